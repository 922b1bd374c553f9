"""NumPy twins of the decode step's CUDA kernels (``cuda/rms_norm_q8_1.cu``, ``rope_kv_f16.cu``,
``attn_decode_f16.cu``, ``swiglu_q8_1.cu``, ``argmax_f32.cu``, ``get_rows.cu``).

Each function computes what its kernel computes, rounding where it rounds and adding in its
order (the kernels' comments say the order; docs/modules/device_twins.md too): f32 operations
one at a time, partial sums per thread in the kernel's stride order, warps summed by the xor
butterfly (``cuda_twins.butterfly_sum``, lane 0's) and then in warp order, e^x by ``exp_rn``
(IEEE operations only, not a library exp), q8_1 blocks by ``cuda_twins.quantize_q8_1``.
Nothing here needs CuPy or a GPU; ``device_step`` runs them through a stand-in CuPy in the tests.
"""

from __future__ import annotations

import numpy

from bankml.engine_cupy.cuda_twins import Q8_1, QK, WARP, butterfly_sum, quantize_q8_1

F32 = numpy.float32
NORM_THREADS = 256  # rms_norm_q8_1.cu
ATTN_WARPS = 4  # attn_decode_f16.cu
ATTN_MAX_HD = 256
ARGMAX_THREADS = 1024  # argmax_f32.cu
TOPK_THREADS = 1024  # top_k_f32.cu

_LOG2E = F32(1.44269504)
_LN2_HI = F32(0.693145751953125)
_LN2_LO = F32(1.42860677e-06)
_EXP_COEFFS = tuple(
    F32(c) for c in (1.38888889e-03, 8.33333333e-03, 4.16666667e-02, 1.66666667e-01, 0.5, 1.0, 1.0)
)


def exp_rn(x: numpy.ndarray) -> numpy.ndarray:
    """step_common.cuh's exp_rn: e^x as n = rint(x·log2 e), r = x − n·ln2 (two parts), Horner's
    rule on the Taylor series to r^7, times 2^n; 0 below −87, +inf above 88. f32, elementwise."""
    x = numpy.asarray(x, F32)
    xc = numpy.clip(x, F32(-87), F32(88))
    n = numpy.rint(xc * _LOG2E)
    r = (xc - n * _LN2_HI) - n * _LN2_LO
    p = numpy.full_like(r, F32(1.98412698e-04))
    for c in _EXP_COEFFS:
        p = p * r + c
    scale = ((n.astype(numpy.int32) + 127) << 23).astype(numpy.int32).view(F32)
    out = p * scale
    out = numpy.where(x < F32(-87), F32(0), out)
    return numpy.where(x > F32(88), F32(numpy.inf), out).astype(F32)


def _strided_sums(v: numpy.ndarray, threads: int) -> numpy.ndarray:
    """Thread t's f32 sum of v[t], v[t + threads], ... in that order (0.0 where it has none)."""
    acc = numpy.zeros(threads, F32)
    for start in range(0, v.shape[0], threads):
        chunk = v[start : start + threads]
        acc[: chunk.shape[0]] += chunk
    return acc


def _block_sum(per_thread: numpy.ndarray) -> F32:
    """Warps' butterflies (lane 0's), then the warps added in order from 0.0."""
    warps = butterfly_sum(per_thread.reshape(-1, WARP))
    total = F32(0)
    for w in warps:
        total = F32(total + w)
    return total


def rms_norm_q8_1(
    x: numpy.ndarray, delta: numpy.ndarray | None, weight: numpy.ndarray, eps: float
) -> tuple[numpy.ndarray, Q8_1]:
    """The twin of rms_norm_q8_1.cu: x (+ delta), and the q8_1 blocks of its RMSNorm times
    weight. Returns the new x (the residual stream) and the blocks."""
    x = numpy.asarray(x, F32)
    if delta is not None:
        x = x + numpy.asarray(delta, F32)
    n = x.shape[0]
    total = _block_sum(_strided_sums(x * x, NORM_THREADS))
    scale = F32(1) / numpy.sqrt(total / F32(n) + F32(eps))
    return x, quantize_q8_1((x * scale) * numpy.asarray(weight, F32))


def silu_mul(gate: numpy.ndarray, up: numpy.ndarray) -> numpy.ndarray:
    """(g / (1 + e^-g)) · u as swiglu_q8_1.cu computes it."""
    g = numpy.asarray(gate, F32)
    with numpy.errstate(over="ignore"):
        return (g / (F32(1) + exp_rn(-g))) * numpy.asarray(up, F32)


def swiglu_q8_1(gate: numpy.ndarray, up: numpy.ndarray) -> Q8_1:
    """The twin of swiglu_q8_1.cu."""
    return quantize_q8_1(silu_mul(gate, up))


def to_f16(x: numpy.ndarray) -> numpy.ndarray:
    return numpy.asarray(x, F32).astype(numpy.float16)


def rope_pairs(
    x: numpy.ndarray, cos: numpy.ndarray, sin: numpy.ndarray, neox: bool
) -> numpy.ndarray:
    """x [heads, hd] turned by one position's cos/sin [hd/2]: a cos − b sin, a sin + b cos."""
    half = x.shape[-1] // 2
    out = numpy.empty_like(x)
    ia = numpy.arange(half) if neox else 2 * numpy.arange(half)
    ib = ia + half if neox else ia + 1
    a, b = x[:, ia], x[:, ib]
    out[:, ia] = a * cos - b * sin
    out[:, ib] = a * sin + b * cos
    return out


def rope_kv_f16(
    q: numpy.ndarray,
    k: numpy.ndarray,
    v: numpy.ndarray,
    bias: numpy.ndarray | None,
    pos: int,
    cos_table: numpy.ndarray,
    sin_table: numpy.ndarray,
    k_cache: numpy.ndarray,
    v_cache: numpy.ndarray,
    hd: int,
    neox: bool,
) -> numpy.ndarray:
    """The twin of rope_kv_f16.cu: stores K and V at ``pos`` of the layer's caches (f16
    [n_head_kv, n_ctx, hd], in place) and returns Q turned and rounded to f16, as f32."""
    q, k, v = (numpy.asarray(a, F32) for a in (q, k, v))
    if bias is not None:
        nq, nk = q.shape[0], k.shape[0]
        q, k, v = q + bias[:nq], k + bias[nq : nq + nk], v + bias[nq + nk :]
    cos, sin = cos_table[pos], sin_table[pos]
    q_out = rope_pairs(q.reshape(-1, hd), cos, sin, neox)
    k_out = rope_pairs(k.reshape(-1, hd), cos, sin, neox)
    k_cache[:, pos] = to_f16(k_out)
    v_cache[:, pos] = to_f16(v.reshape(-1, hd))
    return to_f16(q_out).astype(F32).reshape(-1)


def attn_decode_f16(
    q: numpy.ndarray,
    k_cache: numpy.ndarray,
    v_cache: numpy.ndarray,
    pos: int,
    n_head: int,
    scale: float,
) -> numpy.ndarray:
    """The twin of attn_decode_f16.cu before its quantization: the heads' outputs f32
    [n_head * hd] over positions 0..pos of the f16 caches [n_head_kv, n_ctx, hd]."""
    n_kv, _, hd = k_cache.shape
    group = n_head // n_kv
    T = pos + 1
    threads = ATTN_WARPS * WARP
    qh = numpy.asarray(q, F32).reshape(n_head, hd)
    out = numpy.empty((n_head, hd), F32)
    for h in range(n_head):
        keys = k_cache[h // group, :T].astype(F32)  # [T, hd]
        vals = v_cache[h // group, :T].astype(F32)
        prods = keys * qh[h]  # [T, hd]: each product rounded to f32
        # lane l adds dims l, l + 32, ... in order
        lanes = numpy.zeros((T, WARP), F32)
        for start in range(0, hd, WARP):
            lanes += prods[:, start : start + WARP]
        s = butterfly_sum(lanes) * F32(scale)  # [T]
        e = exp_rn(s - s.max())
        total = _block_sum(_strided_sums(e, threads))
        acc = numpy.zeros(hd, F32)
        for t in range(T):
            acc += e[t] * vals[t]
        out[h] = acc / total
    return out.reshape(-1)


def attn_decode_q8_1(
    q: numpy.ndarray,
    k_cache: numpy.ndarray,
    v_cache: numpy.ndarray,
    pos: int,
    n_head: int,
    scale: float,
) -> Q8_1:
    """The twin of attn_decode_f16.cu: its output as q8_1 blocks."""
    return quantize_q8_1(attn_decode_f16(q, k_cache, v_cache, pos, n_head, scale))


def argmax_f32(x: numpy.ndarray) -> int:
    """The twin of argmax_f32.cu: the lowest index of the largest value (no NaN)."""
    return int(numpy.argmax(numpy.asarray(x, F32)))


def top_k_f32(x: numpy.ndarray, k: int) -> numpy.ndarray:
    """The twin of top_k_f32.cu: int32 [2k + 1], the ids of the k largest values (largest
    first, equal values in index order, NaN never chosen), their f32 bits, then 1 where a value
    is NaN; a slot no value fills holds -1 and -inf."""
    x = numpy.asarray(x, F32)
    valid = numpy.flatnonzero(~numpy.isnan(x))
    order = valid[numpy.argsort(-x[valid], kind="stable")][:k]
    ids = numpy.full(k, -1, numpy.int32)
    vals = numpy.full(k, -numpy.inf, F32)
    ids[: len(order)], vals[: len(order)] = order, x[order]
    nan = numpy.asarray([len(valid) < len(x)], numpy.int32)
    return numpy.concatenate([ids, vals.view(numpy.int32), nan])


def get_rows_q8_0(w: numpy.ndarray, token: int, ncols: int) -> numpy.ndarray:
    """The twin of get_rows.cu's get_rows_q8_0: row ``token`` of Q8_0 blocks as f32 (d · q)."""
    b = numpy.asarray(w, numpy.uint8)[token].reshape(ncols // QK, 34)
    d = numpy.ascontiguousarray(b[:, 0:2]).view("<f2").astype(F32)
    q = b[:, 2:].view(numpy.int8).astype(F32)
    return (d * q).reshape(-1)
