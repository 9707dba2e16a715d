"""Header templates: the same bytes as the full encoder, and the data checks still made on every cached decode."""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np
import pytest
import zmq
from carton_protocol import FrameError, Infer, InferReply
from carton_protocol._framing import decode_tensors, encode_tensors
from carton_protocol._limits import DEFAULT_LIMITS, WireLimits
from carton_protocol._messages import decode_request, encode
from carton_protocol._templates import REQUEST_PREFIX, Templates, pack_id
from hypothesis import given, settings
from hypothesis import strategies as st

IDS = [0, 1, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**40]


@pytest.mark.parametrize("value", IDS)
def test_ids_are_packed_as_msgpack_packs_them(value: int) -> None:
    assert pack_id(value) == msgspec.msgpack.encode(value)


@pytest.mark.parametrize("request_id", IDS)
def test_template_headers_are_the_bytes_of_the_full_encoder(request_id: int) -> None:
    tensors = {"x": np.ones((1, 16), np.float32), "mask": np.array([True, False]), "n": np.zeros((), np.int64)}
    encoded = encode_tensors(tensors, pool=None, threshold=1 << 62)
    host, runner = Templates(limits=DEFAULT_LIMITS, sends=Infer), Templates(limits=DEFAULT_LIMITS, sends=InferReply)
    for templates, message in (
        (host, Infer(id=request_id, tensors=encoded.entries)),
        (runner, InferReply(id=request_id, tensors=encoded.entries)),
    ):
        for _ in range(2):  # learning, then cached
            parts = templates.encode(request_id, tensors, 1 << 62)
            assert parts is not None
            assert parts[0] == encode(message)
            assert parts[1:] == list(tensors.values())


@pytest.mark.parametrize("request_id", IDS)
def test_a_layout_key_gives_the_same_bytes_as_the_layout(request_id: int) -> None:
    """A caller's key for the layout (the host's input check entry) only changes what the cache is looked up by:
    byte for byte the message the layout itself gives, learning or cached; a key never stands in for the checks
    that depend on the arrays (a non-contiguous array, or one at the threshold, still misses)."""
    tensors = {"x": np.ones((1, 16), np.float32), "mask": np.array([True, False]), "n": np.zeros((), np.int64)}
    expected = encode(Infer(id=request_id, tensors=encode_tensors(tensors, pool=None, threshold=1 << 62).entries))
    templates, key = Templates(limits=DEFAULT_LIMITS, sends=Infer), object()
    for _ in range(2):  # learning, then cached
        parts = templates.encode(request_id, tensors, 1 << 62, key)
        assert parts is not None
        assert parts[0] == expected
        assert parts[1:] == list(tensors.values())
    assert templates.encode(request_id, tensors, 65, key) == [expected, *tensors.values()]
    assert templates.encode(request_id, tensors, 64, key) is None  # "x" is 64 bytes: shared memory's
    strided = {"x": np.ones((1, 32), np.float32)[:, ::2], "mask": tensors["mask"], "n": tensors["n"]}
    assert templates.encode(request_id, strided, 1 << 62, key) is None


def test_the_documented_infer_request_comes_out_of_the_template() -> None:
    templates = Templates(limits=DEFAULT_LIMITS, sends=Infer)
    parts = templates.encode(3, {"x": np.array([[1.0, 2.0]], np.float32)}, 1 << 62)
    assert parts is not None
    assert parts[0].hex(" ") == (
        "83 a2 6f 70 a5 69 6e 66 65 72 a2 69 64 03 a7 74 65 6e 73 6f 72 73 91 84 a4 6e 61 6d 65 a1 78 a8 "
        "64 61 74 61 74 79 70 65 a4 46 50 33 32 a5 73 68 61 70 65 92 01 02 a4 73 69 7a 65 08"
    )


@pytest.mark.parametrize(
    "tensors",
    [
        {"s": np.array(["a"])},  # strings: data-dependent size
        {"x": np.ones((4, 4), np.float32)[:, ::2]},  # not contiguous
        {"x": np.ones(2, ">f4")},  # big-endian: converted by the full encoder
        {"n": [np.ones(2)]},  # nested
        {"x": np.ones(2, np.complex64)},  # not carried at all: the full encoder names it
        {"x": np.ones(64, np.uint8)},  # at the shared-memory threshold below
    ],
)
def test_what_the_template_does_not_cover_takes_the_full_encoder(tensors: dict[str, Any]) -> None:
    templates = Templates(limits=DEFAULT_LIMITS, sends=Infer)
    assert templates.encode(1, tensors, 64) is None
    assert templates.encode(2, tensors, 64) is None


def frames(*payloads: bytes) -> list[zmq.Frame]:
    """Data frames as a socket delivers them."""
    return [zmq.Frame(payload) for payload in payloads]


def pack(header: dict[str, Any]) -> bytes:
    return msgspec.msgpack.encode(header)


def _learned(templates: Templates, header: dict[str, Any], frames: list[bytes]) -> bytes:
    data = pack(header)
    decoded = decode_request(data, DEFAULT_LIMITS)
    assert isinstance(decoded, Infer)
    decode_tensors(
        decoded.tensors, [memoryview(f) for f in frames], limits=DEFAULT_LIMITS, peer=None, copy_shared=False
    )
    templates.learn(data, decoded)
    return data


ENTRY = {"name": "x", "datatype": "FP32", "shape": [1, 2], "size": 8}
BOOL_ENTRY = {"name": "b", "datatype": "BOOL", "shape": [3], "size": 3}


def test_a_learned_header_matches_only_identical_bytes_and_data_is_still_checked() -> None:
    runner = Templates(limits=DEFAULT_LIMITS, sends=InferReply)  # reads requests
    data = _learned(runner, {"op": "infer", "id": 7, "tensors": [ENTRY, BOOL_ENTRY]}, [bytes(8), bytes(3)])
    matched = runner.match(data)
    assert matched is not None and matched[0] == 7
    plan = matched[1]
    other_id = pack({"op": "infer", "id": 70000, "tensors": [ENTRY, BOOL_ENTRY]})
    assert runner.match(other_id) is not None and runner.match(other_id)[0] == 70000  # type: ignore[index]
    data_frames = frames(b"\x00\x00\x80\x3f\x00\x00\x00\x40", b"\x01\x00\x01")
    outputs = plan.decode(data_frames)
    assert outputs["x"].tolist() == [[1.0, 2.0]]  # type: ignore[union-attr]
    assert outputs["b"].tolist() == [True, False, True]  # type: ignore[union-attr]
    # Writable views over the frames themselves, not copies: a runner may work in place on its inputs.
    x = outputs["x"]
    assert isinstance(x, np.ndarray) and x.flags.writeable and not x.flags.owndata
    x[0, 0] = 3.0
    assert data_frames[0].bytes[:4] == b"\x00\x00\x40\x40"
    with pytest.raises(FrameError, match="message has 1 data frames, the header accounts for 2"):
        plan.decode(frames(bytes(8)))
    with pytest.raises(FrameError, match="'x': data frame is 9 bytes, header says 8"):
        plan.decode(frames(bytes(9), bytes(3)))
    with pytest.raises(FrameError, match="'b': BOOL bytes must be 0 or 1"):
        plan.decode(frames(bytes(8), b"\x00\x02\x00"))
    for changed in (
        data.replace(b"\x92\x01\x02", b"\x92\x02\x01"),  # another shape
        data + b"\x00",  # trailing bytes
        data[:-1],  # truncated
        pack({"op": "infer", "id": 7, "drop": ["r1"], "tensors": [ENTRY, BOOL_ENTRY]}),
        pack({"op": "infer", "id": -1, "tensors": [ENTRY, BOOL_ENTRY]}),
        pack({"reply": "infer", "id": 7, "tensors": [ENTRY, BOOL_ENTRY]}),  # a reply, not a request
    ):
        assert runner.match(changed) is None


@pytest.mark.parametrize(
    ("entry", "payload"),
    [
        (ENTRY, b"\x00\x00\x80\x3f\x00\x00\x00\x40"),
        (BOOL_ENTRY, b"\x01\x00\x01"),
        ({"name": "e", "datatype": "INT64", "shape": [0, 4], "size": 0}, b""),
        ({"name": "s", "datatype": "UINT8", "shape": [], "size": 1}, b"\x07"),
    ],
)
def test_a_one_tensor_plan_reads_and_refuses_what_the_full_decoder_does(entry: dict[str, Any], payload: bytes) -> None:
    # One tensor takes a shorter path through `Plan.decode` (not for BOOL or empty ones): same arrays, same errors.
    runner = Templates(limits=DEFAULT_LIMITS, sends=InferReply)
    data = _learned(runner, {"op": "infer", "id": 300, "tensors": [entry]}, [payload])
    matched = runner.match(data)
    assert matched is not None and matched[0] == 300
    decoded = decode_request(data, DEFAULT_LIMITS)
    assert isinstance(decoded, Infer)
    data_frames = frames(payload)
    expected, _ = decode_tensors(
        decoded.tensors, [memoryview(payload)], limits=DEFAULT_LIMITS, peer=None, copy_shared=False
    )
    outputs = matched[1].decode(data_frames)
    name = entry["name"]
    array = outputs[name]
    assert list(outputs) == [name] and isinstance(array, np.ndarray)
    assert array.dtype == expected[name].dtype and array.shape == expected[name].shape  # type: ignore[union-attr]
    assert array.tobytes() == expected[name].tobytes()  # type: ignore[union-attr]
    if payload:  # a writable view over the frame itself
        assert array.flags.writeable and not array.flags.owndata
    size = entry["size"]
    with pytest.raises(FrameError, match="message has 2 data frames, the header accounts for 1"):
        matched[1].decode(frames(payload, payload))
    with pytest.raises(FrameError, match="message has 0 data frames, the header accounts for 1"):
        matched[1].decode([])
    with pytest.raises(FrameError, match=f"{name!r}: data frame is {size + 1} bytes, header says {size}"):
        matched[1].decode(frames(payload + b"\x00"))
    if entry is BOOL_ENTRY:
        with pytest.raises(FrameError, match="BOOL bytes must be 0 or 1"):
            matched[1].decode(frames(b"\x00\x02\x00"))


@pytest.mark.parametrize(
    "header",
    [
        {"op": "infer", "id": 1, "tensors": [{**ENTRY, "shm": ["h0", 0]}]},
        {"op": "infer", "id": 1, "drop": ["h1"], "tensors": [ENTRY]},
        {"op": "infer", "id": 1, "tensors": [ENTRY], "later": "a field from a newer host"},
        {"op": "infer", "id": 1, "tensors": [{"name": "s", "datatype": "BYTES", "shape": [1], "size": 5}]},
        {"op": "infer", "id": 1, "tensors": [{"name": "n", "nested": [{"datatype": "FP32", "shape": [2], "size": 8}]}]},
        {"id": 1, "op": "infer", "tensors": [ENTRY]},  # same map, other key order: other bytes
    ],
)
def test_only_plain_frame_tensors_are_learned(header: dict[str, Any]) -> None:
    runner = Templates(limits=DEFAULT_LIMITS, sends=InferReply)
    data = pack(header)
    message = decode_request(data, DEFAULT_LIMITS)
    assert isinstance(message, Infer)
    runner.learn(data, message)
    assert runner.match(data) is None


def test_a_header_near_the_size_limit_is_not_cached() -> None:
    header = {"op": "infer", "id": 1, "tensors": [ENTRY]}
    data = pack(header)
    runner = Templates(limits=WireLimits(max_header_bytes=len(data) + 3), sends=InferReply)
    message = decode_request(data, DEFAULT_LIMITS)
    assert isinstance(message, Infer)
    runner.learn(data, message)
    assert runner.match(data) is None  # a longer id could push the same tail over the limit


@settings(max_examples=200, deadline=None)
@given(position=st.integers(min_value=0), value=st.integers(min_value=0, max_value=255))
def test_a_mutated_header_never_matches_a_plan_it_does_not_equal(position: int, value: int) -> None:
    runner = Templates(limits=DEFAULT_LIMITS, sends=InferReply)
    data = _learned(runner, {"op": "infer", "id": 5, "tensors": [ENTRY]}, [bytes(8)])
    mutated = bytearray(data)
    mutated[position % len(data)] = value
    matched = runner.match(bytes(mutated))
    if bytes(mutated) != data and matched is not None:
        # Only the id may differ: the bytes after it are the learned ones.
        assert bytes(mutated)[len(REQUEST_PREFIX) + 1 :] == data[len(REQUEST_PREFIX) + 1 :]
        assert matched[0] == mutated[len(REQUEST_PREFIX)]
