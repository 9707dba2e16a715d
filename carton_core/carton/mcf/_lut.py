"""Table-driven decoding of packed codes straight to float32, in cache-sized row chunks, optionally on threads.

Why it is shaped like this (numpy only, measured by ``bench/bench_mcf.py``):

* ``np.take`` with ``intp`` indices and ``mode="clip"`` runs at memory speed; with ``uint8`` indices numpy first
  allocates an ``intp`` copy of the whole index array, and with ``mode="raise"`` plus ``out=`` it writes through a
  temporary. So each chunk converts its packed bytes into a reused ``intp`` buffer, then gathers whole table rows:
  one byte -> two (4-bit) or four (2-bit) float32 codes; one 12-bit half of a 24-bit group -> four 3-bit or two
  6-bit codes (the halves are read as two unaligned little-endian ``uint16`` views with a 3-byte stride).
* The block scales are then folded in with one in-place multiply per chunk while the chunk is still in L2.
* Every step is a numpy call that releases the GIL, so row ranges decode in parallel on a small thread pool.

Results are bit-identical to decoding codes to int8 and multiplying by the scale (see ``tests/mcf/test_lut.py``):
a table entry is the exact float32 of its code, and the scale multiply is the same single float32 operation.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import numpy.typing as npt

from carton.mcf._layout import PayloadLayout
from carton.mcf._packing import BLOCK, block_bytes

__all__ = [
    "CHUNK_BYTES",
    "MIN_PARALLEL_VALUES",
    "BlockDecoder",
    "IntDecoder",
    "chunk_rows",
    "parallel_ranges",
    "resolve_threads",
]

# float32 output per chunk: large enough to amortise numpy's per-call overhead, small enough to stay in L2.
CHUNK_BYTES = 1 << 19
# Below this many output values a call stays on the calling thread (a pool hand-off costs tens of microseconds).
MIN_PARALLEL_VALUES = 1 << 18


def _sign_extend(value: npt.NDArray[np.int64], bits: int) -> npt.NDArray[np.int64]:
    half = 1 << (bits - 1)
    return (value ^ half) - half


def _code_table(bits: int, index_bits: int) -> npt.NDArray[np.float32]:
    """``[2**index_bits, index_bits // bits]`` float32 codes of every packed index, LSB-first."""
    per_entry = index_bits // bits
    index = np.arange(1 << index_bits, dtype=np.int64)
    fields = [_sign_extend((index >> (bits * i)) & ((1 << bits) - 1), bits) for i in range(per_entry)]
    return np.ascontiguousarray(np.stack(fields, axis=1).astype(np.float32))


# bits -> (table, bits of packed input per table index)
_TABLES: dict[int, tuple[npt.NDArray[np.float32], int]] = {
    2: (_code_table(2, 8), 8),
    4: (_code_table(4, 8), 8),
    3: (_code_table(3, 12), 12),
    6: (_code_table(6, 12), 12),
}

_local = threading.local()


def _scratch(name: str, size: int, dtype: type[np.generic]) -> npt.NDArray[np.generic]:
    """A per-thread reusable buffer of at least ``size`` items (reallocated only to grow)."""
    buf: npt.NDArray[np.generic] | None = getattr(_local, name, None)
    if buf is None or buf.size < size:
        buf = np.empty(size, dtype=dtype)
        setattr(_local, name, buf)
    return buf[:size]


def _indices(packed: npt.NDArray[np.uint8], index_bits: int) -> npt.NDArray[np.intp]:
    """Table indices of a chunk of packed bytes, in a reused per-thread ``intp`` buffer."""
    if index_bits == 8:
        idx = _scratch("idx", packed.size, np.intp)
        np.copyto(idx, packed)
        return idx  # type: ignore[return-value]
    groups = packed.size // 3
    # Bytes b0 b1 b2 of a group hold two 12-bit indices: b0 | (b1 & 0xF) << 8 and b1 >> 4 | b2 << 4, i.e. the low
    # 12 bits of the little-endian uint16 at the group start and the top 12 bits of the one a byte later.
    low = np.ndarray((groups,), dtype="<u2", buffer=packed, offset=0, strides=(3,))
    high = np.ndarray((groups,), dtype="<u2", buffer=packed, offset=1, strides=(3,))
    idx = _scratch("idx", 2 * groups, np.intp).reshape(groups, 2)
    np.bitwise_and(low, np.uint16(0xFFF), out=idx[:, 0], casting="unsafe")
    np.right_shift(high, np.uint16(4), out=idx[:, 1], casting="unsafe")
    return idx.reshape(-1)  # type: ignore[return-value]


def chunk_rows(width: int) -> int:
    """Rows of ``width`` float32 values per decode chunk."""
    return max(1, CHUNK_BYTES // (4 * width))


def resolve_threads(threads: int | None) -> int:
    """A ``threads=`` argument as a count: ``None`` -> the CPU count; otherwise at least 1."""
    if threads is None:
        return max(1, os.cpu_count() or 1)
    return max(1, int(threads))


_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2), thread_name_prefix="carton-mcf")
        return _pool


def parallel_ranges(total: int, threads: int, align: int, work: Callable[[int, int], None]) -> None:
    """Run ``work(start, stop)`` over ``[0, total)`` split into ``threads`` contiguous parts (starts multiples of
    ``align``); the calling thread takes the first part, pool threads the others. Exceptions propagate."""
    parts = max(1, min(threads, -(-total // align)))
    if parts == 1:
        work(0, total)
        return
    per = -(-total // (parts * align)) * align
    bounds = [(s, min(total, s + per)) for s in range(0, total, per)]
    futures: list[Future[None]] = [_executor().submit(work, s, e) for s, e in bounds[1:]]
    try:
        work(*bounds[0])
    finally:
        for future in futures:
            future.result()


class BlockDecoder:
    """Decodes rows of a q* / k* payload into float32 with the fp32 block scales ``[rows, blocks]`` folded in:
    ``BlockDecoder(flat, layout, block_scales(flat, layout)).decode(r0, r1, out)``, table-driven and in
    L2-sized chunks; what `dequantize` runs, and what a kernel that decodes row tiles on the fly uses."""

    def __init__(self, flat: npt.NDArray[np.uint8], layout: PayloadLayout, scales: npt.NDArray[np.float32]) -> None:
        self.layout = layout
        self._bits = layout.bits
        self._row_bytes = layout.blocks_per_row * block_bytes(layout.bits)
        self._data = flat[layout.data.offset : layout.data.end]
        self._scales = scales

    def decode(self, r0: int, r1: int, out: npt.NDArray[np.float32]) -> None:
        """Write rows ``[r0, r1)`` into ``out``, a C-contiguous ``[r1 - r0, padded_cols]`` float32 array.

        Padding values beyond ``cols`` are decoded as stored; callers zero or drop them.
        """
        nb = self.layout.blocks_per_row
        step = chunk_rows(nb * BLOCK)
        for c0 in range(r0, r1, step):
            c1 = min(r1, c0 + step)
            rows = c1 - c0
            packed = self._data[c0 * self._row_bytes : c1 * self._row_bytes]
            tile = out[c0 - r0 : c1 - r0].reshape(rows, nb, BLOCK)
            scales = self._scales[c0:c1, :, None]
            if self._bits == 8:
                # int8 codes need no table: a cast is faster than a gather (and than numpy's buffered mixed-type
                # multiply).
                np.copyto(tile, packed.view(np.int8).reshape(rows, nb, BLOCK), casting="unsafe")
            else:
                table, index_bits = _TABLES[self._bits]
                idx = _indices(packed, index_bits)
                np.take(table, idx, axis=0, out=tile.reshape(idx.size, table.shape[1]), mode="clip")
            tile *= scales


class IntDecoder:
    """Decodes an int8 / int4 payload (one tensor scale, optional zero point) into float32 values.

    A 256-entry table holds ``(float32(code) - zero) * scale`` for every byte, computed with the same float32
    operations a direct decode performs, so results are identical.
    """

    def __init__(self, flat: npt.NDArray[np.uint8], layout: PayloadLayout, scale: np.float32, zero: np.float32) -> None:
        self.layout = layout
        self._data = flat[layout.data.offset : layout.data.end]
        self._scale, self._zero = scale, zero
        raw = np.arange(256, dtype=np.uint8)
        if layout.bits == 8:
            codes = raw.view(np.int8).astype(np.float32)[:, None]
        else:
            fields = [raw & np.uint8(0x0F), raw >> np.uint8(4)]
            codes = np.stack([((f ^ np.uint8(8)).view(np.int8) - np.int8(8)) for f in fields], axis=1)
            codes = codes.astype(np.float32)
        if zero != 0:
            codes -= zero
        codes *= scale
        self._table = np.ascontiguousarray(codes)

    def decode(self, v0: int, v1: int, out: npt.NDArray[np.float32]) -> None:
        """Write flat values ``[v0, v1)`` (``v0`` even for int4) into the contiguous ``out`` of ``v1 - v0`` values."""
        per = self._table.shape[1]
        step = CHUNK_BYTES // 4
        for c0 in range(v0, v1, step):
            c1 = min(v1, c0 + step)
            if per == 1:  # int8: cast, then the same float32 operations the table holds
                dest = out[c0 - v0 : c1 - v0]
                np.copyto(dest, self._data[c0:c1].view(np.int8), casting="unsafe")
                if self._zero != 0:
                    dest -= self._zero
                dest *= self._scale
                continue
            whole = (c1 - c0) // per
            packed = self._data[c0 // per : c0 // per + whole]
            if whole:
                idx = _indices(packed, 8)
                dest = out[c0 - v0 : c0 - v0 + whole * per].reshape(whole, per)
                np.take(self._table, idx, axis=0, out=dest, mode="clip")
            if whole * per < c1 - c0:  # an odd int4 tail: the low nibble of the next byte
                out[c1 - v0 - 1] = self._table[self._data[c0 // per + whole], 0]
