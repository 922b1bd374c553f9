"""Embeddings on the native engine: llama-server's ``--embeddings``, ``--pooling``,
``--embd-normalize``, over the resident model, and Ollama's embed routes, over the model the
request names (made resident first, on the engine thread, where its inputs are tokenized).

``Embedder(native, settings)`` does the work in three steps, each on its thread:

1. ``parse`` (the bridge's prepare thread): the body read as llama-server reads it
   (formats/embeddings.py), each input tokenized as its ``tokenize_input_subprompt``, then its
   limits: an input that must fit one micro-batch (every pooling but ``last``: llama-server
   evaluates it in one ubatch) and does not, or one over the slot's context, is refused with
   llama-server's message, before anything is computed;
2. ``compute`` (the engine thread, ``bridge.call``: in turn with the runs, never beside one):
   every input's hidden states as that input alone gives them (the engine's
   ``hidden_states_batch``, which puts several inputs in one pass where the model's
   products give a row the same bits beside other rows, each input's attention its own; else
   one after the other), pooled and normalised as llama-server does (engine_cupy/pooling.py).
   Each input alone is what llama-server computes with one slot (bankml's default ``-np 1``);
   with several slots llama-server puts a request's inputs together (Engine.embedding_batches
   follows how), and its vectors move (docs/modules/embeddings.md has when and by how much).
   bankml follows it on llama-server's routes where it computes the same: a batch under 64
   tokens in one micro-batch keeps each input's hidden states, only its ``mean`` is pooled by
   the product's lanes over the batch (Engine.pooled_together, pooling.py); from 64 tokens the
   batch is evaluated as one micro-batch in its slots' order where the engine can say which
   cells it takes (Engine.evaluated_together: an encoder; a decoder with -kvu whose slots were
   all idle). Other batches, and Ollama's routes (one input at a time), keep each input's own
   vectors;
3. the answer (the reactor thread): the body (formats/embeddings.py) and its receipt
   (receipts/embedding.py).

The model is read through the contract every embedding model gives: ``hidden_states(tokens)``
(float32 [n_tokens, n_embd]), ``n_embd``, ``pooling_type`` (the GGUF's), and the engine's
``embedding_inputs`` / ``prompt_tokens`` for the tokenization.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from bankml.formats import embeddings as fmt
from bankml.formats.errors import ApiError, refusal_of
from bankml.receipts.embedding import (
    GroupCells,
    Issuer,
    embedding_receipt,
    group_cells,
    lengths_of,
    native_issuer,
)
from bankml.receipts.kinds import LLAMA_EMBEDDING, OAI_EMBEDDINGS, OLLAMA_EMBED, OLLAMA_EMBEDDINGS
from bankml.receipts.vouch import identity_problem

DEFAULT_NORMALIZE = 2  # llama-server's --embd-normalize: euclidean


@dataclass(frozen=True)
class EmbedSettings:
    """llama-server's flags: ``--embeddings`` (``enabled``), ``--pooling`` (None: the
    model's own), ``--embd-normalize``."""

    enabled: bool = False
    pooling: str | None = None
    embd_normalize: int = DEFAULT_NORMALIZE

    @classmethod
    def of(cls, llama: Any) -> EmbedSettings:
        """From serving.llama_flags.native_settings' ``embedding`` entry (absent: off)."""
        given = (llama or {}).get("embedding") or {}
        return cls(
            bool(given.get("enabled", False)),
            given.get("pooling"),
            int(given.get("embd_normalize", DEFAULT_NORMALIZE)),
        )


@dataclass(frozen=True)
class EmbedModel:
    """The model an Ollama embedding names (the host's ``embedding_model``): whether it embeds
    here, ``load`` (engine thread: made resident as for a chat, verified again when it is
    loaded; an OllamaError when refused) and ``after`` (the request's keep-alive applied)."""

    embeds: bool
    load: Callable[[], Any]
    after: Callable[[], None]


@dataclass
class EmbedJob:
    """One request, parsed: what to compute and how to answer it."""

    api: str
    raw: bytes
    started: float  # time.monotonic() when the request came
    tokens: list[list[int]]
    pooling: str
    embd_normalize: int | None  # None: no llama-server normalisation (Ollama's routes)
    oai: bool = False
    base64: bool = False
    model: str = ""
    ollama: Any = None  # formats.embeddings.OllamaEmbedRequest, on /api/embed
    started_ns: int = 0  # time.time_ns() when the request came (Ollama's durations)
    loaded_ns: int = 0  # time.time_ns() when the model was there to compute it
    vectors: list[list[Any]] = field(default_factory=list)  # per input, its vectors
    after: Callable[[], None] | None = None  # on the engine thread after it (Ollama's keep_alive)
    load: Callable[[], Any] | None = None  # Ollama's: the named model made resident first
    texts: list[str] | None = None  # Ollama's inputs, tokenized by that model once resident
    issuer: Issuer | None = None  # who issued the vectors (the model that computed them)
    seconds: float = 0.0  # the computation's time (/metrics' prompt seconds)
    choice: Any = None  # with several models: the model the body chose (the host's Choice)
    # llama-server's routes, -np N: the inputs whose hidden states are computed in one
    # micro-batch, in its order (Engine.evaluated_together), and, mean pooling, those pooled
    # beside each other in one (Engine.pooled_together); the receipt records both for its replay
    evaluated_together: list[list[int]] = field(default_factory=list)
    pooled_together: list[list[int]] = field(default_factory=list)
    # where those sat in the shared cache when not from cell 0 of an empty one (Engine.cells)
    evaluated_cells: list[GroupCells] = field(default_factory=list)


class Embedder:
    """Embeddings over a NativeEngine (see the module doc)."""

    def __init__(
        self,
        native: Any,
        settings: EmbedSettings,
        check_model: Callable[[Any, Any], EmbedModel] | None = None,
    ) -> None:
        self.native = native
        self.settings = settings
        # Ollama's routes: the request's model name and keep_alive checked (the host's
        # ``embedding_model``: an OllamaError for an unknown model; else an EmbedModel)
        self.check_model = check_model

    @property
    def engine(self) -> Any:
        return self.native.engine

    def pooling(self, engine: Any = None) -> str:
        """--pooling, else the model's own (llama.cpp: the GGUF's, ``none`` for a decoder);
        ``engine``: the model's (None: the resident one)."""
        from bankml.engine_cupy.pooling import pooling_name

        if self.settings.pooling is not None:
            return self.settings.pooling
        engine = self.engine if engine is None else engine
        return pooling_name(getattr(engine.model, "pooling_type", 0))

    # --- the prepare thread ----------------------------------------------------------------

    def parse(self, body: dict[str, Any], raw: bytes, oai: bool, started: float) -> EmbedJob:
        """llama-server's /v1/embeddings (``oai``), /embedding and /embeddings body. With
        several models (``NativeEngine.select`` set: ``--max-loaded`` above 1) the body's
        ``model`` chooses the model as a chat's does (made resident first, verified again when
        loaded; unknown: the chat's 404); else the resident model answers (llama-server's
        rule: the field does not choose)."""
        choice = None
        if self.native.select is not None:
            choice = self.native.select(body, None)
        else:
            self.native._awake()
        engine = self.engine if choice is None else choice[1]
        pooling = self.pooling(engine)
        req = fmt.read_request(
            body,
            oai=oai,
            pooling=pooling,
            enabled=self.settings.enabled,
            embd_normalize=self.settings.embd_normalize,
        )
        if pooling == "rank":
            raise ApiError.of(501, fmt.RANK_POOLING, "not_supported_error")
        from bankml.engine_cupy.request import RequestError

        try:
            tokens = engine.embedding_inputs(req.prompt)
        except RequestError as err:
            raise refusal_of(err) from None
        fmt.check_tokens(tokens)
        for toks in tokens:
            check_limits(self.native, len(toks), pooling, engine if choice is not None else None)
        return EmbedJob(
            OAI_EMBEDDINGS if req.oai else LLAMA_EMBEDDING,
            raw,
            started,
            tokens,
            pooling,
            req.embd_normalize,
            oai=req.oai,
            base64=req.base64,
            model=_model_name(body, self.native.model_id) if req.oai else "",
            choice=None if choice is None else choice[0],
        )

    def parse_ollama(
        self, body: dict[str, Any], raw: bytes, legacy: bool, started: float, started_ns: int
    ) -> EmbedJob:
        """Ollama's /api/embed (or, ``legacy``, /api/embeddings): its inputs tokenized, too
        long ones cut to the context as Ollama cuts them (``truncate``, its default) or
        refused with its message. Ollama's runner takes the model's pooling (``last`` where
        the model has none: the last token's hidden state) and no normalisation of
        llama-server's; the route normalises."""
        if legacy:  # Ollama's checks in its order: the body, the model, then the inputs
            name = body.get("model") if isinstance(body.get("model"), str) else ""
            if not name:
                raise fmt.ollama_error(400, "model is required")
            prompt = body.get("prompt", "")
            if not isinstance(prompt, str):
                raise fmt.ollama_error(400, "prompt must be a string")
            texts = [prompt] if prompt else []
            request = None
        else:
            request = fmt.read_ollama_embed(body)
            name, texts = request.model, request.inputs
        named = None
        if self.check_model is not None:
            named = _ollama_refusal(self.check_model, name, body.get("keep_alive"))
        else:
            self.native._awake()
        embeds = named.embeds if named is not None else self.settings.enabled
        if not embeds:  # a model that completes, served without --embeddings
            raise fmt.ollama_error(400, f'"{name}" does not support embeddings')
        return EmbedJob(
            OLLAMA_EMBEDDINGS if legacy else OLLAMA_EMBED,
            raw,
            started,
            [],
            "",
            None,
            model=str(body.get("model") or ""),
            ollama=request,
            started_ns=started_ns,
            after=None if named is None else named.after,
            load=None if named is None else named.load,
            texts=list(texts),
        )

    def _ollama_inputs(self, job: EmbedJob) -> None:
        """On the engine thread, the named model resident: the pooling (the server's
        ``--pooling``, else the model's; ``last`` where that is none) and each input's tokens,
        too long ones cut to the context as Ollama cuts them (``truncate``, its default) or
        refused with its message."""
        pooling = self.pooling()
        if pooling == "rank":
            raise fmt.ollama_error(501, fmt.RANK_POOLING)
        if pooling == "none":
            pooling = "last"
        n_ctx = int(self.engine.n_ctx)
        limit = min(n_ctx, n_ctx if pooling == "last" else int(self.engine.n_ubatch))
        tokens = []
        for text in job.texts or []:
            toks = self._tokens(text)
            if len(toks) > limit:
                if job.ollama is not None and not job.ollama.truncate:
                    raise fmt.ollama_error(400, "the input length exceeds the context length")
                toks = toks[:limit]
            if not toks:
                raise fmt.ollama_error(400, "input after truncation exceeds maximum context length")
            tokens.append(toks)
        job.pooling, job.tokens = pooling, tokens

    def _tokens(self, prompt: Any) -> list[int]:
        from bankml.engine_cupy.request import RequestError

        try:
            return list(self.engine.prompt_tokens(prompt))
        except RequestError as err:
            raise refusal_of(err) from None

    # --- the engine thread -----------------------------------------------------------------

    def compute(self, job: EmbedJob) -> EmbedJob:
        """Every input's vectors, each the input's alone (see the module doc)."""
        from bankml.engine_cupy.pooling import normalize, pool

        release: Callable[[], None] | None = None
        held = None
        if job.load is not None:
            _ollama_refusal(job.load)
        elif job.choice is not None and self.native.hold is not None:
            # the chosen model, made resident again if it was unloaded while this waited
            # (verified again; the same file it was parsed for), held while it computes; the
            # NativeEngine is swapped to it, so the receipt's issuer is it too
            held, release = self.native.hold(job.choice)
        else:
            self.native.wake()
        try:
            job.loaded_ns = time.time_ns()
            if job.texts is not None:
                self._ollama_inputs(job)
            engine = self.engine if held is None else held  # the model made resident
            out = []
            began = time.perf_counter()
            all_idle = engine.free_slots() == engine.n_slots
            # pooling last: llama-server can split such an input (its checkpoints go)
            plan = engine.embedding_batches(job.tokens, splits=job.pooling == "last")
            if job.api in (OAI_EMBEDDINGS, LLAMA_EMBEDDING):
                lengths = lengths_of(job.tokens)
                job.evaluated_together = engine.evaluated_together(
                    plan.batches, lengths, all_idle, plan
                )
                job.evaluated_cells = group_cells(engine, job.evaluated_together, plan, lengths)
                if job.pooling == "mean":
                    job.pooled_together = engine.pooled_together(
                        plan.batches, lengths, all_idle, plan
                    )
            beside = {i for group in job.pooled_together for i in group}
            states = engine.compute_hidden_states(job.tokens, job.evaluated_together, plan)
            for i, hidden in enumerate(states):
                rows = list(pool(hidden, job.pooling, beside_others=i in beside))
                if job.pooling != "none" and job.embd_normalize is not None:
                    rows = [normalize(row, job.embd_normalize) for row in rows]
                out.append(rows)
            job.vectors = out
            job.seconds = time.perf_counter() - began
            # the model that computed them, read on this thread
            job.issuer = native_issuer(self.native)
        finally:
            if release is not None:  # the chosen model's keep-alive starts again
                release()
        if job.after is not None:  # Ollama's routes: the request's keep_alive
            job.after()
        elif release is None and self.native.used is not None:
            self.native.used()  # the resident model's keep-alive starts again
        return job

    # --- the reactor thread ----------------------------------------------------------------

    def job_problem(self, job: EmbedJob) -> str | None:
        """None while the file of the model that computed ``job`` is the one that was hashed."""
        if job.issuer is None:
            return self.native.identity_problem()
        return identity_problem(job.issuer.verified)

    def answer(self, job: EmbedJob) -> Any:
        """The answer's JSON value, its receipt in it (see receipts/embedding.py); its inputs
        counted in /metrics and /slots as llama-server's tasks (NativeEngine.record_pooled)."""
        self.native.record_pooled(job.api, [len(t) for t in job.tokens], job.seconds)
        if job.api == OAI_EMBEDDINGS:
            vectors = [vs[0] for vs in job.vectors]
            body: Any = fmt.oai_object(job.model, vectors, [len(t) for t in job.tokens], job.base64)
            body["bankml_receipt"] = self._receipt(job, vectors, job.tokens)
            return body
        if job.api == LLAMA_EMBEDDING:
            results = fmt.llama_results(job.vectors)
            for result, vs, toks in zip(results, job.vectors, job.tokens):
                result["bankml_receipt"] = self._receipt(job, vs, [toks])
            return results
        if job.api == OLLAMA_EMBEDDINGS:
            vector = fmt.floats(job.vectors[0][0]) if job.vectors else []
            body = {"embedding": vector}
            body["bankml_receipt"] = self._receipt(job, [vector] if job.vectors else [], job.tokens)
            return body
        req = job.ollama
        vectors = []
        for vs in job.vectors:
            vector = fmt.ollama_normalize(fmt.floats(vs[0]))
            if req is not None and 0 < req.dimensions < len(vector):
                vector = fmt.ollama_normalize(vector[: req.dimensions])
            vectors.append(vector)
        now_ns = time.time_ns()
        body = fmt.ollama_embed_object(
            job.model,
            vectors,
            sum(len(t) for t in job.tokens),
            now_ns - job.started_ns,
            max(0, job.loaded_ns - job.started_ns),
        )
        body["bankml_receipt"] = self._receipt(job, vectors, job.tokens)
        return body

    def _receipt(
        self, job: EmbedJob, vectors: Sequence[Any], tokens: Sequence[Sequence[int]]
    ) -> dict[str, Any]:
        return embedding_receipt(
            job.issuer or native_issuer(self.native),
            api=job.api,
            request_body=job.raw,
            started=job.started,
            vectors=[fmt.floats(v) for v in vectors],
            inputs_tokens=tokens,
            pooling=job.pooling,
            embd_normalize=job.embd_normalize,
            evaluated_together=job.evaluated_together,
            pooled_together=job.pooled_together,
            evaluated_cells=job.evaluated_cells,
        )


def _ollama_refusal(call: Callable[..., Any], *args: Any) -> Any:
    """``call(*args)`` with the host's OllamaError made Ollama's refusal (its status, message
    and Retry-After)."""
    try:
        return call(*args)
    except Exception as err:  # the host's OllamaError: its status and message
        status = getattr(err, "status", None)
        if not isinstance(status, int):
            raise
        refused = fmt.ollama_error(status, str(getattr(err, "message", err)))
        refused.retry_after = getattr(err, "retry_after", None)
        raise refused from None


def check_limits(native: Any, n: int, pooling: str, engine: Any = None) -> None:
    """llama-server's checks of one input of ``n`` tokens (an embedding's, a rerank pair's), in
    its order: one micro-batch unless pooled ``last``, then the slot's context (``last``: the
    context less one, as a completion's prompt). ``engine``: the model's (None: the resident
    one's, whose context the NativeEngine holds)."""
    if engine is None:
        n_ctx, n_ubatch = int(native.n_ctx), int(native.engine.n_ubatch)
    else:
        n_ctx, n_ubatch = int(engine.n_ctx), int(engine.n_ubatch)
    if pooling != "last":
        if n > n_ubatch:
            raise fmt.too_large(n, n_ubatch)
        if n > n_ctx:
            raise fmt.over_context(n, n_ctx)
    elif n >= n_ctx:
        message = (
            f"request ({n} tokens) exceeds the available context size ({n_ctx} tokens), "
            "try increasing it"
        )
        raise ApiError(
            400,
            {
                "error": {
                    "code": 400,
                    "message": message,
                    "type": "exceed_context_size_error",
                    "n_prompt_tokens": n,
                    "n_ctx": n_ctx,
                }
            },
        )


def _model_name(body: dict[str, Any], default: str) -> str:
    """llama-server's ``json_value(body, "model", model_name)``: the body's string, else its
    name."""
    model = body.get("model")
    return model if isinstance(model, str) else default
