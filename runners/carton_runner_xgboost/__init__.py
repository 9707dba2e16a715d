"""The built-in ``xgboost`` runner: runs JSON or UBJSON xgboost models (never pickles), out of the host's process.

Importing this package (as plugin discovery does) never imports xgboost; the runner class lives in
`carton_runner_xgboost.runner` and is imported only inside a runner process.
"""

from ._errors import InvalidRunnerOption, UnsupportedModelFile, XGBoostRunnerError
from ._options import ModelType

__all__ = ["InvalidRunnerOption", "ModelType", "UnsupportedModelFile", "XGBoostRunnerError"]
