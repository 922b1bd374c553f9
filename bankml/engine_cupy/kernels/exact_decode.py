"""A decode step (one new token) in one compiled call, bit for bit the general path.

The definition in model.py runs a layer as ~25 calls from Python (norms, products, RoPE, the
cache store, attention, SwiGLU, the residual adds), each a Numba dispatch plus NumPy glue: ~5 ms
of a ~16 ms decode step of the default model. Here that definition is compiled for one row, of
the layer's parts in exact_batch (the same the batched step runs for several rows, with the
one-row products): ``decode_layer`` is ``model.block`` (``attention_inputs`` and
``store_attend`` are ``model.attention``, ``layer_rest`` the rest of the block with
``model.feed_forward``), and ``DecodePlan.step`` is ``model.stack``, composed of the very
kernels the exact backend calls (exact_ops' RMSNorm, RoPE, SwiGLU/GeGLU; the products' one-row
kernels; kv_cache's f16 store; exact_attention's one-row flash attention), in the same order on
the same values, so the logits are the same bits (tests/test_decode_fast_path.py).

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
from numba.typed import List

from bankml.engine_cupy.kernels.exact_batch import (
    _ABSENT,
    _GRID,
    _IQ4,
    _KQUANT,
    _MATMUL,
    FAMILIES,
    ONE_ROW,
    CellViews,
    attention_inputs,
    batch_output,
    layer_rest,
    store_attend,
)
from bankml.engine_cupy.kernels.exact_iquants import IQ4NLMatrix, IQ4XSMatrix, IQGridMatrix
from bankml.engine_cupy.kernels.exact_kquants import KQuantMatrix
from bankml.engine_cupy.kernels.exact_matmul import F16_TABLE, MatrixStack, QuantMatrix, code_set
from bankml.engine_cupy.kernels.jit import njit

__all__ = ["DecodePlan", "decode_layer", "decode_output", "decode_stack"]

F32 = np.float32
_NONE = np.zeros(0, F32)  # an absent bias, norm weight or GELU table
MAX_PARTS = 3  # a product's parts: Q/K/V of three types at most
_NO_ROWS = np.zeros((0, 0), np.uint8)


# --- the compiled step ---------------------------------------------------------------------------


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
    matrix MAX_PARTS parts (family, code, raw, bias, grid) as DecodePlan lays out; shape
    (n_head, n_head_kv, head_dim); cells: exact_batch.CellViews.cells; families:
    DecodePlan.families (its type chooses the products compiled)."""
    q_norm, k_norm = norms[2], norms[3]
    q, k, v = attention_inputs(
        x,
        norms[0],
        qkv,
        q_norm,
        k_norm,
        shape,
        cos,
        sin,
        neox,
        q_scale,
        eps,
        table,
        families,
        ONE_ROW,
    )
    n_head, _, head_dim = shape
    attn = np.empty((1, n_head * head_dim), np.float32)
    store_attend(q, k, v, 0, pos, cells, scale, n_threads, attn)
    return layer_rest(x, attn, norms, wo, gate_up, down, n_ff, eps, table, gelu, families, ONE_ROW)


@njit
def decode_output(x: Any, norm: Any, output: Any, eps: float, table: Any, families: Any) -> Any:
    """The output norm and the logits product of the last token; [1, n_vocab]."""
    return batch_output(x, norm, output, eps, table, families, ONE_ROW)


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
    """(family, code, raw, grid) of one matrix whose one-row product the step calls."""
    if type(m) is QuantMatrix:
        return _MATMUL, int(m._kind), _readonly(m.raw), _no_grid()
    if type(m) is KQuantMatrix:
        return _KQUANT, m.row_code(), _readonly(m.raw), _no_grid()
    if type(m) in (IQ4NLMatrix, IQ4XSMatrix):
        return _IQ4, m._code(1), _readonly(m.raw), _no_grid()
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
        return _GRID, code, _readonly(m.raw), grid
    return None


def _matrix(linears: list[Any]) -> tuple | None:
    """The MAX_PARTS parts (family, code, raw, bias, grid) of Linears used side by side,
    each Linear's matrix or stack split into its parts (the rest absent); None if one of them
    has no one-row product here. Each part carries its slice of its Linear's bias, so an
    output without a bias gets no addition (adding 0 would turn -0.0 into 0.0)."""
    parts = []
    for linear in linears:
        m = getattr(linear, "exact", None)
        start = 0
        for piece in m.parts if isinstance(m, MatrixStack) else [m]:
            part = None if piece is None else _part(piece)
            if part is None:
                return None
            bias = None if linear.bias is None else linear.bias[start : start + piece.n_out]
            parts.append((*part[:3], _f32(bias), part[3]))
            start += piece.n_out
    if len(parts) > MAX_PARTS:
        return None
    absent = (_ABSENT, 0, _readonly(_NO_ROWS), _f32(None), _no_grid())
    return tuple(parts + [absent] * (MAX_PARTS - len(parts)))


def _families(present: set[int], matmul_codes: set[int]) -> tuple[Any, ...]:
    """DecodePlan.families: True per family present (exact_matmul's: its code_set), None."""
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
        views = CellViews(pos, cache)
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
