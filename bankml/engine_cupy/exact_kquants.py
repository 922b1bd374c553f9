"""K-quant matrix products (Q4_K, Q5_K, Q6_K) that round exactly as llama-server's AVX2 CPU backend.

ggml rounds the activation to q8_K blocks (256 values, an f32 scale, 16 sums of 16 quants) and
then takes one of four arithmetics, depending on the weight type, whether llama-server repacked
the matrix (CPU_REPACK buffer) and the number of activation rows ``m``:

- ``vec_dot`` (arch/x86/quants.c, ``ggml_vec_dot_q{4,5,6}_K_q8_K``, m < 8, not repacked): eight
  exact integer lanes per super-block (lane L = the products of elements 4L..4L+3 of every 32,
  each weighted by its sub-block scale), ``acc[L] = fma(d_x·d_w, lane, acc[L])``, then
  ``hsum_float_8``. Q6_K subtracts ``32·(bsums·scales)`` per lane (its quants are stored
  unsigned); Q4_K keeps a 4-lane min chain ``fma(-d_x·dmin, Σ m·bsum, acc_m)`` added at the end,
  Q5_K a scalar one (GCC fuses its ``summs += dmin * Σ`` into vfmadd231ss).
- ``tiled`` (tiled/tiled-kernel.cpp, m >= 8, not repacked, new in this build): one exact integer
  per super-block, ``res = d_w·s1`` (Q4_K, Q5_K: ``res = fma(-dmin, s2, res)``) and
  ``out = fma(res, d_x, out)``. llamafile's sgemm takes no K-quant.
- repacked Q4_K (arch/x86/repack.cpp, ``q4_K_8x8``, ``n_out % 8 == 0``): the activation rows in
  groups of four are rounded by ``ggml_quantize_mat_q8_K_4x8`` and go through ``gemm`` (one fma
  per 64 values: ``acc = fma(Σ, d_w·d_x, acc)``, ``accm = fma(Σm·bsum, dmin·d_x, accm)``,
  ``out = acc - accm``); the ``m % 4`` leftover rows are rounded by ``quantize_row_q8_K`` and go
  through ``gemv`` (the same with one fma per super-block).

Every integer sum is exact in any order, so only the float chains above need to be kept; the
weights stay in their GGUF block bytes and are unpacked one super-block at a time.
"""

from __future__ import annotations

import numpy
from gguf import GGMLQuantizationType as T
from llvmlite import ir
from numba import prange, types
from numba.extending import intrinsic

from bankml.engine_cupy.exact_matmul import HOST_HAS_AVX2, PARALLEL_MIN_MACS, _byte_ptr, _call, _load, _splat
from bankml.engine_cupy.jit import fma32, njit

__all__ = ["KQuantMatrix", "KActivation", "supported", "repacked_by_llama_server", "quantize_q8_K"]

QK_K = 256
_BLOCK_BYTES = {T.Q4_K: 144, T.Q5_K: 176, T.Q6_K: 210}
TILED_MIN_ROWS = 8  # ggml_tiled_min_batch: the tiled kernel takes batches of 8 rows or more
ROWS_PER_TASK = 16

# arithmetic codes
_VD6, _VD4, _T6, _T4, _GV4, _GM4, _VD5, _T5 = 0, 1, 2, 3, 4, 5, 6, 7

# weight type -> (tiled code, vec_dot code) for matrices llama-server does not repack
_PLAIN_CODES = {T.Q4_K: (_T4, _VD4), T.Q5_K: (_T5, _VD5), T.Q6_K: (_T6, _VD6)}

F16_TABLE = numpy.arange(65536, dtype=numpy.uint16).view(numpy.float16).astype(numpy.float32)


def supported(qtype: T | int) -> bool:
    """Whether KQuantMatrix reproduces ggml's product for this weight type on this host."""
    try:
        return HOST_HAS_AVX2 and T(qtype) in _BLOCK_BYTES
    except ValueError:
        return False


def repacked_by_llama_server(qtype: T | int, n_out: int, token_embd: bool = False) -> bool:
    """ggml_repack_get_optimal_repack_type on AVX2: Q4_K -> q4_K_8x8 when the row count is a
    multiple of 8; Q5_K and Q6_K are repacked only on ARM. The token embedding never is (its
    first use is GET_ROWS, which the repack buffer does not take)."""
    return T(qtype) == T.Q4_K and n_out % 8 == 0 and not token_embd


# ---------------------------------------------------------------------------------------------
# Activation rounding to q8_K


@njit
def _quantize_block(x, t, b, pos_wins, q, d, bsums):  # pragma: no cover - compiled
    """One 256-value block. ``quantize_row_q8_K_ref`` (the x86 build's from_float): the scale's
    sign is that of the first value of largest magnitude; ``ggml_quantize_mat_q8_K_4x8``
    (``pos_wins``): negative whenever +amax occurs. iscale = ∓127/amax, d = 1/iscale, quants
    rint(x·iscale) (the ref's 1.5·2^23 trick is SSE2 mul then add, no fma: the same)."""
    base = b * QK_K
    amax = numpy.float32(0.0)
    first = numpy.float32(0.0)
    has_pos = False
    for k in range(QK_K):
        v = x[t, base + k]
        a = abs(v)
        if a > amax:
            amax = a
            first = v
    if amax == numpy.float32(0.0):
        d[t, b] = numpy.float32(0.0)
        for k in range(QK_K):
            q[t, base + k] = 0
        for j in range(16):
            bsums[t, b * 16 + j] = 0
        return
    if pos_wins:
        for k in range(QK_K):
            if x[t, base + k] == amax:
                has_pos = True
        iscale = numpy.float32(-127.0) / amax if has_pos else numpy.float32(127.0) / amax
    else:
        iscale = numpy.float32(-127.0) / first
    for j in range(16):
        total = 0
        for k in range(16):
            v = numpy.int32(numpy.rint(iscale * x[t, base + 16 * j + k]))
            v = min(v, 127)
            q[t, base + 16 * j + k] = v
            total += v
        bsums[t, b * 16 + j] = total
    d[t, b] = numpy.float32(1.0) / iscale


@njit
def _quantize(x, groups_of_four):  # pragma: no cover - compiled
    """Rows [0, groups_of_four) by the 4x8 packing rule, the rest by quantize_row_q8_K."""
    m, n = x.shape
    nb = n // QK_K
    q = numpy.empty((m, n), numpy.int8)
    d = numpy.empty((m, nb), numpy.float32)
    bsums = numpy.empty((m, nb * 16), numpy.int32)
    for t in range(m):
        for b in range(nb):
            _quantize_block(x, t, b, t < groups_of_four, q, d, bsums)
    return q, d, bsums


class KActivation:
    """Activation rows rounded to q8_K: int8 quants, f32 block scales, the 16 sums per block.
    ``packed_rows``: how many leading rows llama-server rounds with its 4-row packing (repacked
    Q4_K: m - m % 4), which picks the scale's sign differently when both ±amax occur."""

    def __init__(self, x: numpy.ndarray, packed_rows: int = 0):
        x = numpy.ascontiguousarray(numpy.atleast_2d(x), dtype=numpy.float32)
        if x.ndim != 2 or x.shape[1] % QK_K:
            raise ValueError(f"activation must be [m, k] with k a multiple of {QK_K}, got {x.shape}")
        self.packed_rows = packed_rows
        self.q, self.d, self.bsums = _quantize(x, packed_rows)

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
# The integer core: one weight super-block against one activation block, as LLVM IR (AVX2)
#
# Numba's own loops ran at about 1 GMAC/s; the core is therefore emitted with the instructions
# ggml uses: the unsigned quants unpacked from the block bytes (and/shift/or on byte vectors),
# pmaddubsw against the int8 activation (no saturation: q <= 63), pmaddwd by the sub-block
# scales. Its result is exact, so any grouping of the sums that ggml's differs from is harmless.

_I8, _I16, _I32 = ir.IntType(8), ir.IntType(16), ir.IntType(32)
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
        for c, low in ((2 * g, builder.and_(raw, _bytes(15))), (2 * g + 1, builder.lshr(raw, _bytes(4)))):
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
        highs = [builder.shl(builder.and_(builder.lshr(h, _bytes(s)), _bytes(3)), _bytes(4)) for s in (0, 2, 4, 6)]
        lows = [builder.and_(b1, _bytes(15)), builder.and_(b2, _bytes(15)),
                builder.lshr(b1, _bytes(4)), builder.lshr(b2, _bytes(4))]
        chunks += [builder.or_(lo, hi) for lo, hi in zip(lows, highs)]
    return chunks


def _make_core(unpack):
    """core(w, w_off, xq, x_off, scl, out): out[8g + L] (int32, g = 64-value group, L = lane)
    = Σ over the two 32-value chunks of group g of scale(e)·q(e)·x(e) for the elements
    e = 4L..4L+3 of the chunk; q unsigned (Q6_K's -32 is applied by the caller through the
    bsums, as ggml's vec_dot does), scale(e) = scl[e // 16] (int16)."""

    @intrinsic
    def core(typingctx, w, w_off, xq, x_off, scl, out):
        sig = types.void(w, w_off, xq, x_off, scl, out)

        def codegen(context, builder, signature, args):
            aty = signature.args
            wbase = _byte_ptr(context, builder, aty[0], args[0])
            xbase = _byte_ptr(context, builder, aty[2], args[2])
            sbase = builder.bitcast(context.make_array(aty[4])(context, builder, args[4]).data, _I16.as_pointer())
            obase = builder.bitcast(context.make_array(aty[5])(context, builder, args[5]).data, _V8I32.as_pointer())
            w_off, x_off = args[1], args[3]
            chunks = unpack(builder, wbase, w_off)
            for g in range(4):
                total = None
                for c in (2 * g, 2 * g + 1):
                    x = _load(builder, xbase, builder.add(x_off, ir.Constant(x_off.type, 32 * c)), _V32I8)
                    pairs = _call(builder, "llvm.x86.avx2.pmadd.ub.sw", _V16I16, [chunks[c], x])
                    lo = builder.load(builder.gep(sbase, [ir.Constant(_I32, 2 * c)]))
                    hi = builder.load(builder.gep(sbase, [ir.Constant(_I32, 2 * c + 1)]))
                    scale = builder.shuffle_vector(_splat(builder, lo, ir.VectorType(_I16, 8)),
                                                   _splat(builder, hi, ir.VectorType(_I16, 8)),
                                                   ir.Constant(ir.VectorType(_I32, 16), list(range(16))))
                    quads = _call(builder, "llvm.x86.avx2.pmadd.wd", _V8I32, [pairs, scale])
                    total = quads if total is None else builder.add(total, quads)
                builder.store(total, builder.gep(obase, [ir.Constant(_I32, g)]), align=4)
            return context.get_dummy_value()

        return sig, codegen

    return core


_core_q4_k = _make_core(_q4_k_chunks)
_core_q5_k = _make_core(_q5_k_chunks)
_core_q6_k = _make_core(_q6_k_chunks)


@njit
def _half_bits(raw, r, o):  # pragma: no cover - compiled
    return numpy.uint16(raw[r, o]) | (numpy.uint16(raw[r, o + 1]) << numpy.uint16(8))


@njit
def _scales_q6_k(raw, r, b, scl):  # pragma: no cover - compiled
    """block_q6_K's 16 int8 scales (at +192) into scl; returns d (f16 bits, at +208)."""
    o = b * 210
    for s in range(16):
        scl[s] = numpy.int16(numpy.int8(raw[r, o + 192 + s]))
    return _half_bits(raw, r, o + 208)


@njit
def _scales_q4_k(raw, r, b, block_bytes, scl, mn):  # pragma: no cover - compiled
    """block_q4_K's (and block_q5_K's: same head) 6-bit scales and mins (get_scale_min_k4):
    scale s covers values 32s..32s+31, so scl (per 16 values) holds each twice. Returns (d, dmin)
    as f16 bits."""
    o = b * block_bytes
    for j in range(8):
        if j < 4:
            s = numpy.int16(raw[r, o + 4 + j] & 63)
            mn[j] = numpy.int32(raw[r, o + 8 + j] & 63)
        else:
            s = numpy.int16((raw[r, o + 8 + j] & 15) | ((raw[r, o + j] >> 6) << 4))
            mn[j] = numpy.int32((raw[r, o + 8 + j] >> 4) | ((raw[r, o + 4 + j] >> 6) << 4))
        scl[2 * j] = s
        scl[2 * j + 1] = s
    return _half_bits(raw, r, o), _half_bits(raw, r, o + 2)


@njit
def _hsum8(a):  # pragma: no cover - compiled
    """hsum_float_8: ((a0+a4)+(a2+a6)) + ((a1+a5)+(a3+a7))."""
    return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]))


@njit
def _row(code, raw, r, xq, xd, bsums, table, out):  # pragma: no cover - compiled
    """out[:, r] for weight row r against every activation row, in the arithmetic ``code``."""
    m, n = xq.shape
    nb = n // QK_K
    row_bytes = raw.shape[1]
    six = code == _VD6 or code == _T6
    five = code == _VD5 or code == _T5
    block_bytes = 210 if six else 176 if five else 144
    scl = numpy.empty(16, numpy.int16)
    mn = numpy.zeros(8, numpy.int32)
    part = numpy.empty(32, numpy.int32)
    acc = numpy.zeros((m, 8), numpy.float32)
    accm = numpy.zeros((m, 4), numpy.float32)
    for b in range(nb):
        if six:
            d_w = table[_scales_q6_k(raw, r, b, scl)]
            dmin_w = numpy.float32(0.0)
        else:
            h, hm = _scales_q4_k(raw, r, b, block_bytes, scl, mn)
            d_w, dmin_w = table[h], table[hm]
        w_off = r * row_bytes + b * block_bytes
        for t in range(m):
            x_off = t * n + b * QK_K
            if six:
                _core_q6_k(raw, w_off, xq, x_off, scl, part)
            elif five:
                _core_q5_k(raw, w_off, xq, x_off, scl, part)
            else:
                _core_q4_k(raw, w_off, xq, x_off, scl, part)
            d_x = xd[t, b]
            bs = b * 16
            if code == _VD6 or code == _VD4 or code == _VD5:
                d = d_x * d_w
                for lane in range(8):
                    s = part[lane] + part[8 + lane] + part[16 + lane] + part[24 + lane]
                    if six:  # the -32 of Q6_K's quants, per lane as ggml's q8sclsub
                        s -= 32 * (bsums[t, bs + 2 * lane] * numpy.int32(scl[2 * lane])
                                   + bsums[t, bs + 2 * lane + 1] * numpy.int32(scl[2 * lane + 1]))
                    acc[t, lane] = fma32(d, numpy.float32(s), acc[t, lane])
                if code == _VD5:  # one scalar min chain: summs = fma(-d_x·dmin, Σ m·bsums, summs)
                    p = 0
                    for j in range(16):
                        p += mn[j >> 1] * bsums[t, bs + j]
                    accm[t, 0] = fma32(-d_x * dmin_w, numpy.float32(p), accm[t, 0])
                elif not six:
                    dmn = -d_x * dmin_w
                    for i in range(4):
                        q8s0 = bsums[t, bs + 4 * i] + bsums[t, bs + 4 * i + 1]
                        q8s1 = bsums[t, bs + 4 * i + 2] + bsums[t, bs + 4 * i + 3]
                        p = mn[2 * i] * q8s0 + mn[2 * i + 1] * q8s1
                        accm[t, i] = fma32(dmn, numpy.float32(p), accm[t, i])
                continue
            # the other arithmetics need only group totals and the mins' sums
            if code == _GM4:
                scale, mscale = d_w * d_x, dmin_w * d_x
                for g in range(4):
                    s = 0
                    for lane in range(8):
                        s += part[8 * g + lane]
                    gmin = (mn[2 * g] * (bsums[t, bs + 4 * g] + bsums[t, bs + 4 * g + 1])
                            + mn[2 * g + 1] * (bsums[t, bs + 4 * g + 2] + bsums[t, bs + 4 * g + 3]))
                    acc[t, 0] = fma32(numpy.float32(s), scale, acc[t, 0])
                    accm[t, 0] = fma32(numpy.float32(gmin), mscale, accm[t, 0])
                continue
            s1 = 0
            for i in range(32):
                s1 += part[i]
            s2 = 0
            for j in range(16):
                if six:  # Q6_K's -32 again, for the block total
                    s1 -= 32 * numpy.int32(scl[j]) * bsums[t, bs + j]
                else:
                    s2 += mn[j >> 1] * bsums[t, bs + j]
            if code == _GV4:
                acc[t, 0] = fma32(numpy.float32(s1), d_w * d_x, acc[t, 0])
                accm[t, 0] = fma32(numpy.float32(s2), dmin_w * d_x, accm[t, 0])
            else:  # tiled: res = d_w·s1 (- dmin·s2 fused), out = fma(res, d_x, out)
                res = d_w * numpy.float32(s1)
                if code == _T4 or code == _T5:
                    res = fma32(-dmin_w, numpy.float32(s2), res)
                acc[t, 0] = fma32(res, d_x, acc[t, 0])
    for t in range(m):
        if code == _VD6:
            out[t, r] = _hsum8(acc[t])
        elif code == _VD4:
            out[t, r] = _hsum8(acc[t]) + ((accm[t, 0] + accm[t, 2]) + (accm[t, 1] + accm[t, 3]))
        elif code == _VD5:
            out[t, r] = _hsum8(acc[t]) + accm[t, 0]
        elif code == _GV4 or code == _GM4:
            out[t, r] = acc[t, 0] - accm[t, 0]
        else:
            out[t, r] = acc[t, 0]


@njit
def _serial(code, raw, xq, xd, bsums, table, out):  # pragma: no cover - compiled
    for r in range(raw.shape[0]):
        _row(code, raw, r, xq, xd, bsums, table, out)


@njit(parallel=True)
def _parallel(code, raw, xq, xd, bsums, table, out):  # pragma: no cover - compiled
    n_out = raw.shape[0]
    for task in prange((n_out + ROWS_PER_TASK - 1) // ROWS_PER_TASK):
        for r in range(task * ROWS_PER_TASK, min(task * ROWS_PER_TASK + ROWS_PER_TASK, n_out)):
            _row(code, raw, r, xq, xd, bsums, table, out)


def _run(code: int, raw: numpy.ndarray, act: KActivation, rows: slice, out: numpy.ndarray) -> None:
    xq, xd, bs = act.q[rows], act.d[rows], act.bsums[rows]
    if xq.shape[0] == 0:
        return
    part = numpy.empty((xq.shape[0], out.shape[1]), numpy.float32)
    macs = xq.shape[0] * raw.shape[0] * xq.shape[1]
    (_parallel if macs >= PARALLEL_MIN_MACS else _serial)(code, raw, xq, xd, bs, F16_TABLE, part)
    out[rows] = part


class KQuantMatrix:
    """A GGUF K-quant weight matrix [n_out, n_in] kept in its block bytes; ``matmul`` is
    llama-server's mul_mat (``repacked``: as after its CPU_REPACK buffer took the matrix, see
    ``repacked_by_llama_server``; the bytes stay in GGUF order here)."""

    def __init__(self, raw: numpy.ndarray, qtype: T | int, n_out: int, n_in: int, repacked: bool = False):
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
            raise ValueError(f"{qtype.name} [{n_out}, {n_in}] needs {n_out * row_bytes} bytes, got {data.size}")
        self.raw = data.reshape(n_out, row_bytes)
        self.qtype, self.n_out, self.n_in, self.repacked = qtype, n_out, n_in, repacked

    @classmethod
    def concat(cls, parts: list["KQuantMatrix"]) -> "KQuantMatrix":
        """Rows of same-type, same-layout matrices of one input width stacked (Q/K/V, gate/up).
        Stacking repacked matrices keeps every row count a multiple of 8, so they stay repacked."""
        first = parts[0]
        if any((p.qtype, p.n_in, p.repacked) != (first.qtype, first.n_in, first.repacked) for p in parts):
            raise ValueError("concatenated K-quant matrices must share type, input width and layout")
        raw = numpy.concatenate([p.raw for p in parts])
        return cls(raw, first.qtype, raw.shape[0], first.n_in, first.repacked)

    def quantize(self, x: numpy.ndarray) -> KActivation:
        """The activation rounded as llama-server rounds it for this matrix."""
        m = numpy.atleast_2d(x).shape[0]
        return KActivation(x, m - m % 4 if self.repacked else 0)

    def matmul(self, x: numpy.ndarray | KActivation) -> numpy.ndarray:
        """x [m, n_in] f32 (or its KActivation) -> [m, n_out] f32, bit-identical to ggml."""
        act = x if isinstance(x, KActivation) else self.quantize(x)
        m, n = act.q.shape
        if n != self.n_in:
            raise ValueError(f"activation width {n} != n_in {self.n_in}")
        out = numpy.empty((m, self.n_out), numpy.float32)
        if self.repacked:
            packed = m - m % 4
            if act.packed_rows != packed:
                raise ValueError("activation was not rounded for a repacked matrix (use .quantize)")
            _run(_GM4, self.raw, act, slice(0, packed), out)
            _run(_GV4, self.raw, act, slice(packed, m), out)
            return out
        if act.packed_rows:
            raise ValueError("activation was rounded for a repacked matrix")
        tiled, vec_dot = _PLAIN_CODES[self.qtype]
        _run(tiled if m >= TILED_MIN_ROWS else vec_dot, self.raw, act, slice(0, m), out)
        return out
