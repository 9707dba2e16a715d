"""The HTTP/REST endpoints of the KServe v2 protocol and its Triton extensions, as one ASGI application.

Routing is done on the raw request path, split on ``/`` before percent-decoding, so an encoded slash (``%2F``) stays
inside its segment and is then refused by the model-name rules instead of silently changing the route. The body is
read with the size limit enforced from ``Content-Length`` before any byte is read, and while reading otherwise
(chunked bodies); ``Content-Encoding: gzip``/``deflate`` (what tritonclient's request compression sends) is inflated
under the same limit.
"""

from __future__ import annotations

import logging
import time
import zlib
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

import orjson
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ._config import ModelConfig
from ._datatypes import DATATYPE_OF
from ._handle import metadata_shape
from ._http_codec import encode_infer_response, parse_infer_request
from ._inference import request_failed, request_succeeded, select_outputs
from ._repository import ModelRepository, ServedVersion
from ._stats import ServerMetrics
from .errors import BadRequest, RequestTooLarge, ServerError

__all__ = ["EXTENSIONS", "HttpApp", "Message", "Receive", "Scope", "Send", "model_config_json", "model_metadata_json"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

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


@dataclass(slots=True)
class _Request:
    method: str
    segments: list[str]
    headers: dict[bytes, bytes]


class HttpApp:
    """The ASGI application; `repository` does the work, this class speaks HTTP."""

    def __init__(
        self,
        repository: ModelRepository,
        metrics: ServerMetrics,
        *,
        max_body_size: int,
        server_version: str,
    ) -> None:
        self.repository = repository
        self.metrics = metrics
        self.max_body_size = max_body_size
        self.server_version = server_version

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        raw_path: bytes = scope.get("raw_path") or scope["path"].encode()
        path = raw_path.split(b"?", 1)[0].decode("latin-1")
        request = _Request(
            method=scope["method"],
            segments=[unquote(part, errors="replace") for part in path.split("/")[1:]],
            headers=dict(scope["headers"]),
        )
        try:
            await self._route(request, receive, send)
        except _HttpError as exc:
            await self._reject(send, exc.status, str(exc))
        except ServerError as exc:
            # Composed by the server from names, numbers and already-scrubbed foreign text (`translate_error`, the
            # repository's load errors): scrubbing again would mangle names the client chose, such as 'file:/etc/x'.
            await self._reject(send, exc.http_status, str(exc))

    async def _reject(self, send: Send, status: int, message: str) -> None:
        self.metrics.rejected.labels(str(status)).inc()
        await _send_json(send, status, {"error": message})

    # ---- routing -------------------------------------------------------------------------------------------------
    async def _route(self, request: _Request, receive: Receive, send: Send) -> None:
        segments, method = request.segments, request.method
        if segments == ["metrics"]:
            _expect(method, "GET")
            body = generate_latest(self.metrics.registry)
            await _send(send, 200, [(b"content-type", CONTENT_TYPE_LATEST.encode())], [body])
            return
        if not segments or segments[0] != "v2":
            raise _HttpError(404, "Not Found")
        rest = segments[1:]
        if not rest or rest == [""]:
            _expect(method, "GET")
            await _send_json(send, 200, {"name": "carton", "version": self.server_version, "extensions": EXTENSIONS})
            return
        head = rest[0]
        if head == "health" and len(rest) == 2 and rest[1] in ("live", "ready"):
            _expect(method, "GET")
            ok = rest[1] == "live" or self.repository.is_ready()
            await _send(send, 200 if ok else 400, [], [b""])
            return
        if head == "models":
            await self._models(request, rest[1:], receive, send)
            return
        if head == "repository":
            await self._repository(request, rest[1:], receive, send)
            return
        if head in _UNSUPPORTED:
            raise _HttpError(501, f"the {_UNSUPPORTED[head]} extension is not supported by this server")
        raise _HttpError(404, "Not Found")

    async def _models(self, request: _Request, rest: list[str], receive: Receive, send: Send) -> None:
        method = request.method
        if rest == ["stats"]:
            _expect(method, "GET")
            await self._stats(send, self.repository.all_served())
            return
        if not rest:
            raise _HttpError(404, "Not Found")
        name, rest = rest[0], rest[1:]
        version = ""
        if len(rest) >= 2 and rest[0] == "versions":
            version, rest = rest[1], rest[2:]
        action = rest[0] if rest else ""
        if len(rest) > 1 or action not in ("", "ready", "config", "stats", "infer"):
            raise _HttpError(404, "Not Found")
        if action == "infer":
            _expect(method, "POST")
            await self._infer(request, name, version, receive, send)
            return
        _expect(method, "GET")
        if action == "ready":
            ready = self.repository.model_ready(name, version)
            await _send(send, 200 if ready else 400, [], [b""])
            return
        served = self.repository.get(name, version)
        if action == "":
            versions = [v.version_str for v in self.repository.versions(name)]
            await _send_json(send, 200, model_metadata_json(served, versions))
        elif action == "config":
            await _send_json(send, 200, model_config_json(served, self.repository.options.workers))
        else:
            chosen = [served] if version else self.repository.versions(name)
            await self._stats(send, chosen)

    async def _stats(self, send: Send, versions: list[ServedVersion]) -> None:
        await _send_json(send, 200, {"model_stats": [served.stats.to_json() for served in versions]})

    async def _repository(self, request: _Request, rest: list[str], receive: Receive, send: Send) -> None:
        _expect(request.method, "POST")
        if rest == ["index"]:
            body = await self._read_json(request, receive)
            ready = body.get("ready", False)
            if not isinstance(ready, bool):
                raise BadRequest("'ready' must be true or false")
            await _send_json(send, 200, self.repository.index(ready_only=ready))
            return
        if len(rest) != 3 or rest[0] != "models" or rest[2] not in ("load", "unload"):
            raise _HttpError(404, "Not Found")
        name, action = rest[1], rest[2]
        body = await self._read_json(request, receive)
        parameters = body.get("parameters", {})
        if not isinstance(parameters, dict):
            raise BadRequest("'parameters' must be a JSON object")
        if action == "unload":
            dependents = parameters.get("unload_dependents", False)
            if not isinstance(dependents, bool):
                raise BadRequest("'unload_dependents' must be true or false")
            await self.repository.unload(name, unload_dependents=dependents)
        else:
            config, files = _load_parameters(parameters)
            await self.repository.load(name, config=config, files=files)
        await _send(send, 200, [(b"content-type", b"application/json")], [b""])

    # ---- inference (the hot path) --------------------------------------------------------------------------------
    async def _infer(self, request: _Request, name: str, version: str, receive: Receive, send: Send) -> None:
        started = time.perf_counter_ns()
        served = self.repository.acquire(name, version)
        try:
            body = await self._read_body(request, receive)
            decoded = parse_infer_request(served, body, request.headers.get(b"inference-header-content-length"))
            decoded_at = time.perf_counter_ns()
            outputs, _ = await served.infer(decoded.inputs)
            inferred_at = time.perf_counter_ns()
            requested = [output for output, _ in decoded.outputs] if decoded.outputs is not None else None
            header, parts = encode_infer_response(served, decoded, select_outputs(served, outputs, requested))
        except Exception as exc:
            raise request_failed(served, exc, self.repository.scrub, started_ns=started) from exc
        request_succeeded(served, started_ns=started, decoded_ns=decoded_at, inferred_ns=inferred_at)
        if parts:
            headers = [
                (b"content-type", b"application/octet-stream"),
                (b"inference-header-content-length", str(len(header)).encode()),
            ]
            await _send(send, 200, headers, [header, *parts])
        else:
            await _send(send, 200, [(b"content-type", b"application/json")], [header])

    # ---- bodies --------------------------------------------------------------------------------------------------
    async def _read_body(self, request: _Request, receive: Receive) -> bytes | bytearray:
        limit = self.max_body_size
        declared = request.headers.get(b"content-length")
        if declared is not None:
            if not declared.strip().isdigit():
                raise BadRequest("Content-Length is not a number")
            if int(declared) > limit:
                raise RequestTooLarge(f"request body of {int(declared)} bytes is over the {limit}-byte limit")
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise BadRequest("the client disconnected before sending the whole body")
            chunk = message.get("body", b"")
            if chunk:
                size += len(chunk)
                if size > limit:
                    raise RequestTooLarge(f"request body is over the {limit}-byte limit")
                chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body: bytes | bytearray = chunks[0] if len(chunks) == 1 else b"".join(chunks)
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

    async def _read_json(self, request: _Request, receive: Receive) -> dict[str, Any]:
        body = await self._read_body(request, receive)
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


def _expect(method: str, allowed: str) -> None:
    if method != allowed:
        raise _HttpError(405, f"method {method} is not allowed here (use {allowed})")


async def _send(send: Send, status: int, headers: list[tuple[bytes, bytes]], parts: list[Any]) -> None:
    length = sum(len(part) if isinstance(part, bytes) else part.nbytes for part in parts)
    await send(
        {"type": "http.response.start", "status": status, "headers": [*headers, (b"content-length", b"%d" % length)]}
    )
    last = len(parts) - 1
    for index, part in enumerate(parts):
        await send({"type": "http.response.body", "body": part, "more_body": index < last})


async def _send_json(send: Send, status: int, document: object) -> None:
    body = orjson.dumps(document)
    await _send(send, status, [(b"content-type", b"application/json")], [body])
