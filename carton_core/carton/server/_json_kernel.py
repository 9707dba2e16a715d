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
general way, which names the fault.
"""

from __future__ import annotations

import numba
import numpy as np

__all__ = ["DECLINED", "read"]

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


@numba.njit(**_JIT)
def read(text, integral, low, high, floats, integers, slow):  # type: ignore[no-untyped-def]
    """Parse `text` (a JSON value: nested arrays of numbers, or one number) into `floats` (float64) or, when
    `integral`, into `integers` (int64, each within ``low .. high``).

    Returns ``(count, listed)``: the number of elements (the buffer holds ``min(count, len)`` of them), and how many
    were listed in `slow` (rows of element index, start and end offset in `text`) for the caller to read with
    ``float``; count is `DECLINED` when the text is anything else, or `slow` is full."""
    n = len(text)
    capacity = len(floats) if not integral else len(integers)
    bits = floats.view(np.uint64)
    listed = 0
    count = 0
    depth = 0
    i = _space(text, 0, n)
    if i == n:
        return DECLINED, 0
    while True:
        # A value starts at i.
        closed = False
        if text[i] == 91:  # [
            depth += 1
            if depth > _MAX_DEPTH:
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
            c = text[i]
            if c < 48 or c > 57:
                return DECLINED, 0
            w = _U0
            digits = 0
            if c == 48:
                i += 1
            else:
                i, w, digits, _ = _digit_run(text, i, n, w, digits)
            point = 0
            fraction = False
            if i < n and text[i] == 46:  # .
                fraction = True
                i += 1
                first = i
                i, w, digits, point = _digit_run(text, i, n, w, digits)
                if i == first:
                    return DECLINED, 0
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
                            bits[count] = found | (np.uint64(1) << np.uint64(63)) if negative else found
                if not settled:  # left to the caller's float()
                    if listed == len(slow):
                        return DECLINED, 0
                    slow[listed, 0] = count
                    slow[listed, 1] = start
                    slow[listed, 2] = i
                    listed += 1
            count += 1
        # A value ended at i: a comma, closing brackets, or the end.
        i = _space(text, i, n)
        while True:
            if depth == 0:
                return (count, listed) if i == n else (DECLINED, 0)
            if i == n:
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
