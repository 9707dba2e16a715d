"""What `carton.pack` asks of the runtime: run the runner's ``pack`` in a runner process, and serialize in-memory
model objects through the ``carton_serialize_model`` hook."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from carton_protocol import OptValue, PackResult, RunnerSpec, TensorSpec

from ..errors import CartonError, InvalidVersionReq, PackError, RunnerFailed
from ._plugins import plugin_manager
from ._process import RunnerProcess
from ._resolve import RunnerRequest, resolve_runner

__all__ = ["DEFAULT_PACK_TIMEOUT", "PackOutcome", "pack_in_runner", "serialize_model"]

#: Default limit for a runner to validate and describe a model folder.
DEFAULT_PACK_TIMEOUT = 600.0


@dataclass(frozen=True, slots=True, kw_only=True)
class PackOutcome:
    """What packing in a runner produced: the runner's `PackResult` and the runner that produced it."""

    result: PackResult
    runner: RunnerSpec


def pack_in_runner(
    *,
    runner_name: str,
    required_framework_version: str,
    model_dir: Path,
    opts: Mapping[str, OptValue] | None = None,
    inputs: Sequence[TensorSpec] = (),
    outputs: Sequence[TensorSpec] = (),
    runner_compat_version: int | None = None,
    required_platforms: Sequence[str] = (),
    timeout: float | None = DEFAULT_PACK_TIMEOUT,
) -> PackOutcome:
    """Resolve the runner, start it, run its ``pack`` on ``model_dir`` and stop it.

    The runner's own failure (the model does not load, a bad option) is a `PackError` carrying its message;
    process failures keep their `RunnerError` types (`RunnerCrashed`, `RunnerTimeout`, ...).
    """
    request = RunnerRequest(
        runner_name=runner_name,
        required_framework_version=required_framework_version,
        runner_compat_version=runner_compat_version,
        required_platforms=tuple(required_platforms),
    )
    try:
        runner = resolve_runner(request)
    except InvalidVersionReq as exc:
        raise InvalidVersionReq(f"pack(required_framework_version=...): {exc}") from exc
    folder = Path(model_dir).resolve()
    process = RunnerProcess.start(runner, model_dir=folder)
    try:
        result = process.pack(
            model_dir=folder, opts=dict(opts or {}), inputs=tuple(inputs), outputs=tuple(outputs), timeout=timeout
        )
    except RunnerFailed as exc:
        raise PackError(f"runner {runner.runner_name} {runner.framework_version} refused {folder}: {exc}") from exc
    finally:
        process.close()
    return PackOutcome(result=result, runner=runner)


def serialize_model(obj: object, *, runner_name: str, model_dir: Path) -> dict[str, OptValue]:
    """Write an in-memory model object into ``model_dir`` through the first plugin that takes it.

    Returns the runner options that plugin wants recorded. Raises `PackError` when no plugin takes the object or
    the plugin fails.
    """
    manager = plugin_manager()
    try:
        opts = manager.hook.carton_serialize_model(obj=obj, runner_name=runner_name, model_dir=Path(model_dir))
    except CartonError:
        raise
    except Exception as exc:  # a plugin's serializer may raise anything; the caller gets one typed error
        raise PackError(
            f"serializing a {type(obj).__module__}.{type(obj).__qualname__} for runner {runner_name!r} failed: "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    if opts is None:
        raise PackError(
            f"no installed plugin can serialize a {type(obj).__module__}.{type(obj).__qualname__} for runner "
            f"{runner_name!r}; save the model to a folder and pack the folder instead"
        )
    if not isinstance(opts, dict) or not all(isinstance(key, str) for key in opts):
        raise PackError(
            f"the plugin that serialized a {type(obj).__qualname__} for runner {runner_name!r} returned "
            f"{type(opts).__name__}, not a dict of runner options"
        )
    return opts
