"""GBNF from a PEG arena: llama-server's common_peg_arena::build_grammar and build_grammar.

The grammar that constrains a chat answer (tool calls, a response_format) is written from the
same arena that parses the answer. Each named rule of the arena becomes a GBNF rule; a JSON
schema parser becomes the rules of llama-server's schema converter
(``json_schema_grammar._Converter``); an ``until`` parser becomes the complement of an
Aho-Corasick automaton over its delimiters (text that contains none of them) and an ``ac``
parser the automaton itself (text up to and including the first delimiter). Lookaheads and
start/end write nothing. A lazy grammar has only the trigger rules (and what they use) under
``root``. Rules come out sorted by name, one ``name ::= body`` a line, as llama-server's.

Public API::

    build_grammar(fn, dotall=False) -> str
        calls ``fn(builder)`` with a ``GrammarBuilder`` and returns the grammar text; raises
        SchemaConversionError (llama-server's "JSON schema conversion failed:" text) where a
        schema cannot be converted. Typical use:
            build_grammar(lambda b: arena.build_grammar(b, lazy))
    GrammarBuilder       add_rule(name, body) -> name used; add_schema(name, node) -> rule name
    arena_grammar(arena, builder, lazy=False)    what Arena.build_grammar does
    AhoCorasick(words)   the automaton (common_aho_corasick): num_states() is_terminal(s) next(s, c)
    gbnf_char_class(codepoints, negate) -> str
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

from bankml.engine_cupy.json_schema_grammar import (
    Node,
    SchemaConversionError,
    _Converter,
    _SchemaError,
    format_literal,
)
from bankml.engine_cupy.peg.parser import (
    INVALID_ID,
    AcParser,
    AndParser,
    AnyParser,
    Arena,
    AtomicParser,
    CharsParser,
    ChoiceParser,
    EndParser,
    EpsilonParser,
    GbnfParser,
    LiteralParser,
    NotParser,
    PegParser,
    RefParser,
    RepetitionParser,
    RuleParser,
    SchemaParser,
    SequenceParser,
    SpaceParser,
    StartParser,
    StringParser,
    TagParser,
    Trie,
    UntilParser,
)
from bankml.engine_cupy.peg.schema import may_be_string


class GrammarBuilder:
    """Rules into one grammar (common_grammar_builder over the schema converter)."""

    def __init__(self, dotall: bool = False):
        self.converter = _Converter(dotall)

    def add_rule(self, name: str, body: str) -> str:
        return self.converter.add_rule(name, body)

    def add_schema(self, name: str, node: Node) -> str:
        return self.converter.visit(node, "" if name == "root" else name)

    def text(self) -> str:
        try:
            self.converter.check_errors()
        except _SchemaError as err:
            raise SchemaConversionError(str(err)) from None
        return self.converter.format_grammar()


def build_grammar(fn: Callable[[GrammarBuilder], object], dotall: bool = False) -> str:
    builder = GrammarBuilder(dotall)
    fn(builder)
    return builder.text()


# --- Aho-Corasick (common/trie.cpp) --------------------------------------------------------------


class AhoCorasick:
    def __init__(self, words: Sequence[str]):
        self.trie = Trie(words)
        children = self.trie.children
        n = len(children)
        self.fail = [0] * n
        order: list[int] = []
        queue = deque([0])
        while queue:
            u = queue.popleft()
            order.append(u)
            for ch, v in sorted(children[u].items()):
                if u != 0:
                    f = self.fail[u]
                    while f and ch not in children[f]:
                        f = self.fail[f]
                    nxt = children[f].get(ch)
                    self.fail[v] = nxt if nxt is not None and nxt != v else 0
                queue.append(v)
        self.match = [-1] * n
        for u in order:
            pattern = self.trie.pattern[u]
            self.match[u] = pattern if pattern >= 0 else (self.match[self.fail[u]] if u else -1)
        self.alphabet = sorted({ch for node in children for ch in node})

    def num_states(self) -> int:
        return len(self.trie.children)

    def is_terminal(self, state: int) -> bool:
        return self.match[state] >= 0

    def next(self, state: int, ch: int) -> int:
        children = self.trie.children
        while state and ch not in children[state]:
            state = self.fail[state]
        return children[state].get(ch, 0)


def _escape_class_char(c: int) -> str:
    if c in (0x2D, 0x5D, 0x5B, 0x5C):  # - ] [ backslash
        return "\\" + chr(c)
    if c == 0x0A:
        return "\\n"
    if c == 0x09:
        return "\\t"
    if c == 0x0D:
        return "\\r"
    if 0x20 <= c <= 0x7E:
        return chr(c)
    if c <= 0xFF:
        return f"\\x{c:02X}"
    if c <= 0xFFFF:
        return f"\\u{c:04X}"
    return f"\\U{c:08X}"


def gbnf_char_class(chars: Sequence[int], negate: bool) -> str:
    return ("[^" if negate else "[") + "".join(_escape_class_char(c) for c in chars) + "]"


RuleBody = Callable[[list[int], dict[int, list[int]], list[int], Callable[[int], str]], str]


def _ac_grammar(
    builder: GrammarBuilder, prefix: str, strings: Sequence[str], body: RuleBody
) -> str:
    ac = AhoCorasick(strings)

    def state_name(s: int) -> str:
        return prefix if s == 0 else f"{prefix}-{s:02d}"

    for q in range(ac.num_states()):
        if ac.is_terminal(q):
            continue
        buckets: dict[int, list[int]] = {}
        completing: list[int] = []
        specific: list[int] = []
        for c in ac.alphabet:
            d = ac.next(q, c)
            if ac.is_terminal(d):
                completing.append(c)
                specific.append(c)
            elif d != 0:
                buckets.setdefault(d, []).append(c)
                specific.append(c)
        builder.add_rule(
            state_name(q), body(completing, dict(sorted(buckets.items())), specific, state_name)
        )
    if ac.is_terminal(0):
        builder.add_rule(prefix, "|")
    return state_name(0)


def _excluding(builder: GrammarBuilder, prefix: str, strings: Sequence[str]) -> str:
    """Text containing none of ``strings``: every state accepts, no completing character."""

    def body(
        completing: list[int],
        buckets: dict[int, list[int]],
        specific: list[int],
        state_name: Callable[[int], str],
    ) -> str:
        rhs = "|"
        for d, chars in buckets.items():
            rhs += f" {gbnf_char_class(chars, False)} {state_name(d)} |"
        return rhs + f" {gbnf_char_class(specific, True)} {state_name(0)}"

    return _ac_grammar(builder, prefix, strings, body)


def _including(builder: GrammarBuilder, prefix: str, strings: Sequence[str]) -> str:
    """Text up to and including the first of ``strings``."""

    def body(
        completing: list[int],
        buckets: dict[int, list[int]],
        specific: list[int],
        state_name: Callable[[int], str],
    ) -> str:
        alts = []
        if completing:
            alts.append(gbnf_char_class(completing, False))
        for d, chars in buckets.items():
            alts.append(f"{gbnf_char_class(chars, False)} {state_name(d)}")
        alts.append(f"{gbnf_char_class(specific, True)} {state_name(0)}")
        return " | ".join(alts)

    return _ac_grammar(builder, prefix, strings, body)


# --- the arena's grammar -------------------------------------------------------------------------


def _reachable_rules(arena: Arena, start: int) -> set[str]:
    reachable: set[str] = set()
    visited: set[str] = set()
    stack = [start]
    while stack:
        p = arena.get(stack.pop())
        if isinstance(p, RuleParser):
            if p.name in visited:
                continue
            visited.add(p.name)
            reachable.add(p.name)
            stack.append(p.child)
        elif isinstance(p, RefParser):
            stack.append(arena.get_rule(p.name))
        else:
            stack.extend(reversed(p.child_ids()))
    return reachable


def _repeat_suffix(body: str, lo: int, hi: int) -> str:
    if lo == 0 and hi == 1:
        return body + "?"
    if lo == 0 and hi == -1:
        return body + "*"
    if lo == 1 and hi == -1:
        return body + "+"
    if hi == -1:
        return f"{body}{{{lo},}}"
    if lo == hi:
        return body if lo == 1 else f"{body}{{{lo}}}"
    return f"{body}{{{lo},{hi}}}"


def arena_grammar(arena: Arena, builder: GrammarBuilder, lazy: bool = False) -> None:
    """Adds the arena's rules and ``root`` to ``builder`` (common_peg_arena::build_grammar)."""

    def schema_delegates(s: SchemaParser) -> bool:
        # a raw string value is parsed by the child rather than constrained by the schema
        return s.node is None or (s.raw and may_be_string(s.node))

    def effective(pid: int) -> PegParser:
        while True:
            p = arena.get(pid)
            if isinstance(p, (TagParser, AtomicParser)) or (
                isinstance(p, SchemaParser) and schema_delegates(p)
            ):
                pid = p.child
            else:
                return p

    def grouped(pid: int, body: str, sequences_too: bool) -> str:
        p = effective(pid)
        if isinstance(p, ChoiceParser) or (sequences_too and isinstance(p, SequenceParser)):
            return f"({body})"
        return body

    def to_gbnf(pid: int) -> str:
        p = arena.get(pid)
        if isinstance(p, (EpsilonParser, StartParser, EndParser, AndParser, NotParser)):
            return ""
        if isinstance(p, LiteralParser):
            return format_literal(p.literal)
        if isinstance(p, SequenceParser):
            parts = []
            for child in p.children:
                body = to_gbnf(child)
                if body:
                    parts.append(grouped(child, body, True))
            return " ".join(parts)
        if isinstance(p, ChoiceParser):
            # an empty first alternative is dropped, as llama-server's writer does
            text = ""
            for child in p.children:
                if text:
                    text += " | "
                text += grouped(child, to_gbnf(child), False)
            return text
        if isinstance(p, RepetitionParser):
            return _repeat_suffix(
                grouped(p.child, to_gbnf(p.child), True), p.min_count, p.max_count
            )
        if isinstance(p, AnyParser):
            return "."
        if isinstance(p, SpaceParser):
            return "space"
        if isinstance(p, CharsParser):
            return _repeat_suffix(p.pattern, p.min_count, p.max_count)
        if isinstance(p, StringParser):
            d = p.delimiter
            return f'( [^{d}\\\\] | "\\\\" ( [{d}\\\\/ bfnrt] | "u" [0-9a-fA-F]{{4}} ) )*'
        if isinstance(p, UntilParser):
            if not p.delimiters:
                return ".*"
            return _excluding(builder, f"until-{pid}", p.delimiters)
        if isinstance(p, SchemaParser):
            if schema_delegates(p):
                return to_gbnf(p.child)
            assert p.node is not None
            return builder.add_schema(p.name, p.node)
        if isinstance(p, (RuleParser, RefParser)):
            return p.name
        if isinstance(p, (TagParser, AtomicParser)):
            return to_gbnf(p.child)
        if isinstance(p, GbnfParser):
            return p.grammar
        if isinstance(p, AcParser):
            return _including(builder, f"ac-{pid}", p.delimiters)
        raise TypeError(f"no GBNF for {type(p).__name__}")

    def rule_of(pid: int) -> RuleParser | None:
        p = arena.get(pid)
        return p if isinstance(p, RuleParser) else None

    reachable: set[str] = set()
    if lazy:
        for name, pid in arena.rules.items():
            rule = rule_of(pid)
            if rule is not None and rule.trigger:
                reachable.add(name)
                reachable |= _reachable_rules(arena, pid)
    elif arena.root != INVALID_ID:
        reachable = _reachable_rules(arena, arena.root)

    for name, pid in arena.rules.items():
        rule = rule_of(pid)
        if name in reachable and rule is not None:
            builder.add_rule(rule.name, to_gbnf(rule.child))

    if lazy:
        triggers = sorted(
            rule.name for pid in arena.rules.values() if (rule := rule_of(pid)) and rule.trigger
        )
        builder.add_rule("root", " | ".join(triggers))
    elif arena.root != INVALID_ID:
        builder.add_rule("root", to_gbnf(arena.root))
