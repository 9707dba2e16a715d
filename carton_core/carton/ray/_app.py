"""`build_app`: the application Ray Serve runs (``serve run carton.ray:build_app repository=PATH``)."""

from __future__ import annotations

from collections.abc import Mapping

from ray import serve
from ray.serve import Application

from ._deployments import CartonIngress, CartonModels
from ._index import ReplicaReports
from ._options import parse_app_args

__all__ = ["build_app"]

#: Seconds between a model replica's health checks, which are also its reports to the index.
_HEALTH_CHECK_PERIOD = 2.0


def build_app(args: Mapping[str, object]) -> Application:
    """The carton application for `args` (Ray's application-builder convention: ``key=value`` strings).

    ``serve.run(carton.ray.build_app({"repository": "models/", "num_replicas": "2"}))`` or, from a shell,
    ``serve run carton.ray:build_app repository=models/ num_replicas=2``. Keys: see `AppOptions`; an unknown key, a
    missing ``repository`` or a bad value raises `BuildAppError` naming the key."""
    options = parse_app_args(args)
    reports = serve.deployment(name="CartonReplicaReports", num_replicas=1, ray_actor_options={"num_cpus": 0})(
        ReplicaReports
    ).bind()
    models = serve.deployment(
        name="CartonModels",
        health_check_period_s=_HEALTH_CHECK_PERIOD,
        max_ongoing_requests=64,
        **options.replica_options(),
    )(CartonModels).bind(options, reports)
    ingress = serve.deployment(
        name="CartonIngress",
        num_replicas=options.ingress_replicas,
        ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=1024,
    )(CartonIngress)
    return ingress.bind(options, models, reports)
