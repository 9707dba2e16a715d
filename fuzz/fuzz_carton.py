"""Atheris harness for the carton reader: any input must end in a CartonError or a successful read.

Run (atheris is in the `fuzz` extra: ``pip install -e ".[fuzz]"``):

    python fuzz/fuzz_carton.py -max_total_time=120 -max_len=65536 -rss_limit_mb=4096 fuzz-corpus/carton

The corpus directory (default ``carton-fuzz/carton`` in the temporary folder) is kept between runs, as a corpus
should be; when it is missing or empty it is seeded with the fixture cartons of tests/fixtures/format (libFuzzer
writes new inputs into its first corpus directory; the fixtures stay untouched). Extracted model folders go to one
scratch cache, ``<corpus>.cache``, emptied after every input and at start-up, so a run leaves no temporary folders
behind.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

import atheris

with atheris.instrument_imports(include=["carton"]):
    from carton._format._limits import ReadLimits
    from carton._format._open import _materialize
    from carton._format._reader import CartonReader, ZipStore, build_info
    from carton._format._source import BytesSource
    from carton._format._tensor_data import INDEX_PATH, load_tensor, parse_index
    from carton.errors import CartonError

LIMITS = ReadLimits(max_total_size=1 << 26, max_metadata_size=1 << 22)
DEFAULT_CORPUS = Path(tempfile.gettempdir()) / "carton-fuzz" / "carton"
CACHE = DEFAULT_CORPUS.with_name("carton.cache")  # replaced in main() to sit next to the corpus given


def test_one_input(data: bytes) -> None:
    try:
        reader = CartonReader(ZipStore(BytesSource(data), LIMITS), "<fuzz>", LIMITS, CACHE)
        build_info(reader, read=lambda p: reader.read(p, 1 << 26))
        if INDEX_PATH in reader.manifest:
            index = parse_index(reader.read(INDEX_PATH), LIMITS.max_toml_depth)
            for name in index:
                load_tensor(index, name, lambda p: reader.read(p, 1 << 26), LIMITS.max_toml_depth)
        paths = sorted(p for p in reader.manifest if p.startswith("model/") and p in reader.present)
        if len(paths) == len([p for p in reader.manifest if p.startswith("model/")]):
            _materialize(reader, paths, CACHE / "models" / reader.model_hash)
    except CartonError:
        return
    finally:
        shutil.rmtree(CACHE / "models", ignore_errors=True)


def main() -> None:
    global CACHE
    seeds = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "format"
    args = list(sys.argv)
    corpora = [a for a in args[1:] if not a.startswith("-")]
    if not corpora:
        args.append(str(DEFAULT_CORPUS))
        corpora = [str(DEFAULT_CORPUS)]
    corpus = Path(corpora[0])
    corpus.mkdir(parents=True, exist_ok=True)
    if not any(corpus.iterdir()):
        for seed in seeds.glob("*.carton"):
            shutil.copyfile(seed, corpus / seed.name)
    CACHE = corpus.with_name(f"{corpus.name}.cache")
    shutil.rmtree(CACHE, ignore_errors=True)
    atheris.Setup(args, test_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
