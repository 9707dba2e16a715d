"""Bad input over raw HTTP: each gets a 4xx with a clear message and no server path, and the server keeps serving."""

from __future__ import annotations

import base64
import gzip
import http.client
import json
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest
from carton.server import ModelControlMode, Server, ServerOptions, serve_in_thread

from .conftest import arange


def _request(
    server: Server, method: str, path: str, body: bytes | None = None, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=30)
    try:
        connection.request(method, path, body=body, headers=headers or {})
        response = connection.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        connection.close()


def _error(server: Server, method: str, path: str, body: bytes | None = None, **headers: str) -> tuple[int, str]:
    status, _, payload = _request(server, method, path, body, {k.replace("_", "-"): v for k, v in headers.items()})
    message = json.loads(payload)["error"]
    assert "/tmp" not in message and "carton-serve" not in message and "Traceback" not in message
    return status, message


def _still_serving(server: Server) -> None:
    body = json.dumps({"inputs": [{"name": "INPUT0", "shape": [1, 2], "datatype": "FP32", "data": [1, 2]}]})
    status, _, payload = _request(server, "POST", "/v2/models/identity/infer", body.encode())
    assert status == 200, payload
    assert json.loads(payload)["outputs"][0]["data"] == [2.0, 4.0]


def _binary_infer(header: dict, data: bytes, header_length: str | None = None) -> tuple[bytes, dict[str, str]]:
    head = json.dumps(header).encode()
    return head + data, {"Inference-Header-Content-Length": header_length or str(len(head))}


FP32_16 = {"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "FP32", "parameters": {"binary_data_size": 64}}]}


def test_exact_binary_response_bytes(server: Server) -> None:
    body, headers = _binary_infer({**FP32_16, "parameters": {"binary_data_output": True}}, arange((1, 16)).tobytes())
    status, response_headers, payload = _request(server, "POST", "/v2/models/identity/infer", body, headers)
    assert status == 200
    length = int(response_headers["inference-header-content-length"])
    assert json.loads(payload[:length]) == {
        "model_name": "identity", "model_version": "2",
        "outputs": [{"name": "OUTPUT0", "datatype": "FP32", "shape": [1, 16], "parameters": {"binary_data_size": 64}}],
    }  # fmt: skip
    assert payload[length:] == (arange((1, 16)) * 2).astype("<f4").tobytes()


def test_raw_binary_request(server: Server) -> None:
    data = arange((1, 4)).tobytes()
    status, headers, payload = _request(
        server, "POST", "/v2/models/batched/infer", data, {"Inference-Header-Content-Length": "0"}
    )
    assert status == 200
    length = int(headers["inference-header-content-length"])
    assert json.loads(payload[:length])["outputs"][0]["shape"] == [1, 4]
    assert payload[length:] == (arange((1, 4)) * 2).tobytes()
    status, message = _error(server, "POST", "/v2/models/identity/infer", data, Inference_Header_Content_Length="0")
    assert status == 400 and "more than one variable-size dimension" in message
    status, message = _error(server, "POST", "/v2/models/sum/infer", data, Inference_Header_Content_Length="0")
    assert status == 400 and "exactly one input" in message


@pytest.mark.parametrize(
    ("header_length", "message"),
    [
        ("abc", "must be a non-negative decimal integer"),
        ("-1", "must be a non-negative decimal integer"),
        ("99999", "is larger than the request body"),
        ("1e3", "must be a non-negative decimal integer"),
    ],
)
def test_bad_inference_header_length(server: Server, header_length: str, message: str) -> None:
    body, headers = _binary_infer(FP32_16, arange((1, 16)).tobytes(), header_length)
    status, text = _error(
        server, "POST", "/v2/models/identity/infer", body, **{k.replace("-", "_"): v for k, v in headers.items()}
    )
    assert status == 400 and message in text
    _still_serving(server)


@pytest.mark.parametrize(
    ("header", "data", "message"),
    [
        (FP32_16, b"\0" * 60, "binary_data_size 64 runs past the end"),
        (FP32_16, b"\0" * 70, "6 bytes of binary data follow the inputs"),
        (
            {
                "inputs": [
                    {"name": "INPUT0", "shape": [1, 16], "datatype": "FP32", "parameters": {"binary_data_size": 60}}
                ]
            },
            b"\0" * 60,
            "60 bytes of data, but shape [1, 16] of FP32 needs 64",
        ),
        (
            {"inputs": [{"name": "TEXT", "shape": [2], "datatype": "BYTES", "parameters": {"binary_data_size": 9}}]},
            struct.pack("<I", 1) + b"a" + struct.pack("<I", 50),
            "declares 50 bytes but only 0 remain",
        ),
        (
            {"inputs": [{"name": "TEXT", "shape": [2], "datatype": "BYTES", "parameters": {"binary_data_size": 7}}]},
            struct.pack("<I", 1) + b"a" + b"\1\0",
            "length prefix runs past the end",
        ),
        (
            {"inputs": [{"name": "TEXT", "shape": [1], "datatype": "BYTES", "parameters": {"binary_data_size": 6}}]},
            struct.pack("<I", 2) + b"\xff\xfe",
            "not valid utf-8",
        ),
        (
            {
                "inputs": [
                    {"name": "INPUT0", "shape": [1, -16], "datatype": "FP32", "parameters": {"binary_data_size": 64}}
                ]
            },
            b"\0" * 64,
            "non-negative integers",
        ),
    ],
)
def test_bad_binary_tensors(server: Server, header: dict, data: bytes, message: str) -> None:
    model = "strings" if header["inputs"][0]["name"] == "TEXT" else "identity"
    body, headers = _binary_infer(header, data)
    status, text = _error(
        server, "POST", f"/v2/models/{model}/infer", body, **{k.replace("-", "_"): v for k, v in headers.items()}
    )
    assert status == 400 and message in text, text
    _still_serving(server)


@pytest.mark.parametrize(
    ("document", "message"),
    [
        (b"not json", "not valid JSON"),
        (b"[1]", "must be a JSON object"),
        (b'{"inputs": 5}', "'inputs' must be a JSON array"),
        (b'{"inputs": [{"name": "INPUT0", "shape": [1, 3], "datatype": "FP32", "data": [1, 2]}]}', "holds 2 elements"),
        (
            b'{"inputs": [{"name": "INPUT0", "shape": [1, 2], "datatype": "FP32", "data": [1]}]}',
            "'data' holds 1 element but shape [1, 2] needs 2",
        ),
        (b'{"inputs": [{"name": "INPUT0", "shape": [1, 2], "datatype": "FP32", "data": ["a", 2]}]}', "must be numbers"),
        (b'{"inputs": [{"name": "INPUT0", "shape": [1, 2], "datatype": "INT32", "data": [1, 2]}]}', "expects 'FP32'"),
        (
            b'{"inputs": [{"name": "WRONG", "shape": [1], "datatype": "FP32", "data": [1]}]}',
            "unexpected inference input",
        ),
        (b'{"inputs": []}', "missing ['INPUT0']"),
        (
            b'{"inputs": [{"name": "INPUT0", "shape": [1, 1], "datatype": "FP32", "data": [1]}],'
            b' "outputs": [{"name": "X"}]}',
            "unexpected inference output 'X'",
        ),
        (
            b'{"inputs": [{"name": "INPUT0", "shape": [1, 1], "datatype": "FP32", "data": [1]}], "id": 5}',
            "'id' must be a string",
        ),
        (b"[" * 100000, "not valid JSON"),
    ],
)
def test_bad_json_requests(server: Server, document: bytes, message: str) -> None:
    status, text = _error(server, "POST", "/v2/models/identity/infer", document)
    assert status == 400 and message in text, text
    _still_serving(server)


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("/v2/models/../infer", "starts with '.'"),
        ("/v2/models/..%2F..%2Fetc/infer", "path separator"),
        ("/v2/models/a%5Cb/infer", "path separator"),
        ("/v2/models/a%00b/infer", "NUL or control character"),
        ("/v2/repository/models/..%2Fidentity/load", "path separator"),
        ("/v2/repository/models/%2e%2e/load", "starts with '.'"),
        ("/v2/repository/models/a%00/unload", "NUL or control character"),
    ],
)
def test_bad_model_names(server: Server, path: str, message: str) -> None:
    status, text = _error(server, "POST", path, b"{}")
    assert status == 400 and message in text, text
    _still_serving(server)


def test_unknown_model_and_endpoints(server: Server) -> None:
    assert _error(server, "POST", "/v2/models/nosuch/infer", b"{}") == (
        404, "Request for unknown model: 'nosuch' is not found",
    )  # fmt: skip
    assert _error(server, "GET", "/v2/nothing")[0] == 404
    assert _error(server, "GET", "/v2/models/identity/infer")[0] == 405
    status, message = _error(server, "POST", "/v2/systemsharedmemory/region/x/register", b"{}")
    assert status == 501 and "system shared memory" in message
    status, message = _error(server, "POST", "/v2/repository/models/identity/load", b'{"parameters": {"x": 1}}')
    assert status == 400 and "unknown load parameter 'x'" in message
    status, message = _error(server, "POST", "/v2/repository/models/identity/load", b'{"parameters": {"config": "{"}}')
    assert status == 400 and "not valid JSON" in message
    status, message = _error(
        server,
        "POST",
        "/v2/repository/models/identity/load",
        b'{"parameters": {"config": "{\\"backend\\": \\"onnxruntime\\"}"}}',
    )
    assert status == 400 and "backend 'onnxruntime' is not available" in message
    assert _request(server, "POST", "/v2/repository/index", b"")[0] == 200
    assert _error(server, "POST", "/v2/repository/index", b'{"ready": 3}')[0] == 400
    _still_serving(server)


def test_body_size_limits(server: Server) -> None:
    # Content-Length over the limit: refused before the body is read.
    connection = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=30)
    connection.putrequest("POST", "/v2/models/identity/infer")
    connection.putheader("Content-Length", str(64 * 1024 * 1024))
    connection.endheaders()
    response = connection.getresponse()
    assert response.status == 413 and "over the 4194304-byte limit" in json.loads(response.read())["error"]
    connection.close()

    # Chunked body over the limit: refused once the limit is passed; the server stops reading and answers.
    import socket

    with socket.create_connection(("127.0.0.1", server.http_port), timeout=30) as sock:
        sock.sendall(b"POST /v2/models/identity/infer HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
        chunk = b"10000\r\n" + b" " * 0x10000 + b"\r\n"
        try:
            for _ in range(100):
                sock.sendall(chunk)
        except (BrokenPipeError, ConnectionResetError):
            pass
        reply = sock.recv(65536)
    assert reply.startswith(b"HTTP/1.1 413"), reply[:100]
    bomb = gzip.compress(b" " * (16 * 1024 * 1024))
    status, message = _error(server, "POST", "/v2/models/identity/infer", bomb, Content_Encoding="gzip")
    assert status == 413 and "decompressed" in message
    status, message = _error(server, "POST", "/v2/models/identity/infer", b"\x1f\x8bjunk", Content_Encoding="gzip")
    assert status == 400 and "corrupt" in message
    _still_serving(server)


def test_many_tiny_chunks(server: Server) -> None:
    document = json.dumps(
        {"inputs": [{"name": "INPUT0", "shape": [1, 512], "datatype": "FP32", "data": list(range(512))}]}
    ).encode()

    connection = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=30)
    connection.putrequest("POST", "/v2/models/identity/infer")
    connection.putheader("Transfer-Encoding", "chunked")
    connection.endheaders()
    for offset in range(0, len(document), 3):
        piece = document[offset : offset + 3]
        connection.send(b"%x\r\n%s\r\n" % (len(piece), piece))
    connection.send(b"0\r\n\r\n")
    response = connection.getresponse()
    status, payload = response.status, response.read()
    connection.close()
    assert status == 200, payload
    assert json.loads(payload)["outputs"][0]["data"][:3] == [0.0, 2.0, 4.0]


@pytest.fixture(scope="module")
def locked_server(repository: Path) -> Iterator[Server]:
    """Uploads disabled; default upload sandbox; explicit control."""
    options = ServerOptions(
        repository=repository, http_port=0, grpc_port=None, model_control_mode=ModelControlMode.EXPLICIT,
        allow_upload=False,
    )  # fmt: skip
    with serve_in_thread(options) as running:
        yield running


def test_upload_disabled(locked_server: Server, cartons: dict[str, Path]) -> None:
    payload = base64.b64encode(cartons["identity"].read_bytes()).decode()
    body = json.dumps({"parameters": {"config": "{}", "file:1/model.carton": payload}}).encode()
    status, message = _error(locked_server, "POST", "/v2/repository/models/up/load", body)
    assert status == 403 and "upload" in message
    assert _request(locked_server, "GET", "/v2/health/ready")[0] == 200


def test_model_control_mode_none(repository: Path) -> None:
    options = ServerOptions(repository=repository, http_port=0, grpc_port=None, load_timeout=60)
    with serve_in_thread(options) as running:
        assert _request(running, "GET", "/v2/models/sum/ready")[0] == 200
        status, message = _error(running, "POST", "/v2/repository/models/sum/unload", b"")
        assert status == 400 and "model control mode is 'none'" in message
        index = json.loads(_request(running, "POST", "/v2/repository/index", b"")[2])
        assert {"name": "broken", "version": "1", "state": "UNAVAILABLE"}.items() <= next(
            e for e in index if e["name"] == "broken"
        ).items()
