"""The decode step's attention split by cache positions (`_attention`): parts that cover every position once, the
same bits whatever order and threads run the units in, one merge per head, and a float64 reference."""

from __future__ import annotations

import numpy as np
import pytest

numba = pytest.importorskip("numba", reason="numba is not installed (pip install 'carton[mcf]')")
from carton_runner_mcf import _atomics, _attention, _team  # noqa: E402 - after the skip

BATCH, KV, GROUPS, D, LAYERS = 2, 2, 3, 16, 2
HEADS = KV * GROUPS


@pytest.mark.parametrize("positions", [1, 2, 3, 4, 5, 7, 64, 129])
def test_parts_cover_every_position_once(positions: int) -> None:
    covered = np.concatenate([np.arange(*_attention.part_bounds(positions, p)) for p in range(_attention.PARTS)])
    np.testing.assert_array_equal(covered, np.arange(positions))


def _inputs(slot: int, capacity: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(slot)
    mask = np.ones((BATCH, capacity), dtype=bool)
    mask[1, : min(3, slot)] = False  # a left-padded row: its padding slots are never attended
    return {
        "q": rng.standard_normal((BATCH, HEADS * D)).astype(np.float32),
        "k": rng.standard_normal((BATCH, KV * D)).astype(np.float32),
        "v": rng.standard_normal((BATCH, KV * D)).astype(np.float32),
        "cos": rng.standard_normal((BATCH, D // 2)).astype(np.float32),
        "sin": rng.standard_normal((BATCH, D // 2)).astype(np.float32),
        "keys": rng.standard_normal((LAYERS, BATCH, KV, capacity, D)).astype(np.float32),
        "values": rng.standard_normal((LAYERS, BATCH, KV, capacity, D)).astype(np.float32),
        "mask": mask,
    }


def _buffers(threads: int, capacity: int) -> tuple[tuple[np.ndarray, ...], tuple[np.ndarray, ...]]:
    rows = BATCH * HEADS
    partials = (
        np.zeros(BATCH * KV * _atomics.SLOT, np.int64),
        np.zeros((rows, _attention.PARTS), np.float32),
        np.zeros((rows, _attention.PARTS), np.float32),
        np.zeros((rows, _attention.PARTS, D), np.float32),
    )
    own = (
        np.zeros((threads, GROUPS, D), np.float32),
        np.zeros((threads, D), np.float32),
        np.zeros((threads, GROUPS, D), np.float32),
        np.zeros((threads, GROUPS, capacity), np.float32),
    )
    return partials, own


@numba.njit(nogil=True)
def _units(layer, order, x, slot, scale, own, worker, partials, out):  # type: ignore[no-untyped-def]
    q, k, v, cos, sin, keys, values, mask = x
    query, key, acc, scores = own
    for unit in order:
        _attention.attend_unit(layer, unit, q, k, v, cos, sin, keys, values, mask, slot, scale, query[worker],
                               key[worker], acc[worker], scores[worker], partials, out)  # fmt: skip


def _args(x: dict[str, np.ndarray]) -> tuple[np.ndarray, ...]:
    return tuple(x[name] for name in ("q", "k", "v", "cos", "sin", "keys", "values", "mask"))


def _serial(x: dict[str, np.ndarray], slot: int, order: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Every layer's attention output, the units of each layer run in ``order`` by one thread; the done counters."""
    partials, own = _buffers(1, x["mask"].shape[1])
    outs = np.zeros((LAYERS, BATCH, HEADS * D), np.float32)
    for layer in range(LAYERS):
        _units(layer, order, _args(x), slot, np.float32(0.25), own, 0, partials, outs[layer])
    return outs, partials[0][:: _atomics.SLOT].copy()


def _rotate(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    first, second = x[: D // 2], x[D // 2 :]
    return np.concatenate((first * cos - second * sin, second * cos + first * sin))


def _reference(x: dict[str, np.ndarray], slot: int) -> np.ndarray:
    """Softmax attention in float64 over the real cached slots and the new one (whose key is rotated)."""
    out = np.zeros((LAYERS, BATCH, HEADS * D))
    for layer in range(LAYERS):
        for b in range(BATCH):
            cos, sin = x["cos"][b].astype(np.float64), x["sin"][b].astype(np.float64)
            for head in range(HEADS):
                g = head // GROUPS
                query = _rotate(x["q"][b, head * D : (head + 1) * D].astype(np.float64), cos, sin) * 0.25
                new_key = _rotate(x["k"][b, g * D : (g + 1) * D].astype(np.float64), cos, sin)
                real = [s for s in range(slot) if x["mask"][b, s]]
                keys = np.vstack([x["keys"][layer, b, g, real].astype(np.float64), new_key])
                values = np.vstack([x["values"][layer, b, g, real], x["v"][b, g * D : (g + 1) * D]])
                scores = keys @ query
                weights = np.exp(scores - scores.max())
                out[layer, b, head * D : (head + 1) * D] = weights @ values / weights.sum()
    return out


@pytest.mark.parametrize("slot", [0, 1, 2, 5, 40])
def test_any_order_of_units_gives_the_same_bits_and_the_reference(slot: int) -> None:
    """Parts that are empty (a short cache, a padded row) have no weight; every kv head is merged once per layer
    whatever order its parts finish in; the new key and value land in the cache."""
    capacity = slot + 3
    units = BATCH * KV * _attention.PARTS
    orders = [np.arange(units), np.arange(units)[::-1].copy(), np.random.default_rng(1).permutation(units)]
    results = []
    for order in orders:
        x = _inputs(slot, capacity)
        outs, done = _serial(x, slot, order)
        np.testing.assert_array_equal(done, LAYERS * _attention.PARTS)
        results.append(outs)
        for b in range(BATCH):
            for g in range(KV):
                key = _rotate(x["k"][b, g * D : (g + 1) * D], x["cos"][b], x["sin"][b])
                np.testing.assert_allclose(x["keys"][:, b, g, slot], np.broadcast_to(key, (LAYERS, D)), rtol=1e-6)
                value = x["v"][b, g * D : (g + 1) * D]
                np.testing.assert_array_equal(x["values"][:, b, g, slot], np.broadcast_to(value, (LAYERS, D)))
    for other in results[1:]:
        np.testing.assert_array_equal(other, results[0])
    want = _reference(_inputs(slot, capacity), slot)
    np.testing.assert_allclose(results[0], want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))


@numba.njit(nogil=True)
def _team_units(layer, units, x, slot, scale, own, partials, out, control, worker, team):  # type: ignore[no-untyped-def]
    """A layer's units handed out by a work counter, as the step hands them out; each taken unit recorded."""
    q, k, v, cos, sin, keys, values, mask = x
    query, key, acc, scores = own
    while True:
        unit = _atomics.take(control, 0)
        if unit >= units.size:
            break
        units[unit] += 1
        _attention.attend_unit(layer, unit, q, k, v, cos, sin, keys, values, mask, slot, scale, query[worker],
                               key[worker], acc[worker], scores[worker], partials, out)  # fmt: skip
    if worker == 0:
        return 0 if _atomics.wait_departures(control, team) else 1
    _atomics.depart(control)
    return 0


@pytest.mark.parametrize("threads", [2, 3])
def test_threads_hand_out_every_unit_once_and_give_one_threads_bits(threads: int) -> None:
    slot, capacity = 70, 80
    want, _ = _serial(_inputs(slot, capacity), slot, np.arange(BATCH * KV * _attention.PARTS))
    x = _inputs(slot, capacity)
    partials, own = _buffers(threads, capacity)
    team = _team.Team(threads, 1)
    for layer in range(LAYERS):
        units = np.zeros(BATCH * KV * _attention.PARTS, np.int64)
        out = np.zeros((BATCH, HEADS * D), np.float32)
        args = (layer, units, _args(x), slot, np.float32(0.25), own, partials, out)
        team.run(_team_units, args)
        np.testing.assert_array_equal(units, 1)
        np.testing.assert_array_equal(out, want[layer])
    np.testing.assert_array_equal(partials[0][:: _atomics.SLOT], LAYERS * _attention.PARTS)
    team.close()
