"""The safetensors header: dtype table, strict parsing and validation, and byte-exact serialization.

The file is ``u64 N`` (little-endian), ``N`` bytes of JSON starting with ``{`` and padded with spaces, then the data
buffer. Serialization reproduces the reference implementation exactly: ``__metadata__`` first, tensors sorted by dtype
(largest alignment first, in the reference's dtype order) then by name, compact JSON with serde_json's escaping, the
header padded with spaces to a multiple of 8, tensor bytes back to back in the same order.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

from ..errors import SafetensorsError

__all__ = [
    "DTYPES",
    "MAX_HEADER_SIZE",
    "DTypeInfo",
    "Header",
    "TensorInfo",
    "build_header",
    "byte_size",
    "dtype_for_array",
    "fits_numpy",
    "parse_header",
]

MAX_HEADER_SIZE = 100_000_000
_U64_MAX = 2**64 - 1
_LENGTH = struct.Struct("<Q")


@dataclass(frozen=True, slots=True, kw_only=True)
class DTypeInfo:
    """A safetensors dtype: its header code, its bit width, and the numpy dtype of one element."""

    code: str
    bits: int
    numpy: np.dtype[Any]
    rank: int  # position in the reference's dtype enum; serialization sorts by it, largest first


def _table() -> dict[str, DTypeInfo]:
    # Order matters: it is the reference's enum order, which decides the tensor order in files it writes.
    rows: list[tuple[str, int, Any]] = [
        ("BOOL", 8, np.bool_),
        ("F4", 4, ml_dtypes.float4_e2m1fn),
        ("F6_E2M3", 6, ml_dtypes.float6_e2m3fn),
        ("F6_E3M2", 6, ml_dtypes.float6_e3m2fn),
        ("U8", 8, np.uint8),
        ("I8", 8, np.int8),
        ("F8_E5M2", 8, ml_dtypes.float8_e5m2),
        ("F8_E4M3", 8, ml_dtypes.float8_e4m3fn),
        ("F8_E8M0", 8, ml_dtypes.float8_e8m0fnu),
        ("F8_E4M3FNUZ", 8, ml_dtypes.float8_e4m3fnuz),
        ("F8_E5M2FNUZ", 8, ml_dtypes.float8_e5m2fnuz),
        ("I16", 16, "<i2"),
        ("U16", 16, "<u2"),
        ("F16", 16, "<f2"),
        ("BF16", 16, ml_dtypes.bfloat16),
        ("I32", 32, "<i4"),
        ("U32", 32, "<u4"),
        ("F32", 32, "<f4"),
        ("C64", 64, "<c8"),
        ("F64", 64, "<f8"),
        ("I64", 64, "<i8"),
        ("U64", 64, "<u8"),
    ]
    return {code: DTypeInfo(code=code, bits=bits, numpy=np.dtype(t), rank=i) for i, (code, bits, t) in enumerate(rows)}


#: Every dtype the format defines, by header code.
DTYPES: dict[str, DTypeInfo] = _table()
_BY_NUMPY: dict[np.dtype[Any], DTypeInfo] = {info.numpy: info for info in DTYPES.values()}


def dtype_for_array(array: np.ndarray[Any, Any], name: str) -> DTypeInfo:
    dtype = array.dtype
    if dtype.byteorder == ">":
        dtype = dtype.newbyteorder("<")
    info = _BY_NUMPY.get(dtype)
    if info is None:
        raise SafetensorsError(
            f"tensor {name!r}: numpy dtype {array.dtype} has no safetensors equivalent "
            f"(supported: {', '.join(str(i.numpy) for i in DTYPES.values())})"
        )
    return info


@dataclass(frozen=True, slots=True, kw_only=True)
class TensorInfo:
    """One tensor of a header. ``begin``/``end`` are offsets into the data buffer (after the header)."""

    name: str
    dtype: DTypeInfo
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True, slots=True, kw_only=True)
class Header:
    """A parsed header: ``tensors`` in header order, ``data_start`` the absolute offset of the data buffer."""

    metadata: dict[str, str] | None
    tensors: dict[str, TensorInfo]
    data_start: int


def fits_numpy(shape: list[int] | tuple[int, ...], itemsize: int) -> bool:
    """Whether numpy can represent an array of this shape (it bounds the product of the non-zero dimensions)."""
    total = itemsize
    for dim in shape:
        if dim:
            total *= dim
    return total <= 2**63 - 1


# --- writing --------------------------------------------------------------------------------------------------
def byte_size(info: DTypeInfo, shape: tuple[int, ...], label: str) -> int:
    """Bytes taken by ``shape`` elements of ``info``, with the reference's u64 overflow checks."""
    count = 1
    for dim in shape:
        count *= dim
        if count > _U64_MAX:
            raise SafetensorsError(f"{label}: shape {list(shape)} overflows a 64-bit element count")
    bits = count * info.bits
    if bits > _U64_MAX:
        raise SafetensorsError(f"{label}: shape {list(shape)} of {info.code} overflows a 64-bit bit count")
    if bits % 8:
        raise SafetensorsError(
            f"{label}: {count} elements of {info.bits}-bit {info.code} do not fill a whole number of bytes"
        )
    return bits // 8


def build_header(
    specs: list[tuple[str, DTypeInfo, tuple[int, ...]]], metadata: Mapping[str, str] | None
) -> tuple[bytes, list[tuple[str, int]]]:
    """Header bytes (length prefix included) and the (name, size) write order of the tensors' data."""
    if metadata is not None:
        if not isinstance(metadata, Mapping):
            raise SafetensorsError(f"metadata must be a dict of str to str, got {type(metadata).__name__}")
        for key, value in metadata.items():
            if not isinstance(key, str) or not isinstance(value, str):
                raise SafetensorsError(f"metadata entry {key!r}: keys and values must be str, got {value!r}")
    ordered = sorted(specs, key=lambda s: (-s[1].rank, s[0]))
    doc: dict[str, Any] = {}
    if metadata is not None:
        doc["__metadata__"] = dict(metadata)
    order = []
    offset = 0
    for name, info, shape in ordered:
        size = byte_size(info, shape, f"tensor {name!r}")
        doc[name] = {"dtype": info.code, "shape": list(shape), "data_offsets": [offset, offset + size]}
        order.append((name, size))
        offset += size
    try:
        text = json.dumps(doc, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    except UnicodeEncodeError as exc:
        raise SafetensorsError(f"a tensor name or metadata string is not valid Unicode: {exc}") from exc
    text += b" " * (-len(text) % 8)
    return _LENGTH.pack(len(text)) + text, order


# --- reading --------------------------------------------------------------------------------------------------
class _DuplicateKey(ValueError):
    pass


def _pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


_DECODER = json.JSONDecoder(object_pairs_hook=_pairs, parse_constant=_reject_constant)


def parse_header(buffer: memoryview, where: str) -> Header:
    """Parse and validate the header of a whole file image; every rule failure is a `SafetensorsError`."""
    total = len(buffer)
    if total < 8:
        raise SafetensorsError(f"{where}: file is {total} bytes, too small for the 8-byte header length")
    (length,) = _LENGTH.unpack_from(buffer, 0)
    if length > MAX_HEADER_SIZE:
        raise SafetensorsError(f"{where}: header length {length} exceeds the limit of {MAX_HEADER_SIZE} bytes")
    if 8 + length > total:
        raise SafetensorsError(
            f"{where}: header length {length} runs past the end of the file ({total - 8} bytes after the length)"
        )
    raw = bytes(buffer[8 : 8 + length])
    if not raw.startswith(b"{"):
        raise SafetensorsError(f"{where}: header does not start with '{{'")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SafetensorsError(f"{where}: header is not valid UTF-8 (byte {exc.start})") from exc
    try:
        doc, end = _DECODER.raw_decode(text)
    except _DuplicateKey as exc:
        raise SafetensorsError(f"{where}: header has duplicate key {exc.args[0]!r}") from exc
    except json.JSONDecodeError as exc:
        raise SafetensorsError(f"{where}: header is not valid JSON: {exc.msg} at character {exc.pos}") from exc
    except (ValueError, RecursionError) as exc:
        raise SafetensorsError(f"{where}: header is not valid JSON: {exc}") from exc
    if text[end:].strip(" "):
        raise SafetensorsError(
            f"{where}: header has trailing bytes after the JSON object at character {end} (only spaces may pad it)"
        )
    metadata: dict[str, str] | None = None
    tensors: dict[str, TensorInfo] = {}
    for name, value in doc.items():
        _check_text(name, f"{where}: key {name!r}")
        if name == "__metadata__":
            metadata = _parse_metadata(value, where)
            continue
        if "\x00" in name:
            raise SafetensorsError(f"{where}: tensor name {name!r} contains a NUL character")
        tensors[name] = _parse_tensor(name, value, where)
    _check_coverage(tensors, total - 8 - length, where)
    return Header(metadata=metadata, tensors=tensors, data_start=8 + length)


def _check_text(text: str, label: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise SafetensorsError(f"{label}: string is not valid Unicode (lone surrogate)") from exc


def _parse_metadata(value: Any, where: str) -> dict[str, str]:
    if not isinstance(value, dict):
        raise SafetensorsError(f"{where}: __metadata__ must be an object of strings, got {type(value).__name__}")
    for key, item in value.items():
        if not isinstance(item, str):
            raise SafetensorsError(f"{where}: __metadata__[{key!r}] must be a string, got {type(item).__name__}")
        _check_text(key, f"{where}: __metadata__ key")
        _check_text(item, f"{where}: __metadata__[{key!r}]")
    return value


def _all_u64(values: list[Any]) -> bool:
    return all(type(value) is int and 0 <= value <= _U64_MAX for value in values)


_FIELDS = frozenset(("dtype", "shape", "data_offsets"))


def _parse_tensor(name: str, value: Any, where: str) -> TensorInfo:
    label = f"{where}: tensor {name!r}"
    if type(value) is not dict:
        raise SafetensorsError(f"{label}: entry must be an object, got {type(value).__name__}")
    if value.keys() != _FIELDS:
        missing = sorted(_FIELDS - value.keys())
        if missing:
            raise SafetensorsError(f"{label}: missing field {missing[0]!r}")
        raise SafetensorsError(f"{label}: unknown field {sorted(value.keys() - _FIELDS)[0]!r}")
    code = value["dtype"]
    info = DTYPES.get(code) if type(code) is str else None
    if info is None:
        raise SafetensorsError(f"{label}: unknown dtype {code!r}")
    shape = value["shape"]
    if type(shape) is not list or not _all_u64(shape):
        raise SafetensorsError(f"{label}: shape must be a list of unsigned integers, got {shape!r}")
    offsets = value["data_offsets"]
    if type(offsets) is not list or len(offsets) != 2 or not _all_u64(offsets):
        raise SafetensorsError(f"{label}: data_offsets must be two unsigned integers, got {offsets!r}")
    begin, end = offsets
    if end < begin:
        raise SafetensorsError(f"{label}: data_offsets end {end} is before begin {begin}")
    size = byte_size(info, tuple(shape), label)
    if not fits_numpy(shape, info.numpy.itemsize):
        raise SafetensorsError(f"{label}: shape {shape} is too large for a numpy array")
    if size != end - begin:
        raise SafetensorsError(
            f"{label}: {code} shape {shape} needs {size} bytes but data_offsets [{begin}, {end}] hold {end - begin}"
        )
    return TensorInfo(name=name, dtype=info, shape=tuple(shape), begin=begin, end=end)


def _check_coverage(tensors: dict[str, TensorInfo], buffer_size: int, where: str) -> None:
    """Tensors must tile the data buffer exactly: contiguous from 0, no holes, no overlaps, nothing after."""
    expected = 0
    for info in sorted(tensors.values(), key=lambda t: (t.begin, t.end)):
        if info.begin > expected:
            raise SafetensorsError(
                f"{where}: tensor {info.name!r} starts at offset {info.begin}, leaving a hole at [{expected}, "
                f"{info.begin}) of the data buffer"
            )
        if info.begin < expected:
            raise SafetensorsError(
                f"{where}: tensor {info.name!r} at [{info.begin}, {info.end}) overlaps the previous tensor ending at "
                f"{expected}"
            )
        expected = info.end
    if expected != buffer_size:
        raise SafetensorsError(
            f"{where}: tensors cover {expected} bytes of data but the data buffer holds {buffer_size} bytes"
        )
