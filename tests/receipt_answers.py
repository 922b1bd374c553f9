"""Real answers with version-2 receipts, shared by the receipt tests.

Every answer is computed by the real engine on the default model and signed by
``build_receipt_v2``, two ways:

- ``through_api``: ``bankml.api.chat`` / ``chat_stream`` (the Python API: chat only, and the
  request names its seed, since the API does not tell which seed it drew);
- ``as_served``: what the serving code does with a parsed request: the seed pinned first
  (``pin_seed``, so a request without one gets a drawn seed the receipt records), the run, the
  answer objects written by the resources' own ``Answer``, the receipt signed and, streamed, carried
  by the last regular event (``attach_to_stream``). This covers the completion APIs too.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from bankml.receipts.keys import SigningKey, keygen
from bankml.receipts.sign import (
    ReplayFacts,
    attach_to_stream,
    build_receipt_v2,
    engine_source_digest,
    native_facts,
    pin_seed,
    sampler_settings,
)

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
