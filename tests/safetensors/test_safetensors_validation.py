"""Every validation rule of the safetensors reader, each with a crafted file and its exact error message."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import carton.safetensors as st
import pytest
from carton import SafetensorsError


def craft(header: object, data: bytes = b"", *, length: int | None = None, pad: bool = True) -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header, separators=(",", ":")).encode()
    if pad:
        raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw) if length is None else length) + raw + data


def entry(dtype: str = "F32", shape: list[int] | None = None, offsets: list[int] | None = None) -> dict[str, object]:
    return {"dtype": dtype, "shape": [2] if shape is None else shape, "data_offsets": offsets or [0, 8]}


CASES: list[tuple[str, bytes, str]] = [
    ("short", b"\x01\x00\x00", "file is 3 bytes, too small for the 8-byte header length"),
    (
        "huge-header",
        struct.pack("<Q", 100_000_001) + b"{}",
        "header length 100000001 exceeds the limit of 100000000 bytes",
    ),
    (
        "header-past-end",
        craft({}, length=64),
        "header length 64 runs past the end of the file (8 bytes after the length)",
    ),
    ("no-brace", craft(b' {"a":1}'), "header does not start with '{'"),
    ("empty-header", craft(b"", pad=False), "header does not start with '{'"),
    ("not-utf8", craft(b'{"\xff":1}'), "header is not valid UTF-8 (byte 2)"),
    ("bad-json", craft(b'{"a":}'), "header is not valid JSON: Expecting value at character 5"),
    ("nan", craft(b'{"a":NaN}'), "header is not valid JSON: NaN is not valid JSON"),
    (
        "trailing",
        craft(b"{}\n"),
        "header has trailing bytes after the JSON object at character 2 (only spaces may pad it)",
    ),
    ("trailing-junk", craft(b"{}x"), "header has trailing bytes after the JSON object at character 2"),
    ("dup-tensor", craft(b'{"a":{},"a":{}}'), "header has duplicate key 'a'"),
    ("dup-field", craft(b'{"a":{"dtype":"F32","dtype":"F32"}}'), "header has duplicate key 'dtype'"),
    ("metadata-type", craft({"__metadata__": ["x"]}), "__metadata__ must be an object of strings, got list"),
    ("metadata-value", craft({"__metadata__": {"k": 1}}), "__metadata__['k'] must be a string, got int"),
    ("surrogate", craft(b'{"\\ud800":{}}'), "key '\\ud800': string is not valid Unicode (lone surrogate)"),
    ("nul-name", craft({"a\u0000b": entry()}, bytes(8)), "tensor name 'a\\x00b' contains a NUL character"),
    ("entry-type", craft({"a": [1]}), "tensor 'a': entry must be an object, got list"),
    ("missing-field", craft({"a": {"dtype": "F32", "shape": [2]}}), "tensor 'a': missing field 'data_offsets'"),
    ("extra-field", craft({"a": {**entry(), "x": 1}}, bytes(8)), "tensor 'a': unknown field 'x'"),
    ("bad-dtype", craft({"a": entry("F128")}, bytes(8)), "tensor 'a': unknown dtype 'F128'"),
    ("dtype-type", craft({"a": entry(7)}, bytes(8)), "tensor 'a': unknown dtype 7"),  # type: ignore[arg-type]
    (
        "neg-dim",
        craft({"a": entry(shape=[-2])}, bytes(8)),
        "tensor 'a': shape must be a list of unsigned integers, got [-2]",
    ),
    (
        "float-dim",
        craft({"a": entry(shape=[2.0])}, bytes(8)),
        "tensor 'a': shape must be a list of unsigned integers, got [2.0]",
    ),  # type: ignore[list-item]
    (
        "bool-dim",
        craft({"a": entry(shape=[True])}, bytes(8)),
        "tensor 'a': shape must be a list of unsigned integers, got [True]",
    ),
    (
        "huge-dim",
        craft({"a": entry(shape=[2**64])}, bytes(8)),
        "tensor 'a': shape must be a list of unsigned integers, got [18446744073709551616]",
    ),
    (
        "offsets-len",
        craft({"a": entry(offsets=[0, 8, 9])}, bytes(8)),
        "tensor 'a': data_offsets must be two unsigned integers, got [0, 8, 9]",
    ),
    (
        "offsets-neg",
        craft({"a": entry(offsets=[-8, 0])}, bytes(8)),
        "tensor 'a': data_offsets must be two unsigned integers, got [-8, 0]",
    ),
    (
        "offsets-reversed",
        craft({"a": entry(offsets=[8, 0])}, bytes(8)),
        "tensor 'a': data_offsets end 0 is before begin 8",
    ),
    (
        "count-overflow",
        craft({"a": entry(shape=[2**32, 2**32])}, bytes(8)),
        "tensor 'a': shape [4294967296, 4294967296] overflows a 64-bit element count",
    ),
    (
        "bits-overflow",
        craft({"a": entry(shape=[2**62])}, bytes(8)),
        "tensor 'a': shape [4611686018427387904] of F32 overflows a 64-bit bit count",
    ),
    (
        "numpy-limit",
        craft({"a": entry(shape=[0, 2**63], offsets=[0, 0])}),
        "tensor 'a': shape [0, 9223372036854775808] is too large for a numpy array",
    ),
    (
        "size-mismatch",
        craft({"a": entry(shape=[3])}, bytes(8)),
        "tensor 'a': F32 shape [3] needs 12 bytes but data_offsets [0, 8] hold 8",
    ),
    (
        "partial-byte",
        craft({"a": entry("F4", [3], [0, 1])}, bytes(1)),
        "tensor 'a': 3 elements of 4-bit F4 do not fill a whole number of bytes",
    ),
    (
        "hole-at-start",
        craft({"a": entry(offsets=[8, 16])}, bytes(16)),
        "tensor 'a' starts at offset 8, leaving a hole at [0, 8) of the data buffer",
    ),
    (
        "hole-between",
        craft({"a": entry(), "b": entry(offsets=[12, 20])}, bytes(20)),
        "tensor 'b' starts at offset 12, leaving a hole at [8, 12) of the data buffer",
    ),
    (
        "overlap",
        craft({"a": entry(), "b": entry(offsets=[4, 12])}, bytes(12)),
        "tensor 'b' at [4, 12) overlaps the previous tensor ending at 8",
    ),
    (
        "same-range",
        craft({"a": entry(), "b": entry()}, bytes(8)),
        "tensor 'b' at [0, 8) overlaps the previous tensor ending at 8",
    ),
    (
        "trailing-data",
        craft({"a": entry()}, bytes(9)),
        "tensors cover 8 bytes of data but the data buffer holds 9 bytes",
    ),
    (
        "truncated-data",
        craft({"a": entry()}, bytes(7)),
        "tensors cover 8 bytes of data but the data buffer holds 7 bytes",
    ),
    (
        "empty-tensor-past-end",
        craft({"a": entry(shape=[0], offsets=[4, 4])}, b""),
        "tensor 'a' starts at offset 4, leaving a hole at [0, 4) of the data buffer",
    ),
    (
        "deep-nesting",
        craft(b'{"a":' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
        "header is not valid JSON: maximum recursion depth exceeded",
    ),
]


@pytest.mark.parametrize(("data", "message"), [(c[1], c[2]) for c in CASES], ids=[c[0] for c in CASES])
def test_rule(data: bytes, message: str) -> None:
    with pytest.raises(SafetensorsError) as info:
        st.load(data)
    assert str(info.value).startswith(f"<bytes>: {message}"), str(info.value)


def test_error_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.safetensors"
    path.write_bytes(craft({"a": entry()}, bytes(9)))
    with pytest.raises(SafetensorsError) as info:
        st.load_file(path)
    assert str(info.value) == f"{path}: tensors cover 8 bytes of data but the data buffer holds 9 bytes"


def test_empty_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "empty.safetensors"
    path.write_bytes(b"")
    with pytest.raises(SafetensorsError, match=r"empty.safetensors: file is 0 bytes, too small"):
        st.safe_open(path)


def test_valid_edge_cases_are_accepted() -> None:
    # zero-size tensors anywhere in the chain, a scalar, unpadded header, header padded with many spaces
    header = {
        "z": entry(shape=[0, 5], offsets=[0, 0]),
        "s": entry(shape=[], offsets=[0, 4]),
        "e": entry(shape=[0], offsets=[4, 4]),
    }
    out = st.load(craft(header, bytes(4)))
    assert out["z"].shape == (0, 5) and out["s"].shape == () and out["e"].shape == (0,)
    assert st.load(craft(b"{}", pad=False)) == {}
    assert st.load(craft(b"{}" + b" " * 30, pad=False)) == {}


def test_reference_rejects_what_we_call_stricter() -> None:
    """Where the reference is laxer (unknown fields, non-space padding) we still refuse; document it by test."""
    import safetensors

    lax = craft({"a": {**entry(), "x": 1}}, bytes(8))
    assert dict(safetensors.deserialize(lax))  # the reference accepts an unknown field
    with pytest.raises(SafetensorsError, match="unknown field 'x'"):
        st.load(lax)
