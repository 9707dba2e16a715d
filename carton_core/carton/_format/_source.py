"""Random-access byte sources a zip is read from: a local file, bytes in memory, or an HTTP(S) URL.

The zip reader needs only ``size``, ``read_at`` (small reads: headers, central directory, metadata files) and
``iter_range`` (streaming a large entry). A URL source reads with HTTP Range requests; when the server ignores
ranges it falls back to downloading the whole file once into a private temporary file and reading that.
"""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

import httpx

from ..errors import FetchError, FormatError, UnsafeArchive
from ._http import DecodeError, decode_stream, describe_http_error, make_client
from ._limits import ReadLimits

__all__ = ["BytesSource", "FileSource", "HttpSource", "Source", "open_source"]

_CHUNK = 1 << 20
#: How much of a remote file's tail the first request fetches: the central directory of a carton with a few
#: hundred files, carton.toml and MANIFEST (written last by `carton.pack`) usually all fit.
_TAIL = 256 << 10
_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+)")


class Source(Protocol):
    """Bytes the zip reader reads by offset. ``name`` is used in error messages."""

    @property
    def name(self) -> str: ...
    @property
    def size(self) -> int: ...
    def read_at(self, offset: int, length: int) -> bytes: ...
    def iter_range(self, offset: int, length: int, chunk_size: int = _CHUNK) -> Iterator[bytes]: ...
    def iter_range_reusing(self, offset: int, length: int, chunk_size: int) -> Iterator[bytes | memoryview]:
        """`iter_range` for consumers that copy what they keep: each piece may be valid only until the next one."""
        ...

    def close(self) -> None: ...


def _check_range(source: Source, offset: int, length: int) -> None:
    if offset < 0 or length < 0 or offset + length > source.size:
        raise UnsafeArchive(
            f"{source.name}: read of {length} bytes at offset {offset} is outside the {source.size}-byte file"
        )


class BytesSource:
    """A zip held in memory (tests, the fuzzer)."""

    def __init__(self, data: bytes, name: str = "<bytes>") -> None:
        self._data = memoryview(data)
        self._name = name

    @property
    def name(self) -> str:
        return self._name

    @property
    def size(self) -> int:
        return len(self._data)

    def read_at(self, offset: int, length: int) -> bytes:
        _check_range(self, offset, length)
        return bytes(self._data[offset : offset + length])

    def iter_range(self, offset: int, length: int, chunk_size: int = _CHUNK) -> Iterator[bytes]:
        _check_range(self, offset, length)
        for start in range(offset, offset + length, chunk_size):
            yield bytes(self._data[start : min(start + chunk_size, offset + length)])

    def iter_range_reusing(self, offset: int, length: int, chunk_size: int) -> Iterator[bytes]:
        return self.iter_range(offset, length, chunk_size)

    def close(self) -> None:
        self._data.release()


class FileSource:
    """A local file read with ``pread`` (no shared file position, so concurrent readers are safe)."""

    def __init__(self, path: Path, *, display_name: str | None = None) -> None:
        self.path = path
        self._name = display_name or str(path)
        try:
            self._fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError as exc:
            raise FormatError(f"{path}: cannot open: {exc.strerror}") from exc
        self._size = os.fstat(self._fd).st_size

    @property
    def name(self) -> str:
        return self._name

    @property
    def size(self) -> int:
        return self._size

    def fileno(self) -> int:
        return self._fd

    def read_at(self, offset: int, length: int) -> bytes:
        _check_range(self, offset, length)
        parts: list[bytes] = []
        while length:
            part = os.pread(self._fd, length, offset)
            if not part:
                raise FormatError(f"{self._name}: file shrank while being read (at offset {offset})")
            parts.append(part)
            offset += len(part)
            length -= len(part)
        return b"".join(parts)

    def iter_range(self, offset: int, length: int, chunk_size: int = _CHUNK * 4) -> Iterator[bytes]:
        _check_range(self, offset, length)
        end = offset + length
        while offset < end:
            part = self.read_at(offset, min(chunk_size, end - offset))
            offset += len(part)
            yield part

    def iter_range_reusing(self, offset: int, length: int, chunk_size: int) -> Iterator[memoryview]:
        """`iter_range` into one reused buffer: each view is valid only until the next one is produced.

        For consumers that copy what they keep (decompressors): no fresh allocation per piece, so the input stays
        in cache (docs/performance.md, "Package format").
        """
        _check_range(self, offset, length)
        buffer = memoryview(bytearray(min(chunk_size, max(length, 1))))
        end = offset + length
        while offset < end:
            n = os.preadv(self._fd, [buffer[: min(len(buffer), end - offset)]], offset)
            if n <= 0:
                raise FormatError(f"{self._name}: file shrank while being read (at offset {offset})")
            offset += n
            yield buffer[:n]

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class HttpSource:
    """A remote carton read with HTTP Range requests.

    Construct with `HttpSource.open`, which falls back to a `FileSource` over a full download when the server
    answers the first range request with the whole body (status 200).
    """

    def __init__(self, url: str, client: httpx.Client, size: int, tail_offset: int, tail: bytes) -> None:
        self._url = url
        self._client = client
        self._size = size
        self._tail_offset = tail_offset
        self._tail = tail

    @property
    def name(self) -> str:
        return self._url

    @property
    def size(self) -> int:
        return self._size

    @classmethod
    def open(cls, url: str, limits: ReadLimits, download_dir: Path) -> Source:
        client = make_client(limits.http_timeout)
        try:
            with client.stream("GET", url, headers={"Range": f"bytes=-{_TAIL}", "Accept-Encoding": "identity"}) as r:
                if r.status_code == 206:
                    start, _end, total = _parse_content_range(url, r.headers.get("content-range"))
                    tail = b"".join(r.iter_raw())
                    if start + len(tail) != total:
                        raise FetchError(f"{url}: range response has {len(tail)} bytes, Content-Range disagrees")
                    return cls(url, client, total, start, tail)
                if r.status_code == 416:
                    raise FetchError(f"{url}: server refused the range request (HTTP 416): the file is empty")
                r.raise_for_status()
                # The server ignores ranges: this response is the whole file; keep it in a private temp file.
                source = _download(url, r, limits, download_dir)
            client.close()
            return source
        except httpx.HTTPError as exc:
            client.close()
            raise FetchError(f"{url}: {describe_http_error(exc)}") from exc
        except BaseException:
            client.close()
            raise

    def read_at(self, offset: int, length: int) -> bytes:
        _check_range(self, offset, length)
        if offset >= self._tail_offset:
            start = offset - self._tail_offset
            return self._tail[start : start + length]
        return b"".join(self.iter_range(offset, length))

    def iter_range(self, offset: int, length: int, chunk_size: int = _CHUNK) -> Iterator[bytes]:
        _check_range(self, offset, length)
        if length == 0:
            return
        if offset >= self._tail_offset:
            yield self.read_at(offset, length)
            return
        headers = {"Range": f"bytes={offset}-{offset + length - 1}", "Accept-Encoding": "identity"}
        received = 0
        try:
            with self._client.stream("GET", self._url, headers=headers) as r:
                if r.status_code != 206:
                    r.raise_for_status()
                    raise FetchError(f"{self._url}: server stopped honouring range requests (HTTP {r.status_code})")
                start, end, _total = _parse_content_range(self._url, r.headers.get("content-range"))
                if (start, end) != (offset, offset + length - 1):
                    raise FetchError(f"{self._url}: asked for bytes {offset}-{offset + length - 1}, got {start}-{end}")
                if r.headers.get("content-encoding", "identity").lower() not in ("identity", ""):
                    raise FetchError(f"{self._url}: server applied a content-encoding to a range response")
                for chunk in r.iter_raw(chunk_size):
                    received += len(chunk)
                    if received > length:
                        raise FetchError(f"{self._url}: range response is longer than the {length} bytes asked for")
                    yield chunk
        except httpx.HTTPError as exc:
            raise FetchError(f"{self._url}: {describe_http_error(exc)}") from exc
        if received != length:
            raise FetchError(f"{self._url}: range response ended after {received} of {length} bytes")

    def iter_range_reusing(self, offset: int, length: int, chunk_size: int) -> Iterator[bytes]:
        return self.iter_range(offset, length, chunk_size)

    def close(self) -> None:
        self._client.close()


def _parse_content_range(url: str, header: str | None) -> tuple[int, int, int]:
    match = _CONTENT_RANGE.fullmatch((header or "").strip())
    if not match:
        raise FetchError(f"{url}: range response has a missing or malformed Content-Range ({header!r})")
    start, end, total = (int(g) for g in match.groups())
    if not start <= end < total:
        raise FetchError(f"{url}: inconsistent Content-Range {header!r}")
    return start, end, total


def _download(url: str, response: httpx.Response, limits: ReadLimits, download_dir: Path) -> Source:
    download_dir.mkdir(parents=True, exist_ok=True)
    # The file is unlinked when the `with` block ends; the source keeps its own descriptor open, so on POSIX the
    # bytes stay readable and nothing is left behind in the cache.
    with tempfile.NamedTemporaryFile(dir=download_dir, prefix="download-", suffix=".carton") as handle:
        raw = response.iter_raw(_CHUNK)
        try:
            encoding = response.headers.get("content-encoding")
            for chunk in decode_stream(raw, encoding, max_bytes=limits.max_total_size):
                handle.write(chunk)
        except DecodeError as exc:
            raise FetchError(f"{url}: {exc}") from exc
        handle.flush()
        return FileSource(Path(handle.name), display_name=url)


def open_source(location: str | os.PathLike[str], limits: ReadLimits, download_dir: Path) -> Source:
    """A source for a local path or an http(s) URL."""
    text = os.fspath(location)
    if text.startswith(("http://", "https://")):
        return HttpSource.open(text, limits, download_dir)
    return FileSource(Path(text))
