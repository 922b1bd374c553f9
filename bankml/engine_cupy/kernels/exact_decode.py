"""A decode step (one new token) in one compiled call per layer, bit for bit the general path.

The definition in model.py runs a layer as ~25 calls from Python (norms, products, RoPE, the
cache store, attention, SwiGLU, the residual adds), each a Numba dispatch plus NumPy glue: ~5 ms
of a ~16 ms decode step of the default model. Here that definition is compiled for one row:
``decode_layer`` is ``model.block`` (``_attention`` is ``model.attention``, ``_feed_forward``
``model.feed_forward``, ``_norm`` and ``_linear`` the backend's norm and a Linear), and
``DecodePlan.step`` is ``model.stack``, composed of the very kernels the exact backend calls
(exact_ops' RMSNorm, RoPE, SwiGLU/GeGLU; the products' one-row kernels; kv_cache's f16 store;
exact_attention's one-row flash attention), in the same order on the same values, so the logits
are the same bits (tests/test_decode_fast_path.py).

What takes it (``DecodePlan.build`` says None otherwise, and the general path runs): every
matrix an exact_matmul ``QuantMatrix`` (Q4_0..Q8_0, F16, F32, BF16), an exact_kquants
``KQuantMatrix`` (Q2_K..Q6_K), an exact_iquants matrix (IQ4_NL, IQ4_XS, the grid and TQ
types), or a stack of them (Q/K/V or gate/up of several types); at run time one token, an f16 cache
(in position order, or with gemma3's sliding-window ring; not q8_0).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numba.core import errors
from numba.extending import overload
from numba.typed import List

from bankml.engine_cupy.kernels import exact_attention, exact_iquants, exact_kquants
from bankml.engine_cupy.kernels.exact_attention import one_row_f16
from bankml.engine_cupy.kernels.exact_iquants import IQ4NLMatrix, IQ4XSMatrix, IQGridMatrix
from bankml.engine_cupy.kernels.exact_kquants import KQuantMatrix
from bankml.engine_cupy.kernels.exact_matmul import (
    F16_TABLE,
    PARALLEL_MIN_MACS,
    MatrixStack,
    QuantMatrix,
    code_set,
    row_product,
)
from bankml.engine_cupy.kernels.exact_ops import (
    _geglu_rows,
    _norm_fused_pairs,
    _rms_norm_rows,
    _rope_rows,
    _swiglu_rows,
)
from bankml.engine_cupy.kernels.jit import every_type_compiled, njit, present_in
from bankml.engine_cupy.kv_cache import _store_f16

__all__ = ["DecodePlan", "decode_layer", "decode_output", "decode_stack"]

F32 = np.float32
_NONE = np.zeros(0, F32)  # an absent bias, norm weight or GELU table
_NO_MASK = np.zeros((1, 1), F32)  # a placeholder the kernels never read
# Attention over a decode step's heads runs on Numba's threads from this many (head, cell)
# visits: each (head, chunk) task writes its own partial, so the bits do not change.
PARALLEL_MIN_VISITS = 2048
# the kernel family of a product's part (what runs its one-row product), and a part's absence
_MATMUL, _KQUANT, _IQ4, _GRID, _ABSENT = 0, 1, 2, 3, -1
FAMILIES = (_MATMUL, _KQUANT, _IQ4, _GRID)
MAX_PARTS = 3  # a product's parts: Q/K/V of three types at most
_NO_ROWS = np.zeros((0, 0), np.uint8)


# --- the compiled step ---------------------------------------------------------------------------


@njit
def _norm(x: Any, weight: Any, eps: float) -> Any:
    """exact_ops.rms_norm of each row of x [rows, n] (weight of size 0: none)."""
    out = np.empty_like(x)
    _rms_norm_rows(x, weight, eps, out)
    return out


def _part_product(families, family, code, parallel, raw, grid, x, table, out):  # pragma: no cover
    """One part's one-row product into out [1, its rows], by its family's kernels (``grid``:
    a grid or TQ matrix's other arguments, placeholders otherwise). Compiled code only: the
    body is ``_part_product_for``'s, for the families of ``families``."""
    raise TypeError("exact_decode._part_product runs in compiled code only")


@overload(_part_product)
def _part_product_for(families, family, code, parallel, raw, grid, x, table, out):
    """_part_product's body with the branch of each family the model lacks dropped (the
    constants below): only the present families' one-row products are typed and compiled.
    The body computes nothing itself, so Numba's default options (not njit's float settings)
    change no bits; it is compiled into the calling kernel and cached with it. (Numba wants
    this function's parameters and the body's alike, annotations included: none.)"""
    matmul, kquant, iq4, grid_types = present_in(families)

    def body(families, family, code, parallel, raw, grid, x, table, out):
        if matmul and family == _MATMUL:  # families[_MATMUL]: the code_set of its products
            row_product(families[0], code, parallel, raw, x, table, out)
        elif kquant and family == _KQUANT:
            exact_kquants.row_product(code, parallel, raw, x, out)
        elif iq4 and family == _IQ4:
            exact_iquants.row_product(code, parallel, raw, x, table, out)
        elif grid_types and family == _GRID:
            kind, f_vd, f_t, grid_table, scales, d = grid
            exact_iquants.grid_row_product(
                code, kind, f_vd, f_t, parallel, raw, grid_table, scales, d, x, out
            )

    return body


@njit
def _linear(matrix: Any, x: Any, table: Any, families: Any) -> Any:
    """Linear.__call__ (each Linear of a layer's Q/K/V or gate/up in turn) for one row x
    [1, n_in]: each part (family, code, parallel, raw, bias, grid) times x, plus its bias, side
    by side. Each part rounds x itself: the same bits as the stacks' one rounding per rule."""
    n_out = 0
    for part in matrix:
        n_out += part[3].shape[0]
    out = np.empty((1, n_out), np.float32)
    start = 0
    for family, code, parallel, raw, bias, grid in matrix:
        rows = raw.shape[0]
        if family == _ABSENT:
            continue
        if rows == n_out:  # the only part: straight into the output
            _part_product(families, family, code, parallel, raw, grid, x, table, out)
        else:
            part = np.empty((1, rows), np.float32)
            _part_product(families, family, code, parallel, raw, grid, x, table, part)
            out[0, start : start + rows] = part[0]
        for i in range(bias.shape[0]):
            out[0, start + i] += bias[i]
        start += rows
    return out


@njit
def _heads(y: Any, start: int, n_heads: int, head_dim: int) -> Any:
    """y[:, start : start + n_heads*head_dim] as a [rows, n_heads, head_dim] copy."""
    m, n = y.shape[0], n_heads * head_dim
    out = np.empty((m, n), np.float32)
    for t in range(m):  # row by row: each a contiguous copy (a 2-D slice's is element-wise)
        out[t] = y[t, start : start + n]
    return out.reshape(m, n_heads, head_dim)


@njit
def _head_norm(x: Any, weight: Any, eps: float) -> Any:
    """qwen3/gemma3's Q or K norm: RMSNorm of each head's row, for each row."""
    m, n_heads, head_dim = x.shape
    return _norm(x.reshape(m * n_heads, head_dim), weight, eps).reshape(m, n_heads, head_dim)


@njit
def _rope(x: Any, cos: Any, sin: Any, neox: bool, fused_pairs: int) -> Any:
    """exact_ops.apply_rope (``fused_pairs``: the pairs GCC's loop rotates with fmas)."""
    out = np.empty_like(x)
    _rope_rows(x, cos, sin, neox, fused_pairs, out)
    return out


@njit
def _qkv_heads(
    y: Any,
    q_norm: Any,
    k_norm: Any,
    shape: Any,
    cos: Any,
    sin: Any,
    neox: bool,
    q_scale: float,
    eps: float,
) -> Any:
    """Q [rows, n_head, hd], K and V [rows, n_head_kv, hd] of the Q/K/V product's rows y: the
    heads split, Q/K norms (qwen3, gemma3), RoPE at each row's position (cos/sin [rows,
    hd/2]), gemma3's Q scale (it then attends with scale 1)."""
    n_head, n_head_kv, head_dim = shape
    nq, nk = n_head * head_dim, n_head_kv * head_dim
    q = _heads(y, 0, n_head, head_dim)
    k = _heads(y, nq, n_head_kv, head_dim)
    v = _heads(y, nq + nk, n_head_kv, head_dim)
    if q_norm.shape[0]:
        q = _head_norm(q, q_norm, eps)
        k = _head_norm(k, k_norm, eps)
    fused_pairs = cos.shape[1] if neox else _norm_fused_pairs(cos.shape[1])
    q = _rope(q, cos, sin, neox, fused_pairs)
    k = _rope(k, cos, sin, neox, fused_pairs)
    if q_scale != 1:
        q = q * np.float32(q_scale)
    return q, k, v


@njit
def _attention(
    h: Any,
    qkv: Any,
    q_norm: Any,
    k_norm: Any,
    shape: Any,
    cos: Any,
    sin: Any,
    neox: bool,
    q_scale: float,
    scale: float,
    pos: int,
    cells: Any,
    n_threads: int,
    eps: float,
    table: Any,
    families: Any,
) -> Any:
    """model.attention with ExactOps.attend for one token: Q/K/V, their norms, RoPE, gemma3's
    Q scale, the f16 cache store at ``pos`` (and at the ring cell), ggml's one-row flash
    attention over the cells attended; [1, n_head*hd]. ``cells``: see decode_layer."""
    k_store, v_store, k_att, v_att, cell, n_cells, n_kv, mask, has_mask = cells
    n_head, n_head_kv, head_dim = shape
    y = _linear(qkv, h, table, families)
    q, k, v = _qkv_heads(y, q_norm, k_norm, shape, cos, sin, neox, q_scale, eps)
    _store_f16(k_store, pos, k)
    _store_f16(v_store, pos, v)
    if cell >= 0:  # the same rounded values into the sliding-window ring's cell
        _store_f16(k_att, cell, k)
        _store_f16(v_att, cell, v)
    out = np.empty((1, n_head, head_dim), np.float32)
    parallel = n_head * n_cells >= PARALLEL_MIN_VISITS
    one_row_f16(
        q,
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
        out,
    )
    return out.reshape(1, n_head * head_dim)


@njit
def _glu(gu: Any, n_ff: int, gelu: Any) -> Any:
    """ExactOps.glu of each row: SwiGLU, or GeGLU through ggml's f16 GELU table when one is
    given."""
    m = gu.shape[0]
    gate = gu[:, :n_ff].copy()
    up = gu[:, n_ff : 2 * n_ff].copy()
    out = np.empty((m, n_ff), np.float32)
    if gelu.shape[0]:
        _geglu_rows(gate, up, gelu, out)
    else:
        _swiglu_rows(gate.reshape(-1), n_ff, up.reshape(-1), n_ff, out)
    return out


@njit
def _feed_forward(
    h: Any, gate_up: Any, down: Any, n_ff: int, gelu: Any, table: Any, families: Any
) -> Any:
    """model.feed_forward: down(glu(gate(h), up(h))) for one row h [1, n_embd]."""
    gu = _linear(gate_up, h, table, families)
    return _linear(down, _glu(gu, n_ff, gelu), table, families)


@njit
def _add(x: Any, y: Any) -> Any:
    out = np.empty_like(x)
    for i in range(x.shape[1]):
        out[0, i] = x[0, i] + y[0, i]
    return out


@njit
def decode_layer(
    x: Any,
    pos: int,
    cos: Any,
    sin: Any,
    cells: Any,
    norms: Any,
    qkv: Any,
    wo: Any,
    gate_up: Any,
    down: Any,
    shape: Any,
    n_ff: int,
    neox: bool,
    q_scale: float,
    scale: float,
    n_threads: int,
    eps: float,
    table: Any,
    gelu: Any,
    families: Any,
) -> Any:
    """model.block for one token x [1, n_embd] at ``pos``; returns the layer's output.

    norms: (attn, ffn, q, k, post-attention, post-FFN) weights, size 0 where absent; each
    matrix MAX_PARTS parts (family, code, parallel, raw, bias, grid) as DecodePlan lays out;
    shape (n_head, n_head_kv, head_dim); cells: (K and V position stores, K and V attended,
    the ring cell to store at or -1, the cells attended, ggml's n_kv, the mask [1, cells] or a
    placeholder, has_mask), the attended arrays being the stores themselves except for a layer
    in the SWA ring; families: DecodePlan.families (its type chooses the products compiled)."""
    attn_norm, ffn_norm, q_norm, k_norm, post_attn_norm, post_ffw_norm = norms
    h = _norm(x, attn_norm, eps)
    attn = _attention(
        h,
        qkv,
        q_norm,
        k_norm,
        shape,
        cos,
        sin,
        neox,
        q_scale,
        scale,
        pos,
        cells,
        n_threads,
        eps,
        table,
        families,
    )
    out = _linear(wo, attn, table, families)
    if post_attn_norm.shape[0]:
        out = _norm(out, post_attn_norm, eps)
    x = _add(x, out)
    h = _norm(x, ffn_norm, eps)
    out = _feed_forward(h, gate_up, down, n_ff, gelu, table, families)
    if post_ffw_norm.shape[0]:
        out = _norm(out, post_ffw_norm, eps)
    return _add(x, out)


@njit
def decode_output(x: Any, norm: Any, output: Any, eps: float, table: Any, families: Any) -> Any:
    """The output norm and the logits product of the last token; [1, n_vocab]."""
    return _linear(output, _norm(x, norm, eps), table, families)


@njit
def decode_stack(
    x: Any,
    pos: int,
    ropes: Any,
    swa: Any,
    cells: Any,
    layers: Any,
    shape: Any,
    n_ff: int,
    neox: bool,
    q_scale: float,
    scale: float,
    n_threads: int,
    eps: float,
    table: Any,
    gelu: Any,
    families: Any,
    output_norm: Any,
    output: Any,
) -> Any:
    """model.stack for one token: decode_layer for each layer in turn, then decode_output, in
    one call from Python. ``layers``: the plan's typed List of (norms, qkv, wo, gate_up, down);
    ``ropes``: the (cos, sin) of the global and the sliding-window layers, ``swa[il]`` choosing;
    ``cells``: each layer's (see decode_layer). One call instead of one a layer: each call from
    Python unboxed a layer's ~60 arrays and took the GIL back, ~40 us a layer of a ~10 ms step,
    and a serving thread waiting for the GIL stalled both cores."""
    for il in range(len(layers)):
        norms, qkv, wo, gate_up, down = layers[il]
        cos, sin = ropes[swa[il]]
        x = decode_layer(
            x,
            pos,
            cos,
            sin,
            cells[il],
            norms,
            qkv,
            wo,
            gate_up,
            down,
            shape,
            n_ff,
            neox,
            q_scale,
            scale,
            n_threads,
            eps,
            table,
            gelu,
            families,
        )
    return decode_output(x, output_norm, output, eps, table, families)


@njit
def _layer_list(first: Any) -> Any:
    """A typed List of layers' arguments, holding ``first`` (built by compiled, cached code: a
    typed List made from Python compiles its methods anew in every process, ~4 s)."""
    layers = List()
    layers.append(first)
    return layers


@njit
def _append_layer(layers: Any, layer: Any) -> None:
    layers.append(layer)


def _stack_layers(layers: list[tuple]) -> Any | None:
    """The layers' arguments in a typed List (decode_stack's ``layers``), or None where it
    cannot hold them all: layers whose arguments differ in type."""
    try:
        stacked = _layer_list(layers[0])
        for layer in layers[1:]:
            _append_layer(stacked, layer)
    except errors.TypingError:
        return None
    return stacked


# --- the plan: each layer's arguments, laid out once per model -----------------------------------


def _readonly(a: np.ndarray) -> np.ndarray:
    """A read-only view: every weight then has one Numba type (the memory-mapped ones are
    read-only, copies are not), so decode_layer compiles once for every model."""
    view = a.view()
    view.flags.writeable = False
    return view


def _f32(a: Any | None) -> np.ndarray:
    """A norm weight, bias or table as a read-only float32 vector (size 0 for None)."""
    return _readonly(_NONE if a is None else np.ascontiguousarray(a, dtype=F32).reshape(-1))


def _no_grid() -> tuple:
    """The grid arguments of a part that is not a grid matrix: placeholders of their types."""
    return (
        0,
        0.0,
        0.0,
        _readonly(np.zeros(0, np.uint64)),
        _readonly(np.zeros((0, 0), np.int16)),
        _readonly(np.zeros((0, 0), F32)),
    )


def _part(m: Any) -> tuple | None:
    """(family, code, parallel, raw, grid) of one matrix whose one-row product the step calls."""
    parallel = m.n_out * m.n_in >= PARALLEL_MIN_MACS  # as its matmul decides for one row
    if type(m) is QuantMatrix:
        return _MATMUL, int(m._kind), parallel, _readonly(m.raw), _no_grid()
    if type(m) is KQuantMatrix:
        return _KQUANT, m.row_code(), parallel, _readonly(m.raw), _no_grid()
    if type(m) in (IQ4NLMatrix, IQ4XSMatrix):
        return _IQ4, m._code(1), parallel, _readonly(m.raw), _no_grid()
    if type(m) is IQGridMatrix:
        code, kind, f_vd, f_t, grid_table, scales, d = m.row_args()
        grid = (
            kind,
            f_vd,
            f_t,
            _readonly(grid_table),
            _readonly(np.ascontiguousarray(scales)),
            _readonly(np.ascontiguousarray(d)),
        )
        return _GRID, code, parallel, _readonly(m.raw), grid
    return None


def _matrix(linears: list[Any]) -> tuple | None:
    """The MAX_PARTS parts (family, code, parallel, raw, bias) of Linears used side by side,
    each Linear's matrix or stack split into its parts (the rest absent); None if one of them
    has no one-row product here. Each part carries its slice of its Linear's bias, so an
    output without a bias gets no addition (adding 0 would turn -0.0 into 0.0)."""
    parts = []
    for linear in linears:
        m = getattr(linear, "exact", None)
        start = 0
        for piece in m.parts if isinstance(m, MatrixStack) else [m]:
            part = None if piece is None else _part(piece)
            if piece is None or part is None:
                return None
            bias = None if linear.bias is None else linear.bias[start : start + piece.n_out]
            parts.append((*part[:4], _f32(bias), part[4]))
            start += piece.n_out
    if len(parts) > MAX_PARTS:
        return None
    absent = (_ABSENT, 0, False, _readonly(_NO_ROWS), _f32(None), _no_grid())
    return tuple(parts + [absent] * (MAX_PARTS - len(parts)))


def _families(present: set[int], matmul_codes: set[int]) -> tuple[Any, ...]:
    """DecodePlan.families: True per family present (exact_matmul's: its code_set), None;
    every family with ``BANKML_KERNEL_TYPES=all`` (jit.every_type_compiled)."""
    if every_type_compiled():
        present = set(FAMILIES)
    return tuple(
        None if f not in present else code_set(matmul_codes) if f == _MATMUL else True
        for f in FAMILIES
    )


def _output_widths(linears: list[Any]) -> list[tuple[str, int]]:
    return [part for linear in linears for part in linear.parts]


@dataclass
class DecodePlan:
    """Each layer's constant arguments of decode_layer, and the output's."""

    layers: list[tuple]  # (norms, qkv, wo, gate_up, down, window)
    output: tuple
    output_norm: np.ndarray
    shape: tuple[int, int, int]
    n_ff: int
    neox: bool
    q_scale: F32
    scale: F32
    eps: F32
    swa: tuple[bool, ...]
    gelu: np.ndarray
    # per FAMILIES entry True where a matrix of the model is of that family, None where none
    # is (for exact_matmul's family, the code_set of the model's codes in it): the steps'
    # compiled code holds only the present families' and codes' products (one compile per
    # set, each cached)
    families: tuple[Any, ...]
    # per layer 1 where it takes the sliding-window RoPE, else 0 (decode_stack's swa)
    swa_index: np.ndarray
    # the layers' arguments as decode_stack takes them (a typed List); None where the layers'
    # types differ (each layer is then its own call)
    stacked: Any = field(repr=False)

    @classmethod
    def build(cls, hp: Any, weights: Any, gelu: Any | None) -> DecodePlan | None:
        """The plan of a model whose every matrix the fused step multiplies, else None."""
        output = _matrix([weights.output])
        if output is None:
            return None
        layers = []
        present = {part[0] for part in output}
        codes = {part[1] for part in output if part[0] == _MATMUL}
        for il, layer in enumerate(weights.layers):
            mats = [_matrix(m) for m in (layer.qkv, [layer.wo], layer.gate_up, [layer.down])]
            if any(m is None for m in mats):
                return None
            present.update(part[0] for m in mats for part in m)  # type: ignore[union-attr]
            codes.update(part[1] for m in mats for part in m if part[0] == _MATMUL)  # type: ignore[union-attr]
            if _output_widths(layer.gate_up) != [("gate", hp.n_ff), ("up", hp.n_ff)]:
                return None
            norms = tuple(
                _f32(n)
                for n in (
                    layer.attn_norm,
                    layer.ffn_norm,
                    layer.q_norm,
                    layer.k_norm,
                    layer.post_attn_norm,
                    layer.post_ffw_norm,
                )
            )
            window = hp.swa_window if hp.swa_layers[il] else 0
            layers.append((norms, *mats, window))
        q_scale, scale = hp.spec.attention_scales(hp.attn_scale)
        return cls(
            layers=layers,
            output=output,
            output_norm=_f32(weights.output_norm),
            shape=(hp.n_head, hp.n_head_kv, hp.head_dim),
            n_ff=hp.n_ff,
            neox=bool(hp.spec.rope_neox),
            q_scale=F32(q_scale),
            scale=F32(scale),
            eps=F32(hp.rms_eps),
            swa=tuple(hp.swa_layers),
            gelu=_f32(gelu),
            families=_families(present, codes),
            swa_index=_readonly(np.array(hp.swa_layers, dtype=np.intp)),
            stacked=_stack_layers([layer[:5] for layer in layers]),
        )

    def step(
        self,
        x: np.ndarray,
        pos: int,
        ropes: dict[bool, tuple[Any, Any]],
        cache: Any,
        n_threads: int,
    ) -> np.ndarray:
        """model.stack for one token x [1, n_embd] at ``pos``: the layers and the output
        product, its K/V stored in ``cache`` (f16); the logits [1, n_vocab]."""
        views = _CellViews(pos, cache)
        # decode_layer's arguments after the layer's own, decode_stack's after its layers
        shared = (
            self.shape,
            self.n_ff,
            self.neox,
            self.q_scale,
            self.scale,
            n_threads,
            self.eps,
            F16_TABLE,
            self.gelu,
            self.families,
        )
        if self.stacked is not None:
            cells = tuple(views.cells(il, layer[5]) for il, layer in enumerate(self.layers))
            full = ropes[False]
            ropes_by_kind = (full, ropes.get(True, full))
            return decode_stack(
                x,
                pos,
                ropes_by_kind,
                self.swa_index,
                cells,
                self.stacked,
                *shared,
                self.output_norm,
                self.output,
            )
        for il, layer in enumerate(self.layers):
            cos, sin = ropes[self.swa[il]]
            x = decode_layer(x, pos, cos, sin, views.cells(il, layer[5]), *layer[:5], *shared)
        return decode_output(x, self.output_norm, self.output, self.eps, F16_TABLE, self.families)


class _CellViews:
    """What each layer of one step stores into and attends over, as ExactOps.attend picks
    it: the cells in position order (n_kv padded from pos + 1; a sliding layer's window mask
    once the window is passed), or for a layer in gemma3's SWA ring its cells in cell order with
    the ring's mask and n_kv (after cache.place chose the token's cell)."""

    def __init__(self, pos: int, cache: Any):
        self.cache, self.end = cache, pos + 1
        self.n_kv = exact_attention.kv_length(self.end, cache.kv_size)
        self._window_masks: dict[int, np.ndarray] = {}
        # per cell layout (a sliding-window model following both shared caches has two): its
        # cells, n_kv and mask
        self._rings: dict[int, tuple[int, int, np.ndarray]] = {}

    def ring(self, layout: Any) -> tuple[int, int, np.ndarray]:
        key = id(layout)
        if key not in self._rings:
            mask = layout.mask(np.array([self.end - 1]))
            self._rings[key] = (layout.used_max_p1, layout.n_kv(), mask)
        return self._rings[key]

    def window_mask(self, window: int) -> tuple[bool, np.ndarray]:
        """Model._mask for the one query: none unless a sliding window reaches back past cell 0."""
        if not window or self.end <= window:
            return False, _NO_MASK
        if window not in self._window_masks:
            self._window_masks[window] = exact_attention.attention_mask(
                np.array([self.end - 1]), np.arange(self.end), window
            )
        return True, self._window_masks[window]

    def cells(self, il: int, window: int) -> tuple:
        k_store, v_store = self.cache.f16_cells(il)
        ring = self.cache.ring_f16_cells(il)
        if ring is not None:
            k_ring, v_ring, cell = ring
            n_cells, n_kv, mask = self.ring(self.cache.layout(il))
            return k_store, v_store, k_ring, v_ring, cell, n_cells, n_kv, mask, True
        has_mask, mask = self.window_mask(window)
        return k_store, v_store, k_store, v_store, -1, self.end, self.n_kv, mask, has_mask
