"""The chat templates llama-server reads with a handler of its own instead of the autoparser
(llama.cpp's common/parsers/): the prompt, generation prompt, PEG parser, grammar with its
triggers, preserved tokens and thinking tags of a request on one, as that handler makes them.

``HANDLERS`` maps the name :data:`.apply.SPECIALIZED` detects a template as to its handler,
``handler(tmpl, inputs) -> ChatParams`` (inputs as the generator takes them: messages already in
the template's form). The templates named there without a handler here are refused by the
caller (:class:`.apply.SpecializedTemplateError`).

As in :mod:`.generator`, parsers are allocated in llama-server's order (their ids name GBNF
rules): where C++ writes ``a + b`` this module writes ``p.cat(a, b)`` with the operands that
allocate passed as functions (GCC builds the right operand of ``+`` and ``|`` first).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from bankml.engine_cupy.autoparser.generator import (
    ChatParams,
    Continuation,
    GenerationParams,
    GrammarTrigger,
    ReasoningFormat,
    ToolChoice,
    TriggerType,
    _functions,
    _parameters,
    generation_prompt,
    render_prompt,
)
from bankml.engine_cupy.chat_template import render_content
from bankml.engine_cupy.json_schema_grammar import Alternatives, Array, Node, Object, parse_schema
from bankml.engine_cupy.peg.chat import (
    TOOL_ARG_ARRAY,
    TOOL_ARG_ITEM,
    TOOL_ARG_OBJECT,
    ChatFormat,
    ChatPegBuilder,
    build_chat_peg_parser,
    tool_parameters,
)
from bankml.engine_cupy.peg.gbnf import build_grammar
from bankml.engine_cupy.peg.parser import Arena, Parser
from bankml.engine_cupy.peg.schema import (
    TYPE_ARRAY,
    TYPE_BOOLEAN,
    TYPE_INTEGER,
    TYPE_NULL,
    TYPE_NUMBER,
    TYPE_OBJECT,
    TYPE_STRING,
    may_be_string,
    value_types,
)

if TYPE_CHECKING:
    from bankml.engine_cupy.chat_template import ChatTemplate

Handler = Callable[["ChatTemplate", GenerationParams], ChatParams]


def _has_continuation(inputs: GenerationParams) -> bool:
    """generation_params::has_continuation: a continued last message that is not empty."""
    msg = inputs.continue_msg
    return (
        inputs.continue_final_message is not Continuation.NONE
        and msg is not None
        and any(
            msg.get(key)
            for key in ("content", "reasoning_content", "tool_calls", "name", "tool_call_id")
        )
    )


def _calls_tools(inputs: GenerationParams) -> bool:
    return inputs.has_tools and inputs.tool_choice is not ToolChoice.NONE


def _grammar(parser: Arena, lazy: bool) -> str:
    return build_grammar(lambda builder: parser.build_grammar(builder, lazy))


# ---------------------------------------------------------------------------------------------
# GPT-OSS (common/parsers/gpt-oss.cpp)
# ---------------------------------------------------------------------------------------------

_GPT_OSS_TRIGGERS = (
    r"^\s+to$",
    r"^<\|channel\|>(?:commentary|analysis)\s+to=functions$",
    r"<\|start\|>assistant(\s+to)",
    r"<\|start\|>assistant(<\|channel\|>(?:commentary|analysis)\s+to)",
)


def gpt_oss(tmpl: ChatTemplate, inputs: GenerationParams) -> ChatParams:
    """Harmony channels: analysis (reasoning), commentary (preambles and tool calls, the
    recipient in the role or the channel header), final (content)."""
    adjusted = []
    for message in inputs.messages:
        m = copy.deepcopy(dict(message))
        if isinstance(m.get("reasoning_content"), str):
            m["thinking"] = m["reasoning_content"]
            if isinstance(m.get("tool_calls"), list) and m["tool_calls"]:
                m.pop("content", None)
        adjusted.append(m)
    over = replace(inputs, messages=adjusted)
    prompt = render_prompt(tmpl, over, over.add_generation_prompt)
    if not inputs.add_generation_prompt:  # an inference render ends its last turn with <|end|>
        at = prompt.rfind("<|return|>")
        if at >= 0:
            prompt = prompt[:at] + "<|end|>" + prompt[at + len("<|return|>") :]
    gen_prompt = generation_prompt(tmpl, over)
    if _has_continuation(inputs):
        msg = inputs.continue_msg or {}
        gen_prompt = "<|start|>assistant<|channel|>analysis<|message|>" + (
            msg.get("reasoning_content") or ""
        )
        if inputs.continue_final_message is Continuation.CONTENT:
            gen_prompt += "<|end|><|start|>assistant<|channel|>final<|message|>" + render_content(
                msg
            )
        prompt += gen_prompt
    has_tools = inputs.has_tools
    has_format = inputs.json_schema is not None and isinstance(inputs.json_schema, Mapping)
    include_grammar = has_format or _calls_tools(inputs)
    extract = inputs.reasoning_format is not ReasoningFormat.NONE

    def build(p: ChatPegBuilder) -> Parser:
        start = p.rule("start", p.literal("<|start|>assistant"))
        end = p.rule("end", p.literal("<|end|>"))
        content = p.rule("message-content", p.until("<|end|>"))
        channel = p.cat(
            lambda: p.literal("<|channel|>"),
            lambda: p.alt(lambda: p.literal("commentary"), lambda: p.literal("analysis")),
        )
        constrain_type = p.chars("[A-Za-z0-9_-]", 1, -1)
        stray = p.optional(
            p.cat(
                lambda: p.literal("<|channel|>commentary"),
                lambda: p.optional(p.literal(" to=assistant")),
            )
        )
        start_analysis = stray + p.literal("<|channel|>analysis<|message|>")
        if extract:
            p.rule("analysis", p.cat(start_analysis, lambda: p.reasoning(content), end))
        else:
            p.rule("analysis", p.content(start_analysis + content + end))
        analysis = p.ref("analysis")
        preamble = p.rule(
            "preamble",
            p.cat(
                lambda: p.literal("<|channel|>commentary<|message|>"),
                lambda: p.content(content),
                end,
            ),
        )
        final_msg = p.rule(
            "final",
            p.cat(
                stray,
                lambda: p.literal("<|channel|>final<|message|>"),
                lambda: p.content(content),
            ),
        )
        unsolicited = p.rule(
            "unsolicited",
            p.atomic(p.cat(lambda: p.optional(channel), lambda: p.literal(" to="), content, end)),
        )
        any_msg = p.rule("any", preamble | analysis)

        def constraint() -> Parser:
            return p.optional(
                p.cat(
                    p.space,
                    lambda: p.optional(p.literal("<|constrain|>")),
                    constrain_type,
                )
            )

        if has_format:
            made = constraint()
            response_format = p.rule(
                "response-format",
                p.cat(
                    lambda: p.literal("<|channel|>final"),
                    made,
                    lambda: p.literal("<|message|>"),
                    lambda: p.content(
                        p.schema(p.json(), "response-format-schema", inputs.json_schema)
                    ),
                ),
            )
            return p.cat(lambda: p.zero_or_more(start + analysis), start, response_format)
        if _calls_tools(inputs):
            tool_choice = p.choice()
            for function in _functions(inputs.tools):
                name = function["name"]
                params = tool_parameters(function)
                tool_name = p.tool_name(p.literal(name))
                func_name = p.literal(" to=functions.") + tool_name
                made = constraint()
                args = p.tool_args(p.schema(p.json(), f"tool-{name}-schema", params))
                in_role = p.tool(
                    p.tool_open(p.cat(func_name, channel, made, lambda: p.literal("<|message|>")))
                    + args
                )
                in_channel = p.tool(
                    p.tool_open(p.cat(channel, func_name, made, lambda: p.literal("<|message|>")))
                    + args
                )
                tool_choice |= p.rule(f"tool-{name}", in_role | in_channel)
            tool_call = p.trigger_rule("tool-call", tool_choice)
            if inputs.tool_choice is ToolChoice.REQUIRED:
                return p.cat(lambda: p.zero_or_more(start + any_msg), start, tool_call)
            return p.cat(
                lambda: p.zero_or_more(start + any_msg), start, lambda: tool_call | final_msg
            )
        return p.cat(
            lambda: p.zero_or_more(start + any_msg), start, lambda: final_msg | unsolicited
        )

    parser = build_chat_peg_parser(build)
    grammar, lazy, triggers = "", False, ()
    if include_grammar:
        lazy = not (has_format or (has_tools and inputs.tool_choice is ToolChoice.REQUIRED))
        grammar = _grammar(parser, lazy)
        triggers = tuple(GrammarTrigger(TriggerType.PATTERN, t) for t in _GPT_OSS_TRIGGERS)
    return ChatParams(
        prompt=prompt,
        generation_prompt=gen_prompt,
        parser=parser,
        grammar=grammar,
        grammar_lazy=lazy,
        grammar_triggers=triggers,
        preserved_tokens=("<|channel|>", "<|constrain|>", "<|message|>", "<|start|>", "<|end|>"),
        supports_thinking=True,
        thinking_start_tag="<|channel|>analysis<|message|>",
        thinking_end_tags=("<|end|>",),
        user_start="<|start|>user",
        assistant_start="<|start|>assistant",
    )


# ---------------------------------------------------------------------------------------------
# Qwen3-Coder XML tool calls (common/parsers/qwen3-coder.cpp), also Qwen3.5, Nemotron Nano 3
# and StepFun 3.5 Flash
# ---------------------------------------------------------------------------------------------


def _typed_value(p: ChatPegBuilder, types: frozenset[str]) -> Parser:
    """The JSON alternatives tried before a raw string, for an argument that may be either."""
    json_value = p.choice()
    if TYPE_OBJECT in types:
        json_value |= p.json_object()
    if TYPE_ARRAY in types:
        json_value |= p.json_array()
    if TYPE_NUMBER in types or TYPE_INTEGER in types:
        json_value |= p.json_number()
    if TYPE_BOOLEAN in types:
        json_value |= p.json_bool()
    if TYPE_NULL in types:
        json_value |= p.json_null()
    return json_value


def qwen3_coder(tmpl: ChatTemplate, inputs: GenerationParams) -> ChatParams:
    """``<tool_call>\\n<function=NAME>\\n<parameter=ARG>\\nVALUE\\n</parameter>\\n...``: string
    values raw, others JSON; reasoning in ``<think>`` where the template has it."""
    gen_prefix = "<|im_start|>assistant\n"
    prompt = render_prompt(tmpl, inputs, inputs.add_generation_prompt)
    gen_prompt = generation_prompt(tmpl, inputs)
    thinks = "<think>" in tmpl.source
    preserved: tuple[str, ...] = ("<tool_call>", "</tool_call>")
    start_tag, end_tags = "", ()
    if thinks:
        start_tag = "<think>"
        end_tags = ("\n</think>", "</think>", "<tool_call>")
        preserved += ("<think>", "</think>")
    has_tools = inputs.has_tools
    has_format = bool(inputs.json_schema) and isinstance(inputs.json_schema, Mapping)
    extract = inputs.reasoning_format is not ReasoningFormat.NONE
    include_grammar = has_format or _calls_tools(inputs)
    if _has_continuation(inputs):
        msg = inputs.continue_msg or {}
        gen_prompt = gen_prefix
        if thinks:
            gen_prompt += "<think>\n" + (msg.get("reasoning_content") or "")
            if inputs.continue_final_message is Continuation.CONTENT:
                gen_prompt += "\n</think>\n\n"
        if inputs.continue_final_message is Continuation.CONTENT:
            gen_prompt += render_content(msg)
        prompt += gen_prompt
    starts = ["<tool_call>"]
    if not thinks:  # Qwen3-Coder itself: a call may come without its <tool_call>
        starts += [f"<function={f['name']}>" for f in _functions(inputs.tools)]

    def build(p: ChatPegBuilder) -> Parser:
        generation = p.literal(gen_prefix)
        reasoning = p.eps()
        if thinks and extract:
            reasoning = p.optional(
                p.cat(
                    "<think>",
                    p.space,
                    lambda: p.reasoning(p.until_one_of(["</think>", "<tool_call>"])),
                    lambda: p.alt(
                        lambda: p.literal("</think>"),
                        lambda: p.peek(p.literal("<tool_call>")),
                    ),
                )
            )
        if has_format:
            return generation + (
                reasoning << p.content(p.schema(p.json(), "response-format", inputs.json_schema))
            )
        if _calls_tools(inputs):
            arg_close = p.tool_arg_close(p.literal("\n</parameter>\n"))
            arg_string = p.rule(
                "xml-arg-string",
                p.ac(
                    p.tool_arg_string_value(p.until("\n</parameter>\n")) + arg_close,
                    "\n</parameter>\n",
                ),
            )
            tool_choice = p.choice()
            for function in _functions(inputs.tools):
                name = function["name"]
                required: list[Parser] = []
                optional: list[Parser] = []
                for param in _parameters(function):
                    rule_name = f"tool-{name}-arg-{param.name}"
                    arg_name = p.tool_arg_name(p.literal(param.name))
                    arg_open = p.tool_arg_open("<parameter=" + arg_name + ">\n")
                    types = value_types(param.schema)
                    value = p.eps()
                    if TYPE_STRING not in types:
                        value = (
                            p.tool_arg_json_value(
                                p.schema(p.json(), f"{rule_name}-schema", param.schema)
                            )
                            + arg_close
                        )
                    elif types == {TYPE_STRING}:
                        value = arg_string
                    else:
                        json_value = _typed_value(p, types)
                        value = p.gbnf(
                            p.atomic(p.tool_arg_json_value(json_value) + arg_close) | arg_string,
                            "xml-arg-string",
                        )
                    arg_rule = p.rule(rule_name, p.tool_arg(arg_open + value))
                    (required if param.required else optional).append(arg_rule)
                args = p.permute(f"tool-{name}-args", required)
                if optional:
                    args = args + p.zero_or_more(p.choice(optional))
                close = p.tool_close(p.literal("</function>\n"))
                tool_args = p.tool_args(args)
                tool_name = p.tool_name(p.literal(name))
                func = p.tool(p.tool_open("<function=" + tool_name + ">\n") + tool_args + close)
                tool_choice |= p.rule(f"tool-{name}", func)
            min_calls = 1 if inputs.tool_choice is ToolChoice.REQUIRED else 0
            body = p.cat(tool_choice, "</tool_call>", p.space)
            tool_call = p.rule("tool-call", "<tool_call>\n" + body)
            first = tool_call
            if not thinks:
                first = p.rule("tool-call-first", p.optional(p.literal("<tool_call>\n")) + body)
            calls = first + p.zero_or_more(tool_call) if inputs.parallel_tool_calls else first
            tool_calls = p.trigger_rule("tool-call-root", p.repeat(calls, min_calls, 1))
            return generation + (reasoning << p.content(p.until_one_of(starts)) << tool_calls)
        return generation + (reasoning << p.content(p.rest()))

    parser = build_chat_peg_parser(build)
    grammar, lazy, triggers = "", False, ()
    if include_grammar:
        lazy = has_tools and inputs.tool_choice is ToolChoice.AUTO
        grammar = _grammar(parser, lazy)
        if lazy:
            triggers = tuple(GrammarTrigger(TriggerType.WORD, s) for s in starts)
    return ChatParams(
        prompt=prompt,
        generation_prompt=gen_prompt,
        parser=parser,
        grammar=grammar,
        grammar_lazy=lazy,
        grammar_triggers=triggers,
        preserved_tokens=preserved,
        supports_thinking=thinks,
        thinking_start_tag=start_tag,
        thinking_end_tags=end_tags,
        user_start="<|im_start|>user",
        assistant_start="<|im_start|>assistant",
    )


# ---------------------------------------------------------------------------------------------
# Kimi K2 (common/parsers/kimi-k2.cpp): calls ``functions.NAME:N`` (the call id) in a section
# ---------------------------------------------------------------------------------------------

_K2_SECTION_BEGIN = "<|tool_calls_section_begin|>"
_K2_SECTION_END = "<|tool_calls_section_end|>"
_K2_CALL_BEGIN = "<|tool_call_begin|>"
_K2_ARGS_BEGIN = "<|tool_call_argument_begin|>"
_K2_CALL_END = "<|tool_call_end|>"
_K2_GEN_PROMPT = "<|im_assistant|>assistant<|im_middle|>"


def _kimi_k2_call(p: ChatPegBuilder, name: str, schema: Any) -> Parser:
    tool_id = p.tool_id(
        p.cat(
            lambda: p.literal("functions."),
            lambda: p.tool_name(p.literal(name)),
            lambda: p.literal(":"),
            lambda: p.chars("[0-9]", 1, -1),
        )
    )
    return p.tool(
        p.cat(
            lambda: p.tool_open(tool_id + p.literal(_K2_ARGS_BEGIN)),
            lambda: p.tool_args(p.schema(p.json(), f"tool-{name}-schema", schema)),
            lambda: p.tool_close(p.optional(p.literal(_K2_CALL_END))),
        )
    )


def kimi_k2(tmpl: ChatTemplate, inputs: GenerationParams) -> ChatParams:
    """``<think>`` reasoning, content, then a section of calls whose id is
    ``functions.NAME:INDEX``."""
    prompt = render_prompt(tmpl, inputs, inputs.add_generation_prompt)
    gen_prompt = generation_prompt(tmpl, inputs)
    extract = inputs.reasoning_format is not ReasoningFormat.NONE
    if _has_continuation(inputs):
        msg = inputs.continue_msg or {}
        gen_prompt = _K2_GEN_PROMPT + "<think>" + (msg.get("reasoning_content") or "")
        if inputs.continue_final_message is Continuation.CONTENT:
            gen_prompt += "</think>" + render_content(msg)
        prompt += gen_prompt

    def build(p: ChatPegBuilder) -> Parser:
        end = p.end()
        if not extract:
            reasoning = p.eps()
        else:
            reasoning = p.optional(
                p.cat(
                    "<think>",
                    lambda: p.reasoning(
                        p.until_one_of(["</think>", _K2_SECTION_BEGIN, _K2_CALL_BEGIN])
                    ),
                    lambda: p.optional(p.literal("</think>")),
                )
            )
        generation = p.literal(_K2_GEN_PROMPT)
        if not _calls_tools(inputs):
            return p.cat(generation, reasoning, lambda: p.content(p.rest()), end)
        tool_choice = p.choice()
        for function in _functions(inputs.tools):
            name = function["name"]
            tool_choice |= p.rule(f"tool-{name}", _kimi_k2_call(p, name, tool_parameters(function)))
        min_calls = 1 if inputs.tool_choice is ToolChoice.REQUIRED else 0
        max_calls = -1 if inputs.parallel_tool_calls else 1
        tool_calls = p.rule(
            "tool-calls",
            p.cat(
                lambda: p.optional(p.literal(_K2_SECTION_BEGIN)),
                lambda: p.trigger_rule(
                    "tool-call",
                    p.cat(
                        lambda: p.repeat(_K2_CALL_BEGIN + tool_choice, min_calls, max_calls),
                        lambda: p.optional(p.literal(_K2_SECTION_END)),
                    ),
                ),
            ),
        )
        before = p.content(p.until_one_of([_K2_SECTION_BEGIN, _K2_CALL_BEGIN]))
        return generation + reasoning + before + tool_calls + end

    parser = build_chat_peg_parser(build)
    grammar, lazy, triggers = "", False, ()
    if _calls_tools(inputs):
        lazy = inputs.tool_choice is ToolChoice.AUTO
        grammar = _grammar(parser, lazy)
        triggers = (GrammarTrigger(TriggerType.WORD, _K2_CALL_BEGIN),)
    return ChatParams(
        prompt=prompt,
        generation_prompt=gen_prompt,
        parser=parser,
        grammar=grammar,
        grammar_lazy=lazy,
        grammar_triggers=triggers,
        preserved_tokens=(
            _K2_SECTION_BEGIN,
            _K2_SECTION_END,
            _K2_CALL_BEGIN,
            _K2_ARGS_BEGIN,
            _K2_CALL_END,
            "<think>",
            "</think>",
        ),
        supports_thinking=True,
        thinking_start_tag="<think>",
        thinking_end_tags=("</think>",),
    )


# ---------------------------------------------------------------------------------------------
# DeepSeek V3.2 and V4 (common/parsers/deepseek.cpp): DSML invoke/parameter markup
# ---------------------------------------------------------------------------------------------

_DSML = "\uff5cDSML\uff5c"
_DS_GEN_PROMPT = "<\uff5cAssistant\uff5c>"
_DS_PARAM_START = "<" + _DSML + "parameter"
_DS_PARAM_END = "</" + _DSML + "parameter>"
_DS_INVOKE_START = "<" + _DSML + "invoke"
_DS_INVOKE_END = "</" + _DSML + "invoke>"


def _deepseek_v4_sort_tool_results(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """V4 renders a run of tool results in the order of the calls they answer (by call id)."""
    adjusted = [dict(m) for m in messages]
    order: dict[str, int] = {}
    i = 0
    while i < len(adjusted):
        msg = adjusted[i]
        role = msg.get("role", "")
        calls = msg.get("tool_calls")
        if role == "assistant" and isinstance(calls, list) and calls:
            order = {}
            for idx, call in enumerate(calls):
                call_id = call.get("id", "") if isinstance(call, Mapping) else ""
                if call_id:
                    order[call_id] = idx
            i += 1
            continue
        if role not in ("user", "tool"):
            i += 1
            continue
        positions = []
        run_end = i
        while run_end < len(adjusted):
            r = adjusted[run_end].get("role", "")
            if r == "tool":
                positions.append(run_end)
            elif r != "user":
                break
            run_end += 1
        if len(positions) > 1 and order:
            results = sorted(
                (adjusted[k] for k in positions),
                key=lambda m: order.get(m.get("tool_call_id", ""), 0),
            )
            for k, result in zip(positions, results, strict=True):
                adjusted[k] = result
        i = run_end
    return adjusted


def _dsml_arg(p: ChatPegBuilder, name: str, param: Any) -> Parser:
    is_string = may_be_string(param.schema)
    flag = "true" if is_string else "false"

    def value() -> Parser:
        if is_string:
            return p.tool_arg_string_value(p.until(_DS_PARAM_END))
        return p.tool_arg_json_value(
            p.schema(p.json(), f"tool-{name}-arg-{param.name}-schema", param.schema)
        )

    arg = p.tool_arg(
        p.cat(
            lambda: p.tool_arg_open(
                p.cat(
                    lambda: p.literal(_DS_PARAM_START + ' name="'),
                    lambda: p.tool_arg_name(p.literal(param.name)),
                    lambda: p.literal(f'" string="{flag}">'),
                )
            ),
            value,
            lambda: p.tool_arg_close(p.literal(_DS_PARAM_END)),
        )
    )
    return p.rule(f"tool-{name}-arg-{param.name}", arg)


def _dsml_invoke(p: ChatPegBuilder, function: Mapping[str, Any]) -> Parser:
    name = function["name"]
    required: list[Parser] = []
    optional: list[Parser] = []
    for param in _parameters(function):
        (required if param.required else optional).append(_dsml_arg(p, name, param))
    args = p.eps()
    for i, named in enumerate(required):
        if i > 0:
            args = args + p.space()
        args = args + named
    if optional:
        any_optional = p.choice()
        for named in optional:
            any_optional |= named
        args = args + p.repeat(p.space() + any_optional, 0, -1)

    def opener() -> Parser:
        return p.tool_open(
            p.cat(
                lambda: p.literal(_DS_INVOKE_START + ' name="'),
                lambda: p.tool_name(p.literal(name)),
                lambda: p.literal('">\n'),
            )
        )

    return p.tool(
        p.cat(
            opener,
            args,
            p.space,
            lambda: p.tool_close(p.literal(_DS_INVOKE_END)),
        )
    )


def deepseek_v3_2(tmpl: ChatTemplate, inputs: GenerationParams) -> ChatParams:
    """``<think>`` reasoning, then DSML calls: ``<｜DSML｜function_calls>`` (V4: ``tool_calls``)
    around ``invoke`` elements whose ``parameter`` elements say whether they are strings."""
    is_v4 = "function_calls" not in tmpl.source
    over = inputs
    if is_v4:
        over = replace(over, messages=_deepseek_v4_sort_tool_results(inputs.messages))
    has_tools = inputs.has_tools
    has_format = inputs.json_schema is not None and isinstance(inputs.json_schema, Mapping)
    extract = inputs.reasoning_format is not ReasoningFormat.NONE
    include_grammar = has_format or _calls_tools(inputs)
    if is_v4 and has_format:
        over = replace(
            over, extra_context={**over.extra_context, "response_format": inputs.json_schema}
        )
    block = "tool_calls" if is_v4 else "function_calls"
    fc_start = "<" + _DSML + block + ">"
    fc_end = "</" + _DSML + block + ">"
    prompt = render_prompt(tmpl, over, over.add_generation_prompt)
    gen_prompt = generation_prompt(tmpl, over)
    if _has_continuation(inputs):
        msg = inputs.continue_msg or {}
        reasoning_text = msg.get("reasoning_content") or ""
        content = inputs.continue_final_message is Continuation.CONTENT
        if is_v4 and not reasoning_text:
            gen_prompt = _DS_GEN_PROMPT + "</think>" + (render_content(msg) if content else "")
        else:
            gen_prompt = _DS_GEN_PROMPT + "<think>" + reasoning_text
            if content:
                gen_prompt += "</think>" + render_content(msg)
        prompt += gen_prompt
    require = inputs.tool_choice is ToolChoice.REQUIRED
    calls_tools = _calls_tools(inputs)

    def build(p: ChatPegBuilder) -> Parser:
        generation = p.literal(_DS_GEN_PROMPT)
        end = p.end()
        tool_choice = p.choice()
        if calls_tools:
            for function in _functions(inputs.tools):
                tool_choice |= p.rule(f"tool-{function['name']}", _dsml_invoke(p, function))
        tool_calls = p.eps()
        if inputs.parallel_tool_calls:
            tool_calls = p.trigger_rule(
                "tool-call",
                p.cat(
                    lambda: p.literal(fc_start),
                    p.space,
                    tool_choice,
                    lambda: p.zero_or_more(p.space() + tool_choice),
                    p.space,
                    lambda: p.literal(fc_end),
                ),
            )
        else:
            tool_calls = p.trigger_rule(
                "tool-call",
                p.cat(
                    lambda: p.literal(fc_start),
                    p.space,
                    tool_choice,
                    p.space,
                    lambda: p.literal(fc_end),
                ),
            )
        reasoning = p.eps()
        reasoning_with_tc = p.eps()
        obligatory = tool_calls
        with_tc = False
        if not require:
            tool_calls = p.optional(tool_calls)
        if extract and inputs.enable_thinking:
            reasoning = p.optional(
                p.cat("<think>", lambda: p.reasoning(p.until("</think>")), "</think>")
            )
            reasoning_with_tc = p.cat(
                "<think>",
                lambda: p.reasoning(p.until_one_of(["\n\n" + fc_start, fc_start, "</think>"])),
                p.space,
                obligatory,
            )
            with_tc = True
        elif extract:
            if is_v4:
                reasoning = p.optional(p.literal("</think>"))
            else:
                reasoning = p.optional(
                    p.cat(
                        lambda: p.literal("<think>"),
                        lambda: p.until("</think>"),
                        lambda: p.literal("</think>"),
                    )
                )
        if has_format:
            response_format = p.rule(
                "response-format",
                p.cat(
                    lambda: p.literal("```json"),
                    p.space,
                    lambda: p.content(
                        p.schema(p.json(), "response-format-schema", inputs.json_schema)
                    ),
                    p.space,
                    lambda: p.literal("```"),
                ),
            )
            return generation + reasoning + response_format + end
        if not calls_tools:
            return p.cat(generation, reasoning, lambda: p.content(p.rest()), end)
        before = p.cat(
            lambda: p.negate(p.literal("<think>")),
            lambda: p.content(p.until_one_of(["\n\n" + fc_start, fc_start])),
            p.space,
        )
        if with_tc:
            return generation + (reasoning_with_tc | (reasoning + before + tool_calls)) + end
        return generation + reasoning + before + tool_calls + end

    parser = build_chat_peg_parser(build)
    grammar, lazy, triggers = "", False, ()
    if include_grammar:
        lazy = has_tools and not require
        grammar = _grammar(parser, lazy)
        triggers = (GrammarTrigger(TriggerType.WORD, fc_start),)
    return ChatParams(
        prompt=prompt,
        generation_prompt=gen_prompt,
        parser=parser,
        grammar=grammar,
        grammar_lazy=lazy,
        grammar_triggers=triggers,
        preserved_tokens=(_DSML, "<think>", "</think>"),
        supports_thinking=True,
        thinking_start_tag="<think>",
        thinking_end_tags=("</think>", fc_start),
        user_start="<\uff5cUser\uff5c>",
        assistant_start=_DS_GEN_PROMPT,
    )


# ---------------------------------------------------------------------------------------------
# LFM2 and LFM2.5 (common/parsers/lfm2.cpp): Python-style calls in <|tool_call_start|>
# ---------------------------------------------------------------------------------------------

_LFM2_CALL_START = "<|tool_call_start|>"
_LFM2_CALL_END = "<|tool_call_end|>"


def _lfm2(tool_list_tokens: bool) -> Handler:
    def handler(tmpl: ChatTemplate, inputs: GenerationParams) -> ChatParams:
        """``<think>`` reasoning where the template has it, then
        ``<|tool_call_start|>[name(arg=value, ...)]<|tool_call_end|>``."""
        adjusted = []
        for message in inputs.messages:
            m = copy.deepcopy(dict(message))
            if isinstance(m.get("reasoning_content"), str):
                m["thinking"] = m["reasoning_content"]
            adjusted.append(m)
        over = replace(inputs, messages=adjusted)
        prompt = render_prompt(tmpl, over, over.add_generation_prompt)
        gen_prompt = generation_prompt(tmpl, over)
        preserved: tuple[str, ...] = (_LFM2_CALL_START, _LFM2_CALL_END, "<think>", "</think>")
        if tool_list_tokens:
            preserved += ("<|tool_list_start|>", "<|tool_list_end|>")
        has_tools = inputs.has_tools
        has_format = inputs.json_schema is not None and isinstance(inputs.json_schema, Mapping)
        extract = inputs.reasoning_format is not ReasoningFormat.NONE and "<think>" in tmpl.source
        include_grammar = has_format or _calls_tools(inputs)
        if _has_continuation(inputs):
            msg = inputs.continue_msg or {}
            gen_prompt = "<|im_start|>assistant\n<think>" + (msg.get("reasoning_content") or "")
            if inputs.continue_final_message is Continuation.CONTENT:
                gen_prompt += "</think>" + render_content(msg)
            prompt += gen_prompt

        def build(p: ChatPegBuilder) -> Parser:
            generation = p.literal("<|im_start|>assistant\n")
            end = p.end()
            reasoning = p.eps()
            if extract:
                reasoning = p.optional(
                    p.cat("<think>", lambda: p.reasoning(p.until("</think>")), "</think>")
                )
            if not _calls_tools(inputs):
                if has_format:
                    response_format = p.content(
                        p.schema(p.json(), "response-format-schema", inputs.json_schema)
                    )
                    return generation + reasoning + response_format + end
                return p.cat(generation, reasoning, lambda: p.content(p.rest()), end)
            tool_calls = p.rule(
                "tool-calls",
                p.trigger_rule(
                    "tool-call",
                    p.cat(
                        lambda: p.literal(_LFM2_CALL_START),
                        lambda: p.python_style_tool_calls(
                            list(inputs.tools or ()), inputs.parallel_tool_calls, True
                        ),
                        lambda: p.literal(_LFM2_CALL_END),
                    ),
                ),
            )
            content = p.content(p.until(_LFM2_CALL_START))
            return generation + reasoning + content + tool_calls + end

        parser = build_chat_peg_parser(build)
        grammar, lazy, triggers = "", False, ()
        if include_grammar:
            lazy = not (has_format or (has_tools and inputs.tool_choice is ToolChoice.REQUIRED))
            grammar = _grammar(parser, lazy)
            triggers = (GrammarTrigger(TriggerType.WORD, _LFM2_CALL_START),)
        return ChatParams(
            prompt=prompt,
            generation_prompt=gen_prompt,
            parser=parser,
            grammar=grammar,
            grammar_lazy=lazy,
            grammar_triggers=triggers,
            preserved_tokens=preserved,
            supports_thinking=True,
            thinking_start_tag="<think>",
            thinking_end_tags=("</think>",),
        )

    return handler


# ---------------------------------------------------------------------------------------------
# GigaChat V3 (common/parsers/gigachat-v3.cpp): one JSON call after a "function call" turn
# ---------------------------------------------------------------------------------------------

_GIGACHAT_CALL_PREFIX = "<|message_sep|>\n\nfunction call<|role_sep|>\n"


def _gigachat_call(p: ChatPegBuilder, name: str, schema: Any) -> Parser:
    tool_name = p.json_member("name", p.cat('"', lambda: p.tool_name(p.literal(name)), '"'))
    tool_args = p.json_member(
        "arguments", p.tool_args(p.schema(p.json(), f"tool-{name}-schema", schema))
    )
    tool_open = p.tool_open(p.literal("{") << tool_name)
    return p.rule(f"tool-{name}", tool_open << "," << tool_args << "}")


def gigachat_v3(tmpl: ChatTemplate, inputs: GenerationParams) -> ChatParams:
    """Content, then at most one ``{"name": ..., "arguments": ...}`` call in a turn of its own."""
    prompt = render_prompt(tmpl, inputs, inputs.add_generation_prompt)
    gen_prompt = generation_prompt(tmpl, inputs)
    if _has_continuation(inputs):
        gen_prompt = "assistant<|role_sep|>\n" + render_content(inputs.continue_msg or {})
        prompt += gen_prompt
    include_grammar = _calls_tools(inputs)

    def build(p: ChatPegBuilder) -> Parser:
        ret = p.eps()
        if _calls_tools(inputs):
            tool_choice = p.choice()
            for tool in inputs.tools or ():
                function = tool["function"]
                tool_choice |= _gigachat_call(p, function["name"], tool_parameters(function))
            min_calls = 1 if inputs.tool_choice is ToolChoice.REQUIRED else 0
            tool_call = p.rule("tool-call", p.literal(_GIGACHAT_CALL_PREFIX) + tool_choice)
            tool_calls = p.trigger_rule("tool-call-root", p.repeat(tool_call, min_calls, 1))
            ret = p.content(p.until("<|message_sep|>\n\n")) << tool_calls
        else:
            ret = p.content(p.rest())
        return p.literal("assistant<|role_sep|>\n") + ret

    parser = build_chat_peg_parser(build)
    grammar, lazy, triggers = "", False, ()
    if include_grammar:
        lazy = inputs.tool_choice is ToolChoice.AUTO
        grammar = _grammar(parser, lazy)
        triggers = (GrammarTrigger(TriggerType.WORD, _GIGACHAT_CALL_PREFIX),)
    return ChatParams(
        prompt=prompt,
        generation_prompt=gen_prompt,
        parser=parser,
        grammar=grammar,
        grammar_lazy=lazy,
        grammar_triggers=triggers,
        preserved_tokens=("<|message_sep|>\n\n", "<|role_sep|>\n"),
    )


# ---------------------------------------------------------------------------------------------
# Functionary v3.2 (common/parsers/functionary-v3-2.cpp): ``>>>all`` content, ``>>>NAME`` calls
# ---------------------------------------------------------------------------------------------

_FUNCTIONARY_PROMPT = "<|start_header_id|>assistant<|end_header_id|>\n\n>>>"


def _functionary_call(p: ChatPegBuilder, name: str, schema: Any) -> Parser:
    return p.tool(
        p.cat(
            lambda: p.tool_open(
                p.cat(lambda: p.tool_name(p.literal(name)), lambda: p.literal("\n"))
            ),
            lambda: p.tool_args(p.schema(p.json(), f"tool-{name}-schema", schema)),
        )
    )


def functionary_v3_2(tmpl: ChatTemplate, inputs: GenerationParams) -> ChatParams:
    """After the ``>>>`` of the generation prompt, ``all\\n`` then content, or a function's name,
    a newline and its JSON arguments."""
    prompt = render_prompt(tmpl, inputs, inputs.add_generation_prompt)
    gen_prompt = generation_prompt(tmpl, inputs)
    if _has_continuation(inputs):
        gen_prompt = _FUNCTIONARY_PROMPT + "all\n" + render_content(inputs.continue_msg or {})
        prompt += gen_prompt

    def build(p: ChatPegBuilder) -> Parser:
        until_tool = p.cat(lambda: p.literal("all\n"), lambda: p.content(p.until(">>>")))
        until_end = p.cat(lambda: p.literal("all\n"), lambda: p.content(p.rest()))
        generation = p.literal(_FUNCTIONARY_PROMPT)
        if not _calls_tools(inputs):
            return p.cat(generation, until_end, p.end)
        tool_choice = p.choice()
        for function in _functions(inputs.tools):
            name = function["name"]
            tool_choice |= p.rule(
                f"tool-{name}", _functionary_call(p, name, tool_parameters(function))
            )
        tools_only = p.trigger_rule("tools", p.one_or_more(tool_choice))
        content_and_tools = until_tool + tools_only
        ret = p.eps()
        if inputs.tool_choice is ToolChoice.REQUIRED:
            if inputs.parallel_tool_calls:
                ret = p.cat(lambda: p.choice([content_and_tools, tools_only]), p.end)
            else:
                ret = p.cat(lambda: p.choice([until_tool + tool_choice, tools_only]), p.end)
        elif inputs.parallel_tool_calls:
            ret = p.cat(lambda: p.choice([content_and_tools, until_end, tools_only]), p.end)
        else:
            content_and_tool = until_tool + tool_choice
            ret = p.cat(lambda: p.choice([content_and_tool, until_end, tool_choice]), p.end)
        return generation + ret

    parser = build_chat_peg_parser(build)
    grammar, lazy, triggers = "", False, ()
    if _calls_tools(inputs):
        lazy = inputs.tool_choice is ToolChoice.AUTO
        grammar = _grammar(parser, lazy)
        triggers = (GrammarTrigger(TriggerType.PATTERN, ">>>(?!all)"),)
    return ChatParams(
        prompt=prompt,
        generation_prompt=gen_prompt,
        parser=parser,
        grammar=grammar,
        grammar_lazy=lazy,
        grammar_triggers=triggers,
        preserved_tokens=(">>>all",),
    )


# ---------------------------------------------------------------------------------------------
# Ministral 3 / Magistral / Devstral (common/parsers/ministral3.cpp): [THINK] and [TOOL_CALLS]
# ---------------------------------------------------------------------------------------------


def _ministral_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """System and assistant messages as content blocks: the reasoning a ``thinking`` block,
    then the text."""
    out = []
    for message in messages:
        if message.get("role", "") not in ("system", "assistant"):
            out.append(copy.deepcopy(dict(message)))
            continue
        blocks: list[Any] = []
        if isinstance(message.get("reasoning_content"), str):
            blocks.append({"type": "thinking", "thinking": message["reasoning_content"]})
        if "content" in message:
            content = message["content"]
            if isinstance(content, str):
                blocks.append({"type": "text", "text": content})
            elif isinstance(content, list):
                blocks.extend(copy.deepcopy(content))
        adjusted = copy.deepcopy(dict(message))
        adjusted["content"] = blocks
        adjusted.pop("reasoning_content", None)
        out.append(adjusted)
    return out


def _ministral_call(p: ChatPegBuilder, name: str, schema: Any) -> Parser:
    return p.rule(
        f"tool-{name}",
        p.cat(
            lambda: p.tool_open(p.tool_name(p.literal(name)) + "[ARGS]"),
            lambda: p.tool_args(p.schema(p.json(), f"tool-{name}-schema", schema)),
        ),
    )


def ministral_3(tmpl: ChatTemplate, inputs: GenerationParams) -> ChatParams:
    """``[THINK]`` reasoning ``[/THINK]``, content, then ``[TOOL_CALLS]NAME[ARGS]{...}`` calls."""
    over = replace(inputs, messages=_ministral_messages(inputs.messages))
    prompt = render_prompt(tmpl, over, over.add_generation_prompt)
    gen_prompt = generation_prompt(tmpl, over)
    has_tools = inputs.has_tools
    has_format = bool(inputs.json_schema) and isinstance(inputs.json_schema, Mapping)
    extract = inputs.reasoning_format is not ReasoningFormat.NONE
    if _has_continuation(inputs):
        msg = inputs.continue_msg or {}
        gen_prompt = "[THINK]" + (msg.get("reasoning_content") or "")
        if inputs.continue_final_message is Continuation.CONTENT:
            gen_prompt += "[/THINK]" + render_content(msg)
        prompt += gen_prompt
    include_grammar = has_format or _calls_tools(inputs)

    def build(p: ChatPegBuilder) -> Parser:
        generation = p.eps()
        if extract:
            reasoning = p.optional(
                p.cat("[THINK]", lambda: p.reasoning(p.until("[/THINK]")), "[/THINK]")
            )
        else:
            reasoning = p.eps()
        if has_format:
            schema = inputs.json_schema
            return generation + (
                reasoning
                << "```json"
                << p.content(p.schema(p.json(), "response-format", schema))
                << "```"
            )
        if _calls_tools(inputs):
            tool_choice = p.choice()
            for function in _functions(inputs.tools):
                tool_choice |= _ministral_call(p, function["name"], tool_parameters(function))
            min_calls = 1 if inputs.tool_choice is ToolChoice.REQUIRED else 0
            max_calls = -1 if inputs.parallel_tool_calls else 1
            tool_calls = p.trigger_rule(
                "tool-call", p.repeat("[TOOL_CALLS]" + tool_choice, min_calls, max_calls)
            )
            return generation + (reasoning << p.content(p.until("[TOOL_CALLS]")) << tool_calls)
        return generation + (reasoning << p.content(p.rest()))

    parser = build_chat_peg_parser(build)
    grammar, lazy, triggers = "", False, ()
    if include_grammar:
        lazy = has_tools and inputs.tool_choice is ToolChoice.AUTO
        grammar = _grammar(parser, lazy)
        triggers = (GrammarTrigger(TriggerType.WORD, "[TOOL_CALLS]"),)
    return ChatParams(
        prompt=prompt,
        generation_prompt=gen_prompt,
        parser=parser,
        grammar=grammar,
        grammar_lazy=lazy,
        grammar_triggers=triggers,
        preserved_tokens=("[THINK]", "[/THINK]", "[TOOL_CALLS]", "[ARGS]"),
        supports_thinking=True,
        thinking_start_tag="[THINK]",
        thinking_end_tags=("[/THINK]",),
    )


# ---------------------------------------------------------------------------------------------
# MiniCPM5 (common/parsers/minicpm5.cpp): <function name="..."><param name="...">
# ---------------------------------------------------------------------------------------------


def _minicpm5_string_value(p: ChatPegBuilder) -> Parser:
    """A string value: raw up to ``</param>``, or inside CDATA (its markers left out)."""
    cdata = p.cat(
        lambda: p.literal("<![CDATA["),
        lambda: p.ac(
            p.cat(lambda: p.tool_arg_string_value(p.until("]]>")), lambda: p.literal("]]>")),
            "]]>",
        ),
        lambda: p.tool_arg_close(p.literal("</param>")),
    )
    raw = p.cat(
        lambda: p.negate(p.literal("<![CDATA[")),
        lambda: p.ac(
            p.cat(
                lambda: p.tool_arg_string_value(p.until("</param>")),
                lambda: p.tool_arg_close(p.literal("</param>")),
            ),
            "</param>",
        ),
    )
    return p.choice([cdata, raw])


def _minicpm5_call(p: ChatPegBuilder, function: Mapping[str, Any], string_value: Parser) -> Parser:
    name = function["name"]
    arg_rules = []
    for param in _parameters(function):
        value = p.eps()
        if may_be_string(param.schema):
            value = string_value
        else:
            value = p.cat(
                lambda param=param: p.tool_arg_json_value(
                    p.schema(p.json(), f"tool-{name}-arg-{param.name}-schema", param.schema)
                ),
                lambda: p.tool_arg_close(p.literal("</param>")),
            )
        opener = p.tool_arg_open(
            p.cat(
                lambda: p.literal('<param name="'),
                lambda param=param: p.tool_arg_name(p.literal(param.name)),
                lambda: p.literal('">'),
            )
        )
        arg_rules.append(p.tool_arg(opener + value))
    args = p.eps()
    if arg_rules:
        args = p.zero_or_more(p.cat(lambda: p.choice(arg_rules), p.space))
    opener = p.tool_open(
        p.cat(
            lambda: p.literal('<function name="'),
            lambda: p.tool_name(p.literal(name)),
            lambda: p.literal('">'),
        )
    )
    return p.tool(opener << p.tool_args(args) << p.tool_close(p.literal("</function>")))


def minicpm5(tmpl: ChatTemplate, inputs: GenerationParams) -> ChatParams:
    """``<think>`` reasoning, content, then one or more
    ``<function name="F"><param name="A">value</param></function>`` calls."""
    prompt = render_prompt(tmpl, inputs, inputs.add_generation_prompt)
    gen_prompt = generation_prompt(tmpl, inputs)
    has_tools = inputs.has_tools
    has_format = bool(inputs.json_schema) and isinstance(inputs.json_schema, Mapping)
    extract = inputs.reasoning_format is not ReasoningFormat.NONE
    include_grammar = has_format or _calls_tools(inputs)
    if _has_continuation(inputs):
        msg = inputs.continue_msg or {}
        gen_prompt = "<|im_start|>assistant\n<think>\n" + (msg.get("reasoning_content") or "")
        if inputs.continue_final_message is Continuation.CONTENT:
            gen_prompt += "\n</think>\n\n" + render_content(msg)
        prompt += gen_prompt

    def build(p: ChatPegBuilder) -> Parser:
        generation = p.literal("<|im_start|>assistant\n")
        reasoning = p.eps()
        if extract:
            reasoning = p.cat(
                lambda: "<think>" << p.reasoning(p.until("</think>")) << "</think>", p.space
            )
        if has_format:
            schema = inputs.json_schema
            return p.cat(
                generation,
                reasoning,
                lambda: p.content(p.schema(p.json(), "response-format", schema)),
            )
        if _calls_tools(inputs):
            string_value = _minicpm5_string_value(p)
            tool_choice = p.choice()
            for function in _functions(inputs.tools):
                call = _minicpm5_call(p, function, string_value)
                tool_choice |= p.rule(f"tool-{function['name']}", call)
            max_calls = -1 if inputs.parallel_tool_calls else 1
            tool_calls = p.trigger_rule(
                "tool-call", p.repeat(tool_choice + p.space(), 1, max_calls)
            )
            content = p.content(p.until("<function"))
            return p.cat(generation, reasoning, content, tool_calls, p.end)
        return p.cat(generation, reasoning, lambda: p.content(p.rest()), p.end)

    parser = build_chat_peg_parser(build)
    grammar, lazy, triggers = "", False, ()
    if include_grammar:
        lazy = not (has_format or (has_tools and inputs.tool_choice is ToolChoice.REQUIRED))
        grammar = _grammar(parser, lazy)
        triggers = (GrammarTrigger(TriggerType.WORD, "<function"),)
    return ChatParams(
        prompt=prompt,
        generation_prompt=gen_prompt,
        parser=parser,
        grammar=grammar,
        grammar_lazy=lazy,
        grammar_triggers=triggers,
        preserved_tokens=("<function", "<param", "</function>", "</param>", "<think>", "</think>"),
        supports_thinking=True,
        thinking_start_tag="<think>",
        thinking_end_tags=("</think>",),
        user_start="<|im_start|>user",
        assistant_start="<|im_start|>assistant",
    )


# ---------------------------------------------------------------------------------------------
# Cohere2 MoE (common/parsers/cohere2moe.cpp): marker-wrapped thinking, text or a JSON action
# ---------------------------------------------------------------------------------------------

_C2_TURN_START = "<|START_OF_TURN_TOKEN|>"
_C2_TURN_END = "<|END_OF_TURN_TOKEN|>"
_C2_THINK_START = "<|START_THINKING|>"
_C2_THINK_END = "<|END_THINKING|>"
_C2_TEXT_START = "<|START_TEXT|>"
_C2_TEXT_END = "<|END_TEXT|>"
_C2_ACTION_START = "<|START_ACTION|>"
_C2_ACTION_END = "<|END_ACTION|>"
_C2_GEN_PREFIX = _C2_TURN_START + "<|CHATBOT_TOKEN|>"


def cohere2moe(tmpl: ChatTemplate, inputs: GenerationParams) -> ChatParams:
    """``<|START_THINKING|>`` reasoning, then either ``<|START_TEXT|>`` content or a
    ``<|START_ACTION|>[{"tool_call_id", "tool_name", "parameters"}, ...]`` action."""
    prompt = render_prompt(tmpl, inputs, inputs.add_generation_prompt)
    gen_prompt = generation_prompt(tmpl, inputs)
    has_format = bool(inputs.json_schema) and isinstance(inputs.json_schema, Mapping)
    extract = inputs.reasoning_format is not ReasoningFormat.NONE
    include_grammar = has_format or _calls_tools(inputs)
    if _has_continuation(inputs):
        msg = inputs.continue_msg or {}
        gen_prompt = _C2_GEN_PREFIX + _C2_THINK_START + (msg.get("reasoning_content") or "")
        if inputs.continue_final_message is Continuation.CONTENT:
            gen_prompt += _C2_THINK_END + _C2_TEXT_START + render_content(msg)
        prompt += gen_prompt
    ends = [_C2_THINK_END, _C2_TEXT_START, _C2_ACTION_START]

    def build(p: ChatPegBuilder) -> Parser:
        generation = p.literal(_C2_GEN_PREFIX)
        end = p.end()
        reasoning = p.eps()
        if extract:
            reasoning = p.optional(
                p.cat(
                    lambda: p.literal(_C2_THINK_START),
                    lambda: p.reasoning(p.until_one_of(ends)),
                    lambda: p.optional(p.literal(_C2_THINK_END)),
                )
            )
        else:
            reasoning = p.optional(
                p.content(
                    p.cat(
                        lambda: p.literal(_C2_THINK_START),
                        lambda: p.until_one_of(ends),
                        lambda: p.optional(p.literal(_C2_THINK_END)),
                    )
                )
            )
        if has_format:
            schema = inputs.json_schema
            text = p.cat(
                lambda: p.literal(_C2_TEXT_START),
                lambda: p.content(p.schema(p.json(), "response-format-schema", schema)),
                lambda: p.optional(p.literal(_C2_TEXT_END)),
            )
        else:
            text = p.cat(
                lambda: p.literal(_C2_TEXT_START),
                lambda: p.content(p.until(_C2_TEXT_END)),
                lambda: p.optional(p.literal(_C2_TEXT_END)),
            )
        turn_end = lambda: p.optional(p.literal(_C2_TURN_END))  # noqa: E731
        if not _calls_tools(inputs):
            return p.cat(generation, reasoning, text, turn_end, end)
        tool_calls = p.standard_json_tools(
            _C2_ACTION_START,
            _C2_ACTION_END,
            list(inputs.tools or ()),
            inputs.parallel_tool_calls,
            True,
            "tool_name",
            "parameters",
            True,
            False,
            "",
            "tool_call_id",
            ("tool_call_id", "tool_name", "parameters"),
        )
        required = inputs.tool_choice is ToolChoice.REQUIRED
        body = tool_calls if required else p.choice([tool_calls, text])
        return p.cat(generation, reasoning, body, turn_end, end)

    parser = build_chat_peg_parser(build)
    grammar, lazy, triggers = "", False, ()
    if include_grammar:
        lazy = not has_format and inputs.tool_choice is ToolChoice.AUTO
        grammar = _grammar(parser, lazy)
        triggers = (GrammarTrigger(TriggerType.WORD, _C2_ACTION_START),)
    return ChatParams(
        prompt=prompt,
        generation_prompt=gen_prompt,
        parser=parser,
        grammar=grammar,
        grammar_lazy=lazy,
        grammar_triggers=triggers,
        preserved_tokens=(
            _C2_TURN_START,
            _C2_TURN_END,
            "<|CHATBOT_TOKEN|>",
            "<|USER_TOKEN|>",
            "<|SYSTEM_TOKEN|>",
            _C2_THINK_START,
            _C2_THINK_END,
            _C2_TEXT_START,
            _C2_TEXT_END,
            _C2_ACTION_START,
            _C2_ACTION_END,
            "<|START_TOOL_RESULT|>",
            "<|END_TOOL_RESULT|>",
        ),
        supports_thinking=True,
        thinking_start_tag=_C2_THINK_START,
        thinking_end_tags=(_C2_THINK_END,),
        user_start=_C2_TURN_START + "<|USER_TOKEN|>",
        assistant_start=_C2_GEN_PREFIX,
    )


# ---------------------------------------------------------------------------------------------
# LLM-jp Harmony v1 (common/parsers/llm-jp-harmony.cpp): GPT-OSS's channels with a space after
# each special token, parallel calls as consecutive messages
# ---------------------------------------------------------------------------------------------

_LLM_JP_TRIGGERS = (
    r"^\s+to$",
    r"^<\|channel\|>\s*(?:commentary|analysis)\s+to=functions$",
    r"<\|start\|>\s*assistant(\s+to)",
    r"<\|start\|>\s*assistant(<\|channel\|>\s*(?:commentary|analysis)\s+to)",
)


def _harmony_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Reasoning as the template's ``thinking``; a call's content left out beside it."""
    adjusted = []
    for message in messages:
        m = copy.deepcopy(dict(message))
        if isinstance(m.get("reasoning_content"), str):
            m["thinking"] = m["reasoning_content"]
            if isinstance(m.get("tool_calls"), list) and m["tool_calls"]:
                m.pop("content", None)
        adjusted.append(m)
    return adjusted


def _harmony_prompts(tmpl: ChatTemplate, inputs: GenerationParams) -> tuple[str, str]:
    over = replace(inputs, messages=_harmony_messages(inputs.messages))
    prompt = render_prompt(tmpl, over, over.add_generation_prompt)
    if not inputs.add_generation_prompt:  # an inference render ends its last turn with <|end|>
        at = prompt.rfind("<|return|>")
        if at >= 0:
            prompt = prompt[:at] + "<|end|>" + prompt[at + len("<|return|>") :]
    gen_prompt = generation_prompt(tmpl, over)
    if _has_continuation(inputs):
        msg = inputs.continue_msg or {}
        gen_prompt = "<|start|>assistant<|channel|>analysis<|message|>" + (
            msg.get("reasoning_content") or ""
        )
        if inputs.continue_final_message is Continuation.CONTENT:
            gen_prompt += "<|end|><|start|>assistant<|channel|>final<|message|>" + render_content(
                msg
            )
        prompt += gen_prompt
    return prompt, gen_prompt


def _llm_jp_tool(
    p: ChatPegBuilder, name: str, params: Any, channel: Parser, constraint: Parser, message: Parser
) -> Parser:
    tool_name = p.tool_name(p.literal(name))
    func_name = p.literal(" to=functions.") + tool_name
    args = p.tool_args(p.schema(p.json(), f"tool-{name}-schema", params))
    in_role = p.tool(p.tool_open(func_name + channel + constraint + message) + args)
    in_channel = p.tool(p.tool_open(channel + func_name + constraint + message) + args)
    return p.rule(f"tool-{name}", in_role | in_channel)


def llm_jp_harmony(tmpl: ChatTemplate, inputs: GenerationParams) -> ChatParams:
    """GPT-OSS's channels as LLM-jp 4.1 writes them (blanks after the special tokens)."""
    prompt, gen_prompt = _harmony_prompts(tmpl, inputs)
    has_tools = inputs.has_tools
    has_format = inputs.json_schema is not None and isinstance(inputs.json_schema, Mapping)
    include_grammar = has_format or _calls_tools(inputs)
    extract = inputs.reasoning_format is not ReasoningFormat.NONE

    def build(p: ChatPegBuilder) -> Parser:
        sp = p.chars("[ ]", 0, -1)
        channel_tag = p.literal("<|channel|>") + sp
        message = p.cat(lambda: p.literal("<|message|>"), lambda: p.optional(p.literal(" ")))
        start = p.rule(
            "start",
            p.cat(lambda: p.literal("<|start|>"), sp, lambda: p.literal("assistant")),
        )
        end = p.rule("end", p.literal("<|end|>"))
        content = p.rule("message-content", p.until("<|end|>"))
        channel = p.cat(
            channel_tag,
            lambda: p.alt(lambda: p.literal("commentary"), lambda: p.literal("analysis")),
        )
        constrain_type = p.chars("[A-Za-z0-9_-]", 1, -1)
        constraint = p.optional(
            p.cat(
                p.space,
                lambda: p.optional(p.literal("<|constrain|>") + sp),
                constrain_type,
            )
        )
        start_analysis = p.cat(channel_tag, lambda: p.literal("analysis"), message)
        if extract:
            p.rule("analysis", p.cat(start_analysis, lambda: p.reasoning(content), end))
        else:
            p.rule("analysis", p.content(start_analysis + content + end))
        analysis = p.ref("analysis")
        preamble = p.rule(
            "preamble",
            p.cat(
                channel_tag,
                lambda: p.literal("commentary"),
                message,
                lambda: p.content(content),
                end,
            ),
        )
        final_msg = p.rule(
            "final",
            p.cat(channel_tag, lambda: p.literal("final"), message, lambda: p.content(content)),
        )
        any_msg = p.rule("any", preamble | analysis)
        if has_format:
            schema = inputs.json_schema
            response_format = p.rule(
                "response-format",
                p.cat(
                    channel_tag,
                    lambda: p.literal("final"),
                    constraint,
                    message,
                    lambda: p.content(p.schema(p.json(), "response-format-schema", schema)),
                ),
            )
            return p.cat(lambda: p.zero_or_more(start + analysis), start, response_format)
        if _calls_tools(inputs):
            tool_choice = p.choice()
            for function in _functions(inputs.tools):
                tool_choice |= _llm_jp_tool(
                    p, function["name"], tool_parameters(function), channel, constraint, message
                )
            calls = tool_choice
            if inputs.parallel_tool_calls:
                calls = tool_choice + p.zero_or_more(end + start + tool_choice)
            tool_call = p.trigger_rule("tool-call", calls)
            if inputs.tool_choice is ToolChoice.REQUIRED:
                return p.cat(lambda: p.zero_or_more(start + any_msg), start, tool_call)
            return p.cat(
                lambda: p.zero_or_more(start + any_msg), start, lambda: tool_call | final_msg
            )
        return p.cat(lambda: p.zero_or_more(start + any_msg), start, final_msg)

    parser = build_chat_peg_parser(build)
    grammar, lazy, triggers = "", False, ()
    if include_grammar:
        lazy = not (has_format or (has_tools and inputs.tool_choice is ToolChoice.REQUIRED))
        grammar = _grammar(parser, lazy)
        triggers = tuple(GrammarTrigger(TriggerType.PATTERN, t) for t in _LLM_JP_TRIGGERS)
    return ChatParams(
        prompt=prompt,
        generation_prompt=gen_prompt,
        parser=parser,
        grammar=grammar,
        grammar_lazy=lazy,
        grammar_triggers=triggers,
        preserved_tokens=("<|channel|>", "<|constrain|>", "<|message|>", "<|start|>", "<|end|>"),
        supports_thinking=True,
        thinking_start_tag="<|channel|>analysis<|message|>",
        thinking_end_tags=("<|end|>",),
        user_start="<|start|>user",
        assistant_start="<|start|>assistant",
    )


# ---------------------------------------------------------------------------------------------
# Muse Glimmer (common/parsers/muse-glimmer.cpp): " to=RECIPIENT" messages, ATEM call markup
# ---------------------------------------------------------------------------------------------

_MUSE_TRIGGER = (
    r"(?:^|<\|start\|>assistant)( to=(?!self<\|message\|>)(?!user<\|message\|>)[^<]*?<\|message\|>)"
)


def _muse_call(p: ChatPegBuilder, function: Mapping[str, Any], string_value: Parser) -> Parser:
    name = function["name"]
    arg_rules = []
    for param in _parameters(function):
        value = p.eps()
        if may_be_string(param.schema):
            value = string_value
        else:
            value = p.cat(
                lambda param=param: p.tool_arg_json_value(
                    p.schema(p.json(), f"tool-{name}-arg-{param.name}-schema", param.schema)
                ),
                lambda: p.tool_arg_close(p.literal("</atem:parameter>")),
            )
        opener = p.tool_arg_open(
            p.cat(
                lambda: p.literal('<atem:parameter name="'),
                lambda param=param: p.tool_arg_name(p.literal(param.name)),
                lambda: p.literal('">'),
            )
        )
        arg_rules.append(p.tool_arg(opener + value))
    args = p.eps()
    if arg_rules:
        args = p.zero_or_more(p.cat(lambda: p.choice(arg_rules), p.space))
    opener = p.tool_open(
        p.cat(
            lambda: p.literal(" to="),
            lambda: p.until("<|message|>"),
            lambda: p.literal("<|message|><atem:function_calls>"),
            p.space,
            lambda: p.literal('<atem:invoke name="'),
            lambda: p.tool_name(p.literal(name)),
            lambda: p.literal('">'),
            p.space,
        )
    )
    return p.tool(
        opener
        << p.tool_args(args)
        << p.tool_close(
            p.cat(
                lambda: p.literal("</atem:invoke>"),
                p.space,
                lambda: p.literal("</atem:function_calls>"),
            )
        )
    )


def muse_glimmer(tmpl: ChatTemplate, inputs: GenerationParams) -> ChatParams:
    """Messages ``<|start|>assistant to=RECIPIENT<|message|>...``: ``self`` reasoning ended by
    ``<|eom|>``, ``user`` content, any other recipient an ATEM function call."""
    prompt = render_prompt(tmpl, inputs, inputs.add_generation_prompt)
    gen_prompt = "<|start|>assistant"
    if _has_continuation(inputs):
        msg = inputs.continue_msg or {}
        gen_prompt = "<|start|>assistant to=self<|message|>" + (msg.get("reasoning_content") or "")
        if inputs.continue_final_message is Continuation.CONTENT:
            gen_prompt += "<|eom|><|start|>assistant to=user<|message|>" + render_content(msg)
        prompt += gen_prompt
    extract = inputs.reasoning_format is not ReasoningFormat.NONE
    has_tools = inputs.has_tools
    has_format = inputs.json_schema is not None and isinstance(inputs.json_schema, Mapping)
    include_grammar = has_format or _calls_tools(inputs)

    def build(p: ChatPegBuilder) -> Parser:
        start = p.rule("start", p.literal("<|start|>assistant"))
        if not extract and not include_grammar:
            return start + p.content(p.rest())
        tag = p.reasoning if extract else p.content
        p.rule(
            "analysis",
            p.cat(
                lambda: p.literal(" to=self<|message|>"),
                lambda: tag(p.until("<|eom|>")),
                lambda: p.literal("<|eom|>"),
            ),
        )
        analysis = p.ref("analysis")
        recipient = p.optional(p.literal(" to=user"))
        final_msg = p.rule(
            "final",
            p.cat(
                recipient,
                lambda: p.literal("<|message|>"),
                lambda: p.content(p.until_one_of(["<|eot|>", "<|eom|>"])),
            ),
        )
        if has_format:
            schema = inputs.json_schema
            response_json = p.content(p.schema(p.json(), "response-format-schema", schema))
            fenced = lambda: p.cat(  # noqa: E731
                lambda: p.literal("```json"),
                p.space,
                response_json,
                p.space,
                lambda: p.literal("```"),
            )
            response_format = p.rule(
                "response-format",
                p.cat(
                    recipient,
                    lambda: p.literal("<|message|>"),
                    lambda: p.alt(fenced, response_json),
                ),
            )
            return p.cat(lambda: p.zero_or_more(start + analysis), start, response_format)
        if _calls_tools(inputs):
            string_value = p.ac(
                p.cat(
                    lambda: p.tool_arg_string_value(p.until("</atem:parameter>")),
                    lambda: p.tool_arg_close(p.literal("</atem:parameter>")),
                ),
                "</atem:parameter>",
            )
            tool_choice = p.choice()
            for function in _functions(inputs.tools):
                call = _muse_call(p, function, string_value)
                tool_choice |= p.rule(f"tool-{function['name']}", call)
            if inputs.parallel_tool_calls:
                tool_calls = p.trigger_rule(
                    "tool-call",
                    tool_choice + p.zero_or_more(p.literal("<|eom|>") + start + tool_choice),
                )
            else:
                tool_calls = p.trigger_rule("tool-call", tool_choice)
            if inputs.tool_choice is ToolChoice.REQUIRED:
                return p.cat(lambda: p.zero_or_more(start + analysis), start, tool_calls)
            trailing = p.optional(p.literal("<|eom|>") + start + tool_calls)
            return p.cat(
                lambda: p.zero_or_more(start + analysis),
                start,
                lambda: tool_calls | (final_msg + trailing),
            )
        return p.cat(lambda: p.zero_or_more(start + analysis), start, final_msg)

    parser = build_chat_peg_parser(build)
    grammar, lazy, triggers = "", False, ()
    if include_grammar:
        lazy = not (has_format or (has_tools and inputs.tool_choice is ToolChoice.REQUIRED))
        grammar = _grammar(parser, lazy)
        triggers = (GrammarTrigger(TriggerType.PATTERN, _MUSE_TRIGGER),)
    return ChatParams(
        prompt=prompt,
        generation_prompt=gen_prompt,
        parser=parser,
        grammar=grammar,
        grammar_lazy=lazy,
        grammar_triggers=triggers,
        preserved_tokens=(
            "<|start|>",
            "<|message|>",
            "<|eom|>",
            "<|eot|>",
            "<atem:function_calls>",
            "<atem:invoke",
            "<atem:parameter",
            "</atem:parameter>",
            "</atem:invoke>",
            "</atem:function_calls>",
        ),
        supports_thinking=True,
        user_start="<|start|>user",
        assistant_start="<|start|>assistant",
    )


# ---------------------------------------------------------------------------------------------
# Kimi K3 (common/parsers/kimi-k3.cpp): <|open|>TAG attrs<|sep|> ... <|close|>TAG<|sep|> sections
# ---------------------------------------------------------------------------------------------

_K3_SEP = "<|sep|>"
_K3_MSG_START = '<|open|>message role="assistant"<|sep|>'
_K3_THINK_START = "<|open|>think<|sep|>"
_K3_THINK_END = "<|close|>think<|sep|>"
_K3_RESP_START = "<|open|>response<|sep|>"
_K3_RESP_END = "<|close|>response<|sep|>"
_K3_TOOLS_START = "<|open|>tools<|sep|>"
_K3_TOOLS_END = "<|close|>tools<|sep|>"
_K3_CALL_START = '<|open|>call tool="'
_K3_CALL_END = "<|close|>call<|sep|>"
_K3_ARG_START = '<|open|>argument key="'
_K3_ARG_END = "<|close|>argument<|sep|>"
_K3_MSG_END = "<|close|>message<|sep|>"
_K3_EOM = "<|end_of_msg|>"


def _kimi_k3_arg(p: ChatPegBuilder, name: str, key: str, prop: Any) -> Parser:
    kind = "string"
    if isinstance(prop, Mapping) and isinstance(prop.get("type"), str):
        kind = prop["type"]
    if kind == "string":
        value = p.tool_arg_string_value(p.until(_K3_ARG_END))
    else:
        value = p.tool_arg_value(p.until(_K3_ARG_END))
    return p.rule(
        f"kimi-k3-arg-{name}-{key}",
        p.tool_arg(
            p.cat(
                lambda: p.tool_arg_open(p.literal(_K3_ARG_START)),
                lambda: p.tool_arg_name(p.literal(key)),
                lambda: p.literal('"'),
                lambda: p.until(_K3_SEP),
                lambda: p.literal(_K3_SEP),
                value,
                lambda: p.tool_arg_close(p.literal(_K3_ARG_END)),
            )
        ),
    )


def _kimi_k3_call(p: ChatPegBuilder, function: Mapping[str, Any]) -> Parser:
    name = function["name"]
    schema = tool_parameters(function)
    args = p.eps()
    props = schema.get("properties") if isinstance(schema, Mapping) else None
    if props:
        arg_choices = p.choice()
        for key, prop in props.items():
            arg_choices |= _kimi_k3_arg(p, name, key, prop)
        args = p.zero_or_more(arg_choices)
    opener = lambda: p.tool_open(  # noqa: E731
        p.cat(
            lambda: p.literal(_K3_CALL_START),
            lambda: p.tool_name(p.literal(name)),
            lambda: p.literal('"'),
            lambda: p.until(_K3_SEP),
            lambda: p.literal(_K3_SEP),
        )
    )
    call = p.tool(
        p.cat(
            opener,
            lambda: p.tool_args(args),
            lambda: p.tool_close(p.literal(_K3_CALL_END)),
        )
    )
    return p.rule(f"kimi-k3-tool-{name}", call)


def kimi_k3(tmpl: ChatTemplate, inputs: GenerationParams) -> ChatParams:
    """A think section, a response section, a tools section of calls with one tag per argument,
    then the message's closer."""
    prompt = render_prompt(tmpl, inputs, inputs.add_generation_prompt)
    gen_prompt = generation_prompt(tmpl, inputs)
    extract = inputs.reasoning_format is not ReasoningFormat.NONE
    if _has_continuation(inputs):
        msg = inputs.continue_msg or {}
        gen_prompt = _K3_MSG_START + _K3_THINK_START + (msg.get("reasoning_content") or "")
        if inputs.continue_final_message is Continuation.CONTENT:
            gen_prompt += _K3_THINK_END + _K3_RESP_START + render_content(msg)
        prompt += gen_prompt

    def build(p: ChatPegBuilder) -> Parser:
        end = p.end()
        start = p.optional(p.literal(_K3_MSG_START))
        tag = p.reasoning if extract else p.content
        think_body = tag(p.until_one_of([_K3_THINK_END, _K3_RESP_START]))
        reasoning = p.optional(
            p.cat(
                lambda: p.optional(p.literal(_K3_THINK_START)),
                think_body,
                lambda: p.optional(p.literal(_K3_THINK_END)),
            )
        )
        response = p.cat(
            lambda: p.optional(p.literal(_K3_RESP_START)),
            lambda: p.content(p.until_one_of([_K3_RESP_END, _K3_TOOLS_START, _K3_MSG_END])),
            lambda: p.optional(p.literal(_K3_RESP_END)),
        )
        trailer = p.cat(
            lambda: p.optional(p.literal(_K3_MSG_END)), lambda: p.optional(p.literal(_K3_EOM))
        )
        if not _calls_tools(inputs):
            return start + reasoning + response + trailer + end
        tool_choices = p.choice()
        for function in _functions(inputs.tools):
            tool_choices |= _kimi_k3_call(p, function)
        section = p.trigger_rule(
            "kimi-k3-tool-call",
            p.cat(
                lambda: p.literal(_K3_TOOLS_START),
                lambda: p.one_or_more(tool_choices),
                lambda: p.literal(_K3_TOOLS_END),
                lambda: p.optional(p.literal(_K3_MSG_END)),
                lambda: p.optional(p.literal(_K3_EOM)),
            ),
        )
        tools = section if inputs.tool_choice is ToolChoice.REQUIRED else p.optional(section)
        return start + reasoning + response + tools + trailer + end

    parser = build_chat_peg_parser(build)
    grammar, lazy, triggers = "", False, ()
    if _calls_tools(inputs):
        lazy = inputs.tool_choice is not ToolChoice.REQUIRED
        grammar = _grammar(parser, lazy)
        triggers = (GrammarTrigger(TriggerType.WORD, _K3_TOOLS_START),)
    return ChatParams(
        prompt=prompt,
        generation_prompt=gen_prompt,
        parser=parser,
        grammar=grammar,
        grammar_lazy=lazy,
        grammar_triggers=triggers,
        preserved_tokens=("<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"),
        supports_thinking=True,
        thinking_start_tag=_K3_THINK_START,
        thinking_end_tags=(_K3_THINK_END,),
        user_start='<|open|>message role="user"<|sep|>',
        assistant_start=_K3_MSG_START,
    )


# ---------------------------------------------------------------------------------------------
# Ling 3.0 / Bailing V3 (common/parsers/ling3.cpp): <role> sections, <arg_key>/<arg_value> calls
# ---------------------------------------------------------------------------------------------

_LING3_ROLE = "<role>ASSISTANT</role>"
_LING3_ROLE_END = "<|role_end|>"


def _ling3_arg(
    p: ChatPegBuilder, name: str, param: Any, arg_close: Parser, arg_string: Parser
) -> Parser:
    rule_name = f"ling3-arg-{name}-{param.name}"
    types = value_types(param.schema)
    value = p.eps()
    if TYPE_STRING not in types:
        value = p.cat(
            lambda: p.tool_arg_json_value(p.schema(p.json(), f"{rule_name}-schema", param.schema)),
            arg_close,
        )
    elif types == {TYPE_STRING}:
        value = arg_string
    else:
        typed = p.tool_arg_json_value(p.schema(p.json(), f"{rule_name}-schema", param.schema))
        value = p.gbnf(p.atomic(typed + arg_close) | arg_string, "ling3-arg-string")
    arg = p.tool_arg(
        p.cat(
            lambda: p.tool_arg_open(
                p.cat(
                    lambda: p.literal("<arg_key>"),
                    lambda: p.tool_arg_name(p.literal(param.name)),
                    lambda: p.literal("</arg_key>"),
                )
            ),
            lambda: p.optional(p.space()),
            lambda: p.literal("<arg_value>"),
            value,
        )
    )
    return p.rule(rule_name, p.optional(p.space()) + arg)


def _ling3_call(
    p: ChatPegBuilder, function: Mapping[str, Any], arg_close: Parser, arg_string: Parser
) -> Parser:
    name = function["name"]
    required: list[Parser] = []
    optional: list[Parser] = []
    for param in _parameters(function):
        arg = _ling3_arg(p, name, param, arg_close, arg_string)
        (required if param.required else optional).append(arg)
    args = p.permute(f"ling3-{name}-args", required)
    if optional:
        args = args + p.zero_or_more(p.choice(optional))
    close = p.tool_close(p.cat(lambda: p.optional(p.space()), lambda: p.literal("</tool_call>")))
    tool_args = p.tool_args(args)
    opener = p.tool_open(
        p.cat(
            lambda: p.literal("<tool_call>"),
            lambda: p.tool_name(p.literal(name)),
            lambda: p.optional(p.space()),
        )
    )
    return p.rule(f"ling3-tool-{name}", p.tool(opener + tool_args + close))


def ling3(tmpl: ChatTemplate, inputs: GenerationParams) -> ChatParams:
    """``<think>`` reasoning (opened by the generation prompt), content, then
    ``<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value></tool_call>`` calls."""
    prompt = render_prompt(tmpl, inputs, inputs.add_generation_prompt)
    gen_prompt = generation_prompt(tmpl, inputs)
    if _has_continuation(inputs):
        msg = inputs.continue_msg or {}
        gen_prompt = _LING3_ROLE + "\n<think>" + (msg.get("reasoning_content") or "")
        if inputs.continue_final_message is Continuation.CONTENT:
            gen_prompt += "</think>" + render_content(msg)
        prompt += gen_prompt
        think_open = inputs.continue_final_message is not Continuation.CONTENT
    else:
        last_open, last_close = gen_prompt.rfind("<think>"), gen_prompt.rfind("</think>")
        think_open = last_open >= 0 and (last_close < 0 or last_open > last_close)
    has_format = bool(inputs.json_schema) and isinstance(inputs.json_schema, Mapping)
    extract = inputs.reasoning_format is not ReasoningFormat.NONE
    include_grammar = has_format or _calls_tools(inputs)

    def build(p: ChatPegBuilder) -> Parser:
        end = p.end()
        opener = p.optional(p.cat(lambda: p.literal(_LING3_ROLE), lambda: p.optional(p.space())))
        ends = ["</think>", "<tool_call>"] if think_open else ["</think>"]
        body_end = p.until_one_of(ends)
        think_body = p.reasoning(body_end) if extract else p.content(body_end)
        reasoning = p.optional(
            p.cat(
                lambda: p.optional(p.literal("<think>")),
                think_body,
                lambda: p.optional(p.literal("</think>")),
            )
        )
        content = p.optional(p.content(p.until_one_of(["<tool_call>"])))
        tail = p.cat(
            lambda: p.optional(p.content(p.until(_LING3_ROLE_END))),
            lambda: p.optional(p.literal(_LING3_ROLE_END)),
        )
        if has_format:
            closed = p.cat(lambda: p.literal("<think>"), think_body, lambda: p.literal("</think>"))
            schema = inputs.json_schema
            response_format = p.content(p.schema(p.json(), "response-format", schema))
            return opener + (closed << response_format) + end
        if not _calls_tools(inputs):
            return opener + reasoning + tail + end
        tool_choices = p.choice()
        arg_close = p.tool_arg_close(p.literal("</arg_value>"))
        arg_string = p.rule(
            "ling3-arg-string", p.tool_arg_string_value(p.until("</arg_value>")) + arg_close
        )
        for function in _functions(inputs.tools):
            tool_choices |= _ling3_call(p, function, arg_close, arg_string)
        calls = tool_choices
        if inputs.parallel_tool_calls:
            calls = tool_choices + p.zero_or_more(p.space() + tool_choices)
        section = p.trigger_rule(
            "ling3-tool-call",
            p.cat(
                calls,
                p.space,
                lambda: p.optional(p.content(p.until(_LING3_ROLE_END))),
                lambda: p.optional(p.literal(_LING3_ROLE_END)),
            ),
        )
        tools = section if inputs.tool_choice is ToolChoice.REQUIRED else p.optional(section)
        return opener + reasoning + content + tools + tail + end

    parser = build_chat_peg_parser(build)
    grammar, lazy, triggers = "", False, ()
    if include_grammar:
        lazy = not has_format and inputs.tool_choice is not ToolChoice.REQUIRED
        grammar = _grammar(parser, lazy)
        triggers = (GrammarTrigger(TriggerType.WORD, "<tool_call>"),)
    return ChatParams(
        prompt=prompt,
        generation_prompt=gen_prompt,
        parser=parser,
        grammar=grammar,
        grammar_lazy=lazy,
        grammar_triggers=triggers,
        preserved_tokens=(
            "<think>",
            "</think>",
            "<tool_call>",
            "</tool_call>",
            "<arg_key>",
            "</arg_key>",
            "<arg_value>",
            "</arg_value>",
            _LING3_ROLE_END,
        ),
        additional_stops=(_LING3_ROLE_END,),
        supports_thinking=True,
        thinking_start_tag="<think>",
        thinking_end_tags=("</think>", "<tool_call>"),
        user_start="<role>HUMAN</role>",
        assistant_start=_LING3_ROLE,
    )


# ---------------------------------------------------------------------------------------------
# MiniMax-M3 (common/parsers/minimax-m3.cpp): namespaced XML calls, arguments as nested elements
# ---------------------------------------------------------------------------------------------

_MM3_NS = "]<]minimax[>["
_MM3_FC_START = _MM3_NS + "<tool_call>"
_MM3_FC_END = _MM3_NS + "</tool_call>"


class _Mm3Args:
    """The argument elements of one function, its schema expanded as the template writes it."""

    def __init__(self, p: ChatPegBuilder):
        self.p = p

    def element(self, tag: str, schema: Node, rule_name: str) -> Parser:
        p = self.p
        close = _MM3_NS + "</" + tag + ">"
        return p.rule(
            rule_name,
            p.tool_arg(
                p.cat(
                    lambda: p.tool_arg_open(
                        p.cat(
                            lambda: p.literal(_MM3_NS + "<"),
                            lambda: p.tool_arg_name(p.literal(tag)),
                            lambda: p.literal(">"),
                        )
                    ),
                    lambda: self.value(schema, rule_name, close),
                )
            ),
        )

    def value(self, schema: Node, rule_name: str, close: str) -> Parser:
        p = self.p
        close_tag = p.tool_arg_close(p.literal(close))
        if may_be_string(schema):
            return p.ac(p.tool_arg_string_value(p.until(close)) + close_tag, close)
        if isinstance(schema, Alternatives) and schema.kind == "any_of":
            return p.choice(
                [
                    self.value(alt, f"{rule_name}-{i}", close)
                    for i, alt in enumerate(schema.children)
                ]
            )
        if isinstance(schema, Object) and schema.properties:
            return p.cat(
                lambda: p.tag(TOOL_ARG_OBJECT, self.members(schema, rule_name)), p.space, close_tag
            )
        if isinstance(schema, Array) and schema.kind == "array":
            item_close = _MM3_NS + "</item>"
            item = p.rule(
                f"{rule_name}-item",
                p.tag(
                    TOOL_ARG_ITEM,
                    p.cat(
                        lambda: p.literal(_MM3_NS + "<item>"),
                        lambda: self.value(schema.items, f"{rule_name}-item", item_close),
                    ),
                ),
            )
            return p.cat(
                lambda: p.tag(TOOL_ARG_ARRAY, p.repeat(p.space() + item, 0, -1)),
                p.space,
                close_tag,
            )
        return p.tool_arg_json_value(p.schema(p.json(), f"{rule_name}-schema", schema)) + close_tag

    def members(self, obj: Object, prefix: str) -> Parser:
        """Required properties in schema order, then optional ones in any order and number."""
        p = self.p
        required: list[Parser] = []
        optional: list[Parser] = []
        for prop in obj.properties:
            element = self.element(prop.name, prop.schema, f"{prefix}-{prop.name}")
            (required if prop.required else optional).append(element)
        members = p.eps()
        for i, element in enumerate(required):
            if i > 0:
                members = members + p.space()
            members = members + element
        if optional:
            any_optional = p.choice()
            for element in optional:
                any_optional |= element
            members = members + p.repeat(p.space() + any_optional, 0, -1)
        return members


def _mm3_invoke(p: ChatPegBuilder, function: Mapping[str, Any]) -> Parser:
    name = function["name"]
    root = parse_schema(tool_parameters(function))
    body = p.eps()
    if isinstance(root, Object):
        body = _Mm3Args(p).members(root, f"tool-{name}-arg")
    return p.tool(
        p.cat(
            lambda: p.tool_open(
                p.cat(
                    lambda: p.literal(_MM3_NS + '<invoke name="'),
                    lambda: p.tool_name(p.literal(name)),
                    lambda: p.literal('">'),
                )
            ),
            p.space,
            body,
            p.space,
            lambda: p.tool_close(p.literal(_MM3_NS + "</invoke>")),
        )
    )


def minimax_m3(tmpl: ChatTemplate, inputs: GenerationParams) -> ChatParams:
    """``<mm:think>`` reasoning, content, then ``]<]minimax[>[<tool_call>`` around invokes
    whose arguments are elements named after them (objects and arrays nested)."""
    prompt = render_prompt(tmpl, inputs, inputs.add_generation_prompt)
    template_gen_prompt = gen_prompt = generation_prompt(tmpl, inputs)
    has_tools = inputs.has_tools
    has_format = inputs.json_schema is not None and isinstance(inputs.json_schema, Mapping)
    extract = inputs.reasoning_format is not ReasoningFormat.NONE
    include_grammar = has_format or _calls_tools(inputs)
    if _has_continuation(inputs):
        msg = inputs.continue_msg or {}
        gen_prompt = template_gen_prompt + "<mm:think>" + (msg.get("reasoning_content") or "")
        if inputs.continue_final_message is Continuation.CONTENT:
            gen_prompt += "</mm:think>" + render_content(msg)
        prompt += gen_prompt
    think_end = "</mm:think>"

    def build(p: ChatPegBuilder) -> Parser:
        generation = p.prefix(template_gen_prompt, "<mm:think>")
        end = p.end()
        reasoning = p.eps()
        if extract:
            if inputs.enable_thinking:
                block = p.cat(
                    lambda: p.literal("<mm:think>"),
                    p.space,
                    lambda: p.ac(
                        p.cat(
                            lambda: p.reasoning(p.until(think_end)), lambda: p.literal(think_end)
                        ),
                        think_end,
                    ),
                )
            else:
                block = p.cat(
                    lambda: p.literal("<mm:think>"),
                    lambda: p.ac(
                        p.cat(lambda: p.until(think_end), lambda: p.literal(think_end)), think_end
                    ),
                )
            reasoning = p.optional(p.choice([block, p.literal(think_end)]))
        if has_format:
            schema = inputs.json_schema
            response_format = p.rule(
                "response-format",
                p.cat(
                    lambda: p.literal("```json"),
                    p.space,
                    lambda: p.content(p.schema(p.json(), "response-format-schema", schema)),
                    p.space,
                    lambda: p.literal("```"),
                ),
            )
            return generation + reasoning + response_format + end
        if not _calls_tools(inputs):
            return p.cat(generation, reasoning, lambda: p.content(p.rest()), end)
        tool_choice = p.choice()
        for function in _functions(inputs.tools):
            tool_choice |= p.rule(f"tool-{function['name']}", _mm3_invoke(p, function))
        tool_calls = p.eps()
        if inputs.parallel_tool_calls:
            tool_calls = p.trigger_rule(
                "tool-call",
                p.cat(
                    lambda: p.literal(_MM3_FC_START),
                    p.space,
                    tool_choice,
                    lambda: p.zero_or_more(p.space() + tool_choice),
                    p.space,
                    lambda: p.literal(_MM3_FC_END),
                ),
            )
        else:
            tool_calls = p.trigger_rule(
                "tool-call",
                p.cat(
                    lambda: p.literal(_MM3_FC_START),
                    p.space,
                    tool_choice,
                    p.space,
                    lambda: p.literal(_MM3_FC_END),
                ),
            )
        if inputs.tool_choice is not ToolChoice.REQUIRED:
            tool_calls = p.optional(tool_calls)
        before = p.content(p.until(_MM3_FC_START))
        return generation + reasoning + before + tool_calls + end

    parser = build_chat_peg_parser(build)
    grammar, lazy, triggers = "", False, ()
    if include_grammar:
        lazy = not (has_format or (has_tools and inputs.tool_choice is ToolChoice.REQUIRED))
        grammar = _grammar(parser, lazy)
        triggers = (GrammarTrigger(TriggerType.WORD, _MM3_FC_START),)
    return ChatParams(
        prompt=prompt,
        generation_prompt=gen_prompt,
        parser=parser,
        format=ChatFormat.PEG_MINIMAX_M3.value,
        grammar=grammar,
        grammar_lazy=lazy,
        grammar_triggers=triggers,
        preserved_tokens=(_MM3_NS, "<tool_call>", "</tool_call>", "<mm:think>", "</mm:think>"),
        supports_thinking=True,
        thinking_start_tag="<mm:think>",
        thinking_end_tags=("</mm:think>",),
        user_start="]~b]user",
        assistant_start="]~b]ai",
    )


# ---------------------------------------------------------------------------------------------
# Gemma 4 (common/parsers/gemma4.cpp): <|channel>thought reasoning, <|tool_call>call:NAME{...}
# ---------------------------------------------------------------------------------------------


def _gemma4_has_content(msg: Mapping[str, Any]) -> bool:
    content = msg.get("content")
    return (isinstance(content, str) and content != "") or (
        isinstance(content, list) and bool(content)
    )


def _gemma4_has_calls(msg: Mapping[str, Any]) -> bool:
    calls = msg.get("tool_calls")
    return isinstance(calls, list) and bool(calls)


def convert_tool_responses_gemma4(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The older Gemma 4 templates read tool results from the calling assistant message: an
    assistant turn with calls, the tool messages after it and a final assistant answer become
    one assistant message with ``tool_calls``, ``tool_responses`` (name, response parsed as JSON
    where it is JSON) and the answer's ``content``."""
    result: list[dict[str, Any]] = []
    i = 0
    while i < len(messages):
        msg = messages[i]
        if msg.get("role", "") != "assistant" or not _gemma4_has_calls(msg):
            result.append(copy.deepcopy(dict(msg)))
            i += 1
            continue
        reasoning = msg.get("reasoning_content")
        calls = copy.deepcopy(list(msg["tool_calls"]))
        responses: list[dict[str, Any]] = []
        i += 1
        while i < len(messages) and messages[i].get("role", "") == "tool":
            tool = messages[i]
            response: Any = None
            if "content" in tool:
                content = tool["content"]
                if isinstance(content, str):
                    try:
                        response = json.loads(content)
                    except ValueError:
                        response = content
                else:
                    response = copy.deepcopy(content)
            name = ""
            if len(responses) < len(calls):
                call = calls[len(responses)]
                if isinstance(call, Mapping) and isinstance(call.get("function"), Mapping):
                    name = call["function"].get("name", "")
            if not name:
                name = tool.get("tool_call_id", "")
            responses.append({"name": name, "response": response})
            i += 1
        content: Any = None
        if i < len(messages) and messages[i].get("role", "") == "assistant":
            after = messages[i]
            if not _gemma4_has_calls(after) and _gemma4_has_content(after):
                content = copy.deepcopy(after["content"])
                i += 1
        built: dict[str, Any] = {"role": "assistant", "tool_calls": calls}
        if responses:
            built["tool_responses"] = responses
        if content is not None:
            built["content"] = content
        if isinstance(reasoning, str):
            built["reasoning_content"] = reasoning
        result.append(built)
    return result


def _gemma4_value_rules(p: ChatPegBuilder) -> None:
    """The rules of Gemma 4's argument syntax (``<|"|>`` strings, bare keys)."""
    p.rule("gemma4-string-content", p.until('<|"|>'))
    p.rule(
        "gemma4-string",
        p.cat(
            lambda: p.literal('<|"|>'),
            lambda: p.ref("gemma4-string-content"),
            lambda: p.literal('<|"|>'),
        ),
    )
    p.rule("gemma4-bool", p.json_bool())
    p.rule("gemma4-null", p.json_null())
    p.rule("gemma4-number", p.json_number())
    p.rule(
        "gemma4-dict-key",
        p.cat(
            lambda: p.rule("gemma4-dict-key-name", p.chars("[^:}]", 1, -1)),
            lambda: p.literal(":"),
        ),
    )
    p.rule(
        "gemma4-dict-kv",
        p.cat(lambda: p.ref("gemma4-dict-key"), p.space, lambda: p.ref("gemma4-value")),
    )

    def container(open_: str, close: str, item: str) -> Callable[[], Parser]:
        def build() -> Parser:
            ws = p.space()
            element = p.ref(item)
            elements = p.sequence(
                [element, p.zero_or_more(p.sequence([p.literal(","), ws, element]))]
            )
            return p.sequence(
                [
                    p.literal(open_),
                    ws,
                    p.choice([p.literal(close), p.sequence([elements, ws, p.literal(close)])]),
                ]
            )

        return build

    p.rule("gemma4-dict", container("{", "}", "gemma4-dict-kv"))
    p.rule("gemma4-array", container("[", "]", "gemma4-value"))
    p.rule(
        "gemma4-value",
        lambda: p.choice(
            [
                p.ref("gemma4-string"),
                p.ref("gemma4-dict"),
                p.ref("gemma4-array"),
                p.ref("gemma4-number"),
                p.ref("gemma4-bool"),
                p.ref("gemma4-null"),
            ]
        ),
    )


def gemma4(tmpl: ChatTemplate, inputs: GenerationParams) -> ChatParams:
    """``<|channel>thought`` reasoning ``<channel|>``, content, and
    ``<|tool_call>call:NAME{key:value,...}<tool_call|>`` calls in Gemma's own value syntax."""
    if "{#- OpenAI Chat Completions:" not in tmpl.source:  # an older Gemma 4 template
        inputs = replace(inputs, messages=convert_tool_responses_gemma4(inputs.messages))
    prompt = render_prompt(tmpl, inputs, inputs.add_generation_prompt)
    gen_prompt = generation_prompt(tmpl, inputs)
    if inputs.add_generation_prompt and prompt.endswith("<turn|>\n"):
        gen_prompt = "<|turn>model\n"
        prompt += gen_prompt
    if _has_continuation(inputs):
        msg = inputs.continue_msg or {}
        gen_prompt = "<|turn>model\n" if prompt.endswith("<turn|>\n") else ""
        gen_prompt += "<|channel>thought\n" + (msg.get("reasoning_content") or "")
        if inputs.continue_final_message is Continuation.CONTENT:
            gen_prompt += "<channel|>" + render_content(msg)
        prompt += gen_prompt
    has_tools = inputs.has_tools
    has_format = inputs.json_schema is not None and isinstance(inputs.json_schema, Mapping)
    include_grammar = has_format or _calls_tools(inputs)
    extract = inputs.reasoning_format is not ReasoningFormat.NONE

    def build(p: ChatPegBuilder) -> Parser:
        start = p.rule("start", p.optional(p.literal("<|turn>model\n")))
        if extract:
            p.rule(
                "thought",
                p.cat(
                    lambda: p.literal("<|channel>thought"),
                    p.space,
                    lambda: p.reasoning(p.until("<channel|>")),
                    lambda: p.literal("<channel|>"),
                ),
            )
        else:
            p.rule(
                "thought",
                p.content(
                    p.cat(
                        lambda: p.literal("<|channel>thought"),
                        p.space,
                        lambda: p.until("<channel|>"),
                        lambda: p.literal("<channel|>"),
                    )
                ),
            )
        consume_empty = p.gbnf(
            p.zero_or_more(
                p.cat(lambda: p.literal("<|channel>"), lambda: p.negate(p.literal("thought")))
            ),
            "",
        )
        thought = p.alt(
            lambda: p.cat(
                lambda: p.peek(p.literal("<|channel>")), consume_empty, lambda: p.ref("thought")
            ),
            lambda: p.negate(p.literal("<|channel>")),
        )
        if has_format:
            schema = inputs.json_schema
            response_format = (
                p.literal("```json")
                << p.content(p.schema(p.json(), "response-format-schema", schema))
                << p.literal("```")
            )
            return start + p.optional(thought) + response_format
        if _calls_tools(inputs):
            _gemma4_value_rules(p)
            tool_choice = p.choice()
            for function in _functions(inputs.tools):
                name = function["name"]
                opener = p.tool_open(
                    p.cat(
                        lambda name=name: p.tool_name(p.literal(name)),
                        lambda: p.peek(p.literal("{")),
                    )
                )
                call = p.tool(p.sequence([opener, p.tool_args(p.ref("gemma4-dict"))]))
                tool_choice |= p.rule(f"tool-{name}", call)
            tool_call = p.trigger_rule(
                "tool-call",
                p.repeat(
                    "<|tool_call>call:" + tool_choice + "<tool_call|>",
                    1 if inputs.tool_choice is ToolChoice.REQUIRED else 0,
                    -1 if inputs.parallel_tool_calls else 1,
                ),
            )
            if inputs.tool_choice is ToolChoice.REQUIRED:
                return start + thought + tool_call
            scan = p.rule("scan-to-toolcall", p.until("<|tool_call>"))
            content = p.rule(
                "content",
                p.content(p.until_one_of(["<|channel>", "<channel|>", "<|tool_call>"])),
            )
            message = p.rule("message", thought + content)
            return start + p.zero_or_more(message) + scan + tool_call
        content = p.rule("content", p.content(p.until_one_of(["<|channel>", "<channel|>"])))
        message = p.rule("message", thought + content)
        return start + p.one_or_more(message)

    parser = build_chat_peg_parser(build)
    grammar, lazy, triggers = "", False, ()
    if include_grammar:
        lazy = not (has_format or (has_tools and inputs.tool_choice is ToolChoice.REQUIRED))
        grammar = _grammar(parser, lazy)
        triggers = (GrammarTrigger(TriggerType.WORD, "<|tool_call>"),)
    return ChatParams(
        prompt=prompt,
        generation_prompt=gen_prompt,
        parser=parser,
        format=ChatFormat.PEG_GEMMA4.value,
        grammar=grammar,
        grammar_lazy=lazy,
        grammar_triggers=triggers,
        preserved_tokens=("<|channel>", "<channel|>", "<|tool_call>", "<tool_call|>", "<|turn>"),
        supports_thinking=True,
        thinking_start_tag="<|channel>thought",
        thinking_end_tags=("<channel|>",),
        user_start="<|turn>user",
        assistant_start="<|turn>model",
    )


HANDLERS: dict[str, Handler] = {
    "GPT-OSS": gpt_oss,
    "Qwen3-Coder": qwen3_coder,
    "Kimi K2 Thinking": kimi_k2,
    "DeepSeek V3.2/V4": deepseek_v3_2,
    "LFM2": _lfm2(tool_list_tokens=True),
    "LFM2.5": _lfm2(tool_list_tokens=False),
    "GigaChatV3": gigachat_v3,
    "Functionary v3.2": functionary_v3_2,
    "Ministral/Magistral Large 3": ministral_3,
    "MiniCPM5": minicpm5,
    "Cohere2 MoE": cohere2moe,
    "LLM-jp Harmony v1": llm_jp_harmony,
    "Muse Glimmer": muse_glimmer,
    "Kimi K3": kimi_k3,
    "Ling 3.0 (Bailing V3)": ling3,
    "MiniMax-M3": minimax_m3,
    "Gemma4": gemma4,
}
