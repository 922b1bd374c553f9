"""The exact backend of the forward pass: every step rounds as ggml's CPU kernels do.

The steps of model.py through the kernels package (RMSNorm, RoPE, SwiGLU/GeGLU of
kernels.exact_ops; flash attention over the f16 or q8_0 cache of kernels.exact_attention; the
products are the weights' own, kernels.exact_matmul/kquants/iquants), so the logits are
llama-server's bits. A one-token step has a compiled fast path, ``decode``: the same
definition (norm, attention, feed-forward, the block, the stack) composed of the same kernels
in one Numba call per layer (kernels.exact_decode), the same bits with less dispatch; and
``decode_batch``, one token for each of several caches, whose products share each weight read
(kernels.exact_batch), every row the bits of its own one-token step.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy

from bankml.engine_cupy.kernels import exact_attention, exact_batch, exact_decode, exact_ops
from bankml.engine_cupy.kv_cache import KVCache
from bankml.engine_cupy.weights import HParams, Weights

F32 = numpy.float32

# The warm-up's steps, each a kind of forward a request reaches: the attention kernels on
# their own, a prompt past the tiled attention's rows, one token, two tokens, and the batched
# step of two sequences.
WARM_UP_STEPS = ("attention", "prompt", "decode", "pair", "batch")


class ExactOps:
    """norm, rope, glu and attend by the exact kernels, for one model on the CPU."""

    exact = True

    def __init__(self, hp: HParams, weights: Weights, gelu: Any | None):
        self.xp, self.hp, self.weights = numpy, hp, weights
        self.gelu = gelu  # ggml's f16 GELU table (GeGLU models), else None
        self._plan_lock = threading.Lock()
        self._plan: exact_decode.DecodePlan | None = None
        self._plan_built = False

    def ropes(self, positions: Any, rope_freqs: Any | None) -> dict[bool, tuple[Any, Any]]:
        """cos/sin per layer kind: global (False) and, for gemma3, local sliding-window (True)."""
        hp = self.hp
        ropes = {
            False: exact_ops.rope_cos_sin(
                positions, hp.head_dim, hp.rope_base, hp.rope_freq_scale, rope_freqs
            )
        }
        if any(hp.swa_layers):
            ropes[True] = exact_ops.rope_cos_sin(positions, hp.head_dim, hp.rope_base_swa)
        return ropes

    def norm(self, x: Any, weight: Any) -> Any:
        return exact_ops.rms_norm(x, weight, self.hp.rms_eps)

    def rope(self, x: Any, cos: Any, sin: Any, neox: bool) -> Any:
        return exact_ops.apply_rope(x, cos, sin, neox)

    def glu(self, gate: Any, up: Any) -> Any:
        """SwiGLU or GeGLU of the gate and up projections."""
        if self.gelu is not None:
            return exact_ops.geglu(gate, up, self.gelu)
        return exact_ops.swiglu(gate, up)

    def attend(self, il: int, q: Any, step: Any, cache: KVCache, scale: Any) -> Any:
        """ggml's flash attention over the f16 or q8_0 cache, bit for bit; q [n, n_head, hd]
        → [n, n_head*hd].

        A sliding-window layer whose cache is a ring in llama.cpp (``cache.in_ring``) reads the
        ring's cells in cell order, with the mask of the positions they hold and its n_kv."""
        hp = self.hp
        if cache.in_ring(il):
            cells = cache.layout(il)
            assert cells is not None  # a ring keeps its cells' positions
            end, n_kv = cells.used_max_p1, cells.n_kv()
            mask = step.ring_mask(cells)
        else:
            end = step.end
            n_kv = exact_attention.kv_length(end, cache.kv_size)
            mask = step.mask(numpy, hp.swa_window if hp.swa_layers[il] else 0)
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
                n_threads=step.n_threads,
            )
        return out.reshape(q.shape[0], hp.n_head * hp.head_dim)

    def row_attention(
        self, positions: Sequence[int], caches: Sequence[KVCache], n_threads: int
    ) -> Callable[[int, Any, Any, Any, Any], Any]:
        """For several one-token steps as rows of one pass (row i at positions[i] of
        caches[i], f16 caches with ``fused_decode``, their rings placed): ``attend_rows(il, q,
        k, v, scale)`` → [B, n_head*hd], which stores row i's K/V and attends over its cache's
        cells by the fused step's one-row kernel (kernels.exact_batch.store_attend): each row
        the bits ``attend`` gives it as a micro-batch of its own, in one compiled call."""
        hp = self.hp
        views = [exact_decode._CellViews(pos, cache) for pos, cache in zip(positions, caches)]

        def attend_rows(il: int, q: Any, k: Any, v: Any, scale: Any) -> Any:
            window = hp.swa_window if hp.swa_layers[il] else 0
            q, k, v = (numpy.ascontiguousarray(a, dtype=F32) for a in (q, k, v))
            out = numpy.empty((q.shape[0], hp.n_head * hp.head_dim), F32)
            for row, (pos, view) in enumerate(zip(positions, views)):
                exact_batch.store_attend(
                    q, k, v, row, pos, view.cells(il, window), F32(scale), n_threads, out
                )
            return out

        return attend_rows

    @property
    def plan(self) -> exact_decode.DecodePlan | None:
        """The fused decode step's layout of this model, made on first use (after any change
        to the weights' matrices); None where a matrix is not one it multiplies."""
        with self._plan_lock:
            if not self._plan_built:
                self._plan = exact_decode.DecodePlan.build(self.hp, self.weights, self.gelu)
                self._plan_built = True
            return self._plan

    def decode(self, x: Any, step: Any, cache: KVCache) -> Any | None:
        """The stack for one token x [1, n_embd] in one compiled call per layer (an f16 cache;
        kv_cache.fused_decode says when): the logits [1, n_vocab], or None where the plan does
        not take this model (the definition's stack runs then)."""
        plan = self.plan
        if plan is None:
            return None
        x = numpy.ascontiguousarray(x, dtype=F32)
        return plan.step(x, step.start, step.ropes, cache, step.n_threads)

    def decode_batch(
        self, x: Any, positions: Sequence[int], caches: Sequence[KVCache], n_threads: int
    ) -> Any | None:
        """One token for each cache: x [B, n_embd], row i at positions[i] of caches[i] (f16
        caches, their rings placed); the logits [B, n_vocab], each row ``decode``'s bits for
        that row alone, or None where the plan does not take this model."""
        plan = self.plan
        if plan is None:
            return None
        x = numpy.ascontiguousarray(x, dtype=F32)
        ropes = self.ropes(numpy.asarray(positions, dtype=numpy.int64), self.weights.rope_freqs)
        return exact_batch.BatchStep(plan).run(x, positions, ropes, caches, n_threads)

    def warm_up(
        self, model: Any, cache_type: str | None, steps: Sequence[str] = WARM_UP_STEPS
    ) -> None:
        """Run every kernel a request can reach once, on a scratch cache: Numba compiles them
        (or loads its on-disk cache) here rather than during the first answer. ``steps``:
        some of WARM_UP_STEPS, in any order (a compile job runs some, the start-up the
        others: compile_jobs)."""
        n = exact_attention.FA_TILE_Q + 1  # the tiled attention kernel, then the one-row one
        cache = model.new_cache(n + 4, cache_type)  # room for every step, whatever the order
        runs: dict[str, Callable[[], Any]] = {
            "attention": lambda: exact_attention.warm_up(q8_0=cache.cache_type == "q8_0"),
            "prompt": lambda: model.forward([0] * n, cache),
            "decode": lambda: model.forward([0], cache),
            "pair": lambda: model.forward([0, 0], cache),
            # the batched step beside a second sequence (several slots' steps: exact_batch)
            "batch": lambda: model.decode_batch([0, 0], [cache, model.new_cache(4, cache_type)]),
        }
        for step in steps:
            runs[step]()
