"""Constrained decoding through llguidance: GBNF grammars, JSON mode and JSON schemas.

A request's constraint is resolved in llama-server's order (``resolve_constraint``), compiled
by llguidance before any token is computed (an invalid one is a ``ConstraintError``, HTTP 400),
and then used by the sampler as llama.cpp's grammar sampler is: the chain runs on raw logits,
the drawn token is checked, and only a rejected token makes the chain run again on masked logits.
End of generation (any EOG token) is allowed only where the grammar is complete.

Choices where llama-server differs: llama.cpp compiles GBNF with its own parser and converts
schemas with ``json_schema_to_grammar``; here GBNF goes through llguidance's ``gbnf_to_lark`` and
schemas through llguidance's JSON compiler, so the language accepted is the same for the
supported constructs but error texts and rare corner cases (regex features, token terminals
``<[id]>``) differ. Control tokens are never matched as grammar text.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import llguidance
import numpy as np
from llguidance.gbnf_to_lark import gbnf_to_lark

# llama.cpp's json_schema_to_grammar allows `space ::= | " " | "\n"{1,2} [ \t]{0,20}` between items;
# an unbounded whitespace rule lets a small model loop on blanks until the token limit.
JSON_OPTIONS: dict[str, Any] = {"whitespace_pattern": r"(?: |\n{1,2}[ \t]{0,20})?"}


SCHEMA_FAILED = "Field 'json_schema': \"json_schema\": JSON schema conversion failed"
GRAMMAR_FAILED = "Failed to initialize samplers: failed to parse grammar"
SCHEMA_NOT_OBJECT = (
    "Field 'json_schema': \"json_schema\": JSON schema conversion failed:\n"
    "JSON schema error at #: schema must be an object"
)


class ConstraintError(ValueError):
    """An invalid grammar, schema or response_format: HTTP 400 with llama-server's message;
    ``reason`` says what llguidance found wrong (llama-server only logs its reason)."""

    def __init__(self, message: str, reason: str = ""):
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class ConstraintSpec:
    """What to compile: ``kind`` is "gbnf", "json_object" or "json_schema"; ``source`` its text."""

    kind: str
    source: str


# --- resolution ---------------------------------------------------------------------------------------


def _schema_spec(schema: Any) -> ConstraintSpec:
    if isinstance(schema, dict) and not schema:
        schema = {"type": "object"}
    if not isinstance(schema, dict):
        raise ConstraintError(SCHEMA_NOT_OBJECT, "the schema is not a JSON object")
    kind = "json_object" if schema == {"type": "object"} else "json_schema"
    return ConstraintSpec(kind, json.dumps(schema))


def resolve_constraint(body: Mapping[str, Any], kind: str) -> ConstraintSpec | None:
    """The constraint of a request, in llama-server's order.

    /v1/chat/completions (oaicompat_chat_params_parse): top-level ``json_schema`` and ``grammar``
    (not both), then ``response_format`` (json_object / json_schema / text); a top-level schema
    that is not an object is refused, a non-object schema inside response_format leaves the answer
    unconstrained. /completion: a ``json_schema`` (without a ``grammar`` key) wins, else a
    non-empty ``grammar`` string. A grammar that is not a string is ignored, as json_value does.
    """
    json_schema = body.get("json_schema")
    grammar = body.get("grammar")
    grammar = grammar if isinstance(grammar, str) else ""
    if kind == "chat":
        if json_schema is not None and grammar:
            raise ConstraintError("Cannot use both json_schema and grammar")
        if json_schema is not None:
            return _schema_spec(json_schema)
        fmt = body.get("response_format")
        if fmt is not None:
            schema = _response_format_schema(fmt)
            return _schema_spec(schema) if isinstance(schema, dict) else None
    elif "json_schema" in body and json_schema is not None and "grammar" not in body:
        return _schema_spec(json_schema)
    if grammar:
        return ConstraintSpec("gbnf", grammar)
    return None


def _response_format_schema(fmt: Any) -> Any:
    """The schema a response_format asks for ({} for plain JSON mode), or None for text."""
    if not isinstance(fmt, dict):
        fmt = {}
    rtype = fmt.get("type") if isinstance(fmt.get("type"), str) else ""
    if rtype == "json_object":
        return fmt.get("schema") if fmt.get("schema") is not None else {}
    if rtype == "json_schema":
        wrapper = fmt.get("json_schema") if isinstance(fmt.get("json_schema"), dict) else {}
        return wrapper.get("schema") if wrapper.get("schema") is not None else {}
    if rtype and rtype != "text":
        raise ConstraintError(
            f'response_format type must be one of "text" or "json_object", but got: {rtype}'
        )
    return None


# --- compilation ---------------------------------------------------------------------------------------


class _VocabForLlg:
    """The duck-typed tokenizer llguidance.TokenizerWrapper reads."""

    def __init__(
        self,
        pieces: Sequence[bytes],
        special_ids: Sequence[int],
        eos_id: int,
        bos_id: int | None,
        tokenize: Callable[[str], list[int]],
    ):
        self.tokens = list(pieces)
        self.special_token_ids = list(special_ids)
        self.eos_token_id = eos_id
        self.bos_token_id = bos_id
        self._tokenize = tokenize

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", "replace")
        return self._tokenize(text)


def build_llg_tokenizer(
    pieces: Sequence[bytes],
    special_ids: Sequence[int],
    eog_ids: Sequence[int],
    bos_id: int | None,
    tokenize: Callable[[str], list[int]],
) -> llguidance.LLTokenizer:
    """An LLTokenizer over the GGUF vocabulary; every EOG token ends a complete grammar."""
    eog = sorted(eog_ids)
    wrapper = llguidance.TokenizerWrapper(
        _VocabForLlg(pieces, special_ids, eog[0], bos_id, tokenize)
    )
    return llguidance.LLTokenizer(wrapper, n_vocab=len(pieces), eos_token=eog)


def compile_grammar(spec: ConstraintSpec) -> str:
    """The llguidance grammar text for a spec (no tokenizer needed); raises ConstraintError."""
    if spec.kind == "gbnf":
        try:
            lark = gbnf_to_lark(spec.source)
        except Exception as err:  # the converter raises plain Exception for unknown rules
            raise ConstraintError(GRAMMAR_FAILED, str(err)) from None
        return llguidance.LLMatcher.grammar_from_lark(lark)
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(spec.source, overrides=JSON_OPTIONS)
    except ValueError as err:
        raise ConstraintError(SCHEMA_FAILED, str(err)) from None


def check_grammar(grammar: str, tokenizer: llguidance.LLTokenizer | None, kind: str) -> None:
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
    if is_error:
        reason = messages[0] if messages else "invalid"
        raise ConstraintError(
            GRAMMAR_FAILED if kind == "gbnf" else f"{SCHEMA_FAILED}: {reason}", reason
        )


# --- the matcher at generation time ------------------------------------------------------------------------


class Constraint:
    """One request's grammar state: which tokens may come next, and the tokens taken so far."""

    def __init__(
        self,
        spec: ConstraintSpec,
        tokenizer: llguidance.LLTokenizer,
        n_vocab: int,
        eog_ids: frozenset[int],
    ):
        grammar = compile_grammar(spec)
        check_grammar(grammar, tokenizer, spec.kind)
        self.spec = spec
        self.n_vocab = n_vocab
        self.eog_ids = eog_ids
        self._eog = np.fromiter(sorted(eog_ids), dtype=np.int64)
        self.matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if self.matcher.is_error():
            raise ConstraintError(GRAMMAR_FAILED, self.matcher.get_error())

    def is_complete(self) -> bool:
        return self.matcher.is_accepting()

    def allows(self, token: int) -> bool:
        """llama_sampler_grammar_apply on one candidate: EOG only where the grammar is complete."""
        if token in self.eog_ids:
            return self.is_complete()
        return self.matcher.validate_tokens([token]) == 1

    def mask(self) -> np.ndarray:
        """Allowed tokens as a boolean vector over the model's vocabulary."""
        words = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        bits = np.unpackbits(words, bitorder="little").astype(bool)
        out = np.zeros(self.n_vocab, dtype=bool)
        n = min(self.n_vocab, len(bits))
        out[:n] = bits[:n]
        out[self._eog[self._eog < self.n_vocab]] = self.is_complete()
        return out

    def accept(self, token: int) -> None:
        if token in self.eog_ids:
            return
        if not self.matcher.consume_token(token):
            raise ConstraintError(
                f"token {token} does not fit the grammar: {self.matcher.get_error()}"
            )


def validate_text(
    spec: ConstraintSpec, tokenizer: llguidance.LLTokenizer, ids: Sequence[int]
) -> bool:
    """Whether a whole token sequence is a complete sentence of the grammar (for tests and checks)."""
    c = Constraint(spec, tokenizer, tokenizer.vocab_size, frozenset(tokenizer.eos_tokens))
    for t in ids:
        if not c.allows(t):
            return False
        c.accept(t)
    return c.is_complete()
