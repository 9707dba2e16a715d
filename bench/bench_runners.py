"""Built-in runner benchmarks: carton against the framework called in this process, measured in the same run.

    python bench/bench_runners.py [--quick] [--only load,infer] [--repeats N]

1. load: `carton.load` to first inference of a ~100 MB ONNX model (six 2048x2048 float32 MatMuls) versus
   `onnxruntime.InferenceSession` on the same file plus its first run, two references: (A) in this benchmark
   process, which has created sessions of this model before (memory already faulted in and reused); (B) the first
   session of a fresh interpreter that has already started (and, in the "+ import" row, then imports onnxruntime);
   (C) B with the glibc malloc tunables the onnxruntime runner process gets (transparent huge pages for malloc).
   "cold" loads use an empty cache (the model is extracted from the .carton and verified), "warm" loads reuse the
   cache a previous load filled. "no spare" runs with CARTON_SPARE_RUNNERS=0 (every load starts its runner
   process, overlapped with extraction); "spare ready" loads take the idle runner process the previous load left
   (waited for until it is up); "prestart" is the first load after `carton.prestart` on an empty pool (what an
   application that calls it at start-up gets); "back to back" is a load right after the previous one, whose
   spare may still be starting. Every row is measured in each round, rounds interleaved. Goals: cold <= 1.3x,
   warm <= 1.1x.
2. infer: steady-state per-call time of a small ONNX MLP (16 -> 32 -> 4) and of a 100-tree xgboost classifier
   (8 features), batch 1 and 256: `model.infer` versus the in-process framework call (`session.run`,
   `XGBClassifier.predict_proba`), with the per-call overhead (difference) and the ratio. "handed off" is the same
   in-process call made on a worker thread that sleeps between calls (as a server's or a runner's does): an idle
   core runs the next call slower than a core kept busy by a back-to-back loop, which is most of what the
   xgboost rows lose inside the runner process.

Everything is built in a temporary folder that is deleted at the end; nothing is written to the repository.
"""

from __future__ import annotations

import argparse
import os
import shutil
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
from carton_runner_onnx.plugin import MALLOC_TUNABLES
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


_FRESH_CHILD = r"""
import sys, time
import numpy as np
print("ready", flush=True)
sys.stdin.readline()
t0 = time.perf_counter()
import onnxruntime as ort
t1 = time.perf_counter()
session = ort.InferenceSession(sys.argv[1], providers=["CPUExecutionProvider"])
session.run(None, {"x": np.ones((1, 2048), dtype=np.float32)})
t2 = time.perf_counter()
print(t1 - t0, t2 - t1, flush=True)
"""


def _fresh_process_reference(path: Path, tunables: str | None = None) -> tuple[float, float]:
    """(import onnxruntime, first InferenceSession + first run) timed inside a fresh interpreter that has already
    started and imported numpy, so interpreter start-up is not counted; ``tunables`` sets its GLIBC_TUNABLES."""
    import subprocess

    env = dict(os.environ)
    env.pop("GLIBC_TUNABLES", None)
    if tunables is not None:
        env["GLIBC_TUNABLES"] = tunables
    child = subprocess.Popen([sys.executable, "-c", _FRESH_CHILD, str(path)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, env=env)
    assert child.stdin is not None and child.stdout is not None
    if child.stdout.readline().strip() != "ready":
        raise RuntimeError("reference child did not start")
    child.stdin.write("go\n")
    child.stdin.flush()
    import_seconds, session_seconds = (float(value) for value in child.stdout.readline().split())
    child.wait()
    return import_seconds, session_seconds


def bench_load(work: Path, repeats: int) -> list[tuple[str, float, float]]:
    from carton._runtime._spares import SPARE_RUNNERS_ENV, spare_pool

    path = _big_onnx(work / "big")
    size_mb = path.stat().st_size / 1e6
    packed = carton.pack(work / "big", work / "big.carton", runner_name="onnxruntime",
                         required_framework_version="*", compression="stored")
    x = np.ones((1, 2048), dtype=np.float32)
    pool = spare_pool()
    runner = carton._runtime.resolve_runner(carton._runtime.RunnerRequest(
        runner_name="onnxruntime", required_framework_version="*", runner_compat_version=1))

    def forget(cache_name: str) -> None:
        # A user's cache holds each model once; these rounds extract the same model again and again. Keeping every
        # round's 101 MB copy makes each later copy land on guest memory the VM host has not backed yet: 240 ms
        # instead of 28 ms for the same copy_file_range here (docs/performance.md), which measures the VM, not the
        # code. So each round's folder goes once its row is timed.
        shutil.rmtree(work / cache_name, ignore_errors=True)

    def settle() -> None:
        # Every cold load writes 101 MB into a fresh cache folder; without a sync its writeback runs during
        # whatever is timed next (2-3x on some rows of this VM), so each measurement starts with none pending.
        os.sync()

    def reference() -> float:
        """Seconds from `InferenceSession(...)` to the first run's result (freeing the session is not counted)."""
        settle()
        start = time.perf_counter()
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        session.run(None, {"x": x})
        seconds = time.perf_counter() - start
        del session
        return seconds

    def carton_load() -> float:
        """Seconds from `carton.load` to the first inference's result (closing the model is not counted)."""
        settle()
        start = time.perf_counter()
        model = carton.load(packed)
        model.infer({"x": x})
        seconds = time.perf_counter() - start
        model.close()
        return seconds

    def timed(function: Callable[[], object]) -> float:
        settle()
        start = time.perf_counter()
        function()
        return time.perf_counter() - start

    def spares(enabled: bool) -> None:
        os.environ[SPARE_RUNNERS_ENV] = "2" if enabled else "0"
        if not enabled:
            pool.close()

    def spare_ready() -> None:
        if pool.wait(runner, 60) is None:
            raise RuntimeError("the spare runner did not start")

    reference()  # page cache warm for everyone: we compare loading, not disk reads
    rows: dict[str, list[float]] = {}

    def record(name: str, seconds: float) -> None:
        rows.setdefault(name, []).append(seconds)

    from carton._format import open_carton

    for round_index in range(repeats):
        record("ref_warm", reference())
        settle()
        imported, session = _fresh_process_reference(path)
        record("ref_fresh", session)
        record("ref_fresh_import", imported + session)
        settle()
        record("ref_fresh_thp", _fresh_process_reference(path, MALLOC_TUNABLES)[1])
        # No spare runner: every load starts its runner (overlapped with extraction when the cache is cold).
        spares(False)
        os.environ["CARTON_CACHE_DIR"] = str(work / f"cache-{round_index}-a")
        record("open_cold", timed(lambda: open_carton(packed)))
        forget(f"cache-{round_index}-a")
        os.environ["CARTON_CACHE_DIR"] = str(work / f"cache-{round_index}-d")
        settle()
        start = time.perf_counter()
        deferred = open_carton(packed, defer_verification=True)
        record("open_deferred", time.perf_counter() - start)
        if deferred.verification is not None:
            deferred.verification.wait()  # not timed: in carton.load it overlaps the runner's load
        forget(f"cache-{round_index}-d")
        os.environ["CARTON_CACHE_DIR"] = str(work / f"cache-{round_index}-b")
        record("cold_nospare", carton_load())
        record("warm_nospare", carton_load())
        # Spare runners on (the default). First, the application's start-up calls carton.prestart (not timed; the
        # pool is empty), then loads the carton for the first time.
        spares(True)
        carton.prestart(packed).result(timeout=60)
        os.environ["CARTON_CACHE_DIR"] = str(work / f"cache-{round_index}-p")
        record("cold_prestart", carton_load())
        forget(f"cache-{round_index}-p")
        os.environ["CARTON_CACHE_DIR"] = str(work / f"cache-{round_index}-b")
        # The load before leaves a spare for this runner.
        carton_load()
        spare_ready()
        record("warm_spare", carton_load())
        record("warm_spare_b2b", carton_load())  # right after the previous load: its spare may still start
        forget(f"cache-{round_index}-b")
        spare_ready()
        os.environ["CARTON_CACHE_DIR"] = str(work / f"cache-{round_index}-c")
        record("cold_spare", carton_load())
        forget(f"cache-{round_index}-c")
        spare_ready()
    spares(True)
    med = {name: statistics.median(values) for name, values in rows.items()}
    base_warm, base_fresh, base_thp = med["ref_warm"], med["ref_fresh"], med["ref_fresh_thp"]
    base_import = med["ref_fresh_import"]
    labels = [
        ("ref_warm", "reference A: InferenceSession + run, warm process", ""),
        ("ref_fresh", "reference B: same, first session of a fresh process", ""),
        ("ref_fresh_import", "reference B + `import onnxruntime`", ""),
        ("ref_fresh_thp", "reference C: B with the runner's malloc tunables", ""),
        ("open_cold", "open_carton alone, cold cache (extract + verify)", ""),
        ("open_deferred", "carton.load's open alone, cold cache (copy; hash later)", ""),
        ("cold_nospare", "carton.load + infer, cold cache, no spare", "1.30"),
        ("cold_prestart", "carton.prestart, then carton.load + infer, cold cache", "1.30"),
        ("cold_spare", "carton.load + infer, cold cache, spare ready", "1.30"),
        ("warm_nospare", "carton.load + infer, warm cache, no spare", "1.10"),
        ("warm_spare", "carton.load + infer, warm cache, spare ready", "1.10"),
        ("warm_spare_b2b", "carton.load + infer, warm cache, back to back", "1.10"),
    ]
    print(f"\n## load to first inference: {size_mb:.0f} MB ONNX model, median of {repeats} interleaved rounds")
    print(f"{'what':<55} {'seconds':>8} {'vs A':>6} {'vs B':>6} {'vs B+i':>6} {'vs C':>6} {'goal':>6}")
    for key, label, goal in labels:
        value = med[key]
        print(f"{label:<55} {value:8.3f} {value / base_warm:6.2f} {value / base_fresh:6.2f}"
              f" {value / base_import:6.2f} {value / base_thp:6.2f} {goal:>6}")
    print("goals: the first load in a process (cold cache) against B+i, the fresh process's `import onnxruntime` + "
          "first session, without (no spare) and with carton.prestart at start-up; a second load of the same carton "
          "(warm cache, spare ready) against A, a second session in the same process (docs/performance.md)")
    return [(key, med[key], med[key] / base_warm) for key, _, _ in labels]


def _compare(name: str, in_process: Callable[[np.ndarray], object], model: carton.Model, input_name: str,
             batches: dict[int, np.ndarray], calls: int) -> None:
    from concurrent.futures import ThreadPoolExecutor

    handoff = ThreadPoolExecutor(1, thread_name_prefix="bench-handoff")
    for batch, rows in batches.items():
        def call_in_process(rows: np.ndarray = rows) -> object:
            return in_process(rows)

        def call_handed_off(rows: np.ndarray = rows) -> object:
            # The same call on another thread that sleeps between calls, as in a server or a runner process.
            return handoff.submit(in_process, rows).result()

        def call_carton(rows: np.ndarray = rows) -> object:
            return model.infer({input_name: rows})

        for _ in range(max(calls // 10, 5)):  # warm up every path
            call_in_process()
            call_handed_off()
            call_carton()
        base = _median_time(call_in_process, calls) * 1e6
        handed = _median_time(call_handed_off, calls) * 1e6
        ours = _median_time(call_carton, calls) * 1e6
        print(f"{name:<22} {batch:>5} {base:11.1f} {handed:10.1f} {ours:9.1f} {ours - base:9.1f} {ours / base:6.2f}"
              f" {ours / handed:8.2f}")
    handoff.shutdown()


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
    print(f"{'model':<22} {'batch':>5} {'in-process':>11} {'handed off':>10} {'carton':>9} {'overhead':>9} "
          f"{'ratio':>6} {'vs h.off':>8}")
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
