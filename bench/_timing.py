"""Timing helpers shared by the benchmark scripts (imported as a sibling: the scripts run from bench/)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU time of process `pid`, all its threads (from /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def percentiles(samples: list[float]) -> tuple[float, float]:
    """p50 and p99 of `samples`."""
    ordered = sorted(samples)
    return ordered[len(ordered) // 2], ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]


#: Two-sided confidence of `median_interval` unless asked otherwise (bench_server.py prints it with each goal).
CONFIDENCE = 0.95


def median_interval(values: Sequence[float], confidence: float = CONFIDENCE) -> tuple[float, float] | None:
    """A distribution-free confidence interval for the median of `values`, taken as independent draws: the order
    statistics x(k) and x(n+1-k), with k the largest count for which P(Binomial(n, 1/2) < k) is at most half of
    1 - `confidence` (the sign test's interval). None when there are too few values for that confidence (under six
    at 95 %)."""
    ordered = sorted(values)
    count = len(ordered)
    tail = (1 - confidence) / 2
    k = 0
    below = 0.0  # P(Binomial(count, 1/2) < k + 1)
    while k < count:
        below += math.comb(count, k) / 2**count
        if below > tail:
            break
        k += 1
    if k == 0:
        return None
    return ordered[k - 1], ordered[count - k]


def timed(call: Callable[[], object], repeat: int, warmup: int) -> list[float]:
    """Seconds per call of `call`, `repeat` times after `warmup` untimed calls."""
    for _ in range(warmup):
        call()
    samples = []
    for _ in range(repeat):
        begin = time.perf_counter()
        call()
        samples.append(time.perf_counter() - begin)
    return samples


async def timed_async(call: Callable[[], Awaitable[object]], repeat: int, warmup: int) -> list[float]:
    """`timed` for a coroutine function, awaited on the running event loop."""
    for _ in range(warmup):
        await call()
    samples = []
    for _ in range(repeat):
        begin = time.perf_counter()
        await call()
        samples.append(time.perf_counter() - begin)
    return samples


def run_in_checkout(
    script: str, tree: Path, arguments: Sequence[str], *, env: Mapping[str, str] | None = None, cwd: Path | None = None
) -> dict[str, Any]:
    """Run `script` again as a child process whose ``carton_core``, ``protocol`` and ``runners`` come from the
    checkout `tree` (first on ``PYTHONPATH``), with `arguments`; the child prints its result as JSON on its last
    line, which is returned. A child that fails stops the benchmark with its error output."""
    paths = [str(tree / part) for part in ("carton_core", "protocol", "runners")]
    environment = {**os.environ, **(env or {}), "PYTHONPATH": os.pathsep.join(paths)}
    done = subprocess.run(
        [sys.executable, str(Path(script).resolve()), *arguments],
        env=environment, capture_output=True, text=True, check=False, cwd=cwd or tree,
    )  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"the child for {tree} ({' '.join(arguments)}) failed:\n{done.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


#: The variables that set BLAS's (and OpenMP's) thread count in a child process.
BLAS_THREAD_VARS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


def mcf_runner_env(tree: Path, environ: Mapping[str, str]) -> dict[str, str]:
    """The variables the mcf runner plugin of checkout `tree` adds to a runner process's environment (its
    ``RunnerSpec.env`` when the host's environment is `environ`): a benchmark that runs the runner in a child process
    of its own gives the child these, so the child's BLAS and kernels are set up as `carton.load` sets up a runner
    process."""
    paths = [str(tree / part) for part in ("carton_core", "protocol", "runners")]
    script = (
        "import json; from carton_runner_mcf import plugin; (spec,) = plugin.carton_runners(); "
        "print(json.dumps(dict(spec.env)))"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], env={**environ, "PYTHONPATH": os.pathsep.join(paths)},
        capture_output=True, text=True, check=True, cwd=tree,
    )  # fmt: skip
    found: dict[str, str] = json.loads(done.stdout)
    return found
