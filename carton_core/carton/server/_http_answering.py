"""The answering side of a connection of the HTTP/1.1 server (``_http_server.py``'s `_Connection`, which inherits
`Answering`): once a request is parsed, the connection's one task hands it to the handler and writes its
`HttpResponse` (whole in one ``write`` when small, part by part waiting for the socket to drain when large), then
goes on with the next pipelined request or ends the connection: a lingering close after the last answer (or a
refused body), a 400 or 431 for a malformed or too large head once the requests before it are answered, the
keep-alive timeout, the server's shutdown. Reading and parsing the requests is ``_http_server.py``'s.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

from ._http_body import BodyReading
from ._http_exchange import CLOSE_TAIL, Exchange, body_left, fixed_wire, response_head, status_line
from ._http_messages import JOIN_ON_A_THREAD_BYTES, HttpHandler, HttpResponse

if TYPE_CHECKING:
    from ._http_server import HttpServer

__all__ = ["MAX_PIPELINED", "MAX_PIPELINED_BYTES", "Answering"]

_log = logging.getLogger("carton.server")

#: Requests parsed and waiting behind the one being answered before the connection stops reading.
MAX_PIPELINED = 16
#: Body bytes buffered for requests waiting behind the one being answered before the connection stops reading.
MAX_PIPELINED_BYTES = 1 << 20
#: A response whose parts together are at most this size is written with one ``write`` (one system call).
_JOIN_LIMIT = 1 << 16
#: How long a connection refusing a body (413) keeps dropping what the client still sends before closing.
_LINGER_SECONDS = 2.0


class Answering(BodyReading):
    """What a connection (``_http_server.py``'s `_Connection`, which inherits it) does with the requests it parsed:
    answer them in order on its task, then go on or close. The connection sets the attributes (see its
    ``__init__``) and parses the requests."""

    __slots__ = (
        "current", "drained", "handler", "idle", "idle_timer", "last_active", "lingering", "malformed", "next",
        "queued_bytes", "reading_paused", "task",
    )  # fmt: skip

    server: HttpServer
    handler: HttpHandler
    #: The request being answered, and the parsed ones waiting behind it (with their bodies' bytes).
    current: Exchange | None
    queue: collections.deque[Exchange]
    queued_bytes: int
    #: The request being parsed.
    parsing: Exchange | None
    #: The connection's one task, the request it is to answer next, and what it waits on when there is none.
    task: asyncio.Task[None] | None
    next: Exchange | None
    idle: asyncio.Future[None] | None
    #: What a writer waits on while the transport has paused writing.
    drained: asyncio.Future[None] | None
    reading_paused: bool
    lingering: bool
    malformed: bool
    head_too_large: bool
    last_active: float
    idle_timer: asyncio.TimerHandle | None

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
        if self.reading_paused and len(self.queue) <= MAX_PIPELINED and self.queued_bytes <= MAX_PIPELINED_BYTES:
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
