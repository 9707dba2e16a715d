"""How a runner process is started: the `LaunchPlan` a sandbox may rewrite, the private runtime directory, spawning.

The runtime directory (mode 0700, under ``/dev/shm`` when it exists) belongs to the host. Before the runner starts,
the host binds and listens on the ``ipc://`` socket there (the runner's ZeroMQ socket adopts the listening
descriptor, ``--listen-fd``), creates the log (the runner's stdout and stderr, read back only through the
descriptor the host keeps) and ``scratch/``, the one folder the runner may write (a sandbox binds only that one into
its view). So after the start the host never opens, by name, anything the runner could have replaced: it connects
to a socket in its own folder and reads its own descriptor; ``scratch/`` it only removes, with `shutil.rmtree`'s
descriptor-based walk, which never follows a link (docs/sandbox.md, "What the host touches after the start").
Large tensors do not live there: they travel in sealed memfd segments passed over an inherited Unix socket (see
``docs/protocol.md``), so nothing is left on disk when a process dies. Directories left by a host that was SIGKILLed
are swept by the next host that starts.
"""

from __future__ import annotations

import contextlib
import errno
import os
import queue
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import carton_protocol
from carton_protocol import RunnerSpec

from .._paths import pid_alive

__all__ = [
    "LaunchPlan",
    "LaunchWrapper",
    "RuntimeDir",
    "build_launch_plan",
    "make_runtime_dir",
    "read_log_tail",
    "spawn",
]

_DIR_PREFIX = "carton-"
_SOCKET_NAME = "runner.sock"
_LOG_NAME = "runner.log"
_SUN_PATH_MAX = 107
#: Connections the runner's listening socket queues before the runner accepts them (one per host thread).
_BACKLOG = 128


@dataclass(frozen=True, slots=True, kw_only=True)
class LaunchPlan:
    """Everything needed to start one runner process. A sandbox ``wrap(plan) -> plan`` may rewrite any field.

    ``argv[0]`` is the interpreter; ``env`` is the complete environment (nothing else is inherited); ``pass_fds``
    are the only descriptors the process inherits (the shared-memory channel and ``listen_fd``, the socket the host
    bound at ``endpoint``). ``runtime_dir`` is the host's: the runner needs none of it but ``scratch_dir``, its only
    writable place, which a sandbox must show it at the same path (its socket and log it reaches through inherited
    descriptors); ``model_dir`` is read-only input. ``log_path`` is where the host created the log the runner
    writes to (the host reads it only through its own descriptor). ``host_pid`` is what the runner watches to exit
    with the host.

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
    #: The inherited listening socket the runner's ZeroMQ socket adopts (``--listen-fd``); one of `pass_fds`.
    listen_fd: int | None = None
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
        if not pid_alive(int(pid_text)):
            _remove_tree(entry)


@dataclass(slots=True, eq=False)
class RuntimeDir:
    """A runner's runtime directory, and what the host made in it before the runner started.

    ``log_fd`` is the runner's log (its stdout and stderr), opened by the host with ``O_EXCL | O_NOFOLLOW``: the
    host reads the log through it and never by name. ``listener`` is the bound, listening ``runner.sock`` that the
    runner's socket adopts; the host closes its copy once the runner is started (`close_listener`).
    """

    path: Path
    log_fd: int
    listener: socket.socket | None

    @property
    def scratch(self) -> Path:
        return self.path / "scratch"

    def close_listener(self) -> None:
        if self.listener is not None:
            self.listener.close()
            self.listener = None

    def remove(self) -> None:
        """Close what the host holds and delete the directory (a descriptor walk: no link in it is followed)."""
        self.close_listener()
        if self.log_fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.log_fd)
            self.log_fd = -1
        _remove_tree(self.path)


def _remove_tree(path: Path) -> None:
    # On Linux rmtree walks by descriptor (openat, unlinkat, each directory checked against its lstat:
    # `shutil.rmtree.avoids_symlink_attacks`), so it never follows a symlink a runner left in its scratch folder.
    shutil.rmtree(path, ignore_errors=True)


def make_runtime_dir() -> RuntimeDir:
    """A fresh private (0700) directory for one runner process, with its log, its bound socket and ``scratch/``;
    stale ones of dead hosts are swept first."""
    base = _runtime_base()
    _sweep_stale(base)
    path = Path(tempfile.mkdtemp(prefix=f"{_DIR_PREFIX}{os.getpid()}-", dir=base))
    listener: socket.socket | None = None
    try:
        socket_path = path / _SOCKET_NAME
        if len(str(socket_path)) > _SUN_PATH_MAX:
            raise OSError(f"runtime directory {path} is too long for a Unix socket path (max {_SUN_PATH_MAX} bytes)")
        (path / "scratch").mkdir(mode=0o700)
        log_fd = os.open(
            path / _LOG_NAME,
            os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
            0o600,
        )
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(socket_path))
        listener.listen(_BACKLOG)
    except BaseException:
        if listener is not None:
            listener.close()
        _remove_tree(path)
        raise
    return RuntimeDir(path=path, log_fd=log_fd, listener=listener)


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
    runtime: RuntimeDir,
    channel_fd: int | None,
    extra_env: Mapping[str, str] | None = None,
    model_dir: Path | None = None,
    threads: int = 8,
) -> LaunchPlan:
    """The default plan: ``<python> -m carton_protocol ...`` with a clean environment."""
    runtime_dir = runtime.path
    scratch = runtime.scratch
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
    pass_fds: list[int] = []
    if channel_fd is not None:
        argv += ["--fd", str(channel_fd)]
        pass_fds.append(channel_fd)
    listen_fd = None if runtime.listener is None else runtime.listener.fileno()
    if listen_fd is not None:
        argv += ["--listen-fd", str(listen_fd)]
        pass_fds.append(listen_fd)
    return LaunchPlan(
        argv=tuple(argv),
        env=env,
        cwd=scratch,
        runtime_dir=runtime_dir,
        endpoint=endpoint,
        scratch_dir=scratch,
        log_path=runtime_dir / _LOG_NAME,
        model_dir=model_dir,
        pass_fds=tuple(pass_fds),
        listen_fd=listen_fd,
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


#: Run by ``/bin/sh`` before the runner's own argv when the runner gets a cgroup of its own: the shell moves itself
#: into the cgroup (``0`` is the writer's pid) and execs, so every process of the runner's tree starts inside it.
#: (``PWD`` is the shell's addition to the environment.)
_JOIN_CGROUP = 'echo 0 >"$1" || exit 125; shift; unset PWD; exec "$@"'


def spawn(plan: LaunchPlan, *, log_fd: int, cgroup_procs: Path | None = None) -> subprocess.Popen[bytes]:
    """Start the plan's process in its own session, with only its env and fds, its output to `log_fd`; inside the
    cgroup whose ``cgroup.procs`` is `cgroup_procs`, when given, from its first instruction on."""
    argv: tuple[str, ...] = plan.argv
    if cgroup_procs is not None:
        # The shell's exec fails after the start, as an exit status: say what Popen would have said, before it.
        program = argv[0] if "/" in argv[0] else shutil.which(argv[0], path=plan.env.get("PATH")) or argv[0]
        if not os.access(program, os.X_OK):
            code = errno.EACCES if os.path.lexists(program) else errno.ENOENT
            raise OSError(code, os.strerror(code), argv[0])
        argv = ("/bin/sh", "-c", _JOIN_CGROUP, "carton-cgroup", str(cgroup_procs), *argv)

    def work() -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            argv,
            env=dict(plan.env),
            cwd=plan.cwd,
            stdin=subprocess.DEVNULL,
            stdout=log_fd,
            stderr=subprocess.STDOUT,
            close_fds=True,
            pass_fds=plan.pass_fds,
            start_new_session=True,
        )

    return _launcher.call(work)


def read_log_tail(log_fd: int, limit: int = 4000) -> str:
    """The end of a runner's log, for error messages, read through the descriptor the host opened before the
    runner started (never by name: the runner could have replaced the file by a link)."""
    if log_fd < 0:
        return ""
    with contextlib.suppress(OSError):
        size = os.fstat(log_fd).st_size
        start = max(0, size - limit)
        return os.pread(log_fd, size - start, start).decode("utf-8", "replace").strip()
    return ""
