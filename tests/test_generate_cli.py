"""`bankml generate` as a user runs it: a subprocess on the default model, checked against llama-server."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests import support


def generate(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "bankml", "generate", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=support.ROOT,
    )


def test_json_answer_matches_llama_server_greedy(
    default_model: Path, reference_server: support.LlamaServer
) -> None:
    prompt = "The three primary colors are"
    out = generate(
        str(default_model),
        "--prompt",
        prompt,
        "--max",
        "8",
        "--temperature",
        "0",
        "--ctx",
        "512",
        "--device",
        "cpu",
        "--json",
    )
    assert out.returncode == 0, out.stderr
    answer = json.loads(out.stdout)
    assert set(answer) == {"text", "tokens", "prompt_tokens", "finish_reason", "timings"}
    status, ref = support.http_json(
        reference_server.url + "/completion",
        {
            "prompt": prompt,
            "n_predict": 8,
            "temperature": 0,
            "cache_prompt": False,
            "return_tokens": True,
        },
    )
    assert status == 200
    assert answer["tokens"] == ref["tokens"] and answer["text"] == ref["content"]
    assert answer["prompt_tokens"] == ref["timings"]["prompt_n"]
    assert answer["finish_reason"] == "length" and answer["timings"]["predicted_n"] == 8


def test_streams_chat_answer_under_a_grammar(default_model: Path) -> None:
    messages = json.dumps([{"role": "user", "content": "Is water wet? Answer yes or no."}])
    out = generate(
        str(default_model),
        "--messages",
        messages,
        "--grammar",
        'root ::= "yes" | "no"',
        "--seed",
        "5",
        "--ctx",
        "512",
        "--device",
        "cpu",
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout in ("yes\n", "no\n")


def test_bad_input_is_a_clear_error(default_model: Path) -> None:
    out = generate(str(default_model), "--messages", "[not json")
    assert (
        out.returncode != 0
        and "--messages is not JSON" in out.stderr
        and "Traceback" not in out.stderr
    )
    out2 = generate(str(default_model))  # one of --prompt and --messages is required
    assert (
        out2.returncode == 2
        and "one of the arguments --prompt --messages is required" in out2.stderr
    )
    out = generate(
        str(default_model),
        "--prompt",
        "x",
        "--grammar",
        "root ::= nothing",
        "--ctx",
        "64",
        "--device",
        "cpu",
    )
    assert (
        out.returncode == 2
        and "failed to parse grammar" in out.stderr
        and "Traceback" not in out.stderr
    )
