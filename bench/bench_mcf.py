"""MCF quantization benchmarks: accuracy, dequantization throughput, quantized matmul, and the matrix-vector goal.

    python bench/bench_mcf.py                 # full run: 4096 x 4096, one and two threads
    python bench/bench_mcf.py --size 1024     # quicker smoke run
    python bench/bench_mcf.py --sections evict
                                              # q4's product and a read of its payload, after N MiB of other reads
    bash bench/setup_llamacpp.sh && python bench/bench_mcf.py --sections matvec
                                              # the compiled kernels against numpy sgemv and ggml's q4_K
    python bench/bench_mcf.py --sections matvec evict --base-pages
                                              # the same with every matrix on base pages (as a mapped file)

The ``prefill`` section times the large-batch products of a prompt (128 activation rows) on the shapes of
SmolLM2-135M's layers for q4, k4, q8 and k6: the int16 panel kernels (`CompiledPayload.paneled`, what
``QuantizedLinear`` runs where the CPU has 512-bit VNNI), decoded float32 tiles and BLAS (`CompiledPayload.tiled`,
the path elsewhere), and the references of the same child: numpy's fp32 ``x @ W.T`` on the dequantized matrix and,
when torch is installed, ``torch.nn.functional.linear`` (what transformers runs), at one and two threads; the child
gets the environment carton gives a runner process.

The ``matvec`` section times ``y = W x`` (one vector, one thread unless ``--threads``) for every block method on
the mcf runner's compiled kernels, numpy's fp32 sgemv of the dequantized matrix, the numpy int8-cache path, and
ggml's q4_K product of the same random matrix (quantized by ggml, without an importance matrix), called in the
child through ctypes from the shared ggml that bench/setup_llamacpp.sh builds with its llama.cpp tools' flags
(bench/_ggml.py): ggml's ``MUL_MAT`` on its CPU backend, the vector quantized to q8_K inside the op, as our kernels
round theirs to int16 inside the call. Its output is checked against the float64 product and against ggml's own
dequantized matrix. llama.cpp's own ``test-backend-ops perf`` figure for the same op (it repeats the op on the same
tensors, on half the hardware threads) is kept as a cross-check of the repeated column. Without the shared build
(or the tool), their rows are skipped with a note.

Within the child the variants are timed twice, ggml's product among them. First alternated, call by call, so that
every other variant's matrix passes through the caches between two calls of one (its matrix is then read from
memory, or from a far level of cache); best and median of the rounds. Then repeated: each variant called back to
back, so that its matrix stays in whatever cache holds it (the ``warm`` columns). The goal lines compare q4 and k4
with sgemv alternated, and with ggml alternated against alternated and repeated against repeated. ``q4 payload
read`` is numpy summing a copy of the q4 payload's bytes as 64-bit words: no product, only a read of as many bytes
as the q4 kernel reads, as a floor for its alternated figure (and ggml's: how much of its arithmetic a product hides
behind its cold read). Every matrix, ours and ggml's, lives in fresh memory on transparent huge pages, as numpy
gives any large array; ``--base-pages`` puts them all on base pages instead, as a mapped model file is (memory the
allocator hands back has whatever page size its earlier use left, which moves a cold read's time).

The ``evict`` section (not run by default) times q4's product, a plain read of its payload and ggml's q4_K product
with N MiB of other memory read between two calls, for N from 0 to 256: how much traffic the matrix survives in
this machine's caches, and what the products and the read cost once it does not.

Every timing section runs in a child process whose BLAS thread count is fixed through the environment before numpy
is imported, and compares against a reference measured in the same child: fp32 ``numpy.matmul`` on the already
dequantized matrix for matmul, numpy's own int8 -> float32 conversion of the same number of values for
dequantization. Timings are the best of several repeats. Read the ratios; the machine is shared and noisy.

Dequantization is also timed in CPU seconds of the calling thread (``time.thread_time``): on a shared machine the
wall clock counts the time other processes hold the core, the thread's CPU time does not. The two-thread matmul
table shows ``QuantizedLinear(threads=2)`` (our pool splits the output rows) next to ``threads=1`` (only BLAS threads).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from _mcf_children import (
    METHODS,
    PREFILL_METHODS,
    PREFILL_ROWS,
    PREFILL_SHAPES,
    child_accuracy,
    child_dequant,
    child_evict,
    child_matmul,
    child_matvec,
    child_memory,
    child_prefill,
)
from _timing import mcf_runner_env

RMSE_TARGETS = {"q8": 0.0053, "k6": 0.022, "q4": 0.092, "k4": 0.092, "k3": 0.20, "k2": 0.45}
GGML_RMSE = {"q8": "0.0054 (q8_0)", "k6": "0.018 (q6_K)", "q4": "0.086 (q4_0)", "k4": "0.071 (q4_K)", "k3": "-",
             "k2": "0.30 (q2_K)"}  # fmt: skip
DEQUANT_TARGET_GBS = 3.0
THREAD_VARS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS")


def report_evict(res: dict[str, Any], size: int) -> None:
    ggml = "ggml q4_K" in res["rows"][0]
    print(f"\n### q4 {size}x{size} after reading other memory between calls (1 thread, {res['bytes'] / 2**20:.1f} MiB"
          " payload)\n")  # fmt: skip
    if not ggml:
        print("note: in-process ggml column skipped: run bench/setup_llamacpp.sh (or set GGML_LIBRARY)\n")
    print("| MiB read between two calls | product best ms | median | payload read best ms | median |"
          + (" ggml q4_K best ms | median |" if ggml else ""))  # fmt: skip
    print("|---:|---:|---:|---:|---:|" + ("---:|---:|" if ggml else ""))
    for row in res["rows"]:
        cells = [f"{s[0] * 1e3:.3f} | {s[len(s) // 2] * 1e3:.3f}" for s in (row["product"], row["read"],
                 *([row["ggml q4_K"]] if ggml else []))]  # fmt: skip
        print(f"| {row['mib']} | {' | '.join(cells)} |")


def run_ggml(size: int) -> float | None:
    """Seconds per q4_K MUL_MAT of ``size x size`` by one vector, from test-backend-ops perf (None if not built)."""
    import re

    cache = Path(os.environ.get("CARTON_BENCH_CACHE", Path.home() / ".cache" / "carton-bench"))
    tool = Path(os.environ.get("GGML_TEST_BACKEND_OPS", cache / "llama.cpp" / "test-backend-ops"))
    if not tool.is_file():
        return None
    pattern = f"type_a=q4_K,type_b=f32,m={size},n=1,k={size},"
    done = subprocess.run(
        [str(tool), "perf", "-b", "CPU", "-o", "MUL_MAT", "-p", pattern], capture_output=True, text=True, check=False
    )
    found = re.search(r"([0-9.]+) us/run", done.stdout)
    if done.returncode != 0 or found is None:
        raise SystemExit(f"test-backend-ops failed or printed no timing:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return float(found.group(1)) * 1e-6


def report_prefill(results: list[dict[str, Any]]) -> None:
    from carton_runner_mcf._compiled import PANEL_PRODUCTS

    for res in results:
        t = res["threads"]
        print(f"\n### Prefill products, {PREFILL_ROWS} rows, {t} thread(s), GFLOP/s (best of rounds)\n")
        print(f"`QuantizedLinear` takes the panel kernels on this CPU: {PANEL_PRODUCTS}.")
        if not res["torch"]:
            print("torch is not installed: no F.linear column.")
        print("\n| method | W | panel (int16) | tiles + sgemm | numpy fp32 | torch F.linear | panel / torch |")
        print("|---|---|---:|---:|---:|---:|---:|")
        for method in PREFILL_METHODS:
            for rows, cols in PREFILL_SHAPES:
                r = res[f"{method} {rows}x{cols}"]
                torch_gf = r.get("torch")
                ratio = f"{r['panel'] / torch_gf:.2f}x" if torch_gf else "-"
                print(
                    f"| {method} | {rows} x {cols} | {r['panel']:.1f} | {r['tiled']:.1f} | {r['numpy']:.1f} "
                    f"| {f'{torch_gf:.1f}' if torch_gf else '-'} | {ratio} |"
                )


def run_child(section: str, size: int, threads: int, *extra: str) -> dict[str, Any]:
    env = dict(os.environ)
    for var in THREAD_VARS:
        env[var] = str(threads)
    if section == "memory":
        # A fixed mmap threshold makes glibc return every large block on free, so RSS deltas measure what is kept
        # (it also makes every large allocation fault its pages in, so no timing runs under it).
        env["MALLOC_MMAP_THRESHOLD_"] = "131072"
    if section == "prefill":
        # As carton starts a runner process (OpenBLAS's threads stop polling soon after their products, and leave
        # the cores to numba's team): without it, at two threads every engine of the alternated rounds waits on
        # the threads of the one before.
        env.update(mcf_runner_env(Path(__file__).resolve().parent.parent, env))
    cmd = [sys.executable, __file__, "--child", section, "--size", str(size), "--threads", str(threads), *extra]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"child {section} failed:\n{proc.stderr}")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


# --- report -----------------------------------------------------------------------------------------------------
def report_accuracy(acc: dict[str, Any], size: int) -> None:
    print(f"\n### Quantize-dequantize relative RMSE, N(0,1) {size}x{size}\n")
    print("| method | best | reference mode | target (max) | best / target | ggml | quantize s (best) |")
    print("|---|---|---|---|---|---|---|")
    for m in METHODS:
        r = acc[m]
        ok = "ok" if r["best"] <= RMSE_TARGETS[m] else "MISS"
        print(
            f"| {m} | {r['best']:.4f} | {r['reference']:.4f} | {RMSE_TARGETS[m]} | {r['best'] / RMSE_TARGETS[m]:.2f} "
            f"{ok} | {GGML_RMSE[m]} | {r['best_seconds']:.2f} |"
        )


def report_dequant(dq: dict[str, Any], size: int) -> None:
    print(f"\n### Dequantization, {size}x{size}, GB/s of fp32 output\n")
    print("Reference: numpy's int8 -> float32 `astype` of as many values, timed alternately with each method;")
    print("`unpacked`: the straightforward decoder (codes unpacked to int8, converted, scaled). Wall clock, then the")
    print("calling thread's CPU time (`thread_time`, one thread), which load from other processes does not inflate.\n")
    print(
        "| method | new array | reused `out=` | unpacked | reference | new / reference | 2 threads (new array) "
        "| CPU time: new array | CPU: reused | CPU: unpacked | CPU: reference | CPU new vs 3 GB/s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for m in [*METHODS, "int8", "int4"]:
        r = dq[m]
        ok = "ok" if r["fresh_cpu"] >= DEQUANT_TARGET_GBS else "MISS"
        print(
            f"| {m} | {r['fresh']:.2f} | {r['reuse']:.2f} | {r['unpacked']:.2f} | {r['reference']:.2f} "
            f"| {r['fresh'] / r['reference']:.2f}x | {r['fresh2']:.2f} ({r['fresh2'] / r['fresh']:.2f}x) "
            f"| {r['fresh_cpu']:.2f} | {r['reuse_cpu']:.2f} | {r['unpacked_cpu']:.2f} | {r['reference_cpu']:.2f} "
            f"| {r['fresh_cpu'] / DEQUANT_TARGET_GBS:.2f}x {ok} |"
        )


def report_matmul(results: list[dict[str, Any]], size: int) -> None:
    for res in results:
        t = res["threads"]
        print(f"\n### Matmul y = x @ W.T, W {size}x{size}, {t} thread(s)\n")
        print("| method | variant | batch 1 ms | batch 1 GFLOP/s | batch 64 ms | batch 64 vs fp32 | resident weights |")
        print("|---|---|---|---|---|---|---|")
        for m in ("q4", "k4"):
            r = res[m]
            qb = r["quantized_bytes"]
            variants = [
                ("fp32", "numpy fp32 matmul on dequantized W (reference)"),
                ("naive", "dequantize whole W, then matmul (straightforward)"),
                ("int8", "QuantizedLinear cache=int8 (numpy)"),
                ("packed", "QuantizedLinear cache=packed (compiled; the default)"),
            ]
            if t > 1:
                variants += [
                    (f"int8_t{t}", f"QuantizedLinear cache=int8, threads={t}"),
                    (f"packed_t{t}", f"QuantizedLinear cache=packed, threads={t}"),
                ]
            for variant, label in variants:
                t1, t64 = r[f"{variant}_b1"], r[f"{variant}_b64"]
                gf1 = r["flops"]["1"] / t1 / 1e9
                ratio = r["fp32_b64"] / t64
                if variant in ("int8", "packed"):
                    mem = f"{r[f'{variant}_nbytes'] / qb:.2f}x q ({r[f'{variant}_rss'] / qb:.2f}x RSS)"
                elif "_t" in variant:
                    mem = "as above (+ work buffers per thread)"
                elif variant == "fp32":
                    mem = f"{size * size * 4 / qb:.2f}x q"
                else:
                    mem = "-"
                mem = mem.replace("x q ", "x ")
                print(f"| {m} | {label} | {t1 * 1e3:.2f} | {gf1:.1f} | {t64 * 1e3:.1f} | {ratio:.2f}x | {mem} |")


def report_matvec(size: int, results: list[dict[str, Any]], tool: list[float]) -> None:
    """ggml's in-process product is compared regime for regime (alternated with alternated, repeated with
    repeated); test-backend-ops' figure, always repeated, is a cross-check of the repeated one."""
    tool_s = min(tool) if tool else None
    for res in results:
        t, seconds, warm = res["threads"], res["seconds"], res.get("warm", {})
        median = {name: sorted(m)[len(m) // 2] for name, m in res["median"].items()}
        sgemv, cold_g, warm_g = seconds["sgemv"], seconds.get("ggml q4_K"), warm.get("ggml q4_K")
        warm_ref = warm_g if warm_g is not None else tool_s
        print(f"\n### Matrix-vector y = W x, W {size}x{size}, {t} thread(s)\n")
        if cold_g is None:
            print("note: in-process ggml rows skipped: run bench/setup_llamacpp.sh (or set GGML_LIBRARY)\n")
        print("| variant | ms | median ms | GFLOP/s | x numpy fp32 sgemv | x ggml q4_K | warm ms | warm x ggml q4_K |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|")
        rows: list[tuple[str, str, float | None]] = [("numpy fp32 sgemv (reference)", "sgemv", sgemv)]
        if tool_s is not None and t == max(1, (os.cpu_count() or 2) // 2):  # the threads test-backend-ops takes
            rows.append(("ggml q4_K (test-backend-ops perf, repeated: cross-check)", "tool", None))
        labels = {"ggml q4_K": "ggml q4_K (in-process, same rounds)"}
        rows += [(labels.get(name, f"mcf {name} compiled" if " " not in name else f"mcf {name}"), name, s)
                 for name, s in seconds.items() if name != "sgemv"]  # fmt: skip
        for label, name, s in rows:
            w = tool_s if name == "tool" else warm.get(name)
            cold_cells = "- | - | - | - | -" if s is None else (
                f"{s * 1e3:.3f} | {median[name] * 1e3:.3f} | {2 * size * size / s / 1e9:.1f} | {sgemv / s:.2f} | "
                + (f"{cold_g / s:.2f}" if cold_g else "-"))  # fmt: skip
            warm_cells = "- | -" if w is None else f"{w * 1e3:.3f} | " + (f"{warm_ref / w:.2f}" if warm_ref else "-")
            print(f"| {label} | {cold_cells} | {warm_cells} |")
        check = res.get("check", {})
        if "ggml" in check:
            print(f"\noutput check, relative error of y against the float64 product: q4 {check['q4']:.4f}, k4 "
                  f"{check['k4']:.4f}, ggml q4_K {check['ggml']:.4f} (against ggml's own dequantized matrix "
                  f"{check['ggml own']:.4f})")  # fmt: skip
            read = seconds["q4 payload read"]
            mib = ", ".join(f"{k} {res['bytes'][k] / 2**20:.2f} MiB" for k in ("q4", "k4", "ggml q4_K"))
            print(f"alternated product / alternated plain read of the q4 payload: ggml q4_K {cold_g / read:.2f}x, "
                  f"q4 {seconds['q4'] / read:.2f}x, k4 {seconds['k4'] / read:.2f}x (bytes read: {mib})")  # fmt: skip
        if t == 1:
            print()
            for method in ("q4", "k4"):
                line = (f"goal {method}: >= 3.5x sgemv: {_verdict(sgemv / seconds[method], 3.5)} (medians "
                        f"{median['sgemv'] / median[method]:.2f}x)")  # fmt: skip
                if cold_g is not None and warm_g is not None:
                    line += (f"; >= 0.8x ggml q4_K: alternated vs alternated {_verdict(cold_g / seconds[method], 0.8)}"
                             f" (medians {median['ggml q4_K'] / median[method]:.2f}x), repeated vs repeated "
                             f"{_verdict(warm_g / warm[method], 0.8)}")  # fmt: skip
                elif tool_s is not None:
                    ratio = _verdict(tool_s / warm[method], 0.8)
                    line += f"; >= 0.8x ggml q4_K (repeated vs test-backend-ops): {ratio}"
                print(line)


def _verdict(ratio: float, target: float) -> str:
    return f"{ratio:.2f}x {'met' if ratio >= target else 'NOT met'}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=4096, help="matrix side (default 4096)")
    parser.add_argument("--threads", type=int, nargs="*", default=[1, 2], help="thread counts for matmul")
    parser.add_argument("--sections", nargs="*", default=["accuracy", "dequant", "matvec", "matmul", "prefill"])
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds of the matvec section")
    parser.add_argument("--base-pages", action="store_true", help="matvec / evict matrices on base pages, not huge")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--method", help=argparse.SUPPRESS)
    parser.add_argument("--cache", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        threads = args.threads[0] if args.threads else 1
        fn = {"accuracy": lambda: child_accuracy(args.size), "dequant": lambda: child_dequant(args.size),
              "matmul": lambda: child_matmul(args.size, threads),
              "matvec": lambda: child_matvec(args.size, threads, not args.base_pages),
              "evict": lambda: child_evict(args.size, not args.base_pages),
              "prefill": lambda: child_prefill(threads),
              "memory": lambda: child_memory(args.size, args.method, args.cache)}[args.child]  # fmt: skip
        print(json.dumps(fn()))
        return
    print(f"# bench_mcf: {' '.join(sys.argv[1:]) or '(defaults)'}; cpu count {os.cpu_count()}; load average "
          f"{os.getloadavg()[0]:.2f}")  # fmt: skip
    pages = ["--base-pages"] if args.base_pages else []
    if "accuracy" in args.sections:
        report_accuracy(run_child("accuracy", args.size, 1), args.size)
    if "dequant" in args.sections:
        report_dequant(run_child("dequant", args.size, 1), args.size)
    if "matvec" in args.sections:
        matvec: dict[int, dict[str, Any]] = {}
        ggml: list[float] = []
        for _ in range(args.rounds):
            for t in args.threads:
                res = run_child("matvec", args.size, t, *pages)
                kept = matvec.setdefault(t, res)
                for name in res["seconds"] if kept is not res else []:
                    kept["median"][name] += res["median"][name]
                    for key in ("seconds", "warm"):
                        if name in res[key]:
                            kept[key][name] = min(kept[key][name], res[key][name])
            found = run_ggml(args.size)
            if found is not None:
                ggml.append(found)
        if not ggml:
            print("note: test-backend-ops rows skipped: run bench/setup_llamacpp.sh (or set GGML_TEST_BACKEND_OPS)")
        report_matvec(args.size, list(matvec.values()), ggml)
        print(f"load average after the section {os.getloadavg()[0]:.2f}")
    if "evict" in args.sections:
        report_evict(run_child("evict", args.size, 1, *pages), args.size)
        print(f"load average after the section {os.getloadavg()[0]:.2f}")
    if "matmul" in args.sections:
        results = [run_child("matmul", args.size, t) for t in args.threads]
        for method in ("q4", "k4"):
            for cache in ("int8", "packed"):
                mem = run_child("memory", args.size, 1, "--method", method, "--cache", cache)
                for res in results:
                    res[method][f"{cache}_rss"], res[method][f"{cache}_nbytes"] = mem["rss"], mem["nbytes"]
        report_matmul(results, args.size)
    if "prefill" in args.sections:
        report_prefill([run_child("prefill", args.size, t) for t in args.threads])
        print(f"load average after the section {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
