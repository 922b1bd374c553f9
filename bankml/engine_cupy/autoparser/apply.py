"""A chat request on a template, as llama-server prepares it (common_chat_templates_apply_jinja).

Which template (the tool-use one when tools are given and the model has one), the message
workarounds (StepFun's whitespace trim, roles and content as the template takes them), the
continuation of the last message, ``chat_template_kwargs``, the checks, ``force_pure_content``,
then either one of llama.cpp's specialised handlers — detected here and run as ported in
:mod:`.dedicated` (:class:`SpecializedTemplateError` names one without a port) — or the
differential autoparser (:mod:`.analysis` then :mod:`.generator`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from bankml.engine_cupy.autoparser.analysis import AnalysisError
from bankml.engine_cupy.autoparser.dedicated import HANDLERS
from bankml.engine_cupy.autoparser.generator import (
    ChatParams,
    Continuation,
    GenerationParams,
    ReasoningFormat,
    ToolChoice,
    generate_parser,
    generation_prompt,
    render_prompt,
)
from bankml.engine_cupy.autoparser.helpers import trim_whitespace
from bankml.engine_cupy.chat_template import (
    ChatTemplate,
    TemplateError,
    extra_context,
    normalize_messages,
    normalize_tools,
)
from bankml.engine_cupy.json_schema_grammar import CHAT_PARSER_FAILED
from bankml.engine_cupy.peg.chat import build_chat_peg_parser


class SpecializedTemplateError(NotImplementedError):
    """llama-server handles this template with a dedicated parser bankml does not follow yet."""

    def __init__(self, name: str):
        super().__init__(f"specialized, not followed yet: {name}")
        self.name = name


@dataclass(frozen=True)
class ChatRequest:
    """The chat inputs llama-server passes on (common_chat_templates_inputs), messages and tools
    in OpenAI form. ``continue_final_message`` is set by the caller where llama-server sets it
    (an explicit request, or a trailing assistant message: AUTO)."""

    messages: Sequence[Mapping[str, Any]]
    tools: Sequence[Mapping[str, Any]] | None = None
    tool_choice: ToolChoice = ToolChoice.AUTO
    parallel_tool_calls: bool = False
    reasoning_format: ReasoningFormat = ReasoningFormat.NONE
    enable_thinking: bool = True
    chat_template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    add_generation_prompt: bool = True
    continue_final_message: Continuation = Continuation.NONE
    json_schema: Mapping[str, Any] | None = None
    grammar: str = ""
    force_pure_content: bool = False


def _has(src: str, *needles: str) -> bool:
    return all(needle in src for needle in needles)


# common_chat_try_specialized_template, in its order: (name, test on the template source)
SPECIALIZED: tuple[tuple[str, Callable[[str], bool]], ...] = (
    (
        "Ministral/Magistral Large 3",
        lambda s: _has(s, "[SYSTEM_PROMPT]", "[TOOL_CALLS]", "[ARGS]") and "[CALL_ID]" not in s,
    ),
    ("LLM-jp Harmony v1", lambda s: "chat_format=llm-jp-harmony-v1" in s),
    ("GPT-OSS", lambda s: "<|channel|>" in s),
    ("Muse Glimmer", lambda s: _has(s, "<atem:function_calls>", "<|eom|>")),
    ("Functionary v3.2", lambda s: _has(s, ">>>all", ">>>${recipient}")),
    ("Kimi K2 Thinking", lambda s: _has(s, "<|tool_calls_section_begin|>", "<|tool_call_begin|>")),
    ("Kimi K3", lambda s: _has(s, "<|open|>", "<|close|>", "<|end_of_msg|>")),
    ("Ling 3.0 (Bailing V3)", lambda s: _has(s, "<role>ASSISTANT</role>", "<arg_key>")),
    ("Cohere2 MoE", lambda s: _has(s, "<|START_TEXT|>", "<|START_ACTION|>")),
    ("LFM2", lambda s: _has(s, "<|tool_list_start|>", "<|tool_list_end|>")),
    ("LFM2.5", lambda s: "List of tools: [" in s and "<|tool_list_start|>" not in s),
    (
        "GigaChatV3",
        lambda s: _has(s, "<|role_sep|>", "<|message_sep|>") and "<|function_call|>" not in s,
    ),
    ("MiniMax-M3", lambda s: _has(s, "]<]minimax[>[", "<tool_call>", "<invoke name=")),
    (
        "DeepSeek V3.2/V4",
        lambda s: _has(s, "dsml_token", "DSML") and ("function_calls" in s or "tool_calls" in s),
    ),
    ("Gemma4", lambda s: "'<|tool_call>call:'" in s),
    (
        "MiniCPM5",
        lambda s: _has(s, "Tool usage guidelines:", '<function name="', '<param name="'),
    ),
    (
        "Qwen3-Coder",
        lambda s: (
            _has(s, "<tool_call>", "<function=", "<parameter=")
            and "'<tool_call><function=' ~ tool_call.name ~ '>'" not in s
        ),
    ),
)


def specialized_template(source: str) -> str | None:
    """The name of llama.cpp's dedicated handler for this template, None for the autoparser."""
    for name, test in SPECIALIZED:
        if test(source):
            return name
    return None


def supports_thinking(template: ChatTemplate) -> bool:
    """Whether llama-server enables thinking on this template by default
    (common_chat_templates_support_enable_thinking): the supports_thinking of a one-message
    request, its dedicated handler's where it has one, else the analysis's reasoning."""
    name = specialized_template(template.source)
    if name in HANDLERS:
        probe = ChatRequest(
            [{"role": "user", "content": "test"}], reasoning_format=ReasoningFormat.DEEPSEEK
        )
        return chat_params(template, probe).supports_thinking
    return template.reasoning.supported


def _trim_all_content(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """StepFun: content, reasoning and text parts trimmed before rendering."""
    out = []
    for message in messages:
        m = copy.deepcopy(dict(message))
        if isinstance(m.get("content"), str):
            m["content"] = trim_whitespace(m["content"])
        elif isinstance(m.get("content"), list):
            for part in m["content"]:
                if isinstance(part, dict) and part.get("type") == "text":
                    part["text"] = trim_whitespace(part.get("text", ""))
        if isinstance(m.get("reasoning_content"), str):
            m["reasoning_content"] = trim_whitespace(m["reasoning_content"])
        out.append(m)
    return out


def chat_params(
    template: ChatTemplate, request: ChatRequest, tool_use_template: ChatTemplate | None = None
) -> ChatParams:
    """What llama-server renders, constrains and parses this request with, for templates the
    autoparser handles; SpecializedTemplateError for the others, TemplateError for requests
    llama-server refuses (grammar with tools, a template it cannot build a parser for)."""
    tools = normalize_tools(list(request.tools)) if request.tools else None
    tmpl = tool_use_template if tools and tool_use_template is not None else template
    src = tmpl.source
    messages: Sequence[Mapping[str, Any]] = request.messages
    if "You have access to the following functions in JSONSchema format" in src:
        messages = _trim_all_content(messages)
    # developer messages are system ones, except for GPT-OSS's template (it has both)
    parsed = normalize_messages(
        list(messages), tmpl.caps, developer_as_system="<|channel|>" not in src
    )
    params = GenerationParams(
        messages=parsed,
        tools=tools,
        tool_choice=request.tool_choice,
        json_schema=request.json_schema or None,
        parallel_tool_calls=request.parallel_tool_calls,
        reasoning_format=request.reasoning_format,
        grammar=request.grammar,
        add_generation_prompt=request.add_generation_prompt,
        continue_final_message=request.continue_final_message,
        enable_thinking=request.enable_thinking,
        extra_context=extra_context(request.chat_template_kwargs),
        add_bos=tmpl.add_bos,
        add_eos=tmpl.add_eos,
    )
    if params.continue_final_message is not Continuation.NONE:
        params = replace(params, add_generation_prompt=False)
        if parsed:
            last = messages[-1]  # as given: its content parts are joined when it is continued
            mode = params.continue_final_message
            if mode is Continuation.AUTO:
                reasoning_only = bool(last.get("reasoning_content")) and not last.get("content")
                mode = Continuation.REASONING if reasoning_only else Continuation.CONTENT
            params = replace(
                params, messages=parsed[:-1], continue_msg=last, continue_final_message=mode
            )
    if tools and params.tool_choice is not ToolChoice.NONE and params.grammar:
        raise TemplateError("Cannot specify grammar with tools")
    if request.force_pure_content:
        pure = replace(params, reasoning_format=ReasoningFormat.NONE)
        prompt = render_prompt(tmpl, pure, pure.add_generation_prompt)
        gen_prompt = generation_prompt(tmpl, params)
        parser = build_chat_peg_parser(lambda p: p.literal(gen_prompt) << p.content(p.rest()))
        return ChatParams(prompt=prompt, generation_prompt=gen_prompt, parser=parser)
    name = specialized_template(src)
    if name is not None:
        handler = HANDLERS.get(name)
        if handler is None:
            raise SpecializedTemplateError(name)
        return handler(tmpl, params)
    try:
        analysis = tmpl.analysis
        return generate_parser(tmpl, params, analysis)
    except AnalysisError as err:
        raise TemplateError(f"{CHAT_PARSER_FAILED}{err}") from err
