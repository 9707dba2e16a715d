"""The repository on disk: model names, version folders, ``file:`` uploads, and keeping paths out of messages.

Layout (like Triton's)::

    REPO/<model>/config.json            optional serving config (see `carton.server._config`)
    REPO/<model>/<version>/model.carton a packed carton, or an unpacked carton folder of that name
    REPO/<model>/<version>/carton.toml  ... or the version folder itself is an unpacked carton
    REPO/<model>.carton                 shorthand for version 1 of <model>
"""

from __future__ import annotations

import os
import re
import shutil
import uuid
from collections.abc import Iterable, Mapping
from pathlib import Path

from ..errors import BadRequest, RepositoryError

__all__ = ["Scrubber", "list_models", "scan_versions", "validate_model_name", "write_upload"]

_MAX_NAME = 255
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_FILE_KEY = re.compile(r"^file:([1-9][0-9]{0,17})/(.+)$", re.DOTALL)


def validate_model_name(name: str) -> str:
    """Return `name` if it can name a model folder; `BadRequest` saying why not (``..``, slashes, NUL, ...)."""
    if not name:
        raise BadRequest("model name is empty")
    if len(name) > _MAX_NAME:
        raise BadRequest(f"model name is {len(name)} characters long; the limit is {_MAX_NAME}")
    if "/" in name or "\\" in name:
        raise BadRequest(f"model name {name!r} contains a path separator")
    if _CONTROL.search(name):
        raise BadRequest(f"model name {name!r} contains a NUL or control character")
    if name.startswith("."):
        raise BadRequest(f"model name {name!r} starts with '.'")
    return name


def _version_path(folder: Path) -> Path | None:
    packed = folder / "model.carton"
    if packed.exists():
        return packed
    if (folder / "carton.toml").is_file():
        return folder
    return None


def scan_versions(root: Path, name: str) -> tuple[dict[int, Path], Path | None]:
    """The versions of model `name` under `root` and its ``config.json`` (if any); `RepositoryError` if none."""
    folder = root / name
    packed = root / f"{name}.carton"
    if folder.is_dir() and packed.exists():
        raise RepositoryError(f"model {name!r} is both a folder and '{name}.carton' in the repository; keep one")
    if packed.exists():
        return {1: packed}, None
    if not folder.is_dir():
        raise RepositoryError(f"failed to load {name!r}: no such model in the repository")
    versions: dict[int, Path] = {}
    problems: list[str] = []
    for child in folder.iterdir():
        if not child.is_dir() or not child.name.isdigit() or child.name != str(int(child.name)) or child.name == "0":
            continue
        path = _version_path(child)
        if path is None:
            problems.append(f"version {child.name} holds neither model.carton nor an unpacked carton (carton.toml)")
        else:
            versions[int(child.name)] = path
    if not versions:
        detail = "; ".join(problems) if problems else "it has no version folders (REPO/<model>/<version>/model.carton)"
        raise RepositoryError(f"failed to load {name!r}: {detail}")
    config = folder / "config.json"
    return versions, config if config.is_file() else None


def list_models(root: Path) -> list[str]:
    """Names of the models the repository folder holds (entries that are not valid model names are skipped)."""
    names: set[str] = set()
    try:
        entries = list(root.iterdir())
    except OSError:
        return []
    for entry in entries:
        name = entry.name[: -len(".carton")] if entry.name.endswith(".carton") and entry.is_file() else entry.name
        if entry.is_dir() or entry.name.endswith(".carton"):
            try:
                names.add(validate_model_name(name))
            except BadRequest:
                continue
    return sorted(names)


def _upload_relpath(key: str) -> tuple[int, tuple[str, ...]]:
    match = _FILE_KEY.match(key)
    if match is None:
        raise RepositoryError(
            f"load parameter {key!r}: expected 'file:<version>/<path>' with a version number >= 1"
        )
    parts = tuple(match.group(2).split("/"))
    for part in parts:
        if part in ("", ".", "..") or "\\" in part or _CONTROL.search(part):
            raise RepositoryError(
                f"load parameter {key!r}: each path segment must be a plain name (no '', '.', '..', "
                "backslash or control characters); files must stay inside the model's folder"
            )
    return int(match.group(1)), parts


def write_upload(upload_root: Path, name: str, files: Mapping[str, bytes]) -> Path:
    """Write ``file:<version>/<path>`` payloads into a new folder for `name`; every path is confined to it."""
    planned = [(key, *_upload_relpath(key)) for key in sorted(files)]
    folder = upload_root / name / uuid.uuid4().hex
    folder.mkdir(parents=True)
    try:
        for key, version, parts in planned:
            target = folder.joinpath(str(version), *parts)
            if not target.resolve().is_relative_to(folder.resolve()):
                raise RepositoryError(f"load parameter {key!r}: path leaves the model's folder")
            target.parent.mkdir(parents=True, exist_ok=True)
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
            try:
                fd = os.open(target, flags, 0o600)
            except FileExistsError as exc:
                raise RepositoryError(f"load parameter {key!r}: the same file is given twice") from exc
            except OSError as exc:
                raise RepositoryError(f"load parameter {key!r}: cannot write it ({exc.strerror})") from exc
            with os.fdopen(fd, "wb") as stream:
                stream.write(files[key])
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    return folder


_ABSOLUTE = re.compile(r"(?<![\w.>])/(?:[^\s'\"/:,;()\[\]]+/)+([^\s'\"/:,;()\[\]]*)")


class Scrubber:
    """Rewrites messages so that no filesystem path of the server reaches a client.

    Paths under a known root become relative to it (the repository's become ``<model>/<version>/...``, uploads
    ``<upload>/...``); any other absolute path is cut to its last component.
    """

    def __init__(self, roots: Iterable[tuple[Path, str]]) -> None:
        pairs: list[tuple[str, str]] = []
        for root, label in roots:
            for form in {str(root), str(root.resolve())}:
                pairs.append((form.rstrip("/") + "/", label))
        # Longest first, so a root nested in another is rewritten by its own label.
        self._roots = sorted(pairs, key=lambda pair: len(pair[0]), reverse=True)

    def __call__(self, message: str) -> str:
        for prefix, label in self._roots:
            message = message.replace(prefix, label)
            message = message.replace(prefix.rstrip("/"), label.rstrip("/") or ".")
        return _ABSOLUTE.sub(lambda match: match.group(1) or "/", message)
