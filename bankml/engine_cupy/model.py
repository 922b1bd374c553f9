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

import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Protocol

import numpy

from bankml.engine_cupy import backend
from bankml.engine_cupy.array_backend import ArrayOps
from bankml.engine_cupy.exact_backend import ExactOps
from bankml.engine_cupy.kernels import exact_ops, jit, progress
from bankml.engine_cupy.kernels.progress import CompileStats
from bankml.engine_cupy.kv_cache import KVCache
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
    total_tensor_bytes,
)

__all__ = ["Model", "KVCache", "UnsupportedModel"]

F32 = numpy.float32


class Ops(Protocol):
    """What a backend gives the definition (ExactOps, ArrayOps)."""

    xp: ModuleType
    exact: bool

    def ropes(self, positions: Any, rope_freqs: Any | None) -> dict[bool, tuple[Any, Any]]: ...
    def norm(self, x: Any, weight: Any) -> Any: ...
    def rope(self, x: Any, cos: Any, sin: Any, neox: bool) -> Any: ...
    def glu(self, gate: Any, up: Any) -> Any: ...
    def attend(self, il: int, q: Any, step: Step, cache: KVCache, scale: Any) -> Any: ...
    def decode(self, x: Any, step: Step, cache: KVCache) -> Any | None: ...
    def warm_up(self, model: Model, cache_type: str | None) -> None: ...


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
        """The sliding-window ring's mask (kv_cache.SlidingCells.mask), read-only."""
        if "ring" not in self.masks:
            mask = cells.mask(self.positions)
            mask.flags.writeable = False
            self.masks["ring"] = mask
        return self.masks["ring"]


# --- the definition ------------------------------------------------------------------------------
# n tokens, d = n_embd, h = n_head, kv = n_head_kv, hd = head_dim, f = n_ff, V = n_vocab


def attention(
    ops: Ops, hp: HParams, il: int, layer: Layer, h: Any, step: Step, cache: KVCache
) -> Any:
    """Causal GQA self-attention of h [n, d] over the cache, this batch's K/V stored first."""
    parts = apply_all(ops.xp, layer.qkv, h)  # q [n, h*hd], k and v [n, kv*hd] (or fused qkv)
    q, k, v = split_heads(hp, parts, h.shape[0])  # [n, h, hd], [n, kv, hd], [n, kv, hd]
    if layer.q_norm is not None:  # qwen3, gemma3: RMSNorm of each head
        q, k = ops.norm(q, layer.q_norm), ops.norm(k, layer.k_norm)
    cos, sin = step.ropes[hp.swa_layers[il]]  # [n, hd/2]
    q = ops.rope(q, cos, sin, hp.spec.rope_neox)
    k = ops.rope(k, cos, sin, hp.spec.rope_neox)
    scale = F32(hp.attn_scale)
    if hp.arch == "gemma3":  # gemma3 scales Q before attention and attends with scale 1
        q, scale = q * scale, F32(1)
    cache.store(il, step.start, k, v)
    return ops.attend(il, q, step, cache, scale)  # [n, h*hd]


def feed_forward(ops: Ops, layer: Layer, h: Any) -> Any:
    """down(glu(gate(h), up(h))): h [n, d] → [n, d], through [n, f]."""
    gu = apply_all(ops.xp, layer.gate_up, h)  # gate, up [n, f]
    return layer.down(ops.xp, ops.glu(gu["gate"], gu["up"]))["down"]


def block(
    ops: Ops,
    hp: HParams,
    il: int,
    layer: Layer,
    x: Any,
    step: Step,
    cache: KVCache,
    only_last: bool,
) -> Any:
    """One pre-norm transformer layer: x [n, d] → [n, d] (the last row only if ``only_last``)."""
    h = ops.norm(x, layer.attn_norm)  # [n, d]
    out = layer.wo(ops.xp, attention(ops, hp, il, layer, h, step, cache))["o"]  # [n, d]
    if only_last:  # llama.cpp keeps only the output row(s) after the last layer's attention
        # output product (build_attn multiplies every row by wo before get_rows): F16, BF16
        # and F32 products round differently for one row (vec_dot) and several (tinyBLAS)
        out, x = out[-1:], x[-1:]
    if layer.post_attn_norm is not None:  # gemma3
        out = ops.norm(out, layer.post_attn_norm)
    x = x + out
    h = ops.norm(x, layer.ffn_norm)
    out = feed_forward(ops, layer, h)  # [n, d]
    if layer.post_ffw_norm is not None:  # gemma3
        out = ops.norm(out, layer.post_ffw_norm)
    return x + out


def stack(
    ops: Ops, hp: HParams, weights: Weights, x: Any, step: Step, cache: KVCache, all_logits: bool
) -> Any:
    """Every layer, the output norm and the logits product: x [n, d] → [n or 1, V]."""
    for il, layer in enumerate(weights.layers):
        only_last = il == hp.n_layer - 1 and not all_logits
        x = block(ops, hp, il, layer, x, step, cache, only_last)
    return weights.output(ops.xp, ops.norm(x, weights.output_norm))["logits"]


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

    @classmethod
    def load(
        cls,
        path: str | os.PathLike,
        device: str = "auto",
        progress: bool | None = None,
        exact: bool = True,
    ) -> Model:
        """Read the header, refuse what is not played, then load the weights (tqdm bar).

        ``exact=False`` runs the array-module path (the one CuPy takes) on the CPU too, so that
        path is tested on machines without a GPU."""
        xp = backend.get_xp(device)
        reader = open_reader(path)
        hp = read_hparams(reader)
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
        return cls(hp, weights, xp, os.fspath(path), reader, exact)

    @property
    def has_sliding_window(self) -> bool:
        """Whether some layers attend through a sliding window (gemma3): llama-server then cuts
        prompts for its context checkpoints (engine.prompt_batches)."""
        return bool(self.hp.swa_window and any(self.hp.swa_layers))

    def warm_up(
        self, cache_type: str | None = None, report: Callable[[str], None] | None = None
    ) -> CompileStats:
        """Run every kernel a request can reach once, for a cache of ``cache_type``: Numba
        compiles them (or loads its on-disk cache) here rather than during the first answer.
        ``report`` is told what is compiling and how long it took (kernels.progress). Only
        the kernels of this model's weight types and cache type run, so only they compile.
        Nothing to compile on the array backend."""
        if not self.exact:
            return CompileStats()
        what = f"{os.path.basename(self.path)} ({', '.join(self.weight_types())} weights)"
        with progress.reporting(report, what) as stats:
            self.ops.warm_up(self, cache_type)
        return stats

    def weight_types(self) -> list[str]:
        """The GGUF types of this model's tensors (Q4_1, Q8_0, F32, ...), sorted."""
        return sorted({t.tensor_type.name for t in self.reader.tensors})

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

    # --- the forward pass ----------------------------------------------------------------------

    def forward(
        self, tokens: Sequence[int], cache: KVCache, all_logits: bool = False
    ) -> numpy.ndarray:
        """Append ``tokens`` to ``cache`` and return the logits of the last (or every) token."""
        xp, hp = self.xp, self.hp
        n = len(tokens)
        start = cache.n_tokens
        if n == 0:
            raise ValueError("forward needs at least one token")
        if start + n > cache.n_ctx:
            raise ValueError(f"{start + n} positions do not fit a cache of {cache.n_ctx}")
        ids = numpy.asarray(tokens, dtype=numpy.int64)
        if ids.min() < 0 or ids.max() >= hp.n_vocab:
            raise ValueError(f"token id out of range 0..{hp.n_vocab - 1}")
        x = self.weights.token_embd[xp.asarray(ids)]  # [n, d]
        if hp.embd_scale != 1.0:
            x = x * F32(hp.embd_scale)
        self._blas.set(self.decode_threads if n == 1 else self.threads)
        positions = xp.arange(start, start + n)
        step = Step(
            positions,
            start,
            start + n,
            self.ops.ropes(positions, self.weights.rope_freqs),
            self.ggml_threads,
            readonly_masks=self.exact,
        )
        cache.place(start, n)  # the sliding-window ring's cells for this micro-batch
        logits = None
        if n == 1 and self.fused_decode and cache.fused_decode:
            logits = self.ops.decode(x, step, cache)  # one compiled call per layer, same bits
        if logits is None:
            logits = stack(self.ops, hp, self.weights, x, step, cache, all_logits)
        cache.advance(start + n)
        return self._final_logits(logits, all_logits)

    def decode_batch(self, tokens: Sequence[int], caches: Sequence[KVCache]) -> numpy.ndarray:
        """One decode step for each of several sequences: tokens[i] appended to caches[i]
        (each cache its own sequence, at its own length); the logits [B, n_vocab].

        Row i is bit for bit ``forward([tokens[i]], caches[i])``, and each cache ends as that
        call leaves it. On the exact path the rows whose cache the fused step takes (f16) go
        through kernels.exact_batch together, the products reading each weight once for all of
        them; any other row (a q8_0 cache, the array backend, a model the fused step does not
        take, ``fused_decode`` off) is its own ``forward``: the same answer, no gain. Every
        row is checked before any cache changes."""
        xp, hp = self.xp, self.hp
        if len(tokens) != len(caches):
            raise ValueError(f"{len(tokens)} tokens for {len(caches)} caches")
        if len({id(c) for c in caches}) != len(caches):
            raise ValueError("each row needs a cache of its own")
        if len(tokens) == 1:
            return self.forward([tokens[0]], caches[0])[None, :]
        for token, cache in zip(tokens, caches):
            if cache.n_tokens + 1 > cache.n_ctx:
                raise ValueError(
                    f"{cache.n_tokens + 1} positions do not fit a cache of {cache.n_ctx}"
                )
            if not 0 <= int(token) < hp.n_vocab:
                raise ValueError(f"token id out of range 0..{hp.n_vocab - 1}")
        out = numpy.empty((len(tokens), hp.n_vocab), F32)
        batched = []
        if isinstance(self.ops, ExactOps) and self.fused_decode and self.ops.plan is not None:
            batched = [i for i, cache in enumerate(caches) if cache.fused_decode]
        if len(batched) < 2:
            batched = []
        else:
            x = numpy.concatenate(
                [self.weights.token_embd[xp.asarray([int(tokens[i])])] for i in batched]
            )
            if hp.embd_scale != 1.0:
                x = x * F32(hp.embd_scale)
            starts = [caches[i].n_tokens for i in batched]
            for i, start in zip(batched, starts):
                caches[i].place(start, 1)
            logits = self.ops.decode_batch(
                x, starts, [caches[i] for i in batched], self.ggml_threads
            )
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
        return self.ops.plan if self.fused_decode else None
