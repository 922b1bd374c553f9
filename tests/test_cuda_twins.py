"""The NumPy twins of the CUDA kernels (bankml/engine_cupy/cuda_twins.py), on the CPU.

Each product is checked in its three parts: the integer dot products equal a direct unpacking
of the GGUF blocks (nibbles, fifth bits, int8) times the q8_1 quants; the float reduction
follows the order the module documents (a loop over threads written here, bit for bit); and the
whole product lies within the error the q8_1 activation and the f16 scales allow of the
dequantized f32 product, computed term by term. Matrices: generated ones of every type
(gguf's quantizers, as tests/tiny_models.py writes them) and the default model's own (Q4_1
layers, the Q8_0 embedding). What only a GPU can show is that the kernels compute what their
twins do (docs/modules/cuda_twins.md).
"""

from __future__ import annotations

import numpy
import pytest
from gguf import GGMLQuantizationType as T

from bankml.engine_cupy import cuda_kernels
from bankml.engine_cupy import cuda_twins as tw
from bankml.engine_cupy.gguf_file import open_file
from bankml.engine_cupy.weights import dequantize
from tests.fake_cupy_kernels import _POINTER_TYPES, KernelCupy
from tests.tiny_models import _matrix

TYPES = tuple(tw.BLOCK_TYPES)
LEGACY = tuple(q for q in TYPES if q not in tw.K_QUANTS)
F32 = numpy.float32


def _generated(qtype: str, rows: int = 96, cols: int = 512, seed: int = 0) -> numpy.ndarray:
    data, _ = _matrix(numpy.random.default_rng(seed), rows, cols, T[qtype], 0.05)
    return data


@pytest.fixture(scope="module")
def model_matrices(default_model) -> list[tuple[str, str, numpy.ndarray]]:
    """(name, type, rows of blocks): two Q4_1 layers' matrices and the Q8_0 embedding's first
    2048 rows."""
    f = open_file(default_model)
    wanted = ("blk.0.ffn_down.weight", "blk.0.attn_q.weight", "token_embd.weight")
    out = []
    for t in f.tensors:
        if t.name in wanted:
            out.append((t.name, t.tensor_type.name, numpy.array(t.data[:2048])))
    assert sorted(n for n, _, _ in out) == sorted(wanted)
    return out


def _activation(cols: int, seed: int = 1) -> numpy.ndarray:
    rng = numpy.random.default_rng(seed)
    x = rng.normal(0.0, 1.0, cols).astype(F32)
    x[:32] *= F32(40)  # blocks of very different scales
    x[32:64] = 0  # and an all-zero block (d = 0)
    return x


# --- direct unpacking (independent of the twin's word masks) -----------------------------------


def _quants(qtype: str, w: numpy.ndarray) -> numpy.ndarray:
    """The unsigned (int8 for Q8_0) quants of every block, [rows, blocks, 32], in value order."""
    bt = tw.BLOCK_TYPES[qtype]
    b = w.reshape(w.shape[0], -1, bt.block_bytes)
    if qtype == "Q8_0":
        return b[..., 2:].view(numpy.int8).astype(numpy.int32)
    qs_at = {"Q4_0": 2, "Q4_1": 4, "Q5_0": 6, "Q5_1": 8}[qtype]
    qs = b[..., qs_at : qs_at + 16].astype(numpy.int32)
    q = numpy.concatenate([qs & 15, qs >> 4], axis=-1)
    if qtype in ("Q5_0", "Q5_1"):
        hi_at = 2 if qtype == "Q5_0" else 4
        qh = b[..., hi_at : hi_at + 4].astype(numpy.uint32)
        bits = qh[..., 0] | qh[..., 1] << 8 | qh[..., 2] << 16 | qh[..., 3] << 24
        q |= (((bits[..., None] >> numpy.arange(32, dtype=numpy.uint32)) & 1) << 4).astype(
            numpy.int32
        )
    return q


def _slot_of_value(qtype: str) -> numpy.ndarray:
    """Which thread slot of a block multiplies each of its 32 values."""
    bt = tw.BLOCK_TYPES[qtype]
    j = numpy.arange(32)
    word = j // 4 if qtype == "Q8_0" else (j % 16) // 4
    return word // bt.vdr


def _direct_sumi(qtype: str, w: numpy.ndarray, y: tw.Q8_1) -> numpy.ndarray:
    prod = _quants(qtype, w) * y.qs.astype(numpy.int32)[None]
    slots = _slot_of_value(qtype)
    bt = tw.BLOCK_TYPES[qtype]
    return numpy.stack([prod[..., slots == s].sum(-1) for s in range(bt.slots)], axis=-1)


def _q4_k_scales(b: numpy.ndarray) -> tuple[numpy.ndarray, numpy.ndarray]:
    """ggml's get_scale_min_k4 for j = 0..7, one sub-block at a time."""
    q = b[..., 4:16].astype(numpy.int32)
    sc, m = [], []
    for j in range(8):
        if j < 4:
            sc.append(q[..., j] & 63)
            m.append(q[..., j + 4] & 63)
        else:
            sc.append((q[..., j + 4] & 0xF) | ((q[..., j - 4] >> 6) << 4))
            m.append((q[..., j + 4] >> 4) | ((q[..., j] >> 6) << 4))
    return numpy.stack(sc, -1), numpy.stack(m, -1)


def _q3_k_scales(b: numpy.ndarray) -> numpy.ndarray:
    """Q3_K's 16 signed 6-bit scales as ggml's dequantize_row_q3_K unpacks them (its aux words
    and masks), int32 [rows, blocks, 16]."""
    aux = numpy.ascontiguousarray(b[..., 96:108]).view("<u4").copy()  # [rows, blocks, 3]
    k1, k2 = numpy.uint32(0x03030303), numpy.uint32(0x0F0F0F0F)
    tmp = aux[..., 2]
    words = [
        (aux[..., 0] & k2) | (((tmp >> 0) & k1) << 4),
        (aux[..., 1] & k2) | (((tmp >> 2) & k1) << 4),
        ((aux[..., 0] >> 4) & k2) | (((tmp >> 4) & k1) << 4),
        ((aux[..., 1] >> 4) & k2) | (((tmp >> 6) & k1) << 4),
    ]
    packed = numpy.ascontiguousarray(numpy.stack(words, -1).astype("<u4"))
    return packed.view(numpy.int8).astype(numpy.int32) - 32


def _kquant_values(qtype: str, b: numpy.ndarray) -> numpy.ndarray:
    """The 256 quants of every super-block in value order (ggml's dequantize_row_*)."""
    if qtype in ("Q2_K", "Q3_K"):  # half h, bit pair j, l = 0..31: value 128h + 32j + l
        at = 16 if qtype == "Q2_K" else 32
        qs = b[..., at : at + 64].astype(numpy.int32).reshape(*b.shape[:2], 2, 1, 32)
        j = numpy.arange(4)[:, None]
        q = (qs >> (2 * j)) & 3  # [rows, blocks, 2, 4, 32]
        if qtype == "Q3_K":  # hmask bit 4h + j of byte l clear: minus 4
            hm = b[..., 0:32].astype(numpy.int32)[..., None, None, :]
            bit = 4 * numpy.arange(2)[:, None, None] + j[None]
            q = q - 4 * (1 - ((hm >> bit) & 1))
        return q.reshape(*b.shape[:2], 256)
    if qtype == "Q4_K":
        qs = b[..., 16:144].astype(numpy.int32).reshape(*b.shape[:2], 4, 32)
        return numpy.concatenate([qs & 15, qs >> 4], axis=-1).reshape(*b.shape[:2], 256)
    if qtype == "Q5_K":  # group j: low nibbles + bit 2j of qh, then high nibbles + bit 2j + 1
        qs = b[..., 48:176].astype(numpy.int32).reshape(*b.shape[:2], 4, 32)
        qh = b[..., 16:48].astype(numpy.int32)[..., None, :]  # [rows, blocks, 1, 32]
        j = numpy.arange(4)[:, None]
        lo = (qs & 15) | (((qh >> (2 * j)) & 1) << 4)
        hi = (qs >> 4) | (((qh >> (2 * j + 1)) & 1) << 4)
        return numpy.concatenate([lo, hi], axis=-1).reshape(*b.shape[:2], 256)
    ql, qh = b[..., 0:128].astype(numpy.int32), b[..., 128:192].astype(numpy.int32)
    out = numpy.empty((*b.shape[:2], 256), numpy.int32)
    for h in range(2):
        lo, hi = ql[..., 64 * h : 64 * h + 64], qh[..., 32 * h : 32 * h + 32]
        base = 128 * h
        out[..., base : base + 32] = (lo[..., :32] & 15) | ((hi & 3) << 4)
        out[..., base + 32 : base + 64] = (lo[..., 32:] & 15) | (((hi >> 2) & 3) << 4)
        out[..., base + 64 : base + 96] = (lo[..., :32] >> 4) | (((hi >> 4) & 3) << 4)
        out[..., base + 96 : base + 128] = (lo[..., 32:] >> 4) | (((hi >> 6) & 3) << 4)
    return out - 32


def _kquant_terms(qtype: str) -> list[list[numpy.ndarray]]:
    """For each thread slot and each of its two terms, the values (indices in the super-block)
    it multiplies: Q4_K's two words of a sub-block pair's bytes, Q6_K's four low-bit bytes."""
    terms = []
    if qtype in ("Q2_K", "Q3_K"):
        for s in range(16):  # bytes 32 (s // 8) + 4 (s % 8).. of qs, bit pairs 0..3
            at = 4 * (s % 8) + numpy.arange(4)
            terms.append([128 * (s // 8) + 32 * i + at for i in range(4)])
        return terms
    if qtype in ("Q4_K", "Q5_K"):
        for s in range(16):
            group, word = s // 4, s % 4  # bytes 32*group + 4*word (+16): low nibbles, then high
            at = numpy.r_[4 * word : 4 * word + 4, 16 + 4 * word : 20 + 4 * word]
            terms.append([64 * group + 32 * i + at for i in range(2)])
        return terms
    for s in range(32):
        byte = 4 * s + numpy.arange(4)  # of ql: values byte % 64 (+32 past 32) of its half
        h, within = byte // 64, byte % 64
        low = 128 * h + within % 32 + 32 * (within >= 32)
        terms.append([low, low + 64])
    return terms


def _direct_kquant_ints(
    qtype: str, w: numpy.ndarray, y: tw.Q8_1
) -> tuple[numpy.ndarray, numpy.ndarray]:
    """[rows, blocks, slots, 2, P] as kquant_ints, and the q8_1 block (in the super-block) of
    each term [slots, 2]."""
    bt = tw.BLOCK_TYPES[qtype]
    b = w.reshape(w.shape[0], -1, bt.block_bytes)
    q = _kquant_values(qtype, b)
    y8 = y.qs.astype(numpy.int32).reshape(b.shape[1], 256)
    terms = _kquant_terms(qtype)
    mins = qtype in ("Q2_K", "Q4_K", "Q5_K")
    p = 2 if mins else 1
    out = numpy.empty((*b.shape[:2], len(terms), len(terms[0]), p), numpy.int32)
    q8_block = numpy.empty((len(terms), len(terms[0])), int)
    if qtype == "Q2_K":  # per 16 values: scale in the low nibble, min in the high
        raw = b[..., 0:16].astype(numpy.int32)
        sc16, mn16 = raw & 0xF, raw >> 4
    elif qtype == "Q3_K":
        sc16 = _q3_k_scales(b)
    elif mins:
        sc, mn = _q4_k_scales(b)
    else:
        scales = b[..., 192:208].view(numpy.int8).astype(numpy.int32)
    for s, pair in enumerate(terms):
        for i, at in enumerate(pair):
            assert len(set(at // 32)) == 1  # one q8_1 block per term
            q8_block[s, i] = at[0] // 32
            dot = (q[..., at] * y8[None][..., at]).sum(-1)
            if qtype in ("Q2_K", "Q3_K"):
                assert len(set(at // 16)) == 1  # one scale per term
                out[..., s, i, 0] = dot * sc16[..., at[0] // 16]
                if qtype == "Q2_K":
                    out[..., s, i, 1] = y8[None][..., at].sum(-1) * mn16[..., at[0] // 16]
            elif mins:
                out[..., s, i, 0] = dot * sc[..., at[0] // 32]
                out[..., s, i, 1] = y8[None][..., at].sum(-1) * mn[..., at[0] // 32]
            else:
                assert len(set(at // 16)) == 1  # one scale per term
                out[..., s, i, 0] = dot * scales[..., at[0] // 16]
    return out, q8_block


# --- the activation ----------------------------------------------------------------------------


def test_round_half_away_is_roundf() -> None:
    r = numpy.array([0.5, 1.5, 2.5, -0.5, -2.5, 0.49999997, -126.5, 3.0, -0.0], F32)
    assert tw.round_half_away(r).tolist() == [1, 2, 3, -1, -3, 0, -127, 3, 0]


def test_quantize_q8_1_blocks() -> None:
    x = _activation(576)
    y = tw.quantize_q8_1(x)
    xb = x.reshape(-1, 32)
    q = y.qs.astype(numpy.int32)
    d = numpy.abs(xb).max(axis=1) / F32(127)
    assert (numpy.abs(q).max(axis=1) == numpy.where(d > 0, 127, 0)).all()
    nonzero = d > 0
    assert (numpy.abs(xb[nonzero] / d[nonzero, None] - q[nonzero]) <= 0.5).all()
    assert (q[~nonzero] == 0).all() and (y.d[~nonzero] == 0).all()
    assert (y.d == d.astype(numpy.float16)).all()
    # the sum: the butterfly's f32 value, stored as f16
    sums = numpy.array([numpy.sum(b, dtype=numpy.float64) for b in xb])
    assert numpy.allclose(y.s.astype(numpy.float64), sums, rtol=2**-10, atol=2**-20)
    raw = y.to_bytes().reshape(-1, 36)
    assert (raw[:, 0:2].copy().view("<f2")[:, 0] == y.d).all()
    assert (raw[:, 2:4].copy().view("<f2")[:, 0] == y.s).all()
    assert (raw[:, 4:].view(numpy.int8) == y.qs).all()


def test_butterfly_sum_order() -> None:
    """Lane 0 of the xor butterfly: ((l0 + l16) + (l8 + l24)) + ..., written out as a loop."""
    rng = numpy.random.default_rng(3)
    v = (rng.normal(size=(200, 32)) * numpy.exp2(rng.integers(-20, 20, (200, 32)))).astype(F32)
    expected = []
    for row in v:
        lanes = list(row)
        for offset in (16, 8, 4, 2, 1):
            lanes = [F32(lanes[i] + lanes[i ^ offset]) for i in range(32)]
        expected.append(lanes[0])
    got = tw.butterfly_sum(v)
    assert got.tobytes() == numpy.array(expected, F32).tobytes()
    assert (got != v.sum(axis=1, dtype=F32)).any()  # the order shows in the bits


# --- the integer parts --------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", LEGACY)
def test_integer_dot_products_generated(qtype: str) -> None:
    w = _generated(qtype)
    y = tw.quantize_q8_1(_activation(512))
    sumi = tw.mmvq_sumi(qtype, w, y)
    assert sumi.shape == (96, 16, tw.BLOCK_TYPES[qtype].slots)
    assert numpy.abs(sumi).max() > 1000
    assert numpy.array_equal(sumi, _direct_sumi(qtype, w, y))


@pytest.mark.parametrize("qtype", tw.K_QUANTS)
def test_kquant_integer_terms_generated(qtype: str) -> None:
    w = _generated(qtype, rows=64, cols=1024)
    y = tw.quantize_q8_1(_activation(1024))
    ints = tw.kquant_ints(qtype, w, y)
    direct, _ = _direct_kquant_ints(qtype, w, y)
    assert ints.shape == direct.shape and numpy.abs(ints).max() > 1000
    assert numpy.array_equal(ints, direct)


def test_integer_dot_products_default_model(model_matrices) -> None:
    for name, qtype, w in model_matrices:
        y = tw.quantize_q8_1(_activation(w.shape[1] // tw.BLOCK_TYPES[qtype].block_bytes * 32))
        assert numpy.array_equal(tw.mmvq_sumi(qtype, w, y), _direct_sumi(qtype, w, y)), name


# --- the float order ----------------------------------------------------------------------------


def _reduce_by_threads(contrib: numpy.ndarray, bt: tw.BlockType, nwarps: int) -> numpy.ndarray:
    """The kernel's order, thread by thread (the module doc's recipe, as plain loops)."""
    rows, blocks, slots = contrib.shape
    out = []
    for r in range(rows):
        tmp = [F32(0)] * (32 * nwarps)
        for t in range(32 * nwarps):
            for kbx in range(t // slots, blocks, bt.blocks_per_iter(nwarps)):
                tmp[t] = F32(tmp[t] + contrib[r, kbx, t % slots])
        lanes = tmp[:32]
        for warp in range(1, nwarps):
            lanes = [F32(lanes[i] + tmp[32 * warp + i]) for i in range(32)]
        for offset in (16, 8, 4, 2, 1):
            lanes = [F32(lanes[i] + lanes[i ^ offset]) for i in range(32)]
        out.append(lanes[0])
    return numpy.array(out, F32)


@pytest.mark.parametrize(
    ("qtype", "blocks", "nwarps"),
    [
        ("Q4_1", 150, 4),
        ("Q8_0", 70, 4),
        ("Q5_0", 40, 2),
        ("Q4_K", 20, 4),
        ("Q6_K", 9, 4),
        ("Q2_K", 11, 4),
    ],
)
def test_reduction_order(qtype: str, blocks: int, nwarps: int) -> None:
    bt = tw.BLOCK_TYPES[qtype]
    rng = numpy.random.default_rng(5)
    c = rng.normal(size=(6, blocks, bt.slots)) * numpy.exp2(rng.integers(-12, 12, (6, blocks, 1)))
    c = c.astype(F32)
    got = tw.mmvq_reduce(c, bt, nwarps)
    assert got.tobytes() == _reduce_by_threads(c, bt, nwarps).tobytes()
    assert (got != c.reshape(6, -1).sum(axis=1, dtype=F32)).any()


# --- the products -------------------------------------------------------------------------------


def _error_bound(qtype: str, w: numpy.ndarray, x: numpy.ndarray, y: tw.Q8_1) -> numpy.ndarray:
    """What separates the kernel's product from the f32 one, term by term, per row: each
    value's q8_1 rounding times its weight's quant part, the f16 rounding of the block sums the
    offsets multiply, Q4_1/Q5_1's f16 products, and f32 rounding. The K-quants' offsets (Q4_K's
    mins, Q6_K's 32) multiply the q8 quants too, so their whole weight meets the rounding."""
    if qtype in tw.K_QUANTS:
        return _kquant_error_bound(qtype, w, x, y)
    bt = tw.BLOCK_TYPES[qtype]
    b = w.reshape(w.shape[0], -1, bt.block_bytes)
    d = b[..., 0:2].copy().view("<f2")[..., 0].astype(numpy.float64)
    q = _quants(qtype, w).astype(numpy.float64)
    xb = x.reshape(-1, 32).astype(numpy.float64)
    d8, s8 = y.d.astype(numpy.float64), y.s.astype(numpy.float64)
    x_err = numpy.abs(xb - y.qs * d8[:, None])  # [blocks, 32]
    quant_part = numpy.abs(d[..., None] * q)  # what multiplies the q8 quants
    bound = (quant_part * x_err[None]).sum(axis=(1, 2))
    sum_err = numpy.abs(xb.sum(axis=1) - s8)[None]  # [1, blocks]
    if qtype in ("Q4_0", "Q5_0"):
        bound += ((16 if qtype == "Q5_0" else 8) * d * sum_err).sum(axis=1)
    elif qtype in ("Q4_1", "Q5_1"):
        m = b[..., 2:4].copy().view("<f2")[..., 0].astype(numpy.float64)
        bound += (numpy.abs(m) * sum_err).sum(axis=1)
        sumi = numpy.abs(_direct_sumi(qtype, w, y).sum(axis=-1))
        dd = (b[..., 0:2].copy().view("<f2")[..., 0] * y.d[None]).astype(numpy.float64)
        ms = (b[..., 2:4].copy().view("<f2")[..., 0] * y.s[None]).astype(numpy.float64)
        bound += (sumi * numpy.abs(dd - d * d8[None])).sum(axis=1)
        bound += numpy.abs(ms - m * s8[None]).sum(axis=1)
    magnitude = (quant_part * numpy.abs(xb)[None]).sum(axis=(1, 2))
    return bound + 2**-18 * magnitude + 1e-30


def _kquant_error_bound(
    qtype: str, w: numpy.ndarray, x: numpy.ndarray, y: tw.Q8_1
) -> numpy.ndarray:
    weights = numpy.abs(dequantize(w, T[qtype]).astype(numpy.float64))  # [rows, cols]
    x64 = x.astype(numpy.float64)
    x_err = numpy.abs(
        x64 - (y.qs.astype(numpy.float64) * y.d.astype(numpy.float64)[:, None]).reshape(-1)
    )
    bt = tw.BLOCK_TYPES[qtype]
    b = w.reshape(w.shape[0], -1, bt.block_bytes)
    if qtype == "Q2_K":  # the two parts apart, as Q4_K's
        d = b[..., 80:82].copy().view("<f2")[..., 0].astype(numpy.float64)
        dmin = b[..., 82:84].copy().view("<f2")[..., 0].astype(numpy.float64)
        raw = b[..., 0:16].astype(numpy.float64)
        q = _kquant_values(qtype, b).reshape(*b.shape[:2], 16, 16)
        parts = numpy.abs(d[..., None, None] * (raw % 16)[..., None] * q) + numpy.abs(
            dmin[..., None, None] * (raw // 16)[..., None]
        )
        magnitude = parts.reshape(w.shape[0], -1) @ numpy.abs(x64)
    elif qtype in (
        "Q4_K",
        "Q5_K",
    ):  # the two parts apart: d*scale*q and dmin*min, before they cancel
        d = b[..., 0:2].copy().view("<f2")[..., 0].astype(numpy.float64)
        dmin = b[..., 2:4].copy().view("<f2")[..., 0].astype(numpy.float64)
        sc, mn = _q4_k_scales(b)
        q = _kquant_values(qtype, b).reshape(*b.shape[:2], 8, 32)
        parts = numpy.abs(d[..., None, None] * sc[..., None] * q) + numpy.abs(
            dmin[..., None, None] * mn[..., None]
        )
        magnitude = parts.reshape(w.shape[0], -1) @ numpy.abs(x64)
    else:
        magnitude = weights @ numpy.abs(x64)
    return weights @ x_err + 2**-18 * magnitude + 1e-30


def _same_operands(qtype: str, w: numpy.ndarray, y: tw.Q8_1) -> tuple[numpy.ndarray, numpy.ndarray]:
    """The kernel's formula per block in float64, on the operands it reads (f16 scales, f16
    products for Q4_1/Q5_1, the direct integer sums): the value and the sum of |terms|."""
    bt = tw.BLOCK_TYPES[qtype]
    if qtype in tw.K_QUANTS:
        ints, q8_block = _direct_kquant_ints(qtype, w, y)
        b = w.reshape(w.shape[0], -1, bt.block_bytes)
        d8 = y.d.astype(numpy.float64).reshape(-1, 8)[:, q8_block][None]  # [1, blocks, slots, 2]
        if qtype in ("Q2_K", "Q4_K", "Q5_K"):
            at = 80 if qtype == "Q2_K" else 0
            d = (
                b[..., at : at + 2]
                .copy()
                .view("<f2")[..., 0]
                .astype(numpy.float64)[..., None, None]
            )
            dmin = (
                b[..., at + 2 : at + 4]
                .copy()
                .view("<f2")[..., 0]
                .astype(numpy.float64)[..., None, None]
            )
            terms = (d * d8 * ints[..., 0], -dmin * d8 * ints[..., 1])
        else:
            at = 108 if qtype == "Q3_K" else 208
            d = (
                b[..., at : at + 2]
                .copy()
                .view("<f2")[..., 0]
                .astype(numpy.float64)[..., None, None]
            )
            terms = (d * d8 * ints[..., 0], numpy.zeros(ints.shape[:-1]))
        return (terms[0] + terms[1]).sum(axis=(1, 2, 3)), (
            numpy.abs(terms[0]) + numpy.abs(terms[1])
        ).sum(axis=(1, 2, 3))
    b = w.reshape(w.shape[0], -1, bt.block_bytes)
    dh = b[..., 0:2].copy().view("<f2")[..., 0]
    d = dh.astype(numpy.float64)
    sumi = _direct_sumi(qtype, w, y).sum(axis=-1).astype(numpy.float64)
    d8, s8 = y.d.astype(numpy.float64)[None], y.s.astype(numpy.float64)[None]
    if qtype in ("Q4_0", "Q5_0"):
        offset = 16 if qtype == "Q5_0" else 8
        terms = (d * sumi * d8, -d * offset * s8)
    elif qtype in ("Q4_1", "Q5_1"):
        mh = b[..., 2:4].copy().view("<f2")[..., 0]
        terms = (
            sumi * (dh * y.d[None]).astype(numpy.float64),
            (mh * y.s[None]).astype(numpy.float64),
        )
    else:
        terms = (d * d8 * sumi, numpy.zeros_like(d))
    return (terms[0] + terms[1]).sum(axis=1), (numpy.abs(terms[0]) + numpy.abs(terms[1])).sum(
        axis=1
    )


def _check_product(qtype: str, w: numpy.ndarray, x: numpy.ndarray) -> float:
    y = tw.quantize_q8_1(x)
    got = tw.mmvq(qtype, w, x)
    assert got.dtype == F32 and got.shape == (w.shape[0],)
    # against the same operands: only f32 rounding apart, a few ulps of the terms per addition
    value, magnitude = _same_operands(qtype, w, y)
    bt = tw.BLOCK_TYPES[qtype]
    levels = -(-(w.shape[1] // bt.block_bytes) // bt.blocks_per_iter()) + tw.NWARPS + 5 + 6
    assert (numpy.abs(got - value) <= levels * 2**-24 * magnitude + 1e-30).all(), qtype
    reference = dequantize(w, T[qtype]).astype(numpy.float64) @ x.astype(numpy.float64)
    err = numpy.abs(got - reference)
    bound = _error_bound(qtype, w, x, y)
    assert (err <= bound).all(), (qtype, float((err / bound).max()))
    return float(err.max() / numpy.abs(reference).max())


@pytest.mark.parametrize("qtype", TYPES)
def test_product_generated(qtype: str) -> None:
    for cols in (512, 4096):  # one iteration of the threads, and several
        rel = _check_product(qtype, _generated(qtype, cols=cols), _activation(cols))
        assert rel < 0.05


def test_product_default_model(model_matrices) -> None:
    for _, qtype, w in model_matrices:
        cols = w.shape[1] // tw.BLOCK_TYPES[qtype].block_bytes * 32
        assert _check_product(qtype, w, _activation(cols, seed=7)) < 0.05


def test_twin_takes_a_quantized_activation_and_refuses_mismatched_blocks() -> None:
    w, x = _generated("Q4_0"), _activation(512)
    assert tw.mmvq("Q4_0", w, tw.quantize_q8_1(x)).tobytes() == tw.mmvq("Q4_0", w, x).tobytes()
    with pytest.raises(ValueError, match="q8_1 blocks"):
        tw.mmvq("Q4_0", w, _activation(1024))
    with pytest.raises(ValueError, match="whole blocks"):
        tw.mmvq("Q4_0", w[:, :-1], x)


# --- every kernel has a twin in the stand-in ------------------------------------------------------


def _no_twin(name: str, code: str) -> str | None:
    """Why the strict stand-in cannot run kernel ``name`` of ``code`` (None: it can).

    ``get_function`` only parses the entry point's parameters, so the kernel is launched once
    with placeholder arguments of those types: the stand-in then either refuses a name it has
    no twin for ("no twin for kernel ..."), or fails to look up the type of a product or
    dequantization kernel in the twins' tables (a KeyError), or reaches the twin, which runs or
    rejects the placeholders by its own checks."""
    cp = KernelCupy()
    kernel = cp.RawModule(code=code, options=tuple(cuda_kernels.options())).get_function(name)
    scalars = {"int": numpy.int32, "float": numpy.float32}
    args = tuple(
        cp.asarray(numpy.zeros(256, _POINTER_TYPES[base])) if pointer else scalars[base](1)
        for base, pointer in kernel.params
    )
    try:
        kernel((1,), (32,), args)
    except AssertionError as err:
        if str(err).startswith("no twin for kernel"):
            return str(err)
    except KeyError as err:
        return f"no twin's table holds {err} for kernel {name}"
    except Exception:  # the twin's own refusal of the placeholders
        pass
    return None


def test_every_kernel_has_a_twin_in_the_stand_in() -> None:
    """Each entry of cuda_kernels.KERNELS: its source's entry point found by the stand-in's
    RawModule(...).get_function and its launch reaching a twin; made-up kernels (a name, and types no
    twin knows for a product and a dequantization) are found missing by the same check."""
    assert len({k.name for k in cuda_kernels.KERNELS}) == len(cuda_kernels.KERNELS) > 0
    reasons = {k.name: _no_twin(k.name, k.code()) for k in cuda_kernels.KERNELS}
    missing = {name: why for name, why in reasons.items() if why is not None}
    assert not missing, missing

    made_up = 'extern "C" __global__ void made_up_f32(const float *x, float *y, int n) {}\n'
    mmvq = next(k for k in cuda_kernels.KERNELS if k.name == "mmvq_q4_0").code()
    dequant = next(k for k in cuda_kernels.KERNELS if k.name == "dequantize_f16_q4_0").code()
    fakes = {
        "made_up_f32": made_up,
        "mmvq_q7_k": mmvq.replace("mmvq_q4_0", "mmvq_q7_k"),
        "mmvq_q7_k_rows": mmvq.replace("mmvq_q4_0", "mmvq_q7_k"),
        "dequantize_f16_q7_k": dequant.replace("dequantize_f16_q4_0", "dequantize_f16_q7_k"),
    }
    for name, code in fakes.items():
        why = _no_twin(name, code)
        assert why is not None and name in why, (name, why)
