"""Shared memory for large tensors: sealed memfd segments, reused as arenas, passed over a Unix socket.

Each side owns the segments it writes (`SegmentPool`): the host its request segments (ids ``h<n>``), the runner its
reply segments (``r<n>``). A segment is an anonymous ``memfd`` sealed against shrinking and growing, so the peer
can map it without fear of ``SIGBUS`` from a truncation, and nothing is left on any filesystem when a process dies:
the kernel frees a segment when its last mapping and descriptor go. A new segment's descriptor is sent once over
the fd channel (an ``AF_UNIX`` ``SOCK_SEQPACKET`` pair inherited by the runner) before the first message that
names it; the peer keeps a mapping per id (`PeerSegments`). Free segments are kept for reuse (their pages stay
resident, so a steady stream of large tensors does not page-fault); an owner that drops a segment tells the peer in
the ``drop`` field of its next message so the peer unmaps it too.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import socket
import threading
import time
from dataclasses import dataclass

from .errors import FrameError, LimitExceeded, ProtocolError

__all__ = ["SHM_AVAILABLE", "FdChannel", "PeerSegments", "Segment", "SegmentPool", "align"]

SHM_AVAILABLE = hasattr(os, "memfd_create") and hasattr(fcntl, "F_ADD_SEALS") and hasattr(socket, "send_fds")

_MIN_SEGMENT = 1 << 20
_SEALS = getattr(fcntl, "F_SEAL_SHRINK", 0) | getattr(fcntl, "F_SEAL_GROW", 0) | getattr(fcntl, "F_SEAL_SEAL", 0)
_ALIGN = 64


def align(offset: int) -> int:
    """Round `offset` up to the 64-byte alignment every tensor in a segment starts at."""
    return (offset + _ALIGN - 1) & ~(_ALIGN - 1)


@dataclass(slots=True, eq=False)
class Segment:
    """One mapped memfd. Arrays are made over `mapping` itself, so a live array keeps the mapping alive."""

    id: str
    size: int
    mapping: mmap.mmap

    def close(self) -> None:
        with contextlib.suppress(BufferError):
            # An array a caller still holds exports the buffer; the mapping is then unmapped with that array.
            self.mapping.close()


class FdChannel:
    """The Unix socket that carries segment descriptors; one message = one id, one size and one descriptor."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._send_lock = threading.Lock()
        self._recv_lock = threading.Lock()
        self._pending: dict[str, tuple[int, int]] = {}
        self._closed = False

    def fileno(self) -> int:
        return self._sock.fileno()

    def send(self, segment_id: str, size: int, fd: int) -> None:
        payload = f"{segment_id} {size}".encode("ascii")
        with self._send_lock:
            try:
                socket.send_fds(self._sock, [payload], [fd])
            except OSError as exc:
                raise ProtocolError(f"cannot pass shared-memory segment {segment_id} to the peer: {exc}") from exc

    def receive(self, segment_id: str, *, timeout: float, max_pending: int) -> tuple[int, int]:
        """The (fd, size) the peer sent for `segment_id`; it must already be on its way, so `timeout` is short."""
        deadline = time.monotonic() + timeout
        with self._recv_lock:
            while segment_id not in self._pending:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._closed:
                    raise FrameError(f"shared-memory segment {segment_id!r} was never passed by the peer")
                self._sock.settimeout(remaining)
                try:
                    message, fds, flags, _ = socket.recv_fds(self._sock, 64, 1)
                except TimeoutError:
                    continue
                except OSError as exc:
                    raise FrameError(f"shared-memory channel failed while waiting for {segment_id!r}: {exc}") from exc
                if not message and not fds:
                    self._closed = True
                    continue
                self._store(message, fds, flags, max_pending)
            return self._pending.pop(segment_id)

    def _store(self, message: bytes, fds: list[int], flags: int, max_pending: int) -> None:
        if len(fds) != 1 or flags & socket.MSG_CTRUNC:
            for fd in fds:
                os.close(fd)
            raise FrameError(f"shared-memory channel message carried {len(fds)} descriptors, expected 1")
        fd = fds[0]
        try:
            name, _, size_text = message.decode("ascii").partition(" ")
            size = int(size_text)
        except (UnicodeDecodeError, ValueError) as exc:
            os.close(fd)
            raise FrameError(f"shared-memory channel message {message[:64]!r} is not 'ID SIZE'") from exc
        if name in self._pending or len(self._pending) >= max_pending:
            os.close(fd)
            raise LimitExceeded(f"shared-memory segment {name!r} passed twice, or over {max_pending} unclaimed")
        self._pending[name] = (fd, size)

    def close(self) -> None:
        self._closed = True
        for fd, _ in self._pending.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self._pending.clear()
        self._sock.close()


class SegmentPool:
    """Segments this side writes: acquire one for a message, release it when the peer is done reading it."""

    def __init__(self, prefix: str, channel: FdChannel, *, keep_free_bytes: int = 1 << 30) -> None:
        self._prefix = prefix
        self._channel = channel
        self._keep_free_bytes = keep_free_bytes
        self._lock = threading.Lock()
        self._next = 0
        self._free: list[Segment] = []
        self._busy: dict[str, Segment] = {}
        #: Ids dropped since the last `take_dropped` (read without the lock: a stale answer only delays a ``drop``).
        self.dropped: list[str] = []

    def acquire(self, nbytes: int) -> Segment:
        with self._lock:
            fits = [segment for segment in self._free if segment.size >= nbytes]
            if fits:
                segment = min(fits, key=lambda candidate: candidate.size)
                self._free.remove(segment)
            else:
                segment = self._create(nbytes)
            self._busy[segment.id] = segment
            return segment

    def release(self, segment_id: str) -> None:
        """Return a segment to the free list (ids this pool does not lend out are ignored: the peer may lie)."""
        with self._lock:
            segment = self._busy.pop(segment_id, None)
            if segment is not None:
                self._free.append(segment)
                self._trim()

    def take_dropped(self) -> list[str]:
        """Ids dropped since the last call; the next outgoing message tells the peer to unmap them."""
        if not self.dropped:
            return []  # the common case, without taking the lock
        with self._lock:
            dropped, self.dropped = self.dropped, []
            return dropped

    def _create(self, nbytes: int) -> Segment:
        size = max(_MIN_SEGMENT, 1 << (max(nbytes, 1) - 1).bit_length())
        segment_id = f"{self._prefix}{self._next}"
        self._next += 1
        fd = os.memfd_create(f"carton-{segment_id}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
            mapping = mmap.mmap(fd, size)
            with contextlib.suppress(AttributeError, OSError):
                mapping.madvise(mmap.MADV_HUGEPAGE)
            self._channel.send(segment_id, size, fd)
        finally:
            os.close(fd)
        # Keep the freshly created pool within bounds: large idle segments are what costs memory.
        self._trim(reserve=size)
        return Segment(segment_id, size, mapping)

    def _trim(self, reserve: int = 0) -> None:
        free_bytes = sum(segment.size for segment in self._free) + reserve
        self._free.sort(key=lambda candidate: candidate.size)
        while self._free and free_bytes > self._keep_free_bytes:
            victim = self._free.pop(0)
            free_bytes -= victim.size
            self.dropped.append(victim.id)
            victim.close()

    def close(self) -> None:
        with self._lock:
            for segment in [*self._free, *self._busy.values()]:
                segment.close()
            self._free.clear()
            self._busy.clear()


class PeerSegments:
    """Mappings of the segments the peer owns, by id; a descriptor is fetched from the channel on first use."""

    def __init__(self, channel: FdChannel, *, writable: bool, max_segments: int, timeout: float = 1.0) -> None:
        self._channel = channel
        self._writable = writable
        self._max_segments = max_segments
        self._timeout = timeout
        self._lock = threading.Lock()
        self._segments: dict[str, Segment] = {}

    def get(self, segment_id: str) -> Segment:
        segment = self._segments.get(segment_id)
        if segment is not None:
            return segment
        with self._lock:
            segment = self._segments.get(segment_id)
            if segment is None:
                if len(self._segments) >= self._max_segments:
                    raise LimitExceeded(f"peer has over {self._max_segments} shared-memory segments mapped")
                segment = self._map(segment_id)
                self._segments[segment_id] = segment
            return segment

    def _map(self, segment_id: str) -> Segment:
        fd, size = self._channel.receive(segment_id, timeout=self._timeout, max_pending=self._max_segments)
        try:
            try:
                seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
                actual = os.fstat(fd).st_size
            except OSError as exc:
                raise FrameError(f"shared-memory segment {segment_id!r} is not a sealed memfd: {exc}") from exc
            if not seals & fcntl.F_SEAL_SHRINK:
                raise FrameError(f"shared-memory segment {segment_id!r} is not sealed against shrinking")
            if actual != size or size <= 0:
                raise FrameError(f"shared-memory segment {segment_id!r} is {actual} bytes, announced as {size}")
            access = mmap.ACCESS_WRITE if self._writable else mmap.ACCESS_READ
            return Segment(segment_id, size, mmap.mmap(fd, size, access=access))
        finally:
            os.close(fd)

    def drop(self, segment_ids: list[str]) -> None:
        with self._lock:
            for segment_id in segment_ids:
                segment = self._segments.pop(segment_id, None)
                if segment is not None:
                    segment.close()

    def close(self) -> None:
        with self._lock:
            for segment in self._segments.values():
                segment.close()
            self._segments.clear()
