"""The infer hot path of `HttpApp.handle`: a binary header seen before skips the decoding and checks, and answers
exactly as the full path does (values from the new body, the same errors, the request's id), served from an
in-process model version."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import orjson
import pytest
from carton.server._http import HttpApp
from carton.server._http_messages import DIGITS, HttpRequest, HttpResponse, read_digits, whole_body
from carton.server._repository import ModelRepository
from carton.server.errors import BadRequest, RequestTooLarge
from carton_protocol import DType, TensorSpec

from .in_process import in_process_app


class Echo:
    """An in-process model version: OUTPUT0 is INPUT0, COUNT is INPUT1 (and, for ``texts``, TEXT is echoed)."""

    def __init__(self, *, texts: bool) -> None:
        self.inputs = (
            TensorSpec(name="INPUT0", dtype=DType.FLOAT32, shape=("a", "b")),
            TensorSpec(name="INPUT1", dtype=DType.INT32, shape=("n",)),
            *((TensorSpec(name="TEXT", dtype=DType.STRING, shape=("n",)),) if texts else ()),
        )
        self.outputs = (
            TensorSpec(name="OUTPUT0", dtype=DType.FLOAT32, shape=("a", "b")),
            TensorSpec(name="COUNT", dtype=DType.INT32, shape=("n",)),
            *((TensorSpec(name="TEXT", dtype=DType.STRING, shape=("n",)),) if texts else ()),
        )

    async def infer(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        outputs = {"OUTPUT0": inputs["INPUT0"], "COUNT": inputs["INPUT1"]}
        if "TEXT" in inputs:
            outputs["TEXT"] = inputs["TEXT"]
        return outputs

    def close(self) -> None:
        pass


@pytest.fixture
def app(tmp_path: Path) -> Iterator[tuple[HttpApp, asyncio.AbstractEventLoop, ModelRepository]]:
    loop = asyncio.new_event_loop()
    app, repository = in_process_app(
        tmp_path, ("echo", "texts"), lambda spec: Echo(texts="texts" in str(spec.path)), loop.run_until_complete
    )
    yield app, loop, repository
    loop.run_until_complete(repository.close())
    loop.close()


def _binary(x: np.ndarray, *, request_id: str | None = None, text: bool = False) -> tuple[bytes, int]:
    """A binary request: INPUT0 = `x`, INPUT1 = [7, 8] (and TEXT = ["hi"] when `text`); OUTPUT0 asked for binary."""
    inputs: list[dict[str, object]] = [
        {"name": "INPUT0", "shape": list(x.shape), "datatype": "FP32", "parameters": {"binary_data_size": x.nbytes}},
        {"name": "INPUT1", "shape": [2], "datatype": "INT32", "parameters": {"binary_data_size": 8}},
    ]
    data = x.tobytes() + np.array([7, 8], dtype="<i4").tobytes()
    if text:
        inputs.append({"name": "TEXT", "shape": [1], "datatype": "BYTES", "parameters": {"binary_data_size": 6}})
        data += b"\x02\x00\x00\x00hi"
    header: dict[str, object] = {
        "inputs": inputs,
        "outputs": [{"name": "OUTPUT0", "parameters": {"binary_data": True}}],
    }
    if request_id is not None:
        header["id"] = request_id
    encoded = orjson.dumps(header)
    return encoded + data, len(encoded)


def _infer(
    app: tuple[HttpApp, asyncio.AbstractEventLoop, ModelRepository],
    body: bytes,
    header: int | None,
    model: str = "echo",
) -> HttpResponse:
    headers = {b"content-length": b"%d" % len(body)}
    if header is not None:
        headers[b"inference-header-content-length"] = b"%d" % header
    path = f"/v2/models/{model}/infer".encode()
    return app[1].run_until_complete(app[0].handle(HttpRequest("POST", path, headers, body)))


def _output(response: HttpResponse) -> tuple[dict[str, object], np.ndarray]:
    assert response.status == 200, response.body()
    body = response.body()
    length = int(dict(response.headers)[b"inference-header-content-length"])
    return orjson.loads(body[:length]), np.frombuffer(body[length:], np.float32)


def test_a_header_seen_before_decodes_the_new_body(app: tuple[HttpApp, asyncio.AbstractEventLoop, ModelRepository]):
    served = app[2].get("echo")
    x = np.arange(16, dtype=np.float32).reshape(1, 16)
    for round_ in range(3):
        body, header = _binary(x + round_)
        document, values = _output(_infer(app, body, header))
        assert values.tolist() == (x + round_).ravel().tolist()  # OUTPUT0 only: the one asked for
        assert document == {
            "model_name": "echo", "model_version": "1",
            "outputs": [{"name": "OUTPUT0", "datatype": "FP32", "shape": [1, 16],
                         "parameters": {"binary_data_size": 64}}],
        }  # fmt: skip
    assert len(served.request_plans) == 1
    # The id comes from the header it was sent in.
    for request_id in ("a", "b", "a"):
        document, _ = _output(_infer(app, *_binary(x, request_id=request_id)))
        assert document["id"] == request_id
    assert len(served.request_plans) == 3


def test_a_header_seen_before_with_another_body_length_gets_the_full_paths_errors(
    app: tuple[HttpApp, asyncio.AbstractEventLoop, ModelRepository],
) -> None:
    x = np.ones((1, 16), dtype=np.float32)
    body, header = _binary(x)
    assert _infer(app, body, header).status == 200
    longer = _infer(app, body + b"xx", header)
    assert (longer.status, orjson.loads(longer.body())) == (
        400, {"error": "2 bytes of binary data follow the inputs that none of them claims"},
    )  # fmt: skip
    shorter = _infer(app, body[:-4], header)
    assert shorter.status == 400 and b"binary_data_size 8 runs past the end" in shorter.body()
    assert _infer(app, body, header).status == 200


def test_headers_with_strings_or_json_data_are_not_remembered(
    app: tuple[HttpApp, asyncio.AbstractEventLoop, ModelRepository],
) -> None:
    x = np.ones((2, 4), dtype=np.float32)
    for _ in range(2):
        _, values = _output(_infer(app, *_binary(x, text=True), model="texts"))
        assert values.tolist() == x.ravel().tolist()
        document = {"inputs": [
            {"name": "INPUT0", "shape": [2, 4], "datatype": "FP32", "data": x.ravel().tolist()},
            {"name": "INPUT1", "shape": [2], "datatype": "INT32", "data": [7, 8]},
        ]}  # fmt: skip
        response = _infer(app, orjson.dumps(document), None)
        assert orjson.loads(response.body())["outputs"][1]["data"] == [7, 8]
    assert app[2].get("texts").request_plans == {} and app[2].get("echo").request_plans == {}


def test_remembered_headers_are_bounded(app: tuple[HttpApp, asyncio.AbstractEventLoop, ModelRepository]) -> None:
    served = app[2].get("echo")
    x = np.ones((1, 4), dtype=np.float32)
    for index in range(600):
        assert _infer(app, *_binary(x, request_id=str(index))).status == 200
    assert 0 < len(served.request_plans) <= 256
    assert 0 < len(served.response_heads) <= 256


def test_remembered_response_headers_follow_each_outputs_shape_and_the_id(
    app: tuple[HttpApp, asyncio.AbstractEventLoop, ModelRepository],
) -> None:
    served = app[2].get("echo")
    for shape, request_id in (((1, 16), None), ((2, 8), None), ((1, 16), "x"), ((2, 8), None), ((1, 16), None)):
        x = np.arange(16, dtype=np.float32).reshape(shape)
        document, values = _output(_infer(app, *_binary(x, request_id=request_id)))
        expected: dict[str, object] = {"id": request_id} if request_id is not None else {}
        expected |= {
            "model_name": "echo", "model_version": "1",
            "outputs": [{"name": "OUTPUT0", "datatype": "FP32", "shape": list(shape),
                         "parameters": {"binary_data_size": 64}}],
        }  # fmt: skip
        assert document == expected
        assert values.tolist() == x.ravel().tolist()
    assert len(served.response_heads) == 3


@pytest.mark.parametrize(
    ("outputs", "parameters", "binary_only"),
    [
        ([{"name": "OUTPUT0", "parameters": {"binary_data": True}}, {"name": "COUNT"}], {}, False),
        (
            [{"name": "COUNT", "parameters": {"binary_data": True}}, {"name": "OUTPUT0"}],
            {"binary_data_output": True},
            True,
        ),
        ([{"name": "COUNT", "parameters": {"binary_data": False}}], {"binary_data_output": True}, False),
        (None, {"binary_data_output": True}, True),
        (None, {}, False),
    ],
)
def test_a_planned_request_answers_its_outputs_as_the_full_path_does(
    app: tuple[HttpApp, asyncio.AbstractEventLoop, ModelRepository],
    outputs: list[dict[str, object]] | None,
    parameters: dict[str, object],
    binary_only: bool,
) -> None:
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    header: dict[str, object] = {
        "inputs": [
            {"name": "INPUT0", "shape": [2, 3], "datatype": "FP32", "parameters": {"binary_data_size": 24}},
            {"name": "INPUT1", "shape": [2], "datatype": "INT32", "parameters": {"binary_data_size": 8}},
        ],
        "parameters": parameters,
    }
    if outputs is not None:
        header["outputs"] = outputs
    encoded = orjson.dumps(header)
    body = encoded + x.tobytes() + np.array([7, 8], dtype="<i4").tobytes()
    first = _infer(app, body, len(encoded))  # decoded in full, its plan kept
    (plan,) = app[2].get("echo").request_plans.values()
    assert plan.binary_only is binary_only
    again = _infer(app, body, len(encoded))  # from the plan
    assert first.status == again.status == 200
    assert (first.headers, first.body()) == (again.headers, again.body())


def test_length_values_read_once_mean_what_they_say() -> None:
    # `Content-Length` values of digits only are kept once read (`DIGITS`); others are read every time.
    for _ in range(2):
        assert whole_body(b"x" * 12, declared=b"12", limit=100) == b"x" * 12
        with pytest.raises(RequestTooLarge, match="101 bytes"):
            whole_body(b"", declared=b"101", limit=100)
        assert whole_body(b"abc", declared=b" 3 ", limit=100) == b"abc"
        with pytest.raises(BadRequest, match="not a number"):
            whole_body(b"abc", declared=b"3x", limit=100)
    assert DIGITS[b"12"] == 12 and DIGITS[b"101"] == 101 and b" 3 " not in DIGITS
    assert read_digits(b"0042") == 42 and read_digits(b"4 2") is None and read_digits(b"") is None
