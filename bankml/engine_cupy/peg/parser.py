"""The PEG parser arena: llama-server's common_peg_arena and its builder (common/peg-parser.h).

A model's chat output is parsed, and its tool-call grammar built, from one description: an arena
of small parsers, each with an id, combined by a builder. The arena parses the bytes of an
output (full, or partial while streaming) into an AST of tagged and named nodes, and writes the
GBNF grammar that constrains generation (``build_grammar`` in ``bankml.engine_cupy.peg.gbnf``).

Everything works on bytes, as llama-server does: positions are byte offsets, text is UTF-8 and
a partial output may end inside a character. ``str`` input is encoded as UTF-8.

Public API (C++ names in snake_case)::

    ParseResultType      FAIL, SUCCESS, NEED_MORE_INPUT
    ParseFlags           NONE, LENIENT (partial input: NEED_MORE_INPUT at its end), DEBUG
    ParseContext(input, flags=ParseFlags.NONE)     .input (bytes), .flags, .ast, is_lenient()
    ParseResult          .type .start .end .nodes (AST ids) .invalid_utf8;
                         fail() success() need_more_input()
    AstNode              .id .rule .tag .start .end .raw (bytes) .text (str) .children
                         .is_partial .invalid_utf8; sanitized_text() (bad UTF-8 as U+FFFD)
    AstArena             get(id) find_by_tag(node, tag, max_depth=3) find_by_rule(...)
                         visit(id_or_result, fn) dump()
    Arena                parse(ctx, start=0) parse_id(id, ctx, start) get(id) get_rule(name)
                         has_rule(name) root size() empty() dump(id) build_grammar(builder, lazy)
                         to_json() Arena.from_json(j) save() Arena.load(text)
    Parser               a handle (id + builder): ``a + b`` sequence, ``a << b`` sequence with
                         ``space()`` between, ``a | b`` choice; ``str`` operands are literals
                         (``"<think>" + p.reasoning(...)``); ``+=`` and ``|=`` rebind
    ParserBuilder        eps start end literal sequence choice one_or_more zero_or_more optional
                         peek negate any chars ref space until until_one_of rest repeat
                         double_quoted_string single_quoted_string quoted_string string_content
                         json json_object json_string json_array json_number json_bool json_null
                         json_member python_value python_dict python_string python_array
                         python_number python_bool python_null marker schema rule trigger_rule
                         atomic tag gbnf ac set_root build
    build_peg_parser(fn) the arena of ``fn(builder)``'s parser (build_peg_parser in C++)

``rule(name, p_or_fn, trigger=False)`` takes a parser, or a function returning one (the C++
overload taking a builder function: a rule already defined under that name is reused, and the
function may refer to the rule itself through ``ref``). ``sequence``/``choice`` take a list of
parsers (or no argument: an empty one). Parser ids are allocated in call order, as in C++; the
ids name the GBNF rules of ``until``/``ac`` parsers (``until-12``), so a builder that allocates
in llama-server's order gets llama-server's grammar text.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Sequence
from enum import IntEnum, IntFlag
from typing import Any

from bankml.engine_cupy.json_schema_grammar import (
    Node,
    SchemaConversionError,
    _Builder,
    _SchemaError,
)

INVALID_ID = -1


class ParseResultType(IntEnum):
    FAIL = 0
    SUCCESS = 1
    NEED_MORE_INPUT = 2


RESULT_TYPE_NAMES = {
    ParseResultType.FAIL: "fail",
    ParseResultType.SUCCESS: "success",
    ParseResultType.NEED_MORE_INPUT: "need_more_input",
}

FAIL = ParseResultType.FAIL
SUCCESS = ParseResultType.SUCCESS
NEED_MORE = ParseResultType.NEED_MORE_INPUT


class ParseFlags(IntFlag):
    NONE = 0
    LENIENT = 1
    DEBUG = 2


# --- UTF-8 (common/unicode.cpp) ---------------------------------------------------------------

UTF8_SUCCESS, UTF8_INCOMPLETE, UTF8_INVALID = 0, 1, 2


def parse_utf8_codepoint(data: bytes, offset: int) -> tuple[int, int, int]:
    """(status, codepoint, bytes consumed) of the character at ``offset``, as llama.cpp's
    common_parse_utf8_codepoint: no check for overlong forms or surrogates; for an incomplete
    or invalid sequence the length of its valid prefix."""
    n = len(data)
    if offset >= n:
        return UTF8_INCOMPLETE, 0, 0
    b0 = data[offset]
    if not b0 & 0x80:
        return UTF8_SUCCESS, b0, 1
    if not b0 & 0x40:
        return UTF8_INVALID, 0, 1
    if not b0 & 0x20:
        if offset + 1 >= n:
            return UTF8_INCOMPLETE, 0, 1
        b1 = data[offset + 1]
        if b1 & 0xC0 != 0x80:
            return UTF8_INVALID, 0, 1
        return UTF8_SUCCESS, ((b0 & 0x1F) << 6) | (b1 & 0x3F), 2
    if not b0 & 0x10:
        length, cp = 3, b0 & 0x0F
    elif not b0 & 0x08:
        length, cp = 4, b0 & 0x07
    else:
        return UTF8_INVALID, 0, 1
    for i in range(1, length):
        if offset + i >= n:
            return UTF8_INCOMPLETE, 0, i
        b = data[offset + i]
        if b & 0xC0 != 0x80:
            return UTF8_INVALID, 0, i
        cp = (cp << 6) | (b & 0x3F)
    return UTF8_SUCCESS, cp, length


def utf8_codepoints(text: bytes) -> list[int]:
    """The codepoints of ``text`` up to its first undecodable byte (common_trie::insert)."""
    out = []
    pos = 0
    while pos < len(text):
        status, cp, size = parse_utf8_codepoint(text, pos)
        if status != UTF8_SUCCESS:
            break
        out.append(cp)
        pos += size
    return out


def _to_bytes(text: str | bytes) -> bytes:
    return text.encode("utf-8") if isinstance(text, str) else bytes(text)


# --- the trie the until parser scans with (common/trie.cpp) -------------------------------------

NO_MATCH, PARTIAL_MATCH, COMPLETE_MATCH = 0, 1, 2


class Trie:
    """Literals as codepoint paths; ``check_at`` says whether one starts at a position."""

    def __init__(self, words: Iterable[str | bytes] = ()):
        self.children: list[dict[int, int]] = [{}]
        self.pattern: list[int] = [-1]
        self.n_patterns = 0
        for w in words:
            self.insert(utf8_codepoints(_to_bytes(w)))

    def insert(self, symbols: Sequence[int]) -> int:
        cur = 0
        for ch in symbols:
            nxt = self.children[cur].get(ch)
            if nxt is None:
                nxt = len(self.children)
                self.children.append({})
                self.pattern.append(-1)
                self.children[cur][ch] = nxt
            cur = nxt
        if self.pattern[cur] < 0:
            self.pattern[cur] = self.n_patterns
            self.n_patterns += 1
        return self.pattern[cur]

    def check_at(self, data: bytes, start: int) -> int:
        cur = 0
        pos = start
        while pos < len(data):
            status, cp, size = parse_utf8_codepoint(data, pos)
            if status != UTF8_SUCCESS:
                break
            nxt = self.children[cur].get(cp)
            if nxt is None:
                return NO_MATCH
            cur = nxt
            pos += size
            if self.pattern[cur] >= 0:
                return COMPLETE_MATCH
        return PARTIAL_MATCH if cur != 0 else NO_MATCH


# --- results and the AST ----------------------------------------------------------------------


class InvalidUtf8:
    """A run of input bytes that does not decode as UTF-8."""

    __slots__ = ("pos", "len")

    def __init__(self, pos: int, length: int):
        self.pos = pos
        self.len = length

    def __repr__(self) -> str:
        return f"InvalidUtf8({self.pos}, {self.len})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, InvalidUtf8) and (self.pos, self.len) == (other.pos, other.len)


class ParseResult:
    __slots__ = ("type", "start", "end", "nodes", "invalid_utf8")

    def __init__(
        self,
        type: ParseResultType,
        start: int,
        end: int | None = None,
        nodes: list[int] | None = None,
        invalid_utf8: list[InvalidUtf8] | None = None,
    ):
        self.type = type
        self.start = start
        self.end = start if end is None else end
        self.nodes = nodes if nodes is not None else []
        self.invalid_utf8 = invalid_utf8 if invalid_utf8 is not None else []

    def fail(self) -> bool:
        return self.type == FAIL

    def success(self) -> bool:
        return self.type == SUCCESS

    def need_more_input(self) -> bool:
        return self.type == NEED_MORE

    def __repr__(self) -> str:
        return f"ParseResult({RESULT_TYPE_NAMES[self.type]}, {self.start}, {self.end}, nodes={self.nodes})"


class AstNode:
    __slots__ = (
        "id",
        "rule",
        "tag",
        "start",
        "end",
        "raw",
        "children",
        "is_partial",
        "invalid_utf8",
    )

    def __init__(
        self,
        id: int,
        rule: str,
        tag: str,
        start: int,
        end: int,
        raw: bytes,
        children: list[int],
        is_partial: bool,
        invalid_utf8: list[InvalidUtf8],
    ):
        self.id = id
        self.rule = rule
        self.tag = tag
        self.start = start
        self.end = end
        self.raw = raw
        self.children = children
        self.is_partial = is_partial
        self.invalid_utf8 = invalid_utf8

    @property
    def text(self) -> str:
        """The node's bytes as text (an undecodable byte as U+FFFD)."""
        return self.raw.decode("utf-8", errors="replace")

    def sanitized_text(self) -> str:
        """The text with every invalid run the parser recorded replaced by one U+FFFD."""
        if not self.invalid_utf8:
            return self.text
        parts = []
        seg = self.start
        for bad in self.invalid_utf8:
            parts.append(self.raw[seg - self.start : bad.pos - self.start])
            parts.append(b"\xef\xbf\xbd")
            seg = bad.pos + bad.len
        parts.append(self.raw[seg - self.start : self.end - self.start])
        return b"".join(parts).decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return f"AstNode({self.id}, rule={self.rule!r}, tag={self.tag!r}, text={self.raw!r})"


class AstArena:
    def __init__(self) -> None:
        self.nodes: list[AstNode] = []

    def add_node(
        self,
        rule: str,
        tag: str,
        start: int,
        end: int,
        raw: bytes,
        children: list[int],
        is_partial: bool = False,
        invalid_utf8: list[InvalidUtf8] | None = None,
    ) -> int:
        node_id = len(self.nodes)
        self.nodes.append(
            AstNode(
                node_id, rule, tag, start, end, raw, children, is_partial, list(invalid_utf8 or [])
            )
        )
        return node_id

    def get(self, node_id: int) -> AstNode:
        return self.nodes[node_id]

    def size(self) -> int:
        return len(self.nodes)

    def clear(self) -> None:
        self.nodes.clear()

    def find_by_tag(self, parent: AstNode, tag: str, max_depth: int = 3) -> int:
        for child_id in parent.children:
            child = self.nodes[child_id]
            if child.tag == tag:
                return child_id
            if max_depth > 1:
                found = self.find_by_tag(child, tag, max_depth - 1)
                if found != INVALID_ID:
                    return found
        return INVALID_ID

    def find_by_rule(self, parent: AstNode, rule: str, max_depth: int = 3) -> int:
        for child_id in parent.children:
            child = self.nodes[child_id]
            if child.rule == rule:
                return child_id
            if max_depth > 1:
                found = self.find_by_rule(child, rule, max_depth - 1)
                if found != INVALID_ID:
                    return found
        return INVALID_ID

    def visit(self, what: int | ParseResult, visitor: Callable[[AstNode], None]) -> None:
        """Pre-order over a node's subtree, or over every top node of a result."""
        if isinstance(what, ParseResult):
            for node_id in what.nodes:
                self.visit(node_id, visitor)
            return
        if what == INVALID_ID:
            return
        node = self.nodes[what]
        visitor(node)
        for child in node.children:
            self.visit(child, visitor)

    def dump(self) -> str:
        out: list[str] = []

        def walk(node: AstNode, indent: int) -> None:
            line = "  " * indent + f"NODE {node.id}"
            if node.rule:
                line += f" (rule {node.rule})"
            if node.tag:
                line += f" (tag {node.tag})"
            out.append(line + f" ['{node.text}']\n")
            for child in node.children:
                walk(self.nodes[child], indent + 1)

        for node in self.nodes:
            walk(node, 0)
        return "".join(out)


class ParseContext:
    def __init__(self, input: str | bytes = b"", flags: ParseFlags | int = ParseFlags.NONE):
        self.input = _to_bytes(input)
        self.flags = ParseFlags(flags)
        self.ast = AstArena()
        self.parse_depth = 0
        self._valid_utf8: bool | None = None

    def is_lenient(self) -> bool:
        return bool(self.flags & ParseFlags.LENIENT)

    def is_debug(self) -> bool:
        return bool(self.flags & ParseFlags.DEBUG)

    def valid_utf8(self) -> bool:
        """Whether the whole input decodes (the until parser's fast path)."""
        if self._valid_utf8 is None:
            try:
                self.input.decode("utf-8")
                self._valid_utf8 = True
            except UnicodeDecodeError:
                self._valid_utf8 = False
        return self._valid_utf8


# --- the parsers --------------------------------------------------------------------------------

_SPACE_BYTES = frozenset(b" \t\n\v\f\r")  # C isspace
_HEX_BYTES = frozenset(b"0123456789abcdefABCDEF")
_SIMPLE_ESCAPES = frozenset(b"\\/bfnrt")


class PegParser:
    """One parser of the arena (a C++ common_peg_*_parser variant)."""

    __slots__ = ()
    kind = ""

    def child_ids(self) -> list[int]:
        return []

    def map_children(self, fn: Callable[[int], int]) -> None:
        pass

    def parse(self, arena: Arena, ctx: ParseContext, start: int) -> ParseResult:
        raise NotImplementedError

    def fields(self) -> dict[str, Any]:
        return {}


class _Single(PegParser):
    """A parser with one child."""

    __slots__ = ("child",)

    def __init__(self, child: int):
        self.child = child

    def child_ids(self) -> list[int]:
        return [self.child]

    def map_children(self, fn: Callable[[int], int]) -> None:
        self.child = fn(self.child)

    def fields(self) -> dict[str, Any]:
        return {"child": self.child}


class EpsilonParser(PegParser):
    __slots__ = ()
    kind = "epsilon"

    def parse(self, arena: Arena, ctx: ParseContext, start: int) -> ParseResult:
        return ParseResult(SUCCESS, start)


class StartParser(PegParser):
    __slots__ = ()
    kind = "start"

    def parse(self, arena: Arena, ctx: ParseContext, start: int) -> ParseResult:
        return ParseResult(SUCCESS if start == 0 else FAIL, start)


class EndParser(PegParser):
    __slots__ = ()
    kind = "end"

    def parse(self, arena: Arena, ctx: ParseContext, start: int) -> ParseResult:
        return ParseResult(SUCCESS if start >= len(ctx.input) else FAIL, start)


class LiteralParser(PegParser):
    __slots__ = ("literal", "data")
    kind = "literal"

    def __init__(self, literal: str | bytes):
        self.data = _to_bytes(literal)
        self.literal = literal if isinstance(literal, str) else self.data.decode("utf-8", "replace")

    def parse(self, arena: Arena, ctx: ParseContext, start: int) -> ParseResult:
        data = ctx.input
        lit = self.data
        left = len(data) - start
        if left >= len(lit):
            if data.startswith(lit, start):
                return ParseResult(SUCCESS, start, start + len(lit))
            return ParseResult(FAIL, start)
        if lit.startswith(data[start:]):
            if not ctx.is_lenient():
                return ParseResult(FAIL, start)
            return ParseResult(NEED_MORE, start, len(data))
        return ParseResult(FAIL, start)

    def fields(self) -> dict[str, Any]:
        return {"literal": self.literal}


class _Multi(PegParser):
    """A parser with a list of children."""

    __slots__ = ("children",)

    def __init__(self, children: list[int]):
        self.children = children

    def child_ids(self) -> list[int]:
        return list(self.children)

    def map_children(self, fn: Callable[[int], int]) -> None:
        self.children = [fn(c) for c in self.children]

    def fields(self) -> dict[str, Any]:
        return {"children": list(self.children)}


class SequenceParser(_Multi):
    __slots__ = ()
    kind = "sequence"

    def parse(self, arena: Arena, ctx: ParseContext, start: int) -> ParseResult:
        pos = start
        nodes: list[int] = []
        invalid: list[InvalidUtf8] = []
        for child in self.children:
            result = arena.parse_id(child, ctx, pos)
            if result.type == FAIL:
                return ParseResult(FAIL, start, result.end)
            nodes.extend(result.nodes)
            invalid.extend(result.invalid_utf8)
            if result.type == NEED_MORE:
                return ParseResult(NEED_MORE, start, result.end, nodes, invalid)
            pos = result.end
        return ParseResult(SUCCESS, start, pos, nodes, invalid)


class ChoiceParser(_Multi):
    __slots__ = ()
    kind = "choice"

    def parse(self, arena: Arena, ctx: ParseContext, start: int) -> ParseResult:
        for child in self.children:
            result = arena.parse_id(child, ctx, start)
            if result.type != FAIL:
                return result
        return ParseResult(FAIL, start)


class RepetitionParser(_Single):
    __slots__ = ("min_count", "max_count")
    kind = "repetition"

    def __init__(self, child: int, min_count: int, max_count: int):
        super().__init__(child)
        self.min_count = min_count
        self.max_count = max_count

    def parse(self, arena: Arena, ctx: ParseContext, start: int) -> ParseResult:
        pos = start
        count = 0
        nodes: list[int] = []
        invalid: list[InvalidUtf8] = []
        n = len(ctx.input)
        while self.max_count == -1 or count < self.max_count:
            if pos >= n:
                break
            result = arena.parse_id(self.child, ctx, pos)
            if result.type == SUCCESS:
                if result.end == pos:
                    break
                nodes.extend(result.nodes)
                invalid.extend(result.invalid_utf8)
                pos = result.end
                count += 1
                continue
            if result.type == NEED_MORE:
                nodes.extend(result.nodes)
                invalid.extend(result.invalid_utf8)
                return ParseResult(NEED_MORE, start, result.end, nodes, invalid)
            break
        if self.min_count > 0 and count < self.min_count:
            if pos >= n and ctx.is_lenient():
                return ParseResult(NEED_MORE, start, pos, nodes, invalid)
            return ParseResult(FAIL, start, pos)
        return ParseResult(SUCCESS, start, pos, nodes, invalid)

    def fields(self) -> dict[str, Any]:
        return {"child": self.child, "min_count": self.min_count, "max_count": self.max_count}


class AndParser(_Single):
    __slots__ = ()
    kind = "and"

    def parse(self, arena: Arena, ctx: ParseContext, start: int) -> ParseResult:
        return ParseResult(arena.parse_id(self.child, ctx, start).type, start)


class NotParser(_Single):
    __slots__ = ()
    kind = "not"

    def parse(self, arena: Arena, ctx: ParseContext, start: int) -> ParseResult:
        result = arena.parse_id(self.child, ctx, start)
        if result.type == SUCCESS:
            return ParseResult(FAIL, start)
        if result.type == NEED_MORE:
            return ParseResult(NEED_MORE, start)
        return ParseResult(SUCCESS, start)


class AnyParser(PegParser):
    __slots__ = ()
    kind = "any"

    def parse(self, arena: Arena, ctx: ParseContext, start: int) -> ParseResult:
        status, _, size = parse_utf8_codepoint(ctx.input, start)
        if status == UTF8_INCOMPLETE:
            return ParseResult(NEED_MORE if ctx.is_lenient() else FAIL, start)
        if status == UTF8_INVALID:
            return ParseResult(FAIL, start)
        return ParseResult(SUCCESS, start, start + size)


class SpaceParser(PegParser):
    __slots__ = ()
    kind = "space"

    def parse(self, arena: Arena, ctx: ParseContext, start: int) -> ParseResult:
        data = ctx.input
        pos = start
        n = len(data)
        while pos < n and data[pos] in _SPACE_BYTES:
            pos += 1
        return ParseResult(SUCCESS, start, pos)


def _hex_value(text: bytes, pos: int, count: int) -> int | None:
    if pos + count > len(text):
        return None
    digits = text[pos : pos + count]
    if not all(c in _HEX_BYTES for c in digits):
        return None
    return int(digits, 16)


def _class_char(content: bytes, pos: int) -> tuple[int, int]:
    """One character of a class pattern and its length (parse_char_class_char)."""
    if content[pos] == 0x5C and pos + 1 < len(content):  # backslash
        esc = content[pos + 1]
        widths = {ord("x"): 2, ord("u"): 4, ord("U"): 8}
        if esc in widths:
            value = _hex_value(content, pos + 2, widths[esc])
            if value is not None:
                return value, 2 + widths[esc]
            return esc, 2
        simple = {ord("n"): 10, ord("t"): 9, ord("r"): 13}
        return simple.get(esc, esc), 2
    return content[pos], 1


def parse_char_classes(classes: str) -> tuple[list[tuple[int, int]], bool]:
    """The ranges of a ``[...]`` class (brackets optional) and whether it is negated."""
    content = _to_bytes(classes)
    if content[:1] == b"[":
        content = content[1:]
    if content[-1:] == b"]":
        content = content[:-1]
    negated = content[:1] == b"^"
    if negated:
        content = content[1:]
    ranges = []
    i = 0
    while i < len(content):
        lo, size = _class_char(content, i)
        i += size
        if i + 1 < len(content) and content[i] == 0x2D:  # '-'
            hi, size = _class_char(content, i + 1)
            ranges.append((lo, hi))
            i += 1 + size
        else:
            ranges.append((lo, lo))
    return ranges, negated


class CharsParser(PegParser):
    __slots__ = ("pattern", "ranges", "negated", "min_count", "max_count")
    kind = "chars"

    def __init__(
        self,
        pattern: str,
        ranges: list[tuple[int, int]],
        negated: bool,
        min_count: int,
        max_count: int,
    ):
        self.pattern = pattern
        self.ranges = ranges
        self.negated = negated
        self.min_count = min_count
        self.max_count = max_count

    def parse(self, arena: Arena, ctx: ParseContext, start: int) -> ParseResult:
        data = ctx.input
        pos = start
        count = 0
        while self.max_count == -1 or count < self.max_count:
            status, cp, size = parse_utf8_codepoint(data, pos)
            if status == UTF8_INCOMPLETE:
                if count >= self.min_count:
                    return ParseResult(SUCCESS, start, pos)
                if not ctx.is_lenient():
                    return ParseResult(FAIL, start)
                return ParseResult(NEED_MORE, start, pos)
            if status == UTF8_INVALID:
                if count >= self.min_count:
                    return ParseResult(SUCCESS, start, pos)
                return ParseResult(FAIL, start)
            matches = any(lo <= cp <= hi for lo, hi in self.ranges)
            if matches != self.negated:
                pos += size
                count += 1
            else:
                break
        if count < self.min_count:
            if pos >= len(data) and ctx.is_lenient():
                return ParseResult(NEED_MORE, start, pos)
            return ParseResult(FAIL, start, pos)
        return ParseResult(SUCCESS, start, pos)

    def fields(self) -> dict[str, Any]:
        return {
            "pattern": self.pattern,
            "ranges": [{"start": lo, "end": hi} for lo, hi in self.ranges],
            "negated": self.negated,
            "min_count": self.min_count,
            "max_count": self.max_count,
        }


class StringParser(PegParser):
    """The content of a quoted string, up to (not including) its unescaped delimiter."""

    __slots__ = ("delimiter", "_plain")
    kind = "string"

    def __init__(self, delimiter: str):
        self.delimiter = delimiter
        # a run of ASCII bytes that are neither the delimiter nor a backslash
        self._plain = re.compile(b"[^\\\\\x80-\xff" + re.escape(delimiter.encode()) + b"]+")

    def parse(self, arena: Arena, ctx: ParseContext, start: int) -> ParseResult:
        data = ctx.input
        n = len(data)
        delim = ord(self.delimiter)
        lenient = ctx.is_lenient()
        pos = start
        while pos < n:
            c = data[pos]
            if c == delim:
                return ParseResult(SUCCESS, start, pos)
            if c == 0x5C:  # backslash
                if pos + 1 >= n:
                    if not lenient:
                        return ParseResult(FAIL, start)
                    return ParseResult(NEED_MORE, start, pos)
                esc = data[pos + 1]
                if esc == delim or esc in _SIMPLE_ESCAPES:
                    pos += 2
                    continue
                if esc == 0x75:  # u
                    p = pos + 2
                    for _ in range(4):
                        if p >= n:
                            if not lenient:
                                return ParseResult(FAIL, start)
                            return ParseResult(NEED_MORE, start, pos)
                        if data[p] not in _HEX_BYTES:
                            return ParseResult(FAIL, start)
                        p += 1
                    pos = p
                    continue
                return ParseResult(FAIL, start)
            if c < 0x80:
                m = self._plain.match(data, pos)
                pos = m.end() if m else pos + 1
                continue
            status, _, size = parse_utf8_codepoint(data, pos)
            if status == UTF8_INCOMPLETE:
                if not lenient:
                    return ParseResult(FAIL, start)
                return ParseResult(NEED_MORE, start, pos)
            if status == UTF8_INVALID:
                return ParseResult(FAIL, start)
            pos += size
        if not lenient:
            return ParseResult(FAIL, start, pos)
        return ParseResult(NEED_MORE, start, pos)

    def fields(self) -> dict[str, Any]:
        return {"delimiter": self.delimiter}


class UntilParser(PegParser):
    """Everything up to the first delimiter (not consumed); all of the input if none is."""

    __slots__ = ("delimiters", "_trie", "_data", "_max_len")
    kind = "until"

    def __init__(self, delimiters: Sequence[str]):
        self.delimiters = list(delimiters)
        self._trie = Trie(self.delimiters)
        self._data = [_to_bytes(d) for d in self.delimiters if d]
        self._max_len = max((len(d) for d in self._data), default=0)

    def parse(self, arena: Arena, ctx: ParseContext, start: int) -> ParseResult:
        data = ctx.input
        n = len(data)
        if ctx.valid_utf8():
            # every delimiter match starts on a character boundary of valid UTF-8: the scan
            # below, done with bytes.find
            best = n
            for d in self._data:
                i = data.find(d, start, min(n, best + len(d)))
                if i != -1 and i < best:
                    best = i
            for k in range(max(start, n - self._max_len + 1), best):
                tail = data[k:]
                if any(d.startswith(tail) for d in self._data):
                    best = k
                    break
            if best < n:
                return ParseResult(SUCCESS, start, best)
            return ParseResult(NEED_MORE if ctx.is_lenient() else SUCCESS, start, n)
        return self._scan(ctx, start)

    def _scan(self, ctx: ParseContext, start: int) -> ParseResult:
        data = ctx.input
        n = len(data)
        lenient = ctx.is_lenient()
        pos = start
        last_valid = start
        invalid: list[InvalidUtf8] = []
        while pos < n:
            status, _, size = parse_utf8_codepoint(data, pos)
            if status == UTF8_INCOMPLETE and lenient:
                return ParseResult(NEED_MORE, start, last_valid, [], invalid)
            if status != UTF8_SUCCESS:
                invalid.append(InvalidUtf8(pos, size))
                pos += size
                last_valid = pos
                continue
            if self._trie.check_at(data, pos) != NO_MATCH:
                return ParseResult(SUCCESS, start, pos, [], invalid)
            pos += size
            last_valid = pos
        if last_valid == n and lenient:
            return ParseResult(NEED_MORE, start, last_valid, [], invalid)
        return ParseResult(SUCCESS, start, last_valid, [], invalid)

    def fields(self) -> dict[str, Any]:
        return {"delimiters": list(self.delimiters)}


class SchemaParser(_Single):
    """Parses as its child; its GBNF is the JSON schema's (unless ``raw`` and a string)."""

    __slots__ = ("name", "node", "raw", "schema")
    kind = "schema"

    def __init__(self, child: int, name: str, node: Node | None, raw: bool, schema: Any = None):
        super().__init__(child)
        self.name = name
        self.node = node
        self.raw = raw
        self.schema = schema

    def parse(self, arena: Arena, ctx: ParseContext, start: int) -> ParseResult:
        return arena.parse_id(self.child, ctx, start)

    def fields(self) -> dict[str, Any]:
        return {"child": self.child, "name": self.name, "raw": self.raw}


class RuleParser(_Single):
    __slots__ = ("name", "trigger")
    kind = "rule"

    def __init__(self, name: str, child: int, trigger: bool):
        super().__init__(child)
        self.name = name
        self.trigger = trigger

    def parse(self, arena: Arena, ctx: ParseContext, start: int) -> ParseResult:
        return _node_of(arena.parse_id(self.child, ctx, start), ctx, self.name, "")

    def fields(self) -> dict[str, Any]:
        return {"name": self.name, "child": self.child, "trigger": self.trigger}


class RefParser(PegParser):
    __slots__ = ("name",)
    kind = "ref"

    def __init__(self, name: str):
        self.name = name

    def parse(self, arena: Arena, ctx: ParseContext, start: int) -> ParseResult:
        return arena.parse_id(arena.get_rule(self.name), ctx, start)

    def fields(self) -> dict[str, Any]:
        return {"name": self.name}


class AtomicParser(_Single):
    __slots__ = ()
    kind = "atomic"

    def parse(self, arena: Arena, ctx: ParseContext, start: int) -> ParseResult:
        result = arena.parse_id(self.child, ctx, start)
        if result.type == NEED_MORE:
            result.nodes = []
        return result


class TagParser(_Single):
    __slots__ = ("tag",)
    kind = "tag"

    def __init__(self, child: int, tag: str):
        super().__init__(child)
        self.tag = tag

    def parse(self, arena: Arena, ctx: ParseContext, start: int) -> ParseResult:
        return _node_of(arena.parse_id(self.child, ctx, start), ctx, "", self.tag)

    def fields(self) -> dict[str, Any]:
        return {"child": self.child, "tag": self.tag}


class GbnfParser(_Single):
    """Parses as its child; writes the given GBNF instead of the child's."""

    __slots__ = ("grammar",)
    kind = "gbnf"

    def __init__(self, child: int, grammar: str):
        super().__init__(child)
        self.grammar = grammar

    def parse(self, arena: Arena, ctx: ParseContext, start: int) -> ParseResult:
        return arena.parse_id(self.child, ctx, start)

    def fields(self) -> dict[str, Any]:
        return {"child": self.child, "grammar": self.grammar}


class AcParser(_Single):
    """Parses as its child; its GBNF matches everything up to and including a delimiter."""

    __slots__ = ("delimiters",)
    kind = "ac"

    def __init__(self, child: int, delimiters: Sequence[str]):
        super().__init__(child)
        self.delimiters = list(delimiters)

    def parse(self, arena: Arena, ctx: ParseContext, start: int) -> ParseResult:
        return arena.parse_id(self.child, ctx, start)

    def fields(self) -> dict[str, Any]:
        return {"child": self.child, "delimiters": list(self.delimiters)}


def _node_of(result: ParseResult, ctx: ParseContext, rule: str, tag: str) -> ParseResult:
    """A rule's or tag's AST node over a result that did not fail."""
    if result.type == FAIL:
        return result
    raw = ctx.input[result.start : result.end] if result.start < len(ctx.input) else b""
    node_id = ctx.ast.add_node(
        rule,
        tag,
        result.start,
        result.end,
        raw,
        result.nodes,
        result.type == NEED_MORE,
        result.invalid_utf8,
    )
    return ParseResult(result.type, result.start, result.end, [node_id], result.invalid_utf8)


# --- the arena ----------------------------------------------------------------------------------


_KINDS: dict[str, type[PegParser]] = {
    cls.kind: cls
    for cls in (
        EpsilonParser,
        StartParser,
        EndParser,
        LiteralParser,
        SequenceParser,
        ChoiceParser,
        RepetitionParser,
        AndParser,
        NotParser,
        AnyParser,
        SpaceParser,
        CharsParser,
        StringParser,
        UntilParser,
        SchemaParser,
        RuleParser,
        RefParser,
        AtomicParser,
        TagParser,
        GbnfParser,
        AcParser,
    )
}


class Arena:
    """The parsers by id, the named rules, and the root (common_peg_arena)."""

    def __init__(self) -> None:
        self.parsers: list[PegParser] = []
        self.rules: dict[str, int] = {}
        self.root: int = INVALID_ID

    def get(self, parser_id: int) -> PegParser:
        return self.parsers[parser_id]

    def size(self) -> int:
        return len(self.parsers)

    def empty(self) -> bool:
        return not self.parsers

    def get_rule(self, name: str) -> int:
        try:
            return self.rules[name]
        except KeyError:
            raise RuntimeError(f"Rule not found: {name}") from None

    def has_rule(self, name: str) -> bool:
        return name in self.rules

    def set_root(self, parser_id: int) -> None:
        self.root = parser_id

    def add_parser(self, parser: PegParser) -> int:
        self.parsers.append(parser)
        return len(self.parsers) - 1

    def add_rule(self, name: str, parser_id: int) -> None:
        self.rules[name] = parser_id

    def parse(self, ctx: ParseContext, start: int = 0) -> ParseResult:
        if self.root == INVALID_ID:
            raise RuntimeError("No root parser set")
        return self.parsers[self.root].parse(self, ctx, start)

    def parse_id(self, parser_id: int, ctx: ParseContext, start: int) -> ParseResult:
        return self.parsers[parser_id].parse(self, ctx, start)

    def resolve_ref(self, parser_id: int) -> int:
        parser = self.parsers[parser_id]
        if isinstance(parser, RefParser):
            return self.get_rule(parser.name)
        return parser_id

    def resolve_refs(self) -> None:
        """Points every child and the root that is a ref at its rule."""
        for parser in self.parsers:
            parser.map_children(self.resolve_ref)
        if self.root != INVALID_ID:
            self.root = self.resolve_ref(self.root)

    def build_grammar(self, builder: Any, lazy: bool = False) -> None:
        """Adds this arena's GBNF to a grammar builder (see ``peg.gbnf.build_grammar``)."""
        from bankml.engine_cupy.peg.gbnf import arena_grammar

        arena_grammar(self, builder, lazy)

    def dump(self, parser_id: int) -> str:
        return self._dump(parser_id, set())

    def _dump(self, parser_id: int, visited: set[int]) -> str:
        if parser_id in visited:
            return "[cycle]"
        visited.add(parser_id)
        p = self.parsers[parser_id]
        if isinstance(p, EpsilonParser):
            return "Epsilon"
        if isinstance(p, StartParser):
            return "Start"
        if isinstance(p, EndParser):
            return "End"
        if isinstance(p, LiteralParser):
            return f"Literal({p.literal})"
        if isinstance(p, _Multi):
            name = "Choice" if isinstance(p, ChoiceParser) else "Sequence"
            return f"{name}(" + ", ".join(self._dump(c, visited) for c in p.children) + ")"
        if isinstance(p, RepetitionParser):
            hi = "unbounded" if p.max_count == -1 else str(p.max_count)
            return f"Repetition({self._dump(p.child, visited)}, {p.min_count}, {hi})"
        if isinstance(p, CharsParser):
            hi = "unbounded" if p.max_count == -1 else str(p.max_count)
            return f"CharRepeat({p.pattern}, {p.min_count}, {hi})"
        if isinstance(p, StringParser):
            return f"String({p.delimiter})"
        if isinstance(p, UntilParser):
            return "Until(" + " | ".join(p.delimiters) + ")"
        if isinstance(p, SchemaParser):
            kind = p.node.kind if p.node is not None else "null"
            return f"Schema({self._dump(p.child, visited)}, {kind})"
        if isinstance(p, RuleParser):
            return f"Rule({p.name}, {self._dump(p.child, visited)})"
        if isinstance(p, RefParser):
            return f"Ref({p.name})"
        if isinstance(p, TagParser):
            return f"Tag({p.tag}, {self.dump(p.child)})"
        if isinstance(p, GbnfParser):
            return f"Gbnf({p.grammar}, {self._dump(p.child, visited)})"
        if isinstance(p, AcParser):
            return "Ac(" + " | ".join(p.delimiters) + f", {self._dump(p.child, visited)})"
        names = {AndParser: "And", NotParser: "Not", AtomicParser: "Atomic"}
        if isinstance(p, _Single):
            return f"{names[type(p)]}({self._dump(p.child, visited)})"
        return {AnyParser: "Any", SpaceParser: "Space"}.get(type(p), "Unknown")

    # -- serialization (what llama-server keeps of a chat template's parser) --

    def to_json(self) -> dict[str, Any]:
        return {
            "parsers": [{"type": p.kind, **p.fields()} for p in self.parsers],
            "rules": dict(self.rules),
            "root": self.root if self.root != INVALID_ID else 2**64 - 1,
        }

    @staticmethod
    def from_json(j: dict[str, Any]) -> Arena:
        arena = Arena()
        for pj in j["parsers"]:
            kind = pj["type"]
            if kind not in _KINDS:
                raise RuntimeError(f"Unknown parser type: {kind}")
            arena.parsers.append(_parser_from_json(kind, pj))
        arena.rules = dict(j["rules"])
        for name, pid in arena.rules.items():
            if pid >= len(arena.parsers):
                raise RuntimeError(f"Rule '{name}' references invalid parser ID: {pid}")
        root = j["root"]
        arena.root = INVALID_ID if root == 2**64 - 1 else root
        if arena.root != INVALID_ID and arena.root >= len(arena.parsers):
            raise RuntimeError(f"Root references invalid parser ID: {arena.root}")
        return arena

    def save(self) -> str:
        return json.dumps(self.to_json(), ensure_ascii=False, separators=(",", ":"))

    @staticmethod
    def load(data: str) -> Arena:
        return Arena.from_json(json.loads(data))


def _parser_from_json(kind: str, j: dict[str, Any]) -> PegParser:
    if kind in ("epsilon", "start", "end", "any", "space"):
        return _KINDS[kind]()
    if kind == "literal":
        return LiteralParser(j["literal"])
    if kind in ("sequence", "choice"):
        return (ChoiceParser if kind == "choice" else SequenceParser)(list(j["children"]))
    if kind == "repetition":
        return RepetitionParser(j["child"], j["min_count"], j["max_count"])
    if kind in ("and", "not", "atomic"):
        return {"and": AndParser, "not": NotParser, "atomic": AtomicParser}[kind](j["child"])
    if kind == "chars":
        ranges = [(r["start"], r["end"]) for r in j["ranges"]]
        return CharsParser(j["pattern"], ranges, j["negated"], j["min_count"], j["max_count"])
    if kind == "string":
        return StringParser(j["delimiter"][0])
    if kind == "until":
        return UntilParser(j["delimiters"])
    if kind == "schema":
        return SchemaParser(j["child"], j["name"], None, j["raw"])
    if kind == "rule":
        return RuleParser(j["name"], j["child"], j["trigger"])
    if kind == "ref":
        return RefParser(j["name"])
    if kind == "tag":
        return TagParser(j["child"], j["tag"])
    if kind == "gbnf":
        return GbnfParser(j["child"], j["grammar"])
    if not j.get("delimiters"):
        raise RuntimeError("ac parser requires 'child' and a non-empty 'delimiters' array")
    return AcParser(j["child"], j["delimiters"])


# --- the builder --------------------------------------------------------------------------------


class Parser:
    """A parser of a builder's arena: its id, with the combining operators."""

    __slots__ = ("id", "builder")

    def __init__(self, parser_id: int, builder: ParserBuilder):
        self.id = parser_id
        self.builder = builder

    def _other(self, other: Parser | str) -> Parser:
        if isinstance(other, str):
            return self.builder.literal(other)
        if isinstance(other, Parser):
            return other
        return NotImplemented

    def __add__(self, other: Parser | str) -> Parser:
        o = self._other(other)
        if o is NotImplemented:
            return NotImplemented
        return self.builder.sequence([self, o])

    def __radd__(self, other: str) -> Parser:
        o = self._other(other)
        if o is NotImplemented:
            return NotImplemented
        return self.builder.sequence([o, self])

    def __lshift__(self, other: Parser | str) -> Parser:
        o = self._other(other)
        if o is NotImplemented:
            return NotImplemented
        return self.builder.sequence([self, self.builder.space(), o])

    def __rlshift__(self, other: str) -> Parser:
        o = self._other(other)
        if o is NotImplemented:
            return NotImplemented
        return self.builder.sequence([o, self.builder.space(), self])

    def __or__(self, other: Parser | str) -> Parser:
        o = self._other(other)
        if o is NotImplemented:
            return NotImplemented
        return self.builder.choice([self, o])

    def __ror__(self, other: str) -> Parser:
        o = self._other(other)
        if o is NotImplemented:
            return NotImplemented
        return self.builder.choice([o, self])

    def __index__(self) -> int:
        return self.id

    def __repr__(self) -> str:
        return f"Parser({self.id}: {self.builder.arena.dump(self.id)})"


_RULE_NAME = re.compile(r"[^a-zA-Z0-9-]+")


def rule_name(name: str) -> str:
    """A rule name as GBNF allows it: every other run of characters one ``-``."""
    return _RULE_NAME.sub("-", name)


ParserLike = Parser | int


def _ids(parsers: Iterable[ParserLike]) -> list[int]:
    return [p.id if isinstance(p, Parser) else int(p) for p in parsers]


class ParserBuilder:
    """Builds an arena (common_peg_parser_builder); every method returns a ``Parser``."""

    def __init__(self) -> None:
        self.arena = Arena()

    def wrap(self, parser_id: int) -> Parser:
        return Parser(parser_id, self)

    def add(self, parser: PegParser) -> Parser:
        return self.wrap(self.arena.add_parser(parser))

    # -- primitives

    def eps(self) -> Parser:
        """Matches nothing, always succeeds."""
        return self.add(EpsilonParser())

    def start(self) -> Parser:
        return self.add(StartParser())

    def end(self) -> Parser:
        """Matches the end of the input."""
        return self.add(EndParser())

    def literal(self, literal: str) -> Parser:
        return self.add(LiteralParser(literal))

    def sequence(self, parsers: Iterable[ParserLike] = ()) -> Parser:
        """All in order; nested sequences are flattened."""
        flat: list[int] = []
        for pid in _ids(parsers):
            p = self.arena.get(pid)
            if isinstance(p, SequenceParser):
                flat.extend(p.children)
            else:
                flat.append(pid)
        return self.add(SequenceParser(flat))

    def choice(self, parsers: Iterable[ParserLike] = ()) -> Parser:
        """The first that does not fail; nested choices are flattened."""
        flat: list[int] = []
        for pid in _ids(parsers):
            p = self.arena.get(pid)
            if isinstance(p, ChoiceParser):
                flat.extend(p.children)
            else:
                flat.append(pid)
        return self.add(ChoiceParser(flat))

    def one_or_more(self, p: Parser) -> Parser:
        return self.repeat(p, 1, -1)

    def zero_or_more(self, p: Parser) -> Parser:
        return self.repeat(p, 0, -1)

    def optional(self, p: Parser) -> Parser:
        return self.repeat(p, 0, 1)

    def peek(self, p: Parser) -> Parser:
        """Positive lookahead: succeeds where ``p`` does, consumes nothing."""
        return self.add(AndParser(p.id))

    def negate(self, p: Parser) -> Parser:
        """Negative lookahead."""
        return self.add(NotParser(p.id))

    def any(self) -> Parser:
        """One UTF-8 character."""
        return self.add(AnyParser())

    def chars(self, classes: str, min: int = 1, max: int = -1) -> Parser:
        """``min`` to ``max`` (-1: unbounded) characters of a class such as ``[a-z]``."""
        ranges, negated = parse_char_classes(classes)
        return self.add(CharsParser(classes, ranges, negated, min, max))

    def ref(self, name: str) -> Parser:
        return self.add(RefParser(name))

    def space(self) -> Parser:
        """Zero or more blanks (C isspace)."""
        return self.add(SpaceParser())

    def until(self, delimiter: str) -> Parser:
        """Everything up to the delimiter (not consumed)."""
        return self.add(UntilParser([delimiter]))

    def until_one_of(self, delimiters: Sequence[str]) -> Parser:
        return self.add(UntilParser(delimiters))

    def rest(self) -> Parser:
        """Everything."""
        return self.until_one_of([])

    def repeat(self, p: Parser, min: int, max: int | None = None) -> Parser:
        """``min`` to ``max`` (-1: unbounded) repetitions; exactly ``min`` without ``max``."""
        return self.add(RepetitionParser(p.id, min, min if max is None else max))

    # -- strings

    def string_content(self, delimiter: str) -> Parser:
        return self.add(StringParser(delimiter))

    def double_quoted_string(self) -> Parser:
        return self.rule(
            "double-quoted-string",
            lambda: self.sequence([self.literal('"'), self.string_content('"'), self.literal('"')]),
        )

    def single_quoted_string(self) -> Parser:
        return self.rule(
            "single-quoted-string",
            lambda: self.sequence([self.literal("'"), self.string_content("'"), self.literal("'")]),
        )

    def quoted_string(self) -> Parser:
        return self.rule(
            "quoted-string",
            lambda: self.choice([self.double_quoted_string(), self.single_quoted_string()]),
        )

    # -- JSON

    def json_number(self) -> Parser:
        def build() -> Parser:
            digit1_9 = self.chars("[1-9]", 1, 1)
            digits = self.chars("[0-9]")
            int_part = self.choice(
                [self.literal("0"), self.sequence([digit1_9, self.chars("[0-9]", 0, -1)])]
            )
            frac = self.sequence([self.literal("."), digits])
            exp = self.sequence(
                [
                    self.choice([self.literal("e"), self.literal("E")]),
                    self.optional(self.chars("[+-]", 1, 1)),
                    digits,
                ]
            )
            # the number is only committed where the next character cannot extend it
            not_continuation = self.negate(self.chars("[0-9.eE+-]", 1, 1))
            return self.sequence(
                [
                    self.optional(self.literal("-")),
                    int_part,
                    self.optional(frac),
                    self.optional(exp),
                    not_continuation,
                ]
            )

        return self.rule("json-number", build)

    def json_string(self) -> Parser:
        return self.rule(
            "json-string",
            lambda: self.sequence([self.literal('"'), self.string_content('"'), self.literal('"')]),
        )

    def json_bool(self) -> Parser:
        return self.rule(
            "json-bool", lambda: self.choice([self.literal("true"), self.literal("false")])
        )

    def json_null(self) -> Parser:
        return self.rule("json-null", lambda: self.literal("null"))

    def json_object(self) -> Parser:
        def build() -> Parser:
            ws = self.space()
            member = self.sequence([self.json_string(), ws, self.literal(":"), ws, self.json()])
            members = self.sequence(
                [member, self.zero_or_more(self.sequence([ws, self.literal(","), ws, member]))]
            )
            return self.sequence(
                [
                    self.literal("{"),
                    ws,
                    self.choice(
                        [self.literal("}"), self.sequence([members, ws, self.literal("}")])]
                    ),
                ]
            )

        return self.rule("json-object", build)

    def json_array(self) -> Parser:
        def build() -> Parser:
            ws = self.space()
            elements = self.sequence(
                [
                    self.json(),
                    self.zero_or_more(self.sequence([ws, self.literal(","), ws, self.json()])),
                ]
            )
            return self.sequence(
                [
                    self.literal("["),
                    ws,
                    self.choice(
                        [self.literal("]"), self.sequence([elements, ws, self.literal("]")])]
                    ),
                ]
            )

        return self.rule("json-array", build)

    def json(self) -> Parser:
        """Any JSON value."""
        return self.rule(
            "json-value",
            lambda: self.choice(
                [
                    self.json_object(),
                    self.json_array(),
                    self.json_string(),
                    self.json_number(),
                    self.json_bool(),
                    self.json_null(),
                ]
            ),
        )

    def json_member(self, key: str, p: Parser) -> Parser:
        ws = self.space()
        return self.sequence([self.literal(f'"{key}"'), ws, self.literal(":"), ws, p])

    # -- Python literals

    def python_string(self) -> Parser:
        return self.rule(
            "python-string",
            lambda: self.choice([self.double_quoted_string(), self.single_quoted_string()]),
        )

    def python_number(self) -> Parser:
        return self.json_number()

    def python_bool(self) -> Parser:
        return self.rule(
            "python-bool", lambda: self.choice([self.literal("True"), self.literal("False")])
        )

    def python_null(self) -> Parser:
        return self.rule("python-none", lambda: self.literal("None"))

    def python_dict(self) -> Parser:
        def build() -> Parser:
            ws = self.space()
            member = self.sequence(
                [self.python_string(), ws, self.literal(":"), ws, self.python_value()]
            )
            members = self.sequence(
                [member, self.zero_or_more(self.sequence([ws, self.literal(","), ws, member]))]
            )
            return self.sequence(
                [
                    self.literal("{"),
                    ws,
                    self.choice(
                        [self.literal("}"), self.sequence([members, ws, self.literal("}")])]
                    ),
                    ws,
                ]
            )

        return self.rule("python-dict", build)

    def python_array(self) -> Parser:
        def build() -> Parser:
            ws = self.space()
            elements = self.sequence(
                [
                    self.python_value(),
                    self.zero_or_more(self.sequence([self.literal(","), ws, self.python_value()])),
                ]
            )
            return self.sequence(
                [
                    self.literal("["),
                    ws,
                    self.choice(
                        [self.literal("]"), self.sequence([elements, ws, self.literal("]")])]
                    ),
                    ws,
                ]
            )

        return self.rule("python-array", build)

    def python_value(self) -> Parser:
        return self.rule(
            "python-value",
            lambda: self.choice(
                [
                    self.python_dict(),
                    self.python_array(),
                    self.python_string(),
                    self.python_number(),
                    self.python_bool(),
                    self.python_null(),
                ]
            ),
        )

    def marker(self) -> Parser:
        """Text between ``<`` and ``>`` or ``[`` and ``]``."""
        sharp = self.cat(
            lambda: self.literal("<"), lambda: self.until(">"), lambda: self.literal(">")
        )
        square = self.cat(
            lambda: self.literal("["), lambda: self.until("]"), lambda: self.literal("]")
        )
        return self.choice([sharp, square])

    # -- chains in llama-server's allocation order

    def cat(self, *parts: Parser | str | Callable[[], Parser]) -> Parser:
        """``a + b + c ...`` with the parsers allocated as llama-server's build allocates them.

        Parser ids follow allocation order and name GBNF rules (``until-12``). C++ leaves the
        order of the two operands of ``+`` unspecified and GCC, which builds llama-server,
        evaluates the right one first; Python evaluates the left one first. Pass an operand
        that allocates as a function (``lambda: p.until("</x>")``): the functions are called
        right to left, then the operands combined left to right as ``+`` does (a ``str`` is a
        literal made at combination time, as C++'s ``+ "text"``)."""
        return self._fold(parts, lambda a, b: a + b)

    def alt(self, *parts: Parser | str | Callable[[], Parser]) -> Parser:
        """``a | b | c ...`` in llama-server's allocation order (see ``cat``)."""
        return self._fold(parts, lambda a, b: a | b)

    def _fold(self, parts: Sequence[Any], op: Callable[[Any, Any], Any]) -> Parser:
        built: list[Any] = list(parts)
        for i in reversed(range(len(built))):
            if callable(built[i]):
                built[i] = built[i]()
        acc = built[0]
        for part in built[1:]:
            acc = op(acc, part)
        return acc

    # -- schema, rules, tags

    def schema(self, p: Parser, name: str, schema: Any, raw: bool = False) -> Parser:
        """``p`` for parsing; the JSON schema's GBNF (rule ``name``) for the grammar. ``raw``: a
        value the schema allows as a string is written bare, so its GBNF is ``p``'s.
        A schema outside the convertible subset raises SchemaConversionError (the reason
        alone, as llama.cpp's common_chat_schema_from_json throws it)."""
        if isinstance(schema, Node):
            node = schema
            source = None
        else:
            try:
                node = _Builder(schema).build()
            except _SchemaError as err:
                raise SchemaConversionError(str(err)) from None
            source = schema
        return self.add(SchemaParser(p.id, name, node, raw, source))

    def rule(
        self,
        name: str,
        p: Parser | Callable[[], Parser],
        trigger: bool = False,
    ) -> Parser:
        """A named rule (a GBNF rule of its own, a ``rule`` node in the AST); returns a ref.
        ``p`` may be a function building the rule's parser: then a rule of that name already
        defined is reused, and the function may refer to the rule (recursion)."""
        clean = rule_name(name)
        if isinstance(p, Parser):
            rule_id = self.arena.add_parser(RuleParser(clean, p.id, trigger))
            self.arena.add_rule(clean, rule_id)
            return self.ref(clean)
        if self.arena.has_rule(clean):
            return self.ref(clean)
        placeholder = self.any()
        placeholder_id = self.arena.add_parser(RuleParser(clean, placeholder.id, trigger))
        self.arena.add_rule(clean, placeholder_id)
        parser = p()
        rule_id = self.arena.add_parser(RuleParser(clean, parser.id, trigger))
        self.arena.rules[clean] = rule_id
        return self.ref(clean)

    def trigger_rule(self, name: str, p: Parser | Callable[[], Parser]) -> Parser:
        """A rule that starts a lazy grammar."""
        return self.rule(name, p, True)

    def atomic(self, p: Parser) -> Parser:
        """``p``, without AST nodes while it is incomplete (NEED_MORE_INPUT)."""
        return self.add(AtomicParser(p.id))

    def tag(self, tag: str, p: Parser) -> Parser:
        """An AST node named ``tag`` over ``p``'s match."""
        return self.add(TagParser(p.id, tag))

    def gbnf(self, p: Parser, grammar: str) -> Parser:
        """Parses as ``p``, writes ``grammar`` as its GBNF."""
        return self.add(GbnfParser(p.id, grammar))

    def ac(self, p: Parser, delimiters: str | Sequence[str]) -> Parser:
        """Parses as ``p``; its GBNF matches everything up to and including the first
        delimiter (an Aho-Corasick automaton)."""
        delims = [delimiters] if isinstance(delimiters, str) else list(delimiters)
        if not delims:
            raise RuntimeError("ac parser requires at least one delimiter")
        return self.add(AcParser(p.id, delims))

    def set_root(self, p: Parser) -> None:
        self.arena.set_root(p.id)

    def build(self) -> Arena:
        self.arena.resolve_refs()
        return self.arena


def build_peg_parser(fn: Callable[[ParserBuilder], Parser]) -> Arena:
    builder = ParserBuilder()
    builder.set_root(fn(builder))
    return builder.build()
