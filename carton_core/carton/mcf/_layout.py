"""Byte layout of MCF quantized payloads: region offsets and sizes (mcf-model-container-format.md section 4).

Every region starts on a 64-byte boundary relative to the payload start; the final region is not padded.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from carton.errors import MCFError
from carton.mcf._packing import BLOCK, block_bytes
from carton.mcf._types import QuantDomain, QuantMethod

__all__ = [
    "SUPER_BLOCKS",
    "PayloadLayout",
    "Region",
    "align64",
    "as_payload_array",
    "coerce_domain",
    "coerce_method",
    "payload_layout",
    "payload_size",
]

SUPER_BLOCKS = 8  # blocks of 32 per k* super-block (256 values)


def align64(offset: int) -> int:
    """Round ``offset`` up to the next multiple of 64."""
    return (offset + 63) & ~63


@dataclass(frozen=True, slots=True, kw_only=True)
class Region:
    """One region of a payload: ``size`` bytes at ``offset`` from the payload start."""

    offset: int
    size: int

    @property
    def end(self) -> int:
        """Offset just past the region."""
        return self.offset + self.size


@dataclass(frozen=True, slots=True, kw_only=True)
class PayloadLayout:
    """Where each region of a quantized payload lives.

    ``scales`` holds the block scales (q*, fp16), the super-block scales (k*, fp16) or the tensor scale (int*, one
    float32); ``zero`` the int* activations zero point (float32); ``sub_scales`` the k* 6-bit sub-scales (one byte per
    block); ``data`` the packed codes.
    """

    method: QuantMethod
    domain: QuantDomain
    rows: int
    cols: int
    blocks_per_row: int
    supers_per_row: int
    scales: Region
    zero: Region | None
    sub_scales: Region | None
    data: Region

    @property
    def size(self) -> int:
        """Total payload bytes (the codes region is last and unpadded)."""
        return self.data.end

    @property
    def bits(self) -> int:
        """Bits per code."""
        return self.method.bits

    @property
    def padded_cols(self) -> int:
        """Values per row including the last block's padding (a multiple of 32; ``cols`` for int*)."""
        return self.blocks_per_row * BLOCK


def coerce_method(method: QuantMethod | str) -> QuantMethod:
    """``QuantMethod(method)``, or `MCFError` listing the valid methods."""
    try:
        return QuantMethod(method)
    except ValueError as exc:
        valid = ", ".join(m.value for m in QuantMethod)
        raise MCFError(f"unknown quantization method {method!r} (expected one of: {valid})") from exc


def coerce_domain(domain: QuantDomain | int) -> QuantDomain:
    """``QuantDomain(domain)``, or `MCFError` naming the two domains."""
    try:
        return QuantDomain(domain)
    except ValueError as exc:
        raise MCFError(f"unknown quantization domain {domain!r} (expected 0 weights or 1 activations)") from exc


def payload_layout(
    method: QuantMethod | str, rows: int, cols: int, *, domain: QuantDomain | int = QuantDomain.WEIGHTS
) -> PayloadLayout:
    """Region offsets and sizes of a ``rows x cols`` tensor quantized with ``method`` in ``domain``:
    ``payload_layout("k4", 4096, 4096).data.offset`` is where the codes start; kernels read a payload through it."""
    method = coerce_method(method)
    domain = coerce_domain(domain)
    if isinstance(rows, bool) or isinstance(cols, bool) or not isinstance(rows, int) or not isinstance(cols, int):
        raise MCFError(f"{method.value} tensor shape must be two integers, got rows={rows!r}, cols={cols!r}")
    if rows <= 0 or cols <= 0:
        raise MCFError(f"{method.value} tensor shape must be positive, got ({rows}, {cols})")
    if method.family != "int" and domain is not QuantDomain.WEIGHTS:
        raise MCFError(f"{method.value} supports only the weights domain (q* and k* are symmetric), got {domain.name}")
    blocks_per_row = -(-cols // BLOCK)
    supers_per_row = -(-blocks_per_row // SUPER_BLOCKS)
    total_blocks = rows * blocks_per_row
    zero: Region | None = None
    sub: Region | None = None
    if method.family == "int":
        scales = Region(offset=0, size=4)
        cursor = scales.end
        if domain is QuantDomain.ACTIVATIONS:
            zero = Region(offset=align64(cursor), size=4)
            cursor = zero.end
        count = rows * cols
        data_size = count if method.bits == 8 else -(-count // 2)
        data = Region(offset=align64(cursor), size=data_size)
    elif method.family == "q":
        scales = Region(offset=0, size=2 * total_blocks)
        data = Region(offset=align64(scales.end), size=total_blocks * block_bytes(method.bits))
    else:
        scales = Region(offset=0, size=2 * rows * supers_per_row)
        sub = Region(offset=align64(scales.end), size=total_blocks)
        data = Region(offset=align64(sub.end), size=total_blocks * block_bytes(method.bits))
    return PayloadLayout(
        method=method,
        domain=domain,
        rows=rows,
        cols=cols,
        blocks_per_row=blocks_per_row,
        supers_per_row=supers_per_row,
        scales=scales,
        zero=zero,
        sub_scales=sub,
        data=data,
    )


def payload_size(
    method: QuantMethod | str, rows: int, cols: int, *, domain: QuantDomain | int = QuantDomain.WEIGHTS
) -> int:
    """Exact payload size in bytes (regions 64-byte aligned, the last one unpadded)."""
    return payload_layout(method, rows, cols, domain=domain).size


def as_payload_array(
    payload: bytes | bytearray | memoryview | npt.NDArray[np.uint8], layout: PayloadLayout
) -> npt.NDArray[np.uint8]:
    """View ``payload`` (bytes, memoryview, uint8 array) as a flat uint8 array without copying; `MCFError` when its
    size is not ``layout.size``. Every reader of a payload starts with it."""
    if isinstance(payload, np.ndarray):
        if payload.dtype != np.uint8:
            raise MCFError(f"{layout.method.value} payload array must be uint8, got {payload.dtype}")
        flat = payload.reshape(-1)
    elif isinstance(payload, bytes | bytearray | memoryview):
        try:
            flat = np.frombuffer(payload, dtype=np.uint8)
        except (ValueError, TypeError, BufferError) as exc:
            raise MCFError(f"{layout.method.value} payload is not a contiguous byte buffer: {exc}") from exc
    else:
        raise MCFError(
            f"{layout.method.value} payload must be bytes, memoryview or a uint8 array, got {type(payload).__name__}"
        )
    if flat.size != layout.size:
        raise MCFError(
            f"{layout.method.value} payload for shape ({layout.rows}, {layout.cols}) must be {layout.size} bytes, "
            f"got {flat.size}"
        )
    return flat
