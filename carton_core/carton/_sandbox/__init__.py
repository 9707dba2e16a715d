"""Isolated execution of untrusted models: policies, limits, layer detection and the exec shim (docs/sandbox.md).

`carton.load(..., sandbox=..., limits=...)` calls `launch_wrapper` (from ``carton._workflows``); the wrapper rewrites
each runner's launch plan so that it is exec'd through the shim inside bubblewrap or unshare.
"""

from .._runtime._isolation import RunnerLimits, SandboxPolicy
from ._layers import Backend, Layer, LayerStatus, MachineSupport, machine_support
from ._wrap import BACKEND_ENV, SandboxSetup, launch_wrapper, plan_setup

#: The per-model limits (the same class as `carton.RunnerLimits`).
Limits = RunnerLimits

__all__ = [
    "BACKEND_ENV",
    "Backend",
    "Layer",
    "LayerStatus",
    "Limits",
    "MachineSupport",
    "RunnerLimits",
    "SandboxPolicy",
    "SandboxSetup",
    "launch_wrapper",
    "machine_support",
    "plan_setup",
]
