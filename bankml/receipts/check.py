"""``check_receipt``: does a response's signed receipt hold for the request and answer given?

The checks run in this order and the first that fails is the answer, ``refuse: <reason>``:

1. the response is an answer with one receipt (a JSON object's ``bankml_receipt``, or that field
   of a stream's last event), of version 2, signed with ``alg`` ed25519 (an answer with several,
   a request's prompts or ``n`` completions, has every receipt checked against its own choice,
   as ``verified_receipts`` says);
2. its ``keyid`` is the given public key's, and the signature verifies over the receipt's
   canonical bytes (canonical.py), so no field was changed after signing; its DSSE ``envelope``
   (envelope.py), where it has one, is signed by the same key and its Statement's subjects and
   predicate are the receipt's;
3. ``request_sha256`` is the sha256 of the request bytes as sent;
4. with a pin, ``model_sha256`` is the pinned file's;
5. the answer's form (one object or a stream) is the receipt's ``stream``; ``response_sha256``
   and ``logprobs_sha256`` are what the answer itself hashes to, computed as bankml computed them
   (receipt.py: the UTF-8 text of choice 0, streamed pieces joined; the compact JSON of the
   logprobs entries), and the logprobs hash is there exactly when the answer carries logprobs;
6. the fields agree with each other and with the answer: token counts and finish reason as the
   answer reports them, the request's own sampler fields (seed, temperature, top_k, ...) equal to
   the receipt's resolved settings, a request's explicit seed being the seed the receipt names.
   A Responses or Messages request is read as the chat completion llama-server converts it to
   (convert.py): a Messages request's fields that llama-server drops (its ``seed`` among them)
   are not settings, and its receipt names the seed as unknown (null).

``check_envelope`` checks an envelope kept apart from its answer the same way;
``check_receipt_log`` a log of receipts (log.py): its chain and every receipt's signature.

``valid`` means a holder of the key signed this receipt for this request and this answer. Whether
the answer is what the pinned model computes for the request is the replay's question (replay.py).
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Mapping
from dataclasses import fields, replace
from typing import Any

from bankml.receipts.answer import JSON, Unreadable, answer_of, answer_parts, read_answer
from bankml.receipts.canonical import signed_bytes
from bankml.receipts.convert import chat_fields, n_cmpl_of
from bankml.receipts.digest import canonical_logprobs, sha256_hex, text_sha256
from bankml.receipts.embedding import EmbeddingMismatch, check_vectors
from bankml.receipts.envelope import EnvelopeRefused, claimed_predicate, matches, opened
from bankml.receipts.keyring import KeyNotTrusted, TrustedKeys
from bankml.receipts.keys import ALG, verifies
from bankml.receipts.kinds import APIS, CONVERTED, EMBEDDING_APIS, MESSAGES, RERANK
from bankml.receipts.log import LogBroken, check_log, log_files
from bankml.receipts.rerank import RerankMismatch, check_results
from bankml.receipts.sign import RECEIPT_VERSION, is_p0

VALID = "valid"
# request fields that are not sampler settings though the sampler's table reads them
_NOT_SAMPLER_FIELDS = ("logprobs", "n_probs", "top_logprobs")


# where a request states its token limit, in the order the engine reads them
_N_PREDICT_FIELDS = {
    "chat": ("n_predict", "max_completion_tokens", "max_tokens"),
    "oai_completion": ("n_predict", "max_completion_tokens", "max_tokens"),
    "llama_completion": ("n_predict", "max_completion_tokens", "max_tokens"),
    # read from the chat completion llama-server converts these to (convert.py)
    "responses": ("n_predict", "max_completion_tokens", "max_tokens"),
    "messages": ("n_predict", "max_completion_tokens", "max_tokens"),
}


class Refused(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def check_receipt(
    request_bytes: bytes,
    response_bytes: bytes,
    public_key_pem: str | bytes,
    *,
    model_sha256: str | None = None,
) -> str:
    """``valid`` or ``refuse: <the first reason>``; ``model_sha256`` pins the model file. An
    answer with several (a request's ``n`` completions, its prompts) is valid when every one
    of its receipts holds for its own choice."""
    try:
        verified_receipts(request_bytes, response_bytes, public_key_pem, model_sha256=model_sha256)
    except Refused as err:
        return f"refuse: {err.reason}"
    return VALID


def verified_receipts(
    request_bytes: bytes,
    response_bytes: bytes,
    public_key_pem: str | bytes,
    *,
    model_sha256: str | None = None,
) -> list[dict[str, Any]]:
    """Every receipt of the response, once each holds for its own answer (``verified_receipt``
    for a response with one): the answers are the request's ``n_cmpl`` completions of each of
    its prompts, numbered 0, 1, ... as llama-server numbers its tasks, none left out."""
    try:
        parts = answer_parts(response_bytes)
    except Unreadable as err:
        raise Refused(str(err)) from None
    if parts is None:
        return [
            verified_receipt(
                request_bytes, response_bytes, public_key_pem, model_sha256=model_sha256
            )
        ]
    try:
        public = TrustedKeys.of(public_key_pem)
    except ValueError as err:
        raise Refused(f"the public key: {err}") from None
    request = _request_object(request_bytes)
    n_cmpl = n_cmpl_of(request)
    if len(parts) % n_cmpl:
        raise Refused(
            f"the answer holds {len(parts)} answers, not a multiple of the {n_cmpl} completions "
            "the request asks for: one was left out"
        )
    out = []
    for part in parts:
        try:
            receipt = _checked_signature(part.receipt, public)
            _check_origin(receipt, request_bytes, model_sha256)
            try:
                view = answer_of(part.objects, part.form, receipt["api"], receipt, part.index)
            except Unreadable as err:
                raise Refused(str(err)) from None
            _check_answer(receipt, view)
            _check_request_fields(receipt, request, part.index % n_cmpl)
        except Refused as err:
            raise Refused(f"answer {part.index}: {err.reason}") from None
        out.append(receipt)
    return out


def check_envelope(
    request_bytes: bytes,
    response_bytes: bytes,
    envelope_bytes: bytes,
    public_key_pem: str | bytes,
    *,
    model_sha256: str | None = None,
) -> str:
    """``valid`` or ``refuse: <reason>`` for a DSSE envelope kept apart from its answer: the
    envelope is signed by the key, its Statement is a bankml receipt (the predicate) whose
    subjects are its own digests, and that receipt holds for the request and the answer as
    ``check_receipt`` checks one (an answer with one receipt)."""
    try:
        try:
            keys = TrustedKeys.of(public_key_pem)
        except ValueError as err:
            raise Refused(f"the public key: {err}") from None
        try:
            envelope = json.loads(envelope_bytes)
        except (ValueError, RecursionError):
            raise Refused("the envelope is not JSON") from None
        claimed = claimed_predicate(envelope)  # which key it says signed it, and when
        try:
            public = keys.for_receipt(claimed) if claimed else keys.current
            found = opened(envelope, public)
        except KeyNotTrusted as err:
            raise Refused(err.reason) from None
        except EnvelopeRefused as err:
            raise Refused(err.reason) from None
        receipt = found["predicate"]
        if receipt.get("receipt_version") != RECEIPT_VERSION or receipt.get("api") not in APIS:
            raise Refused("the Statement's predicate is not a bankml receipt")
        disagreement = matches(found, receipt)
        if disagreement is not None:
            raise Refused(disagreement)
        _check_origin(receipt, request_bytes, model_sha256)
        try:
            if answer_parts(response_bytes) is not None:
                raise Refused(
                    "the answer holds several answers: check each one's envelope in the answer"
                )
            view = read_answer(response_bytes, receipt["api"])
        except Unreadable as err:
            raise Refused(str(err)) from None
        _check_answer(receipt, view)
        _check_request_fields(receipt, _request_object(request_bytes))
    except Refused as err:
        return f"refuse: {err.reason}"
    return VALID


def check_receipt_log(path: str, public_key_pem: str | bytes) -> str:
    """``valid: N receipts`` or ``refuse: <where the log breaks>`` for the log at ``path`` (its
    rotated files too, oldest first: log.py): the chain holds and every receipt is signed by
    the key (its envelope too)."""
    try:
        public = TrustedKeys.of(public_key_pem)
    except ValueError as err:
        return f"refuse: the public key: {err}"

    def verify(receipt: Any) -> None:
        try:
            _checked_signature(receipt, public)
        except Refused as err:
            raise LogBroken(err.reason) from None

    files = log_files(path)
    if not files:
        return f"refuse: no log at {path}"
    try:
        count = check_log(files, verify)
    except LogBroken as err:
        return f"refuse: {err.reason}"
    except OSError as err:
        return f"refuse: {err.strerror or err}"
    return f"{VALID}: {count} receipts"


def _request_object(request_bytes: bytes) -> dict[str, Any]:
    try:
        request = json.loads(request_bytes)
    except ValueError:
        raise Refused("the request is not JSON") from None
    if not isinstance(request, dict):
        raise Refused("the request is not a JSON object")
    return request


def _check_origin(
    receipt: Mapping[str, Any], request_bytes: bytes, model_sha256: str | None
) -> None:
    """The receipt is for this request and (with a pin) this model file."""
    if sha256_hex(request_bytes) != receipt.get("request_sha256"):
        raise Refused("request_sha256 is not the sha256 of this request: another request")
    if model_sha256 is not None and receipt.get("model_sha256") != model_sha256.lower():
        raise Refused(
            f"model_sha256 {receipt.get('model_sha256')} is not the pinned model's {model_sha256}"
        )


def verified_receipt(
    request_bytes: bytes,
    response_bytes: bytes,
    public_key_pem: str | bytes,
    *,
    model_sha256: str | None = None,
) -> dict[str, Any]:
    """The receipt, once every check passed; Refused with the first reason otherwise."""
    try:
        public = TrustedKeys.of(public_key_pem)
    except ValueError as err:
        raise Refused(f"the public key: {err}") from None
    receipt = _signed_receipt(response_bytes, public)
    _check_origin(receipt, request_bytes, model_sha256)
    request = _request_object(request_bytes)
    try:
        view = read_answer(response_bytes, receipt["api"])
    except Unreadable as err:
        raise Refused(str(err)) from None
    _check_answer(receipt, view)
    _check_request_fields(receipt, request)
    return receipt


def _signed_receipt(response_bytes: bytes, public: TrustedKeys) -> dict[str, Any]:
    from bankml.receipts.answer import find_receipt

    try:
        _, receipt, _ = find_receipt(response_bytes)
    except Unreadable as err:
        raise Refused(str(err)) from None
    return _checked_signature(receipt, public)


def _checked_signature(receipt: Any, keys: TrustedKeys) -> dict[str, Any]:
    """``receipt`` itself, once it is a signed receipt of this key, unchanged since signing."""
    if not isinstance(receipt, dict):
        raise Refused("bankml_receipt is not one JSON object")
    version = receipt.get("receipt_version")
    if version != RECEIPT_VERSION:
        raise Refused(
            f"receipt version {version!r}, not {RECEIPT_VERSION}: an unsigned receipt proves "
            "nothing to a third party"
            if version is None
            else f"receipt version {version!r}, not {RECEIPT_VERSION}"
        )
    if receipt.get("alg") != ALG:
        raise Refused(f"alg {receipt.get('alg')!r}, not {ALG}")
    try:
        public = keys.for_receipt(receipt)
    except KeyNotTrusted as err:
        raise Refused(err.reason) from None
    signature = receipt.get("signature")
    try:
        raw_sig = base64.b64decode(signature, validate=True) if isinstance(signature, str) else b""
    except (binascii.Error, ValueError):
        raw_sig = b""
    try:
        message = signed_bytes(receipt)
    except ValueError as err:  # a NaN or infinity cannot be in a signed receipt
        raise Refused(f"the receipt cannot be encoded canonically ({err})") from None
    if len(raw_sig) != 64 or not verifies(public, raw_sig, message):
        raise Refused("the signature does not verify: the receipt was changed after signing")
    if "envelope" in receipt:  # signed on its own: its Statement must be this receipt's
        try:
            found = opened(receipt["envelope"], public)
        except EnvelopeRefused as err:
            raise Refused(err.reason) from None
        disagreement = matches(found, receipt)
        if disagreement is not None:
            raise Refused(f"the envelope: {disagreement}")
    if receipt.get("signed") is not True:
        raise Refused("the receipt says it is not signed")
    if receipt.get("api") not in APIS:
        raise Refused(f"api {receipt.get('api')!r} is not one bankml answers")
    return receipt


def _check_answer(receipt: Mapping[str, Any], view: Any) -> None:
    streamed = view.form != JSON
    if receipt.get("stream") is not streamed:
        raise Refused(
            f"the receipt is for a {'streamed' if receipt.get('stream') else 'whole'} answer, "
            f"this one is {'streamed' if streamed else 'whole'}"
        )
    if receipt.get("api") in EMBEDDING_APIS:  # vectors, not text (receipts/embedding.py)
        try:
            check_vectors(receipt, view.objects[0] if view.objects else None)
        except EmbeddingMismatch as err:
            raise Refused(str(err)) from None
        return
    if receipt.get("api") == RERANK:  # scores, not text (receipts/rerank.py)
        try:
            check_results(receipt, view.objects[0] if view.objects else None)
        except RerankMismatch as err:
            raise Refused(str(err)) from None
        return
    if text_sha256(view.text) != receipt.get("response_sha256"):
        raise Refused("response_sha256 is not the sha256 of this answer's text: another answer")
    carried = view.acts.receipt_fields()
    for name, what in (("reasoning_sha256", "reasoning"), ("tool_calls_sha256", "tool calls")):
        if name not in carried and name in receipt:
            raise Refused(f"the receipt hashes {what} this answer does not carry")
        if name in carried and name not in receipt:
            raise Refused(f"the answer carries {what} the receipt does not hash")
        if name in carried and carried[name] != receipt[name]:
            raise Refused(f"{name} is not the sha256 of this answer's {what}: another answer")
    if view.logprobs is None:
        if "logprobs_sha256" in receipt:
            raise Refused("the receipt hashes logprobs this answer does not carry")
    else:
        if "logprobs_sha256" not in receipt:
            raise Refused("the answer carries logprobs the receipt does not hash")
        if sha256_hex(canonical_logprobs(view.logprobs)) != receipt["logprobs_sha256"]:
            raise Refused("logprobs_sha256 is not the sha256 of this answer's logprobs")
    for name in ("prompt_tokens", "completion_tokens"):
        shown = getattr(view, name)
        if shown is not None and shown != receipt.get(name):
            raise Refused(f"the answer reports {name} {shown}, the receipt {receipt.get(name)}")
    if view.finish_reason is not None and view.finish_reason != receipt.get("finish_reason"):
        raise Refused(
            f"the answer's finish reason is {view.finish_reason!r}, "
            f"the receipt's {receipt.get('finish_reason')!r}"
        )
    cache_n = receipt.get("cache_n")
    prompt = receipt.get("prompt_tokens")
    if not (isinstance(cache_n, int) and isinstance(prompt, int) and 0 <= cache_n <= prompt):
        raise Refused(f"cache_n {cache_n!r} does not fit prompt_tokens {prompt!r}")


def _check_request_fields(
    receipt: Mapping[str, Any], request: dict[str, Any], completion: int = 0
) -> None:
    """The sampler fields the request names must resolve to the receipt's settings: the
    engine's own reading of the request over the receipt's values changes none of them. The
    prompt's completion ``completion`` (0: the first) of a request that names a seed ran with
    that seed plus ``completion`` (uint32), as llama-server seeds its child tasks."""
    from bankml.engine_cupy.sampler import DEFAULT_SEED, SamplerError, SamplerParams
    from bankml.receipts.sign import params_from_settings

    if receipt["api"].startswith("ollama") or receipt["api"] in (*EMBEDDING_APIS, RERANK):
        return  # Ollama's options are read by its own resource; these sample nothing
    try:
        settings = params_from_settings(receipt.get("sampler") or {})
    except (ValueError, TypeError, AttributeError) as err:
        raise Refused(f"the receipt's sampler settings: {err}") from None
    api = receipt["api"]
    read = chat_fields(api, request) if api in CONVERTED else request
    body = {k: v for k, v in read.items() if k not in _NOT_SAMPLER_FIELDS}
    try:
        asked = SamplerParams.from_request(body, settings)
    except (SamplerError, ValueError, TypeError) as err:
        raise Refused(f"the request's sampler fields are refused: {err}") from None
    if completion and read.get("seed") is not None and asked.seed != DEFAULT_SEED:
        asked = replace(asked, seed=(asked.seed + completion) % 2**32)
    if asked.seed == DEFAULT_SEED:  # no seed, or "draw one": the receipt names the one drawn
        asked = replace(asked, seed=settings.seed)
    for f in fields(asked):
        name, value = f.name, getattr(asked, f.name)
        if getattr(settings, name) != value:
            raise Refused(
                f"the request's {name} is {value!r}, the receipt's {getattr(settings, name)!r}"
            )
    if api == MESSAGES and is_p0(receipt):
        if settings.seed is not None:  # llama-server drops a Messages request's seed
            raise Refused("a Messages receipt names a seed, which llama-server never reads")
    elif settings.seed == DEFAULT_SEED or not isinstance(settings.seed, int):
        raise Refused("the receipt names no seed actually used")
    limits = [read[k] for k in _N_PREDICT_FIELDS.get(api, ()) if read.get(k) is not None]
    if limits and type(limits[0]) is int and limits[0] != receipt.get("n_predict"):
        raise Refused(
            f"the request asks for at most {limits[0]} tokens, the receipt's n_predict is "
            f"{receipt.get('n_predict')!r}"
        )
