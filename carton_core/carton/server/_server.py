"""Running the server: HTTP (carton's protocol on httptools + uvloop, ``_http_server.py``) and gRPC (on carton's
own HTTP/2 frames, ``_grpc_transport.py``) on one event loop, one repository.

The listening sockets are created here with ``TCP_NODELAY`` set (accepted connections inherit it on Linux), so
small responses are not held back by Nagle's algorithm, and so that port 0 picks a free port the caller can read.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import shutil
import socket
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ._handle import ModelLoader, load_carton
from ._http import HttpApp
from ._http_server import HttpServer, serve_http
from ._layout import list_models, make_upload_root, sweep_stale_upload_roots
from ._repository import ModelRepository, RepositoryOptions
from ._stats import ServerMetrics
from .errors import ServerError

if TYPE_CHECKING:
    from ._grpc_transport import GrpcServer
    from ._processes import CoordinatorLink, ProcessGroup

__all__ = ["ModelControlMode", "Server", "ServerOptions", "listening_text", "run_server", "serve_in_thread"]

_log = logging.getLogger("carton.server")


def _listen(host: str, port: int, *, shared: bool, what: str) -> socket.socket:
    """A listening, non-blocking socket on `host`:`port`; `shared`: several server processes listen on it
    (``SO_REUSEPORT``). `ServerError` if it cannot be bound."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if shared:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ServerError(f"cannot listen {'for ' + what if what else ''}on {host}:{port}: {exc.strerror}") from exc
    sock.listen(2048)
    sock.setblocking(False)
    return sock


class ModelControlMode(enum.StrEnum):
    """Triton's ``--model-control-mode``: which models load at start, and whether the load/unload API works."""

    #: Every model of the repository is loaded at start; the load/unload API is refused.
    NONE = "none"
    #: Only ``load_models`` are loaded at start (``"*"``: all); the load/unload API is available.
    EXPLICIT = "explicit"


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerOptions:
    """Everything `carton serve` can set. Ports of 0 pick free ports; ``grpc_port=None`` turns gRPC off."""

    repository: Path
    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int | None = 8001
    model_control_mode: ModelControlMode = ModelControlMode.NONE
    load_models: Sequence[str] = ()
    max_body_size: int = 256 * 1024 * 1024
    allow_upload: bool = True
    workers: int = 1
    sandbox: str | None = None
    upload_sandbox: str | None = "best_effort"
    load_timeout: float = 300.0
    unload_timeout: float = 60.0
    #: Triton's ``--strict-readiness``: not ready while a model that was asked for failed to load.
    strict_readiness: bool = False
    loader: ModelLoader = field(default=load_carton)
    #: Server processes listening on the same ports (``SO_REUSEPORT``), each with its own repository and runners
    #: (not the runner `workers`); see docs/server.md, "Several server processes".
    processes: int = 1


def _version() -> str:
    from .._version import __version__

    return __version__


class Server:
    """One server: `start` binds and loads, `stop` unloads everything and closes the sockets."""

    def __init__(self, options: ServerOptions, *, peers: CoordinatorLink | None = None) -> None:
        if not options.repository.is_dir():
            raise ServerError(f"model repository {options.repository} is not a directory")
        self.options = options
        # The other server processes: this is their coordinator (a `ProcessGroup`), or one of them (`peers`).
        self.peers: ProcessGroup | CoordinatorLink | None = peers
        if peers is None and options.processes != 1:
            from ._processes import ProcessGroup

            self.peers = ProcessGroup(options)
        self.metrics = ServerMetrics()
        # Uploads of servers that were killed (SIGKILL skips `stop`) are swept here: their folders name their pid.
        for stale in sweep_stale_upload_roots():
            _log.info("removed the upload folder of a server that is no longer running: %s", stale)
        self._upload_root = make_upload_root()
        explicit = options.model_control_mode is ModelControlMode.EXPLICIT
        self.repository = ModelRepository(
            options.repository,
            loader=options.loader,
            metrics=self.metrics,
            upload_root=self._upload_root,
            options=RepositoryOptions(
                workers=options.workers,
                sandbox=options.sandbox,
                upload_sandbox=options.upload_sandbox,
                allow_upload=options.allow_upload,
                explicit=explicit,
                load_timeout=options.load_timeout,
                unload_timeout=options.unload_timeout,
                strict_readiness=options.strict_readiness,
            ),
        )
        if self.peers is not None:
            self.peers.attach(self.repository, self.metrics)
        self.app = HttpApp(
            self.repository, self.metrics, max_body_size=options.max_body_size, server_version=_version(),
            control=self.peers, totals=self.peers,
        )  # fmt: skip
        self.http_port: int = options.http_port
        self.grpc_port: int | None = options.grpc_port
        self._http: HttpServer | None = None
        #: The event loop the server runs on, once started (for callers in other threads).
        self.loop: asyncio.AbstractEventLoop | None = None
        self._grpc: GrpcServer | None = None

    async def start(self) -> None:
        """Bind the HTTP (and gRPC) ports and load the models the options name; raise `ServerError` if a port
        cannot be bound."""
        if self.options.grpc_port is not None:
            # Imported before anything listens: it needs the generated stubs, and HTTP-only serving does not.
            from ._grpc import GrpcService
            from ._grpc_transport import serve_grpc

        if self.peers is not None:
            self.peers.check_ports()
        sock = _listen(self.options.host, self.options.http_port, shared=self.peers is not None, what="")
        self.http_port = sock.getsockname()[1]
        self.loop = asyncio.get_running_loop()
        self._http = await serve_http(self.app.handle, sock, keep_alive_timeout=30.0)
        if self.options.grpc_port is not None:
            grpc_sock = _listen(self.options.host, self.options.grpc_port, shared=self.peers is not None, what="gRPC ")
            service = GrpcService(self.repository, server_version=_version(), control=self.peers, totals=self.peers)
            self._grpc = await serve_grpc(service, grpc_sock, max_message_size=self.options.max_body_size)
            self.grpc_port = grpc_sock.getsockname()[1]
        if self.peers is None:
            await self._load_startup_models()
        else:
            await self.peers.start(self, self._startup_models())  # the coordinator loads them on every process

    def _startup_models(self) -> list[str]:
        if self.options.model_control_mode is ModelControlMode.NONE or "*" in self.options.load_models:
            return list_models(self.options.repository)
        return list(self.options.load_models)

    async def _load_startup_models(self) -> None:
        names = self._startup_models()
        results = await asyncio.gather(*(self.repository.load_at_startup(n) for n in names), return_exceptions=True)
        for name, result in zip(names, results, strict=True):
            if isinstance(result, BaseException):
                _log.error("model %r failed to load: %s", name, result)

    async def stop(self) -> None:
        """Stop accepting requests, unload every model (closing its runners) and close the ports."""
        if self.peers is not None:
            await asyncio.gather(self._stop_serving(), self.peers.stop())
        else:
            await self._stop_serving()

    async def _stop_serving(self) -> None:
        if self._grpc is not None:
            await self._grpc.close(1.0)
        if self._http is not None:
            await self._http.close()
        await self.repository.close()
        shutil.rmtree(self._upload_root, ignore_errors=True)


def listening_text(server: Server) -> str:
    """Where a started server listens, as one line (the startup banner)."""
    grpc_text = f", gRPC on {server.options.host}:{server.grpc_port}" if server.grpc_port is not None else ""
    processes = f" ({server.options.processes} server processes)" if server.options.processes > 1 else ""
    return f"carton server: HTTP on {server.options.host}:{server.http_port}{grpc_text}{processes}"


async def _serve_until_signalled(server: Server, on_started: Callable[[Server], None] | None) -> None:
    import signal

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    await server.start()
    _log.info("%s", listening_text(server))
    if on_started is not None:
        on_started(server)
    # A signal, or a server process that died (then the others stop too, and the error is raised).
    waits: list[asyncio.Future[object]] = [asyncio.ensure_future(stop.wait())]
    if server.peers is not None:
        waits.append(asyncio.ensure_future(server.peers.broken()))
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiting in waits:
            waiting.cancel()
        await server.stop()
    for waiting in waits[1:]:
        error = waiting.result() if waiting.done() and not waiting.cancelled() else None
        if isinstance(error, ServerError):
            raise error


def _run(coroutine_factory: object) -> None:
    import uvloop

    uvloop.run(coroutine_factory)  # type: ignore[arg-type]


#: The GIL switch interval of a `carton serve` process, in seconds (Python's default is 0.005).
_SWITCH_INTERVAL = 0.001


def run_server(options: ServerOptions, *, on_started: Callable[[Server], None] | None = None) -> None:
    """Serve until SIGINT/SIGTERM (what `carton serve` runs); `on_started` is called once the server listens.

    The process's GIL switch interval is shortened: while a worker thread decodes a large JSON body, the event loop
    waits up to one interval for the GIL at each step of every other request, and a request takes several steps."""
    sys.setswitchinterval(_SWITCH_INTERVAL)
    server = Server(options)
    _run(_serve_until_signalled(server, on_started))


@contextmanager
def serve_in_thread(options: ServerOptions) -> Iterator[Server]:
    """Run a server on its own event loop in a background thread; yields it started (ports filled in)."""
    import uvloop

    loop = uvloop.new_event_loop()
    server = Server(options)
    ready = threading.Event()
    failure: list[BaseException] = []

    def main() -> None:
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(server.start())
        except BaseException as exc:
            failure.append(exc)
            ready.set()
            return
        ready.set()
        loop.run_forever()

    thread = threading.Thread(target=main, name="carton-server", daemon=True)
    thread.start()
    ready.wait()
    if failure:
        thread.join()
        loop.close()
        raise failure[0]
    try:
        yield server
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(), loop).result(timeout=120)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=30)
        loop.close()
