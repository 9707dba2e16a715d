"""Hand-built zip archives for tests: every header field can be made to lie, so each refusal can be exercised.

This deliberately shares no code with carton's writer: fixtures built here test the reader against an independent
encoding of the zip format (APPNOTE 6.3).
"""

from __future__ import annotations

import hashlib
import struct
import zlib
from dataclasses import dataclass, field

from backports import zstd

STORED, DEFLATE, ZSTD = 0, 8, 93


def compress(data: bytes, method: int) -> bytes:
    if method == STORED:
        return data
    if method == DEFLATE:
        c = zlib.compressobj(6, zlib.DEFLATED, -15)
        return c.compress(data) + c.flush()
    if method == ZSTD:
        return zstd.compress(data)
    raise ValueError(method)


@dataclass
class Entry:
    name: str | bytes
    data: bytes = b""
    method: int = STORED
    flags: int = 0
    made_by: int = (3 << 8) | 63
    external_attr: int = 0o100644 << 16
    date: int = 0x21
    # Lies: None means "the truth".
    crc: int | None = None
    csize: int | None = None
    usize: int | None = None
    local_name: bytes | None = None
    local_method: int | None = None
    local_crc: int | None = None
    local_csize: int | None = None
    local_usize: int | None = None
    descriptor: bytes | None = None  # raw bytes written after the data (with flags |= 8)
    payload: bytes | None = None  # raw compressed bytes instead of compress(data)
    offset: int | None = None  # central directory's local header offset, filled in by build()
    point_at: int | None = None  # index of an earlier entry whose local header this one's CD record reuses
    raw: bytes = field(default=b"", repr=False)

    @property
    def name_bytes(self) -> bytes:
        return self.name.encode("utf-8") if isinstance(self.name, str) else self.name


def build(entries: list[Entry], *, comment: bytes = b"", trailing_cd: bytes = b"") -> bytes:
    """The archive bytes: local headers and data in order, then the central directory and end record."""
    out = bytearray()
    for e in entries:
        if e.point_at is not None:
            continue
        payload = e.payload if e.payload is not None else compress(e.data, e.method)
        crc = zlib.crc32(e.data) if e.crc is None else e.crc
        csize = len(payload) if e.csize is None else e.csize
        usize = len(e.data) if e.usize is None else e.usize
        e.crc, e.csize, e.usize = crc, csize, usize
        e.offset = len(out)
        name = e.local_name if e.local_name is not None else e.name_bytes
        out += struct.pack(
            "<4sHHHHHIIIHH", b"PK\x03\x04", 20, e.flags, e.method if e.local_method is None else e.local_method, 0,
            e.date, crc if e.local_crc is None else e.local_crc, csize if e.local_csize is None else e.local_csize,
            usize if e.local_usize is None else e.local_usize, len(name), 0,
        )
        out += name + payload
        if e.descriptor is not None:
            out += e.descriptor
    for e in entries:
        if e.point_at is not None:
            target = entries[e.point_at]
            e.offset, e.crc, e.csize, e.usize = target.offset, target.crc, target.csize, target.usize
    cd_offset = len(out)
    for e in entries:
        name = e.name_bytes
        out += struct.pack(
            "<4sHHHHHHIIIHHHHHII", b"PK\x01\x02", e.made_by, 20, e.flags, e.method, 0, e.date, e.crc, e.csize,
            e.usize, len(name), 0, 0, 0, 0, e.external_attr, e.offset,
        )
        out += name
    out += trailing_cd
    cd_size = len(out) - cd_offset
    out += struct.pack("<4sHHHHIIH", b"PK\x05\x06", 0, 0, len(entries), len(entries), cd_size, cd_offset,
                       len(comment))
    return bytes(out + comment)


def manifest(files: dict[str, bytes]) -> bytes:
    return "".join(f"{p}={hashlib.sha256(d).hexdigest()}\n" for p, d in sorted(files.items())).encode()


MINIMAL_TOML = b"""spec_version = 1
[runner]
runner_name = "onnxruntime"
required_framework_version = "=1.17.0"
runner_compat_version = 1
"""


def carton_entries(
    files: dict[str, bytes] | None = None, *, method: int = STORED, manifest_name: str = "MANIFEST",
    manifest_method: int = STORED, toml: bytes = MINIMAL_TOML,
) -> list[Entry]:
    """Entries of a valid carton holding ``files`` (plus carton.toml unless given), MANIFEST last."""
    contents = {"carton.toml": toml, "model/model.bin": b"weights" * 10}
    contents.update(files or {})
    entries = [Entry(name, data, method=method) for name, data in sorted(contents.items())]
    entries.append(Entry(manifest_name, manifest(contents), method=manifest_method))
    return entries
