"""The host end of the wire to one runner: a DEALER socket per calling thread, watched together with the pidfd.

A call is one send and one blocking poll on the caller's own thread, with no relay thread in between. The poll
includes the runner's pidfd, so a runner that dies fails the call at once instead of leaving it waiting.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import zmq
from carton_protocol._limits import WireLimits
from carton_protocol._messages import pack_header, unpack_header
from carton_protocol._shm import FdChannel, PeerSegments, SegmentPool
from carton_protocol._zmqio import recv_message, send_message
from zmq.backend import zmq_poll

__all__ = ["CallTimeout", "Connection", "PeerGone"]

# Without a pidfd, a waiting call checks the process this often.
_LIVENESS_SLICE_MS = 100
# A reply sent just before the runner died may still be in flight inside ZeroMQ when the pidfd fires.
_LAST_WORDS_MS = 20


class PeerGone(Exception):
    """The runner process exited while a call waited for its reply."""


class CallTimeout(Exception):
    """No reply arrived within the call's timeout."""


class _ThreadSocket:
    __slots__ = ("poll_items", "socket")

    def __init__(self, sock: zmq.Socket[Any], poll_items: list[tuple[Any, int]]) -> None:
        self.socket = sock
        self.poll_items = poll_items


def _close_socket(sock: zmq.Socket[Any]) -> None:
    with contextlib.suppress(zmq.ZMQError):
        sock.close(linger=0)


class Connection:
    """Request/reply with one runner; safe to use from any number of threads at once."""

    def __init__(
        self,
        *,
        endpoint: str,
        pidfd: int | None,
        is_alive: Callable[[], bool],
        limits: WireLimits,
        channel: FdChannel | None,
    ) -> None:
        self.endpoint = endpoint
        self.limits = limits
        self._pidfd = pidfd
        self._is_alive = is_alive
        # Our own context: destroying it at close closes every thread's socket in one go.
        self._context = zmq.Context()
        self._local = threading.local()
        self._sockets_lock = threading.Lock()
        self._sockets: set[zmq.Socket[Any]] = set()
        self._ids = itertools.count(1)
        self.channel = channel
        self.pool = SegmentPool("h", channel) if channel is not None else None
        self.peer = (
            PeerSegments(channel, writable=False, max_segments=limits.max_segments) if channel is not None else None
        )

    def _thread_socket(self) -> _ThreadSocket:
        state: _ThreadSocket | None = getattr(self._local, "state", None)
        if state is not None:
            return state
        sock = self._context.socket(zmq.DEALER)
        sock.linger = 0
        sock.setsockopt(zmq.RECONNECT_IVL, 10)
        sock.connect(self.endpoint)
        # zmq_poll on a prepared list: half the cost of zmq.Poller.poll, which rebuilds it on every call.
        poll_items: list[tuple[Any, int]] = [(sock, zmq.POLLIN)]
        if self._pidfd is not None:
            poll_items.append((self._pidfd, zmq.POLLIN))
        state = _ThreadSocket(sock, poll_items)
        self._local.state = state
        with self._sockets_lock:
            self._sockets.add(sock)
        # When the thread ends its socket goes too, without waiting for the connection to close.
        weakref.finalize(threading.current_thread(), self._forget, sock)
        return state

    def _forget(self, sock: zmq.Socket[Any]) -> None:
        with self._sockets_lock:
            if sock not in self._sockets:
                return
            self._sockets.discard(sock)
        _close_socket(sock)

    def call(
        self, header: dict[str, Any], frames: Sequence[Any] = (), *, timeout: float | None
    ) -> tuple[dict[str, Any], list[zmq.Frame]]:
        """Send a request and wait for its reply: (header, data frames). Raises PeerGone or CallTimeout."""
        state = self._thread_socket()
        sock = state.socket
        request_id = next(self._ids)
        header["id"] = request_id
        self._attach_drops(header)
        send_message(sock, [pack_header(header), *frames])
        deadline = None if timeout is None else time.monotonic() + timeout
        slice_ms = -1 if self._pidfd is not None else _LIVENESS_SLICE_MS
        poll_items = state.poll_items
        while True:
            wait_ms = slice_ms
            if deadline is not None:
                remaining = max(0, int((deadline - time.monotonic()) * 1000) + 1)
                wait_ms = remaining if wait_ms < 0 else min(wait_ms, remaining)
            events = zmq_poll(poll_items, wait_ms)
            if events and events[0][0] is sock:
                reply = self._receive(sock, request_id)
                if reply is not None:
                    return reply
                continue
            if events or not self._is_alive():
                # Only the pidfd fired (or the process is gone): collect a reply it may have sent just before.
                if sock.poll(_LAST_WORDS_MS):
                    reply = self._receive(sock, request_id)
                    if reply is not None:
                        return reply
                raise PeerGone
            if deadline is not None and time.monotonic() >= deadline:
                raise CallTimeout

    def _receive(self, sock: zmq.Socket[Any], request_id: int) -> tuple[dict[str, Any], list[zmq.Frame]] | None:
        frames = recv_message(sock)
        header = unpack_header(frames[0].buffer, self.limits)
        reply_id = header.get("id")
        if reply_id == request_id or (reply_id == -1 and header.get("ok") is False):
            return header, frames[1:]
        return None  # the late reply of an earlier call on this thread that timed out

    def send(self, header: dict[str, Any]) -> None:
        """Send a request that has no reply (``release``)."""
        sock = self._thread_socket().socket
        header["id"] = next(self._ids)
        sock.send(pack_header(header))

    def _attach_drops(self, header: dict[str, Any]) -> None:
        if self.pool is not None:
            dropped = self.pool.take_dropped()
            if dropped:
                header["drop"] = dropped

    def close(self) -> None:
        with self._sockets_lock:
            sockets, self._sockets = self._sockets, set()
        for sock in sockets:
            _close_socket(sock)
        self._context.destroy(linger=0)
        if self.pool is not None:
            self.pool.close()
        if self.peer is not None:
            self.peer.close()
        if self.channel is not None:
            self.channel.close()
