"""Real models built at test time for the built-in runners: ONNX graphs from `onnx.helper`, xgboost models trained
on a few hundred synthetic rows. Each builder writes a model folder (what becomes a carton's ``model/``)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

# Opset and IR version that onnxruntime 1.17 onward reads, so one graph runs in old and new environments.
OPSET = 17
IR_VERSION = 8

#: carton dtype name -> (ONNX element type, numpy dtype) for every carton dtype.
DTYPES: dict[str, tuple[int, Any]] = {
    "float32": (TensorProto.FLOAT, np.float32),
    "float64": (TensorProto.DOUBLE, np.float64),
    "string": (TensorProto.STRING, np.str_),
    "int8": (TensorProto.INT8, np.int8),
    "int16": (TensorProto.INT16, np.int16),
    "int32": (TensorProto.INT32, np.int32),
    "int64": (TensorProto.INT64, np.int64),
    "uint8": (TensorProto.UINT8, np.uint8),
    "uint16": (TensorProto.UINT16, np.uint16),
    "uint32": (TensorProto.UINT32, np.uint32),
    "uint64": (TensorProto.UINT64, np.uint64),
}


def _model(graph: onnx.GraphProto) -> onnx.ModelProto:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="carton-tests")
    model.ir_version = IR_VERSION
    return model


def write_mlp(model_dir: Path, *, features: int = 16, hidden: int = 32, classes: int = 4, seed: int = 0,
              file_name: str = "model.onnx") -> Path:
    """A two-layer MLP: ``x [batch, features] -> Gemm -> Relu -> Gemm -> Softmax -> probs [batch, classes]``."""
    rng = np.random.default_rng(seed)
    initializers = [
        numpy_helper.from_array(rng.standard_normal((features, hidden)).astype(np.float32) * 0.3, "w1"),
        numpy_helper.from_array(rng.standard_normal(hidden).astype(np.float32) * 0.1, "b1"),
        numpy_helper.from_array(rng.standard_normal((hidden, classes)).astype(np.float32) * 0.3, "w2"),
        numpy_helper.from_array(rng.standard_normal(classes).astype(np.float32) * 0.1, "b2"),
    ]
    nodes = [
        helper.make_node("Gemm", ["x", "w1", "b1"], ["h"]),
        helper.make_node("Relu", ["h"], ["a"]),
        helper.make_node("Gemm", ["a", "w2", "b2"], ["logits"]),
        helper.make_node("Softmax", ["logits"], ["probs"], axis=-1),
    ]
    graph = helper.make_graph(
        nodes, "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", features])],
        [helper.make_tensor_value_info("probs", TensorProto.FLOAT, ["batch", classes])],
        initializer=initializers,
    )
    model_dir.mkdir(parents=True, exist_ok=True)
    path = model_dir / file_name
    onnx.save(_model(graph), path)
    return path


def write_identity_all_dtypes(model_dir: Path) -> Path:
    """One ``Identity`` per carton dtype: input ``in_<dtype>`` ``["n", "*"]``-shaped -> output ``out_<dtype>``."""
    nodes, inputs, outputs = [], [], []
    for name, (element_type, _) in DTYPES.items():
        nodes.append(helper.make_node("Identity", [f"in_{name}"], [f"out_{name}"]))
        inputs.append(helper.make_tensor_value_info(f"in_{name}", element_type, ["n", None]))
        outputs.append(helper.make_tensor_value_info(f"out_{name}", element_type, ["n", None]))
    graph = helper.make_graph(nodes, "all_dtypes", inputs, outputs)
    model_dir.mkdir(parents=True, exist_ok=True)
    path = model_dir / "identity.onnx"
    onnx.save(_model(graph), path)
    return path


def sample(dtype: str, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """Values that exercise a dtype's range (extremes, negatives, non-ASCII strings)."""
    rng = np.random.default_rng(seed)
    numpy_dtype = DTYPES[dtype][1]
    size = int(np.prod(shape))
    if dtype == "string":
        words = ["", "a", "héllo", "日本語", "tab\tand\nnewline", "x" * 40]
        return np.array([words[i % len(words)] for i in range(size)], dtype=np.str_).reshape(shape)
    if dtype.startswith("float"):
        values = rng.standard_normal(size).astype(numpy_dtype)
        values[:1] = np.finfo(numpy_dtype).max
        return values.reshape(shape)
    info = np.iinfo(numpy_dtype)
    values = rng.integers(info.min, info.max, size=size, dtype=numpy_dtype, endpoint=True)
    values[:2] = (info.min, info.max)[: min(2, size)]
    return values.reshape(shape)


def write_string_ops(model_dir: Path) -> Path:
    """Strings through real string ops: ``words [n] -> Concat(words, ["end"]) -> with_end [n + 1]`` and
    ``Equal(words, "b") -> is_b [n]`` cast to uint8."""
    target = numpy_helper.from_array(np.array(["b"], dtype=object), "target")
    end = numpy_helper.from_array(np.array(["end"], dtype=object), "end")
    nodes = [
        helper.make_node("Concat", ["words", "end"], ["with_end"], axis=0),
        helper.make_node("Equal", ["words", "target"], ["eq"]),
        helper.make_node("Cast", ["eq"], ["is_b"], to=TensorProto.UINT8),
    ]
    graph = helper.make_graph(
        nodes, "strings",
        [helper.make_tensor_value_info("words", TensorProto.STRING, ["n"])],
        [helper.make_tensor_value_info("with_end", TensorProto.STRING, [None]),
         helper.make_tensor_value_info("is_b", TensorProto.UINT8, ["n"])],
        initializer=[target, end],
    )
    model_dir.mkdir(parents=True, exist_ok=True)
    path = model_dir / "strings.onnx"
    model = _model(graph)
    model.opset_import[0].version = 19  # Equal on strings needs opset 19
    onnx.save(model, path)
    return path


def write_graph_names(model_dir: Path) -> Path:
    """Graph tensor names a carton would not show users: ``ns/in_x:0`` -> ``ns/out_y:0`` (y = 2x + 1)."""
    two = numpy_helper.from_array(np.array(2.0, dtype=np.float32), "two")
    one = numpy_helper.from_array(np.array(1.0, dtype=np.float32), "one")
    nodes = [helper.make_node("Mul", ["ns/in_x:0", "two"], ["t"]),
             helper.make_node("Add", ["t", "one"], ["ns/out_y:0"])]
    graph = helper.make_graph(
        nodes, "names",
        [helper.make_tensor_value_info("ns/in_x:0", TensorProto.FLOAT, ["batch", 3])],
        [helper.make_tensor_value_info("ns/out_y:0", TensorProto.FLOAT, ["batch", 3])],
        initializer=[two, one],
    )
    model_dir.mkdir(parents=True, exist_ok=True)
    path = model_dir / "names.onnx"
    onnx.save(_model(graph), path)
    return path


def write_external_data(model_dir: Path, location: str, *, weights_path: Path | None = None) -> np.ndarray:
    """``y = x @ w`` with ``w [4, 4]`` stored as external data named ``location`` (written to ``weights_path``,
    default: that location under the model folder). Returns ``w``."""
    weights = np.arange(16, dtype=np.float32).reshape(4, 4) / 10
    tensor = numpy_helper.from_array(weights, "w")
    tensor.ClearField("raw_data")
    tensor.data_location = TensorProto.EXTERNAL
    entry = tensor.external_data.add()
    entry.key, entry.value = "location", location
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])], "external",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
        initializer=[tensor],
    )
    model_dir.mkdir(parents=True, exist_ok=True)
    onnx.save(_model(graph), model_dir / "external.onnx")
    destination = weights_path if weights_path is not None else model_dir / location
    destination.parent.mkdir(parents=True, exist_ok=True)
    destination.write_bytes(weights.tobytes())
    return weights


def write_symlinked_external_data(model_dir: Path, outside: Path) -> None:
    """External data ``weights.bin`` that is a symlink to a file outside the model folder."""
    write_external_data(model_dir, "weights.bin", weights_path=outside)
    os.symlink(outside, model_dir / "weights.bin")


# --- xgboost ----------------------------------------------------------------------------------------------------

def training_data(rows: int = 400, features: int = 8, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Synthetic features with ~10% NaNs (missing values) and a nonlinear target."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, features)).astype(np.float32)
    target = np.sin(x[:, 0]) + x[:, 1] * x[:, 2] - 0.5 * x[:, 3]
    x[rng.random(x.shape) < 0.1] = np.nan
    return x, target.astype(np.float32)
