"""The generic transformer forward pass (llama, qwen2, qwen3, gemma3) and the ``Model`` API.

Written once against ``xp`` (NumPy or CuPy). One call of ``forward`` runs one micro-batch: the
tokens' K/V are appended to the cache at positions ``cache.n_tokens..`` and the float32 logits of
the last token (or of every token) come back as a host NumPy array.

Where it matters for agreeing with llama-server, the arithmetic follows ggml's CPU kernels:
RMSNorm sums squares in double; RoPE angles are built by repeated f32 multiplication as
ggml_rope_cache_init; each matrix product sees the activation rounded to the weight type's
vec_dot_type (weights.quantize_activation); K/V go through the cache's rounding and Q is rounded
to K's type; GeGLU looks GELU up in ggml's f16 table.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import numpy

from bankml.engine_cupy import backend
from bankml.engine_cupy.kernels import exact_attention, exact_decode, exact_ops, jit
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


def rms_norm(xp: ModuleType, x: Any, weight: Any, eps: float) -> Any:
    """ggml_rms_norm then ggml_mul: squares summed in double, scale 1/sqrtf(mean + eps) in f32."""
    mean = (xp.square(x).astype(xp.float64).sum(axis=-1, keepdims=True) / x.shape[-1]).astype(F32)
    return (x * (F32(1) / xp.sqrt(mean + F32(eps)))) * weight


def silu(xp: ModuleType, x: Any) -> Any:
    return x / (F32(1) + xp.exp(-x))


def rope_angles(
    xp: ModuleType,
    positions: Any,
    head_dim: int,
    base: float,
    freq_scale: float,
    freq_factors: Any | None,
) -> tuple[Any, Any]:
    """cos, sin [n, head_dim/2] as ggml_rope_cache_init: theta = pos, then theta *= base^(-2/d)."""
    half = head_dim // 2
    theta_scale = F32(numpy.power(F32(base), F32(-2.0) / F32(head_dim)))
    steps = xp.full((positions.shape[0], half), theta_scale, dtype=F32)
    steps[:, 0] = positions.astype(F32)
    theta = xp.cumprod(steps, axis=1)  # sequential f32 products, as the C loop
    if freq_factors is not None:
        theta = theta / freq_factors
    theta = F32(freq_scale) * theta
    return xp.cos(theta), xp.sin(theta)


def apply_rope(x: Any, cos: Any, sin: Any, neox: bool) -> Any:
    """x [n, heads, head_dim] rotated; NEOX pairs (i, i + d/2), NORM pairs (2i, 2i + 1)."""
    c, s = cos[:, None, :], sin[:, None, :]
    out = x.copy()
    if neox:
        half = x.shape[-1] // 2
        a, b = x[..., :half], x[..., half:]
        out[..., :half] = a * c - b * s
        out[..., half:] = a * s + b * c
    else:
        a, b = x[..., 0::2], x[..., 1::2]
        out[..., 0::2] = a * c - b * s
        out[..., 1::2] = a * s + b * c
    return out


def softmax_product(xp: ModuleType, scores: Any, values: Any) -> Any:
    """softmax(scores) @ values in f32: scores [kv, rows, T] (−inf hidden), values [kv, T, hd]."""
    scores = scores - scores.max(axis=-1, keepdims=True)
    probs = xp.exp(scores)
    probs /= probs.sum(axis=-1, keepdims=True)
    return probs @ values


class Model:
    """A GGUF model ready to run forward passes on one device."""

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
        # ggml's f16 GELU table, one for both paths (built on the host, moved to the device)
        self._gelu = (
            xp.asarray(exact_ops.gelu_f16_table()) if hp.spec.ffn_activation == "gelu" else None
        )
        self._masks: dict[int | str, Any] = {}  # per window size, and "ring"
        # BLAS threads: `threads` for batches (None: BLAS's default, one per core), and
        # `decode_threads` for one-token steps (backend.BlasThreads says why 1)
        self.threads: int | None = None
        self.decode_threads: int | None = 1
        # llama-server's -t, on which the split of a long one-row attention depends
        self.ggml_threads = 2
        self._blas = backend.BlasThreads(xp)
        # On the CPU, every op rounds as ggml's kernels do (exact_matmul/ops/attention); the
        # array-module path (CuPy) keeps the vectorised approximations below.
        self.exact = exact and xp is numpy
        # one-token steps through exact_decode's fused layers (False: always the general path)
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

    def warm_up(self, cache_type: str | None = None) -> None:
        """Run every kernel a request can reach once, on a scratch cache: Numba compiles them (or
        loads its on-disk cache) here rather than during the first answer. A no-op on CuPy."""
        if not self.exact:
            return
        n = exact_attention.FA_TILE_Q + 1  # the tiled attention kernel, then the one-row one
        cache = self.new_cache(n + 3, cache_type)  # the type the engine's cache has
        exact_attention.warm_up(q8_0=cache.cache_type == "q8_0")
        self.forward([0] * n, cache)
        self.forward([0], cache)
        self.forward([0, 0], cache)

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
        x = self.weights.token_embd[xp.asarray(ids)]
        if hp.embd_scale != 1.0:
            x = x * F32(hp.embd_scale)
        self._blas.set(self.decode_threads if n == 1 else self.threads)
        positions = xp.arange(start, start + n)
        self._masks = {}  # masks depend on the positions: built afresh per call
        ropes = self._ropes(positions)
        cache.place(start, n)  # the sliding-window ring's cells for this micro-batch
        plan = self._decode_plan() if n == 1 and cache.fused_decode else None
        if plan is not None:  # one token: one compiled call per layer, the same bits
            logits = plan.step(
                numpy.ascontiguousarray(x, dtype=F32), start, ropes, cache, self.ggml_threads
            )
            cache.advance(start + n)
            return self._final_logits(logits, all_logits)
        for il, layer in enumerate(self.weights.layers):
            last = il == hp.n_layer - 1 and not all_logits
            x = self._block(il, layer, x, positions, ropes, cache, only_last=last)
        cache.advance(start + n)
        x = self._norm(x, self.weights.output_norm)
        return self._final_logits(self.weights.output(xp, x)["logits"], all_logits)

    def _final_logits(self, logits: Any, all_logits: bool) -> numpy.ndarray:
        """gemma3's final soft-capping, then the last row (or all) on the host."""
        if self.hp.final_softcap:
            cap = F32(self.hp.final_softcap)
            logits = self.xp.tanh(logits / cap) * cap
        out = backend.to_host(logits)
        return numpy.ascontiguousarray(out[-1] if not all_logits else out, dtype=F32)

    def _decode_plan(self) -> exact_decode.DecodePlan | None:
        """The fused decode step's layout of this model (exact_decode), made on first use;
        None where a matrix is not one it multiplies (the general path runs then)."""
        return self._plan if self.exact and self.fused_decode else None

    @functools.cached_property
    def _plan(self) -> exact_decode.DecodePlan | None:
        return exact_decode.DecodePlan.build(self.hp, self.weights, self._gelu)

    def _ropes(self, positions: Any) -> dict[bool, tuple[Any, Any]]:
        """cos/sin per layer kind: global (False) and, for gemma3, local sliding-window (True)."""
        hp = self.hp
        if self.exact:
            ropes = {
                False: exact_ops.rope_cos_sin(
                    positions,
                    hp.head_dim,
                    hp.rope_base,
                    hp.rope_freq_scale,
                    self.weights.rope_freqs,
                )
            }
            if any(hp.swa_layers):
                ropes[True] = exact_ops.rope_cos_sin(positions, hp.head_dim, hp.rope_base_swa)
            return ropes
        ropes = {
            False: rope_angles(
                self.xp,
                positions,
                hp.head_dim,
                hp.rope_base,
                hp.rope_freq_scale,
                self.weights.rope_freqs,
            )
        }
        if any(hp.swa_layers):
            ropes[True] = rope_angles(self.xp, positions, hp.head_dim, hp.rope_base_swa, 1.0, None)
        return ropes

    def _block(
        self,
        il: int,
        layer: Layer,
        x: Any,
        positions: Any,
        ropes: dict[bool, tuple[Any, Any]],
        cache: KVCache,
        only_last: bool,
    ) -> Any:
        xp, hp = self.xp, self.hp
        h = self._norm(x, layer.attn_norm)
        attn = self._attention(il, layer, h, positions, ropes[hp.swa_layers[il]], cache)
        out = layer.wo(xp, attn)["o"]
        if only_last:  # llama.cpp keeps only the output row(s) after the last layer's attention
            # output product (build_attn multiplies every row by wo before get_rows): F16, BF16
            # and F32 products round differently for one row (vec_dot) and several (tinyBLAS)
            out, x = out[-1:], x[-1:]
        if layer.post_attn_norm is not None:
            out = self._norm(out, layer.post_attn_norm)
        x = x + out
        h = self._norm(x, layer.ffn_norm)
        gu = apply_all(xp, layer.gate_up, h)
        out = layer.down(xp, self._gated(gu["gate"], gu["up"]))["down"]
        if layer.post_ffw_norm is not None:
            out = self._norm(out, layer.post_ffw_norm)
        return x + out

    def _norm(self, x: Any, weight: Any) -> Any:
        if self.exact:
            return exact_ops.rms_norm(x, weight, self.hp.rms_eps)
        return rms_norm(self.xp, x, weight, self.hp.rms_eps)

    def _gated(self, gate: Any, up: Any) -> Any:
        """SwiGLU or GeGLU of the gate and up projections."""
        if self.exact:
            if self._gelu is not None:
                return exact_ops.geglu(gate, up, self._gelu)
            return exact_ops.swiglu(gate, up)
        # contiguous, so NumPy's exp takes its SIMD path whatever the batch size (a strided view
        # takes another path whose last bit can differ, and q8 rounding would magnify it)
        gate = self.xp.ascontiguousarray(gate)
        act = self._gelu_lookup(gate) if self._gelu is not None else silu(self.xp, gate)
        return act * up

    def _gelu_lookup(self, x: Any) -> Any:
        """ggml_vec_geglu_f32: 0 below -10, x above 10, else the f16 table at f16(x)."""
        xp = self.xp
        idx = x.astype(xp.float16).view(xp.uint16)
        y = self._gelu[idx.astype(xp.int32)]
        y = xp.where(x <= F32(-10), F32(0), y)
        return xp.where(x >= F32(10), x, y)

    def _qkv(self, layer: Layer, h: Any) -> tuple[Any, Any, Any]:
        hp = self.hp
        parts = apply_all(self.xp, layer.qkv, h)
        if "qkv" in parts:
            fused = parts["qkv"]
            nq, nk = hp.n_head * hp.head_dim, hp.n_head_kv * hp.head_dim
            parts = {"q": fused[:, :nq], "k": fused[:, nq : nq + nk], "v": fused[:, nq + nk :]}
        n = h.shape[0]
        return (
            parts["q"].reshape(n, hp.n_head, hp.head_dim),
            parts["k"].reshape(n, hp.n_head_kv, hp.head_dim),
            parts["v"].reshape(n, hp.n_head_kv, hp.head_dim),
        )

    def _attention(
        self, il: int, layer: Layer, h: Any, positions: Any, rope: tuple[Any, Any], cache: KVCache
    ) -> Any:
        """Causal GQA attention over the cache (with this batch stored first); [n, n_head*hd]."""
        xp, hp = self.xp, self.hp
        q, k, v = self._qkv(layer, h)
        if layer.q_norm is not None:
            q = self._norm(q, layer.q_norm)
            k = self._norm(k, layer.k_norm)
        neox = hp.spec.rope_neox
        rotate = exact_ops.apply_rope if self.exact else apply_rope
        q = rotate(q, rope[0], rope[1], neox)
        k = rotate(k, rope[0], rope[1], neox)
        if hp.arch == "gemma3":  # gemma3 scales Q before attention and attends with scale 1
            q = q * F32(hp.attn_scale)
            scale = F32(1)
        else:
            scale = F32(hp.attn_scale)
        start = int(positions[0])
        n = q.shape[0]
        end = start + n
        cache.store(il, start, k, v)
        if self.exact:
            return self._attend_exact(il, q, positions, cache, end, scale)
        keys, values = cache.keys(il, end), cache.values(il, end)  # [kv, T, hd]
        group = hp.n_head // hp.n_head_kv
        # heads h = kv * group + j share KV head kv (ggml broadcasts head h to h // group)
        qg = cache.query(q).reshape(n, hp.n_head_kv, group, hp.head_dim).transpose(1, 2, 0, 3)
        qg = qg.reshape(hp.n_head_kv, group * n, hp.head_dim)
        scores = (qg @ keys.transpose(0, 2, 1)) * scale  # [kv, group*n, T]
        scores = scores.reshape(hp.n_head_kv, group, n, end)
        mask = self._mask(positions, end, hp.swa_window if hp.swa_layers[il] else 0)
        if mask is not None:
            scores = scores + mask
        scores = scores.reshape(hp.n_head_kv, group * n, end)
        out = softmax_product(xp, scores, values)  # [kv, group*n, hd]
        out = cache.output(out).reshape(hp.n_head_kv, group, n, hp.head_dim)
        return out.transpose(2, 0, 1, 3).reshape(n, hp.n_head * hp.head_dim)

    def _attend_exact(
        self, il: int, q: Any, positions: Any, cache: KVCache, end: int, scale: Any
    ) -> Any:
        """ggml's flash attention over the f16 or q8_0 cache, bit for bit (exact_attention).

        A sliding-window layer whose cache is a ring in llama.cpp (``cache.in_ring``) reads the
        ring's cells in cell order, with the mask of the positions they hold and its n_kv."""
        hp = self.hp
        if cache.in_ring(il):
            cells = cache.cells
            end, n_kv = cells.used_max_p1, cells.n_kv()
            mask = self._ring_mask(positions, cells)
        else:
            n_kv = exact_attention.kv_length(end, cache.kv_size)
            mask = self._mask(positions, end, hp.swa_window if hp.swa_layers[il] else 0)
        if cache.cache_type == "q8_0":  # Q turned like K; the output back from V's turn
            out = cache.output(
                exact_attention.flash_attn_q8_0(
                    cache.rotate_k(q), *cache.quantized(il, end), mask, scale
                )
            )
        else:
            out = exact_attention.flash_attn_f16(
                q,
                cache.keys(il, end),
                cache.values(il, end),
                mask,
                scale,
                n_kv=n_kv,
                n_threads=self.ggml_threads,
            )
        return out.reshape(q.shape[0], hp.n_head * hp.head_dim)

    def _ring_mask(self, positions: Any, cells: Any) -> Any:
        """The ring's mask (kv_cache.SlidingCells.mask), built once per forward, read-only."""
        if "ring" not in self._masks:
            mask = cells.mask(positions)
            mask.flags.writeable = False
            self._masks["ring"] = mask
        return self._masks["ring"]

    def _mask(self, positions: Any, end: int, window: int) -> Any | None:
        """[n, T] additive mask: key position > query position, or (window) too far back.

        None when nothing is hidden (one new token and no window reaching back), which spares
        decoding an addition per layer. The mask of a forward is built once per window size.
        """
        n = positions.shape[0]
        if n == 1 and (not window or end <= window):
            return None
        if window not in self._masks:
            mask = self._build_mask(positions, end, window)
            if self.exact:  # read-only: exact_attention rounds it once for all the layers
                mask.flags.writeable = False
            self._masks[window] = mask
        return self._masks[window]

    def _build_mask(self, positions: Any, end: int, window: int) -> Any:
        xp = self.xp
        kpos = xp.arange(end)[None, :]
        qpos = positions[:, None]
        hidden = kpos > qpos
        if window:
            hidden = hidden | (qpos - kpos >= window)
        return xp.where(hidden, F32(-xp.inf), F32(0))
