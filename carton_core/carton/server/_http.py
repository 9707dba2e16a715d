"""The HTTP/REST endpoints of the KServe v2 protocol and its Triton extensions: `HttpApp.handle` answers one
`HttpRequest` with an `HttpResponse` (``_http_messages.py`` is the seam a transport adapts to; the app is also an
ASGI application through `AsgiAdapter`).

Routing is done on the raw request path, split on ``/`` before percent-decoding, so an encoded slash (``%2F``) stays
inside its segment and is then refused by the model-name rules instead of silently changing the route. The body is
read with the size limit enforced from ``Content-Length`` before any byte is read, and while reading otherwise
(chunked bodies); ``Content-Encoding: gzip``/``deflate`` (what tritonclient's request compression sends) is inflated
under the same limit.
"""

from __future__ import annotations

import asyncio
import logging
import zlib
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from operator import itemgetter
from time import perf_counter_ns
from typing import Any, Protocol
from urllib.parse import unquote

import numpy as np
import orjson
from carton_protocol import Tensor
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ._bounded import remember
from ._config import ModelConfig
from ._datatypes import DATATYPE_OF
from ._handle import metadata_shape
from ._http_codec import (
    InferBody,
    encode_binary_response,
    encode_infer_response,
    planned_request,
    unplanned_request,
)
from ._http_messages import (
    JOIN_ON_A_THREAD_BYTES,
    AsgiAdapter,
    FixedHead,
    HttpRequest,
    HttpResponse,
    Receive,
    Scope,
    Send,
    collect_body,
    whole_body,
)
from ._inference import request_failed, request_succeeded, select_outputs
from ._repository import ModelRepository, ServedVersion
from ._stats import ServerMetrics
from .errors import BadRequest, ModelNotFound, RequestTooLarge, ServerError

__all__ = [
    "EXTENSIONS",
    "Forward",
    "HttpApp",
    "RepositoryControl",
    "ServerControl",
    "ServerTotals",
    "model_config_json",
    "model_metadata_json",
    "split_path",
]

_log = logging.getLogger("carton.server")

#: What server metadata reports: only what this server implements.
EXTENSIONS = (
    "binary_tensor_data",
    "model_repository",
    "model_repository(unload_dependents)",
    "model_configuration",
    "statistics",
)

_UNSUPPORTED = {
    "systemsharedmemory": "system shared memory",
    "cudasharedmemory": "CUDA shared memory",
    "trace": "trace",
    "logging": "logging",
}


class _HttpError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def model_metadata_json(served: ServedVersion, versions: list[str]) -> dict[str, Any]:
    """A model version's metadata as KServe v2's JSON (its versions, declared inputs and outputs)."""
    return {
        "name": served.model,
        "versions": versions,
        "platform": "carton",
        "inputs": [
            {"name": s.name, "datatype": DATATYPE_OF[s.dtype], "shape": metadata_shape(s)}
            for s in served.input_specs.values()
        ],
        "outputs": [
            {"name": s.name, "datatype": DATATYPE_OF[s.dtype], "shape": metadata_shape(s)} for s in served.output_specs
        ],
    }


def _type_name(datatype: str) -> str:
    return "TYPE_STRING" if datatype == "BYTES" else f"TYPE_{datatype}"


def model_config_json(served: ServedVersion, default_workers: int) -> dict[str, Any]:
    """The version's config in Triton's JSON ``ModelConfig`` form (batch dimension left out when batching)."""
    config: ModelConfig = served.config
    skip = 1 if config.max_batch_size > 0 else 0
    document: dict[str, Any] = {
        "name": served.model,
        "platform": "carton",
        "backend": "carton",
        "version_policy": config.version_policy.to_json(),
        "max_batch_size": config.max_batch_size,
        "input": [
            {"name": s.name, "data_type": _type_name(DATATYPE_OF[s.dtype]), "dims": metadata_shape(s)[skip:]}
            for s in served.input_specs.values()
        ],
        "output": [
            {"name": s.name, "data_type": _type_name(DATATYPE_OF[s.dtype]), "dims": metadata_shape(s)[skip:]}
            for s in served.output_specs
        ],
        "instance_group": [
            {"name": f"{served.model}_0", "kind": "KIND_CPU", "count": config.instance_count or default_workers}
        ],
        "parameters": {key: {"string_value": value} for key, value in config.parameters.items()},
    }
    if config.dynamic_batching is not None:
        document["dynamic_batching"] = {
            "preferred_batch_size": list(config.dynamic_batching.preferred_batch_sizes),
            "max_queue_delay_microseconds": config.dynamic_batching.max_queue_delay_microseconds,
        }
    return document


class ServerControl(Protocol):
    """What the server-wide endpoints (readiness, the repository index, load and unload) ask of the server.

    `carton serve` answers them from its `ModelRepository`; ``carton.ray``'s ingress from the state its replicas
    report."""

    async def is_ready(self) -> bool: ...

    async def index(self, *, ready_only: bool) -> list[dict[str, str]]: ...

    async def load(self, name: str, *, config: str | None, files: Mapping[str, bytes]) -> None: ...

    async def unload(self, name: str, *, unload_dependents: bool) -> None: ...


class ServerTotals(Protocol):
    """``/metrics`` and the statistics extension summed over several server processes (``carton serve
    --processes N``); without one, an app reports its own repository's counters."""

    async def metrics(self) -> bytes:
        """The Prometheus text of every process's counters added up."""
        ...

    async def statistics(self, name: str, version: str) -> list[dict[str, Any]]:
        """``model_stats`` of `name` (empty: every model) at `version` (empty: every version served), summed; a
        model unknown here raises `ModelNotFound`."""
        ...


#: Answers a request about model `name` (``None``: statistics of every model, metrics) somewhere else.
Forward = Callable[[HttpRequest, "str | None"], Awaitable[HttpResponse]]


class RepositoryControl:
    """`ServerControl` over the repository of this process."""

    __slots__ = ("repository",)

    def __init__(self, repository: ModelRepository) -> None:
        self.repository = repository

    async def is_ready(self) -> bool:
        return self.repository.is_ready()

    async def index(self, *, ready_only: bool) -> list[dict[str, str]]:
        return self.repository.index(ready_only=ready_only)

    async def load(self, name: str, *, config: str | None, files: Mapping[str, bytes]) -> None:
        await self.repository.load(name, config=config, files=files)

    async def unload(self, name: str, *, unload_dependents: bool) -> None:
        await self.repository.unload(name, unload_dependents=unload_dependents)


def split_path(raw_path: bytes) -> list[str]:
    """The path's segments, split on ``/`` before percent-decoding (``%2F`` stays inside its segment)."""
    path = raw_path.split(b"?", 1)[0].decode("latin-1")
    return [unquote(part, errors="replace") for part in path.split("/")[1:]]


_EMPTY_JSON = [(b"content-type", b"application/json")]
_BINARY_CONTENT_TYPE = (b"content-type", b"application/octet-stream")
#: An output's name from its (name, binary) pair, without a Python-level function call.
_FIRST = itemgetter(0)
#: How many request targets' segments an app remembers.
_SEGMENTS_KEPT = 1024
#: How many binary inference response heads an app remembers (one per response header: model, outputs' layout, id).
_FIXED_HEADS_KEPT = 1024


class _Target:
    """A request target's segments, and the model and version when it is an inference endpoint."""

    __slots__ = ("infer", "segments")

    def __init__(self, segments: list[str]) -> None:
        self.segments = segments
        self.infer: tuple[str, str] | None = None
        # What `_route` and `_models` take to `_infer`: /v2/models/<name>[/versions/<version>]/infer.
        if len(segments) in (4, 6) and segments[:2] == ["v2", "models"] and segments[-1] == "infer":
            if len(segments) == 4:
                self.infer = (segments[2], "")
            elif segments[3] == "versions":
                self.infer = (segments[2], segments[4])


class HttpApp:
    """The KServe v2 HTTP protocol: `handle` answers one `HttpRequest`; the instance is also an ASGI application.

    `HttpApp(repository, ...)` serves the models of `repository` (``carton serve``). `HttpApp.front(control,
    forward, ...)` serves the server-wide endpoints from `control` and passes every request about a model to
    `forward` (the Ray Serve ingress, whose replicas run `HttpApp(repository, ...)` on the forwarded requests).
    Routing, errors and encoding are the same code either way.
    """

    def __init__(
        self,
        repository: ModelRepository | None,
        metrics: ServerMetrics,
        *,
        max_body_size: int,
        server_version: str,
        control: ServerControl | None = None,
        forward: Forward | None = None,
        totals: ServerTotals | None = None,
    ) -> None:
        if control is None:
            if repository is None:
                raise ValueError("HttpApp needs a repository or a control")
            control = RepositoryControl(repository)
        if repository is None and forward is None:
            raise ValueError("HttpApp without a repository must forward model requests")
        self.repository = repository
        self.control = control
        self.forward = forward
        self.totals = totals
        self.metrics = metrics
        self.max_body_size = max_body_size
        self.server_version = server_version
        self._asgi = AsgiAdapter(self.handle)
        #: The request targets seen last, split (clients repeat theirs); never mutated by the routing.
        self._targets: dict[bytes, _Target] = {}
        #: The heads of binary inference responses, by their JSON header (`_binary_head`).
        self._fixed_heads: dict[bytes, FixedHead] = {}

    @classmethod
    def front(cls, control: ServerControl, forward: Forward, *, max_body_size: int, server_version: str) -> HttpApp:
        """An app that answers the server-wide endpoints from `control` and forwards requests about models."""
        return cls(
            None, ServerMetrics(), max_body_size=max_body_size, server_version=server_version, control=control,
            forward=forward,
        )  # fmt: skip

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._asgi(scope, receive, send)

    def handle(self, request: HttpRequest) -> Coroutine[Any, Any, HttpResponse]:
        """Answer one request (``await app.handle(request)``); the answer never raises for anything a client can
        send."""
        target = self._targets.get(request.raw_path)
        if target is None:
            target = remember(self._targets, request.raw_path, _Target(split_path(request.raw_path)), _SEGMENTS_KEPT)
        # An inference is `_infer`'s own coroutine, the way `_route` would take it there: it answers its refusals
        # itself, so no coroutine around it is made and stepped through on every request.
        repository = self.repository
        if target.infer is not None and request.method == "POST" and repository is not None and self.forward is None:
            return self._infer(repository, request, *target.infer)
        return self._answer(request, target.segments)

    async def _answer(self, request: HttpRequest, segments: list[str]) -> HttpResponse:
        try:
            return await self._route(request, segments)
        except _HttpError as exc:
            return self._reject(exc.status, str(exc))
        except ServerError as exc:
            return self.refusal(exc)

    def refusal(self, exc: ServerError) -> HttpResponse:
        """The answer to a refused request: its status and ``{"error": message}``."""
        # Composed by the server from names, numbers and already-scrubbed foreign text (`translate_error`, the
        # repository's load errors): scrubbing again would mangle names the client chose, such as 'file:/etc/x'.
        return self._reject(exc.http_status, str(exc))

    def _reject(self, status: int, message: str) -> HttpResponse:
        self.metrics.rejected.labels(str(status)).inc()
        return _json(status, {"error": message})

    def _models_of(self) -> ModelRepository:
        if self.repository is None:  # a front app forwards every request that reaches here
            raise ModelNotFound("this server holds no models itself")
        return self.repository

    # ---- routing -------------------------------------------------------------------------------------------------
    async def _route(self, request: HttpRequest, segments: list[str]) -> HttpResponse:
        method = request.method
        if segments == ["metrics"]:
            _expect(method, "GET")
            if self.forward is not None:
                return await self.forward(request, None)
            body = await self.totals.metrics() if self.totals else generate_latest(self.metrics.registry)
            return HttpResponse(200, [(b"content-type", CONTENT_TYPE_LATEST.encode())], [body])
        if not segments or segments[0] != "v2":
            raise _HttpError(404, "Not Found")
        rest = segments[1:]
        if not rest or rest == [""]:
            _expect(method, "GET")
            return _json(200, {"name": "carton", "version": self.server_version, "extensions": EXTENSIONS})
        head = rest[0]
        if head == "health" and len(rest) == 2 and rest[1] in ("live", "ready"):
            _expect(method, "GET")
            ok = rest[1] == "live" or await self.control.is_ready()
            return HttpResponse(200 if ok else 400, [], [b""])
        if head == "models":
            return await self._models(request, rest[1:])
        if head == "repository":
            return await self._repository(request, rest[1:])
        if head in _UNSUPPORTED:
            raise _HttpError(501, f"the {_UNSUPPORTED[head]} extension is not supported by this server")
        raise _HttpError(404, "Not Found")

    async def _models(self, request: HttpRequest, rest: list[str]) -> HttpResponse:
        method = request.method
        if rest == ["stats"]:
            _expect(method, "GET")
            if self.forward is not None:
                return await self.forward(request, None)
            if self.totals is not None:
                return _json(200, {"model_stats": await self.totals.statistics("", "")})
            return _stats(self._models_of().all_served())
        if not rest:
            raise _HttpError(404, "Not Found")
        name, rest = rest[0], rest[1:]
        version = ""
        if len(rest) >= 2 and rest[0] == "versions":
            version, rest = rest[1], rest[2:]
        action = rest[0] if rest else ""
        if len(rest) > 1 or action not in ("", "ready", "config", "stats", "infer"):
            raise _HttpError(404, "Not Found")
        _expect(method, "POST" if action == "infer" else "GET")
        if self.forward is not None:
            return await self.forward(request, name)
        repository = self._models_of()
        if action == "infer":
            return await self._infer(repository, request, name, version)
        if action == "ready":
            return HttpResponse(200 if repository.model_ready(name, version) else 400, [], [b""])
        served = repository.get(name, version)
        if action == "":
            versions = [v.version_str for v in repository.versions(name)]
            return _json(200, model_metadata_json(served, versions))
        if action == "config":
            return _json(200, model_config_json(served, repository.options.workers))
        if self.totals is not None:
            return _json(200, {"model_stats": await self.totals.statistics(name, version)})
        return _stats([served] if version else repository.versions(name))

    async def _repository(self, request: HttpRequest, rest: list[str]) -> HttpResponse:
        _expect(request.method, "POST")
        if rest == ["index"]:
            body = await self._read_json(request)
            ready = body.get("ready", False)
            if not isinstance(ready, bool):
                raise BadRequest("'ready' must be true or false")
            return _json(200, await self.control.index(ready_only=ready))
        if len(rest) != 3 or rest[0] != "models" or rest[2] not in ("load", "unload"):
            raise _HttpError(404, "Not Found")
        name, action = rest[1], rest[2]
        body = await self._read_json(request)
        parameters = body.get("parameters", {})
        if not isinstance(parameters, dict):
            raise BadRequest("'parameters' must be a JSON object")
        if action == "unload":
            dependents = parameters.get("unload_dependents", False)
            if not isinstance(dependents, bool):
                raise BadRequest("'unload_dependents' must be true or false")
            await self.control.unload(name, unload_dependents=dependents)
        else:
            config, files = _load_parameters(parameters)
            await self.control.load(name, config=config, files=files)
        return HttpResponse(200, _EMPTY_JSON, [b""])

    # ---- inference (the hot path) --------------------------------------------------------------------------------
    async def _infer(self, repository: ModelRepository, request: HttpRequest, name: str, version: str) -> HttpResponse:
        """Answer an inference request, refusals included."""
        started = perf_counter_ns()
        try:
            served = repository.acquire(name, version)
        except ServerError as exc:
            return self.refusal(exc)
        # A version that runs each request as an execution of its own is called directly (no `ServedVersion.infer`
        # between), its execution counted with the request; `inferred_at` says whether the model ran.
        direct = served.direct
        decoded_at = inferred_at = 0
        release = None
        try:
            headers = request.headers
            body = request.body
            if callable(body) or b"content-encoding" in headers:
                body = await self.read_body(request)
            else:  # the usual small request: its body arrived with its head, as it was sent
                body = whole_body(body, declared=headers.get(b"content-length"), limit=self.max_body_size)
            header_length = headers.get(b"inference-header-content-length")
            decoded = planned_request(served, body, header_length)  # the usual binary request, else None
            if decoded is None:
                if _json_bytes(body, header_length) < _OFF_LOOP_BYTES:
                    decoded = unplanned_request(served, body, header_length)
                else:  # JSON tensors: decoded on a thread, so that other requests and health probes keep answering
                    decoded = await asyncio.to_thread(unplanned_request, served, body, header_length)
            decoded_at = perf_counter_ns()
            if direct is not None:
                lending = served.lending
                if len(body) >= _LEND_BYTES and lending is not None and request.calls_done:
                    # Large outputs stay in the runner's memory until the response is written (`HttpResponse.done`).
                    outputs, release = await lending(decoded.inputs)
                else:
                    outputs = await direct(decoded.inputs)
            else:
                outputs, _ = await served.infer(decoded.inputs)
            inferred_at = perf_counter_ns()
            if decoded.binary_only:  # a planned request (its outputs known binary): nothing to count
                header, parts = encode_binary_response(served, decoded, outputs)
            else:
                requested = list(map(_FIRST, decoded.outputs)) if decoded.outputs is not None else None
                selected = select_outputs(served, outputs, requested)
                if _json_output_bytes(decoded, selected) < _OFF_LOOP_BYTES:
                    header, parts = encode_infer_response(served, decoded, selected)
                else:
                    header, parts = await asyncio.to_thread(encode_infer_response, served, decoded, selected)
        except Exception as exc:
            if release is not None:
                release()
            return self.refusal(
                request_failed(
                    served, exc, repository.scrub, started_ns=started, decoded_ns=decoded_at, inferred_ns=inferred_at
                )
            )
        except BaseException:
            if release is not None:
                release()
            raise
        request_succeeded(served, started_ns=started, decoded_ns=decoded_at, inferred_ns=inferred_at)
        if parts:
            if decoded.binary_only:
                # The header is one `encode_infer_response` keeps, and it gives every part's size: the response's
                # head is the same for every response with this header.
                fixed = self._fixed_heads.get(header)
                if fixed is None:
                    fixed = remember(self._fixed_heads, header, _binary_head(header, parts), _FIXED_HEADS_KEPT)
                parts.insert(0, header)  # (the list is this request's own: no copy of it)
                return HttpResponse(200, fixed.headers, parts, fixed, release)
            length = (b"inference-header-content-length", b"%d" % len(header))
            parts.insert(0, header)
            return HttpResponse(200, [_BINARY_CONTENT_TYPE, length], parts, done=release)
        return HttpResponse(200, _EMPTY_JSON, [header], done=release)

    # ---- bodies --------------------------------------------------------------------------------------------------
    async def read_body(self, request: HttpRequest) -> bytes | bytearray:
        """The request's body under the size limit, inflated if ``Content-Encoding`` says gzip or deflate."""
        limit = self.max_body_size
        body = await collect_body(request.body, declared=request.headers.get(b"content-length"), limit=limit)
        encoding = request.headers.get(b"content-encoding", b"identity").strip().lower()
        if encoding in (b"", b"identity"):
            return body
        if encoding not in (b"gzip", b"deflate"):
            raise BadRequest(f"unsupported Content-Encoding {encoding.decode('latin-1')!r} (use gzip or deflate)")
        inflater = zlib.decompressobj(wbits=31 if encoding == b"gzip" else 15)
        try:
            inflated = inflater.decompress(body, limit + 1)
        except zlib.error as exc:
            raise BadRequest(f"the {encoding.decode()} request body is corrupt: {exc}") from exc
        if len(inflated) > limit or inflater.unconsumed_tail:
            raise RequestTooLarge(f"the decompressed request body is over the {limit}-byte limit")
        if not inflater.eof:
            raise BadRequest(f"the {encoding.decode()} request body is truncated")
        return inflated

    async def _read_json(self, request: HttpRequest) -> dict[str, Any]:
        body = await self.read_body(request)
        if not body.strip():
            return {}
        try:
            document = orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            raise BadRequest(f"the request body is not valid JSON: {exc}") from exc
        if not isinstance(document, dict):
            raise BadRequest("the request body must be a JSON object")
        return document


def _load_parameters(parameters: dict[str, Any]) -> tuple[str | None, dict[str, bytes]]:
    import base64
    import binascii

    config: str | None = None
    files: dict[str, bytes] = {}
    for key, value in parameters.items():
        if key == "config":
            if not isinstance(value, str):
                raise BadRequest("load parameter 'config' must be a string holding the JSON model config")
            config = value
        elif key.startswith("file:"):
            if not isinstance(value, str):
                raise BadRequest(f"load parameter {key!r} must be a base64 string")
            try:
                files[key] = base64.b64decode(value, validate=True)
            except (binascii.Error, ValueError) as exc:
                raise BadRequest(f"load parameter {key!r} is not valid base64") from exc
        else:
            raise BadRequest(f"unknown load parameter {key!r} (expected 'config' or 'file:<version>/<path>')")
    return config, files


#: A request body at least this large has its outputs lent by the runner (`ServedVersion.lending`) rather than
#: copied out of its shared memory, when the transport says when the response is written: below it the outputs are
#: rarely large enough to lie in shared memory at all.
_LEND_BYTES = JOIN_ON_A_THREAD_BYTES

#: A JSON request header, or JSON response outputs, at least this large is decoded (encoded) on a worker thread:
#: below it, the thread hand-off would cost more than the event loop is held.
_OFF_LOOP_BYTES = 1 << 16


def _json_bytes(body: bytes | bytearray, header_length: bytes | None) -> int:
    """How many bytes of `body` are JSON (a malformed length counts as the whole body: the decoder refuses it)."""
    if header_length is not None and header_length.strip().isdigit():
        return min(int(header_length), len(body))
    return len(body)


def _json_output_bytes(request: InferBody, selected: list[tuple[str, Tensor]]) -> int:
    """The size of the outputs the response carries as JSON numbers (a bound on the work of writing them)."""
    if request.outputs is None:
        if request.binary_default:
            return 0  # the usual binary request: nothing to count
        binary_of = {}
    else:
        for _, binary in request.outputs:
            if not binary:
                break
        else:
            return 0  # every requested output is binary (what tritonclient sends)
        binary_of = dict(request.outputs)
    return sum(
        tensor.nbytes
        for name, tensor in selected
        if isinstance(tensor, np.ndarray) and not binary_of.get(name, request.binary_default)
    )


def _binary_head(header: bytes, parts: list[bytes | memoryview]) -> FixedHead:
    """The head of a response made of the binary inference `header` and its outputs' `parts`."""
    length = len(header) + sum(part.nbytes if isinstance(part, memoryview) else len(part) for part in parts)
    return FixedHead(200, [_BINARY_CONTENT_TYPE, (b"inference-header-content-length", b"%d" % len(header))], length)


def _expect(method: str, allowed: str) -> None:
    if method != allowed:
        raise _HttpError(405, f"method {method} is not allowed here (use {allowed})")


def _json(status: int, document: object) -> HttpResponse:
    return HttpResponse(status, _EMPTY_JSON, [orjson.dumps(document)])


def _stats(versions: list[ServedVersion]) -> HttpResponse:
    return _json(200, {"model_stats": [served.stats.to_json() for served in versions]})
