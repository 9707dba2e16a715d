"""Hypothesis strategies shared by the MCF format tests and the mcf runner's kernel tests."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp


@st.composite
def weights(draw: st.DrawFn) -> np.ndarray:
    """Small float32 matrices (1-6 rows, 1-300 columns) of multiples of 1/64 up to ~16 in magnitude, which keep every
    scale in fp16's normal range."""
    rows = draw(st.integers(1, 6))
    cols = draw(st.integers(1, 300))
    ints = draw(hnp.arrays(np.int32, (rows, cols), elements=st.integers(-1000, 1000)))
    return (ints / np.float32(64)).astype(np.float32)


def corrupted_payload(method: str, flips: list[tuple[int, int]], cut: int) -> bytes:
    """The payload of a fixed 3 x 70 random matrix with ``(position, value)`` bytes overwritten (positions wrap) and
    the last ``cut`` bytes dropped."""
    from carton.mcf import quantize

    w = np.random.default_rng(7).standard_normal((3, 70)).astype(np.float32)
    raw = bytearray(quantize(w, method).payload)
    for position, value in flips:
        raw[position % len(raw)] = value
    return bytes(raw[: len(raw) - cut])
