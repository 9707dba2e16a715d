"""A compiled (numba) reader of a JSON tensor's ``data``: nested arrays of numbers parsed straight into a numpy buffer,
with the GIL released for the whole text.

`read` accepts exactly the JSON grammar for arrays of numbers (whitespace, any nesting, ``-``, fractions, exponents)
and gives the values orjson would, then msgspec's conversion: integers only for integer types (within the bounds
given), and for float types the correctly rounded double of every literal, an integer literal ``-0`` giving ``+0.0``
as a Python ``int`` would. Doubles come from the exact fast path (mantissa below 2**53, power of ten within 22) or
the Eisel-Lemire algorithm (up to 19 significant digits, normal results); a literal that neither settles (more
digits, a subnormal or infinite result, a rounding tie it cannot decide) is listed for the caller, which reads it
with Python's correctly rounded ``float``. Anything else (another token, a string, a boolean, unbalanced brackets,
an integer out of bounds, more elements than the buffer holds) stops the read: the caller decodes that text the
general way, which names the fault. A literal of at most 19 digits in all is read without a test per digit; longer
ones are read again digit by digit. `read` can also take part of a flat array's text (cut at a comma), so that two
threads read one text.

`spans` finds a header's large flat arrays in one pass (the caller cuts them out before decoding the rest).
"""

from __future__ import annotations

import numba
import numpy as np

__all__ = ["DECLINED", "read", "spans"]

#: `read`'s status when the text is not plainly an array of numbers that fits.
DECLINED = -1

_MAX_DEPTH = 1000
_SIGNIFICANT = 19


def _powers_of_five() -> tuple[np.ndarray, np.ndarray]:
    """The 128-bit truncated (normalized) powers of five 5**-342 .. 5**308 of the Eisel-Lemire algorithm, as high
    and low words (the table of Lemire, "Number Parsing at a Gigabyte per Second")."""
    values: list[int] = []
    for q in range(-342, 0):
        power = 5**-q
        z = (power - 1).bit_length()  # the least z with 2**z >= power
        c = 2 ** (z + 127) // power + 1 if q >= -27 else 2 ** (2 * z + 128) // power + 1
        while c >= 1 << 128:
            c //= 2
        values.append(c)
    for q in range(309):
        power = 5**q
        while power < 1 << 127:
            power *= 2
        while power >= 1 << 128:
            power //= 2
        values.append(power)
    high = np.array([v >> 64 for v in values], dtype=np.uint64)
    low = np.array([v & ((1 << 64) - 1) for v in values], dtype=np.uint64)
    return high, low


_POW5_HIGH, _POW5_LOW = _powers_of_five()
_EXACT = np.array([10.0**k for k in range(23)], dtype=np.float64)

_U0 = np.uint64(0)
_U1 = np.uint64(1)
_U32 = np.uint64(32)
_LOW32 = np.uint64(0xFFFFFFFF)
_ALL = np.uint64(0xFFFFFFFFFFFFFFFF)
_TEN = np.uint64(10)
_PRECISION = np.uint64(0x1FF)
_TWO53 = np.uint64(1 << 53)
_HIDDEN = np.uint64(1 << 52)
_I64_MAX = np.uint64((1 << 63) - 1)
_I64_MIN_MAGNITUDE = np.uint64(1 << 63)
_JIT = {"nogil": True, "cache": True, "boundscheck": False}


@numba.njit(**_JIT)
def _multiply(a, b):  # type: ignore[no-untyped-def]
    """The 128-bit product of two 64-bit words, as (high, low)."""
    a_low, a_high = a & _LOW32, a >> _U32
    b_low, b_high = b & _LOW32, b >> _U32
    p0 = a_low * b_low
    p1 = a_low * b_high
    p2 = a_high * b_low
    p3 = a_high * b_high
    middle = (p0 >> _U32) + (p1 & _LOW32) + (p2 & _LOW32)
    return p3 + (p1 >> _U32) + (p2 >> _U32) + (middle >> _U32), (p0 & _LOW32) | (middle << _U32)


@numba.njit(**_JIT)
def _eisel_lemire(w, q):  # type: ignore[no-untyped-def]
    """The bits of the double nearest ``w * 10**q`` (``0 < w < 10**19``), or 0 when the algorithm cannot settle it
    here (out of the table, subnormal, infinite, or a tie to round to even)."""
    if q < -342 or q > 308:
        return _U0
    lz = 0
    while (w << np.uint64(lz)) >> np.uint64(63) == _U0:
        lz += 1
    w = w << np.uint64(lz)
    index = q + 342
    high, low = _multiply(w, _POW5_HIGH[index])
    if (high & _PRECISION) == _PRECISION:
        high2, _ = _multiply(w, _POW5_LOW[index])
        low = low + high2
        if high2 > low:
            high += _U1
    if low == _ALL:
        return _U0  # the truncated table may be one short here
    upper = high >> np.uint64(63)
    shift = upper + np.uint64(9)
    mantissa = high >> shift
    power2 = (((152170 + 65536) * q) >> 16) + 63 + np.int64(upper) - lz + 1023
    if power2 <= 0 or power2 >= 2047:
        return _U0
    if low <= _U1 and -4 <= q <= 23 and (mantissa & np.uint64(3)) == _U1 and (mantissa << shift) == high:
        return _U0  # exactly between two doubles
    mantissa += mantissa & _U1
    mantissa >>= _U1
    if mantissa >= _HIDDEN << _U1:
        mantissa = _HIDDEN
        power2 += 1
    mantissa &= ~_HIDDEN
    if power2 >= 2047:
        return _U0
    return (np.uint64(power2) << np.uint64(52)) | mantissa


@numba.njit(**_JIT)
def _space(text, i, n):  # type: ignore[no-untyped-def]
    while i < n:
        c = text[i]
        if c != 32 and c != 10 and c != 13 and c != 9:
            break
        i += 1
    return i


@numba.njit(inline="always", **_JIT)
def _digit_run(text, i, n, w, digits):  # type: ignore[no-untyped-def]
    """Read the run of digits at ``i`` into the mantissa ``w`` (of ``digits`` significant digits so far; zeros before
    the first significant digit are not counted, digits past `_SIGNIFICANT` are counted but not kept). Returns the
    run's end, ``w``, ``digits`` and how many of the run's digits were leading zeros or kept (a fraction's
    decimal places in ``w``)."""
    placed = 0
    while i < n:
        c = text[i]
        if c < 48 or c > 57:
            break
        if digits or c != 48:
            if digits < _SIGNIFICANT:
                w = w * _TEN + np.uint64(c - 48)
                placed += 1
            digits += 1
        else:
            placed += 1
        i += 1
    return i, w, digits, placed


@numba.njit(inline="always", **_JIT)
def _plain_number(text, i, n):  # type: ignore[no-untyped-def]
    """The literal at ``i`` read the short way: all its digits (integer part and fraction, leading zeros included)
    into one mantissa, no test per digit but where the run ends. Returns its end, ``w``, the count of digits, the
    count of fraction digits, and whether the literal is well formed so far (a digit first, no leading zero, a
    digit after the point); more than `_SIGNIFICANT` digits leave ``w`` wrapped, for the careful reading."""
    first = i
    w = _U0
    # The integer part's and the fraction's loops are written out: one inlined helper for both made the whole read
    # slower (docs/performance.md, the JSON tensor on the new machine).
    while i < n:
        d = np.uint64(text[i]) - np.uint64(48)
        if d > np.uint64(9):
            break
        w = w * _TEN + d
        i += 1
    whole = i - first
    good = whole == 1 or (whole > 1 and text[first] != 48)
    point = 0
    if good and i < n and text[i] == 46:  # .
        i += 1
        first = i
        while i < n:
            d = np.uint64(text[i]) - np.uint64(48)
            if d > np.uint64(9):
                break
            w = w * _TEN + d
            i += 1
        point = i - first
        good = point > 0
    return i, w, whole + point, point, good


@numba.njit(**_JIT)
def read(text, integral, low, high, floats, integers, slow, depth, final_depth, max_depth):  # type: ignore[no-untyped-def]
    """Parse `text` (a JSON value: nested arrays of numbers, or one number) into `floats` (float64 or float32,
    through the correctly rounded double) or, when `integral`, into `integers` (int64, each within ``low .. high``).

    The text may be part of a larger one: the read starts at nesting `depth` (0 for a whole value; 1 for the elements
    after a comma of a flat array, expecting a value), must end at `final_depth` (0 for a whole value; 1 for a text
    that stops before a comma of a flat array), and declines nesting deeper than `max_depth`.

    Returns ``(count, listed)``: the number of elements (the buffer holds ``min(count, len)`` of them), and how many
    were listed in `slow` (rows of element index, start and end offset in `text`) for the caller to read with
    ``float``; count is `DECLINED` when the text is anything else, or `slow` is full."""
    n = len(text)
    capacity = len(floats) if not integral else len(integers)
    scratch = np.empty(1, dtype=np.uint64)
    scratch_float = scratch.view(np.float64)
    listed = 0
    count = 0
    i = _space(text, 0, n)
    if i == n:
        return DECLINED, 0
    while True:
        # A value starts at i.
        closed = False
        if text[i] == 91:  # [
            depth += 1
            if depth > max_depth:
                return DECLINED, 0
            i = _space(text, i + 1, n)
            if i == n:
                return DECLINED, 0
            if text[i] == 93:  # ]
                depth -= 1
                i += 1
                closed = True
            else:
                continue
        if not closed:
            start = i
            negative = text[i] == 45  # -
            if negative:
                i += 1
                if i == n:
                    return DECLINED, 0
            i, w, digits, point, good = _plain_number(text, i, n)
            if not good:
                return DECLINED, 0
            fraction = point > 0
            if digits > _SIGNIFICANT:  # read again the careful way: zeros before the first significant digit
                i = start + 1 if negative else start
                w = _U0
                digits = 0
                i, w, digits, _ = _digit_run(text, i, n, w, digits)
                point = 0
                if fraction:
                    i, w, digits, point = _digit_run(text, i + 1, n, w, digits)
            exponent = 0
            scaled = False
            if i < n and (text[i] == 101 or text[i] == 69):  # e E
                scaled = True
                i += 1
                minus = False
                if i < n and (text[i] == 43 or text[i] == 45):
                    minus = text[i] == 45
                    i += 1
                first = i
                while i < n:
                    c = text[i]
                    if c < 48 or c > 57:
                        break
                    if exponent < 100000:
                        exponent = exponent * 10 + (c - 48)
                    i += 1
                if i == first:
                    return DECLINED, 0
                if minus:
                    exponent = -exponent
            if integral:
                if fraction or scaled or digits > _SIGNIFICANT:
                    return DECLINED, 0
                if w == _U0:
                    value = np.int64(0)
                elif negative:
                    if w > _I64_MIN_MAGNITUDE:
                        return DECLINED, 0
                    value = -np.int64(w - _U1) - 1  # -2**63 included
                else:
                    if w > _I64_MAX:
                        return DECLINED, 0
                    value = np.int64(w)
                if value < low or value > high:
                    return DECLINED, 0
                if count < capacity:
                    integers[count] = value
            elif count < capacity:
                settled = digits <= _SIGNIFICANT  # more digits than the mantissa keeps: left to float()
                if settled and w == _U0:
                    floats[count] = -0.0 if negative and (fraction or scaled) else 0.0
                elif settled:
                    q = exponent - point
                    if w <= _TWO53 and -22 <= q <= 22:
                        value_f = np.float64(w)
                        value_f = value_f * _EXACT[q] if q >= 0 else value_f / _EXACT[-q]
                        floats[count] = -value_f if negative else value_f
                    else:
                        found = _eisel_lemire(w, q)
                        settled = found != _U0
                        if settled:
                            scratch[0] = found
                            floats[count] = -scratch_float[0] if negative else scratch_float[0]
                if not settled:  # left to the caller's float()
                    if listed == len(slow):
                        return DECLINED, 0
                    slow[listed, 0] = count
                    slow[listed, 1] = start
                    slow[listed, 2] = i
                    listed += 1
            count += 1
        # A value ended at i: a comma, closing brackets, or the end.
        if i + 1 < n and text[i] == 44 and depth > 0:  # the usual ",": the next value right after it
            c = text[i + 1]
            if c == 45 or (c >= 48 and c <= 57):
                i += 1
                continue
        i = _space(text, i, n)
        while True:
            if i == n:
                return (count, listed) if depth == final_depth else (DECLINED, 0)
            if depth == 0:
                return DECLINED, 0
            c = text[i]
            if c == 44:  # ,
                i = _space(text, i + 1, n)
                if i == n:
                    return DECLINED, 0
                break
            if c != 93:
                return DECLINED, 0
            depth -= 1
            i = _space(text, i + 1, n)


#: Words (of 8 bytes) `spans` tests at a time.
_BLOCK = 8


@numba.njit(**_JIT)
def _span_bytes(text, lo, hi, state, found):  # type: ignore[no-untyped-def]
    """`spans`' state machine over ``text[lo:hi]``; False when it must stop (`state` 0 holds why)."""
    count, last_open, quoted, quote_since_open, open_quoted = state[0], state[1], state[2], state[3], state[4]
    cut = state[5]
    for i in range(lo, hi):
        c = text[i]
        if c != 91 and c != 93 and c != 34 and c != 92:
            continue
        if c == 92:  # \
            state[0] = -1
            return False
        if c == 34:  # "
            quoted = 1 - quoted
            quote_since_open = 1
        elif c == 91:  # [
            last_open = i
            quote_since_open = 0
            open_quoted = quoted
        elif last_open >= 0:  # ]
            if i + 1 - last_open >= cut and quote_since_open == 0 and open_quoted == 0:
                if count == len(found):
                    state[0] = -2
                    return False
                found[count, 0] = last_open
                found[count, 1] = i + 1
                count += 1
            last_open = -1
    state[0], state[1], state[2], state[3], state[4] = count, last_open, quoted, quote_since_open, open_quoted
    return True


@numba.njit(**_JIT)
def spans(text, cut, found):  # type: ignore[no-untyped-def]
    """Find in a JSON text without escapes every ``[``...``]`` span of at least `cut` bytes that holds no quote and
    no other ``[`` and is not inside a string (every quote opens or closes one); rows of start and end (past the
    ``]``) in `found`. Returns how many, -1 when the text holds a backslash, -2 when `found` is full.

    Blocks without any of the four bytes (most of a large array's text) are passed over by a test the compiler
    vectorizes; the others go through the state machine byte by byte."""
    n = len(text)
    state = np.zeros(6, dtype=np.int64)
    state[1] = -1
    state[5] = cut
    words = text[: n - n % 8].view(np.uint64)
    i = 0
    while i + _BLOCK <= len(words):
        hits = _U0
        for j in range(i, i + _BLOCK):
            w = words[j]
            hits |= _zero_byte(w ^ _QUOTES) | _zero_byte(w ^ _OPENS) | _zero_byte((w & _LOW2_OFF) ^ _CLOSES)
        if hits != _U0 and not _span_bytes(text, i * 8, (i + _BLOCK) * 8, state, found):
            return state[0]
        i += _BLOCK
    if not _span_bytes(text, i * 8, n, state, found):
        return state[0]
    return state[0]


_ONES = np.uint64(0x0101010101010101)
_HIGHS = np.uint64(0x8080808080808080)
_QUOTES = np.uint64(0x2222222222222222)
_OPENS = np.uint64(0x5B5B5B5B5B5B5B5B)
#: ``\`` and ``]`` (0x5C, 0x5D) with their two low bits masked off; ``^`` and ``_`` match too (harmless: the block is
#: then read byte by byte).
_CLOSES = np.uint64(0x5C5C5C5C5C5C5C5C)
_LOW2_OFF = np.uint64(0xFCFCFCFCFCFCFCFC)


@numba.njit(inline="always", **_JIT)
def _zero_byte(w):  # type: ignore[no-untyped-def]
    """Nonzero when a byte of the word `w` is zero (the high bit of each such byte set; others may be too)."""
    return (w - _ONES) & ~w & _HIGHS
