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

import numpy as np
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

__all__ = ["ServerMetrics", "VersionStats"]

_LATENCY_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.00075, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
_BOUNDS_NS = tuple(int(bound * 1e9) for bound in _LATENCY_BUCKETS)
_BOUNDS = np.array(_BOUNDS_NS, dtype=np.int64)
_FOLD_AT = 1024  # recorded figures kept before they are counted (a few hundred requests)
_BUCKET_LABELS = (*(repr(bound) for bound in _LATENCY_BUCKETS), "+Inf")


class _Histogram:
    __slots__ = ("buckets", "sum_ns")

    def __init__(self) -> None:
        self.buckets = [0] * (len(_BOUNDS_NS) + 1)  # per bucket, not cumulative; the last is +Inf
        self.sum_ns = 0

    def observe(self, ns: int) -> None:
        """Count one duration."""
        self.buckets[bisect_left(_BOUNDS_NS, ns)] += 1
        self.sum_ns += ns

    def observe_all(self, durations: list[int], total_ns: int) -> None:
        """Count `durations`, whose sum is `total_ns`."""
        counts = np.bincount(np.searchsorted(_BOUNDS, durations, side="left"), minlength=len(self.buckets))
        for index, count in enumerate(counts.tolist()):
            self.buckets[index] += count
        self.sum_ns += total_ns

    def add_to(self, family: HistogramMetricFamily, labels: list[str]) -> None:
        cumulative, total = [], 0
        for label, count in zip(_BUCKET_LABELS, self.buckets, strict=True):
            total += count
            cumulative.append((label, float(total)))
        family.add_metric(labels, cumulative, self.sum_ns / 1e9)


class _Series:
    """The Prometheus series of one (model, version); a reloaded version keeps recording into the same one."""

    __slots__ = ("compute", "duration", "executions", "failure", "in_flight", "queue", "success", "unfolded")

    def __init__(self) -> None:
        self.success = 0
        self.failure = 0
        self.executions = 0
        self.in_flight = 0
        self.duration = _Histogram()
        self.queue = _Histogram()
        self.compute = _Histogram()
        #: The version statistics recording into this series with figures not yet counted (`VersionStats.fold`).
        self.unfolded: set[VersionStats] = set()

    def fold(self) -> None:
        """Count every figure recorded into this series so far."""
        for stats in list(self.unfolded):
            stats.fold()


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
            series.fold()
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
        for series in self._series.values():
            series.fold()
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
        """Count one duration."""
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
    """Counters of one loaded model version.

    Successful requests and model executions, recorded on every request, are kept as their raw figures and counted
    in batches (`fold`): when enough have gathered, and before anything reads the counters (their attributes, `to_json`,
    the Prometheus collector and `ServerMetrics.series_items` fold first), so every reader sees every request."""

    __slots__ = (
        "_batches", "_compute_infer", "_compute_input", "_compute_output", "_execution_count", "_executions",
        "_inference_count", "_queue", "_singles", "_success", "_successes", "fail", "last_ns", "model", "series",
        "version",
    )  # fmt: skip

    def __init__(self, model: str, version: str, metrics: ServerMetrics) -> None:
        self.model = model
        self.version = version
        #: `time.perf_counter_ns()` at the end of the last inference (None: none yet).
        self.last_ns: int | None = None
        self._inference_count = 0
        self._execution_count = 0
        self._success = _Duration()
        self.fail = _Duration()
        self._queue = _Duration()
        self._compute_input = _Duration()
        self._compute_infer = _Duration()
        self._compute_output = _Duration()
        self._batches: dict[int, _BatchStats] = {}
        self.series = metrics.series(model, version)
        self._successes: list[int] = []  # per success not yet counted: total, input and output ns
        self._executions: list[int] = []  # per execution not yet counted: batch size, infer ns, queue ns, requests
        #: per successful request that was an execution of its own (batch size 1, not queued) not yet counted:
        #: total, input, output and infer ns
        self._singles: list[int] = []

    # The records below run on every request: each keeps its figures with one list extension (and, when the list
    # was empty, marks the series as having figures to fold); `fold` counts them, a few hundred at a time, with
    # array operations instead of a dozen attribute updates and a bisection per request.

    def record_execution(self, *, batch_size: int, infer_ns: int, queue_ns: int = 0, requests: int = 1) -> None:
        """One model execution over `batch_size` elements gathered from `requests` requests."""
        pending = self._executions
        if not pending:
            self.series.unfolded.add(self)
        pending += (batch_size, infer_ns, queue_ns, requests)
        if len(pending) >= _FOLD_AT:
            self.fold()

    def record_success(self, *, total_ns: int, input_ns: int, output_ns: int, now_ns: int) -> None:
        """Count a successful inference and its durations (nanoseconds: in total, decoding inputs, encoding outputs)
        ending at `now_ns` (``time.perf_counter_ns()``)."""
        self.last_ns = now_ns
        pending = self._successes
        if not pending:
            self.series.unfolded.add(self)
        pending += (total_ns, input_ns, output_ns)
        if len(pending) >= _FOLD_AT:
            self.fold()

    def record_single(self, *, total_ns: int, input_ns: int, output_ns: int, infer_ns: int, now_ns: int) -> None:
        """Count a successful inference that was a model execution of its own (batch size 1, not queued): what
        `record_execution` and `record_success` count for it, in one record."""
        self.last_ns = now_ns
        pending = self._singles
        if not pending:
            self.series.unfolded.add(self)
        pending += (total_ns, input_ns, output_ns, infer_ns)
        if len(pending) >= _FOLD_AT:
            self.fold()

    def fold(self) -> None:
        """Count the successes and executions recorded since the last fold."""
        self.series.unfolded.discard(self)
        if singles := self._singles:  # each a success and an execution of batch size 1
            self._singles = []
            self._count_successes(singles[0::4], sum(singles[1::4]), sum(singles[2::4]))
            infers = singles[3::4]
            count = len(infers)
            self._inference_count += count
            self._count_executions(count, infers, {1: (count, sum(infers))}, count)
        if successes := self._successes:
            self._successes = []
            self._count_successes(successes[0::3], sum(successes[1::3]), sum(successes[2::3]))
        if executions := self._executions:
            self._executions = []
            sizes, infers, queues, requests = (executions[at::4] for at in range(4))
            self._inference_count += sum(sizes)
            if any(queues):  # executions of the dynamic batcher
                queued = [(ns, count) for ns, count in zip(queues, requests, strict=True) if ns]
                queue_ns = sum(ns for ns, _ in queued)
                self._queue.count += sum(count for _, count in queued)
                self._queue.ns += queue_ns
                self.series.queue.observe_all([ns for ns, _ in queued], queue_ns)
            if sizes.count(sizes[0]) == len(sizes):  # one batch size throughout, as a model without batching has
                by_size = {sizes[0]: (len(sizes), sum(infers))}
            else:
                by_size = {}
                for size, ns in zip(sizes, infers, strict=True):
                    count, total = by_size.get(size, (0, 0))
                    by_size[size] = (count + 1, total + ns)
            self._count_executions(len(sizes), infers, by_size, sum(requests))

    def _count_successes(self, totals: list[int], input_ns: int, output_ns: int) -> None:
        """Count successes taking `totals` (ns each), and `input_ns` and `output_ns` in all."""
        count = len(totals)
        total_ns = sum(totals)
        self._success.count += count
        self._success.ns += total_ns
        self._compute_input.count += count
        self._compute_input.ns += input_ns
        self._compute_output.count += count
        self._compute_output.ns += output_ns
        self.series.success += count
        self.series.duration.observe_all(totals, total_ns)

    def _count_executions(
        self, count: int, infers: list[int], by_size: dict[int, tuple[int, int]], requests: int
    ) -> None:
        """Count `count` executions taking `infers` (ns each) for `requests` requests; `by_size` holds, per batch
        size, how many there were and their ns in all."""
        infer_ns = sum(infers)
        self._execution_count += count
        self._compute_infer.count += requests
        self._compute_infer.ns += infer_ns
        self.series.executions += count
        self.series.compute.observe_all(infers, infer_ns)
        for size, (executions, total) in by_size.items():
            batch = self._batches.get(size)
            if batch is None:
                batch = self._batches[size] = _BatchStats()
            batch.compute_infer.count += executions
            batch.compute_infer.ns += total

    @property
    def inference_count(self) -> int:
        self.fold()
        return self._inference_count

    @property
    def execution_count(self) -> int:
        self.fold()
        return self._execution_count

    @property
    def success(self) -> _Duration:
        self.fold()
        return self._success

    @property
    def queue(self) -> _Duration:
        self.fold()
        return self._queue

    @property
    def compute_input(self) -> _Duration:
        self.fold()
        return self._compute_input

    @property
    def compute_infer(self) -> _Duration:
        self.fold()
        return self._compute_infer

    @property
    def compute_output(self) -> _Duration:
        self.fold()
        return self._compute_output

    @property
    def batches(self) -> dict[int, _BatchStats]:
        self.fold()
        return self._batches

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
        self.fold()
        zero = _Duration().to_json()
        return {
            "name": self.model,
            "version": self.version,
            "last_inference": self.last_inference_ms,
            "inference_count": self._inference_count,
            "execution_count": self._execution_count,
            "inference_stats": {
                "success": self._success.to_json(),
                "fail": self.fail.to_json(),
                "queue": self._queue.to_json(),
                "compute_input": self._compute_input.to_json(),
                "compute_infer": self._compute_infer.to_json(),
                "compute_output": self._compute_output.to_json(),
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
                for size, batch in sorted(self._batches.items())
            ],
        }
