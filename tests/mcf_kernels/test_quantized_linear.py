"""QuantizedLinear: every method x cache x batch path, on the numpy and the compiled kernels, against
x @ dequantize(W).T; zero-copy, parts of a matrix, bad input."""

from __future__ import annotations

import mmap
import os
import threading
from pathlib import Path

import numpy as np
import pytest
from carton import MCFError
from carton.mcf import QuantDomain, dequantize, payload_layout, payload_size, quantize
from carton.mcf._packing import pack_blocks, unpack_blocks
from carton_runner_mcf._kernels import QuantizedLinear, matmul
from carton_runner_mcf._rows import row_copies
from kernel_bounds import compiled_bound

METHODS = ["q8", "q4", "k6", "k4", "k3", "k2", "int8", "int4"]
CACHES = ["packed", "int8", "fp32"]


def _reference(x: np.ndarray, dense: np.ndarray) -> np.ndarray:
    return (x.astype(np.float64) @ dense.astype(np.float64).T).astype(np.float32)


def _assert_close(got: np.ndarray, want: np.ndarray) -> None:
    assert got.dtype == np.float32 and got.shape == want.shape
    scale = max(1.0, float(np.abs(want).max()))
    assert float(np.abs(got - want).max()) <= 2e-5 * scale


def _check(linear: QuantizedLinear, x: np.ndarray, dense: np.ndarray) -> None:
    """``linear(x)`` against the float64 product with the dequantized matrix, within what the path may differ by.

    numpy paths multiply in float32. The compiled kernels round each block of 32 activations to int16, off by at
    most ``max|x_block| / 65534`` per value, so a row may differ by that times the block's ``sum |w|``, summed over
    the blocks (plus float32 rounding of the result)."""
    got = linear(x)
    want = _reference(x, dense)
    if not linear.compiled:
        _assert_close(got, want)
        return
    assert got.dtype == np.float32 and got.shape == want.shape
    assert float((np.abs(got.astype(np.float64) - want) / compiled_bound(x, dense)).max()) <= 1.0


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("cols", [300, 31, 512])
def test_matches_dequantized_matmul(method: str, cache: str, cols: int, kernels: str) -> None:
    rng = np.random.default_rng(11)
    rows = 37  # odd rows; 300 and 31 columns end in a padded block (31: a single one), 512 in two super-blocks
    w = rng.standard_normal((rows, cols)).astype(np.float32)
    q = quantize(w, method)
    dense = q.dequantize()
    # A small tile budget forces several tiles and a ragged last tile on every path.
    linear = QuantizedLinear.from_quantized(q, cache=cache, tile_bytes=4 * 32 * 40, kernels=kernels)
    assert linear.compiled == (kernels == "numba" and cache == "packed")
    for batch in (1, 3, 4, 5, 9, 17):
        _check(linear, rng.standard_normal((batch, cols)).astype(np.float32), dense)


@pytest.mark.parametrize("method", ["q4", "k4"])
def test_four_bit_rows_end_in_every_partial_group(method: str, kernels: str) -> None:
    """The 4-bit kernels read a row's scales eight blocks at a time: rows of 1 to 24 blocks end after every count
    of whole groups and every length of a partial one (a lone last block included), the last block padded."""
    rng = np.random.default_rng(12)
    for blocks in range(1, 25):
        cols = 32 * blocks - 5
        q = quantize(rng.standard_normal((9, cols)).astype(np.float32), method)
        linear = QuantizedLinear.from_quantized(q, cache="packed", kernels=kernels)
        for batch in (1, 2, 3, 5):
            _check(linear, rng.standard_normal((batch, cols)).astype(np.float32), q.dequantize())


@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("cache", CACHES)
def test_int_activations_domain_zero_point(method: str, cache: str, kernels: str) -> None:
    rng = np.random.default_rng(12)
    w = rng.uniform(0.0, 2.0, (9, 51)).astype(np.float32)  # odd columns: int4 rows start mid-byte
    q = quantize(w, method, domain=QuantDomain.ACTIVATIONS)
    linear = QuantizedLinear.from_quantized(q, cache=cache, kernels=kernels)
    for batch in (1, 6):
        _check(linear, rng.standard_normal((batch, 51)).astype(np.float32), q.dequantize())


def test_default_settings_and_leading_dimensions(kernels: str) -> None:
    rng = np.random.default_rng(13)
    q = quantize(rng.standard_normal((64, 256)).astype(np.float32), "k4")
    linear = QuantizedLinear(q.payload, "k4", 64, 256, kernels=kernels)
    assert linear.shape == (64, 256)
    x = rng.standard_normal((2, 3, 256))
    y = linear(x)  # float64 input is accepted, float32 returned
    assert y.shape == (2, 3, 64) and y.dtype == np.float32
    _check(linear, x.reshape(6, 256).astype(np.float32), q.dequantize())
    np.testing.assert_allclose(y.reshape(6, 64), linear(x.reshape(6, 256).astype(np.float32)), rtol=1e-6)
    assert linear(np.zeros((0, 256), np.float32)).shape == (0, 64)
    assert linear(rng.standard_normal(256).astype(np.float32)).shape == (64,)


@pytest.mark.parametrize("threads", [1, 2])
def test_matrix_vector_path_over_more_rows_than_one_piece(threads: int, kernels: str) -> None:
    """More output rows than the numpy matrix-vector path takes at a time (4096), split unevenly, alone and on two
    threads (a tied output head is 49152 rows)."""
    rng = np.random.default_rng(16)
    rows, cols = 2 * 4096 + 48, 96
    q = quantize(rng.standard_normal((rows, cols)).astype(np.float32), "q4")
    linear = QuantizedLinear.from_quantized(q, threads=threads, kernels=kernels)
    for batch in (1, 4):
        _check(linear, rng.standard_normal((batch, cols)).astype(np.float32), q.dequantize())


def test_gemv_and_gemm_paths_agree_across_the_threshold(kernels: str) -> None:
    rng = np.random.default_rng(14)
    q = quantize(rng.standard_normal((96, 512)).astype(np.float32), "q4")
    small = QuantizedLinear.from_quantized(q, gemv_max_batch=64, kernels=kernels)
    large = QuantizedLinear.from_quantized(q, gemv_max_batch=0, kernels=kernels)
    x = rng.standard_normal((8, 512)).astype(np.float32)
    _check(small, x, q.dequantize())
    _check(large, x, q.dequantize())


def _payload_with_garbage_in_row_padding(method: str, rows: int, cols: int) -> tuple[bytes, np.ndarray]:
    """A payload whose codes beyond ``cols`` are non-zero; readers must treat those values as zero."""
    rng = np.random.default_rng(15)
    q = quantize(rng.standard_normal((rows, cols)).astype(np.float32), method)
    layout = q.layout
    raw = bytearray(q.payload)
    nb, bits = layout.blocks_per_row, layout.bits
    data = np.frombuffer(raw, np.uint8, layout.data.size, layout.data.offset).reshape(rows, nb, 4 * bits)
    last = unpack_blocks(np.ascontiguousarray(data[:, -1]), bits)
    last[:, cols % 32 :] = 1
    garbage = np.concatenate([data[:, :-1].reshape(rows, -1), pack_blocks(last, bits)], axis=1)
    raw[layout.data.offset : layout.data.end] = garbage.tobytes()
    return bytes(raw), q.dequantize()


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("method", ["q8", "q4", "k6", "k4", "k3", "k2"])
def test_codes_in_row_padding_are_ignored(cache: str, method: str, kernels: str) -> None:
    payload, dense = _payload_with_garbage_in_row_padding(method, 5, 40)
    assert np.array_equal(dequantize(payload, method, (5, 40)), dense)
    linear = QuantizedLinear(payload, method, 5, 40, cache=cache, kernels=kernels)
    x = np.random.default_rng(16).standard_normal((9, 40)).astype(np.float32)
    _check(linear, x, dense)
    _check(linear, x[:1], dense)
    assert np.array_equal(linear.take_rows(np.arange(5)), dense)


def test_packed_cache_is_zero_copy_over_an_mmap(tmp_path: Path, kernels: str) -> None:
    rng = np.random.default_rng(17)
    q = quantize(rng.standard_normal((48, 256)).astype(np.float32), "k4")
    path = tmp_path / "w.bin"
    path.write_bytes(b"\0" * 64 + q.payload)  # the payload ends the file: nothing is read past its end
    with path.open("rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        view = memoryview(mm)[64:]
        linear = QuantizedLinear(view, "k4", 48, 256, cache="packed", kernels=kernels)
        base = np.frombuffer(mm, np.uint8)
        kept = linear._compiled._flat if linear._compiled is not None else linear._flat
        assert kept is not None and np.shares_memory(kept, base)
        _check(linear, rng.standard_normal((2, 256)).astype(np.float32), q.dequantize())
        # numpy: payload + fp32 block scales; compiled: the payload alone (scales are read as stored)
        assert linear.nbytes == len(q.payload) + (0 if linear.compiled else 48 * 8 * 4)
        del linear, base, view, kept


@pytest.mark.parametrize("method", ["q4", "k4"])
def test_int8_cache_memory_within_two_and_a_half_times_the_payload(method: str) -> None:
    q = quantize(np.random.default_rng(18).standard_normal((256, 1024)).astype(np.float32), method)
    linear = QuantizedLinear.from_quantized(q, cache="int8")
    assert linear.nbytes <= 2.5 * payload_size(method, 256, 1024)
    assert QuantizedLinear.from_quantized(q, cache="fp32").nbytes == 256 * 1024 * 4


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("cache", CACHES)
def test_take_rows_decodes_only_the_requested_rows(method: str, cache: str, kernels: str) -> None:
    q = quantize(np.random.default_rng(19).standard_normal((20, 70)).astype(np.float32), method)
    linear = QuantizedLinear.from_quantized(q, cache=cache, kernels=kernels)
    dense = q.dequantize()
    idx = np.array([[0, 19], [-1, 7]])
    assert np.array_equal(linear.take_rows(idx), dense[idx])
    with pytest.raises(MCFError, match="out of range for 20 rows"):
        linear.take_rows([20])
    with pytest.raises(MCFError, match="must be integers"):
        linear.take_rows([1.5])


@pytest.mark.parametrize("threads", [1, 2])
def test_concurrent_calls_use_separate_buffers(kernels: str, threads: int) -> None:
    rng = np.random.default_rng(20)
    q = quantize(rng.standard_normal((128, 512)).astype(np.float32), "q4")
    linear = QuantizedLinear.from_quantized(q, tile_bytes=64 * 1024, kernels=kernels, threads=threads)
    inputs = [rng.standard_normal((batch, 512)).astype(np.float32) for batch in (1, 9, 2, 33)]
    want = [linear(x) for x in inputs]
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            for _ in range(20):
                assert np.array_equal(linear(inputs[i]), want[i])
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(inputs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


def test_matmul_convenience() -> None:
    rng = np.random.default_rng(21)
    q = quantize(rng.standard_normal((16, 64)).astype(np.float32), "k6")
    x = rng.standard_normal((4, 64)).astype(np.float32)
    assert np.array_equal(matmul(x, q), QuantizedLinear.from_quantized(q, cache="packed")(x))
    linear = QuantizedLinear.from_quantized(q, cache="fp32")
    assert np.array_equal(matmul(x, linear), linear(x))


def test_bad_construction_and_inputs_are_typed_errors() -> None:
    q = quantize(np.ones((4, 64), np.float32), "q4")
    with pytest.raises(MCFError, match="unknown kernels 'gpu'"):
        QuantizedLinear(q.payload, "q4", 4, 64, kernels="gpu")  # type: ignore[arg-type]
    with pytest.raises(MCFError, match="unknown weight cache 'fp16'"):
        QuantizedLinear(q.payload, "q4", 4, 64, cache="fp16")  # type: ignore[arg-type]
    with pytest.raises(MCFError, match=r"payload for shape \(4, 64\) must be 192 bytes, got 191"):
        QuantizedLinear(q.payload[:-1], "q4", 4, 64)
    with pytest.raises(MCFError, match="tile_bytes must be at least"):
        QuantizedLinear(q.payload, "q4", 4, 64, tile_bytes=8)
    with pytest.raises(MCFError, match="only the weights domain"):
        QuantizedLinear(q.payload, "q4", 4, 64, domain=QuantDomain.ACTIVATIONS)
    linear = QuantizedLinear(q.payload, "q4", 4, 64)
    with pytest.raises(MCFError, match=r"shape \[\.\.\., 64\], got \(2, 63\)"):
        linear(np.ones((2, 63), np.float32))
    with pytest.raises(MCFError, match="must be a float array, got dtype int64"):
        linear(np.ones((2, 64), np.int64))
    bad = bytearray(q.payload)
    bad[0:2] = (0x7E00).to_bytes(2, "little")  # NaN block scale
    with pytest.raises(MCFError, match="block scale #0 is not finite"):
        QuantizedLinear(bytes(bad), "q4", 4, 64)


# --- parts of a matrix (what a process of a split model holds) ----------------------------------------------------
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize(
    ("cache", "kernels"),
    # the packed cache holds a part only on the compiled kernels: the numpy packed path keeps whole matrices and
    # refuses a part (test_bad_parts_are_refused), so that pair is not a case here
    [("int8", "numpy"), ("int8", "numba"), ("fp32", "numpy"), ("fp32", "numba"), ("packed", "numba")],
    indirect=["kernels"],
)
def test_a_part_equals_the_same_part_of_the_dequantized_matrix(method: str, cache: str, kernels: str) -> None:
    rng = np.random.default_rng(5)
    rows, cols = 70, 600  # the last block of a row is partial
    q = quantize(rng.standard_normal((rows, cols)).astype(np.float32), method)
    dense = q.dequantize()
    for row_range, col_range in (((3, 57), (32, cols)), ((0, rows), (0, 64)), ((50, 51), (64, 128)), (None, None)):
        linear = QuantizedLinear.from_quantized(
            q, cache=cache, row_range=row_range, col_range=col_range, kernels=kernels
        )
        (r0, r1), (c0, c1) = row_range or (0, rows), col_range or (0, cols)
        assert linear.shape == (r1 - r0, c1 - c0)
        part = dense[r0:r1, c0:c1]
        np.testing.assert_array_equal(linear.take_rows(np.arange(r1 - r0)), part)
        for batch in (1, 6):
            _check(linear, rng.standard_normal((batch, c1 - c0)).astype(np.float32), part)


def test_an_int8_part_holds_only_its_share() -> None:
    q = quantize(np.random.default_rng(0).standard_normal((256, 512)).astype(np.float32), "q4")
    whole = QuantizedLinear.from_quantized(q, cache="int8").nbytes
    quarter = QuantizedLinear.from_quantized(q, cache="int8", row_range=(0, 128), col_range=(0, 256)).nbytes
    assert quarter == whole // 4


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"row_range": (5, 5)}, r"row_range \(5, 5\) is not a non-empty range within 0..70"),
        ({"row_range": (0, 71)}, r"row_range \(0, 71\) is not a non-empty range within 0..70"),
        ({"col_range": (1,)}, r"col_range must be two integers \(start, stop\), got \(1,\)"),
        ({"col_range": (16, 64)}, r"col_range \(16, 64\) of a q4 matrix must start on a 32-value block"),
        ({"col_range": (0, 40)}, r"must start on a 32-value block and end on one or at column 600"),
        ({"row_range": (0, 8), "cache": "packed", "kernels": "numpy"}, r"needs the int8 or fp32 cache, or the"),
    ],
)
def test_bad_parts_are_refused(options: dict[str, object], message: str) -> None:
    q = quantize(np.ones((70, 600), np.float32), "q4")
    with pytest.raises(MCFError, match=message):
        QuantizedLinear.from_quantized(q, **options)


@pytest.mark.parametrize("method", METHODS)
def test_row_copies_cut_a_payload_that_decodes_to_those_rows(method: str) -> None:
    rows, cols = 70, 600
    q = quantize(np.random.default_rng(2).standard_normal((rows, cols)).astype(np.float32), method)
    flat = np.frombuffer(q.payload, dtype=np.uint8)
    cut = row_copies(payload_layout(method, rows, cols), 9, 41)
    assert cut is not None
    layout, copies = cut
    part = np.zeros(layout.size, dtype=np.uint8)
    for source, size, destination in copies:
        part[destination : destination + size] = flat[source : source + size]
    np.testing.assert_array_equal(dequantize(part, method, (32, cols)), q.dequantize()[9:41])


def test_row_copies_exact_offsets_and_the_int4_odd_column_case() -> None:
    # q4 [4, 64]: 2 blocks a row; fp16 scales (4 bytes a row) at 0, codes (2 x 16 bytes a row) at 64.
    layout, copies = row_copies(payload_layout("q4", 4, 64), 1, 3) or (None, None)
    assert layout is not None and (layout.scales.offset, layout.data.offset, layout.size) == (0, 64, 128)
    assert copies == [(4, 8, 0), (64 + 32, 64, 64)]
    # int4 with 3 columns: row 1 starts in the middle of a byte.
    assert row_copies(payload_layout("int4", 4, 3), 1, 3) is None
    with pytest.raises(ValueError, match=r"rows \(3, 3\) are not a non-empty range within 0..4"):
        row_copies(payload_layout("q4", 4, 64), 3, 3)


# --- choosing the path --------------------------------------------------------------------------------------------
def test_the_environment_forces_the_numpy_path(monkeypatch: pytest.MonkeyPatch) -> None:
    q = quantize(np.random.default_rng(22).standard_normal((8, 64)).astype(np.float32), "q4")
    monkeypatch.setenv("CARTON_MCF_KERNELS", "numpy")
    linear = QuantizedLinear.from_quantized(q)
    assert not linear.compiled and linear.cache == "int8"  # the numpy default cache
    monkeypatch.setenv("CARTON_MCF_KERNELS", "fast")
    with pytest.raises(MCFError, match="CARTON_MCF_KERNELS='fast' is not one of: auto, numba, numpy"):
        QuantizedLinear.from_quantized(q)


def test_requiring_numba_without_it_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from carton_runner_mcf import _packed

    q = quantize(np.ones((8, 64), np.float32), "q4")
    monkeypatch.setitem(_packed._loaded, "module", None)  # as after a failed `import numba`
    with pytest.raises(MCFError, match=r"need numba: pip install 'carton-runtime\[mcf\]'"):
        QuantizedLinear.from_quantized(q, kernels="numba")
    assert not QuantizedLinear.from_quantized(q).compiled  # "auto" falls back


def test_compiled_default_is_the_packed_cache(kernels: str) -> None:
    q = quantize(np.ones((8, 64), np.float32), "k4")
    linear = QuantizedLinear.from_quantized(q, kernels=kernels)
    assert linear.cache == ("packed" if kernels == "numba" else "int8")
    assert linear.compiled == (kernels == "numba")
    assert ("compiled" in repr(linear)) == (kernels == "numba")


def test_the_plugin_passes_kernel_settings_to_the_runner_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """A runner process starts with a clean environment; the kernel choice and numba's settings reach it through
    the runner spec (so CARTON_MCF_KERNELS=numpy forces the fallback out of process too)."""
    from carton_runner_mcf import plugin

    monkeypatch.setenv("CARTON_MCF_KERNELS", "numpy")
    monkeypatch.setenv("NUMBA_NUM_THREADS", "2")
    for name in ("NUMBA_CACHE_DIR", "OPENBLAS_NUM_THREADS", "OPENBLAS_THREAD_TIMEOUT"):
        monkeypatch.delenv(name, raising=False)
    (spec,) = plugin.carton_runners()
    layer = {name: os.environ[name] for name in ("NUMBA_THREADING_LAYER",) if name in os.environ}
    assert (
        dict(spec.env)
        == {
            "CARTON_MCF_KERNELS": "numpy",
            "NUMBA_NUM_THREADS": "2",
            "OPENBLAS_THREAD_TIMEOUT": plugin.BLAS_THREAD_TIMEOUT,
        }
        | layer
    )
    # The host's own BLAS settings win.
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "1")
    monkeypatch.setenv("OPENBLAS_THREAD_TIMEOUT", "28")
    (spec,) = plugin.carton_runners()
    assert dict(spec.env)["OPENBLAS_NUM_THREADS"] == "1"
    assert dict(spec.env)["OPENBLAS_THREAD_TIMEOUT"] == "28"


def test_a_large_packed_payload_is_copied_onto_huge_pages_unless_given(kernels: str) -> None:
    from carton_runner_mcf._arena import HUGE_PAGE, in_arena

    rng = np.random.default_rng(19)
    q = quantize(rng.standard_normal((1024, 4096)).astype(np.float32), "q4")  # 2.25 MiB of payload
    assert len(q.payload) >= HUGE_PAGE
    base = np.frombuffer(q.payload, np.uint8)
    x = rng.standard_normal((3, 4096)).astype(np.float32)
    copied = QuantizedLinear(q.payload, "q4", 1024, 4096, cache="packed", kernels=kernels)
    given = QuantizedLinear(q.payload, "q4", 1024, 4096, cache="packed", kernels=kernels, pages="given")
    if kernels == "numba":
        kept = copied.compiled_payload.payload  # type: ignore[union-attr]
        assert in_arena(kept) and not np.shares_memory(kept, base) and np.array_equal(kept, base)
        assert kept.ctypes.data % 64 == 0
        assert not in_arena(given.compiled_payload.payload)  # type: ignore[union-attr]
        assert np.shares_memory(given.compiled_payload.payload, base)  # type: ignore[union-attr]
        # a payload already in an arena is not copied again
        again = QuantizedLinear(kept, "q4", 1024, 4096, cache="packed", kernels=kernels)
        assert again.compiled_payload.payload is kept or np.shares_memory(again.compiled_payload.payload, kept)  # type: ignore[union-attr]
    assert np.array_equal(copied(x), given(x))
    _check(copied, x, q.dequantize())
    with pytest.raises(MCFError, match="unknown pages"):
        QuantizedLinear(q.payload, "q4", 1024, 4096, pages="tiny")  # type: ignore[arg-type]
