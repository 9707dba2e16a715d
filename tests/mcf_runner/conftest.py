"""Shared tiny models for the mcf runner tests (built once per session; torch and transformers are test extras)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

pytest.importorskip(
    "torch", reason="the mcf runner tests compare against transformers (pip install 'carton-runtime[test]')"
)
pytest.importorskip("transformers", reason="the mcf runner tests compare against transformers")

from mcf_runner_models import build_llama, to_mcf

#: The base model: untied head, grouped-query attention (4 query heads over 2 kv heads), 2 layers.
BASE = {"init": 0.02}
#: Tied head, one kv head for 4 query heads, linear rope scaling x2 with a custom rope_theta, larger weights so that
#: attention is far from uniform.
TIED_LINEAR = {
    "tie": True,
    "layers": 3,
    "kv_heads": 1,
    "initializer_range": 0.1,
    "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5000.0},
    "seed": 1,
}
#: Biases on every projection and a head_dim that is not hidden / heads.
BIASED = {"attention_bias": True, "mlp_bias": True, "head_dim": 32, "kv_heads": 4, "initializer_range": 0.1, "seed": 2}


@pytest.fixture(scope="session")
def model_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("mcf-runner-models")


@pytest.fixture(scope="session")
def hf_model(model_root: Path) -> Callable[..., Path]:
    """``hf_model(name)`` -> the Hugging Face folder of ``BASE``, ``TIED_LINEAR`` or ``BIASED`` (built once)."""
    built: dict[str, Path] = {}
    variants = {"base": BASE, "tied_linear": TIED_LINEAR, "biased": BIASED}

    def get(name: str) -> Path:
        if name not in built:
            options = dict(variants[name])
            init = options.pop("init", None)
            if init is not None:
                options["initializer_range"] = init
            built[name] = build_llama(model_root / f"hf-{name}", **options)
        return built[name]

    return get


@pytest.fixture(scope="session")
def mcf_model(model_root: Path, hf_model: Callable[..., Path]) -> Callable[..., Path]:
    """``mcf_model(name, method=None)`` -> a folder holding model.mcf (converted once per name and method)."""
    converted: dict[tuple[str, str | None], Path] = {}

    def get(name: str, method: str | None = None) -> Path:
        key = (name, method)
        if key not in converted:
            converted[key] = to_mcf(hf_model(name), model_root / f"mcf-{name}-{method or 'fp32'}", method)
        return converted[key]

    return get
