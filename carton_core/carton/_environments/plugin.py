"""Internal plugin: offers every registered runner environment to discovery (registered by the plugin manager)."""

from __future__ import annotations

from carton_protocol import RunnerSpec, hookimpl

from ._registry import list_environments, stale_reason

__all__ = ["carton_runners"]


@hookimpl
def carton_runners() -> list[RunnerSpec]:
    """One spec per registered environment whose interpreter exists and that is not stale (built for another
    carton: `stale_reason`; resolution names those when nothing matches): ``python`` is that interpreter,
    ``environment`` and ``source`` the environment's folder. Reads small JSON files only."""
    return [environment.runner_spec() for environment in list_environments() if stale_reason(environment) is None]
