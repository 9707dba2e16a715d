"""deploy/kserve/: what can be checked without Kubernetes or Docker. The manifests parse and say what KServe needs,
the runtime's arguments are `carton serve` flags and match the container recipe, and the entrypoint command serves
the /mnt/models layout KServe's storage initializer writes (run here on 127.0.0.1 and a free port instead of
0.0.0.0:8080, queried with tritonclient)."""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from serving_process import start_serving, wait_answering

yaml = pytest.importorskip("yaml")
onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
pytest.importorskip("tritonclient.http")

import carton  # noqa: E402
from onnx import TensorProto, helper  # noqa: E402

KSERVE = Path(__file__).resolve().parents[2] / "deploy" / "kserve"


def _documents(name: str) -> list[dict[str, object]]:
    return [doc for doc in yaml.safe_load_all((KSERVE / name).read_text()) if doc is not None]


def _runtime_container() -> dict[str, object]:
    (runtime,) = _documents("servingruntime.yaml")
    (container,) = runtime["spec"]["containers"]  # type: ignore[index]
    return container  # type: ignore[no-any-return]


def test_manifests_parse_and_name_the_carton_format_and_v2() -> None:
    (runtime,) = _documents("servingruntime.yaml")
    assert runtime["apiVersion"] == "serving.kserve.io/v1alpha1"
    assert runtime["kind"] in ("ServingRuntime", "ClusterServingRuntime")
    spec = runtime["spec"]
    assert spec["protocolVersions"] == ["v2"]  # type: ignore[index]
    assert [f["name"] for f in spec["supportedModelFormats"]] == ["carton"]  # type: ignore[index]
    container = _runtime_container()
    assert container["name"] == "kserve-container"
    assert container["ports"][0]["containerPort"] == 8080  # type: ignore[index]
    (service,) = _documents("inferenceservice.yaml")
    assert service["apiVersion"] == "serving.kserve.io/v1beta1" and service["kind"] == "InferenceService"
    model = service["spec"]["predictor"]["model"]  # type: ignore[index]
    assert model["modelFormat"]["name"] == "carton" and model["protocolVersion"] == "v2"
    assert model["runtime"] == runtime["metadata"]["name"]  # type: ignore[index]
    assert "://" in model["storageUri"]


def test_runtime_flags_exist_in_carton_serve_help_and_match_the_container_recipe() -> None:
    help_text = subprocess.run(
        [sys.executable, "-m", "carton", "serve", "--help"], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    known = set(re.findall(r"--[a-z][a-z-]*", help_text))
    args = [str(arg) for arg in _runtime_container()["args"]]  # type: ignore[union-attr]
    assert args[0] == "/mnt/models"
    flags = [arg for arg in args if arg.startswith("--")]
    assert flags and set(flags) <= known, set(flags) - known
    dockerfile = (KSERVE / "Dockerfile").read_text()
    entrypoint = re.search(r"^ENTRYPOINT (\[.*\])$", dockerfile, re.M)
    command = re.search(r"^CMD (\[.*\])$", dockerfile, re.M)
    assert entrypoint and json.loads(entrypoint.group(1)) == ["carton", "serve"]
    assert command and json.loads(command.group(1)) == args


def _carton(folder: Path, target: Path, constant: float) -> None:
    graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "c"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n"])],
        initializer=[helper.make_tensor("c", TensorProto.FLOAT, [], [constant])],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    folder.mkdir(parents=True)
    onnx.save(model, folder / "model.onnx")
    target.parent.mkdir(parents=True, exist_ok=True)
    carton.pack(folder, target, runner_name="onnxruntime", required_framework_version="*")


def test_the_entrypoint_serves_the_storage_initializers_layout(tmp_path: Path) -> None:
    import tritonclient.http as httpclient

    models = tmp_path / "mnt" / "models"
    # A storageUri of a repository folder (mlp/1/model.carton) and one of a single file (single.carton).
    _carton(tmp_path / "src-mlp", models / "mlp" / "1" / "model.carton", 2.0)
    _carton(tmp_path / "src-single", models / "single.carton", 3.0)
    args = [str(arg) for arg in _runtime_container()["args"]]  # type: ignore[union-attr]
    # The same command with the repository at this test's /mnt/models, listening on loopback only.
    args[0] = str(models)
    args[args.index("--host") + 1] = "127.0.0.1"
    args[args.index("--http-port") + 1] = "0"
    carton_command = shutil.which("carton", path=str(Path(sys.executable).parent)) or "carton"
    serving = start_serving([carton_command, "serve", *args])
    process = serving.process
    try:
        client = httpclient.InferenceServerClient(f"127.0.0.1:{serving.http_port}")
        wait_answering(
            serving,
            lambda: client.is_server_ready() and client.is_model_ready("mlp") and client.is_model_ready("single"),
            timeout=120,
        )
        for name, constant in (("mlp", 2.0), ("single", 3.0)):
            x = np.arange(5, dtype=np.float32)
            tensor = httpclient.InferInput("x", [5], "FP32")
            tensor.set_data_from_numpy(x)
            np.testing.assert_array_equal(client.infer(name, [tensor]).as_numpy("y"), x * np.float32(constant))
        assert {e["name"] for e in client.get_model_repository_index()} == {"mlp", "single"}
        process.send_signal(signal.SIGTERM)  # what the kubelet sends
        assert process.wait(60) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
