"""Tiny random llama models for the mcf runner tests: built with transformers, saved as safetensors + config.json,
converted to MCF with carton's converter, and served by the runner in-process (or through carton.load)."""

from __future__ import annotations

import json
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import carton.mcf
import numpy as np
from carton_protocol import LoadContext, OptValue
from carton_runner_mcf.runner import MCFRunner

WEIGHT_CLASSES = ("embeddings", "attention", "mlp", "head")


def build_llama(
    directory: Path,
    *,
    vocab: int = 512,
    hidden: int = 64,
    intermediate: int = 160,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    tie: bool = False,
    seed: int = 0,
    tokenizer_json: str | None = None,
    **config: Any,
) -> Path:
    """A random ``LlamaForCausalLM`` saved with ``save_pretrained`` (safetensors + config.json) in ``directory``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    llama_config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        tie_word_embeddings=tie,
        **config,
    )
    model = LlamaForCausalLM(llama_config).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.save_pretrained(directory)
    if tokenizer_json is not None:
        (directory / "tokenizer.json").write_text(tokenizer_json)
    return directory


def edit_config(hf_dir: Path, **changes: Any) -> None:
    """Rewrite keys of a saved config.json (``None`` deletes the key)."""
    path = hf_dir / "config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config))


def reference_logits(
    hf_dir: Path,
    input_ids: np.ndarray,
    attention_mask: np.ndarray | None = None,
    position_ids: np.ndarray | None = None,
) -> np.ndarray:
    """transformers' fp32 logits for the same inputs."""
    import torch
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    kwargs: dict[str, Any] = {"input_ids": torch.tensor(input_ids)}
    if attention_mask is not None:
        kwargs["attention_mask"] = torch.tensor(attention_mask)
    if position_ids is not None:
        kwargs["position_ids"] = torch.tensor(position_ids)
    with torch.no_grad():
        return model(**kwargs).logits.numpy()


def to_mcf(hf_dir: Path, out_dir: Path, method: str | None = None, *, float_dtype: str = "keep") -> Path:
    """Convert with ``method`` for every weight class (``None``: all float); returns the folder holding model.mcf."""
    out_dir.mkdir(parents=True, exist_ok=True)
    methods = dict.fromkeys(WEIGHT_CLASSES, method) if method else {}
    carton.mcf.convert(hf_dir, out_dir / "model.mcf", methods=methods, float_dtype=float_dtype)
    return out_dir


def load_runner(model_dir: Path, warnings_seen: list[str] | None = None, **opts: OptValue) -> MCFRunner:
    runner = MCFRunner()
    sink = warnings_seen.append if warnings_seen is not None else (lambda message: None)
    runner.load(LoadContext(model_dir=model_dir, opts=opts, warn=sink))
    return runner


def infer_logits(model_dir: Path, inputs: Mapping[str, np.ndarray], **opts: OptValue) -> np.ndarray:
    runner = load_runner(model_dir, **opts)
    try:
        logits = runner.infer(inputs)["logits"]
        assert isinstance(logits, np.ndarray)
        return logits
    finally:
        runner.close()


def relative_rmse(value: np.ndarray, reference: np.ndarray) -> float:
    return float(np.sqrt(np.mean((value - reference) ** 2)) / np.sqrt(np.mean(reference**2)))


def max_relative_error(value: np.ndarray, reference: np.ndarray) -> float:
    return float(np.abs(value - reference).max() / np.abs(reference).max())


def word_tokenizer_json(vocab: int) -> str:
    """A word-level tokenizer.json over ``vocab`` ids: ``<unk>``, ``<eos>``, then ``w2`` ... (whitespace split)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    words = {"<unk>": 0, "<eos>": 1} | {f"w{i}": i for i in range(2, vocab)}
    tokenizer = Tokenizer(models.WordLevel(vocab=words, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tokenizer.add_special_tokens(["<eos>"])
    return str(tokenizer.to_str())
