"""A request's several completions (``n_cmpl``, alias ``n``) and several prompts on several slots.

On the ``--parallel 4 -kvu`` server test_parallel uses (real HTTP on loopback, the real default
model): each choice is bit-identical to the same request alone with ``n`` 1 on the one-slot
server (child ``j`` of a seeded request seeded ``seed + j``, as llama-server seeds its child
tasks), streamed and not, and equal to a real llama-server ``-np 4 -kvu``'s choices; the
choices of one request run at once (decode rows outnumber decode calls while it runs); a
three-prompt /completion equals each prompt alone; every answer's receipts check ``valid`` and
are refused once any choice's text changes, and replay identically answer by answer; a refusal (``n`` 0, 5 on 4 slots, a string, with a
bad grammar) is llama-server's status and message; the official ``openai`` client reads
``n=2``; a client leaving stops every one of its choices within a token. A prompt's
completions compute it once (the scheduler's prompt-token count grows by the prompt's length)
and report llama-server's ``cache_n`` and ``prompt_n``, also for a prompt one slot holds; a
group that does not fit the free slots waits while a later single request is answered, then
answers as each completion alone; a child whose parent is cancelled before its prompt is
computed computes it itself and answers as it alone; ``copy_slot`` gives a child the parent's
sliding-window cells as they are laid out.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
import pytest_twisted
from twisted.internet.defer import Deferred
from twisted.internet.threads import deferToThread

from bankml import api
from bankml.engine_cupy.checkpoints import Checkpoints
from bankml.engine_cupy.engine import Engine
from bankml.engine_cupy.kv_cache import KVCache
from bankml.engine_cupy.schedule import Slot
from bankml.engine_cupy.slots import copy_slot
from bankml.native.resident import completions
from bankml.native.run import prompt_steps
from bankml.native.scheduler import RunGroup, RunJob, Scheduler
from bankml.receipts.check import VALID, check_receipt
from bankml.receipts.replay import ReplayEngine, replay_in_process
from bankml.serving.run_control import RunControl
from tests.events import HANG_GUARD_S, until
from tests.native_support import (
    N_CTX,
    N_SLOTS,
    HeadlessControl,
    Served,
    apost,
    get,
    post,
    recorded,
    run_alone,
    seeded_chat,
    sse_events,
    stream_then_leave,
    wait_for,
)
from tests.support import DEFAULT_SHA256, LlamaServer

CHAT_PATH = "/v1/chat/completions"


@pytest.fixture(scope="module")
def llama_np4(default_model: Path, llama_server_bin: Path):
    """A real llama-server with four slots and one unified cache, as the bankml server."""
    with LlamaServer(
        default_model, args=["-np", str(N_SLOTS), "-kvu"], binary=llama_server_bin
    ) as s:
        yield s


async def _checked(served: Served, body: dict[str, Any], answer: bytes) -> str:
    """check-receipt's verdict on ``answer`` with the server's published key."""
    key = json.loads((await deferToThread(get, served.url + "/bankml/key"))[2])["public_key"]
    return check_receipt(json.dumps(body).encode(), answer, key)


async def _raw(url: str, body: dict[str, Any]) -> tuple[int, bytes]:
    status, _, data = await deferToThread(post, url, body)
    return status, data


def _shared_decodes(served: Served) -> tuple[int, int]:
    stats = served.native.bridge.scheduler.stats
    return stats.decode_calls, stats.decode_rows


def _choice(answer: dict[str, Any]) -> dict[str, Any]:
    """A chat choice as compared: its text, finish reason and logprob entries."""
    choice = answer["choices"][0]
    return {k: choice.get(k) for k in ("message", "finish_reason", "logprobs")}


def _stream_choices(events: list[Any]) -> dict[int, dict[str, Any]]:
    """Per choice index: its text, logprob entries, finish reason and events, in order."""
    out: dict[int, dict[str, Any]] = {}
    last = None
    for e in events:
        if e in (None, "[DONE]"):
            continue
        index = e["choices"][0]["index"] if e["choices"] else last
        last = index
        got = out.setdefault(index, {"text": "", "entries": [], "finish": None, "events": []})
        got["events"].append(e)
        for c in e["choices"]:
            got["text"] += c["delta"].get("content") or ""
            got["entries"] += (c.get("logprobs") or {}).get("content") or []
            got["finish"] = c["finish_reason"] or got["finish"]
    return out


@pytest_twisted.ensureDeferred
async def test_three_seeded_chat_choices_are_each_request_alone_and_llama_servers(
    parallel: Served, alone_server: Served, llama_np4: LlamaServer
) -> None:
    body = seeded_chat(n=3)
    calls, rows = _shared_decodes(parallel)
    status, raw = await _raw(parallel.url + CHAT_PATH, body)
    calls, rows = _shared_decodes(parallel)[0] - calls, _shared_decodes(parallel)[1] - rows
    assert status == 200, raw
    answer = json.loads(raw)
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2]
    assert rows > calls > 0  # the three choices' decode steps were shared
    print(f"n 3 on {N_SLOTS} slots: {rows} decode rows in {calls} decode calls")
    alone = [
        json.loads((await _raw(alone_server.url + CHAT_PATH, seeded_chat(seed=41 + j)))[1])
        for j in range(3)
    ]
    for j, (choice, single) in enumerate(zip(answer["choices"], alone)):
        assert {k: choice.get(k) for k in ("message", "finish_reason", "logprobs")} == _choice(
            single
        ), j
        assert (
            answer["bankml_receipt"][j]["completion_tokens_sha256"]
            == single["bankml_receipt"]["completion_tokens_sha256"]
        )
        assert answer["bankml_receipt"][j]["sampler"]["seed"] == 41 + j
    assert len({c["message"]["content"] for c in answer["choices"]}) == 3
    assert answer["usage"] == alone[0]["usage"]  # the first choice's, as llama-server's
    _, ref = await apost(llama_np4.url + CHAT_PATH, body)
    assert [c["message"]["content"] for c in answer["choices"]] == [
        c["message"]["content"] for c in ref["choices"]
    ]
    assert [c["index"] for c in ref["choices"]] == [0, 1, 2]
    assert await _checked(parallel, body, raw) == VALID
    changed = json.loads(raw)
    changed["choices"][2]["message"]["content"] += " "
    verdict = await _checked(parallel, body, json.dumps(changed).encode())
    assert verdict.startswith("refuse: answer 2: response_sha256"), verdict
    dropped = json.loads(raw)
    del dropped["choices"][1], dropped["bankml_receipt"][1]
    assert (await _checked(parallel, body, json.dumps(dropped).encode())).startswith("refuse:")


@pytest_twisted.ensureDeferred
async def test_three_streamed_chat_choices_are_each_stream_alone(
    parallel: Served, alone_server: Served, llama_np4: LlamaServer
) -> None:
    body = seeded_chat(n=3, stream=True, stream_options={"include_usage": True})
    status, raw = await _raw(parallel.url + CHAT_PATH, body)
    assert status == 200
    events = sse_events(raw)
    assert events[-1] == "[DONE]" and None not in events  # children send no begin event
    got = _stream_choices(events)
    assert sorted(got) == [0, 1, 2]
    for j in range(3):
        _, single = await _raw(alone_server.url + CHAT_PATH, {**body, "n": 1, "seed": 41 + j})
        want = _stream_choices(sse_events(single))[0]
        for key in ("text", "entries", "finish"):
            assert got[j][key] == want[key], (j, key)
        own = got[j]["events"]
        assert own[0]["choices"][0]["delta"] == {"role": "assistant", "content": None}
        assert own[-1]["choices"] == [] and "usage" in own[-1]  # include_usage: a usage chunk
        assert [("bankml_receipt" in e) for e in own] == [False] * (len(own) - 1) + [True]
    _, ref = await _raw(llama_np4.url + CHAT_PATH, body)
    ref_got = _stream_choices(sse_events(ref))
    assert {j: got[j]["text"] for j in got} == {j: ref_got[j]["text"] for j in ref_got}
    assert await _checked(parallel, body, raw) == VALID
    piece = json.dumps(got[1]["events"][1]["choices"][0]["delta"]["content"])[1:-1].encode()
    changed = raw.replace(
        b'"index":1,"delta":{"content":"' + piece, b'"index":1,"delta":{"content":"X' + piece, 1
    )
    assert changed != raw
    assert (await _checked(parallel, body, changed)).startswith("refuse: answer 1:")


@pytest_twisted.ensureDeferred
async def test_three_prompts_run_at_once_each_equal_to_it_alone(
    parallel: Served, alone_server: Served
) -> None:
    prompts = ["The capital of France is", "Once upon a time", "def add(a, b):"]
    body = {"prompt": prompts, "n_predict": 16, "n_probs": 2, "cache_prompt": False, "seed": 3}
    calls, rows = _shared_decodes(parallel)
    status, raw = await _raw(parallel.url + "/completion", body)
    now = _shared_decodes(parallel)
    assert status == 200
    assert now[1] - rows > now[0] - calls > 0
    answer = json.loads(raw)
    assert [a["index"] for a in answer] == [0, 1, 2]
    for a, prompt in zip(answer, prompts):
        _, single = await apost(alone_server.url + "/completion", {**body, "prompt": prompt})
        for key in ("content", "completion_probabilities", "tokens_predicted", "stop_type"):
            assert a[key] == single[key], (prompt, key)
    assert len({a["id_slot"] for a in answer}) == 3  # each its own slot
    assert await _checked(parallel, body, raw) == VALID
    contents = [a["content"] for a in answer]
    answer[1]["content"] += "!"
    assert (await _checked(parallel, body, json.dumps(answer).encode())).startswith(
        "refuse: answer 1:"
    )
    streamed = {**body, "stream": True}
    status, raw = await _raw(parallel.url + "/completion", streamed)
    events = sse_events(raw)
    assert events.count(None) == 2  # the later prompts' task begins, as llama-server's
    assert "[DONE]" not in events
    texts = ["".join(e["content"] for e in events if e and e["index"] == i) for i in range(3)]
    assert texts == contents
    assert await _checked(parallel, streamed, raw) == VALID


@pytest_twisted.ensureDeferred
async def test_two_prompts_two_completions_each_in_llama_servers_task_order(
    parallel: Served, llama_np4: LlamaServer, default_model: Path
) -> None:
    body = {"prompt": ["A list:", "B is"], "max_tokens": 4, "seed": 5, "n": 2}
    status, raw = await _raw(parallel.url + "/v1/completions", body)
    assert status == 200
    ours = json.loads(raw)
    _, ref = await apost(llama_np4.url + "/v1/completions", body)
    # prompt p's completion j is choice p * n + j, seeded seed + j
    assert [(c["index"], c["text"]) for c in ours["choices"]] == [
        (c["index"], c["text"]) for c in ref["choices"]
    ]
    assert [r["sampler"]["seed"] for r in ours["bankml_receipt"]] == [5, 6, 5, 6]
    assert await _checked(parallel, body, raw) == VALID
    # the replay runs each answer alone (prompt i // n, its receipt's seed) on a fresh engine
    engine = Engine.open(default_model, n_ctx=N_CTX, device="cpu")
    verdict = replay_in_process(
        json.dumps(body).encode(), raw, ReplayEngine(engine, DEFAULT_SHA256)
    )
    assert verdict.startswith("identical: 4 answers"), verdict
    _, ours_llama = await apost(parallel.url + "/completion", body)
    _, ref_llama = await apost(llama_np4.url + "/completion", body)
    assert [(a["index"], a["content"]) for a in ours_llama] == [
        (a["index"], a["content"]) for a in ref_llama
    ]


BAD = [
    {"n": 5},
    {"n_cmpl": 5},
    {"n": 0},
    {"n": "2"},
    {"n": 2, "grammar": "root ::= [a-"},
    {"n": 2, "json_schema": {"type": "object", "properties": 5}},
]


@pytest_twisted.ensureDeferred
async def test_bad_n_is_llama_servers_refusal_and_loses_nothing(
    parallel: Served, llama_np4: LlamaServer
) -> None:
    for extra in BAD:
        body = {"prompt": "Hi", "n_predict": 2, **extra}
        ours = await apost(parallel.url + "/completion", body)
        ref = await apost(llama_np4.url + "/completion", body)
        assert ours[0] == ref[0] and 400 <= ours[0] < 500, (extra, ours, ref)
        assert ours[1]["error"]["message"] == ref[1]["error"]["message"], extra
    status, answer = await apost(parallel.url + "/completion", {"prompt": "Hi", "n_predict": 2})
    assert status == 200 and answer["tokens_predicted"] == 2
    assert parallel.native.bridge.processing == 0


@pytest_twisted.ensureDeferred
async def test_the_openai_client_reads_n_2(parallel: Served) -> None:
    def ask() -> Any:
        client = openai.OpenAI(base_url=parallel.url + "/v1", api_key="none", max_retries=0)
        return client.chat.completions.create(
            model="any",
            messages=[{"role": "user", "content": "Say hi."}],
            n=2,
            seed=8,
            max_tokens=8,
        )

    completion = await deferToThread(ask)
    assert [c.index for c in completion.choices] == [0, 1]
    assert all(c.message.content for c in completion.choices)
    receipts = completion.model_extra["bankml_receipt"]
    assert [r["sampler"]["seed"] for r in receipts] == [8, 9]


@pytest_twisted.ensureDeferred
async def test_a_client_leaving_stops_every_choice_within_one_token(parallel: Served) -> None:
    bridge = parallel.native.bridge
    earlier = {id(c) for c in bridge.scheduler.stats.runs}
    body = seeded_chat(
        n=3, stream=True, max_tokens=300, ignore_eos=True, logprobs=False, top_logprobs=None
    )
    body = {k: v for k, v in body.items() if v is not None}
    seen = await deferToThread(stream_then_leave, parallel.url, body)
    assert b'"content":"' in seen
    await until(lambda: bridge.processing == 0, "the slots to be free")
    runs = [c for c in bridge.scheduler.stats.runs if id(c) not in earlier]
    assert len(runs) == 3
    for control in runs:
        # at most the token of the forward pass under way when the cancel came (a choice still
        # in its prefill samples its first one), then its summary
        assert control.steps_at_cancel is not None
        assert control.steps - control.steps_at_cancel <= 2, (
            control.steps,
            control.steps_at_cancel,
        )
        assert control.steps < 100


@pytest_twisted.ensureDeferred
async def test_the_python_api_answers_n_choices_as_http_does(parallel: Served) -> None:
    body = seeded_chat(n=2, max_tokens=8)
    got = await deferToThread(api.chat, body, native=parallel.native)
    _, over_http = await apost(parallel.url + CHAT_PATH, body)
    assert got["choices"] == over_http["choices"]
    assert [r["sampler"]["seed"] for r in got["bankml_receipt"]] == [41, 42]
    raw = json.dumps(got).encode()
    assert await _checked(parallel, body, raw) == VALID
    events = await deferToThread(lambda: list(api.chat_stream(body, native=parallel.native)))
    texts = _stream_choices(events)
    assert {j: texts[j]["text"] for j in texts} == {
        c["index"]: c["message"]["content"] for c in got["choices"]
    }


SHARED_PROMPT = "A short story about a lighthouse keeper who counts the waves:"


def _completion_n(prompt: str, **extra: Any) -> dict[str, Any]:
    return {
        "prompt": prompt,
        "n_cmpl": 3,
        "n_predict": 6,
        "n_probs": 2,
        "temperature": 0.9,
        "seed": 11,
        **extra,
    }


def _prompt_counts(answer: list[dict[str, Any]]) -> list[tuple[int, int]]:
    return [(a["timings"]["cache_n"], a["timings"]["prompt_n"]) for a in answer]


async def _each_alone(served: Served, body: dict[str, Any], answer: list[dict[str, Any]]) -> None:
    """Answer ``j`` is the same request with ``n_cmpl`` 1 and seed 11 + j on ``served``."""
    for j, choice in enumerate(answer):
        _, alone = await apost(served.url + "/completion", {**body, "n_cmpl": 1, "seed": 11 + j})
        for key in ("content", "completion_probabilities", "tokens_predicted"):
            assert choice[key] == alone[key], (j, key)


@pytest_twisted.ensureDeferred
async def test_n_cmpl_computes_its_prompt_once_with_llama_servers_prompt_counts(
    parallel: Served, alone_server: Served, llama_np4: LlamaServer
) -> None:
    stats = parallel.native.bridge.scheduler.stats
    computed, groups = stats.prompt_tokens, stats.groups
    body = _completion_n(SHARED_PROMPT, cache_prompt=False)
    status, ours = await apost(parallel.url + "/completion", body)
    assert status == 200, ours
    n_prompt = ours[0]["tokens_evaluated"]
    # the parent computed the prompt; its two children took its slot's state
    assert stats.prompt_tokens - computed == n_prompt
    assert stats.groups - groups == 1
    _, ref = await apost(llama_np4.url + "/completion", body)
    assert _prompt_counts(ours) == _prompt_counts(ref) == [(0, n_prompt)] * 3
    await _each_alone(alone_server, body, ours)
    # a prompt that one slot holds: the parent re-evaluates its last token there, and the
    # children report the parent's counts (computing it on their own slots, they would not)
    held = SHARED_PROMPT + " one, two,"
    for url in (parallel.url, llama_np4.url):
        await apost(url + "/completion", {"prompt": held, "n_predict": 1})
    cached = _completion_n(held)
    computed = stats.prompt_tokens
    _, ours = await apost(parallel.url + "/completion", cached)
    _, ref = await apost(llama_np4.url + "/completion", cached)
    assert stats.prompt_tokens - computed == 1
    n_prompt = ours[0]["tokens_evaluated"]
    assert _prompt_counts(ours) == _prompt_counts(ref) == [(n_prompt - 1, 1)] * 3
    await _each_alone(parallel, cached, ours)  # alone, on a slot holding the prompt too


def _open_stream(url: str, body: dict[str, Any]) -> socket.socket:
    """A /completion stream read until its first piece of text, left open (not read)."""
    host, port = url.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)), timeout=HANG_GUARD_S)
    data = json.dumps(body).encode()
    s.sendall(
        b"POST /completion HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(data)}\r\n\r\n".encode()
        + data
    )
    seen = b""
    while b'"content":"' not in seen:
        chunk = s.recv(4096)
        assert chunk, seen
        seen += chunk
    return s


@pytest_twisted.ensureDeferred
async def test_a_group_that_does_not_fit_waits_for_free_slots_later_runs_go_on(
    parallel: Served, alone_server: Served
) -> None:
    bridge = parallel.native.bridge
    stats = bridge.scheduler.stats
    long = {"prompt": "Count slowly:", "n_predict": 1500, "stream": True, "ignore_eos": True}
    streams = [await deferToThread(_open_stream, parallel.url, long) for _ in range(2)]
    try:
        assert bridge.processing == 2
        deferred = stats.deferred
        body = _completion_n("The lighthouse keeper said", cache_prompt=False)
        group = Deferred.fromCoroutine(apost(parallel.url + "/completion", body))
        await until(lambda: bridge.scheduler.waiting_runs == 3, "the group to wait")
        await until(lambda: stats.deferred > deferred, "the group to be deferred")
        # two slots are free: a later single run takes one and is answered meanwhile
        status, single = await apost(parallel.url + "/completion", {"prompt": "Hi", "n_predict": 2})
        assert status == 200 and single["tokens_predicted"] == 2
        assert bridge.scheduler.waiting_runs == 3 and not group.called
        computed = stats.prompt_tokens
    finally:
        for s in streams:
            s.close()
    status, ours = await group
    assert status == 200, ours
    assert stats.prompt_tokens - computed == ours[0]["tokens_evaluated"]
    await _each_alone(alone_server, body, ours)


def test_a_child_whose_parent_ends_before_its_prompt_computes_it_itself(
    engines: tuple[Engine, Engine],
) -> None:
    one, four = engines
    prompt = " ".join(f"item {i}," for i in range(180))
    body = {"prompt": prompt, "n_predict": 4, "seed": 11, "temperature": 0.9}
    body.update(n_probs=1, cache_prompt=False)
    (parsed,) = four.parse_batch({**body, "n_cmpl": 2}, "completion")
    group = four.share_prompt(completions(parsed))
    controls = [HeadlessControl() for _ in group]
    controls[0].pauseProducing()  # the parent starts, then sits out after its first micro-batch
    got: dict[int, list[Any]] = {j: [] for j in range(2)}
    outcomes: dict[int, Any] = {}

    def deliver(item: Any, control: RunControl) -> None:
        if control.take_room():
            got[item.index].append(item)
            control.delivered()

    scheduler = Scheduler(None, "test-engine", N_SLOTS, outcomes.__setitem__)
    jobs = [
        RunJob(prompt_steps(four, [req], first_index=j), deliver, controls[j], j)
        for j, req in enumerate(group)
    ]
    try:
        scheduler.submit_run(RunGroup(jobs))
        wait_for(lambda: len(group[0].shared.waiting) == 1, "the child to wait")
        controls[0].cancel()  # before its second micro-batch: it publishes nothing
        wait_for(lambda: len(outcomes) == 2, "both runs to end")
    finally:
        scheduler.stop(HANG_GUARD_S)
    assert got[0] == []  # it never sampled (a cancelled run's last steps are not sent)
    n_prompt = len(parsed.prompt_tokens)
    assert n_prompt > 512  # two micro-batches
    assert scheduler.stats.prompt_tokens == 512 + n_prompt  # the child computed its own
    assert recorded(got[1]) == run_alone(one, "completion", {**body, "seed": 12})
    assert got[1][-1].summary.timings["prompt_n"] == n_prompt
    assert all(not slot.processing for slot in four.slots)


def _filled(cache: KVCache, n: int, rng: np.random.Generator, start: int = 0) -> None:
    """Positions start..n-1 stored in micro-batches of the cache's n_ubatch, as a prefill."""
    for a in range(start, n, cache.n_ubatch):
        b = min(a + cache.n_ubatch, n)
        cache.place(a, b - a)
        for layer in range(2):
            k, v = (rng.standard_normal((b - a, 1, 32)).astype(np.float32) for _ in "kv")
            cache.store(layer, a, k, v)
        cache.advance(b)


def test_copy_slot_copies_the_sliding_window_cells_as_they_are_laid_out() -> None:
    def slot(i: int) -> Slot:
        cache = KVCache(
            np, 2, 1, 32, 2048, window=64, sliding=(True, False), ring=True, n_ubatch=64
        )
        return Slot(i, cache, 2048, checkpoints=Checkpoints(64))

    parent, child = slot(0), slot(1)
    rng = np.random.default_rng(7)
    _filled(child.cache, 90, rng)  # the child slot's earlier contents, replaced
    _filled(parent.cache, 300, rng)  # the ring has wrapped: cell order is not position order
    parent.tokens = list(range(300))
    parent.checkpoints.items = ["a checkpoint"]
    assert copy_slot(parent, child) == 300
    assert child.tokens == parent.tokens and child.checkpoints.items == ["a checkpoint"]
    a, b = parent.cache, child.cache
    assert b.n_tokens == a.n_tokens == 300 and b.pos_min == a.pos_min > 0
    assert (b.swa.pos == a.swa.pos).all() and b.swa.head == a.swa.head
    # the next token goes to the same cell of each; every position and ring cell is the same
    for cache in (a, b):
        _filled(cache, 301, np.random.default_rng(8), start=300)
    assert (a.swa.pos == b.swa.pos).all()
    assert a.in_ring(0) and not a.in_ring(1)
    ring = a.swa.size
    assert np.array_equal(a.keys(0, ring), b.keys(0, ring))
    assert np.array_equal(a.values(0, ring), b.values(0, ring))
    assert np.array_equal(a.keys(1, 301), b.keys(1, 301))
    assert np.array_equal(a.values(1, 301), b.values(1, 301))
