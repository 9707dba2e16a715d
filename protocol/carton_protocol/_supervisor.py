"""The runner's supervisor: the process the host starts forks the runner at once and stays behind as its reaper.

A runner that dies by a signal (SIGSEGV in a framework, SIGKILL) cannot clean up after itself, and a child it
started that called ``setsid()`` would then be re-parented to init and outlive it. So ``python -m carton_protocol``
first calls `supervise`, before anything heavy is imported (the package ``__init__`` is lazy: numpy and pyzmq load
in the runner only), which

1. makes this process a child subreaper (``PR_SET_CHILD_SUBREAPER``), so every descendant orphaned in the runner's
   tree, ``setsid()`` or not, is re-parented here rather than to init;
2. forks: the child (the runner) arms its parent-death signal (SIGTERM) and returns to run `carton_protocol._loop`;
3. the parent (the supervisor) closes every inherited descriptor but stdio, arms its own parent-death signal
   (SIGTERM), watches the host's pidfd when ``--host-pid`` is given, forwards SIGTERM/SIGINT/SIGHUP to the runner
   (and kills the whole tree if the runner has not exited `GRACE_SECONDS` later), and otherwise only waits: it reaps
   adopted orphans as they exit, and when the runner exits it SIGKILLs every descendant left (stopping them first,
   `kill_tree`) and exits the same way: the runner's exit status, or the runner's signal re-raised on itself with
   core dumps off, so the host still reads "killed by SIGSEGV".

The supervisor is not on the data path (the host talks to the runner's socket directly) and costs one ``fork`` of a
small interpreter at start-up. When the host is gone (the parent-death signal, or the host's pidfd) it kills the
whole tree at once. Inside a sandbox's PID namespace it is harmless and redundant (PID 1's death ends the namespace).

Standard library only, and before the fork only what the runner imports anyway (``ctypes``, ``select``, ``signal``).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import signal
import sys

__all__ = ["GRACE_SECONDS", "supervise"]

#: After forwarding a termination signal, how long the runner has to exit before its whole tree is killed.
GRACE_SECONDS = 2.0
#: How long the supervisor waits for the descendants it SIGKILLed to die, so it can reap them.
_REAP_SECONDS = 1.0

_PR_SET_PDEATHSIG = 1
_PR_SET_DUMPABLE = 4
_PR_SET_CHILD_SUBREAPER = 36
_FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def _prctl(option: int, value: int) -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)  # libc is already loaded: no find_library (it runs ldconfig)
        return int(libc.prctl(option, ctypes.c_ulong(value), 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def _host_pid(argv: list[str]) -> int | None:
    """``--host-pid N`` (or ``--host-pid=N``) from the runner's own arguments; argparse is not worth importing."""
    for index, item in enumerate(argv):
        value = None
        if item == "--host-pid" and index + 1 < len(argv):
            value = argv[index + 1]
        elif item.startswith("--host-pid="):
            value = item.partition("=")[2]
        if value is not None:
            return int(value) if value.isdigit() else None
    return None


def supervise(argv: list[str] | None = None) -> None:
    """Fork the runner; return in the runner only. The supervisor never returns: it exits as the runner did."""
    arguments = sys.argv[1:] if argv is None else argv
    parent = os.getppid()
    supervisor = os.getpid()
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)
    try:
        runner = os.fork()
    except OSError as exc:
        # No supervisor (a process limit reached already): run the runner in this process, unsupervised.
        print(f"carton runner: cannot fork the runner's supervisor ({exc}); running unsupervised", file=sys.stderr)
        return
    if runner == 0:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != supervisor:
            os._exit(0)  # the supervisor died before the signal was armed: nobody would end this process
        return
    _Supervisor(runner, parent, _host_pid(arguments)).run()


class _Supervisor:
    def __init__(self, runner: int, parent: int, host_pid: int | None) -> None:
        self.runner = runner
        self.parent = parent
        self.host_pid = host_pid
        self.runner_exited = False  # once reaped, its pid may be reused: never signal it again

    def run(self) -> None:
        # The runner's descriptors are its own (the shared-memory channel above all: the host must see it close).
        os.closerange(3, 1 << 20)
        # One thread, no threads started: a thread's stack could not even be mapped under a tight memory limit.
        # SIGCHLD (the runner or an adopted orphan exited) wakes the poll below through the wakeup pipe.
        wake_read, wake_write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.set_wakeup_fd(wake_write, warn_on_full_buffer=False)
        signal.signal(signal.SIGCHLD, _ignore)
        for signum in _FORWARDED:
            signal.signal(signum, self._on_termination)
        signal.signal(signal.SIGALRM, self._on_grace_expired)
        _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != self.parent:
            self._end_all()  # the host died while this process started
        poller = select.poll()
        poller.register(wake_read, select.POLLIN)
        host = self._host_pidfd()
        if host is not None:
            poller.register(host, select.POLLIN)
        while True:
            status = self._reap()
            if status is not None:
                break
            for fd, _ in poller.poll():
                if fd == host:
                    self._end_all()
                with contextlib.suppress(BlockingIOError):
                    os.read(wake_read, 512)
        self._kill_descendants()
        _exit_as(status)

    def _reap(self) -> int | None:
        """Reap every exited child (adopted orphans included); the runner's wait status once it has exited."""
        found = None
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                if found is None:
                    os._exit(1)  # cannot happen while the runner's status is unread
                return found
            if pid == 0:
                return found
            if pid == self.runner:
                self.runner_exited = True
                found = status

    def _host_pidfd(self) -> int | None:
        if self.host_pid is None:
            return None
        try:
            return os.pidfd_open(self.host_pid)
        except ProcessLookupError:
            self._end_all()
        except (OSError, AttributeError):
            pass  # no pidfd here (kernel before 5.3): the parent-death signal remains
        return None

    def _kill_descendants(self) -> None:
        """SIGKILL every descendant, then reap them: an init that does not reap (a container's) must not inherit
        their zombies."""
        import time

        from ._reaper import kill_tree

        kill_tree(os.getpid(), include_root=False)
        deadline = time.monotonic() + _REAP_SECONDS
        while True:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return  # no child left
            if pid == 0:
                if time.monotonic() > deadline:
                    return  # one stuck in the kernel (state D): it dies when its call ends
                time.sleep(0.001)

    def _end_all(self) -> None:
        """The host is gone: kill the runner and everything below it, now."""
        self._kill_descendants()
        os._exit(128 + signal.SIGTERM)

    def _on_termination(self, signum: int, frame: object) -> None:
        del frame
        if os.getppid() != self.parent:
            self._end_all()  # the parent-death signal: no grace for a runner whose host is gone
        if self.runner_exited:
            return
        try:
            os.kill(self.runner, signum)
        except ProcessLookupError:
            return  # exited already: the wait loop finishes up
        signal.setitimer(signal.ITIMER_REAL, GRACE_SECONDS)

    def _on_grace_expired(self, signum: int, frame: object) -> None:
        del signum, frame
        from ._reaper import kill_tree

        kill_tree(os.getpid(), include_root=False)  # the wait loop then sees the runner killed by SIGKILL


def _ignore(signum: int, frame: object) -> None:
    del signum, frame  # a handler only so that SIGCHLD is delivered (and written to the wakeup pipe)


def _exit_as(status: int) -> None:
    """Exit with the runner's exit status, or die of the runner's signal (without a core dump of this process)."""
    if not os.WIFSIGNALED(status):
        os._exit(os.waitstatus_to_exitcode(status))
    signum = os.WTERMSIG(status)
    _prctl(_PR_SET_DUMPABLE, 0)  # a non-dumpable process never dumps core, whatever core_pattern says
    try:
        import resource

        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    except (ImportError, OSError, ValueError):
        pass
    with contextlib.suppress(OSError, ValueError):  # SIGKILL cannot be caught: it has the default disposition
        signal.signal(signum, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signum})
    signal.raise_signal(signum)  # delivered to this thread before raise returns
    os._exit(128 + signum)  # a signal whose default action is not to terminate (not expected)
