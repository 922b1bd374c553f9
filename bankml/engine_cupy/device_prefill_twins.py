"""NumPy twins of the prefill's CUDA kernels (``cuda/dequantize_f16.cu``, ``cuda/prefill_f16.cu``)
and of its cuBLAS products.

- ``dequantize_f16(qtype, w)``: each value by the kernel's index arithmetic and its f32
  formula (ggml's CPU dequantization, one rounding per operation), then rounded to f16 once.
- ``add_rms_norm_f16``, ``rope_kv_f16_n``, ``attn_prefill_f16``, ``swiglu_f16``: the decode
  step's twins (device_twins) row by row, f16 in and out where the step has q8_1.
- ``gemm_f16(a, w)``: the product the prefill asks cuBLAS for: f16 rows times f16 weights,
  products and sums in f32, the result rounded to f16. The order of cuBLAS's additions is its
  own (tiles, split-k), so this twin fixes the rounding points, not the bits.

Nothing here needs CuPy or a GPU.
"""

from __future__ import annotations

import numpy

from bankml.engine_cupy import device_twins as dt
from bankml.engine_cupy.cuda_twins import BLOCK_TYPES, scale_min_k4

F32 = numpy.float32
F16 = numpy.float16


def _f16_at(b: numpy.ndarray, at: int) -> numpy.ndarray:
    return numpy.ascontiguousarray(b[..., at : at + 2]).view("<f2")[..., 0].astype(F32)


def _nibble32(qs: numpy.ndarray) -> numpy.ndarray:
    """Values 0..31 of 16 quant bytes [..., 16]: low nibbles, then high. int32 [..., 32]."""
    q = qs.astype(numpy.int32)
    return numpy.concatenate([q & 0xF, q >> 4], axis=-1)


def dequantize_values(qtype: str, w: numpy.ndarray) -> numpy.ndarray:
    """The kernel's f32 value of every weight, before the f16 rounding: f32 [rows, cols]."""
    bt = BLOCK_TYPES[qtype]
    w = numpy.asarray(w, numpy.uint8)
    rows = w.shape[0]
    b = w.reshape(rows, -1, bt.block_bytes)
    if qtype in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"):
        d = _f16_at(b, 0)[..., None]
        if qtype == "Q8_0":
            out = b[..., 2:34].view(numpy.int8).astype(F32) * d
        else:
            start = {"Q4_0": 2, "Q4_1": 4, "Q5_0": 6, "Q5_1": 8}[qtype]
            q = _nibble32(b[..., start : start + 16])
            if qtype in ("Q5_0", "Q5_1"):
                qh = numpy.ascontiguousarray(b[..., start - 4 : start]).view("<u4")  # [.., 1]
                q = q | (((qh >> numpy.arange(32, dtype=numpy.uint32)) & 1) << 4).astype(
                    numpy.int32
                )
            if qtype in ("Q4_0", "Q5_0"):
                out = (q - (8 if qtype == "Q4_0" else 16)).astype(F32) * d
            else:
                out = q.astype(F32) * d + _f16_at(b, 2)[..., None]
        return out.reshape(rows, -1)
    j = numpy.arange(256)
    if qtype in ("Q2_K", "Q3_K"):
        h, k, l = j // 128, (j % 128) // 32, j % 32
        at = 16 if qtype == "Q2_K" else 32
        q = (b[..., at + 32 * h + l].astype(numpy.int32) >> (2 * k)) & 3
        if qtype == "Q2_K":
            sc = b[..., j // 16].astype(numpy.int32)
            dl = _f16_at(b, 80)[..., None] * (sc & 0xF).astype(F32)
            ml = _f16_at(b, 82)[..., None] * (sc >> 4).astype(F32)
            return (dl * q.astype(F32) - ml).reshape(rows, -1)
        q = q - numpy.where((b[..., l].astype(numpy.int32) >> (4 * h + k)) & 1, 0, 4)
        i = j // 16
        low = (b[..., 96 + i % 8].astype(numpy.int32) >> (4 * (i // 8))) & 0xF
        high = ((b[..., 104 + i % 4].astype(numpy.int32) >> (2 * (i // 4))) & 3) << 4
        dl = _f16_at(b, 108)[..., None] * ((low | high) - 32).astype(F32)
        return (dl * q.astype(F32)).reshape(rows, -1)
    if qtype in ("Q4_K", "Q5_K"):
        five = qtype == "Q5_K"
        g, l = j // 64, j % 64
        sub = 2 * g + (l >= 32)
        qs = b[..., (48 if five else 16) + 32 * g + l % 32].astype(numpy.int32)
        q = numpy.where(l < 32, qs & 0xF, qs >> 4)
        if five:
            q = q + (((b[..., 16 + j % 32].astype(numpy.int32) >> sub) & 1) << 4)
        sc, mn = scale_min_k4(b[..., 4:16])  # [rows, blocks, 8]
        d1 = _f16_at(b, 0)[..., None] * sc[..., sub].astype(F32)
        m1 = _f16_at(b, 2)[..., None] * mn[..., sub].astype(F32)
        return (d1 * q.astype(F32) - m1).reshape(rows, -1)
    # Q6_K
    h, k, l = j // 128, (j % 128) // 32, j % 32
    ql = b[..., 64 * h + l + 32 * (k % 2)].astype(numpy.int32)
    lo = numpy.where(k < 2, ql & 0xF, ql >> 4)
    hi = (b[..., 128 + 32 * h + l].astype(numpy.int32) >> (2 * k)) & 3
    sc = b[..., 192 + 8 * h + l // 16 + 2 * k].view(numpy.int8).astype(F32)
    return ((_f16_at(b, 208)[..., None] * sc) * ((lo | (hi << 4)) - 32).astype(F32)).reshape(
        rows, -1
    )


def dequantize_f16(qtype: str, w: numpy.ndarray) -> numpy.ndarray:
    """The twin of dequantize_f16_<type>: f16 [rows, cols]."""
    return dequantize_values(qtype, w).astype(F16)


def gemm_f16(a: numpy.ndarray, w: numpy.ndarray) -> numpy.ndarray:
    """f16 rows a [n, k] times f16 weights w [m, k]: f32 products and sums, f16 [n, m]."""
    return (numpy.asarray(a, F16).astype(F32) @ numpy.asarray(w, F16).astype(F32).T).astype(F16)


def add_rms_norm_f16(
    x: numpy.ndarray, delta: numpy.ndarray | None, weight: numpy.ndarray, eps: float
) -> tuple[numpy.ndarray, numpy.ndarray]:
    """The twin of add_rms_norm_f16 over rows x [n, d]: the new x, and f16 [n, d]."""
    x, y = add_rms_norm_f32(x, delta, weight, eps)
    return x, y.astype(F16)


def add_rms_norm_f32(
    x: numpy.ndarray, delta: numpy.ndarray | None, weight: numpy.ndarray, eps: float
) -> tuple[numpy.ndarray, numpy.ndarray]:
    """add_rms_norm_f16's arithmetic (its order of additions) without the f16 rounding of its
    result: the new x, and f32 [n, d]. The prefill's hidden states (``DevicePrefill.hidden``)
    take their last add and output norm from it, on the host."""
    x = numpy.asarray(x, F32)
    if delta is not None:
        x = x + numpy.asarray(delta, F16).astype(F32)
    y = numpy.empty(x.shape, F32)
    for r in range(x.shape[0]):
        total = dt._block_sum(dt._strided_sums(x[r] * x[r], dt.NORM_THREADS))
        scale = F32(1) / numpy.sqrt(total / F32(x.shape[1]) + F32(eps))
        y[r] = (x[r] * scale) * numpy.asarray(weight, F32)
    return x, y


def rope_kv_f16_n(
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
    """The twin of rope_kv_f16_n: row r of the f16 rows q, k, v at position pos + r; K and V
    into the layer's f16 caches in place; Q turned, f16 [n, n_head * hd]."""
    n = q.shape[0]
    out = numpy.empty(q.shape, F16)
    for r in range(n):
        q_f, k_f, v_f = (numpy.asarray(a[r], F16).astype(F32) for a in (q, k, v))
        q_r = dt.rope_kv_f16(
            q_f, k_f, v_f, bias, pos + r, cos_table, sin_table, k_cache, v_cache, hd, neox
        )
        out[r] = q_r.astype(F16)
    return out


def attn_prefill_f16(
    q: numpy.ndarray,
    k_cache: numpy.ndarray,
    v_cache: numpy.ndarray,
    pos: int,
    n_head: int,
    scale: float,
) -> numpy.ndarray:
    """The twin of attn_prefill_f16: row r attends to positions 0..pos + r; f16 [n, nh * hd]."""
    n = q.shape[0]
    out = numpy.empty(q.shape, F16)
    for r in range(n):
        q_r = numpy.asarray(q[r], F16).astype(F32)
        out[r] = dt.attn_decode_f16(q_r, k_cache, v_cache, pos + r, n_head, scale).astype(F16)
    return out


def swiglu_f16(gate: numpy.ndarray, up: numpy.ndarray) -> numpy.ndarray:
    """The twin of swiglu_f16: f16(silu(g) · u) of f16 inputs."""
    g = numpy.asarray(gate, F16).astype(F32)
    return dt.silu_mul(g, numpy.asarray(up, F16).astype(F32)).astype(F16)
