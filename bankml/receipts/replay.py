"""Replays: run a receipt's request again and compare the answer bit for bit.

``replay_in_process`` runs it on bankml's exact CPU engine (an ``Engine`` opened on the pinned file
with the receipt's context size and cache type); ``replay_with_llama_server`` sends it to an
unmodified llama-server started on the same file. Both use the seed the receipt names (a request
that gave none was answered with a seed bankml drew and recorded), evaluate the whole prompt
(no cached prefix), and compare the text, the token ids and the logprobs entries with the answer
as received, naming the first token that differs.

A Responses or Messages request is replayed as the chat completion llama-server converts it to
(convert.py): on the engine as a chat request, through llama-server on its chat endpoint; the
answer compared is its text, token count and (Messages) finish reason, the shapes' answers
carrying no logprobs. A P0 receipt (llama-server's answer, ``device`` null) is replayed too: its
prompt is compared by its token count (llama-server lists no ids). A P0 Messages receipt names
no seed (llama-server drops the request's and draws one it does not show), so only a seed-free
answer (temperature 0: ``seed_free``) is replayed; any other is ``cannot replay``. A native
Messages receipt names the seed bankml drew for it (the request's own is dropped, as
llama-server drops it), and replays like any other.

A replay answers ``identical: ...``, ``refuse: ...`` (the answer is not what the model computes
for the request, or the request does not resolve to the receipt's settings) or
``cannot replay: ...`` (the receipt's run cannot be reproduced here: a GPU's bits, an API the
replay does not speak, a seed nobody knows, an upstream whose context bankml did not set); only
``identical`` passes.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from bankml.llama_server import command_line
from bankml.receipts.acts import Acts
from bankml.receipts.answer import (
    AnswerView,
    Unreadable,
    answer_of,
    answer_parts,
    read_answer,
    read_plain_answer,
)
from bankml.receipts.canonical import canonical_json
from bankml.receipts.convert import ConversionError, n_cmpl_of, to_chat
from bankml.receipts.embedding import replay_embeddings
from bankml.receipts.kinds import (
    CONVERTED,
    EMBEDDING_APIS,
    ENGINE_KIND,
    LLAMA_EMBEDDING,
    OAI_EMBEDDINGS,
    RERANK,
)
from bankml.receipts.rerank import replay_rerank
from bankml.receipts.sign import (
    engine_source_digest,
    is_p0,
    sampler_settings,
    token_ids_sha256,
)

IDENTICAL = "identical"
# bankml's logprobs are a few ulps from llama-server's, not bit for bit: the logprob softmax sums
# the vocabulary in another order (docs/modules/sampler.md's limits). A replay through
# llama-server allows this much in logprob values (1.5e-5 seen on the default model), nothing in
# text, token ids, token text or bytes.
LLAMA_SERVER_LOGPROB_TOLERANCE = 1e-4
REPLAYABLE_DEVICES = ("cpu",)  # where the engine computes llama-server's own bits
ENDPOINTS = {
    "chat": "/v1/chat/completions",
    "oai_completion": "/v1/completions",
    "llama_completion": "/completion",
}


class CannotReplay(Exception):
    pass


@dataclass
class Replayed:
    """The replay's answer, in the terms the received answer is read in."""

    text: str
    pieces: list[str]  # each token's text where known, in order
    token_ids: list[int] | None
    logprobs: list[Any] | None
    completion_tokens: int | None
    finish_reason: str | None
    acts: Acts | None = None  # a chat answer's reasoning and tool calls, as its parse finds them


def seed_free(settings: Mapping[str, Any]) -> bool:
    """Whether these settings pick every token without the RNG: temperature <= 0 in the chain
    (only the most likely token left for the final draw), no mirostat, no dynamic temperature,
    no XTC (which draws too)."""
    temperature = settings.get("temperature")
    xtc = settings.get("xtc_probability") or 0
    return (
        isinstance(temperature, (int, float))
        and temperature <= 0
        and settings.get("mirostat") == 0
        and "temperature" in (settings.get("samplers") or ())
        and not (settings.get("dynatemp_range") or 0) > 0
        and not (xtc > 0 and (settings.get("xtc_threshold") or 0) <= 0.5)
    )


def replayable(receipt: Mapping[str, Any]) -> None:
    """CannotReplay when no replay can reproduce the receipt's run. A P0 receipt (llama-server's
    answer, no device named) is replayed: an ``identical`` proves the answer is the pinned
    model's on the CPU path, whatever llama-server ran on."""
    api = receipt.get("api")
    if api in EMBEDDING_APIS:
        _embedding_replayable(receipt)
        return
    if api == RERANK:
        if receipt.get("device") not in REPLAYABLE_DEVICES and not is_p0(receipt):
            raise CannotReplay(
                f"answered on {receipt.get('device')!r}, whose bits are not llama-server's: "
                "only a CPU answer is reproduced exactly"
            )
        return
    if api not in ENGINE_KIND and api not in CONVERTED:
        raise CannotReplay(f"the {api} API is not replayed")
    if receipt.get("device") not in REPLAYABLE_DEVICES and not is_p0(receipt):
        raise CannotReplay(
            f"answered on {receipt.get('device')!r}, whose bits are not llama-server's: "
            "only a CPU answer is reproduced exactly"
        )
    for name, what in (("n_ctx", "context size"), ("cache_type", "KV cache type")):
        if receipt.get(name) is None:
            raise CannotReplay(
                f"the receipt names no {what} (bankml did not start that llama-server)"
            )
    settings = receipt.get("sampler") or {}
    if settings.get("seed") is None and not seed_free(settings):
        raise CannotReplay(
            "the seed is not known (llama-server drops a Messages request's seed and draws one "
            "it does not show): only a greedy answer (temperature 0) is reproduced"
        )


def _chat_request(request_bytes: bytes, receipt: Mapping[str, Any]) -> dict[str, Any]:
    """The request as the engine reads it: a Responses or Messages request converted to the
    chat completion llama-server runs for it (CannotReplay where llama-server refuses it)."""
    body = json.loads(request_bytes)
    if not isinstance(body, dict):
        raise ValueError("the request is not a JSON object")
    if receipt["api"] in CONVERTED:
        try:
            return to_chat(receipt["api"], body)
        except RecursionError:
            raise CannotReplay("the request is nested too deep to convert") from None
        except ConversionError as err:
            raise CannotReplay(f"llama-server does not convert the request: {err}") from None
    return body


def _p0_note(receipt: Mapping[str, Any]) -> str:
    if not is_p0(receipt):
        return ""
    return (
        " (a P0 receipt names no device: a llama-server that computed on a GPU gives other bits "
        "than the CPU's)"
    )


def _receipt_and_answer(response_bytes: bytes) -> tuple[dict[str, Any], AnswerView]:
    from bankml.receipts.answer import find_receipt

    _, receipt, _ = find_receipt(response_bytes)
    return receipt, read_answer(response_bytes, receipt["api"])


def receipts_and_answers(response_bytes: bytes) -> list[tuple[dict[str, Any], AnswerView]]:
    """Each receipt of the response with its own answer, in index order (one for an answer
    with one receipt; answer_parts' for several prompts or completions)."""
    parts = answer_parts(response_bytes)
    if parts is None:
        return [_receipt_and_answer(response_bytes)]
    out = []
    for part in parts:
        if not isinstance(part.receipt, dict):
            raise Unreadable(f"answer {part.index}'s bankml_receipt is not one JSON object")
        view = answer_of(part.objects, part.form, part.receipt["api"], part.receipt, part.index)
        out.append((part.receipt, view))
    return out


def first_receipt(response_bytes: bytes) -> dict[str, Any]:
    """The receipt whose settings (n_ctx, cache type, device) open the replay's engine."""
    return receipts_and_answers(response_bytes)[0][0]


# --- bankml's engine, in this process -------------------------------------------------------------


@dataclass
class ReplayEngine:
    """bankml's engine opened on a verified file, and that file's sha256."""

    engine: Any
    model_sha256: str


def open_replay_engine(
    model: str, fork: str, receipt: Mapping[str, Any], chat_template: str | None = None
) -> ReplayEngine:
    """The engine a receipt's replay runs on: the pinned file (verified first, and it must be
    the receipt's model), the receipt's n_ctx and cache type, on the CPU (an EncoderEngine for
    a BERT file); ``chat_template``: the template source the answer's server was given
    (``--chat-template-file``) over the file's."""
    from bankml.engine_cupy.encoder_engine import EncoderEngine, is_encoder
    from bankml.engine_cupy.engine import Engine
    from bankml.gate.verify import Refused, verify

    try:
        verified = verify(model, fork)
    except Refused as err:
        raise CannotReplay(f"the model file: {err.reason}") from None
    if verified.sha256 != receipt.get("model_sha256"):
        raise ModelMismatch(
            f"the model file's sha256 is {verified.sha256}, the receipt names "
            f"{receipt.get('model_sha256')}"
        )
    opener = EncoderEngine.open if is_encoder(verified.path) else Engine.open  # BERT
    engine = opener(
        verified.path, n_ctx=receipt["n_ctx"], device="cpu", cache_type=receipt["cache_type"]
    )
    if chat_template is not None and engine.template is not None:
        engine.template = replace(engine.template, source=chat_template)
    return ReplayEngine(engine, verified.sha256)


class ModelMismatch(Exception):
    pass


def replay_in_process(request_bytes: bytes, response_bytes: bytes, replay: ReplayEngine) -> str:
    """Run the request on ``replay``'s engine (open_replay_engine's) and compare; an answer
    with several receipts (several prompts, ``n`` > 1) answer by answer: answer ``i`` is prompt
    ``i // n`` run alone with its receipt's seed."""
    try:
        answers = receipts_and_answers(response_bytes)
        if answers and answers[0][0].get("api") in EMBEDDING_APIS:
            return _replay_embeddings(request_bytes, [r for r, _ in answers], replay)
        if answers and answers[0][0].get("api") == RERANK:
            replayable(answers[0][0])
            return _replay_rerank(request_bytes, answers[0][0], replay)
        for receipt, _ in answers:
            replayable(receipt)
    except Unreadable as err:
        return f"refuse: {err}"
    except CannotReplay as err:
        return f"cannot replay: {err}"
    if len(answers) == 1:
        return _replay_answer(request_bytes, *answers[0], replay, None)
    verdicts = []
    for index, (receipt, original) in enumerate(answers):
        verdict = _replay_answer(request_bytes, receipt, original, replay, index)
        if not verdict.startswith(IDENTICAL):
            head, _, reason = verdict.partition(": ")
            return f"{head}: answer {index}: {reason}"
        verdicts.append(verdict)
    each = "; ".join(f"{i}: {v.partition(': ')[2]}" for i, v in enumerate(verdicts))
    return f"{IDENTICAL}: {len(answers)} answers ({each})"


def _embedding_replayable(receipt: Mapping[str, Any]) -> None:
    """An embedding answer is replayed on bankml's engine: a CPU answer of its own with its
    pooling named (llama-server's through P0 does not say its pooling)."""
    if receipt.get("api") not in (OAI_EMBEDDINGS, LLAMA_EMBEDDING):
        raise CannotReplay(f"the {receipt.get('api')} API is not replayed")
    if receipt.get("device") not in REPLAYABLE_DEVICES:
        raise CannotReplay(
            f"answered on {receipt.get('device')!r}: only bankml's own CPU embeddings are "
            "replayed (a P0 receipt does not name llama-server's pooling)"
        )


def _replay_embeddings(
    request_bytes: bytes, receipts: Sequence[Mapping[str, Any]], replay: ReplayEngine
) -> str:
    """An embedding answer's replay (receipts/embedding.py): CPU answers of bankml's engine."""
    for receipt in receipts:
        _embedding_replayable(receipt)
    return replay_embeddings(request_bytes, receipts, replay.engine)


def _replay_rerank(request_bytes: bytes, receipt: Mapping[str, Any], replay: ReplayEngine) -> str:
    """A rerank answer's replay (receipts/rerank.py): the scores on bankml's encoder."""
    if receipt.get("model_sha256") != replay.model_sha256:
        return (
            f"refuse: the model file's sha256 is {replay.model_sha256}, the receipt names "
            f"{receipt.get('model_sha256')}"
        )
    return replay_rerank(request_bytes, receipt, replay.engine)


def _replay_answer(
    request_bytes: bytes,
    receipt: dict[str, Any],
    original: AnswerView,
    replay: ReplayEngine,
    index: int | None,
) -> str:
    """One receipt's replay: the request's only answer (``index`` None), or its answer
    ``index`` among several."""
    from bankml.engine_cupy.request import RequestError

    if receipt.get("model_sha256") != replay.model_sha256:
        return (
            f"refuse: the model file's sha256 is {replay.model_sha256}, the receipt names "
            f"{receipt.get('model_sha256')}"
        )
    engine = replay.engine
    if engine.n_ctx != receipt["n_ctx"] or engine.cache.cache_type != receipt["cache_type"]:
        return (
            f"cannot replay: the engine holds n_ctx {engine.n_ctx} and a "
            f"{engine.cache.cache_type} cache; the receipt's run had {receipt['n_ctx']} and "
            f"{receipt['cache_type']}"
        )
    kind = ENGINE_KIND.get(receipt["api"], "chat")
    try:
        body = _chat_request(request_bytes, receipt)
        if index is None:
            parsed = engine.parse_request(body, kind)
        else:  # the prompt alone, one completion (the seed is the receipt's, set below)
            n_cmpl = n_cmpl_of(body)
            single = {k: v for k, v in body.items() if k not in ("n", "n_cmpl")}
            prompts = engine.parse_batch(single, kind)
            if index // n_cmpl >= len(prompts):
                return f"refuse: the request has {len(prompts)} prompts, not answer {index}'s"
            parsed = prompts[index // n_cmpl]
    except CannotReplay as err:
        return f"cannot replay: {err}"
    except (RequestError, ValueError) as err:
        return f"refuse: the engine refuses the request ({err})"
    seed = receipt["sampler"].get("seed")
    # a seed-free run (replayable's check) draws nothing: any seed gives the same answer
    run_seed = 0 if seed is None else seed
    parsed = replace(parsed, sampler=replace(parsed.sampler, seed=run_seed), cache_prompt=False)
    settings = sampler_settings(parsed.sampler)
    if seed is None:
        settings["seed"] = None
    for name, value in settings.items():
        if canonical_json(value) != canonical_json(receipt["sampler"].get(name)):
            return (
                f"refuse: on this model the request resolves {name} to {value!r}, the receipt "
                f"says {receipt['sampler'].get(name)!r}"
            )
    if parsed.n_predict != receipt.get("n_predict"):
        return f"refuse: the request resolves n_predict to {parsed.n_predict}, the receipt says {receipt.get('n_predict')}"
    prompt_sha = receipt.get("prompt_tokens_sha256")
    if prompt_sha is None and is_p0(receipt):  # llama-server lists no ids: the count at least
        if len(parsed.prompt_tokens) != receipt.get("prompt_tokens"):
            return (
                f"refuse: the request's prompt is {len(parsed.prompt_tokens)} tokens on this "
                f"model, the receipt says {receipt.get('prompt_tokens')}"
            )
    elif token_ids_sha256(parsed.prompt_tokens) != prompt_sha:
        return "refuse: the request's prompt tokens on this model are not the receipt's"
    replayed = _run(engine, parsed, receipt)
    if replayed.acts is not None:
        acts = acts_difference(original.acts, replayed.acts, receipt["api"] in CONVERTED)
        if acts is not None:
            return f"refuse: {acts}"
    # llama-server's logprobs (a P0 answer's) are a few ulps from the engine's: the tolerance of
    # a replay through llama-server, for the values only
    tolerance = LLAMA_SERVER_LOGPROB_TOLERANCE if is_p0(receipt) else 0.0
    result = compare(original, receipt, replayed, tolerance)
    verdict = result.verdict
    if verdict != IDENTICAL:
        if is_p0(receipt):
            verdict += _p0_note(receipt)
        elif receipt.get("engine_digest") != engine_source_digest():
            verdict += " (the receipt's engine sources differ from this bankml's)"
        return f"refuse: {verdict}"
    if not is_p0(receipt):
        return (
            f"{IDENTICAL}: {len(replayed.pieces)} tokens, text, token ids and logprobs bit for bit"
        )
    told = f"{IDENTICAL}: the text of {len(replayed.pieces)} tokens bit for bit"
    if not original.logprobs:
        return told
    if result.logprob_distance == 0.0:
        return f"{told}, logprobs too"
    return (
        f"{told}; logprobs {result.logprob_distance:.2g} apart at most "
        f"(within {LLAMA_SERVER_LOGPROB_TOLERANCE:g})"
    )


def _run(engine: Any, parsed: Any, receipt: Mapping[str, Any]) -> Replayed:
    """The run's answer as the serving code writes it (bankml/resources/openai.py's Answer):
    streamed, the chunks' texts joined and every chunk's entry (a chat entry only where its
    token made an event); whole, the summary's text and the entries less a stop word's own."""
    run = engine.run_steps(parsed)
    chunks = list(run)
    summary = run.summary
    streamed = bool(receipt.get("stream"))
    entries: list[Any] = []
    for index, chunk in enumerate(chunks):
        if chunk.entry is None:
            continue
        if streamed and receipt["api"] == "chat" and not (chunk.text or index == 0):
            continue
        entries.append(chunk.entry)
    if not streamed and summary.stopping_word and entries:
        drop = min(len(entries), len(engine.tokenize(summary.stopping_word)))
        entries = entries[: len(entries) - drop]
    text = "".join(c.text for c in chunks) if streamed else summary.text
    wants = int(getattr(parsed, "n_probs", 0) or 0) > 0
    finish, acts = summary.finish_reason, None
    parse = getattr(parsed, "chat_parser", None)
    if parse is not None and (receipt["api"] == "chat" or receipt["api"] in CONVERTED):
        # the answer split by the chat format's parse, as the server wrote it (a continued
        # message's text starts its content; streamed without echo, what it held already is
        # not sent again)
        message = parse(summary.text, False)
        acts = Acts()
        acts.add_reasoning(message.reasoning_content)
        for position, call in enumerate(message.tool_calls):
            function = {"name": call.name, "arguments": call.arguments}
            acts.add_call({"id": call.id, "type": "function", "function": function}, position)
        text = message.content
        options = getattr(parsed, "options", {}) or {}
        if streamed and not options.get("prefill_streamed", True):
            held = parse("", True).content
            text = text[len(held) :] if text.startswith(held) else text
        if message.tool_calls and finish == "stop":
            finish = "tool_calls"
    return answered_as(
        receipt,
        Replayed(
            text=text,
            pieces=[c.text for c in chunks],
            token_ids=list(summary.tokens),
            logprobs=entries if wants and entries else None,
            completion_tokens=summary.completion_tokens,
            finish_reason=finish,
            acts=acts,
        ),
    )


def answered_as(receipt: Mapping[str, Any], replayed: Replayed) -> Replayed:
    """The replayed chat completion in the terms of the receipt's API: a Responses or Messages
    answer carries no logprobs, and a Responses answer no finish reason."""
    if receipt["api"] not in CONVERTED:
        return replayed
    finish = None if receipt["api"] == "responses" else replayed.finish_reason
    return replace(replayed, logprobs=None, finish_reason=finish)


# --- comparing ------------------------------------------------------------------------------------


def _first_text_difference(pieces: Sequence[str], original: str) -> tuple[int, str] | None:
    """(index of the first token whose text the received answer does not continue with, that text)."""
    seen = ""
    for index, piece in enumerate(pieces):
        seen += piece
        if not original.startswith(seen):
            return index, piece
    return None


_VALUE_KEYS = ("logprob", "prob")


def _value_distance(a: Any, b: Any) -> float | None:
    """The largest difference between two logprobs entries' values (logprob or prob, theirs and
    their top candidates'), or None when anything else differs (ids, token text, bytes, keys)."""
    if not (isinstance(a, dict) and isinstance(b, dict)) or set(a) != set(b):
        return None
    worst = 0.0
    for key in a:
        x, y = a[key], b[key]
        if key in _VALUE_KEYS:
            if not (isinstance(x, (int, float)) and isinstance(y, (int, float))):
                if x != y:
                    return None
                continue
            worst = max(worst, abs(float(x) - float(y)))
        elif isinstance(x, list) and isinstance(y, list) and key.startswith("top_"):
            if len(x) != len(y):
                return None
            for u, v in zip(x, y):
                d = _value_distance(u, v)
                if d is None:
                    return None
                worst = max(worst, d)
        elif canonical_json(x) != canonical_json(y):
            return None
    return worst


@dataclass
class Comparison:
    verdict: str  # IDENTICAL or what differs first
    logprob_distance: float = 0.0  # the largest logprob difference tolerated


def compare(
    original: AnswerView,
    receipt: Mapping[str, Any],
    replayed: Replayed,
    logprob_tolerance: float = 0.0,
) -> Comparison:
    """IDENTICAL, or what differs first (the token, by index from 0). Text and token ids are
    compared bit for bit; logprobs too unless ``logprob_tolerance`` allows their values (never
    their ids, text or bytes) to differ by that much."""
    mine = original.logprobs or []
    theirs = replayed.logprobs or []
    worst = 0.0
    for index, (a, b) in enumerate(zip(mine, theirs)):
        if canonical_json(a) == canonical_json(b):
            continue
        distance = _value_distance(a, b) if logprob_tolerance > 0 else None
        if distance is None or distance > logprob_tolerance:
            return Comparison(_entry_difference(index, a, b, distance))
        worst = max(worst, distance)
    if replayed.text != original.text:
        found = _first_text_difference(replayed.pieces, original.text)
        if found is not None:
            index, piece = found
            token = replayed.token_ids[index] if replayed.token_ids else None
            named = f" (id {token})" if token is not None else ""
            where = original.text[len("".join(replayed.pieces[:index])) :][:20]
            return Comparison(
                f"the answer differs at token {index}: the replay computes {piece!r}{named} "
                f"where the answer has {where!r}"
            )
        return Comparison(
            f"the answer is longer than the replay's {len(replayed.pieces)} tokens: "
            f"{original.text[len(replayed.text) :][:40]!r} follows"
        )
    if (original.logprobs is None) != (replayed.logprobs is None) or len(mine) != len(theirs):
        return Comparison(
            f"the answer carries {len(mine)} logprobs entries, the replay {len(theirs)}"
        )
    expected_tokens = receipt.get("completion_tokens_sha256")
    if replayed.token_ids is not None and expected_tokens is not None:
        if token_ids_sha256(replayed.token_ids) != expected_tokens:
            return Comparison(
                "the same text from other token ids (completion_tokens_sha256 differs)"
            )
    counted = receipt.get("completion_tokens")
    # llama-server reports the first answer's count only: a P0 receipt of a later one names none
    unknown = counted is None and is_p0(receipt)
    if (
        replayed.completion_tokens is not None
        and not unknown
        and replayed.completion_tokens != counted
    ):
        return Comparison(
            f"the replay generates {replayed.completion_tokens} tokens, the receipt says "
            f"{receipt.get('completion_tokens')}"
        )
    if replayed.finish_reason is not None and replayed.finish_reason != receipt.get(
        "finish_reason"
    ):
        return Comparison(
            f"the replay finishes with {replayed.finish_reason!r}, the receipt says "
            f"{receipt.get('finish_reason')!r}"
        )
    return Comparison(IDENTICAL, worst)


def _entry_difference(index: int, a: Any, b: Any, distance: float | None) -> str:
    if isinstance(a, dict) and isinstance(b, dict):
        if a.get("id") != b.get("id"):
            return (
                f"the answer differs at token {index}: the answer has id {a.get('id')} "
                f"{a.get('token')!r}, the replay computes id {b.get('id')} {b.get('token')!r}"
            )
        named = f"token {index} (id {a.get('id')} {a.get('token')!r})"
        if distance is not None:
            return f"{named}: logprobs {distance:.3g} apart"
        for key in sorted(set(a) | set(b)):
            if canonical_json(a.get(key)) != canonical_json(b.get(key)):
                return f"{named}: {key} differs"
    return f"token {index}: the logprobs entries differ"


# --- an unmodified llama-server -------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: bytes, timeout: float) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


class LlamaServerProcess:
    """llama-server on a free loopback port with a receipt's n_ctx and cache type; ``args``:
    more of llama-server's flags, as the answer's llama-server ran with them (a P0 started with
    ``--chat-template-file F``: the same here); ``reasoning_off``: bankml's ``--reasoning off``,
    the default P0 starts llama-server with (``is_p0``)."""

    def __init__(
        self,
        binary: str,
        model: str,
        n_ctx: int,
        cache_type: str = "f16",
        threads: int = 2,
        args: Sequence[str] = (),
        reasoning_off: bool = False,
    ) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.n_ctx = n_ctx
        self.cache_type = cache_type
        cache = ["-ctk", cache_type, "-ctv", cache_type] if cache_type != "f16" else []
        cmd = command_line(
            binary,
            model,
            "127.0.0.1",
            self.port,
            threads,
            n_ctx,
            # thinking as llama-server decides it from the template, as bankml's engine does;
            # a P0 answer's llama-server ran with bankml's --reasoning off
            reasoning_off=reasoning_off,
            give_way_to=args,
            after=[*cache, *args],
        )
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def wait_healthy(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise CannotReplay(f"llama-server exited with {self.proc.returncode}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.1)
        self.stop()
        raise CannotReplay("llama-server did not become healthy")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> LlamaServerProcess:
        self.wait_healthy()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def replay_request_body(request_bytes: bytes, receipt: Mapping[str, Any]) -> bytes:
    """The request as a replay sends it: the receipt's seed where the request named none (a P0
    Messages receipt names none: its answer is seed-free), the receipt's stream form, and the
    whole prompt evaluated; a Responses or Messages request as the chat completion llama-server
    converts it to, sent to its chat endpoint (where ``cache_prompt`` is read)."""
    from bankml.engine_cupy.sampler import DEFAULT_SEED

    body = _chat_request(request_bytes, receipt)
    seed = body.get("seed")
    drawn = receipt["sampler"].get("seed")
    if (seed is None or seed == -1 or seed == DEFAULT_SEED) and drawn is not None:
        body["seed"] = drawn
    body["stream"] = bool(receipt.get("stream"))
    body["cache_prompt"] = False
    return json.dumps(body).encode("utf-8")


def replay_with_llama_server(
    request_bytes: bytes, response_bytes: bytes, server: LlamaServerProcess
) -> str:
    """Send the request to ``server`` (started on the pinned file) and compare."""
    try:
        receipt, original = _receipt_and_answer(response_bytes)
        replayable(receipt)
    except Unreadable as err:
        return f"refuse: {err}"
    except CannotReplay as err:
        return f"cannot replay: {err}"
    if server.n_ctx != receipt["n_ctx"] or server.cache_type != receipt["cache_type"]:
        return "cannot replay: llama-server runs another n_ctx or cache type than the receipt's"
    try:
        body = replay_request_body(request_bytes, receipt)
    except CannotReplay as err:
        return f"cannot replay: {err}"
    except ValueError as err:
        return f"refuse: the request: {err}"
    api = receipt["api"] if receipt["api"] in ENDPOINTS else "chat"
    status, raw = _post(server.url + ENDPOINTS[api], body, timeout=600)
    if status != 200:
        return f"refuse: llama-server answers {status}: {raw[:200].decode('utf-8', 'replace')}"
    try:
        theirs = read_plain_answer(raw, api)
    except Unreadable as err:
        return f"refuse: llama-server's answer: {err}"
    if receipt.get("prompt_tokens_sha256") is None and theirs.prompt_tokens is not None:
        if theirs.prompt_tokens != receipt.get("prompt_tokens"):
            return (
                f"refuse: llama-server reads the request as a {theirs.prompt_tokens}-token "
                f"prompt, the receipt says {receipt.get('prompt_tokens')}"
            )
    entries = [e for e in theirs.logprobs or [] if isinstance(e, dict)]
    ids = [e["id"] for e in entries if isinstance(e.get("id"), int)]
    replayed = Replayed(
        text=theirs.text,
        pieces=theirs.pieces,
        token_ids=ids if ids and len(ids) == len(entries) == theirs.completion_tokens else None,
        logprobs=theirs.logprobs,
        completion_tokens=theirs.completion_tokens,
        finish_reason=theirs.finish_reason,
    )
    replayed = answered_as(receipt, replayed)
    result = compare(original, receipt, replayed, LLAMA_SERVER_LOGPROB_TOLERANCE)
    if result.verdict != IDENTICAL:
        return f"refuse: {result.verdict}{_p0_note(receipt)}"
    acts = acts_difference(original.acts, theirs.acts, receipt["api"] in CONVERTED)
    if acts is not None:
        return f"refuse: {acts}{_p0_note(receipt)}"
    n = replayed.completion_tokens
    told = f"the text of {n} tokens" if n is not None else "the text"
    if not original.logprobs:
        return f"{IDENTICAL}: {told} bit for bit"
    if result.logprob_distance == 0.0:
        return f"{IDENTICAL}: {told}, token ids and logprobs bit for bit"
    return (
        f"{IDENTICAL}: {told} and token ids bit for bit; logprobs "
        f"{result.logprob_distance:.2g} apart at most (within {LLAMA_SERVER_LOGPROB_TOLERANCE:g})"
    )


def acts_difference(original: Acts, replayed: Acts, converted: bool = False) -> str | None:
    """What differs first between two answers' reasoning and tool calls, else None. A tool
    call's id is not compared: llama-server draws each at random. ``converted``: the answer is
    a Responses or Messages one replayed as a chat completion; its calls' arguments are compared
    as JSON values (Messages sends them as an object) and their type is the API's own."""
    if original.reasoning_text != replayed.reasoning_text:
        return (
            f"the reasoning differs: the replay's is {replayed.reasoning_text[:40]!r}, the "
            f"answer's {original.reasoning_text[:40]!r}"
        )
    mine, theirs = original.tool_calls(), replayed.tool_calls()
    if len(mine) != len(theirs):
        return f"the answer makes {len(mine)} tool calls, the replay {len(theirs)}"
    for index, (a, b) in enumerate(zip(mine, theirs)):
        for name in ("name", "arguments") if converted else ("type", "name", "arguments"):
            if name == "arguments" and converted and _same_json(a.arguments, b.arguments):
                continue
            if getattr(a, name) != getattr(b, name):
                return (
                    f"tool call {index}'s {name} differs: the replay's is "
                    f"{getattr(b, name)[:60]!r}, the answer's {getattr(a, name)[:60]!r}"
                )
    return None


def _same_json(a: str, b: str) -> bool:
    try:
        return bool(json.loads(a) == json.loads(b))
    except ValueError:
        return False


def llama_server_threads() -> int:
    return max(1, min(4, os.cpu_count() or 1))
