"""A decoder reranker's head, as llama.cpp build 11434 scores a pair with pooling rank.

Of the decoder architectures bankml serves, only ``qwen3`` loads a rank head
(src/models/qwen3.cpp: ``cls.output.weight``, one row per ``qwen3.classifier.output_labels``;
the Qwen3 reranker's converter takes the output head's rows of ``yes`` and ``no``).
``build_pooling`` (src/llama-graph.cpp) with pooling rank on a causal model:

1. the **last** token's row of ``t_embd`` (the hidden state after the output norm:
   ``llm_graph_input_cls`` picks the last position for rank with causal attention);
2. ``ggml_mul_mat(cls_out, row)`` (no ``cls`` layer, no bias for qwen3), ggml's product for the
   weight's type (engine_cupy's exact matrices);
3. for qwen3, ``ggml_soft_max`` over the labels (``ggml_vec_soft_max_f32``, AVX2): each whole
   group of 8 labels through ``ggml_v_expf`` of ``x - max``, the group's values reduced in
   float as ``((v0+v4)+(v2+v6)) + ((v1+v5)+(v3+v7))`` and added to a double; the last
   ``n % 8`` by the scalar loop, ``expf(x - max)`` (glibc's) each added to the double; each
   value then multiplied by ``(float)(1.0 / sum)``;

and llama-server's score is element 0 (send_rerank: ``embd[0]``). The pair's tokens are
``format_prompt_rerank``'s: the GGUF's ``tokenizer.chat_template.rerank`` with ``{query}`` and
``{document}`` put in, special texts parsed, nothing added; without it BOS (when the vocabulary
adds it), the query, EOS, SEP (when added), the document, EOS.

``rank_head(engine)`` gives the head of an opened decoder ``Engine`` (None where the file has
none); ``score(tokens)`` computes one pair alone (``Engine.hidden_states``),
``rank_score_each(pairs)`` several, each the same bits (``Engine.hidden_states_batch``);
``rank_score_batches(pairs, batches)`` as llama-server's slots score them with ``-np N``
(a micro-batch's pairs evaluated together, the head over their rows in one product).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy

from bankml.engine_cupy.kernels.exact_ops import expf, ggml_v_expf
from bankml.engine_cupy.weights import UnsupportedModel, exact_matrix_of

F32 = numpy.float32

HEAD = "cls.output.weight"
RANK_ARCHS = ("qwen3",)  # the decoders whose graph loads cls.output (and soft-maxes it)


def _field(reader: Any, key: str) -> Any:
    field = reader.fields.get(key)
    return None if field is None else field.contents()


class RankHead:
    """A causal reranker's head over an opened decoder engine (see the module doc)."""

    def __init__(self, engine: Any, weight: Any, n_labels: int) -> None:
        self.engine = engine
        self.weight = weight  # exact matrix [n_labels, n_embd]
        self.n_labels = n_labels
        reader = engine.model.reader
        self.template = _field(reader, "tokenizer.chat_template.rerank")
        add_sep = _field(reader, "tokenizer.ggml.add_sep_token")
        self.add_sep = bool(add_sep) if add_sep is not None else False

    def rerank_tokens(self, query: str, document: str) -> list[int]:
        """format_prompt_rerank's ids for the pair (see the module doc)."""
        tok = self.engine.tokenizer
        if self.template is not None:
            prompt = str(self.template).replace("{query}", query).replace("{document}", document)
            return list(tok.tokenize(prompt, add_special=False, parse_special=True))
        eos = tok.special.get("eos")
        if eos is None:
            eos = tok.special.get("sep")
        out: list[int] = []
        if tok.add_bos and tok.special.get("bos") is not None:
            out.append(int(tok.special["bos"]))
        out += tok.tokenize(query, add_special=False, parse_special=False)
        if tok.add_eos and eos is not None:
            out.append(int(eos))
        if self.add_sep and tok.special.get("sep") is not None:
            out.append(int(tok.special["sep"]))
        out += tok.tokenize(document, add_special=False, parse_special=False)
        if tok.add_eos and eos is not None:
            out.append(int(eos))
        return out

    def scores(self, tokens: Sequence[int]) -> numpy.ndarray:
        """The head's output for one pair alone: the labels' soft-maxed values, float32."""
        return self._head(self.engine.hidden_states(tokens))

    def _head(self, hidden: numpy.ndarray) -> numpy.ndarray:
        """The last row of one pair's hidden states through the head (one row, as alone)."""
        row = numpy.ascontiguousarray(hidden[-1:], dtype=F32)
        logits = numpy.asarray(self.weight.matmul(row), dtype=F32).reshape(-1)
        return soft_max(logits)

    def rank_score_each(self, pairs: Sequence[Sequence[int]]) -> list[float]:
        """``rank_score`` of each pair, bit for bit: the pairs' hidden states through the
        engine's ``hidden_states_batch`` (shared passes where the model allows), the head on
        each pair's last row alone."""
        return [float(self._head(h)[0]) for h in self.engine.hidden_states_batch(pairs)]

    def rank_score_batches(
        self,
        pairs: Sequence[Sequence[int]],
        batches: Sequence[Sequence[int]] = (),
        plan: Any = None,
    ) -> list[float]:
        """``rank_score`` of each pair, except the ``batches`` (groups of the pairs, each in its
        micro-batch's order: Engine.evaluated_together), each evaluated as that micro-batch
        (Engine.compute_hidden_states) with the head over their last rows in one product,
        in that order, each row soft-maxed. The slots are the caller's to take (``plan``:
        Engine.embedding_batches', where the pairs' cells go after)."""
        states = self.engine.compute_hidden_states(pairs, batches, plan)
        scores: list[float | None] = [None] * len(pairs)
        for batch in batches:
            rows = numpy.ascontiguousarray(numpy.stack([states[i][-1] for i in batch]), F32)
            logits = numpy.asarray(self.weight.matmul(rows), dtype=F32)
            for i, row in zip(batch, logits, strict=True):
                scores[i] = float(soft_max(row)[0])
        return [
            float(self._head(states[i])[0]) if score is None else score
            for i, score in enumerate(scores)
        ]

    def rank_score(self, tokens: Sequence[int]) -> float:
        """llama-server's /rerank score of the pair: the first label's value."""
        return float(self.scores(tokens)[0])


def soft_max(x: numpy.ndarray) -> numpy.ndarray:
    """ggml_soft_max of one row, scale 1, no mask (module doc)."""
    x = numpy.asarray(x, dtype=F32).reshape(-1)
    top = F32(max(float(v) for v in x))
    y = numpy.empty_like(x)
    total = 0.0
    whole = x.size - x.size % 8
    for i in range(0, whole, 8):  # ggml_v_expf over eight lanes, reduced as the SSE adds
        v = [F32(ggml_v_expf(F32(x[i + k] - top))) for k in range(8)]
        y[i : i + 8] = v
        total += float(((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7])))
    if whole < x.size:  # the scalar tail: glibc's expf, each added in double
        y[whole:] = expf(x[whole:] - top)
        for v in y[whole:].tolist():
            total += v
    return (y * F32(1.0 / total)).astype(F32)


def rank_head(engine: Any) -> RankHead | None:
    """The rank head of an opened decoder engine; None where its file has no ``cls.output``.
    A head llama.cpp would not load (another architecture) or of an unplayable type refuses."""
    model = getattr(engine, "model", None)
    reader = getattr(model, "reader", None)
    if reader is None:
        return None
    infos = {t.name: t for t in reader.tensors}
    info = infos.get(HEAD)
    if info is None:
        return None
    arch = _field(reader, "general.architecture")
    if arch not in RANK_ARCHS:
        raise UnsupportedModel(f"{HEAD} on {arch}: llama.cpp loads a rank head on qwen3 only")
    labels = _field(reader, f"{arch}.classifier.output_labels") or []
    n_embd, n_out = (int(d) for d in info.shape)
    if n_out != len(labels):
        raise UnsupportedModel(f"{HEAD}: {n_out} rows, {len(labels)} classifier labels")
    weight = exact_matrix_of(info)
    return RankHead(engine, weight, n_out)
