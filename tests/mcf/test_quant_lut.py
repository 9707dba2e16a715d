"""The table-driven decoders (carton.mcf._lut) against the straightforward unpack-then-scale decoder, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
from carton import MCFError
from carton.mcf import QuantDomain, _lut, dequantize, quantize
from carton.mcf._decode import dequantize_unpacked
from carton.mcf._layout import payload_layout
from carton.mcf._packing import unpack_blocks

BLOCK_METHODS = ["q8", "k6", "q4", "k4", "k3", "k2"]
INT_METHODS = ["int8", "int4"]


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return (
        a.dtype == b.dtype == np.float32 and a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))
    )


def _random_payload(method: str, rows: int, cols: int, seed: int) -> bytes:
    """Every data byte random (all codes, padding garbage too) with valid finite scales and 6-bit sub-scales."""
    rng = np.random.default_rng(seed)
    layout = payload_layout(method, rows, cols)
    raw = bytearray(rng.integers(0, 256, layout.size, dtype=np.uint8).tobytes())
    scales = rng.uniform(-4, 4, layout.scales.size // 2).astype(np.float16)
    raw[layout.scales.offset : layout.scales.end] = scales.tobytes()
    if layout.sub_scales is not None:
        sub = rng.integers(0, 64, layout.sub_scales.size, dtype=np.uint8)
        raw[layout.sub_scales.offset : layout.sub_scales.end] = sub.tobytes()
    return bytes(raw)


@pytest.mark.parametrize("method", BLOCK_METHODS)
@pytest.mark.parametrize("shape", [(1, 32), (3, 70), (37, 300), (70, 1024), (129, 2080)])
def test_block_methods_match_unpacked_decoder_on_random_payloads(method: str, shape: tuple[int, int]) -> None:
    payload = _random_payload(method, *shape, seed=sum(shape))
    want = dequantize_unpacked(payload, method, shape)
    assert _same_bits(dequantize(payload, method, shape), want)
    assert _same_bits(dequantize(payload, method, shape, threads=2), want)
    out = np.full(shape, np.nan, np.float32)
    dequantize(payload, method, shape, out=out, threads=3)
    assert _same_bits(out, want)


@pytest.mark.parametrize("method", [*BLOCK_METHODS, *INT_METHODS])
def test_quantized_gaussian_matches_unpacked_decoder(method: str) -> None:
    w = np.random.default_rng(3).standard_normal((300, 900)).astype(np.float32)
    q = quantize(w, method)
    want = dequantize_unpacked(q.payload, method, q.shape)
    for threads in (1, 2, None):
        assert _same_bits(dequantize(q.payload, method, q.shape, threads=threads), want)


@pytest.mark.parametrize("method", INT_METHODS)
@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (513, 1001)])  # odd counts exercise the int4 tail nibble
def test_int_methods_match_unpacked_decoder_with_zero_point(method: str, shape: tuple[int, int]) -> None:
    w = np.random.default_rng(4).uniform(-1.0, 3.0, shape).astype(np.float32)
    for domain in (QuantDomain.WEIGHTS, QuantDomain.ACTIVATIONS):
        q = quantize(w, method, domain=domain)
        want = dequantize_unpacked(q.payload, method, shape, domain=domain)
        assert _same_bits(dequantize(q.payload, method, shape, domain=domain, threads=2), want)


@pytest.mark.parametrize("bits", [2, 3, 4, 6])
def test_code_tables_agree_with_unpack_blocks_for_every_index(bits: int) -> None:
    table, index_bits = _lut._TABLES[bits]
    if index_bits == 8:
        packed = np.arange(256, dtype=np.uint8).reshape(-1, 4 * bits)  # every byte value once
    else:  # every 12-bit value appears as both halves of some 3-byte group
        words = np.arange(1 << 12, dtype=np.uint32)
        word24 = words | (words[::-1] << 12)
        triples = np.stack([(word24 >> s) & 0xFF for s in (0, 8, 16)], axis=1).astype(np.uint8).reshape(-1)
        packed = triples.reshape(-1, 4 * bits)
    want = unpack_blocks(packed, bits).astype(np.float32)
    idx = _lut._indices(np.ascontiguousarray(packed).reshape(-1), index_bits)
    assert np.array_equal(table[idx].reshape(want.shape), want)


def test_small_chunks_and_many_threads_are_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_lut, "CHUNK_BYTES", 4 * 32 * 3)  # three blocks per chunk: ragged chunks everywhere
    monkeypatch.setattr(_lut, "MIN_PARALLEL_VALUES", 1)
    for method in ("k3", "k6", "q4", "int4"):
        q = quantize(np.random.default_rng(5).standard_normal((23, 101)).astype(np.float32), method)
        want = dequantize_unpacked(q.payload, method, q.shape)
        assert _same_bits(dequantize(q.payload, method, q.shape, threads=4), want)


def test_parallel_ranges_cover_once_and_propagate_errors() -> None:
    seen: list[tuple[int, int]] = []
    _lut.parallel_ranges(1000, 3, 16, lambda a, b: seen.append((a, b)))
    assert sorted(seen)[0][0] == 0 and sum(b - a for a, b in seen) == 1000
    assert all(a % 16 == 0 for a, _ in seen)

    def fail(a: int, b: int) -> None:
        if a > 0:
            raise MCFError("worker failed")

    with pytest.raises(MCFError, match="worker failed"):
        _lut.parallel_ranges(1000, 2, 16, fail)
