"""Every validation rule of the MCF reader: a valid file with one field broken, and the exact error it gives."""

from __future__ import annotations

import struct
from collections.abc import Callable
from pathlib import Path

import carton.mcf as mcf
import numpy as np
import pytest
from carton import MCFError
from carton.mcf import ModelInfo, SectionType

MI, QI, TI, TD = SectionType.MODEL_INFO, SectionType.QUANT_INFO, SectionType.TENSOR_INDEX, SectionType.TENSOR_DATA


def _valid() -> bytes:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = mcf.write_mcf(
            Path(tmp) / "v.mcf",
            tensors={
                "a": np.arange(6, dtype=np.float32).reshape(2, 3),
                "q": ("q4", bytes(mcf.payload_size("q4", 2, 64)), (2, 64), -1.0, 1.0),
            },
            model_info=ModelInfo(model_name="tiny", kv={"k": 5}),
            resources={"config.json": b"{}"},
        )
        return path.read_bytes()


VALID = _valid()


def directory(data: bytes | bytearray) -> dict[int, tuple[int, int, int]]:
    """section type -> (directory entry position, payload offset, payload size)"""
    count, dir_off = struct.unpack_from("<IQ", data, 12)
    out: dict[int, tuple[int, int, int]] = {}
    for i in range(count):
        stype, _version, offset, size = struct.unpack_from("<IIQQ", data, dir_off + 24 * i)
        out.setdefault(stype, (dir_off + 24 * i, offset, size))
    return out


def at(section: int, rel: int) -> int:
    return directory(VALID)[section][1] + rel


def entry_pos(i: int, field: int = 0) -> int:
    """Absolute position of TensorIndex entry ``i`` (0 = "a", 1 = "q") plus ``field`` bytes."""
    return at(TI, 48 + 40 * i + field)


def put(fmt: str, pos: int, *values: object) -> Callable[[bytearray], None]:
    def patch(data: bytearray) -> None:
        struct.pack_into(fmt, data, pos, *values)

    return patch


def set_section(
    stype: int, *, offset: int | None = None, size: int | None = None, version: int | None = None
) -> Callable[[bytearray], None]:
    def patch(data: bytearray) -> None:
        pos, old_offset, old_size = directory(data)[stype]
        struct.pack_into(
            "<IQQ",
            data,
            pos + 4,
            1 if version is None else version,
            old_offset if offset is None else offset,
            old_size if size is None else size,
        )

    return patch


def both(*patches: Callable[[bytearray], None]) -> Callable[[bytearray], None]:
    def patch(data: bytearray) -> None:
        for p in patches:
            p(data)

    return patch


def truncate(n: int) -> Callable[[bytearray], None]:
    def patch(data: bytearray) -> None:
        del data[n:]

    return patch


def dir_offset(value: int) -> Callable[[bytearray], None]:
    return put("<Q", 16, value)


A_NAME = "<bytes>: tensor 'a'"
Q_NAME = "<bytes>: tensor 'q'"
TI_MSG = "<bytes>: TensorIndex"
QI_MSG = "<bytes>: QuantInfo"
MI_MSG = "<bytes>: ModelInfo"
FILE = len(VALID)
D = directory(VALID)
DIR = struct.unpack_from("<Q", VALID, 16)[0]

CASES: list[tuple[str, Callable[[bytearray], None], str]] = [
    # header
    ("short", truncate(10), "<bytes>: file is 10 bytes, shorter than the 40-byte MCF header"),
    ("magic", put("4s", 0, b"GGUF"), "<bytes>: bad magic 47475546 at offset 0 (expected 4d434600, 'MCF\\0')"),
    ("major", put("<H", 4, 2), "<bytes>: unsupported major version 2 (this reader supports 1)"),
    ("header-size-small", put("<I", 8, 39), "<bytes>: header size 39 is less than 40"),
    (
        "header-size-big",
        put("<I", 8, FILE + 1),
        f"<bytes>: header size {FILE + 1} is past the end of the {FILE}-byte file",
    ),
    (
        "file-size",
        put("<Q", 24, FILE + 8),
        f"<bytes>: header file size {FILE + 8} does not match the real file length {FILE}",
    ),
    (
        "truncated",
        truncate(FILE - 1),
        f"<bytes>: header file size {FILE} does not match the real file length {FILE - 1}",
    ),
    ("no-sections", put("<I", 12, 0), "<bytes>: section count is 0"),
    ("dir-in-header", dir_offset(32), "<bytes>: section directory offset 32 lies inside the 40-byte header"),
    (
        "dir-past-end",
        dir_offset(FILE - 8),
        f"<bytes>: section directory (5 entries at offset {FILE - 8}) runs past the end of the {FILE}-byte file",
    ),
    (
        "many-sections",
        put("<I", 12, 1000),
        f"<bytes>: section directory (1000 entries at offset {DIR}) runs past the end",
    ),
    # directory
    (
        "section-past-end",
        set_section(MI, size=FILE),
        f"<bytes>: section 0 (MODEL_INFO) at offset {D[MI][1]} with size {FILE} runs past the end of the {FILE}-byte "
        "file",
    ),
    (
        "section-in-header",
        set_section(MI, offset=32, size=8),
        "<bytes>: section 0 (MODEL_INFO) at offset 32 overlaps the header",
    ),
    (
        "section-unaligned",
        set_section(MI, offset=D[MI][1] + 4),
        f"<bytes>: section 0 (MODEL_INFO) offset {D[MI][1] + 4} is not 8-byte aligned",
    ),
    (
        "section-over-dir",
        set_section(SectionType.HF_CONFIG, offset=FILE - 24, size=8),
        f"<bytes>: section 4 (HF_CONFIG) at offset {FILE - 24} overlaps the section directory",
    ),
    ("section-version", set_section(TI, version=2), "<bytes>: TENSOR_INDEX section has unsupported version 2"),
    # ModelInfo
    ("mi-short", set_section(MI, size=80), f"{MI_MSG}: section is 80 bytes, shorter than its 88-byte fixed part"),
    ("mi-version", put("<I", at(MI, 0), 2), f"{MI_MSG}: unsupported version 2"),
    ("mi-flags", put("<I", at(MI, 4), 1), f"{MI_MSG}: flags are 0x1, must be 0"),
    ("mi-name-offset", put("<Q", at(MI, 8 + 48), 10_000), f"{MI_MSG}: model name: string offset 10000 runs past the"),
    (
        "mi-name-length",
        put("<I", at(MI, 88), 10_000),
        f"{MI_MSG}: model name: string of 10000 bytes at offset 88 runs past the",
    ),
    (
        "mi-name-utf8",
        put("4s", at(MI, 92), b"\xff\xfe\xfd\xfc"),
        f"{MI_MSG}: model name: b'\\xff\\xfe\\xfd\\xfc' is not valid UTF-8",
    ),
    ("mi-kv-off-zero", put("<Q", at(MI, 8 + 72), 0), f"{MI_MSG}: kv count is 1 but the kv table offset is 0"),
    ("mi-kv-past-end", put("<I", at(MI, 8 + 64), 100), f"{MI_MSG}: kv table (100 entries at offset"),
    ("mi-kv-empty-key", put("<Q", at(MI, 112), 0), f"{MI_MSG}: kv[0] has an empty key"),
    ("mi-kv-type", put("<I", at(MI, 120), 9), f"{MI_MSG}: kv['k']: unknown value type 9 (1 u32, 2 f32, 3 string)"),
    ("mi-kv-value-off", put("<Q", at(MI, 128), 10_000), f"{MI_MSG}: kv['k']: value offset 10000 runs past the"),
    # TensorIndex
    ("ti-short", set_section(TI, size=40), f"{TI_MSG}: section is 40 bytes, shorter than its 48-byte header"),
    ("ti-version", put("<I", at(TI, 0), 3), f"{TI_MSG}: unsupported version 3"),
    ("ti-count-zero", put("<I", at(TI, 8), 0), f"{TI_MSG}: tensor count is 0"),
    ("ti-entries", put("<I", at(TI, 8), 50), f"{TI_MSG}: entries at offset 48 with size 2000 runs past the"),
    ("ti-dims", put("<I", at(TI, 12), 500), f"{TI_MSG}: dims table at offset"),
    ("ti-names", put("<Q", at(TI, 40), 500), f"{TI_MSG}: names blob at offset"),
    (
        "ti-name-range",
        put("<I", entry_pos(1, 4), 9),
        f"{TI_MSG}: entry 1 name (offset 1, length 9) runs past the 2-byte names blob",
    ),
    ("ti-empty-name", put("<I", entry_pos(0, 4), 0), f"{TI_MSG}: entry 0: empty tensor name"),
    ("ti-dup-name", put("<I", entry_pos(1, 0), 0), f"{TI_MSG}: tensor 'a': duplicate name"),
    (
        "ti-unsorted",
        both(put("<I", entry_pos(0, 0), 1), put("<I", entry_pos(1, 0), 0)),
        f"{TI_MSG}: tensor 'a': entry 1 breaks the sorted-by-name order",
    ),
    ("ti-nul", put("B", at(TI, 48 + 80 + 8 * 4), 0), f"{TI_MSG}: entry 0: tensor name b'\\x00' contains a NUL byte"),
    ("ti-utf8", put("B", at(TI, 48 + 80 + 8 * 4), 0xFF), f"{TI_MSG}: entry 0: tensor name b'\\xff' is not valid UTF-8"),
    ("ti-dtype-big", put("<I", entry_pos(0, 8), 0x10001), f"{TI_MSG}: tensor 'a': dtype 0x10001 is larger than 0xFFFF"),
    ("ti-dtype-unknown", put("<I", entry_pos(0, 8), 0x99), f"{TI_MSG}: tensor 'a': unknown dtype 0x0099"),
    ("ti-reserved", put("<I", entry_pos(0, 20), 1), f"{TI_MSG}: tensor 'a': reserved field is 1, must be 0"),
    (
        "ti-dims-index",
        put("<I", entry_pos(1, 16), 3),
        f"{TI_MSG}: tensor 'q': rank 2 at dims index 3 runs past the 4-entry dims table",
    ),
    # QuantInfo
    ("qi-short", set_section(QI, size=4), f"{QI_MSG}: section is 4 bytes, shorter than its 8-byte header"),
    ("qi-version", put("<I", at(QI, 0), 2), f"{QI_MSG}: unsupported version 2"),
    ("qi-count", put("<I", at(QI, 4), 2), f"{QI_MSG}: 2 records of 24 bytes do not fit in the 32-byte section"),
    ("qi-reserved", put("B", at(QI, 8 + 12), 1), f"{QI_MSG}: record 0 has non-zero reserved bytes 000001000000"),
    ("qi-method", put("B", at(QI, 8 + 4), 0x22), f"{QI_MSG}: record 0 has unknown method 0x22"),
    (
        "qi-domain",
        put("B", at(QI, 8 + 5), 2),
        f"{QI_MSG}: record 0: domain 2 is neither 0 (weights) nor 1 (activations)",
    ),
    (
        "qi-q-activations",
        put("B", at(QI, 8 + 5), 1),
        f"{QI_MSG}: record 0: q4 allows only the weights domain (0), got 1",
    ),
    (
        "qi-block",
        put("<H", at(QI, 8 + 6), 64),
        f"{QI_MSG}: record 0: q4 needs block size 32 and super size 0, got 64 and 0",
    ),
    (
        "qi-index",
        put("<I", at(QI, 8), 7),
        "<bytes>: QuantInfo record 0 refers to tensor 7, but the TensorIndex has 2 tensors",
    ),
    ("qi-mismatch", put("B", at(QI, 8 + 4), 0x20), "<bytes>: QuantInfo record 0 says q8 but tensor 'q' has dtype Q4"),
    ("qi-plain-target", put("<I", at(QI, 8), 0), "<bytes>: QuantInfo record 0 says q4 but tensor 'a' has dtype F32"),
    # tensor data
    (
        "numpy-limit",
        both(put("<Q", at(TI, 128), 0), put("<Q", at(TI, 136), 2**63)),
        f"{A_NAME}: shape (0, 9223372036854775808) is too large for a numpy array",
    ),
    (
        "plain-size",
        put("<Q", entry_pos(0, 32), 20),
        f"{A_NAME}: data size 20 does not match 24 bytes for F32 shape (2, 3)",
    ),
    (
        "plain-range",
        put("<Q", entry_pos(0, 24), 256),
        f"{A_NAME}: data range [256, 280) lies outside the TensorData section [64, 256)",
    ),
    (
        "aligned-flag",
        put("<Q", entry_pos(0, 24), 72),
        f"{A_NAME}: data offset 72 is not 64-byte aligned though FlagTensorDataAligned64 is set",
    ),
    (
        "quant-size",
        put("<Q", entry_pos(1, 32), 64),
        f"{Q_NAME}: data size 64 does not match the 128-byte q4 payload for shape (2, 64)",
    ),
    ("quant-offset", put("<Q", entry_pos(1, 24), 72), f"{Q_NAME}: quantized data offset 72 is not a multiple of 64"),
    (
        "quant-no-flag",
        put("<Q", 32, 0),
        f"{Q_NAME}: the file holds q4 tensors but does not set FlagTensorDataAligned64",
    ),
    ("quant-rank", put("<I", entry_pos(1, 12), 1), f"{Q_NAME}: q4-quantized tensors must have rank 2, shape is (2,)"),
    ("quant-empty", put("<Q", at(TI, 48 + 80 + 16), 0), f"{Q_NAME}: q4-quantized tensor has an empty shape (0, 64)"),
    (
        "no-tensor-data",
        put("<I", D[TD][0], 0x7777),
        f"{A_NAME}: has 24 bytes of data but the file has no TensorData section",
    ),
    (
        "outside-tensor-data",
        set_section(TD, size=64),
        f"{Q_NAME}: data range [128, 256) lies outside the TensorData section [64, 128)",
    ),
]


@pytest.mark.parametrize(("patch", "message"), [(c[1], c[2]) for c in CASES], ids=[c[0] for c in CASES])
def test_rule(patch: Callable[[bytearray], None], message: str) -> None:
    data = bytearray(VALID)
    patch(data)
    with pytest.raises(MCFError) as info:
        mcf.MCFFile.from_bytes(bytes(data))
    assert str(info.value).startswith(message), str(info.value)


def test_valid_base_file_reads() -> None:
    f = mcf.MCFFile.from_bytes(VALID)
    assert list(f.tensors) == ["a", "q"]
    assert f.tensors["q"].data_offset == 128  # the layout CASES relies on


def test_empty_tensor_offset_is_not_read() -> None:
    data = bytearray(VALID)
    struct.pack_into("<Q", data, at(TI, 128), 0)  # shape (0, 3): no bytes
    struct.pack_into("<QQ", data, entry_pos(0, 24), 2**40, 0)
    f = mcf.MCFFile.from_bytes(bytes(data))
    assert f.array("a").shape == (0, 3) and bytes(f.tensor_bytes("a")) == b""


def test_unknown_minor_and_flag_bits_are_accepted() -> None:
    data = bytearray(VALID)
    struct.pack_into("<H", data, 6, 7)
    struct.pack_into("<Q", data, 32, 1 | 1 << 40)
    assert mcf.MCFFile.from_bytes(bytes(data)).header.minor == 7


def test_errors_name_the_file(tmp_path: Path) -> None:
    path = tmp_path / "broken.mcf"
    path.write_bytes(VALID[:-1])
    with pytest.raises(MCFError) as info:
        mcf.open(path)
    assert str(info.value).startswith(f"{path}: header file size")
    empty = tmp_path / "empty.mcf"
    empty.write_bytes(b"")
    with pytest.raises(MCFError, match=r"empty.mcf: file is empty"):
        mcf.open(empty)
