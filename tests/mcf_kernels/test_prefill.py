"""The compiled operations of a prompt chunk outside the products (`_prefill`) against the numpy forms `_llama` uses
without them, and their threaded forms against the serial ones."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from carton_runner_mcf._llama import LlamaModel

prefill = pytest.importorskip(
    "carton_runner_mcf._prefill", reason="numba is not installed (pip install 'carton-runtime[mcf]')"
)
fused = pytest.importorskip("carton_runner_mcf._fused")


def test_exponential_is_within_a_few_ulps_and_clamped() -> None:
    x = np.linspace(-86.5, 87.5, 100_001, dtype=np.float32)
    got = np.empty_like(x)
    _exp_all(x, got)
    exact = np.exp(x.astype(np.float64))
    assert (np.abs(got - exact) / exact).max() < 4 * 2.0**-24  # a few float32 ulps
    extremes = np.array([-1e30, -200.0, 200.0, 1e30], dtype=np.float32)
    out = np.empty_like(extremes)
    _exp_all(extremes, out)
    assert np.isfinite(out).all() and out[0] == out[1] > 0 and out[2] == out[3] > 1e38


def _exp_all(x: np.ndarray, out: np.ndarray) -> None:
    # `exp` is inlined into compiled loops; from Python it is called per value.
    for i in range(x.size):
        out[i] = prefill.exp(x[i])


def _attention_in_numpy(
    q: npt.NDArray[np.float32],
    k: npt.NDArray[np.float32],
    v: npt.NDArray[np.float32],
    cos: npt.NDArray[np.float32],
    sin: npt.NDArray[np.float32],
    cache: tuple[npt.NDArray[np.float32], npt.NDArray[np.float32]],
    key_mask: npt.NDArray[np.bool_],
    start: int,
    scale: np.float32,
) -> npt.NDArray[np.float64]:
    """The numpy path's attention (`LlamaModel._apply_rotary`, `LlamaModel._causal_bias`), in float64 after the
    rotations, ``[batch, seq, heads * d]``."""
    batch, seq, heads, d = q.shape
    kv = k.shape[2]
    end = start + seq
    keys, values = (part.astype(np.float64) for part in cache)
    keys[:, :, start:end] = LlamaModel._apply_rotary(k.transpose(0, 2, 1, 3), cos, sin)
    values[:, :, start:end] = v.transpose(0, 2, 1, 3)
    rotated = LlamaModel._apply_rotary(q.transpose(0, 2, 1, 3), cos, sin) * scale
    grouped = rotated.reshape(batch, kv, heads // kv, seq, d).astype(np.float64)
    scores = np.einsum("bgmtd,bgsd->bgmts", grouped, keys[:, :, :end])
    scores = scores + LlamaModel._causal_bias(key_mask, start, seq)
    scores -= scores.max(axis=-1, keepdims=True)
    weights = np.exp(scores)
    weights /= weights.sum(axis=-1, keepdims=True)
    attended = np.einsum("bgmts,bgsd->bgmtd", weights, values[:, :, :end])
    out: npt.NDArray[np.float64] = attended.reshape(batch, heads, seq, d).transpose(0, 2, 1, 3).reshape(batch, seq, -1)
    return out


def _attention_case(
    batch: int, start: int, seq: int, heads: int, kv: int, d: int, seed: int
) -> tuple[tuple[Any, ...], npt.NDArray[np.bool_]]:
    """`attend`'s arguments for a cache of ``start`` earlier slots (some of them padding) and a chunk of ``seq``
    tokens (the last row's last token padding), and its key mask."""
    rng = np.random.default_rng(seed)
    end = start + seq
    q = rng.standard_normal((batch, seq, heads, d)).astype(np.float32) * 2
    k = rng.standard_normal((batch, seq, kv, d)).astype(np.float32) * 2
    v = rng.standard_normal((batch, seq, kv, d)).astype(np.float32)
    angles = rng.uniform(0, 6.3, (batch, 1, seq, d // 2))
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    keys = rng.standard_normal((batch, kv, end + 3, d)).astype(np.float32)
    values = rng.standard_normal((batch, kv, end + 3, d)).astype(np.float32)
    key_mask = rng.random((batch, end + 3)) > 0.25
    key_mask[-1, end - 1] = False  # a padding query: it still attends to itself
    keys_t = np.full((batch, kv, d, end), np.nan, dtype=np.float32)
    out = np.full((batch, seq, heads * d), np.nan, dtype=np.float32)
    args = (q, k, v, cos, sin, keys, values, keys_t, key_mask, start, np.float32(1 / np.sqrt(d)), out)
    return args, key_mask


CASES = [(1, 0, 128, 9, 3, 64), (2, 5, 7, 6, 2, 16), (1, 3, 1, 9, 3, 64), (1, 0, 1, 4, 4, 8), (2, 17, 37, 9, 3, 64)]


@pytest.mark.parametrize(("batch", "start", "seq", "heads", "kv", "d"), CASES)
def test_attention_matches_the_numpy_path(batch: int, start: int, seq: int, heads: int, kv: int, d: int) -> None:
    """Queries rotated and scaled, the chunk's keys rotated into the cache and its values stored, and each query's
    causal softmax over the real slots (and itself): the numpy path's computation, to float32 rounding."""
    args, _ = _attention_case(batch, start, seq, heads, kv, d, seed=seq)
    q, k, v, cos, sin, keys, values, _, key_mask, _, scale, out = args
    cache = (keys.copy(), values.copy())
    want = _attention_in_numpy(q, k, v, cos, sin, cache, key_mask, start, scale)
    prefill.attend(*args)
    np.testing.assert_allclose(out, want, rtol=0, atol=2e-5 * float(np.abs(want).max()))
    end = start + seq
    rotated = LlamaModel._apply_rotary(k.transpose(0, 2, 1, 3), cos, sin)
    np.testing.assert_allclose(keys[:, :, start:end], rotated, rtol=1e-6, atol=1e-6)
    assert np.array_equal(values[:, :, start:end], v.transpose(0, 2, 1, 3))
    # the slots before and after the chunk are left as they were
    assert np.array_equal(keys[:, :, :start], cache[0][:, :, :start])
    assert np.array_equal(values[:, :, end:], cache[1][:, :, end:])


def test_attention_gives_padding_slots_no_weight() -> None:
    """A padding slot's value, however large, does not reach any query's result (its weight is exactly zero)."""
    args, key_mask = _attention_case(2, 9, 20, 6, 3, 16, seed=7)
    values = args[6]
    padding = ~key_mask[:, :9]
    assert padding.any()
    values[:, :, :9][np.broadcast_to(padding[:, None, :, None], values[:, :, :9].shape)] = 1e30
    prefill.attend(*args)
    out = args[-1]
    assert np.isfinite(out).all() and float(np.abs(out).max()) < 100


@pytest.mark.parametrize(("batch", "start", "seq", "heads", "kv", "d"), CASES)
@pytest.mark.parametrize("parts", [1, 2, 3])
def test_shared_attention_equals_one_threads(
    batch: int, start: int, seq: int, heads: int, kv: int, d: int, parts: int
) -> None:
    """Split between threads, every value is the one the serial kernel computes, bit for bit (odd lengths, one
    token, more parts than kv heads)."""
    serial, _ = _attention_case(batch, start, seq, heads, kv, d, seed=seq)
    shared, _ = _attention_case(batch, start, seq, heads, kv, d, seed=seq)
    prefill.attend(*serial)
    prefill.attend_parallel(*shared, parts)
    for one, many in zip(serial, shared, strict=True):
        if isinstance(one, np.ndarray) and one.dtype == np.float32 and one.ndim == 4:
            assert np.array_equal(one, many, equal_nan=True)
    assert np.array_equal(serial[-1], shared[-1])


@pytest.mark.parametrize("rows", [1, 7, 128])
@pytest.mark.parametrize("parts", [1, 2, 3])
def test_shared_norm_and_swiglu_equal_one_threads(rows: int, parts: int) -> None:
    rng = np.random.default_rng(rows)
    x = (rng.standard_normal((rows, 96)) * 3).astype(np.float32)
    y = rng.standard_normal((rows, 96)).astype(np.float32)
    weight = rng.standard_normal(96).astype(np.float32)
    eps = np.float32(1e-5)
    one, many = np.empty_like(x), np.full_like(x, np.nan)
    fused.rms_norm(x, weight, eps, one)
    prefill.rms_norm_parallel(x, weight, eps, many, parts)
    assert np.array_equal(one, many)
    one, many = np.empty_like(x), np.full_like(x, np.nan)
    prefill.swiglu(x, y, one)
    prefill.swiglu_parallel(x, y, many, parts)
    assert np.array_equal(one, many)


def test_swiglu_rows() -> None:
    rng = np.random.default_rng(3)
    gate = (rng.standard_normal((5, 100)) * 8).astype(np.float32)
    gate[0, :3] = (-100.0, 100.0, 0.0)
    up = rng.standard_normal((5, 100)).astype(np.float32)
    out = np.empty_like(gate)
    prefill.swiglu(gate, up, out)
    with np.errstate(over="ignore"):  # exp(100) is inf in float32: SiLU is then 0, as it should be
        want = gate / (np.float32(1.0) + np.exp(-gate)) * up
    np.testing.assert_allclose(out, want, rtol=2e-6, atol=2e-6 * float(np.abs(want).max()))
