"""The runner side: ``python -m carton_protocol --endpoint ipc://... --entry module:Class [--host-pid N] [--fd N]
[--listen-fd N]``.

The loop binds a ROUTER socket at the endpoint (each host thread talks to it over its own DEALER), adopting the
listening socket the host bound there when it passes one (``--listen-fd``), imports the entry, answers ``hello``,
then serves ``load``/``pack``/``infer``/``release``/``close``. A ``concurrent`` runner's infers run on a thread
pool, their replies coming back to the socket-owning thread over an inproc socket, except short calls while the pool
is idle, which run on the socket thread itself (`_Server._to_pool`).

It also guards against orphans: a parent-death signal (SIGTERM; the parent is the supervisor that forked it, see
`carton_protocol._supervisor`) and a pidfd watch on the host both end the process, and as a child subreaper it
adopts and kills every descendant before it exits. What it cannot do after a fatal signal, its supervisor does.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import importlib
import os
import platform
import select
import signal
import socket
import sys
import threading
import time
import traceback
import types
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import zmq
from zmq.backend import zmq_poll

from ._codec import Received, RunnerCodec
from ._limits import DEFAULT_LIMITS, WireLimits
from ._messages import (
    PROTOCOL_VERSION,
    Close,
    CloseReply,
    ErrorReply,
    Hello,
    HelloReply,
    Infer,
    Load,
    LoadReply,
    Pack,
    PackReply,
    Release,
    Reply,
    check_opts,
)
from ._reaper import kill_tree, reap_children, set_child_subreaper, set_parent_death_signal
from ._runner import LoadContext, PackContext, PackResult, Runner
from ._shm import SHM_AVAILABLE, FdChannel
from ._templates import LearntRequest, Plan
from ._zmqio import new_context, recv_frames, recv_message, recv_routed, send_message, send_routed
from .errors import ErrorCode, FrameError, InvalidOutput, ProtocolError, RunnerFault, VersionMismatch

__all__ = ["DEFAULT_INLINE_MAX_SECONDS", "INLINE_MAX_ENV", "error_code", "error_reply", "import_entry", "main"]

_TRACEBACK_CHARS = 8000
_perf_counter = time.perf_counter
_EXIT_IMPORT_FAILED = 2
_EXIT_VERSION_MISMATCH = 3
_recv = zmq.backend.Socket.recv
# `_Server._serve_inline`'s requests per call.
_BATCH = range(64)


def _no_id(data: bytes, offset: int) -> tuple[int]:
    del data, offset
    return (-1,)


# No header is -1 bytes long: `_Server._serve_inline` before it has learnt a request layout.
_NOT_LEARNT: LearntRequest = (-1, b"", b"", _no_id, 0, "", np.dtype(np.uint8), (), 0)
#: A concurrent runner's call runs on the socket thread (no pool hand-off) only while calls take less than this: the
#: hand-off costs much of a small call's round trip, and an inline call delays requests that arrive meanwhile by its
#: own length, which matters to a long one (docs/protocol.md, "Concurrent runners", has the measurements).
#: The runner's environment variable `INLINE_MAX_ENV` sets another bound in seconds; 0 sends every call to the pool.
DEFAULT_INLINE_MAX_SECONDS = 0.0005
INLINE_MAX_ENV = "CARTON_RUNNER_INLINE_MAX_SECONDS"


def _inline_max_seconds() -> float:
    text = os.environ.get(INLINE_MAX_ENV)
    if text is None:
        return DEFAULT_INLINE_MAX_SECONDS
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:  # also refuses nan
        print(f"carton runner: ignoring {INLINE_MAX_ENV}={text!r} (not a number of seconds >= 0)", file=sys.stderr)
        return DEFAULT_INLINE_MAX_SECONDS
    return value


def import_entry(entry: str) -> type[Runner]:
    """The `Runner` subclass named by ``"module:Class"`` (``Class`` may be dotted)."""
    module_name, _, attribute = entry.partition(":")
    if not module_name or not attribute:
        raise ValueError(f"runner entry {entry!r} must look like 'module:Class'")
    target: object = importlib.import_module(module_name)
    for part in attribute.split("."):
        target = getattr(target, part)
    if not (isinstance(target, type) and issubclass(target, Runner)):
        raise TypeError(f"runner entry {entry!r} is not a carton_protocol.Runner subclass")
    return target


def error_code(exc: BaseException) -> ErrorCode:
    """The code an exception travels as: a `RunnerFault`'s own, ``out_of_memory`` for any `MemoryError`,
    ``protocol`` for a `ProtocolError`, ``internal`` for anything else (by class, never by name)."""
    match exc:
        case RunnerFault():
            return exc.code
        case ProtocolError():
            return ErrorCode.PROTOCOL
        case MemoryError():
            return ErrorCode.OUT_OF_MEMORY
        case _:
            return ErrorCode.INTERNAL


def error_reply(
    request_id: int, exc: BaseException, *, warnings: tuple[str, ...] = (), protocol: int | None = None
) -> ErrorReply:
    """The reply reporting `exc` (its code, message, type name, traceback, and the tensor it names)."""
    text = "".join(traceback.format_exception(exc))
    tensor = getattr(exc, "tensor", None) if isinstance(exc, RunnerFault) else None
    return ErrorReply(
        id=request_id,
        code=error_code(exc),
        message=str(exc),
        exception=type(exc).__name__,
        traceback=text[-_TRACEBACK_CHARS:],
        tensor=tensor if isinstance(tensor, str) else None,
        warnings=warnings,
        protocol=protocol,
    )


def _die(code: int) -> None:
    """Kill every descendant, then leave at once (used when the host is gone)."""
    kill_tree(os.getpid(), include_root=False)
    reap_children()
    os._exit(code)


def _watch_host(host_pid: int) -> None:
    try:
        pidfd = os.pidfd_open(host_pid)
    except ProcessLookupError:
        _die(0)  # the host died before we could watch it
        return
    except (OSError, AttributeError):
        return  # not visible from here (e.g. another PID namespace): the parent-death signal remains

    def wait() -> None:
        poller = select.poll()
        poller.register(pidfd, select.POLLIN)
        while not poller.poll():
            pass
        _die(0)

    threading.Thread(target=wait, name="carton-host-watch", daemon=True).start()


def _on_sigterm(signum: int, frame: types.FrameType | None) -> None:
    del frame
    _die(128 + signum)


class _Server:
    def __init__(
        self,
        endpoint: str,
        entry: str,
        fd_channel: FdChannel | None,
        threads: int,
        limits: WireLimits,
        listen_fd: int | None = None,
    ):
        self.entry = entry
        self.threads = threads
        self.context = new_context()
        self.router = self.context.socket(zmq.ROUTER)
        self.router.linger = 1000
        if listen_fd is not None:
            # The host bound and listens on the endpoint's socket file, in a folder this process cannot write: the
            # socket adopts that descriptor instead of creating (and owning) the file.
            self.router.setsockopt(zmq.USE_FD, listen_fd)
        self.router.bind(endpoint)
        self.codec = RunnerCodec(limits=limits, channel=fd_channel)
        self.match = self.codec.match_bytes
        self.runner_class: type[Runner] | None = None
        self.import_error: BaseException | None = None
        self.runner: Runner | None = None
        self.executor: ThreadPoolExecutor | None = None
        self.results: zmq.Socket[Any] | None = None
        # Infers on the pool whose reply the socket thread has not forwarded yet; only the socket thread touches it.
        self.pooled = 0
        # How long the runner's last `infer` took (any thread; set before its reply is sent).
        self.last_infer_seconds = 0.0
        self.inline_max_seconds = _inline_max_seconds()
        # A call runs on the socket thread while the last one took less than this: always, without a pool.
        self.inline_bound = float("inf")
        # The last request layout the codec matched (`_serve_inline`).
        self.learnt: LearntRequest = _NOT_LEARNT
        self.local = threading.local()
        self.running = True
        self.exit_code = 0
        try:
            self.runner_class = import_entry(entry)
        except BaseException as exc:
            self.import_error = exc

    # --- socket thread ---------------------------------------------------------------------------------------
    def serve(self) -> int:
        router = self.router
        items: list[tuple[Any, int]] = []
        if self.runner_class is not None and self.runner_class.concurrent:
            self.results = results = self.context.socket(zmq.PULL)
            results.bind("inproc://results")
            self.executor = ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="carton-infer")
            # zmq_poll on a prepared list: zmq.Poller.poll rebuilds its list on every call.
            items = [(router, zmq.POLLIN), (results, zmq.POLLIN)]
            self.inline_bound = self.inline_max_seconds
        while self.running:
            if not self.pooled:
                self._serve_inline()
                continue
            for sock, _ in zmq_poll(items, -1):
                if sock is router:
                    self._handle(recv_routed(router))
                else:
                    # Counted down before the reply leaves: the host's next request then finds the pool idle.
                    self.pooled -= 1
                    send_message(router, recv_message(results))
        return self.exit_code

    def _serve_inline(self) -> None:
        """Serve requests while nothing runs on the pool (a call may go there: then return), at most `_BATCH`.

        Nothing can come back from the pool: this waits on the router alone (a poll over both sockets costs a
        wake-up's worth of extra system calls per request). A request in the last layout the codec matched, when
        `RunnerCodec.learnt_request` gives one, is served here: the steps of `_handle` and of the codec's match
        written out (the path of every call). It is matched by its length, head and tail, its tensor is an array
        over its one data frame, and the call and its reply are `_run`'s, as on `_infer`'s path. Anything else takes
        `_handle`, with every check.

        It returns after `_BATCH` requests to be called again: CPython 3.11 specializes a function's bytecode once
        it has been entered (or a loop in it has jumped back) a few times, and the back edge of a ``while
        <condition>:`` loop does not count, so a function entered once that looped that way would run its whole life
        unspecialized (as `serve` would); entered again and again, this one is specialized however its loop is
        written.
        """
        router = self.router
        codec = self.codec
        inline_max = self.inline_bound
        length, head, tail, read_id, id_offset, name, dtype, shape, size = self.learnt
        # What only `_handle` changes (the runner loads and closes).
        runner = self.runner
        for _ in _BATCH:
            # A ROUTER delivers a routing id, then a message.
            ident = _recv(router, 0, True)
            header: zmq.Frame = _recv(router, 0, False)
            frame: Any = None
            if header.more:
                frame = _recv(router, 0, False)
                if not frame.more:
                    data = header.bytes
                    if (
                        len(data) == length
                        and data.endswith(tail)
                        and data.startswith(head)
                        and len(frame) == size
                        and runner is not None
                        and self.last_infer_seconds < inline_max
                    ):
                        # (The array fits: the frame has the plan's byte size.)
                        inputs = {name: np.ndarray(shape, dtype, frame)}
                        parts, copied = self._run(read_id(data, id_offset)[0], runner, inputs)
                        send_routed(router, ident, parts, copied)
                        continue
                    self._handle([ident, header, frame])
                    learnt = codec.learnt_request(data)
                    if learnt is not None:
                        self.learnt = learnt
                        length, head, tail, read_id, id_offset, name, dtype, shape, size = learnt
                else:
                    self._handle(recv_frames(router, [ident, header, frame]))
            else:
                self._handle([ident, header])
            if self.pooled or not self.running:
                return
            runner = self.runner

    def _to_pool(self, ident: Any, received: Received) -> None:
        """Run one infer on the pool; its reply comes back to this thread over the inproc socket.

        An infer runs on this thread when the runner is not concurrent, or when it is but the last call was short
        and none is running on the pool (`_handle`); on the pool otherwise. The pool costs two thread hand-offs per
        call (to a pool thread, and the reply back over the inproc socket), a large share of a small round trip on
        two cores (docs/protocol.md, "Concurrent runners"). Requests that arrive while an inline call runs wait for
        it, as every request does with a non-concurrent runner: short calls are served one after another on this
        thread, and once a call takes long the next ones go to the pool.
        """
        assert self.executor is not None
        self.pooled += 1
        self.executor.submit(self._pooled_infer, ident, received)

    def _send(self, ident: Any, reply: Reply) -> None:
        """Send `reply` on the router (from the socket thread: pool threads send theirs in `_pooled_infer`)."""
        send_message(self.router, [ident, self.codec.encode(reply)])

    def _handle(self, frames: list[Any]) -> None:
        if len(frames) < 2:
            return  # not a request (an empty message from a confused peer): nothing to answer
        ident = frames[0]
        runner = self.runner
        # An infer runs on this thread unless the runner is concurrent and its pool is busy or its last call was long
        # (then `_to_pool`).
        inline = self.executor is None or (self.last_infer_seconds < self.inline_max_seconds and self.pooled == 0)
        # Every call's path, written out here: a plain infer in a layout seen before, run on this thread. Its header
        # is matched as bytes and its tensors read by the template's plan, without making the message or a `Received`.
        matched = self.match(frames[1].bytes)
        if matched is not None and runner is not None and inline:
            parts, copied = self._infer(matched[0], matched[1], frames[2:])
            send_routed(self.router, ident, parts, copied)
            return
        try:
            received = self.codec.decode(frames, 1)
        except ProtocolError as exc:
            self._send(ident, error_reply(-1, exc))
            return
        request = received.message
        match request:
            case Infer() if runner is not None:
                if inline:
                    parts, copied = self._infer(request.id, None, received)
                    send_routed(self.router, ident, parts, copied)
                else:
                    self._to_pool(ident, received)
            case Infer():
                self._send(
                    ident, error_reply(request.id, ProtocolError("infer before load: the host must send 'load' first"))
                )
            case Release(segments=segments):
                self.codec.release(segments)
            case Hello():
                self._hello(ident, request)
            case Load() | Pack() | Close():
                self._call(ident, request)

    def _hello(self, ident: Any, hello: Hello) -> None:
        if hello.protocol != PROTOCOL_VERSION:
            message = (
                f"host speaks carton protocol {hello.protocol!r}, this runner ({self.entry}) speaks {PROTOCOL_VERSION}"
            )
            print(f"carton runner: {message}", file=sys.stderr, flush=True)
            mismatch = VersionMismatch(message, local=PROTOCOL_VERSION, remote=hello.protocol)
            self._send(ident, error_reply(hello.id, mismatch, protocol=PROTOCOL_VERSION))
            self.running = False
            self.exit_code = _EXIT_VERSION_MISMATCH
            return
        if self.import_error is not None or self.runner_class is None:
            failure = self.import_error or ImportError(f"runner entry {self.entry} did not import")
            self._send(ident, error_reply(hello.id, failure, protocol=PROTOCOL_VERSION))
            self.running = False
            self.exit_code = _EXIT_IMPORT_FAILED
            return
        self.codec.accept(hello)
        self._send(ident, HelloReply(
            id=hello.id,
            protocol=PROTOCOL_VERSION,
            pid=os.getpid(),
            entry=self.entry,
            concurrent=bool(self.runner_class.concurrent),
            python=platform.python_version(),
        ))  # fmt: skip

    def _call(self, ident: Any, request: Load | Pack | Close) -> None:
        warnings: list[str] = []
        try:
            match request:
                case Load():
                    reply: Reply = self._load(request, warnings)
                case Pack():
                    reply = self._pack(request, warnings)
                case Close():
                    self._close()
                    reply = CloseReply(id=request.id)
        except Exception as exc:
            reply = error_reply(request.id, exc, warnings=tuple(str(warning) for warning in warnings))
        self._send(ident, reply)

    def _load(self, load: Load, warnings: list[str]) -> LoadReply:
        if self.runner is not None:
            raise ProtocolError("the model is already loaded; a runner process loads one model")
        assert self.runner_class is not None
        runner = self.runner_class()
        runner.load(
            LoadContext(
                model_dir=Path(load.model_dir),
                opts=load.opts,
                inputs=load.inputs,
                outputs=load.outputs,
                scratch_dir=Path(load.scratch_dir) if load.scratch_dir is not None else None,
                warn=warnings.append,
            )
        )
        self.runner = runner
        return LoadReply(id=load.id, warnings=tuple(str(warning) for warning in warnings))

    def _pack(self, pack: Pack, warnings: list[str]) -> PackReply:
        assert self.runner_class is not None
        result = self.runner_class.pack(
            PackContext(
                model_dir=Path(pack.model_dir),
                opts=pack.opts,
                inputs=pack.inputs,
                outputs=pack.outputs,
                warn=warnings.append,
            )
        )
        if not isinstance(result, PackResult):
            raise InvalidOutput(f"{self.entry}.pack returned a {type(result).__name__}, expected a PackResult")
        try:
            reply = PackReply(
                id=pack.id,
                inputs=tuple(result.inputs),
                outputs=tuple(result.outputs),
                opts=check_opts(dict(result.opts), "pack opts"),
                warnings=tuple(str(warning) for warning in warnings),
            )
            self.codec.encode(reply)  # what the wire cannot carry fails here, named as the runner's fault
        except (ValueError, TypeError, AttributeError, ProtocolError) as exc:
            raise InvalidOutput(f"{self.entry}.pack returned specs or opts the wire cannot carry: {exc}") from exc
        return reply

    def _close(self) -> None:
        self.running = False
        if self.executor is not None:
            self.executor.shutdown(wait=True)
        if self.runner is not None:
            runner, self.runner = self.runner, None
            runner.close()

    # --- any thread ------------------------------------------------------------------------------------------
    def _pooled_infer(self, ident: Any, received: Received) -> None:
        """`_infer` on a pool thread: the reply goes back to the socket thread over this thread's own PUSH socket."""
        parts, _ = self._infer(received.message.id, None, received)
        sender = getattr(self.local, "sender", None)
        if sender is None:
            sender = self.local.sender = self.context.socket(zmq.PUSH)
            sender.connect("inproc://results")
        send_message(sender, [ident, *parts])

    def _infer(self, request_id: int, plan: Plan | None, data: Any) -> tuple[list[Any], bool]:
        """The parts of the reply to an infer request (its outputs, or the error) and whether they are all to be
        copied on send (`RunnerCodec.encode_reply`). `data` is the request's data frames when `plan` reads them
        (`RunnerCodec.match_bytes`), else its `Received`."""
        try:
            inputs = plan.decode(data) if plan is not None else self.codec.tensors(data)
            runner = self.runner
            if runner is None:
                raise ProtocolError("the model was closed")
        except Exception as exc:
            return [self.codec.encode(error_reply(request_id, exc))], False
        return self._run(request_id, runner, inputs)

    def _run(self, request_id: int, runner: Runner, inputs: dict[str, Any]) -> tuple[list[Any], bool]:
        """`runner.infer(inputs)` timed (`last_infer_seconds`), and the parts of its reply as `_infer` gives them:
        the outputs, else the error (`InvalidOutput` for what is not a mapping or what the wire cannot carry)."""
        try:
            start = _perf_counter()
            outputs = runner.infer(inputs)
            self.last_infer_seconds = _perf_counter() - start
            if type(outputs) is not dict:
                if not isinstance(outputs, Mapping):
                    raise InvalidOutput(f"infer returned a {type(outputs).__name__}, expected a mapping")
                outputs = dict(outputs)
            try:
                return self.codec.encode_reply(request_id, outputs)
            except FrameError as exc:
                raise InvalidOutput(f"infer returned an output the wire cannot carry: {exc}") from exc
        except Exception as exc:
            return [self.codec.encode(error_reply(request_id, exc))], False

    def shutdown(self) -> None:
        if self.runner is not None:
            with contextlib.suppress(Exception):
                self.runner.close()
        self.codec.close()
        self.context.destroy(linger=1000)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m carton_protocol",
        description="Serve one carton runner over the carton wire protocol (started by the carton host).",
    )
    parser.add_argument("--endpoint", required=True, help="ZeroMQ endpoint to bind, e.g. ipc:///run/x/runner.sock")
    parser.add_argument("--entry", required=True, help="the Runner subclass, as module:Class")
    parser.add_argument("--host-pid", type=int, default=None, help="exit (killing descendants) when it exits")
    parser.add_argument("--fd", type=int, default=None, help="inherited Unix socket for shared-memory descriptors")
    parser.add_argument(
        "--listen-fd", type=int, default=None, help="inherited socket, bound at the endpoint and listening, to adopt"
    )
    parser.add_argument("--threads", type=int, default=8, help="infer threads for a concurrent runner")
    args = parser.parse_args(argv)

    faulthandler.enable()
    set_parent_death_signal(signal.SIGTERM)
    set_child_subreaper()
    signal.signal(signal.SIGTERM, _on_sigterm)
    if args.host_pid is not None:
        _watch_host(args.host_pid)

    channel = None
    if args.fd is not None and SHM_AVAILABLE:
        channel = FdChannel(socket.socket(fileno=args.fd))
    server = _Server(args.endpoint, args.entry, channel, max(1, args.threads), DEFAULT_LIMITS, args.listen_fd)
    try:
        code = server.serve()
    finally:
        server.shutdown()
        kill_tree(os.getpid(), include_root=False)
        reap_children()
    return code
