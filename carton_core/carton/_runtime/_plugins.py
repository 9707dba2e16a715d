"""The plugin manager (pluggy project ``carton``) and runner discovery.

Plugins come from the ``carton`` entry-point group (built-in runners register there exactly like a third party's)
plus the internal runner-environments plugin. A plugin that fails to import, fails pluggy's validation, raises in a
hook or returns garbage is reported by name as a `carton.CartonWarning` and skipped; the others still count.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import threading
import warnings
from dataclasses import dataclass

import pluggy
from carton_protocol import RunnerSpec

from ..errors import CartonWarning
from . import _hookspecs

__all__ = ["PROJECT", "Discovery", "PluginProblem", "discover", "discover_runners", "plugin_manager", "reset_plugins"]

#: The pluggy project name and the entry-point group.
PROJECT = "carton"

#: Internal plugin registered beside the entry points (runner environments built by ``carton runner install``).
_INTERNAL_PLUGINS = ("carton._environments.plugin",)


@dataclass(frozen=True, slots=True, kw_only=True)
class PluginProblem:
    """A plugin that was skipped (or partly skipped), and why."""

    plugin: str
    message: str

    def __str__(self) -> str:
        return f"plugin {self.plugin!r}: {self.message}"


@dataclass(frozen=True, slots=True, kw_only=True)
class Discovery:
    """What one discovery found: the runners, in discovery order, and the plugins that were skipped."""

    runners: tuple[RunnerSpec, ...]
    problems: tuple[PluginProblem, ...] = ()


class _State:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.manager: pluggy.PluginManager | None = None
        self.load_problems: tuple[PluginProblem, ...] = ()
        self.sources: dict[str, str] = {}


_state = _State()


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _report(problem: PluginProblem) -> None:
    warnings.warn(f"carton skipped {problem}", CartonWarning, stacklevel=3)


def _build_manager() -> tuple[pluggy.PluginManager, list[PluginProblem], dict[str, str]]:
    manager = pluggy.PluginManager(PROJECT)
    manager.add_hookspecs(_hookspecs)
    problems: list[PluginProblem] = []
    sources: dict[str, str] = {}

    def register(plugin: object, name: str, source: str) -> None:
        if manager.is_registered(plugin) or manager.has_plugin(name):
            return
        try:
            manager.register(plugin, name=name)
        except Exception as exc:  # pluggy.PluginValidationError and anything a plugin's attributes raise
            problems.append(PluginProblem(plugin=name, message=f"rejected by the plugin manager: {_describe(exc)}"))
            return
        sources[name] = source

    entry_points = sorted(importlib.metadata.entry_points(group=PROJECT), key=lambda ep: (ep.name, ep.value))
    for entry_point in entry_points:
        if manager.has_plugin(entry_point.name):
            continue  # the same distribution seen twice on sys.path: first one wins, as in pluggy
        dist = entry_point.dist
        where = f"{dist.name} {dist.version}" if dist is not None else entry_point.value
        try:
            plugin = entry_point.load()
        except Exception as exc:  # a plugin's import may raise anything; it must not take the others down
            problems.append(PluginProblem(
                plugin=entry_point.name,
                message=f"entry point {entry_point.value!r} ({where}) failed to load: {_describe(exc)}",
            ))
            continue
        register(plugin, entry_point.name, f"plugin {entry_point.name} ({where})")

    for module_name in _INTERNAL_PLUGINS:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name is not None and module_name.startswith(exc.name):
                continue  # not part of this build
            problems.append(PluginProblem(plugin=module_name, message=f"failed to import: {_describe(exc)}"))
            continue
        except Exception as exc:
            problems.append(PluginProblem(plugin=module_name, message=f"failed to import: {_describe(exc)}"))
            continue
        register(module, module_name, f"plugin {module_name}")
    return manager, problems, sources


def plugin_manager() -> pluggy.PluginManager:
    """The process-wide plugin manager; entry points are loaded on first use (and after `reset_plugins`).

    Tests and embedding applications may ``register`` extra plugin objects on it.
    """
    with _state.lock:
        if _state.manager is None:
            manager, problems, sources = _build_manager()
            _state.manager, _state.load_problems, _state.sources = manager, tuple(problems), sources
            for problem in problems:
                _report(problem)
        return _state.manager


def reset_plugins() -> None:
    """Forget the plugin manager so that the next discovery reloads the entry points (e.g. after a pip install)."""
    with _state.lock:
        _state.manager = None
        _state.load_problems = ()
        _state.sources = {}


def _check_spec(spec: object) -> str | None:
    """Why a hook result is not a usable RunnerSpec, or None."""
    if not isinstance(spec, RunnerSpec):
        return f"returned a {type(spec).__name__}, not a RunnerSpec"
    if not isinstance(spec.runner_name, str) or not spec.runner_name:
        return f"returned a RunnerSpec with an invalid runner_name {spec.runner_name!r}"
    if not isinstance(spec.framework_version, str) or not spec.framework_version:
        return f"runner {spec.runner_name!r}: framework_version must be a non-empty string"
    if not isinstance(spec.runner_compat_version, int) or isinstance(spec.runner_compat_version, bool):
        return f"runner {spec.runner_name!r}: runner_compat_version must be an int"
    module, sep, attribute = spec.entry.partition(":") if isinstance(spec.entry, str) else ("", "", "")
    if not sep or not module or not attribute:
        return f"runner {spec.runner_name!r}: entry {spec.entry!r} is not 'module:Class'"
    if not isinstance(spec.supported_platforms, tuple) or not all(
        isinstance(p, str) for p in spec.supported_platforms
    ):
        return f"runner {spec.runner_name!r}: supported_platforms must be a tuple of target triples"
    return None


def discover(manager: pluggy.PluginManager | None = None) -> Discovery:
    """Call ``carton_runners`` on every plugin, one at a time so that one failing plugin skips only itself."""
    if manager is None:
        manager = plugin_manager()
    with _state.lock:
        problems = list(_state.load_problems) if manager is _state.manager else []
        sources = dict(_state.sources) if manager is _state.manager else {}
    runners: list[RunnerSpec] = []
    # get_hookimpls() lists implementations in registration order (pluggy calls them in reverse).
    for impl in manager.hook.carton_runners.get_hookimpls():
        if impl.hookwrapper or impl.wrapper:
            continue
        name = impl.plugin_name
        try:
            result = impl.function()
        except Exception as exc:  # a plugin's hook may raise anything; the other plugins must still count
            problem = PluginProblem(plugin=name, message=f"carton_runners() raised {_describe(exc)}")
            problems.append(problem)
            _report(problem)
            continue
        if not isinstance(result, list | tuple):
            problem = PluginProblem(
                plugin=name, message=f"carton_runners() returned a {type(result).__name__}, not a list of RunnerSpec"
            )
            problems.append(problem)
            _report(problem)
            continue
        for spec in result:
            reason = _check_spec(spec)
            if reason is not None:
                problem = PluginProblem(plugin=name, message=f"carton_runners() {reason}; that entry was skipped")
                problems.append(problem)
                _report(problem)
                continue
            assert isinstance(spec, RunnerSpec)
            if not spec.source:
                spec = dataclasses.replace(spec, source=sources.get(name, f"plugin {name}"))
            runners.append(spec)
    return Discovery(runners=tuple(runners), problems=tuple(problems))


def discover_runners() -> tuple[RunnerSpec, ...]:
    """Every runner the installed plugins ship (broken plugins are skipped with a `carton.CartonWarning`)."""
    return discover().runners
