"""What a chat template does with reasoning, content and tool calls, found by rendering it.

A port of llama.cpp's differential template analysis (common/chat-diff-analyzer.cpp): the template
is rendered with probe conversations that differ in one thing (reasoning or not, a tool call or
not, one argument or two, another call id, ...), and the markers the template writes around the
thing that changed are read off the difference. The result says where reasoning goes (its start
and end markers), whether content is wrapped, and how tool calls are written: as JSON objects
(``JSON_NATIVE``), as tags around JSON arguments (``TAG_WITH_JSON``) or as tags around each
argument (``TAG_WITH_TAGGED``), with their section, per-call, function-name, argument and call-id
markers. llama.cpp's fixed answers for templates the analysis gets wrong ("workarounds") are
applied at the end, as llama.cpp applies them.

:func:`analyze_template` is the entry point; every result is a frozen dataclass mirroring the
C++ struct of the same role.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from bankml.engine_cupy.autoparser.helpers import (
    MARKER,
    CompareResult,
    TemplateParams,
    after_common_suffix,
    calculate_diff_split,
    compare_variants,
    get,
    last_marker,
    match_tags,
    prune_whitespace_segments,
    search_tags,
    segmentize_markers,
    trim_leading_whitespace,
    trim_whitespace,
    until_common_prefix,
)
from bankml.engine_cupy.peg.parser import Parser, ParserBuilder

if TYPE_CHECKING:
    from bankml.engine_cupy.chat_template import Caps, ChatTemplate


class AnalysisError(ValueError):
    """The template's tool calls cannot be analysed (llama-server refuses such a template)."""


class ReasoningMode(enum.Enum):
    NONE = "NONE"  # no reasoning markers
    TAG_BASED = "TAG_BASED"  # <think>...</think> (the start may be empty: delimiter style)
    TOOLS_ONLY = "TOOLS_ONLY"  # reasoning is rendered only with tool calls


class ContentMode(enum.Enum):
    PLAIN = "PLAIN"
    ALWAYS_WRAPPED = "ALWAYS_WRAPPED"
    WRAPPED_WITH_REASONING = "WRAPPED_WITH_REASONING"


class CallIdPosition(enum.Enum):
    NONE = "NONE"
    PRE_FUNC_NAME = "PRE_FUNC_NAME"  # [CALL_ID]id[FUNC]name{args}
    BETWEEN_FUNC_AND_ARGS = "BETWEEN_FUNC_AND_ARGS"  # [FUNC]name[CALL_ID]id{args}
    POST_ARGS = "POST_ARGS"  # [FUNC]name{args}[CALL_ID]id


class ToolFormat(enum.Enum):
    NONE = "NONE"
    JSON_NATIVE = "JSON_NATIVE"  # {"name": "X", "arguments": {...}}
    TAG_WITH_JSON = "TAG_WITH_JSON"  # <function=X>{...}</function>
    TAG_WITH_TAGGED = "TAG_WITH_TAGGED"  # <function=X><param=key>value</param></function>


@dataclass(frozen=True)
class ReasoningAnalysis:
    mode: ReasoningMode = ReasoningMode.NONE
    start: str = ""  # "<think>", "[THINK]", "<|START_THINKING|>", ""
    end: str = ""  # "</think>", "[BEGIN FINAL RESPONSE]", "<|END_THINKING|>"

    @property
    def supported(self) -> bool:
        """The template has a reasoning block (llama-server then enables thinking by default)."""
        return self.mode is not ReasoningMode.NONE


@dataclass(frozen=True)
class ContentAnalysis:
    mode: ContentMode = ContentMode.PLAIN
    start: str = ""  # "<response>", ""
    end: str = ""  # "</response>", ""
    requires_nonnull_content: bool = False

    @property
    def is_always_wrapped(self) -> bool:
        return self.mode is ContentMode.ALWAYS_WRAPPED and bool(self.start) and bool(self.end)


@dataclass(frozen=True)
class ToolFormatAnalysis:
    mode: ToolFormat = ToolFormat.NONE
    section_start: str = ""  # "<tool_call>", "[TOOL_CALLS]", ""
    section_end: str = ""  # "</tool_call>", ""
    per_call_start: str = ""  # "<|tool_call_begin|>", ""
    per_call_end: str = ""  # "<|tool_call_end|>", ""
    fun_name_is_key: bool = False  # JSON: {"<name>": {arguments}}
    tools_array_wrapped: bool = False  # JSON calls inside [...]
    openai_wrapper_trigger: bool = False  # the model writes the OpenAI function wrapper
    function_field: str = "function"
    name_field: str = "name"
    args_field: str = "arguments"
    id_field: str = ""
    gen_id_field: str = ""
    parameter_order: tuple[str, ...] = ()


@dataclass(frozen=True)
class ToolFunctionAnalysis:
    name_prefix: str = ""  # "<function=", "\"name\": \"", "functions."
    name_suffix: str = ""  # ">", "\"", ":0"
    args_separator: str = ""  # "<tool_sep>"
    close: str = ""  # "</function>", ""


@dataclass(frozen=True)
class ToolArgumentsAnalysis:
    start: str = ""  # "<|tool_call_argument_begin|>", "<args>"
    end: str = ""  # "<|tool_call_argument_end|>", "</args>"
    name_prefix: str = ""  # "<param=", "<arg_key>", "\""
    name_suffix: str = ""  # ">", "</arg_key>", "\":"
    value_prefix: str = ""  # "", "<arg_value>"
    value_suffix: str = ""  # "</param>", "</arg_value>"
    separator: str = ""  # "", "\n", ","
    tolerate_intertag_whitespace: bool = False


@dataclass(frozen=True)
class ToolIdAnalysis:
    pos: CallIdPosition = CallIdPosition.NONE
    prefix: str = ""  # "[CALL_ID]"
    suffix: str = ""


@dataclass(frozen=True)
class ToolsAnalysis:
    format: ToolFormatAnalysis = field(default_factory=ToolFormatAnalysis)
    function: ToolFunctionAnalysis = field(default_factory=ToolFunctionAnalysis)
    arguments: ToolArgumentsAnalysis = field(default_factory=ToolArgumentsAnalysis)
    call_id: ToolIdAnalysis = field(default_factory=ToolIdAnalysis)


@dataclass(frozen=True)
class TemplateAnalysis:
    """Everything the analysis found (llama.cpp's ``autoparser`` after ``analyze_template``)."""

    jinja_caps: Caps
    user_start: str = ""
    assistant_start: str = ""
    reasoning: ReasoningAnalysis = field(default_factory=ReasoningAnalysis)
    content: ContentAnalysis = field(default_factory=ContentAnalysis)
    tools: ToolsAnalysis = field(default_factory=ToolsAnalysis)
    preserved_tokens: tuple[str, ...] = ()  # every non-empty marker, trimmed, once
    additional_stops: tuple[str, ...] = ()  # literal stop strings (Laguna's </assistant>)


# ---------------------------------------------------------------------------------------------
# Probe conversations
# ---------------------------------------------------------------------------------------------

FUN_FIRST = "FFF_FIRST_FUN_F"
FUN_SECOND = "SSS_SECOND_FUN_S"
ARG_FIRST = "AA_ARG_FST_AA"
ARG_SECOND = "BB_ARG_SND_BB"
USER_MSG = "U_USER_MSG Hello END_U"
USER_MSG_TWO = "V_USER_MSG Hello END_V"
ASSISTANT_MSG = "A_ASST_MSG I can help END_A"
THINKING_CONTENT = "REASON_PART I am thinking END_R"
CALL_ID_001 = "call00001"
CALL_ID_002 = "call00002"
CALL_ID_999 = "call99999"

_PARAMS_SCHEMA = {
    "type": "object",
    "properties": {
        ARG_FIRST: {"type": "string", "description": "First argument"},
        ARG_SECOND: {"type": "string", "description": "Second argument"},
    },
    "required": [],
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": FUN_FIRST,
            "description": "Test function foo",
            "parameters": _PARAMS_SCHEMA,
        },
    },
    {
        "type": "function",
        "function": {
            "name": FUN_SECOND,
            "description": "Test function bar",
            "parameters": _PARAMS_SCHEMA,
        },
    },
]


def _call(name: str, args: dict[str, Any], call_id: str = CALL_ID_001) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}


def _user(content: str = USER_MSG) -> dict[str, Any]:
    return {"role": "user", "content": content}


def _assistant(content: Any = ASSISTANT_MSG, **extra: Any) -> dict[str, Any]:
    return {"role": "assistant", "content": content, **extra}


def _with_calls(*calls: dict[str, Any]) -> dict[str, Any]:
    return _assistant("", tool_calls=list(calls))


_CALL_ZERO_ARGS = _call(FUN_FIRST, {})
_CALL_ONE_ARG = _call(FUN_FIRST, {ARG_FIRST: "XXXX"})
_CALL_ONE_ARG_OTHER_VAL = _call(FUN_FIRST, {ARG_FIRST: "YYYY"})
_CALL_OTHER_ARG = _call(FUN_FIRST, {ARG_SECOND: "YYYY"})
_FIRST_CALL = _call(FUN_FIRST, {ARG_FIRST: "XXXX", ARG_SECOND: "YYYY"})
_SECOND_CALL = _call(FUN_SECOND, {ARG_FIRST: "XXXX", ARG_SECOND: "YYYY"}, CALL_ID_002)
_FIRST_CALL_ALT_ID = _call(FUN_FIRST, {ARG_FIRST: "XXXX", ARG_SECOND: "YYYY"}, CALL_ID_999)


def _params(*messages: dict[str, Any], tools: bool = True, gen: bool = False) -> TemplateParams:
    return TemplateParams(
        messages=list(messages), tools=TOOLS if tools else None, add_generation_prompt=gen
    )


def _messages(*messages: dict[str, Any]) -> Callable[[TemplateParams], TemplateParams]:
    return lambda p: p.but(messages=list(messages))


# ---------------------------------------------------------------------------------------------
# Tagged parsers used more than once
# ---------------------------------------------------------------------------------------------


def _up_to_last_marker(tag_name: str, whole: bool) -> Callable[[ParserBuilder], Parser]:
    """Everything up to the last marker, then the last marker tagged (``whole``: with the text
    after it, to the end)."""

    def build(p: ParserBuilder) -> Parser:
        tagged = last_marker(p) if whole else p.marker()
        return p.zero_or_more(p.negate(last_marker(p)) + p.any()) + p.tag(tag_name, tagged)

    return build


def _first_marker(p: ParserBuilder) -> Parser:
    return p.tag("m", p.marker())


def _wrapped(needle: str, space_in_post: bool) -> Callable[[ParserBuilder], Parser]:
    """A marker, the needle and a marker, the markers (with the spaces after them) tagged
    pre/post; ``space_in_post`` puts the space before the closing marker into "post"."""

    def build(p: ParserBuilder) -> Parser:
        pre = p.tag("pre", p.marker() + p.space()) + p.literal(needle)
        if space_in_post:
            return pre + p.tag("post", p.space() + p.marker() + p.space()) + p.rest()
        return pre + p.space() + p.tag("post", p.marker() + p.space()) + p.rest()

    return build


# ---------------------------------------------------------------------------------------------
# Reasoning
# ---------------------------------------------------------------------------------------------


def _reasoning_presence(tmpl: ChatTemplate) -> ReasoningAnalysis:
    found = compare_variants(
        tmpl,
        _params(_user(), _assistant(), tools=False),
        _messages(_user(), _assistant(reasoning_content=THINKING_CONTENT)),
    )
    if found is None or THINKING_CONTENT not in found.diff.right:
        return ReasoningAnalysis()

    def delimiter(p: ParserBuilder) -> Parser:
        post = p.optional(p.tag("post", p.marker() + p.space()))
        return p.literal(THINKING_CONTENT) + p.space() + post + p.rest()

    tags = search_tags(_wrapped(THINKING_CONTENT, space_in_post=True), found.output_b)
    if tags is None:
        tags = search_tags(delimiter, found.output_b)
    if tags is None:
        return ReasoningAnalysis()
    if get(tags, "pre") and get(tags, "post"):
        return ReasoningAnalysis(ReasoningMode.TAG_BASED, tags["pre"], tags["post"])
    if get(tags, "post"):
        return ReasoningAnalysis(ReasoningMode.TAG_BASED, "", tags["post"])
    return ReasoningAnalysis()


def _thinking_enabled(tmpl: ChatTemplate, found: ReasoningAnalysis) -> ReasoningAnalysis:
    """compare_thinking_enabled: what enable_thinking adds to or removes from the prompt."""
    comparison = compare_variants(
        tmpl,
        TemplateParams(messages=[_user()], add_generation_prompt=True, enable_thinking=False),
        lambda p: p.but(enable_thinking=True),
    )
    if comparison is None:
        return found
    mode, start, end = found.mode, found.start, found.end
    diff = comparison.diff
    left, right = trim_whitespace(diff.left), trim_whitespace(diff.right)
    if not left and diff.right:
        if right and comparison.output_b.endswith(right) and not start:
            start, mode = diff.right, ReasoningMode.TAG_BASED
    elif not right and diff.left:
        if left and comparison.output_a.endswith(left) and not end:
            segs = prune_whitespace_segments(segmentize_markers(comparison.output_a))
            if len(segs) >= 2 and segs[-1].value == left and segs[-2].type == MARKER:
                start = segs[-2].value
            end, mode = diff.left, ReasoningMode.TAG_BASED
    elif left and right:
        # the whole renders differ (SmolLM3 changes its system message): anchor on the tail
        out_a, out_b = comparison.output_a, comparison.output_b
        for base, extended in ((out_b, out_a), (out_a, out_b)):
            anchor = base[len(base) - min(len(base), 64) :]
            pos = extended.rfind(anchor)
            if pos < 0 or pos + len(anchor) >= len(extended):
                continue
            extra = trim_whitespace(extended[pos + len(anchor) :])
            if not extra:
                continue
            segs = prune_whitespace_segments(segmentize_markers(extra))
            if len(segs) == 2 and segs[0].type == MARKER and segs[1].type == MARKER:
                start = start or segs[0].value
                end = end or segs[1].value
                mode = ReasoningMode.TAG_BASED
                break
    if mode is ReasoningMode.NONE and not start and end:
        mode = ReasoningMode.TAG_BASED
    return ReasoningAnalysis(mode, start, end)


def _reasoning_scope(tmpl: ChatTemplate, found: ReasoningAnalysis) -> ReasoningAnalysis:
    """compare_reasoning_scope: reasoning rendered only beside tool calls (TOOLS_ONLY)."""
    with_tools = _assistant(
        None,
        reasoning_content=THINKING_CONTENT,
        tool_calls=[_call(FUN_FIRST, {ARG_FIRST: "VVVV", ARG_SECOND: "XXXX"})],
    )
    comparison = compare_variants(
        tmpl,
        _params(_user(), _assistant(reasoning_content=THINKING_CONTENT)),
        _messages(_user(), with_tools),
    )
    if comparison is None:
        return found
    if THINKING_CONTENT in comparison.output_a or THINKING_CONTENT not in comparison.output_b:
        return found

    def wrapped(p: ParserBuilder) -> Parser:
        pre = p.tag("pre", p.marker() + p.space()) + p.literal(THINKING_CONTENT) + p.space()
        return pre + p.tag("post", p.marker() + p.space())

    tags = search_tags(wrapped, comparison.output_b)
    if tags is not None:
        return ReasoningAnalysis(ReasoningMode.TOOLS_ONLY, get(tags, "pre"), get(tags, "post"))

    def delimiter(p: ParserBuilder) -> Parser:
        post = p.optional(p.tag("post", p.marker() + p.space()))
        return p.literal(THINKING_CONTENT) + p.space() + post

    tags = search_tags(delimiter, comparison.output_b)
    if tags is not None:
        return ReasoningAnalysis(ReasoningMode.TOOLS_ONLY, found.start, get(tags, "post"))
    return ReasoningAnalysis(ReasoningMode.NONE, found.start, found.end)


def analyze_reasoning(tmpl: ChatTemplate, supports_tools: bool) -> ReasoningAnalysis:
    """The reasoning block's markers, before the workarounds (analyze_reasoning)."""
    found = _reasoning_presence(tmpl)
    found = _thinking_enabled(tmpl, found)
    if supports_tools:
        found = _reasoning_scope(tmpl, found)
    return found


# ---------------------------------------------------------------------------------------------
# Content
# ---------------------------------------------------------------------------------------------


def analyze_content(tmpl: ChatTemplate, reasoning: ReasoningAnalysis) -> ContentAnalysis:
    """Whether the template wraps the assistant's content in markers (analyze_content)."""
    base = _params(_user(), _assistant())
    with_tools = compare_variants(
        tmpl, base, _messages(_user(), _with_calls(_call("test_func", {"arg1": "value1"})))
    )
    with_reasoning = compare_variants(
        tmpl, base, _messages(_user(), _assistant("", reasoning_content=THINKING_CONTENT))
    )
    if with_tools is None or with_reasoning is None:
        return ContentAnalysis()
    diff_tools, diff_reasoning = with_tools.diff, with_reasoning.diff
    if trim_whitespace(diff_tools.left) == ASSISTANT_MSG:
        left = diff_reasoning.left

        def only_content(p: ParserBuilder) -> Parser:
            text = p.space() + left + p.space()
            return text + p.optional(p.marker()) + p.space() + p.end()

        if match_tags(only_content, left) is not None:
            return ContentAnalysis()  # only the text (maybe an end-of-turn marker): plain
        if reasoning.mode is not ReasoningMode.NONE and reasoning.end:

            def after(p: ParserBuilder) -> Parser:
                return p.literal(reasoning.end) + p.space() + p.literal(ASSISTANT_MSG)

            if search_tags(after, left) is not None:
                return ContentAnalysis()
    rdiff = diff_reasoning.left
    if reasoning.end and reasoning.end in rdiff:
        rdiff = rdiff[rdiff.find(reasoning.end) + len(reasoning.end) :]
    pure = rdiff if len(rdiff) > len(diff_tools.left) else diff_tools.left
    tags = search_tags(_wrapped(ASSISTANT_MSG, space_in_post=False), pure)
    start, end = get(tags, "pre"), get(tags, "post")
    if start or end:
        return ContentAnalysis(ContentMode.ALWAYS_WRAPPED, start, end)
    return ContentAnalysis()


# ---------------------------------------------------------------------------------------------
# Tool calls
# ---------------------------------------------------------------------------------------------


class _ToolsWork:
    """The tool analysis as it proceeds (frozen parts replaced step by step)."""

    def __init__(self, tmpl: ChatTemplate) -> None:
        self.tmpl = tmpl
        self.format = ToolFormatAnalysis()
        self.function = ToolFunctionAnalysis()
        self.arguments = ToolArgumentsAnalysis()
        self.call_id = ToolIdAnalysis()

    def compare(
        self, first: dict[str, Any], second: dict[str, Any] | None = None
    ) -> CompareResult | None:
        return compare_variants(
            self.tmpl,
            _params(_user(), first),
            _messages(_user(), second) if second is not None else None,
        )

    def frozen(self) -> ToolsAnalysis:
        return ToolsAnalysis(self.format, self.function, self.arguments, self.call_id)

    # -- format --------------------------------------------------------------------------------

    def analyze_tool_calls(self, reasoning: ReasoningAnalysis, parallel: bool) -> None:
        found = self.compare(_assistant(), _with_calls(_FIRST_CALL))
        if found is None or not found.diff.right:
            return
        self.analyze_format(found.diff.right, reasoning, parallel)

    def analyze_format(self, haystack: str, reasoning: ReasoningAnalysis, parallel: bool) -> None:
        def in_json(needle: str) -> bool:
            def quoted(p: ParserBuilder) -> Parser:
                dq = p.tag("dq", p.literal('"') + p.literal(needle) + p.literal('"'))
                return p.choice([p.literal("{"), p.literal(":")]) << p.choice([dq])

            return search_tags(quoted, haystack) is not None

        if in_json(FUN_FIRST):
            mode = ToolFormat.JSON_NATIVE
        elif in_json(ARG_FIRST):
            mode = ToolFormat.TAG_WITH_JSON
        else:
            mode = ToolFormat.TAG_WITH_TAGGED
        self.format = replace(self.format, mode=mode)
        clean = haystack
        if reasoning.start and reasoning.start in haystack:
            pos = haystack.find(reasoning.start)
            clean = haystack[:pos] + haystack[pos + len(reasoning.start) :]
        if reasoning.end and reasoning.end in clean:
            pos = clean.find(reasoning.end)
            clean = clean[:pos] + clean[pos + len(reasoning.end) :]
        if mode is ToolFormat.JSON_NATIVE:
            self.json_native(clean)
            if parallel:
                self.json_native_parallel()
        else:
            self.non_json(clean)
        self.format = replace(
            self.format,
            section_end=trim_whitespace(self.format.section_end),
            per_call_end=trim_whitespace(self.format.per_call_end),
        )

    def json_native(self, clean: str) -> None:
        json_start, json_end = clean.find("{"), clean.rfind("}")
        if json_start < 0:
            raise AnalysisError("tool call analysis: no JSON object in the rendered tool call")
        cut = clean[json_start : json_end + 1]
        try:
            call = json.loads(cut)
        except ValueError as err:
            raise AnalysisError(
                f"tool call analysis: the rendered call is not JSON: {err}"
            ) from err
        if not isinstance(call, dict):
            raise AnalysisError("tool call analysis: the rendered call is not a JSON object")
        fmt = self.format
        fields = {
            "id_field": fmt.id_field,
            "name_field": fmt.name_field,
            "args_field": fmt.args_field,
            "gen_id_field": fmt.gen_id_field,
        }

        def register(prefix: str, key: str, value: Any) -> None:
            path = f"{prefix}.{key}" if prefix else key
            if isinstance(value, str) and "call0000" in value:
                fields["id_field"] = path
            elif isinstance(value, str) and value == FUN_FIRST:
                fields["name_field"] = path
            elif ARG_FIRST in json.dumps(value, ensure_ascii=False, separators=(",", ":")):
                fields["args_field"] = path
            elif "id" in key:
                fields["gen_id_field"] = path  # a generated id field, by its name

        fun_name_is_key, function_field = fmt.fun_name_is_key, fmt.function_field
        for key, value in call.items():
            if key == FUN_FIRST:
                fun_name_is_key = True
                fields["name_field"] = fields["args_field"] = ""
                continue
            dumped = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
            if isinstance(value, dict) and ARG_FIRST not in dumped:
                function_field = key
                for sub_key, sub_value in value.items():
                    register(key, sub_key, sub_value)
            register("", key, value)

        def array(p: ParserBuilder) -> Parser:
            pre = p.tag("pre", p.literal("[") + p.space())
            return pre + p.literal(cut) + p.tag("post", p.space() + p.literal("]"))

        wrapped = search_tags(array, clean)
        if wrapped is not None:
            json_start -= len(wrapped["pre"])
            json_end += len(wrapped["post"])
        json_end += 1
        located = sorted(  # a field not found sorts last (std::string::npos)
            (clean.find(name) if name in clean else len(clean) + 1, name)
            for name in (
                fields["name_field"],
                fields["args_field"],
                fields["id_field"],
                fields["gen_id_field"],
            )
            if name
        )
        section_end = trim_whitespace(clean[json_end:])
        if wrapped is not None and section_end == "]":
            section_end = ""
        self.format = replace(
            fmt,
            fun_name_is_key=fun_name_is_key,
            function_field=function_field,
            tools_array_wrapped=wrapped is not None,
            parameter_order=fmt.parameter_order + tuple(name for _, name in located),
            section_start=trim_leading_whitespace(clean[: max(json_start, 0)]),
            section_end=section_end,
            id_field=fields["id_field"],
            name_field=fields["name_field"],
            args_field=fields["args_field"],
            gen_id_field=fields["gen_id_field"],
        )

    def json_native_parallel(self) -> None:
        found = self.compare(_with_calls(_FIRST_CALL), _with_calls(_FIRST_CALL, _SECOND_CALL))
        if found is None:
            return
        fmt = self.format
        if fmt.section_start and fmt.section_start in found.diff.right:
            self.format = replace(
                fmt,
                per_call_start=fmt.section_start,
                per_call_end=fmt.section_end,
                section_start="",
                section_end="",
            )

    def non_json(self, clean: str) -> None:
        def fun_marker_parser(p: ParserBuilder) -> Parser:
            angle = (
                p.tag("fun_pre", p.literal("<") + p.until_one_of([">", FUN_FIRST]))
                + p.literal(FUN_FIRST)
                + p.tag(
                    "fun_post",
                    p.negate(p.space() + p.literal("<")) + p.until(">") + p.literal(">"),
                )
                + p.space()
            )
            square = (
                p.tag("fun_pre", p.literal("[") + p.until_one_of(["]", FUN_FIRST]))
                + p.literal(FUN_FIRST)
                + p.tag(
                    "fun_post",
                    p.negate(p.space() + p.literal("[") + p.until("]") + p.literal("]"))
                    + p.space(),
                )
            )
            return p.tag("fun_marker", p.choice([angle, square]))

        fun_tags = search_tags(fun_marker_parser, clean)
        fun_marker = fun_tags["fun_marker"] if fun_tags is not None else FUN_FIRST

        def per_tool(p: ParserBuilder) -> Parser:
            starts = p.tag("sec_start", p.marker() + p.space()) + p.tag(
                "call_start", p.marker() + p.space()
            )
            return (
                starts
                + p.tag("fun_pre", p.until(fun_marker))
                + fun_marker
                + p.tag("rest", p.rest())
            )

        def section(p: ParserBuilder) -> Parser:
            sec_start = p.tag("sec_start", p.marker() + p.space())
            return sec_start + fun_marker + p.tag("rest", p.rest())

        def double_closer(p: ParserBuilder) -> Parser:
            call_end = p.tag("call_end", p.marker() + p.space())
            return call_end + p.tag("sec_end", p.marker() + p.space()) + p.end()

        def single_closer(p: ParserBuilder) -> Parser:
            return p.tag("sec_end", p.marker() + p.space()) + p.end()

        tags = search_tags(per_tool, clean)
        if tags is not None:
            end_tags = search_tags(double_closer, tags["rest"])
            self.function = replace(
                self.function, name_prefix=get(fun_tags, "fun_pre") + self.function.name_prefix
            )
        else:
            tags = search_tags(section, clean)
            end_tags = search_tags(single_closer, get(tags, "rest"))
        self.format = replace(
            self.format,
            per_call_start=get(tags, "call_start"),
            per_call_end=get(end_tags, "call_end"),
            section_start=get(tags, "sec_start"),
            section_end=get(end_tags, "sec_end"),
        )

    def per_call_markers(self) -> None:
        found = self.compare(_with_calls(_FIRST_CALL), _with_calls(_FIRST_CALL, _SECOND_CALL))
        if found is None:
            return
        common = calculate_diff_split(found.diff.suffix, found.diff.right)
        second = trim_leading_whitespace(common.right)
        fmt = self.format
        if fmt.section_start and second.startswith(fmt.section_start):
            fmt = replace(
                fmt,
                per_call_start=fmt.section_start,
                per_call_end=fmt.section_end,
                section_start="",
                section_end="",
            )
        if fmt.per_call_end:
            ones = _count(found.output_a, fmt.per_call_end)
            twos = _count(found.output_b, fmt.per_call_end)
            if ones > 0 and ones == twos:
                fmt = replace(fmt, section_end=fmt.per_call_end, per_call_end="")
        self.format = fmt

    # -- function name and closer --------------------------------------------------------------

    def function_markers(self) -> None:
        found = self.compare(_with_calls(_FIRST_CALL), _with_calls(_SECOND_CALL))
        if found is None:
            return
        diff, fmt = found.diff, self.format
        if FUN_FIRST not in diff.left or FUN_SECOND not in diff.right:
            return
        function = self.function
        prefix_marker = fmt.per_call_start or fmt.section_start
        if prefix_marker and prefix_marker in diff.prefix:
            cut = diff.prefix.rfind(prefix_marker) + len(prefix_marker)
            function = replace(function, name_prefix=diff.prefix[cut:])

        def name_parser(p: ParserBuilder) -> Parser:
            post = p.tag("post", p.zero_or_more(p.negate(p.marker()) + p.any()))
            return p.tag("pre", p.until(FUN_FIRST)) + p.literal(FUN_FIRST) + post

        name = match_tags(name_parser, diff.left)
        if name is not None:
            function = replace(
                function,
                name_prefix=function.name_prefix + get(name, "pre"),
                name_suffix=get(name, "post"),
            )
        if fmt.mode is ToolFormat.TAG_WITH_JSON:
            # up to the first { or [ outside a marker, when a marker follows the JSON
            def json_suffix(p: ParserBuilder) -> Parser:
                non_json = p.marker() | (
                    p.negate(p.literal("{")) + p.negate(p.literal("[")) + p.any()
                )
                after_json = p.zero_or_more(p.negate(p.marker()) + p.any()) + p.marker()
                return p.tag("ext", p.zero_or_more(non_json)) + after_json

            ext = match_tags(json_suffix, diff.suffix)
            if ext is not None:
                function = replace(function, name_suffix=function.name_suffix + get(ext, "ext"))
        else:

            def tagged_suffix(p: ParserBuilder) -> Parser:
                return p.tag("ext", p.zero_or_more(p.negate(p.marker()) + p.any()))

            ext = match_tags(tagged_suffix, diff.suffix)
            if ext is not None:
                ext_text = get(ext, "ext")
                function = replace(function, name_suffix=function.name_suffix + ext_text)

                def arg_start(p: ParserBuilder) -> Parser:
                    names = p.choice([p.literal(ARG_FIRST), p.literal(ARG_SECOND)])
                    return p.marker() + p.space() + names

                def separator(p: ParserBuilder) -> Parser:
                    sep = p.zero_or_more(p.negate(arg_start(p)) + p.any())
                    return p.tag("sep", sep) + arg_start(p)

                sep = match_tags(separator, diff.suffix[len(ext_text) :])
                if sep is not None:
                    function = replace(function, args_separator=trim_whitespace(get(sep, "sep")))
        suffix_marker = fmt.per_call_end or fmt.section_end
        closer_suffix = ""
        if not suffix_marker:
            no_call = compare_variants(
                self.tmpl,
                _params(_user(), _with_calls(_FIRST_CALL)),
                _messages(_user(), _assistant()),
            )
            if no_call is not None:
                left = no_call.diff.left
                at = left.find("YYYY")
                closer_suffix = left[at + 4 :] if at >= 0 else left[3:]
        else:
            at = diff.suffix.find(suffix_marker)
            closer_suffix = diff.suffix[: at if at >= 0 else len(diff.suffix)]
        if closer_suffix:
            if fmt.mode is ToolFormat.TAG_WITH_TAGGED:

                def closer(p: ParserBuilder) -> Parser:
                    value = p.until("YYYY") + p.literal("YYYY") + p.space()
                    return value + p.marker() + p.space() + p.tag("close", p.rest())

                close = match_tags(closer, closer_suffix)
                if close is not None:
                    function = replace(function, close=get(close, "close"))
            elif fmt.mode is ToolFormat.TAG_WITH_JSON:

                def post_value(p: ParserBuilder) -> Parser:
                    value = p.until("YYYY") + p.literal("YYYY")
                    return value + p.tag("post_val", p.rest())

                close = match_tags(post_value, closer_suffix)
                if close is not None:
                    post = get(close, "post_val")
                    pos = max(post.rfind("}"), post.rfind("]"))
                    if 0 <= pos < len(post) - 1:
                        function = replace(function, close=trim_leading_whitespace(post[pos + 1 :]))
        self.function = replace(function, close=trim_leading_whitespace(function.close))

    # -- arguments -----------------------------------------------------------------------------

    def argument_name_markers(self) -> None:
        found = self.compare(_with_calls(_CALL_ONE_ARG), _with_calls(_CALL_OTHER_ARG))
        if found is None:
            return
        diff = found.diff
        if not diff.left or not diff.right:
            return

        def named(needle: str, value: str) -> Callable[[ParserBuilder], Parser]:
            def build(p: ParserBuilder) -> Parser:
                pre = p.tag("pre", p.until(needle)) + p.literal(needle)
                return pre + p.tag("suffix", p.until_one_of(['"', value]))

            return build

        left = search_tags(named(ARG_FIRST, "X"), diff.left)
        right = search_tags(named(ARG_SECOND, "Y"), diff.right)
        if (
            left is not None
            and right is not None
            and get(left, "pre")
            and get(left, "pre") == get(right, "pre")
            and get(left, "suffix") == get(right, "suffix")
        ):
            self.arguments = replace(
                self.arguments, name_prefix=get(left, "pre"), name_suffix=get(left, "suffix")
            )
        elif diff.left.startswith(ARG_FIRST) and diff.right.startswith(ARG_SECOND):
            pre = match_tags(_up_to_last_marker("m", whole=True), diff.prefix)
            name_prefix = get(pre, "m") if pre is not None else diff.prefix
            after_first = diff.left[len(ARG_FIRST) :] + diff.suffix

            def suffix_parser(p: ParserBuilder) -> Parser:
                text = p.zero_or_more(p.negate(p.marker()) + p.any())
                return p.tag("suffix", text + p.marker() + p.space())

            suffix = search_tags(suffix_parser, after_first)
            self.arguments = replace(
                self.arguments,
                name_prefix=name_prefix,
                name_suffix=get(suffix, "suffix")
                if suffix is not None
                else self.arguments.name_suffix,
            )

    def argument_value_markers(self) -> None:
        found = self.compare(_with_calls(_CALL_ONE_ARG), _with_calls(_CALL_ONE_ARG_OTHER_VAL))
        if found is None:
            return
        diff = found.diff
        if diff.left != "XXXX" or diff.right != "YYYY":
            return
        args = self.arguments
        name_ending = ARG_FIRST + args.name_suffix
        prefix = diff.prefix
        if name_ending in prefix:
            prefix = prefix[prefix.rfind(name_ending) + len(name_ending) :]
        if prefix:
            pre = match_tags(_up_to_last_marker("m", whole=True), prefix)
            args = replace(args, value_prefix=get(pre, "m") if pre is not None else prefix)
        value_suffix = diff.suffix
        if self.function.close:
            at = value_suffix.find(self.function.close)
            if at >= 0:
                value_suffix = value_suffix[:at]
        elif self.format.per_call_end or self.format.section_end:
            end_marker = self.format.per_call_end or self.format.section_end
            at = value_suffix.find(end_marker)
            if at >= 0:
                value_suffix = value_suffix[:at]
        if trim_whitespace(value_suffix):
            args = replace(args, value_suffix=value_suffix)
        self.arguments = args

    def argument_separator(self) -> None:
        found = self.compare(_with_calls(_CALL_ONE_ARG), _with_calls(_FIRST_CALL))
        if found is not None and found.diff.right:
            self.arguments = replace(
                self.arguments,
                separator=until_common_prefix(found.diff.right, ARG_FIRST, ARG_SECOND),
            )

    def args_markers(self) -> None:
        found = self.compare(_with_calls(_CALL_ZERO_ARGS), _with_calls(_CALL_ONE_ARG))
        if found is None or self.format.mode is not ToolFormat.JSON_NATIVE:
            return
        diff, fmt = found.diff, self.format
        prefix_marker = fmt.section_start or fmt.per_call_start
        suffix_marker = fmt.section_end or fmt.per_call_end
        prefix_pos = diff.prefix.rfind(prefix_marker) if prefix_marker else 0
        suffix_pos = diff.suffix.find(suffix_marker) if suffix_marker else len(diff.suffix)
        prefix_pos = max(prefix_pos, 0)
        if suffix_pos < 0:
            suffix_pos = len(diff.suffix)
        prefix_cut = diff.prefix[prefix_pos + len(prefix_marker) :]
        suffix_cut = diff.suffix[:suffix_pos]
        args_start = until_common_prefix(prefix_cut, "{}", '{"first":')
        args_end = after_common_suffix(suffix_cut, "{}", '"XXXX"}')
        if args_start or args_end:
            if FUN_FIRST in args_start:
                args_start = args_start[args_start.find(FUN_FIRST) + len(FUN_FIRST) :]
            if CALL_ID_001 in args_start:
                args_start = args_start[args_start.find(CALL_ID_001) + len(CALL_ID_001) :]
            self.arguments = replace(self.arguments, start=args_start, end=args_end)

    # -- call ids ------------------------------------------------------------------------------

    def call_id_markers(self) -> None:
        found = self.compare(_with_calls(_FIRST_CALL), _with_calls(_FIRST_CALL_ALT_ID))
        if found is None:
            return
        diff = found.diff
        if not diff.left and not diff.right:
            return
        common_len = 0
        for a, b in zip(CALL_ID_001, CALL_ID_999, strict=True):
            if a != b:
                break
            common_len += 1
        common_id = CALL_ID_001[:common_len]
        in_prefix = diff.prefix.rfind(FUN_FIRST)
        in_suffix = diff.suffix.find(FUN_FIRST)
        call_id = self.call_id

        def last_of(text: str) -> str:
            return get(search_tags(_up_to_last_marker("m", whole=False), text), "m")

        def first_of(text: str) -> str:
            return get(search_tags(_first_marker, text), "m")

        if in_prefix >= 0 and in_suffix < 0:
            args_in_prefix = diff.prefix.find("{", in_prefix)
            args_in_suffix = diff.suffix.find("{")
            if args_in_suffix >= 0 and args_in_prefix < 0:
                after_func = diff.prefix[in_prefix + len(FUN_FIRST) :]

                def id_prefix_parser(p: ParserBuilder) -> Parser:
                    text = p.negate(p.marker()) + p.negate(p.literal(common_id)) + p.any()
                    prefix = p.tag("prefix", p.marker()) + p.zero_or_more(text)
                    return prefix + p.literal(common_id)

                def id_suffix_parser(p: ParserBuilder) -> Parser:
                    text = p.negate(p.marker()) + p.negate(p.literal("{")) + p.any()
                    return p.zero_or_more(text) + p.tag("suffix", p.marker())

                id_prefix = search_tags(id_prefix_parser, after_func)
                id_suffix = search_tags(id_suffix_parser, diff.suffix)
                call_id = ToolIdAnalysis(
                    CallIdPosition.BETWEEN_FUNC_AND_ARGS,
                    get(id_prefix, "prefix") if id_prefix is not None else last_of(after_func),
                    get(id_suffix, "suffix") if id_suffix is not None else call_id.suffix,
                )
            elif args_in_prefix >= 0:
                after_args = diff.prefix[args_in_prefix:]
                brace = after_args.rfind("}")
                prefix = last_of(after_args[brace + 1 :]) if brace >= 0 else call_id.prefix
                call_id = ToolIdAnalysis(CallIdPosition.POST_ARGS, prefix, first_of(diff.suffix))
        elif in_suffix >= 0 and in_prefix < 0:
            call_id = ToolIdAnalysis(
                CallIdPosition.PRE_FUNC_NAME,
                last_of(diff.prefix),
                first_of(diff.suffix[:in_suffix]),
            )
        if call_id.prefix == self.arguments.end:
            call_id = replace(call_id, prefix="")
        if call_id.suffix == self.arguments.start:
            call_id = replace(call_id, suffix="")
        self.call_id = call_id
        if (
            call_id.pos is not CallIdPosition.NONE
            and call_id.suffix
            and self.format.per_call_end.startswith(call_id.suffix)
        ):
            self.format = replace(self.format, per_call_end="")


def _count(haystack: str, needle: str) -> int:
    return haystack.count(needle) if needle else 0


def analyze_tools(tmpl: ChatTemplate, caps: Caps, reasoning: ReasoningAnalysis) -> ToolsAnalysis:
    """How the template writes tool calls (analyze_tools); the format NONE when it writes none."""
    work = _ToolsWork(tmpl)
    work.analyze_tool_calls(reasoning, caps.supports_parallel_tool_calls)
    if work.format.mode not in (ToolFormat.NONE, ToolFormat.JSON_NATIVE):
        if caps.supports_parallel_tool_calls:
            work.per_call_markers()
        work.function_markers()
        if work.format.mode is ToolFormat.TAG_WITH_TAGGED:
            work.argument_name_markers()
            work.argument_value_markers()
        work.argument_separator()
        work.args_markers()
        work.call_id_markers()
    return work.frozen()


# ---------------------------------------------------------------------------------------------
# Role markers
# ---------------------------------------------------------------------------------------------


def detect_assistant_start(tmpl: ChatTemplate, reasoning: ReasoningAnalysis) -> str:
    found = compare_variants(tmpl, _params(_user(), tools=False), _messages(_user(), _assistant()))
    if found is None:
        return ""
    block = found.diff.right
    at = block.find(ASSISTANT_MSG)
    prefix = block[:at] if at >= 0 else block
    for marker in (reasoning.start, reasoning.end):
        trimmed = trim_whitespace(marker)
        if marker and trimmed in prefix:
            prefix = prefix[: prefix.find(trimmed)]
    return trim_whitespace(prefix)


def detect_user_start(tmpl: ChatTemplate) -> str:
    found = compare_variants(tmpl, _params(tools=False), _messages(_user()))
    if found is None:
        found = compare_variants(
            tmpl,
            _params(_user(USER_MSG_TWO), _assistant(), tools=False),
            _messages(_user(USER_MSG_TWO), _assistant(), _user()),
        )
        if found is None:
            return ""
    block = found.diff.right
    if ASSISTANT_MSG in block:
        block = block[block.find(ASSISTANT_MSG) + len(ASSISTANT_MSG) :]
    at = block.find(USER_MSG)
    candidate = block[:at] if at >= 0 else block
    result, seen_marker = "", False
    for seg in segmentize_markers(candidate):
        lower = seg.value.lower()
        if seg.type == MARKER and not seen_marker and ("end" in lower or "close" in lower):
            continue  # an end marker of the turn before, at the start
        if seg.type != MARKER and not seen_marker and not trim_whitespace(seg.value):
            continue
        seen_marker = seen_marker or seg.type == MARKER
        result += seg.value
    return trim_whitespace(result)


# ---------------------------------------------------------------------------------------------
# The whole analysis
# ---------------------------------------------------------------------------------------------


@dataclass
class _Analysis:
    """The analysis while the workarounds adjust it."""

    caps: Caps
    user_start: str
    assistant_start: str
    reasoning: ReasoningAnalysis
    content: ContentAnalysis
    tools: ToolsAnalysis
    preserved_tokens: list[str]
    additional_stops: list[str] = field(default_factory=list)

    def frozen(self) -> TemplateAnalysis:
        return TemplateAnalysis(
            jinja_caps=self.caps,
            user_start=self.user_start,
            assistant_start=self.assistant_start,
            reasoning=self.reasoning,
            content=self.content,
            tools=self.tools,
            preserved_tokens=tuple(self.preserved_tokens),
            additional_stops=tuple(self.additional_stops),
        )


def _preserved_tokens(
    reasoning: ReasoningAnalysis, content: ContentAnalysis, tools: ToolsAnalysis
) -> list[str]:
    fmt, fn, args, cid = tools.format, tools.function, tools.arguments, tools.call_id
    tokens: list[str] = []
    for marker in (
        reasoning.start,
        reasoning.end,
        content.start,
        content.end,
        fmt.section_start,
        fmt.section_end,
        fmt.per_call_start,
        fmt.per_call_end,
        fn.name_prefix,
        fn.name_suffix,
        fn.args_separator,
        fn.close,
        args.start,
        args.end,
        args.name_prefix,
        args.name_suffix,
        args.separator,
        args.value_prefix,
        args.value_suffix,
        cid.prefix,
        cid.suffix,
    ):
        token = trim_whitespace(marker)
        if token and token not in tokens:
            tokens.append(token)
    return tokens


def _with_tools(a: _Analysis, **changes: Any) -> None:
    parts = {
        "format": a.tools.format,
        "function": a.tools.function,
        "arguments": a.tools.arguments,
        "call_id": a.tools.call_id,
    }
    for path, value in changes.items():
        part, name = path.split("__")
        parts[part] = replace(parts[part], **{name: value})  # type: ignore[type-var]
    a.tools = ToolsAnalysis(**parts)  # type: ignore[arg-type]


def _think_tags(a: _Analysis, start: str = "<think>", end: str = "</think>") -> None:
    a.reasoning = ReasoningAnalysis(ReasoningMode.TAG_BASED, start, end)


def _apply_workarounds(src: str, a: _Analysis) -> None:
    """llama.cpp's fixed answers for templates the analysis reads wrongly, in its order."""
    if (
        "content.split('</think>')" in src
        and "reasoning_content" not in src
        and "<SPECIAL_12>" not in src
        and a.reasoning.mode is ReasoningMode.NONE
    ):
        # old Qwen/DeepSeek thinking templates: no reasoning rendered, but the model thinks
        _think_tags(a)
        a.preserved_tokens += ["<think>", "</think>"]
    if (
        "Write your thoughts between <think></think> and write your response between "
        "<response></response>" in src
    ):  # Granite 3.3
        _think_tags(a)
        a.content = ContentAnalysis(ContentMode.WRAPPED_WITH_REASONING, "<response>", "</response>")
        a.preserved_tokens += ["<think>", "</think>", "<response>", "</response>"]
    if "<|CHATBOT_TOKEN|>" in src and "<|END_OF_TURN_TOKEN|>" in src and not a.content.start:
        # Cohere Command R+
        a.content = replace(
            a.content,
            mode=ContentMode.ALWAYS_WRAPPED,
            start="<|CHATBOT_TOKEN|>",
            end="<|END_OF_TURN_TOKEN|>",
        )
        a.preserved_tokens += ["<|CHATBOT_TOKEN|>", "<|END_OF_TURN_TOKEN|>"]
        a.user_start = "<|START_OF_TURN_TOKEN|><|USER_TOKEN|>"
    if (
        'set has_code_interpreter = tools | selectattr("type", "equalto", '
        '"code_interpreter") | list | length > 0' in src
    ):  # Functionary 3.1: no section delimiter
        a.content = replace(a.content, mode=ContentMode.PLAIN, end="")
        _with_tools(
            a,
            function__name_prefix="",
            format__section_start="",
            format__section_end="",
            format__per_call_start="<function=",
            format__per_call_end="</function>",
            function__close="",
        )
        a.preserved_tokens = ["<|eot_id|>", "<|eom_id|>", "<function=", ">", "</function>"]
    if (
        "{{'<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>'"
        in src
    ):  # DeepSeek-R1-Distill-Qwen
        _with_tools(
            a,
            format__section_start="<｜tool▁calls▁begin｜>",
            format__section_end="<｜tool▁calls▁end｜>",
            format__per_call_start="<｜tool▁call▁begin｜>function",
            function__name_prefix="<｜tool▁sep｜>",
            format__per_call_end="<｜tool▁call▁end｜>",
            function__close="```",
        )
    if all(m in src for m in ("<SPECIAL_10>", "<SPECIAL_11>", "<SPECIAL_12>", "<TOOL_RESPONSE>")):
        # Nemotron Nano v2
        _with_tools(
            a,
            format__mode=ToolFormat.JSON_NATIVE,
            format__section_start="",
            format__section_end="",
            format__per_call_start="<TOOLCALL>",
            format__per_call_end="</TOOLCALL>",
            format__tools_array_wrapped=True,
        )
        a.content = replace(a.content, mode=ContentMode.PLAIN, start="", end="")
        _think_tags(a, "<think>\n", "</think>")
        a.assistant_start = "<SPECIAL_11>Assistant"
        a.user_start = "<SPECIAL_11>User"
        a.preserved_tokens = ["<SPECIAL_11>", "</think>", "<TOOLCALL>", "</TOOLCALL>"]
    if (
        "{%- set system_prompt = '<|start_header_id|>' + 'system' + '<|end_header_id|>\\n\\n'"
        " + message['content'] | trim + '\\n' + system_prompt_suffix + '<|eot_id|>' -%}" in src
    ):  # Fireworks
        a.assistant_start = "<|start_header_id|>assistant<|end_header_id|>"
        a.user_start = "<|start_header_id|>user<|end_header_id|>"
    if "<|begin|>assistant<|think|><|end|>" in src:  # Solar Open
        a.assistant_start = "<|begin|>assistant"
    if "if not loop.last and '[BEGIN FINAL RESPONSE]' in asst_text" in src:  # Apriel 1.6
        a.user_start = "<|begin_user|>"
        a.assistant_start = "<|begin_assistant|>"
    if 'Respond in the format {"name": function name' in src and "Do not use variables." in src:
        _with_tools(a, format__openai_wrapper_trigger=True)
    if "laguna_glm_thinking" in src:
        # Laguna: the template's delimiters carry formatting whitespace the model does not write
        a.reasoning = replace(
            a.reasoning,
            start=trim_whitespace(a.reasoning.start),
            end=trim_whitespace(a.reasoning.end),
        )
        args = a.tools.arguments
        _with_tools(
            a,
            arguments__value_prefix=trim_whitespace(args.value_prefix),
            arguments__value_suffix=trim_whitespace(args.value_suffix),
            arguments__separator=trim_whitespace(args.separator),
            arguments__tolerate_intertag_whitespace=True,
        )
        a.additional_stops.append("</assistant>")
    if "Bailing V3 chat template" in src:
        _with_tools(
            a,
            arguments__value_suffix=trim_whitespace(a.tools.arguments.value_suffix),
            arguments__tolerate_intertag_whitespace=True,
        )


def analyze_template(tmpl: ChatTemplate) -> TemplateAnalysis:
    """The differential analysis of a template (llama.cpp's ``autoparser::analyze_template``).

    Renders ``tmpl`` (with its BOS/EOS texts) some twenty times; raises :class:`AnalysisError`
    where llama-server cannot build a parser for the template either."""
    caps = tmpl.caps
    reasoning = analyze_reasoning(tmpl, caps.supports_tool_calls)
    content = analyze_content(tmpl, reasoning)
    tools = analyze_tools(tmpl, caps, reasoning) if caps.supports_tool_calls else ToolsAnalysis()
    work = _Analysis(
        caps=caps,
        assistant_start=detect_assistant_start(tmpl, reasoning),
        user_start=detect_user_start(tmpl),
        reasoning=reasoning,
        content=content,
        tools=tools,
        preserved_tokens=_preserved_tokens(reasoning, content, tools),
    )
    _apply_workarounds(tmpl.source, work)
    return work.frozen()
