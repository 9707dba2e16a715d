"""Eight- and sixteen-lane vector values for numba kernels, written as portable LLVM vector IR.

numba has no vector types, and LLVM's auto-vectorizer does not find the structure of a quantized dot product (a
short per-block reduction scaled by a per-block factor): on plain loops it vectorized the wrong loop or none
(docs/performance.md, "Compiled kernels"). These intrinsics say the structure explicitly, with LLVM's generic vector
operations only (``shufflevector``, ``shl``/``ashr``, ``sext``/``mul``/``add``, ``llvm.fma``), so the backend picks
the instructions of the machine the kernel is compiled on: on x86 with AVX2 a block's codes become one broadcast
load, two byte shuffles and shifts, and two ``vpmaddwd``; elsewhere (NEON, SSE) the same IR lowers to that
target's equivalents.

Values: `F32x8` (eight float32), `I32x8`, `I16x16`. Code unpacking: `unpack_codes(payload, byte_index, width,
group)` turns half of a 32-code block of ``width``-bit codes into sixteen int16 lanes, in the lane order
`lane_order` gives, so activations quantized into that order line up with them. 4-bit codes have a cheaper form,
`nibbles`: two blocks' 32 bytes read as sixteen 16-bit words, one nibble of each word per vector (a mask and a
shift, no byte shuffles), as unsigned codes ``code + 8`` (`nibble_order` gives the lanes).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, models, register_model

__all__ = [
    "Codegen",
    "F32x8",
    "I16x16",
    "I32x8",
    "VectorType",
    "broadcast",
    "first_lanes",
    "float_of_bits",
    "fma",
    "hsum",
    "iadd",
    "lane_order",
    "load_f16",
    "load_f16x8",
    "load_f32x8",
    "load_i16x16",
    "load_u8x8",
    "madd",
    "mul",
    "nibble_order",
    "nibbles",
    "prefetch",
    "splat",
    "spread",
    "store_f32x8",
    "store_natural",
    "store_scaled",
    "to_float",
    "to_nibble_order",
    "unpack_codes",
    "zeros",
]

_I8, _I16, _I32, _I64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
_F32 = ir.FloatType()
_ELEMENTS = {"f32": _F32, "i16": _I16, "i32": _I32}
_BYTES = {"f32": 4, "i16": 2, "i32": 4}
_BLOCK = 32
_GROUP = 16  # codes per unpacked vector: a block is two groups


class VectorType(types.Type):
    """A numba type whose value is one LLVM vector of ``lanes`` ``kind`` elements (kept in a register)."""

    def __init__(self, kind: str, lanes: int) -> None:
        self.kind, self.lanes = kind, lanes
        super().__init__(name=f"{kind}x{lanes}")


F32x8 = VectorType("f32", 8)
I32x8 = VectorType("i32", 8)
I16x16 = VectorType("i16", 16)


@register_model(VectorType)
class _VectorModel(models.PrimitiveModel):
    def __init__(self, dmm: Any, fe_type: VectorType) -> None:
        super().__init__(dmm, fe_type, _llvm(fe_type))


def _llvm(vector: VectorType) -> ir.VectorType:
    return ir.VectorType(_ELEMENTS[vector.kind], vector.lanes)


def _constant(element: ir.Type, values: list[int] | list[float]) -> ir.Constant:
    return ir.Constant(ir.VectorType(element, len(values)), [ir.Constant(element, v) for v in values])


def _element_pointer(context: Any, builder: ir.IRBuilder, array_type: Any, array: Any, element: ir.Type) -> Any:
    data = context.make_array(array_type)(context, builder, array).data
    return builder.bitcast(data, element.as_pointer())


def _literal(value: Any) -> int | None:
    return value.literal_value if isinstance(value, types.IntegerLiteral) else None


Codegen = Callable[[Any, ir.IRBuilder, Any, list[Any]], Any]


@intrinsic
def zeros(typingctx: Any) -> tuple[Any, Codegen]:
    """Eight float32 zeros."""

    def codegen(context: Any, builder: ir.IRBuilder, sig: Any, args: list[Any]) -> Any:
        return ir.Constant(_llvm(F32x8), [0.0] * 8)

    return F32x8(), codegen


@intrinsic
def splat(typingctx: Any, value: Any) -> tuple[Any, Codegen]:
    """A float32 in all eight lanes."""

    def codegen(context: Any, builder: ir.IRBuilder, sig: Any, args: list[Any]) -> Any:
        one = builder.insert_element(ir.Constant(_llvm(F32x8), ir.Undefined), args[0], ir.Constant(_I32, 0))
        return builder.shuffle_vector(one, one, _constant(_I32, [0] * 8))

    return F32x8(types.float32), codegen


@intrinsic
def broadcast(typingctx: Any, array: Any, index: Any) -> tuple[Any, Codegen]:
    """The float32 at flat element ``index`` of a C-contiguous float32 array, in all eight lanes (one load; no
    negative-index wrap-around, the caller's index is in range)."""

    def codegen(context: Any, builder: ir.IRBuilder, sig: Any, args: list[Any]) -> Any:
        pointer = builder.gep(_element_pointer(context, builder, sig.args[0], args[0], _F32), [args[1]])
        one = builder.insert_element(
            ir.Constant(_llvm(F32x8), ir.Undefined), builder.load(pointer, align=4), ir.Constant(_I32, 0)
        )
        return builder.shuffle_vector(one, one, _constant(_I32, [0] * 8))

    return F32x8(array, index), codegen


@intrinsic
def store_f32x8(typingctx: Any, array: Any, index: Any, vector: Any) -> tuple[Any, Codegen]:
    """Store eight float32 into a C-contiguous float32 array at flat element ``index``."""

    def codegen(context: Any, builder: ir.IRBuilder, sig: Any, args: list[Any]) -> Any:
        pointer = builder.gep(_element_pointer(context, builder, sig.args[0], args[0], _F32), [args[1]])
        builder.store(args[2], builder.bitcast(pointer, _llvm(F32x8).as_pointer()), align=4)
        return context.get_dummy_value()

    return types.none(array, index, F32x8), codegen


@intrinsic
def load_f16x8(typingctx: Any, array: Any, byte_index: Any) -> tuple[Any, Codegen]:
    """Eight little-endian IEEE halves from ``byte_index`` of a uint8 array, as float32 (exact)."""

    def codegen(context: Any, builder: ir.IRBuilder, sig: Any, args: list[Any]) -> Any:
        pointer = builder.gep(_element_pointer(context, builder, sig.args[0], args[0], _I8), [args[1]])
        halves = ir.VectorType(ir.HalfType(), 8)
        return builder.fpext(builder.load(builder.bitcast(pointer, halves.as_pointer()), align=1), _llvm(F32x8))

    return F32x8(array, byte_index), codegen


@intrinsic
def load_u8x8(typingctx: Any, array: Any, byte_index: Any) -> tuple[Any, Codegen]:
    """Eight unsigned bytes from ``byte_index`` of a uint8 array, as float32."""

    def codegen(context: Any, builder: ir.IRBuilder, sig: Any, args: list[Any]) -> Any:
        pointer = builder.gep(_element_pointer(context, builder, sig.args[0], args[0], _I8), [args[1]])
        raw = builder.load(builder.bitcast(pointer, ir.VectorType(_I8, 8).as_pointer()), align=1)
        return builder.uitofp(raw, _llvm(F32x8))

    return F32x8(array, byte_index), codegen


@intrinsic
def fma(typingctx: Any, a: Any, b: Any, c: Any) -> tuple[Any, Codegen]:
    """``a * b + c`` lane by lane, rounded once."""

    def codegen(context: Any, builder: ir.IRBuilder, sig: Any, args: list[Any]) -> Any:
        vector = _llvm(F32x8)
        function = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(vector, [vector] * 3), "llvm.fma.v8f32"
        )
        return builder.call(function, args)

    return F32x8(F32x8, F32x8, F32x8), codegen


@intrinsic
def first_lanes(typingctx: Any, vector: Any, count: Any) -> tuple[Any, Codegen]:
    """Eight float32 with the lanes from ``count`` on set to zero (a row's last, partial group of blocks)."""

    def codegen(context: Any, builder: ir.IRBuilder, sig: Any, args: list[Any]) -> Any:
        limit = context.cast(builder, args[1], sig.args[1], types.int32)
        one = builder.insert_element(ir.Constant(ir.VectorType(_I32, 8), ir.Undefined), limit, ir.Constant(_I32, 0))
        limits = builder.shuffle_vector(one, one, _constant(_I32, [0] * 8))
        keep = builder.icmp_signed("<", _constant(_I32, list(range(8))), limits)
        return builder.select(keep, args[0], ir.Constant(_llvm(F32x8), [0.0] * 8))

    return F32x8(F32x8, count), codegen


@intrinsic
def hsum(typingctx: Any, vector: Any) -> tuple[Any, Codegen]:
    """The sum of the eight lanes (pairwise: halves, then quarters, then the last two)."""

    def codegen(context: Any, builder: ir.IRBuilder, sig: Any, args: list[Any]) -> Any:
        v = args[0]
        four = builder.fadd(
            builder.shuffle_vector(v, v, _constant(_I32, [0, 1, 2, 3])),
            builder.shuffle_vector(v, v, _constant(_I32, [4, 5, 6, 7])),
        )
        two = builder.fadd(
            builder.shuffle_vector(four, four, _constant(_I32, [0, 1])),
            builder.shuffle_vector(four, four, _constant(_I32, [2, 3])),
        )
        return builder.fadd(
            builder.extract_element(two, ir.Constant(_I32, 0)), builder.extract_element(two, ir.Constant(_I32, 1))
        )

    return types.float32(F32x8), codegen


@intrinsic
def float_of_bits(typingctx: Any, bits: Any) -> tuple[Any, Codegen]:
    """The float32 whose bits are the integer ``bits`` (taken as int32)."""

    def codegen(context: Any, builder: ir.IRBuilder, sig: Any, args: list[Any]) -> Any:
        return builder.bitcast(context.cast(builder, args[0], sig.args[0], types.int32), _F32)

    return types.float32(bits), codegen


@intrinsic
def load_f16(typingctx: Any, array: Any, byte_index: Any) -> tuple[Any, Codegen]:
    """The little-endian IEEE half at ``byte_index`` of a uint8 array, as float32 (exact)."""

    def codegen(context: Any, builder: ir.IRBuilder, sig: Any, args: list[Any]) -> Any:
        pointer = builder.gep(_element_pointer(context, builder, sig.args[0], args[0], _I8), [args[1]])
        half = builder.load(builder.bitcast(pointer, ir.HalfType().as_pointer()), align=1)
        return builder.fpext(half, _F32)

    return types.float32(array, byte_index), codegen


@intrinsic
def madd(typingctx: Any, a: Any, b: Any) -> tuple[Any, Codegen]:
    """Sixteen int16 products, summed pairwise into eight int32 lanes (x86: one ``vpmaddwd``)."""

    def codegen(context: Any, builder: ir.IRBuilder, sig: Any, args: list[Any]) -> Any:
        wide = ir.VectorType(_I32, 16)
        products = builder.mul(builder.sext(args[0], wide), builder.sext(args[1], wide))
        even = builder.shuffle_vector(products, products, _constant(_I32, list(range(0, 16, 2))))
        odd = builder.shuffle_vector(products, products, _constant(_I32, list(range(1, 16, 2))))
        return builder.add(even, odd)

    return I32x8(I16x16, I16x16), codegen


@intrinsic
def to_float(typingctx: Any, a: Any) -> tuple[Any, Codegen]:
    """int32 lanes converted to float32 (exact below 2**24)."""

    def codegen(context: Any, builder: ir.IRBuilder, sig: Any, args: list[Any]) -> Any:
        return builder.sitofp(args[0], _llvm(F32x8))

    return F32x8(I32x8), codegen


@intrinsic
def store_scaled(typingctx: Any, array: Any, index: Any, codes: Any, scale: Any) -> tuple[Any, Codegen]:
    """Store sixteen int16 ``codes`` times the float32 ``scale`` into a float32 array at flat element ``index``."""

    def codegen(context: Any, builder: ir.IRBuilder, sig: Any, args: list[Any]) -> Any:
        floats = ir.VectorType(_F32, 16)
        values = builder.sitofp(args[2], floats)
        one = builder.insert_element(ir.Constant(floats, ir.Undefined), args[3], ir.Constant(_I32, 0))
        values = builder.fmul(values, builder.shuffle_vector(one, one, _constant(_I32, [0] * 16)))
        pointer = builder.gep(_element_pointer(context, builder, sig.args[0], args[0], _F32), [args[1]])
        builder.store(values, builder.bitcast(pointer, floats.as_pointer()), align=4)
        return context.get_dummy_value()

    return types.none(array, index, I16x16, types.float32), codegen


@intrinsic
def store_natural(
    typingctx: Any, array: Any, index: Any, low: Any, high: Any, scale: Any, width: Any
) -> tuple[Any, Codegen] | None:
    """Store a block's 32 codes (its two `unpack_codes` groups ``low`` and ``high`` of ``width``-bit codes, a
    constant) times the float32 ``scale`` into a float32 array at flat element ``index``, in the block's natural
    column order."""
    bits = _literal(width)
    if bits is None:
        return None
    order = lane_order(bits)
    natural = [order.index(code) for code in range(_BLOCK)]

    def codegen(context: Any, builder: ir.IRBuilder, sig: Any, args: list[Any]) -> Any:
        floats = ir.VectorType(_F32, _GROUP)
        both = builder.shuffle_vector(
            builder.sitofp(args[2], floats), builder.sitofp(args[3], floats), _constant(_I32, natural)
        )
        lanes = ir.VectorType(_F32, _BLOCK)
        one = builder.insert_element(ir.Constant(lanes, ir.Undefined), args[4], ir.Constant(_I32, 0))
        values = builder.fmul(both, builder.shuffle_vector(one, one, _constant(_I32, [0] * _BLOCK)))
        pointer = builder.gep(_element_pointer(context, builder, sig.args[0], args[0], _F32), [args[1]])
        builder.store(values, builder.bitcast(pointer, lanes.as_pointer()), align=4)
        return context.get_dummy_value()

    return types.none(array, index, I16x16, I16x16, types.float32, width), codegen


def _vector_load(vector: VectorType, doc: str) -> Any:
    """An intrinsic loading one ``vector`` from a C-contiguous array of its element type at a flat element index."""
    element = _ELEMENTS[vector.kind]

    def typer(typingctx: Any, array: Any, index: Any) -> tuple[Any, Codegen]:
        def codegen(context: Any, builder: ir.IRBuilder, sig: Any, args: list[Any]) -> Any:
            pointer = builder.gep(_element_pointer(context, builder, sig.args[0], args[0], element), [args[1]])
            return builder.load(builder.bitcast(pointer, _llvm(vector).as_pointer()), align=_BYTES[vector.kind])

        return vector(array, index), codegen

    typer.__doc__ = doc
    typer.__name__ = typer.__qualname__ = f"load_{vector.name}"
    return intrinsic(typer)


load_f32x8 = _vector_load(F32x8, "Eight float32 from a C-contiguous float32 array at flat element ``index``.")
load_i16x16 = _vector_load(I16x16, "Sixteen int16 from a C-contiguous int16 array at flat element ``index``.")


def _lanewise(vector: VectorType, instruction: str, doc: str) -> Any:
    """An intrinsic combining two ``vector`` values lane by lane with one IRBuilder ``instruction``."""

    def typer(typingctx: Any, a: Any, b: Any) -> tuple[Any, Codegen]:
        def codegen(context: Any, builder: ir.IRBuilder, sig: Any, args: list[Any]) -> Any:
            return getattr(builder, instruction)(args[0], args[1])

        return vector(vector, vector), codegen

    typer.__doc__ = doc
    typer.__name__ = typer.__qualname__ = instruction
    return intrinsic(typer)


mul = _lanewise(F32x8, "fmul", "Lane-wise float32 product.")
iadd = _lanewise(I32x8, "add", "Lane-wise int32 sum.")


# --- code unpacking ------------------------------------------------------------------------------------------------
def lane_order(width: int) -> tuple[int, ...]:
    """Which code of a 32-code block each of the 32 lanes (two groups of 16) holds.

    Chosen so that the lanes of one group need as few distinct shifts as possible: for 4-bit codes the first group
    holds the low nibbles (codes 0, 2, ..., 30) and the second the high ones, so each group is a zero-extension of
    the block's 16 bytes and one shift pair; 2-bit codes pair bit offsets 0/2 and 4/6 the same way. Other widths keep
    the natural order.
    """
    if width == 4:
        return (*range(0, _BLOCK, 2), *range(1, _BLOCK, 2))
    if width == 2:
        return tuple(4 * (lane % 8) + 2 * group + lane // 8 for group in range(2) for lane in range(16))
    return tuple(range(_BLOCK))


def _group_plan(width: int, group: int) -> tuple[int, list[int], list[int]]:
    """How group ``group`` (lanes ``16 * group ..``) of a block is built: the offset of a 16-byte window relative to
    the block start, then for every lane the window bytes of its 16-bit word (16 = a zero byte) and the left shift
    that puts the code's top bit at bit 15.

    A window never reaches past the block's end, so the last block of a payload is read without overrun; for 2- and
    3-bit codes (8- and 12-byte blocks) it starts before the block: inside the previous block, or, for a payload's
    first block, inside the 64-byte-aligned regions that precede the codes in every k* payload.
    """
    order = lane_order(width)[_GROUP * group : _GROUP * (group + 1)]
    block_bytes = _BLOCK * width // 8
    first = min(width * code // 8 for code in order)
    start = min(first, block_bytes - _GROUP)
    indices: list[int] = []
    shifts: list[int] = []
    for code in order:
        byte, bit = divmod(width * code, 8)
        indices += [byte - start, byte - start + 1 if bit + width > 8 else _GROUP]
        shifts.append(16 - width - bit)
    return start, indices, shifts


@intrinsic
def unpack_codes(typingctx: Any, payload: Any, byte_index: Any, width: Any, group: Any) -> tuple[Any, Codegen] | None:
    """Sixteen signed ``width``-bit codes (``width`` and ``group`` are compile-time constants) of the block whose
    packed bytes start at ``byte_index`` of the uint8 array ``payload``, sign-extended to int16 lanes in
    `lane_order`."""
    bits, half = _literal(width), _literal(group)
    if bits is None or half is None:
        return None  # numba retries with the constants as literals
    start, indices, shifts = _group_plan(bits, half)

    def codegen(context: Any, builder: ir.IRBuilder, sig: Any, args: list[Any]) -> Any:
        base = _element_pointer(context, builder, sig.args[0], args[0], _I8)
        pointer = builder.gep(base, [builder.add(args[1], ir.Constant(_I64, start))])
        window = builder.load(builder.bitcast(pointer, ir.VectorType(_I8, _GROUP).as_pointer()), align=1)
        if bits == 8:
            return builder.sext(window, _llvm(I16x16))
        zero = ir.Constant(ir.VectorType(_I8, _GROUP), [0] * _GROUP)
        words = builder.bitcast(builder.shuffle_vector(window, zero, _constant(_I32, indices)), _llvm(I16x16))
        words = builder.shl(words, _constant(_I16, shifts))
        return builder.ashr(words, _constant(_I16, [16 - bits] * _GROUP))

    return I16x16(payload, byte_index, width, group), codegen


# --- 4-bit codes as words ------------------------------------------------------------------------------------------
def nibble_order() -> tuple[int, ...]:
    """Which code of a pair of 4-bit blocks (64 codes, block ``b`` then ``b + 1``) each of the 64 lanes of `nibbles`
    holds: vector ``k`` (lanes ``16 k ..``) is nibble ``k`` of the sixteen words; words 0-7 are the first block's
    bytes, 8-15 the second's, and a word's nibbles are codes ``4 w .. 4 w + 3``."""
    return tuple((word // 8) * _BLOCK + 4 * (word % 8) + k for k in range(4) for word in range(16))


@intrinsic
def to_nibble_order(typingctx: Any, codes: Any, index: Any) -> tuple[Any, Codegen]:
    """Reorder in place the 64 int16 at flat element ``index`` of the C-contiguous array ``codes`` (a pair of
    blocks' activations, block ``b`` then ``b + 1`` in column order) into the lanes of `nibble_order`."""
    order = list(nibble_order())

    def codegen(context: Any, builder: ir.IRBuilder, sig: Any, args: list[Any]) -> Any:
        vector = ir.VectorType(_I16, len(order))
        start = builder.gep(_element_pointer(context, builder, sig.args[0], args[0], _I16), [args[1]])
        pointer = builder.bitcast(start, vector.as_pointer())
        natural = builder.load(pointer, align=2)
        builder.store(builder.shuffle_vector(natural, natural, _constant(_I32, order)), pointer, align=2)
        return context.get_dummy_value()

    return types.none(codes, index), codegen


@intrinsic
def nibbles(typingctx: Any, payload: Any, byte_index: Any, k: Any, half: Any) -> tuple[Any, Codegen] | None:
    """Nibble ``k`` (a compile-time constant) of the sixteen 16-bit words at ``byte_index`` of the uint8 array
    ``payload``, as unsigned codes ``code + 8`` (0..15) in int16 lanes, lane order `nibble_order`. With ``half`` (a
    constant) 1 only one block (16 bytes, eight words) is read and lanes 8-15 are zero: a row's odd last block,
    read without touching the bytes after it."""
    shift, single = _literal(k), _literal(half)
    if shift is None or single is None:
        return None  # numba retries with the constants as literals

    def codegen(context: Any, builder: ir.IRBuilder, sig: Any, args: list[Any]) -> Any:
        pointer = builder.gep(_element_pointer(context, builder, sig.args[0], args[0], _I8), [args[1]])
        lanes = 8 if single else 16
        words = builder.load(builder.bitcast(pointer, ir.VectorType(_I16, lanes).as_pointer()), align=1)
        words = builder.xor(words, _constant(_I16, [0x8888] * lanes))  # two's complement -> offset binary
        if shift:
            words = builder.lshr(words, _constant(_I16, [4 * shift] * lanes))
        if shift != 3:
            words = builder.and_(words, _constant(_I16, [15] * lanes))
        if single:
            zero = ir.Constant(ir.VectorType(_I16, 8), [0] * 8)
            words = builder.shuffle_vector(words, zero, _constant(_I32, list(range(16))))
        return words

    return I16x16(payload, byte_index, k, half), codegen


@intrinsic
def spread(typingctx: Any, vector: Any, k: Any) -> tuple[Any, Codegen] | None:
    """Lanes ``2 k`` and ``2 k + 1`` of eight float32 (``k`` a constant), each repeated in four lanes: the scales of
    a pair of blocks laid out as `nibbles`' products are."""
    pair = _literal(k)
    if pair is None:
        return None

    def codegen(context: Any, builder: ir.IRBuilder, sig: Any, args: list[Any]) -> Any:
        return builder.shuffle_vector(args[0], args[0], _constant(_I32, [2 * pair] * 4 + [2 * pair + 1] * 4))

    return F32x8(F32x8, k), codegen


@intrinsic
def prefetch(typingctx: Any, payload: Any, byte_index: Any) -> tuple[Any, Codegen]:
    """Ask the cache to fetch the line holding byte ``byte_index`` of the uint8 array ``payload`` for reading
    (``llvm.prefetch``; a hint: no fault past the end, nothing where the machine has no such instruction)."""

    def codegen(context: Any, builder: ir.IRBuilder, sig: Any, args: list[Any]) -> Any:
        pointer = builder.gep(_element_pointer(context, builder, sig.args[0], args[0], _I8), [args[1]])
        function = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [_I8.as_pointer(), _I32, _I32, _I32]), "llvm.prefetch.p0i8"
        )
        builder.call(function, [pointer, ir.Constant(_I32, 0), ir.Constant(_I32, 3), ir.Constant(_I32, 1)])
        return context.get_dummy_value()

    return types.none(payload, byte_index), codegen
