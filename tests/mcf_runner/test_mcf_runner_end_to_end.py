"""The mcf runner as users meet it: discovered as a plugin, packed with carton.pack, run out of process."""

from __future__ import annotations

import importlib.metadata
import shutil
from collections.abc import Callable
from pathlib import Path

import carton
import numpy as np
import pytest
from carton_runner_mcf import plugin
from mcf_runner_models import (
    build_llama,
    edit_config,
    infer_logits,
    load_runner,
    max_relative_error,
    to_mcf,
    word_tokenizer_json,
)


def test_plugin_offers_the_runner_at_carton_version():
    (spec,) = plugin.carton_runners()
    assert spec.runner_name == "mcf"
    assert spec.framework_version == importlib.metadata.version("carton-runtime") == carton.__version__
    assert spec.runner_compat_version == 1
    assert spec.entry == "carton_runner_mcf.runner:MCFRunner"
    assert any(s.runner_name == "mcf" for s in carton.discover_runners())


def test_packed_logits_out_of_process_equal_in_process(mcf_model: Callable[..., Path], tmp_path: Path):
    folder = mcf_model("tied_linear", "q8")
    path = carton.pack(folder, tmp_path / "tiny.carton", runner_name="mcf", required_framework_version=">=0.1")
    info = carton.get_model_info(path)
    assert info.runner.runner_name == "mcf" and info.runner.runner_compat_version == 1
    assert [(s.name, s.dtype, s.shape) for s in info.inputs] == [("input_ids", "int64", ("batch", "seq"))]
    assert [(s.name, s.dtype, s.shape) for s in info.outputs] == [("logits", "float32", ("batch", "seq", 512))]
    ids = np.random.default_rng(0).integers(0, 512, size=(2, 9), dtype=np.int64)
    with carton.load(path) as model:
        remote = model.infer({"input_ids": ids})["logits"]
        # A token outside the vocabulary is the caller's mistake, found by the runner: InvalidInput, as on the host.
        with pytest.raises(carton.InvalidInput, match=r"'input_ids'\[0, 0\] = 600 is outside the vocabulary") as bad:
            model.infer({"input_ids": np.full((1, 2), 600, dtype=np.int64)})
        assert bad.value.tensor == "input_ids"
        # The runner survives a bad request.
        np.testing.assert_array_equal(model.infer({"input_ids": ids})["logits"], remote)
    # Equal up to BLAS summation order (the runner process may use another thread count).
    assert max_relative_error(remote, infer_logits(folder, {"input_ids": ids})) < 1e-5


def test_generate_with_prompts_out_of_process(model_root: Path, tmp_path: Path):
    hf = build_llama(
        model_root / "hf-e2e-words", tie=True, initializer_range=0.1, seed=5, tokenizer_json=word_tokenizer_json(512)
    )
    folder = to_mcf(hf, tmp_path / "words", "k4")
    path = carton.pack(
        folder,
        tmp_path / "words.carton",
        runner_name="mcf",
        required_framework_version=">=0.1",
        runner_opts={"mode": "generate", "max_new_tokens": 4, "stop_at_eos": False},
    )
    info = carton.get_model_info(path)
    assert [s.name for s in info.inputs] == ["prompt"] and [s.name for s in info.outputs] == ["text"]
    prompts = np.array(["w10 w20 w30", "w5"])
    with carton.load(path) as model:
        texts = model.infer({"prompt": prompts})["text"]
    local = load_runner(folder, mode="generate", max_new_tokens=4, stop_at_eos=False)
    try:
        assert texts.tolist() == local.infer({"prompt": prompts})["text"].tolist()
    finally:
        local.close()
    assert all(len(text.split()) == 4 for text in texts)


def test_unsupported_model_fails_at_pack_and_load(hf_model: Callable[..., Path], tmp_path: Path):
    hf = tmp_path / "hf-qwen"
    shutil.copytree(hf_model("base"), hf)
    edit_config(hf, model_type="qwen2", architectures=["Qwen2ForCausalLM"])
    folder = to_mcf(hf, tmp_path / "qwen")
    with pytest.raises(carton.CartonError, match="model_type 'qwen2' is not supported by the mcf runner"):
        carton.pack(folder, tmp_path / "qwen.carton", runner_name="mcf", required_framework_version=">=0.1")
    with pytest.raises(carton.RunnerStartError, match="model_type 'qwen2' is not supported by the mcf runner") as info:
        carton.load_unpacked(folder, runner_name="mcf", required_framework_version=">=0.1")
    assert info.value.remote_kind == "unsupported_model"  # carton.UnsupportedModel travels as its protocol kind


def test_strict_sandbox_runs_a_converted_model(mcf_model: Callable[..., Path]) -> None:
    """The sandboxed runner reads model.mcf under another uid: the converter must write it readable (umask mode)."""
    folder = mcf_model("base")
    ids = np.array([[3, 1, 4, 1, 5]], dtype=np.int64)
    try:
        model = carton.load_unpacked(folder, runner_name="mcf", required_framework_version=">=0.1", sandbox="strict")
    except carton.SandboxUnavailable as exc:
        pytest.skip(f"no strict sandbox on this machine: {exc}")
    with model:
        logits = model.infer({"input_ids": ids})["logits"]
    assert max_relative_error(logits, infer_logits(folder, {"input_ids": ids})) < 1e-5


def test_bad_runner_option_fails_the_load_out_of_process(mcf_model: Callable[..., Path]) -> None:
    message = r"InvalidOption: runner option 'max_new_tokens' must be >= 0"
    with pytest.raises(carton.RunnerStartError, match=message) as info:
        carton.load_unpacked(
            mcf_model("base"),
            runner_name="mcf",
            required_framework_version=">=0.1",
            runner_opts={"mode": "generate", "max_new_tokens": -1},
        )
    assert info.value.remote_kind == "invalid_option"


@pytest.mark.parametrize("packed_mode, asked_mode", [("logits", "generate"), ("generate", "logits")])
def test_overriding_the_mode_at_load_says_it_is_chosen_at_pack_time(
    mcf_model: Callable[..., Path], tmp_path: Path, packed_mode: str, asked_mode: str
):
    """The declared interface follows the packed mode, so a load-time override fails at load, saying why."""
    folder = mcf_model("base")
    path = carton.pack(folder, tmp_path / f"{packed_mode}.carton", runner_name="mcf", required_framework_version="*",
                       runner_opts={"mode": packed_mode})  # fmt: skip
    with pytest.raises(carton.RunnerStartError) as caught:
        carton.load(path, runner_opts={"mode": asked_mode})
    message = str(caught.value)
    assert f"runner option mode = {asked_mode!r}" in message and "chosen at pack time" in message, message
    assert f"packed in {packed_mode!r} mode" in message, message
    assert "did not return output" not in message
    with carton.load(path, runner_opts={"mode": packed_mode}) as model:  # the packed mode itself is fine
        assert model.info.runner.opts["mode"] == packed_mode
