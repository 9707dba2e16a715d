"""A runner's own refusals reach clients typed: a third-party runner's `carton_protocol.InvalidInput` is HTTP 400 and
gRPC ``INVALID_ARGUMENT`` (the client's fault, as when the server itself refuses an input); its other failures are
500 / ``INTERNAL`` with the model's own words and none of the server's internals."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import carton
import grpc
import numpy as np
import pytest
from carton._runtime import plugin_manager
from carton.server import ModelControlMode, Server, ServerOptions, serve_in_thread
from carton_protocol import DType, RunnerSpec, TensorSpec, hookimpl
from triton_calls import infer_grpc, infer_http
from tritonclient.utils import InferenceServerException

HERE = Path(__file__).resolve().parent

PICKY = RunnerSpec(
    runner_name="picky",
    framework_version="1.0.0",
    runner_compat_version=1,
    entry="picky_runner:Picky",
    concurrent=True,
    env=(("PYTHONPATH", str(HERE)),),
)


class _PickyPlugin:
    """Registers the runner as a third party's plugin would (here on the plugin manager, not an entry point)."""

    @hookimpl
    def carton_runners(self) -> list[RunnerSpec]:
        return [PICKY]


@pytest.fixture(scope="module")
def picky_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    manager = plugin_manager()
    plugin = _PickyPlugin()
    manager.register(plugin, name="picky-test-plugin")
    try:
        root = tmp_path_factory.mktemp("picky")
        (root / "model").mkdir()
        (root / "model" / "README").write_text("a runner without a model file")
        version = root / "repo" / "picky" / "1"
        version.mkdir(parents=True)
        carton.pack(
            root / "model", version / "model.carton", runner_name="picky", required_framework_version=">=1.0",
            inputs=[TensorSpec(name="x", dtype=DType.FLOAT32, shape=("n",))],
            outputs=[TensorSpec(name="y", dtype=DType.FLOAT32, shape=("n",))],
        )  # fmt: skip
        options = ServerOptions(
            repository=root / "repo", http_port=0, grpc_port=0, model_control_mode=ModelControlMode.EXPLICIT,
            load_models=("picky",), upload_sandbox=None,
        )  # fmt: skip
        with serve_in_thread(options) as running:
            yield running
    finally:
        manager.unregister(plugin)


def _http(server: Server, x: np.ndarray) -> np.ndarray:
    return infer_http(server.http_port, "picky", "x", x, "FP32", "y")


def _grpc(server: Server, x: np.ndarray) -> np.ndarray:
    assert server.grpc_port is not None
    return infer_grpc(server.grpc_port, "picky", "x", x, "FP32", "y")


def test_a_third_party_runner_serves_and_refuses_typed(picky_server: Server) -> None:
    x = np.array([1.0, 2.5], np.float32)
    np.testing.assert_array_equal(_http(picky_server, x), x * 2)
    np.testing.assert_array_equal(_grpc(picky_server, x), x * 2)

    negative = np.array([1.0, -3.0], np.float32)
    with pytest.raises(InferenceServerException, match=r"input 'x' must not be negative, got -3.0") as http_error:
        _http(picky_server, negative)
    assert http_error.value.status() == "400"
    with pytest.raises(InferenceServerException, match=r"input 'x' must not be negative") as grpc_error:
        _grpc(picky_server, negative)
    assert grpc_error.value.status() == str(grpc.StatusCode.INVALID_ARGUMENT)

    huge = np.array([2e6], np.float32)
    expected = "model 'picky' version 1 failed: this model cannot count that high"
    with pytest.raises(InferenceServerException, match=expected) as http_failure:
        _http(picky_server, huge)
    assert http_failure.value.status() == "500"
    with pytest.raises(InferenceServerException, match=expected) as grpc_failure:
        _grpc(picky_server, huge)
    assert grpc_failure.value.status() == str(grpc.StatusCode.INTERNAL)
    for error in (http_error, grpc_error, http_failure, grpc_failure):
        assert "picky_runner" not in str(error.value) and "ValueError" not in str(error.value)

    np.testing.assert_array_equal(_http(picky_server, x), x * 2)  # the runner survived every refusal
