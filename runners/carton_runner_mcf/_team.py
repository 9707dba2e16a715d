"""A team of threads that run one compiled function together: the caller and ``size - 1`` persistent helpers.

`Team.run(function, args)` resets the shared ``control`` array (`_atomics`), wakes the helpers, and calls
``function(*args, control, worker, size)`` on every thread (the caller is worker 0). The function releases the GIL
and hands out its work with `_atomics.take` and separates its phases with `_atomics.barrier`; helpers call
`_atomics.depart` when done and the caller returns only after `_atomics.wait_departures`, so no helper still reads
or writes a shared array when `run` returns.

Plain Python threads, not a numba parallel region: every worker is an OS thread that exists for the team's life,
so a barrier never waits on work that was queued behind another (a TBB task arena may run two iterations of a
``prange`` one after the other on one thread, which would deadlock a barrier), and no OpenMP team spins on the
cores between tokens (a helper polls for the next run for a few milliseconds, yielding its core, then sleeps on a
condition). A helper that fails sets the abort flag; every wait then returns, `run` raises `TeamFailed`,
and the team refuses further runs.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from ._atomics import ABORT, SLOT, await_post, control_size

__all__ = ["OK", "Team", "TeamFailed"]

#: What a team function returns when every thread passed every barrier.
OK = 0


class TeamFailed(RuntimeError):
    """A run of the team was aborted (a helper failed, or a wait timed out); the team is not used again."""


class _Shared:
    """What the helpers see: the posted work and its generation (kept apart from `Team` so helpers hold no
    reference to it and a dropped team is collected and stops them)."""

    def __init__(self) -> None:
        self.condition = threading.Condition()
        self.generation = 0
        self.work: tuple[Callable[..., Any], tuple[Any, ...]] | None = None
        self.closed = False
        self.failure: BaseException | None = None
        #: ``posted[0]``: the generation, also written outside the condition so that a helper between runs can
        #: poll it in compiled code without the GIL (`_atomics.await_post`) before it sleeps on the condition.
        self.posted = np.zeros(SLOT, dtype=np.int64)


def _helper(shared: _Shared, control: npt.NDArray[np.int64], worker: int, size: int) -> None:
    seen = 0
    while True:
        # A step's runs follow each other within microseconds to a millisecond: a helper that polls for the next
        # one starts it at once, where a wake-up from the condition costs a futex wake and a trip through the
        # scheduler per run. After a few idle milliseconds it sleeps.
        if not await_post(shared.posted, seen):
            with shared.condition:
                while shared.generation == seen and not shared.closed:
                    shared.condition.wait()
        with shared.condition:
            if shared.closed:
                return
            seen = shared.generation
            work = shared.work
        assert work is not None
        function, args = work
        try:
            function(*args, control, worker, size)
        except BaseException as exc:
            shared.failure = exc
            control[ABORT] = 1
            return


class Team:
    """``size`` threads (the caller and ``size - 1`` helpers started on first use) with ``counters`` work counters
    per run."""

    def __init__(self, size: int, counters: int) -> None:
        self.size = size
        self.control = np.zeros(control_size(counters), dtype=np.int64)
        self._shared = _Shared()
        self._threads: list[threading.Thread] = []
        self._broken = False
        self._lock = threading.Lock()  # one run at a time: the control array and the helpers serve one caller
        weakref.finalize(self, _close, self._shared)

    @property
    def broken(self) -> bool:
        return self._broken

    def _start(self) -> None:
        for worker in range(1, self.size):
            thread = threading.Thread(
                target=_helper,
                args=(self._shared, self.control, worker, self.size),
                name=f"carton-mcf-{worker}",
                daemon=True,
            )
            thread.start()
            self._threads.append(thread)

    def run(self, function: Callable[..., int], args: tuple[Any, ...]) -> None:
        """``function(*args, control, worker, size)`` on every thread of the team; raises `TeamFailed` when a thread
        failed or the run was aborted."""
        with self._lock:
            self._run(function, args)

    def _run(self, function: Callable[..., int], args: tuple[Any, ...]) -> None:
        if self._broken:
            raise TeamFailed("the mcf runner's thread team failed earlier")
        if len(self._threads) != self.size - 1:
            self._start()
        if not all(thread.is_alive() for thread in self._threads):
            self._broken = True
            raise TeamFailed("a thread of the mcf runner's team has stopped")
        self.control[:] = 0
        shared = self._shared
        if self.size > 1:
            with shared.condition:
                shared.work = (function, args)
                shared.generation += 1
                shared.posted[0] = shared.generation
                shared.condition.notify_all()
        try:
            status = function(*args, self.control, 0, self.size)
        except BaseException:
            self.control[ABORT] = 1
            self._broken = True
            raise
        if status != OK or self.control[ABORT] != 0:
            self._broken = True
            raise TeamFailed("a run of the mcf runner's thread team was aborted") from shared.failure

    def close(self) -> None:
        """Stop the helpers (they exit when idle; a team is also closed when collected)."""
        _close(self._shared)


def _close(shared: _Shared) -> None:
    with shared.condition:
        shared.closed = True
        shared.posted[0] += 1
        shared.condition.notify_all()
