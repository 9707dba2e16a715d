"""The thread team's compiled helper loop (`_team`, `_atomics.await_run`): helpers stay in it while a run's arguments
do not change, leave it for other arguments, when idle (and come back), when a run fails, and when the team closes
while they wait in it; every run still does all its work once with the values the caller gave it."""

from __future__ import annotations

import time

import numpy as np
import pytest

numba = pytest.importorskip("numba", reason="numba is not installed (pip install 'carton-runtime[mcf]')")
from carton_runner_mcf import _atomics, _team  # noqa: E402 - after the skip
from carton_runner_mcf._packed import KERNELS_ENV, compiled_kernels  # noqa: E402

pytestmark = pytest.mark.skipif(compiled_kernels("auto") is None, reason=f"{KERNELS_ENV} forces the numpy path")

UNITS = 3000


@numba.njit(nogil=True)
def _mark(into, steps, control, worker, team):  # type: ignore[no-untyped-def]
    """Units of counter 0 until ``into``'s rows are spent, each marked with the run's value ``steps[0]`` and the
    worker that took it; worker 0 waits for the others' departures (1 if it gave up), they depart."""
    while True:
        unit = _atomics.take(control, 0)
        if unit >= into.shape[0]:
            break
        into[unit, 0] = steps[0]
        into[unit, 1] = worker
    if worker == 0:
        return 0 if _atomics.wait_departures(control, team) else 1
    _atomics.depart(control)
    return 0


@numba.njit(nogil=True)
def _serve_marks(serves, control, board, epoch, seen, worker, team):  # type: ignore[no-untyped-def]
    """A helper's loop of `_mark` runs (counting its entries in ``entries``); it raises in the run whose value is
    ``fail[0]``. With ``stay[0]`` it does not leave when idle (so that its entries do not depend on how fast the
    caller posts): it waits on in `_atomics.await_run`, which takes the next run on its epoch however it comes."""
    into, steps, entries, fail, stay = serves
    entries[worker] += 1
    while True:
        generation = _atomics.await_run(board, epoch, seen, worker)
        if generation == seen:
            if stay[0] and _atomics.atomic_load(board, _atomics.EPOCH) == epoch:
                continue
            return seen
        seen = generation
        if steps[0] == fail[0]:
            raise RuntimeError("helper failed")
        _mark(into, steps, control, worker, team)


@numba.njit(nogil=True)
def _posting_mark(into, steps, value, control, board, team, epoch, mode):  # type: ignore[no-untyped-def]
    """`_mark` as `_team.Team.run_posting` runs it: unless the run was posted already, the caller declines a negative
    ``value``, else writes it into ``steps`` (late: after a few hundred microseconds of polls, so that a helper that
    started the run before would mark an older value), then claims the helpers and posts the run itself, or not."""
    if mode != _team.POSTED:
        if value < 0:
            return value
        for _ in range(5000):
            _atomics.atomic_load(steps, 0)
        steps[0] = value
        if mode != _team.CLAIM or not _atomics.claim(board, team):
            return _team.UNCLAIMED
        _atomics.post(control, board, epoch)
    return _mark(into, steps, control, 0, team)


def _serves(threads: int, *, fail: int = -1, stay: bool = False) -> tuple[np.ndarray, ...]:
    into = np.zeros((UNITS, 2), np.int64)
    return into, np.zeros(1, np.int64), np.zeros(threads, np.int64), np.array([fail], np.int64), np.array([stay])


def _run(team: _team.Team, serves: tuple[np.ndarray, ...], value: int) -> None:
    """A run of `_mark` with ``value`` that the caller posts from compiled code when the helpers wait in their loop
    (`_team.Team.run_posting`), as the decode step's runs are."""
    into, steps = serves[0], serves[1]
    into[:] = 0
    args = (into, steps, value, team.control, team.board, team.size)
    assert team.run_posting(_posting_mark, args, serve=_serve_marks, serves=serves) == _team.OK
    np.testing.assert_array_equal(into[:, 0], value)  # every unit once, with this run's value


def _idle(team: _team.Team) -> None:
    """Wait until every helper has left its compiled loop after idling."""
    board = team._shared.board
    deadline = time.monotonic() + 60
    while any(board[_atomics.SLOT * worker] != _atomics.IDLE for worker in range(1, team.size)):
        assert time.monotonic() < deadline, "a helper never left its loop"
        time.sleep(0.01)


@pytest.mark.parametrize("threads", [2, 3])
def test_helpers_stay_in_their_loop_until_the_arguments_change(threads: int) -> None:
    team = _team.Team(threads, 1)
    first, second = _serves(threads, stay=True), _serves(threads, stay=True)
    for value in range(1, 40):
        _run(team, first, value)
    assert list(first[2][1:]) == [1] * (threads - 1)  # entered once, for every run on the same arguments
    for value in range(40, 50):
        _run(team, second, value)
    assert list(second[2][1:]) == [1] * (threads - 1)
    _run(team, first, 50)  # back to the first arguments: a new entry
    assert list(first[2][1:]) == [2] * (threads - 1)
    team.close()


def test_plain_runs_and_loop_runs_mix() -> None:
    team = _team.Team(2, 1)
    serves = _serves(2, stay=True)
    into, steps = np.zeros((UNITS, 2), np.int64), np.array([7], np.int64)
    for value in range(1, 4):
        _run(team, serves, value)
        team.run(_mark, (into, steps))
        np.testing.assert_array_equal(into[:, 0], 7)
    assert serves[2][1] == 3  # a plain run on the helpers takes them out of their loop
    team.close()


def test_idle_helpers_leave_their_loop_and_come_back() -> None:
    team = _team.Team(2, 1)
    serves = _serves(2)
    _run(team, serves, 1)
    _idle(team)
    _run(team, serves, 2)
    assert serves[2][1] == 2
    team.close()


def test_a_helper_failing_in_its_loop_ends_the_run() -> None:
    team = _team.Team(2, 1)
    serves = _serves(2, fail=3, stay=True)
    _run(team, serves, 1)
    _run(team, serves, 2)
    start = time.monotonic()
    with pytest.raises(_team.TeamFailed) as failed:
        _run(team, serves, 3)
    assert time.monotonic() - start < 10
    assert isinstance(failed.value.__cause__, RuntimeError)
    assert team.broken
    with pytest.raises(_team.TeamFailed):
        _run(team, serves, 4)


@pytest.mark.parametrize("idle", [False, True])
def test_closing_stops_helpers_waiting_in_their_loop_or_asleep(idle: bool) -> None:
    team = _team.Team(3, 1)
    serves = _serves(3)
    _run(team, serves, 1)
    if idle:
        _idle(team)
    team.close()
    for thread in team._threads:
        thread.join(timeout=30)
        assert not thread.is_alive()


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_a_run_its_caller_posts_from_compiled_code_reads_the_inputs_the_caller_prepared(threads: int) -> None:
    """`Team.run_posting`: whether the caller posts the run (helpers in their loop), or the team does (their first
    run on these arguments, or after they left their loop when idle), every unit of every run is marked once with
    that run's value; a run the caller declines before posting returns its status and leaves the team usable."""
    team = _team.Team(threads, 1)
    serves = _serves(threads)
    into, steps = serves[0], serves[1]

    def run(value: int) -> int:
        into[:] = 0
        args = (into, steps, value, team.control, team.board, team.size)
        return team.run_posting(_posting_mark, args, serve=_serve_marks, serves=serves)

    for value in range(1, 31):
        if value % 10 == 0 and threads > 1:
            _idle(team)
        assert run(value) == _team.OK
        np.testing.assert_array_equal(into[:, 0], value)
    assert run(-5) == -5
    np.testing.assert_array_equal(into[:, 0], 0)  # nothing ran
    assert run(31) == _team.OK
    np.testing.assert_array_equal(into[:, 0], 31)
    team.close()


@numba.njit(nogil=True)
def _clock():  # type: ignore[no-untyped-def]
    return _atomics.monotonic_ns()


def test_the_waits_clock_is_the_monotonic_clock() -> None:
    """The waits' windows (a helper's idle polling, a barrier's spinning and yielding) are measured on
    `_atomics.monotonic_ns`, read from compiled code: the clock `time.monotonic_ns` reads, in nanoseconds."""
    for _ in range(3):
        before = time.monotonic_ns()
        now = _clock()
        after = time.monotonic_ns()
        assert before <= now <= after
