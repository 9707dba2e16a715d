"""Exceptions of the wire layer, and the failures a runner reports on purpose.

Two roots. `ProtocolError` is what the wire itself raises; the host translates it into `carton` errors::

    ProtocolError
    ├── FrameError              a frame or header is malformed, or disagrees with the bytes that arrived
    │   └── LimitExceeded       a declared size, count or depth is over a configured limit
    ├── VersionMismatch         the two sides speak different protocol versions
    └── RemoteError             the other side reported a failure (its code, message, exception type, traceback)

`RunnerFault` is what a runner raises when it knows what went wrong. Its `code` (an `ErrorCode`) travels on the wire,
and the host raises the matching `carton` exception (docs/protocol.md, "Errors")::

    RunnerFault                 code              on the host (during infer)
    ├── InvalidInput            invalid_input     carton.InvalidInput: the client's inputs are wrong (names the tensor)
    ├── InvalidOutput           invalid_output    carton.InvalidOutput: the model produced something it must not
    ├── InvalidModel            invalid_model     the model's files or declared tensors are wrong for this runner
    ├── InvalidOption           invalid_option    a runner option has the wrong type or value (names the option)
    └── UnsupportedModel        unsupported_model the runner does not implement what the model needs

Any `MemoryError` travels as ``out_of_memory``, a `ProtocolError` as ``protocol``, and anything else as
``internal`` (the host's `carton.RunnerFailed`, or `carton.RunnerStartError` during ``load``).
"""

from __future__ import annotations

import enum
from typing import ClassVar

__all__ = [
    "ErrorCode",
    "FrameError",
    "InvalidInput",
    "InvalidModel",
    "InvalidOption",
    "InvalidOutput",
    "LimitExceeded",
    "ProtocolError",
    "RemoteError",
    "RunnerFault",
    "UnsupportedModel",
    "VersionMismatch",
]


class ErrorCode(enum.StrEnum):
    """The kind of a failure, as it travels in an error reply. A peer may send a code this version does not know:
    readers treat it as `INTERNAL`."""

    INVALID_INPUT = "invalid_input"
    INVALID_OUTPUT = "invalid_output"
    INVALID_MODEL = "invalid_model"
    INVALID_OPTION = "invalid_option"
    UNSUPPORTED_MODEL = "unsupported_model"
    OUT_OF_MEMORY = "out_of_memory"
    PROTOCOL = "protocol"
    INTERNAL = "internal"


class ProtocolError(Exception):
    """Root of every error the wire layer raises."""


class FrameError(ProtocolError):
    """A message could not be decoded: it names the frame, field or tensor at fault."""


class LimitExceeded(FrameError):
    """A message declared more than the configured limits allow (bytes, elements, tensors, depth)."""


class VersionMismatch(ProtocolError):
    """The host and the runner speak different protocol versions."""

    def __init__(self, message: str, *, local: int, remote: int) -> None:
        super().__init__(message)
        self.local = local
        self.remote = remote


class RemoteError(ProtocolError):
    """The peer failed while handling a request: what its error reply said.

    ``code`` is the reply's `ErrorCode` value (kept as sent, so a code from a newer peer survives), ``exception``
    the name of the exception type the peer raised (for people; never matched), ``tensor`` the tensor it named.
    """

    def __init__(
        self, message: str, *, code: str, exception: str = "", traceback: str = "", tensor: str | None = None
    ) -> None:
        super().__init__(message)
        self.code = code
        self.exception = exception
        self.traceback = traceback
        self.tensor = tensor


class RunnerFault(Exception):
    """Raise a subclass from a `carton_protocol.Runner` to report a failure of a known kind; its `code` reaches
    the host, which raises the matching `carton` exception. The message is shown to the user as it is."""

    code: ClassVar[ErrorCode] = ErrorCode.INTERNAL


class InvalidInput(RunnerFault):
    """The inputs are wrong: the client's fault (HTTP 400, gRPC ``INVALID_ARGUMENT``). Name the tensor::

    raise InvalidInput(f"token id {value} is outside the vocabulary", tensor="input_ids")
    """

    code = ErrorCode.INVALID_INPUT

    def __init__(self, message: str, *, tensor: str | None = None) -> None:
        super().__init__(message)
        self.tensor = tensor


class InvalidOutput(RunnerFault):
    """The model produced an output it must not (or one the wire cannot carry); names the tensor when known."""

    code = ErrorCode.INVALID_OUTPUT

    def __init__(self, message: str, *, tensor: str | None = None) -> None:
        super().__init__(message)
        self.tensor = tensor


class InvalidModel(RunnerFault):
    """The model folder, a model file or a declared tensor is wrong for this runner (missing, corrupt, unsafe)."""

    code = ErrorCode.INVALID_MODEL


class InvalidOption(RunnerFault):
    """A runner option has the wrong type or value; ``option`` names it."""

    code = ErrorCode.INVALID_OPTION

    def __init__(self, message: str, *, option: str | None = None) -> None:
        super().__init__(message)
        self.option = option


class UnsupportedModel(RunnerFault):
    """The runner does not implement what the model needs (an architecture, an operator, a config key)."""

    code = ErrorCode.UNSUPPORTED_MODEL
