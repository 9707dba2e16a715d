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
  decoded through lookup tables (``_lut.BlockDecoder``), scaled and multiplied per call.
* ``"fp32"``: dequantizes once and calls BLAS on the full matrix (fastest, 8x the q4 size).

With ``threads > 1`` every path splits the output features (rows of ``W``) into contiguous ranges, one per thread of
a small pool; each range runs the same tile loop with its own work buffers (numpy releases the GIL in the casts,
multiplies and gathers, BLAS in its calls).
"""

from __future__ import annotations

import math
import operator
import threading
from collections.abc import Callable
from typing import Literal

import numpy as np
import numpy.typing as npt

from carton.errors import MCFError
from carton.mcf._decode import block_codes, block_scales, dequantize, int_codes, int_parameters
from carton.mcf._layout import PayloadLayout, as_payload_array, coerce_domain, coerce_method, payload_layout
from carton.mcf._lut import BlockDecoder, parallel_ranges, resolve_threads
from carton.mcf._packing import BLOCK
from carton.mcf._quant import QuantizedTensor
from carton.mcf._types import QuantDomain, QuantMethod

__all__ = ["DEFAULT_GEMV_MAX_BATCH", "DEFAULT_TILE_BYTES", "CacheMode", "Payload", "QuantizedLinear", "matmul"]

CacheMode = Literal["packed", "int8", "fp32"]
_CACHE_MODES = ("packed", "int8", "fp32")

# Work-buffer budget per call and thread (bytes of fp32 tile): half the L2 cache of the build machine (2 MiB per
# core), so the tile, the int8 codes it is cast from and the partial sums stay in L2. Chosen by measurement on
# 2026-11-25 (q4, batch 1, one thread, medians): 576x1536 157 us with 1 MiB against 217-225 us with 2 MiB;
# 4096x4096 3.2 ms against 4.7 ms; 11008x4096 14.4 ms against 14.9 ms; only 4096x11008 was faster with 2 MiB
# (13.5 ms against 14.6). An earlier machine had favoured 2 MiB (4096^2: 2.75 ms against 3.56).
DEFAULT_TILE_BYTES = 1 << 20
# The matrix-vector path works through at most this many output rows at a time: with more, even one block of 32
# columns overflows the tile (the 49152-row tied head of SmolLM2: 7.2-7.8 ms in 4096-row pieces against 11.9 ms).
_GEMV_ROW_CHUNK = 4096
# Largest batch served by the block-partial (matrix-vector) path; chosen by bench/bench_mcf.py.
DEFAULT_GEMV_MAX_BATCH = 4
# Smallest row range handed to a pool thread: below it the hand-off costs more than it saves.
_MIN_ROWS_PER_THREAD = 256

Payload = bytes | bytearray | memoryview | npt.NDArray[np.uint8]


# Work buffers are per thread and shared by every QuantizedLinear: a thread runs one matmul at a time and no
# buffer escapes a call, so a model with hundreds of matrices keeps one set of tile buffers per thread, not one per
# matrix.
_WORK_BUFFERS = threading.local()

class QuantizedLinear:
    """A quantized ``[rows = out_features, cols = in_features]`` weight applied as ``x @ W.T``.

    ``payload`` may be bytes, a memoryview or a uint8 array over an mmap; with ``cache="packed"`` it is referenced,
    never copied. Calls accept float32 (other floats are converted) of shape ``[..., cols]`` and return float32
    ``[..., rows]``. A call reuses per-thread work buffers of about ``tile_bytes``. ``threads`` (default 1; ``None``:
    one per CPU) splits the output features of each call across a small thread pool; results do not depend on it
    beyond float32 summation order.

    ``row_range`` and ``col_range`` (half-open, in the full tensor's coordinates) keep only that part of ``W``, as
    tensor parallelism splits a layer: the object then behaves as the ``[r1 - r0, c1 - c0]`` matrix and holds
    nothing of the rest. A part needs the ``int8`` or ``fp32`` cache, and for q*/k* its columns must start on a
    32-value block (and end on one or at the last column).
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
        threads: int | None = 1,
        row_range: tuple[int, int] | None = None,
        col_range: tuple[int, int] | None = None,
    ) -> None:
        if cache not in _CACHE_MODES:
            raise MCFError(f"unknown weight cache {cache!r} (expected one of: {', '.join(_CACHE_MODES)})")
        if tile_bytes < 4 * BLOCK:
            raise MCFError(f"tile_bytes must be at least {4 * BLOCK}, got {tile_bytes}")
        self.method: QuantMethod = coerce_method(method)
        self.domain: QuantDomain = coerce_domain(domain)
        full = payload_layout(self.method, rows, cols, domain=self.domain)
        r0, r1 = _checked_range("row_range", row_range, rows)
        c0, c1 = _checked_range("col_range", col_range, cols)
        part = (r0, r1, c0, c1) != (0, rows, 0, cols)
        if part and cache == "packed":
            raise MCFError("a part of a quantized matrix (row_range/col_range) needs the int8 or fp32 cache")
        if part and self.method.family != "int" and (c0 % BLOCK or (c1 % BLOCK and c1 != cols)):
            raise MCFError(
                f"col_range ({c0}, {c1}) of a {self.method.value} matrix must start on a {BLOCK}-value block and end "
                f"on one or at column {cols}"
            )
        self.layout: PayloadLayout = payload_layout(self.method, r1 - r0, c1 - c0, domain=self.domain) if part else full
        self.rows, self.cols = r1 - r0, c1 - c0
        self.cache: CacheMode = cache
        self.tile_bytes = tile_bytes
        self.gemv_max_batch = gemv_max_batch
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
            raise MCFError(f"threads must be a positive integer or None, got {threads!r}")
        self.threads = resolve_threads(threads)
        self._local = _WORK_BUFFERS
        flat = as_payload_array(payload, full)
        self._flat: npt.NDArray[np.uint8] | None = None
        self._fp32: npt.NDArray[np.float32] | None = None
        self._codes_t: npt.NDArray[np.int8] | None = None
        self._scales_t: npt.NDArray[np.float32] | None = None
        self._scales: npt.NDArray[np.float32] | None = None
        self._decoder: BlockDecoder | None = None
        self._int_scale = np.float32(1.0)
        self._int_zero = np.float32(0.0)
        if cache == "fp32":
            whole = dequantize(flat, self.method, (rows, cols), domain=self.domain)
            self._fp32 = np.ascontiguousarray(whole[r0:r1, c0:c1]) if part else whole
        elif self.method.family == "int":
            self._int_scale, self._int_zero = int_parameters(flat, full)
            if cache == "packed" and self.method is QuantMethod.INT8:
                self._flat = flat
            else:  # int4 has no packed fast path: its codes are expanded to int8 once
                codes = int_codes(flat, full)
                self._codes_t = np.ascontiguousarray(codes.reshape(rows, cols)[r0:r1, c0:c1].T)
        elif cache == "packed":
            self._flat = flat
            self._scales = block_scales(flat, self.layout)
            self._decoder = BlockDecoder(flat, self.layout, self._scales)
        else:
            self._build_int8_cache(flat, full, (r0, r1), (c0 // BLOCK, -(-c1 // BLOCK)))

    @classmethod
    def from_quantized(cls, tensor: QuantizedTensor, **options: object) -> QuantizedLinear:
        """Build from a :class:`QuantizedTensor` (options as for the constructor)."""
        rows, cols = tensor.shape
        return cls(tensor.payload, tensor.method, rows, cols, domain=tensor.domain, **options)  # type: ignore[arg-type]

    # --- construction --------------------------------------------------------------------------------------------
    def _build_int8_cache(
        self, flat: npt.NDArray[np.uint8], full: PayloadLayout, rows: tuple[int, int], blocks: tuple[int, int]
    ) -> None:
        """Codes and folded scales of rows ``rows`` and blocks ``blocks`` of the ``full`` payload."""
        (r0, r1), (b0, b1) = rows, blocks
        nb = b1 - b0
        self._scales_t = np.ascontiguousarray(block_scales(flat, full)[r0:r1, b0:b1].T)
        codes_t = np.empty((nb * BLOCK, r1 - r0), dtype=np.int8)
        # 1 MiB of codes at a time: unpacking makes a few temporaries of that size, which add to the peak.
        step = max(1, (1 << 20) // (full.blocks_per_row * BLOCK))
        for a in range(r0, r1, step):
            b = min(r1, a + step)
            codes = block_codes(flat, full, a, b)
            codes_t[:, a - r0 : b - r0] = (codes[:, b0:b1] if nb != full.blocks_per_row else codes).reshape(
                b - a, nb * BLOCK
            ).T
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
            return (x2 @ self._fp32.T).reshape(*lead, self.rows)
        m = x2.shape[0]
        if self._codes_t is not None and self.method.family != "int":
            xp = self._padded_input(x2)
            if m <= self.gemv_max_batch:
                xb = xp.reshape(m, self.layout.blocks_per_row, BLOCK).transpose(1, 0, 2)  # [nb, m, 32]
                out = np.zeros((m, self.rows), dtype=np.float32)
                self._over_rows(lambda r0, r1: self._blockwise_gemv(xb, out, r0, r1))
            else:
                out = np.empty((m, self.rows), dtype=np.float32)
                self._over_rows(lambda r0, r1: self._ktiled_gemm(xp, out, r0, r1))
        elif self._codes_t is not None:
            out = np.empty((m, self.rows), dtype=np.float32)
            self._over_rows(lambda r0, r1: self._int_ktiled(x2, out, r0, r1))
        else:
            width = self.cols if self.method.family == "int" else self.layout.padded_cols
            xp_t = np.ascontiguousarray((x2 if width == self.cols else self._padded_input(x2)).T)
            out_t = np.empty((self.rows, m), dtype=np.float32)
            self._over_rows(lambda r0, r1: self._rowtiled_packed(xp_t, out_t, r0, r1))
            out = out_t.T
        return np.ascontiguousarray(out).reshape(*lead, self.rows)

    def _over_rows(self, work: Callable[[int, int], None]) -> None:
        """Run ``work(r0, r1)`` over the output rows, split across ``self.threads`` threads when large enough."""
        workers = min(self.threads, max(1, self.rows // _MIN_ROWS_PER_THREAD))
        # Ranges start on multiples of 16 rows so that every thread's tiles stay aligned.
        parallel_ranges(self.rows, workers, 16, work)

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
        size = math.prod(shape)  # np.prod costs ~5 us a call, several per matrix-vector product
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

    def _blockwise_gemv(self, xb: npt.NDArray[np.float32], out: npt.NDArray[np.float32], r0: int, r1: int) -> None:
        for c0 in range(r0, r1, _GEMV_ROW_CHUNK):
            self._blockwise_gemv_rows(xb, out, c0, min(r1, c0 + _GEMV_ROW_CHUNK))

    def _blockwise_gemv_rows(
        self, xb: npt.NDArray[np.float32], out: npt.NDArray[np.float32], r0: int, r1: int
    ) -> None:
        codes_t, scales_t = self._codes_t, self._scales_t
        assert codes_t is not None and scales_t is not None
        m, rows, nb = xb.shape[1], r1 - r0, self.layout.blocks_per_row
        group = max(1, min(nb, self.tile_bytes // (4 * BLOCK * rows)))
        slab = self._buffer("tile", (group * BLOCK, rows))
        partial = self._buffer("partial", (group, m, rows))
        dest = out[:, r0:r1]
        for b0 in range(0, nb, group):
            b1 = min(nb, b0 + group)
            g = b1 - b0
            tile = slab[: g * BLOCK]
            codes = codes_t[b0 * BLOCK : b1 * BLOCK, r0:r1]
            # A decode step reads every matrix once, so its codes come from RAM, and numpy's int8 -> float32 cast
            # streams them at 3-5 GB/s where a plain reduction reads 22 GB/s. Reading them first (into L2) measured
            # 288 -> 260 us for a 576 x 1536 product over 141 MB of rotating codes (docs/performance.md).
            codes.max()
            np.copyto(tile, codes, casting="unsafe")
            part = partial[:g]
            np.matmul(xb[b0:b1], tile.reshape(g, BLOCK, rows), out=part)
            part *= scales_t[b0:b1, None, r0:r1]
            dest += part.sum(axis=0)

    def _ktiled_gemm(self, xp: npt.NDArray[np.float32], out: npt.NDArray[np.float32], r0: int, r1: int) -> None:
        codes_t, scales_t = self._codes_t, self._scales_t
        assert codes_t is not None and scales_t is not None
        m, rows, kp = xp.shape[0], r1 - r0, self.layout.padded_cols
        kt = max(BLOCK, min(kp, (self.tile_bytes // (4 * rows)) // BLOCK * BLOCK))
        tile_buf = self._buffer("tile", (kt, rows))
        acc = out[:, r0:r1]  # BLAS writes a column range in place (leading dimension = all rows)
        tmp = self._buffer("partial", (m, rows))
        for k0 in range(0, kp, kt):
            k1 = min(kp, k0 + kt)
            tile = tile_buf[: k1 - k0]
            np.copyto(tile, codes_t[k0:k1, r0:r1], casting="unsafe")
            blocks = tile.reshape((k1 - k0) // BLOCK, BLOCK, rows)
            np.multiply(blocks, scales_t[k0 // BLOCK : k1 // BLOCK, None, r0:r1], out=blocks)
            if k0 == 0:
                np.matmul(xp[:, k0:k1], tile, out=acc)
            else:
                np.matmul(xp[:, k0:k1], tile, out=tmp)
                acc += tmp

    def _int_ktiled(self, x2: npt.NDArray[np.float32], out: npt.NDArray[np.float32], r0: int, r1: int) -> None:
        codes_t = self._codes_t
        assert codes_t is not None
        m, rows, cols = x2.shape[0], r1 - r0, self.cols
        kt = max(1, min(cols, self.tile_bytes // (4 * rows)))
        tile_buf = self._buffer("tile", (kt, rows))
        acc = out[:, r0:r1]  # BLAS writes a column range in place (leading dimension = all rows)
        tmp = self._buffer("partial", (m, rows))
        for k0 in range(0, cols, kt):
            k1 = min(cols, k0 + kt)
            tile = tile_buf[: k1 - k0]
            np.copyto(tile, codes_t[k0:k1, r0:r1], casting="unsafe")
            if k0 == 0:
                np.matmul(x2[:, k0:k1], tile, out=acc)
            else:
                np.matmul(x2[:, k0:k1], tile, out=tmp)
                acc += tmp
        if self._int_zero != 0:
            acc -= self._int_zero * x2.sum(axis=1, keepdims=True)
        acc *= self._int_scale

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
        decoder = self._decoder
        assert decoder is not None
        tile = self._buffer("tile", (r1 - r0, layout.padded_cols))
        decoder.decode(r0, r1, tile)
        if self.cols != layout.padded_cols:
            tile[:, self.cols :] = 0
        return tile

    def _rowtiled_packed(self, xp_t: npt.NDArray[np.float32], out_t: npt.NDArray[np.float32], r0: int, r1: int) -> None:
        width = xp_t.shape[0]
        rt = max(1, min(r1 - r0, self.tile_bytes // (4 * width)))
        for t0 in range(r0, r1, rt):
            t1 = min(r1, t0 + rt)
            np.matmul(self._decode_rows(t0, t1), xp_t, out=out_t[t0:t1])


def _checked_range(name: str, value: tuple[int, int] | None, size: int) -> tuple[int, int]:
    if value is None:
        return 0, size
    try:
        start, stop = (operator.index(v) for v in value)
    except (TypeError, ValueError):
        raise MCFError(f"{name} must be two integers (start, stop), got {value!r}") from None
    if not 0 <= start < stop <= size:
        raise MCFError(f"{name} ({start}, {stop}) is not a non-empty range within 0..{size}")
    return start, stop


def matmul(
    x: npt.ArrayLike, weight: QuantizedTensor | QuantizedLinear, *, cache: CacheMode = "packed"
) -> npt.NDArray[np.float32]:
    """``x @ W.T`` for a quantized ``W`` in one call (builds a :class:`QuantizedLinear` when given a tensor)."""
    linear = weight if isinstance(weight, QuantizedLinear) else QuantizedLinear.from_quantized(weight, cache=cache)
    return linear(x)
