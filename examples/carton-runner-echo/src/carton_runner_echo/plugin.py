"""The entry point module (``carton`` group): tells carton which runners this distribution ships."""

from __future__ import annotations

from carton_protocol import RunnerSpec, hookimpl

__all__ = ["FRAMEWORK_VERSION", "carton_runners"]

#: The echo runner has no framework; its "framework version" is this package's version, so models can pin it.
FRAMEWORK_VERSION = "1.0.0"


@hookimpl
def carton_runners() -> list[RunnerSpec]:
    """Called at discovery; cheap and import-free, as the hook requires."""
    return [
        RunnerSpec(
            runner_name="echo",
            framework_version=FRAMEWORK_VERSION,
            runner_compat_version=1,
            entry="carton_runner_echo.runner:EchoRunner",
            concurrent=True,
        )
    ]
