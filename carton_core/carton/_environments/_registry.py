"""Where runner environments live and how an environment becomes visible (registered) or disappears.

    <data dir>/runners/
      .lock                              held (flock) while an install or a removal runs
      .tmp-<name>-<version>-<random>/    a build in progress, or left by an interrupted one (never read)
      <name>-<version>/                  a finished venv ...
        carton-environment.json          ... registered only once this file exists; it is written last, atomically

Discovery reads only ``<name>-<version>/carton-environment.json`` files that parse, so an install killed at any point
leaves nothing resolution would pick; the next install or removal sweeps the leftovers.

An entry records what the environment was built with: the carton version, the framework's distribution and every
requirement pip installed. An environment built by another carton, or without a requirement this carton's runner
side now needs (the wire moved from msgpack to msgspec, say), is stale (`stale_reason`): discovery does not offer it,
resolution names it with the command that rebuilds it, and ``carton runner install`` rebuilds it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from carton_protocol import RunnerSpec

from .._paths import data_dir
from .._version import __version__
from ..errors import EnvironmentInstallError
from ._frameworks import FRAMEWORKS, runner_requirements

__all__ = [
    "ENTRY_FILE",
    "ENTRY_FORMAT",
    "RunnerEnvironment",
    "discard",
    "environment_dir",
    "install_lock",
    "list_environments",
    "new_build_dir",
    "read_entry",
    "rebuild_command",
    "runners_dir",
    "stale_reason",
    "sweep_leftovers",
    "write_entry",
]

#: The registration file; its presence (and validity) is what makes an environment exist.
ENTRY_FILE = "carton-environment.json"

#: Version of the entry file's layout; readers skip entries with a newer one.
ENTRY_FORMAT = 1

_TMP_PREFIX = ".tmp-"


@dataclass(frozen=True, slots=True, kw_only=True)
class RunnerEnvironment:
    """An installed, registered runner environment."""

    runner_name: str
    framework_version: str
    #: The requirement it was installed for (``carton runner install NAME --framework-version REQ``).
    requirement: str
    path: Path
    runner_compat_version: int
    entry: str
    supported_platforms: tuple[str, ...] = ()
    concurrent: bool = False
    carton_version: str = ""
    installed_at: str = ""
    #: The distribution that provides the framework (``xgboost-cpu`` or ``xgboost``, say).
    distribution: str = ""
    #: Every requirement pip installed into the environment (the framework pinned, the runner's dependencies); empty
    #: in entries written before carton recorded them.
    requirements: tuple[str, ...] = ()

    @property
    def python(self) -> Path:
        """The environment's interpreter (the runner process is started with it)."""
        return self.path / "bin" / "python"

    def runner_spec(self) -> RunnerSpec:
        """The spec discovery offers for this environment."""
        return RunnerSpec(
            runner_name=self.runner_name,
            framework_version=self.framework_version,
            runner_compat_version=self.runner_compat_version,
            entry=self.entry,
            supported_platforms=self.supported_platforms,
            python=str(self.python),
            environment=str(self.path),
            concurrent=self.concurrent,
            source=str(self.path),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "format": ENTRY_FORMAT,
            "runner_name": self.runner_name,
            "framework_version": self.framework_version,
            "requirement": self.requirement,
            "runner_compat_version": self.runner_compat_version,
            "entry": self.entry,
            "supported_platforms": list(self.supported_platforms),
            "concurrent": self.concurrent,
            "carton_version": self.carton_version,
            "installed_at": self.installed_at,
            "distribution": self.distribution,
            "requirements": list(self.requirements),
        }

    @classmethod
    def from_json(cls, data: Any, path: Path) -> RunnerEnvironment | None:
        """Read an entry; ``None`` for anything malformed or written by a newer carton."""
        try:
            if data["format"] != ENTRY_FORMAT:
                return None
            environment = cls(
                runner_name=_str(data["runner_name"]),
                framework_version=_str(data["framework_version"]),
                requirement=_str(data["requirement"]),
                path=path,
                runner_compat_version=_int(data["runner_compat_version"]),
                entry=_str(data["entry"]),
                supported_platforms=tuple(_str(item) for item in data["supported_platforms"]),
                concurrent=bool(data["concurrent"]),
                carton_version=_str(data.get("carton_version", "")),
                installed_at=_str(data.get("installed_at", "")),
                distribution=_str(data.get("distribution", "")),
                requirements=tuple(_str(item) for item in data.get("requirements", ())),
            )
        except (KeyError, TypeError, ValueError):
            return None
        return environment


def _str(value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(value)
    return value


def _int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(value)
    return value


def runners_dir() -> Path:
    """``<data dir>/runners`` (not created)."""
    return data_dir() / "runners"


def environment_dir(runner_name: str, framework_version: str) -> Path:
    """The folder of one environment (whether or not it exists)."""
    return runners_dir() / f"{runner_name}-{framework_version}"


def stale_reason(environment: RunnerEnvironment) -> str | None:
    """Why `environment` cannot run this carton's runner side, or ``None`` when it can: it was built by another
    carton version, or lacks a requirement this carton needs there (`runner_requirements`), or records none."""
    if environment.carton_version != __version__:
        built_by = f"carton {environment.carton_version}" if environment.carton_version else "an unknown carton"
        return f"it was built by {built_by}, this is carton {__version__}"
    if not environment.requirements:
        return "it records no dependencies (it was built by an older carton)"
    framework = FRAMEWORKS.get(environment.runner_name)
    if framework is None:
        return None
    try:
        wanted = runner_requirements(framework, environment.framework_version, environment.distribution or None)
    except EnvironmentInstallError:
        return None  # carton's own metadata is unreadable: nothing to compare with
    missing = [requirement for requirement in wanted if requirement not in environment.requirements]
    if missing:
        return f"this carton needs {', '.join(missing)} there, which it was not built with"
    return None


def rebuild_command(runner_name: str, framework_version: str, *, force: bool = False) -> str:
    """The command that builds the environment of `runner_name` at `framework_version` again: ``carton runner
    install`` rebuilds a stale one by itself, and any one with ``force`` (one that is broken but looks fresh)."""
    command = f'carton runner install {runner_name} --framework-version "={framework_version}"'
    return f"{command} --force" if force else command


def list_environments() -> list[RunnerEnvironment]:
    """Registered environments whose interpreter still exists, sorted by runner name then install order of folders
    (stale ones included: see `stale_reason`).

    Cheap (one small JSON read per environment) because discovery calls it on every `carton.load`.
    """
    root = runners_dir()
    if not root.is_dir():
        return []
    found: list[RunnerEnvironment] = []
    for folder in sorted(root.iterdir()):
        if folder.name.startswith("."):
            continue
        environment = read_entry(folder)
        if environment is not None and environment.python.exists():
            found.append(environment)
    return found


def read_entry(folder: Path) -> RunnerEnvironment | None:
    """The registration of ``folder``, or ``None`` when it has none or it does not parse."""
    try:
        data = json.loads((folder / ENTRY_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return RunnerEnvironment.from_json(data, folder)


def write_entry(environment: RunnerEnvironment) -> None:
    """Register ``environment``: write its entry to a temporary file, fsync it, then rename it into place."""
    text = json.dumps(environment.to_json(), indent=2, sort_keys=True) + "\n"
    descriptor, temporary = tempfile.mkstemp(prefix=".entry-", dir=environment.path)
    try:
        with os.fdopen(descriptor, "w", encoding="utf-8") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
        Path(temporary).replace(environment.path / ENTRY_FILE)
    except BaseException:
        with contextlib.suppress(OSError):
            Path(temporary).unlink()
        raise
    _fsync_dir(environment.path)


def _fsync_dir(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def new_build_dir(runner_name: str, framework_version: str) -> Path:
    """A fresh, empty folder for a build, named so that discovery never reads it."""
    root = runners_dir()
    return Path(tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{runner_name}-{framework_version}-", dir=root))


def discard(folder: Path) -> None:
    """Unregister and delete ``folder``: rename it to a temporary name first (atomic), then delete it."""
    if not folder.exists():
        return
    graveyard = Path(tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}removing-", dir=folder.parent))
    folder.rename(graveyard / folder.name)
    shutil.rmtree(graveyard, ignore_errors=True)


def sweep_leftovers() -> list[Path]:
    """Delete interrupted builds and unregistered environment folders; call with the install lock held."""
    root = runners_dir()
    removed: list[Path] = []
    if not root.is_dir():
        return removed
    for folder in root.iterdir():
        if not folder.is_dir():
            continue
        unregistered = not folder.name.startswith(".") and not (folder / ENTRY_FILE).exists()
        if folder.name.startswith(_TMP_PREFIX) or unregistered:
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


@contextlib.contextmanager
def install_lock(*, on_wait: Callable[[str], None] | None = None) -> Iterator[Path]:
    """Hold ``<data dir>/runners/.lock`` exclusively (one install or removal at a time, across processes)."""
    root = runners_dir()
    try:
        root.mkdir(parents=True, exist_ok=True)
        descriptor = os.open(root / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise EnvironmentInstallError(f"cannot use the runner environments folder {str(root)!r}: {exc}") from exc
    try:
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if on_wait is not None:
                on_wait(f"waiting for another install or removal in {root} to finish")
            fcntl.flock(descriptor, fcntl.LOCK_EX)
        yield root
    finally:
        os.close(descriptor)
