"""Which host paths a runner needs to see: system libraries, its interpreter and import roots, nothing else."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

import carton_protocol

__all__ = ["ETC_FILES", "SYSTEM_DIRS", "SYS_FILES", "import_roots", "system_paths"]

#: Top-level directories bound read-only when they exist (a symlink stays a symlink, as in merged-/usr systems).
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/opt/conda")
#: Files of /etc that loaders and libcs read; /etc itself (shadow, ssh keys, ...) stays hidden.
ETC_FILES = (
    "/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime", "/etc/passwd", "/etc/group",
    "/etc/nsswitch.conf", "/etc/os-release", "/etc/alternatives",
)
#: What thread-pool sizing in frameworks reads (CPU topology); nothing else of /sys.
SYS_FILES = ("/sys/devices/system/cpu", "/sys/devices/system/node")


def system_paths() -> list[str]:
    return [path for path in (*SYSTEM_DIRS, *ETC_FILES, *SYS_FILES) if os.path.lexists(path)]


def _editable_roots() -> list[str]:
    """Package folders that setuptools' editable finders map outside sys.path."""
    roots: list[str] = []
    for finder in sys.meta_path:
        module = sys.modules.get(getattr(finder, "__module__", "") or "")
        mapping = getattr(module, "MAPPING", None)
        if isinstance(mapping, Mapping):
            roots.extend(str(Path(value).parent) for value in mapping.values() if isinstance(value, str))
    return roots


def _interpreter_roots(interpreter: str) -> list[str]:
    """The prefix of `interpreter`: a venv root (and its base from pyvenv.cfg) or the installation prefix."""
    exe = Path(interpreter)
    roots: list[str] = []
    venv = exe.parent.parent
    config = venv / "pyvenv.cfg"
    if config.is_file():
        roots.append(str(venv))
        for line in config.read_text(encoding="utf-8", errors="replace").splitlines():
            key, _, value = line.partition("=")
            if key.strip() == "home" and value.strip():
                roots.append(str(Path(value.strip()).parent))
    real = exe.resolve()
    roots.append(str(real.parent.parent))
    return roots


def import_roots(interpreter: str, env: Mapping[str, str]) -> list[str]:
    """Folders the runner's interpreter imports from: its prefix, PYTHONPATH, and (for the host's own
    interpreter) sys.path and editable-install roots."""
    roots = _interpreter_roots(interpreter)
    roots.extend(part for part in env.get("PYTHONPATH", "").split(os.pathsep) if part)
    same = Path(interpreter).resolve() == Path(sys.executable).resolve()
    if same:
        roots.extend([sys.prefix, sys.base_prefix, sys.exec_prefix])
        roots.extend(entry for entry in sys.path if entry)
        roots.extend(_editable_roots())
    roots.append(str(Path(carton_protocol.__file__).resolve().parent.parent))
    roots.append(str(Path(__file__).resolve().parent.parent.parent))
    return _dedupe(path for path in roots if Path(path).is_absolute() and Path(path).exists())


def _dedupe(paths: Iterable[str]) -> list[str]:
    """Absolute, existing, resolved paths, with those inside another listed folder dropped."""
    unique = sorted({str(Path(path).resolve()) for path in paths})
    kept: list[str] = []
    for path in unique:
        if not any(path == parent or path.startswith(parent.rstrip("/") + "/") for parent in kept):
            kept.append(path)
    return kept
