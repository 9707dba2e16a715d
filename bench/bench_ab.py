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
* ``large``: 64 MiB in and 64 MiB out (shared memory);
* ``onnx model``: `Model.infer` of a ``[1,16]`` float32 identity ONNX carton (onnxruntime runner), the whole
  host<->runner hop a server request makes: spec checks, the wire, the runner loop and onnxruntime;
  ``onnx model async``: the same through `Model.infer_async`.

Each round gives a p50 per row and side. The ``cpu`` rows are the CPU time one call costs, the host process and the
runner process together (every thread: ZeroMQ's I/O threads too), over the same calls: on a loaded machine a
round trip's wall time is mostly waiting to be scheduled, while the CPU a call burns is what the code decides. The
table shows the median over rounds of each side's figure and of the per-round ratio (this checkout / baseline), with
its range, and the load average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROWS = (
    "small",
    "small async",
    "small strings",
    "large",
    "onnx model",
    "onnx model async",
    "small cpu",
    "small strings cpu",
    "onnx model cpu",
    "onnx model async cpu",
)


def _identity_carton(folder: Path) -> Path:
    """A packed ``[1,16]``-capable identity ONNX carton (input ``INPUT0``, output ``OUTPUT0``) in `folder`."""
    import carton
    import onnx
    from onnx import TensorProto, helper

    dims = ["d0", "d1"]
    graph = helper.make_graph(
        [helper.make_node("Identity", ["INPUT0"], ["OUTPUT0"])], "identity",
        [helper.make_tensor_value_info("INPUT0", TensorProto.FLOAT, dims)],
        [helper.make_tensor_value_info("OUTPUT0", TensorProto.FLOAT, dims)],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    (folder / "identity").mkdir()
    onnx.save(model, folder / "identity" / "model.onnx")
    carton.pack(folder / "identity", folder / "identity.carton", runner_name="onnxruntime",
                required_framework_version=">=1.0")  # fmt: skip
    return folder / "identity.carton"


def _child(tree: Path, calls: int) -> None:
    import asyncio
    import tempfile

    import carton
    import numpy as np
    from _timing import process_cpu_seconds, timed, timed_async
    from carton._runtime._process import RunnerProcess
    from carton_protocol import RunnerSpec

    spec = RunnerSpec(runner_name="bench", framework_version="1.0.0", runner_compat_version=1,
                      entry="runners_for_tests:Echo")  # fmt: skip
    runner = RunnerProcess.start(spec, extra_env={"PYTHONPATH": str(tree / "tests" / "protocol")})
    runner.load(model_dir=tree, opts={}, inputs=(), outputs=())
    x = np.random.default_rng(0).random((1, 16), dtype=np.float32)
    words = np.array(["hello", "wire"])
    big = np.random.default_rng(0).random((64 << 20) // 4, dtype=np.float32)
    assert runner.runner_pid is not None
    runner_pid = runner.runner_pid

    def cpu_per_call(call: Callable[[], object], pid: int = runner_pid, repeat: int = calls) -> float:
        for _ in range(max(1, repeat // 10)):
            call()
        host, remote = time.process_time(), process_cpu_seconds(pid)
        for _ in range(repeat):
            call()
        return (time.process_time() - host + process_cpu_seconds(pid) - remote) / repeat

    async def loop_calls(call: Callable[[], Any], count: int) -> None:
        for _ in range(count):
            await call()

    try:
        samples = {
            "small": statistics.median(timed(lambda: runner.infer({"x": x}), calls, calls // 10)),
            "small async": statistics.median(
                asyncio.run(timed_async(lambda: runner.infer_async({"x": x}), calls, calls // 10))
            ),
            "small strings": statistics.median(
                timed(lambda: runner.infer({"x": x, "words": words}), calls, calls // 10)
            ),
            "large": statistics.median(timed(lambda: runner.infer({"x": big}), 10, 2)),
            "small cpu": cpu_per_call(lambda: runner.infer({"x": x})),
            "small strings cpu": cpu_per_call(lambda: runner.infer({"x": x, "words": words})),
        }
    finally:
        runner.close()
    with tempfile.TemporaryDirectory() as folder:
        model = carton.load(_identity_carton(Path(folder)))
        try:
            for _ in range(calls // 3):
                model.infer({"INPUT0": x})
            time.sleep(1.5)  # the spare runner the first call scheduled finishes starting
            model_pid = model._workers[0].process.runner_pid
            assert model_pid is not None

            def infer_async() -> Any:
                return model.infer_async({"INPUT0": x})

            samples["onnx model"] = statistics.median(timed(lambda: model.infer({"INPUT0": x}), calls, calls // 10))
            samples["onnx model async"] = statistics.median(asyncio.run(timed_async(infer_async, calls, calls // 10)))
            samples["onnx model cpu"] = cpu_per_call(lambda: model.infer({"INPUT0": x}), model_pid)
            # one event loop for all the calls, as a server runs them
            samples["onnx model async cpu"] = (
                cpu_per_call(lambda: asyncio.run(loop_calls(infer_async, calls)), model_pid, repeat=1) / calls
            )
        finally:
            model.close()
    print(json.dumps(samples))


def _run_side(tree: Path, calls: int) -> dict[str, float]:
    from _timing import run_in_checkout

    return run_in_checkout(__file__, tree, ["--child", str(tree), "--calls", str(calls)], cwd=HERE)


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
    figures: dict[str, dict[str, list[float]]] = {side: {row: [] for row in ROWS} for side in ("base", "new")}
    for index in range(args.rounds):
        order = [("base", baseline), ("new", ours)]
        if index % 2:
            order.reverse()
        for side, tree in order:
            for row, value in _run_side(tree, args.calls).items():
                figures[side][row].append(value)
    load_after = os.getloadavg()
    print(
        f"# bench_ab: {ours.name} against {baseline.name}, {args.rounds} alternating rounds, python "
        f"{sys.version.split()[0]}; load average {load_before[0]:.2f} before, {load_after[0]:.2f} after\n"
    )
    print("| row | baseline | this checkout | ratio (median of rounds) | ratio range |")
    print("|---|---|---|---|---|")
    for row in ROWS:
        base, new = figures["base"][row], figures["new"][row]
        ratios = [b / a for a, b in zip(base, new, strict=True)]
        unit, scale = ("ms", 1e3) if row == "large" else ("us", 1e6)
        what = "CPU per call" if row.endswith("cpu") else "p50"
        print(
            f"| {row} ({what}) | {statistics.median(base) * scale:.1f} {unit} | "
            f"{statistics.median(new) * scale:.1f} {unit} | {statistics.median(ratios):.3f}x | "
            f"{min(ratios):.2f}-{max(ratios):.2f}x |"
        )


if __name__ == "__main__":
    main()
