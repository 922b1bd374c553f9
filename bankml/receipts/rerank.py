"""Receipts of rerank answers: which scores were sent, for which documents, request and model.

A rerank answer (``api`` ``rerank``: llama-server's ``/rerank``, ``/reranking``,
``/v1/rerank``, ``/v1/reranking``) carries no text; its receipt says what it sent in
``rerank_sha256``: the lowercase hex sha256 of its ``results`` in the order the answer lists
them, each result 8 bytes: its ``index`` as an unsigned 32-bit integer, then its
``relevance_score`` as a **float32**, both little-endian. A JSON score is the float32 value
written as a double, so it reads back exactly (read it as a double, round to float32)::

    b"".join(struct.pack("<If", r["index"], r["relevance_score"]) for r in answer["results"])

The order is hashed too (it is the ranking), and so is ``top_n``'s cut (the results that were
left out are not in the hash). ``prompt_tokens`` is the answer's ``usage.prompt_tokens`` (every
pair's tokens); ``inputs_tokens_sha256`` lists, per document in request order, the sha256 of the
pair's token ids as compact JSON (``token_ids_sha256``; null in P0, where llama-server shows no
ids); ``pooling`` is ``rank``; with ``-np N``, ``evaluated_together`` lists the
groups of pairs llama-server's slots score in one micro-batch (document indexes, each in the
micro-batch's order; absent where there is none), so that a replay scores them alike. The other
fields are an embedding receipt's (receipts/embedding.py):
``completion_tokens`` 0, ``response_sha256`` the sha256 of the empty text, ``sampler``
``{"seed": null}``, ``n_predict`` 0, ``finish_reason`` null.

TEI's form (a body with ``texts``) is a bare array of ``{"index", "score"[, "text"]}``: its
first result carries the receipt (receipts/answer.py's ``tei_receipt`` finds it), which hashes
the whole array's ``index`` and ``score`` as above (a ``text`` is the request's document,
covered by ``request_sha256``); it shows no token count.

``ranked`` is llama-server's ranking (libstdc++'s ``std::sort``, ``std_sort``, step for step:
equal scores come in its order); ``documents_of`` and ``top_n_of`` its reading of the body;
``check_results`` is ``bankml check-receipt``'s check of an answer against its receipt;
``replay_rerank`` computes an answer's scores again on bankml's encoder (``--replay``; a P0
answer too).
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from bankml.receipts.digest import sha256_hex
from bankml.receipts.embedding import (
    GroupCells,
    Issuer,
    cells_field,
    input_groups,
    lengths_of,
    placement_plan,
    read_cells_field,
    unsampled_receipt,
)
from bankml.receipts.kinds import RERANK
from bankml.receipts.sign import token_ids_sha256


def documents_of(body: Mapping[str, Any]) -> list[str]:
    """llama-server's ``json_value(body, "documents", json_value(body, "texts", {}))`` as a
    vector of strings: the first of the two that is an array of strings, else none."""
    for key in ("documents", "texts"):
        value = body.get(key)
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return list(value)
    return []


def top_n_of(body: Mapping[str, Any], default: int) -> int:
    """llama-server's ``json_value(body, "top_n", default)``: nlohmann's get<int> of a number
    (an integer wrapped to 32 bits, a double truncated, INT_MIN where it does not fit; a
    boolean 0 or 1), else ``default`` (absent, null, another type)."""
    value = body.get("top_n")
    if isinstance(value, bool) or isinstance(value, int) and -(2**63) <= value < 2**64:
        return (int(value) + 2**31) % 2**32 - 2**31
    if isinstance(value, (int, float)):
        fits = math.isfinite(value) and -(2**31) <= math.trunc(value) < 2**31
        return math.trunc(value) if fits else -(2**31)
    return default


def ranked(scores: Sequence[float], top_n: int) -> list[tuple[int, float]]:
    """(document index, score) sorted by score, highest first, the first ``top_n``: as
    llama-server sorts them (``std::sort`` with ``a > b``, libstdc++'s: ``std_sort``), so equal
    scores come in its order too."""
    pairs = [(i, float(s)) for i, s in enumerate(scores)]
    std_sort(pairs, lambda a, b: a[1] > b[1])
    return pairs[: max(0, top_n)]


_THRESHOLD = 16  # libstdc++'s _S_threshold


def std_sort(items: list[Any], less: Callable[[Any, Any], bool]) -> None:
    """libstdc++'s ``std::sort(first, last, comp)`` in place, step for step (introsort: the
    median of three moved first, the unguarded partition, heapsort past 2·log2(n) levels, then
    the final insertion sort), so that elements ``less`` does not order end where it puts
    them."""
    n = len(items)
    if n > 1:
        _introsort_loop(items, 0, n, 2 * (n.bit_length() - 1), less)
        _final_insertion_sort(items, 0, n, less)


def _introsort_loop(a: list[Any], first: int, last: int, depth: int, less: Any) -> None:
    while last - first > _THRESHOLD:
        if depth == 0:
            _heap_sort(a, first, last, less)
            return
        depth -= 1
        mid = first + (last - first) // 2
        _move_median_to_first(a, first, first + 1, mid, last - 1, less)
        cut = _unguarded_partition(a, first + 1, last, first, less)
        _introsort_loop(a, cut, last, depth, less)
        last = cut


def _move_median_to_first(a: list[Any], result: int, x: int, y: int, z: int, less: Any) -> None:
    if less(a[x], a[y]):
        if less(a[y], a[z]):
            pick = y
        elif less(a[x], a[z]):
            pick = z
        else:
            pick = x
    elif less(a[x], a[z]):
        pick = x
    elif less(a[y], a[z]):
        pick = z
    else:
        pick = y
    a[result], a[pick] = a[pick], a[result]


def _unguarded_partition(a: list[Any], first: int, last: int, pivot: int, less: Any) -> int:
    while True:
        while less(a[first], a[pivot]):
            first += 1
        last -= 1
        while less(a[pivot], a[last]):
            last -= 1
        if not first < last:
            return first
        a[first], a[last] = a[last], a[first]
        first += 1


def _final_insertion_sort(a: list[Any], first: int, last: int, less: Any) -> None:
    if last - first > _THRESHOLD:
        _insertion_sort(a, first, first + _THRESHOLD, less)
        for i in range(first + _THRESHOLD, last):
            _unguarded_linear_insert(a, i, less)
    else:
        _insertion_sort(a, first, last, less)


def _insertion_sort(a: list[Any], first: int, last: int, less: Any) -> None:
    for i in range(first + 1, last):
        if less(a[i], a[first]):
            a[first : i + 1] = [a[i], *a[first:i]]
        else:
            _unguarded_linear_insert(a, i, less)


def _unguarded_linear_insert(a: list[Any], last: int, less: Any) -> None:
    value = a[last]
    while less(value, a[last - 1]):
        a[last] = a[last - 1]
        last -= 1
    a[last] = value


def _heap_sort(a: list[Any], first: int, last: int, less: Any) -> None:
    """``std::__partial_sort(first, last, last)``: make_heap, then sort_heap."""
    n = last - first
    if n >= 2:
        for parent in range((n - 2) // 2, -1, -1):
            _adjust_heap(a, first, parent, n, a[first + parent], less)
    while last - first > 1:
        last -= 1
        value = a[last]
        a[last] = a[first]
        _adjust_heap(a, first, 0, last - first, value, less)


def _adjust_heap(a: list[Any], base: int, hole: int, n: int, value: Any, less: Any) -> None:
    top, child = hole, hole
    while child < (n - 1) // 2:
        child = 2 * (child + 1)
        if less(a[base + child], a[base + child - 1]):
            child -= 1
        a[base + hole] = a[base + child]
        hole = child
    if n % 2 == 0 and child == (n - 2) // 2:
        child = 2 * (child + 1)
        a[base + hole] = a[base + child - 1]
        hole = child - 1
    parent = (hole - 1) // 2
    while hole > top and less(a[base + parent], value):
        a[base + hole] = a[base + parent]
        hole = parent
        parent = (hole - 1) // 2
    a[base + hole] = value


class RerankMismatch(Exception):
    """The answer's results are not the ones the receipt hashes; the message says where."""


def results_sha256(results: Sequence[tuple[int, float]]) -> str:
    """sha256 of (index uint32, score float32) per result, little-endian, in order."""
    return sha256_hex(b"".join(struct.pack("<If", int(i), float(s)) for i, s in results))


def answer_results(obj: Any) -> list[tuple[int, float]]:
    """The (index, score) pairs an answer sends, in its order: Jina's object (``results`` of
    ``relevance_score``) or TEI's bare array (of ``score``; check-receipt reads it as
    ``{"results": array}``)."""
    if isinstance(obj, list):
        results = obj
    elif isinstance(obj, dict) and isinstance(obj.get("results"), list):
        results = obj["results"]
    else:
        raise RerankMismatch("the answer has no results list")
    out = []
    for position, result in enumerate(results):
        index = result.get("index") if isinstance(result, dict) else None
        tei = isinstance(result, dict) and "relevance_score" not in result
        label = "score" if tei else "relevance_score"
        score = result.get(label) if isinstance(result, dict) else None
        if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < 2**32:
            raise RerankMismatch(f"result {position} has no document index")
        if not isinstance(score, (int, float)) or isinstance(score, bool):
            raise RerankMismatch(f"result {position} has no {label} number")
        out.append((index, float(score)))
    return out


def answer_prompt_tokens(obj: Any) -> int | None:
    usage = obj.get("usage") if isinstance(obj, dict) else None
    value = usage.get("prompt_tokens") if isinstance(usage, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def check_results(receipt: Mapping[str, Any], obj: Any) -> None:
    """RerankMismatch unless ``obj`` sends exactly the results the receipt hashes, and the
    tokens it counts."""
    if receipt.get("api") != RERANK:
        raise RerankMismatch(f"api {receipt.get('api')!r} is not rerank")
    try:
        sent = results_sha256(answer_results(obj))
    except (OverflowError, struct.error):
        raise RerankMismatch("a result does not fit its 8 bytes") from None
    if sent != receipt.get("rerank_sha256"):
        raise RerankMismatch("the results are not the ones the receipt hashes (rerank_sha256)")
    shown = answer_prompt_tokens(obj)
    if shown is not None and shown != receipt.get("prompt_tokens"):
        raise RerankMismatch(
            f"the answer reports {shown} prompt tokens, the receipt {receipt.get('prompt_tokens')}"
        )


def rerank_receipt(
    issuer: Issuer,
    *,
    request_body: bytes,
    started: float,
    results: Sequence[tuple[int, float]],
    pairs_tokens: Sequence[Sequence[int]] | None,
    prompt_tokens: int | None = None,
    evaluated_together: Sequence[Sequence[int]] = (),
    evaluated_cells: Sequence[GroupCells] = (),
) -> dict[str, Any]:
    """The receipt of one rerank answer (the module doc); signed with the issuer's key, else
    today's unsigned receipt with the same fields. ``pairs_tokens`` None (P0):
    ``inputs_tokens_sha256`` null and ``prompt_tokens`` as the answer reports it.
    ``evaluated_together``: the groups of pairs scored in one micro-batch, each in its order
    (Encoder.rank_score_batches), and ``evaluated_cells`` their cells where not from cell 0 of
    an empty cache (receipts/embedding.py's ``cells_field``); each field is there only where
    there is a group."""
    if pairs_tokens is not None:
        prompt_tokens = int(sum(len(t) for t in pairs_tokens))
    fields: dict[str, Any] = {
        "rerank_sha256": results_sha256(results),
        "inputs_tokens_sha256": (
            None if pairs_tokens is None else [token_ids_sha256(t) for t in pairs_tokens]
        ),
        "pooling": "rank",
    }
    if evaluated_together:
        fields["evaluated_together"] = [list(group) for group in evaluated_together]
    if evaluated_cells:
        fields["evaluated_cells"] = cells_field(evaluated_cells)
    return unsampled_receipt(
        issuer,
        api=RERANK,
        request_body=request_body,
        started=started,
        prompt_tokens=prompt_tokens,
        fields=fields,
    )


def replay_rerank(request_bytes: bytes, receipt: Mapping[str, Any], engine: Any) -> str:
    """A native rerank answer computed again on ``engine`` (the pinned file's: an
    EncoderEngine's classifier, or a decoder's rank head, engine_cupy/rank_head.py): every
    document paired with the query as llama-server pairs them, scored, ranked and cut to
    ``top_n`` as the request says, the digest compared with the receipt's.
    ``identical: ...``, ``refuse: ...`` or ``cannot replay: ...``."""
    encoder = getattr(getattr(engine, "model", None), "encoder", None)
    if encoder is None:
        from bankml.engine_cupy.rank_head import rank_head

        try:
            encoder = rank_head(engine)
        except ValueError as err:  # UnsupportedModel
            return f"cannot replay: {err}"
    if encoder is None:
        return "cannot replay: the model has no rank head (a BERT reranker, or qwen3's cls.output)"
    try:
        body = json.loads(request_bytes)
    except ValueError as err:
        return f"refuse: the request is not JSON ({err})"
    query = body.get("query") if isinstance(body, dict) else None
    documents = documents_of(body) if isinstance(body, dict) else []
    if not isinstance(query, str) or not documents:
        return "refuse: the request does not read as a rerank request (a query, documents)"
    top_n = top_n_of(body, len(documents))
    pairs = [encoder.rerank_tokens(query, d) for d in documents]
    hashed = receipt.get("inputs_tokens_sha256")
    if isinstance(hashed, list) and hashed != [token_ids_sha256(t) for t in pairs]:
        return "refuse: the documents do not tokenize to the pairs the receipt hashes"
    together = receipt.get("evaluated_together", [])
    if together:
        if input_groups(together, len(pairs), smallest=1) is None:
            return "refuse: the receipt's evaluated_together is not groups of the request's pairs"
        placed = read_cells_field(receipt.get("evaluated_cells", []), together, lengths_of(pairs))
        if isinstance(placed, str):
            return f"refuse: {placed}"
        try:
            scores = encoder.rank_score_batches(pairs, together, placement_plan(placed))
        except ValueError as err:  # a group no micro-batch holds
            return f"refuse: the receipt's evaluated_together cannot be evaluated ({err})"
    else:
        scores = [encoder.rank_score(t) for t in pairs]
    results = ranked(scores, top_n)
    if results_sha256(results) != receipt.get("rerank_sha256"):
        return "refuse: the scores or their order are not what the model computes"
    n_tokens = sum(len(t) for t in pairs)
    return f"identical: {len(results)} results of {len(pairs)} documents, {n_tokens} tokens"
