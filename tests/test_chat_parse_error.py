"""An answer its chat format does not match: llama-server's 500, side by side.

The drop-in and llama-server (build 11434) on the default model, both given Llama 3.1's chat
template from llama.cpp's models/templates. With a tool offered and a high temperature, the
tiny model writes something that starts like a call and is not one: llama-server's parser then
ends the request with a 500 (``The model produced output that does not match the expected
peg-native format``, type ``server_error``), and a stream with that error as its last event.
bankml answers byte for byte the same, and both go on answering the next request. The
template writes the day's date into the prompt; the request fixes it (``date_string`` in
``chat_template_kwargs``), since on another day the sampled answer may parse.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests import support
from tests.dropin import Pair, dropin_pair
from tests.tool_chats import WEATHER

pytestmark = [pytest.mark.llama_server]

TEMPLATE = "meta-llama-Llama-3.1-8B-Instruct.jinja"
UNPARSED = {
    "messages": [{"role": "user", "content": "What is the weather in Paris? Use a tool."}],
    "tools": [WEATHER],
    "temperature": 1.8,
    "seed": 5,
    "max_tokens": 60,
    "cache_prompt": False,
    # the template writes today's date into the prompt: a fixed one keeps the answer
    "chat_template_kwargs": {"date_string": "07 Dec 2026"},
}


@pytest.fixture(scope="module")
def pair(
    default_model: Path,
    default_fork: Path,
    llama_server_bin: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Pair]:
    template = support.llama_templates_dir(llama_server_bin) / TEMPLATE
    if not template.is_file():
        pytest.skip(f"llama.cpp's {TEMPLATE} is not beside the llama-server build")
    flags = ["--jinja", "--chat-template-file", str(template), "-c", "2048"]
    log = tmp_path_factory.mktemp("parse-error") / "bankml.log"
    yield from dropin_pair(flags, default_model, default_fork, llama_server_bin, log)


def test_an_unparsable_answer_is_llama_servers_500(pair: Pair) -> None:
    (ours, our_body), (theirs, their_body) = pair.both("POST", "/v1/chat/completions", UNPARSED)
    assert theirs == 500, their_body  # the case still fails on the reference
    assert ours == theirs
    assert json.loads(our_body) == json.loads(their_body)
    assert json.loads(our_body)["error"]["type"] == "server_error"


def _events(raw: bytes) -> list[Any]:
    return [json.loads(line[6:]) for line in raw.decode().split("\n") if line.startswith("data: ")]


def test_an_unparsable_stream_ends_with_llama_servers_error(pair: Pair) -> None:
    body = {**UNPARSED, "stream": True}
    (ours, our_raw), (theirs, their_raw) = pair.both("POST", "/v1/chat/completions", body)
    assert ours == theirs == 200
    mine, reference = _events(our_raw), _events(their_raw)
    assert mine[-1] == reference[-1] and "error" in reference[-1]
    deltas = [[c["delta"] for c in e.get("choices", [])] for e in mine[:-1]]
    assert deltas == [[c["delta"] for c in e.get("choices", [])] for e in reference[:-1]]
    assert b"[DONE]" not in our_raw


def test_the_server_answers_on_after_it(pair: Pair) -> None:
    plain = {"messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 8}
    (ours, our_body), (theirs, their_body) = pair.both(
        "POST", "/v1/chat/completions", {**plain, "temperature": 0}
    )
    assert ours == theirs == 200
    mine, reference = json.loads(our_body), json.loads(their_body)
    assert mine["choices"][0]["message"] == reference["choices"][0]["message"]
