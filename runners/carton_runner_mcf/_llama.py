"""The llama decoder in numpy: embedding, RMSNorm, rotary embeddings, grouped-query attention, SwiGLU, output head.

Every weight matmul is a `Linear` (a quantized kernel or a plain float matrix, see `_weights`). Activations are
float32 throughout, matching transformers' fp32 computation order where it matters for accuracy (RMSNorm in fp32,
softmax after subtracting the row maximum, cos/sin from fp32 inverse frequencies).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from types import ModuleType

import numpy as np
from numpy.typing import NDArray

from ._config import DecoderConfig
from ._decoder import F32, I64, DecoderLayer, KVCache, chunked_prefill, pick_rows
from ._kernels import QuantizedLinear
from ._packed import CompiledPayload, compiled_kernels, without_threads
from ._region import DecodeRegion
from ._weights import Embedding, Linear

__all__ = ["LlamaModel"]


def _unchanged(partial: F32) -> F32:
    return partial


def _fused_ops() -> ModuleType | None:
    """The compiled single-token operations (`_fused`) when the compiled kernels are in use, else None."""
    if compiled_kernels() is None:
        return None
    from . import _fused

    return _fused


def _prefill_ops() -> ModuleType | None:
    """The compiled element-wise operations of a chunk (`_prefill`) when the compiled kernels are in use, else
    None."""
    if compiled_kernels() is None:
        return None
    from . import _prefill

    return _prefill


class LlamaModel:
    """Forward pass of a llama-family decoder; ``forward`` fills a `KVCache` and returns final hidden states.

    A shard of a model split across processes (``_shards``) holds ``kv_heads`` of the kv heads (with their query
    heads), part of the MLP rows and part of the head's rows; ``reduce`` adds up the shards' partial sums of the
    attention output and MLP projections, so every shard carries the same hidden states.
    """

    def __init__(
        self,
        config: DecoderConfig,
        *,
        embedding: Embedding,
        layers: Sequence[DecoderLayer],
        final_norm: F32,
        lm_head: Linear,
        kv_heads: int | None = None,
        reduce: Callable[[F32], F32] = _unchanged,
    ) -> None:
        self.config = config
        self.embedding = embedding
        self.layers = tuple(layers)
        self.final_norm = final_norm
        self.lm_head = lm_head
        self.kv_heads = config.num_kv_heads if kv_heads is None else kv_heads
        self.heads = self.kv_heads * (config.num_heads // config.num_kv_heads)
        self.reduce = reduce
        half = config.head_dim // 2
        exponents = np.arange(0, config.head_dim, 2, dtype=np.float32)[:half] / np.float32(config.head_dim)
        self._inv_freq = (1.0 / (np.float32(config.rope_theta) ** exponents)).astype(np.float32)
        if config.rope_scaling_factor != 1.0:
            self._inv_freq = (self._inv_freq / np.float32(config.rope_scaling_factor)).astype(np.float32)
        self._scale = np.float32(1.0 / np.sqrt(config.head_dim))
        self._fused = _fused_ops()
        self._prefill = _prefill_ops()
        self._prefill_parts = _prefill_threads(self.layers) if self._prefill is not None else 1
        self._region: DecodeRegion | bool | None = self._fused is not None  # True: not built yet
        self._stepped: tuple[F32, F32] | None = None  # the last region step's output and logits

    def new_cache(self, batch: int, capacity: int) -> KVCache:
        return KVCache(self.config, batch, capacity, kv_heads=self.kv_heads)

    def _rms_norm(self, x: F32, weight: F32) -> F32:
        variance = np.einsum("...i,...i->...", x, x)[..., None] / np.float32(x.shape[-1])
        normed: F32 = (x / np.sqrt(variance + np.float32(self.config.rms_norm_eps))) * weight
        return normed

    def _norm(self, x: F32, weight: F32) -> F32:
        """`_rms_norm`, compiled (`_fused.rms_norm`) when the compiled kernels are in use."""
        if self._fused is None:
            return self._rms_norm(x, weight)
        rows = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, x.shape[-1])
        out = np.empty_like(rows)
        args = (rows, weight, np.float32(self.config.rms_norm_eps), out)
        if self._prefill is not None:
            self._shared(self._prefill.rms_norm_parallel, self._fused.rms_norm, args, rows.shape[0])
        else:
            self._fused.rms_norm(*args)
        return out.reshape(x.shape)

    def _rotary(self, positions: I64) -> tuple[F32, F32]:
        """cos and sin, ``[batch, 1, seq, head_dim // 2]``; the two halves of a head share them."""
        freqs = positions[:, None, :, None].astype(np.float32) * self._inv_freq
        return np.cos(freqs), np.sin(freqs)

    @staticmethod
    def _apply_rotary(x: F32, cos: F32, sin: F32) -> F32:
        half = x.shape[-1] // 2
        first, second = x[..., :half], x[..., half:]
        return np.concatenate((first * cos - second * sin, second * cos + first * sin), axis=-1)

    def forward(
        self,
        input_ids: I64,
        positions: I64,
        token_mask: NDArray[np.bool_],
        cache: KVCache,
        *,
        outputs: I64 | None = None,
    ) -> F32:
        """Run ``input_ids [batch, seq]`` at rotary ``positions`` after what ``cache`` holds; returns hidden states.

        ``token_mask`` marks the real (non-padding) tokens of this chunk; they and the cache's real slots are what
        every query may attend to, causally. With ``outputs`` (one index into the chunk per row) the result is
        ``[batch, 1, hidden]``, those tokens' hidden states only: every token's keys and values still fill the
        cache, but the last layer computes its queries, attention, output projection and MLP for those tokens
        alone (nothing after the last layer's keys and values reads the other tokens' states).
        """
        config = self.config
        batch, seq = input_ids.shape
        cache.reserve(seq)
        start = cache.length
        end = start + seq
        cache.key_mask[:, start:end] = token_mask
        if seq == 1 and self._fused is not None:
            region = self._decode_region()
            hidden_one = None
            if region is not None:
                hidden_one = self._step_region(region, input_ids, positions, cache)
            if hidden_one is None:
                hidden_one = self._step_one(input_ids, positions, cache, self._fused)
            cache.length = end
            return hidden_one
        # Query t (slot start + t) attends to the real slots s <= start + t and always to itself: the causal bias of
        # the numpy path, or the compiled attention's own masking (`_prefill.attend`).
        compiled = self._prefill
        bias = None if compiled is not None else self._causal_bias(cache.key_mask, start, seq)
        cos, sin = self._rotary(positions)
        heads, kv_heads, head_dim, reduce = self.heads, self.kv_heads, config.head_dim, self.reduce
        fused = self._fused
        keys_t = None if compiled is None else np.empty((batch, kv_heads, head_dim, end), dtype=np.float32)

        hidden = self.embedding(input_ids)
        last_layer = len(self.layers) - 1
        for index, layer in enumerate(self.layers):
            normed = self._norm(hidden, layer.input_norm)
            # ``[batch, seq, kv_heads, head_dim]``, as the compiled attention reads them (it stores them itself)
            selected = outputs is not None and index == last_layer
            projected = self._products(normed, (layer.k_proj, layer.v_proj) + (() if selected else (layer.q_proj,)))
            k = projected[0].reshape(batch, seq, kv_heads, head_dim)
            v = projected[1].reshape(batch, seq, kv_heads, head_dim)
            keys, values = cache.keys[index], cache.values[index]
            if selected:
                assert outputs is not None
                if fused is not None:
                    fused.rotary(k.transpose(0, 2, 1, 3), cos, sin, keys[:, :, start:end])
                else:
                    keys[:, :, start:end] = self._apply_rotary(k.transpose(0, 2, 1, 3), cos, sin)
                values[:, :, start:end] = v.transpose(0, 2, 1, 3)
                rows = np.arange(batch)
                hidden = self._selected(
                    layer,
                    hidden=hidden[rows, outputs][:, None],
                    normed=normed[rows, outputs][:, None],
                    positions=positions[rows, outputs][:, None],
                    slots=start + outputs,
                    keys=keys[:, :, :end],
                    values=values[:, :, :end],
                    key_mask=cache.key_mask[:, :end],
                )
                break
            q = projected[2].reshape(batch, seq, heads, head_dim)
            if compiled is not None:
                assert keys_t is not None
                attended = np.empty((batch, seq, heads * head_dim), dtype=np.float32)
                args = (q, k, v, cos, sin, keys, values, keys_t, cache.key_mask, start, self._scale, attended)
                self._shared(compiled.attend_parallel, compiled.attend, args, batch * seq)
            else:
                assert bias is not None
                attended = self._attend_numpy(q, k, v, cos, sin, keys, values, bias, start)
            attention = reduce(layer.o_proj(attended))
            if layer.o_bias is not None:
                attention += layer.o_bias
            hidden = self._mlp(layer, hidden + attention)
        cache.length = end
        return self._norm(hidden, self.final_norm)

    def _mlp(self, layer: DecoderLayer, hidden: F32) -> F32:
        """``hidden`` plus the layer's MLP of it (post-attention norm, SwiGLU, down projection)."""
        compiled = self._prefill
        normed = self._norm(hidden, layer.post_attention_norm)
        gate, up = self._products(normed, (layer.gate_proj, layer.up_proj))
        if compiled is not None:
            activated = np.empty_like(gate)
            rows = (-1, gate.shape[-1])
            args = (gate.reshape(rows), up.reshape(rows), activated.reshape(rows))
            self._shared(compiled.swiglu_parallel, compiled.swiglu, args, args[0].shape[0])
        else:
            # SiLU(gate) * up, with the sigmoid computed in place to spare temporaries
            activated = np.negative(gate)
            np.exp(activated, out=activated)
            activated += np.float32(1.0)
            np.divide(gate, activated, out=activated)
            activated *= up
        mlp = self.reduce(layer.down_proj(activated))
        if layer.down_bias is not None:
            mlp += layer.down_bias
        return hidden + mlp

    def _attend_numpy(
        self, q: F32, k: F32, v: F32, cos: F32, sin: F32, keys: F32, values: F32, bias: F32, start: int
    ) -> F32:
        """`_prefill.attend` in numpy: ``q [batch, seq, heads, d]``, ``k`` / ``v [batch, seq, kv, d]`` into the cache
        and the attended values ``[batch, seq, heads * d]``, with ``bias`` of `_causal_bias`."""
        batch, seq, heads, head_dim = q.shape
        kv_heads = k.shape[2]
        end = start + seq
        keys[:, :, start:end] = self._apply_rotary(k.transpose(0, 2, 1, 3), cos, sin)
        values[:, :, start:end] = v.transpose(0, 2, 1, 3)
        rotated = self._apply_rotary(q.transpose(0, 2, 1, 3), cos, sin)
        # Grouped-query attention: the query heads sharing a kv head are one batched matmul.
        grouped = rotated.reshape(batch, kv_heads, -1, head_dim) * self._scale
        scores = np.matmul(grouped, keys[:, :, :end].transpose(0, 1, 3, 2))
        scores = scores.reshape(batch, kv_heads, heads // kv_heads, seq, end) + bias
        scores -= scores.max(axis=-1, keepdims=True)
        np.exp(scores, out=scores)
        scores /= scores.sum(axis=-1, keepdims=True)
        attended = np.matmul(scores.reshape(batch, kv_heads, -1, end), values[:, :, :end])
        out: F32 = attended.reshape(batch, heads, seq, head_dim).transpose(0, 2, 1, 3).reshape(batch, seq, -1)
        return out

    def _products(self, x: F32, linears: tuple[Linear, ...]) -> tuple[F32, ...]:
        """Each of ``linears`` applied to ``x``: in one call of the panel kernels (`_panel.PanelKernels.matmul_many`:
        ``x`` rounded once, the matrices' groups shared between the threads as one list) when all of them would run
        on the same panel kernels, else one product each."""
        from ._compiled import panel_shapes

        compiled = [_paneled(linear, x) for linear in linears]
        first = compiled[0]
        if first is None or any(part is None or part.panels is not first.panels for part in compiled):
            return tuple(linear(x) for linear in linears)
        payloads = [part for part in compiled if part is not None]
        x2 = np.ascontiguousarray(x.reshape(-1, x.shape[-1]), dtype=np.float32)
        m = x2.shape[0]
        xq_shape, xs_shape = panel_shapes(m, first.blocks)
        xq, xs = np.empty(xq_shape, np.int16), np.empty(xs_shape, np.float32)
        outs = tuple(np.empty((m, part.rows), dtype=np.float32) for part in payloads)
        flats, metas = tuple(part.payload for part in payloads), tuple(part.meta for part in payloads)
        kernels = first.panels
        assert kernels is not None
        self._shared(kernels.matmul_many_parallel, kernels.matmul_many, (flats, metas, x2, xq, xs, outs), m)
        return tuple(out.reshape(*x.shape[:-1], out.shape[-1]) for out in outs)

    def _shared(
        self, parallel: Callable[..., None], serial: Callable[..., None], args: tuple[object, ...], rows: int
    ) -> None:
        """``parallel(*args, parts)`` on the model's prefill threads (`_prefill_threads`) for a chunk of more than a
        few ``rows``, else (or once numba has no thread-safe threading layer) ``serial(*args)``."""
        parts = self._prefill_parts
        if parts > 1 and rows >= _SHARED_ROWS:
            try:
                parallel(*args, parts)
                return
            except ValueError as exc:
                without_threads(exc)  # (raises it again unless numba has no thread-safe threading layer)
                self._prefill_parts = 1
        serial(*args)

    def _selected(
        self,
        layer: DecoderLayer,
        *,
        hidden: F32,
        normed: F32,
        positions: I64,
        slots: I64,
        keys: F32,
        values: F32,
        key_mask: NDArray[np.bool_],
    ) -> F32:
        """The rest of a layer (after its keys and values are in the cache) for one token per row: ``hidden`` and
        ``normed`` are those tokens' ``[batch, 1, hidden]`` states, ``slots`` their cache slots; ``keys`` /
        ``values`` the cache up to the chunk's end. The same computation as `forward`'s for those rows."""
        config = self.config
        batch = hidden.shape[0]
        heads, kv_heads, head_dim = self.heads, self.kv_heads, config.head_dim
        cos, sin = self._rotary(positions)
        q = layer.q_proj(normed).reshape(batch, 1, heads, head_dim).transpose(0, 2, 1, 3)
        if self._fused is not None:
            rotated = np.empty(q.shape, dtype=np.float32)
            self._fused.rotary(q, cos, sin, rotated)
            q = rotated
        else:
            q = self._apply_rotary(q, cos, sin)
        grouped = q.reshape(batch, kv_heads, heads // kv_heads, head_dim) * self._scale
        scores = np.matmul(grouped, keys.transpose(0, 1, 3, 2))
        # Query at slot t sees the real slots s <= t and itself, as the causal bias of `forward` says.
        every = np.arange(keys.shape[2])
        allowed = ((every[None, :] <= slots[:, None]) & key_mask) | (every[None, :] == slots[:, None])
        scores[~np.broadcast_to(allowed[:, None, None, :], scores.shape)] = np.finfo(np.float32).min
        scores -= scores.max(axis=-1, keepdims=True)
        np.exp(scores, out=scores)
        scores /= scores.sum(axis=-1, keepdims=True)
        attended = np.matmul(scores, values).reshape(batch, 1, heads * head_dim)
        attention = self.reduce(layer.o_proj(attended))
        if layer.o_bias is not None:
            attention += layer.o_bias
        return self._mlp(layer, hidden + attention)

    @staticmethod
    def _causal_bias(key_mask: NDArray[np.bool_], start: int, seq: int) -> F32:
        """``[batch, 1, 1, seq, start + seq]``: 0 where query ``t`` (slot ``start + t``) sees a real slot ``s <=
        start + t``, and always itself (so that a padding query, whose output nobody reads, is still well defined
        and independent of chunking); float32's lowest elsewhere."""
        end = start + seq
        slots = np.arange(end)
        query_slots = (start + np.arange(seq))[:, None]
        allowed = (slots[None, :] <= query_slots)[None, :, :] & key_mask[:, None, :end]
        allowed |= (slots[None, :] == query_slots)[None, :, :]
        bias: F32 = np.where(allowed, np.float32(0.0), np.float32(np.finfo(np.float32).min))[:, None, None, :, :]
        return bias

    def _decode_region(self) -> DecodeRegion | None:
        """The whole-step region (`_region`), built on first use; None when the model does not qualify."""
        if self._region is True:
            from ._region import build_region

            self._region = build_region(self)
        return self._region or None

    def _step_region(self, region: DecodeRegion, input_ids: I64, positions: I64, cache: KVCache) -> F32 | None:
        """`forward` for one token per row as one `_step.decode_step` run by the model's threads, which also
        computes the step's logits (kept for `logits`); None (and the region dropped, with a warning) when the team
        failed."""
        # The caller's Python between two steps is serial at every thread count and runs on caches the step has
        # just evicted: this path touches as little as it can (`DecodeRegion.step` checks the arrays' types).
        try:
            out, logits = region.step(
                input_ids, positions, cache.key_store, cache.value_store, cache.key_mask, cache.length, self._scale
            )
        except Exception as exc:
            from ._team import TeamFailed

            if not isinstance(exc, TeamFailed):
                raise
            warnings.warn(f"mcf runner: decode falls back to one call per operation: {exc}", RuntimeWarning, 2)
            self._region = None
            return None
        # Read-only, so that the logits kept for it cannot go stale.
        out.flags.writeable = False
        self._stepped = (out, logits) if logits is not None else None
        return out.reshape(input_ids.shape[0], 1, -1)

    def _step_one(self, input_ids: I64, positions: I64, cache: KVCache, fused: ModuleType) -> F32:
        """`forward` for one token per row with the compiled small operations (`_fused`): the same computation,
        with a layer's norms, rotary embedding, attention and SwiGLU in four calls instead of a few dozen."""
        config = self.config
        batch = input_ids.shape[0]
        heads, kv_heads, head_dim, reduce = self.heads, self.kv_heads, config.head_dim, self.reduce
        eps = np.float32(config.rms_norm_eps)
        cos, sin = (np.ascontiguousarray(part.reshape(batch, -1)) for part in self._rotary(positions))
        hidden = np.ascontiguousarray(self.embedding(input_ids).reshape(batch, -1), dtype=np.float32)
        normed = np.empty_like(hidden)
        attended = np.empty((batch, heads * head_dim), dtype=np.float32)
        slot = cache.length
        for index, layer in enumerate(self.layers):
            fused.rms_norm(hidden, layer.input_norm, eps, normed)
            q = layer.q_proj(normed).reshape(batch, heads, head_dim)
            k = layer.k_proj(normed).reshape(batch, kv_heads, head_dim)
            v = layer.v_proj(normed).reshape(batch, kv_heads, head_dim)
            keys, values = cache.keys[index], cache.values[index]
            fused.attend_one(q, k, v, cos, sin, keys, values, cache.key_mask, slot, self._scale, attended)
            attention = reduce(layer.o_proj(attended))
            if layer.o_bias is not None:
                attention += layer.o_bias
            hidden = hidden + attention
            fused.rms_norm(hidden, layer.post_attention_norm, eps, normed)
            gate = layer.gate_proj(normed)
            fused.swiglu(gate, layer.up_proj(normed), gate)
            mlp = reduce(layer.down_proj(gate))
            if layer.down_bias is not None:
                mlp += layer.down_bias
            hidden = hidden + mlp
        fused.rms_norm(hidden, self.final_norm, eps, normed)
        return normed.reshape(batch, 1, -1)

    def prefill(
        self,
        input_ids: I64,
        positions: I64,
        token_mask: NDArray[np.bool_],
        cache: KVCache,
        *,
        chunk: int = 256,
        outputs: I64 | None = None,
    ) -> F32:
        """`chunked_prefill`; with ``outputs`` (one index into the prompt per row) only those tokens' hidden states,
        ``[batch, 1, hidden]``: a prompt of one chunk then runs its last layer for those tokens alone (`forward`),
        a longer one is run whole and the rows picked."""
        if outputs is not None and input_ids.shape[1] <= chunk:
            return self.forward(input_ids, positions, token_mask, cache, outputs=outputs)
        hidden = chunked_prefill(self, input_ids, positions, token_mask, cache, chunk=chunk)
        return hidden if outputs is None else pick_rows(hidden, outputs)

    def logits(self, hidden: F32) -> F32:
        stepped, self._stepped = self._stepped, None
        if stepped is not None:
            out, logits = stepped
            # ``hidden`` is what the last single-token step returned (or a view of all of it): its logits were
            # computed in the same run of the threads.
            # (``out`` owns its memory, so every view of it has it as ``base``; a contiguous view as large as ``out``
            # starts where it does.)
            if (
                (hidden is out or hidden.base is out)
                and hidden.size == out.size
                and hidden.shape[-1] == out.shape[-1]
                and hidden.dtype == out.dtype
                and hidden.flags.c_contiguous
            ):
                return logits.reshape(*hidden.shape[:-1], logits.shape[-1])
        return self.lm_head(hidden)


def _panel_payload(linear: Linear) -> CompiledPayload | None:
    """The compiled payload of ``linear`` when it is a whole q* / k* matrix whose large batches run on the panel
    kernels, else None."""
    if type(linear) is not QuantizedLinear:
        return None
    compiled = linear.compiled_payload
    if compiled is None or compiled.layout.method.family == "int" or compiled.panels is None:
        return None
    if (compiled.rows, compiled.cols) != (linear.rows, linear.cols):
        return None
    return compiled


def _paneled(linear: Linear, x: F32) -> CompiledPayload | None:
    """The compiled payload whose panel kernels ``linear`` would multiply ``x`` by, else None."""
    compiled = _panel_payload(linear)
    if compiled is None or x.shape[-1] != compiled.cols:
        return None
    assert isinstance(linear, QuantizedLinear)
    return None if x.size // x.shape[-1] <= linear.gemv_max_batch else compiled


#: Rows of a chunk from which its attention, norms and SwiGLU are shared between the model's threads: below, a
#: parallel region's start costs more than the work.
_SHARED_ROWS = 16


def _prefill_threads(layers: Sequence[DecoderLayer]) -> int:
    """The threads a prompt's attention, norms and SwiGLU are shared between: the most any of the layers' products
    uses (their ``threads``, at most numba's thread count) when every product of a prompt runs on the panel kernels
    (numba's threads), else one. A product on BLAS's threads (decoded tiles, float32 or int* matrices) would then
    alternate with numba's threads, and each team polls for a while after its work on the cores the other needs."""
    from ._compiled import MAX_THREADS

    linears = [linear for layer in layers for linear in _layer_linears(layer)]
    if not linears or not all(_panel_payload(linear) is not None for linear in linears):
        return 1
    most = max(getattr(linear, "threads", 1) for linear in linears)
    return max(1, min(int(most), MAX_THREADS))


def _layer_linears(layer: DecoderLayer) -> tuple[Linear, ...]:
    return (layer.q_proj, layer.k_proj, layer.v_proj, layer.o_proj, layer.gate_proj, layer.up_proj, layer.down_proj)
