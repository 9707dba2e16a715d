"""Build a `LlamaModel` from an open MCF file: check ModelInfo against config.json, then wire every tensor.

Tensor names are Hugging Face's (``model.layers.0.self_attn.q_proj.weight``); shapes are checked against the config
before anything is computed, so a wrong file fails at load with the tensor's name, not inside a matmul.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from carton.mcf import (
    Architecture,
    MCFError,
    MCFFile,
    QuantMethod,
    RopeType,
    SectionType,
    UnsupportedModel,
    dequantize,
    payload_layout,
)
from numpy.typing import NDArray

from ._arena import HugePageArena
from ._config import DecoderConfig, parse_config
from ._decoder import Decoder, DecoderLayer
from ._kernels import CacheMode, QuantizedLinear
from ._llama import LlamaModel
from ._rows import row_copies
from ._shards import ShardPlan
from ._weights import BiasedLinear, Embedding, FloatEmbedding, FloatLinear, Linear, QuantizedEmbedding

__all__ = ["F32", "LoadedDecoder", "Range", "WeightSettings", "build_decoder", "load_decoder", "read_config"]

F32 = NDArray[np.float32]
Range = tuple[int, int]

_SUPPORTED_ARCHS = {Architecture.UNKNOWN: None, Architecture.LLAMA: "llama", Architecture.MISTRAL: "mistral"}


@dataclass(frozen=True, slots=True, kw_only=True)
class WeightSettings:
    """How quantized weights are held and multiplied: the `QuantizedLinear` cache and the threads of a product."""

    cache: CacheMode = "int8"
    threads: int = 1


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadedDecoder:
    model: Decoder
    config: DecoderConfig
    unknown_config_keys: tuple[str, ...]
    quantized: dict[str, str]  # tensor name -> method, for the runner's description


def _check_model_info(mcf: MCFFile, config: DecoderConfig) -> None:
    info = mcf.model_info
    if info is None:
        return
    try:
        arch = Architecture(info.arch)
    except ValueError:
        raise UnsupportedModel(f"{mcf.name}: ModelInfo arch code {int(info.arch)} is unknown") from None
    if arch not in _SUPPORTED_ARCHS:
        raise UnsupportedModel(
            f"{mcf.name}: ModelInfo arch {arch.name.lower()} is not supported by the mcf runner (supported: llama, "
            "mistral)"
        )
    expected_type = _SUPPORTED_ARCHS[arch]
    if expected_type is not None and expected_type != config.model_type:
        raise MCFError(
            f"{mcf.name}: ModelInfo arch {arch.name.lower()} disagrees with config.json model_type "
            f"{config.model_type!r}"
        )
    pairs = (
        ("vocab_size", info.vocab_size, config.vocab_size),
        ("hidden_size", info.hidden_size, config.hidden_size),
        ("layer_count", info.layer_count, config.num_layers),
        ("head_count", info.head_count, config.num_heads),
        ("kv_head_count", info.kv_head_count, config.num_kv_heads),
    )
    for field, stored, wanted in pairs:
        if stored and stored != wanted:
            raise MCFError(f"{mcf.name}: ModelInfo {field} = {stored} disagrees with config.json ({wanted})")
    rope_type = int(info.rope_type)
    if rope_type not in (RopeType.NONE, RopeType.STANDARD, RopeType.LINEAR):
        raise UnsupportedModel(f"{mcf.name}: ModelInfo rope type {rope_type} is not supported (standard or linear)")
    if info.rope_freq_base and not np.isclose(info.rope_freq_base, config.rope_theta, rtol=1e-6):
        raise MCFError(
            f"{mcf.name}: ModelInfo rope_freq_base {info.rope_freq_base} disagrees with config.json rope_theta "
            f"{config.rope_theta}"
        )
    scaled = config.rope_scaling_factor != 1.0
    if rope_type == RopeType.LINEAR and not scaled and info.rope_scale not in (0.0, 1.0):
        raise MCFError(f"{mcf.name}: ModelInfo says linear rope scaling x{info.rope_scale} but config.json has none")
    if rope_type == RopeType.LINEAR and scaled and info.rope_scale not in (0.0, config.rope_scaling_factor):
        raise MCFError(
            f"{mcf.name}: ModelInfo rope_scale {info.rope_scale} disagrees with config.json factor "
            f"{config.rope_scaling_factor}"
        )


class _Tensors:
    """Typed access to the file's tensors with the shape each must have."""

    def __init__(self, mcf: MCFFile, weights: WeightSettings) -> None:
        self._mcf = mcf
        self._cache = weights.cache
        self._threads = weights.threads
        self.quantized: dict[str, str] = {}
        self._file: io.BufferedReader | None = None
        # The packed payloads, all in one arena per model sized for every quantized tensor whole (small matrices
        # share huge pages; one chunk, so that only its last huge page is partly unused; a shard's unread rest is
        # never touched, so it is never resident).
        whole = sum(-(-entry.data_size // 64) * 64 for entry in mcf.tensors.values() if entry.method is not None)
        self._arena = HugePageArena(chunk_bytes=max(whole, 64))
        #: Whole payloads already read, by tensor name: a tied head and its embedding share one.
        self._kept: dict[str, NDArray[np.uint8]] = {}

    def _entry(self, name: str, shape: tuple[int, ...]) -> Any:
        if name not in self._mcf.tensors:
            raise MCFError(f"{self._mcf.name}: tensor {name!r} is missing")
        entry = self._mcf.tensors[name]
        if tuple(entry.shape) != shape:
            raise MCFError(f"{self._mcf.name}: tensor {name!r} has shape {list(entry.shape)}, expected {list(shape)}")
        return entry

    def _payload(self, name: str, entry: Any, rows: Range | None) -> tuple[NDArray[np.uint8], int, Range | None]:
        """The payload of a quantized matrix, read from the file (with `read`, not through the mapping, so that the
        file's pages never count in this process's resident memory). The packed cache keeps it, in the model's
        `HugePageArena` (2 MiB pages, which its products read about twice as fast as the mapping's small pages:
        docs/performance.md); the int8 and fp32 caches read it into a temporary buffer and drop it once converted.

        A shard reads only its ``rows`` when the layout allows. Returns the payload, how many rows it holds, and the
        row range still to be cut from it (None when it holds exactly ``rows``)."""
        whole = entry.shape[0]
        kept = self._kept.get(name)
        if kept is not None:  # the tied head of an embedding already read whole
            return kept, whole, rows
        plan = None
        if rows is not None and rows != (0, whole):
            layout = payload_layout(entry.method, *entry.shape, domain=entry.domain)
            plan = row_copies(layout, *rows)
        if plan is None:
            copies, size = [(0, entry.data_size, 0)], entry.data_size
        else:
            copies, size = plan[1], plan[0].size
        payload = self._arena.take(size) if self._cache == "packed" else np.zeros(size, dtype=np.uint8)
        self._read(name, entry, copies, payload)
        if plan is None or rows is None:
            if self._cache == "packed":
                self._kept[name] = payload
            return payload, whole, rows
        return payload, rows[1] - rows[0], None

    def _read(self, name: str, entry: Any, copies: list[tuple[int, int, int]], payload: NDArray[np.uint8]) -> None:
        """``(source, length, destination)`` byte ranges of tensor ``name``'s data into ``payload``."""
        if not Path(self._mcf.name).is_file():  # an MCF given as bytes: nothing is mapped, copy from memory
            data = np.frombuffer(self._mcf.tensor_bytes(name), dtype=np.uint8)
            for source, length, destination in copies:
                payload[destination : destination + length] = data[source : source + length]
            return
        if self._file is None:
            self._file = open(self._mcf.name, "rb")  # noqa: SIM115 - closed by close()
        for source, length, destination in copies:
            self._file.seek(entry.data_offset + source)
            if self._file.readinto(payload[destination : destination + length].data) != length:
                raise MCFError(f"{self._mcf.name}: tensor {name!r}: the file ended inside its data")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def _float(self, name: str, entry: Any) -> NDArray[np.floating]:
        array = self._mcf.array(name)
        if not np.issubdtype(array.dtype, np.floating) and array.dtype.name != "bfloat16":
            raise MCFError(f"{self._mcf.name}: tensor {name!r} has integer dtype {entry.dtype.name}; expected float")
        return array

    def vector(self, name: str, size: int) -> NDArray[np.float32]:
        entry = self._entry(name, (size,))
        if entry.method is not None:
            raise MCFError(f"{self._mcf.name}: tensor {name!r} is quantized ({entry.method.value}); norms stay float")
        return np.asarray(self._float(name, entry), dtype=np.float32)

    def has(self, name: str) -> bool:
        return name in self._mcf.tensors

    def linear(
        self,
        name: str,
        rows: int,
        cols: int,
        *,
        bias: str | None = None,
        row_range: Range | None = None,
        col_range: Range | None = None,
    ) -> Linear:
        """The weight ``name`` (``[rows, cols]`` in the file), or the part of it a shard holds."""
        entry = self._entry(name, (rows, cols))
        (r0, r1), (c0, c1) = row_range or (0, rows), col_range or (0, cols)
        result: Linear
        if entry.method is None:
            result = FloatLinear(self._float(name, entry)[r0:r1, c0:c1])
        else:
            self.quantized[name] = entry.method.value
            payload, payload_rows, left = self._payload(name, entry, row_range)
            try:
                linear = QuantizedLinear(
                    payload,
                    entry.method,
                    payload_rows,
                    cols,
                    domain=entry.domain,
                    cache=self._cache,
                    threads=self._threads,
                    row_range=left,
                    col_range=col_range,
                )
            except MCFError as exc:
                raise MCFError(f"{self._mcf.name}: tensor {name!r}: {exc}") from exc
            result = linear
        if bias is not None:
            result = BiasedLinear(result, self.vector(bias, rows)[r0:r1])
        return result

    def embedding(self, name: str, rows: int, cols: int) -> Embedding:
        entry = self._entry(name, (rows, cols))
        if entry.method is None:
            return FloatEmbedding(self._float(name, entry))
        method: QuantMethod = entry.method
        domain = entry.domain
        self.quantized[name] = method.value

        def decode(sub: NDArray[np.uint8], count: int) -> NDArray[np.float32]:
            return dequantize(sub, method, (count, cols), domain=domain)

        if self._cache == "packed":  # read whole once, so that a tied head reads the same copy
            payload = self._payload(name, entry, None)[0]
        else:
            payload = np.frombuffer(self._mcf.tensor_bytes(name), dtype=np.uint8)
        layout = payload_layout(method, rows, cols, domain=domain)
        try:
            return QuantizedEmbedding(payload, layout=layout, dequantize=decode)
        except ValueError as exc:
            raise UnsupportedModel(f"{self._mcf.name}: embedding {name!r}: {exc}") from exc


def read_config(mcf: MCFFile) -> tuple[DecoderConfig, list[str]]:
    """config.json (required), checked against ModelInfo; also the keys the runner does not know."""
    raw = mcf.resource(SectionType.HF_CONFIG)
    if raw is None:
        raise MCFError(
            f"{mcf.name}: no config.json section (0x0100); the mcf runner reads the model's hyper-parameters from it"
        )
    config, unknown = parse_config(raw, source=mcf.name)
    _check_model_info(mcf, config)
    return config, unknown


def load_decoder(mcf: MCFFile, *, weights: WeightSettings = WeightSettings()) -> LoadedDecoder:
    """Read config.json (required) and every tensor of a llama-family decoder from ``mcf``."""
    config, unknown = read_config(mcf)
    return build_decoder(mcf, config, unknown, weights=weights)


def build_decoder(
    mcf: MCFFile,
    config: DecoderConfig,
    unknown: list[str],
    *,
    weights: WeightSettings = WeightSettings(),
    shard: ShardPlan | None = None,
    reduce: Callable[[F32], F32] | None = None,
) -> LoadedDecoder:
    """The whole decoder, or with ``shard`` the part of every weight that shard holds (``reduce`` adds up the
    shards' partial sums)."""
    tensors = _Tensors(mcf, weights)
    try:
        model = _build(mcf, config, tensors, shard, reduce)
    finally:
        tensors.close()
    return LoadedDecoder(
        model=model, config=config, unknown_config_keys=tuple(unknown), quantized=dict(tensors.quantized)
    )


def _build(
    mcf: MCFFile,
    config: DecoderConfig,
    tensors: _Tensors,
    shard: ShardPlan | None,
    reduce: Callable[[F32], F32] | None,
) -> LlamaModel:
    h, q_out, kv_out = config.hidden_size, config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    inter = config.intermediate_size
    attn_bias = config.attention_bias
    mlp_bias = config.mlp_bias
    # What this process holds: query/kv rows of its kv heads (o: those columns), MLP rows, head rows.
    group_width = config.num_heads // config.num_kv_heads * config.head_dim
    k0, k1 = shard.kv_heads if shard else (0, config.num_kv_heads)
    q_rows = (k0 * group_width, k1 * group_width)
    kv_rows = (k0 * config.head_dim, k1 * config.head_dim)
    mlp_rows = shard.mlp_rows if shard else (0, inter)
    vocab_rows = shard.vocab_rows if shard else (0, config.vocab_size)

    def bias(name: str, enabled: bool) -> str | None:
        return name.replace(".weight", ".bias") if enabled else None

    def summed_bias(name: str, enabled: bool) -> F32 | None:
        # A column-split projection's bias is added once, after the partial sums are added up.
        return tensors.vector(name.replace(".weight", ".bias"), h) if enabled and shard else None

    def summed(name: str, cols: int, col_range: Range, enabled: bool) -> Linear:
        if shard:
            return tensors.linear(name, h, cols, col_range=col_range)
        return tensors.linear(name, h, cols, bias=bias(name, enabled))

    layers = []
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        q, k, v, o = (f"{p}self_attn.{x}_proj.weight" for x in "qkvo")
        gate, up, down = (f"{p}mlp.{x}_proj.weight" for x in ("gate", "up", "down"))
        layers.append(
            DecoderLayer(
                input_norm=tensors.vector(f"{p}input_layernorm.weight", h),
                q_proj=tensors.linear(q, q_out, h, bias=bias(q, attn_bias), row_range=q_rows),
                k_proj=tensors.linear(k, kv_out, h, bias=bias(k, attn_bias), row_range=kv_rows),
                v_proj=tensors.linear(v, kv_out, h, bias=bias(v, attn_bias), row_range=kv_rows),
                o_proj=summed(o, q_out, q_rows, attn_bias),
                post_attention_norm=tensors.vector(f"{p}post_attention_layernorm.weight", h),
                gate_proj=tensors.linear(gate, inter, h, bias=bias(gate, mlp_bias), row_range=mlp_rows),
                up_proj=tensors.linear(up, inter, h, bias=bias(up, mlp_bias), row_range=mlp_rows),
                down_proj=summed(down, inter, mlp_rows, mlp_bias),
                o_bias=summed_bias(o, attn_bias),
                down_bias=summed_bias(down, mlp_bias),
            )
        )
    embed_name = "model.embed_tokens.weight"
    embedding = tensors.embedding(embed_name, config.vocab_size, h)
    if config.tie_word_embeddings:
        head = tensors.linear(embed_name, config.vocab_size, h, row_range=vocab_rows)
    elif tensors.has("lm_head.weight"):
        head = tensors.linear("lm_head.weight", config.vocab_size, h, row_range=vocab_rows)
    else:
        raise MCFError(f"{mcf.name}: tensor 'lm_head.weight' is missing and config.json does not tie the embeddings")
    options = {} if reduce is None else {"reduce": reduce}
    return LlamaModel(
        config,
        embedding=embedding,
        layers=layers,
        final_norm=tensors.vector("model.norm.weight", h),
        lm_head=head,
        kv_heads=k1 - k0,
        **options,
    )
