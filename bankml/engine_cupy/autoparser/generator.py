"""From a template's analysis and a chat request, what llama-server generates and parses with.

A port of llama.cpp's common/chat-auto-parser-generator.cpp (``peg_generator::generate_parser``
and the analysers' ``build_parser``): the prompt and generation prompt, the PEG parser that reads
the model's output into reasoning, content and tool calls (built with
:mod:`bankml.engine_cupy.peg`), the GBNF grammar that constrains tool calls or a response format
(lazy, with its trigger words, when tools are optional), and the tokens and stops the tokenizer
and sampler keep.

Parser ids name GBNF rules (``until-12``), so the parsers are allocated in llama-server's order:
where C++ writes ``a + b`` (GCC builds the right operand first) this module writes
``p.cat(a, b)`` with the operands that allocate passed as functions (``ParserBuilder.cat``).
"""

from __future__ import annotations

import copy
import enum
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from bankml.engine_cupy.autoparser.analysis import (
    CallIdPosition,
    ContentAnalysis,
    ReasoningAnalysis,
    ReasoningMode,
    TemplateAnalysis,
    ToolFormat,
    ToolsAnalysis,
)
from bankml.engine_cupy.autoparser.helpers import trim_whitespace
from bankml.engine_cupy.chat_template import continue_generation_prompt
from bankml.engine_cupy.json_schema_grammar import Object, Property, parse_schema
from bankml.engine_cupy.peg.chat import ChatPegBuilder, build_chat_peg_parser, tool_parameters
from bankml.engine_cupy.peg.gbnf import build_grammar
from bankml.engine_cupy.peg.parser import Arena, Parser
from bankml.engine_cupy.peg.schema import may_be_string

if TYPE_CHECKING:
    from bankml.engine_cupy.chat_template import ChatTemplate


class ToolChoice(enum.Enum):
    AUTO = "auto"
    REQUIRED = "required"
    NONE = "none"


class ReasoningFormat(enum.Enum):
    NONE = "none"
    AUTO = "auto"
    DEEPSEEK = "deepseek"
    DEEPSEEK_LEGACY = "deepseek-legacy"


class Continuation(enum.Enum):
    """How the last message is continued (common_chat_continuation)."""

    NONE = "none"
    AUTO = "auto"
    CONTENT = "content"
    REASONING = "reasoning_content"


@dataclass(frozen=True)
class GenerationParams:
    """The request as the generator sees it (llama.cpp's ``autoparser::generation_params``):
    ``messages`` already in the template's form (chat_template.normalize_messages), ``tools``
    in OpenAI form, ``continue_msg`` the continued last message as the request gave it (left out
    of ``messages``)."""

    messages: Sequence[Mapping[str, Any]] = ()
    tools: Sequence[Mapping[str, Any]] | None = None
    tool_choice: ToolChoice = ToolChoice.AUTO
    json_schema: Mapping[str, Any] | None = None
    parallel_tool_calls: bool = True
    reasoning_format: ReasoningFormat = ReasoningFormat.AUTO
    grammar: str = ""
    add_generation_prompt: bool = False
    continue_final_message: Continuation = Continuation.NONE
    continue_msg: Mapping[str, Any] | None = None
    enable_thinking: bool = True
    extra_context: Mapping[str, Any] = field(default_factory=dict)
    add_bos: bool = False
    add_eos: bool = False

    @property
    def has_tools(self) -> bool:
        return bool(self.tools)

    @property
    def has_response_format(self) -> bool:
        return bool(self.json_schema) and isinstance(self.json_schema, Mapping)


class TriggerType(enum.Enum):
    TOKEN = "token"
    WORD = "word"
    PATTERN = "pattern"
    PATTERN_FULL = "pattern_full"


@dataclass(frozen=True)
class GrammarTrigger:
    type: TriggerType
    value: str


@dataclass(frozen=True)
class ChatParams:
    """What llama-server renders, constrains and parses a chat request with
    (``common_chat_params``); ``parser`` is the PEG arena (``parser.save()`` is llama-server's
    serialised form)."""

    prompt: str
    generation_prompt: str
    parser: Arena | None
    format: str = "peg-native"
    grammar: str = ""
    grammar_lazy: bool = False
    grammar_triggers: tuple[GrammarTrigger, ...] = ()
    preserved_tokens: tuple[str, ...] = ()
    additional_stops: tuple[str, ...] = ()
    supports_thinking: bool = False
    thinking_start_tag: str = ""
    thinking_end_tags: tuple[str, ...] = ()
    user_start: str = ""  # the message delimiters llama-server splits a prefill on
    assistant_start: str = ""


# ---------------------------------------------------------------------------------------------
# Rendering
# ---------------------------------------------------------------------------------------------


def render_prompt(tmpl: ChatTemplate, inputs: GenerationParams, add_generation_prompt: bool) -> str:
    """common_chat_template_direct_apply with the request's messages, tools and context."""
    return tmpl.direct_apply(
        copy.deepcopy([dict(m) for m in inputs.messages]),
        tools=copy.deepcopy([dict(t) for t in inputs.tools]) if inputs.tools else None,
        add_generation_prompt=add_generation_prompt,
        enable_thinking=inputs.enable_thinking,
        extra_context=dict(inputs.extra_context),
        strip_bos_eos=True,
    )


def generation_prompt(tmpl: ChatTemplate, inputs: GenerationParams) -> str:
    """What the template adds for the assistant's turn (common_chat_template_generation_prompt):
    the render with the generation prompt after its common prefix with the render without."""
    without = render_prompt(tmpl, inputs, False)
    with_prompt = render_prompt(tmpl, inputs, True)
    return with_prompt[len(os.path.commonprefix([without, with_prompt])) :]


# ---------------------------------------------------------------------------------------------
# The parser
# ---------------------------------------------------------------------------------------------


@dataclass
class _Context:
    """parser_build_context."""

    p: ChatPegBuilder
    inputs: GenerationParams
    analysis: TemplateAnalysis
    reasoning_parser: Parser
    extracting_reasoning: bool = False


def _reasoning_parser(ctx: _Context, reasoning: ReasoningAnalysis) -> Parser:
    p = ctx.p
    if not ctx.extracting_reasoning:
        return p.eps()
    if reasoning.mode in (ReasoningMode.TAG_BASED, ReasoningMode.TOOLS_ONLY) and reasoning.end:
        end = trim_whitespace(reasoning.end)
        if reasoning.start:
            return p.optional(
                p.cat(
                    lambda: p.optspace(reasoning.start),
                    lambda: p.reasoning(p.until(end)),
                    lambda: p.optspace(reasoning.end),
                )
            )
        return p.optional(
            p.cat(lambda: p.reasoning(p.until(end)), lambda: p.optspace(reasoning.end))
        )
    return p.eps()


def _content_parser(ctx: _Context, content: ContentAnalysis) -> Parser:
    p = ctx.p
    if content.is_always_wrapped:
        if ctx.extracting_reasoning:
            return p.cat(
                ctx.reasoning_parser,
                content.start,
                lambda: p.content(p.until(content.end)),
                content.end,
                p.end,
            )
        return p.cat(
            lambda: p.content(p.until(content.start)),
            content.start,
            lambda: p.content(p.until(content.end)),
            content.end,
            p.end,
        )
    return p.cat(ctx.reasoning_parser, lambda: p.content(p.rest()), p.end)


def _optional_wrapped(ctx: _Context, content: ContentAnalysis) -> Parser:
    p = ctx.p
    if content.is_always_wrapped:
        return p.optional(
            p.cat(content.start, lambda: p.content(p.until(content.end)), content.end)
        )
    return p.eps()


def _functions(tools: Sequence[Mapping[str, Any]] | None) -> list[Mapping[str, Any]]:
    """foreach_function: the tools of type function that have one."""
    return [
        t["function"]
        for t in tools or ()
        if isinstance(t, Mapping) and t.get("type") == "function" and "function" in t
    ]


def _json_native(ctx: _Context, tools: ToolsAnalysis) -> Parser:
    p, inputs, fmt = ctx.p, ctx.inputs, tools.format
    name_field, args_field = fmt.name_field, fmt.args_field
    if fmt.function_field and fmt.function_field != "function" and "." not in name_field:
        name_field = f"{fmt.function_field}.{name_field}"
        args_field = f"{fmt.function_field}.{args_field}"
    required = inputs.tool_choice is ToolChoice.REQUIRED
    tool_list = list(inputs.tools or ())

    def standard(start: str, end: str) -> Parser:
        return p.standard_json_tools(
            start,
            end,
            tool_list,
            inputs.parallel_tool_calls,
            required,
            name_field,
            args_field,
            fmt.tools_array_wrapped,
            fmt.fun_name_is_key,
            fmt.id_field,
            fmt.gen_id_field,
            fmt.parameter_order,
            fmt.openai_wrapper_trigger,
        )

    tools_parser = p.eps()
    if not fmt.section_start and fmt.per_call_start:
        single = standard(fmt.per_call_start, fmt.per_call_end)
        tools_parser = p.trigger_rule("tool-calls", p.one_or_more(p.cat(single, p.space)))
    else:
        tools_parser = standard(fmt.section_start, fmt.section_end)
    content = ctx.analysis.content
    if content.is_always_wrapped:
        wrapped = _optional_wrapped(ctx, content)
        return p.cat(ctx.reasoning_parser, wrapped, tools_parser, p.end)
    tool_start = fmt.section_start or fmt.per_call_start or "{"
    return p.cat(
        ctx.reasoning_parser,
        lambda: p.optional(p.content(p.until(tool_start))),
        tools_parser,
        p.end,
    )


def _func_parser(
    p: ChatPegBuilder,
    tools: ToolsAnalysis,
    name: str,
    call_id_section: Parser,
    have_call_id: bool,
    args: Parser,
    atomic_peek: Parser | None,
) -> Parser:
    """build_func_parser: the function's opener, call id, arguments and closer."""
    fn, fmt, arguments = tools.function, tools.format, tools.arguments
    opener = p.tool_open(
        p.cat(fn.name_prefix, lambda: p.tool_name(p.literal(name)), fn.name_suffix)
    )
    matched_atomic = False
    func = p.eps()
    if fn.args_separator:
        opener = p.cat(opener, p.space, lambda: p.literal(fn.args_separator))
    if fn.name_suffix:
        func = p.cat(opener, call_id_section, p.space, args)
        matched_atomic = True
    elif have_call_id:
        func = p.cat(lambda: p.atomic(opener + call_id_section), p.space, args)
        matched_atomic = True
    elif atomic_peek is not None:
        peek = atomic_peek
        func = p.cat(lambda: p.atomic(p.cat(opener, call_id_section, p.space, peek)), args)
        matched_atomic = True
    else:
        func = p.cat(opener, call_id_section, p.space, args)
    if fn.close:
        func = p.cat(func, p.space, lambda: p.tool_close(p.literal(fn.close)))
    elif fmt.per_call_end:
        if arguments.tolerate_intertag_whitespace:
            close_peek = p.peek(p.cat(p.space, lambda: p.literal(fmt.per_call_end)))
        else:
            close_peek = p.peek(p.literal(fmt.per_call_end))
        func = func + p.tool_close(close_peek)
    else:
        func = func + p.tool_close(p.space())  # the mapper's tool-closing step runs on it
    if not matched_atomic:
        func = p.atomic(func)
    return func


def _call_id_between(tools: ToolsAnalysis) -> bool:
    cid = tools.call_id
    return (
        cid.pos is CallIdPosition.BETWEEN_FUNC_AND_ARGS
        and bool(cid.prefix)
        and bool(cid.suffix or tools.arguments.start)
    )


def _tool_calls_tail(
    ctx: _Context, tools: ToolsAnalysis, tool_calls: Parser, required: bool
) -> Parser:
    p, fmt = ctx.p, tools.format
    if not required:
        tool_calls = p.optional(tool_calls)
    trigger_marker = fmt.section_start or fmt.per_call_start
    before = p.until(trigger_marker) if trigger_marker else p.eps()
    return p.cat(ctx.reasoning_parser, lambda: p.optional(p.content(before)), tool_calls, p.end)


def _tag_json(ctx: _Context, tools: ToolsAnalysis) -> Parser:
    p, inputs = ctx.p, ctx.inputs
    fmt, arguments, cid = tools.format, tools.arguments, tools.call_id
    tool_choice = p.choice()
    for function in _functions(inputs.tools):
        name = function["name"]
        schema = tool_parameters(function)
        have_call_id = False
        call_id_section = p.eps()
        if _call_id_between(tools):
            if cid.suffix:
                call_id_section = p.cat(
                    lambda: p.optional(p.cat(cid.prefix, lambda: p.tool_id(p.until(cid.suffix)))),
                    cid.suffix,
                )
            else:
                call_id_section = p.optional(
                    p.cat(cid.prefix, lambda: p.tool_id(p.until(arguments.start)))
                )
            have_call_id = True
        args = p.tool_args(p.schema(p.json(), f"tool-{name}-schema", schema))
        if arguments.start:
            args = p.cat(lambda: p.literal(arguments.start), args)
        if arguments.end:
            args = args + p.literal(arguments.end)
        peek = p.peek(p.literal(arguments.start)) if arguments.start else None
        func = _func_parser(p, tools, name, call_id_section, have_call_id, args, peek)
        tool_choice |= p.rule(f"tool-{name}", func)
    required = inputs.tool_choice is ToolChoice.REQUIRED
    tool_calls = p.eps()
    if fmt.per_call_start:
        wrapped = p.cat(fmt.per_call_start, tool_choice, fmt.per_call_end)
        if inputs.parallel_tool_calls:
            tool_calls = p.trigger_rule(
                "tool-call",
                p.cat(wrapped, lambda: p.zero_or_more(p.cat(p.space, wrapped))),
            )
        else:
            tool_calls = p.trigger_rule("tool-call", wrapped)
        if fmt.section_start:
            tool_calls = p.trigger_rule(
                "tool-calls",
                p.cat(
                    lambda: p.literal(fmt.section_start),
                    p.space,
                    tool_calls,
                    p.space,
                    lambda: p.end() if not fmt.section_end else p.literal(fmt.section_end),
                ),
            )
    else:
        separator = ", "
        if inputs.parallel_tool_calls:
            tool_calls = p.trigger_rule(
                "tool-call",
                p.cat(
                    fmt.section_start,
                    tool_choice,
                    lambda: p.zero_or_more(p.cat(separator, tool_choice)),
                    fmt.section_end,
                ),
            )
        else:
            tool_calls = p.trigger_rule(
                "tool-call", p.cat(fmt.section_start, tool_choice, fmt.section_end)
            )
    return _tool_calls_tail(ctx, tools, tool_calls, required)


def _parameters(function: Mapping[str, Any]) -> list[Property]:
    """foreach_parameter: the properties of the function's parameter schema (an object)."""
    root = parse_schema(tool_parameters(function))
    return list(root.properties) if isinstance(root, Object) else []


def _tag_tagged(ctx: _Context, tools: ToolsAnalysis) -> Parser:
    p, inputs = ctx.p, ctx.inputs
    fmt, arguments, cid = tools.format, tools.arguments, tools.call_id
    until_suffix = p.rule("until-suffix", p.until(arguments.value_suffix))
    tool_choice = p.choice()
    for function in _functions(inputs.tools):
        name = function["name"]
        required_args: list[Parser] = []
        optional_args: list[Parser] = []
        for param in _parameters(function):

            def value(param: Any = param, name: str = name) -> Parser:
                if may_be_string(param.schema):
                    return p.ac(
                        p.cat(
                            lambda: p.tool_arg_string_value(until_suffix),
                            lambda: p.tool_arg_close(p.literal(arguments.value_suffix)),
                        ),
                        arguments.value_suffix,
                    )
                return p.cat(
                    lambda: p.tool_arg_json_value(
                        p.schema(p.json(), f"tool-{name}-arg-{param.name}-schema", param.schema)
                    ),
                    lambda: p.tool_arg_close(p.literal(arguments.value_suffix)),
                )

            def opener(param: Any = param) -> Parser:
                return p.tool_arg_open(
                    p.cat(
                        arguments.name_prefix,
                        lambda: p.tool_arg_name(p.literal(param.name)),
                        arguments.name_suffix,
                    )
                )

            arg = p.tool_arg(p.cat(opener, arguments.value_prefix, value))
            named = p.rule(f"tool-{name}-arg-{param.name}", arg)
            (required_args if param.required else optional_args).append(named)
        args = p.eps()
        for i, named in enumerate(required_args):
            if i > 0:
                args = args + p.space()
            args = args + named
        if optional_args:
            any_optional = p.choice()
            for named in optional_args:
                any_optional |= named

            def optionals(opt: Parser = any_optional) -> Parser:
                return p.repeat(p.cat(p.space, opt), 0, -1)

            args = p.cat(args, optionals)
        if arguments.start:
            args = p.cat(lambda: p.literal(arguments.start), args)
        if arguments.end:
            args = args + p.literal(arguments.end)
        call_id_section = p.eps()
        have_call_id = False
        if _call_id_between(tools):
            have_call_id = True
            if cid.suffix:
                call_id_section = p.optional(
                    p.cat(cid.prefix, lambda: p.tool_id(p.until(cid.suffix)), cid.suffix)
                )
            else:
                call_id_section = p.optional(
                    p.cat(cid.prefix, lambda: p.tool_id(p.until(arguments.start)))
                )
        peek = (
            p.peek(p.literal(arguments.name_prefix))
            if arguments.name_prefix and required_args
            else None
        )
        func = _func_parser(p, tools, name, call_id_section, have_call_id, args, peek)
        tool_choice |= p.rule(f"tool-{name}", func)
    required = inputs.tool_choice is ToolChoice.REQUIRED
    tool_calls = p.eps()
    if fmt.per_call_start:
        wrapped = p.cat(fmt.per_call_start, p.space, tool_choice, p.space, fmt.per_call_end)
        if inputs.parallel_tool_calls:
            tool_calls = p.trigger_rule(
                "tool-call",
                p.cat(wrapped, lambda: p.zero_or_more(p.cat(p.space, wrapped)), p.space),
            )
        else:
            tool_calls = p.trigger_rule("tool-call", p.cat(wrapped, p.space))
        if fmt.section_start:
            tool_calls = p.trigger_rule(
                "tool-calls",
                p.cat(
                    lambda: p.literal(fmt.section_start),
                    p.space,
                    tool_calls,
                    p.space,
                    lambda: (
                        p.end()
                        if not fmt.section_end
                        else p.cat(lambda: p.literal(fmt.section_end), p.space)
                    ),
                ),
            )
    else:
        separator = ", "
        if inputs.parallel_tool_calls:
            tool_calls = p.trigger_rule(
                "tool-call",
                p.cat(
                    fmt.section_start,
                    p.space,
                    tool_choice,
                    lambda: p.zero_or_more(p.cat(separator, tool_choice)),
                    p.space,
                    fmt.section_end,
                ),
            )
        else:
            tool_calls = p.trigger_rule(
                "tool-call",
                p.cat(fmt.section_start, p.space, tool_choice, p.space, fmt.section_end),
            )
    return _tool_calls_tail(ctx, tools, tool_calls, required)


def _tools_parser(ctx: _Context, tools: ToolsAnalysis) -> Parser:
    if tools.format.mode is ToolFormat.JSON_NATIVE:
        return _json_native(ctx, tools)
    if tools.format.mode is ToolFormat.TAG_WITH_JSON:
        return _tag_json(ctx, tools)
    if tools.format.mode is ToolFormat.TAG_WITH_TAGGED:
        return _tag_tagged(ctx, tools)
    return ctx.p.eps()  # tool calls without a known format: none are parsed


def build_parser(
    analysis: TemplateAnalysis, inputs: GenerationParams, generation_prompt: str
) -> Arena:
    """The PEG parser of a model's output (autoparser::build_parser): the generation prompt, then
    reasoning, content, tool calls or a response format as the request asks."""

    def build(p: ChatPegBuilder) -> Parser:
        ctx = _Context(p, inputs, analysis, reasoning_parser=p.eps())
        extract = inputs.reasoning_format is not ReasoningFormat.NONE
        ctx.extracting_reasoning = extract and analysis.reasoning.mode is not ReasoningMode.NONE
        ctx.reasoning_parser = _reasoning_parser(ctx, analysis.reasoning)
        parser = p.eps()
        pure_content = analysis.reasoning.mode is ReasoningMode.NONE
        if inputs.has_response_format:
            response_format = p.rule(
                "response-format",
                p.content(p.schema(p.json(), "response-format-schema", inputs.json_schema)),
            )
            parser = p.cat(
                ctx.reasoning_parser,
                p.space,
                lambda: p.choice(
                    [
                        p.cat(
                            lambda: p.literal("```json"),
                            p.space,
                            response_format,
                            p.space,
                            lambda: p.literal("```"),
                        ),
                        p.cat(p.space, response_format, p.space),
                    ]
                ),
                p.end,
            )
            pure_content = False
        elif (
            inputs.has_tools
            and inputs.tool_choice is not ToolChoice.NONE
            and analysis.jinja_caps.supports_tool_calls
        ):
            parser = _tools_parser(ctx, analysis.tools)
            pure_content = False
        else:
            parser = _content_parser(ctx, analysis.content)
        start = trim_whitespace(analysis.reasoning.start)
        if pure_content:
            return p.prefix(generation_prompt, start) + parser
        return p.prefix(generation_prompt, start) << parser

    return build_chat_peg_parser(build)


def generate_parser(
    tmpl: ChatTemplate, inputs: GenerationParams, analysis: TemplateAnalysis | None = None
) -> ChatParams:
    """peg_generator::generate_parser: the chat params of a request on an analysed template."""
    analysis = analysis if analysis is not None else tmpl.analysis
    prompt = render_prompt(tmpl, inputs, inputs.add_generation_prompt)
    gen_prompt = generation_prompt(tmpl, inputs)
    parser_generation_prompt = gen_prompt
    msg = inputs.continue_msg
    if inputs.continue_final_message is not Continuation.NONE and msg and _not_empty(msg):
        reasoning = analysis.reasoning
        gen_prompt = continue_generation_prompt(
            gen_prompt,
            reasoning.start,
            reasoning.end,
            msg,
            inputs.continue_final_message is Continuation.CONTENT,
        )
        prompt += gen_prompt
    parser = build_parser(analysis, inputs, parser_generation_prompt)
    fmt = analysis.tools.format
    has_tools = fmt.mode is not ToolFormat.NONE and inputs.has_tools
    trigger_marker = fmt.section_start or fmt.per_call_start
    include_grammar = inputs.has_response_format or (
        has_tools
        and (
            (inputs.tool_choice is ToolChoice.AUTO and bool(trigger_marker))
            or inputs.tool_choice is ToolChoice.REQUIRED
        )
    )
    grammar, lazy, triggers = "", False, []
    if include_grammar:
        lazy = not inputs.has_response_format and inputs.tool_choice is ToolChoice.AUTO
        grammar = build_grammar(lambda builder: parser.build_grammar(builder, lazy))
        if lazy:
            triggers.append(GrammarTrigger(TriggerType.WORD, trigger_marker))
            if fmt.openai_wrapper_trigger:
                triggers.append(GrammarTrigger(TriggerType.WORD, '{"type": "function",'))
    reasoning = analysis.reasoning
    end_tag = trim_whitespace(reasoning.end)
    return ChatParams(
        prompt=prompt,
        generation_prompt=gen_prompt,
        parser=parser,
        grammar=grammar,
        grammar_lazy=lazy,
        grammar_triggers=tuple(triggers),
        preserved_tokens=analysis.preserved_tokens,
        additional_stops=analysis.additional_stops,
        supports_thinking=reasoning.supported,
        thinking_start_tag=trim_whitespace(reasoning.start) if reasoning.supported else "",
        thinking_end_tags=(end_tag,) if reasoning.supported and end_tag else (),
        user_start=analysis.user_start,
        assistant_start=analysis.assistant_start,
    )


def _not_empty(msg: Mapping[str, Any]) -> bool:
    """common_chat_msg::empty, negated."""
    return any(
        msg.get(key)
        for key in ("content", "reasoning_content", "tool_calls", "name", "tool_call_id")
    )
