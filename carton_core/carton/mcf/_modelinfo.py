"""The ModelInfo section (0x0001, version 1): fixed architecture fields, two strings and a typed key/value table.

Layout (offsets relative to the section payload, 0 meaning absent): an 8-byte header (version, flags), an 80-byte fixed
block, then length-prefixed strings each starting 8-aligned, then the 24-byte KV entries, 8-aligned. Values are encoded
in the order the reference writer uses (model name, base model, then each key in sorted order followed by its value),
so a ModelInfo we write is byte-identical to the reference's for the same fields.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field

from ..errors import MCFError
from ._types import Architecture, RopeType

__all__ = ["KVValue", "ModelInfo"]

KVValue = int | float | str | bytes

_HEADER = struct.Struct("<II")
_FIXED = struct.Struct("<IIIIIIIIIIffQQIIQ")
_KV = struct.Struct("<QIIQ")
_KV_U32, _KV_F32, _KV_STRING = 1, 2, 3
_FIXED_END = _HEADER.size + _FIXED.size
_U32_MAX = 0xFFFF_FFFF
_F32_MAX = 3.4028234663852886e38
assert _FIXED.size == 80 and _KV.size == 24


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelInfo:
    """Descriptive model metadata. ``arch`` and ``rope_type`` stay plain ints when a newer writer used a code this
    reader does not know. ``kv`` maps keys to u32 ints, f32 floats, strings, or bytes (string entries whose bytes are
    not UTF-8)."""

    arch: Architecture | int = Architecture.UNKNOWN
    vocab_size: int = 0
    hidden_size: int = 0
    layer_count: int = 0
    head_count: int = 0
    kv_head_count: int = 0
    context_length: int = 0
    train_context: int = 0
    rope_type: RopeType | int = RopeType.NONE
    rope_freq_base: float = 0.0
    rope_scale: float = 0.0
    model_name: str = ""
    base_model: str = ""
    kv: Mapping[str, KVValue] = field(default_factory=dict)

    def encode(self) -> bytes:
        """The section payload. Raises `MCFError` naming the field whose value does not fit its on-disk type."""
        ints = {
            "arch": int(self.arch),
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "layer_count": self.layer_count,
            "head_count": self.head_count,
            "kv_head_count": self.kv_head_count,
            "context_length": self.context_length,
            "train_context": self.train_context,
            "rope_type": int(self.rope_type),
        }
        for name, number in ints.items():
            _check_u32(number, f"ModelInfo.{name}")
        for name, fvalue in (("rope_freq_base", self.rope_freq_base), ("rope_scale", self.rope_scale)):
            _check_f32(fvalue, f"ModelInfo.{name}")
        blob = _Blob(bytearray(_FIXED_END))
        name_off = blob.add_bytes(_utf8(self.model_name, "ModelInfo.model_name")) if self.model_name else 0
        base_off = blob.add_bytes(_utf8(self.base_model, "ModelInfo.base_model")) if self.base_model else 0
        table = []
        for key in sorted(self.kv):
            value = self.kv[key]
            label = f"ModelInfo.kv[{key!r}]"
            if not isinstance(key, str) or not key:
                raise MCFError(f"{label}: keys must be non-empty strings")
            key_off = blob.add_bytes(_utf8(key, label))
            if isinstance(value, bool):
                raise MCFError(f"{label}: bool is not an MCF value type; store it as the int 0 or 1")
            if isinstance(value, int):
                _check_u32(value, label)
                table.append(_KV.pack(key_off, _KV_U32, 0, blob.add_scalar(struct.pack("<I", value))))
            elif isinstance(value, float):
                _check_f32(value, label)
                table.append(_KV.pack(key_off, _KV_F32, 0, blob.add_scalar(struct.pack("<f", value))))
            elif isinstance(value, str):
                value_off = blob.add_bytes(_utf8(value, label)) if value else 0
                table.append(_KV.pack(key_off, _KV_STRING, 0, value_off))
            elif isinstance(value, bytes | bytearray | memoryview):
                table.append(_KV.pack(key_off, _KV_STRING, 0, blob.add_bytes(bytes(value))))
            else:
                raise MCFError(f"{label}: unsupported value type {type(value).__name__} (int, float, str or bytes)")
        blob.pad()
        kv_off = len(blob.data)
        for entry in table:
            blob.data += entry
        out = blob.data
        _HEADER.pack_into(out, 0, 1, 0)
        _FIXED.pack_into(
            out,
            _HEADER.size,
            ints["arch"],
            0,
            self.vocab_size,
            self.hidden_size,
            self.layer_count,
            self.head_count,
            self.kv_head_count,
            self.context_length,
            self.train_context,
            ints["rope_type"],
            self.rope_freq_base,
            self.rope_scale,
            name_off,
            base_off,
            len(table),
            0,
            kv_off,
        )
        return bytes(out)

    @classmethod
    def decode(cls, payload: memoryview | bytes, where: str = "ModelInfo") -> ModelInfo:
        """Parse a section payload, checking every offset; `MCFError` names the field at fault."""
        data = memoryview(payload)
        where = f"{where}: ModelInfo"
        if len(data) < _FIXED_END:
            raise MCFError(f"{where}: section is {len(data)} bytes, shorter than its {_FIXED_END}-byte fixed part")
        version, flags = _HEADER.unpack_from(data, 0)
        if version != 1:
            raise MCFError(f"{where}: unsupported version {version}")
        if flags:
            raise MCFError(f"{where}: flags are 0x{flags:x}, must be 0")
        (
            arch,
            _pad,
            vocab,
            hidden,
            layers,
            heads,
            kv_heads,
            ctx,
            train,
            rope,
            freq_base,
            scale,
            name_off,
            base_off,
            kv_count,
            _pad2,
            kv_off,
        ) = _FIXED.unpack_from(data, _HEADER.size)
        model_name = _read_text(data, name_off, f"{where}: model name")
        base_model = _read_text(data, base_off, f"{where}: base model")
        kv: dict[str, KVValue] = {}
        if kv_count:
            if kv_off == 0:
                raise MCFError(f"{where}: kv count is {kv_count} but the kv table offset is 0")
            if kv_off + kv_count * _KV.size > len(data):
                raise MCFError(
                    f"{where}: kv table ({kv_count} entries at offset {kv_off}) runs past the {len(data)}-byte section"
                )
        for i in range(kv_count):
            key_off, vtype, _pad3, value_off = _KV.unpack_from(data, kv_off + i * _KV.size)
            key = _read_text(data, key_off, f"{where}: kv[{i}] key")
            if not key:
                raise MCFError(f"{where}: kv[{i}] has an empty key")
            label = f"{where}: kv[{key!r}]"
            if key in kv:
                raise MCFError(f"{label}: duplicate key")
            if vtype in (_KV_U32, _KV_F32):
                if value_off + 4 > len(data):
                    raise MCFError(f"{label}: value offset {value_off} runs past the {len(data)}-byte section")
                kv[key] = struct.unpack_from("<I" if vtype == _KV_U32 else "<f", data, value_off)[0]
            elif vtype == _KV_STRING:
                raw = _read_blob(data, value_off, label)
                try:
                    kv[key] = raw.decode("utf-8")
                except UnicodeDecodeError:
                    kv[key] = raw
            else:
                raise MCFError(f"{label}: unknown value type {vtype} (1 u32, 2 f32, 3 string)")
        return cls(
            arch=_enum_or_int(Architecture, arch),
            vocab_size=vocab,
            hidden_size=hidden,
            layer_count=layers,
            head_count=heads,
            kv_head_count=kv_heads,
            context_length=ctx,
            train_context=train,
            rope_type=_enum_or_int(RopeType, rope),
            rope_freq_base=freq_base,
            rope_scale=scale,
            model_name=model_name,
            base_model=base_model,
            kv=kv,
        )


class _Blob:
    """Appends length-prefixed strings and 4-byte scalars, each starting on an 8-byte boundary."""

    def __init__(self, data: bytearray) -> None:
        self.data = data

    def pad(self) -> None:
        self.data += bytes(-len(self.data) % 8)

    def add_bytes(self, raw: bytes) -> int:
        if len(raw) > _U32_MAX:
            raise MCFError(f"ModelInfo string of {len(raw)} bytes does not fit a u32 length")
        self.pad()
        offset = len(self.data)
        self.data += struct.pack("<I", len(raw)) + raw
        self.pad()
        return offset

    def add_scalar(self, raw: bytes) -> int:
        self.pad()
        offset = len(self.data)
        self.data += raw
        self.pad()
        return offset


def _enum_or_int(enum_type: type[Architecture] | type[RopeType], value: int) -> int:
    try:
        return enum_type(value)
    except ValueError:
        return value


def _utf8(text: str, label: str) -> bytes:
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise MCFError(f"{label}: {text!r} cannot be encoded as UTF-8") from exc


def _check_u32(value: int, label: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= _U32_MAX:
        raise MCFError(f"{label}: {value!r} is not an unsigned 32-bit integer")


def _check_f32(value: float, label: str) -> None:
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise MCFError(f"{label}: {value!r} is not a float")
    if not math.isfinite(value) or abs(value) > _F32_MAX:
        raise MCFError(f"{label}: {value!r} is not a finite 32-bit float")


def _read_blob(data: memoryview, offset: int, label: str) -> bytes:
    if offset == 0:
        return b""
    if offset + 4 > len(data):
        raise MCFError(f"{label}: string offset {offset} runs past the {len(data)}-byte section")
    (length,) = struct.unpack_from("<I", data, offset)
    if offset + 4 + length > len(data):
        raise MCFError(f"{label}: string of {length} bytes at offset {offset} runs past the {len(data)}-byte section")
    return bytes(data[offset + 4 : offset + 4 + length])


def _read_text(data: memoryview, offset: int, label: str) -> str:
    raw = _read_blob(data, offset, label)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise MCFError(f"{label}: {raw[:40]!r} is not valid UTF-8") from exc
