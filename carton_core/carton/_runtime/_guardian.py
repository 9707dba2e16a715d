"""The cgroup guardian: ``python -E -s -S _guardian.py PIDFD CGROUP``, started once by a host that puts its
runners in cgroups (`carton._runtime._cgroups`), with ``PIDFD`` an inherited pidfd of the host.

It waits for the host to exit, however it exits (SIGKILL included: the pidfd becomes readable), then kills every
process left in ``CGROUP`` (the host's ``carton-<pid>`` cgroup, the parent of its runners' cgroups) with
``cgroup.kill`` and removes the cgroups. A runner that killed its supervisor and disarmed its parent-death signal
dies then too. The same role as `multiprocessing`'s resource tracker: a process that cleans up after its parent.
It is started in the background by ``/bin/sh``, which exits at once: the guardian is nobody's child in the host.

Standard library only and started with ``-E -s -S``, like the sandbox shim: nothing of the environment steers it.
"""

from __future__ import annotations

import contextlib
import os
import select
import sys
import time
from pathlib import Path

__all__ = ["end", "kill", "main", "populated"]

#: How long the guardian waits for the killed processes to leave the cgroups before it removes them.
_EMPTY_SECONDS = 10.0


def _wait_for(pidfd: int) -> None:
    """Return once the process `pidfd` refers to has exited."""
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    while not poller.poll():
        pass


def populated(cgroup: str) -> bool:
    """Whether a process is left in `cgroup` or below it."""
    try:
        return "populated 1" in (Path(cgroup) / "cgroup.events").read_text()
    except OSError:
        return False


def kill(cgroup: str, wait_seconds: float) -> bool:
    """SIGKILL every process in `cgroup` and below it, and wait up to `wait_seconds` until none is left; ``False``
    when the cgroup is gone."""
    try:
        (Path(cgroup) / "cgroup.kill").write_text("1")
    except OSError:
        return False
    deadline = time.monotonic() + wait_seconds
    while populated(cgroup) and time.monotonic() < deadline:
        time.sleep(0.002)
    return True


def end(cgroup: str) -> None:
    """Kill every process in `cgroup` and below it, then remove the cgroups (deepest first)."""
    if not kill(cgroup, _EMPTY_SECONDS):
        return  # removed already: the host cleaned up after itself
    for directory, _subdirectories, _files in os.walk(cgroup, topdown=False):
        with contextlib.suppress(OSError):  # a process stuck in the kernel (state D) still in it: leave it
            Path(directory).rmdir()


def main(argv: list[str]) -> None:
    pidfd, cgroup = int(argv[0]), argv[1]
    _wait_for(pidfd)
    end(cgroup)


if __name__ == "__main__":
    main(sys.argv[1:])
