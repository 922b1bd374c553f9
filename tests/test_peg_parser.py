"""The PEG parser arena (bankml.engine_cupy.peg.parser and .gbnf) against llama.cpp's own tests.

The cases restate llama.cpp's tests/peg-parser/ (test-basic, test-gbnf-generation,
test-json-parser, test-json-serialization, test-python-dict-parser, test-unicode): parse results
full and partial, the matched text, invalid UTF-8 recorded and replaced, and the exact GBNF text.
tests/test_chat_peg.py compares the same machinery with llama.cpp's code side by side.
"""

from __future__ import annotations

import json
import re

import pytest

from bankml.engine_cupy.peg.gbnf import build_grammar
from bankml.engine_cupy.peg.parser import (
    Arena,
    InvalidUtf8,
    ParseContext,
    ParseFlags,
    ParserBuilder,
    ParseResultType,
    build_peg_parser,
)

LENIENT = ParseFlags.LENIENT
SUCCESS = ParseResultType.SUCCESS
NEED_MORE = ParseResultType.NEED_MORE_INPUT
FAIL = ParseResultType.FAIL
SPACE_RULE = 'space ::= | " " | "\\n"{1,2} [ \\t]{0,20}'


def parse(arena: Arena, text: str | bytes, flags: ParseFlags = ParseFlags.NONE):
    ctx = ParseContext(text, flags)
    return arena.parse(ctx), ctx


def gbnf(arena: Arena, lazy: bool = False) -> str:
    return build_grammar(lambda b: arena.build_grammar(b, lazy))


def lines(text: str) -> str:
    """An expected grammar written indented, one rule a line."""
    return re.sub(r"(^|\n)\s+", r"\1", text.strip()) + "\n"


# --- test-basic ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("classes", "text", "ok"),
    [
        ("[\\n\\t\\\\]", "\n", True),
        ("[\\n\\t\\\\]", "\t", True),
        ("[\\n\\t\\\\]", "\\", True),
        ("[\\n\\t\\\\]", " ", False),
        ("[a\\-z]", "a", True),
        ("[a\\-z]", "-", True),
        ("[a\\-z]", "z", True),
        ("[a\\-z]", "b", False),  # \- is a dash, not a range
        ("a-z", "a", True),
        ("a-z", "A", False),
        ("a-z-", "f", True),
        ("a-z-", "-", True),
        ("a-z-", "A", False),
    ],
)
def test_char_classes(classes: str, text: str, ok: bool) -> None:
    result, _ = parse(build_peg_parser(lambda p: p.chars(classes)), text)
    assert result.success() is ok and result.fail() is not ok


def test_optional() -> None:
    arena = build_peg_parser(lambda p: p.literal("hello") + p.optional(p.literal(" world")))
    result, _ = parse(arena, "hello world")
    assert result.success() and result.end == 11
    result, _ = parse(arena, "hello")
    assert result.success() and result.end == 5
    result, _ = parse(arena, "hello ", LENIENT)  # " world" may still come
    assert result.need_more_input()


@pytest.mark.parametrize(
    ("build", "text", "flags", "expected"),
    [
        (lambda p: p.literal("hello"), "hello", 0, SUCCESS),
        (lambda p: p.literal("<think>") + p.literal("</think>"), "<thi", LENIENT, NEED_MORE),
        (lambda p: p.literal("begin") + p.literal("end"), "begin", LENIENT, NEED_MORE),
        (lambda p: p.literal("<think>") + p.literal("</think>"), "<think></", LENIENT, NEED_MORE),
        (lambda p: p.literal("hello") + p.literal("world"), "helloworld", 0, SUCCESS),
        (lambda p: p.literal("<think>") + p.literal("</think>"), "<think>I am", LENIENT, FAIL),
        (lambda p: p.literal("option1") | p.literal("option2"), "opt", LENIENT, NEED_MORE),
        (lambda p: p.literal("choice_a") | p.literal("choice_b"), "choice", LENIENT, NEED_MORE),
        (lambda p: p.literal("first") | p.literal("second"), "first", 0, SUCCESS),
        (lambda p: p.literal("alpha") | p.literal("beta"), "beta", 0, SUCCESS),
        (lambda p: p.literal("good") | p.literal("better"), "best", 0, FAIL),
        (lambda p: p.zero_or_more(p.literal("ab")), "a", LENIENT, NEED_MORE),
        (lambda p: p.zero_or_more(p.literal("xy")), "xyx", LENIENT, NEED_MORE),
        (lambda p: p.zero_or_more(p.literal("test")), "test", 0, SUCCESS),
        (lambda p: p.one_or_more(p.literal("repeat")), "rep", LENIENT, NEED_MORE),
        (lambda p: p.one_or_more(p.literal("ab")), "aba", LENIENT, NEED_MORE),
        (lambda p: p.one_or_more(p.literal("single")), "single", 0, SUCCESS),
        (lambda p: p.one_or_more(p.literal("()")), "success", 0, FAIL),
        # without LENIENT an input that stops early is a failure
        (lambda p: p.literal("<think>") + p.literal("</think>"), "<thi", 0, FAIL),
    ],
)
def test_partial_parsing(build, text: str, flags: int, expected: ParseResultType) -> None:
    result, _ = parse(build_peg_parser(build), text, ParseFlags(flags))
    assert result.type == expected


def _value_grammar(p: ParserBuilder):
    p.rule("number", p.chars("0-9"))
    p.rule("list", p.literal("[") + p.ref("value") + p.literal("]"))
    return p.rule("value", p.ref("number") | p.ref("list"))


@pytest.mark.parametrize(
    ("text", "flags", "expected"),
    [
        ("1", 0, SUCCESS),
        ("[1]", 0, SUCCESS),
        ("[[2]]", 0, SUCCESS),
        ("[[[3]]]", 0, SUCCESS),
        ("[[", LENIENT, NEED_MORE),
        ("[a]", 0, FAIL),
    ],
)
def test_recursive_rules(text: str, flags: int, expected: ParseResultType) -> None:
    result, _ = parse(build_peg_parser(_value_grammar), text, ParseFlags(flags))
    assert result.type == expected


def test_marker() -> None:
    arena = build_peg_parser(lambda p: p.marker())
    assert parse(arena, "[marker]")[0].success()
    assert parse(arena, "<marker>")[0].success()
    assert parse(arena, "marker")[0].fail()


def test_rule_nodes_and_tags() -> None:
    arena = build_peg_parser(
        lambda p: p.rule("greeting", p.tag("word", p.until(" ")) + " " + p.tag("name", p.rest()))
    )
    result, ctx = parse(arena, "hello world")
    assert result.success()
    (top,) = result.nodes
    node = ctx.ast.get(top)
    assert (node.rule, node.tag, node.text, node.is_partial) == (
        "greeting",
        "",
        "hello world",
        False,
    )
    tags = [(ctx.ast.get(c).tag, ctx.ast.get(c).text) for c in node.children]
    assert tags == [("word", "hello"), ("name", "world")]
    assert ctx.ast.find_by_tag(node, "name") == node.children[1]
    # partial: the nodes are kept, marked partial
    result, ctx = parse(arena, "hello wor", LENIENT)
    assert result.need_more_input()
    assert ctx.ast.get(result.nodes[0]).is_partial


def test_atomic_drops_partial_nodes() -> None:
    arena = build_peg_parser(lambda p: p.atomic(p.tag("t", p.literal("abc"))))
    result, ctx = parse(arena, "ab", LENIENT)
    assert result.need_more_input() and result.nodes == []
    result, ctx = parse(arena, "abc", LENIENT)
    assert result.success() and ctx.ast.get(result.nodes[0]).text == "abc"


def test_rule_builder_is_reused_and_recursive() -> None:
    p = ParserBuilder()
    first = p.json()
    size = p.arena.size()
    p.json()  # already defined: only a new reference
    assert p.arena.size() == size + 1
    assert p.arena.get(first.id).name == "json-value"


# --- test-gbnf-generation ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("build", "expected"),
    [
        (lambda p: p.literal("hello"), 'root ::= "hello"'),
        (lambda p: p.chars("[a-z]", 1, 1), "root ::= [a-z]"),
        (
            lambda p: p.literal("hello") + p.literal(" ") + p.literal("world"),
            'root ::= "hello" " " "world"',
        ),
        (lambda p: p.literal("cat") | p.literal("dog"), 'root ::= "cat" | "dog"'),
        (lambda p: p.one_or_more(p.literal("a")), 'root ::= "a"+'),
        (lambda p: p.zero_or_more(p.literal("a")), 'root ::= "a"*'),
        (
            lambda p: p.literal("hello") + p.optional(p.literal(" world")),
            'root ::= "hello" " world"?',
        ),
        (lambda p: p.one_or_more(p.literal("a") | p.literal("b")), 'root ::= ("a" | "b")+'),
        (lambda p: p.literal("hello\nworld\n!"), 'root ::= "hello\\nworld\\n!"'),
        (lambda p: p.literal("hello") << p.literal("world"), 'root ::= "hello" space "world"'),
        (
            lambda p: p.literal("a") + p.tag("t", p.literal("b") | p.literal("c")),
            'root ::= "a" ("b" | "c")',
        ),
        (
            lambda p: p.tag("t", p.literal("a") + p.literal("b")) | p.literal("c"),
            'root ::= "a" "b" | "c"',
        ),
        (
            lambda p: p.one_or_more(p.atomic(p.literal("a") | p.literal("b"))),
            'root ::= ("a" | "b")+',
        ),
        (lambda p: p.literal("hello") + p.gbnf(p.literal("world"), ""), 'root ::= "hello"'),
        (
            lambda p: p.literal("a") + p.gbnf(p.literal("b") | p.literal("c"), "") + p.literal("d"),
            'root ::= "a" "d"',
        ),
        (lambda p: p.literal("a") + p.tag("t", p.gbnf(p.literal("b"), "")), 'root ::= "a"'),
        (lambda p: p.literal("a") + p.gbnf(p.literal("b"), "[a-z]+"), 'root ::= "a" [a-z]+'),
        (
            lambda p: p.literal("x") + p.tag("outer", p.atomic(p.literal("a") | p.literal("b"))),
            'root ::= "x" ("a" | "b")',
        ),
        # repetition counts, lookaheads and anchors write nothing, a string's content
        (lambda p: p.repeat(p.literal("a"), 2, 5), 'root ::= "a"{2,5}'),
        (lambda p: p.repeat(p.literal("a"), 3), 'root ::= "a"{3}'),
        (lambda p: p.repeat(p.literal("a"), 2, -1), 'root ::= "a"{2,}'),
        (lambda p: p.chars("[0-9]", 0, 1), "root ::= [0-9]?"),
        (
            lambda p: (
                p.start() + p.peek(p.literal("a")) + p.any() + p.negate(p.literal("b")) + p.end()
            ),
            "root ::= .",
        ),
        (lambda p: p.rest(), "root ::= .*"),
        (
            lambda p: p.string_content("'"),
            """root ::= ( [^'\\\\] | "\\\\" ( ['\\\\/ bfnrt] | "u" [0-9a-fA-F]{4} ) )*""",
        ),
    ],
)
def test_gbnf_single_rule(build, expected: str) -> None:
    assert gbnf(build_peg_parser(build)) == f"{expected}\n{SPACE_RULE}\n"


def test_gbnf_until() -> None:
    assert gbnf(build_peg_parser(lambda p: p.until("</tag>"))) == lines(
        """
        root ::= until-0
        space ::= | " " | "\\n"{1,2} [ \\t]{0,20}
        until-0 ::= | [<] until-0-01 | [^<] until-0
        until-0-01 ::= | [<] until-0-01 | [/] until-0-02 | [^/<] until-0
        until-0-02 ::= | [<] until-0-01 | [t] until-0-03 | [^<t] until-0
        until-0-03 ::= | [<] until-0-01 | [a] until-0-04 | [^<a] until-0
        until-0-04 ::= | [<] until-0-01 | [g] until-0-05 | [^<g] until-0
        until-0-05 ::= | [<] until-0-01 | [^<>] until-0
        """
    )


def test_gbnf_until_overlapping_delimiter() -> None:
    text = gbnf(build_peg_parser(lambda p: p.until("\n</parameter>\n")))
    assert "until-0-12 ::= | [\\n] until-0-01 | [>] until-0-13 | [^\\n>] until-0\n" in text
    assert "until-0-13 ::= | [^\\n] until-0\n" in text
    assert text.count("\n") == 16  # root, space, 14 states


def test_gbnf_until_unicode_delimiter() -> None:
    assert gbnf(build_peg_parser(lambda p: p.until("<｜DSML｜"))) == lines(
        """
        root ::= until-0
        space ::= | " " | "\\n"{1,2} [ \\t]{0,20}
        until-0 ::= | [<] until-0-01 | [^<] until-0
        until-0-01 ::= | [<] until-0-01 | [\\uFF5C] until-0-02 | [^<\\uFF5C] until-0
        until-0-02 ::= | [<] until-0-01 | [D] until-0-03 | [^<D] until-0
        until-0-03 ::= | [<] until-0-01 | [S] until-0-04 | [^<S] until-0
        until-0-04 ::= | [<] until-0-01 | [M] until-0-05 | [^<M] until-0
        until-0-05 ::= | [<] until-0-01 | [L] until-0-06 | [^<L] until-0
        until-0-06 ::= | [<] until-0-01 | [^<\\uFF5C] until-0
        """
    )


def test_gbnf_until_multiple_delimiters() -> None:
    assert gbnf(build_peg_parser(lambda p: p.until_one_of(["ab", "cd", "ef"]))) == lines(
        """
        root ::= until-0
        space ::= | " " | "\\n"{1,2} [ \\t]{0,20}
        until-0 ::= | [a] until-0-01 | [c] until-0-03 | [e] until-0-05 | [^ace] until-0
        until-0-01 ::= | [a] until-0-01 | [c] until-0-03 | [e] until-0-05 | [^abce] until-0
        until-0-03 ::= | [a] until-0-01 | [c] until-0-03 | [e] until-0-05 | [^acde] until-0
        until-0-05 ::= | [a] until-0-01 | [c] until-0-03 | [e] until-0-05 | [^acef] until-0
        """
    )


def test_gbnf_ac() -> None:
    arena = build_peg_parser(
        lambda p: p.ac(p.cat(lambda: p.until("</tag>"), lambda: p.literal("</tag>")), "</tag>")
    )
    assert gbnf(arena) == lines(
        """
        ac-3 ::= [<] ac-3-01 | [^<] ac-3
        ac-3-01 ::= [<] ac-3-01 | [/] ac-3-02 | [^/<] ac-3
        ac-3-02 ::= [<] ac-3-01 | [t] ac-3-03 | [^<t] ac-3
        ac-3-03 ::= [<] ac-3-01 | [a] ac-3-04 | [^<a] ac-3
        ac-3-04 ::= [<] ac-3-01 | [g] ac-3-05 | [^<g] ac-3
        ac-3-05 ::= [>] | [<] ac-3-01 | [^<>] ac-3
        root ::= ac-3
        space ::= | " " | "\\n"{1,2} [ \\t]{0,20}
        """
    )
    # the parser itself consumes up to and including the delimiter
    result, _ = parse(arena, "abc</tag>")
    assert result.success() and result.end == 9


def test_gbnf_ac_multiple_delimiters() -> None:
    assert gbnf(build_peg_parser(lambda p: p.ac(p.eps(), ["ab", "cd", "ef"]))) == lines(
        """
        ac-1 ::= [a] ac-1-01 | [c] ac-1-03 | [e] ac-1-05 | [^ace] ac-1
        ac-1-01 ::= [b] | [a] ac-1-01 | [c] ac-1-03 | [e] ac-1-05 | [^abce] ac-1
        ac-1-03 ::= [d] | [a] ac-1-01 | [c] ac-1-03 | [e] ac-1-05 | [^acde] ac-1
        ac-1-05 ::= [f] | [a] ac-1-01 | [c] ac-1-03 | [e] ac-1-05 | [^acef] ac-1
        root ::= ac-1
        space ::= | " " | "\\n"{1,2} [ \\t]{0,20}
        """
    )


def test_gbnf_rules() -> None:
    def digits(p: ParserBuilder):
        return p.one_or_more(p.rule("digit", p.chars("[0-9]", 1, 1)))

    assert gbnf(build_peg_parser(digits)) == lines(
        f"""
        digit ::= [0-9]
        root ::= digit+
        {SPACE_RULE}
        """
    )

    def orphan(p: ParserBuilder):
        p.rule("orphan", p.literal("orphan"))
        return p.literal("hello") + p.rule("child", p.literal(" world"))

    assert gbnf(build_peg_parser(orphan)) == lines(
        f"""
        child ::= " world"
        root ::= "hello" child
        {SPACE_RULE}
        """
    )


def test_gbnf_lazy_keeps_trigger_rules() -> None:
    def rules(p: ParserBuilder):
        rule1 = p.rule("rule-1", p.literal("a") + p.ref("rule-2"))
        p.rule("rule-2", p.literal("b") + p.ref("rule-3"), True)
        p.rule("rule-3", p.literal("c") + p.ref("rule-4"))
        p.rule("rule-4", p.literal("d"), True)
        return rule1

    arena = build_peg_parser(rules)
    assert gbnf(arena) == lines(
        f"""
        root ::= rule-1
        rule-1 ::= "a" rule-2
        rule-2 ::= "b" rule-3
        rule-3 ::= "c" rule-4
        rule-4 ::= "d"
        {SPACE_RULE}
        """
    )
    assert gbnf(arena, lazy=True) == lines(
        f"""
        root ::= rule-2 | rule-4
        rule-2 ::= "b" rule-3
        rule-3 ::= "c" rule-4
        rule-4 ::= "d"
        {SPACE_RULE}
        """
    )


def test_gbnf_empty_first_alternative_is_dropped() -> None:
    # llama-server's writer puts " | " only after text: an empty first alternative vanishes
    assert gbnf(build_peg_parser(lambda p: p.eps() | p.literal("a"))).startswith('root ::= "a"\n')
    assert gbnf(build_peg_parser(lambda p: p.literal("a") | p.eps())).startswith(
        'root ::= "a" | \n'
    )


def test_rule_names_are_cleaned() -> None:
    arena = build_peg_parser(lambda p: p.rule("tool get_weather!", p.literal("x")))
    assert gbnf(arena) == f'root ::= tool-get-weather-\n{SPACE_RULE}\ntool-get-weather- ::= "x"\n'


def test_cat_allocates_as_llama_server() -> None:
    """GCC evaluates the right operand of C++ ``+`` first: ``until(D) + literal(D)`` allocates
    the literal, then the until (ids 0 and 1), which names the until's GBNF rule."""
    arena = build_peg_parser(lambda p: p.cat(lambda: p.until("</x>"), lambda: p.literal("</x>")))
    assert arena.to_json()["parsers"][:2] == [
        {"type": "literal", "literal": "</x>"},
        {"type": "until", "delimiters": ["</x>"]},
    ]
    assert "root ::= until-1 " in gbnf(arena)


# --- test-json-parser ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        '{"name": "test", "value": 42, "flag": true}',
        '[1, "hello", true, null, 3.14]',
        '{"users": [{"id": 1, "name": "Alice"}, {"id": 2, "name": "Bob"}], "count": 2, '
        '"metadata": {"version": "1.0", "tags": ["admin", "user"]}}',
        '{"e": -0.5e+10, "u": "\\u00e9\\n", "empty": {}, "list": []}',
    ],
)
def test_json_full(text: str) -> None:
    result, _ = parse(build_peg_parser(lambda p: p.json()), text)
    assert result.success() and result.end == len(text.encode())


@pytest.mark.parametrize(
    "text", ['{"name": "test", "value": ', "[1, 2, 3, ", '{"data": {"nested": ', "3", "-"]
)
def test_json_partial(text: str) -> None:
    result, _ = parse(build_peg_parser(lambda p: p.json()), text, LENIENT)
    assert result.need_more_input()


@pytest.mark.parametrize(
    "text", ['{"text": "hello\\', '{"text": "hello\\u', '{"text": "hello\\u00']
)
def test_json_incomplete_escape_is_left_out(text: str) -> None:
    result, _ = parse(build_peg_parser(lambda p: p.json()), text, LENIENT)
    assert result.need_more_input() and result.end == text.index("\\")


def test_json_number_is_committed_only_when_complete() -> None:
    arena = build_peg_parser(lambda p: p.json_number())
    assert parse(arena, "3", LENIENT)[0].need_more_input()  # "3.14" may be coming
    assert parse(arena, "3", ParseFlags.NONE)[0].success()
    assert parse(arena, "3,", LENIENT)[0].success()


def test_json_member() -> None:
    arena = build_peg_parser(lambda p: p.json_member("name", '"' + p.chars("[a-z]") + '"'))
    assert parse(arena, '"name": "bob"')[0].success()
    assert parse(arena, '"name": "bo', LENIENT)[0].need_more_input()
    assert parse(arena, "[]")[0].fail()


def test_serialization_round_trip() -> None:
    original = build_peg_parser(lambda p: "<tool_call>" + p.json() + "</tool_call>")
    loaded = Arena.load(original.save())
    assert loaded.to_json() == original.to_json()
    assert json.loads(original.save()) == original.to_json()
    text = '<tool_call>{"name": "test", "values": [1, 2, 3], "nested": {"a": true}}</tool_call>'
    first, second = parse(original, text)[0], parse(loaded, text)[0]
    assert first.success() and second.success() and first.end == second.end == len(text)
    assert gbnf(loaded) == gbnf(original)


# --- test-python-dict-parser ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        "{'name': 'test', 'value': 42, 'flag': True}",
        "[1, 'hello', True, None, 3.14]",
        "{'users': [{'id': 1, 'name': 'Alice'}, {'id': 2, 'name': 'Bob'}], 'count': 2, "
        "'metadata': {'version': '1.0', 'tags': ['admin', 'user']}}",
        "{'message': 'It\\'s working!'}",
        "{'quote': 'He said \"Hello\"'}",
        "{ 'obj' : { 'something': 1, 'other \"something\"' : 'foo\\'s bar' } }",
        "{'message': 'Hello, 世界!'}",
        "{'unicode': 'Hello\\u0041'}",
        '{"name": "test"}',
        "{\"name\": 'test', 'value': \"hello\"}",
        "True",
        "False",
        "None",
    ],
)
def test_python_value_full(text: str) -> None:
    result, _ = parse(build_peg_parser(lambda p: p.python_value()), text)
    assert result.success() and result.end == len(text.encode())


@pytest.mark.parametrize("text", ["{'name': 'test', 'value': ", "{'name': 'test"])
def test_python_value_partial(text: str) -> None:
    assert parse(build_peg_parser(lambda p: p.python_value()), text, LENIENT)[0].need_more_input()


@pytest.mark.parametrize("text", ["true", "false", "null"])
def test_python_value_rejects_json_keywords(text: str) -> None:
    assert parse(build_peg_parser(lambda p: p.python_value()), text)[0].fail()


@pytest.mark.parametrize(
    ("text", "flags", "expected"),
    [
        ("'hello'", 0, SUCCESS),
        ("'it\\'s'", 0, SUCCESS),
        ("'say \"hello\"'", 0, SUCCESS),
        ("'hello", LENIENT, NEED_MORE),
    ],
)
def test_single_quoted_content(text: str, flags: int, expected: ParseResultType) -> None:
    arena = build_peg_parser(
        lambda p: p.sequence([p.literal("'"), p.string_content("'"), p.literal("'"), p.space()])
    )
    result, _ = parse(arena, text, ParseFlags(flags))
    assert result.type == expected
    if expected == SUCCESS:
        assert result.end == len(text)


def _flexible_json(p: ParserBuilder):
    p.rule("json-string", lambda: p.choice([p.double_quoted_string(), p.single_quoted_string()]))
    return p.json()


def test_json_with_a_flexible_string_rule() -> None:
    assert parse(build_peg_parser(lambda p: p.json()), "{'name': 'test'}")[0].fail()
    for text in [
        "{'name': 'test'}",
        '{"name": "test"}',
        "{\"name\": 'test', 'value': \"hello\"}",
        "{ 'obj' : { 'something': 1, 'other \"something\"' : 'foo\\'s bar' } }",
    ]:
        result, _ = parse(build_peg_parser(_flexible_json), text)
        assert result.success() and result.end == len(text)


# --- test-unicode ----------------------------------------------------------------------------------------


def _cases_match(arena: Arena, cases, flags=LENIENT) -> None:
    for text, matched, expected in cases:
        result, _ = parse(arena, text, flags)
        assert result.type == expected, text
        if expected != FAIL:
            assert text[result.start : result.end] == matched, text


def test_unicode_any() -> None:
    arena = build_peg_parser(lambda p: p.sequence([p.one_or_more(p.any()), p.end()]))
    _cases_match(
        arena,
        [
            (b"Hello", b"Hello", SUCCESS),
            (b"Caf\xc3\xa9", b"Caf\xc3\xa9", SUCCESS),
            (b"\xe4\xbd\xa0\xe5\xa5\xbd", b"\xe4\xbd\xa0\xe5\xa5\xbd", SUCCESS),
            (b"\xf0\x9f\x9a\x80", b"\xf0\x9f\x9a\x80", SUCCESS),
            (b"Caf\xc3", b"Caf", NEED_MORE),
            (b"\xe4\xbd", b"", NEED_MORE),
            (b"\xf0\x9f\x9a", b"", NEED_MORE),
            (b"\xff\xfe", b"", FAIL),
            (b"Hello\x80World", b"", FAIL),
            (b"\xc3\x28", b"", FAIL),
        ],
    )


def test_unicode_char_ranges() -> None:
    cjk = build_peg_parser(lambda p: p.sequence([p.chars("[\\u4E00-\\u9FFF]"), p.end()]))
    _cases_match(
        cjk,
        [
            (b"\xe4\xb8\x80", b"\xe4\xb8\x80", SUCCESS),
            (b"\xe9\xbf\xbf", b"\xe9\xbf\xbf", SUCCESS),
            (b"a", b"", FAIL),
            (b"\xe4\xb7\xbf", b"", FAIL),
            (b"\xea\x80\x80", b"", FAIL),
            (b"\xe4\xb8", b"", NEED_MORE),
        ],
    )
    emoji = build_peg_parser(lambda p: p.sequence([p.chars("[\\U0001F600-\\U0001F64F]"), p.end()]))
    _cases_match(
        emoji,
        [
            (b"\xf0\x9f\x98\x80", b"\xf0\x9f\x98\x80", SUCCESS),
            (b"\xf0\x9f\x99\x8f", b"\xf0\x9f\x99\x8f", SUCCESS),
            (b"\xf0\x9f\x97\xbf", b"", FAIL),
            (b"\xf0\x9f\x9a\x80", b"", FAIL),
            (b"\xf0\x9f\x98", b"", NEED_MORE),
            (b"\xf0\x9f", b"", NEED_MORE),
        ],
    )
    mixed = build_peg_parser(
        lambda p: p.sequence([p.chars("[\\u4E00-\\u9FFF\\U0001F600-\\U0001F64F0-9]"), p.end()])
    )
    _cases_match(
        mixed,
        [
            (b"\xe4\xbd\xa0", b"\xe4\xbd\xa0", SUCCESS),
            (b"\xf0\x9f\x98\x80", b"\xf0\x9f\x98\x80", SUCCESS),
            (b"5", b"5", SUCCESS),
            (b"a", b"", FAIL),
            (b"\xf0\x9f\x9a\x80", b"", FAIL),
            (b"\xe4\xb8", b"", NEED_MORE),
        ],
    )


def test_unicode_until() -> None:
    arena = build_peg_parser(lambda p: p.until("</tag>"))
    _cases_match(
        arena,
        [
            (b"\xe4\xbd\xa0\xe5\xa5\xbd</tag>", b"\xe4\xbd\xa0\xe5\xa5\xbd", SUCCESS),
            (b"\xf0\x9f\x98\x80</tag>", b"\xf0\x9f\x98\x80", SUCCESS),
            (b"Hello \xe4\xb8\x96\xe7\x95\x8c!</tag>", b"Hello \xe4\xb8\x96\xe7\x95\x8c!", SUCCESS),
        ],
        ParseFlags.NONE,
    )
    _cases_match(
        arena,
        [
            (b"content\xf0\x9f\x98", b"content", NEED_MORE),
            (b"hello\xe4\xb8", b"hello", NEED_MORE),
            (b"\xe4\xbd\xa0\xe5\xa5\xbd", b"\xe4\xbd\xa0\xe5\xa5\xbd", NEED_MORE),
            # a delimiter cut short by the end of the input stops the match before it
            (b"abc</ta", b"abc", SUCCESS),
            (b"abc<", b"abc", SUCCESS),
        ],
    )


@pytest.mark.parametrize(
    ("text", "raw", "sanitized"),
    [
        (b"Hello\xff\xfe</tag>", b"Hello\xff\xfe", "Hello\ufffd\ufffd"),
        (b"Hello\x80World</tag>", b"Hello\x80World", "Hello\ufffdWorld"),
        (b"\xc3\x28</tag>", b"\xc3\x28", "\ufffd("),
        (b"\xe4\xb8A</tag>", b"\xe4\xb8A", "\ufffdA"),
        (b"\xe4\xb8</tag>", b"\xe4\xb8", "\ufffd"),
        (b"Hello\xe4\xb8", b"Hello\xe4\xb8", "Hello\ufffd"),
        (b"\xe4\xbd\xa0\xff\xe5\xa5\xbd</tag>", b"\xe4\xbd\xa0\xff\xe5\xa5\xbd", "你\ufffd好"),
    ],
)
def test_until_passes_malformed_utf8(text: bytes, raw: bytes, sanitized: str) -> None:
    arena = build_peg_parser(
        lambda p: p.tag("body", p.until("</tag>")) + p.optional(p.literal("</tag>"))
    )
    result, ctx = parse(arena, text)
    assert result.success()
    node = ctx.ast.get(result.nodes[0])
    assert node.raw == raw and node.sanitized_text() == sanitized


def test_malformed_utf8_recorded_once_through_backtracking() -> None:
    arena = build_peg_parser(
        lambda p: (
            p.cat(lambda: p.until("<a>"), lambda: p.literal("<a>"))
            | p.cat(
                lambda: p.peek(p.until("<b>")), lambda: p.until("<b>"), lambda: p.literal("<b>")
            )
        )
    )
    result, _ = parse(arena, b"x\xffy<b>")
    assert result.success() and result.invalid_utf8 == [InvalidUtf8(1, 1)]


def test_string_content_utf8() -> None:
    closed = build_peg_parser(lambda p: p.sequence([p.string_content('"'), p.literal('"')]))
    for text in [
        b'Hello World"',
        b'Caf\xc3\xa9"',
        b'\xf0\x9f\x98\x80"',
        b'Hello\\u0041"',
        b'\xe4\xbd\xa0\\n\xe5\xa5\xbd"',
        b'\xe4\xbd\xa0\\"\xe5\xa5\xbd"',
    ]:
        result, _ = parse(closed, text)
        assert result.success() and result.end == len(text), text
    bare = build_peg_parser(lambda p: p.string_content('"'))
    _cases_match(
        bare,
        [
            (b"Caf\xc3", b"Caf", NEED_MORE),
            (b"Hello\xe4\xb8", b"Hello", NEED_MORE),
            (b"Text\xf0\x9f\x98", b"Text", NEED_MORE),
            (b"\xe4\xbd", b"", NEED_MORE),
        ],
    )
    for text in [b"Hello\xff\xfe", b"Hello\x80World", b"\xc3\x28"]:
        assert parse(bare, text, ParseFlags.NONE)[0].fail()
