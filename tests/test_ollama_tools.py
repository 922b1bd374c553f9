"""Ollama's ``tools`` and ``think`` on ``/api/chat`` and ``/api/generate``, side by side with
bankml's own /v1/chat/completions (proven equal to llama-server's in test_native_tool_calls.py).

One ``bankml serve --native`` on the default model given Qwen3's chat template from llama.cpp's
models/templates (``--chat-template-file``, tests/tool_chats.py), a signing key, and a registry
with a small pinned GGUF whose template has neither tool calls nor thinking (refused, never
loaded). The official ``ollama`` client and raw HTTP ask the conversations of tests/tool_chats.py
in Ollama's shape (tool calls with object arguments, ``thinking``, ``think``); each answer,
streamed and not, carries the same calls, thinking and content as /v1's answer to the same
conversation with the same sampling. Every Ollama request of a comparison comes after the same
request once (the same prompt cache state for all of them, /v1's included). The receipts hash
the thinking and the calls as sent; ``bankml check-receipt`` finds them valid and refuses one
changed byte of a call's arguments.
"""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ollama
import pytest

from bankml.cli.receipts import check_receipt_main
from bankml.receipts.answer import find_receipt
from bankml.receipts.check import VALID, check_receipt
from bankml.receipts.keys import SigningKey, keygen
from tests.native_server import NativeProcess, native_process
from tests.registry_support import pin_into, write_gguf
from tests.tool_chats import CALLING, REASONING, WEATHER

pytestmark = pytest.mark.slow

CALL_ID = re.compile(r"call_[a-z0-9]{8}")
PLAIN = "plain-f16"  # the registry's small pin: a template with neither tools nor thinking


def ollama_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A /v1 conversation in Ollama's shape: calls with object arguments, reasoning as
    ``thinking``."""
    out = []
    for m in messages:
        msg: dict[str, Any] = {"role": m["role"], "content": m.get("content") or ""}
        if m.get("reasoning_content"):
            msg["thinking"] = m["reasoning_content"]
        if m.get("tool_calls"):
            msg["tool_calls"] = [
                {
                    "id": call["id"],
                    "function": {
                        "name": call["function"]["name"],
                        "arguments": json.loads(call["function"]["arguments"]),
                    },
                }
                for call in m["tool_calls"]
            ]
        out.append(msg)
    return out


OPTIONS = {"temperature": 0, "num_predict": 40}
PLAIN_CHAT = [{"role": "user", "content": "Name a colour."}]
# name -> (the Ollama fields, the /v1 fields of the same conversation)
CHATS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "call": (
        {"messages": ollama_messages(CALLING["messages"]), "tools": [WEATHER]},
        {"messages": CALLING["messages"], "tools": [WEATHER]},
    ),
    "thinking": (
        {"messages": ollama_messages(REASONING["messages"]), "think": True},
        {"messages": REASONING["messages"], "chat_template_kwargs": {"enable_thinking": True}},
    ),
    "think false": (
        {"messages": PLAIN_CHAT, "think": False},
        {"messages": PLAIN_CHAT, "chat_template_kwargs": {"enable_thinking": False}},
    ),
}


@pytest.fixture(scope="module")
def key(tmp_path_factory: pytest.TempPathFactory) -> SigningKey:
    return keygen(tmp_path_factory.mktemp("ollama-tools-key") / "receipt-key.pem")


@pytest.fixture(scope="module")
def server(
    template: Path,
    key: SigningKey,
    default_model: Path,
    default_fork: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[NativeProcess]:
    home = tmp_path_factory.mktemp("ollama-tools")
    registry = home / "forks"
    registry.mkdir()
    pin_into(registry, write_gguf(registry / "Plain-F16.gguf", name="Plain"))
    proc = native_process(default_model, default_fork, home)
    proc.engine_args += [
        *("--registry", str(registry)),
        *("--chat-template-file", str(template)),
        *("--receipt-key", str(key.path)),
    ]
    with proc:
        yield proc


@pytest.fixture(scope="module")
def model(default_model: Path) -> str:
    return default_model.name[: -len(".gguf")].lower()


def post(server: NativeProcess, path: str, body: dict[str, Any]) -> tuple[int, bytes]:
    request = urllib.request.Request(
        server.url + path, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=600) as answer:
            return answer.status, bytes(answer.read())
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def lines(raw: bytes) -> list[dict[str, Any]]:
    return [json.loads(line) for line in raw.split(b"\n") if line.strip()]


def read(raw: bytes, kind: str = "chat") -> dict[str, Any]:
    """An Ollama answer, streamed or not: its content, thinking and calls joined as sent, each
    call's id checked for Ollama's form and set aside; the done reason; the receipt."""
    objects = lines(raw)
    out: dict[str, Any] = {"content": "", "thinking": "", "calls": []}
    for obj in objects:
        part = obj["message"] if kind == "chat" else obj
        out["content"] += part["content" if kind == "chat" else "response"]
        out["thinking"] += part.get("thinking", "")
        for call in part.get("tool_calls") or []:
            assert CALL_ID.fullmatch(call["id"]), call
            out["calls"].append(call["function"])
    assert [obj["done"] for obj in objects] == [False] * (len(objects) - 1) + [True]
    out["done_reason"] = objects[-1]["done_reason"]
    out["receipt"] = objects[-1]["bankml_receipt"]
    return out


def v1(raw: bytes) -> dict[str, Any]:
    """/v1's message in the same terms: calls' arguments as objects, indexed in order."""
    message = json.loads(raw)["choices"][0]["message"]
    calls = [
        {
            "index": index,
            "name": call["function"]["name"],
            "arguments": json.loads(call["function"]["arguments"]),
        }
        for index, call in enumerate(message.get("tool_calls") or [])
    ]
    return {
        "content": message["content"] or "",
        "thinking": message.get("reasoning_content", ""),
        "calls": calls,
    }


@pytest.fixture(scope="module")
def exchanges(
    server: NativeProcess, model: str
) -> dict[str, tuple[bytes, bytes, bytes, bytes, bytes]]:
    """name -> (the whole request, its answer, the streamed request, its answer, /v1's)."""
    out = {}
    for name, (ours, theirs) in CHATS.items():
        whole = {"model": model, **ours, "options": OPTIONS, "stream": False}
        streamed = {**whole, "stream": True}
        post(server, "/api/chat", whole)  # the prompt cached: the same state for all below
        status_w, answer_w = post(server, "/api/chat", whole)
        status_s, answer_s = post(server, "/api/chat", streamed)
        body = {**theirs, "max_tokens": OPTIONS["num_predict"], "temperature": 0}
        status_v, answer_v = post(server, "/v1/chat/completions", body)
        assert (status_w, status_s, status_v) == (200, 200, 200), (name, answer_w, answer_s)
        out[name] = (
            json.dumps(whole).encode(),
            answer_w,
            json.dumps(streamed).encode(),
            answer_s,
            answer_v,
        )
    return out


def test_the_answers_carry_v1s_calls_and_thinking(
    exchanges: dict[str, tuple[bytes, bytes, bytes, bytes, bytes]],
) -> None:
    for name, (_, whole, _, streamed, reference) in exchanges.items():
        theirs = v1(reference)
        for raw in (whole, streamed):
            ours = read(raw)
            assert ours["calls"] == theirs["calls"], name
            # a continued turn's own text (REASONING's thinking) is held, not sent again
            assert theirs["thinking"].endswith(ours["thinking"]), (name, ours, theirs)
            assert theirs["content"].endswith(ours["content"]), (name, ours, theirs)
            held = len(theirs["thinking"]) - len(ours["thinking"])
            assert theirs["thinking"][:held] in ("", "The user wants"), (name, ours, theirs)
            assert ours["done_reason"] in ("stop", "length"), name
        assert read(whole)["calls"] == read(streamed)["calls"]
    call = read(exchanges["call"][1])
    assert call["calls"] and call["calls"][0]["name"] == "get_weather"
    assert call["done_reason"] == "stop"
    assert read(exchanges["thinking"][1])["thinking"]  # the model went on reasoning
    off = read(exchanges["think false"][1])
    assert not off["thinking"] and off["content"]
    # streamed, a call comes whole on one line; thinking comes in pieces as it grows
    streamed_lines = lines(exchanges["call"][3])
    with_calls = [obj for obj in streamed_lines if obj["message"].get("tool_calls")]
    assert (
        len(with_calls) == 1
        and with_calls[0]["message"]["tool_calls"][0]["function"] == (call["calls"][0])
    )
    pieces = [obj for obj in lines(exchanges["thinking"][3]) if obj["message"].get("thinking")]
    assert len(pieces) > 1


def test_receipts_cover_thinking_and_calls(
    exchanges: dict[str, tuple[bytes, bytes, bytes, bytes, bytes]],
    key: SigningKey,
    tmp_path: Path,
) -> None:
    for name, (request_w, whole, request_s, streamed, _) in exchanges.items():
        for request, raw in ((request_w, whole), (request_s, streamed)):
            receipt = find_receipt(raw)[1]
            assert check_receipt(request, raw, key.public_key_pem) == VALID, name
            ours = read(raw)
            assert ("tool_calls_sha256" in receipt) == bool(ours["calls"]), name
            assert ("reasoning_sha256" in receipt) == bool(ours["thinking"]), name
    request, raw = exchanges["call"][2], exchanges["call"][3]

    def changed(objects: list[dict[str, Any]]) -> None:
        for obj in objects:
            for call in obj["message"].get("tool_calls") or []:
                call["function"]["arguments"]["city"] += "x"  # one byte more
                return

    (tmp_path / "request.json").write_bytes(request)
    (tmp_path / "key.pem").write_text(key.public_key_pem)
    argv = ["--request", str(tmp_path / "request.json"), "--key", str(tmp_path / "key.pem")]
    (tmp_path / "answer.ndjson").write_bytes(raw)
    assert check_receipt_main([*argv, "--response", str(tmp_path / "answer.ndjson")]) == 0
    objects = lines(raw)
    changed(objects)
    edited = b"".join(json.dumps(obj).encode() + b"\n" for obj in objects)
    (tmp_path / "changed.ndjson").write_bytes(edited)
    assert check_receipt_main([*argv, "--response", str(tmp_path / "changed.ndjson")]) == 2
    verdict = check_receipt(request, edited, key.public_key_pem)
    assert verdict.startswith("refuse: tool_calls_sha256"), verdict


def test_the_official_client_reads_calls_and_thinking(
    server: NativeProcess,
    model: str,
    exchanges: dict[str, tuple[bytes, bytes, bytes, bytes, bytes]],
) -> None:
    client = ollama.Client(host=server.url, timeout=600)
    ours, _ = CHATS["call"]
    expected = read(exchanges["call"][1])["calls"]
    answer = client.chat(model, ours["messages"], tools=ours["tools"], options=OPTIONS)
    calls = answer.message.tool_calls or []
    assert [(c.function.name, dict(c.function.arguments)) for c in calls] == [
        (c["name"], c["arguments"]) for c in expected
    ]
    streamed = [
        call
        for part in client.chat(
            model, ours["messages"], tools=ours["tools"], options=OPTIONS, stream=True
        )
        for call in part.message.tool_calls or []
    ]
    assert [c.function.name for c in streamed] == [c["name"] for c in expected]
    ours, _ = CHATS["thinking"]
    thought = client.chat(model, ours["messages"], think=True, options=OPTIONS)
    assert thought.message.thinking == read(exchanges["thinking"][1])["thinking"]
    # /api/generate takes think (and a level) the same way: thinking switched on in the template
    generated = client.generate(model, "Name a colour.", think="low", options=OPTIONS)
    status, raw = post(
        server,
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "Name a colour."}],
            "reasoning_effort": "low",
            "chat_template_kwargs": {"enable_thinking": True},
            "max_tokens": OPTIONS["num_predict"],
            "temperature": 0,
        },
    )
    assert status == 200
    assert (generated.response, generated.thinking or "") == (
        v1(raw)["content"],
        v1(raw)["thinking"],
    )


def test_capabilities_and_refusals(server: NativeProcess, model: str) -> None:
    client = ollama.Client(host=server.url, timeout=600)
    assert client.show(model).capabilities == ["completion", "tools", "thinking"]
    status, raw = post(server, "/api/show", {"model": PLAIN})
    assert status == 200 and json.loads(raw)["capabilities"] == ["completion"]
    hello = [{"role": "user", "content": "hi"}]
    refusals = [
        ("/api/chat", {"model": PLAIN, "messages": hello, "think": True}),
        ("/api/generate", {"model": PLAIN, "prompt": "hi", "think": "high"}),
        ("/api/chat", {"model": PLAIN, "messages": hello, "tools": [WEATHER]}),
        ("/api/chat", {"model": model, "messages": hello, "tools": [{"function": {}}]}),
        ("/api/chat", {"model": model, "messages": hello, "think": "hard"}),
    ]
    messages = [
        f'"{PLAIN}" does not support thinking',
        f'"{PLAIN}" does not support thinking',
        f"{PLAIN} does not support tools",
        "tools: tools[0].function.name must be a non-empty string",
        'invalid think value: "hard" (must be "high", "medium", "low", "max", true, or false)',
    ]
    for (path, body), message in zip(refusals, messages, strict=True):
        assert post(server, path, body) == (400, json.dumps({"error": message}).encode()), body
    with pytest.raises(ollama.ResponseError) as err:
        client.chat(PLAIN, hello, tools=[WEATHER])
    assert err.value.status_code == 400 and "does not support tools" in err.value.error
