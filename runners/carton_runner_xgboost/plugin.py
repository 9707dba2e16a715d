"""Entry point of the ``xgboost`` runner (``carton`` entry-point group).

Neither hook imports xgboost: discovery reads the version from package metadata, and serialization recognizes
models by duck typing (``get_booster`` for the sklearn wrappers, ``save_raw`` for a `Booster`).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from carton_protocol import OptValue, RunnerSpec, hookimpl, installed_version

from ._options import ModelType

__all__ = [
    "FRAMEWORK_DISTRIBUTIONS",
    "MODEL_FILE_NAME",
    "RUNNER_COMPAT_VERSION",
    "RUNNER_NAME",
    "carton_runners",
    "carton_serialize_model",
]

RUNNER_NAME = "xgboost"

#: Version of the layout of ``model/`` this runner reads: one xgboost JSON or UBJSON model file.
RUNNER_COMPAT_VERSION = 1

#: The file `carton_serialize_model` writes.
MODEL_FILE_NAME = "model.ubj"


#: Distributions that provide the ``xgboost`` module: the CPU-only build (carton's ``xgboost`` extra) and the full
#: one with its GPU libraries (the ``xgboost-gpu`` extra). Both carry the same version numbers.
FRAMEWORK_DISTRIBUTIONS = ("xgboost-cpu", "xgboost")


@hookimpl
def carton_runners() -> list[RunnerSpec]:
    """Offer the runner when xgboost is installed in this environment (either build); offer nothing otherwise."""
    framework_version = installed_version(*FRAMEWORK_DISTRIBUTIONS)
    if framework_version is None:
        return []
    return [
        RunnerSpec(
            runner_name=RUNNER_NAME,
            framework_version=framework_version,
            runner_compat_version=RUNNER_COMPAT_VERSION,
            entry="carton_runner_xgboost.runner:XGBoostRunner",
            concurrent=True,
        )
    ]


@hookimpl
def carton_serialize_model(obj: Any, runner_name: str, model_dir: Path) -> dict[str, OptValue] | None:
    """Write an xgboost model object as ``model_dir/model.ubj``; return the opts that reproduce its predictions.

    An `XGBClassifier` is recorded as ``model_type = "classifier"`` (outputs ``predict_proba``), any other sklearn
    wrapper as ``"regressor"`` (outputs ``predict``), a bare `Booster` as ``"booster"``. A wrapper's non-NaN
    ``missing`` value is recorded too. Objects of any other kind are left to other plugins (``None``).
    """
    if runner_name != RUNNER_NAME:
        return None
    opts: dict[str, OptValue] = {}
    if callable(getattr(obj, "get_booster", None)) and callable(getattr(obj, "predict", None)):
        booster = obj.get_booster()
        is_classifier = callable(getattr(obj, "predict_proba", None))
        opts["model_type"] = (ModelType.CLASSIFIER if is_classifier else ModelType.REGRESSOR).value
        missing = getattr(obj, "missing", math.nan)
        if isinstance(missing, int | float) and not math.isnan(missing):
            opts["missing"] = float(missing)
    elif callable(getattr(obj, "save_raw", None)) and callable(getattr(obj, "inplace_predict", None)):
        booster = obj
        opts["model_type"] = ModelType.BOOSTER.value
    else:
        return None
    raw = booster.save_raw("ubj")
    (model_dir / MODEL_FILE_NAME).write_bytes(bytes(raw))
    return opts
