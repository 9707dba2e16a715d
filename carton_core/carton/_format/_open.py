"""`open_carton`: the carton's info plus a local ``model/`` folder the runner process reads.

A directory is used in place, after its ``model/`` files are checked against its MANIFEST; a verification stamp in
the cache (per file: inode, size, mtime_ns) makes every later load of the unchanged folder cost one ``stat`` per
file. A .carton file (or URL) is materialized once into the cache, keyed by the model hash: every ``model/`` file is
extracted into a private temporary directory while being hashed, checked against MANIFEST, stamped, and only then
is the directory renamed into place (atomically). A cache entry is reused after comparing every file with its stamp
(one ``stat`` per file); an entry that does not match (tampered, partly deleted) is extracted again and swapped in.

``defer_verification=True`` is what `carton.load` uses: the files are copied without hashing (a kernel copy for
stored entries), published without a stamp, and hashed on a helper thread (`Verification`) while the runner process
loads them. `carton.load` returns or raises only after `Verification.wait`: a mismatch closes the runner, removes
the entry and raises `carton.ManifestError`, so nothing computed from unverified bytes reaches the caller. An entry
without a stamp (a host that died before its verification ended) is never trusted: the next open extracts it again.
"""

from __future__ import annotations

import contextlib
import hashlib
import mmap
import os
import shutil
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .. import _paths
from .._progress import Progress
from ..errors import FormatError, ManifestError, UnsafeArchive
from ._info import CartonInfo
from ._limits import DEFAULT_LIMITS, ReadLimits
from ._reader import CartonReader, DirStore, ZipStore, build_info, open_reader
from ._source import FileSource
from ._stamp import FileStat, file_stat, hash_stable, read_stamp, stamp_matches, write_stamp
from ._writeback import write_all, write_pieces
from ._zipread import METHOD_STORED, ZipEntry

__all__ = [
    "ENTRY_STAMP",
    "WRITE_BEHIND_PIECE",
    "OpenedCarton",
    "Verification",
    "copy_stored",
    "dir_stamp_path",
    "extract_stored",
    "extract_stored_kernel_copy",
    "models_dir",
    "open_carton",
]

_COPY_CHUNK = 8 << 20
#: Buffer of the one-pass stored extraction: 1 MiB measured fastest (stays in cache between read, hash and write).
_ONE_PASS_CHUNK = 1 << 20
#: Pieces compressed entries are decoded in when another thread writes them: 256-512 KiB measured fastest for
#: 1 GiB of zstd; 64 KiB pays more queue hand-offs, 1 MiB leaves the cache (docs/performance.md, "Package format").
WRITE_BEHIND_PIECE = 256 << 10
#: The stamp of a materialized cache entry, next to its model/ folder.
ENTRY_STAMP = "stamp.json"


class Verification:
    """The MANIFEST check of a model folder, running on a helper thread while a runner process reads the folder.

    `wait` returns once every file matched (and the stamp is written) or raises what the check raised, typically
    `carton.ManifestError` naming the file; by then a bad cache entry has been removed. hashlib releases the GIL,
    so the hashing runs on the other core while the host waits for the runner.
    """

    def __init__(self, check: Callable[[], None]) -> None:
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(check,), name="carton-verify", daemon=True)
        self._thread.start()

    def _run(self, check: Callable[[], None]) -> None:
        try:
            check()
        except BaseException as exc:  # handed to wait(), on the caller's thread
            self._error = exc

    def wait(self) -> None:
        self._thread.join()
        if self._error is not None:
            raise self._error


@dataclass(frozen=True, slots=True, kw_only=True)
class OpenedCarton:
    """A carton ready to load: ``model_dir`` is a local folder holding exactly the ``model/`` files.

    ``cached`` is True when no model byte was read: ``model_dir`` is a cache entry that already existed, or an
    unpacked folder whose verification stamp matched. ``verification`` is None when every file was verified
    before `open_carton` returned; with ``defer_verification=True`` it may be a `Verification` still running,
    which the caller must `wait` for before it trusts anything read from ``model_dir``.
    """

    info: CartonInfo
    model_dir: Path
    cached: bool = False
    verification: Verification | None = None


def models_dir(cache_dir: Path) -> Path:
    return cache_dir / "models"


def dir_stamp_path(cache_dir: Path, root: Path) -> Path:
    """Where the verification stamp of the unpacked carton folder ``root`` (resolved) lives."""
    return cache_dir / "verified" / f"{hashlib.sha256(os.fsencode(root)).hexdigest()}.json"


def open_carton(
    path_or_url: str | os.PathLike[str],
    *,
    limits: ReadLimits | None = None,
    cache_dir: Path | None = None,
    defer_verification: bool = False,
    on_info: Callable[[CartonInfo], None] | None = None,
) -> OpenedCarton:
    """Open a .carton file, an unpacked carton directory or an http(s) URL for loading.

    Raises a `carton.FormatError` subclass naming the file at fault; on failure nothing is left in the cache.
    With ``defer_verification`` the model files' hashes may still be being checked when this returns
    (`OpenedCarton.verification`; see the module docstring). ``on_info`` is called with the carton's info as soon
    as carton.toml is read, before any model byte is: `carton.load` starts the runner from there, so carton.toml
    is read once per load.
    """
    limits = limits or DEFAULT_LIMITS
    cache = cache_dir or _paths.cache_dir()
    with open_reader(path_or_url, limits, cache) as reader:
        info = build_info(reader)
        if on_info is not None:
            on_info(info)
        model_paths = sorted(p for p in reader.manifest if p.startswith("model/"))
        if isinstance(reader.store, DirStore) and all(p in reader.present for p in model_paths):
            model_dir = reader.store.root / "model"
            if not model_dir.is_dir():
                raise FormatError(f"{reader.location}: has no model/ folder")
            check = _folder_check(reader, reader.store, model_paths, cache)
            if check is None:
                return OpenedCarton(info=info, model_dir=model_dir, cached=True)
            if defer_verification:
                return OpenedCarton(info=info, model_dir=model_dir, verification=Verification(check))
            check()
            return OpenedCarton(info=info, model_dir=model_dir)
        final = models_dir(cache) / reader.model_hash
        replace = (final / "model").is_dir()
        if replace and _entry_intact(final, model_paths, reader.model_hash):
            return OpenedCarton(info=info, model_dir=final / "model", cached=True)
        # Missing, or tampered with / partly deleted (replace): extract (again) and swap the fresh entry in.
        if defer_verification:
            check = _materialize_unverified(reader, model_paths, final, replace=replace)
            return OpenedCarton(info=info, model_dir=final / "model", verification=Verification(check))
        _materialize(reader, model_paths, final, replace=replace)
        return OpenedCarton(info=info, model_dir=final / "model")


def _folder_check(
    reader: CartonReader, store: DirStore, model_paths: list[str], cache: Path
) -> Callable[[], None] | None:
    """None when an unpacked folder's stamp shows its ``model/`` files unchanged (no byte is read), else the check
    that hashes them against MANIFEST and writes the stamp.

    Symlinks were already checked by `DirStore` (they must stay inside the folder); the stamp records the stat of
    the file a symlink leads to. The check uses nothing of ``reader`` but plain values: it may run after the
    reader is closed.
    """
    key = {"model_hash": reader.model_hash, "root": str(store.root)}
    stamp_path = dir_stamp_path(cache, store.root)
    current = {p: file_stat(store.root / p) for p in model_paths}
    if stamp_matches(read_stamp(stamp_path), key=key, files=current):
        return None
    location, root = reader.location, store.root
    expected = {p: reader.manifest[p] for p in model_paths}

    def check() -> None:
        verified: list[tuple[str, FileStat]] = []
        total = sum(s[1] for s in current.values())
        with Progress(f"verifying {location}", total=total) as bar:
            for path in model_paths:
                digest, stat_now = hash_stable(root / path, f"{location}: {path}")
                if digest != expected[path]:
                    raise ManifestError(f"{location}: {path} has sha256 {digest} but MANIFEST says {expected[path]}")
                verified.append((path, stat_now))
                bar.advance(stat_now[1])
        write_stamp(stamp_path, key=key, files=verified)

    return check


def _entry_files(model_dir: Path) -> dict[str, FileStat] | None:
    """``{"model/...": stat}`` of every file in a cache entry's model/ folder (symlinks not followed), or None if
    anything in it is not a plain file or directory."""
    found: dict[str, FileStat] = {}
    for directory, _dirs, names in os.walk(model_dir):
        for name in names:
            path = Path(directory) / name
            try:
                found[f"model/{path.relative_to(model_dir).as_posix()}"] = file_stat(path, follow=False)
            except FormatError:
                return None
    return found


def _entry_intact(final: Path, model_paths: list[str], model_hash: str) -> bool:
    """True when the cache entry holds exactly the files its stamp recorded, unchanged (one stat per file)."""
    files = _entry_files(final / "model")
    if files is None or sorted(files) != model_paths:
        return False
    return stamp_matches(read_stamp(final / ENTRY_STAMP), key={"model_hash": model_hash}, files=files, racy=False)


def _materialize(reader: CartonReader, model_paths: list[str], final: Path, *, replace: bool = False) -> None:
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
                    _link_verified_blob(reader, path, destination)
                    continue
                digest = _extract(reader, path, destination, bar)
                if digest != reader.manifest[path]:
                    raise ManifestError(
                        f"{reader.location}: {path} has sha256 {digest} but MANIFEST says {reader.manifest[path]}"
                    )
                destination.chmod(0o444)
        files = _entry_files(temp / "model")
        if files is None:
            raise UnsafeArchive(f"{temp}: extracted entry holds something other than plain files")
        write_stamp(temp / ENTRY_STAMP, key={"model_hash": reader.model_hash}, files=files.items())
        if replace:
            _swap_in(temp, final)
            return
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


def _materialize_unverified(
    reader: CartonReader, model_paths: list[str], final: Path, *, replace: bool = False
) -> Callable[[], None]:
    """Copy the ``model/`` files into the cache entry ``final`` without hashing them and publish it without a
    stamp; returns the check that hashes the published files, then stamps the entry (or removes it on a mismatch).

    The check hashes the very files a runner reads (in a directory only we write), so the bytes verified are the
    bytes loaded. LINKS blobs are verified before this returns (they come from a shared cache).
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    temp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name[:16]}-", suffix=".partial"))
    pending: list[str] = []
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
                    _link_verified_blob(reader, path, destination)
                    continue
                _copy_out(reader, path, destination, bar)
                destination.chmod(0o444)
                pending.append(path)
        if _entry_files(temp / "model") is None:
            raise UnsafeArchive(f"{temp}: extracted entry holds something other than plain files")
        _publish(temp, final, replace=replace)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    location, model_hash = reader.location, reader.model_hash
    expected = {p: reader.manifest[p] for p in pending}

    def check() -> None:
        try:
            for path in pending:
                digest, _stat = hash_stable(final / path, f"{location}: {path}")
                if digest != expected[path]:
                    raise ManifestError(
                        f"{location}: {path} has sha256 {digest} but MANIFEST says {expected[path]}"
                    )
            files = _entry_files(final / "model")
            if files is None or sorted(files) != model_paths:
                raise UnsafeArchive(f"{location}: its cache entry changed while it was being verified")
            write_stamp(final / ENTRY_STAMP, key={"model_hash": model_hash}, files=files.items())
        except BaseException:
            if read_stamp(final / ENTRY_STAMP) is None:  # not an entry another process verified meanwhile
                _remove_entry(final)
            raise

    return check


def _publish(temp: Path, final: Path, *, replace: bool) -> None:
    if replace:
        _swap_in(temp, final)
        return
    try:
        temp.rename(final)
    except OSError:
        # Another process published the same model first: take its entry out of the way and publish ours, whose
        # bytes are the ones about to be verified (theirs may still be unverified and may be removed).
        if not (final / "model").is_dir():
            raise
        _swap_in(temp, final)


def _remove_entry(final: Path) -> None:
    stale = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name[:16]}-", suffix=".stale"))
    with contextlib.suppress(FileNotFoundError):
        final.rename(stale / "entry")
    shutil.rmtree(stale, ignore_errors=True)


def _swap_in(temp: Path, final: Path) -> None:
    """Replace a damaged cache entry by a fresh one: the old one is renamed aside, then removed."""
    stale = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name[:16]}-", suffix=".stale"))
    with contextlib.suppress(FileNotFoundError):  # another process already moved it aside
        final.rename(stale / "entry")
    try:
        temp.rename(final)
    except OSError:
        if not (final / "model").is_dir():
            raise
        shutil.rmtree(temp, ignore_errors=True)  # another process swapped in its fresh entry first
    shutil.rmtree(stale, ignore_errors=True)


def _link_verified_blob(reader: CartonReader, path: str, destination: Path) -> None:
    """Link (or copy) a LINKS blob from the cache into the entry, after hashing it: a cached blob may have been
    changed since it was downloaded. A bad blob is removed from the cache and downloaded once more."""
    for attempt in range(2):
        blob = reader.linked_blob(path)
        _link_or_copy(blob, destination)
        digest, _stat = hash_stable(destination, f"{reader.location}: {path}")
        if digest == reader.manifest[path]:
            return
        destination.unlink()
        blob.unlink(missing_ok=True)
        if attempt:
            raise ManifestError(
                f"{reader.location}: {path} from LINKS has sha256 {digest} but MANIFEST says {reader.manifest[path]}"
            )


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
            return extract_stored(store, entry, destination, bar)
    fd = os.open(destination, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600)
    try:
        pieces = store.iter_file(path, WRITE_BEHIND_PIECE)
        write_pieces(fd, pieces, size=store.size(path), hasher=hasher, advance=bar.advance)
    finally:
        os.close(fd)
    return hasher.hexdigest()


def extract_stored(store: ZipStore, entry: ZipEntry, destination: Path, bar: Progress | None = None) -> str:
    """A stored entry of a local file, in one pass: ``preadv`` into a reused buffer, hash it, write it.

    The hash is computed over the very buffer that is written, so the bytes checked against MANIFEST are exactly
    the bytes the runner reads (the copy sits in a private directory nobody else writes to). Measured faster than
    a kernel copy (``copy_file_range``) followed by a SHA-256 over an mmap of the copy, which reads every byte twice
    (bench/bench_format.py; docs/performance.md).
    """
    offset, length = store.zip.data_span(entry)
    hasher = hashlib.sha256()
    fd = os.open(destination, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600)
    try:
        for chunk in store.source.iter_range_reusing(offset, length, _ONE_PASS_CHUNK):
            hasher.update(chunk)
            write_all(fd, chunk)
            if bar is not None:
                bar.advance(len(chunk))
    except FormatError as exc:
        raise FormatError(f"{store.name}: {entry.name} ends early (file truncated while reading?)") from exc
    finally:
        os.close(fd)
    return hasher.hexdigest()


def _copy_out(reader: CartonReader, path: str, destination: Path, bar: Progress) -> None:
    """Write one file of the carton to ``destination`` without hashing it (`_materialize_unverified`)."""
    store = reader.store
    if isinstance(store, ZipStore) and isinstance(store.source, FileSource):
        entry = store.entry(path)
        if entry.method == METHOD_STORED:
            copy_stored(store, entry, destination, bar)
            return
    fd = os.open(destination, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600)
    try:
        write_pieces(fd, store.iter_file(path, WRITE_BEHIND_PIECE), size=store.size(path), advance=bar.advance)
    finally:
        os.close(fd)


def extract_stored_kernel_copy(
    store: ZipStore, entry: ZipEntry, destination: Path, bar: Progress | None = None
) -> str:
    """The previous design, kept for bench/bench_format.py: ``copy_file_range`` in the kernel, then one SHA-256
    over an mmap of the copy (two passes over the bytes)."""
    length = copy_stored(store, entry, destination, bar)
    if length == 0:
        return hashlib.sha256(b"").hexdigest()
    fd = os.open(destination, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        with mmap.mmap(fd, length, access=mmap.ACCESS_READ) as mapped:
            return hashlib.sha256(mapped).hexdigest()
    finally:
        os.close(fd)


def copy_stored(store: ZipStore, entry: ZipEntry, destination: Path, bar: Progress | None = None) -> int:
    """A stored entry of a local file copied by the kernel (``copy_file_range``; no byte passes through Python);
    returns its length. Nothing is hashed: `_materialize_unverified` hashes the copy afterwards."""
    offset, length = store.zip.data_span(entry)
    source_fd = store.source.fileno() if isinstance(store.source, FileSource) else -1
    fd = os.open(destination, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600)
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
            if bar is not None:
                bar.advance(n)
    finally:
        os.close(fd)
    return length
