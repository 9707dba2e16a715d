"""Streaming decompressors with an output cap, shared by the zip reader and HTTP content decoding.

Each decoder's ``feed(data, max_length)`` returns at most ``max_length`` bytes; ``pending()`` says whether more
output is waiting without new input (call ``feed(b"", ...)`` again); ``finish()`` raises `DecodeError` unless the
stream ended cleanly. Callers count what comes out and stop at their own limits: no declared size is trusted.
"""

from __future__ import annotations

import sys
import zlib
from collections.abc import Callable
from typing import Protocol

import brotli

if sys.version_info >= (3, 14):  # pragma: no cover - exercised only on newer interpreters
    from compression import zstd
else:
    from backports import zstd

__all__ = ["DECODERS", "DecodeError", "Decoder", "RawDeflate", "Zstd", "zstd"]


class DecodeError(Exception):
    """A response body could not be decoded, or decoded to more than the allowed number of bytes."""


class Decoder(Protocol):
    def feed(self, data: bytes | memoryview, max_length: int) -> bytes: ...
    def pending(self) -> bool: ...
    def finish(self) -> None: ...


class _Identity:
    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, data: bytes | memoryview, max_length: int) -> bytes:
        data = self._buffer + data
        self._buffer = data[max_length:]
        return data[:max_length]

    def pending(self) -> bool:
        return bool(self._buffer)

    def finish(self) -> None:
        return None


class _Zlib:
    """gzip (wbits 31) or deflate: HTTP's "deflate" is zlib-wrapped, but some servers send raw deflate."""

    def __init__(self, gzip: bool) -> None:
        self._gzip = gzip
        self._obj: zlib._Decompress | None = zlib.decompressobj(31) if gzip else None
        self._head = b""

    def feed(self, data: bytes | memoryview, max_length: int) -> bytes:
        if self._obj is None:
            self._head += data
            if len(self._head) < 2:
                return b""
            cmf, flg = self._head[0], self._head[1]
            wrapped = cmf & 0x0F == 8 and (cmf * 256 + flg) % 31 == 0
            self._obj = zlib.decompressobj(15 if wrapped else -15)
            data, self._head = self._head, b""
        try:
            return self._obj.decompress(self._obj.unconsumed_tail + data, max_length)
        except zlib.error as exc:
            raise DecodeError(f"invalid {'gzip' if self._gzip else 'deflate'} data: {exc}") from exc

    def pending(self) -> bool:
        return self._obj is not None and bool(self._obj.unconsumed_tail)

    def finish(self) -> None:
        if self._obj is None or not self._obj.eof:
            raise DecodeError(f"truncated {'gzip' if self._gzip else 'deflate'} stream")


class RawDeflate:
    """Raw deflate (zip method 8): the stream must end exactly where the entry's data ends."""

    def __init__(self) -> None:
        self._obj = zlib.decompressobj(-15)

    def feed(self, data: bytes | memoryview, max_length: int) -> bytes:
        if self._obj.eof:
            if data:
                raise DecodeError("data after the end of the deflate stream")
            return b""
        try:
            tail = self._obj.unconsumed_tail
            out = self._obj.decompress(tail + data if tail else data, max_length)
        except zlib.error as exc:
            raise DecodeError(f"invalid deflate data: {exc}") from exc
        if self._obj.unused_data:
            raise DecodeError("data after the end of the deflate stream")
        return out

    def pending(self) -> bool:
        return bool(self._obj.unconsumed_tail)

    def finish(self) -> None:
        if not self._obj.eof:
            raise DecodeError("truncated deflate stream")


class Zstd:
    def __init__(self) -> None:
        self._obj = zstd.ZstdDecompressor()
        self._started = False

    def feed(self, data: bytes | memoryview, max_length: int) -> bytes:
        # The decompressor's own output objects are returned as they are (joined only when a frame boundary splits
        # a call): extraction is bound by memory bandwidth, and every copy is one more pass over the bytes.
        parts: list[bytes] = []
        produced = 0
        try:
            while produced < max_length:
                if self._obj.eof:
                    # Several concatenated frames are one valid zstd stream.
                    data = self._obj.unused_data + data
                    if not data:
                        break
                    self._obj = zstd.ZstdDecompressor()
                self._started = True
                part = self._obj.decompress(data, max_length - produced)
                data = b""
                if part:
                    parts.append(part)
                    produced += len(part)
                if not self._obj.eof and self._obj.needs_input:
                    break
        except zstd.ZstdError as exc:
            raise DecodeError(f"invalid zstd data: {exc}") from exc
        if len(parts) == 1:
            return parts[0]
        return b"".join(parts)

    def pending(self) -> bool:
        if self._obj.eof:
            return bool(self._obj.unused_data)
        return not self._obj.needs_input

    def finish(self) -> None:
        if self._started and not self._obj.eof:
            raise DecodeError("truncated zstd stream")


class _Brotli:
    def __init__(self) -> None:
        self._obj = brotli.Decompressor()
        self._buffer = b""
        self._more = False

    def feed(self, data: bytes | memoryview, max_length: int) -> bytes:
        try:
            if data and not self._obj.can_accept_more_data():
                # Output of earlier input is still pending: brotli wants empty input until it is drained.
                self._buffer += data
                data = b""
            elif self._buffer:
                data, self._buffer = self._buffer + data, b""
            out: bytes = self._obj.process(data, output_buffer_limit=max_length)
        except brotli.error as exc:
            raise DecodeError(f"invalid br data: {exc}") from exc
        # can_accept_more_data() does not say whether output is pending; a full buffer does.
        self._more = (len(out) >= max_length and not self._obj.is_finished()) or bool(self._buffer)
        return out

    def pending(self) -> bool:
        return self._more

    def finish(self) -> None:
        if not self._obj.is_finished():
            raise DecodeError("truncated br stream")


DECODERS: dict[str, Callable[[], Decoder]] = {
    "identity": _Identity,
    "gzip": lambda: _Zlib(gzip=True),
    "x-gzip": lambda: _Zlib(gzip=True),
    "deflate": lambda: _Zlib(gzip=False),
    "zstd": Zstd,
    "br": _Brotli,
}
