"""The compiled path of `QuantizedLinear`'s ``packed`` cache: products straight from the payload as stored.

`compiled_kernels` decides between this path and the numpy one: the environment variable ``CARTON_MCF_KERNELS``
(``auto``, the default: numba when it imports; ``numba``: required; ``numpy``: never) or a ``kernels=`` argument.
`CompiledPayload` holds nothing but a view of the payload (and, for a part of a split model, the part's position
in it) and calls the kernels of `_compiled`:

- batches up to ``gemv_max_batch`` rows: activations rounded to int16 per block, integer block products
  (`_compiled.block_kernels`), rows split across numba's threads when ``threads > 1``;
- larger batches (prefill), where the CPU has 512-bit VNNI (`_compiled.PANEL_PRODUCTS`): activations rounded to
  int16 as for small batches, weight rows unpacked into int16 panels and multiplied by the integer micro-kernel of
  `_panel`, groups of rows split across numba's threads when ``threads > 1``;
- larger batches elsewhere: row tiles decoded to float32 on the calling thread, each multiplied by the activations
  in one BLAS call that BLAS splits across its own threads;
- int8 / int4 payloads (one tensor scale, rows not aligned to blocks): decoded tiles and BLAS for every batch.
"""

from __future__ import annotations

import importlib
import os
import threading
import warnings
from collections.abc import Callable
from types import ModuleType
from typing import Literal, TypeVar

import numpy as np
import numpy.typing as npt
from carton.mcf import (
    BLOCK,
    MCFError,
    PayloadLayout,
    block_scales,
    int_parameters,
)

__all__ = [
    "KERNELS_ENV",
    "PREFILL_TILE_BYTES",
    "Activations",
    "CompiledPayload",
    "Kernels",
    "activation_buffers",
    "compiled_kernels",
    "without_threads",
]

Kernels = Literal["auto", "numba", "numpy"]
#: Environment variable choosing the kernels when ``kernels="auto"``: ``auto``, ``numba`` or ``numpy``.
KERNELS_ENV = "CARTON_MCF_KERNELS"
_CHOICES = ("auto", "numba", "numpy")
# Rows below which a part is not worth a thread of its own (the hand-off costs more than the rows).
_MIN_ROWS_PER_PART = 64
#: Work buffer of the large-batch path per thread (float32 rows decoded for BLAS): the whole of a small model's
#: matrix, so that one sgemm call does a product (tile-sized calls cost more than the decoding they save).
PREFILL_TILE_BYTES = 8 << 20

_loaded: dict[str, ModuleType | None] = {}
_parallel_broken = False
_local = threading.local()


def compiled_kernels(choice: Kernels | str = "auto") -> ModuleType | None:
    """The compiled kernels module, or None when the numpy path is to be used.

    ``"auto"`` reads ``CARTON_MCF_KERNELS`` (``"auto"`` there too: numba if it can be imported). ``"numba"``
    without numba installed is an `MCFError` saying how to install it.
    """
    if choice not in _CHOICES:
        raise MCFError(f"unknown kernels {choice!r} (expected one of: {', '.join(_CHOICES)})")
    if choice == "auto":
        choice = os.environ.get(KERNELS_ENV, "auto").strip().lower() or "auto"
        if choice not in _CHOICES:
            raise MCFError(f"{KERNELS_ENV}={choice!r} is not one of: {', '.join(_CHOICES)}")
    if choice == "numpy":
        return None
    if "module" not in _loaded:
        try:
            _loaded["module"] = importlib.import_module("carton_runner_mcf._compiled")
        except ImportError:
            _loaded["module"] = None
    module = _loaded["module"]
    if module is None and choice == "numba":
        raise MCFError("the compiled mcf kernels need numba: pip install 'carton-runtime[mcf]'")
    return module


Activations = tuple[npt.NDArray[np.int16], npt.NDArray[np.float32], npt.NDArray[np.float32], npt.NDArray[np.float32]]


_B = TypeVar("_B")


def _thread_buffers(
    name: str, m: int, blocks: int, make: Callable[[ModuleType, int, int], _B], kernels: ModuleType
) -> _B:
    """This thread's work arrays `name` for ``m`` rows of ``blocks`` blocks, made by ``make(kernels, m, blocks)`` on
    first use and reused across calls (no buffer escapes a call)."""
    buffers: dict[tuple[int, int], _B] | None = getattr(_local, name, None)
    if buffers is None:
        buffers = {}
        setattr(_local, name, buffers)
    found = buffers.get((m, blocks))
    if found is None:
        if len(buffers) > 64:  # many shapes (prefill chunks of every length): start over
            buffers.clear()
        found = buffers[(m, blocks)] = make(kernels, m, blocks)
    return found


def _new_activations(kernels: ModuleType, m: int, blocks: int) -> Activations:
    codes, scales, spread = kernels.activation_shapes(m, blocks)
    return (np.empty(codes, np.int16), np.empty(scales, np.float32), np.empty(spread, np.float32),
            np.empty(scales, np.float32))  # fmt: skip


def _new_panel_activations(
    kernels: ModuleType, m: int, blocks: int
) -> tuple[npt.NDArray[np.int16], npt.NDArray[np.float32]]:
    codes, scales = kernels.panel_shapes(m, blocks)
    return np.empty(codes, np.int16), np.empty(scales, np.float32)


def activation_buffers(kernels: ModuleType, m: int, blocks: int) -> Activations:
    """This thread's work arrays for ``m`` activation rows of a part of ``blocks`` blocks: int16 codes, block
    scales, spread scales and offsets (`_compiled.activation_shapes`)."""
    return _thread_buffers("activations", m, blocks, _new_activations, kernels)


def _panel_buffers(kernels: ModuleType, m: int, blocks: int) -> tuple[npt.NDArray[np.int16], npt.NDArray[np.float32]]:
    """This thread's int16 activation codes and block scales for the panel kernels (`_panel.activation_shapes`)."""
    return _thread_buffers("panel", m, blocks, _new_panel_activations, kernels)


def _tile_buffer(size: int) -> npt.NDArray[np.float32]:
    """This thread's float32 work buffer of at least ``size`` values (reallocated only to grow)."""
    buf: npt.NDArray[np.float32] | None = getattr(_local, "tile", None)
    if buf is None or buf.size < size:
        buf = _local.tile = np.empty(size, dtype=np.float32)
    return buf


def without_threads(exc: ValueError) -> None:
    """A threaded kernel raised `exc`: when numba found no thread-safe threading layer (tbb or OpenMP), products run
    on one thread from then on (with a warning); any other error is raised again."""
    global _parallel_broken
    if "threading layer" not in str(exc):
        raise exc
    _parallel_broken = True
    warnings.warn(f"mcf kernels run on one thread: {exc}", RuntimeWarning, stacklevel=3)


class CompiledPayload:
    """Rows ``rows`` and columns ``cols`` (half-open ranges) of the tensor whose payload ``flat`` has ``layout``,
    multiplied by the compiled kernels. Columns of a q* / k* part start on a block (and end on one or at the last
    column); the caller checks that."""

    def __init__(
        self,
        kernels: ModuleType,
        flat: npt.NDArray[np.uint8],
        layout: PayloadLayout,
        rows: tuple[int, int],
        cols: tuple[int, int],
    ) -> None:
        self._k = kernels
        self._flat = flat
        self.layout = layout
        (r0, r1), (c0, c1) = rows, cols
        self.rows, self.cols = r1 - r0, c1 - c0
        self._r0, self._c0 = r0, c0
        self._int = layout.method.family == "int"
        if self._int:
            self._scale, self._zero = int_parameters(flat, layout)
            self.width = self.cols
            return
        block_scales(flat, layout)  # validates every scale and sub-scale once, as the other caches do
        self.blocks = -(-c1 // BLOCK) - c0 // BLOCK
        sub = layout.sub_scales.offset if layout.sub_scales is not None else 0
        self.meta = np.array(
            [layout.data.offset, layout.scales.offset, sub, layout.blocks_per_row, layout.supers_per_row, r0,
             c0 // BLOCK, self.blocks, layout.method.family == "k", layout.bits],
            dtype=np.int64,
        )  # fmt: skip
        self.width = self.blocks * BLOCK
        self._kernels = kernels.block_kernels(layout.bits)
        #: The large-batch kernels (`_panel`) where they are faster than decoded tiles and BLAS, else None.
        self.panels = kernels.panel_kernels(layout.bits) if kernels.PANEL_PRODUCTS else None

    @property
    def nbytes(self) -> int:
        return int(self._flat.nbytes)

    @property
    def payload(self) -> npt.NDArray[np.uint8]:
        """The payload as stored (a view of the mapped file, or of the bytes given)."""
        return self._flat

    # --- products ------------------------------------------------------------------------------------------------
    def matmul(
        self, x2: npt.NDArray[np.float32], *, threads: int, gemv_max_batch: int, tile_bytes: int | None
    ) -> npt.NDArray[np.float32]:
        """``x2 [m, cols] @ W.T`` as float32 ``[m, rows]`` (``tile_bytes``: the large-batch work buffer, by
        default `PREFILL_TILE_BYTES`)."""
        m = x2.shape[0]
        if not self._int and m <= gemv_max_batch:
            return self._blockwise(x2, threads)
        if not self._int and self.panels is not None:
            return self.paneled(x2, threads)
        return self.tiled(x2, tile_bytes)

    def paneled(self, x2: npt.NDArray[np.float32], threads: int) -> npt.NDArray[np.float32]:
        """``x2 @ W.T`` by the int16 panel kernels (`_panel`; q* / k* parts), whichever CPU this is (elsewhere
        than 512-bit VNNI only slower); groups of sixteen rows split across ``threads`` of numba's."""
        kernels = self.panels if self.panels is not None else self._k.panel_kernels(self.layout.bits)
        m = x2.shape[0]
        codes, scales = _panel_buffers(self._k, m, self.blocks)
        out = np.empty((m, self.rows), dtype=np.float32)
        parts = min(threads, self._k.MAX_THREADS, self.rows // _MIN_ROWS_PER_PART)
        if parts > 1 and not _parallel_broken:
            try:
                kernels.matmul_parallel(self._flat, self.meta, x2, codes, scales, out, parts)
                return out
            except ValueError as exc:
                without_threads(exc)
        kernels.matmul(self._flat, self.meta, x2, codes, scales, out)
        return out

    def _blockwise(self, x2: npt.NDArray[np.float32], threads: int) -> npt.NDArray[np.float32]:
        xq, xs, xe, xoff = activation_buffers(self._k, x2.shape[0], self.blocks)
        out = np.empty((x2.shape[0], self.rows), dtype=np.float32)
        parts = min(threads, self._k.MAX_THREADS, self.rows // _MIN_ROWS_PER_PART)
        if parts > 1 and not _parallel_broken:
            try:
                self._kernels.matmul_parallel(self._flat, self.meta, x2, xq, xs, xe, xoff, out, parts)
                return out
            except ValueError as exc:
                without_threads(exc)
        self._kernels.matmul(self._flat, self.meta, x2, xq, xs, xe, xoff, out)
        return out

    def tiled(self, x2: npt.NDArray[np.float32], tile_bytes: int | None = None) -> npt.NDArray[np.float32]:
        """``x2 @ W.T`` by row tiles decoded to float32 and BLAS (``tile_bytes``: the work buffer, by default
        `PREFILL_TILE_BYTES`)."""
        # One tile after another on the calling thread, each product one sgemm call that BLAS splits across its own
        # threads: splitting the rows across a pool of ours as well had each pool thread call a threaded sgemm, and
        # the two levels of threads fought over the cores.
        m = x2.shape[0]
        out = np.empty((m, self.rows), dtype=np.float32)
        step = max(1, (PREFILL_TILE_BYTES if tile_bytes is None else tile_bytes) // (4 * self.width))
        tile = _tile_buffer(min(step, self.rows) * self.width)
        for t0 in range(0, self.rows, step):
            t1 = min(self.rows, t0 + step)
            part = tile[: (t1 - t0) * self.width].reshape(t1 - t0, self.width)
            self.decode(t0, t1, part)
            weights = part[:, : self.cols]  # codes past the last column, if any, are not part of the matrix
            if t1 - t0 == self.rows:
                np.matmul(x2, weights.T, out=out)
            else:
                out[:, t0:t1] = x2 @ weights.T
        return out

    def decode(self, first: int, last: int, out: npt.NDArray[np.float32]) -> None:
        """Rows ``first..last`` of the part as float32 ``[last - first, width]`` (q* / k*: columns past ``cols``
        hold the payload's padding codes)."""
        if self._int:
            first_code = self._r0 * self.layout.cols + self._c0
            self._k.decode_int_rows(
                self._flat,
                self.layout.data.offset,
                first_code,
                self.layout.cols,
                self.layout.bits,
                self._scale,
                self._zero,
                out[:, : self.cols],
                first,
                last,
            )
            return
        self._kernels.decode(self._flat, self.meta, out, first, last)

    def take_rows(self, indices: npt.NDArray[np.intp]) -> npt.NDArray[np.float32]:
        """Dequantized rows ``indices`` of the part, ``[len(indices), cols]``."""
        out = np.empty((indices.size, self.cols), dtype=np.float32)
        row = np.empty((1, self.width), dtype=np.float32)
        for i, r in enumerate(indices):
            self.decode(int(r), int(r) + 1, row)
            out[i] = row[0, : self.cols]
        return out
