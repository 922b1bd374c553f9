"""Constrained decoding through llguidance: GBNF grammars, JSON mode and JSON schemas.

A request's constraint is resolved in llama-server's order (``resolve_constraint``) and turned
into the GBNF text llama-server feeds its grammar sampler: a ``grammar`` as given, a /completion
``json_schema`` through llama-server's schema converter, a chat ``response_format`` or
``json_schema`` through the chat template's answer parser (``json_schema_grammar``). llguidance
compiles that GBNF before any token is computed (an invalid one is a ``ConstraintError``, HTTP
400) and computes the allowed tokens; the sampler uses them as llama.cpp's grammar sampler does:
the chain runs on raw logits, the drawn token is checked, and only a rejected token makes the
chain run again on masked logits. End of generation (any EOG token) is allowed only where the
grammar is complete.

GBNF reaches llguidance through its ``gbnf_to_lark``; error texts for invalid GBNF are
llama-server's one line, the reason is llguidance's. Control tokens that do not end generation
are matched by their text, as llama.cpp's grammar matches them.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import llguidance
import numpy as np
from llguidance.gbnf_to_lark import gbnf_to_lark

from bankml.engine_cupy.grammar_triggers import (
    GrammarTrigger,
    TriggerError,
    TriggerWatch,
    trigger_regexes,
)
from bankml.engine_cupy.json_schema_grammar import (
    SchemaConversionError,
    chat_schema_gbnf,
    schema_to_gbnf,
    without_prefix,
)

SCHEMA_FIELD = "Field 'json_schema': \"json_schema\": "
GRAMMAR_FAILED = "Failed to initialize samplers: failed to parse grammar"
SCHEMA_NOT_OBJECT = f"{SCHEMA_FIELD}JSON schema conversion failed:\nJSON schema error at #: schema must be an object"
SAMPLERS_FAILED = "Failed to initialize samplers: "
# common_sampler_init rethrows a failed prefill as a plain std::exception (``throw e;``)
PREFILL_FAILED = SAMPLERS_FAILED + "std::exception"
GRAMMAR_TOOL_CALLS = "tool_calls"  # /completion's grammar_type for a chat template's grammar


class ConstraintError(ValueError):
    """An invalid grammar, schema or response_format: HTTP 400 with llama-server's message;
    ``reason`` says what llguidance found wrong (llama-server only logs its reason)."""

    def __init__(self, message: str, reason: str = ""):
        super().__init__(message)
        self.reason = reason


class GrammarStackError(ValueError):
    """A token the grammar cannot take where llama.cpp's sampler takes it without checking
    (a lazy grammar's trigger text, a generation prompt fed before the first draw); the message
    is llama.cpp's."""


@dataclass(frozen=True)
class ConstraintSpec:
    """What to compile. ``kind``: "gbnf" (``source`` is the grammar), "json_schema" (/completion:
    ``source`` is the schema as JSON) or "chat_schema" (a chat request's schema, answered after
    ``generation_prompt``, the text the chat template ends the prompt with).

    ``lazy``: the grammar waits for one of ``triggers`` (llama-server's ``grammar_lazy`` and
    ``grammar_triggers``). ``grammar_type``: llama-server's COMMON_GRAMMAR_TYPE; a grammar of type
    "tool_calls" (a chat template's) and a /completion schema ("output_format") take the
    generation prompt's tokens before the first draw, unless lazy (``needs_prefill``)."""

    kind: str
    source: str
    generation_prompt: str = ""
    lazy: bool = False
    triggers: tuple[GrammarTrigger, ...] = ()
    grammar_type: str = ""

    @property
    def needs_prefill(self) -> bool:
        """common_grammar_needs_prefill and not lazy (a chat schema's prompt is taken off its
        grammar instead, ``compile_grammar``)."""
        prefilled = self.kind == "json_schema" or (
            self.kind == "gbnf" and self.grammar_type == GRAMMAR_TOOL_CALLS
        )
        return prefilled and not self.lazy

    def with_generation_prompt(self, text: str) -> ConstraintSpec:
        return replace(self, generation_prompt=text)


# --- resolution ---------------------------------------------------------------------------------------


def _default_object(schema: Any) -> Any:
    """An absent or empty schema means any object."""
    return {"type": "object"} if isinstance(schema, dict) and not schema else schema


def resolve_constraint(body: Mapping[str, Any], kind: str) -> ConstraintSpec | None:
    """The constraint of a request, in llama-server's order.

    /v1/chat/completions (oaicompat_chat_params_parse): top-level ``json_schema`` and ``grammar``
    (not both), then ``response_format`` (json_object / json_schema / text) may replace the
    schema; an object schema goes to the chat template's parser, a top-level schema that is not an
    object is refused, a non-object schema inside response_format leaves the answer free.
    /completion: a non-null ``json_schema`` (without a ``grammar`` key) wins, else a non-empty
    ``grammar`` string. A grammar that is not a string is ignored, as json_value does.
    """
    json_schema = body.get("json_schema")
    grammar = body.get("grammar")
    grammar = grammar if isinstance(grammar, str) else ""
    if kind == "chat":
        if json_schema is not None and grammar:
            raise ConstraintError("Cannot use both json_schema and grammar")
        schema = json_schema
        if "response_format" in body:
            schema = _response_format_schema(body["response_format"], schema)
        schema = _default_object(schema)
        if isinstance(schema, dict):
            return ConstraintSpec("chat_schema", json.dumps(schema))
        if json_schema is not None:
            # the top-level field then reaches /completion's converter, which refuses it
            schema_to_constraint_text(json_schema)
    elif json_schema is not None and "grammar" not in body:
        return ConstraintSpec("json_schema", json.dumps(_default_object(json_schema)))
    if grammar:
        return ConstraintSpec("gbnf", grammar)
    return None


def _response_format_schema(fmt: Any, schema: Any) -> Any:
    """The schema after response_format: its own ({} when it names none), or ``schema`` for
    text (and for json_object without a schema of its own when one was given)."""
    if not isinstance(fmt, dict):
        fmt = {}
    rtype = fmt.get("type") if isinstance(fmt.get("type"), str) else ""
    if rtype == "json_object":
        if "schema" in fmt or not schema:
            return fmt.get("schema") if fmt.get("schema") is not None else {}
        return schema
    if rtype == "json_schema":
        wrapper = fmt.get("json_schema") if isinstance(fmt.get("json_schema"), dict) else {}
        return wrapper.get("schema") if wrapper.get("schema") is not None else {}
    if rtype and rtype != "text":
        raise ConstraintError(
            f'response_format type must be one of "text" or "json_object", but got: {rtype}'
        )
    return schema


# --- compilation ---------------------------------------------------------------------------------------


def schema_to_constraint_text(schema: Any) -> str:
    """/completion's GBNF for a schema; a refusal is a ConstraintError with llama-server's text."""
    try:
        return schema_to_gbnf(schema)
    except SchemaConversionError as err:
        raise ConstraintError(f"{SCHEMA_FIELD}{err}", str(err)) from None


def constraint_gbnf(spec: ConstraintSpec) -> str:
    """The GBNF llama-server's grammar sampler starts from for this spec (for a chat schema, the
    grammar with the generation prompt still at the head of its root)."""
    if spec.kind == "gbnf":
        return spec.source
    if spec.kind == "json_schema":
        return schema_to_constraint_text(json.loads(spec.source))
    try:
        return chat_schema_gbnf(json.loads(spec.source), spec.generation_prompt)
    except SchemaConversionError as err:
        raise ConstraintError(str(err), str(err)) from None


def compile_grammar(spec: ConstraintSpec) -> str:
    """The llguidance grammar text for a spec (no tokenizer needed); raises ConstraintError.

    For a chat schema, llama-server's sampler first accepts the generation prompt's tokens into
    the grammar; that leaves exactly the grammar without the root's leading literal."""
    gbnf = constraint_gbnf(spec)
    if spec.kind == "chat_schema":
        gbnf = without_prefix(gbnf, spec.generation_prompt)
    try:
        lark = gbnf_to_lark(gbnf)
    except Exception as err:  # the converter raises plain Exception for unknown rules
        raise ConstraintError(GRAMMAR_FAILED, str(err)) from None
    # Without this llguidance allows only the canonical tokens of a forced stretch (after "```"
    # only "json", never "j" or "js"); llama.cpp's grammar allows every token that fits.
    options = '%llguidance {"no_forcing": true}'
    if lark.startswith("%llguidance {}"):
        lark = options + lark[len("%llguidance {}") :]
    else:
        lark = f"{options}\n{lark}"
    return llguidance.LLMatcher.grammar_from_lark(lark)


def check_grammar(grammar: str, tokenizer: llguidance.LLTokenizer | None) -> None:
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
    if is_error:
        reason = messages[0] if messages else "invalid"
        raise ConstraintError(GRAMMAR_FAILED, reason)


# --- llguidance's view of the vocabulary -----------------------------------------------------------------


class _VocabForLlg:
    """The duck-typed tokenizer llguidance.TokenizerWrapper reads."""

    def __init__(
        self,
        pieces: Sequence[bytes],
        eos_id: int,
        bos_id: int | None,
        tokenize: Callable[[str], list[int]],
    ):
        self.tokens = list(pieces)
        # none: llama.cpp's grammar matches a control token by its text, like any other piece
        self.special_token_ids: list[int] = []
        self.eos_token_id = eos_id
        self.bos_token_id = bos_id
        self._tokenize = tokenize

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", "replace")
        return self._tokenize(text)


def build_llg_tokenizer(
    pieces: Sequence[bytes],
    eog_ids: Collection[int],
    bos_id: int | None,
    tokenize: Callable[[str], list[int]],
) -> llguidance.LLTokenizer:
    """An LLTokenizer over the GGUF vocabulary (``token_to_piece(special=true)`` bytes); every
    EOG token ends a complete grammar, and only there (``Constraint`` sees to it)."""
    eog = sorted(eog_ids)
    wrapper = llguidance.TokenizerWrapper(_VocabForLlg(pieces, eog[0], bos_id, tokenize))
    return llguidance.LLTokenizer(wrapper, n_vocab=len(pieces), eos_token=eog)


# --- the matcher at generation time ------------------------------------------------------------------------


class Constraint:
    """One request's grammar state: which tokens may come next, and the tokens taken so far.

    A lazy grammar (``spec.lazy``) constrains nothing until a trigger fires (``TriggerWatch``):
    until then every token is allowed, EOG included; then it takes the trigger's text and
    constrains every later token. ``pieces`` are the tokens' texts as the grammar reads them
    (``token_to_piece(special=true)``), needed by a lazy grammar's patterns."""

    def __init__(
        self,
        spec: ConstraintSpec,
        tokenizer: llguidance.LLTokenizer,
        n_vocab: int,
        eog_ids: frozenset[int],
        pieces: Sequence[bytes] | None = None,
    ):
        grammar = compile_grammar(spec)
        check_grammar(grammar, tokenizer)
        self.spec = spec
        self.n_vocab = n_vocab
        self.eog_ids = eog_ids
        self._eog = np.fromiter(sorted(eog_ids), dtype=np.int64)
        self.matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if self.matcher.is_error():
            raise ConstraintError(GRAMMAR_FAILED, self.matcher.get_error())
        self.pieces = pieces
        self.watch: TriggerWatch | None = None
        if spec.lazy:
            try:
                self.watch = TriggerWatch(*trigger_regexes(spec.triggers))
            except TriggerError as err:
                raise ConstraintError(SAMPLERS_FAILED + str(err), str(err)) from None
        self._byte_tokens: dict[int, int] | None = None

    @property
    def awaiting(self) -> bool:
        """A lazy grammar still waiting for its trigger."""
        return self.watch is not None

    def is_complete(self) -> bool:
        return self.matcher.is_accepting()

    def allows(self, token: int) -> bool:
        """llama_sampler_grammar_apply on one candidate: EOG only where the grammar is complete."""
        if self.awaiting:
            return True
        if token in self.eog_ids:
            return self.is_complete()
        return self.matcher.validate_tokens([token]) == 1

    def mask(self) -> np.ndarray:
        """Allowed tokens as a boolean vector over the model's vocabulary."""
        if self.awaiting:
            return np.ones(self.n_vocab, dtype=bool)
        words = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        bits = np.unpackbits(words, bitorder="little").astype(bool)
        out = np.zeros(self.n_vocab, dtype=bool)
        n = min(self.n_vocab, len(bits))
        out[:n] = bits[:n]
        out[self._eog[self._eog < self.n_vocab]] = self.is_complete()
        return out

    def accept(self, token: int) -> None:
        """llama_grammar_accept_impl: while a lazy grammar waits, the token goes to its trigger
        watch (and, when a trigger fires, the trigger's text to the grammar); else to the
        grammar. EOG is taken without a change (the sampler allowed it only when complete)."""
        if self.watch is not None:
            if self.pieces is None:
                raise ValueError("a lazy grammar needs the vocabulary's pieces")
            fired = self.watch.push(token, self.pieces[token])
            if fired is None:
                return
            self.watch = None
            for tok, piece in fired:
                self._take_piece(tok, piece)
            return
        if token in self.eog_ids:
            return
        if not self.matcher.consume_token(token):
            raise ConstraintError(
                f"token {token} does not fit the grammar: {self.matcher.get_error()}"
            )

    def prefill(self, tokens: Sequence[int]) -> None:
        """The generation prompt's tokens, taken before the first draw (common_sampler_init);
        a token the grammar refuses is llama-server's refusal of the request."""
        for t in tokens:
            try:
                if t in self.eog_ids:  # llama_grammar_accept_impl: only where complete
                    if not self.is_complete():
                        raise GrammarStackError(f"end of generation ({t}) before the grammar ends")
                    continue
                self._take_piece(t, self.pieces[t] if self.pieces is not None else None)
            except GrammarStackError as err:
                raise ConstraintError(PREFILL_FAILED, str(err)) from None

    def _take_piece(self, token: int, piece: bytes | None) -> None:
        """llama_grammar_accept_token: the grammar reads ``piece`` (the token's text, or the end
        of it where a trigger fired inside it; None: the token's own text), an end-of-generation
        token's text too. GrammarStackError, with llama.cpp's message, if it cannot take it."""
        whole = piece is None or self.pieces is None or piece == self.pieces[token]
        if whole and token not in self.eog_ids:
            ok = bool(self.matcher.consume_token(token))
        else:
            data = piece if piece is not None else b""
            ok = all(self.matcher.consume_token(t) for t in self._tokens_of(data))
        if not ok:
            text = (piece or b"").decode("utf-8", "replace")
            raise GrammarStackError(
                f"Unexpected empty grammar stack after accepting piece: {text} ({token})"
            )

    def _tokens_of(self, data: bytes) -> list[int]:
        """Tokens spelling ``data`` one byte each (the grammar reads bytes, whatever the
        tokens): the vocabulary's single-byte pieces."""
        if self._byte_tokens is None:
            assert self.pieces is not None
            table: dict[int, int] = {}
            for tid, p in enumerate(self.pieces):
                if len(p) == 1 and p[0] not in table and tid not in self.eog_ids:
                    table[p[0]] = tid
            self._byte_tokens = table
        missing = [b for b in data if b not in self._byte_tokens]
        if missing:
            raise GrammarStackError(f"no token spells the byte {missing[0]:#04x}")
        return [self._byte_tokens[b] for b in data]


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
