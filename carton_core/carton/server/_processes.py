"""Several server processes on one port (``carton serve --processes N``): the coordinator and its children.

Every process listens on the same HTTP and gRPC ports (``SO_REUSEPORT``: the kernel spreads connections across
them) and runs the same `HttpApp` and `GrpcService` over its own `ModelRepository`, with its own runner processes.
The first process is the coordinator (`ProcessGroup`); it starts the others as ``python -m carton.server._child``
with one end of a Unix socket pair (`carton.server._process_wire`), and each child's `CoordinatorLink` is its
`ServerControl`: what the repository extension says is decided by the coordinator, so it is the same whichever
process a client reaches.

- A load or unload, asked of any process, goes to the coordinator, which applies it to every process at once and
  answers when all have; the start-up models are loaded the same way once every process listens. A load that fails
  on some processes and not on others is unloaded from all of them, so no process serves what another does not (the
  answer names the failure).
- The repository index is the coordinator's; server readiness is false while a load or unload runs anywhere, while
  any process is not ready by its own rules, and once a child has died.
- ``/metrics`` and the statistics extension are the sum of every process's counters, whichever process answers.
- A child that dies stops the server: the coordinator logs which process and how it ended, stops the others and
  `run_server` raises `ServerError` (``carton serve`` exits with status 1), so that the service manager restarts
  the whole server. Children die with the coordinator: they get a parent-death signal (SIGTERM: they unload and
  close their runners), and stop when the channel closes.

Children are started as a fresh interpreter running a module, not with `multiprocessing`: their options travel as a
typed message instead of a pickle, they inherit exactly one descriptor (their end of the socket pair), and nothing of
the parent's ``__main__`` is imported again.
"""

from __future__ import annotations

import abc
import asyncio
import ctypes
import dataclasses
import functools
import logging
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ._handle import ModelLoader, load_carton
from ._process_wire import (
    Channel,
    ChannelClosed,
    ChildOptions,
    Counters,
    CountersSnapshot,
    Entries,
    Index,
    Load,
    LocalProcess,
    Readiness,
    Ready,
    Request,
    Result,
    Retract,
    Setup,
    Started,
    StartupLoad,
    Statistics,
    StatisticsEntries,
    Unload,
    add_counters,
    answer,
    counters_of,
    merge_statistics,
    metrics_text,
)
from ._repository import ModelRepository
from ._stats import ServerMetrics
from .errors import RepositoryError, ServerError

if TYPE_CHECKING:
    from .._runtime import RunnerLimits
    from ._server import Server, ServerOptions

__all__ = ["CoordinatorLink", "ProcessGroup", "check_processes", "child_main"]

_log = logging.getLogger("carton.server")

_PR_SET_PDEATHSIG = 1
#: How long a child may take to stop (unload, close its runners) after SIGTERM before it is killed.
_STOP_SECONDS = 60.0


def check_processes(options: ServerOptions) -> RunnerLimits | None:
    """Refuse options that several processes cannot run; the runner limits of the loader otherwise."""
    if options.processes < 1:
        raise ServerError(f"processes must be at least 1, got {options.processes}")
    if options.processes > 1 and not sys.platform.startswith("linux"):
        raise ServerError("several server processes need Linux (SO_REUSEPORT and a parent-death signal)")
    return _loader_limits(options.loader)


def _loader_limits(loader: ModelLoader) -> RunnerLimits | None:
    if loader is load_carton:
        return None
    if (
        isinstance(loader, functools.partial)
        and loader.func is load_carton
        and not loader.args
        and set(loader.keywords) == {"limits"}
    ):
        limits: RunnerLimits | None = loader.keywords["limits"]
        return limits
    raise ServerError(
        "several server processes need carton's own loader (load_carton, or functools.partial(load_carton, "
        "limits=...)): another process cannot rebuild a custom one"
    )


class _Totals(abc.ABC):
    """`ServerTotals` from the counters and statistics of every process, summed: the coordinator (`ProcessGroup`)
    gathers them itself, a child (`CoordinatorLink`) asks the coordinator."""

    repository: ModelRepository

    @abc.abstractmethod
    async def counters(self) -> CountersSnapshot:
        """Every process's counters, summed."""

    @abc.abstractmethod
    async def model_stats(self, name: str, version: str) -> list[dict[str, Any]]:
        """Every process's ``model_stats``, summed."""

    async def metrics(self) -> bytes:
        return metrics_text([await self.counters()])

    async def statistics(self, name: str, version: str) -> list[dict[str, Any]]:
        if name:
            self.repository.get(name, version)  # an unknown model is 404 here, as with one process
        return await self.model_stats(name, version)


@dataclasses.dataclass(slots=True, eq=False)
class _Child:
    index: int
    process: subprocess.Popen[bytes]
    channel: Channel
    started: asyncio.Future[None]

    def describe(self) -> str:
        return f"server process {self.index} (pid {self.process.pid})"


class ProcessGroup(_Totals):
    """The coordinator: starts and stops the children; its `ServerControl` decides for the whole server."""

    def __init__(self, options: ServerOptions) -> None:
        self._limits = check_processes(options)
        self.options = options
        self._children: list[_Child] = []
        self._transitions = 0
        self._locks: dict[str, tuple[asyncio.Lock, list[int]]] = {}
        self._stopping = False
        self._started = False
        self._broken: asyncio.Future[ServerError] | None = None

    def attach(self, repository: ModelRepository, metrics: ServerMetrics) -> None:
        """The coordinator's own repository and metrics (called by `Server`)."""
        self.repository = repository
        self._local = LocalProcess(repository, metrics)

    # ---- lifecycle -----------------------------------------------------------------------------------------------
    def check_ports(self) -> None:
        """Refuse ports another server already listens on: with ``SO_REUSEPORT`` the coordinator's bind would
        succeed and share the port with it. A socket bound without the option fails where any other listens."""
        ports = [self.options.http_port, self.options.grpc_port]
        for port in (port for port in ports if port):
            family = socket.AF_INET6 if ":" in self.options.host else socket.AF_INET
            with socket.socket(family, socket.SOCK_STREAM) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    probe.bind((self.options.host, port))
                except OSError as exc:
                    raise ServerError(f"cannot listen on {self.options.host}:{port}: {exc.strerror}") from exc

    async def start(self, server: Server, models: list[str]) -> None:
        """Start the children on `server`'s bound ports, then load the start-up `models` on every process; return
        once all have (the server is not ready before)."""
        self._broken = asyncio.get_running_loop().create_future()
        setup = ChildOptions(
            repository=str(self.options.repository.absolute()),
            host=self.options.host,
            http_port=server.http_port,
            grpc_port=server.grpc_port,
            model_control_mode=self.options.model_control_mode.value,
            load_models=list(self.options.load_models),
            max_body_size=self.options.max_body_size,
            allow_upload=self.options.allow_upload,
            workers=self.options.workers,
            sandbox=self.options.sandbox,
            upload_sandbox=self.options.upload_sandbox,
            load_timeout=self.options.load_timeout,
            unload_timeout=self.options.unload_timeout,
            strict_readiness=self.options.strict_readiness,
            limits=self._limits,
        )
        try:
            for index in range(2, self.options.processes + 1):
                child = await self._spawn(index)
                self._children.append(child)
                child.channel.notify(Setup(index=index, processes=self.options.processes, options=setup))
            await asyncio.gather(*(child.started for child in self._children))
        except BaseException:
            await self.stop()
            raise
        failures = await asyncio.gather(*(self.load_at_startup(name) for name in models), return_exceptions=True)
        for name, failure in zip(models, failures, strict=True):
            if isinstance(failure, BaseException):
                _log.error("model %r failed to load: %s", name, failure)
        self._started = True

    async def _spawn(self, index: int) -> _Child:
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        with theirs:
            # Forked from the event loop's thread, which lives as long as the server: the parent-death signal fires
            # when the forking thread ends.
            process = subprocess.Popen(
                [sys.executable, "-m", "carton.server._child", str(theirs.fileno()), str(os.getpid())],
                stdin=subprocess.DEVNULL,
                pass_fds=(theirs.fileno(),),
                close_fds=True,
            )
        started: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        holder: list[_Child] = []
        channel = await Channel.open(
            mine,
            handler=self._answer_child,
            on_notice=lambda message: self._on_notice(holder[0], message),
            on_closed=lambda: self._on_closed(holder[0]),
            peer=f"server process {index}",
        )
        child = _Child(index=index, process=process, channel=channel, started=started)
        holder.append(child)
        if channel.closed:  # it died before the holder was filled
            self._on_closed(child)
        return child

    def _on_notice(self, child: _Child, message: Setup | Started) -> None:
        if isinstance(message, Started) and not child.started.done():
            if message.error is None:
                child.started.set_result(None)
            else:
                child.started.set_exception(ServerError(f"{child.describe()} could not start: {message.error}"))

    def _on_closed(self, child: _Child) -> None:
        if self._stopping:
            return
        asyncio.get_running_loop().create_task(self._lost(child))

    async def _lost(self, child: _Child) -> None:
        try:
            status = await asyncio.to_thread(child.process.wait, 10.0)
            how = f"was killed by {signal.Signals(-status).name}" if status < 0 else f"exited with status {status}"
        except (subprocess.TimeoutExpired, ValueError):
            how = "closed its channel"
        error = ServerError(f"{child.describe()} {how}; the server stops")
        if not child.started.done():
            child.started.set_exception(ServerError(f"{child.describe()} {how} while starting"))
            return
        _log.error("%s", error)
        if self._broken is not None and not self._broken.done():
            self._broken.set_result(error)

    async def broken(self) -> ServerError:
        """Wait until a child has died; the error says which and how."""
        assert self._broken is not None, "start() first"
        return await asyncio.shield(self._broken)

    async def stop(self) -> None:
        """Stop every child (SIGTERM: each unloads its models and closes its runners; SIGKILL after a while)."""
        self._stopping = True
        children, self._children = self._children, []
        for child in children:
            if child.process.poll() is None:
                child.process.terminate()
        await asyncio.gather(*(self._reap(child) for child in children))

    async def _reap(self, child: _Child) -> None:
        try:
            await asyncio.to_thread(child.process.wait, _STOP_SECONDS)
        except subprocess.TimeoutExpired:
            _log.error("%s did not stop within %.0fs; killing it", child.describe(), _STOP_SECONDS)
            child.process.kill()
            await asyncio.to_thread(child.process.wait)
        await child.channel.aclose()

    # ---- what a child asks ---------------------------------------------------------------------------------------
    async def _answer_child(self, request: Request) -> Result:
        return await answer(self, request)

    # ---- ServerControl -------------------------------------------------------------------------------------------
    async def is_ready(self) -> bool:
        if self._transitions or not self.repository.is_ready():
            return False
        if self._broken is None or self._broken.done():
            return False
        if not self._started:
            return False  # a process is still loading its start-up models
        try:
            answers = await asyncio.gather(*(child.channel.call(Readiness()) for child in self._children))
        except ServerError:
            return False
        return all(isinstance(found, Ready) and found.ready for found in answers)

    async def index(self, *, ready_only: bool) -> list[dict[str, str]]:
        return self.repository.index(ready_only=ready_only)

    async def load(self, name: str, *, config: str | None, files: Mapping[str, bytes]) -> None:
        await self._load_everywhere(name, Load(name=name, config=config, files=dict(files)))

    async def load_at_startup(self, name: str) -> None:
        await self._load_everywhere(name, StartupLoad(name=name))

    async def retract(self, name: str) -> None:
        async with self._changing(name):
            await self._everywhere(Retract(name=name))

    async def _load_everywhere(self, name: str, request: Load | StartupLoad) -> None:
        async with self._changing(name):
            outcomes = await self._everywhere(request)
            failures = [outcome for outcome in outcomes if isinstance(outcome, BaseException)]
            if not failures:
                return
            first = failures[0]
            if len(failures) == len(outcomes):
                raise first
            # Loaded on some processes only: unloaded from all, so that every process serves the same versions.
            await self._everywhere(Retract(name=name))
            raise RepositoryError(
                f"{first} (it loaded on {len(outcomes) - len(failures)} of {len(outcomes)} server processes, so it "
                "was unloaded from all of them)"
            ) from first

    async def unload(self, name: str, *, unload_dependents: bool) -> None:
        async with self._changing(name):
            for outcome in await self._everywhere(Unload(name=name, unload_dependents=unload_dependents)):
                if isinstance(outcome, BaseException):
                    raise outcome

    async def _everywhere(self, request: Request) -> list[BaseException | None]:
        """Apply `request` to the coordinator's repository and every child's at once; each one's exception or None
        (the coordinator's first)."""
        if self._broken is None or self._broken.done():
            raise ServerError("a server process has stopped; the server is stopping")
        calls = [answer(self._local, request)]
        calls += [child.channel.call(request) for child in self._children]
        outcomes = await asyncio.gather(*calls, return_exceptions=True)
        for outcome in outcomes:
            if isinstance(outcome, BaseException) and not isinstance(outcome, Exception):
                raise outcome  # cancelled: not a load's outcome
        return [outcome if isinstance(outcome, BaseException) else None for outcome in outcomes]

    def _changing(self, name: str) -> _Changing:
        """Serialize loads and unloads of `name` across processes; readiness is false meanwhile."""
        entry = self._locks.get(name)
        if entry is None:
            entry = self._locks[name] = (asyncio.Lock(), [0])
        return _Changing(self, name, entry)

    # ---- totals --------------------------------------------------------------------------------------------------
    async def counters(self) -> CountersSnapshot:
        snapshots = [await self._local.counters()]
        for found in await asyncio.gather(*(child.channel.call(Counters()) for child in self._children)):
            assert isinstance(found, CountersSnapshot)
            snapshots.append(found)
        return counters_of(add_counters(snapshots))

    async def model_stats(self, name: str, version: str) -> list[dict[str, Any]]:
        parts = [await self._local.model_stats(name, version)]
        request = Statistics(name=name, version=version)
        for found in await asyncio.gather(*(child.channel.call(request) for child in self._children)):
            assert isinstance(found, StatisticsEntries)
            parts.append(found.model_stats)
        return merge_statistics(parts)


class _Changing:
    """``async with``: hold `name`'s lock and count a transition (the lock entry goes when nobody holds or waits)."""

    __slots__ = ("_entry", "_group", "_name")

    def __init__(self, group: ProcessGroup, name: str, entry: tuple[asyncio.Lock, list[int]]) -> None:
        self._group, self._name, self._entry = group, name, entry

    async def __aenter__(self) -> None:
        lock, users = self._entry
        users[0] += 1
        try:
            await lock.acquire()
        except BaseException:
            self._leave()
            raise
        self._group._transitions += 1

    async def __aexit__(self, *exc: object) -> None:
        self._group._transitions -= 1
        self._entry[0].release()
        self._leave()

    def _leave(self) -> None:
        users = self._entry[1]
        users[0] -= 1
        if not users[0]:
            self._group._locks.pop(self._name, None)


class CoordinatorLink(_Totals):
    """A child's `ServerControl`: the server-wide questions go to the coordinator, which answers for every process;
    the coordinator's requests are applied to this process's repository."""

    def __init__(self, channel_socket: socket.socket) -> None:
        self._socket = channel_socket
        self._channel: Channel | None = None
        self.setup: asyncio.Future[Setup] | None = None
        self.closed = asyncio.Event()

    async def connect(self) -> Setup:
        """Open the channel and wait for the coordinator's `Setup`."""
        self.setup = asyncio.get_running_loop().create_future()
        self._channel = await Channel.open(
            self._socket,
            handler=self._answer,
            on_notice=self._on_notice,
            on_closed=self.closed.set,
            peer="the coordinating server process",
        )
        closed = asyncio.ensure_future(self.closed.wait())
        waits: list[asyncio.Future[Any]] = [self.setup, closed]
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        closed.cancel()
        if not self.setup.done():
            raise ChannelClosed("the coordinating server process stopped before sending the setup")
        return self.setup.result()

    def _on_notice(self, message: Setup | Started) -> None:
        if isinstance(message, Setup) and self.setup is not None and not self.setup.done():
            self.setup.set_result(message)

    def attach(self, repository: ModelRepository, metrics: ServerMetrics) -> None:
        self.repository = repository
        self._local = LocalProcess(repository, metrics)

    def check_ports(self) -> None:
        """Nothing to check: this process shares the ports the coordinator listens on."""

    async def start(self, server: Server, models: list[str]) -> None:
        """Nothing to do: the coordinator loads the start-up models on every process once all listen."""

    async def broken(self) -> ServerError:
        """Wait until the coordinator has gone."""
        await self.closed.wait()
        return ChannelClosed("the coordinating server process stopped")

    async def stop(self) -> None:
        """Nothing to stop: `_serve_child` closes the channel once the server has stopped."""

    def started(self, error: str | None = None) -> None:
        assert self._channel is not None
        self._channel.notify(Started(error=error))

    async def _answer(self, request: Request) -> Result:
        return await answer(self._local, request)

    async def _ask(self, request: Request) -> Result:
        assert self._channel is not None
        return await self._channel.call(request)

    async def aclose(self) -> None:
        if self._channel is not None:
            await self._channel.aclose()

    # ---- ServerControl -------------------------------------------------------------------------------------------
    async def is_ready(self) -> bool:
        try:
            found = await self._ask(Readiness())
        except ChannelClosed:
            return False
        return isinstance(found, Ready) and found.ready

    async def index(self, *, ready_only: bool) -> list[dict[str, str]]:
        found = await self._ask(Index(ready_only=ready_only))
        assert isinstance(found, Entries)
        return found.entries

    async def load(self, name: str, *, config: str | None, files: Mapping[str, bytes]) -> None:
        await self._ask(Load(name=name, config=config, files=dict(files)))

    async def unload(self, name: str, *, unload_dependents: bool) -> None:
        await self._ask(Unload(name=name, unload_dependents=unload_dependents))

    async def load_at_startup(self, name: str) -> None:
        await self._ask(StartupLoad(name=name))

    async def retract(self, name: str) -> None:
        await self._ask(Retract(name=name))

    # ---- totals --------------------------------------------------------------------------------------------------
    async def counters(self) -> CountersSnapshot:
        found = await self._ask(Counters())
        assert isinstance(found, CountersSnapshot)
        return found

    async def model_stats(self, name: str, version: str) -> list[dict[str, Any]]:
        found = await self._ask(Statistics(name=name, version=version))
        assert isinstance(found, StatisticsEntries)
        return found.model_stats


# ---- the child process ---------------------------------------------------------------------------------------------
def _arm_parent_death_signal(parent: int) -> None:
    """SIGTERM this process when the coordinator ends, however it ends; exit if it already has."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent:
        sys.exit(1)


def child_main(argv: list[str]) -> int:
    """``python -m carton.server._child FD PARENT_PID``: serve as one of the coordinator's children."""
    fd, parent = int(argv[0]), int(argv[1])
    _arm_parent_death_signal(parent)
    # Ctrl-C reaches the whole process group: the coordinator alone answers it, and stops its children with SIGTERM.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    import uvloop

    channel_socket = socket.socket(fileno=fd)
    channel_socket.set_inheritable(False)
    uvloop.run(_serve_child(channel_socket))
    return 0


async def _serve_child(channel_socket: socket.socket) -> None:
    from ._server import ModelControlMode, Server, ServerOptions

    link = CoordinatorLink(channel_socket)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    try:
        setup = await link.connect()
    except ChannelClosed:
        return
    given = setup.options
    options = ServerOptions(
        repository=Path(given.repository),
        host=given.host,
        http_port=given.http_port,
        grpc_port=given.grpc_port,
        model_control_mode=ModelControlMode(given.model_control_mode),
        load_models=tuple(given.load_models),
        max_body_size=given.max_body_size,
        allow_upload=given.allow_upload,
        workers=given.workers,
        sandbox=given.sandbox,
        upload_sandbox=given.upload_sandbox,
        load_timeout=given.load_timeout,
        unload_timeout=given.unload_timeout,
        strict_readiness=given.strict_readiness,
        loader=load_carton if given.limits is None else functools.partial(load_carton, limits=given.limits),
        processes=setup.processes,
    )
    server = Server(options, peers=link)
    try:
        await server.start()
    except ServerError as exc:
        link.started(str(exc))
        await server.stop()
        await link.aclose()
        return
    link.started()
    closed = asyncio.ensure_future(link.closed.wait())
    stopped = asyncio.ensure_future(stop.wait())
    await asyncio.wait([closed, stopped], return_when=asyncio.FIRST_COMPLETED)
    closed.cancel()
    stopped.cancel()
    try:
        await server.stop()
    finally:
        await link.aclose()
