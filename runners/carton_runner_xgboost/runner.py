"""`XGBoostRunner`: loads a JSON/UBJSON model into an xgboost `Booster` and predicts like the in-process API would.

Each model type reproduces one in-process call bit for bit: ``booster`` = ``Booster.predict`` (all trees),
``regressor`` = ``XGBRegressor.predict`` and ``classifier`` = ``XGBClassifier.predict_proba`` (both use the best
iteration recorded by early stopping, as the sklearn wrappers do).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
from carton_protocol import DType, InvalidInput, LoadContext, PackContext, PackResult, Runner, Tensor, TensorSpec

from ._errors import UnsupportedModelFile, XGBoostRunnerError
from ._framework import xgb
from ._options import ModelType, XGBoostOptions, parse_options

__all__ = ["Predict", "XGBoostRunner"]

_MODEL_SUFFIXES = (".ubj", ".json")
_DEFAULT_OUTPUT = {
    ModelType.BOOSTER: "predictions",
    ModelType.REGRESSOR: "predictions",
    ModelType.CLASSIFIER: "probabilities",
}

Predict = Callable[[np.ndarray], np.ndarray]


class XGBoostRunner(Runner):
    """One input (``x``: ``[batch, n_features]``), one output; gbtree prediction is thread-safe."""

    concurrent = True

    def load(self, context: LoadContext) -> None:
        options = parse_options(context.opts, context.warn)
        booster = _load_booster(context.model_dir, options)
        self._predict = _predictor(booster, options)
        self._features = booster.num_features()
        self._input_name = _single(context.inputs, "input", default="x")
        self._output_name = _single(context.outputs, "output", default=_DEFAULT_OUTPUT[options.model_type])

    def infer(self, inputs: Mapping[str, Tensor]) -> Mapping[str, Tensor]:
        name = self._input_name
        if set(inputs) != {name}:
            raise InvalidInput(
                f"the model takes exactly one input, {name!r}; got {', '.join(map(repr, inputs)) or 'none'}",
                tensor=name,
            )
        features = inputs[name]
        if isinstance(features, list) or features.ndim != 2:
            raise InvalidInput(f"input {name!r} must be a 2-D [batch, n_features] array", tensor=name)
        if features.shape[1] != self._features:
            raise InvalidInput(
                f"input {name!r} has {features.shape[1]} features, the model takes {self._features}", tensor=name
            )
        try:
            return {self._output_name: np.ascontiguousarray(self._predict(features))}
        except xgb.core.XGBoostError as exc:
            raise XGBoostRunnerError(f"xgboost failed to predict: {_message(exc)}") from exc

    @classmethod
    def pack(cls, context: PackContext) -> PackResult:
        """Check the model loads; describe input ``x`` and the output of the model type when the caller gave none."""
        options = parse_options(context.opts, context.warn)
        booster = _load_booster(context.model_dir, options)
        n_features = booster.num_features()
        probe = _predictor(booster, options)(np.zeros((1, n_features), dtype=np.float32))
        inputs = context.inputs or (TensorSpec(name="x", dtype=DType.FLOAT32, shape=("batch", n_features)),)
        outputs = context.outputs or (
            TensorSpec(
                name=_DEFAULT_OUTPUT[options.model_type], dtype=DType.FLOAT32, shape=("batch", *probe.shape[1:])
            ),
        )
        return PackResult(inputs=tuple(inputs), outputs=tuple(outputs), opts=dict(context.opts))


def _load_booster(model_dir: Path, options: XGBoostOptions) -> Any:
    path = _model_file(model_dir, options.model_file)
    raw = path.read_bytes()
    # JSON and UBJSON models both start with an object ('{'); pickles and the legacy binary format do not.
    if not raw.lstrip()[:1] == b"{":
        raise UnsupportedModelFile(
            f"{path.name!r} is not an xgboost JSON or UBJSON model (pickles and the legacy "
            f"binary format are refused); save it with booster.save_model('model.ubj')"
        )
    try:
        booster = xgb.Booster(model_file=bytearray(raw))
    except xgb.core.XGBoostError as exc:
        raise UnsupportedModelFile(f"xgboost {xgb.__version__} could not load {path.name!r}: {_message(exc)}") from exc
    if options.nthread is not None:
        booster.set_param({"nthread": options.nthread})
    return booster


def _model_file(model_dir: Path, model_file: str | None) -> Path:
    if model_file is not None:
        candidate = model_dir / model_file
        if not candidate.resolve().is_relative_to(model_dir.resolve()):
            raise UnsupportedModelFile(f"runner opt model_file={model_file!r} leads outside the model folder")
    else:
        found = sorted(path for path in model_dir.iterdir() if path.suffix in _MODEL_SUFFIXES)
        if len(found) != 1:
            listing = ", ".join(sorted(path.name for path in model_dir.iterdir())) or "nothing"
            raise UnsupportedModelFile(
                f"expected exactly one .ubj or .json model in the model folder, found: "
                f"{listing}; set runner opt 'model_file'"
            )
        candidate = found[0]
    if not candidate.is_file():
        raise UnsupportedModelFile(f"model file {model_file!r} does not exist in the model folder")
    return candidate


def _predictor(booster: Any, options: XGBoostOptions) -> Predict:
    config = json.loads(booster.save_config())["learner"]
    objective = config["objective"]["name"]
    n_classes = int(config["learner_model_param"]["num_class"]) or 2
    missing = options.missing
    if options.model_type is ModelType.BOOSTER:
        iterations = (0, 0)
    else:  # the sklearn wrappers predict with the best iteration when early stopping recorded one
        best = booster.attr("best_iteration")
        iterations = (0, int(best) + 1) if best is not None else (0, 0)

    def values(features: np.ndarray, kind: str = "value") -> np.ndarray:
        result: np.ndarray = booster.inplace_predict(
            features, iteration_range=iterations, predict_type=kind, missing=missing, validate_features=False
        )
        return result

    if options.model_type is not ModelType.CLASSIFIER:
        return values
    if objective == "multi:softmax":
        return lambda features: _softmax(values(features, "margin"))
    return lambda features: _class_probabilities(n_classes, values(features))


def _class_probabilities(n_classes: int, prediction: np.ndarray) -> np.ndarray:
    """What ``XGBClassifier.predict_proba`` makes of the booster's values (same operations, same bits)."""
    if prediction.ndim == 2 and (prediction.shape[1] == n_classes or n_classes == 2 <= prediction.shape[1]):
        return prediction
    return np.vstack((1.0 - prediction, prediction)).transpose()


def _softmax(margin: np.ndarray) -> np.ndarray:
    """``scipy.special.softmax(margin, axis=1)``, as ``predict_proba`` applies it to ``multi:softmax`` margins."""
    shifted = np.exp(margin - np.amax(margin, axis=1, keepdims=True))
    result: np.ndarray = shifted / np.sum(shifted, axis=1, keepdims=True)
    return result


def _single(specs: tuple[TensorSpec, ...], kind: str, *, default: str) -> str:
    if not specs:
        return default
    if len(specs) != 1:
        raise XGBoostRunnerError(
            f"an xgboost model has exactly one {kind}; carton.toml declares "
            f"{', '.join(repr(spec.name) for spec in specs)}"
        )
    return specs[0].name


def _message(exc: BaseException) -> str:
    """xgboost's error text without the native stack trace it appends."""
    return str(exc).split("Stack trace:", 1)[0].strip()
