"""Several slots (``--parallel``): every answer bit-identical to the same request alone.

Engine level (the real default model, no HTTP): llama-server's slot choice, and the scheduler
interleaving runs of every kind step by step against each run alone on a one-slot engine.

Server level (real HTTP on loopback, as test_native_serve.py): a ``--parallel 4 -kvu`` server
(each slot the whole 2048-token context, the size of the one-slot server's cache, so the
attention sees the same padded lengths) answers eight concurrent requests of different kinds,
each compared byte for byte with the same request alone on the native tests' one-slot server
(and the greedy ones with llama-server ``-np 1``). Requests send ``cache_prompt: false``: each
prefill starts from an empty slot, so an answer cannot depend on what ran in its slot before
(that is the prompt cache's business, tested in test_prompt_cache.py), only on what runs beside
it. A client leaving, a client that stops reading (its producer paused, as Twisted pauses it
when the transport is full), slot files per id and the queue's bound are asserted from the
scheduler's and the runs' counters, never from timings.
"""

from __future__ import annotations

import http.client
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import pytest_twisted
from twisted.internet.defer import Deferred, DeferredList
from twisted.internet.threads import deferToThread

from bankml.engine_cupy.engine import Engine
from bankml.engine_cupy.passes import passes_of
from bankml.native.run import prompt_steps
from bankml.native.scheduler import RunJob, Scheduler
from bankml.serving.run_control import RunControl
from tests.events import HANG_GUARD_S, until
from tests.native_support import (
    N_SLOTS,
    HeadlessControl,
    Served,
    apost,
    get,
    post,
    recorded,
    run_alone,
    sse_events,
    stream_then_leave,
    wait_for,
)

LONG_PROMPT = " ".join(f"item {i}," for i in range(300))  # ~900 tokens: two prefill batches

# --- engine level ------------------------------------------------------------------------------


def test_the_slot_is_chosen_as_llama_servers_get_available_slot(
    engines: tuple[Engine, Engine],
) -> None:
    _, four = engines
    for slot in four.slots:
        slot.tokens, slot.t_last_used, slot.processing = [], -1, False
    prompt = list(range(100, 140))
    # every slot empty and never used: the least recently used, the last of equals (its <=)
    assert four.choose_slot(prompt) == (four.slots[3], True)
    four.slots[1].tokens = prompt[:30] + [1, 2, 3]  # 30/40 of the prompt
    four.slots[2].tokens = prompt[:20]  # 20/40
    four.slots[0].tokens = prompt[:3]  # 3/40: not above the 0.1 similarity
    assert four.choose_slot(prompt) == (four.slots[1], False)  # keeps 30 of its 33 tokens
    four.slots[1].processing = True  # busy: the next best
    assert four.choose_slot(prompt) == (four.slots[2], False)
    four.slots[2].tokens = prompt[:20] + list(range(40))  # would keep 20 of 60: cache it first
    assert four.choose_slot(prompt) == (four.slots[2], True)
    four.slot_prompt_similarity = 0.0  # -sps 0: by use only
    four.slots[3].t_last_used = 5
    four.slots[0].t_last_used = 7
    four.slots[2].t_last_used = 9
    assert four.choose_slot(prompt) == (four.slots[3], True)
    four.slot_prompt_similarity = 0.1
    for slot in four.slots:
        slot.processing = True
    with pytest.raises(RuntimeError):
        four.choose_slot(prompt)
    for slot in four.slots:
        slot.tokens, slot.t_last_used, slot.processing = [], -1, False
        slot.cache.truncate(0)


ENGINE_REQUESTS: list[tuple[str, dict[str, Any]]] = [
    ("completion", {"prompt": "The capital of France is", "n_predict": 12, "n_probs": 2}),
    (
        "completion",
        {
            "prompt": "Once upon a time",
            "n_predict": 16,
            "temperature": 0.8,
            "seed": 7,
            "repeat_penalty": 1.3,
            "n_probs": 1,
        },
    ),
    ("chat", {"messages": [{"role": "user", "content": "Count to five."}], "max_tokens": 14}),
    ("completion", {"prompt": "def fib(n):", "n_predict": 30, "stop": ["return"]}),
    ("completion", {"prompt": LONG_PROMPT, "n_predict": 5}),
]


def _scheduled(four: Engine, requests: list[tuple[str, dict[str, Any]]], controls: list) -> Any:
    """Every request run through a Scheduler on the four-slot engine, all submitted at once;
    returns (scheduler, the items each run delivered, the outcomes by index)."""
    outcomes: dict[int, Any] = {}
    got: dict[int, list[Any]] = {i: [] for i in range(len(requests))}
    scheduler = Scheduler(None, "test-engine", N_SLOTS, outcomes.__setitem__)
    for i, (kind, body) in enumerate(requests):
        request = four.parse_request({"temperature": 0, **body}, kind)

        def deliver(item: Any, control: RunControl, i: int = i) -> None:
            if control.take_room():
                got[i].append(item)
                control.delivered()

        scheduler.submit_run(RunJob(prompt_steps(four, [request]), deliver, controls[i], i))
    return scheduler, got, outcomes


def test_interleaved_runs_are_bit_identical_to_each_run_alone(
    engines: tuple[Engine, Engine],
) -> None:
    one, four = engines
    alone = [run_alone(one, kind, body) for kind, body in ENGINE_REQUESTS]
    controls = [HeadlessControl() for _ in ENGINE_REQUESTS]
    scheduler, got, outcomes = _scheduled(four, ENGINE_REQUESTS, controls)
    try:
        wait_for(lambda: len(outcomes) == len(ENGINE_REQUESTS), "every run to end")
    finally:
        scheduler.stop(HANG_GUARD_S)
    assert [recorded(got[i]) for i in range(len(ENGINE_REQUESTS))] == alone
    stats = scheduler.stats
    assert stats.max_active == N_SLOTS  # the fifth waited for a slot
    # the decode steps of several slots went out together, each slot once per step
    assert stats.decode_rows > stats.decode_calls > 0
    # the four prompts went through the layers together (every product read its weights once)
    assert stats.shared_prompts > 0 and stats.passes < stats.decode_rows + stats.prefill_batches
    assert len({s.summary.slot for i in got for s in got[i] if s.summary is not None}) == N_SLOTS
    assert all(not slot.processing for slot in four.slots)


class _BatchingModel:
    """The real model with a ``forward_batch`` made of its own forward passes (the contract the
    shared pass keeps: each sequence the bits of its own ``forward``), recording each call's
    micro-batch sizes."""

    def __init__(self, model: Any) -> None:
        self._model = model
        self.batches: list[list[int]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def forward_batch(self, tokens: list[list[int]], caches: list[Any]) -> list[Any]:
        self.batches.append([len(t) for t in tokens])
        return [self._model.forward(t, c) for t, c in zip(tokens, caches)]


def test_the_forward_passes_of_one_iteration_go_to_forward_batch_in_one_call(
    engines: tuple[Engine, Engine],
) -> None:
    one, _ = engines
    model = _BatchingModel(one.model)
    four = Engine(model, one.tokenizer, one.template, one.n_ctx, n_slots=N_SLOTS)
    requests = ENGINE_REQUESTS[:3]
    alone = [run_alone(one, kind, body) for kind, body in requests]
    controls = [HeadlessControl() for _ in requests]
    scheduler, got, outcomes = _scheduled(four, requests, controls)
    try:
        wait_for(lambda: len(outcomes) == len(requests), "every run to end")
    finally:
        scheduler.stop(HANG_GUARD_S)
    assert [recorded(got[i]) for i in range(len(requests))] == alone
    # every pass with several slots' steps was one forward_batch call of them all: the three
    # prompts together first, then the decode steps
    decodes = [sum(n == 1 for n in sizes) for sizes in model.batches]
    assert len(model.batches[0]) == 3 and min(model.batches[0]) > 1
    assert sum(d > 1 for d in decodes) == scheduler.stats.shared_decodes > 0
    assert sum(decodes) <= scheduler.stats.decode_rows
    assert max(decodes) == len(requests)


def test_a_paused_run_sits_out_and_a_cancelled_one_stops_within_one_token(
    engines: tuple[Engine, Engine],
) -> None:
    _, four = engines
    body = {"prompt": "Write a long story:", "n_predict": 60, "ignore_eos": True}
    requests = [("completion", dict(body, prompt=f"Story {i}:")) for i in range(3)]
    controls = [HeadlessControl(window=4) for _ in requests]
    controls[0].pauseProducing()  # its client's transport is full before the first token
    scheduler, got, outcomes = _scheduled(four, requests, controls)
    try:
        wait_for(lambda: controls[2].steps >= 10, "the third run's first tokens")
        controls[2].cancel()
        wait_for(lambda: 1 in outcomes and 2 in outcomes, "the second and the cancelled run to end")
        paused_steps = controls[0].steps
        assert controls[0].skipped > 0 and paused_steps == 0  # it never went on
        assert recorded(got[1])[-1][3] == 60  # the other went on to its 60 tokens meanwhile
        assert controls[2].steps - controls[2].steps_at_cancel <= 1
        assert outcomes[2] is None and 0 not in outcomes
        controls[0].resumeProducing()
        wait_for(lambda: 0 in outcomes, "the paused run, resumed, to end")
    finally:
        scheduler.stop(HANG_GUARD_S)
    assert recorded(got[0])[-1][3] == 60
    # nothing of the cancelled run was delivered after the cancel, its summary neither
    assert len(got[2]) <= controls[2].steps_at_cancel
    assert all(s.summary is None for s in got[2])


# --- over HTTP ---------------------------------------------------------------------------------


def _chat(content: str, **extra: Any) -> dict[str, Any]:
    return {
        "messages": [{"role": "user", "content": content}],
        "temperature": 0,
        "max_tokens": 24,
        "cache_prompt": False,
        **extra,
    }


def _completion(prompt: str, **extra: Any) -> dict[str, Any]:
    return {"prompt": prompt, "n_predict": 24, "temperature": 0, "cache_prompt": False, **extra}


SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}

# (path, body, greedy: also compared with llama-server -np 1)
EIGHT: list[tuple[str, dict[str, Any], bool]] = [
    ("/v1/chat/completions", _chat("Name three colours."), True),
    (
        "/v1/chat/completions",
        _chat(
            "Tell me about cats.",
            temperature=0.9,
            seed=1234,
            repeat_penalty=1.2,
            presence_penalty=0.4,
            frequency_penalty=0.3,
        ),
        False,
    ),
    (
        "/v1/chat/completions",
        _chat(
            "Invent a person.",
            max_tokens=40,
            response_format={"type": "json_schema", "json_schema": {"schema": SCHEMA}},
        ),
        False,
    ),
    ("/v1/chat/completions", _chat("What is 2+2?", logprobs=True, top_logprobs=3), False),
    ("/completion", _completion(LONG_PROMPT, n_predict=8), True),  # sent mid-run
    ("/completion", _completion("The alphabet: a, b, c,", n_predict=40, stop=[" h"]), False),
    ("/completion", _completion("Paris is the capital of", n_probs=3), False),
    ("/v1/completions", _completion("Water boils at", max_tokens=16), True),
]
LONG_INDEX = 4


def _stable(answer: Any) -> Any:
    """An answer without what differs between any two answers (its id, creation time, timings,
    the slot that ran it, the receipt's times and signature): the text, tokens, logprobs,
    usage, and the receipt's hashes of the request and the response stay."""
    if not isinstance(answer, dict):
        return answer
    out = {k: v for k, v in answer.items() if k not in ("id", "created", "timings", "id_slot")}
    receipt = out.pop("bankml_receipt", None)
    if receipt is not None:
        out["receipt"] = {
            k: receipt.get(k) for k in ("request_sha256", "response_sha256", "model_sha256")
        }
    return out


@pytest_twisted.ensureDeferred
async def test_eight_concurrent_requests_answer_as_each_alone(
    parallel: Served, alone_server: Served
) -> None:
    alone = [_stable((await apost(alone_server.url + p, b))[1]) for p, b, _ in EIGHT]
    assert all("receipt" in a for a in alone), alone
    scheduler = parallel.native.bridge.scheduler
    decode_rows_before, mixed_before = scheduler.stats.decode_rows, scheduler.stats.mixed_passes
    first = [
        Deferred.fromCoroutine(apost(parallel.url + p, b))
        for i, (p, b, _) in enumerate(EIGHT)
        if i != LONG_INDEX
    ]
    # the long prompt arrives while the others are generating
    await until(lambda: scheduler.stats.decode_rows > decode_rows_before + 8, "the runs to decode")
    long_path, long_body, _ = EIGHT[LONG_INDEX]
    late = Deferred.fromCoroutine(apost(parallel.url + long_path, long_body))
    results = await DeferredList([*first, late], consumeErrors=True)
    answers = [r if ok else (0, repr(r)) for ok, r in results]
    answers.insert(LONG_INDEX, answers.pop())  # back in EIGHT's order
    for (path, _, _), got, want in zip(EIGHT, answers, alone):
        assert got[0] == 200, (path, got)
        assert _stable(got[1]) == want, path
    assert scheduler.stats.max_active == N_SLOTS
    # a queued request's prompt went through the layers with the other slots' decode steps
    assert scheduler.stats.mixed_passes > mixed_before
    assert len({json.dumps(a, sort_keys=True) for a in alone}) == len(alone)


@pytest_twisted.ensureDeferred
async def test_greedy_answers_equal_llama_server_with_one_slot(
    parallel: Served, reference_server: Any
) -> None:
    greedy = [(p, b) for p, b, g in EIGHT if g]
    together = await DeferredList(
        [Deferred.fromCoroutine(apost(parallel.url + p, b)) for p, b in greedy],
        consumeErrors=True,
    )
    for (path, body), (ok, (status, got)) in zip(greedy, together):
        _, ref = await apost(reference_server.url + path, body)
        assert ok and status == 200
        if path == "/v1/chat/completions":
            assert (
                got["choices"][0]["message"]["content"] == ref["choices"][0]["message"]["content"]
            )
        elif path == "/v1/completions":
            assert got["choices"][0]["text"] == ref["choices"][0]["text"]
        else:
            assert got["content"] == ref["content"] and got["tokens_predicted"] > 0


@pytest_twisted.ensureDeferred
async def test_a_client_leaving_stops_its_slot_within_one_token_the_others_go_on(
    parallel: Served,
) -> None:
    bridge = parallel.native.bridge
    earlier = {id(c) for c in bridge.scheduler.stats.runs}  # the runs of earlier tests
    others = [
        Deferred.fromCoroutine(
            apost(
                parallel.url + "/completion",
                _completion(f"Story {i}:", n_predict=48, ignore_eos=True),
            )
        )
        for i in range(3)
    ]
    body = _chat("Write a long story about a lighthouse.", stream=True, max_tokens=400)
    seen = await deferToThread(stream_then_leave, parallel.url, body)
    assert b'"content":"' in seen
    results = await DeferredList(others, consumeErrors=True)
    assert all(ok and r[0] == 200 and r[1]["tokens_predicted"] == 48 for ok, r in results)
    await until(lambda: bridge.processing == 0, "the slots to be free")
    runs = [c for c in bridge.scheduler.stats.runs if id(c) not in earlier]
    left = [c for c in runs if c.steps_at_cancel is not None]
    assert len(left) == 1
    control = left[0]
    assert control.steps - control.steps_at_cancel <= 1, (control.steps, control.steps_at_cancel)
    assert control.steps < 100


@pytest_twisted.ensureDeferred
async def test_a_client_that_stops_reading_does_not_hold_the_others(parallel: Served) -> None:
    bridge = parallel.native.bridge
    body = _chat("Write a long story about a river.", stream=True, max_tokens=64, ignore_eos=True)
    slow = Deferred.fromCoroutine(apost_stream(parallel.url + "/v1/chat/completions", body))
    await until(lambda: bridge.processing == 1 and bridge.last_run is not None, "the stream")
    control = bridge.last_run
    control.pauseProducing()  # what Twisted calls when the client's transport is full
    steps_at_pause = control.steps
    others = await DeferredList(
        [
            Deferred.fromCoroutine(
                apost(
                    parallel.url + "/completion",
                    _completion(f"Fact {i}:", n_predict=40, ignore_eos=True),
                )
            )
            for i in range(3)
        ],
        consumeErrors=True,
    )
    assert all(ok and r[0] == 200 and r[1]["tokens_predicted"] == 40 for ok, r in others)
    # while the others computed 40 tokens each, the paused run made at most its window's worth
    assert control.steps <= steps_at_pause + control.window + 2
    assert control.skipped > 0
    control.resumeProducing()
    status, events = await slow
    assert status == 200 and events[-1] == "[DONE]"
    assert events[-2]["usage"]["completion_tokens"] == 64


async def apost_stream(url: str, body: Any) -> tuple[int, list[Any]]:
    status, _, data = await deferToThread(post, url, body)
    return status, sse_events(data)


@pytest_twisted.ensureDeferred
async def test_slots_are_listed_saved_erased_and_restored_per_id(parallel: Served) -> None:
    native = parallel.native
    prompts = [f"Slot test {i}: the weather is" for i in range(N_SLOTS)]
    await DeferredList(
        [
            Deferred.fromCoroutine(apost(parallel.url + "/completion", _completion(p, n_predict=6)))
            for p in prompts
        ]
    )
    _, _, props = await deferToThread(get, parallel.url + "/props")
    assert json.loads(props)["total_slots"] == N_SLOTS
    status, _, data = await deferToThread(get, parallel.engine_url + "/slots")
    listed = json.loads(data)
    assert status == 200 and [s["id"] for s in listed] == list(range(N_SLOTS))
    tokens = [list(slot.tokens) for slot in native.engine.slots]
    assert [s["n_prompt_tokens"] for s in listed] == [len(t) for t in tokens]
    assert all(tokens) and len({tuple(t) for t in tokens}) == N_SLOTS
    url = parallel.engine_url + "/slots/"
    status, saved = await apost(url + "1?action=save", {"filename": "one.bin"})
    assert status == 200 and saved["id_slot"] == 1 and saved["n_saved"] == len(tokens[1])
    status, erased = await apost(url + "1?action=erase", {})
    assert status == 200 and erased["n_erased"] == len(tokens[1])
    assert native.engine.slots[1].tokens == []
    assert [list(s.tokens) for s in native.engine.slots[2:]] == tokens[2:]  # the others kept
    status, restored = await apost(url + "3?action=restore", {"filename": "one.bin"})
    assert status == 200 and restored["n_restored"] == len(tokens[1])
    assert native.engine.slots[3].tokens == tokens[1]
    # an id wraps onto the slots as llama-server's get_slot_by_id (5 % 4 = 1)
    status, restored = await apost(url + "5?action=restore", {"filename": "one.bin"})
    assert status == 200 and restored["id_slot"] == 5 and native.engine.slots[1].tokens == tokens[1]


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(f"llamacpp:{name} "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def _open_stream(url: str, body: dict[str, Any]) -> http.client.HTTPResponse:
    host, port = url.removeprefix("http://").split("/", 1)[0].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=HANG_GUARD_S)
    conn.request("POST", "/completion", json.dumps(body), {"Content-Type": "application/json"})
    return conn.getresponse()


@pytest_twisted.ensureDeferred
async def test_past_the_queue_bound_a_request_is_503_with_retry_after_and_nothing_lost(
    parallel: Served,
) -> None:
    bridge = parallel.native.bridge
    bridge.max_queue = 1
    try:
        body = _completion("Count slowly:", n_predict=40, stream=True, ignore_eos=True)
        streams = [deferToThread(_open_stream, parallel.url, body) for _ in range(N_SLOTS)]
        await until(lambda: bridge.processing == N_SLOTS, "every slot to be busy")
        queued = Deferred.fromCoroutine(
            apost(parallel.url + "/completion", _completion("Hi", ignore_eos=True))
        )
        await until(lambda: bridge.scheduler.waiting_runs == 1, "the fifth to wait")
        _, _, metrics = await deferToThread(get, parallel.url + "/metrics")
        text = metrics.decode()
        assert _metric(text, "requests_processing") == N_SLOTS
        assert _metric(text, "requests_deferred") == 1
        assert _metric(text, "n_busy_slots_per_decode") > 1.0  # slots shared decode passes
        status, refused = await deferToThread(
            _post_with_headers, parallel.url + "/completion", _completion("Hi")
        )
        assert status[0] == 503 and status[1] == "1"
        assert refused["error"]["code"] == 503 and refused["error"]["type"] == "unavailable_error"
        responses = await DeferredList(streams)
        for _, response in responses:
            events = await deferToThread(response.read)
            assert b'"stop":true' in events
        status, answer = await queued
        assert status == 200 and answer["tokens_predicted"] == 24  # the queued one answered
    finally:
        bridge.max_queue = 512


def _post_with_headers(url: str, body: Any) -> tuple[tuple[int, str | None], Any]:
    host, port = url.removeprefix("http://").split("/", 1)[0].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=HANG_GUARD_S)
    conn.request("POST", "/completion", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    return (resp.status, resp.getheader("retry-after")), json.loads(data)


@pytest_twisted.ensureDeferred
async def test_ollama_answers_take_the_slots_too(
    parallel: Served, alone_server: Served, default_model: Path
) -> None:
    name = default_model.name[: -len(".gguf")].lower()  # the startup model's Ollama name
    bodies = [
        {
            "model": name,
            "prompt": f"List {n} fruits:",
            "options": {"temperature": 0, "num_predict": 16},
            "stream": False,
        }
        for n in (2, 3, 4)
    ]
    alone = [(await apost(alone_server.url + "/api/generate", b))[1]["response"] for b in bodies]
    scheduler = parallel.native.bridge.scheduler
    shared_before = scheduler.stats.shared_decodes
    together = await DeferredList(
        [Deferred.fromCoroutine(apost(parallel.url + "/api/generate", b)) for b in bodies],
        consumeErrors=True,
    )
    got = [r[1]["response"] if ok and r[0] == 200 else repr(r) for ok, r in together]
    assert got == alone
    assert scheduler.stats.shared_decodes > shared_before  # they ran side by side


def test_an_iterations_passes_take_the_decode_steps_first_then_prompts_within_the_budget() -> None:
    """llama-server's -b: every decode step in the first group, each prompt micro-batch in
    slot order in the first group of at most 2048 tokens (decode steps counted) it fits."""

    def forward(n: int) -> Any:
        return SimpleNamespace(tokens=[0] * n, decode=n == 1)

    prompts = [forward(512), forward(512), forward(512), forward(512), forward(100)]
    decodes = [forward(1) for _ in range(3)]
    passes = passes_of([prompts[0], decodes[0], *prompts[1:], *decodes[1:]])
    assert [[len(f.tokens) for f in p] for p in passes] == [[1, 1, 1, 512, 512, 512, 100], [512]]
    assert passes[0] == decodes + prompts[:3] + [prompts[4]] and passes[1] == [prompts[3]]
    one = forward(1)
    assert passes_of([one], budget=4) == [[one]]
    four = forward(4)
    assert passes_of([four, one], budget=4) == [[one], [four]]  # the decode step takes room
    assert passes_of([]) == []
