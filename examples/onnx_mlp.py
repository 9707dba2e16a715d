"""An ONNX MLP end to end: build it with onnx.helper, pack it with runner options, load it, check the outputs are
bit-for-bit those of onnxruntime in this process, and show what the packed carton declares.

    pip install "carton-runtime[onnx]"     # or, from a checkout: pip install -e ".[onnx]"
    python examples/onnx_mlp.py
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import carton
import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper


def build_mlp(path: Path, features: int = 16, hidden: int = 32, classes: int = 4) -> None:
    """x [batch, features] -> Gemm -> Relu -> Gemm -> Softmax -> probs [batch, classes]."""
    rng = np.random.default_rng(0)
    weights = [
        numpy_helper.from_array(rng.standard_normal((features, hidden)).astype(np.float32) * 0.3, "w1"),
        numpy_helper.from_array(np.zeros(hidden, np.float32), "b1"),
        numpy_helper.from_array(rng.standard_normal((hidden, classes)).astype(np.float32) * 0.3, "w2"),
        numpy_helper.from_array(np.zeros(classes, np.float32), "b2"),
    ]
    graph = helper.make_graph(
        [
            helper.make_node("Gemm", ["x", "w1", "b1"], ["h"]),
            helper.make_node("Relu", ["h"], ["a"]),
            helper.make_node("Gemm", ["a", "w2", "b2"], ["logits"]),
            helper.make_node("Softmax", ["logits"], ["probs"], axis=-1),
        ],
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", features])],
        [helper.make_tensor_value_info("probs", TensorProto.FLOAT, ["batch", classes])],
        initializer=weights,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, path)


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        model_file = Path(tmp, "model", "mlp.onnx")
        build_mlp(model_file)
        packed = carton.pack(
            model_file.parent,
            Path(tmp, "mlp.carton"),
            runner_name="onnxruntime",
            required_framework_version="*",
            model_name="mlp",
            runner_opts={"intra_op_threads": 1, "graph_optimization_level": "all"},
        )
        info = carton.get_model_info(packed)
        print(
            f"{info.model_name}: runner {info.runner.runner_name} {info.runner.required_framework_version!r}, "
            f"opts {dict(info.runner.opts)}"
        )
        for spec in (*info.inputs, *info.outputs):
            print(f"  {spec.name}: {spec.dtype.value} {spec.shape}")

        x = np.random.default_rng(1).standard_normal((3, 16)).astype(np.float32)
        with carton.load(packed) as model:
            probs = model.infer({"x": x})["probs"]
            print(f"runner: onnxruntime {model.runner.framework_version} ({model.runner.source})")
        reference = ort.InferenceSession(str(model_file), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
        print("probs =\n", np.round(probs, 4))
        print("bit-for-bit equal to onnxruntime in this process:", np.array_equal(probs, reference))


if __name__ == "__main__":
    main()
