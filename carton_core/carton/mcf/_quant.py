"""Quantizers for every MCF method: int8/int4 (weights and activations), q8/q4 and k6/k4/k3/k2.

Two modes:

* ``"best"`` minimises the reconstruction error the format allows: per block a search over candidate scales, each
  refit by least squares; scales rounded to the *nearest* fp16; k* sub-scales use all 63 steps with a local search;
  codes always computed against the scale that is actually stored.
* ``"reference"`` reproduces the reference Go writer (mantle ``quantize``) byte for byte: block scale
  ``max|x| / qmax``, fp16 by truncating the mantissa, k* sub-scales ``round(32 * scale / super)`` (so 1..32), codes
  rounded half away from zero against the unrounded float32 scale.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import numpy as np
import numpy.typing as npt

from carton.errors import MCFError
from carton.mcf._decode import dequantize
from carton.mcf._fp16 import F16_MAX, f16_bits_to_f32, f32_to_f16_nearest, f32_to_f16_truncate
from carton.mcf._layout import SUPER_BLOCKS, PayloadLayout, coerce_domain, coerce_method, payload_layout
from carton.mcf._packing import BLOCK, pack_blocks
from carton.mcf._types import QuantDomain, QuantMethod

__all__ = ["QuantMode", "QuantizedTensor", "quantize"]

QuantMode = Literal["best", "reference"]

# Blocks processed per step by the scale search (bounds the temporaries to a few MB).
_CHUNK_BLOCKS = 1 << 14
# The "best" search per block: codes for max|x| above qmax (clipping) up to qmax * span in _SEARCH_STEPS steps (lower
# widths clip more), and below it down to qmax / 2 in steps of min(1, qmax / _SEARCH_DOWN_STEPS).
_SEARCH_SPAN = {8: 1.06, 6: 1.15, 4: 1.45, 3: 1.8, 2: 3.2}
_SEARCH_STEPS = 20
_SEARCH_DOWN_STEPS = 32


@dataclass(frozen=True, slots=True, kw_only=True)
class QuantizedTensor:
    """A quantized rank-2 tensor: the exact payload bytes plus the QuantInfo clip bounds used to make them."""

    method: QuantMethod
    domain: QuantDomain
    shape: tuple[int, int]
    payload: bytes
    min_clip: float
    max_clip: float

    @property
    def layout(self) -> PayloadLayout:
        """Where the payload's regions are (`payload_layout` of this method, shape and domain)."""
        return payload_layout(self.method, *self.shape, domain=self.domain)

    def dequantize(self) -> npt.NDArray[np.float32]:
        """The float32 tensor the payload reconstructs (``carton.mcf.dequantize`` of it)."""
        return dequantize(self.payload, self.method, self.shape, domain=self.domain)


def quantize(
    array: npt.ArrayLike,
    method: QuantMethod | str,
    *,
    domain: QuantDomain | int = QuantDomain.WEIGHTS,
    mode: QuantMode = "best",
    min_clip: float | None = None,
    max_clip: float | None = None,
) -> QuantizedTensor:
    """Quantize a finite rank-2 float array (``[rows = out_features, cols = in_features]``; blocks run along cols).

    ``min_clip``/``max_clip`` (both or neither) clamp the values first; by default they are ``-max|x|, max|x|`` for
    weights and the data range widened to include 0 for activations. Both are recorded for QuantInfo.
    """
    method = coerce_method(method)
    domain = coerce_domain(domain)
    if mode not in ("best", "reference"):
        raise MCFError(f"unknown quantization mode {mode!r} (expected 'best' or 'reference')")
    try:
        values = np.asarray(array, dtype=np.float32)
    except (TypeError, ValueError) as exc:
        raise MCFError(f"cannot quantize {type(array).__name__} as float32: {exc}") from exc
    if values.ndim != 2:
        raise MCFError(f"{method.value} quantizes rank-2 tensors [rows, cols]; got shape {values.shape}")
    rows, cols = values.shape
    layout = payload_layout(method, rows, cols, domain=domain)
    if not np.isfinite(values).all():
        raise MCFError(f"cannot quantize to {method.value}: the tensor contains NaN or Inf")
    lo, hi = _clip_bounds(values, domain, min_clip, max_clip)
    if min_clip is not None or (domain is QuantDomain.ACTIVATIONS):
        values = np.clip(values, lo, hi)
    if method.family == "int":
        payload = _quantize_int(values, layout, lo, hi, mode)
    elif method.family == "q":
        payload = _quantize_q(values, layout, mode)
    else:
        payload = _quantize_k(values, layout, mode)
    if len(payload) != layout.size:  # pragma: no cover - guards the layout arithmetic
        raise MCFError(f"internal error: {method.value} payload is {len(payload)} bytes, expected {layout.size}")
    return QuantizedTensor(
        method=method, domain=domain, shape=(rows, cols), payload=payload, min_clip=float(lo), max_clip=float(hi)
    )


def _clip_bounds(
    values: npt.NDArray[np.float32], domain: QuantDomain, min_clip: float | None, max_clip: float | None
) -> tuple[np.float32, np.float32]:
    if (min_clip is None) != (max_clip is None):
        raise MCFError("min_clip and max_clip must be given together")
    if min_clip is not None and max_clip is not None:
        lo, hi = np.float32(min_clip), np.float32(max_clip)
        if not (np.isfinite(lo) and np.isfinite(hi)) or lo > hi:
            raise MCFError(f"clip bounds must be finite with min_clip <= max_clip, got [{min_clip}, {max_clip}]")
        return lo, hi
    vmin, vmax = np.float32(values.min()), np.float32(values.max())
    if domain is QuantDomain.WEIGHTS:
        amax = np.float32(max(abs(float(vmin)), abs(float(vmax))))
        return np.float32(-amax), amax
    return np.float32(min(float(vmin), 0.0)), np.float32(max(float(vmax), 0.0))


# --- helpers --------------------------------------------------------------------------------------------------------
def _blocks(values: npt.NDArray[np.float32], layout: PayloadLayout) -> npt.NDArray[np.float32]:
    """Zero-pad each row to whole blocks: ``[rows, blocks_per_row, 32]``."""
    rows, cols = values.shape
    if cols == layout.padded_cols:
        return values.reshape(rows, layout.blocks_per_row, BLOCK)
    padded = np.zeros((rows, layout.padded_cols), dtype=np.float32)
    padded[:, :cols] = values
    return padded.reshape(rows, layout.blocks_per_row, BLOCK)


def _round_half_away(x: npt.NDArray[np.float32]) -> npt.NDArray[np.float64]:
    """Go's math.Round of float32 products (exact in float64 for every float32 input)."""
    y = x.astype(np.float64)
    return np.copysign(np.floor(np.abs(y) + 0.5), y)


def _chunks(total: int, step: int = _CHUNK_BLOCKS) -> Iterator[slice]:
    for start in range(0, total, step):
        yield slice(start, min(total, start + step))


def _assemble(*regions: tuple[int, bytes]) -> bytes:
    """Concatenate regions at their offsets, zero-filling the alignment gaps."""
    out = bytearray()
    for offset, data in regions:
        out.extend(b"\0" * (offset - len(out)))
        out.extend(data)
    return bytes(out)


def _f16_checked(scales: npt.NDArray[np.float32], method: QuantMethod) -> None:
    if scales.size and float(scales.max()) > F16_MAX:
        raise MCFError(f"{method.value}: a block scale of {float(scales.max()):.6g} overflows fp16 (max {F16_MAX})")


def _search_scales(x: npt.NDArray[np.float32], qmax: int) -> npt.NDArray[np.float32]:
    """Per-row least-squares-optimal scale over candidate codes for ``max|x|``; ``x`` is ``[n, 32]``.

    Each candidate ``N`` rounds ``x * N / max|x|`` to codes (the largest value gets code ``N``); the scale is then refit
    by least squares, which leaves the residual ``sum(x x) - sum(x q)^2 / sum(q q)``. Candidates run down from ``qmax``
    to ``qmax / 2`` (coarser grids whose points can land closer to the values: every integer for 8-bit) and up to
    ``qmax * span`` (finer grids that clip the largest values).
    """
    amax = np.abs(x).max(axis=1)
    nonzero = amax > 0
    safe_amax = np.where(nonzero, amax, np.float32(1.0))
    # Transposed ([32, n]) so that the per-block sums run along contiguous memory, about a third faster.
    unit = np.ascontiguousarray((x / safe_amax[:, None]).astype(np.float32).T)
    best_gain = np.full(x.shape[0], -1.0, dtype=np.float32)
    best_n = np.full(x.shape[0], np.float32(qmax), dtype=np.float32)
    q = np.empty_like(unit)
    for n in _candidate_codes(qmax):
        np.multiply(unit, n, out=q)
        np.rint(q, out=q)
        if n > qmax:
            np.clip(q, -qmax, qmax, out=q)
        suq = np.einsum("ij,ij->j", unit, q)
        sqq = np.einsum("ij,ij->j", q, q)
        # The refit explains suq^2 / sqq of sum(unit^2): the larger, the smaller the residual.
        gain = suq * suq / np.where(sqq > 0, sqq, np.float32(1.0))
        better = gain > best_gain
        best_gain = np.where(better, gain, best_gain)
        best_n = np.where(better, n, best_n)
    # Gains differ from the residuals they rank by float32 cancellation: an exact fit at qmax (weights stored at this
    # precision before) must not lose to a candidate that only looks as good within rounding, so residuals decide.
    scale, residual = _refit(unit, best_n, qmax)
    plain_scale, plain_residual = _refit(unit, np.float32(qmax), qmax)
    plain = plain_residual <= residual
    scale = np.where(plain, plain_scale, scale)
    return np.where(nonzero, amax * scale, np.float32(0.0)).astype(np.float32)


def _refit(
    unit: npt.NDArray[np.float32], n: npt.NDArray[np.float32] | np.float32, qmax: int
) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.float32]]:
    """Least-squares scale of the codes ``rint(unit * n)`` (``unit`` ``[32, blocks]``) and the residual it leaves."""
    q = np.clip(np.rint(unit * n), -qmax, qmax)
    sqq = np.einsum("ij,ij->j", q, q)
    ok = sqq > 0
    scale = np.where(ok, np.einsum("ij,ij->j", unit, q) / np.where(ok, sqq, np.float32(1.0)), np.float32(0.0))
    diff = unit - q * scale
    residual: npt.NDArray[np.float32] = np.einsum("ij,ij->j", diff, diff)
    return scale.astype(np.float32), residual


def _candidate_codes(qmax: int) -> npt.NDArray[np.float32]:
    """The codes tried for ``max|x|`` by `_search_scales`: ``qmax`` first, then coarser, then clipping ones."""
    down_step = min(1.0, qmax / _SEARCH_DOWN_STEPS)
    down = qmax - down_step * np.arange(int(np.floor(qmax / 2 / down_step)) + 1)
    bits = _bits_of_qmax(qmax)
    # Within 32 values clipping never pays at 8 bits (measured on Gaussian and SmolLM2 blocks): no such candidates.
    up = np.linspace(qmax, qmax * _SEARCH_SPAN[bits], _SEARCH_STEPS)[1:] if bits < 8 else np.zeros(0)
    return np.concatenate([down, up]).astype(np.float32)


def _bits_of_qmax(qmax: int) -> int:
    return {127: 8, 31: 6, 7: 4, 3: 3, 1: 2}[qmax]


def _codes_for(x: npt.NDArray[np.float32], scales: npt.NDArray[np.float32], qmax: int) -> npt.NDArray[np.int8]:
    """Nearest codes for the stored scales (``x`` ``[n, 32]``, scales ``[n]``; zero scale gives zero codes)."""
    inv = np.where(scales > 0, np.float32(1.0) / np.where(scales > 0, scales, 1), 0).astype(np.float32)
    q: npt.NDArray[np.float32] = np.rint(x * inv[:, None])
    np.clip(q, -qmax, qmax, out=q)
    return q.astype(np.int8)


def _block_error(x: npt.NDArray[np.float32], scales: npt.NDArray[np.float32], qmax: int) -> npt.NDArray[np.float32]:
    q = _codes_for(x, scales, qmax).astype(np.float32)
    diff = x - q * scales[:, None]
    err: npt.NDArray[np.float32] = np.einsum("ij,ij->i", diff, diff)
    return err


# --- q* (block 32, fp16 scales) -------------------------------------------------------------------------------------
def _quantize_q(values: npt.NDArray[np.float32], layout: PayloadLayout, mode: QuantMode) -> bytes:
    qmax = (1 << (layout.bits - 1)) - 1
    flat = _blocks(values, layout).reshape(-1, BLOCK)
    scale_bits = np.empty(flat.shape[0], dtype=np.uint16)
    codes = np.empty(flat.shape, dtype=np.int8)
    for part in _chunks(flat.shape[0]):
        x = flat[part]
        if mode == "reference":
            amax = np.abs(x).max(axis=1)
            scale = (amax / np.float32(qmax)).astype(np.float32)
            scale_bits[part] = f32_to_f16_truncate(scale)
            codes[part] = _reference_codes(x, scale, qmax)
        else:
            scale = _search_scales(x, qmax)
            _f16_checked(scale, layout.method)
            bits16 = f32_to_f16_nearest(scale)
            scale_bits[part] = bits16
            codes[part] = _codes_for(x, f16_bits_to_f32(bits16), qmax)
    data = pack_blocks(codes, layout.bits)
    return _assemble((layout.scales.offset, scale_bits.astype("<u2").tobytes()), (layout.data.offset, data.tobytes()))


def _reference_codes(x: npt.NDArray[np.float32], scale: npt.NDArray[np.float32], qmax: int) -> npt.NDArray[np.int8]:
    with np.errstate(divide="ignore"):
        inv = np.where(scale != 0, np.float32(1.0) / scale, np.float32(0.0)).astype(np.float32)
    q = _round_half_away((x * inv[:, None]).astype(np.float32))
    return np.clip(q, -qmax, qmax).astype(np.int8)


# --- k* (super-block 256: fp16 super-scale, 6-bit sub-scales) -------------------------------------------------------
def _quantize_k(values: npt.NDArray[np.float32], layout: PayloadLayout, mode: QuantMode) -> bytes:
    qmax = (1 << (layout.bits - 1)) - 1
    rows, nb, ns = layout.rows, layout.blocks_per_row, layout.supers_per_row
    # Pad the block axis to whole super-blocks; padded blocks are all-zero and never written.
    blocks = np.zeros((rows, ns * SUPER_BLOCKS, BLOCK), dtype=np.float32)
    blocks[:, :nb] = _blocks(values, layout)
    grouped = blocks.reshape(rows * ns, SUPER_BLOCKS, BLOCK)
    super_bits = np.empty(rows * ns, dtype=np.uint16)
    sub = np.empty((rows * ns, SUPER_BLOCKS), dtype=np.uint8)
    codes = np.empty((rows * ns, SUPER_BLOCKS, BLOCK), dtype=np.int8)
    step = max(1, _CHUNK_BLOCKS // SUPER_BLOCKS)
    for part in _chunks(rows * ns, step):
        x = grouped[part].reshape(-1, BLOCK)
        n = x.shape[0] // SUPER_BLOCKS
        if mode == "reference":
            bits16, sub_u6, scale = _reference_k_scales(x, qmax, n)
            block_codes = _reference_codes(x, scale, qmax)
        else:
            bits16, sub_u6, scale = _best_k_scales(x, qmax, n, layout.method)
            block_codes = _codes_for(x, scale, qmax)
        super_bits[part] = bits16
        sub[part] = sub_u6.reshape(n, SUPER_BLOCKS)
        codes[part] = block_codes.reshape(n, SUPER_BLOCKS, BLOCK)
    sub_row = sub.reshape(rows, ns * SUPER_BLOCKS)[:, :nb]
    code_rows = codes.reshape(rows, ns * SUPER_BLOCKS, BLOCK)[:, :nb]
    data = pack_blocks(np.ascontiguousarray(code_rows), layout.bits)
    assert layout.sub_scales is not None
    return _assemble(
        (layout.scales.offset, super_bits.astype("<u2").tobytes()),
        (layout.sub_scales.offset, np.ascontiguousarray(sub_row).tobytes()),
        (layout.data.offset, data.tobytes()),
    )


def _reference_k_scales(
    x: npt.NDArray[np.float32], qmax: int, n: int
) -> tuple[npt.NDArray[np.uint16], npt.NDArray[np.uint8], npt.NDArray[np.float32]]:
    block_scale = (np.abs(x).max(axis=1) / np.float32(qmax)).astype(np.float32).reshape(n, SUPER_BLOCKS)
    super_scale = block_scale.max(axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = (block_scale / super_scale[:, None]).astype(np.float32)
    u = np.clip(_round_half_away((ratio * np.float32(32.0)).astype(np.float32)), 1, 63)
    live = (block_scale > 0) & (super_scale[:, None] > 0)
    u6 = np.where(live, u, 0).astype(np.uint8)
    scale = (super_scale[:, None] * (u6.astype(np.float32) / np.float32(32.0))).astype(np.float32)
    return f32_to_f16_truncate(super_scale), u6.reshape(-1), scale.reshape(-1)


def _best_k_scales(
    x: npt.NDArray[np.float32], qmax: int, n: int, method: QuantMethod
) -> tuple[npt.NDArray[np.uint16], npt.NDArray[np.uint8], npt.NDArray[np.float32]]:
    ideal = _search_scales(x, qmax).reshape(n, SUPER_BLOCKS)
    # The largest block scale maps to sub-scale 63 so every block keeps as many sub-scale steps as possible.
    super_raw = (ideal.max(axis=1) * np.float32(32.0 / 63.0)).astype(np.float32)
    _f16_checked(super_raw, method)
    bits16 = f32_to_f16_nearest(super_raw)
    super16 = f16_bits_to_f32(bits16)
    live = (ideal > 0) & (super16[:, None] > 0)
    with np.errstate(divide="ignore", invalid="ignore"):
        u0 = np.where(live, np.rint(ideal / super16[:, None] * np.float32(32.0)), 0)
    u0 = np.clip(u0, 1, 63)
    flat_x = x
    best_u = np.where(live, u0, 0).reshape(-1)
    best_err = np.full(best_u.shape, np.inf, dtype=np.float32)
    super_per_block = np.repeat(super16, SUPER_BLOCKS)
    live_flat = live.reshape(-1)
    for delta in (-1, 0, 1):
        u = np.clip(u0.reshape(-1) + delta, 1, 63)
        scale = (super_per_block * (u.astype(np.float32) / np.float32(32.0))).astype(np.float32)
        err = _block_error(flat_x, np.where(live_flat, scale, 0).astype(np.float32), qmax)
        better = live_flat & (err < best_err)
        best_err = np.where(better, err, best_err)
        best_u = np.where(better, u, best_u)
    u6 = best_u.astype(np.uint8)
    scale = (super_per_block * (u6.astype(np.float32) / np.float32(32.0))).astype(np.float32)
    return bits16, u6, scale


# --- int* (one tensor scale; zero point in the activations domain) -------------------------------------------------
def _quantize_int(
    values: npt.NDArray[np.float32], layout: PayloadLayout, lo: np.float32, hi: np.float32, mode: QuantMode
) -> bytes:
    bits = layout.bits
    flat = values.reshape(-1)
    if layout.domain is QuantDomain.WEIGHTS:
        qmin, qmax = -((1 << (bits - 1)) - 1), (1 << (bits - 1)) - 1
        amax = np.float32(max(abs(lo), abs(hi)))
        scale = np.float32(amax / np.float32(qmax))
        if mode == "best" and amax > 0:
            scale = _search_tensor_scale(flat, qmax, amax)
        zero = np.float32(0.0)
    else:
        qmin, qmax = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
        span = np.float32(hi - lo)
        if span > 0:
            scale = np.float32(span / np.float32(qmax - qmin))
            zero = np.float32(np.clip(np.rint(np.float32(qmin) - lo / scale), qmin, qmax))
        else:  # a constant tensor: represent the constant exactly with code +-1 or 0
            scale = np.float32(abs(lo)) if lo != 0 else np.float32(1.0)
            zero = np.float32(0.0)
    inv = np.float32(1.0) / scale if scale > 0 else np.float32(0.0)
    codes = np.clip(np.rint(flat * inv + zero), qmin, qmax).astype(np.int8)
    if bits == 8:
        data = codes.view(np.uint8)
    else:
        u = codes.astype(np.uint8) & np.uint8(0x0F)
        if u.size % 2:
            u = np.append(u, np.uint8(0))
        data = u[0::2] | (u[1::2] << np.uint8(4))
    regions = [(layout.scales.offset, np.array([scale], dtype="<f4").tobytes())]
    if layout.zero is not None:
        regions.append((layout.zero.offset, np.array([zero], dtype="<f4").tobytes()))
    regions.append((layout.data.offset, data.tobytes()))
    return _assemble(*regions)


def _search_tensor_scale(flat: npt.NDArray[np.float32], qmax: int, amax: np.float32) -> np.float32:
    """Tensor-wide scale minimising the squared error over a grid of clipping divisors."""
    sample = flat if flat.size <= (1 << 20) else flat[:: flat.size // (1 << 20) + 1]
    best, best_err = np.float32(amax / np.float32(qmax)), np.inf
    span = _SEARCH_SPAN[_bits_of_qmax(qmax)]
    for factor in np.linspace(1.0, span, _SEARCH_STEPS, dtype=np.float32):
        scale = np.float32(amax / (np.float32(qmax) * factor))
        q = np.clip(np.rint(sample / scale), -qmax, qmax)
        err = float(np.square(sample - q * scale).sum())
        if err < best_err:
            best, best_err = scale, err
    return best
