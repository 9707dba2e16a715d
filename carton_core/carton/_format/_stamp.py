"""Verification stamps: what lets a verified folder be reused at the cost of one ``stat`` per file.

A stamp records, for each file of a folder whose bytes were checked against MANIFEST, its inode, size and
``st_mtime_ns`` at the time of the check. A later load compares fresh ``stat`` results with the stamp: any
difference (a file rewritten, truncated, replaced, deleted or added) means the folder is checked again.

What a stamp cannot see: a rewrite that keeps the inode, the size and the modification time (setting the mtime
back with ``touch -d`` / ``os.utime`` after changing the bytes). Only someone who can already write the folder
(the user themself or root) can do that, and such a person could equally change the bytes after the check and
before the runner reads them, so this is outside the threat model (docs/format.md, "Verification stamps").

Racy files: a file modified within `RACY_NS` before the stamp was written might be modified again within the
same timestamp tick, so such files are not trusted from the stamp (the same rule as git's index): they are
hashed again on the next load, after which their mtime is old enough.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import tempfile
import time
from collections.abc import Iterable, Mapping
from pathlib import Path

from ..errors import FormatError, ManifestError, UnsafeArchive

__all__ = ["RACY_NS", "FileStat", "file_stat", "hash_stable", "read_stamp", "stamp_matches", "write_stamp"]

#: (inode, size, mtime_ns) of a file.
FileStat = tuple[int, int, int]
#: Files modified this close to the stamp's creation are re-hashed on the next load (coarse-mtime filesystems).
RACY_NS = 2_000_000_000
_STAMP_VERSION = 1
_CHUNK = 1 << 20


def file_stat(path: Path, *, follow: bool = True) -> FileStat:
    """The stamp fields of ``path``; `UnsafeArchive` if it is not a regular file."""
    try:
        st = path.stat() if follow else path.lstat()
    except OSError as exc:
        raise FormatError(f"{path}: cannot stat: {exc.strerror}") from exc
    if not stat.S_ISREG(st.st_mode):
        raise UnsafeArchive(f"{path}: not a regular file")
    return (st.st_ino, st.st_size, st.st_mtime_ns)


def hash_stable(path: Path, where: str) -> tuple[str, FileStat]:
    """The sha256 of ``path`` and its stat, refusing a file that changes while it is read."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        before = os.fstat(fd)
        if not stat.S_ISREG(before.st_mode):
            raise UnsafeArchive(f"{path}: not a regular file")
        hasher = hashlib.sha256()
        buffer = bytearray(_CHUNK)
        view = memoryview(buffer)
        while n := os.readv(fd, [buffer]):
            hasher.update(view[:n])
        after = os.fstat(fd)
    finally:
        os.close(fd)
    first = (before.st_ino, before.st_size, before.st_mtime_ns)
    if first != (after.st_ino, after.st_size, after.st_mtime_ns):
        raise ManifestError(f"{where}: changed while it was being verified")
    return hasher.hexdigest(), first


def read_stamp(path: Path) -> dict[str, object] | None:
    """The stamp at ``path``, or None when it is missing or unreadable (which just means: verify again)."""
    try:
        data = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("version") == _STAMP_VERSION else None


def stamp_matches(
    stamp: Mapping[str, object] | None, *, key: Mapping[str, str], files: Mapping[str, FileStat], racy: bool = True
) -> bool:
    """True when ``stamp`` was written for ``key`` (model hash, folder) and records exactly ``files``.

    ``racy``: distrust files modified within `RACY_NS` before the stamp was written (folders the user edits; a
    cache entry's files are written by us before its stamp and then never again, so it passes False).
    """
    if stamp is None or any(stamp.get(k) != v for k, v in key.items()):
        return False
    recorded = stamp.get("files")
    written = stamp.get("written_ns")
    if not isinstance(recorded, dict) or not isinstance(written, int) or recorded.keys() != files.keys():
        return False
    for path, current in files.items():
        if recorded[path] != list(current) or (racy and current[2] + RACY_NS >= written):
            return False
    return True


def write_stamp(path: Path, *, key: Mapping[str, str], files: Iterable[tuple[str, FileStat]]) -> None:
    """Write a stamp atomically (temp file + rename): a reader sees the old stamp, the new one, or none."""
    payload = {"version": _STAMP_VERSION, **key, "written_ns": time.time_ns(),
               "files": {p: list(s) for p, s in sorted(files)}}  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".partial")
    temp = Path(temp_name)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            json.dump(payload, handle, separators=(",", ":"))
        temp.replace(path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
