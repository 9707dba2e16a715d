"""Timing helpers shared by the benchmark scripts (imported as a sibling: the scripts run from bench/)."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable


def percentiles(samples: list[float]) -> tuple[float, float]:
    """p50 and p99 of `samples`."""
    ordered = sorted(samples)
    return ordered[len(ordered) // 2], ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]


def timed(call: Callable[[], object], repeat: int, warmup: int) -> list[float]:
    """Seconds per call of `call`, `repeat` times after `warmup` untimed calls."""
    for _ in range(warmup):
        call()
    samples = []
    for _ in range(repeat):
        begin = time.perf_counter()
        call()
        samples.append(time.perf_counter() - begin)
    return samples


async def timed_async(call: Callable[[], Awaitable[object]], repeat: int, warmup: int) -> list[float]:
    """`timed` for a coroutine function, awaited on the running event loop."""
    for _ in range(warmup):
        await call()
    samples = []
    for _ in range(repeat):
        begin = time.perf_counter()
        await call()
        samples.append(time.perf_counter() - begin)
    return samples
