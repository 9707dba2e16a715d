"""The adversarial runner attacks its sandbox through the real launcher, under every backend this machine has.

For every attack: the host gets a typed error within a bounded time, no file appears on the host, no process of the
runner's tree survives, the host's memory is unchanged, and a benign model loaded right after still answers.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import uuid
import warnings
from pathlib import Path

import carton
import pytest
from carton._sandbox import Backend, machine_support
from carton.errors import (
    RunnerCPULimit,
    RunnerCrashed,
    RunnerFailed,
    RunnerMemoryLimit,
    RunnerTimeout,
    SandboxWarning,
)

from .conftest import BOUND, HERE, aftermath, attack, load, policy_for, processes_mentioning, wait_gone

pytestmark = pytest.mark.usefixtures("adversarial_plugin")


def test_reads_outside_the_model_are_refused(models: tuple[Path, Path], backend: Backend, home_secret: Path) -> None:
    model = load(models[0], backend)
    with aftermath(models, backend, model):
        assert attack(model, "read", str(models[0] / "secret.txt"))["out"].tolist() == ["secret of mine"]
        for path in ("/etc/shadow", str(models[1] / "secret.txt"), str(home_secret)):
            with pytest.raises(RunnerFailed, match=r"(PermissionError|FileNotFoundError)"):
                attack(model, "read", path)
        with pytest.raises(RunnerFailed, match=r"(PermissionError|FileNotFoundError)"):
            attack(model, "listdir", str(Path.home()))


def test_writes_outside_scratch_fail(models: tuple[Path, Path], backend: Backend) -> None:
    tag = uuid.uuid4().hex
    targets = [Path("/tmp") / f"carton-escape-{tag}", models[0] / f"planted-{tag}", models[1] / f"planted-{tag}",
               Path.home() / f".carton-escape-{tag}"]
    model = load(models[0], backend)
    with aftermath(models, backend, model):
        for target in targets:
            with pytest.raises(RunnerFailed, match=r"(PermissionError|FileNotFoundError|OSError|Read-only)"):
                attack(model, "write", str(target))
        assert attack(model, "write", "scratch-file")["out"].tolist() == ["wrote scratch-file"]  # cwd is scratch
    assert [target for target in targets if target.exists()] == []


def test_no_network(models: tuple[Path, Path], backend: Backend) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.5)
    port = listener.getsockname()[1]
    model = load(models[0], backend)
    with listener, aftermath(models, backend, model):
        with pytest.raises(RunnerFailed, match=r"OSError|ConnectionRefused|Address family"):
            attack(model, "connect", str(port))
        with pytest.raises(TimeoutError):
            listener.accept()


def test_fork_bomb_is_contained(models: tuple[Path, Path], backend: Backend) -> None:
    model = load(models[0], backend, carton.RunnerLimits(processes=48, request_seconds=3))
    with aftermath(models, backend, model), pytest.raises(RunnerTimeout, match="infer timeout"):
        attack(model, "forkbomb")


def test_huge_allocation_hits_the_memory_limit(models: tuple[Path, Path], backend: Backend) -> None:
    model = load(models[0], backend, carton.RunnerLimits(memory_bytes=3 << 30))
    with aftermath(models, backend, model):
        with pytest.raises(RunnerMemoryLimit, match="memory_bytes"):
            attack(model, "alloc", str(50 << 30))
        assert attack(model, "echo", "still here")["out"].tolist() == ["mine:still here"]


def test_spinning_hits_the_cpu_limit(models: tuple[Path, Path], backend: Backend) -> None:
    model = load(models[0], backend, carton.RunnerLimits(cpu_seconds=1))
    with aftermath(models, backend, model), pytest.raises(RunnerCPULimit, match="cpu_seconds=1"):
        attack(model, "spin")


def test_spinning_hits_the_wall_time_limit(models: tuple[Path, Path], backend: Backend) -> None:
    model = load(models[0], backend, carton.RunnerLimits(request_seconds=1.5))
    with aftermath(models, backend, model), pytest.raises(RunnerTimeout, match="infer timeout"):
        attack(model, "spin")


def test_segfault_mid_request(models: tuple[Path, Path], backend: Backend) -> None:
    model = load(models[0], backend)
    with aftermath(models, backend, model), pytest.raises(RunnerCrashed, match="SIGSEGV"):
        attack(model, "segfault")


def _orphan_then_segfault(models: tuple[Path, Path], backend: Backend | None) -> None:
    marker = f"carton-orphan-{uuid.uuid4().hex}"
    model = load(models[0], backend)
    with aftermath(models, backend, model, marker), pytest.raises(RunnerCrashed, match="SIGSEGV"):
        attack(model, "orphan", marker)


def test_setsid_orphan_does_not_survive(models: tuple[Path, Path], backend: Backend) -> None:
    _orphan_then_segfault(models, backend)


def test_setsid_orphan_does_not_survive_without_a_sandbox(models: tuple[Path, Path]) -> None:
    """Policy ``none``: no PID namespace ends the tree, the runner's supervisor does (docs/protocol.md)."""
    _orphan_then_segfault(models, None)


def test_never_answering_the_handshake(models: tuple[Path, Path], backend: Backend) -> None:
    started = time.monotonic()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SandboxWarning)
        with pytest.raises(RunnerTimeout, match="handshake"):
            carton.load_unpacked(models[0], runner_name="never-ready", required_framework_version="1",
                                 sandbox=policy_for(backend), handshake_timeout=2)
    assert time.monotonic() - started < BOUND
    assert wait_gone("adversarial_hang") == []
    with load(models[0], backend) as benign:
        assert attack(benign, "echo", "ok")["out"].tolist() == ["mine:ok"]


def test_nothing_of_the_host_leaks_in(models: tuple[Path, Path], backend: Backend, monkeypatch: pytest.MonkeyPatch,
                                      tmp_path: Path) -> None:
    monkeypatch.setenv("CARTON_TEST_HOST_SECRET", "hunter2")
    leaked = open(tmp_path / "inheritable", "w")  # noqa: SIM115 - an open, inheritable descriptor of the host
    os.set_inheritable(leaked.fileno(), True)
    try:
        with load(models[0], backend) as model:
            environment = attack(model, "env")["out"].tolist()[0]
            assert "hunter2" not in environment and "CARTON_TEST_HOST_SECRET" not in environment
            assert f"HOME={Path.home()}" not in environment and os.environ["PATH"] not in environment
            uid, pid = map(int, attack(model, "whoami")["out"].tolist()[0].split())
            assert pid < 10  # a fresh PID namespace: the runner's pid is tiny
            if machine_support().layers(backend)[-1].available:
                assert uid != 0
            descriptors = attack(model, "fds")["out"].tolist()[0].splitlines()
            assert leaked.name not in descriptors
            assert [target for target in descriptors if target.startswith("/") and not target.startswith(
                ("/dev/null", "/dev/shm/carton-", "/memfd:", "/proc/"))] == []
    finally:
        leaked.close()


HOST_SCRIPT = textwrap.dedent(
    """
    import sys, time, warnings
    import carton
    sys.path.insert(0, {tests!r})
    from conftest import AdversarialPlugin
    from carton._runtime import plugin_manager
    warnings.simplefilter("ignore")
    plugin_manager().register(AdversarialPlugin(), name="adversary")
    models = [carton.load_unpacked({model!r}, runner_name="adversary", required_framework_version="1",
                                   sandbox={policy!r}) for _ in range(2)]
    for model in models:
        print(model._workers[0].process.plan.runtime_dir, flush=True)
    time.sleep(600)
    """
)


@pytest.mark.slow
def test_sigkilled_host_leaves_no_runner(models: tuple[Path, Path], backend: Backend) -> None:
    script = HOST_SCRIPT.format(tests=str(HERE), model=str(models[0]), policy=policy_for(backend))
    host = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(HERE)})
    assert host.stdout is not None
    dirs = [host.stdout.readline().strip() for _ in range(2)]
    assert all(dirs), "the host script did not start its models"
    assert len(processes_mentioning(*dirs)) >= 2
    host.send_signal(signal.SIGKILL)
    host.wait(timeout=10)
    assert wait_gone(*dirs) == []
