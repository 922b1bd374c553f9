"""Tiny random GGUF models of each architecture the native engine plays, for oracle tests.

``write_tiny_model`` writes a 2-4 layer model with ``gguf.GGUFWriter`` that llama-server loads:
random weights in the chosen ggml type and the default model's GPT-2 vocabulary (tokens, types,
merges), which llama.cpp accepts for any architecture. The weights are scaled so the logits are
peaked (a standard deviation near 8), so greedy choices are not coin flips between near-ties.

K-quant types (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K) have no quantizer in gguf.quants, so their blocks are random bytes
with the f16 scales set to keep the weights at the intended size; both engines dequantize the
same bytes.
IQ4_NL and IQ4_XS (no quantizer in gguf.quants either) are made the same way: random 4-bit indices
into ggml's value table (and random 6-bit IQ4_XS sub-block scales), f16 d rescaled; so are the grid
types (IQ3_XXS, IQ2_XXS, ...: random grid indices, signs and 4-bit scales). TQ2_0 is quantized by
gguf.quants. ggml's own quantizer (the kernel oracle's) is not used here because the device check
builds these models on a machine without the ggml build; tests/test_exact_iquants.py multiplies
ggml-quantized weights where ggml has a quantizer without an importance matrix.
"""

from __future__ import annotations

import functools
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy
from gguf import GGMLQuantizationType as T
from gguf import GGUFWriter, PoolingType, quants

from bankml.engine_cupy.weights import dequantize, open_reader

# a reranker's prompt as Qwen3's converter writes it (shortened): the query and the document
RERANK_TEMPLATE = (
    "<|im_start|>system\nJudge whether the Document answers the Query: yes or no.<|im_end|>\n"
    "<|im_start|>user\n<Query>: {query}\n<Document>: {document}<|im_end|>\n"
    "<|im_start|>assistant\n"
)


@dataclass(frozen=True)
class TinySpec:
    arch: str
    wtype: T  # the type of every matrix
    n_layer: int = 2
    tied: bool = True
    llama3_rope: bool = False  # a rope_freqs.weight tensor (Llama 3 frequency factors)
    out_type: T | None = None  # the untied output's type (default: wtype)
    n_embd: int = 256  # a multiple of 256, as K-quant rows need
    n_ff: int = 512
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int = 64
    # a rank head (qwen3's reranker layout): ``cls.output.weight`` F32 of one row per label,
    # pooling rank, the labels, and a rerank template with {query} and {document}
    rank_labels: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        extra = ("-untied" if not self.tied else "") + ("-rope3" if self.llama3_rope else "")
        return f"{self.arch}-{self.wtype.name}{extra}"


# The set the oracle tests run: every architecture, several weight types each.
TINY_SPECS = (
    TinySpec("llama", T.Q4_K, tied=False, llama3_rope=True, out_type=T.Q6_K),
    TinySpec("llama", T.F16),
    TinySpec("qwen2", T.Q8_0),
    TinySpec("qwen2", T.Q4_1, tied=False),
    TinySpec("qwen3", T.Q4_0),
    TinySpec("qwen3", T.F32),
    TinySpec("gemma3", T.Q6_K, n_layer=4),
    TinySpec("gemma3", T.Q5_0, n_layer=4),
    TinySpec("llama", T.Q3_K, tied=False, out_type=T.Q2_K),
    TinySpec("qwen2", T.Q2_K),
    TinySpec("llama", T.BF16),
    TinySpec("llama", T.IQ4_NL),  # layers repacked (iq4_nl_8x8), the tied output not
    TinySpec("qwen2", T.IQ4_XS, tied=False, out_type=T.Q6_K),  # as IQ4_XS downloads pair them
    TinySpec("llama", T.IQ3_XXS),  # the tied output too: vec_dot for one row, tiled for 8 or more
    TinySpec("qwen2", T.IQ2_XXS, tied=False, out_type=T.Q4_K),
    TinySpec("qwen3", T.TQ2_0),  # ternary, quantized by gguf-py
)

# The set the fast-path tests run (decode step, decode_batch, forward_batch):
# biases (qwen2), Q/K norms and a repacked Q4_0 (qwen3), post-norms, GeGLU, the Q scale,
# sliding windows and soft-capping (gemma3), and the three float weight types' vec_dot paths;
# the K-quants' one-row products: repacked Q4_K's gemv with a Q6_K output, Q2_K with biases,
# Q3_K with a Q2_K output, and Q6_K in gemma3 (Q5_K: gguf-py cannot quantize it)
FAST_SPECS = (
    TinySpec("qwen2", T.Q4_1, tied=False),
    TinySpec("gemma3", T.Q5_0, n_layer=4),
    TinySpec("qwen3", T.Q4_0),
    TinySpec("llama", T.F16),
    TinySpec("llama", T.BF16),
    TinySpec("qwen3", T.F32),
    TinySpec("llama", T.Q4_K, tied=False, llama3_rope=True, out_type=T.Q6_K),
    TinySpec("qwen2", T.Q2_K),
    TinySpec("llama", T.Q3_K, tied=False, out_type=T.Q2_K),
    TinySpec("gemma3", T.Q6_K, n_layer=4),
    TinySpec("llama", T.IQ4_NL),  # repacked layers (gemv), the tied output's q8_0 vec_dot
    TinySpec("qwen2", T.IQ4_XS, tied=False, out_type=T.Q6_K),  # q8_K vec_dot, biases
    TinySpec("llama", T.IQ3_XXS),  # the grid types' vec_dot
    TinySpec("qwen2", T.IQ2_XXS, tied=False, out_type=T.Q4_K),
    TinySpec("llama", T.IQ1_S),  # the deltas' scalar chain
    TinySpec("qwen3", T.TQ2_0),  # TQ's activation correction, in compiled loops here
)


@functools.lru_cache(maxsize=2)
def _vocab(vocab_model: Path) -> tuple[list[str], list[int], list[str]]:
    reader = open_reader(vocab_model)
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    types = reader.fields["tokenizer.ggml.token_type"].contents()
    merges = reader.fields["tokenizer.ggml.merges"].contents()
    return tokens, types, merges


# IQ types whose block starts with its f16 d: random bytes are valid blocks (every grid index and
# sign pattern is allowed), d set to 1 and then rescaled like the K-quants' scales
_D_FIRST = (T.IQ4_NL, T.IQ4_XS, T.IQ3_XXS, T.IQ3_S, T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ1_S)


def _kquant_bytes(rng: numpy.random.Generator, rows: int, cols: int, qtype: T) -> numpy.ndarray:
    """Random K-quant blocks with unit-sized f16 scale fields, then rescaled (see module doc)."""
    block, size = quants.GGML_QUANT_SIZES[qtype]
    nblk = rows * cols // block
    raw = rng.integers(0, 256, size=(nblk, size), dtype=numpy.uint8)
    if qtype in (T.Q4_K, T.Q5_K):  # d, dmin (f16) first, then 12 bytes of 6-bit scales/mins
        raw[:, 0:4] = numpy.array([1.0, 0.5], numpy.float16).view(numpy.uint8)
    elif qtype == T.Q6_K:  # int8 scales at 192..207, d (f16) last
        raw[:, 192:208] = (
            rng.integers(-16, 17, size=(nblk, 16)).astype(numpy.int8).view(numpy.uint8)
        )
        raw[:, 208:210] = numpy.array([1.0], numpy.float16).view(numpy.uint8)
    elif qtype == T.Q3_K:  # hmask, qs, 12 bytes of 6-bit scales, d (f16) last
        raw[:, 108:110] = numpy.array([1.0], numpy.float16).view(numpy.uint8)
    elif qtype == T.Q2_K:  # 16 bytes of 4-bit scales and mins, qs, then d and dmin (f16)
        raw[:, 80:84] = numpy.array([1.0, 1.5], numpy.float16).view(numpy.uint8)  # mean near 0
    elif qtype in _D_FIRST:  # d (f16) first; the table's or grid's values are signed already
        raw[:, 0:2] = numpy.array([1.0], numpy.float16).view(numpy.uint8)
    else:
        raise ValueError(f"no random-byte recipe for {qtype.name}")
    return raw.reshape(rows, cols // block * size)


def _scale_kquant(raw: numpy.ndarray, qtype: T, target_std: float) -> numpy.ndarray:
    block, size = quants.GGML_QUANT_SIZES[qtype]
    std = float(dequantize(raw, qtype).std())
    blocks = raw.reshape(-1, size)
    # the f16 d (and dmin) of each block
    spots = {
        T.Q2_K: slice(80, 84),
        T.Q3_K: slice(108, 110),
        T.Q4_K: slice(0, 4),
        T.Q5_K: slice(0, 4),
        T.Q6_K: slice(208, 210),
        **{q: slice(0, 2) for q in _D_FIRST},
    }[qtype]
    halves = blocks[:, spots].copy().view(numpy.float16).astype(numpy.float32)
    blocks[:, spots] = (halves * (target_std / std)).astype(numpy.float16).view(numpy.uint8)
    return raw


def _matrix(rng: numpy.random.Generator, rows: int, cols: int, qtype: T, std: float):
    """(data to write, raw_dtype) for an [rows, cols] matrix of the given type."""
    if qtype in (T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, *_D_FIRST):
        return _scale_kquant(_kquant_bytes(rng, rows, cols, qtype), qtype, std), qtype
    w = rng.normal(0.0, std, size=(rows, cols)).astype(numpy.float32)
    if qtype == T.F32:
        return w, None
    if qtype == T.F16:
        return w.astype(numpy.float16), None
    return quants.quantize(w, qtype), qtype


# the files this process wrote, by their arguments: (path, size, mtime_ns) as written
_WRITTEN: dict[tuple[TinySpec, Path, int, int, int], tuple[Path, int, int]] = {}


def write_tiny_model(path: Path, spec: TinySpec, vocab_model: Path, seed: int = 0) -> Path:
    """The tiny model of ``spec`` at ``path``. The same arguments give the same bytes, so a file
    this process already wrote, still as it was written, is copied (milliseconds) instead of
    written again (half a second, most of it packing the vocabulary)."""
    source = Path(vocab_model).resolve()
    st = source.stat()
    key = (spec, source, st.st_size, st.st_mtime_ns, seed)
    kept = _WRITTEN.get(key)
    if kept is not None and _unchanged(kept):
        if kept[0] != Path(path).resolve():
            shutil.copyfile(kept[0], path)
        return path
    _write_tiny_model(path, spec, vocab_model, seed)
    written = Path(path).stat()
    _WRITTEN[key] = (Path(path).resolve(), written.st_size, written.st_mtime_ns)
    return path


def _unchanged(kept: tuple[Path, int, int]) -> bool:
    try:
        st = kept[0].stat()
    except OSError:
        return False
    return (st.st_size, st.st_mtime_ns) == kept[1:]


def _write_tiny_model(path: Path, spec: TinySpec, vocab_model: Path, seed: int) -> Path:
    rng = numpy.random.default_rng(seed)
    tokens, types, merges = _vocab(vocab_model)
    n_vocab = len(tokens)
    w = GGUFWriter(str(path), spec.arch)
    w.add_name(f"tiny {spec.name}")
    w.add_block_count(spec.n_layer)
    w.add_context_length(4096)
    w.add_embedding_length(spec.n_embd)
    w.add_feed_forward_length(spec.n_ff)
    w.add_head_count(spec.n_head)
    w.add_head_count_kv(spec.n_head_kv)
    w.add_key_length(spec.head_dim)
    w.add_value_length(spec.head_dim)
    w.add_rope_dimension_count(spec.head_dim)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0 if spec.arch == "llama" else 1e6)
    if spec.arch == "gemma3":
        w.add_sliding_window(8)  # small, so 40-token prompts cross it
        w.add_sliding_window_pattern(2)  # layers 1 and 3 global
        w.add_rope_freq_base_swa(10000.0)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)

    def matrix(name: str, rows: int, cols: int, qtype: T, std: float) -> None:
        data, raw = _matrix(rng, rows, cols, qtype, std)
        w.add_tensor(name, data, raw_dtype=raw)

    def vector(name: str, values: numpy.ndarray) -> None:
        w.add_tensor(name, values.astype(numpy.float32))

    # Embedding rows at 0.25 and an output norm of 2 give logits with a std near 8.
    matrix("token_embd.weight", n_vocab, spec.n_embd, spec.wtype, 0.25)
    vector("output_norm.weight", numpy.full(spec.n_embd, 2.0))
    if not spec.tied:
        matrix("output.weight", n_vocab, spec.n_embd, spec.out_type or spec.wtype, 0.25)
    if spec.llama3_rope:
        vector("rope_freqs.weight", numpy.linspace(1.0, 8.0, spec.head_dim // 2))
    nq, nkv = spec.n_head * spec.head_dim, spec.n_head_kv * spec.head_dim
    for il in range(spec.n_layer):
        p = f"blk.{il}."
        norm = lambda: 1.0 + 0.1 * rng.standard_normal(spec.n_embd)  # noqa: E731
        vector(p + "attn_norm.weight", norm())
        vector(p + "ffn_norm.weight", norm())
        matrix(p + "attn_q.weight", nq, spec.n_embd, spec.wtype, spec.n_embd**-0.5)
        matrix(p + "attn_k.weight", nkv, spec.n_embd, spec.wtype, spec.n_embd**-0.5)
        matrix(p + "attn_v.weight", nkv, spec.n_embd, spec.wtype, spec.n_embd**-0.5)
        matrix(p + "attn_output.weight", spec.n_embd, nq, spec.wtype, nq**-0.5)
        matrix(p + "ffn_gate.weight", spec.n_ff, spec.n_embd, spec.wtype, spec.n_embd**-0.5)
        matrix(p + "ffn_up.weight", spec.n_ff, spec.n_embd, spec.wtype, spec.n_embd**-0.5)
        matrix(p + "ffn_down.weight", spec.n_embd, spec.n_ff, spec.wtype, spec.n_ff**-0.5)
        if spec.arch == "qwen2":
            for part, width in (("q", nq), ("k", nkv), ("v", nkv)):
                vector(p + f"attn_{part}.bias", 0.1 * rng.standard_normal(width))
        if spec.arch in ("qwen3", "gemma3"):
            vector(p + "attn_q_norm.weight", 1.0 + 0.1 * rng.standard_normal(spec.head_dim))
            vector(p + "attn_k_norm.weight", 1.0 + 0.1 * rng.standard_normal(spec.head_dim))
        if spec.arch == "gemma3":
            vector(p + "post_attention_norm.weight", norm())
            vector(p + "post_ffw_norm.weight", norm())
    if spec.rank_labels:
        w.add_pooling_type(PoolingType.RANK)
        w.add_classifier_output_labels(list(spec.rank_labels))
        w.add_chat_template([{"name": "rerank", "template": RERANK_TEMPLATE}])
        head = rng.standard_normal((len(spec.rank_labels), spec.n_embd)) * spec.n_embd**-0.5
        vector("cls.output.weight", head)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
