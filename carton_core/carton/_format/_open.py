"""`open_carton`: the carton's info plus a local ``model/`` folder the runner process reads.

A directory is used in place. A .carton file (or URL) is materialized once into the cache, keyed by the model hash:
every ``model/`` file is extracted into a private temporary directory while being hashed, checked against
MANIFEST, and only then is the directory renamed into place (atomically). A finished cache entry is trusted by its
name and reused without touching the zip again, so every load after the first costs one directory lookup.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .. import _paths
from .._progress import Progress
from ..errors import FormatError, ManifestError
from ._info import CartonInfo
from ._limits import DEFAULT_LIMITS, ReadLimits
from ._reader import CartonReader, DirStore, ZipStore, build_info, open_reader
from ._source import FileSource
from ._zipread import METHOD_STORED, ZipEntry

__all__ = ["OpenedCarton", "open_carton"]

_COPY_CHUNK = 8 << 20


@dataclass(frozen=True, slots=True, kw_only=True)
class OpenedCarton:
    """A carton ready to load: ``model_dir`` is a local folder holding exactly the verified ``model/`` files.

    ``cached`` is True when ``model_dir`` is a cache entry that already existed (nothing was extracted).
    """

    info: CartonInfo
    model_dir: Path
    cached: bool = False


def models_dir(cache_dir: Path) -> Path:
    return cache_dir / "models"


def open_carton(
    path_or_url: str | os.PathLike[str], *, limits: ReadLimits | None = None, cache_dir: Path | None = None
) -> OpenedCarton:
    """Open a .carton file, an unpacked carton directory or an http(s) URL for loading.

    Raises a `carton.FormatError` subclass naming the file at fault; on failure nothing is left in the cache.
    """
    limits = limits or DEFAULT_LIMITS
    cache = cache_dir or _paths.cache_dir()
    with open_reader(path_or_url, limits, cache) as reader:
        info = build_info(reader)
        model_paths = sorted(p for p in reader.manifest if p.startswith("model/"))
        if isinstance(reader.store, DirStore) and all(p in reader.present for p in model_paths):
            model_dir = reader.store.root / "model"
            if not model_dir.is_dir():
                raise FormatError(f"{reader.location}: has no model/ folder")
            return OpenedCarton(info=info, model_dir=model_dir)
        final = models_dir(cache) / reader.model_hash
        if (final / "model").is_dir():
            return OpenedCarton(info=info, model_dir=final / "model", cached=True)
        _materialize(reader, model_paths, final)
        return OpenedCarton(info=info, model_dir=final / "model")


def _materialize(reader: CartonReader, model_paths: list[str], final: Path) -> None:
    final.parent.mkdir(parents=True, exist_ok=True)
    temp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name[:16]}-", suffix=".partial"))
    try:
        (temp / "model").mkdir()
        if isinstance(reader.store, ZipStore):
            for directory in sorted(reader.store.zip.directories):
                if directory.startswith("model/"):
                    (temp / directory).mkdir(parents=True, exist_ok=True)
        total = sum(reader.store.size(p) for p in model_paths if p in reader.present)
        with Progress(f"extracting {reader.location}", total=total) as bar:
            for path in model_paths:
                destination = temp / path
                destination.parent.mkdir(parents=True, exist_ok=True)
                if path not in reader.present:
                    _link_or_copy(reader.linked_blob(path), destination)
                    continue
                digest = _extract(reader, path, destination, bar)
                if digest != reader.manifest[path]:
                    raise ManifestError(
                        f"{reader.location}: {path} has sha256 {digest} but MANIFEST says {reader.manifest[path]}"
                    )
                destination.chmod(0o444)
        try:
            temp.rename(final)
        except OSError:
            # Another process finished the same model first; its entry holds the same verified bytes.
            if not (final / "model").is_dir():
                raise
            shutil.rmtree(temp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise


def _link_or_copy(blob: Path, destination: Path) -> None:
    try:
        os.link(blob, destination)
    except OSError:
        shutil.copyfile(blob, destination)
        destination.chmod(0o444)


def _extract(reader: CartonReader, path: str, destination: Path, bar: Progress) -> str:
    """Write one file of the carton to ``destination``; returns the sha256 of exactly the bytes written."""
    store = reader.store
    hasher = hashlib.sha256()
    if isinstance(store, ZipStore) and isinstance(store.source, FileSource):
        entry = store.entry(path)
        if entry.method == METHOD_STORED:
            return _extract_stored(store, entry, destination, bar)
    fd = os.open(destination, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600)
    try:
        for chunk in store.iter_file(path):
            hasher.update(chunk)
            view = memoryview(chunk)
            while view:
                view = view[os.write(fd, view) :]
            bar.advance(len(chunk))
    finally:
        os.close(fd)
    return hasher.hexdigest()


def _extract_stored(store: ZipStore, entry: ZipEntry, destination: Path, bar: Progress) -> str:
    """A stored entry of a local file: copied in the kernel (``copy_file_range``), then hashed from the copy.

    Hashing the destination, not the source, is what makes the check hold for exactly the bytes the runner will
    read: the copy sits in a private directory nobody else writes to, while the source could change underneath.
    The copy is hashed through one mmap after the copy (measured faster than reading it back chunk by chunk).
    """
    offset, length = store.zip.data_span(entry)
    source_fd = store.source.fileno() if isinstance(store.source, FileSource) else -1
    fd = os.open(destination, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600)
    try:
        copied = 0
        while copied < length:
            want = min(_COPY_CHUNK, length - copied)
            try:
                n = os.copy_file_range(source_fd, fd, want, offset + copied)
            except OSError:
                n = os.write(fd, os.pread(source_fd, want, offset + copied))
            if n <= 0:
                raise FormatError(f"{store.name}: {entry.name} ends early (file truncated while reading?)")
            copied += n
            bar.advance(n)
        if os.fstat(fd).st_size != length:
            raise FormatError(f"{destination}: extracted copy has the wrong size")
        if length == 0:
            return hashlib.sha256(b"").hexdigest()
        with mmap.mmap(fd, length, access=mmap.ACCESS_READ) as view:
            return hashlib.sha256(view).hexdigest()
    finally:
        os.close(fd)
