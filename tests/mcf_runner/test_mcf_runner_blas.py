"""Runner option ``threads`` bounds BLAS's threads (a prompt's products) in a real runner process.

Observed from outside: the CPU time each thread of the runner process spends during a few long prompts, read from
``/proc``. The caller's thread does most of the work; with BLAS on two threads one more thread carries a real share
of it, with BLAS bounded to one thread none does. Shares of CPU time, never durations, are compared.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

import carton
import numpy as np
import pytest
from mcf_runner_models import infer_logits, load_runner, max_relative_error

pytestmark = pytest.mark.skipif(
    not Path("/proc/self/schedstat").is_file() or (os.cpu_count() or 1) < 2,
    reason="reads per-thread CPU times from /proc (schedstat) and needs two CPUs for BLAS to split a product",
)

#: A long prompt: every product is large enough for OpenBLAS to split it across threads.
IDS = np.random.default_rng(20).integers(0, 512, size=(8, 512), dtype=np.int64)


def _thread_cpu_ns(pid: int) -> dict[int, int]:
    """The time each thread of ``pid`` has run on a CPU, in nanoseconds (``schedstat``, counted by the scheduler).
    ``stat``'s user and system times are sampled at clock ticks, and over a few prompts that sampling adds an error of
    its own to each thread's share."""
    spent = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            spent[int(task.name)] = int((task / "schedstat").read_text().split()[0])
        except FileNotFoundError:  # a thread that ended meanwhile
            continue
    return spent


def _shares_during_prompt(path: Path) -> tuple[list[float], np.ndarray]:
    """Each busy thread's CPU time during three prompts' logits, as a share of the busiest thread's, largest first;
    and the logits."""
    with carton.load(path) as model:
        model.infer({"input_ids": IDS[:1, :64]})  # the kernels compile and every pool starts before the count
        (worker,) = model._workers
        runner = worker.process.runner_pid
        assert runner is not None
        before = _thread_cpu_ns(runner)
        for _ in range(3):
            logits = model.infer({"input_ids": IDS})["logits"]
        after = _thread_cpu_ns(runner)
    spent = sorted((after[tid] - before.get(tid, 0) for tid in after), reverse=True)
    assert spent[0] > 0
    return [ns / spent[0] for ns in spent if ns > 0], logits


def test_threads_option_runs_a_prompt_on_one_blas_thread(
    mcf_model: Callable[..., Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = mcf_model("base", "q4")
    # The host's OPENBLAS_NUM_THREADS reaches the runner: it asks for two threads, which the option overrides.
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "2")
    # The numpy kernels, whose products and attention are BLAS calls on every CPU: the compiled ones make none in a
    # prompt where the CPU has 512-bit VNNI (int16 panels, compiled attention).
    monkeypatch.setenv("CARTON_MCF_KERNELS", "numpy")
    free = carton.pack(folder, tmp_path / "free.carton", runner_name="mcf", required_framework_version=">=0.1")
    bounded = carton.pack(
        folder, tmp_path / "one.carton", runner_name="mcf", required_framework_version=">=0.1",
        runner_opts={"threads": 1},
    )  # fmt: skip
    free_shares, free_logits = _shares_during_prompt(free)
    # Without the option BLAS follows the environment: a second thread carries a real part of the products (this is
    # what makes the check below able to fail).
    assert len(free_shares) > 1 and free_shares[1] > 0.2, free_shares
    one_shares, one_logits = _shares_during_prompt(bounded)
    assert len(one_shares) == 1 or one_shares[1] < 0.1, one_shares
    # The same results: BLAS splits a product's rows and columns across threads, never a sum.
    reference = infer_logits(folder, {"input_ids": IDS})
    assert max_relative_error(one_logits, reference) < 1e-5
    assert max_relative_error(free_logits, reference) < 1e-5


def test_without_threadpoolctl_the_runner_loads_and_says_blas_is_not_bounded(
    mcf_model: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "threadpoolctl", None)  # what an install without the mcf extra's library meets
    warnings: list[str] = []
    runner = load_runner(mcf_model("base", "q4"), warnings, threads=1)
    try:
        assert warnings == [
            "mcf runner: threadpoolctl is not installed, so runner option 'threads' does not bound BLAS's threads "
            "(a prompt's products); install carton-runtime[mcf]"
        ]
        logits = runner.infer({"input_ids": IDS[:1, :64]})["logits"]
    finally:
        runner.close()
    assert max_relative_error(logits, infer_logits(mcf_model("base", "q4"), {"input_ids": IDS[:1, :64]})) < 1e-5
    warnings.clear()
    load_runner(mcf_model("base", "q4"), warnings).close()  # without the option nothing is limited, nothing said
    assert warnings == []
