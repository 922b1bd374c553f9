"""A decode step for several sequences at once, each row bit for bit its own one-row step.

The fused decode step (exact_decode) runs one token of one sequence, reading (and unpacking)
every weight once per token. Several sequences advancing by one token each (one row each,
every row at its own position in its own cache) can share that: here every product walks its
weight rows once and, for each weight row, takes every row's dot product while the row is in
L1, each row's activation rounded as the one-row path rounds it (q8_0/q8_1, q8_K, f16/bf16).
The dots are the one-row product's arithmetic: exact_matmul's wide tiles over 8, 4 and 2 rows
(each lane the very float operations of the 1x1 tile; the weight block unpacked once) and its
1x1 tile, the float types' vec_dot pairs, exact_kquants' and exact_iquants' dots of the
one-row code over 4 rows and 1, the grid types' dot. Each output element is then the same
arithmetic on the same values, so the bits are the one-row step's; the parallel split over
weight rows never touches one element's arithmetic.

The rest is per row, in the fused step's kernels: RMSNorm, RoPE (each row at its position),
SwiGLU/GeGLU are row-wise already; the K/V store into each row's cache and the attention over
its cells (``exact_attention.one_row_f16`` with that cache's n_kv and mask) run once per row.

A layer is two compiled calls for all the rows (``attention_inputs``: norm, Q/K/V products,
Q/K norms, RoPE, the Q scale; ``layer_rest``: the output product, the FFN, the residuals) and
one per row between them (``store_attend``); ``batch_output`` gives the logits of every row.
The layout is exact_decode's ``DecodePlan`` (``BatchStep.run`` walks its layers).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from numba import prange, types
from numba.extending import intrinsic, overload

from bankml.engine_cupy.kernels import exact_iquants
from bankml.engine_cupy.kernels.exact_attention import one_row_f16
from bankml.engine_cupy.kernels.exact_decode import (
    _ABSENT,
    _GRID,
    _IQ4,
    _KQUANT,
    _MATMUL,
    PARALLEL_MIN_VISITS,
    DecodePlan,
    _CellViews,
    _glu,
    _norm,
    _qkv_heads,
)
from bankml.engine_cupy.kernels.exact_iquants import _XS_T, _XS_VD
from bankml.engine_cupy.kernels.exact_iquants import _dot as _iq4_dot
from bankml.engine_cupy.kernels.exact_kquants import QK_K
from bankml.engine_cupy.kernels.exact_kquants import _quantize_serial as _quantize_q8_K
from bankml.engine_cupy.kernels.exact_kquants import _rows as _kquant_rows
from bankml.engine_cupy.kernels.exact_matmul import (
    _CODES,
    _F16,
    _Q4_0R,
    _QUANT_CODES,
    F16_TABLE,
    PARALLEL_MIN_MACS,
    QK,
    ROWS_PER_TASK,
    _by_code,
    _literal_key,
    _make_wide_tile,
    _tile_at,
    _wide_at,
    row_product,
)
from bankml.engine_cupy.kernels.exact_matmul import _quantize_serial as _quantize_q8_0
from bankml.engine_cupy.kernels.jit import njit, present_in
from bankml.engine_cupy.kv_cache import _store_f16

__all__ = ["BatchStep", "attention_inputs", "store_attend", "layer_rest", "batch_output"]

F32 = np.float32


# --- the products: weight rows once, every activation row by the one-row dot -------------------


# one weight row by 2 activation rows: exact_matmul's wide tile with two lanes (the 8- and
# 4-row ones are exact_matmul's own), for what is left of B after the groups of four
_PAIR_TILES = {
    code: _make_wide_tile(layout, size, has_min, 1, 2)
    for code, (layout, size, has_min, whole) in _CODES.items()
    if not whole
}


@intrinsic(prefer_literal=True)
def _pair_at(
    typingctx, code, w, w_off, row_bytes, xq, x_off, n_in, xd, xs, s_off, m, nb, out, o_off, n_out
):
    """The 2-row wide tile of ``code`` (a literal), inlined at the call (a no-op for repacked
    Q4_0, whose branch never runs), as exact_matmul's _wide_at."""
    key = _literal_key(code)
    if key is None:
        return None
    args = (w, w_off, row_bytes, xq, x_off, n_in, xd, xs, s_off, m, nb, out, o_off, n_out)
    if key[0] not in _PAIR_TILES:
        return types.void(
            code, *args
        ), lambda context, builder, signature, a: context.get_dummy_value()
    sig, gen = _PAIR_TILES[key[0]]._defn(typingctx, *args)

    def codegen(context, builder, signature, a):
        return gen(context, builder, sig, a[1:])

    return types.void(code, *sig.args), codegen


@njit
def _q_rows(code, raw, r0, r1, q, d, s, d_by_block, s_by_block, out):  # pragma: no cover
    """out[:, r0:r1] for q8 activation rows (``code`` a literal): each weight row against the
    activation rows, eight, four, then two at a time by exact_matmul's wide tiles (its blocks
    unpacked once for them), a last one by the 1x1 tile of the one-row product;
    each output the same arithmetic in every tile (exact_matmul). Repacked Q4_0: 1x1 only."""
    m, n_in = q.shape
    nb = n_in // QK
    row_bytes = raw.shape[1]
    n_out = out.shape[1]
    for r in range(r0, r1):
        w = r * row_bytes
        t = 0
        if code != _Q4_0R:
            while t + 8 <= m:
                _wide_at(
                    code,
                    8,
                    raw,
                    w,
                    row_bytes,
                    q,
                    t * n_in,
                    n_in,
                    d_by_block,
                    s_by_block,
                    t,
                    m,
                    nb,
                    out,
                    t * n_out + r,
                    n_out,
                )
                t += 8
            if t + 4 <= m:
                _wide_at(
                    code,
                    4,
                    raw,
                    w,
                    row_bytes,
                    q,
                    t * n_in,
                    n_in,
                    d_by_block,
                    s_by_block,
                    t,
                    m,
                    nb,
                    out,
                    t * n_out + r,
                    n_out,
                )
                t += 4
            if t + 2 <= m:
                _pair_at(
                    code,
                    raw,
                    w,
                    row_bytes,
                    q,
                    t * n_in,
                    n_in,
                    d_by_block,
                    s_by_block,
                    t,
                    m,
                    nb,
                    out,
                    t * n_out + r,
                    n_out,
                )
                t += 2
        while t < m:
            _tile_at(
                code,
                11,
                raw,
                w,
                row_bytes,
                q,
                t * n_in,
                n_in,
                d,
                s,
                t * nb,
                nb,
                out,
                t * n_out + r,
                n_out,
            )
            t += 1


@njit
def _q_serial(code, args):  # pragma: no cover - compiled
    raw, q, d, s, db, sb, out = args
    _q_rows(code, raw, 0, out.shape[1], q, d, s, db, sb, out)


@njit(parallel=True)
def _q_parallel(code, args):  # pragma: no cover - compiled
    raw, q, d, s, db, sb, out = args
    n_out = out.shape[1]
    for task in prange((n_out + ROWS_PER_TASK - 1) // ROWS_PER_TASK):
        r0 = task * ROWS_PER_TASK
        _q_rows(code, raw, r0, min(r0 + ROWS_PER_TASK, n_out), q, d, s, db, sb, out)


# _q_serial or _q_parallel with the code as a constant (the tiles inlined per type), for the
# codes of the model's code_set only (as exact_matmul's one-row products)
_q_by_code = _by_code(_q_serial, _q_parallel, _QUANT_CODES)


@njit
def _matmul_rows(codes, code, parallel, raw, x, table, out):  # pragma: no cover - compiled
    """exact_matmul.row_product for each row of x [B, n_in] into out [B, n_out]. The float
    types' vec_dot path already takes the rows one by one inside each task of weight rows
    (the pairs of weight rows fixed by the task, not by the row count), so it is called as is."""
    if code >= _F16:
        row_product(codes, code, parallel, raw, x, table, out)
        return
    q, d16, s16, d, s = _quantize_q8_0(x, table)  # each row rounded alone, as for one row
    # the scales block-major too ([nb, B]), as the wide tiles load them
    db, sb = np.ascontiguousarray(d.T), np.ascontiguousarray(s.T)
    _q_by_code(codes, code, parallel, (raw, q, d, s, db, sb, out))


@njit
def _dot_rows(kquant, code, raw, r0, r1, qk, xq, xd, bsums, out):  # pragma: no cover - compiled
    """out[:, r0:r1] by exact_kquants' (``kquant``) or exact_iquants' dots of the one-row
    arithmetic ``code``: each weight row against the activation rows four at a time (its
    blocks unpacked once for the four: each output the one-row dot's arithmetic), then one."""
    if kquant:
        _kquant_rows(code, raw, r0, r1, xq, xd, bsums, out)
        return
    m, n = xq.shape
    nb = n // qk
    n_out = out.shape[1]
    row_bytes = raw.shape[1]
    for r in range(r0, r1):
        w = r * row_bytes
        t = 0
        while t < m:
            rn = 4 if t + 4 <= m else 1
            o = t * n_out + r
            if rn == 4:
                _iq4_dot(code, 4, raw, w, xq, t * n, n, xd, t * nb, nb, out, o, n_out)
            else:
                _iq4_dot(code, 1, raw, w, xq, t * n, n, xd, t * nb, nb, out, o, n_out)
            t += rn


@njit
def _dot_serial(kquant, code, raw, qk, xq, xd, bsums, out):  # pragma: no cover - compiled
    _dot_rows(kquant, code, raw, 0, raw.shape[0], qk, xq, xd, bsums, out)


@njit(parallel=True)
def _dot_parallel(kquant, code, raw, qk, xq, xd, bsums, out):  # pragma: no cover - compiled
    n_out = raw.shape[0]
    for task in prange((n_out + ROWS_PER_TASK - 1) // ROWS_PER_TASK):
        r0 = task * ROWS_PER_TASK
        _dot_rows(kquant, code, raw, r0, min(r0 + ROWS_PER_TASK, n_out), qk, xq, xd, bsums, out)


@njit
def _dots(kquant, code, parallel, raw, qk, xq, xd, bsums, out):  # pragma: no cover - compiled
    if parallel:
        _dot_parallel(kquant, code, raw, qk, xq, xd, bsums, out)
    else:
        _dot_serial(kquant, code, raw, qk, xq, xd, bsums, out)


def _part_product(families, family, code, parallel, raw, grid, x, table, out):  # pragma: no cover
    """exact_decode._part_product for each row of x [B, n_in]: out [B, the part's rows].
    Compiled code only: the body is ``_part_product_for``'s, for the families of ``families``."""
    raise TypeError("exact_batch._part_product runs in compiled code only")


@overload(_part_product)
def _part_product_for(families, family, code, parallel, raw, grid, x, table, out):
    """_part_product's body with the branch of each family the model lacks dropped (as
    exact_decode's): only the present families' batch products are typed and compiled."""
    matmul, kquant, iq4, grid_types = present_in(families)

    def body(families, family, code, parallel, raw, grid, x, table, out):  # pragma: no cover
        if matmul and family == _MATMUL:
            _matmul_rows(families[0], code, parallel, raw, x, table, out)
        elif kquant and family == _KQUANT:  # quantize_row_q8_K of each row, then vec_dot (or gemv)
            q, d, bsums = _quantize_q8_K(x, 0)
            _dots(True, code, parallel, raw, QK_K, q, d, bsums, out)
        elif iq4 and family == _IQ4:
            if code == _XS_VD or code == _XS_T:  # IQ4_XS: q8_K
                q, d, _ = _quantize_q8_K(x, 0)
                _dots(False, code, parallel, raw, QK_K, q, d, np.zeros((0, 0), np.int16), out)
            else:  # IQ4_NL: q8_0
                q, _, _, d, _ = _quantize_q8_0(x, table)
                _dots(False, code, parallel, raw, QK, q, d, np.zeros((0, 0), np.int16), out)
        elif grid_types and family == _GRID:  # each weight row decoded once for every x row
            kind, f_vd, f_t, grid_table, scales, wd = grid
            exact_iquants.grid_row_product(
                code, kind, f_vd, f_t, parallel, raw, grid_table, scales, wd, x, out
            )

    return body


@njit
def _linear(matrix, x, table, families):  # pragma: no cover - compiled
    """exact_decode._linear for each row of x [B, n_in]: each part's product side by side,
    plus its bias."""
    m = x.shape[0]
    n_out = 0
    for part in matrix:
        n_out += part[3].shape[0]
    out = np.empty((m, n_out), np.float32)
    start = 0
    for family, code, _, raw, bias, grid in matrix:
        rows = raw.shape[0]
        if family == _ABSENT:
            continue
        parallel = m * rows * x.shape[1] >= PARALLEL_MIN_MACS
        if rows == n_out:
            _part_product(families, family, code, parallel, raw, grid, x, table, out)
        else:
            part = np.empty((m, rows), np.float32)
            _part_product(families, family, code, parallel, raw, grid, x, table, part)
            out[:, start : start + rows] = part
        for t in range(m):
            for i in range(bias.shape[0]):
                out[t, start + i] += bias[i]
        start += rows
    return out


# --- the layer ------------------------------------------------------------------------------


@njit
def attention_inputs(
    x, attn_norm, qkv, q_norm, k_norm, shape, cos, sin, neox, q_scale, eps, table, families
):  # pragma: no cover - compiled
    """exact_decode._attention up to the store, for each row of x [B, n_embd] (cos/sin [B,
    hd/2]: each row's position): Q [B, n_head, hd] (RoPE'd, gemma3's scale), K and V [B,
    n_head_kv, hd]."""
    h = _norm(x, attn_norm, eps)
    y = _linear(qkv, h, table, families)
    return _qkv_heads(y, q_norm, k_norm, shape, cos, sin, neox, q_scale, eps)


@njit
def store_attend(q, k, v, row, pos, cells, scale, n_threads, out):  # pragma: no cover
    """Row ``row``'s K/V into its cache at ``pos`` (and its ring cell), then ggml's one-row
    flash attention over its cells (exact_decode._attention's end) into out[row]."""
    k_store, v_store, k_att, v_att, cell, n_cells, n_kv, mask, has_mask = cells
    _, n_head, head_dim = q.shape
    n_head_kv = k.shape[1]
    kr = k[row : row + 1].copy()
    vr = v[row : row + 1].copy()
    _store_f16(k_store, pos, kr)
    _store_f16(v_store, pos, vr)
    if cell >= 0:
        _store_f16(k_att, cell, kr)
        _store_f16(v_att, cell, vr)
    o = np.empty((1, n_head, head_dim), np.float32)
    parallel = n_head * n_cells >= PARALLEL_MIN_VISITS
    one_row_f16(
        q[row : row + 1].copy(),
        k_att,
        v_att,
        n_cells,
        mask,
        has_mask,
        scale,
        n_head // n_head_kv,
        n_kv,
        n_threads,
        parallel,
        o,
    )
    out[row] = o.reshape(n_head * head_dim)


@njit
def layer_rest(
    x, attn, norms, wo, gate_up, down, n_ff, eps, table, gelu, families
):  # pragma: no cover - compiled
    """exact_decode.decode_layer after the attention, for each row: the output product
    [+ post-norm], the residual, the FFN [+ post-norm], the residual."""
    _, ffn_norm, _, _, post_attn_norm, post_ffw_norm = norms
    out = _linear(wo, attn, table, families)
    if post_attn_norm.shape[0]:
        out = _norm(out, post_attn_norm, eps)
    x = x + out
    h = _norm(x, ffn_norm, eps)
    gu = _linear(gate_up, h, table, families)
    out = _linear(down, _glu(gu, n_ff, gelu), table, families)
    if post_ffw_norm.shape[0]:
        out = _norm(out, post_ffw_norm, eps)
    return x + out


@njit
def batch_output(x, norm, output, eps, table, families):  # pragma: no cover - compiled
    """The output norm and the logits product of every row; [B, n_vocab]."""
    return _linear(output, _norm(x, norm, eps), table, families)


class BatchStep:
    """DecodePlan.step for several rows: row i the token x[i] at positions[i] of caches[i]."""

    def __init__(self, plan: DecodePlan):
        self.plan = plan

    def run(
        self,
        x: np.ndarray,
        positions: Sequence[int],
        ropes: dict[bool, tuple[Any, Any]],
        caches: Sequence[Any],
        n_threads: int,
    ) -> np.ndarray:
        """x [B, n_embd] (row i at positions[i], its K/V stored in caches[i], f16, each
        cache's ring already placed); ropes: cos/sin [B, hd/2] per layer kind. The logits
        [B, n_vocab]."""
        plan = self.plan
        n_head, _, head_dim = plan.shape
        views = [_CellViews(pos, cache) for pos, cache in zip(positions, caches)]
        rows = range(x.shape[0])
        for il, (norms, qkv, wo, gate_up, down, window) in enumerate(plan.layers):
            cos, sin = ropes[plan.swa[il]]
            q, k, v = attention_inputs(
                x,
                norms[0],
                qkv,
                norms[2],
                norms[3],
                plan.shape,
                cos,
                sin,
                plan.neox,
                plan.q_scale,
                plan.eps,
                F16_TABLE,
                plan.families,
            )
            attn = np.empty((x.shape[0], n_head * head_dim), F32)
            for i in rows:
                store_attend(
                    q,
                    k,
                    v,
                    i,
                    positions[i],
                    views[i].cells(il, window),
                    plan.scale,
                    n_threads,
                    attn,
                )
            x = layer_rest(
                x,
                attn,
                norms,
                wo,
                gate_up,
                down,
                plan.n_ff,
                plan.eps,
                F16_TABLE,
                plan.gelu,
                plan.families,
            )
        return batch_output(x, plan.output_norm, plan.output, plan.eps, F16_TABLE, plan.families)
