"""Tool calls and reasoning natively, side by side with the real llama-server.

``bankml serve --native`` and llama-server (build 11434) on the default model, both given
Qwen3's chat template from llama.cpp's models/templates (``--chat-template-file``), asked the same
requests over loopback: a conversation that makes the tiny model call a tool (greedy, seeded,
``tool_choice`` required and none), tools it does not call, a continued reasoning turn (with
``reasoning_format`` none, and thinking switched off by ``chat_template_kwargs``), a plain chat;
streamed and not. Every answer's choices are identical (the calls' ids aside: both servers draw
them at random; each id is 32 letters and digits). Each prompt is computed whole
(``cache_prompt: false``), as the replay computes it.

Natively each answer is signed: the receipt hashes the calls and the reasoning as sent, is
``valid``, refuses a changed byte of a call's arguments, and replays identically on bankml's
engine (given the same template) and through an unmodified llama-server. The official
``openai`` client reads the calls, streamed and not.
"""

from __future__ import annotations

import json
import re
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
from tests.native_support import wait_for
from tests.receipt_answers import edited
from tests.tool_chats import CALLING, REASONING, WEATHER

pytestmark = [pytest.mark.llama_server, pytest.mark.slow]


CASES: dict[str, dict[str, Any]] = {
    "call": CALLING,
    "call seeded": {**CALLING, "temperature": 0.8, "seed": 3},
    "call required": {**CALLING, "tool_choice": "required"},
    "call none": {**CALLING, "tool_choice": "none"},
    "tools not called": {
        "messages": [{"role": "user", "content": "Hi"}],
        "tools": [WEATHER],
        "max_tokens": 20,
        "temperature": 0,
    },
    "reasoning": REASONING,
    "reasoning format none": {**REASONING, "reasoning_format": "none"},
    "thinking off": {**REASONING, "chat_template_kwargs": {"enable_thinking": False}},
    "plain": {
        "messages": [{"role": "user", "content": "Name a colour."}],
        "max_tokens": 20,
        "temperature": 0,
    },
}
# every prompt computed whole: a prefix reused from an earlier request is computed in other
# batches, whose bits can differ, and the replay computes the whole prompt
CASES = {name: {**body, "cache_prompt": False} for name, body in CASES.items()}
ID = re.compile(r"[0-9A-Za-z]{32}")


@pytest.fixture(scope="module")
def key(signing_key: SigningKey) -> SigningKey:
    return signing_key


@pytest.fixture(scope="module")
def native(template_pair: tuple[NativeProcess, Any]) -> NativeProcess:
    return template_pair[0]


@pytest.fixture(scope="module")
def reference(template_pair: tuple[NativeProcess, Any]) -> Any:
    return template_pair[1]


def _post(url: str, body: dict[str, Any]) -> bytes:
    request = urllib.request.Request(
        url + "/v1/chat/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=600) as answer:
        return bytes(answer.read())


def _choices(raw: bytes, stream: bool) -> list[Any]:
    """Each object's choices, the calls' ids checked for their form and set aside."""
    if stream:
        objects = [
            json.loads(line[6:])
            for line in raw.decode().split("\n")
            if line.startswith("data: ") and line[6:] != "[DONE]"
        ]
    else:
        objects = [json.loads(raw)]
    out = []
    for obj in objects:
        for choice in obj.get("choices", []):
            part = choice.get("delta" if stream else "message", {})
            for call in part.get("tool_calls") or []:
                if "id" in call:
                    assert ID.fullmatch(call["id"]), call
                    call["id"] = "drawn"
        out.append(obj.get("choices"))
    return out


@pytest.fixture(scope="module")
def exchanges(native: NativeProcess, reference: Any) -> list[tuple[str, bytes, bytes, bytes]]:
    out = []
    for name, body in CASES.items():
        for stream in (False, True):
            asked = {**body, "stream": stream}
            out.append(
                (
                    f"{name}{' stream' if stream else ''}",
                    json.dumps(asked).encode(),
                    _post(native.engine_url, asked),
                    _post(reference.url, asked),
                )
            )
    return out


def test_answers_are_llama_servers(exchanges: list[tuple[str, bytes, bytes, bytes]]) -> None:
    calls = reasoned = 0
    for name, request, ours, theirs in exchanges:
        stream = json.loads(request)["stream"]
        assert _choices(ours, stream) == _choices(theirs, stream), name
        calls += b"tool_calls" in ours
        reasoned += b"reasoning_content" in ours
    assert calls >= 6 and reasoned >= 4, (calls, reasoned)
    print(
        f"\nnative chat: {len(exchanges)} answers identical, {calls} with calls, {reasoned} reasoned"
    )


def test_receipts_cover_calls_and_reasoning(
    exchanges: list[tuple[str, bytes, bytes, bytes]], key: SigningKey
) -> None:
    refused = 0
    for name, request, ours, _ in exchanges:
        receipt = find_receipt(ours)[1]
        assert check_receipt(request, ours, key.public_key_pem) == VALID, name
        assert ("tool_calls_sha256" in receipt) == (b"tool_calls" in ours), name
        assert ("reasoning_sha256" in receipt) == (b"reasoning_content" in ours), name
        if "tool_calls_sha256" not in receipt:
            continue
        assert receipt["finish_reason"] == "tool_calls", name

        def changed(objects: list[dict[str, Any]]) -> None:
            for obj in objects:
                for choice in obj.get("choices", []):
                    part = choice.get("delta") or choice.get("message") or {}
                    for call in part.get("tool_calls") or []:
                        arguments = call.get("function", {}).get("arguments")
                        if arguments:
                            call["function"]["arguments"] = arguments + " "  # one byte more
                            return

        verdict = check_receipt(request, edited(ours, changed), key.public_key_pem)
        assert verdict.startswith("refuse: tool_calls_sha256"), (name, verdict)
        refused += 1
    assert refused >= 6


def test_the_answers_replay_on_the_engine_and_through_llama_server(
    exchanges: list[tuple[str, bytes, bytes, bytes]],
    template: Path,
    default_model: Path,
    default_fork: Path,
    llama_server_bin: Path,
) -> None:
    receipt = find_receipt(exchanges[0][2])[1]
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
    with server:
        for name, request, ours, _ in exchanges:
            assert replay_in_process(request, ours, engine).startswith(IDENTICAL), name
            outcome = replay_with_llama_server(request, ours, server)
            assert outcome.startswith(IDENTICAL), (name, outcome)


def test_the_openai_client_reads_the_calls(native: NativeProcess) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{native.engine_url}/v1", api_key="none", max_retries=0)
    answer = client.chat.completions.create(model="default", **CALLING)
    call = answer.choices[0].message.tool_calls[0]  # type: ignore[index]
    assert call.function.name == "get_weather"  # type: ignore[union-attr]
    assert json.loads(call.function.arguments) == {"city": "Rome"}  # type: ignore[union-attr]
    assert answer.choices[0].finish_reason == "tool_calls"
    pieces = client.chat.completions.create(model="default", **CALLING, stream=True)
    arguments, finish = "", None
    for chunk in pieces:
        if chunk.choices and chunk.choices[0].delta.tool_calls:
            arguments += chunk.choices[0].delta.tool_calls[0].function.arguments or ""  # type: ignore[union-attr]
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
    assert json.loads(arguments) == {"city": "Rome"} and finish == "tool_calls"


def test_the_chat_flags_as_llama_servers(
    template: Path,
    default_model: Path,
    default_fork: Path,
    llama_server_bin: Path,
    tmp_path: Path,
) -> None:
    """--reasoning-format, --reasoning and --chat-template-kwargs natively, beside llama-server
    started with the same flags: the same answers, also after the model was unloaded (its
    keep-alive ran out) and loaded again."""
    flags = [
        "--chat-template-file",
        str(template),
        "--reasoning-format",
        "none",
        "--reasoning",
        "off",
        "--chat-template-kwargs",
        '{"enable_thinking": true}',
    ]
    server = native_process(default_model, default_fork, tmp_path)
    # a keep-alive that runs out between the two rounds: the model is loaded again, with the
    # same flags
    server.engine_args += [*flags, "--keep-alive", "1s"]
    reference = support.LlamaServer(default_model, args=flags, binary=llama_server_bin)
    with server, reference:
        for round_ in range(2):
            for name in ("call", "reasoning", "plain"):
                body = CASES[name]
                assert _choices(_post(server.engine_url, body), False) == _choices(
                    _post(reference.url, body), False
                ), (name, round_)
            if round_ == 0:  # the reaper (every second) unloads it after its keep-alive
                wait_for(
                    lambda: (
                        b"expires_at" not in urllib.request.urlopen(server.url + "/api/ps").read()
                    ),
                    "the keep-alive's unload",
                )


BAD = [
    {"tools": {"a": 1}},
    {"tools": [{"type": "function"}]},
    {"tools": [{"type": "code", "function": {"name": "f"}}]},
    {"tools": [WEATHER], "tool_choice": "bogus"},
    {"tools": [WEATHER], "grammar": 'root ::= "a"'},
    {"reasoning_format": "bogus"},
    {"chat_template_kwargs": {"enable_thinking": "yes"}},
]


def test_bad_tool_and_reasoning_fields_are_refused_as_llama_server_refuses_them(
    native: NativeProcess, reference: Any
) -> None:
    """llama-server's message; its status where it is 400 (bankml answers 400 where it answers
    500 for a body it cannot read); nothing computed: the server answers the next request as
    before."""
    for bad in BAD:
        body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, **bad}
        ours = support.http_json(native.engine_url + "/v1/chat/completions", body)
        theirs = support.http_json(reference.url + "/v1/chat/completions", body)
        assert ours[0] == 400 and theirs[0] in (400, 500), (bad, ours, theirs)
        assert ours[1]["error"]["message"] == theirs[1]["error"]["message"], bad
    asked = CASES["plain"]
    assert _choices(_post(native.engine_url, asked), False) == _choices(
        _post(reference.url, asked), False
    )


def test_parallel_slots_give_the_same_answers(
    template: Path,
    default_model: Path,
    default_fork: Path,
    exchanges: list[tuple[str, bytes, bytes, bytes]],
    tmp_path: Path,
) -> None:
    """On a server with two slots, the calls and the reasoning asked at once: each answer is
    the one a one-slot server gave alone."""
    from concurrent.futures import ThreadPoolExecutor

    alone = {name: ours for name, _, ours, _ in exchanges}
    names = ["call", "reasoning", "call seeded", "reasoning format none"]
    server = native_process(default_model, default_fork, tmp_path)
    server.engine_args += ["--chat-template-file", str(template), "--parallel", "2"]
    with server, ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda n: _post(server.engine_url, CASES[n]), names))
    for name, answer in zip(names, answers):
        assert _choices(answer, False) == _choices(alone[name], False), name


@pytest.mark.parametrize(
    "family",
    [
        # JSON calls without a section marker (the call is the whole answer)
        "meta-llama-Llama-3.2-3B-Instruct.jinja",
        # tagged calls: the name and each argument between tags
        "GLM-4.6.jinja",
        # JSON calls between <tool_call> tags, no reasoning block
        "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use.jinja",
    ],
)
def test_other_template_families_as_llama_servers(
    family: str,
    default_model: Path,
    default_fork: Path,
    llama_server_bin: Path,
    tmp_path: Path,
) -> None:
    path = support.llama_templates_dir(llama_server_bin) / family
    if not path.exists():
        pytest.skip(f"{path} is not in the llama.cpp source tree")
    server = native_process(default_model, default_fork, tmp_path)
    server.engine_args += ["--chat-template-file", str(path)]
    reference = support.LlamaServer(
        default_model, args=["--chat-template-file", str(path)], binary=llama_server_bin
    )
    with server, reference:
        for name in ("call", "call required", "tools not called", "reasoning"):
            for stream in (False, True):
                body = {**CASES[name], "stream": stream}
                ours = _choices(_post(server.engine_url, body), stream)
                assert ours == _choices(_post(reference.url, body), stream), (family, name, stream)
