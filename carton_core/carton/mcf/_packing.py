"""Bit packing of 32-value quantization blocks (mcf-model-container-format.md, "Bit Packing").

Codes are two's-complement integers of the method's bit width, written LSB first into a little-endian bit stream per
block: 2-bit four to a byte, 4-bit low nibble first, 3-bit eight codes to three bytes, 6-bit four codes to three
bytes, 8-bit one byte each. Every function works on whole blocks, shaped ``[..., 32]`` codes <-> ``[..., 4 * bits]``
bytes, vectorised over the leading axes.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

__all__ = ["BLOCK", "block_bytes", "pack_blocks", "unpack_blocks"]

BLOCK = 32
_SUPPORTED_BITS = (2, 3, 4, 6, 8)


def block_bytes(bits: int) -> int:
    """Packed size of one 32-value block."""
    return BLOCK * bits // 8


def _check_bits(bits: int) -> None:
    if bits not in _SUPPORTED_BITS:
        raise ValueError(f"unsupported code width {bits} bits (supported: {_SUPPORTED_BITS})")


def pack_blocks(codes: npt.NDArray[np.int8], bits: int) -> npt.NDArray[np.uint8]:
    """Pack signed codes ``[..., 32]`` (each within the bit width) into bytes ``[..., 4 * bits]``."""
    _check_bits(bits)
    if codes.shape[-1] != BLOCK:
        raise ValueError(f"codes must have a last axis of {BLOCK}, got shape {codes.shape}")
    lead = codes.shape[:-1]
    if bits == 8:
        return np.ascontiguousarray(codes, dtype=np.int8).view(np.uint8)
    u = (codes.astype(np.uint8) & np.uint8((1 << bits) - 1)).reshape(*lead, BLOCK)
    if bits == 4:
        return np.ascontiguousarray(u[..., 0::2] | (u[..., 1::2] << np.uint8(4)))
    if bits == 2:
        return np.ascontiguousarray(
            u[..., 0::4] | (u[..., 1::4] << np.uint8(2)) | (u[..., 2::4] << np.uint8(4)) | (u[..., 3::4] << np.uint8(6))
        )
    # 3 and 6 bits: groups of 24 bits (8 or 4 codes) become three bytes.
    per_group = 24 // bits
    groups = u.reshape(*lead, BLOCK // per_group, per_group).astype(np.uint32)
    word = np.zeros(groups.shape[:-1], dtype=np.uint32)
    for i in range(per_group):
        word |= groups[..., i] << np.uint32(bits * i)
    out = np.empty((*groups.shape[:-1], 3), dtype=np.uint8)
    out[..., 0] = word & 0xFF
    out[..., 1] = (word >> 8) & 0xFF
    out[..., 2] = (word >> 16) & 0xFF
    return out.reshape(*lead, block_bytes(bits))


def _sign_extend(value: npt.NDArray[np.int64], bits: int) -> npt.NDArray[np.int64]:
    half = 1 << (bits - 1)
    return (value ^ half) - half


def _decode_table(bits: int, index_bits: int) -> npt.NDArray[np.generic]:
    """Lookup table from ``index_bits`` packed bits to their sign-extended int8 codes, viewed as one integer."""
    per_entry = index_bits // bits
    index = np.arange(1 << index_bits, dtype=np.int64)
    codes = np.stack([_sign_extend((index >> (bits * i)) & ((1 << bits) - 1), bits) for i in range(per_entry)], axis=1)
    entry = {2: np.uint16, 4: np.uint32}[per_entry]
    return np.ascontiguousarray(codes.astype(np.int8)).view(entry).reshape(-1)


# One gather per byte (2- and 4-bit) or per 12 bits (3-bit) yields several codes at once.
_TABLE_4 = _decode_table(4, 8)
_TABLE_2 = _decode_table(2, 8)
_TABLE_3 = _decode_table(3, 12)


def unpack_blocks(packed: npt.NDArray[np.uint8], bits: int) -> npt.NDArray[np.int8]:
    """Unpack bytes ``[..., 4 * bits]`` into sign-extended codes ``[..., 32]`` (int8)."""
    _check_bits(bits)
    nbytes = block_bytes(bits)
    if packed.shape[-1] != nbytes:
        raise ValueError(f"packed blocks of {bits}-bit codes must have a last axis of {nbytes}, got {packed.shape}")
    lead = packed.shape[:-1]
    if bits == 8:
        return np.ascontiguousarray(packed).view(np.int8)
    if bits in (4, 2):
        table = _TABLE_4 if bits == 4 else _TABLE_2
        return np.take(table, packed).view(np.int8).reshape(*lead, BLOCK)
    triples = packed.reshape(*lead, nbytes // 3, 3)
    if bits == 3:
        # Each 24-bit group holds 8 codes: two 12-bit halves, 4 codes per table entry.
        b0, b1, b2 = (triples[..., i].astype(np.intp) for i in range(3))
        index = np.empty((*lead, nbytes // 3, 2), dtype=np.intp)
        index[..., 0] = b0 | ((b1 & 0x0F) << 8)
        index[..., 1] = (b1 >> 4) | (b2 << 4)
        return np.take(_TABLE_3, index).view(np.int8).reshape(*lead, BLOCK)
    # 6 bits: each 24-bit group holds 4 codes.
    word = triples[..., 0].astype(np.uint32)
    word |= triples[..., 1].astype(np.uint32) << np.uint32(8)
    word |= triples[..., 2].astype(np.uint32) << np.uint32(16)
    out = np.empty((*lead, BLOCK // 4, 4), dtype=np.uint8)
    for i in range(4):
        out[..., i] = (word >> np.uint32(6 * i)) & np.uint32(0x3F)
    flat = out.reshape(*lead, BLOCK)
    flat ^= np.uint8(0x20)
    signed = flat.view(np.int8)
    signed -= np.int8(0x20)
    return signed
