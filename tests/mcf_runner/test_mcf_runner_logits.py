"""Logits of the mcf runner against transformers' fp32 llama, for float and every quantized MCF."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from carton_runner_mcf._decoder import KVCache, pick_rows, positions_from_mask
from carton_runner_mcf._packed import compiled_kernels
from mcf_runner_models import (
    infer_logits,
    load_runner,
    max_relative_error,
    reference_logits,
    relative_rmse,
    to_mcf,
)

IDS = np.random.default_rng(7).integers(0, 512, size=(2, 24), dtype=np.int64)
#: Two ways of running the same tokens through the compiled kernels (a batch of up to 48 rows through their int16
#: block products, a larger one through float32 tiles and BLAS; or against the numpy path) differ by the rounding
#: of activations to int16 per block of 32, which leaves logits within this relative distance on these models.
PATHS_AGREE = 2e-4

#: Relative RMSE of logits against the fp32 MCF, every weight (embeddings, attention, MLP, head) quantized, on the
#: BASE model. q8 and k6 are the issue's bounds; the others are the values measured when this test was written
#: (q8 0.0095, k6 0.037, q4 0.161, k4 0.161, k3 0.331, k2 0.683; int8 0.017, int4 0.216) with a margin of about 1.4x.
QUANT_BOUNDS = {
    "q8": 0.02,
    "k6": 0.05,
    "q4": 0.22,
    "k4": 0.22,
    "k3": 0.47,
    "k2": 0.97,
    "int8": 0.025,
    "int4": 0.30,
}


@pytest.mark.parametrize("name", ["base", "tied_linear", "biased"])
def test_fp32_logits_match_transformers(name: str, hf_model: Callable[..., Path], mcf_model: Callable[..., Path]):
    ours = infer_logits(mcf_model(name), {"input_ids": IDS})
    reference = reference_logits(hf_model(name), IDS)
    assert ours.dtype == np.float32 and ours.shape == reference.shape
    assert max_relative_error(ours, reference) < 1e-4


def test_float16_storage_stays_close(hf_model: Callable[..., Path], model_root: Path):
    # f16 weights are widened to fp32 at load; only the rounding of the stored weights remains.
    folder = to_mcf(hf_model("tied_linear"), model_root / "mcf-tied-f16", None, float_dtype="f16")
    ours = infer_logits(folder, {"input_ids": IDS})
    assert max_relative_error(ours, reference_logits(hf_model("tied_linear"), IDS)) < 5e-3


@pytest.mark.parametrize("method", list(QUANT_BOUNDS))
def test_quantized_logits_error_is_bounded(method: str, mcf_model: Callable[..., Path], record_property):
    fp32 = infer_logits(mcf_model("base"), {"input_ids": IDS})
    quantized = infer_logits(mcf_model("base", method), {"input_ids": IDS})
    error = relative_rmse(quantized, fp32)
    record_property(f"logits_relative_rmse_{method}", error)
    print(f"{method}: logits relative RMSE vs fp32 = {error:.4f}")
    assert error < QUANT_BOUNDS[method]
    # Quantization must not break the model: the argmax mostly survives at 8 and 6 bits.
    if method in ("q8", "k6", "int8"):
        assert np.mean(quantized.argmax(-1) == fp32.argmax(-1)) > 0.9


@pytest.mark.parametrize("cache", ["packed", "int8", "fp32"])
def test_weight_caches_agree(cache: str, mcf_model: Callable[..., Path]):
    folder = mcf_model("tied_linear", "k4")
    default = infer_logits(folder, {"input_ids": IDS})
    chosen = infer_logits(folder, {"input_ids": IDS}, weight_cache=cache)
    assert max_relative_error(chosen, default) < PATHS_AGREE


def test_attention_mask_padding(hf_model: Callable[..., Path], mcf_model: Callable[..., Path]):
    """Left- and right-padded rows give the logits of the unpadded sequences (rotary positions skip padding)."""
    rng = np.random.default_rng(3)
    short = rng.integers(0, 512, size=10)
    long = rng.integers(0, 512, size=16)
    ids = np.zeros((3, 16), dtype=np.int64)
    mask = np.zeros((3, 16), dtype=np.int64)
    ids[0], mask[0] = long, 1
    ids[1, 6:], mask[1, 6:] = short, 1  # left padding
    ids[2, :10], mask[2, :10] = short, 1  # right padding
    folder = mcf_model("tied_linear")
    ours = infer_logits(folder, {"input_ids": ids, "attention_mask": mask})

    alone = infer_logits(folder, {"input_ids": short[None]})[0]
    np.testing.assert_allclose(ours[1, 6:], alone, rtol=0, atol=1e-4 * np.abs(alone).max())
    np.testing.assert_allclose(ours[2, :10], alone, rtol=0, atol=1e-4 * np.abs(alone).max())

    positions = positions_from_mask(mask.astype(bool))
    reference = reference_logits(hf_model("tied_linear"), ids, mask, positions)
    real = mask.astype(bool)
    assert max_relative_error(ours[real], reference[real]) < 1e-4


def test_chunked_prefill_equals_one_pass(mcf_model: Callable[..., Path]):
    runner = load_runner(mcf_model("tied_linear", "q8"))
    try:
        model = runner._loaded.model
        ids = np.random.default_rng(5).integers(0, 512, size=(2, 45), dtype=np.int64)
        mask = np.ones(ids.shape, dtype=bool)
        mask[1, :7] = False
        positions = positions_from_mask(mask)
        whole = model.forward(ids, positions, mask, KVCache(model.config, 2, 45))
        chunked = model.prefill(ids, positions, mask, KVCache(model.config, 2, 4), chunk=16)
        np.testing.assert_allclose(chunked, whole, rtol=0, atol=PATHS_AGREE * np.abs(whole).max())
    finally:
        runner.close()


@pytest.mark.parametrize("kernels", ["auto", "numpy"])
@pytest.mark.parametrize(("name", "method"), [("biased", "q4"), ("tied_linear", "k6"), ("base", None)])
def test_prefill_of_chosen_tokens_equals_those_rows_of_the_whole(
    kernels: str, name: str, method: str | None, mcf_model: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
):
    """``prefill(outputs=...)`` (what generation asks for: each row's last real token) runs the last layer for those
    tokens alone: the same hidden states as the whole prefill's rows, within the int16 rounding of the few rows'
    products, and the same keys and values in the cache; a prompt longer than a chunk is run whole."""
    monkeypatch.setenv("CARTON_MCF_KERNELS", kernels)
    runner = load_runner(mcf_model(name, method))
    try:
        model = runner._loaded.model
        ids = np.random.default_rng(9).integers(0, 512, size=(3, 21), dtype=np.int64)
        mask = np.ones(ids.shape, dtype=bool)
        mask[1, :5] = False  # left padding
        mask[2, 13:] = False  # right padding: the last real token is not the chunk's last
        positions = positions_from_mask(mask)
        outputs = np.array([20, 20, 12])
        full_cache, picked_cache = KVCache(model.config, 3, 21), KVCache(model.config, 3, 21)
        whole = pick_rows(model.prefill(ids, positions, mask, full_cache), outputs)
        picked = model.prefill(ids, positions, mask, picked_cache, outputs=outputs)
        assert picked.shape == (3, 1, model.config.hidden_size)
        np.testing.assert_allclose(picked, whole, rtol=0, atol=PATHS_AGREE * np.abs(whole).max())
        np.testing.assert_array_equal(picked_cache.key_store, full_cache.key_store)
        np.testing.assert_array_equal(picked_cache.value_store, full_cache.value_store)
        assert picked_cache.length == full_cache.length == 21
        chunked = model.prefill(ids, positions, mask, KVCache(model.config, 3, 4), chunk=8, outputs=outputs)
        np.testing.assert_allclose(chunked, whole, rtol=0, atol=PATHS_AGREE * np.abs(whole).max())
    finally:
        runner.close()


def assert_two_threads_continue_as_one(folder: Path, ids: np.ndarray, *, max_new_tokens: int) -> None:
    """The greedy continuation of `ids` at ``threads = 2`` is the one of a single thread, token for token."""
    options = {"mode": "generate", "max_new_tokens": max_new_tokens, "stop_at_eos": False}
    one, two = load_runner(folder, threads=1, **options), load_runner(folder, threads=2, **options)
    try:
        inputs = {"input_ids": ids}
        np.testing.assert_array_equal(two.infer(inputs)["output_ids"], one.infer(inputs)["output_ids"])
    finally:
        one.close()
        two.close()


@pytest.mark.parametrize("method", ["q4", "k6"])
def test_threads_split_products_without_changing_them(method: str, mcf_model: Callable[..., Path]):
    """Runner option threads: every product's rows split across threads; a row's sum never is, so a token at a
    time (the compiled matrix-vector kernels) gives the same bits, and a prompt (decoded tiles and BLAS) the same
    logits up to float32 rounding."""
    folder = mcf_model("base", method)
    assert_two_threads_continue_as_one(folder, IDS, max_new_tokens=6)
    single = infer_logits(folder, {"input_ids": IDS})
    assert max_relative_error(infer_logits(folder, {"input_ids": IDS}, threads=2), single) < 1e-5


#: A prompt of more rows than the compiled kernels' small-batch path takes: its products run as decoded float32 tiles
#: and BLAS, which the option ``threads`` runs on that many threads.
LONG_IDS = np.random.default_rng(9).integers(0, 512, size=(4, 96), dtype=np.int64)


@pytest.mark.parametrize("method", ["q4", "k4"])
def test_two_threads_prefill_a_long_prompt_as_one_does(method: str, mcf_model: Callable[..., Path]):
    """A prompt's products at ``threads = 2`` (BLAS on two threads, splitting rows and columns, never a sum) give the
    logits of one thread up to float32 rounding, and the same greedy continuation."""
    folder = mcf_model("base", method)
    single = infer_logits(folder, {"input_ids": LONG_IDS}, threads=1)
    assert max_relative_error(infer_logits(folder, {"input_ids": LONG_IDS}, threads=2), single) < 1e-5
    assert_two_threads_continue_as_one(folder, LONG_IDS, max_new_tokens=4)


@pytest.mark.parametrize("length", [1, 7, 61, 97])
def test_a_prompt_on_two_threads_gives_one_threads_logits(length: int, mcf_model: Callable[..., Path]):
    """A prompt's attention, norms and SwiGLU are shared between the threads in units each computed whole by one
    thread, and its products by groups of rows (the panel kernels, where the CPU has 512-bit VNNI): two threads give
    one thread's logits bit for bit there, and within float32 rounding elsewhere (BLAS's threads). Odd lengths
    leave partial blocks of queries and of activation rows; one token is a decode step."""
    folder = mcf_model("base", "q4")
    ids = np.random.default_rng(length).integers(0, 512, size=(2, length), dtype=np.int64)
    single = infer_logits(folder, {"input_ids": ids}, threads=1)
    double = infer_logits(folder, {"input_ids": ids}, threads=2)
    compiled = compiled_kernels("auto")
    if compiled is not None and compiled.PANEL_PRODUCTS:
        np.testing.assert_array_equal(double, single)
    assert max_relative_error(double, single) < 1e-5


def test_numpy_kernels_agree_with_the_compiled_ones(mcf_model: Callable[..., Path], monkeypatch: pytest.MonkeyPatch):
    """The same model on both kernel paths (CARTON_MCF_KERNELS=numpy forces the fallback, which auto-selects the
    int8 cache): logits within the compiled kernels' int16 rounding of the activations."""
    pytest.importorskip("numba", reason="the compiled kernels need numba")
    folder = mcf_model("tied_linear", "q8")
    compiled = infer_logits(folder, {"input_ids": IDS})
    monkeypatch.setenv("CARTON_MCF_KERNELS", "numpy")
    fallback = infer_logits(folder, {"input_ids": IDS})
    assert max_relative_error(compiled, fallback) < PATHS_AGREE


@pytest.mark.parametrize("panels", [True, False])
def test_a_prompts_work_is_shared_only_when_its_products_run_on_numbas_threads(
    panels: bool, mcf_model: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
):
    """With decoded tiles and BLAS (no panel kernels: a CPU without 512-bit VNNI) a prompt's attention and norms stay
    on the calling thread, so that numba's threads do not poll on the cores BLAS's threads need next, and the
    results stay those of one thread; with the panel kernels they take the model's threads."""
    compiled = compiled_kernels("auto")
    if compiled is None:
        pytest.skip("the compiled kernels need numba")
    if panels and not compiled.PANEL_PRODUCTS:
        pytest.skip("this CPU has no 512-bit VNNI: prompts never use the panel kernels")
    monkeypatch.setattr(compiled, "PANEL_PRODUCTS", panels)
    runner = load_runner(mcf_model("base", "q4"), threads=2)
    try:
        assert runner._loaded.model._prefill_parts == (min(2, compiled.MAX_THREADS) if panels else 1)
        got = runner.infer({"input_ids": LONG_IDS})["logits"]
    finally:
        runner.close()
    single = infer_logits(mcf_model("base", "q4"), {"input_ids": LONG_IDS}, threads=1)
    assert max_relative_error(got, single) < 1e-5


def test_packed_payloads_are_read_into_one_arena_and_a_tied_head_shares_its_embedding(
    mcf_model: Callable[..., Path],
) -> None:
    if compiled_kernels("auto") is None:
        pytest.skip("the packed cache's payloads are read into an arena with the compiled kernels only")
    from carton_runner_mcf._arena import in_arena

    folder = mcf_model("tied_linear", "k4")
    runner = load_runner(folder, weight_cache="packed")
    try:
        model = runner._loaded.model  # type: ignore[union-attr]
        payloads = [
            getattr(layer, name).compiled_payload.payload
            for layer in model.layers
            for name in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
        ]
        head = model.lm_head.compiled_payload.payload
        assert all(in_arena(p) for p in [*payloads, head])
        embedding = model.embedding.payload
        assert head.ctypes.data == embedding.ctypes.data and head.nbytes == embedding.nbytes  # read once for both
        # the file is no longer what the products read
        mapped = np.frombuffer(runner._mcf.tensor_bytes("model.layers.0.self_attn.q_proj.weight"), np.uint8)  # type: ignore[union-attr]
        assert not np.shares_memory(payloads[0], mapped) and np.array_equal(payloads[0], mapped)
        logits = runner.infer({"input_ids": IDS})["logits"]
    finally:
        runner.close()
    given = infer_logits(folder, {"input_ids": IDS}, weight_cache="int8")
    assert max_relative_error(logits, given) < PATHS_AGREE
