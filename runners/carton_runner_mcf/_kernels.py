"""``y = x @ W.T`` for a quantized ``W`` (the mcf runner's `Linear` for quantized weights).

A `QuantizedLinear` keeps one of three weight caches:

* ``"packed"``: only the payload (bytes, or a uint8 array over the mapped file). With the compiled kernels (numba
  installed, `_packed`) every product reads the codes as stored: integer block products for small batches, decoded
  row tiles and BLAS for large ones; a whole matrix's payload of 2 MiB or more is first copied onto huge pages
  (`_arena`) unless ``pages="given"``, smaller ones and parts are referenced as given. Without them (the numpy
  fallback) row tiles are decoded through lookup tables (`carton.mcf.BlockDecoder`), scaled and multiplied per
  call, which is slow.
* ``"int8"``: the codes as int8, stored K-major (``[cols_padded, rows]``, i.e. ``W.T``'s layout) plus one fp32
  scale per block (``[blocks_per_row, rows]``, k* super x sub-scales folded once at load); about 2x the q4/k4
  payload. Two numpy paths use it, both converting cache-sized tiles and handing them to BLAS:

  - small batches (``batch <= gemv_max_batch``): for a group of block columns, convert the int8 slab to fp32 and
    compute every block's partial dot product with one batched matmul; then ``y += sum_b S[b] * D[b]``. The scales
    touch only ``1/32`` of the values and no fp32 copy of the weights is ever written.
  - larger batches: convert a tile of ``kt`` input features for all rows, fold the block scales in (a multiply whose
    inner axis is the long, contiguous row axis), and accumulate ``x[:, tile] @ tile`` with sgemm.

* ``"fp32"``: dequantizes once and calls BLAS on the full matrix (8x the q4 size).

The default (``cache=None``) is ``"packed"`` when the compiled kernels are available and ``"int8"`` otherwise: the
fastest choice of each path (docs/performance.md, "Compiled kernels").

With ``threads > 1`` products split the output features (rows of ``W``) into contiguous ranges: the compiled
kernels across numba's threads inside one call, the numpy paths across a small thread pool (numpy releases the GIL
in the casts, multiplies and gathers, BLAS in its calls).
"""

from __future__ import annotations

import math
import operator
import threading
from collections.abc import Callable
from typing import Literal

import numpy as np
import numpy.typing as npt
from carton.mcf import (
    BLOCK,
    BlockDecoder,
    MCFError,
    PayloadLayout,
    QuantDomain,
    QuantizedTensor,
    QuantMethod,
    as_payload_array,
    block_codes,
    block_scales,
    dequantize,
    int_codes,
    int_parameters,
    parallel_ranges,
    payload_layout,
    resolve_threads,
)

from ._arena import HUGE_PAGE, HugePageArena, in_arena
from ._packed import CompiledPayload, Kernels, compiled_kernels

__all__ = [
    "COMPILED_GEMV_MAX_BATCH",
    "DEFAULT_GEMV_MAX_BATCH",
    "DEFAULT_TILE_BYTES",
    "CacheMode",
    "Pages",
    "Payload",
    "QuantizedLinear",
    "compiled_available",
    "default_cache",
    "matmul",
]

CacheMode = Literal["packed", "int8", "fp32"]
_CACHE_MODES = ("packed", "int8", "fp32")
Pages = Literal["huge", "given"]
_PAGES = ("huge", "given")

# Work-buffer budget per call and thread of the numpy paths (bytes of fp32 tile): about half an L2 cache, so that a
# tile, the codes it is made from and the partial sums stay in L2 (measured in docs/performance.md, "Quantized
# matmul"). The compiled path's large batches use `_packed.PREFILL_TILE_BYTES` unless given one.
DEFAULT_TILE_BYTES = 1 << 20
# The numpy matrix-vector path works through at most this many output rows at a time: with more, even one block of
# 32 columns overflows the tile (a tied output head has tens of thousands of rows).
_GEMV_ROW_CHUNK = 4096
# Largest batch served by the matrix-vector paths, chosen by measurement (docs/performance.md): numpy's block
# partials, and the compiled integer block products, which share each unpacked block among the batch's rows and
# so stay ahead of decoding the matrix for BLAS up to a few dozen rows.
DEFAULT_GEMV_MAX_BATCH = 4
COMPILED_GEMV_MAX_BATCH = 48
# Smallest row range handed to a pool thread: below it the hand-off costs more than it saves.
_MIN_ROWS_PER_THREAD = 256

Payload = bytes | bytearray | memoryview | npt.NDArray[np.uint8]


# Work buffers are per thread and shared by every QuantizedLinear: a thread runs one matmul at a time and no
# buffer escapes a call, so a model with hundreds of matrices keeps one set of tile buffers per thread, not one per
# matrix.
_WORK_BUFFERS = threading.local()


def compiled_available(kernels: Kernels = "auto") -> bool:
    """Whether products with ``kernels`` (``"auto"``: as ``CARTON_MCF_KERNELS`` says) run compiled."""
    return compiled_kernels(kernels) is not None


def default_cache(kernels: Kernels = "auto") -> CacheMode:
    """The weight cache ``cache=None`` resolves to: ``"packed"`` with the compiled kernels, else ``"int8"``."""
    return "packed" if compiled_available(kernels) else "int8"


class QuantizedLinear:
    """A quantized ``[rows = out_features, cols = in_features]`` weight applied as ``x @ W.T``.

    ``payload`` may be bytes, a memoryview or a uint8 array over an mmap. With ``cache="packed"`` and the compiled
    kernels, a whole matrix's payload of at least 2 MiB is copied once onto 2 MiB pages (``pages="huge"``, the
    default; `_arena.HugePageArena`: products read it from memory about twice as fast as from small pages) unless it
    already lies in such an arena; with ``pages="given"``, or a smaller payload, or a part, it is referenced, never
    copied. Calls accept float32 (other floats are converted) of shape ``[..., cols]`` and return float32
    ``[..., rows]``. A call reuses per-thread work buffers of about ``tile_bytes`` (default: 1 MiB on the numpy
    paths, 8 MiB for the compiled path's large batches). ``threads`` (default 1; ``None``:
    one per CPU) splits the output features of each call across threads; results do not depend on it (the compiled
    kernels) or only through float32 summation order (numpy). ``kernels`` picks the compiled or the numpy path of
    the packed cache (``"auto"``: ``CARTON_MCF_KERNELS``, else compiled when numba is installed).

    The compiled kernels round each block of 32 activations to int16 (relative error at most ``1/65534`` of the
    block's largest value) and multiply the codes exactly; the numpy paths multiply in float32.

    ``row_range`` and ``col_range`` (half-open, in the full tensor's coordinates) keep only that part of ``W``, as
    tensor parallelism splits a layer: the object then behaves as the ``[r1 - r0, c1 - c0]`` matrix and holds
    nothing of the rest. A part needs the ``int8`` or ``fp32`` cache, or the packed one with the compiled kernels;
    for q*/k* its columns must start on a 32-value block (and end on one or at the last column).
    """

    def __init__(
        self,
        payload: Payload,
        method: QuantMethod | str,
        rows: int,
        cols: int,
        *,
        domain: QuantDomain | int = QuantDomain.WEIGHTS,
        cache: CacheMode | None = None,
        kernels: Kernels = "auto",
        tile_bytes: int | None = None,
        gemv_max_batch: int | None = None,
        threads: int | None = 1,
        row_range: tuple[int, int] | None = None,
        col_range: tuple[int, int] | None = None,
        pages: Pages = "huge",
    ) -> None:
        compiled = compiled_kernels(kernels)
        if pages not in _PAGES:
            raise MCFError(f"unknown pages {pages!r} (expected one of: {', '.join(_PAGES)})")
        if cache is None:
            cache = "packed" if compiled is not None else "int8"
        if cache not in _CACHE_MODES:
            raise MCFError(f"unknown weight cache {cache!r} (expected one of: {', '.join(_CACHE_MODES)})")
        if tile_bytes is not None and tile_bytes < 4 * BLOCK:
            raise MCFError(f"tile_bytes must be at least {4 * BLOCK}, got {tile_bytes}")
        full = payload_layout(method, rows, cols, domain=domain)
        self.method: QuantMethod = full.method
        self.domain: QuantDomain = full.domain
        r0, r1 = _checked_range("row_range", row_range, rows)
        c0, c1 = _checked_range("col_range", col_range, cols)
        part = (r0, r1, c0, c1) != (0, rows, 0, cols)
        if part and cache == "packed" and compiled is None:
            raise MCFError(
                "a part of a quantized matrix (row_range/col_range) needs the int8 or fp32 cache, or the compiled "
                "kernels (numba)"
            )
        if part and self.method.family != "int" and (c0 % BLOCK or (c1 % BLOCK and c1 != cols)):
            raise MCFError(
                f"col_range ({c0}, {c1}) of a {self.method.value} matrix must start on a {BLOCK}-value block and end "
                f"on one or at column {cols}"
            )
        self.layout: PayloadLayout = payload_layout(self.method, r1 - r0, c1 - c0, domain=self.domain) if part else full
        self.rows, self.cols = r1 - r0, c1 - c0
        self.cache: CacheMode = cache
        self.tile_bytes = DEFAULT_TILE_BYTES if tile_bytes is None else tile_bytes
        self._tile_option = tile_bytes
        if gemv_max_batch is None:
            gemv_max_batch = (
                COMPILED_GEMV_MAX_BATCH if cache == "packed" and compiled is not None else DEFAULT_GEMV_MAX_BATCH
            )
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
        self._compiled: CompiledPayload | None = None
        self._int_scale = np.float32(1.0)
        self._int_zero = np.float32(0.0)
        if cache == "packed" and compiled is not None:
            if pages == "huge" and not part and flat.nbytes >= HUGE_PAGE and not in_arena(flat):
                copy = HugePageArena(chunk_bytes=flat.nbytes).take(flat.nbytes)
                copy[:] = flat
                flat = copy
            self._compiled = CompiledPayload(compiled, flat, full, (r0, r1), (c0, c1))
        elif cache == "fp32":
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

    @property
    def compiled(self) -> bool:
        """Whether calls run the compiled kernels."""
        return self._compiled is not None

    @property
    def compiled_payload(self) -> CompiledPayload | None:
        """The compiled payload calls multiply by (the decode region and a prompt's grouped products call its
        kernels directly), or None when calls run the numpy paths."""
        return self._compiled

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
            codes_t[:, a - r0 : b - r0] = (
                (codes[:, b0:b1] if nb != full.blocks_per_row else codes).reshape(b - a, nb * BLOCK).T
            )
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
        if self._compiled is not None:
            return self._compiled.nbytes
        arrays = (self._flat, self._fp32, self._codes_t, self._scales_t, self._scales)
        return sum(a.nbytes for a in arrays if a is not None)

    def __repr__(self) -> str:
        path = ", compiled" if self._compiled is not None else ""
        return f"QuantizedLinear({self.method.value}, rows={self.rows}, cols={self.cols}, cache={self.cache!r}{path})"

    # --- application ---------------------------------------------------------------------------------------------
    def __call__(self, x: npt.ArrayLike) -> npt.NDArray[np.float32]:
        if (
            type(x) is np.ndarray
            and x.dtype == np.float32
            and x.ndim == 2
            and x.shape[1] == self.cols
            and x.flags.c_contiguous
        ):
            # Already in the form the products take: no conversion, no copy, since every Python step before a
            # product is paid again, from memory, when it runs after other work
            x2, lead = x, x.shape[:1]
        else:
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
        if self._compiled is not None:
            out = self._compiled.matmul(
                x2, threads=self.threads, gemv_max_batch=self.gemv_max_batch, tile_bytes=self._tile_option
            )
            return out.reshape(*lead, self.rows)
        m = x2.shape[0]
        if self._codes_t is not None and self.method.family != "int":
            xp = self._padded_input(x2)
            if m <= self.gemv_max_batch:
                xb = xp.reshape(m, self.layout.blocks_per_row, BLOCK).transpose(1, 0, 2)  # [nb, m, 32]
                out = np.zeros((m, self.rows), dtype=np.float32)
                self._over_rows(lambda r0, r1: self._blockwise_gemv(xb, out, r0, r1))
            else:
                out = np.empty((m, self.rows), dtype=np.float32)
                self._over_rows(lambda r0, r1: self._ktiled(xp, out, r0, r1))
        elif self._codes_t is not None:
            out = np.empty((m, self.rows), dtype=np.float32)
            self._over_rows(lambda r0, r1: self._ktiled(x2, out, r0, r1))
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
        if self._compiled is not None:
            return self._compiled.take_rows(flat_idx).reshape(*idx.shape, self.cols)
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
        size = math.prod(shape)  # np.prod costs more than a small product's other work (docs/performance.md)
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

    def _blockwise_gemv_rows(self, xb: npt.NDArray[np.float32], out: npt.NDArray[np.float32], r0: int, r1: int) -> None:
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
            # streams RAM far more slowly than a plain reduction does: reading them first leaves them in L2 for the
            # cast (measured in docs/performance.md, "MCF runner").
            codes.max()
            np.copyto(tile, codes, casting="unsafe")
            part = partial[:g]
            np.matmul(xb[b0:b1], tile.reshape(g, BLOCK, rows), out=part)
            part *= scales_t[b0:b1, None, r0:r1]
            dest += part.sum(axis=0)

    def _ktiled(self, x: npt.NDArray[np.float32], out: npt.NDArray[np.float32], r0: int, r1: int) -> None:
        """``out[:, r0:r1] = x @ W[r0:r1].T`` from the int8 cache, decoding K-tiles of the transposed codes to fp32
        for BLAS: per-block scales for the block methods, the tensor's zero point and scale for int8 / int4."""
        codes_t = self._codes_t
        assert codes_t is not None
        blockwise = self.method.family != "int"
        step, width = (BLOCK, self.layout.padded_cols) if blockwise else (1, self.cols)
        m, rows = x.shape[0], r1 - r0
        kt = max(step, min(width, (self.tile_bytes // (4 * rows)) // step * step))
        tile_buf = self._buffer("tile", (kt, rows))
        acc = out[:, r0:r1]  # BLAS writes a column range in place (leading dimension = all rows)
        tmp = self._buffer("partial", (m, rows))
        for k0 in range(0, width, kt):
            k1 = min(width, k0 + kt)
            tile = tile_buf[: k1 - k0]
            np.copyto(tile, codes_t[k0:k1, r0:r1], casting="unsafe")
            if blockwise:
                assert self._scales_t is not None
                blocks = tile.reshape((k1 - k0) // BLOCK, BLOCK, rows)
                np.multiply(blocks, self._scales_t[k0 // BLOCK : k1 // BLOCK, None, r0:r1], out=blocks)
            if k0 == 0:
                np.matmul(x[:, k0:k1], tile, out=acc)
            else:
                np.matmul(x[:, k0:k1], tile, out=tmp)
                acc += tmp
        if not blockwise:
            if self._int_zero != 0:
                acc -= self._int_zero * x.sum(axis=1, keepdims=True)
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
