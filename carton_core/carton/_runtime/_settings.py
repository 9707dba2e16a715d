"""`LoadSettings`: how a model's runner processes are started and called, decided once per load."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from carton_protocol import OptValue, RunnerSpec

from ._launch import LaunchWrapper

__all__ = ["DEFAULT_HANDSHAKE_TIMEOUT", "DEFAULT_LOAD_TIMEOUT", "LoadSettings"]

#: Default time for a runner to load its model (framework import + model load).
DEFAULT_LOAD_TIMEOUT = 300.0
#: Default time for a started runner to answer the version handshake.
DEFAULT_HANDSHAKE_TIMEOUT = 30.0


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadSettings:
    """What `carton.load` (or `carton.load_unpacked`) decided, for every runner process the `Model` starts.

    ``model_dir`` is the folder the runner loads, ``runner`` the runner resolution chose, ``opts`` its options
    (carton.toml's, overridden by ``runner_opts``), ``workers`` how many processes serve the model, ``wrap`` the
    sandbox's rewrite of every launch plan (``None``: unsandboxed). ``request_timeout`` is the one default limit of
    every call in seconds (``load(timeout=...)``, else ``RunnerLimits.request_seconds``, else ``None``: none);
    ``load_timeout`` and ``handshake_timeout`` bound a runner's start.
    """

    model_dir: Path
    runner: RunnerSpec
    opts: Mapping[str, OptValue]
    workers: int = 1
    wrap: LaunchWrapper | None = None
    request_timeout: float | None = None
    load_timeout: float | None = DEFAULT_LOAD_TIMEOUT
    handshake_timeout: float = DEFAULT_HANDSHAKE_TIMEOUT
