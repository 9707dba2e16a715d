"""What every compiled product over q* / k* payloads shares: compilation settings, a part's description (``meta``),
block scales read from the payload, and the int16 rounding of the activations.

``meta`` is a part's int64 description: payload offsets of the codes, scales and sub-scales; blocks and
super-blocks per row of the whole tensor; the part's first row, first block and block count. Activations are
rounded per block of 32 to int16 with scale ``max|x| / 32767`` (relative error at most ``1 / 65534`` of the block's
largest value) into the lane order the kernel of their code width reads (`_simd.lane_order`, `_simd.nibble_order`).
"""

from __future__ import annotations

import numba
import numpy as np

from ._simd import first_lanes, lane_order, load_f16, load_f16x8, load_u8x8, mul, splat, store_f32x8

__all__ = [
    "BLOCKS_PER_VECTOR",
    "JIT",
    "LANE_ORDERS",
    "grouped_scales",
    "padded_blocks",
    "quantize_activations",
    "row_scales",
    "scale_group",
    "whole_group",
]

#: numba settings of every kernel: compiled once, cached on disk, the GIL released. No ``fastmath``: reassociation
#: would let LLVM sum in an order that depends on where a function is inlined, and a product must give the same
#: bits whichever thread count (and so whichever compiled caller) runs it; the vector code is explicit instead.
JIT = {"nogil": True, "cache": True, "error_model": "numpy", "boundscheck": False}
BLOCKS_PER_VECTOR = 8
_INV32767 = np.float32(1.0 / 32767.0)
_SUB_SCALE = np.float32(1.0 / 32.0)

#: bit width -> code index held by each of a block's 32 lanes (int64; row ``width`` of a [9, 32] table, so that
#: compiled code can index it by a width known only at run time).
LANE_ORDERS = np.zeros((9, 32), dtype=np.int64)
for _width in (2, 3, 4, 6, 8):
    LANE_ORDERS[_width] = lane_order(_width)


@numba.njit(**JIT)
def padded_blocks(blocks):  # type: ignore[no-untyped-def]
    """``blocks`` rounded up to whole vectors of block scales (scale buffers are this long, zero past the end)."""
    return (blocks + BLOCKS_PER_VECTOR - 1) // BLOCKS_PER_VECTOR * BLOCKS_PER_VECTOR


@numba.njit(**JIT)
def quantize_activations(x, order, xq, xs):  # type: ignore[no-untyped-def]
    """Round ``x [m, k]`` (float32) per block of 32 into int16 ``xq [m, >= blocks * 32]`` in lane order ``order``,
    with the block scales in ``xs [m, >= blocks]`` (zero past the last block); columns past ``k`` count as zero."""
    m, k = x.shape
    blocks = (k + 31) // 32
    for j in range(m):
        xs[j, blocks:] = 0.0
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


@numba.njit(**JIT)
def scale_group(payload, meta, row, kfamily, b):  # type: ignore[no-untyped-def]
    """The float32 scales of blocks ``b .. b + 7`` of the part's ``row`` (q*: the fp16 block scales; k*: fp16
    super-scale x sub-scale / 32), zero past the part's last block; ``b`` is a multiple of 8 and, for k*, the part
    starts on a super-block (`grouped_scales`).

    Eight scales (eight sub-scales) are read at a time, also where the part ends inside the group: in every q* / k*
    layout the scales and sub-scales are followed by at least the 64-byte aligned codes region, so the read stays in
    the payload, and the lanes past the end are zeroed before anything uses them."""
    return first_lanes(whole_group(payload, meta, row, kfamily, b), meta[7] - b)


@numba.njit(**JIT)
def whole_group(payload, meta, row, kfamily, b):  # type: ignore[no-untyped-def]
    """`scale_group` of a group that lies wholly inside the part (``b + 8 <= blocks``): nothing to zero."""
    scale_at, blocks_full, block0 = meta[1], meta[3], meta[6]
    if kfamily:
        scale = load_f16(payload, scale_at + 2 * (row * meta[4] + (block0 + b) // 8)) * _SUB_SCALE
        return mul(load_u8x8(payload, meta[2] + row * blocks_full + block0 + b), splat(scale))
    return load_f16x8(payload, scale_at + 2 * (row * blocks_full + block0 + b))


@numba.njit(**JIT)
def grouped_scales(meta):  # type: ignore[no-untyped-def]
    """Whether `scale_group` reads this part's scales: always for q*; for k* when the part starts on a
    super-block."""
    return meta[8] == 0 or meta[6] % 8 == 0


@numba.njit(**JIT)
def row_scales(payload, meta, row, kfamily, scales):  # type: ignore[no-untyped-def]
    """The scales of every block of the part's ``row`` into ``scales`` (`padded_blocks` values, zero past the
    part's last block): `scale_group` at a time, or one by one for a k* part that does not start on a
    super-block."""
    blocks = meta[7]
    padded = padded_blocks(blocks)
    if grouped_scales(meta):
        for b in range(0, padded, 8):
            store_f32x8(scales, b, scale_group(payload, meta, row, kfamily, b))
        return
    supers = meta[1] + 2 * row * meta[4]
    subs = meta[2] + row * meta[3] + meta[6]
    for b in range(blocks):
        scale = load_f16(payload, supers + 2 * ((meta[6] + b) // 8)) * _SUB_SCALE
        scales[b] = scale * np.float32(payload[subs + b])
    for b in range(blocks, padded):
        scales[b] = 0.0
