"""Request heads learnt per HTTP connection: a client sends the same request line and headers, byte for byte, for
every request of one shape, so a head the parser has already taken stands for what it gave.

A head is learnt (`learn_head`) only when replaying it is exactly what the parser would do with the same bytes: it
is checked by parsing it again on a parser of its own, which must end the head at its last byte, give the same
method, target and headers, keep the connection alive and end the message after ``Content-Length`` more bytes. A
head that changes how the bytes after it are read (``Transfer-Encoding``, ``Expect``, an upgrade, no
``Content-Length``) or that is long is never learnt.
"""

from __future__ import annotations

from dataclasses import dataclass

import httptools

__all__ = ["GIVE_UP", "HEADS", "HEAD_LIMIT", "KnownHead", "learn_head"]

#: The longest head learnt: a client's usual head is a few hundred bytes, and a connection keeps what it learnt.
HEAD_LIMIT = 4096
#: Heads a connection keeps (the oldest is dropped for a new one): a client sends a few shapes of request.
HEADS = 8
#: Heads learnt in a row with no request replaying one: past this many, a connection learns no more until one is.
GIVE_UP = 16
#: The largest body a learnt head may announce: the check parses a body of that size once, and a large request's
#: head is a small part of its cost anyway.
_BODY_LIMIT = 1 << 16


@dataclass(frozen=True, slots=True, kw_only=True)
class KnownHead:
    """What the parser took from a learnt head: the method, the request target and the headers (names in lower
    case, shared by every request of this head: a handler only reads them), and the body's length."""

    method: str
    raw_path: bytes
    headers: dict[bytes, bytes]
    length: int


class _Probe:
    """The callbacks of the parser that checks a head: what it reports, and when."""

    __slots__ = ("body", "complete", "headers", "headers_done", "keep_alive", "messages", "method", "parser", "url")

    def __init__(self) -> None:
        self.parser = httptools.HttpRequestParser(self)
        self.method = b""
        self.keep_alive = False
        self.url = b""
        self.headers: dict[bytes, bytes] = {}
        self.headers_done = False
        self.body = 0
        self.complete = False
        self.messages = 0

    def on_message_begin(self) -> None:
        self.messages += 1

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.lower()] = value

    def on_headers_complete(self) -> None:
        self.headers_done = True
        self.method = self.parser.get_method()
        self.keep_alive = self.parser.should_keep_alive()

    def on_body(self, body: bytes) -> None:
        self.body += len(body)

    def on_message_complete(self) -> None:
        self.complete = True


def learn_head(
    data: bytes, *, method: str, raw_path: bytes, headers: dict[bytes, bytes], keep_alive: bool
) -> tuple[bytes, KnownHead] | None:
    """The head that `data` begins with and what it means, if it can be replayed: `data` is what a connection's
    parser was fed from a message boundary, and `method`, `raw_path`, `headers` and `keep_alive` what it made of the
    request it began with. None if the head is not to be learnt."""
    if not keep_alive or b"transfer-encoding" in headers or b"expect" in headers or b"upgrade" in headers:
        return None
    if b"upgrade" in headers.get(b"connection", b"").lower():
        return None
    declared = headers.get(b"content-length")
    if declared is None or not declared.isdigit() or len(declared) > 9 or int(declared) > _BODY_LIMIT:
        return None
    length = int(declared)
    end = data.find(b"\r\n\r\n", 0, HEAD_LIMIT)
    if end < 0:
        return None
    head = data[: end + 4]
    probe = _Probe()
    parser = probe.parser
    try:
        # The head must end at its last byte (not earlier, at a bare line feed the parser takes as a line's end).
        parser.feed_data(head[:-1])
        if probe.headers_done:
            return None
        parser.feed_data(head[-1:])
        if not probe.headers_done or probe.body or probe.complete != (length == 0):
            return None
        if length:  # and the message must end after exactly the declared length
            parser.feed_data(bytes(length - 1))
            if probe.complete:
                return None
            parser.feed_data(b"\0")
    except (httptools.HttpParserError, httptools.HttpParserUpgrade):
        return None
    if not probe.complete or probe.messages != 1 or probe.body != length:
        return None
    if not probe.keep_alive or probe.method.decode("ascii") != method:
        return None
    if probe.url != raw_path or probe.headers != headers:
        return None
    return head, KnownHead(method=method, raw_path=raw_path, headers=headers, length=length)
