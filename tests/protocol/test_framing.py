"""Tensor framing and control headers: exact bytes (those in docs/protocol.md), round trips, and every refusal."""

from __future__ import annotations

import struct
from typing import Any

import ml_dtypes
import msgspec
import numpy as np
import pytest
from carton_protocol import (
    PROTOCOL_VERSION,
    DType,
    FrameError,
    Hello,
    Infer,
    LimitExceeded,
    Load,
    TensorEntry,
    TensorSpec,
)
from carton_protocol._dtypes import WireType, carton_dtype, from_numpy
from carton_protocol._framing import decode_tensors, encode_tensors
from carton_protocol._limits import DEFAULT_LIMITS, WireLimits
from carton_protocol._messages import check_opts, check_specs, decode_request, encode

# The sample messages of docs/protocol.md, byte for byte.
DOC_HELLO = bytes.fromhex(
    "85 a2 6f 70 a5 68 65 6c 6c 6f a2 69 64 01 a8 70 72 6f 74 6f 63 6f 6c 02 a8 68 6f 73 74 5f 70 69 64 cd 10 92"
    " ad 73 68 6d 5f 74 68 72 65 73 68 6f 6c 64 ce 00 01 00 00"
)
DOC_INFER_HEADER = bytes.fromhex(
    "83 a2 6f 70 a5 69 6e 66 65 72 a2 69 64 03 a7 74 65 6e 73 6f 72 73 91 84 a4 6e 61 6d 65 a1 78 a8 64 61 74 61"
    " 74 79 70 65 a4 46 50 33 32 a5 73 68 61 70 65 92 01 02 a4 73 69 7a 65 08"
)
DOC_INFER_DATA = bytes.fromhex("00 00 80 3f 00 00 00 40")
DOC_INFER_REPLY = bytes.fromhex(
    "83 a5 72 65 70 6c 79 a5 69 6e 66 65 72 a2 69 64 03 a7 74 65 6e 73 6f 72 73 91 84 a4 6e 61 6d 65 a1 79 a8 64"
    " 61 74 61 74 79 70 65 a4 46 50 33 32 a5 73 68 61 70 65 92 01 02 a4 73 69 7a 65 08"
)
DOC_ERROR_REPLY = bytes.fromhex(
    "86 a5 72 65 70 6c 79 a5 65 72 72 6f 72 a2 69 64 03 a4 63 6f 64 65 ad 69 6e 76 61 6c 69 64 5f 69 6e 70 75 74"
    " a7 6d 65 73 73 61 67 65 ad 78 20 69 73 20 6e 65 67 61 74 69 76 65 a9 65 78 63 65 70 74 69 6f 6e ac 49 6e 76"
    " 61 6c 69 64 49 6e 70 75 74 a6 74 65 6e 73 6f 72 a1 78"
)


def roundtrip(tensors: dict[str, Any], limits: WireLimits = DEFAULT_LIMITS) -> dict[str, Any]:
    encoded = encode_tensors(tensors, pool=None, threshold=1 << 62)
    message = decode_request(encode(Infer(id=1, tensors=encoded.entries)), limits)
    assert isinstance(message, Infer)
    frames = [memoryview(as_bytes(frame)) for frame in encoded.frames]
    decoded, segments = decode_tensors(message.tensors, frames, limits=limits, peer=None, copy_shared=True)
    assert segments == []
    return decoded


def as_bytes(frame: Any) -> bytes:
    """A frame's bytes as the wire carries them (frames are bytes or arrays sent through the buffer protocol)."""
    return bytes(frame) if isinstance(frame, bytes) else np.ascontiguousarray(frame).tobytes()


def decode(entries: Any, frames: list[bytes], limits: WireLimits = DEFAULT_LIMITS) -> dict[str, Any]:
    """Decode `entries` (plain maps, as a peer may send anything) the way a runner reads an infer request."""
    message = decode_request(msgspec.msgpack.encode({"op": "infer", "id": 1, "tensors": entries}), limits)
    assert isinstance(message, Infer)
    views = [memoryview(f) for f in frames]
    return decode_tensors(message.tensors, views, limits=limits, peer=None, copy_shared=False)[0]


def entry(name: str = "x", datatype: str = "FP32", shape: Any = (1, 2), size: int = 8) -> dict[str, Any]:
    return {"name": name, "datatype": datatype, "shape": list(shape), "size": size}


# --- exact bytes --------------------------------------------------------------------------------------------------
def test_hello_bytes_match_the_documentation() -> None:
    # The connection numbers requests from 1; hello is always the first.
    hello = Hello(id=1, protocol=PROTOCOL_VERSION, host_pid=4242, shm_threshold=65536)
    assert PROTOCOL_VERSION == 2
    assert encode(hello) == DOC_HELLO
    assert decode_request(DOC_HELLO, DEFAULT_LIMITS) == hello
    assert msgspec.msgpack.decode(DOC_HELLO) == {
        "op": "hello",
        "id": 1,
        "protocol": 2,
        "host_pid": 4242,
        "shm_threshold": 65536,
    }


def test_infer_request_bytes_match_the_documentation() -> None:
    encoded = encode_tensors({"x": np.array([[1.0, 2.0]], dtype=np.float32)}, pool=None, threshold=1 << 62)
    message = Infer(id=3, tensors=encoded.entries)  # hello = 1, load = 2, first infer = 3
    assert encode(message) == DOC_INFER_HEADER
    assert [as_bytes(frame) for frame in encoded.frames] == [DOC_INFER_DATA]
    assert decode_request(DOC_INFER_HEADER, DEFAULT_LIMITS) == message
    decoded = decode([{"name": "x", "datatype": "FP32", "shape": [1, 2], "size": 8}], [DOC_INFER_DATA])
    np.testing.assert_array_equal(decoded["x"], np.array([[1.0, 2.0]], dtype=np.float32))


def test_reply_bytes_match_the_documentation() -> None:
    from carton_protocol import ErrorReply, InferReply

    reply = InferReply(id=3, tensors=(TensorEntry(name="y", datatype="FP32", shape=(1, 2), size=8),))
    assert encode(reply) == DOC_INFER_REPLY
    failure = ErrorReply(id=3, code="invalid_input", message="x is negative", exception="InvalidInput", tensor="x")
    assert encode(failure) == DOC_ERROR_REPLY


def test_bytes_tensor_layout_is_tritons() -> None:
    encoded = encode_tensors({"s": np.array(["ab", "", "é"])}, pool=None, threshold=1 << 62)
    assert encoded.entries == (TensorEntry(name="s", datatype="BYTES", shape=(3,), size=4 + 2 + 4 + 4 + 2),)
    assert bytes(encoded.frames[0]) == b"\x02\x00\x00\x00ab" + b"\x00\x00\x00\x00" + b"\x02\x00\x00\x00\xc3\xa9"


def test_bool_and_big_endian_are_sent_as_little_endian_bytes() -> None:
    encoded = encode_tensors(
        {"b": np.array([True, False]), "i": np.array([1, 256], dtype=">i4")}, pool=None, threshold=1 << 62
    )
    assert [e.datatype for e in encoded.entries] == ["BOOL", "INT32"]
    assert as_bytes(encoded.frames[0]) == b"\x01\x00"
    assert as_bytes(encoded.frames[1]) == struct.pack("<ii", 1, 256)


# --- round trips --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("dtype", "wire"),
    [
        (np.bool_, "BOOL"),
        (np.uint8, "UINT8"),
        (np.uint16, "UINT16"),
        (np.uint32, "UINT32"),
        (np.uint64, "UINT64"),
        (np.int8, "INT8"),
        (np.int16, "INT16"),
        (np.int32, "INT32"),
        (np.int64, "INT64"),
        (np.float16, "FP16"),
        (ml_dtypes.bfloat16, "BF16"),
        (np.float32, "FP32"),
        (np.float64, "FP64"),
    ],
)
def test_every_fixed_dtype_round_trips(dtype: Any, wire: str) -> None:
    value = (np.arange(24).reshape(2, 3, 4) % 2).astype(dtype)
    assert encode_tensors({"v": value}, pool=None, threshold=1 << 62).entries[0].datatype == wire
    out = roundtrip({"v": value})["v"]
    assert out.dtype == np.dtype(dtype) and out.shape == (2, 3, 4)
    np.testing.assert_array_equal(out, value)


def test_strings_scalars_empty_noncontiguous_and_nested_round_trip() -> None:
    base = np.arange(12, dtype=np.float64).reshape(3, 4)
    tensors = {
        "text": np.array([["héllo", ""], ["🙂", "x" * 1000]]),
        "objects": np.array(["a", "bc"], dtype=object),
        "scalar": np.array(3.5, dtype=np.float32),
        "empty": np.zeros((0, 7), dtype=np.int64),
        "empty_text": np.array([], dtype=str).reshape(0, 2),
        "strided": base[:, ::2],
        "transposed": base.T,
        "nested": [np.array([1, 2], dtype=np.int32), np.array(["a"]), np.zeros((0,))],
        "no_items": [],
    }
    out = roundtrip(tensors)
    assert out["text"].dtype.kind == "U" and out["text"].tolist() == [["héllo", ""], ["🙂", "x" * 1000]]
    assert out["objects"].tolist() == ["a", "bc"] and out["objects"].dtype.kind == "U"
    assert out["scalar"].shape == () and out["scalar"] == np.float32(3.5)
    assert out["empty"].shape == (0, 7) and out["empty"].dtype == np.int64
    assert out["empty_text"].shape == (0, 2)
    np.testing.assert_array_equal(out["strided"], base[:, ::2])
    np.testing.assert_array_equal(out["transposed"], base.T)
    assert isinstance(out["nested"], list) and len(out["nested"]) == 3
    np.testing.assert_array_equal(out["nested"][0], [1, 2])
    assert out["nested"][1].tolist() == ["a"]
    assert out["no_items"] == []


def test_decoded_arrays_are_views_over_the_frames() -> None:
    frame = bytearray(DOC_INFER_DATA)
    entries = (TensorEntry(name="x", datatype="FP32", shape=(1, 2), size=8),)
    out = decode_tensors(entries, [memoryview(frame)], limits=DEFAULT_LIMITS, peer=None, copy_shared=False)[0]["x"]
    frame[0:4] = struct.pack("<f", 9.0)
    assert out[0, 0] == 9.0  # no copy was made


def test_wire_types_map_to_carton_dtypes() -> None:
    assert carton_dtype(WireType.FP32) is DType.FLOAT32
    assert carton_dtype(WireType.BYTES) is DType.STRING
    assert carton_dtype(WireType.BOOL) is None
    assert from_numpy(np.dtype(">f8"), tensor="t") is WireType.FP64


# --- what the encoder refuses -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("value", "message"),
    [
        (np.zeros(2, dtype=np.complex64), "'bad': numpy dtype complex64 has no wire type"),
        (np.array(["a"], dtype="S1"), "'bad': numpy dtype |S1 has no wire type"),
        (np.array([b"a"], dtype=object), "'bad': string tensors must hold str, not bytes"),
        (np.array([1, "a"], dtype=object), "'bad': string tensor holds a int"),
        ([1, 2], "'bad[0]': expected a numpy array, got int"),
        ("text", "'bad': expected a numpy array, got str"),
    ],
)
def test_encoder_names_the_tensor_it_cannot_send(value: Any, message: str) -> None:
    with pytest.raises(FrameError, match=message.replace("[", r"\[").replace("]", r"\]").replace("|", r"\|")):
        encode_tensors({"bad": value}, pool=None, threshold=1 << 62)


# --- what the decoder refuses -------------------------------------------------------------------------------------
FOUR = b"\x00" * 8


@pytest.mark.parametrize(
    ("entries", "frames", "error", "message"),
    [
        ("nope", [], FrameError, r"Expected `array`, got `str` - at `\$.tensors`"),
        ([7], [], FrameError, r"Expected `object`, got `int` - at `\$.tensors\[0\]`"),
        ([{"datatype": "FP32"}], [], FrameError, r"'name' must be a non-empty string"),
        ([entry(), entry()], [FOUR, FOUR], FrameError, "'x' appears twice"),
        ([entry(datatype="FP128")], [FOUR], FrameError, "'x': unknown datatype 'FP128'"),
        # Found by fuzz/fuzz_wire.py: an unhashable datatype once escaped as TypeError.
        ([{**entry(), "datatype": ["UINT8"]}], [FOUR], FrameError, r"got `array` - at `\$.tensors\[0\].datatype`"),
        ([{**entry(), "datatype": None}], [FOUR], FrameError, "'x': 'datatype' is missing"),
        ([{**entry(), "shape": "12"}], [FOUR], FrameError, r"got `str` - at `\$.tensors\[0\].shape`"),
        ([entry(shape=(1, -2))], [FOUR], FrameError, r"must hold ints from 0 to 2\*\*62"),
        ([entry(shape=(1, 2.0))], [FOUR], FrameError, r"Expected `int`, got `float` - at `\$.tensors\[0\].shape\[1\]`"),
        ([entry(shape=(0, 1 << 63), size=0)], [b""], FrameError, r"must hold ints from 0 to 2\*\*62"),
        ([entry(shape=(0, 1 << 62, 1 << 62), size=0)], [b""], FrameError, "too large for a numpy array"),
        ([entry("s", "BYTES", (0, 1 << 62, 1 << 62), 0)], [b""], FrameError, "too large for a numpy array"),
        ([entry(shape=(1,) * 33)], [FOUR], LimitExceeded, "rank 33 is over the limit of 32"),
        ([entry(size=-1)], [FOUR], FrameError, "'size' must be a non-negative int"),
        ([entry(size=12)], [FOUR], FrameError, r"shape \[1, 2\] of FP32 needs 8 bytes, size says 12"),
        ([entry()], [], FrameError, "data frame is missing"),
        ([entry()], [b"\x00" * 4], FrameError, "data frame is 4 bytes, header says 8"),
        ([entry()], [FOUR, FOUR], FrameError, "2 data frames, the header accounts for 1"),
        # 2**62 * 2**62 elements: the product is exact (Python ints), so it cannot wrap around to a small size.
        ([entry(shape=(1 << 62, 1 << 62), size=0)], [b""], FrameError, "needs .* bytes, size says 0"),
        ([entry(size=1 << 41, shape=(1 << 39,))], [b""], LimitExceeded, "over the limit of"),
        ([entry(datatype="BOOL", shape=(2,), size=2)], [b"\x01\x02"], FrameError, "BOOL bytes must be 0 or 1"),
        (
            [{"name": "x", "datatype": "FP32", "shape": [2], "size": 8, "shm": ["h0", 0]}],
            [],
            FrameError,
            "placed in shared memory, which this connection does not use",
        ),
        ([{"name": "n", "nested": "x"}], [], FrameError, r"got `str` - at `\$.tensors\[0\].nested`"),
        ([{"name": "n", "nested": [{"nested": []}]}], [], FrameError, "nested entries must not be nested"),
        ([{**entry(), "shm": ["h0", -1]}], [], FrameError, "placed in shared memory"),
        ([{**entry(), "shm": ["h0"]}], [], FrameError, r"`array` of length 2, got 1 - at `\$.tensors\[0\].shm`"),
    ],
)
def test_decoder_refuses(entries: Any, frames: list[bytes], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        decode(entries, frames)


@pytest.mark.parametrize(
    ("payload", "count", "message"),
    [
        (b"\x05\x00\x00\x00abc", 1, "declares 5 bytes, 3 remain"),
        (b"\x01\x00\x00\x00a\x00", 1, "1 bytes left over after 1 BYTES elements"),
        (b"\x01\x00\x00\x00\xff" + b"\x00" * 4, 2, "element 0 is not valid utf-8"),
        (b"\x00\x00\x00\x00\x00\x00", 2, "6 bytes cannot hold 2 length-prefixed elements"),
        (b"\xff\xff\xff\xff" + b"\x00" * 4, 2, r"element 0 declares 4294967295 bytes"),
    ],
)
def test_bytes_prefixes_are_checked_against_the_frame(payload: bytes, count: int, message: str) -> None:
    with pytest.raises(FrameError, match=message):
        decode([entry("s", "BYTES", (count,), len(payload))], [payload])


def test_zero_length_prefixes_cannot_become_millions_of_strings() -> None:
    payload = b"\x00" * (16 << 20)  # 4 Mi empty strings if it were believed
    with pytest.raises(LimitExceeded, match=r"4194304 BYTES elements, over the limit of 1048576"):
        decode([entry("s", "BYTES", (len(payload) // 4,), len(payload))], [payload])


def test_counts_and_names_are_limited() -> None:
    tight = WireLimits(max_tensors=2, max_nested=1, max_name_length=4, max_message_bytes=10)
    with pytest.raises(LimitExceeded, match="3 tensors, over the limit of 2"):
        decode([entry(str(i)) for i in range(3)], [FOUR] * 3, tight)
    with pytest.raises(LimitExceeded, match="2 nested arrays, over the limit of 1"):
        decode([{"name": "n", "nested": [entry(), entry()]}], [FOUR] * 2, tight)
    with pytest.raises(FrameError, match="at most 4 characters"):
        decode([entry("toolong")], [FOUR], tight)
    with pytest.raises(LimitExceeded, match="total over 10 bytes"):
        decode([entry("a"), entry("b")], [FOUR, FOUR], tight)


# --- control headers ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("data", "error", "message"),
    [
        (b"", FrameError, "not valid msgpack"),
        (b"\xc1", FrameError, "not valid msgpack"),
        (msgspec.msgpack.encode([1, 2]), FrameError, "Expected `object`, got `array`"),
        (msgspec.msgpack.encode({"op": "close", "id": 1}) + b"\x00", FrameError, "not valid msgpack"),
        (msgspec.msgpack.encode({1: 2}), FrameError, "Expected `str`, got `int`"),
        # Found by test_wire_properties.py: a key that is not utf-8 once escaped as UnicodeDecodeError.
        (b"\x81\xa2op\xa2\xe9\x80", FrameError, r"not valid msgpack: .*(?i:utf-8)"),
        (msgspec.msgpack.encode({"id": 1}), FrameError, "missing required field `op`"),
        (msgspec.msgpack.encode({"op": "dance", "id": 1}), FrameError, r"Invalid value 'dance' - at `\$.op`"),
        (msgspec.msgpack.encode({"op": "close", "id": True}), FrameError, r"Expected `int`, got `bool` - at `\$.id`"),
        pytest.param(b"\x91" * 100_000, FrameError, "Expected `object`, got `array`", id="deep-array"),
        # Nesting deeper than any stack, where any value may be: refused, not a RecursionError.
        pytest.param(
            b"\x84\xa2op\xa4load\xa2id\x01\xa9model_dir\xa1/\xa4opts\x81\xa1a" + b"\x91" * 100_000 + b"\x01",
            FrameError,
            "not valid msgpack: maximum recursion depth",
            id="deep-option",
        ),
        (b"\xdd\xff\xff\xff\xff", FrameError, "Expected `object`, got `array`"),  # a 4-Gi-element array in 5 bytes
        pytest.param(b"\x80" * ((1 << 20) + 1), LimitExceeded, "over the 1048576-byte limit", id="too-large"),
    ],
)
def test_header_refusals(data: bytes, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        decode_request(data, DEFAULT_LIMITS)


def test_specs_and_opts_round_trip_and_refusals() -> None:
    specs = (
        TensorSpec(name="x", dtype=DType.FLOAT32, shape=("batch", 3), description="in"),
        TensorSpec(name="y", dtype=DType.STRING, shape="*", internal_name="out:0"),
        TensorSpec(name="z", dtype=DType.INT8, shape=()),
    )
    opts = {"a": 1, "b": [1.5, "x", True], "c": {"d": {"e": "f"}}}
    load = Load(id=2, model_dir="/m", opts=opts, inputs=specs)
    decoded = decode_request(encode(load), DEFAULT_LIMITS)
    assert decoded == load and isinstance(decoded, Load) and decoded.inputs == specs

    def load_with(inputs: list[Any], opts: Any = None) -> bytes:
        return msgspec.msgpack.encode({"op": "load", "id": 2, "model_dir": "/m", "opts": opts or {}, "inputs": inputs})

    with pytest.raises(FrameError, match=r"Invalid enum value 'complex' - at `\$.inputs\[0\].dtype`"):
        decode_request(load_with([{"name": "x", "dtype": "complex", "shape": "*"}]), DEFAULT_LIMITS)
    with pytest.raises(FrameError, match=r"missing required field `name` - at `\$.inputs\[0\]`"):
        decode_request(load_with([{"dtype": "float32"}]), DEFAULT_LIMITS)
    with pytest.raises(LimitExceeded, match=r"inputs\[0\] \('x'\): rank 33 over 32"):
        check_specs((TensorSpec(name="x", dtype=DType.INT8, shape=(1,) * 33),), "inputs", DEFAULT_LIMITS)
    with pytest.raises(LimitExceeded, match="3 tensor specs, over the limit of 2"):
        check_specs(specs, "inputs", WireLimits(max_tensors=2))
    assert check_opts(opts, "opts") == opts
    with pytest.raises(FrameError, match=r"opts.a: a runner option cannot be a NoneType"):
        check_opts({"a": None}, "opts")
    with pytest.raises(FrameError, match=r"opts.b\[0\]: a runner option cannot be a bytes"):
        check_opts({"b": [b"x"]}, "opts")
    raw = decode_request(load_with([], {"x": msgspec.msgpack.Ext(1, b"a")}), DEFAULT_LIMITS)
    assert isinstance(raw, Load)
    with pytest.raises(FrameError, match=r"opts.x: a runner option cannot be a Ext"):
        check_opts(raw.opts, "opts")
    deep: Any = "leaf"
    for _ in range(40):
        deep = [deep]
    with pytest.raises(LimitExceeded, match="nested deeper than 32"):
        check_opts({"deep": deep}, "opts")
