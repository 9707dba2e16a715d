"""The sandbox policy and resource limits `carton.load` accepts, and how they become a launch-plan wrapper.

The wrapper itself is the sandbox layer's job (``carton._sandbox``): when that module provides
``launch_wrapper(policy, limits, *, model_dir) -> Callable[[LaunchPlan], LaunchPlan] | None`` it is used for every
runner process a model starts. Without it, the ``none`` policy runs runners unwrapped and any other policy, or a
limit that needs the sandbox (memory, CPU time, processes), raises `SandboxUnavailable`. The per-request wall-time
limit needs no sandbox: it is the default timeout of every `Model.infer` call.
"""

from __future__ import annotations

import enum
import importlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..errors import SandboxConfigError, SandboxUnavailable
from ._launch import LaunchPlan

__all__ = ["RunnerLimits", "SandboxPolicy", "launch_wrapper"]

LaunchWrapper = Callable[[LaunchPlan], LaunchPlan]


class SandboxPolicy(enum.StrEnum):
    """How a model's runner processes are isolated (issue 8 describes the layers)."""

    NONE = "none"
    BEST_EFFORT = "best_effort"
    STRICT = "strict"


@dataclass(frozen=True, slots=True, kw_only=True)
class RunnerLimits:
    """Per-model limits; ``None`` means unlimited. Exceeding one is `RunnerMemoryLimit`, `RunnerCPULimit`,
    `RunnerTimeout` or `RunnerCrashed`, naming the limit. A value that is not a positive number is
    `SandboxConfigError` (a `ValueError`)."""

    memory_bytes: int | None = None
    cpu_seconds: float | None = None
    request_seconds: float | None = None
    processes: int | None = None
    open_files: int | None = None
    file_size_bytes: int | None = None

    def __post_init__(self) -> None:
        for name in ("memory_bytes", "cpu_seconds", "request_seconds", "processes", "open_files", "file_size_bytes"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
                raise SandboxConfigError(f"RunnerLimits.{name} must be a positive number or None, got {value!r}")

    def needs_sandbox(self) -> tuple[str, ...]:
        """The limits that only the sandbox layer can enforce."""
        return tuple(
            name
            for name in ("memory_bytes", "cpu_seconds", "processes", "open_files", "file_size_bytes")
            if getattr(self, name) is not None
        )


def _policy(value: SandboxPolicy | str | None) -> SandboxPolicy:
    if value is None:
        return SandboxPolicy.NONE
    try:
        return SandboxPolicy(value)
    except ValueError:
        choices = ", ".join(repr(p.value) for p in SandboxPolicy)
        raise SandboxConfigError(f"unknown sandbox policy {value!r} (choose one of {choices})") from None


def launch_wrapper(
    sandbox: SandboxPolicy | str | None, limits: RunnerLimits | None, *, model_dir: Path
) -> LaunchWrapper | None:
    """The ``wrap=`` for `RunnerProcess.start` under ``sandbox`` and ``limits`` (``None``: start unwrapped)."""
    policy = _policy(sandbox)
    if limits is not None and not isinstance(limits, RunnerLimits):
        raise TypeError(f"limits must be a carton.RunnerLimits, got {type(limits).__name__}")
    needs = limits.needs_sandbox() if limits is not None else ()
    try:
        sandbox_module = importlib.import_module("carton._sandbox")
    except ImportError:
        sandbox_module = None
    provider = getattr(sandbox_module, "launch_wrapper", None)
    if callable(provider):
        wrapper: LaunchWrapper | None = provider(policy, limits, model_dir=model_dir)
        return wrapper
    if policy is not SandboxPolicy.NONE:
        raise SandboxUnavailable(
            f"sandbox policy {policy.value!r} needs the sandbox layer (carton._sandbox), which this build does not "
            "have; use sandbox='none' to run the model unsandboxed"
        )
    if needs:
        raise SandboxUnavailable(
            f"limits {', '.join(needs)} are enforced by the sandbox layer (carton._sandbox), which this build does "
            "not have; only request_seconds is available without it"
        )
    return None
