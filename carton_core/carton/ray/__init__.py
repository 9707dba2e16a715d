"""The model repository on Ray Serve: ``carton serve``'s protocol, repository layout and isolation, scaled out.

    serve run carton.ray:build_app repository=/shared/models num_replicas=2 max_models_per_replica=2

    from ray import serve
    import carton.ray
    serve.run(carton.ray.build_app({"repository": "/shared/models", "num_replicas": "2"}), route_prefix="/")

Serve's HTTP proxy then speaks the KServe v2 / Triton HTTP protocol at route prefix ``/`` (tritonclient.http works
unchanged); with ``grpc_servicer_functions=["carton.ray.add_GRPCInferenceServiceServicer_to_server"]`` in Serve's
gRPC options, its gRPC proxy carries ``inference.GRPCInferenceService`` too. Models are multiplexed across replicas by
name. Needs the ``ray`` extra (``pip install "carton-runtime[ray]"``). See docs/scale-out.md.
"""

from ._app import build_app
from ._grpc import add_GRPCInferenceServiceServicer_to_server
from ._options import AppOptions, BuildAppError, parse_app_args

__all__ = ["AppOptions", "BuildAppError", "add_GRPCInferenceServiceServicer_to_server", "build_app", "parse_app_args"]
