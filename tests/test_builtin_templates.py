"""bankml.engine_cupy.builtin_templates side by side with llama.cpp's own code.

``tests/oracle/builtin_templates.cpp``, compiled against the reference build's libraries
(``ggml_oracle.compile_against_ggml``), runs ``llama_chat_apply_template`` (the detection and the
built-in formats of src/llama-chat.cpp), ``llama_chat_builtin_templates`` (the name table) and
``common_chat_templates_apply`` without Jinja (the route llama-server's ``--no-jinja`` takes).
Every built-in template on several conversations, with and without the assistant's turn; every
detection test on a text that reaches it, and every template of llama.cpp's models/templates;
the request-level rendering (content parts, null content, tool calls, a NUL byte): identical.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from typing import Any

import pytest

from bankml.engine_cupy import builtin_templates as bt
from tests import ggml_oracle

Oracle = Callable[[list[dict[str, Any]]], list[dict[str, Any]]]


@pytest.fixture(scope="module")
def oracle() -> Oracle:
    try:
        binary = ggml_oracle.compile_against_ggml(
            ggml_oracle.HERE / "oracle" / "builtin_templates.cpp", "builtin-templates"
        )
    except (RuntimeError, OSError, subprocess.CalledProcessError) as err:
        pytest.skip(f"cannot build the built-in templates oracle: {err}")

    def ask(requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
        lines = "".join(json.dumps(r) + "\n" for r in requests)
        done = subprocess.run([str(binary)], input=lines.encode(), capture_output=True, check=True)
        answers = [json.loads(line) for line in done.stdout.decode().splitlines()]
        assert len(answers) == len(requests)
        return answers

    return ask


CHATS: list[list[tuple[str, str]]] = [
    [("user", "Hello")],
    [
        ("system", " You are terse.\n"),
        ("user", "\tHi there \x0b"),
        ("assistant", " Hello! How can I help? "),
        ("user", "What is 2+2?"),
    ],
    [("user", "Q"), ("assistant", "A")],
    [("system", "Only a system prompt")],
    [],
    [
        ("user", "héllo ✓ 日本"),
        ("tool", '{"temp": 21}'),
        ("developer", "be kind"),
        ("assistant_tool_call", "[call]"),
        ("function", "f()"),
        ("assistant", "done"),
        ("", "no role"),
    ],
    [("system", "sys"), ("system", "more"), ("user", "u"), ("assistant", "a"), ("user", "v")],
]

# a text that reaches each test of llm_chat_detect_template, in its order
DETECTION_TEXTS = [
    "<|im_start|>",
    "<|im_start|><|im_sep|>",
    "<|im_start|><end_of_utterance>",
    "mistral-something",
    "[INST][SYSTEM_PROMPT]",
    "{{ ' [INST] ' + system_message }}",
    '[AVAILABLE_TOOLS]"[INST]"',
    "[AVAILABLE_TOOLS][INST]",
    "[INST] message.content.strip()",
    "{{ bos_token + '[INST] ' }}",
    "[INST] <<SYS>>",
    "[INST]",
    "<|assistant|><|end|>",
    "[gMASK]<sop>",
    "<|assistant|><|user|><|tool_declare|>",
    "<|assistant|><|user|></s>",
    "<|assistant|><|user|>",
    "<|{{ item['role'] }}|><|begin_of_image|>",
    "<|user|><|endoftext|>",
    "{{ bos_token + message['role'] }}",
    "<start_of_turn>",
    "{{ '\\n\\nAssistant: ' + eos_token }}",
    "GPT4 Correct ",
    "USER: x ASSISTANT: ",
    "SYSTEM: USER: x ASSISTANT: ",
    "### Instruction:<|EOT|>",
    "<|START_OF_TURN_TOKEN|><|USER_TOKEN|>",
    "<|start_header_id|><|end_header_id|>",
    "[gMASK]sop",
    "<用户>",
    "{{ 'Assistant: ' + message['content'] + eos_token }}",
    "<｜Assistant｜><｜User｜><｜end▁of▁sentence｜>",
    "[|system|][|assistant|][|endofturn|]",
    "[|system|][|assistant|][|endofturn|][|tool|]",
    "a rwkv-world template",
    "{{- 'User: ' + message['content']|trim + '\\n\\n' -}}",
    "<|start_of_role|>",
    "<|start_of_role|><tools>g4_default_system_message",
    "<|start_of_role|><tool_call>",
    "message['role'] + additional_special_tokens[0] + message['content'] + "
    "additional_special_tokens[1]",
    "<|role_start|>",
    " Ассистент:",
    "<role>ASSISTANT</role>'HUMAN'",
    '<role>ASSISTANT</role>"HUMAN"<think>',
    "<role>ASSISTANT</role><role>HUMAN</role><|role_end|>",
    "<|header_start|><|header_end|>",
    "<|endofuserprompt|>",
    "<|extra_0|><|extra_4|>",
    "<|start|><|channel|>",
    "<｜hy_Assistant｜><｜hy_begin▁of▁sentence｜>",
    "<｜hy_Assistant｜><｜hy_place▁holder▁no▁3｜>",
    "<|im_assistant|>assistant<|im_middle|>",
    "<seed:bos>",
    "'Assistant: '  + message['content'] + '<|separator|>",
    "[unused9]系统：[unused10]",
    "<|begin|><|end|><|content|>",
    "a template of no known kind",
    "",
]


def _ours(template: str, chat: list[tuple[str, str]], add_ass: bool) -> dict[str, Any]:
    kind = bt.detect_template(template)
    if kind is None:
        return {"res": -1}
    prompt = bt.apply_builtin(kind, chat, add_ass)
    return {"res": len(prompt.encode()), "prompt": prompt}


def _compare(oracle: Oracle, templates: list[str], chats: list[list[tuple[str, str]]]) -> int:
    requests = [
        {"op": "apply", "template": t, "chat": [list(m) for m in chat], "add_ass": add}
        for t in templates
        for chat in chats
        for add in (True, False)
    ]
    answers = oracle(requests)
    for request, ref in zip(requests, answers, strict=True):
        mine = _ours(request["template"], request["chat"], request["add_ass"])
        assert mine == ref, request
    return len(requests)


def test_the_name_table_is_llama_cpps(oracle: Oracle) -> None:
    (ref,) = oracle([{"op": "names"}])
    assert list(bt.NAMES) == ref["names"]
    assert set(bt.KINDS) == set(bt.NAMES.values()) | {bt.DOTS1}


def test_every_builtin_template_writes_llama_cpps_prompt(oracle: Oracle) -> None:
    templates = [*bt.NAMES, "<|endofuserprompt|>"]  # DOTS1 has no name
    assert {bt.detect_template(t) for t in templates} == set(bt.KINDS)
    assert _compare(oracle, templates, CHATS) == len(templates) * len(CHATS) * 2


def test_every_detection_is_llama_cpps(oracle: Oracle) -> None:
    kinds = {bt.detect_template(t) for t in DETECTION_TEXTS}
    # every format the text tests reach (two are named only), and the unknown
    assert kinds == set(bt.KINDS) - {bt.MISTRAL_V7_TEKKEN, bt.DEEPSEEK_OCR} | {None}
    _compare(oracle, DETECTION_TEXTS, CHATS[1:3])


def test_llama_cpps_model_templates_are_detected_as_there(oracle: Oracle) -> None:
    path = ggml_oracle.llama_root() / "src" / "llama.cpp" / "models" / "templates"
    if not path.is_dir():
        pytest.skip(f"{path} is not there")
    texts = [p.read_text(encoding="utf-8") for p in sorted(path.glob("*.jinja"))]
    assert len(texts) >= 30
    _compare(oracle, texts, CHATS[1:2])


LEGACY_MESSAGES: list[list[dict[str, Any]]] = [
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": ""},
                {"type": "text", "text": "first"},
                {"type": "media_marker", "text": "<__media__>"},
                {"type": "text", "text": "second"},
            ],
        },
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"type": "function", "id": "c1", "function": {"name": "f", "arguments": "{}"}}
            ],
        },
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
        {"role": "assistant", "content": "ok", "reasoning_content": "thought"},
    ],
    [{"role": "developer", "content": "dev"}, {"role": "user", "content": "a\u0000b ✓"}],
    [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "prefilled"}],
]


def test_the_no_jinja_route_is_llama_servers(oracle: Oracle) -> None:
    """common_chat_templates_apply with use_jinja false, on request messages."""
    templates = ["chatml", "llama3", "gemma", "mistral-v7", "<|endofuserprompt|>", "no such"]
    requests = [
        {"op": "legacy", "template": t, "messages": m, "add_generation_prompt": add}
        for t in templates
        for m in LEGACY_MESSAGES
        for add in (True, False)
    ]
    for request, ref in zip(requests, oracle(requests), strict=True):
        try:
            mine = {
                "prompt": bt.render_legacy(
                    request["template"], request["messages"], request["add_generation_prompt"]
                )
            }
        except bt.BuiltinTemplateError as err:
            mine = {"error": str(err)}
        assert mine == ref, request


def test_supported_is_the_startup_check() -> None:
    assert bt.supported("llama3") and bt.supported("<|im_start|>")
    assert not bt.supported("{{ messages }}")
