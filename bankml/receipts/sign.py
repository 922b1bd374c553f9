"""Version-2 receipts: today's receipt plus what a replay needs, signed with Ed25519.

``build_receipt_v2(base, facts, key)`` takes the receipt ``bankml.receipts.tally.receipt`` gives today and
the run's ``ReplayFacts`` (resolved sampler settings with the seed actually used, context size,
cache type, engine identity, prompt and answer token ids) and returns the signed receipt, still
one JSON object that rides as ``bankml_receipt``. The format is docs/modules/receipts.md's.
"""

from __future__ import annotations

import base64
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace
from functools import cache
from pathlib import Path
from typing import Any

from bankml.engine_cupy.sampler import (
    DEFAULT_SEED,
    LogitBias,
    SamplerError,
    SamplerParams,
    resolve_seed,
)
from bankml.receipts.canonical import normalized, signed_bytes, timestamp
from bankml.receipts.convert import chat_fields, n_cmpl_of
from bankml.receipts.digest import sha256_hex
from bankml.receipts.envelope import envelope_of, model_name
from bankml.receipts.keys import ALG, SigningKey
from bankml.receipts.kinds import APIS, CONVERTED, MESSAGES
from bankml.version import __version__

RECEIPT_VERSION = 2
ENGINE_SOURCES = Path(__file__).resolve().parent.parent / "engine_cupy"


def token_ids_sha256(ids: Sequence[int]) -> str:
    """sha256 of the ids as compact JSON (``[1,2,3]``, what ``jq -cj .tokens`` prints)."""
    return sha256_hex(json.dumps([int(i) for i in ids], separators=(",", ":")).encode("ascii"))


@cache
def engine_source_digest(root: Path = ENGINE_SOURCES) -> str:
    """sha256 of ``sha256sum``'s listing of the engine's Python sources, paths relative to the
    package directory in C sort order: ``cd bankml && find engine_cupy -name '*.py' |
    LC_ALL=C sort | xargs sha256sum | sha256sum``. Computed once per process."""
    lines = []
    for path in sorted(root.rglob("*.py"), key=lambda p: p.relative_to(root.parent).as_posix()):
        rel = path.relative_to(root.parent).as_posix()
        lines.append(f"{sha256_hex(path.read_bytes())}  {rel}\n")
    return sha256_hex("".join(lines).encode("utf-8"))


@dataclass(frozen=True)
class ReplayFacts:
    """What, beyond today's receipt, a replay needs and a reader may check."""

    api: str  # one of APIS: how the request was read and the answer written
    stream: bool  # the answer was an event stream (SSE or NDJSON), not one object
    sampler: Mapping[str, Any]  # resolved settings (sampler_settings), the seed actually used
    n_predict: int
    n_ctx: int | None  # None where bankml does not see it (P0: an upstream that does not say)
    cache_type: str | None
    device: str | None  # None where bankml does not see where the engine computed (P0)
    engine_version: str | None
    engine_digest: str | None
    prompt_token_ids: Sequence[int] | None  # None where the engine does not say (P0)
    completion_token_ids: Sequence[int] | None  # None where the engine does not say (P0 chat)
    cache_n: int  # prompt tokens reused from the slot, not computed for this request
    finish_reason: str | None
    # P0 over llama.cpp RPC workers: their HOST:PORT addresses, where the layers were computed
    rpc: Sequence[str] | None = None


def sampler_settings(params: Any) -> dict[str, Any]:
    """A SamplerParams as JSON: every field, tuples as lists, a logit bias as ``[token, bias]``
    with a banning -inf written as null."""
    out: dict[str, Any] = {}
    for f in fields(params):
        value = getattr(params, f.name)
        if f.name == "logit_bias":
            value = [[b.token, b.bias if math.isfinite(b.bias) else None] for b in value]
        elif isinstance(value, tuple):
            value = list(value)
        out[f.name] = value
    return out


def params_from_settings(settings: Mapping[str, Any]) -> Any:
    """``sampler_settings`` read back into a SamplerParams (ValueError when it does not fit)."""
    known = {f.name: f for f in fields(SamplerParams)}
    if set(settings) != set(known):
        missing = sorted(set(known) - set(settings))
        extra = sorted(set(settings) - set(known))
        raise ValueError(
            f"sampler settings differ from this bankml's (missing {missing}, extra {extra})"
        )
    values: dict[str, Any] = {}
    for name, value in settings.items():
        if name == "logit_bias":
            value = tuple(LogitBias(-math.inf if b is None else float(b), int(t)) for t, b in value)
        elif isinstance(value, list):
            value = tuple(value)
        elif isinstance(getattr(SamplerParams(), name), float) and isinstance(value, int):
            value = float(value)  # canonical JSON writes 1.0 as 1
        values[name] = value
    return replace(SamplerParams(), **values)


def pin_seed(parsed: Any) -> Any:
    """A parsed engine Request whose seed is the one the run will use: a request without a seed
    (llama.cpp's 0xFFFFFFFF) gets one drawn here, so the receipt can name it."""
    if parsed.sampler.seed != DEFAULT_SEED:
        return parsed
    seed = DEFAULT_SEED
    while seed == DEFAULT_SEED:  # the drawn value must not mean "draw one" again
        seed = resolve_seed(DEFAULT_SEED)
    return replace(parsed, sampler=replace(parsed.sampler, seed=seed), seed_drawn=True)


def native_facts(
    parsed: Any,
    summary: Any,
    *,
    api: str,
    stream: bool,
    n_ctx: int,
    cache_type: str,
    device: str,
    finish_reason: str | None = None,
) -> ReplayFacts:
    """The facts of one run of bankml's engine: ``parsed`` (its Request, seed pinned) and the
    run's Summary; ``finish_reason``: the answer's where it says more than the run's (a chat
    answer that stopped with tool calls: ``tool_calls``)."""
    return ReplayFacts(
        api=api,
        stream=stream,
        sampler=sampler_settings(parsed.sampler),
        n_predict=int(parsed.n_predict),
        n_ctx=int(n_ctx),
        cache_type=cache_type,
        device=device,
        engine_version=__version__,
        engine_digest=engine_source_digest(),
        prompt_token_ids=list(parsed.prompt_tokens),
        completion_token_ids=list(summary.tokens),
        cache_n=int((summary.timings or {}).get("cache_n", 0)),
        finish_reason=finish_reason or summary.finish_reason,
    )


# where a request states its token limit, in the order llama-server reads them
N_PREDICT_FIELDS = ("n_predict", "max_completion_tokens", "max_tokens")
# request fields that set n_probs rather than a sampler setting of their own
LOGPROB_FIELDS = ("logprobs", "n_probs", "top_logprobs")


@dataclass(frozen=True)
class ForwardedRequest:
    """P0: a request as bankml forwards it to llama-server, and what the receipt says of it."""

    api: str
    body: bytes  # the bytes sent upstream: the client's, with a drawn seed appended if it had none
    stream: bool
    sampler: Mapping[str, Any]  # the request's sampler fields read over llama-server's defaults
    n_predict: int
    n_cmpl: int = 1  # the completions llama-server answers for each prompt (``n_cmpl``/``n``)

    def for_answer(self, index: int) -> ForwardedRequest:
        """The request as answer ``index`` of it ran (answers numbered as llama-server numbers
        its tasks: prompt ``p``'s completion ``j`` is ``p * n_cmpl + j``): completion ``j``
        is seeded ``seed + j`` (uint32), as llama-server seeds its child tasks."""
        completion = index % self.n_cmpl
        seed = self.sampler.get("seed")
        if not completion or not isinstance(seed, int):
            return self
        return replace(self, sampler={**self.sampler, "seed": (seed + completion) % 2**32})


def _drawn_seed() -> int:
    seed = DEFAULT_SEED
    while seed == DEFAULT_SEED:  # the drawn value must not mean "draw one" again
        seed = resolve_seed(DEFAULT_SEED)
    return seed


P0_ENGINE = "llama-server"  # a P0 receipt's engine: llama-server, on a device bankml does not see


def is_p0(receipt: Mapping[str, Any]) -> bool:
    """A receipt of P0's (llama-server's answer) rather than of bankml's own engine."""
    engine = receipt.get("engine")
    return (
        receipt.get("device") is None and isinstance(engine, str) and engine.startswith(P0_ENGINE)
    )


def forward_request(body: bytes, api: str) -> ForwardedRequest:
    """P0: the request to forward. A JSON object without a seed (or with llama-server's "draw
    one", -1 or 4294967295) gets ``"seed": N`` appended, N drawn here: a repeated key's last
    value is the one llama-server (nlohmann) reads, and the client's bytes stay as they were
    otherwise. The sampler settings are the request's fields read the way bankml's engine reads
    them, over llama-server's defaults; a Responses or Messages request is read as the chat
    completion llama-server converts it to (convert.py). A Messages request is forwarded as it
    is and its seed recorded as unknown (null): llama-server's conversion drops any ``seed``
    and draws one its answer does not show. A body that is not such an object is forwarded as
    it is (llama-server answers it, with no receipt unless it answers 200)."""
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):
        obj = None
    if not isinstance(obj, dict):
        return ForwardedRequest(api, body, False, sampler_settings(SamplerParams()), -1)
    fields_read = chat_fields(api, obj) if api in CONVERTED else obj
    chat_like = api == "chat" or api in CONVERTED
    # a chat's logprobs/top_logprobs set n_probs below; a completion's n_probs (or its alias
    # logprobs) is a sampler field read as the engine reads it
    sampler_body = (
        {k: v for k, v in fields_read.items() if k not in LOGPROB_FIELDS} if chat_like else obj
    )
    try:
        params = SamplerParams.from_request(sampler_body)
    except (SamplerError, ValueError, TypeError):
        params = SamplerParams()  # llama-server refuses it too: no receipt is written
    top = fields_read.get("top_logprobs")
    wants = fields_read.get("logprobs")
    n_probs = (int(top) if isinstance(top, (int, float)) else 20) if wants else 0
    if not chat_like:
        n_probs = params.n_probs
    sent = body
    if api != MESSAGES and params.seed == DEFAULT_SEED:
        params = replace(params, seed=_drawn_seed())
        close = body.rstrip()
        comma = b"" if close[:-1].strip().endswith(b"{") else b","
        sent = close[:-1] + comma + b'"seed":' + str(params.seed).encode("ascii") + b"}"
    limits = [fields_read[k] for k in N_PREDICT_FIELDS if fields_read.get(k) is not None]
    n_predict = limits[0] if limits and type(limits[0]) is int else -1
    settings = sampler_settings(replace(params, n_probs=n_probs))
    if api == MESSAGES:
        settings["seed"] = None  # llama-server draws it and does not say
    return ForwardedRequest(
        api, sent, obj.get("stream") is True, settings, n_predict, n_cmpl_of(fields_read)
    )


def forwarded_facts(
    forwarded: ForwardedRequest,
    tally: Any,
    *,
    n_ctx: int | None,
    cache_type: str | None,
    engine_version: str | None,
    engine_digest: str | None,
    rpc: Sequence[str] | None = None,
) -> ReplayFacts:
    """The facts of one answer llama-server gave through P0: what bankml forwarded, and what
    the answer said of its end (``tally.finish_reason``, ``tally.cache_n``). llama-server's chat
    answer lists no token ids, and bankml does not see on which device it computed; ``rpc``
    names the RPC workers llama-server was started with, where it has any."""
    return ReplayFacts(
        api=forwarded.api,
        stream=forwarded.stream,
        sampler=forwarded.sampler,
        n_predict=forwarded.n_predict,
        n_ctx=n_ctx,
        cache_type=cache_type,
        device=None,
        engine_version=engine_version,
        engine_digest=engine_digest,
        prompt_token_ids=None,
        completion_token_ids=None,
        cache_n=int(tally.cache_n or 0),
        finish_reason=tally.finish_reason,
        rpc=rpc,
    )


def build_receipt_v2(
    base: Mapping[str, Any], facts: ReplayFacts, key: SigningKey, *, now: float | None = None
) -> dict[str, Any]:
    """Today's receipt ``base`` with the replay facts, the key id and the signature added."""
    if facts.api not in APIS:
        raise ValueError(f"unknown api {facts.api!r}")
    out = {k: v for k, v in base.items() if k not in ("signed", "signature")}
    out.update(
        {
            "signed": True,
            "receipt_version": RECEIPT_VERSION,
            "api": facts.api,
            "stream": bool(facts.stream),
            "engine_version": facts.engine_version,
            "engine_digest": facts.engine_digest,
            "device": facts.device,
            "n_ctx": facts.n_ctx,
            "cache_type": facts.cache_type,
            "sampler": dict(facts.sampler),
            "n_predict": facts.n_predict,
            "prompt_tokens_sha256": None
            if facts.prompt_token_ids is None
            else token_ids_sha256(facts.prompt_token_ids),
            "completion_tokens_sha256": None
            if facts.completion_token_ids is None
            else token_ids_sha256(facts.completion_token_ids),
            "cache_n": facts.cache_n,
            "finish_reason": facts.finish_reason,
            "timestamp": timestamp(now),
            "alg": ALG,
            "keyid": key.keyid,
        }
    )
    if facts.rpc:
        out["rpc"] = list(facts.rpc)
    return sign_receipt(out, key)


def sign_receipt(receipt: dict[str, Any], key: SigningKey) -> dict[str, Any]:
    """``receipt`` with ``keyid`` set to the key's and ``signature`` (base64) over its
    canonical bytes; anything signed before is replaced (an envelope made again)."""
    out = normalized({k: v for k, v in receipt.items() if k not in ("signature", "envelope")})
    out["keyid"] = key.keyid
    out["signature"] = base64.b64encode(key.sign(signed_bytes(out))).decode("ascii")
    if "envelope" in receipt:  # signed again too, for the same model file
        out["envelope"] = envelope_of(out, model_name(receipt["envelope"]), key)
    return out


def attach_to_stream(events: list[dict[str, Any]], receipt: dict[str, Any]) -> list[dict[str, Any]]:
    """A stream's event objects with ``receipt`` as a ``bankml_receipt`` field of the last
    regular event (an event that held only today's receipt is dropped first)."""
    out = [dict(e) for e in events]
    if out and set(out[-1]) == {"bankml_receipt"}:
        out.pop()
    if not out:
        raise ValueError("a stream with no event to carry the receipt")
    out[-1]["bankml_receipt"] = receipt
    return out
