"""The drop-in started with the command line llama.cpp's own server tests start llama-server
with (build 11434, ``tools/server/tests/utils.py``: the ``tinyllama2`` preset, on the default
model, with ``--context-shift`` as its context tests add it), side by side with llama-server
started with the very same flags, over real HTTP on loopback.

The preset passes ``--no-jinja``, ``--batch-size 32`` (prompts evaluated 32 tokens a pass: other
kernels, other bits than the default 2048/512), ``--alias``, ``--ctx-size 512`` with
``--parallel 2`` (256 positions a slot), ``--n-predict 64``, ``--seed 42`` and ``--temp 0.8``,
``--offline``: each answer below must be llama-server's.
"""

from __future__ import annotations

import json
from typing import Any

from tests.dropin import Pair, call, pair_fixture

# ServerPreset.tinyllama2() as ServerProcess.start() writes it, the model aside
PRESET = [
    *("--temp", "0.8", "--seed", "42", "--host", "127.0.0.1", "--offline"),
    *("--batch-size", "32", "--alias", "tinyllama-2", "--ctx-size", "512"),
    *("--parallel", "2", "--n-predict", "64", "--no-jinja", "--context-shift"),
]
LONG = "The history of the city begins in the early medieval period, when a small settlement grew. "


pair = pair_fixture(PRESET)


def completions(pair: Pair, body: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for port in pair.ports:
        status, _, raw = call(port, "POST", "/completion", body)
        assert status == 200, raw
        out.append(json.loads(raw))
    return out


def same(answers: list[dict[str, Any]]) -> dict[str, Any]:
    keys = ("content", "tokens", "tokens_predicted", "tokens_evaluated", "truncated", "stop_type")
    ours, theirs = ({k: a[k] for k in keys} for a in answers)
    assert ours == theirs
    return ours


def test_a_completion_with_the_presets_defaults(pair: Pair) -> None:
    """llama.cpp's test_completion: seed 42, temperature 0.8 and 64 tokens from the flags."""
    body = {"prompt": "I believe the meaning of life is", "return_tokens": True}
    answer = same(completions(pair, body))
    assert answer["tokens_predicted"] == 64


def test_a_long_prompt_in_batches_of_32(pair: Pair) -> None:
    body = {"prompt": LONG * 5, "n_predict": 8, "return_tokens": True, "cache_prompt": False}
    assert same(completions(pair, body))["tokens_evaluated"] > 64


def test_a_generation_past_the_slots_context_shifts(pair: Pair) -> None:
    """llama.cpp's test_ctx_shift: the 256 positions of a slot passed, the context shifted."""
    body = {"prompt": LONG * 2, "n_predict": 300, "ignore_eos": True, "return_tokens": True}
    answer = same(completions(pair, body))
    assert answer["truncated"] is True and answer["tokens_predicted"] == 300


def test_the_openai_client_against_the_preset(pair: Pair) -> None:
    """llama.cpp's test_chat_completion, through the official client; the alias names the
    model."""
    import openai

    answers = []
    for port in pair.ports:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        answer = client.chat.completions.create(
            model="tinyllama-2",
            messages=[
                {"role": "system", "content": "Book"},
                {"role": "user", "content": "What is the best book"},
            ],
            max_tokens=8,
        )
        answers.append((answer.model, answer.choices[0].message.content, answer.usage))
    assert answers[0] == answers[1]
    assert answers[0][0] == "tinyllama-2"
