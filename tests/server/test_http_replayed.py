"""A request of a learnt head, taken whole in `data_received` and handed to the waiting connection task, is answered as
one the parser took: whatever the handler awaits, `asyncio.current_task`, `asyncio.timeout`, a failure, a large
answer, requests pipelined behind it and a client that goes away mid-request. Over real sockets on 127.0.0.1; each
request is sent three times, the first time parsed (its head learnt), then replayed, and the answers must be the
same."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from carton.server._http_messages import HttpRequest, HttpResponse
from carton.server._http_server import HttpServer

from .test_http_transport import connect, read_response, served, wait_until

uvloop = pytest.importorskip("uvloop")


def request(path: bytes, body: bytes = b"0123456789") -> bytes:
    return b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (path, len(body), body)


class Odd:
    """An awaitable that yields what is not a future (a task throws a RuntimeError into its awaiter)."""

    def __await__(self) -> Any:
        yield 42


class Handler:
    """Answers by path, awaiting in the ways a handler may; records per request whether the current task was the
    connection's own before and after each await."""

    def __init__(self) -> None:
        self.server: HttpServer | None = None
        self.seen: list[tuple[bytes, bool]] = []

    async def __call__(self, request: HttpRequest) -> HttpResponse:
        assert self.server is not None
        connections = list(self.server.connections)
        task = asyncio.current_task()
        own = task is not None and any(connection.task is task for connection in connections)
        path = request.raw_path
        status = 200
        if path == b"/yield":
            await asyncio.sleep(0)
        elif path == b"/later":
            await asyncio.sleep(0.05)
        elif path == b"/thread":
            await asyncio.to_thread(time.sleep, 0.01)
        elif path == b"/future":
            future = asyncio.get_running_loop().create_future()
            asyncio.get_running_loop().call_later(0.01, future.set_result, None)
            await future
        elif path == b"/timeout":
            try:
                async with asyncio.timeout(0.05):
                    await asyncio.sleep(10)
            except TimeoutError:
                status = 504
            assert task is not None and task.cancelling() == 0  # the timeout's cancellation was taken back
        elif path == b"/fail":
            raise ValueError("the handler failed")
        elif path == b"/odd":
            await Odd()
        elif path == b"/large":
            await asyncio.sleep(0)
            return HttpResponse(200, [], [bytes(range(256)) * 2000])
        own = own and asyncio.current_task() is task
        self.seen.append((path, own))
        assert isinstance(request.body, bytes)
        return HttpResponse(status, [(b"x-path", path)], [path + b" " + request.body])


@pytest.mark.parametrize("path", [b"/plain", b"/yield", b"/later", b"/thread", b"/future", b"/timeout", b"/large"])
def test_a_replayed_request_is_answered_as_a_parsed_one(path: bytes) -> None:
    handler = Handler()
    with served(handler) as (port, server), connect(port) as sock:  # type: ignore[arg-type]
        handler.server = server
        buffer = bytearray()
        answers = []
        for _ in range(3):
            sock.sendall(request(path))
            answers.append(read_response(sock, buffer))
        # Then another request on the same connection, after whatever the first ones left.
        sock.sendall(request(b"/plain", b"after"))
        assert read_response(sock, buffer)[2] == b"/plain after"
    assert answers[0] == answers[1] == answers[2]
    status, _, body = answers[0]
    if path == b"/large":
        assert (status, body) == (200, bytes(range(256)) * 2000)
        return
    assert (status, body) == (504 if path == b"/timeout" else 200, path + b" 0123456789")
    # The current task was the connection's throughout.
    assert handler.seen[:3] == [(path, True)] * 3


@pytest.mark.parametrize("path", [b"/fail", b"/odd"])
def test_a_failing_handler_of_a_replayed_request_gets_a_500_and_the_connection_goes_on(
    path: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    handler = Handler()
    with served(handler) as (port, server), connect(port) as sock:  # type: ignore[arg-type]
        handler.server = server
        buffer = bytearray()
        for _ in range(3):
            sock.sendall(request(path))
            assert read_response(sock, buffer)[0] == 500
        sock.sendall(request(b"/plain"))
        assert read_response(sock, buffer)[2] == b"/plain 0123456789"
    assert caplog.text.count(f"the HTTP handler failed on POST {path!r}") == 3


def test_requests_pipelined_behind_a_replayed_one_are_answered_in_order() -> None:
    handler = Handler()
    with served(handler) as (port, server), connect(port) as sock:  # type: ignore[arg-type]
        handler.server = server
        buffer = bytearray()
        for path in (b"/later", b"/plain"):  # both heads learnt
            sock.sendall(request(path))
            read_response(sock, buffer)
        sock.sendall(request(b"/later", b"first....."))  # the same head, replayed: it waits 50 ms ...
        assert wait_until(lambda: any(c.current is not None for c in server.connections))
        # ... while these arrive behind it, learnt and not, in one piece.
        behind = request(b"/plain", b"second....") + request(b"/other", b"third") + request(b"/plain", b"fourth....")
        sock.sendall(behind)
        bodies = [read_response(sock, buffer)[2] for _ in range(4)]
    assert bodies == [b"/later first.....", b"/plain second....", b"/other third", b"/plain fourth...."]
    assert [path for path, _ in handler.seen[2:]] == [b"/later", b"/plain", b"/other", b"/plain"]


def test_a_client_that_goes_away_mid_request_leaves_nothing_behind() -> None:
    handler = Handler()
    with served(handler) as (port, server):  # type: ignore[arg-type]
        handler.server = server
        with connect(port) as sock:
            sock.sendall(request(b"/later"))
            read_response(sock, bytearray())
            sock.sendall(request(b"/later", b"gone......"))  # replayed, then the client closes under it
            assert wait_until(lambda: any(c.current is not None for c in server.connections))
        assert wait_until(lambda: not server.connections)
        assert wait_until(lambda: len(handler.seen) == 2)  # the handler ran to its end all the same
        assert handler.seen[1] == (b"/later", True)
        with connect(port) as sock:  # the server goes on
            sock.sendall(request(b"/plain"))
            assert read_response(sock, bytearray())[2] == b"/plain 0123456789"


def test_a_handler_that_is_not_a_coroutine_is_awaited() -> None:
    class Plain:
        def __init__(self) -> None:
            self.calls = 0

        def __call__(self, request: HttpRequest) -> Any:
            self.calls += 1
            future = asyncio.get_running_loop().create_future()
            asyncio.get_running_loop().call_soon(future.set_result, HttpResponse(200, [], [request.body]))
            return future

    handler = Plain()
    with served(handler) as (port, _), connect(port) as sock:  # type: ignore[arg-type]
        buffer = bytearray()
        for _ in range(3):
            sock.sendall(request(b"/plain"))
            assert read_response(sock, buffer)[2] == b"0123456789"
    assert handler.calls == 3
