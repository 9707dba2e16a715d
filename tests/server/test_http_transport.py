"""The HTTP/1.1 protocol `carton serve` runs (``_http_server.py``), tested at the socket level: raw sockets on
127.0.0.1 against `serve_http` serving small handlers on a uvloop loop of its own thread."""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest
from carton.server._http_messages import HttpRequest, HttpResponse, collect_body
from carton.server._http_server import HttpServer, _Connection, serve_http
from carton.server.errors import ServerError

uvloop = pytest.importorskip("uvloop")

BIG = np.arange((38_535_168) // 4, dtype=np.float32)  # the size of a [64,3,224,224] FP32 tensor


class Handler:
    """Answers by path: /echo (the body, read under an 8 KiB limit), /sleep/<ms>, /big (38.5 MB), else the path."""

    def __init__(self) -> None:
        self.started: list[bytes] = []
        self.finished: list[bytes] = []
        self.failures: list[str] = []

    async def __call__(self, request: HttpRequest) -> HttpResponse:
        self.started.append(request.raw_path)
        try:
            return await self.answer(request)
        finally:
            self.finished.append(request.raw_path)

    async def answer(self, request: HttpRequest) -> HttpResponse:
        path = request.raw_path
        if path == b"/echo":
            try:
                body = await collect_body(request.body, declared=request.headers.get(b"content-length"), limit=8192)
            except ServerError as exc:
                self.failures.append(str(exc))
                return HttpResponse(exc.http_status, [], [str(exc).encode()])
            return HttpResponse(200, [(b"x-method", request.method.encode())], [bytes(body)])
        if path.startswith(b"/sleep/"):
            await asyncio.sleep(int(path.rsplit(b"/", 1)[1]) / 1000)
            return HttpResponse(200, [], [path])
        if path == b"/big":
            return HttpResponse(200, [(b"content-type", b"application/octet-stream")], [BIG.data.cast("B")])
        return HttpResponse(200, [], [path])


@contextmanager
def served(handler: Handler, *, keep_alive_timeout: float = 30.0) -> Iterator[tuple[int, HttpServer]]:
    loop = uvloop.new_event_loop()
    sock = socket.create_server(("127.0.0.1", 0))
    sock.setblocking(False)
    started: list[HttpServer] = []
    ready = threading.Event()

    def main() -> None:
        asyncio.set_event_loop(loop)
        started.append(loop.run_until_complete(serve_http(handler, sock, keep_alive_timeout=keep_alive_timeout)))
        ready.set()
        loop.run_forever()

    thread = threading.Thread(target=main, daemon=True)
    thread.start()
    assert ready.wait(10)
    try:
        yield sock.getsockname()[1], started[0]
    finally:
        asyncio.run_coroutine_threadsafe(started[0].close(timeout=2.0), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=10)


def read_response(sock: socket.socket, buffer: bytearray) -> tuple[int, dict[bytes, bytes], bytes]:
    """One response from `sock` (bytes past it stay in `buffer`); the head's status and headers, and the body."""
    while b"\r\n\r\n" not in buffer:
        data = sock.recv(65536)
        if not data:
            raise ConnectionError(f"closed before a whole head: {bytes(buffer)!r}")
        buffer += data
    head, _, rest = bytes(buffer).partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    status = int(lines[0].split()[1])
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(b":") for line in lines[1:])}
    length = int(headers.get(b"content-length", b"0"))
    body = bytearray(rest)
    while len(body) < length:
        data = sock.recv(1 << 20)
        if not data:
            raise ConnectionError("closed mid-body")
        body += data
    buffer[:] = body[length:]
    return status, headers, bytes(body[:length])


def closed_by_server(sock: socket.socket, timeout: float = 30.0) -> bool:
    sock.settimeout(timeout)
    try:
        while sock.recv(65536):
            pass
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
    return True


def wait_until(condition: object, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():  # type: ignore[operator]
            return True
        time.sleep(0.01)
    return False


def test_keep_alive_and_http_1_0() -> None:
    handler = Handler()
    with served(handler) as (port, _), connect(port) as sock:
        buffer = bytearray()
        for index in range(3):
            sock.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello")
            status, headers, body = read_response(sock, buffer)
            assert (status, body, headers[b"x-method"]) == (200, b"hello", b"POST"), index
            assert b"connection" not in headers
        with connect(port) as old:
            old.sendall(b"GET /a HTTP/1.0\r\n\r\n")
            status, headers, body = read_response(old, bytearray())
            assert (status, body, headers[b"connection"]) == (200, b"/a", b"close")
            assert closed_by_server(old)
        with connect(port) as old:
            old.sendall(b"GET /a HTTP/1.0\r\nConnection: keep-alive\r\n\r\nGET /b HTTP/1.0\r\n\r\n")
            buffer = bytearray()
            assert read_response(old, buffer)[2] == b"/a"
            assert read_response(old, buffer)[2] == b"/b"
            assert closed_by_server(old)


def test_pipelined_requests_answered_in_order() -> None:
    handler = Handler()
    with served(handler) as (port, _), connect(port) as sock:
        # The first takes longest: answers still come in request order, and one at a time.
        sock.sendall(
            b"GET /sleep/200 HTTP/1.1\r\nHost: x\r\n\r\n"
            b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc"
            b"GET /sleep/1 HTTP/1.1\r\nHost: x\r\n\r\n"
        )
        buffer = bytearray()
        assert [read_response(sock, buffer)[2] for _ in range(3)] == [b"/sleep/200", b"abc", b"/sleep/1"]
        assert handler.started == [b"/sleep/200", b"/echo", b"/sleep/1"] == handler.finished


def test_chunked_request_body() -> None:
    handler = Handler()
    with served(handler) as (port, _), connect(port) as sock:
        sock.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n")
        time.sleep(0.05)  # the handler starts with part of the body and reads the rest as it comes
        sock.sendall(b"1;ext=1\r\n,\r\n6\r\n world\r\n0\r\n\r\n")
        buffer = bytearray()
        assert read_response(sock, buffer)[:3:2] == (200, b"hello, world")
        sock.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n")
        assert read_response(sock, buffer)[:3:2] == (200, b"")


def test_content_length_over_the_limit_refused_before_the_body() -> None:
    handler = Handler()
    with served(handler) as (port, _), connect(port) as sock:
        sock.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 67108864\r\n\r\n" + b"x" * 1000)
        status, headers, body = read_response(sock, bytearray())
        assert status == 413 and b"67108864 bytes" in body and headers[b"connection"] == b"close"
        # What the client still sends is dropped, then the connection closes (no reset before the answer).
        for _ in range(64):
            try:
                sock.sendall(b"x" * 65536)
            except (BrokenPipeError, ConnectionResetError):
                break
        assert closed_by_server(sock)
    assert handler.failures == ["request body of 67108864 bytes is over the 8192-byte limit"]


def test_chunked_body_over_the_limit() -> None:
    handler = Handler()
    with served(handler) as (port, _), connect(port) as sock:
        sock.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
        try:
            for _ in range(100):
                sock.sendall(b"1000\r\n" + b" " * 0x1000 + b"\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass
        status, headers, _ = read_response(sock, bytearray())
        assert status == 413 and headers[b"connection"] == b"close"


def test_body_left_unread_is_skipped_and_the_connection_kept() -> None:
    handler = Handler()
    with served(handler) as (port, _), connect(port) as sock:
        # /other never reads its body: the rest of it is dropped and the next request is parsed after it.
        sock.sendall(b"POST /other HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n12345")
        buffer = bytearray()
        assert read_response(sock, buffer)[2] == b"/other"
        sock.sendall(b"67890GET /next HTTP/1.1\r\nHost: x\r\n\r\n")
        assert read_response(sock, buffer)[2] == b"/next"


def test_expect_100_continue() -> None:
    handler = Handler()
    with served(handler) as (port, _), connect(port) as sock:
        sock.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\nExpect: 100-continue\r\n\r\n")
        buffer = bytearray()
        assert read_response(sock, buffer)[0] == 100
        sock.sendall(b"ping")
        assert read_response(sock, buffer)[:3:2] == (200, b"ping")


def test_idle_keep_alive_timeout() -> None:
    handler = Handler()
    with served(handler, keep_alive_timeout=0.3) as (port, server), connect(port) as sock:
        sock.sendall(b"GET /a HTTP/1.1\r\nHost: x\r\n\r\n")
        assert read_response(sock, bytearray())[2] == b"/a"
        started = time.monotonic()
        assert closed_by_server(sock, timeout=20)  # by its 0.3 s idle timeout, well before the default 30 s one
        assert time.monotonic() - started > 0.25
        assert wait_until(lambda: not server.connections)
        # A request in flight is not cut by the idle timeout.
        with connect(port) as slow:
            slow.sendall(b"GET /sleep/800 HTTP/1.1\r\nHost: x\r\n\r\n")
            assert read_response(slow, bytearray())[2] == b"/sleep/800"


def test_client_leaves_mid_body(caplog: pytest.LogCaptureFixture) -> None:
    handler = Handler()
    with caplog.at_level(logging.DEBUG, "carton"), served(handler) as (port, server):
        with connect(port) as sock:
            sock.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\nonly this")
            assert wait_until(lambda: handler.started)
        assert wait_until(lambda: handler.finished and not server.connections)
        assert handler.failures == ["the client disconnected before sending the whole body"]
        with connect(port) as sock:  # half-closed mid-body: the same
            sock.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\nonly this")
            sock.shutdown(socket.SHUT_WR)
            assert read_response(sock, bytearray())[0] == 400
        assert wait_until(lambda: len(handler.finished) == 2 and not server.connections)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_client_leaves_mid_response(caplog: pytest.LogCaptureFixture) -> None:
    handler = Handler()
    with caplog.at_level(logging.DEBUG), served(handler) as (port, server):
        with connect(port) as sock:
            sock.sendall(b"GET /big HTTP/1.1\r\nHost: x\r\n\r\n")
            assert sock.recv(65536).startswith(b"HTTP/1.1 200 OK\r\n")
        assert wait_until(lambda: handler.finished and not server.connections)
        # The server still answers.
        with connect(port) as sock:
            sock.sendall(b"GET /after HTTP/1.1\r\nHost: x\r\n\r\n")
            assert read_response(sock, bytearray())[2] == b"/after"
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.records


def test_large_responses_wait_for_the_client() -> None:
    handler = Handler()
    with served(handler) as (port, _), connect(port) as sock:
        sock.sendall(b"GET /big HTTP/1.1\r\nHost: x\r\n\r\n" * 3)
        assert wait_until(lambda: handler.started)
        time.sleep(0.5)
        # The client reads nothing: the first answer waits on the socket, and the next request is not started.
        assert handler.started == [b"/big"]
        buffer = bytearray()
        for _ in range(3):
            status, headers, body = read_response(sock, buffer)
            assert status == 200 and int(headers[b"content-length"]) == BIG.nbytes
            assert body == BIG.tobytes()
        assert len(handler.finished) == 3


@pytest.mark.parametrize(
    "request_bytes",
    [
        b"GARBAGE\r\n\r\n",
        b"GET /a HTTP/1.1\r\nHost x\r\n\r\n",
        b"GET /a HTTP/1.1\r\nBad Header: x\r\n\r\n",
        b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
        b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\nabcd",
        b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"3\r\nabc\r\n0\r\n\r\n",
        b"FOO /a HTTP/1.1\r\nHost: x\r\n\r\n",
        b"GET /a HTTP/9.9\r\nHost: x\r\n\r\n",
    ],
    ids=["request-line", "header", "header-name", "content-length", "two-lengths", "length-and-chunked", "method",
         "version"],
)  # fmt: skip
def test_malformed_requests_get_400_and_close(request_bytes: bytes) -> None:
    handler = Handler()
    with served(handler) as (port, _), connect(port) as sock:
        sock.sendall(request_bytes)
        status, headers, body = read_response(sock, bytearray())
        assert (status, headers[b"connection"], body) == (400, b"close", b'{"error":"malformed HTTP request"}')
        assert closed_by_server(sock)
    assert handler.started == []


def test_a_head_too_large_is_refused() -> None:
    handler = Handler()
    with served(handler) as (port, server), connect(port) as sock:
        sock.sendall(b"GET /a HTTP/1.1\r\nHost: x\r\n\r\nGET /b HTTP/1.1\r\nX-Long: ")
        try:
            for _ in range(40):
                sock.sendall(b"a" * 65536)
        except (BrokenPipeError, ConnectionResetError):
            pass
        buffer = bytearray()
        assert read_response(sock, buffer)[2] == b"/a"
        status, headers, body = read_response(sock, buffer)
        assert (status, headers[b"connection"]) == (431, b"close") and b"too large" in body
        assert closed_by_server(sock)
        sock.close()
        assert wait_until(lambda: not server.connections)
    assert handler.started == [b"/a"]


def test_malformed_request_behind_good_ones() -> None:
    handler = Handler()
    with served(handler) as (port, _), connect(port) as sock:
        sock.sendall(b"GET /sleep/100 HTTP/1.1\r\nHost: x\r\n\r\nGET /b HTTP/1.1\r\nHost: x\r\n\r\nNONSENSE\r\n\r\n")
        buffer = bytearray()
        assert read_response(sock, buffer)[2] == b"/sleep/100"
        assert read_response(sock, buffer)[2] == b"/b"
        assert read_response(sock, buffer)[0] == 400
        assert closed_by_server(sock)
        # A chunked body whose framing breaks while its handler reads it: the read is refused, then close.
    with served(handler) as (port, _), connect(port) as sock:
        sock.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nab")
        time.sleep(0.05)
        sock.sendall(b"c\r\nzz\r\n")
        status, headers, body = read_response(sock, bytearray())
        assert status == 400 and b"chunked" in body and headers[b"connection"] == b"close"
        assert closed_by_server(sock)


def test_head_answers_without_a_body() -> None:
    handler = Handler()
    with served(handler) as (port, _), connect(port) as sock:
        sock.sendall(b"HEAD /abc HTTP/1.1\r\nHost: x\r\n\r\nGET /next HTTP/1.1\r\nHost: x\r\n\r\n")
        buffer = bytearray()
        sock.settimeout(10)
        while buffer.count(b"\r\n\r\n") < 2:
            buffer += sock.recv(65536)
        head, _, rest = bytes(buffer).partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 OK") and b"content-length: 4" in head
        assert rest.startswith(b"HTTP/1.1 200 OK") and rest.endswith(b"/next")


def test_handler_failure_is_a_500_and_the_connection_stays() -> None:
    class Failing(Handler):
        async def answer(self, request: HttpRequest) -> HttpResponse:
            if request.raw_path == b"/fail":
                raise RuntimeError("boom")
            return await super().answer(request)

    handler = Failing()
    with served(handler) as (port, _), connect(port) as sock:
        sock.sendall(b"GET /fail HTTP/1.1\r\nHost: x\r\n\r\nGET /ok HTTP/1.1\r\nHost: x\r\n\r\n")
        buffer = bytearray()
        assert read_response(sock, buffer)[0] == 500
        assert read_response(sock, buffer)[2] == b"/ok"


def test_close_waits_for_requests_in_flight() -> None:
    handler = Handler()
    loop = uvloop.new_event_loop()
    try:
        sock = socket.create_server(("127.0.0.1", 0))
        sock.setblocking(False)
        port = sock.getsockname()[1]
        server = loop.run_until_complete(serve_http(handler, sock))
        results: list[bytes] = []

        def client() -> None:
            with connect(port) as conn:
                conn.sendall(b"GET /sleep/300 HTTP/1.1\r\nHost: x\r\n\r\n")
                results.append(read_response(conn, bytearray())[2])

        thread = threading.Thread(target=client)
        thread.start()

        async def until_started() -> None:  # the loop runs only here: the request arrives when the machine lets it
            deadline = time.monotonic() + 30
            while not handler.started:
                assert time.monotonic() < deadline, "the request never arrived"
                await asyncio.sleep(0.01)

        loop.run_until_complete(until_started())
        loop.run_until_complete(server.close())
        thread.join(10)
        assert results == [b"/sleep/300"] and not server.connections
        with pytest.raises(OSError):
            connect(port).close()
    finally:
        loop.close()


def test_one_task_per_connection_answers_its_requests_and_ends_with_it() -> None:
    class Recording(Handler):
        def __init__(self) -> None:
            super().__init__()
            self.tasks: list[asyncio.Task[object] | None] = []
            self.loop: asyncio.AbstractEventLoop | None = None

        async def answer(self, request: HttpRequest) -> HttpResponse:
            self.tasks.append(asyncio.current_task())
            self.loop = asyncio.get_running_loop()
            return await super().answer(request)

    handler = Recording()
    with served(handler) as (port, _):
        with connect(port) as first, connect(port) as second:
            buffer = bytearray()
            for index in range(3):  # one at a time, the task waiting in between
                first.sendall(b"GET /a%d HTTP/1.1\r\nHost: x\r\n\r\n" % index)
                assert read_response(first, buffer)[2] == b"/a%d" % index
            # Pipelined, and a body dropped unread: the next request is still answered, by the same task.
            first.sendall(
                b"GET /sleep/50 HTTP/1.1\r\nHost: x\r\n\r\n"
                b"POST /skip HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc"
                b"GET /last HTTP/1.1\r\nHost: x\r\n\r\n"
            )
            assert [read_response(first, buffer)[2] for _ in range(3)] == [b"/sleep/50", b"/skip", b"/last"]
            second.sendall(b"GET /b HTTP/1.1\r\nHost: x\r\n\r\n")
            assert read_response(second, bytearray())[2] == b"/b"
        first_tasks, second_task = handler.tasks[:-1], handler.tasks[-1]
        assert len(first_tasks) == 6 and all(task is first_tasks[0] for task in first_tasks)
        assert first_tasks[0] is not None and second_task is not first_tasks[0]
        # Once both connections are closed, neither leaves a task behind.
        loop = handler.loop
        assert loop is not None

        def left() -> set[asyncio.Task[object]]:
            return asyncio.run_coroutine_threadsafe(_tasks_left(), loop).result(30)

        assert wait_until(lambda: not ({first_tasks[0], second_task} & left()))


async def _tasks_left() -> set[asyncio.Task[object]]:
    current = asyncio.current_task()
    return {task for task in asyncio.all_tasks() if task is not current}


def test_a_connection_keeps_its_attributes_in_slots() -> None:
    """Past 30 instance attributes CPython 3.11 reads every one of them through a dictionary: the connection, with
    more than that, has slots and no instance dictionary (and neither has any base class)."""
    loop = uvloop.new_event_loop()
    try:
        connection = _Connection(HttpServer(Handler(), loop, 30.0))
    finally:
        loop.close()
    assert not hasattr(connection, "__dict__")
