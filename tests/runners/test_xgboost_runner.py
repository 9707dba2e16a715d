"""The xgboost runner class in this process, and the plugin's serialization hook.

Every model is trained here on a few hundred synthetic rows with NaNs (missing values); outputs are compared bit
for bit (`np.array_equal`) with the in-process call a user would make.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xgboost as xgb
from carton_protocol import DType, InvalidInput, InvalidModel, InvalidOption, LoadContext, PackContext, TensorSpec
from carton_runner_xgboost import InvalidRunnerOption, UnsupportedModelFile, XGBoostRunnerError
from carton_runner_xgboost.plugin import carton_serialize_model
from carton_runner_xgboost.runner import XGBoostRunner
from runner_models import training_data

X, TARGET = training_data()
LABELS = (TARGET > 0).astype(np.int64)
CLASSES3 = np.digitize(TARGET, [-0.5, 0.5]).astype(np.int64)


def _serialize(model: Any, model_dir: Path) -> dict:
    model_dir.mkdir(parents=True, exist_ok=True)
    opts = carton_serialize_model(model, "xgboost", model_dir)
    assert opts is not None and (model_dir / "model.ubj").is_file()
    return opts


def _load(model_dir: Path, opts: dict, *, inputs=(), outputs=(), warnings: list[str] | None = None) -> XGBoostRunner:
    runner = XGBoostRunner()
    sink = warnings if warnings is not None else []
    runner.load(
        LoadContext(model_dir=model_dir, opts=opts, inputs=tuple(inputs), outputs=tuple(outputs), warn=sink.append)
    )
    return runner


@pytest.fixture(scope="module")
def models() -> dict[str, tuple[Any, Any]]:
    """name -> (model, in-process prediction function)."""
    booster = xgb.train(
        {"objective": "reg:squarederror", "max_depth": 3, "nthread": 1}, xgb.DMatrix(X, label=TARGET), 30
    )
    softprob = xgb.train(
        {"objective": "multi:softprob", "num_class": 3, "nthread": 1}, xgb.DMatrix(X, label=CLASSES3), 10
    )
    binary = xgb.XGBClassifier(n_estimators=25, max_depth=3, n_jobs=1).fit(X, LABELS)
    softmax = xgb.XGBClassifier(n_estimators=10, objective="multi:softmax", n_jobs=1).fit(X, CLASSES3)
    multiclass = xgb.XGBClassifier(n_estimators=10, n_jobs=1).fit(X, CLASSES3)
    early = xgb.XGBRegressor(n_estimators=200, learning_rate=0.3, early_stopping_rounds=3, n_jobs=1).fit(
        X[:300], TARGET[:300], eval_set=[(X[300:], TARGET[300:])], verbose=False
    )
    assert early.best_iteration + 1 < early.get_booster().num_boosted_rounds()  # early stopping really kicked in
    multi_target = xgb.XGBRegressor(n_estimators=10, n_jobs=1).fit(X, np.stack([TARGET, -TARGET], axis=1))
    return {
        "booster": (booster, lambda x: booster.predict(xgb.DMatrix(x))),
        "booster_softprob": (softprob, lambda x: softprob.predict(xgb.DMatrix(x))),
        "classifier_binary": (binary, binary.predict_proba),
        "classifier_softmax": (softmax, softmax.predict_proba),
        "classifier_softprob": (multiclass, multiclass.predict_proba),
        "regressor_early_stopping": (early, early.predict),
        "regressor_multi_target": (multi_target, multi_target.predict),
    }


EXPECTED = {
    "booster": ({"model_type": "booster"}, "predictions", ("batch",)),
    "booster_softprob": ({"model_type": "booster"}, "predictions", ("batch", 3)),
    "classifier_binary": ({"model_type": "classifier"}, "probabilities", ("batch", 2)),
    "classifier_softmax": ({"model_type": "classifier"}, "probabilities", ("batch", 3)),
    "classifier_softprob": ({"model_type": "classifier"}, "probabilities", ("batch", 3)),
    "regressor_early_stopping": ({"model_type": "regressor"}, "predictions", ("batch",)),
    "regressor_multi_target": ({"model_type": "regressor"}, "predictions", ("batch", 2)),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_outputs_equal_the_in_process_call_bit_for_bit(tmp_path: Path, models: dict, name: str) -> None:
    model, predict = models[name]
    opts = _serialize(model, tmp_path)
    expected_opts, output_name, shape = EXPECTED[name]
    assert opts == expected_opts
    runner = _load(tmp_path, opts)
    for rows in (X[:1], X[:7], X):
        rows = np.ascontiguousarray(rows)
        rows.setflags(write=False)  # tensors decoded from the wire are read-only views
        outputs = runner.infer({"x": rows})
        assert list(outputs) == [output_name]
        assert np.array_equal(outputs[output_name], predict(rows)), name
        assert outputs[output_name].flags.c_contiguous
    result = XGBoostRunner.pack(PackContext(model_dir=tmp_path, opts=opts))
    assert result.inputs == (TensorSpec(name="x", dtype=DType.FLOAT32, shape=("batch", 8)),)
    assert result.outputs == (TensorSpec(name=output_name, dtype=DType.FLOAT32, shape=shape),)
    assert dict(result.opts) == opts


def test_json_model_file_loads_too(tmp_path: Path, models: dict) -> None:
    booster, predict = models["booster"]
    booster.save_model(str(tmp_path / "model.json"))
    assert np.array_equal(_load(tmp_path, {}).infer({"x": X})["predictions"], predict(X))


def test_custom_missing_value(tmp_path: Path) -> None:
    sentinel = -999.0
    x = np.where(np.isnan(X), sentinel, X).astype(np.float32)
    model = xgb.XGBRegressor(n_estimators=15, missing=sentinel, n_jobs=1).fit(x, TARGET)
    opts = _serialize(model, tmp_path)
    assert opts == {"model_type": "regressor", "missing": sentinel}
    got = _load(tmp_path, opts).infer({"x": x})["predictions"]
    assert np.array_equal(got, model.predict(x))
    # Without the opt the sentinel is a real value and predictions change: the opt matters.
    assert not np.array_equal(_load(tmp_path, {"model_type": "regressor"}).infer({"x": x})["predictions"], got)


def test_nthread_opt_gives_the_same_predictions(tmp_path: Path, models: dict) -> None:
    model, predict = models["classifier_binary"]
    opts = _serialize(model, tmp_path)
    assert np.array_equal(_load(tmp_path, {**opts, "nthread": 1}).infer({"x": X})["probabilities"], predict(X))


def test_declared_names_are_used(tmp_path: Path, models: dict) -> None:
    model, predict = models["classifier_binary"]
    opts = _serialize(model, tmp_path)
    runner = _load(
        tmp_path,
        opts,
        inputs=[TensorSpec(name="features", dtype=DType.FLOAT32)],
        outputs=[TensorSpec(name="p", dtype=DType.FLOAT32)],
    )
    assert np.array_equal(runner.infer({"features": X})["p"], predict(X))
    with pytest.raises(InvalidInput, match="exactly one input, 'features'; got 'x'"):
        runner.infer({"x": X})


def test_more_than_one_declared_input_is_refused(tmp_path: Path, models: dict) -> None:
    opts = _serialize(models["booster"][0], tmp_path)
    with pytest.raises(XGBoostRunnerError, match=r"exactly one input; carton\.toml declares 'a', 'b'"):
        _load(
            tmp_path,
            opts,
            inputs=[TensorSpec(name="a", dtype=DType.FLOAT32), TensorSpec(name="b", dtype=DType.FLOAT32)],
        )


def test_concurrent_infer_matches() -> None:
    assert XGBoostRunner.concurrent


# --- refusals ----------------------------------------------------------------------------------------------------


def test_pickled_model_is_refused(tmp_path: Path, models: dict) -> None:
    (tmp_path / "model.ubj").write_bytes(pickle.dumps(models["booster"][0]))
    with pytest.raises(UnsupportedModelFile, match=r"'model\.ubj' is not an xgboost JSON or UBJSON model"):
        _load(tmp_path, {})


def test_corrupt_model_message_has_no_native_stack_trace(tmp_path: Path) -> None:
    (tmp_path / "model.json").write_bytes(b'{"learner": garbage')
    with pytest.raises(UnsupportedModelFile, match=r"could not load 'model.json'") as info:
        _load(tmp_path, {})
    assert "Stack trace" not in str(info.value) and isinstance(info.value.__cause__, xgb.core.XGBoostError)


def test_model_file_selection(tmp_path: Path, models: dict) -> None:
    models["booster"][0].save_model(str(tmp_path / "a.json"))
    models["booster"][0].save_model(str(tmp_path / "b.ubj"))
    with pytest.raises(UnsupportedModelFile, match=r"exactly one \.ubj or \.json model .* a\.json, b\.ubj"):
        _load(tmp_path, {})
    assert _load(tmp_path, {"model_file": "b.ubj"}).infer({"x": X[:2]})["predictions"].shape == (2,)
    with pytest.raises(UnsupportedModelFile, match="leads outside the model folder"):
        _load(tmp_path, {"model_file": "../a.json"})
    with pytest.raises(UnsupportedModelFile, match=r"'c\.json' does not exist"):
        _load(tmp_path, {"model_file": "c.json"})


def test_empty_folder(tmp_path: Path) -> None:
    with pytest.raises(UnsupportedModelFile, match="found: nothing"):
        _load(tmp_path, {})


@pytest.mark.parametrize(
    "opts, message",
    [
        ({"model_type": "svm"}, "runner opt 'model_type' must be one of 'booster', 'classifier', 'regressor'"),
        ({"nthread": "4"}, "runner opt 'nthread' must be an integer >= 0"),
        ({"nthread": True}, "runner opt 'nthread' must be an integer >= 0"),
        ({"missing": "nan"}, "runner opt 'missing' must be a number"),
        ({"model_file": ""}, "runner opt 'model_file' must be a non-empty string"),
    ],
)
def test_invalid_opts(tmp_path: Path, models: dict, opts: dict, message: str) -> None:
    _serialize(models["booster"][0], tmp_path)
    with pytest.raises(InvalidRunnerOption, match=message):
        _load(tmp_path, opts)


def test_unknown_opts_warn(tmp_path: Path, models: dict) -> None:
    opts = _serialize(models["booster"][0], tmp_path)
    warnings: list[str] = []
    _load(tmp_path, {**opts, "n_jobs": 2}, warnings=warnings)
    assert warnings == [
        "xgboost runner: ignoring unknown runner opts 'n_jobs' (known: missing, model_file, model_type, nthread)"
    ]


def test_infer_refusals(tmp_path: Path, models: dict) -> None:
    runner = _load(tmp_path, _serialize(models["booster"][0], tmp_path))
    with pytest.raises(InvalidInput, match="must be a 2-D") as refused:
        runner.infer({"x": X[0]})
    assert refused.value.tensor == "x"
    with pytest.raises(InvalidInput, match=rf"input 'x' has 5 features, the model takes {X.shape[1]}"):
        runner.infer({"x": X[:, :5]})
    assert issubclass(InvalidRunnerOption, InvalidOption) and issubclass(UnsupportedModelFile, InvalidModel)


# --- the serialization hook ----------------------------------------------------------------------------------------


def test_serialize_hook_leaves_other_runners_and_objects_alone(tmp_path: Path, models: dict) -> None:
    assert carton_serialize_model(models["booster"][0], "onnxruntime", tmp_path) is None
    assert carton_serialize_model({"not": "a model"}, "xgboost", tmp_path) is None
    assert carton_serialize_model(object(), "xgboost", tmp_path) is None
    assert list(tmp_path.iterdir()) == []


def test_serialized_file_is_ubjson_not_pickle(tmp_path: Path, models: dict) -> None:
    _serialize(models["classifier_binary"][0], tmp_path)
    raw = (tmp_path / "model.ubj").read_bytes()
    assert raw[:1] == b"{" and raw == bytes(models["classifier_binary"][0].get_booster().save_raw("ubj"))


@pytest.mark.parametrize(
    "installed, offered",
    [({"xgboost-cpu": "3.2.0"}, "3.2.0"), ({"xgboost": "2.1.4"}, "2.1.4"), ({}, None)],
)
def test_plugin_offers_the_runner_with_either_xgboost_build(
    monkeypatch: pytest.MonkeyPatch, installed: dict[str, str], offered: str | None
) -> None:
    """The [xgboost] extra installs xgboost-cpu, [xgboost-gpu] xgboost: the same module under two names."""
    import importlib.metadata

    from carton_runner_xgboost import plugin

    def version(distribution: str) -> str:
        if distribution in installed:
            return installed[distribution]
        raise importlib.metadata.PackageNotFoundError(distribution)

    monkeypatch.setattr(importlib.metadata, "version", version)
    specs = plugin.carton_runners()
    assert [spec.framework_version for spec in specs] == ([offered] if offered else [])
