"""GGUF weights: the header decides the architecture, then every matrix is dequantized once.

The file is opened memory-mapped with the engine's GGUF reader (``gguf_file``). ``read_hparams``
looks only at the header (keys and tensor descriptions) and refuses, with the reason, any
architecture, key or tensor the forward pass does not play, before a single weight byte is read. ``load_weights`` then
dequantizes each matrix with ``gguf.quants.dequantize`` into float32, rows = output features,
in the array module of the chosen device. Q/K/V and gate/up are fused into one matrix each
where they share an activation type, so a decode step makes four matrix products per layer.

Memory budget: 4 bytes per weight (the f32 matrices), a tied embedding held once. The load
refuses a model whose f32 weights would not fit in 90 % of the memory available.

``quantize_activation`` reproduces what ggml does to the activation before a quantized matrix
product: it rounds the row to the weight type's ``vec_dot_type`` (q8_0, q8_1, q8_K, f16, bf16).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import numpy
from gguf import GGMLQuantizationType as T
from gguf import quants

from bankml.engine_cupy.arch import (
    ARCHITECTURES,
    BASE_LAYER_TENSORS,
    FUSED_QKV,
    SPLIT_QKV,
    ArchSpec,
    supported_names,
)
from bankml.engine_cupy.gguf_file import GGUFFile, metadata, open_file
from bankml.engine_cupy.kernels import exact_iquants, exact_kquants, exact_matmul, exact_ops

MEMORY_SHARE = 0.9  # the share of available memory the f32 weights may take


class UnsupportedModel(ValueError):
    """The file is not one the forward pass plays; the message names the key, tensor or type."""


# ggml's vec_dot_type per weight type (ggml-cpu.c type_traits_cpu): how the activation is
# rounded before the product. Types not listed here cannot be dequantized by gguf either.
VEC_DOT_KIND: dict[T, str] = {
    T.F32: "f32",
    T.F16: "f16",
    T.BF16: "bf16",
    T.Q4_0: "q8_0",
    T.Q5_0: "q8_0",
    T.Q8_0: "q8_0",
    T.IQ4_NL: "q8_0",
    T.MXFP4: "q8_0",
    T.NVFP4: "q8_0",
    T.Q4_1: "q8_1",
    T.Q5_1: "q8_1",
    T.Q2_K: "q8_K",
    T.Q3_K: "q8_K",
    T.Q4_K: "q8_K",
    T.Q5_K: "q8_K",
    T.Q6_K: "q8_K",
    T.IQ2_XXS: "q8_K",
    T.IQ2_XS: "q8_K",
    T.IQ2_S: "q8_K",
    T.IQ3_XXS: "q8_K",
    T.IQ3_S: "q8_K",
    T.IQ1_S: "q8_K",
    T.IQ1_M: "q8_K",
    T.IQ4_XS: "q8_K",
    T.TQ1_0: "q8_K",
    T.TQ2_0: "q8_K",
}


def dequantizable_types() -> set[T]:
    """The ggml types gguf.quants can turn into float32 (and so the ones accepted)."""
    known = {T.F32, T.F16} | set(getattr(quants, "_type_traits", {}).keys())
    return {t for t in known if t in VEC_DOT_KIND}


# ---------------------------------------------------------------------------------------------
# Header: hyper-parameters and the architecture decision


@dataclass(frozen=True)
class HParams:
    arch: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    n_vocab: int
    n_ctx_train: int
    rms_eps: float
    rope_base: float
    rope_freq_scale: float
    attn_scale: float  # multiplies Q·K
    embd_scale: float  # multiplies the token embeddings (1 except gemma3)
    final_softcap: float  # 0: none
    tied_output: bool
    swa_window: int  # 0: no sliding-window layers
    swa_layers: tuple[bool, ...]  # per layer: is it a sliding-window (local) layer
    rope_base_swa: float
    spec: ArchSpec = field(compare=False)


def _field(reader: GGUFFile, key: str, default: Any = None) -> Any:
    return metadata(reader, [key]).get(key, default)


def _scalar(reader: GGUFFile, key: str, default: Any = None, required: bool = False) -> Any:
    value = _field(reader, key, default)
    if value is None and required:
        raise UnsupportedModel(f"no {key} in the header")
    if isinstance(value, list):
        raise UnsupportedModel(f"{key} is per-layer ({len(value)} values): not reproduced")
    return value


def _tensor_infos(reader: GGUFFile) -> dict[str, Any]:
    return {t.name: t for t in reader.tensors}


def _check_tensor_names(spec: ArchSpec, names: set[str], n_layer: int) -> bool:
    """Every tensor must be part of the graph; every required one present. Returns tied."""
    allowed = {"token_embd.weight", "output_norm.weight", "output.weight", *spec.optional_global}
    fused = "blk.0.attn_qkv.weight" in names
    per_layer = list(BASE_LAYER_TENSORS) + list(spec.required_layer)
    per_layer += list(FUSED_QKV) if fused else list(SPLIT_QKV)
    optional = list(spec.optional_layer) + (["attn_qkv.bias"] if fused else [])
    if fused:  # biases of a fused projection come fused too
        per_layer = [n for n in per_layer if n not in ("attn_q.bias", "attn_k.bias", "attn_v.bias")]
    for il in range(n_layer):
        for suffix in per_layer:
            name = f"blk.{il}.{suffix}"
            if name not in names:
                raise UnsupportedModel(f"tensor {name} is missing: the {spec.name} graph needs it")
            allowed.add(name)
        allowed.update(f"blk.{il}.{suffix}" for suffix in optional)
    for name in ("token_embd.weight", "output_norm.weight"):
        if name not in names:
            raise UnsupportedModel(f"tensor {name} is missing")
    for name in sorted(names - allowed):
        raise UnsupportedModel(
            f"tensor {name}: not part of the {spec.name} graph this forward pass reproduces"
        )
    return "output.weight" not in names


def _check_tensor_types(infos: dict[str, Any]) -> None:
    accepted = dequantizable_types()
    for name, info in infos.items():
        if info.tensor_type not in accepted:
            raise UnsupportedModel(
                f"tensor {name} has type {info.tensor_type.name}, which gguf.quants cannot "
                "dequantize: the forward pass refuses it"
            )


def _rope_scaling(reader: GGUFFile, arch: str) -> float:
    kind = _scalar(reader, f"{arch}.rope.scaling.type", "none")
    if kind in ("none", None):
        return 1.0
    if kind == "linear":
        factor = float(_scalar(reader, f"{arch}.rope.scaling.factor", 1.0) or 1.0)
        return 1.0 / factor
    raise UnsupportedModel(
        f"RoPE scaling {kind!r} on {arch}: not reproduced (none, linear and "
        "Llama 3 frequency factors are)"
    )


def _swa_layers(reader: GGUFFile, arch: str, n_layer: int) -> tuple[int, tuple[bool, ...]]:
    """gemma3: local layers except every n-th (llama_hparams::set_swa_pattern, n = 6)."""
    window = int(_scalar(reader, f"{arch}.attention.sliding_window", 0) or 0)
    if window <= 0:
        return 0, (False,) * n_layer
    pattern = _field(reader, f"{arch}.attention.sliding_window_pattern", 6)
    if isinstance(pattern, list):  # an explicit per-layer list of booleans
        if len(pattern) != n_layer:
            raise UnsupportedModel("attention.sliding_window_pattern does not list every layer")
        return window, tuple(bool(p) for p in pattern)
    n = int(pattern)
    return window, tuple(n == 0 or (il % n < n - 1) for il in range(n_layer))


def read_hparams(reader: GGUFFile) -> HParams:
    """The architecture and its numbers from the header alone; refuses what is not played."""
    arch = _scalar(reader, "general.architecture")
    if arch is None:
        raise UnsupportedModel("no general.architecture in the header")
    spec = ARCHITECTURES.get(arch)
    if spec is None:
        raise UnsupportedModel(f"architecture {arch}: the forward pass plays {supported_names()}")
    if int(_scalar(reader, f"{arch}.expert_count", 0) or 0) > 0:
        raise UnsupportedModel(f"a mixture-of-experts {arch} (expert_count > 0): not reproduced")

    infos = _tensor_infos(reader)
    _check_tensor_types(infos)
    n_layer = int(_scalar(reader, f"{arch}.block_count", required=True))
    tied = _check_tensor_names(spec, set(infos), n_layer)

    n_embd = int(_scalar(reader, f"{arch}.embedding_length", required=True))
    n_head = int(_scalar(reader, f"{arch}.attention.head_count", required=True))
    n_head_kv = int(_scalar(reader, f"{arch}.attention.head_count_kv", n_head))
    head_dim = int(_scalar(reader, f"{arch}.attention.key_length", n_embd // n_head))
    value_dim = int(_scalar(reader, f"{arch}.attention.value_length", head_dim))
    n_rot = int(_scalar(reader, f"{arch}.rope.dimension_count", head_dim))
    if value_dim != head_dim or n_rot != head_dim:
        raise UnsupportedModel("partial RoPE or a value head of another width: not reproduced")
    if n_head % n_head_kv:
        raise UnsupportedModel(f"{n_head} query heads do not group over {n_head_kv} KV heads")
    embd_shape = [int(x) for x in infos["token_embd.weight"].shape]  # ggml order: [n_embd, n_vocab]
    if embd_shape[0] != n_embd:
        raise UnsupportedModel(f"token_embd.weight is {embd_shape}, not {n_embd} wide")

    if arch == "gemma3":
        # llama_model_gemma3::load_arch_hparams: the 27B scales by n_embd/n_head, others by head_dim.
        attn_scale = float(exact_ops.attn_scale(n_embd // n_head if n_layer == 62 else head_dim))
        window, swa = _swa_layers(reader, arch, n_layer)
    else:
        attn_scale = float(exact_ops.attn_scale(head_dim))  # llama.cpp's kq_scale
        window, swa = 0, (False,) * n_layer
        if _field(reader, f"{arch}.attention.scale") is not None:
            raise UnsupportedModel(f"a {arch} variant with attention.scale: not reproduced")
    return HParams(
        arch=arch,
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim=head_dim,
        n_ff=int(_scalar(reader, f"{arch}.feed_forward_length", required=True)),
        n_vocab=embd_shape[1],
        n_ctx_train=int(_scalar(reader, f"{arch}.context_length", 2048)),
        rms_eps=float(_scalar(reader, f"{arch}.attention.layer_norm_rms_epsilon", required=True)),
        rope_base=float(_scalar(reader, f"{arch}.rope.freq_base", 10000.0)),
        rope_freq_scale=_rope_scaling(reader, arch),
        attn_scale=attn_scale,
        embd_scale=math.sqrt(n_embd) if spec.scale_embeddings else 1.0,
        final_softcap=float(_scalar(reader, f"{arch}.final_logit_softcapping", 0.0) or 0.0),
        tied_output=tied,
        swa_window=window,
        swa_layers=swa,
        rope_base_swa=float(_scalar(reader, f"{arch}.rope.freq_base_swa", 10000.0)),
        spec=spec,
    )


# ---------------------------------------------------------------------------------------------
# Activation rounding before a matrix product (ggml's from_float for the vec_dot_type)


def _q8_blocks(xp: ModuleType, x: Any, block: int, f16_scale: bool) -> Any:
    """Round rows of x to 8-bit blocks as ggml's AVX2 quantize_row_q8_0/q8_1 and dequantize."""
    n, k = x.shape
    xb = x.reshape(n, k // block, block)
    amax = xp.abs(xb).max(axis=-1, keepdims=True)
    d = amax / numpy.float32(127)
    if f16_scale:
        d = d.astype(xp.float16).astype(xp.float32)
    inv = numpy.float32(127) / xp.where(amax > 0, amax, numpy.float32(1))
    q = xp.rint(xb * inv)  # _mm256_round_ps nearest: ties to even
    return (q * d).reshape(n, k)


def _q8_k(xp: ModuleType, x: Any) -> Any:
    """ggml's quantize_row_q8_K_ref: 256-blocks, scale from the signed largest value, f32 d."""
    n, k = x.shape
    xb = x.reshape(n, k // 256, 256)
    idx = xp.abs(xb).argmax(axis=-1)[..., None]  # first largest, as the C loop's strict '>'
    mx = xp.take_along_axis(xb, idx, axis=-1)
    safe = xp.where(mx != 0, mx, numpy.float32(1))
    iscale = numpy.float32(-127) / safe
    q = xp.minimum(xp.rint(xb * iscale), numpy.float32(127))
    d = xp.where(mx != 0, numpy.float32(1) / iscale, numpy.float32(0))
    return (q * d).reshape(n, k)


def _bf16(xp: ModuleType, x: Any) -> Any:
    """Round to bfloat16 (nearest even), as ggml_fp32_to_bf16."""
    u = xp.ascontiguousarray(x).view(xp.uint32)
    rounded = (u + xp.uint32(0x7FFF) + ((u >> xp.uint32(16)) & xp.uint32(1))) & xp.uint32(
        0xFFFF0000
    )
    return rounded.view(xp.float32)


def quantize_q8_1(xp: ModuleType, x: Any) -> tuple[Any, Any]:
    """x [n, k] as q8_1 blocks (dequantized) and, per block, f16(d·Σq) − d16·Σq [n, k/32]."""
    n, k = x.shape
    xb = x.reshape(n, k // 32, 32)
    amax = xp.abs(xb).max(axis=-1)
    d = amax / numpy.float32(127)
    d16 = d.astype(xp.float16).astype(xp.float32)
    inv = numpy.float32(127) / xp.where(amax > 0, amax, numpy.float32(1))
    q = xp.rint(xb * inv[..., None])
    qsum = q.sum(axis=-1)
    s16 = (d * qsum).astype(xp.float16).astype(xp.float32)
    return (q * d16[..., None]).reshape(n, k), s16 - d16 * qsum


def quantize_activation(xp: ModuleType, x: Any, kind: str) -> Any:
    """x [n, k] f32 as ggml sees it in a product with a weight of this vec_dot kind."""
    if kind == "f32":
        return x
    if kind == "f16":
        return x.astype(xp.float16).astype(xp.float32)
    if kind == "bf16":
        return _bf16(xp, x)
    if kind == "q8_0" or kind == "q8_1":
        return _q8_blocks(xp, x, 32, f16_scale=True)
    if kind == "q8_K":
        return _q8_k(xp, x)
    raise ValueError(f"unknown activation kind {kind}")


# ---------------------------------------------------------------------------------------------
# Matrices


@dataclass
class Linear:
    """y = round(x) @ W.T + b, with W [out, in] float32 and the outputs named in order.

    With ``exact`` (the CPU path, for the types exact_matmul plays) the weight stays in its GGUF
    blocks and the product is ggml's own arithmetic; ``weight`` is then None.
    """

    weight: Any
    bias: Any | None
    kind: str  # the vec_dot kind of the weight type
    parts: tuple[tuple[str, int], ...]  # (name, width) of the fused outputs
    block_mins: Any | None = None  # [out, in/32] f32: Q4_1/Q5_1 block minimums (see below)
    exact: Any | None = None  # a QuantMatrix / KQuantMatrix / IQuantMatrix (or a stack of them)

    def __call__(
        self, xp: ModuleType, x: Any, groups: Sequence[int] | None = None
    ) -> dict[str, Any]:
        """The named outputs for the rows of x. ``groups``: the sizes of the groups of rows
        that are each a product of their own in llama-server (several sequences' micro-batches
        in one pass): a K-quant product (rows_grouped) multiplies each group in that group's
        arithmetic; the others multiply the rows as one product."""
        if self.exact is not None:
            if groups is not None and len(groups) > 1 and rows_grouped(self):
                y = self.exact.matmul(x, groups)
            else:
                y = self.exact.matmul(x)
        elif self.block_mins is None:
            y = quantize_activation(xp, x, self.kind) @ self.weight.T
        else:
            # ggml's Q4_1/Q5_1 dot adds min·s per block with s = f16(d·Σq) from q8_1; the
            # dequantized product has min·d16·Σq instead: add the difference. The rounding of s
            # is 2^-11 of a term as large as the product itself, and downstream q8 rounding
            # magnifies it, so it is worth its 1/32-sized extra product.
            xq, sum_error = quantize_q8_1(xp, x)
            y = xq @ self.weight.T
            y += sum_error @ self.block_mins.T
        if self.bias is not None:
            y += self.bias
        out, start = {}, 0
        for name, width in self.parts:
            out[name] = y[:, start : start + width]
            start += width
        return out


def apply_all(
    xp: ModuleType, linears: Iterable[Linear], x: Any, groups: Sequence[int] | None = None
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for linear in linears:
        out.update(linear(xp, x, groups))
    return out


# The weight types whose product gives each activation row the same bits whatever rows it is
# multiplied beside: ggml's vec_dot for one row and tinyBLAS's tiles for several share the
# per-element arithmetic (exact_matmul). The K-quants change arithmetic at 8 rows (tiled),
# repacked matrices at 4 (gemm), F16/BF16/F32 at 2 (tinyBLAS), IQ4_NL with its tinyBLAS tiles.
ROW_INDEPENDENT_TYPES = frozenset({T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0})


def rows_independent(linear: Linear) -> bool:
    """Whether ``linear`` multiplies each row as it would alone, for any number of rows (so
    several sequences' rows may share one product): an exact product of those types, not
    repacked, every part of a stacked one."""
    return linear.exact is not None and rows_alone(linear.exact)


def rows_grouped(linear: Linear) -> bool:
    """Whether ``linear`` multiplies several groups of rows in one product, each group in the
    arithmetic ggml picks for its own row count (exact_kquants.KQuantMatrix.matmul's groups):
    an exact K-quant product, every part of a stacked one. Several sequences' rows may share
    such a product too."""
    parts = getattr(linear.exact, "parts", [linear.exact])
    return linear.exact is not None and all(
        isinstance(p, exact_kquants.KQuantMatrix) for p in parts
    )


def rows_alone(matrix: Any, min_rows: int = 1) -> bool:
    """Whether the exact ``matrix`` multiplies each row of sequences of at least ``min_rows``
    rows each, put side by side, as it multiplies them in a product of that sequence alone:
    the ``ROW_INDEPENDENT_TYPES`` (not repacked) always; F16, BF16 and F32 where each sequence
    has two rows or more (tinyBLAS's tiles for every such product; one row is vec_dot's) or
    the weight rows do not come in fours (vec_dot for any rows); every part of a stack."""
    parts = getattr(matrix, "parts", [matrix])
    for p in parts:
        if not isinstance(p, exact_matmul.QuantMatrix) or p.repacked:
            return False
        if p.qtype in ROW_INDEPENDENT_TYPES:
            continue
        if p.qtype in (T.F16, T.BF16, T.F32) and (min_rows >= 2 or p.n_out % 4 != 0):
            continue
        return False
    return True


@dataclass
class Layer:
    attn_norm: Any
    qkv: list[Linear]
    wo: Linear
    ffn_norm: Any
    gate_up: list[Linear]
    down: Linear
    q_norm: Any | None = None
    k_norm: Any | None = None
    post_attn_norm: Any | None = None
    post_ffw_norm: Any | None = None


@dataclass
class Weights:
    token_embd: Any  # [n_vocab, n_embd] f32 (or EmbeddingRows), rows looked up by token id
    output_norm: Any
    output: Linear  # the tied embedding when the file has no output.weight
    layers: list[Layer]
    rope_freqs: Any | None  # Llama 3 per-frequency divisors
    nbytes: int


def exact_family(qtype: T) -> ModuleType | None:
    """The module whose kernels multiply this weight type exactly as ggml (None: none does)."""
    for family in (exact_matmul, exact_kquants, exact_iquants):
        if family.supported(qtype):
            return family
    return None


# each family's matrix class (GGUF blocks -> ggml's product)
_MATRIX_CLASS: dict[ModuleType, type] = {
    exact_matmul: exact_matmul.QuantMatrix,
    exact_kquants: exact_kquants.KQuantMatrix,
    exact_iquants: exact_iquants.IQuantMatrix,
}


def exact_matrix_of(info: Any, token_embd: bool = False) -> Any:
    """A GGUF tensor [n_in, n_out] kept in its blocks for ggml's exact product (its type must
    have an exact family); as llama-server holds it (some layer matrices repacked)."""
    n_in, n_out = (int(d) for d in info.shape)
    family = exact_family(info.tensor_type)
    if family is None:
        raise UnsupportedModel(f"tensor {info.name}: no exact kernel for its type")
    # llama-server repacks some layer matrices (Q4_0, Q4_K on AVX2): other kernels, other roundings
    repacked = family.repacked_by_llama_server(info.tensor_type, n_out, token_embd=token_embd)
    return _MATRIX_CLASS[family](info.data, info.tensor_type, n_out, n_in, repacked=repacked)


class EmbeddingRows:
    """A token embedding left in its GGUF blocks; ``rows[ids]`` dequantizes just those rows.

    ggml's get_rows dequantizes the same way (d·q in f32 per block), so nothing changes but the
    memory: the default model's 49,152 × 576 table stays 30 MiB of Q8_0 instead of 113 MiB.
    """

    def __init__(self, info: Any):
        self.raw = info.data
        self.qtype = info.tensor_type
        self.width = int(info.shape[0])

    def __getitem__(self, ids: Any) -> numpy.ndarray:
        rows = self.raw[numpy.asarray(ids, dtype=numpy.int64)]
        return dequantize(rows, self.qtype).reshape(len(rows), self.width).astype(numpy.float32)


class _Loader:
    """Turns tensors of the memory-mapped file into exact block matrices or dequantized xp
    arrays, ticking progress."""

    def __init__(
        self, reader: GGUFFile, xp: ModuleType, tick: Callable[[int], None], exact: bool = True
    ):
        self.reader = reader
        self.infos = _tensor_infos(reader)
        self.xp = xp
        self.tick = tick
        self.exact = exact  # keep matrices in their blocks for exact_matmul (CPU only)
        self.nbytes = 0

    def has(self, name: str) -> bool:
        return name in self.infos

    def kind(self, name: str) -> str:
        return VEC_DOT_KIND[self.infos[name].tensor_type]

    def host(self, name: str) -> numpy.ndarray:
        info = self.infos[name]
        array = dequantize(info.data, info.tensor_type)
        self.tick(int(info.n_bytes))
        shape = tuple(int(s) for s in reversed([int(x) for x in info.shape]))
        return numpy.ascontiguousarray(array.reshape(shape), dtype=numpy.float32)

    def array(self, name: str) -> Any:
        out = self.xp.asarray(self.host(name))
        self.nbytes += out.nbytes
        return out

    def optional(self, name: str) -> Any | None:
        return self.array(name) if self.has(name) else None

    def fused(self, names: list[tuple[str, str]]) -> list[Linear]:
        """One Linear per run of consecutive weights sharing a vec_dot kind (name, output name)."""
        groups: list[list[tuple[str, str]]] = []
        for item in names:
            if groups and self.kind(groups[-1][-1][0]) == self.kind(item[0]):
                groups[-1].append(item)
            else:
                groups.append([item])
        return [self._linear(group) for group in groups]

    def exact_matrix(self, name: str) -> Any:
        """The weight kept in its blocks for ggml's exact product (``exact_matrix_possible``)."""
        info = self.infos[name]
        self.tick(int(info.n_bytes))
        self.nbytes += int(info.n_bytes)
        return exact_matrix_of(info, token_embd=name == "token_embd.weight")

    def _exact_linear(self, group: list[tuple[str, str]]) -> Linear | None:
        if not all(self.exact_matrix_possible(w) for w, _ in group):
            return None
        mats = [self.exact_matrix(w) for w, _ in group]
        parts = tuple((out, m.n_out) for (_, out), m in zip(group, mats))
        # one vec_dot kind per group (fused): the first part's concat stacks rows or products,
        # also across modules of that kind (IQ4_NL beside Q4_0: q8_0; IQ4_XS beside Q6_K: q8_K)
        exact = type(mats[0]).concat(mats) if len(mats) > 1 else mats[0]
        if len(mats) > 1 and getattr(exact, "raw", None) is not None:  # the parts' bytes copied
            for w, _ in group:
                self.reader.drop_pages(self.infos[w].data)
        return Linear(
            None,
            self._bias(group, [m.n_out for m in mats]),
            self.kind(group[0][0]),
            parts,
            exact=exact,
        )

    def exact_matrix_possible(self, name: str) -> bool:
        info = self.infos[name]
        return (
            self.exact
            and self.xp is numpy
            and exact_family(info.tensor_type) is not None
            and len(info.shape) == 2
        )

    def _bias(self, group: list[tuple[str, str]], widths: list[int]) -> Any | None:
        """The group's biases side by side (zeros for a member without one), or None."""
        names = [w[: -len("weight")] + "bias" for w, _ in group]
        if not any(self.has(b) for b in names):
            return None
        bias = self.xp.asarray(
            numpy.concatenate(
                [
                    self.host(b) if self.has(b) else numpy.zeros(n, numpy.float32)
                    for b, n in zip(names, widths)
                ]
            )
        )
        self.nbytes += bias.nbytes
        return bias

    def _linear(self, group: list[tuple[str, str]]) -> Linear:
        exact = self._exact_linear(group)
        if exact is not None:
            return exact
        mats = [self.host(w) for w, _ in group]
        weight = self.xp.asarray(numpy.concatenate(mats, axis=0) if len(mats) > 1 else mats[0])
        bias = self._bias(group, [m.shape[0] for m in mats])
        self.nbytes += weight.nbytes
        parts = tuple((out, m.shape[0]) for (_, out), m in zip(group, mats))
        mins = None
        if self.infos[group[0][0]].tensor_type in (T.Q4_1, T.Q5_1):
            mins = self.xp.asarray(numpy.concatenate([self.block_mins(w) for w, _ in group]))
            self.nbytes += mins.nbytes
        return Linear(weight, bias, self.kind(group[0][0]), parts, mins)

    def block_mins(self, name: str) -> numpy.ndarray:
        """The f16 minimum 'm' of each Q4_1/Q5_1 block (bytes 2..3 of the block), [out, in/32]."""
        info = self.infos[name]
        _, size = quants.GGML_QUANT_SIZES[info.tensor_type]
        rows = info.data.reshape(info.data.shape[0], -1, size)
        return (
            numpy.ascontiguousarray(rows[:, :, 2:4])
            .view(numpy.float16)[..., 0]
            .astype(numpy.float32)
        )


def dequantize(data: numpy.ndarray, qtype: T) -> numpy.ndarray:
    """gguf.quants' dequantization, fed about 1 MiB of rows at a time.

    gguf.quants.dequantize works through groups of 16 rows, and its per-group overhead made the
    default model's load take seconds more; its public per-type dequantize_rows does the work.
    """
    if qtype in (T.F32, T.F16):
        return quants.dequantize(data, qtype)
    qclass = quants._type_traits[qtype]
    qclass.init_grid()
    rows = data.reshape(-1, data.shape[-1])
    step = max(1, (1 << 20) // rows.shape[1])
    chunks = [qclass.dequantize_rows(rows[i : i + step]) for i in range(0, rows.shape[0], step)]
    return numpy.concatenate(chunks) if len(chunks) > 1 else chunks[0]


def weight_bytes(reader: GGUFFile, exact: bool = False) -> int:
    """What the loaded weights take: 4 bytes per element, or (``exact``) the GGUF bytes of the
    matrices an exact family multiplies in their blocks."""

    def size(t: Any) -> int:
        if exact and exact_family(t.tensor_type) is not None and len(t.shape) == 2:
            return int(t.n_bytes)
        return int(t.n_elements) * 4

    return sum(size(t) for t in reader.tensors)


def check_memory(reader: GGUFFile, available: int | None = None, exact: bool = False) -> None:
    need = weight_bytes(reader, exact)
    if available is None:
        import psutil

        available = psutil.virtual_memory().available
    if need > MEMORY_SHARE * available:
        raise UnsupportedModel(
            f"the weights take {need / 2**30:.2f} GiB, more than {MEMORY_SHARE:.0%} of the "
            f"{available / 2**30:.2f} GiB of memory available"
        )


def _layer(ld: _Loader, hp: HParams, il: int) -> Layer:
    p = f"blk.{il}."
    if ld.has(p + "attn_qkv.weight"):
        qkv = [ld._linear([(p + "attn_qkv.weight", "qkv")])]
    else:
        qkv = ld.fused(
            [(p + "attn_q.weight", "q"), (p + "attn_k.weight", "k"), (p + "attn_v.weight", "v")]
        )
    layer = Layer(
        attn_norm=ld.array(p + "attn_norm.weight"),
        qkv=qkv,
        wo=ld._linear([(p + "attn_output.weight", "o")]),
        ffn_norm=ld.array(p + "ffn_norm.weight"),
        gate_up=ld.fused([(p + "ffn_gate.weight", "gate"), (p + "ffn_up.weight", "up")]),
        down=ld._linear([(p + "ffn_down.weight", "down")]),
    )
    if hp.spec.qk_norm:
        layer.q_norm = ld.array(p + "attn_q_norm.weight")
        layer.k_norm = ld.array(p + "attn_k_norm.weight")
    if hp.spec.post_norms:
        layer.post_attn_norm = ld.array(p + "post_attention_norm.weight")
        layer.post_ffw_norm = ld.array(p + "post_ffw_norm.weight")
    return layer


def load_weights(
    reader: GGUFFile,
    hp: HParams,
    xp: ModuleType,
    tick: Callable[[int], None] = lambda n: None,
    exact: bool = True,
) -> Weights:
    """Every tensor loaded (exact block matrices on the CPU, else float32 on the device),
    matrices fused for decoding."""
    ld = _Loader(reader, xp, tick, exact)
    exact_embd = ld.exact_matrix_possible("token_embd.weight")
    token_embd = (
        EmbeddingRows(ld.infos["token_embd.weight"])
        if exact_embd
        else ld.array("token_embd.weight")
    )
    kind = ld.kind("token_embd.weight")
    if hp.tied_output and exact_embd:
        output = ld._linear([("token_embd.weight", "logits")])
    elif hp.tied_output:
        output = Linear(token_embd, None, kind, (("logits", hp.n_vocab),))
    else:
        output = ld._linear([("output.weight", "logits")])
    layers = [_layer(ld, hp, il) for il in range(hp.n_layer)]
    return Weights(
        token_embd=token_embd,
        output_norm=ld.array("output_norm.weight"),
        output=output,
        layers=layers,
        rope_freqs=ld.optional("rope_freqs.weight"),
        nbytes=ld.nbytes,
    )


def total_tensor_bytes(reader: GGUFFile) -> int:
    return sum(int(t.n_bytes) for t in reader.tensors)


def open_reader(path: str | os.PathLike) -> GGUFFile:
    """The model's header (``gguf_file.open_file``); a file it cannot read is refused."""
    try:
        return open_file(path)
    except ValueError as err:  # a missing file stays FileNotFoundError
        raise UnsupportedModel(f"{os.fspath(path)}: not a readable GGUF file ({err})") from err
