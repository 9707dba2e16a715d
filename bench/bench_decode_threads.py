"""Decode from one thread to two: the mcf runner's single-token step at ``threads`` 1 and 2, this checkout against
another, in alternating rounds.

    python bench/bench_llm.py --threads 1 --rounds 1 --methods q4 --new-tokens 8   # converts SmolLM2 once
    git worktree add --detach ../carton-base <commit>                             # the code before a change
    python bench/bench_decode_threads.py --baseline ../carton-base [--rounds 4] [--method q4] [--bandwidth]

Every round starts one child process per (side, thread count), in alternating order (the baseline first in even
rounds). A child has that side's ``carton_core``, ``protocol`` and ``runners`` first on ``PYTHONPATH``, loads the
MCF that ``bench/bench_llm.py`` converted (its ``--work`` folder) with runner option ``threads``, in the environment
carton gives that checkout's runner process (its plugin's ``RunnerSpec.env``) with ``OPENBLAS_NUM_THREADS`` set to
``threads`` as ``bench_llm.py`` sets it, prefills a prompt of ``--prompt-tokens`` random tokens and decodes
``--new-tokens`` greedily (the loop of the runner's generate: step, output head, argmax), ``--repeats`` times; it
reports the best time per token and the process's CPU time per token (every thread, from /proc).

``--bandwidth`` first measures what bounds a step from below: the time to read the model file's bytes once (a
compiled XOR over them as 64-bit words, the file already in the page cache) by one thread and by two (each half),
best of 5, alternated over ``--rounds``: a decode step reads every weight once; and what a second thread gives to
work that touches no memory at all (eight multiply-add chains in registers, each thread the whole count): whether
the machine's two CPUs compute independently.

The table gives, per side and thread count, the median over rounds of the best time per token, and the scaling
from one thread to two as the median of the per-round ratios (each round's two children ran back to back, so a
ratio is less exposed to the machine's load than either time), with its range, and the load average before and
after. Without ``--baseline`` only this checkout runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def _cpu_seconds() -> float:
    fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _child(args: argparse.Namespace) -> dict[str, Any]:
    import numpy as np
    from carton_protocol import DType, LoadContext, TensorSpec
    from carton_runner_mcf._llama import positions_from_mask
    from carton_runner_mcf.runner import MCFRunner

    runner = MCFRunner()
    opts: dict[str, Any] = {"mode": "generate", "threads": args.threads}
    inputs = (TensorSpec(name="input_ids", dtype=DType.INT64, shape=("batch", "seq")),)
    outputs = (TensorSpec(name="output_ids", dtype=DType.INT64, shape=("batch", "new")),)
    runner.load(LoadContext(model_dir=Path(args.model), opts=opts, inputs=inputs, outputs=outputs))
    model = runner._loaded.model
    ids = np.random.default_rng(0).integers(100, 40000, size=(1, args.prompt_tokens), dtype=np.int64)
    mask = np.ones(ids.shape, dtype=bool)
    one = np.ones((1, 1), dtype=bool)

    def decode(steps: int) -> tuple[float, float]:
        cache = model.new_cache(1, args.prompt_tokens + steps + 1)
        hidden = model.forward(ids, positions_from_mask(mask), mask, cache)
        token = model.logits(hidden[:, -1]).argmax(-1)
        started, cpu = time.perf_counter(), _cpu_seconds()
        for step in range(steps):
            position = np.array([[args.prompt_tokens + step]], dtype=np.int64)
            hidden = model.forward(token[:, None], position, one, cache)
            token = model.logits(hidden[:, 0]).argmax(-1)
        return (time.perf_counter() - started) / steps, (_cpu_seconds() - cpu) / steps

    decode(4)  # compiled code loaded, threads started
    runs = [decode(args.new_tokens) for _ in range(args.repeats)]
    runner.close()
    best = min(runs)
    return {"step_ms": best[0] * 1e3, "cpu_ms": best[1] * 1e3}


def _bandwidth(model: Path, rounds: int) -> None:
    import threading

    import numba
    import numpy as np

    @numba.njit(nogil=True, cache=False)
    def fold(words: Any, first: int, last: int) -> int:
        total = np.uint64(0)
        for i in range(first, last):
            total ^= words[i]
        return int(total)

    @numba.njit(nogil=True, cache=False)
    def compute(steps: int) -> float:
        # Eight independent multiply-add chains on registers: no memory traffic at all.
        a0, a1, a2, a3, a4, a5, a6, a7 = 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8
        for _ in range(steps):
            a0, a1, a2, a3 = a0 * 0.999 + 0.001, a1 * 0.999 + 0.001, a2 * 0.999 + 0.001, a3 * 0.999 + 0.001
            a4, a5, a6, a7 = a4 * 0.999 + 0.001, a5 * 0.999 + 0.001, a6 * 0.999 + 0.001, a7 * 0.999 + 0.001
        return a0 + a1 + a2 + a3 + a4 + a5 + a6 + a7

    raw = np.fromfile(model / "model.mcf", dtype=np.uint8)
    words = raw[: raw.size // 8 * 8].view(np.uint64)
    n = words.size
    steps = 20_000_000
    fold(words, 0, 8)
    compute(8)

    def run(calls: list[tuple[Any, tuple[Any, ...]]]) -> tuple[float, float]:
        """Wall time of ``calls`` run at once (the first on this thread, each other on a thread of its own), and
        the mean of their threads' CPU times: unlike the wall time, that one does not count what other processes
        take of the cores, only how fast a thread runs while it has one."""
        cpu = [0.0] * len(calls)

        def call(index: int) -> None:
            function, arguments = calls[index]
            begun = time.thread_time()
            function(*arguments)
            cpu[index] = time.thread_time() - begun

        helpers = [threading.Thread(target=call, args=(index,)) for index in range(1, len(calls))]
        started = time.perf_counter()
        for helper in helpers:
            helper.start()
        call(0)
        for helper in helpers:
            helper.join()
        return time.perf_counter() - started, sum(cpu) / len(cpu)

    def best(calls: list[tuple[Any, tuple[Any, ...]]]) -> tuple[float, float]:
        runs = [run(calls) for _ in range(5)]
        return min(wall for wall, _ in runs), min(cpu for _, cpu in runs)

    read, computed = [], []
    for _ in range(rounds):
        read.append((best([(fold, (words, 0, n))]), best([(fold, (words, 0, n // 2)), (fold, (words, n // 2, n))])))
        # Both threads do the whole count: twice the work in the same wall time is a speed-up of 2.
        computed.append((best([(compute, (steps,))]), best([(compute, (steps,)), (compute, (steps,))])))
    mb = raw.size / 1e6
    print(f"# what a second thread gives, best of 5 per round, {rounds} rounds; load average {os.getloadavg()[0]:.2f}. "
          "'by wall' counts what other processes take of the cores; 'by CPU time' compares each thread's own CPU "
          "time for its share of the work (2.00x: two CPUs that do not slow each other)")  # fmt: skip
    print("| work | round | 1 thread ms | CPU ms | 2 threads ms | CPU ms per thread | 2 threads / 1 by wall "
          "| by CPU time |")  # fmt: skip
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for label, results, scale in ((f"read the {mb:.0f} MB file", read, 1), ("registers only", computed, 2)):
        for index, ((one_wall, one_cpu), (two_wall, two_cpu)) in enumerate(results):
            # Reading: each thread reads half, so its CPU time against one thread's whole read is the speed-up.
            # Registers: each thread does the whole count, twice the work.
            wall_ratio = scale * one_wall / two_wall
            cpu_ratio = (2 * one_cpu / two_cpu) if scale == 2 else one_cpu / two_cpu
            print(f"| {label} | {index + 1} | {one_wall * 1e3:.1f} | {one_cpu * 1e3:.1f} | {two_wall * 1e3:.1f} | "
                  f"{two_cpu * 1e3:.1f} | {wall_ratio:.2f}x | {cpu_ratio:.2f}x |")  # fmt: skip


_RUNNER_ENVS: dict[tuple[Path, int], dict[str, str]] = {}


def _child_env(tree: Path, threads: int) -> dict[str, str]:
    """BLAS gets the step's thread count, as in bench_llm.py (and as a runner process on a machine of that many CPUs
    gets by default), plus what carton gives a runner process of checkout ``tree``."""
    from _timing import BLAS_THREAD_VARS, mcf_runner_env

    if (tree, threads) not in _RUNNER_ENVS:
        env = dict.fromkeys(BLAS_THREAD_VARS, str(threads))
        _RUNNER_ENVS[(tree, threads)] = env | mcf_runner_env(tree, {**os.environ, **env})
    return _RUNNER_ENVS[(tree, threads)]


def _run_child(tree: Path, threads: int, model: Path, args: argparse.Namespace) -> dict[str, Any]:
    from _timing import run_in_checkout

    arguments = ["--child", "--threads", str(threads), "--model", str(model),
                 "--prompt-tokens", str(args.prompt_tokens), "--new-tokens", str(args.new_tokens),
                 "--repeats", str(args.repeats)]  # fmt: skip
    return run_in_checkout(__file__, tree, arguments, env=_child_env(tree, threads))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", type=Path, help="another checkout (its root folder) to compare against")
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "carton-bench-llm",
                        help="bench_llm.py's work folder (holds mcf-<method>/)")  # fmt: skip
    parser.add_argument("--method", default="q4")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--bandwidth", action="store_true", help="also time reading the model at 1 and 2 threads")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_child(args)))
        return
    model = args.work / f"mcf-{args.method}"
    if not (model / "model.mcf").is_file():
        raise SystemExit(f"{model}/model.mcf is missing: run bench/bench_llm.py --methods {args.method} first")
    if args.bandwidth:
        _bandwidth(model, args.rounds)
    sides = [("this checkout", HERE.parent)]
    if args.baseline is not None:
        sides.append(("baseline", args.baseline.resolve()))
    load_before = os.getloadavg()
    times: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for index in range(args.rounds):
        order = sides if index % 2 else sides[::-1]
        for name, tree in order:
            for threads in (1, 2):
                times.setdefault((name, threads), []).append(_run_child(tree, threads, model, args))
        print(f"# round {index + 1}/{args.rounds} done, load {os.getloadavg()[0]:.2f}", file=sys.stderr)
    load_after = os.getloadavg()
    print(f"# bench_decode_threads: SmolLM2-135M {args.method}, prompt {args.prompt_tokens}, decode "
          f"{args.new_tokens} tokens, best of {args.repeats} per child, {args.rounds} alternating rounds; load average "
          f"{load_before[0]:.2f} before, {load_after[0]:.2f} after")  # fmt: skip
    print("| side | 1 thread ms/token | CPU ms/token | 2 threads ms/token | CPU ms/token | 2 threads / 1: speed-up "
          "(median of rounds) | range |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---|")
    for name, _ in sides:
        one, two = times[(name, 1)], times[(name, 2)]
        ratios = [a["step_ms"] / b["step_ms"] for a, b in zip(one, two, strict=True)]

        def median(runs: list[dict[str, Any]], key: str) -> float:
            return float(statistics.median(run[key] for run in runs))

        print(f"| {name} | {median(one, 'step_ms'):.2f} | {median(one, 'cpu_ms'):.2f} | {median(two, 'step_ms'):.2f} "
              f"| {median(two, 'cpu_ms'):.2f} | **{statistics.median(ratios):.2f}x** | "
              f"{min(ratios):.2f}-{max(ratios):.2f} |")  # fmt: skip


if __name__ == "__main__":
    main()
