"""The int16 panel kernels of large batches (`_panel`): called directly on every machine (the IR is portable; only
where the CPU has 512-bit VNNI does `CompiledPayload.matmul` pick them), against the float64 product with the
dequantized matrix within the int16 activation bound, the same bits at one and two threads, and the activation
rounding of the small-batch kernels bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
from carton.mcf import quantize
from carton_runner_mcf._kernels import COMPILED_GEMV_MAX_BATCH, QuantizedLinear
from carton_runner_mcf._packed import CompiledPayload
from kernel_bounds import compiled_bound

numba = pytest.importorskip("numba", reason="the panel kernels are compiled (pip install 'carton-runtime[mcf]')")

METHODS = ["q8", "q4", "k6", "k4", "k3", "k2"]


def _compiled(linear: QuantizedLinear) -> CompiledPayload:
    compiled = linear._compiled
    assert compiled is not None
    return compiled


def _within_bound(got: np.ndarray, x: np.ndarray, dense: np.ndarray) -> None:
    want = x.astype(np.float64) @ dense.astype(np.float64).T
    assert got.dtype == np.float32 and got.shape == want.shape
    assert float((np.abs(got.astype(np.float64) - want) / compiled_bound(x, dense)).max()) <= 1.0


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize(
    ("rows", "cols", "m"),
    [
        (37, 300, 53),  # rows not a multiple of 16, a padded last block, a batch not a multiple of 8 (8 + 4 + 1)
        (16, 31, 3),  # one group, a single padded block, a batch below 4 (2 + 1)
        (130, 576, 128),  # two full tiles of activation rows per group, a last group of two rows
        (5, 33, 15),  # fewer rows than a group, one column in the last block, 8 + 4 + 2 + 1 activation rows
    ],
)
def test_panel_product_within_the_int16_bound_on_one_and_two_threads(method: str, rows: int, cols: int, m: int) -> None:
    rng = np.random.default_rng(rows * cols + m)
    q = quantize(rng.standard_normal((rows, cols)).astype(np.float32), method)
    dense = q.dequantize()
    compiled = _compiled(QuantizedLinear.from_quantized(q, kernels="numba"))
    x = rng.standard_normal((m, cols)).astype(np.float32) * rng.uniform(0.01, 10, (m, 1)).astype(np.float32)
    x[0, : min(cols, 40)] = 0.0  # an all-zero block: scale zero, codes zero
    one = compiled.paneled(x, threads=1)
    two = compiled.paneled(x, threads=2)
    _within_bound(one, x, dense)
    np.testing.assert_array_equal(one, two)


@pytest.mark.parametrize("method", ["q4", "k4", "k6"])
def test_a_part_of_a_matrix(method: str) -> None:
    """Rows 5..140 and block columns 1.. of a larger matrix: the payload offsets of a part (a k* part starting off
    a super-block reads its sub-scales one by one)."""
    rng = np.random.default_rng(7)
    rows, cols = 150, 300
    q = quantize(rng.standard_normal((rows, cols)).astype(np.float32), method)
    dense = q.dequantize()[5:140, 32:]
    linear = QuantizedLinear.from_quantized(q, kernels="numba", row_range=(5, 140), col_range=(32, cols))
    x = rng.standard_normal((70, cols - 32)).astype(np.float32)
    compiled = _compiled(linear)
    one = compiled.paneled(x, threads=1)
    _within_bound(one, x, dense)
    np.testing.assert_array_equal(one, compiled.paneled(x, threads=2))


def test_activation_rounding_matches_the_block_kernels() -> None:
    from carton_runner_mcf._blocks import quantize_activations
    from carton_runner_mcf._panel import activation_shapes, quantize_natural

    rng = np.random.default_rng(3)
    for cols in (31, 32, 33, 300, 576):
        x = rng.standard_normal((9, cols)).astype(np.float32) * np.float32(3.0)
        x[1] = 0.0
        x[2, ::3] = np.float32(0.5 / 32767)  # exact halves after scaling: round half to even
        x[2, 0] = np.float32(1.0)
        blocks = -(-cols // 32)
        codes, scales = activation_shapes(9, blocks)
        got_q, got_s = np.full(codes, 7, np.int16), np.full(scales, 7, np.float32)
        want_q, want_s = np.full(codes, 7, np.int16), np.full(scales, 7, np.float32)
        quantize_natural(x, got_q, got_s)
        quantize_activations(x, np.arange(32, dtype=np.int64), want_q, want_s)
        np.testing.assert_array_equal(got_q, want_q)
        np.testing.assert_array_equal(got_s, want_s)


def test_4_bit_activation_rounding_in_vectors_matches_value_by_value() -> None:
    """`_nibble.quantize_pairs` rounds contiguous rows with `round_block` and one shuffle per pair, rows of another
    stride value by value: the same bits, also at odd block counts, a partial last block, tiny and huge scales and
    exact halves."""
    from carton_runner_mcf._compiled import activation_shapes
    from carton_runner_mcf._nibble import quantize_pairs

    rng = np.random.default_rng(11)
    for cols in (1, 31, 32, 33, 64, 65, 100, 576, 600, 1536):
        m = 5
        x = rng.standard_normal((m, 2 * cols)).astype(np.float32)
        x *= rng.choice(np.array([1e-30, 1e-3, 1.0, 1e3, 1e30], np.float32), size=x.shape)
        x[1] = 0.0
        x[2, ::3] = np.float32(0.5 / 32767)
        x[2, 0] = np.float32(1.0)
        strided, contiguous = x[:, ::2], np.ascontiguousarray(x[:, ::2])
        shapes = activation_shapes(m, -(-cols // 32))
        got, want = ([np.full(shape, 7, dtype) for shape, dtype in zip((shapes[0], shapes[1], shapes[2], shapes[1]),
                     (np.int16, np.float32, np.float32, np.float32), strict=True)] for _ in range(2))  # fmt: skip
        quantize_pairs(contiguous, *got)
        quantize_pairs(strided, *want)
        for a, b in zip(got, want, strict=True):
            np.testing.assert_array_equal(a, b)


def test_large_batches_take_the_panel_kernels_where_the_cpu_has_512_bit_vnni() -> None:
    from carton_runner_mcf._compiled import PANEL_PRODUCTS

    rng = np.random.default_rng(5)
    q = quantize(rng.standard_normal((64, 96)).astype(np.float32), "q4")
    linear = QuantizedLinear.from_quantized(q, kernels="numba")
    compiled = _compiled(linear)
    assert (compiled.panels is not None) == PANEL_PRODUCTS
    x = rng.standard_normal((COMPILED_GEMV_MAX_BATCH + 1, 96)).astype(np.float32)
    expected = compiled.paneled(x, threads=1) if PANEL_PRODUCTS else compiled.tiled(x)
    np.testing.assert_array_equal(linear(x), expected)
    _within_bound(linear(x), x, q.dequantize())


@pytest.mark.parametrize("method", ["q4", "k4", "q8"])
@pytest.mark.parametrize("m", [1, 53, 128])
def test_several_matrices_of_one_input_equal_their_own_products(method: str, m: int) -> None:
    """`matmul_many` (the input rounded once, the matrices' groups shared out as one list, as a layer's q / k / v and
    gate / up run) gives each matrix its own product bit for bit, on one thread and split unevenly across two or
    three."""
    from carton_runner_mcf._panel import activation_shapes

    rng = np.random.default_rng(m)
    cols = 300
    parts = [
        _compiled(QuantizedLinear.from_quantized(quantize(rng.standard_normal((rows, cols)), method), kernels="numba"))
        for rows in (37, 130, 16)
    ]
    x = rng.standard_normal((m, cols)).astype(np.float32)
    want = [part.paneled(x, threads=1) for part in parts]
    kernels = parts[0].panels if parts[0].panels is not None else parts[0]._k.panel_kernels(parts[0].layout.bits)
    flats, metas = tuple(part.payload for part in parts), tuple(part.meta for part in parts)
    codes, scales = activation_shapes(m, parts[0].blocks)
    for threads in (1, 2, 3):
        outs = tuple(np.full((m, part.rows), np.nan, dtype=np.float32) for part in parts)
        args = (flats, metas, x, np.empty(codes, np.int16), np.empty(scales, np.float32), outs)
        if threads == 1:
            kernels.matmul_many(*args)
        else:
            kernels.matmul_many_parallel(*args, threads)
        for got, expected in zip(outs, want, strict=True):
            np.testing.assert_array_equal(got, expected)
