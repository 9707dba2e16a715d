"""Compiled (numba) kernels over MCF payloads as stored: quantized matrix products and row decoding.

Products ``y = x @ W.T`` for the block methods (q8, q4, k6, k4, k3, k2), from activations rounded per block of 32 to
int16 (`_blocks`):

- 4-bit codes (q4, k4): `_nibble`, two blocks per step with the codes read as words;
- the other widths: each weight block's packed codes are unpacked into two vectors of sixteen int16 lanes
  (`_simd.unpack_codes`), multiplied with the activations in int32 (``vpmaddwd`` on x86) and the eight int32
  partial sums converted and scaled by ``weight scale x activation scale`` into eight float32 accumulators, summed
  once per row; up to four activation rows share every unpacked block.

The weight scales are read from the payload (fp16, k*: super-scale x 6-bit sub-scale / 32); nothing is decoded ahead
of time. Larger batches decode row tiles to float32 (`decode_rows`, natural column order) for BLAS; int8 / int4 (one
tensor scale, rows not aligned to blocks) are decoded by `decode_int_rows`.

Every kernel releases the GIL. ``*_parallel`` variants split rows across numba's threads (``prange``), the serial
ones run on the calling thread; a row is always computed whole by the same compiled code, so results do not depend
on the thread count. All kernels are compiled on first use and cached on disk (``cache=True``, see
docs/mcf-runner.md for where).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Any

import numba
import numpy as np
from llvmlite import binding as llvm
from numba import prange

from ._blocks import JIT, LANE_ORDERS, padded_blocks, quantize_activations, row_scales
from ._nibble import PAIR_LANES, nibble_rows, quantize_pairs
from ._panel import PanelKernels, panel_kernels
from ._panel import activation_shapes as panel_shapes
from ._simd import (
    broadcast,
    fma,
    hsum,
    iadd,
    load_f32x8,
    load_i16x16,
    madd,
    mul,
    store_f32x8,
    store_natural,
    to_float,
    unpack_codes,
    zeros,
)

__all__ = [
    "MAX_THREADS",
    "PANEL_PRODUCTS",
    "BlockKernels",
    "PanelKernels",
    "activation_shapes",
    "block_kernels",
    "decode_int_rows",
    "panel_kernels",
    "panel_shapes",
    "quantize",
]

if "NUMBA_THREADING_LAYER" not in os.environ:
    # numba's fallback layer (workqueue) aborts on concurrent calls from two threads and starts a parallel region
    # far more slowly than OpenMP or TBB; "threadsafe" takes whichever of those is installed.
    numba.config.THREADING_LAYER = "threadsafe"

#: Threads in numba's pool (``NUMBA_NUM_THREADS``, by default the CPU count): the most a product can use.
MAX_THREADS = int(numba.config.NUMBA_NUM_THREADS)


def _vnni512() -> bool:
    features = llvm.get_host_cpu_features()
    return all(features.get(name, False) for name in ("avx512f", "avx512bw", "avx512vnni"))


#: Whether large batches use the int16 panel kernels (`_panel`) instead of decoded float32 tiles and BLAS: on a
#: host whose CPU has 512-bit VNNI, where an int16 pair product issues as fast as an fp32 FMA; elsewhere the
#: integer kernel is slower than sgemm (docs/performance.md).
PANEL_PRODUCTS = _vnni512()


def activation_shapes(m: int, blocks: int) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int]]:
    """Shapes of the work arrays of `quantize` for ``m`` rows of a part of ``blocks`` blocks: ``xq`` (int16),
    ``xs`` / ``xoff`` (float32, one value per block, padded) and ``xe`` (float32, eight per pair of blocks)."""
    pairs = (blocks + 1) // 2
    padded = (blocks + 7) // 8 * 8
    return (m, pairs * PAIR_LANES), (m, padded), (m, pairs * 8)


@numba.njit(**JIT)
def quantize(x, bits, xq, xs, xe, xoff):  # type: ignore[no-untyped-def]
    """Round ``x [m, k]`` into the activation arrays the kernel of ``bits``-bit codes reads."""
    if bits == 4:
        quantize_pairs(x, xq, xs, xe, xoff)
    else:
        quantize_activations(x, LANE_ORDERS[bits], xq, xs)


@numba.njit(**JIT)
def _dot(low, high, xq, at):  # type: ignore[no-untyped-def]
    """One block's 32 products with the activations at flat index ``at`` of ``xq``, as eight float32 partial sums."""
    return to_float(iadd(madd(low, load_i16x16(xq, at)), madd(high, load_i16x16(xq, at + 16))))


@numba.njit(**JIT)
def _matmul_rows(payload, meta, xq, xs, y, first, last, width):  # type: ignore[no-untyped-def]
    """Rows ``first..last`` (of the part) of ``y [m, rows] = x @ W.T`` for ``width``-bit codes (a constant)."""
    data_at, blocks_full, row0, block0, blocks, kfamily = meta[0], meta[3], meta[5], meta[6], meta[7], meta[8] != 0
    block_bytes = 4 * width
    m, stride = xq.shape
    padded = padded_blocks(blocks)
    scales = np.empty(padded, dtype=np.float32)
    # weight scale x activation scale of every (activation row, block), made once per weight row so that the
    # product loop broadcasts it straight from memory
    both = np.empty(m * padded, dtype=np.float32)
    for r in range(first, last):
        row = row0 + r
        at = data_at + row * blocks_full * block_bytes + block0 * block_bytes
        row_scales(payload, meta, row, kfamily, scales)
        for j in range(m):
            for b in range(0, padded, 8):
                store_f32x8(both, j * padded + b, mul(load_f32x8(scales, b), load_f32x8(xs, j * xs.shape[1] + b)))
        j = 0
        while j + 4 <= m:  # four activation rows share each unpacked block
            a0, a1, a2, a3 = zeros(), zeros(), zeros(), zeros()
            for b in range(blocks):
                low = unpack_codes(payload, at + b * block_bytes, width, 0)
                high = unpack_codes(payload, at + b * block_bytes, width, 1)
                x0 = j * stride + b * 32
                s0 = j * padded + b
                a0 = fma(_dot(low, high, xq, x0), broadcast(both, s0), a0)
                a1 = fma(_dot(low, high, xq, x0 + stride), broadcast(both, s0 + padded), a1)
                a2 = fma(_dot(low, high, xq, x0 + 2 * stride), broadcast(both, s0 + 2 * padded), a2)
                a3 = fma(_dot(low, high, xq, x0 + 3 * stride), broadcast(both, s0 + 3 * padded), a3)
            y[j, r], y[j + 1, r], y[j + 2, r], y[j + 3, r] = hsum(a0), hsum(a1), hsum(a2), hsum(a3)
            j += 4
        while j < m:  # one activation row: two accumulators, so consecutive blocks do not wait on one FMA chain
            even, odd = zeros(), zeros()
            for b in range(0, blocks - 1, 2):
                at0, at1 = at + b * block_bytes, at + (b + 1) * block_bytes
                x0 = j * stride + b * 32
                low = unpack_codes(payload, at0, width, 0)
                high = unpack_codes(payload, at0, width, 1)
                even = fma(_dot(low, high, xq, x0), broadcast(both, j * padded + b), even)
                low = unpack_codes(payload, at1, width, 0)
                high = unpack_codes(payload, at1, width, 1)
                odd = fma(_dot(low, high, xq, x0 + 32), broadcast(both, j * padded + b + 1), odd)
            if blocks % 2:
                b = blocks - 1
                low = unpack_codes(payload, at + b * block_bytes, width, 0)
                high = unpack_codes(payload, at + b * block_bytes, width, 1)
                even = fma(_dot(low, high, xq, j * stride + b * 32), broadcast(both, j * padded + b), even)
            y[j, r] = hsum(even) + hsum(odd)
            j += 1


@numba.njit(**JIT)
def _decode_rows(payload, meta, out, first, last, width):  # type: ignore[no-untyped-def]
    """Rows ``first..last`` of the part, dequantized into ``out [last - first, >= blocks * 32]`` (float32) in
    natural column order; columns past the tensor's last one hold whatever the payload codes there."""
    data_at, blocks_full, row0, block0, blocks, kfamily = meta[0], meta[3], meta[5], meta[6], meta[7], meta[8] != 0
    block_bytes = 4 * width
    scales = np.empty(padded_blocks(blocks), dtype=np.float32)
    for r in range(first, last):
        row = row0 + r
        at = data_at + row * blocks_full * block_bytes + block0 * block_bytes
        row_scales(payload, meta, row, kfamily, scales)
        into = (r - first) * out.shape[1]
        for b in range(blocks):
            low = unpack_codes(payload, at + b * block_bytes, width, 0)
            high = unpack_codes(payload, at + b * block_bytes, width, 1)
            store_natural(out, into + b * 32, low, high, scales[b], width)


@dataclass(frozen=True, slots=True)
class BlockKernels:
    """The compiled kernels of one code width (see `block_kernels`).

    ``matmul(payload, meta, x, xq, xs, xe, xoff, y)`` and ``matmul_parallel(..., parts)`` compute ``y [m, rows] =
    x @ W.T``, rounding ``x`` into the work arrays first (`quantize`; shapes from `activation_shapes`);
    ``decode(payload, meta, out, first, last)`` writes rows ``first..last`` of the part as float32 in natural column
    order.
    """

    matmul: Any
    matmul_parallel: Any
    decode: Any


@functools.cache
def block_kernels(width: int) -> BlockKernels:
    """Kernels specialised for ``width``-bit codes. They are separate dispatchers closing over the width, so that a
    call from Python goes straight to compiled code (a literal-typed argument would be re-resolved by numba's
    dispatcher on every call) and each is compiled, or loaded from numba's cache, only when a model uses it.

    The closures capture ``width`` and nothing else (the product kernels call the row kernels by their global
    names): numba's cache keys a closure by the pickle of what it captures, and a captured dispatcher pickles with
    an id drawn anew in every process, so a kernel closing over one missed the cache and was compiled again in every
    process, at the model's first products (LLVM's memory staying in the runner's heap, one more cache file each
    time)."""

    def matmul(payload, meta, x, xq, xs, xe, xoff, y):  # type: ignore[no-untyped-def]
        quantize(x, width, xq, xs, xe, xoff)
        if width == 4:
            nibble_rows(payload, meta, xq, xs, xe, xoff, y, 0, y.shape[1])
        else:
            _matmul_rows(payload, meta, xq, xs, y, 0, y.shape[1], width)

    def matmul_parallel(payload, meta, x, xq, xs, xe, xoff, y, parts):  # type: ignore[no-untyped-def]
        quantize(x, width, xq, xs, xe, xoff)
        rows = y.shape[1]
        step = (rows + parts - 1) // parts
        for part in prange(parts):
            first, last = min(rows, part * step), min(rows, (part + 1) * step)
            if width == 4:
                nibble_rows(payload, meta, xq, xs, xe, xoff, y, first, last)
            else:
                _matmul_rows(payload, meta, xq, xs, y, first, last, width)

    def decode(payload, meta, out, first, last):  # type: ignore[no-untyped-def]
        _decode_rows(payload, meta, out, first, last, width)

    return BlockKernels(
        matmul=numba.njit(**JIT)(matmul),
        matmul_parallel=numba.njit(parallel=True, **JIT)(matmul_parallel),
        decode=numba.njit(**JIT)(decode),
    )


@numba.njit(**JIT)
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
