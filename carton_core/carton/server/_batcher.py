"""Dynamic batching: requests to one model version are merged along the batch dimension (axis 0).

The batcher works like Triton's: it forms a batch only when one of the version's runner workers is free, and then
waits at most ``max_queue_delay_microseconds`` (measured from the oldest queued request) for the batch to fill up to
the largest preferred size (``max_batch_size`` when none is given). Requests are merged only with requests that have
the same input names, dtypes and non-batch dimensions, in arrival order. The model's outputs are split back along
axis 0; an output whose first dimension is not the batch's total size fails every request of that batch.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

import numpy as np
from carton_protocol import Tensor

from ..errors import InvalidOutput
from ._stats import VersionStats
from .errors import ModelNotFound

__all__ = ["DynamicBatcher"]

_Key = tuple[tuple[str, str, tuple[int, ...]], ...]


@dataclass(slots=True, eq=False)
class _Pending:
    inputs: dict[str, np.ndarray]
    batch: int
    key: _Key
    future: asyncio.Future[tuple[dict[str, np.ndarray], int]]
    enqueued_ns: int


def _key(inputs: Mapping[str, np.ndarray]) -> _Key:
    return tuple(sorted((name, array.dtype.kind, array.shape[1:]) for name, array in inputs.items()))


class DynamicBatcher:
    """Queues requests of one version and runs them in batches on `run` (the model's ``infer``)."""

    def __init__(
        self,
        *,
        run: Callable[[dict[str, np.ndarray]], Awaitable[Mapping[str, Tensor]]],
        max_batch_size: int,
        max_queue_delay_us: int,
        preferred_batch_sizes: tuple[int, ...],
        concurrency: int,
        stats: VersionStats,
    ) -> None:
        self._run = run
        self._max_batch_size = max_batch_size
        self._delay_ns = max_queue_delay_us * 1000
        self._target = max(preferred_batch_sizes) if preferred_batch_sizes else max_batch_size
        self._slots = asyncio.Semaphore(concurrency)
        self._stats = stats
        self._queue: list[_Pending] = []
        self._arrived = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self._loop_task = asyncio.get_running_loop().create_task(self._loop())

    async def submit(self, inputs: dict[str, np.ndarray], batch: int) -> tuple[dict[str, np.ndarray], int]:
        """Run `inputs` (whose first dimension is `batch`) in some batch; returns its outputs and its queue time."""
        future: asyncio.Future[tuple[dict[str, np.ndarray], int]] = asyncio.get_running_loop().create_future()
        self._queue.append(_Pending(inputs, batch, _key(inputs), future, time.perf_counter_ns()))
        self._arrived.set()
        return await future

    def _compatible(self, key: _Key) -> int:
        return sum(item.batch for item in self._queue if item.key == key)

    async def _loop(self) -> None:
        while True:
            await self._slots.acquire()
            try:
                while not self._queue:
                    self._arrived.clear()
                    await self._arrived.wait()
                first = self._queue[0]
                deadline = first.enqueued_ns + self._delay_ns
                while self._compatible(first.key) < self._target:
                    remaining = deadline - time.perf_counter_ns()
                    if remaining <= 0:
                        break
                    self._arrived.clear()
                    try:
                        await asyncio.wait_for(self._arrived.wait(), remaining / 1e9)
                    except TimeoutError:
                        break
                chosen: list[_Pending] = []
                size = 0
                for item in list(self._queue):
                    if item.key == first.key and size + item.batch <= self._max_batch_size:
                        chosen.append(item)
                        size += item.batch
                        self._queue.remove(item)
            except BaseException:
                self._slots.release()
                raise
            task = asyncio.get_running_loop().create_task(self._execute(chosen, size))
            self._tasks.add(task)
            task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        self._slots.release()

    async def _execute(self, items: list[_Pending], size: int) -> None:
        started = time.perf_counter_ns()
        queue_ns = sum(started - item.enqueued_ns for item in items)
        if len(items) == 1:
            inputs = items[0].inputs
        else:
            inputs = {name: np.concatenate([item.inputs[name] for item in items]) for name in items[0].inputs}
        outputs: dict[str, np.ndarray] = {}
        try:
            results = await self._run(inputs)
            infer_ns = time.perf_counter_ns() - started
            for name, output in results.items():
                if not isinstance(output, np.ndarray) or output.ndim == 0 or output.shape[0] != size:
                    shape = output.shape if isinstance(output, np.ndarray) else "a nested tensor"
                    raise InvalidOutput(
                        f"output {name!r} has shape {shape}, but a dynamic batch of {size} needs its first "
                        f"dimension to be {size}"
                    )
                outputs[name] = output
        except Exception as exc:
            for item in items:
                if not item.future.done():
                    item.future.set_exception(exc)
            return
        self._stats.record_execution(batch_size=size, infer_ns=infer_ns, queue_ns=queue_ns, requests=len(items))
        offset = 0
        for item in items:
            stop = offset + item.batch
            if not item.future.done():
                split = {name: output[offset:stop] for name, output in outputs.items()}
                item.future.set_result((split, started - item.enqueued_ns))
            offset = stop

    async def close(self) -> None:
        """Stop batching; requests still queued fail (the repository drains in-flight requests before this)."""
        self._loop_task.cancel()
        for item in self._queue:
            if not item.future.done():
                item.future.set_exception(ModelNotFound("the model version was unloaded before the request ran"))
        self._queue.clear()
        await asyncio.gather(self._loop_task, *self._tasks, return_exceptions=True)
