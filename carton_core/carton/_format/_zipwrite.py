"""A deterministic zip writer (stdlib zipfile cannot write zstd, method 93).

Every entry gets the same DOS timestamp (1980-01-01 00:00), Unix mode 0644 and no data descriptor: the local header
is written first and patched with the CRC and sizes once the data is out, so the output is a pure function of the
entries' names, bytes, order and methods. zip64 records are used exactly when a size, an offset or the entry count
needs them.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Protocol

from ._codecs import zstd
from ._zipread import METHOD_DEFLATE, METHOD_STORED, METHOD_ZSTD

__all__ = ["COMPRESSION_METHODS", "DATA_ALIGNMENT", "ZSTD_LEVEL", "ZipWriter"]

#: ``compression=`` names accepted by `carton.pack`.
COMPRESSION_METHODS = {"stored": METHOD_STORED, "deflate": METHOD_DEFLATE, "zstd": METHOD_ZSTD}
#: The zstd level carton writes with: zstd's default, fast to write and to read.
ZSTD_LEVEL = 3

_LOCAL = struct.Struct("<4sHHHHHIIIHH")
_CENTRAL = struct.Struct("<4sHHHHHHIIIHHHHHII")
_EOCD = struct.Struct("<4sHHHHIIH")
_Z64_EOCD = struct.Struct("<4sQHHIIQQQQ")
_Z64_LOCATOR = struct.Struct("<4sIQI")
_DOS_TIME = 0
_DOS_DATE = (0 << 9) | (1 << 5) | 1  # 1980-01-01, the earliest DOS date
_MADE_BY = (3 << 8) | 63  # Unix, APPNOTE 6.3
_FILE_MODE = 0o100644 << 16
_FLAG_UTF8 = 0x800
_U16 = 0xFFFF
_U32 = 0xFFFFFFFF
#: Entries at least this large reserve a zip64 extra field in their local header, since their compressed size
#: could pass 4 GiB (compression can expand incompressible data slightly).
_ZIP64_THRESHOLD = 0xF0000000
_CHUNK = 4 << 20
#: Stored entries at least `_ALIGN_FROM` bytes long start their data on a multiple of `DATA_ALIGNMENT` (the
#: zipalign technique): the kernel then copies them out page cache to page cache at `cp` speed, where an unaligned
#: source runs about 40 % slower (docs/format.md, "Data alignment"). The padding is an extra field of the local
#: header with Android's alignment tag (0xD935: a u16 alignment, then zeros), which every zip reader skips.
DATA_ALIGNMENT = 4096
_ALIGN_FROM = 64 << 10
_ALIGNMENT_TAG = 0xD935


class _Compressor(Protocol):
    def compress(self, data: bytes) -> bytes: ...
    def flush(self) -> bytes: ...


class _Stored:
    def compress(self, data: bytes) -> bytes:
        return data

    def flush(self) -> bytes:
        return b""


def _compressor(method: int) -> _Compressor:
    if method == METHOD_STORED:
        return _Stored()
    if method == METHOD_DEFLATE:
        return zlib.compressobj(6, zlib.DEFLATED, -15)
    if method == METHOD_ZSTD:
        return zstd.ZstdCompressor(level=ZSTD_LEVEL)
    raise ValueError(f"unknown zip method {method}")


@dataclass(slots=True)
class _Written:
    name: bytes
    method: int
    crc32: int
    compressed_size: int
    uncompressed_size: int
    offset: int


class ZipWriter:
    """Write entries in the order given to a seekable binary file; `close` writes the central directory."""

    def __init__(self, fileobj: BinaryIO) -> None:
        self._out = fileobj
        self._written: list[_Written] = []
        self._names: set[str] = set()

    def add_bytes(self, name: str, data: bytes, method: int) -> None:
        self.add_chunks(name, [data], method, size_hint=len(data))

    def add_file(
        self, name: str, path: Path, method: int, *, on_chunk: Callable[[bytes], object] | None = None
    ) -> None:
        """Add a file's bytes, read in chunks; ``on_chunk`` sees each uncompressed chunk (hashing, progress)."""
        with path.open("rb") as handle:
            size = path.stat().st_size

            def chunks() -> Iterable[bytes]:
                while chunk := handle.read(_CHUNK):
                    if on_chunk is not None:
                        on_chunk(chunk)
                    yield chunk

            self.add_chunks(name, chunks(), method, size_hint=size)

    def add_chunks(self, name: str, chunks: Iterable[bytes], method: int, *, size_hint: int) -> None:
        """Compress and add the bytes of ``chunks``. ``size_hint`` (the expected uncompressed size) decides
        whether the local header reserves zip64 fields."""
        compressor = _compressor(method)

        def encoded() -> Iterable[tuple[bytes, bytes]]:
            for chunk in chunks:
                yield chunk, compressor.compress(chunk)
            yield b"", compressor.flush()

        self._write_entry(name, method, encoded(), size_hint)

    def add_raw(
        self, name: str, method: int, *, crc32: int, uncompressed_size: int, raw_chunks: Iterable[bytes]
    ) -> None:
        """Copy an entry's already compressed bytes (``carton.shrink``); the CRC and size are the caller's."""

        def encoded() -> Iterable[tuple[bytes, bytes]]:
            for chunk in raw_chunks:
                yield b"", chunk

        self._write_entry(name, method, encoded(), uncompressed_size, known=(crc32, uncompressed_size))

    def _write_entry(
        self,
        name: str,
        method: int,
        encoded: Iterable[tuple[bytes, bytes]],
        size_hint: int,
        known: tuple[int, int] | None = None,
    ) -> None:
        if name in self._names:
            raise ValueError(f"duplicate zip entry {name!r}")
        self._names.add(name)
        raw_name = name.encode("utf-8")
        flags = 0 if raw_name.isascii() else _FLAG_UTF8
        offset = self._out.tell()
        zip64 = size_hint >= _ZIP64_THRESHOLD
        extra = struct.pack("<HHQQ", 1, 16, 0, 0) if zip64 else b""
        if method == METHOD_STORED and size_hint >= _ALIGN_FROM:
            unpadded = offset + _LOCAL.size + len(raw_name) + len(extra) + 6
            padding = -unpadded % DATA_ALIGNMENT
            extra += struct.pack("<HHH", _ALIGNMENT_TAG, 2 + padding, DATA_ALIGNMENT) + bytes(padding)
        needed = _version_needed(method, zip64)
        self._out.write(
            _LOCAL.pack(b"PK\x03\x04", needed, flags, method, _DOS_TIME, _DOS_DATE, 0, 0, 0, len(raw_name), len(extra))
        )
        self._out.write(raw_name)
        self._out.write(extra)
        crc = 0
        usize = 0
        csize = 0
        for plain, packed in encoded:
            if plain:
                crc = zlib.crc32(plain, crc)
                usize += len(plain)
            if packed:
                self._out.write(packed)
                csize += len(packed)
        if known is not None:
            crc, usize = known
        if not zip64 and max(usize, csize) >= _U32:
            raise ValueError(f"{name}: grew past 4 GiB although {size_hint} bytes were announced")
        end = self._out.tell()
        self._out.seek(offset + 14)
        if zip64:
            self._out.write(struct.pack("<III", crc, _U32, _U32))
            self._out.seek(offset + _LOCAL.size + len(raw_name) + 4)
            self._out.write(struct.pack("<QQ", usize, csize))
        else:
            self._out.write(struct.pack("<III", crc, csize, usize))
        self._out.seek(end)
        self._written.append(_Written(raw_name, method, crc, csize, usize, offset))

    def close(self) -> None:
        cd_offset = self._out.tell()
        for entry in self._written:
            values = [("u", entry.uncompressed_size), ("c", entry.compressed_size), ("o", entry.offset)]
            overflow = [v for _k, v in values if v >= _U32]
            extra = struct.pack("<HH", 1, 8 * len(overflow)) + b"".join(struct.pack("<Q", v) for v in overflow)
            usize, csize, offset = (_U32 if v >= _U32 else v for _k, v in values)
            needed = _version_needed(entry.method, bool(overflow))
            flags = 0 if entry.name.isascii() else _FLAG_UTF8
            self._out.write(
                _CENTRAL.pack(
                    b"PK\x01\x02", _MADE_BY, needed, flags, entry.method, _DOS_TIME, _DOS_DATE, entry.crc32,
                    csize, usize, len(entry.name), len(extra) if overflow else 0, 0, 0, 0, _FILE_MODE, offset,
                )
            )  # fmt: skip
            self._out.write(entry.name)
            if overflow:
                self._out.write(extra)
        cd_end = self._out.tell()
        cd_size = cd_end - cd_offset
        count = len(self._written)
        if count >= _U16 or cd_size >= _U32 or cd_offset >= _U32:
            self._out.write(
                _Z64_EOCD.pack(b"PK\x06\x06", _Z64_EOCD.size - 12, _MADE_BY, 45, 0, 0, count, count, cd_size, cd_offset)
            )
            self._out.write(_Z64_LOCATOR.pack(b"PK\x06\x07", 0, cd_end, 1))
            count16 = _U16
            cd_size, cd_offset = min(cd_size, _U32), min(cd_offset, _U32)
        else:
            count16 = count
        self._out.write(_EOCD.pack(b"PK\x05\x06", 0, 0, count16, count16, cd_size, cd_offset, 0))
        self._out.flush()


def _version_needed(method: int, zip64: bool) -> int:
    version = 63 if method == METHOD_ZSTD else 20
    return max(version, 45) if zip64 else version
