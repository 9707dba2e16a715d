"""Where carton keeps its cache and its data, following the XDG base directory conventions.

``CARTON_CACHE_DIR`` and ``CARTON_DATA_DIR`` override everything; otherwise ``$XDG_CACHE_HOME/carton`` and
``$XDG_DATA_HOME/carton``, falling back to ``~/.cache/carton`` and ``~/.local/share/carton``. The cache holds only
what can be rebuilt (extracted models, downloaded LINKS files); the data directory holds what cannot (installed
runner environments). Both are read from the environment on every call so tests can redirect them.

`pid_alive` answers, for the folders named after the process that made them (runtime folders, upload folders,
cgroups), whether that process still runs, so that what a killed process left behind can be swept.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["cache_dir", "data_dir", "pid_alive"]


def _xdg(override: str, xdg_var: str, fallback: tuple[str, ...]) -> Path:
    explicit = os.environ.get(override)
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get(xdg_var)
    # The XDG spec says relative values are invalid and must be ignored.
    if base and Path(base).is_absolute():
        return Path(base) / "carton"
    return Path.home().joinpath(*fallback, "carton")


def cache_dir() -> Path:
    """The cache directory (not created): ``CARTON_CACHE_DIR``, else ``$XDG_CACHE_HOME/carton`` or
    ``~/.cache/carton``."""
    return _xdg("CARTON_CACHE_DIR", "XDG_CACHE_HOME", (".cache",))


def data_dir() -> Path:
    """The data directory (not created): ``CARTON_DATA_DIR``, else ``$XDG_DATA_HOME/carton`` or
    ``~/.local/share/carton``."""
    return _xdg("CARTON_DATA_DIR", "XDG_DATA_HOME", (".local", "share"))


def pid_alive(pid: int) -> bool:
    """Whether a process `pid` exists (one of another user counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
