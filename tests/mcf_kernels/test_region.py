"""The decode step in one parallel region (`_region`, `_step`, `_team`, `_atomics`): equal to the step of one call per
operation on every method and odd sizes, the same at one thread and several, no deadlock when threads outnumber
the work, and a failed thread that ends the run instead of hanging it."""

from __future__ import annotations

import time
import warnings

import numpy as np
import pytest
from carton.mcf import dequantize, quantize
from carton_runner_mcf._config import DecoderConfig
from carton_runner_mcf._decoder import DecoderLayer, positions_from_mask
from carton_runner_mcf._kernels import QuantizedLinear
from carton_runner_mcf._llama import LlamaModel
from carton_runner_mcf._weights import Embedding, FloatEmbedding, FloatLinear, Linear, QuantizedEmbedding

numba = pytest.importorskip("numba", reason="numba is not installed (pip install 'carton-runtime[mcf]')")
from carton_runner_mcf import _atomics, _region, _serve, _step, _team  # noqa: E402 - after the skip
from carton_runner_mcf._packed import KERNELS_ENV, compiled_kernels  # noqa: E402

pytestmark = pytest.mark.skipif(compiled_kernels("auto") is None, reason=f"{KERNELS_ENV} forces the numpy path")

BLOCK_METHODS = ["q8", "q4", "k6", "k4", "k3", "k2"]


def _config(hidden: int, inter: int, layers: int, heads: int, kv_heads: int, head_dim: int) -> DecoderConfig:
    return DecoderConfig(
        vocab_size=97, hidden_size=hidden, intermediate_size=inter, num_layers=layers, num_heads=heads,
        num_kv_heads=kv_heads, head_dim=head_dim, rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling_factor=1.0,
        max_position_embeddings=512, tie_word_embeddings=False, attention_bias=False, mlp_bias=False,
        bos_token_id=None, eos_token_ids=(), pad_token_id=None, model_type="llama",
    )  # fmt: skip


def _model(
    method: str,
    threads: int,
    *,
    hidden: int = 64,
    inter: int = 160,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 16,
    kernels: str = "numba",
    float_o: bool = False,
    quantized_embedding: bool = False,
) -> LlamaModel:
    """A random decoder whose matrices are quantized with ``method`` (the same weights for any ``threads``)."""
    config = _config(hidden, inter, layers, heads, kv_heads, head_dim)
    rng = np.random.default_rng(5)

    def linear(rows: int, cols: int) -> Linear:
        w = rng.standard_normal((rows, cols)).astype(np.float32) / np.sqrt(cols)
        return QuantizedLinear.from_quantized(quantize(w, method), threads=threads, kernels=kernels)

    def norm() -> np.ndarray:
        return (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32)

    blocks = []
    for _ in range(layers):
        q, k, v = (linear(rows, hidden) for rows in (heads * head_dim, kv_heads * head_dim, kv_heads * head_dim))
        o = linear(hidden, heads * head_dim)
        if float_o:  # a float matrix: the model does not qualify for the region
            o = FloatLinear(rng.standard_normal((hidden, heads * head_dim)).astype(np.float32))
        blocks.append(
            DecoderLayer(
                input_norm=norm(), q_proj=q, k_proj=k, v_proj=v,
                o_proj=o,
                post_attention_norm=norm(), gate_proj=linear(inter, hidden), up_proj=linear(inter, hidden),
                down_proj=linear(hidden, inter),
            )
        )  # fmt: skip
    table = rng.standard_normal((config.vocab_size, hidden)).astype(np.float32)
    embedding: Embedding = FloatEmbedding(table)
    if quantized_embedding:
        embedding = _quantized_embedding(table, method)
    return LlamaModel(config, embedding=embedding, layers=blocks, final_norm=norm(), lm_head=linear(97, hidden))


def _quantized_embedding(table: np.ndarray, method: str) -> QuantizedEmbedding:
    """``table`` quantized with ``method`` as the loader builds it (rows decoded by `carton.mcf.dequantize`)."""
    tensor = quantize(table, method)
    cols = table.shape[1]

    def decode(sub: np.ndarray, count: int) -> np.ndarray:
        return dequantize(sub, tensor.method, (count, cols), domain=tensor.domain)

    return QuantizedEmbedding(np.frombuffer(tensor.payload, dtype=np.uint8), layout=tensor.layout, dequantize=decode)


def _decode(model: LlamaModel, region: object, *, batch: int = 1, steps: int = 5) -> np.ndarray:
    """Logits of a padded prompt's prefill and of ``steps`` greedy decode steps, ``[steps + 1, batch, vocab]``.
    ``region``: None for the step of one call per operation, True to let the model build its region, or a region."""
    model._region = region  # type: ignore[assignment]
    rng = np.random.default_rng(3)
    ids = rng.integers(0, model.config.vocab_size, (batch, 7))
    mask = np.ones(ids.shape, dtype=bool)
    mask[1:, :2] = False  # rows after the first are left-padded: their padding slots are never attended
    cache = model.new_cache(batch, 4)  # small, so that decoding grows the cache
    positions = positions_from_mask(mask)
    hidden = model.prefill(ids, positions, mask, cache)
    logits = [model.logits(hidden[:, -1])]
    position = positions[:, -1:] + 1
    for _ in range(steps):
        token = np.argmax(logits[-1], axis=-1)[:, None]
        hidden = model.forward(token, position, np.ones((batch, 1), dtype=bool), cache)
        logits.append(model.logits(hidden[:, 0]))
        position = position + 1
    return np.stack(logits)


def _close(got: np.ndarray, want: np.ndarray) -> None:
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))


@pytest.mark.parametrize("method", BLOCK_METHODS)
def test_region_equals_the_step_of_one_call_per_operation(method: str) -> None:
    one, two = _model(method, 1), _model(method, 2)
    reference = _decode(one, None, batch=2)
    by_one = _decode(one, True, batch=2)
    assert isinstance(one._region, _region.DecodeRegion) and one._region.team.size == 1
    by_two = _decode(two, True, batch=2)
    assert isinstance(two._region, _region.DecodeRegion)
    assert two._region._entries  # the caller calls the compiled entry of `_serve.run_step`, not the dispatcher
    _close(by_one, reference)
    # every row of every product, every head and norm is computed by the same compiled code whichever thread runs it
    np.testing.assert_array_equal(by_two, by_one)


@pytest.mark.parametrize("method", BLOCK_METHODS)
def test_the_threads_decode_a_quantized_embedding_as_its_lookup_does(method: str) -> None:
    """With a quantized embedding table the step's threads decode the new tokens' rows themselves: the same bits
    as the model's own lookup (which the per-operation step uses), so the same logits at one thread and two."""
    model = _model(method, 1, hidden=80, quantized_embedding=True)
    region = _region.DecodeRegion.build(model, threads=2)
    assert region is not None and region.embedding is not None
    ids = np.array([0, 5, 96], dtype=np.int64)
    assert _prepare(region, ids) and not _prepare(region, np.array([97])) and not _prepare(region, np.array([-1]))
    rows = np.zeros((3, 80), np.float32)
    _step._embed((region.embedding.payload, region.embedding.meta), ids, np.zeros((1, region.embedding.width),
                 np.float32), rows)  # fmt: skip
    np.testing.assert_array_equal(rows, model.embedding(ids))
    reference = _decode(model, None, batch=2)
    by_one = _decode(model, _region.DecodeRegion.build(model, threads=1), batch=2)
    _close(by_one, reference)
    np.testing.assert_array_equal(_decode(model, region, batch=2), by_one)


def _prepare(region: _region.DecodeRegion, ids: np.ndarray) -> bool:
    """Whether the step's threads would decode the embeddings of ``ids`` themselves (`_serve.prepare`)."""
    m = ids.size
    cos, sin = np.zeros((m, region.head_dim // 2), np.float32), np.zeros((m, region.head_dim // 2), np.float32)
    return bool(
        _serve.prepare(ids.reshape(m, 1), np.zeros((m, 1), np.int64), np.ones(region.head_dim // 2, np.float32),
                       region.embedding.rows if region.embedding else 0, np.zeros(m, np.int64), cos, sin,
                       np.zeros(_serve.STEPS, np.int64), 0, np.zeros((m, 1), np.float32))
    )  # fmt: skip


def test_the_rotary_tables_of_a_step_are_the_models() -> None:
    """`_serve.prepare` computes a step's rotary tables as the model's `_rotary` does (to the last bit or two)."""
    model = _model("q4", 1, head_dim=64)
    positions = np.array([[0], [1], [517], [30000]], np.int64)
    half = model.config.head_dim // 2
    cos, sin = np.zeros((4, half), np.float32), np.zeros((4, half), np.float32)
    steps, logits = np.zeros(_serve.STEPS, np.int64), np.zeros((4, 3), np.float32)
    ids = np.zeros(4, np.int64)
    _serve.prepare(positions + 1, positions, model._inv_freq, 0, ids, cos, sin, steps, 9, logits)
    want_cos, want_sin = model._rotary(positions)
    np.testing.assert_allclose(cos, want_cos.reshape(4, half), rtol=0, atol=1e-6)
    np.testing.assert_allclose(sin, want_sin.reshape(4, half), rtol=0, atol=1e-6)
    np.testing.assert_array_equal(ids, positions[:, 0] + 1)
    assert steps[_serve.SLOT_INDEX] == 9 and steps[_serve.LOGITS_ADDRESS] == logits.ctypes.data


def test_the_step_keeps_its_logits_for_its_own_hidden_state_only() -> None:
    """The logits computed in the step's run answer `logits` of the returned hidden state (whole or its rows), once;
    any other array goes through the head."""
    model = _model("q4", 2)
    model._region = True  # type: ignore[assignment]
    cache = model.new_cache(2, 8)
    ids = np.array([[3], [4]])
    hidden = model.forward(ids, np.zeros((2, 1), np.int64), np.ones((2, 1), dtype=bool), cache)
    assert not hidden.flags.writeable
    kept = model._stepped
    assert kept is not None
    copy = hidden[:, 0].copy()
    np.testing.assert_array_equal(model.logits(hidden[:, 0]), kept[1])
    assert model._stepped is None
    np.testing.assert_array_equal(model.logits(copy), kept[1])  # the head itself, on equal input: equal rows


@pytest.mark.parametrize("method", ["q4", "k3"])
def test_odd_sizes(method: str) -> None:
    """Columns that end inside a block (and a k* super-block), heads that do not divide among the threads, a single
    kv head for five query heads, more kv rows than a unit of work."""
    model = _model(method, 1, hidden=80, inter=100, layers=3, heads=5, kv_heads=1, head_dim=16)
    reference = _decode(model, None, batch=3, steps=4)
    for threads in (1, 2, 3):
        region = _region.DecodeRegion.build(model, threads=threads)
        assert region is not None and region.team.size == threads
        _close(_decode(model, region, batch=3, steps=4), reference)
        assert model._region is region


def test_more_threads_than_work_finish() -> None:
    """Four threads on two cores and products of one unit each: the idle threads pass every barrier."""
    model = _model("q4", 1, hidden=32, inter=32, layers=2, heads=2, kv_heads=1, head_dim=16)
    reference = _decode(model, None)
    region = _region.DecodeRegion.build(model, threads=4)
    _close(_decode(model, region), reference)
    assert model._region is region


def test_models_that_do_not_qualify_keep_the_per_operation_step(kernels: str) -> None:
    model = _model("q4", 2, kernels=kernels)
    _decode(model, True, steps=1)
    assert (model._region is None) == (kernels == "numpy")  # the numpy fallback has no region
    assert _region.DecodeRegion.build(_model("q4", 2, float_o=True)) is None


def _stuck(control: np.ndarray, worker: int, team: int) -> int:
    """Worker 0 waits at a barrier; every other worker fails before reaching it."""
    if worker:
        raise RuntimeError("helper failed")
    return 0 if _atomics.barrier(control, 0, team) == 1 else 1


def test_a_failed_helper_ends_the_run_instead_of_hanging_it() -> None:
    team = _team.Team(2, 1)
    start = time.monotonic()
    with pytest.raises(_team.TeamFailed) as failed:
        team.run(_stuck, ())
    assert time.monotonic() - start < 10
    assert isinstance(failed.value.__cause__, RuntimeError)
    assert team.broken
    with pytest.raises(_team.TeamFailed):
        team.run(_stuck, ())


def test_a_failed_team_falls_back_with_a_warning() -> None:
    model = _model("k4", 2)
    reference = _decode(model, None, steps=2)
    region = _region.DecodeRegion.build(model)
    assert region is not None
    region.team._broken = True
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        got = _decode(model, region, steps=2)
    assert any("falls back" in str(w.message) for w in seen)
    assert model._region is None
    _close(got, reference)


@numba.njit(nogil=True)
def _leave(control, worker, team):  # type: ignore[no-untyped-def]
    """A worker's end of the region: the first waits for the others' departures (1 if it gave up), they depart."""
    if worker == 0:
        return 0 if _atomics.wait_departures(control, team) else 1
    _atomics.depart(control)
    return 0


@numba.njit(nogil=True)
def _take_all(control, into, worker, team):  # type: ignore[no-untyped-def]
    """Units of counter 0 until ``into.size``, recorded (plus one) in this worker's ``into``."""
    count = 0
    while True:
        unit = _atomics.take(control, 0)
        if unit >= into.size:
            break
        into[count] = unit + 1
        count += 1
    return _leave(control, worker, team)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_the_counter_hands_out_every_unit_once(threads: int) -> None:
    team = _team.Team(threads, 1)
    seen = np.zeros((threads, 4000), dtype=np.int64)

    def hand_out(control: np.ndarray, worker: int, size: int) -> int:
        return int(_take_all(control, seen[worker], worker, size))

    for _ in range(3):  # the control array is reset between runs
        seen[:] = 0
        team.run(hand_out, ())
        taken = np.sort(seen[seen > 0]) - 1
        np.testing.assert_array_equal(taken, np.arange(4000))


@numba.njit(nogil=True)
def _take_shares(control, units, most, into, worker, team, idle):  # type: ignore[no-untyped-def]
    """Chunks of ``units`` units by shares of at most ``most`` chunks, recorded in this worker's ``into`` (first unit
    + 1, last unit, the share it came from); worker ``idle`` takes none (it stands for a thread descheduled for the
    whole phase)."""
    count, share = 0, 0
    while worker != idle:
        first, last, share = _atomics.take_share(control, 0, units, most, team, worker, share)
        if first < 0:
            break
        into[count, 0] = first + 1
        into[count, 1] = last
        into[count, 2] = share
        count += 1
    return _leave(control, worker, team)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("idle", [-1, 1])
@pytest.mark.parametrize(("units", "most"), [(1000, 16), (30, 3), (5, 4)])
def test_shares_hand_out_every_unit_once(threads: int, idle: int, units: int, most: int) -> None:
    """Each unit once, in chunks of a worker's own share from its front in order, and a worker that takes nothing
    leaves its share to the others (taken from its back)."""
    team = _team.Team(threads, threads)
    seen = np.zeros((threads, units + 1, 3), dtype=np.int64)

    def hand_out(control: np.ndarray, worker: int, size: int) -> int:
        return int(_take_shares(control, units, most, seen[worker], worker, size, idle))

    for _ in range(3):  # the control array is reset between runs
        seen[:] = 0
        team.run(hand_out, ())
        chunks = seen[seen[:, :, 0] > 0]
        assert np.all(chunks[:, 1] > chunks[:, 0] - 1)  # no empty chunk
        covered = np.concatenate([np.arange(first - 1, last) for first, last, _ in chunks])
        np.testing.assert_array_equal(np.sort(covered), np.arange(units))
        for worker in range(threads):
            mine = seen[worker][seen[worker, :, 0] > 0]
            own = mine[mine[:, 2] == 0]
            begin, end = units * worker // threads, units * (worker + 1) // threads
            assert own.size == 0 or own[0, 0] - 1 == begin
            np.testing.assert_array_equal(own[1:, 0] - 1, own[:-1, 1])  # front to back, no gap
            assert len(own) <= most
            stolen = mine[mine[:, 2] > 0]
            assert not np.any((stolen[:, 0] - 1 >= begin) & (stolen[:, 0] - 1 < end))
            for owner in range(threads):
                begin, end = units * owner // threads, units * (owner + 1) // threads
                from_owner = stolen[(stolen[:, 0] - 1 >= begin) & (stolen[:, 0] - 1 < end)]
                np.testing.assert_array_equal(from_owner[1:, 1], from_owner[:-1, 0] - 1)  # back to front, no gap
        if 0 < idle < threads:
            assert not seen[idle].any()
