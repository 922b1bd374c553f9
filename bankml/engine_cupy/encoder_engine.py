"""A BERT GGUF served as llama-server serves an encoder-only model: ``EncoderEngine`` is the
``Engine`` (its tokenizer, chat template, request parsing, slots and limits, unchanged) over an
``Encoder`` in place of a decoder.

What llama-server build 11434 does with such a model, and so this engine:

* embeddings (``--embeddings``): each input's hidden states are the encoder's
  (``Encoder.hidden_states``: llama.cpp's ``t_embd``, bit for bit), tokenized by the GGUF's
  WordPiece tokenizer with [CLS] and [SEP] added, pooled as the GGUF's ``bert.pooling_type``
  unless ``--pooling`` says otherwise; with several slots a request's inputs that
  llama-server evaluates in one micro-batch of 64 tokens or more are evaluated together, in
  its slot order (``EncoderModel.hidden_states_together``, Engine.evaluated_together);
* a completion or a chat (any prompt that is not empty): its context has no memory, so no
  logits; llama-server parses the body as usual (its 400s first), then its slot refuses the
  task with a 500 ``server_error`` "the current context does not support logits computation.
  skipping" (server-context.cpp). An empty prompt is answered, empty, as for any model;
* llama-server sets ``n_batch = n_ubatch`` with ``--embeddings``; both stay at 512 here, the
  micro-batch an input must fit;
* a slot's context is capped at the model's training context (``n_ctx_slot``: -c 512 on a
  model of 128 positions gives slots of 128), so an input past it is llama-server's 400
  ``exceed_context_size_error``, never computed;
* without ``--embeddings`` (and without a ``--pooling`` other than none) its context may output
  one row per slot (``server_output_limits``: -np times one plus the drafts), yet an encoder
  outputs every row, and its warm-up evaluates BOS and EOS: with one slot it aborts at startup
  (``GGML_ASSERT(n_outputs_max <= cparams.n_outputs_max)``). ``check_outputs`` refuses to
  start there; with more slots it serves, its embedding routes refused with the 501.

The model object the Engine holds (``EncoderModel``) has no KV cache: its slots' caches are
empty placeholders that only count nothing.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy

from bankml.engine_cupy.chat_template import ChatTemplate
from bankml.engine_cupy.encoder import Encoder
from bankml.engine_cupy.engine import (
    DEFAULT_SLOT_PROMPT_SIMILARITY,
    Engine,
    _gguf_sampling_defaults,
    slot_context,
)
from bankml.engine_cupy.gguf_file import read_metadata
from bankml.engine_cupy.kernels import jit
from bankml.engine_cupy.request import Request, RequestError
from bankml.engine_cupy.weights import UnsupportedModel

NO_LOGITS = "the current context does not support logits computation. skipping"


def is_encoder(path: str | os.PathLike[str]) -> bool:
    """Whether the GGUF at ``path`` is an encoder-only model (``general.architecture`` bert)."""
    arch = read_metadata(os.fspath(path), ["general.architecture"]).get("general.architecture")
    return arch == "bert"


@dataclass
class EncoderHparams:
    """What /v1/models and /props read of a model's hyperparameters."""

    n_embd: int
    n_ctx_train: int
    swa_window: int = 0


class NoCache:
    """A slot's cache for a model that keeps none (llama-server's memory-less context)."""

    cache_type = "f16"
    n_tokens = 0

    def truncate(self, n: int) -> None:
        return None


class EncoderModel:
    """The model surface ``Engine`` reads, over an ``Encoder``."""

    has_sliding_window = False
    follows_micro_batches = True  # hidden_states_together: Encoder.hidden_states_batch

    def __init__(self, encoder: Encoder) -> None:
        self.encoder = encoder
        self.reader = encoder._reader
        self.n_vocab = encoder.tokenizer.n_vocab
        self.pooling_type = encoder.pooling_type
        self.hp = EncoderHparams(encoder.n_embd, encoder.n_ctx_train)

    def new_cache(self, n_ctx: int, cache_type: str | None = None) -> NoCache:
        return NoCache()

    def hidden_states(self, tokens: Sequence[int], cache: Any, n_ubatch: int) -> numpy.ndarray:
        """The input alone in one micro-batch (an embedding input must fit one)."""
        return self.encoder.hidden_states(tokens)

    def hidden_states_batch(
        self, inputs: Sequence[Sequence[int]], caches: Sequence[Any], n_ubatch: int
    ) -> list[numpy.ndarray]:
        """Each input alone in its micro-batch, computed together where the products allow
        (``Encoder.hidden_states_each``): the same bits as ``hidden_states`` of each."""
        return self.encoder.hidden_states_each(inputs)

    def hidden_states_together(
        self,
        inputs: Sequence[Sequence[int]],
        kv_size: int = 0,
        cache_type: str | None = None,
        caches: Sequence[Any] = (),
        placed: Any = None,
    ) -> list[numpy.ndarray]:
        """The inputs in one micro-batch, in that order, as llama-server's slots evaluate them
        (``Encoder.hidden_states_batch``: the attention's tiles over the whole batch; no
        cache, so ``kv_size``, ``cache_type``, ``caches`` and ``placed`` say nothing)."""
        return self.encoder.hidden_states_batch(inputs)


class EncoderEngine(Engine):
    """The Engine over an encoder: embeddings computed, generation refused (module doc)."""

    @classmethod
    def open(
        cls,
        path: str | os.PathLike[str],
        n_ctx: int = 4096,
        device: str = "auto",
        cache_type: str | None = None,
        cache_ram: int | str | None = None,
        n_slots: int = 1,
        kv_unified: bool = False,
        slot_prompt_similarity: float = DEFAULT_SLOT_PROMPT_SIMILARITY,
    ) -> EncoderEngine:
        """The encoder on ``path``, computed on the CPU whatever ``device`` says."""
        jit.start_worker_threads()  # as Model.load: the loading thread runs the engine
        encoder = Encoder(path)
        model = EncoderModel(encoder)
        tokenizer = encoder.tokenizer
        template = ChatTemplate.from_gguf(encoder._reader, tokenizer)
        # llama-server's n_ctx_slot(): the slot's context capped at the training context (an
        # encoder has no positions past it)
        n_ctx = min(slot_context(n_ctx, n_slots, kv_unified), encoder.n_ctx_train)
        return cls(
            model,
            tokenizer,
            template,
            n_ctx,
            cache_type,
            _gguf_sampling_defaults(encoder._reader),
            cache_ram,
            n_slots,
            slot_prompt_similarity,
            kv_unified=kv_unified,
        )

    @property
    def shares_micro_batch(self) -> bool:
        """An encoder evaluates a batch in one micro-batch, with or without ``-kvu``."""
        return True

    def cells_known(self, n_tokens: int, all_idle: bool) -> bool:
        """An encoder keeps no cache: its micro-batch is the batch's rows alone, whatever the
        other slots hold."""
        return True

    def check_outputs(self, n_outputs_max: int) -> None:
        """Refuse to serve where llama-server's warm-up aborts (module doc): its batch (BOS and
        EOS, else one token) has more rows than the context may output."""
        bos, eos = self.tokenizer.bos_id, self.tokenizer.eos_id
        n_warm_up = max(1, (bos is not None) + (eos is not None))
        if n_warm_up > n_outputs_max:
            raise UnsupportedModel(
                f"an encoder outputs every token, {n_warm_up} in llama-server's warm-up, and "
                f"its context outputs {n_outputs_max} rows: llama-server aborts at startup "
                "(GGML_ASSERT n_outputs_max); serve it with --embeddings (or -np 2 or more)"
            )

    def warm_up(self, report: Callable[[str], None] | None = None, jobs: int | None = None) -> Any:
        """The encoder runs numpy and ggml's exact kernels: one short input computed once (no
        kernel to compile: ``report`` and ``jobs`` say nothing)."""
        self.model.hidden_states([0], None, self.n_ubatch)
        return None

    def parse_batch(self, request: Mapping[str, Any], kind: str) -> list[Request]:
        """The body read as for any model, then llama-server's slot refusal of a prompt that
        needs logits (module doc)."""
        requests = super().parse_batch(request, kind)
        if any(r.prompt_tokens for r in requests):
            refused = RequestError(
                NO_LOGITS,
                500,
                {"error": {"code": 500, "message": NO_LOGITS, "type": "server_error"}},
            )
            refused.refused = list(requests)  # tasks llama-server starts, then refuses
            raise refused
        return requests
