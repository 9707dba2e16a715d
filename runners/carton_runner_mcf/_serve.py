"""The helpers' compiled loop of decode steps (`_team`'s ``serve``): a helper of a `_region.DecodeRegion`'s team runs
`_step.decode_step` for every step of a generation without returning to Python between them; and what the caller
computes before each step (`prepare`), in one compiled call.

The loop's arguments are the step's, except the two that change every step: the new slot's index and the address
of the step's logits (a new array each step, which the caller keeps alive until the run ends), read from ``steps``
(`SLOT_INDEX`, `LOGITS_ADDRESS`) when a run is posted. The other per-step inputs (ids, rotary tables, embeddings)
are copied by the caller into arrays the loop holds.
"""

from __future__ import annotations

import math

import numba
import numpy as np

from ._atomics import await_run, leave, pointer_like
from ._blocks import JIT
from ._step import decode_step

__all__ = ["LOGITS_ADDRESS", "SLOT_INDEX", "STEPS", "prepare", "serve_steps"]

#: ``steps[SLOT_INDEX]``: the new slot of the cache.
SLOT_INDEX = 0
#: ``steps[LOGITS_ADDRESS]``: the address of the step's logits, a C-contiguous float32 array shaped like ``logits``.
LOGITS_ADDRESS = 1
#: Elements of ``steps``.
STEPS = 2


@numba.njit(**JIT)
def prepare(input_ids, positions, inv_freq, rows, ids, cos, sin, steps, slot, logits):  # type: ignore[no-untyped-def]
    """The caller's inputs of a step: ``ids [m]`` from ``input_ids [m, 1]``, the rotary tables ``cos`` / ``sin [m,
    d / 2]`` of ``positions [m, 1]`` (the inverse frequencies ``inv_freq [d / 2]``), and into ``steps`` the new
    ``slot`` and the address of ``logits``. Returns whether every id is a row of an embedding table of ``rows`` rows
    (the threads can decode them)."""
    known = rows > 0
    for j in range(ids.size):
        token = input_ids[j, 0]
        ids[j] = token
        known &= 0 <= token < rows
        position = np.float32(positions[j, 0])
        for i in range(inv_freq.size):
            angle = position * inv_freq[i]
            cos[j, i] = math.cos(angle)
            sin[j, i] = math.sin(angle)
    steps[SLOT_INDEX] = slot
    steps[LOGITS_ADDRESS] = logits.ctypes.data
    return known


@numba.njit(**JIT)
def serve_steps(serves, control, board, epoch, seen, worker, team):  # type: ignore[no-untyped-def]
    """A helper's loop (`_team`): `decode_step` on ``serves`` (its arguments up to ``own``, ``steps`` in place of
    ``slot``, ``logits`` a template of the logits' shape) for every run posted on ``epoch``; returns the last
    run's generation when it must return to Python (`_atomics.await_run`)."""
    (payloads, metas, widths, norms, final_norm, eps, embedding, ids, hidden_in, cos, sin, keys, values, key_mask,
     steps, scale, q, k, v, attended, projected, gate, up, activated, out, head, logits, own) = serves  # fmt: skip
    while True:
        generation = await_run(board, epoch, seen, worker)
        if generation == seen:
            return seen
        seen = generation
        into = numba.carray(pointer_like(steps[LOGITS_ADDRESS], logits), logits.shape)
        status = decode_step(
            payloads, metas, widths, norms, final_norm, eps, embedding, ids, hidden_in, cos, sin, keys, values,
            key_mask, steps[SLOT_INDEX], scale, q, k, v, attended, projected, gate, up, activated, out, head,
            into, own, control, worker, team,
        )  # fmt: skip
        if status != 0:
            leave(board, worker)
            return seen
