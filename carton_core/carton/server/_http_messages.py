"""The seam between the KServe v2 HTTP protocol and whatever carries HTTP: one request in, one response out.

`HttpApp.handle` (``_http.py``) takes an `HttpRequest` and returns an `HttpResponse`; it parses, routes, runs and
encodes, and knows nothing of sockets, ASGI or Ray. A transport adapts to it:

- ``_http_server.py`` (what `carton serve` runs) builds them straight from its HTTP/1.1 parser;
- `AsgiAdapter` turns an ASGI server's scope/receive/send into these;
- ``carton.ray`` builds `HttpRequest`s from Serve's ASGI messages at its ingress and hands the same objects (with the
  body read into bytes) to the replica that holds the model.

A transport owes the handler: the method, the raw request target (percent-encoded, as sent, so that an encoded slash
stays inside its path segment), header names in lower case, and the body either whole or as a reader of its chunks
(so a handler can refuse a too-large or unrouted request before reading it). It sends the response's parts in order
after a ``content-length`` of their total size, which the transport adds.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from typing import Any, ClassVar

import msgspec

from ._bounded import remember
from .errors import BadRequest, RequestTooLarge

__all__ = [
    "DIGITS",
    "JOIN_ON_A_THREAD_BYTES",
    "AsgiAdapter",
    "BodyReader",
    "FixedHead",
    "HttpHandler",
    "HttpRequest",
    "HttpResponse",
    "Message",
    "Receive",
    "Scope",
    "Send",
    "collect_body",
    "read_digits",
    "whole_body",
]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

#: Returns the next chunk of a request body and whether more follows; `BadRequest` if the client went away.
BodyReader = Callable[[], Awaitable[tuple[bytes, bool]]]


class HttpRequest(msgspec.Struct):
    """One HTTP request as a transport hands it to `HttpApp.handle` (positional construction is allowed: it is made
    once per request on the hot path; a struct, made without a Python-level ``__init__``)."""

    method: str
    #: The request target as sent: percent-encoded, possibly with a query (ignored).
    raw_path: bytes
    #: Header names in lower case (HTTP/2 and ASGI already give them so).
    headers: Mapping[bytes, bytes]
    #: The whole body, or a reader of its chunks (read only by the endpoints that take a body).
    body: bytes | bytearray | BodyReader = b""
    #: Whether the transport calls a response's `HttpResponse.done` once it is written (``_http_server.py`` does).
    calls_done: ClassVar[bool] = False


class FixedHead:
    """The status, headers and content length of every response of one kind, made once and given again with each
    (`HttpResponse.fixed`), so that a transport can keep what it makes of them (`wire`) instead of making it again.
    Neither its fields nor its headers list are ever changed."""

    __slots__ = ("headers", "length", "status", "wire")

    def __init__(self, status: int, headers: list[tuple[bytes, bytes]], length: int) -> None:
        self.status = status
        self.headers = headers
        self.length = length
        #: The transport's own rendering of this head, made the first time it writes it.
        self.wire: Any = None


class HttpResponse(msgspec.Struct):
    """A status, headers (without ``content-length``, which the transport adds) and the body's parts in order.

    Parts are ``bytes`` or buffers (binary tensor outputs are sent from the arrays' own memory). `fixed`, when given,
    says the same as `status`, `headers` and the parts' total size (its headers are `headers` itself); a transport
    may go by either. (A struct rather than a dataclass: one is made per request, and a struct is made without a
    Python-level ``__init__``.)"""

    status: int
    headers: list[tuple[bytes, bytes]] = msgspec.field(default_factory=list)
    parts: list[Any] = msgspec.field(default_factory=list)
    fixed: FixedHead | None = None
    #: For a request whose transport `HttpRequest.calls_done`: called once the parts are written (nothing of them
    #: is held by the transport any more) or can no longer be; the parts may lie in memory lent until then.
    done: Callable[[], None] | None = None

    def content_length(self) -> int:
        if self.fixed is not None:
            return self.fixed.length
        parts = self.parts
        if len(parts) == 1 and type(parts[0]) is bytes:
            return len(parts[0])
        length = 0
        for part in parts:
            length += part.nbytes if type(part) is memoryview else len(part)
        return length

    def body(self) -> bytes:
        """The parts joined (what a transport that cannot send buffers one by one sends)."""
        return self.parts[0] if len(self.parts) == 1 and isinstance(self.parts[0], bytes) else b"".join(self.parts)


HttpHandler = Callable[[HttpRequest], Awaitable[HttpResponse]]

#: A body at least this large is joined from its pieces off the event loop (`collect_body`).
JOIN_ON_A_THREAD_BYTES = 1 << 20

#: Header values of digits only met so far, and the numbers they say (``Content-Length``,
#: ``Inference-Header-Content-Length``): a client repeats them, and a learnt head's values are the same objects
#: every time (their hashes kept), so a look-up costs less than reading the number again.
DIGITS: dict[bytes, int] = {}
_DIGITS_KEPT = 256


def read_digits(value: bytes) -> int | None:
    """The number `value` says if it is digits only (then kept in `DIGITS`), else None."""
    if not value.isdigit():
        return None
    return remember(DIGITS, value, int(value), _DIGITS_KEPT)


def whole_body(body: bytes | bytearray, *, declared: bytes | None, limit: int) -> bytes | bytearray:
    """`collect_body` of a body that arrived whole, without an await."""
    if declared is not None:
        size = DIGITS.get(declared)
        if size is None:
            size = read_digits(declared)
            if size is None:
                if not declared.strip().isdigit():
                    raise BadRequest("Content-Length is not a number")
                size = int(declared)
        if size > limit:
            raise RequestTooLarge(f"request body of {size} bytes is over the {limit}-byte limit")
    if len(body) > limit:
        raise RequestTooLarge(f"request body is over the {limit}-byte limit")
    return body


async def collect_body(
    body: bytes | bytearray | BodyReader, *, declared: bytes | None, limit: int
) -> bytes | bytearray:
    """The whole body, refused with 413 over `limit` bytes: before reading when ``Content-Length`` (`declared`) says
    so, and while reading otherwise (chunked bodies). Not decompressed."""
    if not callable(body):
        return whole_body(body, declared=declared, limit=limit)
    whole_body(b"", declared=declared, limit=limit)  # the declared length's checks, before any byte is read
    whole = getattr(body, "whole", None)
    if whole is not None and declared is not None:
        # A transport that can receive the body into one buffer as it arrives (``_http_server.py``): a large one
        # whose length is known is read so, without the pieces and their join.
        size = DIGITS.get(declared)
        if size is None:
            size = int(declared)
        if size >= JOIN_ON_A_THREAD_BYTES:
            buffer: bytearray = await whole(size)
            return buffer
    chunks: list[bytes] = []
    size = 0
    while True:
        chunk, more = await body()
        if chunk:
            size += len(chunk)
            if size > limit:
                raise RequestTooLarge(f"request body is over the {limit}-byte limit")
            chunks.append(chunk)
        if not more:
            break
    if len(chunks) == 1:
        return chunks[0]
    if size >= JOIN_ON_A_THREAD_BYTES:
        # Joining copies the whole body (and faults its fresh pages in): on a worker thread, where it releases the GIL,
        # the event loop keeps answering other requests meanwhile.
        return await asyncio.to_thread(b"".join, chunks)
    return b"".join(chunks)


class AsgiAdapter:
    """An ASGI 3 application serving `handler` (HTTP only; other scope types are ignored)."""

    __slots__ = ("handler",)

    def __init__(self, handler: HttpHandler) -> None:
        self.handler = handler

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return

        async def read() -> tuple[bytes, bool]:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise BadRequest("the client disconnected before sending the whole body")
            return message.get("body", b""), message.get("more_body", False)

        raw_path = scope.get("raw_path") or scope["path"].encode()
        response = await self.handler(HttpRequest(scope["method"], raw_path, dict(scope["headers"]), read))
        # The start message with the parts' total as content-length, then each part (inline: the hot path).
        headers = [*response.headers, (b"content-length", b"%d" % response.content_length())]
        await send({"type": "http.response.start", "status": response.status, "headers": headers})
        parts = response.parts or [b""]
        last = len(parts) - 1
        for index, part in enumerate(parts):
            await send({"type": "http.response.body", "body": part, "more_body": index < last})
