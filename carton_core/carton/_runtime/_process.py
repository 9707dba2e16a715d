"""`RunnerProcess`: one runner subprocess, from start and handshake to load, infer and close.

Every failure becomes a `carton` exception naming the runner, the operation and the limit or signal: a runner that
dies fails the calls in flight with `RunnerCrashed` within milliseconds (its pidfd is polled with the socket), one
that does not answer in time is killed with its whole process tree (`RunnerTimeout`), a failure the runner reports
becomes the exception its code maps to (`_failures.remote_failure`), and the process, its descendants and its
runtime directory are cleaned up on close, on garbage collection and at exit. Exceptions of the layers below (the
wire, ZeroMQ, the operating system) are translated in one place, `RunnerProcess._failure`. That failure side (the
translation, and the exceptions for a runner that exited, timed out, did not start or answered amiss) is
``_process_failures.py``'s `RunnerFailures`, which `RunnerProcess` inherits; the calls' own checks stay here.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import threading
import time
import weakref
from collections.abc import Callable, Hashable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NoReturn

import zmq
from carton_protocol import (
    PROTOCOL_VERSION,
    Close,
    ErrorReply,
    HelloReply,
    HostCodec,
    InferReply,
    Load,
    LoadReply,
    OptValue,
    Outgoing,
    Pack,
    PackReply,
    PackResult,
    ProtocolError,
    Received,
    Reply,
    Request,
    RunnerSpec,
    Tensor,
    TensorSpec,
    WireLimits,
)

from .._warnings import warn_user
from ..errors import (
    InvalidInput,
    ModelClosed,
    ProtocolMismatch,
    RunnerError,
    RunnerMemoryLimit,
    RunnerProtocolError,
    RunnerStartError,
    RunnerWarning,
)
from ._cgroups import runner_cgroup
from ._connection import Answer, AsyncChannel, CallTimeout, Connection, NotSent, PeerGone
from ._exits import Resources as _Resources
from ._failures import Operation
from ._launch import LaunchPlan, build_launch_plan, make_runtime_dir, spawn
from ._process_failures import RunnerFailures

__all__ = ["DEFAULT_SHM_THRESHOLD", "LaunchPlan", "RunnerProcess", "Started", "release_lent"]

#: Tensors of at least this many bytes travel in shared memory, smaller ones in the message: shared memory wins
#: from 64 KiB up (bench/bench_protocol.py, threshold section; docs/protocol.md).
DEFAULT_SHM_THRESHOLD = 1 << 16

# Threads of the pool behind infer_async's fallback (large tensors, no pidfd).
_ASYNC_THREADS = 64
# infer_async requests moving at least this many bytes run on the thread pool: their copies to and from shared
# memory would stall the event loop, and next to them a thread hand-off costs nothing.
_ASYNC_COPY_BYTES = 1 << 20

#: A call `RunnerProcess.start_infer_async` sent: its channel, its message, the future its answer comes in, and the
#: timer of its timeout.
Started = tuple[AsyncChannel, Outgoing, asyncio.Future[Answer], asyncio.TimerHandle | None]

#: What the layers below raise while a call waits; `RunnerProcess._failure` turns each into a `carton` exception.
_FOREIGN = (PeerGone, CallTimeout, ProtocolError, zmq.ZMQError, OSError)


def release_lent(lent: list[Callable[[], None]]) -> None:
    """Give back everything in `lent` (each once, whichever thread gets to it first)."""
    while lent:
        try:
            release = lent.pop()
        except IndexError:
            return
        release()


def _cause(exc: BaseException) -> BaseException | None:
    """What a translated exception is raised from: nothing for the host's own wake-ups, else the original."""
    return None if isinstance(exc, PeerGone | CallTimeout) else exc


class RunnerProcess(RunnerFailures):
    """One runner in its own process. `infer` is thread-safe: several calls may be in flight at once."""

    def __init__(self, spec: RunnerSpec, plan: LaunchPlan, resources: _Resources) -> None:
        self.spec = spec
        self.plan = plan
        self._resources = resources
        # Calls count themselves in and out under the bare lock (its C-level `with` is cheaper than the condition's);
        # `close` waits on the condition for them to leave.
        self._mutex = threading.RLock()
        self._lock = threading.Condition(self._mutex)
        self._inflight = 0
        self._closed = False
        self._fate: RunnerError | None = None  # why the host killed the process, for calls that were waiting
        self._executor: ThreadPoolExecutor | None = None
        self._channels: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, AsyncChannel] = weakref.WeakKeyDictionary()
        self._last_channel: tuple[weakref.ref[asyncio.AbstractEventLoop], AsyncChannel] | None = None
        self._finalizer = weakref.finalize(self, resources.release)
        assert resources.process is not None, "a RunnerProcess is made once its process started"
        self.pid: int = resources.process.pid
        self.runner_pid: int | None = None
        self.concurrent = spec.concurrent

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
        limits: WireLimits | None = None,
        threads: int = 8,
    ) -> RunnerProcess:
        """Start `spec`'s runner and complete the version handshake.

        `wrap` may rewrite the launch plan (a sandbox). `model_dir`, when known, is recorded in the plan so a
        sandbox can expose it. `shm_threshold=None` keeps every tensor in the message (no shared memory).
        """
        limits = limits if limits is not None else WireLimits()
        try:
            runtime = make_runtime_dir()
        except OSError as exc:
            raise RunnerStartError(f"cannot create a runtime directory for runner {spec.entry}: {exc}") from exc
        resources = _Resources(runtime, runner_cgroup())
        codec = HostCodec(limits=limits, shm_threshold=shm_threshold)
        try:
            plan = build_launch_plan(
                spec,
                runtime=runtime,
                channel_fd=codec.runner_fd,
                extra_env=extra_env,
                model_dir=model_dir,
                threads=threads,
            )
            if wrap is not None:
                plan = wrap(plan)
            cgroup = resources.cgroup
            try:
                process = spawn(plan, log_fd=runtime.log_fd, cgroup_procs=None if cgroup is None else cgroup.procs)
            except OSError as exc:
                raise RunnerStartError(f"cannot start runner {spec.entry} ({plan.argv[0]}): {exc}") from exc
            resources.process = process
        except BaseException:
            codec.close()
            resources.release()
            raise
        runtime.close_listener()  # the runner's now: a listening socket the host kept would take its connections
        codec.started()
        try:
            resources.pidfd = os.pidfd_open(process.pid)
        except (OSError, AttributeError):
            resources.pidfd = None  # no pidfd (old kernel): calls poll the process instead
        resources.connection = Connection(
            endpoint=plan.endpoint, pidfd=resources.pidfd, is_alive=lambda: resources.poll() is None, codec=codec
        )
        runner = cls(spec, plan, resources)
        try:
            runner._handshake(codec, handshake_timeout)
        except (ProtocolMismatch, RunnerStartError, RunnerMemoryLimit):
            # The runner answered and is on its way out: let it finish saying why (its log) before cleanup.
            resources.wait(2.0)
            runner._finalizer()
            raise
        except BaseException:
            runner._finalizer()
            raise
        return runner

    def _handshake(self, codec: HostCodec, timeout: float) -> None:
        reply = self._call(codec.hello(host_pid=os.getpid()), Operation.START, timeout, "handshake_timeout")
        remote = reply.protocol if isinstance(reply, HelloReply | ErrorReply) else None
        if remote is not None and remote != PROTOCOL_VERSION:
            raise self._mismatch(remote)
        match reply:
            case HelloReply(pid=pid, concurrent=concurrent):
                self.runner_pid = pid
                self.concurrent = concurrent
                if self._resources.cgroup is None:
                    self._resources.watch_runner(pid)
            case ErrorReply():
                raise self._remote_failure(reply, Operation.START)
            case _:
                raise self._unexpected(reply, "the handshake")

    def _mismatch(self, remote: object) -> ProtocolMismatch:
        return ProtocolMismatch(
            f"host speaks carton protocol {PROTOCOL_VERSION}, runner {self.spec.entry} speaks {remote!r}",
            host_version=PROTOCOL_VERSION,
            runner_version=remote if type(remote) is int else None,
        )

    # --- calls ---------------------------------------------------------------------------------------------------
    def _enter(self, what: str) -> Connection:
        with self._mutex:
            connection = self._resources.connection
            if self._closed or connection is None:
                raise ModelClosed(f"runner {self.spec.entry} is closed; cannot {what}")
            self._inflight += 1
        return connection

    def _leave(self) -> None:
        with self._mutex:
            self._inflight -= 1
            if self._closed:
                self._lock.notify_all()

    def _call(self, request: Request, operation: Operation, timeout: float | None, limit_name: str) -> Reply:
        """Send a request that is not an ``infer`` and return its reply; failures to get one are translated."""
        connection = self._enter("complete the handshake" if operation is Operation.START else str(operation))
        try:
            return connection.call(request, timeout=timeout)
        except _FOREIGN as exc:
            raise self._failure(exc, operation, timeout, limit_name) from _cause(exc)
        finally:
            self._leave()

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
        request = Load(
            id=0,
            model_dir=str(model_dir),
            opts=dict(opts),
            inputs=tuple(inputs),
            outputs=tuple(outputs),
            scratch_dir=str(self.plan.scratch_dir),
        )
        reply = self._call(request, Operation.LOAD, timeout, "load timeout")
        match reply:
            case LoadReply(warnings=warnings):
                self._raise_warnings(warnings)
            case ErrorReply(warnings=warnings):
                self._raise_warnings(warnings)
                raise self._remote_failure(reply, Operation.LOAD, str(model_dir))
            case _:
                raise self._unexpected(reply, "load")

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
        request = Pack(id=0, model_dir=str(model_dir), opts=dict(opts), inputs=tuple(inputs), outputs=tuple(outputs))
        reply = self._call(request, Operation.PACK, timeout, "pack timeout")
        match reply:
            case PackReply(warnings=warnings):
                self._raise_warnings(warnings)
                return PackResult(inputs=reply.inputs, outputs=reply.outputs, opts=reply.opts)
            case ErrorReply(warnings=warnings):
                self._raise_warnings(warnings)
                raise self._remote_failure(reply, Operation.PACK, str(model_dir))
            case _:
                raise self._unexpected(reply, "pack")

    def infer(self, tensors: Mapping[str, Tensor], *, timeout: float | None = None) -> dict[str, Tensor]:
        """Run one inference; thread-safe. Outputs are ordinary numpy arrays the caller owns. ``timeout`` is in
        seconds (``None``: no limit); a runner that does not answer within it is killed (`RunnerTimeout`)."""
        return self.infer_with_layouts(tensors, timeout=timeout)[0]

    def infer_with_layouts(
        self,
        tensors: Mapping[str, Tensor],
        *,
        timeout: float | None = None,
        layout_key: Hashable | None = None,
        lent: list[Callable[[], None]] | None = None,
    ) -> tuple[dict[str, Tensor], Hashable | None]:
        """`infer` for a caller that keys its own checks by layout (`Model`). `layout_key`, when given, stands for
        `tensors`' layout (plain numpy arrays; the same key always comes with the same names, dtypes and shapes),
        so the request's header template is found by it. Returns the outputs and an object standing for their
        layout in the same way, when the reply was read by a learnt plan (else None). With `lent`, outputs in the
        runner's shared memory are lent, not copied (`Connection.outputs`)."""
        connection = self._enter("infer")
        try:
            request_id = connection.next_id()
            outgoing = connection.codec.encode_inline(request_id, tensors, layout_key)
            if outgoing is None:
                outgoing = self._encode(connection, request_id, tensors)
            try:
                reply = connection.infer(outgoing.parts, outgoing.id, timeout, outgoing.copied)
            finally:
                if outgoing.segment is not None:
                    outgoing.done()
            if type(reply) is tuple:
                return reply
            return self._outputs(connection, reply, lent)  # type: ignore[arg-type]  # a Received
        except _FOREIGN as exc:
            raise self._failure(exc, Operation.INFER, timeout, "infer timeout") from _cause(exc)
        finally:
            self._leave()

    @staticmethod
    def _encode(connection: Connection, request_id: int, tensors: Mapping[str, Tensor]) -> Outgoing:
        """The request carrying `tensors` when `encode_inline` could not make it; what the wire cannot carry is the
        caller's `InvalidInput`."""
        try:
            return connection.codec.encode_full(request_id, tensors)
        except ProtocolError as exc:
            raise InvalidInput(str(exc)) from exc

    def _outputs(
        self, connection: Connection, received: Received, lent: list[Callable[[], None]] | None = None
    ) -> tuple[dict[str, Tensor], Hashable | None]:
        reply = received.message
        match reply:
            case InferReply():
                try:
                    return connection.outputs(received, lent), received.plan
                except ProtocolError as exc:
                    raise RunnerProtocolError(f"runner {self.spec.entry} sent malformed infer outputs: {exc}") from exc
            case ErrorReply():
                connection.release(received)
                raise self._remote_failure(reply, Operation.INFER)
            case _:
                connection.release(received)
                raise self._unexpected(reply, "infer")

    async def infer_async(self, tensors: Mapping[str, Tensor], *, timeout: float | None = None) -> dict[str, Tensor]:
        """`infer` without blocking the event loop; any number of calls may be in flight.

        The call runs on the loop itself: the request goes out on the loop's own socket to the runner, and the
        reply (or the runner's death, through its pidfd, or the timeout) wakes the awaiting task. A cancelled call's
        late reply is discarded. Requests of at least `_ASYNC_COPY_BYTES` (whose copies into and out of shared
        memory would stall the loop) and hosts without pidfd run `infer` on this runner's thread pool instead.
        """
        return (await self.infer_async_with_layouts(tensors, timeout=timeout))[0]

    async def infer_async_with_layouts(
        self,
        tensors: Mapping[str, Tensor],
        *,
        timeout: float | None = None,
        layout_key: Hashable | None = None,
        unsent: bool = False,
        lent: list[Callable[[], None]] | None = None,
    ) -> tuple[dict[str, Tensor], Hashable | None]:
        """`infer_async` with layouts, as `infer_with_layouts`. With `unsent`, a runner found exited (or this process
        closed) before the request left raises `NotSent` instead of failing: nothing reached the runner, and the
        caller may send the request to another one (`Model` restarts it). Once the request is sent, the runner's exit
        is `RunnerCrashed` whatever `unsent` says."""
        started = self.start_infer_async(tensors, timeout, layout_key, unsent)
        if started is None:
            return await self._infer_in_pool(tensors, timeout, layout_key, unsent, lent)
        try:
            answer = await started[2]
        except BaseException as exc:
            await self.fail_infer_async(started, exc, timeout)
            raise  # (`fail_infer_async` always raises)
        return self.finish_infer_async(started, answer, lent, timeout)

    def start_infer_async(
        self, tensors: Mapping[str, Tensor], timeout: float | None, layout_key: Hashable | None, unsent: bool
    ) -> Started | None:
        """The first half of `infer_async_with_layouts` (its arguments, positional), on the calling loop's channel:
        the request encoded and sent, or None when it goes to the thread pool instead (`infer_async_with_layouts`
        then). The caller awaits the future (``[2]``), then passes the answer to `finish_infer_async`, or what that
        await raised to `fail_infer_async`: the call in three steps, without a coroutine of this class between the
        caller's and the future (`Model` calls it so)."""
        # Not counted in flight: the loop's channel owns its socket, which `close` does not tear down under it.
        connection = self._resources.connection
        if connection is None or self._closed:
            if unsent:
                raise NotSent
            raise ModelClosed(f"runner {self.spec.entry} is closed; cannot infer")
        # This loop's channel: the last one used, else `_new_async_channel`'s (None: run on the thread pool).
        loop = asyncio.get_running_loop()
        last = self._last_channel
        channel = last[1] if last is not None and last[0]() is loop and not last[1].closed else None
        if channel is None:
            channel = self._new_async_channel(loop)
            if channel is None:
                return None
        # A small request in a layout sent before copies nothing: no need to count what it would copy.
        request_id = connection.next_id()
        outgoing = connection.codec.encode_inline(request_id, tensors, layout_key)
        if outgoing is None:
            if connection.codec.copied_bytes(tensors) >= _ASYNC_COPY_BYTES:
                return None
            outgoing = self._encode(connection, request_id, tensors)
        try:
            # `send` reads the runner's pidfd just before sending: `NotSent` if it had exited.
            future, timer = channel.send(outgoing.parts, request_id, timeout, outgoing.copied)
        except BaseException as exc:
            outgoing.done()
            if isinstance(exc, _FOREIGN) and not (unsent and type(exc) is NotSent):
                raise self._failure(exc, Operation.INFER, timeout, "infer timeout") from _cause(exc)
            raise
        return channel, outgoing, future, timer

    def finish_infer_async(
        self, started: Started, answer: Answer, lent: list[Callable[[], None]] | None, timeout: float | None
    ) -> tuple[dict[str, Tensor], Hashable | None]:
        """The outputs of a call `start_infer_async` started, from what its future gave."""
        outgoing = started[1]
        timer = started[3]
        if timer is not None:
            timer.cancel()
        if outgoing.segment is not None:
            outgoing.done()
        try:
            if type(answer) is tuple:
                plan = answer[0]
                return plan.decode(answer[1]), plan
            return self._outputs(started[0].connection, answer, lent)  # type: ignore[arg-type]  # a Received
        except _FOREIGN as exc:
            raise self._failure(exc, Operation.INFER, timeout, "infer timeout") from _cause(exc)

    async def fail_infer_async(self, started: Started, exc: BaseException, timeout: float | None) -> NoReturn:
        """Raise what a call `start_infer_async` started fails with, given what awaiting its future raised."""
        channel, outgoing, _, timer = started
        channel.forget(outgoing.id, timer)
        if isinstance(exc, asyncio.CancelledError):
            # The runner may still be reading the input: what it lies in is freed only once its reply is in (at
            # once if it already is: read for the call just before the cancel came).
            future = started[2]
            if future.done() and not future.cancelled():
                outgoing.done()
            else:
                channel.orphan(outgoing.id, outgoing.done)
            raise exc
        outgoing.done()
        if isinstance(exc, CallTimeout):
            # Killing the runner's tree waits for it to go: not on the loop.
            failure = await asyncio.to_thread(self._failure, exc, Operation.INFER, timeout, "infer timeout")
            raise failure from None
        if isinstance(exc, _FOREIGN):
            raise self._failure(exc, Operation.INFER, timeout, "infer timeout") from _cause(exc)
        raise exc

    async def _infer_in_pool(
        self,
        tensors: Mapping[str, Tensor],
        timeout: float | None,
        layout_key: Hashable | None,
        unsent: bool,
        lent: list[Callable[[], None]] | None,
    ) -> tuple[dict[str, Tensor], Hashable | None]:
        """`infer_with_layouts` on this runner's thread pool: large requests, and hosts without a channel."""
        if unsent and not self.alive:  # the thread pool's call sends at once: the liveness check comes first
            raise NotSent
        call = functools.partial(self.infer_with_layouts, tensors, timeout=timeout, layout_key=layout_key, lent=lent)
        loop = asyncio.get_running_loop()
        if lent is None:
            return await loop.run_in_executor(self._async_pool(), call)
        work = self._async_pool().submit(call)
        try:
            return await asyncio.wrap_future(work, loop=loop)
        except asyncio.CancelledError:
            # The call goes on without its caller: what it lends is given back once it is done.
            work.add_done_callback(lambda _: release_lent(lent))
            raise

    def _new_async_channel(self, loop: asyncio.AbstractEventLoop) -> AsyncChannel | None:
        connection = self._resources.connection
        if connection is None or self._closed:
            raise ModelClosed(f"runner {self.spec.entry} is closed; cannot infer")
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
        return not self._closed and self._resources.process is not None and self._resources.running()

    @property
    def returncode(self) -> int | None:
        return self._resources.poll()

    def close(self, timeout: float = 5.0) -> None:
        """Ask the runner to close its model and exit; kill its whole tree if it has not within `timeout`."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        resources = self._resources
        connection = resources.connection
        if resources.process is not None and resources.poll() is None and connection is not None:
            give_up = time.monotonic() + timeout
            with contextlib.suppress(*_FOREIGN):
                connection.call(Close(id=0), timeout=timeout)
            # After its reply the runner still kills its descendants and tears down its sockets.
            resources.wait(max(0.2, give_up - time.monotonic()))
        resources.kill()
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
    def _raise_warnings(self, messages: tuple[str, ...]) -> None:
        for message in messages:
            warn_user(f"runner {self.spec.runner_name}: {message}", RunnerWarning)
