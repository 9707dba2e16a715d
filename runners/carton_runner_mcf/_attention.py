"""Attention of one new token per row, split by cache positions for the threads of a decode step (`_step`).

A unit of work is one part of one kv head's positions, for all the query heads that share that kv head: the
positions ``0 .. slot`` (the cache and the new slot) are cut into `PARTS` contiguous parts of as equal sizes as can
be (`part_bounds`). `attend_part` reads each of its part's cached keys and values once for all those query heads
and computes, per query head, the part's largest score, the sum of the exponentials of its scores against that
largest and the sum of the values weighted by them. `attend_unit` then counts the part done for its kv head (an
atomic add on a counter per kv head), and the thread that finishes a kv head's last part merges the parts of each
of its query heads (`merge_parts`) into the head's output, always part 0 first, then 1, ..., rescaled to the largest
of all. So a head's output is the same arithmetic whichever threads ran its parts and in whatever order, at any
thread count: the number of parts never depends on the team.

The part that holds the new slot rotates the kv head's new key itself and stores the new key and value in the cache;
no other unit reads the new slot from the cache, so no unit waits for another.
"""

from __future__ import annotations

import math

import numba
import numpy as np

from ._atomics import SLOT, atomic_add
from ._blocks import JIT
from ._fused import _rotate

__all__ = ["PARTS", "attend_part", "attend_unit", "merge_parts", "part_bounds"]

#: Parts of each kv head's positions: a unit of attention is one. The same at every thread count (the merge's order
#: is then fixed); enough that two or three threads share a layer's kv heads evenly.
PARTS = 4

_FAST = {**JIT, "fastmath": {"reassoc", "contract"}}


@numba.njit(**JIT)
def part_bounds(positions, part):  # type: ignore[no-untyped-def]
    """Positions ``first .. last - 1`` of part ``part`` of ``positions`` positions (`PARTS` parts, possibly empty)."""
    return positions * part // PARTS, positions * (part + 1) // PARTS


@numba.njit(**_FAST)
def _dot(a, b):  # type: ignore[no-untyped-def]
    total = np.float32(0.0)
    for i in range(a.size):
        total += a[i] * b[i]
    return total


@numba.njit(**_FAST)
def attend_part(  # type: ignore[no-untyped-def]
    layer, b, g, part, q, k, v, cos, sin, keys, values, key_mask, slot, scale, query, key, acc, scores, partials
):
    """Part ``part`` of kv head ``g`` of batch row ``b``, for each of its query heads ``head``: the largest score, the
    sum of the weights and the weighted values into ``partials`` (done, largest ``[rows, PARTS]``, sums ``[rows,
    PARTS]``, weighted ``[rows, PARTS, d]``, row ``b * heads + head``). ``query`` / ``acc [groups, d]``, ``key
    [d]``, ``scores [groups, capacity]``: the thread's own buffers (the weighted values are summed in ``acc``, not
    in the shared array, whose neighbouring parts other threads write meanwhile)."""
    _, largest_all, sums, weighted = partials
    groups, d = query.shape
    heads = q.shape[1] // d
    first, last = part_bounds(slot + 1, part)
    cached = min(last, slot)  # the part's positions before the new slot are read from the cache
    holds_slot = last > slot
    for member in range(groups):
        head = g * groups + member
        _rotate(q[b, head * d : (head + 1) * d], cos[b], sin[b], query[member], scale)
    new_value = v[b, g * d : (g + 1) * d]
    if holds_slot:
        _rotate(k[b, g * d : (g + 1) * d], cos[b], sin[b], key, np.float32(1.0))
        keys[layer, b, g, slot, :] = key
        values[layer, b, g, slot, :] = new_value
        for member in range(groups):
            scores[member, slot] = _dot(query[member], key)
    # Indexed in place rather than through a row view per position and head: the views cost more than the
    # products of a short part.
    for s in range(first, cached):
        if key_mask[b, s]:
            for member in range(groups):
                total = np.float32(0.0)
                for i in range(d):
                    total += query[member, i] * keys[layer, b, g, s, i]
                scores[member, s] = total
    for member in range(groups):
        largest = np.float32(-np.inf)
        for s in range(first, cached):
            if key_mask[b, s]:
                largest = max(largest, scores[member, s])
        if holds_slot:
            largest = max(largest, scores[member, slot])
        denominator = np.float32(0.0)
        for s in range(first, cached):
            if key_mask[b, s]:
                weight = np.float32(math.exp(scores[member, s] - largest))
                scores[member, s] = weight
                denominator += weight
        if holds_slot:
            weight = np.float32(math.exp(scores[member, slot] - largest))
            scores[member, slot] = weight
            denominator += weight
        row = b * heads + g * groups + member
        largest_all[row, part] = largest
        sums[row, part] = denominator
    acc[:, :] = 0.0
    for s in range(first, cached):
        if key_mask[b, s]:
            for member in range(groups):
                weight = scores[member, s]
                for i in range(d):
                    acc[member, i] += weight * values[layer, b, g, s, i]
    if holds_slot:
        for member in range(groups):
            weight = scores[member, slot]
            for i in range(d):
                acc[member, i] += weight * new_value[i]
    for member in range(groups):
        weighted[b * heads + g * groups + member, part, :] = acc[member]


@numba.njit(**JIT)
def merge_parts(row, partials, dest):  # type: ignore[no-untyped-def]
    """A query head's output ``dest [d]`` from its `PARTS` parts (row ``row`` of ``partials``), part 0 first."""
    _, largest_all, sums, weighted = partials
    top = np.float32(-np.inf)
    for part in range(PARTS):
        top = max(top, largest_all[row, part])
    dest[:] = 0.0
    total = np.float32(0.0)
    for part in range(PARTS):
        if sums[row, part] > 0.0:  # a part with no real position has no weight
            factor = np.float32(math.exp(largest_all[row, part] - top))
            total += sums[row, part] * factor
            for i in range(dest.size):
                dest[i] += weighted[row, part, i] * factor
    for i in range(dest.size):
        dest[i] /= total


@numba.njit(**JIT)
def attend_unit(  # type: ignore[no-untyped-def]
    layer, unit, q, k, v, cos, sin, keys, values, key_mask, slot, scale, query, key, acc, scores, partials, out
):
    """Unit ``unit`` of a layer's attention (``(b * kv + g) * PARTS + part``, ``kv = k.shape[1] // d``); the thread
    that finishes a kv head's last part in this layer merges its query heads into ``out [m, heads * d]``. The done
    counters (``partials[0]``, one per kv head of each batch row, `_atomics.SLOT` apart) count parts over the layers
    of a step and start it at zero."""
    groups, d = query.shape
    kv = k.shape[1] // d
    pair, part = unit // PARTS, unit % PARTS
    b, g = pair // kv, pair % kv
    attend_part(layer, b, g, part, q, k, v, cos, sin, keys, values, key_mask, slot, scale, query, key, acc, scores,
                partials)  # fmt: skip
    # The add publishes this part's partial sums; the thread whose add completes the kv head's count sees them all.
    if atomic_add(partials[0], pair * SLOT, 1) == PARTS * (layer + 1) - 1:
        heads = q.shape[1] // d
        for member in range(groups):
            head = g * groups + member
            merge_parts(b * heads + head, partials, out[b, head * d : (head + 1) * d])
