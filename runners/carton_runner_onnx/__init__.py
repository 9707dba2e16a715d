"""The built-in ``onnxruntime`` runner: runs ``model/*.onnx`` with onnxruntime, out of the host's process.

Importing this package (as plugin discovery does) never imports onnxruntime; the runner class lives in
`carton_runner_onnx.runner` and is imported only inside a runner process.
"""

from ._errors import InvalidRunnerOption, OnnxRunnerError, UnsafeModelPath, UnsupportedTensorType

__all__ = ["InvalidRunnerOption", "OnnxRunnerError", "UnsafeModelPath", "UnsupportedTensorType"]
