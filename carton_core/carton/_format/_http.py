"""HTTP helpers shared by URL cartons and LINKS: one client configuration and content-encoding decoding.

Content encodings are decoded here from the raw byte stream (``Response.iter_raw``) rather than by httpx, so that
every encoding the spec lists works whatever optional decoders httpx finds installed, and so that the number of
decoded bytes is capped by us while decoding (a compressed response is a decompression bomb like any other).
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx

from ._codecs import DECODERS, DecodeError

__all__ = ["ACCEPT_ENCODING", "DecodeError", "decode_stream", "describe_http_error", "make_client"]

#: What we ask for when a whole file is fetched; range requests ask for ``identity``.
ACCEPT_ENCODING = "zstd, br, gzip, deflate"

_CHUNK = 1 << 20


def decode_stream(raw: Iterator[bytes], content_encoding: str | None, *, max_bytes: int) -> Iterator[bytes]:
    """Yield the decoded body of ``raw`` (a response's raw chunks) whose Content-Encoding header is given.

    Several encodings (``gzip, br``) are undone in reverse order. More than ``max_bytes`` decoded bytes, an unknown
    encoding, or a truncated or corrupt stream raise `DecodeError`.
    """
    names = [part.strip().lower() for part in (content_encoding or "").split(",") if part.strip()]
    try:
        decoders = [DECODERS[name]() for name in reversed(names)]
    except KeyError as exc:
        raise DecodeError(f"unsupported content-encoding {exc.args[0]!r}") from None
    produced = 0

    def run(data: bytes, stage: int) -> Iterator[bytes]:
        if stage == len(decoders):
            yield data
            return
        decoder = decoders[stage]
        while True:
            out = decoder.feed(data, _CHUNK)
            data = b""
            if out:
                yield from run(out, stage + 1)
            if not decoder.pending():
                return

    for chunk in raw:
        for out in run(chunk, 0):
            produced += len(out)
            if produced > max_bytes:
                raise DecodeError(f"decoded body is larger than the {max_bytes}-byte limit")
            yield out
    for decoder in decoders:
        decoder.finish()


def make_client(timeout: float) -> httpx.Client:
    """A client for fetching cartons and linked files: redirects followed, one timeout for connect and reads."""
    return httpx.Client(timeout=httpx.Timeout(timeout), follow_redirects=True)


def describe_http_error(exc: Exception) -> str:
    """A one-line reason for an httpx failure, for error messages."""
    if isinstance(exc, httpx.TimeoutException):
        return f"timed out ({type(exc).__name__})"
    if isinstance(exc, httpx.HTTPStatusError):
        return f"HTTP {exc.response.status_code}"
    return f"{type(exc).__name__}: {exc}"

