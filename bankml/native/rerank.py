"""Rerank on the native engine: llama-server's ``--rerank`` (``--reranking``; or
``--embeddings --pooling rank``) over a resident BERT reranker (a BERT GGUF with a classifier
head, served as an EncoderEngine).

``Reranker(native, enabled)`` does the work in three steps, each on its thread, as
native/embed.py's Embedder does:

1. ``parse`` (the bridge's prepare thread): the body read as llama-server reads it
   (formats/rerank.py), each document paired with the query as its ``format_prompt_rerank``
   pairs them (``Encoder.rerank_tokens``), each pair's limits checked as an embedding input's
   (one micro-batch, the slot's context: ``embed.check_limits``), before anything is computed;
2. ``compute`` (the engine thread, ``bridge.call``: in turn with the runs): each pair alone in
   its micro-batch, one after the other (llama-server with one slot), its score the
   classifier's first value (``Encoder.rank_score``: llama-server's bits);
3. the answer (the reactor thread): the scores ranked and cut to ``top_n``, the body
   (formats/rerank.py: Jina's object, or TEI's array for a body with ``texts``) and its
   receipt (receipts/rerank.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from bankml.formats import rerank as fmt
from bankml.formats.errors import ApiError
from bankml.native.embed import check_limits
from bankml.receipts.embedding import GroupCells, group_cells, lengths_of, native_issuer
from bankml.receipts.kinds import RERANK
from bankml.receipts.rerank import ranked, rerank_receipt
from bankml.receipts.vouch import identity_problem

NOT_A_RERANKER = (
    "bankml reranks with a BERT reranker (a BERT GGUF with a classifier head) or a qwen3 "
    "reranker (cls.output)"
)


def ranker_of(engine: Any) -> Any:
    """What scores a pair on ``engine``: a BERT's ``Encoder`` (its classifier), a decoder's
    ``RankHead`` (set by open_served with --rerank; found here for an engine opened again after
    an unload), else None. Each gives ``rerank_tokens``, ``rank_score`` and ``rank_score_each``."""
    encoder = getattr(getattr(engine, "model", None), "encoder", None)
    if encoder is not None:
        return encoder
    if getattr(engine, "rank_head", None) is None and engine is not None:
        from bankml.engine_cupy.rank_head import rank_head

        try:
            engine.rank_head = rank_head(engine)
        except ValueError:  # UnsupportedModel: a head llama.cpp would not load
            return None
    return getattr(engine, "rank_head", None)


@dataclass
class RerankJob:
    """One request, parsed: its pairs, and what the answer needs."""

    raw: bytes
    started: float  # time.monotonic() when the request came
    pairs: list[list[int]]
    model: str
    request: fmt.RerankRequest  # the query, the documents, top_n, the form
    scores: list[float] = field(default_factory=list)
    seconds: float = 0.0  # the scoring's time (/metrics' prompt seconds)
    choice: Any = None  # with several models: the model the body chose (the host's Choice)
    issuer: Any = None  # who scored it (the model that computed the scores)
    # -np N: the pairs llama-server's slots evaluate in one micro-batch, each group in its
    # order (Engine.evaluated_together), which the receipt records for its replay
    evaluated_together: list[list[int]] = field(default_factory=list)
    evaluated_cells: list[GroupCells] = field(default_factory=list)  # where not from cell 0


class Reranker:
    """Rerank over a NativeEngine (see the module doc); ``enabled``: served with --rerank."""

    def __init__(self, native: Any, enabled: bool) -> None:
        self.native = native
        self.enabled = enabled

    # --- the prepare thread ----------------------------------------------------------------

    def parse(self, body: dict[str, Any], raw: bytes, started: float) -> RerankJob:
        """llama-server's /rerank body, its refusals in its order. With several models
        (``NativeEngine.select`` set) the body's ``model`` then chooses the model as a chat's
        does (made resident, verified again when loaded; unknown: the chat's 404); a model
        that does not rank is the 501 below."""
        choice = None
        if self.native.select is None:
            self.native._awake()
        req = fmt.read_request(body, enabled=self.enabled)
        if self.native.select is not None:
            choice = self.native.select(body, None)
        engine = self.native.engine if choice is None else choice[1]
        ranker = ranker_of(engine)
        if ranker is None:  # open_served refuses --rerank on another startup model
            raise ApiError.of(501, NOT_A_RERANKER, "not_supported_error")
        pairs = [ranker.rerank_tokens(req.query, d) for d in req.documents]
        # a causal reranker reads its last token: its input may span micro-batches (llama-server's
        # can_split), as pooling last
        pooling = "rank" if ranker is getattr(engine.model, "encoder", None) else "last"
        for tokens in pairs:
            check_limits(self.native, len(tokens), pooling, None if choice is None else engine)
        model = fmt.model_name(body, self.native.model_id)
        job = RerankJob(raw, started, pairs, model, req)
        job.choice = None if choice is None else choice[0]
        return job

    # --- the engine thread -----------------------------------------------------------------

    def compute(self, job: RerankJob) -> RerankJob:
        """Every pair's score: the pairs on the slots as llama-server's tasks take them, the
        pairs of a micro-batch evaluated and their head applied together where bankml follows
        it (Engine.evaluated_together), the others each alone (``rank_score_batches``)."""
        held, release = None, None
        if job.choice is not None and self.native.hold is not None:
            # the chosen model (loaded and verified again if it was unloaded meanwhile), held
            held, release = self.native.hold(job.choice)
        else:
            self.native.wake()
        try:
            engine = self.native.engine if held is None else held
            ranker = ranker_of(engine)
            if ranker is None:
                raise ApiError.of(501, NOT_A_RERANKER, "not_supported_error")
            began = time.perf_counter()
            all_idle = engine.free_slots() == engine.n_slots
            plan = engine.embedding_batches(job.pairs)  # the slots, as llama-server's
            lengths = lengths_of(job.pairs)
            job.evaluated_together = engine.evaluated_together(
                plan.batches, lengths, all_idle, plan
            )
            job.evaluated_cells = group_cells(engine, job.evaluated_together, plan, lengths)
            job.scores = ranker.rank_score_batches(job.pairs, job.evaluated_together, plan)
            job.seconds = time.perf_counter() - began
            job.issuer = native_issuer(self.native)  # swapped to the chosen model by hold
        finally:
            if release is not None:  # the chosen model's keep-alive starts again
                release()
        if release is None and self.native.used is not None:
            self.native.used()  # the resident model's keep-alive starts again
        return job

    # --- the reactor thread ----------------------------------------------------------------

    def job_problem(self, job: RerankJob) -> str | None:
        """None while the file of the model that scored ``job`` is the one that was hashed."""
        if job.issuer is None:
            return self.native.identity_problem()
        return identity_problem(job.issuer.verified)

    def answer(self, job: RerankJob) -> Any:
        """The answer's JSON value, its receipt in it (see receipts/rerank.py): Jina's object,
        or TEI's array with the receipt in its first result. Its pairs are counted in /metrics
        and /slots as llama-server's tasks (NativeEngine.record_pooled)."""
        self.native.record_pooled(RERANK, [len(t) for t in job.pairs], job.seconds)
        results = ranked(job.scores, job.request.top_n)
        n_tokens = sum(len(t) for t in job.pairs)
        out = rerank_receipt(
            job.issuer or native_issuer(self.native),
            request_body=job.raw,
            started=job.started,
            results=results,
            pairs_tokens=job.pairs,
            evaluated_together=job.evaluated_together,
            evaluated_cells=job.evaluated_cells,
        )
        req = job.request
        if req.tei:  # never empty: top_n 0 is refused in this form
            array = fmt.tei_results(results, req.documents, req.return_text)
            array[0]["bankml_receipt"] = out
            return array
        body = fmt.rerank_object(job.model, results, n_tokens)
        body["bankml_receipt"] = out
        return body
