"""The KServe v2 gRPC messages: ``kserve_v2_pb2``, generated from ``kserve_v2.proto`` and committed.

The messages live in carton's own proto package ``carton.kserve.v2`` (file ``carton/server/_proto/kserve_v2.proto``)
rather than the protocol's ``inference`` package: tritonclient registers ``inference.*`` and ``grpc_service.proto``
in protobuf's process-wide descriptor pool, and a second registration of either makes whichever is imported last
fail with "duplicate file name"/"duplicate symbol". Message names never travel on the wire (protobuf encodes field
numbers only), and the service is served under its wire name `SERVICE_NAME`, so clients see the standard protocol.

``_generate`` regenerates the module (``python -m carton.server._proto``); a test checks that doing so changes
nothing. The module checks at import that the protobuf runtime is at least as new as its generator.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

from ..errors import ServerError

__all__ = ["PACKAGE", "SERVICE_NAME", "message_class", "messages"]

#: The service path clients call (``/inference.GRPCInferenceService/ModelInfer``): the protocol's, not our package's.
SERVICE_NAME = "inference.GRPCInferenceService"
#: The proto package our messages are registered under.
PACKAGE = "carton.kserve.v2"

_module: ModuleType | None = None


def messages() -> ModuleType:
    """The generated ``kserve_v2_pb2`` module; `ServerError` when the installed protobuf is too old for it."""
    global _module
    if _module is not None:
        return _module
    try:
        module = importlib.import_module(f"{__name__}.kserve_v2_pb2")
    except ModuleNotFoundError as exc:  # google.protobuf: the server extra is not installed
        raise ServerError(f"the gRPC endpoint needs {exc.name!r}: install carton-runtime[server]") from exc
    except Exception as exc:  # protobuf's VersionError: a runtime older than the stubs' generator
        from google.protobuf import __version__ as runtime

        raise ServerError(
            f"carton's gRPC stubs do not work with the installed protobuf {runtime}: {exc}; install the protobuf "
            "version the server extra asks for"
        ) from exc
    _module = module
    return module


def message_class(name: str) -> Any:
    """The message class ``carton.kserve.v2.<name>`` (a protobuf `Message` subclass)."""
    try:
        return getattr(messages(), name)
    except AttributeError:
        raise ServerError(f"the gRPC protocol has no message {name!r}") from None
