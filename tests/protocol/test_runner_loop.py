"""The runner loop's own path for a learnt request layout (`carton_protocol._loop`): every answer, error and check
as the general path gives it, whatever the id's width, and whichever way the outputs change."""

from __future__ import annotations

import itertools
from typing import Any

import carton
import numpy as np
import pytest
from carton._runtime._process import RunnerProcess
from carton_protocol import ErrorReply, InferReply
from carton_protocol._loop import INLINE_MAX_ENV

from .conftest import TEST_ENV
from .test_process import Start, assert_four_calls_overlap

# Ids of one byte (the general path), of two and three, and of four (a long-running host's).
FIRST_IDS = [1, 200, 70_000]


def _start(start_runner: Start, first_id: int, **kwargs: Any) -> RunnerProcess:
    runner = start_runner("Shifty", **kwargs)
    connection = runner._resources.connection
    assert connection is not None
    connection.next_id = itertools.count(first_id).__next__
    return runner


def _x(how: float) -> np.ndarray:
    return np.array([how, 2, 3, 4], dtype=np.float32)


def _echo(runner: RunnerProcess, times: int = 1) -> None:
    for _ in range(times):
        outputs = runner.infer({"x": _x(0)})
        assert list(outputs) == ["y"] and outputs["y"].dtype == np.float32 and outputs["y"].tolist() == [0, 2, 3, 4]


@pytest.mark.parametrize("first_id", FIRST_IDS)
def test_outputs_in_any_layout_come_back_as_returned(start_runner: Start, first_id: int) -> None:
    runner = _start(start_runner, first_id)
    _echo(runner, times=3)  # learnt, matched, then the loop's own path
    x = _x(2)
    for how, check in (
        (2, lambda out: out["y"].shape == (4, 1) and out["y"].ravel().tolist() == x.tolist()),
        (5, lambda out: out["y"].tolist() == [5, 2, 3, 4]),
        (6, lambda out: sorted(out) == ["inline", "y"] and bool(out["inline"][0])),
        (7, lambda out: list(out) == ["y"] and out["y"].tolist() == [7, 2, 3, 4]),
        (8, lambda out: list(out) == ["z"] and out["z"].tolist() == [8, 2, 3, 4]),
        (9, lambda out: out["y"].dtype == np.float64 and out["y"].tolist() == [9, 2, 3, 4]),
    ):
        outputs = runner.infer({"x": _x(how)})
        assert check(outputs), (how, outputs)
        _echo(runner, times=2)  # relearnt, then the loop's own path again
    assert runner.alive


@pytest.mark.parametrize("first_id", FIRST_IDS)
def test_failures_in_a_learnt_layout_are_the_general_paths(start_runner: Start, first_id: int) -> None:
    runner = _start(start_runner, first_id)
    _echo(runner, times=3)
    for how, error, message in (
        (1, carton.RunnerFailed, "ValueError: shifty refuses"),
        (3, carton.InvalidOutput, "returned a list, expected a mapping"),
        (4, carton.InvalidOutput, "'y': numpy dtype complex64 has no wire type"),
    ):
        with pytest.raises(error, match=message):
            runner.infer({"x": _x(how)})
        _echo(runner, times=2)
    assert runner.alive


@pytest.mark.parametrize("first_id", FIRST_IDS)
def test_a_learnt_request_is_still_checked_against_its_data(start_runner: Start, first_id: int) -> None:
    runner = _start(start_runner, first_id)
    _echo(runner, times=3)
    connection = runner._resources.connection
    assert connection is not None
    x = _x(0)
    for data, message in (
        ([b"\0" * 12], "tensor 'x': data frame is 12 bytes, header says 16"),
        ([b"\0" * 20], "tensor 'x': data frame is 20 bytes, header says 16"),
        ([], "message has 0 data frames, the header accounts for 1"),
        ([x.tobytes(), x.tobytes()], "message has 2 data frames, the header accounts for 1"),
    ):
        outgoing = connection.codec.encode_tensors(connection.next_id(), {"x": x})
        received = connection.exchange([outgoing.parts[0], *data], outgoing.id, timeout=5)
        reply = received.message
        assert isinstance(reply, ErrorReply) and reply.id == outgoing.id
        assert reply.code == "protocol" and message in reply.message
        _echo(runner)
        _echo(runner)
    # The learnt path's reply is the general one's, id included.
    outgoing = connection.codec.encode_tensors(connection.next_id(), {"x": x})
    received = connection.exchange(outgoing.parts, outgoing.id, timeout=5)
    assert isinstance(received.message, InferReply) and received.message.id == outgoing.id
    assert connection.codec.tensors(received)["y"].tolist() == [0, 2, 3, 4]


@pytest.mark.parametrize("first_id", FIRST_IDS)
def test_ids_crossing_a_width_keep_their_answers(start_runner: Start, first_id: int) -> None:
    runner = _start(start_runner, first_id)
    connection = runner._resources.connection
    assert connection is not None
    for start in (first_id, 120, 250, 65530, 2**32 - 3):
        connection.next_id = itertools.count(start).__next__
        for _ in range(8):
            _echo(runner)


def test_a_concurrent_runner_sends_a_learnt_call_after_a_long_one_to_the_pool(start_runner: Start) -> None:
    # As `test_concurrent_runner_runs_short_calls_on_its_socket_thread`, on the learnt path (one input, four-byte ids).
    runner = _start(start_runner, 70_000, threads=4, extra_env={**TEST_ENV, INLINE_MAX_ENV: "0.05"})

    def inline(sleep: float) -> bool:
        if sleep:
            runner.infer({"x": _x(-sleep)})
        return bool(runner.infer({"x": _x(6)})["inline"][0])

    _echo(runner, times=3)
    assert [inline(0), inline(0)] == [True, True]
    assert not inline(0.3)  # after a long call: the pool
    assert [inline(0), inline(0)] == [True, True]


def test_a_concurrent_runner_overlaps_learnt_calls_after_a_short_one(start_runner: Start) -> None:
    runner = _start(start_runner, 70_000, threads=4)
    _echo(runner, times=3)

    def call() -> None:
        assert runner.infer({"x": _x(-0.4)})["y"][0] == np.float32(-0.4)

    assert_four_calls_overlap(call)
