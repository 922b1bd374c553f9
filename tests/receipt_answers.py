"""Real answers with version-2 receipts, shared by the receipt tests.

Every answer is computed by the real engine on the default model and signed by
``build_receipt_v2``, two ways:

- ``through_api``: ``bankml.api.chat`` / ``chat_stream`` (the Python API: chat only, and the
  request names its seed, since the API does not tell which seed it drew);
- ``as_served``: what the serving code does with a parsed request: the seed pinned first
  (``pin_seed``, so a request without one gets a drawn seed the receipt records), the run, the
  answer objects written by the resources' own ``Answer``, the receipt signed and, streamed, carried
  by the last regular event (``attach_to_stream``). This covers the completion APIs too.

The mutation suite's cases are built here too, from any such exchanges (the native engine's, or
P0's): ``tampered_cases`` (changes made after signing: the check alone must refuse each) and
``lies_signed`` (changes signed again by the key's holder: the check or the replay must refuse
each); ``load`` takes an answer apart into its objects, ``edited`` puts it back as the server
writes it with an edit applied.
"""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from bankml.receipts.answer import JSON, find_receipt, response_form, sse_payloads
from bankml.receipts.digest import sha256_hex
from bankml.receipts.keys import SigningKey, keygen
from bankml.receipts.sign import (
    ReplayFacts,
    attach_to_stream,
    build_receipt_v2,
    engine_source_digest,
    native_facts,
    pin_seed,
    sampler_settings,
    sign_receipt,
)
from tests import support

ENGINE_KIND = {"chat": "chat", "oai_completion": "completion", "llama_completion": "completion"}
MESSAGES = [{"role": "user", "content": "Name three colors."}]
OTHER_MESSAGES = [{"role": "user", "content": "Write one word about the sea."}]
PROMPT = "The three primary colors are"


@dataclass
class Exchange:
    """One request as sent and its answer as received, with how long each part took."""

    name: str
    api: str
    stream: bool
    seeded: bool
    request: bytes
    response: bytes
    wall_s: float  # the answer, from parse to the last byte written
    sign_s: float  # build_receipt_v2 alone


def _serialize(api: str, stream: bool, out: Any) -> bytes:
    from bankml.formats.nlohmann import dumps
    from bankml.serving.writers import sse_event

    if not stream:
        return dumps(out)
    tail = b"" if api == "llama_completion" else b"data: [DONE]\n\n"
    return b"".join(sse_event(e) for e in out) + tail


def _signed(base: dict[str, Any], facts: ReplayFacts, key: SigningKey) -> tuple[dict, float]:
    t0 = time.perf_counter()
    receipt = build_receipt_v2(base, facts, key)
    return receipt, time.perf_counter() - t0


def as_served(
    native: Any, key: SigningKey, name: str, api: str, body: dict, seeded: bool
) -> Exchange:
    from bankml.formats.answer import ChatAnswer, CompletionAnswer, LlamaCompletionAnswer

    stream = body.get("stream") is True
    raw = json.dumps(body).encode("utf-8")
    t0 = time.perf_counter()
    parsed = pin_seed(native.engine.parse_request(body, ENGINE_KIND[api]))
    kind = {"chat": ChatAnswer, "oai_completion": CompletionAnswer}.get(api, LlamaCompletionAnswer)
    answer = kind(native, api, raw, body, parsed, stream=stream)
    run = native.engine.run_steps(parsed)
    events: list[dict[str, Any]] = []
    for chunk in run:
        events += answer.on_chunk(chunk)
    summary = run.summary
    facts = native_facts(
        parsed,
        summary,
        api=api,
        stream=stream,
        n_ctx=native.engine.n_ctx,
        cache_type=native.engine.cache.cache_type,
        device=native.device,
    )
    if stream:
        events += answer.final_events(summary)
        receipt, sign_s = _signed(events[-1]["bankml_receipt"], facts, key)
        out: Any = attach_to_stream(events, receipt)
    else:
        out = answer.whole(summary)
        out["bankml_receipt"], sign_s = _signed(out["bankml_receipt"], facts, key)
    response = _serialize(api, stream, out)
    return Exchange(name, api, stream, seeded, raw, response, time.perf_counter() - t0, sign_s)


def through_api(native: Any, key: SigningKey, name: str, body: dict, stream: bool) -> Exchange:
    from bankml.api import chat, chat_stream
    from bankml.version import __version__

    assert "seed" in body, "the Python API does not say which seed it drew"
    raw = json.dumps(body).encode("utf-8")
    t0 = time.perf_counter()
    if stream:
        events = list(chat_stream(raw, native=native))
        base = events[-1]["bankml_receipt"]
        final = next(e for e in reversed(events) if "timings" in e)
        finish = next(
            c["finish_reason"]
            for e in reversed(events)
            for c in e.get("choices", [])
            if c.get("finish_reason")
        )
    else:
        whole = chat(raw, native=native)
        base, final, finish = whole["bankml_receipt"], whole, whole["choices"][0]["finish_reason"]
    parsed = native.engine.parse_request(body, "chat")  # the API's own reading of the request
    facts = ReplayFacts(
        api="chat",
        stream=stream,
        sampler=sampler_settings(parsed.sampler),
        n_predict=parsed.n_predict,
        n_ctx=native.engine.n_ctx,
        cache_type=native.engine.cache.cache_type,
        device=native.device,
        engine_version=__version__,
        engine_digest=engine_source_digest(),
        prompt_token_ids=parsed.prompt_tokens,
        completion_token_ids=None,  # the API's answer does not list them
        cache_n=final["timings"]["cache_n"],
        finish_reason=finish,
    )
    receipt, sign_s = _signed(base, facts, key)
    if stream:
        out: Any = attach_to_stream(events, receipt)
    else:
        out = {**whole, "bankml_receipt": receipt}
    response = _serialize("chat", stream, out)
    return Exchange(name, "chat", stream, True, raw, response, time.perf_counter() - t0, sign_s)


def make_exchanges(native: Any, key: SigningKey) -> list[Exchange]:
    greedy = {"temperature": 0}
    seeded = {"temperature": 0.9, "top_k": 40}
    chat = {"messages": MESSAGES, "max_tokens": 12}
    lp = {"logprobs": True, "top_logprobs": 2}
    return [
        through_api(native, key, "api chat greedy", {**chat, **greedy, "seed": 1}, False),
        through_api(
            native, key, "api chat seeded stream", {**chat, **seeded, **lp, "seed": 42}, True
        ),
        as_served(
            native,
            key,
            "chat greedy stream",
            "chat",
            {**chat, **greedy, **lp, "stream": True},
            False,
        ),
        as_served(
            native, key, "chat seeded (seed drawn)", "chat", {**chat, "temperature": 1.0}, True
        ),
        as_served(
            native,
            key,
            "chat seeded stream",
            "chat",
            {"messages": OTHER_MESSAGES, "max_tokens": 10, **seeded, "seed": 7, "stream": True},
            True,
        ),
        as_served(
            native,
            key,
            "oai completion greedy",
            "oai_completion",
            {"prompt": PROMPT, "max_tokens": 10, **greedy, "logprobs": 2},
            False,
        ),
        as_served(
            native,
            key,
            "oai completion seeded stream",
            "oai_completion",
            {"prompt": PROMPT, "max_tokens": 10, **seeded, "seed": 3, "stream": True},
            True,
        ),
        as_served(
            native,
            key,
            "completion seeded",
            "llama_completion",
            {"prompt": PROMPT, "n_predict": 10, **seeded, "seed": 5, "n_probs": 2},
            True,
        ),
        as_served(
            native,
            key,
            "completion greedy stream",
            "llama_completion",
            {"prompt": PROMPT, "n_predict": 10, **greedy, "stream": True},
            False,
        ),
        as_served(
            native,
            key,
            "completion stop word",
            "llama_completion",
            {"prompt": PROMPT, "n_predict": 16, **greedy, "stop": [","], "n_probs": 1},
            False,
        ),
    ]


@pytest.fixture(scope="session", name="native_engine")
def native_engine_fixture(default_model: Path, default_fork: Path) -> Any:
    from bankml.api import open_native

    return open_native(str(default_model), str(default_fork))


@pytest.fixture(scope="session", name="receipt_key")
def receipt_key_fixture(tmp_path_factory: pytest.TempPathFactory) -> SigningKey:
    return keygen(tmp_path_factory.mktemp("receipt-key") / "receipt-key.pem")


@pytest.fixture(scope="session", name="exchanges")
def exchanges_fixture(native_engine: Any, receipt_key: SigningKey) -> list[Exchange]:
    engine_source_digest()  # computed once per process, before any answer is timed
    receipt_key.sign(b"")  # the first signature of a process initializes the library
    return make_exchanges(native_engine, receipt_key)


@pytest.fixture(scope="session", name="replay_engine")
def replay_engine_fixture(
    default_model: Path, default_fork: Path, exchanges: list[Exchange]
) -> Any:
    from bankml.receipts.answer import find_receipt
    from bankml.receipts.replay import open_replay_engine

    _, receipt, _ = find_receipt(exchanges[0].response)
    return open_replay_engine(str(default_model), str(default_fork), receipt)


# --- taking an answer apart and putting it back as the server writes it ---------------------------


def load(ex_response: bytes) -> tuple[str, list[dict[str, Any]], bool]:
    """(form, the objects, whether the stream ended with [DONE])."""
    form = response_form(ex_response)
    if form == JSON:
        return form, [json.loads(ex_response)], False
    payloads = sse_payloads(ex_response)
    done = bool(payloads) and payloads[-1] == b"[DONE]"
    return form, [json.loads(p) for p in payloads if p != b"[DONE]"], done


def dump(form: str, objects: list[dict[str, Any]], done: bool) -> bytes:
    from bankml.formats.nlohmann import dumps
    from bankml.serving.writers import sse_event

    if form == JSON:
        return dumps(objects[0])
    return b"".join(sse_event(o) for o in objects) + (b"data: [DONE]\n\n" if done else b"")


def receipt_of(objects: list[dict[str, Any]]) -> dict[str, Any]:
    return objects[-1]["bankml_receipt"]


def edited(response: bytes, edit: Callable[[list[dict[str, Any]]], None]) -> bytes:
    form, objects, done = load(response)
    objects = copy.deepcopy(objects)
    edit(objects)
    return dump(form, objects, done)


def text_slots(api: str, objects: list[dict[str, Any]]) -> list[tuple[dict[str, Any], str]]:
    """(the dict holding a piece of the answer text, its key), in order."""
    out = []
    for obj in objects:
        if api == "llama_completion":
            out.append((obj, "content"))
            continue
        if api in ("responses", "messages"):
            out += typed_text_slots(api, obj)
            continue
        for choice in obj.get("choices") or []:
            if api == "oai_completion":
                out.append((choice, "text"))
            else:
                out.append((choice.get("delta") or choice.get("message") or {}, "content"))
    return [(d, k) for d, k in out if isinstance(d.get(k), str) and d[k]]


def typed_text_slots(api: str, obj: dict[str, Any]) -> list[tuple[dict[str, Any], str]]:
    """The Responses and Messages answers' text: a whole answer's output_text parts or text
    blocks, a stream's text deltas."""
    kind = obj.get("type")
    if kind == "response.output_text.delta":
        return [(obj, "delta")]
    if kind == "content_block_delta" and (obj.get("delta") or {}).get("type") == "text_delta":
        return [(obj["delta"], "text")]
    if api == "responses" and isinstance(obj.get("output"), list) and kind is None:
        items = [i for i in obj["output"] if i.get("type") == "message"]
        return [(p, "text") for i in items for p in i["content"] if p["type"] == "output_text"]
    if api == "messages" and kind == "message":
        return [(b, "text") for b in obj["content"] if b.get("type") == "text"]
    return []


def one_answer_byte(api: str) -> Callable[[list[dict[str, Any]]], None]:
    """Change the answer's first ASCII letter to another letter."""

    def edit(objects: list[dict[str, Any]]) -> None:
        for holder, key in text_slots(api, objects):
            text = holder[key]
            for i, c in enumerate(text):
                if c.isascii() and c.isalpha():
                    holder[key] = text[:i] + ("x" if c != "x" else "y") + text[i + 1 :]
                    return
        raise AssertionError("an answer without a letter")

    return edit


def one_request_byte(request: bytes) -> bytes:
    """A letter of the prompt (a message's content, the prompt, or a Responses input) changed."""
    field = (
        b"content" if b"messages" in request else b"input" if b'"input"' in request else b"prompt"
    )
    i = request.index(b'"', request.index(field) + len(field) + 1)
    i = next(j for j in range(i, len(request)) if chr(request[j]).isalpha())
    return request[:i] + (b"x" if request[i : i + 1] != b"x" else b"y") + request[i + 1 :]


def with_fields(request: bytes, **fields: Any) -> bytes:
    return json.dumps({**json.loads(request), **fields}).encode()


def changed(value: Any) -> Any:
    """Another value of the same kind."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, float):
        return value + 0.5
    if isinstance(value, str):
        return value[:-1] + ("0" if value[-1:] != "0" else "1") if value else "x"
    if isinstance(value, dict):
        first = sorted(value)[0]
        return {**value, first: changed(value[first])}
    if isinstance(value, list):
        return [*value, 0]
    return 0  # null


# --- answers changed after signing ----------------------------------------------------------------


def tampered_cases(
    exchanges: list[Exchange], key: SigningKey, other: SigningKey
) -> list[tuple[str, bytes, bytes]]:
    """Changes made after signing: the check alone must refuse each."""
    cases = []
    for n, ex in enumerate(exchanges):
        tag = ex.name
        cases.append(
            (
                f"{tag}: a byte of the answer",
                ex.request,
                edited(ex.response, one_answer_byte(ex.api)),
            )
        )
        cases.append((f"{tag}: a byte of the request", one_request_byte(ex.request), ex.response))
        cases.append(
            (
                f"{tag}: another seed in the request",
                with_fields(ex.request, seed=1234567),
                ex.response,
            )
        )
        cases.append(
            (
                f"{tag}: another temperature in the request",
                with_fields(ex.request, temperature=0.55),
                ex.response,
            )
        )

        def set_model(objects: list[dict[str, Any]]) -> None:
            receipt_of(objects)["model_sha256"] = support.DEFAULT_SHA256[::-1]

        cases.append((f"{tag}: another model sha256", ex.request, edited(ex.response, set_model)))
        for field in sorted(find_receipt(ex.response)[1]):

            def edit_field(objects: list[dict[str, Any]], field: str = field) -> None:
                r = receipt_of(objects)
                r[field] = changed(r[field])

            cases.append(
                (
                    f"{tag}: receipt field {field} edited",
                    ex.request,
                    edited(ex.response, edit_field),
                )
            )

        def drop_signature(objects: list[dict[str, Any]]) -> None:
            del receipt_of(objects)["signature"]

        cases.append((f"{tag}: signature removed", ex.request, edited(ex.response, drop_signature)))

        def other_signs(objects: list[dict[str, Any]]) -> None:
            objects[-1]["bankml_receipt"] = sign_receipt(receipt_of(objects), other)

        cases.append(
            (f"{tag}: signed by another key", ex.request, edited(ex.response, other_signs))
        )

        def other_signs_keyid_kept(objects: list[dict[str, Any]]) -> None:
            r = sign_receipt(receipt_of(objects), other)
            objects[-1]["bankml_receipt"] = {**r, "keyid": key.keyid}

        cases.append(
            (
                f"{tag}: another key's signature, this key's id",
                ex.request,
                edited(ex.response, other_signs_keyid_kept),
            )
        )
        for m, other_ex in enumerate(exchanges):
            if m == n or other_ex.stream != ex.stream or other_ex.api != ex.api:
                continue
            moved_receipt = find_receipt(ex.response)[1]

            def move(objects: list[dict[str, Any]], r: dict = moved_receipt) -> None:
                objects[-1]["bankml_receipt"] = r

            moved = edited(other_ex.response, move)
            cases.append((f"{tag}: receipt moved onto {other_ex.name}", other_ex.request, moved))
            if moved_receipt["response_sha256"] != find_receipt(other_ex.response)[1].get(
                "response_sha256"
            ):  # the same answer text (a drawn seed may give the greedy one): no change to refuse
                cases.append(
                    (f"{tag}: receipt moved onto {other_ex.name}, own request", ex.request, moved)
                )
    return cases


def lies_signed(exchanges: list[Exchange], key: SigningKey) -> list[tuple[str, bytes, bytes]]:
    """Changes signed again by the key's holder: the check or the replay must refuse each."""

    def resigned(
        response: bytes, edit: Callable[[dict[str, Any], list[dict[str, Any]]], None]
    ) -> bytes:
        def apply(objects: list[dict[str, Any]]) -> None:
            r = dict(receipt_of(objects))
            edit(r, objects)
            objects[-1]["bankml_receipt"] = sign_receipt(r, key)

        return edited(response, apply)

    cases = []
    for ex in exchanges:
        tag = ex.name

        def answer_byte(
            r: dict[str, Any], objects: list[dict[str, Any]], api: str = ex.api
        ) -> None:
            one_answer_byte(api)(objects)
            from bankml.receipts.answer import answer_of

            form = "sse" if r["stream"] else JSON
            r["response_sha256"] = sha256_hex(answer_of(objects, form, api, None).text.encode())

        cases.append(
            (
                f"{tag}: a byte of the answer, hash re-signed",
                ex.request,
                resigned(ex.response, answer_byte),
            )
        )

        def model(r: dict[str, Any], objects: list) -> None:
            r["model_sha256"] = support.DEFAULT_SHA256[::-1]

        cases.append(
            (f"{tag}: another model sha256, re-signed", ex.request, resigned(ex.response, model))
        )
        for name, value in (("seed", 1234567), ("temperature", 0.55)):
            request = with_fields(ex.request, **{name: value})

            def rehash(r: dict[str, Any], objects: list, request: bytes = request) -> None:
                r["request_sha256"] = sha256_hex(request)

            cases.append(
                (
                    f"{tag}: another {name} in the request, re-signed",
                    request,
                    resigned(ex.response, rehash),
                )
            )

        def count(r: dict[str, Any], objects: list) -> None:
            r["completion_tokens"] += 1

        cases.append(
            (
                f"{tag}: completion_tokens edited, re-signed",
                ex.request,
                resigned(ex.response, count),
            )
        )

        def prompt(r: dict[str, Any], objects: list) -> None:
            r["prompt_tokens_sha256"] = changed(r["prompt_tokens_sha256"])

        cases.append(
            (
                f"{tag}: prompt_tokens_sha256 edited, re-signed",
                ex.request,
                resigned(ex.response, prompt),
            )
        )

        def n_ctx(r: dict[str, Any], objects: list) -> None:
            r["n_ctx"] = r["n_ctx"] // 2

        cases.append((f"{tag}: n_ctx edited, re-signed", ex.request, resigned(ex.response, n_ctx)))
    return cases
