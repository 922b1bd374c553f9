"""NumPy twins of the CUDA kernels in ``bankml/engine_cupy/cuda/``: the same arithmetic on the CPU.

Each kernel has a twin here that computes what it computes, step for step:

- ``quantize_q8_1(x)``: the activation as q8_1 blocks (``quantize_q8_1.cu``): 32 int8 quants, an
  f16 scale d = amax / 127 and an f16 s = the block's sum of x, the sum added in the kernel's
  butterfly order (lane i + lane i^16, then ^8, ^4, ^2, ^1), q = roundf(x / d) (half away from
  zero).
- ``mmvq(qtype, w, x)``: one row of a quantized matrix times the q8_1 activation
  (``mmvq_<type>.cu``), in three parts the tests check one by one:

  1. ``mmvq_sumi``: the integer dot products, per row, weight block and thread slot: the
     weight's 32-bit words masked and shifted as the kernel does (fifth bits moved into bit 4 of
     each byte for Q5_0/Q5_1) and multiplied byte by byte with the activation's words (dp4a);
  2. ``mmvq_contributions``: each slot's float value, rounded where the kernel rounds (f32
     operations one at a time, no fused multiply-add; Q4_1/Q5_1's d*d8 and m*s8 as f16
     products);
  3. ``mmvq_reduce``: the order of the float additions, which fixes the result's bits. With
     ``nwarps`` warps per row (``MMVQ_NWARPS``, 4), thread t = 32*warp + lane takes the weight
     blocks t // (QI/VDR), then every (VDR * 32 * nwarps / QI)-th after it, its slot being
     t % (QI/VDR); it adds its contributions into an f32 starting at 0.0 in that block order;
     lane l of warp 0 then adds lane l of warps 1, 2, ... in that order, and the 32 lanes are
     summed by the butterfly above; the row's value is lane 0's.

Nothing here needs CuPy or a GPU. ``tests/test_cuda_twins.py`` checks the integer parts against a
direct unpacking of the blocks and the products against the dequantized f32 product; on a GPU,
``bankml.engine_cupy.cuda_loader`` runs the kernels themselves, and a kernel that differs from its
twin in a bit is a bug in one of them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy

WARP = 32
QK = 32  # values per block of every type here, and per q8_1 block
NWARPS = 4  # warps per output row, MMVQ_NWARPS in cuda/mmvq_common.cuh
_F32 = numpy.float32


@dataclass(frozen=True)
class BlockType:
    """A weight type's block: its bytes and how the kernel splits it among threads."""

    name: str
    block_bytes: int
    qi: int  # 32-bit words of quants per block, as ggml counts them (QI4_0, ...)
    vdr: int  # words each thread takes per block
    values: int = 32  # per block (256 for the K-quants' super-blocks)

    @property
    def slots(self) -> int:
        """Threads per block (QI / VDR)."""
        return self.qi // self.vdr

    def blocks_per_iter(self, nwarps: int = NWARPS) -> int:
        return self.vdr * nwarps * WARP // self.qi


BLOCK_TYPES = {
    "Q4_0": BlockType("Q4_0", 18, 4, 2),
    "Q4_1": BlockType("Q4_1", 20, 4, 2),
    "Q5_0": BlockType("Q5_0", 22, 4, 2),
    "Q5_1": BlockType("Q5_1", 24, 4, 2),
    "Q8_0": BlockType("Q8_0", 34, 8, 2),
    "Q2_K": BlockType("Q2_K", 84, 16, 1, 256),
    "Q3_K": BlockType("Q3_K", 110, 16, 1, 256),
    "Q4_K": BlockType("Q4_K", 144, 32, 2, 256),
    "Q5_K": BlockType("Q5_K", 176, 32, 2, 256),
    "Q6_K": BlockType("Q6_K", 210, 32, 1, 256),
}
K_QUANTS = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")


# --- the activation -----------------------------------------------------------------------------


def butterfly_sum(v: numpy.ndarray) -> numpy.ndarray:
    """The f32 sum over the last axis (32 lanes) by __shfl_xor_sync, 16 down to 1: lane 0's."""
    v = numpy.asarray(v, _F32)
    lanes = numpy.arange(v.shape[-1])
    offset = v.shape[-1] // 2
    while offset:
        v = v + v[..., lanes ^ offset]
        offset //= 2
    return v[..., 0]


def round_half_away(r: numpy.ndarray) -> numpy.ndarray:
    """C's roundf: to the nearest integer, halves away from zero (exact for every f32)."""
    t = numpy.trunc(r)
    return t + numpy.where(numpy.abs(r - t) >= _F32(0.5), numpy.sign(r), _F32(0)).astype(_F32)


@dataclass(frozen=True)
class Q8_1:
    """An activation as q8_1 blocks: ``qs`` int8 [n/32, 32], ``d`` and ``s`` float16 [n/32]."""

    qs: numpy.ndarray
    d: numpy.ndarray
    s: numpy.ndarray

    def to_bytes(self) -> numpy.ndarray:
        """The blocks as the kernels read them: f16 d, f16 s, 32 int8 (36 bytes each)."""
        out = numpy.empty((self.qs.shape[0], 36), numpy.uint8)
        out[:, 0:2] = self.d.astype("<f2").view(numpy.uint8).reshape(-1, 2)
        out[:, 2:4] = self.s.astype("<f2").view(numpy.uint8).reshape(-1, 2)
        out[:, 4:] = self.qs.view(numpy.uint8)
        return out.reshape(-1)


def quantize_q8_1(x: numpy.ndarray) -> Q8_1:
    """The twin of ``quantize_q8_1.cu`` for one activation row x (f32, a multiple of 32 long)."""
    xb = numpy.asarray(x, _F32).reshape(-1, QK)
    amax = numpy.abs(xb).max(axis=1)
    total = butterfly_sum(xb)
    d = amax / _F32(127)
    with numpy.errstate(divide="ignore", invalid="ignore"):
        q = round_half_away(xb / d[:, None])
    q = numpy.where(amax[:, None] == 0, _F32(0), q)
    return Q8_1(q.astype(numpy.int8), d.astype(numpy.float16), total.astype(numpy.float16))


# --- the integer dot products -------------------------------------------------------------------


def _words(b: numpy.ndarray, start: int, stop: int) -> numpy.ndarray:
    """Bytes start:stop of every block as little-endian uint32 words [..., (stop-start)/4]."""
    return numpy.ascontiguousarray(b[..., start:stop]).view("<u4")


def _sum_last(x: numpy.ndarray) -> numpy.ndarray:
    """int32 sum over the short last axis, as adds of its slices (exact in any order, and much
    faster than numpy's reduction over an axis of 2-4 values)."""
    out = x[..., 0].astype(numpy.int32)
    for k in range(1, x.shape[-1]):
        out += x[..., k]
    return out


def _dp4a(a: numpy.ndarray, b: numpy.ndarray) -> numpy.ndarray:
    """__dp4a(a, b, 0): the four signed bytes of a times those of b, summed (int32)."""
    ab = numpy.ascontiguousarray(a, "<u4").view(numpy.int8).reshape(*a.shape, 4)
    bb = numpy.ascontiguousarray(b, "<u4").view(numpy.int8).reshape(*b.shape, 4)
    out = ab[..., 0].astype(numpy.int32) * bb[..., 0]
    for k in (1, 2, 3):
        out += ab[..., k].astype(numpy.int32) * bb[..., k]
    return out


def _fifth_bits(vl: numpy.ndarray, vh: numpy.ndarray) -> tuple[numpy.ndarray, numpy.ndarray]:
    """Q5's low and high words with their fifth bits in bit 4 of each byte (the kernel's masks)."""
    m = numpy.uint32
    v0 = vl & m(0x0F0F0F0F)
    v0 |= (vh << m(4)) & m(0x00000010)
    v0 |= (vh << m(11)) & m(0x00001000)
    v0 |= (vh << m(18)) & m(0x00100000)
    v0 |= (vh << m(25)) & m(0x10000000)
    v1 = (vl >> m(4)) & m(0x0F0F0F0F)
    v1 |= (vh >> m(12)) & m(0x00000010)
    v1 |= (vh >> m(5)) & m(0x00001000)
    v1 |= (vh << m(2)) & m(0x00100000)
    v1 |= (vh << m(9)) & m(0x10000000)
    return v0, v1


def _blocks(qtype: str, w: numpy.ndarray) -> tuple[BlockType, numpy.ndarray]:
    bt = BLOCK_TYPES[qtype]
    w = numpy.asarray(w, numpy.uint8)
    if w.ndim == 1:
        w = w[None]
    if w.shape[-1] % bt.block_bytes:
        raise ValueError(f"{qtype} rows of {w.shape[-1]} bytes are not whole blocks")
    return bt, w.reshape(w.shape[0], -1, bt.block_bytes)


def _q8_words(bt: BlockType, b: numpy.ndarray, y: Q8_1) -> numpy.ndarray:
    """The activation's words, [q8_1 blocks, 8], checked against the weight's blocks."""
    yw = numpy.ascontiguousarray(y.qs).view("<u4")
    if yw.shape[0] * QK != b.shape[1] * bt.values:
        raise ValueError(f"{b.shape[1]} weight blocks per row against {yw.shape[0]} q8_1 blocks")
    return yw


def mmvq_sumi(qtype: str, w: numpy.ndarray, y: Q8_1) -> numpy.ndarray:
    """The kernel's integer dot products: int32 [rows, blocks, slots], slot k covering the
    weight words VDR*k .. VDR*k+VDR-1 (and, for the 4-bit types, their high nibbles' words).
    Not for the K-quants: ``kquant_ints``."""
    bt, b = _blocks(qtype, w)
    if qtype in K_QUANTS:
        raise ValueError(f"{qtype}: kquant_ints")
    yw = _q8_words(bt, b, y)  # [blocks, 8]
    m = numpy.uint32
    if qtype == "Q8_0":
        per_word = _dp4a(_words(b, 2, 34), yw[None])  # [rows, blocks, 8]
    else:
        if qtype in ("Q4_0", "Q4_1"):
            vl = _words(b, 2, 18) if qtype == "Q4_0" else _words(b, 4, 20)
            v0, v1 = vl & m(0x0F0F0F0F), (vl >> m(4)) & m(0x0F0F0F0F)
        else:
            lo, hi = (6, 2) if qtype == "Q5_0" else (8, 4)
            vl = _words(b, lo, lo + 16)
            qh = _words(b, hi, hi + 4)  # [rows, blocks, 1]
            vh = qh >> (m(4) * numpy.arange(4, dtype=m))  # word j's fifth bits at bit 0..
            v0, v1 = _fifth_bits(vl, vh)
        per_word = _dp4a(v0, yw[None, :, :4]) + _dp4a(v1, yw[None, :, 4:])  # [rows, blocks, 4]
    rows, blocks = per_word.shape[:2]
    return _sum_last(per_word.reshape(rows, blocks, bt.slots, bt.vdr))


# --- the K-quants' integer parts ------------------------------------------------------------


def scale_min_k4(scales: numpy.ndarray) -> tuple[numpy.ndarray, numpy.ndarray]:
    """Q4_K's 6-bit scales and mins of the 8 sub-blocks from its 12 bytes [..., 12]: int32
    [..., 8] each (ggml's get_scale_min_k4)."""
    q = scales.astype(numpy.int32)
    sc = numpy.concatenate([q[..., 0:4] & 63, (q[..., 8:12] & 0xF) | ((q[..., 0:4] >> 6) << 4)], -1)
    m = numpy.concatenate([q[..., 4:8] & 63, (q[..., 8:12] >> 4) | ((q[..., 4:8] >> 6) << 4)], -1)
    return sc, m


def _kquant_layout(qtype: str) -> tuple[numpy.ndarray, numpy.ndarray]:
    """Per thread slot: the q8_1 block (within the super-block) of each of its terms (two, or
    four for Q2_K and Q3_K), and the word of that q8_1 block it starts at. [slots, terms] and
    [slots]."""
    if qtype in ("Q2_K", "Q3_K"):
        s = numpy.arange(16)  # iqs
        return 4 * (s // 8)[:, None] + numpy.arange(4), s % 8
    if qtype in ("Q4_K", "Q5_K"):
        s = numpy.arange(16)  # iqs / 2
        first = 2 * (s // 4)
        return numpy.stack([first, first + 1], -1), s % 4
    s = numpy.arange(32)  # Q6_K: iqs
    first = 4 * (s // 16) + (s % 16) // 8
    return numpy.stack([first, first + 2], -1), s % 8


def kquant_ints(qtype: str, w: numpy.ndarray, y: Q8_1) -> numpy.ndarray:
    """The K-quant kernels' integer terms, int32 [rows, blocks, slots, terms, P]: per slot, for
    each of its sub-blocks (terms: 2, or 4 for Q2_K and Q3_K), Q2_K's, Q4_K's and Q5_K's
    dot * scale and (sum of q8) * min (P = 2), Q3_K's and Q6_K's dot * scale (P = 1)."""
    bt, b = _blocks(qtype, w)
    yw = _q8_words(bt, b, y).reshape(b.shape[1], 8, 8)  # [blocks, q8_1 block, word]
    sub, word = _kquant_layout(qtype)
    m = numpy.uint32
    nib = m(0x0F0F0F0F)
    if qtype in ("Q2_K", "Q3_K"):
        return _low_kquant_ints(qtype, b, yw, sub, word)
    if qtype in ("Q4_K", "Q5_K"):
        five = qtype == "Q5_K"
        qs = _words(b, 48, 176) if five else _words(b, 16, 144)  # [rows, blocks, 32]
        w0 = 8 * (numpy.arange(16) // 4) + numpy.arange(16) % 4
        v0, v1 = qs[..., w0], qs[..., w0 + 4]  # [rows, blocks, 16]
        if five:  # each value's fifth bit: bit (sub-block) of its byte in qh
            qh = _words(b, 16, 48)  # [rows, blocks, 8]
            shift = m(2) * (numpy.arange(16, dtype=m) // 4)  # bq8_offset
            h0, h1 = qh[..., word] >> shift, qh[..., word + 4] >> shift
        sc, mn = scale_min_k4(b[..., 4:16])  # [rows, blocks, 8]
        out = numpy.empty((*v0.shape, 2, 2), numpy.int32)
        for i in range(2):
            u0 = yw[:, sub[:, i], word][None]  # [1, blocks, 16]
            u1 = yw[:, sub[:, i], word + 4][None]
            x0, x1 = (v0 >> m(4 * i)) & nib, (v1 >> m(4 * i)) & nib
            if five:
                x0 |= ((h0 >> m(i)) << m(4)) & m(0x10101010)
                x1 |= ((h1 >> m(i)) << m(4)) & m(0x10101010)
            dot1 = _dp4a(x0, u0) + _dp4a(x1, u1)
            ones = numpy.full(u0.shape, 0x01010101, m)
            dot2 = _dp4a(ones, u0) + _dp4a(ones, u1)
            out[..., i, 0] = dot1 * sc[..., sub[:, i]]
            out[..., i, 1] = dot2 * mn[..., sub[:, i]]
        return out
    s = numpy.arange(32)
    vl = _words(b, 0, 128)  # [rows, blocks, 32]
    vh = _words(b, 128, 192)[..., 8 * (s // 16) + s % 8] >> (m(2) * ((s % 16) // 8)).astype(m)
    scales = b[..., 192:208].view(numpy.int8).astype(numpy.int32)
    scale_at = 8 * (s // 16) + (s % 16) // 4
    out = numpy.empty((*vl.shape, 2, 1), numpy.int32)
    for i in range(2):
        vil = (vl >> m(4 * i)) & nib
        vih = ((vh >> m(4 * i)) << m(4)) & m(0x30303030)
        # __vsub4(vil | vih, 0x20202020): byte by byte, each 0..63 less 32
        vi = (numpy.ascontiguousarray(vil | vih).view(numpy.uint8) - numpy.uint8(32)).view(m)
        dot = _dp4a(vi, yw[:, sub[:, i], word][None])
        out[..., i, 0] = dot * scales[..., scale_at + 4 * i]
    return out


def _low_kquant_ints(
    qtype: str, b: numpy.ndarray, yw: numpy.ndarray, sub: numpy.ndarray, word: numpy.ndarray
) -> numpy.ndarray:
    """Q2_K's and Q3_K's integer terms: slot s (one word of 2-bit quants) times word s % 8 of
    q8_1 blocks 4 (s // 8) + i, i = 0..3 (the bit pairs 2i); scale_offset + 2i the sub-block."""
    m = numpy.uint32
    s = numpy.arange(16)
    scale_at = 8 * (s // 8) + (s % 8) // 4  # [16]
    if qtype == "Q2_K":
        v = _words(b, 16, 80)  # [rows, blocks, 16]
        out = numpy.empty((*v.shape, 4, 2), numpy.int32)
        for i in range(4):
            u = yw[:, sub[:, i], word][None]  # [1, blocks, 16]
            sc = b[..., scale_at + 2 * i].astype(numpy.int32)
            dot = _dp4a((v >> m(2 * i)) & m(0x03030303), u)
            total = _dp4a(numpy.full(u.shape, 0x01010101, m), u)
            out[..., i, 0] = dot * (sc & 0xF)
            out[..., i, 1] = total * (sc >> 4)  # dp4a of the min in every byte
        return out
    vl = _words(b, 32, 96)  # [rows, blocks, 16]
    shift = (m(4) * (s // 8)).astype(m)
    vh = ~_words(b, 0, 32)[..., s % 8] >> shift  # the high bits inverted: clear subtracts 4
    scales = b[..., 96:108].astype(numpy.int32)
    out = numpy.empty((*vl.shape, 4, 1), numpy.int32)
    for i in range(4):
        isc = scale_at + 2 * i
        low = (scales[..., isc % 8] >> (4 * (isc // 8))) & 0xF
        high = ((scales[..., 8 + isc % 4] >> (2 * (isc // 4))) & 3) << 4
        vil = (vl >> m(2 * i)) & m(0x03030303)
        vih = ((vh >> m(i)) << m(2)) & m(0x04040404)
        # __vsub4(vil, vih): byte by byte
        vi = (
            numpy.ascontiguousarray(vil).view(numpy.uint8)
            - numpy.ascontiguousarray(vih).view(numpy.uint8)
        ).view(m)
        dot = _dp4a(vi, yw[:, sub[:, i], word][None])
        out[..., i, 0] = dot * ((low | high) - 32)
    return out


def _kquant_contributions(qtype: str, b: numpy.ndarray, y: Q8_1) -> numpy.ndarray:
    ints = kquant_ints(qtype, b.reshape(b.shape[0], -1), y).astype(_F32)  # exact: < 2**24
    sub, _ = _kquant_layout(qtype)
    blocks = b.shape[1]
    d8 = y.d.astype(_F32).reshape(blocks, 8)[:, sub][None]  # [1, blocks, slots, terms]
    # 0.0 + first term is the first term: the kernel's f32 sums start at 0
    sums = [d8[..., 0] * ints[..., 0, p] for p in range(ints.shape[-1])]
    for i in range(1, ints.shape[-2]):
        sums = [acc + d8[..., i] * ints[..., i, p] for p, acc in enumerate(sums)]
    if qtype in ("Q2_K", "Q4_K", "Q5_K"):
        at = 80 if qtype == "Q2_K" else 0
        d, dmin = _f16(b, at).astype(_F32)[..., None], _f16(b, at + 2).astype(_F32)[..., None]
        return d * sums[0] - dmin * sums[1]
    return _f16(b, 108 if qtype == "Q3_K" else 208).astype(_F32)[..., None] * sums[0]


# --- the float parts ----------------------------------------------------------------------------


def _f16(b: numpy.ndarray, at: int) -> numpy.ndarray:
    return numpy.ascontiguousarray(b[..., at : at + 2]).view("<f2")[..., 0]


def mmvq_contributions(qtype: str, w: numpy.ndarray, y: Q8_1) -> numpy.ndarray:
    """Each thread slot's f32 value, [rows, blocks, slots], rounded as the kernel rounds."""
    bt, b = _blocks(qtype, w)
    if qtype in K_QUANTS:
        return _kquant_contributions(qtype, b, y)
    sumi = mmvq_sumi(qtype, w, y).astype(_F32)  # exact: |sumi| < 2**24
    d8, s8 = y.d[None, :, None], y.s[None, :, None]
    d = _f16(b, 0)[..., None]
    if qtype in ("Q4_0", "Q5_0"):
        offset = _F32((8 if qtype == "Q4_0" else 16) * bt.vdr // bt.qi)
        t = sumi * d8.astype(_F32) - offset * s8.astype(_F32)
        return d.astype(_F32) * t
    if qtype in ("Q4_1", "Q5_1"):
        m = _f16(b, 2)[..., None]
        dd = (d * d8).astype(_F32)  # f16 x f16, rounded to f16: ggml's __hmul2
        ms = (m * s8).astype(_F32)
        return sumi * dd + ms / _F32(bt.qi // bt.vdr)
    return (d.astype(_F32) * d8.astype(_F32)) * sumi  # Q8_0


def mmvq_reduce(contrib: numpy.ndarray, bt: BlockType, nwarps: int = NWARPS) -> numpy.ndarray:
    """The kernel's sum of [rows, blocks, slots] contributions, in its order (module doc): f32 [rows]."""
    rows, blocks, slots = contrib.shape
    per_iter = bt.blocks_per_iter(nwarps)
    iters = -(-blocks // per_iter)
    pad = numpy.zeros((rows, iters * per_iter, slots), _F32)
    pad[:, :blocks] = contrib
    # thread t = block-in-iteration * slots + slot
    by_thread = pad.reshape(rows, iters, per_iter * slots)
    kbx = numpy.arange(iters * per_iter).reshape(iters, per_iter, 1)
    valid = numpy.broadcast_to(kbx < blocks, (iters, per_iter, slots)).reshape(iters, -1)
    tmp = numpy.zeros((rows, WARP * nwarps), _F32)
    for it in range(iters):
        tmp = numpy.where(valid[it], tmp + by_thread[:, it], tmp)
    lanes = tmp.reshape(rows, nwarps, WARP)
    acc = lanes[:, 0]
    for warp in range(1, nwarps):
        acc = acc + lanes[:, warp]
    return butterfly_sum(acc)


def mmvq(
    qtype: str, w: numpy.ndarray, x: numpy.ndarray | Q8_1, nwarps: int = NWARPS
) -> numpy.ndarray:
    """The twin of ``mmvq_<type>.cu``: rows of GGUF blocks ``w`` (uint8 [rows, bytes]) times one
    activation row ``x`` (f32, or already q8_1), f32 [rows]. Rows go 4096 at a time."""
    y = x if isinstance(x, Q8_1) else quantize_q8_1(x)
    bt, _ = _blocks(qtype, w)
    w2 = numpy.asarray(w, numpy.uint8).reshape(-1, numpy.shape(w)[-1])
    out = [
        mmvq_reduce(mmvq_contributions(qtype, w2[i : i + 4096], y), bt, nwarps)
        for i in range(0, w2.shape[0], 4096)
    ]
    return numpy.concatenate(out)


def mmvq_rows(
    qtype: str, w: numpy.ndarray, xs: list[numpy.ndarray | Q8_1], nwarps: int = NWARPS
) -> numpy.ndarray:
    """The twin of ``mmvq_<type>_rows`` (mmvq_common.cuh's ``mmvq_rows``): the rows of ``w``
    times each of up to 8 activation rows, f32 [len(xs), rows]. The kernel keeps one partial
    sum per activation row and adds into it exactly what the one-row kernel adds, in the same
    order, so row j is ``mmvq(qtype, w, xs[j])``."""
    if not 1 <= len(xs) <= 8:
        raise ValueError(f"the batched product takes 1..8 activation rows, not {len(xs)}")
    return numpy.stack([mmvq(qtype, w, x, nwarps) for x in xs])
