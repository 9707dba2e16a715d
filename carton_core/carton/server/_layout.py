"""The repository on disk: model names, version folders, ``file:`` uploads, and keeping paths out of messages.

Layout (like Triton's)::

    REPO/<model>/config.json            optional serving config (see `carton.server._config`)
    REPO/<model>/<version>/model.carton a packed carton, or an unpacked carton folder of that name
    REPO/<model>/<version>/carton.toml  ... or the version folder itself is an unpacked carton
    REPO/<model>/<version>/<file>       ... or the version folder's only file is a packed carton (any name)
    REPO/<model>.carton                 shorthand for version 1 of <model>
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import tempfile
import uuid
from collections.abc import Mapping
from pathlib import Path

from .._paths import pid_alive
from .errors import BadRequest, RepositoryError

__all__ = [
    "Scrubber",
    "list_models",
    "make_upload_root",
    "scan_model_folder",
    "scan_versions",
    "sweep_stale_upload_roots",
    "validate_model_name",
    "write_upload",
]

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
    """What a version folder serves: ``model.carton``, the folder itself when it is an unpacked carton, or its one
    file whatever that file is called (``file:1/model.bin``: Triton clients name uploads after their backends)."""
    packed = folder / "model.carton"
    if packed.exists():
        return packed
    if (folder / "carton.toml").is_file():
        return folder
    entries = list(folder.iterdir())
    if len(entries) == 1 and entries[0].is_file():
        return entries[0]
    return None


def scan_versions(root: Path, name: str) -> tuple[dict[int, Path], Path | None]:
    """The versions of model `name` in the repository `root` and its ``config.json`` (if any); `RepositoryError` if
    none."""
    folder = root / name
    packed = root / f"{name}.carton"
    if folder.is_dir() and packed.exists():
        raise RepositoryError(f"model {name!r} is both a folder and '{name}.carton' in the repository; keep one")
    if packed.exists():
        return {1: packed}, None
    if not folder.is_dir():
        raise RepositoryError(f"failed to load {name!r}: no such model in the repository")
    config = folder / "config.json"
    return scan_model_folder(folder, name), config if config.is_file() else None


def scan_model_folder(folder: Path, name: str) -> dict[int, Path]:
    """The version folders of model `name` in `folder` (the repository's or an upload's); `RepositoryError` naming
    the model, never the folder, if there is none."""
    versions: dict[int, Path] = {}
    problems: list[str] = []
    for child in sorted(folder.iterdir()):
        if not child.is_dir() or not child.name.isdigit() or child.name != str(int(child.name)) or child.name == "0":
            continue
        path = _version_path(child)
        if path is None:
            problems.append(
                f"version {child.name} holds neither model.carton, an unpacked carton (carton.toml), nor a single "
                "carton file"
            )
        else:
            versions[int(child.name)] = path
    if not versions:
        detail = "; ".join(problems) if problems else "it has no version folders (REPO/<model>/<version>/model.carton)"
        raise RepositoryError(f"failed to load {name!r}: {detail}")
    return versions


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
        raise RepositoryError(f"load parameter {key!r}: expected 'file:<version>/<path>' with a version number >= 1")
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
# A path starts at the beginning of the message or after a delimiter, never inside a longer path or a word.
_BOUNDARY = r"(?:^|(?<=[\s'\"`(\[{=:,;<]))"


class Scrubber:
    """Rewrites foreign messages (the runtime's, a runner's) so that no filesystem path of the server reaches a client.

    Only absolute paths are matched, and a known root only where a path starts (its absolute form followed by a
    separator), so names that merely contain the root's text are left alone. Paths under the repository become
    ``<model>/<version>/...``; paths inside an upload become the client's own ``file:<version>/<path>`` parameter
    name; any other absolute path is cut to its last component. Messages the server composes itself are not passed
    through it: they are built from names (model, tensor, parameter names, echoed verbatim) and carry no paths.
    """

    def __init__(self, repository: Path, upload_root: Path | None = None) -> None:
        patterns: list[tuple[re.Pattern[str], str]] = []
        if upload_root is not None:
            for form in _absolute_forms(upload_root):
                # <upload_root>/<model>/<uuid>/ is the folder the client's file: parameters were written into.
                folder = re.escape(form) + r"/[^/\s]+/[0-9a-f]{32}/"
                patterns.append((re.compile(_BOUNDARY + folder), "file:"))
                patterns.append((re.compile(_BOUNDARY + re.escape(form) + "/"), "<upload>/"))
        for form in _absolute_forms(repository):
            patterns.append((re.compile(_BOUNDARY + re.escape(form) + "/"), ""))
        # Longest first, so a root nested in another is rewritten by its own label.
        self._patterns = sorted(patterns, key=lambda pair: len(pair[0].pattern), reverse=True)

    def __call__(self, message: str) -> str:
        for pattern, label in self._patterns:
            message = pattern.sub(label, message)
        return _ABSOLUTE.sub(lambda match: match.group(1) or "/", message)


def _absolute_forms(root: Path) -> set[str]:
    forms = {str(root.absolute()), str(root.resolve())}
    return {form.rstrip("/") for form in forms if form.rstrip("/")}


# ---- the upload root: one private temporary folder per server process ------------------------------------------
_UPLOAD_PREFIX = "carton-serve-uploads-"
_UPLOAD_NAME = re.compile(rf"^{_UPLOAD_PREFIX}([1-9][0-9]*)-")


def make_upload_root() -> Path:
    """A new private (0700) temporary folder for this server's uploads, named after this process's pid."""
    return Path(tempfile.mkdtemp(prefix=f"{_UPLOAD_PREFIX}{os.getpid()}-"))


def sweep_stale_upload_roots(temp_dir: Path | None = None) -> list[Path]:
    """Delete upload folders left by servers that died without cleaning up (SIGKILL, power loss); returns them.

    A folder is removed only when its name records an owner pid that no longer runs, and it is a real folder owned
    by this user; a live server's folder (or one whose pid was reused by another process) is left alone.
    """
    folder = Path(temp_dir if temp_dir is not None else tempfile.gettempdir())
    removed: list[Path] = []
    try:
        entries = list(folder.iterdir())
    except OSError:
        return removed
    for entry in entries:
        match = _UPLOAD_NAME.match(entry.name)
        if match is None:
            continue
        try:
            status = entry.lstat()
        except OSError:
            continue
        if not stat.S_ISDIR(status.st_mode) or status.st_uid != os.getuid() or pid_alive(int(match.group(1))):
            continue
        shutil.rmtree(entry, ignore_errors=True)
        removed.append(entry)
    return removed
