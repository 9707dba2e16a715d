"""The zip layer on its own: exact bytes written, interoperability with stdlib zipfile, zip64, and refusals."""

from __future__ import annotations

import io
import struct
import zipfile
import zlib

import pytest
from carton._format._limits import ReadLimits
from carton._format._source import BytesSource
from carton._format._zipread import ZipReader
from carton._format._zipwrite import ZipWriter
from carton.errors import ArchiveTooLarge, FormatError, UnsafeArchive

from .zipcraft import DEFLATE, STORED, ZSTD, Entry, build


def read_all(data: bytes, limits: ReadLimits | None = None) -> dict[str, bytes]:
    reader = ZipReader(BytesSource(data), limits or ReadLimits())
    return {name: b"".join(reader.iter_entry(e)) for name, e in reader.entries.items()}


def test_writer_exact_bytes() -> None:
    out = io.BytesIO()
    writer = ZipWriter(out)
    writer.add_bytes("a", b"hi", STORED)
    writer.close()
    crc = zlib.crc32(b"hi")
    local = struct.pack("<4sHHHHHIIIHH", b"PK\x03\x04", 20, 0, 0, 0, 0x21, crc, 2, 2, 1, 0) + b"a" + b"hi"
    central = struct.pack("<4sHHHHHHIIIHHHHHII", b"PK\x01\x02", 0x033F, 20, 0, 0, 0, 0x21, crc, 2, 2, 1, 0, 0, 0, 0,
                          0o100644 << 16, 0) + b"a"  # fmt: skip
    end = struct.pack("<4sHHHHIIH", b"PK\x05\x06", 0, 0, 1, 1, len(central), len(local), 0)
    assert out.getvalue() == local + central + end


def test_writer_aligns_large_stored_entries_exact_bytes() -> None:
    out = io.BytesIO()
    writer = ZipWriter(out)
    writer.add_bytes("a", b"hi", STORED)  # small: no padding
    big = bytes(range(256)) * 256  # 64 KiB: aligned
    writer.add_bytes("model/w.bin", big, STORED)
    writer.add_bytes("model/z.bin", big, ZSTD)  # compressed: never padded
    writer.close()
    data = out.getvalue()
    offset = 30 + 1 + 2  # after entry "a"
    padding = 4096 - (offset + 30 + len("model/w.bin") + 6)
    extra = struct.pack("<HHH", 0xD935, 2 + padding, 4096) + bytes(padding)
    local = struct.pack("<4sHHHHHIIIHH", b"PK\x03\x04", 20, 0, 0, 0, 0x21, zlib.crc32(big), len(big), len(big),
                        len("model/w.bin"), len(extra)) + b"model/w.bin" + extra  # fmt: skip
    assert data[offset : offset + len(local)] == local
    assert (offset + len(local)) % 4096 == 0
    assert data[offset + len(local) : offset + len(local) + len(big)] == big
    reader = ZipReader(BytesSource(data), ReadLimits())
    assert reader.data_span(reader.entries["model/w.bin"]) == (4096, len(big))
    zstd_offset, _ = reader.data_span(reader.entries["model/z.bin"])
    assert zstd_offset == 4096 + len(big) + 30 + len("model/z.bin")
    assert read_all(data) == {"a": b"hi", "model/w.bin": big, "model/z.bin": big}
    with zipfile.ZipFile(io.BytesIO(data)) as stdlib:  # the padding is an ordinary extra field to other readers
        assert stdlib.read("model/w.bin") == big


@pytest.mark.parametrize("method", [STORED, DEFLATE, ZSTD])
def test_writer_roundtrip_and_determinism(method: int) -> None:
    blobs = {"model/x.bin": bytes(range(256)) * 1000, "ü/é.txt": "ünïcode".encode(), "empty": b""}

    def write() -> bytes:
        out = io.BytesIO()
        writer = ZipWriter(out)
        for name, data in blobs.items():
            writer.add_bytes(name, data, method)
        writer.close()
        return out.getvalue()

    first = write()
    assert first == write()
    assert read_all(first) == blobs
    if method != ZSTD:
        with zipfile.ZipFile(io.BytesIO(first)) as stdlib:
            assert stdlib.testzip() is None
            assert {n: stdlib.read(n) for n in stdlib.namelist()} == blobs


def test_reads_stdlib_zip64_and_data_descriptors() -> None:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_DEFLATED) as z:
        with z.open("big", "w", force_zip64=True) as handle:  # streamed: data descriptor + zip64 extra
            handle.write(b"x" * 100_000)
        z.writestr("small", b"y")
    assert read_all(out.getvalue()) == {"big": b"x" * 100_000, "small": b"y"}


def test_zip64_end_records_written_for_many_entries() -> None:
    out = io.BytesIO()
    writer = ZipWriter(out)
    for i in range(0x10000):
        writer.add_bytes(f"f{i}", b"", STORED)
    writer.close()
    data = out.getvalue()
    assert b"PK\x06\x06" in data[-200:] and b"PK\x06\x07" in data[-200:]
    reader = ZipReader(BytesSource(data), ReadLimits(max_entries=70_000))
    assert len(reader.entries) == 0x10000
    with pytest.raises(ArchiveTooLarge, match="65536 entries is over the limit of 1000"):
        ZipReader(BytesSource(data), ReadLimits(max_entries=1000))


def test_compressed_data_with_zip_signatures_reads() -> None:
    payload = b"PK\x05\x06" + b"\x00" * 18 + b"PK\x01\x02PK\x03\x04"
    data = build([Entry("a", payload * 50, method=STORED), Entry("b", payload, method=ZSTD)], comment=b"PK\x05\x06")
    assert read_all(data) == {"a": payload * 50, "b": payload}


def test_total_size_cap_is_configurable() -> None:
    data = build([Entry("a", b"x" * 1000), Entry("b", b"y" * 1000)])
    with pytest.raises(ArchiveTooLarge, match="2000 bytes in all, over the limit of 1500"):
        ZipReader(BytesSource(data), ReadLimits(max_total_size=1500))
    assert len(read_all(data, ReadLimits(max_total_size=2000))) == 2


def test_ratio_cap_is_configurable() -> None:
    data = build([Entry("zeros", bytes(1 << 20), method=ZSTD)])
    with pytest.raises(ArchiveTooLarge, match="ratio over the limit of 10"):
        ZipReader(BytesSource(data), ReadLimits(ratio_floor=1000, max_ratio=10))
    assert read_all(data) == {"zeros": bytes(1 << 20)}  # under the default 16 MiB floor


def test_declared_size_smaller_than_output_stops_decompression_early() -> None:
    entry = Entry("bomb", bytes(50 << 20), method=ZSTD, usize=10)  # declares 10 bytes, really 50 MiB
    reader = ZipReader(BytesSource(build([entry])), ReadLimits())
    produced = 0
    with pytest.raises(UnsafeArchive, match="more than the 10 bytes"):
        for chunk in reader.iter_entry(reader.entries["bomb"]):
            produced += len(chunk)
    assert produced <= 10


def test_declared_size_larger_than_output() -> None:
    data = build([Entry("a", b"abc", method=DEFLATE, usize=5)])
    with pytest.raises(UnsafeArchive, match="decompresses to 3 bytes but declares 5"):
        read_all(data)


def test_corrupt_compressed_data() -> None:
    data = build([Entry("a", b"abc" * 100, method=ZSTD, payload=b"\x28\xb5\x2f\xfd garbage!")])
    with pytest.raises(FormatError, match="corrupt zstd data"):
        read_all(data)


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        (Entry("a/./b"), "'.' path component"),
        (Entry("a//b"), "'empty' path component"),
        (Entry("C:/x"), "absolute path"),
        (Entry("a\x00b"), "NUL byte"),
        (Entry(b"\xff\xfe", flags=0x800), "not valid UTF-8"),
        (Entry("dir/", b"data"), "directory entry has data"),
        (Entry("fifo", external_attr=0o010644 << 16), "special file"),
        (Entry("win", made_by=0x0A14, external_attr=0x400), "reparse point"),
    ],
)
def test_refused_entries(entry: Entry, message: str) -> None:
    with pytest.raises(UnsafeArchive, match=message):
        ZipReader(BytesSource(build([entry])), ReadLimits())


def test_file_and_directory_clash() -> None:
    with pytest.raises(UnsafeArchive, match="inside 'model', which is a file"):
        ZipReader(BytesSource(build([Entry("model"), Entry("model/x")])), ReadLimits())


def test_trailing_garbage_in_central_directory() -> None:
    with pytest.raises(UnsafeArchive, match="unaccounted trailing bytes"):
        ZipReader(BytesSource(build([Entry("a")], trailing_cd=b"junk")), ReadLimits())


def test_valid_data_descriptor_is_accepted() -> None:
    data = b"payload"
    descriptor = struct.pack("<4sIII", b"PK\x07\x08", zlib.crc32(data), len(data), len(data))
    entry = Entry("a", data, flags=8, local_crc=0, local_csize=0, local_usize=0, descriptor=descriptor)
    assert read_all(build([entry])) == {"a": data}
