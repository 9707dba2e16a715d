"""Internal plugin: offers every registered runner environment to discovery (registered by the plugin manager)."""

from __future__ import annotations

from carton_protocol import RunnerSpec, hookimpl

from ._registry import list_environments

__all__ = ["carton_runners"]


@hookimpl
def carton_runners() -> list[RunnerSpec]:
    """One spec per registered environment whose interpreter exists: ``python`` is that interpreter,
    ``environment`` and ``source`` the environment's folder. Reads small JSON files only."""
    return [environment.runner_spec() for environment in list_environments()]
