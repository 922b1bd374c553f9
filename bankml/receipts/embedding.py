"""Receipts of embedding answers: which vectors were sent, for which request and model.

An embedding answer carries no text; its receipt says what it sent in ``embeddings_sha256``:
one lowercase hex sha256 per vector, in the order the answer lists them, each of the vector's
**float32 values as little-endian bytes** (4 bytes an element). Both of llama-server's
encodings give those bytes back exactly: a JSON number is the float32 value written as a double
(read it as a double, round to float32), and ``encoding_format: base64`` is those very bytes.
So a client checks a vector with ``hashlib.sha256(numpy.asarray(v, "<f4").tobytes())`` (or the
base64 decoded), whatever encoding it asked for.

The vectors, in order, for each API (``api`` field):

- ``embeddings`` (OpenAI's ``/v1/embeddings``): ``data[i].embedding`` in ``data`` order;
- ``llama_embedding`` (llama-server's ``/embedding``, ``/embeddings``: an array of results, one
  receipt in each): that result's ``embedding`` rows (every token's with pooling none);
- ``ollama_embed`` (``/api/embed``): ``embeddings`` in order, after Ollama's normalisation and
  ``dimensions``;
- ``ollama_embeddings`` (``/api/embeddings``): ``embedding`` (JSON doubles holding float32
  values).

The other fields are a chat receipt's (docs/receipts.md): ``prompt_tokens`` the tokens embedded,
``completion_tokens`` 0, ``response_sha256`` the sha256 of the empty text, ``sampler``
``{"seed": null}``, ``n_predict`` 0, ``finish_reason`` null; and ``pooling``, ``embd_normalize``
(null on Ollama's routes, which normalise themselves; in P0 the request's, pooling null: bankml
does not see llama-server's) and ``inputs_tokens_sha256`` (each input's token ids as compact
JSON, ``token_ids_sha256``; null in P0); with ``-np N``, ``evaluated_together``, where a
request's inputs had their hidden states computed in one micro-batch as llama-server's slots
evaluate them (lists of input indexes, each in the micro-batch's order), and
``pooled_together``, where they were mean-pooled beside each other in one (lists of input
indexes); each absent otherwise, so that a replay computes and pools them the same way.

``p0_receipts(api, answer, issue)``: P0's receipts of llama-server's
answer, put in it as the native answers carry them. ``replay_embeddings``: a native answer's
vectors computed again on bankml's engine (``bankml check-receipt --replay``).
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from bankml.receipts.digest import sha256_hex
from bankml.receipts.envelope import envelope_of
from bankml.receipts.keys import SigningKey
from bankml.receipts.kinds import EMBEDDING_APIS, LLAMA_EMBEDDING, OAI_EMBEDDINGS, OLLAMA_EMBED
from bankml.receipts.log import ReceiptLog
from bankml.receipts.sign import (
    ReplayFacts,
    build_receipt_v2,
    engine_source_digest,
    token_ids_sha256,
)
from bankml.receipts.tally import Tally, receipt
from bankml.version import __version__


class EmbeddingMismatch(Exception):
    """The answer's vectors are not the ones the receipt hashes; the message says where."""


def vector_sha256(values: Sequence[float]) -> str:
    """sha256 of the vector's float32 values as little-endian bytes."""
    return sha256_hex(struct.pack(f"<{len(values)}f", *[float(v) for v in values]))


def _vector_values(item: Any) -> list[float]:
    """A vector as an answer lists it: JSON numbers, or base64 of float32 bytes."""
    if isinstance(item, str):
        try:
            raw = base64.b64decode(item, validate=True)
        except (binascii.Error, ValueError):
            raise EmbeddingMismatch("a base64 embedding does not decode") from None
        if len(raw) % 4:
            raise EmbeddingMismatch("a base64 embedding is not whole float32 values")
        return list(struct.unpack(f"<{len(raw) // 4}f", raw))
    if not isinstance(item, list) or not all(
        isinstance(v, (int, float)) and not isinstance(v, bool) for v in item
    ):
        raise EmbeddingMismatch("an embedding is not a list of numbers")
    return [float(v) for v in item]


def answer_vectors(obj: Any, api: str) -> list[list[float]]:
    """The vectors one answer object sends, in the order ``embeddings_sha256`` lists them."""
    if not isinstance(obj, dict):
        raise EmbeddingMismatch("the answer is not a JSON object")
    if api == OAI_EMBEDDINGS:
        data = obj.get("data")
        if not isinstance(data, list):
            raise EmbeddingMismatch("the answer has no data list")
        return [_vector_values(d.get("embedding") if isinstance(d, dict) else None) for d in data]
    if api == LLAMA_EMBEDDING:
        rows = obj.get("embedding")
        if not isinstance(rows, list):
            raise EmbeddingMismatch("the result has no embedding rows")
        return [_vector_values(r) for r in rows]
    if api == OLLAMA_EMBED:
        rows = obj.get("embeddings")
        if not isinstance(rows, list):
            raise EmbeddingMismatch("the answer has no embeddings list")
        return [_vector_values(r) for r in rows]
    return [_vector_values(obj.get("embedding"))]


def answer_prompt_tokens(obj: Any, api: str) -> int | None:
    """The token count an answer shows, where its shape has one."""
    if not isinstance(obj, dict):
        return None
    if api == OAI_EMBEDDINGS and isinstance(obj.get("usage"), dict):
        value = obj["usage"].get("prompt_tokens")
    elif api == OLLAMA_EMBED:
        value = obj.get("prompt_eval_count", 0)  # Ollama leaves a zero count out
    else:
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def check_vectors(receipt: Mapping[str, Any], obj: Any) -> None:
    """EmbeddingMismatch unless ``obj`` sends exactly the vectors the receipt hashes."""
    api = str(receipt.get("api"))
    if api not in EMBEDDING_APIS:
        raise EmbeddingMismatch(f"api {api!r} is not an embedding API")
    hashed = receipt.get("embeddings_sha256")
    if not isinstance(hashed, list):
        raise EmbeddingMismatch("the receipt hashes no embeddings (embeddings_sha256)")
    vectors = answer_vectors(obj, api)
    if len(vectors) != len(hashed):
        raise EmbeddingMismatch(
            f"the answer sends {len(vectors)} vectors, the receipt hashes {len(hashed)}"
        )
    for i, (vector, digest) in enumerate(zip(vectors, hashed)):
        if vector_sha256(vector) != digest:
            raise EmbeddingMismatch(f"vector {i} is not the one the receipt hashes")
    shown = answer_prompt_tokens(obj, api)
    if shown is not None and shown != receipt.get("prompt_tokens"):
        raise EmbeddingMismatch(
            f"the answer reports {shown} prompt tokens, the receipt {receipt.get('prompt_tokens')}"
        )


@dataclass(frozen=True)
class Issuer:
    """Who issues the receipts of answers that sample nothing (embeddings, rerank scores): the
    pinned file, the engine and what a signed receipt says of it, the key, and the log every
    receipt is appended to (``--receipt-log``)."""

    verified: Any
    engine_name: str
    device: str | None
    n_ctx: int | None
    cache_type: str | None
    key: SigningKey | None
    engine_version: str | None = __version__
    engine_digest: str | None = None
    log: ReceiptLog | None = None


def native_issuer(native: Any) -> Issuer:
    """The native engine's Issuer (``native``: the resident engine's state)."""
    return Issuer(
        verified=native.verified,
        engine_name=native.engine_name,
        device=native.device,
        n_ctx=native.n_ctx,
        cache_type=native.cache_type,
        key=native.receipt_key,
        log=native.receipt_log,
    )


def unsampled_receipt(
    issuer: Issuer,
    *,
    api: str,
    request_body: bytes,
    started: float,
    prompt_tokens: int | None,
    fields: Mapping[str, Any],
) -> dict[str, Any]:
    """A receipt of an answer that samples nothing: a chat receipt's fields, then ``fields``
    (what this answer sent), signed with the issuer's key; appended to its log."""
    tally = Tally(request_body=request_body, started=started)
    tally.set_counts(prompt_tokens, 0)
    base = receipt(
        tally, engine=issuer.engine_name, model_sha256=issuer.verified.sha256, ttft_measured=False
    )
    signed_flag = base.pop("signed")
    base.update(fields)
    base["signed"] = signed_flag
    out = _signed(base, api, issuer)
    if issuer.log is not None:
        issuer.log.append(out)
    return out


def embedding_receipt(
    issuer: Issuer,
    *,
    api: str,
    request_body: bytes,
    started: float,
    vectors: Sequence[Sequence[float]],
    inputs_tokens: Sequence[Sequence[int]] | None,
    pooling: str | None,
    embd_normalize: int | None,
    prompt_tokens: int | None = None,
    evaluated_together: Sequence[Sequence[int]] = (),
    pooled_together: Sequence[Sequence[int]] = (),
    evaluated_cells: Sequence[GroupCells] = (),
) -> dict[str, Any]:
    """The receipt of one embedding answer (see the module doc); signed with the issuer's key
    (a version-2 receipt and its envelope), else today's unsigned receipt with the same
    fields. ``inputs_tokens`` None (P0: llama-server's answer lists no ids):
    ``inputs_tokens_sha256`` null and ``prompt_tokens`` as the answer reports it (None:
    unknown). ``evaluated_together``: the groups of the request's inputs whose hidden states
    were computed in one micro-batch, in its order (Engine.evaluated_together);
    ``pooled_together``: those whose ``mean`` was pooled beside each other in one
    (Engine.pooled_together); ``evaluated_cells``: the cells of those groups that did not sit
    from cell 0 of an empty cache (``cells_field``); each field is there only where there is a
    group."""
    if api not in EMBEDDING_APIS:
        raise ValueError(f"unknown embedding api {api!r}")
    if inputs_tokens is not None:
        prompt_tokens = int(sum(len(t) for t in inputs_tokens))
    fields: dict[str, Any] = {
        "embeddings_sha256": [vector_sha256(v) for v in vectors],
        "inputs_tokens_sha256": (
            None if inputs_tokens is None else [token_ids_sha256(t) for t in inputs_tokens]
        ),
        "pooling": pooling,
        "embd_normalize": embd_normalize,
    }
    if evaluated_together:
        fields["evaluated_together"] = [list(group) for group in evaluated_together]
    if pooled_together:
        fields["pooled_together"] = [list(group) for group in pooled_together]
    if evaluated_cells:
        fields["evaluated_cells"] = cells_field(evaluated_cells)
    return unsampled_receipt(
        issuer,
        api=api,
        request_body=request_body,
        started=started,
        prompt_tokens=prompt_tokens,
        fields=fields,
    )


def _signed(base: dict[str, Any], api: str, issuer: Issuer) -> dict[str, Any]:
    """An answer that samples nothing (embeddings, rerank scores): its receipt ``base`` signed
    with the issuer's key (a version-2 receipt and its envelope), else ``base`` as it is."""
    key = issuer.key
    if key is None:
        return base
    facts = ReplayFacts(
        api=api,
        stream=False,
        sampler={"seed": None},  # nothing is sampled
        n_predict=0,
        n_ctx=issuer.n_ctx,
        cache_type=issuer.cache_type,
        device=issuer.device,
        engine_version=issuer.engine_version,
        engine_digest=issuer.engine_digest
        if issuer.engine_digest is not None
        else engine_source_digest(),
        prompt_token_ids=None,
        completion_token_ids=None,
        cache_n=0,
        finish_reason=None,
    )
    signed = build_receipt_v2(base, facts, key)
    signed["envelope"] = envelope_of(signed, os.path.basename(str(issuer.verified.path)), key)
    return signed


def p0_receipts(api: str, answer: Any, issue: Any) -> bool:
    """P0: llama-server's whole embedding answer with its receipts put in (``issue(vectors,
    prompt_tokens)`` makes one): one ``bankml_receipt`` on the OpenAI object, one in each
    result of llama-server's array. False (nothing changed) where the answer is not of that
    shape."""
    try:
        if api == LLAMA_EMBEDDING:
            if not isinstance(answer, list) or not all(isinstance(r, dict) for r in answer):
                return False
            receipts = [issue(answer_vectors(r, api), None) for r in answer]
            for result, out in zip(answer, receipts):
                result["bankml_receipt"] = out
            return True
        if not isinstance(answer, dict):
            return False
        answer["bankml_receipt"] = issue(
            answer_vectors(answer, api), answer_prompt_tokens(answer, api)
        )
        return True
    except EmbeddingMismatch:
        return False


def replay_embeddings(
    request_bytes: bytes, receipts: Sequence[Mapping[str, Any]], engine: Any
) -> str:
    """A native embedding answer computed again on ``engine`` (bankml's exact engine on the
    pinned file, the receipt's context and cache type): every input of the request tokenized,
    embedded, pooled and normalised as the receipt says, each vector's digest compared with the
    receipt's. ``receipts``: the answer's (one, or one per result of llama-server's array).
    ``identical: ...``, ``refuse: ...`` or ``cannot replay: ...``."""
    from bankml.engine_cupy.pooling import normalize, pool
    from bankml.engine_cupy.request import RequestError

    api = receipts[0].get("api")
    if api not in (OAI_EMBEDDINGS, LLAMA_EMBEDDING):
        return f"cannot replay: the {api} API is not replayed"
    pooling = receipts[0].get("pooling")
    if pooling not in ("none", "mean", "cls", "last"):
        return "cannot replay: the receipt names no pooling (llama-server's answer does not say)"
    try:
        body = json.loads(request_bytes)
        prompt = body["input"] if "input" in body else body["content"]
        tokens = engine.embedding_inputs(prompt)
    except (ValueError, TypeError, KeyError, RequestError) as err:
        return f"refuse: the request does not read as an embedding request ({err})"
    if api == LLAMA_EMBEDDING and len(receipts) != len(tokens):
        return f"refuse: {len(receipts)} receipts for {len(tokens)} inputs"
    norm = receipts[0].get("embd_normalize")
    together = receipts[0].get("evaluated_together", [])
    if input_groups(together, len(tokens), smallest=1) is None:
        return "refuse: the receipt's evaluated_together is not groups of the request's inputs"
    beside = input_groups(receipts[0].get("pooled_together", []), len(tokens))
    if beside is None:
        return "refuse: the receipt's pooled_together is not groups of the request's inputs"
    placed = read_cells_field(receipts[0].get("evaluated_cells", []), together, lengths_of(tokens))
    if isinstance(placed, str):
        return f"refuse: {placed}"
    try:
        states = engine.compute_hidden_states(tokens, together, placement_plan(placed))
    except ValueError as err:  # a group no micro-batch holds
        return f"refuse: the receipt's evaluated_together cannot be evaluated ({err})"
    vectors = []
    for i, hidden in enumerate(states):
        rows = list(pool(hidden, pooling, beside_others=i in beside))
        if pooling != "none" and isinstance(norm, int):
            rows = [normalize(row, norm) for row in rows]
        vectors.append([vector_sha256(row.tolist()) for row in rows])
    hashed = [r.get("embeddings_sha256") for r in receipts]
    if api == OAI_EMBEDDINGS:
        got, hashed = [[v[0] for v in vectors]], [hashed[0]]
    else:
        got = vectors
    for i, (mine, theirs) in enumerate(zip(got, hashed)):
        if mine != theirs:
            where = next((j for j, (a, b) in enumerate(zip(mine, theirs or [])) if a != b), 0)
            return f"refuse: vector {where} of answer {i} is not what the model computes"
    n = sum(len(v) for v in got)
    return f"identical: {n} vectors, {sum(len(t) for t in tokens)} tokens"


class GroupCells(NamedTuple):
    """Where one group of ``evaluated_together`` sat in the shared cache: its index there, each
    input's cells (in position order) and the batch's ``n_kv``; a sliding-window model's
    sliding layers' cells and ``n_kv`` in their own cache (None: none named)."""

    group: int
    cells: Sequence[Sequence[int]]
    n_kv: int
    swa_cells: Sequence[Sequence[int]] | None = None
    swa_n_kv: int = 0


def group_cells(
    engine: Any, together: Sequence[Sequence[int]], plan: Any, lengths: Sequence[int]
) -> list[GroupCells]:
    """The groups of ``together`` that the engine's plan placed elsewhere than from cell 0 of
    an empty cache (Engine.batch_cells), for the receipt."""
    out = []
    for g, group in enumerate(together):
        placed = engine.batch_cells(group, plan, lengths)
        if placed is None:
            continue
        swa = None if placed.swa_cells is None else [c.tolist() for c in placed.swa_cells]
        cells = [c.tolist() for c in placed.cells]
        out.append(GroupCells(g, cells, placed.n_kv, swa, placed.swa_n_kv))
    return out


def cells_field(groups: Sequence[GroupCells]) -> list[dict[str, Any]]:
    """A receipt's ``evaluated_cells``: for each group, each input's cells as runs of
    consecutive cells, ``[first, last + 1]``; a sliding-window model's also ``swa_n_kv`` and
    ``swa_cells``, its sliding layers' in their own cache."""
    out = []
    for g in groups:
        entry: dict[str, Any] = {
            "group": g.group,
            "n_kv": g.n_kv,
            "cells": [_runs(cells) for cells in g.cells],
        }
        if g.swa_cells is not None:
            entry["swa_n_kv"] = g.swa_n_kv
            entry["swa_cells"] = [_runs(cells) for cells in g.swa_cells]
        out.append(entry)
    return out


def _runs(cells: Sequence[int]) -> list[list[int]]:
    runs: list[list[int]] = []
    for cell in (int(c) for c in cells):
        if runs and runs[-1][1] == cell:
            runs[-1][1] = cell + 1
        else:
            runs.append([cell, cell + 1])
    return runs


CELLS_KEYS = {"group", "n_kv", "cells"}
SWA_CELLS_KEYS = CELLS_KEYS | {"swa_n_kv", "swa_cells"}


class InputCells(NamedTuple):
    """One input's cells read back from a receipt, its batch's n_kv, and a sliding-window
    model's sliding layers' (None: none named)."""

    cells: list[int]
    n_kv: int
    swa_cells: list[int] | None = None
    swa_n_kv: int = 0


def read_cells_field(
    field: Any, together: Sequence[Sequence[int]], lengths: Sequence[int]
) -> dict[int, InputCells] | str:
    """A receipt's ``evaluated_cells`` read back: input index: its cells; or why it is not
    cells of the groups of ``together`` (each input its length's cells, in the full layers'
    cache and, where named, in the sliding layers')."""
    if not isinstance(field, list):
        return "the receipt's evaluated_cells is not a list"
    out: dict[int, InputCells] = {}
    for entry in field:
        if not isinstance(entry, dict) or set(entry) not in (CELLS_KEYS, SWA_CELLS_KEYS):
            return "an entry of the receipt's evaluated_cells is not {group, n_kv, cells}"
        g, n_kv = entry["group"], entry["n_kv"]
        swa_n_kv = entry.get("swa_n_kv", 0)
        if type(g) is not int or not 0 <= g < len(together) or type(n_kv) is not int:
            return "the receipt's evaluated_cells names no group of evaluated_together"
        if type(swa_n_kv) is not int:
            return "the receipt's evaluated_cells gives no number for swa_n_kv"
        group = together[g]
        per_layout = [entry["cells"]] + ([entry["swa_cells"]] if "swa_cells" in entry else [])
        read = []
        for cells in per_layout:
            if not isinstance(cells, list) or len(cells) != len(group):
                return "the receipt's evaluated_cells does not give each input of its group cells"
            expanded = [_expand(runs) for runs in cells]
            if any(e is None or len(e) != lengths[i] for i, e in zip(group, expanded)):
                return "the receipt's evaluated_cells does not give each input its tokens' cells"
            read.append(expanded)
        for j, i in enumerate(group):
            if i in out:
                return "the receipt's evaluated_cells does not give each input its tokens' cells"
            swa = read[1][j] if len(read) > 1 else None
            out[i] = InputCells(read[0][j] or [], n_kv, swa, swa_n_kv)
    return out


def _expand(runs: Any) -> list[int] | None:
    if not isinstance(runs, list) or not all(
        isinstance(r, list) and len(r) == 2 and all(type(c) is int for c in r) and r[0] < r[1]
        for r in runs
    ):
        return None
    return [c for first, end in runs for c in range(first, end)]


def lengths_of(inputs: Sequence[Sequence[int]]) -> list[int]:
    return [len(tokens) for tokens in inputs]


def placement_plan(placed: Mapping[int, InputCells]) -> Any:
    """The engine's plan (Engine.compute_hidden_states) that puts each input at the cells a
    receipt names (None: none named)."""
    if not placed:
        return None
    import numpy

    from bankml.engine_cupy.engine import EmbeddingPlan
    from bankml.engine_cupy.model import Placed

    def cells(c: Sequence[int]) -> Any:
        return numpy.asarray(c, numpy.int64)

    placement = {
        i: Placed(
            cells(p.cells), p.n_kv, None if p.swa_cells is None else cells(p.swa_cells), p.swa_n_kv
        )
        for i, p in placed.items()
    }
    return EmbeddingPlan([], {}, placement=placement)


def input_groups(groups: Any, n_inputs: int, smallest: int = 2) -> set[int] | None:
    """The inputs a receipt's ``evaluated_together`` or ``pooled_together`` names (each group
    ``smallest`` or more of the request's inputs, none in two groups); None where it is not
    that. An input evaluated alone at cells of its own is a group of one of
    ``evaluated_together``."""
    if not isinstance(groups, list) or not all(
        isinstance(g, list) and len(g) >= smallest and all(type(i) is int for i in g)
        for g in groups
    ):
        return None
    named = [i for g in groups for i in g]
    if len(set(named)) != len(named) or not all(0 <= i < n_inputs for i in named):
        return None
    return set(named)
