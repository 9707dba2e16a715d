"""The ``[runner.opts]`` the xgboost runner understands, checked before anything is loaded."""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from carton_protocol import OptValue

from ._errors import InvalidRunnerOption

__all__ = ["KNOWN_OPTIONS", "ModelType", "XGBoostOptions", "parse_options"]


class ModelType(enum.StrEnum):
    """How outputs are computed, matching the in-process call a user would make."""

    #: ``Booster.predict`` (all trees, objective's transformed values).
    BOOSTER = "booster"
    #: ``XGBClassifier.predict_proba``: class probabilities, ``[batch, n_classes]``.
    CLASSIFIER = "classifier"
    #: ``XGBRegressor.predict``: predicted values.
    REGRESSOR = "regressor"


@dataclass(frozen=True, slots=True, kw_only=True)
class XGBoostOptions:
    """Parsed runner opts."""

    model_type: ModelType = ModelType.BOOSTER
    model_file: str | None = None
    nthread: int | None = None
    missing: float = math.nan


KNOWN_OPTIONS = ("missing", "model_file", "model_type", "nthread")


def parse_options(opts: Mapping[str, OptValue], warn: Callable[[str], None]) -> XGBoostOptions:
    """Check ``opts`` and return them typed; warn once, naming every opt this runner does not know."""
    unknown = sorted(set(opts) - set(KNOWN_OPTIONS))
    if unknown:
        names = ", ".join(repr(name) for name in unknown)
        warn(f"xgboost runner: ignoring unknown runner opts {names} (known: {', '.join(KNOWN_OPTIONS)})")
    model_type = opts.get("model_type", ModelType.BOOSTER.value)
    if model_type not in set(ModelType):
        allowed = ", ".join(repr(value.value) for value in ModelType)
        raise InvalidRunnerOption(f"runner opt 'model_type' must be one of {allowed}, got {model_type!r}")
    model_file = opts.get("model_file")
    if model_file is not None and (not isinstance(model_file, str) or not model_file):
        raise InvalidRunnerOption(f"runner opt 'model_file' must be a non-empty string, got {model_file!r}")
    nthread = opts.get("nthread")
    if nthread is not None and (isinstance(nthread, bool) or not isinstance(nthread, int) or nthread < 0):
        raise InvalidRunnerOption(f"runner opt 'nthread' must be an integer >= 0 (0: all cores), got {nthread!r}")
    missing = opts.get("missing", math.nan)
    if isinstance(missing, bool) or not isinstance(missing, int | float):
        raise InvalidRunnerOption(f"runner opt 'missing' must be a number (nan by default), got {missing!r}")
    return XGBoostOptions(
        model_type=ModelType(str(model_type)), model_file=model_file, nthread=nthread, missing=float(missing)
    )
