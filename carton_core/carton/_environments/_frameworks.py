"""What goes into a runner environment: the framework at one version, the runner's own dependencies, and carton.

The dependency lists are read from the installed carton-runtime distribution's metadata (its ``onnx``/``xgboost``
extras and the core dependencies `carton_protocol` imports), so pyproject.toml stays the single place they are
declared.
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name

from ..errors import EnvironmentInstallError

__all__ = [
    "CARTON_DISTRIBUTION",
    "FRAMEWORKS",
    "PROTOCOL_DEPENDENCIES",
    "Framework",
    "can_install",
    "carton_install_args",
    "framework_distributions",
    "framework_for",
    "runner_requirements",
]

#: The distribution carton is installed from. The package index's "carton" is an unrelated project.
CARTON_DISTRIBUTION = "carton-runtime"

#: The core dependencies of carton that the runner side (`carton_protocol` and the runner loop) imports.
PROTOCOL_DEPENDENCIES = ("numpy", "pluggy", "pyzmq", "msgspec")


@dataclass(frozen=True, slots=True, kw_only=True)
class Framework:
    """How to build an environment for one runner."""

    runner_name: str
    #: The distribution whose version is the runner's framework version (when the extra names none of `builds`).
    distribution: str
    #: The carton extra that lists the runner's dependencies (the framework among them).
    extra: str
    #: The module the environment must be able to import once built.
    module: str
    #: Every distribution that provides `module` (builds of one framework with the same versions, such as
    #: xgboost-cpu and xgboost); empty means `distribution` only.
    builds: tuple[str, ...] = ()


FRAMEWORKS: dict[str, Framework] = {
    "onnxruntime": Framework(runner_name="onnxruntime", distribution="onnxruntime", extra="onnx", module="onnxruntime"),
    "xgboost": Framework(
        runner_name="xgboost",
        distribution="xgboost",
        extra="xgboost",
        module="xgboost",
        builds=("xgboost-cpu", "xgboost"),
    ),
}


def can_install(runner_name: str) -> bool:
    """Whether `install_runner` knows how to build environments for ``runner_name`` (resolution's install hint)."""
    return runner_name in FRAMEWORKS


def framework_for(runner_name: str) -> Framework:
    """The recipe for ``runner_name``; `EnvironmentInstallError` naming the runners that have one otherwise."""
    try:
        return FRAMEWORKS[runner_name]
    except KeyError:
        known = ", ".join(sorted(FRAMEWORKS))
        raise EnvironmentInstallError(
            f"carton cannot build environments for runner {runner_name!r}; it can for: {known}"
        ) from None


@functools.cache
def _carton() -> importlib.metadata.Distribution:
    """The installed carton distribution. A stale ``egg-info`` in the working directory (left by an old
    ``setup.py develop``) can shadow it on ``sys.path``, so prefer the metadata that records where carton was
    installed from."""
    found = list(importlib.metadata.Distribution.discover(name=CARTON_DISTRIBUTION))
    if not found:
        raise EnvironmentInstallError(
            f"the {CARTON_DISTRIBUTION} distribution's metadata is missing; reinstall {CARTON_DISTRIBUTION}"
        )
    return next((dist for dist in found if dist.read_text("direct_url.json")), found[0])


def _requirements() -> list[Requirement]:
    parsed = []
    for text in _carton().requires or []:
        try:
            parsed.append(Requirement(text))
        except InvalidRequirement as exc:
            raise EnvironmentInstallError(f"carton's metadata has an invalid requirement {text!r}") from exc
    return parsed


def framework_distributions(framework: Framework) -> list[str]:
    """The distributions to build ``framework``'s environments from, preferred first: the build carton's extra
    installs on this platform (xgboost-cpu on Linux), then the framework's other builds (for versions the preferred
    build was never released at)."""
    builds = framework.builds or (framework.distribution,)
    chosen = [
        requirement.name
        for requirement in _requirements()
        if _only_in_extra(requirement, framework.extra) and canonicalize_name(requirement.name) in builds
    ]
    return [*chosen, *(build for build in builds if build not in chosen)]


def runner_requirements(framework: Framework, version: str, distribution: str | None = None) -> list[str]:
    """Requirement strings for the environment: the framework's ``distribution`` (default: the preferred one)
    pinned to ``version``, the extra's other dependencies and the protocol's, with the specifiers carton declares."""
    wanted = {canonicalize_name(name) for name in PROTOCOL_DEPENDENCIES}
    distribution = distribution or framework_distributions(framework)[0]
    builds = {canonicalize_name(build) for build in (*framework.builds, framework.distribution, distribution)}
    requirements = [f"{distribution}=={version}"]
    for requirement in _requirements():
        name = canonicalize_name(requirement.name)
        if requirement.marker is None:
            if name in wanted:
                requirements.append(str(requirement))
        elif _only_in_extra(requirement, framework.extra) and name not in builds:
            requirement.marker = None  # the extra's marker means nothing in the environment
            requirements.append(str(requirement))
    return requirements


def _only_in_extra(requirement: Requirement, extra: str) -> bool:
    marker = requirement.marker
    return marker is not None and marker.evaluate({"extra": extra}) and not marker.evaluate({"extra": ""})


def carton_install_args() -> list[str]:
    """pip arguments that install this very carton (without dependencies): the checkout of an editable install,
    or the local file or URL it was installed from."""
    distribution = _carton()
    text = distribution.read_text("direct_url.json")
    if text:
        try:
            direct = json.loads(text)
            url = str(direct["url"])
        except (ValueError, KeyError, TypeError) as exc:
            raise EnvironmentInstallError(f"carton's direct_url.json is malformed: {exc}") from exc
        parsed = urllib.parse.urlsplit(url)
        if parsed.scheme == "file":
            path = Path(urllib.request.url2pathname(parsed.path))
            if not path.exists():
                raise EnvironmentInstallError(f"carton was installed from {str(path)!r}, which no longer exists")
            editable = bool(direct.get("dir_info", {}).get("editable", False))
            return ["-e", str(path)] if editable else [str(path)]
        return [f"{CARTON_DISTRIBUTION} @ {url}"]
    # Without a record of the source, carton is not installed again from the index: the environment must get this
    # very carton, not whatever version the index has.
    raise EnvironmentInstallError(
        "cannot tell where carton was installed from (its metadata has no direct_url.json); install carton from "
        "a local checkout or wheel (pip install -e PATH, pip install FILE.whl) to build runner environments"
    )
