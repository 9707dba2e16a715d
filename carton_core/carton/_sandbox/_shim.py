"""The sandbox shim: ``python -E -s -S .../_shim.py CONFIG_JSON -- ARGV...`` applies layers, then execs ``ARGV``.

Standard library only, run with site and user paths disabled, so it starts in a few milliseconds and cannot be
steered by the environment. With bubblewrap it runs inside bwrap's namespaces as the last step before the runner.
With the ``unshare`` backend it is the process the host starts: it creates the namespaces and the private root
itself (``_namespaces.py``), forks the namespace's PID 1 and waits for it. Order: parent-death signal, namespaces
and filesystem view (unshare only), the PID-1 reaper that forks the runner (unshare only), resource limits, the uid
drop (while still privileged), closing inherited descriptors, Landlock, then seccomp (last: it forbids what the
steps before need), then exec. Any failure prints ``carton sandbox: <layer>: <reason>`` to stderr (the runner log)
and exits with `SETUP_FAILED` so the host reports the layer by name.
"""

from __future__ import annotations

import ctypes
import importlib
import json
import os
import resource
import signal
import sys

TYPE_CHECKING = False  # typing is not imported at run time: the shim's start-up is on every runner's load path
if TYPE_CHECKING:
    from typing import Any

SETUP_FAILED = 121
_PR_SET_PDEATHSIG = 1
_PR_SET_DUMPABLE = 4
_RLIMITS = {
    "AS": resource.RLIMIT_AS,
    "CPU": resource.RLIMIT_CPU,
    "NOFILE": resource.RLIMIT_NOFILE,
    "NPROC": resource.RLIMIT_NPROC,
    "FSIZE": resource.RLIMIT_FSIZE,
    "CORE": resource.RLIMIT_CORE,
}


def _fail(layer: str, reason: object) -> None:
    sys.stderr.write(f"carton sandbox: {layer}: {reason}\n")
    sys.stderr.flush()
    os._exit(SETUP_FAILED)


def _parent_death_signal(signum: int) -> None:
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signum, 0, 0, 0) != 0:
        _fail("parent_death_signal", os.strerror(ctypes.get_errno()))
    if os.getppid() != parent:
        _fail("parent_death_signal", "the parent exited before the signal was armed")


def _reaper() -> None:
    """Become PID 1's reaper (the shim is PID 1 under both backends: bubblewrap runs it ``--as-pid-1``): fork the
    runner, reap every orphan, exit with the runner's status (signal N as 128+N, like bubblewrap); when PID 1 exits
    the kernel kills whatever is left in the namespace. Reaping the whole tree also adds its CPU time up to the
    process the host reaps, which the host's CPU-limit verdict reads."""
    child = os.fork()
    if child == 0:
        return
    # Like bubblewrap's init, and whatever uid the runner shares with it: no ptrace, no /proc/1/mem, no core.
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)
    os.closerange(3, 1 << 20)  # the runner's descriptors are its own; PID 1 keeps none of them open
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, lambda num, _frame: os.kill(child, num))
    while True:
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:
            os._exit(SETUP_FAILED)
        except InterruptedError:
            continue
        if pid == child:
            if os.WIFSIGNALED(status):
                os._exit(128 + os.WTERMSIG(status))
            os._exit(os.WEXITSTATUS(status))


def _limits(rlimits: dict[str, list[int]]) -> None:
    for name, (soft, hard) in rlimits.items():
        try:
            resource.setrlimit(_RLIMITS[name], (soft, hard))
        except (ValueError, OSError, KeyError) as exc:
            _fail("resource_limits", f"setrlimit({name}, {soft}, {hard}): {exc}")


def _drop_uid(uid: int, gid: int) -> None:
    try:
        os.setgroups([])
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)
    except OSError as exc:
        _fail("non_root_uid", f"cannot switch to uid {uid}: {exc.strerror}")
    if os.getuid() != uid or os.geteuid() != uid:
        _fail("non_root_uid", f"still uid {os.geteuid()} after setresuid({uid})")


def _close_fds(keep: list[int]) -> None:
    last = 3
    for fd in sorted(keep):
        if fd >= last:
            os.closerange(last, fd)
            last = fd + 1
    os.closerange(last, 1 << 20)


def main(argv: list[str]) -> None:
    if len(argv) < 3 or argv[1] != "--":
        _fail("shim", "usage: _shim.py CONFIG_JSON -- ARGV...")
    try:
        config = json.loads(argv[0])
    except ValueError as exc:
        _fail("shim", f"bad configuration: {exc}")
    target = argv[2:]
    if config.get("pdeathsig"):
        _parent_death_signal(signal.SIGKILL)
    namespaces = config.get("namespaces")
    if namespaces:
        _namespaces: Any = importlib.import_module("_namespaces")
        try:
            _namespaces.enter(namespaces)  # returns only in the namespaces' PID 1, inside the private root
        except _namespaces.NamespaceError as exc:
            _fail(exc.layer, exc)
    if config.get("reaper"):
        _reaper()
        _parent_death_signal(signal.SIGKILL)
    _limits(config.get("rlimits") or {})
    if config.get("uid") is not None:
        _drop_uid(int(config["uid"]), int(config["gid"]))
        _parent_death_signal(signal.SIGKILL)  # changing the uid cleared it
    if config.get("close_fds"):
        _close_fds([int(fd) for fd in config.get("keep_fds", ())])
    landlock = config.get("landlock")
    if landlock:
        _landlock: Any = importlib.import_module("_landlock")  # this folder is sys.path[0]: no carton import
        try:
            _landlock.restrict(landlock["read"], landlock["write"])
        except (_landlock.LandlockError, OSError) as exc:
            _fail("landlock", exc)
    if config.get("seccomp"):
        _seccomp: Any = importlib.import_module("_seccomp")
        try:
            _seccomp.install_filter(_seccomp.build_filter())
        except (_seccomp.FilterUnavailable, OSError) as exc:
            _fail("seccomp", exc)
    try:
        os.execve(target[0], target, os.environ)  # noqa: S606 - exec'ing the runner is the point
    except OSError as exc:
        _fail("exec", f"cannot execute {target[0]}: {exc.strerror}")


if __name__ == "__main__":
    main(sys.argv[1:])
