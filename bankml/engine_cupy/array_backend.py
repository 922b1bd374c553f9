"""The array backend of the forward pass: vectorised NumPy or CuPy operations (``xp``).

The steps of model.py on whole arrays, the path a GPU takes (and, with ``exact=False``, the
CPU too, so it is tested without one). Where it matters for agreeing with llama-server, the
arithmetic follows ggml's CPU kernels: RMSNorm sums squares in double; RoPE angles are built by
repeated f32 multiplication as ggml_rope_cache_init; GeGLU looks GELU up in ggml's f16 table.
Softmax and the products are plain f32, so the results are close to the exact backend's, not
equal (tests/test_forward.py measures how close).
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType
from typing import Any

import numpy

from bankml.engine_cupy.kv_cache import KVCache
from bankml.engine_cupy.weights import HParams

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


class ArrayOps:
    """norm, rope, glu and attend on ``xp`` arrays, for one model."""

    exact = False

    def __init__(self, xp: ModuleType, hp: HParams, gelu: Any | None):
        self.xp, self.hp = xp, hp
        self.gelu = gelu  # ggml's f16 GELU table on the device (GeGLU models), else None

    def ropes(self, positions: Any, rope_freqs: Any | None) -> dict[bool, tuple[Any, Any]]:
        """cos/sin per layer kind: global (False) and, for gemma3, local sliding-window (True)."""
        hp, xp = self.hp, self.xp
        ropes = {
            False: rope_angles(
                xp, positions, hp.head_dim, hp.rope_base, hp.rope_freq_scale, rope_freqs
            )
        }
        if any(hp.swa_layers):
            ropes[True] = rope_angles(xp, positions, hp.head_dim, hp.rope_base_swa, 1.0, None)
        return ropes

    def norm(self, x: Any, weight: Any) -> Any:
        return rms_norm(self.xp, x, weight, self.hp.rms_eps)

    def rope(self, x: Any, cos: Any, sin: Any, neox: bool) -> Any:
        return apply_rope(x, cos, sin, neox)

    def glu(self, gate: Any, up: Any) -> Any:
        """SwiGLU or GeGLU of the gate and up projections."""
        # contiguous, so NumPy's exp takes its SIMD path whatever the batch size (a strided view
        # takes another path whose last bit can differ, and q8 rounding would magnify it)
        gate = self.xp.ascontiguousarray(gate)
        act = self._gelu_lookup(gate) if self.gelu is not None else silu(self.xp, gate)
        return act * up

    def _gelu_lookup(self, x: Any) -> Any:
        """ggml_vec_geglu_f32: 0 below -10, x above 10, else the f16 table at f16(x)."""
        xp, table = self.xp, self.gelu
        assert table is not None  # only GeGLU models look it up
        idx = x.astype(xp.float16).view(xp.uint16)
        y = table[idx.astype(xp.int32)]
        y = xp.where(x <= F32(-10), F32(0), y)
        return xp.where(x >= F32(10), x, y)

    def attend(self, il: int, q: Any, step: Any, cache: KVCache, scale: Any) -> Any:
        """softmax(q·Kᵀ·scale + mask)·V over the cache's first ``step.end`` positions, GQA:
        q [n, n_head, hd] → [n, n_head*hd]. Q and the output take the cache's rounding."""
        xp, hp = self.xp, self.hp
        n, end = q.shape[0], step.end
        keys, values = cache.keys(il, end), cache.values(il, end)  # [kv, T, hd]
        group = hp.n_head // hp.n_head_kv
        # heads h = kv * group + j share KV head kv (ggml broadcasts head h to h // group)
        qg = cache.query(q).reshape(n, hp.n_head_kv, group, hp.head_dim).transpose(1, 2, 0, 3)
        qg = qg.reshape(hp.n_head_kv, group * n, hp.head_dim)
        scores = (qg @ keys.transpose(0, 2, 1)) * scale  # [kv, group*n, T]
        scores = scores.reshape(hp.n_head_kv, group, n, end)
        mask = step.mask(xp, hp.swa_window if hp.swa_layers[il] else 0)
        if mask is not None:
            scores = scores + mask
        scores = scores.reshape(hp.n_head_kv, group * n, end)
        out = softmax_product(xp, scores, values)  # [kv, group*n, hd]
        out = cache.output(out).reshape(hp.n_head_kv, group, n, hp.head_dim)
        return out.transpose(2, 0, 1, 3).reshape(n, hp.n_head * hp.head_dim)

    plan = None  # no fused one-token step here: the definition's stack runs

    def decode(self, x: Any, step: Any, cache: KVCache) -> Any | None:
        return None

    def warm_up(self, model: Any, cache_type: str | None, steps: Sequence[str] = ()) -> None:
        """Nothing to compile ahead."""
