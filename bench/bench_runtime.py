"""Runtime benchmarks: what `carton.load` / `Model` add on top of the wire, measured against references in one run.

    python bench/bench_runtime.py [--quick] [--only small,workers,load,hop]

1. small: p50/p99 of a [1,16] float32 `Model.infer` (inputs and outputs checked against declared specs) vs the
   same call on the bare `RunnerProcess` and vs a raw pyzmq REQ/REP round trip of the same bytes between two
   processes. The issue's goal: <= 1.3x the raw round trip and < 100 us p50.
2. workers: throughput of a CPU-bound runner that holds the GIL (it spins 2 ms per call) with 4 client threads,
   `workers=1` vs `workers=2` (this machine has `os.cpu_count()` cores).
3. load: runner discovery, and `carton.load` of a packed carton to its first inference vs starting the same
   runner by hand (`RunnerProcess.start` + `load` + `infer`).
4. hop (not in the default run): `Model.infer` of a [1,16] ONNX identity carton against the raw pyzmq REQ/REP round
   trip, interleaved, split by thread of each process (the calling or serving thread, ZeroMQ's I/O thread, any
   other): CPU time and context switches per call, from /proc. The switches count the hand-offs between threads,
   which do not move with the machine's load; the CPU split says which thread the difference is in.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import carton
import numpy as np
import zmq
from _timing import percentiles, timed
from carton._runtime import RunnerProcess, discover, plugin_manager
from carton._workflows import load_unpacked
from carton_protocol import DType, RunnerSpec, TensorSpec, hookimpl

ROOT = Path(__file__).resolve().parent.parent
RUNNERS_DIR = ROOT / "tests" / "runtime"


def spec(entry: str, name: str, concurrent: bool = False) -> RunnerSpec:
    return RunnerSpec(
        runner_name=name,
        framework_version="1.0.0",
        runner_compat_version=1,
        entry=f"runtime_test_runners:{entry}",
        concurrent=concurrent,
        env=(("PYTHONPATH", str(RUNNERS_DIR)),),
    )


class BenchPlugin:
    @hookimpl
    def carton_runners(self) -> list[RunnerSpec]:
        return [
            spec("Passthrough", "bench-passthrough"),
            spec("Spin", "bench-spin"),
            spec("Affine", "bench-affine", concurrent=True),
        ]


def _rep_server(endpoint: str, ready: object) -> None:
    context = zmq.Context()
    sock = context.socket(zmq.REP)
    sock.bind(endpoint)
    ready.set()  # type: ignore[attr-defined]
    while True:
        frames = sock.recv_multipart(copy=False)
        if len(frames) == 1 and frames[0].bytes == b"stop":
            sock.send(b"")
            return
        sock.send_multipart(frames, copy=False)


class RawZmq:
    """A REQ socket talking to a REP echo server in another process over ipc://."""

    def __init__(self) -> None:
        base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
        self.path = base / f"carton-bench-runtime-{os.getpid()}.sock"
        self.endpoint = f"ipc://{self.path}"
        ctx = multiprocessing.get_context("spawn")
        ready = ctx.Event()
        self.server = ctx.Process(target=_rep_server, args=(self.endpoint, ready), daemon=True)
        self.server.start()
        ready.wait()
        self.context = zmq.Context()
        self.sock = self.context.socket(zmq.REQ)
        self.sock.connect(self.endpoint)

    def call(self, frames: list[bytes]) -> None:
        self.sock.send_multipart(frames, copy=False)
        self.sock.recv_multipart(copy=False)

    def close(self) -> None:
        self.sock.send(b"stop")
        self.sock.recv()
        self.server.join()
        self.context.destroy()
        # The echo server's process ends without closing its bound socket, so its file would stay behind.
        self.path.unlink(missing_ok=True)


def row(name: str, samples: list[float], reference: float) -> str:
    p50, p99 = percentiles(samples)
    return f"| {name:<52} | {p50 * 1e6:>8.1f} us | {p99 * 1e6:>8.1f} us | {p50 / reference:>5.2f}x |"


def bench_small(repeat: int) -> None:
    x = np.random.default_rng(0).random((1, 16), dtype=np.float32)
    frames = raw_infer_frames({"x": x})
    declared = (TensorSpec(name="x", dtype=DType.FLOAT32, shape=("batch", 16)),)
    outputs = (TensorSpec(name="x", dtype=DType.FLOAT32, shape=("batch", 16)),)
    with tempfile.TemporaryDirectory() as folder:
        model = load_unpacked(
            folder, runner_name="bench-passthrough", required_framework_version="*", inputs=declared, outputs=outputs
        )
        bare = load_unpacked(folder, runner_name="bench-passthrough", required_framework_version="*")
        process = RunnerProcess.start(spec("Passthrough", "bench-passthrough"))
        process.load(model_dir=Path(folder), opts={}, inputs=(), outputs=())
        raw = RawZmq()
        results: dict[str, list[float]] = {name: [] for name in ("raw", "process", "model", "bare")}
        calls: dict[str, Callable[[], object]] = {
            "raw": lambda: raw.call(frames),
            "process": lambda: process.infer({"x": x}),
            "model": lambda: model.infer({"x": x}),
            "bare": lambda: bare.infer({"x": x}),
        }
        try:
            # interleave rounds so that machine noise hits every path alike
            rounds = 10
            for _ in range(rounds):
                for name, call in calls.items():
                    results[name] += timed(call, repeat // rounds, warmup=50)
        finally:
            raw.close()
            process.close()
            model.close()
            bare.close()
    reference = percentiles(results["raw"])[0]
    print(f"\n## small: [1,16] float32 round trip, {repeat} calls per path (interleaved)\n")
    print(f"| {'path':<52} | {'p50':>11} | {'p99':>11} | ratio |")
    print(f"|{'-' * 54}|{'-' * 13}|{'-' * 13}|-------|")
    print(row("raw pyzmq REQ/REP, same bytes (reference)", results["raw"], reference))
    print(row("RunnerProcess.infer (the wire alone)", results["process"], reference))
    print(row("Model.infer, no declared specs", results["bare"], reference))
    print(row("Model.infer, inputs+outputs checked against specs", results["model"], reference))


def _throughput(model: carton.Model, threads: int, seconds: float) -> float:
    x = np.array([[2.0]], np.float32)  # Spin: 2 ms of pure-Python work per call
    counts = [0] * threads
    stop = time.perf_counter() + seconds

    def client(index: int) -> None:
        while time.perf_counter() < stop:
            model.infer({"x": x})
            counts[index] += 1

    workers = [threading.Thread(target=client, args=(i,)) for i in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    return sum(counts) / seconds


def bench_workers(seconds: float) -> None:
    print(f"\n## workers: CPU-bound runner (2 ms of GIL-holding work per call), 4 client threads, {seconds:g} s each\n")
    print(f"| {'model':<20} | {'calls/s':>9} | ratio |")
    print(f"|{'-' * 22}|{'-' * 11}|-------|")
    with tempfile.TemporaryDirectory() as folder:
        rates: list[float] = []
        for workers in (1, 2):
            with load_unpacked(
                folder, runner_name="bench-spin", required_framework_version="*", workers=workers
            ) as model:
                _throughput(model, 4, 0.5)  # warm up
                rates.append(_throughput(model, 4, seconds))
            print(f"| {f'workers={workers}':<20} | {rates[-1]:>9.0f} | {rates[-1] / rates[0]:>5.2f}x |")
    print(f"\n(os.cpu_count() = {os.cpu_count()}; one calls/s at 2 ms/call is ~500 per core)")


def bench_load(repeat: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp, "model")
        folder.mkdir()
        (folder / "offset.txt").write_text("0.5")
        path = carton.pack(
            folder, Path(tmp, "affine.carton"), runner_name="bench-affine", required_framework_version="*"
        )
        x = np.ones((1, 4), np.float32)

        def by_hand() -> None:
            process = RunnerProcess.start(spec("Affine", "bench-affine", concurrent=True))
            process.load(model_dir=folder, opts={}, inputs=(), outputs=())
            process.infer({"x": x})
            process.close()

        def through_load() -> None:
            with carton.load(path) as model:
                model.infer({"x": x})

        discovery = timed(lambda: discover(), repeat * 5, warmup=2)
        hand: list[float] = []
        loaded: list[float] = []
        for _ in range(repeat):  # interleaved; the carton's model/ is in the cache after the warm-up call
            loaded += timed(through_load, 1, warmup=0 if loaded else 1)
            hand += timed(by_hand, 1, warmup=0)
    reference = percentiles(hand)[0]
    print(f"\n## load: {repeat} loads each (interleaved)\n")
    print(f"| {'step':<60} | {'p50':>9} | ratio |")
    print(f"|{'-' * 62}|{'-' * 11}|-------|")
    print(f"| {'RunnerProcess.start + load + infer + close (reference)':<60} | {reference * 1e3:>6.1f} ms | 1.00x |")
    p50 = percentiles(loaded)[0]
    print(f"| {'carton.load(.carton, cached) + infer + close':<60} | {p50 * 1e3:>6.1f} ms | {p50 / reference:>5.2f}x |")
    d50 = percentiles(discovery)[0]
    print(
        f"| {'discover(): every plugin carton_runners() (part of load)':<60} | {d50 * 1e3:>6.2f} ms | "
        f"{d50 / reference:>5.2f}x |"
    )


def _thread_usage(pid: int) -> dict[int, tuple[str, int, int]]:
    """Each thread of process `pid`: its role (``main``, the thread whose id is the pid; ``io``, a ZeroMQ I/O
    thread; ``other``), nanoseconds on the CPU and context switches so far (from /proc)."""
    usage = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        folder = Path(f"/proc/{pid}/task/{tid}")
        try:
            name = (folder / "comm").read_text().strip()
            cpu = int((folder / "schedstat").read_text().split()[0])
            status = (folder / "status").read_text().splitlines()
        except (OSError, ValueError):
            continue  # the thread ended meanwhile
        switches = sum(int(line.split()[1]) for line in status if "ctxt_switches:" in line)
        role = "main" if int(tid) == pid else "io" if name.startswith("ZMQbg/IO") else "other"
        usage[int(tid)] = (role, cpu, switches)
    return usage


def raw_infer_frames(tensors: dict[str, np.ndarray]) -> list[bytes]:
    """The frames of an infer request carrying ``tensors`` inline, as the host sends it: what the raw REQ/REP
    reference sends and its echo server answers."""
    from carton_protocol import Infer
    from carton_protocol._framing import encode_tensors
    from carton_protocol._messages import encode

    encoded = encode_tensors(tensors, pool=None, threshold=1 << 62)
    return [encode(Infer(id=1, tensors=encoded.entries)), *(array.tobytes() for array in tensors.values())]


@dataclass(frozen=True, slots=True, kw_only=True)
class Hop:
    """`measure_hop`'s result, by path (``model``: `Model.infer`; ``raw``: the REQ/REP round trip): each timed call's
    seconds, and by (side, role) of a thread (side ``caller`` or ``peer``; role as `_thread_usage` says) its CPU
    nanoseconds and context switches over all the timed calls."""

    samples: dict[str, list[float]]
    totals: dict[str, dict[tuple[str, str], list[int]]]
    rounds: int

    def round_ratios(self) -> list[float]:
        """Each round's p50 of `Model.infer` over its p50 of the raw round trip: the two blocks of a round ran back to
        back, so a ratio compares them under the same load (a pooled p50 can pair one path's fast rounds with the
        other's slow ones on a machine whose speed drifts)."""
        size = len(self.samples["raw"]) // self.rounds
        return [
            statistics.median(self.samples["model"][at : at + size])
            / statistics.median(self.samples["raw"][at : at + size])
            for at in range(0, size * self.rounds, size)
        ]

    def per_call(self, path: str, side: str, role: str | None = None) -> tuple[float, float]:
        """CPU microseconds and switches per call of ``path`` on ``side``'s threads of ``role`` (None: all)."""
        picked = [total for (at, kind), total in self.totals[path].items() if at == side and role in (None, kind)]
        calls = len(self.samples[path])
        return sum(total[0] for total in picked) / 1e3 / calls, sum(total[1] for total in picked) / calls


def measure_hop(model_file: Path, calls: int, rounds: int = 10) -> Hop:
    """`Model.infer` of ``model_file`` (the [1,16] FP32 identity carton, input ``INPUT0``) against a raw pyzmq REQ/REP
    round trip of the same bytes between two processes, interleaved in ``rounds``, each path warmed before its block:
    every call's time, and each thread's CPU time and switches (from /proc) in both processes."""
    x = np.random.default_rng(0).random((1, 16), dtype=np.float32)
    frames = raw_infer_frames({"INPUT0": x})
    raw = RawZmq()
    model = carton.load(model_file)
    try:
        model.infer({"INPUT0": x})
        process = model._workers[0].process
        assert process is not None and process.runner_pid is not None and raw.server.pid is not None
        pids = {"raw": (os.getpid(), raw.server.pid), "model": (os.getpid(), process.runner_pid)}
        paths: dict[str, Callable[[], object]] = {
            "raw": lambda: raw.call(frames),
            "model": lambda: model.infer({"INPUT0": x}),
        }
        hop = Hop(samples={name: [] for name in paths}, totals={name: {} for name in paths}, rounds=rounds)
        for _ in range(rounds):
            for name, call in paths.items():
                for _ in range(50):
                    call()
                before = [_thread_usage(pid) for pid in pids[name]]
                for _ in range(calls // rounds):
                    started = time.perf_counter()
                    call()
                    hop.samples[name].append(time.perf_counter() - started)
                after = [_thread_usage(pid) for pid in pids[name]]
                for side, first, last in zip(("caller", "peer"), before, after, strict=True):
                    for tid, (role, cpu, switches) in last.items():
                        start = first.get(tid, (role, 0, 0))  # a thread started meanwhile counts from 0
                        total = hop.totals[name].setdefault((side, role), [0, 0])
                        total[0] += cpu - start[1]
                        total[1] += switches - start[2]
    finally:
        model.close()
        raw.close()
    return hop


def bench_hop(calls: int) -> None:
    """`Model.infer` of the ONNX identity carton vs raw REQ/REP, with CPU and switches per call by thread."""
    from _servers import build_repository

    rounds = 10
    with tempfile.TemporaryDirectory() as folder:
        hop = measure_hop(build_repository(Path(folder)) / "identity" / "1" / "model.carton", calls, rounds)
    raw_p50, model_p50 = (percentiles(hop.samples[name])[0] for name in ("raw", "model"))
    print(
        f"\n## The hop by thread: Model.infer of a [1,16] ONNX identity carton vs raw pyzmq REQ/REP "
        f"({calls} calls each, {rounds} interleaved rounds, load {os.getloadavg()[0]:.2f})\n"
    )
    ratios = hop.round_ratios()
    print(
        f"p50: Model.infer {model_p50 * 1e6:.1f} us, raw {raw_p50 * 1e6:.1f} us; "
        f"ratio {statistics.median(ratios):.2f}x, the median of the rounds' own "
        f"({min(ratios):.2f}-{max(ratios):.2f}x)\n"
    )
    print("| thread | Model.infer CPU per call | switches per call | raw CPU per call | switches per call |")
    print("|---|---|---|---|---|")
    labels = {
        ("caller", "main"): "calling thread",
        ("caller", "io"): "caller's ZeroMQ I/O thread",
        ("caller", "other"): "caller's other threads",
        ("peer", "main"): "runner (raw: REP server) thread",
        ("peer", "io"): "peer's ZeroMQ I/O thread",
        ("peer", "other"): "peer's other threads",
    }
    for (side, role), label in labels.items():
        cells = []
        for name in ("model", "raw"):
            cpu, switches = hop.per_call(name, side, role)
            cells += [f"{cpu:.1f} us", f"{switches:.2f}"]
        print(f"| {label} | {' | '.join(cells)} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (a smoke run)")
    parser.add_argument("--only", default="small,workers,load", help="comma-separated sections to run (also: hop)")
    args = parser.parse_args()
    sections = set(args.only.split(","))
    warnings.simplefilter("ignore", carton.CartonWarning)
    plugin_manager().register(BenchPlugin(), name="bench-runtime")
    print(
        f"python {sys.version.split()[0]}, numpy {np.__version__}, pyzmq {zmq.__version__}, "
        f"{os.cpu_count()} cpu(s), {carton.target_triple()}"
    )
    if "small" in sections:
        bench_small(2000 if args.quick else 20000)
    if "workers" in sections:
        bench_workers(1.0 if args.quick else 4.0)
    if "load" in sections:
        bench_load(5 if args.quick else 20)
    if "hop" in sections:
        bench_hop(2000 if args.quick else 10000)


if __name__ == "__main__":
    main()
