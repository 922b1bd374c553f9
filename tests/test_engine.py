"""The Engine: its mechanics on a scripted stand-in model (fast, exact), then the real default
model against the real llama-server (seeded answers, refusals, context limit, logprobs, cache reuse,
JSON-schema and GBNF answers)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
import pytest

from bankml.engine_cupy.chat_template import ChatTemplate
from bankml.engine_cupy.engine import Engine
from bankml.engine_cupy.grammar import resolve_constraint, validate_text
from bankml.engine_cupy.request import RequestError
from bankml.engine_cupy.stops import TextRelease, find_partial_stop
from bankml.engine_cupy.tokenizer import Tokenizer
from bankml.formats.chat_content import chat_schema_content
from tests import support

# --- a scripted stand-in for Model: the next token is chosen by position ---------------------------------


class ScriptCache:
    def __init__(self, n_ctx: int):
        self.n_ctx = n_ctx
        self.n_tokens = 0

    def truncate(self, n: int) -> None:
        self.n_tokens = min(self.n_tokens, n)


class ScriptModel:
    """forward() appends to the cache and returns logits peaked on script[position] (else EOG)."""

    has_sliding_window = False

    def __init__(self, n_vocab: int, eog: int):
        self.n_vocab = n_vocab
        self.eog = eog
        self.script: dict[int, int] = {}
        self.batches: list[int] = []

    def new_cache(self, n_ctx: int, cache_type: str | None = None) -> ScriptCache:
        return ScriptCache(n_ctx)

    def follow(self, prompt_len: int, tokens: list[int]) -> None:
        self.script = {prompt_len + i: t for i, t in enumerate(tokens)}

    def forward(
        self, tokens: list[int], cache: ScriptCache, all_logits: bool = False
    ) -> np.ndarray:
        assert cache.n_tokens + len(tokens) <= cache.n_ctx
        self.batches.append(len(tokens))
        cache.n_tokens += len(tokens)
        logits = np.zeros(self.n_vocab, dtype=np.float32)
        logits[self.script.get(cache.n_tokens, self.eog)] = 20.0
        return logits


@pytest.fixture(scope="module")
def vocab(default_model: Path) -> tuple[Tokenizer, ChatTemplate]:
    tok = Tokenizer.from_gguf(default_model)
    return tok, ChatTemplate.from_gguf(default_model, tok)


def scripted_engine(
    vocab: tuple[Tokenizer, ChatTemplate], n_ctx: int = 4096
) -> tuple[Engine, ScriptModel]:
    tok, template = vocab
    model = ScriptModel(tok.n_vocab, min(tok.eog_ids))
    return Engine(model, tok, template, n_ctx), model


def run(engine: Engine, body: dict, kind: str = "completion", cancelled: Any = lambda: False):
    steps = engine.run_steps(engine.parse_request(body, kind), cancelled)
    chunks = list(steps)
    return chunks, steps.summary


GREEDY = {"temperature": 0, "seed": 1}


def test_prefill_runs_in_micro_batches_of_512(vocab) -> None:
    engine, model = scripted_engine(vocab)
    model.follow(1100, [])
    _, summary = run(engine, {"prompt": list(range(1000, 2100)), "n_predict": 3, **GREEDY})
    assert model.batches == [512, 512, 76]
    assert summary.completion_tokens == 1 and summary.finish_reason == "stop"  # EOG at once


def test_cancel_between_micro_batches_keeps_what_was_computed(vocab) -> None:
    engine, model = scripted_engine(vocab)
    checks = iter([False, True])
    chunks, summary = run(
        engine, {"prompt": list(range(1000, 2100)), **GREEDY}, cancelled=lambda: next(checks)
    )
    assert chunks == [] and summary.cancelled
    assert model.batches == [512] and len(engine.slot_tokens) == 512


def test_cancel_between_tokens(vocab) -> None:
    engine, model = scripted_engine(vocab)
    model.follow(3, [300, 301, 302, 303, 304])
    calls = {"n": 0}

    def cancelled() -> bool:
        calls["n"] += 1
        return calls["n"] > 3  # prefill check, then two tokens

    chunks, summary = run(engine, {"prompt": [10, 11, 12], **GREEDY}, cancelled=cancelled)
    assert [c.token for c in chunks] == [300, 301] and summary.cancelled


def test_prefix_reuse_and_cache_prompt_false(vocab) -> None:
    engine, model = scripted_engine(vocab)
    prompt = list(range(500, 540))
    model.follow(40, [600, 601])
    _, first = run(engine, {"prompt": prompt, **GREEDY})
    assert first.timings["cache_n"] == 0 and first.timings["prompt_n"] == 40
    # the slot holds the prompt and every generated token but the last (the EOG is never decoded)
    assert engine.slot_tokens == prompt + [600, 601]
    _, again = run(engine, {"prompt": prompt, **GREEDY})
    assert (
        again.timings["cache_n"] == 39 and again.timings["prompt_n"] == 1
    )  # the last token re-evaluated
    _, longer = run(engine, {"prompt": prompt + [700, 701], **GREEDY})
    assert longer.timings["cache_n"] == 40
    _, off = run(engine, {"prompt": prompt, "cache_prompt": False, **GREEDY})
    assert off.timings["cache_n"] == 0 and off.timings["prompt_n"] == 40


def test_limits_n_predict_and_full_context(vocab) -> None:
    engine, model = scripted_engine(vocab, n_ctx=20)
    model.follow(10, list(range(300, 330)))
    _, zero = run(engine, {"prompt": list(range(10, 20)), "n_predict": 0, **GREEDY})
    assert (
        zero.completion_tokens == 1 and zero.finish_reason == "length"
    )  # llama-server samples one
    _, three = run(engine, {"prompt": list(range(10, 20)), "max_tokens": 3, **GREEDY})
    assert three.tokens == [300, 301, 302] and three.finish_reason == "length"
    _, full = run(engine, {"prompt": list(range(10, 20)), "n_predict": -1, **GREEDY})
    assert full.completion_tokens == 10 and full.finish_reason == "length"  # slot + 1 reached n_ctx
    for t in (full.timings["prompt_per_second"], full.timings["predicted_per_second"]):
        assert t is None or t > 0


def test_context_limit_body(vocab) -> None:
    engine, _ = scripted_engine(vocab, n_ctx=16)
    with pytest.raises(RequestError) as err:
        engine.parse_request({"prompt": list(range(100, 116))}, "completion")
    assert err.value.body == {
        "error": {
            "code": 400,
            "message": "request (16 tokens) exceeds the available context size (16 tokens), try increasing it",
            "type": "exceed_context_size_error",
            "n_prompt_tokens": 16,
            "n_ctx": 16,
        }
    }


def test_stop_string_cut_and_partial_hold(vocab) -> None:
    tok, _ = vocab
    engine, model = scripted_engine(vocab)
    ids = tok.tokenize("Hello END more words")
    model.follow(2, ids)
    chunks, summary = run(engine, {"prompt": [10, 11], "stop": ["ENDX", "more"], **GREEDY})
    assert summary.finish_reason == "stop" and summary.stopping_word == "more"
    assert summary.text == "Hello END "
    texts = [c.text for c in chunks]
    assert "".join(texts) == "Hello END "
    assert "" in texts  # " END" was held while it could begin "ENDX"


def test_utf8_held_to_whole_characters_with_entries(vocab) -> None:
    tok, _ = vocab
    pieces = tok.vocab_bytes()
    by_piece = {p: i for i, p in enumerate(pieces)}
    emoji = "😀".encode()
    ids = [by_piece[bytes([b])] for b in emoji]
    engine, model = scripted_engine(vocab)
    model.follow(2, ids)
    chunks, summary = run(engine, {"prompt": [10, 11], "n_probs": 3, **GREEDY})
    assert [c.text for c in chunks[:4]] == ["", "", "", "😀"]
    assert [c.entry is None for c in chunks[:4]] == [True, True, True, False]
    entry = chunks[3].entry
    assert entry["token"] == "😀" and entry["bytes"] == list(emoji) and entry["id"] == ids[3]
    assert set(entry) == {"id", "token", "bytes", "logprob", "top_logprobs"}
    assert len(entry["top_logprobs"]) == 3 and entry["top_logprobs"][0]["id"] == ids[3]
    assert chunks[0].first and not chunks[1].first


def test_grammar_overrides_the_model_and_holds_eog_until_complete(vocab) -> None:
    tok, _ = vocab
    engine, model = scripted_engine(vocab)
    model.follow(2, [])  # the model wants EOG at once
    chunks, summary = run(
        engine, {"prompt": [10, 11], "grammar": 'root ::= "yes" | "no"', **GREEDY}
    )
    assert summary.text in ("yes", "no") and summary.finish_reason == "stop"
    assert summary.tokens[-1] in tok.eog_ids


def test_release_helpers() -> None:
    assert find_partial_stop(b"abc EN", b"END") == 4
    assert find_partial_stop(b"abc", b"END") == -1
    r = TextRelease(["\n\n"])
    assert r.push(b"a\n", False) == (b"", False)
    assert r.push(b"\nb", False) == (b"a", True)


# --- the real model against the real llama-server ------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(default_model: Path) -> Engine:
    return Engine.open(default_model, n_ctx=2048, device="cpu")


def completion(server: support.LlamaServer, body: dict) -> tuple[int, dict]:
    return support.http_json(server.url + "/completion", body)


PROMPTS = [
    "<|im_start|>user\nWrite a short poem about the sea.<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "Once upon a time, in a small village,",
    "def fibonacci(n):",
]

SAMPLING_CASES = [
    {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05},
    {"temperature": 1.0, "top_k": 40, "top_p": 1.0, "min_p": 0.0},
    {"temperature": 0.5, "top_k": 5},
    {"temperature": 1.3, "top_k": 100, "top_p": 0.9, "min_p": 0.1},
    {
        "temperature": 0.7,
        "repeat_penalty": 1.3,
        "repeat_last_n": 32,
        "presence_penalty": 0.5,
        "frequency_penalty": 0.3,
    },
]


# Whole-engine seeded answers against llama-server's: every one identical, token for token, since
# the CPU forward pass computes ggml's own bits (docs/modules/sampler.md); the sampler alone is
# checked exactly by test_sampler_on_llama_servers_own_distribution.
END_TO_END_TOKENS = 32


def compare_seeded(
    engine: Engine, server: support.LlamaServer, cases: list[tuple[str, dict]], what: str
) -> int:
    same = 0
    for prompt, params in cases:
        ids = engine.tokenize(prompt, add_special=True, parse_special=True)
        body = {
            "prompt": ids,
            "n_predict": END_TO_END_TOKENS,
            "cache_prompt": False,
            "return_tokens": True,
            **params,
        }
        status, ref = completion(server, body)
        assert status == 200, ref
        steps = engine.run_steps(engine.parse_request(body, "completion"))
        for _ in steps:
            pass
        ok = steps.summary.tokens == ref["tokens"]
        same += ok
        print(f"  {'same' if ok else 'DIFF'} {params}")
    print(f"{what}: {same}/{len(cases)} identical token sequences of {END_TO_END_TOKENS} tokens")
    return same


EXACT_CASES = [
    ({"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}, 200),
    ({"temperature": 1.0, "top_k": 40, "top_p": 1.0, "min_p": 0.0}, 200),
    ({"temperature": 0.5, "top_k": 5}, 200),
    ({"temperature": 1.3, "top_k": 100, "top_p": 0.9, "min_p": 0.1}, 200),
    ({"temperature": 0.7, "presence_penalty": 0.5, "frequency_penalty": 0.3}, 200),
    ({"temperature": 1.0, "dry_multiplier": 0.8, "dry_allowed_length": 1, "top_k": 40}, 200),
    ({"temperature": 1.0, "xtc_probability": 0.5, "xtc_threshold": 0.1, "top_k": 40}, 200),
    ({"temperature": 1.0, "typical_p": 0.8, "top_k": 40}, 200),
    ({"temperature": 0.9, "dynatemp_range": 0.5, "dynatemp_exponent": 1.5}, 200),
    ({"temperature": 0.8, "mirostat": 1, "mirostat_tau": 4.0}, 200),
    ({"temperature": 0.8, "mirostat": 2, "mirostat_tau": 4.0, "mirostat_eta": 0.2}, 0),
    ({"temperature": 1.0, "top_n_sigma": 1.5, "top_k": 0, "top_p": 1.0, "min_p": 0.0}, 0),
    ({"temperature": 0.8, "samplers": ["min_p", "temperature", "top_k"]}, 200),
]


def test_sampler_on_llama_servers_own_distribution(
    engine: Engine, reference_server: support.LlamaServer
) -> None:
    """Teacher-forced: at each step our sampler gets llama-server's own raw distribution (its
    logprobs, which are the logits up to a constant) with the same seed and accepted tokens, and
    must draw llama-server's token. Shift-invariant stages only (repeat_penalty is not)."""
    from bankml.engine_cupy.sampler import Sampler

    steps_same = steps_all = 0
    for i, (params, n_top) in enumerate(EXACT_CASES):
        prompt = PROMPTS[i % len(PROMPTS)]
        ids = engine.tokenize(prompt, add_special=True, parse_special=True)
        n_probs = n_top or engine.n_vocab
        n_predict = 6 if n_top else 2
        body = {
            "prompt": ids,
            "n_predict": n_predict,
            "cache_prompt": False,
            "return_tokens": True,
            "n_probs": n_probs,
            "seed": 500 + i,
            **params,
        }
        status, ref = completion(reference_server, body)
        assert status == 200
        sampler = Sampler(
            engine.parse_request(body, "completion").sampler, engine._vocab_info, engine.n_vocab
        )
        for t in ids:
            sampler.accept(t)
        for token, entry in zip(ref["tokens"], ref["completion_probabilities"]):
            logits = np.full(engine.n_vocab, -np.inf, dtype=np.float32)
            for top in entry["top_logprobs"]:
                logits[top["id"]] = top["logprob"]
            steps_same += sampler.sample(logits) == token
            steps_all += 1
            sampler.accept(token)
    print(
        f"\nsampler on llama-server's distributions: {steps_same}/{steps_all} draws identical "
        f"({len(EXACT_CASES)} configurations)"
    )
    assert steps_same == steps_all


def test_seeded_sampling_matches_llama_server(
    engine: Engine, reference_server: support.LlamaServer
) -> None:
    cases = []
    for i, params in enumerate(SAMPLING_CASES):
        for j, prompt in enumerate(PROMPTS):
            cases.append((prompt, {**params, "seed": 1000 + 10 * i + j}))
    print()
    same = compare_seeded(engine, reference_server, cases, "seeded sampling")
    assert len(cases) == 20
    assert same == len(cases)


BAD_REQUESTS = [
    {"repeat_last_n": -1},
    {"dry_allowed_length": -2},
    {"dry_penalty_last_n": -5},
    {"repeat_penalty": 0},
    {"repeat_penalty": -1.5},
    {"dry_sequence_breakers": "\n"},
    {"dry_sequence_breakers": []},
    {"top_k": "forty"},
    {"temperature": "hot"},
    {"min_keep": -1},
    {"n_predict": -2},
    {"max_tokens": -7},
    {"stop": ["ok", 3]},
    {"n_predict": "ten"},
]


def _server_error(status: int, body: Any) -> tuple[int, str]:
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return status, body["error"]["message"]
    return status, body.get("raw", "") if isinstance(body, dict) else str(body)


@pytest.mark.parametrize(
    "kind,path", [("completion", "/completion"), ("chat", "/v1/chat/completions")]
)
def test_refusals_match_llama_server(
    engine: Engine, reference_server: support.LlamaServer, kind: str, path: str
) -> None:
    base = (
        {"prompt": "Hi"}
        if kind == "completion"
        else {"messages": [{"role": "user", "content": "Hi"}]}
    )
    extra = [{"logprobs": False, "top_logprobs": 3}] if kind == "chat" else []
    checked = 0
    for bad in BAD_REQUESTS + extra:
        body = (
            {**base, **bad, "n_predict": bad.get("n_predict", 1)}
            if "max_tokens" not in bad
            else {**base, **bad}
        )
        status, answer = support.http_json(reference_server.url + path, body)
        ref_status, ref_message = _server_error(status, answer)
        with pytest.raises(RequestError) as err:
            engine.parse_request(body, kind)
        assert (err.value.status, str(err.value)) == (ref_status, ref_message), bad
        checked += 1
    print(f"\n{kind}: {checked} refusals with llama-server's status and message")


def test_context_limit_matches_llama_server(
    engine: Engine, reference_server: support.LlamaServer
) -> None:
    ids = [504] * 2048
    status, answer = completion(reference_server, {"prompt": ids, "n_predict": 1})
    with pytest.raises(RequestError) as err:
        engine.parse_request({"prompt": ids, "n_predict": 1}, "completion")
    assert (err.value.status, err.value.body) == (status, answer)


def test_greedy_logprobs_and_stop_match_llama_server(
    engine: Engine, reference_server: support.LlamaServer
) -> None:
    ids = engine.tokenize(PROMPTS[1], add_special=True, parse_special=True)
    body = {
        "prompt": ids,
        "n_predict": 32,
        "temperature": 0,
        "n_probs": 5,
        "cache_prompt": False,
        "return_tokens": True,
    }
    status, ref = completion(reference_server, body)
    assert status == 200
    steps = engine.run_steps(engine.parse_request(body, "completion"))
    entries = [c.entry for c in steps if c.entry]
    ref_entries = ref["completion_probabilities"]
    assert steps.summary.tokens == ref["tokens"]
    worst = 0.0
    for ours, theirs in zip(entries, ref_entries):
        assert (
            ours["id"] == theirs["id"]
            and ours["token"] == theirs["token"]
            and ours["bytes"] == theirs["bytes"]
        )
        assert ours["top_logprobs"][0]["id"] == theirs["top_logprobs"][0]["id"]
        assert len(ours["top_logprobs"]) == len(theirs["top_logprobs"]) == 5
        worst = max(worst, abs(ours["logprob"] - theirs["logprob"]))
    print(f"\ngreedy logprobs: largest |difference| of the drawn token's logprob {worst:.2e}")
    # the logits are ggml's bits, the softmax summed in the order of llama-server's partial sort
    # with glibc's expf and logf (sampler.token_logprobs): the same bits
    assert worst == 0.0
    # a stop string cuts the text before it, with finish "stop", as llama-server does
    stop_word = ref["content"].split()[1] if len(ref["content"].split()) > 1 else ref["content"][:2]
    body = {**body, "stop": [stop_word], "n_probs": 0}
    status, ref_stop = completion(reference_server, body)
    steps = engine.run_steps(engine.parse_request(body, "completion"))
    for _ in steps:
        pass
    assert steps.summary.text == ref_stop["content"]
    assert steps.summary.finish_reason == "stop" and ref_stop["stop_type"] == "word"


def test_max_tokens_zero_matches_llama_server(
    engine: Engine, reference_server: support.LlamaServer
) -> None:
    body = {
        "prompt": "The sky is",
        "n_predict": 0,
        "temperature": 0,
        "cache_prompt": False,
        "return_tokens": True,
    }
    status, ref = completion(reference_server, body)
    steps = engine.run_steps(engine.parse_request(body, "completion"))
    for _ in steps:
        pass
    assert steps.summary.tokens == ref["tokens"]
    assert steps.summary.completion_tokens == ref["timings"]["predicted_n"]


SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "colors": {
                "type": "array",
                "items": {"enum": ["red", "green", "blue"]},
                "minItems": 1,
                "maxItems": 3,
            }
        },
        "required": ["colors"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "score": {"type": "number"}},
        "required": ["ok", "score"],
        "additionalProperties": False,
    },
]


def test_json_schema_answers_are_valid(engine: Engine) -> None:
    valid = 0
    for i, schema in enumerate(SCHEMAS):
        body = {
            "messages": [{"role": "user", "content": "Describe a person as JSON."}],
            "max_tokens": 60,
            "seed": 7 + i,
            "temperature": 0.7,
            "response_format": {"type": "json_schema", "json_schema": {"schema": schema}},
        }
        steps = engine.run_steps(engine.parse_request(body, "chat"))
        for _ in steps:
            pass
        text = steps.summary.text
        assert steps.summary.finish_reason == "stop", text
        # the chat grammar allows a ```json fence around the value; the answer's content is the value
        jsonschema.validate(json.loads(chat_schema_content(text)), schema)
        valid += 1
    print(f"\nJSON-schema answers valid: {valid}/{len(SCHEMAS)}")


GRAMMARS = [
    'root ::= "The answer is " ("yes" | "no") "."',
    'root ::= [0-9]{1,3} ("," [0-9]{1,3}){2}',
    'root ::= item (", " item){0,2}\nitem ::= "apple" | "pear" | "plum"',
]


def test_gbnf_answers_parse_under_their_grammar(engine: Engine) -> None:
    llg = engine.llg_tokenizer()
    parsed = 0
    for i, grammar in enumerate(GRAMMARS):
        body = {
            "prompt": "Answer: ",
            "n_predict": 24,
            "seed": 3 + i,
            "temperature": 0.8,
            "grammar": grammar,
        }
        steps = engine.run_steps(engine.parse_request(body, "completion"))
        for _ in steps:
            pass
        tokens = steps.summary.tokens
        spec = resolve_constraint({"grammar": grammar}, "completion")
        assert steps.summary.finish_reason == "stop", steps.summary.text
        assert validate_text(spec, llg, tokens), steps.summary.text
        parsed += 1
    print(f"\nGBNF answers that parse under their grammar: {parsed}/{len(GRAMMARS)}")


@pytest.mark.parametrize(
    "body",
    [
        {"grammar": "root ::= undefined_rule"},
        {"grammar": 'root ::= "a'},
        {"json_schema": "not a schema"},
    ],
)
def test_invalid_constraints_are_refused_before_compute(engine: Engine, body: dict) -> None:
    before = list(engine.slot_tokens)
    with pytest.raises(RequestError) as err:
        engine.parse_request({"prompt": "Hi", **body}, "completion")
    assert err.value.status == 400 and str(err.value)
    assert engine.slot_tokens == before
