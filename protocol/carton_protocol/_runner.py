"""The base class every runner implements, in the spirit of httpx's one-method transports and MLServer's models.

A runner lives in its own process. The runner-side loop constructs the class with no arguments, calls `load` once,
then `infer` for every request, and `close` before the process exits. `pack` is a classmethod run (in a runner
process too) when a user packs a model for this runner: it validates the model folder and describes it.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import numpy as np

from ._spec import TensorSpec

__all__ = ["LoadContext", "OptValue", "PackContext", "PackResult", "Runner", "Tensor"]

#: A tensor on either side of `Runner.infer`: a numpy array (strings as ``str`` arrays) or, for a nested tensor,
#: a list of arrays.
Tensor = np.ndarray | list[np.ndarray]

#: A runner option value, as carton.toml's ``[runner.opts]`` can hold it.
OptValue = str | int | float | bool | list["OptValue"] | dict[str, "OptValue"]


def _ignore(message: str) -> None:
    del message


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadContext:
    """What `Runner.load` gets: the model folder (read-only), options, declared tensors, a private scratch folder.

    ``warn`` sends a warning to the host, where it is raised as a `carton.RunnerWarning`; runners use it for
    options they do not understand (the spec requires a warning, not silence).
    """

    model_dir: Path
    opts: Mapping[str, OptValue]
    inputs: tuple[TensorSpec, ...] = ()
    outputs: tuple[TensorSpec, ...] = ()
    scratch_dir: Path | None = None
    warn: Callable[[str], None] = field(default=_ignore)


@dataclass(frozen=True, slots=True, kw_only=True)
class PackContext:
    """What `Runner.pack` gets: the folder that will become the carton's ``model/`` (it may rewrite files in it)."""

    model_dir: Path
    opts: Mapping[str, OptValue]
    inputs: tuple[TensorSpec, ...] = ()
    outputs: tuple[TensorSpec, ...] = ()
    warn: Callable[[str], None] = field(default=_ignore)


@dataclass(frozen=True, slots=True, kw_only=True)
class PackResult:
    """What packing learned: tensor specs read from the model (when the caller gave none) and options to record."""

    inputs: tuple[TensorSpec, ...] = ()
    outputs: tuple[TensorSpec, ...] = ()
    opts: Mapping[str, OptValue] = field(default_factory=dict)


class Runner(abc.ABC):
    """Subclass and implement `infer`; override `load`, `close` and `pack` as needed.

    ``concurrent = True`` declares that `infer` may run on several threads at once (the loop then dispatches
    requests to a thread pool); otherwise requests are served one at a time.
    """

    concurrent: ClassVar[bool] = False

    def load(self, context: LoadContext) -> None:  # noqa: B027 - optional hook, empty by design
        """Load the model. Raise any exception to fail the load; its message reaches the host."""

    @abc.abstractmethod
    def infer(self, inputs: Mapping[str, Tensor]) -> Mapping[str, Tensor]:
        """Compute outputs from inputs, both keyed by carton tensor name."""

    def close(self) -> None:  # noqa: B027 - optional hook, empty by design
        """Release resources; called once before the process exits."""

    @classmethod
    def pack(cls, context: PackContext) -> PackResult:
        """Validate a model folder for this runner and describe it. The default accepts the folder as given."""
        return PackResult(inputs=context.inputs, outputs=context.outputs, opts=dict(context.opts))
