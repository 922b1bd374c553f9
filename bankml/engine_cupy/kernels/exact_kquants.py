"""K-quant matrix products (Q2_K to Q6_K) that round exactly as llama-server's AVX2 CPU backend.

ggml rounds the activation to q8_K blocks (256 values, an f32 scale, 16 sums of 16 quants) and
then takes one of four arithmetics, depending on the weight type, whether llama-server repacked
the matrix (CPU_REPACK buffer) and the number of activation rows ``m``:

- ``vec_dot`` (arch/x86/quants.c, ``ggml_vec_dot_q{2,3,4,5,6}_K_q8_K``, m < 8, not repacked):
  eight exact integer lanes per super-block (lane L = the products of elements 4L..4L+3 of every
  32, each weighted by its sub-block scale), ``acc[L] = fma(d_x·d_w, lane, acc[L])``, then
  ``hsum_float_8``. Q6_K subtracts ``32·(bsums·scales)`` per lane (its quants are stored
  unsigned), Q3_K takes ``q3l·x - q3h·x`` per pair (exact); Q4_K keeps a 4-lane min chain
  ``fma(-d_x·dmin, Σ m·bsum, acc_m)`` added at the end, Q5_K a scalar one (GCC fuses its
  ``summs += dmin * Σ`` into vfmadd231ss); Q2_K fuses its 8 min lanes (min per 16 values ·
  bsums) into ``acc`` itself, ``acc = fma(-d_x·dmin, mins, acc)`` *before* the scale lanes.
- ``tiled`` (tiled/tiled-kernel.cpp, m >= 8, not repacked, new in this build): one exact integer
  per super-block, ``res = d_w·s1`` (Q2_K, Q4_K, Q5_K: ``res = fma(-dmin, s2, res)``) and
  ``out = fma(res, d_x, out)``. llamafile's sgemm takes no K-quant.
- repacked Q4_K (arch/x86/repack.cpp, ``q4_K_8x8``, ``n_out % 8 == 0``): the activation rows in
  groups of four are rounded by ``ggml_quantize_mat_q8_K_4x8`` and go through ``gemm`` (one fma
  per 64 values: ``acc = fma(Σ, d_w·d_x, acc)``, ``accm = fma(Σm·bsum, dmin·d_x, accm)``,
  ``out = acc - accm``); the ``m % 4`` leftover rows are rounded by ``quantize_row_q8_K`` and go
  through ``gemv`` (the same with one fma per super-block). Q2_K is repacked (``q2_K_8x8``) only
  by AVX512 builds, Q3_K never.

Every integer sum is exact in any order, so only the float chains above need to be kept; the
weights stay in their GGUF block bytes. One-row products (vec_dot, gemv) unpack them one
super-block at a time in registers; the batch arithmetics (tiled, gemm) unpack eight weight rows
per task into a scratch copy and compute in weight-row lanes (lane j = weight row r+j, see
"Batch products in weight-row lanes"), with no horizontal sums.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy
from gguf import GGMLQuantizationType as T
from llvmlite import ir
from numba import prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from bankml.engine_cupy.kernels.exact_matmul import (
    HOST_HAS_AVX2,
    HOST_HAS_VNNI,
    HOST_HAS_ZMM_VNNI,
    PARALLEL_MIN_ELEMENTS,
    PARALLEL_MIN_MACS,
    BlockRows,
    MatrixStack,
    _byte_ptr,
    _call,
    _data,
    _dpbusd,
    _half,
    _hsum,
    _load,
    _splat,
)
from bankml.engine_cupy.kernels.jit import njit

__all__ = [
    "KQuantMatrix",
    "KMatrixStack",
    "KActivation",
    "supported",
    "repacked_by_llama_server",
    "quantize_q8_K",
    "row_product",
]

QK_K = 256
_BLOCK_BYTES = {T.Q2_K: 84, T.Q3_K: 110, T.Q4_K: 144, T.Q5_K: 176, T.Q6_K: 210}
TILED_MIN_ROWS = 8  # ggml_tiled_min_batch: the tiled kernel takes batches of 8 rows or more
ROWS_PER_TASK = 16

# arithmetic codes
_VD6, _VD4, _T6, _T4, _GV4, _GM4, _VD5, _T5, _VD3, _T3, _VD2, _T2 = range(12)

# weight type -> (tiled code, vec_dot code) for matrices llama-server does not repack
_PLAIN_CODES = {
    T.Q2_K: (_T2, _VD2),
    T.Q3_K: (_T3, _VD3),
    T.Q4_K: (_T4, _VD4),
    T.Q5_K: (_T5, _VD5),
    T.Q6_K: (_T6, _VD6),
}
# code -> weight type (the block layout it unpacks)
_CODE_TYPE = {code: qtype for qtype, codes in _PLAIN_CODES.items() for code in codes} | {
    _GV4: T.Q4_K,
    _GM4: T.Q4_K,
}
_VECTOR_CODES = {
    _VD6,
    _VD4,
    _VD5,
    _VD3,
    _VD2,
}  # vec_dot: eight float lanes, hsum_float_8 at the end
_MIN_CODES = {_VD4, _T4, _GV4, _GM4, _VD5, _T5, _VD2, _T2}  # types with mins (Q2_K, Q4_K, Q5_K)


def supported(qtype: T | int) -> bool:
    """Whether KQuantMatrix reproduces ggml's product for this weight type on this host."""
    try:
        return HOST_HAS_AVX2 and T(qtype) in _BLOCK_BYTES
    except ValueError:
        return False


def repacked_by_llama_server(qtype: T | int, n_out: int, token_embd: bool = False) -> bool:
    """ggml_repack_get_optimal_repack_type on AVX2: Q4_K -> q4_K_8x8 when the row count is a
    multiple of 8; Q5_K and Q6_K are repacked only on ARM, Q2_K only with AVX512, Q3_K never.
    The token embedding never is (its first use is GET_ROWS, which the repack buffer does not
    take)."""
    return T(qtype) == T.Q4_K and n_out % 8 == 0 and not token_embd


# ---------------------------------------------------------------------------------------------
# Activation rounding to q8_K


@intrinsic
def _round_block(typingctx, x, off, iscale, q, bsums, s_off):
    """q.flat[off:off+256] = min(rint(x·iscale), 127) as int8 and bsums.flat[s_off:s_off+16]
    their sums per 16, for one block of x.flat[off:off+256], in 8-lane vectors (vmulps,
    vroundps to nearest even, cvtps2dq: the scalar rounding's operations, a lane each)."""
    sig = types.void(x, off, iscale, q, bsums, s_off)

    def codegen(context, builder, signature, args):
        aty = signature.args
        _, off, iscale, _, _, s_off = args
        xdata, qdata, sdata = (_data(context, builder, aty[i], args[i]) for i in (0, 3, 4))
        v8f = ir.VectorType(_F32, 8)
        mul = _splat(builder, iscale, v8f)
        top = ir.Constant(_V8I32, [127] * 8)
        for j in range(16):
            total = None
            for h in range(2):
                at = builder.add(off, ir.Constant(off.type, 16 * j + 8 * h))
                v = builder.load(
                    builder.bitcast(builder.gep(xdata, [at]), v8f.as_pointer()), align=4
                )
                r = _call(
                    builder,
                    "llvm.x86.avx.round.ps.256",
                    v8f,
                    [builder.fmul(v, mul), ir.Constant(_I32, 0)],
                )
                i = _call(builder, "llvm.x86.avx.cvt.ps2dq.256", _V8I32, [r])
                i = builder.select(builder.icmp_signed(">", i, top), top, i)
                builder.store(
                    builder.trunc(i, ir.VectorType(_I8, 8)),
                    builder.bitcast(builder.gep(qdata, [at]), ir.VectorType(_I8, 8).as_pointer()),
                    align=1,
                )
                total = i if total is None else builder.add(total, i)
            total = _call(builder, "llvm.vector.reduce.add.v8i32", _I32, [total])
            at = builder.add(s_off, ir.Constant(s_off.type, j))
            builder.store(builder.trunc(total, _I16), builder.gep(sdata, [at]))
        return context.get_dummy_value()

    return sig, codegen


def _bit_vectors(context, builder, aty, arr, off) -> list:
    """The 32 <8 x i32> of one block of 256 values of an int32 array, from flat offset off."""
    data = _data(context, builder, aty, arr)
    return [
        builder.load(
            builder.bitcast(
                builder.gep(data, [builder.add(off, ir.Constant(off.type, 8 * k))]),
                _V8I32.as_pointer(),
            ),
            align=4,
        )
        for k in range(32)
    ]


@intrinsic
def _block_top(typingctx, bits, off):
    """max over the block of (bits & 0x7FFFFFFF): the largest |x| as its bit pattern (the integer
    order of non-negative floats' patterns is their order; a NaN's is above +inf's)."""
    sig = types.int32(bits, off)

    def codegen(context, builder, signature, args):
        mask = ir.Constant(_V8I32, [0x7FFFFFFF] * 8)
        vecs = [
            builder.and_(v, mask)
            for v in _bit_vectors(context, builder, signature.args[0], args[0], args[1])
        ]
        while len(vecs) > 1:
            vecs = [
                _call(builder, "llvm.smax.v8i32", _V8I32, [a, b])
                for a, b in zip(vecs[0::2], vecs[1::2])
            ]
        return _call(builder, "llvm.vector.reduce.smax.v8i32", _I32, [vecs[0]])

    return sig, codegen


@intrinsic
def _block_has(typingctx, bits, off, pattern):
    """Whether the block holds a value with exactly this bit pattern."""
    sig = types.boolean(bits, off, pattern)

    def codegen(context, builder, signature, args):
        want = _splat(
            builder, context.cast(builder, args[2], signature.args[2], types.int32), _V8I32
        )
        found = None
        for v in _bit_vectors(context, builder, signature.args[0], args[0], args[1]):
            eq = builder.icmp_signed("==", v, want)
            found = eq if found is None else builder.or_(found, eq)
        return _call(builder, "llvm.vector.reduce.or.v8i1", ir.IntType(1), [found])

    return sig, codegen


@njit
def _quantize_block(x, bits, t, b, pos_wins, q, d, bsums):  # pragma: no cover - compiled
    """One 256-value block. ``quantize_row_q8_K_ref`` (the x86 build's from_float): the scale's
    sign is that of the first value of largest magnitude; ``ggml_quantize_mat_q8_K_4x8``
    (``pos_wins``): negative whenever +amax occurs. iscale = ∓127/amax, d = 1/iscale, quants
    rint(x·iscale) (the ref's 1.5·2^23 trick is SSE2 mul then add, no fma: the same).

    The largest magnitude is found on the bit patterns (``bits``: x as int32), where the
    integer order of |x| is the float order and the max reduction vectorises (a float one does
    not without fast-math); the first value that has it is then a short scan. A NaN (ggml's
    ``ax > amax`` never takes one) sends the block to the scalar search."""
    base = b * QK_K
    off = t * bits.shape[1] + base
    top = _block_top(bits, off)
    at = -1  # the first value of largest magnitude
    if top > numpy.int32(0x7F800000):  # a NaN: ggml's own search, which skips it
        amax = numpy.float32(0.0)
        for k in range(QK_K):
            if abs(x[t, base + k]) > amax:
                amax, at = abs(x[t, base + k]), k
    elif top != 0:
        for k in range(QK_K):
            if bits[t, base + k] & numpy.int32(0x7FFFFFFF) == top:
                at = k
                break
    if at < 0:  # all zero (or NaN)
        d[t, b] = numpy.float32(0.0)
        for k in range(QK_K):
            q[t, base + k] = 0
        for j in range(16):
            bsums[t, b * 16 + j] = 0
        return
    first = x[t, base + at]
    amax = abs(first)
    if pos_wins:  # negative scale whenever +amax occurs
        positive = _block_has(bits, off, bits[t, base + at] & numpy.int32(0x7FFFFFFF))
        iscale = numpy.float32(-127.0) / amax if positive else numpy.float32(127.0) / amax
    else:
        iscale = numpy.float32(-127.0) / first
    _round_block(x, t * x.shape[1] + base, iscale, q, bsums, t * bsums.shape[1] + b * 16)
    d[t, b] = numpy.float32(1.0) / iscale


@njit
def _quantize_row(x, bits, t, pos_wins, q, d, bsums):  # pragma: no cover - compiled
    for b in range(x.shape[1] // QK_K):
        _quantize_block(x, bits, t, b, pos_wins, q, d, bsums)


@njit
def _quantize_serial(x, groups_of_four):  # pragma: no cover - compiled
    """Rows [0, groups_of_four) by the 4x8 packing rule, the rest by quantize_row_q8_K."""
    m, n = x.shape
    q, d, bsums = (
        numpy.empty((m, n), numpy.int8),
        numpy.empty((m, n // QK_K), numpy.float32),
        numpy.empty((m, n // QK_K * 16), numpy.int16),
    )
    for t in range(m):
        _quantize_row(x, x.view(numpy.int32), t, t < groups_of_four, q, d, bsums)
    return q, d, bsums


@njit(parallel=True)
def _quantize_parallel(x, groups_of_four):  # pragma: no cover - compiled
    """_quantize_serial's rows on the Numba threads (each row's rounding is its own)."""
    m, n = x.shape
    q, d, bsums = (
        numpy.empty((m, n), numpy.int8),
        numpy.empty((m, n // QK_K), numpy.float32),
        numpy.empty((m, n // QK_K * 16), numpy.int16),
    )
    bits = x.view(numpy.int32)
    for t in prange(m):
        _quantize_row(x, bits, t, t < groups_of_four, q, d, bsums)
    return q, d, bsums


class KActivation:
    """Activation rows rounded to q8_K: int8 quants, f32 block scales, the 16 sums per block.
    ``packed_rows``: how many leading rows llama-server rounds with its 4-row packing (repacked
    Q4_K: m - m % 4), which picks the scale's sign differently when both ±amax occur.
    ``order``: the rows of x in the order they were rounded (None: as given), so that the rows
    of one arithmetic come first (KQuantMatrix.arithmetic_order); ``groups``: the groups of
    rows that order was made for (None: one group of every row)."""

    def __init__(
        self,
        x: numpy.ndarray,
        packed_rows: int = 0,
        order: numpy.ndarray | None = None,
        groups: tuple[int, ...] | None = None,
    ):
        x = numpy.ascontiguousarray(numpy.atleast_2d(x), dtype=numpy.float32)
        if x.ndim != 2 or x.shape[1] % QK_K:
            raise ValueError(
                f"activation must be [m, k] with k a multiple of {QK_K}, got {x.shape}"
            )
        if order is not None:
            x = x[order]
        self.packed_rows, self.order, self.groups = packed_rows, order, groups
        quantize = _quantize_parallel if x.size >= PARALLEL_MIN_ELEMENTS else _quantize_serial
        self.q, self.d, self.bsums = quantize(x, packed_rows)

    def blocks(self) -> numpy.ndarray:
        """ggml's block_q8_K bytes (f32 d, int8 qs[256], int16 bsums[16]), [m, n/256 * 292]."""
        m, n = self.q.shape
        nb = n // QK_K
        d = self.d.reshape(m, nb, 1).view(numpy.uint8)
        qs = self.q.view(numpy.uint8).reshape(m, nb, QK_K)
        sums = self.bsums.astype(numpy.int16).reshape(m, nb, 16).view(numpy.uint8)
        return numpy.concatenate([d, qs, sums], axis=-1).reshape(m, -1)


def quantize_q8_K(x: numpy.ndarray) -> numpy.ndarray:
    """f32 rows [m, k] -> block_q8_K bytes, as the x86 build's quantize_row_q8_K (the ref)."""
    return KActivation(x).blocks()


# ---------------------------------------------------------------------------------------------
# Dot products as LLVM IR (AVX2)
#
# Numba's own loops ran at about 1 GMAC/s; each dot is therefore emitted with the instructions
# ggml uses, looping over the super-blocks with its accumulators in registers: the unsigned
# quants unpacked from the block bytes (and/shift/or on byte vectors), pmaddubsw against the
# int8 activation (no saturation: q <= 63), pmaddwd by the sub-block scales. The integer sums
# are exact, so only the float operations (_block_step, _block_step_rows, _finish) keep ggml's
# order.

_I8, _I16, _I32, _F32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.FloatType()
_V32I8, _V16I16, _V8I32 = ir.VectorType(_I8, 32), ir.VectorType(_I16, 16), ir.VectorType(_I32, 8)


def _bytes(v: int) -> ir.Constant:
    return ir.Constant(_V32I8, [v] * 32)


def _q4_k_chunks(builder: ir.IRBuilder, wbase: ir.Value, blk: ir.Value) -> list:
    """The 8 chunks of 32 unsigned 4-bit quants of a block_q4_K (qs at +16): chunk 2g is the low
    nibbles of qs[32g:32g+32], chunk 2g+1 their high nibbles."""
    chunks = []
    for g in range(4):
        raw = _load(builder, wbase, builder.add(blk, ir.Constant(blk.type, 16 + 32 * g)), _V32I8)
        chunks += [builder.and_(raw, _bytes(15)), builder.lshr(raw, _bytes(4))]
    return chunks


def _q5_k_chunks(builder: ir.IRBuilder, wbase: ir.Value, blk: ir.Value) -> list:
    """The 8 chunks of 32 unsigned 5-bit quants of a block_q5_K (qh[32] at +16, qs[128] at +48):
    as Q4_K's nibbles, with bit c of qh[l] as bit 4 of value l of chunk c."""
    h = _load(builder, wbase, builder.add(blk, ir.Constant(blk.type, 16)), _V32I8)
    chunks = []
    for g in range(4):
        raw = _load(builder, wbase, builder.add(blk, ir.Constant(blk.type, 48 + 32 * g)), _V32I8)
        for c, low in (
            (2 * g, builder.and_(raw, _bytes(15))),
            (2 * g + 1, builder.lshr(raw, _bytes(4))),
        ):
            fifth = builder.shl(builder.and_(builder.lshr(h, _bytes(c)), _bytes(1)), _bytes(4))
            chunks.append(builder.or_(low, fifth))
    return chunks


def _q6_k_chunks(builder: ir.IRBuilder, wbase: ir.Value, blk: ir.Value) -> list:
    """The 8 chunks of 32 unsigned 6-bit quants of a block_q6_K (ql[128], qh[64]): per half j,
    ql[64j:64j+32] and ql[64j+32:64j+64] give the low nibbles (chunks 4j, 4j+1) and high nibbles
    (4j+2, 4j+3); qh[32j:32j+32] gives bits 4-5 at shifts 0, 2, 4, 6."""

    def at(k: int) -> ir.Value:
        return _load(builder, wbase, builder.add(blk, ir.Constant(blk.type, k)), _V32I8)

    chunks = []
    for j in range(2):
        b1, b2, h = at(64 * j), at(64 * j + 32), at(128 + 32 * j)
        highs = [
            builder.shl(builder.and_(builder.lshr(h, _bytes(s)), _bytes(3)), _bytes(4))
            for s in (0, 2, 4, 6)
        ]
        lows = [
            builder.and_(b1, _bytes(15)),
            builder.and_(b2, _bytes(15)),
            builder.lshr(b1, _bytes(4)),
            builder.lshr(b2, _bytes(4)),
        ]
        chunks += [builder.or_(lo, hi) for lo, hi in zip(lows, highs)]
    return chunks


def _q2_k_chunks(builder: ir.IRBuilder, wbase: ir.Value, blk: ir.Value) -> list:
    """The 8 chunks of 32 unsigned 2-bit quants of a block_q2_K (qs[64] at +16): chunk 4j+k is
    (qs[32j:32j+32] >> 2k) & 3."""
    chunks = []
    for j in range(2):
        raw = _load(builder, wbase, builder.add(blk, ir.Constant(blk.type, 16 + 32 * j)), _V32I8)
        chunks += [builder.and_(builder.lshr(raw, _bytes(2 * k)), _bytes(3)) for k in range(4)]
    return chunks


def _q3_k_chunks(builder: ir.IRBuilder, wbase: ir.Value, blk: ir.Value) -> list:
    """The 8 chunks of 32 signed 3-bit quants of a block_q3_K (hmask[32] at +0, qs[64] at +32),
    each as ggml's pair (q3l, q3h) whose difference is the quant: for chunk c = 4j+k,
    q3l = (qs[32j:32j+32] >> 2k) & 3 and q3h = 4 where bit c of hmask is clear, else 0."""
    clear = builder.xor(_load(builder, wbase, blk, _V32I8), _bytes(-1))
    chunks = []
    for j in range(2):
        raw = _load(builder, wbase, builder.add(blk, ir.Constant(blk.type, 32 + 32 * j)), _V32I8)
        for k in range(4):
            c = 4 * j + k
            high = builder.shl(builder.and_(builder.lshr(clear, _bytes(c)), _bytes(1)), _bytes(2))
            chunks.append((builder.and_(builder.lshr(raw, _bytes(2 * k)), _bytes(3)), high))
    return chunks


# each type's block unpacking into its 32-value chunks (quants, and high bits where it has them)
_CHUNKS = {
    T.Q2_K: _q2_k_chunks,
    T.Q3_K: _q3_k_chunks,
    T.Q4_K: _q4_k_chunks,
    T.Q5_K: _q5_k_chunks,
    T.Q6_K: _q6_k_chunks,
}


def _vec(builder: ir.IRBuilder, ptr: ir.Value, index: ir.Value, vty: ir.Type) -> ir.Value:
    """A vector loaded from ptr[index] (ptr typed by its elements), unaligned."""
    return builder.load(builder.bitcast(builder.gep(ptr, [index]), vty.as_pointer()), align=1)


def _reduce(builder: ir.IRBuilder, v: ir.Value) -> ir.Value:
    """Σ of an integer vector (exact)."""
    return _call(builder, f"llvm.vector.reduce.add.v{v.type.count}i32", _I32, [v])


def _scale_min_bytes(builder: ir.IRBuilder, wbase: ir.Value, blk: ir.Value) -> ir.Value:
    """block_q4_K/q5_K's 12 bytes of packed 6-bit scales and mins (at +4) -> <16 x i8>: the 8
    scales, then the 8 mins, by ggml's utmp/kmask unpacking (get_scale_min_k4) done on the four
    words at once: with u = the words at +4, +8, +12 (and +16, unused),
    [u0 & m1, (u2 & m2) | ((u0 >> 6) & m3) << 4, u1 & m1, ((u2 >> 4) & m2) | ((u1 >> 6) & m3) << 4]."""
    v4i = ir.VectorType(_I32, 4)

    def k(values: list) -> ir.Constant:
        return ir.Constant(v4i, values)

    u = _load(builder, wbase, builder.add(blk, ir.Constant(blk.type, 4)), v4i)
    low_words = builder.shuffle_vector(u, u, k([0, 2, 1, 2]))
    top_words = builder.shuffle_vector(u, u, k([0, 0, 1, 1]))
    m1, m2, m3 = 0x3F3F3F3F, 0x0F0F0F0F, 0x03030303
    low = builder.and_(builder.lshr(low_words, k([0, 0, 0, 4])), k([m1, m2, m1, m2]))
    top = builder.shl(
        builder.and_(builder.lshr(top_words, k([6] * 4)), k([0, m3, 0, m3])), k([4] * 4)
    )
    return builder.bitcast(builder.or_(low, top), ir.VectorType(_I8, 16))


def _scales_and_mins(builder: ir.IRBuilder, wbase: ir.Value, blk: ir.Value) -> ir.Value:
    """_scale_min_bytes as <16 x i16>."""
    return builder.zext(_scale_min_bytes(builder, wbase, blk), _V16I16)


def _q3_k_scales(builder: ir.IRBuilder, wbase: ir.Value, blk: ir.Value) -> ir.Value:
    """block_q3_K's 12 bytes of packed 6-bit scales (at +96) -> <16 x i16> of the 16 signed
    scales (value - 32), by ggml's aux/kmask word unpacking."""
    u = [
        _load(builder, wbase, builder.add(blk, ir.Constant(blk.type, 96 + 4 * i)), _I32)
        for i in range(3)
    ]

    def k(v: int) -> ir.Constant:
        return ir.Constant(_I32, v)

    def word(low: ir.Value, shift_low: int, shift_high: int) -> ir.Value:
        nibbles = builder.and_(builder.lshr(low, k(shift_low)), k(0x0F0F0F0F))
        tops = builder.and_(builder.lshr(u[2], k(shift_high)), k(0x03030303))
        return builder.or_(nibbles, builder.shl(tops, k(4)))

    words = [word(u[0], 0, 0), word(u[1], 0, 2), word(u[0], 4, 4), word(u[1], 4, 6)]
    biased = builder.sub(
        _word_bytes(builder, words), ir.Constant(ir.VectorType(_I8, 16), [32] * 16)
    )
    return builder.sext(biased, _V16I16)


def _word_bytes(builder: ir.IRBuilder, words: list) -> ir.Value:
    """Four i32 words as the <16 x i8> of their bytes (little-endian, as ggml's memcpy)."""
    vec = ir.Constant(ir.VectorType(_I32, 4), ir.Undefined)
    for i, word in enumerate(words):
        vec = builder.insert_element(vec, word, ir.Constant(_I32, i))
    return builder.bitcast(vec, ir.VectorType(_I8, 16))


def _block_scales(builder: ir.IRBuilder, qtype: T, wbase: ir.Value, blk: ir.Value) -> tuple:
    """A weight block's (scales, mins, d, dmin), read straight from its bytes: scales and mins as
    <16 x i16> per 16 values (Q2_K, Q3_K, Q6_K: 16 sub-blocks) or per 32 (Q4_K, Q5_K: the 8
    scales then the 8 mins); mins and dmin are None for the types without them."""

    def at(k: int) -> ir.Value:
        return builder.add(blk, ir.Constant(blk.type, k))

    if qtype == T.Q6_K:  # int8 scales at +192, d at +208
        scales = builder.sext(_load(builder, wbase, at(192), ir.VectorType(_I8, 16)), _V16I16)
        return scales, None, _half(builder, wbase, at(208)), None
    if qtype == T.Q3_K:  # d at +108
        return _q3_k_scales(builder, wbase, blk), None, _half(builder, wbase, at(108)), None
    if qtype == T.Q2_K:  # a byte per 16 values (scale | min << 4) at +0, d and dmin at +80
        raw = _load(builder, wbase, blk, ir.VectorType(_I8, 16))
        scales = builder.zext(builder.and_(raw, ir.Constant(raw.type, [15] * 16)), _V16I16)
        mins = builder.zext(builder.lshr(raw, ir.Constant(raw.type, [4] * 16)), _V16I16)
        return scales, mins, _half(builder, wbase, at(80)), _half(builder, wbase, at(82))
    packed = _scales_and_mins(builder, wbase, blk)  # Q4_K, Q5_K: d, dmin at +0
    mins = builder.shuffle_vector(
        packed, packed, ir.Constant(ir.VectorType(_I32, 16), [8 + j // 2 for j in range(16)])
    )
    return packed, mins, _half(builder, wbase, blk), _half(builder, wbase, at(2))


class _DotArgs:
    """A dot intrinsic's arguments inside its codegen (the signature ``_make_dot`` describes):
    the arrays' data pointers (w and xq as i8*, xd, bsums and out typed by their elements), the
    integers by name, and ``const`` for constants of their type."""

    def __init__(self, context, builder, signature, args):
        aty = signature.args
        (
            _,
            self.w_first,
            self.row_bytes,
            self.n_rows,
            _,
            self.x_off,
            self.n_in,
            _,
            _,
            self.s_off,
            self.nblocks,
            _,
            self.o_first,
            self.n_out,
        ) = args
        self.wbase = _byte_ptr(context, builder, aty[0], args[0])
        self.xbase = _byte_ptr(context, builder, aty[4], args[4])
        self.xd, self.bsums, self.out = (
            _data(context, builder, aty[i], args[i]) for i in (7, 8, 11)
        )

    def const(self, v: int) -> ir.Value:
        return ir.Constant(self.w_first.type, v)


def _dot_intrinsic(emit):
    """An intrinsic of the dots' signature: for each of its weight rows, ``emit(builder,
    _DotArgs, w_off, o_off)`` writes the row's code (w_off: the row's byte offset in w, o_off:
    its first output's index in out)."""

    @intrinsic
    def dot(
        typingctx,
        w,
        w_off,
        row_bytes,
        n_rows,
        xq,
        x_off,
        n_in,
        xd,
        bsums,
        s_off,
        nb,
        out,
        o_off,
        n_out,
    ):
        sig = types.void(
            w, w_off, row_bytes, n_rows, xq, x_off, n_in, xd, bsums, s_off, nb, out, o_off, n_out
        )

        def codegen(context, builder, signature, args):
            a = _DotArgs(context, builder, signature, args)
            with cgutils.for_range(builder, a.n_rows) as weight_rows:
                w_off = builder.add(a.w_first, builder.mul(weight_rows.index, a.row_bytes))
                emit(builder, a, w_off, builder.add(a.o_first, weight_rows.index))
            return context.get_dummy_value()

        return sig, codegen

    return dot


def _make_dot(code: int, rn: int):
    """dot(w, w_off, row_bytes, n_rows, xq, x_off, n_in, xd, bsums, s_off, nb, out, o_off, n_out):
    rn outputs of arithmetic ``code`` (see the module docstring) over nb super-blocks for each
    of n_rows weight rows, one weight row at a time against rn activation rows. Weight row i is
    at byte w_off + i·row_bytes of w (its scales, mins and d read from the blocks), unpacked
    once per block for all rn rows; activation row j is at x_off + j·n_in of xq (int8), its
    block scales at s_off + j·nb of xd and its sums at 16 times that of bsums (int16); their
    output goes to out.flat[o_off + i + j·n_out]. The rows loop inside, so that a task of rows
    is one call."""
    qtype = _CODE_TYPE[code]
    unpack = _CHUNKS[qtype]
    block_bytes = _BLOCK_BYTES[qtype]
    v8f, v4f = ir.VectorType(_F32, 8), ir.VectorType(_F32, 4)
    v16i = ir.VectorType(_I32, 16)
    vector_acc = code in _VECTOR_CODES
    per16 = qtype in (T.Q2_K, T.Q3_K, T.Q6_K)  # a scale per 16 values, not per 32
    across = rn == 4 and not vector_acc  # scalar chains: four rows' in one vector

    def emit(builder: ir.IRBuilder, a: _DotArgs, w_off: ir.Value, o_off: ir.Value) -> None:
        x_off, n_in, s_off, nblocks = a.x_off, a.n_in, a.s_off, a.nblocks
        n_out, const = a.n_out, a.const
        wbase, xbase, xdp, bsp, obase = a.wbase, a.xbase, a.xd, a.bsums, a.out
        zero = ir.Constant(v8f, [0.0] * 8) if vector_acc else ir.Constant(_F32, 0.0)
        zero_m = ir.Constant(v4f, [0.0] * 4) if code == _VD4 else ir.Constant(_F32, 0.0)
        acc = [cgutils.alloca_once_value(builder, zero) for _ in range(rn)]
        accm = [cgutils.alloca_once_value(builder, zero_m) for _ in range(rn)]
        # scalar chains of four rows side by side in one <4 x float> (lane j: row j)
        acc4 = cgutils.alloca_once_value(builder, ir.Constant(v4f, [0.0] * 4))
        accm4 = cgutils.alloca_once_value(builder, ir.Constant(v4f, [0.0] * 4))
        with cgutils.for_range(builder, nblocks) as loop:
            b = loop.index
            blk = builder.add(w_off, builder.mul(b, const(block_bytes)))
            scales, mins16, d_w, dm_w = _block_scales(builder, qtype, wbase, blk)
            chunks = unpack(builder, wbase, blk)
            chunk_scales = [
                builder.shuffle_vector(
                    scales,
                    scales,
                    ir.Constant(v16i, [2 * c] * 8 + [2 * c + 1] * 8 if per16 else [c] * 16),
                )
                for c in range(8)
            ]
            rows = []
            for j in range(rn):
                row = builder.add(s_off, builder.mul(const(j), nblocks))
                xo = builder.add(
                    builder.add(x_off, builder.mul(const(j), n_in)),
                    builder.mul(b, const(QK_K)),
                )
                d_x = builder.load(builder.gep(xdp, [builder.add(row, b)]))
                sums = _vec(builder, bsp, builder.mul(builder.add(row, b), const(16)), _V16I16)
                groups = []
                for g in range(4):
                    total = None
                    for c in (2 * g, 2 * g + 1):
                        x = _load(builder, xbase, builder.add(xo, const(32 * c)), _V32I8)
                        pairs = _pairs(builder, chunks[c], x)
                        quads = _call(
                            builder,
                            "llvm.x86.avx2.pmadd.wd",
                            _V8I32,
                            [pairs, chunk_scales[c]],
                        )
                        total = quads if total is None else builder.add(total, quads)
                    groups.append(total)
                if across:
                    rows.append((groups, sums, d_x))
                else:
                    _block_step(
                        builder,
                        code,
                        groups,
                        sums,
                        scales,
                        mins16,
                        d_x,
                        d_w,
                        dm_w,
                        acc[j],
                        accm[j],
                    )
            if across:
                _block_step_rows(builder, code, rows, scales, mins16, d_w, dm_w, acc4, accm4)
        for j in range(rn):
            index = builder.add(o_off, builder.mul(const(j), n_out))
            if across:
                total = builder.load(acc4)
                if code in (_GV4, _GM4):
                    total = builder.fsub(total, builder.load(accm4))
                value = builder.extract_element(total, ir.Constant(_I32, j))
            else:
                value = _finish(builder, code, acc[j], accm[j])
            builder.store(value, builder.gep(obase, [index]))

    return _dot_intrinsic(emit)


# --- gemv and Q6_K vec_dot on 512-bit vectors (hosts with AVX512BW and VNNI) -------------------
#
# Two 32-value chunks per vector: a super-block is four pmaddubsw and four pmaddwd (LLVM fuses
# each with its sum into vpdpwssd), the chunks' scales spread to their int16 lanes by one
# shuffle a pair. The integers are the AVX2 dots' (exact in any order) and the float steps the
# same operations in the same order, so the bits are the same; a super-block takes about 70
# instructions where the AVX2 dot takes 95 (docs/bench.md, "bench/real_size.py").

_V64I8, _V32I16, _V16I32 = ir.VectorType(_I8, 64), ir.VectorType(_I16, 32), ir.VectorType(_I32, 16)


def _lanes(values: list) -> ir.Constant:
    return ir.Constant(ir.VectorType(_I32, len(values)), values)


def _half_of(builder: ir.IRBuilder, v: ir.Value, high: bool) -> ir.Value:
    n = v.type.count // 2
    return builder.shuffle_vector(v, v, _lanes(list(range(n, 2 * n) if high else range(n))))


def _scaled_pairs(builder: ir.IRBuilder, q: ir.Value, x: ir.Value, scales: ir.Value) -> ir.Value:
    """pmaddubsw of two chunks' unsigned quants by their activations, then pmaddwd by their
    sub-block scales (int16 lanes): <16 x i32>, lanes 0-7 the first chunk's, 8-15 the second's."""
    prod = _call(builder, "llvm.x86.avx512.pmaddubs.w.512", _V32I16, [q, x])
    return _call(builder, "llvm.x86.avx512.pmaddw.d.512", _V16I32, [prod, scales])


def _chunk_lanes(block: _RowBlock, r: int, pairs: list) -> ir.Value:
    """Activation row r's eight exact int32 lanes of a super-block: the four chunk pairs'
    (quants, scales) by its activations (pair j: values 64j..64j+63), added, then the two
    halves of the vector (lane L: values 4L..4L+3 of every 32, by their scales)."""
    builder = block.builder
    total = None
    for j, (q, scales) in enumerate(pairs):
        part = _scaled_pairs(builder, q, block.activation(r, 64 * j), scales)
        total = part if total is None else builder.add(total, part)
    return builder.add(_half_of(builder, total, False), _half_of(builder, total, True))


class _RowBlock:
    """What a dot's super-block step reads: the weight block's byte offset ``blk`` and, for
    each activation row j, its block's offset ``xo[j]`` in xq, scale ``d_x[j]`` and 16 sums
    ``sums[j]`` (<16 x i16>)."""

    def __init__(self, builder, wbase, xbase, blk, xo, d_x, sums, const):
        self.builder, self.wbase, self.xbase = builder, wbase, xbase
        self.blk, self.xo, self.d_x, self.sums, self.const = blk, xo, d_x, sums, const

    def weights(self, offset: int, ty: ir.Type) -> ir.Value:
        return _load(self.builder, self.wbase, self.builder.add(self.blk, self.const(offset)), ty)

    def activation(self, j: int, offset: int) -> ir.Value:
        return _load(
            self.builder, self.xbase, self.builder.add(self.xo[j], self.const(offset)), _V64I8
        )

    def half(self, offset: int) -> ir.Value:
        return _half(self.builder, self.wbase, self.builder.add(self.blk, self.const(offset)))


def _row_dot(qtype: T, rn: int, zeros: list, step, finish):
    """An intrinsic of ``dot``'s signature for rn activation rows: for each weight row, every
    activation row's accumulators start at ``zeros``, ``step(block, accs)`` emits one
    super-block's operations (a _RowBlock; accs[j] row j's accumulators' allocas) and
    ``finish(builder, accs[j])`` row j's output."""
    block_bytes = _BLOCK_BYTES[qtype]

    def emit(builder: ir.IRBuilder, a: _DotArgs, w_off: ir.Value, o_first: ir.Value) -> None:
        const, nblocks = a.const, a.nblocks
        accs = [[cgutils.alloca_once_value(builder, zero) for zero in zeros] for _ in range(rn)]
        with cgutils.for_range(builder, nblocks) as loop:
            b = loop.index
            at = [
                builder.add(builder.add(a.s_off, builder.mul(const(j), nblocks)), b)
                for j in range(rn)
            ]
            block = _RowBlock(
                builder,
                a.wbase,
                a.xbase,
                builder.add(w_off, builder.mul(b, const(block_bytes))),
                [
                    builder.add(
                        builder.add(a.x_off, builder.mul(const(j), a.n_in)),
                        builder.mul(b, const(QK_K)),
                    )
                    for j in range(rn)
                ],
                [builder.load(builder.gep(a.xd, [i])) for i in at],
                [_vec(builder, a.bsums, builder.mul(i, const(16)), _V16I16) for i in at],
                const,
            )
            step(block, accs)
        for j in range(rn):
            o_off = builder.add(o_first, builder.mul(const(j), a.n_out))
            builder.store(finish(builder, accs[j]), builder.gep(a.out, [o_off]))

    return _dot_intrinsic(emit)


def _fma_into(builder: ir.IRBuilder, a: ir.Value, b: ir.Value, chain: ir.Value) -> None:
    """chain = fma(a, b, chain), chain an alloca of a float or float vector."""
    ty = a.type
    name = f"llvm.fma.v{ty.count}f32" if isinstance(ty, ir.VectorType) else "llvm.fma.f32"
    builder.store(_call(builder, name, ty, [a, b, builder.load(chain)]), chain)


def _make_gv4_zmm(rn: int):
    """The repacked-Q4_K gemv dot (``_GV4``) for rn activation rows: per super-block, the 8
    sub-blocks in four vectors (unpacked once for the rn rows), one horizontal sum for each
    row's block integer and min sum together, then ``acc = fma(Σ, d_w·d_x, acc)`` and
    ``accm = fma(Σm, dmin·d_x, accm)``; ``acc - accm``."""

    def spread(a: int, b: int) -> ir.Constant:
        """vpshufb indices taking, in every 128-bit lane of the 16 scale and min bytes, scale a
        to the int16 lanes of the vector's low half and scale b to its high half."""
        return ir.Constant(_V64I8, [a, -128] * 16 + [b, -128] * 16)

    scale_pairs = [spread(2 * j, 2 * j + 1) for j in range(4)]
    min_spread = ir.Constant(_V32I8, [v for j in range(16) for v in (8 + j // 2, -128)])
    low_nibbles, four = ir.Constant(_V64I8, [15] * 64), ir.Constant(_V64I8, [4] * 64)

    def step(block: _RowBlock, accs: list) -> None:
        builder = block.builder
        sm16 = _scale_min_bytes(builder, block.wbase, block.blk)
        sm64 = builder.shuffle_vector(sm16, sm16, _lanes([i % 16 for i in range(64)]))
        pairs = []  # (quants, scales) of sub-blocks 2j, 2j+1
        for g in range(2):  # qs[64g:64g+64]: sub-blocks 4g..4g+3
            raw = block.weights(16 + 64 * g, _V64I8)
            low = builder.and_(raw, low_nibbles)  # [4g | 4g+2]
            high = builder.and_(builder.lshr(raw, four), low_nibbles)  # [4g+1 | 4g+3]
            for k, order in enumerate(
                ([*range(32), *range(64, 96)], [*range(32, 64), *range(96, 128)])
            ):
                scales = _call(
                    builder, "llvm.x86.avx512.pshuf.b.512", _V64I8, [sm64, scale_pairs[2 * g + k]]
                )
                pairs.append(
                    (
                        builder.shuffle_vector(low, high, _lanes(order)),
                        builder.bitcast(scales, _V32I16),
                    )
                )
        mins = builder.bitcast(
            _call(
                builder,
                "llvm.x86.avx2.pshuf.b",
                _V32I8,
                [_half_of(builder, sm64, False), min_spread],
            ),
            _V16I16,
        )
        d_w, dm_w = block.half(0), block.half(2)
        for r in range(len(accs)):
            folded = _chunk_lanes(block, r, pairs)
            min_pairs = _call(builder, "llvm.x86.avx2.pmadd.wd", _V8I32, [block.sums[r], mins])
            # lanes 0, 1 of the sum of both halves: the block's integer and its min sum
            h = _call(builder, "llvm.x86.avx2.phadd.d", _V8I32, [folded, min_pairs])
            h = _call(builder, "llvm.x86.avx2.phadd.d", _V8I32, [h, h])
            both = builder.add(_half_of(builder, h, False), _half_of(builder, h, True))
            both = builder.sitofp(both, ir.VectorType(_F32, 4))
            for i, (d, chain) in enumerate(((d_w, accs[r][0]), (dm_w, accs[r][1]))):
                s = builder.extract_element(both, ir.Constant(_I32, i))
                _fma_into(builder, s, builder.fmul(d, block.d_x[r]), chain)

    def finish(builder: ir.IRBuilder, accs: list) -> ir.Value:
        return builder.fsub(builder.load(accs[0]), builder.load(accs[1]))

    zero = ir.Constant(_F32, 0.0)
    return _row_dot(T.Q4_K, rn, [zero, zero], step, finish)


def _make_vd6_zmm(rn: int):
    """The Q6_K vec_dot (``_VD6``) for rn activation rows: per super-block the eight exact integer lanes of the
    AVX2 dot (lane L: elements 4L..4L+3 of every 32, by their scales, less 32·bsums·scales),
    from four vectors of two chunks folded, then ``acc = fma(d_x·d_w, lanes, acc)`` (8 lanes) and
    hsum_float_8."""
    low_nibbles = ir.Constant(_V64I8, [15] * 64)
    top_bits = ir.Constant(_V64I8, [0x30] * 64)
    # qh to bits 4-5 of chunks (4j, 4j+1) and (4j+2, 4j+3): shifts 0, 2, 4, 6 of qh, by word
    shifts = [
        ir.Constant(_V32I16, [4] * 16 + [2] * 16),  # << 4, << 2
        ir.Constant(_V32I16, [0] * 16 + [2] * 16),  # >> 0, >> 2
    ]
    # vpermw indices: chunk pair (2g, 2g+1) takes scales 4g..4g+3, 16 values (8 int16 lanes) each
    scale_index = [ir.Constant(_V32I16, [4 * g + i // 8 for i in range(32)]) for g in range(4)]

    def step(block: _RowBlock, accs: list) -> None:
        builder = block.builder
        scales16 = builder.sext(block.weights(192, ir.VectorType(_I8, 16)), _V16I16)
        scales32 = builder.shuffle_vector(scales16, scales16, _lanes(list(range(32))))
        pairs = []  # (quants, scales) of chunks 2g, 2g+1
        for j in range(2):  # ql[64j:64j+64], qh[32j:32j+32]: chunks 4j..4j+3
            raw = block.weights(64 * j, _V64I8)
            h = block.weights(128 + 32 * j, _V32I8)
            h64 = builder.bitcast(
                builder.shuffle_vector(h, h, _lanes(list(range(32)) * 2)), _V32I16
            )
            highs = [
                builder.shl(h64, shifts[0]),  # chunks 4j, 4j+1: bits 0-1, 2-3 of qh to 4-5
                builder.lshr(h64, shifts[1]),  # chunks 4j+2, 4j+3: bits 4-5, 6-7
            ]
            lows = [
                builder.and_(raw, low_nibbles),
                builder.and_(builder.lshr(raw, ir.Constant(_V64I8, [4] * 64)), low_nibbles),
            ]
            for k in range(2):
                g = 2 * j + k
                q = builder.or_(lows[k], builder.and_(builder.bitcast(highs[k], _V64I8), top_bits))
                scales = _call(
                    builder, "llvm.x86.avx512.permvar.hi.512", _V32I16, [scales32, scale_index[g]]
                )
                pairs.append((q, scales))
        v8f = ir.VectorType(_F32, 8)
        d_w = block.half(208)
        for r in range(len(accs)):
            lanes = _chunk_lanes(block, r, pairs)
            corr = _call(builder, "llvm.x86.avx2.pmadd.wd", _V8I32, [block.sums[r], scales16])
            lanes = builder.sub(lanes, builder.shl(corr, ir.Constant(_V8I32, [5] * 8)))
            scale = _splat(builder, builder.fmul(block.d_x[r], d_w), v8f)
            _fma_into(builder, scale, builder.sitofp(lanes, v8f), accs[r][0])

    def finish(builder: ir.IRBuilder, accs: list) -> ir.Value:
        return _hsum(builder, builder.load(accs[0]))

    return _row_dot(T.Q6_K, rn, [ir.Constant(ir.VectorType(_F32, 8), [0.0] * 8)], step, finish)


def _pairs(builder: ir.IRBuilder, chunk: ir.Value | tuple, x: ir.Value) -> ir.Value:
    """pmaddubsw of a chunk's unsigned quants by 32 int8 activations (no saturation reachable);
    Q3_K's (q3l, q3h) chunks give q3l·x - q3h·x, as ggml subtracts them (exact in int16)."""

    def madd(q: ir.Value) -> ir.Value:
        return _call(builder, "llvm.x86.avx2.pmadd.ub.sw", _V16I16, [q, x])

    if isinstance(chunk, tuple):
        return builder.sub(madd(chunk[0]), madd(chunk[1]))
    return madd(chunk)


def _block_step(
    builder: ir.IRBuilder,
    code: int,
    groups: list,
    sums: ir.Value,
    scales: ir.Value,
    mins16: ir.Value | None,
    d_x: ir.Value,
    d_w: ir.Value,
    dm_w: ir.Value | None,
    acc: ir.Value,
    accm: ir.Value,
) -> None:
    """One super-block's float operations for one output, from its exact integer groups (4 x 8
    lanes), the activation block's sums and scale and the weight block's scale(s)."""
    v8f, v4f, v4i = ir.VectorType(_F32, 8), ir.VectorType(_F32, 4), ir.VectorType(_I32, 4)

    def fma(name: str, ty: ir.Type, a: ir.Value, b: ir.Value, c: ir.Value) -> ir.Value:
        return _call(builder, name, ty, [a, b, c])

    lanes = builder.add(builder.add(groups[0], groups[1]), builder.add(groups[2], groups[3]))
    min_pairs = None
    if code in (_VD6, _T6):  # Q6_K's -32 per quant, through the sums (ggml's q8sclsub)
        corr = _call(builder, "llvm.x86.avx2.pmadd.wd", _V8I32, [sums, scales])
        lanes = builder.sub(lanes, builder.shl(corr, ir.Constant(_V8I32, [5] * 8)))
    elif code in _MIN_CODES:  # pair p = Σ min·bsums over 32 values (Q4_K/Q5_K: one min, Q2_K: two)
        min_pairs = _call(builder, "llvm.x86.avx2.pmadd.wd", _V8I32, [sums, mins16])
    if code in _VECTOR_CODES:
        if code == _VD2:  # Q2_K's min lanes go into the same accumulator, before the scales
            neg = _splat(builder, builder.fneg(builder.fmul(d_x, dm_w)), v8f)
            builder.store(
                fma("llvm.fma.v8f32", v8f, neg, builder.sitofp(min_pairs, v8f), builder.load(acc)),
                acc,
            )
        scale = _splat(builder, builder.fmul(d_x, d_w), v8f)
        builder.store(
            fma("llvm.fma.v8f32", v8f, scale, builder.sitofp(lanes, v8f), builder.load(acc)), acc
        )
        if code == _VD4:  # four lanes: m[2i]·q8s[2i] + m[2i+1]·q8s[2i+1]
            even = builder.shuffle_vector(min_pairs, min_pairs, ir.Constant(v4i, [0, 2, 4, 6]))
            odd = builder.shuffle_vector(min_pairs, min_pairs, ir.Constant(v4i, [1, 3, 5, 7]))
            neg = _splat(builder, builder.fneg(builder.fmul(d_x, dm_w)), v4f)
            prod = builder.sitofp(builder.add(even, odd), v4f)
            builder.store(fma("llvm.fma.v4f32", v4f, neg, prod, builder.load(accm)), accm)
        elif code == _VD5:  # one scalar chain
            total = builder.sitofp(_reduce(builder, min_pairs), _F32)
            neg = builder.fneg(builder.fmul(d_x, dm_w))
            builder.store(fma("llvm.fma.f32", _F32, neg, total, builder.load(accm)), accm)
    elif code == _GM4:  # one fma pair per 64 values
        scale, mscale = builder.fmul(d_w, d_x), builder.fmul(dm_w, d_x)
        for g in range(4):
            s = builder.sitofp(_reduce(builder, groups[g]), _F32)
            mg = builder.add(
                builder.extract_element(min_pairs, ir.Constant(_I32, 2 * g)),
                builder.extract_element(min_pairs, ir.Constant(_I32, 2 * g + 1)),
            )
            builder.store(fma("llvm.fma.f32", _F32, s, scale, builder.load(acc)), acc)
            builder.store(
                fma("llvm.fma.f32", _F32, builder.sitofp(mg, _F32), mscale, builder.load(accm)),
                accm,
            )
    elif code == _GV4:  # one fma pair per super-block
        s1 = builder.sitofp(_reduce(builder, lanes), _F32)
        s2 = builder.sitofp(_reduce(builder, min_pairs), _F32)
        builder.store(fma("llvm.fma.f32", _F32, s1, builder.fmul(d_w, d_x), builder.load(acc)), acc)
        builder.store(
            fma("llvm.fma.f32", _F32, s2, builder.fmul(dm_w, d_x), builder.load(accm)), accm
        )
    else:  # tiled: res = d_w·s1 (- dmin·s2 fused), out = fma(res, d_x, out)
        res = builder.fmul(d_w, builder.sitofp(_reduce(builder, lanes), _F32))
        if min_pairs is not None:
            s2 = builder.sitofp(_reduce(builder, min_pairs), _F32)
            res = fma("llvm.fma.f32", _F32, builder.fneg(dm_w), s2, res)
        builder.store(fma("llvm.fma.f32", _F32, res, d_x, builder.load(acc)), acc)


def _sum_rows(builder: ir.IRBuilder, vecs: list) -> ir.Value:
    """The totals of four <8 x i32> as one <4 x i32> (three phaddd and one add: the sums are
    exact, so their grouping is free)."""

    def hadd(a: ir.Value, b: ir.Value) -> ir.Value:
        return _call(builder, "llvm.x86.avx2.phadd.d", _V8I32, [a, b])

    s = hadd(hadd(vecs[0], vecs[1]), hadd(vecs[2], vecs[3]))
    v4i = ir.VectorType(_I32, 4)
    low = builder.shuffle_vector(s, s, ir.Constant(v4i, [0, 1, 2, 3]))
    high = builder.shuffle_vector(s, s, ir.Constant(v4i, [4, 5, 6, 7]))
    return builder.add(low, high)


def _block_step_rows(
    builder: ir.IRBuilder,
    code: int,
    rows: list,
    scales: ir.Value,
    mins16: ir.Value | None,
    d_w: ir.Value,
    dm_w: ir.Value | None,
    acc4: ir.Value,
    accm4: ir.Value,
) -> None:
    """_block_step for four activation rows of a scalar-chain arithmetic (tiled, repacked gemv
    and gemm): lane j of every vector is row j, and each lane's operations are the scalar ones."""
    v4f, v4i = ir.VectorType(_F32, 4), ir.VectorType(_I32, 4)

    def fma(a: ir.Value, b: ir.Value, c: ir.Value) -> ir.Value:
        return _call(builder, "llvm.fma.v4f32", v4f, [a, b, c])

    def gather(values: list) -> ir.Value:
        vec = ir.Constant(v4f, ir.Undefined)
        for j, v in enumerate(values):
            vec = builder.insert_element(vec, v, ir.Constant(_I32, j))
        return vec

    d_x = gather([d for _, _, d in rows])
    lanes, min_pairs = [], []
    for groups, sums, _ in rows:
        total = builder.add(builder.add(groups[0], groups[1]), builder.add(groups[2], groups[3]))
        if code == _T6:  # Q6_K's -32 per quant, through the sums
            corr = _call(builder, "llvm.x86.avx2.pmadd.wd", _V8I32, [sums, scales])
            total = builder.sub(total, builder.shl(corr, ir.Constant(_V8I32, [5] * 8)))
        elif code in _MIN_CODES:
            min_pairs.append(_call(builder, "llvm.x86.avx2.pmadd.wd", _V8I32, [sums, mins16]))
        lanes.append(total)
    if code == _GM4:  # one fma pair per 64 values
        scale, mscale = (
            builder.fmul(_splat(builder, d_w, v4f), d_x),
            builder.fmul(_splat(builder, dm_w, v4f), d_x),
        )
        # per row, the 4 groups' min sums (pairs 2g, 2g+1), then transposed to per group, by row
        q = [
            builder.add(
                builder.shuffle_vector(p, p, ir.Constant(v4i, [0, 2, 4, 6])),
                builder.shuffle_vector(p, p, ir.Constant(v4i, [1, 3, 5, 7])),
            )
            for p in min_pairs
        ]
        t = [
            builder.shuffle_vector(q[0], q[1], ir.Constant(v4i, [0, 4, 1, 5])),
            builder.shuffle_vector(q[2], q[3], ir.Constant(v4i, [0, 4, 1, 5])),
            builder.shuffle_vector(q[0], q[1], ir.Constant(v4i, [2, 6, 3, 7])),
            builder.shuffle_vector(q[2], q[3], ir.Constant(v4i, [2, 6, 3, 7])),
        ]
        mins_by_group = [
            builder.shuffle_vector(t[0], t[1], ir.Constant(v4i, [0, 1, 4, 5])),
            builder.shuffle_vector(t[0], t[1], ir.Constant(v4i, [2, 3, 6, 7])),
            builder.shuffle_vector(t[2], t[3], ir.Constant(v4i, [0, 1, 4, 5])),
            builder.shuffle_vector(t[2], t[3], ir.Constant(v4i, [2, 3, 6, 7])),
        ]
        for g in range(4):
            s = builder.sitofp(_sum_rows(builder, [groups[g] for groups, _, _ in rows]), v4f)
            builder.store(fma(s, scale, builder.load(acc4)), acc4)
            builder.store(
                fma(builder.sitofp(mins_by_group[g], v4f), mscale, builder.load(accm4)), accm4
            )
        return
    s1 = builder.sitofp(_sum_rows(builder, lanes), v4f)
    s2 = builder.sitofp(_sum_rows(builder, min_pairs), v4f) if min_pairs else None
    if code == _GV4:
        builder.store(
            fma(s1, builder.fmul(_splat(builder, d_w, v4f), d_x), builder.load(acc4)), acc4
        )
        builder.store(
            fma(s2, builder.fmul(_splat(builder, dm_w, v4f), d_x), builder.load(accm4)), accm4
        )
        return
    res = builder.fmul(_splat(builder, d_w, v4f), s1)  # tiled
    if s2 is not None:
        res = fma(_splat(builder, builder.fneg(dm_w), v4f), s2, res)
    builder.store(fma(res, d_x, builder.load(acc4)), acc4)


def _finish(builder: ir.IRBuilder, code: int, acc: ir.Value, accm: ir.Value) -> ir.Value:
    """The output from the accumulators: hsum_float_8 (+ the min chain) for vec_dot, acc - accm
    for the repacked kernels, the accumulator itself for tiled."""
    total = builder.load(acc)
    if code in _VECTOR_CODES:
        total = _hsum(builder, total)
        if code == _VD4:
            a = [
                builder.extract_element(builder.load(accm), ir.Constant(_I32, i)) for i in range(4)
            ]
            total = builder.fadd(
                total, builder.fadd(builder.fadd(a[0], a[2]), builder.fadd(a[1], a[3]))
            )
        elif code == _VD5:
            total = builder.fadd(total, builder.load(accm))
    elif code in (_GV4, _GM4):
        total = builder.fsub(total, builder.load(accm))
    return total


# [code] -> (one activation row, four activation rows)
_DOTS = {code: (_make_dot(code, 1), _make_dot(code, 4)) for code in _CODE_TYPE}
if HOST_HAS_ZMM_VNNI:
    # four rows of gemv stay AVX2: its four scalar chains in one vector measured faster (0.17
    # against 0.23 ms for four rows of 1024x3072 in cache)
    _DOTS[_GV4] = (_make_gv4_zmm(1), _DOTS[_GV4][1])
    _DOTS[_VD6] = (_make_vd6_zmm(1), _make_vd6_zmm(4))
_dot1_vd6, _dot4_vd6 = _DOTS[_VD6]
_dot1_vd4, _dot4_vd4 = _DOTS[_VD4]
_dot1_vd5, _dot4_vd5 = _DOTS[_VD5]
_dot1_t6, _dot4_t6 = _DOTS[_T6]
_dot1_t4, _dot4_t4 = _DOTS[_T4]
_dot1_t5, _dot4_t5 = _DOTS[_T5]
_dot1_gv4, _dot4_gv4 = _DOTS[_GV4]
_dot1_gm4, _dot4_gm4 = _DOTS[_GM4]
_dot1_vd3, _dot4_vd3 = _DOTS[_VD3]
_dot1_t3, _dot4_t3 = _DOTS[_T3]
_dot1_vd2, _dot4_vd2 = _DOTS[_VD2]
_dot1_t2, _dot4_t2 = _DOTS[_T2]


@njit
def _dot(
    code, rn, raw, w, row_bytes, rows, xq, x, n, xd, bsums, s, nb, out, o, n_out
):  # pragma: no cover - compiled
    """``rows`` weight rows, each by rn (1 or 4) activation rows; the branches fold for a constant
    code."""
    if code == _VD6:
        if rn == 4:
            _dot4_vd6(raw, w, row_bytes, rows, xq, x, n, xd, bsums, s, nb, out, o, n_out)
        else:
            _dot1_vd6(raw, w, row_bytes, rows, xq, x, n, xd, bsums, s, nb, out, o, n_out)
    elif code == _VD4:
        if rn == 4:
            _dot4_vd4(raw, w, row_bytes, rows, xq, x, n, xd, bsums, s, nb, out, o, n_out)
        else:
            _dot1_vd4(raw, w, row_bytes, rows, xq, x, n, xd, bsums, s, nb, out, o, n_out)
    elif code == _VD5:
        if rn == 4:
            _dot4_vd5(raw, w, row_bytes, rows, xq, x, n, xd, bsums, s, nb, out, o, n_out)
        else:
            _dot1_vd5(raw, w, row_bytes, rows, xq, x, n, xd, bsums, s, nb, out, o, n_out)
    elif code == _T6:
        if rn == 4:
            _dot4_t6(raw, w, row_bytes, rows, xq, x, n, xd, bsums, s, nb, out, o, n_out)
        else:
            _dot1_t6(raw, w, row_bytes, rows, xq, x, n, xd, bsums, s, nb, out, o, n_out)
    elif code == _T4:
        if rn == 4:
            _dot4_t4(raw, w, row_bytes, rows, xq, x, n, xd, bsums, s, nb, out, o, n_out)
        else:
            _dot1_t4(raw, w, row_bytes, rows, xq, x, n, xd, bsums, s, nb, out, o, n_out)
    elif code == _T5:
        if rn == 4:
            _dot4_t5(raw, w, row_bytes, rows, xq, x, n, xd, bsums, s, nb, out, o, n_out)
        else:
            _dot1_t5(raw, w, row_bytes, rows, xq, x, n, xd, bsums, s, nb, out, o, n_out)
    elif code == _GV4:
        if rn == 4:
            _dot4_gv4(raw, w, row_bytes, rows, xq, x, n, xd, bsums, s, nb, out, o, n_out)
        else:
            _dot1_gv4(raw, w, row_bytes, rows, xq, x, n, xd, bsums, s, nb, out, o, n_out)
    elif code == _VD3:
        if rn == 4:
            _dot4_vd3(raw, w, row_bytes, rows, xq, x, n, xd, bsums, s, nb, out, o, n_out)
        else:
            _dot1_vd3(raw, w, row_bytes, rows, xq, x, n, xd, bsums, s, nb, out, o, n_out)
    elif code == _T3:
        if rn == 4:
            _dot4_t3(raw, w, row_bytes, rows, xq, x, n, xd, bsums, s, nb, out, o, n_out)
        else:
            _dot1_t3(raw, w, row_bytes, rows, xq, x, n, xd, bsums, s, nb, out, o, n_out)
    elif code == _VD2:
        if rn == 4:
            _dot4_vd2(raw, w, row_bytes, rows, xq, x, n, xd, bsums, s, nb, out, o, n_out)
        else:
            _dot1_vd2(raw, w, row_bytes, rows, xq, x, n, xd, bsums, s, nb, out, o, n_out)
    elif code == _T2:
        if rn == 4:
            _dot4_t2(raw, w, row_bytes, rows, xq, x, n, xd, bsums, s, nb, out, o, n_out)
        else:
            _dot1_t2(raw, w, row_bytes, rows, xq, x, n, xd, bsums, s, nb, out, o, n_out)
    elif rn == 4:
        _dot4_gm4(raw, w, row_bytes, rows, xq, x, n, xd, bsums, s, nb, out, o, n_out)
    else:
        _dot1_gm4(raw, w, row_bytes, rows, xq, x, n, xd, bsums, s, nb, out, o, n_out)


@njit
def _rows(code, raw, r0, r1, xq, xd, bsums, out):  # pragma: no cover - compiled
    """out[:, r0:r1] in the arithmetic ``code``: the weight rows against the activation rows
    four at a time (each weight block unpacked once per four), then one at a time."""
    m, n = xq.shape
    nb = n // QK_K
    n_out = out.shape[1]
    row_bytes = raw.shape[1]
    w, rows = r0 * row_bytes, r1 - r0
    t = 0
    while t < m:
        rn = 4 if t + 4 <= m else 1
        o = t * n_out + r0
        _dot(code, rn, raw, w, row_bytes, rows, xq, t * n, n, xd, bsums, t * nb, nb, out, o, n_out)
        t += rn


@njit
def _serial(code, raw, xq, xd, bsums, out):  # pragma: no cover - compiled
    _rows(code, raw, 0, raw.shape[0], xq, xd, bsums, out)


@njit(parallel=True)
def _parallel(code, raw, xq, xd, bsums, out):  # pragma: no cover - compiled
    n_out = raw.shape[0]
    for task in prange((n_out + ROWS_PER_TASK - 1) // ROWS_PER_TASK):
        r0 = task * ROWS_PER_TASK
        _rows(code, raw, r0, min(r0 + ROWS_PER_TASK, n_out), xq, xd, bsums, out)


@njit
def row_product(code, parallel, raw, x, out):  # pragma: no cover - compiled
    """out [1, n_out] = one activation row x [1, n_in] (f32, C-contiguous) times the K-quant
    matrix whose GGUF block rows are ``raw``, in the one-row arithmetic ``code``
    (KQuantMatrix.row_code: vec_dot, or gemv when repacked), as KQuantMatrix.matmul computes it
    for one row: x rounded by quantize_row_q8_K, then the weight rows one at a time. The
    callable piece of the fused decode step (exact_decode)."""
    q, d, bsums = _quantize_serial(x, 0)
    if parallel:
        _parallel(code, raw, q, d, bsums, out)
    else:
        _serial(code, raw, q, d, bsums, out)


# ---------------------------------------------------------------------------------------------
# Batch products in weight-row lanes
#
# For the batch arithmetics (tiled, repacked gemm) eight weight rows are unpacked once into a
# scratch copy laid out for vectors across the rows (``_make_unpack8``), and each activation row
# is then multiplied against all eight at once (``_make_wtile``): lane j of every vector is
# weight row r+j. One broadcast 4-byte load of the activation and one pmaddubsw give 4 products
# for each of the 8 rows; the int16 pair sums of a sub-block add up in int16 while no overflow
# is possible (``_RUN``), then one pmaddwd applies the 8 rows' sub-block scales. The exact
# integer per (row, super-block, group) ends up in a lane, with no horizontal sum, and the float
# steps are ggml's scalar ones, one lane per output. Each scratch block group (GS bytes, 8 rows,
# one super-block) holds: the 256 unsigned quants as 64 quads of [row][4 bytes], then per
# sub-block the int16 scale of each row twice (pmaddwd's multiplier), then the pair vectors
# (two neighbouring sub-blocks' mins or, for the biased types, scales, per row), then d_w and
# (types with mins) dmin as f32 per row.

_PER16 = {T.Q2_K, T.Q3_K, T.Q6_K}  # a scale per 16 values
# unsigned weight quants are stored with a bias of (B: 32 for Q6_K, 4 for Q3_K), corrected
# exactly through the activation's bsums: Σ s·(u - B)·x = Σ s·u·x - B·Σ s·bsum16
_BIAS_SHIFT = {T.Q6_K: 5, T.Q3_K: 2}
# quads whose pmaddubsw pair sums may add in int16: n·2·u_max·128 < 32768 (u_max 15, 31, 63, 7, 3)
_RUN = {T.Q4_K: 8, T.Q5_K: 4, T.Q6_K: 2, T.Q3_K: 4, T.Q2_K: 4}
_WIDE_CODES = {_T2, _T3, _T4, _T5, _T6, _GM4}  # arithmetics computed by the weight-row lanes


def _wide_layout(qtype: T) -> tuple[int, int, int, int, int]:
    """(sub-blocks, pair vectors, offset of the pair vectors, offset of d_w, group stride GS)."""
    subs = 16 if qtype in _PER16 else 8
    pairs = 8 if qtype in _PER16 else 4  # per 16: Q6_K/Q3_K's bias, Q2_K's mins; per 32: the mins
    p_at = 2048 + 32 * subs
    d_at = p_at + 32 * pairs
    return subs, pairs, p_at, d_at, d_at + (64 if qtype in (T.Q2_K, T.Q4_K, T.Q5_K) else 32)


def _store(builder: ir.IRBuilder, base: ir.Value, offset: ir.Value, value: ir.Value) -> None:
    builder.store(
        value, builder.bitcast(builder.gep(base, [offset]), value.type.as_pointer()), align=1
    )


def _transpose8(builder: ir.IRBuilder, rows: list) -> list:
    """The 8x8 transpose of eight <8 x i32> (unpack 32, unpack 64, then the 128-bit halves)."""

    def shuffle(a: ir.Value, b: ir.Value, mask: list) -> ir.Value:
        return builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(_I32, 8), mask))

    lo32, hi32 = [0, 8, 1, 9, 4, 12, 5, 13], [2, 10, 3, 11, 6, 14, 7, 15]
    lo64, hi64 = [0, 1, 8, 9, 4, 5, 12, 13], [2, 3, 10, 11, 6, 7, 14, 15]
    t = []
    for i in range(0, 8, 2):
        t += [shuffle(rows[i], rows[i + 1], lo32), shuffle(rows[i], rows[i + 1], hi32)]
    # u[k] (k < 4): rows 0-3 of quads k and k+4; u[4 + k]: rows 4-7
    u = []
    for base in (0, 4):
        a, b = t[2 * base // 2], t[2 * base // 2 + 2]  # pairs (0,1)/(2,3) or (4,5)/(6,7): lows
        c, d = t[2 * base // 2 + 1], t[2 * base // 2 + 3]  # their highs
        u += [shuffle(a, b, lo64), shuffle(a, b, hi64), shuffle(c, d, lo64), shuffle(c, d, hi64)]
    low, high = [0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15]
    return [shuffle(u[k], u[4 + k], low) for k in range(4)] + [
        shuffle(u[k], u[4 + k], high) for k in range(4)
    ]


def _make_unpack8(qtype: T, dpbusd: bool = False):
    """unpack8(w, w_off, row_bytes, nb, dst): the nb blocks of the eight weight rows at byte
    w_off of w (rows row_bytes apart) into dst's block groups (see the section comment).
    ``dpbusd``: each row's sub-block scale as one int32 (vpmulld's multiplier) instead of the
    int16 scale twice."""
    unpack = _CHUNKS[qtype]
    block_bytes = _BLOCK_BYTES[qtype]
    subs, pairs, p_at, d_at, gs = _wide_layout(qtype)

    @intrinsic
    def unpack8(typingctx, w, w_off, row_bytes, nb, dst):
        sig = types.void(w, w_off, row_bytes, nb, dst)

        def codegen(context, builder, signature, args):
            aty = signature.args
            _, w_off, row_bytes, nblocks, _ = args
            wbase = _byte_ptr(context, builder, aty[0], args[0])
            dbase = _byte_ptr(context, builder, aty[4], args[4])
            ity = w_off.type

            def const(v: int) -> ir.Value:
                return ir.Constant(ity, v)

            def block_at(b: ir.Value, j: ir.Value) -> ir.Value:
                return builder.add(
                    builder.add(w_off, builder.mul(j, row_bytes)),
                    builder.mul(b, const(block_bytes)),
                )

            def words(chunk: ir.Value | tuple) -> ir.Value:
                if isinstance(chunk, tuple):  # Q3_K: q3l - q3h, stored + 4
                    chunk = builder.sub(builder.add(chunk[0], _bytes(4)), chunk[1])
                return builder.bitcast(chunk, _V8I32)

            with cgutils.for_range(builder, nblocks) as loop:
                b = loop.index
                # the quants: chunk c of the 8 rows (8 quads each) transposed to quads 8c..8c+7 of 8 rows
                rows = [unpack(builder, wbase, block_at(b, const(j))) for j in range(8)]
                for c in range(8):
                    for k, quad in enumerate(
                        _transpose8(builder, [words(chunks[c]) for chunks in rows])
                    ):
                        _store(
                            builder,
                            dbase,
                            builder.add(builder.mul(b, const(gs)), const(32 * (8 * c + k))),
                            quad,
                        )
            with (
                cgutils.for_range(builder, nblocks) as loop,
                cgutils.for_range(builder, const(8)) as rows,
            ):
                b, j = loop.index, rows.index
                group = builder.add(
                    builder.mul(b, const(gs)), builder.mul(j, const(4))
                )  # row j's lane
                blk = block_at(b, j)
                scales, mins16, d_w, dm_w = _block_scales(builder, qtype, wbase, blk)

                def lane(v: ir.Value, i: int) -> ir.Value:
                    return builder.extract_element(v, ir.Constant(_I32, i))

                for sub in range(subs):  # pmaddwd multipliers: the row's scale twice
                    at = builder.add(group, const(2048 + 32 * sub))
                    if dpbusd:
                        _store(builder, dbase, at, builder.sext(lane(scales, sub), _I32))
                        continue
                    _store(builder, dbase, at, lane(scales, sub))
                    _store(builder, dbase, builder.add(at, const(2)), lane(scales, sub))
                # pair vectors: biased types' scales, Q2_K's mins (per 16), Q4_K/Q5_K's (per 32)
                source = mins16 if qtype == T.Q2_K else scales
                first = 0 if qtype in _PER16 else 8  # Q4_K/Q5_K: the mins are lanes 8..15
                for p in range(pairs):
                    at = builder.add(group, const(p_at + 32 * p))
                    _store(builder, dbase, at, lane(source, first + 2 * p))
                    _store(
                        builder, dbase, builder.add(at, const(2)), lane(source, first + 2 * p + 1)
                    )
                _store(builder, dbase, builder.add(group, const(d_at)), d_w)
                if dm_w is not None:
                    _store(builder, dbase, builder.add(group, const(d_at + 32)), dm_w)
            return context.get_dummy_value()

        return sig, codegen

    return unpack8


def _fma8(builder: ir.IRBuilder, a: ir.Value, b: ir.Value, c: ir.Value) -> ir.Value:
    return _call(builder, "llvm.fma.v8f32", ir.VectorType(_F32, 8), [a, b, c])


def _make_wtile(code: int, rn: int, dpbusd: bool = False):
    """wtile(u, xq, x_off, n_in, xd, s_off, pr, p_off, p_stride, nb, out, o_off, n_out): the
    eight weight rows unpacked in u by rn activation rows, in arithmetic ``code``. Activation row
    j: its quants at x_off + j·n_in of xq, its block scales at s_off + j·nb of xd, its bsums
    pairs (int16 pairs as int32: per 16 values, or per 32 for Q4_K/Q5_K) from p_off +
    j·p_stride of pr; its 8 outputs to out.flat[o_off + j·n_out ...]."""
    qtype = _CODE_TYPE[code]
    subs, pairs, p_at, d_at, gs = _wide_layout(qtype)
    quads = 64 // subs  # quads per sub-block
    run = _RUN[qtype]
    v8f = ir.VectorType(_F32, 8)
    has_min = qtype in (T.Q2_K, T.Q4_K, T.Q5_K)

    @intrinsic
    def wtile(typingctx, u, xq, x_off, n_in, xd, s_off, pr, p_off, p_stride, nb, out, o_off, n_out):
        sig = types.void(u, xq, x_off, n_in, xd, s_off, pr, p_off, p_stride, nb, out, o_off, n_out)

        def codegen(context, builder, signature, args):
            aty = signature.args
            (_, _, x_off, n_in, _, s_off, _, p_off, p_stride, nblocks, _, o_off, n_out) = args
            ubase, xbase = (
                _byte_ptr(context, builder, aty[0], args[0]),
                _byte_ptr(context, builder, aty[1], args[1]),
            )
            xdp, prp, obase = (_data(context, builder, aty[i], args[i]) for i in (4, 6, 10))
            ity = x_off.type

            def const(v: int) -> ir.Value:
                return ir.Constant(ity, v)

            def madd(a: ir.Value, b: ir.Value) -> ir.Value:
                return _call(builder, "llvm.x86.avx2.pmadd.wd", _V8I32, [a, b])

            def total(values: list) -> ir.Value:
                out = values[0]
                for v in values[1:]:
                    out = builder.add(out, v)
                return out

            zero = ir.Constant(v8f, [0.0] * 8)
            acc = [cgutils.alloca_once_value(builder, zero) for _ in range(rn)]
            accm = [cgutils.alloca_once_value(builder, zero) for _ in range(rn)]
            ints = [
                cgutils.alloca_once_value(builder, ir.Constant(_V8I32, [0] * 8)) for _ in range(rn)
            ]

            def slice_sums(group: ir.Value, xo: list, index: ir.Value) -> list:
                """Per activation row, the 8 rows' exact Σ scale·u·x over slice ``index`` (64
                values, 16 quads): int16 runs of pmaddubsw pair sums, one pmaddwd per run."""
                at = builder.add(group, builder.mul(index, const(512)))  # 16 quads of 32 bytes
                sums = [[] for _ in range(rn)]
                for sub in range(subs // 4):
                    mult_at = builder.add(
                        builder.mul(index, const(32 * subs // 4)), const(2048 + 32 * sub)
                    )
                    if dpbusd:
                        # VNNI: the sub-block's quads by vpdpbusd (u8 weight · s8 activation,
                        # four products into an int32 lane), in two chains, then one vpmulld
                        # by the rows' int32 scales: the same exact integer
                        mult32 = _load(builder, ubase, builder.add(group, mult_at), _V8I32)
                        part = [[None, None] for _ in range(rn)]
                        for i, q in enumerate(range(sub * quads, (sub + 1) * quads)):
                            wq = _load(builder, ubase, builder.add(at, const(32 * q)), _V32I8)
                            for j in range(rn):
                                x_at = builder.add(
                                    builder.add(xo[j], builder.mul(index, const(64))), const(4 * q)
                                )
                                xv = builder.bitcast(
                                    _splat(builder, _load(builder, xbase, x_at, _I32), _V8I32),
                                    _V32I8,
                                )
                                prior = part[j][i % 2] or ir.Constant(_V8I32, [0] * 8)
                                part[j][i % 2] = _dpbusd(builder, prior, wq, xv)
                        for j in range(rn):
                            sums[j].append(
                                builder.mul(total([p for p in part[j] if p is not None]), mult32)
                            )
                        continue
                    mult = _load(builder, ubase, builder.add(group, mult_at), _V16I16)
                    for first in range(sub * quads, (sub + 1) * quads, run):
                        short = [[] for _ in range(rn)]
                        for q in range(first, first + run):
                            wq = _load(builder, ubase, builder.add(at, const(32 * q)), _V32I8)
                            for j in range(rn):
                                x_at = builder.add(
                                    builder.add(xo[j], builder.mul(index, const(64))), const(4 * q)
                                )
                                xv = builder.bitcast(
                                    _splat(builder, _load(builder, xbase, x_at, _I32), _V8I32),
                                    _V32I8,
                                )
                                short[j].append(
                                    _call(builder, "llvm.x86.avx2.pmadd.ub.sw", _V16I16, [wq, xv])
                                )
                        for j in range(rn):
                            sums[j].append(madd(total(short[j]), mult))
                return [total(s) for s in sums]

            with cgutils.for_range(builder, nblocks) as loop:
                b = loop.index
                group = builder.mul(b, const(gs))
                xo = [
                    builder.add(
                        builder.add(x_off, builder.mul(const(j), n_in)), builder.mul(b, const(QK_K))
                    )
                    for j in range(rn)
                ]
                d_x = [
                    _splat(
                        builder,
                        builder.load(
                            builder.gep(
                                xdp,
                                [
                                    builder.add(
                                        builder.add(s_off, builder.mul(const(j), nblocks)), b
                                    )
                                ],
                            )
                        ),
                        v8f,
                    )
                    for j in range(rn)
                ]
                d_w = _load(builder, ubase, builder.add(group, const(d_at)), v8f)
                dm_w = (
                    _load(builder, ubase, builder.add(group, const(d_at + 32)), v8f)
                    if has_min
                    else None
                )

                def pair_sum(j: int, p: int | ir.Value) -> ir.Value:
                    """pmaddwd of activation row j's bsums pair p by the rows' pair vector p."""
                    p = const(p) if isinstance(p, int) else p
                    at = builder.add(
                        builder.add(p_off, builder.mul(const(j), p_stride)),
                        builder.add(builder.mul(b, const(pairs)), p),
                    )
                    sums = builder.bitcast(
                        _splat(builder, builder.load(builder.gep(prp, [at])), _V8I32), _V16I16
                    )
                    vec_at = builder.add(group, builder.add(const(p_at), builder.mul(p, const(32))))
                    return madd(sums, _load(builder, ubase, vec_at, _V16I16))

                for j in range(rn):
                    builder.store(ir.Constant(_V8I32, [0] * 8), ints[j])
                scale = [builder.fmul(d_w, d) for d in d_x] if code == _GM4 else None
                mscale = [builder.fmul(dm_w, d) for d in d_x] if code == _GM4 else None
                with cgutils.for_range(
                    builder, const(4)
                ) as slices:  # the block's 4 slices of 64 values
                    sums = slice_sums(group, xo, slices.index)
                    for j in range(rn):
                        if code == _GM4:  # one fma pair per 64 values
                            s_g = builder.sitofp(sums[j], v8f)
                            builder.store(
                                _fma8(builder, s_g, scale[j], builder.load(acc[j])), acc[j]
                            )
                            m_g = builder.sitofp(pair_sum(j, slices.index), v8f)
                            builder.store(
                                _fma8(builder, m_g, mscale[j], builder.load(accm[j])), accm[j]
                            )
                        else:
                            builder.store(builder.add(builder.load(ints[j]), sums[j]), ints[j])
                for j in range(
                    rn if code != _GM4 else 0
                ):  # tiled: res = d_w·s1 (- dmin·s2), fma(res, d_x, out)
                    s1 = builder.load(ints[j])
                    if qtype in _BIAS_SHIFT:  # s1 -= bias·Σ scale·bsum16
                        corr = total([pair_sum(j, p) for p in range(pairs)])
                        s1 = builder.sub(
                            s1, builder.shl(corr, ir.Constant(_V8I32, [_BIAS_SHIFT[qtype]] * 8))
                        )
                    res = builder.fmul(d_w, builder.sitofp(s1, v8f))
                    if has_min:
                        s2 = builder.sitofp(total([pair_sum(j, p) for p in range(pairs)]), v8f)
                        res = _fma8(builder, builder.fneg(dm_w), s2, res)
                    builder.store(_fma8(builder, res, d_x[j], builder.load(acc[j])), acc[j])
            for j in range(rn):
                result = builder.load(acc[j])
                if code == _GM4:
                    result = builder.fsub(result, builder.load(accm[j]))
                at = builder.add(o_off, builder.mul(const(j), n_out))
                builder.store(
                    result, builder.bitcast(builder.gep(obase, [at]), v8f.as_pointer()), align=4
                )
            return context.get_dummy_value()

        return sig, codegen

    return wtile


# VNNI hosts: the batch tiles sum each sub-block by vpdpbusd and scale it by vpmulld
_UNPACK8 = {qtype: _make_unpack8(qtype, HOST_HAS_VNNI) for qtype in _PLAIN_CODES}
_unpack8_q2, _unpack8_q3, _unpack8_q4, _unpack8_q5, _unpack8_q6 = (
    _UNPACK8[q] for q in (T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K)
)
_WTILES = {
    code: _make_wtile(code, 4, HOST_HAS_VNNI) for code in _WIDE_CODES
}  # 4 activation rows (the rest: one-row dots)
_wtile_t2, _wtile_t3, _wtile_t4, _wtile_t5, _wtile_t6, _wtile_gm4 = (
    _WTILES[c] for c in (_T2, _T3, _T4, _T5, _T6, _GM4)
)


@njit
def _unpack8(code, raw, w_off, row_bytes, nb, dst):  # pragma: no cover - compiled
    if code == _T2:
        _unpack8_q2(raw, w_off, row_bytes, nb, dst)
    elif code == _T3:
        _unpack8_q3(raw, w_off, row_bytes, nb, dst)
    elif code == _T5:
        _unpack8_q5(raw, w_off, row_bytes, nb, dst)
    elif code == _T6:
        _unpack8_q6(raw, w_off, row_bytes, nb, dst)
    else:  # _T4, _GM4
        _unpack8_q4(raw, w_off, row_bytes, nb, dst)


@njit
def _wtile(
    code, u, xq, x_off, n, xd, s_off, pr, p_off, p_stride, nb, out, o_off, n_out
):  # pragma: no cover
    """Eight weight rows by four activation rows; the branches fold for a constant code."""
    if code == _T2:
        _wtile_t2(u, xq, x_off, n, xd, s_off, pr, p_off, p_stride, nb, out, o_off, n_out)
    elif code == _T3:
        _wtile_t3(u, xq, x_off, n, xd, s_off, pr, p_off, p_stride, nb, out, o_off, n_out)
    elif code == _T4:
        _wtile_t4(u, xq, x_off, n, xd, s_off, pr, p_off, p_stride, nb, out, o_off, n_out)
    elif code == _T5:
        _wtile_t5(u, xq, x_off, n, xd, s_off, pr, p_off, p_stride, nb, out, o_off, n_out)
    elif code == _T6:
        _wtile_t6(u, xq, x_off, n, xd, s_off, pr, p_off, p_stride, nb, out, o_off, n_out)
    else:
        _wtile_gm4(u, xq, x_off, n, xd, s_off, pr, p_off, p_stride, nb, out, o_off, n_out)


@njit
def _wide_rows(code, gs, raw, r0, r1, xq, xd, bsums, pr, out):  # pragma: no cover - compiled
    """out[:, r0:r1] in the arithmetic ``code``: eight weight rows at a time unpacked into a
    scratch copy (GS bytes per super-block), each against every activation row, four at a time;
    the r1 - r0 mod 8 last rows by the one-row dots (_rows)."""
    m, n = xq.shape
    nb = n // QK_K
    n_out = out.shape[1]
    row_bytes = raw.shape[1]
    p_stride = pr.shape[1]
    scratch = numpy.empty(nb * gs, numpy.uint8)
    r = r0
    while r + 8 <= r1:
        _unpack8(code, raw, r * row_bytes, row_bytes, nb, scratch)
        t = 0
        while t + 4 <= m:
            _wtile(
                code,
                scratch,
                xq,
                t * n,
                n,
                xd,
                t * nb,
                pr,
                t * p_stride,
                p_stride,
                nb,
                out,
                t * n_out + r,
                n_out,
            )
            t += 4
        while t < m:  # the m % 4 last activation rows: the one-row dots
            w, o = r * row_bytes, t * n_out + r
            _dot(code, 1, raw, w, row_bytes, 8, xq, t * n, n, xd, bsums, t * nb, nb, out, o, n_out)
            t += 1
        r += 8
    _rows(code, raw, r, r1, xq, xd, bsums, out)


@njit
def _wide_serial(code, gs, raw, xq, xd, bsums, pr, out):  # pragma: no cover - compiled
    _wide_rows(code, gs, raw, 0, raw.shape[0], xq, xd, bsums, pr, out)


@njit(parallel=True)
def _wide_parallel(code, gs, raw, xq, xd, bsums, pr, out):  # pragma: no cover - compiled
    n_out = raw.shape[0]
    for task in prange((n_out + ROWS_PER_TASK - 1) // ROWS_PER_TASK):
        r0 = task * ROWS_PER_TASK
        _wide_rows(code, gs, raw, r0, min(r0 + ROWS_PER_TASK, n_out), xq, xd, bsums, pr, out)


def _pair_sums(qtype: T, bsums: numpy.ndarray) -> numpy.ndarray:
    """The activation's bsums as int16 pairs in int32 words, as the weight-row lanes read them:
    per 16 values (the bsums themselves) or, for Q4_K/Q5_K, per 32 (|sum| <= 32·128 fits)."""
    if qtype not in _PER16:
        bsums = bsums[:, 0::2] + bsums[:, 1::2]
    return numpy.ascontiguousarray(bsums, numpy.int16).view(numpy.int32)


def _run(code: int, raw: numpy.ndarray, act: KActivation, rows: slice, out: numpy.ndarray) -> None:
    """out[rows] = the product of these activation rows in the arithmetic ``code``."""
    xq, xd, bs = act.q[rows], act.d[rows], act.bsums[rows]
    if xq.shape[0] == 0:
        return
    parallel = xq.shape[0] * raw.shape[0] * xq.shape[1] >= PARALLEL_MIN_MACS
    if code in _WIDE_CODES:
        qtype = _CODE_TYPE[code]
        gs = _wide_layout(qtype)[4]
        (_wide_parallel if parallel else _wide_serial)(
            code, gs, raw, xq, xd, bs, _pair_sums(qtype, bs), out[rows]
        )
        return
    (_parallel if parallel else _serial)(code, raw, xq, xd, bs, out[rows])


class KQuantMatrix(BlockRows):
    """A GGUF K-quant weight matrix [n_out, n_in] kept in its block bytes; ``matmul`` is
    llama-server's mul_mat (``repacked``: as after its CPU_REPACK buffer took the matrix, see
    ``repacked_by_llama_server``; the bytes stay in GGUF order here)."""

    def __init__(
        self, raw: numpy.ndarray, qtype: T | int, n_out: int, n_in: int, repacked: bool = False
    ):
        qtype = T(qtype)
        if not supported(qtype):
            raise ValueError(f"no exact K-quant kernel for {qtype.name}")
        if repacked and not repacked_by_llama_server(qtype, n_out):
            raise ValueError(f"llama-server does not repack {qtype.name} [{n_out}, {n_in}] on AVX2")
        if n_in % QK_K:
            raise ValueError(f"n_in={n_in} is not a multiple of {QK_K}")
        row_bytes = n_in // QK_K * _BLOCK_BYTES[qtype]
        data = numpy.ascontiguousarray(raw).view(numpy.uint8)
        if data.size != n_out * row_bytes:
            raise ValueError(
                f"{qtype.name} [{n_out}, {n_in}] needs {n_out * row_bytes} bytes, got {data.size}"
            )
        self.raw = data.reshape(n_out, row_bytes)
        self.qtype, self.n_out, self.n_in, self.repacked = qtype, n_out, n_in, repacked

    def row_code(self) -> int:
        """The arithmetic of a one-row product (``row_product``'s code): gemv when repacked
        (one row is left over from the 4-row groups), else vec_dot."""
        return _GV4 if self.repacked else _PLAIN_CODES[self.qtype][1]

    def arithmetic_order(self, groups: Sequence[int]) -> tuple[numpy.ndarray | None, int]:
        """For activation rows in ``groups`` (sizes, in order), each group a product of its
        own in llama-server (a sequence's micro-batch), the rows that take the batch arithmetic
        first, then the rest, as an order of row indices (None: as they are), and how many
        lead. In a group of m rows ggml takes, for a repacked matrix, gemm for the first
        m - m % 4 (rounded by the 4-row packing) and gemv for the others; else the tiled
        kernel for all of them where m >= 8 and vec_dot below."""
        batch, single, start = [numpy.arange(0)], [], 0
        for m in groups:
            k = m - m % 4 if self.repacked else (m if m >= TILED_MIN_ROWS else 0)
            batch.append(numpy.arange(start, start + k))
            single.append(numpy.arange(start + k, start + m))
            start += m
        order = numpy.concatenate(batch + single)
        n_batch = sum(len(b) for b in batch)
        return (None if bool((order == numpy.arange(start)).all()) else order), n_batch

    def quantize(self, x: numpy.ndarray, groups: Sequence[int] | None = None) -> KActivation:
        """The activation rounded as llama-server rounds it for this matrix, for rows in
        ``groups`` (sizes; default: one group of every row) that are each a product of its own."""
        m = numpy.atleast_2d(x).shape[0]
        groups = tuple(groups) if groups is not None else (m,) if m else ()
        if sum(groups) != m or any(n < 1 for n in groups):
            raise ValueError(f"row groups {groups} do not cover {m} rows")
        order, n_batch = self.arithmetic_order(groups)
        return KActivation(x, n_batch if self.repacked else 0, order, groups)

    def matmul(
        self, x: numpy.ndarray | KActivation, groups: Sequence[int] | None = None
    ) -> numpy.ndarray:
        """x [m, n_in] f32 (or its KActivation) -> [m, n_out] f32, bit-identical to ggml; with
        ``groups``, each group of rows as ggml multiplies it alone (see arithmetic_order), in
        one product: the batch arithmetic's rows of every group unpack the weights once."""
        act = x if isinstance(x, KActivation) else self.quantize(x, groups)
        m, n = act.q.shape
        if n != self.n_in:
            raise ValueError(f"activation width {n} != n_in {self.n_in}")
        # the groups give both rules' rows in the same order wherever their rounding agrees, so
        # the 4-row packing's count tells an activation rounded for the other rule
        _, n_batch = self.arithmetic_order(act.groups or (m,))
        if act.packed_rows != (n_batch if self.repacked else 0):
            rule = "a repacked" if act.packed_rows else "an unrepacked"
            raise ValueError(f"activation was rounded for {rule} matrix (use .quantize)")
        batch_code, row_code = (_GM4, _GV4) if self.repacked else _PLAIN_CODES[self.qtype]
        out = numpy.empty((m, self.n_out), numpy.float32)
        _run(batch_code, self.raw, act, slice(0, n_batch), out)
        _run(row_code, self.raw, act, slice(n_batch, m), out)
        if act.order is None:
            return out
        in_order = numpy.empty_like(out)
        in_order[act.order] = out
        return in_order


class KMatrixStack(MatrixStack):
    """K-quant matrices of different types or layouts over one input, used as one: ``matmul``
    gives their outputs side by side, rounding the activation once per rounding rule (plain, or
    4-row packed for repacked parts) rather than once per part."""

    def matmul(self, x: numpy.ndarray, groups: Sequence[int] | None = None) -> numpy.ndarray:
        x = numpy.atleast_2d(numpy.asarray(x, dtype=numpy.float32))
        rounded: dict[bool, KActivation] = {}
        outs = []
        for part in self.parts:
            if part.repacked not in rounded:
                rounded[part.repacked] = (
                    part.quantize(x) if groups is None else part.quantize(x, groups)
                )
            outs.append(part.matmul(rounded[part.repacked]))
        return numpy.concatenate(outs, axis=1)


KQuantMatrix.stack = KMatrixStack
