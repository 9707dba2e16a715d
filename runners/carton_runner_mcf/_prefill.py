"""Compiled (numba) forms of a prompt chunk's element-wise work: the causal softmax of attention over the prompt and
SwiGLU.

numpy makes several passes over the arrays for each (add the causal bias, subtract the maximum, exponentiate, sum,
divide; negate, exponentiate, add, divide, multiply), with temporaries, all on the calling thread while BLAS's
threads wait for the next product. These make one pass per row with an exponential that LLVM vectorizes (`exp`: a
range reduction to ``2**n * exp(r)`` with ``|r| <= ln 2 / 2`` and Cephes' ``expf`` polynomial, within a couple of
float32 ulps of the exact value), and release the GIL. They run on the calling thread: handing them to a team of
threads between two BLAS calls cost more than it saved (docs/performance.md, issue 20).
"""

from __future__ import annotations

import numba
import numpy as np

from ._simd import float_of_bits

__all__ = ["exp", "softmax", "swiglu"]

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
def softmax(scores, key_mask, start, out):  # type: ignore[no-untyped-def]
    """Causal softmax of attention scores into ``out`` (same shape, not ``scores`` itself): ``scores [batch, kv,
    groups * seq, start + seq]`` holds, for query ``t`` of the chunk (row ``g * seq + t``), its scores against cache
    slots ``0 .. start + seq``; its row of ``out`` becomes the weights over slots ``s <= start + t`` that
    ``key_mask [batch, >= start + seq]`` marks real (and slot ``start + t`` itself), zero elsewhere."""
    batch, kv, rows, end = scores.shape
    seq = end - start
    for b in range(batch):
        for g in range(kv):
            for r in range(rows):
                _softmax_row(scores[b, g, r], key_mask[b], start + r % seq, out[b, g, r])


@numba.njit(**_JIT)
def swiglu(gate, up, out):  # type: ignore[no-untyped-def]
    """``out = gate / (1 + exp(-gate)) * up`` (SiLU(gate) times up) for ``[rows, width]`` arrays (``out`` not one
    of the others)."""
    rows, width = gate.shape
    for i in range(rows):
        g, u, o = gate[i], up[i], out[i]
        for c in range(width):
            o[c] = g[c] / (np.float32(1.0) + exp(-g[c])) * u[c]
