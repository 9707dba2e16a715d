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
"""

from __future__ import annotations

import asyncio
import collections
import logging
import socket
from collections.abc import Coroutine
from typing import Any, cast

import httptools

from ._http_body import BodyBuffers, BodyReading
from ._http_exchange import CLOSE_TAIL, Exchange, body_left, fixed_wire, response_head, status_line
from ._http_heads import GIVE_UP, HEAD_LIMIT, HEADS, KnownHead, learn_head
from ._http_messages import JOIN_ON_A_THREAD_BYTES, HttpHandler, HttpResponse

__all__ = ["HttpServer", "serve_http"]

_log = logging.getLogger("carton.server")

#: Requests parsed and waiting behind the one being answered before the connection stops reading.
_MAX_PIPELINED = 16
#: Body bytes buffered for requests waiting behind the one being answered before the connection stops reading.
_MAX_PIPELINED_BYTES = 1 << 20
#: Bytes a connection reads before it lets the event loop's other callbacks run: a large body arriving all at once
#: would otherwise be read in one long turn of the loop (many socket reads back to back) while other connections'
#: requests and the runners' replies wait.
_READ_TURN_BYTES = 1 << 20
#: A response whose parts together are at most this size is written with one ``write`` (one system call).
_JOIN_LIMIT = 1 << 16
#: How long a connection refusing a body (413) keeps dropping what the client still sends before closing.
_LINGER_SECONDS = 2.0
#: A request line and headers still incomplete after this many bytes are refused with 431 (the parser would keep
#: gathering them; the count may include up to one read's worth of the previous request).
_MAX_HEAD_BYTES = 1 << 20


class _Connection(BodyReading):
    """One client connection (see the module's docstring for what it guarantees)."""

    # Slots, not a dictionary: past 30 instance attributes CPython 3.11 stops keeping them inline and every
    # `self.x` read becomes a dictionary look-up. (`BodyReading` has the slots of what it uses.)
    __slots__ = (
        "current", "drained", "fresh", "handler", "head_bytes", "head_too_large", "headers", "idle", "idle_timer",
        "known", "last_active", "last_head", "last_known", "learn_from", "lingering", "malformed", "next", "parsing",
        "queue", "queued_bytes", "reading_paused", "server", "task", "turn_bytes", "turn_paused", "unused",
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
        elif self.queue and (len(self.queue) > _MAX_PIPELINED or self.queued_bytes > _MAX_PIPELINED_BYTES):
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

    # ---- answering -----------------------------------------------------------------------------------------------
    def _start_next(self) -> None:
        exchange = self.queue.popleft()
        self.current = exchange
        chunks = exchange.chunks
        if self.queued_bytes and chunks:
            self.queued_bytes -= sum(map(len, chunks))
        if exchange.body_done and (len(chunks) == 1 or sum(map(len, chunks)) < JOIN_ON_A_THREAD_BYTES):
            exchange.chunks = []
            body: Any = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        else:  # the handler's reader hands the pieces over one by one and joins them once (`collect_body`)
            body = self._reader(exchange)
        if self.reading_paused and len(self.queue) <= _MAX_PIPELINED and self.queued_bytes <= _MAX_PIPELINED_BYTES:
            self.reading_paused = False
            assert self.transport is not None
            self.transport.resume_reading()
        exchange.body = body
        self._hand_over(exchange)

    def _hand_over(self, exchange: Exchange) -> None:
        """Give `exchange` (now `current`) to the connection's task."""
        if self.task is None:
            self.task = self.loop.create_task(self._serve(exchange))
            return
        self.next = exchange
        idle = self.idle
        if idle is not None and not idle.done():
            idle.set_result(None)

    async def _serve(self, exchange: Exchange) -> None:
        """The connection's task: answer `exchange`, then each request `_start_next` hands over, until the
        connection closes. (The answer's steps are plain methods around the handler's await: a coroutine per
        request would be made and stepped through on every request.)"""
        try:
            while True:
                try:
                    response = await self.handler(exchange)
                except Exception:
                    _log.exception("the HTTP handler failed on %s %r", exchange.method, exchange.raw_path[:200])
                    response = HttpResponse(
                        500, [(b"content-type", b"text/plain; charset=utf-8")], [b"Internal Server Error"]
                    )
                if response.done is not None:
                    self.lent = response.done
                if self.closed:
                    self._finish(exchange)
                else:
                    if (
                        (not exchange.body_done and body_left(exchange, response))
                        or exchange.broken
                        or self.eof
                        or self.server.closing
                    ):
                        exchange.keep_alive = False
                    rest = self._write(exchange, response)
                    if rest is not None:
                        await rest
                    if self.lent is not None:
                        await self._flushed()
                    if not exchange.body_done or self.closed:
                        self._answered(exchange, response)
                    elif exchange.keep_alive and not self.queue and not self.reading_paused:
                        # The usual end of a request (what `_finish` does for it): nothing waits behind it.
                        self.current = None
                        self.last_active = self.loop.time()
                        if self.malformed or self.server.closing or self.eof:
                            self._finish_idle()
                    else:
                        self._finish(exchange)
                if self.lent is not None:
                    self._return_lent()
                if exchange.held is not None:
                    self._give_back(exchange)
                if self.next is None:
                    if self.closed:
                        return
                    self.idle = self.loop.create_future()
                    await self.idle
                    self.idle = None
                    if self.next is None:  # woken by the connection's end
                        return
                exchange = self.next
                self.next = None
        except Exception:
            # Not a handler's failure (answered with 500 above): the connection cannot go on.
            _log.exception("answering an HTTP request failed")
            if self.transport is not None:
                self.transport.abort()
        finally:
            self.task = None
            if self.lent is not None:
                self._return_lent()

    def _answered(self, exchange: Exchange, response: HttpResponse) -> None:
        """`response` is written: go on with the connection (see `_finish`), unless the request's body is left or
        still arriving."""
        if self.closed:
            self._finish(exchange)
            return
        if not exchange.body_done:
            if body_left(exchange, response):
                self._linger()
                return
            if exchange.keep_alive:
                exchange.discard = True  # the rest of the body is dropped; the next request starts after it
                exchange.chunks = []
                return
        self._finish(exchange)

    def _write(self, exchange: Exchange, response: HttpResponse) -> Coroutine[Any, Any, None] | None:
        """Write the response's head and as much of its body as goes without waiting; what is left to wait for
        (the parts of a large body, a full socket buffer) comes back as a coroutine. The usual response is written
        whole here, without one."""
        transport = self.transport
        assert transport is not None
        parts = response.parts
        fixed = response.fixed
        if fixed is not None:  # a head made before: its bytes are kept with it
            length = fixed.length
            wire = fixed.wire
            if wire is None:
                wire = fixed.wire = fixed_wire(fixed)
            head = wire[0] if exchange.keep_alive else wire[1]
        else:
            length = response.content_length()
            head = response_head(response.status, response.headers, length, keep_alive=exchange.keep_alive)
        if exchange.method == "HEAD" or not length:
            transport.write(head)
        elif length <= _JOIN_LIMIT:
            transport.write(b"".join([head, *parts]))
        else:
            transport.write(head)
            return self._write_parts(parts)
        return None if self.writable else self._drain()

    async def _write_parts(self, parts: list[Any]) -> None:
        transport = self.transport
        assert transport is not None
        for part in parts:
            if self.closed:
                return
            transport.write(part)
            if not self.writable:
                await self._drain()
        if not self.writable:
            await self._drain()

    async def _drain(self) -> None:
        while not self.writable and not self.closed:
            self.drained = self.loop.create_future()
            await self.drained
            self.drained = None

    def _finish(self, exchange: Exchange) -> None:
        """The answer to `exchange` is written (or cannot be): close, or go on with the next request."""
        self.current = None
        self.last_active = self.loop.time()
        if self.closed:
            return
        assert self.transport is not None
        if not exchange.keep_alive:
            self._shut()
        elif self.queue:
            self._start_next()
        elif self.malformed or self.server.closing or self.eof:
            self._finish_idle()
        elif self.reading_paused:
            self.reading_paused = False
            self.transport.resume_reading()

    def _finish_idle(self) -> None:
        """Nothing is left to answer: refuse a malformed request that came after, or close if asked to."""
        assert self.transport is not None
        if self.malformed:
            self._write_bad_request()
        elif self.server.closing or self.eof:
            self.transport.close()

    def _linger(self) -> None:
        """Stop reading the refused body: shut the sending side, drop what the client still sends for a while."""
        self.current = None
        self.queue.clear()
        self._shut()

    def _shut(self) -> None:
        """Shut the sending side after the last answer and drop whatever still comes, closing at the client's end of
        sending or after `_LINGER_SECONDS`: closing at once with unread bytes would send a reset, which can make the
        client lose the answer."""
        assert self.transport is not None
        if self.eof:  # the client has finished sending: nothing can be left unread
            self.transport.close()
            return
        self.lingering = True
        if self.reading_paused:
            self.reading_paused = False
            self.transport.resume_reading()
        if self.transport.can_write_eof():
            self.transport.write_eof()
        else:
            self.transport.close()
        self.loop.call_later(_LINGER_SECONDS, self._abort)

    def _abort(self) -> None:
        if not self.closed and self.transport is not None:
            self.transport.close()

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

    def _stop_parsing(self) -> None:
        """Nothing more is parsed; the refusal is written once the requests before it are answered."""
        self.malformed = True
        if self.current is None:
            if self.queue:
                self._start_next()
            else:
                self._write_bad_request()

    def _write_bad_request(self) -> None:
        assert self.transport is not None
        if self.head_too_large:
            status, body = 431, b'{"error":"the request line and headers are too large"}'
        else:
            status, body = 400, b'{"error":"malformed HTTP request"}'
        self.transport.write(
            b"%scontent-type: application/json\r\ncontent-length: %d\r\n%s%s"
            % (status_line(status), len(body), CLOSE_TAIL, body)
        )
        self._shut()

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

    def _idle_check(self) -> None:
        """Close a connection with no request in flight once it has been quiet for the keep-alive timeout."""
        self.idle_timer = None
        if self.closed:
            return
        now = self.loop.time()
        due = self.last_active + self.server.keep_alive_timeout
        if self.current is None and not self.queue and now >= due:
            assert self.transport is not None
            self.transport.close()
            return
        # One timer per connection, moved on when it fires early, rather than one per request.
        self.idle_timer = self.loop.call_at(due if due > now else now + 1.0, self._idle_check)

    def shutdown(self) -> None:
        """The server stops: close now if nothing is being answered, else after the current answer."""
        if self.current is None and not self.queue and self.transport is not None:
            self.transport.close()


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
