"""Metadata shared by the host and the runners: carton dtypes, tensor specs and runner specs.

These live in `carton_protocol` (not `carton`) so that runner plugins can describe themselves without importing
anything of the host. `carton` re-exports them.
"""

from __future__ import annotations

import enum
import importlib.metadata
from dataclasses import dataclass, field

import pluggy

__all__ = ["DType", "RunnerSpec", "Shape", "TensorSpec", "hookimpl", "installed_version"]

#: Marks a plugin's hook implementations; the project name is ``carton``, the entry-point group too.
hookimpl = pluggy.HookimplMarker("carton")


class DType(enum.StrEnum):
    """Element types a carton.toml may declare (Carton format v1), plus the extras the wire can carry."""

    FLOAT32 = "float32"
    FLOAT64 = "float64"
    STRING = "string"
    INT8 = "int8"
    INT16 = "int16"
    INT32 = "int32"
    INT64 = "int64"
    UINT8 = "uint8"
    UINT16 = "uint16"
    UINT32 = "uint32"
    UINT64 = "uint64"


#: A declared shape: ``"*"`` (anything), a symbol name for the whole shape, or one entry per dimension, each an
#: int or a symbol (``"*"`` being a free symbol). ``()`` is a scalar.
Shape = str | tuple[int | str, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class TensorSpec:
    """One `[[input]]` or `[[output]]` entry of carton.toml."""

    name: str
    dtype: DType
    shape: Shape = "*"
    description: str | None = None
    internal_name: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class RunnerSpec:
    """A runner a plugin ships, as returned by the ``carton_runners`` hook.

    ``entry`` is ``"module:Class"`` naming a `carton_protocol.Runner` subclass, imported only inside the runner
    process. ``python`` is the interpreter that process is started with (``None``: the host's own). ``environment``
    names the isolated environment the runner lives in (``None``: the host's). ``source`` says where the spec came
    from (plugin name, environment path) and is filled in by discovery when left empty.
    """

    runner_name: str
    framework_version: str
    runner_compat_version: int
    entry: str
    supported_platforms: tuple[str, ...] = ()
    python: str | None = None
    environment: str | None = None
    concurrent: bool = False
    source: str = ""
    env: tuple[tuple[str, str], ...] = field(default=())


def installed_version(*distributions: str) -> str | None:
    """The version of the first of `distributions` installed in this environment, or None when none is: for a
    ``carton_runners`` hook whose framework ships under several distribution names (a CPU and a GPU build)."""
    for distribution in distributions:
        try:
            return importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None
