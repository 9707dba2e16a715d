"""The carton-facing interface of the mcf runner: its options, its tensors, and checks on what arrives.

Two modes (runner option ``mode``): ``logits`` (``input_ids`` [+ ``attention_mask``] -> ``logits``) and ``generate``
(``input_ids`` [+ ``attention_mask``] or a string ``prompt``, plus optional scalar sampling inputs -> ``output_ids``
and, with a tokenizer, ``text``). Sampling inputs default to the runner options of the same name.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import numpy as np
from carton_protocol import DType, InvalidInput, InvalidOption, OptValue, Tensor, TensorSpec
from numpy.typing import NDArray

from ._kernels import CacheMode, compiled_available

__all__ = [
    "INPUT_DTYPES",
    "OUTPUT_DTYPES",
    "WEIGHT_CACHES",
    "Mode",
    "RunnerOptions",
    "check_declared_mode",
    "check_positions",
    "check_room_for_a_prompt",
    "default_specs",
    "ids_and_mask",
    "parse_options",
    "scalar_float",
    "scalar_int",
]


#: Values of the ``weight_cache`` option, passed to `_kernels.QuantizedLinear` as its ``cache``: keep only the
#: packed payload, int8 codes + fp32 scales, or the dequantized fp32 matrix; ``auto`` is packed with the compiled
#: kernels and int8 without them.
WEIGHT_CACHES = ("auto", "packed", "int8", "fp32")


class Mode(enum.StrEnum):
    LOGITS = "logits"
    GENERATE = "generate"


#: Every input the runner understands, per mode, with the dtype it is declared with.
INPUT_DTYPES: dict[Mode, dict[str, DType]] = {
    Mode.LOGITS: {"input_ids": DType.INT64, "attention_mask": DType.INT64},
    Mode.GENERATE: {
        "input_ids": DType.INT64,
        "attention_mask": DType.INT64,
        "prompt": DType.STRING,
        "max_new_tokens": DType.INT64,
        "temperature": DType.FLOAT32,
        "top_k": DType.INT64,
        "top_p": DType.FLOAT32,
        "seed": DType.INT64,
    },
}
OUTPUT_DTYPES: dict[Mode, dict[str, DType]] = {
    Mode.LOGITS: {"logits": DType.FLOAT32},
    Mode.GENERATE: {"output_ids": DType.INT64, "text": DType.STRING},
}


@dataclass(frozen=True, slots=True, kw_only=True)
class RunnerOptions:
    """Parsed runner options; ``seed = None`` means a fresh random seed per request."""

    mode: Mode = Mode.LOGITS
    model_file: str | None = None
    weight_cache: CacheMode | Literal["auto"] = "auto"
    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_at_eos: bool = True
    chat: bool = False
    processes: int = 1
    threads: int = 1


def _typed(name: str, value: OptValue, kind: type) -> OptValue:
    ok = isinstance(value, kind) and not (kind is not bool and isinstance(value, bool))
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        ok = True
    if not ok:
        raise InvalidOption(f"runner option {name!r} must be {kind.__name__}, got {value!r}", option=name)
    return value


def _in_range(name: str, value: object) -> None:
    """Refuse values the request path would refuse on every call: better at load than at the first request."""
    if name in ("processes", "threads") and isinstance(value, int) and value < 1:
        raise InvalidOption(f"runner option {name!r} must be >= 1, got {value!r}", option=name)
    if name in ("max_new_tokens", "top_k", "seed") and isinstance(value, int) and value < 0:
        raise InvalidOption(f"runner option {name!r} must be >= 0, got {value!r}", option=name)
    if name == "temperature" and isinstance(value, float) and not (math.isfinite(value) and value >= 0):
        raise InvalidOption(f"runner option 'temperature' must be a finite number >= 0, got {value!r}", option=name)
    if name == "top_p" and isinstance(value, float) and not 0.0 < value <= 1.0:
        raise InvalidOption(f"runner option 'top_p' must be in (0, 1], got {value!r}", option=name)


def parse_options(opts: Mapping[str, OptValue]) -> tuple[RunnerOptions, list[str]]:
    """Parse and check known options (a wrong type or value is an `InvalidOption` naming the option); returns the
    unknown names too."""
    known: dict[str, object] = {}
    unknown = []
    for name, value in opts.items():
        if name == "mode":
            if value not in tuple(Mode):
                raise InvalidOption(f"runner option 'mode' must be 'logits' or 'generate', got {value!r}", option=name)
            known[name] = Mode(value)
        elif name == "weight_cache":
            if value not in WEIGHT_CACHES:
                choices = ", ".join(WEIGHT_CACHES)
                raise InvalidOption(
                    f"runner option 'weight_cache' must be one of {choices}, got {value!r}", option=name
                )
            known[name] = value
        elif name == "model_file":
            known[name] = _typed(name, value, str)
        elif name in ("max_new_tokens", "top_k", "seed", "processes", "threads"):
            known[name] = _typed(name, value, int)
        elif name in ("temperature", "top_p"):
            known[name] = float(_typed(name, value, float))  # type: ignore[arg-type]
        elif name in ("stop_at_eos", "chat"):
            known[name] = _typed(name, value, bool)
        else:
            unknown.append(name)
            continue
        _in_range(name, known[name])
    options = RunnerOptions(**known)  # type: ignore[arg-type]
    if options.processes > 1 and options.weight_cache == "packed" and not compiled_available():
        raise InvalidOption(
            f"runner option processes={options.processes} needs weight_cache 'int8' or 'fp32' without the compiled "
            "kernels (numba): the numpy 'packed' path cannot multiply part of a matrix",
            option="processes",
        )
    return options, unknown


def check_declared_mode(mode: Mode, inputs: tuple[TensorSpec, ...], outputs: tuple[TensorSpec, ...]) -> None:
    """At load: the carton's declared tensors were chosen for the mode it was packed with. A load-time ``mode``
    override that disagrees would fail only at the first request ("did not return output 'logits'"): refuse it now,
    saying where the mode is chosen."""
    names = {spec.name for spec in inputs} | {spec.name for spec in outputs}

    def serves(candidate: Mode) -> bool:
        return {spec.name for spec in inputs} <= set(INPUT_DTYPES[candidate]) and {
            spec.name for spec in outputs
        } <= set(OUTPUT_DTYPES[candidate])

    if not names or serves(mode):
        return
    packed = next((candidate for candidate in Mode if serves(candidate)), None)
    declared = ", ".join(sorted(spec.name for spec in outputs)) or "none"
    packed_text = f"packed in {packed.value!r} mode" if packed is not None else "packed for another interface"
    raise InvalidOption(
        f"runner option mode = {mode.value!r} does not match this carton, which was {packed_text} (its outputs: "
        f"{declared}): the mode is chosen at pack time, with the interface it declares; pack the model again with "
        f"mode = {mode.value!r} to serve it that way",
        option="mode",
    )


def check_room_for_a_prompt(options: RunnerOptions, max_positions: int) -> None:
    """In generate mode, ``max_new_tokens`` must leave at least one position of the context for the prompt."""
    if options.mode is Mode.GENERATE and options.max_new_tokens >= max_positions:
        raise InvalidOption(
            f"runner option 'max_new_tokens' = {options.max_new_tokens} leaves no room for a prompt within "
            f"config.json's max_position_embeddings ({max_positions})",
            option="max_new_tokens",
        )


def check_positions(seq: int, max_new_tokens: int | None, max_positions: int, source: str) -> None:
    """Refuse a request longer than the model's context before any work (a 9000-token request to an 8192-position
    model would otherwise run for minutes and return gigabytes of logits)."""
    if max_new_tokens is None:
        if seq > max_positions:
            raise InvalidInput(
                f"input {source!r} has {seq} positions, more than config.json's max_position_embeddings "
                f"({max_positions})",
                tensor=source,
            )
    elif seq + max_new_tokens > max_positions:
        raise InvalidInput(
            f"input {source!r}: {seq} prompt positions + max_new_tokens {max_new_tokens} = {seq + max_new_tokens} "
            f"is more than config.json's max_position_embeddings ({max_positions})",
            tensor=source,
        )


def default_specs(mode: Mode, *, vocab_size: int, has_tokenizer: bool) -> tuple[tuple[TensorSpec, ...], ...]:
    """The interface `pack` declares when the caller gives none."""
    if mode is Mode.LOGITS:
        return (
            (TensorSpec(name="input_ids", dtype=DType.INT64, shape=("batch", "seq")),),
            (TensorSpec(name="logits", dtype=DType.FLOAT32, shape=("batch", "seq", vocab_size)),),
        )
    if has_tokenizer:
        return (
            (TensorSpec(name="prompt", dtype=DType.STRING, shape=("batch",)),),
            (TensorSpec(name="text", dtype=DType.STRING, shape=("batch",)),),
        )
    return (
        (TensorSpec(name="input_ids", dtype=DType.INT64, shape=("batch", "seq")),),
        (TensorSpec(name="output_ids", dtype=DType.INT64, shape=("batch", "new")),),
    )


def _one_number(inputs: Mapping[str, Tensor], name: str) -> np.generic | None:
    if name not in inputs:
        return None
    value = inputs[name]
    if isinstance(value, list) or value.size != 1 or value.dtype.kind not in "iuf":
        raise InvalidInput(f"input {name!r} must be a single number", tensor=name)
    item: np.generic = value.reshape(-1)[0]
    return item


def scalar_int(inputs: Mapping[str, Tensor], name: str, default: int | None) -> int | None:
    """A one-element integer input (shape ``()`` or ``[1]``), or ``default`` when absent."""
    item = _one_number(inputs, name)
    if item is None:
        return default
    if not float(item).is_integer():
        raise InvalidInput(f"input {name!r} must be an integer, got {item}", tensor=name)
    return int(item)


def scalar_float(inputs: Mapping[str, Tensor], name: str, default: float) -> float:
    """A one-element float input (shape ``()`` or ``[1]``), or ``default`` when absent."""
    item = _one_number(inputs, name)
    return default if item is None else float(item)


def ids_and_mask(inputs: Mapping[str, Tensor], vocab_size: int) -> tuple[NDArray[np.int64], NDArray[np.bool_]]:
    """``input_ids`` as int64 ``[batch, seq]`` and ``attention_mask`` as bool (all true when absent), checked."""
    ids = inputs.get("input_ids")
    if ids is None:
        raise InvalidInput("input 'input_ids' is missing", tensor="input_ids")
    if isinstance(ids, list) or ids.dtype.kind not in "iu" or ids.ndim != 2:
        kind = "a nested tensor" if isinstance(ids, list) else f"{ids.dtype} {list(ids.shape)}"
        raise InvalidInput(f"input 'input_ids' must be an integer tensor [batch, seq], got {kind}", tensor="input_ids")
    if ids.shape[0] == 0 or ids.shape[1] == 0:
        raise InvalidInput(f"input 'input_ids' must not be empty, got shape {list(ids.shape)}", tensor="input_ids")
    bad = (ids < 0) | (ids >= vocab_size)
    if bad.any():
        row, col = (int(i) for i in np.argwhere(bad)[0])
        raise InvalidInput(
            f"input 'input_ids'[{row}, {col}] = {int(ids[row, col])} is outside the vocabulary [0, {vocab_size})",
            tensor="input_ids",
        )
    mask_in = inputs.get("attention_mask")
    if mask_in is None:
        return ids.astype(np.int64, copy=False), np.ones(ids.shape, dtype=bool)
    if isinstance(mask_in, list) or mask_in.shape != ids.shape or mask_in.dtype.kind not in "iub":
        got = "a nested tensor" if isinstance(mask_in, list) else f"{mask_in.dtype} {list(mask_in.shape)}"
        raise InvalidInput(
            f"input 'attention_mask' must be 0/1 integers shaped like input_ids, got {got}", tensor="attention_mask"
        )
    if not np.isin(mask_in, (0, 1)).all():
        raise InvalidInput("input 'attention_mask' may only hold 0 and 1", tensor="attention_mask")
    mask = mask_in.astype(bool)
    empty = np.flatnonzero(~mask.any(axis=1))
    if empty.size:
        raise InvalidInput(f"input 'attention_mask' row {int(empty[0])} masks every token", tensor="attention_mask")
    return ids.astype(np.int64, copy=False), mask
