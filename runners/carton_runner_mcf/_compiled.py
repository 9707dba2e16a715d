"""Compiled (numba) kernels over MCF payloads as stored: quantized matrix products and row decoding.

Products ``y = x @ W.T`` for the block methods (q8, q4, k6, k4, k3, k2):

- the activations are rounded per block of 32 to int16 (scale ``max|x| / 32767``: relative error at most
  ``1 / 65534`` of the block's largest value) and reordered into the lane order of `_simd.lane_order`;
- each weight block's packed codes are unpacked into two vectors of sixteen int16 lanes, multiplied with the
  activations in int32 (``vpmaddwd`` on x86) and the eight int32 partial sums are converted and scaled by
  ``weight scale x activation scale`` into eight float32 accumulators, summed once per row;
- up to four activation rows share every unpacked block (`_matmul_rows`); the weight scales are read from the
  payload (fp16, k*: super-scale x 6-bit sub-scale / 32), nothing is decoded ahead of time.

Larger batches decode row tiles to float32 (`decode_rows`, same lane order) for BLAS. int8 / int4 (one tensor
scale, rows not aligned to blocks) are decoded by `decode_int_rows`.

Every kernel releases the GIL. ``*_parallel`` variants split rows across numba's threads (``prange``), the serial
ones run on the calling thread; both come from one body, so results do not depend on the thread count. All kernels
are compiled on first use and cached on disk (``cache=True``, see docs/mcf-runner.md for where).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Any

import numba
import numpy as np
from numba import prange

from ._simd import (
    broadcast,
    fma,
    hsum,
    iadd,
    lane_order,
    load_f16,
    load_f16x8,
    load_f32x8,
    load_i16x16,
    load_u8x8,
    madd,
    mul,
    splat,
    store_f32x8,
    store_scaled,
    to_float,
    unpack_codes,
    zeros,
)

__all__ = ["LANE_ORDERS", "MAX_THREADS", "BlockKernels", "block_kernels", "decode_int_rows", "quantize_activations"]

if "NUMBA_THREADING_LAYER" not in os.environ:
    # numba's fallback layer (workqueue) aborts on concurrent calls from two threads and starts a parallel region
    # far more slowly than OpenMP or TBB; "threadsafe" takes whichever of those is installed.
    numba.config.THREADING_LAYER = "threadsafe"

_JIT = {"nogil": True, "cache": True, "fastmath": True, "error_model": "numpy", "boundscheck": False}
_INV32767 = np.float32(1.0 / 32767.0)
_SUB_SCALE = np.float32(1.0 / 32.0)

#: Threads in numba's pool (``NUMBA_NUM_THREADS``, by default the CPU count): the most a product can use.
MAX_THREADS = int(numba.config.NUMBA_NUM_THREADS)
#: bit width -> code index held by each of a block's 32 lanes (int64, for the kernels' reordering).
LANE_ORDERS = {width: np.array(lane_order(width), dtype=np.int64) for width in (2, 3, 4, 6, 8)}


@numba.njit(**_JIT)
def quantize_activations(x, order, xq, xs):  # type: ignore[no-untyped-def]
    """Round ``x [m, k]`` (float32) per block of 32 into int16 ``xq [m, blocks * 32]`` in lane order ``order``,
    with the block scales in ``xs [m, blocks]``; columns past ``k`` count as zero."""
    m, k = x.shape
    blocks = xs.shape[1]
    for j in range(m):
        for b in range(blocks):
            base = b * 32
            largest = np.float32(0.0)
            for i in range(min(32, k - base)):
                largest = max(largest, abs(x[j, base + i]))
            xs[j, b] = largest * _INV32767
            inverse = np.float32(32767.0) / largest if largest > 0 else np.float32(0.0)
            for lane in range(32):
                column = base + order[lane]
                value = x[j, column] * inverse if column < k else np.float32(0.0)
                xq[j, base + lane] = np.int16(np.rint(value))


@numba.njit(inline="always", **_JIT)
def _row_scales(payload, meta, row, kfamily, scales):  # type: ignore[no-untyped-def]
    """The float32 scales of the part's blocks of ``row`` into ``scales`` (q*: the fp16 block scales; k*: fp16
    super-scale x sub-scale / 32), eight blocks per vector operation where the part allows."""
    scale_at, sub_at, blocks_full, supers_full, block0 = meta[1], meta[2], meta[3], meta[4], meta[6]
    blocks = scales.size
    vector_end = blocks - blocks % 8
    if kfamily:
        subs = sub_at + row * blocks_full + block0
        supers = scale_at + 2 * row * supers_full
        if block0 % 8 == 0:  # super-blocks line up with groups of eight blocks
            for b in range(0, vector_end, 8):
                scale = load_f16(payload, supers + 2 * ((block0 + b) // 8)) * _SUB_SCALE
                store_f32x8(scales, b, mul(load_u8x8(payload, subs + b), splat(scale)))
        else:
            vector_end = 0
        for b in range(vector_end, blocks):
            scale = load_f16(payload, supers + 2 * ((block0 + b) // 8)) * _SUB_SCALE
            scales[b] = scale * np.float32(payload[subs + b])
    else:
        first = scale_at + 2 * (row * blocks_full + block0)
        for b in range(0, vector_end, 8):
            store_f32x8(scales, b, load_f16x8(payload, first + 2 * b))
        for b in range(vector_end, blocks):
            scales[b] = load_f16(payload, first + 2 * b)


@numba.njit(inline="always", **_JIT)
def _dot(low, high, xq, at):  # type: ignore[no-untyped-def]
    """One block's 32 products with the activations at flat index ``at`` of ``xq``, as eight float32 partial sums."""
    return to_float(iadd(madd(low, load_i16x16(xq, at)), madd(high, load_i16x16(xq, at + 16))))


@numba.njit(**_JIT)
def _matmul_rows(payload, meta, xq, xs, y, first, last, width, kfamily):  # type: ignore[no-untyped-def]
    """Rows ``first..last`` (of the part) of ``y [m, rows] = x @ W.T``; ``meta`` describes the part."""
    data_at, blocks_full, row0, block0, blocks = meta[0], meta[3], meta[5], meta[6], meta[7]
    block_bytes = 4 * width
    m, stride = xq.shape
    scales = np.empty(blocks, dtype=np.float32)
    # weight scale x activation scale of every (activation row, block), made once per weight row so that the
    # product loop broadcasts it straight from memory
    both = np.empty(m * blocks, dtype=np.float32)
    vector_end = blocks - blocks % 8
    for r in range(first, last):
        row = row0 + r
        at = data_at + row * blocks_full * block_bytes + block0 * block_bytes
        _row_scales(payload, meta, row, kfamily, scales)
        for j in range(m):
            for b in range(0, vector_end, 8):
                store_f32x8(both, j * blocks + b, mul(load_f32x8(scales, b), load_f32x8(xs, j * blocks + b)))
            for b in range(vector_end, blocks):
                both[j * blocks + b] = scales[b] * xs[j, b]
        j = 0
        while j + 4 <= m:  # four activation rows share each unpacked block
            a0, a1, a2, a3 = zeros(), zeros(), zeros(), zeros()
            for b in range(blocks):
                low = unpack_codes(payload, at + b * block_bytes, width, 0)
                high = unpack_codes(payload, at + b * block_bytes, width, 1)
                x0 = j * stride + b * 32
                s0 = j * blocks + b
                a0 = fma(_dot(low, high, xq, x0), broadcast(both, s0), a0)
                a1 = fma(_dot(low, high, xq, x0 + stride), broadcast(both, s0 + blocks), a1)
                a2 = fma(_dot(low, high, xq, x0 + 2 * stride), broadcast(both, s0 + 2 * blocks), a2)
                a3 = fma(_dot(low, high, xq, x0 + 3 * stride), broadcast(both, s0 + 3 * blocks), a3)
            y[j, r], y[j + 1, r], y[j + 2, r], y[j + 3, r] = hsum(a0), hsum(a1), hsum(a2), hsum(a3)
            j += 4
        while j < m:  # one activation row: two accumulators, so consecutive blocks do not wait on one FMA chain
            even, odd = zeros(), zeros()
            for b in range(0, blocks - 1, 2):
                at0, at1 = at + b * block_bytes, at + (b + 1) * block_bytes
                x0 = j * stride + b * 32
                low = unpack_codes(payload, at0, width, 0)
                high = unpack_codes(payload, at0, width, 1)
                even = fma(_dot(low, high, xq, x0), broadcast(both, j * blocks + b), even)
                low = unpack_codes(payload, at1, width, 0)
                high = unpack_codes(payload, at1, width, 1)
                odd = fma(_dot(low, high, xq, x0 + 32), broadcast(both, j * blocks + b + 1), odd)
            if blocks % 2:
                b = blocks - 1
                low = unpack_codes(payload, at + b * block_bytes, width, 0)
                high = unpack_codes(payload, at + b * block_bytes, width, 1)
                even = fma(_dot(low, high, xq, j * stride + b * 32), broadcast(both, j * blocks + b), even)
            y[j, r] = hsum(even) + hsum(odd)
            j += 1


@numba.njit(**_JIT)
def _decode_rows(payload, meta, out, first, last, width, kfamily):  # type: ignore[no-untyped-def]
    """Rows ``first..last`` of the part, dequantized into ``out [last - first, blocks * 32]`` (float32) with each
    block's values in lane order (`LANE_ORDERS`); multiply by activations reordered the same way."""
    data_at, blocks_full, row0, block0, blocks = meta[0], meta[3], meta[5], meta[6], meta[7]
    block_bytes = 4 * width
    scales = np.empty(blocks, dtype=np.float32)
    for r in range(first, last):
        row = row0 + r
        at = data_at + row * blocks_full * block_bytes + block0 * block_bytes
        _row_scales(payload, meta, row, kfamily, scales)
        into = (r - first) * out.shape[1]
        for b in range(blocks):
            store_scaled(out, into + b * 32, unpack_codes(payload, at + b * block_bytes, width, 0), scales[b])
            store_scaled(out, into + b * 32 + 16, unpack_codes(payload, at + b * block_bytes, width, 1), scales[b])


@dataclass(frozen=True, slots=True)
class BlockKernels:
    """The compiled kernels of one code width and scale family (see `block_kernels`).

    ``matmul(payload, meta, x, order, xq, xs, y)`` and ``matmul_parallel(..., parts)`` compute
    ``y [m, rows] = x @ W.T``, quantizing ``x`` into the work arrays ``xq`` / ``xs`` first (`quantize_activations`);
    ``decode(payload, meta, out, first, last)`` writes rows
    ``first..last`` of the part as float32 in lane order. ``meta`` is the part's int64 description: payload offsets
    of the codes, scales and sub-scales, blocks and super-blocks per row of the whole tensor, the part's first row,
    first block and block count.
    """

    matmul: Any
    matmul_parallel: Any
    decode: Any


@functools.cache
def block_kernels(width: int, kfamily: bool) -> BlockKernels:
    """Kernels specialised for ``width``-bit codes with q* (``kfamily`` false) or k* scales. They are separate
    dispatchers closing over the two constants, so that a call from Python goes straight to compiled code (a
    literal-typed argument would be re-resolved by numba's dispatcher on every call) and each is compiled, or
    loaded from numba's cache, only when a model uses it."""

    def matmul(payload, meta, x, order, xq, xs, y):  # type: ignore[no-untyped-def]
        quantize_activations(x, order, xq, xs)
        _matmul_rows(payload, meta, xq, xs, y, 0, y.shape[1], width, kfamily)

    def matmul_parallel(payload, meta, x, order, xq, xs, y, parts):  # type: ignore[no-untyped-def]
        quantize_activations(x, order, xq, xs)
        rows = y.shape[1]
        step = (rows + parts - 1) // parts
        for part in prange(parts):
            _matmul_rows(payload, meta, xq, xs, y, min(rows, part * step), min(rows, (part + 1) * step), width, kfamily)

    def decode(payload, meta, out, first, last):  # type: ignore[no-untyped-def]
        _decode_rows(payload, meta, out, first, last, width, kfamily)

    return BlockKernels(
        matmul=numba.njit(**_JIT)(matmul),
        matmul_parallel=numba.njit(parallel=True, **_JIT)(matmul_parallel),
        decode=numba.njit(**_JIT)(decode),
    )


@numba.njit(**_JIT)
def decode_int_rows(payload, data_at, first_code, stride, bits, scale, zero, out, first, last):  # type: ignore[no-untyped-def]
    """Rows ``first..last`` of an int8 / int4 payload as ``(code - zero) * scale`` into ``out [last - first, cols]``.

    Codes are row-major over the whole tensor from payload byte ``data_at`` (int4 two to a byte, low nibble first);
    row ``r`` of the part starts at code ``first_code + r * stride``."""
    cols = out.shape[1]
    for r in range(first, last):
        dest = out[r - first]
        start = first_code + r * stride
        if bits == 8:
            for c in range(cols):
                dest[c] = (np.float32(np.int8(payload[data_at + start + c])) - zero) * scale
        else:
            for c in range(cols):
                index = start + c
                nibble = (np.int32(payload[data_at + (index >> 1)]) >> (4 * (index & 1))) & 15
                dest[c] = (np.float32((nibble ^ 8) - 8) - zero) * scale
