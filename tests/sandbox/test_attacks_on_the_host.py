"""A hostile runner attacks the host rather than its sandbox: the files the host reads after it started, the verdict
the host gives on its death, and the host's promise that no runner process outlives `close()` or the host itself.

Each test runs under every sandbox backend this machine has and, where the attack means something there, without
a sandbox (policy ``none``, where the runner has the host's own rights: only attacks on the host's cleanup and
verdicts apply).
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import carton
import pytest
from carton._runtime import cgroup_support
from carton._sandbox import Backend
from carton.errors import RunnerCPULimit, RunnerCrashed

from .conftest import HERE, aftermath, attack, load, policy_for, processes_mentioning, runtime_dir, wait_gone

pytestmark = pytest.mark.usefixtures("adversarial_plugin")

SECRET = "host-only secret 7f3a"


def _needs_cgroups(backend: Backend | None) -> None:
    """Without a sandbox, only a cgroup of its own ends a runner that kills its supervisor and daemonizes."""
    support = cgroup_support()
    if backend is None and not support.available:
        pytest.skip(f"policy none cannot promise this without a cgroup per runner: {support.detail}")


# --- 1. the host never reads a runner-writable file by name -------------------------------------------------------


def test_a_log_swapped_for_a_link_to_a_host_file_is_never_followed(
    models: tuple[Path, Path], any_backend: Backend | None, tmp_path: Path
) -> None:
    secret = tmp_path / "host-only.txt"
    secret.write_text(SECRET)
    secret.chmod(0o600)
    model = load(models[0], any_backend)
    with aftermath(models, any_backend, model), pytest.raises(RunnerCrashed, match="SIGSEGV") as caught:
        attack(model, "swap_log", str(secret))
    message = str(caught.value)
    assert SECRET not in message
    # The log is still quoted: what the runner printed before it crashed, read from the log the host opened.
    assert "swapped" in message or "refused" in message


def test_the_runner_cannot_redirect_the_hosts_connections(
    models: tuple[Path, Path], backend: Backend, tmp_path: Path
) -> None:
    decoy_path = tmp_path / "decoy.sock"
    decoy = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    decoy.bind(str(decoy_path))
    decoy.listen()
    decoy.settimeout(0.5)
    model = load(models[0], backend)
    with decoy, aftermath(models, backend, model):
        assert attack(model, "swap_socket", str(decoy_path))["out"].tolist()[0].startswith("refused")
        # A call from another thread connects afresh, by the socket's path: it must still reach the runner.
        with ThreadPoolExecutor(1) as pool:
            assert pool.submit(attack, model, "echo", "x").result()["out"].tolist() == ["mine:x"]
        with pytest.raises(TimeoutError):
            decoy.accept()


def test_removing_the_runtime_folder_never_follows_the_runners_links(
    models: tuple[Path, Path], any_backend: Backend | None, tmp_path: Path
) -> None:
    host_folder = tmp_path / "host-folder"
    host_folder.mkdir()
    (host_folder / "keep.txt").write_text("keep")
    model = load(models[0], any_backend)
    folder = Path(runtime_dir(model))
    with aftermath(models, any_backend, model):
        assert attack(model, "plant_links", str(host_folder))["out"].tolist() == ["planted"]
    assert not folder.exists()
    assert sorted(path.name for path in host_folder.iterdir()) == ["keep.txt"]
    assert (host_folder / "keep.txt").read_text() == "keep"


# --- 2. a death is blamed on a limit only when the accounting shows it ---------------------------------------------


def test_a_self_inflicted_sigkill_is_not_the_cpu_limit(models: tuple[Path, Path], any_backend: Backend | None) -> None:
    model = load(models[0], any_backend, carton.RunnerLimits(cpu_seconds=20))
    with aftermath(models, any_backend, model), pytest.raises(RunnerCrashed, match="SIGKILL") as caught:
        attack(model, "suicide", "0.5")
    assert caught.value.signal == signal.SIGKILL
    assert "went over" not in str(caught.value)
    assert re.search(r"\(not its CPU-time limit cpu_seconds=20: it used [0-9.]+ s\)", str(caught.value))


def test_killing_the_supervisor_is_not_the_cpu_limit(models: tuple[Path, Path], any_backend: Backend | None) -> None:
    model = load(models[0], any_backend, carton.RunnerLimits(cpu_seconds=20))
    with aftermath(models, any_backend, model), pytest.raises(RunnerCrashed, match="SIGKILL") as caught:
        attack(model, "kill_supervisor")
    assert caught.value.signal == signal.SIGKILL


@pytest.mark.parametrize("action", ["spin", "spin_past_sigxcpu"])
def test_really_spinning_is_the_cpu_limit(models: tuple[Path, Path], any_backend: Backend | None, action: str) -> None:
    """SIGXCPU at the soft limit; a runner that ignores it gets the kernel's SIGKILL at the hard limit."""
    model = load(models[0], any_backend, carton.RunnerLimits(cpu_seconds=1))
    with aftermath(models, any_backend, model), pytest.raises(RunnerCPULimit, match=r"cpu_seconds=1\b") as caught:
        attack(model, action)
    assert caught.value.limit_seconds == 1


def test_a_self_inflicted_sigkill_is_not_the_memory_limit(
    models: tuple[Path, Path], any_backend: Backend | None
) -> None:
    model = load(models[0], any_backend, carton.RunnerLimits(memory_bytes=3 << 30))
    with aftermath(models, any_backend, model), pytest.raises(RunnerCrashed, match="SIGKILL") as caught:
        attack(model, "suicide", "0.5")
    assert "memory" not in str(caught.value)


# --- 3. no runner process outlives close() or its host ------------------------------------------------------------


def test_close_ends_a_runner_that_fights_its_own_tree(models: tuple[Path, Path], any_backend: Backend | None) -> None:
    """The runner ignores SIGTERM/SIGHUP/SIGINT, disarms its parent-death signal, leaves its session, daemonizes
    two stubborn sleepers and kills its supervisor."""
    _needs_cgroups(any_backend)
    marker = f"carton-outlive-{uuid.uuid4().hex}"
    model = load(models[0], any_backend)
    with aftermath(models, any_backend, model, marker):
        attack(model, "outlive", marker)
        time.sleep(0.5)  # the supervisor is dead by now, and the sleepers are daemons
        if any_backend is None:  # in a sandbox, the namespace's PID 1 ended them all with the supervisor
            assert len(processes_mentioning(marker)) == 2


def test_without_a_cgroup_close_still_ends_a_runner_that_killed_its_supervisor(
    models: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fallback: the runner's own pid (checked at the handshake) and its process group are still killed."""
    monkeypatch.setenv("CARTON_RUNNER_CGROUPS", "0")
    model = load(models[0], None)
    with aftermath(models, None, model):
        runner_pid = int(attack(model, "outlive")["out"].tolist()[0])
        time.sleep(0.5)  # the supervisor is dead by now: the runner is an orphan in a session of its own
        assert [pid for pid, _ in processes_mentioning(runtime_dir(model))] == [runner_pid]


HOST_SCRIPT = textwrap.dedent(
    """
    import sys, time, warnings
    import numpy as np
    import carton
    sys.path.insert(0, {tests!r})
    from conftest import AdversarialPlugin
    from carton._runtime import plugin_manager
    warnings.simplefilter("ignore")
    plugin_manager().register(AdversarialPlugin(), name="adversary")
    model = carton.load_unpacked({model!r}, runner_name="adversary", required_framework_version="1",
                                 sandbox={policy!r})
    model.infer({{"action": np.array(["outlive"]), "arg": np.array([{marker!r}])}})
    print(model._workers[0].process.plan.runtime_dir, flush=True)
    time.sleep(0.5)
    if {how!r} == "sigkill":
        time.sleep(600)
    """
)


@pytest.mark.parametrize("how", ["exit", "sigkill"])
def test_a_runner_that_fights_its_tree_does_not_outlive_its_host(
    models: tuple[Path, Path], any_backend: Backend | None, how: str
) -> None:
    _needs_cgroups(any_backend)
    marker = f"carton-outlive-{uuid.uuid4().hex}"
    script = HOST_SCRIPT.format(
        tests=str(HERE), model=str(models[0]), policy=policy_for(any_backend), marker=marker, how=how
    )
    host = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(HERE)})  # fmt: skip
    assert host.stdout is not None
    folder = host.stdout.readline().strip()
    assert folder, "the host script did not start its model"
    if how == "sigkill":
        deadline = time.monotonic() + 10
        while len(processes_mentioning(marker)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        host.send_signal(signal.SIGKILL)
    host.wait(timeout=30)
    assert wait_gone(folder, marker) == []
