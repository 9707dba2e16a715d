"""JSON tensor numbers without holding the GIL for long: a tensor's ``data`` text read into a numpy array
(`read_numbers`), and a large output array written as JSON text (`array_text`).

With numba installed (``carton-runtime[mcf]``), the compiled reader (`_json_kernel`) parses the whole text, nested or
not, with the GIL released; without it, a flat array is parsed a piece at a time by orjson and msgspec, the GIL free
between pieces. Both give the array the general decoding (orjson, then msgspec's checks) gives, bit for bit, and
both decline (None) whatever is not plainly such an array, for the caller to decode the general way, which names
the fault. The compiled reader is loaded on a thread when the first tensor is read (numba and the compiled code take
memory a server that gets no large JSON tensors can keep); the piecewise reader serves until it is ready.

An output is written by orjson a slice at a time, the GIL free between slices, as the same text one orjson call
over the whole list of Python numbers would give.
"""

from __future__ import annotations

import functools
import importlib
import logging
import math
import threading
from types import ModuleType
from typing import Any

import msgspec
import numpy as np
import orjson

__all__ = ["WRITTEN_KINDS", "array_text", "element_type", "load_compiled_reader", "nested_list", "read_numbers"]

_log = logging.getLogger("carton.server")

#: Element types the compiled reader fills (through float64 or int64).
_COMPILED_KINDS = frozenset({"f4", "f8", "i1", "i2", "i4", "i8", "u1", "u2", "u4", "u8"})
#: Literals the compiled reader may leave to Python's ``float`` before it gives up on the text (most data has none:
#: they take more than 19 significant digits, or fall out of the normal range).
_SLOW_ROWS = 1 << 14
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
        _compiled(module, memoryview(b"[0]"), np.dtype(np.float64), 1)
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
        integers, floats = np.empty(count, dtype=np.int64), np.empty(0, dtype=np.float64)
    else:
        low, high = 0, 0
        integers, floats = np.empty(0, dtype=np.int64), np.empty(count, dtype=np.float64)
    slow = np.empty((min(_SLOW_ROWS, count), 3), dtype=np.int64)
    found, listed = module.read(data, integral, low, high, floats, integers, slow)
    if found != count:
        return None
    for index, start, end in slow[:listed].tolist():
        value = float(bytes(text[start:end]))  # the kernel checked the grammar; float() rounds correctly
        if math.isinf(value):
            return None  # orjson refuses a number out of the double's range
        floats[index] = value
    array = integers if integral else floats
    return array if array.dtype == numpy_dtype else array.astype(numpy_dtype)


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
