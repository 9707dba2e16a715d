"""Registering ``inference.GRPCInferenceService`` with Serve's gRPC proxy.

Serve's gRPC proxy takes "servicer functions" (``grpc_servicer_functions`` in ``serve.start``'s gRPC options or a
config file's ``grpc_options``), calls each with a placeholder servicer and its server, then replaces every
registered method's behaviour with a call to the method of the same name on the application's ingress. The function
below registers the protocol's unary methods under their wire names, without (de)serializers: the proxy hands the
request's bytes to the ingress, which parses them with carton's own messages (see ``carton.server._proto`` for why
they are not registered under the ``inference`` package) and returns the serialized response.
"""

from __future__ import annotations

from typing import Any

import grpc

from ..server._proto import SERVICE_NAME
from ._deployments import GRPC_METHODS

__all__ = ["add_GRPCInferenceServiceServicer_to_server"]


def add_GRPCInferenceServiceServicer_to_server(servicer: Any, server: grpc.Server) -> None:
    """Register the protocol's unary methods on `server` (Serve's gRPC proxy), as generated gRPC code does."""
    handlers = {method: grpc.unary_unary_rpc_method_handler(getattr(servicer, method)) for method in GRPC_METHODS}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
