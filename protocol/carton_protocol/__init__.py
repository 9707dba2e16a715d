"""carton_protocol: the wire between the carton host and its runner processes, and the `Runner` base class.

This package imports nothing else of carton's, so a runner (and its isolated environment) depends only on it.
"""

from ._dtypes import WireType
from ._limits import WireLimits
from ._messages import PROTOCOL_VERSION
from ._runner import LoadContext, OptValue, PackContext, PackResult, Runner, Tensor
from ._spec import DType, RunnerSpec, Shape, TensorSpec, hookimpl
from .errors import FrameError, LimitExceeded, ProtocolError, RemoteError, VersionMismatch

__all__ = [
    "PROTOCOL_VERSION",
    "DType",
    "FrameError",
    "LimitExceeded",
    "LoadContext",
    "OptValue",
    "PackContext",
    "PackResult",
    "ProtocolError",
    "RemoteError",
    "Runner",
    "RunnerSpec",
    "Shape",
    "Tensor",
    "TensorSpec",
    "VersionMismatch",
    "WireLimits",
    "WireType",
    "hookimpl",
]
