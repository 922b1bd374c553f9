"""The official ``openai`` Python client against ``--native``, and ``bankml.chat`` against HTTP.

The client runs in a thread (it blocks) while the reactor serves the real engine on loopback.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import pytest_twisted
from twisted.internet.threads import deferToThread

from bankml import api
from tests import support
from tests.bankml_process import canonical_stream, check_receipt_on_last_chunk
from tests.native_support import Served, post


def client(served: Served) -> Any:
    import openai

    return openai.OpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0, timeout=120)


MESSAGES = [{"role": "user", "content": "Name a colour."}]


@pytest_twisted.ensureDeferred
async def test_openai_chat_streamed_and_not_agree(served: Served) -> None:
    def run() -> tuple[Any, str, list[Any]]:
        c = client(served)
        # cache_prompt false: both from an empty slot (a reused prefix may change the greedy token)
        whole = c.chat.completions.create(
            model="x",
            messages=MESSAGES,
            max_tokens=5,
            temperature=0,
            extra_body={"cache_prompt": False},
        )
        chunks = list(
            c.chat.completions.create(
                model="x",
                messages=MESSAGES,
                max_tokens=5,
                temperature=0,
                stream=True,
                extra_body={"cache_prompt": False},
            )
        )
        text = "".join((ch.choices[0].delta.content or "") for ch in chunks if ch.choices)
        return whole, text, chunks

    whole, text, chunks = await deferToThread(run)
    content = whole.choices[0].message.content
    assert content and content == text
    assert whole.usage.completion_tokens == 5 and whole.choices[0].finish_reason == "length"
    receipt = whole.model_extra["bankml_receipt"]
    assert receipt["response_sha256"] == hashlib.sha256(content.encode()).hexdigest()
    assert any(ch.choices and ch.choices[0].finish_reason == "length" for ch in chunks)


@pytest.mark.parametrize("include_usage", [False, True])
@pytest_twisted.ensureDeferred
async def test_openai_canonical_stream_loop(served: Served, include_usage: bool) -> None:
    text, chunks = await deferToThread(canonical_stream, client(served), include_usage)
    check_receipt_on_last_chunk(text, chunks, include_usage)


@pytest_twisted.ensureDeferred
async def test_openai_logprobs(served: Served) -> None:
    def run() -> Any:
        return client(served).chat.completions.create(
            model="x", messages=MESSAGES, max_tokens=3, temperature=0, logprobs=True, top_logprobs=3
        )

    resp = await deferToThread(run)
    entries = resp.choices[0].logprobs.content
    assert len(entries) == 3
    assert all(len(e.top_logprobs) == 3 and e.logprob <= 0 for e in entries)
    assert entries[0].top_logprobs[0].logprob >= entries[0].top_logprobs[1].logprob


@pytest_twisted.ensureDeferred
async def test_openai_json_schema_answer_follows_the_schema(served: Served) -> None:
    schema = {
        "type": "object",
        "properties": {"colour": {"type": "string", "maxLength": 12}},
        "required": ["colour"],
        "additionalProperties": False,
    }

    def run() -> Any:
        return client(served).chat.completions.create(
            model="x",
            messages=[{"role": "user", "content": "Give a colour as JSON."}],
            temperature=0,
            max_tokens=24,
            response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema}},
        )

    resp = await deferToThread(run)
    assert resp.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(resp.choices[0].message.content), schema)


@pytest_twisted.ensureDeferred
async def test_openai_completions(served: Served) -> None:
    def run() -> Any:
        return client(served).completions.create(
            model="x", prompt="The capital of France is", max_tokens=3, temperature=0
        )

    resp = await deferToThread(run)
    assert resp.choices[0].text and resp.usage.completion_tokens == 3
    assert (
        resp.model_extra["bankml_receipt"]["response_sha256"]
        == hashlib.sha256(resp.choices[0].text.encode()).hexdigest()
    )


@pytest_twisted.ensureDeferred
async def test_openai_client_sees_a_refusal_as_bad_request(served: Served) -> None:
    import openai

    def run() -> Any:
        return client(served).chat.completions.create(model="x", messages=MESSAGES, top_logprobs=2)

    try:
        await deferToThread(run)
    except openai.BadRequestError as err:
        assert "top_logprobs requires logprobs" in str(err)
    else:
        raise AssertionError("the refusal was not raised")


# --- bankml.chat: the same answer and receipt as HTTP ---------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_api_chat_equals_the_http_answer(served: Served) -> None:
    body = {"messages": MESSAGES, "max_tokens": 4, "temperature": 0, "cache_prompt": False}
    raw = json.dumps(body).encode()
    status, _, data = await deferToThread(post, served.url + "/v1/chat/completions", None, raw)
    http_answer = json.loads(data)
    direct = await deferToThread(api.chat, body, native=served.native)
    assert direct["choices"] == http_answer["choices"] and direct["usage"] == http_answer["usage"]
    keep = (
        "response_sha256",
        "request_sha256",
        "model_sha256",
        "prompt_tokens",
        "completion_tokens",
        "engine",
    )
    assert {k: direct["bankml_receipt"][k] for k in keep} == {
        k: http_answer["bankml_receipt"][k] for k in keep
    }
    events = await deferToThread(
        lambda: list(api.chat_stream(dict(body, stream=True), native=served.native))
    )
    text = "".join(
        e["choices"][0]["delta"].get("content") or "" for e in events if e.get("choices")
    )
    assert text == direct["choices"][0]["message"]["content"]
    assert (
        events[-1]["bankml_receipt"]["response_sha256"]
        == direct["bankml_receipt"]["response_sha256"]
    )


def test_api_refusal_is_an_api_error(served: Served) -> None:
    try:
        api.chat({"messages": MESSAGES, "top_logprobs": 1}, native=served.native)
    except api.ApiError as err:
        assert (
            err.status == 400
            and err.body["error"]["message"] == "top_logprobs requires logprobs to be set to true"
        )
    else:
        raise AssertionError("no refusal")


API_WITHOUT_TWISTED = """
import sys
import bankml
request = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0}
whole = bankml.chat(request)
events = list(bankml.chat_stream(dict(request, stream=True)))
assert whole["bankml_receipt"]["completion_tokens"] == 2, whole
assert "bankml_receipt" in events[-1], events
loaded = sorted(name for name in sys.modules if name.split(".")[0] == "twisted")
assert not loaded, loaded
print("no twisted")
"""


def test_api_chat_works_without_importing_twisted(default_model: Path, default_fork: Path) -> None:
    """``bankml.chat`` and ``chat_stream`` in a fresh interpreter: answered, receipts on the
    object and on the last event, and not one Twisted module loaded."""
    env = {
        **os.environ,
        "BANKML_MODEL": str(default_model),
        "BANKML_FORK": str(default_fork),
        "PYTHONPATH": os.pathsep.join(
            filter(None, [str(support.ROOT), os.environ.get("PYTHONPATH")])
        ),
    }
    done = subprocess.run(
        [sys.executable, "-c", API_WITHOUT_TWISTED],
        env=env,
        cwd=support.ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0 and "no twisted" in done.stdout, done.stderr[-3000:]
