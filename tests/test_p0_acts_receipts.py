"""Receipts that cover what an agent acts on: P0's tool calls and reasoning.

A real ``bankml serve --spawn`` in front of the real llama-server on the default model, given
Qwen3's chat template from llama.cpp's models/templates (``--chat-template-file``), asked over
loopback. The tiny model makes a tool call when the conversation shows it two calls first; it
reasons when the request continues an assistant turn that holds only reasoning (llama-server
then opens the reasoning block for it). llama-server splits both out of the text; the receipt
hashes them as sent (``tool_calls_sha256``, ``reasoning_sha256``), streamed and not.

Each answer's receipt is ``valid``; one byte changed in a tool call's arguments, its name or id,
or the reasoning, a call taken away, is refused; the replay through an unmodified llama-server
with the same template reproduces the answer, its reasoning and its calls (their ids aside:
llama-server draws them); the official ``openai`` client reads the calls.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest

from bankml.receipts.answer import find_receipt
from bankml.receipts.check import VALID, check_receipt
from bankml.receipts.keys import SigningKey, keygen
from bankml.receipts.replay import IDENTICAL, LlamaServerProcess, replay_with_llama_server
from tests import support
from tests.bankml_process import BankmlProcess, check_receipt_cli, post, spawned_p0
from tests.receipt_answers import Exchange, edited
from tests.tool_chats import CALLING as CHAT_CALLING
from tests.tool_chats import REASONING, WEATHER

pytestmark = [pytest.mark.llama_server, pytest.mark.slow]

# P0 starts llama-server with --reasoning off; Qwen3's template then closes an empty reasoning
# block in the prompt, and the tiny model no longer calls
CALLING = {**CHAT_CALLING, "chat_template_kwargs": {"enable_thinking": True}}
EXCHANGES: list[tuple[str, dict[str, Any]]] = [
    ("tool call", CALLING),
    ("tool call stream", {**CALLING, "stream": True}),
    ("tool call seeded", {**CALLING, "temperature": 0.8, "seed": 3}),
    ("reasoning", REASONING),
    ("reasoning stream", {**REASONING, "stream": True}),
]
# the same conversations in the Responses and Anthropic Messages shapes
RESPONSES_CALLING = {
    "input": [
        {"role": "user", "content": "What is the weather in Paris?"},
        {
            "type": "function_call",
            "call_id": "a1",
            "name": "get_weather",
            "arguments": '{"city": "Paris"}',
        },
        {"role": "user", "content": "What is the weather in London?"},
        {
            "type": "function_call",
            "call_id": "a2",
            "name": "get_weather",
            "arguments": '{"city": "London"}',
        },
        {"role": "user", "content": "What is the weather in Rome?"},
    ],
    "tools": [{"type": "function", **WEATHER["function"]}],
    "max_output_tokens": 40,
    "temperature": 0,
    "chat_template_kwargs": {"enable_thinking": True},
}


def _tool_use(call_id: str, city: str) -> dict[str, Any]:
    block = {"type": "tool_use", "id": call_id, "name": "get_weather", "input": {"city": city}}
    return {"role": "assistant", "content": [block]}


MESSAGES_CALLING = {
    "messages": [
        {"role": "user", "content": "What is the weather in Paris?"},
        _tool_use("a1", "Paris"),
        {"role": "user", "content": "What is the weather in London?"},
        _tool_use("a2", "London"),
        {"role": "user", "content": "What is the weather in Rome?"},
    ],
    "tools": [
        {
            "name": "get_weather",
            "description": "Get the weather",
            "input_schema": WEATHER["function"]["parameters"],
        }
    ],
    "max_tokens": 40,
    "temperature": 0,
    "chat_template_kwargs": {"enable_thinking": True},
}
MESSAGES_REASONING = {
    "messages": [
        {"role": "user", "content": "Name a colour."},
        {
            "role": "assistant",
            "content": [{"type": "thinking", "thinking": "The user wants", "signature": ""}],
        },
    ],
    "max_tokens": 30,
    "temperature": 0,
}
TYPED_EXCHANGES: list[tuple[str, str, dict[str, Any]]] = [
    ("responses tool call", "/v1/responses", RESPONSES_CALLING),
    ("responses tool call stream", "/v1/responses", {**RESPONSES_CALLING, "stream": True}),
    ("messages tool call", "/v1/messages", MESSAGES_CALLING),
    ("messages tool call stream", "/v1/messages", {**MESSAGES_CALLING, "stream": True}),
    ("messages reasoning", "/v1/messages", MESSAGES_REASONING),
    ("messages reasoning stream", "/v1/messages", {**MESSAGES_REASONING, "stream": True}),
]


@pytest.fixture(scope="module")
def key(tmp_path_factory: pytest.TempPathFactory) -> SigningKey:
    return keygen(tmp_path_factory.mktemp("p0-acts-key") / "receipt-key.pem")


@pytest.fixture(scope="module")
def p0(
    key: SigningKey,
    template: Path,
    default_model: Path,
    default_fork: Path,
    llama_server_bin: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Any:
    log = tmp_path_factory.mktemp("log") / "p0.log"
    args = ["--chat-template-file", str(template)]
    with spawned_p0(key, default_model, default_fork, llama_server_bin, log, args) as bankml:
        yield bankml


@pytest.fixture(scope="module")
def exchanges(p0: BankmlProcess) -> list[Exchange]:
    return [_asked(p0, name, "/v1/chat/completions", body) for name, body in EXCHANGES]


@pytest.fixture(scope="module")
def typed_exchanges(p0: BankmlProcess) -> list[Exchange]:
    return [_asked(p0, name, path, body) for name, path, body in TYPED_EXCHANGES]


def _asked(p0: BankmlProcess, name: str, path: str, body: dict[str, Any]) -> Exchange:
    raw = json.dumps(body).encode()
    response = post(p0, path, raw)
    api = path.rsplit("/", 1)[-1].replace("completions", "chat")
    return Exchange(name, api, "stream" in body, "seed" in body, raw, response, 0, 0)


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _assembled(ex: Exchange) -> tuple[str, list[dict[str, str]]]:
    """The reasoning and tool calls as a client assembles them, read independently of bankml's
    reader: the message's fields, or the deltas joined (each call by its index)."""
    _, _, objects = find_receipt(ex.response)
    if not ex.stream:
        message = objects[0]["choices"][0]["message"]
        calls = [
            {
                "id": c["id"],
                "type": c["type"],
                "name": c["function"]["name"],
                "arguments": c["function"]["arguments"],
            }
            for c in message.get("tool_calls", [])
        ]
        return message.get("reasoning_content", ""), calls
    reasoning, by_index = "", {}
    for obj in objects:
        for choice in obj.get("choices", []):
            delta = choice.get("delta", {})
            reasoning += delta.get("reasoning_content") or ""
            for piece in delta.get("tool_calls") or []:
                call = by_index.setdefault(
                    piece["index"], {"id": "", "type": "", "name": "", "arguments": ""}
                )
                call["id"] = call["id"] or piece.get("id", "")
                call["type"] = call["type"] or piece.get("type", "")
                call["name"] += piece.get("function", {}).get("name", "")
                call["arguments"] += piece.get("function", {}).get("arguments", "")
    return reasoning, [by_index[i] for i in sorted(by_index)]


def test_the_answers_carry_calls_and_reasoning_and_the_receipts_hash_them(
    exchanges: list[Exchange],
) -> None:
    for ex in exchanges:
        receipt = find_receipt(ex.response)[1]
        reasoning, calls = _assembled(ex)
        if ex.name.startswith("tool call"):
            assert calls and all(c["name"] == "get_weather" for c in calls), ex.name
            assert json.loads(calls[0]["arguments"]).keys() == {"city"}, ex.name
            assert receipt["finish_reason"] == "tool_calls", ex.name
            canonical = json.dumps(calls, separators=(",", ":"), ensure_ascii=False)
            assert receipt["tool_calls_sha256"] == _sha(canonical.encode()), ex.name
            assert "reasoning_sha256" not in receipt, ex.name
        else:
            assert reasoning.strip() and not calls, ex.name
            assert receipt["reasoning_sha256"] == _sha(reasoning.encode()), ex.name
            assert "tool_calls_sha256" not in receipt, ex.name
    print(f"\nP0 acts: {len(exchanges)} answers with tool calls or reasoning, each hashed")


def test_untouched_receipts_are_valid(
    exchanges: list[Exchange], key: SigningKey, tmp_path: Path
) -> None:
    for ex in exchanges:
        verdict = check_receipt(
            ex.request, ex.response, key.public_key_pem, model_sha256=support.DEFAULT_SHA256
        )
        assert verdict == VALID, (ex.name, verdict)
    ex = exchanges[1]
    assert check_receipt_cli(tmp_path, ex.request, ex.response, key.public_key_pem) == (0, VALID)


def _first_call(objects: list[dict[str, Any]], stream: bool) -> dict[str, Any]:
    for obj in objects:
        for choice in obj.get("choices", []):
            calls = choice.get("delta" if stream else "message", {}).get("tool_calls")
            if calls:
                return calls[0]
    raise AssertionError("no tool call")


def _last_call_piece(objects: list[dict[str, Any]]) -> dict[str, Any]:
    pieces = [
        piece
        for obj in objects
        for choice in obj.get("choices", [])
        for piece in choice.get("delta", {}).get("tool_calls") or []
        if piece.get("function", {}).get("arguments")
    ]
    return pieces[-1]


def _reasoning_holder(objects: list[dict[str, Any]], stream: bool) -> dict[str, Any]:
    for obj in objects:
        for choice in obj.get("choices", []):
            part = choice.get("delta" if stream else "message", {})
            if part.get("reasoning_content"):
                return part
    raise AssertionError("no reasoning")


def _flip(text: str) -> str:
    """``text`` with one byte changed (its last character's)."""
    return text[:-1] + ("x" if text[-1:] != "x" else "y")


def test_one_changed_byte_of_a_call_or_the_reasoning_is_refused(
    exchanges: list[Exchange], key: SigningKey
) -> None:
    cases = 0
    for ex in exchanges:

        def refused(change: Any, why: str, ex: Exchange = ex) -> None:
            verdict = check_receipt(ex.request, edited(ex.response, change), key.public_key_pem)
            assert verdict.startswith("refuse:") and why in verdict, (ex.name, verdict)

        if ex.name.startswith("tool call"):

            def arguments(objs: Any, ex: Exchange = ex) -> None:
                call = _last_call_piece(objs) if ex.stream else _first_call(objs, False)
                call["function"]["arguments"] = _flip(call["function"]["arguments"])

            def name(objs: Any, ex: Exchange = ex) -> None:
                function = _first_call(objs, ex.stream)["function"]
                function["name"] = _flip(function["name"])

            def call_id(objs: Any, ex: Exchange = ex) -> None:
                call = _first_call(objs, ex.stream)
                call["id"] = _flip(call["id"])

            def dropped(objs: Any, ex: Exchange = ex) -> None:
                for obj in objs:
                    for choice in obj.get("choices", []):
                        choice.get("delta" if ex.stream else "message", {}).pop("tool_calls", 0)

            for change in (arguments, name, call_id):
                refused(change, "tool_calls_sha256")
            refused(dropped, "the receipt hashes tool calls this answer does not carry")
            cases += 4
        else:

            def reasoning(objs: Any, ex: Exchange = ex) -> None:
                part = _reasoning_holder(objs, ex.stream)
                part["reasoning_content"] = _flip(part["reasoning_content"])

            refused(reasoning, "reasoning_sha256")
            cases += 1
    print(f"\nP0 acts: {cases} one-byte changes to calls and reasoning, all refused")


def test_the_replay_through_llama_server_reproduces_calls_and_reasoning(
    exchanges: list[Exchange], template: Path, default_model: Path, llama_server_bin: Path
) -> None:
    receipt = find_receipt(exchanges[0].response)[1]
    server = LlamaServerProcess(
        str(llama_server_bin),
        str(default_model),
        receipt["n_ctx"],
        receipt["cache_type"],
        args=["--chat-template-file", str(template)],
        reasoning_off=True,  # P0's default, as check-receipt starts it for a P0 receipt
    )
    with server:
        for ex in exchanges:
            outcome = replay_with_llama_server(ex.request, ex.response, server)
            assert outcome.startswith(IDENTICAL), (ex.name, outcome)

        # another call (another argument) is told apart, though signed by nobody
        def elsewhere(objects: list[dict[str, Any]]) -> None:
            function = _first_call(objects, False)["function"]
            function["arguments"] = function["arguments"].replace("Rome", "Pisa")

        ex = exchanges[0]
        outcome = replay_with_llama_server(ex.request, edited(ex.response, elsewhere), server)
        assert outcome.startswith("refuse: tool call 0's arguments differs"), outcome


def test_the_openai_client_reads_the_calls(p0: BankmlProcess) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{p0.url}/v1", api_key="none", max_retries=0)
    asked = {k: v for k, v in CALLING.items() if k != "chat_template_kwargs"}
    extra = {"chat_template_kwargs": CALLING["chat_template_kwargs"]}
    answer = client.chat.completions.create(model="default", **asked, extra_body=extra)
    call = answer.choices[0].message.tool_calls[0]  # type: ignore[index]
    assert call.function.name == "get_weather"  # type: ignore[union-attr]
    assert json.loads(call.function.arguments) == {"city": "Rome"}  # type: ignore[union-attr]
    assert answer.choices[0].finish_reason == "tool_calls"
    assert answer.model_extra["bankml_receipt"]["tool_calls_sha256"]  # type: ignore[index]
    pieces = client.chat.completions.create(model="default", **asked, extra_body=extra, stream=True)
    arguments = "".join(
        (chunk.choices[0].delta.tool_calls or [None])[0].function.arguments or ""  # type: ignore[union-attr]
        for chunk in pieces
        if chunk.choices and chunk.choices[0].delta.tool_calls
    )
    assert json.loads(arguments) == {"city": "Rome"}


def _typed_calls(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The function call items or tool_use blocks of a typed answer (a stream's: its final
    Responses answer, or the blocks its events start)."""
    found = []
    for obj in objects:
        holder = obj.get("response", obj)
        for item in holder.get("output", []) + holder.get("content", []):
            if item.get("type") in ("function_call", "tool_use"):
                found.append(item)
        if obj.get("type") == "content_block_start":
            if obj["content_block"].get("type") == "tool_use":
                found.append(obj["content_block"])
    return found


def test_responses_and_messages_receipts_hash_calls_and_thinking(
    typed_exchanges: list[Exchange], key: SigningKey
) -> None:
    """Valid untouched; one byte of a call's arguments (Responses: the final answer's item;
    Messages: the input, or a streamed input piece), its name, or the thinking, refused."""
    cases = 0
    for ex in typed_exchanges:
        receipt = find_receipt(ex.response)[1]
        verdict = check_receipt(ex.request, ex.response, key.public_key_pem)
        assert verdict == VALID, (ex.name, verdict)
        _, _, objects = find_receipt(ex.response)
        if "tool call" in ex.name:
            assert "tool_calls_sha256" in receipt and "reasoning_sha256" not in receipt, ex.name
            calls = _typed_calls(objects)
            assert calls and all(c["name"] == "get_weather" for c in calls), ex.name

            def renamed(objs: list[dict[str, Any]]) -> None:
                for call in _typed_calls(objs):
                    call["name"] = _flip(call["name"])

            def changed_arguments(objs: list[dict[str, Any]], ex: Exchange = ex) -> None:
                if ex.api == "responses":
                    for call in _typed_calls(objs):
                        call["arguments"] = _flip(call["arguments"])
                elif not ex.stream:
                    for call in _typed_calls(objs):
                        call["input"]["city"] = _flip(call["input"]["city"])
                else:
                    pieces = [
                        o for o in objs if o.get("delta", {}).get("type") == "input_json_delta"
                    ]
                    pieces[-2]["delta"]["partial_json"] = _flip(pieces[-2]["delta"]["partial_json"])

            for change in (renamed, changed_arguments):
                verdict = check_receipt(ex.request, edited(ex.response, change), key.public_key_pem)
                assert verdict.startswith("refuse: tool_calls_sha256"), (ex.name, verdict)
                cases += 1
        else:
            assert "reasoning_sha256" in receipt and "tool_calls_sha256" not in receipt, ex.name

            def rethought(objs: list[dict[str, Any]]) -> None:
                for obj in objs:
                    for block in obj.get("content", []):
                        if block.get("type") == "thinking":
                            block["thinking"] = _flip(block["thinking"])
                    if obj.get("delta", {}).get("type") == "thinking_delta":
                        obj["delta"]["thinking"] = _flip(obj["delta"]["thinking"])
                        return

            verdict = check_receipt(ex.request, edited(ex.response, rethought), key.public_key_pem)
            assert verdict.startswith("refuse: reasoning_sha256"), (ex.name, verdict)
            cases += 1
    print(f"\nP0 Responses/Messages acts: {len(typed_exchanges)} valid, {cases} changes refused")
