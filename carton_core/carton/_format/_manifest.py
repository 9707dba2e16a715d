"""MANIFEST: one ``path=sha256`` line per file, sorted; its own sha256 is the model hash.

The reader accepts what the original Carton writers produced (any line order, lowercase hex) and refuses anything
ambiguous: duplicate paths, unsafe paths, MANIFEST or LINKS listing themselves, malformed lines.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping

from ..errors import ManifestError, UnsafeArchive
from ._zipread import normalize_name

__all__ = ["UNLISTED", "manifest_hash", "parse_manifest", "serialize_manifest"]

#: Files a MANIFEST never lists.
UNLISTED = frozenset({"MANIFEST", "LINKS"})
_SHA256 = re.compile(r"[0-9a-f]{64}")


def parse_manifest(data: bytes, where: str) -> dict[str, str]:
    """``{path: sha256}`` from MANIFEST bytes; ``where`` names the carton in errors."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ManifestError(f"{where}: MANIFEST is not valid UTF-8 (byte {exc.start})") from exc
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    entries: dict[str, str] = {}
    for number, line in enumerate(lines, start=1):
        path, sep, digest = line.rpartition("=")
        if not sep or not path:
            raise ManifestError(f"{where}: MANIFEST line {number} is not of the form path=sha256: {line[:80]!r}")
        if not _SHA256.fullmatch(digest):
            raise ManifestError(f"{where}: MANIFEST line {number} ({path}): {digest[:80]!r} is not a lowercase sha256")
        try:
            normalized = normalize_name(path.encode("utf-8"), 0x800, f"{where}: MANIFEST line {number}")
        except UnsafeArchive as exc:
            raise ManifestError(str(exc)) from exc
        if normalized != path or path.endswith("/"):
            raise ManifestError(f"{where}: MANIFEST line {number}: {path!r} is not a plain relative file path")
        if path in UNLISTED:
            raise ManifestError(f"{where}: MANIFEST lists {path}, which it must never list")
        if path in entries:
            raise ManifestError(f"{where}: MANIFEST lists {path} twice")
        entries[path] = digest
    return entries


def serialize_manifest(entries: Mapping[str, str]) -> bytes:
    """MANIFEST bytes: lines sorted by path (UTF-8 byte order, as the original's BTreeMap), each ending in \\n."""
    ordered = sorted(entries.items(), key=lambda item: item[0].encode("utf-8"))
    return "".join(f"{path}={digest}\n" for path, digest in ordered).encode("utf-8")


def manifest_hash(data: bytes) -> str:
    """The model hash: the sha256 of the MANIFEST bytes."""
    return hashlib.sha256(data).hexdigest()
