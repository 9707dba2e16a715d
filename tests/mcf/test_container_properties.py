"""Property tests for the MCF container: write-then-read round trips, and corruption of a valid file always ends in
`MCFError` or a correct read, never another exception."""

from __future__ import annotations

import tempfile
from pathlib import Path

import carton.mcf as mcf
import ml_dtypes
import numpy as np
from carton import MCFError
from carton.mcf import ModelInfo
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hs
from hypothesis.extra import numpy as hnp

DTYPES = [
    np.float32,
    np.float16,
    np.float64,
    np.int8,
    np.uint8,
    np.int16,
    np.uint16,
    np.int32,
    np.uint32,
    np.int64,
    np.uint64,
    ml_dtypes.bfloat16,
]
names = hs.text(hs.characters(exclude_characters="\x00", exclude_categories=["Cs"]), min_size=1, max_size=10)
kv_values = hs.one_of(
    hs.integers(0, 2**32 - 1),
    hs.floats(width=32, allow_nan=False, allow_infinity=False),
    hs.text(hs.characters(exclude_categories=["Cs"]), max_size=8),
)


@hs.composite
def plain_arrays(draw: hs.DrawFn) -> np.ndarray:
    dtype = np.dtype(draw(hs.sampled_from(DTYPES)))  # type: ignore[call-overload]
    shape = draw(hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4))
    size = int(np.prod(shape)) * dtype.itemsize
    raw = draw(hs.binary(min_size=size, max_size=size))
    return np.frombuffer(raw, dtype=np.uint8).view(dtype).reshape(shape) if size else np.zeros(shape, dtype)


@hs.composite
def quantized(draw: hs.DrawFn) -> tuple[object, ...]:
    method = draw(hs.sampled_from(["q8", "q4", "k6", "k4", "k3", "k2", "int8", "int4"]))
    rows, cols = draw(hs.integers(1, 3)), draw(hs.integers(1, 300))
    size = mcf.payload_size(method, rows, cols)
    return (method, draw(hs.binary(min_size=size, max_size=size)), (rows, cols), -1.0, 1.0)


model_infos = hs.builds(
    ModelInfo,
    arch=hs.integers(0, 2**32 - 1),
    vocab_size=hs.integers(0, 2**32 - 1),
    rope_freq_base=hs.floats(width=32, allow_nan=False, allow_infinity=False),
    model_name=hs.text(hs.characters(exclude_categories=["Cs"]), max_size=10),
    kv=hs.dictionaries(names, kv_values, max_size=4),
)


@given(hs.dictionaries(names, hs.one_of(plain_arrays(), quantized()), max_size=6), model_infos, hs.booleans())
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_round_trip(tensors: dict[str, object], info: ModelInfo, dedup: bool) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = mcf.write_mcf(Path(tmp) / "p.mcf", tensors=tensors, model_info=info, dedup=dedup)  # type: ignore[arg-type]
        with mcf.open(path) as f:
            assert f.model_info == info
            assert list(f.tensors) == sorted(tensors, key=lambda n: n.encode())
            for name, value in tensors.items():
                if isinstance(value, np.ndarray):
                    assert f.array(name).tobytes() == np.ascontiguousarray(value).tobytes()
                    assert f.array(name).shape == value.shape
                else:
                    assert bytes(f.tensor_bytes(name)) == value[1]  # type: ignore[index]
                    assert f.tensors[name].shape == value[2]  # type: ignore[index]


def _valid() -> bytes:
    rng = np.random.default_rng(3)
    with tempfile.TemporaryDirectory() as tmp:
        path = mcf.write_mcf(
            Path(tmp) / "v.mcf",
            tensors={
                "emb": rng.standard_normal((4, 8)).astype(np.float16),
                "w": mcf.quantize(rng.standard_normal((2, 64)).astype(np.float32), "k4"),
                "q": mcf.quantize(rng.standard_normal((2, 40)).astype(np.float32), "q4"),
                "i": mcf.quantize(rng.standard_normal((2, 5)).astype(np.float32), "int4", domain=1),
            },
            model_info=ModelInfo(model_name="p", kv={"a": 1, "b": "x"}),
            resources={"config.json": b"{}"},
        )
        return path.read_bytes()


VALID = _valid()


def _read_all(data: bytes) -> None:
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
    f.resource("config.json")


@given(hs.lists(hs.tuples(hs.integers(0, len(VALID) - 1), hs.integers(0, 255)), min_size=1, max_size=8))
@settings(max_examples=500, deadline=None)
def test_byte_corruption_is_a_typed_error_or_a_valid_read(flips: list[tuple[int, int]]) -> None:
    data = bytearray(VALID)
    for position, value in flips:
        data[position] = value
    _read_all(bytes(data))


@given(hs.integers(0, len(VALID)), hs.binary(max_size=24), hs.integers(0, 24))
@settings(max_examples=200, deadline=None)
def test_insertions_and_deletions_are_typed_errors(position: int, inserted: bytes, deleted: int) -> None:
    _read_all(VALID[:position] + inserted + VALID[position + deleted :])


@given(hs.binary(max_size=300))
@settings(max_examples=200, deadline=None)
def test_random_bytes_are_typed_errors(data: bytes) -> None:
    _read_all(b"MCF\x00" + data)
