"""Rerank requests and answers as llama-server (build 11434) reads and writes them
(``post_rerank`` in tools/server/server-context.cpp, ``format_response_rerank`` in
server-common.cpp), on ``POST /rerank``, ``/reranking``, ``/v1/rerank``, ``/v1/reranking``.

Its checks, in its order:

- a server not started with ``--rerank`` (``--embeddings`` with ``--pooling rank``): 501
  ``not_supported_error``;
- ``query`` absent, or present and not a string (null included): 400;
- ``documents`` read as llama-server's ``json_value``: an array of strings, else (absent, null,
  another type, an element that is not a string) the same reading of ``texts``, else nothing;
  nothing is its 400 "must be a non-empty string array";
- ``top_n``: a number (a double truncated, a boolean 0 or 1), else the number of documents.

The answer: each document's score (its float32 as a double), sorted by score, highest first,
cut to ``top_n``, as ``{"model", "object": "list", "usage": {"prompt_tokens", "total_tokens"},
"results": [{"index", "relevance_score"}, ...]}``; ``model`` is the body's string, else the
model's name; the tokens are every pair's. llama-server sorts with libstdc++'s ``std::sort``,
which bankml follows step for step (receipts/rerank.py's ``ranked``), so equal scores come in
llama-server's order too.

bankml's own refusals, where llama-server answers without a receipt's place or fails:

- a body with ``texts`` (the TEI form): llama-server answers a bare array, where no receipt
  fits; 501 ``not_supported_error``;
- a negative ``top_n``: llama-server's resize to it fails with a 500; bankml answers 400.

Pure data: scores come in as floats, no NumPy here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from bankml.formats.errors import ApiError
from bankml.formats.nlohmann import c_float
from bankml.receipts.rerank import documents_of, top_n_of

NOT_SUPPORTED = "This server does not support reranking. Start it with `--reranking`"
QUERY_NOT_STRING = '"query" must be a string'
NO_QUERY = '"query" must be provided'
NO_DOCUMENTS = '"documents" must be a non-empty string array'
TEI_FORM = (
    'bankml does not answer the TEI form of rerank (a body with "texts"): its answer is a bare '
    'array, where no receipt fits; send the documents as "documents"'
)
NEGATIVE_TOP_N = '"top_n" must not be negative'


@dataclass(frozen=True)
class RerankRequest:
    """What llama-server reads of a rerank body."""

    query: str
    documents: list[str]
    top_n: int


def read_request(body: dict[str, Any], *, enabled: bool) -> RerankRequest:
    """llama-server's reading of a rerank body, its refusals in its order (ApiError), then
    bankml's own (the module doc)."""
    if not enabled:
        raise ApiError.of(501, NOT_SUPPORTED, "not_supported_error")
    if "query" not in body:
        raise ApiError.of(400, NO_QUERY)
    query = body["query"]
    if not isinstance(query, str):
        raise ApiError.of(400, QUERY_NOT_STRING)
    documents = documents_of(body)
    if not documents:
        raise ApiError.of(400, NO_DOCUMENTS)
    top_n = top_n_of(body, len(documents))
    if "texts" in body:
        raise ApiError.of(501, TEI_FORM, "not_supported_error")
    if top_n < 0:
        raise ApiError.of(400, NEGATIVE_TOP_N)
    return RerankRequest(query, documents, top_n)


def rerank_object(
    model: str, results: Sequence[tuple[int, float]], n_tokens: int
) -> dict[str, Any]:
    """format_response_rerank's Jina form: the results as receipts.rerank's ``ranked`` gives
    them."""
    return {
        "model": model,
        "object": "list",
        "usage": {"prompt_tokens": int(n_tokens), "total_tokens": int(n_tokens)},
        "results": [{"index": i, "relevance_score": c_float(score)} for i, score in results],
    }


def model_name(body: dict[str, Any], default: str) -> str:
    """``json_value(request, "model", model_name)``: the body's string, else the name."""
    model = body.get("model")
    return model if isinstance(model, str) else default
