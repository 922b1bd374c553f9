"""Matrix products that round exactly as ggml's AVX2 CPU kernels in llama-server.

ggml multiplies a quantized weight by an f32 activation in two steps (ggml-cpu.c,
``ggml_compute_forward_mul_mat``): the activation rows are rounded to the weight type's
``vec_dot_type`` (q8_0 or q8_1 blocks of 32, ``quantize_row_q8_0/q8_1``, arch/x86/quants.c), then
every output element is one block-by-block dot product. With one activation row that dot product
is ``ggml_vec_dot_<w>_<x>``; with two or more, Q8_0/Q4_0/Q5_0 go through llamafile's
``tinyBLAS_Q0_AVX`` (sgemm.cpp), whose per-element arithmetic is the same. Both compute, per
block ``b``, eight exact integer lanes (lane ``j`` = the products of elements 4j..4j+3, from
``maddubs`` + ``madd``), then ``acc[j] = fma(d_w·d_x, lane_j, acc[j])`` in float32 over the
blocks in order, and finally ``hsum_float_8``: ((a0+a4)+(a2+a6)) + ((a1+a5)+(a3+a7)). Q4_1 and
Q5_1 add ``summs``, a scalar ``fma(m_w, s_x, summs)`` chain over the blocks (GCC contracts the
C ``summs += m*s`` into vfmadd231ss: checked in the build's object code), after the sum.

Batches of 16 rows or more go through lane tiles (``_make_lane_tile``; ``_make_zmm_lane_tile``
on AVX512-VNNI hosts), which vectorise over activation rows instead of over ggml's eight lanes:
each output is still the same sequence of float operations, ~40 % faster.

Two other arithmetics: llama-server repacks Q4_0 layer matrices (CPU_REPACK buffer, q4_0_8x8
kernels: one integer sum per block, a scalar fma chain, no horizontal sum), and F16/F32/BF16
weights use f32 fma chains whose accumulator layout depends on the path (vec_dot or tinyBLAS);
BF16 rows may have any length (ggml's tails are reproduced), the others are multiples of 32.

The weights stay in their GGUF block bytes (read straight from the memory-mapped file). Numba
does not vectorise the lane-wise fma chains by itself, so each dot product is LLVM IR emitted
through ``numba.extending.intrinsic`` with the very AVX2 operations ggml uses (psign, pmaddubsw,
pmaddwd, cvtdq2ps, vfmadd, vcvtph2ps for the f16 scales); hence ``supported`` is False on a
host without AVX2/FMA/F16C. Tiles of 4x1 (decode) or 1x8, 1x4, 2x2 (batches) outputs share the
unpacked blocks and keep several independent fma chains in flight; the products are parallel
over tasks of 16 output rows (Numba prange), which changes no element's arithmetic.
"""

from __future__ import annotations

import functools

import numba  # noqa: E402
import numpy  # noqa: E402
from gguf import GGMLQuantizationType as T  # noqa: E402
from llvmlite import binding as llvm_binding  # noqa: E402
from llvmlite import ir  # noqa: E402
from numba import prange, types  # noqa: E402
from numba.core import cgutils  # noqa: E402
from numba.extending import intrinsic, overload  # noqa: E402

from bankml.engine_cupy.kernels.jit import (  # noqa: E402
    every_type_compiled,
    f16_bits,
    f16_round,
    njit,
    present_in,
)

__all__ = [
    "BlockRows",
    "QuantMatrix",
    "MatrixStack",
    "Activation",
    "supported",
    "repacked_by_llama_server",
    "quantize_q8_0",
    "quantize_q8_1",
    "f32_to_f16_bits",
    "bf16_round",
    "row_product",
    "code_set",
]

QK = 32  # elements per block for every type handled here
ROWS_PER_TASK = 16  # output rows per parallel task; its weight rows stay in L1 across the batch
LANE_ROWS = 16  # activation rows of a lane tile (batch products): two groups of 8, one per vector

# f16 bit pattern -> f32 value (exact): the activation's block scales as the kernels read them
F16_TABLE = numpy.arange(65536, dtype=numpy.uint16).view(numpy.float16).astype(numpy.float32)

# kernel codes for the weight types
_Q4_0, _Q4_1, _Q5_0, _Q5_1, _Q8_0, _Q4_0R = 0, 1, 2, 3, 4, 5  # _Q4_0R: repacked Q4_0
_F16, _F32_CODE, _BF16 = 6, 7, 8
N_CODES = 9
_QUANT_CODES = frozenset(range(_F16))
_FLOAT_CODES = frozenset((_F16, _F32_CODE, _BF16))
# weight type -> (kernel code, bytes per block, activation is q8_1)
_LAYOUT: dict[T, tuple[int, int, bool]] = {
    T.Q4_0: (_Q4_0, 18, False),
    T.Q5_0: (_Q5_0, 22, False),
    T.Q8_0: (_Q8_0, 34, False),
    T.Q4_1: (_Q4_1, 20, True),
    T.Q5_1: (_Q5_1, 24, True),
    T.F16: (_F16, 64, False),
    T.F32: (_F32_CODE, 128, False),
    T.BF16: (_BF16, 64, False),  # bytes per 32 values
}
_FLOAT_TYPES = {T.F16, T.F32, T.BF16}
_ANY_WIDTH = {
    T.BF16
}  # rows of any length (the kernels take ggml's tails), not only multiples of 32


# ggml-cpu/repack.cpp (ggml_repack_get_optimal_repack_type) on an AVX2 build: Q4_0 -> q4_0_8x8
# when the row count is a multiple of 8 (IQ4_NL and Q4_K too, which are not handled here)
REPACKED_TYPES = {T.Q4_0}


def repacked_by_llama_server(qtype: T | int, n_out: int, token_embd: bool = False) -> bool:
    """Whether llama-server's CPU backend (GGML_CPU_REPACK=ON, AVX2) repacks this matrix, which
    changes its product's rounding. The token embedding table never is: its first use is
    GET_ROWS, which the repack buffer does not take, so a tied output keeps the plain kernels."""
    return T(qtype) in REPACKED_TYPES and n_out % 8 == 0 and not token_embd


def _host_has_avx2() -> bool:
    """The kernels are AVX2+FMA+F16C code: the host Numba compiles for must have them."""
    if numba.config.CPU_NAME not in (None, "host"):
        return False  # a generic/portable Numba target cannot take the x86 intrinsics
    features = llvm_binding.get_host_cpu_features()
    return all(features.get(f, False) for f in ("avx2", "fma", "f16c"))


HOST_HAS_AVX2 = _host_has_avx2()


def _host_has_vnni() -> bool:
    """Whether the batch lane tiles may take vpdpbusd (AVX512-VNNI on 256-bit vectors, or
    AVX-VNNI): four u8·s8 products summed into an int32 lane in one instruction, the very
    integer ggml's pmaddubsw + pmaddwd pair gives for a lane (which cannot saturate in ggml's
    quant ranges: exact either way). Only for Numba's own host target."""
    if not HOST_HAS_AVX2 or numba.config.CPU_FEATURES is not None:
        return False
    features = llvm_binding.get_host_cpu_features()
    return bool(
        features.get("avxvnni", False)
        or (features.get("avx512vnni", False) and features.get("avx512vl", False))
    )


HOST_HAS_VNNI = _host_has_vnni()


def _host_has_avx512vl() -> bool:
    """Whether LLVM may use 32 vector registers for 256-bit vectors (AVX512VL): the batch lane
    tiles then keep all eight of ggml's lanes of 16 rows in registers in one pass."""
    if not HOST_HAS_AVX2 or numba.config.CPU_FEATURES is not None:
        return False
    return bool(llvm_binding.get_host_cpu_features().get("avx512vl", False))


HOST_HAS_AVX512VL = _host_has_avx512vl()


def _host_has_zmm_vnni() -> bool:
    """Whether the lane tiles may use 512-bit vectors with vpdpbusd (AVX512F/BW/VNNI): 16
    activation rows in one vector."""
    if not HOST_HAS_VNNI:
        return False
    features = llvm_binding.get_host_cpu_features()
    return all(features.get(f, False) for f in ("avx512f", "avx512bw", "avx512vnni"))


HOST_HAS_ZMM_VNNI = _host_has_zmm_vnni()
# rows side by side in Activation.lanes: 16 where a lane tile is one 512-bit vector, else 8
LANE_GROUP = 16 if HOST_HAS_ZMM_VNNI else 8


def code_set(codes: object) -> tuple[bool | None, ...]:
    """The kernel codes a compiled product may meet (an iterable of them), as a tuple whose
    Numba *type* tells them apart: True at each code present, None elsewhere. The products
    take it first and type only those codes' branches (``_by_code``), so a matrix or a model
    compiles the kernels of its own weight types, not all nine (one specialization per set,
    cached); all nine with ``BANKML_KERNEL_TYPES=all`` (jit.every_type_compiled)."""
    present = set(range(N_CODES)) if every_type_compiled() else set(codes)  # type: ignore[call-overload]
    return tuple(True if code in present else None for code in range(N_CODES))


def supported(qtype: T | int) -> bool:
    """Whether QuantMatrix reproduces ggml's product for this weight type on this host."""
    try:
        return HOST_HAS_AVX2 and T(qtype) in _LAYOUT
    except ValueError:
        return False


# ---------------------------------------------------------------------------------------------
# Activation rounding: ggml's AVX2 quantize_row_q8_0 / quantize_row_q8_1


@njit
def f32_to_f16_bits(f):  # pragma: no cover - compiled
    """float32 -> IEEE half bits, round to nearest even (F16C's _cvtss_sh(x, 0))."""
    return numpy.uint16(f16_bits(numpy.float32(f)))


@intrinsic
def _quantize_block(typingctx, x, off, q, d16, s16, soff):
    """One block of 32 as the AVX2 quantize_row_q8_0/q8_1, in 8-lane vectors: x.flat[off:off+32]
    -> q.flat[off:off+32] (int8), d16.flat[soff] = f16(amax/127) and s16.flat[soff] =
    f16(d·Σq). amax by the same max_ps tree, 127/amax, round_ps to nearest even, cvtps2dq, the
    integer sum before the saturating pack; a scalar loop was half of the rounding's time."""
    sig = types.void(x, off, q, d16, s16, soff)

    def codegen(context, builder, signature, args):
        aty = signature.args
        xarr, off, qarr, darr, sarr, soff = args
        xdata = _data(context, builder, aty[0], xarr)
        qdata = _data(context, builder, aty[2], qarr)
        v4f = ir.VectorType(_F32, 4)

        def lane_vector(k: int) -> ir.Value:
            at = builder.gep(xdata, [builder.add(off, ir.Constant(off.type, 8 * k))])
            return builder.load(builder.bitcast(at, _V8F.as_pointer()), align=4)

        def vmax(name: str, ty: ir.Type, a: ir.Value, b: ir.Value) -> ir.Value:
            return _call(builder, name, ty, [a, b])

        v = [lane_vector(k) for k in range(4)]
        mask = ir.Constant(_V8I32, [0x7FFFFFFF] * 8)  # andnot(-0.0, v): |v|
        a = [builder.bitcast(builder.and_(builder.bitcast(x, _V8I32), mask), _V8F) for x in v]
        m8 = vmax(
            "llvm.x86.avx.max.ps.256",
            _V8F,
            vmax("llvm.x86.avx.max.ps.256", _V8F, a[0], a[1]),
            vmax("llvm.x86.avx.max.ps.256", _V8F, a[2], a[3]),
        )
        hi = builder.shuffle_vector(m8, m8, ir.Constant(ir.VectorType(_I32, 4), [4, 5, 6, 7]))
        lo = builder.shuffle_vector(m8, m8, ir.Constant(ir.VectorType(_I32, 4), [0, 1, 2, 3]))
        m4 = vmax("llvm.x86.sse.max.ps", v4f, hi, lo)
        m4 = vmax(
            "llvm.x86.sse.max.ps",
            v4f,
            m4,
            builder.shuffle_vector(m4, m4, ir.Constant(ir.VectorType(_I32, 4), [2, 3, 2, 3])),
        )
        m4 = vmax(
            "llvm.x86.sse.max.ss",
            v4f,
            m4,
            builder.shuffle_vector(m4, m4, ir.Constant(ir.VectorType(_I32, 4), [1, 1, 3, 3])),
        )
        amax = builder.extract_element(m4, ir.Constant(_I32, 0))
        d = builder.fdiv(amax, ir.Constant(_F32, 127.0))
        nonzero = builder.fcmp_unordered("!=", amax, ir.Constant(_F32, 0.0))
        inv = builder.select(
            nonzero, builder.fdiv(ir.Constant(_F32, 127.0), amax), ir.Constant(_F32, 0.0)
        )
        mul = _splat(builder, inv, _V8F)
        total = ir.Constant(_V8I32, [0] * 8)
        for k in range(4):
            r = _call(
                builder,
                "llvm.x86.avx.round.ps.256",
                _V8F,
                [builder.fmul(v[k], mul), ir.Constant(_I32, 0)],
            )
            i = _call(builder, "llvm.x86.avx.cvt.ps2dq.256", _V8I32, [r])
            total = builder.add(total, i)
            lo8 = ir.Constant(_V8I32, [-128] * 8)
            hi8 = ir.Constant(_V8I32, [127] * 8)
            clamped = builder.select(builder.icmp_signed("<", i, lo8), lo8, i)
            clamped = builder.select(builder.icmp_signed(">", clamped, hi8), hi8, clamped)
            at = builder.gep(qdata, [builder.add(off, ir.Constant(off.type, 8 * k))])
            builder.store(
                builder.trunc(clamped, ir.VectorType(_I8, 8)),
                builder.bitcast(at, ir.VectorType(_I8, 8).as_pointer()),
                align=1,
            )
        total = _call(builder, "llvm.vector.reduce.add.v8i32", _I32, [total])
        for arr, aidx, value in (
            (darr, 3, d),
            (sarr, 4, builder.fmul(d, builder.sitofp(total, _F32))),
        ):
            data = _data(context, builder, aty[aidx], arr)
            bits = builder.bitcast(builder.fptrunc(value, ir.HalfType()), _I16)
            builder.store(bits, builder.gep(data, [soff]))
        return context.get_dummy_value()

    return sig, codegen


@njit
def _quantize_serial(x, table):  # pragma: no cover - compiled
    """x [m, n] f32 -> (q int8 [m, n], d16, s16 f16 bits [m, n/32], d, s their f32 values)."""
    m, n = x.shape
    q = numpy.empty((m, n), numpy.int8)
    d16 = numpy.empty((m, n // QK), numpy.uint16)
    s16 = numpy.empty((m, n // QK), numpy.uint16)
    nb = n // QK
    for t in range(m):
        for b in range(nb):
            _quantize_block(x, t * n + b * QK, q, d16, s16, t * nb + b)
    return q, d16, s16, _widen(d16, table), _widen(s16, table)


@njit(parallel=True)
def _quantize_parallel(x, table):  # pragma: no cover - compiled
    m, n = x.shape
    q = numpy.empty((m, n), numpy.int8)
    d16 = numpy.empty((m, n // QK), numpy.uint16)
    s16 = numpy.empty((m, n // QK), numpy.uint16)
    nb = n // QK
    for t in prange(m):
        for b in range(nb):
            _quantize_block(x, t * n + b * QK, q, d16, s16, t * nb + b)
    return q, d16, s16, _widen(d16, table), _widen(s16, table)


@njit
def _widen(h, table):  # pragma: no cover - compiled
    """f16 bits -> f32 values (exact)."""
    out = numpy.empty(h.shape, numpy.float32)
    for t in range(h.shape[0]):
        for b in range(h.shape[1]):
            out[t, b] = table[h[t, b]]
    return out


PARALLEL_MIN_ELEMENTS = 1 << 16  # activations smaller than this are rounded on one thread


_NO_LANES = numpy.zeros(0, numpy.int8)


def _interleave_lanes(q: numpy.ndarray, biased: bool = False) -> numpy.ndarray:
    """The quants of each whole group of 8 rows as the lane tiles read them, flat:
    [group, block, lane L, row j, 4 bytes] = row 8·group+j's elements 32·block+4L..+3.
    ``biased``: each byte x stored as x + 128 (x xor 0x80, an unsigned byte), vpdpbusd's u8
    operand for the signed weight types on a VNNI host, biased once here rather than once per
    weight row in the tiles."""
    m, n = q.shape
    rows = m // LANE_GROUP * LANE_GROUP
    out = numpy.empty(rows * n + 64, numpy.int8)
    start = -out.ctypes.data % 64  # 64-byte aligned: no lane load splits a cache line
    out = out[start : start + rows * n]
    # moved as int32 words (one lane of one row): a quarter of the elements to shuffle
    flip = numpy.int32(_BIAS_WORD if biased else 0)
    _interleave_words(q[:rows].view(numpy.int32), out.view(numpy.int32), flip, LANE_GROUP)
    return out


_BIAS_WORD = -0x7F7F7F80  # 0x80808080 as an int32: each byte's sign bit flipped


@njit
def _interleave_words(words, out, flip, group):  # pragma: no cover - compiled
    rows, n_words = words.shape
    at = 0
    for g in range(rows // group):
        for w in range(n_words):
            for j in range(group):
                out[at] = words[group * g + j, w] ^ flip
                at += 1


class Activation:
    """Activation rows rounded to q8 blocks: int8 quants, f32 block scales (and d·Σq for q8_1)."""

    def __init__(self, x: numpy.ndarray):
        x = numpy.ascontiguousarray(x, dtype=numpy.float32)
        if x.ndim != 2 or x.shape[1] % QK:
            raise ValueError(f"activation must be [m, k] with k a multiple of {QK}, got {x.shape}")
        quantize = _quantize_parallel if x.size >= PARALLEL_MIN_ELEMENTS else _quantize_serial
        self.q, self.d16, self.s16, self.d, self.s = quantize(x, F16_TABLE)
        # the scales block-major too ([nb, m]): the batch tiles load 8 rows' scales at once
        self.d_by_block, self.s_by_block = (
            numpy.ascontiguousarray(self.d.T),
            numpy.ascontiguousarray(self.s.T),
        )

    @functools.cached_property
    def lanes(self) -> numpy.ndarray:
        """The quants interleaved for the lane tiles (16 rows or more), made on first use: the
        repacked Q4_0 kernel and the K-quants never read them."""
        return _interleave_lanes(self.q) if self.q.shape[0] >= LANE_ROWS else _NO_LANES

    @functools.cached_property
    def biased_lanes(self) -> numpy.ndarray:
        """``lanes`` with every byte + 128 (unsigned): what the VNNI lane tiles of the signed
        weight types (Q4_0, Q5_0, Q8_0) read, made on first use."""
        if self.q.shape[0] < LANE_ROWS:
            return _NO_LANES
        return _interleave_lanes(self.q, biased=True)

    def blocks(self, with_sum: bool) -> numpy.ndarray:
        """ggml's block_q8_0 (d, qs[32]) or block_q8_1 (d, s, qs[32]) bytes, [m, n/32 * size]."""
        m, n = self.q.shape
        nb = n // QK
        head = [self.d16, self.s16] if with_sum else [self.d16]
        scales = numpy.stack(head, axis=-1).view(numpy.uint8).reshape(m, nb, 2 * len(head))
        quants = self.q.view(numpy.uint8).reshape(m, nb, QK)
        return numpy.concatenate([scales, quants], axis=-1).reshape(m, -1)


def quantize_q8_0(x: numpy.ndarray) -> numpy.ndarray:
    """f32 rows [m, k] -> ggml block_q8_0 bytes [m, k/32*34], as the AVX2 quantize_row_q8_0."""
    return Activation(numpy.atleast_2d(x)).blocks(with_sum=False)


def quantize_q8_1(x: numpy.ndarray) -> numpy.ndarray:
    """f32 rows [m, k] -> ggml block_q8_1 bytes [m, k/32*36], as the AVX2 quantize_row_q8_1."""
    return Activation(numpy.atleast_2d(x)).blocks(with_sum=True)


# ---------------------------------------------------------------------------------------------
# The dot product of one weight row with one activation row, as LLVM IR (AVX2)
#
# Numba does not vectorise the lane-wise fma chain by itself (it stays scalar, ~10x slower), so
# the dot is emitted as IR with the very operations ggml's AVX2 code uses: psign/pmaddubsw/
# pmaddwd for the integer lanes, a <8 x float> fma per block, then the fixed-order horizontal sum.

_I8, _I16, _I32, _F32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.FloatType()
_V32I8, _V16I8 = ir.VectorType(_I8, 32), ir.VectorType(_I8, 16)
_V16I16, _V8I32, _V8F = ir.VectorType(_I16, 16), ir.VectorType(_I32, 8), ir.VectorType(_F32, 8)


def _call(builder: ir.IRBuilder, name: str, ret: ir.Type, args: list) -> ir.Value:
    fn = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(ret, [a.type for a in args]), name
    )
    return builder.call(fn, args)


def _data(context, builder, aty, arr) -> ir.Value:
    """An array argument's data pointer (typed by its elements), inside an intrinsic's codegen."""
    return context.make_array(aty)(context, builder, arr).data


def _byte_ptr(context, builder, aty, arr) -> ir.Value:
    """The array's data as an i8*."""
    return builder.bitcast(_data(context, builder, aty, arr), _I8.as_pointer())


def _load(
    builder: ir.IRBuilder, base: ir.Value, offset: ir.Value, ty: ir.Type, align: int = 1
) -> ir.Value:
    return builder.load(builder.bitcast(builder.gep(base, [offset]), ty.as_pointer()), align=align)


def _half(builder: ir.IRBuilder, base: ir.Value, offset: ir.Value) -> ir.Value:
    """An f16 stored at base+offset, widened exactly to f32 (vcvtph2ps)."""
    return builder.fpext(builder.bitcast(_load(builder, base, offset, _I16), ir.HalfType()), _F32)


def _splat(builder: ir.IRBuilder, value: ir.Value, vty: ir.VectorType) -> ir.Value:
    first = builder.insert_element(ir.Constant(vty, ir.Undefined), value, ir.Constant(_I32, 0))
    mask = ir.Constant(ir.VectorType(_I32, vty.count), [0] * vty.count)
    return builder.shuffle_vector(first, ir.Constant(vty, ir.Undefined), mask)


def _nibbles(builder: ir.IRBuilder, base: ir.Value, offset: ir.Value) -> ir.Value:
    """16 bytes of packed 4-bit values -> 32 bytes: low nibbles (elements 0..15), then high."""
    raw = _load(builder, base, offset, _V16I8)
    low = builder.and_(raw, ir.Constant(_V16I8, [15] * 16))
    high = builder.lshr(raw, ir.Constant(_V16I8, [4] * 16))
    return builder.shuffle_vector(low, high, ir.Constant(ir.VectorType(_I32, 32), list(range(32))))


def _fifth_bits(builder: ir.IRBuilder, base: ir.Value, offset: ir.Value) -> ir.Value:
    """qh (little-endian uint32): whether bit k is set, in byte k (an <32 x i1>). As ggml's
    bytes_from_bits_32: the word's byte k // 8 spread to byte k by one shuffle (vpshufb), then
    its bit k % 8 tested (vpand, vpcmpeqb); the 32 shifts of a per-bit lshr it replaced made
    Q5_0/Q5_1's one-row products twice Q4_1's time."""
    word = _splat(builder, _load(builder, base, offset, _I32), ir.VectorType(_I32, 8))
    spread = builder.shuffle_vector(
        builder.bitcast(word, _V32I8),
        ir.Constant(_V32I8, ir.Undefined),
        ir.Constant(ir.VectorType(_I32, 32), [k // 8 for k in range(32)]),
    )
    mask = ir.Constant(_V32I8, [(1 << (k % 8)) - (256 if k % 8 == 7 else 0) for k in range(32)])
    return builder.icmp_unsigned("==", builder.and_(spread, mask), mask)


def _weight_bytes(builder: ir.IRBuilder, code: int, base: ir.Value, blk: ir.Value) -> ir.Value:
    """The 32 signed weight values of the block at base+blk, as ggml's byte lanes hold them."""

    def at(k: int) -> ir.Value:
        return builder.add(blk, ir.Constant(blk.type, k))

    if code == _Q8_0:
        return _load(builder, base, at(2), _V32I8)
    if code in (_Q4_0, _Q4_1):
        q = _nibbles(builder, base, at(2 if code == _Q4_0 else 4))
        return builder.sub(q, ir.Constant(_V32I8, [8] * 32)) if code == _Q4_0 else q
    hoff = 2 if code == _Q5_0 else 4
    bit = _fifth_bits(builder, base, at(hoff))
    # Q5_0: nibble | (bit ? 0 : 0xF0) is the signed value nibble + 16·bit − 16 (ggml's andnot);
    # Q5_1: nibble | (bit ? 16 : 0), unsigned
    high = (
        builder.select(bit, ir.Constant(_V32I8, [0] * 32), ir.Constant(_V32I8, [-16] * 32))
        if code == _Q5_0
        else builder.select(bit, ir.Constant(_V32I8, [16] * 32), ir.Constant(_V32I8, [0] * 32))
    )
    return builder.or_(_nibbles(builder, base, at(hoff + 4)), high)


def _hsum(builder: ir.IRBuilder, acc: ir.Value) -> ir.Value:
    """hsum_float_8: hi128 + lo128, then + movehl, then + movehdup."""
    a = [builder.extract_element(acc, ir.Constant(_I32, i)) for i in range(8)]
    low = builder.fadd(builder.fadd(a[0], a[4]), builder.fadd(a[2], a[6]))
    high = builder.fadd(builder.fadd(a[1], a[5]), builder.fadd(a[3], a[7]))
    return builder.fadd(low, high)


def _dpbusd(builder: ir.IRBuilder, acc: ir.Value, u: ir.Value, v: ir.Value) -> ir.Value:
    """vpdpbusd: acc + the sums of four u8 (u) · s8 (v) products per int32 lane, no saturation."""
    v8 = [builder.bitcast(a, _V8I32) for a in (u, v)]
    return _call(builder, "llvm.x86.avx512.vpdpbusd.256", _V8I32, [acc, *v8])


# 1.5·2^23 as f32 bits: for an int32 |i| < 2^22, the float whose bits are _MAGIC + i is exactly
# 1.5·2^23 + i, so subtracting 1.5·2^23 gives float(i) exactly (as cvtdq2ps does): an integer
# add (folded into vpdpbusd's accumulator) and an f32 subtract on the add pipes instead of a
# conversion on the pipes the fmas and vpdpbusd share. ggml's lanes are at most 4·128·128.
_MAGIC = 0x4B400000
_MAGIC_F = 12582912.0


def _magic_float(builder: ir.IRBuilder, biased: ir.Value) -> ir.Value:
    """float(i) of int32 lanes holding _MAGIC + i (|i| < 2^22), exactly."""
    return builder.fsub(builder.bitcast(biased, _V8F), ir.Constant(_V8F, [_MAGIC_F] * 8))


def _pair_quads(builder: ir.IRBuilder, aw: ir.Value, sx: ir.Value, vnni: bool) -> ir.Value:
    """ggml's lanes of a 32-value dot, Σ of four u8 (aw) · s8 (sx) products each: pmaddubsw
    then pmaddwd by ones, or one vpdpbusd (``vnni``: the host has it). The pairs cannot
    saturate in pmaddubsw (|aw·sx| <= 128·128, and -128·128·2 fits), so the integers are the
    same."""
    if vnni:
        return _dpbusd(builder, ir.Constant(_V8I32, [0] * 8), aw, sx)
    pairs = _call(builder, "llvm.x86.avx2.pmadd.ub.sw", _V16I16, [aw, sx])
    return _call(builder, "llvm.x86.avx2.pmadd.wd", _V8I32, [pairs, ir.Constant(_V16I16, [1] * 16)])


def _make_tile(
    code: int, block_bytes: int, has_min: bool, rm: int, rn: int, whole_block: bool = False
):
    """An intrinsic computing an rm x rn tile of outputs: weight rows r..r+rm-1 against
    activation rows t..t+rn-1, each element exactly ggml's vec_dot. The tile shares each unpacked
    weight block and each activation block among its dots, and its rm*rn independent fma chains
    keep the FMA unit busy where one chain would wait on its own latency.

    tile(w, w_off, row_bytes, xq, x_off, n_in, xd, xs, s_off, nb, out, o_off, n_out): weight row
    i at byte w_off + i*row_bytes of w (uint8), activation row j's quants at x_off + j*n_in of xq
    (int8) and its block scales (and q8_1 sums) at s_off + j*nb of xd (and xs); the result of
    (i, j) goes to out.flat[o_off + j*n_out + i].

    ``whole_block``: the arithmetic of llama-server's repacked Q4_0 (q4_0_8x8 gemv/gemm,
    arch/x86/repack.cpp): the block's 32 products summed as one integer, then a scalar
    ``acc = fma(Σ, d_w·d_x, acc)`` per block and no horizontal sum."""

    @intrinsic
    def tile(typingctx, w, w_off, row_bytes, xq, x_off, n_in, xd, xs, s_off, nb, out, o_off, n_out):
        sig = types.void(w, w_off, row_bytes, xq, x_off, n_in, xd, xs, s_off, nb, out, o_off, n_out)

        def codegen(context, builder, signature, args):
            aty = signature.args
            (_, w_off, row_bytes, _, x_off, n_in, _, _, s_off, nblocks, _, o_off, n_out) = args
            wbase = _byte_ptr(context, builder, aty[0], args[0])
            xbase = _byte_ptr(context, builder, aty[3], args[3])
            dbase, sbase, obase = (_data(context, builder, aty[i], args[i]) for i in (6, 7, 10))
            ity = w_off.type

            def const(v: int) -> ir.Value:
                return ir.Constant(ity, v)

            acc_zero = ir.Constant(_F32, 0.0) if whole_block else ir.Constant(_V8F, [0.0] * 8)
            acc = [
                [cgutils.alloca_once_value(builder, acc_zero) for _ in range(rn)] for _ in range(rm)
            ]
            summs = [
                [cgutils.alloca_once_value(builder, ir.Constant(_F32, 0.0)) for _ in range(rn)]
                for _ in range(rm)
            ]
            with cgutils.for_range(builder, nblocks) as loop:
                b = loop.index
                rows = []
                for i in range(rm):
                    blk = builder.add(
                        builder.add(w_off, builder.mul(const(i), row_bytes)),
                        builder.mul(b, const(block_bytes)),
                    )
                    wv = _weight_bytes(builder, code, wbase, blk)
                    m_w = _half(builder, wbase, builder.add(blk, const(2))) if has_min else None
                    # signed weights: |w| for maddubs, the sign moves onto x (mul_sum_i8_pairs)
                    aw = (
                        wv if has_min else _call(builder, "llvm.x86.avx2.psign.b", _V32I8, [wv, wv])
                    )
                    rows.append((wv, aw, _half(builder, wbase, blk), m_w))
                for j in range(rn):
                    xo = builder.add(
                        builder.add(x_off, builder.mul(const(j), n_in)), builder.mul(b, const(QK))
                    )
                    xv = _load(builder, xbase, xo, _V32I8)
                    so = builder.add(builder.add(s_off, builder.mul(const(j), nblocks)), b)
                    d_x = builder.load(builder.gep(dbase, [so]))
                    s_x = builder.load(builder.gep(sbase, [so])) if has_min else None
                    for i, (wv, aw, d_w, m_w) in enumerate(rows):
                        sx = (
                            xv
                            if has_min
                            else _call(builder, "llvm.x86.avx2.psign.b", _V32I8, [xv, wv])
                        )
                        # vpdpbusd: one-row Q4_1 1536x576 44.1 -> 41.4 us, Q5_0 55.2 -> 51.8, Q5_1
                        # 54.2 -> 52.3, but Q8_0 39.5 -> 44.0 (one thread, min of 9): not for Q8_0
                        quads = _pair_quads(builder, aw, sx, HOST_HAS_VNNI and code != _Q8_0)
                        if whole_block:
                            block_sum = _call(
                                builder, "llvm.vector.reduce.add.v8i32", _I32, [quads]
                            )
                            builder.store(
                                _call(
                                    builder,
                                    "llvm.fma.f32",
                                    _F32,
                                    [
                                        builder.sitofp(block_sum, _F32),
                                        builder.fmul(d_w, d_x),
                                        builder.load(acc[i][j]),
                                    ],
                                ),
                                acc[i][j],
                            )
                        else:
                            lanes = builder.sitofp(quads, _V8F)
                            scale = _splat(builder, builder.fmul(d_w, d_x), _V8F)
                            builder.store(
                                _call(
                                    builder,
                                    "llvm.fma.v8f32",
                                    _V8F,
                                    [scale, lanes, builder.load(acc[i][j])],
                                ),
                                acc[i][j],
                            )
                        if has_min:
                            builder.store(
                                _call(
                                    builder,
                                    "llvm.fma.f32",
                                    _F32,
                                    [m_w, s_x, builder.load(summs[i][j])],
                                ),
                                summs[i][j],
                            )
            for i in range(rm):
                for j in range(rn):
                    total = builder.load(acc[i][j])
                    if not whole_block:
                        total = _hsum(builder, total)
                    if has_min:
                        total = builder.fadd(total, builder.load(summs[i][j]))
                    index = builder.add(builder.add(o_off, builder.mul(const(j), n_out)), const(i))
                    builder.store(total, builder.gep(obase, [index]))
            return context.get_dummy_value()

        return sig, codegen

    return tile


def _make_wide_tile(code: int, block_bytes: int, has_min: bool, rm: int, rn: int):
    """Like _make_tile, for batches: an rm x rn tile whose activation scales are read from the
    block-major copies (``Activation.d_by_block``/``s_by_block``, [nb, m]): the rn ``s_x`` of a
    block are one vector load, so per weight row and block one vector fma advances all rn
    ``summs`` chains, and each ``d_w·d_x`` is a multiply of two broadcasts (the d_x one straight
    from memory). Each lane is the same float operation as ggml's scalar one, so the bits do not
    change, with fewer instructions per dot.

    tile(w, w_off, row_bytes, xq, x_off, n_in, xd, xs, s_off, m, nb, out, o_off, n_out): as
    _make_tile's, except that the scales of activation row t+j, block b are at
    s_off + b*m + j of xd/xs (s_off = t)."""
    vrn = ir.VectorType(_F32, rn)

    @intrinsic
    def tile(
        typingctx, w, w_off, row_bytes, xq, x_off, n_in, xd, xs, s_off, m, nb, out, o_off, n_out
    ):
        sig = types.void(
            w, w_off, row_bytes, xq, x_off, n_in, xd, xs, s_off, m, nb, out, o_off, n_out
        )

        def codegen(context, builder, signature, args):
            aty = signature.args
            (_, w_off, row_bytes, _, x_off, n_in, _, _, s_off, m, nblocks, _, o_off, n_out) = args
            wbase = _byte_ptr(context, builder, aty[0], args[0])
            xbase = _byte_ptr(context, builder, aty[3], args[3])
            dbase, sbase, obase = (_data(context, builder, aty[i], args[i]) for i in (6, 7, 11))
            ity = w_off.type

            def const(v: int) -> ir.Value:
                return ir.Constant(ity, v)

            def load_scales(base: ir.Value, index: ir.Value) -> ir.Value:
                return builder.load(
                    builder.bitcast(builder.gep(base, [index]), vrn.as_pointer()), align=4
                )

            acc = [
                [
                    cgutils.alloca_once_value(builder, ir.Constant(_V8F, [0.0] * 8))
                    for _ in range(rn)
                ]
                for _ in range(rm)
            ]
            summs = [
                cgutils.alloca_once_value(builder, ir.Constant(vrn, [0.0] * rn)) for _ in range(rm)
            ]
            with cgutils.for_range(builder, nblocks) as loop:
                b = loop.index
                so = builder.add(s_off, builder.mul(b, m))
                s_x = load_scales(sbase, so) if has_min else None
                rows = []
                for i in range(rm):
                    blk = builder.add(
                        builder.add(w_off, builder.mul(const(i), row_bytes)),
                        builder.mul(b, const(block_bytes)),
                    )
                    wv = _weight_bytes(builder, code, wbase, blk)
                    aw = (
                        wv if has_min else _call(builder, "llvm.x86.avx2.psign.b", _V32I8, [wv, wv])
                    )
                    d_w = _splat(builder, _half(builder, wbase, blk), _V8F)
                    if has_min:
                        m_w = _splat(
                            builder, _half(builder, wbase, builder.add(blk, const(2))), vrn
                        )
                        builder.store(
                            _call(
                                builder,
                                f"llvm.fma.v{rn}f32",
                                vrn,
                                [m_w, s_x, builder.load(summs[i])],
                            ),
                            summs[i],
                        )
                    rows.append((wv, aw, d_w))
                for j in range(rn):
                    xo = builder.add(
                        builder.add(x_off, builder.mul(const(j), n_in)), builder.mul(b, const(QK))
                    )
                    xv = _load(builder, xbase, xo, _V32I8)
                    # d_x broadcast from memory, times the splat d_w: one multiply per dot, where
                    # taking lane j of a vector of products cost two shuffles
                    d_x = _splat(
                        builder, builder.load(builder.gep(dbase, [builder.add(so, const(j))])), _V8F
                    )
                    for i, (wv, aw, d_w) in enumerate(rows):
                        sx = (
                            xv
                            if has_min
                            else _call(builder, "llvm.x86.avx2.psign.b", _V32I8, [xv, wv])
                        )
                        pairs = _call(builder, "llvm.x86.avx2.pmadd.ub.sw", _V16I16, [aw, sx])
                        quads = _call(
                            builder,
                            "llvm.x86.avx2.pmadd.wd",
                            _V8I32,
                            [pairs, ir.Constant(_V16I16, [1] * 16)],
                        )
                        scale = builder.fmul(d_w, d_x)
                        builder.store(
                            _call(
                                builder,
                                "llvm.fma.v8f32",
                                _V8F,
                                [scale, builder.sitofp(quads, _V8F), builder.load(acc[i][j])],
                            ),
                            acc[i][j],
                        )
            for i in range(rm):
                mins = builder.load(summs[i]) if has_min else None
                for j in range(rn):
                    total = _hsum(builder, builder.load(acc[i][j]))
                    if has_min:
                        total = builder.fadd(
                            total, builder.extract_element(mins, ir.Constant(_I32, j))
                        )
                    index = builder.add(builder.add(o_off, builder.mul(const(j), n_out)), const(i))
                    builder.store(total, builder.gep(obase, [index]))
            return context.get_dummy_value()

        return sig, codegen

    return tile


def _make_lane_tile(
    code: int, block_bytes: int, has_min: bool, vnni: bool = False, one_pass: bool = False
):
    """One weight row by LANE_ROWS activation rows, vectorised across the rows instead of across
    ggml's eight lanes: vector g, lane j holds lane L of the dot with activation row t+8g+j.

    ggml's dot keeps eight float lanes, lane L = fma(d_w·d_x, Σ of elements 4L..4L+3, lane L)
    over the blocks, then hsum_float_8. Here the activation comes interleaved
    (``Activation.lanes``: per group of 8 rows, block and lane, the 8 rows' 4 bytes side by
    side), so one pmaddubsw gives lane L of 8 dots; the weight's 4 bytes of lane L are a
    broadcast load from the task's unpacked copy of its rows (a load, no shuffle); and d_w·d_x
    of the 8 rows is one vector multiply per block, where the row-major tile spent a multiply
    and a broadcast per dot (those, on the FMA pipes, were a third of a batch product's time).
    hsum_float_8's adds become vertical adds across the lane vectors. Every element is the same
    sequence of float operations as ggml's. Lanes 0-3 (the block's first 16 elements) and 4-7
    are two passes over the blocks, to keep the accumulators in the 16 vector registers of AVX2;
    ``one_pass`` (AVX512VL: 32 of them) takes all eight lanes in one pass, so that d_w, the
    rows' scales and their products are loaded and computed once per block, not twice.

    tile(w, w_off, wu, wu_off, xl, xl_off, xd, xs, s_off, m, nb, out, o_off, n_out): the weight
    row's block bytes at w_off of w (for d_w, m_w) and its 32 signed values per block at wu_off
    of wu (``_unpack_at``); the two groups' interleaved quants at xl_off and xl_off + nb*256 of
    xl (int8); scales of activation row t+j, block b at s_off + b*m + j of xd/xs (block-major,
    s_off = t); the result of row t+j to out.flat[o_off + j*n_out]."""

    @intrinsic
    def tile(typingctx, w, w_off, wu, wu_off, xl, xl_off, xd, xs, s_off, m, nb, out, o_off, n_out):
        sig = types.void(w, w_off, wu, wu_off, xl, xl_off, xd, xs, s_off, m, nb, out, o_off, n_out)

        def codegen(context, builder, signature, args):
            aty = signature.args
            (_, w_off, _, wu_off, _, xl_off, _, _, s_off, m, nblocks, _, o_off, n_out) = args
            wbase = _byte_ptr(context, builder, aty[0], args[0])
            ubase = _byte_ptr(context, builder, aty[2], args[2])
            xbase = _byte_ptr(context, builder, aty[4], args[4])
            dbase, sbase, obase = (_data(context, builder, aty[i], args[i]) for i in (6, 7, 11))
            ity = w_off.type

            def const(v: int) -> ir.Value:
                return ir.Constant(ity, v)

            def row_scales(base: ir.Value, b: ir.Value, g: int) -> ir.Value:
                at = builder.add(builder.add(s_off, builder.mul(b, m)), const(8 * g))
                return builder.load(
                    builder.bitcast(builder.gep(base, [at]), _V8F.as_pointer()), align=4
                )

            zero = ir.Constant(_V8F, [0.0] * 8)
            lanes = [[cgutils.alloca_once_value(builder, zero) for _ in range(8)] for _ in range(2)]
            summs = [cgutils.alloca_once_value(builder, zero) for _ in range(2)]
            ones = ir.Constant(_V16I16, [1] * 16)
            n_lanes = 8 if one_pass else 4  # ggml lanes per pass over the blocks
            for half in range(8 // n_lanes):
                acc = [
                    [cgutils.alloca_once_value(builder, zero) for _ in range(n_lanes)]
                    for _ in range(2)
                ]
                with cgutils.for_range(builder, nblocks) as loop:
                    b = loop.index
                    blk = builder.add(w_off, builder.mul(b, const(block_bytes)))
                    d_w = _splat(builder, _half(builder, wbase, blk), _V8F)
                    scales = [builder.fmul(d_w, row_scales(dbase, b, g)) for g in range(2)]
                    if has_min and half == 0:
                        m_w = _splat(
                            builder, _half(builder, wbase, builder.add(blk, const(2))), _V8F
                        )
                        for g in range(2):
                            builder.store(
                                _call(
                                    builder,
                                    "llvm.fma.v8f32",
                                    _V8F,
                                    [m_w, row_scales(sbase, b, g), builder.load(summs[g])],
                                ),
                                summs[g],
                            )
                    for k in range(n_lanes):
                        lane = n_lanes * half + k
                        wat = builder.add(
                            builder.add(wu_off, builder.mul(b, const(QK))), const(4 * lane)
                        )
                        wl = builder.bitcast(
                            _splat(builder, _load(builder, ubase, wat, _I32), _V8I32), _V32I8
                        )
                        if vnni:
                            # signed weights: the activation's bytes + 128 (unsigned, biased
                            # once in Activation.biased_lanes) times w, less 128·Σw of the lane
                            # (one vpdpbusd for the 8 rows), exactly; Q4_1/Q5_1: the unsigned
                            # weight times the activation as it is
                            lane_sum = (
                                None
                                if has_min
                                else _splat(
                                    builder,
                                    _load(
                                        builder,
                                        ubase,
                                        # lane L's bytes are at 4L of the block, its
                                        # correction at 4L of the block's int32 eight
                                        builder.add(wat, builder.mul(nblocks, const(QK))),
                                        _I32,
                                    ),
                                    _V8I32,
                                )
                            )
                            for g in range(2):
                                at = builder.add(
                                    builder.add(
                                        xl_off,
                                        builder.mul(const(g), builder.mul(nblocks, const(256))),
                                    ),
                                    builder.add(builder.mul(b, const(256)), const(32 * lane)),
                                )
                                xv = _load(builder, xbase, at, _V32I8)
                                quads = (
                                    _dpbusd(builder, ir.Constant(_V8I32, [_MAGIC] * 8), wl, xv)
                                    if has_min
                                    else _dpbusd(builder, lane_sum, xv, wl)
                                )
                                builder.store(
                                    _call(
                                        builder,
                                        "llvm.fma.v8f32",
                                        _V8F,
                                        [
                                            scales[g],
                                            _magic_float(builder, quads),
                                            builder.load(acc[g][k]),
                                        ],
                                    ),
                                    acc[g][k],
                                )
                            continue
                        aw = (
                            wl
                            if has_min
                            else _call(builder, "llvm.x86.avx2.psign.b", _V32I8, [wl, wl])
                        )
                        for g in range(2):
                            # group g, block b, lane 4*half+k: 32 bytes
                            at = builder.add(
                                builder.add(
                                    xl_off, builder.mul(const(g), builder.mul(nblocks, const(256)))
                                ),
                                builder.add(builder.mul(b, const(256)), const(32 * lane)),
                            )
                            xv = _load(builder, xbase, at, _V32I8)
                            sx = (
                                xv
                                if has_min
                                else _call(builder, "llvm.x86.avx2.psign.b", _V32I8, [xv, wl])
                            )
                            pairs = _call(builder, "llvm.x86.avx2.pmadd.ub.sw", _V16I16, [aw, sx])
                            quads = _call(builder, "llvm.x86.avx2.pmadd.wd", _V8I32, [pairs, ones])
                            builder.store(
                                _call(
                                    builder,
                                    "llvm.fma.v8f32",
                                    _V8F,
                                    [
                                        scales[g],
                                        builder.sitofp(quads, _V8F),
                                        builder.load(acc[g][k]),
                                    ],
                                ),
                                acc[g][k],
                            )
                for g in range(2):
                    for k in range(n_lanes):
                        builder.store(builder.load(acc[g][k]), lanes[g][n_lanes * half + k])
            for g in range(2):
                a = [builder.load(lane) for lane in lanes[g]]
                low = builder.fadd(builder.fadd(a[0], a[4]), builder.fadd(a[2], a[6]))
                high = builder.fadd(builder.fadd(a[1], a[5]), builder.fadd(a[3], a[7]))
                total = builder.fadd(low, high)
                if has_min:
                    total = builder.fadd(total, builder.load(summs[g]))
                for j in range(8):
                    index = builder.add(o_off, builder.mul(const(8 * g + j), n_out))
                    builder.store(
                        builder.extract_element(total, ir.Constant(_I32, j)),
                        builder.gep(obase, [index]),
                    )
            return context.get_dummy_value()

        return sig, codegen

    return tile


_V16F, _V16I32, _V64I8 = ir.VectorType(_F32, 16), ir.VectorType(_I32, 16), ir.VectorType(_I8, 64)


def _make_zmm_lane_tile(code: int, block_bytes: int, has_min: bool):
    """_make_lane_tile's VNNI tile with 512-bit vectors (AVX512F/BW/VNNI): lane j of each
    vector is activation row t+j of the 16, whose quants ``Activation.lanes`` then holds in
    groups of 16 rows ([group, block, lane L, row j, 4 bytes]: one 64-byte load per ggml lane and
    block). All eight lanes in one pass (8 accumulators), the rows' 16 scales one load; per
    element the same integers (vpdpbusd, the −128·Σw corrections of the signed types), the same
    1.5·2^23 conversion and the same float operations as the 256-bit tile: the bits do not
    change, with half the instructions per product.

    Same signature as _make_lane_tile's tile; xl_off is the 16-row group's start."""

    @intrinsic
    def tile(typingctx, w, w_off, wu, wu_off, xl, xl_off, xd, xs, s_off, m, nb, out, o_off, n_out):
        sig = types.void(w, w_off, wu, wu_off, xl, xl_off, xd, xs, s_off, m, nb, out, o_off, n_out)

        def codegen(context, builder, signature, args):
            aty = signature.args
            (_, w_off, _, wu_off, _, xl_off, _, _, s_off, m, nblocks, _, o_off, n_out) = args
            wbase = _byte_ptr(context, builder, aty[0], args[0])
            ubase = _byte_ptr(context, builder, aty[2], args[2])
            xbase = _byte_ptr(context, builder, aty[4], args[4])
            dbase, sbase, obase = (_data(context, builder, aty[i], args[i]) for i in (6, 7, 11))
            ity = w_off.type

            def const(v: int) -> ir.Value:
                return ir.Constant(ity, v)

            def row_scales(base: ir.Value, b: ir.Value) -> ir.Value:
                at = builder.add(s_off, builder.mul(b, m))
                return builder.load(
                    builder.bitcast(builder.gep(base, [at]), _V16F.as_pointer()), align=4
                )

            def dpbusd(acc: ir.Value, u: ir.Value, v: ir.Value) -> ir.Value:
                v16 = [builder.bitcast(a, _V16I32) for a in (u, v)]
                return _call(builder, "llvm.x86.avx512.vpdpbusd.512", _V16I32, [acc, *v16])

            zero = ir.Constant(_V16F, [0.0] * 16)
            magic = ir.Constant(_V16I32, [_MAGIC] * 16)
            acc = [cgutils.alloca_once_value(builder, zero) for _ in range(8)]
            summs = cgutils.alloca_once_value(builder, zero)
            with cgutils.for_range(builder, nblocks) as loop:
                b = loop.index
                blk = builder.add(w_off, builder.mul(b, const(block_bytes)))
                d_w = _splat(builder, _half(builder, wbase, blk), _V16F)
                scales = builder.fmul(d_w, row_scales(dbase, b))
                if has_min:
                    m_w = _splat(builder, _half(builder, wbase, builder.add(blk, const(2))), _V16F)
                    builder.store(
                        _call(
                            builder,
                            "llvm.fma.v16f32",
                            _V16F,
                            [m_w, row_scales(sbase, b), builder.load(summs)],
                        ),
                        summs,
                    )
                for lane in range(8):
                    wat = builder.add(
                        builder.add(wu_off, builder.mul(b, const(QK))), const(4 * lane)
                    )
                    wl = builder.bitcast(
                        _splat(builder, _load(builder, ubase, wat, _I32), _V16I32), _V64I8
                    )
                    at = builder.add(
                        builder.add(xl_off, builder.mul(b, const(512))), const(64 * lane)
                    )
                    xv = _load(builder, xbase, at, _V64I8)
                    if has_min:  # unsigned weight against the activation as it is
                        quads = dpbusd(magic, wl, xv)
                    else:  # the activation + 128 (biased_lanes) against w, less 128·Σw
                        corr = _splat(
                            builder,
                            _load(
                                builder,
                                ubase,
                                builder.add(wat, builder.mul(nblocks, const(QK))),
                                _I32,
                            ),
                            _V16I32,
                        )
                        quads = dpbusd(corr, xv, wl)
                    lanef = builder.fsub(
                        builder.bitcast(quads, _V16F), ir.Constant(_V16F, [_MAGIC_F] * 16)
                    )
                    builder.store(
                        _call(
                            builder,
                            "llvm.fma.v16f32",
                            _V16F,
                            [scales, lanef, builder.load(acc[lane])],
                        ),
                        acc[lane],
                    )
            a = [builder.load(x) for x in acc]
            low = builder.fadd(builder.fadd(a[0], a[4]), builder.fadd(a[2], a[6]))
            high = builder.fadd(builder.fadd(a[1], a[5]), builder.fadd(a[3], a[7]))
            total = builder.fadd(low, high)
            if has_min:
                total = builder.fadd(total, builder.load(summs))
            for j in range(16):
                index = builder.add(o_off, builder.mul(const(j), n_out))
                builder.store(
                    builder.extract_element(total, ir.Constant(_I32, j)),
                    builder.gep(obase, [index]),
                )
            return context.get_dummy_value()

        return sig, codegen

    return tile


# kernel code -> (weight layout, bytes per block, has the min term, repacked arithmetic)
_CODES = {
    _Q4_0: (_Q4_0, 18, False, False),
    _Q4_1: (_Q4_1, 20, True, False),
    _Q5_0: (_Q5_0, 22, False, False),
    _Q5_1: (_Q5_1, 24, True, False),
    _Q8_0: (_Q8_0, 34, False, False),
    _Q4_0R: (_Q4_0, 18, False, True),
}
# (kernel code, shape) -> tile intrinsic; shape = 10 * weight rows + activation rows
_TILES = {
    (code, shape): _make_tile(layout, size, has_min, shape // 10, shape % 10, whole_block=whole)
    for code, (layout, size, has_min, whole) in _CODES.items()
    for shape in (11, 41, 22)
}
# batches: one weight row by 8 or 4 activation rows, scales read block-major (not for repacked Q4_0)
_WIDE_TILES = {
    (code, rows): _make_wide_tile(layout, size, has_min, 1, rows)
    for code, (layout, size, has_min, whole) in _CODES.items()
    if not whole
    for rows in (8, 4)
}


def _make_unpack(code: int, block_bytes: int, corrections: bool = False):
    """unpack(w, w_off, nb, dst, d_off): the nb blocks of the weight row at byte w_off of w as
    32 signed int8 values each (_weight_bytes), to dst[d_off:d_off + 32*nb]. ``corrections``
    (signed weights, VNNI lane tiles): also each block's eight int32 −128·Σw of its lanes, to
    dst[d_off + 32*nb:][32*b:32*b + 32] (the row's slot in dst is 64*nb bytes)."""

    @intrinsic
    def unpack(typingctx, w, w_off, nb, dst, d_off):
        sig = types.void(w, w_off, nb, dst, d_off)

        def codegen(context, builder, signature, args):
            aty = signature.args
            _, w_off, nblocks, _, d_off = args
            wbase = _byte_ptr(context, builder, aty[0], args[0])
            dbase = _byte_ptr(context, builder, aty[3], args[3])
            ity = w_off.type
            with cgutils.for_range(builder, nblocks) as loop:
                b = loop.index
                blk = builder.add(w_off, builder.mul(b, ir.Constant(ity, block_bytes)))
                wv = _weight_bytes(builder, code, wbase, blk)
                at = builder.add(d_off, builder.mul(b, ir.Constant(ity, QK)))
                builder.store(
                    wv, builder.bitcast(builder.gep(dbase, [at]), _V32I8.as_pointer()), align=1
                )
                if corrections:
                    zero = ir.Constant(_V8I32, [0] * 8)
                    bias = ir.Constant(_V32I8, [-128] * 32)  # 0x80, unsigned 128
                    lane_sum = builder.sub(
                        ir.Constant(_V8I32, [_MAGIC] * 8), _dpbusd(builder, zero, bias, wv)
                    )
                    cat = builder.add(at, builder.mul(nblocks, ir.Constant(ity, QK)))
                    builder.store(
                        lane_sum,
                        builder.bitcast(builder.gep(dbase, [cat]), _V8I32.as_pointer()),
                        align=1,
                    )
            return context.get_dummy_value()

        return sig, codegen

    return unpack


_UNPACKS = {
    code: _make_unpack(layout, size, HOST_HAS_VNNI and not has_min)
    for code, (layout, size, has_min, whole) in _CODES.items()
    if not whole
}


@intrinsic(prefer_literal=True)
def _unpack_at(typingctx, code, w, w_off, nb, dst, d_off):
    """The unpacking of _UNPACKS[code], inlined at the call."""
    key = _literal_key(code)
    if key is None:
        return None
    if key[0] not in _UNPACKS:
        return types.void(
            code, w, w_off, nb, dst, d_off
        ), lambda context, builder, signature, args: context.get_dummy_value()
    sig, gen = _UNPACKS[key[0]]._defn(typingctx, w, w_off, nb, dst, d_off)

    def codegen(context, builder, signature, args):
        return gen(context, builder, sig, args[1:])

    return types.void(code, *sig.args), codegen


_LANE_TILES = {
    code: (
        _make_zmm_lane_tile(layout, size, has_min)
        if HOST_HAS_ZMM_VNNI
        else _make_lane_tile(layout, size, has_min, HOST_HAS_VNNI, HOST_HAS_AVX512VL)
    )
    for code, (layout, size, has_min, whole) in _CODES.items()
    if not whole
}


def _literal_key(*args) -> tuple | None:
    """The values of literal-typed arguments (the code and shape a caller passed as constants)."""
    if not all(isinstance(a, types.IntegerLiteral) for a in args):
        return None
    return tuple(a.literal_value for a in args)


@intrinsic(prefer_literal=True)
def _tile_at(
    typingctx,
    code,
    shape,
    w,
    w_off,
    row_bytes,
    xq,
    x_off,
    n_in,
    xd,
    xs,
    s_off,
    nb,
    out,
    o_off,
    n_out,
):
    """The tile of _TILES[code, shape] (both compile-time constants), inlined at the call: a call
    to a jitted helper per tile (with its array reference counting) cost a third of the time."""
    key = _literal_key(code, shape)
    if key not in _TILES:
        return None
    sig, gen = _TILES[key]._defn(
        typingctx, w, w_off, row_bytes, xq, x_off, n_in, xd, xs, s_off, nb, out, o_off, n_out
    )

    def codegen(context, builder, signature, args):
        return gen(context, builder, sig, args[2:])

    return types.void(code, shape, *sig.args), codegen


@intrinsic(prefer_literal=True)
def _wide_at(
    typingctx,
    code,
    rows,
    w,
    w_off,
    row_bytes,
    xq,
    x_off,
    n_in,
    xd,
    xs,
    s_off,
    m,
    nb,
    out,
    o_off,
    n_out,
):
    """The tile of _WIDE_TILES[code, rows], inlined at the call."""
    key = _literal_key(code, rows)
    if key is None:
        return None
    if key not in _WIDE_TILES:  # repacked Q4_0: typed in _rows's branch that never runs for it
        return types.void(
            code,
            rows,
            w,
            w_off,
            row_bytes,
            xq,
            x_off,
            n_in,
            xd,
            xs,
            s_off,
            m,
            nb,
            out,
            o_off,
            n_out,
        ), lambda context, builder, signature, args: context.get_dummy_value()
    sig, gen = _WIDE_TILES[key]._defn(
        typingctx, w, w_off, row_bytes, xq, x_off, n_in, xd, xs, s_off, m, nb, out, o_off, n_out
    )

    def codegen(context, builder, signature, args):
        return gen(context, builder, sig, args[2:])

    return types.void(code, rows, *sig.args), codegen


@intrinsic(prefer_literal=True)
def _lanes_at(
    typingctx, code, w, w_off, wu, wu_off, xl, xl_off, xd, xs, s_off, m, nb, out, o_off, n_out
):
    """The tile of _LANE_TILES[code], inlined at the call (a no-op for repacked Q4_0, whose
    branch never runs)."""
    key = _literal_key(code)
    if key is None:
        return None
    if key[0] not in _LANE_TILES:
        return types.void(
            code, w, w_off, wu, wu_off, xl, xl_off, xd, xs, s_off, m, nb, out, o_off, n_out
        ), lambda context, builder, signature, args: context.get_dummy_value()
    sig, gen = _LANE_TILES[key[0]]._defn(
        typingctx, w, w_off, wu, wu_off, xl, xl_off, xd, xs, s_off, m, nb, out, o_off, n_out
    )

    def codegen(context, builder, signature, args):
        return gen(context, builder, sig, args[1:])

    return types.void(code, *sig.args), codegen


@njit
def _rows(
    code, raw, row_bytes, r0, r1, xq, xd, xs, xd_by_block, xs_by_block, xl, out
):  # pragma: no cover
    """out[:, r0:r1] (``code`` a literal): lane tiles (one weight row by 16 activation rows, on
    the task's weight rows unpacked once), then wide tiles (one weight row by 8, then 4) while
    enough activation rows are left (neither for repacked Q4_0), then 2x2 tiles (two weight rows
    by two activation rows), then 4x1 tiles for a last row; single dots at the edges."""
    m, n_in = xq.shape
    nb = n_in // QK
    n_out = out.shape[1]
    t = 0
    if code != _Q4_0R:
        if m >= LANE_ROWS:
            # per weight row its values, then (signed weights on a VNNI host) the lanes'
            # corrections (_make_unpack)
            wu = numpy.empty((r1 - r0) * 2 * n_in, numpy.int8)
            for r in range(r0, r1):
                _unpack_at(code, raw, r * row_bytes, nb, wu, (r - r0) * 2 * n_in)
        while t + LANE_ROWS <= m:
            for r in range(r0, r1):
                _lanes_at(
                    code,
                    raw,
                    r * row_bytes,
                    wu,
                    (r - r0) * 2 * n_in,
                    xl,
                    (t // 8) * nb * 256,
                    xd_by_block,
                    xs_by_block,
                    t,
                    m,
                    nb,
                    out,
                    t * n_out + r,
                    n_out,
                )
            t += LANE_ROWS
        while t + 8 <= m:
            for r in range(r0, r1):
                _wide_at(
                    code,
                    8,
                    raw,
                    r * row_bytes,
                    row_bytes,
                    xq,
                    t * n_in,
                    n_in,
                    xd_by_block,
                    xs_by_block,
                    t,
                    m,
                    nb,
                    out,
                    t * n_out + r,
                    n_out,
                )
            t += 8
        if t + 4 <= m:
            for r in range(r0, r1):
                _wide_at(
                    code,
                    4,
                    raw,
                    r * row_bytes,
                    row_bytes,
                    xq,
                    t * n_in,
                    n_in,
                    xd_by_block,
                    xs_by_block,
                    t,
                    m,
                    nb,
                    out,
                    t * n_out + r,
                    n_out,
                )
            t += 4
    while t + 2 <= m:
        r = r0
        while r + 2 <= r1:
            _tile_at(
                code,
                22,
                raw,
                r * row_bytes,
                row_bytes,
                xq,
                t * n_in,
                n_in,
                xd,
                xs,
                t * nb,
                nb,
                out,
                t * n_out + r,
                n_out,
            )
            r += 2
        if r < r1:
            for j in range(2):
                _tile_at(
                    code,
                    11,
                    raw,
                    r * row_bytes,
                    row_bytes,
                    xq,
                    (t + j) * n_in,
                    n_in,
                    xd,
                    xs,
                    (t + j) * nb,
                    nb,
                    out,
                    (t + j) * n_out + r,
                    n_out,
                )
        t += 2
    if t < m:
        r = r0
        while r + 4 <= r1:
            _tile_at(
                code,
                41,
                raw,
                r * row_bytes,
                row_bytes,
                xq,
                t * n_in,
                n_in,
                xd,
                xs,
                t * nb,
                nb,
                out,
                t * n_out + r,
                n_out,
            )
            r += 4
        while r < r1:
            _tile_at(
                code,
                11,
                raw,
                r * row_bytes,
                row_bytes,
                xq,
                t * n_in,
                n_in,
                xd,
                xs,
                t * nb,
                nb,
                out,
                t * n_out + r,
                n_out,
            )
            r += 1


def _by_code(serial: object, parallel: object, handled: frozenset[int]) -> object:
    """``run(codes, code, use_parallel, args)``, for compiled code: ``serial(code, args)`` or
    ``parallel(code, args)`` with the runtime ``code`` passed on as a constant, so that each
    kernel compiles once per weight type with that type's tiles inlined (a runtime code made
    every tile a call through all the branches, about 30 % of a batch product's time). Only the
    branches of the codes in ``codes`` (a ``code_set``) that the kernels handle are kept: the
    others are dropped before typing and never compiled. The body computes nothing itself, so
    Numba's default options change no bits; it is compiled into its caller and cached with it."""

    def run(codes, code, use_parallel, args):  # pragma: no cover - compiled code only
        raise TypeError("exact_matmul's product dispatch runs in compiled code only")

    @overload(run)
    def _run(codes, code, use_parallel, args):
        present = present_in(codes)
        q4_0, q4_1, q5_0, q5_1, q8_0, q4_0r, f16, f32, bf16 = (
            present[c] and c in handled for c in range(N_CODES)
        )

        def body(codes, code, use_parallel, args):  # pragma: no cover - compiled
            if q4_1 and code == _Q4_1:
                if use_parallel:
                    parallel(_Q4_1, args)
                else:
                    serial(_Q4_1, args)
            elif q8_0 and code == _Q8_0:
                if use_parallel:
                    parallel(_Q8_0, args)
                else:
                    serial(_Q8_0, args)
            elif q4_0 and code == _Q4_0:
                if use_parallel:
                    parallel(_Q4_0, args)
                else:
                    serial(_Q4_0, args)
            elif q5_0 and code == _Q5_0:
                if use_parallel:
                    parallel(_Q5_0, args)
                else:
                    serial(_Q5_0, args)
            elif q5_1 and code == _Q5_1:
                if use_parallel:
                    parallel(_Q5_1, args)
                else:
                    serial(_Q5_1, args)
            elif q4_0r and code == _Q4_0R:
                if use_parallel:
                    parallel(_Q4_0R, args)
                else:
                    serial(_Q4_0R, args)
            elif f16 and code == _F16:
                if use_parallel:
                    parallel(_F16, args)
                else:
                    serial(_F16, args)
            elif f32 and code == _F32_CODE:
                if use_parallel:
                    parallel(_F32_CODE, args)
                else:
                    serial(_F32_CODE, args)
            elif bf16 and code == _BF16:
                if use_parallel:
                    parallel(_BF16, args)
                else:
                    serial(_BF16, args)

        return body

    return run


@njit
def _serial_for(code, args):  # pragma: no cover - compiled
    raw, row_bytes, n_out, xq, xd, xs, xd_by_block, xs_by_block, xl, out = args
    for r0 in range(0, n_out, ROWS_PER_TASK):
        _rows(
            code,
            raw,
            row_bytes,
            r0,
            min(r0 + ROWS_PER_TASK, n_out),
            xq,
            xd,
            xs,
            xd_by_block,
            xs_by_block,
            xl,
            out,
        )


@njit(parallel=True)
def _parallel_for(code, args):  # pragma: no cover - compiled
    raw, row_bytes, n_out, xq, xd, xs, xd_by_block, xs_by_block, xl, out = args
    for task in prange((n_out + ROWS_PER_TASK - 1) // ROWS_PER_TASK):
        r0 = task * ROWS_PER_TASK
        _rows(
            code,
            raw,
            row_bytes,
            r0,
            min(r0 + ROWS_PER_TASK, n_out),
            xq,
            xd,
            xs,
            xd_by_block,
            xs_by_block,
            xl,
            out,
        )


_matmul_by_code = _by_code(_serial_for, _parallel_for, _QUANT_CODES)


@njit
def _matmul(
    codes, code, parallel, raw, row_bytes, n_out, xq, xd, xs, xd_by_block, xs_by_block, xl, out
):  # pragma: no cover - compiled
    """One product of a quantized weight (kernel ``code``, one of ``codes``)."""
    _matmul_by_code(
        codes,
        code,
        parallel,
        (raw, row_bytes, n_out, xq, xd, xs, xd_by_block, xs_by_block, xl, out),
    )


PARALLEL_MIN_MACS = 1 << 18  # below this many multiply-adds one thread is faster


@njit
def _one_row_rows(code, raw, r0, r1, q, d, s, out):  # pragma: no cover - compiled
    """out[0, r0:r1] for one activation row (``code`` a literal): one weight row at a time
    (1x1 tiles, ggml's vec_dot itself). A decode step's weights stream from memory, and there
    the 4x1 tiles of _rows were slower: the default model's 120 layer products took 7.6-8.6 ms
    of one thread's CPU in 1x1 tiles against 10.2-12.9 in 4x1, its Q8_0 output product 2.3-3.0
    against 4.6-5.1 ms (ggml's own: 2.8). Each output's arithmetic is the same in either."""
    n_in = q.shape[1]
    nb = n_in // QK
    row_bytes = raw.shape[1]
    n_out = out.shape[1]
    for r in range(r0, r1):
        _tile_at(code, 11, raw, r * row_bytes, row_bytes, q, 0, n_in, d, s, 0, nb, out, r, n_out)


@njit
def _one_row_serial(code, args):  # pragma: no cover - compiled
    raw, q, d, s, out = args
    _one_row_rows(code, raw, 0, out.shape[1], q, d, s, out)


@njit(parallel=True)
def _one_row_parallel(code, args):  # pragma: no cover - compiled
    raw, q, d, s, out = args
    n_out = out.shape[1]
    for task in prange((n_out + ROWS_PER_TASK - 1) // ROWS_PER_TASK):
        r0 = task * ROWS_PER_TASK
        _one_row_rows(code, raw, r0, min(r0 + ROWS_PER_TASK, n_out), q, d, s, out)


_one_row_by_code = _by_code(_one_row_serial, _one_row_parallel, _QUANT_CODES)


@njit
def _one_row(codes, code, parallel, raw, n_out, x, table):  # pragma: no cover - compiled
    """One activation row: its rounding and the product in one call from Python. A decode step
    makes ~120 products, and building an Activation and passing a dozen arrays into _matmul cost
    tens of microseconds each from Python."""
    out = numpy.empty((1, n_out), numpy.float32)
    row_product(codes, code, parallel, raw, x, table, out)
    return out


# ---------------------------------------------------------------------------------------------
# F16 and F32 weights: no integer part, the f32 fma chains and their reduction differ by path
#
# One activation row (or a row count not a multiple of 4): ggml_vec_dot_f16/f32 (vec.cpp), four
# <8 x float> accumulators taking the 8-element steps in turn, reduced by GGML_F32x8_REDUCE:
# (x0+x2)+(x1+x3), then t = lo128 + hi128, then (t0+t1)+(t2+t3). Two or more activation rows:
# llamafile's tinyBLAS (sgemm.cpp), one accumulator over all steps and hsum. For F16 weights the
# activation is first rounded to f16 (vec_dot_type F16, round to nearest even).


def _f32x8_reduce(builder: ir.IRBuilder, accs: list) -> ir.Value:
    """GGML_F32x8_REDUCE of four accumulators (AVX)."""
    y = builder.fadd(builder.fadd(accs[0], accs[2]), builder.fadd(accs[1], accs[3]))
    a = [builder.extract_element(y, ir.Constant(_I32, i)) for i in range(8)]
    t = [builder.fadd(a[i], a[i + 4]) for i in range(4)]
    return builder.fadd(builder.fadd(t[0], t[1]), builder.fadd(t[2], t[3]))


def _make_float_tile(half: bool, rm: int, rn: int, split: bool):
    """tile(w, w_off, row_elems, x, x_off, n_in, out, o_off, n_out): weight row i at element
    w_off + i*row_elems of w (raw bytes of f16 or f32 values), activation row j at x_off + j*n_in
    of x (f32, already rounded to f16 values for F16 weights); (i, j) to out.flat[o_off + j*n_out + i].
    ``split``: vec_dot's four accumulators; else tinyBLAS's one."""
    n_acc = 4 if split else 1
    wty = ir.HalfType() if half else _F32

    @intrinsic
    def tile(typingctx, w, w_off, row_elems, x, x_off, n_in, out, o_off, n_out):
        sig = types.void(w, w_off, row_elems, x, x_off, n_in, out, o_off, n_out)

        def codegen(context, builder, signature, args):
            aty = signature.args
            (_, w_off, row_elems, _, x_off, n_in, _, o_off, n_out) = args
            wdata = _data(context, builder, aty[0], args[0])
            wbase = builder.bitcast(wdata, wty.as_pointer())
            xbase = _data(context, builder, aty[3], args[3])
            obase = _data(context, builder, aty[6], args[6])
            ity = w_off.type

            def const(v: int) -> ir.Value:
                return ir.Constant(ity, v)

            def load8(base: ir.Value, index: ir.Value, elem: ir.Type) -> ir.Value:
                ptr = builder.bitcast(
                    builder.gep(base, [index]), ir.VectorType(elem, 8).as_pointer()
                )
                vec = builder.load(ptr, align=1)
                return builder.fpext(vec, _V8F) if elem is not _F32 else vec

            zero = ir.Constant(_V8F, [0.0] * 8)
            acc = [
                [
                    [cgutils.alloca_once_value(builder, zero) for _ in range(n_acc)]
                    for _ in range(rn)
                ]
                for _ in range(rm)
            ]
            with cgutils.for_range(builder, builder.udiv(n_in, const(32))) as loop:
                base = builder.mul(loop.index, const(32))
                for k in range(4):
                    step = builder.add(base, const(8 * k))
                    wv = [
                        load8(
                            wbase,
                            builder.add(builder.add(w_off, builder.mul(const(i), row_elems)), step),
                            wty,
                        )
                        for i in range(rm)
                    ]
                    xv = [
                        load8(
                            xbase,
                            builder.add(builder.add(x_off, builder.mul(const(j), n_in)), step),
                            _F32,
                        )
                        for j in range(rn)
                    ]
                    for i in range(rm):
                        for j in range(rn):
                            slot = acc[i][j][k % n_acc]
                            fma = _call(
                                builder, "llvm.fma.v8f32", _V8F, [wv[i], xv[j], builder.load(slot)]
                            )
                            builder.store(fma, slot)
            for i in range(rm):
                for j in range(rn):
                    sums = [builder.load(a) for a in acc[i][j]]
                    total = _f32x8_reduce(builder, sums) if split else _hsum(builder, sums[0])
                    index = builder.add(builder.add(o_off, builder.mul(const(j), n_out)), const(i))
                    builder.store(total, builder.gep(obase, [index]))
            return context.get_dummy_value()

        return sig, codegen

    return tile


_vd11_f16, _vd21_f16 = _make_float_tile(True, 1, 1, True), _make_float_tile(True, 2, 1, True)
_vd11_f32, _vd21_f32 = _make_float_tile(False, 1, 1, True), _make_float_tile(False, 2, 1, True)
_tb11_f16, _tb22_f16 = _make_float_tile(True, 1, 1, False), _make_float_tile(True, 2, 2, False)
_tb11_f32, _tb22_f32 = _make_float_tile(False, 1, 1, False), _make_float_tile(False, 2, 2, False)


# BF16 weights (vec_dot_type BF16). The activation is rounded to bf16 (ggml_cpu_fp32_to_bf16: a
# scalar loop of ggml_compute_fp32_to_bf16, nearest even, NaN kept quiet); bf16 widens exactly to
# f32 (the 16 bits shifted up), so both operands are f32 values with 8-bit significands and each
# product is exact short of underflow. One activation row (or n_out not a multiple of 4):
# ggml_vec_dot_bf16's AVX2 branch, four <8 x float> accumulators over steps of 32 (GCC contracts
# its add(mul(..), c) into vfmadd231ps: checked in vec.cpp.o), (c1+c3)+(c2+c4), then hi128+lo128,
# movehl, movehdup: hsum_float_8's order, not GGML_F32x8_REDUCE's. That f32 goes into a double
# sum (``ggml_float sumf``) that adds each tail element's f32 product, and the double is rounded
# to f32 at the end. Two or more rows: tinyBLAS<8, __m256, __m256, ggml_bf16_t, ggml_bf16_t>,
# one accumulator over steps of 8, a last partial step on zero-padded vectors (load_partial),
# then hsum.


def bf16_round(x: numpy.ndarray) -> numpy.ndarray:
    """f32 -> bf16 (ggml_compute_fp32_to_bf16) -> f32 again, exactly: the values the kernels read."""
    u = numpy.ascontiguousarray(x, dtype=numpy.float32).view(numpy.uint32)
    nan = (u & numpy.uint32(0x7FFFFFFF)) > numpy.uint32(0x7F800000)
    rounded = u + (
        numpy.uint32(0x7FFF) + ((u >> numpy.uint32(16)) & numpy.uint32(1))
    )  # nearest even
    bits = numpy.where(nan, u | numpy.uint32(0x00400000), rounded) & numpy.uint32(
        0xFFFF0000
    )  # NaN: quiet
    return bits.view(numpy.float32)


def _bf16_widen(builder: ir.IRBuilder, halves: ir.Value) -> ir.Value:
    """<8 x i16> bf16 -> <8 x float>: vpmovzxwd then vpslld 16 (exact)."""
    wide = builder.shl(builder.zext(halves, _V8I32), ir.Constant(_V8I32, [16] * 8))
    return builder.bitcast(wide, _V8F)


def _make_bf16_tile(rm: int, rn: int, split: bool):
    """tile(w, w_off, row_elems, x, x_off, n_in, out, o_off, n_out) as ``_make_float_tile``, for
    BF16 weights (raw bytes, offsets in bf16 elements) and an activation already rounded to
    bf16 values; any n_in. ``split``: ggml_vec_dot_bf16's arithmetic; else tinyBLAS's."""
    step = 32 if split else 8  # elements per loop iteration
    n_acc = 4 if split else 1
    v8i16 = ir.VectorType(_I16, 8)

    @intrinsic
    def tile(typingctx, w, w_off, row_elems, x, x_off, n_in, out, o_off, n_out):
        sig = types.void(w, w_off, row_elems, x, x_off, n_in, out, o_off, n_out)

        def codegen(context, builder, signature, args):
            aty = signature.args
            (_, w_off, row_elems, _, x_off, n_in, _, o_off, n_out) = args
            wdata = _data(context, builder, aty[0], args[0])
            wbase = builder.bitcast(wdata, _I16.as_pointer())
            xbase = _data(context, builder, aty[3], args[3])
            obase = _data(context, builder, aty[6], args[6])
            ity = w_off.type

            def const(v: int) -> ir.Value:
                return ir.Constant(ity, v)

            w_rows = [builder.add(w_off, builder.mul(const(i), row_elems)) for i in range(rm)]
            x_rows = [builder.add(x_off, builder.mul(const(j), n_in)) for j in range(rn)]

            def w_vec(i: int, at: ir.Value) -> ir.Value:
                return _bf16_widen(
                    builder, _load(builder, wbase, builder.add(w_rows[i], at), v8i16)
                )

            def x_vec(j: int, at: ir.Value) -> ir.Value:
                return _load(builder, xbase, builder.add(x_rows[j], at), _V8F)

            zero = ir.Constant(_V8F, [0.0] * 8)
            acc = [
                [
                    [cgutils.alloca_once_value(builder, zero) for _ in range(n_acc)]
                    for _ in range(rn)
                ]
                for _ in range(rm)
            ]

            def madd(i: int, j: int, k: int, wv: ir.Value, xv: ir.Value) -> None:
                slot = acc[i][j][k]
                builder.store(
                    _call(builder, "llvm.fma.v8f32", _V8F, [wv, xv, builder.load(slot)]), slot
                )

            whole = builder.udiv(n_in, const(step))
            with cgutils.for_range(builder, whole) as loop:
                base = builder.mul(loop.index, const(step))
                for k in range(step // 8):
                    at = builder.add(base, const(8 * k))
                    wv, xv = [w_vec(i, at) for i in range(rm)], [x_vec(j, at) for j in range(rn)]
                    for i in range(rm):
                        for j in range(rn):
                            madd(i, j, k, wv[i], xv[j])
            done = builder.mul(whole, const(step))
            if split:
                totals = _vec_dot_tails(builder, wbase, xbase, w_rows, x_rows, done, n_in, acc)
            else:
                _tinyblas_partial_step(builder, wbase, xbase, w_rows, x_rows, done, n_in, madd)
                totals = [
                    [_hsum(builder, builder.load(acc[i][j][0])) for j in range(rn)]
                    for i in range(rm)
                ]
            for i in range(rm):
                for j in range(rn):
                    index = builder.add(builder.add(o_off, builder.mul(const(j), n_out)), const(i))
                    builder.store(totals[i][j], builder.gep(obase, [index]))
            return context.get_dummy_value()

        return sig, codegen

    return tile


def _vec_dot_tails(
    builder: ir.IRBuilder,
    wbase: ir.Value,
    xbase: ir.Value,
    w_rows: list,
    x_rows: list,
    done: ir.Value,
    n_in: ir.Value,
    acc: list,
) -> list:
    """ggml_vec_dot_bf16 after its vector loop: ``sumf = 0.0 + (double)reduce(c1..c4)``, then
    ``sumf += (double)(x[i]*y[i])`` (an f32 product) per tail element, ``*s = (float)sumf``."""
    f64 = ir.DoubleType()
    sums = [
        [
            cgutils.alloca_once_value(
                builder,
                builder.fadd(
                    ir.Constant(f64, 0.0),
                    builder.fpext(
                        _hsum(builder, _pair_sum(builder, [builder.load(a) for a in acc[i][j]])),
                        f64,
                    ),
                ),
            )
            for j in range(len(x_rows))
        ]
        for i in range(len(w_rows))
    ]
    with cgutils.for_range_slice(builder, done, n_in, ir.Constant(n_in.type, 1)) as (at, _):
        ws = [
            builder.bitcast(
                builder.shl(
                    builder.zext(builder.load(builder.gep(wbase, [builder.add(r, at)])), _I32),
                    ir.Constant(_I32, 16),
                ),
                _F32,
            )
            for r in w_rows
        ]
        xs = [builder.load(builder.gep(xbase, [builder.add(r, at)])) for r in x_rows]
        for i, wi in enumerate(ws):
            for j, xj in enumerate(xs):
                slot = sums[i][j]
                builder.store(
                    builder.fadd(builder.load(slot), builder.fpext(builder.fmul(wi, xj), f64)), slot
                )
    return [[builder.fptrunc(builder.load(s), _F32) for s in row] for row in sums]


def _pair_sum(builder: ir.IRBuilder, c: list) -> ir.Value:
    """ggml_vec_dot_bf16's (c1 + c3) + (c2 + c4) of its four accumulators."""
    return builder.fadd(builder.fadd(c[0], c[2]), builder.fadd(c[1], c[3]))


def _tinyblas_partial_step(
    builder: ir.IRBuilder,
    wbase: ir.Value,
    xbase: ir.Value,
    w_rows: list,
    x_rows: list,
    done: ir.Value,
    n_in: ir.Value,
    madd,
) -> None:
    """tinyBLAS's last step when n_in % 8 != 0: load_partial gives vectors whose missing lanes
    are zero, and every accumulator still takes the fma (fma(0, 0, -0) is +0, as in ggml)."""
    rem = builder.sub(n_in, done)
    with builder.if_then(builder.icmp_unsigned("!=", rem, ir.Constant(rem.type, 0))):

        def padded(base: ir.Value, row: ir.Value, elem: ir.Type) -> ir.Value:
            slot = cgutils.alloca_once(builder, ir.VectorType(elem, 8))
            builder.store(
                ir.Constant(slot.type.pointee, [0] * 8 if elem is _I16 else [0.0] * 8), slot
            )
            lanes = builder.bitcast(slot, elem.as_pointer())
            with cgutils.for_range(builder, rem) as lane:
                value = builder.load(
                    builder.gep(base, [builder.add(builder.add(row, done), lane.index)])
                )
                builder.store(value, builder.gep(lanes, [lane.index]))
            return builder.load(slot)

        wv = [_bf16_widen(builder, padded(wbase, r, _I16)) for r in w_rows]
        xv = [padded(xbase, r, _F32) for r in x_rows]
        for i in range(len(w_rows)):
            for j in range(len(x_rows)):
                madd(i, j, 0, wv[i], xv[j])


_vd11_bf16, _vd21_bf16 = _make_bf16_tile(1, 1, True), _make_bf16_tile(2, 1, True)
_tb11_bf16, _tb22_bf16 = _make_bf16_tile(1, 1, False), _make_bf16_tile(2, 2, False)


# kernel code -> its tiles: vec_dot's one and two weight rows, tinyBLAS's 1x1 and 2x2
_FLOAT_TILES = {
    _F16: (_vd11_f16, _vd21_f16, _tb11_f16, _tb22_f16),
    _F32_CODE: (_vd11_f32, _vd21_f32, _tb11_f32, _tb22_f32),
    _BF16: (_vd11_bf16, _vd21_bf16, _tb11_bf16, _tb22_bf16),
}


def _float_tile(code, split, shape, raw, row_elems, r, x, t, out):  # pragma: no cover
    """Outputs (t.., r..) of one F16/F32/BF16 tile (vec_dot's or tinyBLAS's order by ``split``),
    ``code`` a compile-time constant. Compiled code only: the body is ``_float_tile_for``'s."""
    raise TypeError("exact_matmul._float_tile runs in compiled code only")


@overload(_float_tile, prefer_literal=True)
def _float_tile_for(code, split, shape, raw, row_elems, r, x, t, out):
    """_float_tile's body with the tiles of ``code`` alone (None, so no match, for a code that
    is not a constant: its caller is then compiled once per code, as the quantized kernels)."""
    key = _literal_key(code)
    if key is None or key[0] not in _FLOAT_TILES:
        return None
    vd11, vd21, tb11, tb22 = _FLOAT_TILES[key[0]]

    def body(code, split, shape, raw, row_elems, r, x, t, out):  # pragma: no cover - compiled
        n_in = x.shape[1]
        n_out = out.shape[1]
        w, xo, o = r * row_elems, t * n_in, t * n_out + r
        if split and shape == 21:
            vd21(raw, w, row_elems, x, xo, n_in, out, o, n_out)
        elif split:
            vd11(raw, w, row_elems, x, xo, n_in, out, o, n_out)
        elif shape == 22:
            tb22(raw, w, row_elems, x, xo, n_in, out, o, n_out)
        else:
            tb11(raw, w, row_elems, x, xo, n_in, out, o, n_out)

    return body


@njit
def _float_rows(code, split, raw, row_elems, r0, r1, x, out):  # pragma: no cover - compiled
    """out[:, r0:r1] for F16/F32 weights: vec_dot pairs of rows, or tinyBLAS 2x2 tiles."""
    m = x.shape[0]
    if split:
        for t in range(m):
            r = r0
            while r < r1:
                pair = r + 2 <= r1
                _float_tile(code, True, 21 if pair else 11, raw, row_elems, r, x, t, out)
                r += 2 if pair else 1
        return
    t = 0
    while t < m:
        rn = 2 if t + 2 <= m else 1
        r = r0
        while r < r1:
            if rn == 2 and r + 2 <= r1:
                _float_tile(code, False, 22, raw, row_elems, r, x, t, out)
                r += 2
            else:
                for j in range(rn):
                    _float_tile(code, False, 11, raw, row_elems, r, x, t + j, out)
                r += 1
        t += rn


@njit
def _float_serial(code, args):  # pragma: no cover - compiled
    split, raw, row_elems, n_out, x, out = args
    for r0 in range(0, n_out, ROWS_PER_TASK):
        _float_rows(code, split, raw, row_elems, r0, min(r0 + ROWS_PER_TASK, n_out), x, out)


@njit(parallel=True)
def _float_parallel(code, args):  # pragma: no cover - compiled
    split, raw, row_elems, n_out, x, out = args
    for task in prange((n_out + ROWS_PER_TASK - 1) // ROWS_PER_TASK):
        r0 = task * ROWS_PER_TASK
        _float_rows(code, split, raw, row_elems, r0, min(r0 + ROWS_PER_TASK, n_out), x, out)


_float_by_code = _by_code(_float_serial, _float_parallel, _FLOAT_CODES)


@njit
def _float_product(
    codes, code, parallel, split, raw, row_elems, n_out, x, out
):  # pragma: no cover - compiled
    """One product of an F16/F32/BF16 weight (kernel ``code``, one of ``codes``), x already
    rounded to its vec_dot type; ``split``: vec_dot's path, else tinyBLAS's."""
    _float_by_code(codes, code, parallel, (split, raw, row_elems, n_out, x, out))


@njit
def _round_for_float(code, x):  # pragma: no cover - compiled
    """The activation as F16/BF16 weights' vec_dot type holds it (F32: x itself), as
    QuantMatrix._float_matmul rounds it."""
    if code == _F32_CODE:
        return x
    out = numpy.empty_like(x)
    flat, dst = x.reshape(-1), out.reshape(-1)
    if code == _F16:
        for i in range(flat.shape[0]):
            dst[i] = f16_round(flat[i])
        return out
    bits, rounded = flat.view(numpy.uint32), dst.view(numpy.uint32)
    for i in range(flat.shape[0]):  # bf16_round, one element at a time
        u = numpy.int64(bits[i])
        if (u & 0x7FFFFFFF) > 0x7F800000:
            rounded[i] = numpy.uint32((u | 0x00400000) & 0xFFFF0000)  # NaN: quiet
        else:
            rounded[i] = numpy.uint32((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000)
    return out


@njit
def row_product(codes, code, parallel, raw, x, table, out):  # pragma: no cover - compiled
    """out [1, n_out] = one activation row x [1, n_in] (f32, C-contiguous) times the matrix whose
    GGUF block rows are ``raw`` (kernel ``code``: QuantMatrix._kind), as QuantMatrix.matmul
    computes it for one row: quantized weights round x to q8 blocks and take the 4x1 tiles,
    F16/F32/BF16 weights round x to their vec_dot type and take vec_dot's path. The callable
    piece of the fused decode step (exact_decode). ``codes``: the code_set of the codes it may
    be given (a model's, in the fused step), whose kernels alone are compiled."""
    n_out = out.shape[1]
    if code >= _F16:
        kernel_x = _round_for_float(code, x)
        _float_by_code(codes, code, parallel, (True, raw, x.shape[1], n_out, kernel_x, out))
        return
    q, d16, s16, d, s = _quantize_serial(x, table)
    _one_row_by_code(codes, code, parallel, (raw, q, d, s, out))


class BlockRows:
    """What the exact matrix classes share: a [n_out, n_in] weight in GGUF block rows, with
    ``qtype``, ``repacked`` and ``raw`` (uint8 [n_out, row bytes]); ``stack`` is the class that
    runs parts of different types or layouts side by side."""

    qtype: T
    repacked: bool
    raw: numpy.ndarray
    n_out: int
    n_in: int
    stack: type

    @classmethod
    def concat(cls, parts: list) -> object:
        """Rows of several matrices of one input width stacked (Q/K/V, gate/up): the products
        side by side. Same type and layout: one matrix (the bytes copied once; repacked parts
        keep row counts that are multiples of 8, so the whole stays repacked). Otherwise the
        class's ``stack``, which runs each part's own kernel."""
        first = parts[0]
        if any(p.n_in != first.n_in for p in parts):
            raise ValueError("concatenated matrices must share the input width")
        if any((p.qtype, p.repacked) != (first.qtype, first.repacked) for p in parts):
            return cls.stack(parts)
        raw = numpy.concatenate([p.raw for p in parts])
        return cls(raw, first.qtype, raw.shape[0], first.n_in, first.repacked)


class QuantMatrix(BlockRows):
    """A GGUF weight matrix [n_out, n_in] kept in its block bytes; ``matmul`` is ggml's mul_mat.

    ``raw`` is the tensor's data as gguf's ReaderTensor gives it (uint8 [n_out, row_bytes], or
    any shape with that many bytes); it is used without a copy when already contiguous uint8.
    ``repacked``: compute as llama-server does after its CPU_REPACK buffer interleaved the
    matrix (see ``repacked_by_llama_server``); the bytes stay in GGUF order here.
    """

    def __init__(
        self, raw: numpy.ndarray, qtype: T | int, n_out: int, n_in: int, repacked: bool = False
    ):
        qtype = T(qtype)
        if not supported(qtype):
            raise ValueError(f"no exact kernel for {qtype.name}")
        if repacked and qtype not in REPACKED_TYPES:
            raise ValueError(f"llama-server does not repack {qtype.name} on AVX2")
        if n_in % QK and qtype not in _ANY_WIDTH:
            raise ValueError(f"n_in={n_in} is not a multiple of {QK}")
        kind, block_bytes, q8_1 = _LAYOUT[qtype]
        row_bytes = n_in * block_bytes // QK
        data = numpy.ascontiguousarray(raw).view(numpy.uint8)
        if data.size != n_out * row_bytes:
            raise ValueError(
                f"{qtype.name} [{n_out}, {n_in}] needs {n_out * row_bytes} bytes, got {data.size}"
            )
        self.raw = data.reshape(n_out, row_bytes)
        self.qtype, self.n_out, self.n_in, self.repacked = qtype, n_out, n_in, repacked
        self._kind = _Q4_0R if repacked else kind
        self._codes = code_set([self._kind])  # this matrix's kernels alone are compiled

    def quantize(self, x: numpy.ndarray) -> Activation:
        """The activation rounded as ggml rounds it for this weight (reusable across matrices)."""
        if self.qtype in _FLOAT_TYPES:
            raise ValueError(f"{self.qtype.name} weights take the f32 activation itself")
        return Activation(x)

    def matmul(self, x: numpy.ndarray | Activation) -> numpy.ndarray:
        """x [m, n_in] f32 (or its Activation) -> [m, n_out] f32, bit-identical to ggml."""
        if self.qtype in _FLOAT_TYPES:
            return self._float_matmul(x)
        if (
            not isinstance(x, Activation)
            and numpy.ndim(x) <= 2
            and numpy.shape(x)[-1:] == (self.n_in,)
            and numpy.size(x) == self.n_in
        ):  # one row (a decode step): one compiled call
            row = numpy.ascontiguousarray(x, dtype=numpy.float32).reshape(1, self.n_in)
            return _one_row(
                self._codes,
                self._kind,
                self.n_out * self.n_in >= PARALLEL_MIN_MACS,
                self.raw,
                self.n_out,
                row,
                F16_TABLE,
            )
        act = x if isinstance(x, Activation) else Activation(numpy.atleast_2d(x))
        if act.q.shape[1] != self.n_in:
            raise ValueError(f"activation width {act.q.shape[1]} != n_in {self.n_in}")
        m = act.q.shape[0]
        out = numpy.empty((m, self.n_out), numpy.float32)
        parallel = m * self.n_out * self.n_in >= PARALLEL_MIN_MACS
        lanes = _NO_LANES
        if m >= LANE_ROWS and self._kind != _Q4_0R:
            biased = HOST_HAS_VNNI and self._kind not in (_Q4_1, _Q5_1)
            lanes = act.biased_lanes if biased else act.lanes
        _matmul(
            self._codes,
            self._kind,
            parallel,
            self.raw,
            self.raw.shape[1],
            self.n_out,
            act.q,
            act.d,
            act.s,
            act.d_by_block,
            act.s_by_block,
            lanes,
            out,
        )
        return out

    def _float_matmul(self, x: numpy.ndarray) -> numpy.ndarray:
        x = numpy.ascontiguousarray(numpy.atleast_2d(x), dtype=numpy.float32)
        if x.ndim != 2 or x.shape[1] != self.n_in:
            raise ValueError(f"activation width {x.shape[-1]} != n_in {self.n_in}")
        if self.qtype == T.F16:  # vec_dot_type F16: ggml_cpu_fp32_to_fp16, nearest even
            x = x.astype(numpy.float16).astype(numpy.float32)
        elif self.qtype == T.BF16:  # vec_dot_type BF16: ggml_cpu_fp32_to_bf16
            x = bf16_round(x)
        m = x.shape[0]
        # tinyBLAS takes two or more activation rows when the weight rows come in fours
        split = m == 1 or self.n_out % 4 != 0
        out = numpy.empty((m, self.n_out), numpy.float32)
        parallel = m * self.n_out * self.n_in >= PARALLEL_MIN_MACS
        _float_product(
            self._codes, self._kind, parallel, split, self.raw, self.n_in, self.n_out, x, out
        )
        return out


class MatrixStack:
    """Matrices of different types (or layouts) over one input, used as one: ``matmul`` gives
    their outputs side by side, rounding the activation once for all the quantized parts."""

    def __init__(self, parts: list[QuantMatrix]):
        self.parts = list(parts)
        self.n_in = parts[0].n_in
        self.n_out = sum(p.n_out for p in parts)

    def matmul(self, x: numpy.ndarray) -> numpy.ndarray:
        x = numpy.atleast_2d(numpy.asarray(x, dtype=numpy.float32))
        quantized = [p for p in self.parts if p.qtype not in _FLOAT_TYPES]
        act = Activation(x) if quantized else None
        return numpy.concatenate(
            [p.matmul(x if p.qtype in _FLOAT_TYPES else act) for p in self.parts], axis=1
        )


QuantMatrix.stack = MatrixStack
