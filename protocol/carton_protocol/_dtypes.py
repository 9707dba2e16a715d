"""The wire's element types: Triton's datatype names, their numpy dtypes and carton's `DType` equivalents.

Every fixed-size type travels as raw little-endian C-order bytes. ``BYTES`` travels as Triton lays it out: per
element a 4-byte little-endian length, then the bytes. carton's strings are ``BYTES`` holding utf-8 and are ``str``
numpy arrays on both ends.
"""

from __future__ import annotations

import enum
from typing import Any

import numpy as np

from ._spec import DType
from .errors import FrameError

__all__ = ["WIRE_TYPES", "WireType", "carton_dtype", "from_numpy", "to_numpy"]


class WireType(enum.StrEnum):
    """A tensor's datatype on the wire, named as in Triton / KServe v2."""

    BOOL = "BOOL"
    UINT8 = "UINT8"
    UINT16 = "UINT16"
    UINT32 = "UINT32"
    UINT64 = "UINT64"
    INT8 = "INT8"
    INT16 = "INT16"
    INT32 = "INT32"
    INT64 = "INT64"
    FP16 = "FP16"
    BF16 = "BF16"
    FP32 = "FP32"
    FP64 = "FP64"
    BYTES = "BYTES"


def _bfloat16() -> np.dtype[Any] | None:
    try:
        import ml_dtypes
    except ImportError:  # optional in a runner environment: BF16 is then refused with a clear error
        return None
    bfloat16: np.dtype[Any] = np.dtype(ml_dtypes.bfloat16)
    return bfloat16


_BF16 = _bfloat16()

#: Little-endian numpy dtype of every fixed-size wire type.
_NUMPY: dict[WireType, np.dtype[Any]] = {
    WireType.BOOL: np.dtype("?"),
    WireType.UINT8: np.dtype("<u1"),
    WireType.UINT16: np.dtype("<u2"),
    WireType.UINT32: np.dtype("<u4"),
    WireType.UINT64: np.dtype("<u8"),
    WireType.INT8: np.dtype("<i1"),
    WireType.INT16: np.dtype("<i2"),
    WireType.INT32: np.dtype("<i4"),
    WireType.INT64: np.dtype("<i8"),
    WireType.FP16: np.dtype("<f2"),
    WireType.FP32: np.dtype("<f4"),
    WireType.FP64: np.dtype("<f8"),
}
if _BF16 is not None:
    _NUMPY[WireType.BF16] = _BF16

# Keyed by (kind, itemsize) so that both byte orders of a numpy dtype find their wire type.
_BY_KIND: dict[tuple[str, int], WireType] = {
    (dtype.kind, dtype.itemsize): wire for wire, dtype in _NUMPY.items() if wire is not WireType.BF16
}

_CARTON: dict[WireType, DType] = {
    WireType.UINT8: DType.UINT8,
    WireType.UINT16: DType.UINT16,
    WireType.UINT32: DType.UINT32,
    WireType.UINT64: DType.UINT64,
    WireType.INT8: DType.INT8,
    WireType.INT16: DType.INT16,
    WireType.INT32: DType.INT32,
    WireType.INT64: DType.INT64,
    WireType.FP32: DType.FLOAT32,
    WireType.FP64: DType.FLOAT64,
    WireType.BYTES: DType.STRING,
}

#: Wire types by name, for decoding a header without the cost of an enum lookup failure path.
WIRE_TYPES: dict[str, WireType] = {member.value: member for member in WireType}


def from_numpy(dtype: np.dtype[Any], *, tensor: str) -> WireType:
    """The wire type that carries arrays of `dtype`; `FrameError` naming `tensor` if none does."""
    if dtype.kind in "UO":
        return WireType.BYTES
    if _BF16 is not None and dtype == _BF16:
        return WireType.BF16
    wire = _BY_KIND.get((dtype.kind, dtype.itemsize))
    if wire is None:
        raise FrameError(
            f"tensor {tensor!r}: numpy dtype {dtype} has no wire type "
            "(supported: bool, int8-64, uint8-64, float16/32/64, bfloat16, str)"
        )
    return wire


def to_numpy(wire: WireType, *, tensor: str) -> np.dtype[Any]:
    """The little-endian numpy dtype of a fixed-size wire type (not ``BYTES``)."""
    dtype = _NUMPY.get(wire)
    if dtype is None:
        raise FrameError(f"tensor {tensor!r}: datatype {wire} needs the ml_dtypes package, which is not installed")
    return dtype


def carton_dtype(wire: WireType) -> DType | None:
    """The carton.toml `DType` a wire type corresponds to, or ``None`` (BOOL, FP16, BF16 have none)."""
    return _CARTON.get(wire)
