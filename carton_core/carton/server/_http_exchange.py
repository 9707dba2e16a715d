"""One HTTP/1.1 request on a connection of ``_http_server.py`` (`Exchange`: the `HttpRequest` its handler is given, and
the connection's state of it), and the bytes of a response's status line and last header."""

from __future__ import annotations

import asyncio
import http

from ._http_heads import KnownHead
from ._http_messages import HttpRequest, HttpResponse

__all__ = ["CLOSE_TAIL", "KEEP_ALIVE_TAIL", "STATUS_LINES", "Exchange", "body_left", "status_line"]

STATUS_LINES = {
    status.value: b"HTTP/1.1 %d %s\r\n" % (status.value, status.phrase.encode()) for status in http.HTTPStatus
}
KEEP_ALIVE_TAIL = b"\r\n"
CLOSE_TAIL = b"connection: close\r\n\r\n"


def status_line(status: int) -> bytes:
    line = STATUS_LINES.get(status)
    return line if line is not None else b"HTTP/1.1 %d \r\n" % status


class Exchange(HttpRequest):
    """One request on a connection, from its first byte to its answer: the `HttpRequest` its handler is given (its
    body set when it is handed over), and the connection's state of it."""

    __slots__ = (
        "body_done",
        "broken",
        "chunks",
        "continue_sent",
        "discard",
        "expect_continue",
        "keep_alive",
        "waiter",
    )

    def __init__(self, known: KnownHead | None = None) -> None:
        # A request of a learnt head is made with its fields; the parser's are filled in as the parser reports them.
        if known is None:
            self.method = ""
            self.raw_path = b""
            self.headers: dict[bytes, bytes] = {}
        else:
            self.method = known.method
            self.raw_path = known.raw_path
            self.headers = known.headers  # read, never written, by handlers
        self.body = b""
        self.chunks: list[bytes] = []
        self.body_done = False
        #: Its body's framing turned out malformed (chunked encoding): reading it is refused.
        self.broken = False
        self.keep_alive = True
        self.expect_continue = False
        self.continue_sent = False
        #: Set once the handler answered without reading all of the body: what still comes is dropped.
        self.discard = False
        #: The handler's read waiting for a chunk.
        self.waiter: asyncio.Future[None] | None = None


def body_left(exchange: Exchange, response: HttpResponse) -> bool:
    """Whether `response` leaves the request's body unread for good: a body refused (413), or one the client waits
    for "100 Continue" to send and then may send or not. The connection cannot be reused either way."""
    return not exchange.body_done and (
        response.status == 413 or (exchange.expect_continue and not exchange.continue_sent)
    )
