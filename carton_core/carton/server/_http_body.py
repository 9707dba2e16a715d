"""A large request body received into one buffer as it arrives (for ``_http_server.py``).

A body read piece by piece and joined afterwards is copied twice in this process, once by the event loop into a new
``bytes`` per socket read and once more into the joined whole, and the whole is fresh memory: a buffer of that size
lies above glibc's largest mmap threshold, so it is mapped anew and page-faulted in on every request. `BodySink`
instead takes the transport's reads itself (an `asyncio.BufferedProtocol`, the connection's protocol for as long as
the body arrives): the kernel copies the body straight into one buffer, which `BodyBuffers` keeps for the next large
body once nothing holds it any more.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterable
from typing import Protocol

__all__ = ["BodyBuffers", "BodySink", "SinkOwner", "copy_into"]


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
