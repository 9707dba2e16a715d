"""MCF container: exact bytes of every section we write, round trips through the reader, deduplication, resources,
quantized entries, and the writer's refusals."""

from __future__ import annotations

import errno
import os
import re
import stat
import struct
from pathlib import Path

import carton.mcf as mcf
import ml_dtypes
import numpy as np
import pytest
from carton import MCFError
from carton.mcf import Architecture, MCFDType, ModelInfo, QuantDomain, QuantMethod, RopeType, SectionType

RNG = np.random.default_rng(7)


def test_exact_bytes_of_a_minimal_file(tmp_path: Path) -> None:
    path = mcf.write_mcf(tmp_path / "m.mcf", tensors={"w": np.array([1.0, 2.0], dtype=np.float32)})
    data = path.read_bytes()
    # TensorData at 64 (first tensor 64-aligned), then ModelInfo, then TensorIndex, then the directory.
    tensor_data = struct.pack("<2f", 1.0, 2.0)
    model_info = struct.pack("<II", 1, 0) + bytes(80)
    struct.pack_into("<Q", bytearray(8), 0, 0)
    model_info = bytearray(model_info)
    struct.pack_into("<Q", model_info, 8 + 72, 88)  # kv table offset: right after the fixed part, empty
    index = struct.pack("<IIIIQQQQ", 1, 3, 1, 1, 48, 88, 96, 1)
    index += struct.pack("<IIIIIIQQ", 0, 1, 1, 1, 0, 0, 64, 8) + struct.pack("<Q", 2) + b"w"
    mi_off = 72
    ti_off = mi_off + 88
    dir_off = (ti_off + len(index) + 7) // 8 * 8
    directory = struct.pack("<IIQQ", 1, 1, mi_off, 88) + struct.pack("<IIQQ", 3, 1, ti_off, len(index))
    directory += struct.pack("<IIQQ", 4, 1, 64, 8)
    file_size = dir_off + len(directory)
    header = b"MCF\x00" + struct.pack("<HHIIQQQ", 1, 1, 40, 3, dir_off, file_size, 1)
    expected = header + bytes(24) + tensor_data + bytes(model_info) + index + bytes(dir_off - ti_off - len(index))
    expected += directory
    assert data == expected


def test_model_info_bytes_follow_the_reference_encoder() -> None:
    info = ModelInfo(arch=Architecture.LLAMA, vocab_size=32000, model_name="m", kv={"b": 2.5, "a": 7, "c": "xyz"})
    data = info.encode()
    fixed = struct.pack("<IIIIIIIIIIffQQIIQ", 1, 0, 32000, 0, 0, 0, 0, 0, 0, 0, 0.0, 0.0, 88, 0, 3, 0, 144)
    blob = struct.pack("<I", 1) + b"m" + bytes(3)  # 88: model name
    blob += struct.pack("<I", 1) + b"a" + bytes(3)  # 96: key a
    blob += struct.pack("<I", 7) + bytes(4)  # 104: u32 7
    blob += struct.pack("<I", 1) + b"b" + bytes(3)  # 112: key b
    blob += struct.pack("<f", 2.5) + bytes(4)  # 120: f32
    blob += struct.pack("<I", 1) + b"c" + bytes(3)  # 128: key c
    blob += struct.pack("<I", 3) + b"xyz" + bytes(1)  # 136: string, then the table at 144
    table = struct.pack("<QIIQ", 96, 1, 0, 104) + struct.pack("<QIIQ", 112, 2, 0, 120)
    table += struct.pack("<QIIQ", 128, 3, 0, 136)
    assert data == struct.pack("<II", 1, 0) + fixed + blob + table
    assert ModelInfo.decode(data) == info


def test_model_info_round_trips_every_field() -> None:
    info = ModelInfo(
        arch=Architecture.QWEN,
        vocab_size=1,
        hidden_size=2,
        layer_count=3,
        head_count=4,
        kv_head_count=5,
        context_length=6,
        train_context=7,
        rope_type=RopeType.YARN,
        rope_freq_base=1e6,
        rope_scale=4.0,
        model_name="name é",
        base_model="base",
        kv={"u": 0, "f": -1.5, "s": "", "raw": b"\xff\xfe", "t": "text"},
    )
    decoded = ModelInfo.decode(info.encode())
    assert decoded == ModelInfo(**{**{f: getattr(info, f) for f in info.__slots__}, "kv": {**info.kv, "s": ""}})
    assert isinstance(decoded.arch, Architecture) and isinstance(decoded.rope_type, RopeType)


def test_model_info_keeps_unknown_codes_as_ints() -> None:
    decoded = ModelInfo.decode(ModelInfo(arch=99, rope_type=42).encode())
    assert decoded.arch == 99 and not isinstance(decoded.arch, Architecture)
    assert decoded.rope_type == 42


@pytest.mark.parametrize(
    ("info", "message"),
    [
        (ModelInfo(vocab_size=-1), "ModelInfo.vocab_size: -1 is not an unsigned 32-bit integer"),
        (ModelInfo(head_count=2**32), "ModelInfo.head_count: 4294967296 is not an unsigned 32-bit integer"),
        (ModelInfo(rope_scale=float("nan")), "ModelInfo.rope_scale: nan is not a finite 32-bit float"),
        (ModelInfo(rope_freq_base=1e39), "ModelInfo.rope_freq_base: 1e+39 is not a finite 32-bit float"),
        (ModelInfo(kv={"": 1}), "ModelInfo.kv['']: keys must be non-empty strings"),
        (ModelInfo(kv={"b": True}), "ModelInfo.kv['b']: bool is not an MCF value type"),
        (ModelInfo(kv={"l": [1]}), "ModelInfo.kv['l']: unsupported value type list"),
        (ModelInfo(kv={"n": -3}), "ModelInfo.kv['n']: -3 is not an unsigned 32-bit integer"),
        (ModelInfo(model_name="\ud800"), "ModelInfo.model_name: '\\ud800' cannot be encoded as UTF-8"),
    ],
)
def test_model_info_refuses_values_that_do_not_fit(info: ModelInfo, message: str) -> None:
    with pytest.raises(MCFError) as exc:
        info.encode()
    assert str(exc.value).startswith(message)


def _plain_tensors() -> dict[str, np.ndarray]:
    return {
        "f32": RNG.standard_normal((3, 5)).astype(np.float32),
        "f16": RNG.standard_normal((4,)).astype(np.float16),
        "bf16": RNG.standard_normal((2, 2)).astype(ml_dtypes.bfloat16),
        "f64": RNG.standard_normal((2,)),
        "i8": np.arange(-3, 3, dtype=np.int8),
        "u8": np.arange(6, dtype=np.uint8),
        "i16": np.arange(6, dtype=np.int16),
        "u16": np.arange(6, dtype=np.uint16),
        "i32": np.arange(6, dtype=">i4"),
        "u32": np.arange(6, dtype=np.uint32),
        "i64": np.arange(6, dtype=np.int64).reshape(2, 3),
        "u64": np.arange(6, dtype=np.uint64),
        "scalar": np.array(3.5, dtype=np.float32),
        "empty": np.zeros((0, 4), dtype=np.float32),
        "strided": np.arange(20, dtype=np.float32).reshape(4, 5)[:, ::2],
    }


def test_round_trip_of_every_plain_dtype(tmp_path: Path) -> None:
    tensors = _plain_tensors()
    mcf.write_mcf(tmp_path / "m.mcf", tensors=tensors)
    with mcf.open(tmp_path / "m.mcf") as f:
        assert list(f.tensors) == sorted(tensors)
        for name, value in tensors.items():
            array = f.array(name)
            assert array.shape == value.shape
            assert array.dtype == value.dtype.newbyteorder("=") or array.dtype == value.dtype
            np.testing.assert_array_equal(array, value)
            assert not array.flags.writeable and not array.flags.owndata
            entry = f.tensors[name]
            assert entry.data_offset % 64 == 0 and entry.method is None and entry.quant is None
        assert f.tensors["bf16"].dtype == MCFDType.BF16 and f.tensors["i32"].dtype == MCFDType.I32


def test_quantized_entries_and_quant_info(tmp_path: Path) -> None:
    weight = RNG.standard_normal((8, 300)).astype(np.float32)
    tensors: dict[str, object] = {
        "q4": mcf.quantize(weight, "q4"),
        "k6": mcf.quantize(weight, "k6"),
        "act": mcf.quantize(weight, "int8", domain=QuantDomain.ACTIVATIONS),
        "raw": ("k2", bytes(mcf.payload_size("k2", 2, 64)), (2, 64), -1.0, 1.0),
        "norm": np.ones(300, dtype=np.float32),
    }
    mcf.write_mcf(tmp_path / "q.mcf", tensors=tensors)  # type: ignore[arg-type]
    with mcf.open(tmp_path / "q.mcf") as f:
        assert f.header.tensor_data_aligned64
        assert sorted(f.quant_info) == [0, 1, 3, 4]  # act, k6, (norm: no record), q4, raw
        act = f.tensors["act"]
        assert act.dtype == MCFDType.INT8 and act.domain == QuantDomain.ACTIVATIONS
        assert act.quant is not None and act.quant.block_size == 0 and act.quant.super_size == 0
        k6 = f.tensors["k6"]
        assert k6.quant is not None and (k6.quant.block_size, k6.quant.super_size) == (32, 256)
        raw = f.tensors["raw"]
        assert raw.quant is not None and (raw.quant.min_clip, raw.quant.max_clip) == (-1.0, 1.0)
        for name in ("q4", "k6", "act"):
            q = tensors[name]
            assert bytes(f.tensor_bytes(name)) == q.payload  # type: ignore[attr-defined]
            np.testing.assert_array_equal(f.dequantize(name), q.dequantize())  # type: ignore[attr-defined]
        with pytest.raises(MCFError, match=r"tensor 'q4' has dtype Q4, which is not a plain array type"):
            f.array("q4")
        np.testing.assert_array_equal(f.dequantize("norm"), np.ones(300))


def test_quant_info_record_bytes(tmp_path: Path) -> None:
    mcf.write_mcf(tmp_path / "q.mcf", tensors={"w": ("k4", bytes(mcf.payload_size("k4", 1, 300)), (1, 300), -2.0, 3.0)})
    with mcf.open(tmp_path / "q.mcf") as f:
        section = f.section_bytes(SectionType.QUANT_INFO)
        assert section is not None
        assert bytes(section) == struct.pack("<II", 1, 1) + struct.pack(
            "<IBBHH6sff", 0, 0x31, 0, 32, 256, bytes(6), -2.0, 3.0
        )


def test_dedup_shares_identical_payloads(tmp_path: Path) -> None:
    emb = RNG.standard_normal((64, 64)).astype(np.float32)
    tensors = {"embed": emb, "head": emb.copy(), "other": emb + 1}
    mcf.write_mcf(tmp_path / "d.mcf", tensors=tensors)
    mcf.write_mcf(tmp_path / "n.mcf", tensors=tensors, dedup=False)
    with mcf.open(tmp_path / "d.mcf") as f:
        assert f.tensors["embed"].data_offset == f.tensors["head"].data_offset
        assert f.tensors["other"].data_offset != f.tensors["embed"].data_offset
        np.testing.assert_array_equal(f.array("head"), emb)
    assert (tmp_path / "n.mcf").stat().st_size - (tmp_path / "d.mcf").stat().st_size == emb.nbytes


def test_resources_by_type_and_by_file_name(tmp_path: Path) -> None:
    mcf.write_mcf(
        tmp_path / "r.mcf",
        tensors={"w": np.zeros(1, np.float32)},
        resources={SectionType.HF_CONFIG: b'{"model_type": "llama"}', "merges.txt": b"a b\n"},
    )
    with mcf.open(tmp_path / "r.mcf") as f:
        assert f.resource(SectionType.HF_CONFIG) == b'{"model_type": "llama"}'
        assert f.resource("merges.txt") == b"a b\n"
        assert f.resource("tokenizer.json") is None
        assert [s.type for s in f.sections] == sorted(s.type for s in f.sections)
        with pytest.raises(MCFError, match=r"'model.bin' is not an MCF resource"):
            f.resource("model.bin")


def test_file_without_tensors_has_model_info_only(tmp_path: Path) -> None:
    mcf.write_mcf(tmp_path / "e.mcf", tensors={}, model_info=ModelInfo(model_name="x"))
    with mcf.open(tmp_path / "e.mcf") as f:
        assert len(f) == 0 and f.model_info is not None and f.model_info.model_name == "x"
        assert [s.known_type for s in f.sections] == [SectionType.MODEL_INFO]


def test_from_bytes_and_arrays_outlive_close(tmp_path: Path) -> None:
    value = np.arange(10, dtype=np.float32)
    path = mcf.write_mcf(tmp_path / "m.mcf", tensors={"v": value})
    f = mcf.MCFFile.open(path)
    array, view = f.array("v"), f.tensor_bytes("v")
    f.close()
    assert f.closed
    np.testing.assert_array_equal(array, value)
    assert bytes(view) == value.tobytes()
    with pytest.raises(MCFError, match="file is closed"):
        f.tensor_bytes("v")
    g = mcf.MCFFile.from_bytes(path.read_bytes())
    np.testing.assert_array_equal(g.array("v"), value)
    with pytest.raises(MCFError, match=r"<bytes>: no tensor named 'nope'"):
        g.tensor("nope")


def test_writer_failure_leaves_no_file(tmp_path: Path) -> None:
    target = tmp_path / "m.mcf"
    target.write_bytes(b"previous")
    with pytest.raises(MCFError), mcf.MCFWriter(target) as w:
        w.add_tensor("a", np.zeros(4, np.float32))
        w.add_tensor("a", np.zeros(4, np.float32))
    assert target.read_bytes() == b"previous"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.mcf"]


def test_written_file_mode_follows_the_umask(tmp_path: Path) -> None:
    # A sandboxed runner reads the file under another uid: it must get the mode open() would give, not mkstemp's 0600.
    previous = os.umask(0o027)
    try:
        path = mcf.write_mcf(tmp_path / "m.mcf", tensors={"a": np.zeros(4, np.float32)})
    finally:
        os.umask(previous)
    assert stat.S_IMODE(path.stat().st_mode) == 0o640
    path = mcf.write_mcf(tmp_path / "n.mcf", tensors={"a": np.zeros(4, np.float32)})
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~previous


def test_open_errors_name_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "missing.mcf"
    with pytest.raises(MCFError, match=rf"^{re.escape(str(missing))}: cannot open: no such file") as info:
        mcf.MCFFile.open(missing)
    assert isinstance(info.value.__cause__, FileNotFoundError)
    with pytest.raises(MCFError, match=rf"^{re.escape(str(tmp_path))}: cannot open: it is a directory"):
        mcf.MCFFile.open(tmp_path)
    (tmp_path / "empty.mcf").touch()
    with pytest.raises(MCFError, match=r"empty.mcf: file is empty"):
        mcf.open(tmp_path / "empty.mcf")


def test_writer_refuses_a_directory_or_a_missing_folder(tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    with pytest.raises(MCFError, match=r"out: cannot write the MCF file: it is a directory"):
        mcf.MCFWriter(tmp_path / "out")
    target = tmp_path / "nowhere" / "m.mcf"
    with pytest.raises(MCFError, match=rf"{re.escape(str(target))}: cannot write the MCF file: folder .*nowhere does"):
        mcf.write_mcf(target, tensors={"a": np.zeros(1, np.float32)})
    assert not (tmp_path / "nowhere").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_failed_rename_leaves_no_temporary_file(tmp_path: Path) -> None:
    target = tmp_path / "m.mcf"
    writer = mcf.MCFWriter(target)
    writer.add_tensor("a", np.zeros(4, np.float32))
    target.mkdir()  # the output turns into a folder while the file is being written
    with pytest.raises(MCFError, match=rf"{re.escape(str(target))}: cannot write the MCF file: it is a directory"):
        writer.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.mcf"]
    assert target.is_dir() and not list(target.iterdir())


def test_write_error_names_the_target_and_discards_the_temporary_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "m.mcf"
    writer = mcf.MCFWriter(target)
    writer.add_tensor("a", np.zeros(4, np.float32))

    def disk_full(raw: memoryview) -> tuple[int, int]:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(writer, "_append", disk_full)
    with pytest.raises(MCFError, match=rf"^{re.escape(str(target))}: cannot write the MCF file: no space left"):
        writer.add_tensor("b", np.ones(4, np.float32))
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(MCFError, match="writer is already closed"):
        writer.add_tensor("c", np.ones(4, np.float32))


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda w: w.add_tensor("", np.zeros(1)), "tensor name must be a non-empty string, got ''"),
        (lambda w: w.add_tensor("a\x00", np.zeros(1)), "tensor name 'a\\x00' contains a NUL character"),
        (lambda w: w.add_tensor("b", np.zeros(1, dtype=bool)), "tensor 'b': numpy dtype bool has no MCF equivalent"),
        (lambda w: w.add_tensor("c", [1.0]), "tensor 'c': expected a numpy array, got list"),
        (
            lambda w: w.add_quantized("q", method="q4", payload=b"x", shape=(2, 64)),
            "tensor 'q': q4 payload for shape (2, 64) must be 128 bytes, got 1",
        ),
        (
            lambda w: w.add_quantized("q", method="q4", payload=bytes(64), shape=(64,)),
            "tensor 'q': quantized tensors must have rank 2, shape is (64,)",
        ),
        (
            lambda w: w.add_quantized("q", method="q5", payload=b"", shape=(1, 1)),
            "tensor 'q': 'q5' is not a valid QuantMethod",
        ),
        (
            lambda w: w.add_quantized("q", method="k4", payload=bytes(1000), shape=(1, 32), domain=1),
            "tensor 'q': k4 allows only the weights domain",
        ),
        (lambda w: w.add_quantized("q"), "tensor 'q': give a quantized tensor, or method, payload and shape"),
        (lambda w: w.add_resource(SectionType.MODEL_INFO, b""), "section type 0x0001 is not a raw resource section"),
        (lambda w: w.add_resource("weights.bin", b""), "'weights.bin' is not an MCF resource file"),
    ],
)
def test_writer_refuses_bad_input(tmp_path: Path, call: object, message: str) -> None:
    w = mcf.MCFWriter(tmp_path / "m.mcf")
    with pytest.raises(MCFError) as exc:
        call(w)  # type: ignore[operator]
    assert str(exc.value).startswith(message), str(exc.value)
    w.abort()
    assert not list(tmp_path.iterdir())


def test_write_mcf_rejects_malformed_tuples(tmp_path: Path) -> None:
    with pytest.raises(MCFError, match=r"a quantized tuple is \(method, payload, shape, min_clip, max_clip\), got 2"):
        mcf.write_mcf(tmp_path / "m.mcf", tensors={"q": ("q4", b"")})  # type: ignore[dict-item]
    with pytest.raises(MCFError, match=r"tensor 'x': unsupported value of type str"):
        mcf.write_mcf(tmp_path / "m.mcf", tensors={"x": "nope"})  # type: ignore[dict-item]


def test_unknown_sections_are_skipped_and_the_first_of_a_type_wins(tmp_path: Path) -> None:
    path = mcf.write_mcf(tmp_path / "m.mcf", tensors={"w": np.ones(2, np.float32)}, resources={"config.json": b"{}"})
    data = bytearray(path.read_bytes())
    (count, dir_off) = struct.unpack_from("<IQ", data, 12)
    entries = [struct.unpack_from("<IIQQ", data, dir_off + 24 * i) for i in range(count)]
    config = next(e for e in entries if e[0] == SectionType.HF_CONFIG)
    # append: an unknown section type (version 9) and a second HF_CONFIG pointing at the ModelInfo bytes
    extra = [(0x7777, 9, config[2], config[3]), (SectionType.HF_CONFIG, 1, 48, 8)]
    new_dir = len(data)
    for e in entries + extra:
        data += struct.pack("<IIQQ", *e)
    struct.pack_into("<IQQ", data, 12, len(entries) + 2, new_dir, len(data))
    f = mcf.MCFFile.from_bytes(bytes(data))
    assert f.resource("config.json") == b"{}"
    assert any(s.known_type is None and s.type == 0x7777 for s in f.sections)


def test_tensor_class_order_is_bytewise(tmp_path: Path) -> None:
    names = ["b", "a", "B", "é", "a.b", "a_b"]
    mcf.write_mcf(tmp_path / "m.mcf", tensors={n: np.zeros(1, np.float32) for n in names})
    with mcf.open(tmp_path / "m.mcf") as f:
        assert list(f.tensors) == sorted(names, key=lambda n: n.encode())
        assert [e.index for e in f.tensors.values()] == list(range(len(names)))


def test_quant_method_enum_matches_dtype_codes() -> None:
    for method in QuantMethod:
        assert method.dtype.value & 0xFF == method.dtype.value
