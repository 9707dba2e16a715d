"""Compiled (numba) forms of a prompt chunk's work outside the products: attention over the prompt (rotary, the
causal softmax, the weighted values) and SwiGLU, and both with the RMS norm shared across threads.

numpy makes several passes over the arrays for each (add the causal bias, subtract the maximum, exponentiate, sum,
divide; negate, exponentiate, add, divide, multiply), with temporaries, and its attention's batched matmuls are
small BLAS calls, all on the calling thread or on BLAS's own threads, which then poll on the cores that the next
product's threads need. These make one pass per row with an exponential that LLVM vectorizes (`exp`: a range
reduction to ``2**n * exp(r)`` with ``|r| <= ln 2 / 2`` and Cephes' ``expf`` polynomial, within a couple of float32
ulps of the exact value), release the GIL, and in their ``*_parallel`` forms share the rows (attention: units of a
query head and a block of queries, only the causal part of the scores) between numba's threads, the pool the
products use. Every value is computed by the same code whichever thread computes it, so results do not depend on
the thread count.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import prange

from ._fused import _rotate, rms_norm
from ._simd import float_of_bits

__all__ = [
    "QUERY_BLOCK",
    "attend",
    "attend_parallel",
    "exp",
    "rms_norm_parallel",
    "swiglu",
    "swiglu_parallel",
]

# fastmath lets LLVM vectorize the reductions (the row's maximum and sum) by reassociating them; nothing relies on
# infinities or NaNs being absent, the exponential's input is clamped first.
_JIT = {"nogil": True, "cache": True, "error_model": "numpy", "boundscheck": False, "fastmath": {"reassoc", "contract"}}

_LOG2E = np.float32(1.4426950408889634)
# ln 2 split in two so that ``x - n * ln 2`` is exact for the ``n`` of float32's range (Cephes' constants).
_LN2_HI = np.float32(0.693359375)
_LN2_LO = np.float32(-2.12194440e-4)
# Beyond these the result is below float32's smallest normal or above its largest: clamping keeps 2**n a normal.
_LOWEST = np.float32(-87.0)
_HIGHEST = np.float32(88.0)


@numba.njit(inline="always", **_JIT)
def exp(x):  # type: ignore[no-untyped-def]
    """``exp(x)`` of a float32 for loops that LLVM vectorizes (no branch, no call); inputs below -87 give
    ``exp(-87)`` (about 1.6e-38), above 88 give ``exp(88)``."""
    v = min(max(x, _LOWEST), _HIGHEST)
    n = np.floor(v * _LOG2E + np.float32(0.5))
    r = v - n * _LN2_HI - n * _LN2_LO
    p = np.float32(1.9875691500e-4)
    p = p * r + np.float32(1.3981999507e-3)
    p = p * r + np.float32(8.3334519073e-3)
    p = p * r + np.float32(4.1665795894e-2)
    p = p * r + np.float32(1.6666665459e-1)
    p = p * r + np.float32(5.0000001201e-1)
    p = p * r * r + r + np.float32(1.0)
    # times 2**n, built from its exponent bits
    return p * float_of_bits((np.int32(n) + np.int32(127)) << np.int32(23))


@numba.njit(**_JIT)
def _softmax_row(row, key_mask, last, out):  # type: ignore[no-untyped-def]
    """``out``: the softmax of ``row[: last + 1]`` over the slots ``key_mask`` marks real (and ``last`` itself), zero
    at every other slot."""
    # Masked slots are selected out rather than branched around, so that LLVM vectorizes every pass.
    lowest = np.float32(-np.inf)
    largest = row[last]
    for s in range(last):
        largest = max(largest, row[s] if key_mask[s] else lowest)
    total = np.float32(0.0)
    for s in range(last):
        value = exp(row[s] - largest) if key_mask[s] else np.float32(0.0)
        out[s] = value
        total += value
    out[last] = exp(row[last] - largest)
    total += out[last]
    inverse = np.float32(1.0) / total
    for s in range(last + 1):
        out[s] = out[s] * inverse
    out[last + 1 :] = np.float32(0.0)


@numba.njit(**_JIT)
def swiglu(gate, up, out):  # type: ignore[no-untyped-def]
    """``out = gate / (1 + exp(-gate)) * up`` (SiLU(gate) times up) for ``[rows, width]`` arrays (``out`` not one
    of the others)."""
    rows, width = gate.shape
    for i in range(rows):
        g, u, o = gate[i], up[i], out[i]
        for c in range(width):
            o[c] = g[c] / (np.float32(1.0) + exp(-g[c])) * u[c]


#: Queries of one attention unit (a row of the batch, a query head, this many consecutive queries): small enough that
#: a 128-token chunk has a few dozen units to share between threads, large enough that a unit's set-up is amortized.
QUERY_BLOCK = 16


#: Queries whose scores and weighted values are computed together, sharing each load of a key or a value.
_QUADS = 4


@numba.njit(**_JIT)
def _four_rows(a, b, k, m, out):  # type: ignore[no-untyped-def]
    """``out[:, :m] = a[:, :k] @ b[:k, :m]`` for the four rows of ``a``, two of ``b``'s rows per pass, the inner loop
    along a row of ``b``. The attention's scores (``a`` four queries, ``b`` the keys transposed, ``k`` the head's
    dimensions, ``m`` the slots) and its weighted values (``a`` their weights, ``b`` the values, ``k`` the slots,
    ``m`` the dimensions)."""
    out0, out1, out2, out3 = out[0], out[1], out[2], out[3]
    out[:, :m] = np.float32(0.0)
    i = 0
    while i + 2 <= k:
        b0, b1 = b[i], b[i + 1]
        x0, x1, x2, x3 = a[0, i], a[1, i], a[2, i], a[3, i]
        y0, y1, y2, y3 = a[0, i + 1], a[1, i + 1], a[2, i + 1], a[3, i + 1]
        for s in range(m):
            u, v = b0[s], b1[s]
            out0[s] += x0 * u + y0 * v
            out1[s] += x1 * u + y1 * v
            out2[s] += x2 * u + y2 * v
            out3[s] += x3 * u + y3 * v
        i += 2
    if i < k:
        b0 = b[i]
        x0, x1, x2, x3 = a[0, i], a[1, i], a[2, i], a[3, i]
        for s in range(m):
            u = b0[s]
            out0[s] += x0 * u
            out1[s] += x1 * u
            out2[s] += x2 * u
            out3[s] += x3 * u


@numba.njit(**_JIT)
def _store_keys(k, v, cos, sin, keys, values, keys_t, start, part, parts):  # type: ignore[no-untyped-def]
    """`attend`'s first phase, the (row, kv head) pairs ``part, part + parts, ...``: the chunk's keys rotated into
    the cache and its values stored, then the kv head's keys up to the chunk's end transposed for the scores
    (`_four_rows`)."""
    batch, seq, kv, d = k.shape
    end = start + seq
    for unit in range(part, batch * kv, parts):
        b, g = unit // kv, unit % kv
        for t in range(seq):
            _rotate(k[b, t, g], cos[b, 0, t], sin[b, 0, t], keys[b, g, start + t], np.float32(1.0))
            values[b, g, start + t, :] = v[b, t, g]
        for s in range(end):
            for i in range(d):
                keys_t[b, g, i, s] = keys[b, g, s, i]


@numba.njit(**_JIT)
def _attend_units(q, cos, sin, values, keys_t, key_mask, start, scale, out, part, parts):  # type: ignore[no-untyped-def]
    """`attend`'s second phase, the units ``part, part + parts, ...`` (a row of the batch, a query head, a block of
    `QUERY_BLOCK` queries), ordered block first so that every part gets blocks of every length alike."""
    batch, seq, heads, d = q.shape
    groups = heads // keys_t.shape[1]
    end = start + seq
    query = np.zeros((_QUADS, d), dtype=np.float32)
    scores = np.empty((_QUADS, end), dtype=np.float32)
    weights = np.zeros((_QUADS, end), dtype=np.float32)
    attended = np.empty((_QUADS, d), dtype=np.float32)
    units = (seq + QUERY_BLOCK - 1) // QUERY_BLOCK * batch * heads
    for unit in range(part, units, parts):
        block, rest = unit // (batch * heads), unit % (batch * heads)
        b, h = rest // heads, rest % heads
        g = h // groups
        for first in range(block * QUERY_BLOCK, min(seq, (block + 1) * QUERY_BLOCK), _QUADS):
            # Queries first .. first + 4 (fewer at the chunk's end: the rest of ``query`` and ``weights`` stay zero).
            count = min(_QUADS, seq - first)
            n = start + first + count  # the slots the last of them sees
            for j in range(count):
                t = first + j
                _rotate(q[b, t, h], cos[b, 0, t], sin[b, 0, t], query[j], scale)
            _four_rows(query, keys_t[b, g], d, n, scores)
            for j in range(count):
                _softmax_row(scores[j], key_mask[b], start + first + j, weights[j, :n])
            _four_rows(weights, values[b, g], n, d, attended)
            for j in range(count):
                out[b, first + j, h * d : (h + 1) * d] = attended[j]


@numba.njit(**_JIT)
def attend(q, k, v, cos, sin, keys, values, keys_t, key_mask, start, scale, out):  # type: ignore[no-untyped-def]
    """Attention over a chunk of the prompt: rotary on ``q [batch, seq, heads, d]`` (times ``scale``) and ``k
    [batch, seq, kv, d]``, the chunk's keys and values (``v``, same shape as ``k``) stored in slots ``start .. start
    + seq`` of ``keys`` / ``values [batch, kv, capacity, d]``, then for query ``t`` the causal softmax of its scores
    over the slots ``s <= start + t`` that ``key_mask [batch, >= start + seq]`` marks real (and its own), and the
    weighted values, into ``out [batch, seq, heads * d]``. ``cos`` / ``sin`` are ``[batch, 1, seq, d / 2]``;
    ``keys_t [batch, kv, d, >= start + seq]`` is a work array."""
    _store_keys(k, v, cos, sin, keys, values, keys_t, start, 0, 1)
    _attend_units(q, cos, sin, values, keys_t, key_mask, start, scale, out, 0, 1)


@numba.njit(parallel=True, **_JIT)
def attend_parallel(q, k, v, cos, sin, keys, values, keys_t, key_mask, start, scale, out, parts):  # type: ignore[no-untyped-def]
    """`attend` with its work shared between ``parts`` of numba's threads; every value is computed by the same code
    whichever thread computes it, so results do not depend on ``parts``."""
    for part in prange(parts):
        _store_keys(k, v, cos, sin, keys, values, keys_t, start, part, parts)
    for part in prange(parts):
        _attend_units(q, cos, sin, values, keys_t, key_mask, start, scale, out, part, parts)


@numba.njit(parallel=True, **_JIT)
def swiglu_parallel(gate, up, out, parts):  # type: ignore[no-untyped-def]
    """`swiglu` with the rows shared between ``parts`` of numba's threads (each row computed whole by one)."""
    rows = gate.shape[0]
    share = (rows + parts - 1) // parts
    for part in prange(parts):
        first, last = min(rows, part * share), min(rows, (part + 1) * share)
        swiglu(gate[first:last], up[first:last], out[first:last])


@numba.njit(parallel=True, **_JIT)
def rms_norm_parallel(x, weight, eps, out, parts):  # type: ignore[no-untyped-def]
    """`_fused.rms_norm` of ``x [n, h]`` into ``out`` with the rows shared between ``parts`` of numba's threads."""
    rows = x.shape[0]
    share = (rows + parts - 1) // parts
    for part in prange(parts):
        first, last = min(rows, part * share), min(rows, (part + 1) * share)
        rms_norm(x[first:last], weight, eps, out[first:last])
