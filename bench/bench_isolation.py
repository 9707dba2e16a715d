"""What a runner's own cgroup costs at start and close, against the same runner started without one.

    python bench/bench_isolation.py [--rounds N]

With a cgroup (docs/sandbox.md, "What each policy guarantees") the host creates ``runner-<n>`` under its
``carton-<pid>`` cgroup, starts ``/bin/sh`` that joins it and execs the runner, and on close writes ``cgroup.kill``,
waits for ``cgroup.events`` to say it is empty, and removes it. The reference, measured in the same run, starts the
same Echo runner (policy ``none``) with no cgroup: `RunnerProcess.start` to a completed handshake, then
`RunnerProcess.close`, rounds interleaved in alternating order. Printed: medians of the wall time of each step and
of the CPU time of the whole tree per start and close (``RUSAGE_CHILDREN``), and the load average before and after.
Needs a host that may create cgroups (root, or a delegated cgroup v2 subtree).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from carton._runtime import _process, cgroup_support
from carton._runtime._cgroups import RunnerCgroup, runner_cgroup
from carton._runtime._process import RunnerProcess
from carton_protocol import RunnerSpec

ROOT = Path(__file__).resolve().parent.parent
RUNNERS_DIR = ROOT / "tests" / "protocol"
SPEC = RunnerSpec(
    runner_name="bench-echo",
    framework_version="1.0.0",
    runner_compat_version=1,
    entry="runners_for_tests:Echo",
    env=(("PYTHONPATH", str(RUNNERS_DIR)),),
)


def _no_cgroup() -> RunnerCgroup | None:
    return None


VARIANTS: dict[str, Callable[[], RunnerCgroup | None]] = {"own cgroup": runner_cgroup, "reference": _no_cgroup}


def bench(rounds: int) -> dict[str, tuple[float, float, float]]:
    """Median start and close wall times, and median CPU of the whole tree, per variant, in milliseconds."""
    starts: dict[str, list[float]] = {label: [] for label in VARIANTS}
    closes: dict[str, list[float]] = {label: [] for label in VARIANTS}
    cpu: dict[str, list[float]] = {label: [] for label in VARIANTS}
    labels = list(VARIANTS)
    for round_index in range(rounds):
        for label in labels if round_index % 2 == 0 else labels[::-1]:
            _process.runner_cgroup = VARIANTS[label]  # type: ignore[assignment]
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            began = time.perf_counter()
            runner = RunnerProcess.start(SPEC)
            started = time.perf_counter()
            runner.close()
            closed = time.perf_counter()
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            starts[label].append(started - began)
            closes[label].append(closed - started)
            cpu[label].append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
    return {
        label: (
            statistics.median(starts[label]) * 1e3,
            statistics.median(closes[label]) * 1e3,
            statistics.median(cpu[label]) * 1e3,
        )
        for label in labels
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=30, help="start + close rounds per variant")
    args = parser.parse_args()
    support = cgroup_support()
    if not support.available:
        raise SystemExit(f"runners get no cgroup here: {support.detail}")
    load_before = os.getloadavg()
    RunnerProcess.start(SPEC).close()  # warm-up: imports, the cgroup probe and the guardian
    results = bench(args.rounds)
    load_after = os.getloadavg()
    print(f"## start and close, median of {args.rounds} interleaved rounds\n")
    print("| variant | start -> handshake | close | CPU of the tree per start + close |")
    print("|---|---|---|---|")
    for label, (start, close, cpu) in results.items():
        print(f"| {label} | {start:.1f} ms | {close:.1f} ms | {cpu:.1f} ms |")
    ref_start, ref_close, ref_cpu = results["reference"]
    start, close, cpu = results["own cgroup"]
    print(
        f"\nown cgroup - reference: start {start - ref_start:+.1f} ms, close {close - ref_close:+.1f} ms, "
        f"CPU {cpu - ref_cpu:+.1f} ms"
    )
    print(f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f}")


if __name__ == "__main__":
    main()
