"""The HTTP/1.1 server of `carton serve`: an `asyncio.Protocol` on httptools that hands each request to an
`HttpHandler` (``HttpApp.handle``) and writes its `HttpResponse`, with no ASGI layer in between.

What it owes a client, per connection:

- keep-alive (HTTP/1.1 by default, HTTP/1.0 with ``Connection: keep-alive``), closed after an idle timeout;
- pipelined requests answered in order, one at a time; reading pauses while too many wait behind the one running;
- the body whole when it has arrived with its headers (the usual small request: no await to read it), else as a
  reader of its chunks, so the handler refuses a too-large or unrouted request before reading it;
- ``Expect: 100-continue`` answered when the handler first reads the body;
- a request answered before its body ended: the rest of the body is discarded and the connection kept, except after
  a 413, when the server stops reading it: it answers with ``Connection: close``, shuts its side and drops whatever
  still comes for a short while (a lingering close), so that the client reads the answer instead of a reset;
- a malformed request (request line, header, ``Content-Length``, chunk framing, both ``Content-Length`` and
  chunked) answered 400 with ``Connection: close``, then closed; a head over 1 MiB answered 431;
- large responses written part by part, waiting for the socket to drain (``pause_writing``/``resume_writing``), and
  the next pipelined request started only once the previous answer has drained;
- a large body whose length is declared is received, once its handler reads it, straight into one buffer
  (``_http_body.py``) that is reused for a later body once the request is answered and nothing refers to it;
- a client that goes away mid-body gets its handler's read refused (`BadRequest`), one that goes away mid-response
  gets nothing more written; neither leaves a task behind or logs a traceback;
- ``HEAD`` answered like ``GET`` without the body;
- a request whose head repeats, byte for byte, one the parser took on this connection is taken without the parser,
  exactly as the parser would have it (``_http_heads.py``); everything else is the parser's.

Reading and parsing the requests is this module's `_Connection`; answering them (the connection's task, writing the
responses, going on with the next or closing) is the `Answering` it inherits from ``_http_answering.py``.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import socket
from typing import cast

import httptools

from ._http_answering import MAX_PIPELINED, MAX_PIPELINED_BYTES, Answering
from ._http_body import BodyBuffers
from ._http_exchange import Exchange
from ._http_heads import GIVE_UP, HEAD_LIMIT, HEADS, KnownHead, learn_head
from ._http_messages import HttpHandler

__all__ = ["HttpServer", "serve_http"]

_log = logging.getLogger("carton.server")

#: Bytes a connection reads before it lets the event loop's other callbacks run: a large body arriving all at once
#: would otherwise be read in one long turn of the loop (many socket reads back to back) while other connections'
#: requests and the runners' replies wait.
_READ_TURN_BYTES = 1 << 20
#: A request line and headers still incomplete after this many bytes are refused with 431 (the parser would keep
#: gathering them; the count may include up to one read's worth of the previous request).
_MAX_HEAD_BYTES = 1 << 20


class _Connection(Answering):
    """One client connection (see the module's docstring for what it guarantees)."""

    # Slots, not a dictionary: past 30 instance attributes CPython 3.11 stops keeping them inline and every
    # `self.x` read becomes a dictionary look-up. (`BodyReading` and `Answering` have the slots of what they use.)
    __slots__ = (
        "fresh", "head_bytes", "head_too_large", "headers", "known", "last_head", "last_known", "learn_from",
        "parsing", "queue", "server", "turn_bytes", "turn_paused", "unused",
    )  # fmt: skip

    def __init__(self, server: HttpServer) -> None:
        self.server = server
        self.buffers = server.buffers
        self.loop = server.loop
        self.handler = server.handler
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        #: The request being parsed (its headers or body may still be arriving), and its headers.
        self.parsing: Exchange | None = None
        self.headers: dict[bytes, bytes] = {}
        #: The request being answered, and the parsed ones waiting behind it.
        self.current: Exchange | None = None
        self.queue: collections.deque[Exchange] = collections.deque()
        self.queued_bytes = 0
        #: The connection's one task, answering its requests one after another for as long as it lives (a task per
        #: request would be made, registered and torn down again for every request), the request it is to answer
        #: next, and what it waits on when there is none.
        self.task: asyncio.Task[None] | None = None
        self.next: Exchange | None = None
        self.idle: asyncio.Future[None] | None = None
        self.reading_paused = False
        #: Reading is paused until the loop's next turn (`_READ_TURN_BYTES`), and what was read since the last pause.
        self.turn_paused = False
        self.turn_bytes = 0
        self.writable = True
        self.drained: asyncio.Future[None] | None = None
        self.closed = False
        #: Lingering after a refused body: everything received is dropped, nothing is parsed.
        self.lingering = False
        #: A malformed request head was received: once the requests before it are answered, 400 and close.
        self.malformed = False
        #: ... or a head over `_MAX_HEAD_BYTES`: 431 instead.
        self.head_too_large = False
        #: The client shut its sending side.
        self.eof = False
        self.last_active = 0.0
        self.idle_timer: asyncio.TimerHandle | None = None
        #: Bytes received since the request being parsed began, while its head is incomplete.
        self.head_bytes = -1
        #: The parser is between two messages and would take a next one: the last it parsed kept the connection
        #: alive (after one that did not, or after an upgrade, it refuses or drops what follows).
        self.fresh = True
        #: Learnt request heads (`_http_heads`): a request that begins at a message boundary with one of these is
        #: taken without the parser, which never sees it and stays at that boundary. While such a request's body
        #: is arriving, the bytes of it still due.
        self.known: dict[bytes, KnownHead] = {}
        self.known_rest = 0
        #: The learnt head a request last began with, and what it stands for: the next request of a client that
        #: repeats itself is taken by comparing its first bytes with it, without slicing, hashing and looking up its
        #: head. (Its first blank line ends it, so a request that begins with it has a head of just those bytes.)
        self.last_head: bytes | None = None
        self.last_known: KnownHead | None = None
        #: Heads learnt since one was last replayed, and what the parser is being fed when it is from a boundary
        #: (the first request it begins there may be learnt).
        self.unused = 0
        self.learn_from: bytes | None = None
        self.sink = None
        self.lent = None

    # ---- asyncio.Protocol ----------------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports are not its subclasses
        self.server.connections.add(self)
        self.last_active = self.loop.time()
        self.idle_timer = self.loop.call_at(self.last_active + self.server.keep_alive_timeout, self._idle_check)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.server.connections.discard(self)
        if self.idle_timer is not None:
            self.idle_timer.cancel()
            self.idle_timer = None
        for exchange in (self.current, self.parsing):
            if exchange is not None and exchange.waiter is not None and not exchange.waiter.done():
                exchange.waiter.set_result(None)
        if self.drained is not None and not self.drained.done():
            self.drained.set_result(None)
        if self.idle is not None and not self.idle.done():
            self.idle.set_result(None)
        self.queue.clear()

    def eof_received(self) -> bool | None:
        self.eof = True
        if self.lingering or (self.current is None and not self.queue):
            return None  # close
        # The client only shut its sending side: what it asked is answered, then the connection closes; a body
        # still being read is cut short.
        for exchange in (self.current, self.parsing):
            if exchange is not None and exchange.waiter is not None and not exchange.waiter.done():
                exchange.waiter.set_result(None)
        return True

    def pause_writing(self) -> None:
        self.writable = False

    def resume_writing(self) -> None:
        self.writable = True
        if self.drained is not None and not self.drained.done():
            self.drained.set_result(None)

    def data_received(self, data: bytes) -> None:
        if self.lingering or self.malformed:
            return
        if self.parsing is None and self.fresh and self.known:
            # The usual request of a client that repeats itself: one whole request of a learnt head, nothing being
            # answered (what `_replay`, then `_start_next`, do for it, in short).
            last = self.last_head
            if last is not None and data.startswith(last):
                end = len(last)
                head = self.last_known
            else:
                end = data.find(b"\r\n\r\n", 0, HEAD_LIMIT) + 4
                head = self.known.get(data[:end])
                if head is not None:
                    self.last_head = data[:end]
                    self.last_known = head
            if head is None:
                rest = data
            elif len(data) - end == head.length and self.current is None and not self.queue:
                self.unused = 0
                exchange = self.current = Exchange(head.method, head.raw_path, head.headers, data[end:], body_done=True)
                idle = self.idle  # (`_hand_over`, inline)
                if idle is not None and self.task is not None and not idle.done():
                    self.next = exchange
                    idle.set_result(None)
                else:
                    self._hand_over(exchange)
                self.turn_bytes += len(data)
                if self.turn_bytes >= _READ_TURN_BYTES:  # (`_read`'s test first: a call fewer per request)
                    self._read(0)
                # (`last_active` is not moved on here: the request is in flight, which keeps the connection open
                # whatever the time, and its end is marked when it is answered.)
                return
            else:
                rest = self._replay(data)
        else:
            rest = self._replay(data) if self.known_rest else data
        self.last_active = self.loop.time()
        if rest:
            if self.parsing is None and self.fresh and self.unused < GIVE_UP:
                self.learn_from = rest
            try:
                self.parser.feed_data(rest)
            except httptools.HttpParserUpgrade:
                # An HTTP/1.1 request that also offers another protocol (websocket, h2c): answered as HTTP/1.1, and
                # the connection is closed after it since the parser stops at the switch (and drops the rest of
                # what it was fed).
                self.fresh = False
                if self.parsing is not None:
                    self.parsing.keep_alive = False
            except httptools.HttpParserError as exc:
                self.learn_from = None
                self._bad_request(exc)
                return
            self.learn_from = None
            if self.head_bytes >= 0:
                self.head_bytes += len(rest)
                if self.head_bytes > _MAX_HEAD_BYTES:
                    self._refuse_head()
                    return
        if self.current is None and self.queue:
            self._start_next()
        elif self.queue and (len(self.queue) > MAX_PIPELINED or self.queued_bytes > MAX_PIPELINED_BYTES):
            self._pause_reading()
        self._read(len(data))

    def _read(self, size: int) -> None:
        """`size` more bytes were read this turn: let the loop's other callbacks run once they come to
        `_READ_TURN_BYTES`."""
        self.turn_bytes += size
        if self.turn_bytes >= _READ_TURN_BYTES and not self.turn_paused and not self.reading_paused and not self.closed:
            self.turn_paused = True
            assert self.transport is not None
            self.transport.pause_reading()
            self.loop.call_soon(self._next_turn)

    def _replay(self, data: bytes) -> bytes:
        """Take the requests at the front of `data` whose heads are learnt (and the body of one still arriving) as
        the parser would, without it; what is left, from the first byte of another head, is the parser's."""
        at = 0
        size = len(data)
        known = self.known
        while True:
            rest = self.known_rest
            if rest:
                end = at + rest
                if end >= size:
                    self.known_rest = end - size
                    self.on_body(data[at:] if at else data)
                    if end == size:
                        self.on_message_complete()
                    return b""
                self.known_rest = 0
                self.on_body(data[at:end])
                self.on_message_complete()
                at = end
            if at == size:
                return b""
            if not self.fresh:
                return data[at:]
            end = data.find(b"\r\n\r\n", at, at + HEAD_LIMIT)
            head = known.get(data[at : end + 4]) if end >= 0 else None
            if head is None:
                return data[at:] if at else data
            self.unused = 0
            at = end + 4
            exchange = self.parsing = Exchange(head.method, head.raw_path, head.headers)
            self.queue.append(exchange)
            if head.length:
                self.known_rest = head.length
            else:
                self.on_message_complete()

    def _learn(self, exchange: Exchange) -> None:
        """Keep the head of `exchange` (the first request the parser began at a boundary in `learn_from`) if it can
        be replayed."""
        data = self.learn_from
        assert data is not None
        self.learn_from = None
        learnt = learn_head(
            data, method=exchange.method, raw_path=exchange.raw_path, headers=exchange.headers,
            keep_alive=exchange.keep_alive,
        )  # fmt: skip
        if learnt is None:
            return
        known = self.known
        if len(known) >= HEADS:
            oldest = next(iter(known))
            del known[oldest]
            if oldest == self.last_head:
                self.last_head = self.last_known = None
        known[learnt[0]] = learnt[1]
        self.unused += 1

    # ---- httptools callbacks -------------------------------------------------------------------------------------
    # httptools calls each of these that the protocol defines, a Python call per callback and per header; a header
    # goes into the dict of the request being parsed, kept on the connection. (A request whose head is learnt is
    # taken by `_replay`, without any of these but the body's.)
    def on_message_begin(self) -> None:
        exchange = self.parsing = Exchange("", b"", {})
        self.headers = exchange.headers
        self.head_bytes = 0

    def on_url(self, url: bytes) -> None:
        exchange = self.parsing
        assert exchange is not None
        exchange.raw_path += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.lower()] = value

    def on_headers_complete(self) -> None:
        exchange = self.parsing
        assert exchange is not None
        parser = self.parser
        self.head_bytes = -1
        exchange.method = parser.get_method().decode("ascii")
        exchange.keep_alive = parser.should_keep_alive()
        expect = exchange.headers.get(b"expect")
        exchange.expect_continue = expect is not None and expect.lower() == b"100-continue"
        self.queue.append(exchange)
        if self.learn_from is not None:
            self._learn(exchange)

    def on_body(self, body: bytes) -> None:
        exchange = self.parsing
        assert exchange is not None
        if exchange.discard:
            return
        exchange.chunks.append(body)
        if exchange is not self.current:
            self.queued_bytes += len(body)
        elif exchange.waiter is not None and not exchange.waiter.done():
            exchange.waiter.set_result(None)

    def on_message_complete(self) -> None:
        exchange = self.parsing
        assert exchange is not None
        self.parsing = None
        self.fresh = exchange.keep_alive
        exchange.body_done = True
        if exchange.waiter is not None and not exchange.waiter.done():
            exchange.waiter.set_result(None)
        if exchange.discard and exchange is self.current:
            self._finish(exchange)

    def _bad_request(self, exc: Exception) -> None:
        """The parser refused what came: nothing more is parsed; the requests before it are answered in order."""
        _log.debug("malformed HTTP request: %s", exc)
        exchange = self.parsing
        if exchange is not None and (exchange is self.current or exchange in self.queue):
            # Its head was fine, its chunked body is not: its handler's read is refused (a 400 naming the body).
            exchange.broken = True
            exchange.keep_alive = False
            if exchange.waiter is not None and not exchange.waiter.done():
                exchange.waiter.set_result(None)
            if exchange.discard and exchange is self.current:  # already answered, its body being dropped
                self._finish(exchange)
                return
        self._stop_parsing()

    def _refuse_head(self) -> None:
        """A request head too large to gather: answered 431 after the requests before it, then closed."""
        _log.debug("HTTP request head over %d bytes", _MAX_HEAD_BYTES)
        self.head_too_large = True
        self._stop_parsing()

    def _next_turn(self) -> None:
        self.turn_paused = False
        self.turn_bytes = 0
        if not self.reading_paused and not self.closed and self.transport is not None:
            self.transport.resume_reading()

    def _pause_reading(self) -> None:
        if not self.reading_paused:
            self.reading_paused = True
            assert self.transport is not None
            self.transport.pause_reading()


class HttpServer:
    """A listening HTTP server (made by `serve_http`); `close` stops it."""

    def __init__(self, handler: HttpHandler, loop: asyncio.AbstractEventLoop, keep_alive_timeout: float) -> None:
        self.handler = handler
        self.loop = loop
        self.keep_alive_timeout = keep_alive_timeout
        self.connections: set[_Connection] = set()
        #: Buffers of large bodies, kept for the next ones (`_Connection._whole`).
        self.buffers = BodyBuffers()
        self.closing = False
        self._server: asyncio.Server | None = None

    async def close(self, timeout: float = 10.0) -> None:
        """Stop accepting, let requests in flight be answered (for at most `timeout` seconds), close every
        connection."""
        self.closing = True
        if self._server is not None:
            self._server.close()
        for connection in list(self.connections):
            connection.shutdown()
        deadline = self.loop.time() + timeout
        while self.connections and self.loop.time() < deadline:
            await asyncio.sleep(0.01)
        for connection in list(self.connections):
            if connection.transport is not None:
                connection.transport.abort()
        # Tasks of aborted connections see the connection closed at their next step and end by themselves.
        if self._server is not None:
            await self._server.wait_closed()


async def serve_http(handler: HttpHandler, sock: socket.socket, *, keep_alive_timeout: float = 30.0) -> HttpServer:
    """Serve `handler` on the listening socket `sock` on the running event loop until `HttpServer.close`."""
    loop = asyncio.get_running_loop()
    server = HttpServer(handler, loop, keep_alive_timeout)
    server._server = await loop.create_server(lambda: _Connection(server), sock=sock, backlog=2048)
    return server
