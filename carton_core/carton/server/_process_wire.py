"""The local channel between the server processes of one ``carton serve --processes N``: typed messages over a Unix
socket pair, and the counters each process reports so that ``/metrics`` and the statistics extension add up.

Each message is a msgspec value of the `Message` union, sent as a 4-byte little-endian length and its MessagePack
bytes (no pickle). Either end may `Channel.call` the other: a `Call` carries a `Request` and an id, the `Reply` with
that id carries a `Result` (a refusal is a `Refused` naming the `carton.server.errors` class, rebuilt on the
caller's side). The same request means what the answering process knows: a child answers for itself, the
coordinator for the whole server (a child's ``Load`` is applied on every process, its ``Counters`` are the sum).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import socket
import struct
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any, Protocol

import msgspec
from prometheus_client import generate_latest

from .._runtime import RunnerLimits
from ._http import RepositoryControl
from ._repository import ModelRepository
from ._stats import ServerMetrics
from .errors import STATUS, ServerError

__all__ = [
    "Answering",
    "Call",
    "Channel",
    "ChannelClosed",
    "ChildOptions",
    "Counters",
    "CountersSnapshot",
    "Done",
    "Entries",
    "Handler",
    "Histogram",
    "Index",
    "Load",
    "LocalProcess",
    "Message",
    "Readiness",
    "Ready",
    "Refused",
    "Reply",
    "Request",
    "Result",
    "Retract",
    "SeriesCounters",
    "Setup",
    "Started",
    "StartupLoad",
    "Statistics",
    "StatisticsEntries",
    "Unload",
    "add_counters",
    "answer",
    "counters_of",
    "local_statistics",
    "merge_statistics",
    "metrics_text",
]

_log = logging.getLogger("carton.server")


# ---- requests ------------------------------------------------------------------------------------------------------
class Load(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """Load or reload a model (``config`` and ``file:`` payloads as the load request gave them)."""

    name: str
    config: str | None = None
    files: dict[str, bytes] = {}


class Unload(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """Unload a model."""

    name: str
    unload_dependents: bool = False


class StartupLoad(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """Load a model from the repository as the server starts (whatever the model control mode)."""

    name: str


class Retract(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """Unload a model on the server's own decision (whatever the model control mode): a load that succeeded on some
    processes only is undone."""

    name: str


class Index(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """The repository index."""

    ready_only: bool = False


class Readiness(msgspec.Struct, tag=True, frozen=True):
    """Whether the server (or the child process asked) is ready."""


class Counters(msgspec.Struct, tag=True, frozen=True):
    """The Prometheus counters."""


class Statistics(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """The statistics extension's ``model_stats`` of one model (``name``; ``version`` empty: all its versions), or of
    every model (``name`` empty)."""

    name: str = ""
    version: str = ""


Request = Load | Unload | Index | Readiness | Counters | Statistics | StartupLoad | Retract


# ---- results -------------------------------------------------------------------------------------------------------
class Done(msgspec.Struct, tag=True, frozen=True):
    """A load or unload succeeded."""


class Refused(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """The request failed with the `carton.server.errors` class named `error` and its message."""

    error: str
    message: str


class Entries(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """Repository index entries."""

    entries: list[dict[str, str]]


class Ready(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    ready: bool


class Histogram(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    buckets: list[int]
    sum_ns: int


class SeriesCounters(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    """One (model, version)'s Prometheus series (`carton.server._stats._Series`)."""

    model: str
    version: str
    success: int
    failure: int
    executions: int
    in_flight: int
    duration: Histogram
    queue: Histogram
    compute: Histogram


class CountersSnapshot(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """Every series of a process (or the sum of every process), and its rejected requests by HTTP status."""

    series: list[SeriesCounters]
    rejected: dict[str, int]


class StatisticsEntries(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """``model_stats`` entries, as `VersionStats.to_json` lays them out."""

    model_stats: list[dict[str, Any]]


Result = Done | Refused | Entries | Ready | CountersSnapshot | StatisticsEntries


# ---- envelope ------------------------------------------------------------------------------------------------------
class ChildOptions(msgspec.Struct, frozen=True, kw_only=True):
    """`ServerOptions` as a child process gets them: the ports the coordinator bound, and the runner limits of its
    loader (the loader itself is a function: the child rebuilds it as `load_carton` with these limits)."""

    repository: str
    host: str
    http_port: int
    grpc_port: int | None
    model_control_mode: str
    load_models: list[str]
    max_body_size: int
    allow_upload: bool
    workers: int
    sandbox: str | None
    upload_sandbox: str | None
    load_timeout: float
    unload_timeout: float
    strict_readiness: bool
    limits: RunnerLimits | None


class Setup(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """The coordinator's first message to a child: which process it is and how to serve."""

    index: int
    processes: int
    options: ChildOptions


class Started(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """A child's notice that it listens and has loaded its start-up models (or why it could not start)."""

    error: str | None = None


class Call(msgspec.Struct, tag=True, frozen=True):
    id: int
    request: Request


class Reply(msgspec.Struct, tag=True, frozen=True):
    id: int
    result: Result


Message = Call | Reply | Setup | Started

_LENGTH = struct.Struct("<I")
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)
_ERRORS: dict[str, type[ServerError]] = {cls.__name__: cls for cls in STATUS}

#: Answers a request that arrived on a channel.
Handler = Callable[[Request], Awaitable[Result]]


class ChannelClosed(ServerError):
    """The process at the other end of a channel stopped."""


class Channel:
    """One end of a coordinator <-> child channel over a connected Unix stream socket."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        *,
        handler: Handler,
        on_notice: Callable[[Setup | Started], None],
        on_closed: Callable[[], None],
        peer: str,
    ) -> None:
        self._reader = reader
        self._writer = writer
        self._handler = handler
        self._on_notice = on_notice
        self._on_closed = on_closed
        self._peer = peer
        self._next_id = 0
        self._pending: dict[int, asyncio.Future[Result]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self.closed = False
        self._reading = asyncio.get_running_loop().create_task(self._read())

    @classmethod
    async def open(
        cls,
        sock: socket.socket,
        *,
        handler: Handler,
        on_notice: Callable[[Setup | Started], None],
        on_closed: Callable[[], None],
        peer: str,
    ) -> Channel:
        """A channel over `sock` (one end of a `socket.socketpair`), reading in the background from now on."""
        reader, writer = await asyncio.open_unix_connection(sock=sock, limit=1 << 20)
        return cls(reader, writer, handler=handler, on_notice=on_notice, on_closed=on_closed, peer=peer)

    def notify(self, message: Setup | Started) -> None:
        """Send a one-way message."""
        self._write(message)

    async def call(self, request: Request) -> Result:
        """Ask the other end; its `Refused` is raised here as the `ServerError` it names."""
        if self.closed:
            raise ChannelClosed(f"{self._peer} has stopped")
        self._next_id += 1
        call_id = self._next_id
        future: asyncio.Future[Result] = asyncio.get_running_loop().create_future()
        self._pending[call_id] = future
        try:
            self._write(Call(call_id, request))
            await self._writer.drain()
            result = await future
        finally:
            self._pending.pop(call_id, None)  # a cancelled call leaves nothing behind
        if isinstance(result, Refused):
            raise _ERRORS.get(result.error, ServerError)(result.message)
        return result

    def _write(self, message: Message) -> None:
        body = _encoder.encode(message)
        self._writer.write(_LENGTH.pack(len(body)) + body)

    async def _read(self) -> None:
        try:
            while True:
                (length,) = _LENGTH.unpack(await self._reader.readexactly(_LENGTH.size))
                message = _decoder.decode(await self._reader.readexactly(length))
                match message:
                    case Call(id=call_id, request=request):
                        task = asyncio.get_running_loop().create_task(self._answer(call_id, request))
                        self._tasks.add(task)
                        task.add_done_callback(self._tasks.discard)
                    case Reply(id=call_id, result=result):
                        future = self._pending.pop(call_id, None)
                        if future is not None and not future.done():
                            future.set_result(result)
                    case Setup() | Started():
                        self._on_notice(message)
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            pass  # the other end closed or died
        except msgspec.DecodeError:  # not MessagePack, or not a `Message`: the other end is not carton's
            _log.exception("a malformed message from %s; closing the channel", self._peer)
        finally:
            self._close()

    async def _answer(self, call_id: int, request: Request) -> None:
        try:
            result = await self._handler(request)
        except ServerError as exc:
            result = Refused(error=type(exc).__name__ if type(exc) in STATUS else "ServerError", message=str(exc))
        except Exception:
            _log.exception("answering %s from %s failed", type(request).__name__, self._peer)
            result = Refused(error="ServerError", message="internal error in a server process")
        if not self.closed:
            self._write(Reply(call_id, result))

    def _close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for future in self._pending.values():
            if not future.done():
                future.set_exception(ChannelClosed(f"{self._peer} has stopped"))
        self._pending.clear()
        self._writer.close()
        self._on_closed()

    async def aclose(self) -> None:
        """Close this end (the other end's reads end) and stop reading."""
        self._reading.cancel()
        self._close()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._reading


# ---- answering a request ------------------------------------------------------------------------------------------
class Answering(Protocol):
    """What a process answers requests from: its own repository (`LocalProcess`) or, on the coordinator, the whole
    server (`carton.server._processes.ProcessGroup`)."""

    async def is_ready(self) -> bool: ...

    async def index(self, *, ready_only: bool) -> list[dict[str, str]]: ...

    async def load(self, name: str, *, config: str | None, files: Mapping[str, bytes]) -> None: ...

    async def unload(self, name: str, *, unload_dependents: bool) -> None: ...

    async def load_at_startup(self, name: str) -> None: ...

    async def retract(self, name: str) -> None: ...

    async def counters(self) -> CountersSnapshot: ...

    async def model_stats(self, name: str, version: str) -> list[dict[str, Any]]: ...


async def answer(target: Answering, request: Request) -> Result:
    """Answer `request` from `target`."""
    match request:
        case Load(name=name, config=config, files=files):
            await target.load(name, config=config, files=files)
            return Done()
        case Unload(name=name, unload_dependents=dependents):
            await target.unload(name, unload_dependents=dependents)
            return Done()
        case StartupLoad(name=name):
            await target.load_at_startup(name)
            return Done()
        case Retract(name=name):
            await target.retract(name)
            return Done()
        case Index(ready_only=ready_only):
            return Entries(entries=await target.index(ready_only=ready_only))
        case Readiness():
            return Ready(ready=await target.is_ready())
        case Counters():
            return await target.counters()
        case Statistics(name=name, version=version):
            return StatisticsEntries(model_stats=await target.model_stats(name, version))


class LocalProcess(RepositoryControl):
    """This process's own repository and counters, as `Answering`."""

    __slots__ = ("metrics",)

    def __init__(self, repository: ModelRepository, metrics: ServerMetrics) -> None:
        super().__init__(repository)
        self.metrics = metrics

    async def load_at_startup(self, name: str) -> None:
        await self.repository.load_at_startup(name)

    async def retract(self, name: str) -> None:
        await self.repository.retract(name)

    async def counters(self) -> CountersSnapshot:
        return counters_of(self.metrics)

    async def model_stats(self, name: str, version: str) -> list[dict[str, Any]]:
        return local_statistics(self.repository, name, version)


def local_statistics(repository: ModelRepository, name: str, version: str) -> list[dict[str, Any]]:
    """This process's ``model_stats`` for `name` (empty: every model) at `version` (empty: every version); none for
    a model it does not serve."""
    if not name:
        return [served.stats.to_json() for served in repository.all_served()]
    if version:
        try:
            return [repository.get(name, version).stats.to_json()]
        except ServerError:
            return []
    return [served.stats.to_json() for served in repository.versions(name)]


def _histogram(source: Any) -> Histogram:
    return Histogram(buckets=list(source.buckets), sum_ns=source.sum_ns)


def counters_of(metrics: ServerMetrics) -> CountersSnapshot:
    """A snapshot of `metrics`: every series' counters and the rejected requests by status."""
    series = [
        SeriesCounters(
            model=model,
            version=version,
            success=s.success,
            failure=s.failure,
            executions=s.executions,
            in_flight=s.in_flight,
            duration=_histogram(s.duration),
            queue=_histogram(s.queue),
            compute=_histogram(s.compute),
        )
        for (model, version), s in metrics.series_items()
    ]
    rejected: dict[str, int] = {}
    for family in metrics.rejected.collect():
        for sample in family.samples:
            if sample.name.endswith("_total"):
                rejected[sample.labels["status"]] = int(sample.value)
    return CountersSnapshot(series=series, rejected=rejected)


def add_counters(snapshots: Iterable[CountersSnapshot]) -> ServerMetrics:
    """A `ServerMetrics` holding the sum of `snapshots` (for ``/metrics``, or to be snapshotted again)."""
    total = ServerMetrics()
    for snapshot in snapshots:
        for counters in snapshot.series:
            series = total.series(counters.model, counters.version)
            series.success += counters.success
            series.failure += counters.failure
            series.executions += counters.executions
            series.in_flight += counters.in_flight
            for mine, theirs in (
                (series.duration, counters.duration), (series.queue, counters.queue),
                (series.compute, counters.compute),
            ):  # fmt: skip
                mine.buckets = [a + b for a, b in zip(mine.buckets, theirs.buckets, strict=True)]
                mine.sum_ns += theirs.sum_ns
        for status, count in snapshot.rejected.items():
            total.rejected.labels(status).inc(count)
    return total


def metrics_text(snapshots: Iterable[CountersSnapshot]) -> bytes:
    """The Prometheus text of the sum of `snapshots`."""
    return generate_latest(add_counters(snapshots).registry)


def _add_json(mine: dict[str, Any], theirs: dict[str, Any]) -> None:
    for key, value in theirs.items():
        if key == "last_inference":
            mine[key] = max(mine.get(key, 0), value)
        elif isinstance(value, dict):
            _add_json(mine.setdefault(key, {}), value)
        elif isinstance(value, int) and not isinstance(value, bool) and key not in ("batch_size",):
            mine[key] = mine.get(key, 0) + value
        elif key == "batch_stats":
            by_size = {entry["batch_size"]: entry for entry in mine.get(key, [])}
            for entry in value:
                found = by_size.get(entry["batch_size"])
                if found is None:
                    by_size[entry["batch_size"]] = copy.deepcopy(entry)
                else:
                    _add_json(found, entry)
            mine[key] = [by_size[size] for size in sorted(by_size)]
        else:
            mine.setdefault(key, value)


def merge_statistics(parts: Iterable[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Several processes' ``model_stats`` summed per (model, version): counts and durations added, the last
    inference the latest; ordered by model name, then version."""
    merged: dict[tuple[str, int], dict[str, Any]] = {}
    for entries in parts:
        for entry in entries:
            key = (entry["name"], int(entry["version"]))
            found = merged.get(key)
            if found is None:
                merged[key] = found = {"name": entry["name"], "version": entry["version"]}
            _add_json(found, entry)
    return [merged[key] for key in sorted(merged)]
