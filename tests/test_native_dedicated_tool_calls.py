"""Tool calls on a template llama-server reads with a handler of its own, side by side with the
real llama-server.

``bankml serve --native`` and llama-server (build 11434) on the default model, both given
Qwen3-Coder's chat template from llama.cpp's models/templates (``--chat-template-file``): its
XML tool calls are read by llama-server's Qwen3-Coder handler, not the autoparser
(bankml.engine_cupy.autoparser.dedicated). The same requests over loopback — a conversation
that makes the tiny model call a tool (``tool_choice`` auto and required), tools not called —
streamed and not, give identical choices (the calls' ids aside: both servers draw
them at random), and the official ``openai`` client reads the calls.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests import support
from tests.native_server import NativeProcess
from tests.test_native_tool_calls import _choices, _post
from tests.tool_chats import CALLING, WEATHER

pytestmark = [pytest.mark.llama_server, pytest.mark.slow]

CASES: dict[str, dict[str, Any]] = {
    "call": CALLING,
    "call required": {**CALLING, "tool_choice": "required"},
    "tools not called": {
        "messages": [{"role": "user", "content": "Hi"}],
        "tools": [WEATHER],
        "max_tokens": 20,
        "temperature": 0,
    },
}
CASES = {name: {**body, "cache_prompt": False} for name, body in CASES.items()}


@pytest.fixture(scope="module")
def template(llama_server_bin: Path) -> Path:
    """Qwen3-Coder's template (template_pair's servers are given it)."""
    path = support.llama_templates_dir(llama_server_bin) / "Qwen3-Coder.jinja"
    if not path.exists():
        pytest.skip(f"{path} is not in the llama.cpp source tree")
    return path


@pytest.fixture(scope="module")
def exchanges(
    template_pair: tuple[NativeProcess, Any],
) -> list[tuple[str, dict[str, Any], bytes, bytes]]:
    native, reference = template_pair
    out = []
    for name, body in CASES.items():
        for stream in (False, True):
            asked = {**body, "stream": stream}
            out.append(
                (
                    f"{name}{' stream' if stream else ''}",
                    asked,
                    _post(native.engine_url, asked),
                    _post(reference.url, asked),
                )
            )
    return out


def test_qwen3_coder_answers_are_llama_servers(
    exchanges: list[tuple[str, dict[str, Any], bytes, bytes]],
) -> None:
    calls = 0
    for name, asked, ours, theirs in exchanges:
        assert _choices(ours, asked["stream"]) == _choices(theirs, asked["stream"]), name
        calls += b'"tool_calls"' in ours
    assert calls >= 2, calls  # required makes the model call, streamed and not


def test_the_openai_client_reads_the_calls(template_pair: tuple[NativeProcess, Any]) -> None:
    import openai

    native, _ = template_pair
    client = openai.OpenAI(base_url=native.engine_url + "/v1", api_key="none")
    body = {k: v for k, v in CASES["call required"].items() if k != "cache_prompt"}
    answer = client.chat.completions.create(
        model="default", extra_body={"cache_prompt": False}, **body
    )
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls"
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather"
    assert isinstance(json.loads(call.function.arguments), dict)
