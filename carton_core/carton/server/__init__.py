"""carton's model server: the KServe v2 / Triton protocol over HTTP and gRPC for a repository of cartons.

    from carton.server import ServerOptions, serve_in_thread
    with serve_in_thread(ServerOptions(repository=Path("models"), http_port=0, grpc_port=0)) as server:
        ...  # tritonclient.http.InferenceServerClient(f"127.0.0.1:{server.http_port}")

`carton serve REPO` runs `run_server`. See docs/server.md for the endpoints, the repository layout and the config.
"""

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
