"""Atheris harness for the MCF reader: any input must open or raise MCFError, and every accessor of an opened file
must work or raise MCFError.

    python fuzz/fuzz_mcf.py -max_total_time=120 -rss_limit_mb=4096 fuzz-corpus/mcf

The corpus directory is seeded with valid files on first run (see docs/fuzzing.md).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import atheris

with atheris.instrument_imports(include=["carton"]):
    import carton.mcf as mcf
    import numpy as np
    from carton import MCFError


def seed(corpus: Path) -> None:
    corpus.mkdir(parents=True, exist_ok=True)
    if any(corpus.iterdir()):
        return
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((2, 64)).astype(np.float32)
    files = {
        "plain": {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.arange(4, dtype=np.int8)},
        "quant": {
            "q4": mcf.quantize(weight, "q4"),
            "k3": mcf.quantize(weight, "k3"),
            "i8": mcf.quantize(weight, "int8", domain=1),
            "n": np.ones(64, np.float16),
        },
    }
    with tempfile.TemporaryDirectory() as tmp:
        for name, tensors in files.items():
            path = mcf.write_mcf(
                Path(tmp) / f"{name}.mcf",
                tensors=tensors,  # type: ignore[arg-type]
                model_info=mcf.ModelInfo(model_name=name, kv={"a": 1, "b": 2.0, "c": "x"}),
                resources={"config.json": b"{}"},
            )
            (corpus / path.name).write_bytes(path.read_bytes())


def test_one_input(data: bytes) -> None:
    try:
        f = mcf.MCFFile.from_bytes(data)
    except MCFError:
        return
    for name, entry in f.tensors.items():
        bytes(f.tensor_bytes(name))
        try:
            if entry.method is None:
                f.array(name).tobytes()
            f.dequantize(name)
        except MCFError:
            pass
    for section in mcf.SectionType:
        f.section_bytes(section)


def main() -> None:
    for directory in (a for a in sys.argv[1:] if not a.startswith("-")):
        seed(Path(directory))
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
