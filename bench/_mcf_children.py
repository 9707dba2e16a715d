"""The timed sections of bench_mcf.py, each run in a child process of its own (``bench_mcf.py --child SECTION``, with
the BLAS thread count fixed in its environment before numpy is imported) and printing its results as one JSON line;
bench_mcf.py runs them and prints the tables. (Imported as a sibling: the bench scripts run from this directory.)
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from _ggml import add_ggml_matvec

METHODS = ["q8", "k6", "q4", "k4", "k3", "k2"]


def best_times(
    fns: dict[str, Callable[[], object]],
    *,
    repeat: int = 7,
    min_time: float = 0.5,
    clock: Callable[[], float] = time.perf_counter,
    samples: dict[str, list[float]] | None = None,
) -> dict[str, float]:
    """Best time of each function, run in alternation round by round so that load from other processes hits the
    reference and the candidates alike (every time is appended to ``samples``, when given)."""
    for fn in fns.values():
        fn()  # warm caches and buffers
    best = dict.fromkeys(fns, float("inf"))
    spent, rounds = 0.0, 0
    while (rounds < repeat or spent < min_time) and rounds < 60:
        for name, fn in fns.items():
            start = clock()
            fn()
            elapsed = clock() - start
            best[name] = min(best[name], elapsed)
            spent += elapsed
            if samples is not None:
                samples.setdefault(name, []).append(elapsed)
        rounds += 1
    return best


def rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# --- child sections ---------------------------------------------------------------------------------------------
def child_accuracy(size: int) -> dict[str, Any]:
    import numpy as np
    from carton.mcf import quantize

    w = np.random.default_rng(0).standard_normal((size, size)).astype(np.float32)
    power = float(np.mean(w.astype(np.float64) ** 2))
    out: dict[str, Any] = {}
    for method in METHODS:
        row = {}
        for mode in ("best", "reference"):
            start = time.perf_counter()
            q = quantize(w, method, mode=mode)
            seconds = time.perf_counter() - start
            err = q.dequantize().astype(np.float64) - w
            row[mode] = float(np.sqrt(np.mean(err**2) / power))
            row[f"{mode}_seconds"] = seconds
        out[method] = row
    return out


def child_dequant(size: int) -> dict[str, Any]:
    import numpy as np
    from carton.mcf import dequantize, quantize
    from carton.mcf._decode import dequantize_unpacked

    w = np.random.default_rng(1).standard_normal((size, size)).astype(np.float32)
    codes = np.random.default_rng(2).integers(-7, 8, size * size).astype(np.int8)
    out: dict[str, Any] = {}
    reuse = np.empty((size, size), dtype=np.float32)
    for method in [*METHODS, "int8", "int4"]:
        q = quantize(w, method)
        one: dict[str, Callable[[], object]] = {
            "reference": lambda: codes.astype(np.float32),
            "unpacked": lambda q=q: dequantize_unpacked(q.payload, q.method, q.shape),
            "fresh": lambda q=q: dequantize(q.payload, q.method, q.shape),
            "reuse": lambda q=q: dequantize(q.payload, q.method, q.shape, out=reuse),
        }
        times = best_times({**one, "fresh2": lambda q=q: dequantize(q.payload, q.method, q.shape, threads=2)})
        cpu = best_times(one, clock=time.thread_time)
        row = {name: size * size * 4 / t / 1e9 for name, t in times.items()}
        row.update({f"{name}_cpu": size * size * 4 / t / 1e9 for name, t in cpu.items()})
        out[method] = row
    return out


def repeated_times(fns: dict[str, Callable[[], object]], *, calls: int = 20, rounds: int = 3) -> dict[str, float]:
    """Best time of each function called ``calls`` times back to back (its data warm in the caches), the variants
    taking turns round by round."""
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(rounds):
        for name, fn in fns.items():
            fn()
            for _ in range(calls):
                start = time.perf_counter()
                fn()
                best[name] = min(best[name], time.perf_counter() - start)
    return best


def child_matvec(size: int, threads: int, huge: bool) -> dict[str, Any]:
    """Best time of one matrix-vector product per variant, alternated within each repeat (``seconds``) and
    repeated back to back (``warm``). Every matrix lives in fresh memory of the same page size (``huge``)."""
    import numpy as np
    from _ggml import placed_copy
    from carton.mcf import quantize
    from carton_runner_mcf._kernels import QuantizedLinear

    rng = np.random.default_rng(3)
    w = rng.standard_normal((size, size)).astype(np.float32)
    x = rng.standard_normal((1, size)).astype(np.float32)
    dense = placed_copy(quantize(w, "q4").dequantize(), huge)
    x1 = x[0]
    fns: dict[str, Callable[[], object]] = {"sgemv": lambda: dense @ x1}
    sizes: dict[str, int] = {}
    for method in ("q4", "k4", "q8", "k6", "k3", "k2"):
        payload = placed_copy(np.frombuffer(quantize(w, method, mode="reference").payload, np.uint8), huge)
        sizes[method] = len(payload)
        compiled = QuantizedLinear(  # pages="given": the payload stays in the memory placed for it
            payload, method, size, size, cache="packed", kernels="numba", threads=threads, pages="given"
        )
        fns[method] = lambda linear=compiled: linear(x)
        if method == "q4":  # a copy, so that reading it does not warm the product's payload
            words = placed_copy(payload[: len(payload) // 8 * 8], huge).view(np.uint64)
        if method in ("q4", "k4"):
            numpy_path = QuantizedLinear(payload, method, size, size, cache="int8", kernels="numpy", threads=threads)
            fns[f"{method} numpy int8"] = lambda linear=numpy_path: linear(x)
    ggml = add_ggml_matvec(fns, w, x1, threads, huge)
    fns["q4 payload read"] = lambda: words.sum()  # last in a round: every other variant's order is unchanged
    samples: dict[str, list[float]] = {}
    seconds = best_times(fns, repeat=15, min_time=1.0, samples=samples)
    warm = repeated_times({name: fn for name, fn in fns.items() if "numpy int8" not in name})
    exact = w.astype(np.float64) @ x1
    check = {name: float(np.linalg.norm(np.asarray(fns[name](), np.float64).ravel() - exact) / np.linalg.norm(exact))
             for name in ("q4", "k4")}  # fmt: skip
    if ggml is not None:
        check.update(ggml)
        sizes["ggml q4_K"] = fns["ggml q4_K"].nbytes  # type: ignore[attr-defined]
    median = {name: [sorted(times)[len(times) // 2]] for name, times in samples.items()}
    return {"threads": threads, "seconds": seconds, "median": median, "warm": warm, "check": check, "bytes": sizes}


def child_evict(size: int, huge: bool) -> dict[str, Any]:
    """q4's matrix-vector product, a plain read of its payload and ggml's q4_K product after reading N MiB of other
    memory between two calls, for growing N: where the matrix stops being found in a cache, and what reading it
    then costs."""
    import numpy as np
    from _ggml import placed_copy
    from carton.mcf import quantize
    from carton_runner_mcf._kernels import QuantizedLinear

    rng = np.random.default_rng(3)
    w = rng.standard_normal((size, size)).astype(np.float32)
    x = rng.standard_normal((1, size)).astype(np.float32)
    payload = placed_copy(np.frombuffer(quantize(w, "q4", mode="reference").payload, np.uint8), huge)
    linear = QuantizedLinear(payload, "q4", size, size, cache="packed", kernels="numba", threads=1, pages="given")
    words = payload[: len(payload) // 8 * 8].view(np.uint64)
    other = rng.integers(0, 1 << 62, (256 << 20) // 8, dtype=np.uint64)  # read only: nothing to write back
    fns: dict[str, Callable[[], object]] = {"product": lambda: linear(x), "read": lambda: words.sum()}
    add_ggml_matvec(fns, w, x[0], 1, huge)
    for fn in fns.values():
        fn()
    rows = []
    for mib in (0, 8, 16, 32, 64, 128, 256):
        between = other[: (mib << 20) // 8]
        row: dict[str, Any] = {"mib": mib, **{name: [] for name in fns}}
        for _ in range(25):
            for name, fn in fns.items():
                between.sum()
                start = time.perf_counter()
                fn()
                row[name].append(time.perf_counter() - start)
        rows.append({k: sorted(v) if isinstance(v, list) else v for k, v in row.items()})
    return {"bytes": len(payload), "rows": rows}


def child_matmul(size: int, threads: int) -> dict[str, Any]:
    import gc

    import numpy as np
    from carton.mcf import dequantize, payload_size, quantize
    from carton_runner_mcf._kernels import QuantizedLinear

    rng = np.random.default_rng(3)
    w = rng.standard_normal((size, size)).astype(np.float32)
    flops = {b: 2.0 * b * size * size for b in (1, 64)}
    xs = {b: rng.standard_normal((b, size)).astype(np.float32) for b in (1, 64)}
    out: dict[str, Any] = {"threads": threads}
    for method in ("q4", "k4"):
        payload = quantize(w, method).payload
        dense = dequantize(payload, method, (size, size))
        res: dict[str, Any] = {"quantized_bytes": payload_size(method, size, size)}
        linears = {cache: QuantizedLinear(payload, method, size, size, cache=cache) for cache in ("int8", "packed")}
        if threads > 1:
            for cache in ("int8", "packed"):
                linears[f"{cache}_t{threads}"] = QuantizedLinear(
                    payload, method, size, size, cache=cache, threads=threads
                )  # fmt: skip
        for b, x in xs.items():
            fns: dict[str, Callable[[], object]] = {
                "fp32": lambda x=x, dense=dense: x @ dense.T,
                "naive": lambda x=x, p=payload, m=method: x @ dequantize(p, m, (size, size)).T,
            }
            for cache, linear in linears.items():
                fns[cache] = lambda x=x, linear=linear: linear(x)
            for name, seconds in best_times(fns).items():
                res[f"{name}_b{b}"] = seconds
        del dense, linears
        gc.collect()
        res["flops"] = flops
        out[method] = res
    return out


PREFILL_SHAPES = [(1536, 576), (576, 1536), (576, 576), (192, 576)]
PREFILL_METHODS = ["q4", "k4", "q8", "k6"]
PREFILL_ROWS = 128


def child_prefill(threads: int) -> dict[str, Any]:
    import numpy as np
    from carton.mcf import quantize
    from carton_runner_mcf._kernels import QuantizedLinear

    try:
        import torch
    except ImportError:
        torch = None
    else:
        torch.set_num_threads(threads)
    rng = np.random.default_rng(6)
    out: dict[str, Any] = {"threads": threads, "torch": torch is not None}
    for rows, cols in PREFILL_SHAPES:
        w = rng.standard_normal((rows, cols)).astype(np.float32)
        x = rng.standard_normal((PREFILL_ROWS, cols)).astype(np.float32)
        for method in PREFILL_METHODS:
            q = quantize(w, method)
            dense = q.dequantize()
            compiled = QuantizedLinear.from_quantized(q, kernels="numba", threads=threads)._compiled
            assert compiled is not None
            fns: dict[str, Callable[[], object]] = {
                "panel": lambda c=compiled, x=x: c.paneled(x, threads),
                "tiled": lambda c=compiled, x=x: c.tiled(x),
                "numpy": lambda d=dense, x=x: x @ d.T,
            }
            if torch is not None:
                tx, tw = torch.from_numpy(x), torch.from_numpy(dense)
                fns["torch"] = lambda tx=tx, tw=tw: torch.nn.functional.linear(tx, tw)
            flops = 2.0 * PREFILL_ROWS * rows * cols
            out[f"{method} {rows}x{cols}"] = {k: flops / v / 1e9 for k, v in best_times(fns, repeat=9).items()}
    return out


def child_memory(size: int, method: str, cache: str) -> dict[str, Any]:
    """Resident bytes a layer keeps: RSS after building it and serving batch 1 and 64, minus RSS before loading."""
    import gc
    import tempfile

    import numpy as np
    from carton.mcf import quantize
    from carton_runner_mcf._kernels import QuantizedLinear

    rng = np.random.default_rng(4)
    with tempfile.NamedTemporaryFile(suffix=".bin") as fh:
        fh.write(quantize(rng.standard_normal((size, size)).astype(np.float32), method).payload)
        fh.flush()
        xs = [rng.standard_normal((b, size)).astype(np.float32) for b in (1, 64)]
        gc.collect()
        base = rss_bytes()
        payload: Any = np.fromfile(fh.name, dtype=np.uint8)
        linear = QuantizedLinear(payload, method, size, size, cache=cache)  # type: ignore[arg-type]
        del payload  # the packed cache keeps its own reference
        for x in xs:
            linear(x)
        gc.collect()
        return {"rss": rss_bytes() - base, "nbytes": linear.nbytes}
