"""IEEE-754 binary16 conversions for MCF scale regions.

Two float32 -> float16 conversions exist because MCF files come from two writers: ours rounds to nearest-even (the
smallest error), the reference Go writer truncates the mantissa (0.04 -> 0x291E where nearest gives 0x291F). Readers
accept any valid fp16, so decoding is a single function.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

__all__ = ["F16_MAX", "f16_bits_to_f32", "f32_to_f16_nearest", "f32_to_f16_truncate"]

F16_MAX = 65504.0


def f32_to_f16_nearest(values: npt.ArrayLike) -> npt.NDArray[np.uint16]:
    """Round float32 values to the nearest fp16 (ties to even) and return the bit patterns."""
    return np.asarray(values, dtype=np.float32).astype(np.float16).view(np.uint16)


def f32_to_f16_truncate(values: npt.ArrayLike) -> npt.NDArray[np.uint16]:
    """Convert float32 values to fp16 bit patterns by dropping mantissa bits, as the reference writer does.

    Overflow and NaN become +-inf; magnitudes below the smallest fp16 subnormal become signed zero; subnormal results
    are truncated too.
    """
    bits = np.asarray(values, dtype=np.float32).view(np.uint32).astype(np.int64)
    sign = (bits >> 31) << 15
    exp = ((bits >> 23) & 0xFF) - 127
    frac = bits & 0x7FFFFF
    normal = sign | ((exp + 15) << 10) | (frac >> 13)
    shift = np.clip(-14 - exp, 0, 31)
    subnormal = sign | (((frac | 0x800000) >> shift) >> 13)
    out = np.where(exp > 15, sign | 0x7C00, np.where(exp <= -15, np.where(exp < -24, sign, subnormal), normal))
    return out.astype(np.uint16)


def f16_bits_to_f32(bits: npt.NDArray[np.uint16]) -> npt.NDArray[np.float32]:
    """Decode fp16 bit patterns to float32 (exact: every fp16 value is a float32 value)."""
    return np.ascontiguousarray(bits).view(np.float16).astype(np.float32)
