"""The chat params the autoparser generates (bankml.engine_cupy.autoparser.generator/apply)
against llama.cpp's own.

Side by side: ``tests/oracle/chat_params.cpp`` runs llama.cpp's ``common_chat_templates_apply``
(linked from the reference build) and ``common_chat_parse`` on the same requests, for every
template of llama.cpp's models/templates that the autoparser handles (the others go to
llama.cpp's specialised handlers, which bankml names and refuses). Each request's prompt,
generation prompt, GBNF grammar, lazy flag and triggers, preserved tokens, stops, thinking tags
and PEG parser (parser for parser) must be identical, and so must the messages both parse out of
model outputs: generic ones and the template's own rendering of a tool call (whole and cut
short), and, parsed as a stream still running, every 7th prefix of that tool call. Requests: no
tools (reasoning extracted or not, thinking on or off, or off through chat_template_kwargs), a
tool with tool_choice auto (parallel calls or not), required and none, a response-format schema,
a continued assistant message (content, content parts and reasoning), force_pure_content.

Plus llama.cpp's own expectations restated (test-chat-auto-parser.cpp's Bailing V3 parser) and
the request checks llama-server makes.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest

from bankml.engine_cupy.autoparser import analyze_template
from bankml.engine_cupy.autoparser.apply import (
    ChatRequest,
    SpecializedTemplateError,
    chat_params,
    specialized_template,
)
from bankml.engine_cupy.autoparser.dedicated import HANDLERS
from bankml.engine_cupy.autoparser.generator import (
    ChatParams,
    Continuation,
    GenerationParams,
    ReasoningFormat,
    ToolChoice,
    TriggerType,
    build_parser,
)
from bankml.engine_cupy.autoparser.helpers import segmentize_markers
from bankml.engine_cupy.chat_template import ChatTemplate, TemplateError, normalize_messages
from bankml.engine_cupy.peg.chat import ChatMsg, chat_peg_parse
from bankml.engine_cupy.peg.parser import ParseContext, ParseFlags
from tests import ggml_oracle
from tests.test_autoparser_analysis import BAILING_V3, templates_dir  # noqa: F401

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
CALL = {
    "role": "assistant",
    "content": "",
    "tool_calls": [
        {
            "id": "call_1",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'},
        }
    ],
}
OUTPUTS = [
    "Hello there.",
    "<think>Let me think.</think>The answer.",
    "I think\n</think>\nSo it is.",
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "abc123def"}]',
    '{"name": "get_weather", "parameters": {"city": "Paris"}}',
    '{"a": 1}',
]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}
PREFILL = [*USER, {"role": "assistant", "content": "It is"}]
THINKING_PREFILL = [*USER, {"role": "assistant", "content": "", "reasoning_content": "Hmm,"}]
PARTS_PREFILL = [
    *USER,
    {
        "role": "assistant",
        "content": [{"type": "text", "text": "It is"}, {"type": "text", "text": "sunny"}],
    },
]

# (oracle request fields, the same as a ChatRequest)
VARIANTS: list[tuple[dict[str, Any], ChatRequest]] = [
    ({}, ChatRequest(USER)),
    ({"reasoning_format": "auto"}, ChatRequest(USER, reasoning_format=ReasoningFormat.AUTO)),
    (
        {"reasoning_format": "auto", "enable_thinking": False},
        ChatRequest(USER, reasoning_format=ReasoningFormat.AUTO, enable_thinking=False),
    ),
    (
        {"tools": [WEATHER], "reasoning_format": "auto"},
        ChatRequest(USER, tools=[WEATHER], reasoning_format=ReasoningFormat.AUTO),
    ),
    (
        {"tools": [WEATHER], "reasoning_format": "auto", "parallel_tool_calls": True},
        ChatRequest(
            USER, tools=[WEATHER], reasoning_format=ReasoningFormat.AUTO, parallel_tool_calls=True
        ),
    ),
    (
        {"tools": [WEATHER], "tool_choice": "required"},
        ChatRequest(USER, tools=[WEATHER], tool_choice=ToolChoice.REQUIRED),
    ),
    (
        {"json_schema": json.dumps(SCHEMA), "reasoning_format": "auto"},
        ChatRequest(USER, json_schema=SCHEMA, reasoning_format=ReasoningFormat.AUTO),
    ),
    (
        {"messages": PREFILL, "continue_final_message": "auto", "reasoning_format": "auto"},
        ChatRequest(
            PREFILL,
            continue_final_message=Continuation.AUTO,
            reasoning_format=ReasoningFormat.AUTO,
        ),
    ),
    (
        {"messages": THINKING_PREFILL, "continue_final_message": "auto"},
        ChatRequest(THINKING_PREFILL, continue_final_message=Continuation.AUTO),
    ),
    (
        {"messages": PARTS_PREFILL, "continue_final_message": "content"},
        ChatRequest(PARTS_PREFILL, continue_final_message=Continuation.CONTENT),
    ),
    (
        {"tools": [WEATHER], "tool_choice": "none", "reasoning_format": "auto"},
        ChatRequest(
            USER,
            tools=[WEATHER],
            tool_choice=ToolChoice.NONE,
            reasoning_format=ReasoningFormat.AUTO,
        ),
    ),
    (
        {"chat_template_kwargs": {"enable_thinking": "false"}, "reasoning_format": "auto"},
        ChatRequest(
            USER,
            chat_template_kwargs={"enable_thinking": False},
            reasoning_format=ReasoningFormat.AUTO,
        ),
    ),
    (
        {"force_pure_content": True, "tools": [WEATHER], "reasoning_format": "auto"},
        ChatRequest(
            USER, tools=[WEATHER], reasoning_format=ReasoningFormat.AUTO, force_pure_content=True
        ),
    ),
]


def own_tool_call(template: ChatTemplate) -> list[str]:
    """The template's own text for an assistant tool call (what a model trained on it writes),
    whole and with its last one to three markers cut off."""
    try:
        full = template.direct_apply(normalize_messages([*USER, CALL], template.caps), [WEATHER])
        head = template.direct_apply(
            normalize_messages(USER, template.caps), [WEATHER], add_generation_prompt=True
        )
    except TemplateError:
        return []
    n = 0
    while n < min(len(full), len(head)) and full[n] == head[n]:
        n += 1
    text = full[n:]
    segments = segmentize_markers(text)
    cut = ["".join(s.value for s in segments[:-k]) for k in (1, 2, 3) if len(segments) > k]
    return [text, *cut]


def streamed(output: str) -> list[str]:
    """Prefixes of an output as a stream shows it: every 7th character, and the whole."""
    return [output[:n] for n in range(1, len(output), 7)] + [output]


def ours(params: ChatParams) -> dict[str, Any]:
    assert params.parser is not None
    return {
        "prompt": params.prompt,
        "generation_prompt": params.generation_prompt,
        "grammar": params.grammar,
        "grammar_lazy": params.grammar_lazy,
        "grammar_triggers": [
            [list(TriggerType).index(t.type), t.value] for t in params.grammar_triggers
        ],
        "preserved_tokens": list(params.preserved_tokens),
        "additional_stops": list(params.additional_stops),
        "supports_thinking": params.supports_thinking,
        "thinking_start_tag": params.thinking_start_tag,
        "thinking_end_tags": list(params.thinking_end_tags),
        "parser": params.parser.to_json(),
    }


def message(msg: ChatMsg) -> dict[str, Any]:
    return {
        "content": msg.content,
        "reasoning_content": msg.reasoning_content,
        "tool_calls": [[c.name, c.arguments, c.id] for c in msg.tool_calls],
    }


def their_message(j: dict[str, Any]) -> dict[str, Any]:
    if "error" in j:
        return {"error": True}
    calls = j.get("tool_calls") or []
    return {
        "content": j.get("content") or "",
        "reasoning_content": j.get("reasoning_content") or "",
        "tool_calls": [
            [c["function"]["name"], c["function"]["arguments"], c.get("id") or ""] for c in calls
        ],
    }


@pytest.fixture(scope="session")
def chat_params_oracle() -> Path:
    try:
        return ggml_oracle.compile_against_ggml(
            ggml_oracle.HERE / "oracle" / "chat_params.cpp", "chat-params"
        )
    except (RuntimeError, OSError, subprocess.CalledProcessError) as err:
        pytest.skip(f"cannot build the chat params oracle: {err}")


def test_chat_params_as_llama_cpp(
    templates_dir: Path,  # noqa: F811
    chat_params_oracle: Path,
) -> None:
    names = sorted(
        p.name
        for p in templates_dir.glob("*.jinja")
        if specialized_template(p.read_text(encoding="utf-8")) is None
    )
    assert len(names) >= 30
    requests, cases = [], []
    for name in names:
        template = ChatTemplate((templates_dir / name).read_text(encoding="utf-8"))
        own = own_tool_call(template)
        outputs = OUTPUTS + own
        partial = streamed(own[0] if own else OUTPUTS[1])
        for fields, request in VARIANTS:
            body = {
                "template": str(templates_dir / name),
                "messages": USER,
                "outputs": outputs,
                "partial_outputs": partial,
                **fields,
            }
            requests.append(json.dumps(body))
            cases.append((name, template, request, outputs, partial, fields))
    answers = subprocess.run(
        [str(chat_params_oracle)],
        input="\n".join(requests) + "\n",
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    assert len(answers) == len(cases)
    differing, tool_call_parses, partial_call_parses = [], 0, 0
    for (name, template, request, outputs, partial, fields), line in zip(
        cases, answers, strict=True
    ):
        theirs = json.loads(line)
        assert "error" not in theirs, (name, fields, theirs)
        params = chat_params(template, request)
        mine = ours(params)
        if "continue_final_message" in fields:  # ChatTemplate.render continues the same way
            rendered = template.render(
                fields["messages"],
                continue_final_message=fields["continue_final_message"],
                enable_thinking=True,
            )
            if rendered != theirs["prompt"]:
                differing.append((name, fields, "ChatTemplate.render"))
        for key, value in mine.items():
            if value != theirs[key]:
                differing.append((name, fields, key))
        assert params.parser is not None
        for output, their_msg in zip(outputs, theirs["parsed"], strict=True):
            try:
                got = message(
                    chat_peg_parse(params.parser, output, False, params.generation_prompt)
                )
            except Exception:  # noqa: BLE001 - a refused output is compared as such
                got = {"error": True}
            want = their_message(their_msg)
            tool_call_parses += bool(want.get("tool_calls"))
            if got != want:
                differing.append((name, fields, f"parse {output[:40]!r}"))
        for output, their_msg in zip(partial, theirs["partial"], strict=True):
            try:
                got = message(chat_peg_parse(params.parser, output, True, params.generation_prompt))
            except Exception:  # noqa: BLE001 - a refused output is compared as such
                got = {"error": True}
            want = their_message(their_msg)
            partial_call_parses += bool(want.get("tool_calls"))
            if got != want:
                differing.append((name, fields, f"partial {output!r}"))
    assert differing == []
    assert tool_call_parses >= 150  # the outputs exercise the tool-call parsers
    assert partial_call_parses >= 600  # and so do the streamed prefixes


def test_specialized_templates_are_named(templates_dir: Path) -> None:  # noqa: F811
    named = {}
    for path in sorted(templates_dir.glob("*.jinja")):
        template = ChatTemplate(path.read_text(encoding="utf-8"))
        name = specialized_template(template.source)
        if name is None:
            continue
        named[path.name] = name
        if name in HANDLERS:  # tests/test_dedicated_parsers.py
            continue
        with pytest.raises(SpecializedTemplateError, match=re.escape(f"not followed yet: {name}")):
            chat_params(template, ChatRequest(USER, tools=[WEATHER]))
    assert named["openai-gpt-oss-120b.jinja"] == "GPT-OSS"
    assert named["Qwen3-Coder.jinja"] == "Qwen3-Coder"
    assert named["moonshotai-Kimi-K2.jinja"] == "Kimi K2 Thinking"
    assert named["mistralai-Ministral-3-14B-Reasoning-2512.jinja"] == "Ministral/Magistral Large 3"
    assert named["meetkai-functionary-medium-v3.2.jinja"] == "Functionary v3.2"


def test_grammar_with_tools_is_refused() -> None:
    template = ChatTemplate(BAILING_V3.replace("Bailing V3", "Plain"))
    with pytest.raises(TemplateError, match="Cannot specify grammar with tools"):
        chat_params(template, ChatRequest(USER, tools=[WEATHER], grammar='root ::= "x"'))


def test_bailing_v3_parses_a_multi_argument_call() -> None:
    """test-chat-auto-parser.cpp's Bailing V3 case: the parser built from the analysis reads a
    call whose arguments have whitespace between the tags."""
    analysis = analyze_template(ChatTemplate(BAILING_V3))
    tool = {
        "type": "function",
        "function": {
            "name": "test_function_name",
            "parameters": {
                "type": "object",
                "properties": {"param1": {"type": "string"}, "param2": {"type": "string"}},
            },
        },
    }
    inputs = GenerationParams(tools=[tool], reasoning_format=ReasoningFormat.NONE)
    arena = build_parser(analysis, inputs, "")
    output = (
        "<tool_call>test_function_name\n"
        "<arg_key>param1</arg_key>\n<arg_value>value1</arg_value>"
        "<arg_key>param2</arg_key>\n<arg_value>value2</arg_value>\n"
        "</tool_call>"
    )
    assert arena.parse(ParseContext(output, ParseFlags.LENIENT)).success()
    msg = chat_peg_parse(arena, output, False)
    assert [(c.name, json.loads(c.arguments)) for c in msg.tool_calls] == [
        ("test_function_name", {"param1": "value1", "param2": "value2"})
    ]


@pytest.mark.parametrize(
    ("name", "output", "reasoning", "content", "calls"),
    [
        (
            "Qwen-Qwen2.5-7B-Instruct.jinja",
            'Sure.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            "</tool_call>",
            "",
            "Sure.",
            [("get_weather", {"city": "Paris"}, "")],
        ),
        (
            "Qwen-QwQ-32B.jinja",
            "Let me see.\n</think>\n\nIt is sunny.",
            "\nLet me see.\n",  # the generation prompt's "<think>\n" newline, kept raw
            "\n\nIt is sunny.",
            [],
        ),
        (
            "Mistral-Small-3.2-24B-Instruct-2506.jinja",
            '[TOOL_CALLS]get_weather[CALL_ID]abc123def[ARGS]{"city": "Paris", "days": 2}',
            "",
            "",
            [("get_weather", {"city": "Paris", "days": 2}, "abc123def")],
        ),
    ],
)
def test_outputs_parse_into_messages(
    templates_dir: Path,  # noqa: F811
    name: str,
    output: str,
    reasoning: str,
    content: str,
    calls: list[tuple[str, dict[str, Any], str]],
) -> None:
    """Model outputs of the forms llama.cpp's tests use, read into messages (the expectations
    are llama.cpp's common_chat_parse's on the same outputs)."""
    template = ChatTemplate((templates_dir / name).read_text(encoding="utf-8"))
    request = ChatRequest(
        USER, tools=[WEATHER], reasoning_format=ReasoningFormat.AUTO, parallel_tool_calls=True
    )
    params = chat_params(template, request)
    assert params.parser is not None
    msg = chat_peg_parse(params.parser, output, False, params.generation_prompt)
    assert (msg.reasoning_content, msg.content) == (reasoning, content)
    assert [(c.name, json.loads(c.arguments), c.id) for c in msg.tool_calls] == calls
