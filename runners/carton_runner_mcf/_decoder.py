"""What a decoder is to the rest of the runner: a layer's weights (`DecoderLayer`), the key-value cache (`KVCache`),
rotary positions from a padding mask, the `Decoder` protocol that generation uses, and a long prompt's prefill in
chunks. `_llama.LlamaModel` is the one-process decoder; `_sharded.ShardedModel` the one split across processes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
from numpy.typing import NDArray

from ._config import DecoderConfig
from ._weights import Linear

__all__ = [
    "F32",
    "I64",
    "Decoder",
    "DecoderLayer",
    "KVCache",
    "chunked_prefill",
    "pick_rows",
    "positions_from_mask",
]

F32 = NDArray[np.float32]
I64 = NDArray[np.int64]


@dataclass(frozen=True, slots=True, kw_only=True)
class DecoderLayer:
    """One transformer block's weights (of one shard when the model is split across processes).

    ``o_bias`` and ``down_bias`` are added after the shards' partial sums are added up; a single process may as well
    fold them into its `Linear` (``BiasedLinear``).
    """

    input_norm: F32
    q_proj: Linear
    k_proj: Linear
    v_proj: Linear
    o_proj: Linear
    post_attention_norm: F32
    gate_proj: Linear
    up_proj: Linear
    down_proj: Linear
    o_bias: F32 | None = None
    down_bias: F32 | None = None


class KVCache:
    """Keys and values of every layer, ``[batch, kv_heads, capacity, head_dim]``, plus which slots are real.

    ``key_mask[b, s]`` is False for padding slots, so a padded prompt and its continuation attend only to real
    tokens. Capacity grows geometrically when a step would overflow it.
    """

    def __init__(self, config: DecoderConfig, batch: int, capacity: int, *, kv_heads: int | None = None) -> None:
        self._config = config
        self.batch = batch
        self.length = 0
        heads = config.num_kv_heads if kv_heads is None else kv_heads
        shape = (config.num_layers, batch, heads, max(capacity, 1), config.head_dim)
        #: every layer's keys and values in one array each, ``[layers, batch, kv_heads, capacity, head_dim]``
        #: (the compiled decode step reads them whole); ``keys[i]`` / ``values[i]`` are layer ``i``'s views.
        self.key_store = np.zeros(shape, np.float32)
        self.value_store = np.zeros(shape, np.float32)
        self.keys = list(self.key_store)
        self.values = list(self.value_store)
        self.key_mask = np.zeros((batch, shape[3]), dtype=bool)

    @property
    def capacity(self) -> int:
        return int(self.key_mask.shape[1])

    def reserve(self, extra: int) -> None:
        needed = self.length + extra
        if needed <= self.capacity:
            return
        new_capacity = max(needed, 2 * self.capacity)
        stores = []
        for old in (self.key_store, self.value_store):
            grown = np.zeros((*old.shape[:3], new_capacity, old.shape[4]), np.float32)
            grown[:, :, :, : self.length] = old[:, :, :, : self.length]
            stores.append(grown)
        self.key_store, self.value_store = stores
        self.keys, self.values = list(self.key_store), list(self.value_store)
        mask = np.zeros((self.batch, new_capacity), dtype=bool)
        mask[:, : self.length] = self.key_mask[:, : self.length]
        self.key_mask = mask


def positions_from_mask(attention_mask: NDArray[np.bool_], start: I64 | None = None) -> I64:
    """Rotary positions: each real token's index among the real tokens of its row (padding does not count)."""
    counts = np.cumsum(attention_mask, axis=1, dtype=np.int64) - 1
    if start is not None:
        counts += start[:, None]
    return np.maximum(counts, 0)


class Decoder(Protocol):
    """What generation and the runner use of a model: one process's `LlamaModel` or the split `ShardedModel`."""

    @property
    def config(self) -> DecoderConfig: ...

    def new_cache(self, batch: int, capacity: int) -> KVCache: ...

    def forward(self, input_ids: I64, positions: I64, token_mask: NDArray[np.bool_], cache: KVCache) -> F32: ...

    def prefill(
        self,
        input_ids: I64,
        positions: I64,
        token_mask: NDArray[np.bool_],
        cache: KVCache,
        *,
        chunk: int = 256,
        outputs: I64 | None = None,
    ) -> F32: ...

    def logits(self, hidden: F32) -> F32: ...


def pick_rows(hidden: F32, outputs: I64) -> F32:
    """``hidden [batch, seq, h]`` at one position per row, ``[batch, 1, h]``."""
    picked: F32 = hidden[np.arange(hidden.shape[0]), outputs][:, None]
    return picked


def chunked_prefill(
    model: Decoder, input_ids: I64, positions: I64, token_mask: NDArray[np.bool_], cache: KVCache, *, chunk: int = 256
) -> F32:
    """`forward` over a long prompt in chunks of ``chunk`` tokens: the attention scores of one chunk are
    ``[batch, heads, chunk, length]`` instead of ``[batch, heads, seq, seq]``, so memory stays linear in the prompt
    length. The result equals one `forward` call."""
    seq = input_ids.shape[1]
    if seq <= chunk:
        return model.forward(input_ids, positions, token_mask, cache)
    cache.reserve(seq)
    parts = [
        model.forward(input_ids[:, i : i + chunk], positions[:, i : i + chunk], token_mask[:, i : i + chunk], cache)
        for i in range(0, seq, chunk)
    ]
    return np.concatenate(parts, axis=1)
