"""Hypothesis properties of the wire decoder: valid messages round-trip; corrupt ones fail with a protocol error.

The decoder's contract is that nothing a peer sends makes it raise anything but `carton_protocol.ProtocolError`
(and that it allocates nothing the limits did not allow first). `fuzz/fuzz_wire.py` runs the same check unguided.
"""

from __future__ import annotations

import contextlib
from typing import Any

import msgspec
import numpy as np
from carton_protocol import Infer, ProtocolError
from carton_protocol._framing import decode_tensors, encode_tensors
from carton_protocol._limits import WireLimits
from carton_protocol._messages import decode_request
from carton_protocol._messages import encode as encode_message
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

LIMITS = WireLimits(max_bytes_elements=4096, max_tensor_bytes=1 << 20, max_message_bytes=1 << 22)
FIXED = [
    np.bool_,
    np.uint8,
    np.uint16,
    np.uint32,
    np.uint64,
    np.int8,
    np.int16,
    np.int32,
    np.int64,
    np.float16,
    np.float32,
    np.float64,
]

arrays = st.one_of(
    hnp.arrays(st.sampled_from(FIXED), hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=5)),
    hnp.arrays(
        np.dtype("U8"),
        hnp.array_shapes(min_dims=0, max_dims=2, min_side=0, max_side=4),
        elements=st.text(max_size=8).filter(lambda text: "\x00" not in text),
    ),
)
tensor_maps = st.dictionaries(
    st.text(min_size=1, max_size=10), st.one_of(arrays, st.lists(arrays, max_size=3)), max_size=4
)


def as_bytes(frame: Any) -> bytes:
    return bytes(frame) if isinstance(frame, bytes) else np.ascontiguousarray(frame).tobytes()


def encode(tensors: dict[str, Any]) -> tuple[bytes, list[bytes]]:
    encoded = encode_tensors(tensors, pool=None, threshold=1 << 62)
    return encode_message(Infer(id=1, tensors=encoded.entries)), [as_bytes(frame) for frame in encoded.frames]


def decode(header: bytes, frames: list[bytes]) -> dict[str, Any]:
    message = decode_request(header, LIMITS)
    if not isinstance(message, Infer):
        return {}  # a corrupted tag that names another request: decoded, nothing more to read
    return decode_tensors(
        message.tensors, [memoryview(frame) for frame in frames], limits=LIMITS, peer=None, copy_shared=False
    )[0]


def same(left: Any, right: Any) -> bool:
    if isinstance(left, list):
        return isinstance(right, list) and len(left) == len(right) and all(map(same, left, right))
    return bool(
        left.dtype.kind == right.dtype.kind
        and left.shape == right.shape
        and np.array_equal(left, right, equal_nan=left.dtype.kind == "f")
    )


@given(tensor_maps)
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_valid_messages_round_trip(tensors: dict[str, Any]) -> None:
    decoded = decode(*encode(tensors))
    assert decoded.keys() == tensors.keys()
    assert all(same(tensors[name], decoded[name]) for name in tensors)


@given(tensor_maps, st.data())
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_corrupted_messages_fail_only_with_protocol_errors(tensors: dict[str, Any], data: st.DataObject) -> None:
    header, frames = encode(tensors)
    parts = [header, *frames]
    index = data.draw(st.integers(0, len(parts) - 1), label="part")
    part = bytearray(parts[index])
    action = data.draw(st.sampled_from(["flip", "truncate", "extend", "drop_frame", "add_frame"]), label="action")
    if action == "flip" and part:
        position = data.draw(st.integers(0, len(part) - 1))
        part[position] ^= data.draw(st.integers(1, 255))
    elif action == "truncate":
        del part[data.draw(st.integers(0, len(part))) :]
    elif action == "extend":
        part += data.draw(st.binary(min_size=1, max_size=16))
    parts[index] = bytes(part)
    if action == "drop_frame" and len(parts) > 1:
        del parts[-1]
    elif action == "add_frame":
        parts.append(data.draw(st.binary(max_size=16)))
    with contextlib.suppress(ProtocolError):
        decode(parts[0], parts[1:])


# Any value a peer could put in a header (msgpack can hold more than carton ever sends).
msgpack_values = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(1 << 63), (1 << 64) - 1),
        st.floats(),
        st.text(max_size=6),
        st.binary(max_size=6),
        st.sampled_from(["FP32", "BYTES", "BOOL", "name", "shape", "size", "nested"]),
    ),
    lambda children: st.one_of(
        st.lists(children, max_size=4), st.dictionaries(st.text(max_size=8), children, max_size=5)
    ),
    max_leaves=20,
)
entries = st.lists(
    st.fixed_dictionaries(
        {},
        optional={
            "name": st.one_of(st.text(max_size=4), msgpack_values),
            "datatype": st.one_of(st.sampled_from(["FP32", "BYTES", "BOOL", "INT64", "BF16"]), msgpack_values),
            "shape": st.one_of(st.lists(st.integers(-2, (1 << 64) - 1), max_size=4), msgpack_values),
            "size": st.one_of(st.integers(-2, (1 << 64) - 1), msgpack_values),
            "nested": msgpack_values,
            "shm": msgpack_values,
        },
    ),
    max_size=4,
)


@given(st.one_of(entries, msgpack_values), st.lists(st.binary(max_size=64), max_size=4))
@settings(max_examples=400, deadline=None)
def test_arbitrary_headers_fail_only_with_protocol_errors(tensors: Any, frames: list[bytes]) -> None:
    header = msgspec.msgpack.encode({"op": "infer", "id": 1, "tensors": tensors})
    with contextlib.suppress(ProtocolError):
        decode(header, frames)


@given(st.binary(max_size=256))
@settings(max_examples=300, deadline=None)
def test_arbitrary_header_bytes_fail_only_with_protocol_errors(header: bytes) -> None:
    with contextlib.suppress(ProtocolError):
        decode(header, [])
