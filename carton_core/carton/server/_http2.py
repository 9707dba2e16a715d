"""The server side of an HTTP/2 connection (RFC 9113) as gRPC clients use it: carton's own frame layer.

`Http2Connection` is an asyncio protocol that checks the connection preface, parses frames, keeps the streams'
states and both directions' flow-control windows, and answers SETTINGS, PING and protocol errors itself. A subclass
gets a call per request (`request_received`), per piece of body (`body_received`), per end of body (`body_ended`) and
per stream the client reset (`stream_reset`), and answers with `send_headers` and `send_data` (or, for a whole
small response at once, `send_response_now`, which does not wait); frames are buffered and written by `flush` (once
per batch of received bytes, and by the subclass after its sends).

Header blocks are decoded by the `hpack` library (dynamic table, Huffman). Header blocks sent are built once and
reused: `header_block` makes one that never touches the client's dynamic table, `indexing_block` one that inserts
headers into it or names those a previous block inserted (a subclass keeps track of what it inserted, in the order
its blocks are sent). This side's table stays within the default 4096 bytes; when the client's HEADER_TABLE_SIZE
setting goes below that, the next header block sent starts by emptying the table (a size update to 0) and
`header_table_lowered` tells the subclass to insert nothing more. Server push is never used. Why not the `h2`
library: docs/server.md, "The gRPC server". The wire format (frame types, flags, settings, error codes, the header
blocks sent) is `._http2_frames`'s; this module keeps the streams' states, the windows and the frames' handling.
"""

from __future__ import annotations

import abc
import asyncio
import logging
import struct
from typing import cast

import msgspec
from hpack import Decoder
from hpack.exceptions import HPACKError

from ._bounded import remember
from ._http2_frames import (
    ACK,
    CONTINUATION,
    DATA,
    DEFAULT_FRAME,
    DEFAULT_TABLE,
    DEFAULT_WINDOW,
    EMPTY_TABLE,
    ENABLE_PUSH,
    END_HEADERS,
    END_STREAM,
    GOAWAY,
    HEADER_TABLE_SIZE,
    HEADERS,
    HEADERS_MASK,
    INITIAL_WINDOW_SIZE,
    MAX_CONCURRENT_STREAMS,
    MAX_FRAME_SIZE,
    MAX_WINDOW,
    PADDED,
    PING,
    PRIORITY,
    PRIORITY_FLAG,
    PUSH_PROMISE,
    RST_STREAM,
    SETTINGS,
    WINDOW_UPDATE,
    ErrorCode,
    Http2Error,
    StreamGone,
    frame,
    goaway_frame,
    header_block,
    indexing_block,
    unpad,
)

__all__ = ["ErrorCode", "Http2Connection", "StreamGone", "header_block", "indexing_block"]

_log = logging.getLogger("carton.server")

# Offered to clients: a large receive window and frames, so large tensors arrive in few frames and few window updates.
_WINDOW = 4 * 1024 * 1024
_HALF_WINDOW = _WINDOW // 2  # given back once used
_MAX_FRAME = 1024 * 1024
_MAX_STREAMS = 1000
# A header block split over CONTINUATION frames is bounded before it is decoded (hpack bounds the decoded list).
_MAX_HEADER_BLOCK = 256 * 1024

# Decoded header blocks kept per connection: a client's calls repeat a handful (one per method and model).
_KNOWN_BLOCKS = 64
# The preface, and a frame's head: length (24 bits, as 8 + 16), type, flags, stream id. They are this module's own
# names, not imported ones: CPython compiles `name.method(...)` on a name an import bound as an attribute load and a
# call (a bound method made on every call) rather than a method call, and a frame's head is on every request's path.
_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_HEAD = struct.Struct(">BHBBI")
_U32 = struct.Struct(">I")


class _Stream(msgspec.Struct, gc=False, eq=False):
    """A stream's state. (A struct: made in C, without a Python ``__init__``; it holds numbers only, so the garbage
    collector need not track it.)"""

    send_window: int
    ended: bool  # the client's END_STREAM came
    # Bytes received and not yet given back with a WINDOW_UPDATE: the stream's receive window is what is left.
    received: int = 0


class Http2Connection(asyncio.Protocol, abc.ABC):
    """One client connection; a subclass answers its requests."""

    def __init__(self) -> None:
        self._transport: asyncio.Transport | None = None
        self._out: list[bytes] = []
        self._parts: list[bytes] = []  # received bytes not yet parsed
        self._have = 0
        self._need = len(_PREFACE)
        self._preface = True
        # The client's first SETTINGS came and no header block is being continued: a frame of any kind may come.
        self._ordinary = False
        self._settled = False  # the client's first SETTINGS came
        self._decoder = Decoder()
        self._known: dict[bytes, dict[bytes, bytes]] = {}  # header blocks of indexed fields only, decoded
        self._streams: dict[int, _Stream] = {}
        self._last_stream = 0
        self._continuing: tuple[int, int, list[bytes]] | None = None  # stream id, flags, fragments of a header block
        self._send_window = DEFAULT_WINDOW
        self._initial_window = DEFAULT_WINDOW
        self._max_frame = DEFAULT_FRAME
        self._received = 0  # DATA bytes not yet given back: the connection's receive window is what is left
        self._stream_owed = False  # a stream has received half of its window since its last WINDOW_UPDATE
        self._waiters: list[asyncio.Future[None]] = []
        self._going_away = False
        # The client's HEADER_TABLE_SIZE went below the default: the next header block sent empties the table.
        # (One attribute: Python 3.11 keeps an instance's attributes inline, each read specialized, only while it has
        # fewer than 30 names, and a connection of the gRPC transport has 28 with it.)
        self._empty_table = False
        self.closed = False

    # ---- what a subclass does --------------------------------------------------------------------------------------
    @abc.abstractmethod
    def request_received(self, stream_id: int, headers: dict[bytes, bytes]) -> None:
        """A request's header block arrived (its body, if any, follows); `headers` may be shared between requests
        and must not be changed."""

    @abc.abstractmethod
    def body_received(self, stream_id: int, data: bytes) -> None:
        """A piece of a request's body arrived."""

    @abc.abstractmethod
    def body_ended(self, stream_id: int) -> None:
        """The request's body is complete (the client's END_STREAM)."""

    def body_ending(self, stream_id: int, data: bytes) -> None:
        """The last piece of a request's body arrived (its DATA frame ended the stream): `body_received`, then
        `body_ended` if the stream is still open (a subclass may take the two in one step)."""
        stream = self._streams.get(stream_id)
        self.body_received(stream_id, data)
        if stream is not None and self._streams.get(stream_id) is stream:
            self.body_ended(stream_id)

    @abc.abstractmethod
    def stream_reset(self, stream_id: int) -> None:
        """The client reset the stream, or the connection ended under it: its request is abandoned."""

    def header_table_lowered(self) -> None:
        """The client's HEADER_TABLE_SIZE went below the default: the header blocks sent from now on must insert
        nothing into its dynamic table (the next one sent empties it). By default nothing to do: a subclass that
        sends `indexing_block`s switches to `header_block`s."""

    # ---- the socket ------------------------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's transports are not its subclasses
        settings = b"".join(
            struct.pack(">HI", key, value)
            for key, value in (
                (MAX_CONCURRENT_STREAMS, _MAX_STREAMS),
                (INITIAL_WINDOW_SIZE, _WINDOW),
                (MAX_FRAME_SIZE, _MAX_FRAME),
            )
        )
        self._out.append(frame(SETTINGS, 0, 0, settings))
        self._out.append(frame(WINDOW_UPDATE, 0, 0, (_WINDOW - DEFAULT_WINDOW).to_bytes(4, "big")))
        self.flush()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        streams = list(self._streams)
        self._streams.clear()
        for stream_id in streams:
            self.stream_reset(stream_id)
        self._wake()

    def data_received(self, data: bytes) -> None:
        if self._have or self.closed or len(data) < self._need:
            self._data_more(data)
            return
        # The usual read: whole frames from the start (a client's request, its window updates), parsed here.
        at = 0
        size = len(data)
        need = 9  # the bytes that make the next frame's head (or, once that is known, the whole frame)
        try:
            if self._preface:
                if data[: len(_PREFACE)] != _PREFACE:
                    raise Http2Error(ErrorCode.PROTOCOL_ERROR, "not the HTTP/2 connection preface")
                self._preface = False
                at = len(_PREFACE)
            while size - at >= 9:
                high, low, kind, flags, stream_id = _HEAD.unpack_from(data, at)
                length = high << 16 | low
                if length > _MAX_FRAME:
                    raise Http2Error(ErrorCode.FRAME_SIZE_ERROR, f"a frame of {length} bytes")
                end: int = at + 9 + length
                if end > size:
                    need = 9 + length
                    break
                start = at + 9  # the payload is data[start:end], sliced only where it is used
                at = end
                stream_id &= MAX_WINDOW
                if not self._ordinary:
                    if not self._settled and kind != SETTINGS:
                        raise Http2Error(ErrorCode.PROTOCOL_ERROR, "the first frame is not SETTINGS")
                    if self._continuing is not None and kind != CONTINUATION:
                        raise Http2Error(ErrorCode.PROTOCOL_ERROR, "a frame inside a header block")
                # A call's frames first: the client's two WINDOW_UPDATEs (its stream's, and the connection's for the
                # last response), handled here, its DATA and its HEADERS.
                if kind == WINDOW_UPDATE:
                    if length != 4:
                        message = "a WINDOW_UPDATE frame that is not 4 bytes"
                        raise Http2Error(ErrorCode.FRAME_SIZE_ERROR, message)
                    increment = _U32.unpack_from(data, start)[0] & MAX_WINDOW
                    if not stream_id:
                        if not increment:
                            raise Http2Error(ErrorCode.PROTOCOL_ERROR, "a WINDOW_UPDATE of 0")
                        self._send_window += increment
                        if self._send_window > MAX_WINDOW:
                            message = "the connection's window over 2^31-1"
                            raise Http2Error(ErrorCode.FLOW_CONTROL_ERROR, message)
                    elif (stream := self._streams.get(stream_id)) is not None:
                        stream.send_window += increment
                        if not increment or stream.send_window > MAX_WINDOW:
                            code = ErrorCode.PROTOCOL_ERROR if not increment else ErrorCode.FLOW_CONTROL_ERROR
                            self._reset(stream_id, code)
                    elif stream_id > self._last_stream:
                        raise Http2Error(ErrorCode.PROTOCOL_ERROR, "a WINDOW_UPDATE on a stream never opened")
                    # (a closed stream's is ignored)
                    if self._waiters:  # usually none: the response went out at once
                        self._wake()
                elif kind == DATA:
                    self._data(stream_id, flags, data[start:end])
                elif kind == HEADERS:
                    if flags & HEADERS_MASK == END_HEADERS and stream_id:  # the usual: plain, whole
                        self._header_block(stream_id, flags, data[start:end])
                    else:
                        self._headers(stream_id, flags, data[start:end])
                elif kind == CONTINUATION:
                    self._continuation(stream_id, flags, data[start:end])
                elif kind == SETTINGS:
                    self._settings(stream_id, flags, data[start:end])
                elif kind == PING:
                    if length != 8:
                        raise Http2Error(ErrorCode.FRAME_SIZE_ERROR, "a PING frame that is not 8 bytes")
                    if stream_id:
                        raise Http2Error(ErrorCode.PROTOCOL_ERROR, "a PING frame on a stream")
                    if not flags & ACK:
                        self._out.append(frame(PING, ACK, 0, data[start:end]))
                elif kind == RST_STREAM:
                    self._rst_stream(stream_id, data[start:end])
                elif kind == GOAWAY:
                    if stream_id:
                        raise Http2Error(ErrorCode.PROTOCOL_ERROR, "a GOAWAY frame on a stream")
                    self.flush()
                    self.close()
                    return
                elif kind == PRIORITY:
                    if length != 5:
                        raise Http2Error(ErrorCode.FRAME_SIZE_ERROR, "a PRIORITY frame that is not 5 bytes")
                elif kind == PUSH_PROMISE:
                    raise Http2Error(ErrorCode.PROTOCOL_ERROR, "a client sent PUSH_PROMISE")
                # Other frame types are extensions this side does not take part in: ignored, as RFC 9113 asks.
        except Http2Error as error:
            self._fail(error.code, str(error))
            return
        self._need = need
        if at < size:
            self._parts = [data[at:]]
            self._have = size - at
        if self._received >= _HALF_WINDOW or self._stream_owed:
            self._give_back()
        if self._out:
            self.flush()

    def _data_more(self, data: bytes) -> None:
        """`data_received` when bytes of an unfinished frame (or of the preface) wait, or too few came to parse: the
        bytes are kept until a frame is whole, then parsed together."""
        if self.closed:
            return
        self._parts.append(data)
        self._have += len(data)
        if self._have < self._need:
            if self._preface and not _PREFACE.startswith(b"".join(self._parts)):  # say so without waiting for more
                self._fail(ErrorCode.PROTOCOL_ERROR, "not the HTTP/2 connection preface")
            return
        buffer = b"".join(self._parts) if len(self._parts) > 1 else self._parts[0]
        self._parts = []
        self._have = 0
        self.data_received(buffer)

    def flush(self) -> None:
        """Write the frames buffered so far."""
        if self._out:
            out = b"".join(self._out) if len(self._out) > 1 else self._out[0]
            self._out = []
            if self._transport is not None and not self.closed:
                self._transport.write(out)

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    def goaway(self) -> None:
        """Tell the client no new streams are taken; the streams under way go on."""
        if not self.closed and not self._going_away:
            self._going_away = True
            self._out.append(goaway_frame(self._last_stream, ErrorCode.NO_ERROR))
            self.flush()

    def _fail(self, code: int, message: str) -> None:
        _log.debug("HTTP/2 connection error %d: %s", code, message)
        self._out.append(goaway_frame(self._last_stream, code, message.encode()))
        self.flush()
        self.closed = True
        self.close()

    # ---- receiving: the frames' handlers ------------------------------------------------------------------------
    def _settings(self, stream_id: int, flags: int, payload: bytes) -> None:
        if stream_id:
            raise Http2Error(ErrorCode.PROTOCOL_ERROR, "a SETTINGS frame on a stream")
        if flags & ACK:
            if payload:
                raise Http2Error(ErrorCode.FRAME_SIZE_ERROR, "a SETTINGS acknowledgement with a payload")
            return
        if len(payload) % 6:
            raise Http2Error(ErrorCode.FRAME_SIZE_ERROR, "a SETTINGS frame that is not whole settings")
        self._settled = True
        self._ordinary = self._continuing is None
        for key, value in struct.iter_unpack(">HI", payload):
            if key == INITIAL_WINDOW_SIZE:
                if value > MAX_WINDOW:
                    raise Http2Error(ErrorCode.FLOW_CONTROL_ERROR, "an INITIAL_WINDOW_SIZE over 2^31-1")
                delta = value - self._initial_window
                self._initial_window = value
                for stream in self._streams.values():
                    stream.send_window += delta
                    if stream.send_window > MAX_WINDOW:
                        raise Http2Error(ErrorCode.FLOW_CONTROL_ERROR, "a stream's window over 2^31-1")
                self._wake()
            elif key == MAX_FRAME_SIZE:
                if not DEFAULT_FRAME <= value < 1 << 24:
                    raise Http2Error(ErrorCode.PROTOCOL_ERROR, f"a MAX_FRAME_SIZE of {value}")
                self._max_frame = value
                self._wake()
            elif key == ENABLE_PUSH and value > 1:
                raise Http2Error(ErrorCode.PROTOCOL_ERROR, f"an ENABLE_PUSH of {value}")
            elif key == HEADER_TABLE_SIZE and value < DEFAULT_TABLE:
                # The table this side's blocks use must shrink, which HPACK says at the start of the next block:
                # it is emptied (a size of 0 fits any setting), and nothing is inserted from then on.
                self._empty_table = True
                self.header_table_lowered()
            # The others (this side opens no streams, and its header blocks are small) have nothing to change.
        self._out.append(frame(SETTINGS, ACK, 0))

    def _rst_stream(self, stream_id: int, payload: bytes) -> None:
        if len(payload) != 4:
            raise Http2Error(ErrorCode.FRAME_SIZE_ERROR, "an RST_STREAM frame that is not 4 bytes")
        if not stream_id or stream_id > self._last_stream:
            raise Http2Error(ErrorCode.PROTOCOL_ERROR, "an RST_STREAM on a stream never opened")
        if self._streams.pop(stream_id, None) is not None:
            self.stream_reset(stream_id)
            self._wake()

    def _headers(self, stream_id: int, flags: int, payload: bytes) -> None:
        if not stream_id:
            raise Http2Error(ErrorCode.PROTOCOL_ERROR, "a HEADERS frame on stream 0")
        if flags & PADDED:
            payload = unpad(payload)
        if flags & PRIORITY_FLAG:
            if len(payload) < 5:
                raise Http2Error(ErrorCode.FRAME_SIZE_ERROR, "a HEADERS frame too short for its priority")
            payload = payload[5:]
        if flags & END_HEADERS:
            self._header_block(stream_id, flags, payload)
        else:
            self._continuing = (stream_id, flags, [payload])
            self._ordinary = False

    def _continuation(self, stream_id: int, flags: int, payload: bytes) -> None:
        if self._continuing is None or self._continuing[0] != stream_id:
            raise Http2Error(ErrorCode.PROTOCOL_ERROR, "a CONTINUATION frame outside a header block")
        _, first_flags, fragments = self._continuing
        fragments.append(payload)
        if sum(map(len, fragments)) > _MAX_HEADER_BLOCK:
            raise Http2Error(ErrorCode.PROTOCOL_ERROR, "a header block over 256 KiB")
        if flags & END_HEADERS:
            self._continuing = None
            self._ordinary = self._settled
            self._header_block(stream_id, first_flags, b"".join(fragments))

    def _header_block(self, stream_id: int, flags: int, block: bytes) -> None:
        headers = self._known.get(block)
        if headers is None:
            try:
                decoded = cast(list[tuple[bytes, bytes]], self._decoder.decode(block, raw=True))
            except HPACKError as exc:
                raise Http2Error(ErrorCode.COMPRESSION_ERROR, "a header block that is not valid HPACK") from exc
            headers = dict(decoded)
            # A client repeats its calls' headers as blocks of one-byte indexed fields (each byte above 0x80, none
            # 0xff, which starts a longer index). Such a block leaves the dynamic table as it is, so while the table
            # stays as it is it means the same headers again; any other block may change the table.
            if min(block, default=0) > 0x80 and 0xFF not in block:
                remember(self._known, block, headers, _KNOWN_BLOCKS)
            elif self._known:
                self._known.clear()
        if stream_id <= self._last_stream:  # a stream's trailers (they end its request), or a stream id used up
            stream = self._streams.get(stream_id)
            if stream is None:
                raise Http2Error(ErrorCode.PROTOCOL_ERROR, f"a request on stream {stream_id}")
            if stream.ended:
                self._reset(stream_id, ErrorCode.STREAM_CLOSED)
            elif not flags & END_STREAM:
                raise Http2Error(ErrorCode.PROTOCOL_ERROR, "trailers without END_STREAM")
            else:
                stream.ended = True
                self.body_ended(stream_id)
            return
        if not stream_id & 1:
            raise Http2Error(ErrorCode.PROTOCOL_ERROR, f"a request on stream {stream_id}")
        self._last_stream = stream_id
        if self._going_away or len(self._streams) >= _MAX_STREAMS:
            self._out.append(frame(RST_STREAM, 0, stream_id, ErrorCode.REFUSED_STREAM.to_bytes(4, "big")))
            return
        # Ended (or not) before the subclass answers, which may end the stream.
        stream = self._streams[stream_id] = _Stream(self._initial_window, flags & END_STREAM != 0)
        self.request_received(stream_id, headers)
        if flags & END_STREAM and self._streams.get(stream_id) is stream:
            self.body_ended(stream_id)

    def _data(self, stream_id: int, flags: int, payload: bytes) -> None:
        if not stream_id or stream_id > self._last_stream:
            raise Http2Error(ErrorCode.PROTOCOL_ERROR, "a DATA frame on a stream never opened")
        length = len(payload)
        self._received += length
        if self._received > _WINDOW:
            raise Http2Error(ErrorCode.FLOW_CONTROL_ERROR, "DATA over the connection's window")
        if flags & PADDED:
            payload = unpad(payload)
        stream = self._streams.get(stream_id)
        if stream is None:  # a stream answered or reset already: only the connection's window counts it
            return
        if stream.ended:
            self._reset(stream_id, ErrorCode.STREAM_CLOSED)
            return
        stream.received += length
        if stream.received >= _HALF_WINDOW:
            if stream.received > _WINDOW:
                self._reset(stream_id, ErrorCode.FLOW_CONTROL_ERROR)
                return
            self._stream_owed = True
        if not flags & END_STREAM:
            if payload:
                self.body_received(stream_id, payload)
            return
        stream.ended = True
        if payload:
            self.body_ending(stream_id, payload)
        else:
            self.body_ended(stream_id)

    def _give_back(self) -> None:
        """Give the client back the window its DATA used, once half of a window is used (so it never runs out)."""
        if self._received >= _HALF_WINDOW:
            self._out.append(frame(WINDOW_UPDATE, 0, 0, self._received.to_bytes(4, "big")))
            self._received = 0
        if not self._stream_owed:
            return
        self._stream_owed = False
        for stream_id, stream in self._streams.items():
            if stream.received >= _HALF_WINDOW and not stream.ended:
                self._out.append(frame(WINDOW_UPDATE, 0, stream_id, stream.received.to_bytes(4, "big")))
                stream.received = 0

    def _reset(self, stream_id: int, code: int) -> None:
        """A stream error: RST_STREAM with `code`, and the request is abandoned."""
        self._out.append(frame(RST_STREAM, 0, stream_id, code.to_bytes(4, "big")))
        if self._streams.pop(stream_id, None) is not None:
            self.stream_reset(stream_id)
            self._wake()

    def _wake(self) -> None:
        if not self._waiters:  # the usual case: every window update comes here
            return
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    # ---- sending ---------------------------------------------------------------------------------------------------
    def send_headers(self, stream_id: int, block: bytes, *, end_stream: bool = False) -> None:
        """Buffer a HEADERS frame with the header block `block` (see `header_block`); `end_stream` ends the response,
        and the stream with it (a request still arriving is then reset with NO_ERROR, as RFC 9113 allows)."""
        stream = self._streams.get(stream_id)
        if stream is None or self.closed:
            raise StreamGone(stream_id)
        flags = END_STREAM if end_stream else 0
        if self._empty_table:
            self._empty_table = False
            block = EMPTY_TABLE + block
        if len(block) <= self._max_frame:
            self._out.append(frame(HEADERS, flags | END_HEADERS, stream_id, block))
        else:
            pieces = [block[at : at + self._max_frame] for at in range(0, len(block), self._max_frame)]
            self._out.append(frame(HEADERS, flags, stream_id, pieces[0]))
            for piece in pieces[1:-1]:
                self._out.append(frame(CONTINUATION, 0, stream_id, piece))
            self._out.append(frame(CONTINUATION, END_HEADERS, stream_id, pieces[-1]))
        if end_stream:
            self._response_ended(stream_id, stream)

    def _response_ended(self, stream_id: int, stream: _Stream) -> None:
        """The response on `stream` is whole: the stream is done (a request still arriving is reset with NO_ERROR,
        as RFC 9113 allows)."""
        del self._streams[stream_id]
        if not stream.ended:
            self._out.append(frame(RST_STREAM, 0, stream_id, ErrorCode.NO_ERROR.to_bytes(4, "big")))

    def send_response_now(
        self, stream_id: int, headers: bytes, pieces: tuple[bytes, ...], size: int, trailers: bytes
    ) -> bool:
        """Buffer a whole response if the client's windows and frame size take its body, the concatenation of
        `pieces` (`size` bytes in all), in one DATA frame now: a HEADERS frame with the header block `headers`, the
        DATA frame, and a HEADERS frame with the block `trailers` that ends the stream (as `send_headers`,
        `send_data` and `send_headers` with `end_stream` would, without waiting and in fewer steps: the usual small
        response); False, with nothing buffered, if they do not (then those three). Each header block must be at
        most 16384 bytes (the smallest frame size a client may set). `StreamGone` if the stream or connection is
        gone."""
        stream = self._streams.get(stream_id)
        if stream is None or self.closed:
            raise StreamGone(stream_id)
        if size > self._send_window or size > stream.send_window or size > self._max_frame:
            return False
        if self._empty_table:
            self._empty_table = False
            headers = EMPTY_TABLE + headers
        self._out += (
            _HEAD.pack(0, len(headers), HEADERS, END_HEADERS, stream_id),
            headers,
            _HEAD.pack(size >> 16, size & 0xFFFF, DATA, 0, stream_id),
            *pieces,
            _HEAD.pack(0, len(trailers), HEADERS, END_HEADERS | END_STREAM, stream_id),
            trailers,
        )
        # `_buffer_data` and `_response_ended` written out (the usual response's path): the DATA counted against the
        # connection's window (the stream's is gone with it), the stream done.
        self._send_window -= size
        del self._streams[stream_id]
        if not stream.ended:
            self._out.append(frame(RST_STREAM, 0, stream_id, ErrorCode.NO_ERROR.to_bytes(4, "big")))
        return True

    async def send_data(self, stream_id: int, data: bytes) -> None:
        """Buffer `data` in DATA frames, waiting for the client's windows to open when they are too small (the
        frames buffered so far are flushed before each wait); `StreamGone` if the stream or connection goes away."""
        view = memoryview(data)
        while view:
            stream = self._streams.get(stream_id)
            if stream is None or self.closed:
                raise StreamGone(stream_id)
            room = min(self._send_window, stream.send_window, self._max_frame, len(view))
            if room <= 0:
                self.flush()
                waiter = asyncio.get_running_loop().create_future()
                self._waiters.append(waiter)
                await waiter
                continue
            self._buffer_data(stream_id, stream, (data if room == len(data) else view[:room].tobytes(),), room)
            view = view[room:]

    def _buffer_data(self, stream_id: int, stream: _Stream, pieces: tuple[bytes, ...], size: int) -> None:
        """One DATA frame of the concatenation of `pieces` (`size` bytes, within both windows), counted against
        them."""
        self._out += (_HEAD.pack(size >> 16, size & 0xFFFF, DATA, 0, stream_id), *pieces)
        self._send_window -= size
        stream.send_window -= size
