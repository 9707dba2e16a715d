"""What goes over the wire for the usual inference exchange, the bytes tritonclient's HTTP client sends: the response
is one ``write`` of exactly the bytes below (a status line, three headers, ``Content-Length`` framing, no chunked
encoding, no ``Connection`` header while the connection stays open), whether the request was parsed or taken from a
learnt head, and the accepted socket has Nagle's algorithm off."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest
from carton.server._http import HttpApp
from carton.server._http_server import HttpServer, _Connection, serve_http

from .in_process import in_process_app
from .test_http_fixed_heads import Echo
from .test_http_heads import CountingParser
from .test_http_transport import connect

uvloop = pytest.importorskip("uvloop")

X = np.arange(16, dtype=np.float32).reshape(1, 16)
_HEADER = (
    b'{"inputs":[{"name":"INPUT0","shape":[1,16],"datatype":"FP32","parameters":{"binary_data_size":64}}],'
    b'"outputs":[{"name":"OUTPUT0","parameters":{"binary_data":true}}]}'
)
#: A request as tritonclient.http (geventhttpclient) writes it, byte for byte: the header names in its case and order.
REQUEST = (
    (
        b"POST /v2/models/echo/infer HTTP/1.1\r\nUser-Agent: python/gevent-http-client-2.6.1\r\n"
        b"Inference-Header-Content-Length: %d\r\nHost: 127.0.0.1:8000\r\nContent-Length: %d\r\n\r\n"
        % (len(_HEADER), len(_HEADER) + X.nbytes)
    )
    + _HEADER
    + X.tobytes()
)
_ANSWER = orjson.dumps(
    {
        "model_name": "echo", "model_version": "1",
        "outputs": [{"name": "OUTPUT0", "datatype": "FP32", "shape": [1, 16], "parameters": {"binary_data_size": 64}}],
    }
)  # fmt: skip
#: The whole response.
RESPONSE = (
    (
        b"HTTP/1.1 200 OK\r\ncontent-type: application/octet-stream\r\ninference-header-content-length: %d\r\n"
        b"content-length: %d\r\n\r\n" % (len(_ANSWER), len(_ANSWER) + X.nbytes)
    )
    + _ANSWER
    + X.tobytes()
)


@pytest.fixture
def app(tmp_path: Path) -> Iterator[HttpApp]:
    app, repository = in_process_app(tmp_path, ("echo",), lambda spec: Echo(), asyncio.run)
    yield app
    asyncio.run(repository.close())


class _Writes:
    """A connection's transport that keeps each ``write`` apart."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []

    def write(self, data: Any) -> None:
        self.writes.append(bytes(data))

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def close(self) -> None:
        pass

    abort = close


def test_each_usual_response_is_one_write_of_its_bytes(app: HttpApp) -> None:
    loop = uvloop.new_event_loop()
    try:
        connection = _Connection(HttpServer(app.handle, loop, 30.0))
        transport = _Writes()
        connection.connection_made(transport)  # type: ignore[arg-type]
        parser = CountingParser(connection.parser)
        connection.parser = parser  # type: ignore[assignment]
        for _ in range(4):  # the first parsed, then learnt, then taken without the parser
            connection.data_received(REQUEST)
            for _ in range(20):
                loop.run_until_complete(asyncio.sleep(0))
        connection.connection_lost(None)
        loop.run_until_complete(asyncio.sleep(0))
    finally:
        loop.close()
    assert parser.fed == len(REQUEST)  # (so the three after it took the learnt head's path)
    assert transport.writes == [RESPONSE] * 4


def test_the_exchange_over_a_socket(app: HttpApp) -> None:
    async def main() -> tuple[list[bytes], int]:
        sock = socket.create_server(("127.0.0.1", 0))
        sock.setblocking(False)
        server = await serve_http(app.handle, sock)
        loop = asyncio.get_running_loop()
        try:
            client = connect(sock.getsockname()[1])
            with client:
                answers = await loop.run_in_executor(None, _ask, client)
                (connection,) = server.connections
                assert connection.transport is not None
                accepted = connection.transport.get_extra_info("socket")
                nodelay = accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        finally:
            await server.close(timeout=2.0)
        return answers, nodelay

    answers, nodelay = uvloop.run(main())
    assert answers == [RESPONSE] * 3
    assert nodelay != 0


def _ask(sock: socket.socket) -> list[bytes]:
    """Three requests on one connection, one at a time: what comes back for each."""
    answers = []
    for _ in range(3):
        sock.sendall(REQUEST)
        received = b""
        while len(received) < len(RESPONSE):
            data = sock.recv(1 << 16)
            assert data, "closed mid-answer"
            received += data
        answers.append(received)
    return answers
