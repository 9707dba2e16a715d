"""Compiled (numba) forms of a decode step's small operations: RMSNorm, rotary embedding with attention over the KV
cache for one new token, SwiGLU; and rotary embedding of a chunk of tokens (the keys of a prompt's last layer).

numpy spends a few microseconds on each of the few dozen small calls a layer makes for one token, as much as the
quantized products themselves on a small model (docs/performance.md, "Compiled kernels"), and all of it on the
calling thread, which bounds what threads give. These do the same float32 arithmetic in one call each; `_llama`
uses them for single-token steps when the compiled kernels are in use, and the norm and `rotary` for longer
chunks too (`_prefill` shares the norm's rows between threads). Attention sums in a different order than numpy's
matmul, so results agree to float32 rounding.
"""

from __future__ import annotations

import math

import numba
import numpy as np

__all__ = ["attend_one", "rms_norm", "rotary", "softmax_weights", "swiglu"]

# fastmath lets LLVM vectorize the sums (a dot product over head_dim, over hidden for the norm) by reassociating
# them; every other operation keeps IEEE semantics.
_JIT = {"nogil": True, "cache": True, "error_model": "numpy", "boundscheck": False, "fastmath": {"reassoc", "contract"}}


@numba.njit(**_JIT)
def rms_norm(x, weight, eps, out):  # type: ignore[no-untyped-def]
    """``out = x / sqrt(mean(x * x) + eps) * weight`` per row of ``x [n, h]`` (float32 throughout)."""
    n, h = x.shape
    for i in range(n):
        total = np.float32(0.0)
        for c in range(h):
            total += x[i, c] * x[i, c]
        root = np.float32(math.sqrt(total / np.float32(h) + eps))
        for c in range(h):
            out[i, c] = x[i, c] / root * weight[c]


@numba.njit(**_JIT)
def swiglu(gate, up, out):  # type: ignore[no-untyped-def]
    """``out = gate * sigmoid(gate) * up`` (SiLU(gate) times up), as ``gate / (1 + exp(-gate)) * up``."""
    flat_gate, flat_up, flat_out = gate.reshape(-1), up.reshape(-1), out.reshape(-1)
    for i in range(flat_gate.size):
        g = flat_gate[i]
        flat_out[i] = g / (np.float32(1.0) + np.float32(math.exp(-g))) * flat_up[i]


@numba.njit(**_JIT)
def rotary(x, cos, sin, out):  # type: ignore[no-untyped-def]
    """Rotary embedding of ``x [b, heads, seq, d]`` into ``out`` (same shape; may be a view such as a slice of the KV
    cache): the two halves of a head rotated by ``cos`` / ``sin [b, 1, seq, d / 2]``."""
    batch, heads, seq, d = x.shape
    half = d // 2
    for b in range(batch):
        for h in range(heads):
            for t in range(seq):
                for i in range(half):
                    first, second = x[b, h, t, i], x[b, h, t, half + i]
                    c, s = cos[b, 0, t, i], sin[b, 0, t, i]
                    out[b, h, t, i] = first * c - second * s
                    out[b, h, t, half + i] = second * c + first * s


@numba.njit(**_JIT)
def _rotate(source, cos, sin, dest, factor):  # type: ignore[no-untyped-def]
    half = source.size // 2
    for i in range(half):
        first, second = source[i], source[half + i]
        dest[i] = (first * cos[i] - second * sin[i]) * factor
        dest[half + i] = (second * cos[i] + first * sin[i]) * factor


@numba.njit(**_JIT)
def softmax_weights(scores, key_mask, slot, largest):  # type: ignore[no-untyped-def]
    """``scores[s] = exp(scores[s] - largest)`` for the slots ``s <= slot`` that ``key_mask`` marks real (and
    ``slot`` itself), zero for the others; returns their sum (the softmax's denominator)."""
    denominator = np.float32(0.0)
    for s in range(slot + 1):
        if s == slot or key_mask[s]:
            scores[s] = np.float32(math.exp(scores[s] - largest))
            denominator += scores[s]
        else:
            scores[s] = np.float32(0.0)
    return denominator


@numba.njit(**_JIT)
def attend_one(q, k, v, cos, sin, keys, values, key_mask, slot, scale, out):  # type: ignore[no-untyped-def]
    """One new token per row: rotary on ``q [b, heads, d]`` and ``k [b, kv, d]``, ``k`` and ``v`` stored in slot
    ``slot`` of ``keys`` / ``values [b, kv, capacity, d]``, then grouped-query attention of each query head over
    the slots ``<= slot`` that ``key_mask [b, capacity]`` marks real (and always its own), into ``out [b, heads *
    d]``. ``cos`` / ``sin`` are ``[b, d / 2]``."""
    batch, heads, d = q.shape
    kv = k.shape[1]
    groups = heads // kv
    query = np.empty(d, dtype=np.float32)
    scores = np.empty(slot + 1, dtype=np.float32)
    for b in range(batch):
        for g in range(kv):
            _rotate(k[b, g], cos[b], sin[b], keys[b, g, slot], np.float32(1.0))
            values[b, g, slot, :] = v[b, g]
            for member in range(groups):
                head = g * groups + member
                _rotate(q[b, head], cos[b], sin[b], query, scale)
                largest = np.float32(-np.inf)
                for s in range(slot + 1):
                    if s == slot or key_mask[b, s]:
                        total = np.float32(0.0)
                        for i in range(d):
                            total += query[i] * keys[b, g, s, i]
                        scores[s] = total
                        largest = max(largest, total)
                denominator = softmax_weights(scores, key_mask[b], slot, largest)
                dest = out[b, head * d : (head + 1) * d]
                dest[:] = 0.0
                for s in range(slot + 1):
                    weight = scores[s] / denominator
                    if weight != 0.0:
                        for i in range(d):
                            dest[i] += weight * values[b, g, s, i]
