"""How far a product of each kernel path may be from the float64 product with the dequantized matrix."""

from __future__ import annotations

import numpy as np


def compiled_bound(x: np.ndarray, dense: np.ndarray) -> np.ndarray:
    """The compiled kernels round each block of 32 activations to int16, off by at most ``max|x_block| / 65534``
    per value; a row may then differ by that times the block's ``sum |w|``, summed over the blocks, plus float32
    rounding of the result. ``[m, rows]``."""
    cols = dense.shape[1]
    padded = -(-cols // 32) * 32
    xb = np.zeros((x.shape[0], padded))
    xb[:, :cols] = np.abs(x)
    wb = np.zeros((dense.shape[0], padded))
    wb[:, :cols] = np.abs(dense)
    per_block = xb.reshape(x.shape[0], -1, 32).max(axis=2) / 65534  # [m, blocks]
    w_sums = wb.reshape(dense.shape[0], -1, 32).sum(axis=2)  # [rows, blocks]
    return per_block @ w_sums.T + 1e-6 * (np.abs(x).astype(np.float64) @ np.abs(dense).T) + 1e-30
