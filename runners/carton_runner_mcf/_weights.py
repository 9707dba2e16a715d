"""Weights as the decoder sees them: `Linear` maps (``x @ W.T + b``) and `Embedding` row lookups.

A quantized weight stays in its MCF payload (memory-mapped, zero-copy) and every matmul goes through
`carton.mcf.QuantizedLinear`; the ``weight_cache`` runner option chooses how much the kernel may keep decoded
(``packed`` bytes only, ``int8`` codes + fp32 scales, or a full ``fp32`` matrix). A float weight (f32 in the file:
zero-copy; f16/bf16: widened once, the only way BLAS can use it) goes through numpy's matmul.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import numpy as np
from numpy.typing import NDArray

__all__ = [
    "BiasedLinear",
    "Embedding",
    "FloatEmbedding",
    "FloatLinear",
    "Linear",
    "QuantizedEmbedding",
]

F32 = NDArray[np.float32]


class Linear(Protocol):
    """``y = x @ W.T`` for float32 ``x [..., in_features]``; ``W`` is ``[out_features, in_features]``."""

    def __call__(self, x: F32) -> F32: ...


class Embedding(Protocol):
    """Rows of the ``[vocab, hidden]`` table for integer ids of any shape; result ``[*ids.shape, hidden]``."""

    @property
    def num_embeddings(self) -> int: ...

    def __call__(self, ids: NDArray[np.int64]) -> F32: ...


class FloatLinear:
    """A float weight matrix used directly by BLAS (no copy when it is already float32)."""

    def __init__(self, weight: NDArray[np.floating]) -> None:
        self._weight_t = np.asarray(weight, dtype=np.float32).T

    def __call__(self, x: F32) -> F32:
        result: F32 = np.matmul(x, self._weight_t)
        return result


class BiasedLinear:
    """Adds a bias vector after another `Linear` (attention_bias / mlp_bias models)."""

    def __init__(self, inner: Linear, bias: NDArray[np.floating]) -> None:
        self._inner = inner
        self._bias = np.asarray(bias, dtype=np.float32)

    def __call__(self, x: F32) -> F32:
        result = self._inner(x)
        result += self._bias
        return result


class FloatEmbedding:
    def __init__(self, weight: NDArray[np.floating]) -> None:
        self._weight = weight

    @property
    def num_embeddings(self) -> int:
        return int(self._weight.shape[0])

    def __call__(self, ids: NDArray[np.int64]) -> F32:
        return np.asarray(self._weight[ids], dtype=np.float32)


def _align64(value: int) -> int:
    return (value + 63) & ~63


class QuantizedEmbedding:
    """Row lookups in a quantized ``[vocab, hidden]`` payload without decoding the whole table.

    Every region of a payload that holds per-block data (scales, sub-scales, codes) is stored row-major, so the rows
    a batch needs are cut out of each region into a small payload of the same layout, which the format's own
    dequantizer decodes. Regions shared by the whole tensor (the int* scale and zero point) are copied as they are.
    """

    def __init__(
        self,
        payload: NDArray[np.uint8],
        *,
        rows: int,
        cols: int,
        bits: int,
        family: str,
        activations: bool,
        dequantize: Callable[[NDArray[np.uint8], int], F32],
    ) -> None:
        blocks = -(-cols // 32)
        supers = -(-blocks // 8)
        code_bytes = blocks * 32 * bits // 8
        # (bytes per row, or None for a region shared by all rows, and its size when shared)
        layout: list[tuple[int | None, int]]
        if family == "q":
            layout = [(2 * blocks, 0), (code_bytes, 0)]
        elif family == "k":
            layout = [(2 * supers, 0), (blocks, 0), (code_bytes, 0)]
        elif family == "int" and cols * bits % 8 == 0:
            layout = [(None, 4)] + ([(None, 4)] if activations else []) + [(cols * bits // 8, 0)]
        else:
            raise ValueError(f"rows of a {bits}-bit {family} table with {cols} columns do not start on a byte")
        self._rows = rows
        self._cols = cols
        self._dequantize = dequantize
        self._layout = layout
        self._regions: list[NDArray[np.uint8]] = []
        offset = 0
        for index, (per_row, shared) in enumerate(layout):
            if index:
                offset = _align64(offset)
            end = offset + (rows * per_row if per_row is not None else shared)
            if end > len(payload):
                raise ValueError(f"a payload of {len(payload)} bytes is too short for a [{rows}, {cols}] table")
            region = payload[offset:end]
            self._regions.append(region.reshape(rows, per_row) if per_row is not None else region)
            offset = end

    @property
    def num_embeddings(self) -> int:
        return self._rows

    def __call__(self, ids: NDArray[np.int64]) -> F32:
        unique, inverse = np.unique(ids.reshape(-1), return_inverse=True)
        count = len(unique)
        starts = []
        offset = 0
        for index, (per_row, shared) in enumerate(self._layout):
            if index:
                offset = _align64(offset)
            starts.append(offset)
            offset += count * per_row if per_row is not None else shared
        sub = np.zeros(offset, dtype=np.uint8)
        for region, start, (per_row, _) in zip(self._regions, starts, self._layout, strict=True):
            picked = region[unique].reshape(-1) if per_row is not None else region
            sub[start : start + picked.size] = picked
        decoded = self._dequantize(sub, count)
        return decoded[inverse].reshape(*ids.shape, self._cols)
