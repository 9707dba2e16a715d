"""Errors the xgboost runner raises inside its process; each also says, by its base class, which kind of failure it
is (`carton_protocol.RunnerFault`), so the host raises the matching `carton` exception.

    XGBoostRunnerError          root: the model could not be loaded, packed or run
    ├── InvalidRunnerOption     a runner opt has the wrong type or value (names the opt)  carton_protocol.InvalidOption
    └── UnsupportedModelFile    the model file is missing, outside the model folder, or not JSON/UBJSON
                                                                                       carton_protocol.InvalidModel

Inputs the model cannot take (another name, not 2-D, another feature count) are `carton_protocol.InvalidInput`.
"""

from __future__ import annotations

from carton_protocol import InvalidModel, InvalidOption

__all__ = ["InvalidRunnerOption", "UnsupportedModelFile", "XGBoostRunnerError"]


class XGBoostRunnerError(Exception):
    """Root of the xgboost runner's errors."""


class InvalidRunnerOption(XGBoostRunnerError, InvalidOption):
    """A runner opt has the wrong type or value."""


class UnsupportedModelFile(XGBoostRunnerError, InvalidModel):
    """The model file is missing, leads out of the model folder, or is not an xgboost JSON/UBJSON model."""
