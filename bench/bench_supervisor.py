"""What the runner's supervisor costs: start-up and per request, against the same runner started unsupervised.

    python bench/bench_supervisor.py [--rounds N] [--calls N]

``python -m carton_protocol`` forks the runner at once and stays behind as its reaper (``_supervisor.py``). The
reference, measured in the same run, starts the same runner loop without the supervisor
(``python -c "from carton_protocol._loop import main; ..."``, same arguments, same clean environment).

1. fork: in a fresh interpreter that has imported only ``carton_protocol._supervisor`` (what the supervisor imports
   before it forks), the time from ``os.fork()`` to the child running, and that import's own time (``-X importtime``).
2. start: `RunnerProcess.start` to a completed handshake, supervised vs reference (rounds interleaved, alternating
   order), median; and the CPU time of the whole tree per start and close (``RUSAGE_CHILDREN``), less noisy.
3. infer: p50/p99 of a [1,16] float32 echo round trip, supervised vs reference (batches interleaved), and the ratio.
   The supervisor is not on the data path, so the ratio should be 1 within noise.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
from carton._runtime._launch import LaunchPlan
from carton._runtime._process import RunnerProcess
from carton_protocol import RunnerSpec

ROOT = Path(__file__).resolve().parent.parent
RUNNERS_DIR = ROOT / "tests" / "protocol"
SPEC = RunnerSpec(runner_name="bench-echo", framework_version="1.0.0", runner_compat_version=1,
                  entry="runners_for_tests:Echo", env=(("PYTHONPATH", str(RUNNERS_DIR)),))
UNSUPERVISED = "from carton_protocol._loop import main; raise SystemExit(main())"

FORK_SCRIPT = """
import os, sys, time
import carton_protocol._supervisor
samples = []
for _ in range(int(sys.argv[1])):
    read_end, write_end = os.pipe()
    started = time.perf_counter()
    child = os.fork()
    if child == 0:
        os.write(write_end, repr(time.perf_counter()).encode())
        os._exit(0)
    running = float(os.read(read_end, 64))
    os.waitpid(child, 0)
    os.close(read_end)
    os.close(write_end)
    samples.append(running - started)
samples.sort()
print(samples[len(samples) // 2] * 1e3, samples[int(len(samples) * 0.9)] * 1e3)
"""


def unsupervised(plan: LaunchPlan) -> LaunchPlan:
    at = plan.argv.index("-m")
    return replace(plan, argv=(plan.argv[0], "-c", UNSUPERVISED, *plan.argv[at + 2 :]))


VARIANTS: dict[str, Callable[[LaunchPlan], LaunchPlan] | None] = {"supervised": None, "reference": unsupervised}


def bench_fork(rounds: int) -> tuple[float, float, float]:
    out = subprocess.run([sys.executable, "-c", FORK_SCRIPT, str(rounds)], check=True, capture_output=True,
                         text=True, env={**os.environ, "PYTHONPATH": str(ROOT / "protocol")})
    p50, p90 = map(float, out.stdout.split())
    imports = subprocess.run([sys.executable, "-X", "importtime", "-c", "import carton_protocol._supervisor"],
                             check=True, capture_output=True, text=True,
                             env={**os.environ, "PYTHONPATH": str(ROOT / "protocol")}).stderr
    own = [line for line in imports.splitlines() if line.rstrip().endswith("carton_protocol._supervisor")]
    import_ms = int(own[-1].split("|")[1]) / 1e3 if own else float("nan")
    return p50, p90, import_ms


def bench_start(rounds: int) -> dict[str, tuple[float, float]]:
    """Median wall time from start to handshake, and median CPU time of the whole process tree per start+close."""
    import resource

    wall: dict[str, list[float]] = {label: [] for label in VARIANTS}
    cpu: dict[str, list[float]] = {label: [] for label in VARIANTS}
    labels = list(VARIANTS)
    for round_index in range(rounds):
        for label in labels if round_index % 2 == 0 else labels[::-1]:  # interleaved, alternating order
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            started = time.perf_counter()
            runner = RunnerProcess.start(SPEC, wrap=VARIANTS[label])
            wall[label].append(time.perf_counter() - started)
            runner.close()
            after = resource.getrusage(resource.RUSAGE_CHILDREN)  # the supervisor's usage includes the runner's
            cpu[label].append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
    return {label: (statistics.median(wall[label]) * 1e3, statistics.median(cpu[label]) * 1e3) for label in labels}


def bench_infer(calls: int) -> dict[str, tuple[float, float]]:
    x = {"x": np.ones((1, 16), np.float32)}
    runners = {label: RunnerProcess.start(SPEC, wrap=wrap) for label, wrap in VARIANTS.items()}
    samples: dict[str, list[float]] = {label: [] for label in runners}
    try:
        for runner in runners.values():
            runner.load(model_dir=RUNNERS_DIR, opts={}, inputs=(), outputs=())
            for _ in range(200):
                runner.infer(x)  # warm-up
        batch = 500
        for _ in range(max(1, calls // batch)):
            for label, runner in runners.items():
                for _ in range(batch):
                    started = time.perf_counter()
                    runner.infer(x)
                    samples[label].append(time.perf_counter() - started)
    finally:
        for runner in runners.values():
            runner.close()
    out = {}
    for label, values in samples.items():
        values.sort()
        out[label] = (values[len(values) // 2] * 1e6, values[int(len(values) * 0.99)] * 1e6)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=30, help="start-up rounds per variant")
    parser.add_argument("--calls", type=int, default=10000, help="infer calls per variant")
    args = parser.parse_args()

    fork_p50, fork_p90, import_ms = bench_fork(200)
    print("## fork (supervisor's only start-up work on the runner's path)\n")
    print("| what | time |\n|---|---|")
    print(f"| `os.fork()` to child running, p50 / p90 (200 forks) | {fork_p50:.3f} / {fork_p90:.3f} ms |")
    print(f"| import of `carton_protocol._supervisor` (its own, `-X importtime`) | {import_ms:.3f} ms |\n")

    start = bench_start(args.rounds)
    print(f"## start to handshake, median of {args.rounds} interleaved rounds\n")
    print("| variant | start -> handshake | vs reference | CPU of the tree per start + close | vs reference |")
    print("|---|---|---|---|---|")
    wall_ref, cpu_ref = start["reference"]
    for label, (wall, cpu) in start.items():
        print(f"| {label} | {wall:.1f} ms | {wall - wall_ref:+.1f} ms | {cpu:.1f} ms | {cpu - cpu_ref:+.1f} ms |")

    infer = bench_infer(args.calls)
    print(f"\n## infer [1,16] float32 echo, {args.calls} calls per variant in interleaved batches\n")
    print("| variant | p50 | p99 | p50 / reference |\n|---|---|---|---|")
    for label, (p50, p99) in infer.items():
        print(f"| {label} | {p50:.1f} us | {p99:.1f} us | {p50 / infer['reference'][0]:.2f} |")


if __name__ == "__main__":
    main()
