"""The transformer, once: llama, qwen2, qwen3 and gemma3 as one definition, and the ``Model`` API.

The definition below (``attention``, ``feed_forward``, ``block``, ``stack``) is written against
a backend ``ops`` chosen once at load:

- ``ExactOps`` (exact_backend.py), on the CPU: every step through the kernels package, which
  rounds as ggml's CPU kernels do, so the logits are llama-server's bits; a one-token step has
  a compiled fast path (``ops.decode``) composed of the same steps;
- ``ArrayOps`` (array_backend.py), NumPy or CuPy: vectorised, the GPU's path.

The matrix products are the weights' own (weights.Linear: the exact kernels where the backend is
exact). One call of ``Model.forward`` runs one micro-batch: the tokens' K/V are appended to the
cache at positions ``cache.n_tokens..`` and the float32 logits of the last token (or of every
token) come back as a host NumPy array. What differs between the architectures is arch.py's.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, NamedTuple, Protocol

import numpy

from bankml.engine_cupy import backend, compile_jobs
from bankml.engine_cupy.array_backend import ArrayOps
from bankml.engine_cupy.exact_backend import ExactOps
from bankml.engine_cupy.kernels import exact_attention, exact_ops, jit, progress
from bankml.engine_cupy.kernels.progress import CompileStats
from bankml.engine_cupy.kv_cache import KVCache
from bankml.engine_cupy.passes import PassLogits, hidden_passes, pass_groups
from bankml.engine_cupy.weights import (
    HParams,
    Layer,
    UnsupportedModel,
    Weights,
    apply_all,
    check_memory,
    load_weights,
    open_reader,
    read_hparams,
    rows_grouped,
    rows_independent,
    total_tensor_bytes,
)

__all__ = ["Model", "KVCache", "UnsupportedModel"]

F32 = numpy.float32
log = logging.getLogger(__name__)


class Ops(Protocol):
    """What a backend gives the definition (ExactOps, ArrayOps)."""

    exact: bool

    @property
    def xp(self) -> ModuleType: ...
    def ropes(self, positions: Any, rope_freqs: Any | None) -> dict[bool, tuple[Any, Any]]: ...
    def norm(self, x: Any, weight: Any) -> Any: ...
    def rope(self, x: Any, cos: Any, sin: Any, neox: bool) -> Any: ...
    def glu(self, gate: Any, up: Any) -> Any: ...
    def attend(self, il: int, q: Any, step: Step, cache: KVCache, scale: Any) -> Any: ...
    def decode(self, x: Any, step: Step, cache: KVCache) -> Any | None: ...
    def warm_up(self, model: Model, cache_type: str | None, steps: Sequence[str] = ...) -> None: ...


@dataclass
class Step:
    """One micro-batch: its positions start..end-1, their RoPE tables (per layer kind: global
    False, sliding-window True), the attention masks (built once per step, per window), and
    llama-server's -t (on which the split of a long one-row attention depends)."""

    positions: Any
    start: int
    end: int
    ropes: dict[bool, tuple[Any, Any]]
    n_threads: int
    readonly_masks: bool  # the exact kernels round a mask once for all the layers
    masks: dict[int | str, Any] = field(default_factory=dict)

    def mask(self, xp: ModuleType, window: int) -> Any | None:
        """[n, T] additive mask: key position > query position, or (window) too far back.
        None when nothing is hidden (one new token and no window reaching back), which spares
        decoding an addition per layer."""
        if self.positions.shape[0] == 1 and (not window or self.end <= window):
            return None
        if window not in self.masks:
            kpos = xp.arange(self.end)[None, :]
            qpos = self.positions[:, None]
            hidden = kpos > qpos
            if window:
                hidden = hidden | (qpos - kpos >= window)
            mask = xp.where(hidden, F32(-xp.inf), F32(0))
            if self.readonly_masks:
                mask.flags.writeable = False
            self.masks[window] = mask
        return self.masks[window]

    def ring_mask(self, cells: Any) -> Any:
        """The mask of a cell layout (kv_cache.Cells.mask: the sliding-window ring's, or a
        cache's cells in cell order), read-only; one per window."""
        key = f"ring{cells.window}"
        if key not in self.masks:
            mask = cells.mask(self.positions)
            mask.flags.writeable = False
            self.masks[key] = mask
        return self.masks[key]


# --- the definition ------------------------------------------------------------------------------
# n tokens, d = n_embd, h = n_head, kv = n_head_kv, hd = head_dim, f = n_ff, V = n_vocab


@dataclass
class Segment:
    """One sequence's rows in a forward pass: rows ``rows`` of the pass's activations, its
    micro-batch ``step`` (positions, RoPE tables, masks) and its ``cache``. A pass of one
    sequence has one segment; ``Model.shared_pass`` runs several in one pass."""

    rows: slice
    step: Step
    cache: KVCache

    @property
    def ropes(self) -> dict[bool, tuple[Any, Any]]:
        return self.step.ropes

    @property
    def last_rows(self) -> list[int]:
        """The rows whose logits the pass keeps: the micro-batch's last."""
        return [self.rows.stop - 1]

    def store_attend(self, ops: Ops, il: int, q: Any, k: Any, v: Any, scale: Any) -> Any:
        """The rows' K/V into the cache, then their attention over it: [n, h*hd]."""
        self.cache.store(il, self.step.start, k, v)
        return ops.attend(il, q, self.step, self.cache, scale)

    def advance(self) -> None:
        self.cache.advance(self.step.end)


class Placed(NamedTuple):
    """One sequence's cells in a shared cache (its positions in order) and its micro-batch's
    ``n_kv``; for a sliding-window model its sliding layers' cells and ``n_kv`` in their own
    cache (None: those of the full layers)."""

    cells: numpy.ndarray
    n_kv: int
    swa_cells: numpy.ndarray | None = None
    swa_n_kv: int = 0


@dataclass
class BatchCells:
    """Where a micro-batch of several sequences sits in a KV cache that others' cells share
    (kv_cache.SharedCells): each sequence's cells, its positions in order, and the batch's
    ``n_kv``; a sliding-window model's sliding layers' cells and ``n_kv`` in their own cache
    (kv_cache.IswaCells; None: the same as the full layers')."""

    cells: list[numpy.ndarray]
    n_kv: int
    swa_cells: list[numpy.ndarray] | None = None
    swa_n_kv: int = 0

    def check(self, tokens: Sequence[Sequence[int]], kv_size: int) -> None:
        """ValueError unless these are cells of ``tokens``, each a cell of its own within
        ``n_kv``, itself within the cache (the sliding layers' alike)."""
        _check_cells(self.cells, self.n_kv, tokens, kv_size)
        if self.swa_cells is not None:
            _check_cells(self.swa_cells, self.swa_n_kv, tokens, kv_size)


def _check_cells(
    cells: list[numpy.ndarray], n_kv: int, tokens: Sequence[Sequence[int]], kv_size: int
) -> None:
    if len(cells) != len(tokens) or any(len(c) != len(t) for c, t in zip(cells, tokens)):
        raise ValueError("the cells do not match the batch's sequences")
    every = numpy.concatenate(cells) if cells else numpy.zeros(0, numpy.int64)
    if not 0 < n_kv <= kv_size or every.size and (every.min() < 0 or every.max() >= n_kv):
        raise ValueError(f"cells outside the {n_kv} cells attended")
    if len(numpy.unique(every)) != every.size:
        raise ValueError("two tokens in one cell")


@dataclass
class BatchSegment(Segment):
    """One of several sequences evaluated in one micro-batch over one KV cache that was empty
    before it, the batch placed from cell 0 (llama-server's slots with ``-kvu``, their idle
    slots cleared): its rows attend over the batch's ``n_kv`` cells with its own at ``cells``
    (one per position, every other cell hidden), through ggml's tiled kernel whenever the
    micro-batch has ``FA_TILE_Q`` rows or more (``tiled``), however few its own. Its K/V are
    stored in its own cache from position 0. ``windows``: each layer's sliding window (0: none);
    the sliding layers' cache is emptied alike and takes the batch from its cell 0 too (a batch
    fits its cells), their mask hiding what is out of the window as well. Neither cache's
    ``n_kv`` changes a bit here: the cells past the batch are hidden, so skipped. Its cells
    follow the batch's earlier sequences in an emptied cache; where the other slots' sequences
    stay in the cache (llama-server's idle slots not cleared) they are those
    kv_cache.SharedCells gives it; a sliding-window model's sliding layers then sit at
    ``swa_cells`` of their own cache, attended over its ``swa_n_kv`` (kv_cache.IswaCells)."""

    cells: numpy.ndarray = field(default_factory=lambda: numpy.zeros(0, numpy.int64))
    n_kv: int = 0
    tiled: bool = False
    windows: tuple[int, ...] = ()
    swa_cells: numpy.ndarray | None = None
    swa_n_kv: int = 0

    def store_attend(self, ops: Ops, il: int, q: Any, k: Any, v: Any, scale: Any) -> Any:
        """The rows' K/V into its cache, then their attention over the batch's cells (the
        cells before ``first`` hidden, so their values do not count): [n, h*hd]. Over q8_0
        cells ggml attends one row at a time whatever the micro-batch, skipping the hidden
        cells, so there the sequence's own cells are all that counts."""
        self.cache.store(il, self.step.start, k, v)
        if self.cache.cache_type == "q8_0":
            return ops.attend(il, q, self.step, self.cache, scale)
        end = self.step.end
        window = self.windows[il] if self.windows else 0
        own_cache = bool(window) and self.swa_cells is not None  # the sliding layers' cache
        cells, n_kv = (self.swa_cells, self.swa_n_kv) if own_cache else (self.cells, self.n_kv)
        assert cells is not None
        keys, values = (
            _at_cells(a, cells) for a in (self.cache.keys(il, end), self.cache.values(il, end))
        )
        out = exact_attention.flash_attn_f16(
            q,
            keys,
            values,
            self._cells_mask(window, cells, own_cache),
            scale,
            n_kv=n_kv,
            n_threads=self.step.n_threads,
            tiled=self.tiled,
        )
        return out.reshape(q.shape[0], -1)

    def _cells_mask(self, window: int, cells: numpy.ndarray, own_cache: bool) -> numpy.ndarray:
        """[n, width], read-only: each row sees its own sequence's ``cells`` up to its
        position (the causal mask) and within ``window`` (0: none), every other cell hidden;
        ``own_cache``: the sliding layers' cells in a cache of their own."""
        key = f"cells {window} {own_cache}"
        if key not in self.step.masks:
            n, end = self.step.positions.shape[0], self.step.end
            mask = numpy.full((n, _width(cells, end)), F32(-numpy.inf), F32)
            own = self.step.mask(numpy, window)
            mask[:, cells[:end]] = 0 if own is None else own
            mask.flags.writeable = False
            self.step.masks[key] = mask
        return self.step.masks[key]


def _width(cells: numpy.ndarray, end: int) -> int:
    """The batch's cells up to the last of a sequence's positions 0..end-1."""
    return int(cells[:end].max()) + 1


def _at_cells(own: Any, cells: numpy.ndarray) -> numpy.ndarray:
    """[n_head_kv, width, hd]: the batch's cells up to this sequence's last, its own at its
    ``cells``."""
    end = own.shape[1]
    out = numpy.zeros((own.shape[0], _width(cells, end), own.shape[2]), F32)
    out[:, cells[:end]] = own
    return out


@dataclass
class DecodeRows:
    """Several sequences' decode steps as consecutive rows of a shared pass: row i the one new
    token of caches[i] at positions[i] (f16 caches on the exact path, their rings placed).
    Each row is stored and attended over its own cache by the fused decode step's one-row
    kernel (``ExactOps.row_attention``), a call per row and layer where a ``Segment`` of one
    row would make several."""

    rows: slice
    ropes: dict[bool, tuple[Any, Any]]  # cos/sin [B, hd/2]: each row's own position
    attend_rows: Callable[[int, Any, Any, Any, Any], Any]
    caches: list[KVCache]
    positions: list[int]

    @property
    def last_rows(self) -> list[int]:
        return list(range(self.rows.start, self.rows.stop))

    def store_attend(self, ops: Ops, il: int, q: Any, k: Any, v: Any, scale: Any) -> Any:
        return self.attend_rows(il, q, k, v, scale)

    def advance(self) -> None:
        for cache, pos in zip(self.caches, self.positions):
            cache.advance(pos + 1)


def row_groups(segments: Sequence[Segment | DecodeRows]) -> list[int]:
    """The sizes of a pass's groups of rows that llama-server multiplies each in a product of
    their own: a segment's micro-batch, each decode step alone, the sequences of one
    micro-batch (consecutive ``BatchSegment``s) together."""
    groups: list[int] = []
    for i, seg in enumerate(segments):
        n = seg.rows.stop - seg.rows.start
        if isinstance(seg, DecodeRows):
            groups += [1] * n
        elif isinstance(seg, BatchSegment) and i and isinstance(segments[i - 1], BatchSegment):
            groups[-1] += n
        else:
            groups.append(n)
    return groups


def attention(
    ops: Ops,
    hp: HParams,
    il: int,
    layer: Layer,
    h: Any,
    segments: Sequence[Segment | DecodeRows],
    groups: Sequence[int],
) -> Any:
    """Causal GQA self-attention of h [n, d], each segment's rows over its own cache (its
    batch's K/V stored first); the Q/K/V product is one for all the rows (``groups``: their
    row_groups)."""
    parts = apply_all(ops.xp, layer.qkv, h, groups)  # q [n, h*hd], k and v [n, kv*hd] (or qkv)
    outs = []
    for seg in segments:
        rows = {name: part[seg.rows] for name, part in parts.items()}
        outs.append(attend_segment(ops, hp, il, layer, rows, seg))
    return outs[0] if len(outs) == 1 else ops.xp.concatenate(outs)  # [n, h*hd]


def attend_segment(
    ops: Ops, hp: HParams, il: int, layer: Layer, parts: dict[str, Any], seg: Segment | DecodeRows
) -> Any:
    """One segment's part of ``attention``: its Q/K/V rows normed, turned and attended."""
    q, k, v = split_heads(hp, parts, seg.rows.stop - seg.rows.start)
    if layer.q_norm is not None:  # qwen3, gemma3: RMSNorm of each head
        q, k = ops.norm(q, layer.q_norm), ops.norm(k, layer.k_norm)
    cos, sin = seg.ropes[hp.swa_layers[il]]  # [n, hd/2]
    q = ops.rope(q, cos, sin, hp.spec.rope_neox)
    k = ops.rope(k, cos, sin, hp.spec.rope_neox)
    q_scale, scale = (F32(s) for s in hp.spec.attention_scales(hp.attn_scale))
    if q_scale != 1:  # gemma3 scales Q before attention and attends with scale 1
        q = q * q_scale
    return seg.store_attend(ops, il, q, k, v, scale)  # [n, h*hd]


def feed_forward(ops: Ops, layer: Layer, h: Any, groups: Sequence[int] | None = None) -> Any:
    """down(glu(gate(h), up(h))): h [n, d] → [n, d], through [n, f] (``groups``: Linear's)."""
    gu = apply_all(ops.xp, layer.gate_up, h, groups)  # gate, up [n, f]
    return layer.down(ops.xp, ops.glu(gu["gate"], gu["up"]), groups)["down"]


def block(
    ops: Ops,
    hp: HParams,
    il: int,
    layer: Layer,
    x: Any,
    segments: Sequence[Segment | DecodeRows],
    only_last: bool,
) -> Any:
    """One pre-norm transformer layer: x [n, d] → [n, d] (each segment's last row only if
    ``only_last``)."""
    h = ops.norm(x, layer.attn_norm)  # [n, d]
    groups = row_groups(segments)
    out = layer.wo(ops.xp, attention(ops, hp, il, layer, h, segments, groups), groups)["o"]
    if only_last:  # llama.cpp keeps only the output row(s) after the last layer's attention
        # output product (build_attn multiplies every row by wo before get_rows): F16, BF16
        # and F32 products round differently for one row (vec_dot) and several (tinyBLAS)
        last = [row for seg in segments for row in seg.last_rows]
        if len(last) == 1:
            out, x = out[last[0] : last[0] + 1], x[last[0] : last[0] + 1]
        else:
            out, x = out[last], x[last]
        groups = [1] * len(last)
    if layer.post_attn_norm is not None:  # gemma3
        out = ops.norm(out, layer.post_attn_norm)
    x = x + out
    h = ops.norm(x, layer.ffn_norm)
    out = feed_forward(ops, layer, h, groups)  # [n, d]
    if layer.post_ffw_norm is not None:  # gemma3
        out = ops.norm(out, layer.post_ffw_norm)
    return x + out


def stack(
    ops: Ops,
    hp: HParams,
    weights: Weights,
    x: Any,
    segments: Sequence[Segment | DecodeRows],
    all_logits: bool,
) -> Any:
    """Every layer, the output norm and the logits product: x [n, d] → [n or one per segment,
    V]."""
    rows = hidden(ops, hp, weights, x, segments, all_logits)
    groups = row_groups(segments) if all_logits else [1] * rows.shape[0]
    return weights.output(ops.xp, rows, groups)["logits"]


def hidden(
    ops: Ops,
    hp: HParams,
    weights: Weights,
    x: Any,
    segments: Sequence[Segment | DecodeRows],
    all_rows: bool,
) -> Any:
    """Every layer and the output norm: x [n, d] → [n or one per segment, d], llama.cpp's
    ``t_embd`` (the rows the logits product reads)."""
    for il, layer in enumerate(weights.layers):
        only_last = il == hp.n_layer - 1 and not all_rows
        x = block(ops, hp, il, layer, x, segments, only_last)
    return ops.norm(x, weights.output_norm)


def split_heads(hp: HParams, parts: dict[str, Any], n: int) -> tuple[Any, Any, Any]:
    """Q, K, V by heads, from their own products or one fused product."""
    if "qkv" in parts:
        fused = parts["qkv"]
        nq, nk = hp.n_head * hp.head_dim, hp.n_head_kv * hp.head_dim
        parts = {"q": fused[:, :nq], "k": fused[:, nq : nq + nk], "v": fused[:, nq + nk :]}
    return (
        parts["q"].reshape(n, hp.n_head, hp.head_dim),
        parts["k"].reshape(n, hp.n_head_kv, hp.head_dim),
        parts["v"].reshape(n, hp.n_head_kv, hp.head_dim),
    )


class Model:
    """A GGUF model ready to run forward passes on one device, through one backend."""

    def __init__(
        self,
        hp: HParams,
        weights: Weights,
        xp: ModuleType,
        path: str,
        reader: Any,
        exact: bool = True,
    ):
        self.hp = hp
        self.weights = weights
        self.xp = xp
        self.path = path
        self.reader = reader  # the header, reusable by the tokenizer and template code
        self.arch = hp.arch
        self.n_vocab = hp.n_vocab
        self.n_embd = hp.n_embd
        self.n_layer = hp.n_layer
        self.n_ctx_train = hp.n_ctx_train
        # ggml's f16 GELU table, one for both backends (built on the host, moved to the device)
        gelu = xp.asarray(exact_ops.gelu_f16_table()) if hp.spec.ffn_activation == "gelu" else None
        # On the CPU, every op rounds as ggml's kernels do; the array backend (CuPy) keeps the
        # vectorised approximations.
        self.ops: Ops = (
            ExactOps(hp, weights, gelu) if exact and xp is numpy else ArrayOps(xp, hp, gelu)
        )
        self.exact = self.ops.exact
        # BLAS threads: `threads` for batches (None: BLAS's default, one per core), and
        # `decode_threads` for one-token steps (backend.BlasThreads says why 1)
        self.threads: int | None = None
        self.decode_threads: int | None = 1
        # llama-server's -t, on which the split of a long one-row attention depends
        self.ggml_threads = 2
        self._blas = backend.BlasThreads(xp)
        # one-token steps through the backend's fused step where it has one (False: never)
        self.fused_decode = True
        self._shares_passes: bool | None = None
        # on a GPU: why the decode step (device_model.py) does not run this model (None: it
        # does, or the model is on the CPU)
        self.array_path_reason: str | None = None

    @classmethod
    def load(
        cls,
        path: str | os.PathLike,
        device: str = "auto",
        progress: bool | None = None,
        exact: bool = True,
        device_step: bool = True,
    ) -> Model:
        """Read the header, refuse what is not played, then load the weights (tqdm bar).

        ``exact=False`` runs the array-module path (the one CuPy takes) on the CPU too, so that
        path is tested on machines without a GPU.

        On a GPU, a model the decode step plays (device_step.unsupported) is a
        ``device_model.DeviceModel``: its weights in their GGUF blocks on the device, each
        token one step of fused kernels. Any other takes the array path, the reason logged and
        kept in ``array_path_reason``; ``device_step=False`` or BANKML_DEVICE_STEP=0 asks for
        the array path."""
        xp = backend.get_xp(device)
        reader = open_reader(path)
        hp = read_hparams(reader)
        reason = None
        use_step = device_step
        if xp is not numpy:
            from bankml.engine_cupy import device_step as step_module

            why = step_module.unsupported(reader, hp)
            reason = None if why is None else f"the decode step does not play {why}"
            if not use_step or os.environ.get("BANKML_DEVICE_STEP", "1") == "0":
                reason = "asked for (device_step=False or BANKML_DEVICE_STEP=0)"
            if reason is None:
                from bankml.engine_cupy.device_model import DeviceModel

                on_device = DeviceModel.upload(xp, os.fspath(path), reader, hp)
                reason = on_device.not_compiled_here()
                if reason is None:
                    return on_device
                del on_device  # its device arrays go before the array path uploads its own
            log.warning(
                "%s runs the GPU's array path: %s",
                os.path.basename(os.fspath(path)),
                reason,
            )
        exact = exact and xp is numpy
        if xp is numpy:
            check_memory(reader, exact=exact)
        if exact:  # the loading thread runs the engine: it starts the kernels' workers
            jit.start_worker_threads()
        if progress is None:
            progress = sys.stderr.isatty()
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(
                total=total_tensor_bytes(reader),
                unit="B",
                unit_scale=True,
                desc=f"loading {os.path.basename(os.fspath(path))}",
                leave=False,
            )
        try:
            weights = load_weights(
                reader, hp, xp, tick=bar.update if bar else lambda n: None, exact=exact
            )
        finally:
            if bar is not None:
                bar.close()
        model = cls(hp, weights, xp, os.fspath(path), reader, exact)
        model.array_path_reason = reason
        return model

    @property
    def pooling_type(self) -> int:
        """The GGUF's ``<arch>.pooling_type`` (llama.cpp's enum: 0 none, 1 mean, 2 cls, 3 last,
        4 rank); 0 where the header has none, as llama.cpp's default for a decoder."""
        field = self.reader.fields.get(f"{self.arch}.pooling_type")
        if field is None:
            return 0
        return int(field.parts[field.data[0]][0])

    @property
    def has_sliding_window(self) -> bool:
        """Whether some layers attend through a sliding window (gemma3): llama-server then cuts
        prompts for its context checkpoints (engine.prompt_batches)."""
        return bool(self.hp.swa_window and any(self.hp.swa_layers))

    def warm_up(
        self,
        cache_type: str | None = None,
        report: Callable[[str], None] | None = None,
        jobs: int = 1,
        alongside: Callable[[], None] | None = None,
    ) -> CompileStats:
        """Run every kernel a request can reach once, for a cache of ``cache_type``: Numba
        compiles them (or loads its on-disk cache) here rather than during the first answer.
        ``report`` is told what is compiling and how long it took (kernels.progress). Only
        the kernels of this model's weight types and cache type run, so only they compile.
        Up to ``jobs`` processes compile once a kernel misses the cache (compile_jobs);
        ``alongside`` runs here while the jobs compile. Nothing to compile on the array
        backend."""
        if not self.exact:
            if alongside is not None:
                alongside()
            return CompileStats()
        what = f"{os.path.basename(self.path)} ({', '.join(self.weight_types())} weights)"
        first, *rest = compile_jobs.parts_for(jobs)
        helpers = compile_jobs.Jobs(self.path, cache_type, rest, report)
        with progress.reporting(report, what, on_compile=helpers.start) as stats:
            try:
                self.ops.warm_up(self, cache_type, first)
                if alongside is not None:
                    alongside()
                if rest:
                    helpers.wait()  # a part whose job failed compiles here, below
                    self.ops.warm_up(self, cache_type, [s for part in rest for s in part])
            finally:
                helpers.stop()
        jit.release_compile_memory()  # the kernels are loaded: what only compiling needs goes
        return stats

    def weight_types(self) -> list[str]:
        """The GGUF types of this model's tensors (Q4_1, Q8_0, F32, ...), sorted."""
        return sorted({t.tensor_type.name for t in self.reader.tensors})

    def new_caches(self, n: int, n_ctx: int, cache_type: str | None = None) -> list[KVCache]:
        """``n`` caches, one per slot (the device model keeps them in one pool so that their
        decode steps can run as one)."""
        return [self.new_cache(n_ctx, cache_type) for _ in range(n)]

    def new_cache(self, n_ctx: int, cache_type: str | None = None) -> KVCache:
        """A cache for n_ctx positions (llama-server's -c); on the exact path gemma3's
        sliding-window layers also get llama.cpp's SWA cell layout (kv_cache.md)."""
        hp = self.hp
        return KVCache(
            self.xp,
            hp.n_layer,
            hp.n_head_kv,
            hp.head_dim,
            n_ctx,
            cache_type,
            window=hp.swa_window,
            sliding=hp.swa_layers,
            ring=self.exact,
            exact=self.exact,
        )

    def shift_context(self, cache: KVCache, n_keep: int, n_discard: int) -> None:
        """llama-server's context shift on ``cache`` (KVCache.shift): positions
        n_keep..n_keep+n_discard-1 dropped, the later ones moved down, their keys turned by RoPE
        at position -n_discard (llama.cpp's K-shift: the model's own RoPE, its frequency
        factors too)."""
        xp = self.xp
        cos, sin = self.ops.ropes(xp.asarray([-int(n_discard)]), self.weights.rope_freqs)[False]

        def turn(keys: Any) -> Any:
            n = keys.shape[0]
            return self.ops.rope(
                keys, xp.repeat(cos, n, axis=0), xp.repeat(sin, n, axis=0), self.hp.spec.rope_neox
            )

        cache.shift(n_keep, n_discard, turn)

    # --- the forward pass ----------------------------------------------------------------------

    def forward(
        self, tokens: Sequence[int], cache: KVCache, all_logits: bool = False
    ) -> numpy.ndarray:
        """Append ``tokens`` to ``cache`` and return the logits of the last (or every) token."""
        self._check_rows(tokens, cache)
        n = len(tokens)
        self._blas.set(self.decode_threads if n == 1 else self.threads)
        x = self._embed(tokens)
        seg = self._segment(0, tokens, cache)
        logits = None
        if n == 1 and self.fused_decode and cache.fused_decode:
            logits = self.ops.decode(x, seg.step, cache)  # one compiled call per layer, same bits
        if logits is None:
            logits = stack(self.ops, self.hp, self.weights, x, [seg], all_logits)
        cache.advance(seg.step.end)
        return self._final_logits(logits, all_logits)

    def hidden_states(
        self, tokens: Sequence[int], cache: KVCache | None = None, n_ubatch: int = 512
    ) -> numpy.ndarray:
        """llama.cpp's ``t_embd`` of every token of ``tokens``: the hidden states after the
        output norm, before the logits product, float32 [n_tokens, n_embd] on the host.

        The tokens go into ``cache`` (a new one of exactly their length when None; a given one
        is cleared first: an embedding is stateless, as llama-server's embedding task) in
        micro-batches of ``n_ubatch`` through the prompt pass's own kernels, every row kept
        after the last layer (llama-server asks an output for every token of an embedding), so
        each row is the bits llama-server's ``llama_get_embeddings_ith`` reads."""
        if cache is None:
            cache = self.new_cache(max(len(tokens), 1))
        else:
            cache.truncate(0)
        self._check_rows(tokens, cache)
        self._blas.set(self.threads)
        out = []
        for a in range(0, len(tokens), n_ubatch):
            chunk = tokens[a : a + n_ubatch]
            seg = self._segment(0, chunk, cache)
            rows = hidden(self.ops, self.hp, self.weights, self._embed(chunk), [seg], True)
            cache.advance(seg.step.end)
            out.append(numpy.asarray(backend.to_host(rows), dtype=F32))
        return numpy.ascontiguousarray(numpy.concatenate(out) if len(out) > 1 else out[0])

    def hidden_states_batch(
        self,
        tokens: Sequence[Sequence[int]],
        caches: Sequence[KVCache],
        n_ubatch: int = 512,
    ) -> list[numpy.ndarray]:
        """``hidden_states(tokens[i], caches[i], n_ubatch)`` of several inputs, each bit for
        bit its own call's (every cache cleared first, each its own).

        Where the model ``shares_passes``, the short inputs go through the layers together
        (passes.py ``hidden_passes``: inputs of at most 32 tokens, up to 128 rows a pass): every
        product multiplies all their rows at once (a row's bits do not depend on the rows
        beside it: weights.rows_independent), the norms, GLU and adds are row by row, and RoPE,
        the K/V store and the attention are each input's own over its own cache, from position
        0, as alone. Any other input is its own ``hidden_states``."""
        if len(tokens) != len(caches):
            raise ValueError(f"{len(tokens)} inputs for {len(caches)} caches")
        if len({id(c) for c in caches}) != len(caches):
            raise ValueError("each input needs a cache of its own")
        for toks, cache in zip(tokens, caches):
            cache.truncate(0)
            self._check_rows(toks, cache)
        out: list[Any] = [None] * len(tokens)
        for group in hidden_passes([len(t) for t in tokens], n_ubatch, self.shares_passes):
            if len(group) == 1:
                i = group[0]
                out[i] = self.hidden_states(tokens[i], caches[i], n_ubatch)
                continue
            self._blas.set(self.threads)
            x = self._embed([t for i in group for t in tokens[i]])
            segments: list[Segment | DecodeRows] = []
            row = 0
            for i in group:
                segments.append(self._segment(row, tokens[i], caches[i]))
                row += len(tokens[i])
            rows = numpy.asarray(
                backend.to_host(hidden(self.ops, self.hp, self.weights, x, segments, True)),
                dtype=F32,
            )
            for i, seg in zip(group, segments):
                seg.advance()
                out[i] = numpy.ascontiguousarray(rows[seg.rows])
        return out

    def hidden_states_together(
        self,
        tokens: Sequence[Sequence[int]],
        kv_size: int,
        cache_type: str | None = None,
        caches: Sequence[KVCache | None] = (),
        placed: BatchCells | None = None,
    ) -> list[numpy.ndarray]:
        """llama.cpp's ``t_embd`` of several sequences evaluated in one micro-batch, in that
        order, over one cache of ``kv_size`` cells of ``cache_type`` that was empty before it
        (llama-server's slots with ``-kvu``: ``BatchSegment``), each float32 [n_i, n_embd]
        bit for bit where the model ``follows_micro_batches``. Each sequence has its positions
        from 0 and attends to its own cells only, yet over an f16 cache through the batch's
        cells and tiles, so from ``FA_TILE_Q`` tokens in the batch a sequence's bits depend on
        where it sits. A sequence's K/V go to ``caches[i]`` where given (cleared first, left
        holding them: a slot that keeps its embedding), else to a cache of its own. ``placed``:
        the batch's cells where the cache was not empty before it (each sequence's, and the
        batch's ``n_kv``)."""
        if not self.follows_micro_batches:
            raise ValueError("this model's micro-batches of several sequences are not followed")
        total = sum(len(t) for t in tokens)
        if total > kv_size:
            raise ValueError(f"{total} tokens in a micro-batch over a cache of {kv_size} cells")
        n_kv = exact_attention.kv_length(total, kv_size)
        if placed is not None:
            placed.check(tokens, kv_size)
            n_kv = placed.n_kv
        hp = self.hp
        windows = tuple(hp.swa_window if sliding else 0 for sliding in hp.swa_layers)
        self._blas.set(self.threads)
        segments: list[Segment | DecodeRows] = []
        row = 0
        for j, toks in enumerate(tokens):
            given = caches[j] if j < len(caches) else None
            if given is None:
                cache = self.new_cache(max(len(toks), 1), cache_type)
            else:
                cache = given
                cache.truncate(0)
            self._check_rows(toks, cache)
            seg = self._segment(row, toks, cache)
            segments.append(
                BatchSegment(
                    seg.rows,
                    seg.step,
                    cache,
                    numpy.arange(row, row + len(toks)) if placed is None else placed.cells[j],
                    n_kv,
                    total >= exact_attention.FA_TILE_Q,
                    windows,
                    None if placed is None or placed.swa_cells is None else placed.swa_cells[j],
                    0 if placed is None else placed.swa_n_kv,
                )
            )
            row += len(toks)
        x = self._embed([t for toks in tokens for t in toks])
        rows = numpy.asarray(
            backend.to_host(hidden(self.ops, self.hp, self.weights, x, segments, True)),
            dtype=F32,
        )
        for kept, toks in zip(caches, tokens):
            if kept is not None:  # it holds the sequence now
                kept.advance(len(toks))
        return [numpy.ascontiguousarray(rows[seg.rows]) for seg in segments]

    @property
    def follows_micro_batches(self) -> bool:
        """Whether ``hidden_states_together`` computes llama-server's bits: on the exact path
        (every product is ggml's for the batch's rows, the batch's sequences one group of rows,
        ``row_groups``, as one micro-batch's product in llama-server)."""
        return bool(self.exact)

    @property
    def rows_independent(self) -> bool:
        """Whether every product gives a row the same bits whatever rows it is multiplied
        beside (weights.rows_independent), so that an input's states in a micro-batch below
        ``FA_TILE_Q`` tokens are its own."""
        return bool(self.exact) and all(rows_independent(m) for m in self._matrices())

    def _matrices(self) -> list[Any]:
        """Every matrix a pass multiplies its rows by (the output's last)."""
        w = self.weights
        return [
            linear
            for layer in w.layers
            for linear in (*layer.qkv, layer.wo, *layer.gate_up, layer.down)
        ] + [w.output]

    @property
    def shares_passes(self) -> bool:
        """Whether ``forward_batch`` runs several sequences' prompt chunks in one pass: on the
        exact path, when every product of the model gives a row the same bits whatever rows
        it is multiplied beside (weights.rows_independent) or multiplies each sequence's rows
        in that sequence's own arithmetic (weights.rows_grouped: the K-quants); otherwise each
        is its own pass."""
        if self._shares_passes is None:
            self._shares_passes = self.exact and all(
                rows_independent(m) or rows_grouped(m) for m in self._matrices()
            )
        return self._shares_passes

    def forward_batch(
        self, tokens: Sequence[Sequence[int]], caches: Sequence[KVCache]
    ) -> PassLogits:
        """One micro-batch for each of several sequences: tokens[i] appended to caches[i];
        the logits of each one's last token, each its own array, with the passes that
        computed them (``PassLogits.passes``).

        Each is bit for bit ``forward(tokens[i], caches[i])``, and each cache ends as that
        call leaves it. The passes are passes.pass_groups': where the model ``shares_passes``,
        the prompt chunks go through the layers together (``shared_pass``) and the decode
        steps ride in the first of those passes; otherwise (or with no prompt chunk) the
        decode steps are one ``decode_batch`` and each chunk its own ``forward``. Every
        sequence is checked before any cache changes."""
        if len(tokens) != len(caches):
            raise ValueError(f"{len(tokens)} micro-batches for {len(caches)} caches")
        if len({id(c) for c in caches}) != len(caches):
            raise ValueError("each sequence needs a cache of its own")
        for toks, cache in zip(tokens, caches):
            self._check_rows(toks, cache)
        out: list[Any] = [None] * len(tokens)
        passes = pass_groups([len(toks) for toks in tokens], self.shares_passes)
        for group in passes:
            batches, group_caches = [tokens[i] for i in group], [caches[i] for i in group]
            if all(len(toks) == 1 for toks in batches):
                rows = self.decode_batch([toks[0] for toks in batches], group_caches)
                logits = [row.copy() for row in rows]  # its own array: a run may keep it
            elif len(group) == 1:
                logits = [self.forward(batches[0], group_caches[0])]
            else:
                logits = self.shared_pass(batches, group_caches)
            for i, row in zip(group, logits):
                out[i] = row
        return PassLogits(out, passes)

    def shared_pass(
        self, tokens: Sequence[Sequence[int]], caches: Sequence[KVCache]
    ) -> list[numpy.ndarray]:
        """Several sequences' micro-batches through the layers as one pass (checked by the
        caller; only where the model ``shares_passes``): every product multiplies all their
        rows at once, reading its weights once for all; the norms, GLU and residual adds are
        row by row; RoPE, the K/V store and the attention are each sequence's own, over its
        own cache, as in its own pass; the last layer keeps each sequence's last row. The
        decode steps whose cache the fused step takes are the pass's first rows, one
        ``DecodeRows``; every other micro-batch is a ``Segment``. The logits come back in
        the order of ``tokens``."""
        self._blas.set(self.threads)
        decode: list[int] = []
        others: list[int] = []
        for i, toks in enumerate(tokens):
            one_row = len(toks) == 1 and self._row_attends(caches[i])
            (decode if one_row else others).append(i)
        order = decode + others
        x = self._embed([t for i in order for t in tokens[i]])
        segments: list[Segment | DecodeRows] = []
        if decode:
            segments.append(self._decode_rows([caches[i] for i in decode]))
        row = len(decode)
        for i in others:
            segments.append(self._segment(row, tokens[i], caches[i]))
            row += len(tokens[i])
        logits = stack(self.ops, self.hp, self.weights, x, segments, False)
        for seg in segments:
            seg.advance()
        rows = self._final_logits(logits, True)
        out: list[Any] = [None] * len(tokens)
        for r, i in enumerate(order):
            out[i] = rows[r].copy()
        return out

    def _row_attends(self, cache: KVCache) -> bool:
        """Whether a decode step on ``cache`` can be a row of a shared pass's ``DecodeRows``."""
        return isinstance(self.ops, ExactOps) and self.fused_decode and cache.fused_decode

    def _decode_rows(self, caches: Sequence[KVCache]) -> DecodeRows:
        """One decode step for each cache as the first rows of a pass: each ring's cell placed,
        RoPE at each row's own position."""
        assert isinstance(self.ops, ExactOps)
        positions = [cache.n_tokens for cache in caches]
        for cache, pos in zip(caches, positions):
            cache.place(pos, 1)
        ropes = self.ops.ropes(numpy.asarray(positions, dtype=numpy.int64), self.weights.rope_freqs)
        attend_rows = self.ops.row_attention(positions, caches, self.ggml_threads)
        return DecodeRows(slice(0, len(caches)), ropes, attend_rows, list(caches), positions)

    def _check_rows(self, tokens: Sequence[int], cache: KVCache) -> None:
        """What a micro-batch must be before its cache changes: some tokens, room for them,
        ids in the vocabulary."""
        n = len(tokens)
        if n == 0:
            raise ValueError("forward needs at least one token")
        if cache.n_tokens + n > cache.n_ctx:
            raise ValueError(f"{cache.n_tokens + n} positions do not fit a cache of {cache.n_ctx}")
        ids = numpy.asarray(tokens, dtype=numpy.int64)
        if ids.min() < 0 or ids.max() >= self.hp.n_vocab:
            raise ValueError(f"token id out of range 0..{self.hp.n_vocab - 1}")

    def _embed(self, tokens: Sequence[int]) -> Any:
        """The tokens' embedding rows [n, d] (gemma3's scale applied)."""
        ids = numpy.asarray(tokens, dtype=numpy.int64)
        x = self.weights.token_embd[self.xp.asarray(ids)]
        if self.hp.embd_scale != 1.0:
            x = x * F32(self.hp.embd_scale)
        return x

    def _segment(self, row: int, tokens: Sequence[int], cache: KVCache) -> Segment:
        """The micro-batch of ``tokens`` at the end of ``cache`` as rows row.. of a pass: its
        step, and the sliding-window ring's cells placed for it."""
        xp, n, start = self.xp, len(tokens), cache.n_tokens
        positions = xp.arange(start, start + n)
        step = Step(
            positions,
            start,
            start + n,
            self.ops.ropes(positions, self.weights.rope_freqs),
            self.ggml_threads,
            readonly_masks=self.exact,
        )
        cache.place(start, n)
        return Segment(slice(row, row + n), step, cache)

    def decode_batch(self, tokens: Sequence[int], caches: Sequence[KVCache]) -> numpy.ndarray:
        """One decode step for each of several sequences: tokens[i] appended to caches[i]
        (each cache its own sequence, at its own length); the logits [B, n_vocab].

        Row i is bit for bit ``forward([tokens[i]], caches[i])``, and each cache ends as that
        call leaves it. On the exact path the rows whose cache the fused step takes (f16) go
        through kernels.exact_batch together, the products reading each weight once for all of
        them; any other row (a q8_0 cache, the array backend, a model the fused step does not
        take, ``fused_decode`` off) is its own ``forward``: the same answer, no gain. Every
        row is checked before any cache changes."""
        if len(tokens) != len(caches):
            raise ValueError(f"{len(tokens)} tokens for {len(caches)} caches")
        if len({id(c) for c in caches}) != len(caches):
            raise ValueError("each row needs a cache of its own")
        if len(tokens) == 1:
            return self.forward([tokens[0]], caches[0])[None, :]
        for token, cache in zip(tokens, caches):
            self._check_rows([int(token)], cache)
        out = numpy.empty((len(tokens), self.hp.n_vocab), F32)
        batched = []
        ops = self.ops
        if isinstance(ops, ExactOps) and self.fused_decode and ops.plan is not None:
            batched = [i for i, cache in enumerate(caches) if cache.fused_decode]
        if len(batched) < 2:
            batched = []
        else:
            assert isinstance(ops, ExactOps)  # only its fused step takes several caches
            x = self._embed([int(tokens[i]) for i in batched])
            starts = [caches[i].n_tokens for i in batched]
            for i, start in zip(batched, starts):
                caches[i].place(start, 1)
            logits = ops.decode_batch(x, starts, [caches[i] for i in batched], self.ggml_threads)
            assert logits is not None  # its plan takes this model (above)
            for row, (i, start) in enumerate(zip(batched, starts)):
                caches[i].advance(start + 1)
                out[i] = self._final_logits(logits[row : row + 1], False)
        for i in sorted(set(range(len(tokens))) - set(batched)):
            out[i] = self.forward([tokens[i]], caches[i])
        return out

    def _final_logits(self, logits: Any, all_logits: bool) -> numpy.ndarray:
        """gemma3's final soft-capping, then the last row (or all) on the host."""
        if self.hp.final_softcap:
            cap = F32(self.hp.final_softcap)
            logits = self.xp.tanh(logits / cap) * cap
        out = backend.to_host(logits)
        return numpy.ascontiguousarray(out[-1] if not all_logits else out, dtype=F32)

    def _decode_plan(self) -> Any | None:
        """The fused decode step's layout (exact_decode.DecodePlan) the next one-token step
        takes, or None (the definition's stack runs then)."""
        return self.ops.plan if self.fused_decode and isinstance(self.ops, ExactOps) else None
