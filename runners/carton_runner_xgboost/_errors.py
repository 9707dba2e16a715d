"""Errors the xgboost runner raises inside its process; the host reports them with their message.

    XGBoostRunnerError          root: the model could not be loaded, packed or run
    ├── InvalidRunnerOption     a runner opt has the wrong type or value (names the opt)
    └── UnsupportedModelFile    the model file is missing, outside the model folder, or not JSON/UBJSON
"""

from __future__ import annotations

__all__ = ["InvalidRunnerOption", "UnsupportedModelFile", "XGBoostRunnerError"]


class XGBoostRunnerError(Exception):
    """Root of the xgboost runner's errors."""


class InvalidRunnerOption(XGBoostRunnerError):
    """A runner opt has the wrong type or value."""


class UnsupportedModelFile(XGBoostRunnerError):
    """The model file is missing, leads out of the model folder, or is not an xgboost JSON/UBJSON model."""
