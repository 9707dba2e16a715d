"""The vector IR of the panel kernels (`_panel`): LLVM's generic vector operations on 512-bit values.

`panel_tile` is the micro-kernel: sixteen weight rows (one int32 lane each) against ``rows`` activation rows, all
accumulators in registers; its pair products are written as ``sext``/``mul``/``shufflevector``/``add`` on 32 int16
lanes, which LLVM turns into ``vpdpwssd`` (with the activation pair as a broadcast memory operand) on x86 with
AVX512-VNNI and into that target's equivalents elsewhere. `round_block` rounds a block of activations, `store_codes`
and `transpose_block` build the panel from unpacked codes.
"""

from __future__ import annotations

from typing import Any

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from ._simd import Codegen, lane_order

__all__ = ["GROUP", "PAIRS", "code_sum", "panel_tile", "round_block", "store_codes", "transpose_block"]

#: Weight rows per group: the int32 lanes of one 512-bit vector.
GROUP = 16
_BLOCK = 32
#: Pairs of columns per block of 32.
PAIRS = _BLOCK // 2

_I1, _I16, _I32, _I64 = ir.IntType(1), ir.IntType(16), ir.IntType(32), ir.IntType(64)
_F32 = ir.FloatType()


def _vec(element: ir.Type, lanes: int) -> ir.VectorType:
    return ir.VectorType(element, lanes)


def _constant(element: ir.Type, values: list[int]) -> ir.Constant:
    return ir.Constant(_vec(element, len(values)), [ir.Constant(element, v) for v in values])


def _data(context: Any, builder: ir.IRBuilder, array_type: Any, array: Any, element: ir.Type) -> Any:
    data = context.make_array(array_type)(context, builder, array).data
    return builder.bitcast(data, element.as_pointer())


def _splat(builder: ir.IRBuilder, value: Any, lanes: int) -> Any:
    vector = _vec(value.type, lanes)
    one = builder.insert_element(ir.Constant(vector, ir.Undefined), value, ir.Constant(_I32, 0))
    return builder.shuffle_vector(one, one, _constant(_I32, [0] * lanes))


def _int64(context: Any, builder: ir.IRBuilder, value: Any, numba_type: Any) -> Any:
    return context.cast(builder, value, numba_type, types.int64)


def _at(builder: ir.IRBuilder, base: Any, index: Any, vector: ir.VectorType) -> Any:
    """A pointer to a ``vector`` at element ``index`` of the scalar pointer ``base``."""
    return builder.bitcast(builder.gep(base, [index]), vector.as_pointer())


def _pair_products(builder: ir.IRBuilder, a: Any, b: Any) -> Any:
    """Sixteen int32 lanes, each the sum of the products of a lane pair of the 32 int16 ``a`` and ``b``."""
    wide = _vec(_I32, 2 * GROUP)
    products = builder.mul(builder.sext(a, wide), builder.sext(b, wide))
    even = builder.shuffle_vector(products, products, _constant(_I32, list(range(0, 2 * GROUP, 2))))
    odd = builder.shuffle_vector(products, products, _constant(_I32, list(range(1, 2 * GROUP, 2))))
    return builder.add(even, odd)


@intrinsic
def panel_tile(
    typingctx: Any, codes: Any, scales: Any, xq: Any, xs: Any, out: Any, acc: Any, col: Any, j0: Any, lanes: Any,
    rows: Any,
) -> tuple[Any, Codegen] | None:  # fmt: skip
    """``out[j0 .. j0 + rows, col .. col + lanes]`` (``rows`` a constant, ``lanes`` at most 16) from one panel group.

    ``codes`` (int32 ``[blocks, 16, 16]``: a pair of int16 codes of a weight row) and ``scales`` (float32 ``[blocks,
    16]``) are the group (`_panel.pack_group`); ``xq`` (int32 ``[m, >= blocks * 16]``: pairs of int16 activations)
    and ``xs`` (float32 ``[m, >= blocks]``) the rounded activations (`_panel.quantize_natural`); ``out`` is float32
    ``[m, >= col + lanes]``; ``acc`` a float32 work array of at least ``16 rows`` values.

    Per block: sixteen pair steps, each one weight vector against every activation row's pair broadcast; then the
    int32 sums (one block: at most 32 x 127 x 32767, no overflow) converted and added with one FMA by ``weight scales
    x activation scale``. The float accumulators live in ``acc`` so that LLVM keeps the integer sums and the weight
    vectors, not them, in registers."""
    count = rows.literal_value if isinstance(rows, types.IntegerLiteral) else None
    if count is None:
        return None

    def codegen(context: Any, builder: ir.IRBuilder, sig: Any, args: list[Any]) -> Any:
        arrays = [context.make_array(t)(context, builder, a) for t, a in zip(sig.args[:6], args[:6], strict=True)]
        elements = (_I32, _F32, _I32, _F32, _F32, _F32)
        cp, sp, xp, xsp, op, accp = (
            builder.bitcast(a.data, e.as_pointer()) for a, e in zip(arrays, elements, strict=True)
        )
        col_, j0_, lanes_ = (_int64(context, builder, v, t) for v, t in zip(args[6:9], sig.args[6:9], strict=True))
        blocks = builder.extract_value(arrays[0].shape, 0)
        x_stride = builder.extract_value(arrays[2].shape, 1)
        xs_stride = builder.extract_value(arrays[3].shape, 1)
        out_stride = builder.extract_value(arrays[4].shape, 1)
        f16, i16, h32 = _vec(_F32, GROUP), _vec(_I32, GROUP), _vec(_I16, 2 * GROUP)
        accs = [_at(builder, accp, ir.Constant(_I64, GROUP * j), f16) for j in range(count)]
        for pointer in accs:
            builder.store(ir.Constant(f16, [0.0] * GROUP), pointer, align=4)
        first = [builder.add(j0_, ir.Constant(_I64, j)) for j in range(count)]
        xrow = [builder.mul(j, x_stride) for j in first]
        srow = [builder.mul(j, xs_stride) for j in first]
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(f16, [f16] * 3), "llvm.fma.v16f32")
        with cgutils.for_range(builder, blocks) as loop:
            b = loop.index
            wbase = builder.gep(cp, [builder.mul(b, ir.Constant(_I64, GROUP * PAIRS))])
            xb = builder.mul(b, ir.Constant(_I64, PAIRS))
            sums = [ir.Constant(i16, [0] * GROUP)] * count
            for p in range(PAIRS):
                w = builder.bitcast(builder.load(_at(builder, wbase, ir.Constant(_I64, p * GROUP), i16), align=4), h32)
                for j in range(count):
                    at = builder.add(builder.add(xrow[j], xb), ir.Constant(_I64, p))
                    x = builder.load(builder.gep(xp, [at]), align=4)
                    sums[j] = builder.add(
                        sums[j], _pair_products(builder, w, builder.bitcast(_splat(builder, x, GROUP), h32))
                    )
            wscale = builder.load(_at(builder, sp, builder.mul(b, ir.Constant(_I64, GROUP)), f16), align=4)
            for j in range(count):
                s = builder.load(builder.gep(xsp, [builder.add(srow[j], b)]), align=4)
                both = builder.fmul(wscale, _splat(builder, s, GROUP))
                total = builder.call(fma, [builder.sitofp(sums[j], f16), both, builder.load(accs[j], align=4)])
                builder.store(total, accs[j], align=4)
        store = cgutils.get_or_insert_function(
            builder.module,
            ir.FunctionType(ir.VoidType(), [f16, f16.as_pointer(), _I32, _vec(_I1, GROUP)]),
            "llvm.masked.store.v16f32.p0v16f32",
        )
        keep = builder.icmp_signed("<", _constant(_I64, list(range(GROUP))), _splat(builder, lanes_, GROUP))
        for j in range(count):
            pointer = _at(builder, op, builder.add(builder.mul(first[j], out_stride), col_), f16)
            builder.call(store, [builder.load(accs[j], align=4), pointer, ir.Constant(_I32, 4), keep])
        return context.get_dummy_value()

    return types.none(codes, scales, xq, xs, out, acc, col, j0, lanes, rows), codegen


@intrinsic
def store_codes(typingctx: Any, codes: Any, index: Any, low: Any, high: Any, width: Any) -> tuple[Any, Codegen] | None:
    """Store a block's 32 codes (its two `_simd.unpack_codes` groups of ``width``-bit codes, a constant) as int16 in
    natural column order at flat element ``index`` of the int16 array ``codes``."""
    bits = width.literal_value if isinstance(width, types.IntegerLiteral) else None
    if bits is None:
        return None
    order = lane_order(bits)
    natural = [order.index(code) for code in range(_BLOCK)]

    def codegen(context: Any, builder: ir.IRBuilder, sig: Any, args: list[Any]) -> Any:
        both = builder.shuffle_vector(args[2], args[3], _constant(_I32, natural))
        target = _data(context, builder, sig.args[0], args[0], _I16)
        builder.store(both, _at(builder, target, args[1], _vec(_I16, _BLOCK)), align=2)
        return context.get_dummy_value()

    return types.none(codes, index, low, high, width), codegen


@intrinsic
def transpose_block(typingctx: Any, rows: Any, at: Any, stride: Any, codes: Any, into: Any) -> tuple[Any, Codegen]:
    """Sixteen rows of sixteen int32 (row ``r`` at flat element ``at + r * stride`` of ``rows``) stored transposed
    (column ``c`` at flat element ``into + 16 c`` of ``codes``): four rounds of two-vector shuffles, each swapping
    one bit of the row index with the same bit of the column index."""

    def codegen(context: Any, builder: ir.IRBuilder, sig: Any, args: list[Any]) -> Any:
        i16 = _vec(_I32, GROUP)
        source = _data(context, builder, sig.args[0], args[0], _I32)
        stride = _int64(context, builder, args[2], sig.args[2])
        start = _int64(context, builder, args[1], sig.args[1])
        vectors = [
            builder.load(
                _at(builder, source, builder.add(start, builder.mul(stride, ir.Constant(_I64, r))), i16), align=4
            )
            for r in range(GROUP)
        ]
        for bit in (8, 4, 2, 1):
            low = _constant(_I32, [(GROUP if c & bit else 0) + (c & ~bit) for c in range(GROUP)])
            high = _constant(_I32, [(GROUP if c & bit else 0) + (c | bit) for c in range(GROUP)])
            swapped = list(vectors)
            for r in range(GROUP):
                if not r & bit:
                    swapped[r] = builder.shuffle_vector(vectors[r], vectors[r | bit], low)
                    swapped[r | bit] = builder.shuffle_vector(vectors[r], vectors[r | bit], high)
            vectors = swapped
        target = _data(context, builder, sig.args[3], args[3], _I32)
        into = _int64(context, builder, args[4], sig.args[4])
        for c in range(GROUP):
            builder.store(
                vectors[c], _at(builder, target, builder.add(into, ir.Constant(_I64, GROUP * c)), i16), align=4
            )
        return context.get_dummy_value()

    return types.none(rows, at, stride, codes, into), codegen


@intrinsic
def round_block(
    typingctx: Any, x: Any, at: Any, count: Any, xq: Any, into: Any, inverse_of: Any
) -> tuple[Any, Codegen]:
    """Round the ``count`` (1..32) float32 at flat element ``at`` of ``x`` (the rest of the block counts as zero) to
    int16 at flat element ``into`` of ``xq`` (32 codes) by ``32767 / max|x|``, round-half-even, as
    `_blocks.quantize_activations` does value by value (the same bits for finite ``x``; a NaN makes every code 0 and
    the scale NaN); returns the block's scale ``max|x| * inverse_of``."""

    def codegen(context: Any, builder: ir.IRBuilder, sig: Any, args: list[Any]) -> Any:
        f32 = _vec(_F32, _BLOCK)

        def function(name: str, result: ir.Type, *operands: ir.Type) -> Any:
            return cgutils.get_or_insert_function(builder.module, ir.FunctionType(result, operands), name)

        source = _at(builder, _data(context, builder, sig.args[0], args[0], _F32), args[1], f32)
        limit = _int64(context, builder, args[2], sig.args[2])
        keep = builder.icmp_signed("<", _constant(_I64, list(range(_BLOCK))), _splat(builder, limit, _BLOCK))
        load = function("llvm.masked.load.v32f32.p0v32f32", f32, f32.as_pointer(), _I32, _vec(_I1, _BLOCK), f32)
        values = builder.call(load, [source, ir.Constant(_I32, 4), keep, ir.Constant(f32, [0.0] * _BLOCK)])
        # max |x| as the largest of the magnitudes' bits (a float's order and its bits' agree once the sign bit is
        # cleared): an integer reduction is a tree of vector maxima, where a float maximum with NaN semantics is a
        # chain of scalar ones.
        i32 = _vec(_I32, _BLOCK)
        magnitudes = builder.and_(builder.bitcast(values, i32), _constant(_I32, [0x7FFFFFFF] * _BLOCK))
        largest_bits = builder.call(function("llvm.vector.reduce.umax.v32i32", _I32, i32), [magnitudes])
        largest = builder.bitcast(largest_bits, _F32)
        positive = builder.fcmp_ordered(">", largest, ir.Constant(_F32, 0.0))
        inverse = builder.select(positive, builder.fdiv(ir.Constant(_F32, 32767.0), largest), ir.Constant(_F32, 0.0))
        scaled = builder.fmul(values, _splat(builder, inverse, _BLOCK))
        rounded = builder.call(function("llvm.rint.v32f32", f32, f32), [scaled])
        target = _at(builder, _data(context, builder, sig.args[3], args[3], _I16), args[4], _vec(_I16, _BLOCK))
        builder.store(builder.fptosi(rounded, _vec(_I16, _BLOCK)), target, align=2)
        return builder.fmul(largest, args[5])

    return types.float32(x, at, count, xq, into, types.float32), codegen


@intrinsic
def code_sum(typingctx: Any, xq: Any, at: Any) -> tuple[Any, Codegen]:
    """The sum of the 32 int16 at flat element ``at`` of the C-contiguous array ``xq`` (a block's codes)."""

    def codegen(context: Any, builder: ir.IRBuilder, sig: Any, args: list[Any]) -> Any:
        codes = builder.load(
            _at(builder, _data(context, builder, sig.args[0], args[0], _I16), args[1], _vec(_I16, _BLOCK)), align=2
        )
        wide = builder.sext(codes, _vec(_I32, _BLOCK))
        reduce = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(_I32, [_vec(_I32, _BLOCK)]), "llvm.vector.reduce.add.v32i32"
        )
        return builder.sext(builder.call(reduce, [wide]), _I64)

    return types.int64(xq, at), codegen
