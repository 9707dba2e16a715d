"""The ``[runner.opts]`` the onnxruntime runner understands, checked before anything is loaded.

Unknown opts are reported through ``warn`` (the spec asks runners to warn, not to stay silent); known opts of the
wrong type or value raise `InvalidRunnerOption` naming the opt.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TypeVar

from carton_protocol import OptValue

from ._errors import InvalidRunnerOption

__all__ = ["KNOWN_OPTIONS", "GraphOptimization", "OnnxOptions", "Spinning", "parse_options"]

_Choice = TypeVar("_Choice", bound=enum.StrEnum)


class GraphOptimization(enum.StrEnum):
    """Values of the ``graph_optimization_level`` opt (onnxruntime's `GraphOptimizationLevel`, lower-cased)."""

    DISABLE = "disable"
    BASIC = "basic"
    EXTENDED = "extended"
    LAYOUT = "layout"
    ALL = "all"


class Spinning(enum.StrEnum):
    """Values of the ``intra_op_spinning`` opt: when onnxruntime's pool threads spin waiting for work."""

    RUN = "run"  # during a run; they block once the last concurrent run returns (`session.force_spinning_stop`)
    ALWAYS = "always"  # during and after runs (onnxruntime's own default)
    NEVER = "never"  # never: they block whenever they have no work (`session.intra_op.allow_spinning = 0`)


@dataclass(frozen=True, slots=True, kw_only=True)
class OnnxOptions:
    """Parsed runner opts; ``None`` leaves onnxruntime's default in place."""

    model_file: str | None = None
    intra_op_threads: int | None = None
    inter_op_threads: int | None = None
    graph_optimization_level: GraphOptimization | None = None
    execution_providers: tuple[str, ...] = ()
    # onnxruntime's default: stopping the spin when a run ends saves CPU between requests but makes a multi-op
    # model's next run wake its pool threads, which costs latency when requests come close together
    # (docs/performance.md has the measurements).
    intra_op_spinning: Spinning = Spinning.ALWAYS


KNOWN_OPTIONS = (
    "execution_providers",
    "graph_optimization_level",
    "inter_op_threads",
    "intra_op_spinning",
    "intra_op_threads",
    "model_file",
)


def parse_options(opts: Mapping[str, OptValue], warn: Callable[[str], None]) -> OnnxOptions:
    """Check ``opts`` and return them typed; warn once, naming every opt this runner does not know."""
    unknown = sorted(set(opts) - set(KNOWN_OPTIONS))
    if unknown:
        names = ", ".join(repr(name) for name in unknown)
        warn(f"onnxruntime runner: ignoring unknown runner opts {names} (known: {', '.join(KNOWN_OPTIONS)})")
    level = _optional_choice(opts, "graph_optimization_level", GraphOptimization)
    spinning = _optional_choice(opts, "intra_op_spinning", Spinning)
    return OnnxOptions(
        model_file=_optional_str(opts, "model_file"),
        intra_op_threads=_optional_thread_count(opts, "intra_op_threads"),
        inter_op_threads=_optional_thread_count(opts, "inter_op_threads"),
        graph_optimization_level=level,
        execution_providers=_providers(opts.get("execution_providers")),
        intra_op_spinning=Spinning.ALWAYS if spinning is None else spinning,
    )


def _optional_choice(opts: Mapping[str, OptValue], name: str, choices: type[_Choice]) -> _Choice | None:
    value = opts.get(name)
    if value is None:
        return None
    if not isinstance(value, str) or value not in set(choices):
        allowed = ", ".join(repr(choice.value) for choice in choices)
        raise InvalidRunnerOption(f"runner opt {name!r} must be one of {allowed}, got {value!r}")
    return choices(value)


def _optional_str(opts: Mapping[str, OptValue], name: str) -> str | None:
    value = opts.get(name)
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise InvalidRunnerOption(f"runner opt {name!r} must be a non-empty string, got {value!r}")
    return value


def _optional_thread_count(opts: Mapping[str, OptValue], name: str) -> int | None:
    value = opts.get(name)
    if value is None:
        return None
    # bool is an int subclass: `intra_op_threads = true` is a mistake, not one thread.
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidRunnerOption(
            f"runner opt {name!r} must be an integer >= 0 (0: onnxruntime decides), got {value!r}"
        )
    return value


def _providers(value: OptValue | None) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(item, str) and item for item in value):
        raise InvalidRunnerOption(
            f"runner opt 'execution_providers' must be a list of provider names such as "
            f"['CUDAExecutionProvider', 'CPUExecutionProvider'], got {value!r}"
        )
    return tuple(str(item) for item in value)
