"""`carton.load_unpacked` / `Model` against real runner processes (the test runners in runtime_test_runners.py)."""

from __future__ import annotations

import asyncio
import gc
import os
import select
import signal
import threading
import time
import warnings
from pathlib import Path

import carton
import numpy as np
import pytest
from carton._runtime import Model, RunnerLimits, RunnerProcess
from carton._workflows import load_unpacked
from carton.errors import (
    InvalidInput,
    InvalidOutput,
    InvalidVersionReq,
    ModelClosed,
    NoCompatibleRunner,
    RunnerCrashed,
    RunnerStartError,
    RunnerTimeout,
    RunnerWarning,
    SandboxConfigError,
)
from carton_protocol import DType, TensorSpec

from .runtime_test_runners import CRASH, SLEEP, STARTED_OPT, WRONG

pytestmark = pytest.mark.usefixtures("runtime_plugin")

INPUTS = (TensorSpec(name="x", dtype=DType.FLOAT32, shape=("batch", "n")),)
OUTPUTS = (
    TensorSpec(name="y", dtype=DType.FLOAT32, shape=("batch", "n")),
    TensorSpec(name="pid", dtype=DType.INT64, shape=()),
)


def load_affine(folder: Path, **kwargs: object) -> Model:
    options: dict[str, object] = {"runner_name": "affine", "required_framework_version": "^1",
                                  "inputs": INPUTS, "outputs": OUTPUTS}
    options.update(kwargs)
    return load_unpacked(folder, **options)  # type: ignore[arg-type]


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # a zombie still answers kill(0); it is gone if its state says so
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except (FileNotFoundError, ProcessLookupError):  # reaped between the two checks
        return True


def special(value: float, extra: float = 0.0) -> np.ndarray:
    return np.array([[value, extra]], np.float32)


def test_infer_dict_and_positional(affine_dir: Path) -> None:
    with load_affine(affine_dir, runner_opts={"scale": 3.0}) as model:
        x = np.arange(6, dtype=np.float32).reshape(2, 3)
        out = model.infer({"x": x})
        np.testing.assert_array_equal(out["y"], x * 3 + 0.5)
        assert out["y"].dtype == np.float32 and out["pid"].shape == ()
        np.testing.assert_array_equal(model.infer([x])["y"], out["y"])
        assert model.runner.framework_version == "1.1.0"  # the highest version matching ^1
        assert model.info.runner.runner_compat_version == 1
        assert model.info.inputs == INPUTS
        assert dict(model.runner_opts) == {"scale": 3.0}


def test_compat_version_pins_the_runner(affine_dir: Path) -> None:
    with load_affine(affine_dir, required_framework_version=">=1", runner_compat_version=2) as model:
        assert model.runner.framework_version == "2.0.0"


def test_runner_warnings_reach_the_host(affine_dir: Path) -> None:
    with pytest.warns(RunnerWarning, match="runner affine: unknown option 'colour'"):
        model = load_affine(affine_dir, runner_opts={"colour": "blue"})
    model.close()


def test_bad_inputs_never_reach_the_runner(affine_dir: Path) -> None:
    with load_affine(affine_dir) as model:
        pid = int(model.infer({"x": np.zeros((1, 2), np.float32)})["pid"])
        with pytest.raises(InvalidInput, match="input 'x' has dtype float64, the model declares float32"):
            model.infer({"x": np.zeros((1, 2))})
        with pytest.raises(InvalidInput, match="unknown input 'z'"):
            model.infer({"x": np.zeros((1, 2), np.float32), "z": np.zeros(1)})
        with pytest.raises(InvalidInput, match="missing input 'x'"):
            model.infer({})
        with pytest.raises(InvalidInput, match=r"input 'x' has shape \(2,\), the model declares 2 dimension"):
            model.infer([np.zeros(2, np.float32)])
        assert int(model.infer({"x": np.zeros((1, 2), np.float32)})["pid"]) == pid


def test_invalid_output(affine_dir: Path) -> None:
    with load_affine(affine_dir) as model:
        with pytest.raises(InvalidOutput, match="output 'y' has dtype float64, the model declares float32"):
            model.infer({"x": special(WRONG)})
        model.infer({"x": special(1.0)})


def test_crash_fails_in_flight_calls_and_the_next_call_restarts(affine_dir: Path, tmp_path: Path) -> None:
    started = tmp_path / "started"
    with load_affine(affine_dir, runner_opts={STARTED_OPT: str(started)}) as model:
        first_pid = int(model.infer({"x": special(1.0)})["pid"])
        # A 10 ms call: the runner then hands the next calls to its pool, so both below are in flight together
        # (after short calls it would run the slow one on its socket thread and read the crash request afterwards).
        model.infer({"x": special(SLEEP, 0.01)})
        results: list[BaseException | None] = []

        def slow_call() -> None:
            try:
                model.infer({"x": special(SLEEP, 30.0)})
                results.append(None)
            except BaseException as exc:
                results.append(exc)

        started.unlink()  # touched by the 10 ms call
        waiter = threading.Thread(target=slow_call)
        waiter.start()
        deadline = time.monotonic() + 30
        while not started.exists():  # the slow call is in the runner (its thread runs when the machine lets it)
            assert time.monotonic() < deadline, "the slow call never reached the runner"
            time.sleep(0.01)
        with pytest.raises(RunnerCrashed, match="SIGSEGV"):
            model.infer({"x": special(CRASH)})
        waiter.join(timeout=10)
        assert not waiter.is_alive()
        assert isinstance(results[0], RunnerCrashed)  # the other request in flight failed too
        assert gone(first_pid)
        second_pid = int(model.infer({"x": special(1.0)})["pid"])
        assert second_pid != first_pid


def test_a_runner_killed_between_calls_is_restarted_by_the_next_call(affine_dir: Path) -> None:
    """No call is in flight when the runner dies: the model notices on its next call (the liveness check reads the
    pidfd) and restarts it instead of failing that call."""
    with load_affine(affine_dir) as model:
        process = model._workers[0].process
        assert process is not None and process.runner_pid is not None
        first_pid = int(model.infer({"x": special(1.0)})["pid"])
        os.kill(process.pid, signal.SIGKILL)  # the supervisor: its runner gets its parent-death signal
        deadline = time.monotonic() + 10
        while process.alive and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not process.alive
        assert process.returncode == -signal.SIGKILL
        second_pid = int(model.infer({"x": special(1.0)})["pid"])
        assert second_pid != first_pid
        assert model._workers[0].process is not process


def _wait_exited(process: RunnerProcess) -> None:
    """Block (without yielding to an event loop) until `process`'s pidfd says it exited."""
    pidfd = process._resources.pidfd
    assert pidfd is not None
    assert select.select([pidfd], [], [], 10)[0], "the killed runner did not exit"


def test_an_async_call_after_the_runner_died_restarts_it(affine_dir: Path) -> None:
    """`infer_async` has no liveness check of its own: its send reads the runner's pidfd in the poll it makes before
    sending. Right before a call (the runner has exited and the loop has not run since, so its watch on the pidfd has
    not fired) and between calls (the loop saw the exit and closed its channel), the call restarts the runner and is
    answered by the new one."""
    with load_affine(affine_dir) as model:

        async def main() -> None:
            x = {"x": special(1.0)}
            first = int((await model.infer_async(x))["pid"])
            process = model._workers[0].process
            assert process is not None
            os.kill(process.pid, signal.SIGKILL)  # the supervisor: its runner gets its parent-death signal
            _wait_exited(process)  # no await between the exit and the call
            second = int((await model.infer_async(x))["pid"])
            assert second != first
            assert model._workers[0].process is not process
            process = model._workers[0].process
            assert process is not None
            os.kill(process.pid, signal.SIGKILL)
            _wait_exited(process)
            await asyncio.sleep(0.2)  # the loop's watch fires and closes the channel
            third = int((await model.infer_async(x))["pid"])
            assert third not in (first, second)

        asyncio.run(main())


def test_an_async_call_whose_runner_dies_under_it_fails_and_is_not_sent_again(affine_dir: Path) -> None:
    """A runner that exits once the request is sent may have read it: the call fails with `RunnerCrashed` and its
    request goes to no other runner (the model keeps the dead process until the next call restarts it)."""
    with load_affine(affine_dir) as model:

        async def main() -> None:
            await model.infer_async({"x": special(1.0)})
            process = model._workers[0].process
            assert process is not None
            slow = asyncio.ensure_future(model.infer_async({"x": special(SLEEP, 30.0)}))
            await asyncio.sleep(0.3)
            os.kill(process.pid, signal.SIGKILL)
            with pytest.raises(RunnerCrashed):
                await slow
            assert model._workers[0].process is process
            await model.infer_async({"x": special(1.0)})  # the next call restarts it
            process = model._workers[0].process
            assert process is not None
            with pytest.raises(RunnerCrashed, match="SIGSEGV"):
                await model.infer_async({"x": special(CRASH)})
            assert model._workers[0].process is process  # sent once: no restart made for it

        asyncio.run(main())


def test_threads_share_a_model(affine_dir: Path) -> None:
    with load_affine(affine_dir) as model:
        failures: list[str] = []

        def client(seed: int) -> None:
            for i in range(25):
                x = np.full((1, 4), seed * 100 + i, np.float32)
                y = model.infer({"x": x})["y"]
                if not np.array_equal(y, x + 0.5):
                    failures.append(f"thread {seed} call {i}: {y}")

        threads = [threading.Thread(target=client, args=(seed,)) for seed in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert failures == []


def test_workers_dispatch_to_the_least_busy(affine_dir: Path) -> None:
    with load_affine(affine_dir, runner_name="affine-serial", workers=2) as model:
        assert model.workers == 2
        pids: list[int] = []
        busy = threading.Thread(target=lambda: pids.append(int(model.infer({"x": special(SLEEP, 1.0)})["pid"])))
        busy.start()
        # Until the busy call holds its worker (the thread runs when the machine lets it).
        deadline = time.monotonic() + 30
        while not any(worker.in_flight for worker in model._workers):
            assert time.monotonic() < deadline, "the busy call never reached a worker"
            time.sleep(0.01)
        free_pid = int(model.infer({"x": special(1.0)})["pid"])
        busy.join()
        assert pids and pids[0] != free_pid
        # when idle, calls go to the first worker
        assert int(model.infer({"x": special(1.0)})["pid"]) == int(model.infer({"x": special(2.0)})["pid"])


def test_infer_async(affine_dir: Path) -> None:
    with load_affine(affine_dir, workers=2) as model:
        async def main() -> list[dict[str, object]]:
            return await asyncio.gather(*(model.infer_async({"x": np.full((1, 2), i, np.float32)}) for i in range(6)))

        results = asyncio.run(main())
        for i, out in enumerate(results):
            np.testing.assert_array_equal(out["y"], np.full((1, 2), i + 0.5, np.float32))

        async def bad() -> None:
            await model.infer_async({"x": np.zeros((1, 2), np.int32)})

        with pytest.raises(InvalidInput):
            asyncio.run(bad())


def test_close_is_idempotent_and_ends_the_processes(affine_dir: Path) -> None:
    model = load_affine(affine_dir, workers=2)
    pids = [w.process.pid for w in model._workers if w.process is not None]
    assert len(pids) == 2
    model.close()
    model.close()
    assert model.closed
    assert all(gone(pid) for pid in pids)
    with pytest.raises(ModelClosed):
        model.infer({"x": special(1.0)})


def test_close_fails_calls_in_flight(affine_dir: Path) -> None:
    model = load_affine(affine_dir)
    errors: list[BaseException] = []

    def call() -> None:
        try:
            model.infer({"x": special(SLEEP, 30.0)})
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=call)
    thread.start()
    time.sleep(0.3)
    began = time.monotonic()
    model.close(timeout=0.5)  # the runner is busy for 30 s: it is killed after the grace period
    assert time.monotonic() - began < 5
    thread.join(timeout=10)
    assert not thread.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], ModelClosed)


def test_garbage_collection_ends_the_process(affine_dir: Path) -> None:
    model = load_affine(affine_dir)
    process = model._workers[0].process
    assert process is not None
    pid = process.pid
    del model, process
    gc.collect()
    deadline = time.monotonic() + 5
    while not gone(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gone(pid)


def test_load_failure_is_reported_and_leaves_nothing(affine_dir: Path) -> None:
    with pytest.raises(RunnerStartError, match="refusing to load: fail_load is set"):
        load_affine(affine_dir, runner_opts={"fail_load": True}, workers=2)
    (affine_dir / "offset.txt").unlink()
    with pytest.raises(RunnerStartError, match=r"offset\.txt"):
        load_affine(affine_dir)


def test_resolution_errors(affine_dir: Path) -> None:
    with pytest.raises(NoCompatibleRunner,
                       match=r"affine 1\.1\.0 \(compat 1, plugin runtime-tests\): framework version"):
        load_affine(affine_dir, required_framework_version="^3")
    with pytest.raises(InvalidVersionReq, match=r"load_unpacked\(required_framework_version=...\): invalid version"):
        load_affine(affine_dir, required_framework_version="one")
    with pytest.raises(carton.FormatError, match="does not exist"):
        load_affine(affine_dir / "missing")
    with pytest.raises(ValueError, match="workers must be a positive int"):
        load_affine(affine_dir, workers=0)


def test_sandbox_and_limits(affine_dir: Path) -> None:
    with pytest.raises(SandboxConfigError, match="unknown sandbox policy 'tight'"):
        load_affine(affine_dir, sandbox="tight")
    # resource limits are applied by the sandbox layer's exec shim, even under sandbox="none"
    with load_affine(affine_dir, limits=RunnerLimits(memory_bytes=3 << 30)) as model:
        model.infer({"x": special(1.0)})
        assert model._workers[0].process is not None
        assert model._workers[0].process.plan.limits == {"memory_bytes": float(3 << 30)}
    with pytest.raises(ValueError, match=r"RunnerLimits\.cpu_seconds must be a positive number"):
        RunnerLimits(cpu_seconds=-1)
    # the per-request wall-time limit needs no sandbox
    with load_affine(affine_dir, sandbox="none", limits=RunnerLimits(request_seconds=0.5)) as model:
        with pytest.raises(RunnerTimeout, match=r"0\.5 s"):
            model.infer({"x": special(SLEEP, 30.0)})
        model.infer({"x": special(1.0)})  # restarted
        with pytest.raises(RunnerTimeout):
            model.infer({"x": special(SLEEP, 30.0)}, timeout=0.2)


def test_strings_and_nested_through_a_model(tmp_path: Path) -> None:
    inputs = (TensorSpec(name="s", dtype=DType.STRING, shape=("n",)),
              TensorSpec(name="ragged", dtype=DType.INT32, shape=("count", "*")))
    outputs = (TensorSpec(name="s", dtype=DType.STRING, shape=("n",)),
               TensorSpec(name="ragged", dtype=DType.INT32, shape=("count", "*")))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RunnerWarning)
        model = load_unpacked(tmp_path, runner_name="passthrough", required_framework_version="*",
                              inputs=inputs, outputs=outputs)
    with model:
        strings = np.array(["héllo", "", "a longer string ✓"])
        ragged = [np.arange(3, dtype=np.int32), np.arange(0, dtype=np.int32), np.arange(5, dtype=np.int32)]
        out = model.infer({"s": strings, "ragged": ragged})
        assert out["s"].dtype.kind == "U"
        np.testing.assert_array_equal(out["s"], strings)
        assert isinstance(out["ragged"], list) and len(out["ragged"]) == 3
        for got, want in zip(out["ragged"], ragged, strict=True):
            np.testing.assert_array_equal(got, want)
        with pytest.raises(InvalidInput, match="input 's' has dtype bytes"):
            model.infer({"s": np.array([b"x"]), "ragged": ragged})
