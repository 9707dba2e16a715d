"""The runner side: ``python -m carton_protocol --endpoint ipc://... --entry module:Class [--host-pid N] [--fd N]``.

The loop binds a ROUTER socket at the endpoint (each host thread talks to it over its own DEALER), imports the
entry, answers ``hello``, then serves ``load``/``pack``/``infer``/``release``/``close``. A ``concurrent`` runner's
infers run on a thread pool, their replies coming back to the socket-owning thread over an inproc socket, except
short calls while the pool is idle, which run on the socket thread itself (`_Server._run_infer`).

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
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import zmq

from ._framing import decode_tensors, encode_tensors
from ._limits import DEFAULT_LIMITS, WireLimits
from ._messages import (
    PROTOCOL_VERSION,
    Op,
    decode_opts,
    decode_specs,
    encode_specs,
    field_list,
    field_str,
    pack_header,
    unpack_header,
)
from ._reaper import kill_tree, reap_children, set_child_subreaper, set_parent_death_signal
from ._runner import LoadContext, PackContext, PackResult, Runner
from ._shm import SHM_AVAILABLE, FdChannel, PeerSegments, SegmentPool
from ._templates import Plan, Templates
from ._zmqio import recv_message, send_message
from .errors import FrameError, ProtocolError, VersionMismatch

__all__ = ["import_entry", "main"]

_TRACEBACK_CHARS = 8000
_EXIT_IMPORT_FAILED = 2
_EXIT_VERSION_MISMATCH = 3
#: A concurrent runner's call runs on the socket thread (no pool hand-off) only while calls take less than this: the
#: hand-off costs about 0.2 ms, which matters to a 50 us call, and an inline call delays requests that arrive
#: meanwhile by its own length, which matters to a 2 ms one (two clients then got 1.15x instead of 1.99x).
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


class InvalidOutput(Exception):
    """The runner's `infer` returned something the wire cannot carry (reported to the host under this name)."""


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


def _error(exc: BaseException) -> dict[str, str]:
    text = "".join(traceback.format_exception(exc))
    return {"kind": type(exc).__name__, "message": str(exc), "traceback": text[-_TRACEBACK_CHARS:]}


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
    def __init__(self, endpoint: str, entry: str, fd_channel: FdChannel | None, threads: int, limits: WireLimits):
        self.entry = entry
        self.limits = limits
        self.threads = threads
        self.context = zmq.Context()
        self.router = self.context.socket(zmq.ROUTER)
        self.router.linger = 1000
        self.router.bind(endpoint)
        self.channel = fd_channel
        self.pool: SegmentPool | None = None
        self.peer: PeerSegments | None = None
        self.threshold = 0
        self.templates = Templates(limits=limits, sends="reply")
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
        self.local = threading.local()
        self.main_thread = threading.get_ident()
        self.running = True
        self.exit_code = 0
        self.warnings: list[str] = []
        try:
            self.runner_class = import_entry(entry)
        except BaseException as exc:
            self.import_error = exc

    # --- socket thread ---------------------------------------------------------------------------------------
    def serve(self) -> int:
        if self.runner_class is not None and self.runner_class.concurrent:
            return self._serve_concurrent()
        router = self.router
        while self.running:
            self._handle(recv_message(router))
        return self.exit_code

    def _serve_concurrent(self) -> int:
        self.results = self.context.socket(zmq.PULL)
        self.results.bind("inproc://results")
        self.executor = ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="carton-infer")
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        poller.register(self.results, zmq.POLLIN)
        while self.running:
            for sock, _ in poller.poll():
                if sock is self.router:
                    self._handle(recv_message(self.router))
                else:
                    # Counted down before the reply leaves: the host's next request then finds the pool idle.
                    self.pooled -= 1
                    send_message(self.router, recv_message(self.results))
        return self.exit_code

    def _run_infer(self, infer: Callable[..., None], *args: Any) -> None:
        """Run one infer: on this thread when the runner is not concurrent, or when it is but the last call was short
        and none is running on the pool; on the pool otherwise.

        The pool costs two thread hand-offs per call (to a pool thread, and the reply back over the inproc socket):
        about 190 us of a 310 us round trip on two cores (docs/protocol.md, "Concurrent runners"). Requests that
        arrive while an inline call runs wait for it, as every request does with a non-concurrent runner: short calls
        are served one after another on this thread, and once a call takes long the next ones go to the pool.
        """
        executor = self.executor
        if executor is None or (self.last_infer_seconds < self.inline_max_seconds and self.pooled == 0):
            infer(*args)
            return
        self.pooled += 1
        executor.submit(infer, *args)

    def _send(self, ident: Any, header: dict[str, Any], frames: Sequence[Any] = ()) -> None:
        if self.pool is not None:
            dropped = self.pool.take_dropped()
            if dropped:
                header["drop"] = dropped
        self._send_raw([ident, pack_header(header), *frames])

    def _send_raw(self, message: list[Any]) -> None:
        if self.results is None or threading.get_ident() == self.main_thread:
            send_message(self.router, message)
        else:
            sender = getattr(self.local, "sender", None)
            if sender is None:
                sender = self.local.sender = self.context.socket(zmq.PUSH)
                sender.connect("inproc://results")
            send_message(sender, message)

    def _handle(self, frames: list[zmq.Frame]) -> None:
        if len(frames) < 2:
            return  # not a request (an empty message from a confused peer): nothing to answer
        ident = frames[0]
        data = frames[1].bytes
        if self.runner is not None:
            # A plain infer whose header bytes (after the id) were accepted before: no msgpack, no re-checking.
            matched = self.templates.match(data)
            if matched is not None:
                self._run_infer(self._infer_planned, ident, matched[0], matched[1], frames[2:])
                return
        try:
            header = unpack_header(data, self.limits)
            request_id = header.get("id")
            op = header.get("op")
            if type(request_id) is not int or type(op) is not str:
                raise FrameError("request header needs an int 'id' and a str 'op'")
        except ProtocolError as exc:
            self._send(ident, {"id": -1, "ok": False, "error": _error(exc)})
            return
        if "drop" in header and self.peer is not None:
            drop = header["drop"]
            if type(drop) is list:
                self.peer.drop([item for item in drop if type(item) is str])
        if op == "infer" and self.runner is not None:
            self._run_infer(self._infer, ident, request_id, header, frames[2:], data)
            return
        try:
            if op == Op.INFER:
                raise ProtocolError("infer before load: the host must send 'load' first")
            if op == Op.RELEASE:
                if self.pool is not None:
                    for segment_id in field_list(header, "segments", "release"):
                        if type(segment_id) is str:
                            self.pool.release(segment_id)
                return
            reply: dict[str, Any] = {"id": request_id, "ok": True}
            self.warnings = []
            if op == Op.HELLO:
                reply.update(self._hello(header))
            elif op == Op.LOAD:
                reply.update(self._load(header))
            elif op == Op.PACK:
                reply.update(self._pack(header))
            elif op == Op.CLOSE:
                self._close()
            else:
                raise FrameError(f"unknown op {op!r}")
        except VersionMismatch as exc:
            self._send(ident, {"id": request_id, "ok": False, "protocol": PROTOCOL_VERSION, "error": _error(exc)})
            self.running = False
            self.exit_code = _EXIT_VERSION_MISMATCH
            return
        except Exception as exc:
            failure: dict[str, Any] = {"id": request_id, "ok": False, "error": _error(exc)}
            if self.warnings:
                failure["warnings"] = [str(warning) for warning in self.warnings]
            if op == Op.HELLO:
                failure["protocol"] = PROTOCOL_VERSION
                self.running = False
                self.exit_code = _EXIT_IMPORT_FAILED
            self._send(ident, failure)
            return
        self._send(ident, reply)

    def _hello(self, header: dict[str, Any]) -> dict[str, Any]:
        remote = header.get("protocol")
        if remote != PROTOCOL_VERSION:
            message = f"host speaks carton protocol {remote!r}, this runner ({self.entry}) speaks {PROTOCOL_VERSION}"
            print(f"carton runner: {message}", file=sys.stderr, flush=True)
            raise VersionMismatch(message, local=PROTOCOL_VERSION, remote=remote if type(remote) is int else -1)
        if self.import_error is not None:
            raise self.import_error
        assert self.runner_class is not None
        threshold = header.get("shm_threshold")
        if self.channel is not None and type(threshold) is int and threshold > 0:
            self.threshold = threshold
            self.pool = SegmentPool("r", self.channel)
            self.peer = PeerSegments(self.channel, writable=True, max_segments=self.limits.max_segments)
        return {
            "protocol": PROTOCOL_VERSION,
            "pid": os.getpid(),
            "entry": self.entry,
            "concurrent": bool(self.runner_class.concurrent),
            "python": platform.python_version(),
        }

    def _contexts(self, header: dict[str, Any], what: str) -> tuple[Path, Any, Any, Any, list[str]]:
        model_dir = Path(field_str(header, "model_dir", what))
        opts = decode_opts(header.get("opts"), f"{what} opts")
        inputs = decode_specs(header.get("inputs"), f"{what} inputs", self.limits)
        outputs = decode_specs(header.get("outputs"), f"{what} outputs", self.limits)
        return model_dir, opts, inputs, outputs, self.warnings

    def _load(self, header: dict[str, Any]) -> dict[str, Any]:
        if self.runner is not None:
            raise ProtocolError("the model is already loaded; a runner process loads one model")
        assert self.runner_class is not None
        model_dir, opts, inputs, outputs, warnings = self._contexts(header, "load")
        scratch = header.get("scratch_dir")
        runner = self.runner_class()
        runner.load(
            LoadContext(
                model_dir=model_dir,
                opts=opts,
                inputs=inputs,
                outputs=outputs,
                scratch_dir=Path(scratch) if type(scratch) is str else None,
                warn=warnings.append,
            )
        )
        self.runner = runner
        return {"warnings": [str(warning) for warning in warnings]}

    def _pack(self, header: dict[str, Any]) -> dict[str, Any]:
        assert self.runner_class is not None
        model_dir, opts, inputs, outputs, warnings = self._contexts(header, "pack")
        result = self.runner_class.pack(
            PackContext(model_dir=model_dir, opts=opts, inputs=inputs, outputs=outputs, warn=warnings.append)
        )
        if not isinstance(result, PackResult):
            raise InvalidOutput(f"{self.entry}.pack returned a {type(result).__name__}, expected a PackResult")
        try:
            encoded = {
                "inputs": encode_specs(tuple(result.inputs)),
                "outputs": encode_specs(tuple(result.outputs)),
                "opts": decode_opts(dict(result.opts), "pack opts"),
            }
        except (ValueError, TypeError, AttributeError, ProtocolError) as exc:
            raise InvalidOutput(f"{self.entry}.pack returned specs or opts the wire cannot carry: {exc}") from exc
        return {"warnings": [str(warning) for warning in warnings], **encoded}

    def _close(self) -> None:
        self.running = False
        if self.executor is not None:
            self.executor.shutdown(wait=True)
        if self.runner is not None:
            runner, self.runner = self.runner, None
            runner.close()

    # --- any thread ------------------------------------------------------------------------------------------
    def _infer(
        self, ident: Any, request_id: int, header: dict[str, Any], frames: list[zmq.Frame], data: bytes
    ) -> None:
        try:
            inputs, _ = decode_tensors(
                header.get("tensors"),
                [frame.buffer for frame in frames],
                limits=self.limits,
                peer=self.peer,
                copy_shared=False,
            )
            self.templates.learn(data, header)
            self._reply(ident, request_id, inputs)
        except Exception as exc:
            self._send(ident, {"id": request_id, "ok": False, "error": _error(exc)})

    def _infer_planned(self, ident: Any, request_id: int, plan: Plan, frames: list[zmq.Frame]) -> None:
        try:
            self._reply(ident, request_id, plan.decode([frame.buffer for frame in frames]))
        except Exception as exc:
            self._send(ident, {"id": request_id, "ok": False, "error": _error(exc)})

    def _reply(self, ident: Any, request_id: int, inputs: dict[str, Any]) -> None:
        runner = self.runner
        if runner is None:
            raise ProtocolError("the model was closed")
        start = time.perf_counter()
        outputs = runner.infer(inputs)
        self.last_infer_seconds = time.perf_counter() - start
        pool = self.pool
        if type(outputs) is dict and (pool is None or not pool.has_dropped):
            template = self.templates.encode(outputs, self.threshold if pool is not None else 1 << 62)
            if template is not None:
                tail, data_frames = template
                self._send_raw([ident, self.templates.header(request_id, tail), *data_frames])
                return
        encoded = self._encode_outputs(outputs)
        self._send(ident, {"id": request_id, "ok": True, "tensors": encoded.entries}, encoded.frames)

    def _encode_outputs(self, outputs: object) -> Any:
        if type(outputs) is not dict and not isinstance(outputs, Mapping):
            raise InvalidOutput(f"{self.entry}.infer returned a {type(outputs).__name__}, expected a mapping")
        if any(isinstance(value, tuple) for value in outputs.values()):
            outputs = {name: list(value) if isinstance(value, tuple) else value for name, value in outputs.items()}
        try:
            return encode_tensors(outputs, pool=self.pool, threshold=self.threshold)
        except FrameError as exc:
            raise InvalidOutput(f"{self.entry}.infer returned an output the wire cannot carry: {exc}") from exc

    def shutdown(self) -> None:
        if self.runner is not None:
            with contextlib.suppress(Exception):
                self.runner.close()
        if self.pool is not None:
            self.pool.close()
        if self.peer is not None:
            self.peer.close()
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
    server = _Server(args.endpoint, args.entry, channel, max(1, args.threads), DEFAULT_LIMITS)
    try:
        code = server.serve()
    finally:
        server.shutdown()
        kill_tree(os.getpid(), include_root=False)
        reap_children()
    return code
