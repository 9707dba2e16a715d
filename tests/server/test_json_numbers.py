"""The JSON tensor readers (`_json_numbers`): the compiled one (numba) and the piecewise one give, for every text,
the array the general decoding (orjson, then msgspec's checks) gives, bit for bit, or the same refusal."""

from __future__ import annotations

import itertools
import random
import struct
import subprocess
import sys
import threading
from collections.abc import Iterator

import msgspec
import numpy as np
import orjson
import pytest
from carton.server import _json_numbers
from carton.server._datatypes import DATATYPE_OF, NUMPY_OF
from carton.server._http_codec import _json_tensor
from carton.server.errors import BadRequest
from carton_protocol import DType


@pytest.fixture(params=["compiled", "halves", "pieces"])
def reader(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    if request.param in ("compiled", "halves"):
        pytest.importorskip("numba")
        assert _json_numbers.load_compiled_reader()
        if request.param == "halves":  # every text with a comma near its middle is read in two halves
            monkeypatch.setattr(_json_numbers, "_SPLIT_BYTES", 0)
    else:
        monkeypatch.setattr(_json_numbers, "_compiled_reader", lambda: None)
    yield request.param


def _read(text: bytes, dtype: DType, shape: list[int]) -> np.ndarray:
    return _json_tensor(msgspec.Raw(text), dtype, shape, tensor="x")


def _general(text: bytes, dtype: DType, shape: list[int]) -> np.ndarray:
    """What the whole-document decoding gives (the reference)."""
    return _json_tensor(orjson.loads(text), dtype, shape, tensor="x")


def _same(got: np.ndarray, expected: np.ndarray) -> bool:
    return got.dtype == expected.dtype and got.shape == expected.shape and got.tobytes() == expected.tobytes()


_FORMS = [
    "0", "-0", "0.0", "-0.0", "0e0", "-0e-0", "0.000", "1", "-1", "7", "123", "-987654321", "1.5", "-1.5", "0.1",
    "0.3", "2.675", "1e5", "1E5", "1e+5", "1e-5", "-1.25e-3", "1.25E+03", "0.000001", "1000000", "3.4028235e38",
    "3.4028236e38", "65504", "65520", "6e-8", "9007199254740992", "9007199254740993", "9007199254740995",
    "18014398509481987", "9223372036854775807", "-9223372036854775808", "18446744073709551615",
    "18446744073709551616", "123456789012345678901234567890", "-123456789012345678901234567890.5e-10",
    "1.7976931348623157e308", "2.2250738585072014e-308", "2.2250738585072011e-308", "4.9e-324", "5e-324",
    "2.4703282292062328e-324", "2.4703282292062327e-324", "1e-400", "-1e-400", "1e-342", "1e308", "1e22", "1e23",
    "1e-22", "1e-23", "0.1e23", "123456789e-30", "8.98846567431158e307", "0.00000000000000000000000000000001",
    "1.00000000000000011102230246251565404236316680908203125", "9.999999999999999e22", "4503599627370497.5",
]  # fmt: skip


@pytest.mark.parametrize("dtype", [DType.FLOAT64, DType.FLOAT32])
def test_every_number_form_reads_as_the_general_decoding_does(reader: str, dtype: DType) -> None:
    text = ("[" + ", ".join(_FORMS) + "]").encode()
    with np.errstate(over="ignore"):
        expected = _general(text, dtype, [len(_FORMS)])
        assert _same(_read(text, dtype, [len(_FORMS)]), expected)
    for form in _FORMS:  # one at a time too: a failure names the literal
        with np.errstate(over="ignore"):
            assert _same(_read(f"[{form}]".encode(), dtype, [1]), _general(f"[{form}]".encode(), dtype, [1])), form


def test_negative_zero_follows_the_literal(reader: str) -> None:
    # an integer literal is a Python int first, and int 0 has no sign; a fraction or exponent keeps it
    assert np.signbit(_read(b"[-0, -0.0, -0e0, 0]", DType.FLOAT64, [4])).tolist() == [False, True, True, False]


@pytest.mark.parametrize(
    "dtype",
    [DType.INT8, DType.INT16, DType.INT32, DType.INT64, DType.UINT8, DType.UINT16, DType.UINT32, DType.UINT64],
)
def test_integers_read_to_their_bounds_and_no_further(reader: str, dtype: DType) -> None:
    bounds = np.iinfo(NUMPY_OF[DATATYPE_OF[dtype]])
    low, high = int(bounds.min), int(bounds.max)
    text = b"[%d, %d, 0, -0, 1, %d]" % (low, high, high // 3)
    assert _same(_read(text, dtype, [6]), _general(text, dtype, [6]))
    assert _read(text, dtype, [6]).tolist() == [low, high, 0, 0, 1, high // 3]
    for outside in (low - 1, high + 1):
        text = b"[1, %d]" % outside
        with pytest.raises(BadRequest) as general:
            _general(text, dtype, [2])
        with pytest.raises(BadRequest) as caught:
            _read(text, dtype, [2])
        # "does not fit", or for integers beyond 64 bits (which orjson reads as floats) "must be integers"
        assert str(caught.value) == str(general.value) and str(caught.value).startswith("input 'x': ")


@pytest.mark.parametrize("literal", [b"2.5", b"1.0", b"1e2", b"-0.0", b"1E0"])
def test_integer_types_refuse_fractions_and_exponents(reader: str, literal: bytes) -> None:
    with pytest.raises(BadRequest, match=r"input 'x': INT32 'data' elements must be integers, got "):
        _read(b"[1, " + literal + b"]", DType.INT32, [2])


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (b" [ 1 ,\n2\t,\r3 , 4 ] ", [1.0, 2.0, 3.0, 4.0]),
        (b"[[1, 2], [3, 4]]", [1.0, 2.0, 3.0, 4.0]),
        (b"[[1], [2, [3, [4]]]]", [1.0, 2.0, 3.0, 4.0]),  # ragged: only the count must agree
        (b"[[], [1, 2, 3, 4], []]", [1.0, 2.0, 3.0, 4.0]),
        (b"[ [ [ 1 ] , 2 ] , 3,4 ]", [1.0, 2.0, 3.0, 4.0]),
    ],
)
def test_whitespace_and_nesting(reader: str, text: bytes, expected: list[float]) -> None:
    assert _read(text, DType.FLOAT32, [4]).ravel().tolist() == expected
    assert _read(text, DType.FLOAT32, [2, 2]).shape == (2, 2)


def test_deep_nesting(reader: str) -> None:
    # Past the typed conversion's depth: read all the same.
    assert _read(b"[" * 40 + b"1, 2" + b"]" * 40, DType.FLOAT32, [2]).tolist() == [1.0, 2.0]
    # Past the compiled reader's depth: what the general decoding gives (newer orjson releases refuse such depth).
    deep = b"[" * 1100 + b"1, 2" + b"]" * 1100
    try:
        orjson.loads(deep)
    except orjson.JSONDecodeError:
        with pytest.raises(BadRequest, match="not valid JSON"):
            _read(deep, DType.FLOAT32, [2])
    else:
        assert _read(deep, DType.FLOAT32, [2]).tolist() == [1.0, 2.0]


def test_an_empty_array_and_a_single_number(reader: str) -> None:
    assert _read(b" [ ] ", DType.FLOAT32, [0]).shape == (0,)
    assert _read(b"[[], []]", DType.INT64, [0, 3]).shape == (0, 3)
    assert _read(b"5", DType.INT64, [1]).tolist() == [5]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (b"[1, 2, 3]", "input 'x': 'data' holds 3 elements but shape [4] needs 4"),
        (b"[1, 2, 3, 4, 5]", "input 'x': 'data' holds 5 elements but shape [4] needs 4"),
        (b"[[1, 2], [3]]", "input 'x': 'data' holds 3 elements but shape [4] needs 4"),
        (b"[]", "input 'x': 'data' holds 0 elements but shape [4] needs 4"),
    ],
)
def test_a_count_other_than_the_shape_is_refused(reader: str, text: bytes, message: str) -> None:
    with pytest.raises(BadRequest, match=message.replace("[", r"\[").replace("]", r"\]")):
        _read(text, DType.FLOAT32, [4])


def test_a_shape_far_larger_than_the_text_is_refused_without_allocating_for_it(reader: str) -> None:
    with pytest.raises(BadRequest, match=r"^input 'x': 'data' holds 2 elements but shape \[1099511627776\] needs "):
        _read(b"[1, 2]", DType.FLOAT32, [1 << 40])


@pytest.mark.parametrize(
    "text",
    [
        b"[NaN, 1]", b"[1, Infinity]", b"[-Infinity, 1]", b"[1e400, 1]", b"[-1e309, 1]", b"[nan, 1]",
        b"[1, 2", b"[1, 2,", b"[1, 2.", b"[1, 2e", b"[1, 2e+", b"[1, -", b"[", b"", b"  ", b"[1, 2]]",
        b"[[1, 2]", b"[1, 2] x", b"[01, 2]", b"[+1, 2]", b"[.5, 2]", b"[1., 2]", b"[--1, 2]", b"[1 2]",
        b"[1,, 2]", b"[1, 2,]", b"[,1, 2]", b"[1, 0x10]", b"[1, 1_0]", b"[1, 2]\x00", b"[1,\x0b2]",
        b"[00, 2]", b"[-01.5, 2]", b"[1.5.5, 2]", b"[1e5e5, 2]", b"[1.e5, 2]", b"[-.5, 2]", b"[0-1, 2]", b"[1-, 2]",
        b"[1,-,2]", b"[1,2-]", b"[0000000000000000000001, 2]", b"[1.5e, 2]", b"[1,2", b"[1,2,",
    ],
)  # fmt: skip
def test_what_is_not_json_is_refused_as_such(reader: str, text: bytes) -> None:
    with pytest.raises(BadRequest, match=r"^the inference request header is not valid JSON: "):
        _read(text, DType.FLOAT32, [2])


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (b"[1.0, true]", "FP32 'data' elements must be numbers, got True"),
        (b"[false, 1]", "FP32 'data' elements must be numbers, got False"),
        (b"[1, null]", "FP32 'data' elements must be numbers, got None"),
        (b'[1, "2"]', "FP32 'data' elements must be numbers, got '2'"),
        (b'[1, {"a": 1}]', "FP32 'data' elements must be numbers, got {'a': 1}"),
    ],
)
def test_other_json_values_are_named(reader: str, text: bytes, message: str) -> None:
    with pytest.raises(BadRequest) as caught:
        _read(text, DType.FLOAT32, [2])
    assert str(caught.value) == f"input 'x': {message}"


def _random_literals(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    literals: list[str] = []
    while len(literals) < count:
        double = struct.unpack("<d", struct.pack("<Q", rng.getrandbits(64)))[0]
        if not np.isfinite(double):
            continue
        kind = rng.randrange(6)
        if kind == 0:
            literals.append(repr(double))  # shortest round trip, up to 17 digits, the whole exponent range
        elif kind == 1:
            literals.append(f"{double:.{rng.randrange(25)}e}")  # up to 25 digits: some beyond 19
        elif kind == 2:
            literals.append(repr(float(np.float32(rng.uniform(-1e3, 1e3)))))
        elif kind == 3:
            literals.append(str(rng.randrange(-(10 ** rng.randrange(1, 25)), 10 ** rng.randrange(1, 25))))
        elif kind == 4:
            places = rng.randrange(1, 12)
            literals.append(f"{rng.randrange(10**6)}.{rng.randrange(10**places):0{places}d}e{rng.randrange(-340, 300)}")
        else:  # halfway between two doubles, written exactly
            below = abs(double)
            if not 1e-300 < below < 1e300:
                continue
            literals.append(_halfway(below, float(np.nextafter(below, np.inf))))
    return literals


def _halfway(below: float, above: float) -> str:
    """The exact decimal midpoint of two doubles."""
    from decimal import Decimal, localcontext

    with localcontext() as context:
        context.prec = 1200
        return format((Decimal(below) + Decimal(above)) / 2, "e")


@pytest.mark.parametrize("dtype", [DType.FLOAT64, DType.FLOAT32])
def test_random_numbers_are_rounded_as_orjson_and_float_round_them(reader: str, dtype: DType) -> None:
    literals = _random_literals(20_000, seed=17)
    literals = [literal for literal in literals if abs(float(literal)) < 1.7e308]
    text = ("[" + ",".join(literals) + "]").encode()
    with np.errstate(over="ignore"):
        got = _read(text, dtype, [len(literals)])
        assert _same(got, _general(text, dtype, [len(literals)]))
    if dtype is DType.FLOAT64:
        assert got.tobytes() == np.array([float(literal) for literal in literals]).tobytes()


@pytest.mark.parametrize(
    "text",
    [
        b"[1,2,3,4,5,6]", b" [ 1 , 2 ,\n3\t, 4 ,5 ,6 ] ", b"[1.5e3,-0,0.25,-7e-2,123456789012345678901234,6]",
        b"[[1,2,3],[4,5,6]]", b"[[1,2],3,4,[5,6]]", b"[1,2,3,[4],5,6]", b"[1,2,,3,4,5]", b"[1,2,3,4,5,]",
        b"[1,2,3,4,5,6]]", b"[1,2,3,4,5,6", b"[1,true,3,4,5,6]", b'[1,2,3,"4",5,6]', b"[1,2,3,4,5,1e400]",
        b"[1,2,3,4,5,6,7]", b"[1,2,3,4,5]", b"[1,2,3,4,5,6] 7",
    ],
)  # fmt: skip
def test_pieces_cut_at_any_commas_read_as_the_whole_text(monkeypatch: pytest.MonkeyPatch, text: bytes) -> None:
    pytest.importorskip("numba")
    assert _json_numbers.load_compiled_reader()

    def outcome() -> object:
        try:
            return _read(text, DType.FLOAT64, [6]).tobytes()
        except BadRequest as exc:
            return str(exc)

    monkeypatch.setattr(_json_numbers, "_SPLIT_BYTES", 1 << 60)
    whole = outcome()
    try:
        expected: object = _general(text, DType.FLOAT64, [6]).tobytes()
    except BadRequest as exc:
        expected = str(exc)
    except orjson.JSONDecodeError:
        expected = whole  # not JSON: the message is the decoder's own, checked below to be the whole read's
    assert whole == expected
    monkeypatch.setattr(_json_numbers, "_SPLIT_BYTES", 0)
    commas = [index for index, byte in enumerate(text) if byte == ord(",")]
    for cuts in [[comma] for comma in commas] + list(map(list, itertools.combinations(commas, 2))):
        monkeypatch.setattr(_json_numbers, "_cuts", lambda data, pieces, cuts=cuts: cuts)
        assert outcome() == whole, cuts


def test_many_literals_left_to_float_still_read_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("numba")
    assert _json_numbers.load_compiled_reader()
    text = ("[" + ",".join(["0.12345678901234567890123"] * 50 + ["5e-324"] * 50) + "]").encode()
    expected = _general(text, DType.FLOAT64, [100])
    assert _same(_read(text, DType.FLOAT64, [100]), expected)
    monkeypatch.setattr(_json_numbers, "_SLOW_ROWS", 8)  # more than the kernel may list: the general path
    assert _same(_read(text, DType.FLOAT64, [100]), expected)


def test_only_the_compiled_reader_takes_nested_arrays(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("numba")
    nested = memoryview(b"[[1, 2], [3, 4]]")
    assert _json_numbers.load_compiled_reader()
    array = _json_numbers.read_numbers(nested, np.dtype(np.float32), 4)
    assert array is not None and array.tolist() == [1.0, 2.0, 3.0, 4.0]
    monkeypatch.setattr(_json_numbers, "_compiled_reader", lambda: None)
    assert _json_numbers.read_numbers(nested, np.dtype(np.float32), 4) is None


@pytest.mark.parametrize(
    "array",
    [
        np.random.default_rng(1).standard_normal((3, 40_000)).astype(np.float32),
        np.concatenate([np.random.default_rng(2).standard_normal(70_000), [np.nan, np.inf, -np.inf, -0.0, 5e-324]]),
        np.random.default_rng(3).standard_normal(70_000).astype(np.float16),
        np.random.default_rng(4).integers(-128, 127, 70_000).astype(np.int8),
        np.random.default_rng(5).integers(0, 2**64 - 1, 70_000, dtype=np.uint64, endpoint=True),
        np.random.default_rng(6).integers(0, 2, 70_000).astype(bool),
        np.zeros((0, 5), np.float32),
        np.arange(1, dtype=np.int64),
    ],
    ids=["fp32", "fp64", "fp16", "int8", "uint64", "bool", "empty", "one"],
)
def test_output_text_is_what_one_orjson_call_over_the_list_gives(array: np.ndarray) -> None:
    expected = orjson.dumps(array.ravel().tolist())
    assert b"".join(_json_numbers.array_text(array)) == expected
    assert b"".join(_json_numbers.array_text(np.asfortranarray(array.reshape(-1, 1)))) == expected


def test_the_compiled_reader_is_loaded_by_the_first_tensor_read_and_not_before() -> None:
    pytest.importorskip("numba")
    script = """
import sys, threading
import numpy as np
from carton.server import _json_numbers
import carton.server
assert "numba" not in sys.modules, "importing the server loaded numba"
first = _json_numbers.read_numbers(memoryview(b"[1, 2]"), np.dtype(np.float32), 2)
assert first is not None and first.tolist() == [1.0, 2.0]
for thread in threading.enumerate():
    if thread.name == "carton-json-reader":
        thread.join()
assert _json_numbers._compiled_reader() is not None
assert _json_numbers.read_numbers(memoryview(b"[[1], [2]]"), np.dtype(np.float32), 2) is not None
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize(
    "text",
    [
        b'{"a": [1, 2, 3], "b": [[4, 5], [6]], "c": "[7, 8]", "d": ["x", 9], "e": []}',
        b'{"a": "[", "b": [1, 2, 3]]}', b'{"a": "]", "b": [1, 2]} "[3]"', b"]]][[[1]", b'"[1, 2]"[3, 4]', b"",
        b'{"a": "\\\\[1, 2]", "b": [3, 4]}', b'[1, 2, "3"]', b"[[[1, 2, 3]]] [4] [", b'"unclosed [1, 2]',
    ],
)  # fmt: skip
@pytest.mark.parametrize("cut", [0, 3, 7, 100])
def test_large_arrays_are_found_alike_with_and_without_the_compiled_reader(
    monkeypatch: pytest.MonkeyPatch, text: bytes, cut: int
) -> None:
    pytest.importorskip("numba")
    assert _json_numbers.load_compiled_reader()
    # The compiled pass tests 64 bytes at a time: long texts with the brackets at every offset of such a block.
    texts = [text] + [b" " * pad + text * 3 + b"_^" * 40 + b"0" * (pad * 7) + text for pad in range(0, 80, 3)]
    for long in texts:
        compiled = _json_numbers.array_spans(memoryview(long), cut)
        with monkeypatch.context() as patch:
            patch.setattr(_json_numbers, "_compiled_module", None)
            assert compiled == _json_numbers.array_spans(memoryview(long), cut)
        assert (compiled is None) == (b"\\" in long)


def test_a_long_array_is_read_by_this_thread_alone_when_no_other_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("numba")
    assert _json_numbers.load_compiled_reader()
    monkeypatch.setattr(_json_numbers, "_SPLIT_BYTES", 0)
    started: list[str] = []

    def refuse(thread: threading.Thread) -> None:
        started.append(thread.name)
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", refuse)
    text = b"[1.5, -2, 3e2, 4, 0.25, 6]"
    assert _read(text, DType.FLOAT32, [6]).tolist() == [1.5, -2.0, 300.0, 4.0, 0.25, 6.0]
    assert started == ["carton-json-piece"]
