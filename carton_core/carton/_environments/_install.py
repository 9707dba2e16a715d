"""Building runner environments: pick the framework version, make a venv, install, check, then register.

Each step reports one line through ``progress``; pip's own lines are passed through indented. Building happens in
a temporary folder that discovery never reads; the finished venv is renamed into place, checked by starting its
interpreter, and only then registered (`_registry.write_entry`), so an install interrupted at any point leaves
nothing resolution would pick.
"""

from __future__ import annotations

import collections
import datetime
import json
import os
import re
import shutil
import subprocess
import sys
import venv
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from packaging.version import InvalidVersion as InvalidPep440Version
from packaging.version import Version

from .._semver import VersionReq, framework_version
from ..errors import EnvironmentInstallError, InvalidVersion
from ._frameworks import Framework, carton_install_args, framework_distributions, framework_for, runner_requirements
from ._registry import (
    RunnerEnvironment,
    discard,
    environment_dir,
    install_lock,
    list_environments,
    new_build_dir,
    read_entry,
    stale_reason,
    sweep_leftovers,
    write_entry,
)

__all__ = ["Progress", "available_versions", "choose_version", "install_runner", "remove_runner_environment"]

Progress = Callable[[str], None]

_STEPS = 5
_PIP_TAIL_LINES = 25
#: pip's lines worth showing as progress (the rest is kept for the error message if pip fails).
_PIP_PROGRESS_PREFIXES = ("Collecting", "Downloading", "Obtaining", "Building", "Installing collected", "Successfully")
_AVAILABLE = re.compile(r"^Available versions:\s*(?P<versions>.*)$", re.MULTILINE)


def install_runner(
    runner_name: str,
    framework_version: str = "*",
    *,
    force: bool = False,
    progress: Progress | None = None,
) -> RunnerEnvironment:
    """Build (or reuse) an isolated environment for ``runner_name`` with the highest framework version that the
    Cargo-style requirement ``framework_version`` allows, register it, and return it.

    An environment already registered for the chosen version is returned as is unless ``force``, or unless it is
    stale (built by another carton, or without a dependency this carton's runner side needs): it is rebuilt then.
    ``progress`` receives one line per step (default: printed to stderr when it is a terminal). Raises
    `InvalidVersionReq` for a bad requirement and `EnvironmentInstallError` when no version matches or a step fails;
    in every failure case nothing is registered.
    """
    report = progress if progress is not None else _default_progress()
    framework = framework_for(runner_name)
    requirement = VersionReq.parse(framework_version)
    distribution, version = _choose_build(framework, requirement, framework_version, report)
    report(f"        chose {distribution} {version}")
    with install_lock(on_wait=report):
        sweep_leftovers()
        target = environment_dir(runner_name, version)
        existing = read_entry(target)
        stale = None if existing is None else stale_reason(existing)
        if existing is not None and not force and stale is None:
            report(f"        {runner_name} {version} is already installed in {target}")
            return existing
        if stale is not None:
            report(f"        rebuilding {runner_name} {version} in {target}: {stale}")
        build = new_build_dir(runner_name, version)
        try:
            report(f"[2/{_STEPS}] creating a virtual environment in {build}")
            venv.EnvBuilder(symlinks=True, with_pip=False, clear=True).create(build)
            python = build / "bin" / "python"
            requirements = runner_requirements(framework, version, distribution)
            report(f"[3/{_STEPS}] installing {', '.join(requirements)}")
            _pip(python, ["install", *requirements], report)
            carton_args = carton_install_args()
            report(f"[4/{_STEPS}] installing carton from {carton_args[-1]}")
            _pip(python, ["install", "--no-deps", *carton_args], report)
            discard(target)
            build.rename(target)
        except BaseException:
            shutil.rmtree(build, ignore_errors=True)
            raise
        try:
            report(f"[{_STEPS}/{_STEPS}] checking that the environment can start the {runner_name} runner")
            environment = _describe(
                target, framework, version, requirement_text=framework_version, installed=(distribution, requirements)
            )
            write_entry(environment)
        except BaseException:
            shutil.rmtree(target, ignore_errors=True)
            raise
    report(f"installed {runner_name} runner with {distribution} {version} in {target}")
    return environment


def _choose_build(
    framework: Framework, requirement: VersionReq, requirement_text: str, report: Progress
) -> tuple[str, str]:
    """The distribution and version to install: the preferred build (the one carton's extra installs here) when
    it has a matching release, else the next build that does (xgboost-cpu starts at 2.1.1; older versions come
    from xgboost)."""
    first_failure: EnvironmentInstallError | None = None
    for distribution in framework_distributions(framework):
        report(f"[1/{_STEPS}] looking up {distribution} versions matching {requirement_text!r}")
        try:
            available = available_versions(distribution)
            return distribution, choose_version(
                available, requirement, requirement_text=requirement_text, distribution=distribution
            )
        except EnvironmentInstallError as exc:
            first_failure = first_failure or exc
    assert first_failure is not None
    raise first_failure


def remove_runner_environment(runner_name: str, framework_version: str | None = None) -> list[RunnerEnvironment]:
    """Unregister and delete the environments of ``runner_name`` (all of them, or the one with exactly
    ``framework_version``); return what was removed (empty when nothing matched)."""
    with install_lock():
        removed = [
            environment
            for environment in list_environments()
            if environment.runner_name == runner_name
            and (framework_version is None or environment.framework_version == framework_version)
        ]
        for environment in removed:
            discard(environment.path)
        sweep_leftovers()
    return removed


def choose_version(
    available: Iterable[str], requirement: VersionReq, *, requirement_text: str, distribution: str
) -> str:
    """The highest of ``available`` (PEP 440 strings from the index) that ``requirement`` matches."""
    matching: list[tuple[Version, str]] = []
    for text in available:
        try:
            if requirement.matches(framework_version(text)):
                matching.append((Version(text), text))
        except (InvalidVersion, InvalidPep440Version):
            continue  # versions SemVer cannot express (epochs) cannot satisfy a Cargo requirement
    if not matching:
        listing = ", ".join(list(available)[:15]) or "none"
        raise EnvironmentInstallError(
            f"no {distribution} release matches {requirement_text!r}; the package index offers: {listing}"
        )
    return max(matching)[1]


def available_versions(distribution: str) -> list[str]:
    """Every version of ``distribution`` that pip can install for this interpreter and platform, newest first."""
    command = [
        sys.executable,
        "-m",
        "pip",
        "index",
        "versions",
        distribution,
        "--pre",
        "--disable-pip-version-check",
        "--no-input",
    ]
    try:
        completed = subprocess.run(command, capture_output=True, text=True, env=_pip_env(), check=False)
    except OSError as exc:
        raise EnvironmentInstallError(f"could not run pip to list {distribution} versions: {exc}") from exc
    found = _AVAILABLE.search(completed.stdout)
    if completed.returncode != 0 or found is None:
        detail = _tail(completed.stderr.splitlines() or completed.stdout.splitlines())
        raise EnvironmentInstallError(
            f"could not list {distribution} versions from the package index "
            f"(`{' '.join(command[2:])}` exited {completed.returncode}):\n{detail}"
        )
    return [item.strip() for item in found["versions"].split(",") if item.strip()]


def _pip(python: Path, arguments: Sequence[str], report: Progress) -> None:
    """Run the host's pip against the environment's interpreter, passing its lines to ``report``."""
    command = [
        sys.executable,
        "-m",
        "pip",
        "--python",
        str(python),
        *arguments,
        "--no-input",
        "--disable-pip-version-check",
        "--no-warn-script-location",
    ]
    tail: collections.deque[str] = collections.deque(maxlen=_PIP_TAIL_LINES)
    try:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_pip_env())
    except OSError as exc:
        raise EnvironmentInstallError(f"could not run pip: {exc}") from exc
    with process:
        assert process.stdout is not None
        try:
            for line in process.stdout:
                line = line.rstrip()
                if line:
                    tail.append(line)
                    if line.lstrip().startswith(_PIP_PROGRESS_PREFIXES):
                        report(f"        {line.strip()}")
        except BaseException:
            process.kill()
            raise
    if process.returncode != 0:
        raise EnvironmentInstallError(
            f"pip failed (exit {process.returncode}) running `pip {' '.join(arguments)}`:\n{_tail(tail)}"
        )


_DESCRIBE = r"""
import importlib, importlib.metadata, json, sys
runner_name, module = sys.argv[1], sys.argv[2]
importlib.import_module(module)
from carton_protocol import Runner
problems = []
for entry_point in importlib.metadata.entry_points(group="carton"):
    try:
        specs = getattr(entry_point.load(), "carton_runners", lambda: [])()
    except Exception as exc:
        problems.append(f"plugin {entry_point.name!r}: {type(exc).__name__}: {exc}")
        continue
    for spec in specs:
        if spec.runner_name != runner_name:
            continue
        module_name, _, class_name = spec.entry.partition(":")
        runner = getattr(importlib.import_module(module_name), class_name)
        if not (isinstance(runner, type) and issubclass(runner, Runner)):
            raise TypeError(f"{spec.entry} is not a carton_protocol.Runner subclass")
        print(json.dumps({"framework_version": spec.framework_version,
                          "runner_compat_version": spec.runner_compat_version, "entry": spec.entry,
                          "supported_platforms": list(spec.supported_platforms), "concurrent": spec.concurrent}))
        sys.exit(0)
raise LookupError(f"no installed plugin offers runner {runner_name!r}; " + "; ".join(problems))
"""


def _describe(
    target: Path, framework: Framework, version: str, *, requirement_text: str, installed: tuple[str, list[str]]
) -> RunnerEnvironment:
    """Start the environment's interpreter, import the framework and the runner, and read the runner's spec.

    ``installed`` is what was installed there: the framework's distribution and every requirement (recorded, so
    that a later carton can tell the environment is stale)."""
    python = target / "bin" / "python"
    command = [str(python), "-I", "-c", _DESCRIBE, framework.runner_name, framework.module]
    completed = subprocess.run(command, capture_output=True, text=True, env=_clean_env(), cwd=target, check=False)
    if completed.returncode != 0:
        raise EnvironmentInstallError(
            f"the new environment cannot start the {framework.runner_name} runner:\n"
            f"{_tail(completed.stderr.splitlines())}"
        )
    try:
        described = json.loads(completed.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError) as exc:
        raise EnvironmentInstallError(
            f"the new environment printed no runner description: {completed.stdout!r}"
        ) from exc
    if described["framework_version"] != version:
        raise EnvironmentInstallError(
            f"asked pip for {framework.distribution}=={version} but the environment reports "
            f"{described['framework_version']}"
        )
    from .._version import __version__

    return RunnerEnvironment(
        runner_name=framework.runner_name,
        framework_version=version,
        requirement=requirement_text,
        path=target,
        runner_compat_version=int(described["runner_compat_version"]),
        entry=str(described["entry"]),
        supported_platforms=tuple(described["supported_platforms"]),
        concurrent=bool(described["concurrent"]),
        carton_version=__version__,
        installed_at=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        distribution=installed[0],
        requirements=tuple(installed[1]),
    )


def _pip_env() -> dict[str, str]:
    # Keep pip's configuration (PIP_*: index, certificates) but not what would change which Python runs.
    return {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "PYTHONHOME")}


def _clean_env() -> dict[str, str]:
    keep = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR")
    return {key: os.environ[key] for key in keep if key in os.environ}


def _tail(lines: Iterable[str]) -> str:
    kept = list(lines)[-_PIP_TAIL_LINES:]
    return "\n".join(f"  {line}" for line in kept) or "  (no output)"


def _default_progress() -> Progress:
    if sys.stderr.isatty():
        return lambda line: print(line, file=sys.stderr, flush=True)
    return lambda line: None
