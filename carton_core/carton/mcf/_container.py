"""Byte layouts of the MCF container (mcf-container-layout.md): the fixed header, the section directory, QuantInfo,
TensorIndex, and the payload-size rules that tie a quantized tensor's shape to its byte length.

Every ``decode_*`` function validates what it reads and raises `MCFError` with a message that starts with ``where``
(usually the file name) and names the field, entry or offset at fault.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from ..errors import MCFError
from ._types import MCFDType, QuantDomain, QuantMethod, SectionType

__all__ = [
    "BLOCK_SIZE",
    "FLAG_TENSOR_DATA_ALIGNED64",
    "HEADER_SIZE",
    "MAGIC",
    "MAJOR_VERSION",
    "MINOR_VERSION",
    "NUMPY_DTYPES",
    "RESOURCE_FILES",
    "SECTION_ENTRY_SIZE",
    "SUPER_SIZE",
    "TENSOR_INDEX_FLAG_SORTED",
    "TENSOR_INDEX_FLAG_UTF8",
    "MCFHeader",
    "QuantRecord",
    "RawTensorEntry",
    "SectionEntry",
    "TensorEntry",
    "align",
    "decode_directory",
    "decode_header",
    "decode_quant_info",
    "decode_tensor_index",
    "encode_directory",
    "encode_header",
    "encode_quant_info",
    "encode_tensor_index",
    "plain_data_size",
    "quant_method_of",
]

MAGIC = b"MCF\x00"
MAJOR_VERSION = 1
MINOR_VERSION = 1
HEADER_SIZE = 40
SECTION_ENTRY_SIZE = 24
FLAG_TENSOR_DATA_ALIGNED64 = 1
TENSOR_INDEX_FLAG_SORTED = 1
TENSOR_INDEX_FLAG_UTF8 = 2
BLOCK_SIZE = 32
SUPER_SIZE = 256

_HEADER = struct.Struct("<4sHHIIQQQ")
_SECTION = struct.Struct("<IIQQ")
_QI_HEADER = struct.Struct("<II")
_QREC = struct.Struct("<IBBHH6sff")
_TI_HEADER = struct.Struct("<IIIIQQQQ")
_TI_ENTRY = struct.Struct("<IIIIIIQQ")
assert _HEADER.size == HEADER_SIZE and _SECTION.size == SECTION_ENTRY_SIZE
assert _QREC.size == 24 and _TI_HEADER.size == 48 and _TI_ENTRY.size == 40

#: Raw Hugging Face files carried verbatim, by section type.
RESOURCE_FILES: dict[SectionType, str] = {
    SectionType.HF_CONFIG: "config.json",
    SectionType.HF_GENERATION_CONFIG: "generation_config.json",
    SectionType.HF_TOKENIZER: "tokenizer.json",
    SectionType.HF_TOKENIZER_CONFIG: "tokenizer_config.json",
    SectionType.HF_VOCAB: "vocab.json",
    SectionType.HF_MERGES: "merges.txt",
}

#: numpy dtypes of the plain (not quantized) MCF dtypes, all little-endian.
NUMPY_DTYPES: dict[MCFDType, np.dtype[np.generic]] = {
    MCFDType.F32: np.dtype("<f4"),
    MCFDType.F16: np.dtype("<f2"),
    MCFDType.BF16: np.dtype(ml_dtypes.bfloat16),
    MCFDType.F64: np.dtype("<f8"),
    MCFDType.I8: np.dtype("i1"),
    MCFDType.U8: np.dtype("u1"),
    MCFDType.I16: np.dtype("<i2"),
    MCFDType.U16: np.dtype("<u2"),
    MCFDType.I32: np.dtype("<i4"),
    MCFDType.U32: np.dtype("<u4"),
    MCFDType.I64: np.dtype("<i8"),
    MCFDType.U64: np.dtype("<u8"),
}

_QUANT_DTYPES = {method.dtype: method for method in QuantMethod}


def align(value: int, alignment: int) -> int:
    """Round ``value`` up to a multiple of ``alignment``."""
    return (value + alignment - 1) // alignment * alignment


def quant_method_of(dtype: MCFDType) -> QuantMethod | None:
    """The quantization method a TensorIndex dtype stands for, or None for plain dtypes."""
    return _QUANT_DTYPES.get(dtype)


# --- header and directory -------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True, kw_only=True)
class MCFHeader:
    """The 40-byte fixed header."""

    major: int
    minor: int
    header_size: int
    section_count: int
    section_dir_offset: int
    file_size: int
    flags: int

    @property
    def tensor_data_aligned64(self) -> bool:
        return bool(self.flags & FLAG_TENSOR_DATA_ALIGNED64)


@dataclass(frozen=True, slots=True, kw_only=True)
class SectionEntry:
    """One 24-byte section directory entry. ``type`` stays an int: unknown types are legal and skipped."""

    type: int
    version: int
    offset: int
    size: int

    @property
    def known_type(self) -> SectionType | None:
        try:
            return SectionType(self.type)
        except ValueError:
            return None


def encode_header(header: MCFHeader) -> bytes:
    return _HEADER.pack(
        MAGIC,
        header.major,
        header.minor,
        header.header_size,
        header.section_count,
        header.section_dir_offset,
        header.file_size,
        header.flags,
    )


def decode_header(data: memoryview, file_size: int, where: str) -> MCFHeader:
    if file_size < HEADER_SIZE:
        raise MCFError(f"{where}: file is {file_size} bytes, shorter than the {HEADER_SIZE}-byte MCF header")
    magic, major, minor, header_size, count, dir_offset, declared_size, flags = _HEADER.unpack_from(data, 0)
    if magic != MAGIC:
        raise MCFError(f"{where}: bad magic {bytes(magic).hex()} at offset 0 (expected 4d434600, 'MCF\\0')")
    if major != MAJOR_VERSION:
        raise MCFError(f"{where}: unsupported major version {major} (this reader supports {MAJOR_VERSION})")
    if header_size < HEADER_SIZE:
        raise MCFError(f"{where}: header size {header_size} is less than {HEADER_SIZE}")
    if header_size > file_size:
        raise MCFError(f"{where}: header size {header_size} is past the end of the {file_size}-byte file")
    if declared_size != file_size:
        raise MCFError(f"{where}: header file size {declared_size} does not match the real file length {file_size}")
    if count == 0:
        raise MCFError(f"{where}: section count is 0")
    if dir_offset < header_size:
        raise MCFError(f"{where}: section directory offset {dir_offset} lies inside the {header_size}-byte header")
    if dir_offset + count * SECTION_ENTRY_SIZE > file_size:
        raise MCFError(
            f"{where}: section directory ({count} entries at offset {dir_offset}) runs past the end of the "
            f"{file_size}-byte file"
        )
    return MCFHeader(
        major=major,
        minor=minor,
        header_size=header_size,
        section_count=count,
        section_dir_offset=dir_offset,
        file_size=file_size,
        flags=flags,
    )


def encode_directory(sections: list[SectionEntry]) -> bytes:
    return b"".join(_SECTION.pack(s.type, s.version, s.offset, s.size) for s in sections)


def decode_directory(data: memoryview, header: MCFHeader, where: str) -> tuple[SectionEntry, ...]:
    dir_start = header.section_dir_offset
    dir_end = dir_start + header.section_count * SECTION_ENTRY_SIZE
    sections = []
    for i in range(header.section_count):
        stype, version, offset, size = _SECTION.unpack_from(data, dir_start + i * SECTION_ENTRY_SIZE)
        name = _section_name(stype)
        end = offset + size
        if end > header.file_size:
            raise MCFError(
                f"{where}: section {i} ({name}) at offset {offset} with size {size} runs past the end of the "
                f"{header.file_size}-byte file"
            )
        if offset < header.header_size:
            raise MCFError(f"{where}: section {i} ({name}) at offset {offset} overlaps the header")
        if offset % 8:
            raise MCFError(f"{where}: section {i} ({name}) offset {offset} is not 8-byte aligned")
        if offset < dir_end and dir_start < end:
            raise MCFError(f"{where}: section {i} ({name}) at offset {offset} overlaps the section directory")
        sections.append(SectionEntry(type=stype, version=version, offset=offset, size=size))
    return tuple(sections)


def _section_name(stype: int) -> str:
    try:
        return SectionType(stype).name
    except ValueError:
        return f"type 0x{stype:04x}"


# --- QuantInfo ------------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True, kw_only=True)
class QuantRecord:
    """One QuantInfo record: how the tensor at ``tensor_index`` of the TensorIndex is quantized."""

    tensor_index: int
    method: QuantMethod
    domain: QuantDomain = QuantDomain.WEIGHTS
    block_size: int
    super_size: int
    min_clip: float = 0.0
    max_clip: float = 0.0

    @classmethod
    def for_method(
        cls,
        method: QuantMethod,
        *,
        tensor_index: int,
        domain: QuantDomain = QuantDomain.WEIGHTS,
        min_clip: float = 0.0,
        max_clip: float = 0.0,
    ) -> QuantRecord:
        """A record with the block and super-block sizes the spec fixes for ``method``."""
        block, super_ = {"int": (0, 0), "q": (BLOCK_SIZE, 0), "k": (BLOCK_SIZE, SUPER_SIZE)}[method.family]
        return cls(
            tensor_index=tensor_index,
            method=method,
            domain=domain,
            block_size=block,
            super_size=super_,
            min_clip=min_clip,
            max_clip=max_clip,
        )


def _check_record_geometry(method: QuantMethod, domain: int, block: int, super_: int) -> str | None:
    """Why this (method, domain, block, super) combination is invalid, or None when it is valid."""
    if domain not in (QuantDomain.WEIGHTS, QuantDomain.ACTIVATIONS):
        return f"domain {domain} is neither 0 (weights) nor 1 (activations)"
    if method.family != "int" and domain != QuantDomain.WEIGHTS:
        return f"{method.value} allows only the weights domain (0), got {domain}"
    want = {"int": (0, 0), "q": (BLOCK_SIZE, 0), "k": (BLOCK_SIZE, SUPER_SIZE)}[method.family]
    if (block, super_) != want:
        return f"{method.value} needs block size {want[0]} and super size {want[1]}, got {block} and {super_}"
    return None


def encode_quant_info(records: list[QuantRecord]) -> bytes:
    out = [_QI_HEADER.pack(1, len(records))]
    for r in records:
        problem = _check_record_geometry(r.method, r.domain, r.block_size, r.super_size)
        if problem:
            raise MCFError(f"QuantInfo record for tensor {r.tensor_index}: {problem}")
        out.append(
            _QREC.pack(
                r.tensor_index,
                r.method.dtype & 0xFF,
                r.domain,
                r.block_size,
                r.super_size,
                bytes(6),
                r.min_clip,
                r.max_clip,
            )
        )
    return b"".join(out)


def decode_quant_info(payload: memoryview, where: str) -> list[QuantRecord]:
    where = f"{where}: QuantInfo"
    if len(payload) < _QI_HEADER.size:
        raise MCFError(f"{where}: section is {len(payload)} bytes, shorter than its 8-byte header")
    version, count = _QI_HEADER.unpack_from(payload, 0)
    if version != 1:
        raise MCFError(f"{where}: unsupported version {version}")
    if _QI_HEADER.size + count * _QREC.size > len(payload):
        raise MCFError(f"{where}: {count} records of 24 bytes do not fit in the {len(payload)}-byte section")
    records = []
    for i in range(count):
        index, method_byte, domain, block, super_, reserved, lo, hi = _QREC.unpack_from(payload, 8 + i * 24)
        if reserved != bytes(6):
            raise MCFError(f"{where}: record {i} has non-zero reserved bytes {reserved.hex()}")
        method = quant_method_of(_dtype_or_unknown(method_byte))
        if method is None:
            raise MCFError(f"{where}: record {i} has unknown method 0x{method_byte:02x}")
        problem = _check_record_geometry(method, domain, block, super_)
        if problem:
            raise MCFError(f"{where}: record {i}: {problem}")
        records.append(
            QuantRecord(
                tensor_index=index,
                method=method,
                domain=QuantDomain(domain),
                block_size=block,
                super_size=super_,
                min_clip=lo,
                max_clip=hi,
            )
        )
    return records


def _dtype_or_unknown(code: int) -> MCFDType:
    try:
        return MCFDType(code)
    except ValueError:
        return MCFDType.UNKNOWN


# --- TensorIndex ----------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True, kw_only=True)
class TensorEntry:
    """One tensor of the TensorIndex. ``data_offset`` is absolute; ``quant`` is its QuantInfo record, if any."""

    name: str
    index: int
    dtype: MCFDType
    shape: tuple[int, ...]
    data_offset: int
    data_size: int
    quant: QuantRecord | None = None

    @property
    def method(self) -> QuantMethod | None:
        """The quantization method, or None for a plain float/int tensor."""
        return quant_method_of(self.dtype)

    @property
    def domain(self) -> QuantDomain:
        return self.quant.domain if self.quant is not None else QuantDomain.WEIGHTS


def encode_tensor_index(entries: list[TensorEntry]) -> bytes:
    """Entries must already be sorted by name bytes (the writer sorts them); the sorted and UTF-8 flags are set."""
    if not entries:
        raise MCFError("TensorIndex needs at least one tensor")
    names = [e.name.encode("utf-8") for e in entries]
    dims = [d for e in entries for d in e.shape]
    entries_off = _TI_HEADER.size
    dims_off = entries_off + len(entries) * _TI_ENTRY.size
    strings_off = dims_off + len(dims) * 8
    strings_size = sum(len(n) for n in names)
    out = bytearray(
        _TI_HEADER.pack(
            1,
            TENSOR_INDEX_FLAG_SORTED | TENSOR_INDEX_FLAG_UTF8,
            len(entries),
            len(dims),
            entries_off,
            dims_off,
            strings_off,
            strings_size,
        )
    )
    name_off = dim_index = 0
    for e, raw in zip(entries, names, strict=True):
        out += _TI_ENTRY.pack(name_off, len(raw), e.dtype, len(e.shape), dim_index, 0, e.data_offset, e.data_size)
        name_off += len(raw)
        dim_index += len(e.shape)
    out += struct.pack(f"<{len(dims)}Q", *dims)
    out += b"".join(names)
    return bytes(out)


@dataclass(frozen=True, slots=True, kw_only=True)
class RawTensorEntry:
    name: str
    dtype: MCFDType
    shape: tuple[int, ...]
    data_offset: int
    data_size: int


def decode_tensor_index(payload: memoryview, where: str) -> list[RawTensorEntry]:
    """Parse and check the TensorIndex's own structure; data ranges are checked by the reader against the file."""
    where = f"{where}: TensorIndex"
    size = len(payload)
    if size < _TI_HEADER.size:
        raise MCFError(f"{where}: section is {size} bytes, shorter than its 48-byte header")
    version, flags, count, dims_count, entries_off, dims_off, strings_off, strings_size = _TI_HEADER.unpack_from(
        payload, 0
    )
    if version != 1:
        raise MCFError(f"{where}: unsupported version {version}")
    if count == 0:
        raise MCFError(f"{where}: tensor count is 0")
    for label, off, length in (
        ("entries", entries_off, count * _TI_ENTRY.size),
        ("dims table", dims_off, dims_count * 8),
        ("names blob", strings_off, strings_size),
    ):
        if off + length > size:
            raise MCFError(f"{where}: {label} at offset {off} with size {length} runs past the {size}-byte section")
    dims = struct.unpack_from(f"<{dims_count}Q", payload, dims_off)
    strings = payload[strings_off : strings_off + strings_size]
    seen: set[bytes] = set()
    previous: bytes | None = None
    entries = []
    for i in range(count):
        name_off, name_len, dtype_code, rank, dim_index, reserved, data_off, data_size = _TI_ENTRY.unpack_from(
            payload, entries_off + i * _TI_ENTRY.size
        )
        if name_off + name_len > strings_size:
            raise MCFError(
                f"{where}: entry {i} name (offset {name_off}, length {name_len}) runs past the "
                f"{strings_size}-byte names blob"
            )
        raw = bytes(strings[name_off : name_off + name_len])
        name = _decode_name(raw, f"{where}: entry {i}")
        label = f"{where}: tensor {name!r}"
        if raw in seen:
            raise MCFError(f"{label}: duplicate name")
        seen.add(raw)
        if flags & TENSOR_INDEX_FLAG_SORTED and previous is not None and raw <= previous:
            raise MCFError(f"{label}: entry {i} breaks the sorted-by-name order the index flags declare")
        previous = raw
        if dtype_code > 0xFFFF:
            raise MCFError(f"{label}: dtype 0x{dtype_code:x} is larger than 0xFFFF")
        try:
            dtype = MCFDType(dtype_code)
        except ValueError:
            raise MCFError(f"{label}: unknown dtype 0x{dtype_code:04x}") from None
        if reserved:
            raise MCFError(f"{label}: reserved field is {reserved}, must be 0")
        if dim_index + rank > dims_count:
            raise MCFError(
                f"{label}: rank {rank} at dims index {dim_index} runs past the {dims_count}-entry dims table"
            )
        entries.append(
            RawTensorEntry(
                name=name,
                dtype=dtype,
                shape=tuple(dims[dim_index : dim_index + rank]),
                data_offset=data_off,
                data_size=data_size,
            )
        )
    return entries


def _decode_name(raw: bytes, label: str) -> str:
    if not raw:
        raise MCFError(f"{label}: empty tensor name")
    if b"\x00" in raw:
        raise MCFError(f"{label}: tensor name {raw!r} contains a NUL byte")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise MCFError(f"{label}: tensor name {raw!r} is not valid UTF-8") from exc


def plain_data_size(dtype: MCFDType, shape: tuple[int, ...]) -> int:
    count = 1
    for d in shape:
        count *= d
    return count * NUMPY_DTYPES[dtype].itemsize
