"""`RunnerProcess`: one runner subprocess, from start and handshake to load, infer and close.

Every failure becomes a `carton.RunnerError` subclass naming the runner, the operation and the limit or signal:
a runner that dies fails the calls in flight with `RunnerCrashed` within milliseconds (its pidfd is polled with
the socket), one that does not answer in time is killed with its whole process tree (`RunnerTimeout`), and the
process, its descendants and its runtime directory are cleaned up on close, on garbage collection and at exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import signal
import socket
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import zmq
from carton_protocol import OptValue, PackResult, ProtocolError, RemoteError, RunnerSpec, Tensor, TensorSpec
from carton_protocol._framing import decode_tensors, encode_tensors
from carton_protocol._limits import DEFAULT_LIMITS, WireLimits
from carton_protocol._messages import (
    PROTOCOL_VERSION,
    Op,
    decode_opts,
    decode_specs,
    encode_specs,
    hello_request,
    infer_request,
    pack_header,
)
from carton_protocol._shm import SHM_AVAILABLE, FdChannel, Segment

from .._warnings import warn_user
from ..errors import (
    InvalidInput,
    InvalidOutput,
    ModelClosed,
    ProtocolMismatch,
    RunnerCPULimit,
    RunnerCrashed,
    RunnerError,
    RunnerFailed,
    RunnerMemoryLimit,
    RunnerProtocolError,
    RunnerStartError,
    RunnerTimeout,
    RunnerWarning,
)
from ._connection import AsyncChannel, CallTimeout, Connection, PeerGone, Reply
from ._exits import Resources as _Resources
from ._exits import describe_exit as _describe_exit
from ._exits import exit_signal as _exit_signal
from ._exits import memory_limit_hit as _memory_limit_hit
from ._launch import LaunchPlan, build_launch_plan, make_runtime_dir, read_log_tail, spawn

__all__ = ["DEFAULT_SHM_THRESHOLD", "LaunchPlan", "RunnerProcess"]

#: Tensors of at least this many bytes travel in shared memory, smaller ones in the message: shared memory wins
#: from 64 KiB up (bench/bench_protocol.py, threshold section; docs/protocol.md).
DEFAULT_SHM_THRESHOLD = 1 << 16

# Threads of the pool behind infer_async's fallback (large tensors, no pidfd).
_ASYNC_THREADS = 64
# infer_async requests moving at least this many bytes run on the thread pool: their copies to and from shared
# memory (a few ms per 64 MiB) would stall the event loop, and next to them a thread hand-off costs nothing.
_ASYNC_COPY_BYTES = 1 << 20

_PROTOCOL_KINDS = frozenset({"ProtocolError", "FrameError", "LimitExceeded"})


class RunnerProcess:
    """One runner in its own process. `infer` is thread-safe: several calls may be in flight at once."""

    def __init__(self, spec: RunnerSpec, plan: LaunchPlan, resources: _Resources, limits: WireLimits) -> None:
        self.spec = spec
        self.plan = plan
        self._resources = resources
        self._limits = limits
        self._threshold = DEFAULT_SHM_THRESHOLD
        self._lock = threading.Condition()
        self._inflight = 0
        self._closed = False
        self._fate: RunnerError | None = None  # why the host killed the process, for calls that were waiting
        self._executor: ThreadPoolExecutor | None = None
        self._channels: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, AsyncChannel] = (
            weakref.WeakKeyDictionary()
        )
        self._last_channel: tuple[weakref.ref[asyncio.AbstractEventLoop], AsyncChannel] | None = None
        self._finalizer = weakref.finalize(self, resources.release)
        self.pid: int = resources.process.pid
        self.runner_pid: int | None = None
        self.concurrent = spec.concurrent
        seconds = plan.limits.get("request_seconds")
        self._request_seconds: float | None = None if seconds is None else float(seconds)

    # --- start ---------------------------------------------------------------------------------------------------
    @classmethod
    def start(
        cls,
        spec: RunnerSpec,
        *,
        wrap: Callable[[LaunchPlan], LaunchPlan] | None = None,
        extra_env: Mapping[str, str] | None = None,
        handshake_timeout: float = 30.0,
        model_dir: Path | None = None,
        shm_threshold: int | None = DEFAULT_SHM_THRESHOLD,
        limits: WireLimits = DEFAULT_LIMITS,
        threads: int = 8,
    ) -> RunnerProcess:
        """Start `spec`'s runner and complete the version handshake.

        `wrap` may rewrite the launch plan (a sandbox). `model_dir`, when known, is recorded in the plan so a
        sandbox can expose it. `shm_threshold=None` keeps every tensor in the message (no shared memory).
        """
        try:
            runtime_dir = make_runtime_dir()
        except OSError as exc:
            raise RunnerStartError(f"cannot create a runtime directory for runner {spec.entry}: {exc}") from exc
        resources = _Resources(runtime_dir)
        use_shm = shm_threshold is not None and SHM_AVAILABLE
        host_end: socket.socket | None = None
        runner_end: socket.socket | None = None
        try:
            if use_shm:
                host_end, runner_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                runner_end.set_inheritable(True)
            plan = build_launch_plan(
                spec,
                runtime_dir=runtime_dir,
                channel_fd=runner_end.fileno() if runner_end is not None else None,
                extra_env=extra_env,
                model_dir=model_dir,
                threads=threads,
            )
            if wrap is not None:
                plan = wrap(plan)
            try:
                resources.process = spawn(plan)
            except OSError as exc:
                raise RunnerStartError(f"cannot start runner {spec.entry} ({plan.argv[0]}): {exc}") from exc
        except BaseException:
            for end in (host_end, runner_end):
                if end is not None:
                    end.close()
            resources.release()
            raise
        if runner_end is not None:
            runner_end.close()
        process = resources.process
        try:
            resources.pidfd = os.pidfd_open(process.pid)
        except (OSError, AttributeError):
            resources.pidfd = None  # no pidfd (old kernel): calls poll the process instead
        resources.connection = Connection(
            endpoint=plan.endpoint,
            pidfd=resources.pidfd,
            is_alive=lambda: process.poll() is None,
            limits=limits,
            channel=FdChannel(host_end) if host_end is not None else None,
        )
        runner = cls(spec, plan, resources, limits)
        runner._threshold = shm_threshold if use_shm and shm_threshold is not None else 0
        try:
            runner._handshake(handshake_timeout, use_shm)
        except (ProtocolMismatch, RunnerStartError, RunnerMemoryLimit):
            # The runner answered and is on its way out: let it finish saying why (its log) before cleanup.
            with contextlib.suppress(Exception):
                process.wait(timeout=2)
            runner._finalizer()
            raise
        except BaseException:
            runner._finalizer()
            raise
        return runner

    def _handshake(self, timeout: float, use_shm: bool) -> None:
        header = hello_request(host_pid=os.getpid(), shm_threshold=self._threshold if use_shm else None)
        try:
            reply, _ = self._connection("handshake").call(header, timeout=timeout)
        except PeerGone:
            text = f"runner {self.spec.entry} {self._exit_text()} before completing the handshake"
            raise self._start_error(text, self._log_text(), read_log_tail(self.plan.log_path, 1 << 16)) from None
        except CallTimeout:
            self._resources.kill()
            raise RunnerTimeout(
                f"runner {self.spec.entry} did not complete the handshake within {timeout:g} s "
                f"(handshake_timeout); it was killed{self._log_text()}"
            ) from None
        except ProtocolError as exc:
            raise RunnerProtocolError(f"runner {self.spec.entry} sent a malformed handshake: {exc}") from exc
        remote = reply.get("protocol")
        if remote != PROTOCOL_VERSION:
            raise ProtocolMismatch(
                f"host speaks carton protocol {PROTOCOL_VERSION}, runner {self.spec.entry} speaks {remote!r}"
            )
        if reply.get("ok") is not True:
            error = self._remote_error(reply)
            text = f"runner {self.spec.entry} failed to start"
            raise self._start_error(text, f": {error.kind}: {error}", error.traceback) from error
        pid = reply.get("pid")
        self.runner_pid = pid if type(pid) is int else None
        self.concurrent = reply.get("concurrent") is True

    # --- calls ---------------------------------------------------------------------------------------------------
    def _connection(self, what: str = "call it") -> Connection:
        connection = self._resources.connection
        if connection is None or self._closed:
            raise ModelClosed(f"runner {self.spec.entry} is closed; cannot {what}")
        return connection

    def _request(
        self, what: str, header: dict[str, Any], frames: list[Any], timeout: float | None, limit_name: str
    ) -> tuple[dict[str, Any], list[zmq.Frame]]:
        connection = self._enter(what)
        try:
            return connection.call(header, frames, timeout=timeout)
        except (PeerGone, CallTimeout) as exc:
            raise self._translate(exc, what, timeout, limit_name) from None
        except (ProtocolError, zmq.ZMQError) as exc:
            raise self._translate(exc, what, timeout, limit_name) from exc
        finally:
            self._leave()

    def _exchange(
        self, connection: Connection, parts: list[Any], request_id: int, timeout: float | None, limit_name: str
    ) -> Reply:
        self._enter("infer")
        try:
            return connection.exchange(parts, request_id, timeout=timeout)
        except (PeerGone, CallTimeout) as exc:
            raise self._translate(exc, "infer", timeout, limit_name) from None
        except (ProtocolError, zmq.ZMQError) as exc:
            raise self._translate(exc, "infer", timeout, limit_name) from exc
        finally:
            self._leave()

    def _enter(self, what: str) -> Connection:
        with self._lock:
            connection = self._resources.connection
            if self._closed or connection is None:
                raise ModelClosed(f"runner {self.spec.entry} is closed; cannot {what}")
            self._inflight += 1
        return connection

    def _leave(self) -> None:
        with self._lock:
            self._inflight -= 1
            if self._closed:
                self._lock.notify_all()

    def _translate(self, exc: Exception, what: str, timeout: float | None, limit_name: str) -> Exception:
        """The error a failed exchange raises."""
        if isinstance(exc, PeerGone):
            return self._gone_error(what)
        if isinstance(exc, CallTimeout):
            fate = RunnerTimeout(
                f"runner {self.spec.entry} did not answer {what} within {timeout:g} s ({limit_name}); it was killed"
            )
            self._kill(fate)
            return fate
        if isinstance(exc, ProtocolError):
            return RunnerProtocolError(f"runner {self.spec.entry} sent a malformed reply to {what}: {exc}")
        if self._closed:
            return ModelClosed(f"runner {self.spec.entry} was closed during {what}")
        return RunnerProtocolError(f"runner {self.spec.entry}: transport failed during {what}: {exc}")

    def _gone_error(self, what: str) -> RunnerError:
        if self._fate is not None:
            fate = self._fate
            return type(fate)(f"{fate} (while waiting for {what})")
        if self._closed:
            return ModelClosed(f"runner {self.spec.entry} was closed during {what}")
        text = f"runner {self.spec.entry} (pid {self.pid}) {self._exit_text()} during {what}"
        signum = _exit_signal(self.returncode, self.plan.exit_signal_base)
        cpu = self.plan.limits.get("cpu_seconds")
        if cpu is not None and signum in (signal.SIGXCPU, signal.SIGKILL):
            # SIGXCPU at the soft limit; SIGKILL at the hard one (a second later) if the runner caught SIGXCPU.
            return RunnerCPULimit(f"{text}: it went over its CPU-time limit (cpu_seconds={cpu:g}){self._log_text()}")
        return RunnerCrashed(f"{text}{self._log_text()}")

    def _start_error(self, what: str, reason: str, detail: str) -> RunnerError:
        """`RunnerStartError`, or `RunnerMemoryLimit` naming the limit when the failure shows it was out of memory."""
        limit = _memory_limit_hit(self.plan.limits, reason, detail)
        if limit is not None:
            return RunnerMemoryLimit(f"{what}: it ran out of memory under its memory limit ({limit}){reason}")
        return RunnerStartError(f"{what}{reason}")

    def _kill(self, fate: RunnerError) -> None:
        with self._lock:
            if self._fate is None:
                self._fate = fate
        self._resources.kill()

    def load(
        self,
        *,
        model_dir: Path,
        opts: Mapping[str, OptValue],
        inputs: tuple[TensorSpec, ...],
        outputs: tuple[TensorSpec, ...],
        timeout: float | None = None,
    ) -> None:
        """Load the model in the runner; its failure is `RunnerStartError` with the runner's message."""
        header = self._model_header(Op.LOAD, model_dir, opts, inputs, outputs)
        header["scratch_dir"] = str(self.plan.scratch_dir)
        reply, _ = self._request("load", header, [], timeout, "load timeout")
        self._raise_warnings(reply)
        if reply.get("ok") is not True:
            error = self._remote_error(reply)
            text = f"runner {self.spec.entry} failed to load {model_dir}"
            raise self._start_error(text, f": {error.kind}: {error}", error.traceback) from error

    def pack(
        self,
        *,
        model_dir: Path,
        opts: Mapping[str, OptValue],
        inputs: tuple[TensorSpec, ...],
        outputs: tuple[TensorSpec, ...],
        timeout: float | None = None,
    ) -> PackResult:
        """Run the runner class's `pack` on `model_dir`; its failure is `RunnerFailed` with the runner's message."""
        header = self._model_header(Op.PACK, model_dir, opts, inputs, outputs)
        reply, _ = self._request("pack", header, [], timeout, "pack timeout")
        self._raise_warnings(reply)
        if reply.get("ok") is not True:
            raise RunnerFailed(
                f"runner {self.spec.entry} failed to pack {model_dir}: {self._remote_text(reply)}"
            ) from self._remote_error(reply)
        try:
            return PackResult(
                inputs=decode_specs(reply.get("inputs"), "pack inputs", self._limits),
                outputs=decode_specs(reply.get("outputs"), "pack outputs", self._limits),
                opts=decode_opts(reply.get("opts"), "pack opts"),
            )
        except ProtocolError as exc:
            raise RunnerProtocolError(f"runner {self.spec.entry} sent a malformed pack result: {exc}") from exc

    def infer(self, tensors: Mapping[str, Tensor], *, timeout: float | None = None) -> dict[str, Tensor]:
        """Run one inference; thread-safe. Outputs are ordinary numpy arrays the caller owns."""
        connection = self._connection("infer")
        parts, request_id, segment = self._encode_request(connection, tensors)
        limit_name = "infer timeout"
        if timeout is None and self._request_seconds is not None:
            timeout, limit_name = self._request_seconds, "its request_seconds limit"
        try:
            reply = self._exchange(connection, parts, request_id, timeout, limit_name)
        finally:
            if segment is not None and connection.pool is not None:
                connection.pool.release(segment.id)
        return self._outputs(connection, reply)

    def _encode_request(
        self, connection: Connection, tensors: Mapping[str, Tensor]
    ) -> tuple[list[Any], int, Segment | None]:
        """The parts of an infer request (header bytes, data frames), its id, and the segment it fills, if any."""
        pool = connection.pool
        if pool is None or not pool.has_dropped:
            template = connection.templates.encode(tensors, self._threshold or 1 << 62)
            if template is not None:
                request_id = connection.next_id()
                return [connection.templates.header(request_id, template[0]), *template[1]], request_id, None
        try:
            encoded = encode_tensors(tensors, pool=pool, threshold=self._threshold or 1 << 62)
        except ProtocolError as exc:
            raise InvalidInput(str(exc)) from exc
        header = infer_request(encoded.entries)
        request_id = header["id"] = connection.next_id()
        if pool is not None:
            dropped = pool.take_dropped()
            if dropped:
                header["drop"] = dropped
        try:
            data = pack_header(header)
        except ProtocolError as exc:
            if encoded.segment is not None and pool is not None:
                pool.release(encoded.segment.id)
            raise InvalidInput(str(exc)) from exc
        return [data, *encoded.frames], request_id, encoded.segment

    def _outputs(self, connection: Connection, reply: Reply) -> dict[str, Tensor]:
        if reply.plan is not None:
            try:
                return reply.plan.decode([frame.buffer for frame in reply.frames])
            except ProtocolError as exc:
                raise RunnerProtocolError(f"runner {self.spec.entry} sent malformed infer outputs: {exc}") from exc
        header = reply.header
        assert header is not None
        if header.get("ok") is not True:
            raise self._infer_error(header)
        outputs = self._decode_outputs(connection, header, reply.frames)
        connection.templates.learn(reply.data, header)
        return outputs

    def _decode_outputs(
        self, connection: Connection, reply: dict[str, Any], frames: list[zmq.Frame]
    ) -> dict[str, Tensor]:
        if "drop" in reply and connection.peer is not None:
            drop = reply["drop"]
            if type(drop) is list:
                connection.peer.drop([item for item in drop if type(item) is str])
        used: list[str] = []
        try:
            outputs, used = decode_tensors(
                reply.get("tensors"),
                [frame.buffer for frame in frames],
                limits=self._limits,
                peer=connection.peer,
                copy_shared=True,
            )
        except ProtocolError as exc:
            raise RunnerProtocolError(f"runner {self.spec.entry} sent malformed infer outputs: {exc}") from exc
        finally:
            if used:
                with contextlib.suppress(zmq.ZMQError):
                    connection.send({"op": Op.RELEASE.value, "id": 0, "segments": used})
        return outputs

    def _infer_error(self, reply: dict[str, Any]) -> Exception:
        error = reply.get("error")
        kind = error.get("kind") if isinstance(error, dict) else None
        text = self._remote_text(reply)
        cause = self._remote_error(reply)
        if kind == "InvalidOutput":
            failure: Exception = InvalidOutput(f"runner {self.spec.entry}: {text}")
        elif isinstance(kind, str) and kind.endswith("MemoryError"):
            memory = self.plan.limits.get("memory_bytes")
            limit = f"its memory limit (memory_bytes={memory:.0f})" if memory is not None else "memory"
            failure = RunnerMemoryLimit(f"runner {self.spec.entry} ran out of {limit} during infer: {text}")
        elif kind in _PROTOCOL_KINDS:
            failure = RunnerProtocolError(f"runner {self.spec.entry} rejected the request: {text}")
        else:
            failure = RunnerFailed(f"runner {self.spec.entry} failed during infer: {text}")
        failure.__cause__ = cause
        return failure

    async def infer_async(self, tensors: Mapping[str, Tensor], *, timeout: float | None = None) -> dict[str, Tensor]:
        """`infer` without blocking the event loop; any number of calls may be in flight.

        The call runs on the loop itself: the request goes out on the loop's own socket to the runner, and the
        reply (or the runner's death, through its pidfd, or the timeout) wakes the awaiting task. A cancelled call's
        late reply is discarded. Requests of at least `_ASYNC_COPY_BYTES` (whose copies into and out of shared
        memory would stall the loop) and hosts without pidfd run `infer` on this runner's thread pool instead.
        """
        channel = self._async_channel(tensors)
        if channel is None:
            loop = asyncio.get_running_loop()
            call = functools.partial(self.infer, tensors, timeout=timeout)
            return await loop.run_in_executor(self._async_pool(), call)
        connection = self._connection("infer")
        parts, request_id, segment = self._encode_request(connection, tensors)
        limit_name = "infer timeout"
        if timeout is None and self._request_seconds is not None:
            timeout, limit_name = self._request_seconds, "its request_seconds limit"
        try:
            reply = await channel.call(parts, request_id, timeout=timeout)
        except asyncio.CancelledError:
            if segment is not None and connection.pool is not None:
                # The runner may still be reading the input: the segment is reused only once its reply is in.
                channel.orphan(request_id, functools.partial(connection.pool.release, segment.id))
                segment = None
            raise
        except CallTimeout as exc:
            # Killing the runner's tree waits for it to go: not on the loop.
            raise await asyncio.to_thread(self._translate, exc, "infer", timeout, limit_name) from None
        except PeerGone as exc:
            raise self._translate(exc, "infer", timeout, limit_name) from None
        except (ProtocolError, zmq.ZMQError) as exc:
            raise self._translate(exc, "infer", timeout, limit_name) from exc
        finally:
            if segment is not None and connection.pool is not None:
                connection.pool.release(segment.id)
        return self._outputs(connection, reply)

    def _async_channel(self, tensors: Mapping[str, Tensor]) -> AsyncChannel | None:
        """This loop's channel to the runner, or None when the call should run on the thread pool instead."""
        loop = asyncio.get_running_loop()
        last = self._last_channel
        if last is not None and last[0]() is loop and not last[1].closed:
            channel: AsyncChannel | None = last[1]
        else:
            channel = self._new_async_channel(loop)
        if channel is not None and self._threshold:
            size = 0
            for value in tensors.values():
                if type(value) is np.ndarray:
                    size += value.nbytes
            if size >= _ASYNC_COPY_BYTES:
                return None
        return channel

    def _new_async_channel(self, loop: asyncio.AbstractEventLoop) -> AsyncChannel | None:
        connection = self._connection("infer")
        if connection.pidfd is None:
            return None
        with self._lock:
            if self._closed:
                raise ModelClosed(f"runner {self.spec.entry} is closed; cannot infer")
            channel = self._channels.get(loop)
            if channel is None or channel.closed:
                try:
                    channel = AsyncChannel(connection, loop)
                except NotImplementedError:  # loops without add_reader (Windows' proactor): fall back to the pool
                    return None
                self._channels[loop] = channel
            self._last_channel = (weakref.ref(loop), channel)
        return channel

    def _async_pool(self) -> ThreadPoolExecutor:
        pool = self._executor
        if pool is None:
            with self._lock:
                if self._closed:
                    raise ModelClosed(f"runner {self.spec.entry} is closed; cannot infer")
                if self._executor is None:
                    self._executor = ThreadPoolExecutor(_ASYNC_THREADS, thread_name_prefix="carton-infer-async")
                pool = self._executor
        return pool

    # --- state ---------------------------------------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        process = self._resources.process
        return not self._closed and process is not None and process.poll() is None

    @property
    def returncode(self) -> int | None:
        process = self._resources.process
        return None if process is None else process.poll()

    def close(self, timeout: float = 5.0) -> None:
        """Ask the runner to close its model and exit; kill its whole tree if it has not within `timeout`."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        process = self._resources.process
        connection = self._resources.connection
        if process is not None and process.poll() is None and connection is not None:
            give_up = time.monotonic() + timeout
            with contextlib.suppress(PeerGone, CallTimeout, ProtocolError, zmq.ZMQError):
                connection.call({"op": Op.CLOSE.value, "id": 0}, timeout=timeout)
            with contextlib.suppress(Exception):
                # After its reply the runner still kills its descendants and tears down its sockets.
                process.wait(timeout=max(0.2, give_up - time.monotonic()))
        self._resources.kill()
        # Calls still waiting see the pidfd fire and leave; give them a moment before their sockets go.
        deadline = time.monotonic() + 1.0
        with self._lock:
            while self._inflight and time.monotonic() < deadline:
                self._lock.wait(0.05)
        self._finalizer()
        if self._executor is not None:
            self._executor.shutdown(wait=False)

    def __enter__(self) -> RunnerProcess:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("alive" if self.alive else "dead")
        return f"<RunnerProcess {self.spec.runner_name} {self.spec.entry} pid={self.pid} {state}>"

    # --- helpers -------------------------------------------------------------------------------------------------
    def _model_header(
        self,
        op: Op,
        model_dir: Path,
        opts: Mapping[str, OptValue],
        inputs: tuple[TensorSpec, ...],
        outputs: tuple[TensorSpec, ...],
    ) -> dict[str, Any]:
        return {
            "op": op.value,
            "id": 0,
            "model_dir": str(model_dir),
            "opts": dict(opts),
            "inputs": encode_specs(inputs),
            "outputs": encode_specs(outputs),
        }

    def _exit_text(self) -> str:
        process = self._resources.process
        returncode = None
        if process is not None:
            with contextlib.suppress(Exception):
                returncode = process.wait(timeout=1)
        return _describe_exit(returncode, self.plan.exit_signal_base)

    def _log_text(self) -> str:
        tail = read_log_tail(self.plan.log_path)
        return f"; runner log ends with:\n{tail}" if tail else ""

    @staticmethod
    def _remote_error(reply: dict[str, Any]) -> RemoteError:
        error = reply.get("error")
        if not isinstance(error, dict):
            return RemoteError("runner reported a failure without details", kind="unknown")
        kind, message, trace = error.get("kind"), error.get("message"), error.get("traceback")
        return RemoteError(
            message if isinstance(message, str) else repr(message),
            kind=kind if isinstance(kind, str) else "unknown",
            traceback=trace if isinstance(trace, str) else "",
        )

    def _remote_text(self, reply: dict[str, Any]) -> str:
        error = self._remote_error(reply)
        return f"{error.kind}: {error}"

    def _raise_warnings(self, reply: dict[str, Any]) -> None:
        messages = reply.get("warnings")
        if type(messages) is list:
            for message in messages:
                warn_user(f"runner {self.spec.runner_name}: {message}", RunnerWarning)
