"""KServe v2 datatypes: carton's `DType` <-> the protocol's names, numpy dtypes, and the BYTES element layout.

A fixed-size tensor travels as raw little-endian row-major bytes. A BYTES tensor travels as, per element, a 4-byte
little-endian unsigned length followed by that many bytes; carton's ``string`` tensors are BYTES holding utf-8 and are
``str`` numpy arrays on the model side.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from carton_protocol import DType

from .errors import BadRequest

__all__ = [
    "DATATYPE_OF",
    "DTYPE_OF",
    "NUMPY_OF",
    "counted",
    "datatype_of_array",
    "decode_bytes_elements",
    "encode_bytes_elements",
]

#: The KServe datatype of each carton dtype.
DATATYPE_OF: dict[DType, str] = {
    DType.FLOAT32: "FP32",
    DType.FLOAT64: "FP64",
    DType.STRING: "BYTES",
    DType.INT8: "INT8",
    DType.INT16: "INT16",
    DType.INT32: "INT32",
    DType.INT64: "INT64",
    DType.UINT8: "UINT8",
    DType.UINT16: "UINT16",
    DType.UINT32: "UINT32",
    DType.UINT64: "UINT64",
}

#: The carton dtype of each KServe datatype a carton can declare.
DTYPE_OF: dict[str, DType] = {name: dtype for dtype, name in DATATYPE_OF.items()}

#: Little-endian numpy dtypes of the fixed-size KServe datatypes (BOOL and FP16 included: models may return them).
NUMPY_OF: dict[str, np.dtype[Any]] = {
    "BOOL": np.dtype("?"),
    "UINT8": np.dtype("<u1"),
    "UINT16": np.dtype("<u2"),
    "UINT32": np.dtype("<u4"),
    "UINT64": np.dtype("<u8"),
    "INT8": np.dtype("<i1"),
    "INT16": np.dtype("<i2"),
    "INT32": np.dtype("<i4"),
    "INT64": np.dtype("<i8"),
    "FP16": np.dtype("<f2"),
    "FP32": np.dtype("<f4"),
    "FP64": np.dtype("<f8"),
}

_BY_KIND: dict[tuple[str, int], str] = {(dtype.kind, dtype.itemsize): name for name, dtype in NUMPY_OF.items()}


def counted(count: int, noun: str) -> str:
    """``1 element``, ``2 elements``: messages quote counts a client sent, which are often 1."""
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def datatype_of_array(array: np.ndarray, *, tensor: str) -> str:
    """The KServe datatype that carries `array`; `TypeError` for a numpy dtype KServe v2 has no name for."""
    if array.dtype.kind in "USO":
        return "BYTES"
    name = _BY_KIND.get((array.dtype.kind, array.dtype.itemsize))
    if name is None:
        raise TypeError(f"output {tensor!r} has numpy dtype {array.dtype}, which KServe v2 cannot carry")
    return name


def encode_bytes_elements(array: np.ndarray) -> bytes:
    """Lay out a str/bytes array as BYTES elements (4-byte little-endian length, then the bytes), row-major."""
    parts: list[bytes] = []
    for element in array.ravel(order="C").tolist():
        data = element.encode() if isinstance(element, str) else bytes(element)
        parts.append(len(data).to_bytes(4, "little"))
        parts.append(data)
    return b"".join(parts)


def decode_bytes_elements(buffer: memoryview, count: int, *, tensor: str) -> list[bytes]:
    """Read exactly `count` BYTES elements filling `buffer`; `BadRequest` naming `tensor` if the layout is wrong."""
    elements: list[bytes] = []
    offset = 0
    end = len(buffer)
    for index in range(count):
        if offset + 4 > end:
            raise BadRequest(
                f"input {tensor!r}: BYTES element {index} length prefix runs past the end of the tensor data "
                f"({end} bytes for {counted(count, 'element')})"
            )
        length = int.from_bytes(buffer[offset : offset + 4], "little")
        offset += 4
        if offset + length > end:
            raise BadRequest(
                f"input {tensor!r}: BYTES element {index} declares {length} bytes but only {end - offset} remain "
                "in the tensor data"
            )
        elements.append(bytes(buffer[offset : offset + length]))
        offset += length
    if offset != end:
        raise BadRequest(
            f"input {tensor!r}: {counted(end - offset, 'byte')} left over after the {counted(count, 'BYTES element')} "
            "its shape holds"
        )
    return elements
