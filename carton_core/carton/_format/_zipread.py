"""A hardened zip reader: end of central directory (and zip64), central directory, local headers, decompression.

Nothing an archive declares is trusted. Before anything is read: entry names are normalized and refused when
absolute, backslashed, or containing ``.``/``..``/empty components; duplicate names (after normalization, so the
original Carton writers' ``/MANIFEST`` and ``MANIFEST`` collide), file/directory name clashes, symlinks and other
special files, encryption, unknown methods and overlapping entries (CVE-2024-0450) are refused; declared sizes are
checked against the configured total and ratio caps. When an entry is read: its local header must agree with the
central directory, its data (and data descriptor) must end before the next entry starts, and decompression is
capped by our own byte count, so an entry that produces more or fewer bytes than it declared is refused.
"""

from __future__ import annotations

import stat
import struct
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from ..errors import ArchiveTooLarge, FormatError, UnsafeArchive
from ._codecs import DecodeError, Decoder, RawDeflate, Zstd
from ._limits import ReadLimits
from ._source import Source

__all__ = [
    "METHOD_DEFLATE",
    "METHOD_STORED",
    "METHOD_ZSTD",
    "QUIRK_ROOT_NAMES",
    "ZipEntry",
    "ZipReader",
    "normalize_name",
]

METHOD_STORED = 0
METHOD_DEFLATE = 8
#: zstd, as numbered by the zip APPNOTE (6.3.7) and written by the original Carton implementation.
METHOD_ZSTD = 93
_DECODER_FACTORIES: dict[int, Callable[[], Decoder]] = {METHOD_DEFLATE: RawDeflate, METHOD_ZSTD: Zstd}
_METHOD_NAMES = {METHOD_STORED: "stored", METHOD_DEFLATE: "deflate", METHOD_ZSTD: "zstd"}

#: Names some versions of the original writer gave with a leading slash; the only absolute names accepted.
QUIRK_ROOT_NAMES = frozenset({"/MANIFEST", "/LINKS"})

_EOCD = struct.Struct("<4sHHHHIIH")
_EOCD_SIG = b"PK\x05\x06"
_Z64_LOCATOR = struct.Struct("<4sIQI")
_Z64_LOCATOR_SIG = b"PK\x06\x07"
_Z64_EOCD = struct.Struct("<4sQHHIIQQQQ")
_Z64_EOCD_SIG = b"PK\x06\x06"
_CENTRAL = struct.Struct("<4sHHHHHHIIIHHHHHII")
_CENTRAL_SIG = b"PK\x01\x02"
_LOCAL = struct.Struct("<4sHHHHHIIIHH")
_LOCAL_SIG = b"PK\x03\x04"
_DESCRIPTOR_SIG = b"PK\x07\x08"
_MAX_COMMENT = 0xFFFF
_FLAG_ENCRYPTED = 0x1
_FLAG_DESCRIPTOR = 0x8
_FLAG_UTF8 = 0x800
_FLAG_STRONG_ENCRYPTION = 0x40
_HOST_UNIX = 3
_WINDOWS_REPARSE_POINT = 0x400
_U16 = 0xFFFF
_U32 = 0xFFFFFFFF
#: Pieces a compressed entry is decoded in by default. 64 KiB stays in L2 between decompression and whatever consumes
#: the piece on the same thread (a hash): 1 GiB of zstd extracted in 0.51-0.52 s, against 0.53 s with 128 KiB,
#: 0.55 s with 32 KiB and 0.6-1.6 s with 1 MiB, which came back from RAM (docs/performance.md). Extraction, which
#: writes on a second thread, asks for larger pieces (`piece_size`). Compressed input is read a few pieces at a time.
_DECODED_PIECE = 64 << 10
_COMPRESSED_READ = 256 << 10


@dataclass(frozen=True, slots=True, kw_only=True)
class ZipEntry:
    """One file of the archive as the central directory declares it. ``limit`` is the offset the entry's local
    header, data and descriptor must end by (the next entry's local header, or the central directory)."""

    name: str
    raw_name: bytes
    method: int
    flags: int
    crc32: int
    compressed_size: int
    uncompressed_size: int
    header_offset: int
    limit: int

    @property
    def method_name(self) -> str:
        return _METHOD_NAMES.get(self.method, str(self.method))


def normalize_name(raw: bytes, flags: int, where: str) -> str:
    """The entry's path as carton sees it, or `UnsafeArchive` naming it. A trailing ``/`` marks a directory."""
    try:
        name = raw.decode("utf-8")
    except UnicodeDecodeError:
        if flags & _FLAG_UTF8:
            raise UnsafeArchive(f"{where}: entry name {raw!r} is flagged UTF-8 but is not valid UTF-8") from None
        name = raw.decode("cp437")
    if name in QUIRK_ROOT_NAMES:
        name = name[1:]
    if "\\" in name:
        raise UnsafeArchive(f"{where}: entry name {name!r} contains a backslash")
    if "\x00" in name:
        raise UnsafeArchive(f"{where}: entry name {name!r} contains a NUL byte")
    if name.startswith("/") or (len(name) >= 2 and name[1] == ":" and name[0].isalpha()):
        raise UnsafeArchive(f"{where}: entry name {name!r} is an absolute path")
    parts = (name[:-1] if name.endswith("/") else name).split("/")
    for part in parts:
        if part in ("", ".", ".."):
            raise UnsafeArchive(f"{where}: entry name {name!r} has a {part or 'empty'!r} path component")
    return name


def _zip64_extra(extra: bytes, wanted: list[str], where: str) -> dict[str, int]:
    """Values of the zip64 extended information field for the 32-bit fields that overflowed, in APPNOTE order."""
    pos = 0
    while pos + 4 <= len(extra):
        tag, size = struct.unpack_from("<HH", extra, pos)
        pos += 4
        if pos + size > len(extra):
            raise UnsafeArchive(f"{where}: extra field 0x{tag:04x} runs past the end of the extra data")
        if tag == 0x0001:
            if size < 8 * len(wanted):
                raise UnsafeArchive(f"{where}: zip64 extra field is too short for {', '.join(wanted)}")
            return {key: struct.unpack_from("<Q", extra, pos + 8 * i)[0] for i, key in enumerate(wanted)}
        pos += size
    if wanted:
        raise UnsafeArchive(f"{where}: sizes or offset overflow 32 bits but there is no zip64 extra field")
    return {}


class ZipReader:
    """The validated central directory of a zip, and streaming access to its entries.

    ``entries`` maps normalized file names to entries; directory entries are checked and dropped. The reader
    counts every byte it decompresses against ``limits.max_total_size``.
    """

    def __init__(self, source: Source, limits: ReadLimits) -> None:
        self.source = source
        self.limits = limits
        self._produced = 0
        self.entries: dict[str, ZipEntry] = {}
        self.directories: frozenset[str] = frozenset()
        self._parse()

    # --- central directory --------------------------------------------------------------------------------
    def _error(self, message: str) -> str:
        return f"{self.source.name}: {message}"

    def _find_eocd(self) -> tuple[int, tuple[int, ...]]:
        size = self.source.size
        if size < _EOCD.size:
            raise FormatError(self._error(f"not a zip archive ({size} bytes is too short)"))
        tail_len = min(size, _EOCD.size + _MAX_COMMENT)
        tail = self.source.read_at(size - tail_len, tail_len)
        pos = tail.rfind(_EOCD_SIG)
        while pos >= 0:
            if pos + _EOCD.size <= len(tail):
                fields = _EOCD.unpack_from(tail, pos)
                # A valid record's comment runs exactly to the end of the file.
                if pos + _EOCD.size + fields[7] == len(tail):
                    return size - tail_len + pos, fields
            pos = tail.rfind(_EOCD_SIG, 0, pos)
        raise FormatError(self._error("not a zip archive (no end of central directory record)"))

    def _parse(self) -> None:
        eocd_offset, (_sig, disk, cd_disk, n_disk, n_total, cd_size, cd_offset, _clen) = self._find_eocd()
        cd_end = eocd_offset
        locator_offset = eocd_offset - _Z64_LOCATOR.size
        locator = self.source.read_at(locator_offset, _Z64_LOCATOR.size) if locator_offset >= 0 else b""
        if locator.startswith(_Z64_LOCATOR_SIG):
            _s, _ldisk, z64_offset, _ndisks = _Z64_LOCATOR.unpack(locator)
            if z64_offset + _Z64_EOCD.size > locator_offset:
                raise UnsafeArchive(self._error("zip64 end of central directory record is out of place"))
            record = _Z64_EOCD.unpack(self.source.read_at(z64_offset, _Z64_EOCD.size))
            if record[0] != _Z64_EOCD_SIG:
                raise UnsafeArchive(self._error("zip64 locator does not point at a zip64 end of directory record"))
            _s, _rsize, _made, _needed, disk, cd_disk, n_disk, n_total, cd_size, cd_offset = record
            cd_end = z64_offset
        elif _U16 in (n_disk, n_total) or _U32 in (cd_size, cd_offset):
            raise UnsafeArchive(self._error("end of central directory needs zip64 but has no zip64 locator"))
        if disk not in (0, _U16) or cd_disk not in (0, _U16) or n_disk != n_total:
            raise FormatError(self._error("multi-disk (split) zip archives are not supported"))
        if n_total > self.limits.max_entries:
            raise ArchiveTooLarge(self._error(f"{n_total} entries is over the limit of {self.limits.max_entries}"))
        if cd_offset + cd_size != cd_end:
            raise UnsafeArchive(
                self._error(f"central directory ({cd_size} bytes at {cd_offset}) does not end where its end record is")
            )
        self._parse_central(self.source.read_at(cd_offset, cd_size), n_total, cd_offset)

    def _parse_central(self, data: bytes, count: int, cd_offset: int) -> None:
        pos = 0
        raw_entries: list[ZipEntry] = []
        directories: set[str] = set()
        seen: set[str] = set()
        for index in range(count):
            if pos + _CENTRAL.size > len(data):
                raise UnsafeArchive(self._error(f"central directory is truncated at entry {index}"))
            fields = _CENTRAL.unpack_from(data, pos)
            (sig, made_by, _needed, flags, method, _time, _date, crc, csize, usize,
             nlen, elen, clen, disk_start, _iattr, eattr, offset) = fields  # fmt: skip
            if sig != _CENTRAL_SIG:
                raise UnsafeArchive(self._error(f"central directory entry {index} has a bad signature"))
            start = pos + _CENTRAL.size
            pos = start + nlen + elen + clen
            if pos > len(data):
                raise UnsafeArchive(self._error(f"central directory entry {index} runs past the directory's end"))
            raw_name = data[start : start + nlen]
            name = normalize_name(raw_name, flags, self.source.name)
            where = self._error(f"entry {name!r}")
            overflow = [k for k, v in (("usize", usize), ("csize", csize), ("offset", offset)) if v == _U32]
            if disk_start == _U16:
                overflow.append("disk")
            big = _zip64_extra(data[start + nlen : start + nlen + elen], overflow, where)
            usize, csize, offset = big.get("usize", usize), big.get("csize", csize), big.get("offset", offset)
            if name in seen:
                raise UnsafeArchive(f"{where}: duplicate entry name (after normalization)")
            seen.add(name)
            mode = eattr >> 16
            # Writers often store permission bits without a file type (stdlib zipfile: 0o600); that is a file.
            if made_by >> 8 == _HOST_UNIX and stat.S_IFMT(mode) and not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
                kind = "a symlink" if stat.S_ISLNK(mode) else f"a special file (mode {mode:o})"
                raise UnsafeArchive(f"{where}: entry is {kind}")
            if eattr & _WINDOWS_REPARSE_POINT and made_by >> 8 in (0, 10, 11, 14):
                raise UnsafeArchive(f"{where}: entry is a reparse point (symlink)")
            if flags & (_FLAG_ENCRYPTED | _FLAG_STRONG_ENCRYPTION):
                raise FormatError(f"{where}: encrypted entries are not supported")
            if method != METHOD_STORED and method not in _DECODER_FACTORIES:
                raise FormatError(f"{where}: compression method {method} is not supported (stored, deflate, zstd)")
            if method == METHOD_STORED and csize != usize:
                raise UnsafeArchive(f"{where}: stored entry declares {csize} compressed but {usize} real bytes")
            if name.endswith("/"):
                if usize or csize:
                    raise UnsafeArchive(f"{where}: directory entry has data")
                directories.add(name[:-1])
                continue
            self._check_ratio(where, csize, usize)
            raw_entries.append(
                ZipEntry(name=name, raw_name=raw_name, method=method, flags=flags, crc32=crc,
                         compressed_size=csize, uncompressed_size=usize, header_offset=offset, limit=0)
            )  # fmt: skip
        if pos != len(data):
            raise UnsafeArchive(self._error(f"central directory has {len(data) - pos} unaccounted trailing bytes"))
        self._check_total(raw_entries)
        self._check_tree(raw_entries, directories)
        self._assign_limits(raw_entries, cd_offset)
        self.directories = frozenset(directories)

    def _check_ratio(self, where: str, csize: int, usize: int) -> None:
        if usize > self.limits.ratio_floor and usize > csize * self.limits.max_ratio:
            raise ArchiveTooLarge(
                f"{where}: declares {usize} bytes from {csize} compressed, a ratio over the limit of "
                f"{self.limits.max_ratio:g}"
            )

    def _check_total(self, entries: list[ZipEntry]) -> None:
        total = sum(e.uncompressed_size for e in entries)
        if total > self.limits.max_total_size:
            raise ArchiveTooLarge(
                self._error(f"entries declare {total} bytes in all, over the limit of {self.limits.max_total_size}")
            )

    def _check_tree(self, entries: list[ZipEntry], directories: set[str]) -> None:
        files = {e.name for e in entries}
        for name in sorted(files):
            parts = name.split("/")
            for depth in range(1, len(parts)):
                parent = "/".join(parts[:depth])
                if parent in files:
                    raise UnsafeArchive(self._error(f"entry {name!r} is inside {parent!r}, which is a file"))
        clash = files & directories
        if clash:
            raise UnsafeArchive(self._error(f"entry {sorted(clash)[0]!r} is both a file and a directory"))

    def _assign_limits(self, entries: list[ZipEntry], cd_offset: int) -> None:
        ordered = sorted(entries, key=lambda e: e.header_offset)
        for i, entry in enumerate(ordered):
            limit = ordered[i + 1].header_offset if i + 1 < len(ordered) else cd_offset
            # The local header is at least as long as its fixed part and the name; anything less overlaps.
            minimum_end = entry.header_offset + _LOCAL.size + len(entry.raw_name) + entry.compressed_size
            if minimum_end > limit:
                raise UnsafeArchive(self._error(f"entry {entry.name!r} overlaps the next entry or the directory"))
            self.entries[entry.name] = ZipEntry(
                name=entry.name, raw_name=entry.raw_name, method=entry.method, flags=entry.flags,
                crc32=entry.crc32, compressed_size=entry.compressed_size,
                uncompressed_size=entry.uncompressed_size, header_offset=entry.header_offset, limit=limit,
            )  # fmt: skip

    # --- entries --------------------------------------------------------------------------------------------
    def data_span(self, entry: ZipEntry) -> tuple[int, int]:
        """``(offset, length)`` of the entry's compressed bytes, after checking its local header (and its data
        descriptor, if any) against the central directory."""
        where = self._error(f"entry {entry.name!r}")
        header = self.source.read_at(entry.header_offset, _LOCAL.size)
        (sig, _needed, flags, method, _time, _date, crc, csize, usize, nlen, elen) = _LOCAL.unpack(header)
        if sig != _LOCAL_SIG:
            raise UnsafeArchive(f"{where}: no local file header at offset {entry.header_offset}")
        if entry.header_offset + _LOCAL.size + nlen + elen > entry.limit:
            raise UnsafeArchive(f"{where}: local header overlaps the next entry")
        rest = self.source.read_at(entry.header_offset + _LOCAL.size, nlen + elen)
        if rest[:nlen] != entry.raw_name:
            raise UnsafeArchive(f"{where}: local header names {rest[:nlen]!r}, central directory disagrees")
        if method != entry.method or (flags ^ entry.flags) & (_FLAG_DESCRIPTOR | _FLAG_ENCRYPTED):
            raise UnsafeArchive(f"{where}: local header and central directory disagree on method or flags")
        overflow = [k for k, v in (("usize", usize), ("csize", csize)) if v == _U32]
        big = _zip64_extra(rest[nlen:], overflow, where) if overflow else {}
        usize, csize = big.get("usize", usize), big.get("csize", csize)
        declared = (crc, csize, usize)
        expected = (entry.crc32, entry.compressed_size, entry.uncompressed_size)
        if declared != expected and not (flags & _FLAG_DESCRIPTOR and declared == (0, 0, 0)):
            raise UnsafeArchive(f"{where}: local header declares crc/sizes {declared}, central directory {expected}")
        data_offset = entry.header_offset + _LOCAL.size + nlen + elen
        end = data_offset + entry.compressed_size
        if flags & _FLAG_DESCRIPTOR:
            end += self._check_descriptor(entry, end, where)
        if end > entry.limit:
            raise UnsafeArchive(f"{where}: data overlaps the next entry or the central directory")
        return data_offset, entry.compressed_size

    def _check_descriptor(self, entry: ZipEntry, offset: int, where: str) -> int:
        room = min(entry.limit - offset, 24)
        if room < 12:
            raise UnsafeArchive(f"{where}: data descriptor is missing or overlaps the next entry")
        blob = self.source.read_at(offset, room)
        skip = 4 if blob.startswith(_DESCRIPTOR_SIG) else 0
        expected = (entry.crc32, entry.compressed_size, entry.uncompressed_size)
        for width, fmt in ((4, "<III"), (8, "<IQQ")):
            length = skip + 4 + 2 * width
            if length <= room and struct.unpack_from(fmt, blob, skip) == expected:
                return length
        raise UnsafeArchive(f"{where}: data descriptor disagrees with the central directory's crc and sizes")

    def stored_span(self, entry: ZipEntry) -> tuple[int, int] | None:
        """The byte range of a stored (uncompressed) entry's content in the source, or None if compressed."""
        if entry.method != METHOD_STORED:
            return None
        return self.data_span(entry)

    def iter_entry(
        self,
        entry: ZipEntry,
        *,
        raw_sink: Callable[[bytes], object] | None = None,
        piece_size: int | None = None,
    ) -> Iterator[bytes]:
        """The entry's uncompressed bytes, in chunks of at most ``piece_size`` (default 64 KiB) for compressed
        entries. ``raw_sink`` also receives the compressed bytes as read.

        Raises `UnsafeArchive` when the entry produces more or fewer bytes than it declared and
        `ArchiveTooLarge` when the reader's total budget runs out.
        """
        where = self._error(f"entry {entry.name!r}")
        offset, length = self.data_span(entry)
        expected = entry.uncompressed_size
        produced = 0
        decoder = None if entry.method == METHOD_STORED else _DECODER_FACTORIES[entry.method]()
        piece = piece_size or _DECODED_PIECE

        def account(n: int) -> None:
            nonlocal produced
            produced += n
            self._produced += n
            if produced > expected:
                raise UnsafeArchive(f"{where}: decompresses to more than the {expected} bytes it declares")
            if self._produced > self.limits.max_total_size:
                raise ArchiveTooLarge(f"{where}: reading passes the limit of {self.limits.max_total_size} bytes")

        try:
            if decoder is None:
                for chunk in self.source.iter_range(offset, length):
                    if raw_sink is not None:
                        raw_sink(chunk)
                    account(len(chunk))
                    yield chunk
            else:
                for data in self._compressed(offset, length, raw_sink):
                    while True:
                        # Ask for one byte more than may remain, so an entry that lies is caught at once.
                        out = decoder.feed(data, min(piece, expected - produced + 1))
                        data = b""
                        if out:
                            account(len(out))
                            yield out
                        if not decoder.pending():
                            break
            if decoder is not None and length:
                decoder.finish()
        except DecodeError as exc:
            raise FormatError(f"{where}: corrupt {entry.method_name} data: {exc}") from exc
        if produced != expected:
            raise UnsafeArchive(f"{where}: decompresses to {produced} bytes but declares {expected}")

    def _compressed(
        self, offset: int, length: int, raw_sink: Callable[[bytes], object] | None
    ) -> Iterator[bytes | memoryview]:
        if raw_sink is None:
            # Decoders copy any input they keep, so one buffer can take every read.
            yield from self.source.iter_range_reusing(offset, length, _COMPRESSED_READ)
            return
        for chunk in self.source.iter_range(offset, length, _COMPRESSED_READ):
            raw_sink(chunk)
            yield chunk

    def read(self, entry: ZipEntry, *, max_size: int, check_crc: bool = True) -> bytes:
        """The whole entry in memory (metadata files), refused if it declares more than ``max_size`` bytes."""
        if entry.uncompressed_size > max_size:
            raise ArchiveTooLarge(
                self._error(f"entry {entry.name!r} is {entry.uncompressed_size} bytes, over the limit of {max_size}")
            )
        data = b"".join(self.iter_entry(entry))
        if check_crc and zlib.crc32(data) != entry.crc32:
            raise FormatError(self._error(f"entry {entry.name!r} fails its CRC-32 check"))
        return data
