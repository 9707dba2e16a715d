"""Quantizers and dequantizers: exact bytes from the layout document's vectors, layouts, accuracy, bad input."""

from __future__ import annotations

import numpy as np
import pytest
from carton import MCFError
from carton.mcf import QuantDomain, QuantMethod, dequantize, payload_layout, payload_size, quantize
from carton.mcf._fp16 import f16_bits_to_f32, f32_to_f16_nearest, f32_to_f16_truncate
from carton.mcf._packing import pack_blocks, unpack_blocks

IDX = np.arange(32)

# (method, bits, code pattern for i = 0..31, packed hex) from mcf-container-layout.md.
PACKED_VECTORS = [
    ("q4", 4, (IDX % 15) - 7, "a9cbed0f21436597badcfe10325476a9"),
    ("k2", 2, (IDX % 3) - 1, "d3344dd3344dd334"),
    ("k3", 3, (IDX % 7) - 3, "f511ad3ea2d547b4fa88561f"),
    ("k6", 6, (IDX % 63) - 31, "a13892a579a2a9bab2adfbc2b13cd3b57de3b9bef3bdff03"),
]


# --- payload sizes and layout ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("method", "rows", "cols", "size"),
    [
        ("q8", 4096, 4096, 17_825_792),
        ("q4", 4096, 4096, 9_437_184),
        ("k6", 4096, 4096, 13_238_272),
        ("k4", 4096, 4096, 9_043_968),
        ("k3", 4096, 4096, 6_946_816),
        ("k2", 4096, 4096, 4_849_664),
        ("q4", 2, 64, 128),
        ("q8", 2, 64, 192),
        ("k6", 2, 64, 224),
        ("k4", 2, 64, 192),
        ("k3", 2, 64, 176),
        ("k2", 2, 64, 160),
        ("q4", 2, 40, 128),
        ("q4", 1, 300, 224),
        ("k6", 1, 300, 368),
        ("k4", 1, 300, 288),
    ],
)
def test_payload_size_matches_layout_document(method: str, rows: int, cols: int, size: int) -> None:
    assert payload_size(method, rows, cols) == size


def test_layout_regions_are_64_aligned_and_ordered() -> None:
    k = payload_layout("k4", 3, 300)
    assert (k.scales.offset, k.scales.size) == (0, 3 * 2 * 2)
    assert k.sub_scales is not None and (k.sub_scales.offset, k.sub_scales.size) == (64, 30)
    assert (k.data.offset, k.data.size) == (128, 30 * 16)
    q = payload_layout("q8", 5, 64)
    assert (q.scales.size, q.data.offset, q.data.size) == (20, 64, 320)
    act = payload_layout("int8", 2, 3, domain=QuantDomain.ACTIVATIONS)
    assert act.zero is not None and (act.scales.offset, act.zero.offset, act.data.offset, act.size) == (0, 64, 128, 134)
    w = payload_layout("int4", 3, 3)
    assert w.zero is None and (w.data.offset, w.data.size) == (64, 5)


@pytest.mark.parametrize("method", ["q8", "q4", "k6", "k4", "k3", "k2"])
def test_block_methods_reject_activations_domain(method: str) -> None:
    with pytest.raises(MCFError, match="only the weights domain"):
        payload_size(method, 1, 32, domain=QuantDomain.ACTIVATIONS)


@pytest.mark.parametrize(("rows", "cols"), [(0, 32), (4, 0), (-1, 32)])
def test_layout_rejects_empty_shapes(rows: int, cols: int) -> None:
    with pytest.raises(MCFError, match="must be positive"):
        payload_size("q4", rows, cols)


def test_unknown_method_and_domain_are_named() -> None:
    with pytest.raises(MCFError, match="unknown quantization method 'q5'"):
        payload_size("q5", 1, 32)
    with pytest.raises(MCFError, match="unknown quantization domain 7"):
        payload_size("int8", 1, 32, domain=7)


# --- bit packing and fp16 -------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("method", "bits", "codes", "packed"), PACKED_VECTORS)
def test_packed_block_vectors(method: str, bits: int, codes: np.ndarray, packed: str) -> None:
    assert QuantMethod(method).bits == bits
    got = pack_blocks(codes.astype(np.int8), bits)
    assert got.tobytes().hex() == packed
    assert np.array_equal(unpack_blocks(np.frombuffer(bytes.fromhex(packed), np.uint8), bits), codes)


@pytest.mark.parametrize("bits", [2, 3, 4, 6, 8])
def test_pack_unpack_round_trip_every_code(bits: int) -> None:
    qmax = (1 << (bits - 1)) - 1
    rng = np.random.default_rng(bits)
    codes = rng.integers(-qmax - 1, qmax + 1, size=(7, 5, 32)).astype(np.int8)
    packed = pack_blocks(codes, bits)
    assert packed.shape == (7, 5, 4 * bits)
    assert np.array_equal(unpack_blocks(packed, bits), codes)


def test_fp16_truncation_vs_nearest() -> None:
    assert int(f32_to_f16_truncate(np.float32(0.04))) == 0x291E
    assert int(f32_to_f16_nearest(np.float32(0.04))) == 0x291F
    values = np.array([0.0, -0.0, 1.0, -2.5, 65504.0, 1e6, -1e6, 6e-8, 1e-9, 3e-5, np.inf, np.nan], np.float32)
    assert [hex(v) for v in f32_to_f16_truncate(values)] == [
        "0x0", "0x8000", "0x3c00", "0xc100", "0x7bff", "0x7c00", "0xfc00", "0x1", "0x0", "0x1f7", "0x7c00", "0x7c00"
    ]  # fmt: skip
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(10_000) * np.exp(rng.uniform(-12, 9, 10_000))).astype(np.float32)
    truncated = f16_bits_to_f32(f32_to_f16_truncate(x))
    assert (np.abs(truncated) <= np.abs(x)).all()  # truncation never rounds away from zero
    nearest = f16_bits_to_f32(f32_to_f16_nearest(x))
    assert (np.abs(x - nearest) <= np.abs(x - truncated)).all()


# --- exact payload bytes --------------------------------------------------------------------------------------------
def _q4_vector_row(scale: float) -> np.ndarray:
    return (((IDX % 15) - 7) * np.float32(scale)).astype(np.float32)[None, :]


def test_reference_q4_payload_bytes() -> None:
    q = quantize(_q4_vector_row(0.04), "q4", mode="reference")
    expected = bytes.fromhex("1e29") + bytes(62) + bytes.fromhex(PACKED_VECTORS[0][3])
    assert q.payload == expected
    assert (q.min_clip, q.max_clip) == (pytest.approx(-0.28), pytest.approx(0.28))


def test_best_q4_payload_rounds_scale_to_nearest() -> None:
    q = quantize(_q4_vector_row(0.04), "q4")
    assert q.payload == bytes.fromhex("1f29") + bytes(62) + bytes.fromhex(PACKED_VECTORS[0][3])


def test_reference_q8_payload_bytes() -> None:
    codes = np.arange(-127, 129, 8)[:32].astype(np.int8)  # -127 ... 121, max |code| 127
    q = quantize((codes * np.float32(0.04))[None, :], "q8", mode="reference")
    assert q.payload == bytes.fromhex("1e29") + bytes(62) + codes.tobytes()


@pytest.mark.parametrize(("method", "bits", "codes", "packed"), PACKED_VECTORS[1:] + PACKED_VECTORS[:1])
def test_reference_k_payload_bytes(method: str, bits: int, codes: np.ndarray, packed: str) -> None:
    qmax = (1 << (bits - 1)) - 1
    row = np.tile(np.clip(codes, -qmax, qmax), 8) * np.float32(0.04)
    q = quantize(row[None, :].astype(np.float32), "k4" if method == "q4" else method, mode="reference")
    expected = bytes.fromhex("1e29") + bytes(62) + bytes([32] * 8) + bytes(56) + bytes.fromhex(packed) * 8
    assert q.payload == expected


def test_reference_k_sub_scales_span_1_to_32() -> None:
    scales = np.array([1.0, 0.5, 0.25, 0.01, 0.0, 0.75, 0.999, 0.001], np.float32)
    row = (np.repeat(scales, 32) * np.tile((IDX % 15) - 7, 8)).astype(np.float32)[None, :]
    q = quantize(row, "k4", mode="reference")
    layout = q.layout
    assert layout.sub_scales is not None
    sub = list(q.payload[layout.sub_scales.offset : layout.sub_scales.end])
    assert sub == [32, 16, 8, 1, 0, 24, 32, 1]
    best = quantize(row, "k4")
    best_sub = np.frombuffer(best.payload, np.uint8, 8, layout.sub_scales.offset)
    assert best_sub.max() == 63 and best_sub[4] == 0


def test_padding_bytes_and_padded_codes_are_zero() -> None:
    rng = np.random.default_rng(3)
    w = rng.standard_normal((3, 300)).astype(np.float32)
    for method in ("q4", "k4", "k3", "k6", "q8", "k2"):
        q = quantize(w, method)
        layout = q.layout
        raw = np.frombuffer(q.payload, np.uint8)
        assert not raw[layout.scales.end : (layout.sub_scales or layout.data).offset].any()
        if layout.sub_scales is not None:
            assert not raw[layout.sub_scales.end : layout.data.offset].any()
        data = raw[layout.data.offset :].reshape(3, layout.blocks_per_row, -1)
        codes = unpack_blocks(data, layout.bits).reshape(3, -1)
        assert not codes[:, 300:].any(), method


# --- accuracy -------------------------------------------------------------------------------------------------------
# Issue 5's bounds for N(0,1) weights; 256 x 4096 holds them with a wide statistical margin (1M values).
RMSE_BOUNDS = {"q8": 0.0053, "k6": 0.022, "q4": 0.092, "k4": 0.092, "k3": 0.20, "k2": 0.45}


@pytest.fixture(scope="module")
def gaussian() -> np.ndarray:
    return np.random.default_rng(2024).standard_normal((256, 4096)).astype(np.float32)


def _relative_rmse(w: np.ndarray, d: np.ndarray) -> float:
    return float(np.sqrt(np.mean((w.astype(np.float64) - d) ** 2) / np.mean(w.astype(np.float64) ** 2)))


@pytest.mark.parametrize("method", list(RMSE_BOUNDS))
def test_best_mode_meets_rmse_bounds(gaussian: np.ndarray, method: str) -> None:
    q = quantize(gaussian, method)
    assert len(q.payload) == payload_size(method, *gaussian.shape)
    assert _relative_rmse(gaussian, q.dequantize()) <= RMSE_BOUNDS[method]


@pytest.mark.parametrize("method", list(RMSE_BOUNDS))
def test_best_mode_beats_reference_mode(gaussian: np.ndarray, method: str) -> None:
    w = gaussian[:32]
    best = _relative_rmse(w, quantize(w, method).dequantize())
    reference = _relative_rmse(w, quantize(w, method, mode="reference").dequantize())
    assert best < reference


def _q4_1_round_trip(x: np.ndarray) -> np.ndarray:
    """GGUF Q4_1 per 32 values (fp16 step and minimum, codes 0..15), dequantized: what a 4-bit checkpoint holds."""
    blocks = x.reshape(-1, 32)
    low = blocks.min(axis=1)
    step = ((blocks.max(axis=1) - low) / 15).astype(np.float16).astype(np.float32)
    low = low.astype(np.float16).astype(np.float32)
    codes = np.clip(np.rint((blocks - low[:, None]) / step[:, None]), 0, 15)
    values: np.ndarray = (codes * step[:, None] + low[:, None]).astype(np.float32)
    return values.reshape(x.shape)


def test_best_q8_fits_weights_from_a_4bit_checkpoint() -> None:
    # Each block holds 16 evenly spaced values: some scale coarser than max|x| / 127 puts most of them on its grid.
    # Measured: 0.0020 relative RMSE against 0.0054 for the absmax scale (0.0050 for a search that only clips).
    w = _q4_1_round_trip(np.random.default_rng(11).standard_normal((64, 1024)).astype(np.float32) * 0.05)
    best = _relative_rmse(w, quantize(w, "q8").dequantize())
    reference = _relative_rmse(w, quantize(w, "q8", mode="reference").dequantize())
    assert best <= 0.5 * reference


def test_best_q8_keeps_an_exact_block_against_near_ties() -> None:
    # Code 127 once, 14 elsewhere: a coarser candidate fits within float32 rounding of its residual-by-cancellation;
    # the exact scale 2**-7 must still win (a hypothesis example found this).
    w = (np.array([127] + [14] * 31, np.float32) * np.float32(2.0**-7))[None, :]
    q = quantize(w, "q8")
    assert q.payload[:2] == bytes.fromhex("0020")
    assert np.array_equal(q.dequantize(), w)


@pytest.mark.parametrize(("method", "bound"), [("int8", 0.012), ("int4", 0.15)])
def test_int_weights_accuracy(gaussian: np.ndarray, method: str, bound: float) -> None:
    q = quantize(gaussian[:64], method)
    assert q.layout.zero is None
    assert _relative_rmse(gaussian[:64], q.dequantize()) <= bound


@pytest.mark.parametrize(("method", "bound"), [("int8", 0.006), ("int4", 0.1)])
def test_int_activations_asymmetric(method: str, bound: float) -> None:
    x = np.random.default_rng(5).uniform(0.5, 3.0, (8, 100)).astype(np.float32)  # all positive: needs a zero point
    q = quantize(x, method, domain=QuantDomain.ACTIVATIONS)
    assert (q.min_clip, q.max_clip) == (0.0, pytest.approx(float(x.max())))
    layout = q.layout
    assert layout.zero is not None
    scale, zero = np.frombuffer(q.payload, "<f4", 1, 0)[0], np.frombuffer(q.payload, "<f4", 1, 64)[0]
    qmin = -(1 << (layout.bits - 1))
    assert zero == qmin and scale == pytest.approx(x.max() / (2**layout.bits - 1))
    assert _relative_rmse(x, q.dequantize()) <= bound


def test_int8_activation_exact_bytes() -> None:
    x = np.array([[0.0, 1.0, 2.55, -1.0]], np.float32)
    q = quantize(x, "int8", domain=QuantDomain.ACTIVATIONS, min_clip=-1.0, max_clip=2.55)
    scale = np.float32(3.55) / np.float32(255)
    zero = np.float32(np.rint(np.float32(-128) + np.float32(1.0) / scale))
    codes = np.clip(np.rint(x[0] / scale + zero), -128, 127).astype(np.int8)
    expected = np.float32(scale).tobytes() + bytes(60) + zero.tobytes() + bytes(60) + codes.tobytes()
    assert q.payload == expected
    assert np.allclose(q.dequantize(), x, atol=scale / 2 + 1e-6)


def test_int4_packs_low_nibble_first_and_pads_odd_counts() -> None:
    x = np.array([[1.0, -1.0, 0.6]], np.float32)
    q = quantize(x, "int4", mode="reference")
    assert np.frombuffer(q.payload, "<f4", 1, 0)[0] == np.float32(1.0) / np.float32(7)
    assert q.payload[64:] == bytes([0x97, 0x04])  # codes 7, -7, 4, then a zero padding nibble


def test_zero_tensor_quantizes_to_zero_everywhere() -> None:
    for method in ("q8", "q4", "k6", "k4", "k3", "k2", "int8", "int4"):
        q = quantize(np.zeros((2, 70), np.float32), method)
        assert not np.frombuffer(q.payload, np.uint8).any(), method
        assert not q.dequantize().any()


def test_clip_bounds_are_applied_and_recorded() -> None:
    w = np.array([[-4.0, 0.1, 0.2, 10.0] + [0.0] * 28], np.float32)
    q = quantize(w, "q8", min_clip=-1.0, max_clip=1.0, mode="reference")
    assert (q.min_clip, q.max_clip) == (-1.0, 1.0)
    assert q.dequantize()[0, :4] == pytest.approx([-1.0, 0.1, 0.2, 1.0], abs=0.005)


# --- bad input ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("array", "kwargs", "message"),
    [
        (np.array([[1.0, np.nan]], np.float32), {}, "NaN or Inf"),
        (np.array([[1.0, np.inf]], np.float32), {}, "NaN or Inf"),
        (np.ones(32, np.float32), {}, "rank-2"),
        (np.ones((2, 2, 32), np.float32), {}, "rank-2"),
        (np.ones((0, 32), np.float32), {}, "must be positive"),
        (np.ones((1, 32), np.float32), {"mode": "fast"}, "unknown quantization mode"),
        (np.ones((1, 32), np.float32), {"min_clip": -1.0}, "given together"),
        (np.ones((1, 32), np.float32), {"min_clip": 1.0, "max_clip": -1.0}, "min_clip <= max_clip"),
        (np.ones((1, 32), np.float32), {"domain": QuantDomain.ACTIVATIONS}, "only the weights domain"),
        (np.full((1, 32), 1e9, np.float32), {}, "overflows fp16"),
        ([["a", "b"]], {}, "cannot quantize"),
    ],
)
def test_quantize_rejects_bad_input(array: object, kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(MCFError, match=message):
        quantize(array, "q4", **kwargs)  # type: ignore[arg-type]


def test_dequantize_rejects_wrong_sizes_and_types() -> None:
    q = quantize(np.ones((2, 64), np.float32), "k4")
    with pytest.raises(MCFError, match=r"must be 192 bytes, got 191"):
        dequantize(q.payload[:-1], "k4", (2, 64))
    with pytest.raises(MCFError, match="must be uint8"):
        dequantize(np.frombuffer(q.payload, np.int8), "k4", (2, 64))
    with pytest.raises(MCFError, match="must be bytes, memoryview or a uint8 array"):
        dequantize("abc", "k4", (2, 64))  # type: ignore[arg-type]
    with pytest.raises(MCFError, match="rank 2"):
        dequantize(q.payload, "k4", (128,))  # type: ignore[arg-type]


def test_dequantize_rejects_sub_scale_with_top_bits_set() -> None:
    q = quantize(np.ones((2, 64), np.float32), "k4")
    bad = bytearray(q.payload)
    bad[64 + 3] |= 0x40
    with pytest.raises(MCFError, match=r"sub-scale #3 is 0x7F; its top two bits must be zero \(offset 67\)"):
        dequantize(bytes(bad), "k4", (2, 64))


@pytest.mark.parametrize(("method", "offset"), [("q4", 2), ("k6", 0)])
def test_dequantize_rejects_non_finite_scales(method: str, offset: int) -> None:
    bad = bytearray(quantize(np.ones((1, 64), np.float32), method).payload)
    bad[offset : offset + 2] = (0x7C00).to_bytes(2, "little")
    with pytest.raises(MCFError, match=r"scale #\d+ is not finite"):
        dequantize(bytes(bad), method, (1, 64))


def test_dequantize_accepts_any_valid_fp16_and_sub_scale() -> None:
    payload = bytearray(payload_size("k4", 1, 32))
    payload[0:2] = (0x0001).to_bytes(2, "little")  # smallest subnormal fp16 super-scale
    payload[64] = 63
    payload[128:144] = bytes.fromhex(PACKED_VECTORS[0][3])
    d = dequantize(bytes(payload), "k4", (1, 32))
    assert np.array_equal(d[0], ((IDX % 15) - 7) * np.float32(2.0**-24) * np.float32(63 / 32))


@pytest.mark.parametrize("method", ["q4", "k3", "int4"])
def test_dequantize_into_out_buffer(method: str) -> None:
    q = quantize(np.random.default_rng(9).standard_normal((3, 70)).astype(np.float32), method)
    out = np.full((3, 70), np.nan, np.float32)
    assert dequantize(q.payload, method, (3, 70), out=out) is out
    assert np.array_equal(out, q.dequantize())
    for bad in (np.empty((3, 70), np.float64), np.empty((70, 3), np.float32), np.empty((3, 140), np.float32)[:, ::2]):
        with pytest.raises(MCFError, match=r"out must be a C-contiguous float32 array of shape \(3, 70\)"):
            dequantize(q.payload, method, (3, 70), out=bad)
