"""A decode step in one parallel region: `DecodeRegion` gathers a model's matrices into the tables `_step.decode_step`
reads and runs it on a `_team.Team` of the model's ``threads``.

A model qualifies when every matrix of every layer is a whole (unsplit) q* / k* matrix multiplied by the compiled
kernels and has no bias, and the model is not a part of a model split across processes; anything else keeps
`LlamaModel`'s step of one call per operation.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt

from ._kernels import QuantizedLinear
from ._packed import CompiledPayload
from ._weights import QuantizedEmbedding

__all__ = ["F32", "DecodeRegion", "build_region"]

F32 = npt.NDArray[np.float32]
_Scalar = TypeVar("_Scalar", bound=np.generic)
#: A step's `_serve.Generation`, the helpers' loop's arguments and the caller's compiled entry (`_generation`).
_Found = tuple[Any, tuple[Any, ...], Callable[..., int]]


def _payload(linear: object) -> CompiledPayload | None:
    """The compiled payload of a whole block-quantized matrix, else None."""
    if type(linear) is not QuantizedLinear:
        return None
    compiled = linear.compiled_payload
    if compiled is None or compiled.layout.method.family == "int":
        return None
    layout = compiled.layout
    if (compiled.rows, compiled.cols) != (layout.rows, layout.cols):
        return None
    return compiled


def _readonly(array: npt.NDArray[_Scalar]) -> npt.NDArray[_Scalar]:
    """A read-only view: every payload of the typed list, and the final norm, then have one numba type whatever
    built the model (mapped files are read-only, weights made in memory are not): the step is compiled once."""
    view = array.view()
    view.flags.writeable = False
    return view


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class _Work:
    """A region's work arrays for one shape: ``shared`` (q, k, v, attended, projected, gate, up, activated) and
    ``own`` (`_step.decode_step`'s), and the step's inputs as the helpers' loop reads them (`_serve`): ``ids``,
    ``hidden`` (embeddings the caller gives), ``cos`` / ``sin``, ``steps`` and a ``logits`` of the logits' shape."""

    shared: tuple[F32, ...]
    own: tuple[Any, ...]
    ids: npt.NDArray[np.int64]
    hidden: F32
    cos: F32
    sin: F32
    steps: npt.NDArray[np.int64]
    logits: F32


class DecodeRegion:
    """The tables and work arrays of one model's `_step.decode_step`, and the team that runs it."""

    def __init__(self, model: Any, payloads: list[CompiledPayload], threads: int) -> None:
        from numba.typed import List

        from . import _serve, _step
        from ._compiled import activation_shapes
        from ._team import Team

        self._step = _step
        self._serve = _serve
        self._activation_shapes = activation_shapes
        config = model.config
        self.head_dim = config.head_dim
        self.hidden = config.hidden_size
        self.heads, self.kv_heads = model.heads, model.kv_heads
        self.inter = config.intermediate_size
        self.eps = np.float32(config.rms_norm_eps)
        self.payloads = List([_readonly(p.payload) for p in payloads])
        self.metas = np.ascontiguousarray(np.stack([p.meta for p in payloads]))
        self.widths = np.array([p.layout.bits for p in payloads], dtype=np.int64)
        self.norms = np.ascontiguousarray(
            np.stack([np.stack([layer.input_norm, layer.post_attention_norm]) for layer in model.layers]),
            dtype=np.float32,
        )
        self.final_norm = _readonly(np.ascontiguousarray(model.final_norm, dtype=np.float32))
        self.layers = len(model.layers)
        self.team = Team(threads, _step.step_counters(self.layers, threads))
        self.head = _payload(model.lm_head)
        self.vocab = self.head.rows if self.head is not None else 0
        no_table = (_readonly(np.zeros(0, np.uint8)), np.zeros(10, np.int64))
        self._head = (_readonly(self.head.payload), self.head.meta) if self.head is not None else no_table
        self.embedding = _embedding_payload(model.embedding)
        self._table = (_readonly(self.embedding.payload), self.embedding.meta) if self.embedding else no_table
        self._rows = self.embedding.rows if self.embedding is not None else 0
        self._lookup = model.embedding
        self._inv_freq = np.ascontiguousarray(model._inv_freq, dtype=np.float32)
        self._no_ids = np.zeros(0, np.int64)
        self._buffers: dict[tuple[int, int, int], _Work] = {}
        #: `_generation`'s last inputs (the cache arrays, the scale, the rows, whether the threads decode the
        #: embeddings) and what it gave (cleared when the work arrays are).
        self._last: tuple[F32, F32, npt.NDArray[np.bool_], np.float32, int, bool, _Work, _Found] | None = None
        #: `_serve.run_step`'s compiled entry by the numba type of its generation (`_compiled`).
        self._entries: dict[Any, Callable[..., int]] = {}

        self._lock = threading.Lock()

    @classmethod
    def build(cls, model: Any, *, threads: int | None = None) -> DecodeRegion | None:
        """The region of ``model`` (a `_llama.LlamaModel`), or None when it does not qualify (module docstring).
        Its team has the matrices' ``threads`` (at most numba's thread count, the CPU count by default), or
        ``threads`` if given."""
        if model.kv_heads != model.config.num_kv_heads or model.reduce.__name__ != "_unchanged":
            return None
        payloads: list[CompiledPayload] = []
        most = 1
        for layer in model.layers:
            if layer.o_bias is not None or layer.down_bias is not None:
                return None
            linears = (layer.q_proj, layer.k_proj, layer.v_proj, layer.o_proj, layer.gate_proj, layer.up_proj,
                       layer.down_proj)  # fmt: skip
            for linear in linears:
                compiled = _payload(linear)
                if compiled is None:
                    return None
                payloads.append(compiled)
                most = max(most, linear.threads)
        if not payloads:
            return None
        if threads is None:
            from ._compiled import MAX_THREADS

            threads = min(most, MAX_THREADS)
        return cls(model, payloads, max(1, threads))

    def _work(self, m: int, capacity: int, rotary: int) -> _Work:
        """The work arrays for ``m`` rows, a cache of ``capacity`` slots and rotary tables ``[m, rotary]`` (kept
        per shape)."""
        found = self._buffers.get((m, capacity, rotary))
        if found is not None:
            return found
        if len(self._buffers) > 8:
            self._buffers.clear()
            self._last = None
        team, h, d = self.team.size, self.hidden, self.head_dim
        q_width, kv_width = self.heads * d, self.kv_heads * d
        blocks = max(-(-width // 32) for width in (h, q_width, self.inter))
        if self.head is not None:
            blocks = max(blocks, self.head.blocks)
        row = self.embedding.width if self.embedding is not None else 0
        xq, xs, xe = self._activation_shapes(m, blocks)
        own = (
            np.zeros((team, m, h), np.float32),
            np.zeros((team, m, h), np.float32),
            np.zeros((team, *xq), np.int16),
            np.zeros((team, *xs), np.float32),
            np.zeros((team, *xe), np.float32),
            np.zeros((team, *xs), np.float32),
            np.zeros((team, d), np.float32),
            np.zeros((team, d), np.float32),
            np.zeros((team, capacity), np.float32),
            np.zeros((team, 1, row), np.float32),
        )
        shared = (
            np.zeros((m, q_width), np.float32),
            np.zeros((m, kv_width), np.float32),
            np.zeros((m, kv_width), np.float32),
            np.zeros((m, q_width), np.float32),
            np.zeros((m, h), np.float32),
            np.zeros((m, self.inter), np.float32),
            np.zeros((m, self.inter), np.float32),
            np.zeros((m, self.inter), np.float32),
        )
        found = self._buffers[(m, capacity, rotary)] = _Work(
            shared=shared,
            own=own,
            ids=np.zeros(m, np.int64),
            hidden=np.zeros((m, h), np.float32),
            cos=np.zeros((m, rotary), np.float32),
            sin=np.zeros((m, rotary), np.float32),
            steps=np.zeros(self._serve.STEPS, np.int64),
            logits=np.zeros((m, self.vocab), np.float32),
        )
        return found

    def _generation(
        self, m: int, embeds: bool, keys: F32, values: F32, key_mask: npt.NDArray[np.bool_], scale: np.float32
    ) -> tuple[_Work, _Found]:
        """The work arrays for ``m`` rows and this cache, their `_serve.Generation`, the helpers' loop's arguments
        (`_serve.serve_steps`) and how the caller calls `_serve.run_step` on it (`_compiled`): the same objects while
        the inputs do not change, so that the helpers stay in their loop and the caller's call unboxes one object for
        all of them. The steps of a generation pass the same cache arrays, so the last inputs are recognised by
        identity alone: the caller's Python between steps is serial at every thread count, and runs on caches the
        step has just evicted."""
        last = self._last
        if (
            last is not None
            and last[0] is keys
            and last[1] is values
            and last[2] is key_mask
            and last[3] is scale
            and last[4] == m
            and last[5] == embeds
        ):
            return last[6], last[7]
        work = self._work(m, keys.shape[3], self._inv_freq.size)
        serves = (self.payloads, self.metas, self.widths, self.norms, self.final_norm, self.eps, self._table,
                  work.ids if embeds else self._no_ids, work.hidden, work.cos, work.sin, keys, values, key_mask,
                  work.steps, scale, *work.shared, work.hidden, self._head, work.logits, work.own)  # fmt: skip
        team = self.team
        generation = self._serve.generation(serves, work.ids, self._inv_freq, self._rows if embeds else 0,
                                            team.control, team.board, team.size)  # fmt: skip
        kind = generation._numba_type_
        entry = self._entries.get(kind)
        if entry is None:
            entry = self._entries[kind] = self._compiled(kind, serves)
        found = (generation, serves, entry)
        self._last = (keys, values, key_mask, scale, m, embeds, work, found)
        return work, found

    def _compiled(self, kind: Any, serves: tuple[Any, ...]) -> Callable[..., int]:
        """`_serve.run_step`'s compiled entry for a generation of numba type ``kind``: numba's dispatcher would type
        every argument of every call, on caches the step has just evicted, where the entry only unboxes them. It
        and the helpers' loop on ``serves`` are compiled (or loaded from numba's cache) here, before a run is
        posted, so no thread of the team waits at a barrier for another's compilation."""
        import numba
        from numba.core import types

        ids, floats = types.Array(types.int64, 2, "C"), types.Array(types.float32, 2, "C")
        counts = types.Array(types.int64, 1, "C")
        self._serve.serve_steps.compile((numba.typeof(serves), counts, counts, *[types.int64] * 4))
        signature = (kind, ids, ids, types.int64, floats, floats, types.int64, types.int64)
        entry: Callable[..., int] = self._serve.run_step.compile(signature)
        return entry

    def step(
        self,
        input_ids: npt.NDArray[np.int64],
        positions: npt.NDArray[np.int64],
        keys: F32,
        values: F32,
        key_mask: npt.NDArray[np.bool_],
        slot: int,
        scale: np.float32,
    ) -> tuple[F32, F32 | None]:
        """The final-normed hidden states ``[m, h]`` of the new tokens ``input_ids [m, 1]`` at rotary ``positions
        [m, 1]`` and their logits ``[m, vocab]`` (None when the output head is not a whole block matrix). The
        threads decode the tokens' embeddings from a quantized table when they can (ids in range), else the model's
        `Embedding` looks them up (and reports bad ids). The cache: ``keys`` / ``values [layers, m, kv, capacity,
        d]``, its real slots ``key_mask [m, capacity]``, the new one ``slot``; ``scale``: the model's attention
        scale (the same every step)."""
        m = input_ids.shape[0]
        # C-contiguous int64, the layout the compiled entry (`_compiled`) was made for.
        input_ids = np.ascontiguousarray(input_ids, dtype=np.int64)
        positions = np.ascontiguousarray(positions, dtype=np.int64)
        out = np.empty((m, self.hidden), dtype=np.float32)
        logits = np.empty((m, self.vocab), dtype=np.float32)
        serve = self._serve.serve_steps
        with self._lock:  # the work arrays serve one step at a time
            embeds = self._rows > 0
            while True:
                work, (generation, serves, entry) = self._generation(m, embeds, keys, values, key_mask, scale)
                if not embeds:
                    work.hidden[:] = self._lookup(input_ids).reshape(m, -1)
                args = (generation, input_ids, positions, slot, out, logits)
                if self.team.run_posting(entry, args, serve=serve, serves=serves) != self._serve.NEEDS_EMBEDDINGS:
                    break
                embeds = False
        return out, (logits if self.vocab else None)


def _embedding_payload(embedding: object) -> CompiledPayload | None:
    """The embedding table as a compiled payload when it is a whole q* / k* table (its rows are then decoded by the
    threads of the step, with the same bits as `QuantizedEmbedding`'s decoder), else None."""
    from ._packed import compiled_kernels

    if type(embedding) is not QuantizedEmbedding or embedding.layout.method.family == "int":
        return None
    kernels = compiled_kernels()
    if kernels is None:
        return None
    layout = embedding.layout
    return CompiledPayload(kernels, embedding.payload, layout, (0, layout.rows), (0, layout.cols))


def build_region(model: Any) -> DecodeRegion | None:
    """`DecodeRegion.build`, with a warning instead of an exception when building fails."""
    try:
        return DecodeRegion.build(model)
    except Exception as exc:
        warnings.warn(f"mcf runner: decode step in one region unavailable: {exc}", RuntimeWarning, stacklevel=2)
        return None
