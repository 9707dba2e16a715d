"""Header templates: the same bytes as the full encoder, and the data checks still made on every cached decode."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from carton_protocol import FrameError
from carton_protocol._framing import decode_tensors, encode_tensors
from carton_protocol._limits import DEFAULT_LIMITS, WireLimits
from carton_protocol._messages import pack_header, unpack_header
from carton_protocol._templates import Templates, pack_id
from hypothesis import given, settings
from hypothesis import strategies as st

IDS = [0, 1, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**40]


@pytest.mark.parametrize("value", IDS)
def test_ids_are_packed_as_msgpack_packs_them(value: int) -> None:
    assert pack_id(value) == pack_header({"v": value})[len(b"\x81\xa1v") :]


@pytest.mark.parametrize("request_id", IDS)
def test_template_headers_are_the_bytes_of_the_full_encoder(request_id: int) -> None:
    tensors = {"x": np.ones((1, 16), np.float32), "mask": np.array([True, False]), "n": np.zeros((), np.int64)}
    encoded = encode_tensors(tensors, pool=None, threshold=1 << 62)
    host, runner = Templates(limits=DEFAULT_LIMITS, sends="request"), Templates(limits=DEFAULT_LIMITS, sends="reply")
    for templates, header in (
        (host, {"op": "infer", "id": request_id, "tensors": encoded.entries}),
        (runner, {"id": request_id, "ok": True, "tensors": encoded.entries}),
    ):
        for _ in range(2):  # learning, then cached
            template = templates.encode(tensors, 1 << 62)
            assert template is not None
            tail, frames = template
            assert templates.header(request_id, tail) == pack_header(header)
            assert frames == list(tensors.values())


def test_the_documented_infer_request_comes_out_of_the_template() -> None:
    templates = Templates(limits=DEFAULT_LIMITS, sends="request")
    template = templates.encode({"x": np.array([[1.0, 2.0]], np.float32)}, 1 << 62)
    assert template is not None
    assert templates.header(3, template[0]).hex(" ") == (
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
    templates = Templates(limits=DEFAULT_LIMITS, sends="request")
    assert templates.encode(tensors, 64) is None
    assert templates.encode(tensors, 64) is None


def _learned(templates: Templates, header: dict[str, Any], frames: list[bytes]) -> bytes:
    data = pack_header(header)
    decoded = unpack_header(data, DEFAULT_LIMITS)
    decode_tensors(decoded["tensors"], [memoryview(f) for f in frames], limits=DEFAULT_LIMITS, peer=None,
                   copy_shared=False)
    templates.learn(data, decoded)
    return data


ENTRY = {"name": "x", "datatype": "FP32", "shape": [1, 2], "size": 8}
BOOL_ENTRY = {"name": "b", "datatype": "BOOL", "shape": [3], "size": 3}


def test_a_learned_header_matches_only_identical_bytes_and_data_is_still_checked() -> None:
    runner = Templates(limits=DEFAULT_LIMITS, sends="reply")  # reads requests
    data = _learned(runner, {"op": "infer", "id": 7, "tensors": [ENTRY, BOOL_ENTRY]}, [bytes(8), bytes(3)])
    matched = runner.match(data)
    assert matched is not None and matched[0] == 7
    plan = matched[1]
    other_id = pack_header({"op": "infer", "id": 70000, "tensors": [ENTRY, BOOL_ENTRY]})
    assert runner.match(other_id) is not None and runner.match(other_id)[0] == 70000  # type: ignore[index]
    outputs = plan.decode([bytearray(b"\x00\x00\x80\x3f\x00\x00\x00\x40"), bytearray(b"\x01\x00\x01")])
    assert outputs["x"].tolist() == [[1.0, 2.0]]  # type: ignore[union-attr]
    assert outputs["b"].tolist() == [True, False, True]  # type: ignore[union-attr]
    with pytest.raises(FrameError, match="message has 1 data frames, the header accounts for 2"):
        plan.decode([bytes(8)])
    with pytest.raises(FrameError, match="'x': data frame is 9 bytes, header says 8"):
        plan.decode([bytes(9), bytes(3)])
    with pytest.raises(FrameError, match="'b': BOOL bytes must be 0 or 1"):
        plan.decode([bytes(8), b"\x00\x02\x00"])
    for changed in (
        data.replace(b"\x92\x01\x02", b"\x92\x02\x01"),  # another shape
        data + b"\x00",  # trailing bytes
        data[:-1],  # truncated
        pack_header({"op": "infer", "id": 7, "tensors": [ENTRY, BOOL_ENTRY], "drop": ["r1"]}),
        pack_header({"op": "infer", "id": -1, "tensors": [ENTRY, BOOL_ENTRY]}),
        pack_header({"id": 7, "ok": True, "tensors": [ENTRY, BOOL_ENTRY]}),  # a reply, not a request
    ):
        assert runner.match(changed) is None


@pytest.mark.parametrize(
    "header",
    [
        {"op": "infer", "id": 1, "tensors": [{**ENTRY, "shm": ["h0", 0]}]},
        {"op": "infer", "id": 1, "tensors": [ENTRY], "drop": ["h1"]},
        {"op": "infer", "id": 1, "tensors": [{"name": "s", "datatype": "BYTES", "shape": [1], "size": 5}]},
        {"op": "infer", "id": 1, "tensors": [{"name": "n", "nested": [{"datatype": "FP32", "shape": [2], "size": 8}]}]},
        {"id": 1, "op": "infer", "tensors": [ENTRY]},  # same map, other key order: other bytes
    ],
)
def test_only_plain_frame_tensors_are_learned(header: dict[str, Any]) -> None:
    runner = Templates(limits=DEFAULT_LIMITS, sends="reply")
    data = pack_header(header)
    runner.learn(data, unpack_header(data, DEFAULT_LIMITS))
    assert runner.match(data) is None


def test_a_header_near_the_size_limit_is_not_cached() -> None:
    header = {"op": "infer", "id": 1, "tensors": [ENTRY]}
    size = len(pack_header(header))
    runner = Templates(limits=WireLimits(max_header_bytes=size + 3), sends="reply")
    data = pack_header(header)
    runner.learn(data, unpack_header(data, DEFAULT_LIMITS))
    assert runner.match(data) is None  # a longer id could push the same tail over the limit


@settings(max_examples=200, deadline=None)
@given(position=st.integers(min_value=0), value=st.integers(min_value=0, max_value=255))
def test_a_mutated_header_never_matches_a_plan_it_does_not_equal(position: int, value: int) -> None:
    runner = Templates(limits=DEFAULT_LIMITS, sends="reply")
    data = _learned(runner, {"op": "infer", "id": 5, "tensors": [ENTRY]}, [bytes(8)])
    mutated = bytearray(data)
    mutated[position % len(data)] = value
    matched = runner.match(bytes(mutated))
    if bytes(mutated) != data and matched is not None:
        # Only the id may differ: the bytes after it are the learned ones.
        assert bytes(mutated)[len(b"\x83\xa2op\xa5infer\xa2id") + 1 :] == data[len(b"\x83\xa2op\xa5infer\xa2id") + 1 :]
        assert matched[0] == mutated[len(b"\x83\xa2op\xa5infer\xa2id")]
