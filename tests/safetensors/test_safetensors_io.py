"""carton.safetensors against the reference `safetensors` package: byte-identical writes, identical reads, the
lazy/zero-copy API, and every dtype."""

from __future__ import annotations

import errno
import json
import mmap
import os
import stat
import struct
from pathlib import Path

import carton.safetensors as st
import ml_dtypes
import numpy as np
import pytest
import safetensors
import safetensors.numpy as ref
from carton import SafetensorsError
from safetensors import safe_open as ref_safe_open

RNG = np.random.default_rng(1234)

# dtypes the reference's numpy binding can write (it has no bfloat16/float8 numpy types)
REF_NUMPY_DTYPES = [
    np.bool_,
    np.uint8,
    np.int8,
    np.int16,
    np.uint16,
    np.float16,
    np.int32,
    np.uint32,
    np.float32,
    np.complex64,
    np.float64,
    np.int64,
    np.uint64,
]
ML_DTYPES = [
    ml_dtypes.bfloat16,
    ml_dtypes.float8_e4m3fn,
    ml_dtypes.float8_e5m2,
    ml_dtypes.float8_e8m0fnu,
    ml_dtypes.float8_e4m3fnuz,
    ml_dtypes.float8_e5m2fnuz,
]


def _random(dtype: object, shape: tuple[int, ...]) -> np.ndarray:
    dt = np.dtype(dtype)  # type: ignore[call-overload]
    if dt == np.bool_:
        return RNG.integers(0, 2, size=shape).astype(bool)
    if dt.kind in "iu":
        info = np.iinfo(dt)
        return RNG.integers(max(info.min, -1000), min(info.max, 1000), size=shape, endpoint=True).astype(dt)
    if dt.kind == "c":
        return (RNG.standard_normal(shape) + 1j * RNG.standard_normal(shape)).astype(dt)
    return RNG.standard_normal(shape).astype(dt)


def _mixed_tensors() -> dict[str, np.ndarray]:
    tensors = {f"t_{np.dtype(d).name}": _random(d, (3, 5)) for d in REF_NUMPY_DTYPES}
    tensors["scalar"] = np.array(2.5, dtype=np.float32)
    tensors["empty"] = np.zeros((4, 0, 2), dtype=np.float16)
    tensors["unicode_é"] = _random(np.float32, (2,))
    tensors["Zed"] = _random(np.float32, (7,))
    return tensors


@pytest.mark.parametrize(
    "metadata", [None, {}, {"format": "np"}, {'quote"\n\u0001é\u2028': "v\t\\"}], ids=["none", "empty", "one", "esc"]
)
def test_save_is_byte_identical_to_reference(metadata: dict[str, str] | None) -> None:
    tensors = _mixed_tensors()
    assert st.save(tensors, metadata=metadata) == ref.save(tensors, metadata=metadata)


def test_save_file_is_byte_identical_to_reference(tmp_path: Path) -> None:
    tensors = _mixed_tensors()
    st.save_file(tensors, tmp_path / "ours.safetensors", metadata={"k": "v"})
    ref.save_file(tensors, tmp_path / "ref.safetensors", metadata={"k": "v"})
    assert (tmp_path / "ours.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()


def test_many_metadata_keys_match_reference_after_parsing() -> None:
    # The reference keeps metadata in a Rust HashMap, so with several keys its order is random; we keep insertion
    # order. Everything else is identical.
    metadata = {f"k{i}": str(i) for i in range(10)}
    tensors = {"a": np.arange(4, dtype=np.float32)}
    ours, theirs = st.save(tensors, metadata=metadata), ref.save(tensors, metadata=metadata)
    assert len(ours) == len(theirs)
    assert json.loads(ours[8:].split(b"}}")[0] + b"}}") == json.loads(theirs[8:].split(b"}}")[0] + b"}}")
    assert ours[-16:] == theirs[-16:]


def test_empty_dict_matches_reference() -> None:
    assert st.save({}) == ref.save({}) == struct.pack("<Q", 8) + b"{}      "
    assert st.save({}, metadata={"a": "b"}) == ref.save({}, metadata={"a": "b"})


def test_no_tensors_with_empty_metadata_is_valid_where_the_reference_is_not() -> None:
    ours = st.save({}, metadata={})
    assert ours == struct.pack("<Q", 24) + b'{"__metadata__":{}}     '
    assert st.load(ours) == {}
    assert ref.save({}, metadata={})[8:].startswith(b'{},"__metadata__"')  # not JSON; we do not copy it


def test_exact_bytes_of_a_small_file() -> None:
    data = st.save({"b": np.array([1.0], dtype=np.float32), "a": np.array([1, 2], dtype=np.int64)})
    header = b'{"a":{"dtype":"I64","shape":[2],"data_offsets":[0,16]},'
    header += b'"b":{"dtype":"F32","shape":[1],"data_offsets":[16,20]}}'
    header += b" " * (-len(header) % 8)
    assert data == struct.pack("<Q", len(header)) + header + struct.pack("<qqf", 1, 2, 1.0)


def test_big_endian_and_non_contiguous_inputs_are_stored_as_their_values() -> None:
    base = np.arange(24, dtype=np.float64).reshape(4, 6)
    tensors = {"be": np.arange(5, dtype=">i4"), "strided": base[:, ::2], "fortran": np.asfortranarray(base)}
    loaded = st.load(st.save(tensors))
    for name, value in tensors.items():
        np.testing.assert_array_equal(loaded[name], value)
    assert loaded["be"].dtype == np.dtype("<i4")


def test_reference_files_load_identically(tmp_path: Path) -> None:
    tensors = _mixed_tensors()
    ref.save_file(tensors, tmp_path / "ref.safetensors", metadata={"m": "1"})
    ours = st.load_file(tmp_path / "ref.safetensors")
    assert set(ours) == set(tensors)
    for name, value in tensors.items():
        assert ours[name].dtype == value.dtype
        np.testing.assert_array_equal(ours[name], value)
    with st.safe_open(tmp_path / "ref.safetensors") as f, ref_safe_open(tmp_path / "ref.safetensors", "np") as g:
        assert f.keys() == g.keys()
        assert f.offset_keys() == g.offset_keys()
        assert f.metadata() == g.metadata()


def test_our_files_load_in_the_reference(tmp_path: Path) -> None:
    tensors = _mixed_tensors()
    st.save_file(tensors, tmp_path / "ours.safetensors")
    theirs = ref.load_file(tmp_path / "ours.safetensors")
    for name, value in tensors.items():
        np.testing.assert_array_equal(theirs[name], value)


@pytest.mark.parametrize("dtype", ML_DTYPES, ids=lambda d: np.dtype(d).name)
def test_ml_dtypes_round_trip_and_decode_in_the_reference(dtype: object, tmp_path: Path) -> None:
    value = _random(dtype, (4, 3))
    st.save_file({"x": value}, tmp_path / "f.safetensors")
    loaded = st.load_file(tmp_path / "f.safetensors")["x"]
    assert loaded.dtype == np.dtype(dtype)  # type: ignore[call-overload]
    assert loaded.tobytes() == value.tobytes()
    # the reference agrees on the header and the raw bytes
    raw = dict(safetensors.deserialize((tmp_path / "f.safetensors").read_bytes()))["x"]
    assert bytes(raw["data"]) == value.tobytes()
    assert raw["shape"] == [4, 3]


def test_subbyte_dtypes_pack_lsb_first() -> None:
    f4 = np.array([0.5, 1.0, -2.0, 6.0], dtype=ml_dtypes.float4_e2m1fn)
    data = st.save({"f4": f4})
    codes = f4.view(np.uint8)
    assert data[-2:] == bytes([codes[0] | codes[1] << 4, codes[2] | codes[3] << 4])
    np.testing.assert_array_equal(st.load(data)["f4"], f4)
    f6 = np.array([0.5, 1, -2, 6, 7, 0.25, -0.125, 3], dtype=ml_dtypes.float6_e2m3fn)
    out = st.load(st.save({"f6": f6}))["f6"]
    assert out.dtype == f6.dtype
    np.testing.assert_array_equal(out, f6)
    header = json.loads(st.save({"f6": f6})[8:].rstrip(bytes(range(256))[33:]).split(b"}}")[0] + b"}}")
    assert header["f6"] == {"dtype": "F6_E2M3", "shape": [8], "data_offsets": [0, 6]}


def test_f4_file_written_by_the_reference_reads_here(tmp_path: Path) -> None:
    packed = np.array([0x21, 0xC3], dtype=np.uint8)  # codes 1,2,3,12
    spec = safetensors.TensorSpec(dtype="float4_e2m1fn_x2", shape=[2], data_ptr=packed.ctypes.data, data_len=2)
    safetensors.serialize_file({"f4": spec}, str(tmp_path / "f4.safetensors"))
    value = st.load_file(tmp_path / "f4.safetensors")["f4"]
    np.testing.assert_array_equal(value.view(np.uint8), [1, 2, 3, 12])


def test_subbyte_with_partial_byte_is_refused() -> None:
    with pytest.raises(SafetensorsError, match=r"tensor 'x': 3 elements of 4-bit F4 do not fill a whole number"):
        st.save({"x": np.zeros(3, dtype=ml_dtypes.float4_e2m1fn)})


def test_safe_open_is_lazy_and_zero_copy(tmp_path: Path) -> None:
    path = tmp_path / "f.safetensors"
    value = _random(np.float32, (64, 32))
    st.save_file({"w": value, "b": _random(np.float32, (32,))}, path)
    before = path.read_bytes()
    with st.safe_open(path, framework="numpy") as f:
        w = f.get_tensor("w")
        assert not w.flags.owndata
        base = w
        while isinstance(base, np.ndarray):
            base = base.base
        assert isinstance(base, memoryview | mmap.mmap)
        part = f.get_slice("w")[8:16, ::2]
        assert np.shares_memory(part, w) or not part.flags.owndata
        np.testing.assert_array_equal(part, value[8:16, ::2])
        w[0, 0] = 1e9  # copy-on-write: private to this process
    assert path.read_bytes() == before
    assert w[0, 0] == np.float32(1e9)  # still usable after close


def test_get_slice_indexing_matches_numpy(tmp_path: Path) -> None:
    value = np.arange(2 * 3 * 4, dtype=np.int32).reshape(2, 3, 4)
    st.save_file({"a": value}, tmp_path / "f.safetensors")
    with st.safe_open(tmp_path / "f.safetensors") as f:
        s = f.get_slice("a")
        assert s.get_shape() == [2, 3, 4] and s.get_dtype() == "I32" and s.ndim == 3 and len(s) == 2
        for index in [
            0,
            -1,
            (0,),
            (slice(None), 1),
            (1, slice(1, 3)),
            ...,
            (..., 1),
            (0, ..., slice(None, None, -1)),
            slice(0, 10),
            (np.int64(1), 2, 3),
        ]:
            np.testing.assert_array_equal(s[index], value[index])  # type: ignore[index]
        with pytest.raises(SafetensorsError, match=r"tensor 'a' with shape \[2, 3, 4\]: index 5 is out of bounds"):
            s[5]
        with pytest.raises(SafetensorsError, match=r"4 indices for 3 dimensions"):
            s[0, 0, 0, 0]
        with pytest.raises(SafetensorsError, match=r"unsupported index None at position 0"):
            s[None]
        with pytest.raises(SafetensorsError, match=r"unsupported index \[0, 1\] at position 0"):
            s[[0, 1]]


def test_safe_open_errors(tmp_path: Path) -> None:
    st.save_file({"a": np.zeros(2, np.float32)}, tmp_path / "f.safetensors")
    with st.safe_open(tmp_path / "f.safetensors") as f:
        with pytest.raises(SafetensorsError, match=r"f.safetensors: file does not contain tensor 'zz'"):
            f.get_tensor("zz")
        assert f.metadata() is None
    with pytest.raises(SafetensorsError, match=r"f.safetensors: file is closed"):
        f.get_tensor("a")
    with pytest.raises(SafetensorsError, match=r"framework 'pt' is not supported"):
        st.safe_open(tmp_path / "f.safetensors", framework="pt")


@pytest.mark.parametrize("reader", [st.safe_open, st.load_file])
def test_missing_file_and_directory_are_both_oserror_and_safetensors_error(reader: object, tmp_path: Path) -> None:
    """The reference raises FileNotFoundError for a missing file and OSError (ENODEV) for a directory; ours raise
    FileNotFoundError and IsADirectoryError (an OSError), which are also SafetensorsError and name the file."""
    missing = tmp_path / "missing.safetensors"
    with pytest.raises(FileNotFoundError):
        ref.load_file(str(missing))
    with pytest.raises(OSError):
        ref.load_file(str(tmp_path))
    with pytest.raises(FileNotFoundError) as not_found:
        reader(missing)  # type: ignore[operator]
    assert isinstance(not_found.value, SafetensorsError) and isinstance(not_found.value, st.SafetensorsFileNotFound)
    assert not_found.value.errno == errno.ENOENT and not_found.value.filename == str(missing)
    assert str(not_found.value) == f"{missing}: cannot open: no such file"
    with pytest.raises(IsADirectoryError) as is_dir:
        reader(tmp_path)  # type: ignore[operator]
    assert isinstance(is_dir.value, SafetensorsError) and is_dir.value.errno == errno.EISDIR
    assert str(is_dir.value) == f"{tmp_path}: cannot open: it is a directory"
    try:
        reader(missing)  # type: ignore[operator]
    except SafetensorsError as exc:  # the carton-wide handler catches it too
        assert isinstance(exc, OSError)


def test_save_file_errors_name_the_target(tmp_path: Path) -> None:
    target = tmp_path / "nowhere" / "x.safetensors"
    with pytest.raises(FileNotFoundError) as info:
        st.save_file({"a": np.zeros(2, np.float32)}, target)
    assert isinstance(info.value, SafetensorsError)
    assert str(info.value) == f"{target}: cannot write: folder {target.parent} does not exist"
    assert info.value.filename == str(target)
    assert not target.parent.exists()
    (tmp_path / "d.safetensors").mkdir()
    with pytest.raises(IsADirectoryError) as is_dir:
        st.save_file({"a": np.zeros(2, np.float32)}, tmp_path / "d.safetensors")
    assert isinstance(is_dir.value, SafetensorsError)
    assert str(is_dir.value) == f"{tmp_path / 'd.safetensors'}: cannot write: it is a directory"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.safetensors"]


def test_save_file_mode_follows_the_umask(tmp_path: Path) -> None:
    previous = os.umask(0o027)
    try:
        st.save_file({"a": np.zeros(2, np.float32)}, tmp_path / "ours.safetensors")
    finally:
        os.umask(previous)
    # As open(path, "wb") would create it (the reference 0.8 writes 0600 through its temporary file).
    assert stat.S_IMODE((tmp_path / "ours.safetensors").stat().st_mode) == 0o640


def test_load_from_bytes_is_a_view() -> None:
    data = st.save({"a": np.arange(6, dtype=np.float64)})
    out = st.load(data)["a"]
    assert not out.flags.writeable  # a view over immutable bytes
    np.testing.assert_array_equal(out, np.arange(6))
    out2 = st.load(bytearray(data))["a"]
    assert out2.flags.writeable


@pytest.mark.parametrize(
    ("tensors", "metadata", "message"),
    [
        ({"a": [1, 2]}, None, "tensor 'a': expected a numpy array, got list"),
        ({"__metadata__": np.zeros(1)}, None, "'__metadata__' is reserved and cannot name a tensor"),
        ({"a\x00b": np.zeros(1)}, None, "tensor name 'a\\x00b' contains a NUL character"),
        ({1: np.zeros(1)}, None, "tensor names must be str, got 1"),
        ({"a": np.zeros(1, dtype="U3")}, None, "tensor 'a': numpy dtype <U3 has no safetensors equivalent"),
        ({"a": np.zeros(1)}, {"k": 1}, "metadata entry 'k': keys and values must be str, got 1"),
        ({"a": np.zeros(1)}, ["k"], "metadata must be a dict of str to str, got list"),
        ({"\ud800": np.zeros(1)}, None, "a tensor name or metadata string is not valid Unicode"),
    ],
)
def test_save_rejects_bad_input(tensors: dict, metadata: object, message: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(SafetensorsError) as info:
        st.save(tensors, metadata=metadata)  # type: ignore[arg-type]
    assert str(info.value).startswith(message)


def test_save_file_failure_leaves_existing_file_untouched(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "f.safetensors"
    st.save_file({"a": np.zeros(2, np.float32)}, path)
    before = path.read_bytes()
    import carton.safetensors._io as io_module

    real = io_module._raw_bytes
    calls = []

    def failing(array: np.ndarray, info: object) -> memoryview:
        calls.append(1)
        if len(calls) == 2:
            raise OSError("disk full")
        return real(array, info)  # type: ignore[arg-type]

    monkeypatch.setattr(io_module, "_raw_bytes", failing)
    with pytest.raises(OSError, match="disk full"):
        st.save_file({"a": np.zeros(2, np.float32), "b": np.ones(3, np.float32)}, path)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.safetensors"]
