"""carton's model server: the KServe v2 / Triton protocol over HTTP and gRPC for a repository of cartons.

    from carton.server import ServerOptions, serve_in_thread
    with serve_in_thread(ServerOptions(repository=Path("models"), http_port=0, grpc_port=0)) as server:
        ...  # tritonclient.http.InferenceServerClient(f"127.0.0.1:{server.http_port}")

`carton serve REPO` runs `run_server`. See docs/server.md for the endpoints, the repository layout and the config;
`carton.server.errors` holds the server's exceptions and what each is answered with.

The names below are imported on first use (PEP 562), so that ``carton.server.errors`` (and ``carton.BadRequest``)
need none of the server's dependencies.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._config import DynamicBatching, ModelConfig, VersionPolicy, parse_config
    from ._handle import LoadSpec, ModelHandle, ModelLoader, load_carton
    from ._repository import ModelRepository, ModelState, RepositoryOptions
    from ._server import ModelControlMode, Server, ServerOptions, run_server, serve_in_thread

__all__ = [
    "DynamicBatching",
    "LoadSpec",
    "ModelConfig",
    "ModelControlMode",
    "ModelHandle",
    "ModelLoader",
    "ModelRepository",
    "ModelState",
    "RepositoryOptions",
    "Server",
    "ServerOptions",
    "VersionPolicy",
    "load_carton",
    "parse_config",
    "run_server",
    "serve_in_thread",
]

#: Where each public name lives.
_SOURCES = {
    "DynamicBatching": "._config",
    "ModelConfig": "._config",
    "VersionPolicy": "._config",
    "parse_config": "._config",
    "LoadSpec": "._handle",
    "ModelHandle": "._handle",
    "ModelLoader": "._handle",
    "load_carton": "._handle",
    "ModelRepository": "._repository",
    "ModelState": "._repository",
    "RepositoryOptions": "._repository",
    "ModelControlMode": "._server",
    "Server": "._server",
    "ServerOptions": "._server",
    "run_server": "._server",
    "serve_in_thread": "._server",
}


def __getattr__(name: str) -> Any:
    source = _SOURCES.get(name)
    if source is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(source, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
