"""Per-version inference statistics (Triton's statistics extension) and the Prometheus metrics behind ``/metrics``.

Both are recorded in one place per request, with label children resolved once per loaded version so that the hot
path pays a few additions and three histogram observations.

Durations, as the statistics extension defines them for carton: ``queue`` is time waiting in the dynamic batcher,
``compute_input`` decoding the request into arrays, ``compute_infer`` the runner round trip, ``compute_output``
encoding the response; ``success``/``fail`` are whole requests as the server saw them.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

__all__ = ["ServerMetrics", "VersionStats"]

_LATENCY_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.00075, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip


class ServerMetrics:
    """The Prometheus metrics of one server, in a registry of their own (several servers may share a process)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        labels = ("model", "version")
        self.requests = Counter(
            "carton_inference_requests",
            "Inference requests handled, by outcome (success or failure).",
            (*labels, "outcome"),
            registry=self.registry,
        )
        self.executions = Counter(
            "carton_inference_executions",
            "Model executions (a dynamic batch counts once).",
            labels,
            registry=self.registry,
        )
        self.request_duration = Histogram(
            "carton_inference_request_duration_seconds",
            "Time from a request's arrival to its response being ready, server side.",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.queue_duration = Histogram(
            "carton_inference_queue_duration_seconds",
            "Time requests waited in the dynamic batcher before running.",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.compute_duration = Histogram(
            "carton_inference_compute_duration_seconds",
            "Time of the runner round trip (the model's computation and the transfer to and from its process).",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.in_flight = Gauge(
            "carton_inference_in_flight",
            "Inference requests currently being handled.",
            labels,
            registry=self.registry,
        )
        self.rejected = Counter(
            "carton_http_requests_rejected",
            "Requests refused before reaching a model, by HTTP status.",
            ("status",),
            registry=self.registry,
        )

    def forget(self, model: str, version: str) -> None:
        """Drop a version's series once it is unloaded (a reload starts them again from zero, like its statistics)."""
        for metric in (
            self.executions, self.request_duration, self.queue_duration, self.compute_duration, self.in_flight,
        ):  # fmt: skip
            with contextlib.suppress(KeyError):
                metric.remove(model, version)
        for outcome in ("success", "failure"):
            with contextlib.suppress(KeyError):
                self.requests.remove(model, version, outcome)


class _Duration:
    __slots__ = ("count", "ns")

    def __init__(self) -> None:
        self.count = 0
        self.ns = 0

    def add(self, ns: int, count: int = 1) -> None:
        self.count += count
        self.ns += ns

    def to_json(self) -> dict[str, int]:
        return {"count": self.count, "ns": self.ns}


class _BatchStats:
    __slots__ = ("compute_infer", "compute_input", "compute_output")

    def __init__(self) -> None:
        self.compute_input = _Duration()
        self.compute_infer = _Duration()
        self.compute_output = _Duration()


class VersionStats:
    """Counters of one loaded model version."""

    __slots__ = (
        "_compute", "_duration", "_executions", "_failure", "_queue", "_success", "batches", "compute_infer",
        "compute_input", "compute_output", "execution_count", "fail", "in_flight", "inference_count",
        "last_inference_ms", "model", "queue", "success", "version",
    )  # fmt: skip

    def __init__(self, model: str, version: str, metrics: ServerMetrics) -> None:
        self.model = model
        self.version = version
        self.last_inference_ms = 0
        self.inference_count = 0
        self.execution_count = 0
        self.success = _Duration()
        self.fail = _Duration()
        self.queue = _Duration()
        self.compute_input = _Duration()
        self.compute_infer = _Duration()
        self.compute_output = _Duration()
        self.batches: dict[int, _BatchStats] = {}
        self._success = metrics.requests.labels(model, version, "success")
        self._failure = metrics.requests.labels(model, version, "failure")
        self._executions = metrics.executions.labels(model, version)
        self._duration = metrics.request_duration.labels(model, version)
        self._queue = metrics.queue_duration.labels(model, version)
        self._compute = metrics.compute_duration.labels(model, version)
        self.in_flight = metrics.in_flight.labels(model, version)

    def record_execution(self, *, batch_size: int, infer_ns: int, queue_ns: int = 0, requests: int = 1) -> None:
        """One model execution over `batch_size` elements gathered from `requests` requests."""
        self.execution_count += 1
        self.inference_count += batch_size
        self.compute_infer.add(infer_ns, requests)
        if queue_ns:
            self.queue.add(queue_ns, requests)
            self._queue.observe(queue_ns / 1e9)
        batch = self.batches.get(batch_size)
        if batch is None:
            batch = self.batches[batch_size] = _BatchStats()
        batch.compute_infer.add(infer_ns)
        self._executions.inc()
        self._compute.observe(infer_ns / 1e9)

    def record_success(self, *, total_ns: int, input_ns: int, output_ns: int) -> None:
        self.last_inference_ms = time.time_ns() // 1_000_000
        self.success.add(total_ns)
        self.compute_input.add(input_ns)
        self.compute_output.add(output_ns)
        self._success.inc()
        self._duration.observe(total_ns / 1e9)

    def record_failure(self, *, total_ns: int) -> None:
        self.last_inference_ms = time.time_ns() // 1_000_000
        self.fail.add(total_ns)
        self._failure.inc()
        self._duration.observe(total_ns / 1e9)

    def to_json(self) -> dict[str, Any]:
        """The version's entry of ``model_stats`` as Triton's statistics extension lays it out."""
        zero = _Duration().to_json()
        return {
            "name": self.model,
            "version": self.version,
            "last_inference": self.last_inference_ms,
            "inference_count": self.inference_count,
            "execution_count": self.execution_count,
            "inference_stats": {
                "success": self.success.to_json(),
                "fail": self.fail.to_json(),
                "queue": self.queue.to_json(),
                "compute_input": self.compute_input.to_json(),
                "compute_infer": self.compute_infer.to_json(),
                "compute_output": self.compute_output.to_json(),
                "cache_hit": zero,
                "cache_miss": zero,
            },
            "batch_stats": [
                {
                    "batch_size": size,
                    "compute_input": batch.compute_input.to_json(),
                    "compute_infer": batch.compute_infer.to_json(),
                    "compute_output": batch.compute_output.to_json(),
                }
                for size, batch in sorted(self.batches.items())
            ],
        }
