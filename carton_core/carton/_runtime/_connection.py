"""The host end of the wire to one runner: a DEALER socket per calling thread, and a watch on the runner's pidfd.

A call without a deadline is one send and one blocking receive on the caller's own thread, with no relay thread in
between: the fewest system calls and Python steps a round trip can take. A runner that dies must not leave it
waiting, so a watcher thread per connection waits on the runner's pidfd and, once it fires (and the runner's last
replies had time to arrive), sends an empty message to every thread's socket over an inproc address each one also
binds: a receive still blocked on one of them returns it, and the call raises `PeerGone`. A call with a deadline (or
without a pidfd) polls its socket together with the pidfd (or checks the process every slice) instead.

asyncio callers get an `AsyncChannel` per event loop instead: one DEALER whose file descriptor, and a duplicate of
the runner's pidfd, are readers of the loop. Calls in flight on it are told apart by request id.

Both hand bytes to and from the connection's `carton_protocol.HostCodec`, which hides how a message is encoded
(header templates or the full encoder) and where its tensors lie (frames or shared memory).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import os
import select
import threading
import time
import weakref
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import msgspec
import zmq
from carton_protocol import (
    ErrorReply,
    HostCodec,
    ProtocolError,
    Received,
    Reply,
    Request,
    Tensor,
    new_context,
    recv_message,
    send_copied,
    send_message,
)
from zmq.backend import zmq_poll

__all__ = ["Answer", "AsyncChannel", "CallTimeout", "Connection", "NotSent", "PeerGone"]

# Without a pidfd, a waiting call checks the process this often.
_LIVENESS_SLICE_MS = 100
# A reply sent just before the runner died may still be in flight inside ZeroMQ when the pidfd fires.
_LAST_WORDS_MS = 20
#: Longest a blocking receive waits before it returns to Python and waits again. A process-directed signal (Ctrl-C)
#: may be handed by the kernel to any thread that does not block it, such as the runner-exit watch; Python then runs
#: its handler only when the main thread next runs bytecode, which a receive that never returns would put off until
#: the runner answers.
_SIGNAL_SLICE_MS = 100
# Names of the inproc addresses thread sockets bind (unique in the process: a closed socket's may linger a moment).
_wake_ids = itertools.count()
_NOBLOCK = int(zmq.NOBLOCK)


class PeerGone(Exception):
    """The runner process exited while a call waited for its reply."""


class NotSent(PeerGone):
    """The runner process had exited before the request was sent: nothing of it reached the runner, so the caller
    may start another runner and send it there (`AsyncChannel.send`)."""


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

    def __init__(self, *, endpoint: str, pidfd: int | None, is_alive: Callable[[], bool], codec: HostCodec) -> None:
        self.endpoint = endpoint
        self.codec = codec
        self._pidfd = pidfd
        self.pidfd = pidfd
        self._is_alive = is_alive
        # Our own context: destroying it at close closes every thread's socket in one go.
        self._context = new_context()
        self._local = threading.local()
        self._sockets_lock = threading.Lock()
        # Every thread's socket, with the inproc address it also binds: where the exit watch wakes it from.
        self._sockets: dict[zmq.Socket[Any], str] = {}
        #: The next request id (a C callable: no Python frame on the path every call takes).
        self.next_id: Callable[[], int] = itertools.count(1).__next__
        # Both set under `_sockets_lock`: the runner exited (and every socket was woken), the connection closed.
        self._exited = False
        self._closed = False
        self._stop_watch: Callable[[], None] | None = None
        if pidfd is not None:
            self._stop_watch = _start_exit_watch(self, pidfd)

    def _thread_socket(self) -> _ThreadSocket:
        """The calling thread's socket and what its waits poll, made on the thread's first call."""
        state: _ThreadSocket | None = getattr(self._local, "state", None)
        if state is not None:
            return state
        sock = self._context.socket(zmq.DEALER)
        sock.linger = 0
        sock.setsockopt(zmq.RECONNECT_IVL, 10)
        sock.setsockopt(zmq.RCVTIMEO, _SIGNAL_SLICE_MS)
        wake = f"inproc://carton-exit-{next(_wake_ids)}"
        sock.bind(wake)
        sock.connect(self.endpoint)
        with self._sockets_lock:
            if self._exited:
                _close_socket(sock)
                raise PeerGone
            self._sockets[sock] = wake
        # zmq_poll on a prepared list: half the cost of zmq.Poller.poll, which rebuilds it on every call.
        poll_items: list[tuple[Any, int]] = [(sock, zmq.POLLIN)]
        if self._pidfd is not None:
            poll_items.append((self._pidfd, zmq.POLLIN))
        state = _ThreadSocket(sock, poll_items)
        self._local.state = state
        # When the thread ends its socket goes too, without waiting for the connection to close.
        weakref.finalize(threading.current_thread(), self._forget, sock)
        return state

    def _forget(self, sock: zmq.Socket[Any]) -> None:
        with self._sockets_lock:
            if self._sockets.pop(sock, None) is None:
                return
        _close_socket(sock)

    def call(self, request: Request, *, timeout: float | None) -> Reply:
        """Send a request that is not an ``infer`` (its ``id`` is set here) and wait for its reply.
        Raises PeerGone or CallTimeout, or `carton_protocol.ProtocolError` for a reply that cannot be read."""
        request_id = self.next_id()
        data = self.codec.encode(msgspec.structs.replace(request, id=request_id))
        reply: Reply = self.exchange([data], request_id, timeout=timeout).message
        return reply

    def exchange(self, parts: Sequence[Any], request_id: int, *, timeout: float | None) -> Received:
        """Send a ready message (header bytes with `request_id`, then data frames) and wait for its reply."""
        if self._exited:
            raise PeerGone
        try:
            state = self._thread_socket()
            sock = state.socket
            send_message(sock, parts)
            if timeout is None and self._pidfd is not None:
                # The common case, kept short: a blocking receive, which the exit watch ends if the runner dies.
                while True:
                    try:
                        reply = self._receive(sock, request_id)
                    except zmq.Again:
                        continue  # a slice ended (`_SIGNAL_SLICE_MS`): any signal's handler has run; wait on
                    if reply is not None:
                        return reply
            return self._wait(state, request_id, timeout)
        except (ProtocolError, zmq.ZMQError):
            # After the runner's exit, what a socket reads is the watch's empty wake-up message (or the half of a
            # reply it left), and a socket may already be closed under a caller: the runner is gone, say so.
            if self._exited:
                raise PeerGone from None
            raise

    def infer(
        self, parts: Sequence[Any], request_id: int, timeout: float | None, copied: bool = False
    ) -> tuple[dict[str, Tensor], Hashable] | Received:
        """`exchange` for an infer request: the reply's tensors and the plan that read them when it came in a header
        template (the usual reply; the same plan always reads the same layout), else its `Received` (an error, or
        tensors the full decoder reads: `outputs`). `copied`: every part is to be copied, as `AsyncChannel.send`
        says."""
        if timeout is not None or self._pidfd is None or self._exited:
            return self.exchange(parts, request_id, timeout=timeout)
        # Every call's path: a send and a blocking receive (as in `exchange`), and a reply in a header template read
        # by its plan, without making the message or a `Received`.
        codec = self.codec
        try:
            # The calling thread's socket (`_thread_socket`, whose first line this is, makes it on the first call).
            state: _ThreadSocket | None = getattr(self._local, "state", None)
            if state is None:
                state = self._thread_socket()
            sock = state.socket
            if copied:
                send_copied(sock, parts)
            else:
                send_message(sock, parts)
            while True:
                try:
                    frames = recv_message(sock)
                except zmq.Again:
                    continue  # a slice ended (`_SIGNAL_SLICE_MS`): any signal's handler has run; wait on
                matched = codec.match_bytes(frames[0].bytes)
                if matched is not None and matched[0] == request_id:
                    plan = matched[1]
                    return plan.decode(frames[1:]), plan
                reply = self._received(codec.decode(frames), request_id, sock)
                if reply is not None:
                    return reply
        except (ProtocolError, zmq.ZMQError):
            if self._exited:
                raise PeerGone from None
            raise

    def _wait(self, state: _ThreadSocket, request_id: int, timeout: float | None) -> Received:
        """Wait for the reply with a deadline, or without a pidfd: polls the socket with the pidfd, or checks the
        process every slice."""
        sock = state.socket
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

    def _receive(self, sock: zmq.Socket[Any], request_id: int) -> Received | None:
        return self._received(self.codec.decode(recv_message(sock)), request_id, sock)

    def _received(self, received: Received, request_id: int, sock: zmq.Socket[Any]) -> Received | None:
        """`received` when it answers `request_id` (or is an error about no request in particular), else None."""
        message = received.message
        if message.id == request_id or (message.id == -1 and isinstance(message, ErrorReply)):
            return received
        self.release(received, sock)  # the late reply of an earlier call on this thread that timed out
        return None

    def outputs(self, received: Received, lent: list[Callable[[], None]] | None = None) -> dict[str, Tensor]:
        """The tensors of an infer reply (ordinary arrays the caller owns); the runner may then reuse whatever
        held them. `carton_protocol.ProtocolError` when they break a rule of the wire.

        With `lent`, tensors in the runner's shared memory are read-only views of it instead of copies, and what
        frees that memory for the runner is appended to `lent`: the caller calls it once it no longer reads them."""
        plan = received.plan
        if plan is not None:
            return plan.decode(received.frames)  # a header template's reply: in frames, nothing to release
        if lent is None:
            try:
                return self.codec.tensors(received)
            finally:
                self.release(received)
        try:
            tensors = self.codec.tensors(received, copy_shared=False)
        except BaseException:
            self.release(received)
            raise
        data = self.codec.release(received, self.next_id)
        if data is not None:  # (else every tensor came in the reply's frames: nothing is lent)
            lent.append(functools.partial(self._send_release, data))
        return tensors

    def _send_release(self, data: bytes) -> None:
        with contextlib.suppress(zmq.ZMQError, PeerGone):
            self._thread_socket().socket.send(data)

    def release(self, received: Received, sock: zmq.Socket[Any] | None = None) -> None:
        """Tell the runner that the shared memory a reply used is free again (nothing to say for most replies)."""
        data = self.codec.release(received, self.next_id)
        if data is not None:
            with contextlib.suppress(zmq.ZMQError, PeerGone):
                (sock if sock is not None else self._thread_socket().socket).send(data)

    def _runner_exited(self) -> None:
        """Called by the exit watch: wake every thread still waiting for a reply (each finds an empty message on its
        socket and raises `PeerGone`); calls made from now on raise it at once."""
        with self._sockets_lock:
            # Under the lock: `close` destroys the context only after this is done with it.
            if self._closed:
                return
            self._exited = True
            for wake in self._sockets.values():
                # Left open: `close` (destroying the context) closes it, once the message surely arrived.
                waker = self._context.socket(zmq.DEALER)
                waker.connect(wake)
                waker.send(b"", zmq.NOBLOCK)

    def close(self) -> None:
        with self._sockets_lock:
            self._closed = True
            sockets, self._sockets = self._sockets, {}
        if self._stop_watch is not None:
            self._stop_watch()
        for sock in sockets:
            _close_socket(sock)
        self._context.destroy(linger=0)
        self.codec.close()


def _start_exit_watch(connection: Connection, pidfd: int) -> Callable[[], None]:
    """Start the thread that tells `connection` when the process behind `pidfd` exits; returns what stops it. The
    thread holds a duplicate of the pidfd, so the caller may close its own at any time, and only a weak reference to
    the connection: a connection nobody closed still goes, and its finalizer stops the thread."""
    watched = os.dup(pidfd)
    # Closing the write end (stopping the watch) makes the read end readable.
    stop_read, stop_write = os.pipe()
    target = weakref.ref(connection)

    def watch() -> None:
        try:
            poller = select.poll()
            poller.register(watched, select.POLLIN)
            poller.register(stop_read, select.POLLIN)
            events = poller.poll()
            if any(fd == stop_read for fd, _ in events):
                return
            poller.unregister(watched)
            # A reply sent just before the runner died may still be in flight inside ZeroMQ: let it arrive.
            if poller.poll(_LAST_WORDS_MS):
                return
            alive = target()
            if alive is not None:
                alive._runner_exited()
        finally:
            os.close(watched)
            os.close(stop_read)

    threading.Thread(target=watch, name="carton-runner-exit", daemon=True).start()
    return weakref.finalize(connection, os.close, stop_write)


_async_context: tuple[int, zmq.Context[Any]] | None = None
_async_context_lock = threading.Lock()


def _shared_async_context() -> zmq.Context[Any]:
    """The context of every AsyncChannel socket: not a Connection's, whose `destroy` at close would close a socket
    still registered with an event loop (the loop must unregister a descriptor before it is closed)."""
    global _async_context
    with _async_context_lock:
        if _async_context is None or _async_context[0] != os.getpid():
            _async_context = (os.getpid(), new_context())
        return _async_context[1]


#: What an `AsyncChannel` call's future holds: (plan, data frames) for a reply in a learnt header template, else the
#: reply as `Received`.
Answer = tuple[Any, list[zmq.Frame]] | Received


class AsyncChannel:
    """The wire to one runner for one asyncio event loop; used only from that loop's thread.

    ZeroMQ's descriptor is edge-triggered: it signals that the socket's state may have changed, not that a message
    is waiting. So every wake-up reads the socket until no message is left (its first read a receive that does not
    block, since a wake-up almost always brings a reply; the next ones ask ``EVENTS`` through ``zmq_poll`` first), and
    every send asks it just before sending: a reply then arrives in a pipe whose reader was last seen finding
    it empty, which is what makes ZeroMQ signal the next message (a new pipe starts with its reader counted as
    awake, so the first reply into it would send no signal at all; reading once per loop step instead of once per
    send cost more than it saved: docs/performance.md). A wake-up's reads stop once no call is left waiting (nor
    given up with its reply still due): whatever comes after that is no one's, and the next send's read collects it.
    A send itself may take in ZeroMQ's commands, among them the signal of a reply that arrived just before it: so
    when any other reply is still due (`_unanswered`: requests sent minus replies read, never under the truth), the
    socket is read after the send too. A lone call's own reply cannot arrive before its send, so it needs no
    second read.

    The read before a send asks the runner's pidfd in the same ``zmq_poll``: a runner that had exited by then gets
    nothing, and `send` raises `NotSent` (the caller may restart it and send again) instead of sending a request
    that could only fail. This is the call's liveness check, at no system call of its own. A runner that exits after
    that read may have read the request: its calls fail (`PeerGone`), never sent twice.

    A reply in a learnt header template (the usual one) reaches its call as the plan that reads it and its data
    frames, with no message decoded; anything else as the `Received`.
    """

    def __init__(self, connection: Connection, loop: asyncio.AbstractEventLoop) -> None:
        assert connection.pidfd is not None
        self.closed = False
        #: The connection this channel's socket talks to the runner of (its codec is the channel's).
        self.connection = connection
        self._codec = connection.codec
        self._pending: dict[int, asyncio.Future[Answer]] = {}
        # Requests given up (cancelled) whose shared-memory input the runner may still read: released on their reply.
        self._orphans: dict[int, Callable[[], None]] = {}
        # Requests whose reply was read after their call was cancelled but before the call gave them up (`orphan`):
        # their reply is in, so `orphan` releases them at once.
        self._answered: set[int] = set()
        self._loop = weakref.ref(loop)
        sock = _shared_async_context().socket(zmq.DEALER)
        sock.linger = 0
        sock.sndhwm = 0  # as many requests in flight as the callers make: never block the loop on a send
        sock.connect(connection.endpoint)
        self._sock = sock
        # `_drain` asks whether a message is waiting with zmq_poll on this prepared list, not `sock.get(zmq.EVENTS)`:
        # the same check inside libzmq, without pyzmq turning the option into its enum on every call.
        self._readable: list[tuple[Any, int]] = [(sock, zmq.POLLIN)]
        self._fd: int = sock.get(zmq.FD)
        self._pidfd = os.dup(connection.pidfd)
        # What a send asks first: a reply waiting on the socket, and whether the runner has exited (its pidfd).
        self._before_send: list[tuple[Any, int]] = [(sock, zmq.POLLIN), (self._pidfd, zmq.POLLIN)]
        # Requests sent whose reply has not been read: a message that cannot be told to answer one (an error about no
        # request in particular, an unreadable one) is not counted off, so this is never less than the truth.
        self._unanswered = 0
        self._match = connection.codec.match_bytes
        try:
            loop.add_reader(self._fd, self._drain, True)
            loop.add_reader(self._pidfd, self._on_exit)
        except BaseException:
            with contextlib.suppress(Exception):
                loop.remove_reader(self._fd)
            sock.close(linger=0)
            os.close(self._pidfd)
            raise
        # A loop that ends (asyncio.run returns) before the runner does: its channel's socket and pidfd go with it.
        self._finalizer = weakref.finalize(loop, _close_quietly, sock, self._pidfd)

    def send(
        self, parts: Sequence[Any], request_id: int, timeout: float | None, copied: bool = False
    ) -> tuple[asyncio.Future[Answer], asyncio.TimerHandle | None]:
        """Send a ready request; its reply comes in the future (PeerGone, CallTimeout or ProtocolError instead): the
        plan and data frames of a reply in a learnt header template, else the `Received`. `copied`: every part is
        to be copied (`carton_protocol.Outgoing.copied`), so `send_copied` sends them. `NotSent` when the runner
        had exited before the request left (or the channel is closed, which it is once the runner exited).
        The caller awaits the future; if that raises, it calls `forget` with both, else it cancels the timer (the
        reply took the future out of the channel): no coroutine of the channel's own stands between the caller and
        the send, one frame fewer on each step of the call."""
        # The channel's own loop, the running one: `asyncio.get_running_loop` makes a system call (`getpid`, its
        # fork check) on every call before Python 3.12.
        loop = self._loop()
        if self.closed or loop is None:
            raise NotSent
        future: asyncio.Future[Answer] = loop.create_future()
        # Waiting before the read below: with a call waiting, a drain reads the socket until it is empty.
        self._pending[request_id] = future
        try:
            ready = zmq_poll(self._before_send, 0)
            if ready:
                if ready[-1][0] is not self._sock:  # the pidfd, listed last
                    raise NotSent
                self._drain(True)  # the poll found a message waiting
            if copied:
                send_copied(self._sock, parts)
            else:
                send_message(self._sock, parts)
            self._unanswered += 1
            if self._unanswered > 1:
                # Another reply may have arrived while this request was sent, its signal taken by the send.
                self._drain()
        except BaseException:
            self._pending.pop(request_id, None)
            raise
        return future, None if timeout is None else loop.call_later(timeout, self._expire, request_id)

    def forget(self, request_id: int, timer: asyncio.TimerHandle | None) -> None:
        """The call `send` started is over (answered, failed, timed out or cancelled)."""
        self._pending.pop(request_id, None)
        if timer is not None:
            timer.cancel()

    def orphan(self, request_id: int, release: Callable[[], None]) -> None:
        """Run `release` when the reply to `request_id`, a call given up, arrives (or the channel closes)."""
        if self.closed or request_id in self._answered:
            self._answered.discard(request_id)
            release()
        else:
            self._orphans[request_id] = release

    def _expire(self, request_id: int) -> None:
        future = self._pending.get(request_id)
        if future is not None and not future.done():
            future.set_exception(CallTimeout())

    def _drain(self, signalled: bool = False) -> None:
        """Read the socket until it is empty, or until no call is left waiting. `signalled`: a message is almost
        surely there (the loop's reader, woken by ZeroMQ's signal, or a poll that found one), so the first read is a
        receive that does not block, without the ``zmq_poll`` in front of it, whose own ``poll`` of the descriptor is
        a system call more per reply; libzmq takes in the signal inside the receive as it does for ``EVENTS``. One
        that finds nothing (`zmq.Again`, far dearer than a poll) has looked at the pipe as the poll would have."""
        sock = self._sock
        readable = self._readable
        pending = self._pending
        match = self._match
        try:
            if not signalled:
                if not zmq_poll(readable, 0):
                    return
                frames = recv_message(sock)
            else:
                try:
                    frames = recv_message(sock, _NOBLOCK)
                except zmq.Again:
                    return
            while True:
                matched = match(frames[0].bytes)
                if matched is None:
                    self._dispatch(frames)
                else:
                    self._unanswered -= 1
                    # An infer reply in a learnt layout (the usual one): its tensors are in its frames, no shared
                    # memory to free. Handled here, one Python call fewer per reply.
                    waiting = pending.pop(matched[0], None)
                    if waiting is not None and not waiting.done():
                        waiting.set_result((matched[1], frames[1:]))
                    else:
                        release = self._orphans.pop(matched[0], None)
                        if release is not None:
                            release()
                        elif waiting is not None:  # cancelled, and not yet given up: `orphan` will find it answered
                            self._answered.add(matched[0])
                if not pending and not self._orphans:
                    # Every call is answered: a message still coming is no one's, and stops here. Not asking the
                    # socket again leaves its pipe counted as awake, so what arrives next may not signal; the next
                    # `send` asks before its call waits, and reads it then.
                    return
                if not zmq_poll(readable, 0):
                    return
                frames = recv_message(sock)
        except zmq.ZMQError:
            if not self.closed:
                raise

    def _dispatch(self, frames: list[zmq.Frame]) -> None:
        """A message that is not an infer reply in a learnt layout (`_drain` handles those)."""
        try:
            received = self._codec.decode(frames)
        except ProtocolError as exc:
            # A reply we cannot read belongs to no call in particular: the runner is broken for all of them.
            self._fail_all(exc)
            return
        message = received.message
        pending = self._pending
        if message.id == -1 and isinstance(message, ErrorReply):
            for future in pending.values():
                if not future.done():
                    future.set_result(received)
            pending.clear()
            return
        self._unanswered -= 1
        waiting = pending.pop(message.id, None)
        if waiting is None or waiting.done():
            self._discard(received, cancelled=waiting is not None)
            return
        waiting.set_result(received)

    def _discard(self, received: Received, *, cancelled: bool) -> None:
        """The late reply of a call given up (or `cancelled` and not yet given up): free what it holds on both
        sides, use nothing else of it."""
        release = self._orphans.pop(received.message.id, None)
        if release is not None:
            release()
        elif cancelled:
            self._answered.add(received.message.id)
        self.connection.release(received, self._sock)

    def _fail_all(self, error: BaseException) -> None:
        for future in self._pending.values():
            if not future.done():
                future.set_exception(error)

    def _on_exit(self) -> None:
        """The runner exited: collect replies it sent just before, then fail what is still waiting."""
        loop = self._loop()
        if loop is None:
            return
        loop.remove_reader(self._pidfd)
        self._drain()
        loop.call_later(_LAST_WORDS_MS / 1000, self.close)

    def close(self) -> None:
        """Unregister from the loop and close the socket and pidfd (on the loop's thread); waiting calls get
        PeerGone."""
        if self.closed:
            return
        with contextlib.suppress(zmq.ZMQError):
            self._drain()
        self.closed = True
        loop = self._loop()
        if loop is not None and not loop.is_closed():
            loop.remove_reader(self._fd)
            loop.remove_reader(self._pidfd)
        self._finalizer()
        self._fail_all(PeerGone())
        for release in self._orphans.values():
            release()
        self._orphans.clear()
        self._answered.clear()


def _close_quietly(sock: zmq.Socket[Any], pidfd: int) -> None:
    with contextlib.suppress(zmq.ZMQError):
        sock.close(linger=0)
    with contextlib.suppress(OSError):
        os.close(pidfd)
