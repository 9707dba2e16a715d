"""Per-version inference statistics (Triton's statistics extension) and the Prometheus metrics behind ``/metrics``.

The hot path pays plain integer additions only: each (model, version) has a `_Series` of counters and histogram
buckets that the event loop updates in place (every request is recorded on the loop thread), and a collector turns
them into Prometheus families when ``/metrics`` is scraped. prometheus_client's own metric objects take a lock and
run label checks on every increment, which measured about 7 us of CPU per request here; this costs under 1 us.

Durations, as the statistics extension defines them for carton: ``queue`` is time waiting in the dynamic batcher,
``compute_input`` decoding the request into arrays, ``compute_infer`` the runner round trip, ``compute_output``
encoding the response; ``success``/``fail`` are whole requests as the server saw them.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

__all__ = ["ServerMetrics", "VersionStats"]

_LATENCY_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.00075, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
_BOUNDS_NS = tuple(int(bound * 1e9) for bound in _LATENCY_BUCKETS)
_BUCKET_LABELS = (*(repr(bound) for bound in _LATENCY_BUCKETS), "+Inf")


class _Histogram:
    __slots__ = ("buckets", "sum_ns")

    def __init__(self) -> None:
        self.buckets = [0] * (len(_BOUNDS_NS) + 1)  # per bucket, not cumulative; the last is +Inf
        self.sum_ns = 0

    def observe(self, ns: int) -> None:
        """Count one duration (the hot paths of `VersionStats` write this out in place)."""
        self.buckets[bisect_left(_BOUNDS_NS, ns)] += 1
        self.sum_ns += ns

    def add_to(self, family: HistogramMetricFamily, labels: list[str]) -> None:
        cumulative, total = [], 0
        for label, count in zip(_BUCKET_LABELS, self.buckets, strict=True):
            total += count
            cumulative.append((label, float(total)))
        family.add_metric(labels, cumulative, self.sum_ns / 1e9)


class _Series:
    """The Prometheus series of one (model, version); a reloaded version keeps recording into the same one."""

    __slots__ = ("compute", "duration", "executions", "failure", "in_flight", "queue", "success")

    def __init__(self) -> None:
        self.success = 0
        self.failure = 0
        self.executions = 0
        self.in_flight = 0
        self.duration = _Histogram()
        self.queue = _Histogram()
        self.compute = _Histogram()


class _SeriesCollector(Collector):
    def __init__(self, series: dict[tuple[str, str], _Series]) -> None:
        self._series = series

    def collect(self) -> Iterator[Metric]:
        labels = ["model", "version"]
        requests = CounterMetricFamily(
            "carton_inference_requests", "Inference requests handled, by outcome (success or failure).",
            labels=[*labels, "outcome"],
        )  # fmt: skip
        executions = CounterMetricFamily(
            "carton_inference_executions", "Model executions (a dynamic batch counts once).", labels=labels
        )
        duration = HistogramMetricFamily(
            "carton_inference_request_duration_seconds",
            "Time from a request's arrival to its response being ready, server side.", labels=labels,
        )  # fmt: skip
        queue = HistogramMetricFamily(
            "carton_inference_queue_duration_seconds",
            "Time requests waited in the dynamic batcher before running.", labels=labels,
        )  # fmt: skip
        compute = HistogramMetricFamily(
            "carton_inference_compute_duration_seconds",
            "Time of the runner round trip (the model's computation and the transfer to and from its process).",
            labels=labels,
        )
        in_flight = GaugeMetricFamily(
            "carton_inference_in_flight", "Inference requests currently being handled.", labels=labels
        )
        for (model, version), series in sorted(self._series.items()):
            key = [model, version]
            requests.add_metric([*key, "success"], series.success)
            requests.add_metric([*key, "failure"], series.failure)
            executions.add_metric(key, series.executions)
            series.duration.add_to(duration, key)
            series.queue.add_to(queue, key)
            series.compute.add_to(compute, key)
            in_flight.add_metric(key, series.in_flight)
        yield from (requests, executions, duration, queue, compute, in_flight)


class ServerMetrics:
    """The Prometheus metrics of one server, in a registry of their own (several servers may share a process)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self._series: dict[tuple[str, str], _Series] = {}
        self.registry.register(_SeriesCollector(self._series))
        self.rejected = Counter(
            "carton_http_requests_rejected",
            "Requests refused before reaching a model, by HTTP status.",
            ("status",),
            registry=self.registry,
        )

    def series(self, model: str, version: str) -> _Series:
        """The Prometheus series of one model version (made on first use)."""
        found = self._series.get((model, version))
        if found is None:
            found = self._series[(model, version)] = _Series()
        return found

    def series_items(self) -> list[tuple[tuple[str, str], _Series]]:
        """Every (model, version) and its series (what another server process adds up, see ``_process_wire``)."""
        return list(self._series.items())

    def forget(self, model: str, version: str) -> None:
        """Drop a version's series once it is unloaded (a reload starts them again from zero, like its statistics)."""
        self._series.pop((model, version), None)


class _Duration:
    __slots__ = ("count", "ns")

    def __init__(self) -> None:
        self.count = 0
        self.ns = 0

    def add(self, ns: int) -> None:
        """Count one duration (the hot paths of `VersionStats` write this out in place)."""
        self.count += 1
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
        "batches", "compute_infer", "compute_input", "compute_output", "execution_count", "fail", "inference_count",
        "last_ns", "model", "queue", "series", "success", "version",
    )  # fmt: skip

    def __init__(self, model: str, version: str, metrics: ServerMetrics) -> None:
        self.model = model
        self.version = version
        #: `time.perf_counter_ns()` at the end of the last inference (None: none yet).
        self.last_ns: int | None = None
        self.inference_count = 0
        self.execution_count = 0
        self.success = _Duration()
        self.fail = _Duration()
        self.queue = _Duration()
        self.compute_input = _Duration()
        self.compute_infer = _Duration()
        self.compute_output = _Duration()
        self.batches: dict[int, _BatchStats] = {}
        self.series = metrics.series(model, version)

    # The two updates below run on every successful request: their counters are written out in place (an attribute
    # per counter, the histogram's bucket found with `bisect_left`), without a method call per duration or
    # histogram, and the wall clock of `last_inference` is read only when the statistics are (`last_inference_ms`).

    def record_execution(self, *, batch_size: int, infer_ns: int, queue_ns: int = 0, requests: int = 1) -> None:
        """One model execution over `batch_size` elements gathered from `requests` requests."""
        self.execution_count += 1
        self.inference_count += batch_size
        infer = self.compute_infer
        infer.count += requests
        infer.ns += infer_ns
        series = self.series
        if queue_ns:
            queue = self.queue
            queue.count += requests
            queue.ns += queue_ns
            histogram = series.queue
            histogram.buckets[bisect_left(_BOUNDS_NS, queue_ns)] += 1
            histogram.sum_ns += queue_ns
        batch = self.batches.get(batch_size)
        if batch is None:
            batch = self.batches[batch_size] = _BatchStats()
        infer = batch.compute_infer
        infer.count += 1
        infer.ns += infer_ns
        series.executions += 1
        histogram = series.compute
        histogram.buckets[bisect_left(_BOUNDS_NS, infer_ns)] += 1
        histogram.sum_ns += infer_ns

    def record_success(self, *, total_ns: int, input_ns: int, output_ns: int, now_ns: int) -> None:
        """Count a successful inference and its durations (nanoseconds: in total, decoding inputs, encoding outputs)
        ending at `now_ns` (``time.perf_counter_ns()``)."""
        self.last_ns = now_ns
        success = self.success
        success.count += 1
        success.ns += total_ns
        duration = self.compute_input
        duration.count += 1
        duration.ns += input_ns
        duration = self.compute_output
        duration.count += 1
        duration.ns += output_ns
        series = self.series
        series.success += 1
        histogram = series.duration
        histogram.buckets[bisect_left(_BOUNDS_NS, total_ns)] += 1
        histogram.sum_ns += total_ns

    def record_failure(self, *, total_ns: int, now_ns: int) -> None:
        """Count a failed inference and how long it took (nanoseconds), ending at `now_ns`
        (``time.perf_counter_ns()``)."""
        self.last_ns = now_ns
        self.fail.add(total_ns)
        self.series.failure += 1
        self.series.duration.observe(total_ns)

    @property
    def last_inference_ms(self) -> int:
        """When the last inference ended, in milliseconds since the epoch (0: none yet)."""
        if self.last_ns is None:
            return 0
        return (time.time_ns() - time.perf_counter_ns() + self.last_ns) // 1_000_000

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
