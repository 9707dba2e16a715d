"""The hooks a carton plugin may implement (pluggy project ``carton``, entry-point group ``carton``).

A plugin is a module named by an entry point in the ``carton`` group. It marks its implementations with
`carton_protocol.hookimpl` so that it imports nothing of the host::

    from carton_protocol import RunnerSpec, hookimpl

    @hookimpl
    def carton_runners() -> list[RunnerSpec]:
        return [RunnerSpec(runner_name="echo", framework_version="1.0.0", runner_compat_version=1,
                           entry="carton_runner_echo.runner:EchoRunner")]

Hooks only grow: a new hook may be added, an existing one keeps its name, arguments and meaning.
"""

from __future__ import annotations

from pathlib import Path

import pluggy
from carton_protocol import OptValue, RunnerSpec

__all__ = ["carton_runners", "carton_serialize_model", "hookspec"]

#: Marks hook specifications of the ``carton`` project.
hookspec = pluggy.HookspecMarker("carton")


@hookspec
def carton_runners() -> list[RunnerSpec]:  # type: ignore[empty-body]
    """Return the runners this plugin ships.

    Called with no arguments on every plugin each time runners are discovered (each `carton.load`, `carton.pack`
    with validation, `carton runners`); the lists are concatenated. Keep it cheap and never import a framework:
    read the framework's version with ``importlib.metadata.version``. A spec's ``source`` may be left empty;
    discovery fills it with the plugin's name. An implementation that raises, or returns anything but a list of
    `RunnerSpec`, is reported by name (a `carton.CartonWarning`) and skipped; the other plugins still count.
    """


@hookspec(firstresult=True)
def carton_serialize_model(
    obj: object, runner_name: str, model_dir: Path
) -> dict[str, OptValue] | None:
    """Write an in-memory model object into ``model_dir`` for the runner ``runner_name``.

    Called by `carton.pack` when it is given an object instead of a folder, on each plugin in turn until one
    returns something other than ``None`` (firstresult). ``model_dir`` exists and is empty. Recognize the object
    by duck typing (never import a framework to check), write its files, and return the runner options to record
    in carton.toml (``{}`` if none); return ``None`` when the object is not yours or ``runner_name`` is not a
    runner you ship.
    """
