"""Errors the onnxruntime runner raises inside its process; each also says, by its base class, which kind of
failure it is (`carton_protocol.RunnerFault`), so the host raises the matching `carton` exception.

    OnnxRunnerError             root: the model could not be loaded, packed or run
    ├── InvalidRunnerOption     a runner opt has the wrong type or value (names the opt)  carton_protocol.InvalidOption
    ├── UnsafeModelPath         the model file or an external data file leads out of the model folder
    │                                                                                  carton_protocol.InvalidModel
    └── UnsupportedTensorType   a graph input or output has a type carton cannot carry (names the tensor)
                                                                                       carton_protocol.UnsupportedModel

Inputs the graph cannot take (unknown, missing, nested, or refused by onnxruntime) are `carton_protocol.InvalidInput`.
"""

from __future__ import annotations

from carton_protocol import InvalidModel, InvalidOption, UnsupportedModel

__all__ = ["InvalidRunnerOption", "OnnxRunnerError", "UnsafeModelPath", "UnsupportedTensorType"]


class OnnxRunnerError(Exception):
    """Root of the onnxruntime runner's errors."""


class InvalidRunnerOption(OnnxRunnerError, InvalidOption):
    """A runner opt has the wrong type or value."""


class UnsafeModelPath(OnnxRunnerError, InvalidModel):
    """The model file or one of its external data files is outside the model folder, or missing."""


class UnsupportedTensorType(OnnxRunnerError, UnsupportedModel):
    """A graph input or output has an element type (or a non-tensor type) that carton cannot declare."""
