"""ggml's CPU flash attention (f16 K/V cache), bit for bit, as Numba loops.

llama-server runs attention as ``ggml_flash_attn_ext`` on the CPU with an f16 K/V cache. Which
kernel of ggml-cpu/ops.cpp runs depends on the number of query rows in the micro-batch:

- **fewer than 64 rows** (``one_chunk``): each (row, head) walks its cells in order with an online
  softmax. Q is rounded to f16, each score is ``ggml_vec_dot_f16`` (32 f32 lanes of exact
  products, a fixed reduction tree, the leftover in double), times ``scale``, plus the f16 mask.
  The V accumulator is **f16**: at a new maximum it is scaled by ``expf(M_old - M)`` and rounded
  (``ggml_vec_scale_f16``), then ``fma(v, expf(s - M), acc)`` is rounded again
  (``ggml_vec_mad_f16``). ``expf`` is libm's (Numba's float32 ``math.exp`` calls the same
  ``expf``). The output is ``acc * (1/S)``.
- **one row over 512 cells or more** (decode on a long context): the cells are split into
  ``n_threads`` equal chunks, each walked as above into a partial (M, S, acc), then merged by
  ``ggml_flash_attn_ext_reduce_partials`` (rescaled to the common maximum in f32).
- **64 rows or more** (``tiled``): Q stays f32; per tile of 64 cells the scores are sequential
  f32 fma chains over the head dimension, the tile's weights come from ggml's SIMD
  ``ggml_v_expf`` polynomial, their sum is taken in 8-lane float groups added into a double, and
  V is accumulated in f32 by fma chains (``simd_gemm``).

Every (row, head) is independent of how ggml spreads rows over threads; only the decode split
depends on ``n_threads`` (llama-server's ``-t``). The cells are those ggml sees: ``n_kv`` is the
cache length padded as llama.cpp pads it (:func:`kv_length`); cells past the ``T`` given are hidden
padding. Where GCC fused a C expression ``a*b + c`` into one fma (``-mfma -ffp-contract=fast``),
so do these loops (see docs/modules/exact_attention.md for each case and how it was settled).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from llvmlite import ir
from numba import prange, types
from numba.extending import intrinsic

from bankml.engine_cupy.jit import fma32, njit

__all__ = ["flash_attn_f16", "attention_mask", "kv_length", "FA_TILE_Q", "FA_TILE_KV",
           "SPLIT_MIN_CELLS", "KV_PAD"]

F32 = np.float32
FA_TILE_Q = 64  # GGML_FA_TILE_Q: from this many query rows the tiled kernel runs
FA_TILE_KV = 64  # GGML_FA_TILE_KV: cells per tile in the tiled kernel
SPLIT_MIN_CELLS = 512  # one query row over this many cells is split across the threads
KV_PAD = 256  # llama_kv_cache::get_n_kv pads the attended cells to a multiple of 256

_NEG_INF = F32(-np.inf)
_ZERO = F32(0.0)
_ONE = F32(1.0)


# --- float32 bit access (no NumPy view for scalars inside Numba) ---------------------------------

@intrinsic
def _bits(typingctx: Any, x: Any) -> Any:
    """The IEEE bits of a float32 as uint32."""
    sig = types.uint32(types.float32)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.bitcast(args[0], ir.IntType(32))

    return sig, codegen


@intrinsic
def _from_bits(typingctx: Any, u: Any) -> Any:
    """The float32 whose IEEE bits are the uint32 u."""
    sig = types.float32(types.uint32)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.bitcast(args[0], ir.FloatType())

    return sig, codegen


@njit(inline="always")
def f16_round(x: float) -> float:
    """x (float32) rounded to the nearest f16 value, ties to even (F16C's _mm256_cvtps_ph(x, 0)).

    Branch-free so the accumulator loops vectorise: normal numbers round their 23-bit mantissa
    to 10 bits on the integer bits, f16 subnormals (|x| < 2^-14) round to a multiple of 2^-24 by
    adding and subtracting 0.5, beyond 65504 (after rounding) is infinity; NaN stays NaN.
    """
    u = _bits(x)
    sign = u & np.uint32(0x80000000)
    a = u & np.uint32(0x7FFFFFFF)
    rounded = (a + np.uint32(0xFFF) + ((a >> np.uint32(13)) & np.uint32(1))) & np.uint32(0xFFFFE000)
    normal = np.uint32(0x7F800000) if rounded >= np.uint32(0x47800000) else rounded
    small = _bits((_from_bits(a) + F32(0.5)) - F32(0.5))
    out = small if a < np.uint32(0x38800000) else normal
    out = a if a > np.uint32(0x7F800000) else out  # NaN
    return _from_bits(out | sign)


_EXP_R = F32(float.fromhex("0x1.8p23"))
_EXP_LOG2E = F32(float.fromhex("0x1.715476p+0"))
_EXP_LN2_HI = F32(float.fromhex("0x1.62e4p-1"))
_EXP_LN2_LO = F32(float.fromhex("0x1.7f7d1cp-20"))
_EXP_C5 = F32(float.fromhex("0x1.0e4020p-7"))
_EXP_C4 = F32(float.fromhex("0x1.573e2ep-5"))
_EXP_C3 = F32(float.fromhex("0x1.555e66p-3"))
_EXP_C2 = F32(float.fromhex("0x1.fffdb6p-2"))
_EXP_C1 = F32(float.fromhex("0x1.ffffecp-1"))


@njit(inline="always")
def ggml_v_expf(x: float) -> float:
    """One lane of ggml's AVX2 ``ggml_v_expf`` (vec.h): exp(x) by a degree-5 polynomial.

    Every lane is independent (the vector's early return gives the same per-lane value as the
    blended slow path), so a scalar port is exact.
    """
    z = fma32(x, _EXP_LOG2E, _EXP_R)
    n = z - _EXP_R
    b = fma32(-n, _EXP_LN2_LO, fma32(-n, _EXP_LN2_HI, x))
    e = _bits(z) << np.uint32(23)
    k = _from_bits(e + np.uint32(0x3F800000))
    u = b * b
    j = fma32(fma32(fma32(_EXP_C5, b, _EXP_C4), u, fma32(_EXP_C3, b, _EXP_C2)), u, _EXP_C1 * b)
    if not abs(n) > F32(126.0):
        return fma32(j, k, k)
    g = np.uint32(0x82000000) if n <= _ZERO else np.uint32(0)
    s1 = _from_bits(g + np.uint32(0x7F000000))
    if abs(n) > F32(192.0):
        return s1 * s1
    s2 = _from_bits(e - g)
    return fma32(s2, j, s2) * s1


# --- the one-row kernel (fewer than 64 rows, and the chunks of a split decode) -------------------

@njit(inline="always")
def _dot_f16(k: Any, kvh: int, ic: int, q16: Any, hd: int, lanes: Any) -> float:
    """ggml_vec_dot_f16 (AVX2 + F16C) of cell ``ic``'s key with the f16-rounded query.

    Four 8-float accumulators over steps of 32 (every product of two f16 values is exact in
    f32, so the fma is one rounding of the sum); reduced as GGML_F32x8_REDUCE does
    ((a0 + a2) + (a1 + a3), then the two 128-bit halves, then two hadds); the leftover
    elements are added in double, and the double rounded to float.
    """
    body = hd & ~31
    for lane in range(32):
        lanes[lane] = _ZERO
    for i in range(0, body, 32):
        for lane in range(32):
            lanes[lane] = fma32(k[kvh, ic, i + lane], q16[i + lane], lanes[lane])
    for lane in range(8):
        lanes[lane] = (lanes[lane] + lanes[lane + 16]) + (lanes[lane + 8] + lanes[lane + 24])
    t0 = lanes[0] + lanes[4]
    t1 = lanes[1] + lanes[5]
    t2 = lanes[2] + lanes[6]
    t3 = lanes[3] + lanes[7]
    total = np.float64((t0 + t1) + (t2 + t3))
    for i in range(body, hd):
        total += np.float64(k[kvh, ic, i] * q16[i])
    return F32(total)


@njit(inline="always")
def _walk_f16(q16: Any, k: Any, v: Any, kvh: int, mask: Any, row: int, has_mask: bool,
              c0: int, c1: int, scale: float, acc: Any, lanes: Any) -> tuple[float, float]:
    """ggml_compute_forward_flash_attn_ext_f16_one_chunk for one (row, head) over cells c0..c1.

    ``acc`` (float32 holding f16 values) ends as the unnormalised V·softmax; returns (M, S).
    Cells at or past ``k.shape[1]`` are llama.cpp's padding, hidden by its mask.
    """
    hd = acc.shape[0]
    for d in range(hd):
        acc[d] = _ZERO
    big_s = _ZERO
    big_m = _NEG_INF
    end = min(c1, k.shape[1])
    for ic in range(c0, end):
        mv = _ZERO
        if has_mask:
            mv = mask[row, ic]
            if mv == _NEG_INF:
                continue
        s = _dot_f16(k, kvh, ic, q16, hd, lanes) * scale
        s = s + mv
        ms = _ONE
        vs = _ONE
        if s > big_m:
            m_old = big_m
            big_m = s
            ms = F32(math.exp(m_old - big_m))
            for d in range(hd):
                acc[d] = f16_round(acc[d] * ms)
        else:
            vs = F32(math.exp(s - big_m))
        for d in range(hd):
            acc[d] = f16_round(fma32(v[kvh, ic, d], vs, acc[d]))
        big_s = fma32(big_s, ms, vs) if FUSE_SUM else big_s * ms + vs
    return big_m, big_s


# S = S*ms + vs in one_chunk: GCC fuses it (settled against ggml, see the docs)
FUSE_SUM = True


@njit(parallel=True)
def _one_chunk(q: Any, k: Any, v: Any, mask: Any, has_mask: bool, scale: float, group: int,
               out: Any) -> None:
    """Every (row, head) over all cells, normalised by 1/S (the path for 1..63 rows)."""
    n_rows, n_head, hd = q.shape
    for task in prange(n_rows * n_head):
        row = task // n_head
        h = task % n_head
        q16 = np.empty(hd, np.float32)
        for d in range(hd):
            q16[d] = f16_round(q[row, h, d])
        acc = np.empty(hd, np.float32)
        lanes = np.empty(32, np.float32)
        _, big_s = _walk_f16(q16, k, v, h // group, mask, row, has_mask, 0, k.shape[1], scale,
                             acc, lanes)
        s_inv = _ZERO if big_s == _ZERO else _ONE / big_s
        for d in range(hd):
            out[row, h, d] = acc[d] * s_inv


@njit(parallel=True)
def _split_decode(q: Any, k: Any, v: Any, mask: Any, has_mask: bool, scale: float, group: int,
                  n_kv: int, n_threads: int, out: Any) -> None:
    """One query row over n_kv >= 512 cells: per-thread chunks, then reduce_partials."""
    _, n_head, hd = q.shape
    chunk = (n_kv + n_threads - 1) // n_threads
    part_m = np.empty((n_head, n_threads), np.float32)
    part_s = np.empty((n_head, n_threads), np.float32)
    part_acc = np.empty((n_head, n_threads, hd), np.float32)
    for task in prange(n_head * n_threads):
        h = task // n_threads
        c = task % n_threads
        c0 = c * chunk
        if c0 >= n_kv:
            part_m[h, c] = _NEG_INF
            part_s[h, c] = _ZERO
            continue
        q16 = np.empty(hd, np.float32)
        for d in range(hd):
            q16[d] = f16_round(q[0, h, d])
        lanes = np.empty(32, np.float32)
        m, s = _walk_f16(q16, k, v, h // group, mask, 0, has_mask, c0, min(c0 + chunk, n_kv),
                         scale, part_acc[h, c], lanes)
        part_m[h, c] = m
        part_s[h, c] = s
    for h in range(n_head):
        _reduce_partials(part_m[h], part_s[h], part_acc[h], chunk, n_kv, out[0, h])


# reduce_partials: a*so + b*sn, GCC fuses the first product (settled against ggml, see the docs)
FUSE_MERGE = 1


@njit(inline="always")
def _reduce_partials(part_m: Any, part_s: Any, part_acc: Any, chunk: int, n_kv: int,
                     out: Any) -> None:
    """ggml_flash_attn_ext_reduce_partials for one head: chunks rescaled to the common max."""
    hd = out.shape[0]
    m_final = _NEG_INF
    s_final = _ZERO
    for d in range(hd):
        out[d] = _ZERO
    for c in range(part_m.shape[0]):
        if c * chunk >= n_kv or part_s[c] == _ZERO:
            continue
        m_new = max(m_final, part_m[c])
        scale_old = F32(math.exp(m_final - m_new))
        scale_new = F32(math.exp(part_m[c] - m_new))
        for d in range(hd):
            out[d] = _merge(out[d], scale_old, part_acc[c, d], scale_new)
        s_final = _merge(s_final, scale_old, part_s[c], scale_new)
        m_final = m_new
    if s_final != _ZERO:
        s_inv = _ONE / s_final
        for d in range(hd):
            out[d] = out[d] * s_inv


@njit(inline="always")
def _merge(a: float, sa: float, b: float, sb: float) -> float:
    if FUSE_MERGE == 1:
        return fma32(a, sa, b * sb)
    if FUSE_MERGE == 2:
        return fma32(b, sb, a * sa)
    return a * sa + b * sb


# --- the tiled kernel (64 rows or more) ----------------------------------------------------------

@njit(inline="always")
def _tile_weights(kq: Any, n: int, big_m: float) -> float:
    """ggml_vec_soft_max_f32 (AVX2) of one tile row: kq[j] = ggml_v_expf(kq[j] - M) in place.

    Returns the sum as ggml takes it: each group of 8 summed in float ((hi4 + lo4), then
    (0+2, 1+3), then the two), the groups added into a double. Hidden cells (-inf) weigh 0.
    """
    total = 0.0
    for g in range(0, n - n % 8, 8):
        for j in range(g, g + 8):
            x = kq[j]
            kq[j] = _ZERO if x == _NEG_INF else ggml_v_expf(x - big_m)
        a0 = kq[g + 4] + kq[g + 0]
        a1 = kq[g + 5] + kq[g + 1]
        a2 = kq[g + 6] + kq[g + 2]
        a3 = kq[g + 7] + kq[g + 3]
        total += np.float64((a0 + a2) + (a1 + a3))
    return total


@njit(parallel=True)
def _tiled(q: Any, k_tiles: Any, v: Any, mask: Any, has_mask: bool, scale: float, group: int,
           out: Any) -> None:
    """ggml_compute_forward_flash_attn_ext_tiled, one (row, head) per task.

    ``k_tiles`` [kv_head, tile, hd, 64] holds K transposed per tile (as ggml packs K_f32), so the
    scores of a tile are 64-wide fma chains over the head dimension.
    """
    n_rows, n_head, hd = q.shape
    n_cells = v.shape[1]
    n_tiles = k_tiles.shape[1]
    for task in prange(n_rows * n_head):
        row = task // n_head
        h = task % n_head
        kvh = h // group
        kq = np.empty(FA_TILE_KV, np.float32)
        acc = np.zeros(hd, np.float32)
        big_s = _ZERO
        big_m = _NEG_INF
        for t in range(n_tiles):
            c0 = t * FA_TILE_KV
            width = min(FA_TILE_KV, n_cells - c0)
            visible = False
            for j in range(FA_TILE_KV):
                kq[j] = _ZERO
            for d in range(hd):
                qd = q[row, h, d]
                for j in range(FA_TILE_KV):
                    kq[j] = fma32(k_tiles[kvh, t, d, j], qd, kq[j])
            tile_max = _NEG_INF
            for j in range(FA_TILE_KV):
                s = kq[j] * scale
                if j >= width:
                    s = _NEG_INF
                elif has_mask:
                    s = s + mask[row, c0 + j]
                kq[j] = s
                if s > tile_max:
                    tile_max = s
                if s != _NEG_INF:
                    visible = True
            if not visible:
                continue
            m_new = max(big_m, tile_max)
            if m_new > big_m:
                ms = F32(math.exp(big_m - m_new))
                for d in range(hd):
                    acc[d] = acc[d] * ms
                big_s = big_s * ms
            big_m = m_new
            big_s = F32(np.float64(big_s) + _tile_weights(kq, FA_TILE_KV, m_new))
            for j in range(width):
                p = kq[j]
                if p == _ZERO:
                    continue  # fma(0, v, acc) == acc: hidden cells change nothing
                for d in range(hd):
                    acc[d] = fma32(p, v[kvh, c0 + j, d], acc[d])
        s_inv = _ZERO if big_s == _ZERO else _ONE / big_s
        for d in range(hd):
            out[row, h, d] = acc[d] * s_inv


def _k_tiles(k: np.ndarray) -> np.ndarray:
    """K [kv_head, T, hd] as [kv_head, tile, hd, 64], zero-padded (ggml's packed K_f32)."""
    n_head_kv, n_cells, hd = k.shape
    n_tiles = -(-n_cells // FA_TILE_KV)
    padded = np.zeros((n_head_kv, n_tiles * FA_TILE_KV, hd), np.float32)
    padded[:, :n_cells] = k
    return np.ascontiguousarray(
        padded.reshape(n_head_kv, n_tiles, FA_TILE_KV, hd).transpose(0, 1, 3, 2))


# --- the API -------------------------------------------------------------------------------------

def kv_length(n_used: int, cache_size: int, pad: int = KV_PAD) -> int:
    """llama_kv_cache::get_n_kv: the cells ggml attends over (used cells padded to 256)."""
    return min(cache_size, max(pad, -(-n_used // pad) * pad))


def attention_mask(q_pos: np.ndarray, k_pos: np.ndarray, window: int = 0) -> np.ndarray:
    """f32 [n_rows, n_cells]: 0 where query i sees cell j, -inf where hidden.

    Hidden: a later key (k_pos > q_pos), or with a sliding ``window`` (gemma3's standard SWA),
    one ``window`` or more positions back, as llama_hparams::is_masked_swa.
    """
    qp = np.asarray(q_pos, np.int64)[:, None]
    kp = np.asarray(k_pos, np.int64)[None, :]
    hidden = kp > qp
    if window:
        hidden |= qp - kp >= window
    return np.where(hidden, F32(-np.inf), F32(0))


def flash_attn_f16(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray | None,
                   scale: float, n_kv: int | None = None, n_threads: int = 2) -> np.ndarray:
    """ggml_flash_attn_ext with an f16 K/V cache, as llama-server's CPU backend computes it.

    q: f32 [n_rows, n_head, hd] (after RoPE); k, v: [n_head_kv, T, hd] f16 values (float16, or
    float32 holding f16 values as kv_cache keeps them); head h reads kv head h // (n_head /
    n_head_kv). mask: [n_rows, T] additive, 0 / -inf (rounded to f16 as ggml stores it), or
    None when every one of the T cells is visible. n_kv: the cells ggml sees (:func:`kv_length`,
    default T); cells T..n_kv-1 are hidden padding, and n_kv decides the decode split.
    Returns f32 [n_rows, n_head, hd].
    """
    q = np.ascontiguousarray(q, np.float32)
    k = np.ascontiguousarray(k, np.float32)
    v = np.ascontiguousarray(v, np.float32)
    n_rows, n_head, hd = q.shape
    n_head_kv, n_cells, _ = k.shape
    if k.shape != v.shape or k.shape[2] != hd or n_head % n_head_kv:
        raise ValueError(f"q {q.shape}, k {k.shape}, v {v.shape} do not fit together")
    n_kv = n_cells if n_kv is None else int(n_kv)
    if n_kv < n_cells:
        raise ValueError(f"n_kv {n_kv} is shorter than the {n_cells} cells given")
    has_mask = mask is not None
    if has_mask:
        mask = np.asarray(mask)
        if mask.shape != (n_rows, n_cells):
            raise ValueError(f"mask {mask.shape} is not [n_rows, T] = {(n_rows, n_cells)}")
        mask = np.ascontiguousarray(mask.astype(np.float16).astype(np.float32))
    else:
        mask = np.zeros((1, 1), np.float32)
    group = n_head // n_head_kv
    out = np.empty((n_rows, n_head, hd), np.float32)
    if n_rows == 0 or n_cells == 0:
        out[:] = 0
        return out
    if n_rows >= FA_TILE_Q:
        _tiled(q, _k_tiles(k), v, mask, has_mask, F32(scale), group, out)
    elif n_rows == 1 and n_kv >= SPLIT_MIN_CELLS:
        _split_decode(q, k, v, mask, has_mask, F32(scale), group, n_kv, max(1, int(n_threads)), out)
    else:
        _one_chunk(q, k, v, mask, has_mask, F32(scale), group, out)
    return out
