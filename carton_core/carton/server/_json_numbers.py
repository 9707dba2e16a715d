"""JSON tensor numbers without holding the GIL for long: a tensor's ``data`` text read into a numpy array
(`read_numbers`), and a large output array written as JSON text (`array_text`).

With numba installed (``carton-runtime[mcf]``), the compiled reader (`_json_kernel`) parses the whole text, nested or
not, with the GIL released; without it, a flat array is parsed a piece at a time by orjson and msgspec, the GIL free
between pieces. Both give the array the general decoding (orjson, then msgspec's checks) gives, bit for bit, and
both decline (None) whatever is not plainly such an array, for the caller to decode the general way, which names
the fault. The compiled reader is loaded on a thread when the first tensor is read (numba and the compiled code take
memory a server that gets no large JSON tensors can keep); the piecewise reader serves until it is ready. A long flat
array's text is cut at commas and read by two threads at once, FP32 straight into float32 (through the double).
`array_spans` finds a large header's flat arrays (one compiled pass when the reader is loaded, else numpy scans).

An output is written by orjson a slice at a time, the GIL free between slices, as the same text one orjson call
over the whole list of Python numbers would give.
"""

from __future__ import annotations

import functools
import importlib
import itertools
import logging
import math
import threading
from types import ModuleType
from typing import Any

import msgspec
import numpy as np
import orjson

__all__ = [
    "WRITTEN_KINDS",
    "array_spans",
    "array_text",
    "element_type",
    "load_compiled_reader",
    "nested_list",
    "read_numbers",
]

_log = logging.getLogger("carton.server")

#: Element types the compiled reader fills (through float64 or int64).
_COMPILED_KINDS = frozenset({"f4", "f8", "i1", "i2", "i4", "i8", "u1", "u2", "u4", "u8"})
#: Literals the compiled reader may leave to Python's ``float`` before it gives up on the text (most data has none:
#: they take more than 19 significant digits, or fall out of the normal range).
_SLOW_ROWS = 1 << 14
#: Texts at least this long are read by two threads (see `_in_pieces`).
_SPLIT_BYTES = 1 << 20
#: The compiled reader's nesting limit (deeper texts go to the general decoding, which names the fault).
_MAX_DEPTH = 1000
#: Pieces a long flat array's text is cut into, read by two threads (`_in_pieces`).
_PIECES = 2
#: Bytes of text parsed per call by the piecewise reader: each call holds the GIL, so a piece bounds how long other
#: requests wait.
_PIECE_BYTES = 1 << 18
#: Elements written per orjson call by `array_text`: each call holds the GIL.
_WRITE_ELEMENTS = 1 << 13
#: Array kinds `array_text` writes (booleans, integers, floats).
WRITTEN_KINDS = frozenset("biuf")


#: The compiled reader once loaded (`load_compiled_reader`), and whether its loading has been started.
_compiled_module: ModuleType | None = None
_loading_started = False


def load_compiled_reader() -> bool:
    """Load the compiled reader now (import numba, then load or compile the kernel, holding the GIL in long
    stretches); False when numba is not installed. `read_numbers` starts this on a thread by itself."""
    global _compiled_module
    if _compiled_module is None:
        try:
            module = importlib.import_module("carton.server._json_kernel")
        except ImportError:
            return False
        for warm in (np.float64, np.float32):  # each output type is a compiled signature of its own
            _compiled(module, memoryview(b"[0]"), np.dtype(warm), 1)
        module.spans(np.frombuffer(b"[0]", dtype=np.uint8), 1, np.empty((4, 2), dtype=np.int64))
        _compiled_module = module
    return True


def _load_in_background() -> None:
    try:
        load_compiled_reader()
    except Exception as exc:  # a broken numba install: the piecewise reader keeps serving
        _log.warning("JSON tensors are read piece by piece: the compiled reader did not load (%s)", type(exc).__name__)


def _compiled_reader() -> ModuleType | None:
    """The compiled reader if it is loaded; else None, after starting its loading on a thread the first time."""
    global _loading_started
    if _compiled_module is None and not _loading_started:
        _loading_started = True
        threading.Thread(target=_load_in_background, name="carton-json-reader", daemon=True).start()
    return _compiled_module


def read_numbers(text: memoryview, numpy_dtype: np.dtype[Any], count: int) -> np.ndarray | None:
    """`text` (a JSON array of numbers, or one number) as a flat array of `numpy_dtype`; None for anything else,
    including another number of elements than `count` when the compiled reader is used."""
    if count > (len(text) + 1) // 2:
        return None  # more elements than the text can hold (each takes a byte and a comma): nothing to allocate for
    module = _compiled_reader()
    if module is None or numpy_dtype.str[1:] not in _COMPILED_KINDS:
        return _pieces(text, numpy_dtype)
    return _compiled(module, text, numpy_dtype, count)


def _compiled(module: ModuleType, text: memoryview, numpy_dtype: np.dtype[Any], count: int) -> np.ndarray | None:
    data = np.frombuffer(text, dtype=np.uint8)
    data.flags.writeable = False  # one compiled signature, whether the body came as bytes or bytearray
    integral = numpy_dtype.kind in "iu"
    if integral:
        bounds = np.iinfo(numpy_dtype)
        low, high = max(int(bounds.min), -(1 << 63)), min(int(bounds.max), (1 << 63) - 1)
    else:
        low, high = 0, 0
    # Floats are written in their own type (float32 through the double, as numpy's cast rounds), integers as int64.
    kind = np.int64 if integral else (np.float32 if numpy_dtype == np.float32 else np.float64)
    array = np.empty(count, dtype=kind)
    cuts = _cuts(data, _PIECES) if len(data) >= _SPLIT_BYTES and _PIECES > 1 else None
    if cuts:
        found = _in_pieces(module, text, data, cuts, integral, low, high, array)
        if found == count:
            return array if array.dtype == numpy_dtype else array.astype(numpy_dtype)
        if found >= 0:
            return None  # a flat array of numbers, of another count than the shape's
    if _read_into(module, text, data, 0, integral, low, high, array, 0, 0, _MAX_DEPTH) != count:
        return None
    return array if array.dtype == numpy_dtype else array.astype(numpy_dtype)


def _read_into(
    module: ModuleType,
    text: memoryview,
    data: np.ndarray,
    offset: int,
    integral: bool,
    low: int,
    high: int,
    array: np.ndarray,
    depth: int,
    final_depth: int,
    max_depth: int,
) -> int:
    """`data` (the text from `offset` on) read into `array` by the kernel, its listed literals by ``float``: how
    many elements it held, or -1 when the kernel declined, they are more than the array holds, or a literal is out of
    the double's range."""
    empty = np.empty(0, dtype=np.int64 if not integral else np.float64)
    floats, integers = (empty, array) if integral else (array, empty)
    slow = np.empty((min(_SLOW_ROWS, max(len(array), 1)), 3), dtype=np.int64)
    found, listed = module.read(data, integral, low, high, floats, integers, slow, depth, final_depth, max_depth)
    if found < 0 or found > len(array):
        return -1
    for index, start, end in slow[:listed].tolist():
        value = float(bytes(text[offset + start : offset + end]))  # the kernel checked the grammar; float() rounds
        if math.isinf(value):
            return -1  # orjson refuses a number out of the double's range
        with np.errstate(over="ignore"):  # beyond float32's range: infinity, as numpy's cast gives
            floats[index] = value
    return int(found)


def _cuts(data: np.ndarray, pieces: int) -> list[int] | None:
    """Offsets of commas cutting `data` into `pieces` about equal parts; None when one is not near its place."""
    cuts: list[int] = []
    for k in range(1, pieces):
        place = len(data) * k // pieces
        found = bytes(data[place : place + 256]).find(b",")
        if found < 0 or (cuts and place + found <= cuts[-1]):
            return None
        cuts.append(place + found)
    return cuts


def _in_pieces(
    module: ModuleType,
    text: memoryview,
    data: np.ndarray,
    cuts: list[int],
    integral: bool,
    low: int,
    high: int,
    array: np.ndarray,
) -> int:
    """A flat array's text read in pieces cut at commas (`cuts`) by this thread and one more, each taking the next
    piece when done with one; the first piece is read into `array`, the others into buffers of their own, copied
    after it. The count of elements, or -1 when a piece declines (nesting included: the caller then reads the text
    whole, which also tells a nested array from a fault)."""
    bounds = [(0, cuts[0], 0, 1)]
    bounds += [(cuts[k] + 1, cuts[k + 1], 1, 1) for k in range(len(cuts) - 1)]
    bounds.append((cuts[-1] + 1, len(data), 1, 0))
    results: list[tuple[int, np.ndarray] | None] = [None] * len(bounds)
    taken = itertools.count()
    failed = threading.Event()

    def work() -> None:
        while not failed.is_set():
            k = next(taken)
            if k >= len(bounds):
                return
            start, end, depth, final_depth = bounds[k]
            buffer = array if k == 0 else np.empty(len(array), dtype=array.dtype)
            found = _read_into(module, text, data[start:end], start, integral, low, high, buffer, depth, final_depth, 1)
            results[k] = (found, buffer)
            if found < 0:
                failed.set()

    thread = threading.Thread(target=work, name="carton-json-piece", daemon=True)
    try:
        thread.start()
        started = True
    except RuntimeError:  # no thread to be had: this one reads every piece
        started = False
    try:
        work()
    finally:
        if started:
            thread.join()
    if failed.is_set() or any(result is None for result in results):
        return -1
    filled = 0
    for k, result in enumerate(results):
        assert result is not None
        found, buffer = result
        if k and filled + found <= len(array):
            array[filled : filled + found] = buffer[:found]
        filled += found
    return filled


def array_spans(text: memoryview, cut: int) -> list[tuple[int, int]] | None:
    """Where a JSON text's large flat arrays are: every ``[``...``]`` span of at least `cut` bytes that holds no
    quote and no other ``[`` and is not inside a string, as (start, end past the ``]``); None when the text holds a
    backslash (escapes would make quotes lie about what is inside a string). One compiled pass without the GIL when
    the compiled reader is loaded, else numpy scans (which release the GIL)."""
    codes = np.frombuffer(text, dtype=np.uint8)
    module = _compiled_module
    if module is not None:
        found = np.empty((len(codes) // max(cut, 1) + 1, 2), dtype=np.int64)
        codes.flags.writeable = False  # one compiled signature
        count = module.spans(codes, cut, found)
        if count >= 0:
            return [(int(start), int(end)) for start, end in found[:count].tolist()]
        if count == -1:
            return None
    if np.count_nonzero(codes == ord("\\")):
        return None  # without escapes, every quote opens or closes a string, so a count says what is inside one
    opens = np.flatnonzero(codes == ord("["))
    closes = np.flatnonzero(codes == ord("]"))
    quotes = np.flatnonzero(codes == ord('"'))
    spans: list[tuple[int, int]] = []
    for index, start in enumerate(opens.tolist()):
        after = int(np.searchsorted(closes, start))
        if after == len(closes):
            break
        end = int(closes[after]) + 1
        if end - start < cut or (index + 1 < len(opens) and opens[index + 1] < end):
            continue  # short, or holding another array
        before, inside = np.searchsorted(quotes, [start, end])
        if before % 2 or inside != before:
            continue  # inside a string, or holding one
        spans.append((start, end))
    return spans


def _pieces(text: memoryview, numpy_dtype: np.dtype[Any]) -> np.ndarray | None:
    """A flat JSON array of numbers parsed a piece at a time (the GIL is free between pieces); None for anything
    else, nested arrays included.

    The whole-text scans (brackets, quotes, commas) are numpy comparisons over a view of the text, which release the
    GIL, instead of `bytes` methods, which hold it for the whole text; the text is never copied whole."""
    data = text.cast("B")
    first, last = _strip(data)
    if last - first < 2 or data[first] != ord("[") or data[last - 1] != ord("]"):
        return None
    inner = data[first + 1 : last - 1]
    codes = np.frombuffer(inner, dtype=np.uint8)
    if np.count_nonzero(codes == ord("[")) or np.count_nonzero(codes == ord('"')):
        return None  # nested, or holding strings: commas do not separate elements
    commas = int(np.count_nonzero(codes == ord(",")))
    count = commas + 1 if commas or bytes(inner).strip() else 0
    array = np.empty(count, dtype=numpy_dtype)
    element_list = nested_list(element_type(numpy_dtype), 1)
    # The pieces' Python numbers are freed together at the end: freed piece by piece, the allocator would hand their
    # memory back to the system and fault fresh pages in for the next piece, which costs more than the parse.
    pieces = []
    filled = start = 0
    try:
        while start < len(inner):
            end = _next_comma(inner, start + _PIECE_BYTES)
            piece = msgspec.convert(orjson.loads(b"[" + inner[start:end] + b"]"), element_list)
            pieces.append(piece)
            array[filled : filled + len(piece)] = np.fromiter(piece, numpy_dtype, len(piece))
            filled += len(piece)
            start = end + 1
    except (orjson.JSONDecodeError, msgspec.ValidationError, OverflowError, ValueError, TypeError):
        return None
    finally:
        while pieces:  # one piece's numbers at a time: freeing all of them at once would hold the GIL as long
            pieces.pop()
    return array if filled == count else None


_JSON_SPACE = frozenset(b" \t\n\r")


def _strip(data: memoryview) -> tuple[int, int]:
    """Where `data` starts and ends without JSON whitespace around it."""
    first, last = 0, len(data)
    while first < last and data[first] in _JSON_SPACE:
        first += 1
    while last > first and data[last - 1] in _JSON_SPACE:
        last -= 1
    return first, last


def _next_comma(data: memoryview, start: int) -> int:
    """The offset of the first comma of `data` at or after `start`, or ``len(data)``: searched a window at a time,
    so that no call holds the GIL over the whole text."""
    window = 4096
    while start < len(data):
        found = bytes(data[start : start + window]).find(b",")
        if found >= 0:
            return start + found
        start += window
    return len(data)


def element_type(numpy_dtype: np.dtype[Any]) -> type:
    """The JSON number type a `numpy_dtype` element must be: integers only for integer types (as the element-by-element
    path checks)."""
    return int if numpy_dtype.kind in "iu" else float


@functools.cache
def nested_list(element: type, depth: int) -> Any:
    """``list[list[...element]]``, `depth` lists deep (a msgspec conversion type)."""
    return element if depth == 0 else list[nested_list(element, depth - 1)]  # type: ignore[misc]


def array_text(array: np.ndarray) -> list[bytes]:
    """`array`'s elements (row-major, flattened) as a JSON array, in pieces to be joined: the text
    ``orjson.dumps(array.tolist())`` gives, written a slice at a time so that no call holds the GIL for the whole
    array (see `WRITTEN_KINDS`). Joining the pieces with ``b"".join`` releases the GIL; ``+`` would not."""
    flat = array.ravel(order="C")
    if flat.dtype.kind == "f" and flat.dtype != np.float64:
        # ``tolist`` gives Python floats, written as the shortest text of the double; orjson writes a float32 array's
        # elements as the shortest text of the float32, which differs.
        flat = flat.astype(np.float64)
    pieces = [b"["]
    for start in range(0, len(flat), _WRITE_ELEMENTS):
        if start:
            pieces.append(b",")
        pieces.append(orjson.dumps(flat[start : start + _WRITE_ELEMENTS], option=orjson.OPT_SERIALIZE_NUMPY)[1:-1])
    pieces.append(b"]")
    return pieces
