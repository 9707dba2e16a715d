"""The server benchmark's goal table (bench/bench_server.py's `print_goals`): a goal row is judged, an explaining row
(`Sense.SHOWN`, the clients' CPU under a throughput row) shows its ratio and interval and is never judged."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from . import BENCH, load_bench_script

bench_server = load_bench_script("bench_server.py")


def _rounds(
    carton: dict[str, list[float]], triton: dict[str, list[float]]
) -> list[dict[str, dict[str, tuple[float, float]]]]:
    count = len(next(iter(carton.values())))
    return [
        {
            "carton": {key: (values[i], 1.0) for key, values in carton.items()},
            "triton": {key: (values[i], 1.0) for key, values in triton.items()},
        }
        for i in range(count)
    ]


def _row(output: str, label: str) -> list[str]:
    (line,) = [line for line in output.splitlines() if line.startswith(label)]
    return line[len(label) :].split()


def test_a_throughput_row_is_judged_and_its_client_rows_are_shown(capsys: pytest.CaptureFixture[str]) -> None:
    rounds = _rounds(
        {"http_rate": [110.0] * 8, "http_client8": [90.0] * 8, "http_both8": [150.0] * 8},
        {"http_rate": [100.0] * 8, "http_client8": [100.0] * 8, "http_both8": [200.0] * 8},
    )
    bench_server.print_goals(rounds)
    output = capsys.readouterr().out
    rate = _row(output, "HTTP throughput, 8 clients")
    assert rate[:6] == ["req/s", "110.000", "100.000", "1.10x", ">=1x", "yes"]
    assert rate[6] == "8/8"
    client = _row(output, "  client CPU per request (8 threads)")
    # unit, carton, Triton, ratio, round ratios, interval, load: no bound, no verdict, no rounds met.
    assert client == ["us", "90.000", "100.000", "0.90x", "0.90-0.90x", "0.90-0.90x", "1.00"]
    both = _row(output, "  client + server CPU per request")
    assert both[:4] == ["us", "150.000", "200.000", "0.75x"]
    assert "yes" not in both and "no" not in both


@pytest.mark.parametrize(
    ("key", "label", "marked"),
    [
        ("http_rate", "HTTP throughput, 8 clients", True),
        ("http_client8", "  client CPU per request (8 threads)", False),
    ],
)
def test_an_interval_across_one_is_marked_unresolved_on_goal_rows_only(
    capsys: pytest.CaptureFixture[str], key: str, label: str, marked: bool
) -> None:
    carton = [80.0, 90.0, 95.0, 105.0, 110.0, 120.0, 85.0, 115.0]
    bench_server.print_goals(_rounds({key: carton}, {key: [100.0] * 8}))
    interval = _row(capsys.readouterr().out, label)[-2]
    low, high = (float(x) for x in interval.rstrip("?").rstrip("x").split("-"))
    assert low < 1.0 < high
    assert interval.endswith("?") is marked


def test_a_shown_row_is_not_a_goal() -> None:
    shown = bench_server.GOALS["http_client8"]
    assert shown.sense is bench_server.Sense.SHOWN
    assert shown.bound_text() == ""
    with pytest.raises(ValueError, match="not a goal"):
        shown.meets(1.0, 1.0)


def test_every_eight_client_throughput_row_has_its_client_rows_beneath() -> None:
    keys = list(bench_server.GOALS)
    for rate, client, both in (
        ("http_rate", "http_client8", "http_both8"),
        ("grpc_rate", "grpc_client8", "grpc_both8"),
        ("http_rate_procs", "http_client8_procs", "http_both8_procs"),
        ("grpc_rate_procs", "grpc_client8_procs", "grpc_both8_procs"),
    ):
        at = keys.index(rate)
        assert keys[at + 1 : at + 3] == [client, both]
        assert bench_server.GOALS[rate].sense is bench_server.Sense.AT_LEAST


def test_saved_rounds_read_back_as_written(tmp_path: Path) -> None:
    rounds = _rounds({"http_rate": [110.0, 90.5], "http_p50": [0.25, 0.3]}, {"http_rate": [100.0, 101.0]})
    path = tmp_path / "rounds.json"
    bench_server.save_rounds(rounds, path)
    assert bench_server.load_rounds(path) == rounds


@pytest.mark.parametrize(
    "text",
    [
        "",
        "[]",
        '{"format": "carton-bench-server-rounds/2", "rounds": []}',
        '{"format": "carton-bench-server-rounds/1"}',
        '{"format": "carton-bench-server-rounds/1", "rounds": [1]}',
        '{"format": "carton-bench-server-rounds/1", "rounds": [{"carton": [1.0, 1.0]}]}',
        '{"format": "carton-bench-server-rounds/1", "rounds": [{"carton": {"http_rate": [1.0]}}]}',
        '{"format": "carton-bench-server-rounds/1", "rounds": [{"carton": {"http_rate": ["fast", 1.0]}}]}',
    ],
)
def test_a_file_that_is_not_saved_rounds_is_refused_by_name(tmp_path: Path, text: str) -> None:
    path = tmp_path / "not-rounds.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=r"not-rounds\.json: not a file of saved rounds"):
        bench_server.load_rounds(path)


def test_rounds_from_saved_runs_are_judged_together(tmp_path: Path) -> None:
    # Two saved runs whose medians miss and meet the goal alone; together, their rounds' median meets it.
    first, second = tmp_path / "first.json", tmp_path / "second.json"
    for path, carton in ((first, [95.0, 96.0, 130.0]), (second, [120.0, 125.0, 110.0])):
        rounds = [{"carton": {"http_rate": [c, 1.0]}, "triton": {"http_rate": [100.0, 1.0]}} for c in carton]
        path.write_text(json.dumps({"format": "carton-bench-server-rounds/1", "rounds": rounds}))
    done = subprocess.run(
        [sys.executable, str(BENCH / "bench_server.py"), "--rounds-from", str(first), str(second)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "6 rounds from 2 saved run(s)" in done.stdout
    rate = _row(done.stdout, "HTTP throughput, 8 clients")
    assert rate[3:7] == ["1.15x", ">=1x", "yes", "4/6"]
    bad = subprocess.run(
        [sys.executable, str(BENCH / "bench_server.py"), "--rounds-from", str(tmp_path / "missing.json")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert bad.returncode == 2
    assert "missing.json: not a file of saved rounds" in bad.stderr
    assert "Traceback" not in bad.stderr
