"""The built-in runners out of process: `carton.pack` (validated in a runner process) then `carton.load` and
`infer`, compared bit for bit with the framework called in this process."""

from __future__ import annotations

import warnings
from pathlib import Path

import carton
import numpy as np
import onnxruntime as ort
import pytest
import xgboost as xgb
from carton import DType, TensorSpec
from runner_models import (
    DTYPES,
    sample,
    write_external_data,
    write_graph_names,
    write_identity_all_dtypes,
    write_mlp,
    write_string_ops,
)


def _session_outputs(path: Path, feeds: dict) -> list:
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)


# --- onnxruntime -------------------------------------------------------------------------------------------------

def test_onnx_mlp_pack_load_infer(tmp_path: Path) -> None:
    path = write_mlp(tmp_path / "model")
    packed = carton.pack(tmp_path / "model", tmp_path / "mlp.carton", runner_name="onnxruntime",
                         required_framework_version="*", model_name="mlp")
    info = carton.get_model_info(packed)
    assert info.runner.runner_name == "onnxruntime" and info.runner.runner_compat_version == 1
    assert info.inputs == (TensorSpec(name="x", dtype=DType.FLOAT32, shape=("batch", 16)),)
    assert info.outputs == (TensorSpec(name="probs", dtype=DType.FLOAT32, shape=("batch", 4)),)
    with carton.load(packed) as model:
        assert model.runner.framework_version == ort.__version__
        for batch in (1, 256):
            x = np.random.default_rng(batch).standard_normal((batch, 16)).astype(np.float32)
            got = model.infer({"x": x})["probs"]
            assert np.array_equal(got, _session_outputs(path, {"x": x})[0])
        with pytest.raises(carton.InvalidInput):
            model.infer({"x": np.zeros((2, 15), np.float32)})


def test_onnx_every_dtype_and_strings_out_of_process(tmp_path: Path) -> None:
    write_identity_all_dtypes(tmp_path / "ids" / "model")
    write_string_ops(tmp_path / "strings" / "model")
    with carton.load(carton.pack(tmp_path / "ids" / "model", tmp_path / "ids.carton", runner_name="onnxruntime",
                                 required_framework_version="*")) as model:
        inputs = {f"in_{name}": sample(name, (4, 3), seed=i) for i, name in enumerate(DTYPES)}
        outputs = model.infer(inputs)
        for name in DTYPES:
            assert np.array_equal(outputs[f"out_{name}"], inputs[f"in_{name}"]), name
            if name != "string":
                assert outputs[f"out_{name}"].dtype == inputs[f"in_{name}"].dtype
    with carton.load(carton.pack(tmp_path / "strings" / "model", tmp_path / "s.carton", runner_name="onnxruntime",
                                 required_framework_version="*")) as model:
        words = np.array(["b", "日本語", "", "b"], dtype=np.str_)
        outputs = model.infer({"words": words})
        assert outputs["with_end"].tolist() == ["b", "日本語", "", "b", "end"]
        assert outputs["is_b"].tolist() == [1, 0, 0, 1]


def test_onnx_internal_names_out_of_process(tmp_path: Path) -> None:
    write_graph_names(tmp_path / "model")
    packed = carton.pack(
        tmp_path / "model", tmp_path / "names.carton", runner_name="onnxruntime", required_framework_version="*",
        inputs=[TensorSpec(name="x", dtype=DType.FLOAT32, shape=("batch", 3), internal_name="ns/in_x:0")],
        outputs=[TensorSpec(name="y", dtype=DType.FLOAT32, shape=("batch", 3), internal_name="ns/out_y:0")],
    )
    with carton.load(packed) as model:
        x = np.arange(6, dtype=np.float32).reshape(2, 3)
        assert np.array_equal(model.infer({"x": x})["y"], 2 * x + 1)


def test_onnx_unknown_opt_reaches_the_host_as_a_runner_warning(tmp_path: Path) -> None:
    write_mlp(tmp_path / "model")
    with pytest.warns(carton.RunnerWarning, match="unknown runner opts 'num_threads'"):
        model = carton.load_unpacked(tmp_path / "model", runner_name="onnxruntime", required_framework_version="*",
                                     runner_opts={"num_threads": 4, "intra_op_threads": 1})
    with model, warnings.catch_warnings():
        warnings.simplefilter("error")
        assert model.infer({"x": np.zeros((1, 16), np.float32)})["probs"].shape == (1, 4)


@pytest.mark.parametrize("location", ["../w.bin", "/tmp/carton-absolute-w.bin"])
def test_onnx_external_data_outside_is_refused_at_pack_and_load(tmp_path: Path, location: str) -> None:
    model_dir = tmp_path / "model"
    write_external_data(model_dir, location, weights_path=tmp_path / "w.bin")
    with pytest.raises(carton.PackError, match="not allowed"):
        carton.pack(model_dir, runner_name="onnxruntime", required_framework_version="*")
    with pytest.raises(carton.RunnerError, match="not allowed"):
        carton.load_unpacked(model_dir, runner_name="onnxruntime", required_framework_version="*")


def test_onnx_external_data_inside_is_packed_and_runs(tmp_path: Path) -> None:
    weights = write_external_data(tmp_path / "model", "data/w.bin")
    with carton.load(carton.pack(tmp_path / "model", tmp_path / "ext.carton", runner_name="onnxruntime",
                                 required_framework_version="*")) as model:
        x = np.ones((3, 4), np.float32)
        assert np.array_equal(model.infer({"x": x})["y"], x @ weights)


# --- xgboost -----------------------------------------------------------------------------------------------------

def test_xgboost_models_packed_from_objects(tmp_path: Path) -> None:
    from runner_models import training_data

    x, target = training_data()
    classifier = xgb.XGBClassifier(n_estimators=20, max_depth=3, n_jobs=1).fit(x, (target > 0).astype(int))
    regressor = xgb.XGBRegressor(n_estimators=20, n_jobs=1).fit(x, target)
    booster = xgb.train({"objective": "reg:squarederror", "nthread": 1}, xgb.DMatrix(x, label=target), 20)
    cases = [
        (classifier, "probabilities", classifier.predict_proba),
        (regressor, "predictions", regressor.predict),
        (booster, "predictions", lambda rows: booster.predict(xgb.DMatrix(rows))),
    ]
    for index, (model_object, output, predict) in enumerate(cases):
        packed = carton.pack(model_object, tmp_path / f"m{index}.carton", runner_name="xgboost",
                             required_framework_version="*")
        info = carton.get_model_info(packed)
        assert info.inputs == (TensorSpec(name="x", dtype=DType.FLOAT32, shape=("batch", 8)),)
        assert [spec.name for spec in info.outputs] == [output]
        with carton.load(packed) as model:
            for rows in (x[:1], x[:256]):
                assert np.array_equal(model.infer({"x": rows})[output], predict(rows)), output


def test_xgboost_pickle_is_refused_out_of_process(tmp_path: Path) -> None:
    import pickle

    from runner_models import training_data

    x, target = training_data(rows=100)
    (tmp_path / "model").mkdir()
    regressor = xgb.XGBRegressor(n_estimators=2, n_jobs=1).fit(x, target)
    (tmp_path / "model" / "model.ubj").write_bytes(pickle.dumps(regressor))
    with pytest.raises(carton.PackError, match="is not an xgboost JSON or UBJSON model"):
        carton.pack(tmp_path / "model", runner_name="xgboost", required_framework_version="*")
