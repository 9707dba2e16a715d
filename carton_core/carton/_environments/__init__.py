"""Isolated runner environments: one venv per (runner, framework version), found by resolution like any runner.

    carton.install_runner("onnxruntime", framework_version="=1.19.2")   # or: carton runner install ...
    carton.list_runner_environments()
    carton.remove_runner_environment("onnxruntime", "1.19.2")

Environments live under ``<data dir>/runners/`` (see `carton._paths.data_dir`); `carton._environments.plugin` offers
each registered one to discovery as a `RunnerSpec` whose ``python`` is the environment's interpreter.
"""

from ._frameworks import can_install
from ._install import install_runner, remove_runner_environment
from ._registry import RunnerEnvironment, rebuild_command, stale_reason
from ._registry import list_environments as list_runner_environments

__all__ = [
    "RunnerEnvironment",
    "can_install",
    "install_runner",
    "list_runner_environments",
    "rebuild_command",
    "remove_runner_environment",
    "stale_reason",
]
