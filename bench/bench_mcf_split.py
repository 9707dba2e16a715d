"""Why a second core does not speed up the mcf runner's decode: threads against processes, same work.

    python bench/bench_mcf_split.py [--steps 15] [--method q4]

One decode step of a SmolLM2-135M-shaped llama (30 layers, hidden 576, MLP 1536, 9 query and 3 kv heads, the
49152-row tied head), its weight products only, through the mcf runner's `QuantizedLinear` with random weights:

- "one thread, whole step": what the runner does today;
- "half alone": the step split the way tensor parallelism splits it (each half owns half the MLP rows, its
  attention heads, half the head rows; o and down take the matching input columns), one half with the other idle;
- "two threads, one half each": both halves at once in one process, meeting at a barrier twice a layer (the sums
  of the o and down partial products), as a two-thread runner would;
- "two threads, no barriers": the same without any synchronisation (the best two threads can do);
- "two processes, one half each": the halves in two processes started together (no synchronisation).

Every row is the median of ``--steps`` steps, interleaved; ratios are against the first row. BLAS runs one
thread everywhere. Results and what they mean: docs/performance.md, "MCF runner".
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np
from carton.mcf import quantize
from carton_runner_mcf._kernels import QuantizedLinear

LAYERS, HIDDEN, MLP, VOCAB = 30, 576, 1536, 49152
Layer = dict[str, QuantizedLinear]


def _linear(rng: np.random.Generator, method: str, rows: int, cols: int) -> QuantizedLinear:
    weight = rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(0.02)
    return QuantizedLinear.from_quantized(quantize(weight, method, mode="reference"))


def _build(method: str, half: int | None, seed: int) -> tuple[list[Layer], QuantizedLinear]:
    """The whole model (``half=None``) or one tensor-parallel half: 5 or 4 of the 9 query heads (320 or 256 rows)
    with the 2 kv heads they read (128 rows), half the MLP rows, half the head rows."""
    rng = np.random.default_rng(seed)
    if half is None:
        q, kv, o_in, mlp, vocab = 576, 192, 576, MLP, VOCAB
    else:
        q = (320, 256)[half]
        kv, o_in, mlp, vocab = 128, q, MLP // 2, VOCAB // 2
    layers = [
        {
            "q": _linear(rng, method, q, HIDDEN),
            "k": _linear(rng, method, kv, HIDDEN),
            "v": _linear(rng, method, kv, HIDDEN),
            "o": _linear(rng, method, HIDDEN, o_in),
            "gate": _linear(rng, method, mlp, HIDDEN),
            "up": _linear(rng, method, mlp, HIDDEN),
            "down": _linear(rng, method, HIDDEN, mlp),
        }
        for _ in range(LAYERS)
    ]
    return layers, _linear(rng, method, vocab, HIDDEN)


def _norm(x: np.ndarray) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x) + np.float32(1e-5))


def _swiglu(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    return gate / (1 + np.exp(-gate)) * up


def _step(
    layers: list[Layer],
    head: QuantizedLinear,
    x: np.ndarray,
    reduce: Callable[[np.ndarray], np.ndarray] = lambda part: part,
) -> np.ndarray:
    for layer in layers:
        normed = _norm(x)
        q, _k, _v = layer["q"](normed), layer["k"](normed), layer["v"](normed)
        x = x + reduce(layer["o"](q))
        normed = _norm(x)
        x = x + reduce(layer["down"](_swiglu(layer["gate"](normed), layer["up"](normed))))
    out: np.ndarray = head(_norm(x))
    return out


class _TwoThreads:
    """Half 1 on a second thread; ``reduce`` adds the two halves' partial products at a barrier."""

    def __init__(self, halves: list[tuple[list[Layer], QuantizedLinear]], synchronise: bool) -> None:
        self._halves = halves
        self._synchronise = synchronise
        self._barrier = threading.Barrier(2)
        self._parts: list[list[np.ndarray]] = [[], []]
        self._go = threading.Semaphore(0)
        self._x = np.zeros((1, HIDDEN), np.float32)
        threading.Thread(target=self._worker, daemon=True).start()

    def _reduce(self, index: int) -> Callable[[np.ndarray], np.ndarray]:
        def reduce(part: np.ndarray) -> np.ndarray:
            if not self._synchronise:
                return part
            self._parts[index].append(part)
            self._barrier.wait()
            total = self._parts[0][-1] + self._parts[1][-1]
            self._barrier.wait()
            return total

        return reduce

    def _worker(self) -> None:
        while True:
            self._go.acquire()
            _step(*self._halves[1], self._x, self._reduce(1))
            self._barrier.wait()

    def step(self, x: np.ndarray) -> None:
        self._x = x
        self._parts = [[], []]
        self._go.release()
        _step(*self._halves[0], x, self._reduce(0))
        self._barrier.wait()


def _child(half: int, method: str, steps: int) -> None:
    """One half in its own process: build, say ready, wait for "go", time ``steps`` steps, print the median."""
    layers, head = _build(method, half, seed=10 + half)
    x = np.ones((1, HIDDEN), np.float32)
    _step(layers, head, x)
    print("ready", flush=True)
    sys.stdin.readline()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        _step(layers, head, x)
        times.append(time.perf_counter() - start)
    print(statistics.median(times), flush=True)


def _two_processes(method: str, steps: int) -> float:
    children = [
        subprocess.Popen(
            [sys.executable, __file__, "--child", str(half), "--method", method, "--steps", str(steps)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for half in (0, 1)
    ]
    for child in children:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
    for child in children:
        assert child.stdin is not None
        child.stdin.write("go\n")
        child.stdin.flush()
    medians = []
    for child in children:
        assert child.stdout is not None
        medians.append(float(child.stdout.readline()))
        child.wait()
    return max(medians)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--method", default="q4")
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        _child(args.child, args.method, args.steps)
        return
    whole = _build(args.method, None, seed=1)
    halves = [_build(args.method, half, seed=2 + half) for half in (0, 1)]
    synchronised, free = _TwoThreads(halves, True), _TwoThreads(halves, False)
    x = np.ones((1, HIDDEN), np.float32)
    runs: dict[str, Callable[[], object]] = {
        "one thread, whole step": lambda: _step(*whole, x),
        "half alone (the larger half, on one thread)": lambda: _step(*halves[0], x),
        "two threads, one half each, 2 barriers a layer": lambda: synchronised.step(x),
        "two threads, one half each, no barriers": lambda: free.step(x),
    }
    times: dict[str, list[float]] = {name: [] for name in runs}
    for run in runs.values():
        run()
    for _ in range(args.steps):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(values) for name, values in times.items()}
    medians["two processes, one half each, no barriers"] = _two_processes(args.method, args.steps)
    base = medians["one thread, whole step"]
    print(f"\n## {args.method} decode step, weight products only (SmolLM2-135M shapes), median of {args.steps}")
    print(f"{'what':<50} {'ms':>8} {'x one thread':>13}")
    for name, value in medians.items():
        print(f"{name:<50} {value * 1e3:8.2f} {value / base:13.2f}")


if __name__ == "__main__":
    main()
