"""JSON tensors: large ones are decoded off the event loop (health keeps answering meanwhile), and the numpy fast
path refuses exactly what the element-by-element checks refuse."""

from __future__ import annotations

import http.client
import json
import threading
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
from carton.server import ModelControlMode, ServerOptions, _http, serve_in_thread
from carton.server._http_codec import (
    _CUT_BYTES,
    _LIFT_BYTES,
    _decode_header,
    _decode_without_large_arrays,
    _json_tensor,
)
from carton.server.errors import BadRequest
from carton_protocol import DType

_DTYPE = {"FP32": DType.FLOAT32, "FP64": DType.FLOAT64, "INT32": DType.INT32, "INT8": DType.INT8, "BYTES": DType.STRING}


def _post(port: int, path: str, body: bytes) -> tuple[int, bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        connection.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def test_health_answers_while_a_json_tensor_decodes(repository: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    decodes: list[tuple[float, float]] = []
    decode = _http.unplanned_request

    def timed_decode(*args: Any) -> Any:
        started = time.perf_counter()
        try:
            return decode(*args)
        finally:
            decodes.append((started, time.perf_counter()))

    monkeypatch.setattr(_http, "unplanned_request", timed_decode)
    count = 4_000_000
    body = (
        b'{"inputs": [{"name": "INPUT0", "shape": [1, %d], "datatype": "FP32", "data": [' % count
        + b"1," * (count - 1)
        + b'1]}], "outputs": [{"name": "OUTPUT0", "parameters": {"binary_data": true}}]}'
    )
    with _serve(repository) as server:
        answer: list[tuple[int, bytes]] = []
        sender = threading.Thread(
            target=lambda: answer.append(_post(server.http_port, "/v2/models/identity/infer", body))
        )
        probe = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=120)
        answered: list[float] = []
        sender.start()
        while sender.is_alive():
            probe.request("GET", "/v2/health/ready")
            response = probe.getresponse()
            response.read()
            assert response.status == 200
            answered.append(time.perf_counter())
        sender.join()
        probe.close()
    status, payload = answer[0]
    assert status == 200, payload[:200]
    header_length = int(payload.index(b"}]}") + 3)
    header = json.loads(payload[:header_length])
    assert header["outputs"][0]["shape"] == [1, count]
    assert header["outputs"][0]["parameters"]["binary_data_size"] == 4 * count
    started, finished = max(decodes, key=lambda window: window[1] - window[0])
    assert any(started < moment < finished for moment in answered), "no health answer while the tensor decoded"


@pytest.mark.parametrize(
    ("data", "dtype", "shape", "expected"),
    [
        ([[1, 2.5], [3, 4]], DType.FLOAT32, [2, 2], [[1.0, 2.5], [3.0, 4.0]]),
        ([1, 2, 3], DType.INT64, [3], [1, 2, 3]),
        ([[1], [2, 3]], DType.FLOAT32, [3], [1.0, 2.0, 3.0]),  # ragged nesting: only the count must agree
        ([], DType.FLOAT32, [0], []),
    ],
)
def test_json_tensor_values(data: object, dtype: DType, shape: list[int], expected: object) -> None:
    assert _json_tensor(data, dtype, shape, tensor="x").tolist() == expected


@pytest.mark.parametrize(
    ("data", "dtype", "message"),
    [
        ([1.0, True], DType.FLOAT32, "FP32 'data' elements must be numbers, got True"),
        ([1, 2.5], DType.INT32, "INT32 'data' elements must be integers, got 2.5"),
        (["1.5", 2], DType.FLOAT32, "must be numbers, got '1.5'"),
        ([None, 2], DType.FLOAT64, "must be numbers, got None"),
        ([300, 1], DType.INT8, "does not fit INT8"),
        ([-1, 1], DType.UINT16, "does not fit UINT16"),
        ([[1, 2], [3]], DType.FLOAT32, "holds 3 elements but shape [2] needs 2"),
        (5, DType.FLOAT32, "holds 1 element but shape [2] needs 2"),
    ],
)
def test_json_tensor_refusals(data: object, dtype: DType, message: str) -> None:
    with pytest.raises(BadRequest) as caught:
        _json_tensor(data, dtype, [2], tensor="x")
    assert message in str(caught.value) and "'x'" in str(caught.value)


def _large_header(data: bytes, datatype: str = "FP32") -> memoryview:
    """A request header over the size from which tensors' data are parsed piece by piece (padded with spaces)."""
    head = b'{"inputs": [{"name": "x", "shape": [3], "datatype": "%s", "data": %s}]}' % (datatype.encode(), data)
    return memoryview(head + b" " * (_LIFT_BYTES + 1))


@pytest.mark.parametrize(
    ("data", "datatype", "message"),
    [
        (b"[1, 2, true]", "FP32", "FP32 'data' elements must be numbers, got True"),
        (b'[1, 2, "a"]', "FP32", "must be numbers, got 'a'"),
        (b"[1, null, 3]", "FP64", "must be numbers, got None"),
        (b"[1, 2.5, 3]", "INT32", "INT32 'data' elements must be integers, got 2.5"),
        (b"[1, 300, 3]", "INT8", "does not fit INT8"),
        (b"[1, 2]", "FP32", "holds 2 elements but shape [3] needs 3"),
        (b"[[1, 2], [3, 4]]", "FP32", "holds 4 elements but shape [3] needs 3"),
        (b"5", "FP32", "holds 1 element but shape [3] needs 3"),
        (b"[1, 2, 3]", "BYTES", "BYTES 'data' elements must be strings"),
    ],
)
def test_large_headers_refuse_the_same(data: bytes, datatype: str, message: str) -> None:
    header = _decode_header(_large_header(data, datatype))
    assert isinstance(header["inputs"][0]["data"], msgspec.Raw)  # the piecewise path, not the whole parse
    with pytest.raises(BadRequest) as caught:
        _json_tensor(header["inputs"][0]["data"], _DTYPE[datatype], [3], tensor="x")
    assert message in str(caught.value)


@pytest.mark.parametrize(
    ("data", "expected"),
    [(b"[1, 2.5, 3]", [1.0, 2.5, 3.0]), (b" [ 1 ,2,\n3 ] ", [1.0, 2.0, 3.0]), (b"[[1], [2, 3]]", [1.0, 2.0, 3.0])],
)
def test_large_headers_decode_the_same(data: bytes, expected: list[float]) -> None:
    header = _decode_header(_large_header(data))
    assert _json_tensor(header["inputs"][0]["data"], DType.FLOAT32, [3], tensor="x").tolist() == expected


def test_large_headers_keep_the_structure_errors() -> None:
    padding = b" " * (_LIFT_BYTES + 1)
    assert _decode_header(memoryview(b'{"inputs": 5}' + padding)) == {"inputs": 5}
    with pytest.raises(BadRequest, match="not valid JSON"):
        _decode_header(memoryview(b'{"inputs": [}' + padding))
    with pytest.raises(BadRequest, match="not valid JSON"):
        _decode_header(memoryview(b'{"inputs": [{"data": [1, 2,]}]}' + padding))


_LONG = list(range(_CUT_BYTES // 4))  # a flat array whose text is longer than the size from which it is cut out
_LONG_TEXT = json.dumps(_LONG).encode()


def _padded(document: bytes) -> memoryview:
    return memoryview(document + b" " * (_LIFT_BYTES + 1))


def test_long_arrays_are_cut_out_of_a_large_header_and_read_the_same() -> None:
    text = _padded(
        b'{"id": "r", "inputs": [{"name": "x", "shape": [%d], "datatype": "INT32", "data": %s}, '
        b'{"name": "y", "shape": [%d], "datatype": "FP64", "data": %s}]}'
        % (len(_LONG), _LONG_TEXT, len(_LONG), _LONG_TEXT)
    )
    header = _decode_without_large_arrays(text)
    assert header is not None and header["id"] == "r"
    for entry, dtype in zip(header["inputs"], (DType.INT32, DType.FLOAT64), strict=True):
        assert isinstance(entry["data"], msgspec.Raw)
        assert _json_tensor(entry["data"], dtype, [len(_LONG)], tensor=entry["name"]).tolist() == _LONG


@pytest.mark.parametrize(
    "document",
    [
        # the long array is inside a string: not a value
        b'{"id": "a%sb", "inputs": [{"name": "x", "shape": [1], "datatype": "INT32", "data": [1]}]}' % _LONG_TEXT,
        # a long array that is not an input's data
        b'{"parameters": {"p": %s}, "inputs": [{"name": "x", "shape": [1], "datatype": "INT32", "data": [1]}]}'
        % _LONG_TEXT,
        # nested arrays
        b'{"inputs": [{"name": "x", "shape": [2, %d], "datatype": "INT32", "data": [%s, %s]}]}'
        % (len(_LONG), _LONG_TEXT, _LONG_TEXT),
        # an escape: quotes can no longer be counted
        b'{"id": "\\"", "inputs": [{"name": "x", "shape": [%d], "datatype": "INT32", "data": %s}]}'
        % (len(_LONG), _LONG_TEXT),
    ],
    ids=["in-a-string", "not-data", "nested", "escape"],
)
def test_headers_of_other_shapes_are_not_cut_and_decode_the_same(document: bytes) -> None:
    assert _decode_without_large_arrays(_padded(document)) is None
    expected = json.loads(document)
    header = _decode_header(_padded(document))
    assert header["id"] == expected.get("id") and header["parameters"] == expected.get("parameters")
    (entry,) = expected["inputs"]
    tensor = _json_tensor(header["inputs"][0]["data"], DType.INT32, entry["shape"], tensor="x")
    assert tensor.tolist() == entry["data"]


@pytest.mark.parametrize("bad", [b"1, foo", b"1, 2,", b"1,, 2"], ids=["token", "trailing-comma", "empty-element"])
def test_a_cut_array_that_is_not_json_is_refused_as_such(bad: bytes) -> None:
    data = _LONG_TEXT[:-1] + b", " + bad + b"]"
    document = b'{"inputs": [{"name": "x", "shape": [3], "datatype": "FP32", "data": %s}]}' % data
    header = _decode_header(_padded(document))
    with pytest.raises(BadRequest, match="not valid JSON"):
        _json_tensor(header["inputs"][0]["data"], DType.FLOAT32, [3], tensor="x")


def _serve(repository: Path) -> Any:
    options = ServerOptions(
        repository=repository,
        http_port=0,
        grpc_port=None,
        model_control_mode=ModelControlMode.EXPLICIT,
        load_models=("identity",),
        max_body_size=64 * 1024 * 1024,
        upload_sandbox=None,
    )
    return serve_in_thread(options)


def _json_request(values: list[float], request_id: str | None = None) -> bytes:
    document: dict[str, Any] = {
        "inputs": [{"name": "INPUT0", "shape": [1, len(values)], "datatype": "FP32", "data": values}]
    }
    if request_id is not None:
        document["id"] = request_id
    return json.dumps(document).encode()


@pytest.mark.parametrize("request_id", [None, "r1", "\x00carton:0"], ids=["no-id", "id", "placeholder-id"])
def test_a_large_json_output_is_the_json_of_its_values(repository: Path, request_id: str | None) -> None:
    import numpy as np

    values = np.random.default_rng(7).standard_normal(100_000).astype(np.float32)
    with _serve(repository) as server:
        status, payload = _post(
            server.http_port, "/v2/models/identity/infer", _json_request(values.tolist(), request_id)
        )
    assert status == 200, payload[:200]
    answer = json.loads(payload)
    assert answer.get("id") == request_id
    (output,) = answer["outputs"]
    # the latest version of `identity` doubles its input
    assert output["shape"] == [1, len(values)] and output["data"] == (values * np.float32(2)).tolist()


def test_pipelined_requests_with_large_bodies_are_all_answered(repository: Path) -> None:
    import socket

    bodies = [_json_request([float(i % 97)] * 400_000, request_id=f"r{i}") for i in range(3)]  # megabytes each
    wire = b"".join(
        b"POST /v2/models/identity/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        for body in bodies
    )
    with _serve(repository) as server, socket.create_connection(("127.0.0.1", server.http_port), timeout=120) as sock:
        sock.sendall(wire)
        stream = sock.makefile("rb")
        for index in range(3):
            status_line = stream.readline()
            headers = {}
            while (line := stream.readline()) not in (b"\r\n", b""):
                name, _, value = line.partition(b":")
                headers[name.strip().lower()] = value.strip()
            answer = json.loads(stream.read(int(headers[b"content-length"])))
            assert status_line.startswith(b"HTTP/1.1 200"), answer
            assert answer["id"] == f"r{index}"
            assert answer["outputs"][0]["data"][:3] == [2.0 * (index % 97)] * 3  # the latest version doubles
