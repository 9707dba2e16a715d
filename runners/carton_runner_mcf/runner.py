"""`MCFRunner`: serves a llama-family decoder stored as ``model/*.mcf`` (see docs/mcf-runner.md)."""

from __future__ import annotations

import ctypes
import json
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np
from carton.mcf import MCFError, MCFFile, SectionType
from carton_protocol import (
    InvalidInput,
    InvalidModel,
    LoadContext,
    PackContext,
    PackResult,
    Runner,
    Tensor,
    TensorSpec,
)

from ._blas import limit_blas_threads
from ._decoder import positions_from_mask
from ._generate import SamplingParams, generate
from ._interface import (
    INPUT_DTYPES,
    OUTPUT_DTYPES,
    Mode,
    RunnerOptions,
    check_declared_mode,
    check_positions,
    check_room_for_a_prompt,
    default_specs,
    ids_and_mask,
    parse_options,
    scalar_float,
    scalar_int,
)
from ._kernels import default_cache
from ._llama import LlamaModel
from ._loader import LoadedDecoder, WeightSettings, build_decoder, load_decoder, read_config
from ._sharded import ShardedModel, start_sharded
from ._shards import ShardPlan, check_processes_supported, plan_shards
from ._tokenizer import TextCodec, load_codec

__all__ = ["MCFRunner", "find_model_file"]


def find_model_file(model_dir: Path, model_file: str | None) -> Path:
    """The one ``*.mcf`` file of the model folder, or the one the ``model_file`` option names (inside it)."""
    if model_file is not None:
        path = (model_dir / model_file).resolve()
        if not path.is_relative_to(model_dir.resolve()) or not path.is_file():
            raise MCFError(f"runner option model_file={model_file!r} is not a file inside the model folder")
        return path
    found = sorted(model_dir.glob("*.mcf"))
    if len(found) != 1:
        names = ", ".join(p.name for p in found) or "none"
        raise MCFError(f"the model folder needs exactly one *.mcf file (found: {names}); set runner option model_file")
    return found[0]


def _generation_ids(mcf: MCFFile, loaded: LoadedDecoder) -> tuple[tuple[int, ...], int]:
    """End-of-sequence ids and the pad id: generation_config.json first, then config.json."""
    eos, pad = loaded.config.eos_token_ids, loaded.config.pad_token_id
    raw = mcf.resource(SectionType.HF_GENERATION_CONFIG)
    if raw is not None:
        try:
            generation = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise MCFError(f"{mcf.name}: the generation_config.json section is not valid JSON: {exc}") from exc
        value = generation.get("eos_token_id") if isinstance(generation, dict) else None
        if isinstance(value, int) and not isinstance(value, bool):
            eos = (value,)
        elif isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            eos = tuple(value)
        pad_value = generation.get("pad_token_id") if isinstance(generation, dict) else None
        if isinstance(pad_value, int) and not isinstance(pad_value, bool):
            pad = pad_value
    if pad is None:
        pad = eos[0] if eos else 0
    return eos, pad


def _return_freed_memory() -> None:
    """Give the heap's free memory back to the system once the weights are built: loading makes a temporary per
    matrix, and glibc keeps freed ones in the heap. A lower mmap threshold would do it too, but costs prefill a fresh
    page-faulted block for every large activation (both measured in docs/performance.md, "MCF runner"). Elsewhere
    (musl, macOS) there is nothing to do."""
    try:
        malloc_trim = ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError):
        return
    malloc_trim(0)


def _weight_settings(options: RunnerOptions) -> WeightSettings:
    """The weight cache (``auto``: packed with the compiled kernels, else int8) and threads per product."""
    cache = default_cache() if options.weight_cache == "auto" else options.weight_cache
    return WeightSettings(cache=cache, threads=options.threads)


class MCFRunner(Runner):
    """Loads the MCF once (memory-mapped), then answers ``logits`` or ``generate`` requests."""

    def load(self, context: LoadContext) -> None:
        self._options, unknown = parse_options(context.opts)
        if unknown:
            context.warn(f"mcf runner: unknown runner options ignored: {', '.join(sorted(unknown))}")
        check_declared_mode(self._options.mode, context.inputs, context.outputs)
        path = find_model_file(context.model_dir, self._options.model_file)
        check_processes_supported(self._options.processes)
        if "threads" in context.opts:  # before `processes` forks helpers, which inherit BLAS's setting
            blas_warning = limit_blas_threads(self._options.threads)
            if blas_warning is not None:
                context.warn(blas_warning)
        self._mcf = MCFFile.open(path)
        try:
            self._loaded = self._load_decoder()
            if self._loaded.unknown_config_keys:
                keys = ", ".join(self._loaded.unknown_config_keys)
                context.warn(f"mcf runner: {path.name}: config.json keys not known to the runner, ignored: {keys}")
            self._eos, self._pad = _generation_ids(self._mcf, self._loaded)
            self._load_codec(context)
        except BaseException:
            self.close()  # the helper processes too, when there are some
            raise
        self._declared = {spec.name for spec in context.outputs}

    def _load_codec(self, context: LoadContext) -> None:
        path = Path(self._mcf.name)
        self._codec: TextCodec | None = None
        self._codec_error: MCFError | InvalidInput | None = None
        tokenizer_json = self._mcf.resource(SectionType.HF_TOKENIZER)
        # A tokenizer costs tens of MB (SmolLM2's: 45); an interface declared without prompt and text never uses it.
        declared = {spec.name for spec in (*context.inputs, *context.outputs)}
        takes_text = self._options.chat or not declared or bool(declared & {"prompt", "text"})
        if tokenizer_json is not None and not takes_text:
            self._codec_error = InvalidInput(
                "this model's declared interface takes input_ids, not a prompt", tensor="prompt"
            )
        elif tokenizer_json is not None:
            try:
                self._codec = load_codec(
                    tokenizer_json,
                    self._mcf.resource(SectionType.HF_TOKENIZER_CONFIG),
                    source=self._mcf.name,
                    pad_token_id=self._pad,
                    chat=self._options.chat,
                )
            except MCFError as exc:  # only string prompts need it; token ids still work
                if self._options.chat:
                    raise
                self._codec_error = exc
                context.warn(str(exc))
        elif self._options.chat:
            raise MCFError(f"{path.name}: runner option chat needs a tokenizer.json section")

    def _load_decoder(self) -> LoadedDecoder:
        options, mcf = self._options, self._mcf
        config, unknown = read_config(mcf)
        check_room_for_a_prompt(options, config.max_position_embeddings)
        weights = _weight_settings(options)
        if options.processes == 1:
            whole = build_decoder(mcf, config, unknown, weights=weights)
            _return_freed_memory()
            return whole
        # Helpers are forked before any weight exists (and before the tokenizer loads), so each holds only its part.
        plans = plan_shards(config, options.processes)
        loaded: list[LoadedDecoder] = []

        def build_shard(plan: ShardPlan, reduce: Callable[[np.ndarray], np.ndarray]) -> LlamaModel:
            shard = build_decoder(mcf, config, unknown, weights=weights, shard=plan, reduce=reduce)
            loaded.append(shard)
            _return_freed_memory()
            assert isinstance(shard.model, LlamaModel)
            return shard.model

        model = start_sharded(plans, config, build_shard)
        return LoadedDecoder(
            model=model, config=config, unknown_config_keys=tuple(unknown), quantized=loaded[0].quantized
        )

    def infer(self, inputs: Mapping[str, Tensor]) -> Mapping[str, Tensor]:
        mode = self._options.mode
        unexpected = sorted(set(inputs) - set(INPUT_DTYPES[mode]))
        if unexpected:
            raise InvalidInput(
                f"mcf runner in {mode} mode does not take input(s) {', '.join(unexpected)}", tensor=unexpected[0]
            )
        if mode is Mode.LOGITS:
            return {"logits": self._logits(inputs)}
        return self._generate(inputs)

    def _logits(self, inputs: Mapping[str, Tensor]) -> np.ndarray:
        model = self._loaded.model
        ids, mask = ids_and_mask(inputs, model.config.vocab_size)
        check_positions(ids.shape[1], None, model.config.max_position_embeddings, "input_ids")
        cache = model.new_cache(ids.shape[0], ids.shape[1])
        hidden = model.prefill(ids, positions_from_mask(mask), mask, cache)
        return model.logits(hidden)

    def _params(self, inputs: Mapping[str, Tensor]) -> SamplingParams:
        opts: RunnerOptions = self._options
        try:
            return SamplingParams(
                max_new_tokens=scalar_int(inputs, "max_new_tokens", opts.max_new_tokens) or 0,
                temperature=scalar_float(inputs, "temperature", opts.temperature),
                top_k=scalar_int(inputs, "top_k", opts.top_k) or 0,
                top_p=scalar_float(inputs, "top_p", opts.top_p),
                seed=scalar_int(inputs, "seed", opts.seed),
                eos_token_ids=self._eos,
                pad_token_id=self._pad,
                stop_at_eos=opts.stop_at_eos,
            )
        except ValueError as exc:
            raise InvalidInput(f"mcf runner: {exc}") from exc

    def _generate(self, inputs: Mapping[str, Tensor]) -> dict[str, Tensor]:
        prompt = inputs.get("prompt")
        prompt_shape: tuple[int, ...] | None = None
        if prompt is not None:
            if "input_ids" in inputs:
                raise InvalidInput("give either 'prompt' or 'input_ids', not both")
            if self._codec is None:
                raise self._codec_error or InvalidInput(
                    f"{self._mcf.name} has no tokenizer.json; send input_ids", tensor="prompt"
                )
            if isinstance(prompt, list) or prompt.dtype.kind not in "UO" or prompt.size == 0:
                raise InvalidInput("input 'prompt' must be a non-empty string tensor", tensor="prompt")
            prompt_shape = prompt.shape
            try:
                ids, mask = self._codec.encode([str(p) for p in prompt.reshape(-1)])
            except ValueError as exc:
                raise InvalidInput(f"input 'prompt': {exc}", tensor="prompt") from exc
            ids, mask = ids_and_mask({"input_ids": ids, "attention_mask": mask.astype(np.int64)}, self._vocab)
        else:
            ids, mask = ids_and_mask(inputs, self._vocab)
        params = self._params(inputs)
        source = "prompt" if prompt is not None else "input_ids"
        check_positions(ids.shape[1], params.max_new_tokens, self._loaded.config.max_position_embeddings, source)
        output_ids = generate(self._loaded.model, ids, mask, params)
        outputs: dict[str, Tensor] = {"output_ids": output_ids}
        wants_text = "text" in self._declared or (not self._declared and prompt is not None)
        if wants_text:
            if self._codec is None:
                raise self._codec_error or MCFError(f"{self._mcf.name} has no tokenizer.json; 'text' needs one")
            texts = self._codec.decode(output_ids, stop_ids=self._eos)
            outputs["text"] = np.array(texts, dtype=str).reshape(prompt_shape if prompt_shape is not None else -1)
        if self._declared:
            outputs = {name: value for name, value in outputs.items() if name in self._declared}
        return outputs

    @property
    def _vocab(self) -> int:
        return self._loaded.config.vocab_size

    def close(self) -> None:
        loaded = getattr(self, "_loaded", None)
        if loaded is not None and isinstance(loaded.model, ShardedModel):
            loaded.model.close()
        mcf = getattr(self, "_mcf", None)
        if mcf is not None:
            mcf.close()

    @classmethod
    def pack(cls, context: PackContext) -> PackResult:
        options, unknown = parse_options(context.opts)
        if unknown:
            context.warn(f"mcf runner: unknown runner options ignored: {', '.join(sorted(unknown))}")
        path = find_model_file(context.model_dir, options.model_file)
        with MCFFile.open(path) as mcf:
            # Building the decoder checks config.json, ModelInfo and every tensor's presence, shape and payload.
            config = load_decoder(mcf, weights=WeightSettings(cache="packed")).config
            check_room_for_a_prompt(options, config.max_position_embeddings)
            vocab = config.vocab_size
            has_tokenizer = mcf.resource(SectionType.HF_TOKENIZER) is not None
        inputs, outputs = default_specs(options.mode, vocab_size=vocab, has_tokenizer=has_tokenizer)
        _check_declared(context.inputs, INPUT_DTYPES[options.mode], "input", options.mode)
        _check_declared(context.outputs, OUTPUT_DTYPES[options.mode], "output", options.mode)
        declared = {spec.name for spec in (*context.inputs, *context.outputs)}
        if not has_tokenizer and declared & {"prompt", "text"}:
            raise InvalidModel(f"{path.name} has no tokenizer.json section, so 'prompt' and 'text' cannot be served")
        return PackResult(
            inputs=context.inputs or inputs,
            outputs=context.outputs or outputs,
            opts=dict(context.opts),
        )


def _check_declared(specs: tuple[TensorSpec, ...], allowed: Mapping[str, object], kind: str, mode: Mode) -> None:
    for spec in specs:
        if spec.name not in allowed:
            names = ", ".join(allowed)
            raise InvalidModel(
                f"declared {kind} {spec.name!r} is not served by the mcf runner in {mode} mode ({names})"
            )
        if spec.dtype != allowed[spec.name]:
            raise InvalidModel(f"declared {kind} {spec.name!r} must have dtype {allowed[spec.name]}, not {spec.dtype}")
