"""Sandbox benchmarks: what each policy costs, `none` vs `best_effort` vs `strict`, measured in one run.

    python bench/bench_sandbox.py [--quick] [--rounds N]

1. load: time from `carton.load_unpacked` to the first inference answered (runner start, shim, namespaces, Landlock,
   seccomp, model load), median over N rounds, and the difference to `none`. The one-time machine probe
   (`carton doctor`'s, cached per process) is run before timing and reported separately.
2. infer: p50/p99 of a [1,16] float32 `Model.infer` round trip under each policy, and the ratio to `none`.
The issue's goal: `strict` adds under 100 ms to load and nothing measurable to `infer`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import carton
import numpy as np
from carton._runtime import plugin_manager
from carton._sandbox import machine_support
from carton_protocol import DType, RunnerSpec, TensorSpec, hookimpl

ROOT = Path(__file__).resolve().parent.parent
RUNNERS_DIR = ROOT / "tests" / "runtime"
POLICIES = ("none", "best_effort", "strict")


class BenchPlugin:
    @hookimpl
    def carton_runners(self) -> list[RunnerSpec]:
        return [RunnerSpec(runner_name="bench-affine", framework_version="1.0.0", runner_compat_version=1,
                           entry="runtime_test_runners:Affine", concurrent=True,
                           env=(("PYTHONPATH", str(RUNNERS_DIR)),))]


def load(model_dir: Path, policy: str) -> carton.Model:
    return carton.load_unpacked(
        model_dir, runner_name="bench-affine", required_framework_version="1", sandbox=policy,
        inputs=[TensorSpec(name="x", dtype=DType.FLOAT32, shape=("batch", "n"))],
        outputs=[TensorSpec(name="y", dtype=DType.FLOAT32, shape=("batch", "n")),
                 TensorSpec(name="pid", dtype=DType.INT64, shape=())],
    )


def bench_load(model_dir: Path, rounds: int) -> dict[str, float]:
    x = np.ones((1, 16), np.float32)
    samples: dict[str, list[float]] = {policy: [] for policy in POLICIES}
    for _ in range(rounds):
        for policy in POLICIES:  # interleaved, so machine noise hits every policy alike
            started = time.perf_counter()
            model = load(model_dir, policy)
            model.infer({"x": x})
            samples[policy].append(time.perf_counter() - started)
            model.close()
    return {policy: statistics.median(values) for policy, values in samples.items()}


def bench_infer(model_dir: Path, calls: int) -> dict[str, tuple[float, float]]:
    x = np.ones((1, 16), np.float32)
    models = {policy: load(model_dir, policy) for policy in POLICIES}
    samples: dict[str, list[float]] = {policy: [] for policy in POLICIES}
    try:
        for model in models.values():
            for _ in range(200):
                model.infer({"x": x})
        for _ in range(calls):
            for policy, model in models.items():
                started = time.perf_counter()
                model.infer({"x": x})
                samples[policy].append(time.perf_counter() - started)
    finally:
        for model in models.values():
            model.close()
    result = {}
    for policy, values in samples.items():
        values.sort()
        result[policy] = (values[len(values) // 2], values[int(len(values) * 0.99)])
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer rounds and calls")
    parser.add_argument("--rounds", type=int, default=None, help="load rounds per policy (default 15, quick 4)")
    args = parser.parse_args()
    rounds = args.rounds or (4 if args.quick else 15)
    calls = 1000 if args.quick else 5000
    warnings.simplefilter("ignore")
    plugin_manager().register(BenchPlugin(), name="bench-sandbox")

    started = time.perf_counter()
    support = machine_support()
    probe = time.perf_counter() - started
    backend = support.backend()
    layers = support.layers(backend)
    missing = [status.layer.value for status in layers if not status.available]
    print(f"backend: {backend.value if backend else 'none'}; missing layers: {', '.join(missing) or 'none'}; "
          f"one-time machine probe: {probe * 1000:.0f} ms")
    if missing:
        print("strict cannot start on this machine; run `carton doctor`", file=sys.stderr)
        return 1

    with tempfile.TemporaryDirectory(prefix="bench-sandbox-") as root:
        model_dir = Path(root) / "model"
        model_dir.mkdir()
        (model_dir / "offset.txt").write_text("0.5")
        load(model_dir, "strict").close()  # warm the page cache for every policy alike

        loads = bench_load(model_dir, rounds)
        print(f"\nload -> first inference, median of {rounds} rounds")
        print(f"{'policy':<12} {'ms':>8} {'+ms vs none':>12}")
        for policy in POLICIES:
            print(f"{policy:<12} {loads[policy] * 1000:>8.1f} {(loads[policy] - loads['none']) * 1000:>+12.1f}")

        infers = bench_infer(model_dir, calls)
        print(f"\ninfer [1,16] float32, {calls} calls per policy (interleaved)")
        print(f"{'policy':<12} {'p50 us':>8} {'p99 us':>8} {'p50 / none':>11}")
        for policy in POLICIES:
            p50, p99 = infers[policy]
            print(f"{policy:<12} {p50 * 1e6:>8.1f} {p99 * 1e6:>8.1f} {p50 / infers['none'][0]:>11.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
