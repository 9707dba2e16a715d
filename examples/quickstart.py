"""carton in one minute: build a tiny ONNX model, pack it as a .carton, load it in an isolated runner, infer.

pip install "carton-runtime[onnx]"     # or, from a checkout: pip install -e ".[onnx]"
python examples/quickstart.py
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import carton
import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

with tempfile.TemporaryDirectory() as tmp:
    # 1. A model: y = relu(x @ w), made with onnx.helper (any exported .onnx file works the same way).
    w = numpy_helper.from_array(np.array([[1, -1], [2, 0.5]], dtype=np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Relu", ["h"], ["y"])],
        "quickstart",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 2])],
        initializer=[w],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    Path(tmp, "model").mkdir()
    onnx.save(model, Path(tmp, "model", "model.onnx"))

    # 2. Pack it. The runner checks the model loads and fills in its inputs and outputs.
    path = carton.pack(
        Path(tmp, "model"),
        Path(tmp, "quickstart.carton"),
        runner_name="onnxruntime",
        required_framework_version="*",
        model_name="quickstart",
    )
    print("packed", path.name, "->", [(t.name, t.dtype.value, t.shape) for t in carton.get_model_info(path).inputs])

    # 3. Load it (onnxruntime runs in its own process) and infer.
    with carton.load(path) as loaded:
        outputs = loaded.infer({"x": np.array([[1.0, 2.0], [-1.0, 0.5]], dtype=np.float32)})
    print("y =", outputs["y"].tolist())
