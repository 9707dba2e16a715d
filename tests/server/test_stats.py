"""Per-version statistics (carton/server/_stats.py): the figures recorded per request are counted in batches, and
every reader (the statistics extension's JSON, the Prometheus collector, another process's series) sees all of them,
equal to counting each request as it came."""

from __future__ import annotations

import random
from bisect import bisect_left

from carton.server._stats import _BOUNDS_NS, ServerMetrics, VersionStats
from prometheus_client import generate_latest


def _expected_buckets(durations: list[int]) -> list[int]:
    buckets = [0] * (len(_BOUNDS_NS) + 1)
    for ns in durations:
        buckets[bisect_left(_BOUNDS_NS, ns)] += 1
    return buckets


def test_batched_counting_equals_counting_each_request() -> None:
    rng = random.Random(7)
    metrics = ServerMetrics()
    stats = VersionStats("m", "1", metrics)
    successes = [(rng.randrange(1, 3 * 10**9), rng.randrange(10**6), rng.randrange(10**6)) for _ in range(1000)]
    # Executions as the dynamic batcher records them (queue time, several requests, several batch sizes) and as a
    # model without batching does (one size, no queue); a bound's exact value lands in its own bucket.
    executions = [(rng.choice((1, 2, 8)), rng.randrange(1, 10**9), rng.choice((0, 250_000, 7)), rng.randrange(1, 4))
                  for _ in range(700)]  # fmt: skip
    executions += [(1, _BOUNDS_NS[3], 0, 1)] * 300
    for done, (total, input_ns, output_ns) in enumerate(successes):
        stats.record_success(total_ns=total, input_ns=input_ns, output_ns=output_ns, now_ns=done)
    for size, infer, queue, requests in executions:
        stats.record_execution(batch_size=size, infer_ns=infer, queue_ns=queue, requests=requests)
    body = stats.to_json()
    inference = body["inference_stats"]
    assert inference["success"] == {"count": 1000, "ns": sum(s[0] for s in successes)}
    assert inference["compute_input"] == {"count": 1000, "ns": sum(s[1] for s in successes)}
    assert inference["compute_output"] == {"count": 1000, "ns": sum(s[2] for s in successes)}
    assert inference["compute_infer"] == {"count": sum(e[3] for e in executions), "ns": sum(e[1] for e in executions)}
    queued = [e for e in executions if e[2]]
    assert inference["queue"] == {"count": sum(e[3] for e in queued), "ns": sum(e[2] for e in queued)}
    assert body["execution_count"] == 1000 and body["inference_count"] == sum(e[0] for e in executions)
    batch_stats = {entry["batch_size"]: entry["compute_infer"] for entry in body["batch_stats"]}
    assert batch_stats == {
        size: {"count": sum(1 for e in executions if e[0] == size), "ns": sum(e[1] for e in executions if e[0] == size)}
        for size in (1, 2, 8)
    }
    assert stats.last_inference_ms > 0
    series = stats.series
    assert (series.success, series.executions) == (1000, 1000)
    assert series.duration.buckets == _expected_buckets([s[0] for s in successes])
    assert series.duration.sum_ns == sum(s[0] for s in successes)
    assert series.compute.buckets == _expected_buckets([e[1] for e in executions])
    assert series.queue.buckets == _expected_buckets([e[2] for e in queued])


def test_every_reader_sees_the_requests_not_yet_counted() -> None:
    metrics = ServerMetrics()
    stats = VersionStats("m", "1", metrics)
    stats.record_success(total_ns=400_000, input_ns=1, output_ns=2, now_ns=5)
    stats.record_execution(batch_size=1, infer_ns=300_000)
    assert stats.success.count == 1 and stats.compute_infer.ns == 300_000 and stats.execution_count == 1
    stats.record_success(total_ns=400_000, input_ns=1, output_ns=2, now_ns=6)
    ((key, series),) = metrics.series_items()  # what another server process adds up
    assert key == ("m", "1") and series.success == 2
    # A reloaded version records into the same series: the scrape counts both versions' requests.
    again = VersionStats("m", "1", metrics)
    again.record_success(total_ns=400_000, input_ns=1, output_ns=2, now_ns=7)
    stats.record_success(total_ns=400_000, input_ns=1, output_ns=2, now_ns=8)
    text = generate_latest(metrics.registry).decode()
    assert 'carton_inference_requests_total{model="m",outcome="success",version="1"} 4.0' in text
    assert 'carton_inference_request_duration_seconds_bucket{le="0.0005",model="m",version="1"} 4.0' in text
    assert 'carton_inference_executions_total{model="m",version="1"} 1.0' in text
    assert stats.to_json()["inference_stats"]["success"]["count"] == 3
    assert again.to_json()["inference_stats"]["success"]["count"] == 1


def _without_clock(body: dict[str, object]) -> dict[str, object]:
    return {key: value for key, value in body.items() if key != "last_inference"}


def test_a_single_record_counts_as_a_success_and_an_execution() -> None:
    # `record_single` (a request run as an execution of its own) against the two records it stands for, mixed with
    # every other record and over several folds: the statistics extension's JSON and the scrape are the same.
    rng = random.Random(11)
    apart_metrics, single_metrics = ServerMetrics(), ServerMetrics()
    apart, single = VersionStats("m", "1", apart_metrics), VersionStats("m", "1", single_metrics)
    for done in range(3000):
        total, input_ns, output_ns = rng.randrange(1, 3 * 10**9), rng.randrange(10**6), rng.randrange(10**6)
        infer = rng.choice((rng.randrange(1, 10**9), _BOUNDS_NS[rng.randrange(len(_BOUNDS_NS))]))
        kind = rng.random()
        if kind < 0.8:
            apart.record_execution(batch_size=1, infer_ns=infer)
            apart.record_success(total_ns=total, input_ns=input_ns, output_ns=output_ns, now_ns=done)
            single.record_single(total_ns=total, input_ns=input_ns, output_ns=output_ns, infer_ns=infer, now_ns=done)
        elif kind < 0.9:  # a request that failed after its model ran
            for stats in (apart, single):
                stats.record_execution(batch_size=1, infer_ns=infer)
                stats.record_failure(total_ns=total, now_ns=done)
        else:  # another caller's records (gRPC, the dynamic batcher)
            for stats in (apart, single):
                stats.record_execution(batch_size=4, infer_ns=infer, queue_ns=input_ns, requests=2)
                stats.record_success(total_ns=total, input_ns=input_ns, output_ns=output_ns, now_ns=done)
        if done % 997 == 0:  # a reader in between
            assert _without_clock(single.to_json()) == _without_clock(apart.to_json())
    assert single.last_ns == apart.last_ns == 2999
    assert _without_clock(single.to_json()) == _without_clock(apart.to_json())
    assert single.to_json()["execution_count"] > 2000
    assert generate_latest(single_metrics.registry) == generate_latest(apart_metrics.registry)
