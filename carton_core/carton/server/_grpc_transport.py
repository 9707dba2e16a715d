"""gRPC over HTTP/2 on carton's own frame layer and the server's own event loop: ``carton serve``'s gRPC endpoint.

`._http2` does HTTP/2 (frames, HPACK through the `hpack` library, stream states, flow control, pings); this module
is the glue between it and `GrpcService`: the gRPC framing of messages (a 5-byte prefix: compressed flag and
length), the response's ``grpc-status``/``grpc-message`` trailers, ``grpc-timeout`` deadlines, the message size
limit, and the calls, which a client's ``RST_STREAM`` cancels: a unary call of ``ModelInfer`` and the methods that
answer from the server's state without a task (`_Call.step`; the code it runs must not need a current task), any other
call in a task. Why not grpcio's server: docs/server.md, "The gRPC
server".

Requests are parsed once, by the committed stubs' ``FromString``; responses are serialized once. A request that is
not a valid message is answered ``INVALID_ARGUMENT``, one over the size limit ``RESOURCE_EXHAUSTED``, an unknown
method ``UNIMPLEMENTED``, a compressed message (no compression is offered) ``UNIMPLEMENTED``.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import socket
import struct
import types
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, cast
from urllib.parse import quote

import grpc
import msgspec
from google.protobuf.message import DecodeError

from ._grpc import GrpcService, message_type
from ._grpc_plan import RequestForms
from ._http2 import Http2Connection, StreamGone, header_block, indexing_block
from ._proto import SERVICE_NAME
from .errors import BadRequest, ServerError

__all__ = ["GrpcServer", "serve_grpc"]

_log = logging.getLogger("carton.server")

_RESPONSE_HEADERS = [
    (b":status", b"200"),
    (b"content-type", b"application/grpc"),
    (b"grpc-accept-encoding", b"identity"),
]
_OK_TRAILERS = [(b"grpc-status", b"0")]
_RESPONSE_BLOCK = header_block(_RESPONSE_HEADERS)
_OK_TRAILERS_BLOCK = header_block(_OK_TRAILERS)


def _indexed_blocks() -> tuple[bytes, bytes, bytes, bytes, bytes]:
    """The response's header blocks through the client's dynamic table, as grpc's own servers send them: the first
    response's headers insert theirs, the first OK trailers after them insert the status, and every later block names
    them by index (a byte each: the client has no literal to parse). The first headers, the headers and OK trailers
    once those are in the table, and the headers and OK trailers once the status is too."""
    table: list[tuple[bytes, bytes]] = []
    first = indexing_block(_RESPONSE_HEADERS, table)
    head_then = indexing_block(_RESPONSE_HEADERS, list(table))
    ok_first = indexing_block(_OK_TRAILERS, table)
    head_indexed = indexing_block(_RESPONSE_HEADERS, list(table))
    return first, head_then, ok_first, head_indexed, indexing_block(_OK_TRAILERS, table)


_HEAD_FIRST, _HEAD_THEN, _OK_FIRST, _HEAD_INDEXED, _OK_INDEXED = _indexed_blocks()
_NOT_GRPC_BLOCK = header_block([(b":status", b"415")])
_TIMEOUT_UNITS = {b"H": 3600.0, b"M": 60.0, b"S": 1.0, b"m": 1e-3, b"u": 1e-6, b"n": 1e-9}
_PREFIX = 5
_MESSAGE_PREFIX = struct.Struct(">BI")  # compressed flag, length
_ONE_MESSAGE = "{} takes exactly one whole request message"


def _code(status: grpc.StatusCode) -> bytes:
    return str(status.value[0]).encode()


@dataclass(frozen=True, slots=True, kw_only=True)
class _Method:
    """One method of the service: its function (which answers with a message, or with its bytes), the class its
    requests parse into, whether they are parsed through the connection's `RequestForms` (``ModelInfer``), and
    whether a unary call of it runs without a task (`_Call.step`: its code must not need a current task)."""

    function: Callable[[Any], Any]
    request: Any
    streaming: bool
    learns: bool = False
    taskless: bool = False


# The unary methods whose code only awaits futures (the model's answer, the server's state), so run without a task.
# The repository's load and unload wait with timeouts, which from Python 3.12 need a current task: they keep one,
# as does any method not named here (a task costs nothing beside a load).
_TASKLESS = frozenset(
    {"ServerLive", "ServerReady", "ModelReady", "ServerMetadata", "ModelMetadata", "ModelConfig", "ModelStatistics"}
)


class _Failure(Exception):
    """A call answered with a status other than the one of a `ServerError`."""

    def __init__(self, status: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.status = status


class _Call(msgspec.Struct, eq=False):
    """One stream: the method it calls, the bytes received not yet parsed, and what runs it: a streamed call's (or a
    call in a task's) task, or a unary call's coroutine stepped without a task (`_start`).

    A coroutine stepped without a task is run on the loop as a task would step it: stepped each time a future it
    awaits is done, in a context of its own, a `CancelledError` thrown in on `cancel`. A task costs its creation,
    its registration in asyncio's set of tasks and a loop turn for its first step; most calls need none of it (a
    method answered from the server's state answers in its first step), and a call to a model in its runner awaits
    one future, the runner's reply. (A struct: made in C, without a Python ``__init__``.)"""

    stream_id: int
    name: str
    method: _Method
    timeout: float | None
    pending: list[bytes] | None = None  # made when a first piece is kept
    size: int = 0
    need: int = _PREFIX  # pending bytes that make the next whole message (its prefix, once that is known)
    task: asyncio.Task[None] | None = None
    queue: asyncio.Queue[bytes | None] | None = None
    timer: asyncio.TimerHandle | None = None
    expired: bool = False  # the deadline cancelled the call
    headers_sent: bool = False
    refused: bool = False  # answered with an error before its request was whole
    # A unary call's coroutine stepped without a task, its context, the future it awaits, what to throw in at its
    # next step (a cancellation, a bad yield), whether it ended, and a future for the server's close to wait on.
    coroutine: Coroutine[Any, Any, None] | None = None
    context: contextvars.Context | None = None
    waiting: asyncio.Future[Any] | None = None
    thrown: BaseException | None = None
    over: bool = False
    ended: asyncio.Future[None] | None = None

    def step(self, _: object = None) -> None:
        """Run the coroutine up to its next suspension (or its end); called in its context, as a task's steps are."""
        self.waiting = None
        coroutine = self.coroutine
        assert coroutine is not None  # (a call is stepped only once it has its coroutine)
        try:
            thrown = self.thrown
            if thrown is not None:
                self.thrown = None
                yielded = coroutine.throw(thrown)
            else:
                yielded = _send(coroutine, None)
        except (StopIteration, asyncio.CancelledError):  # answered; or cancelled, which the call's code handled
            self.over = True
            if self.ended is not None:
                self.ended.set_result(None)
            return
        except BaseException:
            self.over = True
            if self.ended is not None:
                self.ended.set_result(None)
            raise
        self.wait(yielded)

    def wait(self, yielded: Any) -> None:
        """Step again when what the coroutine yielded says: a future it awaits is done, or the loop's next turn."""
        if getattr(yielded, "_asyncio_future_blocking", None):  # an asyncio future, awaited
            yielded._asyncio_future_blocking = False
            yielded.add_done_callback(self.step, context=self.context)
            self.waiting = yielded
        elif yielded is None:  # a bare yield (`asyncio.sleep(0)`): the next turn of the loop
            asyncio.get_running_loop().call_soon(self.step, context=self.context)
        else:
            self.thrown = RuntimeError(f"a gRPC call yielded {yielded!r}, not a future")  # as a task refuses it
            asyncio.get_running_loop().call_soon(self.step, context=self.context)

    def running(self) -> bool:
        """Whether a task or a stepped coroutine runs the call and has not finished."""
        if self.task is not None:
            return not self.task.done()
        return self.coroutine is not None and not self.over

    def cancel(self) -> None:
        """Cancel the call: its task; or the future its coroutine awaits (the call's `await` raises
        `CancelledError`), or, if that is already done, `CancelledError` is thrown in at its next step."""
        if self.task is not None:
            self.task.cancel()
            return
        if self.coroutine is None or self.over:
            return
        waiting = self.waiting
        if waiting is None or not waiting.cancel():
            self.thrown = asyncio.CancelledError()

    def finished(self) -> asyncio.Future[Any]:
        """A future done when the call is (for the server's close to wait on)."""
        if self.task is not None:
            return self.task
        if self.ended is None:
            self.ended = asyncio.get_running_loop().create_future()
            if self.over:
                self.ended.set_result(None)
        return self.ended


def _timeout(value: bytes | None) -> float | None:
    """A ``grpc-timeout`` header's seconds (None: no deadline, or a value that is not one)."""
    if not value or len(value) > 9 or value[-1:] not in _TIMEOUT_UNITS or not value[:-1].isdigit():
        return None
    return int(value[:-1]) * _TIMEOUT_UNITS[value[-1:]]


def _split_messages(call: _Call, limit: int) -> list[bytes]:
    """The whole messages in `call`'s pending bytes (the rest stays pending); `_Failure` if one is compressed or over
    `limit`."""
    pending = call.pending or []
    data = b"".join(pending) if len(pending) != 1 else pending[0]
    messages = []
    at = 0
    while len(data) - at >= _PREFIX:
        length = int.from_bytes(data[at + 1 : at + 5], "big")
        if data[at]:
            raise _Failure(grpc.StatusCode.UNIMPLEMENTED, "compressed messages are not supported (send identity)")
        if length > limit:
            raise _Failure(
                grpc.StatusCode.RESOURCE_EXHAUSTED, f"request message of {length} bytes is over the {limit}-byte limit"
            )
        if len(data) - at - _PREFIX < length:
            break
        messages.append(data[at + _PREFIX : at + _PREFIX + length])
        at += _PREFIX + length
    call.pending = [data[at:]] if at < len(data) else []
    call.size = len(data) - at
    call.need = _PREFIX + int.from_bytes(data[at + 1 : at + 5], "big") if call.size >= _PREFIX else _PREFIX
    return messages


class _Connection(Http2Connection):
    """One client connection: carton's HTTP/2 frame layer, its calls."""

    def __init__(self, server: GrpcServer) -> None:
        super().__init__()
        self._server = server
        self._calls: dict[int, _Call] = {}
        self._forms = RequestForms(message_type("ModelInferRequest").FromString)
        self._limit = server.max_message_size
        # The headers of the last call routed (held, so `is` cannot match another dict at the same address), its
        # method and deadline: a client's calls repeat their header block, which the frame layer gives as one dict.
        self._last_routed: tuple[dict[bytes, bytes], str, _Method, float | None] | None = None
        # The header blocks of a response and of its OK trailers, by what the client's dynamic table holds (`_sent`).
        self._blocks = (_HEAD_FIRST, _OK_TRAILERS_BLOCK)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._server.connections.add(self)
        super().connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self._server.connections.discard(self)
        super().connection_lost(exc)  # each call's stream is reset: its task is cancelled

    @property
    def calls(self) -> list[_Call]:
        """The calls under way (run by a task or a stepped coroutine)."""
        return [call for call in self._calls.values() if call.task is not None or call.coroutine is not None]

    # ---- requests ------------------------------------------------------------------------------------------------
    def request_received(self, stream_id: int, headers: dict[bytes, bytes]) -> None:
        last = self._last_routed
        if last is not None and last[0] is headers:  # the frame layer's decoded block of the previous call, as is
            _, name, method, timeout = last
        else:
            content_type = headers.get(b"content-type", b"")
            if headers.get(b":method") != b"POST" or not content_type.startswith(b"application/grpc"):
                self.send_headers(stream_id, _NOT_GRPC_BLOCK, end_stream=True)
                return
            path = headers.get(b":path", b"")
            route = self._server.routes.get(path)
            if route is None:
                text = path.decode("ascii", "replace")
                self._trailers_only(stream_id, grpc.StatusCode.UNIMPLEMENTED, f"unknown method {text!r}")
                return
            name, method = route
            timeout = _timeout(headers.get(b"grpc-timeout"))
            self._last_routed = (headers, name, method, timeout)
        call = _Call(stream_id, name, method, timeout)
        self._calls[stream_id] = call
        if method.streaming:
            call.queue = asyncio.Queue()
            call.task = asyncio.get_running_loop().create_task(self._run_stream(call))

    def body_received(self, stream_id: int, data: bytes) -> None:
        call = self._calls.get(stream_id)
        if call is None or call.refused:
            return
        if call.pending is None:
            call.pending = [data]
        else:
            call.pending.append(data)
        call.size += len(data)
        limit = self._limit
        if call.queue is None:
            # A unary request is parsed once it has all come; past the size of one message at the limit it can
            # only be refused: a message over the limit, or more than one message.
            if call.size > _PREFIX + limit:
                try:
                    _split_messages(call, limit)
                    raise _Failure(grpc.StatusCode.INVALID_ARGUMENT, _ONE_MESSAGE.format(call.name))
                except _Failure as failure:
                    self._refuse(call, failure)
            return
        if call.size < call.need:
            return  # a streamed message is split off once it has all come, not re-joined with every piece
        try:
            messages = _split_messages(call, limit)
        except _Failure as failure:
            self._refuse(call, failure)
            return
        for message in messages:
            call.queue.put_nowait(message)

    def body_ending(self, stream_id: int, data: bytes) -> None:
        call = self._calls.get(stream_id)
        # The usual unary request: its whole body in one DATA frame, one uncompressed message within the limit.
        if call is not None and call.queue is None and not call.pending and not call.refused and len(data) >= _PREFIX:
            compressed, length = _MESSAGE_PREFIX.unpack_from(data)
            if not compressed and length == len(data) - _PREFIX <= self._limit:
                self._start(call, self._run_unary(call, data[_PREFIX:]))
                return
        super().body_ending(stream_id, data)

    def body_ended(self, stream_id: int) -> None:
        call = self._calls.get(stream_id)
        if call is None or call.refused:
            return
        if call.queue is not None:
            call.queue.put_nowait(None)
            return
        pending = call.pending
        # A unary request in one DATA frame (of one uncompressed message within the limit) that did not end it.
        if pending is not None and len(pending) == 1:
            data = pending[0]
            size = len(data) - _PREFIX
            if not data[0] and int.from_bytes(data[1:_PREFIX], "big") == size <= self._limit:
                self._start(call, self._run_unary(call, data[_PREFIX:]))
                return
        try:
            messages = _split_messages(call, self._limit)
            if len(messages) != 1 or call.size:
                raise _Failure(grpc.StatusCode.INVALID_ARGUMENT, _ONE_MESSAGE.format(call.name))
        except _Failure as failure:
            self._refuse(call, failure)
            return
        self._start(call, self._run_unary(call, messages[0]))

    def _start(self, call: _Call, coroutine: Coroutine[Any, Any, None]) -> None:
        """Run a unary call up to its first suspension now (in a context of its own, as a task would); `call` steps
        it on, without a task, if it suspends. A method not `taskless` runs in a task."""
        if not call.method.taskless:
            call.task = asyncio.get_running_loop().create_task(coroutine)
            return
        context = contextvars.copy_context()
        try:
            yielded = context.run(_send, coroutine, None)
        except StopIteration:
            return
        except asyncio.CancelledError:  # raised by the call's own code (nothing can cancel it here): as a task's
            return
        call.coroutine = coroutine
        call.context = context
        if getattr(yielded, "_asyncio_future_blocking", None):  # the usual: a future, awaited (`wait`, written out)
            yielded._asyncio_future_blocking = False
            yielded.add_done_callback(call.step, context=context)
            call.waiting = yielded
        else:
            call.wait(yielded)

    def stream_reset(self, stream_id: int) -> None:
        call = self._calls.pop(stream_id, None)
        if call is not None:
            call.cancel()  # the client cancelled: the handler's `CancelledError` releases what it holds

    def header_table_lowered(self) -> None:
        self._blocks = (_RESPONSE_BLOCK, _OK_TRAILERS_BLOCK)  # blocks that insert nothing, from now on

    def _sent(self, head: bytes | None, ok: bytes | None) -> None:
        """The response headers `head` and then the OK trailers `ok` were buffered (either may be None): the blocks
        that follow name what they inserted into the client's table."""
        if head is _HEAD_FIRST:
            self._blocks = (_HEAD_THEN, _OK_FIRST)
        if ok is _OK_FIRST:
            self._blocks = (_HEAD_INDEXED, _OK_INDEXED)

    # ---- answering -----------------------------------------------------------------------------------------------
    def _refuse(self, call: _Call, failure: _Failure) -> None:
        call.refused = True
        self._calls.pop(call.stream_id, None)
        call.cancel()
        self._finish(call, failure.status, str(failure))

    def _trailers_only(self, stream_id: int, status: grpc.StatusCode, message: str) -> None:
        headers = [*_RESPONSE_HEADERS, (b"grpc-status", _code(status)), (b"grpc-message", _message(message))]
        self.send_headers(stream_id, header_block(headers), end_stream=True)

    def _finish(self, call: _Call, status: grpc.StatusCode, message: str = "") -> None:
        """End `call` with `status` (trailers, or headers and trailers in one when nothing was sent yet)."""
        try:
            if status is grpc.StatusCode.OK:
                ok = self._blocks[1]
                self.send_headers(call.stream_id, ok, end_stream=True)
                if ok is not _OK_INDEXED:
                    self._sent(None, ok)
            elif call.headers_sent:
                trailers = [(b"grpc-status", _code(status)), (b"grpc-message", _message(message))]
                self.send_headers(call.stream_id, header_block(trailers), end_stream=True)
            else:
                self._trailers_only(call.stream_id, status, message)
        except StreamGone:  # the client reset the stream meanwhile, or left
            pass
        self.flush()

    def _headers_once(self, call: _Call) -> None:
        if not call.headers_sent:
            head = self._blocks[0]
            self.send_headers(call.stream_id, head)
            call.headers_sent = True
            if head is not _HEAD_INDEXED:
                self._sent(head, None)

    async def _send_message(self, call: _Call, payload: bytes) -> None:
        """Send one response message, within the client's flow-control windows."""
        self._headers_once(call)
        await self.send_data(call.stream_id, _framed(payload))

    def _request(self, call: _Call, message: bytes) -> Any:
        try:
            if call.method.learns:
                return self._forms.parse(message)
            return call.method.request.FromString(message)
        except DecodeError as exc:
            raise BadRequest(f"the {call.name} request is not a valid {call.method.request.__name__} message") from exc

    def _arm(self, call: _Call, timeout: float) -> None:
        """Start the call's deadline, from its coroutine (a task cancelled before it starts would never answer)."""
        call.timer = asyncio.get_running_loop().call_later(timeout, _expire, call)

    def _forget(self, call: _Call) -> None:
        """`call` is over: its deadline is stopped and it is no longer the stream's call."""
        if call.timer is not None:
            call.timer.cancel()
        self._calls.pop(call.stream_id, None)  # (a stream id is never reused on a connection: it is this call)

    def _end(self, call: _Call, exc: BaseException | None) -> None:
        """End `call`, whose task finished (raising `exc`, if not None), with its status; re-raises a cancellation
        that is not the call's deadline (the client reset the stream, or the server is stopping)."""
        self._forget(call)
        if exc is None:
            self._finish(call, grpc.StatusCode.OK)
        elif isinstance(exc, asyncio.CancelledError):
            if not call.expired:
                raise exc
            self._finish(call, grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded")
        elif isinstance(exc, ServerError):
            # Safe as composed (see `HttpApp.__call__`): client names are echoed verbatim.
            self._finish(call, grpc.StatusCode[exc.grpc_status], str(exc))
        elif isinstance(exc, _Failure):
            self._finish(call, exc.status, str(exc))
        elif isinstance(exc, StreamGone):  # the stream went away under the call
            return
        elif isinstance(exc, Exception):
            _log.error("gRPC %s failed", call.name, exc_info=exc)
            self._finish(call, grpc.StatusCode.INTERNAL, f"{call.name} failed inside the server")
        else:
            raise exc

    # The calls' tasks are these coroutines themselves, without a coroutine per step (parse, answer, send) inside:
    # each is a function object and frame per call, as is an `asyncio.timeout` (so the deadline is a timer that
    # cancels the task instead).
    async def _run_unary(self, call: _Call, message: bytes) -> None:
        try:
            if call.timeout is not None:
                self._arm(call, call.timeout)
            function = call.method.function  # (a bound method held in a slot: loaded, then called)
            response = await function(self._request(call, message))
            payload = response if type(response) is bytes else response.SerializeToString()
            size = len(payload)
            pieces = (_MESSAGE_PREFIX.pack(0, size), payload)
            head, ok = self._blocks
            if self.send_response_now(call.stream_id, head, pieces, _PREFIX + size, ok):
                if ok is not _OK_INDEXED:  # (the connection's first responses)
                    self._sent(head, ok)
                # The whole response is buffered: the call is done (`_forget`, written out).
                if call.timer is not None:
                    call.timer.cancel()
                self._calls.pop(call.stream_id, None)
                self.flush()
                return
            self._headers_once(call)
            await self.send_data(call.stream_id, b"".join(pieces))
        except BaseException as exc:
            self._end(call, exc)
        else:
            self._end(call, None)

    async def _run_stream(self, call: _Call) -> None:
        assert call.queue is not None
        queue = call.queue

        async def requests() -> AsyncIterator[Any]:
            while (message := await queue.get()) is not None:
                yield self._request(call, message)

        try:
            if call.timeout is not None:
                self._arm(call, call.timeout)
            async for response in call.method.function(requests()):
                await self._send_message(call, response.SerializeToString())
                self.flush()
        except BaseException as exc:
            self._end(call, exc)
        else:
            self._end(call, None)


# A coroutine's `send`, taken from its type once (not a bound method made per call).
_send = cast(Callable[[Coroutine[Any, Any, None], None], Any], types.CoroutineType.send)


def _expire(call: _Call) -> None:
    """The call's deadline passed: its task is cancelled, and ends the call with ``DEADLINE_EXCEEDED``."""
    if call.running():
        call.expired = True
        call.cancel()


def _framed(payload: bytes) -> bytes:
    """A response message with its gRPC prefix (not compressed, its length)."""
    return _MESSAGE_PREFIX.pack(0, len(payload)) + payload


def _message(text: str) -> bytes:
    """A ``grpc-message`` value: percent-encoded UTF-8, as the gRPC protocol asks."""
    return quote(text, safe=" !\"#$&'()*+,-./:;<=>?@[\\]^_`{|}~").encode("ascii")


class GrpcServer:
    """`GrpcService`'s methods served on a listening socket; `close` stops it."""

    def __init__(self, service: GrpcService, *, max_message_size: int) -> None:
        methods: dict[str, _Method] = {
            name: _Method(
                function=function, request=message_type(f"{name}Request"), streaming=False, taskless=name in _TASKLESS
            )
            for name, function in service.unary_methods().items()
        }
        infer_request = message_type("ModelInferRequest")
        methods["ModelInfer"] = _Method(
            function=service.model_infer_serialized, request=infer_request, streaming=False, learns=True, taskless=True
        )
        methods["ModelStreamInfer"] = _Method(
            function=service.model_stream_infer, request=infer_request, streaming=True
        )
        # The request paths taken, as they come: a call's path is looked up, not decoded and split.
        self.routes = {f"/{SERVICE_NAME}/{name}".encode(): (name, method) for name, method in methods.items()}
        self.max_message_size = max_message_size
        self.connections: set[_Connection] = set()
        self._server: asyncio.Server | None = None

    async def start(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Connection(self), sock=sock)

    async def close(self, grace: float) -> None:
        """Stop taking connections and calls, give the calls under way `grace` seconds, then cancel them."""
        if self._server is not None:
            self._server.close()
        for connection in list(self.connections):
            connection.goaway()
        running = {call.finished(): call for connection in self.connections for call in connection.calls}
        if running:
            _, late = await asyncio.wait(running, timeout=grace)
            for future in late:
                running[future].cancel()
            if late:
                await asyncio.wait(late, timeout=grace)
        for connection in list(self.connections):
            connection.close()
        if self._server is not None:
            await self._server.wait_closed()


async def serve_grpc(service: GrpcService, sock: socket.socket, *, max_message_size: int) -> GrpcServer:
    """Serve `service` on the listening socket `sock` (the caller binds it)."""
    server = GrpcServer(service, max_message_size=max_message_size)
    await server.start(sock)
    return server
