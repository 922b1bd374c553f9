"""Grammar triggers: when a lazy grammar starts to constrain, and what text it starts from.

A lazy grammar (llama-server's ``grammar_lazy``) lets the model write freely until a trigger
fires; from then on the grammar constrains every token. This module is llama.cpp's trigger side
(common/sampling.cpp's common_sampler_init, src/llama-grammar.cpp's llama_grammar_accept_impl
and llama_grammar_trigger_pattern::find):

- a request's triggers (``GrammarTrigger``: type 0 token, 1 word, 2 pattern, 3 full pattern)
  become regular expressions and trigger tokens (``trigger_regexes``): a word is escaped
  (``regex_escape``), a full pattern anchored with ``^`` and ``$``;
- ``TriggerWatch`` follows the generated tokens while the grammar waits: a trigger token fires at
  once (the grammar then takes that whole token); otherwise each token's piece is appended to a
  buffer and every pattern is searched in the whole buffer. The first that matches fires, and the
  grammar is fed the buffer from the match's start (the first non-empty capturing group, or the
  whole match), token by token, the first one cut to the part inside.

llama.cpp matches with ``std::regex`` (ECMAScript) on the bytes of the buffer; ``ecmascript``
translates such a pattern into a Python ``re`` pattern over bytes with the same meaning (``.``
stops at ``\\n`` and ``\\r``, ``$`` only at the end, ``[[:alpha:]]`` classes, identity escapes) and
refuses what libstdc++ refuses, with its message.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

TRIGGER_TOKEN, TRIGGER_WORD, TRIGGER_PATTERN, TRIGGER_PATTERN_FULL = 0, 1, 2, 3


class TriggerError(ValueError):
    """A trigger llama.cpp cannot build its sampler with (the message is its reason)."""


@dataclass(frozen=True)
class GrammarTrigger:
    """common_grammar_trigger: ``type`` (TRIGGER_*), ``value`` (the word or pattern; a token
    trigger's text) and, for a token trigger, ``token``."""

    type: int
    value: str
    token: int | None = None

    def to_json(self) -> dict[str, Any]:
        """server_grammar_trigger::to_json (generation_settings' ``grammar_triggers``)."""
        out: dict[str, Any] = {"type": self.type, "value": self.value}
        if self.type == TRIGGER_TOKEN:
            out["token"] = self.token
        return out


_SPECIAL = re.compile(r"[.^$|()*+?\[\]{}\\]")


def regex_escape(word: str) -> str:
    """common's regex_escape: a backslash before each of ``.^$|()*+?[]{}\\``."""
    return _SPECIAL.sub(lambda m: "\\" + m.group(0), word)


def trigger_regexes(triggers: tuple[GrammarTrigger, ...]) -> tuple[list[str], list[int]]:
    """common_sampler_init: (the patterns, the trigger tokens) of a lazy grammar's triggers."""
    patterns: list[str] = []
    tokens: list[int] = []
    for trigger in triggers:
        if trigger.type == TRIGGER_WORD:
            patterns.append(regex_escape(trigger.value))
        elif trigger.type == TRIGGER_PATTERN:
            patterns.append(trigger.value)
        elif trigger.type == TRIGGER_PATTERN_FULL:
            p = trigger.value
            anchored = "^$"
            if p:
                anchored = ("" if p[0] == "^" else "^") + p + ("" if p[-1] == "$" else "$")
            patterns.append(anchored)
        elif trigger.type == TRIGGER_TOKEN:
            tokens.append(int(trigger.token if trigger.token is not None else -1))
        else:
            # llama.cpp asserts here (the server process aborts); bankml refuses the request
            raise TriggerError(f"unknown trigger type {trigger.type}")
    return patterns, tokens


# --- ECMAScript patterns as libstdc++'s std::regex reads them ---------------------------------

_PAREN = "Mismatched '(' and ')' in regular expression"
_BRACK = "Unexpected character within '[...]' in regular expression"
_BRACE = "Invalid range in '{}' in regular expression"
_ESCAPE_END = "Invalid escape at end of regular expression"
_ASSERTION = "Invalid '(?...)' zero-width assertion in regular expression"
_RANGE = "Invalid range in bracket expression."
_CTYPE = "Invalid character class."
_HEX_ESCAPE = "Invalid '\\xNN' control character in regular expression"

_POSIX = {
    b"alnum": rb"0-9A-Za-z",
    b"alpha": rb"A-Za-z",
    b"blank": rb" \t",
    b"cntrl": rb"\x00-\x1f\x7f",
    b"digit": rb"0-9",
    b"d": rb"0-9",
    b"graph": rb"\x21-\x7e",
    b"lower": rb"a-z",
    b"print": rb"\x20-\x7e",
    b"punct": rb"!-/:-@\[-`{-~",
    b"space": rb" \t\n\r\f\v",
    b"s": rb" \t\n\r\f\v",
    b"upper": rb"A-Z",
    b"w": rb"0-9A-Za-z_",
    b"xdigit": rb"0-9A-Fa-f",
}
_CLASS_ESCAPES = {ord(c): rb"\%c" % ord(c) for c in "dDwWsS"}
_CONTROL_ESCAPES = {ord("n"): 10, ord("r"): 13, ord("t"): 9, ord("f"): 12, ord("v"): 11}
_HEX = b"0123456789abcdefABCDEF"


def _byte(value: int) -> bytes:
    return b"\\x%02x" % (value & 0xFF)


class _Translator:
    """One left-to-right pass over the pattern's bytes: a Python pattern, or the first error
    libstdc++ would report."""

    def __init__(self, pattern: bytes):
        self.p = pattern
        self.i = 0
        self.out: list[bytes] = []

    def error(self, message: str) -> TriggerError:
        return TriggerError(message)

    def run(self) -> bytes:
        depth = 0
        can_repeat = False  # an atom precedes (a quantifier applies to it)
        quantified = False  # that atom already has a quantifier
        just_quantified = False  # the last thing read was a quantifier (a ``?`` makes it lazy)
        atom_at: list[int] = []  # where each open group starts in ``out``
        atom_start = 0
        p = self.p
        while self.i < len(p):
            c = p[self.i]
            self.i += 1
            if c == ord("?") and just_quantified:
                self.out.append(b"?")  # lazy
                just_quantified = False
                continue
            just_quantified = False
            if c == ord("\\"):
                atom_start = len(self.out)
                self.out.append(self.escape(in_class=False))
                can_repeat, quantified = True, False
            elif c == ord("("):
                if p[self.i : self.i + 1] == b"?":
                    kind = p[self.i + 1 : self.i + 2]
                    if kind not in (b":", b"=", b"!"):
                        raise self.error(_ASSERTION)
                    self.i += 2
                    atom_at.append(len(self.out))
                    self.out.append(b"(?" + kind)
                else:
                    atom_at.append(len(self.out))
                    self.out.append(b"(")
                depth += 1
                can_repeat, quantified = False, False
            elif c == ord(")"):
                if depth == 0:
                    raise self.error(_PAREN)
                depth -= 1
                atom_start = atom_at.pop()
                self.out.append(b")")
                can_repeat, quantified = True, False
            elif c == ord("|"):
                self.out.append(b"|")
                can_repeat, quantified = False, False
            elif c in b"*+?{":
                if not can_repeat:
                    raise self.error(_PAREN)
                text = bytes([c]) if c != ord("{") else self.brace()
                if quantified:  # libstdc++ quantifies the quantified atom again
                    inner = b"".join(self.out[atom_start:])
                    del self.out[atom_start:]
                    self.out.append(b"(?:" + inner + b")")
                self.out.append(text)
                quantified = just_quantified = True
            elif c == ord("["):
                atom_start = len(self.out)
                self.out.append(self.bracket())
                can_repeat, quantified = True, False
            elif c == ord("."):
                atom_start = len(self.out)
                self.out.append(rb"[^\n\r]")
                can_repeat, quantified = True, False
            elif c == ord("$"):
                self.out.append(rb"\Z")
                can_repeat, quantified = False, False
            elif c == ord("^"):
                self.out.append(b"^")
                can_repeat, quantified = False, False
            else:
                atom_start = len(self.out)
                self.out.append(_byte(c))
                can_repeat, quantified = True, False
        if depth:
            raise self.error(_PAREN)
        return b"".join(self.out)

    def brace(self) -> bytes:
        """``{n}``, ``{n,}`` or ``{n,m}`` after the ``{``."""
        end = self.p.find(b"}", self.i)
        body = self.p[self.i : end] if end >= 0 else b""
        m = re.fullmatch(rb"(\d+)(,(\d*))?", body)
        if end < 0 or m is None:
            raise self.error(_BRACE)
        if m.group(3) and int(m.group(3)) < int(m.group(1)):
            raise self.error(_BRACE)
        self.i = end + 1
        return b"{" + body + b"}"

    def escape(self, in_class: bool) -> bytes:
        """The escape after a backslash (``self.i`` at the escaped byte)."""
        p = self.p
        if self.i >= len(p):
            raise self.error(_ESCAPE_END)
        c = p[self.i]
        self.i += 1
        if c in _CLASS_ESCAPES:
            return _CLASS_ESCAPES[c]
        if c in b"bB" and not in_class:
            return b"\\" + bytes([c])
        if c == ord("b"):  # [\b] is a backspace
            return _byte(8)
        if c in _CONTROL_ESCAPES:
            return _byte(_CONTROL_ESCAPES[c])
        if c == ord("0"):
            return _byte(0)
        if c in b"123456789" and not in_class:
            digits = bytes([c])
            while self.i < len(p) and p[self.i] in b"0123456789":
                digits += p[self.i : self.i + 1]
                self.i += 1
            return b"\\" + digits
        if c in b"xu":
            n = 2 if c == ord("x") else 4
            digits = p[self.i : self.i + n]
            if len(digits) < n or any(d not in _HEX for d in digits):
                raise self.error(_HEX_ESCAPE)
            self.i += n
            return _byte(int(digits, 16))
        if c == ord("c") and self.i < len(p) and chr(p[self.i]).isalpha():
            self.i += 1
            return _byte(p[self.i - 1] % 32)
        return _byte(c)  # an identity escape: the byte itself

    def bracket(self) -> bytes:
        """A bracket expression after the ``[``, as a Python class over bytes."""
        p = self.p
        negate = p[self.i : self.i + 1] == b"^"
        if negate:
            self.i += 1
        items: list[bytes] = []
        prev: int | None = None  # the last single byte, a range's possible start
        while True:
            if self.i >= len(p):
                raise self.error(_BRACK)
            c = p[self.i]
            self.i += 1
            if c == ord("]"):
                break
            if c == ord("[") and p[self.i : self.i + 1] == b":":
                end = p.find(b":]", self.i + 1)
                if end < 0:
                    raise self.error(_BRACK)
                name = p[self.i + 1 : end]
                if name not in _POSIX:
                    raise self.error(_CTYPE)
                items.append(_POSIX[name])
                self.i = end + 2
                prev = None
                continue
            if c == ord("-") and prev is not None and p[self.i : self.i + 1] not in (b"]", b""):
                hi_c = p[self.i]
                self.i += 1
                if hi_c == ord("\\"):
                    esc = self.escape(in_class=True)
                    if not esc.startswith(b"\\x"):
                        raise self.error(_RANGE)
                    hi = int(esc[2:], 16)
                else:
                    hi = hi_c
                if hi < prev:
                    raise self.error(_RANGE)
                items[-1] = _byte(prev) + b"-" + _byte(hi)
                prev = None
                continue
            if c == ord("\\"):
                esc = self.escape(in_class=True)
                items.append(esc)
                prev = int(esc[2:], 16) if esc.startswith(b"\\x") else None
                continue
            items.append(_byte(c))
            prev = c
        if not items:  # ECMAScript: [] matches nothing, [^] any byte
            return rb"[\x00-\xff]" if negate else b"(?!)"
        return b"[" + (b"^" if negate else b"") + b"".join(items) + b"]"


def ecmascript(pattern: str) -> re.Pattern[bytes]:
    """A trigger pattern as std::regex (ECMAScript) reads it, compiled for Python over bytes;
    raises TriggerError with libstdc++'s message where std::regex refuses it."""
    translated = _Translator(pattern.encode("utf-8")).run()
    try:
        return re.compile(translated)
    except re.error as err:
        raise TriggerError(f"Invalid regular expression: {err}") from None


@dataclass(frozen=True)
class TriggerPattern:
    """llama_grammar_trigger_pattern: the pattern text and its compiled form."""

    pattern: str
    regex: re.Pattern[bytes]

    @classmethod
    def compile(cls, pattern: str) -> TriggerPattern:
        return cls(pattern, ecmascript(pattern))

    def find(self, text: bytes) -> int | None:
        """Where the grammar's text starts if the pattern fires on ``text``, else None: the
        first capturing group that matched something, else the match's start. A pattern
        anchored at both ends is first tried on the whole text."""
        if self.pattern[:1] == "^" and self.pattern[-1:] == "$":
            m = self.regex.fullmatch(text)
            if m is not None:
                return _start(m)
        m = self.regex.search(text)
        return _start(m) if m is not None else None


def _start(m: re.Match[bytes]) -> int:
    for i in range(1, (m.re.groups or 0) + 1):
        if m.end(i) - m.start(i) > 0 and m.start(i) >= 0:
            return m.start(i)
    return m.start(0)


class TriggerWatch:
    """A lazy grammar's wait for its trigger. ``push(token, piece)`` returns None while waiting,
    else what the grammar must take now: ``[(token, piece), ...]``, the pieces cut to the text
    from the trigger on."""

    def __init__(self, patterns: list[str], tokens: list[int]):
        self.patterns = [TriggerPattern.compile(p) for p in patterns]
        self.tokens = frozenset(tokens)
        self.buffer = b""
        self.positions: list[tuple[int, int, int]] = []  # (token, start, end) in the buffer

    def push(self, token: int, piece: bytes) -> list[tuple[int, bytes]] | None:
        if token in self.tokens:
            self.buffer, self.positions = b"", []
            return [(token, piece)]
        start = len(self.buffer)
        self.positions.append((token, start, start + len(piece)))
        self.buffer += piece
        for pattern in self.patterns:
            at = pattern.find(self.buffer)
            if at is None:
                continue
            replay = [
                (tok, self.buffer[max(tok_start, at) : tok_end])
                for tok, tok_start, tok_end in self.positions
                if tok_end > at
            ]
            self.buffer, self.positions = b"", []
            return replay
        return None
