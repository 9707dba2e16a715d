"""carton_protocol: the wire between the carton host and its runner processes, and the `Runner` base class.

This package imports nothing else of carton's, so a runner (and its isolated environment) depends only on it.

The names below are imported on first use (PEP 562): ``python -m carton_protocol`` forks the runner's supervisor
(`carton_protocol._supervisor`) before numpy is imported, which it could not if importing the package did so.
"""

from __future__ import annotations

import importlib

TYPE_CHECKING = False  # typing is not imported at run time: this module is on every runner's start-up path
if TYPE_CHECKING:
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


#: Where each public name lives.
_SOURCES = {
    "PROTOCOL_VERSION": "_messages",
    "DType": "_spec",
    "FrameError": "errors",
    "LimitExceeded": "errors",
    "LoadContext": "_runner",
    "OptValue": "_runner",
    "PackContext": "_runner",
    "PackResult": "_runner",
    "ProtocolError": "errors",
    "RemoteError": "errors",
    "Runner": "_runner",
    "RunnerSpec": "_spec",
    "Shape": "_spec",
    "Tensor": "_runner",
    "TensorSpec": "_spec",
    "VersionMismatch": "errors",
    "WireLimits": "_limits",
    "WireType": "_dtypes",
    "hookimpl": "_spec",
}


def __getattr__(name: str) -> object:
    source = _SOURCES.get(name)
    if source is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{source}", __name__), name)
    globals()[name] = value  # later lookups find it directly
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
