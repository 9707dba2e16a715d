"""Atheris harness for the safetensors reader: any input must load or raise SafetensorsError, nothing else.

    python fuzz/fuzz_safetensors.py -max_total_time=120 -rss_limit_mb=4096 fuzz-corpus/safetensors

The corpus directory is seeded with valid files on first run (see docs/fuzzing.md).
"""

from __future__ import annotations

import sys
from pathlib import Path

import atheris

with atheris.instrument_imports(include=["carton"]):
    import carton.safetensors as st
    import ml_dtypes
    import numpy as np
    from carton import SafetensorsError


def seed(corpus: Path) -> None:
    corpus.mkdir(parents=True, exist_ok=True)
    if any(corpus.iterdir()):
        return
    samples = {
        "mixed": {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.arange(3, dtype=np.int64)},
        "empty": {},
        "zero": {"z": np.zeros((0, 3), np.float16), "s": np.array(1.0)},
        "ml": {"bf": np.ones(4, ml_dtypes.bfloat16), "f4": np.zeros(4, ml_dtypes.float4_e2m1fn)},
    }
    for name, tensors in samples.items():
        (corpus / f"{name}.safetensors").write_bytes(st.save(tensors, metadata={"k": "v"}))


def test_one_input(data: bytes) -> None:
    try:
        tensors = st.load(data)
    except SafetensorsError:
        return
    for value in tensors.values():
        value.tobytes()
    with st.SafeOpen(data, name="<fuzz>") as f:
        for name in f.offset_keys():
            sliced = f.get_slice(name)
            if sliced.ndim:
                sliced[0:1]


def main() -> None:
    corpus = [a for a in sys.argv[1:] if not a.startswith("-")]
    for directory in corpus:
        seed(Path(directory))
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
