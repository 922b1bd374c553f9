"""BERT, the encoder llama.cpp build 11434 runs as ``LLM_ARCH_BERT``, computed as llama-server
computes it on the CPU: ``Encoder.hidden_states(tokens)`` is llama.cpp's ``t_embd`` bit for bit.

The graph is llama.cpp's (src/models/bert.cpp, llm_graph_context::build_attn with no KV cache):

* the input: the token embedding rows (``get_rows``: F16 widened, Q8_0 as ``d·q``), plus row 0
  of the token-type embedding (every token is "sentence A"), then the position rows added in
  front (``pos + x``, the same IEEE sum); a LayerNorm with weight and bias;
* each layer: Q, K, V as separate products with their biases; attention over the whole
  sequence (non-causal, no mask hides anything) as llama-server runs it with flash attention
  (``auto`` resolves to on for the CPU): K and V cast to F16, Q in F32, scale
  ``1.0f/sqrtf(head_dim)``, ggml_flash_attn_ext (kernels.exact_attention: its one-chunk
  kernel below 64 tokens, its tiled one from 64); the output product and bias; the layer input
  added back; LayerNorm; the feed-forward (up + bias, GELU, down + bias) added to its input;
  LayerNorm. The last layer's output is ``t_embd``, before any pooling.
* LayerNorm is ``ggml_compute_forward_norm_f32``: the row's sum in double, in order, rounded to
  float and divided by n; the centred values' squares summed eight lanes at a time (AVX2:
  ``(l0+l4)+(l2+l6)`` + ``(l1+l5)+(l3+l7)`` in float), each group added to a double in order,
  divided by n and rounded to float; then ``x·(1.0f/sqrtf(var + eps))``, times the weight,
  plus the bias, each its own f32 operation.
* GELU is ggml's CPU ``ggml_vec_gelu_f32`` with ``GGML_GELU_FP16``: 0 at or below -10, x at or
  above 10, else the f16 table's value at x rounded to f16 (``exact_ops.gelu_f16_table``).
* The products are the weights' own exact kernels (kernels.exact_matmul: F16 and Q8_0, the F32
  and BF16 of those files too).

``hidden_states`` is the sequence alone in its micro-batch; ``hidden_states_batch`` several
sequences sharing one, as llama-server batches its slots' prompts (each sequence masked from the
others, yet the attention's kernel and tiles follow the whole batch, so a text's last bits depend
on what shares its batch).

``rank_scores(tokens)`` is llama.cpp's rank pooling (llama-server ``--rerank``) on a BERT with a
classifier head: the [CLS] row of t_embd through ``cls`` (product, bias, libm's tanhf) and
``cls.output`` (product, bias); ``rank_score`` its first value, /rerank's ``relevance_score``;
``rerank_tokens(query, document)`` the pair as llama-server's format_prompt_rerank builds it.

``tokenize(text)`` is the GGUF's WordPiece tokenizer (engine_cupy.tokenizer) with the special
tokens llama-server adds for embeddings: [CLS] first, [SEP] last, special texts parsed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from collections.abc import Sequence
from typing import Any

import numpy
from gguf import GGMLQuantizationType as T

from bankml.engine_cupy.gguf_file import GGUFFile, open_file
from bankml.engine_cupy.kernels import exact_attention, exact_ops
from bankml.engine_cupy.passes import hidden_passes
from bankml.engine_cupy.tokenizer import Tokenizer
from bankml.engine_cupy.weights import (
    EmbeddingRows,
    UnsupportedModel,
    dequantize,
    exact_family,
    rows_alone,
)

__all__ = ["Encoder", "layer_norm", "gelu"]

F32 = numpy.float32
F64 = numpy.float64
# llama.cpp's classifier head of a BERT (LLM_TENSOR_CLS, LLM_TENSOR_CLS_OUT), run by rank_scores
_CLASSIFIER = ("cls.weight", "cls.bias", "cls.output.weight", "cls.output.bias")

_GELU_TABLE: numpy.ndarray | None = None


def _gelu_table() -> numpy.ndarray:
    global _GELU_TABLE
    if _GELU_TABLE is None:
        _GELU_TABLE = exact_ops.gelu_f16_table()
    return _GELU_TABLE


def gelu(x: numpy.ndarray) -> numpy.ndarray:
    """ggml_vec_gelu_f32 (GGML_GELU_FP16): the f16 table at x rounded to f16, 0 at or below
    -10, x at or above 10."""
    x = numpy.ascontiguousarray(x, dtype=F32)
    with numpy.errstate(over="ignore"):
        bits = x.astype(numpy.float16).view(numpy.uint16)
    out = _gelu_table()[bits]
    out = numpy.where(x <= F32(-10.0), F32(0.0), out)
    return numpy.where(x >= F32(10.0), x, out).astype(F32, copy=False)


def layer_norm(x: numpy.ndarray, weight: numpy.ndarray, bias: numpy.ndarray, eps: float) -> Any:
    """ggml_norm (AVX2 build) of each row, times weight, plus bias: llama.cpp's LLM_NORM."""
    x = numpy.ascontiguousarray(x, dtype=F32)
    n = x.shape[-1]
    # ggml_vec_sum_f32: a double accumulated in order, stored as float
    total = numpy.cumsum(x.astype(F64), axis=-1)[..., -1].astype(F32)
    mean = (total / F32(n)).astype(F32)
    centred = x - mean[..., None]
    sq = centred * centred
    whole = n - n % 8
    groups = sq[..., :whole].reshape(*sq.shape[:-1], whole // 8, 8)
    # _mm256 hi+lo, movehl, add_ss: ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7)), in float
    pairs = groups[..., :4] + groups[..., 4:]
    lane = (pairs[..., 0] + pairs[..., 2]) + (pairs[..., 1] + pairs[..., 3])
    parts = numpy.concatenate([lane, sq[..., whole:]], axis=-1).astype(F64)
    var = (numpy.cumsum(parts, axis=-1)[..., -1] / n).astype(F32)
    scale = F32(1.0) / numpy.sqrt(var + F32(eps))
    y = centred * scale[..., None]
    return (y * weight) + bias


class Encoder:
    """A BERT GGUF (``general.architecture == "bert"``) on the CPU, rounded as llama-server.

    ``hidden_states(tokens)`` → float32 [n_tokens, n_embd], llama.cpp's ``t_embd`` for the
    sequence processed as one batch; ``tokenize(text)`` → the ids llama-server embeds for a
    text; ``n_embd``, ``n_ctx_train``, ``pooling_type`` (``bert.pooling_type``: 0 none, 1 mean,
    2 CLS, 3 last, …; 0 when the file has none) from the GGUF.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        reader = open_file(path)
        arch = _value(reader, "general.architecture")
        if arch != "bert":
            raise UnsupportedModel(f"general.architecture {arch!r} is not an encoder (bert)")
        self.path = os.fspath(path)
        self.n_embd = _int(reader, "bert.embedding_length")
        self.n_layer = _int(reader, "bert.block_count")
        self.n_head = _int(reader, "bert.attention.head_count")
        self.n_ctx_train = _int(reader, "bert.context_length")
        self.n_ff = _int(reader, "bert.feed_forward_length")
        self.eps = float(_value(reader, "bert.attention.layer_norm_epsilon", required=True))
        self.pooling_type = int(_value(reader, "bert.pooling_type") or 0)
        kv = _value(reader, "bert.attention.head_count_kv")
        self.n_head_kv = self.n_head if kv is None else int(kv)
        if self.n_embd % self.n_head or self.n_head % self.n_head_kv:
            raise UnsupportedModel(
                f"{self.n_embd} embedding values do not split into {self.n_head} heads"
            )
        if _value(reader, "bert.attention.causal") not in (None, False):
            raise UnsupportedModel("bert.attention.causal is set: not an encoder")
        self.head_dim = self.n_embd // self.n_head
        infos = {t.name: t for t in reader.tensors}
        self._infos = infos
        for name in infos:
            head = name.split(".")[0] in ("cls", "cls_out", "output", "output_norm")
            if head and name not in _CLASSIFIER:
                raise UnsupportedModel(f"tensor {name}: a classifier or output head is not run")
        if _value(reader, "bert.classifier.pooling_type") not in (None, 2):
            raise UnsupportedModel("bert.classifier.pooling_type: only a CLS classifier is run")
        labels = _value(reader, "bert.classifier.output_labels")
        self.n_cls_out = len(labels) if labels else 1  # llama.cpp's hparams.n_cls_out
        self.token_embd = EmbeddingRows(self._need("token_embd.weight"))
        self.position = self._vector("position_embd.weight").reshape(-1, self.n_embd)
        self.token_type0 = (
            self._vector("token_types.weight")[: self.n_embd]
            if "token_types.weight" in infos
            else None
        )
        self.embd_norm = (
            self._vector("token_embd_norm.weight"),
            self._vector("token_embd_norm.bias"),
        )
        self.layers = [self._layer(il) for il in range(self.n_layer)]
        self.cls = self._head("cls", self.n_embd)
        self.cls_out = self._head("cls.output", self.n_cls_out)
        self.scale = exact_ops.attn_scale(self.head_dim)
        self.tokenizer = Tokenizer.from_gguf(reader)
        if self.tokenizer.model != "bert":
            raise UnsupportedModel(
                f"tokenizer.ggml.model {self.tokenizer.model!r}: BERT needs a WordPiece vocabulary"
            )
        add_sep = _value(reader, "tokenizer.ggml.add_sep_token")
        self.add_sep = True if add_sep is None else bool(add_sep)  # llama-vocab's WPM default
        self.rerank_template = _value(reader, "tokenizer.chat_template.rerank")
        self._reader: GGUFFile | None = reader

    # -- loading -----------------------------------------------------------------------------

    def _need(self, name: str) -> Any:
        info = self._infos.get(name)
        if info is None:
            raise UnsupportedModel(f"tensor {name} is missing")
        return info

    def _vector(self, name: str) -> numpy.ndarray:
        info = self._need(name)
        return numpy.ascontiguousarray(
            dequantize(info.data, info.tensor_type).reshape(-1), dtype=F32
        )

    def _matrix(self, name: str, n_out: int, n_in: int) -> Any:
        info = self._need(name)
        if tuple(int(d) for d in info.shape) != (n_in, n_out):
            raise UnsupportedModel(f"tensor {name}: shape {list(info.shape)}, not {[n_in, n_out]}")
        family = exact_family(info.tensor_type)
        if family is None:
            raise UnsupportedModel(f"tensor {name}: no exact kernel for {T(info.tensor_type).name}")
        repacked = family.repacked_by_llama_server(info.tensor_type, n_out)
        cls = {
            "exact_matmul": "QuantMatrix",
            "exact_kquants": "KQuantMatrix",
            "exact_iquants": "IQuantMatrix",
        }[family.__name__.rsplit(".", 1)[-1]]
        return getattr(family, cls)(info.data, info.tensor_type, n_out, n_in, repacked=repacked)

    def _head(self, name: str, n_out: int) -> tuple[Any, numpy.ndarray | None] | None:
        """A classifier layer (its weight [n_out, n_embd] and bias), None when the file has none."""
        if name + ".weight" not in self._infos:
            if name + ".bias" in self._infos:
                raise UnsupportedModel(f"tensor {name}.bias without {name}.weight")
            return None
        bias = self._vector(name + ".bias") if name + ".bias" in self._infos else None
        if bias is not None and bias.shape != (n_out,):
            raise UnsupportedModel(f"tensor {name}.bias: {bias.size} values, not {n_out}")
        return self._matrix(name + ".weight", n_out, self.n_embd), bias

    def _layer(self, il: int) -> dict[str, Any]:
        p, d, kv, ff = f"blk.{il}.", self.n_embd, self.n_head_kv * self.head_dim, self.n_ff
        return {
            "q": self._matrix(p + "attn_q.weight", d, d),
            "k": self._matrix(p + "attn_k.weight", kv, d),
            "v": self._matrix(p + "attn_v.weight", kv, d),
            "o": self._matrix(p + "attn_output.weight", d, d),
            "up": self._matrix(p + "ffn_up.weight", ff, d),
            "down": self._matrix(p + "ffn_down.weight", d, ff),
            **{
                key: self._vector(p + name) if p + name in self._infos else None
                for key, name in (
                    ("bq", "attn_q.bias"),
                    ("bk", "attn_k.bias"),
                    ("bv", "attn_v.bias"),
                    ("bo", "attn_output.bias"),
                    ("bup", "ffn_up.bias"),
                    ("bdown", "ffn_down.bias"),
                )
            },
            "attn_norm": (
                self._vector(p + "attn_output_norm.weight"),
                self._vector(p + "attn_output_norm.bias"),
            ),
            "out_norm": (
                self._vector(p + "layer_output_norm.weight"),
                self._vector(p + "layer_output_norm.bias"),
            ),
        }

    # -- the contract ------------------------------------------------------------------------

    def tokenize(self, text: str) -> list[int]:
        """The ids llama-server embeds for ``text``: [CLS] … [SEP], special texts parsed."""
        return self.tokenizer.tokenize(text, add_special=True, parse_special=True)

    def rerank_tokens(self, query: str, document: str) -> list[int]:
        """The ids llama-server ranks for a (query, document) pair (format_prompt_rerank): the
        GGUF's rerank template with both put in, special texts parsed; else [CLS] query
        ([EOS] if the vocabulary adds it) [SEP] document ([EOS]), each text without special
        tokens and special texts not parsed (BERT: [CLS] query [SEP] document, no token types)."""
        tok = self.tokenizer
        if self.rerank_template is not None:
            prompt = str(self.rerank_template).replace("{query}", query)
            prompt = prompt.replace("{document}", document)
            return tok.tokenize(prompt, add_special=False, parse_special=True)
        eos = tok.special.get("eos")
        if eos is None:
            eos = tok.special.get("sep")
        out: list[int] = []
        if tok.add_bos and tok.special.get("bos") is not None:
            out.append(int(tok.special["bos"]))  # type: ignore[arg-type]
        out += tok.tokenize(query, add_special=False, parse_special=False)
        if tok.add_eos and eos is not None:
            out.append(int(eos))
        if self.add_sep and tok.special.get("sep") is not None:
            out.append(int(tok.special["sep"]))  # type: ignore[arg-type]
        out += tok.tokenize(document, add_special=False, parse_special=False)
        if tok.add_eos and eos is not None:
            out.append(int(eos))
        return out

    def rank_scores(self, tokens: Sequence[int]) -> numpy.ndarray:
        """llama.cpp's rank pooling (LLAMA_POOLING_TYPE_RANK) of ``tokens`` alone in a batch: the
        [CLS] row of t_embd, through ``cls`` (product, bias, tanh) and ``cls.output`` (product,
        bias) where the file has them: float32 [n_cls_out] (without a classifier, the row)."""
        return self._rank_head(self.hidden_states(tokens)[:1])  # build_inp_cls: position 0

    def _rank_head(self, x: numpy.ndarray) -> numpy.ndarray:
        """The classifier head on one [CLS] row [1, n_embd]: float32 [n_cls_out]."""
        return self._rank_head_rows(x)[0]

    def _rank_head_rows(self, x: numpy.ndarray) -> numpy.ndarray:
        """The classifier head on [CLS] rows [n, n_embd] in one product each, as llama.cpp's
        rank pooling takes a micro-batch's sequences: float32 [n, n_cls_out]."""
        x = numpy.ascontiguousarray(x, dtype=F32)
        if self.cls is not None:
            x = _tanh(_affine(self.cls, x))
        if self.cls_out is not None:
            x = _affine(self.cls_out, x)
        return numpy.ascontiguousarray(x, dtype=F32)

    def rank_score_batches(
        self,
        pairs: Sequence[Sequence[int]],
        batches: Sequence[Sequence[int]] = (),
        plan: Any = None,
    ) -> list[float]:
        """``rank_score`` of each pair, except the ``batches`` (groups of the pairs, each in
        its micro-batch's order: llama-server's slots, Engine.evaluated_together): a batch's
        hidden states as that micro-batch gives them (``hidden_states_batch``: from
        ``FA_TILE_Q`` tokens the attention's tiles run over the whole batch), and the head over
        its [CLS] rows in one product, in that order. An encoder keeps no cache: ``plan``
        (Engine.embedding_batches') says nothing here."""
        scores: list[float | None] = [None] * len(pairs)
        for batch in batches:
            states = self.hidden_states_batch([pairs[i] for i in batch])
            heads = self._rank_head_rows(numpy.stack([rows[0] for rows in states]))
            for i, row in zip(batch, heads, strict=True):
                scores[i] = float(row[0])
        rest = [i for i, score in enumerate(scores) if score is None]
        if rest:
            for i, score in zip(rest, self.rank_score_each([pairs[i] for i in rest])):
                scores[i] = score
        return [float(score) for score in scores if score is not None]

    def rank_score_each(self, pairs: Sequence[Sequence[int]]) -> list[float]:
        """``rank_score`` of each pair, bit for bit: their hidden states computed together
        (``hidden_states_each``), the head applied to each [CLS] row alone (one row, as
        llama-server's pass of the pair alone gives the head)."""
        return [float(self._rank_head(hidden[:1])[0]) for hidden in self.hidden_states_each(pairs)]

    def rank_score(self, tokens: Sequence[int]) -> float:
        """What llama-server's /rerank reports for ``tokens`` (send_rerank: the first class's
        value, not normalised), a float32's value."""
        return float(self.rank_scores(tokens)[0])

    def hidden_states(self, tokens: Sequence[int] | numpy.ndarray) -> numpy.ndarray:
        """llama.cpp's t_embd for ``tokens`` as one sequence alone in one batch: float32
        [n_tokens, n_embd], bit for bit."""
        return self.hidden_states_batch([tokens])[0]

    def hidden_states_batch(
        self, sequences: Sequence[Sequence[int] | numpy.ndarray]
    ) -> list[numpy.ndarray]:
        """llama.cpp's t_embd for several sequences sharing one micro-batch, in that order (as
        llama-server batches the prompts of several slots): each float32 [n_i, n_embd], bit for
        bit. Each sequence has its own positions from 0 and attends to itself only (the mask
        hides the others), yet the attention's tiling runs over the whole batch, so a sequence's
        last bits may differ from ``hidden_states`` of it alone once the batch has 64 tokens."""
        seqs = [numpy.asarray(list(s), dtype=numpy.int64) for s in sequences]
        if not seqs or any(len(s) == 0 for s in seqs):
            raise ValueError("no tokens to encode")
        x = self._input_rows(seqs)
        which = numpy.repeat(numpy.arange(len(seqs)), [len(s) for s in seqs])
        # llm_graph_input_attn_no_cache: 0 within a sequence, -inf across sequences
        mask = numpy.where(which[:, None] == which[None, :], F32(0.0), F32(-numpy.inf))
        for layer in self.layers:
            x = self._layer_forward(layer, x, mask.astype(F32))
        x = numpy.ascontiguousarray(x, dtype=F32)
        bounds = numpy.cumsum([len(s) for s in seqs])[:-1]
        return [numpy.ascontiguousarray(part) for part in numpy.split(x, bounds)]

    def shares_rows(self, min_rows: int) -> bool:
        """Whether every product of the layers multiplies a row of a sequence of at least
        ``min_rows`` tokens as that sequence alone would (weights.rows_alone), so that
        ``hidden_states_each`` may put several sequences' rows in one product."""
        return all(
            rows_alone(layer[name], min_rows)
            for layer in self.layers
            for name in ("q", "k", "v", "o", "up", "down")
        )

    def hidden_states_each(self, sequences: Sequence[Sequence[int]]) -> list[numpy.ndarray]:
        """``hidden_states`` of each sequence alone in its micro-batch, bit for bit, computed
        together: where the products allow it (``shares_rows`` at the shortest sequence's
        length), the sequences of at most ``passes.SHARED_INPUT_ROWS`` tokens as many as fit
        ``passes.SHARED_PASS_ROWS`` rows a pass (a longer one alone), every product multiplies all the pass's rows at once, LayerNorm, GELU and
        the adds are row by row, and the attention is each sequence's own, over its rows alone
        (its own kernel, tiles and mask of zeros, as alone). Otherwise one after the other."""
        seqs = [numpy.asarray(list(s), dtype=numpy.int64) for s in sequences]
        if not seqs or any(len(s) == 0 for s in seqs):
            raise ValueError("no tokens to encode")
        if len(seqs) == 1 or not self.shares_rows(min(len(s) for s in seqs)):
            return [self.hidden_states(s) for s in seqs]
        out: list[Any] = [None] * len(seqs)
        for group in hidden_passes([len(s) for s in seqs], self.n_ctx_train, True):
            for i, rows in zip(group, self._shared_pass([seqs[i] for i in group])):
                out[i] = rows
        return out

    def _shared_pass(self, seqs: list[numpy.ndarray]) -> list[numpy.ndarray]:
        """The sequences' rows through the layers as one pass (``hidden_states_each``)."""
        sizes = [len(s) for s in seqs]
        x = self._input_rows(seqs)
        bounds = numpy.cumsum([0, *sizes])
        parts = [(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]
        masks = {n: numpy.zeros((n, n), F32) for n in set(sizes)}
        for layer in self.layers:
            x = self._layer_forward(layer, x, parts=parts, masks=masks)
        x = numpy.ascontiguousarray(x, dtype=F32)
        return [numpy.ascontiguousarray(x[a:b]) for a, b in parts]

    def _input_rows(self, seqs: list[numpy.ndarray]) -> numpy.ndarray:
        """The first LayerNorm's output for the sequences' tokens side by side, each from
        position 0 (checked: within the position table and the vocabulary)."""
        longest = max(len(s) for s in seqs)
        if longest > self.n_ctx_train:
            raise ValueError(
                f"{longest} tokens: more than the model's {self.n_ctx_train} positions"
            )
        ids = numpy.concatenate(seqs)
        if ids.min() < 0 or ids.max() >= self.tokenizer.n_vocab:
            raise ValueError(f"a token id outside the vocabulary [0, {self.tokenizer.n_vocab})")
        positions = numpy.concatenate([numpy.arange(len(s)) for s in seqs])
        x = self.token_embd[ids]
        if self.token_type0 is not None:
            x = x + self.token_type0
        x = self.position[positions] + x
        return layer_norm(x, *self.embd_norm, self.eps)

    def _layer_forward(
        self,
        layer: dict[str, Any],
        x: numpy.ndarray,
        mask: Any = None,
        parts: list[tuple[int, int]] | None = None,
        masks: dict[int, numpy.ndarray] | None = None,
    ) -> Any:
        """One layer over x's rows: attending under ``mask`` as one batch, or (``parts``:
        row ranges) each part over its own rows alone, under its ``masks`` entry."""
        n, h, hkv, hd = x.shape[0], self.n_head, self.n_head_kv, self.head_dim

        def linear(w: str, b: str, inp: numpy.ndarray) -> numpy.ndarray:
            out = layer[w].matmul(inp)
            return out + layer[b] if layer[b] is not None else out

        q = linear("q", "bq", x).reshape(n, h, hd)
        k = linear("k", "bk", x).reshape(n, hkv, hd).transpose(1, 0, 2)
        v = linear("v", "bv", x).reshape(n, hkv, hd).transpose(1, 0, 2)
        k16 = numpy.ascontiguousarray(k.astype(numpy.float16))  # ggml_cast to F16
        v16 = numpy.ascontiguousarray(v.astype(numpy.float16))
        if parts is None:
            att = exact_attention.flash_attn_f16(q, k16, v16, mask, self.scale, n_kv=n)
        else:
            assert masks is not None
            att = numpy.concatenate(
                [
                    exact_attention.flash_attn_f16(
                        numpy.ascontiguousarray(q[a:b]),
                        numpy.ascontiguousarray(k16[:, a:b]),
                        numpy.ascontiguousarray(v16[:, a:b]),
                        masks[b - a],
                        self.scale,
                        n_kv=b - a,
                    )
                    for a, b in parts
                ]
            )
        cur = linear("o", "bo", att.reshape(n, h * hd))
        weight, bias = layer["attn_norm"]
        cur = layer_norm(cur + x, weight, bias, self.eps)
        ffn_inp = cur
        cur = linear("down", "bdown", gelu(linear("up", "bup", cur)))
        weight, bias = layer["out_norm"]
        return layer_norm(cur + ffn_inp, weight, bias, self.eps)


def _affine(head: tuple[Any, numpy.ndarray | None], x: numpy.ndarray) -> numpy.ndarray:
    """ggml_mul_mat(w, x), then ggml_add of the bias (each an f32 operation)."""
    weight, bias = head
    out = numpy.asarray(weight.matmul(numpy.ascontiguousarray(x, dtype=F32)), dtype=F32)
    return out + bias if bias is not None else out


_TANHF: Any = None


def _tanh(x: numpy.ndarray) -> numpy.ndarray:
    """ggml_vec_tanh_f32: libm's tanhf of each value (numpy's float32 tanh rounds its own way)."""
    global _TANHF
    if _TANHF is None:
        libm = ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6")
        libm.tanhf.restype, libm.tanhf.argtypes = ctypes.c_float, [ctypes.c_float]
        _TANHF = libm.tanhf
    flat = numpy.ascontiguousarray(x, dtype=F32).reshape(-1)
    out = numpy.array([_TANHF(float(v)) for v in flat], dtype=F32)
    return out.reshape(x.shape)


def _value(reader: GGUFFile, key: str, required: bool = False) -> Any:
    field = reader.fields.get(key)
    if field is None:
        if required:
            raise UnsupportedModel(f"the GGUF has no {key}")
        return None
    return field.contents()


def _int(reader: GGUFFile, key: str) -> int:
    value = _value(reader, key, required=True)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise UnsupportedModel(f"{key} {value!r} is not a positive integer")
    return value
