"""Request features of llama-server's /completion and /v1/chat/completions on the native engine,
side by side with the real llama-server (``reference_server``, same model): ``logit_bias`` in all
its forms, ``ignore_eos``, ``n_probs`` with ``post_sampling_probs``, several prompts in one
/completion request, ``return_tokens``, ``response_fields``, ``n_indent``, ``t_max_predict_ms``,
and the schema's refusals (same status and message).

The native side is the shared engine of test_native_serve, on its engine address (the tree
NativeService builds). Text is compared where it is deterministic: greedy, few tokens, or forced by a strong bias;
elsewhere the structure and the first token's candidates.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytest_twisted
from twisted.internet.threads import deferToThread

from bankml.engine_cupy.sampler import (
    Candidates,
    LogitBias,
    Sampler,
    SamplerParams,
    apply_logit_bias,
)
from tests.native_support import apost, post, shared_served, sse_events


@pytest.fixture
def native_url(default_model: Path, default_fork: Path) -> str:
    """The engine address of the shared native service (/completion, /v1/completions, ...)."""
    return shared_served(default_model, default_fork).engine_url


async def both(
    native_url: str, reference: Any, path: str, body: dict
) -> tuple[tuple[int, Any], tuple[int, Any]]:
    ours = await apost(native_url + path, body)
    ref = await apost(reference.url + path, body)
    return ours, ref


def greedy(prompt: Any, n_predict: int = 4, **extra: Any) -> dict[str, Any]:
    return {
        "prompt": prompt,
        "n_predict": n_predict,
        "temperature": 0,
        "cache_prompt": False,
        **extra,
    }


# --- logit_bias and ignore_eos -----------------------------------------------------------------------


def test_biases_are_added_in_turn_in_float32_before_every_stage() -> None:
    """The bias stage alone: a token listed twice gets both, in order, in float32; a ban is -inf;
    it runs before top-k and before mirostat, so a banned maximum is never drawn."""
    logits = np.array([1.0, 5.0, 2.0, 0.5], dtype=np.float32)
    c = Candidates.from_logits(logits)
    apply_logit_bias(c, [LogitBias(0.1, 2), LogitBias(1e-8, 2), LogitBias(-math.inf, 1)])
    assert c.logits[2] == np.float32(np.float32(2.0) + np.float32(0.1)) + np.float32(1e-8)
    assert c.logits[1] == -np.inf and c.logits[0] == 1.0
    ban = (LogitBias(-math.inf, 1),)
    assert Sampler(SamplerParams(temperature=0.0, logit_bias=ban), None, 4).sample(logits) == 2
    drawn = {
        Sampler(
            SamplerParams(mirostat=2, temperature=1.0, seed=seed, logit_bias=ban), None, 4
        ).sample(logits)
        for seed in range(40)
    }
    assert 1 not in drawn and 2 in drawn


@pytest_twisted.ensureDeferred
async def test_logit_bias_list_is_llama_servers_after_parsing(
    native_url: str, reference_server: Any
) -> None:
    """Every form and odd key llama-server reads (ids, text, a bias as a C float, "" as 0, " 7",
    ids out of range, false as a ban, malformed entries skipped), then ignore_eos's EOG bans: the
    same list back."""
    odd = {
        "12": -1,
        "13": 0.1,
        "14": -0.3,
        "hello": False,
        "": 3,
        " 7": 2,
        "x9": 1,
        "-1": 5,
        "99999999": 1,
        "5": True,
        "6": None,
    }
    pairs = [
        [7042, 2.5],
        [8, 0.1],
        [" Paris", False],
        [-3, 1],
        [49152, 1],
        [1.5, 2],
        ["a", "b"],
        [1],
        "bad",
        [3, 1e39],
    ]
    parsed = 0
    for logit_bias in (odd, pairs):
        body = greedy("The capital of France is", 1, logit_bias=logit_bias, ignore_eos=True)
        (status, ours), (ref_status, ref) = await both(
            native_url, reference_server, "/completion", body
        )
        assert status == ref_status == 200
        assert ours["generation_settings"]["logit_bias"] == ref["generation_settings"]["logit_bias"]
        assert (
            ours["generation_settings"]["ignore_eos"]
            is ref["generation_settings"]["ignore_eos"]
            is True
        )
        parsed += len(ref["generation_settings"]["logit_bias"])
    print(
        f"logit_bias: 21 request entries parsed into {parsed} biases, identical to llama-server's"
    )


@pytest.mark.parametrize(
    "logit_bias",
    [
        [[" Paris", False]],  # a text ban: the next choice
        [[" Berlin", 30.0]],  # a text boost strong enough to win every step
        [[28120, 40], [" Paris", False]],  # an id boost and a ban together
        {"28120": 40},  # OpenAI's object form on /completion too
    ],
    ids=["ban-text", "boost-text", "id-and-ban", "object"],
)
@pytest_twisted.ensureDeferred
async def test_logit_bias_steers_completion_like_llama_server(
    native_url: str, reference_server: Any, logit_bias: Any
) -> None:
    body = greedy("The capital of France is", 4, logit_bias=logit_bias, n_probs=2)
    (status, ours), (ref_status, ref) = await both(
        native_url, reference_server, "/completion", body
    )
    assert status == ref_status == 200
    assert ours["content"] == ref["content"], (ours["content"], ref["content"])
    # log-probabilities stay those of the raw logits, as llama-server reports them
    first, ref_first = ours["completion_probabilities"][0], ref["completion_probabilities"][0]
    assert [t["id"] for t in first["top_logprobs"]] == [t["id"] for t in ref_first["top_logprobs"]]


@pytest_twisted.ensureDeferred
async def test_openai_logit_bias_on_chat_is_applied(native_url: str, reference_server: Any) -> None:
    yes = (await apost(native_url + "/tokenize", {"content": " Yes"}))[1]["tokens"]
    body = {
        "messages": [{"role": "user", "content": "Is the sky green?"}],
        "max_tokens": 3,
        "temperature": 0,
        "logit_bias": {str(yes[0]): 100},
    }
    (status, ours), (ref_status, ref) = await both(
        native_url, reference_server, "/v1/chat/completions", body
    )
    assert status == ref_status == 200
    text = ours["choices"][0]["message"]["content"]
    assert text == ref["choices"][0]["message"]["content"] == " Yes Yes Yes"


@pytest_twisted.ensureDeferred
async def test_ignore_eos_generates_past_the_end_token(
    native_url: str, reference_server: Any
) -> None:
    prompt = ["A", 7, "b"]  # greedy: a newline, then the end token
    (_, plain), (_, ref_plain) = await both(
        native_url, reference_server, "/completion", greedy(prompt, 4)
    )
    assert plain["stop_type"] == ref_plain["stop_type"] == "eos" and plain["tokens_predicted"] < 4
    body = greedy(prompt, 4, ignore_eos=True, return_tokens=True)
    (status, ours), (ref_status, ref) = await both(
        native_url, reference_server, "/completion", body
    )
    assert status == ref_status == 200
    assert ours["stop_type"] == ref["stop_type"] == "limit"
    assert ours["tokens_predicted"] == ref["tokens_predicted"] == len(ours["tokens"]) == 4
    assert ours["tokens"][:2] == ref["tokens"][:2]
    eog = {0, 2, 4} & set(ours["tokens"])  # no end-of-generation token was drawn
    assert not eog


# --- n_probs and post_sampling_probs -------------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_post_sampling_probs_greedy_are_llama_servers(
    native_url: str, reference_server: Any
) -> None:
    body = greedy("The capital of France is", 3, n_probs=5, post_sampling_probs=True)
    (_, ours), (_, ref) = await both(native_url, reference_server, "/completion", body)
    assert ours["completion_probabilities"] == ref["completion_probabilities"]
    assert set(ours["completion_probabilities"][0]) == {"id", "token", "bytes", "prob", "top_probs"}


@pytest_twisted.ensureDeferred
async def test_post_sampling_probs_after_the_chain(native_url: str, reference_server: Any) -> None:
    """temperature 0.7, top_k 3: at most 3 candidates survive, their p sum to 1; the first token's
    candidates are llama-server's within the forward pass's difference."""
    body = {
        "prompt": "The capital of France is",
        "n_predict": 2,
        "temperature": 0.7,
        "top_k": 3,
        "seed": 3,
        "n_probs": 10,
        "post_sampling_probs": True,
        "cache_prompt": False,
    }
    (_, ours), (_, ref) = await both(native_url, reference_server, "/completion", body)
    for entries in (ours["completion_probabilities"], ref["completion_probabilities"]):
        for entry in entries:
            assert 1 <= len(entry["top_probs"]) <= 3
            assert abs(sum(t["prob"] for t in entry["top_probs"]) - 1.0) < 1e-5
            assert entry["prob"] == next(
                t["prob"] for t in entry["top_probs"] if t["id"] == entry["id"]
            )
    first, ref_first = ours["completion_probabilities"][0], ref["completion_probabilities"][0]
    assert [t["id"] for t in first["top_probs"]] == [t["id"] for t in ref_first["top_probs"]]
    worst = max(
        abs(a["prob"] - b["prob"]) for a, b in zip(first["top_probs"], ref_first["top_probs"])
    )
    print(f"post-sampling p, first token: largest difference {worst:.4f}")
    assert worst < 0.05


@pytest.mark.parametrize(
    "extra",
    [
        {"n_probs": -3},
        {"n_probs": 2.7},
        {"n_probs": True},
        {"n_probs": 60000},
        {"n_probs": 60000, "post_sampling_probs": True, "top_k": 4},
        {"n_probs": 1, "logprobs": 3},
    ],
    ids=lambda e: json.dumps(e),
)
@pytest_twisted.ensureDeferred
async def test_n_probs_edge_cases(native_url: str, reference_server: Any, extra: dict) -> None:
    body = greedy("Hello", 1, **extra)
    (status, ours), (ref_status, ref) = await both(
        native_url, reference_server, "/completion", body
    )
    assert status == ref_status == 200
    assert ("completion_probabilities" in ours) == ("completion_probabilities" in ref)
    if "completion_probabilities" in ref:
        mine, theirs = ours["completion_probabilities"][0], ref["completion_probabilities"][0]
        key = "top_probs" if extra.get("post_sampling_probs") else "top_logprobs"
        assert len(mine[key]) == len(theirs[key])
        assert mine["id"] == theirs["id"] and mine[key][0]["id"] == theirs[key][0]["id"]


@pytest_twisted.ensureDeferred
async def test_chat_post_sampling_probs(native_url: str, reference_server: Any) -> None:
    body = {
        "messages": [{"role": "user", "content": "Say hi"}],
        "max_tokens": 2,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 3,
        "post_sampling_probs": True,
    }
    (_, ours), (_, ref) = await both(native_url, reference_server, "/v1/chat/completions", body)
    assert ours["choices"][0]["logprobs"] == ref["choices"][0]["logprobs"]


# --- several prompts --------------------------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_one_prompt_answers_one_object(native_url: str, reference_server: Any) -> None:
    """``Completion`` with one prompt answers as NativeChat did: one object, llama-server's keys,
    streamed without [DONE]; ``tokens`` empty unless return_tokens."""
    body = greedy("The capital of France is", 3)
    (_, ours), (_, ref) = await both(native_url, reference_server, "/completion", body)
    assert isinstance(ours, dict) and set(ours) - {"bankml_receipt"} == set(ref)
    assert ours["tokens"] == ref["tokens"] == [] and ours["index"] == 0
    assert set(ours["generation_settings"]) >= set(ref["generation_settings"]) - {
        "chat_format",
        "reasoning_format",
        "reasoning_in_content",
        "generation_prompt",
        "speculative.types",
        "grammar",
        "grammar_lazy",
        "grammar_triggers",
        "preserved_tokens",
    }
    _, _, data = await deferToThread(post, native_url + "/completion", {**body, "stream": True})
    events = sse_events(data)
    assert "[DONE]" not in events and None not in events
    assert all("content" in e and "stop" in e for e in events)  # a receipt is no event of its own
    assert events[-1]["stop"] is True and "bankml_receipt" in events[-1]
    assert not any("bankml_receipt" in e for e in events[:-1])


MULTI = [
    "Hi",
    "The sky is",
    [1, 2, 3],
    ["A", 7, "b"],
    {"prompt_string": "The capital of France is"},
]


@pytest_twisted.ensureDeferred
async def test_several_prompts_answer_an_array(native_url: str, reference_server: Any) -> None:
    body = greedy(MULTI, 2, return_tokens=True)
    (status, ours), (ref_status, ref) = await both(
        native_url, reference_server, "/completion", body
    )
    assert (
        status == ref_status == 200
        and isinstance(ours, list)
        and len(ours) == len(ref) == len(MULTI)
    )
    for mine, theirs in zip(ours, ref):
        for key in (
            "index",
            "content",
            "tokens",
            "prompt",
            "tokens_evaluated",
            "tokens_predicted",
            "stop_type",
        ):
            assert mine[key] == theirs[key], (key, mine[key], theirs[key])
        assert set(mine) - {"bankml_receipt"} == set(theirs)
    print(f"{len(MULTI)} prompts in one request: contents {[r['content'] for r in ours]}")


@pytest_twisted.ensureDeferred
async def test_several_prompts_stream_in_turn(native_url: str, reference_server: Any) -> None:
    body = greedy(["Hi", "The sky is"], 2, stream=True)
    _, ctype, data = await deferToThread(post, native_url + "/completion", body)
    _, _, ref_data = await deferToThread(post, reference_server.url + "/completion", body)
    assert ctype.startswith("text/event-stream")
    ours = sse_events(data)
    ref = sse_events(ref_data)
    # each prompt's receipt rides in its final (stop) event
    assert [e["stop"] for e in ours if e is not None] == [
        "bankml_receipt" in e for e in ours if e is not None
    ]
    assert sum(e is not None and e["stop"] for e in ours) == 2

    def shape(events: list) -> list:
        return [
            None if e is None else (e["index"], e["content"], e["stop"], e["id_slot"])
            for e in events
        ]

    assert shape(ours) == shape(ref)


@pytest_twisted.ensureDeferred
async def test_several_prompts_on_v1_completions_are_choices(
    native_url: str, reference_server: Any
) -> None:
    body = {
        "prompt": ["Hi", "The sky is"],
        "max_tokens": 2,
        "temperature": 0,
        "cache_prompt": False,
    }
    (status, ours), (ref_status, ref) = await both(
        native_url, reference_server, "/v1/completions", body
    )
    assert status == ref_status == 200
    assert ours["choices"] == ref["choices"]
    assert (
        ours["usage"]["prompt_tokens"] == ref["usage"]["prompt_tokens"]
    )  # the first prompt's, as there
    assert len(ours["bankml_receipt"]) == 2
    _, _, data = await deferToThread(post, native_url + "/v1/completions", {**body, "stream": True})
    _, _, ref_data = await deferToThread(
        post, reference_server.url + "/v1/completions", {**body, "stream": True}
    )

    def shape(events: list) -> list:
        return [
            e
            if e in (None, "[DONE]")
            else [(c["index"], c["text"], c["finish_reason"]) for c in e["choices"]]
            for e in events
        ]

    events = sse_events(data)
    assert shape(events) == shape(sse_events(ref_data))
    # each prompt's receipt rides in its chunk with a finish_reason
    chunks = [e for e in events if isinstance(e, dict)]
    assert [c["choices"][0]["finish_reason"] is not None for c in chunks] == [
        "bankml_receipt" in c for c in chunks
    ]


@pytest_twisted.ensureDeferred
async def test_timings_per_token_ride_on_each_streamed_piece(
    native_url: str, reference_server: Any
) -> None:
    body = greedy("Hi", 2, stream=True, timings_per_token=True)
    _, _, data = await deferToThread(post, native_url + "/completion", body)
    _, _, ref_data = await deferToThread(post, reference_server.url + "/completion", body)
    ours = [e for e in sse_events(data) if isinstance(e, dict) and e.get("stop") is False]
    ref = [e for e in sse_events(ref_data) if isinstance(e, dict) and e.get("stop") is False]
    assert len(ours) == len(ref) == 2
    for mine, theirs in zip(ours, ref):
        assert set(theirs["timings"]) >= {"prompt_n", "predicted_n"}
        assert (mine["timings"]["prompt_n"], mine["timings"]["predicted_n"]) == (
            theirs["timings"]["prompt_n"],
            theirs["timings"]["predicted_n"],
        )


@pytest.mark.parametrize(
    "prompt",
    [[], [2.5], [[2.5]], [{"x": 1}], {"no": "prompt_string"}, [None]],
    ids=lambda p: json.dumps(p),
)
@pytest_twisted.ensureDeferred
async def test_bad_prompts_are_refused_like_llama_server(
    native_url: str, reference_server: Any, prompt: Any
) -> None:
    (status, ours), (ref_status, ref) = await both(
        native_url, reference_server, "/completion", greedy(prompt, 1)
    )
    assert status == ref_status == 400
    assert ours["error"]["message"] == ref["error"]["message"]


@pytest_twisted.ensureDeferred
async def test_an_empty_prompt_answers_nothing(native_url: str, reference_server: Any) -> None:
    for prompt in ("", [[]]):
        (status, ours), (ref_status, ref) = await both(
            native_url, reference_server, "/completion", greedy(prompt, 2)
        )
        assert status == ref_status == 200
        for key in ("content", "tokens_predicted", "tokens_evaluated", "stop_type"):
            assert ours[key] == ref[key], key


# --- the other task fields ----------------------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_n_indent_cuts_the_less_indented_line(native_url: str, reference_server: Any) -> None:
    body = greedy("def add(a, b):\n", 24, n_indent=4)
    (_, ours), (_, ref) = await both(native_url, reference_server, "/completion", body)
    assert ours["stop_type"] == ref["stop_type"] == "limit"
    assert (
        ours["content"] == ref["content"]
        and ours["tokens_predicted"] == ref["tokens_predicted"] < 24
    )


@pytest_twisted.ensureDeferred
async def test_t_max_predict_ms_stops_at_a_newline(native_url: str, reference_server: Any) -> None:
    body = greedy("Write a list of fruits:\n", 24, t_max_predict_ms=1)
    (_, ours), (_, ref) = await both(native_url, reference_server, "/completion", body)
    assert ours["stop_type"] == ref["stop_type"] == "limit"
    assert ours["content"].endswith("\n") and ref["content"].endswith("\n")
    assert ours["tokens_predicted"] < 24


@pytest_twisted.ensureDeferred
async def test_response_fields_keep_only_those(native_url: str, reference_server: Any) -> None:
    body = greedy("Hi", 1, response_fields=["content", "generation_settings/n_predict", "nope"])
    (_, ours), (_, ref) = await both(native_url, reference_server, "/completion", body)
    ours.pop("bankml_receipt")
    assert ours == ref == {"content": ref["content"], "generation_settings/n_predict": 1}


@pytest_twisted.ensureDeferred
async def test_generation_settings_have_llama_servers_keys(
    native_url: str, reference_server: Any
) -> None:
    body = greedy("Hi", 1, n_keep=-1, n_discard=3, logit_bias=[[5, 1]], post_sampling_probs=True)
    (_, ours), (_, ref) = await both(native_url, reference_server, "/completion", body)
    mine, theirs = ours["generation_settings"], ref["generation_settings"]
    for key in (
        "n_keep",
        "n_discard",
        "max_tokens",
        "logit_bias",
        "post_sampling_probs",
        "ignore_eos",
        "adaptive_target",
        "adaptive_decay",
        "timings_per_token",
        "lora",
    ):
        assert key in mine, key
        assert json.dumps(mine[key]) == json.dumps(theirs[key]), key


REFUSED = [
    {"n": 2},
    {"n_cmpl": 0},
    {"n_indent": -1},
    {"n_keep": -2},
    {"n_discard": -1},
    {"n_cache_reuse": -1},
    {"t_max_predict_ms": -2},
    {"sse_ping_interval": -5},
    {"ignore_eos": 1},
    {"post_sampling_probs": "yes"},
    {"return_tokens": 3},
    {"timings_per_token": "no"},
    {"stream": 1},
    {"backend_sampling": []},
    {"adaptive_decay": 1},
    {"adaptive_decay": -0.5},
    {"lora": 5},
    {"min_keep": -1},
]


@pytest_twisted.ensureDeferred
async def test_chat_logprobs_with_tools_and_stream_is_refused(
    native_url: str, reference_server: Any
) -> None:
    tool = {
        "type": "function",
        "function": {"name": "f", "parameters": {"type": "object", "properties": {}}},
    }
    body = {
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 1,
        "logprobs": True,
        "stream": True,
        "tools": [tool],
    }
    (status, ours), (ref_status, ref) = await both(
        native_url, reference_server, "/v1/chat/completions", body
    )
    assert status == ref_status == 400
    assert ours["error"]["message"] == ref["error"]["message"]


@pytest.mark.parametrize("extra", REFUSED, ids=lambda e: json.dumps(e))
@pytest_twisted.ensureDeferred
async def test_task_field_refusals_are_llama_servers(
    native_url: str, reference_server: Any, extra: dict
) -> None:
    for path in ("/completion", "/v1/chat/completions"):
        body = {**greedy("Hi", 1), **extra}
        if path != "/completion":
            body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, **extra}
        (status, ours), (ref_status, ref) = await both(native_url, reference_server, path, body)
        assert status == ref_status == 400, (path, ours, ref)
        assert ours["error"]["message"] == ref["error"]["message"], path


ACCEPTED = {
    "n": 1,
    "n_keep": -1,
    "n_discard": 10,
    "n_cache_reuse": 256,
    "sse_ping_interval": 5,
    "lora": [{"id": 0, "scale": 1.0}],
    "backend_sampling": True,
    "verbose": False,
    "timings_per_token": True,
    "return_progress": True,
    "adaptive_target": 0.5,
    "min_keep": 2,
    "samplers": ["top_k", "temperature"],
    "response_fields": 7,
}


@pytest_twisted.ensureDeferred
async def test_accepted_fields_do_not_change_a_greedy_answer(
    native_url: str, reference_server: Any
) -> None:
    """Fields llama-server accepts whose effect a greedy answer does not show here (no context
    shift, no adapters, one slot): accepted together, same answer."""
    (status, ours), (ref_status, ref) = await both(
        native_url,
        reference_server,
        "/completion",
        greedy("The capital of France is", 2, **ACCEPTED),
    )
    assert status == ref_status == 200
    assert ours["content"] == ref["content"] == " Paris."
