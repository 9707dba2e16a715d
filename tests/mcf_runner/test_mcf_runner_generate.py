"""Generation: the KV cache, sampling, stopping, batching, and string prompts through tokenizer.json."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from carton.errors import MCFError
from carton_runner_mcf._decoder import KVCache, positions_from_mask
from carton_runner_mcf._generate import SamplingParams, generate, sample_next
from mcf_runner_models import build_llama, load_runner, to_mcf, word_tokenizer_json

PROMPT = np.random.default_rng(11).integers(3, 512, size=(1, 12), dtype=np.int64)


def _full_forward_greedy(model, ids: np.ndarray, steps: int) -> np.ndarray:
    """Greedy decoding without a cache: the whole sequence is recomputed for every new token."""
    sequence = ids.copy()
    for _ in range(steps):
        mask = np.ones(sequence.shape, dtype=bool)
        hidden = model.forward(sequence, positions_from_mask(mask), mask, KVCache(model.config, len(sequence), 1))
        next_token = model.logits(hidden[:, -1]).argmax(-1)
        sequence = np.concatenate([sequence, next_token[:, None]], axis=1)
    return sequence[:, ids.shape[1] :]


@pytest.mark.parametrize("method", [None, "k4"])
def test_cached_generation_equals_full_forward(method: str | None, mcf_model: Callable[..., Path]):
    runner = load_runner(mcf_model("tied_linear", method), mode="generate", stop_at_eos=False, max_new_tokens=10)
    try:
        ids = np.concatenate([PROMPT, PROMPT[:, ::-1]])
        cached = runner.infer({"input_ids": ids})["output_ids"]
        assert cached.shape == (2, 10) and cached.dtype == np.int64
        np.testing.assert_array_equal(cached, _full_forward_greedy(runner._loaded.model, ids, 10))
    finally:
        runner.close()


def test_greedy_generation_matches_transformers(hf_model: Callable[..., Path], mcf_model: Callable[..., Path]):
    import torch
    from transformers import LlamaForCausalLM

    reference = LlamaForCausalLM.from_pretrained(hf_model("tied_linear"), dtype=torch.float32).eval()
    with torch.no_grad():
        expected = reference.generate(
            torch.tensor(PROMPT), max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0
        )[:, PROMPT.shape[1] :].numpy()
    runner = load_runner(mcf_model("tied_linear"), mode="generate", max_new_tokens=12, stop_at_eos=False)
    try:
        np.testing.assert_array_equal(runner.infer({"input_ids": PROMPT})["output_ids"], expected)
    finally:
        runner.close()


def test_padded_batch_generates_like_single_prompts(mcf_model: Callable[..., Path]):
    runner = load_runner(mcf_model("tied_linear"), mode="generate", max_new_tokens=6, stop_at_eos=False)
    try:
        short = PROMPT[:, 5:]
        ids = np.zeros((2, 12), dtype=np.int64)
        mask = np.zeros((2, 12), dtype=np.int64)
        ids[0], mask[0] = PROMPT[0], 1
        ids[1, 5:], mask[1, 5:] = short[0], 1
        batched = runner.infer({"input_ids": ids, "attention_mask": mask})["output_ids"]
        np.testing.assert_array_equal(batched[0], runner.infer({"input_ids": PROMPT})["output_ids"][0])
        np.testing.assert_array_equal(batched[1], runner.infer({"input_ids": short})["output_ids"][0])
    finally:
        runner.close()


def test_sampling_is_seeded_and_filtered(mcf_model: Callable[..., Path]):
    runner = load_runner(mcf_model("tied_linear"), mode="generate", max_new_tokens=16, stop_at_eos=False)
    try:

        def run(**scalars: float) -> np.ndarray:
            inputs = {"input_ids": PROMPT} | {k: np.array(v) for k, v in scalars.items()}
            return runner.infer(inputs)["output_ids"]

        greedy = run()
        first = run(temperature=1.5, seed=1)
        np.testing.assert_array_equal(first, run(temperature=1.5, seed=1))
        assert not np.array_equal(first, run(temperature=1.5, seed=2))
        assert not np.array_equal(first, greedy)
        np.testing.assert_array_equal(run(temperature=1.5, top_k=1, seed=3), greedy)
        np.testing.assert_array_equal(run(temperature=1.5, top_p=1e-6, seed=4), greedy)
        assert run(max_new_tokens=3).shape == (1, 3)
        assert run(max_new_tokens=0).shape == (1, 0)
    finally:
        runner.close()


def test_sample_next_respects_top_k_and_top_p():
    logits = np.log(np.array([[0.05, 0.4, 0.3, 0.15, 0.1]], dtype=np.float32))
    rng = np.random.default_rng(0)
    draws = [int(sample_next(logits, SamplingParams(temperature=1.0, top_k=2), rng)[0]) for _ in range(300)]
    assert set(draws) == {1, 2}
    # top_p = 0.75: 0.4 + 0.3 = 0.7 is short of it, so 0.15 joins; 0.1 and 0.05 never appear.
    draws = [int(sample_next(logits, SamplingParams(temperature=1.0, top_p=0.75), rng)[0]) for _ in range(400)]
    assert set(draws) == {1, 2, 3}
    frequencies = (
        np.bincount(
            [int(sample_next(logits, SamplingParams(temperature=1.0), rng)[0]) for _ in range(4000)], minlength=5
        )
        / 4000
    )
    np.testing.assert_allclose(frequencies, np.exp(logits[0]), atol=0.03)


def test_generation_stops_at_end_of_sequence(mcf_model: Callable[..., Path]):
    runner = load_runner(mcf_model("tied_linear"), mode="generate")
    try:
        model = runner._loaded.model
        ids = np.concatenate([PROMPT, PROMPT[:, ::-1]])
        mask = np.ones(ids.shape, dtype=bool)
        free = generate(model, ids, mask, SamplingParams(max_new_tokens=8, stop_at_eos=False))
        # Declare the second row's third token the end of sequence: each row stops after its first one.
        eos = int(free[1, 2])
        stopped = generate(model, ids, mask, SamplingParams(max_new_tokens=8, eos_token_ids=(eos,), pad_token_id=0))
        ends = [int(np.flatnonzero(row == eos)[0]) + 1 if eos in row else 8 for row in free]
        assert ends[1] <= 3
        assert stopped.shape == (2, max(ends))
        for row, end in enumerate(ends):
            np.testing.assert_array_equal(stopped[row, :end], free[row, :end])
            assert (stopped[row, end:] == 0).all()
    finally:
        runner.close()


def test_string_prompts_through_tokenizer_json(model_root: Path):
    hf = build_llama(
        model_root / "hf-words", tie=True, initializer_range=0.1, seed=5, tokenizer_json=word_tokenizer_json(512)
    )
    folder = to_mcf(hf, model_root / "mcf-words-q8", "q8")
    runner = load_runner(folder, mode="generate", max_new_tokens=5, stop_at_eos=False)
    try:
        prompts = np.array(["w10 w20 w30 w40", "w7 w8"])
        out = runner.infer({"prompt": prompts})
        assert set(out) == {"output_ids", "text"}
        texts = out["text"]
        assert texts.shape == (2,) and texts.dtype.kind == "U"
        for row, text in enumerate(texts):
            words = text.split()
            assert len(words) == 5 and all(w.startswith("w") or w == "<unk>" for w in words)
            assert words == [f"w{i}" if i >= 2 else "<unk>" for i in out["output_ids"][row]]
        # The batch is left-padded: each prompt alone gives the same continuation.
        alone = runner.infer({"prompt": prompts[1:]})["output_ids"]
        np.testing.assert_array_equal(alone[0], out["output_ids"][1])
        ids = runner.infer({"input_ids": np.array([[10, 20, 30, 40]])})["output_ids"]
        np.testing.assert_array_equal(ids[0], out["output_ids"][0])
        scalar = runner.infer({"prompt": np.array("w7 w8")})
        assert scalar["text"].shape == () and scalar["text"].item() == texts[1]
    finally:
        runner.close()


CHAT_TEMPLATE = (
    "{% for message in messages %}w5 {{ message['content'] }} w6{% endfor %}"
    "{% if add_generation_prompt %} w7{% endif %}"
)


def test_chat_template_wraps_prompts(model_root: Path):
    hf = build_llama(
        model_root / "hf-chat", tie=True, initializer_range=0.1, seed=6, tokenizer_json=word_tokenizer_json(512)
    )
    (hf / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE, "eos_token": "<eos>"}))
    folder = to_mcf(hf, model_root / "mcf-chat")
    runner = load_runner(folder, mode="generate", chat=True, max_new_tokens=4, stop_at_eos=False)
    try:
        chat = runner.infer({"prompt": np.array(["w10 w11"])})["output_ids"]
        by_hand = runner.infer({"input_ids": np.array([[5, 10, 11, 6, 7]])})["output_ids"]
        np.testing.assert_array_equal(chat, by_hand)
    finally:
        runner.close()


def test_chat_templates_run_sandboxed(model_root: Path, tmp_path: Path):
    hf = tmp_path / "hf-evil"
    shutil.copytree(build_llama(model_root / "hf-chat-evil", tokenizer_json=word_tokenizer_json(512)), hf)
    evil = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    (hf / "tokenizer_config.json").write_text(json.dumps({"chat_template": evil}))
    runner = load_runner(to_mcf(hf, tmp_path / "mcf-evil"), mode="generate", chat=True, max_new_tokens=1)
    try:
        with pytest.raises(MCFError, match=r"the chat_template of tokenizer_config.json failed: .*unsafe"):
            runner.infer({"prompt": np.array(["w10"])})
    finally:
        runner.close()
    (hf / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{% for %}"}))
    with pytest.raises(MCFError, match=r"chat_template of tokenizer_config.json does not compile"):
        load_runner(to_mcf(hf, tmp_path / "mcf-broken"), mode="generate", chat=True)
    (hf / "tokenizer_config.json").write_text(json.dumps({}))
    with pytest.raises(MCFError, match=r"runner option chat needs a chat_template in tokenizer_config.json"):
        load_runner(to_mcf(hf, tmp_path / "mcf-none"), mode="generate", chat=True)
