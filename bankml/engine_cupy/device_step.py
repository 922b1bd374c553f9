"""The decode step on a GPU: the weights in their GGUF blocks on the device, a handful of
kernel launches per layer, and no read back to the host inside the step.

``DeviceWeights.upload(cupy, reader, hp)`` checks that the model is one the step plays
(``unsupported``: llama and qwen2, every layer matrix of a type with a one-row product kernel)
and that it fits the device's free memory (``cupy.cuda.runtime.memGetInfo``; refused with the
figures otherwise), then copies each matrix's bytes to the device as they are in the file
(uint8 [rows, row bytes]), the norms as f32, and the RoPE table (cos, sin [n_ctx_train, hd/2],
ggml's angles computed once on the host; grown for a longer context).

``DeviceStep(cupy, weights)`` runs one decode step of one sequence (``DeviceSequence``: its f16
K/V cache [layers, n_head_kv, n_ctx, hd], its position and its next token, both int32 on the
device, its logits) with the kernels of ``cuda/`` (``cuda_loader.CudaKernels``):

    get_rows                         the token's embedding row into x            1
    per layer:                                                                   12
      rms_norm_q8_1                  x += delta (the last product), RMSNorm, q8_1
      mmvq q, k, v                   the three products
      rope_kv_f16                    bias, RoPE of Q and K, K and V into the cache at pos
      attn_decode_f16                softmax(q Kᵀ scale) V over 0..pos, GQA, q8_1 out
      mmvq o                         → delta
      rms_norm_q8_1                  x += delta, RMSNorm, q8_1
      mmvq gate, up
      swiglu_q8_1                    silu(gate) · up, q8_1
      mmvq down                      → delta
    rms_norm_q8_1, mmvq output       x += delta, output norm; the logits
    argmax_f32                       the greedy token into the sequence's token; pos += 1  3

``LAUNCHES_PER_LAYER`` and ``launches_per_step(n_layer)`` say it. ``step_rows(seqs)`` is one
step of up to ``MAX_ROWS`` sequences of one ``SequencePool`` (``new_sequences``: the engine's
slots) with the same launches, each kernel's ``_rows`` form taking every row (the products one
launch for all of them, ggml's several-column mul_mat_vec_q), each row the bits of its own
``step``. The chosen token stays on the
device for the next step; ``chosen(seq)`` is the step's one read back (4 bytes), and the logits
stay on the device (the sequence's ``logits``) unless a request needs them: ``top_k(seq, k)``
hands back only the k largest (id, logit) pairs (``top_k_f32``), ``host_logits(seq)`` the row.
With graphs on (the default where CuPy has stream capture), ``step`` and ``step_rows`` replay
a CUDA graph of the batched step's launches, one per row count per pool, captured the second
time that row count is seen; the kernels read the slots' indices (a buffer of the graph's,
written before a replay where they changed), positions, tokens and cache cells from the
device, so a replay is the uncaptured step (docs/modules/device_step.md).
``truncate``, ``shift`` and ``copy_sequence`` are the slot operations the engine needs (a
reused prefix, llama-server's context shift, a shared prompt's child). Each kernel has a NumPy
twin (cuda_twins, device_twins); tests/fake_cupy_kernels.py runs this module through them;
device_model.py serves it through the engine.
"""

from __future__ import annotations

import logging
import os
import weakref
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import numpy

from bankml.engine_cupy.array_backend import apply_rope, rope_angles
from bankml.engine_cupy.cuda_loader import CudaKernels, on_hip
from bankml.engine_cupy.cuda_twins import BLOCK_TYPES, NWARPS, QK, WARP
from bankml.engine_cupy.weights import HParams, UnsupportedModel, dequantize

F32 = numpy.float32
I32 = numpy.int32
Q8_1_BYTES = 36
THREADS = 256  # per thread block of the one-thread-per-value kernels
NORM_THREADS = 256  # cuda/rms_norm_q8_1.cu
ATTN_THREADS = 128  # cuda/attn_decode_f16.cu: ATTN_WARPS * 32
ARGMAX_THREADS = 1024  # cuda/argmax_f32.cu
TOPK_THREADS = 1024  # cuda/top_k_f32.cu
TOP_K_MAX = 128  # the largest k ``top_k`` hands back (sampler_kernels.MAX_K, the host's bound)
ATTN_MAX_HD = 256
LAUNCHES_PER_LAYER = 12
LAUNCHES_OUTSIDE_LAYERS = 4  # embedding row, output norm, output product, argmax
MAX_ROWS = 8  # the most slots one batched step (step_rows) takes: ggml's mmvq ncols_dst bound
SLOT_LISTS_KEPT = 256  # sets of slots whose device index list a pool keeps
ARCHS = ("llama", "qwen2")
MEMORY_SHARE = 0.9  # of the device's free memory the weights and one cache may take
log = logging.getLogger(__name__)
_MATRICES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def launches_per_step(n_layer: int) -> int:
    return LAUNCHES_PER_LAYER * n_layer + LAUNCHES_OUTSIDE_LAYERS


def graph_unsupported(cupy: ModuleType) -> str | None:
    """Why the decode step is not captured into CUDA graphs on ``cupy`` (None: it is)."""
    if os.environ.get("BANKML_CUDA_GRAPHS", "1") == "0":
        return "asked for (BANKML_CUDA_GRAPHS=0)"
    cuda = getattr(cupy, "cuda", None)
    if on_hip(cupy):
        return "CuPy's HIP build (graph capture is not tried on ROCm)"
    stream = getattr(cuda, "Stream", None)
    if stream is None or not hasattr(stream, "begin_capture"):
        return "this CuPy has no stream capture (cupy.cuda.Stream.begin_capture)"
    return None


@dataclass
class StepGraph:
    """A pool's captured step of one row count: the slots' indices it reads (int32 [rows] on
    the device), the indices last written there, the graph (None until captured), and why
    its capture failed (None: it did not)."""

    slots: Any
    indices: tuple[int, ...] = field(default=())
    graph: Any = None
    failed: str | None = None


class DeviceMemory(UnsupportedModel):
    """The model does not fit the device's free memory; the message gives the figures."""


@dataclass
class Matrix:
    """A weight matrix in its GGUF blocks on the device: uint8 [rows, row bytes]."""

    qtype: str
    w: Any
    rows: int
    cols: int


@dataclass
class DeviceLayer:
    attn_norm: Any
    ffn_norm: Any
    q: Matrix
    k: Matrix
    v: Matrix
    o: Matrix
    gate: Matrix
    up: Matrix
    down: Matrix
    bias: Any | None  # q, k and v biases concatenated (qwen2), f32


def _infos(reader: Any) -> dict[str, Any]:
    return {t.name: t for t in reader.tensors}


def unsupported(reader: Any, hp: HParams) -> str | None:
    """Why the decode step cannot play this model (None: it can)."""
    spec = hp.spec
    if hp.arch not in ARCHS:
        return f"architecture {hp.arch} (the device step plays {', '.join(ARCHS)})"
    if spec.qk_norm or spec.post_norms or spec.ffn_activation != "silu":
        return f"{hp.arch}'s Q/K norms, post-norms or GeGLU"
    if hp.final_softcap or hp.embd_scale != 1.0 or any(hp.swa_layers):
        return "soft-capping, an embedding scale or sliding-window layers"
    if spec.attention_scales(hp.attn_scale)[0] != 1:
        return "a Q scale"
    if hp.head_dim % QK or hp.head_dim > ATTN_MAX_HD or hp.n_embd % QK or hp.n_ff % QK:
        return f"widths not multiples of {QK} (or heads wider than {ATTN_MAX_HD})"
    infos = _infos(reader)
    if "output.bias" in infos:
        return "an output bias"
    out = "token_embd.weight" if hp.tied_output else "output.weight"
    names = [out] + [f"blk.{il}.{m}.weight" for il in range(hp.n_layer) for m in _MATRICES]
    for name in names:
        info = infos.get(name)
        if info is None:
            return f"no tensor {name} (a fused QKV?)"
        if info.tensor_type.name not in BLOCK_TYPES:
            return f"{name} is {info.tensor_type.name}: no one-row product kernel for it"
    return None


def upload_bytes(reader: Any, hp: HParams) -> int:
    """What the step's weights take on the device: the GGUF bytes, plus an f32 embedding table
    where the embedding has no row kernel (only Q8_0 has one), plus the RoPE table."""
    total = sum(int(t.n_bytes) for t in reader.tensors if t.name != "token_embd.weight")
    embd = _infos(reader)["token_embd.weight"]
    if embd.tensor_type.name == "Q8_0" or hp.tied_output:
        total += int(embd.n_bytes)
    if embd.tensor_type.name != "Q8_0":
        total += int(embd.n_elements) * 4
    return total + 2 * hp.n_ctx_train * hp.head_dim // 2 * 4


def cache_bytes(hp: HParams, n_ctx: int) -> int:
    """One sequence's f16 K and V, its attention scores, its logits and top-k pairs."""
    kv = 2 * 2 * hp.n_layer * hp.n_head_kv * n_ctx * hp.head_dim
    return kv + 4 * hp.n_head * n_ctx + 4 * hp.n_vocab + 4 * (2 * TOP_K_MAX + 1)


def check_device_memory(cupy: ModuleType, need: int) -> None:
    """Refuse, with the figures, what would not fit the device's free memory."""
    free, total = (int(v) for v in cupy.cuda.runtime.memGetInfo())
    if need > MEMORY_SHARE * free:
        raise DeviceMemory(
            f"the model needs {need / 2**20:.1f} MiB on the device, more than {MEMORY_SHARE:.0%}"
            f" of its {free / 2**20:.1f} MiB free ({total / 2**20:.1f} MiB in all)"
        )


@dataclass
class DeviceWeights:
    hp: HParams
    embd_qtype: str  # "Q8_0" (rows from its blocks) or "F32" (a dequantized table)
    embd: Any
    output_norm: Any
    output: Matrix
    layers: list[DeviceLayer]
    cos: Any  # [n_ctx_train (or the longest sequence's context), hd/2] f32
    sin: Any
    nbytes: int
    rope_freqs: numpy.ndarray | None = None  # Llama 3's frequency factors, on the host

    def rope_rows(self, cupy: ModuleType, n: int) -> None:
        """The RoPE table grown to ``n`` positions where a sequence's context is longer than the
        training context (llama.cpp allows it): row p is the same whatever the table's size."""
        if n <= int(self.cos.shape[0]):
            return
        hp = self.hp
        cos, sin = rope_angles(
            numpy, numpy.arange(n), hp.head_dim, hp.rope_base, hp.rope_freq_scale, self.rope_freqs
        )
        check_device_memory(cupy, 2 * n * hp.head_dim // 2 * 4)
        self.cos = cupy.asarray(numpy.ascontiguousarray(cos, dtype=F32))
        self.sin = cupy.asarray(numpy.ascontiguousarray(sin, dtype=F32))

    @classmethod
    def upload(cls, cupy: ModuleType, reader: Any, hp: HParams) -> DeviceWeights:
        why = unsupported(reader, hp)
        if why is not None:
            raise UnsupportedModel(f"the device step does not play {why}")
        check_device_memory(cupy, upload_bytes(reader, hp))
        infos = _infos(reader)
        nbytes = 0

        def up(host: numpy.ndarray) -> Any:
            nonlocal nbytes
            nbytes += host.nbytes
            return cupy.asarray(numpy.ascontiguousarray(host))

        def matrix(name: str) -> Matrix:
            info = infos[name]
            qtype = info.tensor_type.name
            data = numpy.asarray(info.data)  # [rows, row bytes], as the file holds it
            w = data.reshape(data.shape[0], -1).view(numpy.uint8)
            cols = w.shape[1] // BLOCK_TYPES[qtype].block_bytes * BLOCK_TYPES[qtype].values
            return Matrix(qtype, up(w), w.shape[0], cols)

        def vector(name: str) -> Any:
            return up(numpy.asarray(infos[name].data, F32).reshape(-1))

        def bias(p: str) -> Any | None:
            names = [f"{p}attn_{x}.bias" for x in ("q", "k", "v")]
            if not any(n in infos for n in names):
                return None
            widths = (hp.n_head, hp.n_head_kv, hp.n_head_kv)
            parts = [
                numpy.asarray(infos[n].data, F32).reshape(-1)
                if n in infos
                else numpy.zeros(w * hp.head_dim, F32)
                for n, w in zip(names, widths)
            ]
            return up(numpy.concatenate(parts))

        layers = []
        for il in range(hp.n_layer):
            p = f"blk.{il}."
            m = {name: matrix(f"{p}{name}.weight") for name in _MATRICES}
            layers.append(
                DeviceLayer(
                    vector(p + "attn_norm.weight"),
                    vector(p + "ffn_norm.weight"),
                    m["attn_q"],
                    m["attn_k"],
                    m["attn_v"],
                    m["attn_output"],
                    m["ffn_gate"],
                    m["ffn_up"],
                    m["ffn_down"],
                    bias(p),
                )
            )
        embd_info = infos["token_embd.weight"]
        embd_qtype = "Q8_0" if embd_info.tensor_type.name == "Q8_0" else "F32"
        output = matrix("token_embd.weight" if hp.tied_output else "output.weight")
        if embd_qtype == "Q8_0":
            embd = output.w if hp.tied_output else matrix("token_embd.weight").w
        else:
            table = dequantize(numpy.asarray(embd_info.data), embd_info.tensor_type)
            embd = up(numpy.asarray(table, F32).reshape(hp.n_vocab, hp.n_embd))
        freqs = infos.get("rope_freqs.weight")
        cos, sin = rope_angles(
            numpy,
            numpy.arange(hp.n_ctx_train),
            hp.head_dim,
            hp.rope_base,
            hp.rope_freq_scale,
            None if freqs is None else numpy.asarray(freqs.data, F32).reshape(-1),
        )
        return cls(
            hp,
            embd_qtype,
            embd,
            vector("output_norm.weight"),
            output,
            layers,
            up(numpy.asarray(cos, F32)),
            up(numpy.asarray(sin, F32)),
            nbytes,
            None if freqs is None else numpy.asarray(freqs.data, F32).reshape(-1),
        )


class SequencePool:
    """Several sequences' device state in one allocation each, so that one launch can reach
    every slot of a batched step (``DeviceStep.step_rows``): K/V (f16 bits, uint16
    [n, layers, n_head_kv, n_ctx, hd]), the attention scores' scratch [n, n_head, n_ctx], the
    positions and next tokens (int32 [n]), the logits [n, n_out] and the top-k buffers."""

    def __init__(self, cupy: ModuleType, hp: HParams, n: int, n_ctx: int, n_out: int) -> None:
        shape = (n, hp.n_layer, hp.n_head_kv, n_ctx, hp.head_dim)
        self.n, self.n_ctx = n, n_ctx
        self.k = cupy.zeros(shape, dtype=numpy.uint16)
        self.v = cupy.zeros(shape, dtype=numpy.uint16)
        self.scores = cupy.empty((n, hp.n_head, n_ctx), dtype=F32)
        self.pos = cupy.zeros(n, dtype=I32)
        self.token = cupy.zeros(n, dtype=I32)
        self.logits = cupy.empty((n, n_out), dtype=F32)
        self.pairs = cupy.empty((n, 2 * TOP_K_MAX + 1), dtype=I32)
        self.slot_lists: dict[tuple[int, ...], Any] = {}  # step_rows' slot indices, uploaded


class DeviceSequence:
    """One sequence's state on the device, slot ``index`` of a ``SequencePool``: K/V cache
    (f16 bits, uint16 [layers, n_head_kv, n_ctx, hd]), the attention scores' scratch, its
    position and its next token (int32 [1] each), its last step's logits (f32 [n_out]) and the
    top-k pairs' buffer (int32 [2 TOP_K_MAX + 1]), each a view of the pool's. ``n_tokens`` is
    the host's own count of the positions filled. Each sequence has its own logits, so several
    slots' steps can run before any samples."""

    def __init__(self, pool: SequencePool, index: int) -> None:
        self.pool, self.index = pool, index
        self.n_ctx = pool.n_ctx
        self.k = pool.k[index]
        self.v = pool.v[index]
        self.scores = pool.scores[index]
        self.pos = pool.pos[index : index + 1]
        self.token = pool.token[index : index + 1]
        self.logits = pool.logits[index]
        self.pairs = pool.pairs[index]
        self.n_tokens = 0


class DeviceStep:
    """One decode step of a ``DeviceSequence``, launches only (module doc)."""

    def __init__(
        self, cupy: ModuleType, weights: DeviceWeights, kernels: Any = None, graphs: bool = True
    ) -> None:
        self.cp, self.w, self.hp = cupy, weights, weights.hp
        self.kernels = kernels if kernels is not None else CudaKernels(cupy)
        hp = self.hp
        nq, nkv = hp.n_head * hp.head_dim, hp.n_head_kv * hp.head_dim

        def f32(n: int) -> Any:
            return cupy.empty(n, dtype=F32)

        def q8(n: int) -> Any:
            return cupy.empty(n // QK * Q8_1_BYTES, dtype=numpy.uint8)

        self.x, self.delta_attn, self.delta_ffn = f32(hp.n_embd), f32(hp.n_embd), f32(hp.n_embd)
        self.h8 = q8(hp.n_embd)
        self.q, self.k, self.v, self.q_rot = f32(nq), f32(nkv), f32(nkv), f32(nq)
        self.attn8 = q8(nq)
        self.gate, self.up = f32(hp.n_ff), f32(hp.n_ff)
        self.ff8 = q8(hp.n_ff)
        self.logits = f32(self.w.output.rows)  # the last stepped sequence's (host_logits())
        self.none = f32(1)  # the pointer a kernel gets where it has nothing to read
        self._rows: dict[str, Any] | None = None  # step_rows' buffers
        _, scale = hp.spec.attention_scales(hp.attn_scale)
        self.scale = F32(scale)
        # CUDA graphs of the step (module doc): why they are off (None: on), the graphs of each
        # pool by row count, the stream they are captured on, and what they did
        self.graph_reason = graph_unsupported(cupy) if graphs else "asked for (graphs=False)"
        if self.graph_reason is not None:
            log.info("decode step uncaptured: %s", self.graph_reason)
        self._graphs: weakref.WeakKeyDictionary[SequencePool, dict[int, StepGraph]] = (
            weakref.WeakKeyDictionary()
        )
        self._capture_stream: Any = None
        self.graph_stats = {"captured": 0, "replayed": 0, "uncaptured": 0}

    @property
    def _graphs_on(self) -> bool:
        return self.graph_reason is None

    def new_sequence(self, n_ctx: int) -> DeviceSequence:
        return self.new_sequences(1, n_ctx)[0]

    def new_sequences(self, n: int, n_ctx: int) -> list[DeviceSequence]:
        """``n`` sequences of ``n_ctx`` positions in one ``SequencePool``: the slots that
        ``step_rows`` can step together."""
        check_device_memory(self.cp, n * cache_bytes(self.hp, n_ctx))
        table = self.w.cos
        self.w.rope_rows(self.cp, n_ctx)
        if self.w.cos is not table:  # a graph holds the old table's address: capture anew
            self._graphs.clear()
        pool = SequencePool(self.cp, self.hp, n, n_ctx, self.w.output.rows)
        return [DeviceSequence(pool, i) for i in range(n)]

    def _launch(self, name: str, grid: tuple[int, ...], block: tuple[int, ...], args: Any) -> None:
        self.kernels.function(name)(grid, block, args)

    def _mmvq(self, m: Matrix, y: Any, dst: Any) -> None:
        name = f"mmvq_{m.qtype.lower()}"
        self._launch(name, (m.rows,), (WARP, NWARPS), (m.w, y, dst, I32(m.cols)))

    def _norm(self, weight: Any, delta: Any | None) -> None:
        hp = self.hp
        args = (
            self.x,
            self.none if delta is None else delta,
            I32(delta is not None),
            weight,
            self.h8,
            I32(hp.n_embd),
            F32(hp.rms_eps),
        )
        self._launch("rms_norm_q8_1", (1,), (NORM_THREADS,), args)

    def set_token(self, seq: DeviceSequence, token: int) -> None:
        """The next step's token chosen on the host (a prompt's, or a sampler's): 4 bytes up."""
        seq.token.set(numpy.asarray([token], dtype=I32))

    def step(self, seq: DeviceSequence) -> None:
        """Append ``seq.token`` at ``seq.pos``: every layer, the logits into ``seq.logits``,
        the greedy choice into ``seq.token`` and pos + 1. Launches only: nothing comes back."""
        if seq.n_tokens >= seq.n_ctx:
            raise ValueError(f"the sequence holds {seq.n_ctx} positions")
        if not (self._graphs_on and self._graph_step(seq.pool, [seq])):
            self._step_launches(seq)
        seq.n_tokens += 1
        self.logits = seq.logits

    def _step_launches(self, seq: DeviceSequence) -> None:
        """The one-row step's launches, uncaptured (``step``)."""
        hp, w = self.hp, self.w
        d = hp.n_embd
        grid_d = (-(-d // THREADS),)
        get_rows = "get_rows_q8_0" if w.embd_qtype == "Q8_0" else "get_rows_f32"
        self._launch(get_rows, grid_d, (THREADS,), (w.embd, seq.token, self.x, I32(d)))
        nq, nkv = hp.n_head * hp.head_dim, hp.n_head_kv * hp.head_dim
        rope_threads = (nq + nkv) // 2 + nkv
        delta = None
        for il, layer in enumerate(w.layers):
            self._norm(layer.attn_norm, delta)
            self._mmvq(layer.q, self.h8, self.q)
            self._mmvq(layer.k, self.h8, self.k)
            self._mmvq(layer.v, self.h8, self.v)
            self._launch(
                "rope_kv_f16",
                (-(-rope_threads // THREADS),),
                (THREADS,),
                (
                    self.q,
                    self.k,
                    self.v,
                    self.none if layer.bias is None else layer.bias,
                    I32(layer.bias is not None),
                    seq.pos,
                    w.cos,
                    w.sin,
                    self.q_rot,
                    seq.k[il],
                    seq.v[il],
                    I32(hp.n_head),
                    I32(hp.n_head_kv),
                    I32(hp.head_dim),
                    I32(seq.n_ctx),
                    I32(hp.spec.rope_neox),
                ),
            )
            self._launch(
                "attn_decode_f16",
                (hp.n_head,),
                (ATTN_THREADS,),
                (
                    self.q_rot,
                    seq.k[il],
                    seq.v[il],
                    seq.pos,
                    seq.scores,
                    self.attn8,
                    I32(hp.n_head),
                    I32(hp.n_head_kv),
                    I32(hp.head_dim),
                    I32(seq.n_ctx),
                    self.scale,
                ),
            )
            self._mmvq(layer.o, self.attn8, self.delta_attn)
            self._norm(layer.ffn_norm, self.delta_attn)
            self._mmvq(layer.gate, self.h8, self.gate)
            self._mmvq(layer.up, self.h8, self.up)
            self._launch(
                "swiglu_q8_1",
                (-(-hp.n_ff // THREADS),),
                (THREADS,),
                (self.gate, self.up, self.ff8, I32(hp.n_ff)),
            )
            self._mmvq(layer.down, self.ff8, self.delta_ffn)
            delta = self.delta_ffn
        self._norm(w.output_norm, delta)
        self._mmvq(w.output, self.h8, seq.logits)
        self._launch(
            "argmax_f32",
            (1,),
            (ARGMAX_THREADS,),
            (seq.logits, I32(w.output.rows), seq.token, seq.pos),
        )

    def _graph_step(self, pool: SequencePool, seqs: list[DeviceSequence]) -> bool:
        """One step of ``seqs`` as a replay of the pool's graph of ``len(seqs)`` rows: the slots'
        indices go up (4 bytes a row) where they differ from the last step's, then one graph
        launch. A row count not seen yet runs the batched step's launches uncaptured (its
        kernels loaded, its buffers made: nothing of that may happen inside a capture) and is
        captured the next time. False: the caller runs the step uncaptured (the capture failed;
        the reason logged once)."""
        n = len(seqs)
        graphs = self._graphs.setdefault(pool, {})
        entry = graphs.get(n)
        indices = tuple(s.index for s in seqs)
        if entry is None:  # first sight: uncaptured, its kernels loaded and buffers made
            entry = graphs[n] = StepGraph(self.cp.asarray(numpy.asarray(indices, dtype=I32)))
            entry.indices = indices
            self._rows_launches(pool, entry.slots, n)
            self.graph_stats["uncaptured"] += 1
            log.debug("decode step of %d row(s) uncaptured: a shape not seen yet", n)
            return True
        if entry.failed is not None:
            self.graph_stats["uncaptured"] += 1
            return False
        if entry.graph is None:
            try:
                entry.graph = self._capture(pool, entry, n)
            except Exception as e:  # noqa: BLE001 (any refusal of the capture: run uncaptured)
                entry.failed = f"{type(e).__name__}: {e}"
                log.warning("decode step of %d row(s) uncaptured: %s", n, entry.failed)
                self.graph_stats["uncaptured"] += 1
                return False
            self.graph_stats["captured"] += 1
        if indices != entry.indices:
            entry.slots.set(numpy.asarray(indices, dtype=I32))
            entry.indices = indices
        entry.graph.launch(self.cp.cuda.get_current_stream())
        self.graph_stats["replayed"] += 1
        return True

    def _capture(self, pool: SequencePool, entry: StepGraph, n: int) -> Any:
        """The batched step's launches for ``n`` rows of ``pool`` recorded into a CUDA graph
        on a stream of its own (nothing runs): every value that changes from token to token
        is read by the kernels from the device (the slots' indices from ``entry.slots``, their
        positions, tokens and cache cells from the pool), so a replay is the step."""
        if self._capture_stream is None:
            self._capture_stream = self.cp.cuda.Stream(non_blocking=True)
        stream = self._capture_stream
        # thread-local: only this thread's own unsafe calls (an allocation, a copy) during
        # the capture invalidate it, not another thread's
        mode = getattr(self.cp.cuda.runtime, "streamCaptureModeThreadLocal", None)
        with stream:
            stream.begin_capture(mode)
            try:
                self._capture_launches(pool, entry, n)
            finally:
                graph = stream.end_capture()
        return graph

    def _capture_launches(self, pool: SequencePool, entry: StepGraph, n: int) -> None:
        self._rows_launches(pool, entry.slots, n)

    def _row_buffers(self) -> dict[str, Any]:
        """The batched step's activations, ``MAX_ROWS`` rows each (allocated on first use)."""
        if self._rows is None:
            hp, cp, n = self.hp, self.cp, MAX_ROWS
            nq, nkv = hp.n_head * hp.head_dim, hp.n_head_kv * hp.head_dim

            def f32(m: int) -> Any:
                return cp.empty(n * m, dtype=F32)

            def q8(m: int) -> Any:
                return cp.empty(n * (m // QK) * Q8_1_BYTES, dtype=numpy.uint8)

            self._rows = {
                "x": f32(hp.n_embd),
                "delta_attn": f32(hp.n_embd),
                "delta_ffn": f32(hp.n_embd),
                "h8": q8(hp.n_embd),
                "q": f32(nq),
                "k": f32(nkv),
                "v": f32(nkv),
                "q_rot": f32(nq),
                "attn8": q8(nq),
                "gate": f32(hp.n_ff),
                "up": f32(hp.n_ff),
                "ff8": q8(hp.n_ff),
                "logits": f32(self.w.output.rows),
            }
        return self._rows

    def _slot_list(self, pool: SequencePool, indices: tuple[int, ...]) -> Any:
        """The slots' indices on the device (int32 [rows]): uploaded once per set of slots."""
        slots = pool.slot_lists.get(indices)
        if slots is None:
            if len(pool.slot_lists) >= SLOT_LISTS_KEPT:
                pool.slot_lists.clear()
            slots = pool.slot_lists[indices] = self.cp.asarray(numpy.asarray(indices, dtype=I32))
        return slots

    def step_rows(self, seqs: list[DeviceSequence]) -> None:
        """One decode step of each of ``seqs`` (1..MAX_ROWS sequences of one ``SequencePool``,
        each at its own position) with the launches of one ``step``: every kernel takes all the
        rows (the products each weight block against every row's activation, ggml's
        ncols_dst), and each row's logits, token and position come out with the bits its own
        ``step`` gives. Launches only: nothing comes back."""
        n = len(seqs)
        if not 1 <= n <= MAX_ROWS:
            raise ValueError(f"a batched step takes 1..{MAX_ROWS} sequences, not {n}")
        pool = seqs[0].pool
        if any(s.pool is not pool for s in seqs) or len({s.index for s in seqs}) != n:
            raise ValueError("a batched step takes distinct sequences of one pool")
        for seq in seqs:
            if seq.n_tokens >= seq.n_ctx:
                raise ValueError(f"the sequence holds {seq.n_ctx} positions")
        if not (self._graphs_on and self._graph_step(pool, seqs)):
            self._rows_launches(pool, self._slot_list(pool, tuple(s.index for s in seqs)), n)
        for seq in seqs:
            seq.n_tokens += 1
        self.logits = seqs[-1].logits

    def _rows_launches(self, pool: SequencePool, slots: Any, n: int) -> None:
        """The batched step's launches for ``n`` rows, the slots' indices read from ``slots``
        (int32 [n] on the device) by the kernels: what a graph of ``n`` rows captures."""
        hp, w, b = self.hp, self.w, self._row_buffers()
        rows = I32(n)
        d = hp.n_embd
        get_rows = "get_rows_q8_0_rows" if w.embd_qtype == "Q8_0" else "get_rows_f32_rows"
        grid_d = (-(-d // THREADS), n)
        self._launch(get_rows, grid_d, (THREADS,), (w.embd, pool.token, slots, b["x"], I32(d)))
        nq, nkv = hp.n_head * hp.head_dim, hp.n_head_kv * hp.head_dim
        rope_threads = (nq + nkv) // 2 + nkv

        def mmvq(m: Matrix, y: Any, dst: Any) -> None:
            name = f"mmvq_{m.qtype.lower()}_rows"
            self._launch(name, (m.rows,), (WARP, NWARPS), (m.w, y, dst, I32(m.cols), rows))

        def norm(weight: Any, delta: Any | None) -> None:
            args = (
                b["x"],
                self.none if delta is None else delta,
                I32(delta is not None),
                weight,
                b["h8"],
                I32(d),
                F32(hp.rms_eps),
            )
            self._launch("rms_norm_q8_1_rows", (n,), (NORM_THREADS,), args)

        delta = None
        for il, layer in enumerate(w.layers):
            norm(layer.attn_norm, delta)
            mmvq(layer.q, b["h8"], b["q"])
            mmvq(layer.k, b["h8"], b["k"])
            mmvq(layer.v, b["h8"], b["v"])
            self._launch(
                "rope_kv_f16_rows",
                (-(-rope_threads // THREADS), n),
                (THREADS,),
                (
                    b["q"],
                    b["k"],
                    b["v"],
                    self.none if layer.bias is None else layer.bias,
                    I32(layer.bias is not None),
                    slots,
                    pool.pos,
                    w.cos,
                    w.sin,
                    b["q_rot"],
                    pool.k,
                    pool.v,
                    I32(il),
                    I32(hp.n_layer),
                    I32(hp.n_head),
                    I32(hp.n_head_kv),
                    I32(hp.head_dim),
                    I32(pool.n_ctx),
                    I32(hp.spec.rope_neox),
                ),
            )
            self._launch(
                "attn_decode_f16_rows",
                (hp.n_head, n),
                (ATTN_THREADS,),
                (
                    b["q_rot"],
                    pool.k,
                    pool.v,
                    slots,
                    pool.pos,
                    pool.scores,
                    b["attn8"],
                    I32(il),
                    I32(hp.n_layer),
                    I32(hp.n_head),
                    I32(hp.n_head_kv),
                    I32(hp.head_dim),
                    I32(pool.n_ctx),
                    self.scale,
                ),
            )
            mmvq(layer.o, b["attn8"], b["delta_attn"])
            norm(layer.ffn_norm, b["delta_attn"])
            mmvq(layer.gate, b["h8"], b["gate"])
            mmvq(layer.up, b["h8"], b["up"])
            self._launch(
                "swiglu_q8_1_rows",
                (-(-hp.n_ff // THREADS), n),
                (THREADS,),
                (b["gate"], b["up"], b["ff8"], I32(hp.n_ff)),
            )
            mmvq(layer.down, b["ff8"], b["delta_ffn"])
            delta = b["delta_ffn"]
        norm(w.output_norm, delta)
        mmvq(w.output, b["h8"], b["logits"])
        self._launch(
            "argmax_f32_rows",
            (n,),
            (ARGMAX_THREADS,),
            (b["logits"], I32(w.output.rows), slots, pool.logits, pool.token, pool.pos),
        )

    def chosen(self, seq: DeviceSequence) -> int:
        """The greedy token of the last step: the step's one read back (4 bytes)."""
        return int(seq.token.get()[0])

    def host_logits(self, seq: DeviceSequence | None = None) -> numpy.ndarray:
        """The logits of ``seq``'s last step (default: the last step's) on the host, for a
        request that needs them: V floats, one read."""
        logits = self.logits if seq is None else seq.logits
        return numpy.asarray(logits.get(), dtype=F32)

    def top_k(
        self,
        seq: DeviceSequence,
        k: int,
        bias: tuple[numpy.ndarray, numpy.ndarray] | None = None,
    ) -> tuple[numpy.ndarray, numpy.ndarray] | None:
        """The k largest of ``seq``'s last logits, largest first, equal ones in id order (the
        host sampler's stable top-k): (ids int32 [k], logits f32 [k]), one launch and one read
        of 2k + 1 ints. None where a logit is NaN (the host's own top-k takes the whole row
        then). 0 < k <= min(TOP_K_MAX, V). ``bias``: (distinct ids, f32 values) added first,
        one f32 addition each, to a device copy of the row (the sequence's logits stay as the
        step left them)."""
        n = self.w.output.rows
        if not 0 < k <= min(TOP_K_MAX, n):
            raise ValueError(f"top-k of {k} on the device (1..{min(TOP_K_MAX, n)})")
        logits = seq.logits
        if bias is not None:
            logits = seq.logits.copy()
            ids = self.cp.asarray(numpy.asarray(bias[0], dtype=numpy.int64))
            logits[ids] = logits[ids] + self.cp.asarray(numpy.asarray(bias[1], dtype=F32))
        self._launch("top_k_f32", (1,), (TOPK_THREADS,), (logits, I32(n), I32(k), seq.pairs))
        raw = numpy.asarray(seq.pairs[: 2 * k + 1].get(), dtype=I32)
        if raw[2 * k]:
            return None
        return raw[:k], raw[k : 2 * k].view(F32)

    def truncate(self, seq: DeviceSequence, n: int) -> None:
        """Keep ``seq``'s first ``n`` positions: the next step writes position n (4 bytes up;
        the cells after it are not read again before they are written)."""
        if not 0 <= n <= seq.n_tokens:
            raise ValueError(f"cannot keep {n} of {seq.n_tokens} positions")
        if n != seq.n_tokens:
            seq.pos.set(numpy.asarray([n], dtype=I32))
            seq.n_tokens = n

    def shift(self, seq: DeviceSequence, n_keep: int, n_discard: int) -> None:
        """llama-server's context shift on ``seq``: positions n_keep..n_keep+n_discard-1
        dropped, the later ones moved down, their keys turned by RoPE at -n_discard (the
        model's own RoPE, frequency factors too: llama.cpp's K-shift). The moved keys go to the
        host and back (a rare step: the context is full); values move on the device."""
        hp, n = self.hp, seq.n_tokens
        if n_keep < 0 or n_discard < 1 or n_keep + n_discard > n:
            raise ValueError(
                f"cannot shift {n} positions by keeping {n_keep}, dropping {n_discard}"
            )
        a, m = n_keep + n_discard, n - n_keep - n_discard
        if m:
            keys = seq.k[:, :, a:n].get().view(numpy.float16).astype(F32)  # [L, kv, m, hd]
            cos, sin = rope_angles(
                numpy,
                numpy.asarray([-n_discard]),
                hp.head_dim,
                hp.rope_base,
                hp.rope_freq_scale,
                self.w.rope_freqs,
            )
            rows = keys.transpose(2, 0, 1, 3).reshape(m, -1, hp.head_dim)
            turned = apply_rope(
                rows, numpy.repeat(cos, m, axis=0), numpy.repeat(sin, m, axis=0), hp.spec.rope_neox
            )
            out = turned.reshape(m, hp.n_layer, hp.n_head_kv, hp.head_dim).transpose(1, 2, 0, 3)
            bits = numpy.ascontiguousarray(out.astype(numpy.float16)).view(numpy.uint16)
            seq.k[:, :, n_keep : n_keep + m] = self.cp.asarray(bits)
            seq.v[:, :, n_keep : n_keep + m] = seq.v[:, :, a:n].copy()
        seq.pos.set(numpy.asarray([n - n_discard], dtype=I32))
        seq.n_tokens = n - n_discard

    def copy_sequence(self, src: DeviceSequence, dst: DeviceSequence) -> None:
        """``dst`` becomes a copy of ``src``'s positions, its position and its token: device
        copies only, nothing read back."""
        if dst.n_ctx < src.n_tokens:
            raise ValueError(f"{src.n_tokens} positions do not fit a sequence of {dst.n_ctx}")
        n = src.n_tokens
        dst.k[:, :, :n] = src.k[:, :, :n]
        dst.v[:, :, :n] = src.v[:, :, :n]
        dst.pos[...] = src.pos
        dst.token[...] = src.token
        dst.logits[...] = src.logits
        dst.n_tokens = n
