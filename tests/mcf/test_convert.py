"""The safetensors -> MCF converter and the ``carton mcf`` CLI, on llama-shaped models built at test time."""

from __future__ import annotations

import json
from pathlib import Path

import carton.mcf as mcf
import carton.safetensors as st
import ml_dtypes
import numpy as np
import pytest
from carton import MCFError, SafetensorsError
from carton.cli import main
from carton.mcf import Architecture, MCFDType, RopeType
from carton.mcf._convert import TensorClass, classify_tensor, convert, model_info_from_config

HIDDEN, INTER, VOCAB, LAYERS = 64, 96, 128, 2
CONFIG = {
    "model_type": "llama",
    "vocab_size": VOCAB,
    "hidden_size": HIDDEN,
    "intermediate_size": INTER,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
}


def llama_tensors(seed: int = 0, dtype: object = np.float32) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.05).astype(dtype)  # type: ignore[call-overload]

    tensors = {
        "model.embed_tokens.weight": w(VOCAB, HIDDEN),
        "model.norm.weight": np.ones(HIDDEN, dtype),  # type: ignore[call-overload]
        "lm_head.weight": w(VOCAB, HIDDEN),
    }
    for i in range(LAYERS):
        p = f"model.layers.{i}"
        tensors |= {
            f"{p}.input_layernorm.weight": np.ones(HIDDEN, dtype),  # type: ignore[call-overload]
            f"{p}.post_attention_layernorm.weight": np.ones(HIDDEN, dtype),  # type: ignore[call-overload]
            f"{p}.self_attn.q_proj.weight": w(HIDDEN, HIDDEN),
            f"{p}.self_attn.q_proj.bias": w(HIDDEN),
            f"{p}.self_attn.k_proj.weight": w(32, HIDDEN),
            f"{p}.self_attn.v_proj.weight": w(32, HIDDEN),
            f"{p}.self_attn.o_proj.weight": w(HIDDEN, HIDDEN),
            f"{p}.mlp.gate_proj.weight": w(INTER, HIDDEN),
            f"{p}.mlp.up_proj.weight": w(INTER, HIDDEN),
            f"{p}.mlp.down_proj.weight": w(HIDDEN, INTER),
        }
    return tensors


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    src = tmp_path / "tiny-llama"
    src.mkdir()
    st.save_file(llama_tensors(), src / "model.safetensors", metadata={"format": "pt"})
    (src / "config.json").write_text(json.dumps(CONFIG))
    (src / "tokenizer.json").write_text('{"model": {"type": "BPE"}}')
    (src / "tokenizer_config.json").write_text("{}")
    return src


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("model.embed_tokens.weight", TensorClass.EMBEDDINGS),
        ("transformer.wte.weight", TensorClass.EMBEDDINGS),
        ("lm_head.weight", TensorClass.HEAD),
        ("output.weight", TensorClass.HEAD),
        ("model.layers.0.self_attn.q_proj.weight", TensorClass.ATTENTION),
        ("transformer.h.3.attn.c_attn.weight", TensorClass.ATTENTION),
        ("model.layers.0.mlp.down_proj.weight", TensorClass.MLP),
        ("layers.1.feed_forward.w1.weight", TensorClass.MLP),
        ("model.layers.0.input_layernorm.weight", TensorClass.NORMS),
        ("model.layers.0.self_attn.q_norm.weight", TensorClass.NORMS),
        ("model.norm.weight", TensorClass.NORMS),
        ("transformer.ln_f.weight", TensorClass.NORMS),
        ("rotary_emb.inv_freq", TensorClass.OTHER),
    ],
)
def test_classify(name: str, expected: TensorClass) -> None:
    assert classify_tensor(name) == expected


def test_convert_quantizes_each_class_with_its_method(model_dir: Path, tmp_path: Path) -> None:
    source = llama_tensors()
    report = convert(
        model_dir, tmp_path / "m.mcf", methods={"embeddings": "q8", "attention": "k4", "mlp": "q4", "head": "k6"}
    )
    assert report.tensors == len(source)
    assert report.resources == ("config.json", "tokenizer.json", "tokenizer_config.json")
    want = {"q8": 1, "k4": 8, "q4": 6, "k6": 1, "f32": 2 * LAYERS + 1 + LAYERS}
    assert dict(report.methods) == want
    bounds = {"q8": 0.01, "k6": 0.03, "k4": 0.12, "q4": 0.12}
    with mcf.open(report.path) as f:
        for name, value in source.items():
            entry = f.tensors[name]
            method = report.tensor_methods[name]
            if method == "f32":
                assert entry.dtype == MCFDType.F32
                np.testing.assert_array_equal(f.array(name), value)
            else:
                assert entry.method is not None and entry.method.value == method
                assert entry.quant is not None
                error = np.sqrt(np.mean((f.dequantize(name) - value) ** 2) / np.mean(value**2))
                assert error < bounds[method], (name, method, error)
        assert f.resource("config.json") == (model_dir / "config.json").read_bytes()
        assert f.resource("tokenizer.json") == (model_dir / "tokenizer.json").read_bytes()
        info = f.model_info
        assert info is not None
        assert (info.arch, info.vocab_size, info.hidden_size, info.layer_count) == (
            Architecture.LLAMA,
            VOCAB,
            HIDDEN,
            2,
        )
        assert (info.head_count, info.kv_head_count, info.context_length) == (4, 2, 256)
        assert info.rope_type == RopeType.STANDARD and info.rope_freq_base == 500000.0 and info.rope_scale == 1.0
        assert info.model_name == "tiny-llama"
        assert info.kv["hf.intermediate_size"] == INTER and info.kv["hf.tie_word_embeddings"] == 0
        assert info.kv["hf.hidden_act"] == "silu"


def test_norms_and_biases_stay_float_and_float_dtype_applies(model_dir: Path, tmp_path: Path) -> None:
    report = convert(model_dir, tmp_path / "m.mcf", methods={"attention": "q8", "mlp": None}, float_dtype="bf16")
    with mcf.open(report.path) as f:
        assert f.tensors["model.layers.0.self_attn.q_proj.weight"].dtype == MCFDType.Q8
        assert f.tensors["model.layers.0.self_attn.q_proj.bias"].dtype == MCFDType.BF16
        assert f.tensors["model.layers.0.mlp.up_proj.weight"].dtype == MCFDType.BF16
        assert f.tensors["model.norm.weight"].dtype == MCFDType.BF16
        assert f.array("model.norm.weight").dtype == np.dtype(ml_dtypes.bfloat16)


def test_bf16_source_keeps_bf16_and_quantizes(tmp_path: Path) -> None:
    src = tmp_path / "bf"
    src.mkdir()
    tensors = llama_tensors(dtype=ml_dtypes.bfloat16)
    st.save_file(tensors, src / "model.safetensors")
    report = convert(src, tmp_path / "m.mcf", methods={"mlp": "k4"})
    with mcf.open(report.path) as f:
        assert f.model_info is not None and f.model_info.arch == Architecture.UNKNOWN  # no config.json
        assert f.tensors["model.embed_tokens.weight"].dtype == MCFDType.BF16
        assert f.tensors["model.layers.1.mlp.down_proj.weight"].dtype == MCFDType.K4
        assert f.resource("config.json") is None


def test_reference_mode_matches_the_quantizer_and_dedup_shares_tied_weights(tmp_path: Path) -> None:
    src = tmp_path / "tied"
    src.mkdir()
    tensors = llama_tensors()
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()
    st.save_file(tensors, src / "model.safetensors")
    report = convert(src, tmp_path / "m.mcf", methods={"embeddings": "q8", "head": "q8"}, mode="reference")
    with mcf.open(report.path) as f:
        head, emb = f.tensors["lm_head.weight"], f.tensors["model.embed_tokens.weight"]
        assert head.data_offset == emb.data_offset
        expected = mcf.quantize(tensors["lm_head.weight"], "q8", mode="reference").payload
        assert bytes(f.tensor_bytes("lm_head.weight")) == expected


def test_sharded_source(tmp_path: Path) -> None:
    src = tmp_path / "sharded"
    src.mkdir()
    tensors = llama_tensors()
    names = sorted(tensors)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    for shard, part in shards.items():
        st.save_file({n: tensors[n] for n in part}, src / shard)
    index = {"weight_map": {n: shard for shard, part in shards.items() for n in part}}
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    report = convert(src, tmp_path / "m.mcf")
    assert report.tensors == len(tensors)
    with mcf.open(report.path) as f:
        np.testing.assert_array_equal(f.array("model.norm.weight"), tensors["model.norm.weight"])
    (src / "model-00001-of-00002.safetensors").unlink()
    with pytest.raises(MCFError, match=r"model.safetensors.index.json: lists shards that do not exist"):
        convert(src, tmp_path / "m2.mcf")


def test_duplicate_tensor_across_files(tmp_path: Path) -> None:
    src = tmp_path / "dup"
    src.mkdir()
    st.save_file({"a": np.zeros(2, np.float32)}, src / "one.safetensors")
    st.save_file({"a": np.zeros(2, np.float32)}, src / "two.safetensors")
    with pytest.raises(MCFError, match=r"tensor 'a' appears in both .*one.safetensors and .*two.safetensors"):
        convert(src, tmp_path / "m.mcf")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"methods": {"layers": "q4"}}, "unknown tensor class 'layers'"),
        ({"methods": {"mlp": "q5"}}, "unknown method 'q5' for mlp"),
        ({"methods": {"norms": "q8"}}, "norm weights always stay float"),
        ({"float_dtype": "f8"}, "float dtype 'f8' is not one of keep, f32, f16, bf16"),
    ],
)
def test_convert_option_errors(model_dir: Path, tmp_path: Path, kwargs: dict, message: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(MCFError, match=message):
        convert(model_dir, tmp_path / "m.mcf", **kwargs)
    assert not (tmp_path / "m.mcf").exists()


def test_convert_source_errors(model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(MCFError, match=r"no such model folder or safetensors file"):
        convert(tmp_path / "missing", tmp_path / "m.mcf")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(MCFError, match=r"empty: no .safetensors weights found"):
        convert(empty, tmp_path / "m.mcf")
    (model_dir / "config.json").write_text("{not json")
    with pytest.raises(MCFError, match=r"config.json: not valid JSON"):
        convert(model_dir, tmp_path / "m.mcf")
    (model_dir / "config.json").write_text("[]")
    with pytest.raises(MCFError, match=r"config.json: must hold a JSON object, got list"):
        convert(model_dir, tmp_path / "m.mcf")
    (model_dir / "config.json").write_text("{}")
    weights = model_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-3])
    out = tmp_path / "m.mcf"
    out.write_bytes(b"keep me")
    with pytest.raises(SafetensorsError, match=r"model.safetensors: tensors cover"):
        convert(model_dir, out)
    assert out.read_bytes() == b"keep me"
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_integer_tensor_in_a_quantized_class_is_refused(tmp_path: Path) -> None:
    src = tmp_path / "int"
    src.mkdir()
    st.save_file({"model.layers.0.mlp.up_proj.weight": np.ones((4, 32), np.int32)}, src / "model.safetensors")
    with pytest.raises(MCFError, match=r"tensor 'model.layers.0.mlp.up_proj.weight': cannot quantize int32 data to k4"):
        convert(src, tmp_path / "m.mcf", methods={"mlp": "k4"})


@pytest.mark.parametrize(
    ("extra", "rope_type", "scale", "train", "kv"),
    [
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, RopeType.LINEAR, 2.0, 256, {}),
        (
            {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}},
            RopeType.YARN,
            4.0,
            64,
            {},
        ),
        (
            {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
            RopeType.STANDARD,
            8.0,
            256,
            {"hf.rope_scaling.type": "llama3"},
        ),
        ({"rope_parameters": {"rope_theta": 1e4, "rope_type": "default"}}, RopeType.STANDARD, 1.0, 256, {}),
    ],
)
def test_model_info_rope_from_config(
    extra: dict,
    rope_type: RopeType,
    scale: float,
    train: int,
    kv: dict,  # type: ignore[type-arg]
) -> None:
    config = {k: v for k, v in CONFIG.items() if k != "rope_theta"} | extra
    info = model_info_from_config(config)
    assert info.rope_type == rope_type and info.rope_scale == scale and info.train_context == train
    assert info.rope_freq_base == 10000.0
    for key, value in kv.items():
        assert info.kv[key] == value
    assert mcf.ModelInfo.decode(info.encode()).rope_type == rope_type


def test_model_info_from_unknown_config() -> None:
    info = model_info_from_config({"model_type": "bert", "vocab_size": -1}, default_name="x")
    assert info.arch == Architecture.UNKNOWN and info.vocab_size == 0 and info.model_name == "x"
    assert info.rope_type == RopeType.NONE and info.kv["hf.model_type"] == "bert"


# --- CLI ------------------------------------------------------------------------------------------------------
def test_cli_convert_and_info(model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cli.mcf"
    assert main(["mcf", "convert", str(model_dir), str(out), "--mlp", "k3", "--head", "none", "-v"]) == 0
    captured = capsys.readouterr()
    assert f"wrote {out}: {len(llama_tensors())} tensors" in captured.out
    assert "model.layers.0.mlp.up_proj.weight: mlp, [96, 64] f32 -> k3" in captured.err
    assert main(["mcf", "info", str(out)]) == 0
    text = capsys.readouterr().out
    assert "arch: llama" in text and "k3: 6" in text and "TENSOR_INDEX" in text
    assert main(["mcf", "info", str(out), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["model_info"]["vocab_size"] == VOCAB
    assert doc["resources"] == ["config.json", "tokenizer.json", "tokenizer_config.json"]
    by_name = {t["name"]: t for t in doc["tensors"]}
    assert by_name["lm_head.weight"]["dtype"] == "f32"
    assert by_name["model.layers.1.mlp.down_proj.weight"]["dtype"] == "k3"
    assert by_name["model.embed_tokens.weight"]["domain"] == "weights"


def test_cli_reports_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.mcf"
    bad.write_bytes(b"MCF\x00" + bytes(60))
    assert main(["mcf", "info", str(bad)]) == 1
    assert "carton: error: MCFError: " in capsys.readouterr().err
    assert main(["mcf", "convert", str(tmp_path / "nope"), str(tmp_path / "o.mcf")]) == 1
    assert "no such model folder" in capsys.readouterr().err


def test_cli_info_on_a_missing_file_or_a_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nonexist.mcf"
    assert main(["mcf", "info", str(missing)]) == 1
    assert f"carton: error: MCFError: {missing}: cannot open: no such file" in capsys.readouterr().err
    assert main(["mcf", "info", str(tmp_path)]) == 1
    assert f"carton: error: MCFError: {tmp_path}: cannot open: it is a directory" in capsys.readouterr().err


def test_cli_convert_output_errors(model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before = sorted(p.name for p in model_dir.iterdir())
    # The output is an existing folder (here the source itself): refused, nothing left behind in it.
    assert main(["mcf", "convert", str(model_dir), str(model_dir)]) == 1
    err = capsys.readouterr().err
    assert f"carton: error: MCFError: {model_dir}: cannot write the MCF file: it is a directory" in err
    assert "Traceback" not in err
    assert sorted(p.name for p in model_dir.iterdir()) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny-llama"]
    # A missing parent folder is refused, not created.
    out = tmp_path / "nonexist" / "out.mcf"
    assert main(["mcf", "convert", str(model_dir), str(out)]) == 1
    err = capsys.readouterr().err
    assert f"carton: error: MCFError: {out}: cannot write the MCF file: folder {out.parent} does not exist" in err
    assert not out.parent.exists()


@pytest.mark.slow
def test_transformers_checkpoint_converts(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(tmp_path / "hf", max_shard_size="20KB")
    report = convert(tmp_path / "hf", tmp_path / "hf.mcf", methods={"mlp": "q8"})
    state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    with mcf.open(report.path) as f:
        assert f.model_info is not None and f.model_info.kv["hf.tie_word_embeddings"] == 1
        np.testing.assert_array_equal(f.array("model.embed_tokens.weight"), state["model.embed_tokens.weight"])
        assert f.tensors["model.layers.0.mlp.up_proj.weight"].dtype == MCFDType.Q8
