"""Running the server: HTTP (uvicorn on httptools + uvloop) and gRPC (grpc.aio) on one event loop, one repository.

The HTTP listening socket is created here with ``TCP_NODELAY`` set (accepted connections inherit it on Linux), so
small responses are not held back by Nagle's algorithm, and so that port 0 picks a free port the caller can read.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import shutil
import socket
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from ._handle import ModelLoader, load_carton
from ._http import HttpApp
from ._layout import list_models, make_upload_root, sweep_stale_upload_roots
from ._repository import ModelRepository, RepositoryOptions
from ._stats import ServerMetrics
from .errors import ServerError

__all__ = ["ModelControlMode", "Server", "ServerOptions", "listening_text", "run_server", "serve_in_thread"]

_log = logging.getLogger("carton.server")


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


def _version() -> str:
    from .._version import __version__

    return __version__


class Server:
    """One server: `start` binds and loads, `stop` unloads everything and closes the sockets."""

    def __init__(self, options: ServerOptions) -> None:
        if not options.repository.is_dir():
            raise ServerError(f"model repository {options.repository} is not a directory")
        self.options = options
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
        self.app = HttpApp(
            self.repository, self.metrics, max_body_size=options.max_body_size, server_version=_version()
        )
        self.http_port: int = options.http_port
        self.grpc_port: int | None = options.grpc_port
        self._uvicorn: object | None = None
        self._uvicorn_task: asyncio.Task[None] | None = None
        self._grpc: object | None = None

    async def start(self) -> None:
        """Bind the HTTP (and gRPC) ports and load the models the options name; raise `ServerError` if a port
        cannot be bound."""
        import uvicorn
        from grpc import aio

        if self.options.grpc_port is not None:
            # Imported before anything listens: it needs the generated stubs, and HTTP-only serving does not.
            from ._grpc import GrpcService

        sock = socket.socket(socket.AF_INET6 if ":" in self.options.host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            sock.bind((self.options.host, self.options.http_port))
        except OSError as exc:
            sock.close()
            raise ServerError(f"cannot listen on {self.options.host}:{self.options.http_port}: {exc.strerror}") from exc
        sock.listen(2048)
        sock.setblocking(False)
        self.http_port = sock.getsockname()[1]
        config = uvicorn.Config(
            self.app,
            http="httptools",
            loop="none",
            lifespan="off",
            log_level="warning",
            access_log=False,
            proxy_headers=False,  # no X-Forwarded-* rewriting: one middleware less per request
            interface="asgi3",
            timeout_keep_alive=30,
            server_header=False,
            date_header=False,
        )
        server = uvicorn.Server(config)
        # uvicorn captures SIGINT/SIGTERM while serving; the caller (`run_server`) owns signals instead, so that
        # one signal stops HTTP, gRPC and the runners together.
        server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign,assignment]
        self._uvicorn = server
        self._uvicorn_task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]))
        if self.options.grpc_port is not None:
            limit = self.options.max_body_size
            grpc_server = aio.server(
                options=[("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", -1)]
            )
            grpc_server.add_generic_rpc_handlers((GrpcService(self.repository, server_version=_version()).handler(),))
            port = grpc_server.add_insecure_port(f"{self.options.host}:{self.options.grpc_port}")
            if port == 0:
                raise ServerError(f"cannot listen for gRPC on {self.options.host}:{self.options.grpc_port}")
            await grpc_server.start()
            self.grpc_port = port
            self._grpc = grpc_server
        while not server.started:
            if self._uvicorn_task.done():
                self._uvicorn_task.result()
                raise ServerError("the HTTP server stopped while starting")
            await asyncio.sleep(0.005)
        await self._load_startup_models()

    async def _load_startup_models(self) -> None:
        if self.options.model_control_mode is ModelControlMode.NONE or "*" in self.options.load_models:
            names = list_models(self.options.repository)
        else:
            names = list(self.options.load_models)
        results = await asyncio.gather(*(self.repository.load_at_startup(n) for n in names), return_exceptions=True)
        for name, result in zip(names, results, strict=True):
            if isinstance(result, BaseException):
                _log.error("model %r failed to load: %s", name, result)

    async def stop(self) -> None:
        """Stop accepting requests, unload every model (closing its runners) and close the ports."""
        if self._grpc is not None:
            await self._grpc.stop(1.0)  # type: ignore[attr-defined]
        if self._uvicorn is not None and self._uvicorn_task is not None:
            self._uvicorn.should_exit = True  # type: ignore[attr-defined]
            await self._uvicorn_task
        await self.repository.close()
        shutil.rmtree(self._upload_root, ignore_errors=True)


def listening_text(server: Server) -> str:
    """Where a started server listens, as one line (the startup banner)."""
    grpc_text = f", gRPC on {server.options.host}:{server.grpc_port}" if server.grpc_port is not None else ""
    return f"carton server: HTTP on {server.options.host}:{server.http_port}{grpc_text}"


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
    try:
        await stop.wait()
    finally:
        await server.stop()


def _run(coroutine_factory: object) -> None:
    import uvloop

    uvloop.run(coroutine_factory)  # type: ignore[arg-type]


def run_server(options: ServerOptions, *, on_started: Callable[[Server], None] | None = None) -> None:
    """Serve until SIGINT/SIGTERM (what `carton serve` runs); `on_started` is called once the server listens."""
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
