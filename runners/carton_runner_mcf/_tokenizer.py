"""Text in, text out, when the MCF carries ``tokenizer.json`` and the ``tokenizers`` package is installed.

The ``tokenizers`` import happens only when a tokenizer section exists, so models without one (or machines without
the package) run on token ids alone.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
from numpy.typing import NDArray

from carton.errors import MCFError

__all__ = ["TextCodec", "load_codec"]


class TextCodec:
    """Encodes prompts to padded id batches and decodes generated ids back to text."""

    def __init__(self, tokenizer: Any, *, add_special_tokens: bool, pad_token_id: int) -> None:
        self._tokenizer = tokenizer
        self._add_special_tokens = add_special_tokens
        self._pad_token_id = pad_token_id

    def encode(self, prompts: list[str]) -> tuple[NDArray[np.int64], NDArray[np.bool_]]:
        """Left-padded ``input_ids`` and the mask of real tokens, ``[len(prompts), longest]`` each."""
        encodings = self._tokenizer.encode_batch(prompts, add_special_tokens=self._add_special_tokens)
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


def _add_bos(tokenizer_config: bytes | None) -> bool | None:
    if tokenizer_config is None:
        return None
    try:
        parsed = json.loads(tokenizer_config)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    value = parsed.get("add_bos_token") if isinstance(parsed, dict) else None
    return value if isinstance(value, bool) else None


def load_codec(
    tokenizer_json: bytes, tokenizer_config: bytes | None, *, source: str, pad_token_id: int
) -> TextCodec:
    """Build a codec from the raw ``tokenizer.json`` (and optional ``tokenizer_config.json``) sections."""
    try:
        from tokenizers import Tokenizer
    except ImportError as exc:
        raise MCFError(
            f"{source} carries tokenizer.json but the 'tokenizers' package is not installed "
            "(pip install 'carton[mcf]'); string prompts need it"
        ) from exc
    try:
        tokenizer = Tokenizer.from_str(tokenizer_json.decode("utf-8"))
    except (UnicodeDecodeError, Exception) as exc:
        raise MCFError(f"{source}: the tokenizer.json section does not load: {exc}") from exc
    # tokenizer.json's post-processor decides about BOS; tokenizer_config.json may only switch it off.
    add_special = _add_bos(tokenizer_config) is not False
    return TextCodec(tokenizer, add_special_tokens=add_special, pad_token_id=pad_token_id)
