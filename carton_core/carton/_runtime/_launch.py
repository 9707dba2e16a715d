"""How a runner process is started: the `LaunchPlan` a sandbox may rewrite, the private runtime directory, spawning.

The runtime directory (mode 0700, under ``/dev/shm`` when it exists) holds the runner's ``ipc://`` socket, its log
and its scratch directory: one folder a sandbox binds into the runner's view. Large tensors do not live there: they
travel in sealed memfd segments passed over an inherited Unix socket (see ``docs/protocol.md``), so nothing is left
on disk when a process dies. Directories left by a host that was SIGKILLed are swept by the next host that starts.
"""

from __future__ import annotations

import contextlib
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import carton_protocol
from carton_protocol import RunnerSpec

__all__ = [
    "LaunchPlan",
    "LaunchWrapper",
    "build_launch_plan",
    "make_runtime_dir",
    "read_log_tail",
    "remove_runtime_dir",
    "spawn",
]

_DIR_PREFIX = "carton-"
_SOCKET_NAME = "runner.sock"
_LOG_NAME = "runner.log"
_SUN_PATH_MAX = 107


@dataclass(frozen=True, slots=True, kw_only=True)
class LaunchPlan:
    """Everything needed to start one runner process. A sandbox ``wrap(plan) -> plan`` may rewrite any field.

    ``argv[0]`` is the interpreter; ``env`` is the complete environment (nothing else is inherited); ``pass_fds``
    are the only descriptors the process inherits (the shared-memory channel). ``runtime_dir`` must stay visible
    to the runner at the same path (it holds ``endpoint``'s socket file); ``model_dir`` is read-only input and
    ``scratch_dir`` the runner's only writable place. ``host_pid`` is what the runner watches to exit with the host.

    ``limits`` records the resource limits a wrapper applied (keys ``memory_bytes``, ``cpu_seconds``,
    ``request_seconds``, ``processes``, ``open_files``, ``file_size_bytes``): the host names them when the runner
    dies of one, and ``request_seconds`` is the default timeout of every request. ``exit_signal_base`` is set when
    the started process is a wrapper that reports its child's death by signal N as exit status ``base + N``
    (bubblewrap and shells use 128), so the host can still name the signal.
    """

    argv: tuple[str, ...]
    env: Mapping[str, str]
    cwd: Path
    runtime_dir: Path
    endpoint: str
    scratch_dir: Path
    log_path: Path
    model_dir: Path | None = None
    pass_fds: tuple[int, ...] = ()
    host_pid: int = field(default_factory=os.getpid)
    #: Resource limits a sandbox applied, by `carton.RunnerLimits` field name (for error messages).
    limits: Mapping[str, float] = field(default_factory=dict)
    #: Set by a wrapper that reports its runner's death by signal N as exit status ``exit_signal_base + N``
    #: (bubblewrap and the sandbox shim use 128).
    exit_signal_base: int | None = None


#: What a sandbox supplies: a function that rewrites the plan of every runner process a model starts.
LaunchWrapper = Callable[[LaunchPlan], LaunchPlan]


def _runtime_base() -> Path:
    shm = Path("/dev/shm")  # noqa: S108 - tmpfs by design; the directory itself is a private mkdtemp (0700)
    if shm.is_dir() and os.access(shm, os.W_OK | os.X_OK):
        return shm
    return Path(tempfile.gettempdir())


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _sweep_stale(base: Path) -> None:
    """Remove runtime directories of hosts that no longer exist (a SIGKILLed host cannot clean up after itself)."""
    uid = os.getuid()
    try:
        entries = list(base.iterdir())
    except OSError:
        return
    for entry in entries:
        name = entry.name
        if not name.startswith(_DIR_PREFIX):
            continue
        pid_text = name[len(_DIR_PREFIX) :].partition("-")[0]
        if not pid_text.isdigit() or int(pid_text) == os.getpid():
            continue
        try:
            # A sandbox hands the directory to its runner's uid, so as root any owner is ours to sweep.
            if (uid != 0 and entry.lstat().st_uid != uid) or not entry.is_dir() or entry.is_symlink():
                continue
        except OSError:
            continue
        if not _pid_alive(int(pid_text)):
            shutil.rmtree(entry, ignore_errors=True)


def make_runtime_dir() -> Path:
    """A fresh private (0700) directory for one runner process; stale ones of dead hosts are swept first."""
    base = _runtime_base()
    _sweep_stale(base)
    path = Path(tempfile.mkdtemp(prefix=f"{_DIR_PREFIX}{os.getpid()}-", dir=base))
    if len(str(path / _SOCKET_NAME)) > _SUN_PATH_MAX:
        shutil.rmtree(path, ignore_errors=True)
        raise OSError(f"runtime directory {path} is too long for a Unix socket path (max {_SUN_PATH_MAX} bytes)")
    (path / "scratch").mkdir(mode=0o700)
    return path


def remove_runtime_dir(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def _python_path(extra: str | None) -> str:
    # carton_protocol must import in the runner even when the host runs from a source tree.
    protocol_root = str(Path(carton_protocol.__file__).resolve().parent.parent)
    parts = [part for part in (extra or "").split(os.pathsep) if part]
    if protocol_root not in parts:
        parts.append(protocol_root)
    return os.pathsep.join(parts)


def build_launch_plan(
    spec: RunnerSpec,
    *,
    runtime_dir: Path,
    channel_fd: int | None,
    extra_env: Mapping[str, str] | None = None,
    model_dir: Path | None = None,
    threads: int = 8,
) -> LaunchPlan:
    """The default plan: ``<python> -m carton_protocol ...`` with a clean environment."""
    scratch = runtime_dir / "scratch"
    endpoint = f"ipc://{runtime_dir / _SOCKET_NAME}"
    env: dict[str, str] = {
        "PATH": os.environ.get("PATH", os.defpath),
        "LANG": os.environ.get("LANG", "C.UTF-8"),
        "HOME": str(scratch),
        "TMPDIR": str(scratch),
    }
    env.update(dict(spec.env))
    env.update(extra_env or {})
    if spec.python is None:
        env["PYTHONPATH"] = _python_path(env.get("PYTHONPATH"))
    argv = [
        spec.python or sys.executable,
        "-m",
        "carton_protocol",
        "--endpoint",
        endpoint,
        "--entry",
        spec.entry,
        "--host-pid",
        str(os.getpid()),
        "--threads",
        str(threads),
    ]
    if channel_fd is not None:
        argv += ["--fd", str(channel_fd)]
    return LaunchPlan(
        argv=tuple(argv),
        env=env,
        cwd=scratch,
        runtime_dir=runtime_dir,
        endpoint=endpoint,
        scratch_dir=scratch,
        log_path=runtime_dir / _LOG_NAME,
        model_dir=model_dir,
        pass_fds=() if channel_fd is None else (channel_fd,),
    )


class _Launcher:
    """Starts processes from one long-lived thread.

    The runner's parent-death signal fires when the *thread* that forked it exits, not the process; forking from
    a caller's thread (an executor worker, a server thread) would kill the runner when that thread ends.
    """

    def __init__(self) -> None:
        self._requests: queue.SimpleQueue[tuple[Callable[[], subprocess.Popen[bytes]], queue.SimpleQueue[object]]]
        self._requests = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def _run(self) -> None:
        while True:
            work, answer = self._requests.get()
            try:
                answer.put(work())
            except BaseException as exc:
                answer.put(exc)

    def call(self, work: Callable[[], subprocess.Popen[bytes]]) -> subprocess.Popen[bytes]:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="carton-launcher", daemon=True)
                self._thread.start()
        answer: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._requests.put((work, answer))
        result = answer.get()
        if isinstance(result, BaseException):
            raise result
        assert isinstance(result, subprocess.Popen)
        return result


_launcher = _Launcher()


def spawn(plan: LaunchPlan) -> subprocess.Popen[bytes]:
    """Start the plan's process in its own session, with only its env and fds, output to the plan's log file."""

    def work() -> subprocess.Popen[bytes]:
        with open(plan.log_path, "ab") as log:
            return subprocess.Popen(
                plan.argv,
                env=dict(plan.env),
                cwd=plan.cwd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                close_fds=True,
                pass_fds=plan.pass_fds,
                start_new_session=True,
            )

    return _launcher.call(work)


def read_log_tail(path: Path, limit: int = 4000) -> str:
    """The end of a runner's log, for error messages."""
    with contextlib.suppress(OSError), open(path, "rb") as log:
        log.seek(0, os.SEEK_END)
        size = log.tell()
        log.seek(max(0, size - limit))
        return log.read().decode("utf-8", "replace").strip()
    return ""
