"""The compiled small operations of a decoder step (`_fused`) against the numpy forms `_llama` uses without them."""

from __future__ import annotations

import numpy as np
import pytest
from carton_runner_mcf._llama import LlamaModel

fused = pytest.importorskip(
    "carton_runner_mcf._fused", reason="numba is not installed (pip install 'carton-runtime[mcf]')"
)


def _close(got: np.ndarray, want: np.ndarray) -> None:
    assert got.dtype == np.float32 and got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-6 * float(np.abs(want).max()))


@pytest.mark.parametrize("shape", [(1, 576), (7, 33), (128, 64)])
def test_rms_norm(shape: tuple[int, int]) -> None:
    rng = np.random.default_rng(1)
    x = rng.standard_normal(shape).astype(np.float32) * 3
    weight = rng.standard_normal(shape[1]).astype(np.float32)
    eps = np.float32(1e-5)
    out = np.empty_like(x)
    fused.rms_norm(x, weight, eps, out)
    variance = np.einsum("...i,...i->...", x, x)[..., None] / np.float32(x.shape[-1])
    _close(out, (x / np.sqrt(variance + eps)) * weight)


@pytest.mark.parametrize(("batch", "heads", "seq", "dim"), [(1, 9, 128, 64), (2, 3, 5, 2), (1, 1, 1, 16)])
def test_rotary_of_a_chunk_into_a_view(batch: int, heads: int, seq: int, dim: int) -> None:
    rng = np.random.default_rng(2)
    # the layout forward passes: a transposed view of the projection, rotated into a slice of the cache
    x = rng.standard_normal((batch, seq, heads, dim)).astype(np.float32).transpose(0, 2, 1, 3)
    angles = rng.uniform(-10, 10, (batch, 1, seq, dim // 2)).astype(np.float32)
    cos, sin = np.cos(angles), np.sin(angles)
    cache = np.full((batch, heads, seq + 3, dim), np.float32(7.0))
    fused.rotary(x, cos, sin, cache[:, :, 2 : 2 + seq])
    _close(cache[:, :, 2 : 2 + seq], LlamaModel._apply_rotary(x, cos, sin))
    assert (cache[:, :, :2] == 7.0).all() and (cache[:, :, 2 + seq :] == 7.0).all()


def test_swiglu_in_place() -> None:
    rng = np.random.default_rng(3)
    gate = rng.standard_normal((3, 100)).astype(np.float32) * 8
    up = rng.standard_normal((3, 100)).astype(np.float32)
    want = gate / (np.float32(1.0) + np.exp(-gate)) * up
    fused.swiglu(gate, up, gate)
    _close(gate, want)
