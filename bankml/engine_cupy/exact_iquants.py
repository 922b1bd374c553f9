"""IQ4_NL and IQ4_XS matrix products that round exactly as llama-server's AVX2 CPU backend.

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

import numpy
from gguf import GGMLQuantizationType as T
from gguf import quants
from llvmlite import ir
from numba import prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from bankml.engine_cupy.exact_kquants import QK_K, TILED_MIN_ROWS, KActivation, KMatrixStack
from bankml.engine_cupy.exact_matmul import (HOST_HAS_AVX2, PARALLEL_MIN_MACS, QK, Activation, BlockRows,
                                             MatrixStack, _byte_ptr, _call, _data, _half, _hsum, _load,
                                             _nibbles, _splat)
from bankml.engine_cupy.jit import njit

__all__ = ["IQuantMatrix", "IQ4NLMatrix", "IQ4XSMatrix", "supported", "repacked_by_llama_server", "KVALUES_IQ4NL"]

# ggml-common.h kvalues_iq4nl: the value each 4-bit index stands for (gguf-py carries the same table)
KVALUES_IQ4NL = tuple(int(v) for v in quants.IQ4_NL.kvalues)
_BLOCK = {T.IQ4_NL: (QK, 18), T.IQ4_XS: (QK_K, 136)}  # values and bytes per block
ROWS_PER_TASK = 16  # output rows per parallel task

# arithmetic codes
_NL_VD, _NL_TB, _NL_RP, _XS_VD, _XS_T = range(5)
_XS_CODES = {_XS_VD, _XS_T}

_I8, _I16, _I32, _F32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.FloatType()
_V32I8, _V16I16, _V8I32, _V8F = (ir.VectorType(_I8, 32), ir.VectorType(_I16, 16), ir.VectorType(_I32, 8),
                                 ir.VectorType(_F32, 8))


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
    low = builder.zext(_load(builder, wbase, builder.add(blk, ir.Constant(blk.type, 4 + ib // 2)), _I8), _I16)
    low = builder.and_(builder.lshr(low, ir.Constant(_I16, 4 * (ib % 2))), ir.Constant(_I16, 15))
    high = _load(builder, wbase, builder.add(blk, ir.Constant(blk.type, 2)), _I16)
    high = builder.shl(builder.and_(builder.lshr(high, ir.Constant(_I16, 2 * ib)), ir.Constant(_I16, 3)),
                       ir.Constant(_I16, 4))
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
            wbase, xbase = _byte_ptr(context, builder, aty[0], args[0]), _byte_ptr(context, builder, aty[2], args[2])
            xdp, obase = _data(context, builder, aty[5], args[5]), _data(context, builder, aty[8], args[8])
            ity = w_off.type

            def const(v: int) -> ir.Value:
                return ir.Constant(ity, v)

            zero = ir.Constant(_F32, 0.0) if scalar_acc else ir.Constant(_V8F, [0.0] * 8)
            n_acc = 2 if code == _NL_VD else 1  # vec_dot's even/odd block accumulators
            acc = [[cgutils.alloca_once_value(builder, zero) for _ in range(n_acc)] for _ in range(rn)]
            ones = ir.Constant(_V16I16, [1] * 16)

            def block(b: ir.Value) -> tuple:
                """The weight block's d and, per 32 values, (int8 values, scale for pmaddwd)."""
                blk = builder.add(w_off, builder.mul(b, const(block_bytes)))
                if xs:
                    parts = [(_table_values(builder, wbase, builder.add(blk, const(8 + 16 * ib))),
                              _xs_scale(builder, wbase, blk, ib)) for ib in range(8)]
                else:
                    parts = [(_table_values(builder, wbase, builder.add(blk, const(2))), ones)]
                return _half(builder, wbase, blk), parts

            def row_lanes(b: ir.Value, j: int, parts: list) -> tuple:
                """Activation row j's block b: (its scale d_x, the eight exact int32 lanes)."""
                row = builder.add(s_off, builder.mul(const(j), nblocks))
                d_x = builder.load(builder.gep(xdp, [builder.add(row, b)]))
                xo = builder.add(builder.add(x_off, builder.mul(const(j), n_in)), builder.mul(b, const(qk)))
                lanes = None
                for k, (wv, scale) in enumerate(parts):
                    x = _load(builder, xbase, builder.add(xo, const(32 * k)), _V32I8)
                    quads = _call(builder, "llvm.x86.avx2.pmadd.wd", _V8I32, [_signed_pairs(builder, wv, x), scale])
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
                        value = _call(builder, "llvm.fma.v8f32", _V8F,
                                      [scale, builder.sitofp(lanes, _V8F), builder.load(slot)])
                    else:
                        total = builder.sitofp(_call(builder, "llvm.vector.reduce.add.v8i32", _I32, [lanes]), _F32)
                        if code == _NL_RP:  # acc = fma(Σ, d_w·d_x, acc)
                            value = _call(builder, "llvm.fma.f32", _F32, [total, builder.fmul(d_w, d_x), builder.load(slot)])
                        else:  # tiled: res = d_w·s1, out = fma(res, d_x, out)
                            value = _call(builder, "llvm.fma.f32", _F32, [builder.fmul(d_w, total), d_x, builder.load(slot)])
                    builder.store(value, slot)

            if code == _NL_VD:
                pairs = builder.udiv(nblocks, const(2))
                with cgutils.for_range(builder, pairs) as loop:
                    b = builder.mul(loop.index, const(2))
                    step(b, 0)
                    step(builder.add(b, const(1)), 1)
                sums = [cgutils.alloca_once_value(builder, _hsum(builder, builder.fadd(
                    builder.load(acc[j][0]), builder.load(acc[j][1])))) for j in range(rn)]
                odd = builder.icmp_unsigned("!=", builder.urem(nblocks, const(2)), const(0))
                with builder.if_then(odd):  # the last block: a scalar fma on the sum
                    b = builder.sub(nblocks, const(1))
                    d_w, parts = block(b)
                    for j in range(rn):
                        d_x, lanes = row_lanes(b, j, parts)
                        total = builder.sitofp(_call(builder, "llvm.vector.reduce.add.v8i32", _I32, [lanes]), _F32)
                        builder.store(_call(builder, "llvm.fma.f32", _F32,
                                            [builder.fmul(d_x, d_w), total, builder.load(sums[j])]), sums[j])
                results = [builder.load(s) for s in sums]
            else:
                with cgutils.for_range(builder, nblocks) as loop:
                    step(loop.index, 0)
                results = [builder.load(acc[j][0]) for j in range(rn)]
                if not scalar_acc:
                    results = [_hsum(builder, r) for r in results]
            for j, value in enumerate(results):
                builder.store(value, builder.gep(obase, [builder.add(o_off, builder.mul(const(j), n_out))]))
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


def _run(code: int, raw: numpy.ndarray, q: numpy.ndarray, d: numpy.ndarray, out: numpy.ndarray) -> None:
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

    def __new__(cls, raw: numpy.ndarray, qtype: T | int, n_out: int, n_in: int, repacked: bool = False):
        if cls is IQuantMatrix:
            try:
                cls = {T.IQ4_NL: IQ4NLMatrix, T.IQ4_XS: IQ4XSMatrix}[T(qtype)]
            except (KeyError, ValueError):
                raise ValueError(f"no exact IQ kernel for type {qtype}") from None
        return super().__new__(cls)

    @classmethod
    def concat(cls, parts: list) -> object:
        """BlockRows.concat by the first part's class (the base class has no ``stack``)."""
        if cls is IQuantMatrix:
            return type(parts[0]).concat(parts)
        return super().concat(parts)

    def __init__(self, raw: numpy.ndarray, qtype: T | int, n_out: int, n_in: int, repacked: bool = False):
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
            raise ValueError(f"{qtype.name} [{n_out}, {n_in}] needs {n_out * row_bytes} bytes, got {data.size}")
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
