"""How a runner process ended, and what must be released however it ends."""

from __future__ import annotations

import contextlib
import os
import re
import signal
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from carton_protocol import kill_tree

from ._connection import Connection
from ._launch import remove_runtime_dir

__all__ = ["Resources", "describe_exit", "exit_signal", "memory_limit_hit"]

# What an allocation or mapping failure says: Python, the dynamic loader (a library that cannot be mapped, e.g.
# "libstdc++.so.6: failed to map segment from shared object"), strerror(ENOMEM), C++ and allocators.
_MEMORY_FAILURE = re.compile(
    r"MemoryError|failed to map segment|cannot allocate memory|\bENOMEM\b|std::bad_alloc|out of memory", re.IGNORECASE
)


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


def memory_limit_hit(limits: Mapping[str, float], *texts: str) -> str | None:
    """``memory_bytes=N`` when the runner had a memory limit and one of `texts` (its error, its log) shows an
    allocation or mapping failure: the limit is then the likely reason it could not start or load."""
    memory = limits.get("memory_bytes")
    if memory is None or not any(_MEMORY_FAILURE.search(text) for text in texts):
        return None
    return f"memory_bytes={memory:.0f}"


class Resources:
    """What must be released however the RunnerProcess ends; held by its finalizer, so no reference to it."""

    def __init__(self, runtime_dir: Path) -> None:
        self.runtime_dir = runtime_dir
        self.process: Any = None
        self.pidfd: int | None = None
        self.connection: Connection | None = None
        # A child forked from the host inherits this object and its finalizer: the runner is not its to kill.
        self.owner_pid = os.getpid()

    def kill(self) -> None:
        if os.getpid() != self.owner_pid:
            return
        process = self.process
        if process is not None and process.poll() is None:
            kill_tree(process.pid)
        if process is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                # Descendants that stayed in the runner's process group (it is its own session leader).
                os.killpg(process.pid, signal.SIGKILL)
            with contextlib.suppress(Exception):
                process.wait(timeout=5)

    def release(self) -> None:
        if os.getpid() != self.owner_pid:
            return
        self.kill()
        if self.connection is not None:
            self.connection.close()
            self.connection = None
        if self.pidfd is not None:
            with contextlib.suppress(OSError):
                os.close(self.pidfd)
            self.pidfd = None
        remove_runtime_dir(self.runtime_dir)
