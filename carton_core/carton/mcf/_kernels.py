"""``y = x @ W.T`` for a quantized ``W`` without materialising the dequantized matrix (unless asked to).

A :class:`QuantizedLinear` keeps one of three weight caches:

* ``"int8"`` (default): the codes as int8, stored K-major (``[cols_padded, rows]``, i.e. ``W.T``'s layout) plus one
  fp32 scale per block (``[blocks_per_row, rows]``, k* super x sub-scales folded once at load). About 2x the q4/k4
  payload. Two numpy paths use it, both converting cache-sized tiles and handing them to BLAS:

  - small batches (``batch <= gemv_max_batch``): for a group of block columns, convert the int8 slab to fp32 and
    compute every block's partial dot product with one batched matmul; then ``y += sum_b S[b] * D[b]``. The scales
    touch only ``1/32`` of the values and no fp32 copy of the weights is ever written.
  - larger batches: convert a tile of ``kt`` input features for all rows, fold the block scales in (a multiply whose
    inner axis is the long, contiguous row axis), and accumulate ``x[:, tile] @ tile`` with sgemm.

* ``"packed"``: keeps only the payload (zero-copy over an mmap or bytes) and per-block fp32 scales; row tiles are
  unpacked, scaled and multiplied per call.
* ``"fp32"``: dequantizes once and calls BLAS on the full matrix (fastest, 8x the q4 size).
"""

from __future__ import annotations

import threading
from typing import Literal

import numpy as np
import numpy.typing as npt

from carton.errors import MCFError
from carton.mcf._decode import block_codes, block_scales, dequantize, int_codes, int_parameters
from carton.mcf._layout import PayloadLayout, as_payload_array, coerce_domain, coerce_method, payload_layout
from carton.mcf._packing import BLOCK
from carton.mcf._quant import QuantizedTensor
from carton.mcf._types import QuantDomain, QuantMethod

__all__ = ["CacheMode", "QuantizedLinear", "matmul"]

CacheMode = Literal["packed", "int8", "fp32"]
_CACHE_MODES = ("packed", "int8", "fp32")

# Work-buffer budget per call (bytes of fp32 tile): sized to stay near the L2 cache; chosen by bench/bench_mcf.py.
DEFAULT_TILE_BYTES = 2 << 20
# Largest batch served by the block-partial (matrix-vector) path; chosen by bench/bench_mcf.py.
DEFAULT_GEMV_MAX_BATCH = 4

Payload = bytes | bytearray | memoryview | npt.NDArray[np.uint8]


class QuantizedLinear:
    """A quantized ``[rows = out_features, cols = in_features]`` weight applied as ``x @ W.T``.

    ``payload`` may be bytes, a memoryview or a uint8 array over an mmap; with ``cache="packed"`` it is referenced,
    never copied. Calls accept float32 (other floats are converted) of shape ``[..., cols]`` and return float32
    ``[..., rows]``. A call reuses per-thread work buffers of about ``tile_bytes``.
    """

    def __init__(
        self,
        payload: Payload,
        method: QuantMethod | str,
        rows: int,
        cols: int,
        *,
        domain: QuantDomain | int = QuantDomain.WEIGHTS,
        cache: CacheMode = "int8",
        tile_bytes: int = DEFAULT_TILE_BYTES,
        gemv_max_batch: int = DEFAULT_GEMV_MAX_BATCH,
    ) -> None:
        if cache not in _CACHE_MODES:
            raise MCFError(f"unknown weight cache {cache!r} (expected one of: {', '.join(_CACHE_MODES)})")
        if tile_bytes < 4 * BLOCK:
            raise MCFError(f"tile_bytes must be at least {4 * BLOCK}, got {tile_bytes}")
        self.method: QuantMethod = coerce_method(method)
        self.domain: QuantDomain = coerce_domain(domain)
        self.layout: PayloadLayout = payload_layout(self.method, rows, cols, domain=self.domain)
        self.rows, self.cols = rows, cols
        self.cache: CacheMode = cache
        self.tile_bytes = tile_bytes
        self.gemv_max_batch = gemv_max_batch
        self._local = threading.local()
        flat = as_payload_array(payload, self.layout)
        self._flat: npt.NDArray[np.uint8] | None = None
        self._fp32: npt.NDArray[np.float32] | None = None
        self._codes_t: npt.NDArray[np.int8] | None = None
        self._scales_t: npt.NDArray[np.float32] | None = None
        self._scales: npt.NDArray[np.float32] | None = None
        self._int_scale = np.float32(1.0)
        self._int_zero = np.float32(0.0)
        if cache == "fp32":
            self._fp32 = dequantize(flat, self.method, (rows, cols), domain=self.domain)
        elif self.method.family == "int":
            self._int_scale, self._int_zero = int_parameters(flat, self.layout)
            if cache == "packed" and self.method is QuantMethod.INT8:
                self._flat = flat
            else:  # int4 has no packed fast path: its codes are expanded to int8 once
                codes = int_codes(flat, self.layout)
                self._codes_t = np.ascontiguousarray(codes.reshape(rows, cols).T)
        elif cache == "packed":
            self._flat = flat
            self._scales = block_scales(flat, self.layout)
        else:
            self._build_int8_cache(flat)

    @classmethod
    def from_quantized(cls, tensor: QuantizedTensor, **options: object) -> QuantizedLinear:
        """Build from a :class:`QuantizedTensor` (options as for the constructor)."""
        rows, cols = tensor.shape
        return cls(tensor.payload, tensor.method, rows, cols, domain=tensor.domain, **options)  # type: ignore[arg-type]

    # --- construction --------------------------------------------------------------------------------------------
    def _build_int8_cache(self, flat: npt.NDArray[np.uint8]) -> None:
        layout = self.layout
        rows, nb = layout.rows, layout.blocks_per_row
        self._scales_t = np.ascontiguousarray(block_scales(flat, layout).T)
        codes_t = np.empty((nb * BLOCK, rows), dtype=np.int8)
        step = max(1, (4 << 20) // (nb * BLOCK))
        for r0 in range(0, rows, step):
            r1 = min(rows, r0 + step)
            codes_t[:, r0:r1] = block_codes(flat, layout, r0, r1).reshape(r1 - r0, nb * BLOCK).T
        # Values beyond cols in the last block are defined as zero whatever a writer stored there.
        codes_t[self.cols :] = 0
        self._codes_t = codes_t

    # --- introspection -------------------------------------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, self.cols)

    @property
    def nbytes(self) -> int:
        """Bytes of weight data this object keeps (payload when referenced, caches, scales; not work buffers)."""
        arrays = (self._flat, self._fp32, self._codes_t, self._scales_t, self._scales)
        return sum(a.nbytes for a in arrays if a is not None)

    def __repr__(self) -> str:
        return f"QuantizedLinear({self.method.value}, rows={self.rows}, cols={self.cols}, cache={self.cache!r})"

    # --- application ---------------------------------------------------------------------------------------------
    def __call__(self, x: npt.ArrayLike) -> npt.NDArray[np.float32]:
        arr = np.asarray(x)
        if arr.dtype != np.float32:
            if not np.issubdtype(arr.dtype, np.floating):
                raise MCFError(f"QuantizedLinear input must be a float array, got dtype {arr.dtype}")
            arr = arr.astype(np.float32)
        if arr.ndim == 0 or arr.shape[-1] != self.cols:
            raise MCFError(f"QuantizedLinear input must have shape [..., {self.cols}], got {arr.shape}")
        lead = arr.shape[:-1]
        x2 = np.ascontiguousarray(arr.reshape(-1, self.cols))
        if x2.shape[0] == 0:
            return np.zeros((*lead, self.rows), dtype=np.float32)
        if self._fp32 is not None:
            out = x2 @ self._fp32.T
        elif self._codes_t is not None and self.method.family != "int":
            small = x2.shape[0] <= self.gemv_max_batch
            out = self._blockwise_gemv(x2) if small else self._ktiled_gemm(x2)
        elif self._codes_t is not None:
            out = self._int_ktiled(x2)
        else:
            out = self._rowtiled_packed(x2)
        return out.reshape(*lead, self.rows)

    def take_rows(self, indices: npt.ArrayLike) -> npt.NDArray[np.float32]:
        """Dequantized rows ``W[indices]`` (an embedding lookup), without decoding the others."""
        idx = np.asarray(indices)
        if not np.issubdtype(idx.dtype, np.integer):
            raise MCFError(f"row indices must be integers, got dtype {idx.dtype}")
        if idx.size and (idx.min() < -self.rows or idx.max() >= self.rows):
            raise MCFError(f"row index out of range for {self.rows} rows (min {idx.min()}, max {idx.max()})")
        flat_idx = np.where(idx < 0, idx + self.rows, idx).reshape(-1)
        if self._fp32 is not None:
            return self._fp32[flat_idx].reshape(*idx.shape, self.cols)
        if self._codes_t is not None and self.method.family != "int":
            assert self._scales_t is not None
            codes = self._codes_t[:, flat_idx].T.astype(np.float32)
            nb = self.layout.blocks_per_row
            codes.reshape(-1, nb, BLOCK)[...] *= self._scales_t[:, flat_idx].T[:, :, None]
            return codes[:, : self.cols].reshape(*idx.shape, self.cols)
        if self._codes_t is not None:
            codes = self._codes_t[:, flat_idx].T.astype(np.float32)
            if self._int_zero != 0:
                codes -= self._int_zero
            codes *= self._int_scale
            return codes.reshape(*idx.shape, self.cols)
        out = np.empty((flat_idx.size, self.cols), dtype=np.float32)
        for i, r in enumerate(flat_idx):
            out[i] = self._decode_rows(int(r), int(r) + 1)[0, : self.cols]
        return out.reshape(*idx.shape, self.cols)

    # --- paths ---------------------------------------------------------------------------------------------------
    def _buffer(self, name: str, shape: tuple[int, ...]) -> npt.NDArray[np.float32]:
        """A per-thread fp32 work buffer, reallocated only when it must grow."""
        size = int(np.prod(shape))
        buf: npt.NDArray[np.float32] | None = getattr(self._local, name, None)
        if buf is None or buf.size < size:
            buf = np.empty(size, dtype=np.float32)
            setattr(self._local, name, buf)
        return buf[:size].reshape(shape)

    def _padded_input(self, x2: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
        kp = self.layout.padded_cols
        if kp == self.cols:
            return x2
        padded = np.zeros((x2.shape[0], kp), dtype=np.float32)
        padded[:, : self.cols] = x2
        return padded

    def _blockwise_gemv(self, x2: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
        codes_t, scales_t = self._codes_t, self._scales_t
        assert codes_t is not None and scales_t is not None
        m, rows, nb = x2.shape[0], self.rows, self.layout.blocks_per_row
        group = max(1, min(nb, self.tile_bytes // (4 * BLOCK * rows)))
        xb = self._padded_input(x2).reshape(m, nb, BLOCK).transpose(1, 0, 2)  # [nb, m, 32]
        slab = self._buffer("tile", (group * BLOCK, rows))
        partial = self._buffer("partial", (group, m, rows))
        out = np.zeros((m, rows), dtype=np.float32)
        for b0 in range(0, nb, group):
            b1 = min(nb, b0 + group)
            g = b1 - b0
            tile = slab[: g * BLOCK]
            np.copyto(tile, codes_t[b0 * BLOCK : b1 * BLOCK], casting="unsafe")
            part = partial[:g]
            np.matmul(xb[b0:b1], tile.reshape(g, BLOCK, rows), out=part)
            part *= scales_t[b0:b1, None, :]
            out += part.sum(axis=0)
        return out

    def _ktiled_gemm(self, x2: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
        codes_t, scales_t = self._codes_t, self._scales_t
        assert codes_t is not None and scales_t is not None
        m, rows, kp = x2.shape[0], self.rows, self.layout.padded_cols
        kt = max(BLOCK, min(kp, (self.tile_bytes // (4 * rows)) // BLOCK * BLOCK))
        xp = self._padded_input(x2)
        tile_buf = self._buffer("tile", (kt, rows))
        out = np.zeros((m, rows), dtype=np.float32)
        tmp = self._buffer("partial", (m, rows))
        for k0 in range(0, kp, kt):
            k1 = min(kp, k0 + kt)
            tile = tile_buf[: k1 - k0]
            np.copyto(tile, codes_t[k0:k1], casting="unsafe")
            blocks = tile.reshape((k1 - k0) // BLOCK, BLOCK, rows)
            np.multiply(blocks, scales_t[k0 // BLOCK : k1 // BLOCK, None, :], out=blocks)
            np.matmul(xp[:, k0:k1], tile, out=tmp)
            out += tmp
        return out

    def _int_ktiled(self, x2: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
        codes_t = self._codes_t
        assert codes_t is not None
        m, rows, cols = x2.shape[0], self.rows, self.cols
        kt = max(1, min(cols, self.tile_bytes // (4 * rows)))
        tile_buf = self._buffer("tile", (kt, rows))
        out = np.zeros((m, rows), dtype=np.float32)
        tmp = self._buffer("partial", (m, rows))
        for k0 in range(0, cols, kt):
            k1 = min(cols, k0 + kt)
            tile = tile_buf[: k1 - k0]
            np.copyto(tile, codes_t[k0:k1], casting="unsafe")
            np.matmul(x2[:, k0:k1], tile, out=tmp)
            out += tmp
        if self._int_zero != 0:
            out -= self._int_zero * x2.sum(axis=1, keepdims=True)
        out *= self._int_scale
        return out

    def _decode_rows(self, r0: int, r1: int) -> npt.NDArray[np.float32]:
        """fp32 rows ``[r1 - r0, cols_padded]`` of W decoded from the referenced payload (packed cache)."""
        flat = self._flat
        assert flat is not None
        layout = self.layout
        if self.method.family == "int":
            codes = flat[layout.data.offset + r0 * self.cols : layout.data.offset + r1 * self.cols].view(np.int8)
            tile = self._buffer("tile", (r1 - r0, self.cols))
            np.copyto(tile, codes.reshape(r1 - r0, self.cols), casting="unsafe")
            if self._int_zero != 0:
                tile -= self._int_zero
            tile *= self._int_scale
            return tile
        scales = self._scales
        assert scales is not None
        nb = layout.blocks_per_row
        tile = self._buffer("tile", (r1 - r0, nb * BLOCK))
        blocks = tile.reshape(r1 - r0, nb, BLOCK)
        np.copyto(blocks, block_codes(flat, layout, r0, r1), casting="unsafe")
        np.multiply(blocks, scales[r0:r1, :, None], out=blocks)
        if self.cols != nb * BLOCK:
            tile[:, self.cols :] = 0
        return tile

    def _rowtiled_packed(self, x2: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
        m, rows = x2.shape[0], self.rows
        width = self.cols if self.method.family == "int" else self.layout.padded_cols
        rt = max(1, min(rows, self.tile_bytes // (4 * width)))
        xp_t = np.ascontiguousarray((x2 if width == self.cols else self._padded_input(x2)).T)
        out_t = np.empty((rows, m), dtype=np.float32)
        for r0 in range(0, rows, rt):
            r1 = min(rows, r0 + rt)
            np.matmul(self._decode_rows(r0, r1), xp_t, out=out_t[r0:r1])
        return np.ascontiguousarray(out_t.T)


def matmul(
    x: npt.ArrayLike, weight: QuantizedTensor | QuantizedLinear, *, cache: CacheMode = "packed"
) -> npt.NDArray[np.float32]:
    """``x @ W.T`` for a quantized ``W`` in one call (builds a :class:`QuantizedLinear` when given a tensor)."""
    linear = weight if isinstance(weight, QuantizedLinear) else QuantizedLinear.from_quantized(weight, cache=cache)
    return linear(x)
