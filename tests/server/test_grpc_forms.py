"""``ModelInfer`` requests of a learnt byte layout (`RequestForms`) and responses of a learnt prefix: the bytes taken as
known are exactly the ones upb parses the same way, anything else is parsed by upb, and responses are the bytes upb
serializes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from carton.server import Server
from carton.server._grpc_plan import HEAD_LIMIT, KnownRequest, RequestForms, varint
from carton.server._proto import message_class
from google.protobuf.message import DecodeError

from .conftest import arange

Request = message_class("ModelInferRequest")
Response = message_class("ModelInferResponse")
Parameter = message_class("InferParameter")


def _request(
    raws: list[bytes],
    *,
    model: str = "identity",
    request_id: str = "",
    outputs: tuple[str, ...] = (),
    shapes: list[list[int]] | None = None,
) -> Any:
    message = Request(model_name=model, id=request_id)
    for index, raw in enumerate(raws):
        shape = shapes[index] if shapes else [1, len(raw) // 4]
        message.inputs.add(name=f"INPUT{index}", datatype="FP32", shape=shape)
    for name in outputs:
        message.outputs.add(name=name)
    message.parameters["priority"].int64_param = 3
    message.raw_input_contents.extend(raws)
    return message


def _learnt(forms: RequestForms, message: bytes) -> None:
    assert not isinstance(forms.parse(message), KnownRequest)  # the first is upb's, and teaches the form


@pytest.mark.parametrize(
    "make",
    [
        lambda raws: _request(raws),
        lambda raws: _request(raws, request_id="call-7", outputs=("OUTPUT0", "OUTPUT1")),
        lambda raws: _request([*raws, raws[0] * 200], shapes=[[1, 2], [1, 400]]),
    ],
    ids=["one input", "id and outputs", "two inputs, a long varint"],
)
def test_a_known_request_means_what_upb_parses(make: Callable[[list[bytes]], Any]) -> None:
    forms = RequestForms(Request.FromString)
    _learnt(forms, make([bytes(8)]).SerializeToString())
    for payload in (b"\x01" * 8, b"\x3a\x08" * 4, bytes(range(8))):
        message = make([payload]).SerializeToString()
        known = forms.parse(message)
        assert isinstance(known, KnownRequest)
        parsed = Request.FromString(message)
        form = known.form
        assert (known.model_name, known.model_version, known.id) == (parsed.model_name, parsed.model_version, parsed.id)
        assert form.key == tuple((t.name, t.datatype, tuple(t.shape)) for t in parsed.inputs)
        assert form.requested == (tuple(o.name for o in parsed.outputs) or None)
        raws = [message[at : at + size] for at, size in zip(form.offsets, form.sizes, strict=True)]
        assert raws == list(parsed.raw_input_contents)


def test_bytes_not_of_the_form_are_parsed_by_upb() -> None:
    forms = RequestForms(Request.FromString)
    two = _request([bytes(8), bytes(8)]).SerializeToString()
    _learnt(forms, two)
    assert isinstance(forms.parse(_request([b"\x05" * 8, b"\x06" * 8]).SerializeToString()), KnownRequest)
    changed_head = bytearray(two)
    changed_head[3] ^= 0x01  # a letter of the model's name
    # The second raw input's field header says 4 bytes, and a field follows them: the same length, not the form.
    at = len(two) - 8 - 2
    assert two[at : at + 2] == b"\x3a\x08"
    inner = two[:at] + b"\x3a\x04" + bytes(4) + b"\x18\x01"
    for message in (
        bytes(changed_head),
        inner,
        two + b"\x3a\x00",  # a third raw input
        _request([bytes(4), bytes(8)]).SerializeToString(),  # another size
    ):
        parsed = forms.parse(message)
        assert not isinstance(parsed, KnownRequest)
        assert parsed == Request.FromString(message)
    # The raw inputs' bytes may be anything, field headers included.
    assert isinstance(forms.parse(two[:-8] + b"\x3a\x08" * 4), KnownRequest)
    assert list(Request.FromString(inner).raw_input_contents) == [bytes(8), bytes(4)]
    with pytest.raises(DecodeError):
        forms.parse(two[:-3])


@pytest.mark.parametrize(
    "message",
    [
        # The raw inputs do not come last: a field after them.
        _request([bytes(8)]).SerializeToString() + b"\x1a\x01x",
        # A raw input before the inputs' descriptions.
        b"\x3a\x08" + bytes(8) + Request(model_name="identity", inputs=[{"name": "INPUT0"}]).SerializeToString(),
        # No raw inputs, or fewer than inputs.
        _request([]).SerializeToString(),
        _request([bytes(8)]).SerializeToString() + Request(inputs=[{"name": "INPUT1"}]).SerializeToString(),
        # The classification extension, which the full decoding refuses every time.
        Request(
            model_name="identity",
            inputs=[{"name": "INPUT0", "datatype": "FP32", "shape": [1, 2]}],
            outputs=[{"name": "OUTPUT0", "parameters": {"classification": {"int64_param": 2}}}],
            raw_input_contents=[bytes(8)],
        ).SerializeToString(),
        # A head longer than a form keeps (a long request id here).
        _request([bytes(8)], request_id="x" * HEAD_LIMIT).SerializeToString(),
    ],
    ids=["field after", "raw first", "no raw", "fewer raw", "classification", "long head"],
)
def test_layouts_never_learnt(message: bytes) -> None:
    forms = RequestForms(Request.FromString)
    for _ in range(3):
        assert not isinstance(forms.parse(message), KnownRequest)


def test_a_connection_whose_requests_never_repeat_stops_learning() -> None:
    forms = RequestForms(Request.FromString)
    for index in range(100):  # a new request id each time: every form learnt goes unused
        message = _request([bytes(8)], request_id=f"{index:04d}").SerializeToString()
        parsed = forms.parse(message)
        assert not isinstance(parsed, KnownRequest)
        assert parsed == Request.FromString(message)
    message = _request([bytes(8)], request_id="same").SerializeToString()
    assert not isinstance(forms.parse(message), KnownRequest)
    assert not isinstance(forms.parse(message), KnownRequest)  # not learnt any more
    other = RequestForms(Request.FromString)  # another connection's
    _learnt(other, message)
    assert isinstance(other.parse(message), KnownRequest)


def test_varint() -> None:
    # As a length prefix (a bytes field of that length), and, for values whose bytes field would be gigabytes, as a
    # varint field's value (the same encoding for a non-negative int64).
    for value in (0, 1, 127, 128, 300, 16383, 16384, 2**21):
        assert varint(value) == Request(raw_input_contents=[bytes(value)]).SerializeToString()[1:][: len(varint(value))]
    for value in (0, 1, 127, 128, 2**21, 2**28 - 1, 2**28, 2**31, 2**35):
        assert varint(value) == Parameter(int64_param=value).SerializeToString()[1:]


# ---- through the server ----------------------------------------------------------------------------------------


def _raw_infer(channel: grpc.Channel) -> Callable[[bytes], bytes]:
    return channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")  # bytes in, bytes out


def test_responses_are_the_bytes_upb_serializes(server: Server) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
        infer = _raw_infer(channel)
        for round_ in range(4):
            for request_id, outputs in (("", ()), ("r", ("OUTPUT0",)), (f"é{round_}" * 70, ()), (str(round_), ())):
                x = arange((1, 4)) + round_
                request = _request([x.tobytes()], request_id=request_id, outputs=outputs)
                expected = Response(model_name="identity", model_version="2", id=request_id)
                expected.outputs.add(name="OUTPUT0", datatype="FP32", shape=[1, 4])
                expected.raw_output_contents.append((x * 2).tobytes())
                assert infer(request.SerializeToString()) == expected.SerializeToString()


def test_known_requests_of_two_inputs_and_their_errors(server: Server) -> None:
    a, b = np.array([3, 4, 5], np.int64), np.array([1, 1, 2], np.int64)
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")

    def infer(x: np.ndarray, y: np.ndarray, output: str = "OUTPUT0") -> np.ndarray:
        inputs = [grpcclient.InferInput("INPUT0", [3], "INT64"), grpcclient.InferInput("INPUT1", [3], "INT64")]
        inputs[0].set_data_from_numpy(x)
        inputs[1].set_data_from_numpy(y)
        result = client.infer("sum", inputs, outputs=[grpcclient.InferRequestedOutput(output)])
        return result.as_numpy(output)

    for round_ in range(3):
        np.testing.assert_array_equal(infer(a + round_, b), a + round_ + b)
    client.load_model("sum")  # a new version: its input plans are learnt again, through the full decoding
    for round_ in range(3):
        np.testing.assert_array_equal(infer(a, b + round_), a + b + round_)
    with pytest.raises(Exception, match="unexpected inference output 'NOPE'"):
        infer(a, b, "NOPE")
    with pytest.raises(Exception, match="unexpected inference output 'NOPE'"):
        infer(a, b, "NOPE")
