"""`HttpApp.handle`, the transport-independent HTTP call: a whole body or a chunk reader, the size limit before and
while reading, and the front app that answers server-wide endpoints from a `ServerControl` and forwards the rest."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

import orjson
import pytest
from carton.server._http import HttpApp
from carton.server._http_messages import HttpRequest, HttpResponse
from carton.server._stats import ServerMetrics
from carton.server.errors import RepositoryError


class _Control:
    def __init__(self) -> None:
        self.loaded: list[str] = []

    async def is_ready(self) -> bool:
        return True

    async def index(self, *, ready_only: bool) -> list[dict[str, str]]:
        return [{"name": "m", "version": "1", "state": "READY"}]

    async def load(self, name: str, *, config: str | None, files: Mapping[str, bytes]) -> None:
        self.loaded.append(name)

    async def unload(self, name: str, *, unload_dependents: bool) -> None:
        raise RepositoryError(f"failed to unload {name!r}: not here")


def _front(limit: int = 64) -> tuple[HttpApp, list[tuple[str, str | None, bytes]]]:
    forwarded: list[tuple[str, str | None, bytes]] = []

    async def forward(request: HttpRequest, model: str | None) -> HttpResponse:
        body = request.body if isinstance(request.body, bytes) else b"<reader>"
        forwarded.append((request.raw_path.decode(), model, body))
        return HttpResponse(299, [(b"x-forwarded", b"1")], [b"from ", memoryview(b"replica")])

    return HttpApp.front(_Control(), forward, max_body_size=limit, server_version="t"), forwarded


def _call(app: HttpApp, method: str, path: str, body: bytes = b"", **headers: str) -> HttpResponse:
    raw = {key.replace("_", "-").encode(): value.encode() for key, value in headers.items()}
    return asyncio.run(app.handle(HttpRequest(method=method, raw_path=path.encode(), headers=raw, body=body)))


def test_front_app_answers_server_wide_endpoints_and_forwards_model_requests() -> None:
    app, forwarded = _front()
    assert _call(app, "GET", "/v2/health/ready").status == 200
    assert orjson.loads(_call(app, "GET", "/v2").body())["name"] == "carton"
    index = _call(app, "POST", "/v2/repository/index", b"{}")
    assert orjson.loads(index.body()) == [{"name": "m", "version": "1", "state": "READY"}]
    assert _call(app, "POST", "/v2/repository/models/m/load").status == 200
    refused = _call(app, "POST", "/v2/repository/models/m/unload")
    assert (refused.status, orjson.loads(refused.body())) == (400, {"error": "failed to unload 'm': not here"})
    response = _call(app, "POST", "/v2/models/m/versions/1/infer?x=1", b"{}")
    assert (response.status, response.content_length(), response.body()) == (299, 12, b"from replica")
    _call(app, "GET", "/v2/models/stats")
    _call(app, "GET", "/metrics")
    assert forwarded == [
        ("/v2/models/m/versions/1/infer?x=1", "m", b"{}"),
        ("/v2/models/stats", None, b""),
        ("/metrics", None, b""),
    ]
    # Routing errors are answered before anything is forwarded, as carton serve answers them.
    assert _call(app, "GET", "/v2/models/m/infer").status == 405
    assert _call(app, "GET", "/v2/models/m/bogus").status == 404
    assert _call(app, "GET", "/v2/trace/setting").status == 501
    assert len(forwarded) == 3


def test_body_limits_apply_to_whole_bodies_and_readers() -> None:
    app, _ = _front(limit=8)
    too_large = _call(app, "POST", "/v2/repository/index", b"{" + b" " * 10 + b"}")
    assert too_large.status == 413 and b"over the 8-byte limit" in too_large.body()
    declared = _call(app, "POST", "/v2/repository/index", b"{}", content_length="100")
    assert declared.status == 413 and b"100 bytes" in declared.body()
    chunks = [b"{", b"}"]
    reads: list[int] = []

    async def reader() -> tuple[bytes, bool]:
        reads.append(1)
        return chunks.pop(0), bool(chunks)

    request = HttpRequest(method="POST", raw_path=b"/v2/repository/index", headers={}, body=reader)
    assert asyncio.run(app.handle(request)).status == 200 and len(reads) == 2


def test_a_reader_is_not_read_for_a_request_refused_by_its_route() -> None:
    app, _ = _front()

    async def reader() -> tuple[bytes, bool]:
        raise AssertionError("the body was read")

    request = HttpRequest(method="POST", raw_path=b"/v2/nothing", headers={}, body=reader)
    assert asyncio.run(app.handle(request)).status == 404


def test_an_app_needs_models_or_a_forward() -> None:
    with pytest.raises(ValueError, match="repository or a control"):
        HttpApp(None, ServerMetrics(), max_body_size=1, server_version="t")
    with pytest.raises(ValueError, match="must forward"):
        HttpApp(None, ServerMetrics(), max_body_size=1, server_version="t", control=_Control())
