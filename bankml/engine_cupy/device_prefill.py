"""The prompt on a GPU at once: n tokens through every layer with a fixed number of launches,
the K/V cache of a ``device_step.DeviceSequence`` filled for positions pos..pos+n-1, the last
row's logits and greedy token left where ``DeviceStep.step`` takes over. No host read inside.

The layer matrices stay in their GGUF blocks (``DeviceWeights``); each product first turns one
matrix into f16 rows (``dequantize_f16_<type>``, into one scratch buffer the size of the largest
matrix) and multiplies the prompt's f16 rows by it with cuBLAS (``cupy.matmul`` on f16 arrays:
``cublasGemmEx`` with f32 products and sums, CuPy's default compute type, the result rounded to
f16), as ggml's CUDA
backend does for a batch of rows where it has no MMQ kernel. The residual stream stays f32.

    get_rows_*_n                     the n embedding rows into x [n, d]                 1
    per layer:                                                                          19
      add_rms_norm_f16               x += delta (f16), RMSNorm, f16 rows
      dequantize, gemm q, k, v       (6)
      rope_kv_f16_n                  bias, RoPE at pos + r, K and V into the cache
      attn_prefill_f16               causal: row r over positions 0..pos + r, GQA, f16 rows
      dequantize, gemm o             → delta
      add_rms_norm_f16
      dequantize, gemm gate, up      (4)
      swiglu_f16
      dequantize, gemm down          → delta
    add_rms_norm_f16 (last row)      x += delta                                         5
    rms_norm_q8_1, mmvq output       the last row's logits, as the decode step's
    advance_pos, argmax_f32          pos + n, the greedy token into the sequence

``prefill(seq, ids, logits=False)`` (the engine's prompt rows before their last one, which a
decode step then evaluates: device_model.py) leaves the head's four launches out; its
``advance_pos`` moves the position by n.

``hidden(seq, ids)`` (embeddings: llama.cpp's ``t_embd``, every row after the output norm) runs
the layers as ``prefill(logits=False)`` does, then reads the residual stream and the last
delta back once (n x d f32 and f16) and makes the last add and the output norm on the host,
in ``add_rms_norm_f16``'s arithmetic without its f16 rounding (device_prefill_twins
``add_rms_norm_f32``), so the rows are f32 as llama.cpp's are.

Each kernel has a NumPy twin (device_prefill_twins); tests/fake_cupy_prefill.py runs this
module through them.
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any

import numpy

from bankml.engine_cupy.cuda_loader import CudaKernels
from bankml.engine_cupy.cuda_twins import NWARPS, QK, WARP
from bankml.engine_cupy.device_prefill_twins import add_rms_norm_f32

__all__ = ["DeviceMemory", "DevicePrefill", "launches_per_prefill"]
from bankml.engine_cupy.device_step import (
    ARGMAX_THREADS,
    ATTN_THREADS,
    NORM_THREADS,
    Q8_1_BYTES,
    THREADS,
    DeviceMemory,
    DeviceSequence,
    DeviceWeights,
    Matrix,
    check_device_memory,
)

F32 = numpy.float32
I32 = numpy.int32
U16 = numpy.uint16
KERNELS_PER_LAYER = 12  # 2 norms, 7 dequantizations, RoPE, attention, SwiGLU
GEMMS_PER_LAYER = 7
KERNELS_OUTSIDE_LAYERS = 6  # embedding rows; last add, output norm, product; position; argmax
KERNELS_OF_THE_HEAD = 4  # last add, output norm, product, argmax: left out without logits


def launches_per_prefill(n_layer: int, logits: bool = True) -> int:
    """Kernel launches and cuBLAS calls of one prefill, whatever the prompt's length (without
    ``logits``, the cache only: no output head)."""
    outside = KERNELS_OUTSIDE_LAYERS - (0 if logits else KERNELS_OF_THE_HEAD)
    return (KERNELS_PER_LAYER + GEMMS_PER_LAYER) * n_layer + outside


def _blocks(n: int) -> int:
    return -(-n // THREADS)


class DevicePrefill:
    """A prompt's rows through the model at once, launches only (module doc)."""

    def __init__(self, cupy: ModuleType, weights: DeviceWeights, kernels: Any = None) -> None:
        self.cp, self.w, self.hp = cupy, weights, weights.hp
        self.kernels = kernels if kernels is not None else CudaKernels(cupy)
        mats = [
            m
            for layer in weights.layers
            for m in (layer.q, layer.k, layer.v, layer.o, layer.gate, layer.up, layer.down)
        ]
        self.w16 = cupy.empty(max(m.rows * m.cols for m in mats), dtype=U16)
        self.h8 = cupy.empty(self.hp.n_embd // QK * Q8_1_BYTES, dtype=numpy.uint8)
        self.logits = cupy.empty(weights.output.rows, dtype=F32)
        self.none = cupy.empty(1, dtype=F32)
        _, scale = self.hp.spec.attention_scales(self.hp.attn_scale)
        self.scale = F32(scale)

    def scratch_bytes(self, n: int, n_ctx: int) -> int:
        """What a prefill of n rows allocates on the device besides the weights and cache."""
        hp = self.hp
        nq, nkv = hp.n_head * hp.head_dim, hp.n_head_kv * hp.head_dim
        f16_values = n * (3 * hp.n_embd + 3 * nq + 2 * nkv + 3 * hp.n_ff)
        return 4 * n * hp.n_embd + 2 * f16_values + 4 * n * hp.n_head * n_ctx + 4 * n

    def _launch(self, name: str, grid: tuple[int, ...], block: tuple[int, ...], args: Any) -> None:
        self.kernels.function(name)(grid, block, args)

    def _product(self, m: Matrix, a: Any, dst: Any) -> None:
        """dst (f16 rows [n, m.rows]) = a (f16 rows [n, m.cols]) times m: its blocks to f16
        rows in the scratch buffer, then cuBLAS."""
        values = m.rows * m.cols
        name = f"dequantize_f16_{m.qtype.lower()}"
        self._launch(name, (_blocks(values),), (THREADS,), (m.w, self.w16, I32(values)))
        f16 = self.cp.float16
        w16 = self.w16[:values].reshape(m.rows, m.cols).view(f16)
        self.cp.matmul(a.view(f16), w16.T, out=dst.view(f16))

    def _norm(self, x: Any, delta: Any, has_delta: bool, weight: Any, y: Any, rows: int) -> None:
        args = (x, delta, I32(has_delta), weight, y, I32(self.hp.n_embd), F32(self.hp.rms_eps))
        self._launch("add_rms_norm_f16", (rows,), (NORM_THREADS,), args)

    def prefill(self, seq: DeviceSequence, token_ids: list[int], logits: bool = True) -> None:
        """Append ``token_ids`` at ``seq.pos``: every layer for all of them at once, the cache
        filled, the last row's logits into ``seq.logits`` (``self.logits`` then names them, as
        the decode step's last logits), its greedy choice into ``seq.token`` and pos + n. The
        ids go up once (4 bytes each); nothing comes back. Without ``logits`` the cache only
        (no output head; ``seq.logits`` and ``seq.token`` untouched): the engine's prompt
        rows before the last, whose last row a decode step then evaluates (device_model.py)."""
        x, delta, h16 = self._layers(seq, token_ids)
        n = len(token_ids)
        if not logits:
            self._launch("advance_pos", (1,), (WARP,), (seq.pos, I32(n)))
            seq.n_tokens += n
            return
        w, hp, d = self.w, self.hp, self.hp.n_embd
        last = n - 1
        self._norm(x[last:], delta[last:], True, w.output_norm, h16[last:], 1)
        norm_args = (x[last], self.none, I32(0), w.output_norm, self.h8, I32(d), F32(hp.rms_eps))
        self._launch("rms_norm_q8_1", (1,), (NORM_THREADS,), norm_args)
        out = w.output
        self.logits = seq.logits  # each sequence its own, as the decode step's
        name = f"mmvq_{out.qtype.lower()}"
        self._launch(name, (out.rows,), (WARP, NWARPS), (out.w, self.h8, self.logits, I32(d)))
        self._launch("advance_pos", (1,), (WARP,), (seq.pos, I32(n - 1)))
        self._launch(
            "argmax_f32", (1,), (ARGMAX_THREADS,), (self.logits, I32(out.rows), seq.token, seq.pos)
        )
        seq.n_tokens += n

    def hidden(self, seq: DeviceSequence, token_ids: list[int]) -> numpy.ndarray:
        """Append ``token_ids`` at ``seq.pos`` as ``prefill(logits=False)`` does, and return
        every row's hidden state after the output norm, f32 [n, n_embd] on the host (module
        doc): one read back, after the layers."""
        x, delta, _ = self._layers(seq, token_ids)
        n = len(token_ids)
        self._launch("advance_pos", (1,), (WARP,), (seq.pos, I32(n)))
        seq.n_tokens += n
        host_x = numpy.asarray(x.get(), dtype=F32)
        host_delta = numpy.asarray(delta.get()).view(numpy.float16)
        _, rows = add_rms_norm_f32(host_x, host_delta, self._output_norm, self.hp.rms_eps)
        return rows

    @functools.cached_property
    def _output_norm(self) -> numpy.ndarray:
        """The output norm's weight on the host, read once (the embeddings' last norm)."""
        return numpy.asarray(self.w.output_norm.get(), dtype=F32)

    def _layers(self, seq: DeviceSequence, token_ids: list[int]) -> tuple[Any, Any, Any]:
        """Every layer for ``token_ids`` at ``seq.pos``, the cache filled: the residual stream
        x (f32 [n, d]) and the last layer's delta (f16 [n, d]) not yet added, and the f16 rows'
        buffer (h16), on the device."""
        hp, w, cp = self.hp, self.w, self.cp
        n = len(token_ids)
        if n == 0:
            raise ValueError("no tokens to prefill")
        if seq.n_tokens + n > seq.n_ctx:
            raise ValueError(f"{seq.n_tokens} + {n} positions: the sequence holds {seq.n_ctx}")
        if any(not 0 <= t < hp.n_vocab for t in token_ids):
            raise ValueError(f"a token id outside the vocabulary of {hp.n_vocab}")
        check_device_memory(cp, self.scratch_bytes(n, seq.n_ctx))
        d, nh, hd = hp.n_embd, hp.n_head, hp.head_dim
        nq, nkv = nh * hd, hp.n_head_kv * hd
        ids = cp.asarray(numpy.asarray(token_ids, dtype=I32))
        x = cp.empty((n, d), dtype=F32)
        h16, delta = cp.empty((n, d), dtype=U16), cp.empty((n, d), dtype=U16)
        q16, qr16, attn16 = (cp.empty((n, nq), dtype=U16) for _ in range(3))
        k16, v16 = cp.empty((n, nkv), dtype=U16), cp.empty((n, nkv), dtype=U16)
        gate, up, ff = (cp.empty((n, hp.n_ff), dtype=U16) for _ in range(3))
        scores = cp.empty((n, nh, seq.n_ctx), dtype=F32)

        get_rows = "get_rows_q8_0_n" if w.embd_qtype == "Q8_0" else "get_rows_f32_n"
        self._launch(get_rows, (_blocks(d), n), (THREADS,), (w.embd, ids, x, I32(d)))
        rope_threads = (nq + nkv) // 2 + nkv
        for il, layer in enumerate(w.layers):
            self._norm(x, delta, il > 0, layer.attn_norm, h16, n)
            self._product(layer.q, h16, q16)
            self._product(layer.k, h16, k16)
            self._product(layer.v, h16, v16)
            bias = self.none if layer.bias is None else layer.bias
            self._launch(
                "rope_kv_f16_n",
                (_blocks(rope_threads), n),
                (THREADS,),
                (
                    *(q16, k16, v16, bias, I32(layer.bias is not None), seq.pos),
                    *(w.cos, w.sin, qr16, seq.k[il], seq.v[il]),
                    *(I32(nh), I32(hp.n_head_kv), I32(hd), I32(seq.n_ctx), I32(hp.spec.rope_neox)),
                ),
            )
            self._launch(
                "attn_prefill_f16",
                (nh, n),
                (ATTN_THREADS,),
                (
                    *(qr16, seq.k[il], seq.v[il], seq.pos, scores, attn16),
                    *(I32(nh), I32(hp.n_head_kv), I32(hd), I32(seq.n_ctx), self.scale),
                ),
            )
            self._product(layer.o, attn16, delta)
            self._norm(x, delta, True, layer.ffn_norm, h16, n)
            self._product(layer.gate, h16, gate)
            self._product(layer.up, h16, up)
            values = n * hp.n_ff
            self._launch("swiglu_f16", (_blocks(values),), (THREADS,), (gate, up, ff, I32(values)))
            self._product(layer.down, ff, delta)
        return x, delta, h16

    def host_logits(self) -> numpy.ndarray:
        """The last row's logits on the host, for a request that needs them (V floats)."""
        return numpy.asarray(self.logits.get(), dtype=F32)
