"""How a runner process ended (its status, and the CPU time its tree used), and what must be released however it
ends: the process tree (its cgroup when it has one), the connection, the runtime directory.

The host reaps the process it started itself, with ``wait4``: the resource usage that comes with the status covers
that process and every descendant that was reaped below it, the runner included when its supervisor reaped it. That
is the accounting a limit verdict rests on (`RunnerProcess._gone_error`): a runner that SIGKILLs itself, or kills its
supervisor, has not used its CPU time, and is not reported as over its limit.
"""

from __future__ import annotations

import contextlib
import os
import re
import select
import signal
import subprocess
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass

from carton_protocol import descendants, kill_tree

from ._cgroups import RunnerCgroup
from ._connection import Connection
from ._launch import RuntimeDir

__all__ = ["Exit", "Resources", "describe_exit", "exit_signal", "memory_failure"]

# What an allocation or mapping failure says: Python, the dynamic loader (a library that cannot be mapped, e.g.
# "libstdc++.so.6: failed to map segment from shared object"), strerror(ENOMEM), C++ and allocators.
_MEMORY_FAILURE = re.compile(
    r"MemoryError|failed to map segment|cannot allocate memory|\bENOMEM\b|std::bad_alloc|out of memory", re.IGNORECASE
)
#: A quoted line is cut to this many characters.
_LINE_CHARS = 300
# waitid's "the id is a pidfd" (Linux 5.4, Python 3.9); None where either is missing.
_P_PIDFD: int | None = getattr(os, "P_PIDFD", None)
# What `running` asks of the pidfd: has it exited, without waiting and without reaping it.
_PEEK = os.WEXITED | os.WNOHANG | os.WNOWAIT
_waitid = os.waitid


@dataclass(frozen=True, slots=True)
class Exit:
    """How the process the host started ended: ``returncode`` as `subprocess` reports it (``-N``: signal N), and
    ``cpu_seconds``, the user and system CPU time of that process and of every descendant reaped below it (``None``
    when the status was collected elsewhere and the usage is unknown)."""

    returncode: int
    cpu_seconds: float | None


def exit_signal(returncode: int | None, signal_base: int | None) -> int | None:
    """The signal that ended the runner: a negative status, or ``signal_base + N`` from a sandbox wrapper."""
    if returncode is None:
        return None
    if returncode < 0:
        return -returncode
    if signal_base is not None and signal_base < returncode < signal_base + 65:
        return returncode - signal_base
    return None


def describe_exit(returncode: int | None, signal_base: int | None = None) -> str:
    if returncode is None:
        return "is still running"
    signum = exit_signal(returncode, signal_base)
    if signum is not None:
        try:
            name = signal.Signals(signum).name
        except ValueError:
            name = f"signal {signum}"
        return f"was killed by {name}"
    return f"exited with status {returncode}"


def memory_failure(limits: Mapping[str, float], *texts: str) -> str | None:
    """When the runner had a memory limit, the line of `texts` (its error, its log) that shows an allocation or
    mapping failure, the last one when there are several: the limit is then the likely reason it could not start,
    load or answer, and that line says why. ``None`` without a limit or without such a line."""
    if limits.get("memory_bytes") is None:
        return None
    for text in reversed(texts):
        for line in reversed(text.splitlines()):
            if _MEMORY_FAILURE.search(line):
                line = line.strip()
                return line if len(line) <= _LINE_CHARS else line[: _LINE_CHARS - 3] + "..."
    return None


class Resources:
    """What must be released however the RunnerProcess ends; held by its finalizer, so no reference to it."""

    def __init__(self, runtime: RuntimeDir, cgroup: RunnerCgroup | None) -> None:
        self.runtime = runtime
        self.cgroup = cgroup
        self.process: subprocess.Popen[bytes] | None = None
        self.pidfd: int | None = None
        self.connection: Connection | None = None
        #: How the started process ended, once the host reaped it.
        self.exit: Exit | None = None
        # Without a cgroup: the runner's own process (a host pid under policy none), checked to be the supervisor's
        # child at the handshake, so that a runner that killed its supervisor still dies with its tree.
        self._runner: tuple[int, int] | None = None
        self._reap_lock = threading.Lock()
        # A child forked from the host inherits this object and its finalizer: the runner is not its to kill.
        self.owner_pid = os.getpid()

    # --- the started process ---------------------------------------------------------------------------------
    def poll(self) -> int | None:
        """The started process's status once it has exited (reaping it, with its resource usage), else ``None``."""
        with self._reap_lock:
            if self.exit is not None:
                return self.exit.returncode
            process = self.process
            if process is None:
                return None
            if process.returncode is None:
                try:
                    pid, status, usage = os.wait4(process.pid, os.WNOHANG)
                except ChildProcessError:
                    process.poll()  # reaped through another handle: subprocess knows nothing more either
                else:
                    if pid == 0:
                        return None
                    process.returncode = os.waitstatus_to_exitcode(status)
                    self.exit = Exit(process.returncode, usage.ru_utime + usage.ru_stime)
                    return process.returncode
            if process.returncode is None:
                return None
            self.exit = Exit(process.returncode, None)
            return process.returncode

    def running(self) -> bool:
        """Whether the started process still runs: checked on its pidfd without the reaping lock (one system call,
        on every call of a model), and through `poll` (which reaps it) once it has exited or without a pidfd."""
        pidfd = self.pidfd
        if pidfd is not None and self.exit is None and _P_PIDFD is not None:
            try:
                if _waitid(_P_PIDFD, pidfd, _PEEK) is None:
                    return True
            except OSError:  # closed meanwhile, or reaped through another handle: `poll` knows
                pass
        return self.poll() is None

    def wait(self, timeout: float) -> Exit | None:
        """`poll` until the started process has exited or `timeout` seconds passed; its `Exit` or ``None``."""
        deadline = time.monotonic() + timeout
        while self.poll() is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            pidfd = self.pidfd
            if pidfd is None or not _readable(pidfd, min(remaining, 0.1)):
                time.sleep(min(remaining, 0.005))  # no pidfd (or closed meanwhile): poll the process
        return self.exit

    def watch_runner(self, pid: int) -> None:
        """Hold the runner's own process (`pid`, from its hello) when it is the supervisor's child on this host."""
        process = self.process
        if process is None or self._runner is not None:
            return
        try:
            pidfd = os.pidfd_open(pid)
        except (OSError, ValueError, OverflowError, AttributeError):
            return  # not a pid of this namespace (a sandbox's), or gone already
        if pid not in descendants(process.pid):  # checked once the pidfd is open: the pid cannot be reused since
            os.close(pidfd)
            return
        self._runner = (pid, pidfd)

    # --- ending --------------------------------------------------------------------------------------------
    def kill(self) -> None:
        """SIGKILL the runner's whole tree: its cgroup when it has one; else the started process's descendants, its
        process group and the runner itself. Then reap the started process."""
        if os.getpid() != self.owner_pid:
            return
        if self.cgroup is not None:
            self.cgroup.kill()
        process = self.process
        if process is not None and self.poll() is None:
            kill_tree(process.pid)
        if process is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                # Descendants that stayed in the runner's process group (it is its own session leader).
                os.killpg(process.pid, signal.SIGKILL)
        if self._runner is not None:
            runner, pidfd = self._runner
            if not _readable(pidfd, 0):  # still running: its pid is still its own
                kill_tree(runner)
            with contextlib.suppress(OSError):
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        if process is not None:
            self.wait(5.0)

    def release(self) -> None:
        if os.getpid() != self.owner_pid:
            return
        self.kill()
        if self.connection is not None:
            self.connection.close()
            self.connection = None
        for pidfd in (self.pidfd, None if self._runner is None else self._runner[1]):
            if pidfd is not None:
                with contextlib.suppress(OSError):
                    os.close(pidfd)
        self.pidfd = None
        self._runner = None
        self.runtime.remove()
        if self.cgroup is not None:
            self.cgroup.remove()


def _readable(pidfd: int, timeout: float) -> bool:
    """Whether the process `pidfd` refers to has exited, waiting up to `timeout` seconds; ``False`` when the
    descriptor is no longer usable."""
    poller = select.poll()
    try:
        poller.register(pidfd, select.POLLIN)
        events = poller.poll(int(timeout * 1000))
    except (OSError, ValueError):
        return False
    return any(event & select.POLLIN for _, event in events)  # not POLLNVAL: a descriptor closed meanwhile
