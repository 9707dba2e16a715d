"""`carton.ray.build_app`'s arguments and the merged repository index, without a cluster."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("ray.serve")

from carton.ray import AppOptions, BuildAppError, build_app, parse_app_args
from carton.ray._index import ReplicaReports, failed, merge_index, reportable


def test_arguments_are_parsed_and_checked(tmp_path: Path) -> None:
    options = parse_app_args(
        {"repository": str(tmp_path), "num_replicas": "2", "max_models_per_replica": "2", "num_cpus": "0.5",
         "memory": "2g", "memory_limit": "512m", "request_timeout": "5", "sandbox": "strict", "strict_readiness": "1"}
    )  # fmt: skip
    assert options == AppOptions(
        repository=tmp_path, num_replicas=2, max_models_per_replica=2, num_cpus=0.5, memory=2 << 30,
        memory_limit=512 << 20, request_timeout=5.0, sandbox="strict", strict_readiness=True,
    )  # fmt: skip
    assert options.replica_options() == {"ray_actor_options": {"num_cpus": 0.5, "memory": 2 << 30}, "num_replicas": 2}
    scaled = parse_app_args({"repository": f"file://{tmp_path}", "min_replicas": "1", "max_replicas": "4"})
    assert scaled.replica_options()["autoscaling_config"] == {
        "min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 2.0,
    }  # fmt: skip


@pytest.mark.parametrize(
    ("args", "key", "words"),
    [
        ({"num_replicas": "two"}, "num_replicas", "'two' is not a whole number"),
        ({"num_replicas": "0"}, "num_replicas", "must be at least 1"),
        ({"ingress_replicas": "1.5"}, "ingress_replicas", "'1.5' is not a whole number"),
        ({"replicas": "2"}, "replicas", "unknown key"),
        ({"max_models_per_replica": "-1"}, "max_models_per_replica", "must be at least 1"),
        ({"memory": "lots"}, "memory", "is not a size"),
        ({"num_cpus": "nan"}, "num_cpus", "non-negative number"),
        ({"sandbox": "tight"}, "sandbox", "not one of none, best_effort, strict"),
        ({"strict_readiness": "maybe"}, "strict_readiness", "is not true or false"),
        ({"num_replicas": "2", "max_replicas": "3"}, "num_replicas", "either num_replicas or min_replicas"),
        ({"min_replicas": "3", "max_replicas": "2"}, "min_replicas", "more than max_replicas"),
        ({"target_ongoing_requests": "4"}, "target_ongoing_requests", "only applies with"),
    ],
)
def test_bad_arguments_name_the_key(tmp_path: Path, args: dict[str, str], key: str, words: str) -> None:
    with pytest.raises(BuildAppError) as caught:
        build_app({"repository": str(tmp_path), **args})
    assert caught.value.key == key and words in str(caught.value) and f"{key!r}" in str(caught.value)
    assert isinstance(caught.value, ValueError)


def test_the_repository_is_required_and_must_be_a_folder(tmp_path: Path) -> None:
    with pytest.raises(BuildAppError, match="'repository': is required"):
        build_app({"num_replicas": "1"})
    with pytest.raises(BuildAppError, match="is not a folder"):
        build_app({"repository": str(tmp_path / "missing")})
    with pytest.raises(BuildAppError, match="s3:// repositories are not supported"):
        build_app({"repository": "s3://bucket/models"})
    with pytest.raises(BuildAppError, match="is not a URL of a folder of cartons"):
        build_app({"repository": "https://example.invalid/models?list=1"})
    assert parse_app_args({"repository": "https://example.invalid/models/"}).repository == (
        "https://example.invalid/models"
    )


def test_merged_index_takes_each_versions_best_state_across_replicas() -> None:
    replica_a = [{"name": "m", "version": "1", "state": "READY"}, {"name": "x", "version": "1", "state": "LOADING"}]
    replica_b = [
        {"name": "m", "version": "1", "state": "UNAVAILABLE", "reason": "crashed"},
        {"name": "bad", "state": "UNAVAILABLE", "reason": "config.json: 'max_batch_size' must be an integer"},
    ]
    merged = merge_index(["m", "x", "bad", "idle"], [replica_a, replica_b], ready_only=False)
    assert merged == [
        {"name": "bad", "state": "UNAVAILABLE", "reason": "config.json: 'max_batch_size' must be an integer"},
        {"name": "idle"},
        {"name": "m", "version": "1", "state": "READY"},
        {"name": "x", "version": "1", "state": "LOADING"},
    ]
    assert merge_index(["m", "idle"], [replica_a], ready_only=True) == [{"name": "m", "version": "1", "state": "READY"}]
    assert failed(merged) and not failed(merge_index(["m"], [replica_a], ready_only=False)[:1])
    # An LRU unload is not reported (the model loads again on demand); a bare name carries no state.
    evicted = {"name": "b", "version": "1", "state": "UNAVAILABLE", "reason": "unloaded"}
    assert reportable([{"name": "a"}, evicted]) == []


def test_reports_of_silent_replicas_expire(monkeypatch: pytest.MonkeyPatch) -> None:
    from carton.ray import _index

    clock = [100.0]
    monkeypatch.setattr(_index.time, "monotonic", lambda: clock[0])
    reports = ReplicaReports()
    reports.report("a", [{"name": "m", "version": "1", "state": "READY"}])
    reports.report("b", [])
    clock[0] += _index.REPORT_TTL / 2
    reports.report("b", [])
    reports.forget("gone")
    clock[0] += _index.REPORT_TTL / 2 + 1
    assert list(reports.live()) == ["b"]
