"""The runner codec's last-layout shortcuts: the same answers as the templates' lookup, byte for byte."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import zmq
from carton_protocol import Infer, InferReply
from carton_protocol._codec import HostCodec, RunnerCodec
from carton_protocol._framing import encode_tensors
from carton_protocol._messages import encode
from carton_protocol._templates import REQUEST_PREFIX, pack_id
from hypothesis import given, settings
from hypothesis import strategies as st

IDS = [0, 1, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**40]
X = np.arange(16, dtype=np.float32).reshape(1, 16)


def _request(request_id: int, tensors: dict[str, Any]) -> bytes:
    return encode(Infer(id=request_id, tensors=encode_tensors(tensors, pool=None, threshold=1 << 62).entries))


def _learned_codec(tensors: dict[str, Any]) -> RunnerCodec:
    """A runner codec that has read one request carrying `tensors` the full way (and so learnt its layout)."""
    codec = RunnerCodec(channel=None)
    host = HostCodec(shm_threshold=None)
    parts = host.encode_tensors(1, tensors).parts
    received = codec.decode([zmq.Frame(parts[0]), *(zmq.Frame(bytes(memoryview(part))) for part in parts[1:])])
    codec.tensors(received)
    return codec


@pytest.mark.parametrize("first", [5, 300, 70000])
def test_a_request_in_the_last_layout_matches_with_its_id_whatever_the_id_length(first: int) -> None:
    codec = _learned_codec({"x": X})
    matched = codec.match(zmq.Frame(_request(first, {"x": X})))
    assert matched is not None and matched[0] == first
    for request_id in IDS:
        again = codec.match(zmq.Frame(_request(request_id, {"x": X})))
        assert again is not None and again[0] == request_id and again[1] is matched[1]
        assert again[1].decode([zmq.Frame(X.tobytes())])["x"].tolist() == X.tolist()  # type: ignore[union-attr]


def test_a_request_in_another_layout_never_takes_the_last_ones_plan() -> None:
    codec = _learned_codec({"x": X})
    assert codec.match(zmq.Frame(_request(3, {"x": X}))) is not None
    for other in (
        _request(3, {"x": X.reshape(16, 1)}),
        _request(3, {"y": X}),
        _request(3, {"x": X.astype(np.float64)}),
        _request(3, {"x": X, "y": X}),
        encode(InferReply(id=3, tensors=encode_tensors({"x": X}, pool=None, threshold=1 << 62).entries)),
        _request(3, {"x": X}) + b"\x00",
    ):
        assert codec.match(zmq.Frame(other)) is None


@settings(max_examples=300, deadline=None)
@given(request_id=st.sampled_from(IDS), position=st.integers(min_value=0), value=st.integers(0, 255))
def test_a_mutated_request_matches_only_as_the_templates_would_match_it(
    request_id: int, position: int, value: int
) -> None:
    codec = _learned_codec({"x": X})
    assert codec.match(zmq.Frame(_request(request_id, {"x": X}))) is not None  # the last layout is set
    data = bytearray(_request(request_id, {"x": X}))
    data[position % len(data)] = value
    matched = codec.match(zmq.Frame(bytes(data)))
    expected = _learned_codec({"x": X})._templates.match(bytes(data))
    assert (matched is None) == (expected is None)
    if matched is not None and expected is not None:
        assert matched[0] == expected[0]
        assert bytes(data).startswith(REQUEST_PREFIX)


@pytest.mark.parametrize("request_id", IDS)
def test_replies_in_the_last_layout_are_the_bytes_of_the_full_encoder(request_id: int) -> None:
    codec = RunnerCodec(channel=None)
    outputs = {"y": X, "mask": np.array([True, False]), "n": np.zeros((), np.int64)}
    expected = encode(InferReply(id=request_id, tensors=encode_tensors(outputs, pool=None, threshold=1 << 62).entries))
    for _ in range(3):  # learning, the templates' lookup, then the last layout
        parts = codec.reply(request_id, outputs)
        assert parts[0] == expected
        assert parts[1:] == list(outputs.values())


@pytest.mark.parametrize(
    "changed",
    [
        {"y": X.reshape(16, 1)},  # another shape
        {"z": X},  # another name
        {"y": X.astype(np.float64)},  # another dtype
        {"y": X.astype(">f4")},  # another byte order: the full encoder converts it
        {"y": np.ones((4, 8), np.float32)[:, ::2]},  # not contiguous
        {"y": X, "z": X},  # another count
        {"y": [X]},  # nested
    ],
)
@pytest.mark.parametrize("last", [{"y": X}, {"y": X, "w": X}, {"w": X, "y": X}])  # one output, or several
def test_a_reply_in_another_layout_is_encoded_as_the_full_encoder_encodes_it(
    changed: dict[str, Any], last: dict[str, Any]
) -> None:
    codec = RunnerCodec(channel=None)
    for _ in range(2):
        codec.reply(7, last)
    parts = codec.reply(300, changed)
    encoded = encode_tensors(changed, pool=None, threshold=1 << 62)
    assert parts[0] == encode(InferReply(id=300, tensors=encoded.entries))
    assert len(parts) == 1 + len(encoded.frames)


@settings(max_examples=300, deadline=None)
@given(
    request_id=st.sampled_from(IDS),
    other=st.sampled_from(IDS),
    position=st.integers(min_value=0),
    value=st.integers(0, 255),
    mutate=st.booleans(),
)
def test_what_the_learnt_request_accepts_the_templates_read_alike(
    request_id: int, other: int, position: int, value: int, mutate: bool
) -> None:
    # The runner loop's own match (`RunnerCodec.learnt_request`): a header of the learnt length, head and tail must
    # be one the templates match, with the same id; a header of the same layout and id width must be accepted.
    codec = _learned_codec({"x": X})
    data = _request(request_id, {"x": X})
    assert codec.match(zmq.Frame(data)) is not None
    learnt = codec.learnt_request(data)
    if request_id < 128:
        assert learnt is None  # one-byte ids take the general path
        return
    assert learnt is not None
    length, head, tail, read_id, offset, name, dtype, shape, size = learnt
    assert (name, dtype, shape, size) == ("x", X.dtype, X.shape, X.nbytes)
    candidate = bytearray(_request(other, {"x": X}))
    if mutate:
        candidate[position % len(candidate)] = value
    header = bytes(candidate)
    accepted = len(header) == length and header.startswith(head) and header.endswith(tail)
    expected = _learned_codec({"x": X})._templates.match(header)
    if accepted:
        assert expected is not None and expected[0] == read_id(header, offset)[0]
    if not mutate:
        assert accepted == (len(pack_id(other)) == len(pack_id(request_id)))
