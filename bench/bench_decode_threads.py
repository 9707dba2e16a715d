"""Decode from one thread to two: the mcf runner's single-token step at ``threads`` 1 and 2, this checkout against
another, in alternating rounds.

    python bench/bench_llm.py --threads 1 --rounds 1 --methods q4 --new-tokens 8   # converts SmolLM2 once
    git worktree add --detach ../carton-base <commit>                             # the code before a change
    python bench/bench_decode_threads.py --baseline ../carton-base [--rounds 4] [--method q4]
    python bench/bench_decode_threads.py --bandwidth [--rounds 5] [--repeats 3]                 # the memory bound

Every round starts one child process per (side, thread count), in alternating order (the baseline first in even
rounds). A child has that side's ``carton_core``, ``protocol`` and ``runners`` first on ``PYTHONPATH``, loads the
MCF that ``bench/bench_llm.py`` converted (its ``--work`` folder) with runner option ``threads``, in the environment
carton gives that checkout's runner process (its plugin's ``RunnerSpec.env``) with ``OPENBLAS_NUM_THREADS`` set to
``threads`` as ``bench_llm.py`` sets it, prefills a prompt of ``--prompt-tokens`` random tokens and decodes
``--new-tokens`` greedily (the loop of the runner's generate: step, output head, argmax), ``--repeats`` times; it
reports the best time per token, the process's CPU time per token (every thread, from /proc), the tenth percentile
of its single tokens' times (p10: on a shared machine, what a token takes when nothing took its cores), and the
median over its tokens of the time a token spends outside the team's compiled run (``Team._call``, stamped): the
caller's Python between two steps, which both thread counts pay in full.

``--bandwidth`` measures instead what the memory system allows, in one child of this checkout: the bytes a decode
step reads per token (every product's payload as stored, the output head's included, the norms, an embedding row,
the cache's keys and values at the decode's mean length), then, alternated over ``--rounds`` in that one process,
a compiled streaming read (an XOR over 64-bit words) of a buffer of that size and of the model's own arrays, by one
thread and by two (each half of every array), against the decode itself at one thread and two (two regions on the
same weights): the bytes per second the decode reaches at each thread count against what the machine streams, and
the two-thread token's floor, the step's bytes read at the machine's two-thread rate.

The table gives, per side and thread count, the median over rounds of the best time per token, and the scaling
from one thread to two as the median of the per-round ratios (each round's two children ran back to back, so a
ratio is less exposed to the machine's load than either time), with its range, and the load average before and
after. Without ``--baseline`` only this checkout runs.
"""

from __future__ import annotations

import argparse
import itertools
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
    from carton_runner_mcf import _team
    from carton_runner_mcf.runner import MCFRunner

    try:
        from carton_runner_mcf._decoder import positions_from_mask
    except ImportError:  # a baseline from before the decoder's shared parts left `_llama`
        from carton_runner_mcf._llama import positions_from_mask  # type: ignore[attr-defined,no-redef]

    # The caller's part of each run of the team (the compiled step), stamped: a token's time outside it is the
    # caller's Python between two steps, serial at every thread count.
    runs_in: list[tuple[float, float]] = []
    call = _team.Team._call

    def stamped(team: Any, *call_args: Any, **kwargs: Any) -> Any:
        entered = time.perf_counter()
        try:
            return call(team, *call_args, **kwargs)
        finally:
            runs_in.append((entered, time.perf_counter()))

    _team.Team._call = stamped  # type: ignore[method-assign]
    runner = MCFRunner()
    opts: dict[str, Any] = {"mode": "generate", "threads": args.threads}
    inputs = (TensorSpec(name="input_ids", dtype=DType.INT64, shape=("batch", "seq")),)
    outputs = (TensorSpec(name="output_ids", dtype=DType.INT64, shape=("batch", "new")),)
    runner.load(LoadContext(model_dir=Path(args.model), opts=opts, inputs=inputs, outputs=outputs))
    model = runner._loaded.model
    ids = np.random.default_rng(0).integers(100, 40000, size=(1, args.prompt_tokens), dtype=np.int64)
    mask = np.ones(ids.shape, dtype=bool)
    one = np.ones((1, 1), dtype=bool)

    def decode(steps: int) -> tuple[float, float, list[float]]:
        cache = model.new_cache(1, args.prompt_tokens + steps + 1)
        hidden = model.forward(ids, positions_from_mask(mask), mask, cache)
        token = model.logits(hidden[:, -1]).argmax(-1)
        tops = [time.perf_counter()]
        started, cpu = tops[0], _cpu_seconds()
        runs_in.clear()
        for step in range(steps):
            position = np.array([[args.prompt_tokens + step]], dtype=np.int64)
            hidden = model.forward(token[:, None], position, one, cache)
            token = model.logits(hidden[:, 0]).argmax(-1)
            tops.append(time.perf_counter())
        outside = []
        for top, end in itertools.pairwise(tops):
            inside = [run for run in runs_in if top <= run[0] < end]
            if inside:
                outside.append((inside[0][0] - top) + (end - inside[-1][1]))
        tokens = [end - top for top, end in itertools.pairwise(tops)]
        return (time.perf_counter() - started) / steps, (_cpu_seconds() - cpu) / steps, outside, tokens

    decode(4)  # compiled code loaded, threads started
    runs = [decode(args.new_tokens) for _ in range(args.repeats)]
    runner.close()
    best = min(runs, key=lambda run: run[0])
    outside = [gap for run in runs for gap in run[2][1:]]  # the first step of a decode posts through Python
    python_us = statistics.median(outside) * 1e6 if outside else float("nan")
    tokens = sorted(token for run in runs for token in run[3])
    p10_ms = tokens[len(tokens) // 10] * 1e3
    return {"step_ms": best[0] * 1e3, "cpu_ms": best[1] * 1e3, "python_us": python_us, "p10_ms": p10_ms}


def _step_bytes(model: Any, region: Any, prompt: int, new: int) -> dict[str, int]:
    """The bytes a q* / k* decode step of ``model`` reads from memory per token, by what holds them: every layer's
    products and the output head as their payloads are stored (the compiled kernels read them in place), the norms,
    one embedding row, and the keys and values of the cache at the decode's mean length (each cached slot read once;
    a kv head's three query heads re-read it from the core's caches)."""
    config = model.config
    head = region._head[0]
    layers = sum(payload.nbytes for payload in region.payloads)
    slots = prompt + (new - 1) / 2 + 1  # the mean number of slots a step attends to, the new one included
    cache = 2 * config.num_layers * model.kv_heads * config.head_dim * 4 * slots
    return {
        "layers' products": layers,
        "output head": head.nbytes,
        "norms": region.norms.nbytes + region.final_norm.nbytes,
        "embedding row": head.nbytes // max(region.vocab, 1),
        "kv cache": int(cache),
    }


def _words(array: Any) -> Any:
    """The 8-byte-aligned middle of a byte array as uint64 words (a compiled XOR over them is vectorized)."""
    import numpy as np

    flat = array.reshape(-1).view(np.uint8)
    skip = -flat.ctypes.data % 8
    words = flat[skip : skip + (flat.size - skip) // 8 * 8].view(np.uint64)
    words.flags.writeable = False  # one numba type for payloads (read-only maps) and the cache
    return words


def _bound_child(args: argparse.Namespace) -> dict[str, Any]:
    """In one process, alternated: a compiled streaming read of a buffer the size of a decode step's reads and of
    the model's own arrays (payloads, cache) at one thread and at two (each half), and the decode at one and two
    threads (two regions on the same weights)."""
    import threading

    import numba
    import numpy as np
    from carton_protocol import DType, LoadContext, TensorSpec
    from carton_runner_mcf._decoder import positions_from_mask
    from carton_runner_mcf._region import DecodeRegion
    from carton_runner_mcf.runner import MCFRunner
    from numba.typed import List

    @numba.njit(nogil=True, cache=False)
    def fold(words: Any, first: int, last: int) -> int:
        total = np.uint64(0)
        for i in range(first, last):
            total ^= words[i]
        return int(total)

    @numba.njit(nogil=True, cache=False)
    def fold_all(arrays: Any, part: int, parts: int) -> int:
        total = 0
        for words in arrays:
            n = words.size
            total ^= fold(words, n * part // parts, n * (part + 1) // parts)
        return total

    @numba.njit(nogil=True, cache=False)
    def fold_one(words: Any, part: int, parts: int) -> int:
        n = words.size
        return fold(words, n * part // parts, n * (part + 1) // parts)

    runner = MCFRunner()
    opts: dict[str, Any] = {"mode": "generate", "threads": 2}
    inputs = (TensorSpec(name="input_ids", dtype=DType.INT64, shape=("batch", "seq")),)
    outputs = (TensorSpec(name="output_ids", dtype=DType.INT64, shape=("batch", "new")),)
    runner.load(LoadContext(model_dir=Path(args.model), opts=opts, inputs=inputs, outputs=outputs))
    model = runner._loaded.model
    regions = {threads: DecodeRegion.build(model, threads=threads) for threads in (1, 2)}
    if regions[1] is None or regions[2] is None:
        raise SystemExit("the model's decode step does not run in one region (not a whole q* / k* model)")
    parts = _step_bytes(model, regions[1], args.prompt_tokens, args.new_tokens)
    total = sum(parts.values())
    ids = np.random.default_rng(0).integers(100, 40000, size=(1, args.prompt_tokens), dtype=np.int64)
    mask = np.ones(ids.shape, dtype=bool)
    one = np.ones((1, 1), dtype=bool)
    steps = args.new_tokens

    def decode(threads: int, count: int) -> list[float]:
        """Each token's time (step, output head, argmax) of a greedy decode of ``count`` tokens."""
        model._region = regions[threads]
        cache = model.new_cache(1, args.prompt_tokens + steps + 1)
        hidden = model.forward(ids, positions_from_mask(mask), mask, cache)
        token = model.logits(hidden[:, -1]).argmax(-1)
        times = []
        for step in range(count):
            started = time.perf_counter()
            position = np.array([[args.prompt_tokens + step]], dtype=np.int64)
            hidden = model.forward(token[:, None], position, one, cache)
            token = model.logits(hidden[:, 0]).argmax(-1)
            times.append(time.perf_counter() - started)
        return times

    def best_decode(threads: int) -> float:
        """The mean over a decode's tokens of each token's fastest time over ``--repeats`` decodes: the least
        disturbed token at each length of the cache (a loaded machine disturbs whole decodes)."""
        runs = [decode(threads, steps) for _ in range(args.repeats)]
        return float(np.mean(np.min(runs, axis=0)))

    # The model's own arrays: every payload, the norms, and the cache's slots at the decode's mean length.
    slots = args.prompt_tokens + steps // 2 + 1
    cache = model.new_cache(1, args.prompt_tokens + steps + 1)
    real = List()
    for array in (*regions[1].payloads, regions[1]._head[0], regions[1].norms):
        real.append(_words(array))
    for store in (cache.key_store, cache.value_store):
        for layer in range(store.shape[0]):
            for group in range(store.shape[2]):
                real.append(_words(store[layer, 0, group, :slots]))
    real_bytes = sum(words.nbytes for words in real)
    synthetic = np.ones(total // 8, np.uint64)
    synthetic.flags.writeable = False

    def read(function: Any, data: Any, threads: int) -> tuple[float, float]:
        """Wall time of one read of ``data`` by ``threads`` threads (each its part, started together), and the
        slowest thread's CPU time for its part (what the read takes while the thread has a core: other processes
        can still take memory bandwidth, but not the core)."""
        spans = [(0.0, 0.0, 0.0)] * threads
        start = threading.Barrier(threads)

        def part(index: int) -> None:
            start.wait()
            begun, cpu = time.perf_counter(), time.thread_time()
            function(data, index, threads)
            spans[index] = (begun, time.perf_counter(), time.thread_time() - cpu)

        helpers = [threading.Thread(target=part, args=(index,)) for index in range(1, threads)]
        for helper in helpers:
            helper.start()
        part(0)
        for helper in helpers:
            helper.join()
        return max(span[1] for span in spans) - min(span[0] for span in spans), max(span[2] for span in spans)

    def best_read(function: Any, data: Any, threads: int) -> tuple[float, float]:
        runs = [read(function, data, threads) for _ in range(5)]
        return min(wall for wall, _ in runs), min(cpu for _, cpu in runs)

    for threads in (1, 2):
        best_read(fold_one, synthetic, threads)
        best_read(fold_all, real, threads)
        decode(threads, 4)  # compiled code loaded, threads started
    rounds = []
    for index in range(args.rounds):
        row: dict[str, float] = {}
        for threads in (1, 2) if index % 2 else (2, 1):
            row[f"synthetic {threads}"], row[f"synthetic cpu {threads}"] = best_read(fold_one, synthetic, threads)
            row[f"real {threads}"], row[f"real cpu {threads}"] = best_read(fold_all, real, threads)
            row[f"decode {threads}"] = best_decode(threads)
        row["load"] = os.getloadavg()[0]
        rounds.append(row)
    runner.close()
    return {"parts": parts, "total": total, "real_bytes": real_bytes, "rounds": rounds}


def _bound(tree: Path, model: Path, args: argparse.Namespace) -> None:
    """Print what the machine's memory allows the decode at one and two threads (`_bound_child`, one child)."""
    import statistics

    from _timing import run_in_checkout

    arguments = ["--child-bound", "--model", str(model), "--rounds", str(args.rounds),
                 "--prompt-tokens", str(args.prompt_tokens), "--new-tokens", str(args.new_tokens),
                 "--repeats", str(args.repeats)]  # fmt: skip
    load_before = os.getloadavg()[0]
    found = run_in_checkout(__file__, tree, arguments, env=_child_env(tree, 2))
    total, rounds = found["total"], found["rounds"]
    print(f"# the memory bound: bytes a decode step reads per token (prompt {args.prompt_tokens}, "
          f"{args.new_tokens} new tokens)")  # fmt: skip
    print("| part | MB |")
    print("|---|---:|")
    for name, size in found["parts"].items():
        print(f"| {name} | {size / 1e6:.2f} |")
    print(f"| **total** | **{total / 1e6:.2f}** |")
    print(f"# in one process, alternated, {args.rounds} rounds; reads best of 5, decodes per token the "
          f"fastest of {args.repeats}; "
          f"load average {load_before:.2f} before, {os.getloadavg()[0]:.2f} after. GB/s: a streaming read (compiled "
          f"XOR over 64-bit words) of a {total / 1e6:.1f} MB buffer, and of the model's own arrays "
          f"({found['real_bytes'] / 1e6:.1f} MB: payloads, norms, the cache's slots), by 1 thread and by 2 (each "
          "half); 'by CPU time': the own arrays over the slowest thread's CPU time for its part; a decode's GB/s is "
          "the bytes above over its time per token")  # fmt: skip
    print("| round (load) | buffer 1 / 2 threads GB/s | own arrays 1 / 2 GB/s | by CPU time | read 2 / 1 | decode 1 "
          "/ 2 threads ms/token | decode 1 / 2 GB/s | decode 2 / 1 | decode / read rate, 1 / 2 threads |")  # fmt: skip
    print("|---|---|---|---|---:|---|---|---:|---|")

    def rate(size: float, seconds: float) -> float:
        return size / seconds / 1e9

    for index, row in enumerate(rounds):
        real = (rate(found["real_bytes"], row["real 1"]), rate(found["real_bytes"], row["real 2"]))
        buffer = (rate(total, row["synthetic 1"]), rate(total, row["synthetic 2"]))
        decoded = (rate(total, row["decode 1"]), rate(total, row["decode 2"]))
        cpu = (rate(found["real_bytes"], row["real cpu 1"]), rate(found["real_bytes"], row["real cpu 2"]))
        print(f"| {index + 1} ({row['load']:.2f}) | {buffer[0]:.1f} / {buffer[1]:.1f} | {real[0]:.1f} / {real[1]:.1f} "
              f"| {cpu[0]:.1f} / {cpu[1]:.1f} | {real[1] / real[0]:.2f}x | "
              f"{row['decode 1'] * 1e3:.2f} / {row['decode 2'] * 1e3:.2f} | "
              f"{decoded[0]:.1f} / {decoded[1]:.1f} | {row['decode 1'] / row['decode 2']:.2f}x | "
              f"{decoded[0] / real[0]:.2f} / {decoded[1] / real[1]:.2f} |")  # fmt: skip

    def median(key: str) -> float:
        return float(statistics.median(row[key] for row in rounds))

    one, two = median("decode 1"), median("decode 2")
    floor = statistics.median(row["real 2"] * total / found["real_bytes"] for row in rounds)
    print(f"# medians: decode {one * 1e3:.2f} / {two * 1e3:.2f} ms per token; reading the step's {total / 1e6:.1f} MB "
          f"at the machine's two-thread rate takes {floor * 1e3:.2f} ms, so the memory system allows two threads "
          f"{one / floor:.2f}x one thread's token (decode two threads / one: {one / two:.2f}x)")  # fmt: skip


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
    parser.add_argument(
        "--bandwidth",
        action="store_true",
        help="measure the memory bound instead: streaming reads against the decode, 1 and 2 threads",
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--child-bound", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_child(args)))
        return
    if args.child_bound:
        print(json.dumps(_bound_child(args)))
        return
    model = args.work / f"mcf-{args.method}"
    if not (model / "model.mcf").is_file():
        raise SystemExit(f"{model}/model.mcf is missing: run bench/bench_llm.py --methods {args.method} first")
    if args.bandwidth:
        _bound(HERE.parent, model, args)
        return
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
    print("| side | 1 thread ms/token | CPU ms/token | Python us/token | p10 token ms | 2 threads ms/token | CPU "
          "ms/token | Python us/token | p10 token ms | 2 threads / 1: speed-up (median of rounds) | range | p10 "
          "tokens, 1 / 2 (best rounds) |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|")
    for name, _ in sides:
        one, two = times[(name, 1)], times[(name, 2)]
        ratios = [a["step_ms"] / b["step_ms"] for a, b in zip(one, two, strict=True)]

        def median(runs: list[dict[str, Any]], key: str) -> float:
            return float(statistics.median(run[key] for run in runs))

        best_p10 = min(run["p10_ms"] for run in one) / min(run["p10_ms"] for run in two)
        print(f"| {name} | {median(one, 'step_ms'):.2f} | {median(one, 'cpu_ms'):.2f} | {median(one, 'python_us'):.0f} "
              f"| {median(one, 'p10_ms'):.2f} | {median(two, 'step_ms'):.2f} | {median(two, 'cpu_ms'):.2f} "
              f"| {median(two, 'python_us'):.0f} | {median(two, 'p10_ms'):.2f} | **{statistics.median(ratios):.2f}x** "
              f"| {min(ratios):.2f}-{max(ratios):.2f} | {best_p10:.2f}x |")  # fmt: skip


if __name__ == "__main__":
    main()
