"""Multipart send and receive without pyzmq's per-call checks.

`zmq.Socket.send_multipart` type-checks every part in Python and `recv_multipart` asks for ``RCVMORE`` with a
`getsockopt` per part: together several microseconds, a large share of a small round trip. Parts here are always
buffers we built, so the checks buy nothing. Small ``bytes`` parts are copied; other buffers (arrays, frames) go out
with ``copy=False``, so pyzmq copies those under its copy threshold and sends larger ones straight from their buffer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import zmq

__all__ = ["recv_message", "send_message"]

_SNDMORE = zmq.SNDMORE
_COPY_BELOW = 1 << 16


def send_message(sock: zmq.Socket[Any], parts: Sequence[Any]) -> None:
    last = len(parts) - 1
    for index, part in enumerate(parts):
        # bytes parts are headers and small BYTES payloads: a copy is cheaper than pinning a zmq.Frame.
        copy = type(part) is bytes and len(part) < _COPY_BELOW
        sock.send(part, _SNDMORE if index < last else 0, copy=copy)


def recv_message(sock: zmq.Socket[Any]) -> list[zmq.Frame]:
    frame = sock.recv(copy=False)
    frames = [frame]
    while frame.more:
        frame = sock.recv(copy=False)
        frames.append(frame)
    return frames
