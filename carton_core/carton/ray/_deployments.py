"""The three deployments of the application: the ingress, the multiplexed model replicas, and their reports.

- `CartonIngress` (route prefix ``/``) receives every HTTP request from Serve's proxy and every gRPC call from Serve's
  gRPC proxy. It runs the server's own `HttpApp`/`GrpcService` with no models: server-wide endpoints are answered
  there from the replicas' reports; a request about a model is forwarded, as its method, path, headers and body
  bytes (or the gRPC request's bytes), through a `DeploymentHandle` with ``multiplexed_model_id`` set to the model's
  name, which Serve routes preferably to a replica that has that model loaded.
- `CartonModels` replicas each run a `ModelRepository` over the same repository folder, the same `HttpApp` and
  `GrpcService` as ``carton serve``, and load a model on its first request (``serve.multiplexed``; at most
  ``max_models_per_replica``, the least recently used unloaded, its runners closed, before another loads). Runner
  processes are children of the replica process, so they end with it.
- `ReplicaReports` (one replica, no CPU) keeps each model replica's latest index report (see ``_index.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import shutil
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import httpx
from ray import serve

from ..server._grpc import GrpcService, status_of
from ..server._handle import LoadSpec, ModelHandle, ModelLoader, load_carton
from ..server._http import HttpApp
from ..server._http_messages import HttpRequest, HttpResponse, collect_body
from ..server._layout import list_models, make_upload_root, sweep_stale_upload_roots, validate_model_name
from ..server._proto import message_class
from ..server._repository import ModelRepository, RepositoryOptions
from ..server._stats import ServerMetrics
from ..server.errors import STATUS, BadRequest, ModelUnavailable, RepositoryError, ServerError
from ._index import failed, merge_index, reportable
from ._options import AppOptions

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

    from ray.serve.grpc_util import RayServegRPCContext
    from ray.serve.handle import DeploymentHandle

__all__ = ["GRPC_METHODS", "CartonIngress", "CartonModels"]

_log = logging.getLogger("carton.ray")

#: The unary methods of ``inference.GRPCInferenceService`` carried through Serve's gRPC proxy, with the request field
#: that names the model (None: answered by the ingress itself).
GRPC_METHODS: dict[str, str | None] = {
    "ServerLive": None,
    "ServerReady": None,
    "ServerMetadata": None,
    "RepositoryIndex": None,
    "RepositoryModelLoad": None,
    "RepositoryModelUnload": None,
    "ModelReady": "name",
    "ModelMetadata": "name",
    "ModelConfig": "name",
    "ModelStatistics": "name",
    "ModelInfer": "model_name",
}

# Error replies travel between the deployments as (status, message); `_refusal` turns one back into a ServerError.
_Reply = tuple[int, str]


def _version() -> str:
    from .._version import __version__

    return __version__


def _refusal(status: int, message: str) -> ServerError:
    """The error a replica answered with, rebuilt from its HTTP status: the class `STATUS` gives that status
    (400 is answered the same way by both of its classes)."""
    for cls, answer in STATUS.items():
        if answer.http == status and cls is not RepositoryError:
            return cls(message)
    return ServerError(message)


def _files_stamp(root: Path, name: str) -> tuple[tuple[str, int, int], ...]:
    """Names, sizes and modification times of model `name`'s files in the repository (changes when it is fixed)."""
    found: list[tuple[str, int, int]] = []
    for path in (root / f"{name}.carton", root / name):
        if path.is_file():
            found.append((path.name, path.stat().st_size, path.stat().st_mtime_ns))
        for folder, _, files in os.walk(path):
            for file in files:
                with contextlib.suppress(OSError):
                    status = Path(folder, file).stat()
                    found.append((os.path.relpath(Path(folder, file), root), status.st_size, status.st_mtime_ns))
    return tuple(sorted(found))


def _from_url(loader: ModelLoader, root: Path, url: str) -> ModelLoader:
    """`loader` for the placeholders `root/<name>.carton` of a URL repository: it loads ``<url>/<name>.carton``."""

    def load(spec: LoadSpec) -> ModelHandle:
        name = Path(spec.path).relative_to(root).as_posix()
        return loader(replace(spec, path=f"{url}/{quote(name, safe='')}"))

    return load


class _Held:
    """A model in a replica's ``serve.multiplexed`` cache. Serve awaits ``__del__`` when it evicts the model; it is an
    instance attribute, so the garbage collector never calls it (the unload is explicit, not left to GC timing).

    A model whose load failed stays here as failed, with the repository files it failed with (`stamp`): its requests
    get `carton serve`'s answers for a failed model without a new load each, until its files change, a load request
    asks again, or the entry is evicted."""

    def __init__(self, replica: CartonModels, name: str) -> None:
        self.name = name
        self.error: ServerError | None = None
        self.stamp: tuple[tuple[str, int, int], ...] = ()
        self.fresh = True
        self.lock = asyncio.Lock()
        self._replica = replica
        self.__del__ = self.unload

    async def unload(self) -> None:
        await self._replica.evict(self.name)


class CartonModels:
    """A model replica: ``carton serve``'s repository and protocol code, loading models on demand."""

    def __init__(self, options: AppOptions, reports: DeploymentHandle[Any]) -> None:
        from .._runtime import RunnerLimits

        self._reports = reports
        self._replica = serve.get_replica_context().replica_id.unique_id
        limits = RunnerLimits(
            memory_bytes=options.memory_limit,
            cpu_seconds=options.cpu_limit,
            request_seconds=options.request_timeout,
            processes=options.process_limit,
        )
        limited = any(
            value is not None
            for value in (options.memory_limit, options.cpu_limit, options.request_timeout, options.process_limit)
        )
        for stale in sweep_stale_upload_roots():
            _log.info("removed the upload folder of a replica that is no longer running: %s", stale)
        self._upload_root = make_upload_root()
        loader: ModelLoader = functools.partial(load_carton, limits=limits) if limited else load_carton
        self._url: str | None = None
        if isinstance(options.repository, str):
            # A URL repository: model `m` is `<url>/m.carton`. The replica's repository is a private folder of empty
            # placeholders `m.carton`, one per model found at the URL, which the loader turns back into URLs.
            self._url = options.repository
            root = Path(tempfile.mkdtemp(prefix="carton-ray-url-", dir=self._upload_root))
            loader = _from_url(loader, root, self._url)
        else:
            root = options.repository
        metrics = ServerMetrics()
        self.repository = ModelRepository(
            root,
            loader=loader,
            metrics=metrics,
            upload_root=self._upload_root,
            options=RepositoryOptions(
                workers=options.workers,
                sandbox=options.sandbox,
                allow_upload=False,
                explicit=True,
                load_timeout=options.load_timeout,
            ),
        )
        self._http = HttpApp(self.repository, metrics, max_body_size=options.max_body_size, server_version=_version())
        self._grpc_methods = GrpcService(self.repository, server_version=_version()).unary_methods()

        async def load(name: str) -> _Held:
            return await self._load(name)

        # Applied here (Serve detects a multiplexed function stored on the instance) because the cache size is an
        # argument of the application, not a constant of the class.
        self._model: Callable[[str], Any] = serve.multiplexed(
            max_num_models_per_replica=options.max_models_per_replica
        )(load)
        # Serve awaits the callable's `__del__` when the replica shuts down; as an instance attribute it is never
        # called by the garbage collector.
        self.__del__ = self._shutdown

    # ---- models --------------------------------------------------------------------------------------------------
    async def _load(self, name: str) -> _Held:
        held = _Held(self, name)
        await self._attempt(held)
        return held

    async def _attempt(self, held: _Held) -> None:
        """Load (or reload) `held`'s model, recording the outcome and the files it was loaded from."""
        held.stamp = _files_stamp(self.repository.root, held.name)
        try:
            await self.repository.load(held.name)
            held.error = None
        except ServerError as exc:
            # The repository keeps the failure and its reason: this replica answers the model's requests from it as
            # `carton serve` does (404 for inference, not ready).
            _log.warning("model %r failed to load: %s", held.name, exc)
            held.error = exc
        finally:
            await self._report()

    async def evict(self, name: str) -> None:
        """Unload `name` and wait until its runners are closed (the multiplexed cache is making room)."""
        await self.repository.unload(name)
        await self.repository.settle()
        await self._report()

    async def _hold(self, *, loading: bool = False) -> _Held | None:
        """The cache entry of the request's model, loaded if this replica does not hold it (None: no such model).

        `fresh` stays true only for a load request that caused the load, which then answers with its outcome."""
        name = serve.get_multiplexed_model_id()
        if not name or not await self._known(name):
            return None
        held: _Held = await self._model(name)
        if not loading:
            held.fresh = False
        if held.error is not None and _files_stamp(self.repository.root, name) != held.stamp:
            async with held.lock:  # one retry for the requests that find the files changed together
                if held.error is not None and _files_stamp(self.repository.root, name) != held.stamp:
                    await self._attempt(held)
        return held

    async def _known(self, name: str) -> bool:
        """Whether the repository holds model `name` (at a URL repository: whether ``<url>/<name>.carton`` exists)."""
        try:
            validate_model_name(name)
        except BadRequest:
            return False
        if self.repository.exists(name):
            return True
        if self._url is None:
            return False
        url = f"{self._url}/{quote(name, safe='')}.carton"
        try:
            async with httpx.AsyncClient(timeout=30, follow_redirects=True) as client:
                status = (await client.head(url)).status_code
        except httpx.HTTPError as exc:
            raise ModelUnavailable(f"the model repository did not answer for {name!r} ({type(exc).__name__})") from exc
        if status in (404, 410):
            return False
        if status != 200:
            raise ModelUnavailable(f"the model repository answered {status} for {name!r}")
        (self.repository.root / f"{name}.carton").touch()
        return True

    async def _report(self) -> None:
        try:
            await self._reports.report.remote(self._replica, reportable(self.repository.index()))
        except Exception as exc:  # the reports deployment restarting must not fail a request or a health check
            _log.warning("could not report this replica's models: %s", exc)

    # ---- what the ingress forwards -------------------------------------------------------------------------------
    async def http(
        self, method: str, raw_path: bytes, headers: list[tuple[bytes, bytes]], body: bytes
    ) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        """Answer an HTTP request about the model named by the request's multiplexed model id (if any)."""
        try:
            await self._hold()
        except ServerError as exc:
            response = self._http.refusal(exc)
        else:
            # Nothing awaits between the model's lookup in the cache and the request taking hold of its version, so
            # an eviction cannot come in between (it waits for the request to finish).
            request = HttpRequest(method=method, raw_path=raw_path, headers=dict(headers), body=body)
            response = await self._http.handle(request)
        return response.status, response.headers, response.body()

    async def grpc(self, method: str, payload: bytes) -> tuple[str, str, bytes]:
        """Run a unary gRPC method; returns the status code's name, its details and the serialized response."""
        try:
            await self._hold()
            request = message_class(f"{method}Request").FromString(payload)
            response = await self._grpc_methods[method](request)
        except ServerError as exc:
            return status_of(exc).name, str(exc), b""
        return "OK", "", response.SerializeToString()

    async def load(self) -> _Reply | None:
        """A repository load request: the first load on this replica, or a reload (which retries a failed load)."""
        name = serve.get_multiplexed_model_id()
        try:
            if not await self._known(name):
                await self.repository.load(name)  # refused with carton serve's reason (no such model, bad name)
            held = await self._hold(loading=True)
            assert held is not None
            if not held.fresh:
                await self._attempt(held)
            held.fresh = False
            if held.error is not None:
                raise held.error
        except ServerError as exc:
            return exc.http_status, str(exc)
        return None

    async def check_health(self) -> None:
        """Serve's periodic health check doubles as this replica's report (so the index forgets dead replicas)."""
        await self._report()

    async def _shutdown(self) -> None:
        try:
            await self._reports.forget.remote(self._replica)
        except Exception as exc:
            _log.warning("could not withdraw this replica's report: %s", exc)
        await self.repository.close()
        shutil.rmtree(self._upload_root, ignore_errors=True)


class _ClusterControl:
    """Readiness, index, load and unload for the whole application, from the replicas' reports."""

    def __init__(self, options: AppOptions, models: DeploymentHandle[Any], reports: DeploymentHandle[Any]) -> None:
        self._options = options
        self._models = models
        self._reports = reports

    async def _merged(self, *, ready_only: bool) -> tuple[int, list[dict[str, str]]]:
        live: Mapping[str, list[dict[str, str]]] = await self._reports.live.remote()
        repository = self._options.repository
        # A URL cannot be listed: the index of a URL repository names the models the replicas have tried.
        names = list_models(repository) if isinstance(repository, Path) else []
        return len(live), merge_index(names, live.values(), ready_only=ready_only)

    async def is_ready(self) -> bool:
        replicas, merged = await self._merged(ready_only=False)
        return replicas > 0 and not (self._options.strict_readiness and failed(merged))

    async def index(self, *, ready_only: bool) -> list[dict[str, str]]:
        return (await self._merged(ready_only=ready_only))[1]

    async def load(self, name: str, *, config: str | None, files: Mapping[str, bytes]) -> None:
        validate_model_name(name)
        if config is not None or files:
            raise RepositoryError(
                f"failed to load {name!r}: 'config' and 'file:' load parameters are not supported on Ray Serve "
                "(every replica loads the model from the repository as it is)"
            )
        try:
            reply: _Reply | None = await self._models.options(multiplexed_model_id=name).load.remote()
        except Exception as exc:
            raise _gone(name, exc) from exc
        if reply is not None:
            raise _refusal(*reply)

    async def unload(self, name: str, *, unload_dependents: bool) -> None:
        validate_model_name(name)
        raise RepositoryError(
            f"failed to unload {name!r}: models are not unloaded through the API on Ray Serve; each replica keeps "
            f"its {self._options.max_models_per_replica} most recently used models and unloads the least recently used"
        )


def _gone(model: str | None, exc: BaseException) -> ModelUnavailable:
    _log.warning("a request about %s failed in Ray: %r", repr(model) if model else "the server", exc)
    what = f"model {model!r}" if model else "the request"
    return ModelUnavailable(f"the replica serving {what} stopped or could not be reached; retry the request")


class _Serialized:
    """A gRPC response already serialized by a replica (Serve's gRPC path calls ``SerializeToString`` on it)."""

    __slots__ = ("payload",)

    def __init__(self, payload: bytes) -> None:
        self.payload = payload

    def SerializeToString(self) -> bytes:
        return self.payload


def _rpc(method: str) -> Callable[..., Any]:
    async def call(self: CartonIngress, payload: bytes, grpc_context: RayServegRPCContext) -> _Serialized:
        return await self.grpc_call(method, payload, grpc_context)

    call.__name__ = call.__qualname__ = method
    return call


@serve.ingress()
class CartonIngress:
    """The application's ingress: ``carton serve``'s HTTP and gRPC code with the replicas behind it."""

    def __init__(self, options: AppOptions, models: DeploymentHandle[Any], reports: DeploymentHandle[Any]) -> None:
        self._options = options
        self._models = models
        control = _ClusterControl(options, models, reports)
        self._http = HttpApp.front(
            control, self._forward, max_body_size=options.max_body_size, server_version=_version()
        )
        self._grpc_methods = GrpcService(None, server_version=_version(), control=control).unary_methods()

    def __serve_build_asgi_app__(self) -> HttpApp:
        return self._http

    async def _forward(self, request: HttpRequest, model: str | None) -> HttpResponse:
        if model is not None:
            validate_model_name(model)
        body = await collect_body(
            request.body, declared=request.headers.get(b"content-length"), limit=self._options.max_body_size
        )
        handle = self._models if model is None else self._models.options(multiplexed_model_id=model)
        try:
            status, headers, payload = await handle.http.remote(
                request.method, request.raw_path, list(request.headers.items()), bytes(body)
            )
        except Exception as exc:
            raise _gone(model, exc) from exc
        return HttpResponse(status, headers, [payload])

    async def grpc_call(self, method: str, payload: bytes, context: RayServegRPCContext) -> _Serialized:
        import grpc

        field = GRPC_METHODS[method]
        try:
            request = message_class(f"{method}Request").FromString(payload)
        except Exception:
            context.set_code(grpc.StatusCode.INVALID_ARGUMENT)
            context.set_details(f"the {method} request does not parse")
            return _Serialized(b"")
        try:
            model = getattr(request, field) if field is not None else ""
            if not model:
                if field is None:
                    return _Serialized((await self._grpc_methods[method](request)).SerializeToString())
                handle = self._models
            else:
                validate_model_name(model)
                handle = self._models.options(multiplexed_model_id=model)
            try:
                code, details, response = await handle.grpc.remote(method, payload)
            except Exception as exc:
                raise _gone(model, exc) from exc
        except ServerError as exc:
            code, details, response = status_of(exc).name, str(exc), b""
        if code != "OK":
            context.set_code(grpc.StatusCode[code])
            context.set_details(details)
        return _Serialized(response)

    ServerLive = _rpc("ServerLive")
    ServerReady = _rpc("ServerReady")
    ServerMetadata = _rpc("ServerMetadata")
    RepositoryIndex = _rpc("RepositoryIndex")
    RepositoryModelLoad = _rpc("RepositoryModelLoad")
    RepositoryModelUnload = _rpc("RepositoryModelUnload")
    ModelReady = _rpc("ModelReady")
    ModelMetadata = _rpc("ModelMetadata")
    ModelConfig = _rpc("ModelConfig")
    ModelStatistics = _rpc("ModelStatistics")
    ModelInfer = _rpc("ModelInfer")
