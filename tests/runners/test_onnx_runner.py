"""The onnxruntime runner class in this process: load, infer, pack, options and every refusal.

Outputs are compared bit for bit (`np.array_equal`) with an `onnxruntime.InferenceSession` on the same file.
"""

from __future__ import annotations

import os
import threading
import types
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from carton_protocol import (
    DType,
    InvalidInput,
    InvalidModel,
    InvalidOption,
    LoadContext,
    PackContext,
    TensorSpec,
    UnsupportedModel,
)
from carton_runner_onnx import InvalidRunnerOption, OnnxRunnerError, UnsafeModelPath, UnsupportedTensorType
from carton_runner_onnx.runner import OnnxRunner
from onnx import TensorProto, helper
from runner_models import (
    DTYPES,
    sample,
    write_external_data,
    write_graph_names,
    write_identity_all_dtypes,
    write_mlp,
    write_string_ops,
    write_symlinked_external_data,
)


def _load(model_dir: Path, *, opts: dict | None = None, inputs=(), outputs=(), warnings: list[str] | None = None):
    runner = OnnxRunner()
    sink = warnings if warnings is not None else []
    runner.load(
        LoadContext(
            model_dir=model_dir, opts=opts or {}, inputs=tuple(inputs), outputs=tuple(outputs), warn=sink.append
        )
    )
    return runner


def _config_entry(options: ort.SessionOptions, key: str) -> str:
    """A session config entry, or "" when none was set (onnxruntime's own default applies)."""
    try:
        return options.get_session_config_entry(key)
    except RuntimeError:  # onnxruntime's answer for a key never set
        return ""


def _reference(path: Path, feeds: dict) -> list:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


# --- results -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("batch", [1, 7, 256])
def test_mlp_matches_inference_session_bit_for_bit(tmp_path: Path, batch: int) -> None:
    path = write_mlp(tmp_path)
    x = np.random.default_rng(batch).standard_normal((batch, 16)).astype(np.float32)
    x.setflags(write=False)  # tensors decoded from the wire are read-only views
    outputs = _load(tmp_path).infer({"x": x})
    assert list(outputs) == ["probs"]
    assert outputs["probs"].dtype == np.float32
    assert np.array_equal(outputs["probs"], _reference(path, {"x": x})[0])


def test_numeric_outputs_and_inputs_in_any_mapping_come_back_as_the_session_gives_them(tmp_path: Path) -> None:
    # Every numeric dtype, no strings: the outputs are onnxruntime's arrays, named; the inputs are fed as given.
    path = write_identity_all_dtypes(tmp_path)
    names = [name for name in DTYPES if name != "string"]
    runner = _load(
        tmp_path,
        inputs=[TensorSpec(name=f"in_{name}", dtype=DType(name), shape=("n", "*")) for name in DTYPES],
        outputs=[TensorSpec(name=f"out_{name}", dtype=DType(name), shape=("n", "*")) for name in reversed(names)],
    )
    feeds = {f"in_{name}": sample(name, (2, 3)) for name in DTYPES}
    expected = dict(zip([f"out_{name}" for name in names], _reference_selected(path, feeds, names), strict=True))
    for given in (feeds, types.MappingProxyType(feeds)):
        outputs = runner.infer(given)
        assert list(outputs) == [f"out_{name}" for name in reversed(names)]
        for name, value in outputs.items():
            assert type(value) is np.ndarray and np.array_equal(value, expected[name]), name
    with pytest.raises(InvalidInput, match="nested tensor") as raised:
        runner.infer({**feeds, "in_int8": [sample("int8", (2, 3))]})
    assert raised.value.tensor == "in_int8"
    with pytest.raises(InvalidInput, match="unknown input"):
        runner.infer({**{key: value for key, value in feeds.items() if key != "in_int8"}, "other": feeds["in_int8"]})


def _reference_selected(path: Path, feeds: dict, names: list[str]) -> list:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run([f"out_{name}" for name in names], feeds)


def test_every_carton_dtype_round_trips(tmp_path: Path) -> None:
    write_identity_all_dtypes(tmp_path)
    runner = _load(tmp_path)
    inputs = {f"in_{name}": sample(name, (3, 5), seed=i) for i, name in enumerate(DTYPES)}
    outputs = runner.infer(inputs)
    for name in DTYPES:
        got, sent = outputs[f"out_{name}"], inputs[f"in_{name}"]
        assert got.dtype.kind == "U" if name == "string" else got.dtype == sent.dtype, name
        assert np.array_equal(got, sent), name
    assert outputs["out_string"].dtype.kind == "U"


def test_string_ops_and_empty_string_tensor(tmp_path: Path) -> None:
    path = write_string_ops(tmp_path)
    words = np.array(["a", "b", "héllo", "", "b"], dtype=np.str_)
    outputs = _load(tmp_path).infer({"words": words})
    with_end, is_b = _reference(path, {"words": words})
    assert outputs["with_end"].dtype.kind == "U"
    assert outputs["with_end"].tolist() == ["a", "b", "héllo", "", "b", "end"] == with_end.tolist()
    assert np.array_equal(outputs["is_b"], is_b) and outputs["is_b"].tolist() == [0, 1, 0, 0, 1]
    empty = _load(tmp_path).infer({"words": np.array([], dtype=np.str_)})
    assert empty["is_b"].shape == (0,) and empty["with_end"].tolist() == ["end"]


def test_internal_names_map_carton_names_to_graph_names(tmp_path: Path) -> None:
    write_graph_names(tmp_path)
    runner = _load(
        tmp_path,
        inputs=[TensorSpec(name="x", dtype=DType.FLOAT32, shape=("batch", 3), internal_name="ns/in_x:0")],
        outputs=[TensorSpec(name="y", dtype=DType.FLOAT32, shape=("batch", 3), internal_name="ns/out_y:0")],
    )
    x = np.array([[0, 1, 2], [3, 4, 5]], dtype=np.float32)
    assert list(runner.infer({"x": x})) == ["y"]
    assert np.array_equal(runner.infer({"x": x})["y"], 2 * x + 1)


def test_internal_name_that_is_not_in_the_graph_is_refused(tmp_path: Path) -> None:
    write_graph_names(tmp_path)
    with pytest.raises(OnnxRunnerError, match=r"declared input 'x': the graph has no input 'ns/x'.*'ns/in_x:0'"):
        _load(tmp_path, inputs=[TensorSpec(name="x", dtype=DType.FLOAT32, internal_name="ns/x")])


def test_declared_dtype_that_disagrees_with_the_graph_is_refused(tmp_path: Path) -> None:
    write_mlp(tmp_path)
    with pytest.raises(OnnxRunnerError, match=r"declared input 'x' has dtype float64 .* tensor\(float\)"):
        _load(tmp_path, inputs=[TensorSpec(name="x", dtype=DType.FLOAT64)])


def test_graph_input_left_undeclared_is_refused(tmp_path: Path) -> None:
    write_identity_all_dtypes(tmp_path)
    with pytest.raises(OnnxRunnerError, match=r"the graph needs input\(s\) 'in_float64'"):
        _load(
            tmp_path,
            inputs=[TensorSpec(name="in_float32", dtype=DType.FLOAT32)]
            + [TensorSpec(name=f"in_{n}", dtype=DType(n)) for n in DTYPES if n not in ("float32", "float64")],
        )


def test_declared_outputs_select_and_order_what_is_returned(tmp_path: Path) -> None:
    write_string_ops(tmp_path)
    runner = _load(
        tmp_path,
        inputs=[TensorSpec(name="words", dtype=DType.STRING)],
        outputs=[TensorSpec(name="is_b", dtype=DType.UINT8)],
    )
    assert list(runner.infer({"words": np.array(["b"])})) == ["is_b"]


def test_concurrent_infer_from_threads(tmp_path: Path) -> None:
    path = write_mlp(tmp_path)
    runner = _load(tmp_path)
    assert OnnxRunner.concurrent
    xs = [np.random.default_rng(i).standard_normal((4, 16)).astype(np.float32) for i in range(8)]
    expected = [_reference(path, {"x": x})[0] for x in xs]
    results: dict[int, np.ndarray] = {}

    def work(i: int) -> None:
        for _ in range(20):
            results[i] = runner.infer({"x": xs[i]})["probs"]

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(np.array_equal(results[i], expected[i]) for i in range(8))


# --- pack --------------------------------------------------------------------------------------------------------


def test_pack_fills_specs_from_the_graph(tmp_path: Path) -> None:
    write_mlp(tmp_path)
    result = OnnxRunner.pack(PackContext(model_dir=tmp_path, opts={"intra_op_threads": 1}))
    assert result.inputs == (TensorSpec(name="x", dtype=DType.FLOAT32, shape=("batch", 16)),)
    assert result.outputs == (TensorSpec(name="probs", dtype=DType.FLOAT32, shape=("batch", 4)),)
    assert dict(result.opts) == {"intra_op_threads": 1}


def test_pack_describes_every_dtype_with_symbolic_and_free_dims(tmp_path: Path) -> None:
    write_identity_all_dtypes(tmp_path)
    result = OnnxRunner.pack(PackContext(model_dir=tmp_path, opts={}))
    assert [(spec.name, spec.dtype.value, spec.shape) for spec in result.inputs] == [
        (f"in_{name}", name, ("n", "*")) for name in DTYPES
    ]
    assert [spec.dtype.value for spec in result.outputs] == list(DTYPES)


def test_pack_keeps_caller_specs_and_checks_them(tmp_path: Path) -> None:
    write_graph_names(tmp_path)
    inputs = (TensorSpec(name="x", dtype=DType.FLOAT32, shape=("b", 3), internal_name="ns/in_x:0"),)
    outputs = (TensorSpec(name="y", dtype=DType.FLOAT32, shape=("b", 3), internal_name="ns/out_y:0"),)
    result = OnnxRunner.pack(PackContext(model_dir=tmp_path, opts={}, inputs=inputs, outputs=outputs))
    assert (result.inputs, result.outputs) == (inputs, outputs)
    with pytest.raises(OnnxRunnerError, match="the graph has no output 'y'"):
        OnnxRunner.pack(
            PackContext(
                model_dir=tmp_path, opts={}, inputs=inputs, outputs=(TensorSpec(name="y", dtype=DType.FLOAT32),)
            )
        )


def test_pack_output_without_any_shape_is_any_shape_not_scalar(tmp_path: Path) -> None:
    graph = helper.make_graph(
        [
            helper.make_node("Reshape", ["x", "shape"], ["y"]),
            helper.make_node("ReduceSum", ["x"], ["total"], keepdims=0),
        ],
        "reshape",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n"]),
            helper.make_tensor_value_info("shape", TensorProto.INT64, [None]),
        ],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, None),
            helper.make_tensor_value_info("total", TensorProto.FLOAT, []),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, tmp_path / "reshape.onnx")
    result = OnnxRunner.pack(PackContext(model_dir=tmp_path, opts={}))
    assert [(spec.name, spec.shape) for spec in result.inputs] == [("x", ("n",)), ("shape", ("*",))]
    assert [(spec.name, spec.shape) for spec in result.outputs] == [("y", "*"), ("total", ())]


def test_pack_refuses_tensor_types_carton_cannot_declare(tmp_path: Path) -> None:
    graph = helper.make_graph(
        [helper.make_node("Greater", ["x", "x"], ["mask"])],
        "bool_out",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n"])],
        [helper.make_tensor_value_info("mask", TensorProto.BOOL, ["n"])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, tmp_path / "bool.onnx")
    with pytest.raises(UnsupportedTensorType, match=r"graph output 'mask' has type tensor\(bool\)"):
        OnnxRunner.pack(PackContext(model_dir=tmp_path, opts={}))


# --- external data -----------------------------------------------------------------------------------------------


def test_external_data_inside_the_folder_loads(tmp_path: Path) -> None:
    weights = write_external_data(tmp_path, "weights/w.bin")
    x = np.ones((2, 4), dtype=np.float32)
    assert np.array_equal(_load(tmp_path).infer({"x": x})["y"], x @ weights)


def test_external_data_with_dotdot_is_refused(tmp_path: Path) -> None:
    model_dir = tmp_path / "model"
    write_external_data(model_dir, "../w.bin")
    assert (tmp_path / "w.bin").exists()  # the file is there: the path itself is what is refused
    with pytest.raises(UnsafeModelPath, match=r"tensor 'w' \(location '\.\./w\.bin'\): '\.\.' is not allowed"):
        _load(model_dir)
    with pytest.raises(UnsafeModelPath):
        OnnxRunner.pack(PackContext(model_dir=model_dir, opts={}))


def test_external_data_with_an_absolute_path_is_refused(tmp_path: Path) -> None:
    model_dir = tmp_path / "model"
    outside = tmp_path / "abs.bin"
    write_external_data(model_dir, str(outside), weights_path=outside)
    with pytest.raises(UnsafeModelPath, match="absolute paths are not allowed"):
        _load(model_dir)


def test_external_data_symlink_leading_out_is_refused(tmp_path: Path) -> None:
    model_dir = tmp_path / "model"
    write_symlinked_external_data(model_dir, tmp_path / "secret.bin")
    with pytest.raises(UnsafeModelPath, match=r"resolves to .*secret\.bin', outside the model folder"):
        _load(model_dir)


def test_external_data_symlink_inside_the_folder_is_fine(tmp_path: Path) -> None:
    weights = write_external_data(tmp_path, "real.bin")
    data = (tmp_path / "real.bin").read_bytes()
    write_external_data(tmp_path, "alias.bin", weights_path=tmp_path / "unused.bin")
    os.symlink("real.bin", tmp_path / "alias.bin")
    assert (tmp_path / "alias.bin").read_bytes() == data
    x = np.eye(4, dtype=np.float32)
    assert np.array_equal(_load(tmp_path).infer({"x": x})["y"], weights)


def test_missing_external_data_file_is_refused(tmp_path: Path) -> None:
    write_external_data(tmp_path, "w.bin")
    (tmp_path / "w.bin").unlink()
    with pytest.raises(UnsafeModelPath, match="the file does not exist in the model folder"):
        _load(tmp_path)


def _model_with_big_initializer(
    model_dir: Path, *, extra_initializer: TensorProto | None = None, doc: str = ""
) -> tuple[Path, np.ndarray]:
    """``y = x @ big`` where ``big`` is a 128x128 float32 initializer whose raw bytes contain ``location``."""
    big = np.zeros((128, 128), dtype=np.float32)
    big.view(np.uint8).reshape(-1)[100:108] = np.frombuffer(b"location", dtype=np.uint8)
    initializers = [onnx.numpy_helper.from_array(big, "big")]
    if extra_initializer is not None:
        initializers.append(extra_initializer)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "big"], ["y"], doc_string=doc)],
        "big",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 128])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 128])],
        initializer=initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    model_dir.mkdir(parents=True, exist_ok=True)
    onnx.save(model, model_dir / "big.onnx")
    return model_dir / "big.onnx", big


def test_location_bytes_inside_initializer_data_are_skipped(tmp_path: Path) -> None:
    from carton_runner_onnx import _files

    path, big = _model_with_big_initializer(tmp_path)
    assert b"location" in path.read_bytes()
    assert not _files._mentions_location(path)  # only inside raw_data: no external data entry can be there
    x = np.ones((1, 128), dtype=np.float32)
    assert np.array_equal(_load(tmp_path).infer({"x": x})["y"], x @ big)


def test_location_bytes_outside_initializer_data_are_found(tmp_path: Path) -> None:
    from carton_runner_onnx import _files

    path, _ = _model_with_big_initializer(tmp_path, doc="a node whose doc string says location")
    assert _files._mentions_location(path)


def test_external_data_next_to_a_large_initializer_is_still_checked(tmp_path: Path) -> None:
    outside = _external_tensor("../w.bin")
    _model_with_big_initializer(tmp_path / "model", extra_initializer=outside)
    (tmp_path / "w.bin").write_bytes(np.zeros(16, dtype=np.float32).tobytes())
    with pytest.raises(UnsafeModelPath, match=r"tensor 'w' \(location '\.\./w\.bin'\): '\.\.' is not allowed"):
        _load(tmp_path / "model")


def _external_tensor(location: str) -> TensorProto:
    tensor = onnx.numpy_helper.from_array(np.zeros((4, 4), dtype=np.float32), "w")
    tensor.ClearField("raw_data")
    tensor.data_location = TensorProto.EXTERNAL
    entry = tensor.external_data.add()
    entry.key, entry.value = "location", location
    return tensor


@pytest.mark.parametrize(
    "content",
    [
        b"\x3a\xff\xff\xff\xff\x0f location",  # graph field longer than the file
        b"\x3b\x00 location",  # a group (wire type 3): not walked
        b"\x3a\x0c\x2a\x0a\x4a\x08location",  # raw_data (too short to skip) holding the bytes
    ],
)
def test_unwalkable_or_small_structures_are_searched_whole(tmp_path: Path, content: bytes) -> None:
    from carton_runner_onnx import _files

    (tmp_path / "odd.onnx").write_bytes(content)
    assert _files._mentions_location(tmp_path / "odd.onnx")


# --- model file --------------------------------------------------------------------------------------------------


def test_model_file_opt_chooses_among_several(tmp_path: Path) -> None:
    write_mlp(tmp_path, file_name="a.onnx", classes=3)
    write_mlp(tmp_path, file_name="b.onnx", classes=5)
    with pytest.raises(OnnxRunnerError, match=r"several \.onnx files in the model folder \(a\.onnx, b\.onnx\)"):
        _load(tmp_path)
    x = np.zeros((1, 16), dtype=np.float32)
    assert _load(tmp_path, opts={"model_file": "b.onnx"}).infer({"x": x})["probs"].shape == (1, 5)


def test_model_file_in_a_subfolder(tmp_path: Path) -> None:
    write_mlp(tmp_path / "nested", file_name="net.onnx")
    assert _load(tmp_path, opts={"model_file": "nested/net.onnx"}).infer({"x": np.zeros((2, 16), dtype=np.float32)})[
        "probs"
    ].shape == (2, 4)


@pytest.mark.parametrize(
    "model_file, message",
    [
        ("../other.onnx", "'..' is not allowed"),
        ("/etc/passwd", "absolute paths are not allowed"),
        ("missing.onnx", "does not exist in the model folder"),
        ("", "must be a non-empty string"),
    ],
)
def test_bad_model_file_opt(tmp_path: Path, model_file: str, message: str) -> None:
    write_mlp(tmp_path / "model")
    write_mlp(tmp_path, file_name="other.onnx")
    with pytest.raises(OnnxRunnerError, match=message):
        _load(tmp_path / "model", opts={"model_file": model_file})


def test_model_file_symlink_leading_out_is_refused(tmp_path: Path) -> None:
    write_mlp(tmp_path, file_name="outside.onnx")
    (tmp_path / "model").mkdir()
    os.symlink(tmp_path / "outside.onnx", tmp_path / "model" / "model.onnx")
    with pytest.raises(UnsafeModelPath, match="outside the model folder"):
        _load(tmp_path / "model")


def test_folder_without_onnx_file(tmp_path: Path) -> None:
    (tmp_path / "weights.bin").write_bytes(b"1234")
    with pytest.raises(OnnxRunnerError, match=r"no \.onnx file in the model folder \(it holds: weights\.bin\)"):
        _load(tmp_path)


@pytest.mark.parametrize(
    "content, message",
    [
        (b"", "model file 'model.onnx' is empty"),
        (b"\x08\x07garbage that is not a protobuf" * 10, "could not load 'model.onnx'"),
    ],
)
def test_corrupt_model_file(tmp_path: Path, content: bytes, message: str) -> None:
    (tmp_path / "model.onnx").write_bytes(content)
    with pytest.raises(OnnxRunnerError, match=message):
        _load(tmp_path)


def test_corrupt_model_mentioning_external_data(tmp_path: Path) -> None:
    (tmp_path / "model.onnx").write_bytes(b"\xff\xff location \xff\xff" * 4)
    with pytest.raises(OnnxRunnerError, match="is not a valid ONNX model"):
        _load(tmp_path)


# --- options -----------------------------------------------------------------------------------------------------


def test_unknown_opts_warn_naming_them(tmp_path: Path) -> None:
    write_mlp(tmp_path)
    warnings: list[str] = []
    _load(tmp_path, opts={"num_threads": 2, "intra_op_threads": 1, "fancy": True}, warnings=warnings)
    assert len(warnings) == 1
    assert "'fancy', 'num_threads'" in warnings[0] and "intra_op_threads" in warnings[0].split("known:")[1]


@pytest.mark.parametrize("level", ["disable", "basic", "extended", "all"])
def test_graph_optimization_levels_give_the_same_result(tmp_path: Path, level: str) -> None:
    path = write_mlp(tmp_path)
    x = np.random.default_rng(3).standard_normal((5, 16)).astype(np.float32)
    got = _load(tmp_path, opts={"graph_optimization_level": level, "intra_op_threads": 1, "inter_op_threads": 1}).infer(
        {"x": x}
    )["probs"]
    assert np.allclose(got, _reference(path, {"x": x})[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "opts, entries",
    [
        ({}, {"session.force_spinning_stop": "", "session.intra_op.allow_spinning": ""}),
        ({"intra_op_spinning": "run"}, {"session.force_spinning_stop": "1", "session.intra_op.allow_spinning": ""}),
        ({"intra_op_spinning": "always"}, {"session.force_spinning_stop": "", "session.intra_op.allow_spinning": ""}),
        (
            {"intra_op_spinning": "never"},
            {
                "session.force_spinning_stop": "",
                "session.intra_op.allow_spinning": "0",
                "session.inter_op.allow_spinning": "0",
            },
        ),
    ],
)
def test_intra_op_spinning_reaches_the_session(tmp_path: Path, opts: dict, entries: dict[str, str]) -> None:
    path = write_mlp(tmp_path)
    runner = _load(tmp_path, opts=opts)
    config = runner._session.get_session_options()
    assert {key: _config_entry(config, key) for key in entries} == entries
    x = sample(DType.FLOAT32, (3, 16))
    assert np.array_equal(runner.infer({"x": x})["probs"], _reference(path, {"x": x})[0])


@pytest.mark.parametrize(
    "opts, message",
    [
        ({"intra_op_threads": "2"}, "runner opt 'intra_op_threads' must be an integer >= 0"),
        ({"inter_op_threads": True}, "runner opt 'inter_op_threads' must be an integer >= 0"),
        ({"intra_op_threads": -1}, "runner opt 'intra_op_threads' must be an integer >= 0"),
        ({"graph_optimization_level": "fast"}, "runner opt 'graph_optimization_level' must be one of"),
        ({"graph_optimization_level": ["all"]}, "runner opt 'graph_optimization_level' must be one of"),
        ({"intra_op_spinning": "sometimes"}, "runner opt 'intra_op_spinning' must be one of 'run', 'always', 'never'"),
        ({"intra_op_spinning": True}, "runner opt 'intra_op_spinning' must be one of"),
        ({"execution_providers": [1, 2]}, "runner opt 'execution_providers' must be a list of provider names"),
        ({"model_file": 3}, "runner opt 'model_file' must be a non-empty string"),
    ],
)
def test_invalid_opts_are_refused_naming_the_opt(tmp_path: Path, opts: dict, message: str) -> None:
    write_mlp(tmp_path)
    with pytest.raises(InvalidRunnerOption, match=message):
        _load(tmp_path, opts=opts)
    with pytest.raises(InvalidRunnerOption, match=message):
        OnnxRunner.pack(PackContext(model_dir=tmp_path, opts=opts))


def test_unavailable_execution_providers_fall_back_to_cpu_with_a_warning(tmp_path: Path) -> None:
    path = write_mlp(tmp_path)
    warnings: list[str] = []
    runner = _load(
        tmp_path, opts={"execution_providers": ["NoSuchExecutionProvider", "CPUExecutionProvider"]}, warnings=warnings
    )
    assert warnings == [
        "onnxruntime runner: execution providers 'NoSuchExecutionProvider' are not available in this onnxruntime "
        f"build (available: {', '.join(sorted(ort.get_available_providers()))}); skipping them"
    ]
    assert runner._session.get_providers() == ["CPUExecutionProvider"]
    x = np.ones((1, 16), dtype=np.float32)
    assert np.array_equal(runner.infer({"x": x})["probs"], _reference(path, {"x": x})[0])


# --- infer refusals ----------------------------------------------------------------------------------------------


def test_infer_refuses_unknown_and_missing_inputs(tmp_path: Path) -> None:
    write_mlp(tmp_path)
    runner = _load(tmp_path)
    with pytest.raises(InvalidInput, match=r"unknown input\(s\) 'y'; the model takes 'x'") as info:
        runner.infer({"x": np.zeros((1, 16), np.float32), "y": np.zeros(1)})
    assert info.value.tensor == "y"
    with pytest.raises(InvalidInput, match="missing input 'x'"):
        runner.infer({})
    with pytest.raises(InvalidInput, match="nested tensor"):
        runner.infer({"x": [np.zeros(16, np.float32)]})


def test_infer_translates_onnxruntime_errors(tmp_path: Path) -> None:
    write_mlp(tmp_path)
    runner = _load(tmp_path)
    # What onnxruntime refuses as an invalid argument is the caller's input: InvalidInput, not a runner failure.
    with pytest.raises(InvalidInput, match=r"onnxruntime refused the inputs: .*tensor\(double\)") as info:
        runner.infer({"x": np.zeros((1, 16), np.float64)})
    assert info.value.__cause__ is not None
    with pytest.raises(InvalidInput, match="onnxruntime refused the inputs"):
        runner.infer({"x": np.zeros((1, 15), np.float32)})


def _write_reshape(model_dir: Path) -> None:
    """``y = Reshape(x, shape)``: whether it can run depends on the data, which only onnxruntime's kernel sees."""
    graph = helper.make_graph(
        [helper.make_node("Reshape", ["x", "shape"], ["y"])], "reshape",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n"]),
         helper.make_tensor_value_info("shape", TensorProto.INT64, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, model_dir / "reshape.onnx")


def _outcome(runner: OnnxRunner, inputs: dict) -> tuple:
    try:
        outputs = runner.infer(inputs)
    except Exception as exc:
        return type(exc), str(exc), type(exc.__cause__)
    return tuple((name, value.dtype, value.shape, value.tobytes()) for name, value in outputs.items())


def test_the_binding_run_gives_what_the_public_run_gives(tmp_path: Path) -> None:
    # A CPU session's checked inputs go to the binding's `run` (not the public wrapper): every result and every
    # error must be the same as through the public `run`.
    identity, reshape = tmp_path / "identity", tmp_path / "reshape"
    identity.mkdir(), reshape.mkdir()
    write_identity_all_dtypes(identity)
    _write_reshape(reshape)
    cases = [
        (identity, {f"in_{name}": sample(name, shape, seed=i) for i, name in enumerate(DTYPES)})
        for shape in ((3, 5), (0, 4), (1, 1))
    ]
    base = sample("float32", (4, 6))
    wrong_dtype = {f"in_{name}": sample(name, (2, 2)) for name in DTYPES} | {"in_float32": sample("float64", (2, 2))}
    wrong_rank = {f"in_{name}": sample(name, (2, 2)) for name in DTYPES} | {"in_int8": sample("int8", (2, 2, 2))}
    cases += [
        (identity, {f"in_{name}": sample(name, (4, 6))[:, ::2] for name in DTYPES}),  # not contiguous
        (identity, {f"in_{name}": sample(name, (2, 3)) for name in DTYPES} | {"in_float32": base[1:3, :3]}),
        (identity, wrong_dtype),
        (identity, wrong_rank),
        (reshape, {"x": np.arange(6, dtype=np.float32), "shape": np.array([2, 3], np.int64)}),
        (reshape, {"x": np.arange(6, dtype=np.float32), "shape": np.array([4, 5], np.int64)}),  # fails in the kernel
        (reshape, {"x": np.arange(6, dtype=np.float32), "shape": np.array([2, 3], np.int32)}),
    ]
    for model_dir, inputs in cases:
        runner = _load(model_dir)
        assert runner._checked_run is not None  # a release that renames it keeps working, slower: look here then
        through_binding = _outcome(runner, inputs)
        runner._checked_run = None
        assert through_binding == _outcome(runner, inputs), (model_dir.name, list(inputs))
    kinds = [_outcome(_load(model_dir), inputs)[0] for model_dir, inputs in cases[-5:]]
    assert kinds[:2] == [InvalidInput, InvalidInput] and kinds[3:] == [OnnxRunnerError, InvalidInput]
    assert kinds[2] == ("y", np.dtype(np.float32), (2, 3), np.arange(6, dtype=np.float32).tobytes())


def test_the_one_input_call_gives_what_the_general_call_gives(tmp_path: Path) -> None:
    # A model of one input and one output takes `infer`'s first few lines; every result and every error must be the
    # general path's (and the public `run`'s).
    write_mlp(tmp_path)
    x = np.random.default_rng(0).standard_normal((3, 16)).astype(np.float32)
    cases = [
        {"x": x},
        {"x": x[:, ::2]},  # refused by onnxruntime: a dimension
        {"x": np.asfortranarray(x)},
        {"x": x.astype(np.float64)},  # refused by onnxruntime: a dtype
        {"x": x[:1]},
        {"y": x},  # unknown
        {"x": [x]},  # nested
        {"x": x, "y": x},
        {},
    ]
    for inputs in [*cases, types.MappingProxyType({"x": x})]:
        runner = _load(tmp_path)
        assert runner._one is not None
        through_one = _outcome(runner, inputs)  # type: ignore[arg-type]
        runner._one = None
        assert through_one == _outcome(runner, inputs)  # type: ignore[arg-type]
        runner._checked_run = None
        assert through_one == _outcome(runner, inputs), list(inputs)  # type: ignore[arg-type]
    assert _outcome(_load(tmp_path), cases[0])[0][:3] == ("probs", np.dtype(np.float32), (3, 4))
    assert [_outcome(_load(tmp_path), cases[i])[0] for i in (1, 3, 5, 6)] == [InvalidInput] * 4


def test_the_runners_errors_carry_their_kind() -> None:
    assert issubclass(InvalidRunnerOption, InvalidOption) and issubclass(UnsafeModelPath, InvalidModel)
    assert issubclass(UnsupportedTensorType, UnsupportedModel)
    assert all(issubclass(kind, OnnxRunnerError) for kind in (InvalidRunnerOption, UnsafeModelPath))
