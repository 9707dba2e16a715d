"""Load generator for the model server: carton's server vs real Triton, same computation, one run, ratios.

    python bench/bench_server.py [--requests 2000] [--big-requests 20] [--skip-triton]

Starts every server itself: `carton serve` on an ONNX Identity carton, and Triton 2.51 (python backend identity
models) through ../shared/peers/triton.sh when it has been set up (``triton.sh setup``). MLServer is measured when
``mlserver`` is importable (it is not installed here by default). The client is tritonclient.http with binary tensor
data; concurrency 8 uses 8 threads, each with its own client. The client shares the machine's cores with the server,
so at concurrency 8 the figures are bounded by the client as much as by the server.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

TRITON_SH = Path(__file__).resolve().parents[2] / "shared" / "peers" / "triton.sh"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_ready(port: int, timeout: float = 120.0) -> None:
    import tritonclient.http as httpclient

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpclient.InferenceServerClient(f"127.0.0.1:{port}").is_server_ready():
                return
        except Exception:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"server on port {port} did not become ready")


def build_repository(root: Path) -> Path:
    import carton
    import onnx
    from onnx import TensorProto, helper

    repo = root / "repo"
    for name, rank in (("identity", 2), ("identity4", 4)):
        dims = [f"d{i}" for i in range(rank)]
        graph = helper.make_graph(
            [helper.make_node("Identity", ["INPUT0"], ["OUTPUT0"])], name,
            [helper.make_tensor_value_info("INPUT0", TensorProto.FLOAT, dims)],
            [helper.make_tensor_value_info("OUTPUT0", TensorProto.FLOAT, dims)],
        )  # fmt: skip
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        model.ir_version = 8
        folder = root / name
        folder.mkdir()
        onnx.save(model, folder / "model.onnx")
        (repo / name / "1").mkdir(parents=True)
        carton.pack(folder, repo / name / "1" / "model.carton", runner_name="onnxruntime",
                    required_framework_version=">=1.0")  # fmt: skip
    return repo


@contextmanager
def carton_server(repo: Path) -> Iterator[int]:
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "carton", "serve", str(repo), "--http-port", str(port), "--grpc-port", "0"],
    )
    try:
        wait_ready(port)
        yield port
    finally:
        process.terminate()
        process.wait(30)


@contextmanager
def triton_server() -> Iterator[int | None]:
    if not TRITON_SH.exists():
        yield None
        return
    port = free_port()
    env = {**os.environ, "TRITON_HTTP_PORT": str(port), "TRITON_GRPC_PORT": str(free_port())}
    process = subprocess.Popen(
        ["bash", str(TRITON_SH), "start"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True,
    )  # fmt: skip
    try:
        wait_ready(port, 180)
        yield port
    except RuntimeError:
        yield None
    finally:
        os.killpg(process.pid, 15)
        process.wait(30)


def run_load(
    port: int, model: str, shape: tuple[int, ...], concurrency: int, requests: int
) -> tuple[float, float, float]:
    """Returns (p50 ms, p99 ms, requests/s)."""
    import tritonclient.http as httpclient

    data = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    latencies: list[float] = []
    lock = threading.Lock()
    per_thread = max(1, requests // concurrency)

    def worker() -> None:
        client = httpclient.InferenceServerClient(f"127.0.0.1:{port}", network_timeout=300, connection_timeout=300)
        tensor = httpclient.InferInput("INPUT0", list(shape), "FP32")
        tensor.set_data_from_numpy(data)
        client.infer(model, [tensor])  # warm the connection
        mine = []
        for _ in range(per_thread):
            started = time.perf_counter()
            client.infer(model, [tensor]).as_numpy("OUTPUT0")
            mine.append(time.perf_counter() - started)
        with lock:
            latencies.extend(mine)

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - started
    latencies.sort()
    p99 = latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))]
    return statistics.median(latencies) * 1e3, p99 * 1e3, len(latencies) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=2000, help="requests per small-tensor case")
    parser.add_argument("--big-requests", type=int, default=16, help="requests per [64,3,224,224] case")
    parser.add_argument("--skip-triton", action="store_true")
    args = parser.parse_args()
    cases = [
        ("[1,16]", "identity", (1, 16), 1, args.requests),
        ("[1,16]", "identity", (1, 16), 8, args.requests),
        ("[64,3,224,224]", "identity4", (64, 3, 224, 224), 1, args.big_requests),
        ("[64,3,224,224]", "identity4", (64, 3, 224, 224), 8, args.big_requests),
    ]
    results: dict[str, dict[tuple[str, int], tuple[float, float, float]]] = {}
    root = Path(tempfile.mkdtemp(prefix="carton-bench-server-"))
    try:
        repo = build_repository(root)
        servers = [("carton", lambda: carton_server(repo))]
        if not args.skip_triton:
            servers.append(("triton", triton_server))
        for name, start in servers:
            with start() as port:
                if port is None:
                    print(f"{name}: not available, skipped", file=sys.stderr)
                    continue
                results[name] = {}
                for label, model, shape, concurrency, count in cases:
                    results[name][(label, concurrency)] = run_load(port, model, shape, concurrency, count)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    header = f"{'case':<22}{'server':<8}{'p50 ms':>10}{'p99 ms':>10}{'req/s':>10}{'p50 ratio':>11}{'req/s ratio':>13}"
    print(header)
    print("-" * len(header))
    for label, _, _, concurrency, _ in cases:
        key = (label, concurrency)
        reference = results.get("triton", {}).get(key)
        for name in results:
            p50, p99, rate = results[name][key]
            ratio = f"{p50 / reference[0]:.2f}x" if reference else "-"
            rate_ratio = f"{rate / reference[2]:.2f}x" if reference else "-"
            case = f"{label} c={concurrency}"
            print(f"{case:<22}{name:<8}{p50:>10.3f}{p99:>10.3f}{rate:>10.1f}{ratio:>11}{rate_ratio:>13}")
    print("ratios are carton / triton (p50: lower is better; req/s: higher is better)")


if __name__ == "__main__":
    main()
