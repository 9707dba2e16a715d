"""A/B of the wire: this checkout's `RunnerProcess` against another checkout's, alternating, in the same run.

    git worktree add --detach ../carton-base <commit>       # the code before a change
    python bench/bench_ab.py --baseline ../carton-base [--rounds 8] [--calls 3000]

Every round starts one child process per side, in alternating order (baseline first in even rounds): the child has
that side's ``carton_core``, ``protocol`` and ``runners`` first on ``PYTHONPATH``, starts the side's own Echo test
runner, and times, after a warm-up:

* ``small``: `RunnerProcess.infer` of one ``[1,16]`` float32 tensor (the header-template path);
* ``small async``: the same through `RunnerProcess.infer_async` on an asyncio loop;
* ``small strings``: ``[1,16]`` float32 plus a 2-element string tensor (never templated: the full encoder and
  decoder on both ends);
* ``large``: 64 MiB in and 64 MiB out (shared memory).

Each round gives a p50 per row and side; the table shows the median over rounds of each side's p50 and of the
per-round ratio (this checkout / baseline), with its range, and the load average before and after.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROWS = ("small", "small async", "small strings", "large")


def _child(tree: Path, calls: int) -> None:
    import numpy as np
    from carton._runtime._process import RunnerProcess
    from carton_protocol import RunnerSpec

    spec = RunnerSpec(runner_name="bench", framework_version="1.0.0", runner_compat_version=1,
                      entry="runners_for_tests:Echo")  # fmt: skip
    runner = RunnerProcess.start(spec, extra_env={"PYTHONPATH": str(tree / "tests" / "protocol")})
    runner.load(model_dir=tree, opts={}, inputs=(), outputs=())
    x = np.random.default_rng(0).random((1, 16), dtype=np.float32)
    words = np.array(["hello", "wire"])
    big = np.random.default_rng(0).random((64 << 20) // 4, dtype=np.float32)

    def timed(call: Any, count: int, warmup: int) -> list[float]:
        for _ in range(warmup):
            call()
        taken = []
        for _ in range(count):
            begin = time.perf_counter()
            call()
            taken.append(time.perf_counter() - begin)
        return taken

    async def timed_async(count: int, warmup: int) -> list[float]:
        for _ in range(warmup):
            await runner.infer_async({"x": x})
        taken = []
        for _ in range(count):
            begin = time.perf_counter()
            await runner.infer_async({"x": x})
            taken.append(time.perf_counter() - begin)
        return taken

    try:
        samples = {
            "small": timed(lambda: runner.infer({"x": x}), calls, calls // 10),
            "small async": asyncio.run(timed_async(calls, calls // 10)),
            "small strings": timed(lambda: runner.infer({"x": x, "words": words}), calls, calls // 10),
            "large": timed(lambda: runner.infer({"x": big}), 10, 2),
        }
    finally:
        runner.close()
    print(json.dumps({row: statistics.median(values) for row, values in samples.items()}))


def _run_side(tree: Path, calls: int) -> dict[str, float]:
    paths = [str(tree / part) for part in ("carton_core", "protocol", "runners")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    out = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--child", str(tree), "--calls", str(calls)],
        env=env, capture_output=True, text=True, check=False, cwd=HERE,
    )  # fmt: skip
    if out.returncode != 0:
        raise SystemExit(f"the child for {tree} failed:\n{out.stderr}")
    result: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", type=Path, help="the other checkout (its root folder)")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--calls", type=int, default=3000, help="timed calls per small row and round")
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        _child(args.child, args.calls)
        return
    if args.baseline is None:
        parser.error("--baseline is required")
    ours = HERE.parent
    baseline = args.baseline.resolve()
    load_before = os.getloadavg()
    p50s: dict[str, dict[str, list[float]]] = {side: {row: [] for row in ROWS} for side in ("base", "new")}
    for index in range(args.rounds):
        order = [("base", baseline), ("new", ours)]
        if index % 2:
            order.reverse()
        for side, tree in order:
            for row, value in _run_side(tree, args.calls).items():
                p50s[side][row].append(value)
    load_after = os.getloadavg()
    print(f"# bench_ab: {ours.name} against {baseline.name}, {args.rounds} alternating rounds, python "
          f"{sys.version.split()[0]}; load average {load_before[0]:.2f} before, {load_after[0]:.2f} after\n")
    print("| row | baseline p50 | this checkout p50 | ratio (median of rounds) | ratio range |")
    print("|---|---|---|---|---|")
    for row in ROWS:
        base, new = p50s["base"][row], p50s["new"][row]
        ratios = [b / a for a, b in zip(base, new, strict=True)]
        unit, scale = ("ms", 1e3) if row == "large" else ("us", 1e6)
        print(f"| {row} | {statistics.median(base) * scale:.1f} {unit} | {statistics.median(new) * scale:.1f} {unit} "
              f"| {statistics.median(ratios):.3f}x | {min(ratios):.2f}-{max(ratios):.2f}x |")


if __name__ == "__main__":
    main()
