"""``--no-jinja`` on the drop-in, side by side with llama-server started with the same flags,
over real HTTP on loopback.

Two pairs: the model's own template read as the built-in template llama.cpp recognises it as
(``--jinja --no-jinja``: the last wins, in both), and a built-in template named by
``--chat-template llama3``. Each answers /apply-template and greedy /v1/chat/completions
(plain, streamed, with a continued assistant message, with a JSON schema) as llama-server does,
refuses tools as it does, and shows the same /props template. A template none of the built-in
ones is refused before anything listens, as llama-server refuses it.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bankml.serving.llama_flags import dropin_argv
from tests.dropin import Pair, bankml, dropin_pair, listening
from tests.support import free_port

FLAGS = {
    "own": ["--jinja", "--no-jinja", "--temp", "0"],
    "llama3": ["--no-jinja", "--chat-template", "llama3", "--temp", "0"],
}


@pytest.fixture(scope="module", params=sorted(FLAGS))
def pair(
    request: pytest.FixtureRequest,
    default_model: Path,
    default_fork: Path,
    llama_server_bin: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Pair]:
    log = tmp_path_factory.mktemp("nojinja") / "bankml.log"
    flags = ["-c", "2048", *FLAGS[request.param]]
    yield from dropin_pair(flags, default_model, default_fork, llama_server_bin, log)


USER = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
TEMPLATE_BODIES: list[dict[str, Any]] = [
    {"messages": USER},
    {"messages": USER, "add_generation_prompt": False},
    {"messages": [*USER, {"role": "assistant", "content": "Blue"}]},
    {
        "messages": [
            {"role": "developer", "content": "dev"},
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
        ]
    },
]


def test_apply_template_is_llama_servers(pair: Pair) -> None:
    for body in TEMPLATE_BODIES:
        (s1, ours), (s2, theirs) = pair.both("POST", "/apply-template", body)
        assert (s1, json.loads(ours)) == (s2, json.loads(theirs)), body
        assert s1 == 200


def _answer(raw: bytes) -> dict[str, Any]:
    answer = json.loads(raw)
    choice = answer["choices"][0]
    return {
        "message": choice["message"],
        "finish": choice["finish_reason"],
        "usage": answer["usage"],
    }


CHATS: list[dict[str, Any]] = [
    {"messages": USER, "max_tokens": 12},
    {"messages": [*USER, {"role": "assistant", "content": "Blue is"}], "max_tokens": 8},
    {
        "messages": USER,
        "max_tokens": 12,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"schema": {"type": "object", "properties": {"c": {"type": "string"}}}},
        },
    },
]


def test_greedy_chats_are_llama_servers(pair: Pair) -> None:
    answers = []
    for body in CHATS:
        (s1, ours), (s2, theirs) = pair.both("POST", "/v1/chat/completions", body)
        assert s1 == s2 == 200, (ours, theirs)
        assert _answer(ours) == _answer(theirs), body
        answers.append(_answer(ours)["message"]["content"])
    assert answers[0] and answers[2].startswith("{")  # real answers, the last one constrained


def _streamed(raw: bytes) -> str:
    text = ""
    for line in raw.decode().splitlines():
        if line.startswith("data: {"):
            for choice in json.loads(line[6:])["choices"]:
                text += choice["delta"].get("content") or ""
    return text


def test_a_streamed_chat_is_llama_servers(pair: Pair) -> None:
    body = {**CHATS[0], "stream": True}
    (s1, ours), (s2, theirs) = pair.both("POST", "/v1/chat/completions", body)
    assert s1 == s2 == 200
    assert _streamed(ours) == _streamed(theirs) != ""


def test_a_verbose_chat_names_llama_servers_content_only_parser(pair: Pair) -> None:
    body = {**CHATS[0], "verbose": True}
    (s1, ours), (s2, theirs) = pair.both("POST", "/v1/chat/completions", body)
    assert s1 == s2 == 200
    settings = [json.loads(raw)["__verbose"]["generation_settings"] for raw in (ours, theirs)]
    keys = ("chat_format", "generation_prompt", "reasoning_format")
    assert [{k: g[k] for k in keys} for g in settings] == [{k: settings[1][k] for k in keys}] * 2
    assert settings[0]["chat_format"] == "Content-only"


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.mark.parametrize(
    "fields",
    [{"tools": [TOOL]}, {"tool_choice": "required"}, {"tool_choice": "none", "tools": []}],
)
def test_tools_are_refused_with_llama_servers_message(pair: Pair, fields: dict[str, Any]) -> None:
    body = {"messages": USER, "max_tokens": 4, **fields}
    for path in ("/v1/chat/completions", "/apply-template"):
        (s1, ours), (s2, theirs) = pair.both("POST", path, body)
        # llama-server answers 500 (a runtime_error); the request is at fault: 400 here
        assert (s1, s2) == (400, 500)
        assert json.loads(ours)["error"]["message"] == json.loads(theirs)["error"]["message"]
        assert "requires --jinja flag" in json.loads(ours)["error"]["message"]


def test_a_tool_choice_of_auto_or_not_a_string_is_taken(pair: Pair) -> None:
    for choice in ("auto", {"type": "function"}):
        body = {"messages": USER, "tool_choice": choice, "tools": []}
        (s1, ours), (s2, theirs) = pair.both("POST", "/apply-template", body)
        assert s1 == s2 == 200 and json.loads(ours) == json.loads(theirs)


def test_props_shows_llama_servers_template(pair: Pair) -> None:
    (_, ours), (_, theirs) = pair.both("GET", "/props")
    keys = ("chat_template", "chat_template_caps", "bos_token", "eos_token")
    assert {k: json.loads(ours)[k] for k in keys} == {k: json.loads(theirs)[k] for k in keys}
    assert "chat_template_tool_use" not in json.loads(theirs)


# --- the command line -----------------------------------------------------------------------


def test_the_last_of_jinja_and_no_jinja_wins() -> None:
    argv, _ = dropin_argv(["-m", "m.gguf", "--jinja", "--no-jinja", "--jinja"])
    assert "--jinja" in argv and "--no-jinja" not in argv
    argv, _ = dropin_argv(["-m", "m.gguf", "--no-jinja", "--jinja", "--no-jinja"])
    assert "--no-jinja" in argv and "--jinja" not in argv


def test_a_template_not_built_in_is_refused_as_llama_server_refuses_it(
    default_model: Path, default_fork: Path, llama_server_bin: Path
) -> None:
    flags = ["--no-jinja", "--chat-template", "{{ messages }}"]
    port = free_port()
    run = subprocess.run(
        bankml("llama-server", "-m", str(default_model), "--fork", str(default_fork))
        + ["--port", str(port), *flags],
        capture_output=True,
        text=True,
        timeout=120,
    )
    ref = subprocess.run(
        [str(llama_server_bin), "-m", str(default_model), "--port", str(free_port()), *flags],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 1 and ref.returncode != 0
    message = "the supplied chat template is not supported: {{ messages }}"
    assert message in run.stderr and message in ref.stderr + ref.stdout
    assert "started without --jinja" in run.stderr
    assert not listening(port)
