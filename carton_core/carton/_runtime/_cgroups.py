"""A cgroup (v2) of its own for every runner process, when this host may make one.

Without a PID namespace (policy ``none``), a runner can take its tree out of every reach the host has through process
relations: it ignores SIGTERM, disarms its parent-death signal, calls ``setsid()``, double-forks daemons and kills its
supervisor; they are then children of init in sessions of their own, and no walk of ``/proc`` from the host finds
them. A cgroup is the kernel's own record of them: a process cannot leave it (without the right to write another
cgroup's ``cgroup.procs``), every child is born in it, and writing ``1`` to its ``cgroup.kill`` SIGKILLs every
process in it at once, forking ones included.

Layout, under the host's own cgroup (``/proc/self/cgroup``, on the cgroup2 mount)::

    <host cgroup>/carton-<host pid>/         the host's runners; the guardian kills and removes it after the host
    <host cgroup>/carton-<host pid>/runner-<n>/   one runner's whole tree (its cgroup.procs is joined by /bin/sh
                                                  before it execs the runner: `_launch.spawn`)

The first runner of a host probes once: the host's cgroup must be writable (root, or a delegated subtree such as
systemd's ``user@.service``), ``cgroup.kill`` present (Linux 5.14+), and a process movable into a child. Then the
host starts its guardian (`_guardian`), which kills and removes ``carton-<host pid>`` when the host exits, SIGKILL
included. ``CARTON_RUNNER_CGROUPS=0`` turns all this off; `cgroup_support` says whether it is on here and why not.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from .._paths import pid_alive
from ._guardian import end as _end
from ._guardian import kill as _kill

__all__ = ["CGROUPS_ENV", "CgroupSupport", "RunnerCgroup", "cgroup_support", "runner_cgroup"]

#: Environment variable: ``0`` (or ``false``, ``no``, ``off``) keeps runners out of cgroups of their own.
CGROUPS_ENV = "CARTON_RUNNER_CGROUPS"
_GUARDIAN = Path(__file__).resolve().with_name("_guardian.py")
_PROBE_TIMEOUT = 10.0
#: How long `RunnerCgroup.kill` waits for the killed processes to be gone.
_EMPTY_SECONDS = 5.0


@dataclass(frozen=True, slots=True, kw_only=True)
class CgroupSupport:
    """Whether runners get cgroups of their own here: ``detail`` is where they go, or why they cannot."""

    available: bool
    detail: str


class RunnerCgroup:
    """One runner's cgroup: its whole process tree, whatever the tree did to itself."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @property
    def procs(self) -> Path:
        """The ``cgroup.procs`` file a process writes ``0`` to in order to join."""
        return self.path / "cgroup.procs"

    def kill(self) -> None:
        """SIGKILL every process in the cgroup and wait (a few seconds at most) until none is left."""
        _kill(str(self.path), _EMPTY_SECONDS)

    def remove(self) -> None:
        """Delete the (empty) cgroup; one still holding a process stuck in the kernel is left to the guardian."""
        with contextlib.suppress(OSError):
            self.path.rmdir()


def _disabled() -> bool:
    return os.environ.get(CGROUPS_ENV, "").strip().lower() in ("0", "false", "no", "off")


def _own_cgroup() -> Path:
    """The host's cgroup v2 directory: its ``0::`` line of ``/proc/self/cgroup`` on the cgroup2 mount."""
    relative = None
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        if line.startswith("0::"):
            relative = line[3:]
    if relative is None:
        raise OSError("this host has no cgroup v2 hierarchy (cgroup v1 only)")
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields, _, tail = line.partition(" - ")
        if tail.split()[:1] != ["cgroup2"]:
            continue
        root, mount_point = (_unescape(field) for field in fields.split()[3:5])
        if relative == root or relative.startswith(root.rstrip("/") + "/"):
            return Path(mount_point) / relative[len(root) :].lstrip("/")
    raise OSError(f"no cgroup2 mount shows this host's cgroup {relative}")


def _unescape(field: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as octal (``\\040``)."""
    return field.encode().decode("unicode_escape") if "\\" in field else field


class _HostCgroups:
    """The host's ``carton-<pid>`` cgroup and its guardian, made on first use; reset in a forked child."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pid = -1
        self._root: Path | None = None
        self._support = CgroupSupport(available=False, detail="not probed yet")
        self._counter = itertools.count()

    def _ensure(self) -> None:
        if self._pid == os.getpid():
            return
        self._pid = os.getpid()
        self._root, self._counter = None, itertools.count()
        if _disabled():
            self._support = CgroupSupport(available=False, detail=f"turned off by {CGROUPS_ENV}=0")
            return
        if not sys.platform.startswith("linux"):
            self._support = CgroupSupport(available=False, detail=f"cgroups are Linux-only (this is {sys.platform})")
            return
        try:
            root = self._make_root()
        except OSError as exc:
            reason = exc.strerror if exc.strerror and exc.filename else str(exc)
            where = f" ({exc.filename})" if exc.filename else ""
            self._support = CgroupSupport(available=False, detail=f"{reason}{where}")
            return
        self._root = root
        self._support = CgroupSupport(available=True, detail=f"one cgroup per runner under {root}")

    def _make_root(self) -> Path:
        parent = _own_cgroup()
        _sweep_stale(parent)
        root = parent / f"carton-{os.getpid()}"
        if root.exists():
            _end(str(root))  # left by a dead host with this same pid
        root.mkdir()
        try:
            if not (root / "cgroup.kill").exists():
                raise OSError(f"the kernel has no cgroup.kill (Linux 5.14+) under {parent}")
            _probe_join(root)
            _start_guardian(root)
        except BaseException:
            _end(str(root))
            raise
        return root

    def support(self) -> CgroupSupport:
        with self._lock:
            self._ensure()
            return self._support

    def new(self) -> RunnerCgroup | None:
        with self._lock:
            self._ensure()
            root = self._root
            if root is None:
                return None
            path = root / f"runner-{next(self._counter)}"
        try:
            path.mkdir()
        except OSError:
            return None  # a cgroup limit (cgroup.max.descendants) or a removed root: this runner goes without
        return RunnerCgroup(path)


def _probe_join(root: Path) -> None:
    """Move a throwaway ``/bin/sh`` into a child of `root` the way `_launch.spawn` moves a runner."""
    probe = root / "probe"
    probe.mkdir()
    try:
        done = subprocess.run(
            ["/bin/sh", "-c", 'echo 0 >"$1"', "carton-cgroup", str(probe / "cgroup.procs")],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=_PROBE_TIMEOUT,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise OSError(f"cannot run /bin/sh to join a cgroup: {exc}") from exc
    finally:
        with contextlib.suppress(OSError):
            probe.rmdir()
    if done.returncode != 0:
        text = done.stderr.decode("utf-8", "replace").strip().splitlines()
        raise OSError(f"cannot move a process into a cgroup under {root}: {text[-1] if text else done.returncode}")


#: Starts the guardian in the background and exits: the guardian is then no child of the host (nothing for the
#: host to reap, or to find among its descendants), and ignores SIGINT like every background job.
_DETACH = '"$@" </dev/null >/dev/null 2>&1 &'


def _start_guardian(root: Path) -> None:
    """Start the host's guardian, watching a pidfd of the host itself (no pid that could be reused)."""
    if not hasattr(os, "pidfd_open"):
        return  # cannot watch the host; the host's own cleanup remains
    pidfd = os.pidfd_open(os.getpid())
    try:
        guardian = [sys.executable, "-E", "-s", "-S", str(_GUARDIAN), str(pidfd), str(root)]
        subprocess.run(
            ["/bin/sh", "-c", _DETACH, "carton-guardian", *guardian],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            close_fds=True,
            pass_fds=(pidfd,),
            start_new_session=True,
            cwd="/",
            env={},
            timeout=_PROBE_TIMEOUT,
            check=True,
        )
    except (subprocess.SubprocessError, OSError) as exc:
        raise OSError(f"cannot start the cgroup guardian: {exc}") from exc
    finally:
        os.close(pidfd)


def _sweep_stale(parent: Path) -> None:
    """End the ``carton-<pid>`` cgroups of hosts that no longer exist and whose guardian did not finish."""
    with contextlib.suppress(OSError):
        for entry in parent.iterdir():
            pid_text = entry.name.removeprefix("carton-")
            if entry.name.startswith("carton-") and pid_text.isdigit() and not pid_alive(int(pid_text)):
                _end(str(entry))


_host = _HostCgroups()


def cgroup_support() -> CgroupSupport:
    """Whether this host puts its runners in cgroups of their own (probed once per process, on first use)."""
    return _host.support()


def runner_cgroup() -> RunnerCgroup | None:
    """A fresh cgroup for one runner, or ``None`` when this host cannot make one (`cgroup_support` says why)."""
    return _host.new()
