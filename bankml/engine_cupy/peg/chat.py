"""The chat layer of the PEG parser: llama-server's common_chat_peg_builder, its mappers and
common_chat_peg_parse (common/chat-peg-parser.cpp, common/chat.cpp).

A chat template's answer parser is an arena built with ``ChatPegBuilder``: the generic parsers
plus tags that say what a match is (reasoning, content, a tool call's name, id, arguments or one
argument's name and value) and the usual tool-call layouts (JSON objects, tagged XML-like calls,
Python-style calls). ``chat_peg_parse`` runs it on the generation prompt plus the model's output,
full or partial (streaming), and a mapper turns the AST into the assistant message llama-server
answers with: ``content``, ``reasoning_content`` and ``tool_calls`` whose ``arguments`` are the
JSON text llama-server writes (the model's own text for a JSON object, built up argument by
argument for tagged formats, quotes and braces closed while a call is still streaming).

Public API (C++ names in snake_case)::

    ChatPegBuilder(ParserBuilder)
        tags: REASONING_BLOCK REASONING CONTENT TOOL TOOL_OPEN TOOL_CLOSE TOOL_ID TOOL_NAME
              TOOL_ARGS TOOL_ARG TOOL_ARG_OPEN TOOL_ARG_CLOSE TOOL_ARG_NAME TOOL_ARG_VALUE
              TOOL_ARG_STRING_VALUE
        reasoning_block(p) reasoning(p) content(p) tag_with_safe_content(tag, marker, p)
        tool(p) tool_open(p) tool_close(p) tool_id(p) tool_name(p) tool_args(p) tool_arg(p)
        tool_arg_open(p) tool_arg_close(p) tool_arg_name(p) tool_arg_value(p)
        tool_arg_string_value(p) tool_arg_json_value(p)       (open/close/id/name are atomic)
        permute(rule_prefix, parsers)  prefix(s, delimiter="")  optspace(tag)
        standard_json_tools(section_start, section_end, tools, parallel_tool_calls,
                            force_tool_calls, name_key="", args_key="", array_wrapped=False,
                            function_is_key=False, call_id_key="", gen_call_id_key="",
                            parameters_order=(), accept_openai_wrapper=False)
        standard_constructed_tools(markers, tools, parallel_tool_calls, force_tool_calls)
        python_style_tool_calls(tools, parallel_tool_calls, allow_json_literals)
    build_chat_peg_parser(fn) -> Arena
    ChatMsg(role, content, reasoning_content, tool_calls)   ChatToolCall(name, arguments, id)
    ChatPegMapper(msg).from_ast(ast, result)   (Gemma4Mapper, MinimaxM3Mapper: their formats)
    ChatFormat   CONTENT_ONLY PEG_SIMPLE PEG_NATIVE PEG_GEMMA4 PEG_MINIMAX_M3 (their names)
    chat_peg_parse(arena, output, is_partial, generation_prompt="", format=PEG_NATIVE,
                   debug=False) -> ChatMsg; raises ChatParseError (llama-server's text)
    tool_parameters(function) -> dict   (common_chat_tool_parameters)
    TaggedPegParser(arena).parse_and_extract(text, flags) / parse_anywhere_and_extract(text)
    build_tagged_peg_parser(fn)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from functools import partial
from typing import Any

from bankml.engine_cupy.json_schema_grammar import dump_json
from bankml.engine_cupy.peg.parser import (
    INVALID_ID,
    Arena,
    AstArena,
    AstNode,
    ParseContext,
    ParseFlags,
    Parser,
    ParserBuilder,
    ParseResult,
)

MAX_PERMUTE = 6  # COMMON_CHAT_MAX_PERMUTE

_C_SPACE = " \t\n\v\f\r"


class ChatFormat(str, Enum):
    """llama-server's chat formats, valued by their names (common_chat_format_name)."""

    CONTENT_ONLY = "Content-only"
    PEG_SIMPLE = "peg-simple"
    PEG_NATIVE = "peg-native"
    PEG_GEMMA4 = "peg-gemma4"
    PEG_MINIMAX_M3 = "peg-minimax-m3"


@dataclass
class ChatToolCall:
    name: str = ""
    arguments: str = ""  # JSON text
    id: str = ""


@dataclass
class ChatMsg:
    role: str = ""
    content: str = ""
    reasoning_content: str = ""
    tool_calls: list[ChatToolCall] = field(default_factory=list)


class ChatParseError(RuntimeError):
    """Output the chat parser cannot read; the message is llama-server's."""


def tool_parameters(function: Mapping[str, Any]) -> Any:
    """A tool's parameters schema; an object without properties when absent or empty."""
    params = function.get("parameters")
    if "parameters" in function and params is not None and params != {}:
        return params
    return {"type": "object", "properties": {}}


def _json_text(value: str) -> str:
    return dump_json(value)


def _escape_json_string_inner(text: str) -> str:
    return _json_text(text)[1:-1]


def _trim_trailing(text: str, limit: int = -1) -> str:
    count = 0
    while text and text[-1] in _C_SPACE and (limit == -1 or count < limit):
        text = text[:-1]
        count += 1
    return text


def _trim(text: str) -> str:
    if text and text[0] in _C_SPACE:
        text = text[1:]
    return _trim_trailing(text)


def _json_brace_depth(text: str) -> int:
    """Unclosed ``{`` of a JSON-like text, braces inside strings not counted."""
    depth = 0
    in_string = escaped = False
    for c in text:
        if escaped:
            escaped = False
            continue
        if c == "\\" and in_string:
            escaped = True
            continue
        if c == '"':
            in_string = not in_string
            continue
        if not in_string:
            if c == "{":
                depth += 1
            elif c == "}":
                depth -= 1
    return depth


def _is_word_char(c: str) -> bool:
    return (c.isascii() and c.isalnum()) or c == "_"


_PY_LITERALS = (("True", "true"), ("False", "false"), ("None", "null"))


def normalize_quotes_to_json(text: str) -> str:
    """Python-style single-quoted strings and True/False/None as JSON (prefixes too, so that a
    streamed value grows monotonically)."""
    out: list[str] = []
    in_single = in_double = False
    i = 0
    n = len(text)
    while i < n:
        c = text[i]
        if c == "\\" and i + 1 < n:
            nxt = text[i + 1]
            if in_single:
                if nxt == "'":
                    out.append("'")
                elif nxt == '"':
                    out.append('\\"')
                else:
                    out.append(c + nxt)
                i += 2
                continue
            if in_double:
                out.append(c + nxt)
                i += 2
                continue
            out.append(c)
            i += 1
            continue
        if c == '"':
            if in_single:
                out.append('\\"')
            else:
                in_double = not in_double
                out.append(c)
        elif c == "'":
            if in_double:
                out.append(c)
            else:
                in_single = not in_single
                out.append('"')
        elif (
            not in_single
            and not in_double
            and c in "TFN"
            and (i == 0 or not _is_word_char(text[i - 1]))
        ):
            k = 0
            while i + k < n and _is_word_char(text[i + k]):
                k += 1
            token = text[i : i + k]
            for py, js in _PY_LITERALS:
                if py[:k] == token:
                    out.append(js[:k])
                    i += k - 1
                    break
            else:
                out.append(c)
        else:
            out.append(c)
        i += 1
    return "".join(out)


# --- the mappers ---------------------------------------------------------------------------------


class ChatPegMapper:
    """The AST of a chat parse as a message (common_chat_peg_mapper)."""

    def __init__(self, msg: ChatMsg):
        self.result = msg
        self.pending_tool_call: ChatToolCall | None = None
        self.current_tool: ChatToolCall | None = None
        self.arg_count = 0
        self.closing_quote_pending = False
        self.args_buffer = ""

    # the arguments text written to: the buffer until the call has a name
    def _args(self) -> str:
        tool = self.current_tool
        return tool.arguments if tool is not None and tool.name else self.args_buffer

    def _set_args(self, text: str) -> None:
        tool = self.current_tool
        if tool is not None and tool.name:
            tool.arguments = text
        else:
            self.args_buffer = text

    def normalize_container_value(self, text: str) -> str:
        return normalize_quotes_to_json(text)

    def from_ast(self, arena: AstArena, result: ParseResult) -> None:
        arena.visit(result, self.map)
        pending = self.pending_tool_call
        if pending is not None and pending.name:
            if self.args_buffer:
                pending.arguments = self.args_buffer
            if self.closing_quote_pending and pending.arguments:
                pending.arguments += '"'
            self.result.tool_calls.append(pending)
            self.pending_tool_call = None
        # whitespace-only reasoning (an empty <think></think> prefill, say) is none
        if self.result.reasoning_content and not self.result.reasoning_content.strip(" \n\r\t"):
            self.result.reasoning_content = ""

    def map(self, node: AstNode) -> None:
        tag = node.tag
        B = ChatPegBuilder
        if tag == B.REASONING:
            self.result.reasoning_content += node.sanitized_text()
        if tag == B.CONTENT:
            self.result.content += node.sanitized_text()

        if tag == B.TOOL_OPEN:
            self.pending_tool_call = ChatToolCall()
            self.current_tool = self.pending_tool_call
            self.arg_count = 0
            self.args_buffer = ""
            self.closing_quote_pending = False

        tool = self.current_tool
        if tag == B.TOOL_ID and tool is not None:
            text = _trim_trailing(node.text)
            if len(text) >= 2 and text[0] == '"' and text[-1] == '"':
                text = text[1:-1]
            tool.id = text

        if tag == B.TOOL_NAME and tool is not None:
            tool.name = _trim_trailing(node.text)
            if self.args_buffer:
                tool.arguments = self.args_buffer
                self.args_buffer = ""
            elif not tool.arguments:
                tool.arguments = "{"
            if self.pending_tool_call is not None:
                self.result.tool_calls.append(self.pending_tool_call)
                self.pending_tool_call = None
                self.current_tool = self.result.tool_calls[-1]

        tool = self.current_tool
        if tag == B.TOOL_ARGS and tool is not None:
            text = _trim_trailing(node.text)
            if text.startswith("{"):
                self._set_args(text)

        if tag == B.TOOL_ARG_OPEN:
            self.closing_quote_pending = False

        if tag == B.TOOL_ARG_NAME and tool is not None:
            entry = "," if self.arg_count > 0 else ""
            entry += _json_text(_trim(node.text)) + ":"
            self.arg_count += 1
            self._set_args((self._args() or "{") + entry)

        is_string_value = tag == B.TOOL_ARG_STRING_VALUE
        if (tag == B.TOOL_ARG_VALUE or is_string_value) and tool is not None:
            value = node.text
            add = ""
            if not value and is_string_value:
                add = '"'
                self.closing_quote_pending = True
            elif value and is_string_value:
                if not self.closing_quote_pending:
                    add = '"'
                    self.closing_quote_pending = True
                add += _escape_json_string_inner(value)
            elif value:
                add = self.normalize_container_value(value)
            self._set_args(self._args() + add)

        if tag == B.TOOL_ARG_CLOSE and tool is not None and self.closing_quote_pending:
            self._set_args(self._args() + '"')
            self.closing_quote_pending = False

        if tag == B.TOOL_CLOSE and tool is not None:
            if not tool.name and self.args_buffer:
                tool.arguments = self.args_buffer
                self.args_buffer = ""
            if self.closing_quote_pending:
                tool.arguments += '"'
                self.closing_quote_pending = False
            tool.arguments += "}" * max(0, _json_brace_depth(tool.arguments))
            if self.pending_tool_call is not None:
                if tool.name:
                    self.result.tool_calls.append(self.pending_tool_call)
                self.pending_tool_call = None
                self.current_tool = None


def _gemma4_to_json(arena: AstArena, node_id: int) -> str:
    node = arena.get(node_id)
    if not node.raw:
        return ""
    rule = node.rule
    if rule in ("gemma4-number", "gemma4-bool", "gemma4-null", "gemma4-dict-key-name"):
        return node.text
    if rule == "gemma4-string-content":
        return _escape_json_string_inner(node.text)
    if rule == "gemma4-string":
        out = '"'
        if node.children:
            out += _gemma4_to_json(arena, node.children[0])
            if not node.is_partial:
                out += '"'
        return out
    if rule in ("gemma4-array", "gemma4-dict"):
        opening, closing = ("[", "]") if rule == "gemma4-array" else ("{", "}")
        out = opening + ",".join(_gemma4_to_json(arena, c) for c in node.children)
        return out if node.is_partial else out + closing
    if rule == "gemma4-dict-key":
        out = '"'
        if node.children:
            out += _escape_json_string_inner(_gemma4_to_json(arena, node.children[0]))
        return out if node.is_partial else out + '":'
    if rule == "gemma4-dict-kv":
        return "".join(_gemma4_to_json(arena, c) for c in node.children)
    if rule == "gemma4-value":
        return _gemma4_to_json(arena, node.children[0]) if node.children else ""
    return ""


class Gemma4Mapper(ChatPegMapper):
    """Gemma 4's tool-call values (its own literal syntax) as JSON."""

    def from_ast(self, arena: AstArena, result: ParseResult) -> None:
        for node_id in result.nodes:
            self._visit(arena, node_id)

    def _visit(self, arena: AstArena, node_id: int) -> None:
        node = arena.get(node_id)
        if node.tag == "reasoning":
            self.result.reasoning_content += node.sanitized_text()
            return
        if node.tag == "content":
            self.result.content += node.sanitized_text()
            return
        if node.tag == "tool":
            name_id = arena.find_by_tag(node, "tool-name")
            args_id = arena.find_by_tag(node, "tool-args")
            if name_id != INVALID_ID and args_id != INVALID_ID:
                name_node = arena.get(name_id)
                args_node = arena.get(args_id)
                if not name_node.is_partial:
                    call = ChatToolCall(name=name_node.text)
                    if args_node.children:
                        call.arguments = _gemma4_to_json(arena, args_node.children[0])
                    self.result.tool_calls.append(call)
            return
        for child in node.children:
            self._visit(arena, child)


TOOL_ARG_OBJECT = "tool-arg-object"
TOOL_ARG_ARRAY = "tool-arg-array"
TOOL_ARG_ITEM = "tool-arg-item"


def _mm3_collect(arena: AstArena, node: AstNode, tag: str, out: list[int]) -> None:
    for child_id in node.children:
        child = arena.get(child_id)
        if child.tag == tag:
            out.append(child_id)
        else:
            _mm3_collect(arena, child, tag, out)


def _mm3_value_of(arena: AstArena, node: AstNode) -> int:
    value_tags = (
        ChatPegBuilder.TOOL_ARG_VALUE,
        ChatPegBuilder.TOOL_ARG_STRING_VALUE,
        TOOL_ARG_OBJECT,
        TOOL_ARG_ARRAY,
    )
    for child_id in node.children:
        if arena.get(child_id).tag in value_tags:
            return child_id
    return INVALID_ID


def _mm3_container(arena: AstArena, node: AstNode, is_object: bool, closed: bool) -> str:
    entries: list[int] = []
    _mm3_collect(arena, node, ChatPegBuilder.TOOL_ARG if is_object else TOOL_ARG_ITEM, entries)
    parts = []
    for entry_id in entries:
        entry = arena.get(entry_id)
        if is_object:
            name_id = arena.find_by_tag(entry, ChatPegBuilder.TOOL_ARG_NAME)
            if name_id == INVALID_ID:
                continue
            text = (
                _json_text(arena.get(name_id).text)
                + ":"
                + _mm3_value(arena, _mm3_value_of(arena, entry), not entry.is_partial)
            )
        else:
            text = _mm3_value(arena, _mm3_value_of(arena, entry), not entry.is_partial)
        if text:
            parts.append(text)
    out = ("{" if is_object else "[") + ",".join(parts)
    if closed:
        out += "}" if is_object else "]"
    return out


def _mm3_value(arena: AstArena, node_id: int, closed: bool) -> str:
    if node_id == INVALID_ID:
        return ""
    node = arena.get(node_id)
    if node.tag == TOOL_ARG_OBJECT:
        return _mm3_container(arena, node, True, closed)
    if node.tag == TOOL_ARG_ARRAY:
        return _mm3_container(arena, node, False, closed)
    if node.tag == ChatPegBuilder.TOOL_ARG_STRING_VALUE:
        return '"' + _escape_json_string_inner(node.text) + ('"' if closed else "")
    return node.text  # numbers and booleans as the template writes them


class MinimaxM3Mapper(ChatPegMapper):
    """MiniMax-M3's nested XML-like arguments as JSON."""

    TOOL_ARG_OBJECT = TOOL_ARG_OBJECT
    TOOL_ARG_ARRAY = TOOL_ARG_ARRAY
    TOOL_ARG_ITEM = TOOL_ARG_ITEM

    def from_ast(self, arena: AstArena, result: ParseResult) -> None:
        for node_id in result.nodes:
            self._visit(arena, node_id)

    def _visit(self, arena: AstArena, node_id: int) -> None:
        node = arena.get(node_id)
        if node.tag == ChatPegBuilder.REASONING:
            self.result.reasoning_content += node.sanitized_text()
            return
        if node.tag == ChatPegBuilder.CONTENT:
            self.result.content += node.sanitized_text()
            return
        if node.tag == ChatPegBuilder.TOOL:
            name_id = arena.find_by_tag(node, ChatPegBuilder.TOOL_NAME)
            if name_id != INVALID_ID:
                call = ChatToolCall(
                    name=arena.get(name_id).text,
                    arguments=_mm3_container(arena, node, True, not node.is_partial),
                )
                self.result.tool_calls.append(call)
            return
        for child in node.children:
            self._visit(arena, child)


def mapper_for(fmt: ChatFormat, msg: ChatMsg) -> ChatPegMapper:
    if fmt == ChatFormat.PEG_GEMMA4:
        return Gemma4Mapper(msg)
    if fmt == ChatFormat.PEG_MINIMAX_M3:
        return MinimaxM3Mapper(msg)
    return ChatPegMapper(msg)


# --- the builder ---------------------------------------------------------------------------------


def _key_spec(key: str) -> tuple[str, str]:
    """``"a.b"`` as (``a``, ``b``); a key without a dot as ("", key)."""
    dot = key.find(".")
    return ("", key) if dot < 0 else (key[:dot], key[dot + 1 :])


class ChatPegBuilder(ParserBuilder):
    """The parser builder with the chat tags and tool-call layouts (common_chat_peg_builder)."""

    REASONING_BLOCK = "reasoning-block"
    REASONING = "reasoning"
    CONTENT = "content"
    TOOL = "tool"
    TOOL_OPEN = "tool-open"
    TOOL_CLOSE = "tool-close"
    TOOL_ID = "tool-id"
    TOOL_NAME = "tool-name"
    TOOL_ARGS = "tool-args"
    TOOL_ARG = "tool-arg"
    TOOL_ARG_OPEN = "tool-arg-open"
    TOOL_ARG_CLOSE = "tool-arg-close"
    TOOL_ARG_NAME = "tool-arg-name"
    TOOL_ARG_VALUE = "tool-arg-value"
    TOOL_ARG_STRING_VALUE = "tool-arg-string-value"

    def reasoning_block(self, p: Parser) -> Parser:
        return self.tag(self.REASONING_BLOCK, p)

    def reasoning(self, p: Parser) -> Parser:
        return self.tag(self.REASONING, p)

    def content(self, p: Parser) -> Parser:
        return self.tag(self.CONTENT, p)

    def tool(self, p: Parser) -> Parser:
        return self.tag(self.TOOL, p)

    def tool_open(self, p: Parser) -> Parser:
        return self.atomic(self.tag(self.TOOL_OPEN, p))

    def tool_close(self, p: Parser) -> Parser:
        return self.atomic(self.tag(self.TOOL_CLOSE, p))

    def tool_id(self, p: Parser) -> Parser:
        return self.atomic(self.tag(self.TOOL_ID, p))

    def tool_name(self, p: Parser) -> Parser:
        return self.atomic(self.tag(self.TOOL_NAME, p))

    def tool_args(self, p: Parser) -> Parser:
        return self.tag(self.TOOL_ARGS, p)

    def tool_arg(self, p: Parser) -> Parser:
        return self.tag(self.TOOL_ARG, p)

    def tool_arg_open(self, p: Parser) -> Parser:
        return self.atomic(self.tag(self.TOOL_ARG_OPEN, p))

    def tool_arg_close(self, p: Parser) -> Parser:
        return self.atomic(self.tag(self.TOOL_ARG_CLOSE, p))

    def tool_arg_name(self, p: Parser) -> Parser:
        return self.atomic(self.tag(self.TOOL_ARG_NAME, p))

    def tool_arg_value(self, p: Parser) -> Parser:
        return self.tag(self.TOOL_ARG_VALUE, p)

    def tool_arg_string_value(self, p: Parser) -> Parser:
        """A value the schema declares a string: kept as a JSON string, never read as JSON."""
        return self.tag(self.TOOL_ARG_STRING_VALUE, p)

    def tool_arg_json_value(self, p: Parser) -> Parser:
        return self.tag(self.TOOL_ARG_VALUE, p)

    def tag_with_safe_content(self, tag_name: str, marker: str, p: Parser) -> Parser:
        """``p`` repeatedly, any other text (up to ``marker``) as content in between."""
        if not marker:
            return self.zero_or_more(
                self.choice([p, self.rule(tag_name, self.content(self.any()))])
            )
        chunk = self.rule(
            tag_name,
            self.content(
                self.cat(
                    lambda: self.negate(self.literal(marker)), self.any, lambda: self.until(marker)
                )
            ),
        )
        return self.zero_or_more(self.choice([p, chunk]))

    def permute(self, rule_prefix: str, parsers: Sequence[Parser]) -> Parser:
        """Every parser exactly once, in any order (one rule per remaining subset)."""
        if not parsers:
            return self.eps()
        if len(parsers) == 1 or len(parsers) > MAX_PERMUTE:
            return self.sequence(parsers)
        rules: dict[int, Parser] = {}

        def remaining_of(remaining: int) -> Parser:
            if remaining == 0:
                return self.eps()
            if remaining in rules:
                return rules[remaining]
            alternatives = self.choice()
            for i, p in enumerate(parsers):
                bit = 1 << i
                if remaining & bit:
                    alternatives |= p + remaining_of(remaining & ~bit)
            made = self.rule(f"{rule_prefix}-{remaining}", alternatives)
            rules.setdefault(remaining, made)
            return rules[remaining]

        return remaining_of((1 << len(parsers)) - 1)

    def prefix(self, s: str, delimiter: str = "") -> Parser:
        """The generation prompt's part before ``delimiter`` (all of it without one)."""
        if not s:
            return self.eps()
        if not delimiter:
            return self.literal(s)
        at = s.find(delimiter)
        return self.literal(s if at < 0 else s[:at])

    def optspace(self, tag: str) -> Parser:
        """``tag`` with its leading and trailing blanks optional, one by one."""
        parser = self.eps()
        n = len(tag)
        head = next((i for i in range(n) if tag[i] not in _C_SPACE), n)
        tail = next((i for i in range(n, 0, -1) if tag[i - 1] not in _C_SPACE), n)
        for i in range(head):
            parser += self.optional(self.literal(tag[i]))
        parser += self.literal(tag[head:tail] if tail >= head else "")
        for i in range(tail, n):
            parser += self.optional(self.literal(tag[i]))
        return parser

    # -- tool-call layouts (operands in llama-server's allocation order: see ParserBuilder.cat)

    def _lit(self, text: str) -> Callable[[], Parser]:
        return lambda: self.literal(text)

    def _tool_name_of(self, name: str) -> Callable[[], Parser]:
        return lambda: self.tool_name(self.literal(name))

    def _quoted_tool_name(self, name: str) -> Parser:
        return self.atomic(self.cat(self._lit('"'), self._tool_name_of(name), self._lit('"')))

    def _tool_open_named(self, opener: str, name: str, suffix: str) -> Parser:
        return self.tool_open(
            self.cat(self._lit(opener), self._tool_name_of(name), self._lit(suffix))
        )

    def _python_arg_open(self, arg_name: Parser) -> Parser:
        return self.tool_arg_open(self.cat(lambda: self.tool_arg_name(arg_name), self._lit("=")))

    def _python_call_open(self, name: str) -> Parser:
        return self.tool_open(self.cat(self._tool_name_of(name), self._lit("(")))

    def standard_json_tools(
        self,
        section_start: str,
        section_end: str,
        tools: Any,
        parallel_tool_calls: bool,
        force_tool_calls: bool,
        name_key: str = "",
        args_key: str = "",
        array_wrapped: bool = False,
        function_is_key: bool = False,
        call_id_key: str = "",
        gen_call_id_key: str = "",
        parameters_order: Sequence[str] = (),
        accept_openai_wrapper: bool = False,
    ) -> Parser:
        """JSON tool calls between section markers: ``{"name": ..., "arguments": {...}}`` (or the
        given keys, dotted for nested objects), the name as a key, ids, a JSON array."""
        if not isinstance(tools, list) or not tools:
            return self.eps()
        name_key_eff = name_key or "name"
        args_key_eff = args_key or "arguments"
        self.eps()  # llama-server's builder allocates a placeholder here
        if function_is_key:
            choices = self._json_tools_function_is_key(
                tools, args_key, args_key_eff, call_id_key, gen_call_id_key
            )
        elif _key_spec(name_key_eff)[0] or _key_spec(args_key_eff)[0]:
            choices = self._json_tools_nested_keys(
                tools, name_key_eff, args_key_eff, call_id_key, gen_call_id_key
            )
        else:
            choices = self._json_tools_flat_keys(
                tools,
                name_key_eff,
                args_key_eff,
                call_id_key,
                gen_call_id_key,
                parameters_order,
                accept_openai_wrapper,
            )
        calls = choices
        if parallel_tool_calls:
            more = self.cat(self.space, self._lit(","), self.space, choices)
            calls = calls + self.zero_or_more(more)
        if array_wrapped:
            calls = self.cat(self._lit("["), self.space, calls, self.space, self._lit("]"))
        section = self.trigger_rule(
            "tool-call",
            self.cat(
                self._lit(section_start), self.space, calls, self.space, self._lit(section_end)
            ),
        )
        return section if force_tool_calls else self.optional(section)

    def _functions(self, tools: Sequence[Any]) -> list[tuple[str, Any]]:
        out = []
        for tool in tools:
            if not isinstance(tool, Mapping) or "function" not in tool:
                continue
            function = tool["function"]
            out.append((function["name"], tool_parameters(function)))
        return out

    def _id_field(self, key: str, with_number: bool) -> Parser:
        """``"key": "id"`` (or a number id)."""

        def quoted() -> Parser:
            return self.cat(
                self._lit('"'), lambda: self.tool_id(self.string_content('"')), self._lit('"')
            )

        def value() -> Parser:
            if not with_number:
                return quoted()
            return self.choice([quoted(), self.tool_id(self.json_number())])

        if not with_number:
            return self.atomic(
                self.cat(
                    self._lit(f'"{key}"'),
                    self.space,
                    self._lit(":"),
                    self.space,
                    self._lit('"'),
                    lambda: self.tool_id(self.string_content('"')),
                    self._lit('"'),
                )
            )
        return self.atomic(
            self.cat(self._lit(f'"{key}"'), self.space, self._lit(":"), self.space, value)
        )

    def _schema_args(self, name: str, params: Any) -> Callable[[], Parser]:
        return lambda: self.tool_args(self.schema(self.json(), f"tool-{name}-schema", params))

    def _json_tools_function_is_key(
        self,
        tools: Sequence[Any],
        args_key: str,
        args_key_eff: str,
        call_id_key: str,
        gen_call_id_key: str,
    ) -> Parser:
        choices = self.choice()
        for name, params in self._functions(tools):
            fields: list[Parser] = []
            if call_id_key:
                id_parser = self._id_field(call_id_key, False)
                fields.append(
                    self.optional(
                        self.cat(
                            id_parser,
                            self.space,
                            lambda: self.optional(self.cat(self._lit(","), self.space)),
                        )
                    )
                )
            if gen_call_id_key:
                gen_parser = self._id_field(gen_call_id_key, True)
                fields.append(
                    self.optional(
                        self.cat(
                            gen_parser,
                            self.space,
                            lambda: self.optional(self.cat(self._lit(","), self.space)),
                        )
                    )
                )
            self.eps()  # placeholders, as llama-server's builder allocates them
            if not args_key:
                args = self._schema_args(name, params)()
            else:
                args = self.cat(
                    self._lit(f'"{args_key_eff}"'),
                    self.space,
                    self._lit(":"),
                    self.space,
                    self._schema_args(name, params),
                )
            fields.append(args)
            self.eps()
            if not args_key and len(fields) == 1:
                inner = fields[0]
            else:
                inner = self.cat(self._lit("{"), self.space)
                for i, f in enumerate(fields):
                    inner = inner + f
                    if i < len(fields) - 1:
                        inner = inner + self.space()
                inner = self.cat(inner, self.space, self._lit("}"))
            tool_parser = self.tool(
                self.cat(
                    lambda: self.tool_open(self.literal("{")),
                    self.space,
                    self._lit('"'),
                    self._tool_name_of(name),
                    self._lit('"'),
                    self.space,
                    self._lit(":"),
                    self.space,
                    inner,
                    self.space,
                    lambda: self.tool_close(self.literal("}")),
                )
            )
            choices |= self.rule(f"tool-{name}", tool_parser)
        return choices

    def _json_tools_nested_keys(
        self,
        tools: Sequence[Any],
        name_key_eff: str,
        args_key_eff: str,
        call_id_key: str,
        gen_call_id_key: str,
    ) -> Parser:
        choices = self.choice()
        name_spec = _key_spec(name_key_eff)
        args_spec = _key_spec(args_key_eff)
        nested_prefix = name_spec[0] or args_spec[0]
        nested_name_field = name_spec[1] if name_spec[0] else name_key_eff
        nested_args_field = args_spec[1] if args_spec[0] else args_key_eff
        for name, params in self._functions(tools):
            nested_name = self.cat(
                self._lit(f'"{nested_name_field}"'),
                self.space,
                self._lit(":"),
                self.space,
                partial(self._quoted_tool_name, name),
            )
            nested_args = self.cat(
                self._lit(f'"{nested_args_field}"'),
                self.space,
                self._lit(":"),
                self.space,
                self._schema_args(name, params),
            )
            nested_object = self.cat(
                self._lit("{"),
                self.space,
                nested_name,
                self.space,
                self._lit(","),
                self.space,
                nested_args,
                self.space,
                self._lit("}"),
            )
            body = self.cat(lambda: self.tool_open(self.literal("{")), self.space)
            if call_id_key and not _key_spec(call_id_key)[0]:
                id_parser = self._id_field(call_id_key, False)
                body = body + self.optional(
                    self.cat(id_parser, self.space, self._lit(","), self.space)
                )
            if gen_call_id_key and not _key_spec(gen_call_id_key)[0]:
                gen_parser = self._id_field(gen_call_id_key, True)
                body = body + self.optional(
                    self.cat(gen_parser, self.space, self._lit(","), self.space)
                )
            nested_field = self.cat(
                self._lit(f'"{nested_prefix}"'),
                self.space,
                self._lit(":"),
                self.space,
                nested_object,
            )
            body = self.cat(
                body, nested_field, self.space, lambda: self.tool_close(self.literal("}"))
            )
            choices |= self.rule(f"tool-{name}", self.tool(body))
        return choices

    def _json_tools_flat_keys(
        self,
        tools: Sequence[Any],
        name_key_eff: str,
        args_key_eff: str,
        call_id_key: str,
        gen_call_id_key: str,
        parameters_order: Sequence[str],
        accept_openai_wrapper: bool,
    ) -> Parser:
        choices = self.choice()
        name_key_parser = self.literal(f'"{name_key_eff}"')
        args_key_parser = self.literal(f'"{args_key_eff}"')
        order = list(parameters_order)

        def rank(key: str) -> int:
            return order.index(key) if key in order else len(order)

        for name, params in self._functions(tools):
            name_field = self.cat(
                name_key_parser,
                self.space,
                self._lit(":"),
                self.space,
                partial(self._quoted_tool_name, name),
            )
            args_field = self.cat(
                args_key_parser,
                self.space,
                self._lit(":"),
                self.space,
                self._schema_args(name, params),
            )
            id_parser = self.eps()
            if call_id_key:
                id_parser = self._id_field(call_id_key, True)
            gen_parser = self.eps()
            if gen_call_id_key:
                gen_parser = self._id_field(gen_call_id_key, True)
            pairs = [(name_field, name_key_eff), (args_field, args_key_eff)]
            if call_id_key:
                pairs.append((self.optional(id_parser), call_id_key))
            if gen_call_id_key:
                pairs.append((self.optional(gen_parser), gen_call_id_key))
            pairs = _sort_pairs(pairs, rank)
            type_field = self.eps()
            if accept_openai_wrapper:
                type_field = self.optional(
                    self.cat(
                        self._lit('"type"'),
                        self.space,
                        self._lit(":"),
                        self.space,
                        self._lit('"function"'),
                        self.space,
                        self._lit(","),
                        self.space,
                    )
                )
            body = self.cat(lambda: self.tool_open(self.literal("{")), self.space, type_field)
            for i, (parser, _) in enumerate(pairs):
                body = body + parser
                if i < len(pairs) - 1:
                    body = self.cat(body, self.space, self._lit(","), self.space)
            body = self.cat(body, self.space, lambda: self.tool_close(self.literal("}")))
            choices |= self.rule(f"tool-{name}", self.tool(body))
        return choices

    def standard_constructed_tools(
        self,
        markers: Mapping[str, str],
        tools: Any,
        parallel_tool_calls: bool,
        force_tool_calls: bool,
    ) -> Parser:
        """Tagged tool calls: ``<tool_call><function=NAME><param=ARG>value</param>...``, the
        markers overridable by key (tool_call_start_marker, tool_call_end_marker,
        function_opener, function_name_suffix, function_closer, parameter_key_prefix,
        parameter_key_suffix, parameter_closer)."""
        if not isinstance(tools, list) or not tools:
            return self.eps()

        def marker(key: str, default: str) -> str:
            return markers.get(key, default)

        section_start = marker("tool_call_start_marker", "<tool_call>")
        section_end = marker("tool_call_end_marker", "</tool_call>")
        func_opener = marker("function_opener", "<function=")
        func_name_suffix = marker("function_name_suffix", ">")
        func_closer = marker("function_closer", "</function>")
        param_key_prefix = marker("parameter_key_prefix", "<param=")
        param_key_suffix = marker("parameter_key_suffix", ">")
        param_closer = marker("parameter_closer", "</param>")

        choices = self.choice()
        for name, params in self._functions(tools):
            args = self.eps()
            props = params.get("properties") if isinstance(params, Mapping) else None
            if props:
                arg_choice = self.choice()
                for prop_name in props:
                    arg_name = self.choice(
                        [
                            self.literal(prop_name),
                            self.literal(f'"{prop_name}"'),
                            self.literal(f"'{prop_name}'"),
                        ]
                    )
                    arg_choice |= self.tool_arg(
                        self.cat(
                            lambda: self.tool_arg_open(self.literal(param_key_prefix)),
                            partial(self.tool_arg_name, arg_name),
                            self._lit(param_key_suffix),
                            lambda: self.tool_arg_value(self.until(param_closer)),
                            lambda: self.tool_arg_close(self.literal(param_closer)),
                        )
                    )
                args = self.zero_or_more(arg_choice + self.space())
            tool_parser = self.tool(
                self.cat(
                    partial(self._tool_open_named, func_opener, name, func_name_suffix),
                    self.space,
                    partial(self.tool_args, args),
                    self.space,
                    lambda: self.tool_close(self.literal(func_closer)),
                )
            )
            choices |= self.rule(f"tool-{name}", tool_parser)
        if parallel_tool_calls:
            body = self.cat(
                self._lit(section_start),
                self.space,
                lambda: self.one_or_more(choices + self.space()),
                self._lit(section_end),
            )
        else:
            body = self.cat(
                self._lit(section_start), self.space, choices, self.space, self._lit(section_end)
            )
        section = self.trigger_rule("tool-call", body)
        return section if force_tool_calls else self.optional(section)

    def python_or_json_value(self) -> Parser:
        """A Python value whose leaves also take JSON's true/false/null."""

        def build() -> Parser:
            ws = self.space()
            value = self.python_or_json_value()
            member = self.sequence([self.python_string(), ws, self.literal(":"), ws, value])
            members = self.sequence(
                [member, self.zero_or_more(self.sequence([ws, self.literal(","), ws, member]))]
            )
            dict_ = self.rule(
                "python-or-json-dict",
                lambda: self.sequence(
                    [
                        self.literal("{"),
                        ws,
                        self.choice(
                            [self.literal("}"), self.sequence([members, ws, self.literal("}")])]
                        ),
                        ws,
                    ]
                ),
            )
            elements = self.sequence(
                [value, self.zero_or_more(self.sequence([self.literal(","), ws, value]))]
            )
            array = self.rule(
                "python-or-json-array",
                lambda: self.sequence(
                    [
                        self.literal("["),
                        ws,
                        self.choice(
                            [self.literal("]"), self.sequence([elements, ws, self.literal("]")])]
                        ),
                        ws,
                    ]
                ),
            )
            return self.choice(
                [
                    dict_,
                    array,
                    self.python_string(),
                    self.python_number(),
                    self.python_bool(),
                    self.python_null(),
                    self.json_bool(),
                    self.json_null(),
                ]
            )

        return self.rule("python-or-json-value", build)

    def python_style_tool_calls(
        self, tools: Any, parallel_tool_calls: bool, allow_json_literals: bool
    ) -> Parser:
        """``[name(arg1="value1", arg2=123), ...]``."""
        if not isinstance(tools, list) or not tools:
            return self.eps()
        choices = self.choice()
        for name, params in self._functions(tools):
            args = self.eps()
            props = params.get("properties") if isinstance(params, Mapping) else None
            if props:
                arg_choice = self.choice()
                for prop_name, prop_def in props.items():
                    is_string = isinstance(prop_def, Mapping) and prop_def.get("type") == "string"
                    arg_name = self.literal(prop_name)
                    value = self.eps()
                    string_value = self.tool_arg_value(
                        self.choice(
                            [
                                self.cat(
                                    self._lit('"'), lambda: self.string_content('"'), self._lit('"')
                                ),
                                self.cat(
                                    self._lit("'"), lambda: self.string_content("'"), self._lit("'")
                                ),
                            ]
                        )
                    )
                    if is_string:
                        value = string_value
                    else:
                        value = self.tool_arg_value(
                            self.python_or_json_value()
                            if allow_json_literals
                            else self.python_value()
                        )
                    arg_choice |= self.tool_arg(
                        self.cat(
                            partial(self._python_arg_open, arg_name),
                            value,
                            lambda: self.tool_arg_close(self.eps()),
                        )
                    )
                args = arg_choice + self.zero_or_more(self.cat(",", self.space, arg_choice))
            tool_parser = self.tool(
                self.cat(
                    partial(self._python_call_open, name),
                    self.space,
                    partial(self.tool_args, args),
                    self.space,
                    lambda: self.tool_close(self.literal(")")),
                )
            )
            choices |= self.rule(f"tool-{name}", tool_parser)
        if parallel_tool_calls:
            return self.cat(
                "[",
                self.space,
                choices,
                lambda: self.zero_or_more(self.cat(",", self.space, choices)),
                self.space,
                "]",
            )
        return self.cat("[", self.space, choices, self.space, "]")


def _sort_pairs(
    pairs: list[tuple[Parser, str]], rank: Callable[[str], int]
) -> list[tuple[Parser, str]]:
    """std::sort by rank: stable for the few (at most four) pairs it sorts, as insertion sort."""
    return sorted(pairs, key=lambda pair: rank(pair[1]))


def build_chat_peg_parser(fn: Callable[[ChatPegBuilder], Parser]) -> Arena:
    builder = ChatPegBuilder()
    builder.set_root(fn(builder))
    return builder.build()


def _content_only(p: ChatPegBuilder) -> Parser:
    return p.content(p.rest()) + p.end()


def chat_peg_parse(
    arena: Arena,
    output: str | bytes,
    is_partial: bool,
    generation_prompt: str = "",
    format: ChatFormat = ChatFormat.PEG_NATIVE,
    debug: bool = False,
) -> ChatMsg:
    """The assistant message in a model's output (common_chat_peg_parse): the arena runs on the
    generation prompt plus the output, always leniently (an output may stop anywhere). A failed
    parse of a partial output gives what was recognised before the failure; of a final output
    it raises ChatParseError."""
    parser = arena if not arena.empty() else build_chat_peg_parser(_content_only)
    prompt = generation_prompt.encode("utf-8")
    text = output.encode("utf-8") if isinstance(output, str) else bytes(output)
    flags = ParseFlags.LENIENT | (ParseFlags.DEBUG if debug else ParseFlags.NONE)
    ctx = ParseContext(prompt + text, flags)
    result = parser.parse(ctx)
    if result.fail() and not (is_partial and result.end > 0):
        raise ChatParseError(
            f"The model produced output that does not match the expected {ChatFormat(format).value} format"
        )
    msg = ChatMsg(role="assistant")
    mapper_for(ChatFormat(format), msg).from_ast(ctx.ast, result)
    return msg


# --- tag extraction (tagged_peg_parser) -----------------------------------------------------------


@dataclass
class TaggedParseResult:
    result: ParseResult
    tags: dict[str, str]


def _tags_of(arena: AstArena, result: ParseResult) -> dict[str, str]:
    tags: dict[str, str] = {}

    def visit(node: AstNode) -> None:
        if node.tag:
            tags[node.tag] = node.text

    arena.visit(result, visit)
    return tags


class TaggedPegParser:
    """An arena whose tags are read off as a name -> text map."""

    def __init__(self, arena: Arena, flags: ParseFlags = ParseFlags.NONE):
        self.arena = arena
        self.flags = flags

    def parse_and_extract(
        self, text: str | bytes, extra_flags: ParseFlags = ParseFlags.NONE
    ) -> TaggedParseResult:
        ctx = ParseContext(text, self.flags | extra_flags)
        result = self.arena.parse(ctx)
        return TaggedParseResult(result, _tags_of(ctx.ast, result))

    def parse_anywhere_and_extract(self, text: str | bytes) -> TaggedParseResult:
        """The first position from which the arena parses (else the result at the last one)."""
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        if not data:
            return self.parse_and_extract(data)
        for i in range(len(data)):
            ctx = ParseContext(data, self.flags)
            result = self.arena.parse(ctx, i)
            if result.success() or i == len(data) - 1:
                return TaggedParseResult(result, _tags_of(ctx.ast, result))
        raise AssertionError("unreachable")


def build_tagged_peg_parser(fn: Callable[[ParserBuilder], Parser]) -> TaggedPegParser:
    builder = ParserBuilder()
    builder.set_root(fn(builder))
    return TaggedPegParser(builder.build())
