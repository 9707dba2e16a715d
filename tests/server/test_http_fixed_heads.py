"""Response heads made once (`FixedHead`): the bytes a connection writes for a response that carries one are exactly
those it writes for the same response without it, and `HttpApp` gives one only to binary inference responses,
with the status, headers and length of the response it is given with."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import orjson
import pytest
from carton.server._http import HttpApp
from carton.server._http_exchange import fixed_wire, response_head
from carton.server._http_messages import FixedHead, HttpRequest, HttpResponse
from carton.server._http_server import serve_http
from carton.server._repository import ModelRepository
from carton_protocol import DType, TensorSpec

from .in_process import in_process_app
from .test_http_transport import connect, served

uvloop = pytest.importorskip("uvloop")

_BINARY_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: application/octet-stream\r\ninference-header-content-length: %d\r\n"
    b"content-length: %d\r\n"
)


def test_a_fixed_heads_bytes() -> None:
    fixed = FixedHead(200, [(b"content-type", b"application/octet-stream"), (b"x-a", b"1")], 76)
    assert fixed_wire(fixed) == (
        b"HTTP/1.1 200 OK\r\ncontent-type: application/octet-stream\r\nx-a: 1\r\ncontent-length: 76\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ncontent-type: application/octet-stream\r\nx-a: 1\r\ncontent-length: 76\r\n"
        b"connection: close\r\n\r\n",
    )
    assert response_head(299, [], 0, keep_alive=True) == b"HTTP/1.1 299 \r\ncontent-length: 0\r\n\r\n"
    assert response_head(404, [], 3, keep_alive=False) == (
        b"HTTP/1.1 404 Not Found\r\ncontent-length: 3\r\nconnection: close\r\n\r\n"
    )
    assert HttpResponse(200, fixed.headers, [b"x"], fixed).content_length() == 76  # the head's length is the one sent


class _Pairs:
    """Answers /fixed/<n> and /plain/<n> alike (a body of n bytes in two parts), the first with a `FixedHead`."""

    def __init__(self) -> None:
        self.heads: dict[int, FixedHead] = {}

    async def __call__(self, request: HttpRequest) -> HttpResponse:
        kind, size = request.raw_path.split(b"/")[1:]
        n = int(size)
        headers = [(b"content-type", b"application/octet-stream"), (b"x-size", size)]
        parts = [b"h" * (n // 2), memoryview(b"d" * (n - n // 2))]
        if kind == b"fixed":
            fixed = self.heads.get(n)
            if fixed is None:
                fixed = self.heads[n] = FixedHead(200, headers, n)
            return HttpResponse(200, fixed.headers, parts, fixed)
        return HttpResponse(200, headers, parts)


def _exchange(port: int, requests: bytes) -> bytes:
    """Everything the server writes back for `requests` (sent in one piece) until it closes."""
    with connect(port) as sock:
        sock.sendall(requests)
        sock.shutdown(socket.SHUT_WR)
        received = bytearray()
        while data := sock.recv(1 << 16):
            received += data
    return bytes(received)


@pytest.mark.parametrize("size", [0, 1, 64, 70_000])  # 70,000: written apart from its head
def test_a_fixed_head_writes_what_the_headers_write(size: int) -> None:
    def requests(kind: bytes, *, method: bytes = b"GET") -> bytes:
        one = b"%s /%s/%d HTTP/1.1\r\nhost: x\r\n\r\n" % (method, kind, size)
        last = b"GET /%s/%d HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n" % (kind, size)
        head = b"HEAD /%s/%d HTTP/1.1\r\nhost: x\r\n\r\n" % (kind, size)
        return one * 3 + head + one + last  # kept alive (three times: learnt, then replayed), HEAD, then closed

    with served(_Pairs()) as (port, _):  # type: ignore[arg-type]
        fixed = _exchange(port, requests(b"fixed"))
        plain = _exchange(port, requests(b"plain"))
    assert fixed.count(b"HTTP/1.1 200 OK") == 6
    assert fixed.replace(b"/fixed/", b"/plain/") == plain
    assert fixed.count(b"connection: close\r\n") == 1
    assert fixed.endswith(b"connection: close\r\n\r\n" + b"h" * (size // 2) + b"d" * (size - size // 2))


class Echo:
    """OUTPUT0 is INPUT0; OUTPUT1 is INPUT0 as int32, left out when INPUT0's first element is negative."""

    inputs = (TensorSpec(name="INPUT0", dtype=DType.FLOAT32, shape=("a", "b")),)
    outputs = (
        TensorSpec(name="OUTPUT0", dtype=DType.FLOAT32, shape=("a", "b")),
        TensorSpec(name="OUTPUT1", dtype=DType.INT32, shape=("a", "b")),
    )

    async def infer(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        x = inputs["INPUT0"]
        return {"OUTPUT0": x} if x.size and x.flat[0] < 0 else {"OUTPUT0": x, "OUTPUT1": x.astype(np.int32)}

    def close(self) -> None:
        pass


@pytest.fixture
def app(tmp_path: Path) -> Iterator[tuple[HttpApp, ModelRepository]]:
    app, repository = in_process_app(tmp_path, ("echo",), lambda spec: Echo(), asyncio.run)
    yield app, repository
    asyncio.run(repository.close())


def _request(x: np.ndarray, *, outputs: list[dict[str, object]], request_id: str | None = None) -> bytes:
    """An HTTP/1.1 binary inference request of INPUT0 = `x`."""
    document: dict[str, object] = {
        "inputs": [
            {"name": "INPUT0", "shape": list(x.shape), "datatype": "FP32", "parameters": {"binary_data_size": x.nbytes}}
        ],
        "outputs": outputs,
    }
    if request_id is not None:
        document["id"] = request_id
    header = orjson.dumps(document)
    body = header + x.tobytes()
    return (
        b"POST /v2/models/echo/infer HTTP/1.1\r\nhost: x\r\ncontent-type: application/octet-stream\r\n"
        b"inference-header-content-length: %d\r\ncontent-length: %d\r\n\r\n" % (len(header), len(body))
    ) + body


def _binary(*names: str) -> list[dict[str, object]]:
    return [{"name": name, "parameters": {"binary_data": True}} for name in names]


def test_binary_inference_responses_are_written_byte_for_byte(app: tuple[HttpApp, ModelRepository]) -> None:
    """Each response is built here from the request alone, and must be what the server wrote, byte for byte: for
    repeated shapes and ids (their heads made once), other shapes, ids and outputs, a JSON output, and the last
    response before the connection closes."""
    cases: list[tuple[np.ndarray, list[dict[str, object]], str | None]] = []
    x = np.arange(16, dtype=np.float32).reshape(1, 16)
    y = np.arange(48, dtype=np.float32).reshape(3, 16) / 7
    for _ in range(3):
        cases.append((x, _binary("OUTPUT0"), None))
    cases += [
        (x + 1, _binary("OUTPUT0"), "a"),
        (y, _binary("OUTPUT0"), None),
        (x, _binary("OUTPUT1", "OUTPUT0"), None),
        (y, _binary("OUTPUT1", "OUTPUT0"), "b"),
        (x, _binary("OUTPUT0"), None),
    ]

    def expected(array: np.ndarray, outputs: list[dict[str, object]], request_id: str | None, close: bool) -> bytes:
        described = []
        data = b""
        for output in outputs:
            value = array if output["name"] == "OUTPUT0" else array.astype(np.int32)
            described.append(
                {"name": output["name"], "datatype": "FP32" if value.dtype == np.float32 else "INT32",
                 "shape": list(array.shape), "parameters": {"binary_data_size": value.nbytes}}
            )  # fmt: skip
            data += value.astype(value.dtype.newbyteorder("<")).tobytes()
        document: dict[str, object] = {"id": request_id} if request_id is not None else {}
        document |= {"model_name": "echo", "model_version": "1", "outputs": described}
        header = orjson.dumps(document)
        tail = b"connection: close\r\n\r\n" if close else b"\r\n"
        return _BINARY_HEAD % (len(header), len(header) + len(data)) + tail + header + data

    sent = [_request(array, outputs=outputs, request_id=rid) for array, outputs, rid in cases]
    closing = sent[-1].replace(b"host: x\r\n", b"host: x\r\nconnection: close\r\n", 1)
    want = b"".join(expected(*case, close=False) for case in cases) + expected(*cases[-1], close=True)

    async def main() -> tuple[bytes, bytes]:
        sock = socket.create_server(("127.0.0.1", 0))
        sock.setblocking(False)
        server = await serve_http(app[0].handle, sock)
        loop = asyncio.get_running_loop()
        try:
            # One request at a time (each read whole: the learnt-head path), then all of them in one piece.
            one_by_one = await loop.run_in_executor(None, _one_by_one, sock.getsockname()[1], [*sent, closing])
            at_once = await loop.run_in_executor(None, _exchange, sock.getsockname()[1], b"".join([*sent, closing]))
        finally:
            await server.close(timeout=2.0)
        return one_by_one, at_once

    one_by_one, at_once = uvloop.run(main())
    assert one_by_one == want
    assert at_once == want
    # One per response header: x and y with one output and with two, and x + 1 with its id (the id is in the
    # header, so the length differs).
    assert len(app[0]._fixed_heads) == 5


def _one_by_one(port: int, requests: list[bytes]) -> bytes:
    received = bytearray()
    with connect(port) as sock:
        for request in requests:
            sock.sendall(request)
            before = len(received)
            while True:
                received += sock.recv(1 << 16)
                head_end = received.find(b"\r\n\r\n", before)
                if head_end >= 0:
                    length = int(received[before:head_end].split(b"content-length: ")[1].split(b"\r\n")[0])
                    if len(received) >= head_end + 4 + length:
                        break
    return bytes(received)


def _handled(http: HttpApp, request: bytes) -> HttpResponse:
    """`http`'s response to the whole HTTP `request` (made by `_request`), handled without a transport."""
    head, _, rest = request.partition(b"\r\n\r\n")
    headers = dict(line.split(b": ", 1) for line in head.split(b"\r\n")[1:])
    return asyncio.run(http.handle(HttpRequest("POST", b"/v2/models/echo/infer", headers, rest)))


def test_only_binary_inference_responses_get_a_fixed_head(app: tuple[HttpApp, ModelRepository]) -> None:
    http, _ = app

    def infer(body: bytes) -> HttpResponse:
        return _handled(http, body)

    x = np.ones((2, 16), dtype=np.float32)
    first, *binary = [infer(_request(x, outputs=_binary("OUTPUT0"), request_id="z")) for _ in range(3)]
    assert first.fixed is None  # its header decoded in full: not known to be binary only until it is planned
    assert first.headers == binary[0].headers and first.body() == binary[0].body()
    for response in binary:
        assert response.fixed is binary[0].fixed is not None
        assert response.headers is response.fixed.headers
        assert response.fixed.status == response.status == 200
        assert response.fixed.length == len(response.body())
        assert response.headers == [
            (b"content-type", b"application/octet-stream"),
            (b"inference-header-content-length", b"%d" % (len(response.body()) - x.nbytes)),
        ]
    json_output = infer(_request(x, outputs=[{"name": "OUTPUT0"}, *_binary("OUTPUT1")]))
    assert json_output.status == 200 and json_output.fixed is None
    refused = infer(_request(x, outputs=_binary("NOPE")))
    assert refused.status == 400 and refused.fixed is None


def test_an_output_the_model_left_out_is_refused_on_the_planned_path(app: tuple[HttpApp, ModelRepository]) -> None:
    http, _ = app

    def infer(body: bytes) -> HttpResponse:
        return _handled(http, body)

    x = np.ones((1, 16), dtype=np.float32)
    for array in (-x, x, x, -x):  # full decoding, then planned (the plan is kept by the second request)
        response = infer(_request(array, outputs=_binary("OUTPUT0", "OUTPUT1")))
        if array.flat[0] < 0:
            assert (response.status, orjson.loads(response.body())) == (
                400, {"error": "unexpected inference output 'OUTPUT1' for model 'echo'"},
            )  # fmt: skip
        else:
            assert response.status == 200
    assert len(app[1].get("echo").request_plans) == 1
    # Each of the four ran the model (an execution of its own); two failed after it ran.
    stats = app[1].get("echo").stats.to_json()
    assert (stats["execution_count"], stats["inference_count"]) == (4, 4)
    assert stats["inference_stats"]["compute_infer"]["count"] == 4
    assert (stats["inference_stats"]["success"]["count"], stats["inference_stats"]["fail"]["count"]) == (2, 2)
    assert [batch["compute_infer"]["count"] for batch in stats["batch_stats"]] == [4]
