"""Sandbox benchmarks: what each policy costs, `none` vs `best_effort` vs `strict`, measured in one run.

    python bench/bench_sandbox.py [--quick] [--rounds N]

`strict` is measured once per namespace backend this machine can use (`strict/bwrap`, `strict/unshare`, the
latter being the shim's own namespaces and private root); `best_effort` uses the default backend. The spare-runner
pool is disabled (``CARTON_SPARE_RUNNERS=0``): it serves only unsandboxed loads, so with it `none` would skip the
runner start that every sandboxed load pays, and its background starts would add noise to the other rows.
1. load: time from `carton.load_unpacked` to the first inference answered (runner start, shim, namespaces, Landlock,
   seccomp, model load), median over N rounds, and the difference to `none`. The one-time machine probe
   (`carton doctor`'s, cached per process) is run before timing and reported separately.
2. infer: p50/p99 of a [1,16] float32 `Model.infer` round trip under each policy, and the ratio to `none`.
The issue's goal: `strict` adds under 100 ms to load and nothing measurable to `infer`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import carton
import numpy as np
from carton._runtime import plugin_manager
from carton._runtime._spares import SPARE_RUNNERS_ENV
from carton._sandbox import BACKEND_ENV, Backend, machine_support
from carton_protocol import DType, RunnerSpec, TensorSpec, hookimpl

ROOT = Path(__file__).resolve().parent.parent
RUNNERS_DIR = ROOT / "tests" / "runtime"
#: (label, policy, forced backend); strict rows are added per usable backend in `main`.
Variant = tuple[str, str, Backend | None]


class BenchPlugin:
    @hookimpl
    def carton_runners(self) -> list[RunnerSpec]:
        return [RunnerSpec(runner_name="bench-affine", framework_version="1.0.0", runner_compat_version=1,
                           entry="runtime_test_runners:Affine", concurrent=True,
                           env=(("PYTHONPATH", str(RUNNERS_DIR)),))]


def load(model_dir: Path, variant: Variant) -> carton.Model:
    _, policy, backend = variant
    if backend is None:
        os.environ.pop(BACKEND_ENV, None)
    else:
        os.environ[BACKEND_ENV] = backend.value  # read by each load's sandbox setup
    return carton.load_unpacked(
        model_dir, runner_name="bench-affine", required_framework_version="1", sandbox=policy,
        inputs=[TensorSpec(name="x", dtype=DType.FLOAT32, shape=("batch", "n"))],
        outputs=[TensorSpec(name="y", dtype=DType.FLOAT32, shape=("batch", "n")),
                 TensorSpec(name="pid", dtype=DType.INT64, shape=())],
    )


def bench_load(model_dir: Path, variants: list[Variant], rounds: int) -> dict[str, float]:
    x = np.ones((1, 16), np.float32)
    samples: dict[str, list[float]] = {variant[0]: [] for variant in variants}
    for _ in range(rounds):
        for variant in variants:  # interleaved, so machine noise hits every policy alike
            started = time.perf_counter()
            model = load(model_dir, variant)
            model.infer({"x": x})
            samples[variant[0]].append(time.perf_counter() - started)
            model.close()
    return {label: statistics.median(values) for label, values in samples.items()}


def bench_infer(model_dir: Path, variants: list[Variant], calls: int) -> dict[str, tuple[float, float]]:
    x = np.ones((1, 16), np.float32)
    models = {variant[0]: load(model_dir, variant) for variant in variants}
    samples: dict[str, list[float]] = {label: [] for label in models}
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
    os.environ[SPARE_RUNNERS_ENV] = "0"
    plugin_manager().register(BenchPlugin(), name="bench-sandbox")

    started = time.perf_counter()
    support = machine_support()
    probe = time.perf_counter() - started
    variants: list[Variant] = [("none", "none", None), ("best_effort", "best_effort", None)]
    for backend in Backend:
        if support.backends[backend] is not None:
            print(f"backend {backend.value}: unusable ({support.backends[backend]})")
            continue
        missing = [status.layer.value for status in support.layers(backend) if not status.available]
        print(f"backend {backend.value}: missing layers: {', '.join(missing) or 'none'}")
        if not missing:
            variants.append((f"strict/{backend.value}", "strict", backend))
    default = support.backend()
    print(f"default backend: {default.value if default else 'none'}; one-time machine probe: {probe * 1000:.0f} ms")
    if len(variants) == 2:
        print("strict cannot start on this machine; run `carton doctor`", file=sys.stderr)
        return 1

    with tempfile.TemporaryDirectory(prefix="bench-sandbox-") as root:
        model_dir = Path(root) / "model"
        model_dir.mkdir()
        (model_dir / "offset.txt").write_text("0.5")
        for variant in variants:
            load(model_dir, variant).close()  # warm the page cache for every policy alike

        loads = bench_load(model_dir, variants, rounds)
        print(f"\nload -> first inference, median of {rounds} rounds")
        print(f"{'policy':<16} {'ms':>8} {'+ms vs none':>12}")
        for label, ms in loads.items():
            print(f"{label:<16} {ms * 1000:>8.1f} {(ms - loads['none']) * 1000:>+12.1f}")

        infers = bench_infer(model_dir, variants, calls)
        print(f"\ninfer [1,16] float32, {calls} calls per policy (interleaved)")
        print(f"{'policy':<16} {'p50 us':>8} {'p99 us':>8} {'p50 / none':>11}")
        for label, (p50, p99) in infers.items():
            print(f"{label:<16} {p50 * 1e6:>8.1f} {p99 * 1e6:>8.1f} {p50 / infers['none'][0]:>11.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
