"""Process-tree control for Linux: parent-death signal, child subreaper, and killing a whole tree.

Used by the runner's supervisor and the runner loop (which adopt and kill their orphaned descendants) and by the
host (which kills a runner's tree when the runner does not exit on request). Without ``/proc`` or ``prctl`` these
degrade to no-ops, and a process group kill is all that remains.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import time
from pathlib import Path

__all__ = ["descendants", "kill_tree", "reap_children", "set_child_subreaper", "set_parent_death_signal"]

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
_PROC = Path("/proc")


def _prctl(option: int, value: int) -> bool:
    try:
        # libc is already loaded into the interpreter; find_library("c") would run ldconfig (~5 ms) on every call.
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return False
    prctl = getattr(libc, "prctl", None)
    if prctl is None:
        return False
    return int(prctl(option, ctypes.c_ulong(value), 0, 0, 0)) == 0


def set_parent_death_signal(signum: int) -> bool:
    """Ask the kernel to send `signum` to this process when the thread that started it exits."""
    return _prctl(_PR_SET_PDEATHSIG, signum)


def set_child_subreaper() -> bool:
    """Make orphaned descendants re-parent to this process instead of init, so it can find and kill them."""
    return _prctl(_PR_SET_CHILD_SUBREAPER, 1)


def _parents() -> dict[int, int]:
    parents: dict[int, int] = {}
    try:
        entries = list(_PROC.iterdir())
    except OSError:
        return parents
    for entry in entries:
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_bytes()
        except OSError:
            continue  # exited while we looked
        # The command name is in parentheses and may itself hold spaces or parentheses: split after the last ')'.
        fields = stat[stat.rfind(b")") + 2 :].split()
        if len(fields) > 1:
            parents[int(entry.name)] = int(fields[1])
    return parents


def descendants(pid: int) -> list[int]:
    """Every process below `pid` in the parent tree, found through /proc (parents before children)."""
    children: dict[int, list[int]] = {}
    for child, parent in _parents().items():
        children.setdefault(parent, []).append(child)
    found: list[int] = []
    frontier = [pid]
    while frontier:
        current = frontier.pop()
        for child in children.get(current, ()):
            found.append(child)
            frontier.append(child)
    return found


def reap_children() -> None:
    """Collect every exited child of this process (adopted orphans included) so none stays a zombie."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def kill_tree(pid: int, *, include_root: bool = True, rounds: int = 50) -> None:
    """SIGKILL `pid` (optionally) and all its descendants, stopping them first so none can fork past the sweep.

    Stopped processes cannot fork and stopped parents do not die, so the tree stays put while it is walked; each
    round stops what is new, until a round finds nothing new.
    """
    stopped: set[int] = set()
    root = [pid] if include_root else []
    for _ in range(rounds):
        found = [*root, *descendants(pid)]
        fresh = [member for member in found if member not in stopped]
        if not fresh:
            break
        for member in fresh:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(member, signal.SIGSTOP)
            stopped.add(member)
        time.sleep(0.001)
    for member in stopped:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(member, signal.SIGKILL)
