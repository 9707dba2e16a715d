"""Extraction of compressed entries with the write (and hash) on a helper thread: same bytes, clean failures."""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import carton
import pytest
from carton._format import open_carton
from carton._format._open import models_dir
from carton._format._reader import open_reader
from carton._format._writeback import INLINE_BELOW, write_pieces
from carton.errors import FormatError

WRITER = "carton-extract-writer"


def writer_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == WRITER]


class RecordingHasher:
    """A sha256 that notes which thread fed it, to tell the threaded path from the inline one."""

    def __init__(self) -> None:
        self.inner = hashlib.sha256()
        self.threads: set[str] = set()

    def update(self, data: bytes, /) -> None:
        self.threads.add(threading.current_thread().name)
        self.inner.update(data)


def pieces(count: int, size: int = 64 << 10) -> list[bytes]:
    return [os.urandom(size) for _ in range(count)]


@pytest.mark.parametrize("total_pieces", [3, INLINE_BELOW // (64 << 10) + 8])
def test_written_bytes_and_hash_are_the_pieces_in_order(tmp_path: Path, total_pieces: int) -> None:
    data = pieces(total_pieces)
    size = sum(map(len, data))
    hasher, advanced = RecordingHasher(), []
    fd = os.open(tmp_path / "out", os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        write_pieces(fd, iter(data), size=size, hasher=hasher, advance=advanced.append)
    finally:
        os.close(fd)
    assert (tmp_path / "out").read_bytes() == b"".join(data)
    assert hasher.inner.hexdigest() == hashlib.sha256(b"".join(data)).hexdigest()
    assert sum(advanced) == size
    threaded = size >= INLINE_BELOW
    assert hasher.threads == ({WRITER} if threaded else {threading.current_thread().name})
    assert not writer_threads()


def test_an_error_while_decoding_stops_the_writer(tmp_path: Path) -> None:
    def failing() -> Iterator[bytes]:
        yield from pieces(8)
        raise ValueError("corrupt input at piece 8")

    fd = os.open(tmp_path / "out", os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        with pytest.raises(ValueError, match="piece 8"):
            write_pieces(fd, failing(), size=INLINE_BELOW * 4)
    finally:
        os.close(fd)
    assert not writer_threads()
    assert (tmp_path / "out").stat().st_size == 8 * (64 << 10)  # what came before the error, in order


def test_an_error_while_writing_stops_decoding() -> None:
    produced = 0

    def counting() -> Iterator[bytes]:
        nonlocal produced
        for piece in pieces(4000, 16 << 10):
            produced += 1
            yield piece

    read_end, write_end = os.pipe()
    os.close(read_end)  # every write fails with EPIPE, as a full disk fails with ENOSPC
    try:
        with pytest.raises(BrokenPipeError):
            write_pieces(write_end, counting(), size=INLINE_BELOW * 16)
    finally:
        os.close(write_end)
    assert not writer_threads()
    assert produced < 100  # stopped at once, not after decoding the whole entry


def _pack(tmp_path: Path, compression: str, model: bytes) -> Path:
    source = tmp_path / f"src-{compression}"
    source.mkdir()
    (source / "weights.bin").write_bytes(model)
    (source / "small.txt").write_text("small file, written inline")
    return carton.pack(source, tmp_path / f"{compression}.carton", runner_name="onnxruntime",
                       required_framework_version="*", runner_compat_version=1, compression=compression,
                       validate=False)  # fmt: skip


def _model_bytes() -> bytes:
    # Compressible and incompressible stretches: zstd emits both compressed and raw blocks.
    return b"".join(os.urandom(1 << 20) + bytes(range(256)) * 4096 for _ in range(5))


@pytest.mark.parametrize("compression", ["zstd", "deflate"])
@pytest.mark.parametrize("deferred", [False, True])
def test_large_compressed_entries_extract_exactly(
    tmp_path: Path, cache: Path, compression: str, deferred: bool
) -> None:
    model = _model_bytes()
    assert len(model) > INLINE_BELOW
    opened = open_carton(_pack(tmp_path, compression, model), defer_verification=deferred)
    if opened.verification is not None:
        opened.verification.wait()
    assert (opened.model_dir / "weights.bin").read_bytes() == model
    assert (opened.model_dir / "small.txt").read_text() == "small file, written inline"
    assert not writer_threads()


@pytest.mark.parametrize("deferred", [False, True])
def test_a_corrupt_large_zstd_entry_leaves_nothing(tmp_path: Path, cache: Path, deferred: bool) -> None:
    path = _pack(tmp_path, "zstd", _model_bytes())
    with open_reader(path, carton.ReadLimits(), cache) as reader:
        offset, length = reader.store.zip.data_span(reader.store.entry("model/weights.bin"))  # type: ignore[attr-defined]
    data = bytearray(path.read_bytes())
    middle = offset + length // 2
    data[middle : middle + 64] = bytes(64)
    path.write_bytes(bytes(data))
    with pytest.raises(FormatError, match=r"model/weights\.bin"):
        opened = open_carton(path, defer_verification=deferred)
        assert opened.verification is not None
        opened.verification.wait()
    assert not writer_threads()
    entries = models_dir(cache)
    assert not entries.exists() or not any(entries.iterdir())
