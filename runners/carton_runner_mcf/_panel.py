"""Large-batch (prefill) products of block payloads on int16 weight panels: a register-blocked integer kernel.

A batch of many activation rows amortizes decoding the weights once per product; decoding them to float32 for BLAS
(`_packed.CompiledPayload.tiled`) then leaves the products to an fp32 sgemm. On a CPU with 512-bit VNNI an int16
pair product (``vpdpwssd``: 32 multiply-adds) issues as fast as an fp32 FMA (16), so this path keeps the products in
integers, with the activations rounded exactly as the small-batch kernels round them.

- **Panel**: the part's rows, sixteen at a time (a *group*), unpacked from the payload into int16 codes in natural
  column order and transposed (`_panel_ir.transpose_block`) to ``[block][pair of columns][16 rows][2 codes]``, with
  float32 scales ``[block][16 rows]`` (k*: super-scale x sub-scale folded in): one layout for every code width. One
  vector load then holds one pair of columns of the sixteen rows. A group is packed just before it is used, so it
  is read from L1 by every activation row.
- **Activations**: rounded per block of 32 to int16 (`quantize_natural`: the rounding of
  `_blocks.quantize_activations`, bit for bit, in natural column order), read as int32 pairs.
- **Micro-kernel** (`_panel_ir.panel_tile`): a group against `ROWS` activation rows at a time (then 4, 2, 1 for the
  rest): lane ``r`` of an accumulator is weight row ``r``'s block product with one activation row; per block it is
  converted to float32 and added with one FMA by ``weight scales x activation block scale``.

``panel_kernels(width)`` gives the serial and the threaded product (``prange`` over parts of the groups); every
output value is computed by the same code whichever part holds it, so results do not depend on the thread count.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numba
import numpy as np
from numba import prange

from ._blocks import JIT, padded_blocks, row_scales
from ._panel_ir import GROUP, PAIRS, panel_tile, round_block, store_codes, transpose_block
from ._simd import unpack_codes

__all__ = [
    "GROUP",
    "ROWS",
    "PanelKernels",
    "activation_shapes",
    "group_product",
    "pack_group",
    "panel_kernels",
    "quantize_natural",
    "quantize_rows",
]

#: Activation rows per micro-kernel call: with sixteen weight vectors and as many integer sums, what the 32 vector
#: registers of AVX-512 hold.
ROWS = 8
_BLOCK = 32
_INV32767 = np.float32(1.0 / 32767.0)


def activation_shapes(m: int, blocks: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """Shapes of the work arrays of `quantize_natural` for ``m`` rows of a part of ``blocks`` blocks: ``xq`` (int16)
    and ``xs`` (float32)."""
    return (m, blocks * _BLOCK), (m, (blocks + 7) // 8 * 8)


@numba.njit(**JIT)
def quantize_natural(x, xq, xs):  # type: ignore[no-untyped-def]
    """Round ``x [m, k]`` (C-contiguous float32) per block of 32 into int16 ``xq [m, >= blocks * 32]`` in natural
    column order and block scales ``xs [m, >= blocks]`` (zero past the last block)."""
    quantize_rows(x, xq, xs, 0, x.shape[0])


@numba.njit(**JIT)
def quantize_rows(x, xq, xs, first, last):  # type: ignore[no-untyped-def]
    """`quantize_natural` of rows ``first .. last``."""
    k = x.shape[1]
    blocks = (k + _BLOCK - 1) // _BLOCK
    flat_x = x.reshape(-1)
    flat_q = xq.reshape(-1)
    for j in range(first, last):
        xs[j, blocks:] = 0.0
        for b in range(blocks):
            base = b * _BLOCK
            into = j * xq.shape[1] + base
            xs[j, b] = round_block(flat_x, j * k + base, min(_BLOCK, k - base), flat_q, into, _INV32767)


@numba.njit(**JIT)
def pack_group(payload, meta, first, rows, codes, scales, natural, row_buffer, width):  # type: ignore[no-untyped-def]
    """Part rows ``first .. first + 16`` (those below ``rows``) as one panel group: ``codes`` int32 ``[blocks, 16,
    16]``, ``scales`` float32 ``[blocks, 16]``; rows past ``rows`` are zero. ``natural`` (int16 ``[16, blocks *
    32]``) and ``row_buffer`` (float32, `_blocks.padded_blocks` values) are work arrays; ``width`` a constant."""
    data_at, blocks_full, row0, block0, blocks, kfamily = meta[0], meta[3], meta[5], meta[6], meta[7], meta[8] != 0
    block_bytes = 4 * width
    flat = natural.reshape(-1)
    stride = natural.shape[1]
    for r in range(GROUP):
        if first + r >= rows:
            natural[r, :] = 0
            scales[:, r] = 0.0
            continue
        row = row0 + first + r
        at = data_at + row * blocks_full * block_bytes + block0 * block_bytes
        row_scales(payload, meta, row, kfamily, row_buffer)
        for b in range(blocks):
            scales[b, r] = row_buffer[b]
            low = unpack_codes(payload, at + b * block_bytes, width, 0)
            high = unpack_codes(payload, at + b * block_bytes, width, 1)
            store_codes(flat, r * stride + b * _BLOCK, low, high, width)
    pairs = flat.view(np.int32)
    out = codes.reshape(-1)
    for b in range(blocks):
        transpose_block(pairs, b * PAIRS, stride // 2, out, b * PAIRS * GROUP)


@numba.njit(**JIT)
def group_product(codes, scales, xq32, xs, out, acc, col, lanes):  # type: ignore[no-untyped-def]
    """Columns ``col .. col + lanes`` of ``out [m, rows]`` from one packed group and all ``m`` activation rows."""
    m = xq32.shape[0]
    j = 0
    while j + ROWS <= m:
        panel_tile(codes, scales, xq32, xs, out, acc, col, j, lanes, ROWS)
        j += ROWS
    if m - j >= 4:
        panel_tile(codes, scales, xq32, xs, out, acc, col, j, lanes, 4)
        j += 4
    if m - j >= 2:
        panel_tile(codes, scales, xq32, xs, out, acc, col, j, lanes, 2)
        j += 2
    if m - j >= 1:
        panel_tile(codes, scales, xq32, xs, out, acc, col, j, lanes, 1)


@numba.njit(**JIT)
def _groups(payload, meta, xq, xs, y, first, last, width):  # type: ignore[no-untyped-def]
    """Output columns of groups ``first .. last`` of ``y = x @ W.T`` from rounded activations (``width`` a
    constant); the work arrays are this call's own."""
    blocks = meta[7]
    rows = y.shape[1]
    codes = np.empty((blocks, PAIRS, GROUP), dtype=np.int32)
    scales = np.empty((blocks, GROUP), dtype=np.float32)
    natural = np.empty((GROUP, blocks * _BLOCK), dtype=np.int16)
    row_buffer = np.empty(padded_blocks(blocks), dtype=np.float32)
    acc = np.empty(ROWS * GROUP, dtype=np.float32)
    xq32 = xq.view(np.int32)
    for g in range(first, last):
        col = g * GROUP
        pack_group(payload, meta, col, rows, codes, scales, natural, row_buffer, width)
        group_product(codes, scales, xq32, xs, y, acc, col, min(GROUP, rows - col))


@dataclass(frozen=True, slots=True)
class PanelKernels:
    """The panel products of one code width (see `panel_kernels`).

    ``matmul(payload, meta, x, xq, xs, y)`` and ``matmul_parallel(..., parts)`` compute ``y [m, rows] = x @ W.T``,
    rounding ``x [m, cols]`` (C-contiguous float32) into the work arrays first (`quantize_natural`; shapes from
    `activation_shapes`)."""

    matmul: Any
    matmul_parallel: Any
    #: ``matmul_many(payloads, metas, x, xq, xs, ys)`` and ``matmul_many_parallel(..., parts)``: the products of
    #: several matrices of the same input (tuples of payloads, metas and outputs ``ys``), the input rounded once and
    #: the matrices' groups shared out as one list; each output equals its own `matmul`'s bit for bit.
    matmul_many: Any
    matmul_many_parallel: Any


@functools.cache
def panel_kernels(width: int) -> PanelKernels:
    """Kernels specialised for ``width``-bit codes: closures over the width alone, for the reasons of
    `_compiled.block_kernels` (cached on disk, no literal dispatch per call)."""

    def matmul(payload, meta, x, xq, xs, y):  # type: ignore[no-untyped-def]
        quantize_natural(x, xq, xs)
        _groups(payload, meta, xq, xs, y, 0, (y.shape[1] + GROUP - 1) // GROUP, width)

    def matmul_parallel(payload, meta, x, xq, xs, y, parts):  # type: ignore[no-untyped-def]
        m = x.shape[0]
        share = (m + parts - 1) // parts
        for part in prange(parts):  # each activation row is rounded whole by one thread: the same bits
            quantize_rows(x, xq, xs, min(m, part * share), min(m, (part + 1) * share))
        total = (y.shape[1] + GROUP - 1) // GROUP
        step = (total + parts - 1) // parts
        for part in prange(parts):
            _groups(payload, meta, xq, xs, y, min(total, part * step), min(total, (part + 1) * step), width)

    def matmul_many(payloads, metas, x, xq, xs, ys):  # type: ignore[no-untyped-def]
        quantize_natural(x, xq, xs)
        for i in range(len(ys)):
            _groups(payloads[i], metas[i], xq, xs, ys[i], 0, (ys[i].shape[1] + GROUP - 1) // GROUP, width)

    def matmul_many_parallel(payloads, metas, x, xq, xs, ys, parts):  # type: ignore[no-untyped-def]
        m = x.shape[0]
        share = (m + parts - 1) // parts
        for part in prange(parts):
            quantize_rows(x, xq, xs, min(m, part * share), min(m, (part + 1) * share))
        total = 0
        for i in range(len(ys)):
            total += (ys[i].shape[1] + GROUP - 1) // GROUP
        step = (total + parts - 1) // parts
        for part in prange(parts):  # a run of the matrices' groups, taken in order
            first, last = min(total, part * step), min(total, (part + 1) * step)
            base = 0
            for i in range(len(ys)):
                count = (ys[i].shape[1] + GROUP - 1) // GROUP
                if max(first, base) < min(last, base + count):
                    low, high = max(first, base) - base, min(last, base + count) - base
                    _groups(payloads[i], metas[i], xq, xs, ys[i], low, high, width)
                base += count

    return PanelKernels(
        matmul=numba.njit(**JIT)(matmul),
        matmul_parallel=numba.njit(parallel=True, **JIT)(matmul_parallel),
        matmul_many=numba.njit(**JIT)(matmul_many),
        matmul_many_parallel=numba.njit(parallel=True, **JIT)(matmul_many_parallel),
    )
