"""The compiled kernels come from numba's disk cache in every process after the first: a kernel compiled again in
each runner process costs the runner LLVM's time and memory at its first products."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from carton_runner_mcf._packed import KERNELS_ENV, compiled_kernels

# Products of a q4 matrix on every path of the packed cache: one activation row on one thread and split across two
# (the parallel kernel), and a batch above the matrix-vector limit (the int16 panel kernels, serial and parallel,
# where the CPU has 512-bit VNNI; decoded rows and BLAS elsewhere).
_CHILD = """
import json
import numpy as np
from carton.mcf import quantize
from carton_runner_mcf import _packed
from carton_runner_mcf._compiled import PANEL_PRODUCTS, block_kernels, panel_kernels
from carton_runner_mcf._kernels import COMPILED_GEMV_MAX_BATCH, QuantizedLinear

rng = np.random.default_rng(0)
q = quantize(rng.standard_normal((256, 64)).astype(np.float32), "q4")
for threads in (1, 2):
    linear = QuantizedLinear.from_quantized(q, threads=threads)
    assert linear.compiled
    for m in (1, COMPILED_GEMV_MAX_BATCH + 1):
        linear(rng.standard_normal((m, 64)).astype(np.float32))
kernels = block_kernels(4)
used = [("matmul", kernels.matmul)]
if not _packed._parallel_broken:  # no thread-safe threading layer: products stay on one thread
    used.append(("matmul_parallel", kernels.matmul_parallel))
if PANEL_PRODUCTS:
    panels = panel_kernels(4)
    used.append(("panel matmul", panels.matmul))
    if not _packed._parallel_broken:
        used.append(("panel matmul_parallel", panels.matmul_parallel))
else:
    used.append(("decode", kernels.decode))
print(json.dumps({
    name: {"hits": sum(d.stats.cache_hits.values()), "misses": sum(d.stats.cache_misses.values())}
    for name, d in used
}))
"""


def _run_child() -> dict[str, dict[str, int]]:
    env = {**os.environ, "NUMBA_NUM_THREADS": "2"}
    env.pop("NUMBA_DISABLE_JIT", None)
    done = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, dict[str, int]] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_a_second_process_loads_every_product_kernel_from_the_cache() -> None:
    if os.environ.get(KERNELS_ENV, "").strip().lower() == "numpy":
        pytest.skip(f"{KERNELS_ENV}=numpy forces the numpy path")
    if compiled_kernels("auto") is None:
        pytest.skip("numba is not installed (pip install 'carton-runtime[mcf]')")
    _run_child()  # compiles what the cache does not hold yet
    second = _run_child()
    for name, counts in second.items():
        assert counts["misses"] == 0, f"{name} was compiled again in a new process: {second}"
        assert counts["hits"] > 0, f"{name} was not loaded from the cache: {second}"
