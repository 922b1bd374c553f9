"""`bankml tokenize` and `bankml chat-template` as a user runs them: a real process, the real
default model, answers checked against the real llama-server."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests import support


def run_cli(*args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "bankml", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=support.ROOT,
    )


TEXTS = [
    "Hello world",
    "<|im_start|>user\nHi<|im_end|>",
    "日本語 😀👍🏽 12345",
    "  spaces\n\n and 'quotes' ",
    "",
]


def test_tokenize_stdin_matches_llama_server(
    default_model: Path, reference_server: support.LlamaServer
) -> None:
    for text in TEXTS[:3]:
        for extra, parse_special in (([], True), (["--no-parse-special"], False)):
            result = run_cli("tokenize", str(default_model), *extra, stdin=text)
            assert result.returncode == 0, result.stderr
            status, expected = support.http_json(
                reference_server.url + "/tokenize",
                {"content": text, "parse_special": parse_special},
            )
            assert status == 200
            assert json.loads(result.stdout) == {"tokens": expected["tokens"]}


def test_tokenize_jsonl_many_texts_in_one_process(
    default_model: Path, reference_server: support.LlamaServer
) -> None:
    lines = "".join(json.dumps(t) + "\n" for t in TEXTS)
    result = run_cli("tokenize", str(default_model), "--jsonl", "--add-special", stdin=lines)
    assert result.returncode == 0, result.stderr
    outputs = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(outputs) == len(TEXTS)
    for text, output in zip(TEXTS, outputs):
        _, expected = support.http_json(
            reference_server.url + "/tokenize",
            {"content": text, "add_special": True, "parse_special": True},
        )
        assert output == {"tokens": expected["tokens"]}


def test_tokenize_jsonl_bad_line_is_reported_in_place(default_model: Path) -> None:
    result = run_cli(
        "tokenize", str(default_model), "--jsonl", stdin='"ok"\nnot json\n42\n"fine"\n'
    )
    assert result.returncode == 1
    outputs = [json.loads(line) for line in result.stdout.splitlines()]
    assert [sorted(o) for o in outputs] == [["tokens"], ["error"], ["error"], ["tokens"]]
    assert (
        "line 2 is not JSON" in outputs[1]["error"]
        and "line 3 is not a JSON string" in outputs[2]["error"]
    )


def test_tokenize_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    result = run_cli("tokenize", str(tmp_path / "absent.gguf"), stdin="x")
    assert result.returncode == 1
    assert "bankml tokenize:" in result.stderr and "Traceback" not in result.stderr
    not_gguf = tmp_path / "x.gguf"
    not_gguf.write_bytes(b"not a gguf at all, just text" * 4)
    result = run_cli("tokenize", str(not_gguf), stdin="x")
    assert result.returncode == 1 and "is not a GGUF file" in result.stderr


def test_chat_template_matches_llama_server(
    default_model: Path, reference_server: support.LlamaServer
) -> None:
    conversations = [
        [{"role": "user", "content": "Hi there"}],
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4"},
            {"role": "user", "content": "日本語?"},
        ],
        [
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            }
        ],
        [
            {"role": "user", "content": "Start my answer"},
            {"role": "assistant", "content": "Once upon"},
        ],
    ]
    for messages in conversations:
        result = run_cli("chat-template", str(default_model), "--messages", json.dumps(messages))
        assert result.returncode == 0, result.stderr
        status, expected = support.http_json(
            reference_server.url + "/apply-template", {"messages": messages}
        )
        assert status == 200
        assert result.stdout == expected["prompt"]


def test_chat_template_bad_input_is_a_clear_error(default_model: Path) -> None:
    result = run_cli("chat-template", str(default_model), "--messages", "[{")
    assert result.returncode == 2 and "invalid JSON argument" in result.stderr
    result = run_cli("chat-template", str(default_model), "--messages", '[{"content": "no role"}]')
    assert result.returncode == 1 and "Missing 'role' in message" in result.stderr
    assert "Traceback" not in result.stderr
