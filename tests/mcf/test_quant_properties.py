"""Property tests (hypothesis) for quantized payloads: round trips, exact representations, corrupted payloads."""

from __future__ import annotations

import numpy as np
from carton import MCFError
from carton.mcf import dequantize, payload_size, quantize
from carton.mcf._fp16 import f16_bits_to_f32
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from mcf_strategies import corrupted_payload, weights

METHODS = ["q8", "q4", "k6", "k4", "k3", "k2", "int8", "int4"]
SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(w=weights(), method=st.sampled_from(METHODS), mode=st.sampled_from(["best", "reference"]))
def test_round_trip_is_bounded_and_sized(w: np.ndarray, method: str, mode: str) -> None:
    q = quantize(w, method, mode=mode)  # type: ignore[arg-type]
    assert len(q.payload) == payload_size(method, *w.shape)
    d = dequantize(q.payload, method, w.shape)
    assert d.shape == w.shape and d.dtype == np.float32 and np.isfinite(d).all()
    amax = float(np.abs(w).max())
    assert float(np.abs(d - w).max()) <= amax * 1.01 + 1e-6
    if method in ("q8", "q4") and mode == "reference":
        # Half a step of max|block| / qmax, plus what truncating the scale to fp16 costs the largest code.
        qmax = (1 << (q.layout.bits - 1)) - 1
        blocks = np.zeros((w.shape[0], q.layout.padded_cols), np.float32)
        blocks[:, : w.shape[1]] = w
        step = np.repeat(np.abs(blocks.reshape(w.shape[0], -1, 32)).max(axis=2) / qmax, 32, axis=1)[:, : w.shape[1]]
        assert (np.abs(d - w) <= step * (0.5 + qmax * 2.0**-10) + 1e-6).all()


@SETTINGS
@given(
    rows=st.integers(1, 5),
    blocks=st.integers(1, 9),
    bits=st.sampled_from([8, 4]),
    scale_bits=st.integers(0x2000, 0x5000),
    data=st.data(),
)
def test_best_mode_reproduces_exactly_representable_blocks(
    rows: int, blocks: int, bits: int, scale_bits: int, data: st.DataObject
) -> None:
    qmax = (1 << (bits - 1)) - 1
    codes = data.draw(hnp.arrays(np.int8, (rows, blocks * 32), elements=st.integers(-qmax, qmax)))
    codes.reshape(rows, blocks, 32)[:, :, 0] = qmax  # every block uses the full code range
    scale = f16_bits_to_f32(np.array([scale_bits], np.uint16))[0]
    w = (codes.astype(np.float32) * scale).astype(np.float32)
    assert np.array_equal(quantize(w, "q8" if bits == 8 else "q4").dequantize(), w)


@SETTINGS
@given(
    method=st.sampled_from(METHODS),
    flips=st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), min_size=1, max_size=8),
    cut=st.integers(0, 3),
)
def test_corrupted_payloads_give_typed_errors_or_finite_values(
    method: str, flips: list[tuple[int, int]], cut: int
) -> None:
    corrupted = corrupted_payload(method, flips, cut)
    try:
        out = dequantize(corrupted, method, (3, 70))
    except MCFError:
        return
    assert cut == 0
    assert np.isfinite(out).all()
