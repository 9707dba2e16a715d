"""What the server needs of a loaded model (a "model handle") and the default loader built on `carton.load`.

The protocol layers depend only on `ModelHandle`, so the repository can be given another loader (for instance one
that adds options); `load_carton` is the one `carton serve` uses.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from carton_protocol import Tensor, TensorSpec

__all__ = ["LendingInfer", "LoadSpec", "ModelHandle", "ModelLoader", "load_carton", "metadata_shape"]


#: A handle's optional ``infer_lent`` (`_CartonHandle` has it): `infer` whose large outputs may be lent views of the
#: runner's memory, with what gives them back (None when nothing is lent; see `carton.Model.infer_async_lent`).
LendingInfer = Callable[
    [dict[str, np.ndarray]], Coroutine[Any, Any, tuple[Mapping[str, Tensor], Callable[[], None] | None]]
]


class ModelHandle(Protocol):
    """A loaded model: its declared tensors, an async `infer`, and `close` (and, optionally, `LendingInfer` as
    ``infer_lent``)."""

    @property
    def inputs(self) -> tuple[TensorSpec, ...]:
        """The declared inputs."""
        ...

    @property
    def outputs(self) -> tuple[TensorSpec, ...]:
        """The declared outputs."""
        ...

    async def infer(self, inputs: dict[str, np.ndarray]) -> Mapping[str, Tensor]:
        """Run one inference without blocking the event loop."""
        ...

    def close(self) -> None:
        """Stop the model's runner processes."""
        ...


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadSpec:
    """How to load one model version: the carton (file or unpacked folder) and the runtime options."""

    #: A packed carton, an unpacked carton folder, or the http(s) URL of a packed carton.
    path: Path | str
    workers: int = 1
    sandbox: str | None = None
    runner_opts: Mapping[str, str] = field(default_factory=dict)


#: Loads a model; blocking (the repository calls it in a worker thread, under its load timeout).
ModelLoader = Callable[[LoadSpec], ModelHandle]


class _CartonHandle:
    __slots__ = ("_model", "infer", "infer_lent")

    def __init__(self, model: Any) -> None:
        self._model = model
        # Off the event loop (the runtime's worker thread waits on the runner): calling the blocking `Model.infer`
        # on the loop measured about 70 us less CPU per request, but one slow or hung model would then stall every
        # connection, health probes included. See docs/server.md, "Where the time goes".
        # `Model.infer_async`'s body itself, bound: a call of the handle's `infer` is a call of it, with no frame (nor
        # the coroutine `infer_async` awaits it in) between.
        self.infer: Callable[[dict[str, np.ndarray]], Coroutine[Any, Any, Mapping[str, Tensor]]] = model._infer_async
        self.infer_lent: LendingInfer = model.infer_async_lent

    @property
    def inputs(self) -> tuple[TensorSpec, ...]:
        return tuple(self._model.info.inputs)

    @property
    def outputs(self) -> tuple[TensorSpec, ...]:
        return tuple(self._model.info.outputs)

    def close(self) -> None:
        self._model.close()


def load_carton(spec: LoadSpec, *, limits: Any = None) -> ModelHandle:
    """Load with `carton.load` (imported here: the runtime is a peer module, not a dependency of the protocol code).

    `limits` (a `carton.RunnerLimits`, from ``carton serve``'s limit flags) applies to every model."""
    from .._workflows import load

    options: dict[str, Any] = {"workers": spec.workers}
    if limits is not None:
        options["limits"] = limits
    if spec.sandbox is not None:
        options["sandbox"] = spec.sandbox
    if spec.runner_opts:
        options["runner_opts"] = dict(spec.runner_opts)
    return _CartonHandle(load(spec.path, **options))


def metadata_shape(spec: TensorSpec) -> list[int]:
    """A declared shape as KServe metadata reports it: symbols and ``"*"`` dimensions as -1; unknown rank as [-1]."""
    if isinstance(spec.shape, str):
        return [-1]
    return [dim if isinstance(dim, int) else -1 for dim in spec.shape]
