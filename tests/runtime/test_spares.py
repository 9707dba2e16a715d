"""Spare runner processes (`carton._runtime._spares`) and the runner start overlapped with extraction in `load`."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import textwrap
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import carton
import numpy as np
import pytest
from carton._runtime import RunnerLimits, RunnerProcess, _model, plugin_manager
from carton._runtime._spares import SPARE_RUNNERS_ENV, spare_limit, spare_pool
from carton._workflows import _load
from carton.errors import CartonWarning, FormatError, RunnerStartError
from carton_protocol import RunnerSpec, hookimpl

from .conftest import HERE, runner_spec
from .test_model import INPUTS, OUTPUTS, gone, load_affine

pytestmark = pytest.mark.usefixtures("runtime_plugin")

AFFINE = runner_spec("Affine", version="1.1.0")  # what "^1" resolves to (the highest 1.x), before discovery
PASSTHROUGH = runner_spec("Passthrough", name="passthrough")
X = np.ones((1, 2), dtype=np.float32)


@pytest.fixture(autouse=True)
def _clean_pool(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    # Room for every runner: models of earlier tests may still schedule spares, which must not evict these.
    monkeypatch.setenv(SPARE_RUNNERS_ENV, "16")
    spare_pool().close()
    yield
    spare_pool().close()


def _pid(model: carton.Model) -> int:
    return int(model.infer({"x": X})["pid"])


def _wait_gone(pid: int, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if gone(pid):
            return True
        time.sleep(0.05)
    return False


def _resolved(spec: RunnerSpec) -> RunnerSpec:
    """The spec as discovery returns it (with its ``source``): the pool's key."""
    return carton._runtime.resolve_runner(carton._runtime.RunnerRequest(
        runner_name=spec.runner_name, required_framework_version=f"={spec.framework_version}",
        runner_compat_version=spec.runner_compat_version))


def _spare(spec: RunnerSpec) -> RunnerProcess:
    process = spare_pool().wait(spec, 30)
    assert process is not None and process.alive and process.runner_pid is not None
    return process


def _all_gone(process: RunnerProcess) -> bool:
    """The process the host started and the runner it forked (the pid `infer` reports) both ended."""
    assert process.runner_pid is not None
    return _wait_gone(process.pid) and _wait_gone(process.runner_pid)


def test_the_next_load_takes_the_spare(affine_dir: Path) -> None:
    with load_affine(affine_dir) as first:
        first_pid = _pid(first)  # the first call lets the spare start
        spare_pid = _spare(_resolved(AFFINE)).runner_pid
        assert spare_pid != first_pid
        with load_affine(affine_dir) as second:
            assert _pid(second) == spare_pid
            assert second.runner == first.runner
        # the second load used the spare, and its first call started the next one
        assert _spare(_resolved(AFFINE)).runner_pid not in (first_pid, spare_pid)


def test_the_spare_starts_without_a_call_after_a_delay(affine_dir: Path) -> None:
    with load_affine(affine_dir):
        assert spare_pool().ready(_resolved(AFFINE)) is None or _model.SPARE_START_DELAY == 0
        _spare(_resolved(AFFINE))


def test_a_dead_spare_is_replaced_by_a_fresh_start(affine_dir: Path) -> None:
    with load_affine(affine_dir) as first:
        _pid(first)
        spare = spare_pool().wait(_resolved(AFFINE), 30)
        assert spare is not None
        assert spare.runner_pid is not None
        os.kill(spare.runner_pid, 9)  # the runner dies while idle in the pool
        assert _wait_gone(spare.runner_pid)
        with load_affine(affine_dir) as second:
            assert _pid(second) != spare.runner_pid


def test_zero_disables_spares_and_closes_the_ones_kept(affine_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with load_affine(affine_dir) as first:
        _pid(first)
        kept = _spare(_resolved(AFFINE))
    monkeypatch.setenv(SPARE_RUNNERS_ENV, "0")
    with carton.load_unpacked(affine_dir, runner_name="passthrough", required_framework_version="*") as other:
        other.infer({"x": X})
        assert _all_gone(kept)
        assert spare_pool().wait(_resolved(PASSTHROUGH), 0.5) is None
        assert spare_pool().wait(_resolved(AFFINE), 0.1) is None


def test_the_limit_keeps_the_most_recently_used_runners(affine_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SPARE_RUNNERS_ENV, "1")
    with load_affine(affine_dir) as first:
        _pid(first)
        evicted = _spare(_resolved(AFFINE))
    with carton.load_unpacked(affine_dir, runner_name="passthrough", required_framework_version="*") as other:
        other.infer({"x": X})
        _spare(_resolved(PASSTHROUGH))
        assert _all_gone(evicted)
        assert spare_pool().ready(_resolved(AFFINE)) is None


@pytest.mark.parametrize("value", ["-1", "two"])
def test_a_bad_setting_warns_and_keeps_the_default(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(SPARE_RUNNERS_ENV, value)
    with pytest.warns(CartonWarning, match=f"{SPARE_RUNNERS_ENV}='{value}' is not a count"):
        assert spare_limit() == 2


def test_unwrapped_starts_only_use_spares() -> None:
    assert _load._unsandboxed(None, None)
    assert _load._unsandboxed("none", RunnerLimits(request_seconds=5))
    assert not _load._unsandboxed("strict", None)
    assert not _load._unsandboxed("best_effort", None)
    assert not _load._unsandboxed(None, RunnerLimits(memory_bytes=1 << 30))
    assert not _load._unsandboxed("bogus", None)


def test_spares_end_when_the_interpreter_exits(tmp_path: Path, affine_dir: Path) -> None:
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(HERE.parent)!r})
        import numpy as np
        from carton._runtime import plugin_manager
        from carton._workflows import load_unpacked
        from carton._runtime._spares import spare_pool
        from runtime.conftest import RuntimeTestPlugin
        plugin_manager().register(RuntimeTestPlugin(), name="runtime-tests")
        model = load_unpacked({str(affine_dir)!r}, runner_name="affine", required_framework_version="^1")
        pid = int(model.infer({{"x": np.ones((1, 2), np.float32)}})["pid"])
        spare = spare_pool().wait(model.runner, 30)
        print(pid, spare.pid, spare.runner_pid, flush=True)
    """)
    env = {**os.environ, SPARE_RUNNERS_ENV: "2"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env,
                          check=False)
    assert done.returncode == 0, done.stderr
    pids = [int(value) for value in done.stdout.split()]
    assert len(pids) == 3
    assert all(_wait_gone(pid) for pid in pids)


def test_load_overlaps_the_runner_start_with_extraction(tmp_path: Path, affine_dir: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SPARE_RUNNERS_ENV, "0")
    packed = carton.pack(affine_dir, tmp_path / "affine.carton", runner_name="affine",
                         required_framework_version="^1", inputs=INPUTS, outputs=OUTPUTS)
    started: list[RunnerSpec] = []
    original = _load._start_in_background

    def spy(runner: RunnerSpec, handshake_timeout: float) -> object:
        started.append(runner)
        return original(runner, handshake_timeout)

    monkeypatch.setattr(_load, "_start_in_background", spy)
    with carton.load(packed) as model:
        assert started == [_resolved(AFFINE)]
        assert model.infer({"x": X})["y"].tolist() == [[1.5, 1.5]]
    started.clear()
    with pytest.raises(RunnerStartError), carton.load(packed, runner_opts={"fail_load": True}):
        pass
    assert started == [_resolved(AFFINE)]


def test_a_carton_that_fails_to_open_leaves_no_runner_behind(tmp_path: Path, affine_dir: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SPARE_RUNNERS_ENV, "0")
    monkeypatch.setenv("CARTON_CACHE_DIR", str(tmp_path / "cache"))  # extract (and verify) for real
    packed = carton.pack(affine_dir, tmp_path / "affine.carton", runner_name="affine",
                         required_framework_version="^1", inputs=INPUTS, outputs=OUTPUTS, compression="stored")
    data = bytearray(packed.read_bytes())
    header = data.find(b"model/offset.txt") - 30  # its local file header: the stored bytes follow it
    name_length, extra_length = struct.unpack_from("<HH", data, header + 26)
    where = header + 30 + name_length + extra_length
    assert data[where:where + 3] == b"0.5"
    data[where:where + 3] = b"0.7"  # same size: carton.toml still reads, the MANIFEST hash no longer matches
    packed.write_bytes(bytes(data))
    started: list[object] = []
    original = _load._start_in_background

    def spy(runner: RunnerSpec, handshake_timeout: float) -> object:
        future = original(runner, handshake_timeout)
        started.append(future)
        return future

    monkeypatch.setattr(_load, "_start_in_background", spy)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CartonWarning)
        with pytest.raises(FormatError):
            carton.load(packed)
    assert len(started) == 1  # the runner was starting while the carton was read
    try:
        process, _ = started[0].result(timeout=30)
    except RunnerStartError:
        return  # it never came up: nothing to leak
    assert _all_gone(process)


# --- carton.prestart ----------------------------------------------------------------------------------------------
@pytest.fixture
def affine_carton(tmp_path: Path, affine_dir: Path) -> Path:
    return carton.pack(affine_dir, tmp_path / "affine.carton", runner_name="affine",
                       required_framework_version="^1", inputs=INPUTS, outputs=OUTPUTS)


def test_prestart_starts_the_runner_the_first_load_takes(affine_carton: Path) -> None:
    ready = carton.prestart(affine_carton)
    assert ready.result(timeout=30) is None
    spare = _spare(_resolved(AFFINE))
    assert carton.prestart(affine_carton).result(timeout=30) is None  # a second call keeps the same runner
    assert _spare(_resolved(AFFINE)).runner_pid == spare.runner_pid
    with carton.load(affine_carton) as model:
        assert _pid(model) == spare.runner_pid
        assert model.infer({"x": X})["y"].tolist() == [[1.5, 1.5]]


def test_prestart_applies_the_loads_overrides(affine_carton: Path) -> None:
    overrides = {"override_runner_name": "passthrough", "override_required_framework_version": "*"}
    carton.prestart(affine_carton, **overrides).result(timeout=30)
    spare = _spare(_resolved(PASSTHROUGH))
    assert spare_pool().ready(_resolved(AFFINE)) is None
    with carton.load(affine_carton, **overrides) as model:
        assert spare_pool().ready(_resolved(PASSTHROUGH)) is not spare  # taken out of the pool by this load
        assert model.runner == _resolved(PASSTHROUGH)
        assert spare.alive
    assert _all_gone(spare)  # it was the model's runner


def test_prestart_reports_a_bad_carton_or_requirement_at_once(tmp_path: Path, affine_carton: Path) -> None:
    with pytest.raises(FormatError, match="no such file"):
        carton.prestart(tmp_path / "missing.carton")
    with pytest.raises(carton.NoCompatibleRunner, match="affine"):
        carton.prestart(affine_carton, override_required_framework_version="^9")
    with pytest.raises(carton.InvalidVersionReq, match="the required_framework_version override"):
        carton.prestart(affine_carton, override_required_framework_version="not a requirement")
    assert spare_pool().ready(_resolved(AFFINE)) is None


def test_prestart_with_spares_disabled_warns_and_starts_nothing(affine_carton: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SPARE_RUNNERS_ENV, "0")
    with pytest.warns(CartonWarning, match=f"started nothing: spare runners are disabled \\({SPARE_RUNNERS_ENV}=0\\)"):
        ready = carton.prestart(affine_carton)
    assert ready.done() and ready.result() is None
    assert spare_pool().wait(_resolved(AFFINE), 0.5) is None


class _BrokenRunnerPlugin:
    """A runner whose entry point does not exist: its process exits before the handshake."""

    @hookimpl
    def carton_runners(self) -> list[RunnerSpec]:
        return [runner_spec("NoSuchRunner", name="broken")]


def test_a_prestarted_runner_that_fails_to_start_fails_the_future(affine_carton: Path) -> None:
    plugin = _BrokenRunnerPlugin()
    plugin_manager().register(plugin, name="broken-runner-tests")
    try:
        ready = carton.prestart(affine_carton, override_runner_name="broken", override_required_framework_version="*")
        with pytest.raises(RunnerStartError, match="NoSuchRunner"):
            ready.result(timeout=60)
    finally:
        plugin_manager().unregister(plugin)
