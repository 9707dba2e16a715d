"""`RunnerProcess.infer_async` on the event loop itself: replies, crashes, timeouts, cancellation, closing."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import carton
import numpy as np
import pytest
from carton._runtime import _connection, _process
from carton._runtime._connection import AsyncChannel
from carton._runtime._process import RunnerProcess

from .test_process import wait_dead

Start = Callable[..., RunnerProcess]


def channels(runner: RunnerProcess) -> list[AsyncChannel]:
    return list(runner._channels.values())


def test_calls_run_on_the_loop_without_a_thread_pool(start_runner: Start) -> None:
    runner = start_runner("Echo")

    async def main() -> list[dict[str, Any]]:
        calls = [runner.infer_async({"x": np.full((1, 16), i, np.float32)}) for i in range(50)]
        results = list(await asyncio.gather(*calls))
        assert len(channels(runner)) == 1
        return results

    results = asyncio.run(main())
    assert [float(result["x"][0, 0]) for result in results] == [float(i) for i in range(50)]
    assert runner._executor is None  # no thread hand-off
    results[0]["x"][0, 0] = 5.0  # outputs are the caller's to write


def test_no_reply_is_left_unread_whatever_the_order_of_sends_and_replies(start_runner: Start) -> None:
    """ZeroMQ's descriptor is edge-triggered, and a drain that answered every call stops without asking the socket
    again: every way a reply can come (alone after the loop went idle, while other calls are being sent, in bursts
    of many, after a call was given up) must still wake its call. A reply left unread would hang its call; the
    generous `wait_for` turns that into a failure instead of a stuck test."""
    runner = start_runner("ConcurrentEcho", threads=4)
    rng = np.random.default_rng(7)

    async def one(i: int, sleep: float) -> int:
        outputs = await runner.infer_async({"sleep": np.array([sleep]), "i": np.array([i])})
        return int(outputs["i"][0])

    async def main() -> None:
        # One call at a time, the loop idle in between: each reply comes into a pipe the last call left awake.
        for i in range(30):
            assert await one(i, 0.0) == i
            await asyncio.sleep(0.002 * (i % 3))
        # Bursts: replies (some at once, some after a sleep) arrive while the rest of the burst is still being sent.
        for burst in range(20):
            size = int(rng.integers(1, 40))
            sleeps = rng.choice([0.0, 0.0, 0.001, 0.005], size=size)
            ids = [1000 * burst + k for k in range(size)]
            assert await asyncio.gather(*(one(i, float(t)) for i, t in zip(ids, sleeps, strict=True))) == ids
            # A call started while the burst's last replies are still arriving, and one after the loop went idle.
            assert await one(-burst, 0.0) == -burst
        # A call given up (its reply comes later, to nobody), then calls on either side of that reply.
        slow = asyncio.ensure_future(one(-1, 0.05))
        await asyncio.sleep(0.01)
        slow.cancel()
        assert await one(7, 0.0) == 7
        while channels(runner)[0]._orphans:  # its reply comes to nobody, the loop idle, whenever the runner sends it
            await asyncio.sleep(0.01)
        assert await one(8, 0.0) == 8
        assert not channels(runner)[0]._pending and not channels(runner)[0]._orphans

    asyncio.run(asyncio.wait_for(main(), 30))
    assert runner.alive


def test_a_lone_call_polls_once_and_its_reply_is_read_without_a_poll(
    start_runner: Start, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loop's system calls per call (docs/performance.md, "the hop, ninth pass"): a lone call makes one
    `zmq_poll`, the send's (the socket and the runner's pidfd); its reply, which woke the loop, is read by a receive
    that does not block, with no poll in front of it; and asyncio is asked for the running loop once, to find the
    loop's channel (on Python 3.11 every ask is a `getpid`), not again by the channel's send."""
    runner = start_runner("Echo")
    counts = {"zmq_poll": 0, "get_running_loop": 0}
    real_poll, real_loop = _connection.zmq_poll, asyncio.get_running_loop

    def zmq_poll(items: Any, timeout: int) -> Any:
        counts["zmq_poll"] += 1
        return real_poll(items, timeout)

    def get_running_loop() -> asyncio.AbstractEventLoop:
        counts["get_running_loop"] += 1
        return real_loop()

    monkeypatch.setattr(_connection, "zmq_poll", zmq_poll)
    monkeypatch.setattr(asyncio, "get_running_loop", get_running_loop)
    x = {"x": np.arange(16, dtype=np.float32)}

    async def main() -> None:
        for _ in range(3):  # the channel made, the reply's layout learnt
            await runner.infer_async(x)
        counts.update(zmq_poll=0, get_running_loop=0)
        for i in range(20):
            output: Any = (await runner.infer_async({"x": np.full(16, i, np.float32)}))["x"]
            assert output.tolist() == [float(i)] * 16
            if i % 5 == 0:
                await asyncio.sleep(0.01)  # the loop idle in between: the reply comes in a pipe left quiet

    asyncio.run(asyncio.wait_for(main(), 30))
    assert counts == {"zmq_poll": 20, "get_running_loop": 20}


def test_a_wake_up_without_a_message_reads_nothing_and_the_next_reply_still_wakes_its_call(start_runner: Start) -> None:
    """The loop's reader reads first with a receive that does not block: woken by a signal that brought no message
    (ZeroMQ signals more than replies), it finds nothing, raises nothing, and leaves the socket so that the next
    reply signals again (a call left waiting would hang: the `wait_for` turns that into a failure)."""
    runner = start_runner("Echo")
    x = {"x": np.arange(4, dtype=np.int64)}

    async def main() -> None:
        await runner.infer_async(x)
        channel = channels(runner)[0]
        for _ in range(3):
            channel._drain(True)  # as the reader would be called, with nothing on the socket
            output: Any = (await runner.infer_async(x))["x"]
            assert output.tolist() == [0, 1, 2, 3]
            await asyncio.sleep(0.01)
        assert not channel._pending and channel._unanswered == 0

    asyncio.run(asyncio.wait_for(main(), 30))


def test_each_loop_gets_its_own_channel_and_a_finished_loop_releases_it(start_runner: Start) -> None:
    runner = start_runner("Echo")
    x = {"x": np.arange(4, dtype=np.int64)}
    for _ in range(3):
        output: Any = asyncio.run(runner.infer_async(x))["x"]
        assert output.tolist() == [0, 1, 2, 3]
    gc.collect()
    # The loops of the first runs are gone: their channels (weakly keyed by loop) went with them.
    assert len(channels(runner)) <= 1
    # The sync path still works next to the async one.
    output = runner.infer(x)["x"]
    assert output.tolist() == [0, 1, 2, 3]


def test_many_types_layouts_and_errors_through_the_async_path(start_runner: Start) -> None:
    runner = start_runner("Echo")
    failing = start_runner("Fail")
    inputs: list[dict[str, Any]] = [
        {"x": np.ones((2, 3), np.float32)},
        {"s": np.array(["a", "bé"]), "n": [np.ones(2), np.zeros((1, 1))]},
        {"x": np.ones((2, 3), np.float32), "b": np.array([True, False])},
        {"big": np.ones(1 << 16, np.uint8)},  # shared memory, still on the loop (under the copy limit)
    ]

    async def main() -> None:
        for tensors in inputs:
            for _ in range(2):  # the second time through the header templates
                outputs = await runner.infer_async(tensors)
                assert outputs.keys() == tensors.keys()
        with pytest.raises(carton.RunnerFailed, match="cannot handle this input"):
            await failing.infer_async({"x": np.ones(1)})
        with pytest.raises(carton.InvalidInput, match="complex"):
            await runner.infer_async({"x": np.ones(2, np.complex64)})

    asyncio.run(main())


def test_large_requests_take_the_thread_pool(start_runner: Start) -> None:
    runner = start_runner("Echo")
    x = np.random.default_rng(0).random(1 << 20, dtype=np.float32)  # 4 MiB: copies that would stall the loop
    result = asyncio.run(runner.infer_async({"x": x}))
    assert np.array_equal(result["x"], x)
    assert runner._executor is not None


def test_a_crash_fails_every_waiting_call_within_a_second_naming_the_signal(start_runner: Start) -> None:
    runner = start_runner("Sleep")

    async def main() -> tuple[list[BaseException | dict[str, Any]], float]:
        calls = [asyncio.ensure_future(runner.infer_async({"seconds": np.array([30.0])})) for _ in range(3)]
        await asyncio.sleep(0.3)
        killed = time.monotonic()
        os.kill(runner.pid, signal.SIGSEGV)
        results = await asyncio.gather(*calls, return_exceptions=True)
        return list(results), time.monotonic() - killed

    results, took = asyncio.run(main())
    assert took < 1.0
    assert all(isinstance(result, carton.RunnerCrashed) and "SIGSEGV" in str(result) for result in results)
    assert not runner.alive
    # Later calls fail the same way at once.
    with pytest.raises(carton.RunnerCrashed, match="SIGSEGV"):
        asyncio.run(runner.infer_async({"seconds": np.array([0.0])}))


def test_a_timeout_kills_the_runner_and_names_the_limit(start_runner: Start) -> None:
    runner = start_runner("Sleep")

    async def main() -> None:
        with pytest.raises(carton.RunnerTimeout, match=r"did not answer infer within 0.3 s \(infer timeout\)"):
            await runner.infer_async({"seconds": np.array([60.0])}, timeout=0.3)

    begin = time.monotonic()
    asyncio.run(main())
    assert time.monotonic() - begin < 3
    assert wait_dead([runner.pid]) == []


def test_a_cancelled_call_is_safe_and_its_late_reply_is_discarded(start_runner: Start) -> None:
    runner = start_runner("ConcurrentEcho", threads=4)

    async def main() -> None:
        slow = asyncio.ensure_future(runner.infer_async({"sleep": np.array([0.3]), "i": np.array([1])}))
        await asyncio.sleep(0.05)
        slow.cancel()
        with pytest.raises(asyncio.CancelledError):
            await slow
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(runner.infer_async({"sleep": np.array([0.3]), "i": np.array([2])}), 0.05)
        # The late replies (ids 1 and 2) arrive while these wait: none is mistaken for theirs.
        outputs = await asyncio.gather(
            *(runner.infer_async({"sleep": np.array([0.1]), "i": np.array([10 + i])}) for i in range(6))
        )
        assert [int(output["i"][0]) for output in outputs] == [10 + i for i in range(6)]
        await asyncio.sleep(0.4)
        assert not channels(runner)[0]._pending

    asyncio.run(main())
    assert runner.alive


def test_a_cancelled_call_keeps_its_shared_memory_until_the_runner_answers(start_runner: Start) -> None:
    runner = start_runner("ConcurrentEcho", threads=4, shm_threshold=1024)
    pool = runner._resources.connection.codec._pool  # type: ignore[union-attr]
    assert pool is not None

    async def main() -> None:
        # The runner answers after 1 s: the cancel comes before the reply unless this loop stalls for most of it.
        call = asyncio.ensure_future(runner.infer_async({"sleep": np.array([1.0]), "x": np.ones(4096, np.uint8)}))
        await asyncio.sleep(0.1)
        call.cancel()
        await asyncio.gather(call, return_exceptions=True)
        assert len(pool._busy) == 1  # the runner may still be reading it
        while pool._busy:  # released when the late reply comes in (the test's `wait_for` bounds the wait)
            await asyncio.sleep(0.01)

    asyncio.run(asyncio.wait_for(main(), 30))


def test_a_call_cancelled_once_its_reply_is_in_gives_back_its_shared_memory(start_runner: Start) -> None:
    """A cancel that comes after the reply was read, or was waiting to be read, before the call saw it: the call
    gives its input's shared memory back at once (no later reply will), and leaves nothing behind."""
    runner = start_runner("ConcurrentEcho", threads=4, shm_threshold=1024)
    pool = runner._resources.connection.codec._pool  # type: ignore[union-attr]
    assert pool is not None
    x = np.ones(4096, np.uint8)

    async def one(i: int) -> int:
        return int((await runner.infer_async({"sleep": np.array([0.0]), "i": np.array([i]), "x": x}))["i"][0])

    async def main() -> None:
        assert await one(0) == 0
        for read_by in ("the next send", "the loop"):
            call = asyncio.ensure_future(one(1))
            await asyncio.sleep(0)  # sent
            time.sleep(0.3)  # the loop blocked: the reply waits on the socket
            if read_by == "the loop":
                await asyncio.sleep(0)  # the loop's reader reads it, and the call is cancelled before it resumes
            call.cancel()
            assert await one(2) == 2  # (its send reads a reply still waiting)
            await asyncio.gather(call, return_exceptions=True)
            while pool._busy or channels(runner)[0]._orphans:  # bounded by the `wait_for`
                await asyncio.sleep(0.01)

    asyncio.run(asyncio.wait_for(main(), 30))


def test_close_during_async_calls_gives_model_closed(start_runner: Start) -> None:
    runner = start_runner("Sleep")

    async def main() -> BaseException | None:
        call = asyncio.ensure_future(runner.infer_async({"seconds": np.array([30.0])}))
        await asyncio.sleep(0.2)
        closer = threading.Thread(target=runner.close, kwargs={"timeout": 0.5})
        closer.start()
        try:
            await call
        except BaseException as exc:
            return exc
        finally:
            await asyncio.to_thread(closer.join)
        return None

    error = asyncio.run(main())
    assert isinstance(error, carton.ModelClosed)
    with pytest.raises(carton.ModelClosed):
        asyncio.run(runner.infer_async({"seconds": np.array([0.0])}))


def test_without_pidfd_the_thread_pool_is_used(start_runner: Start, monkeypatch: pytest.MonkeyPatch) -> None:
    runner = start_runner("Echo")
    connection = runner._resources.connection
    assert connection is not None
    monkeypatch.setattr(connection, "pidfd", None)
    result: dict[str, Any] = asyncio.run(runner.infer_async({"x": np.ones(2)}))
    assert result["x"].tolist() == [1.0, 1.0]
    assert runner._executor is not None
    assert _process._ASYNC_THREADS >= 32


def test_lent_outputs_are_views_of_the_runners_memory_until_given_back(start_runner: Start) -> None:
    runner = start_runner("Echo", shm_threshold=1024)
    peer = runner._resources.connection.codec._peer  # type: ignore[union-attr]
    assert peer is not None
    xs = [np.random.default_rng(seed).random(4096, dtype=np.float32) for seed in range(4)]

    async def main() -> None:
        first: list[Callable[[], None]] = []
        one, _ = await runner.infer_async_with_layouts({"x": xs[0]}, lent=first)
        assert len(first) == 1 and not one["x"].flags.writeable
        second: list[Callable[[], None]] = []
        two, _ = await runner.infer_async_with_layouts({"x": xs[1]}, lent=second)
        # The first reply's memory is still lent: the runner wrote the second elsewhere.
        assert np.array_equal(one["x"], xs[0]) and np.array_equal(two["x"], xs[1])
        assert len(peer._segments) == 2
        _process.release_lent(first)
        _process.release_lent(first)  # nothing left to give back twice
        assert first == []
        # The `release` went out on this thread's own socket, not the loop's: a blocking call on that socket comes
        # after it, so once it is answered the runner has the segment back.
        runner.infer({"x": xs[3][:16]})
        three, _ = await runner.infer_async_with_layouts({"x": xs[2]}, lent=(third := []))
        assert np.array_equal(three["x"], xs[2]) and np.array_equal(two["x"], xs[1])
        assert len(peer._segments) == 2  # the segment given back was reused
        for lent in (second, third):
            _process.release_lent(lent)
        # Outputs small enough for the reply's frames are the caller's own: nothing is lent.
        small, _ = await runner.infer_async_with_layouts({"x": xs[3][:16]}, lent=(nothing := []))
        assert nothing == [] and np.array_equal(small["x"], xs[3][:16])

    asyncio.run(main())


def test_a_cancelled_lending_call_gives_back_what_it_lends_once_it_is_answered(start_runner: Start) -> None:
    runner = start_runner("ConcurrentEcho", threads=4, shm_threshold=1024)
    peer = runner._resources.connection.codec._peer  # type: ignore[union-attr]
    assert peer is not None
    big = np.ones(1 << 20, np.uint8)  # large enough for the thread pool's path

    async def main() -> None:
        lent: list[Callable[[], None]] = []
        call = asyncio.ensure_future(runner.infer_async_with_layouts({"sleep": np.array([0.3]), "x": big}, lent=lent))
        await asyncio.sleep(0.1)
        call.cancel()
        await asyncio.gather(call, return_exceptions=True)
        await asyncio.sleep(0.6)
        assert lent == []  # given back when the call ended

    asyncio.run(main())
    # Each call below and its `release` go out on this thread's socket, in that order: the runner takes the first
    # one's reply segment back before the second call, and so on. The cancelled call's (given back from the pool's
    # thread when it ended, a while ago) was reused: no segment was made for them.
    for _ in range(3):
        again: list[Callable[[], None]] = []
        runner.infer_with_layouts({"sleep": np.array([0.0]), "x": big}, lent=again)
        _process.release_lent(again)
    assert len(peer._segments) == 1
