"""The servers bench_server.py measures (and the benches that reuse them: bench_ray.py, bench_processes.py,
bench_runtime.py): the ONNX identity repository they serve, `carton serve`, Triton through its peer script and
MLServer from its own venv, each started in its own process group and stopped with it. (Imported as a sibling: the
bench scripts run from this directory.)
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path


def _find_triton_sh() -> Path:
    """$TRITON_SH, else ``shared/peers/triton.sh`` beside the checkout or beside one of its parent folders (a
    worktree of the repository sits one level deeper than the main checkout)."""
    if "TRITON_SH" in os.environ:
        return Path(os.environ["TRITON_SH"])
    for folder in Path(__file__).resolve().parents[1:]:
        candidate = folder.parent / "shared" / "peers" / "triton.sh"
        if candidate.exists():
            return candidate
    return Path(__file__).resolve().parents[2] / "shared" / "peers" / "triton.sh"


TRITON_SH = _find_triton_sh()
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


@dataclass(frozen=True, slots=True)
class Served:
    """A running server: its ports and the pid whose process tree (runners included) does its work."""

    name: str
    http: int
    grpc: int
    pid: int


@contextmanager
def carton_served(repo: Path, *extra: str, python: str = sys.executable, name: str = "carton") -> Iterator[Served]:
    http, grpc = free_port(), free_port()
    command = [python, "-m", "carton", "serve", str(repo), "--http-port", str(http), "--grpc-port", str(grpc)]
    process = subprocess.Popen([*command, *extra], start_new_session=True)
    try:
        wait_ready(http)
        yield Served(name, http, grpc, process.pid)
    finally:
        stop_group(process)


@contextmanager
def carton_server(repo: Path) -> Iterator[int]:
    with carton_served(repo) as served:
        yield served.http


@contextmanager
def triton_served() -> Iterator[Served | None]:
    if not TRITON_SH.exists():
        yield None
        return
    http, grpc = free_port(), free_port()
    env = {**os.environ, "TRITON_HTTP_PORT": str(http), "TRITON_GRPC_PORT": str(grpc)}
    process = subprocess.Popen(
        ["bash", str(TRITON_SH), "start"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True,
    )  # fmt: skip
    try:
        try:
            wait_ready(http, 180)
        except RuntimeError:
            yield None
            return
        yield Served("triton", http, grpc, process.pid)
    finally:
        stop_group(process)


@contextmanager
def triton_server() -> Iterator[int | None]:
    with triton_served() as served:
        yield None if served is None else served.http


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
