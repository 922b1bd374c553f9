"""The differential template analysis (bankml.engine_cupy.autoparser) against llama.cpp's.

Three kinds of checks:

* the text tools (markers, diff splits, common prefix/suffix, compare_variants), with the cases
  and expectations of llama.cpp's tests/test-chat-auto-parser.cpp restated;
* the analysis of the templates in llama.cpp's models/templates, with the expectations of
  test-chat-auto-parser.cpp (Nemotron, Laguna, Cohere, SmolLM3, Bailing V3, the role markers of
  every template the autoparser handles); read from the reference source tree, skipped without it;
* side by side with llama.cpp itself: ``tests/oracle/chat_analysis.cpp`` runs llama.cpp's own
  ``autoparser::analyze_template`` (linked from the reference build) on every template of
  models/templates, and every field of bankml's analysis (caps, role markers, reasoning, content,
  tool format, function, arguments, call id, preserved tokens, stops) must be the same.

Every template of models/templates loads under bankml's renderer (``test_every_template_loads``
names any that does not).
"""

from __future__ import annotations

import enum
import json
import subprocess
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

from bankml.engine_cupy.autoparser import (
    CallIdPosition,
    ContentMode,
    ReasoningMode,
    TemplateAnalysis,
    ToolFormat,
    analyze_template,
)
from bankml.engine_cupy.autoparser.helpers import (
    MARKER,
    TEXT,
    DiffSplit,
    Segment,
    TemplateParams,
    after_common_suffix,
    calculate_diff_split,
    compare_variants,
    segmentize_markers,
    until_common_prefix,
)
from bankml.engine_cupy.chat_template import ChatTemplate, TemplateError
from tests import ggml_oracle

# ---------------------------------------------------------------------------------------------
# Text tools
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "pre_marker[marker]post_marker",
            [(TEXT, "pre_marker"), (MARKER, "[marker]"), (TEXT, "post_marker")],
        ),
        (
            "pre_marker<marker>post_marker",
            [(TEXT, "pre_marker"), (MARKER, "<marker>"), (TEXT, "post_marker")],
        ),
        ("<hello>world</hello>", [(MARKER, "<hello>"), (TEXT, "world"), (MARKER, "</hello>")]),
        (
            "<hello>[hello]<world>[world]",
            [(MARKER, "<hello>"), (MARKER, "[hello]"), (MARKER, "<world>"), (MARKER, "[world]")],
        ),
        (
            "im<blue>daba<dee>da[hey]",
            [
                (TEXT, "im"),
                (MARKER, "<blue>"),
                (TEXT, "daba"),
                (MARKER, "<dee>"),
                (TEXT, "da"),
                (MARKER, "[hey]"),
            ],
        ),
        ("unclosed <tag", [(TEXT, "unclosed "), (TEXT, "<tag")]),
    ],
)
def test_segmentize_markers(text: str, expected: list[tuple[str, str]]) -> None:
    assert segmentize_markers(text) == [Segment(kind, value) for kind, value in expected]


# (left, right, prefix, left diff, right diff, suffix), from test-chat-auto-parser.cpp
DIFF_CASES = [
    ("hello world", "hello test", "hello ", "world", "test", ""),
    ("abc", "xyz", "", "abc", "xyz", ""),
    ("prefixA suffix", "prefixB suffix", "prefix", "A", "B", " suffix"),
    ("hello", "hello", "hello", "", "", ""),
    ("", "", "", "", "", ""),
    ("a", "a", "a", "", "", ""),
    (
        "<row><row><row><your><boat><gently>",
        "<row><row><row><your><boat><gently>",
        "<row><row><row><your><boat><gently>",
        "",
        "",
        "",
    ),
    ("abcdef", "abcxyz", "abc", "def", "xyz", ""),
    ("same", "sameagain", "same", "", "again", ""),
    ("test", "testing", "test", "", "ing", ""),
    ("123end", "456end", "", "123", "456", "end"),
    ("start", "end", "", "start", "end", ""),
    ("abcsuffix", "xyzsuffix", "", "abc", "xyz", "suffix"),
    ("helloXworld", "helloYworld", "hello", "X", "Y", "world"),
    ("ABCmiddleXYZ", "ABCdifferentXYZ", "ABC", "middle", "different", "XYZ"),
    ("startAend", "startBend", "start", "A", "B", "end"),
    ("aa", "ab", "a", "a", "b", ""),
    ("", "hello", "", "", "hello", ""),
    ("hello", "", "", "hello", "", ""),
    ("a", "", "", "a", "", ""),
    ("", "a", "", "", "a", ""),
    ("left", "right", "", "lef", "righ", "t"),
    ("123", "456", "", "123", "456", ""),
    ("a", "b", "", "a", "b", ""),
    ("a", "ab", "a", "", "b", ""),
    ("ab", "a", "a", "b", "", ""),
    ("testing", "test", "test", "ing", "", ""),
    ("Xtest", "Ytest", "", "X", "Y", "test"),
    ("testX", "testY", "test", "X", "Y", ""),
    ("abc", "cba", "", "abc", "cba", ""),
    ("prefix<tag>", "prefix</tag>suffix", "prefix", "<tag>", "</tag>suffix", ""),
    ("prefix<div>content</div>", "prefix<div>different</div>", "prefix<div>", "cont", "differ", "ent</div>"),
    ("<tag>left</tag>", "<tag>righ</tag>", "<tag>", "left", "righ", "</tag>"),
    ("PREFIX</think>Sure", "PREFIX<think>Lemme think</think>Sure", "PREFIX", "", "<think>Lemme think", "</think>Sure"),
]  # fmt: skip


@pytest.mark.parametrize(("left", "right", "prefix", "ldiff", "rdiff", "suffix"), DIFF_CASES)
def test_calculate_diff_split(
    left: str, right: str, prefix: str, ldiff: str, rdiff: str, suffix: str
) -> None:
    assert calculate_diff_split(left, right) == DiffSplit(prefix, suffix, ldiff, rdiff)


def test_calculate_diff_split_unclosed_and_special_tokens() -> None:
    result = calculate_diff_split("Hello <world>", "Hello test")
    assert (result.prefix, result.right, result.suffix) == ("Hello ", "test", "")
    assert "<world>" in result.left
    result = calculate_diff_split("test [array]", "test other")
    assert (result.prefix, result.right, result.suffix) == ("test ", "other", "")
    assert "[array]" in result.left
    assert calculate_diff_split("test<tag", "test>content").prefix.startswith("test")
    # the |> that starts the common suffix completes <|END_RESPONSE and <|END_ACTION
    prefix = "SOME_PREFIX"
    suffix = "|><|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>"
    left = "<|START_RESPONSE|>Let me help you.<|END_RESPONSE"
    right = (
        '<|START_THINKING|><|END_THINKING|><|START_ACTION|>[\n    {"tool_call_id": "0", '
        '"tool_name": "test_function_name", "parameters": {"param1": "value1", '
        '"param2": "value2"}}\n]<|END_ACTION'
    )
    result = calculate_diff_split(prefix + left + suffix, prefix + right + suffix)
    assert result.prefix == prefix
    assert result.left == "<|START_RESPONSE|>Let me help you.<|END_RESPONSE|>"
    assert "<|END_ACTION|>" in result.right
    assert result.suffix == "<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>"


def test_calculate_diff_split_generation_prompt_is_not_rotated() -> None:
    left = "<|im_start|>user\nHello<|im_end|>\n"
    result = calculate_diff_split(left, left + "<|im_start|>assistant\n<think>\n")
    assert result == DiffSplit(prefix=left, right="<|im_start|>assistant\n<think>\n")
    common = (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nSearch for files<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nLet me search.\n</think>\n\n"
        "<tool_call>\n<function=search>\n</function>\n</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nNo files found\n</tool_response><|im_end|>\n"
    )
    result = calculate_diff_split(common, common + "<|im_start|>assistant\n<think>\n")
    assert (result.left, result.right) == ("", "<|im_start|>assistant\n<think>\n")


@pytest.mark.parametrize(
    ("full", "left", "right", "expected"),
    [
        ("<function name=foo><arg name=bar>", "<arg name=bar>", "<arg name=baz>", "<function name=foo>"),
        ("prefix<test>suffix", "<test>different", "<test>other", "prefix"),
        ("<common>rest", "<common>left", "<common>right", ""),
        ("something", "left", "right", ""),
        ("test", "", "right", ""),
        ("abcXYZ<shared_prefix>rest", "<shared_prefix>left", "<shared_prefix>right", "abcXYZ"),
    ],
)  # fmt: skip
def test_until_common_prefix(full: str, left: str, right: str, expected: str) -> None:
    assert until_common_prefix(full, left, right) == expected


@pytest.mark.parametrize(
    ("full", "left", "right", "expected"),
    [
        ("<function name=foo><arg name=bar>100</arg></function>", "<arg name=bar>100</arg>", "<arg name=baz>535</arg>", "</function>"),
        ("rest<common>", "left<common>", "right<common>", ""),
        ("test", "left", "", ""),
        ("<outer><inner>value</inner></outer>", "<inner>value</inner>", "<inner>different</inner>", "</outer>"),
        ("prefix<shared>rest</shared>", "prefix<shared>left</shared>", "prefix<shared>right</shared>", ""),
        ("<tag>content</tag><extra>", "<tag>value</tag>", "<tag>other</tag>", "<extra>"),
        ("start<middle>end</middle>", "prefix<middle>left</middle>", "prefix<middle>right</middle>", ""),
    ],
)  # fmt: skip
def test_after_common_suffix(full: str, left: str, right: str, expected: str) -> None:
    assert after_common_suffix(full, left, right) == expected


def _user(content: str) -> dict[str, Any]:
    return {"role": "user", "content": content}


def test_compare_variants() -> None:
    echo = ChatTemplate("{{ messages[0]['content'] }}")
    base = TemplateParams(messages=[_user("Hello")])
    found = compare_variants(echo, base, lambda p: p.but(messages=[_user("World")]))
    assert found is not None and (found.diff.left, found.diff.right) == ("Hello", "World")
    same = compare_variants(echo, base)
    assert same is not None and same.diff == DiffSplit(prefix="Hello")

    roles = ChatTemplate(
        "{% for message in messages %}{{ message['role'] }}:{{ message['content'] }}{% endfor %}"
    )
    base = TemplateParams(messages=[_user("A")])
    found = compare_variants(roles, base, lambda p: p.but(messages=[_user("B")]))
    assert found is not None and (found.diff.left, found.diff.right) == ("A", "B")
    found = compare_variants(
        roles, base, lambda p: p.but(messages=[{"role": "newuser", "content": "B"}])
    )
    assert found is not None and (found.diff.left, found.diff.right) == ("user:A", "newuser:B")

    tools = ChatTemplate("{% for tool in tools %}{{ tool['name'] }}{% endfor %}")
    found = compare_variants(
        tools, TemplateParams(tools=[{"name": "foo"}]), lambda p: p.but(tools=[{"name": "bar"}])
    )
    assert found is not None and (found.diff.left, found.diff.right) == ("foo", "bar")

    failing = ChatTemplate("{{ messages.cahoot()[0]['nonexistent_field'] }}")
    assert compare_variants(failing, TemplateParams(messages=[_user("Hello")])) is None


# ---------------------------------------------------------------------------------------------
# Templates of llama.cpp's models/templates
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def templates_dir() -> Path:
    """models/templates of the reference source tree (scripts/build-llama-server.sh keeps the
    source beside the binary); the tests that read it skip without it."""
    try:
        root = ggml_oracle.llama_root()
    except (OSError, subprocess.CalledProcessError) as err:
        pytest.skip(f"no reference llama.cpp build: {err}")
    path = root / "src" / "llama.cpp" / "models" / "templates"
    if not path.is_dir():
        pytest.skip(f"{path} is not there")
    return path


_ANALYSES: dict[str, TemplateAnalysis] = {}


def analysis_of(templates_dir: Path, name: str) -> TemplateAnalysis:
    if name not in _ANALYSES:
        source = (templates_dir / name).read_text(encoding="utf-8")
        _ANALYSES[name] = analyze_template(ChatTemplate(source))
    return _ANALYSES[name]


def test_every_template_loads(templates_dir: Path) -> None:
    refused = {}
    for path in sorted(templates_dir.glob("*.jinja")):
        try:
            ChatTemplate(path.read_text(encoding="utf-8"))
        except TemplateError as err:
            refused[path.name] = str(err)
    assert refused == {}


def test_nemotron_3(templates_dir: Path) -> None:
    a = analysis_of(templates_dir, "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16.jinja")
    assert (a.reasoning.mode, a.reasoning.start, a.reasoning.end) == (
        ReasoningMode.TAG_BASED,
        "<think>\n",
        "\n</think>\n",
    )
    assert (a.content.mode, a.content.start, a.content.end) == (ContentMode.PLAIN, "", "")
    fmt, fn, args = a.tools.format, a.tools.function, a.tools.arguments
    assert fmt.mode is ToolFormat.TAG_WITH_TAGGED
    assert (fmt.section_start, fmt.section_end) == ("", "")
    assert (fmt.per_call_start, fmt.per_call_end) == ("<tool_call>\n", "</tool_call>")
    assert (fn.name_prefix, fn.name_suffix, fn.close) == ("<function=", ">\n", "</function>\n")
    assert (args.name_prefix, args.name_suffix, args.value_suffix) == (
        "<parameter=",
        ">\n",
        "\n</parameter>\n",
    )
    assert a.jinja_caps.supports_tools and a.jinja_caps.supports_parallel_tool_calls


@pytest.mark.parametrize(
    "name",
    ["poolside-Laguna-XS-2.1.jinja", "poolside-Laguna-S-2.1.jinja", "poolside-Laguna-XS.2.jinja"],
)
def test_laguna(templates_dir: Path, name: str) -> None:
    a = analysis_of(templates_dir, name)
    assert (a.reasoning.mode, a.reasoning.start, a.reasoning.end) == (
        ReasoningMode.TAG_BASED,
        "<think>",
        "</think>",
    )
    assert a.tools.arguments.value_suffix == "</arg_value>"
    assert a.tools.arguments.tolerate_intertag_whitespace
    assert "</assistant>" in a.additional_stops


def test_cohere_command_r7b(templates_dir: Path) -> None:
    a = analysis_of(templates_dir, "CohereForAI-c4ai-command-r7b-12-2024-tool_use.jinja")
    assert (a.reasoning.mode, a.reasoning.start, a.reasoning.end) == (
        ReasoningMode.TOOLS_ONLY,
        "<|START_THINKING|>",
        "<|END_THINKING|>",
    )
    assert (a.content.mode, a.content.start, a.content.end) == (
        ContentMode.ALWAYS_WRAPPED,
        "<|START_RESPONSE|>",
        "<|END_RESPONSE|>",
    )
    fmt, fn, args = a.tools.format, a.tools.function, a.tools.arguments
    assert fmt.mode is ToolFormat.JSON_NATIVE
    assert (fmt.section_start, fmt.section_end) == ("<|START_ACTION|>", "<|END_ACTION|>")
    assert (fmt.per_call_start, fmt.per_call_end) == ("", "")
    assert (fn.name_prefix, fn.name_suffix, fn.close) == ("", "", "")
    assert asdict(args) == asdict(type(args)())  # no argument markers at all
    assert (fmt.name_field, fmt.args_field, fmt.id_field) == ("tool_name", "parameters", "")
    assert fmt.tools_array_wrapped and not a.content.requires_nonnull_content
    assert a.jinja_caps.supports_tools and a.jinja_caps.supports_parallel_tool_calls


def test_smollm3(templates_dir: Path) -> None:
    a = analysis_of(templates_dir, "HuggingFaceTB-SmolLM3-3B.jinja")
    assert (a.reasoning.mode, a.reasoning.start, a.reasoning.end) == (
        ReasoningMode.TAG_BASED,
        "<think>",
        "</think>",
    )
    assert (a.content.mode, a.content.start, a.content.end) == (ContentMode.PLAIN, "", "")
    assert {"<think>", "</think>"} <= set(a.preserved_tokens)


def test_mistral_small_call_id(templates_dir: Path) -> None:
    a = analysis_of(templates_dir, "Mistral-Small-3.2-24B-Instruct-2506.jinja")
    assert a.tools.format.mode is ToolFormat.TAG_WITH_JSON
    assert a.tools.format.per_call_start == "[TOOL_CALLS]"
    assert (a.tools.call_id.pos, a.tools.call_id.prefix, a.tools.call_id.suffix) == (
        CallIdPosition.BETWEEN_FUNC_AND_ARGS,
        "[CALL_ID]",
        "[ARGS]",
    )


BAILING_V3 = """
{# Bailing V3 chat template #}
{%- if tools %}{{ tools | tojson }}{%- endif %}
{%- for message in messages %}
    {%- if message.role == "user" %}
        {{- '<role>HUMAN</role>' + message.content + '<|role_end|>' }}
    {%- elif message.role == "assistant" %}
        {{- '<role>ASSISTANT</role>' }}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- set tc = tool_call.function %}
                {{- '<tool_call>' + tc.name }}
                {%- for k, v in tc.arguments.items() %}
                    {{- '<arg_key>' + k + '</arg_key>' }}
                    {{- '\\n<arg_value>' + v + '</arg_value>' }}
                {%- endfor %}
                {{- '\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|role_end|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<role>ASSISTANT</role>' }}{%- endif %}
"""


def test_bailing_v3() -> None:
    a = analyze_template(ChatTemplate(BAILING_V3))
    assert a.tools.arguments.value_suffix == "</arg_value>"
    assert a.tools.arguments.tolerate_intertag_whitespace


ROLE_MARKERS = {
    "Bielik-11B-v3.0-Instruct.jinja": ("<|im_start|>user", "<|im_start|>assistant"),
    "HuggingFaceTB-SmolLM3-3B.jinja": ("<|im_start|>user", "<|im_start|>assistant"),
    "MiMo-VL.jinja": ("<|im_start|>user", "<|im_start|>assistant"),
    "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use.jinja": ("<|im_start|>user", "<|im_start|>assistant"),
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja": ("<|im_start|>user", "<|im_start|>assistant"),
    "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16.jinja": ("<|im_start|>user", "<|im_start|>assistant"),
    "Qwen3.5-4B.jinja": ("<|im_start|>user", "<|im_start|>assistant"),
    "Qwen3-Coder.jinja": ("<|im_start|>user", "<|im_start|>assistant"),
    "Qwen-Qwen2.5-7B-Instruct.jinja": ("<|im_start|>user", "<|im_start|>assistant"),
    "Qwen-Qwen3-0.6B.jinja": ("<|im_start|>user", "<|im_start|>assistant"),
    "Qwen-QwQ-32B.jinja": ("<|im_start|>user", "<|im_start|>assistant"),
    "StepFun3.5-Flash.jinja": ("<|im_start|>user", "<|im_start|>assistant"),
    "deepseek-ai-DeepSeek-R1-Distill-Llama-8B.jinja": ("<｜User｜>", "<｜Assistant｜>"),
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja": ("<｜User｜>", "<｜Assistant｜>"),
    "deepseek-ai-DeepSeek-V3.1.jinja": ("<｜User｜>", "<｜Assistant｜>"),
    "llama-cpp-deepseek-r1.jinja": ("<｜User｜>", "<｜Assistant｜>"),
    "meetkai-functionary-medium-v3.1.jinja": ("<|start_header_id|>user<|end_header_id|>", "<|start_header_id|>assistant<|end_header_id|>"),
    "meta-llama-Llama-3.1-8B-Instruct.jinja": ("<|start_header_id|>user<|end_header_id|>", "<|start_header_id|>assistant<|end_header_id|>"),
    "meta-llama-Llama-3.2-3B-Instruct.jinja": ("<|start_header_id|>user<|end_header_id|>", "<|start_header_id|>assistant<|end_header_id|>"),
    "meta-llama-Llama-3.3-70B-Instruct.jinja": ("<|start_header_id|>user<|end_header_id|>", "<|start_header_id|>assistant<|end_header_id|>"),
    "fireworks-ai-llama-3-firefunction-v2.jinja": ("<|start_header_id|>user<|end_header_id|>", "<|start_header_id|>assistant<|end_header_id|>"),
    "microsoft-Phi-3.5-mini-instruct.jinja": ("<|user|>", "<|assistant|>"),
    "GLM-4.6.jinja": ("<|user|>", "<|assistant|>"),
    "unsloth-Apriel-1.5.jinja": ("<|user|>", "<|assistant|>"),
    "GLM-4.7-Flash.jinja": ("<|user|>", "<|assistant|>"),
    "google-gemma-2-2b-it.jinja": ("<start_of_turn>user", "<start_of_turn>model"),
    "ibm-granite-granite-3.3-2B-Instruct.jinja": ("<|start_of_role|>user<|end_of_role|>", "<|start_of_role|>assistant<|end_of_role|>"),
    "ibm-granite-granite-4.0.jinja": ("<|start_of_role|>user<|end_of_role|>", "<|start_of_role|>assistant<|end_of_role|>"),
    "CohereForAI-c4ai-command-r7b-12-2024-tool_use.jinja": ("<|START_OF_TURN_TOKEN|><|USER_TOKEN|>", "<|START_RESPONSE|>"),
    "CohereForAI-c4ai-command-r-plus-tool_use.jinja": ("<|START_OF_TURN_TOKEN|><|USER_TOKEN|>", "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>"),
    "mistralai-Mistral-Nemo-Instruct-2407.jinja": ("[INST]", ""),
    "Mistral-Small-3.2-24B-Instruct-2506.jinja": ("[INST]", ""),
    "Apertus-8B-Instruct.jinja": ("<|user_start|>", "<|assistant_start|>"),
    "Apriel-1.6-15b-Thinker-fixed.jinja": ("<|begin_user|>", "<|begin_assistant|>"),
    "ByteDance-Seed-OSS.jinja": ("<seed:bos>user", "<seed:bos>assistant"),
    "GigaChat3.1-10B-A1.8B.jinja": ("user<|role_sep|>", "assistant<|role_sep|>"),
    "MiniMax-M2.jinja": ("]~b]user", "]~b]ai"),
    "tencent-Hy3.jinja": ("<｜hy_User:opensource｜>", "<｜hy_Assistant:opensource｜>"),
    "NVIDIA-Nemotron-Nano-v2.jinja": ("<SPECIAL_11>User", "<SPECIAL_11>Assistant"),
    "Reka-Edge.jinja": ("human:", "assistant:"),
    "llama-cpp-rwkv-world.jinja": ("User:", "Assistant:"),
    "upstage-Solar-Open-100B.jinja": ("<|begin|>user<|content|>", "<|begin|>assistant"),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(ROLE_MARKERS))
def test_role_markers(templates_dir: Path, name: str) -> None:
    a = analysis_of(templates_dir, name)
    assert (a.user_start, a.assistant_start) == ROLE_MARKERS[name]


def test_chat_template_reasoning_is_the_analysis(templates_dir: Path) -> None:
    """ChatTemplate's reasoning markers (its enable_thinking default and continuation) are the
    analysis's, workarounds included (Nemotron Nano v2's and Granite 3.3's fixed answers)."""
    for name, start, end in [
        ("NVIDIA-Nemotron-Nano-v2.jinja", "<think>\n", "</think>"),
        ("ibm-granite-granite-3.3-2B-Instruct.jinja", "<think>", "</think>"),
        ("Qwen-Qwen3-0.6B.jinja", "<think>\n", "\n</think>\n\n"),
    ]:
        template = ChatTemplate((templates_dir / name).read_text(encoding="utf-8"))
        assert template.reasoning == template.analysis.reasoning
        assert (template.reasoning.start, template.reasoning.end) == (start, end)
        assert template.reasoning.supported
    plain = ChatTemplate((templates_dir / "google-gemma-2-2b-it.jinja").read_text())
    assert not plain.reasoning.supported


# ---------------------------------------------------------------------------------------------
# Side by side with llama.cpp's own analysis
# ---------------------------------------------------------------------------------------------


def _as_json(a: TemplateAnalysis) -> dict[str, Any]:
    def plain(part: Any) -> dict[str, Any]:
        return {
            k: v.value if isinstance(v, enum.Enum) else list(v) if isinstance(v, tuple) else v
            for k, v in asdict(part).items()
        }

    caps = a.jinja_caps
    return {
        "caps": {
            name: getattr(caps, name)
            for name in (
                "supports_tools",
                "supports_tool_calls",
                "supports_system_role",
                "supports_parallel_tool_calls",
                "supports_string_content",
                "supports_typed_content",
                "supports_object_arguments",
            )
        },
        "user_start": a.user_start,
        "assistant_start": a.assistant_start,
        "reasoning": plain(a.reasoning),
        "content": plain(a.content),
        "format": plain(a.tools.format),
        "function": plain(a.tools.function),
        "arguments": plain(a.tools.arguments),
        "call_id": plain(a.tools.call_id),
        "preserved_tokens": list(a.preserved_tokens),
        "additional_stops": list(a.additional_stops),
    }


@pytest.fixture(scope="session")
def llama_analyses(templates_dir: Path) -> dict[str, dict[str, Any]]:
    """llama.cpp's analysis of every template, from tests/oracle/chat_analysis.cpp."""
    try:
        binary = ggml_oracle.compile_against_ggml(
            ggml_oracle.HERE / "oracle" / "chat_analysis.cpp", "chat-analysis"
        )
    except (RuntimeError, OSError, subprocess.CalledProcessError) as err:
        pytest.skip(f"cannot build the analysis oracle: {err}")
    paths = sorted(templates_dir.glob("*.jinja"))
    out = subprocess.run(
        [str(binary), *map(str, paths)], check=True, capture_output=True, text=True
    ).stdout
    return {path.name: json.loads(line) for path, line in zip(paths, out.splitlines(), strict=True)}


def test_every_template_analysed_as_llama_cpp_does(
    templates_dir: Path, llama_analyses: dict[str, dict[str, Any]]
) -> None:
    assert len(llama_analyses) >= 60  # the whole models/templates folder
    differing = {}
    for name, theirs in llama_analyses.items():
        assert "error" not in theirs, name
        ours = _as_json(analysis_of(templates_dir, name))
        if ours != theirs:
            differing[name] = {
                key: (theirs[key], ours[key]) for key in theirs if theirs[key] != ours[key]
            }
    assert differing == {}
