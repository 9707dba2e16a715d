"""Load generator for the model server: carton's server vs real Triton and MLServer, same computation, one run, ratios.

    python bench/bench_server.py [--requests 2000] [--big-requests 16] [--skip-triton] [--skip-mlserver]
                                 [--stack-requests 2000]

Starts every server itself: `carton serve` on ONNX Identity cartons; Triton 2.51 (python backend identity models)
through ../shared/peers/triton.sh when it has been set up (``triton.sh setup``); MLServer 1.7 (an identity MLModel)
from the venv at $MLSERVER_VENV (default ~/.cache/carton-peers/mlserver-venv, made with ``python -m venv ...;
.../bin/pip install mlserver``: MLServer pins its own FastAPI/uvicorn/grpcio versions, so it is kept out of carton's
environment). The client is tritonclient.http: binary tensor data for carton and Triton, JSON tensors for MLServer
(it has no binary data extension over HTTP); concurrency 8 uses 8 threads, each with its own client.

The stack section serves carton's ASGI application with a zero-cost in-process model (no runner) under uvicorn
(httptools), uvicorn (h11) and granian, so the HTTP stacks are compared on the same app in the same run.
The client shares the machine's 2 cores with the servers, so at concurrency 8 the client bounds the figures as much
as the servers do.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
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
from typing import Any

import numpy as np

TRITON_SH = Path(__file__).resolve().parents[2] / "shared" / "peers" / "triton.sh"
MLSERVER_VENV = Path(os.environ.get("MLSERVER_VENV", Path.home() / ".cache" / "carton-peers" / "mlserver-venv"))

MLSERVER_MODEL = """
from mlserver import MLModel
from mlserver.codecs import NumpyCodec
from mlserver.types import InferenceRequest, InferenceResponse


class Identity(MLModel):
    async def load(self) -> bool:
        return True

    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        array = NumpyCodec.decode_input(payload.inputs[0])
        return InferenceResponse(model_name=self.name, outputs=[NumpyCodec.encode_output("OUTPUT0", array)])
"""


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


def stop_group(process: subprocess.Popen[bytes], timeout: float = 30) -> None:
    """SIGTERM the child's process group, then SIGKILL it if it has not exited within `timeout`."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout)


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
        start_new_session=True,
    )
    try:
        wait_ready(port)
        yield port
    finally:
        stop_group(process)


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
        stop_group(process)


@contextmanager
def mlserver_server(root: Path) -> Iterator[int | None]:
    binary = MLSERVER_VENV / "bin" / "mlserver"
    if not binary.exists():
        yield None
        return
    import json

    folder = root / "mlserver"
    http, grpc, metrics = free_port(), free_port(), free_port()
    for name in ("identity", "identity4"):
        (folder / name).mkdir(parents=True)
        (folder / name / "identity_model.py").write_text(MLSERVER_MODEL)
        (folder / name / "model-settings.json").write_text(
            json.dumps({"name": name, "implementation": "identity_model.Identity"})
        )
    # parallel_workers 0: inference in MLServer's main process (its worker processes die at start here with
    # "There is no current event loop in thread 'MainThread'"); one process, like carton's server and its runner.
    settings = {"host": "127.0.0.1", "http_port": http, "grpc_port": grpc, "metrics_port": metrics}
    (folder / "settings.json").write_text(json.dumps({**settings, "parallel_workers": 0}))
    process = subprocess.Popen(
        [str(binary), "start", str(folder)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True,
    )  # fmt: skip
    try:
        wait_ready(http, 180)
        yield http
    except RuntimeError:
        yield None
    finally:
        stop_group(process)


STACKS = ("uvicorn-httptools", "uvicorn-h11", "granian")


def stack_child(stack: str, port: int, root: Path) -> None:
    """Serve carton's ASGI app with a zero-cost in-process identity model under `stack` (a bench child process).

    `root` is a folder the parent made inside its own temporary folder, so the parent's cleanup removes it however
    this child ends (the parent stops it with SIGTERM, or SIGKILLs it if that fails)."""
    import uvloop
    from carton.server._http import HttpApp
    from carton.server._repository import ModelRepository, RepositoryOptions
    from carton.server._stats import ServerMetrics
    from carton_protocol import DType, TensorSpec

    class Echo:
        inputs = (TensorSpec(name="INPUT0", dtype=DType.FLOAT32, shape=("a", "b")),)
        outputs = (TensorSpec(name="OUTPUT0", dtype=DType.FLOAT32, shape=("a", "b")),)

        async def infer(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
            return {"OUTPUT0": inputs["INPUT0"]}

        def close(self) -> None:
            pass

    async def main() -> None:
        (root / "identity" / "1").mkdir(parents=True)
        (root / "identity" / "1" / "model.carton").write_bytes(b"")
        metrics = ServerMetrics()
        repo = ModelRepository(
            root, loader=lambda spec: Echo(), metrics=metrics, upload_root=root / "uploads",
            options=RepositoryOptions(explicit=False),
        )  # fmt: skip
        await repo.load_at_startup("identity")
        app = HttpApp(repo, metrics, max_body_size=1 << 28, server_version="bench")
        if stack == "granian":
            from granian.constants import Interfaces
            from granian.server.embed import Server as Granian

            await Granian(app, "127.0.0.1", port, interface=Interfaces.ASGI, log_enabled=False).serve()
        else:
            import uvicorn

            config = uvicorn.Config(
                app, host="127.0.0.1", port=port, http=stack.split("-")[1], loop="none", lifespan="off",
                access_log=False, proxy_headers=False, interface="asgi3", log_level="warning",
            )  # fmt: skip
            await uvicorn.Server(config).serve()

    uvloop.run(main())


@contextmanager
def stack_server(stack: str, root: Path) -> Iterator[int | None]:
    port = free_port()
    folder = Path(tempfile.mkdtemp(prefix=f"stack-{stack}-", dir=root))
    command = [sys.executable, __file__, "--stack-child", stack, str(port), str(folder)]
    process = subprocess.Popen(command, start_new_session=True)
    try:
        wait_ready(port, 60)
        yield port
    except RuntimeError:
        yield None
    finally:
        stop_group(process)
        shutil.rmtree(folder, ignore_errors=True)


def run_load(
    port: int, model: str, shape: tuple[int, ...], concurrency: int, requests: int, *, binary: bool = True
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
        tensor.set_data_from_numpy(data, binary_data=binary)
        outputs = [httpclient.InferRequestedOutput("OUTPUT0", binary_data=binary)]
        client.infer(model, [tensor], outputs=outputs)  # warm the connection
        mine = []
        for _ in range(per_thread):
            started = time.perf_counter()
            client.infer(model, [tensor], outputs=outputs).as_numpy("OUTPUT0")
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


def print_table(
    title: str,
    cases: list[tuple[str, int]],
    results: dict[str, dict[tuple[str, int], tuple[float, ...]]],
    reference: str,
) -> None:
    print(f"\n{title}")
    header = f"{'case':<22}{'server':<19}{'p50 ms':>10}{'p99 ms':>10}{'req/s':>10}{'p50 ratio':>11}{'req/s ratio':>13}"
    print(header)
    print("-" * len(header))
    for key in cases:
        base = results.get(reference, {}).get(key)
        for name in results:
            if key not in results[name]:
                continue
            p50, p99, rate = results[name][key]
            ratio = f"{p50 / base[0]:.2f}x" if base else "-"
            rate_ratio = f"{rate / base[2]:.2f}x" if base else "-"
            case = f"{key[0]} c={key[1]}"
            print(f"{case:<22}{name:<19}{p50:>10.3f}{p99:>10.3f}{rate:>10.1f}{ratio:>11}{rate_ratio:>13}")
    print(f"ratios are server / {reference} (p50: lower is better; req/s: higher is better)")


def main() -> None:
    if len(sys.argv) == 5 and sys.argv[1] == "--stack-child":
        stack_child(sys.argv[2], int(sys.argv[3]), Path(sys.argv[4]))
        return
    # SIGTERM (a CI timeout, `kill`) unwinds like Ctrl-C, so every `finally` below stops its server and the
    # temporary folder is removed on every exit path.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=2000, help="requests per small-tensor case")
    parser.add_argument("--big-requests", type=int, default=16, help="requests per [64,3,224,224] case")
    parser.add_argument("--stack-requests", type=int, default=2000, help="requests per HTTP-stack case (0: skip)")
    parser.add_argument("--skip-triton", action="store_true")
    parser.add_argument("--skip-mlserver", action="store_true")
    args = parser.parse_args()
    cases = [
        ("[1,16]", "identity", (1, 16), 1, args.requests),
        ("[1,16]", "identity", (1, 16), 8, args.requests),
        ("[64,3,224,224]", "identity4", (64, 3, 224, 224), 1, args.big_requests),
        ("[64,3,224,224]", "identity4", (64, 3, 224, 224), 8, args.big_requests),
    ]
    results: dict[str, dict[tuple[str, int], tuple[float, ...]]] = {}
    stacks: dict[str, dict[tuple[str, int], tuple[float, ...]]] = {}
    root = Path(tempfile.mkdtemp(prefix="carton-bench-server-"))
    try:
        repo = build_repository(root)
        servers: list[tuple[str, Any, bool]] = [("carton", lambda: carton_server(repo), True)]
        if not args.skip_triton:
            servers.append(("triton", triton_server, True))
        if not args.skip_mlserver:
            servers.append(("mlserver (JSON)", lambda: mlserver_server(root), False))
        for name, start, binary in servers:
            with start() as port:
                if port is None:
                    print(f"{name}: not available, skipped", file=sys.stderr)
                    continue
                results[name] = {}
                for label, model, shape, concurrency, count in cases:
                    if not binary and label != "[1,16]":
                        count = min(count, 2)  # JSON lists of 9.6M floats take seconds each
                    results[name][(label, concurrency)] = run_load(
                        port, model, shape, concurrency, count, binary=binary
                    )
        if args.stack_requests:
            for stack in STACKS:
                with stack_server(stack, root) as port:
                    if port is None:
                        print(f"stack {stack}: not available, skipped", file=sys.stderr)
                        continue
                    stacks[stack] = {
                        ("[1,16] echo", c): run_load(port, "identity", (1, 16), c, args.stack_requests) for c in (1, 8)
                    }
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print_table("servers (same identity computation)", [(c[0], c[3]) for c in cases], results, "triton")
    if stacks:
        print_table(
            "HTTP stacks: carton's ASGI app, zero-cost in-process model (no runner)",
            [("[1,16] echo", 1), ("[1,16] echo", 8)], stacks, "uvicorn-httptools",
        )  # fmt: skip


if __name__ == "__main__":
    main()
