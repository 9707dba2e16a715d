"""A whole single-token decode step as one compiled function that every thread of a `_team.Team` runs at once.

Per layer, five phases separated by barriers (`_atomics.barrier`); in each, work is handed out by atomic counters,
so a thread that starts late or is descheduled only does less of it:

1. q, k, v rows: the phase's rows (the three matrices' groups of `ROWS` rows, one after the other) are cut into
   one contiguous share per thread, which the thread takes a chunk at a time from the front; a thread done with its
   share takes the others' chunks from their back (`_atomics.take_share`), so each thread streams its own rows'
   codes in one run, and one descheduled mid-phase holds up only its current chunk;
2. attention, one unit per (row of the batch, query head), the units cut into one contiguous share per thread and
   taken one at a time the same way (a thread's heads then mostly share kv heads, whose cached keys and values
   stay in its core's caches): rotary embedding of its query and of its kv head's new key, scores over the cache
   and the new slot, softmax, the weighted values; the first query head of a kv head also stores the new key and
   value in the cache;
3. o rows, the same way;
4. gate and up rows together, the same way, each chunk finishing its rows' SwiGLU;
5. down rows, the same way.

What every thread needs whole and is cheap (the residual adds, the RMSNorms, rounding a product's input to int16)
each thread computes for itself into its own buffers, in the same order, so no barrier is spent on it and every
thread holds the same bits. A row of a product is always computed whole by the same kernel as the serial path
(`_compiled`), so results do not depend on the number of threads.

Before the first layer each thread decodes the new tokens' embedding rows from a quantized table itself; after the
last, each computes the final RMSNorm and the output head's rows are handed out by shares like a layer's.
"""

from __future__ import annotations

import math

import numba
import numpy as np

from ._atomics import barrier, depart, take_share, wait_departures
from ._blocks import JIT
from ._compiled import _decode_rows, _matmul_rows, quantize
from ._fused import _rotate, rms_norm, softmax_weights
from ._nibble import nibble_rows

__all__ = ["ABORTED", "CHUNKS", "CHUNK_ROWS", "MATRICES", "ROWS", "decode_step", "rows_of", "step_counters"]

#: A chunk of a product is a whole number of groups of ``ROWS`` rows.
ROWS = 32
#: Chunks of each thread's share of a phase's rows (a layer's products, the output head) when the team has two
#: threads or more, at most: enough that a thread descheduled mid-phase leaves most of its share to the others.
CHUNKS = 16
#: Rows of a chunk, at least: a call of the row kernels over fewer rows of a layer's matrix costs noticeably more
#: per row than one over the whole matrix (docs/performance.md, "decode threads, third pass").
CHUNK_ROWS = 128
#: Matrices of a layer, in the order of the step's tables: q, k, v, o, gate, up, down.
MATRICES = 7
#: What a team function returns when a barrier was aborted.
ABORTED = 1
_PHASES = 5  # phases per layer, each with one work counter per thread

_FAST = {**JIT, "fastmath": {"reassoc", "contract"}}


@numba.njit(**JIT)
def rows_of(payload, meta, width, xq, xs, xe, xoff, y, first, last):  # type: ignore[no-untyped-def]
    """Rows ``first..last`` of ``y = x @ W.T`` for ``width``-bit codes known only at run time (activations already
    rounded by `_compiled.quantize` for that width)."""
    if width == 4:
        nibble_rows(payload, meta, xq, xs, xe, xoff, y, first, last)
    elif width == 8:
        _matmul_rows(payload, meta, xq, xs, y, first, last, 8)
    elif width == 6:
        _matmul_rows(payload, meta, xq, xs, y, first, last, 6)
    elif width == 3:
        _matmul_rows(payload, meta, xq, xs, y, first, last, 3)
    else:
        _matmul_rows(payload, meta, xq, xs, y, first, last, 2)


@numba.njit(**_FAST)
def _dot(a, b):  # type: ignore[no-untyped-def]
    total = np.float32(0.0)
    for i in range(a.size):
        total += a[i] * b[i]
    return total


@numba.njit(**_FAST)
def _attend(layer, b, head, groups, q, k, v, cos, sin, keys, values, key_mask, slot, scale, query, key, scores, out):  # type: ignore[no-untyped-def]
    """Attention of query ``head`` of batch row ``b`` over the cache and the new slot (see the module)."""
    d = query.size
    g = head // groups
    _rotate(k[b, g * d : (g + 1) * d], cos[b], sin[b], key, np.float32(1.0))
    new_value = v[b, g * d : (g + 1) * d]
    if head % groups == 0:
        keys[layer, b, g, slot, :] = key
        values[layer, b, g, slot, :] = new_value
    _rotate(q[b, head * d : (head + 1) * d], cos[b], sin[b], query, scale)
    largest = _dot(query, key)
    scores[slot] = largest
    for s in range(slot):
        if key_mask[b, s]:
            total = _dot(query, keys[layer, b, g, s])
            scores[s] = total
            largest = max(largest, total)
    denominator = softmax_weights(scores, key_mask[b], slot, largest)
    dest = out[b, head * d : (head + 1) * d]
    weight = scores[slot] / denominator
    for i in range(d):
        dest[i] = weight * new_value[i]
    for s in range(slot):
        if key_mask[b, s]:
            weight = scores[s] / denominator
            for i in range(d):
                dest[i] += weight * values[layer, b, g, s, i]


@numba.njit(**JIT)
def _embed(embedding, ids, row, hidden):  # type: ignore[no-untyped-def]
    """Rows ``ids`` of the quantized embedding table ``embedding`` (payload, meta) into ``hidden [m, h]``, decoded
    through ``row`` (a float32 buffer of at least the table's padded width)."""
    payload, meta = embedding
    h, width = hidden.shape[1], meta[9]
    for j in range(ids.size):
        first, last = ids[j], ids[j] + 1
        if width == 4:
            _decode_rows(payload, meta, row, first, last, 4)
        elif width == 8:
            _decode_rows(payload, meta, row, first, last, 8)
        elif width == 6:
            _decode_rows(payload, meta, row, first, last, 6)
        elif width == 3:
            _decode_rows(payload, meta, row, first, last, 3)
        else:
            _decode_rows(payload, meta, row, first, last, 2)
        for c in range(h):
            hidden[j, c] = row[0, c]


@numba.njit(**JIT)
def _add(into, part):  # type: ignore[no-untyped-def]
    m, n = into.shape
    for j in range(m):
        for c in range(n):
            into[j, c] += part[j, c]


@numba.njit(**_FAST)
def _swiglu_rows(gate, up, out, first, last):  # type: ignore[no-untyped-def]
    for j in range(gate.shape[0]):
        for r in range(first, last):
            g = gate[j, r]
            out[j, r] = g / (np.float32(1.0) + np.float32(math.exp(-g))) * up[j, r]


@numba.njit(**JIT)
def _groups(rows):  # type: ignore[no-untyped-def]
    return (rows + ROWS - 1) // ROWS


@numba.njit(**JIT)
def _most(groups, team):  # type: ignore[no-untyped-def]
    """Chunks of a thread's share of ``groups`` groups of `ROWS` rows, at most (`CHUNKS`, `CHUNK_ROWS`); a thread
    alone takes all at once."""
    if team == 1:
        return 1
    return max(1, min(CHUNKS, groups // team // (CHUNK_ROWS // ROWS)))


@numba.njit(**JIT)
def _rows_by_share(  # type: ignore[no-untyped-def]
    control, counter, tables, first_matrix, count, x, xq, xs, xe, xoff, y0, y1, y2, worker, team
):
    """The rows of matrices ``first_matrix ..`` (``count`` of them, outputs ``y0``, ``y1``, ``y2``; their groups of
    `ROWS` rows one after the other are the phase's units), by shares (`_atomics.take_share`) until every chunk is
    taken; ``x`` is rounded again only when the code width changes. ``tables``: payloads, metas, widths."""
    payloads, metas, widths = tables
    rounded = -1
    sizes = (y0.shape[1], y1.shape[1], y2.shape[1])
    ends = np.zeros(3, np.int64)  # a matrix's last group + 1 among the phase's units
    ends[0] = _groups(sizes[0])
    ends[1] = ends[0] + (_groups(sizes[1]) if count > 1 else 0)
    ends[2] = ends[1] + (_groups(sizes[2]) if count > 2 else 0)
    most = _most(ends[2], team)
    share = 0
    while True:
        first, last, share = take_share(control, counter, ends[2], most, team, worker, share)
        if first < 0:
            return
        for which in range(count):
            start = ends[which - 1] if which else 0
            low, high = max(first, start), min(last, ends[which])
            if low >= high:
                continue
            index = first_matrix + which
            width = widths[index]
            if width != rounded:
                quantize(x, width, xq, xs, xe, xoff)
                rounded = width
            y = y0 if which == 0 else (y1 if which == 1 else y2)
            rows_of(payloads[index], metas[index], width, xq, xs, xe, xoff, y, (low - start) * ROWS,
                    min(sizes[which], (high - start) * ROWS))  # fmt: skip


@numba.njit(**JIT)
def decode_step(  # type: ignore[no-untyped-def]
    payloads, metas, widths, norms, final_norm, eps, embedding, ids, hidden_in, cos, sin, keys, values, key_mask,
    slot, scale, q, k, v, attended, projected, gate, up, activated, out, head_table, logits, own, control, worker, team,
):  # fmt: skip
    """One decode step over every layer (module docstring) for the new tokens ``ids [m]``, whose embeddings each
    thread decodes from ``embedding`` (payload, meta), or, when ``ids`` is empty, for their embeddings ``hidden_in
    [m, h]``; worker 0 writes the final RMSNorm of the last hidden state into ``out [m, h]``, and the output head
    ``head_table`` (payload, meta) multiplies it into ``logits [m, vocab]`` unless that has no columns.

    Tables, per matrix ``7 * layer + i`` (q, k, v, o, gate, up, down): ``payloads`` (a typed list of uint8 arrays),
    ``metas [n, 10]`` (`_packed.CompiledPayload.meta`), ``widths [n]`` (code bits). ``norms [layers, 2, h]``: input
    and post-attention RMSNorm weights. ``keys`` / ``values [layers, m, kv, capacity, d]``: the cache, ``key_mask [m,
    capacity]`` its real slots (``slot``, the new one, included). ``q k v attended projected gate up activated``:
    shared work arrays. ``own``: this thread's work arrays, a tuple of ``[team, ...]`` arrays (hidden, normed, xq, xs,
    xe, xoff, query, key, scores, an embedding row)."""
    hidden_all, normed_all, xq_all, xs_all, xe_all, xoff_all, query_all, key_all, scores_all, row_all = own
    hidden, normed = hidden_all[worker], normed_all[worker]
    xq, xs, xe, xoff = xq_all[worker], xs_all[worker], xe_all[worker], xoff_all[worker]
    query, key, scores = query_all[worker], key_all[worker], scores_all[worker]
    m = hidden.shape[0]
    heads = q.shape[1] // query.size
    groups = heads // (k.shape[1] // query.size)
    if ids.size:
        _embed(embedding, ids, row_all[worker], hidden)
    else:
        hidden[:, :] = hidden_in
    passed = 0
    tables = (payloads, metas, widths)
    for layer in range(norms.shape[0]):
        base, counter = layer * MATRICES, layer * _PHASES * team
        rms_norm(hidden, norms[layer, 0], eps, normed)
        _rows_by_share(control, counter, tables, base, 3, normed, xq, xs, xe, xoff, q, k, v, worker, team)
        passed = barrier(control, passed, team)
        if passed < 0:
            return ABORTED
        share = 0
        while True:
            # One head a chunk, from contiguous shares (module docstring).
            unit, _, share = take_share(control, counter + team, m * heads, m * heads, team, worker, share)
            if unit < 0:
                break
            b, head = unit // heads, unit % heads
            _attend(layer, b, head, groups, q, k, v, cos, sin, keys, values, key_mask, slot, scale, query, key, scores,
                    attended)  # fmt: skip
        passed = barrier(control, passed, team)
        if passed < 0:
            return ABORTED
        _rows_by_share(control, counter + 2 * team, tables, base + 3, 1, attended, xq, xs, xe, xoff, projected,
                       projected, projected, worker, team)  # fmt: skip
        passed = barrier(control, passed, team)
        if passed < 0:
            return ABORTED
        _add(hidden, projected)
        rms_norm(hidden, norms[layer, 1], eps, normed)
        rounded = -1
        units = _groups(gate.shape[1])
        most = _most(units, team)
        share = 0
        while True:
            first, last, share = take_share(control, counter + 3 * team, units, most, team, worker, share)
            if first < 0:
                break
            first, last = first * ROWS, min(gate.shape[1], last * ROWS)
            for which in range(2):
                index = base + 4 + which
                if widths[index] != rounded:
                    quantize(normed, widths[index], xq, xs, xe, xoff)
                    rounded = widths[index]
                rows_of(payloads[index], metas[index], rounded, xq, xs, xe, xoff, gate if which == 0 else up, first,
                        last)  # fmt: skip
            _swiglu_rows(gate, up, activated, first, last)
        passed = barrier(control, passed, team)
        if passed < 0:
            return ABORTED
        _rows_by_share(control, counter + 4 * team, tables, base + 6, 1, activated, xq, xs, xe, xoff, projected,
                       projected, projected, worker, team)  # fmt: skip
        passed = barrier(control, passed, team)
        if passed < 0:
            return ABORTED
        _add(hidden, projected)
    rms_norm(hidden, final_norm, eps, out if worker == 0 else normed)
    if logits.shape[1]:
        # The output head in the same run: every thread has the same final norm (worker 0's is ``out``).
        head_payload, head_meta = head_table
        width = head_meta[9]
        quantize(out if worker == 0 else normed, width, xq, xs, xe, xoff)
        rows = logits.shape[1]
        units = _groups(rows)
        most = _most(units, team)
        share = 0
        while True:
            first, last, share = take_share(control, norms.shape[0] * _PHASES * team, units, most, team, worker, share)
            if first < 0:
                break
            rows_of(head_payload, head_meta, width, xq, xs, xe, xoff, logits, first * ROWS, min(rows, last * ROWS))
    if worker == 0:
        return 0 if wait_departures(control, team) else ABORTED
    depart(control)
    return 0


def step_counters(layers: int, team: int) -> int:
    """Work counters a `decode_step` over ``layers`` layers uses at ``team`` threads (the output head's last)."""
    return (layers * _PHASES + 1) * team
