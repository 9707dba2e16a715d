"""An mcf model behind `carton serve`: a token id outside the vocabulary, which only the runner can check, is the
client's mistake on both protocols (HTTP 400, gRPC ``INVALID_ARGUMENT``), and the model keeps serving."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import carton
import numpy as np
import pytest

pytest.importorskip("tritonclient.http")
pytest.importorskip("tritonclient.grpc")
pytest.importorskip("grpc")

import grpc
from carton.server import ModelControlMode, Server, ServerOptions, serve_in_thread
from mcf_runner_models import infer_logits, max_relative_error
from triton_calls import infer_grpc, infer_http
from tritonclient.utils import InferenceServerException


@pytest.fixture(scope="module")
def mcf_server(mcf_model: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    repo = tmp_path_factory.mktemp("mcf-served") / "repo"
    (repo / "tiny" / "1").mkdir(parents=True)
    carton.pack(
        mcf_model("base"), repo / "tiny" / "1" / "model.carton", runner_name="mcf", required_framework_version=">=0.1"
    )
    options = ServerOptions(
        repository=repo, http_port=0, grpc_port=0, model_control_mode=ModelControlMode.EXPLICIT,
        load_models=("tiny",), upload_sandbox=None,
    )  # fmt: skip
    with serve_in_thread(options) as running:
        yield running


def _http(server: Server, ids: np.ndarray) -> np.ndarray:
    return infer_http(server.http_port, "tiny", "input_ids", ids, "INT64", "logits")


def _grpc(server: Server, ids: np.ndarray) -> np.ndarray:
    assert server.grpc_port is not None
    return infer_grpc(server.grpc_port, "tiny", "input_ids", ids, "INT64", "logits")


def test_a_token_outside_the_vocabulary_is_a_client_error(mcf_server: Server, mcf_model: Callable[..., Path]):
    outside = np.array([[3, 600]], np.int64)
    message = r"'input_ids'\[0, 1\] = 600 is outside the vocabulary \[0, 512\)"
    with pytest.raises(InferenceServerException, match=message) as http_error:
        _http(mcf_server, outside)
    assert http_error.value.status() == "400"
    with pytest.raises(InferenceServerException, match=message) as grpc_error:
        _grpc(mcf_server, outside)
    assert grpc_error.value.status() == str(grpc.StatusCode.INVALID_ARGUMENT)
    for error in (http_error, grpc_error):
        assert "carton_runner_mcf" not in str(error.value) and "InvalidInput" not in str(error.value)

    ids = np.array([[3, 1, 4, 1, 5]], np.int64)
    expected = infer_logits(mcf_model("base"), {"input_ids": ids})
    assert max_relative_error(_http(mcf_server, ids), expected) < 1e-5
    assert max_relative_error(_grpc(mcf_server, ids), expected) < 1e-5
