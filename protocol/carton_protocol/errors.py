"""Exceptions of the wire layer. One root, `ProtocolError`; the host translates these into `carton` errors.

    ProtocolError
    ├── FrameError              a frame or header is malformed, or disagrees with the bytes that arrived
    │   └── LimitExceeded       a declared size, count or depth is over a configured limit
    ├── VersionMismatch         the two sides speak different protocol versions
    └── RemoteError             the other side reported a failure (carries its type name and message)
"""

from __future__ import annotations

__all__ = ["FrameError", "LimitExceeded", "ProtocolError", "RemoteError", "VersionMismatch"]


class ProtocolError(Exception):
    """Root of every error raised by `carton_protocol`."""


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
    """The peer failed while handling a request; `kind` is the peer's error class name."""

    def __init__(self, message: str, *, kind: str, traceback: str = "") -> None:
        super().__init__(message)
        self.kind = kind
        self.traceback = traceback
