"""LINKS (version 1): files left out of the zip, fetched by sha256 from a list of URLs, cached by content.

A download is decoded (zstd, br, gzip, deflate), hashed and written to a temporary file in the cache in one pass,
and renamed to ``<cache>/blobs/sha256/<hash>`` only when the hash matches: a failed or wrong download leaves
nothing behind. A cached blob is trusted by name because only a verified download is ever renamed there.
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

import httpx
import tomli_w

from .._progress import Progress
from ..errors import LinkError
from ._config import parse_toml
from ._http import ACCEPT_ENCODING, DecodeError, decode_stream, describe_http_error, make_client
from ._limits import ReadLimits

__all__ = ["blob_path", "fetch_blob", "parse_links", "serialize_links"]

_SHA256 = re.compile(r"[0-9a-f]{64}")
_CHUNK = 1 << 20


def parse_links(data: bytes, where: str, max_depth: int) -> dict[str, tuple[str, ...]]:
    """``{sha256: urls}`` from LINKS bytes."""
    doc = parse_toml(data, f"{where}: LINKS", LinkError, max_depth)
    version = doc.get("version")
    if version != 1 or isinstance(version, bool):
        raise LinkError(f"{where}: LINKS version {version!r} is not supported (this reader knows version 1)")
    urls = doc.get("urls", {})
    if not isinstance(urls, dict):
        raise LinkError(f"{where}: LINKS urls must be a table")
    out: dict[str, tuple[str, ...]] = {}
    for digest, targets in urls.items():
        if not _SHA256.fullmatch(digest):
            raise LinkError(f"{where}: LINKS key {digest[:80]!r} is not a lowercase sha256")
        if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
            raise LinkError(f"{where}: LINKS urls.{digest} must be an array of URL strings")
        for url in targets:
            if not url.startswith(("http://", "https://")):
                raise LinkError(f"{where}: LINKS urls.{digest}: {url!r} is not an http(s) URL")
        out[digest] = tuple(targets)
    return out


def serialize_links(urls: Mapping[str, Sequence[str]]) -> bytes:
    return tomli_w.dumps({"version": 1, "urls": {k: list(urls[k]) for k in sorted(urls)}}).encode("utf-8")


def blob_path(cache: Path, sha256: str) -> Path:
    return cache / "blobs" / "sha256" / sha256


def fetch_blob(sha256: str, urls: Sequence[str], cache: Path, limits: ReadLimits, *, label: str) -> Path:
    """The cached file with this sha256, downloading it from the first URL that serves the right bytes.

    ``label`` (the file's path in the carton) is used in progress output and errors. Raises `LinkError` listing
    every URL's failure when none works.
    """
    target = blob_path(cache, sha256)
    if target.is_file():
        return target
    if not urls:
        raise LinkError(f"{label}: missing from the zip and LINKS has no URL for sha256 {sha256}")
    target.parent.mkdir(parents=True, exist_ok=True)
    failures: list[str] = []
    with make_client(limits.http_timeout) as client:
        for url in urls:
            reason = _download(client, url, sha256, target, limits, label)
            if reason is None:
                return target
            failures.append(f"{url}: {reason}")
    raise LinkError(f"{label} (sha256 {sha256}) could not be fetched: " + "; ".join(failures))


def _download(client: httpx.Client, url: str, sha256: str, target: Path, limits: ReadLimits, label: str) -> str | None:
    """Download into the cache; returns None on success or the reason it failed (nothing is kept then)."""
    fd, temp_name = tempfile.mkstemp(dir=target.parent, prefix=f".{sha256[:16]}-", suffix=".part")
    temp = Path(temp_name)
    try:
        hasher = hashlib.sha256()
        with os.fdopen(fd, "wb") as out, client.stream("GET", url, headers={"Accept-Encoding": ACCEPT_ENCODING}) as r:
            r.raise_for_status()
            total = r.headers.get("content-length")
            encoding = r.headers.get("content-encoding")
            with Progress(f"fetching {label}", total=int(total) if total and not encoding else None) as bar:
                for chunk in decode_stream(r.iter_raw(_CHUNK), encoding, max_bytes=limits.max_total_size):
                    hasher.update(chunk)
                    out.write(chunk)
                    bar.advance(len(chunk))
        if hasher.hexdigest() != sha256:
            return f"served bytes with sha256 {hasher.hexdigest()}, expected {sha256}"
        temp.chmod(0o444)
        temp.replace(target)
        return None
    except httpx.HTTPError as exc:
        return describe_http_error(exc)
    except DecodeError as exc:
        return str(exc)
    finally:
        temp.unlink(missing_ok=True)
