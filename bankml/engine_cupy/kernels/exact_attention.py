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
from numba.core import cgutils
from numba.extending import intrinsic

from bankml.engine_cupy.kernels.exact_ops import ggml_v_expf
from bankml.engine_cupy.kernels.jit import f16_round, fma32, njit

__all__ = [
    "flash_attn_f16",
    "flash_attn_q8_0",
    "one_row_f16",
    "attention_mask",
    "kv_length",
    "warm_up",
    "FA_TILE_Q",
    "FA_TILE_KV",
    "SPLIT_MIN_CELLS",
    "KV_PAD",
]

F32 = np.float32
FA_TILE_Q = 64  # GGML_FA_TILE_Q: from this many query rows the tiled kernel runs
FA_TILE_KV = 64  # GGML_FA_TILE_KV: cells per tile in the tiled kernel
SPLIT_MIN_CELLS = 512  # one query row over this many cells is split across the threads
KV_PAD = 256  # llama_kv_cache::get_n_kv pads the attended cells to a multiple of 256
# From this many (row, head, cell) visits (~20 ns each) the tasks are spread over Numba's
# threads. Decoding stays on one thread: waking the pool saves ~0.1 ms at T = 1000, but when
# the cores are busy a parallel region can wait a whole scheduler slice for a thread (~10 ms).
PARALLEL_MIN_WORK = 65536

_NEG_INF = F32(-np.inf)
_ZERO = F32(0.0)
_ONE = F32(1.0)


# --- the one-row kernel (fewer than 64 rows, and the chunks of a split decode) -------------------


@intrinsic
def _dot_f16_body(typingctx: Any, arr: Any, offset: Any, q: Any, n: Any) -> Any:
    """Σ arr.flat[offset + i] * q[i], i < n (a multiple of 32), as ggml_vec_dot_f16's SIMD part.

    Written as LLVM vector code (four <8 x float> fma accumulators over steps of 32, then
    GGML_F32x8_REDUCE: (a0 + a2) + (a1 + a3), the two 128-bit halves added, then
    (t0 + t1) + (t2 + t3) as the two hadds) because Numba's scalar loops of the same order
    do not vectorise; arr and q must be C-contiguous float32.
    """
    sig = types.float32(arr, types.intp, q, types.intp)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        f32 = ir.FloatType()
        v8 = ir.VectorType(f32, 8)
        keys = context.make_array(signature.args[0])(context, builder, args[0])
        query = context.make_array(signature.args[2])(context, builder, args[2])
        offset, n = args[1], args[3]
        base = builder.gep(keys.data, [offset])
        fma = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(v8, [v8] * 3), "llvm.fma.v8f32"
        )
        zero = ir.Constant(v8, [0.0] * 8)
        accs = [cgutils.alloca_once_value(builder, zero) for _ in range(4)]
        step = ir.Constant(n.type, 32)
        with cgutils.for_range_slice(builder, ir.Constant(n.type, 0), n, step) as (i, _):
            for j, acc in enumerate(accs):
                at = builder.add(i, ir.Constant(n.type, 8 * j))
                kp = builder.bitcast(builder.gep(base, [at]), v8.as_pointer())
                kv = builder.load(kp, align=4)
                qv = builder.load(
                    builder.bitcast(builder.gep(query.data, [at]), v8.as_pointer()), align=4
                )
                builder.store(builder.call(fma, [kv, qv, builder.load(acc)]), acc)
        a = [builder.load(acc) for acc in accs]
        x = builder.fadd(builder.fadd(a[0], a[2]), builder.fadd(a[1], a[3]))
        i4 = ir.VectorType(ir.IntType(32), 4)
        lo = builder.shuffle_vector(x, x, ir.Constant(i4, [0, 1, 2, 3]))
        hi = builder.shuffle_vector(x, x, ir.Constant(i4, [4, 5, 6, 7]))
        t = builder.fadd(lo, hi)
        e = [builder.extract_element(t, ir.Constant(ir.IntType(32), m)) for m in range(4)]
        return builder.fadd(builder.fadd(e[0], e[1]), builder.fadd(e[2], e[3]))

    return sig, codegen


@njit(inline="always")
def _online_softmax_step(s: float, big_m: float) -> tuple[float, float, float, bool]:
    """One cell of ggml's online softmax (one_chunk): (new max M, scale ms of what was
    accumulated, weight vs of this cell, whether M moved). A new maximum scales the old sum and
    accumulator by expf(M_old - s) and weighs the cell 1; otherwise the cell weighs expf(s - M)."""
    if s > big_m:
        return s, F32(math.exp(big_m - s)), _ONE, True
    return big_m, _ONE, F32(math.exp(s - big_m)), False


@njit(inline="always")
def _dot_f16(k: Any, kvh: int, ic: int, q16: Any) -> float:
    """ggml_vec_dot_f16 (AVX2 + F16C) of the key k[kvh, ic] with the f16-rounded query.

    Products of two f16 values are exact in f32, so each fma is one rounding of a sum and
    only the order matters: the SIMD part (_dot_f16_body), then the leftover elements added
    in double, and the double rounded to float.
    """
    hd = q16.shape[0]
    body = hd & ~31
    total = np.float64(_dot_f16_body(k, (kvh * k.shape[1] + ic) * hd, q16, body))
    for i in range(body, hd):
        total += np.float64(k[kvh, ic, i] * q16[i])
    return F32(total)


@njit(inline="always")
def _mad_f16(acc: Any, v: Any, kvh: int, ic: int, w: float) -> None:
    """ggml_vec_mad_f16: acc = f16(v[kvh, ic] * w + acc), one fma rounding then the f16 one."""
    for d in range(acc.shape[0]):
        acc[d] = f16_round(fma32(v[kvh, ic, d], w, acc[d]))


@njit(inline="always")
def _walk_f16(
    q16: Any,
    k: Any,
    v: Any,
    n_cells: int,
    kvh: int,
    mask: Any,
    row: int,
    has_mask: bool,
    c0: int,
    c1: int,
    scale: float,
    acc: Any,
) -> tuple[float, float]:
    """ggml_compute_forward_flash_attn_ext_f16_one_chunk for one (row, head) over cells c0..c1.

    ``acc`` (float32 holding f16 values) ends as the unnormalised V·softmax; returns (M, S).
    Cells at or past ``n_cells`` are llama.cpp's padding, hidden by its mask (k and v may be
    longer: the whole cache buffer, of which the first n_cells cells are attended).
    """
    hd = acc.shape[0]
    end = min(c1, n_cells)
    # the scores first: they do not depend on the running state, and a tight loop of dot
    # products pipelines better than one interleaved with the accumulator (17 vs 25 ns a cell)
    scores = np.empty(max(end - c0, 0), np.float32)
    for ic in range(c0, end):
        mv = mask[row, ic] if has_mask else _ZERO
        if mv != _NEG_INF:
            scores[ic - c0] = _dot_f16(k, kvh, ic, q16) * scale + mv
    for d in range(hd):
        acc[d] = _ZERO
    big_s = _ZERO
    big_m = _NEG_INF
    for ic in range(c0, end):
        if has_mask and mask[row, ic] == _NEG_INF:
            continue  # ggml skips hidden cells before any arithmetic
        big_m, ms, vs, new_max = _online_softmax_step(scores[ic - c0], big_m)
        if new_max:
            for d in range(hd):
                acc[d] = f16_round(acc[d] * ms)
        _mad_f16(acc, v, kvh, ic, vs)
        big_s = fma32(big_s, ms, vs)  # S = S*ms + vs: GCC fuses it (see the docs)
    return big_m, big_s


@njit(inline="always")
def _one_chunk_task(
    task: int,
    q: Any,
    k: Any,
    v: Any,
    n_cells: int,
    mask: Any,
    has_mask: bool,
    scale: float,
    group: int,
    out: Any,
) -> None:
    """One (row, head) over all cells, normalised by 1/S (the path for 1..63 rows)."""
    n_head, hd = q.shape[1], q.shape[2]
    row = task // n_head
    h = task % n_head
    q16 = np.empty(hd, np.float32)
    for d in range(hd):
        q16[d] = f16_round(q[row, h, d])
    acc = np.empty(hd, np.float32)
    _, big_s = _walk_f16(
        q16, k, v, n_cells, h // group, mask, row, has_mask, 0, n_cells, scale, acc
    )
    s_inv = _ZERO if big_s == _ZERO else _ONE / big_s
    for d in range(hd):
        out[row, h, d] = acc[d] * s_inv


@njit
def _one_chunk_serial(
    q: Any,
    k: Any,
    v: Any,
    n_cells: int,
    mask: Any,
    has_mask: bool,
    scale: float,
    group: int,
    out: Any,
) -> None:
    for task in range(q.shape[0] * q.shape[1]):
        _one_chunk_task(task, q, k, v, n_cells, mask, has_mask, scale, group, out)


@njit(parallel=True)
def _one_chunk_parallel(
    q: Any,
    k: Any,
    v: Any,
    n_cells: int,
    mask: Any,
    has_mask: bool,
    scale: float,
    group: int,
    out: Any,
) -> None:
    for task in prange(q.shape[0] * q.shape[1]):
        _one_chunk_task(task, q, k, v, n_cells, mask, has_mask, scale, group, out)


@njit(inline="always")
def _split_task(
    task: int,
    q: Any,
    k: Any,
    v: Any,
    n_cells: int,
    mask: Any,
    has_mask: bool,
    scale: float,
    group: int,
    n_kv: int,
    chunk: int,
    part_m: Any,
    part_s: Any,
    part_acc: Any,
) -> None:
    """Thread c's chunk of cells for head h: its partial (M, S, acc), as ggml writes it."""
    n_threads = part_m.shape[1]
    hd = q.shape[2]
    h = task // n_threads
    c = task % n_threads
    c0 = c * chunk
    if c0 >= n_kv:
        part_m[h, c] = _NEG_INF
        part_s[h, c] = _ZERO
        return
    q16 = np.empty(hd, np.float32)
    for d in range(hd):
        q16[d] = f16_round(q[0, h, d])
    m, s = _walk_f16(
        q16,
        k,
        v,
        n_cells,
        h // group,
        mask,
        0,
        has_mask,
        c0,
        min(c0 + chunk, n_kv),
        scale,
        part_acc[h, c],
    )
    part_m[h, c] = m
    part_s[h, c] = s


@njit
def _split_serial(
    q: Any,
    k: Any,
    v: Any,
    n_cells: int,
    mask: Any,
    has_mask: bool,
    scale: float,
    group: int,
    n_kv: int,
    chunk: int,
    part_m: Any,
    part_s: Any,
    part_acc: Any,
) -> None:
    for task in range(part_m.size):
        _split_task(
            task,
            q,
            k,
            v,
            n_cells,
            mask,
            has_mask,
            scale,
            group,
            n_kv,
            chunk,
            part_m,
            part_s,
            part_acc,
        )


@njit(parallel=True)
def _split_parallel(
    q: Any,
    k: Any,
    v: Any,
    n_cells: int,
    mask: Any,
    has_mask: bool,
    scale: float,
    group: int,
    n_kv: int,
    chunk: int,
    part_m: Any,
    part_s: Any,
    part_acc: Any,
) -> None:
    for task in prange(part_m.size):
        _split_task(
            task,
            q,
            k,
            v,
            n_cells,
            mask,
            has_mask,
            scale,
            group,
            n_kv,
            chunk,
            part_m,
            part_s,
            part_acc,
        )


@njit
def _reduce_all(part_m: Any, part_s: Any, part_acc: Any, chunk: int, n_kv: int, out: Any) -> None:
    for h in range(part_m.shape[0]):
        _reduce_partials(part_m[h], part_s[h], part_acc[h], chunk, n_kv, out[0, h])


@njit(inline="always")
def _reduce_partials(
    part_m: Any, part_s: Any, part_acc: Any, chunk: int, n_kv: int, out: Any
) -> None:
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
    """reduce_partials' a*scale_old + b*scale_new: GCC fuses the first product (see the docs)."""
    return fma32(a, sa, b * sb)


@njit
def one_row_f16(
    q: Any,
    k: Any,
    v: Any,
    n_cells: int,
    mask: Any,
    has_mask: bool,
    scale: float,
    group: int,
    n_kv: int,
    n_threads: int,
    parallel: bool,
    out: Any,
) -> None:
    """flash_attn_f16's one-row branches (a decode step) callable from compiled code (the fused
    decode step, exact_decode): from SPLIT_MIN_CELLS cells of n_kv, one chunk of cells per
    thread for each head, then the partials merged in chunk order; below that, each head over
    all its cells. ``parallel`` spreads the (head, chunk) tasks over Numba's threads: each task
    writes only its own partial and the merge keeps its order, so the bits are the same either
    way. Arguments as flash_attn_f16's after its checks (k, v the whole cell buffers, the first
    n_cells attended; mask already rounded to f16; n_threads >= 1)."""
    n_head, hd = q.shape[1], q.shape[2]
    if n_kv < SPLIT_MIN_CELLS:
        if parallel:
            _one_chunk_parallel(q, k, v, n_cells, mask, has_mask, scale, group, out)
        else:
            _one_chunk_serial(q, k, v, n_cells, mask, has_mask, scale, group, out)
        return
    chunk = -(-n_kv // n_threads)
    part_m = np.empty((n_head, n_threads), np.float32)
    part_s = np.empty((n_head, n_threads), np.float32)
    part_acc = np.empty((n_head, n_threads, hd), np.float32)
    if parallel:
        _split_parallel(
            q, k, v, n_cells, mask, has_mask, scale, group, n_kv, chunk, part_m, part_s, part_acc
        )
    else:
        _split_serial(
            q, k, v, n_cells, mask, has_mask, scale, group, n_kv, chunk, part_m, part_s, part_acc
        )
    _reduce_all(part_m, part_s, part_acc, chunk, n_kv, out)


# --- the tiled kernel (64 rows or more) ----------------------------------------------------------


def _fma_chains(n_vectors: int) -> Any:
    """An intrinsic: out.flat[out_at + i] = fma(a.flat[a_at + t*a_step + i], b.flat[b_at + t], .)
    over t < n, for i < 8 * n_vectors.

    Each lane is a sequential f32 fma chain started from out's value: the column blocks of
    ggml's simd_gemm (its GGML_F32_VEC_FMA accumulators). Written as LLVM vector code with the
    ``n_vectors`` <8 x float> accumulators in registers and advanced together, so the chains
    overlap instead of waiting on each fma's latency (Numba's loops would spill them).
    """

    @intrinsic
    def fma_chains(
        typingctx: Any,
        out: Any,
        out_at: Any,
        a: Any,
        a_at: Any,
        a_step: Any,
        b: Any,
        b_at: Any,
        n: Any,
    ) -> Any:
        sig = types.void(out, types.intp, a, types.intp, types.intp, b, types.intp, types.intp)

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            v8 = ir.VectorType(ir.FloatType(), 8)
            dst = context.make_array(signature.args[0])(context, builder, args[0])
            rows = context.make_array(signature.args[2])(context, builder, args[2])
            coef = context.make_array(signature.args[5])(context, builder, args[5])
            out_at, a_at, a_step, b_at, n = args[1], args[3], args[4], args[6], args[7]
            fma = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(v8, [v8] * 3), "llvm.fma.v8f32"
            )
            intp = out_at.type
            out_ps, accs = [], []
            for m in range(n_vectors):
                at = builder.add(out_at, ir.Constant(intp, 8 * m))
                out_p = builder.bitcast(builder.gep(dst.data, [at]), v8.as_pointer())
                acc = cgutils.alloca_once(builder, v8)
                builder.store(builder.load(out_p, align=4), acc)
                out_ps.append(out_p)
                accs.append(acc)
            undef = ir.Constant(v8, ir.Undefined)
            zeros = ir.Constant(ir.VectorType(ir.IntType(32), 8), [0] * 8)
            with cgutils.for_range(builder, n) as loop:
                t = loop.index
                row = builder.add(a_at, builder.mul(t, a_step))
                c = builder.load(builder.gep(coef.data, [builder.add(b_at, t)]))
                cv = builder.insert_element(undef, c, ir.Constant(ir.IntType(32), 0))
                cv = builder.shuffle_vector(cv, undef, zeros)
                for m, acc in enumerate(accs):
                    at = builder.add(row, ir.Constant(intp, 8 * m))
                    x = builder.load(
                        builder.bitcast(builder.gep(rows.data, [at]), v8.as_pointer()), align=4
                    )
                    builder.store(builder.call(fma, [x, cv, builder.load(acc)]), acc)
            for acc, out_p in zip(accs, out_ps):
                builder.store(builder.load(acc), out_p, align=4)
            return context.get_dummy_value()

        return sig, codegen

    return fma_chains


_fma_chain8 = _fma_chains(1)
_fma_chain64 = _fma_chains(8)


@njit(inline="always")
def _tile_weights(kq: Any, n: int, big_m: float) -> float:
    """ggml_vec_soft_max_f32 (AVX2) of one tile row: kq[j] = ggml_v_expf(kq[j] - M) in place.

    Returns the sum as ggml takes it: each group of 8 summed in float ((hi4 + lo4), then
    (0+2, 1+3), then the two), the groups added into a double. Hidden cells (-inf) weigh 0.
    """
    for j in range(n - n % 8):
        x = kq[j]
        kq[j] = _ZERO if x == _NEG_INF else ggml_v_expf(x - big_m)
    total = 0.0
    for g in range(0, n - n % 8, 8):
        a0 = kq[g + 4] + kq[g + 0]
        a1 = kq[g + 5] + kq[g + 1]
        a2 = kq[g + 6] + kq[g + 2]
        a3 = kq[g + 7] + kq[g + 3]
        total += np.float64((a0 + a2) + (a1 + a3))
    return total


@njit(inline="always")
def _visible_spans(mask: Any, has_mask: bool, r0: int, n: int, n_cells: int) -> tuple[Any, Any]:
    """The first and last visible cell of rows r0..r0+n-1 (a row with none: first > last).

    A tile outside a row's span is all hidden, which ggml skips; one inside that is still all
    hidden (a hole in the mask) is caught by its -inf maximum.
    """
    first = np.full(n, n_cells, np.int64)
    last = np.full(n, -1, np.int64)
    for i in range(n):
        for j in range(n_cells):
            if not has_mask or mask[r0 + i, j] != _NEG_INF:
                first[i] = min(first[i], j)
                last[i] = j
    return first, last


@njit(inline="always")
def _tile_scores(kq: Any, k_tiles: Any, kvh: int, t: int, q: Any, q_at: int) -> None:
    """kq[j] = the f32 fma chain over d of K[j, d] * q[d], from 0 (simd_gemm of Q by K_f32)."""
    hd = k_tiles.shape[2]
    base = (kvh * k_tiles.shape[1] + t) * hd * FA_TILE_KV
    for j in range(FA_TILE_KV):
        kq[j] = _ZERO
    _fma_chain64(kq, 0, k_tiles, base, FA_TILE_KV, q, q_at, hd)


@njit(inline="always")
def _tile_values(acc: Any, weights: Any, v: Any, kvh: int, c0: int, width: int) -> None:
    """acc[d] = the fma chain over the tile's cells of weight[j] * V[j, d] (simd_gemm by V32).

    Cells past ``width`` weigh 0 in ggml and fma(0, v, acc) == acc, so they are left out.
    """
    hd = acc.shape[0]
    wide = hd & ~63
    body = hd & ~7
    base = (kvh * v.shape[1] + c0) * hd
    for d in range(0, wide, 64):
        _fma_chain64(acc, d, v, base + d, hd, weights, 0, width)
    for d in range(wide, body, 8):
        _fma_chain8(acc, d, v, base + d, hd, weights, 0, width)
    for d in range(body, hd):
        for j in range(width):
            acc[d] = fma32(weights[j], v[kvh, c0 + j, d], acc[d])


ROW_BLOCK = 16  # query rows per tiled task: their (row, head)s share each K and V tile in cache


@njit(inline="always")
def _tiled_task(
    task: int,
    q: Any,
    k_tiles: Any,
    v: Any,
    n_cells: int,
    mask: Any,
    has_mask: bool,
    scale: float,
    group: int,
    out: Any,
) -> None:
    """ggml_compute_forward_flash_attn_ext_tiled for ROW_BLOCK rows and the heads of one KV head.

    Every (row, head) keeps its own running (M, S, acc), exactly as ggml's tile rows do; the
    tiles are the outer loop so that each K and V tile is read from memory once per task.
    ``k_tiles`` [kv_head, tile, hd, 64] holds K transposed per tile, as ggml packs K_f32.
    """
    n_rows, n_head, hd = q.shape
    n_blocks = (n_rows + ROW_BLOCK - 1) // ROW_BLOCK
    kvh = task // n_blocks
    r0 = (task % n_blocks) * ROW_BLOCK
    n_pairs = (min(r0 + ROW_BLOCK, n_rows) - r0) * group
    acc = np.zeros((n_pairs, hd), np.float32)
    big_m = np.full(n_pairs, _NEG_INF, np.float32)
    big_s = np.zeros(n_pairs, np.float32)
    kq = np.empty(FA_TILE_KV, np.float32)
    first, last = _visible_spans(mask, has_mask, r0, n_pairs // group, n_cells)
    for t in range(k_tiles.shape[1]):
        c0 = t * FA_TILE_KV
        width = min(FA_TILE_KV, n_cells - c0)
        for i in range(n_pairs):
            row = r0 + i // group
            h = kvh * group + i % group
            if c0 > last[i // group] or c0 + width <= first[i // group]:
                continue  # ggml skips a tile whose cells are all hidden
            _tile_scores(kq, k_tiles, kvh, t, q, (row * n_head + h) * hd)
            for j in range(width):
                kq[j] = kq[j] * scale
            if has_mask:
                for j in range(width):
                    kq[j] = kq[j] + mask[row, c0 + j]
            for j in range(width, FA_TILE_KV):
                kq[j] = _NEG_INF
            tile_max = _NEG_INF
            for j in range(FA_TILE_KV):
                tile_max = max(tile_max, kq[j])
            if tile_max == _NEG_INF:
                continue  # every cell hidden (a hole in the mask): ggml's skip[tq]
            m_old = big_m[i]
            m_new = max(m_old, tile_max)
            if m_new > m_old:
                ms = F32(math.exp(m_old - m_new))
                for d in range(hd):
                    acc[i, d] = acc[i, d] * ms
                big_s[i] = big_s[i] * ms
            big_m[i] = m_new
            big_s[i] = F32(np.float64(big_s[i]) + _tile_weights(kq, FA_TILE_KV, m_new))
            _tile_values(acc[i], kq, v, kvh, c0, width)
    for i in range(n_pairs):
        s_inv = _ZERO if big_s[i] == _ZERO else _ONE / big_s[i]
        for d in range(hd):
            out[r0 + i // group, kvh * group + i % group, d] = acc[i, d] * s_inv


@njit
def _tiled_serial(
    q: Any,
    k_tiles: Any,
    v: Any,
    n_cells: int,
    mask: Any,
    has_mask: bool,
    scale: float,
    group: int,
    out: Any,
) -> None:
    n_tasks = k_tiles.shape[0] * ((q.shape[0] + ROW_BLOCK - 1) // ROW_BLOCK)
    for task in range(n_tasks):
        _tiled_task(task, q, k_tiles, v, n_cells, mask, has_mask, scale, group, out)


@njit(parallel=True)
def _tiled_parallel(
    q: Any,
    k_tiles: Any,
    v: Any,
    n_cells: int,
    mask: Any,
    has_mask: bool,
    scale: float,
    group: int,
    out: Any,
) -> None:
    n_tasks = k_tiles.shape[0] * ((q.shape[0] + ROW_BLOCK - 1) // ROW_BLOCK)
    for task in prange(n_tasks):
        _tiled_task(task, q, k_tiles, v, n_cells, mask, has_mask, scale, group, out)


@njit
def _pack_k_tiles(k: Any, n_cells: int, out: Any) -> None:
    """out[kvh, t, d, j] = K[kvh, 64 t + j, d], 0 past n_cells (ggml's packed K_f32 tiles)."""
    for kvh in range(out.shape[0]):
        for t in range(out.shape[1]):
            for j in range(FA_TILE_KV):
                c = t * FA_TILE_KV + j
                for d in range(out.shape[2]):
                    out[kvh, t, d, j] = k[kvh, c, d] if c < n_cells else _ZERO


def _k_tiles(k: np.ndarray, n_cells: int) -> np.ndarray:
    """K [kv_head, cells, hd] (the first n_cells of the buffer) as [kv_head, tile, hd, 64]."""
    n_tiles = -(-n_cells // FA_TILE_KV)
    out = np.empty((k.shape[0], n_tiles, k.shape[2], FA_TILE_KV), np.float32)
    _pack_k_tiles(k, n_cells, out)
    return out


# --- the q8_0 cache (one_chunk for every batch: ggml tiles and splits only f16/f32 K/V) --------


@njit(inline="always")
def _quantize_q8_0(x: Any, row: int, h: int, qs: Any, ds: Any) -> None:
    """quantize_row_q8_0 (AVX2) of q[row, h]: per 32 values d = amax/127 (stored as f16),
    q = round-half-even(x * (127/amax)), the query rounded to K's vec_dot type."""
    hd = qs.shape[0]
    for b in range(hd // 32):
        amax = _ZERO
        for j in range(32 * b, 32 * b + 32):
            amax = max(amax, abs(x[row, h, j]))
        ds[b] = f16_round(amax / F32(127.0))
        inv = F32(127.0) / amax if amax != _ZERO else _ZERO
        for j in range(32 * b, 32 * b + 32):
            qs[j] = np.int8(np.rint(x[row, h, j] * inv))


@intrinsic
def _dot_q8_0_body(
    typingctx: Any, kq: Any, k_at: Any, qs: Any, kd: Any, d_at: Any, ds: Any, n_blocks: Any
) -> Any:
    """ggml_vec_dot_q8_0_q8_0 (AVX2) of the key at kq.flat[k_at:] (scales kd.flat[d_at:]) with
    the q8_0 query (qs int8, ds f32), as LLVM vector code.

    Per block: 32 int8 products, summed by pairs in int16 and again in int32 (maddubs, madd:
    exact, as |q| <= 127) into 8 lanes of 4 consecutive products, converted to float and
    fma'd with d_k * d_q into 8 accumulators; then hsum_float_8: r_i = a_i + a_(i+4),
    (r0 + r2) + (r1 + r3).
    """
    sig = types.float32(kq, types.intp, qs, kd, types.intp, ds, types.intp)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        i32 = ir.IntType(32)
        v8f, v8i = ir.VectorType(ir.FloatType(), 8), ir.VectorType(i32, 8)
        keys = context.make_array(signature.args[0])(context, builder, args[0])
        query = context.make_array(signature.args[2])(context, builder, args[2])
        kscale = context.make_array(signature.args[3])(context, builder, args[3])
        qscale = context.make_array(signature.args[5])(context, builder, args[5])
        k_at, d_at, n_blocks = args[1], args[4], args[6]
        intp = k_at.type
        fma = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(v8f, [v8f] * 3), "llvm.fma.v8f32"
        )
        acc = cgutils.alloca_once_value(builder, ir.Constant(v8f, [0.0] * 8))
        bytes32 = ir.VectorType(ir.IntType(8), 32).as_pointer()

        def pick(vec: Any, n: int, start: int) -> Any:
            return builder.shuffle_vector(
                vec, vec, ir.Constant(ir.VectorType(i32, n), list(range(start, 2 * n, 2)))
            )

        with cgutils.for_range(builder, n_blocks) as loop:
            blk = loop.index
            at = builder.mul(blk, ir.Constant(intp, 32))
            kv = builder.load(
                builder.bitcast(builder.gep(keys.data, [builder.add(k_at, at)]), bytes32), align=1
            )
            qv = builder.load(builder.bitcast(builder.gep(query.data, [at]), bytes32), align=1)
            i16x32 = ir.VectorType(ir.IntType(16), 32)
            prod = builder.mul(builder.sext(kv, i16x32), builder.sext(qv, i16x32))
            pairs = builder.add(pick(prod, 16, 0), pick(prod, 16, 1))
            wide = builder.sext(pairs, ir.VectorType(i32, 16))
            quads = builder.add(pick(wide, 8, 0), pick(wide, 8, 1))
            d = builder.fmul(
                builder.load(builder.gep(kscale.data, [builder.add(d_at, blk)])),
                builder.load(builder.gep(qscale.data, [blk])),
            )
            dv = builder.insert_element(ir.Constant(v8f, ir.Undefined), d, ir.Constant(i32, 0))
            dv = builder.shuffle_vector(dv, dv, ir.Constant(v8i, [0] * 8))
            builder.store(
                builder.call(fma, [dv, builder.sitofp(quads, v8f), builder.load(acc)]), acc
            )
        a = builder.load(acc)
        r = [
            builder.fadd(
                builder.extract_element(a, ir.Constant(i32, m)),
                builder.extract_element(a, ir.Constant(i32, m + 4)),
            )
            for m in range(4)
        ]
        return builder.fadd(builder.fadd(r[0], r[2]), builder.fadd(r[1], r[3]))

    return sig, codegen


@intrinsic
def _mad_q8_0_body(
    typingctx: Any, acc: Any, vq: Any, v_at: Any, vd: Any, d_at: Any, w: Any, n_blocks: Any
) -> Any:
    """acc[i] = fma(float(vq.flat[v_at + i]) * vd.flat[d_at + i // 32], w, acc[i]).

    dequantize_row_q8_0 (an exact product) then ggml_vec_mad_f32's fma, 32 values a block as
    LLVM vector code (Numba's loop over int8 values does not vectorise).
    """
    sig = types.void(acc, vq, types.intp, vd, types.intp, types.float32, types.intp)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        i32 = ir.IntType(32)
        v32f = ir.VectorType(ir.FloatType(), 32)
        out = context.make_array(signature.args[0])(context, builder, args[0])
        values = context.make_array(signature.args[1])(context, builder, args[1])
        scales = context.make_array(signature.args[3])(context, builder, args[3])
        v_at, d_at, w, n_blocks = args[2], args[4], args[5], args[6]
        intp = v_at.type
        fma = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(v32f, [v32f] * 3), "llvm.fma.v32f32"
        )
        zeros = ir.Constant(ir.VectorType(i32, 32), [0] * 32)

        def splat(x: Any) -> Any:
            one = builder.insert_element(ir.Constant(v32f, ir.Undefined), x, ir.Constant(i32, 0))
            return builder.shuffle_vector(one, one, zeros)

        wv = splat(w)
        with cgutils.for_range(builder, n_blocks) as loop:
            blk = loop.index
            at = builder.mul(blk, ir.Constant(intp, 32))
            src = builder.bitcast(
                builder.gep(values.data, [builder.add(v_at, at)]),
                ir.VectorType(ir.IntType(8), 32).as_pointer(),
            )
            dv = splat(builder.load(builder.gep(scales.data, [builder.add(d_at, blk)])))
            x = builder.fmul(builder.sitofp(builder.load(src, align=1), v32f), dv)
            dst = builder.bitcast(builder.gep(out.data, [at]), v32f.as_pointer())
            builder.store(builder.call(fma, [x, wv, builder.load(dst, align=4)]), dst, align=4)
        return context.get_dummy_value()

    return sig, codegen


@njit(inline="always")
def _dot_q8_0(kq: Any, kd: Any, kvh: int, ic: int, qs: Any, ds: Any) -> float:
    n_blocks = ds.shape[0]
    return _dot_q8_0_body(
        kq,
        (kvh * kq.shape[1] + ic) * kq.shape[2],
        qs,
        kd,
        (kvh * kd.shape[1] + ic) * n_blocks,
        ds,
        n_blocks,
    )


@njit(inline="always")
def _q8_0_task(
    task: int,
    q: Any,
    kq: Any,
    kd: Any,
    vq: Any,
    vd: Any,
    n_cells: int,
    mask: Any,
    has_mask: bool,
    scale: float,
    group: int,
    out: Any,
) -> None:
    """one_chunk with q8_0 K/V for one (row, head): the f32 V accumulator of ggml's non-f16
    branch (V dequantized exactly, ggml_vec_mad_f32's fma, ggml_vec_scale_f32 at a new max)."""
    n_head, hd = q.shape[1], q.shape[2]
    row = task // n_head
    h = task % n_head
    kvh = h // group
    qs = np.empty(hd, np.int8)
    ds = np.empty(hd // 32, np.float32)
    _quantize_q8_0(q, row, h, qs, ds)
    scores = np.empty(n_cells, np.float32)  # first, as in _walk_f16
    for ic in range(n_cells):
        mv = mask[row, ic] if has_mask else _ZERO
        if mv != _NEG_INF:
            scores[ic] = _dot_q8_0(kq, kd, kvh, ic, qs, ds) * scale + mv
    acc = np.zeros(hd, np.float32)
    big_s = _ZERO
    big_m = _NEG_INF
    for ic in range(n_cells):
        if has_mask and mask[row, ic] == _NEG_INF:
            continue
        big_m, ms, vs, new_max = _online_softmax_step(scores[ic], big_m)
        if new_max:
            for d in range(hd):
                acc[d] = acc[d] * ms
        n_blocks = hd // 32
        _mad_q8_0_body(
            acc,
            vq,
            (kvh * vq.shape[1] + ic) * hd,
            vd,
            (kvh * vd.shape[1] + ic) * n_blocks,
            vs,
            n_blocks,
        )
        big_s = fma32(big_s, ms, vs)  # S = S*ms + vs: GCC fuses it (see the docs)
    s_inv = _ZERO if big_s == _ZERO else _ONE / big_s
    for d in range(hd):
        out[row, h, d] = acc[d] * s_inv


@njit
def _q8_0_serial(
    q: Any,
    kq: Any,
    kd: Any,
    vq: Any,
    vd: Any,
    n_cells: int,
    mask: Any,
    has_mask: bool,
    scale: float,
    group: int,
    out: Any,
) -> None:
    for task in range(q.shape[0] * q.shape[1]):
        _q8_0_task(task, q, kq, kd, vq, vd, n_cells, mask, has_mask, scale, group, out)


@njit(parallel=True)
def _q8_0_parallel(
    q: Any,
    kq: Any,
    kd: Any,
    vq: Any,
    vd: Any,
    n_cells: int,
    mask: Any,
    has_mask: bool,
    scale: float,
    group: int,
    out: Any,
) -> None:
    for task in prange(q.shape[0] * q.shape[1]):
        _q8_0_task(task, q, kq, kd, vq, vd, n_cells, mask, has_mask, scale, group, out)


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


def _cell_buffer(x: np.ndarray, dtype: type) -> np.ndarray:
    """A C-contiguous [kv_head, cells, ...] array whose first cells are x's, without a copy
    where x is the [:, :T] prefix of one (kv_cache.keys/values returns such views of the
    whole cache: copying them would cost more than the attention itself)."""
    if x.dtype == dtype and x.flags.c_contiguous:
        return x
    base = x.base
    if (
        isinstance(base, np.ndarray)
        and base.dtype == dtype
        and base.flags.c_contiguous
        and base.ndim == x.ndim
        and base.shape[0] == x.shape[0]
        and base.shape[2:] == x.shape[2:]
        and base.strides == x.strides
        and base.ctypes.data == x.ctypes.data
    ):
        return base
    return np.ascontiguousarray(x, dtype)


_NO_MASK = np.zeros((1, 1), np.float32)  # a placeholder the kernels never read
_LAST_MASK: tuple[np.ndarray, np.ndarray] | None = None  # (mask, rounded) of the last call


def _prepare_mask(mask: np.ndarray | None, n_rows: int, n_cells: int) -> tuple[bool, np.ndarray]:
    """(has_mask, the mask as f32 holding f16 values, as ggml reads its f16 mask)."""
    if mask is None:
        return False, _NO_MASK
    mask = np.asarray(mask)
    if mask.shape != (n_rows, n_cells):
        raise ValueError(f"mask {mask.shape} is not [n_rows, T] = {(n_rows, n_cells)}")
    global _LAST_MASK
    # the forward pass hands every layer the same read-only mask: round it once (a writable
    # one could have changed in place since, so it is rounded afresh)
    last = _LAST_MASK
    if last is not None and last[0] is mask and not mask.flags.writeable:
        return True, last[1]
    prepared = np.ascontiguousarray(mask.astype(np.float16).astype(np.float32))
    _LAST_MASK = (mask, prepared)  # one tuple, swapped whole: safe across engine threads
    return True, prepared


def flash_attn_f16(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    mask: np.ndarray | None,
    scale: float | np.float32,
    n_kv: int | None = None,
    n_threads: int = 2,
    parallel: bool | None = None,
    tiled: bool | None = None,
) -> np.ndarray:
    """ggml_flash_attn_ext with an f16 K/V cache, as llama-server's CPU backend computes it.

    q: f32 [n_rows, n_head, hd] (after RoPE); k, v: [n_head_kv, T, hd] f16 values (float16, or
    float32 holding f16 values as kv_cache keeps them); head h reads kv head h // (n_head /
    n_head_kv). mask: [n_rows, T] additive, 0 / -inf (rounded to f16 as ggml stores it), or
    None when every one of the T cells is visible. n_kv: the cells ggml sees (:func:`kv_length`,
    default T); cells T..n_kv-1 are hidden padding, and n_kv decides the decode split.
    n_threads: llama-server's -t, on which the decode split depends. parallel: spread the
    (row, head) tasks over Numba's threads (None: when there are PARALLEL_MIN_WORK cell visits
    or more); the result is the same either way. tiled: ggml's kernel is chosen by the
    micro-batch's rows, which may be more than these (several sequences in one micro-batch):
    True runs the tiled kernel (Q kept in f32) whatever n_rows (None: from FA_TILE_Q rows).
    Returns f32 [n_rows, n_head, hd].
    """
    q = np.ascontiguousarray(q, np.float32)
    n_rows, n_head, hd = q.shape
    n_head_kv, n_cells, _ = k.shape
    if k.shape != v.shape or k.shape[2] != hd or n_head % n_head_kv:
        raise ValueError(f"q {q.shape}, k {k.shape}, v {v.shape} do not fit together")
    k_buf, v_buf = _cell_buffer(k, np.float32), _cell_buffer(v, np.float32)
    n_kv = n_cells if n_kv is None else int(n_kv)
    if n_kv < n_cells:
        raise ValueError(f"n_kv {n_kv} is shorter than the {n_cells} cells given")
    has_mask, mask = _prepare_mask(mask, n_rows, n_cells)
    group = n_head // n_head_kv
    out = np.empty((n_rows, n_head, hd), np.float32)
    if n_rows == 0 or n_cells == 0:
        out[:] = 0
        return out
    parallel = parallel if parallel is not None else n_rows * n_head * n_cells >= PARALLEL_MIN_WORK
    scale = F32(scale)
    if n_rows >= FA_TILE_Q if tiled is None else tiled:
        kernel = _tiled_parallel if parallel else _tiled_serial
        kernel(q, _k_tiles(k_buf, n_cells), v_buf, n_cells, mask, has_mask, scale, group, out)
    elif n_rows == 1 and n_kv >= SPLIT_MIN_CELLS:
        n_threads = max(1, int(n_threads))
        chunk = -(-n_kv // n_threads)
        part_m = np.empty((n_head, n_threads), np.float32)
        part_s = np.empty((n_head, n_threads), np.float32)
        part_acc = np.empty((n_head, n_threads, hd), np.float32)
        split = _split_parallel if parallel else _split_serial
        split(
            q,
            k_buf,
            v_buf,
            n_cells,
            mask,
            has_mask,
            scale,
            group,
            n_kv,
            chunk,
            part_m,
            part_s,
            part_acc,
        )
        _reduce_all(part_m, part_s, part_acc, chunk, n_kv, out)
    else:
        one_chunk = _one_chunk_parallel if parallel else _one_chunk_serial
        one_chunk(q, k_buf, v_buf, n_cells, mask, has_mask, scale, group, out)
    return out


def flash_attn_q8_0(
    q: np.ndarray,
    k_q: np.ndarray,
    k_d: np.ndarray,
    v_q: np.ndarray,
    v_d: np.ndarray,
    mask: np.ndarray | None,
    scale: float,
    parallel: bool | None = None,
) -> np.ndarray:
    """ggml_flash_attn_ext with a q8_0 K/V cache (llama-server --cache-type-k/v q8_0).

    q: f32 [n_rows, n_head, hd] as ggml receives it (with the cache's Hadamard rotation already
    applied: the kernel rounds it to q8_0 itself); k_q, v_q: int8 [n_head_kv, T, hd]; k_d, v_d:
    their f16 scales [n_head_kv, T, hd/32] (kv_cache's layout). ggml runs its one-row kernel
    for every batch size here (no tiles, no decode split), so there is no n_kv or n_threads.
    Returns f32 [n_rows, n_head, hd] (still rotated by V's rotation, as ggml's output).
    """
    q = np.ascontiguousarray(q, np.float32)
    n_rows, n_head, hd = q.shape
    n_head_kv, n_cells, _ = k_q.shape
    blocks = (n_head_kv, n_cells, hd // 32)
    if (
        hd % 32
        or k_q.shape != (n_head_kv, n_cells, hd)
        or v_q.shape != k_q.shape
        or k_d.shape != blocks
        or v_d.shape != blocks
        or n_head % n_head_kv
    ):
        raise ValueError(
            f"q {q.shape}, k {k_q.shape}/{k_d.shape}, v {v_q.shape}/{v_d.shape} "
            "do not fit together as q8_0 blocks"
        )
    has_mask, mask = _prepare_mask(mask, n_rows, n_cells)
    out = np.zeros((n_rows, n_head, hd), np.float32)
    if n_rows == 0 or n_cells == 0:
        return out
    parallel = parallel if parallel is not None else n_rows * n_head * n_cells >= PARALLEL_MIN_WORK
    kernel = _q8_0_parallel if parallel else _q8_0_serial
    kernel(
        q,
        _cell_buffer(k_q, np.int8),
        _cell_buffer(k_d, np.float32),
        _cell_buffer(v_q, np.int8),
        _cell_buffer(v_d, np.float32),
        n_cells,
        mask,
        has_mask,
        F32(scale),
        n_head // n_head_kv,
        out,
    )
    return out


def warm_up(q8_0: bool = False) -> None:
    """Compile (or load from Numba's cache) every kernel a forward pass can reach, on tiny
    inputs, so that the first request does not pay it: one-row, split, tiled, serial and
    parallel (and the q8_0 kernels when asked)."""
    rng = np.random.default_rng(0)
    for n_rows, n_cells, n_kv in ((1, 4, 4), (1, 4, SPLIT_MIN_CELLS), (2, 4, 4), (FA_TILE_Q, 4, 4)):
        q = rng.standard_normal((n_rows, 2, 32)).astype(np.float32)
        k = rng.standard_normal((1, n_cells, 32)).astype(np.float16).astype(np.float32)
        mask = attention_mask(np.arange(n_cells - n_rows, n_cells), np.arange(n_cells))
        for parallel in (False, True):
            flash_attn_f16(
                q, k, k, mask if n_rows > 1 else None, 0.125, n_kv=n_kv, parallel=parallel
            )
            if q8_0:
                kq = np.zeros((1, n_cells, 32), np.int8)
                kd = np.ones((1, n_cells, 1), np.float16)
                flash_attn_q8_0(q, kq, kd, kq, kd, mask, 0.125, parallel=parallel)
