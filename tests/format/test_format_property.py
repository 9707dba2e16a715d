"""Property tests: any corruption of a valid carton ends in a CartonError or a correct read, never anything else."""

from __future__ import annotations

import functools
import hashlib
import tempfile
from pathlib import Path

import carton
import numpy as np
from carton import DType, TensorSpec
from carton._format._limits import ReadLimits
from carton._format._open import _materialize
from carton._format._reader import CartonReader, ZipStore, build_info
from carton._format._source import BytesSource
from carton._format._tensor_data import INDEX_PATH, load_tensor, parse_index
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

LIMITS = ReadLimits(max_total_size=1 << 24)


@functools.cache
def valid_carton(compression: str) -> bytes:
    with tempfile.TemporaryDirectory() as root:
        folder = Path(root, "m")
        folder.mkdir()
        (folder / "w.bin").write_bytes(bytes(range(256)) * 8)
        path = carton.pack(folder, Path(root, "m.carton"), runner_name="r", required_framework_version="=1",
                           runner_compat_version=1, validate=False, compression=compression,
                           inputs=[TensorSpec(name="x", dtype=DType.INT32, shape=(2,))],
                           self_tests=[{"inputs": {"x": np.array([1, 2], np.int32)}}])  # fmt: skip
        return path.read_bytes()


def read_everything(data: bytes) -> None:
    """Everything a loader does: info, every tensor, every file verified, the model materialized."""
    with tempfile.TemporaryDirectory() as cache:
        reader = CartonReader(ZipStore(BytesSource(data), LIMITS), "<fuzz>", LIMITS, Path(cache))
        build_info(reader, read=lambda p: reader.read(p, 1 << 24))
        if INDEX_PATH in reader.manifest:
            index = parse_index(reader.read(INDEX_PATH), LIMITS.max_toml_depth)
            for name in index:
                load_tensor(index, name, lambda p: reader.read(p, 1 << 24), LIMITS.max_toml_depth)
        for path in reader.manifest:
            if path in reader.present:
                reader.verify_file(path)
        model_paths = sorted(p for p in reader.manifest if p.startswith("model/"))
        _materialize(reader, model_paths, Path(cache) / "models" / reader.model_hash)


def check(data: bytes, original: bytes) -> None:
    try:
        read_everything(data)
    except carton.CartonError:
        return
    # Reading succeeded: it must have read the same carton (MANIFEST covers every file's bytes).
    reader = CartonReader(ZipStore(BytesSource(data), LIMITS), "<fuzz>", LIMITS, Path("/nonexistent"))
    good = CartonReader(ZipStore(BytesSource(original), LIMITS), "<ok>", LIMITS, Path("/nonexistent"))
    assert reader.model_hash == good.model_hash
    for path in reader.manifest:
        assert hashlib.sha256(reader.read(path, 1 << 24)).hexdigest() == good.manifest[path]


compressions = st.sampled_from(["zstd", "deflate", "stored"])
FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FAST
@given(compressions, st.data())
def test_bit_flips(compression: str, data: st.DataObject) -> None:
    original = valid_carton(compression)
    corrupted = bytearray(original)
    for _ in range(data.draw(st.integers(1, 8))):
        position = data.draw(st.integers(0, len(corrupted) - 1))
        corrupted[position] ^= 1 << data.draw(st.integers(0, 7))
    check(bytes(corrupted), original)


@FAST
@given(compressions, st.data())
def test_truncation_and_insertion(compression: str, data: st.DataObject) -> None:
    original = valid_carton(compression)
    start = data.draw(st.integers(0, len(original)))
    end = data.draw(st.integers(start, min(len(original), start + 64)))
    inserted = data.draw(st.binary(max_size=64))
    check(original[:start] + inserted + original[end:], original)


@FAST
@given(st.binary(max_size=2048))
def test_arbitrary_bytes(blob: bytes) -> None:
    check(blob, valid_carton("stored"))
