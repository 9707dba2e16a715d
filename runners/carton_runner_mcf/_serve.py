"""The step's compiled entries on both sides of a `_region.DecodeRegion`'s team: the helpers' loop of decode steps
(`_team`'s ``serve``), in which a helper runs `_step.decode_step` for every step of a generation without returning
to Python between them, and the caller's step (`run_step`), which computes the step's inputs, posts the step to the
helpers and runs its own part, in one compiled call.

What does not change between the steps of a generation (the weights' tables, the cache, the work arrays, the team's
``control`` and ``board``) is gathered once into a `Generation`, a numba structure that a compiled call unboxes as
one object, so a step's call passes only what changes: the new tokens, their positions, the new slot and the step's
two outputs. The helpers' loop reads the two per-step scalars, the new slot's index and the address of the step's
logits (a new array each step, which the caller keeps alive until the run ends), from ``steps`` (`SLOT_INDEX`,
`LOGITS_ADDRESS`) once a run is posted; ids and rotary tables reach it through arrays it holds.
"""

from __future__ import annotations

import math
from typing import Any

import numba
import numpy as np
from numba.core import types
from numba.experimental import structref

from ._atomics import await_run, claim, leave, pointer_like, post
from ._blocks import JIT
from ._step import decode_step
from ._team import CLAIM, POSTED, UNCLAIMED

__all__ = [
    "LOGITS_ADDRESS",
    "NEEDS_EMBEDDINGS",
    "SLOT_INDEX",
    "STEPS",
    "Generation",
    "generation",
    "prepare",
    "run_step",
    "serve_steps",
]

#: ``steps[SLOT_INDEX]``: the new slot of the cache.
SLOT_INDEX = 0
#: ``steps[LOGITS_ADDRESS]``: the address of the step's logits, a C-contiguous float32 array shaped like ``logits``.
LOGITS_ADDRESS = 1
#: Elements of ``steps``.
STEPS = 2
#: `run_step` returns this, before posting anything, when an id is not a row of the generation's embedding table: the
#: model's `Embedding` must look the tokens up (and report bad ids), and a generation without a table run the step
#: (below `_team.UNCLAIMED`: `_team.Team.run_posting` returns it).
NEEDS_EMBEDDINGS = -2
# The caller's worker index, an int64 rather than a literal 0: the helpers' loop (`serve_steps`) calls `decode_step`
# with an int64 worker, and a literal here would make numba compile the whole step a second time for the caller.
_CALLER = np.int64(0)


@structref.register
class _GenerationType(types.StructRef):  # type: ignore[misc,name-defined]
    def preprocess_fields(self, fields: Any) -> tuple[tuple[str, Any], ...]:
        return tuple((name, types.unliteral(kind)) for name, kind in fields)  # type: ignore[attr-defined]


class Generation(structref.StructRefProxy):  # type: ignore[misc]
    """What the steps of one generation share (module docstring): ``serves`` (`serve_steps`'s arguments), the
    caller's ``ids`` array, the rotary inverse frequencies ``inv_freq``, the embedding table's ``rows`` (0: the
    caller fills ``hidden_in`` itself), and the team's ``control``, ``board`` and size ``team``. Built by
    `generation`."""


structref.define_proxy(Generation, _GenerationType, ["serves", "ids", "inv_freq", "rows", "control", "board", "team"])


@numba.njit(**JIT)
def generation(serves, ids, inv_freq, rows, control, board, team):  # type: ignore[no-untyped-def]
    """A `Generation` (compiled and cached, where the proxy's own constructor would be compiled in every process)."""
    return Generation(serves, ids, inv_freq, rows, control, board, team)


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
def run_step(generation, input_ids, positions, slot, out, logits, epoch, mode):  # type: ignore[no-untyped-def]
    """The caller's step (worker 0) on ``generation`` (`_team.Team.run_posting`): unless ``mode`` is
    `_team.POSTED`, the step's inputs first (`prepare`; the new tokens ``input_ids [m, 1]`` at ``positions [m, 1]``,
    the new ``slot``), then with `_team.CLAIM` the run posted on ``epoch`` when every helper waits in its loop (else,
    and with `_team.PREPARE`, `_team.UNCLAIMED`); then `decode_step` with its outputs ``out [m, h]`` and ``logits``.
    Returns `decode_step`'s status, or `_team.UNCLAIMED` / `NEEDS_EMBEDDINGS` with nothing posted."""
    (payloads, metas, widths, norms, final_norm, eps, embedding, ids, hidden_in, cos, sin, keys, values, key_mask,
     steps, scale, q, k, v, attended, projected, gate, up, activated, _, head, _, own) = generation.serves  # fmt: skip
    control, board, team = generation.control, generation.board, generation.team
    if mode != POSTED:
        rows = generation.rows
        known = prepare(input_ids, positions, generation.inv_freq, rows, generation.ids, cos, sin, steps, slot, logits)
        if rows > 0 and not known:
            return NEEDS_EMBEDDINGS
        if mode != CLAIM or not claim(board, team):
            return UNCLAIMED
        post(control, board, epoch)
    return decode_step(
        payloads, metas, widths, norms, final_norm, eps, embedding, ids, hidden_in, cos, sin, keys, values, key_mask,
        slot, scale, q, k, v, attended, projected, gate, up, activated, out, head, logits, own, control, _CALLER, team,
    )  # fmt: skip


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
