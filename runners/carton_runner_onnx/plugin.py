"""Entry point of the ``onnxruntime`` runner (``carton`` entry-point group).

Discovery must stay cheap and must not import onnxruntime: the framework version comes from package metadata.
"""

from __future__ import annotations

import importlib.metadata

from carton_protocol import RunnerSpec, hookimpl

__all__ = ["FRAMEWORK_DISTRIBUTIONS", "RUNNER_COMPAT_VERSION", "RUNNER_NAME", "carton_runners"]

RUNNER_NAME = "onnxruntime"

#: Version of the layout of ``model/`` this runner reads: a ``.onnx`` file (plus its external data files).
RUNNER_COMPAT_VERSION = 1

#: Distributions that provide the ``onnxruntime`` module, in the order their version is looked up.
FRAMEWORK_DISTRIBUTIONS = ("onnxruntime", "onnxruntime-gpu", "onnxruntime-openvino", "onnxruntime-directml")


@hookimpl
def carton_runners() -> list[RunnerSpec]:
    """Offer the runner when onnxruntime is installed in this environment; offer nothing otherwise."""
    for distribution in FRAMEWORK_DISTRIBUTIONS:
        try:
            framework_version = importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            continue
        break
    else:
        return []
    return [
        RunnerSpec(
            runner_name=RUNNER_NAME,
            framework_version=framework_version,
            runner_compat_version=RUNNER_COMPAT_VERSION,
            entry="carton_runner_onnx.runner:OnnxRunner",
            concurrent=True,
        )
    ]
