"""Text in, text out, when the MCF carries ``tokenizer.json`` and the ``tokenizers`` package is installed.

The ``tokenizers`` import happens only when a tokenizer section exists, so models without one (or machines without
the package) run on token ids alone.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
from carton.mcf import MCFError
from numpy.typing import NDArray

__all__ = ["TextCodec", "load_codec"]


class TextCodec:
    """Encodes prompts to padded id batches and decodes generated ids back to text.

    With a chat template, each prompt is first rendered as one user message followed by the assistant's turn.
    """

    def __init__(
        self, tokenizer: Any, *, add_special_tokens: bool, pad_token_id: int, chat_template: Any = None
    ) -> None:
        self._tokenizer = tokenizer
        self._add_special_tokens = add_special_tokens
        self._pad_token_id = pad_token_id
        self._chat_template = chat_template

    def render(self, prompt: str) -> str:
        if self._chat_template is None:
            return prompt
        try:
            return str(
                self._chat_template.render(messages=[{"role": "user", "content": prompt}], add_generation_prompt=True)
            )
        except Exception as exc:  # a template error is the model's fault: report it as such
            raise MCFError(f"the chat_template of tokenizer_config.json failed: {exc}") from exc

    def encode(self, prompts: list[str]) -> tuple[NDArray[np.int64], NDArray[np.bool_]]:
        """Left-padded ``input_ids`` and the mask of real tokens, ``[len(prompts), longest]`` each."""
        rendered = [self.render(prompt) for prompt in prompts]
        # A chat template already writes every special token the model expects.
        add_special = self._add_special_tokens and self._chat_template is None
        encodings = self._tokenizer.encode_batch(rendered, add_special_tokens=add_special)
        longest = max((len(e.ids) for e in encodings), default=0)
        ids = np.full((len(prompts), longest), self._pad_token_id, dtype=np.int64)
        mask = np.zeros((len(prompts), longest), dtype=bool)
        for row, encoding in enumerate(encodings):
            if not encoding.ids:
                raise ValueError(f"prompt {row} encodes to no tokens; give a non-empty prompt")
            ids[row, longest - len(encoding.ids) :] = encoding.ids
            mask[row, longest - len(encoding.ids) :] = True
        return ids, mask

    def decode(self, ids: NDArray[np.int64], *, stop_ids: tuple[int, ...]) -> list[str]:
        texts = []
        for row in ids:
            tokens = [int(t) for t in row]
            for position, token in enumerate(tokens):
                if token in stop_ids:
                    tokens = tokens[:position]
                    break
            texts.append(self._tokenizer.decode(tokens, skip_special_tokens=True))
        return texts


def _tokenizer_config(raw: bytes | None, source: str) -> dict[str, Any]:
    if raw is None:
        return {}
    try:
        parsed = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise MCFError(f"{source}: the tokenizer_config.json section is not valid JSON: {exc}") from exc
    return parsed if isinstance(parsed, dict) else {}


def _compile_chat_template(template: object, special: dict[str, Any], source: str) -> Any:
    """A chat template compiled in jinja2's immutable sandbox (templates come with untrusted models)."""
    if not isinstance(template, str) or not template:
        raise MCFError(f"{source}: runner option chat needs a chat_template in tokenizer_config.json")
    try:
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as exc:
        raise MCFError("runner option chat needs the 'jinja2' package (pip install 'carton-runtime[mcf]')") from exc

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    environment.globals["raise_exception"] = raise_exception
    try:
        return environment.from_string(template, globals=special)
    except TemplateError as exc:
        raise MCFError(f"{source}: the chat_template of tokenizer_config.json does not compile: {exc}") from exc


def load_codec(
    tokenizer_json: bytes,
    tokenizer_config: bytes | None,
    *,
    source: str,
    pad_token_id: int,
    chat: bool = False,
) -> TextCodec:
    """Build a codec from the raw ``tokenizer.json`` (and optional ``tokenizer_config.json``) sections."""
    try:
        from tokenizers import Tokenizer
    except ImportError as exc:
        raise MCFError(
            f"{source} carries tokenizer.json but the 'tokenizers' package is not installed "
            "(pip install 'carton-runtime[mcf]'); string prompts need it"
        ) from exc
    try:
        tokenizer = Tokenizer.from_str(tokenizer_json.decode("utf-8"))
    except Exception as exc:
        raise MCFError(f"{source}: the tokenizer.json section does not load: {exc}") from exc
    config = _tokenizer_config(tokenizer_config, source)
    special = {key: config[key] for key in ("bos_token", "eos_token", "pad_token") if isinstance(config.get(key), str)}
    template = _compile_chat_template(config.get("chat_template"), special, source) if chat else None
    # tokenizer.json's post-processor decides about BOS; tokenizer_config.json may only switch it off.
    add_special = config.get("add_bos_token") is not False
    return TextCodec(tokenizer, add_special_tokens=add_special, pad_token_id=pad_token_id, chat_template=template)
