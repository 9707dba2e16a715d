"""The gRPC endpoints of ``carton serve``: `GrpcService` on grpcio's thread-pool server, beside the event loop.

A handler thread parses the request, calls the runner itself (`GrpcService.model_infer_blocking`: the runtime's
`Model.infer` waits on a per-thread ZeroMQ socket) and serializes the response, so an inference never hops onto the
event loop and back. Everything that changes the repository's state (load, unload, index, readiness) and models
with a dynamic batcher still run on the event loop, where the HTTP side runs them too: the handler thread submits
the coroutine and waits for its result. Why threads rather than ``grpc.aio``: docs/server.md, "gRPC".

Each call holds one handler thread while it runs, a ``ModelStreamInfer`` stream for as long as it stays open; calls
beyond `threads` wait for a free thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import grpc

from ._grpc import GrpcService, message_handlers, status_of
from ._proto import message_class
from .errors import ServerError

__all__ = ["DEFAULT_GRPC_THREADS", "ThreadedGrpcServer"]

#: Handler threads of the gRPC server (calls in flight at once; each open stream holds one).
DEFAULT_GRPC_THREADS = 32

_StreamResponse = message_class("ModelStreamInferResponse")


class ThreadedGrpcServer:
    """`service` served by a `grpc.server` whose handler threads run inferences; repository work runs on `loop`.

    `start` binds and returns the port (0 when it cannot be bound); `stop` is awaited on `loop`."""

    def __init__(
        self,
        service: GrpcService,
        loop: asyncio.AbstractEventLoop,
        *,
        options: list[tuple[str, Any]],
        threads: int = DEFAULT_GRPC_THREADS,
    ) -> None:
        self._service = service
        self._loop = loop
        self._executor = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="carton-grpc")
        self._server = grpc.server(self._executor, options=options)
        self._server.add_generic_rpc_handlers((self._handler(),))

    def add_port(self, address: str) -> int:
        """Listen on `address` (``host:port``); the bound port, 0 when it cannot be bound."""
        try:
            port: int = self._server.add_insecure_port(address)
        except RuntimeError:  # grpcio raises instead of returning 0 for an address in use
            return 0
        return port

    def start(self) -> None:
        self._server.start()

    async def stop(self, grace: float) -> None:
        """Refuse new calls and let running ones finish for up to `grace` seconds, then cancel them. A handler thread
        still inside a model after that ends when the repository closes the model's runners."""
        stopped = self._server.stop(grace)
        await asyncio.to_thread(stopped.wait)
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _handler(self) -> grpc.GenericRpcHandler[Any, Any]:
        service = self._service
        unary: dict[str, Callable[[Any, grpc.ServicerContext], Any]] = {
            name: self._on_loop(function) for name, function in service.unary_methods().items()
        }
        unary["ModelInfer"] = self._model_infer
        return message_handlers(unary, self._model_stream_infer)

    def _on_loop(self, function: Callable[[Any], Awaitable[Any]]) -> Callable[[Any, grpc.ServicerContext], Any]:
        loop = self._loop

        def call(request: Any, context: grpc.ServicerContext) -> Any:
            try:
                return asyncio.run_coroutine_threadsafe(function(request), loop).result()  # type: ignore[arg-type]
            except ServerError as exc:
                # Safe as composed (see `HttpApp.__call__`): client names are echoed verbatim.
                context.abort(status_of(exc), str(exc))

        return call

    def _model_infer(self, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return self._service.model_infer_blocking(request, self._loop)
        except ServerError as exc:
            context.abort(status_of(exc), str(exc))

    def _model_stream_infer(self, requests: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
        for request in requests:
            try:
                response = self._service.model_infer_blocking(request, self._loop)
            except ServerError as exc:
                yield _StreamResponse(error_message=str(exc))
            else:
                yield _StreamResponse(infer_response=response)
