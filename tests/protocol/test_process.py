"""RunnerProcess against real runner processes: the happy path, every failure mode, and no orphans."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import carton
import numpy as np
import pytest
from carton._runtime import _process
from carton._runtime._launch import LaunchPlan
from carton._runtime._process import RunnerProcess
from carton_protocol import PROTOCOL_VERSION, DType, ErrorReply, RemoteError, TensorSpec
from carton_protocol._loop import INLINE_MAX_ENV

from .conftest import HERE, TEST_ENV, make_spec

Start = Callable[..., RunnerProcess]


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            state = handle.read().rsplit(b")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != b"Z"


def parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat", "rb") as handle:
        return int(handle.read().rsplit(b")", 1)[1].split()[1])


def wait_dead(pids: list[int], timeout: float = 5.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = [pid for pid in pids if pid_alive(pid)]
        if not alive:
            return []
        time.sleep(0.02)
    return [pid for pid in pids if pid_alive(pid)]


# --- the happy path -----------------------------------------------------------------------------------------------
def test_start_load_infer_close(start_runner: Start) -> None:
    runner = start_runner("Echo", opts={"prefix": "out_"})
    # `pid` is the process the host started (the supervisor), `runner_pid` the runner it forked (hello's pid).
    assert runner.alive and runner.runner_pid is not None and runner.runner_pid != runner.pid
    assert parent_of(runner.runner_pid) == runner.pid
    tensors = {
        "x": np.arange(16, dtype=np.float32).reshape(1, 16),
        "text": np.array(["héllo", ""]),
        "flag": np.array(True),
        "empty": np.zeros((0, 3), dtype=np.int64),
        "nested": [np.ones(2, dtype=np.float64), np.array(["a", "b"])],
    }
    out = runner.infer(tensors)
    assert sorted(out) == sorted(f"out_{name}" for name in tensors)
    np.testing.assert_array_equal(out["out_x"], tensors["x"])
    assert out["out_text"].tolist() == ["héllo", ""] and out["out_text"].dtype.kind == "U"
    assert out["out_flag"].shape == () and bool(out["out_flag"]) is True
    assert out["out_empty"].shape == (0, 3)
    nested = out["out_nested"]
    assert isinstance(nested, list) and nested[1].tolist() == ["a", "b"]
    out["out_x"][0, 0] = 42  # outputs belong to the caller
    runtime_dir = runner.plan.runtime_dir
    assert runtime_dir.is_dir() and (runtime_dir.stat().st_mode & 0o777) == 0o700
    runner.close()
    runner.close()  # idempotent
    assert not runner.alive and runner.returncode == 0
    assert not runtime_dir.exists()
    with pytest.raises(carton.ModelClosed, match="is closed; cannot infer"):
        runner.infer(tensors)


def test_load_passes_specs_and_warnings_arrive_as_runner_warnings(start_runner: Start) -> None:
    runner = start_runner("Echo", load=False)
    specs = (TensorSpec(name="x", dtype=DType.FLOAT32, shape=("batch", 16)),)
    with pytest.warns(carton.RunnerWarning, match="runner test: unknown option 'threads'"):
        runner.load(model_dir=HERE, opts={"prefix": "", "threads": 2}, inputs=specs, outputs=specs)
    assert runner.infer({"x": np.zeros((2, 16), np.float32)})["x"].shape == (2, 16)


def test_pack_runs_in_the_runner(start_runner: Start, tmp_path: Path) -> None:
    runner = start_runner("Echo", load=False)
    with pytest.warns(carton.RunnerWarning, match="pack warning"):
        result = runner.pack(model_dir=tmp_path, opts={"a": 1}, inputs=(), outputs=())
    assert (tmp_path / "packed.txt").read_text() == "packed"
    assert result.inputs == (TensorSpec(name="x", dtype=DType.FLOAT32, shape=(1, "n")),)
    assert dict(result.opts) == {"a": 1, "packed": True}
    with pytest.raises(carton.RunnerFailed, match=r"failed to pack .*ValueError: the model folder has no model"):
        runner.pack(model_dir=tmp_path, opts={"fail": True}, inputs=(), outputs=())


def test_async_infer(start_runner: Start) -> None:
    runner = start_runner("Echo")

    async def main() -> list[dict[str, Any]]:
        calls = [runner.infer_async({"x": np.full(3, i, np.int32)}) for i in range(6)]
        return list(await asyncio.gather(*calls))

    results = asyncio.run(main())
    assert [int(result["x"][0]) for result in results] == list(range(6))


def test_async_calls_are_not_capped_by_the_default_executor(start_runner: Start) -> None:
    runner = start_runner("ConcurrentEcho", threads=16)
    # A 10 ms call first: after it the runner hands calls to its pool at once (none runs on its socket thread).
    runner.infer({"sleep": np.array([0.01])})

    async def main() -> float:
        begin = time.monotonic()
        calls = [runner.infer_async({"sleep": np.array([0.5]), "i": np.array([i])}) for i in range(16)]
        results = await asyncio.gather(*calls)
        assert sorted(int(result["i"][0]) for result in results) == list(range(16))
        return time.monotonic() - begin

    # 16 calls of 0.5 s: all in flight at once takes ~0.5 s; the default executor (6 threads here) would take 1.5 s.
    assert asyncio.run(main()) < 1.2


def test_concurrent_runner_runs_short_calls_on_its_socket_thread(start_runner: Start) -> None:
    # Short calls run where the request was read (no pool hand-off); the call after a long one goes to the pool;
    # short calls come back to the socket thread afterwards. A 50 ms bound, far from both kinds of call, so that a
    # loaded machine cannot make a "short" call long.
    runner = start_runner("ConcurrentEcho", threads=4, extra_env={**TEST_ENV, INLINE_MAX_ENV: "0.05"})

    def inline(sleep: float) -> bool:
        return bool(runner.infer({"sleep": np.array([sleep]), "x": np.ones(2)})["inline"][0])

    assert [inline(0.0), inline(0.0)] == [True, True]
    assert inline(0.3)  # chosen before its length is known: still inline
    assert not inline(0.0)  # after a long call: the pool
    assert [inline(0.0), inline(0.0)] == [True, True]


def test_inline_bound_zero_sends_every_call_to_the_pool(start_runner: Start) -> None:
    runner = start_runner("ConcurrentEcho", threads=4, extra_env={**TEST_ENV, INLINE_MAX_ENV: "0"})
    assert not any(bool(runner.infer({"x": np.ones(2)})["inline"][0]) for _ in range(5))


def test_concurrent_runner_overlaps_calls_after_a_short_one(start_runner: Start) -> None:
    # Head-of-line delay is bounded by one call: the first of four overlapping 0.4 s calls, arriving at a runner
    # whose calls were short, may run inline; the three that arrive meanwhile then run together on the pool.
    runner = start_runner("ConcurrentEcho", threads=4)
    runner.infer({"x": np.ones(2)})
    assert_four_calls_overlap(lambda: runner.infer({"sleep": np.array([0.4]), "x": np.ones(2)}))


def assert_four_calls_overlap(call: Callable[[], object]) -> None:
    """Make four `call`s of 0.4 s at once, from four threads: they must not have run one after another."""
    results: list[float] = []

    def timed() -> None:
        call()
        results.append(time.monotonic())

    begin = time.monotonic()
    threads = [threading.Thread(target=timed) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results) == 4
    # Serial would be 1.6 s; one inline call and then the rest together is about 0.8 s.
    assert max(results) - begin < 1.3


# --- shared memory ------------------------------------------------------------------------------------------------
def test_large_tensors_travel_in_shared_memory_and_outputs_stay_valid(start_runner: Start) -> None:
    runner = start_runner("Negate")
    first_in = np.random.default_rng(0).random((1024, 1024), dtype=np.float32)  # 4 MiB, over the threshold
    first = runner.infer({"x": first_in, "small": np.ones(3)})
    for seed in range(1, 4):  # the runner reuses its segment: earlier outputs must not change
        again = np.random.default_rng(seed).random((1024, 1024), dtype=np.float32)
        np.testing.assert_array_equal(runner.infer({"x": again})["x"], -again)
    np.testing.assert_array_equal(first["x"], -first_in)
    np.testing.assert_array_equal(first["small"], -np.ones(3))
    assert first["x"].flags.writeable and first["x"].flags.owndata
    several = {f"t{i}": np.full((300, 1000), i, np.float64) for i in range(3)}
    out = runner.infer(several)
    for i in range(3):
        np.testing.assert_array_equal(out[f"t{i}"], -several[f"t{i}"])


def test_large_tensors_from_many_threads_on_a_concurrent_runner(start_runner: Start) -> None:
    runner = start_runner("ConcurrentEcho")
    failures: list[str] = []

    def work(index: int) -> None:
        for call in range(6):
            value = np.full((256, 1024), index * 100 + call, np.float32)  # 1 MiB each way, in shared memory
            out = runner.infer({"v": value, "sleep": np.array([0.001])})
            if not np.array_equal(out["v"], value):
                failures.append(f"thread {index} call {call}")

    threads = [threading.Thread(target=work, args=(i,)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []


def test_no_shared_memory_still_carries_large_tensors(start_runner: Start) -> None:
    runner = start_runner("Negate", shm_threshold=None)
    x = np.arange(1 << 20, dtype=np.int64)
    np.testing.assert_array_equal(runner.infer({"x": x})["x"], -x)


def test_large_strings_and_shared_memory_threshold_edge(start_runner: Start) -> None:
    runner = start_runner("Echo", shm_threshold=64)
    text = np.array([str(i) * 10 for i in range(1000)])
    at_threshold = np.zeros(16, np.float32)  # exactly 64 bytes: shared memory
    under = np.zeros(15, np.float32)
    out = runner.infer({"text": text, "at": at_threshold, "under": under})
    assert out["text"].tolist() == text.tolist()
    assert out["at"].shape == (16,) and out["under"].shape == (15,)


# --- failures from the runner's code ------------------------------------------------------------------------------
def test_load_failure_is_runner_start_error_with_the_remote_traceback(start_runner: Start) -> None:
    runner = start_runner("Fail", load=False)
    with pytest.raises(carton.RunnerStartError, match=r"failed to load .*FileNotFoundError: no model\.bin") as info:
        runner.load(model_dir=HERE, opts={"fail_load": True}, inputs=(), outputs=())
    cause = info.value.__cause__
    assert isinstance(cause, RemoteError) and cause.exception == "FileNotFoundError" and cause.code == "internal"
    assert info.value.remote_kind == "internal" and info.value.remote_message == f"no model.bin in {HERE}"
    assert "runners_for_tests.py" in cause.traceback


def test_infer_failure_is_runner_failed_and_the_runner_survives(start_runner: Start) -> None:
    runner = start_runner("Fail")
    for _ in range(2):
        with pytest.raises(carton.RunnerFailed, match="ValueError: the model cannot handle this input"):
            runner.infer({"x": np.zeros(1)})
    assert runner.alive


def test_outputs_the_wire_cannot_carry_are_invalid_output(start_runner: Start) -> None:
    runner = start_runner("BadOutput")
    with pytest.raises(carton.InvalidOutput, match="'z': numpy dtype complex64 has no wire type"):
        runner.infer({"x": np.zeros(1)})
    with pytest.raises(carton.InvalidOutput, match="returned a list, expected a mapping"):
        runner.infer({"not_a_mapping": np.zeros(1)})
    assert runner.alive


def test_inputs_the_wire_cannot_carry_are_invalid_input(start_runner: Start) -> None:
    runner = start_runner("Echo")
    with pytest.raises(carton.InvalidInput, match="'bad': numpy dtype complex128 has no wire type"):
        runner.infer({"bad": np.zeros(2, complex)})
    with pytest.raises(carton.InvalidInput, match="'words': string tensors must hold str, not bytes"):
        runner.infer({"words": np.array([b"x"], dtype=object)})


def test_a_request_in_a_learnt_layout_is_still_checked_against_its_data(start_runner: Start) -> None:
    """The runner reads a request whose header bytes it accepted before through the header template's plan, without
    decoding the message: the checks that depend on the data still run, the error names the tensor and goes back
    with the request's id, and the runner goes on serving."""
    runner = start_runner("Echo")
    x = np.arange(2, dtype=np.float32)
    assert runner.infer({"x": x})["x"].tolist() == [0, 1]  # the runner learns the layout
    connection = runner._resources.connection
    assert connection is not None
    for data, message in (
        ([b"\0" * 4], "tensor 'x': data frame is 4 bytes, header says 8"),
        ([], "message has 0 data frames, the header accounts for 1"),
    ):
        outgoing = connection.codec.encode_tensors(connection.next_id(), {"x": x})
        received = connection.exchange([outgoing.parts[0], *data], outgoing.id, timeout=5)
        reply = received.message
        assert isinstance(reply, ErrorReply) and reply.id == outgoing.id
        assert reply.code == "protocol" and message in reply.message
    assert runner.infer({"x": x})["x"].tolist() == [0, 1]


def test_infer_before_load_is_a_protocol_error(start_runner: Start) -> None:
    runner = start_runner("Echo", load=False)
    with pytest.raises(carton.RunnerProtocolError, match="infer before load"):
        runner.infer({"x": np.zeros(1)})


# --- crashes and timeouts -----------------------------------------------------------------------------------------
def test_segfault_mid_request_is_runner_crashed_naming_the_signal(start_runner: Start) -> None:
    runner = start_runner("Crash")
    begin = time.monotonic()
    with pytest.raises(carton.RunnerCrashed, match=r"was killed by SIGSEGV during infer") as info:
        runner.infer({"x": np.zeros(1)})
    assert time.monotonic() - begin < 1.0
    assert "about to segfault" in str(info.value)  # the runner's log tail
    assert "Fatal Python error" in str(info.value)  # faulthandler's report
    assert not runner.alive
    with pytest.raises(carton.RunnerCrashed, match="SIGSEGV"):
        runner.infer({"x": np.zeros(1)})


def test_exit_mid_request_names_the_status(start_runner: Start) -> None:
    runner = start_runner("Crash")
    with pytest.raises(carton.RunnerCrashed, match="exited with status 7 during infer"):
        runner.infer({"exit_code": np.array([7])})


def test_every_call_in_flight_fails_within_a_second_when_the_runner_dies(start_runner: Start) -> None:
    runner = start_runner("Sleep")
    errors: list[BaseException] = []

    def call() -> None:
        try:
            runner.infer({"seconds": np.array([30.0])})
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=call) for _ in range(3)]
    for thread in threads:
        thread.start()
    time.sleep(0.3)
    killed = time.monotonic()
    assert runner.runner_pid is not None
    os.kill(runner.runner_pid, signal.SIGSEGV)  # the runner itself dies; its supervisor re-raises the signal
    for thread in threads:
        thread.join(5)
    assert time.monotonic() - killed < 1.0
    assert len(errors) == 3
    assert all(isinstance(exc, carton.RunnerCrashed) and "SIGSEGV" in str(exc) for exc in errors)


def test_infer_timeout_kills_the_runner(start_runner: Start) -> None:
    runner = start_runner("Sleep")
    begin = time.monotonic()
    with pytest.raises(carton.RunnerTimeout, match=r"did not answer infer within 0.5 s \(infer timeout\)"):
        runner.infer({"seconds": np.array([60.0])}, timeout=0.5)
    assert time.monotonic() - begin < 3
    assert wait_dead([runner.pid]) == []
    assert not runner.alive


def test_a_runner_that_never_answers_the_handshake_is_killed(tmp_path: Path) -> None:
    plans: list[LaunchPlan] = []

    def remember(plan: LaunchPlan) -> LaunchPlan:
        plans.append(plan)
        return plan

    begin = time.monotonic()
    with pytest.raises(carton.RunnerTimeout, match=r"did not complete the handshake within 1 s \(handshake_timeout\)"):
        RunnerProcess.start(make_spec("never_answer:Runner"), extra_env=TEST_ENV, handshake_timeout=1, wrap=remember)
    assert time.monotonic() - begin < 4
    assert not plans[0].runtime_dir.exists()


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ("runners_for_tests:Missing", "AttributeError: module 'runners_for_tests' has no attribute 'Missing'"),
        ("no_such_module_anywhere:Runner", "ModuleNotFoundError: No module named 'no_such_module_anywhere'"),
        ("runners_for_tests:pid_alive_not_here", "AttributeError"),
        ("runners_for_tests:TensorSpec", "is not a carton_protocol.Runner subclass"),
        ("runners_for_tests", "must look like 'module:Class'"),
    ],
)
def test_a_bad_entry_is_runner_start_error(entry: str, message: str) -> None:
    with pytest.raises(carton.RunnerStartError, match=message):
        RunnerProcess.start(make_spec(entry), extra_env=TEST_ENV)


def test_an_interpreter_that_does_not_exist_is_runner_start_error() -> None:
    spec = replace(make_spec("runners_for_tests:Echo"), python="/nonexistent/python3")
    with pytest.raises(carton.RunnerStartError, match=r"cannot start runner .*/nonexistent/python3"):
        RunnerProcess.start(spec)


def test_a_runner_that_exits_before_the_handshake_is_runner_start_error() -> None:
    def crash_at_once(plan: LaunchPlan) -> LaunchPlan:
        script = "import sys; print('broken environment', file=sys.stderr); sys.exit(5)"
        return replace(plan, argv=(sys.executable, "-c", script))

    with pytest.raises(carton.RunnerStartError, match=r"(?s)exited with status 5 before .*broken environment"):
        RunnerProcess.start(make_spec("runners_for_tests:Echo"), wrap=crash_at_once)


# --- protocol versions --------------------------------------------------------------------------------------------
def test_a_runner_speaking_another_version_is_refused_on_both_sides() -> None:
    plans: list[LaunchPlan] = []

    def older(plan: LaunchPlan) -> LaunchPlan:
        assert plan.argv[1:3] == ("-m", "carton_protocol")
        plans.append(plan)
        return replace(plan, argv=(plan.argv[0], str(HERE / "other_version_runner.py"), *plan.argv[3:]))

    with pytest.raises(carton.ProtocolMismatch, match=rf"host speaks carton protocol {PROTOCOL_VERSION}, runner .* 99"):
        RunnerProcess.start(make_spec("runners_for_tests:Echo"), extra_env=TEST_ENV, wrap=older)


def test_a_host_speaking_another_version_is_refused_on_both_sides(monkeypatch: pytest.MonkeyPatch) -> None:
    import carton_protocol._codec as codec

    monkeypatch.setattr(codec, "PROTOCOL_VERSION", 99)  # what the host's hello says
    monkeypatch.setattr(_process, "PROTOCOL_VERSION", 99)  # what the host checks the reply against
    logs: list[Path] = []

    def remember(plan: LaunchPlan) -> LaunchPlan:
        logs.append(plan.log_path)
        return plan

    original = _process._Resources.release
    captured: list[str] = []

    def keep_log(self: Any) -> None:  # read the runner's side of the story before the directory goes
        self.kill()
        captured.append(logs[0].read_text() if logs and logs[0].exists() else "")
        captured.append(str(self.process.returncode))
        original(self)

    monkeypatch.setattr(_process._Resources, "release", keep_log)
    with pytest.raises(carton.ProtocolMismatch, match=rf"host speaks carton protocol 99, runner .* {PROTOCOL_VERSION}"):
        RunnerProcess.start(make_spec("runners_for_tests:Echo"), extra_env=TEST_ENV, wrap=remember)
    runner_says = f"host speaks carton protocol 99, this runner (runners_for_tests:Echo) speaks {PROTOCOL_VERSION}"
    assert runner_says in captured[0]
    assert captured[1] == "3"


# --- concurrency --------------------------------------------------------------------------------------------------
def test_many_threads_each_get_their_own_answers(start_runner: Start) -> None:
    runner = start_runner("Echo")
    failures: list[str] = []

    def work(index: int) -> None:
        for call in range(40):
            value = np.full((2, 3), index * 1000 + call, np.int64)
            text = np.array([f"{index}-{call}"])
            out = runner.infer({"v": value, "t": text})
            if not (np.array_equal(out["v"], value) and out["t"].tolist() == text.tolist()):
                failures.append(f"thread {index} call {call}")

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []


def test_a_concurrent_runner_serves_requests_in_parallel(start_runner: Start) -> None:
    runner = start_runner("ConcurrentEcho")
    assert runner.concurrent
    results: list[dict[str, Any]] = []

    def call(index: int) -> None:
        results.append(runner.infer({"sleep": np.array([0.4]), "i": np.array([index])}))

    begin = time.monotonic()
    threads = [threading.Thread(target=call, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.monotonic() - begin
    assert sorted(int(result["i"][0]) for result in results) == [0, 1, 2, 3]
    assert len({int(result["thread"][0]) for result in results}) > 1
    assert elapsed < 1.2  # four 0.4 s calls one after another would take 1.6 s


# --- closing, and no orphans --------------------------------------------------------------------------------------
def test_close_during_a_call_gives_model_closed(start_runner: Start) -> None:
    runner = start_runner("Sleep")
    errors: list[BaseException] = []

    def call() -> None:
        try:
            runner.infer({"seconds": np.array([30.0])})
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=call)
    thread.start()
    time.sleep(0.3)
    begin = time.monotonic()
    runner.close(timeout=0.5)
    thread.join(5)
    assert time.monotonic() - begin < 3
    assert len(errors) == 1 and isinstance(errors[0], carton.ModelClosed)


def test_a_runner_that_ignores_close_is_killed(start_runner: Start) -> None:
    runner = start_runner("IgnoreClose")
    begin = time.monotonic()
    runner.close(timeout=0.5)
    assert time.monotonic() - begin < 3
    assert wait_dead([runner.pid]) == []


def _spawned_pids(pid_file: Path, expected: int) -> list[int]:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        pids = [int(line) for line in pid_file.read_text().split()] if pid_file.exists() else []
        if len(pids) >= expected:
            return pids
        time.sleep(0.02)
    raise AssertionError(f"{pid_file} never listed {expected} pids")


def test_close_ends_children_and_setsid_grandchildren(start_runner: Start, tmp_path: Path) -> None:
    pid_file = tmp_path / "pids"
    runner = start_runner("Spawner", opts={"pid_file": str(pid_file)})
    pids = _spawned_pids(pid_file, 2)
    assert all(pid_alive(pid) for pid in pids)
    runner.close()
    assert wait_dead([runner.pid, *pids]) == []


@pytest.mark.parametrize("how", ["SIGSEGV", "SIGKILL"])
def test_a_runner_dying_by_a_signal_leaves_no_setsid_orphan(start_runner: Start, tmp_path: Path, how: str) -> None:
    """The runner cannot clean up after a signal: its supervisor kills the orphan before reporting the death."""
    pid_file = tmp_path / "pids"
    runner = start_runner("OrphanThenCrash", opts={"pid_file": str(pid_file)})
    runner_pid = runner.runner_pid
    assert runner_pid is not None
    begin = time.monotonic()
    with pytest.raises(carton.RunnerCrashed, match=rf"was killed by {how} during infer"):
        runner.infer({"sigkill": np.ones(1)} if how == "SIGKILL" else {"x": np.ones(1)})
    assert time.monotonic() - begin < 1.0
    # Already gone when the crash is reported (the supervisor kills the orphans, then dies of the same signal).
    assert wait_dead([runner_pid, *_spawned_pids(pid_file, 1)], timeout=0.5) == []
    assert runner.returncode == -getattr(signal, how)


def test_the_supervisor_forwards_sigterm_and_leaves_nothing(start_runner: Start, tmp_path: Path) -> None:
    pid_file = tmp_path / "pids"
    runner = start_runner("Spawner", opts={"pid_file": str(pid_file)})
    assert runner.runner_pid is not None
    pids = [runner.pid, runner.runner_pid, *_spawned_pids(pid_file, 2)]
    os.kill(runner.pid, signal.SIGTERM)
    assert wait_dead(pids) == []
    # The runner's own exit status (its SIGTERM handler exits with 128 + 15), passed on by the supervisor.
    assert runner._resources.process.wait(timeout=5) == 128 + signal.SIGTERM


def test_killing_the_supervisor_alone_ends_the_runner_and_its_descendants(start_runner: Start, tmp_path: Path) -> None:
    pid_file = tmp_path / "pids"
    runner = start_runner("Spawner", opts={"pid_file": str(pid_file)})
    assert runner.runner_pid is not None
    pids = [runner.pid, runner.runner_pid, *_spawned_pids(pid_file, 2)]
    os.kill(runner.pid, signal.SIGKILL)  # the runner gets its parent-death signal and kills its own tree
    assert wait_dead(pids) == []
    with pytest.raises(carton.RunnerCrashed, match="SIGKILL"):
        runner.infer({})


def test_the_package_import_is_lazy_and_complete() -> None:
    """``python -m carton_protocol`` forks before numpy is imported: importing the package must not import it."""
    script = (
        "import sys, carton_protocol\n"
        "assert 'numpy' not in sys.modules and 'zmq' not in sys.modules, sorted(sys.modules)\n"
        "missing = [name for name in carton_protocol.__all__ if getattr(carton_protocol, name, None) is None]\n"
        "assert not missing, missing\n"
        "assert set(carton_protocol.__all__) <= set(dir(carton_protocol))\n"
        "try:\n"
        "    carton_protocol.no_such_name\n"
        "except AttributeError as exc:\n"
        "    assert 'no_such_name' in str(exc)\n"
        "else:\n"
        "    raise AssertionError('no AttributeError')\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True, env={**os.environ, "PYTHONPATH": str(HERE)})


def test_garbage_collection_ends_the_runner(tmp_path: Path) -> None:
    runner = RunnerProcess.start(make_spec("runners_for_tests:Echo"), extra_env=TEST_ENV)
    pid, runtime_dir = runner.pid, runner.plan.runtime_dir
    del runner
    gc.collect()
    assert wait_dead([pid]) == []
    assert not runtime_dir.exists()


HOST_SCRIPT = textwrap.dedent(
    """
    import sys, threading, time
    import numpy as np
    sys.path.insert(0, {here!r})
    from conftest import make_spec, TEST_ENV
    from carton._runtime._process import RunnerProcess
    runner = RunnerProcess.start(make_spec("runners_for_tests:Spawner"), extra_env=TEST_ENV)
    runner.load(model_dir={here!r}, opts={{"pid_file": sys.argv[1]}}, inputs=(), outputs=())
    if sys.argv[2] == "wedge":
        threading.Thread(target=runner.infer, args=({{"wedge": np.ones(1)}},), daemon=True).start()
        time.sleep(0.5)
    print(runner.pid, runner.runner_pid, runner.plan.runtime_dir, flush=True)
    if sys.argv[2] != "exit":
        time.sleep(600)
    """
)


@pytest.mark.parametrize("how", ["sigkill", "exit", "wedge"])
def test_host_death_ends_the_runner_and_its_descendants(tmp_path: Path, how: str) -> None:
    """``wedge``: the host is SIGKILLed while the runner is stuck in a C call holding the GIL (its own handlers
    cannot run): its supervisor still kills the whole tree."""
    pid_file = tmp_path / "pids"
    script = tmp_path / "host.py"
    script.write_text(HOST_SCRIPT.format(here=str(HERE)))
    host = subprocess.Popen(
        [sys.executable, str(script), str(pid_file), how],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert host.stdout is not None
    supervisor_pid, runner_pid, runtime_dir = host.stdout.readline().split()
    pids = [int(supervisor_pid), int(runner_pid), *_spawned_pids(pid_file, 2)]
    if how != "exit":
        host.kill()
    host.wait(10)
    assert wait_dead(pids) == []
    if how == "exit":
        assert not Path(runtime_dir).exists()  # the finalizer ran at interpreter exit


def test_runtime_directories_of_dead_hosts_are_swept(start_runner: Start) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(os.environ.get("TMPDIR", "/tmp"))
    stale = base / f"carton-{dead.pid}-stale"
    stale.mkdir(mode=0o700)
    (stale / "runner.log").write_text("left behind")
    sandboxed = base / f"carton-{dead.pid}-sandboxed"  # a sandbox chowns its runtime directory to the runner's uid
    sandboxed.mkdir(mode=0o700)
    if os.getuid() == 0:
        os.chown(sandboxed, 123457, 123457)
    start_runner("Echo", load=False)
    assert not stale.exists()
    assert not sandboxed.exists()


def test_the_runner_gets_a_clean_environment_and_no_host_descriptors(
    start_runner: Start, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("CARTON_TEST_SECRET", "hunter2")
    leaked = (tmp_path / "host-only.txt").open("w")
    os.set_inheritable(leaked.fileno(), True)
    try:
        runner = start_runner("Environment")
        out = runner.infer({})
    finally:
        leaked.close()
    env = dict(item.split("=", 1) for item in out["env"].tolist())
    assert "CARTON_TEST_SECRET" not in env
    assert set(env) <= {"PATH", "LANG", "HOME", "TMPDIR", "PYTHONPATH", "LC_CTYPE"}
    assert env["HOME"] == str(runner.plan.scratch_dir) == out["cwd"][0]
    assert not any("host-only" in target for target in out["fds"].tolist())
    session, pid = out["sid"].tolist()
    # Its own session, led by its supervisor: a process-group kill cannot reach the host.
    assert pid == runner.runner_pid and session == runner.pid != os.getsid(0)


def test_a_forked_child_of_the_host_does_not_end_the_hosts_runner(start_runner: Start) -> None:
    runner = start_runner("Echo")
    child = os.fork()
    if child == 0:  # what the child's exit would do: its inherited finalizer releases the resources
        try:
            runner._resources.release()
        finally:
            os._exit(0)
    os.waitpid(child, 0)
    assert runner.alive and runner.plan.runtime_dir.exists()
    assert runner.infer({"x": np.ones(2)})["x"].tolist() == [1.0, 1.0]
