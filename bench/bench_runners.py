"""Built-in runner benchmarks: carton against the framework called in this process, measured in the same run.

    python bench/bench_runners.py [--quick] [--only load,infer] [--repeats N]

1. load: `carton.load` to first inference of a ~100 MB ONNX model (six 2048x2048 float32 MatMuls) versus
   `onnxruntime.InferenceSession` on the same file plus its first run. "cold" loads use an empty cache (the model
   is extracted from the .carton), "warm" loads reuse the cache a previous load filled. Goals: cold <= 1.3x,
   warm <= 1.1x.
2. infer: steady-state per-call time of a small ONNX MLP (16 -> 32 -> 4) and of a 100-tree xgboost classifier
   (8 features), batch 1 and 256: `model.infer` versus the in-process framework call (`session.run`,
   `XGBClassifier.predict_proba`), with the per-call overhead (difference) and the ratio.

Everything is built in a temporary folder that is deleted at the end; nothing is written to the repository.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import carton
import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "runners"))

from runner_models import training_data, write_mlp  # noqa: E402


def _big_onnx(model_dir: Path, *, width: int = 2048, layers: int = 6) -> Path:
    rng = np.random.default_rng(0)
    nodes, initializers, previous = [], [], "x"
    for i in range(layers):
        initializers.append(numpy_helper.from_array(
            (rng.standard_normal((width, width), dtype=np.float32) * 0.02), f"w{i}"))
        nodes.append(helper.make_node("MatMul", [previous, f"w{i}"], [f"h{i}"]))
        previous = f"h{i}"
        if i < layers - 1:
            nodes.append(helper.make_node("Relu", [previous], [f"r{i}"]))
            previous = f"r{i}"
    graph = helper.make_graph(
        nodes, "big",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", width])],
        [helper.make_tensor_value_info(previous, TensorProto.FLOAT, ["batch", width])],
        initializer=initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    model_dir.mkdir(parents=True, exist_ok=True)
    path = model_dir / "model.onnx"
    onnx.save(model, path)
    return path


def _median_time(function: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_load(work: Path, repeats: int) -> list[tuple[str, float, float]]:
    path = _big_onnx(work / "big")
    size_mb = path.stat().st_size / 1e6
    packed = carton.pack(work / "big", work / "big.carton", runner_name="onnxruntime",
                         required_framework_version="*", compression="stored")
    x = np.ones((1, 2048), dtype=np.float32)

    def reference() -> None:
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        session.run(None, {"x": x})

    def carton_load() -> None:
        with carton.load(packed) as model:
            model.infer({"x": x})

    reference()  # page cache warm for everyone: we compare loading, not disk reads
    cold_times, warm_times, reference_times = [], [], []
    for round_index in range(repeats):
        reference_times.append(_median_time(reference, 1))
        os.environ["CARTON_CACHE_DIR"] = str(work / f"cache-{round_index}")
        cold_times.append(_median_time(carton_load, 1))  # empty cache: extract, verify, load
        warm_times.append(_median_time(carton_load, 1))  # same cache: reuse the extracted model
    base = statistics.median(reference_times)
    cold, warm = statistics.median(cold_times), statistics.median(warm_times)
    print(f"\n## load to first inference: {size_mb:.0f} MB ONNX model, median of {repeats}")
    print(f"{'what':<52} {'seconds':>8} {'ratio':>6} {'goal':>6}")
    print(f"{'onnxruntime.InferenceSession + first run (reference)':<52} {base:8.3f} {1:6.2f} {'':>6}")
    print(f"{'carton.load + first infer, cold cache':<52} {cold:8.3f} {cold / base:6.2f} {'1.30':>6}")
    print(f"{'carton.load + first infer, warm cache':<52} {warm:8.3f} {warm / base:6.2f} {'1.10':>6}")
    return [("cold", cold, cold / base), ("warm", warm, warm / base)]


def _compare(name: str, in_process: Callable[[np.ndarray], object], model: carton.Model, input_name: str,
             batches: dict[int, np.ndarray], calls: int) -> None:
    for batch, rows in batches.items():
        def call_in_process(rows: np.ndarray = rows) -> object:
            return in_process(rows)

        def call_carton(rows: np.ndarray = rows) -> object:
            return model.infer({input_name: rows})

        for _ in range(max(calls // 10, 5)):  # warm up both paths
            call_in_process()
            call_carton()
        base = _median_time(call_in_process, calls) * 1e6
        ours = _median_time(call_carton, calls) * 1e6
        print(f"{name:<22} {batch:>5} {base:11.1f} {ours:9.1f} {ours - base:9.1f} {ours / base:6.2f}")


def _bench_onnx_mlp(work: Path, calls: int) -> None:
    mlp_path = write_mlp(work / "mlp")
    session = ort.InferenceSession(str(mlp_path), providers=["CPUExecutionProvider"])
    batches = {batch: np.random.default_rng(batch).standard_normal((batch, 16)).astype(np.float32)
               for batch in (1, 256)}
    with carton.load(carton.pack(work / "mlp", runner_name="onnxruntime", required_framework_version="*")) as mlp:
        _compare("onnx MLP 16-32-4", lambda rows: session.run(None, {"x": rows}), mlp, "x", batches, calls)


def bench_infer(work: Path, calls: int) -> None:
    import xgboost as xgb

    print(f"\n## steady-state infer, median of {calls} calls (microseconds)")
    print(f"{'model':<22} {'batch':>5} {'in-process':>11} {'carton':>9} {'overhead':>9} {'ratio':>6}")
    # One model at a time, so one framework's idle threads do not slow the other's measurement.
    _bench_onnx_mlp(work, calls)
    features, target = training_data(rows=1000)
    classifier = xgb.XGBClassifier(n_estimators=100, max_depth=6).fit(features, (target > 0).astype(int))
    packed = carton.pack(classifier, work / "xgb.carton", runner_name="xgboost", required_framework_version="*")
    batches = {batch: np.ascontiguousarray(features[:batch]) for batch in (1, 256)}
    with carton.load(packed) as trees:
        _compare("xgboost 100 trees", classifier.predict_proba, trees, "x", batches, calls)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer repeats and calls (a smoke run)")
    parser.add_argument("--only", default="load,infer", help="comma-separated: load, infer")
    parser.add_argument("--repeats", type=int, default=5, help="load repeats (default 5)")
    args = parser.parse_args()
    repeats = 2 if args.quick else args.repeats
    calls = 50 if args.quick else 500
    only = set(args.only.split(","))
    print(f"onnxruntime {ort.__version__}, carton {carton.__version__}, {os.cpu_count()} CPUs")
    with tempfile.TemporaryDirectory(prefix="carton-bench-runners-") as folder:
        saved = os.environ.get("CARTON_CACHE_DIR")
        os.environ["CARTON_CACHE_DIR"] = str(Path(folder) / "cache")
        try:
            if "load" in only:
                bench_load(Path(folder), repeats)
            if "infer" in only:
                bench_infer(Path(folder), calls)
        finally:
            if saved is None:
                os.environ.pop("CARTON_CACHE_DIR", None)
            else:
                os.environ["CARTON_CACHE_DIR"] = saved


if __name__ == "__main__":
    main()
