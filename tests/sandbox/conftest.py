"""Fixtures of the sandbox tests: the adversarial plugin, the available backends, models and host-side probes."""

from __future__ import annotations

import logging
import os
import time
import uuid
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import carton
import numpy as np
import pytest
from carton._runtime import plugin_manager
from carton._sandbox import BACKEND_ENV, Backend, machine_support
from carton.errors import CartonWarning, SandboxWarning
from carton_protocol import RunnerSpec, hookimpl

HERE = Path(__file__).resolve().parent
log = logging.getLogger("carton.tests.sandbox")


def _spec(name: str, entry: str) -> RunnerSpec:
    return RunnerSpec(runner_name=name, framework_version="1.0.0", runner_compat_version=1, entry=entry,
                      concurrent=True, env=(("PYTHONPATH", str(HERE)),))


class AdversarialPlugin:
    """Ships ``adversary`` (attacks on request) and ``never-ready`` (never answers the handshake)."""

    @hookimpl
    def carton_runners(self) -> list[RunnerSpec]:
        return [_spec("adversary", "adversarial_runners:Adversary"), _spec("never-ready", "adversarial_hang:Never")]


@pytest.fixture
def adversarial_plugin() -> Iterator[AdversarialPlugin]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CartonWarning)
        manager = plugin_manager()
    plugin = AdversarialPlugin()
    manager.register(plugin, name="sandbox-tests")
    yield plugin
    if manager.is_registered(plugin):
        manager.unregister(plugin)


def _backend_params() -> list[object]:
    support = machine_support()
    params: list[object] = []
    for backend in Backend:
        reason = support.backends[backend]
        if reason is not None:
            log.warning("sandbox backend %s is not available here, its tests are skipped: %s", backend.value, reason)
        marks = [pytest.mark.skip(reason=f"backend {backend.value} unavailable: {reason}")] if reason else []
        params.append(pytest.param(backend, marks=marks, id=backend.value))
    return params


@pytest.fixture(params=_backend_params())
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Backend:
    value: Backend = request.param
    monkeypatch.setenv(BACKEND_ENV, value.value)
    return value


@pytest.fixture(params=[pytest.param(None, id="none"), *_backend_params()])
def any_backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Backend | None:
    """Each backend this machine has, and no sandbox at all (``None``: policy ``none``)."""
    value: Backend | None = request.param
    if value is not None:
        monkeypatch.setenv(BACKEND_ENV, value.value)
    return value


def policy_for(backend: Backend | None) -> str:
    """The strictest policy the backend can start here: strict when every layer is present, else best_effort;
    ``none`` without a backend."""
    if backend is None:
        return "none"
    layers = machine_support().layers(backend)
    return "strict" if all(status.available for status in layers) else "best_effort"


def _model(root: Path, name: str, note: str) -> Path:
    folder = root / name
    folder.mkdir(parents=True)
    (folder / "note.txt").write_text(note)
    (folder / "secret.txt").write_text(f"secret of {name}")
    return folder


@pytest.fixture
def models(tmp_path: Path) -> tuple[Path, Path]:
    """Two model folders: the one the adversary loads and another model's, whose files it must not see."""
    return _model(tmp_path, "mine", "mine:"), _model(tmp_path, "theirs", "theirs:")


@pytest.fixture
def home_secret() -> Iterator[Path]:
    """A file in the host user's real home directory (removed afterwards)."""
    path = Path.home() / f".carton-sandbox-test-{uuid.uuid4().hex}"
    path.write_text("host home secret")
    yield path
    path.unlink(missing_ok=True)


def processes_mentioning(*needles: str) -> list[tuple[int, str]]:
    """Host processes whose command line or environment contains any of `needles` (runner trees carry their
    runtime dir: in the runner's arguments, and in ``HOME``/``TMPDIR`` of everything they start)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode("utf-8", "replace")
            status = (entry / "status").read_text()
        except OSError:
            continue
        try:
            environ = (entry / "environ").read_bytes().decode("utf-8", "replace")
        except OSError:
            environ = ""
        if "State:\tZ" in status:
            continue
        if any(needle in cmdline or needle in environ for needle in needles):
            found.append((int(entry.name), cmdline))
    return found


def host_rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


#: Every attack must be answered within this many seconds (timeouts and limits below are a few seconds).
BOUND = 20.0


def load(model_dir: Path, backend: Backend | None, limits: carton.RunnerLimits | None = None,
         **options: Any) -> carton.Model:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SandboxWarning)
        return carton.load_unpacked(model_dir, runner_name="adversary", required_framework_version="1",
                                    sandbox=policy_for(backend), limits=limits, **options)


def attack(model: carton.Model, action: str, arg: str = "") -> dict[str, Any]:
    return model.infer({"action": np.array([action]), "arg": np.array([arg])})


def runtime_dir(model: carton.Model) -> str:
    process = model._workers[0].process
    assert process is not None
    return str(process.plan.runtime_dir)


def wait_gone(*needles: str, timeout: float = 10.0) -> list[tuple[int, str]]:
    deadline = time.monotonic() + timeout
    while True:
        left = processes_mentioning(*needles)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


@contextmanager
def aftermath(models: tuple[Path, Path], backend: Backend | None, model: carton.Model, *markers: str) -> Iterator[None]:
    """Checks the host after an attack on `model` (which this closes)."""
    rss_before = host_rss()
    started = time.monotonic()
    needles = (runtime_dir(model), *markers)
    try:
        yield
    finally:
        model.close()
    assert time.monotonic() - started < BOUND
    assert wait_gone(*needles) == []
    assert host_rss() - rss_before < 64 << 20
    with load(models[0], backend) as benign:
        assert attack(benign, "echo", "ok")["out"].tolist() == ["mine:ok"]
