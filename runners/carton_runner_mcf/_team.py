"""A team of threads that run one compiled function together: the caller and ``size - 1`` persistent helpers.

`Team.run(function, args)` posts a run on the team's ``board`` (`_atomics.post`: the shared ``control`` array
reset, the run's generation published), and calls ``function(*args, control, worker, size)`` on every thread (the
caller is worker 0). The function releases the GIL and hands out its work with `_atomics.take` and separates its
phases with `_atomics.barrier`; helpers call `_atomics.depart` when done and the caller returns only after
`_atomics.wait_departures`, so no helper still reads or writes a shared array when `run` returns.

`Team.run_posting(function, args, serve=..., serves=...)` is a run whose caller posts it from compiled code: the
helpers call a compiled ``serve`` loop, ``serve(serves, control, board, epoch, seen, worker, size)``, which runs
the team function for each run posted on those arguments and stays in compiled code between them
(`_atomics.await_run`): the next run on the same ``serves`` (compared by identity) is posted by the caller's
compiled function without the GIL or a condition (`_atomics.claim`, `_atomics.post`), and the helper starts it at
once. Per-run values reach it through arrays among ``serves`` that the caller fills before the post. The loop
returns to Python when a run comes on other arguments, when the team closes, or after a few idle milliseconds.

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

from ._atomics import ABORT, GENERATION, await_post, board_size, control_size, post, recall

__all__ = ["CLAIM", "OK", "POSTED", "PREPARE", "UNCLAIMED", "Team", "TeamFailed"]

#: What a team function returns when every thread passed every barrier.
OK = 0
#: `Team.run_posting`'s ``mode``: the function prepares the run's inputs and claims the helpers waiting in their
#: loop, and posts the run itself when it could claim every one ...
CLAIM = 1
#: ... or it prepares the run's inputs and returns `UNCLAIMED` (the helpers are not in their loop on these
#: arguments: the team posts the run) ...
PREPARE = 2
#: ... or the run was posted already, after the function prepared its inputs: it runs its part only.
POSTED = 0
#: What a function run by `Team.run_posting` returns, before posting anything, when a helper was not waiting in its
#: loop (the team posts the run and calls it again with `POSTED`).
UNCLAIMED = -1


class TeamFailed(RuntimeError):
    """A run of the team was aborted (a helper failed, or a wait timed out); the team is not used again."""


class _Shared:
    """What the helpers see: the posted work and the board (kept apart from `Team` so helpers hold no reference to
    it and a dropped team is collected and stops them)."""

    def __init__(self, size: int) -> None:
        self.condition = threading.Condition()
        #: (function, args, serve, serves, epoch) of the last run posted through the condition.
        self.work: tuple[Callable[..., Any], tuple[Any, ...], Callable[..., int] | None, Any, int] | None = None
        self.closed = False
        self.failure: BaseException | None = None
        #: `_atomics.post`'s board: the last run's generation and epoch, and each helper's state. Written by the
        #: caller outside the condition for a run its helpers' compiled loops take, under it otherwise.
        self.board = np.zeros(board_size(size), dtype=np.int64)


def _helper(shared: _Shared, control: npt.NDArray[np.int64], worker: int, size: int) -> None:
    board = shared.board
    seen = 0
    poll = True
    while True:
        # A step's runs follow each other within microseconds to a millisecond: a helper that polls for the next
        # one starts it at once, where a wake-up from the condition costs a futex wake and a trip through the
        # scheduler per run. After a few idle milliseconds it sleeps (a compiled loop has polled already).
        if not (poll and await_post(board, seen)):
            with shared.condition:
                while board[GENERATION] == seen and not shared.closed:
                    shared.condition.wait()
        with shared.condition:
            if shared.closed:
                return
            generation = int(board[GENERATION])
            work = shared.work
        assert work is not None
        function, args, serve, serves, epoch = work
        try:
            if serve is None:
                function(*args, control, worker, size)
                seen, poll = generation, True
            else:
                seen, poll = serve(serves, control, board, epoch, generation - 1, worker, size), False
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
        self._shared = _Shared(size)
        self._serving: tuple[Any, Any] = (None, None)  # the loop and arguments of ``_epoch``
        self._epoch = 0
        self._threads: list[threading.Thread] = []
        self._broken = False
        self._lock = threading.Lock()  # one run at a time: the control array and the helpers serve one caller
        weakref.finalize(self, _close, self._shared)

    @property
    def board(self) -> npt.NDArray[np.int64]:
        """The board the team's runs are posted on (`_atomics.post`)."""
        return self._shared.board

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
            self._check()
            self._post(function, args, None, None)
            self._call(function, args, self.control, 0, self.size)

    def _check(self) -> None:
        """Raise `TeamFailed` when the team failed earlier or a helper has stopped; start the helpers first."""
        if self._broken:
            raise TeamFailed("the mcf runner's thread team failed earlier")
        if len(self._threads) != self.size - 1:
            self._start()
        for thread in self._threads:
            if not thread.is_alive():
                self._broken = True
                raise TeamFailed("a thread of the mcf runner's team has stopped")

    def _post(
        self, function: Callable[..., int], args: tuple[Any, ...], serve: Callable[..., int] | None, serves: Any
    ) -> None:
        """Post the run through the condition (helpers asleep, or about to leave their loop, or on other
        arguments: a new epoch), or only clear ``control`` when there are no helpers."""
        shared = self._shared
        if self.size == 1:
            self.control[:] = 0
            return
        with shared.condition:
            if serve is None or not self._serves(serve, serves):
                self._epoch += 1
                self._serving = (serve, serves)
            shared.work = (function, args, serve, serves, self._epoch)
            post(self.control, shared.board, self._epoch)
            shared.condition.notify_all()

    def run_posting(
        self, function: Callable[..., int], args: tuple[Any, ...], *, serve: Callable[..., int], serves: Any
    ) -> int:
        """A run whose caller posts it from compiled code: ``function(*args, epoch, mode)`` runs the caller's part
        (worker 0, on the team's ``control``, ``board`` and size, which ``args`` hold) and the helpers run their
        compiled loop ``serve`` on ``serves`` (module docstring), which runs the same team function on arguments
        that hold the same data as ``args``. It is called first with `CLAIM` when the helpers' loops run ``serve`` on
        ``serves`` already: it prepares the run's inputs (which the helpers read once the run is posted), claims
        the helpers (`_atomics.claim`) and posts the run on ``epoch`` itself (`_atomics.post`), so the helpers
        start before the caller's own part without the GIL or a condition; when one is not waiting there (or,
        with `PREPARE`, when the loops serve other arguments) it returns `UNCLAIMED` with the inputs prepared and
        nothing posted, and is called again with `POSTED` once the team has posted the run and woken the helpers.
        A status below `UNCLAIMED` means the function declined the run before posting it: it is returned. Raises
        `TeamFailed` as `run` does."""
        with self._lock:
            self._check()
            mode = CLAIM if self.size == 1 or self._serves(serve, serves) else PREPARE
            status = self._call(function, args, self._epoch, mode, declinable=True)
            if status != UNCLAIMED:
                return status
            self._post(function, args, serve, serves)
            return self._call(function, args, self._epoch, POSTED, declinable=True)

    def _call(self, function: Callable[..., int], args: tuple[Any, ...], *extra: Any, declinable: bool = False) -> int:
        """The caller's part of a run; its status when it declined the run before posting it (`declinable`: a
        `run_posting` function's `UNCLAIMED` or lower), else `OK`, or `TeamFailed`."""
        try:
            status = function(*args, *extra)
        except BaseException:
            self.control[ABORT] = 1
            self._broken = True
            raise
        if declinable and status <= UNCLAIMED:
            return status
        if status != OK or self.control[ABORT] != 0:
            self._broken = True
            raise TeamFailed("a run of the mcf runner's thread team was aborted") from self._shared.failure
        return OK

    def _serves(self, serve: Callable[..., int], serves: Any) -> bool:
        """Whether the helpers' compiled loops of the current epoch run ``serve`` on ``serves``."""
        return self._serving[0] is serve and self._serving[1] is serves

    def close(self) -> None:
        """Stop the helpers (they exit when idle; a team is also closed when collected)."""
        _close(self._shared)


def _close(shared: _Shared) -> None:
    with shared.condition:
        shared.closed = True
        recall(shared.board)  # a helper in its compiled loop returns to Python and sees the team closed
        shared.condition.notify_all()
