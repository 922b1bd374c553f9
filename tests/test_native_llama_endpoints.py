"""llama-server's slot monitor, token counting and request fields, side by side: bankml
``--native`` (the native tests' shared engine) and the real llama-server on the same model, the
same requests, over real HTTP on loopback.

``GET /slots`` (after a completion, after a chat, while a stream runs, ``fail_on_no_slot``),
``POST /chat/completions/input_tokens`` (both paths, its refusals). Values are compared where
both sides compute them (every key but ``id_task``, whose numbering counts llama-server's other
tasks too); while a stream runs only the keys and the running state, the counts move.
"""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import pytest_twisted
from twisted.internet.threads import deferToThread

from tests import support
from tests.events import HANG_GUARD_S
from tests.native_support import (
    Served,
    assert_same_keys,
    both,
    call,
    chat,
    completion,
    key_paths,
    receipt_free,
)


@pytest.fixture(scope="module")
def metrics_reference(default_model: Path, llama_server_bin: Path) -> Iterator[support.LlamaServer]:
    """llama-server with --metrics, as bankml always serves /metrics."""
    with support.LlamaServer(default_model, args=["--metrics"], binary=llama_server_bin) as server:
        yield server


def without_task_id(slots: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in slot.items() if k != "id_task"} for slot in slots]


# --- GET /slots ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path, body",
    [
        ("/completion", completion(n_predict=3)),
        ("/completion", completion(n_predict=2, top_k=5, n_probs=1, stream=True)),
        ("/v1/completions", completion(max_tokens=2, seed=7)),
        ("/v1/chat/completions", chat()),
        ("/v1/chat/completions", chat(stream=True, timings_per_token=True)),
    ],
    ids=lambda v: v if isinstance(v, str) else json.dumps(v)[:50],
)
@pytest_twisted.ensureDeferred
async def test_slots_after_a_task_are_llama_servers(
    served: Served, reference_server: Any, path: str, body: dict
) -> None:
    """The idle slot after the same request: the task's parameters, zeroed counts, the slot's
    tokens (prompt + generated - 1), all as llama-server shows them."""
    await both(served.engine_url, reference_server, "POST", path, body)
    (status, ctype, ours), (ref_status, ref_ctype, ref) = await both(
        served.engine_url, reference_server, "GET", "/slots"
    )
    assert status == ref_status == 200 and ctype == ref_ctype
    assert_same_keys(ours, ref)
    assert without_task_id(ours) == without_task_id(ref)
    assert ours[0]["is_processing"] is False and ours[0]["n_prompt_tokens"] > 0


@pytest_twisted.ensureDeferred
async def test_slots_count_their_tasks(served: Served) -> None:
    _, _, before = await deferToThread(call, served.engine_url, "GET", "/slots")
    await deferToThread(call, served.engine_url, "POST", "/completion", completion())
    _, _, after = await deferToThread(call, served.engine_url, "GET", "/slots")
    assert after[0]["id_task"] > before[0].get("id_task", -1)


def open_stream(url: str, body: dict[str, Any]) -> tuple[http.client.HTTPConnection, Any]:
    """A streamed /completion whose first event has been read (the slot is running); blocking."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=HANG_GUARD_S)
    conn.request("POST", "/completion", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    while not resp.readline().startswith(b"data: "):
        pass
    return conn, resp


async def slots_while_streaming(url: str) -> tuple[Any, Any]:
    """(GET /slots, GET /slots?fail_on_no_slot=1) while a long stream runs on the one slot."""
    body = completion(
        "Write a long story about a dog.", n_predict=400, ignore_eos=True, stream=True
    )
    conn, _ = await deferToThread(open_stream, url, body)
    try:
        seen = await deferToThread(call, url, "GET", "/slots")
        refused = await deferToThread(call, url, "GET", "/slots?fail_on_no_slot=1")
    finally:
        await deferToThread(conn.close)
    return seen, refused


@pytest_twisted.ensureDeferred
async def test_slots_while_a_stream_runs_are_llama_servers(
    served: Served, reference_server: Any
) -> None:
    (status, _, ours), ours_refused = await slots_while_streaming(served.engine_url)
    (ref_status, _, ref), ref_refused = await slots_while_streaming(reference_server.url)
    assert status == ref_status == 200
    assert_same_keys(ours, ref)
    assert ours[0]["is_processing"] is ref[0]["is_processing"] is True
    assert ours[0]["next_token"][0]["has_next_token"] is True
    assert ours[0]["params"] == ref[0]["params"] and ours[0]["params"]["stream"] is True
    assert 0 < ours[0]["next_token"][0]["n_decoded"] <= 400
    assert ours[0]["next_token"][0]["n_remain"] == 400 - ours[0]["next_token"][0]["n_decoded"]
    assert ours_refused == ref_refused  # 503 "no slot available"
    assert ours_refused[0] == 503 and ours_refused[2]["error"]["type"] == "unavailable_error"


@pytest_twisted.ensureDeferred
async def test_fail_on_no_slot_on_an_idle_slot_answers_the_slots(
    served: Served, reference_server: Any
) -> None:
    await both(served.engine_url, reference_server, "POST", "/completion", completion())
    (status, _, ours), (ref_status, _, ref) = await both(
        served.engine_url, reference_server, "GET", "/slots?fail_on_no_slot=1"
    )
    assert status == ref_status == 200 and without_task_id(ours) == without_task_id(ref)


# --- POST /chat/completions/input_tokens -----------------------------------------------------------


INPUT_TOKEN_BODIES = [
    {"messages": [{"role": "user", "content": "Hi"}]},
    {"messages": [{"role": "user", "content": "Hi"}], "temperature": "x", "n": 3, "max_tokens": -5},
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]},
    {
        "messages": [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hel"},
        ]
    },
    {"messages": [{"role": "user", "content": "Hi"}], "add_generation_prompt": False},
    {"messages": [{"role": "user", "content": "word " * 3000}]},  # no context check: a count
    {"messages": "x"},
    {},
    {"messages": [{"content": "x"}]},
    {"messages": [{"role": "user"}]},
    {"messages": [{"role": "user", "content": "Hi"}], "top_logprobs": 2},
]


@pytest.mark.parametrize(
    "path", ["/v1/chat/completions/input_tokens", "/chat/completions/input_tokens"]
)
@pytest.mark.parametrize("body", INPUT_TOKEN_BODIES, ids=lambda v: json.dumps(v)[:60])
@pytest_twisted.ensureDeferred
async def test_input_tokens_are_llama_servers(
    served: Served, reference_server: Any, path: str, body: dict
) -> None:
    ours, ref = await both(served.engine_url, reference_server, "POST", path, body)
    if ref[0] == 500:  # llama-server's own parse failure; the client's input to bankml: 400
        assert ours[0] == 400 and ours[2]["error"]["message"] == ref[2]["error"]["message"]
    else:
        assert ours == ref


@pytest_twisted.ensureDeferred
async def test_input_tokens_count_what_the_chat_evaluates(served: Served) -> None:
    body = chat("Count me.")
    _, _, counted = await deferToThread(
        call, served.url, "POST", "/v1/chat/completions/input_tokens", body
    )
    _, _, answered = await deferToThread(call, served.url, "POST", "/v1/chat/completions", body)
    assert counted["input_tokens"] == answered["usage"]["prompt_tokens"] > 0


@pytest.mark.parametrize(
    "method, path, raw",
    [
        ("GET", "/v1/chat/completions/input_tokens", None),
        ("POST", "/v1/chat/completions/input_tokens/x", b"{}"),
        ("POST", "/v1/chat/completions/input_tokens", b"[1]"),
        ("POST", "/v1/chat/completions/", b"{}"),
    ],
)
@pytest_twisted.ensureDeferred
async def test_input_tokens_routes_as_llama_server(
    served: Served, reference_server: Any, method: str, path: str, raw: bytes | None
) -> None:
    (status, _, ours), (ref_status, _, ref) = await both(
        served.engine_url, reference_server, method, path, raw=raw
    )
    if raw == b"[1]":  # llama-server reads an array as a body without messages; bankml refuses it
        assert (status, ref_status) == (400, 400)
        assert ref["error"]["message"] == "'messages' is required"
        assert ours["error"]["message"] == "the request body must be a JSON object"
    else:
        assert (status, ours) == (ref_status, ref) == (404, ref)


# --- return_progress and timings_per_token ---------------------------------------------------------


def timings_are_llama_servers_numbers(events: list[Any]) -> None:
    """Every timings object: numbers, never null, with llama-server's per-token formulas (0.0
    until the divisor is known; generation over its decode steps, the first token free)."""
    for event in events:
        t = event.get("timings") if isinstance(event, dict) else None
        if t is None:
            continue
        assert all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in t.values()), t
        steps = t["predicted_n"] - 1
        assert t["predicted_per_token_ms"] == (t["predicted_ms"] / steps if steps > 0 else 0.0)
        assert t["prompt_per_token_ms"] == (
            t["prompt_ms"] / t["prompt_n"] if t["prompt_n"] > 0 else 0.0
        )


def progress_of(events: list[Any]) -> list[Any]:
    return [
        {k: v for k, v in e["prompt_progress"].items() if k != "time_ms"}
        for e in events
        if isinstance(e, dict) and "prompt_progress" in e
    ]


STREAMED = [
    ("/completion", completion(stream=True, cache_prompt=False)),
    ("/completion", completion(stream=True, n_probs=2, cache_prompt=False)),
    ("/v1/completions", completion(stream=True, cache_prompt=False)),
    ("/v1/chat/completions", chat(stream=True, cache_prompt=False)),
    ("/v1/chat/completions", chat(stream=True, logprobs=True, top_logprobs=1, cache_prompt=False)),
]


@pytest.mark.parametrize(
    "fields",
    [
        {"return_progress": True},
        {"timings_per_token": True},
        {"return_progress": True, "timings_per_token": True},
    ],
    ids=json.dumps,
)
@pytest.mark.parametrize(
    "path, body", STREAMED, ids=lambda v: v if isinstance(v, str) else json.dumps(v)[:50]
)
@pytest_twisted.ensureDeferred
async def test_progress_and_per_token_timings_stream_as_llama_server(
    served: Served, reference_server: Any, path: str, body: dict, fields: dict
) -> None:
    body = (
        {**body, **fields, "stream_options": {"include_usage": True}}
        if "chat" in path
        else {**body, **fields}
    )
    (status, _, ours), (ref_status, _, ref) = await both(
        served.engine_url, reference_server, "POST", path, body
    )
    assert status == ref_status == 200
    ours = receipt_free(ours)
    assert [sorted(key_paths(e)) if isinstance(e, dict) else e for e in ours] == [
        sorted(key_paths(e)) if isinstance(e, dict) else e for e in ref
    ]
    assert progress_of(ours) == progress_of(ref)  # total, cache, processed: the same
    assert bool(progress_of(ours)) is bool(fields.get("return_progress"))
    timings_are_llama_servers_numbers(ours)
    timings_are_llama_servers_numbers(ref)


@pytest_twisted.ensureDeferred
async def test_progress_counts_the_cached_prefix_as_llama_server(
    served: Served, reference_server: Any
) -> None:
    """The same prompt twice: the second run's progress starts at the cached prefix (all of it
    but the last token), on both."""
    body = completion("Progress, twice over.", stream=True, return_progress=True)
    await both(served.engine_url, reference_server, "POST", "/completion", body)
    (_, _, ours), (_, _, ref) = await both(
        served.engine_url, reference_server, "POST", "/completion", body
    )
    assert progress_of(ours) == progress_of(ref)
    total = progress_of(ours)[0]["total"]
    assert progress_of(ours) == [
        {"total": total, "cache": total - 1, "processed": total - 1},
        {"total": total, "cache": total - 1, "processed": total},
    ]


@pytest_twisted.ensureDeferred
async def test_progress_of_several_prompts_is_llama_servers(
    served: Served, reference_server: Any
) -> None:
    body = {
        "prompt": ["One", "Two words"],
        "n_predict": 2,
        "temperature": 0,
        "stream": True,
        "return_progress": True,
        "cache_prompt": False,
    }
    (_, _, ours), (_, _, ref) = await both(
        served.engine_url, reference_server, "POST", "/completion", body
    )
    ours = [e for e in ours if not (isinstance(e, dict) and e.get("stop"))]
    ref = [e for e in ref if not (isinstance(e, dict) and e.get("stop"))]
    assert [sorted(key_paths(e)) if isinstance(e, dict) else e for e in ours] == [
        sorted(key_paths(e)) if isinstance(e, dict) else e for e in ref
    ]
    assert progress_of(ours) == progress_of(ref)


@pytest.mark.parametrize(
    "path, body",
    [
        ("/completion", completion(timings_per_token=True, return_progress=True)),
        ("/v1/chat/completions", chat(timings_per_token=True, return_progress=True)),
        ("/v1/completions", completion(timings_per_token=True)),
    ],
)
@pytest_twisted.ensureDeferred
async def test_whole_answers_with_these_fields_are_llama_servers(
    served: Served, reference_server: Any, path: str, body: dict
) -> None:
    """Not streamed: no progress, one timings object with numbers only."""
    (status, _, ours), (ref_status, _, ref) = await both(
        served.engine_url, reference_server, "POST", path, body
    )
    assert status == ref_status == 200
    assert_same_keys(ours, ref)
    timings_are_llama_servers_numbers([ours, ref])


# --- continue_final_message ------------------------------------------------------------------------


USER = {"role": "user", "content": "Hi"}
PARTIAL = {"role": "assistant", "content": "Hel"}
NO_GEN = {"add_generation_prompt": False}
CONTINUATIONS = [
    {"messages": [USER, PARTIAL], "continue_final_message": True},
    {"messages": [USER, PARTIAL], "continue_final_message": True, **NO_GEN},
    {"messages": [USER], "continue_final_message": True, **NO_GEN},
    {"messages": [USER, PARTIAL], "continue_final_message": "content", **NO_GEN},
    {"messages": [USER, PARTIAL], "continue_final_message": "reasoning_content", **NO_GEN},
    {"messages": [USER, PARTIAL], "continue_final_message": False},
    {"messages": [USER, PARTIAL], "continue_final_message": "x"},
    {"messages": [USER, PARTIAL], "continue_final_message": 5},
    {"messages": [USER, PARTIAL, PARTIAL], "continue_final_message": True, **NO_GEN},
    {"messages": [USER, PARTIAL, PARTIAL]},
    {"messages": [], "continue_final_message": True, **NO_GEN},
    {
        "messages": [USER, {"role": "assistant", "content": "", "reasoning_content": "think"}],
        "continue_final_message": True,
        **NO_GEN,
    },
    {
        "messages": [
            USER,
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{}"}}],
            },
        ],
        "continue_final_message": True,
        **NO_GEN,
    },
    {"messages": [USER, PARTIAL], "add_generation_prompt": "x", "continue_final_message": True},
    {"messages": [USER], "add_generation_prompt": 0},
]


@pytest.mark.parametrize("body", CONTINUATIONS, ids=lambda v: json.dumps(v)[:70])
@pytest_twisted.ensureDeferred
async def test_continue_final_message_templates_as_llama_server(
    served: Served, reference_server: Any, body: dict
) -> None:
    ours, ref = await both(served.engine_url, reference_server, "POST", "/apply-template", body)
    assert ours == ref
    counted = await both(
        served.engine_url, reference_server, "POST", "/v1/chat/completions/input_tokens", body
    )
    assert counted[0] == counted[1]


def streamed_contents(events: list[Any]) -> list[str]:
    return [
        e["choices"][0]["delta"]["content"]
        for e in events
        if isinstance(e, dict) and e.get("choices") and e["choices"][0]["delta"].get("content")
    ]


CONTINUED_CHATS = [
    {"messages": [USER, PARTIAL]},  # a prefill: llama-server continues a trailing assistant
    *CONTINUATIONS[1:4],
    {**CONTINUATIONS[1], "echo": True},
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("body", CONTINUED_CHATS, ids=lambda v: json.dumps(v)[:70])
@pytest_twisted.ensureDeferred
async def test_a_continued_chat_answers_as_llama_server(
    served: Served, reference_server: Any, body: dict, stream: bool
) -> None:
    """The continued content starts the answer's (the whole answer, or a stream's first piece
    unless ``continue_final_message`` came without ``echo``), and the greedy text is the same."""
    request = {**body, "max_tokens": 3, "temperature": 0, "stream": stream}
    (status, _, ours), (ref_status, _, ref) = await both(
        served.engine_url, reference_server, "POST", "/v1/chat/completions", request
    )
    assert status == ref_status == 200
    if stream:
        assert streamed_contents(receipt_free(ours)) == streamed_contents(ref)
    else:
        assert ours["usage"]["prompt_tokens"] == ref["usage"]["prompt_tokens"]
        assert ours["choices"][0]["message"] == ref["choices"][0]["message"]


# --- /metrics after the same requests --------------------------------------------------------------


def metric_values(text: str) -> dict[str, float]:
    return {
        line.split()[0].removeprefix("llamacpp:"): float(line.split()[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }


METRICS_REQUESTS = [
    ("/completion", completion("Metrics one", n_predict=4, cache_prompt=False)),
    ("/v1/chat/completions", chat("Metrics two", max_tokens=3, cache_prompt=False)),
    ("/completion", completion("Metrics three", n_predict=1, cache_prompt=False)),
]


async def metrics_delta(url: str) -> tuple[dict[str, float], dict[str, float]]:
    """(/metrics' counters' growth over METRICS_REQUESTS, the gauges read just after them)."""
    _, _, before = await deferToThread(call, url, "GET", "/metrics")
    for path, body in METRICS_REQUESTS:
        await deferToThread(call, url, "POST", path, body)
    _, _, after = await deferToThread(call, url, "GET", "/metrics")
    b, a = metric_values(before), metric_values(after)
    return {k: a[k] - b[k] for k in a if k.endswith("_total")}, a


@pytest_twisted.ensureDeferred
async def test_metrics_count_as_llama_server_after_the_same_requests(
    served: Served, metrics_reference: Any
) -> None:
    ours, our_gauges = await metrics_delta(served.engine_url)
    ref, ref_gauges = await metrics_delta(metrics_reference.url)
    for name in (
        "prompt_tokens_total",
        "prompt_tokens_cached_total",
        "tokens_predicted_total",
        "n_decode_total",
        "spec_decode_num_draft_tokens_total",
    ):
        assert ours[name] == ref[name], name
    for name in ("prompt_seconds_total", "tokens_predicted_seconds_total"):
        assert ours[name] > 0 and ref[name] > 0, name
    for name in ("prompt_tokens_seconds", "predicted_tokens_seconds"):  # since the last scrape
        assert our_gauges[name] > 0 and ref_gauges[name] > 0, name
    assert our_gauges["n_busy_slots_per_decode"] == ref_gauges["n_busy_slots_per_decode"] == 1
    assert our_gauges["n_tokens_max"] >= 1 and ref_gauges["n_tokens_max"] >= 1


@pytest_twisted.ensureDeferred
async def test_metrics_gauges_start_again_at_each_scrape(
    served: Served, metrics_reference: Any
) -> None:
    """Two scrapes with nothing between: the throughput gauges read 0, as llama-server's."""
    for url in (served.engine_url, metrics_reference.url):
        await deferToThread(call, url, "GET", "/metrics")
        _, _, text = await deferToThread(call, url, "GET", "/metrics")
        values = metric_values(text)
        assert values["prompt_tokens_seconds"] == values["predicted_tokens_seconds"] == 0, url


# --- verbose: __verbose on the OpenAI answers ------------------------------------------------------


def verbose_objects(answer: Any) -> list[dict[str, Any]]:
    events = answer if isinstance(answer, list) else [answer]
    return [e["__verbose"] for e in events if isinstance(e, dict) and "__verbose" in e]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/chat/completions", chat(verbose=True, cache_prompt=False)),
        ("/v1/chat/completions", chat(verbose=True, logprobs=True, top_logprobs=1)),
        ("/v1/completions", completion(verbose=True, cache_prompt=False)),
        ("/v1/completions", completion(verbose=True, return_progress=True, cache_prompt=False)),
    ],
    ids=lambda v: v if isinstance(v, str) else json.dumps(v)[:50],
)
@pytest_twisted.ensureDeferred
async def test_verbose_adds_llama_servers_object(
    served: Served, reference_server: Any, path: str, body: dict, stream: bool
) -> None:
    """``verbose: true`` (a request field in llama-server 11434, no --verbose needed): the
    task's /completion-shaped object as ``__verbose``, on the same events with the same keys;
    its settings, prompt and counts the same."""
    (status, _, ours), (ref_status, _, ref) = await both(
        served.engine_url, reference_server, "POST", path, {**body, "stream": stream}
    )
    assert status == ref_status == 200
    if stream:
        ours = receipt_free(ours)
        assert [i for i, e in enumerate(ours) if "__verbose" in e] == [
            i for i, e in enumerate(ref) if isinstance(e, dict) and "__verbose" in e
        ]
    mine, theirs = verbose_objects(ours), verbose_objects(ref)
    assert len(mine) == len(theirs) > 0
    for a, b in zip(mine, theirs):
        assert_same_keys(a, b)
        for key in ("generation_settings", "prompt", "tokens_evaluated", "stop_type", "index"):
            assert a.get(key) == b.get(key), key
