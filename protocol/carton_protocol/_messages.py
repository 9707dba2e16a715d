"""The messages of the wire: typed, tagged msgspec structs, encoded as msgpack maps in the first frame of a message.

A message is a ZeroMQ multipart message: frame 0 is the header, a msgpack map, and frames 1.. carry tensor bytes in
the order the header lists them (`carton_protocol._framing`). A request's first key is ``op`` (which request), a
reply's is ``reply`` (which request it answers, or ``error``); both then carry the request ``id``. Each side decodes
a header in one place (`decode_request`, `decode_reply`) into one of the types below, and dispatches with ``match``.
Fields are only ever added (a peer ignores fields it does not know); a change an older peer would misread bumps
`PROTOCOL_VERSION`. docs/protocol.md lists every message with its exact bytes.
"""

from __future__ import annotations

from typing import Any

import msgspec

from ._limits import WireLimits
from ._runner import OptValue
from ._spec import TensorSpec
from .errors import FrameError, LimitExceeded

__all__ = [
    "PROTOCOL_VERSION",
    "Close",
    "CloseReply",
    "ErrorReply",
    "Hello",
    "HelloReply",
    "Infer",
    "InferReply",
    "Load",
    "LoadReply",
    "Pack",
    "PackReply",
    "Release",
    "Reply",
    "Request",
    "TensorEntry",
    "check_opts",
    "check_specs",
    "decode_reply",
    "decode_request",
    "encode",
    "peer_protocol",
]

#: The wire protocol version both sides send in ``hello``. Fields only ever get added; anything that would break an
#: older peer bumps this number, and a peer that sees a different number refuses to talk (`VersionMismatch`).
#: 2: replies are tagged (``reply``) and errors travel as a code (`ErrorCode`), not an exception class name.
PROTOCOL_VERSION = 2

_MAX_OPT_DEPTH = 32


class TensorEntry(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One tensor of an ``infer`` request or reply (Triton-style; docs/protocol.md, "Tensor entries").

    Either ``datatype``/``shape``/``size`` (the bytes are in the next data frame, or in shared memory at ``shm``
    = [segment id, offset]), or ``nested``: a list of unnamed entries, one array each. The decoder checks every
    field against the limits and the bytes that arrived (`carton_protocol._framing`).
    """

    name: str | None = None
    datatype: str | None = None
    shape: tuple[int, ...] | None = None
    size: int | None = None
    shm: tuple[str, int] | None = None
    nested: tuple[TensorEntry, ...] | None = None


class _Message(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """``id``: the request's number (the connection counts from 1). ``drop``: shared-memory segments the sender
    no longer uses, which the receiver unmaps (any message may carry it; left out when empty)."""

    id: int
    drop: tuple[str, ...] = ()


# --- requests: host to runner ------------------------------------------------------------------------------------
class Hello(_Message, tag_field="op", tag="hello", frozen=True, kw_only=True):
    """The host's first message. No ``shm_threshold``: this connection uses no shared memory."""

    protocol: int
    host_pid: int
    shm_threshold: int | None = None


class Load(_Message, tag_field="op", tag="load", frozen=True, kw_only=True):
    """Load the model in `model_dir` (once per runner process)."""

    model_dir: str
    opts: dict[str, Any]
    inputs: tuple[TensorSpec, ...] = ()
    outputs: tuple[TensorSpec, ...] = ()
    scratch_dir: str | None = None


class Pack(_Message, tag_field="op", tag="pack", frozen=True, kw_only=True):
    """Run the runner class's ``pack`` on `model_dir`."""

    model_dir: str
    opts: dict[str, Any]
    inputs: tuple[TensorSpec, ...] = ()
    outputs: tuple[TensorSpec, ...] = ()


class Infer(_Message, tag_field="op", tag="infer", frozen=True, kw_only=True):
    """One inference; the tensors' bytes follow in data frames or lie in shared memory."""

    tensors: tuple[TensorEntry, ...]


class Release(_Message, tag_field="op", tag="release", frozen=True, kw_only=True):
    """The host has read these runner segments (outputs in shared memory); the runner may reuse them. No reply."""

    segments: tuple[str, ...]


class Close(_Message, tag_field="op", tag="close", frozen=True, kw_only=True):
    """Close the model and exit after replying."""


Request = Hello | Load | Pack | Infer | Release | Close


# --- replies: runner to host -------------------------------------------------------------------------------------
class HelloReply(_Message, tag_field="reply", tag="hello", frozen=True, kw_only=True):
    """The runner's protocol version, its pid (inside its PID namespace when sandboxed), the entry it imported,
    whether that class is concurrent, and its Python version."""

    protocol: int
    pid: int
    entry: str
    concurrent: bool = False
    python: str = ""


class LoadReply(_Message, tag_field="reply", tag="load", frozen=True, kw_only=True):
    """The model is loaded; the warnings the runner issued meanwhile."""

    warnings: tuple[str, ...] = ()


class PackReply(_Message, tag_field="reply", tag="pack", frozen=True, kw_only=True):
    """What the runner's ``pack`` returned, and the warnings it issued."""

    inputs: tuple[TensorSpec, ...] = ()
    outputs: tuple[TensorSpec, ...] = ()
    opts: dict[str, Any] = msgspec.field(default_factory=dict)
    warnings: tuple[str, ...] = ()


class InferReply(_Message, tag_field="reply", tag="infer", frozen=True, kw_only=True):
    """The outputs; their bytes follow in data frames or lie in the runner's shared memory."""

    tensors: tuple[TensorEntry, ...]


class CloseReply(_Message, tag_field="reply", tag="close", frozen=True, kw_only=True):
    """The model is closed; the runner exits after sending this."""


class ErrorReply(_Message, tag_field="reply", tag="error", frozen=True, kw_only=True):
    """The request failed. ``code`` is an `ErrorCode` value (a newer peer may send one this version does not know);
    ``exception`` names the exception type for people. ``id`` is -1 when the request itself could not be read.
    A failed ``hello`` also carries the runner's ``protocol``."""

    code: str
    message: str
    exception: str = ""
    traceback: str = ""
    tensor: str | None = None
    warnings: tuple[str, ...] = ()
    protocol: int | None = None


Reply = HelloReply | LoadReply | PackReply | InferReply | CloseReply | ErrorReply


class _ProtocolProbe(msgspec.Struct):
    protocol: Any = None


_encoder = msgspec.msgpack.Encoder()
_requests = msgspec.msgpack.Decoder(Request)
_replies = msgspec.msgpack.Decoder(Reply)
_probe = msgspec.msgpack.Decoder(_ProtocolProbe)


def encode(message: Request | Reply) -> bytes:
    """The header bytes of `message` (deterministic: fields in their declared order, defaults left out)."""
    try:
        return _encoder.encode(message)
    except (TypeError, ValueError, OverflowError) as exc:
        raise FrameError(f"{type(message).__name__} cannot be encoded: {exc}") from exc


def _decode(decoder: msgspec.msgpack.Decoder[Any], data: bytes | memoryview, limits: WireLimits) -> Any:
    size = len(data)
    if size > limits.max_header_bytes:
        raise LimitExceeded(f"header frame is {size} bytes, over the {limits.max_header_bytes}-byte limit")
    try:
        return decoder.decode(data)
    except msgspec.ValidationError as exc:
        raise FrameError(f"header frame: {exc}") from exc
    except (ValueError, RecursionError) as exc:  # msgspec.DecodeError, UnicodeDecodeError (a bad utf-8 string)
        raise FrameError(f"header frame is not valid msgpack: {exc}") from exc


def decode_request(data: bytes | memoryview, limits: WireLimits) -> Request:
    """The request in header frame `data`; `FrameError` naming the field at fault."""
    message: Request = _decode(_requests, data, limits)
    return message


def decode_reply(data: bytes | memoryview, limits: WireLimits) -> Reply:
    """The reply in header frame `data`; `FrameError` naming the field at fault."""
    message: Reply = _decode(_replies, data, limits)
    return message


def peer_protocol(data: bytes | memoryview, limits: WireLimits) -> object:
    """The ``protocol`` field of a hello reply, read without assuming anything else about its layout (a peer
    speaking another version may lay its replies out differently); ``None`` when absent."""
    probe: _ProtocolProbe = _decode(_probe, data, limits)
    return probe.protocol


def check_specs(specs: tuple[TensorSpec, ...], what: str, limits: WireLimits) -> tuple[TensorSpec, ...]:
    """`specs` from a peer, within the limits (count, rank); the types were checked when they were decoded."""
    if len(specs) > limits.max_tensors:
        raise LimitExceeded(f"{what}: {len(specs)} tensor specs, over the limit of {limits.max_tensors}")
    for index, spec in enumerate(specs):
        if not isinstance(spec.shape, str) and len(spec.shape) > limits.max_rank:
            raise LimitExceeded(f"{what}[{index}] ({spec.name!r}): rank {len(spec.shape)} over {limits.max_rank}")
    return specs


def check_opts(raw: dict[str, Any], what: str) -> dict[str, OptValue]:
    """Runner options from a peer: maps with string keys, lists, str, int, float, bool (no nil, no binary, no ext),
    nested at most 32 deep."""
    _check_opt(raw, what, 0)
    return raw


def _check_opt(value: object, where: str, depth: int) -> None:
    if depth > _MAX_OPT_DEPTH:
        raise LimitExceeded(f"{where}: nested deeper than {_MAX_OPT_DEPTH}")
    kind = type(value)
    if kind in (str, int, float, bool):
        return
    if isinstance(value, list) and kind is list:
        for index, item in enumerate(value):
            _check_opt(item, f"{where}[{index}]", depth + 1)
        return
    if isinstance(value, dict) and kind is dict:
        for key, item in value.items():
            if type(key) is not str:
                raise FrameError(f"{where}: runner option keys must be strings, got {type(key).__name__}")
            _check_opt(item, f"{where}.{key}", depth + 1)
        return
    raise FrameError(f"{where}: a runner option cannot be a {kind.__name__}")
