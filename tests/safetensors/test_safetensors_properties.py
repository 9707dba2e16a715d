"""Property tests: any tensors round-trip (and match the reference's bytes); any corruption of a valid file ends in
`SafetensorsError` or a correct read, never another exception."""

from __future__ import annotations

import carton.safetensors as st
import ml_dtypes
import numpy as np
import safetensors.numpy as ref
from carton import SafetensorsError
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as hs
from hypothesis.extra import numpy as hnp

REF_DTYPES = [
    np.bool_,
    np.uint8,
    np.int8,
    np.int16,
    np.uint16,
    np.float16,
    np.int32,
    np.uint32,
    np.float32,
    np.float64,
    np.int64,
    np.uint64,
    np.complex64,
]
ALL_DTYPES = [*REF_DTYPES, ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2]

names = hs.text(hs.characters(exclude_characters="\x00", exclude_categories=["Cs"]), max_size=12).filter(
    lambda n: n != "__metadata__"
)
shapes = hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=5)


@hs.composite
def arrays(draw: hs.DrawFn, dtypes: list[object]) -> np.ndarray:
    dtype = np.dtype(draw(hs.sampled_from(dtypes)))  # type: ignore[call-overload]
    shape = draw(shapes)
    raw = draw(hs.binary(min_size=int(np.prod(shape)) * dtype.itemsize, max_size=int(np.prod(shape)) * dtype.itemsize))
    return np.frombuffer(raw, dtype=np.uint8).view(dtype).reshape(shape) if raw else np.zeros(shape, dtype)


metadata = hs.one_of(
    hs.none(), hs.dictionaries(names, hs.text(hs.characters(exclude_categories=["Cs"]), max_size=8), max_size=1)
)


@given(hs.dictionaries(names, arrays(REF_DTYPES), max_size=6), metadata)
@settings(max_examples=150, deadline=None)
def test_bytes_match_reference_and_round_trip(tensors: dict[str, np.ndarray], meta: dict[str, str] | None) -> None:
    data = st.save(tensors, metadata=meta)
    # The reference writes the invalid header '{},"__metadata__":{}}' for no tensors and empty metadata; we do not.
    assume(tensors or meta != {})
    assert data == ref.save(tensors, metadata=meta)
    loaded = st.load(data)
    assert set(loaded) == set(tensors)
    for name, value in tensors.items():
        assert loaded[name].dtype == value.dtype and loaded[name].tobytes() == value.tobytes()


@given(hs.dictionaries(names, arrays(ALL_DTYPES), max_size=6))
@settings(max_examples=100, deadline=None)
def test_all_dtypes_round_trip(tensors: dict[str, np.ndarray]) -> None:
    loaded = st.load(st.save(tensors))
    for name, value in tensors.items():
        assert loaded[name].shape == value.shape and loaded[name].tobytes() == value.tobytes()


VALID = st.save(
    {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.arange(3, dtype=np.int64), "c": np.zeros((0, 2))},
    metadata={"k": "v"},
)


def _read_all(data: bytes) -> None:
    try:
        loaded = st.load(data)
    except SafetensorsError:
        return
    for value in loaded.values():
        value.tobytes()


@given(hs.lists(hs.tuples(hs.integers(0, len(VALID) - 1), hs.integers(0, 255)), min_size=1, max_size=8))
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_byte_corruption_is_a_typed_error_or_a_valid_read(flips: list[tuple[int, int]]) -> None:
    data = bytearray(VALID)
    for position, value in flips:
        data[position] = value
    _read_all(bytes(data))


@given(hs.integers(0, len(VALID)), hs.binary(max_size=16), hs.integers(0, 16))
@settings(max_examples=300, deadline=None)
def test_insertions_and_deletions_are_typed_errors(position: int, inserted: bytes, deleted: int) -> None:
    data = VALID[:position] + inserted + VALID[position + deleted :]
    _read_all(data)


@given(hs.binary(max_size=200))
@settings(max_examples=300, deadline=None)
def test_random_bytes_are_typed_errors(data: bytes) -> None:
    _read_all(data)
