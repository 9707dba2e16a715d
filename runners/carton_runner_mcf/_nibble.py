"""Products of 4-bit block payloads (q4, k4): two blocks per step, codes read as words.

A row's codes are read 32 bytes (two blocks) at a time as sixteen 16-bit words; each of a word's four nibbles is
one mask and at most one shift away (`_simd.nibbles`), against two byte shuffles and four shifts for the
general unpacking. The nibbles are taken unsigned (``code + 8``, the sign bit flipped): ``sum((c + 8) x) - 8 sum(x)``
is the product, and the second term is one number per activation block (``xoff``), subtracted once per row.

Activations (`quantize_pairs`): int16 per block of 32 as for every width, laid out per pair of blocks in
`_simd.nibble_order`; besides the block scales ``xs`` they carry the same scales spread as a pair's int32 products
are (``xe``: four lanes per block) and ``xoff = 8 * xs * sum(q)``. A row's odd last block is read alone (16 bytes)
against a pair whose second half is zero.

`nibble_rows` computes rows of ``y = x @ W.T``: activation rows four at a time share each unpacked pair (the weight
scales spread once per row into a work buffer). Fewer than four (a decode step's one) go group by group of eight
blocks (`_single_rows`): the group's weight scales are read from the payload, multiplied by the activation scales
and kept in a register, each pair taking its two lanes with one shuffle, so nothing is stored and read back per
row; two accumulators; the codes are prefetched ahead (the hardware prefetcher stops at page boundaries).
"""

from __future__ import annotations

import numba
import numpy as np

from ._blocks import JIT, grouped_scales, padded_blocks, row_scales, scale_group, whole_group
from ._panel_ir import code_sum, round_block
from ._simd import (
    fma,
    hsum,
    iadd,
    load_f32x8,
    load_i16x16,
    madd,
    mul,
    nibble_order,
    nibbles,
    prefetch,
    spread,
    store_f32x8,
    to_float,
    to_nibble_order,
    zeros,
)

__all__ = ["PAIR_LANES", "nibble_rows", "quantize_pairs"]

_INV32767 = np.float32(1.0 / 32767.0)
#: code index (within a pair of blocks) -> lane of `_simd.nibble_order`, for `quantize_pairs`.
_LANE_OF_CODE = np.argsort(np.array(nibble_order(), dtype=np.int64)).astype(np.int64)
#: How far ahead of the codes being read the single-row loops ask for the next ones (bytes).
_AHEAD = 2048
#: int16 activations per pair of blocks.
PAIR_LANES = 64


@numba.njit(**JIT)
def quantize_pairs(x, xq, xs, xe, xoff):  # type: ignore[no-untyped-def]
    """Round ``x [m, k]`` (float32) per block of 32 into ``xq [m, pairs * 64]`` (int16, `_simd.nibble_order` per
    pair), block scales ``xs [m, >= padded blocks]``, spread scales ``xe [m, pairs * 8]`` and ``xoff [m, >= padded
    blocks]`` (``8 * xs * sum(q)``); blocks past ``k`` (the odd block's partner) are zero."""
    m, k = x.shape
    blocks = (k + 31) // 32
    pairs = (blocks + 1) // 2
    for j in range(m):
        xs[j, :] = 0.0
        xoff[j, :] = 0.0
        row, codes = x[j], xq[j]
        if row.strides[0] != 4 or codes.strides[0] != 2:
            _pairs_by_value(x, j, xq, xs, xe, xoff)
            continue
        # A block rounded as vectors in column order (the prefill's rounding, the same bits as value by value),
        # then each pair's codes moved into the nibble lanes in one shuffle.
        for p in range(pairs):
            for half in range(2):
                b = 2 * p + half
                base = b * 32
                scale = round_block(row, base, max(0, min(32, k - base)), codes, base, _INV32767)
                total = code_sum(codes, base)
                for lane in range(4):
                    xe[j, p * 8 + half * 4 + lane] = scale
                if b < blocks:
                    xs[j, b] = scale
                    xoff[j, b] = np.float32(8.0) * scale * np.float32(total)
            to_nibble_order(codes, p * 64)


@numba.njit(**JIT)
def _pairs_by_value(x, j, xq, xs, xe, xoff):  # type: ignore[no-untyped-def]
    """`quantize_pairs` of row ``j`` value by value (rows not contiguous), ``xs`` and ``xoff`` already zero."""
    k = x.shape[1]
    blocks = (k + 31) // 32
    for b in range(2 * ((blocks + 1) // 2)):
        base = b * 32
        largest = np.float32(0.0)
        for i in range(max(0, min(32, k - base))):
            largest = max(largest, abs(x[j, base + i]))
        scale = largest * _INV32767
        inverse = np.float32(32767.0) / largest if largest > 0 else np.float32(0.0)
        lanes = (b // 2) * 64
        code0 = (b % 2) * 32
        total = 0
        for c in range(32):
            column = base + c
            value = x[j, column] * inverse if column < k else np.float32(0.0)
            code = np.int16(np.rint(value))
            total += int(code)
            xq[j, lanes + _LANE_OF_CODE[code0 + c]] = code
        for lane in range(4):
            xe[j, (b // 2) * 8 + (b % 2) * 4 + lane] = scale
        if b < blocks:
            xs[j, b] = scale
            xoff[j, b] = np.float32(8.0) * scale * np.float32(total)


@numba.njit(**JIT)
def _pair(payload, at, half):  # type: ignore[no-untyped-def]
    """The four nibble vectors of the pair of blocks whose codes start at byte ``at``; with ``half`` 1 (a constant)
    a row's odd last block alone (16 bytes), the second block's lanes zero."""
    return (
        nibbles(payload, at, 0, half),
        nibbles(payload, at, 1, half),
        nibbles(payload, at, 2, half),
        nibbles(payload, at, 3, half),
    )


@numba.njit(**JIT)
def _products(codes, xq, xa):  # type: ignore[no-untyped-def]
    """The int32 products of an unpacked pair with the activations at ``xq``'s flat index ``xa``: lanes 0-3 the
    first block's partial sums, 4-7 the second's."""
    return iadd(
        iadd(madd(codes[0], load_i16x16(xq, xa)), madd(codes[1], load_i16x16(xq, xa + 16))),
        iadd(madd(codes[2], load_i16x16(xq, xa + 32)), madd(codes[3], load_i16x16(xq, xa + 48))),
    )


@numba.njit(**JIT)
def _four_rows(codes, xq, xe, spread_scales, j, p, tile):  # type: ignore[no-untyped-def]
    """Unpacked pair ``p`` times activation rows ``j .. j + 3``, added into the four accumulators of ``tile``."""
    w = load_f32x8(spread_scales, 8 * p)
    stride, xstride = xq.shape[1], xe.shape[1]
    x0, e0 = j * stride + 64 * p, j * xstride + 8 * p
    return (
        fma(to_float(_products(codes, xq, x0)), mul(w, load_f32x8(xe, e0)), tile[0]),
        fma(to_float(_products(codes, xq, x0 + stride)), mul(w, load_f32x8(xe, e0 + xstride)), tile[1]),
        fma(to_float(_products(codes, xq, x0 + 2 * stride)), mul(w, load_f32x8(xe, e0 + 2 * xstride)), tile[2]),
        fma(to_float(_products(codes, xq, x0 + 3 * stride)), mul(w, load_f32x8(xe, e0 + 3 * xstride)), tile[3]),
    )


@numba.njit(**JIT)
def _spread_into(values, b, out):  # type: ignore[no-untyped-def]
    """Eight block values from ``values[b]``, spread into the four pair vectors ``out[4 b ..]``."""
    v = load_f32x8(values, b)
    store_f32x8(out, 4 * b, spread(v, 0))
    store_f32x8(out, 4 * b + 8, spread(v, 1))
    store_f32x8(out, 4 * b + 16, spread(v, 2))
    store_f32x8(out, 4 * b + 24, spread(v, 3))


@numba.njit(**JIT)
def _offset(scales, xoff, j, padded):  # type: ignore[no-untyped-def]
    """``sum_b scale_b * xoff[j, b]``: what the unsigned codes add to activation row ``j``'s product."""
    total = zeros()
    for b in range(0, padded, 8):
        total = fma(load_f32x8(scales, b), load_f32x8(xoff, j * xoff.shape[1] + b), total)
    return hsum(total)


@numba.njit(**JIT)
def _pair_into(payload, at, xq, xa, both, k, half, acc):  # type: ignore[no-untyped-def]
    """``acc`` plus pair ``k`` (a constant) of a group of eight blocks, whose codes start at byte ``at``, times the
    activations at ``xq``'s flat index ``xa``, scaled by lanes ``2 k`` and ``2 k + 1`` of the group's scales
    ``both``; with ``half`` 1 (a constant) the pair is a row's lone last block."""
    return fma(to_float(_products(_pair(payload, at, half), xq, xa)), spread(both, k), acc)


@numba.njit(**JIT)
def _single_rows(payload, meta, xq, xs, xoff, y, first, last):  # type: ignore[no-untyped-def]
    """`nibble_rows` for fewer than four activation rows of a part whose scales are read eight at a time
    (`grouped_scales`): each group of eight blocks' scales (weight x activation) stays in a register and is spread
    per pair; two accumulators; no work buffer."""
    data_at, blocks_full, row0, block0, blocks, kfamily = meta[0], meta[3], meta[5], meta[6], meta[7], meta[8] != 0
    whole = blocks // 8 * 8
    rest = blocks - whole
    for r in range(first, last):
        row = row0 + r
        at = data_at + (row * blocks_full + block0) * 16
        for j in range(xq.shape[0]):
            xa, sa, oa = j * xq.shape[1], j * xs.shape[1], j * xoff.shape[1]
            offset, even, odd_sum = zeros(), zeros(), zeros()
            for b in range(0, whole, 8):
                group = whole_group(payload, meta, row, kfamily, b)
                offset = fma(group, load_f32x8(xoff, oa + b), offset)
                both = mul(group, load_f32x8(xs, sa + b))
                base, x0 = at + 16 * b, xa + 32 * b
                prefetch(payload, base + _AHEAD)
                prefetch(payload, base + _AHEAD + 64)
                even = _pair_into(payload, base, xq, x0, both, 0, 0, even)
                odd_sum = _pair_into(payload, base + 32, xq, x0 + 64, both, 1, 0, odd_sum)
                even = _pair_into(payload, base + 64, xq, x0 + 128, both, 2, 0, even)
                odd_sum = _pair_into(payload, base + 96, xq, x0 + 192, both, 3, 0, odd_sum)
            if rest:  # the last, partial group (its scales past the part's end are zero): whole pairs, a lone block
                group = scale_group(payload, meta, row, kfamily, whole)
                offset = fma(group, load_f32x8(xoff, oa + whole), offset)
                both = mul(group, load_f32x8(xs, sa + whole))
                base, x0 = at + 16 * whole, xa + 32 * whole
                if rest >= 2:
                    even = _pair_into(payload, base, xq, x0, both, 0, 0, even)
                if rest >= 4:
                    odd_sum = _pair_into(payload, base + 32, xq, x0 + 64, both, 1, 0, odd_sum)
                if rest >= 6:
                    even = _pair_into(payload, base + 64, xq, x0 + 128, both, 2, 0, even)
                if rest == 1:
                    odd_sum = _pair_into(payload, base, xq, x0, both, 0, 1, odd_sum)
                elif rest == 3:
                    odd_sum = _pair_into(payload, base + 32, xq, x0 + 64, both, 1, 1, odd_sum)
                elif rest == 5:
                    odd_sum = _pair_into(payload, base + 64, xq, x0 + 128, both, 2, 1, odd_sum)
                elif rest == 7:
                    odd_sum = _pair_into(payload, base + 96, xq, x0 + 192, both, 3, 1, odd_sum)
            y[j, r] = hsum(even) + hsum(odd_sum) - hsum(offset)


@numba.njit(**JIT)
def nibble_rows(payload, meta, xq, xs, xe, xoff, y, first, last):  # type: ignore[no-untyped-def]
    """Rows ``first..last`` (of the part) of ``y [m, rows] = x @ W.T`` for a 4-bit part (``meta[8]``: k* scales),
    from activations rounded by `quantize_pairs`."""
    data_at, blocks_full, row0, block0, blocks, kfamily = meta[0], meta[3], meta[5], meta[6], meta[7], meta[8] != 0
    m, stride = xq.shape
    grouped = grouped_scales(meta)
    if m < 4 and grouped:
        _single_rows(payload, meta, xq, xs, xoff, y, first, last)
        return
    pairs, odd = blocks // 2, blocks % 2
    padded = padded_blocks(blocks)
    scales = np.empty(padded, dtype=np.float32)
    spread_scales = np.empty(4 * padded, dtype=np.float32)
    both = np.empty(padded, dtype=np.float32)
    for r in range(first, last):
        row = row0 + r
        at = data_at + (row * blocks_full + block0) * 16
        if m >= 4 or not grouped:
            row_scales(payload, meta, row, kfamily, scales)
        j = 0
        if m >= 4:
            for b in range(0, padded, 8):
                _spread_into(scales, b, spread_scales)
        while j + 4 <= m:  # four activation rows share each unpacked pair
            tile = (zeros(), zeros(), zeros(), zeros())
            for p in range(pairs):
                tile = _four_rows(_pair(payload, at + 32 * p, 0), xq, xe, spread_scales, j, p, tile)
            if odd:
                tile = _four_rows(_pair(payload, at + 32 * pairs, 1), xq, xe, spread_scales, j, pairs, tile)
            y[j, r] = hsum(tile[0]) - _offset(scales, xoff, j, padded)
            y[j + 1, r] = hsum(tile[1]) - _offset(scales, xoff, j + 1, padded)
            y[j + 2, r] = hsum(tile[2]) - _offset(scales, xoff, j + 2, padded)
            y[j + 3, r] = hsum(tile[3]) - _offset(scales, xoff, j + 3, padded)
            j += 4
        while j < m:  # one activation row: both scales in one spread vector, two accumulators
            offset = zeros()
            for b in range(0, padded, 8):
                group = scale_group(payload, meta, row, kfamily, b) if grouped else load_f32x8(scales, b)
                offset = fma(group, load_f32x8(xoff, j * xoff.shape[1] + b), offset)
                store_f32x8(both, b, mul(group, load_f32x8(xs, j * xs.shape[1] + b)))
                _spread_into(both, b, spread_scales)
            even, odd_sum = zeros(), zeros()
            x0 = j * stride
            for p in range(0, pairs - 1, 2):
                prefetch(payload, at + 32 * p + _AHEAD)
                products = _products(_pair(payload, at + 32 * p, 0), xq, x0 + 64 * p)
                even = fma(to_float(products), load_f32x8(spread_scales, 8 * p), even)
                products = _products(_pair(payload, at + 32 * p + 32, 0), xq, x0 + 64 * p + 64)
                odd_sum = fma(to_float(products), load_f32x8(spread_scales, 8 * p + 8), odd_sum)
            if pairs % 2:
                p = pairs - 1
                products = _products(_pair(payload, at + 32 * p, 0), xq, x0 + 64 * p)
                even = fma(to_float(products), load_f32x8(spread_scales, 8 * p), even)
            if odd:
                p = pairs
                products = _products(_pair(payload, at + 32 * p, 1), xq, x0 + 64 * p)
                odd_sum = fma(to_float(products), load_f32x8(spread_scales, 8 * p), odd_sum)
            y[j, r] = hsum(even) + hsum(odd_sum) - hsum(offset)
            j += 1
