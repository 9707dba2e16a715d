"""Request bodies for the HTTP/1.1 server, a large one received into one buffer as it arrives, and the memory a
response lends given back once it is written.

`BodyReading` is the part of a connection (``_http_server.py``'s, which inherits it through ``_http_answering.py``'s
`Answering`) that reads a request body for its handler and gives back what a response lent. A body read piece by
piece and joined afterwards is copied twice in this process, once by the event loop into a new ``bytes`` per socket
read and once more into the joined whole, and the whole is fresh memory: a buffer of that size lies above glibc's
largest mmap threshold, so it is mapped anew and page-faulted in on every request. `BodySink` instead takes the
transport's reads itself (an `asyncio.BufferedProtocol`, the connection's protocol for as long as the body arrives):
the kernel copies the body straight into one buffer, which `BodyBuffers` keeps for the next large body once nothing
holds it any more.
"""

from __future__ import annotations

import abc
import asyncio
import collections
import logging
import sys
from collections.abc import Callable, Coroutine, Iterable
from typing import Any, Protocol

import httptools

from ._http_exchange import Exchange
from ._http_messages import JOIN_ON_A_THREAD_BYTES
from .errors import BadRequest

__all__ = ["BodyBuffers", "BodyReading", "BodySink", "SinkOwner", "copy_into"]

_log = logging.getLogger("carton.server")


class SinkOwner(Protocol):
    """What `BodySink` hands the connection: the reads, and the transport's other callbacks."""

    def sunk(self, size: int) -> None: ...
    def connection_lost(self, exc: Exception | None) -> None: ...
    def eof_received(self) -> bool | None: ...
    def pause_writing(self) -> None: ...
    def resume_writing(self) -> None: ...


class BodySink(asyncio.BufferedProtocol):
    """The transport's protocol while the rest of one body arrives: each read lands in `buffer` after what came
    before, and never past the body's end (so the next pipelined request stays in the socket for the connection's
    own reads); `SinkOwner.sunk` is told how much came."""

    __slots__ = ("filled", "owner", "view")

    def __init__(self, owner: SinkOwner, buffer: bytearray, filled: int) -> None:
        self.owner = owner
        self.view = memoryview(buffer)
        self.filled = filled

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.view[self.filled :]

    def buffer_updated(self, nbytes: int) -> None:
        self.filled += nbytes
        self.owner.sunk(nbytes)

    def done(self) -> None:
        """Let go of the buffer (its memoryview is an export that keeps it from being reused or resized)."""
        self.view.release()

    def connection_lost(self, exc: Exception | None) -> None:
        self.owner.connection_lost(exc)

    def eof_received(self) -> bool | None:
        return self.owner.eof_received()

    def pause_writing(self) -> None:
        self.owner.pause_writing()

    def resume_writing(self) -> None:
        self.owner.resume_writing()


#: A buffer given back is kept only while the kept ones together stay within this many bytes.
_KEEP_BYTES = 256 << 20
#: ... and this many buffers.
_KEEP_COUNT = 4


class BodyBuffers:
    """Large body buffers kept for reuse by the connections of one server (used from its event loop's thread only).
    A buffer is taken for one body and given back once the request is answered; it is kept only if nothing else
    refers to it then (no array, view or exception still over it), so a reused buffer is never one someone still
    reads."""

    def __init__(self, keep_bytes: int = _KEEP_BYTES, keep_count: int = _KEEP_COUNT) -> None:
        self.keep_bytes = keep_bytes
        self.keep_count = keep_count
        self.free: list[bytearray] = []
        #: Buffers made and buffers taken again (what tests and the benchmark read).
        self.made = 0
        self.reused = 0

    def take(self, size: int) -> bytearray:
        """A buffer of exactly `size` bytes (its content is whatever was there)."""
        free = self.free
        for index, buffer in enumerate(free):
            # A bytearray shrinks or grows within what it has allocated without moving while it keeps at least half
            # of it: only such a one is taken.
            allocated = buffer.__alloc__()
            if size < allocated <= 2 * size:
                del free[index]
                if len(buffer) > size:
                    del buffer[size:]
                elif len(buffer) < size:
                    buffer.extend(bytes(size - len(buffer)))
                self.reused += 1
                return buffer
        self.made += 1
        return bytearray(size)

    def give(self, buffer: bytearray, holders: int) -> None:
        """`buffer` is no longer the caller's; `holders` is how many references the caller itself still has to it
        (its argument of this call included). Kept for reuse if nobody else has one."""
        if sys.getrefcount(buffer) - 1 > holders:  # (getrefcount's own argument)
            return
        free = self.free
        if len(free) >= self.keep_count or sum(map(len, free)) + len(buffer) > self.keep_bytes:
            return
        free.append(buffer)


def copy_into(buffer: bytearray, at: int, chunks: Iterable[bytes]) -> int:
    """Copy `chunks` into `buffer` from offset `at` on; returns the offset after them."""
    with memoryview(buffer) as view:
        for chunk in chunks:
            end = at + len(chunk)
            view[at:end] = chunk
            at = end
    return at


class BodyReading(asyncio.Protocol, metaclass=abc.ABCMeta):
    """What a connection (``_http_server.py``'s `_Connection`, which inherits it) does to hand its handler a request
    body that had not arrived with its head, and to give back the memory a response lent (`HttpResponse.done`) once
    none of it is left in the transport. The connection sets the attributes and defines the methods left undone
    here."""

    __slots__ = ("buffers", "closed", "eof", "known_rest", "lent", "loop", "parser", "sink", "transport", "writable")

    transport: asyncio.Transport | None
    loop: asyncio.AbstractEventLoop
    #: The server's buffers of large bodies.
    buffers: BodyBuffers
    parser: httptools.HttpRequestParser
    closed: bool
    eof: bool
    #: Bytes still due of a body taken without the parser (a learnt head's).
    known_rest: int
    #: The transport's protocol while the rest of a body is received into one buffer (`_whole`), else None.
    sink: BodySink | None
    #: The `HttpResponse.done` of the response being written, called once the transport holds none of it.
    lent: Callable[[], None] | None
    #: The transport has not paused writing (`pause_writing` / `resume_writing`).
    writable: bool

    @abc.abstractmethod
    def on_message_complete(self) -> None:
        """The parser's end of a request (httptools' callback): the connection hands the request on."""

    @abc.abstractmethod
    def _read(self, size: int) -> None:
        """`size` more bytes were read this turn (the connection lets the loop's other callbacks run after many)."""

    @abc.abstractmethod
    async def _drain(self) -> None:
        """Wait until the transport takes writes again (or the connection is gone)."""

    def _reader(self, exchange: Exchange) -> Any:
        # The pieces as the network delivered them, one per read: joining is left to the reader's caller, which does
        # it once for the whole body (`collect_body`), or has the body received into one buffer (`whole`).
        return _BodyReader(self, exchange)

    async def _read_chunk(self, exchange: Exchange, pending: collections.deque[bytes]) -> tuple[bytes, bool]:
        self._continue(exchange)
        if not pending:
            while not exchange.chunks and not exchange.body_done:
                self._check_body(exchange)
                exchange.waiter = self.loop.create_future()
                await exchange.waiter
                exchange.waiter = None
            pending.extend(exchange.chunks)
            exchange.chunks = []
        chunk = pending.popleft() if pending else b""
        return chunk, bool(pending) or not exchange.body_done

    def _continue(self, exchange: Exchange) -> None:
        """Send "100 Continue" if the client waits for it before sending the body."""
        if exchange.expect_continue and not exchange.continue_sent and not self.closed:
            exchange.continue_sent = True
            assert self.transport is not None
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def _check_body(self, exchange: Exchange) -> None:
        """Refuse the read of a body that cannot arrive whole."""
        if exchange.broken:
            raise BadRequest("the request body's chunked encoding is malformed")
        if self.closed or self.eof:
            raise BadRequest("the client disconnected before sending the whole body")

    async def _whole(self, exchange: Exchange, pending: collections.deque[bytes], size: int) -> bytearray:
        """The body of `exchange`, `size` bytes as its ``Content-Length`` says, in one buffer of the server's: what
        already arrived is copied into it (off the loop when it is much), the rest is received straight into it by a
        `BodySink`. The buffer is given back when the request is answered (`_give_back`)."""
        self._continue(exchange)
        buffer = self.buffers.take(size)
        filled = 0
        while True:
            chunks = [*pending, *exchange.chunks]
            pending.clear()
            exchange.chunks = []
            arrived = sum(map(len, chunks))
            if filled + arrived > size:
                raise BadRequest("the request body is longer than its Content-Length")
            if arrived >= JOIN_ON_A_THREAD_BYTES:
                # Copying releases the GIL: the loop goes on answering other requests (and reading this body).
                filled = await asyncio.to_thread(copy_into, buffer, filled, chunks)
            elif arrived:
                filled = copy_into(buffer, filled, chunks)
            if not exchange.chunks:  # (more may have come while the copy ran on the thread)
                break
        if not exchange.body_done:
            self._check_body(exchange)
            assert self.transport is not None
            self.sink = BodySink(self, buffer, filled)
            self.transport.set_protocol(self.sink)
            try:
                while not exchange.body_done:
                    self._check_body(exchange)
                    exchange.waiter = self.loop.create_future()
                    await exchange.waiter
                    exchange.waiter = None
            finally:
                self._unsink()
        elif filled != size:
            raise BadRequest(f"the request body is {filled} bytes, its Content-Length says {size}")
        exchange.held = buffer
        return buffer

    def sunk(self, size: int) -> None:
        """`BodySink` received `size` more bytes of the body being read."""
        sink = self.sink
        assert sink is not None
        if sink.filled < len(sink.view):
            self._read(size)
            return
        self._unsink()
        if self.known_rest:  # a learnt head's body (`_replay`): the rest of it came here instead
            self.known_rest = 0
        else:
            # The parser was fed the body's first bytes only: one in its state between two messages takes over.
            self.parser = httptools.HttpRequestParser(self)
        self.on_message_complete()

    def _unsink(self) -> None:
        """The body has arrived (or cannot): the connection reads for itself again."""
        sink = self.sink
        if sink is None:
            return
        self.sink = None
        sink.done()
        if self.transport is not None and not self.closed:
            self.transport.set_protocol(self)

    def _give_back(self, exchange: Exchange) -> None:
        held = exchange.held
        exchange.held = None
        if held is not None:
            self.buffers.give(held, 2)  # (`held`, and `give`'s own argument)

    async def _flushed(self) -> None:
        """Wait until the transport holds none of what was written (or the connection is gone): the transport may
        keep the parts themselves rather than copies of them until they are sent."""
        transport = self.transport
        assert transport is not None
        if not transport.get_write_buffer_size():
            return
        low, high = transport.get_write_buffer_limits()
        # Writing is paused while anything is left and resumes only once nothing is.
        transport.set_write_buffer_limits(high=0, low=0)
        try:
            while transport.get_write_buffer_size() and not self.closed:
                if self.writable:  # (a transport that did not pause: look again shortly rather than spin)
                    await asyncio.sleep(0.001)
                else:
                    await self._drain()
        finally:
            if not self.closed:
                transport.set_write_buffer_limits(high=high, low=low)

    def _return_lent(self) -> None:
        done = self.lent
        self.lent = None
        if done is not None:
            try:
                done()
            except Exception:
                _log.exception("giving back the memory of an HTTP response failed")


class _BodyReader:
    """The handler's reader of a body that had not arrived whole when its request was handed over: called, it gives
    the next piece (`BodyReader`); `whole` gives the rest of the body at once, in one buffer."""

    __slots__ = ("connection", "exchange", "pending")

    def __init__(self, connection: BodyReading, exchange: Exchange) -> None:
        self.connection = connection
        self.exchange = exchange
        self.pending: collections.deque[bytes] = collections.deque()

    def __call__(self) -> Coroutine[Any, Any, tuple[bytes, bool]]:
        return self.connection._read_chunk(self.exchange, self.pending)

    def whole(self, size: int) -> Coroutine[Any, Any, bytearray]:
        return self.connection._whole(self.exchange, self.pending, size)
