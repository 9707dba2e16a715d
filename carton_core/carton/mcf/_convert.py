"""Convert a Hugging Face model folder (safetensors weights + config.json + tokenizer files) into one MCF file.

Each weight is sorted into a class by its name (embeddings, attention, MLP, head, norms, other) and quantized with
the method chosen for its class; norms, biases and anything not rank 2 stay float. Tensors stream one at a time from
the memory-mapped safetensors files into the writer, so peak memory is about one tensor, not the model.
"""

from __future__ import annotations

import enum
import json
import os
import re
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from ..errors import MCFError
from ..safetensors import SafeOpen, safe_open
from ._container import RESOURCE_FILES
from ._modelinfo import KVValue, ModelInfo
from ._quant import QuantMode, quantize
from ._types import Architecture, QuantMethod, RopeType
from ._writer import MCFWriter

__all__ = ["ConvertReport", "TensorClass", "classify_tensor", "convert", "model_info_from_config"]


class TensorClass(enum.StrEnum):
    """What a weight does in a decoder, decided from its Hugging Face name."""

    EMBEDDINGS = "embeddings"
    ATTENTION = "attention"
    MLP = "mlp"
    HEAD = "head"
    NORMS = "norms"
    OTHER = "other"


_PATTERNS: list[tuple[TensorClass, re.Pattern[str]]] = [
    (TensorClass.NORMS, re.compile(r"(^|[._])(\w*norm\w*|ln_\w+|ln_f)([._]|$)")),
    (
        TensorClass.EMBEDDINGS,
        re.compile(r"(embed_tokens|word_embeddings|tok_embeddings|(^|\.)wte|(^|\.)embeddings?)\."),
    ),
    (TensorClass.HEAD, re.compile(r"(^|\.)(lm_head|output|embed_out)\.weight$")),
    (TensorClass.ATTENTION, re.compile(r"(self_attn|attention|attn)\.")),
    (TensorClass.MLP, re.compile(r"(mlp|feed_forward|ffn)\.")),
]

_ARCHITECTURES = {
    "llama": Architecture.LLAMA,
    "mistral": Architecture.MISTRAL,
    "qwen2": Architecture.QWEN,
    "qwen3": Architecture.QWEN,
    "gemma": Architecture.GEMMA,
    "gemma2": Architecture.GEMMA,
    "gemma3_text": Architecture.GEMMA,
    "granite": Architecture.GRANITE,
    "smollm3": Architecture.SMOLLM3,
}
_ROPE_TYPES = {"default": RopeType.STANDARD, "linear": RopeType.LINEAR, "yarn": RopeType.YARN}
_FLOAT_DTYPES = {"f32": np.dtype("<f4"), "f16": np.dtype("<f2"), "bf16": np.dtype(ml_dtypes.bfloat16)}
_MCF_NATIVE = {np.dtype(t) for t in ("<f4", "<f2", "<f8", "i1", "u1", "<i2", "<u2", "<i4", "<u4", "<i8", "<u8")} | {
    np.dtype(ml_dtypes.bfloat16)
}

_ML_FLOATS = {
    np.dtype(t)
    for t in (
        ml_dtypes.bfloat16,
        ml_dtypes.float8_e4m3fn,
        ml_dtypes.float8_e5m2,
        ml_dtypes.float8_e8m0fnu,
        ml_dtypes.float8_e4m3fnuz,
        ml_dtypes.float8_e5m2fnuz,
        ml_dtypes.float4_e2m1fn,
        ml_dtypes.float6_e2m3fn,
        ml_dtypes.float6_e3m2fn,
    )
}


def classify_tensor(name: str) -> TensorClass:
    """The class of a weight from its name, e.g. ``model.layers.3.mlp.up_proj.weight`` is `TensorClass.MLP`."""
    for tensor_class, pattern in _PATTERNS:
        if pattern.search(name):
            return tensor_class
    return TensorClass.OTHER


@dataclass(frozen=True, slots=True, kw_only=True)
class ConvertReport:
    """What `convert` wrote: counts per class and method, bytes in and out, and the wall time."""

    path: Path
    tensors: int
    methods: Mapping[str, int]
    classes: Mapping[str, int]
    source_bytes: int
    output_bytes: int
    resources: tuple[str, ...]
    seconds: float
    tensor_methods: Mapping[str, str] = field(default_factory=dict)


def convert(
    src: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    methods: Mapping[TensorClass | str, QuantMethod | str | None] | None = None,
    float_dtype: str = "keep",
    mode: QuantMode = "best",
    dedup: bool = True,
    progress: Callable[[str], None] | None = None,
) -> ConvertReport:
    """Convert the model folder ``src`` (or a single ``.safetensors`` file) into the MCF file ``out``.

    ``methods`` maps a tensor class (``"embeddings"``, ``"attention"``, ``"mlp"``, ``"head"``, ``"other"``) to a
    quantization method or None (keep float); norms always stay float. ``float_dtype`` (``keep``, ``f32``, ``f16``,
    ``bf16``) is the storage type of float tensors that are not quantized. Raises `MCFError` (or `SafetensorsError` for
    a malformed weights file) naming the tensor or file at fault; ``out`` is only replaced once complete.
    """
    started = time.perf_counter()
    src = Path(src)
    chosen = _check_methods(methods or {})
    if float_dtype != "keep" and float_dtype not in _FLOAT_DTYPES:
        raise MCFError(f"float dtype {float_dtype!r} is not one of keep, {', '.join(_FLOAT_DTYPES)}")
    folder = src if src.is_dir() else src.parent
    files = _weight_files(src)
    config = _read_config(folder)
    info = (
        model_info_from_config(config, default_name=folder.name)
        if config is not None
        else ModelInfo(model_name=folder.name)
    )
    method_counts: dict[str, int] = {}
    class_counts: dict[str, int] = {}
    per_tensor: dict[str, str] = {}
    source_bytes = 0
    resources = []
    with ExitStack() as stack:
        handles = [stack.enter_context(safe_open(path)) for path in files]
        writer = stack.enter_context(MCFWriter(out, model_info=info, dedup=dedup))
        for name, handle in _tensors_by_name(handles):
            array = handle.get_tensor(name)
            source_bytes += array.nbytes
            tensor_class = classify_tensor(name)
            method = chosen.get(tensor_class) if array.ndim == 2 and array.size else None
            if method is not None:
                _check_quantizable(name, array, method)
                try:
                    writer.add_quantized(name, quantize(array, method, mode=mode))
                except MCFError as exc:
                    raise MCFError(f"tensor {name!r} ({tensor_class.value}): {exc}") from exc
                label = method.value
            else:
                stored = _float_storage(name, array, float_dtype)
                writer.add_tensor(name, stored)
                label = _dtype_label(stored.dtype)
            method_counts[label] = method_counts.get(label, 0) + 1
            class_counts[tensor_class.value] = class_counts.get(tensor_class.value, 0) + 1
            per_tensor[name] = label
            if progress is not None:
                progress(f"{name}: {tensor_class.value}, {list(array.shape)} {_dtype_label(array.dtype)} -> {label}")
        for section, filename in RESOURCE_FILES.items():
            path = folder / filename
            if src.is_dir() and path.is_file():
                writer.add_resource(section, path.read_bytes())
                resources.append(filename)
    out_path = Path(out)
    return ConvertReport(
        path=out_path,
        tensors=len(per_tensor),
        methods=method_counts,
        classes=class_counts,
        source_bytes=source_bytes,
        output_bytes=out_path.stat().st_size,
        resources=tuple(resources),
        seconds=time.perf_counter() - started,
        tensor_methods=per_tensor,
    )


def _check_methods(methods: Mapping[TensorClass | str, QuantMethod | str | None]) -> dict[TensorClass, QuantMethod]:
    chosen: dict[TensorClass, QuantMethod] = {}
    for key, method in methods.items():
        try:
            tensor_class = TensorClass(key)
        except ValueError:
            raise MCFError(f"unknown tensor class {key!r} (one of {', '.join(c.value for c in TensorClass)})") from None
        if method is None or method in ("none", "float", "keep"):
            continue
        if tensor_class == TensorClass.NORMS:
            raise MCFError("norm weights always stay float; they cannot be quantized")
        try:
            chosen[tensor_class] = QuantMethod(method)
        except ValueError:
            raise MCFError(
                f"unknown method {method!r} for {tensor_class.value} (one of none, "
                f"{', '.join(m.value for m in QuantMethod)})"
            ) from None
    return chosen


def _weight_files(src: Path) -> list[Path]:
    if src.is_file():
        return [src]
    if not src.is_dir():
        raise MCFError(f"{src}: no such model folder or safetensors file")
    index = src / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_bytes())["weight_map"]
            names = sorted(set(weight_map.values()))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise MCFError(f"{index}: not a valid safetensors index (needs a 'weight_map' object)") from exc
        files = [src / name for name in names]
        missing = [str(p) for p in files if not p.is_file()]
        if missing:
            raise MCFError(f"{index}: lists shards that do not exist: {', '.join(missing)}")
        return files
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise MCFError(f"{src}: no .safetensors weights found")
    return files


def _tensors_by_name(handles: list[SafeOpen]) -> Iterator[tuple[str, SafeOpen]]:
    owner: dict[str, SafeOpen] = {}
    for handle in handles:
        for name in handle.offset_keys():
            if name in owner:
                raise MCFError(f"tensor {name!r} appears in both {owner[name].name} and {handle.name}")
            owner[name] = handle
    for name in sorted(owner):
        yield name, owner[name]


def _read_config(folder: Path) -> dict[str, Any] | None:
    path = folder / "config.json"
    if not path.is_file():
        return None
    try:
        config = json.loads(path.read_bytes())
    except ValueError as exc:
        raise MCFError(f"{path}: not valid JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise MCFError(f"{path}: must hold a JSON object, got {type(config).__name__}")
    return config


def _check_quantizable(name: str, array: np.ndarray[Any, Any], method: QuantMethod) -> None:
    if not _is_float(array.dtype):
        raise MCFError(f"tensor {name!r}: cannot quantize {array.dtype} data to {method.value} (floats only)")


def _float_storage(name: str, array: np.ndarray[Any, Any], float_dtype: str) -> np.ndarray[Any, Any]:
    is_float = _is_float(array.dtype)
    if is_float and float_dtype != "keep":
        return array.astype(_FLOAT_DTYPES[float_dtype])
    if array.dtype in _MCF_NATIVE or array.dtype.newbyteorder("<") in _MCF_NATIVE:
        return array
    if is_float:
        return array.astype(np.float32)  # F8/F4/F6 have no MCF dtype: widen losslessly
    if array.dtype == np.bool_:
        return array.view(np.uint8)
    raise MCFError(f"tensor {name!r}: {array.dtype} has no MCF dtype")


def _is_float(dtype: np.dtype[Any]) -> bool:
    return dtype.kind == "f" or dtype in _ML_FLOATS


def _dtype_label(dtype: np.dtype[Any]) -> str:
    names = {"float32": "f32", "float16": "f16", "bfloat16": "bf16", "float64": "f64"}
    return names.get(dtype.name, dtype.name)


# --- ModelInfo from config.json -------------------------------------------------------------------------------
def model_info_from_config(config: Mapping[str, Any], *, default_name: str = "") -> ModelInfo:
    """ModelInfo fields from a Hugging Face ``config.json`` object; anything unknown is left at 0 / absent.

    Extra facts a runtime may need are kept in ``kv`` under ``hf.*`` keys (model type, head_dim, intermediate size,
    rms_norm_eps, tie_word_embeddings, hidden_act, the rope scaling type when it has no ModelInfo code)."""
    model_type = config.get("model_type")
    arch = _ARCHITECTURES.get(model_type, Architecture.UNKNOWN) if isinstance(model_type, str) else Architecture.UNKNOWN
    # transformers 4 writes rope_theta + rope_scaling; transformers 5 folds both into rope_parameters.
    scaling: dict[str, Any] = {}
    for key in ("rope_scaling", "rope_parameters"):
        if isinstance(config.get(key), Mapping):
            scaling.update(config[key])
    kv: dict[str, KVValue] = {"hf.config_json_present": 1}
    if isinstance(model_type, str):
        kv["hf.model_type"] = model_type
    theta = config.get("rope_theta", scaling.get("rope_theta"))
    has_rope = theta is not None or arch != Architecture.UNKNOWN
    rope_type = RopeType.STANDARD if has_rope else RopeType.NONE
    rope_scale = 1.0
    train_context = _u32(config.get("max_position_embeddings"))
    kind = scaling.get("rope_type", scaling.get("type"))
    if isinstance(kind, str):
        rope_type = _ROPE_TYPES.get(kind, RopeType.STANDARD)
        if kind not in _ROPE_TYPES:
            kv["hf.rope_scaling.type"] = kind
    factor = scaling.get("factor")
    if isinstance(factor, int | float) and not isinstance(factor, bool):
        rope_scale = float(factor)
    train_context = _u32(scaling.get("original_max_position_embeddings")) or train_context
    if theta is None:
        theta = 10000.0 if has_rope else 0.0
    for key, kind in (
        ("head_dim", "u32"),
        ("intermediate_size", "u32"),
        ("rms_norm_eps", "f32"),
        ("tie_word_embeddings", "bool"),
        ("hidden_act", "str"),
        ("bos_token_id", "u32"),
        ("eos_token_id", "u32"),
        ("torch_dtype", "str"),
        ("dtype", "str"),
    ):
        value = config.get(key)
        if kind == "u32" and _u32(value):
            kv[f"hf.{key}"] = _u32(value)
        elif kind == "f32" and isinstance(value, int | float) and not isinstance(value, bool):
            kv[f"hf.{key}"] = float(value)
        elif kind == "bool" and isinstance(value, bool):
            kv[f"hf.{key}"] = int(value)
        elif kind == "str" and isinstance(value, str) and value:
            kv[f"hf.{key}"] = value
    name = config.get("_name_or_path")
    return ModelInfo(
        arch=arch,
        vocab_size=_u32(config.get("vocab_size")),
        hidden_size=_u32(config.get("hidden_size")),
        layer_count=_u32(config.get("num_hidden_layers")),
        head_count=_u32(config.get("num_attention_heads")),
        kv_head_count=_u32(config.get("num_key_value_heads", config.get("num_attention_heads"))),
        context_length=_u32(config.get("max_position_embeddings")),
        train_context=train_context,
        rope_type=rope_type,
        rope_freq_base=float(theta) if isinstance(theta, int | float) and not isinstance(theta, bool) else 0.0,
        rope_scale=rope_scale,
        model_name=name if isinstance(name, str) and name else default_name,
        kv=kv,
    )


def _u32(value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 0xFFFF_FFFF:
        return value
    return 0
