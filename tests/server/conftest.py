"""Real cartons for the server tests: ONNX graphs built with onnx.helper, packed with carton.pack, served through the
real runtime (`carton.load`) by a server on free 127.0.0.1 ports."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
pytest.importorskip("tritonclient.http")
pytest.importorskip("tritonclient.grpc")

import carton  # noqa: E402
from carton.server import ModelControlMode, Server, ServerOptions, serve_in_thread  # noqa: E402
from onnx import TensorProto, helper  # noqa: E402


def _onnx_model(nodes: list, inputs: list, outputs: list, initializers: list | None = None) -> object:
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=initializers or [])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def _pack(model: object, folder: Path, output: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    onnx.save(model, folder / "model.onnx")
    output.parent.mkdir(parents=True, exist_ok=True)
    return carton.pack(folder, output, runner_name="onnxruntime", required_framework_version=">=1.0")


def _vi(name: str, elem: int, shape: list) -> object:
    return helper.make_tensor_value_info(name, elem, shape)


@pytest.fixture(scope="session")
def cartons(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """name -> packed .carton file."""
    root = tmp_path_factory.mktemp("cartons")
    built: dict[str, Path] = {}
    fp32 = TensorProto.FLOAT
    built["identity"] = _pack(
        _onnx_model([helper.make_node("Identity", ["INPUT0"], ["OUTPUT0"])],
                    [_vi("INPUT0", fp32, ["a", "b"])], [_vi("OUTPUT0", fp32, ["a", "b"])]),
        root / "identity", root / "identity.carton",
    )  # fmt: skip
    built["double"] = _pack(
        _onnx_model([helper.make_node("Mul", ["INPUT0", "two"], ["OUTPUT0"])],
                    [_vi("INPUT0", fp32, ["a", "b"])], [_vi("OUTPUT0", fp32, ["a", "b"])],
                    [helper.make_tensor("two", fp32, [], [2.0])]),
        root / "double", root / "double.carton",
    )  # fmt: skip
    built["sum"] = _pack(
        _onnx_model([helper.make_node("Add", ["INPUT0", "INPUT1"], ["OUTPUT0"]),
                     helper.make_node("Sub", ["INPUT0", "INPUT1"], ["OUTPUT1"])],
                    [_vi("INPUT0", TensorProto.INT64, ["n"]), _vi("INPUT1", TensorProto.INT64, ["n"])],
                    [_vi("OUTPUT0", TensorProto.INT64, ["n"]), _vi("OUTPUT1", TensorProto.INT64, ["n"])]),
        root / "sum", root / "sum.carton",
    )  # fmt: skip
    built["batched"] = _pack(
        _onnx_model([helper.make_node("Mul", ["INPUT0", "two"], ["OUTPUT0"])],
                    [_vi("INPUT0", fp32, ["batch", 4])], [_vi("OUTPUT0", fp32, ["batch", 4])],
                    [helper.make_tensor("two", fp32, [], [2.0])]),
        root / "batched", root / "batched.carton",
    )  # fmt: skip
    built["strings"] = _pack(
        _onnx_model([helper.make_node("Identity", ["TEXT"], ["ECHO"])],
                    [_vi("TEXT", TensorProto.STRING, ["n"])], [_vi("ECHO", TensorProto.STRING, ["n"])]),
        root / "strings", root / "strings.carton",
    )  # fmt: skip
    return built


def make_repository(root: Path, cartons: dict[str, Path]) -> Path:
    """identity (versions 1 and 2; 2 doubles), sum (REPO/sum.carton), batched (dynamic batching), strings, broken."""
    repo = root / "repo"
    repo.mkdir()
    for version, source in ((1, "identity"), (2, "double")):
        (repo / "identity" / str(version)).mkdir(parents=True)
        shutil.copy(cartons[source], repo / "identity" / str(version) / "model.carton")
    shutil.copy(cartons["sum"], repo / "sum.carton")
    (repo / "batched" / "1").mkdir(parents=True)
    shutil.copy(cartons["batched"], repo / "batched" / "1" / "model.carton")
    (repo / "batched" / "config.json").write_text(
        json.dumps(
            {
                "max_batch_size": 8,
                "dynamic_batching": {"max_queue_delay_microseconds": 20000, "preferred_batch_size": [8]},
            }
        )
    )
    (repo / "strings" / "1").mkdir(parents=True)
    shutil.copy(cartons["strings"], repo / "strings" / "1" / "model.carton")
    (repo / "broken" / "1").mkdir(parents=True)
    (repo / "broken" / "1" / "model.carton").write_bytes(b"PK\x03\x04 this is not a carton")
    return repo


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory, cartons: dict[str, Path]) -> Path:
    return make_repository(tmp_path_factory.mktemp("server"), cartons)


@pytest.fixture(scope="module")
def server(repository: Path) -> Iterator[Server]:
    options = ServerOptions(
        repository=repository,
        http_port=0,
        grpc_port=0,
        model_control_mode=ModelControlMode.EXPLICIT,
        load_models=("identity", "sum", "batched", "strings"),
        max_body_size=4 * 1024 * 1024,
        upload_sandbox=None,
    )
    with serve_in_thread(options) as running:
        yield running


def arange(shape: tuple[int, ...], dtype: type = np.float32) -> np.ndarray:
    return np.arange(int(np.prod(shape)), dtype=dtype).reshape(shape)


def assert_doubles(client: object, model: str, shape: tuple[int, ...] = (1, 3)) -> None:
    """`model` serves the ``double`` carton: an HTTP inference through tritonclient returns INPUT0 * 2."""
    import tritonclient.http as httpclient

    tensor = httpclient.InferInput("INPUT0", list(shape), "FP32")
    tensor.set_data_from_numpy(arange(shape))
    outputs = client.infer(model, [tensor])  # type: ignore[attr-defined]
    np.testing.assert_array_equal(outputs.as_numpy("OUTPUT0"), arange(shape) * 2)
