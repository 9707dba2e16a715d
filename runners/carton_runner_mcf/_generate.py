"""Autoregressive generation over a `LlamaModel`: one prefill, then one cached decode step per new token.

Sampling follows transformers' order: temperature, then top-k, then top-p (nucleus, keeping at least one token);
``temperature == 0`` is greedy. A seed makes sampling reproducible (numpy's PCG64).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from ._decoder import Decoder, positions_from_mask

__all__ = ["F32", "I64", "SamplingParams", "generate", "sample_next"]

F32 = NDArray[np.float32]
I64 = NDArray[np.int64]


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplingParams:
    """How to pick tokens. ``top_k = 0`` and ``top_p = 1.0`` disable those filters; ``seed = None`` is random."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int = 0
    stop_at_eos: bool = True

    def __post_init__(self) -> None:
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if not np.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")


def sample_next(logits: F32, params: SamplingParams, rng: np.random.Generator) -> I64:
    """One token id per row of ``logits [batch, vocab]``."""
    if params.temperature == 0.0:
        greedy: I64 = np.argmax(logits, axis=-1).astype(np.int64)
        return greedy
    scaled = logits.astype(np.float64) / params.temperature
    chosen = np.empty(scaled.shape[0], dtype=np.int64)
    for row, values in enumerate(scaled):
        candidates = np.arange(values.shape[0])
        if 0 < params.top_k < values.shape[0]:
            candidates = np.argpartition(values, -params.top_k)[-params.top_k :]
        order = candidates[np.argsort(-values[candidates], kind="stable")]
        probs = np.exp(values[order] - values[order[0]])
        probs /= probs.sum()
        if params.top_p < 1.0:
            # Keep the smallest prefix whose mass reaches top_p (a token is dropped only when the mass before it
            # already does), as transformers' TopPLogitsWarper does.
            before = np.cumsum(probs) - probs
            keep = int(np.count_nonzero(before < params.top_p)) or 1
            order, probs = order[:keep], probs[:keep] / probs[:keep].sum()
        cumulative = np.cumsum(probs)
        index = int(np.searchsorted(cumulative, rng.random() * cumulative[-1], side="right"))
        chosen[row] = order[min(index, len(order) - 1)]
    return chosen


def _last_real(token_mask: NDArray[np.bool_]) -> I64:
    """Each row's index of its last real token (prompts may be left- or right-padded)."""
    seq = token_mask.shape[1]
    last: I64 = (seq - 1 - np.argmax(token_mask[:, ::-1], axis=1)).astype(np.int64)
    return last


def generate(model: Decoder, input_ids: I64, token_mask: NDArray[np.bool_], params: SamplingParams) -> I64:
    """New tokens, ``[batch, n]`` with ``n <= max_new_tokens``; rows that stopped early hold ``pad_token_id``.

    Generation ends when every row has produced an end-of-sequence token (when ``stop_at_eos``) or after
    ``max_new_tokens`` steps.
    """
    batch = input_ids.shape[0]
    rng = np.random.default_rng(params.seed)
    out = np.full((batch, params.max_new_tokens), params.pad_token_id, dtype=np.int64)
    if params.max_new_tokens == 0:
        return out
    cache = model.new_cache(batch, input_ids.shape[1] + params.max_new_tokens)
    positions = positions_from_mask(token_mask)
    # Only the last real token's state is needed from the prompt: the model's last layer skips the others.
    hidden = model.prefill(input_ids, positions, token_mask, cache, outputs=_last_real(token_mask))
    next_logits = model.logits(hidden[:, 0])
    next_position = positions.max(axis=1, where=token_mask, initial=-1) + 1
    finished = np.zeros(batch, dtype=bool)
    eos = np.asarray(params.eos_token_ids, dtype=np.int64)
    all_real = np.ones((batch, 1), dtype=bool)
    produced = 0
    for step in range(params.max_new_tokens):
        tokens = sample_next(next_logits, params, rng)
        tokens = np.where(finished, params.pad_token_id, tokens)
        out[:, step] = tokens
        produced = step + 1
        if params.stop_at_eos and eos.size:
            finished |= np.isin(tokens, eos)
            if finished.all():
                break
        if step + 1 == params.max_new_tokens:
            break
        hidden = model.forward(tokens[:, None], next_position[:, None], all_real, cache)
        next_logits = model.logits(hidden[:, 0])
        next_position = next_position + 1
    return out[:, :produced]
