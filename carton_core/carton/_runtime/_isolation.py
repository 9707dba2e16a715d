"""The sandbox policy and resource limits `carton.load` accepts.

The wrapper that enforces them is the sandbox layer's (`carton._sandbox.launch_wrapper`), which the load workflow
(`carton._workflows`) calls with what `sandbox_policy` and `check_limits` accepted: the runtime only ever sees the
resulting ``wrap(plan) -> plan`` (`LoadSettings.wrap`). The per-request wall-time limit needs no sandbox: it is
the default timeout of every `Model.infer` call (`LoadSettings.request_timeout`).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from ..errors import SandboxConfigError

__all__ = ["RunnerLimits", "SandboxPolicy", "check_limits", "sandbox_policy"]


class SandboxPolicy(enum.StrEnum):
    """How a model's runner processes are isolated (docs/sandbox.md describes the layers)."""

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


def sandbox_policy(value: SandboxPolicy | str | None) -> SandboxPolicy:
    """The policy `value` names (``None``: ``none``); `SandboxConfigError` listing the policies otherwise."""
    if value is None:
        return SandboxPolicy.NONE
    try:
        return SandboxPolicy(value)
    except ValueError:
        choices = ", ".join(repr(p.value) for p in SandboxPolicy)
        raise SandboxConfigError(f"unknown sandbox policy {value!r} (choose one of {choices})") from None


def check_limits(limits: object) -> RunnerLimits | None:
    """`limits` when it is a `RunnerLimits` (or ``None``); `TypeError` otherwise."""
    if limits is not None and not isinstance(limits, RunnerLimits):
        raise TypeError(f"limits must be a carton.RunnerLimits, got {type(limits).__name__}")
    return limits
