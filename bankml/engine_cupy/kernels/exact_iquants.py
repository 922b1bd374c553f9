"""IQ and TQ matrix products that round exactly as llama-server's AVX2 CPU backend: IQ4_NL and
IQ4_XS (below), and the grid types IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S and the
ternary TQ1_0, TQ2_0 (``IQGridMatrix``; their arithmetic is described at its section).

Both types store 4-bit indices into ggml's non-linear table ``kvalues_iq4nl`` (16 int8 values
from -127 to 113) and multiply them as signed bytes against an 8-bit activation (``psign`` moves
the weight's sign onto the activation, ``pmaddubsw`` + ``pmaddwd`` give exact int32 lanes; lane
L of a 32-value block = the products of its elements 4L..4L+3). Only the float operations
differ by path, so only they are kept in ggml's order:

IQ4_NL (blocks of 32: f16 d, 16 bytes of nibbles; activation rounded to q8_0 as for Q4_0):

- ``vec_dot`` (arch/x86/quants.c ``ggml_vec_dot_iq4_nl_q8_0``; one activation row, matrix not
  repacked): two ``<8 x float>`` accumulators, even blocks into the first and odd into the
  second, ``acc = fma(d_x·d_w, lanes, acc)``; then ``hsum_float_8(acc1 + acc2)``; an odd last
  block is a scalar ``sum = fma(d_x·d_w, float(Σ), sum)`` (GCC contracts the C ``sumf += d*…``:
  vfmadd231ss in the build's quants.c.o).
- tinyBLAS (llamafile/sgemm.cpp ``tinyBLAS_Q0_AVX<block_iq4_nl>``; two rows or more, not
  repacked): one accumulator, ``acc = fma(d_w·d_x, lanes, acc)`` over the blocks, hsum_float_8.
- repacked (arch/x86/repack.cpp ``iq4_nl_8x8`` gemv/gemm, the q4_b32 LUT templates shared with
  Q4_0; llama-server repacks IQ4_NL matrices whose row count is a multiple of 8, not the token
  embedding): the block's 32 products as one integer, ``acc = fma(Σ, d_w·d_x, acc)``, no
  horizontal sum. gemm's 4-row activation packing rounds as quantize_row_q8_0 does.

IQ4_XS (super-blocks of 256: f16 d, 6-bit scales per 32 values; activation rounded to q8_K as
for the K-quants; never repacked on x86):

- ``vec_dot`` (``ggml_vec_dot_iq4_xs_q8_K``, fewer than 8 rows): eight int32 lanes per
  super-block, each 32-value sub-block's lanes weighted by its scale ``ls - 32`` (``pmaddwd``),
  ``acc = fma(d_w·d_x, lanes, acc)``, hsum_float_8.
- tiled (tiled/tiled-kernel.cpp, 8 rows or more, the sign-trick MAC): one exact integer ``s1``
  per super-block, ``res = d_w·float(s1)``, ``out = fma(res, d_x, out)``.

The weights stay in their GGUF block bytes and are unpacked in registers (a ``pshufb`` of the
nibbles into the table, as ggml does).
"""

from __future__ import annotations

import functools

import numpy
from gguf import GGMLQuantizationType as T
from gguf import quants
from llvmlite import ir
from numba import prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from bankml.engine_cupy.kernels.exact_kquants import QK_K, TILED_MIN_ROWS, KActivation, KMatrixStack
from bankml.engine_cupy.kernels.exact_kquants import _quantize_serial as _quantize_q8_K
from bankml.engine_cupy.kernels.exact_matmul import (
    HOST_HAS_AVX2,
    PARALLEL_MIN_MACS,
    QK,
    Activation,
    BlockRows,
    MatrixStack,
    _byte_ptr,
    _call,
    _data,
    _half,
    _hsum,
    _load,
    _nibbles,
    _splat,
)
from bankml.engine_cupy.kernels.exact_matmul import _quantize_serial as _quantize_q8_0
from bankml.engine_cupy.kernels.jit import fma32, njit

__all__ = [
    "IQuantMatrix",
    "IQ4NLMatrix",
    "IQ4XSMatrix",
    "IQGridMatrix",
    "supported",
    "repacked_by_llama_server",
    "KVALUES_IQ4NL",
]

# ggml-common.h kvalues_iq4nl: the value each 4-bit index stands for (gguf-py carries the same table)
KVALUES_IQ4NL = tuple(int(v) for v in quants.IQ4_NL.kvalues)
_BLOCK = {T.IQ4_NL: (QK, 18), T.IQ4_XS: (QK_K, 136)}  # values and bytes per block
ROWS_PER_TASK = 16  # output rows per parallel task

# arithmetic codes
_NL_VD, _NL_TB, _NL_RP, _XS_VD, _XS_T = range(5)
_XS_CODES = {_XS_VD, _XS_T}

_I8, _I16, _I32, _F32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.FloatType()
_V32I8, _V16I16, _V8I32, _V8F = (
    ir.VectorType(_I8, 32),
    ir.VectorType(_I16, 16),
    ir.VectorType(_I32, 8),
    ir.VectorType(_F32, 8),
)


def supported(qtype: T | int) -> bool:
    """Whether this module reproduces ggml's product for this weight type on this host."""
    try:
        return HOST_HAS_AVX2 and T(qtype) in _BLOCK
    except ValueError:
        return False


def repacked_by_llama_server(qtype: T | int, n_out: int, token_embd: bool = False) -> bool:
    """ggml_repack_get_optimal_repack_type on AVX2: IQ4_NL -> iq4_nl_8x8 when the row count is
    a multiple of 8 (not the token embedding, whose first use is GET_ROWS); IQ4_XS has no
    repacked layout."""
    return T(qtype) == T.IQ4_NL and n_out % 8 == 0 and not token_embd


# ---------------------------------------------------------------------------------------------
# Dot products as LLVM IR (AVX2)


def _table_values(builder: ir.IRBuilder, base: ir.Value, offset: ir.Value) -> ir.Value:
    """16 bytes of nibbles at base+offset -> the 32 int8 table values (low nibbles are elements
    0..15, high nibbles 16..31), by pshufb into kvalues_iq4nl as ggml does."""
    table = ir.Constant(_V32I8, list(KVALUES_IQ4NL) * 2)
    return _call(builder, "llvm.x86.avx2.pshuf.b", _V32I8, [table, _nibbles(builder, base, offset)])


def _signed_pairs(builder: ir.IRBuilder, w: ir.Value, x: ir.Value) -> ir.Value:
    """pmaddubsw(|w|, x·sign(w)): the 16 exact int16 sums of adjacent products w·x."""
    aw = _call(builder, "llvm.x86.avx2.psign.b", _V32I8, [w, w])
    sx = _call(builder, "llvm.x86.avx2.psign.b", _V32I8, [x, w])
    return _call(builder, "llvm.x86.avx2.pmadd.ub.sw", _V16I16, [aw, sx])


def _xs_scale(builder: ir.IRBuilder, wbase: ir.Value, blk: ir.Value, ib: int) -> ir.Value:
    """Sub-block ib's signed scale of a block_iq4_xs as <16 x i16>: 4 low bits from scales_l
    (at +4), 2 high bits from scales_h (u16 at +2), minus 32."""
    low = builder.zext(
        _load(builder, wbase, builder.add(blk, ir.Constant(blk.type, 4 + ib // 2)), _I8), _I16
    )
    low = builder.and_(builder.lshr(low, ir.Constant(_I16, 4 * (ib % 2))), ir.Constant(_I16, 15))
    high = _load(builder, wbase, builder.add(blk, ir.Constant(blk.type, 2)), _I16)
    high = builder.shl(
        builder.and_(builder.lshr(high, ir.Constant(_I16, 2 * ib)), ir.Constant(_I16, 3)),
        ir.Constant(_I16, 4),
    )
    value = builder.sub(builder.or_(low, high), ir.Constant(_I16, 32))
    return _splat(builder, value, _V16I16)


def _make_dot(code: int, rn: int):
    """dot(w, w_off, xq, x_off, n_in, xd, s_off, nb, out, o_off, n_out): rn outputs of
    arithmetic ``code`` (see the module docstring) over nb blocks, one weight row against rn
    activation rows. The weight row is at byte w_off of w (uint8), unpacked once per block for
    all rn rows; activation row j's quants are at x_off + j·n_in of xq (int8), its block scales
    at s_off + j·nb of xd (f32); its output goes to out.flat[o_off + j·n_out]."""
    xs = code in _XS_CODES
    qk, block_bytes = _BLOCK[T.IQ4_XS if xs else T.IQ4_NL]
    scalar_acc = code in (_NL_RP, _XS_T)

    @intrinsic
    def dot(typingctx, w, w_off, xq, x_off, n_in, xd, s_off, nb, out, o_off, n_out):
        sig = types.void(w, w_off, xq, x_off, n_in, xd, s_off, nb, out, o_off, n_out)

        def codegen(context, builder, signature, args):
            aty = signature.args
            (_, w_off, _, x_off, n_in, _, s_off, nblocks, _, o_off, n_out) = args
            wbase, xbase = (
                _byte_ptr(context, builder, aty[0], args[0]),
                _byte_ptr(context, builder, aty[2], args[2]),
            )
            xdp, obase = (
                _data(context, builder, aty[5], args[5]),
                _data(context, builder, aty[8], args[8]),
            )
            ity = w_off.type

            def const(v: int) -> ir.Value:
                return ir.Constant(ity, v)

            zero = ir.Constant(_F32, 0.0) if scalar_acc else ir.Constant(_V8F, [0.0] * 8)
            n_acc = 2 if code == _NL_VD else 1  # vec_dot's even/odd block accumulators
            acc = [
                [cgutils.alloca_once_value(builder, zero) for _ in range(n_acc)] for _ in range(rn)
            ]
            ones = ir.Constant(_V16I16, [1] * 16)

            def block(b: ir.Value) -> tuple:
                """The weight block's d and, per 32 values, (int8 values, scale for pmaddwd)."""
                blk = builder.add(w_off, builder.mul(b, const(block_bytes)))
                if xs:
                    parts = [
                        (
                            _table_values(builder, wbase, builder.add(blk, const(8 + 16 * ib))),
                            _xs_scale(builder, wbase, blk, ib),
                        )
                        for ib in range(8)
                    ]
                else:
                    parts = [(_table_values(builder, wbase, builder.add(blk, const(2))), ones)]
                return _half(builder, wbase, blk), parts

            def row_lanes(b: ir.Value, j: int, parts: list) -> tuple:
                """Activation row j's block b: (its scale d_x, the eight exact int32 lanes)."""
                row = builder.add(s_off, builder.mul(const(j), nblocks))
                d_x = builder.load(builder.gep(xdp, [builder.add(row, b)]))
                xo = builder.add(
                    builder.add(x_off, builder.mul(const(j), n_in)), builder.mul(b, const(qk))
                )
                lanes = None
                for k, (wv, scale) in enumerate(parts):
                    x = _load(builder, xbase, builder.add(xo, const(32 * k)), _V32I8)
                    quads = _call(
                        builder,
                        "llvm.x86.avx2.pmadd.wd",
                        _V8I32,
                        [_signed_pairs(builder, wv, x), scale],
                    )
                    lanes = quads if lanes is None else builder.add(lanes, quads)
                return d_x, lanes

            def step(b: ir.Value, which: int) -> None:
                """One block for every row, into accumulator ``which``."""
                d_w, parts = block(b)
                for j in range(rn):
                    d_x, lanes = row_lanes(b, j, parts)
                    slot = acc[j][which]
                    if code in (_NL_VD, _NL_TB, _XS_VD):
                        scale = _splat(builder, builder.fmul(d_w, d_x), _V8F)
                        value = _call(
                            builder,
                            "llvm.fma.v8f32",
                            _V8F,
                            [scale, builder.sitofp(lanes, _V8F), builder.load(slot)],
                        )
                    else:
                        total = builder.sitofp(
                            _call(builder, "llvm.vector.reduce.add.v8i32", _I32, [lanes]), _F32
                        )
                        if code == _NL_RP:  # acc = fma(Σ, d_w·d_x, acc)
                            value = _call(
                                builder,
                                "llvm.fma.f32",
                                _F32,
                                [total, builder.fmul(d_w, d_x), builder.load(slot)],
                            )
                        else:  # tiled: res = d_w·s1, out = fma(res, d_x, out)
                            value = _call(
                                builder,
                                "llvm.fma.f32",
                                _F32,
                                [builder.fmul(d_w, total), d_x, builder.load(slot)],
                            )
                    builder.store(value, slot)

            if code == _NL_VD:
                pairs = builder.udiv(nblocks, const(2))
                with cgutils.for_range(builder, pairs) as loop:
                    b = builder.mul(loop.index, const(2))
                    step(b, 0)
                    step(builder.add(b, const(1)), 1)
                sums = [
                    cgutils.alloca_once_value(
                        builder,
                        _hsum(
                            builder, builder.fadd(builder.load(acc[j][0]), builder.load(acc[j][1]))
                        ),
                    )
                    for j in range(rn)
                ]
                odd = builder.icmp_unsigned("!=", builder.urem(nblocks, const(2)), const(0))
                with builder.if_then(odd):  # the last block: a scalar fma on the sum
                    b = builder.sub(nblocks, const(1))
                    d_w, parts = block(b)
                    for j in range(rn):
                        d_x, lanes = row_lanes(b, j, parts)
                        total = builder.sitofp(
                            _call(builder, "llvm.vector.reduce.add.v8i32", _I32, [lanes]), _F32
                        )
                        builder.store(
                            _call(
                                builder,
                                "llvm.fma.f32",
                                _F32,
                                [builder.fmul(d_x, d_w), total, builder.load(sums[j])],
                            ),
                            sums[j],
                        )
                results = [builder.load(s) for s in sums]
            else:
                with cgutils.for_range(builder, nblocks) as loop:
                    step(loop.index, 0)
                results = [builder.load(acc[j][0]) for j in range(rn)]
                if not scalar_acc:
                    results = [_hsum(builder, r) for r in results]
            for j, value in enumerate(results):
                builder.store(
                    value, builder.gep(obase, [builder.add(o_off, builder.mul(const(j), n_out))])
                )
            return context.get_dummy_value()

        return sig, codegen

    return dot


_dot1_nl_vd, _dot4_nl_vd = _make_dot(_NL_VD, 1), _make_dot(_NL_VD, 4)
_dot1_nl_tb, _dot4_nl_tb = _make_dot(_NL_TB, 1), _make_dot(_NL_TB, 4)
_dot1_nl_rp, _dot4_nl_rp = _make_dot(_NL_RP, 1), _make_dot(_NL_RP, 4)
_dot1_xs_vd, _dot4_xs_vd = _make_dot(_XS_VD, 1), _make_dot(_XS_VD, 4)
_dot1_xs_t, _dot4_xs_t = _make_dot(_XS_T, 1), _make_dot(_XS_T, 4)


@njit
def _dot(code, rn, raw, w, xq, x, n, xd, s, nb, out, o, n_out):  # pragma: no cover - compiled
    """One weight row by rn (1 or 4) activation rows in the arithmetic ``code``."""
    if code == _NL_VD:
        if rn == 4:
            _dot4_nl_vd(raw, w, xq, x, n, xd, s, nb, out, o, n_out)
        else:
            _dot1_nl_vd(raw, w, xq, x, n, xd, s, nb, out, o, n_out)
    elif code == _NL_TB:
        if rn == 4:
            _dot4_nl_tb(raw, w, xq, x, n, xd, s, nb, out, o, n_out)
        else:
            _dot1_nl_tb(raw, w, xq, x, n, xd, s, nb, out, o, n_out)
    elif code == _NL_RP:
        if rn == 4:
            _dot4_nl_rp(raw, w, xq, x, n, xd, s, nb, out, o, n_out)
        else:
            _dot1_nl_rp(raw, w, xq, x, n, xd, s, nb, out, o, n_out)
    elif code == _XS_VD:
        if rn == 4:
            _dot4_xs_vd(raw, w, xq, x, n, xd, s, nb, out, o, n_out)
        else:
            _dot1_xs_vd(raw, w, xq, x, n, xd, s, nb, out, o, n_out)
    elif rn == 4:
        _dot4_xs_t(raw, w, xq, x, n, xd, s, nb, out, o, n_out)
    else:
        _dot1_xs_t(raw, w, xq, x, n, xd, s, nb, out, o, n_out)


@njit
def _rows(code, raw, r0, r1, qk, xq, xd, out):  # pragma: no cover - compiled
    """out[:, r0:r1]: each weight row against the activation rows four at a time, then one."""
    m, n = xq.shape
    nb = n // qk
    n_out = out.shape[1]
    row_bytes = raw.shape[1]
    for r in range(r0, r1):
        w = r * row_bytes
        t = 0
        while t + 4 <= m:
            _dot(code, 4, raw, w, xq, t * n, n, xd, t * nb, nb, out, t * n_out + r, n_out)
            t += 4
        while t < m:
            _dot(code, 1, raw, w, xq, t * n, n, xd, t * nb, nb, out, t * n_out + r, n_out)
            t += 1


@njit
def _serial(code, raw, qk, xq, xd, out):  # pragma: no cover - compiled
    _rows(code, raw, 0, raw.shape[0], qk, xq, xd, out)


@njit(parallel=True)
def _parallel(code, raw, qk, xq, xd, out):  # pragma: no cover - compiled
    n_out = raw.shape[0]
    for task in prange((n_out + ROWS_PER_TASK - 1) // ROWS_PER_TASK):
        r0 = task * ROWS_PER_TASK
        _rows(code, raw, r0, min(r0 + ROWS_PER_TASK, n_out), qk, xq, xd, out)


@njit
def row_product(code, parallel, raw, x, table, out):  # pragma: no cover - compiled
    """out [1, n_out] = one activation row x [1, n_in] (f32, C-contiguous) times the IQ4_NL or
    IQ4_XS matrix whose GGUF block rows are ``raw``, in the one-row arithmetic ``code``
    (``matrix._code(1)``: IQ4_NL's vec_dot or repacked gemv, IQ4_XS's vec_dot), as its matmul
    computes one row: x rounded to q8_0 (exact_matmul's rounding, ``table``: F16_TABLE) or to
    q8_K (IQ4_XS). The callable piece of the fused decode step (exact_decode)."""
    if code == _XS_VD or code == _XS_T:
        q, d, _ = _quantize_q8_K(x, 0)
        qk = QK_K
    else:
        q, _, _, d, _ = _quantize_q8_0(x, table)
        qk = QK
    if parallel:
        _parallel(code, raw, qk, q, d, out)
    else:
        _serial(code, raw, qk, q, d, out)


def _run(
    code: int, raw: numpy.ndarray, q: numpy.ndarray, d: numpy.ndarray, out: numpy.ndarray
) -> None:
    """out = the product of the rounded activation (q, d) by the weight rows in ``code``."""
    if q.shape[0] == 0:
        return
    qk = QK_K if code in _XS_CODES else QK
    macs = q.shape[0] * raw.shape[0] * q.shape[1]
    (_parallel if macs >= PARALLEL_MIN_MACS else _serial)(code, raw, qk, q, d, out)


# ---------------------------------------------------------------------------------------------
# Matrices


class IQuantMatrix(BlockRows):
    """A GGUF IQ4_NL or IQ4_XS weight matrix [n_out, n_in] kept in its block bytes; ``matmul``
    is llama-server's mul_mat (``repacked``: as after its CPU_REPACK buffer took the matrix, see
    ``repacked_by_llama_server``; the bytes stay in GGUF order here). Constructing it gives the
    type's subclass (IQ4NLMatrix or IQ4XSMatrix), whose ``stack`` runs it beside matrices of the
    other exact modules that share its activation rounding (q8_0 or q8_K)."""

    def __new__(
        cls, raw: numpy.ndarray, qtype: T | int, n_out: int, n_in: int, repacked: bool = False
    ):
        if cls is IQuantMatrix:
            try:
                cls = (
                    IQGridMatrix
                    if T(qtype) in _GRID
                    else {T.IQ4_NL: IQ4NLMatrix, T.IQ4_XS: IQ4XSMatrix}[T(qtype)]
                )
            except (KeyError, ValueError):
                raise ValueError(f"no exact IQ kernel for type {qtype}") from None
        return super().__new__(cls)

    @classmethod
    def concat(cls, parts: list) -> object:
        """BlockRows.concat by the first part's class (the base class has no ``stack``)."""
        if cls is IQuantMatrix:
            return type(parts[0]).concat(parts)
        return super().concat(parts)

    def __init__(
        self, raw: numpy.ndarray, qtype: T | int, n_out: int, n_in: int, repacked: bool = False
    ):
        qtype = T(qtype)
        if not supported(qtype):
            raise ValueError(f"no exact IQ kernel for {qtype.name}")
        if repacked and not repacked_by_llama_server(qtype, n_out):
            raise ValueError(f"llama-server does not repack {qtype.name} [{n_out}, {n_in}] on AVX2")
        qk, block_bytes = _BLOCK[qtype]
        if n_in % qk:
            raise ValueError(f"n_in={n_in} is not a multiple of {qk}")
        row_bytes = n_in // qk * block_bytes
        data = numpy.ascontiguousarray(raw).view(numpy.uint8)
        if data.size != n_out * row_bytes:
            raise ValueError(
                f"{qtype.name} [{n_out}, {n_in}] needs {n_out * row_bytes} bytes, got {data.size}"
            )
        self.raw = data.reshape(n_out, row_bytes)
        self.qtype, self.n_out, self.n_in, self.repacked = qtype, n_out, n_in, repacked

    def _product(self, q: numpy.ndarray, d: numpy.ndarray) -> numpy.ndarray:
        if q.shape[1] != self.n_in:
            raise ValueError(f"activation width {q.shape[1]} != n_in {self.n_in}")
        out = numpy.empty((q.shape[0], self.n_out), numpy.float32)
        _run(self._code(q.shape[0]), self.raw, q, d, out)
        return out


class IQ4NLMatrix(IQuantMatrix):
    """IQ4_NL: the activation rounded to q8_0 (exact_matmul.Activation, shared with Q4_0 & co)."""

    stack = MatrixStack

    def quantize(self, x: numpy.ndarray) -> Activation:
        return Activation(numpy.atleast_2d(numpy.asarray(x, dtype=numpy.float32)))

    def matmul(self, x: numpy.ndarray | Activation) -> numpy.ndarray:
        """x [m, n_in] f32 (or its Activation) -> [m, n_out] f32, bit-identical to ggml."""
        act = x if isinstance(x, Activation) else self.quantize(x)
        return self._product(act.q, act.d)

    def _code(self, m: int) -> int:
        if self.repacked:
            return _NL_RP
        return _NL_VD if m == 1 else _NL_TB  # llamafile_sgemm takes two rows or more


class IQ4XSMatrix(IQuantMatrix):
    """IQ4_XS: the activation rounded to q8_K (exact_kquants.KActivation, shared with the K-quants)."""

    stack = KMatrixStack

    def quantize(self, x: numpy.ndarray) -> KActivation:
        return KActivation(x)

    def matmul(self, x: numpy.ndarray | KActivation) -> numpy.ndarray:
        """x [m, n_in] f32 (or its KActivation) -> [m, n_out] f32, bit-identical to ggml."""
        act = x if isinstance(x, KActivation) else self.quantize(x)
        if act.packed_rows:
            raise ValueError("activation was rounded for a repacked matrix")
        return self._product(act.q, act.d)

    def _code(self, m: int) -> int:
        return _XS_T if m >= TILED_MIN_ROWS else _XS_VD


# ---------------------------------------------------------------------------------------------
# The grid types (IQ3_XXS, IQ3_S, IQ2_XXS, IQ2_XS, IQ2_S, IQ1_S, IQ1_M) and the ternary TQ2_0, TQ1_0
#
# Their products differ from each other only in where the float operations fall; the integer
# parts (pmaddubsw/pmaddwd lanes, exact in int32 here: |w| <= 62 and q8_K quants >= -127, so no
# int16 saturation and no psign wrap of -128) may be grouped freely. Each weight row is decoded
# once per product into a scratch row of signed int8 values (the grid value with its sign; IQ1:
# the ternary grid value, its ±1 delta of 8·value apart; TQ: digit - 1) as ggml's
# dequantize_row_<type> reads the blocks (_decode_row), with the grid tables from gguf-py; the
# 16-value scales 2·ls+1 and the f16 d per super-block are read once, when the matrix is made.
#
# The float operations (arch/x86/quants.c ggml_vec_dot_<type>_q8_K below 8 activation rows,
# tiled/tiled.cpp from 8; nothing repacks or hands these types to tinyBLAS on AVX2):
# - _GRID_VD (IQ2_*, IQ3_*): per super-block d = d_w·d_x, acc = fma(d, float(lanes), acc) on
#   eight lanes; out = f·hsum_float_8(acc), f = 0.125 (IQ2), 0.25 (IQ3_XXS), 1 (IQ3_S).
# - _IQ1S_VD: the grid's lanes as above; the deltas' integer Σ bsums·sign·ls in a scalar chain
#   acc1 = fma(d, float(Σ), acc1) (vfmadd231ss in the build); out = hsum(acc) + 0.125·acc1.
# - _IQ1M_VD: the grid's and the deltas' lanes in two vector chains;
#   out = fma(hsum(acc2), 0.125, hsum(acc1)) (vfmadd132ss).
# - _TQ_VD: lanes as in _tq_correction; acc = fma(float(lanes), d, acc), hsum_float_8.
# - _GRID_T (tiled; IQ types only): s1 = the super-block's whole integer (IQ1: its code
#   8·g + delta), out = fma((d_w·f)·float(s1), d_x, out) from 0 over the super-blocks, f the
#   power of two the tile folds into d (0.125 IQ2/IQ1, 0.25 IQ3_XXS, 1 IQ3_S).

_GRID_VD, _IQ1S_VD, _IQ1M_VD, _TQ_VD, _GRID_T = range(5, 10)


def _scales_iq2_xxs(b: numpy.ndarray) -> numpy.ndarray:
    return numpy.repeat(b[:, 9::8] >> 4, 2, axis=1)  # the top nibble of each 32's second u32


def _scales_iq3_xxs(b: numpy.ndarray) -> numpy.ndarray:
    return numpy.repeat(b[:, 69::4] >> 4, 2, axis=1)  # likewise, in the words at 66 + 4·ib


def _scale_nibbles(scales: numpy.ndarray) -> numpy.ndarray:
    """Bytes of two 4-bit scales (low first) -> one scale per byte-half."""
    return numpy.stack([scales & 0x0F, scales >> 4], axis=-1).reshape(scales.shape[0], -1)


def _scales_iq1_s(b: numpy.ndarray) -> numpy.ndarray:
    return numpy.repeat((b[:, 35::2] >> 4) & 7, 2, axis=1)  # qh u16 bits 12..14


def _scales_iq1_m(b: numpy.ndarray) -> numpy.ndarray:
    words = numpy.ascontiguousarray(b[:, 48:56]).view(numpy.uint16)
    return numpy.stack([(words >> (3 * j)) & 7 for j in range(4)], axis=-1).reshape(b.shape[0], 16)


def _d_iq1_m(b: numpy.ndarray) -> numpy.ndarray:
    """IQ1_M's f16 d, spread over the top nibbles of its four scale words."""
    w = numpy.ascontiguousarray(b[:, 48:56]).view(numpy.uint16)
    bits = (
        (w[:, 0] >> 12) | ((w[:, 1] >> 8) & 0x00F0) | ((w[:, 2] >> 4) & 0x0F00) | (w[:, 3] & 0xF000)
    )
    return bits.astype(numpy.uint16).view(numpy.float16).astype(numpy.float32)


def _d_at(offset: int):
    def d(b: numpy.ndarray) -> numpy.ndarray:
        return (
            numpy.ascontiguousarray(b[:, offset : offset + 2])
            .view(numpy.float16)[:, 0]
            .astype(numpy.float32)
        )

    return d


def _no_scales(b: numpy.ndarray) -> numpy.ndarray:
    return numpy.zeros((b.shape[0], 16), numpy.uint8)  # 2·0 + 1 = 1: TQ has no sub-block scales


# qtype: (bytes per 256 values, its f16 d, its 16 scale fields (2·field + 1 is the scale),
#         vec_dot's arithmetic, vec_dot's final factor, the tiled kernel's d factor or None: not tiled)
_GRID = {
    T.IQ2_XXS: (66, _d_at(0), _scales_iq2_xxs, _GRID_VD, 0.125, 0.125),
    T.IQ2_XS: (74, _d_at(0), lambda b: _scale_nibbles(b[:, 66:74]), _GRID_VD, 0.125, 0.125),
    T.IQ2_S: (82, _d_at(0), lambda b: _scale_nibbles(b[:, 74:82]), _GRID_VD, 0.125, 0.125),
    T.IQ3_XXS: (98, _d_at(0), _scales_iq3_xxs, _GRID_VD, 0.25, 0.25),
    T.IQ3_S: (
        110,
        _d_at(0),
        lambda b: numpy.repeat(_scale_nibbles(b[:, 106:110]), 2, axis=1),
        _GRID_VD,
        1.0,
        1.0,
    ),
    T.IQ1_S: (50, _d_at(0), _scales_iq1_s, _IQ1S_VD, 1.0, 0.125),
    T.IQ1_M: (56, _d_iq1_m, _scales_iq1_m, _IQ1M_VD, 1.0, 0.125),
    T.TQ1_0: (54, _d_at(52), _no_scales, _TQ_VD, 1.0, None),
    T.TQ2_0: (66, _d_at(64), _no_scales, _TQ_VD, 1.0, None),
}
_BLOCK.update({qtype: (QK_K, spec[0]) for qtype, spec in _GRID.items()})


def _block_fields(raw: numpy.ndarray, qtype: T, n_out: int) -> tuple[numpy.ndarray, numpy.ndarray]:
    """GGUF rows -> (the 16-value scales 2·ls+1, int16 [n_out, n_in/16]; d, f32 [n_out, n_in/256])."""
    block_bytes, d_of, scales_of = _GRID[qtype][:3]
    blocks = raw.reshape(-1, block_bytes)
    scales = (2 * scales_of(blocks).astype(numpy.int16) + 1).reshape(n_out, -1)
    return scales, d_of(blocks).reshape(n_out, -1).astype(numpy.float32)


@functools.cache
def _grid_table(qtype: T) -> numpy.ndarray:
    """The type's grid from gguf-py, one uint64 per entry: its 8 int8 values (IQ3's 4-value
    entries zero-extended), so a decoded group of 8 is one 64-bit store (TQ: no grid)."""
    cls = {T.IQ1_M: quants.IQ1_S}.get(qtype, quants._type_traits[qtype])
    if cls.grid_hex is None:
        return numpy.zeros(1, numpy.uint64)
    cls.init_grid()
    grid = numpy.ascontiguousarray(cls.grid.reshape(cls.grid_shape), dtype=numpy.int8)
    if grid.shape[1] == 4:
        return grid.view(numpy.uint32).ravel().astype(numpy.uint64)
    return grid.view(numpy.uint64).ravel().copy()


# ggml's ksigns_iq2xs (7 sign bits -> 8 with even parity; gguf-py carries the same table), and
# for each sign byte the 64-bit mask with 0xFF in the bytes it negates
_KSIGNS = numpy.frombuffer(quants.IQ2_XXS.ksigns, numpy.uint8).astype(numpy.int64)
_SIGN_MASKS = ((numpy.arange(256)[:, None] >> numpy.arange(8)) & 1).astype(
    numpy.uint8
) * numpy.uint8(0xFF)
_SIGN_MASKS = numpy.ascontiguousarray(_SIGN_MASKS).view(numpy.uint64).ravel().copy()
_ONES = numpy.uint64(0x0101010101010101)
_MINUS_ONES = numpy.uint64(0xFFFFFFFFFFFFFFFF)
_K_IQ2_XXS, _K_IQ2_XS, _K_IQ2_S, _K_IQ3_XXS, _K_IQ3_S, _K_IQ1_S, _K_IQ1_M, _K_TQ1_0, _K_TQ2_0 = (
    int(T.IQ2_XXS),
    int(T.IQ2_XS),
    int(T.IQ2_S),
    int(T.IQ3_XXS),
    int(T.IQ3_S),
    int(T.IQ1_S),
    int(T.IQ1_M),
    int(T.TQ1_0),
    int(T.TQ2_0),
)


@njit
def _u16(raw, r, i):  # pragma: no cover - compiled
    return numpy.int64(raw[r, i]) | (numpy.int64(raw[r, i + 1]) << 8)


@njit
def _u64(raw, r, i):  # pragma: no cover - compiled
    value = numpy.uint64(0)
    for j in range(8):
        value |= numpy.uint64(raw[r, i + j]) << numpy.uint64(8 * j)
    return value


@njit
def _signed(values, sign_byte, masks):  # pragma: no cover - compiled
    """Eight int8 grid values (one uint64), bit j of the sign byte negating value j: ~v + 1 per
    negated byte, which carries into no neighbour because the grid values are 1..62."""
    mask = masks[sign_byte]
    return (values ^ mask) + (mask & _ONES)


@njit
def _decode_row(kind, raw, r, table, ksigns, masks, w64, delta64, w):  # pragma: no cover - compiled
    """Weight row r's signed values into w (int8 [n_in], w64 its uint64 view); IQ1: the ternary
    grid value in w, the ±1 delta (of 8·value) in delta64. Layouts as ggml's
    dequantize_row_<type> reads the blocks."""
    nb = w.shape[0] // 256
    bb = raw.shape[1] // nb
    for b in range(nb):
        o, y = b * bb, b * 32  # y: the block's first group of 8 in w64
        if kind == _K_IQ2_XXS:
            for ib in range(8):
                aux = _u16(raw, r, o + 2 + 8 * ib + 4) | (_u16(raw, r, o + 2 + 8 * ib + 6) << 16)
                for l in range(4):
                    w64[y + 4 * ib + l] = _signed(
                        table[raw[r, o + 2 + 8 * ib + l]], ksigns[(aux >> (7 * l)) & 127], masks
                    )
        elif kind == _K_IQ2_XS:
            for k in range(32):
                q = _u16(raw, r, o + 2 + 2 * k)
                w64[y + k] = _signed(table[q & 511], ksigns[q >> 9], masks)
        elif kind == _K_IQ2_S:
            for ib in range(8):
                qh = numpy.int64(raw[r, o + 66 + ib])
                for l in range(4):
                    index = numpy.int64(raw[r, o + 2 + 4 * ib + l]) | ((qh << (8 - 2 * l)) & 0x300)
                    w64[y + 4 * ib + l] = _signed(table[index], raw[r, o + 34 + 4 * ib + l], masks)
        elif kind == _K_IQ3_XXS:
            for ib in range(8):
                aux = _u16(raw, r, o + 66 + 4 * ib) | (_u16(raw, r, o + 68 + 4 * ib) << 16)
                for l in range(4):
                    pair = table[raw[r, o + 2 + 8 * ib + 2 * l]] | (
                        table[raw[r, o + 3 + 8 * ib + 2 * l]] << numpy.uint64(32)
                    )
                    w64[y + 4 * ib + l] = _signed(pair, ksigns[(aux >> (7 * l)) & 127], masks)
        elif kind == _K_IQ3_S:
            for ib in range(8):
                qh = numpy.int64(raw[r, o + 66 + ib])
                for l in range(4):
                    i1 = numpy.int64(raw[r, o + 2 + 8 * ib + 2 * l]) | ((qh << (8 - 2 * l)) & 256)
                    i2 = numpy.int64(raw[r, o + 3 + 8 * ib + 2 * l]) | ((qh << (7 - 2 * l)) & 256)
                    pair = table[i1] | (table[i2] << numpy.uint64(32))
                    w64[y + 4 * ib + l] = _signed(pair, raw[r, o + 74 + 4 * ib + l], masks)
        elif kind == _K_IQ1_S:
            for ib in range(8):
                qh = _u16(raw, r, o + 34 + 2 * ib)
                sign = _MINUS_ONES if qh & 0x8000 else _ONES
                for l in range(4):
                    w64[y + 4 * ib + l] = table[
                        numpy.int64(raw[r, o + 2 + 4 * ib + l]) | (((qh >> (3 * l)) & 7) << 8)
                    ]
                    delta64[y + 4 * ib + l] = sign
        elif kind == _K_IQ1_M:
            for ib in range(8):
                for l in range(4):
                    qh = numpy.int64(raw[r, o + 32 + 2 * ib + l // 2])
                    w64[y + 4 * ib + l] = table[
                        numpy.int64(raw[r, o + 4 * ib + l]) | ((qh << (8 - 4 * (l % 2))) & 0x700)
                    ]
                    delta64[y + 4 * ib + l] = _MINUS_ONES if qh & (0x08 << (4 * (l % 2))) else _ONES
        elif (
            kind == _K_TQ2_0
        ):  # 2-bit digits d: (d + 0x7F) ^ 0x80 per byte is d - 1, 8 bytes at once
            for half in range(2):
                for k in range(4):
                    x = _u64(raw, r, o + 32 * half + 8 * k)
                    for l in range(4):
                        digits = (x >> numpy.uint64(2 * l)) & numpy.uint64(0x0303030303030303)
                        w64[y + 16 * half + 4 * l + k] = (
                            digits + numpy.uint64(0x7F7F7F7F7F7F7F7F)
                        ) ^ numpy.uint64(0x8080808080808080)
        else:  # TQ1_0: base-3 digits, the n-th by (q·3^n mod 256)·3 >> 8
            at = b * 256
            for n in range(5):
                for m in range(48):
                    q = (numpy.int64(raw[r, o + m]) * 3**n) & 255
                    w[at + (32 * n + m if m < 32 else 160 + 16 * n + m - 32)] = ((q * 3) >> 8) - 1
            for n in range(4):
                for m in range(4):
                    q = (numpy.int64(raw[r, o + 48 + m]) * 3**n) & 255
                    w[at + 240 + 4 * n + m] = ((q * 3) >> 8) - 1


@intrinsic
def _block_lanes(typingctx, w, w_off, sc, sc_off, x, x_off, lanes):
    """lanes[0:8] = the eight int32 lanes of pmaddubsw + pmaddwd over one super-block: lane L
    gets the products of elements 4L..4L+3 of each 32, times their 16-value scale. w (int8
    values) and x (int8 quants) at element offsets w_off and x_off, sc (int16) at sc_off."""
    sig = types.void(w, w_off, sc, sc_off, x, x_off, lanes)

    def codegen(context, builder, signature, args):
        aty = signature.args
        wbase, xbase = (
            _byte_ptr(context, builder, aty[0], args[0]),
            _byte_ptr(context, builder, aty[4], args[4]),
        )
        scales = _data(context, builder, aty[2], args[2])
        w_off, sc_off, x_off = args[1], args[3], args[5]
        ity = w_off.type
        total = None
        for c in range(8):
            at = ir.Constant(ity, 32 * c)
            wv = _load(builder, wbase, builder.add(w_off, at), _V32I8)
            xv = _load(builder, xbase, builder.add(x_off, at), _V32I8)
            halves = [
                _splat(
                    builder,
                    builder.load(
                        builder.gep(scales, [builder.add(sc_off, ir.Constant(ity, 2 * c + h))])
                    ),
                    ir.VectorType(_I16, 8),
                )
                for h in (0, 1)
            ]
            scale = builder.shuffle_vector(
                halves[0], halves[1], ir.Constant(ir.VectorType(_I32, 16), list(range(16)))
            )
            quads = _call(
                builder, "llvm.x86.avx2.pmadd.wd", _V8I32, [_signed_pairs(builder, wv, xv), scale]
            )
            total = quads if total is None else builder.add(total, quads)
        out = builder.bitcast(_data(context, builder, aty[6], args[6]), _V8I32.as_pointer())
        builder.store(total, out, align=4)
        return context.get_dummy_value()

    return sig, codegen


@njit
def _lanes(w, sc, wr, x, xr, b, lanes):  # pragma: no cover - compiled
    """The eight int32 lanes of super-block b: w the decoded weight row (int8 [n]), sc the
    scales of all rows (row wr's), x the activation rows (row xr)."""
    n = w.shape[0]
    _block_lanes(w, b * 256, sc, wr * (n // 16) + b * 16, x, xr * n + b * 256, lanes)


def _tq_correction(q: numpy.ndarray) -> numpy.ndarray:
    """TQ's vec_dot multiplies the unsigned digits w + 1 in 16-bit lanes and subtracts the
    block's bsums lane by lane (i16 lane k: the sum of values 16k..16k+15) before pmaddwd by 1,
    so lane L = Σ w·x over its 4-of-32 positions + (Σ x over the same positions - Σ
    x[32L..32L+31]). The bracket depends on the activation only: [m, n/256, 8] int32."""
    x = q.astype(numpy.int32).reshape(q.shape[0], -1, 8, 8, 4)
    return (x.sum(axis=(2, 4)) - x.reshape(q.shape[0], -1, 8, 32).sum(axis=3)).astype(numpy.int32)


@njit
def _tq_correction_compiled(q):  # pragma: no cover - compiled
    """_tq_correction in compiled loops (the same exact integers), for grid_row_product."""
    m, n = q.shape
    corr = numpy.empty((m, n // 256, 8), numpy.int32)
    for t in range(m):
        for b in range(n // 256):
            for lane in range(8):
                s = numpy.int32(0)
                for i in range(8):
                    for k in range(4):
                        s += numpy.int32(q[t, b * 256 + i * 32 + lane * 4 + k])
                for j in range(32):
                    s -= numpy.int32(q[t, b * 256 + lane * 32 + j])
                corr[t, b, lane] = s
    return corr


@njit
def _hsum8(a):  # pragma: no cover - compiled
    """hsum_float_8: ((a0+a4) + (a2+a6)) + ((a1+a5) + (a3+a7)) in f32."""
    return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]))


@njit
def _grid_dot(
    code, iq1, f_vd, f_t, w, delta, sc, wd, wr, x, xd, corr, xr, lanes, lanes2, acc, acc2
):  # pragma: no cover
    """One output: weight row wr (decoded into w, delta) by activation row xr (q8_K) in
    arithmetic ``code``."""
    nb = w.shape[0] // 256
    zero = numpy.float32(0.0)
    if (
        code == _GRID_T
    ):  # tiled: one exact integer per super-block, res = d0·s1, out = fma(res, d_x, out)
        out = zero
        for b in range(nb):
            _lanes(w, sc, wr, x, xr, b, lanes)
            s1 = numpy.int64(0)
            for lane in range(8):
                s1 += lanes[lane]
            if iq1:  # the tile's code is 8·g + delta
                _lanes(delta, sc, wr, x, xr, b, lanes2)
                s1 *= 8
                for lane in range(8):
                    s1 += lanes2[lane]
            d0 = wd[wr, b] * numpy.float32(f_t)
            out = fma32(d0 * numpy.float32(s1), xd[xr, b], out)
        return out
    for lane in range(8):
        acc[lane] = zero
        acc2[lane] = zero
    scalar = zero
    for b in range(nb):
        d = wd[wr, b] * xd[xr, b]
        _lanes(w, sc, wr, x, xr, b, lanes)
        if code == _TQ_VD:
            for lane in range(8):
                lanes[lane] += corr[xr, b, lane]
        for lane in range(8):
            acc[lane] = fma32(d, numpy.float32(lanes[lane]), acc[lane])
        if code == _IQ1S_VD:  # the deltas' integer (bsums·sign·ls over the 32s) in a scalar chain
            _lanes(delta, sc, wr, x, xr, b, lanes2)
            s = numpy.int64(0)
            for lane in range(8):
                s += lanes2[lane]
            scalar = fma32(d, numpy.float32(s), scalar)
        elif code == _IQ1M_VD:  # the deltas' lanes in a second vector chain
            _lanes(delta, sc, wr, x, xr, b, lanes2)
            for lane in range(8):
                acc2[lane] = fma32(d, numpy.float32(lanes2[lane]), acc2[lane])
    total = _hsum8(acc)
    if code == _IQ1S_VD:  # hsum + IQ1S_DELTA·accum1 (vmulss, vaddss)
        return total + numpy.float32(0.125) * scalar
    if code == _IQ1M_VD:  # fma(hsum(accum2), IQ1M_DELTA, hsum(accum1))
        return fma32(_hsum8(acc2), numpy.float32(0.125), total)
    return numpy.float32(f_vd) * total


@njit
def _grid_rows(
    code, kind, f_vd, f_t, raw, table, sc, wd, r0, r1, x, xd, corr, out
):  # pragma: no cover
    """out[:, r0:r1]: each weight row decoded once, then dotted with every activation row."""
    n = x.shape[1]
    w64 = numpy.empty(n // 8, numpy.uint64)
    delta64 = numpy.zeros(n // 8, numpy.uint64)
    w, delta = w64.view(numpy.int8), delta64.view(numpy.int8)
    iq1 = kind == _K_IQ1_S or kind == _K_IQ1_M
    lanes = numpy.empty(8, numpy.int32)
    lanes2 = numpy.empty(8, numpy.int32)
    acc = numpy.empty(8, numpy.float32)
    acc2 = numpy.empty(8, numpy.float32)
    for r in range(r0, r1):
        _decode_row(kind, raw, r, table, _KSIGNS, _SIGN_MASKS, w64, delta64, w)
        for t in range(x.shape[0]):
            out[t, r] = _grid_dot(
                code, iq1, f_vd, f_t, w, delta, sc, wd, r, x, xd, corr, t, lanes, lanes2, acc, acc2
            )


@njit
def _grid_serial(code, kind, f_vd, f_t, raw, table, sc, wd, x, xd, corr, out):  # pragma: no cover
    _grid_rows(code, kind, f_vd, f_t, raw, table, sc, wd, 0, raw.shape[0], x, xd, corr, out)


@njit(parallel=True)
def _grid_parallel(code, kind, f_vd, f_t, raw, table, sc, wd, x, xd, corr, out):  # pragma: no cover
    n_out = raw.shape[0]
    for task in prange((n_out + ROWS_PER_TASK - 1) // ROWS_PER_TASK):
        r0 = task * ROWS_PER_TASK
        _grid_rows(
            code,
            kind,
            f_vd,
            f_t,
            raw,
            table,
            sc,
            wd,
            r0,
            min(r0 + ROWS_PER_TASK, n_out),
            x,
            xd,
            corr,
            out,
        )


@njit
def grid_row_product(
    code, kind, f_vd, f_t, parallel, raw, table, sc, wd, x, out
):  # pragma: no cover
    """out [1, n_out] = one activation row x [1, n_in] (f32, C-contiguous) times a grid or TQ
    matrix (``IQGridMatrix.row_args``: code, kind, factors, grid table, scales, d), as its
    matmul computes one row: x rounded to q8_K, then vec_dot. The callable piece of the fused
    decode step (exact_decode)."""
    q, d, _ = _quantize_q8_K(x, 0)
    if code == _TQ_VD:
        corr = _tq_correction_compiled(q)
    else:
        corr = numpy.zeros((0, 0, 0), numpy.int32)
    if parallel:
        _grid_parallel(code, kind, f_vd, f_t, raw, table, sc, wd, q, d, corr, out)
    else:
        _grid_serial(code, kind, f_vd, f_t, raw, table, sc, wd, q, d, corr, out)


class IQGridMatrix(IQuantMatrix):
    """IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, TQ1_0, TQ2_0: the activation rounded
    to q8_K (exact_kquants.KActivation, shared with the K-quants); never repacked on x86. The
    weight is also kept unpacked (one byte per value; see the section comment)."""

    stack = KMatrixStack

    def __init__(
        self, raw: numpy.ndarray, qtype: T | int, n_out: int, n_in: int, repacked: bool = False
    ):
        super().__init__(raw, qtype, n_out, n_in, repacked)
        self.scales, self.d = _block_fields(self.raw, self.qtype, n_out)

    def decoded(self, row: int) -> tuple[numpy.ndarray, numpy.ndarray]:
        """Row ``row``'s signed values as the kernels decode them (int8 [n_in]) and, for IQ1,
        the ±1 deltas of 8·value (zeros otherwise)."""
        w64, delta64 = (
            numpy.empty(self.n_in // 8, numpy.uint64),
            numpy.zeros(self.n_in // 8, numpy.uint64),
        )
        w = w64.view(numpy.int8)
        _decode_row(
            int(self.qtype),
            self.raw,
            row,
            _grid_table(self.qtype),
            _KSIGNS,
            _SIGN_MASKS,
            w64,
            delta64,
            w,
        )
        return w, delta64.view(numpy.int8)

    def quantize(self, x: numpy.ndarray) -> KActivation:
        return KActivation(x)

    def matmul(self, x: numpy.ndarray | KActivation) -> numpy.ndarray:
        """x [m, n_in] f32 (or its KActivation) -> [m, n_out] f32, bit-identical to ggml."""
        act = x if isinstance(x, KActivation) else self.quantize(x)
        if act.packed_rows:
            raise ValueError("activation was rounded for a repacked matrix")
        if act.q.shape[1] != self.n_in:
            raise ValueError(f"activation width {act.q.shape[1]} != n_in {self.n_in}")
        out = numpy.empty((act.q.shape[0], self.n_out), numpy.float32)
        _grid_run(self._code(act.q.shape[0]), self, act.q, act.d, out)
        return out

    def row_args(self) -> tuple:
        """grid_row_product's (code, kind, f_vd, f_t, table, scales, d) for this matrix."""
        spec = _GRID[self.qtype]
        f_t = spec[5] if spec[5] is not None else 1.0
        return (
            self._code(1),
            int(self.qtype),
            float(spec[4]),
            float(f_t),
            _grid_table(self.qtype),
            self.scales,
            self.d,
        )

    def _code(self, m: int) -> int:
        tiled = _GRID[self.qtype][5] is not None and m >= TILED_MIN_ROWS
        return _GRID_T if tiled else _GRID[self.qtype][3]


def _grid_run(
    code: int, matrix: IQGridMatrix, q: numpy.ndarray, d: numpy.ndarray, out: numpy.ndarray
) -> None:
    """out = the product in arithmetic ``code`` (ggml's pick is matrix._code(m))."""
    if q.shape[0] == 0:
        return
    spec = _GRID[matrix.qtype]
    f_t = spec[5] if spec[5] is not None else 1.0
    corr = _tq_correction(q) if code == _TQ_VD else numpy.zeros((0, 0, 0), numpy.int32)
    macs = q.shape[0] * matrix.n_out * matrix.n_in
    (_grid_parallel if macs >= PARALLEL_MIN_MACS else _grid_serial)(
        code,
        int(matrix.qtype),
        spec[4],
        f_t,
        matrix.raw,
        _grid_table(matrix.qtype),
        matrix.scales,
        matrix.d,
        numpy.ascontiguousarray(q),
        d,
        corr,
        out,
    )
