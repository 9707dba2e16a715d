"""Decoding of quantized payloads: fp32 block scales, int8 codes, and full dequantization.

Every reconstructed value is exact in float32: an fp16 scale has 11 significant bits, a 6-bit sub-scale over 32 adds
6, a code at most 7; their product fits float32's 24-bit significand, so the order of multiplication never matters.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from carton.errors import MCFError
from carton.mcf._fp16 import f16_bits_to_f32
from carton.mcf._layout import SUPER_BLOCKS, PayloadLayout, as_payload_array, payload_layout
from carton.mcf._lut import MIN_PARALLEL_VALUES, BlockDecoder, IntDecoder, chunk_rows, parallel_ranges, resolve_threads
from carton.mcf._packing import block_bytes, unpack_blocks
from carton.mcf._types import QuantDomain, QuantMethod

__all__ = ["block_codes", "block_scales", "dequantize", "dequantize_unpacked", "int_codes", "int_parameters"]


def _region(flat: npt.NDArray[np.uint8], offset: int, size: int) -> npt.NDArray[np.uint8]:
    return flat[offset : offset + size]


def block_scales(flat: npt.NDArray[np.uint8], layout: PayloadLayout) -> npt.NDArray[np.float32]:
    """Per-block fp32 scales ``[rows, blocks_per_row]`` of a q* / k* payload (k*: super-scale x sub-scale / 32
    folded once), validated: a non-finite fp16 scale or a sub-scale above 63 is an `MCFError` naming it.
    ``flat`` comes from `as_payload_array`; kernels that keep fp32 scales build them with this."""
    if layout.method.family == "int":
        raise MCFError(f"{layout.method.value} has one tensor scale, not block scales")
    rows, nb = layout.rows, layout.blocks_per_row
    scale_bits = _region(flat, layout.scales.offset, layout.scales.size).view(np.uint16)
    scales = f16_bits_to_f32(scale_bits)
    if not np.isfinite(scales).all():
        bad = int(np.flatnonzero(~np.isfinite(scales))[0])
        kind = "block" if layout.method.family == "q" else "super-block"
        raise MCFError(
            f"{layout.method.value} payload: {kind} scale #{bad} is not finite (fp16 0x{scale_bits[bad]:04X})"
        )
    if layout.method.family == "q":
        return scales.reshape(rows, nb)
    assert layout.sub_scales is not None
    sub = _region(flat, layout.sub_scales.offset, layout.sub_scales.size)
    if (sub > 63).any():
        bad = int(np.flatnonzero(sub > 63)[0])
        raise MCFError(
            f"{layout.method.value} payload: sub-scale #{bad} is 0x{sub[bad]:02X}; its top two bits must be zero "
            f"(offset {layout.sub_scales.offset + bad})"
        )
    supers = scales.reshape(rows, layout.supers_per_row)
    expanded = np.repeat(supers, SUPER_BLOCKS, axis=1)[:, :nb]
    return expanded * (sub.reshape(rows, nb).astype(np.float32) * np.float32(1.0 / 32.0))


def block_codes(
    flat: npt.NDArray[np.uint8], layout: PayloadLayout, row_start: int, row_stop: int
) -> npt.NDArray[np.int8]:
    """Signed int8 codes ``[row_stop - row_start, blocks_per_row, 32]`` of the given rows of a q* / k* payload
    (padding codes as stored); ``codes * block_scales(...)[rows, :, None]`` is the dequantized block."""
    nb, bb = layout.blocks_per_row, block_bytes(layout.bits)
    row_bytes = nb * bb
    data = _region(flat, layout.data.offset + row_start * row_bytes, (row_stop - row_start) * row_bytes)
    return unpack_blocks(data.reshape(row_stop - row_start, nb, bb), layout.bits)


def int_parameters(flat: npt.NDArray[np.uint8], layout: PayloadLayout) -> tuple[np.float32, np.float32]:
    """Tensor scale and zero point of an int* payload (zero is 0 in the weights domain): a value is
    ``(code - zero) * scale``. A non-finite one is an `MCFError`."""
    scale = _region(flat, layout.scales.offset, 4).view("<f4")[0]
    zero = np.float32(0.0) if layout.zero is None else _region(flat, layout.zero.offset, 4).view("<f4")[0]
    if not (np.isfinite(scale) and np.isfinite(zero)):
        raise MCFError(f"{layout.method.value} payload: scale {scale} or zero point {zero} is not finite")
    return np.float32(scale), np.float32(zero)


def int_codes(flat: npt.NDArray[np.uint8], layout: PayloadLayout) -> npt.NDArray[np.int8]:
    """Signed int8 codes ``[rows * cols]`` of an int* payload, row-major (int4 unpacked low nibble first)."""
    count = layout.rows * layout.cols
    data = _region(flat, layout.data.offset, layout.data.size)
    if layout.bits == 8:
        return data.view(np.int8)
    codes = np.empty(2 * data.size, dtype=np.uint8)
    codes[0::2] = data & np.uint8(0x0F)
    codes[1::2] = data >> np.uint8(4)
    signed = (codes ^ np.uint8(8)).view(np.int8) - np.int8(8)
    return signed[:count].astype(np.int8, copy=False)


def dequantize(
    payload: bytes | bytearray | memoryview | npt.NDArray[np.uint8],
    method: QuantMethod | str,
    shape: tuple[int, int],
    *,
    domain: QuantDomain | int = QuantDomain.WEIGHTS,
    out: npt.NDArray[np.float32] | None = None,
    threads: int | None = 1,
) -> npt.NDArray[np.float32]:
    """Reconstruct the float32 ``shape`` tensor from a quantized payload (validating size, scales, sub-scales).

    ``out``, a C-contiguous float32 array of that shape, receives the result instead of a new array (saves the page
    faults of a fresh allocation when the same buffer is reused). ``threads`` splits large tensors' rows across a
    small thread pool (``None``: one per CPU); results do not depend on it.
    """
    if not isinstance(shape, tuple | list) or len(shape) != 2:
        raise MCFError(f"quantized tensors are rank 2; got shape {shape!r}")
    rows, cols = (int(d) for d in shape)
    layout = payload_layout(method, rows, cols, domain=domain)
    flat = as_payload_array(payload, layout)
    if out is None:
        out = np.empty((rows, cols), dtype=np.float32)
    elif out.dtype != np.float32 or out.shape != (rows, cols) or not out.flags.c_contiguous:
        raise MCFError(
            f"out must be a C-contiguous float32 array of shape ({rows}, {cols}); got {out.dtype} {out.shape}"
        )
    workers = resolve_threads(threads) if rows * cols >= MIN_PARALLEL_VALUES else 1
    if layout.method.family == "int":
        scale, zero = int_parameters(flat, layout)
        int_decoder = IntDecoder(flat, layout, scale, zero)
        flat_out = out.reshape(-1)
        parallel_ranges(rows * cols, workers, 2, lambda v0, v1: int_decoder.decode(v0, v1, flat_out[v0:v1]))
        return out
    decoder = BlockDecoder(flat, layout, block_scales(flat, layout))
    if cols == layout.padded_cols:
        parallel_ranges(rows, workers, 1, lambda r0, r1: decoder.decode(r0, r1, out[r0:r1]))
        return out
    step = chunk_rows(layout.padded_cols)

    def ragged(r0: int, r1: int) -> None:
        # Rows whose last block is partial: decode whole blocks into a per-thread tile, keep the first cols.
        tile = np.empty((min(step, r1 - r0), layout.padded_cols), dtype=np.float32)
        for c0 in range(r0, r1, step):
            c1 = min(r1, c0 + step)
            decoder.decode(c0, c1, tile[: c1 - c0])
            out[c0:c1] = tile[: c1 - c0, :cols]

    parallel_ranges(rows, workers, step, ragged)
    return out


def dequantize_unpacked(
    payload: bytes | bytearray | memoryview | npt.NDArray[np.uint8],
    method: QuantMethod | str,
    shape: tuple[int, int],
    *,
    domain: QuantDomain | int = QuantDomain.WEIGHTS,
) -> npt.NDArray[np.float32]:
    """The straightforward decoder: unpack every code to int8, convert, multiply by its scale.

    Slower than :func:`dequantize` and bit-identical to it; kept as the oracle for tests and the baseline of
    ``bench/bench_mcf.py``.
    """
    rows, cols = (int(d) for d in shape)
    layout = payload_layout(method, rows, cols, domain=domain)
    flat = as_payload_array(payload, layout)
    if layout.method.family == "int":
        scale, zero = int_parameters(flat, layout)
        values = int_codes(flat, layout).astype(np.float32)
        if zero != 0:
            values -= zero
        values *= scale
        return values.reshape(rows, cols)
    values = block_codes(flat, layout, 0, rows).astype(np.float32)
    values *= block_scales(flat, layout)[:, :, None]
    return np.ascontiguousarray(values.reshape(rows, layout.padded_cols)[:, :cols])
