"""Multipart send and receive without pyzmq's per-call checks.

`zmq.Socket.send_multipart` type-checks every part in Python and `recv_multipart` asks for ``RCVMORE`` with a
`getsockopt` per part: together several microseconds, a large share of a small round trip. Parts here are always
buffers we built, so the checks buy nothing. Small ``bytes`` and array parts are copied (cheaper than building the
`zmq.Frame` a zero-copy send needs: 0.56 against 0.72 us for 64 bytes); larger ones and frames go out with
``copy=False``, straight from their buffer.

Each part goes through pyzmq's compiled `send` and `recv` (the methods of `zmq.backend.Socket`, the base class of
every `zmq.Socket`), called with positional arguments: `zmq.Socket.send` is a Python method in front of the
compiled one, there for the routing ids and groups of draft socket types we never use, and keyword arguments take
the compiled methods' slower argument parsing (docs/performance.md, "the runner's side of the hop").

`new_context` makes the ZeroMQ context both ends use: its I/O threads run under ``SCHED_BATCH`` on Linux.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np
import zmq

__all__ = [
    "COPY_BELOW",
    "new_context",
    "recv_frames",
    "recv_message",
    "recv_routed",
    "send_copied",
    "send_message",
    "send_routed",
]

_SNDMORE = int(zmq.SNDMORE)
_send = zmq.backend.Socket.send
_recv = zmq.backend.Socket.recv
_SCHED_BATCH = 3  # Linux's SCHED_BATCH (os.SCHED_BATCH where Python exposes it)
#: Parts smaller than this many bytes are copied into ZeroMQ's message; larger ones are sent from their own buffer.
COPY_BELOW = 1 << 16


def send_message(sock: zmq.Socket[Any], parts: Sequence[Any]) -> None:
    """Send `parts` as one message on `sock`, a plain (blocking) `zmq.Socket`: not a `zmq.asyncio` one, whose
    awaitable methods this bypasses."""
    last = len(parts) - 1
    for index, part in enumerate(parts):
        kind = type(part)
        if kind is bytes:
            copy = len(part) < COPY_BELOW
        elif kind is np.ndarray:
            copy = part.nbytes < COPY_BELOW
        else:
            copy = False
        _send(sock, part, _SNDMORE if index < last else 0, copy)


def send_copied(sock: zmq.Socket[Any], parts: Sequence[Any]) -> None:
    """`send_message` of `parts` that are all to be copied (buffers under `COPY_BELOW` bytes, as a header template's
    tensors are when its codec's threshold is no larger; `Outgoing.copied`), without looking at each part's type and
    size. Copying a larger part would cost more, never go wrong."""
    last = len(parts) - 1
    if last == 1:  # a header and one tensor: most messages
        _send(sock, parts[0], _SNDMORE, True)
        _send(sock, parts[1], 0, True)
        return
    for index in range(last):
        _send(sock, parts[index], _SNDMORE, True)
    _send(sock, parts[last], 0, True)


def send_routed(sock: zmq.Socket[Any], ident: bytes, parts: Sequence[Any], copied: bool = False) -> None:
    """`send_message` of ``[ident, *parts]`` on a ROUTER `sock` (`ident` a routing id as `recv_routed` gives it),
    without building that list: the runner loop's every reply. `copied`: `parts` are all to be copied, as for
    `send_copied`."""
    _send(sock, ident, _SNDMORE, True)
    if copied:
        send_copied(sock, parts)
    else:
        send_message(sock, parts)


def recv_message(sock: zmq.Socket[Any], flags: int = 0) -> list[zmq.Frame]:
    """Receive one message from `sock` (a plain `zmq.Socket`, as for `send_message`) as frames, without copies.
    `flags` apply to its first frame (``zmq.NOBLOCK``: `zmq.Again` when none is waiting); a message's other frames
    arrive with its first."""
    # `recv_frames`'s loop, written out: the host's every reply, one Python call fewer.
    frame: zmq.Frame = _recv(sock, flags, False)
    frames = [frame]
    while frame.more:
        frame = _recv(sock, 0, False)
        frames.append(frame)
    return frames


def recv_routed(sock: zmq.Socket[Any]) -> list[Any]:
    """Receive one message from a ROUTER `sock`: the sender's routing id as ``bytes``, then the message's frames as
    `recv_message` gives them. A ROUTER always delivers a routing id followed by at least one part, so the id needs
    no ``more`` check, and a copied receive of a few bytes costs less than making the `zmq.Frame` it would be."""
    return recv_frames(sock, [_recv(sock, 0, True)])


def recv_frames(sock: zmq.Socket[Any], frames: list[Any]) -> list[Any]:
    """`frames` with the message's frames (the rest of it, after what `frames` holds) appended, without copies."""
    frame: zmq.Frame = _recv(sock, 0, False)
    frames.append(frame)
    while frame.more:
        frame = _recv(sock, 0, False)
        frames.append(frame)
    return frames


def new_context() -> zmq.Context[Any]:
    """A ZeroMQ context whose I/O threads run under Linux's ``SCHED_BATCH`` policy (set before they start).

    Every message crosses an I/O thread on each side. Woken by a send, a normal-policy I/O thread preempts the
    sender on a busy CPU, so the sender pays for a context switch in the middle of its own work and the message
    waits as long anyway; a batch thread runs once the CPU is free, or at once on an idle one. Unprivileged, and
    ignored where the policy does not exist (docs/protocol.md, "I/O threads")."""
    context: zmq.Context[Any] = zmq.Context()
    if hasattr(zmq, "THREAD_SCHED_POLICY") and sys.platform == "linux":
        try:
            context.set(zmq.THREAD_SCHED_POLICY, getattr(os, "SCHED_BATCH", _SCHED_BATCH))
            context.set(zmq.THREAD_PRIORITY, 0)
        except zmq.ZMQError:
            pass
    return context
