"""Unsupported models, broken files, bad options and bad inputs: each ends in a typed error naming the culprit."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import carton.mcf
import numpy as np
import pytest
from carton.mcf import MCFError, UnsupportedModel
from carton_protocol import DType, InvalidInput, InvalidModel, InvalidOption, OptValue, PackContext, TensorSpec
from carton_runner_mcf.runner import MCFRunner
from mcf_runner_models import edit_config, load_runner, to_mcf


def _variant(hf_model: Callable[..., Path], root: Path, name: str, **changes: object) -> Path:
    """The base model with config.json edited, converted to a float MCF."""
    hf = root / f"hf-{name}"
    if hf.exists():
        shutil.rmtree(hf)
    shutil.copytree(hf_model("base"), hf)
    edit_config(hf, **changes)
    return to_mcf(hf, root / f"mcf-{name}")


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"model_type": "gemma", "architectures": ["GemmaForCausalLM"]}, "model_type 'gemma' is not supported"),
        ({"architectures": ["Qwen2ForCausalLM"]}, "architectures ['Qwen2ForCausalLM'] are not supported"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, "rope_type = 'yarn'"),
        ({"rope_parameters": None, "rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_type = 'dynamic'"),
        ({"hidden_act": "gelu"}, "hidden_act = 'gelu'"),
        ({"attn_logit_softcapping": 50.0}, "'attn_logit_softcapping' = 50.0"),
        ({"logits_scaling": 8.0}, "'logits_scaling' = 8.0"),
        ({"sliding_window": 16}, "sliding_window = 16"),
    ],
)
def test_unsupported_models_are_refused_by_name(
    changes: dict[str, object], message: str, hf_model: Callable[..., Path], tmp_path: Path
):
    folder = _variant(hf_model, tmp_path, "unsupported", **changes)
    with pytest.raises(UnsupportedModel, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_runner(folder)
    with pytest.raises(UnsupportedModel):
        MCFRunner.pack(PackContext(model_dir=folder, opts={}))


def test_model_info_architecture_is_checked(mcf_model: Callable[..., Path], tmp_path: Path):
    source = carton.mcf.MCFFile.open(mcf_model("base") / "model.mcf")
    tensors = {name: np.array(source.array(name)) for name in source.tensors}
    config = source.resource("config.json")
    assert config is not None
    source.close()
    (tmp_path / "gemma").mkdir()
    carton.mcf.write_mcf(
        tmp_path / "gemma" / "model.mcf",
        tensors=tensors,
        model_info=carton.mcf.ModelInfo(arch=carton.mcf.Architecture.GEMMA),
        resources={"config.json": config},
    )
    with pytest.raises(UnsupportedModel, match="ModelInfo arch gemma is not supported"):
        load_runner(tmp_path / "gemma")
    (tmp_path / "vocab").mkdir()
    carton.mcf.write_mcf(
        tmp_path / "vocab" / "model.mcf",
        tensors=tensors,
        model_info=carton.mcf.ModelInfo(arch=carton.mcf.Architecture.LLAMA, vocab_size=1000),
        resources={"config.json": config},
    )
    with pytest.raises(MCFError, match=r"ModelInfo vocab_size = 1000 disagrees with config.json"):
        load_runner(tmp_path / "vocab")
    (tmp_path / "noconfig").mkdir()
    carton.mcf.write_mcf(tmp_path / "noconfig" / "model.mcf", tensors=tensors)
    with pytest.raises(MCFError, match=r"no config.json section \(0x0100\)"):
        load_runner(tmp_path / "noconfig")


def test_missing_and_misshapen_tensors_are_named(mcf_model: Callable[..., Path], tmp_path: Path):
    source = carton.mcf.MCFFile.open(mcf_model("base") / "model.mcf")
    tensors = {name: np.array(source.array(name)) for name in source.tensors}
    config = source.resource("config.json")
    assert config is not None
    source.close()
    missing = dict(tensors)
    del missing["model.layers.1.mlp.up_proj.weight"]
    (tmp_path / "missing").mkdir()
    carton.mcf.write_mcf(tmp_path / "missing" / "model.mcf", tensors=missing, resources={"config.json": config})
    with pytest.raises(MCFError, match=r"tensor 'model.layers.1.mlp.up_proj.weight' is missing"):
        load_runner(tmp_path / "missing")
    wrong = dict(tensors)
    wrong["model.layers.0.self_attn.k_proj.weight"] = np.zeros((16, 64), np.float32)
    (tmp_path / "wrong").mkdir()
    carton.mcf.write_mcf(tmp_path / "wrong" / "model.mcf", tensors=wrong, resources={"config.json": config})
    with pytest.raises(MCFError, match=r"'model.layers.0.self_attn.k_proj.weight' has shape \[16, 64\], expected"):
        load_runner(tmp_path / "wrong")
    untied = dict(tensors)
    del untied["lm_head.weight"]
    (tmp_path / "nohead").mkdir()
    carton.mcf.write_mcf(tmp_path / "nohead" / "model.mcf", tensors=untied, resources={"config.json": config})
    with pytest.raises(MCFError, match=r"'lm_head.weight' is missing and config.json does not tie"):
        load_runner(tmp_path / "nohead")


def test_bad_config_json(hf_model: Callable[..., Path], tmp_path: Path):
    folder = _variant(hf_model, tmp_path, "heads", num_key_value_heads=3)
    with pytest.raises(MCFError, match=r"num_attention_heads \(4\) is not a multiple of num_key_value_heads \(3\)"):
        load_runner(folder)
    folder = _variant(hf_model, tmp_path, "nohidden", hidden_size=None)
    with pytest.raises(MCFError, match=r"config.json has no 'hidden_size'"):
        load_runner(folder)


def test_model_folder_must_hold_one_mcf(mcf_model: Callable[..., Path], tmp_path: Path):
    with pytest.raises(MCFError, match=r"exactly one \*.mcf file \(found: none\)"):
        load_runner(tmp_path)
    shutil.copy(mcf_model("base") / "model.mcf", tmp_path / "a.mcf")
    shutil.copy(mcf_model("base") / "model.mcf", tmp_path / "b.mcf")
    with pytest.raises(MCFError, match=r"found: a.mcf, b.mcf"):
        load_runner(tmp_path)
    load_runner(tmp_path, model_file="b.mcf").close()
    with pytest.raises(MCFError, match=r"model_file='../x.mcf' is not a file inside the model folder"):
        load_runner(tmp_path, model_file="../x.mcf")


def test_options_are_checked(mcf_model: Callable[..., Path]):
    seen: list[str] = []
    load_runner(mcf_model("base"), seen, temprature=0.5).close()
    assert seen == ["mcf runner: unknown runner options ignored: temprature"]
    with pytest.raises(InvalidOption, match="runner option 'mode' must be 'logits' or 'generate', got 'chat'"):
        load_runner(mcf_model("base"), mode="chat")
    with pytest.raises(InvalidOption, match="runner option 'max_new_tokens' must be int, got '8'"):
        load_runner(mcf_model("base"), max_new_tokens="8")
    with pytest.raises(InvalidOption, match="runner option 'stop_at_eos' must be bool, got 1"):
        load_runner(mcf_model("base"), stop_at_eos=1)
    with pytest.raises(InvalidOption, match="'weight_cache' must be one of auto, packed, int8, fp32, got 'bf16'"):
        load_runner(mcf_model("base", "q8"), weight_cache="bf16")
    with pytest.raises(InvalidOption, match="runner option 'threads' must be >= 1, got 0"):
        load_runner(mcf_model("base", "q8"), threads=0)


def test_unknown_config_keys_are_reported(hf_model: Callable[..., Path], tmp_path: Path):
    folder = _variant(hf_model, tmp_path, "extra", my_new_knob=3)
    seen: list[str] = []
    load_runner(folder, seen).close()
    assert any("config.json keys not known to the runner, ignored: my_new_knob" in message for message in seen)


@pytest.mark.parametrize(
    ("inputs", "message"),
    [
        ({"input_ids": np.array([[1, 512]])}, r"'input_ids'\[0, 1\] = 512 is outside the vocabulary \[0, 512\)"),
        ({"input_ids": np.array([[-1]])}, r"'input_ids'\[0, 0\] = -1 is outside"),
        ({"input_ids": np.array([1, 2])}, r"must be an integer tensor \[batch, seq\], got int64 \[2\]"),
        ({"input_ids": np.array([[1.0]])}, r"got float64 \[1, 1\]"),
        ({"input_ids": np.zeros((1, 0), np.int64)}, "must not be empty"),
        ({"input_ids": np.array([[1, 2]]), "attention_mask": np.array([[1]])}, "shaped like input_ids"),
        ({"input_ids": np.array([[1, 2]]), "attention_mask": np.array([[1, 2]])}, "may only hold 0 and 1"),
        ({"input_ids": np.array([[1, 2], [3, 4]]), "attention_mask": np.array([[1, 1], [0, 0]])}, "row 1 masks"),
        ({"input_ids": np.array([[1]]), "pixels": np.zeros(3)}, "does not take input"),
        ({"attention_mask": np.array([[1]])}, "'input_ids' is missing"),
    ],
)
def test_bad_logits_inputs(inputs: dict[str, np.ndarray], message: str, mcf_model: Callable[..., Path]):
    runner = load_runner(mcf_model("base"))
    try:
        with pytest.raises(InvalidInput, match=message):
            runner.infer(inputs)
    finally:
        runner.close()


@pytest.mark.parametrize(
    ("inputs", "message"),
    [
        ({"top_p": np.array(0.0)}, r"top_p must be in \(0, 1\]"),
        ({"temperature": np.array(-1.0)}, "temperature must be a finite number >= 0"),
        ({"top_k": np.array(-2)}, "top_k must be >= 0"),
        ({"max_new_tokens": np.array(1.5)}, "'max_new_tokens' must be an integer"),
        ({"seed": np.array([1, 2])}, "'seed' must be a single number"),
        ({"prompt": np.array(["hello"])}, "has no tokenizer.json"),
    ],
)
def test_bad_generate_inputs(inputs: dict[str, np.ndarray], message: str, mcf_model: Callable[..., Path]):
    runner = load_runner(mcf_model("base"), mode="generate", max_new_tokens=2)
    try:
        with pytest.raises(InvalidInput, match=message):
            runner.infer({"input_ids": np.array([[1, 2]])} | inputs if "prompt" not in inputs else inputs)
    finally:
        runner.close()


def test_pack_checks_declared_tensors(mcf_model: Callable[..., Path]):
    folder = mcf_model("base")
    result = MCFRunner.pack(PackContext(model_dir=folder, opts={}))
    assert result.inputs == (TensorSpec(name="input_ids", dtype=DType.INT64, shape=("batch", "seq")),)
    assert result.outputs == (TensorSpec(name="logits", dtype=DType.FLOAT32, shape=("batch", "seq", 512)),)
    generate = MCFRunner.pack(PackContext(model_dir=folder, opts={"mode": "generate"}))
    assert [s.name for s in generate.inputs] == ["input_ids"] and [s.name for s in generate.outputs] == ["output_ids"]
    assert generate.opts == {"mode": "generate"}
    with pytest.raises(InvalidModel, match="declared input 'pixels' is not served by the mcf runner in logits mode"):
        MCFRunner.pack(PackContext(model_dir=folder, opts={}, inputs=(TensorSpec(name="pixels", dtype=DType.INT64),)))
    with pytest.raises(InvalidModel, match="declared input 'input_ids' must have dtype int64, not float32"):
        MCFRunner.pack(
            PackContext(model_dir=folder, opts={}, inputs=(TensorSpec(name="input_ids", dtype=DType.FLOAT32),))
        )
    with pytest.raises(InvalidModel, match=r"no tokenizer.json section"):
        MCFRunner.pack(
            PackContext(
                model_dir=folder, opts={"mode": "generate"}, outputs=(TensorSpec(name="text", dtype=DType.STRING),)
            )
        )


def test_config_json_must_be_json(hf_model: Callable[..., Path], tmp_path: Path):
    hf = tmp_path / "hf-badjson"
    shutil.copytree(hf_model("base"), hf)
    (hf / "config.json").write_text("{not json")
    # The converter refuses it first; write the MCF directly to reach the runner's own check.
    source = carton.mcf.MCFFile.open(to_mcf(hf_model("base"), tmp_path / "good") / "model.mcf")
    tensors = {name: np.array(source.array(name)) for name in source.tensors}
    source.close()
    (tmp_path / "badjson").mkdir()
    carton.mcf.write_mcf(tmp_path / "badjson" / "model.mcf", tensors=tensors, resources={"config.json": b"{not json"})
    with pytest.raises(MCFError, match=r"the config.json section is not valid JSON"):
        load_runner(tmp_path / "badjson")
    (tmp_path / "list").mkdir()
    carton.mcf.write_mcf(
        tmp_path / "list" / "model.mcf", tensors=tensors, resources={"config.json": json.dumps([1]).encode()}
    )
    with pytest.raises(MCFError, match="must hold a JSON object"):
        load_runner(tmp_path / "list")


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}, "rope_scaling": {"rope_type": "yarn"}},
            r"config.json rope_scaling.rope_type = 'yarn' is not supported",
        ),
        (
            {
                "rope_parameters": {"rope_type": "yarn", "factor": 2.0},
                "rope_scaling": {"type": "linear", "factor": 2.0},
            },
            r"config.json rope_parameters.rope_type = 'yarn' is not supported",
        ),
        (
            {"rope_parameters": {"rope_type": "default"}, "rope_scaling": {"type": "linear", "factor": 2.0}},
            r"config.json rope_parameters \(rope_type 'default'\) and rope_scaling \(rope_type 'linear'\) disagree",
        ),
        (
            {
                "rope_parameters": {"rope_type": "linear", "factor": 2.0},
                "rope_scaling": {"rope_type": "linear", "factor": 4.0},
            },
            r"config.json rope_parameters \(factor 2.0\) and rope_scaling \(factor 4.0\) disagree",
        ),
        (
            {"rope_theta": 5000.0, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
            r"config.json rope_theta \(5000.0\) and rope_parameters.rope_theta \(10000.0\) disagree",
        ),
    ],
)
def test_rope_keys_must_agree_and_be_supported(
    changes: dict[str, object], message: str, hf_model: Callable[..., Path], tmp_path: Path
) -> None:
    folder = _variant(hf_model, tmp_path, "rope", **changes)
    with pytest.raises(UnsupportedModel, match=message):
        load_runner(folder)


def test_agreeing_rope_keys_are_accepted(hf_model: Callable[..., Path], tmp_path: Path) -> None:
    folder = _variant(
        hf_model,
        tmp_path,
        "rope-agree",
        rope_theta=10000.0,
        rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
        rope_scaling={"type": "linear", "factor": 2},
    )
    runner = load_runner(folder)
    try:
        assert runner._loaded.config.rope_scaling_factor == 2.0
    finally:
        runner.close()


def test_sequences_beyond_max_position_embeddings_are_refused_before_any_work(
    hf_model: Callable[..., Path], tmp_path: Path
) -> None:
    folder = _variant(hf_model, tmp_path, "short", max_position_embeddings=16)
    runner = load_runner(folder)
    try:
        assert runner.infer({"input_ids": np.ones((1, 16), np.int64)})["logits"].shape == (1, 16, 512)
        with pytest.raises(InvalidInput, match=r"'input_ids' has 17 positions, more than config.json's max_posit"):
            runner.infer({"input_ids": np.ones((2, 17), np.int64)})
    finally:
        runner.close()
    runner = load_runner(folder, mode="generate", max_new_tokens=6, stop_at_eos=False)
    try:
        assert runner.infer({"input_ids": np.ones((1, 10), np.int64)})["output_ids"].shape == (1, 6)
        limit = (
            r"11 prompt positions \+ max_new_tokens 6 = 17 is more than config.json's max_position_embeddings \(16\)"
        )
        with pytest.raises(InvalidInput, match=limit):
            runner.infer({"input_ids": np.ones((1, 11), np.int64)})
        with pytest.raises(InvalidInput, match=r"10 prompt positions \+ max_new_tokens 7 = 17"):
            runner.infer({"input_ids": np.ones((1, 10), np.int64), "max_new_tokens": np.array(7)})
    finally:
        runner.close()
    with pytest.raises(InvalidOption, match=r"runner option 'max_new_tokens' = 16 leaves no room for a prompt"):
        load_runner(folder, mode="generate", max_new_tokens=16)
    with pytest.raises(InvalidOption, match=r"'max_new_tokens' = 16 leaves no room .* max_position_embeddings \(16\)"):
        MCFRunner.pack(PackContext(model_dir=folder, opts={"mode": "generate", "max_new_tokens": 16}))
    load_runner(folder, max_new_tokens=16).close()  # logits mode generates nothing: no limit on the option


@pytest.mark.parametrize(
    ("opts", "message"),
    [
        ({"max_new_tokens": -1}, r"runner option 'max_new_tokens' must be >= 0, got -1"),
        ({"temperature": -0.5}, r"runner option 'temperature' must be a finite number >= 0, got -0.5"),
        ({"temperature": float("nan")}, r"runner option 'temperature' must be a finite number >= 0, got nan"),
        ({"top_k": -2}, r"runner option 'top_k' must be >= 0, got -2"),
        ({"top_p": 0.0}, r"runner option 'top_p' must be in \(0, 1\], got 0.0"),
        ({"top_p": 1.5}, r"runner option 'top_p' must be in \(0, 1\], got 1.5"),
        ({"seed": -1}, r"runner option 'seed' must be >= 0, got -1"),
    ],
)
def test_bad_option_values_fail_at_load(
    opts: dict[str, OptValue], message: str, mcf_model: Callable[..., Path]
) -> None:
    with pytest.raises(InvalidOption, match=message):
        load_runner(mcf_model("base"), mode="generate", **opts)
    with pytest.raises(InvalidOption, match=message):
        MCFRunner.pack(PackContext(model_dir=mcf_model("base"), opts={"mode": "generate", **opts}))
