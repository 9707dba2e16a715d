"""Weights as the decoder sees them: `Linear` maps (``x @ W.T + b``) and `Embedding` row lookups.

A quantized weight stays in its MCF payload (read onto 2 MiB pages by the loader) and every matmul goes through
`_kernels.QuantizedLinear`; the ``weight_cache`` runner option chooses how much the kernel may keep decoded
(``packed`` bytes only, ``int8`` codes + fp32 scales, or a full ``fp32`` matrix). A float weight (f32 in the file:
zero-copy; f16/bf16: widened once, the only way BLAS can use it) goes through numpy's matmul.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import numpy as np
from carton.mcf import PayloadLayout, payload_layout
from numpy.typing import NDArray

from ._rows import row_regions

__all__ = [
    "F32",
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
        layout: PayloadLayout,
        dequantize: Callable[[NDArray[np.uint8], int], F32],
    ) -> None:
        regions = row_regions(layout)
        if regions is None:
            raise ValueError(
                f"rows of a {layout.bits}-bit {layout.method.family} table with {layout.cols} columns do not start "
                "on a byte"
            )
        rows, cols = layout.rows, layout.cols
        if layout.size > len(payload):
            raise ValueError(f"a payload of {len(payload)} bytes is too short for a [{rows}, {cols}] table")
        self._rows = rows
        self._cols = cols
        #: the whole table's payload and layout (the compiled decode step decodes its rows itself)
        self.payload = payload
        self.layout = layout
        self._dequantize = dequantize
        self._regions = [
            payload[region.offset : region.end].reshape(rows, per_row)
            if per_row is not None
            else payload[region.offset : region.end]
            for region, per_row in regions
        ]

    @property
    def num_embeddings(self) -> int:
        return self._rows

    def __call__(self, ids: NDArray[np.int64]) -> F32:
        unique, inverse = np.unique(ids.reshape(-1), return_inverse=True)
        count = len(unique)
        part = payload_layout(self.layout.method, count, self._cols, domain=self.layout.domain)
        cut = row_regions(part)
        assert cut is not None  # same columns as the table
        sub = np.zeros(part.size, dtype=np.uint8)
        for source, (region, per_row) in zip(self._regions, cut, strict=True):
            picked = source[unique].reshape(-1) if per_row is not None else source
            sub[region.offset : region.offset + picked.size] = picked
        decoded = self._dequantize(sub, count)
        return decoded[inverse].reshape(*ids.shape, self._cols)
