"""Lazy grammars, grammar triggers, preserved tokens and the reasoning budget.

Pure functions first: the trigger patterns as std::regex reads them (libstdc++'s refusals, with
the messages the real llama-server answered for each), where a fired trigger's text starts, the
trigger watch's replay, the budget's state machine (the cases of llama.cpp's
tests/test-reasoning-budget.cpp, restated), the UTF-8 check, the generation prompt's prefill and
the request fields. Then a lazy grammar over the real SmolLM2 vocabulary. Then, side by side with
the real llama-server on /completion, answers the tiny model really triggers (greedy and seeded:
the same content, tokens, probabilities and settings, and the grammar's text in them, which the
model does not write unconstrained) and every refusal (status and message).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytest_twisted
from twisted.internet.threads import deferToThread

from bankml.engine_cupy.grammar import Constraint, ConstraintSpec, build_llg_tokenizer
from bankml.engine_cupy.grammar_triggers import (
    TRIGGER_PATTERN,
    TRIGGER_PATTERN_FULL,
    TRIGGER_TOKEN,
    TRIGGER_WORD,
    GrammarTrigger,
    TriggerError,
    TriggerPattern,
    TriggerWatch,
    regex_escape,
    trigger_regexes,
)
from bankml.engine_cupy.reasoning_budget import (
    COUNTING,
    DONE,
    FORCING,
    IDLE,
    WAITING_UTF8,
    ReasoningBudget,
    ReasoningBudgetSpec,
    TokenMatcher,
    utf8_is_complete,
)
from bankml.engine_cupy.request import RequestError, grammar_fields, reasoning_budget_fields
from bankml.engine_cupy.sampler import prefill_tokens
from bankml.engine_cupy.tokenizer import Tokenizer
from tests.native_support import Served, both, call

# --- trigger patterns ------------------------------------------------------------------------------------

# each pattern as a trigger of a lazy grammar: llama-server's answer (400 and its message, or
# "OK": it built the sampler), as the real server gave it
PATTERN_VERDICTS = [
    ("((", "Mismatched '(' and ')' in regular expression"),
    ("a)", "Mismatched '(' and ')' in regular expression"),
    ("*a", "Mismatched '(' and ')' in regular expression"),
    ("a|*", "Mismatched '(' and ')' in regular expression"),
    ("[a", "Unexpected character within '[...]' in regular expression"),
    ("a{", "Invalid range in '{}' in regular expression"),
    ("a{2,1}", "Invalid range in '{}' in regular expression"),
    ("a{x}", "Invalid range in '{}' in regular expression"),
    ("\\p{L}", "Invalid range in '{}' in regular expression"),
    ("\\", "Invalid escape at end of regular expression"),
    ("(?<x>a)", "Invalid '(?...)' zero-width assertion in regular expression"),
    ("[b-a]", "Invalid range in bracket expression."),
    ("[[:foo:]]", "Invalid character class."),
    ("(?=a)b", "OK"),
    ("a**", "OK"),
    ("[\\s\\S]*?(<tool_call>)[\\s\\S]*", "OK"),
    ("[[:digit:]]+x", "OK"),
]


@pytest.mark.parametrize("pattern, verdict", PATTERN_VERDICTS)
def test_patterns_are_read_as_libstdcxx_reads_them(pattern: str, verdict: str) -> None:
    if verdict == "OK":
        TriggerPattern.compile(pattern)
    else:
        with pytest.raises(TriggerError) as err:
            TriggerPattern.compile(pattern)
        assert str(err.value) == verdict


def test_where_a_fired_pattern_starts_the_grammar() -> None:
    group = TriggerPattern.compile("[\\s\\S]*?(<tool_call>)[\\s\\S]*")
    assert group.find(b"hello <tool_call> {") == 6  # the first capturing group that matched
    assert group.find(b"hello <tool") is None
    plain = TriggerPattern.compile("\\n[0-9]\\. ")
    assert plain.find(b"a\n2. b") == 1  # no group: the match's start
    empty_group = TriggerPattern.compile("x(y?)z")
    assert empty_group.find(b"__xz") == 2  # an empty group does not count
    full = TriggerPattern.compile("^[\\s\\S]*Apple\\n$")
    assert full.find(b" Banana\n2. Apple\n") == 0
    assert full.find(b" Banana\n2. Apple\nx") is None


def test_ecmascript_meanings_that_python_reads_otherwise() -> None:
    # "$" is the end of the input only (Python's also matches before a final newline)
    assert TriggerPattern.compile("a$").find(b"a\n") is None
    assert TriggerPattern.compile("a$").find(b"xa") == 1
    # "." stops at \r as well as \n
    assert TriggerPattern.compile("a.b").find(b"a\rb") is None
    assert TriggerPattern.compile("a.b").find(b"a-b") == 0
    # identity escapes and POSIX classes
    assert TriggerPattern.compile("\\<x\\>").find(b"<x>") == 0
    assert TriggerPattern.compile("[[:digit:]]+x").find(b"ab12x") == 2
    # a lazy quantifier stays lazy, a quantified quantifier is quantified again
    assert TriggerPattern.compile("a+?(b)").find(b"aab") == 2
    assert TriggerPattern.compile("(a*)*b").find(b"aab") == 0
    # bytes, as std::string holds them: a multibyte character is several "characters"
    assert TriggerPattern.compile("^.x$").find("éx".encode()) is None
    assert TriggerPattern.compile("^..x$").find("éx".encode()) == 0
    assert TriggerPattern.compile("\\xc3").find("é".encode()) == 0


def test_triggers_become_patterns_and_tokens() -> None:
    assert regex_escape("a.b*c[d]{1}(x)|y^$\\") == "a\\.b\\*c\\[d\\]\\{1\\}\\(x\\)\\|y\\^\\$\\\\"
    triggers = (
        GrammarTrigger(TRIGGER_WORD, "f(x)"),
        GrammarTrigger(TRIGGER_PATTERN, "a+"),
        GrammarTrigger(TRIGGER_PATTERN_FULL, "b+"),
        GrammarTrigger(TRIGGER_PATTERN_FULL, "^c$"),
        GrammarTrigger(TRIGGER_PATTERN_FULL, ""),
        GrammarTrigger(TRIGGER_TOKEN, "<t>", 7),
    )
    assert trigger_regexes(triggers) == (["f\\(x\\)", "a+", "^b+$", "^c$", "^$"], [7])
    with pytest.raises(TriggerError, match="unknown trigger type 7"):
        trigger_regexes((GrammarTrigger(7, "x"),))
    assert GrammarTrigger(TRIGGER_TOKEN, "<t>", 7).to_json() == {
        "type": 0,
        "value": "<t>",
        "token": 7,
    }
    assert GrammarTrigger(TRIGGER_WORD, "w").to_json() == {"type": 1, "value": "w"}


def test_the_watch_replays_the_text_from_the_trigger() -> None:
    watch = TriggerWatch(["\\n([0-9])\\. G"], [99])
    assert watch.push(1, b" Banana") is None
    assert watch.push(2, b"\n") is None
    assert watch.push(3, b"3") is None
    assert watch.push(4, b".") is None
    # the fourth token completes the match: the grammar takes from the group ("3") on, each
    # token's piece cut to that part
    assert watch.push(5, b" Gra") == [(3, b"3"), (4, b"."), (5, b" Gra")]
    inside = TriggerWatch(["(A)pple"], [])
    assert inside.push(1, b"x") is None
    assert inside.push(2, b" Apple") == [(2, b"Apple")]  # a token cut where the trigger starts
    tokens = TriggerWatch([], [99])
    assert tokens.push(1, b"a") is None
    assert tokens.push(99, b"<t>") == [(99, b"<t>")]  # a trigger token: that whole token


# --- the reasoning budget -------------------------------------------------------------------------------------


def forcing_span(
    sequence: list[int],
    start: list[list[int]],
    end: list[list[int]],
    forced: list[int],
    budget: int,
    state: str = IDLE,
) -> tuple[int | None, int | None]:
    """test-reasoning-budget.cpp's harness: before each token of ``sequence`` is accepted, are
    the logits forced (one finite)? (first, last) index where they were, None if never."""
    rb = ReasoningBudget(start, end, forced, budget, None, state)
    n_vocab = max([*sequence, *(t for s in start + end for t in s), *forced]) + 1
    first = last = None
    for i, token in enumerate(sequence):
        logits = np.log(np.arange(1, n_vocab + 1, dtype=np.float32))
        out = rb.apply(logits)
        rb.accept(token)
        if np.isfinite(out).sum() == 1:
            first = i if first is None else first
            last = i
        elif first is not None:
            break
    return first, last


@pytest.mark.parametrize(
    "name, sequence, start, end, forced, budget, state, expected",
    [
        ("natural end", [100, 50, 51, 101, 52], [[100]], [[101]], [102], 5, IDLE, (None, None)),
        ("budget spent", [100, 50, 51, 52, 53], [[100]], [[101]], [102, 101], 2, IDLE, (3, 4)),
        ("budget 0", [100, 50, 51, 52], [[100]], [[101]], [102, 101], 0, COUNTING, (0, 1)),
        ("no tags", [50, 51, 52, 53], [[]], [[]], [102], 2, IDLE, (None, None)),
        ("counting at once", [50, 51, 52, 53], [[100]], [[101]], [102, 101], 2, COUNTING, (2, 3)),
        (
            "a second block re-arms",
            [100, 50, 101, 100, 60, 61, 62, 63],
            [[100]],
            [[101]],
            [102, 101],
            2,
            IDLE,
            (6, 7),
        ),
        (
            "several starts",
            [110, 111, 50, 51, 52, 53],
            [[100], [110, 111]],
            [[101]],
            [102, 101],
            2,
            IDLE,
            (4, 5),
        ),
        (
            "several ends",
            [100, 50, 103, 104, 52],
            [[100]],
            [[101], [103, 104]],
            [102, 101],
            5,
            IDLE,
            (None, None),
        ),
    ],
)
def test_budget_forces_where_llama_cpps_does(
    name: str,
    sequence: list[int],
    start: list[list[int]],
    end: list[list[int]],
    forced: list[int],
    budget: int,
    state: str,
    expected: tuple[int | None, int | None],
) -> None:
    assert forcing_span(sequence, start, end, forced, budget, state) == expected


def test_budget_manual_force_and_end_match() -> None:
    rb = ReasoningBudget([[100]], [[101]], [102, 101], 5)
    assert not rb.force() and rb.state == IDLE
    rb.accept(100)
    rb.accept(50)
    assert rb.state == COUNTING and rb.force() and rb.state == FORCING
    assert rb.forced_token() == 102
    rb.accept(102)
    assert rb.forced_token() == 101
    rb.accept(101)
    assert rb.state == DONE and not rb.force()
    forcing = ReasoningBudget([[100]], [[101]], [102, 101], 0, state=FORCING)
    forcing.accept(102)
    assert not forcing.force() and forcing.forced_token() == 101  # no rewind
    # the sequence that ended the block; re-arming forgets it
    rb = ReasoningBudget([[100]], [[101], [103, 104]], [102, 101], 5)
    assert rb.end_sequence() is None
    for t in (100, 50, 103, 104):
        rb.accept(t)
    assert rb.end_sequence() == (103, 104)
    rb.accept(100)
    assert rb.end_sequence() is None and rb.state == COUNTING
    # overlapping ends: the longest ending here wins
    rb = ReasoningBudget([[100]], [[104], [103, 104]], [102, 104], 5)
    for t in (100, 103, 104):
        rb.accept(t)
    assert rb.end_sequence() == (103, 104)
    # a forced sequence ending in an end tag reports it; one that does not, nothing
    rb = ReasoningBudget([[100]], [[101], [103, 104]], [102, 103, 104], 0, state=FORCING)
    for t in (102, 103):
        rb.accept(t)
    assert rb.end_sequence() is None
    rb.accept(104)
    assert rb.end_sequence() == (103, 104)
    rb = ReasoningBudget([[100]], [[101], [103, 104]], [102], 0, state=FORCING)
    rb.accept(102)
    assert rb.state == DONE and rb.end_sequence() is None


def test_budget_waits_for_a_whole_character() -> None:
    pieces = {1: b"<t>", 50: b"ab", 51: b"\xe2\x80", 52: b"\x9c", 53: b"c"}
    rb = ReasoningBudget([[1]], [[9]], [7, 9], 2, pieces.__getitem__)
    for t in (1, 50, 51):
        rb.accept(t)
    assert rb.state == WAITING_UTF8 and rb.forced_token() is None  # "\xe2\x80" is unfinished
    # each token's piece is looked at alone: a lone continuation byte is not complete either
    rb.accept(52)
    assert rb.state == WAITING_UTF8
    rb.accept(53)
    assert rb.state == FORCING and rb.forced_token() == 7


def test_token_matcher_and_utf8() -> None:
    m = TokenMatcher([[1, 2, 3], [2, 3], [], [1, 2, 3]])
    assert m.seqs == [(1, 2, 3), (2, 3)]  # empty and repeated sequences left out
    assert [m.advance(t) for t in (1, 2, 3)] == [-1, -1, 0]  # the longest wins
    assert [m.advance(t) for t in (5, 2, 3)] == [-1, -1, 1]
    assert [m.advance(t) for t in (1, 1, 2, 3)] == [-1, -1, -1, 0]  # a failure link
    for text in (b"hello", b"", b"\xc2\xa0", b"\xe2\x80\x9c", b"\xf0\x9f\x98\x80", b"abc\xc3\xa9"):
        assert utf8_is_complete(text)
    for text in (b"\xc2", b"\xe2\x80", b"\xe2", b"\xf0\x9f\x98", b"\xf0\x9f", b"\xf0", b"\x80"):
        assert not utf8_is_complete(text)
    assert not utf8_is_complete(b"hello\xc3") and utf8_is_complete(b"hello\xc3\xa9")


def test_prefill_leaves_out_a_leading_blank_the_prompt_does_not_have() -> None:
    pieces = [b" <s>", b"<s>", b"a", b" b"]
    assert prefill_tokens("<s>a", [0, 2], pieces) == [2]
    assert prefill_tokens(" <s>a", [0, 2], pieces) == [0, 2]
    assert prefill_tokens("<s>a b", [1, 2, 3], pieces) == [1, 2, 3]
    assert prefill_tokens("", [], pieces) == []


# --- the request fields ------------------------------------------------------------------------------------------

WORDS = {"<|im_start|>": [1], "Apple": [39080], "3.": [35, 30], "<think>": [44, 17400, 46]}


def fake_tokenize(text: str) -> list[int]:
    return WORDS.get(text, [ord(c) for c in text])


def test_grammar_fields_read_as_llama_server() -> None:
    body = {
        "grammar_lazy": True,
        "preserved_tokens": ["<|im_start|>", "3."],  # only one-token texts are kept
        "grammar_triggers": [
            {"type": 1, "value": "<|im_start|>"},
            {"type": 1, "value": "3."},
            {"type": 0, "value": "x", "token": 5.7},
            {"type": 3, "value": "a+"},
        ],
        "generation_prompt": "<|im_start|>",
        "grammar_type": "tool_calls",
    }
    fields = grammar_fields(body, fake_tokenize)
    assert fields.preserved == frozenset({1})
    assert fields.triggers == (
        GrammarTrigger(TRIGGER_TOKEN, "<|im_start|>", 1),  # a one-token word: a token trigger
        GrammarTrigger(TRIGGER_WORD, "3."),
        GrammarTrigger(TRIGGER_TOKEN, "x", 5),
        GrammarTrigger(TRIGGER_PATTERN_FULL, "a+"),
    )
    assert fields.echoed() == {
        "grammar_lazy": True,
        "grammar_triggers": [
            {"type": 0, "value": "<|im_start|>", "token": 1},
            {"type": 1, "value": "3."},
            {"type": 0, "value": "x", "token": 5},
            {"type": 3, "value": "a+"},
        ],
        "preserved_tokens": [1],
        "generation_prompt": "<|im_start|>",
    }
    assert fields.grammar_type == "tool_calls"
    # a scalar is iterated as itself, an object by its values; a lazy grammar without the field
    # has no triggers and no refusal
    assert grammar_fields({"preserved_tokens": "<|im_start|>"}, fake_tokenize).preserved == {1}
    assert grammar_fields({"grammar_lazy": True}, fake_tokenize).triggers == ()
    assert grammar_fields({"grammar_type": 5}, fake_tokenize).grammar_type == ""


@pytest.mark.parametrize(
    "body, message",
    [
        (
            {"grammar_lazy": "yes"},
            "Field 'grammar_lazy': [json.exception.type_error.302] type must be boolean, but is string",
        ),
        (
            {"generation_prompt": 5},
            "Field 'generation_prompt': [json.exception.type_error.302] type must be string, but is number",
        ),
        (
            {"preserved_tokens": [5]},
            "Field 'preserved_tokens': [json.exception.type_error.302] type must be string, but is number",
        ),
        (
            {"grammar_triggers": "x"},
            "Field 'grammar_triggers': [json.exception.type_error.304] cannot use at() with string",
        ),
        (
            {"grammar_triggers": [[1]]},
            "Field 'grammar_triggers': [json.exception.type_error.304] cannot use at() with array",
        ),
        (
            {"grammar_triggers": [{"value": "x"}]},
            "Field 'grammar_triggers': [json.exception.out_of_range.403] key 'type' not found",
        ),
        (
            {"grammar_triggers": [{"type": 1}]},
            "Field 'grammar_triggers': [json.exception.out_of_range.403] key 'value' not found",
        ),
        (
            {"grammar_triggers": [{"type": "1", "value": "x"}]},
            "Field 'grammar_triggers': [json.exception.type_error.302] type must be number, but is string",
        ),
        (
            {"grammar_triggers": [{"type": 1, "value": 3}]},
            "Field 'grammar_triggers': [json.exception.type_error.302] type must be string, but is number",
        ),
        (
            {"grammar_triggers": [{"type": 0, "value": "x"}]},
            "Field 'grammar_triggers': [json.exception.out_of_range.403] key 'token' not found",
        ),
        (
            {"grammar_triggers": [{"type": 1, "value": "Apple"}]},
            "Field 'grammar_triggers': Grammar trigger word should be marked as preserved token: Apple",
        ),
        (
            {"grammar_lazy": True, "grammar_triggers": []},
            "Field 'grammar_triggers': Error: no triggers set for lazy grammar!",
        ),
    ],
)
def test_grammar_field_refusals(body: dict[str, Any], message: str) -> None:
    with pytest.raises(RequestError) as err:
        grammar_fields(body, fake_tokenize)
    assert str(err.value) == message and err.value.status == 400


def test_reasoning_budget_fields() -> None:
    spec = reasoning_budget_fields(
        {
            "reasoning_budget_tokens": 5,
            "reasoning_budget_start_tag": "<think>",
            "reasoning_budget_end_tags": ["3.", "", "Apple"],
            "reasoning_budget_message": "<|im_start|>",
        },
        fake_tokenize,
    )
    assert spec == ReasoningBudgetSpec(5, (44, 17400, 46), ((35, 30), (39080,)), (1, 35, 30), False)
    assert spec.active(False)
    # no message field: nothing is forced; a message that is not a string reads as ""
    assert reasoning_budget_fields({"reasoning_budget_end_tag": "3."}, fake_tokenize).forced == ()
    odd = {"reasoning_budget_end_tag": "3.", "reasoning_budget_message": 5}
    assert reasoning_budget_fields(odd, fake_tokenize).forced == (35, 30)
    # the list wins over the single tag, even when null
    both_ = {"reasoning_budget_end_tags": None, "reasoning_budget_end_tag": "3."}
    assert reasoning_budget_fields(both_, fake_tokenize).end == ()
    # the server default, and when the sampler exists at all
    assert reasoning_budget_fields({}, fake_tokenize, 7).tokens == 7
    tags = ReasoningBudgetSpec(-1, (1,), ((2,),))
    assert not tags.active(False) and tags.active(True)
    assert ReasoningBudgetSpec(-1, (1,), ((2,),), control=True).active(False)
    assert not ReasoningBudgetSpec(3, (), ((2,),)).active(False)


@pytest.mark.parametrize(
    "body, message",
    [
        (
            {"reasoning_control": 1},
            "Field 'reasoning_control': [json.exception.type_error.302] type must be boolean, but is number",
        ),
        (
            {"reasoning_budget_tokens": -2},
            "Field 'reasoning_budget_tokens': Value must be between -1 <= value <= 2147483647, but got -2",
        ),
        (
            {"reasoning_budget_tokens": "x"},
            "Field 'reasoning_budget_tokens': [json.exception.type_error.302] type must be number, but is string",
        ),
        (
            {"reasoning_budget_start_tag": 5},
            "Field 'reasoning_budget_start_tag': [json.exception.type_error.302] type must be string, but is number",
        ),
        (
            {"reasoning_budget_end_tags": [5]},
            "Field 'reasoning_budget_end_tags': [json.exception.type_error.302] type must be string, but is number",
        ),
        (
            {"reasoning_budget_end_tag": ["x"]},
            "Field 'reasoning_budget_end_tag': [json.exception.type_error.302] type must be string, but is array",
        ),
    ],
)
def test_reasoning_budget_field_refusals(body: dict[str, Any], message: str) -> None:
    with pytest.raises(RequestError) as err:
        reasoning_budget_fields(body, fake_tokenize)
    assert str(err.value) == message


# --- a lazy grammar over the real vocabulary --------------------------------------------------------------


@pytest.fixture(scope="module")
def vocab(default_model: Path):
    tok = Tokenizer.from_gguf(default_model)
    llg = build_llg_tokenizer(tok.vocab_bytes(), tok.eog_ids, tok.bos_id, lambda s: tok.tokenize(s))
    return tok, llg


def lazy(vocab, grammar: str, *triggers: GrammarTrigger) -> Constraint:
    tok, llg = vocab
    spec = ConstraintSpec("gbnf", grammar, lazy=True, triggers=triggers)
    return Constraint(spec, llg, tok.n_vocab, tok.eog_ids, tok.vocab_bytes())


def test_a_lazy_grammar_constrains_only_once_triggered(vocab) -> None:
    tok, _ = vocab
    c = lazy(
        vocab, 'root ::= "Apple\\n3. Kiwi\\n"', GrammarTrigger(TRIGGER_PATTERN, "\\n[0-9]\\. (A)")
    )
    eog = min(tok.eog_ids)
    free = tok.tokenize(" Banana\n2.")
    assert all(c.allows(t) for t in [*free, eog]) and c.mask().all()
    for t in free:
        c.accept(t)
    assert c.awaiting
    (apple,) = tok.tokenize(" Apple")
    c.accept(apple)  # fires inside the token: the grammar takes "Apple", not " Apple"
    assert not c.awaiting
    mask = c.mask()
    nl = tok.tokenize("\n")[0]
    assert mask[nl] and not mask[tok.tokenize(" Banana")[0]] and not mask[eog]
    assert c.allows(nl) and not c.allows(apple) and not c.allows(eog)
    for t in tok.tokenize("\n3. Kiwi\n"):
        c.accept(t)
    assert c.is_complete() and c.allows(eog)


def test_a_trigger_token_and_a_refused_trigger_text(vocab) -> None:
    tok, _ = vocab
    im_start = tok.tokenize("<|im_start|>", parse_special=True)[0]
    c = lazy(vocab, 'root ::= "<|im_start|>assistant"', GrammarTrigger(TRIGGER_TOKEN, "", im_start))
    c.accept(tok.tokenize("x")[0])
    c.accept(im_start)
    assert not c.awaiting and c.allows(tok.tokenize("assistant")[0])
    refused = lazy(vocab, 'root ::= "b"', GrammarTrigger(TRIGGER_WORD, "xyz"))
    with pytest.raises(ValueError, match="Unexpected empty grammar stack after accepting piece: x"):
        for t in tok.tokenize("xyz"):
            refused.accept(t)


# --- side by side with llama-server ----------------------------------------------------------------------------

FRUITS = "Here is a list of fruits:\n1."
ASK = "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
THINK_PROMPT = "<|im_start|>assistant\n<think>\n"
BUDGET = {
    "reasoning_budget_start_tag": "<think>",
    "reasoning_budget_end_tags": ["</think>"],
    "generation_prompt": THINK_PROMPT,
}
GREEDY = {"temperature": 0}
FIVE = 'root ::= "<|im_start|>assistant\\nThe answer is five.\\n"'


def seeded(seed: int) -> dict[str, Any]:
    return {"temperature": 0.9, "seed": seed}


# (label, body, text the answer must contain: the grammar's or the budget's, which the model
# does not write unconstrained)
ANSWERED = [
    (
        "word trigger, greedy",
        {
            "prompt": FRUITS,
            **GREEDY,
            "grammar": 'root ::= "3. Kiwi\\n4. Lemon\\n"',
            "grammar_lazy": True,
            "grammar_triggers": [{"type": 1, "value": "3."}],
        },
        "3. Kiwi\n4. Lemon\n",
    ),
    (
        "word trigger, seeded",
        {
            "prompt": FRUITS,
            **seeded(3),
            "grammar": 'root ::= "3. Kiwi\\n4. Lemon\\n"',
            "grammar_lazy": True,
            "grammar_triggers": [{"type": 1, "value": "3."}],
        },
        "3. Kiwi\n4. Lemon\n",
    ),
    (
        "pattern trigger with a group, greedy",
        {
            "prompt": FRUITS,
            **GREEDY,
            "grammar": 'root ::= "Gr" [a-z]+ "\\n4. Kiwi\\n"',
            "grammar_lazy": True,
            "grammar_triggers": [{"type": 2, "value": "\\n[0-9]\\. (Gr)"}],
        },
        "\n4. Kiwi\n",
    ),
    (
        "full pattern firing inside a token, seeded",
        {
            "prompt": FRUITS,
            **seeded(7),
            "grammar": 'root ::= "Apple\\n3. Kiwi\\n"',
            "grammar_lazy": True,
            "grammar_triggers": [{"type": 3, "value": "[\\s\\S]*\\n[0-9]\\. (A)[\\s\\S]*"}],
        },
        "Apple\n3. Kiwi\n",
    ),
    (
        "token trigger, greedy",
        {
            "prompt": ASK,
            **GREEDY,
            "grammar": FIVE,
            "grammar_lazy": True,
            "grammar_triggers": [{"type": 0, "value": "<|im_start|>", "token": 1}],
        },
        "The answer is five.\n",
    ),
    (
        "one-token word, preserved, seeded",
        {
            "prompt": ASK,
            **seeded(5),
            "grammar": FIVE,
            "grammar_lazy": True,
            "grammar_triggers": [{"type": 1, "value": "<|im_start|>"}],
            "preserved_tokens": ["<|im_start|>"],
        },
        "<|im_start|>assistant\nThe answer is five.\n",
    ),
    (
        "preserved token shown, no grammar",
        {"prompt": ASK, **GREEDY, "preserved_tokens": ["<|im_start|>"]},
        "<|im_start|>assistant",
    ),
    (
        "budget forces message and end tag, greedy",
        {
            "prompt": ASK + THINK_PROMPT,
            **GREEDY,
            "reasoning_budget_tokens": 5,
            **BUDGET,
            "reasoning_budget_message": " Done thinking.",
        },
        " Done thinking.</think>",
    ),
    (
        "budget with two end tags, seeded",
        {
            "prompt": ASK + THINK_PROMPT,
            **seeded(11),
            "reasoning_budget_tokens": 4,
            **BUDGET,
            "reasoning_budget_end_tags": ["</think>", "\n\n"],
            "reasoning_budget_message": " Done thinking.",
        },
        " Done thinking.</think>",
    ),
    (
        "budget 0: the prefill's last token takes the first forced place",
        {
            "prompt": ASK + THINK_PROMPT,
            **GREEDY,
            "reasoning_budget_tokens": 0,
            "reasoning_budget_start_tag": "<think>",
            "reasoning_budget_end_tag": "</think>",
            "reasoning_budget_message": "",
            "generation_prompt": THINK_PROMPT,
        },
        "think>",
    ),
    (
        "budget without a message forces nothing",
        {"prompt": ASK + THINK_PROMPT, **GREEDY, "reasoning_budget_tokens": 5, **BUDGET},
        "",
    ),
    (
        "budget's end tag fires a lazy grammar",
        {
            "prompt": ASK + THINK_PROMPT,
            **GREEDY,
            "reasoning_budget_tokens": 3,
            **BUDGET,
            "reasoning_budget_message": " Done.",
            "grammar": 'root ::= "</think>\\nThe answer is five.\\n"',
            "grammar_lazy": True,
            "grammar_triggers": [{"type": 1, "value": "</think>"}],
        },
        "</think>\nThe answer is five.\n",
    ),
    (
        "tool-call grammar takes the generation prompt",
        {
            "prompt": FRUITS,
            **GREEDY,
            "grammar": 'root ::= "Hi there"',
            "grammar_type": "tool_calls",
            "generation_prompt": "Hi",
        },
        " there",
    ),
]

SETTINGS = ("grammar", "grammar_lazy", "grammar_triggers", "preserved_tokens", "generation_prompt")


def first_difference(a: Any, b: Any, path: str = "") -> str | None:
    """Where two JSON values first differ (a key path and both values), or None."""
    if type(a) is not type(b):
        return f"{path}: {a!r} | {b!r}"
    if isinstance(a, dict):
        for key in sorted(set(a) | set(b)):
            found = first_difference(a.get(key), b.get(key), f"{path}/{key}")
            if found:
                return found
        return None
    if isinstance(a, list):
        for i, (x, y) in enumerate(zip(a, b)):
            found = first_difference(x, y, f"{path}/{i}")
            if found:
                return found
        return f"{path}: {len(a)} | {len(b)} items" if len(a) != len(b) else None
    return f"{path}: {a!r} | {b!r}" if a != b else None


def logprobs_out(probs: Any, found: list[float]) -> Any:
    """The probabilities with every ``logprob`` taken out (into ``found``)."""
    if isinstance(probs, list):
        return [logprobs_out(p, found) for p in probs]
    if isinstance(probs, dict):
        if "logprob" in probs:
            found.append(probs["logprob"])
        return {k: logprobs_out(v, found) for k, v in probs.items() if k != "logprob"}
    return probs


def answer_of(answer: Any) -> tuple[Any, list[float]]:
    """What must be the same: the text, the tokens, why it ended, the probabilities, and the
    settings the answer reports for these fields; and, apart, the pre-sampling log-probabilities
    (bankml's prompt logits are not always llama-server's to the last bit: see below)."""
    if not isinstance(answer, dict) or "content" not in answer:
        return answer, []
    settings = answer.get("generation_settings", {})
    logprobs: list[float] = []
    same = {
        "content": answer["content"],
        "tokens": answer.get("tokens"),
        "stop_type": answer.get("stop_type"),
        "tokens_predicted": answer.get("tokens_predicted"),
        "probs": logprobs_out(answer.get("completion_probabilities"), logprobs),
        "settings": {key: settings.get(key) for key in SETTINGS},
    }
    return same, logprobs


@pytest_twisted.ensureDeferred
async def test_lazy_grammar_and_budget_answers_are_llama_servers(
    served: Served, reference_server: Any
) -> None:
    differ = []
    for label, fields, must_contain in ANSWERED:
        for extra in ({"n_probs": 3}, {"n_probs": 2, "post_sampling_probs": True}):
            body = {
                "n_predict": 40,
                "return_tokens": True,
                "cache_prompt": False,
                **fields,
                **extra,
            }
            (status, _, ours), (ref_status, _, ref) = await both(
                served.engine_url, reference_server, "POST", "/completion", body
            )
            assert ref_status == 200, (label, ref)
            (mine, my_logprobs), (theirs, their_logprobs) = answer_of(ours), answer_of(ref)
            far = [(i, a, b) for i, (a, b) in enumerate(zip(my_logprobs, their_logprobs)) if a != b]
            if (status, mine) != (ref_status, theirs) or far:
                differ.append((label, extra, first_difference(mine, theirs) or far[:3]))
                print("differs:", differ[-1])
            assert must_contain in theirs["content"], (label, theirs["content"])
    print(
        f"lazy grammar and budget answers identical: {2 * len(ANSWERED) - len(differ)}/{2 * len(ANSWERED)}"
    )
    assert not differ


@pytest_twisted.ensureDeferred
async def test_the_constraint_changes_what_the_model_writes(served: Served) -> None:
    """Without the lazy grammar (or the budget) the same requests do not write that text: the
    constraint is what put it there."""
    for label, fields, must_contain in ANSWERED:
        if not must_contain:
            continue
        free = {
            k: v
            for k, v in fields.items()
            if not k.startswith(("grammar", "reasoning_budget", "preserved", "generation"))
        }
        _, _, ours = await deferToThread(
            call, served.engine_url, "POST", "/completion", {"n_predict": 40, **free}
        )
        assert must_contain not in ours["content"], label


@pytest_twisted.ensureDeferred
async def test_a_lazy_grammar_streams_as_llama_servers(
    served: Served, reference_server: Any
) -> None:
    """The same pieces of text, event by event. (llama-server also sends an empty event for
    the EOG token before its last one, with or without a grammar; bankml does not: empty
    pieces are left out of the comparison.)"""
    _, fields, _ = ANSWERED[3]
    body = {"n_predict": 40, **fields, "stream": True}
    (_, _, ours), (_, _, ref) = await both(
        served.engine_url, reference_server, "POST", "/completion", body
    )

    def pieces(events: list[Any]) -> list[str]:
        return [e["content"] for e in events if isinstance(e, dict) and e.get("content")]

    assert pieces(ours) == pieces(ref)
    assert "".join(pieces(ref)).endswith("Apple\n3. Kiwi\n")


REFUSED = [
    {"grammar_lazy": True, "grammar_triggers": []},
    {"grammar_lazy": "yes"},
    {"generation_prompt": 5},
    {"preserved_tokens": [5]},
    {"grammar_triggers": "x"},
    {"grammar_triggers": [{"value": "x"}]},
    {"grammar_triggers": [{"type": "1", "value": "x"}]},
    {"grammar_triggers": [{"type": 1, "value": 3}]},
    {"grammar_triggers": [{"type": 0, "value": "x"}]},
    {"grammar_triggers": [{"type": 1, "value": "Apple"}]},
    {"reasoning_budget_tokens": -2},
    {"reasoning_budget_start_tag": 5},
    {"reasoning_budget_end_tags": [5]},
    # at sampler initialisation: the trigger patterns libstdc++ refuses
    *(
        {"grammar_lazy": True, "grammar_triggers": [{"type": 2, "value": pattern}]}
        for pattern, verdict in PATTERN_VERDICTS
        if verdict != "OK"
    ),
    # a grammar that cannot take the generation prompt (llama-server's message is what its
    # rethrow leaves of the exception)
    {"json_schema": {"type": "object"}, "generation_prompt": "Hi"},
    {"grammar": 'root ::= "Hi there"', "grammar_type": "tool_calls", "generation_prompt": "Hx"},
    # a trigger whose text the grammar refuses, found mid-answer: llama-server's 500
    {
        "grammar": 'root ::= [0-9] ". " [a-z]+ "\\n"',
        "grammar_lazy": True,
        "grammar_triggers": [{"type": 2, "value": "\\n([0-9])\\. G"}],
    },
]


@pytest_twisted.ensureDeferred
async def test_refusals_are_llama_servers(served: Served, reference_server: Any) -> None:
    for fields in REFUSED:
        body = {
            "prompt": FRUITS,
            "n_predict": 40,
            "temperature": 0,
            "grammar": 'root ::= "a"',
            **fields,
        }
        if "json_schema" in fields:
            del body["grammar"]
        (status, _, ours), (ref_status, _, ref) = await both(
            served.engine_url, reference_server, "POST", "/completion", body
        )
        assert ref_status in (400, 500) and status == ref_status, (fields, ours, ref)
        assert ours["error"] == ref["error"], fields
    print(f"refusals with llama-server's status and message: {len(REFUSED)}/{len(REFUSED)}")


# --- the server flags ------------------------------------------------------------------------------------------


def test_reasoning_budget_flags_are_served_natively() -> None:
    from bankml.serving.llama_flags import FlagError, dropin_argv, native_settings

    argv, notes = dropin_argv(
        ["-m", "m.gguf", "--reasoning-budget", "3", "--reasoning-budget-message", "Stop."]
    )
    assert argv[argv.index("--reasoning-budget") + 1] == "3" and not notes
    assert argv[argv.index("--reasoning-budget-message") + 1] == "Stop."
    settings = native_settings({"reasoning-budget": "0", "reasoning-budget-message": "Stop."})
    assert (settings["reasoning_budget"], settings["reasoning_budget_message"]) == (0, "Stop.")
    assert native_settings({})["reasoning_budget"] == -1
    with pytest.raises(FlagError, match="--reasoning-budget -2: invalid value"):
        native_settings({"reasoning-budget": "-2"})
    with pytest.raises(FlagError, match="not a number"):
        native_settings({"reasoning-budget": "x"})


@pytest_twisted.ensureDeferred
async def test_the_server_budget_is_a_requests_default_as_in_llama_server(
    served: Served, default_model: Path, llama_server_bin: Path
) -> None:
    """llama-server started with --reasoning-budget 3 and bankml with the same flag's setting
    (``apply_server_defaults``) answer a request that names no budget alike; a request's own
    budget still wins."""
    from bankml.native.resident import apply_server_defaults
    from bankml.serving.llama_flags import native_settings
    from tests import support

    engine = served.native.engine
    before = (engine.reasoning_budget, engine.reasoning_budget_message)
    flags = ["--reasoning-budget", "3", "--reasoning-budget-message", "ignored here"]
    apply_server_defaults(engine, native_settings({"reasoning-budget": "3"}))
    try:
        with support.LlamaServer(default_model, args=flags, binary=llama_server_bin) as ref:
            base = {"prompt": ASK + THINK_PROMPT, "n_predict": 30, **GREEDY, **BUDGET}
            base["reasoning_budget_message"] = " Done."
            for body in (base, {**base, "reasoning_budget_tokens": 6}):
                (status, _, ours), (ref_status, _, theirs) = await both(
                    served.engine_url, ref, "POST", "/completion", body
                )
                assert status == ref_status == 200
                assert ours["content"] == theirs["content"]
                assert ours["tokens_predicted"] == theirs["tokens_predicted"]
                assert " Done.</think>" in theirs["content"]
    finally:
        engine.reasoning_budget, engine.reasoning_budget_message = before


CHAT = [{"role": "user", "content": "What is 2+2?"}]
CHATS = [
    # the budget fields pass through to the sampler, with the template's generation prompt
    # (its start tag counts from there)
    {
        "reasoning_budget_tokens": 3,
        "reasoning_budget_start_tag": "<|im_start|>",
        "reasoning_budget_end_tags": ["</think>"],
        "reasoning_budget_message": " Done.",
    },
    # the lazy-grammar fields are the template's: the body's are not read (not even refused)
    {
        "grammar_lazy": True,
        "grammar_triggers": "x",
        "preserved_tokens": [5],
        "generation_prompt": 7,
    },
    # so a body's grammar constrains from the first token, lazy or not
    {
        "grammar": 'root ::= "Four" "."? ',
        "grammar_lazy": True,
        "grammar_triggers": [{"type": 1, "value": "Apple"}],
    },
]


@pytest_twisted.ensureDeferred
async def test_chat_requests_read_these_fields_as_llama_server(
    served: Served, reference_server: Any
) -> None:
    for fields in CHATS:
        body = {"messages": CHAT, "max_tokens": 30, **GREEDY, **fields}
        (status, _, ours), (ref_status, _, ref) = await both(
            served.engine_url, reference_server, "POST", "/v1/chat/completions", body
        )
        assert status == ref_status == 200, (fields, ours, ref)
        mine, theirs = ours["choices"][0], ref["choices"][0]
        assert mine["message"]["content"] == theirs["message"]["content"], fields
        assert mine["finish_reason"] == theirs["finish_reason"]
        if "reasoning_budget_message" in fields:
            assert "Done.</think>" in theirs["message"]["content"]
        if "grammar" in fields:
            assert theirs["message"]["content"] in ("Four", "Four.")
