"""HTTP/2's wire format as `._http2`'s connection speaks it (RFC 9113, RFC 7541): frame types, flags and settings, the
error codes this side sends, and the HPACK header blocks of responses (`header_block`, `indexing_block`), built once
and reused by the gRPC transport. Parsing a frame's fields is the connection's (it reads them in place from what it
received); header blocks received are decoded by the `hpack` library there.
"""

from __future__ import annotations

import enum

__all__ = [
    "ACK",
    "CONTINUATION",
    "DATA",
    "DEFAULT_FRAME",
    "DEFAULT_TABLE",
    "DEFAULT_WINDOW",
    "EMPTY_TABLE",
    "ENABLE_PUSH",
    "END_HEADERS",
    "END_STREAM",
    "GOAWAY",
    "HEADERS",
    "HEADERS_MASK",
    "HEADER_TABLE_SIZE",
    "INITIAL_WINDOW_SIZE",
    "MAX_CONCURRENT_STREAMS",
    "MAX_FRAME_SIZE",
    "MAX_WINDOW",
    "PADDED",
    "PING",
    "PRIORITY",
    "PRIORITY_FLAG",
    "PUSH_PROMISE",
    "RST_STREAM",
    "SETTINGS",
    "WINDOW_UPDATE",
    "ErrorCode",
    "Http2Error",
    "StreamGone",
    "frame",
    "goaway_frame",
    "header_block",
    "indexing_block",
    "unpad",
]

# Frame types.
DATA = 0
HEADERS = 1
PRIORITY = 2
RST_STREAM = 3
SETTINGS = 4
PUSH_PROMISE = 5
PING = 6
GOAWAY = 7
WINDOW_UPDATE = 8
CONTINUATION = 9
# Frame flags.
END_STREAM = 0x1
ACK = 0x1
END_HEADERS = 0x4
PADDED = 0x8
PRIORITY_FLAG = 0x20
HEADERS_MASK = END_HEADERS | PADDED | PRIORITY_FLAG

# Settings.
HEADER_TABLE_SIZE = 1
ENABLE_PUSH = 2
MAX_CONCURRENT_STREAMS = 3
INITIAL_WINDOW_SIZE = 4
MAX_FRAME_SIZE = 5
DEFAULT_TABLE = 4096  # the dynamic table's size an encoder may use until the client's settings say otherwise
EMPTY_TABLE = b"\x20"  # an HPACK dynamic table size update to 0
MAX_WINDOW = 2**31 - 1
DEFAULT_WINDOW = 65535
DEFAULT_FRAME = 16384


class ErrorCode(enum.IntEnum):
    """The error codes of the RST_STREAM and GOAWAY frames this side sends."""

    NO_ERROR = 0
    PROTOCOL_ERROR = 1
    FLOW_CONTROL_ERROR = 3
    STREAM_CLOSED = 5
    FRAME_SIZE_ERROR = 6
    REFUSED_STREAM = 7
    COMPRESSION_ERROR = 9


class StreamGone(Exception):
    """A send on a stream the client reset, or on a connection that is closed."""


class Http2Error(Exception):
    """A connection error: GOAWAY with `code`, then the connection is closed."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    return len(payload).to_bytes(3, "big") + bytes((kind, flags)) + stream_id.to_bytes(4, "big") + payload


def _integer(value: int, prefix_bits: int, first: int) -> bytes:
    """An HPACK integer with a `prefix_bits`-bit prefix whose other bits are `first`."""
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes((first | value,))
    out = bytearray((first | limit,))
    value -= limit
    while value >= 128:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


# The static table's entries a response names (RFC 7541, appendix A).
_STATIC_NAMES = {b":status": 8, b"content-type": 31}
_STATIC_FIELDS = {(b":status", b"200"): 8}


def header_block(headers: list[tuple[bytes, bytes]]) -> bytes:
    """An HPACK header block for `headers` that never touches the dynamic table (so any decoder state accepts it)."""
    out = []
    for name, value in headers:
        if (name, value) in _STATIC_FIELDS:
            out.append(_integer(_STATIC_FIELDS[name, value], 7, 0x80))
            continue
        index = _STATIC_NAMES.get(name)
        out.append(_integer(index, 4, 0) if index else b"\x00" + _integer(len(name), 7, 0) + name)
        out.append(_integer(len(value), 7, 0) + value)
    return b"".join(out)


def indexing_block(headers: list[tuple[bytes, bytes]], table: list[tuple[bytes, bytes]]) -> bytes:
    """An HPACK header block for `headers` against the client's dynamic table holding `table` (the headers inserted by
    the blocks sent before, newest first): a header in the static table or in `table` is named by its index, any
    other is inserted (and `table` updated to what the client's table holds after this block). The caller keeps
    `table` within `DEFAULT_TABLE` bytes (32 more per header than its name and value), so nothing is evicted."""
    out = []
    for name, value in headers:
        if (name, value) in _STATIC_FIELDS:
            out.append(_integer(_STATIC_FIELDS[name, value], 7, 0x80))
        elif (name, value) in table:
            out.append(_integer(62 + table.index((name, value)), 7, 0x80))
        else:
            index = _STATIC_NAMES.get(name)
            out.append(_integer(index, 6, 0x40) if index else b"\x40" + _integer(len(name), 7, 0) + name)
            out.append(_integer(len(value), 7, 0) + value)
            table.insert(0, (name, value))
    if sum(32 + len(name) + len(value) for name, value in table) > DEFAULT_TABLE:
        raise ValueError("the headers inserted would not fit the default dynamic table")
    return b"".join(out)


def unpad(payload: bytes) -> bytes:
    if not payload or payload[0] >= len(payload):
        raise Http2Error(ErrorCode.PROTOCOL_ERROR, "padding as long as the frame")
    return payload[1 : len(payload) - payload[0]]


def goaway_frame(last_stream: int, code: int, debug: bytes = b"") -> bytes:
    return frame(GOAWAY, 0, 0, last_stream.to_bytes(4, "big") + code.to_bytes(4, "big") + debug)
