"""Property tests (hypothesis) of QuantizedLinear on both kernel paths: random shapes, caches, batches and tiles
against the dequantized product; corrupted payloads give typed errors or finite products."""

from __future__ import annotations

import numpy as np
import pytest
from carton import MCFError
from carton.mcf import dequantize, quantize
from carton_runner_mcf._kernels import QuantizedLinear
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kernel_bounds import compiled_bound
from mcf_strategies import corrupted_payload, weights

METHODS = ["q8", "q4", "k6", "k4", "k3", "k2", "int8", "int4"]
# Function-scoped `kernels` fixture: each example runs on the path it names, nothing carries over between examples.
SETTINGS = settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)


@SETTINGS
@given(
    w=weights(),
    method=st.sampled_from(METHODS),
    cache=st.sampled_from(["packed", "int8", "fp32"]),
    batch=st.integers(1, 9),
    tile=st.sampled_from([128, 4096, 1 << 21]),
)
def test_linear_matches_dequantized_matmul(
    w: np.ndarray, method: str, cache: str, batch: int, tile: int, kernels: str
) -> None:
    q = quantize(w, method)
    linear = QuantizedLinear.from_quantized(q, cache=cache, tile_bytes=tile, kernels=kernels)
    x = np.random.default_rng(batch).standard_normal((batch, w.shape[1])).astype(np.float32)
    dense = q.dequantize().astype(np.float64)
    want = x.astype(np.float64) @ dense.T
    got = linear(x)
    assert got.shape == (batch, w.shape[0])
    if linear.compiled:  # activations rounded to int16 per block
        assert float((np.abs(got - want) / compiled_bound(x, dense)).max()) <= 1.0
    else:  # float32 rounding
        assert float(np.abs(got - want).max()) <= 1e-4 * max(1.0, float(np.abs(want).max()))


@SETTINGS
@given(
    method=st.sampled_from(METHODS),
    flips=st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), min_size=1, max_size=8),
    cut=st.integers(0, 3),
    cache=st.sampled_from(["packed", "int8"]),
)
def test_corrupted_payloads_give_typed_errors_or_finite_products(
    method: str, flips: list[tuple[int, int]], cut: int, cache: str, kernels: str
) -> None:
    corrupted = corrupted_payload(method, flips, cut)
    for batch in (1, 2, 9):
        try:
            out = QuantizedLinear(corrupted, method, 3, 70, cache=cache, kernels=kernels)(
                np.ones((batch, 70), np.float32)
            )
        except MCFError:
            assert cut or method  # typed error: fine whatever the damage
            continue
        assert cut == 0
        # Corrupt scales can make finite weights near float32's limit, whose products with x legitimately overflow
        # in the sum: only rows whose sum of |w * x| stays in range must come out finite.
        bound = np.abs(dequantize(corrupted, method, (3, 70)).astype(np.float64)).sum(axis=1)
        in_range = np.broadcast_to(bound < 1e38, out.shape)
        assert np.isfinite(out[in_range]).all()


@pytest.mark.parametrize("method", ["q4", "k3", "int8"])
@pytest.mark.parametrize("cache", ["packed", "int8"])
def test_threads_give_the_same_products(method: str, cache: str, kernels: str) -> None:
    rng = np.random.default_rng(6)
    q = quantize(rng.standard_normal((600, 288)).astype(np.float32), method)
    one = QuantizedLinear.from_quantized(q, cache=cache, kernels=kernels)
    two = QuantizedLinear.from_quantized(q, cache=cache, threads=2, kernels=kernels)
    assert two.threads == 2
    for batch in (1, 5, 33):
        x = rng.standard_normal((batch, 288)).astype(np.float32)
        if one.compiled and batch <= one.gemv_max_batch and method != "int8":  # rows split, never a row's sum
            assert np.array_equal(two(x), one(x))
        else:
            np.testing.assert_allclose(two(x), one(x), rtol=1e-5, atol=1e-4)


def test_bad_thread_counts_are_refused() -> None:
    q = quantize(np.ones((4, 64), np.float32), "q4")
    for bad in (0, -1, 1.5, True):
        with pytest.raises(MCFError, match="threads must be a positive integer or None"):
            QuantizedLinear(q.payload, "q4", 4, 64, threads=bad)  # type: ignore[arg-type]
    assert QuantizedLinear(q.payload, "q4", 4, 64, threads=None).threads >= 1
