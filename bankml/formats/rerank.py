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
cut to ``top_n``. llama-server sorts with libstdc++'s ``std::sort``, which bankml follows step
for step (receipts/rerank.py's ``ranked``), so equal scores come in llama-server's order too.
Two forms, as llama-server writes them:

- Jina's (``documents``): ``{"model", "object": "list", "usage": {"prompt_tokens",
  "total_tokens"}, "results": [{"index", "relevance_score"}, ...]}``; ``model`` is the body's
  string, else the model's name; the tokens are every pair's;
- TEI's (a body with ``texts``, whatever else it has): the bare array ``[{"index", "score"},
  ...]``, each result with ``"text"`` (its document) where the body's ``return_text`` is true.
  bankml puts the receipt in the first result (receipts/rerank.py).

bankml's own refusals, where llama-server answers without a receipt's place or fails:

- a negative ``top_n``: llama-server's resize to it fails with a 500; bankml answers 400;
- ``top_n`` 0 in the TEI form: its answer is an empty array, with no result to carry the
  receipt: 501 ``not_supported_error``.

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
NEGATIVE_TOP_N = '"top_n" must not be negative'
EMPTY_TEI = (
    'bankml does not answer "top_n" 0 in the TEI form (a body with "texts"): its empty array '
    "has no result to carry the receipt"
)


@dataclass(frozen=True)
class RerankRequest:
    """What llama-server reads of a rerank body."""

    query: str
    documents: list[str]
    top_n: int
    tei: bool = False  # the TEI form: a body with "texts"
    return_text: bool = False  # TEI's return_text: each result with its document


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
    tei = "texts" in body
    if top_n < 0:
        raise ApiError.of(400, NEGATIVE_TOP_N)
    if tei and top_n == 0:
        raise ApiError.of(501, EMPTY_TEI, "not_supported_error")
    return_text = tei and body.get("return_text") is True  # json_value: a boolean, else false
    return RerankRequest(query, documents, top_n, tei, return_text)


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


def tei_results(
    results: Sequence[tuple[int, float]], documents: Sequence[str], return_text: bool
) -> list[dict[str, Any]]:
    """format_response_rerank's TEI form: the bare array of results."""
    out: list[dict[str, Any]] = []
    for i, score in results:
        result: dict[str, Any] = {"index": i, "score": c_float(score)}
        if return_text:
            result["text"] = documents[i]
        out.append(result)
    return out


def model_name(body: dict[str, Any], default: str) -> str:
    """``json_value(request, "model", model_name)``: the body's string, else the name."""
    model = body.get("model")
    return model if isinstance(model, str) else default
