"""One HTTP/1.1 request on a connection of ``_http_server.py`` (`Exchange`: the `HttpRequest` its handler is given, and
the connection's state of it), and the bytes of a response's status line and last header."""

from __future__ import annotations

import asyncio
import http
from typing import ClassVar

import msgspec

from ._http_messages import FixedHead, HttpRequest, HttpResponse

__all__ = [
    "CLOSE_TAIL",
    "KEEP_ALIVE_TAIL",
    "STATUS_LINES",
    "Exchange",
    "body_left",
    "fixed_wire",
    "response_head",
    "status_line",
]

STATUS_LINES = {
    status.value: b"HTTP/1.1 %d %s\r\n" % (status.value, status.phrase.encode()) for status in http.HTTPStatus
}
KEEP_ALIVE_TAIL = b"\r\n"
CLOSE_TAIL = b"connection: close\r\n\r\n"


def status_line(status: int) -> bytes:
    line = STATUS_LINES.get(status)
    return line if line is not None else b"HTTP/1.1 %d \r\n" % status


def response_head(status: int, headers: list[tuple[bytes, bytes]], length: int, *, keep_alive: bool) -> bytes:
    """A response's status line and headers as written, ``content-length`` and the blank line included."""
    head = [STATUS_LINES.get(status) or status_line(status)]
    for header in headers:
        head.append(b"%s: %s\r\n" % header)
    head.append(b"content-length: %d\r\n" % length)
    head.append(KEEP_ALIVE_TAIL if keep_alive else CLOSE_TAIL)
    return b"".join(head)


def fixed_wire(fixed: FixedHead) -> tuple[bytes, bytes]:
    """`response_head` of `fixed` for a connection kept alive and for one closed after it."""
    return (
        response_head(fixed.status, fixed.headers, fixed.length, keep_alive=True),
        response_head(fixed.status, fixed.headers, fixed.length, keep_alive=False),
    )


class Exchange(HttpRequest, eq=False):
    """One request on a connection, from its first byte to its answer: the `HttpRequest` its handler is given (its
    body set when it is handed over), and the connection's state of it. Made with its method, target and headers
    (those of a learnt head, or empty ones the parser fills in as it reports them); compared by identity."""

    #: Made by the connection (a learnt head's, or the parser's as it reports them), read, never written, by handlers.
    headers: dict[bytes, bytes]
    calls_done: ClassVar[bool] = True
    chunks: list[bytes] = msgspec.field(default_factory=list)
    body_done: bool = False
    #: Its body's framing turned out malformed (chunked encoding): reading it is refused.
    broken: bool = False
    keep_alive: bool = True
    expect_continue: bool = False
    continue_sent: bool = False
    #: Set once the handler answered without reading all of the body: what still comes is dropped.
    discard: bool = False
    #: The handler's read waiting for a chunk.
    waiter: asyncio.Future[None] | None = None
    #: The buffer the whole body was received into (``_http_body.py``), given back once the request is answered.
    held: bytearray | None = None


def body_left(exchange: Exchange, response: HttpResponse) -> bool:
    """Whether `response` leaves the request's body unread for good: a body refused (413), or one the client waits
    for "100 Continue" to send and then may send or not. The connection cannot be reused either way."""
    return not exchange.body_done and (
        response.status == 413 or (exchange.expect_continue and not exchange.continue_sent)
    )
