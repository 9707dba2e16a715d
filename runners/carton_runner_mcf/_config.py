"""The decoder's hyper-parameters, read from the HF ``config.json`` section and checked against ModelInfo.

Behaviour is gated on explicit keys (MCF spec principle 4): every key that changes the computation is either
implemented here or refused by name. Keys known not to affect inference are accepted silently; any other key is
reported back (the runner turns that into a warning) so that a new upstream knob never passes unnoticed.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from carton.mcf import MCFError, UnsupportedModel

__all__ = ["DecoderConfig", "parse_config"]

#: ``model_type`` values whose decoder is exactly the llama computation (given the gates below).
_SUPPORTED_MODEL_TYPES = ("llama", "mistral")
_SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM")

#: Keys that do not change inference (training knobs, bookkeeping, token ids handled elsewhere).
_INERT_KEYS = frozenset(
    {
        "_name_or_path",
        "architectures",
        "attention_dropout",
        "auto_map",
        "bos_token_id",
        "dtype",
        "eos_token_id",
        "initializer_range",
        "is_llama_config",
        "model_type",
        "output_attentions",
        "output_hidden_states",
        "pad_token_id",
        "pretraining_tp",  # a tensor-parallel split of the same matmuls; the result is identical
        "return_dict",
        "torch_dtype",
        "transformers_version",
        "use_cache",
        "tie_word_embeddings",
        "max_position_embeddings",
    }
)

#: Keys the runner implements (read below).
_IMPLEMENTED_KEYS = frozenset(
    {
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "hidden_act",
        "rms_norm_eps",
        "rope_theta",
        "rope_scaling",
        "rope_parameters",
        "attention_bias",
        "mlp_bias",
        "sliding_window",
        "use_sliding_window",
    }
)

#: Keys that change the computation in ways this runner does not implement, with the value that is harmless.
_REFUSED_UNLESS = {
    "layer_types": None,
    "no_rope_layers": None,
    "attention_multiplier": None,
    "embedding_multiplier": None,
    "residual_multiplier": None,
    "logits_scaling": None,
    "final_logit_softcapping": None,
    "attn_logit_softcapping": None,
    "qk_layernorm": False,
    "use_qk_norm": False,
    "partial_rotary_factor": 1.0,
}

_SUPPORTED_ROPE_TYPES = ("default", "linear")


@dataclass(frozen=True, slots=True, kw_only=True)
class DecoderConfig:
    """What the llama computation needs. ``rope_scaling_factor`` is 1.0 unless linear scaling is configured."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling_factor: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None
    model_type: str


def _fail(source: str, message: str) -> UnsupportedModel:
    return UnsupportedModel(f"{source}: {message}")


def _int(config: Mapping[str, Any], key: str, source: str, *, default: int | None = None) -> int:
    value = config.get(key, default)
    if value is None:
        raise MCFError(f"{source}: config.json has no {key!r}")
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise MCFError(f"{source}: config.json {key!r} must be a positive integer, got {value!r}")
    return value


def _float(config: Mapping[str, Any], key: str, source: str, *, default: float) -> float:
    value = config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise MCFError(f"{source}: config.json {key!r} must be a positive number, got {value!r}")
    return float(value)


def _bool(config: Mapping[str, Any], key: str, source: str, *, default: bool) -> bool:
    value = config.get(key, default)
    if not isinstance(value, bool):
        raise MCFError(f"{source}: config.json {key!r} must be true or false, got {value!r}")
    return value


def _token_ids(value: object, key: str, source: str) -> tuple[int, ...]:
    if value is None:
        return ()
    items = value if isinstance(value, list) else [value]
    if not all(isinstance(item, int) and not isinstance(item, bool) and item >= 0 for item in items):
        raise MCFError(f"{source}: {key!r} must be a token id or a list of token ids, got {value!r}")
    return tuple(items)


def _rope_spec(params: object, key: str, source: str) -> tuple[str, float, float | None]:
    """(rope type, linear factor, rope_theta or None) of one rope object; an unsupported type is refused by name."""
    if not isinstance(params, dict):
        raise MCFError(f"{source}: config.json {key!r} must be an object, got {params!r}")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in _SUPPORTED_ROPE_TYPES:
        raise _fail(
            source,
            f"config.json {key}.rope_type = {rope_type!r} is not supported by the mcf runner "
            f"(supported: {', '.join(_SUPPORTED_ROPE_TYPES)})",
        )
    partial = params.get("partial_rotary_factor", 1.0)
    if partial != 1.0:
        raise _fail(source, f"config.json {key}.partial_rotary_factor = {partial!r} is not supported")
    factor = _float(params, "factor", source, default=1.0) if rope_type == "linear" else 1.0
    theta = _float(params, "rope_theta", source, default=10000.0) if "rope_theta" in params else None
    return str(rope_type), factor, theta


def _rope(config: Mapping[str, Any], source: str) -> tuple[float, float]:
    """(theta, linear factor) from transformers 5's ``rope_parameters`` and/or the older ``rope_theta`` +
    ``rope_scaling``. When a config carries several of them they must agree: reading one and ignoring the other
    would silently run a different model (say ``rope_parameters`` default beside ``rope_scaling`` yarn)."""
    specs = {
        key: _rope_spec(config[key], key, source)
        for key in ("rope_parameters", "rope_scaling")
        if config.get(key) is not None
    }
    if len(specs) == 2:
        (key_a, (type_a, factor_a, _)), (key_b, (type_b, factor_b, _)) = specs.items()
        for label, value_a, value_b in (("rope_type", type_a, type_b), ("factor", factor_a, factor_b)):
            if value_a != value_b:
                raise _fail(
                    source,
                    f"config.json {key_a} ({label} {value_a!r}) and {key_b} ({label} {value_b!r}) disagree; "
                    "the mcf runner will not guess which one the model was trained with",
                )
    thetas: dict[str, float] = {}
    if config.get("rope_theta") is not None:
        thetas["rope_theta"] = _float(config, "rope_theta", source, default=10000.0)
    thetas |= {f"{key}.rope_theta": spec[2] for key, spec in specs.items() if spec[2] is not None}
    (first_key, theta), *others = thetas.items() if thetas else [("", 10000.0)]
    for key, value in others:
        if value != theta:
            raise _fail(source, f"config.json {first_key} ({theta!r}) and {key} ({value!r}) disagree")
    factor = next(iter(specs.values()))[1] if specs else 1.0
    return theta, factor


def parse_config(raw: bytes, *, source: str) -> tuple[DecoderConfig, list[str]]:
    """Parse config.json bytes; returns the config and the unknown keys (for a warning). ``source`` names the file."""
    try:
        config = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise MCFError(f"{source}: the config.json section is not valid JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise MCFError(f"{source}: the config.json section must hold a JSON object")

    model_type = config.get("model_type")
    if model_type not in _SUPPORTED_MODEL_TYPES:
        raise _fail(
            source,
            f"model_type {model_type!r} is not supported by the mcf runner "
            f"(supported: {', '.join(_SUPPORTED_MODEL_TYPES)})",
        )
    architectures = config.get("architectures") or []
    unsupported_archs = [a for a in architectures if a not in _SUPPORTED_ARCHITECTURES]
    if unsupported_archs:
        raise _fail(source, f"architectures {unsupported_archs!r} are not supported by the mcf runner")

    for key, harmless in _REFUSED_UNLESS.items():
        if key in config and config[key] != harmless:
            raise _fail(source, f"config.json key {key!r} = {config[key]!r} is not supported by the mcf runner")
    hidden_act = config.get("hidden_act", "silu")
    if hidden_act != "silu":
        raise _fail(source, f"config.json hidden_act = {hidden_act!r} is not supported (only 'silu')")

    hidden_size = _int(config, "hidden_size", source)
    num_heads = _int(config, "num_attention_heads", source)
    num_kv_heads = _int(config, "num_key_value_heads", source, default=num_heads)
    if num_heads % num_kv_heads:
        raise MCFError(
            f"{source}: num_attention_heads ({num_heads}) is not a multiple of num_key_value_heads ({num_kv_heads})"
        )
    default_head_dim = hidden_size // num_heads if hidden_size % num_heads == 0 else None
    head_dim = _int(config, "head_dim", source, default=default_head_dim)
    if head_dim % 2:
        raise MCFError(f"{source}: head_dim {head_dim} must be even for rotary embeddings")
    max_positions = _int(config, "max_position_embeddings", source, default=2048)

    sliding_window = config.get("sliding_window")
    use_sliding = config.get("use_sliding_window", sliding_window is not None)
    if use_sliding and sliding_window is not None and sliding_window < max_positions:
        raise _fail(
            source,
            f"config.json sliding_window = {sliding_window!r} (below max_position_embeddings {max_positions}) is "
            "not supported by the mcf runner",
        )

    rope_theta, rope_factor = _rope(config, source)
    pad = config.get("pad_token_id")
    bos = config.get("bos_token_id")
    decoder = DecoderConfig(
        vocab_size=_int(config, "vocab_size", source),
        hidden_size=hidden_size,
        intermediate_size=_int(config, "intermediate_size", source),
        num_layers=_int(config, "num_hidden_layers", source),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=_float(config, "rms_norm_eps", source, default=1e-6),
        rope_theta=rope_theta,
        rope_scaling_factor=rope_factor,
        max_position_embeddings=max_positions,
        tie_word_embeddings=_bool(config, "tie_word_embeddings", source, default=False),
        attention_bias=_bool(config, "attention_bias", source, default=False),
        mlp_bias=_bool(config, "mlp_bias", source, default=False),
        bos_token_id=_token_ids(bos, "bos_token_id", source)[0] if bos is not None else None,
        eos_token_ids=_token_ids(config.get("eos_token_id"), "eos_token_id", source),
        pad_token_id=_token_ids(pad, "pad_token_id", source)[0] if pad is not None else None,
        model_type=str(model_type),
    )
    unknown = sorted(set(config) - _INERT_KEYS - _IMPLEMENTED_KEYS - set(_REFUSED_UNLESS))
    return decoder, unknown
