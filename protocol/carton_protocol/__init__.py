"""carton_protocol: the wire between the carton host and its runner processes, and the `Runner` base class.

This package imports nothing else of carton's, so a runner (and its isolated environment) depends only on it.

The names below are imported on first use (PEP 562): ``python -m carton_protocol`` forks the runner's supervisor
(`carton_protocol._supervisor`) before numpy is imported, which it could not if importing the package did so.
"""

from __future__ import annotations

import importlib

TYPE_CHECKING = False  # typing is not imported at run time: this module is on every runner's start-up path
if TYPE_CHECKING:
    from ._codec import HostCodec, Outgoing, Received, RunnerCodec
    from ._dtypes import WireType
    from ._limits import WireLimits
    from ._messages import (
        PROTOCOL_VERSION,
        Close,
        CloseReply,
        ErrorReply,
        Hello,
        HelloReply,
        Infer,
        InferReply,
        Load,
        LoadReply,
        Pack,
        PackReply,
        Release,
        Reply,
        Request,
        TensorEntry,
    )
    from ._reaper import descendants, kill_tree
    from ._runner import LoadContext, OptValue, PackContext, PackResult, Runner, Tensor
    from ._spec import DType, RunnerSpec, Shape, TensorSpec, hookimpl, installed_version
    from ._zmqio import new_context, recv_message, send_copied, send_message
    from .errors import (
        ErrorCode,
        FrameError,
        InvalidInput,
        InvalidModel,
        InvalidOption,
        InvalidOutput,
        LimitExceeded,
        ProtocolError,
        RemoteError,
        RunnerFault,
        UnsupportedModel,
        VersionMismatch,
    )

__all__ = [
    "PROTOCOL_VERSION",
    "Close",
    "CloseReply",
    "DType",
    "ErrorCode",
    "ErrorReply",
    "FrameError",
    "Hello",
    "HelloReply",
    "HostCodec",
    "Infer",
    "InferReply",
    "InvalidInput",
    "InvalidModel",
    "InvalidOption",
    "InvalidOutput",
    "LimitExceeded",
    "Load",
    "LoadContext",
    "LoadReply",
    "OptValue",
    "Outgoing",
    "Pack",
    "PackContext",
    "PackReply",
    "PackResult",
    "ProtocolError",
    "Received",
    "Release",
    "RemoteError",
    "Reply",
    "Request",
    "Runner",
    "RunnerCodec",
    "RunnerFault",
    "RunnerSpec",
    "Shape",
    "Tensor",
    "TensorEntry",
    "TensorSpec",
    "UnsupportedModel",
    "VersionMismatch",
    "WireLimits",
    "WireType",
    "descendants",
    "hookimpl",
    "installed_version",
    "kill_tree",
    "new_context",
    "recv_message",
    "send_copied",
    "send_message",
]


#: Where each public name lives.
_SOURCES = {
    "PROTOCOL_VERSION": "_messages",
    "Close": "_messages",
    "CloseReply": "_messages",
    "DType": "_spec",
    "ErrorCode": "errors",
    "ErrorReply": "_messages",
    "FrameError": "errors",
    "Hello": "_messages",
    "HelloReply": "_messages",
    "HostCodec": "_codec",
    "Infer": "_messages",
    "InferReply": "_messages",
    "InvalidInput": "errors",
    "InvalidModel": "errors",
    "InvalidOption": "errors",
    "InvalidOutput": "errors",
    "LimitExceeded": "errors",
    "Load": "_messages",
    "LoadContext": "_runner",
    "LoadReply": "_messages",
    "OptValue": "_runner",
    "Outgoing": "_codec",
    "Pack": "_messages",
    "PackContext": "_runner",
    "PackReply": "_messages",
    "PackResult": "_runner",
    "ProtocolError": "errors",
    "Received": "_codec",
    "Release": "_messages",
    "RemoteError": "errors",
    "Reply": "_messages",
    "Request": "_messages",
    "Runner": "_runner",
    "RunnerCodec": "_codec",
    "RunnerFault": "errors",
    "RunnerSpec": "_spec",
    "Shape": "_spec",
    "Tensor": "_runner",
    "TensorEntry": "_messages",
    "TensorSpec": "_spec",
    "UnsupportedModel": "errors",
    "VersionMismatch": "errors",
    "WireLimits": "_limits",
    "WireType": "_dtypes",
    "descendants": "_reaper",
    "hookimpl": "_spec",
    "installed_version": "_spec",
    "kill_tree": "_reaper",
    "new_context": "_zmqio",
    "recv_message": "_zmqio",
    "send_copied": "_zmqio",
    "send_message": "_zmqio",
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
