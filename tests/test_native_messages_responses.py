"""Anthropic Messages (``/v1/messages``) and OpenAI Responses (``/v1/responses``) natively, side
by side with the real llama-server.

``bankml serve --native`` and llama-server (build 11434) on the default model, both given Qwen3's
chat template (``--chat-template-file``), asked the same requests in the same order over loopback:
the tool-call and reasoning conversations of tests/tool_chats.py in each API's shape (tool_use and
thinking blocks, function_call and reasoning items), plain chats with system prompts and stop
sequences, ``tool_choice``, a thinking budget, tool results, an assistant item merged into the
turn before it, Anthropic's billing-header system prompt, seeded sampling with prompt progress;
streamed and not. Every object and event is identical, once the ids both servers draw at random,
the times, the timings and the model's name (llama-server names its file's path) are set aside.
The token count routes and the refusals answer the same too (bankml answers 400 where
llama-server answers 500 for bad input). Each answer is signed: the receipt checks, covers the
calls and the reasoning, refuses a changed byte of a call, and replays identically on bankml's
engine and through llama-server. The official ``anthropic`` and ``openai`` clients read the
answers, streamed and not.
"""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from bankml.receipts.answer import find_receipt
from bankml.receipts.check import VALID, check_receipt
from bankml.receipts.keys import SigningKey
from bankml.receipts.replay import (
    IDENTICAL,
    LlamaServerProcess,
    open_replay_engine,
    replay_in_process,
    replay_with_llama_server,
)
from tests import support
from tests.native_server import NativeProcess, native_process
from tests.receipt_answers import edited
from tests.tool_chats import CALLING, REASONING, as_messages, as_responses

pytestmark = [pytest.mark.llama_server, pytest.mark.slow]

MESSAGES, RESPONSES = "/v1/messages", "/v1/responses"
PLAIN_MESSAGES = {
    "system": "Be brief.",
    "messages": [{"role": "user", "content": [{"type": "text", "text": "Name a colour."}]}],
    "max_tokens": 12,
    "temperature": 0,
}
PLAIN_RESPONSES = {
    "instructions": "Be brief.",
    "input": "Name a colour.",
    "max_output_tokens": 12,
    "temperature": 0,
    "cache_prompt": False,
}
RESULT = [
    {"role": "user", "content": "Weather in Rome?"},
    {
        "role": "assistant",
        "content": [
            {"type": "text", "text": "Let me check."},
            {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Rome"}},
        ],
    },
    {
        "role": "user",
        "content": [
            {
                "type": "tool_result",
                "tool_use_id": "t1",
                "content": [{"type": "text", "text": "Sun"}],
            }
        ],
    },
]
OUTPUT = [
    {"role": "user", "content": "Weather in Rome?"},
    {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hm."}]},
    {
        "type": "function_call",
        "call_id": "c1",
        "name": "get_weather",
        "arguments": '{"city":"Rome"}',
    },
    {
        "type": "function_call_output",
        "call_id": "c1",
        "output": [{"type": "input_text", "text": "Sun"}],
    },
]
TOOLS_MESSAGES = as_messages(CALLING)["tools"]
TOOLS_RESPONSES = as_responses(CALLING)["tools"]
# (name, route, body): each asked streamed and not, in this order, of both servers. A Messages
# request cannot turn the prompt cache off (llama-server drops the field); a Responses one can.
CASES: list[tuple[str, str, dict[str, Any]]] = [
    ("call", MESSAGES, as_messages(CALLING)),
    ("call", RESPONSES, {**as_responses(CALLING), "cache_prompt": False}),
    ("reasoning", MESSAGES, as_messages(REASONING)),
    ("reasoning", RESPONSES, {**as_responses(REASONING), "cache_prompt": False}),
    ("plain, a stop sequence", MESSAGES, {**PLAIN_MESSAGES, "stop_sequences": ["."]}),
    ("plain, seeded", RESPONSES, {**PLAIN_RESPONSES, "temperature": 0.9, "seed": 7}),
    ("any tool", MESSAGES, {**as_messages(CALLING), "tool_choice": {"type": "any"}}),
    ("required", RESPONSES, {**as_responses(CALLING), "tool_choice": "required"}),
    ("thinking budget", MESSAGES, {**as_messages(REASONING), "thinking": {"type": "enabled", "budget_tokens": 3}}),
    ("reasoning effort none", RESPONSES, {**as_responses(REASONING), "reasoning": {"effort": "none"}}),
    ("tool result", MESSAGES, {"messages": RESULT, "tools": TOOLS_MESSAGES, "max_tokens": 15, "temperature": 0}),
    ("call output, merged", RESPONSES, {"input": OUTPUT, "tools": TOOLS_RESPONSES, "max_output_tokens": 15, "temperature": 0}),
    (
        "billing header",
        MESSAGES,
        {
            "system": "x-anthropic-billing-header: cc_version=1; cch=a5145;Be brief.",
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 8,
            "temperature": 0,
        },
    ),
]  # fmt: skip
# every Responses prompt computed whole: a replay computes the whole prompt, and a prefix reused
# from an earlier request is computed in other batches, whose bits can differ
CASES = [(n, r, {**b, "cache_prompt": False} if r == RESPONSES else b) for n, r, b in CASES]
BAD: list[tuple[str, dict[str, Any]]] = [
    (MESSAGES, {"max_tokens": 8}),
    (MESSAGES, {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": "x"}),
    (MESSAGES, {"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}]}]}),
    (RESPONSES, {"input": [{"type": "bogus"}]}),
    (RESPONSES, {"model": "x"}),
    (RESPONSES, {"input": "x", "previous_response_id": "r1"}),
    (RESPONSES, {"input": [{"role": "user", "content": [{"type": "input_file"}]}]}),
    (RESPONSES, {"input": 5}),
    (RESPONSES + "/input_tokens", {"input": [{"role": "user", "content": [{"type": "x"}]}]}),
    (MESSAGES + "/count_tokens", {}),
]  # fmt: skip
# the ids both servers draw (32 letters and digits after the API's prefix)
DRAWN = re.compile(r"^(resp_|rs_|msg_|chatcmpl-|fc_|call_)?[0-9A-Za-z]{32}$")
UNCOMPARED = {"timings", "bankml_receipt", "model", "created_at", "completed_at", "time_ms"}


@pytest.fixture(scope="module")
def key(signing_key: SigningKey) -> SigningKey:
    return signing_key


@pytest.fixture(scope="module")
def native(template_pair: tuple[NativeProcess, Any]) -> NativeProcess:
    return template_pair[0]


@pytest.fixture(scope="module")
def reference(template_pair: tuple[NativeProcess, Any]) -> Any:
    return template_pair[1]


def post(url: str, body: dict[str, Any]) -> tuple[int, bytes]:
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=600) as answer:
            return answer.status, bytes(answer.read())
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def _compared(value: Any) -> Any:
    """``value`` without what differs between two servers' answers to one request."""
    if isinstance(value, dict):
        return {k: _compared(v) for k, v in value.items() if k not in UNCOMPARED}
    if isinstance(value, list):
        return [_compared(v) for v in value]
    if isinstance(value, str) and (drawn := DRAWN.match(value)):
        return (drawn.group(1) or "") + "<drawn>"
    return value


def objects(raw: bytes) -> list[Any]:
    """The whole answer, or each event of a stream as (its name, its data)."""
    text = raw.decode()
    if not text.startswith("event:"):
        return [_compared(json.loads(text))]
    out = []
    for block in text.split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.split("\n") if ": " in line)
        if lines:
            out.append((lines.get("event"), _compared(json.loads(lines["data"]))))
    return out


@pytest.fixture(scope="module")
def exchanges(native: NativeProcess, reference: Any) -> list[tuple[str, str, bytes, bytes, bytes]]:
    """(name, route, request, bankml's answer, llama-server's) for every case."""
    out = []
    for name, route, body in CASES:
        for stream in (False, True):
            asked = {**body, "stream": stream}
            ours = post(native.engine_url + route, asked)
            theirs = post(reference.url + route, asked)
            assert ours[0] == theirs[0] == 200, (name, route, ours, theirs)
            label = f"{route} {name}{' stream' if stream else ''}"
            out.append((label, route, json.dumps(asked).encode(), ours[1], theirs[1]))
    return out


def test_answers_are_llama_servers(
    exchanges: list[tuple[str, str, bytes, bytes, bytes]],
) -> None:
    calls = reasoned = 0
    for name, _, _, ours, theirs in exchanges:
        assert objects(ours) == objects(theirs), name
        calls += b'"tool_use"' in ours or b'"function_call"' in ours
        reasoned += b'"thinking"' in ours or b'"reasoning_text"' in ours
    assert calls >= 8 and reasoned >= 6, (calls, reasoned)
    print(
        f"\nMessages and Responses: {len(exchanges)} answers identical, {calls} with calls, "
        f"{reasoned} reasoned"
    )


def test_token_counts_and_refusals_are_llama_servers(native: NativeProcess, reference: Any) -> None:
    for route, body in [
        (MESSAGES + "/count_tokens", as_messages(CALLING)),
        (MESSAGES + "/count_tokens", PLAIN_MESSAGES),
        (RESPONSES + "/input_tokens", as_responses(CALLING)),
        ("/responses/input_tokens", PLAIN_RESPONSES),
    ]:
        ours, theirs = post(native.engine_url + route, body), post(reference.url + route, body)
        assert ours == theirs and ours[0] == 200, (route, ours, theirs)
    for route, body in BAD:
        ours, theirs = post(native.engine_url + route, body), post(reference.url + route, body)
        assert ours[0] == 400 and theirs[0] in (400, 500), (route, body, ours, theirs)
        message = json.loads(ours[1])["error"]["message"]
        assert message == json.loads(theirs[1])["error"]["message"], (route, body)
    # nothing was lost: the next answer is still llama-server's
    asked = {**PLAIN_MESSAGES, "stream": True}
    assert objects(post(native.engine_url + MESSAGES, asked)[1]) == objects(
        post(reference.url + MESSAGES, asked)[1]
    )


def _change_a_call(objects: list[dict[str, Any]]) -> None:
    """One byte more in the first tool call's arguments, wherever the answer carries them."""
    for obj in objects:
        holders = [obj, obj.get("response") or {}]
        for holder in holders:
            for block in holder.get("content") or holder.get("output") or []:
                if block.get("type") == "tool_use":
                    block["input"]["city"] += " "
                    return
                if block.get("type") == "function_call":
                    block["arguments"] += " "
                    return


def test_receipts_cover_calls_and_reasoning(
    exchanges: list[tuple[str, str, bytes, bytes, bytes]], key: SigningKey
) -> None:
    refused = 0
    for name, route, request, ours, _ in exchanges:
        receipt = find_receipt(ours)[1]
        assert receipt["api"] == ("messages" if route == MESSAGES else "responses")
        assert check_receipt(request, ours, key.public_key_pem) == VALID, name
        calls = b'"tool_use"' in ours or b'"function_call"' in ours
        assert ("tool_calls_sha256" in receipt) == calls, name
        if not calls or b"input_json_delta" in ours:  # a stream's own deltas: the call's start
            continue
        verdict = check_receipt(request, edited(ours, _change_a_call), key.public_key_pem)
        assert verdict.startswith("refuse: tool_calls_sha256"), (name, verdict)
        refused += 1
    assert refused >= 4


def test_the_answers_replay_on_the_engine_and_through_llama_server(
    exchanges: list[tuple[str, str, bytes, bytes, bytes]],
    template: Path,
    default_model: Path,
    default_fork: Path,
    llama_server_bin: Path,
) -> None:
    """The Responses answers (computed without the prompt cache, as a replay computes them) and
    the first Messages answer of each conversation (nothing in the cache to reuse), on the
    engine; the calls and the reasoning through llama-server too."""
    receipt = find_receipt(exchanges[0][3])[1]
    engine = open_replay_engine(
        str(default_model), str(default_fork), receipt, template.read_text(encoding="utf-8")
    )
    server = LlamaServerProcess(
        str(llama_server_bin),
        str(default_model),
        receipt["n_ctx"],
        receipt["cache_type"],
        args=["--chat-template-file", str(template)],
    )
    replayed = 0
    with server:
        for name, _, request, ours, _ in exchanges:
            if find_receipt(ours)[1].get("cache_n"):
                continue
            assert replay_in_process(request, ours, engine).startswith(IDENTICAL), name
            replayed += 1
            if name.split(" ")[1] in ("call", "reasoning"):
                outcome = replay_with_llama_server(request, ours, server)
                assert outcome.startswith(IDENTICAL), (name, outcome)
    assert replayed >= 12, replayed


def test_the_official_clients_read_the_answers(native: NativeProcess) -> None:
    import anthropic
    import openai

    claude = anthropic.Anthropic(base_url=native.engine_url, api_key="none", max_retries=0)

    def asked(chat: dict[str, Any]) -> dict[str, Any]:
        """The client's arguments (sampling fields it does not name go in extra_body)."""
        body = as_messages(chat)
        extra = {"temperature": body.pop("temperature")}
        return {**body, "extra_body": extra}

    message = claude.messages.create(model="default", **asked(CALLING))
    block = next(b for b in message.content if b.type == "tool_use")
    assert block.name == "get_weather" and block.input == {"city": "Rome"}
    assert message.stop_reason == "tool_use"
    assert message.model_extra["bankml_receipt"]["api"] == "messages"  # type: ignore[index]
    with claude.messages.stream(model="default", **asked(REASONING)) as events:
        streamed = events.get_final_message()
    assert streamed.content[0].type == "thinking" and streamed.content[0].thinking

    client = openai.OpenAI(base_url=f"{native.engine_url}/v1", api_key="none", max_retries=0)
    response = client.responses.create(model="default", **as_responses(CALLING))
    call = next(item for item in response.output if item.type == "function_call")
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Rome"}
    assert response.model_extra["bankml_receipt"]["api"] == "responses"  # type: ignore[index]
    events = list(client.responses.create(model="default", **as_responses(CALLING), stream=True))
    assert events[-1].type == "response.completed"
    assert events[-1].response.output[-1].type == "function_call"


def test_the_default_models_own_template_as_llama_servers(
    default_model: Path, default_fork: Path, llama_server_bin: Path, tmp_path: Path
) -> None:
    """Without a template file: the model's own chat template, a plain chat in both APIs."""
    server = native_process(default_model, default_fork, tmp_path)
    reference = support.LlamaServer(default_model, binary=llama_server_bin)
    with server, reference:
        for route, body in [(MESSAGES, PLAIN_MESSAGES), (RESPONSES, PLAIN_RESPONSES)]:
            for stream in (False, True):
                asked = {**body, "stream": stream}
                ours = post(server.engine_url + route, asked)
                theirs = post(reference.url + route, asked)
                assert ours[0] == theirs[0] == 200, (route, ours, theirs)
                assert objects(ours[1]) == objects(theirs[1]), (route, stream)
