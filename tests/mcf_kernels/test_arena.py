"""The huge-page arena that packed payloads are read into: alignment, chunks, lifetime."""

from __future__ import annotations

import gc
import itertools

import numpy as np
from carton_runner_mcf import _arena
from carton_runner_mcf._arena import HUGE_PAGE, HugePageArena, in_arena


def test_regions_are_aligned_disjoint_and_zero() -> None:
    arena = HugePageArena(chunk_bytes=HUGE_PAGE)
    regions = [arena.take(n) for n in (1, 100, 4096, 300_000, HUGE_PAGE + 5, 7)]
    for region, n in zip(regions, (1, 100, 4096, 300_000, HUGE_PAGE + 5, 7), strict=True):
        assert region.nbytes == n and region.dtype == np.uint8
        assert region.ctypes.data % 64 == 0
        assert in_arena(region) and not region.any()
        region[:] = 1
    spans = sorted((r.ctypes.data, r.ctypes.data + r.nbytes) for r in regions)
    assert all(end <= start for (_, end), (start, _) in itertools.pairwise(spans))
    assert all(r.all() for r in regions)  # no region overwrote another
    # the first chunk starts on a huge page; a request larger than the chunk size gets a chunk of its own
    assert regions[0].ctypes.data % HUGE_PAGE == 0
    assert regions[4].ctypes.data % HUGE_PAGE == 0


def test_a_region_outlives_its_arena_and_ordinary_memory_is_not_in_one() -> None:
    region = HugePageArena().take(1000)
    region[:] = np.arange(1000) % 251
    gc.collect()
    assert in_arena(region) and int(region.sum()) == int((np.arange(1000) % 251).sum())
    assert not in_arena(np.zeros(1000, np.uint8))
    assert not in_arena(np.frombuffer(bytes(5000), np.uint8))
    start = region.ctypes.data  # the first region of a chunk starts it
    assert start in _arena._ranges
    del region
    gc.collect()
    assert start not in _arena._ranges  # the chunk was unmapped with its last region, and forgotten
