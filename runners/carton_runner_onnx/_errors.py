"""Errors the onnxruntime runner raises inside its process; the host reports them with their message.

    OnnxRunnerError             root: the model could not be loaded, packed or run
    ├── InvalidRunnerOption     a runner opt has the wrong type or value (names the opt)
    ├── UnsafeModelPath         the model file or an external data file leads out of the model folder
    └── UnsupportedTensorType   a graph input or output has a type carton cannot carry (names the tensor)
"""

from __future__ import annotations

__all__ = ["InvalidRunnerOption", "OnnxRunnerError", "UnsafeModelPath", "UnsupportedTensorType"]


class OnnxRunnerError(Exception):
    """Root of the onnxruntime runner's errors."""


class InvalidRunnerOption(OnnxRunnerError):
    """A runner opt has the wrong type or value."""


class UnsafeModelPath(OnnxRunnerError):
    """The model file or one of its external data files is outside the model folder, or missing."""


class UnsupportedTensorType(OnnxRunnerError):
    """A graph input or output has an element type (or a non-tensor type) that carton cannot declare."""
