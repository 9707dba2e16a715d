"""The compiled element-wise operations of a prompt chunk (`_prefill`) against the numpy forms `_llama` uses without
them."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import pytest
from carton_runner_mcf._llama import LlamaModel

prefill = pytest.importorskip(
    "carton_runner_mcf._prefill", reason="numba is not installed (pip install 'carton-runtime[mcf]')"
)


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


def _softmax_against_numpy(
    scores: npt.NDArray[np.float32], key_mask: npt.NDArray[np.bool_], start: int, groups: int
) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.float32]]:
    """The compiled causal softmax of ``scores [batch, kv, groups * seq, start + seq]`` and numpy's softmax over the
    same scores plus `LlamaModel._causal_bias`, in the latter's shape, checked to agree."""
    batch, kv, _, end = scores.shape
    seq = end - start
    got = np.full_like(scores, np.nan)
    prefill.softmax(scores, key_mask, start, got)
    want = scores.reshape(batch, kv, groups, seq, end) + LlamaModel._causal_bias(key_mask, start, seq)
    want -= want.max(axis=-1, keepdims=True)
    np.exp(want, out=want)
    want /= want.sum(axis=-1, keepdims=True)
    got = got.reshape(want.shape)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    return got, want


@pytest.mark.parametrize(("batch", "start", "seq"), [(1, 0, 128), (2, 5, 7), (1, 3, 1)])
def test_causal_softmax_matches_the_biased_numpy_softmax(batch: int, start: int, seq: int) -> None:
    rng = np.random.default_rng(4)
    kv, groups = 3, 2
    end = start + seq
    scores = (rng.standard_normal((batch, kv, groups * seq, end)) * 6).astype(np.float32)
    key_mask = np.ones((batch, end + 4), dtype=bool)
    key_mask[0, 0] = False  # a padding slot in the cache
    key_mask[-1, end - 1] = False  # a padding query: it still attends to itself
    _softmax_against_numpy(scores, key_mask, start, groups)


@pytest.mark.parametrize(("start", "seq"), [(0, 33), (17, 40)])
def test_causal_softmax_skips_every_padding_slot(start: int, seq: int) -> None:
    """Padding slots scattered through the cache and the chunk (left-padded rows of a batch, or a cache holding
    several prompts' padding) get zero weight and take no part in a row's maximum or sum."""
    rng = np.random.default_rng(5)
    batch, kv, groups = 2, 3, 3
    end = start + seq
    scores = (rng.standard_normal((batch, kv, groups * seq, end)) * 6).astype(np.float32)
    scores[..., ::7] += 40.0  # the largest scores of many rows fall on slots that are padding in some of them
    key_mask = rng.random((batch, end + 3)) > 0.3
    got, want = _softmax_against_numpy(scores, key_mask, start, groups)
    own = (start + np.arange(seq))[:, None] == np.arange(end)[None, :]
    padding = ~key_mask[:, None, None, None, :end] & ~own
    assert padding.any()
    assert not got[np.broadcast_to(padding, want.shape)].any()


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
