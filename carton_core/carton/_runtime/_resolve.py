"""Choosing the runner for a model: name, framework requirement, compat version and platform must all match.

Among the runners that match, the order of preference is (docs/runners.md has the same list):

1. the highest framework version by SemVer precedence;
2. for equal precedence, the highest PEP 440 version (``2.0.0.post1`` over ``2.0.0``; local versions over none);
3. the highest ``runner_compat_version`` (this only decides when the caller did not pin one);
4. a runner that runs in the host's own interpreter over one in an isolated environment (no venv to start);
5. discovery order (entry points sorted by name, then the runner-environments plugin).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pluggy
from carton_protocol import RunnerSpec
from packaging.version import InvalidVersion as _InvalidPep440
from packaging.version import Version as _Pep440Version

from .._semver import VersionReq, framework_version
from ..errors import CartonError, InvalidVersionReq, NoCompatibleRunner, Rejection
from ._platform import target_triple
from ._plugins import PluginProblem, discover

if TYPE_CHECKING:
    from .._format import CartonInfo

__all__ = ["RunnerRequest", "requirement_source", "resolve_runner", "select_runner"]


@dataclass(frozen=True, slots=True, kw_only=True)
class RunnerRequest:
    """What a model asks of its runner (carton.toml's ``[runner]`` and ``required_platforms``).

    ``runner_compat_version=None`` accepts any compat version (e.g. `carton.load_unpacked` without one).
    """

    runner_name: str
    required_framework_version: str
    runner_compat_version: int | None = None
    required_platforms: tuple[str, ...] = ()

    @classmethod
    def for_carton(
        cls,
        info: CartonInfo,
        *,
        override_runner_name: str | None = None,
        override_required_framework_version: str | None = None,
    ) -> RunnerRequest:
        """What a carton's ``[runner]`` asks for, with `carton.load`'s overrides applied (with another runner name
        the model's ``runner_compat_version`` is not enforced: it belongs to the original runner)."""
        return cls(
            runner_name=override_runner_name or info.runner.runner_name,
            required_framework_version=override_required_framework_version or info.runner.required_framework_version,
            runner_compat_version=None if override_runner_name else info.runner.runner_compat_version,
            required_platforms=tuple(info.required_platforms),
        )

    def __str__(self) -> str:
        text = f"runner {self.runner_name!r} with framework version {self.required_framework_version!r}"
        if self.runner_compat_version is not None:
            text += f" and runner compat version {self.runner_compat_version}"
        return text


def _reasons(request: RunnerRequest, requirement: VersionReq, spec: RunnerSpec, host: str) -> list[str]:
    reasons: list[str] = []
    if spec.runner_name != request.runner_name:
        reasons.append(f"runner name is {spec.runner_name!r}, not {request.runner_name!r}")
    try:
        version = framework_version(spec.framework_version)
    except CartonError as exc:
        reasons.append(str(exc))
    else:
        if not requirement.matches(version):
            as_semver = "" if str(version) == spec.framework_version else f" (as SemVer {version})"
            reasons.append(
                f"framework version {spec.framework_version}{as_semver} does not satisfy "
                f"{request.required_framework_version!r}"
            )
    if request.runner_compat_version is not None and spec.runner_compat_version != request.runner_compat_version:
        reasons.append(
            f"runner compat version is {spec.runner_compat_version}, the model needs {request.runner_compat_version}"
        )
    if spec.supported_platforms and host not in spec.supported_platforms:
        reasons.append(f"runner supports {', '.join(spec.supported_platforms)}, not this host ({host})")
    if request.required_platforms and host not in request.required_platforms:
        reasons.append(f"the model requires {', '.join(request.required_platforms)}; this host is {host}")
    return reasons


def _pep440_rank(text: str) -> tuple[int, _Pep440Version]:
    try:
        return 1, _Pep440Version(text)
    except _InvalidPep440:
        return 0, _Pep440Version("0")


def _preference(order: int, spec: RunnerSpec) -> tuple[object, ...]:
    in_host = spec.python is None and spec.environment is None
    return (
        framework_version(spec.framework_version),
        _pep440_rank(spec.framework_version),
        spec.runner_compat_version,
        in_host,
        -order,
    )


def _install_hint(request: RunnerRequest) -> str | None:
    """The command that would build an environment satisfying the request, when one could."""
    from .._environments import can_install  # only when no runner matched: not on the path of a load

    try:
        installable = can_install(request.runner_name)
    except Exception:  # a hint must never turn a clear resolution error into another one
        return None
    if not installable:
        return None
    return f'carton runner install {request.runner_name} --framework-version "{request.required_framework_version}"'


def _stale_environments(request: RunnerRequest) -> list[str]:
    """The request's runner's environments that discovery skipped as stale, each with why and how to rebuild it."""
    from .._environments import list_runner_environments, rebuild_command, stale_reason

    lines = []
    try:
        for environment in list_runner_environments():
            reason = stale_reason(environment) if environment.runner_name == request.runner_name else None
            if reason is not None:
                lines.append(
                    f"{environment.runner_name} {environment.framework_version} ({environment.path}): {reason}; "
                    f"rebuild it: {rebuild_command(environment.runner_name, environment.framework_version)}"
                )
    except Exception:  # as for the hint: never another error instead of the resolution error
        return []
    return lines


def _no_match_message(
    request: RunnerRequest, host: str, rejections: Sequence[Rejection], problems: Sequence[PluginProblem]
) -> str:
    lines = [f"no installed runner can run this model: it needs {request} on {host}."]
    if rejections:
        lines.append("Candidates:")
        lines.extend(f"  - {rejection}" for rejection in rejections)
    else:
        lines.append("Candidates: none (no plugin in the 'carton' entry-point group declares a runner)")
    if problems:
        lines.append("Plugins skipped:")
        lines.extend(f"  - {problem}" for problem in problems)
    stale = _stale_environments(request)
    if stale:
        lines.append("Runner environments skipped, built for another carton:")
        lines.extend(f"  - {line}" for line in stale)
    hint = _install_hint(request)
    if hint is not None:
        lines.append(f"To install a matching runner environment: {hint}")
    return "\n".join(lines)


def select_runner(
    request: RunnerRequest,
    candidates: Iterable[RunnerSpec],
    *,
    host: str | None = None,
    problems: Sequence[PluginProblem] = (),
) -> RunnerSpec:
    """The preferred candidate that satisfies ``request`` (see the module docstring for the order).

    Raises `InvalidVersionReq` when the requirement does not parse, and `NoCompatibleRunner` listing every
    candidate with every reason it was rejected (and the skipped plugins) when none matches.
    """
    requirement = VersionReq.parse(request.required_framework_version)
    host = host or target_triple()
    matches: list[tuple[int, RunnerSpec]] = []
    rejections: list[Rejection] = []
    for order, spec in enumerate(candidates):
        reasons = _reasons(request, requirement, spec, host)
        if reasons:
            rejections.append(Rejection(spec=spec, reasons=tuple(reasons)))
        else:
            matches.append((order, spec))
    if not matches:
        raise NoCompatibleRunner(_no_match_message(request, host, rejections, problems), rejected=tuple(rejections))
    return max(matches, key=lambda item: _preference(*item))[1]


def resolve_runner(
    request: RunnerRequest, *, manager: pluggy.PluginManager | None = None, where: str | None = None
) -> RunnerSpec:
    """Discover the installed runners and select one for ``request``; ``where`` (e.g. `requirement_source`) names
    the requirement's origin in an `InvalidVersionReq`."""
    discovery = discover(manager)
    try:
        return select_runner(request, discovery.runners, problems=discovery.problems)
    except InvalidVersionReq as exc:
        if where is None:
            raise
        raise InvalidVersionReq(f"{where}: {exc}") from exc


def requirement_source(path_or_url: str | Path, override_required_framework_version: str | None) -> str:
    """Where a load's framework requirement comes from: the override, or the carton's carton.toml."""
    if override_required_framework_version:
        return "the required_framework_version override"
    return f"carton.toml [runner] required_framework_version of {path_or_url}"
