"""Constraints: llama-server's resolution order and messages, compile errors before compute, and the
token masks over the real SmolLM2 vocabulary (EOG only where the grammar is complete)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bankml.engine_cupy.grammar import (
    GRAMMAR_FAILED,
    SCHEMA_NOT_OBJECT,
    Constraint,
    ConstraintError,
    ConstraintSpec,
    build_llg_tokenizer,
    resolve_constraint,
    validate_text,
)
from bankml.engine_cupy.tokenizer import Tokenizer
from tests import support


@pytest.fixture(scope="module")
def vocab(default_model: Path):
    tok = Tokenizer.from_gguf(default_model)
    llg = build_llg_tokenizer(tok.vocab_bytes(), tok.eog_ids, tok.bos_id, lambda s: tok.tokenize(s))
    return tok, llg


def constraint(vocab, body: dict, kind: str = "completion") -> Constraint:
    tok, llg = vocab
    spec = resolve_constraint(body, kind)
    assert spec is not None
    return Constraint(spec, llg, tok.n_vocab, tok.eog_ids)


# --- resolution ---------------------------------------------------------------------------------------------


def test_resolution_order() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert resolve_constraint({}, "chat") is None
    assert resolve_constraint({"response_format": {"type": "text"}}, "chat") is None
    # JSON mode is the schema {"type": "object"}, through the chat template's parser in chat
    assert resolve_constraint({"response_format": {"type": "json_object"}}, "chat") == (
        ConstraintSpec("chat_schema", '{"type": "object"}')
    )
    fmt = {"type": "json_schema", "json_schema": {"schema": schema}}
    assert resolve_constraint({"response_format": fmt}, "chat").source == json.dumps(schema)
    # response_format's schema replaces a top-level one; json_object keeps it
    other = {"type": "string"}
    assert resolve_constraint({"json_schema": other, "response_format": fmt}, "chat").source == (
        json.dumps(schema)
    )
    assert resolve_constraint(
        {"json_schema": other, "response_format": {"type": "json_object"}}, "chat"
    ).source == json.dumps(other)
    assert resolve_constraint({"json_schema": {}}, "completion") == ConstraintSpec(
        "json_schema", '{"type": "object"}'
    )
    assert resolve_constraint({"json_schema": None}, "completion") is None
    assert resolve_constraint({"grammar": 'root ::= "a"'}, "completion").kind == "gbnf"
    # /completion: json_schema wins only without a grammar key; an empty grammar is none
    assert resolve_constraint({"grammar": ""}, "completion") is None
    assert (
        resolve_constraint({"json_schema": schema, "grammar": 'root ::= "a"'}, "completion").kind
        == "gbnf"
    )


@pytest.mark.parametrize(
    "body,message",
    [
        (
            {"json_schema": {"type": "object"}, "grammar": 'root ::= "a"'},
            "Cannot use both json_schema and grammar",
        ),
        (
            {"response_format": {"type": "yaml"}},
            'response_format type must be one of "text" or "json_object", but got: yaml',
        ),
    ],
)
def test_chat_resolution_refusals_match_llama_server(
    reference_server: support.LlamaServer, body: dict, message: str
) -> None:
    request = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, **body}
    status, answer = support.http_json(reference_server.url + "/v1/chat/completions", request)
    # llama-server answers "Cannot use both" with a 500 (a runtime_error); bankml keeps the text and
    # says 400, since the request is at fault
    assert status in (400, 500) and answer["error"]["message"] == message
    with pytest.raises(ConstraintError) as err:
        resolve_constraint(request, "chat")
    assert str(err.value) == message


def test_a_grammar_that_is_not_a_string_is_ignored() -> None:
    # json_value(data, "grammar", std::string()) falls back to "" on a type mismatch
    assert resolve_constraint({"grammar": 5}, "completion") is None
    assert resolve_constraint({"grammar": 5, "messages": []}, "chat") is None


def test_non_object_schemas() -> None:
    with pytest.raises(ConstraintError) as err:
        resolve_constraint({"json_schema": "abc"}, "chat")
    assert str(err.value) == SCHEMA_NOT_OBJECT
    # inside response_format a schema that is not an object leaves the answer unconstrained
    assert (
        resolve_constraint({"response_format": {"type": "json_object", "schema": "abc"}}, "chat")
        is None
    )


# --- compilation --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "grammar", ["root ::= missing", 'other ::= "a"', 'root ::= "a', "root ::= [a-", 'root ::= ("a"']
)
def test_invalid_gbnf_is_refused(vocab, grammar: str) -> None:
    with pytest.raises(ConstraintError) as err:
        constraint(vocab, {"grammar": grammar})
    assert str(err.value) == GRAMMAR_FAILED and err.value.reason


def test_invalid_schema_is_refused(vocab) -> None:
    with pytest.raises(ConstraintError):
        constraint(vocab, {"json_schema": "a string"})
    with pytest.raises(ConstraintError):
        constraint(
            vocab,
            {"json_schema": {"type": "object", "properties": {"a": {"type": "no-such-type"}}}},
        )


@pytest.mark.parametrize(
    "body",
    [
        {"grammar": 'root ::= "x" | missing'},
        {"grammar": 'root ::= "a'},
        {"json_schema": []},
        {"json_schema": "abc"},
    ],
)
def test_invalid_constraints_get_llama_servers_message(
    reference_server: support.LlamaServer, vocab, body: dict
) -> None:
    status, answer = support.http_json(
        reference_server.url + "/completion", {"prompt": "Hi", "n_predict": 1, **body}
    )
    assert status == 400
    with pytest.raises(ConstraintError) as err:
        constraint(vocab, body)
    assert str(err.value) == answer["error"]["message"]


# --- masks ----------------------------------------------------------------------------------------------------


def test_mask_and_eog_only_when_complete(vocab) -> None:
    tok, _ = vocab
    c = constraint(vocab, {"grammar": 'root ::= "yes" | "yes!"'})
    mask = c.mask()
    allowed = {tok.token_to_piece(int(i), True) for i in mask.nonzero()[0]}
    assert allowed and all(b"yes!".startswith(p) for p in allowed)
    assert not any(mask[e] for e in tok.eog_ids) and not c.allows(min(tok.eog_ids))
    yes = tok.tokenize("yes")
    assert len(yes) == 1 and c.allows(yes[0])
    c.accept(yes[0])
    assert c.is_complete() and all(c.mask()[e] for e in tok.eog_ids) and c.allows(min(tok.eog_ids))
    assert c.mask()[tok.tokenize("!")[0]]


def test_validate_text(vocab) -> None:
    tok, llg = vocab
    spec = resolve_constraint(
        {
            "json_schema": {
                "type": "object",
                "properties": {"n": {"type": "integer"}},
                "required": ["n"],
            }
        },
        "completion",
    )
    assert validate_text(spec, llg, tok.tokenize('{"n": 12}'))
    assert not validate_text(spec, llg, tok.tokenize('{"n": "x"}'))
    assert not validate_text(spec, llg, tok.tokenize('{"n": 1'))  # incomplete: EOG would be refused
