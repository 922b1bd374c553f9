"""Every llama-server endpoint through P0, side by side with the same llama-server asked directly.

One `bankml serve --spawn` per module, with extra llama-server arguments after `--`; each
request goes to bankml and to the spawned llama-server's own address, and the answers must have
the same status, keys and values (timings, ids and creation times aside), the completions with
receipts whose hashes the test recomputes from what it received.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

import pytest

from bankml.receipts.digest import canonical_logprobs
from bankml.receipts.vouch import FILE_CHANGED
from tests import support
from tests.bankml_process import BankmlProcess, copy_and_pin, sha, sse_events

pytestmark = pytest.mark.llama_server

ALIAS = "p0-smollm"
EXTRA = ["-ngl", "0", "--embeddings", "--metrics", "--slots", "-a", ALIAS, "-b", "256"]
VOLATILE = {"created", "created_at", "completed_at", "id", "item_id", "timings", "id_task"}


class SpawnedWithExtra(BankmlProcess):
    def command(self) -> list[str]:
        return super().command() + ["--", *EXTRA]


@pytest.fixture(scope="module")
def p0(
    tmp_path_factory: pytest.TempPathFactory, default_model: Path, llama_server_bin: Path
) -> Any:
    model, fork = copy_and_pin(default_model, tmp_path_factory.mktemp("p0e"))
    log = tmp_path_factory.mktemp("log") / "p0.log"
    engine = ["--spawn", str(llama_server_bin), "--upstream", f"127.0.0.1:{support.free_port()}"]
    with SpawnedWithExtra(model, fork, engine, log) as bankml:
        yield bankml


def upstream_port(p0: BankmlProcess) -> int:
    return int(p0.get("/bankml")[1]["upstream"].rpartition(":")[2])


def ask(port: int, method: str, path: str, body: Any = None) -> tuple[int, bytes, dict[str, str]]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"} if data is not None else {}
        conn.request(method, path, body=data, headers=headers)
        resp = conn.getresponse()
        return resp.status, resp.read(), {k.lower(): v for k, v in resp.getheaders()}
    finally:
        conn.close()


def both(p0: BankmlProcess, method: str, path: str, body: Any = None) -> tuple[Any, Any]:
    """(bankml's answer, llama-server's answer) to the same request, bankml's first."""
    return ask(p0.port, method, path, body), ask(upstream_port(p0), method, path, body)


def stable(obj: Any) -> Any:
    """An answer without what changes from one request to the next."""
    if isinstance(obj, dict):
        return {k: stable(v) for k, v in obj.items() if k not in VOLATILE}
    if isinstance(obj, list):
        return [stable(v) for v in obj]
    return obj


def without_receipt(obj: Any) -> Any:
    """The answer without its receipt, and with the seed bankml drew for a request that named
    none (it is appended to the forwarded body, and llama-server echoes it) read back as the
    "draw one" llama-server shows when asked directly: the echoed seed must be the receipt's."""
    if not isinstance(obj, dict):
        return [without_receipt(o) for o in obj]
    out = {k: v for k, v in obj.items() if k != "bankml_receipt"}
    drawn = ((obj.get("bankml_receipt") or {}).get("sampler") or {}).get("seed")
    settings = out.get("generation_settings")
    if isinstance(settings, dict) and drawn is not None and settings.get("seed") == drawn:
        out["generation_settings"] = {**settings, "seed": 4294967295}
    return out


def check_receipt(
    r: dict[str, Any],
    body: bytes,
    text: str,
    entries: list[Any] | None,
    counts: tuple[int, int] | None,
) -> None:
    assert r["request_sha256"] == sha(body)
    assert r["response_sha256"] == sha(text.encode("utf-8"))
    if entries is None:
        assert "logprobs_sha256" not in r
    else:
        assert entries and r["logprobs_sha256"] == sha(canonical_logprobs(entries))
    assert r["model_sha256"] == support.DEFAULT_SHA256 and r["guard"] == "play"
    assert r["engine"].startswith("llama-server b")
    if counts is not None:
        assert (r["prompt_tokens"], r["completion_tokens"]) == counts


def events(raw: bytes) -> list[Any]:
    """A stream's events: each data payload as JSON, ``[DONE]`` as the string."""
    out = []
    for event in sse_events(raw):
        assert event.startswith(b"data: "), event
        payload = event[len(b"data: ") :]
        out.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
    return out


def same_stream(mine: bytes, theirs: bytes) -> list[Any]:
    """bankml's events, checked equal to llama-server's one by one (the receipts aside)."""
    a, b = events(mine), events(theirs)
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        x = without_receipt(x) if isinstance(x, dict) else x
        assert stable(x) == stable(y)
    return a


PROMPT = "The capital of France is"
CHAT_MESSAGES = [{"role": "user", "content": "Name a colour."}]


# --- the extra arguments reached llama-server ------------------------------------------------------


def test_the_extra_arguments_reach_the_spawned_llama_server(p0: BankmlProcess) -> None:
    reason = p0.get("/bankml")[1]["engine"]["reason"]
    assert reason.startswith("healthy")
    status, raw, _ = ask(p0.port, "GET", "/v1/models")
    assert status == 200 and json.loads(raw)["data"][0]["id"] == ALIAS  # -a
    assert ask(p0.port, "GET", "/metrics")[0] == 200  # 501 without --metrics


# --- completion endpoints: receipts, streamed and not ----------------------------------------------


@pytest.mark.parametrize("path", ["/completion", "/completions"])
def test_llama_completion_whole(p0: BankmlProcess, path: str) -> None:
    body = {"prompt": PROMPT, "n_predict": 6, "temperature": 0, "n_probs": 2, "cache_prompt": False}
    (s1, mine, _), (s2, theirs, _) = both(p0, "POST", path, body)
    assert s1 == s2 == 200
    answer = json.loads(mine)
    assert stable(without_receipt(answer)) == stable(json.loads(theirs))
    assert list(answer)[-1] == "bankml_receipt"
    check_receipt(
        answer["bankml_receipt"],
        json.dumps(body).encode(),
        answer["content"],
        answer["completion_probabilities"],
        (answer["tokens_evaluated"], answer["tokens_predicted"]),
    )


def test_llama_completion_streamed_receipt_rides_on_the_stop_event(p0: BankmlProcess) -> None:
    body = {"prompt": PROMPT, "n_predict": 6, "temperature": 0, "n_probs": 2, "stream": True}
    body["cache_prompt"] = False
    (s1, mine, h1), (s2, theirs, _) = both(p0, "POST", "/completion", body)
    assert s1 == s2 == 200 and h1["content-type"] == "text/event-stream"
    evs = same_stream(mine, theirs)
    assert [i for i, e in enumerate(evs) if "bankml_receipt" in e] == [len(evs) - 1]
    assert evs[-1]["stop"] is True and list(evs[-1])[-1] == "bankml_receipt"
    entries = [x for e in evs for x in e.get("completion_probabilities", [])]
    check_receipt(
        evs[-1]["bankml_receipt"],
        json.dumps(body).encode(),
        "".join(e["content"] for e in evs),
        entries,
        (evs[-1]["tokens_evaluated"], evs[-1]["tokens_predicted"]),
    )
    assert isinstance(evs[-1]["bankml_receipt"]["ttft_ms"], int)


@pytest.mark.parametrize("stream", [False, True])
def test_llama_completion_of_several_prompts_has_a_receipt_for_each(
    p0: BankmlProcess, stream: bool
) -> None:
    body = {"prompt": ["One,", "Red,"], "n_predict": 3, "temperature": 0, "stream": stream}
    body["cache_prompt"] = False
    (s1, mine, _), (s2, theirs, _) = both(p0, "POST", "/completion", body)
    assert s1 == s2 == 200
    raw = json.dumps(body).encode()
    if not stream:
        answers = json.loads(mine)
        assert stable(without_receipt(answers)) == stable(json.loads(theirs))
        for a in answers:
            check_receipt(a["bankml_receipt"], raw, a["content"], None, None)
        return
    evs = same_stream(mine, theirs)
    for index in (0, 1):
        own = [e for e in evs if isinstance(e, dict) and e["index"] == index]
        assert "bankml_receipt" in own[-1] and own[-1]["stop"] is True
        assert not any("bankml_receipt" in e for e in own[:-1])
        text = "".join(e["content"] for e in own)
        check_receipt(own[-1]["bankml_receipt"], raw, text, None, None)


@pytest.mark.parametrize("stream", [False, True])
def test_oai_completion(p0: BankmlProcess, stream: bool) -> None:
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "logprobs": 2, "stream": stream}
    body["cache_prompt"] = False
    (s1, mine, _), (s2, theirs, _) = both(p0, "POST", "/v1/completions", body)
    assert s1 == s2 == 200
    raw = json.dumps(body).encode()
    if not stream:
        answer = json.loads(mine)
        assert stable(without_receipt(answer)) == stable(json.loads(theirs))
        choice, usage = answer["choices"][0], answer["usage"]
        counts = (usage["prompt_tokens"], usage["completion_tokens"])
        check_receipt(
            answer["bankml_receipt"], raw, choice["text"], choice["logprobs"]["content"], counts
        )
        return
    evs = same_stream(mine, theirs)
    assert evs[-1] == "[DONE]"
    chunks = evs[:-1]
    assert [i for i, e in enumerate(chunks) if "bankml_receipt" in e] == [len(chunks) - 1]
    last = chunks[-1]
    assert last["choices"][0]["finish_reason"] is not None
    entries = [x for e in chunks for x in (e["choices"][0]["logprobs"] or {}).get("content", [])]
    usage = last["usage"]
    check_receipt(
        last["bankml_receipt"],
        raw,
        "".join(e["choices"][0]["text"] for e in chunks),
        entries,
        (usage["prompt_tokens"], usage["completion_tokens"]),
    )


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/chat/completions"])
def test_chat_whole(p0: BankmlProcess, path: str) -> None:
    body = {"messages": CHAT_MESSAGES, "max_tokens": 6, "temperature": 0, "logprobs": True}
    body.update(top_logprobs=2, cache_prompt=False)
    (s1, mine, _), (s2, theirs, _) = both(p0, "POST", path, body)
    assert s1 == s2 == 200
    answer = json.loads(mine)
    assert stable(without_receipt(answer)) == stable(json.loads(theirs))
    choice, usage = answer["choices"][0], answer["usage"]
    check_receipt(
        answer["bankml_receipt"],
        json.dumps(body).encode(),
        choice["message"]["content"],
        choice["logprobs"]["content"],
        (usage["prompt_tokens"], usage["completion_tokens"]),
    )


@pytest.mark.parametrize("include_usage", [False, True])
def test_chat_streamed_receipt_rides_on_the_last_chunk(
    p0: BankmlProcess, include_usage: bool
) -> None:
    body = {"messages": CHAT_MESSAGES, "max_tokens": 6, "temperature": 0, "stream": True}
    body.update(logprobs=True, top_logprobs=2, cache_prompt=False)
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    (s1, mine, _), (s2, theirs, _) = both(p0, "POST", "/v1/chat/completions", body)
    assert s1 == s2 == 200
    evs = same_stream(mine, theirs)
    assert evs[-1] == "[DONE]"
    chunks = evs[:-1]
    assert [i for i, e in enumerate(chunks) if "bankml_receipt" in e] == [len(chunks) - 1]
    last = chunks[-1]
    if include_usage:  # llama-server's usage chunk: no choices, usage and timings
        assert last["choices"] == [] and "usage" in last
        counts = (last["usage"]["prompt_tokens"], last["usage"]["completion_tokens"])
    else:
        assert last["choices"][0]["finish_reason"] is not None and "usage" not in last
        t = last["timings"]  # the counts come from llama-server's timings
        counts = (t["prompt_n"] + t["cache_n"], t["predicted_n"])
    text, entries = "", []
    for e in chunks:
        for c in e["choices"]:
            text += c["delta"].get("content") or ""
            entries += (c.get("logprobs") or {}).get("content", [])
    check_receipt(last["bankml_receipt"], json.dumps(body).encode(), text, entries, counts)


def typed_events(raw: bytes) -> list[tuple[str, Any]]:
    """A typed stream's (event name, data) pairs (the Responses and Messages APIs)."""
    out = []
    for event in sse_events(raw):
        lines = dict(line.split(b": ", 1) for line in event.split(b"\n"))
        out.append((lines[b"event"].decode(), json.loads(lines[b"data"])))
    return out


@pytest.mark.parametrize("path", ["/v1/responses", "/responses"])
@pytest.mark.parametrize("stream", [False, True])
def test_responses(p0: BankmlProcess, path: str, stream: bool) -> None:
    body = {"input": "Name a colour.", "max_output_tokens": 6, "temperature": 0, "stream": stream}
    body["cache_prompt"] = False
    (s1, mine, _), (s2, theirs, _) = both(p0, "POST", path, body)
    assert s1 == s2 == 200
    raw = json.dumps(body).encode()
    if not stream:
        answer = json.loads(mine)
        assert stable(without_receipt(answer)) == stable(json.loads(theirs))
        text = "".join(p["text"] for item in answer["output"] for p in item["content"])
        usage = answer["usage"]
        counts = (usage["input_tokens"], usage["output_tokens"])
        check_receipt(answer["bankml_receipt"], raw, text, None, counts)
        return
    a, b = typed_events(mine), typed_events(theirs)
    assert [(n, stable(without_receipt(d))) for n, d in a] == [(n, stable(d)) for n, d in b]
    assert [i for i, (_, d) in enumerate(a) if "bankml_receipt" in d] == [len(a) - 1]
    name, last = a[-1]
    assert name == "response.completed"
    text = "".join(d["delta"] for n, d in a if n == "response.output_text.delta")
    usage = last["response"]["usage"]
    counts = (usage["input_tokens"], usage["output_tokens"])
    check_receipt(last["bankml_receipt"], raw, text, None, counts)


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_messages(p0: BankmlProcess, stream: bool) -> None:
    body = {"messages": CHAT_MESSAGES, "max_tokens": 6, "temperature": 0, "stream": stream}
    body["cache_prompt"] = False
    (s1, mine, _), (s2, theirs, _) = both(p0, "POST", "/v1/messages", body)
    assert s1 == s2 == 200
    raw = json.dumps(body).encode()
    if not stream:
        answer = json.loads(mine)
        assert stable(without_receipt(answer)) == stable(json.loads(theirs))
        usage = answer["usage"]
        counts = (usage["input_tokens"] + usage["cache_read_input_tokens"], usage["output_tokens"])
        text = "".join(block["text"] for block in answer["content"])
        check_receipt(answer["bankml_receipt"], raw, text, None, counts)
        return
    a, b = typed_events(mine), typed_events(theirs)
    assert [(n, stable(without_receipt(d))) for n, d in a] == [(n, stable(d)) for n, d in b]
    assert [i for i, (_, d) in enumerate(a) if "bankml_receipt" in d] == [len(a) - 1]
    assert a[-1][0] == "message_stop"
    text = "".join(d["delta"]["text"] for n, d in a if n == "content_block_delta")
    start = a[0][1]["message"]["usage"]
    out = [d["usage"]["output_tokens"] for n, d in a if n == "message_delta"][-1]
    counts = (start["input_tokens"] + start["cache_read_input_tokens"], out)
    check_receipt(a[-1][1]["bankml_receipt"], raw, text, None, counts)


def test_infill_passes_llama_servers_refusal_through(p0: BankmlProcess) -> None:
    body = {"input_prefix": "def f(", "input_suffix": "):\n", "n_predict": 2}
    (s1, mine, _), (s2, theirs, _) = both(p0, "POST", "/infill", body)
    assert (s1, json.loads(mine)) == (s2, json.loads(theirs))
    assert s1 == 501 and b"bankml_receipt" not in mine  # this model has no FIM tokens


@pytest.mark.parametrize(
    "path,body",
    [
        ("/completion", b'{"prompt": '),
        ("/v1/chat/completions", {"messages": "not a list"}),
        ("/v1/completions", {"max_tokens": 2}),
    ],
)
def test_a_completion_refused_by_llama_server_passes_through(
    p0: BankmlProcess, path: str, body: Any
) -> None:
    (s1, mine, h1), (s2, theirs, _) = both(p0, "POST", path, body)
    assert 400 <= s1 == s2 < 500 and mine == theirs
    assert h1["content-type"].startswith("application/json")


# --- every other endpoint, passed through ----------------------------------------------------------


@pytest.mark.parametrize(
    "method,path,body",
    [
        ("GET", "/health", None),
        ("GET", "/v1/health", None),
        ("GET", "/props", None),
        ("POST", "/props", {}),
        ("GET", "/models", None),
        ("GET", "/v1/models", None),
        ("GET", "/lora-adapters", None),
        ("POST", "/tokenize", {"content": "Hello world", "with_pieces": True}),
        ("POST", "/tokenize", {"content": 3}),
        ("POST", "/detokenize", {"tokens": [19556, 905]}),
        ("POST", "/apply-template", {"messages": CHAT_MESSAGES}),
        ("POST", "/v1/embeddings", {"input": ["Hello", "world"]}),  # pooling none: refused
        ("POST", "/rerank", {"query": "a", "documents": ["b"]}),
        ("POST", "/v1/chat/completions/input_tokens", {"messages": CHAT_MESSAGES}),
        ("POST", "/v1/chat/completions/control", {}),
        ("POST", "/slots/0?action=erase", {}),
        ("POST", "/v1/systemone", {}),
        ("GET", "/cors-proxy", None),
        ("GET", "/tools", None),
        ("GET", "/nothing-here", None),
        ("PUT", "/completion", None),
    ],
)
def test_every_other_endpoint_answers_as_llama_server(
    p0: BankmlProcess, method: str, path: str, body: Any
) -> None:
    (s1, mine, h1), (s2, theirs, h2) = both(p0, method, path, body)
    assert s1 == s2, (mine, theirs)
    assert h1["content-type"] == h2["content-type"]
    assert stable(json.loads(mine)) == stable(json.loads(theirs))
    assert b"bankml_receipt" not in mine


@pytest.mark.parametrize("path", ["/embedding", "/embeddings"])
def test_embeddings_answer_as_llama_server_with_a_receipt_in_each_result(
    p0: BankmlProcess, path: str
) -> None:
    (s1, mine, _), (s2, theirs, _) = both(p0, "POST", path, {"content": "Hello world"})
    assert s1 == s2 == 200
    results = json.loads(mine)
    receipts = [result.pop("bankml_receipt") for result in results]
    assert results == json.loads(theirs)
    assert [r["api"] for r in receipts] == ["llama_embedding"] * len(results)


def test_slots_and_metrics_answer_as_llama_server(p0: BankmlProcess) -> None:
    (s1, mine, _), (s2, theirs, _) = both(p0, "GET", "/slots")
    assert s1 == s2 == 200
    mine_slots, their_slots = json.loads(mine), json.loads(theirs)
    assert [sorted(s) for s in mine_slots] == [sorted(s) for s in their_slots]
    assert [s["n_ctx"] for s in mine_slots] == [s["n_ctx"] for s in their_slots]
    (s1, mine, h1), (s2, theirs, h2) = both(p0, "GET", "/metrics")
    assert s1 == s2 == 200 and h1["content-type"] == h2["content-type"]
    names = re.compile(rb"^(llamacpp:\w+)", re.M)
    assert names.findall(mine) == names.findall(theirs) != []


@pytest.mark.parametrize("path", ["/v1/audio/transcriptions", "/v1/stream"])
def test_apis_without_a_receipt_are_refused_not_passed_unvouched(
    p0: BankmlProcess, path: str
) -> None:
    status, raw, _ = ask(p0.port, "POST" if path != "/v1/stream" else "GET", path, {})
    assert status == 501
    error = json.loads(raw)["error"]
    assert error["type"] == "not_supported_error" and path in error["message"]


# --- a client leaving mid-stream -----------------------------------------------------------------


def predicted_total(port: int) -> float:
    metrics = ask(port, "GET", "/metrics")[1].decode()
    return float(re.search(r"^llamacpp:tokens_predicted_total (\S+)", metrics, re.M).group(1))


@pytest.mark.parametrize("path", ["/completion", "/v1/chat/completions"])
def test_events_arrive_while_generating_and_a_disconnect_cancels_upstream(
    p0: BankmlProcess, path: str
) -> None:
    """The first event reaches the client while llama-server is still generating (its /slots
    says so), and closing the connection then stops llama-server's generation: its count of
    predicted tokens grows by far less than the 400 asked."""
    upstream = upstream_port(p0)
    before = predicted_total(upstream)
    n = 400
    if path == "/completion":
        body = {"prompt": "Count: 1, 2,", "n_predict": n, "temperature": 0, "stream": True}
    else:
        body = {"messages": CHAT_MESSAGES, "max_tokens": n, "temperature": 0, "stream": True}
    body["ignore_eos"] = True
    conn = http.client.HTTPConnection("127.0.0.1", p0.port, timeout=120)
    conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.readline().startswith(b"data: {")
    slots = json.loads(ask(p0.port, "GET", "/slots")[1])
    assert slots[0]["is_processing"] is True
    conn.close()
    deadline = time.monotonic() + 60  # generous: only a hung cancel gets near it
    while json.loads(ask(upstream, "GET", "/slots")[1])[0]["is_processing"]:
        assert time.monotonic() < deadline, "llama-server kept generating for a gone client"
        time.sleep(0.05)
    assert predicted_total(upstream) - before < n


# --- the file checked before every forwarded request -----------------------------------------------


def test_every_endpoint_answers_503_while_the_file_is_not_the_verified_one(
    p0: BankmlProcess,
) -> None:
    model = p0.model
    original = model.with_name("original-inode.gguf")
    os.link(model, original)  # keeps the verified inode to put back afterwards
    replacement = model.with_name("replacement.gguf")
    shutil.copyfile(model, replacement)
    os.replace(replacement, model)  # same bytes, another inode: not the file that was hashed
    requests = [
        ("POST", "/completion", {"prompt": PROMPT, "n_predict": 2}),
        ("POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "stream": True}),
        ("POST", "/infill", {"input_prefix": "a", "n_predict": 2}),
        ("POST", "/tokenize", {"content": "Hello"}),
        ("POST", "/embedding", {"content": "Hello"}),
        ("GET", "/slots", None),
        ("GET", "/metrics", None),
    ]
    try:
        for method, path, body in requests:
            status, raw, _ = ask(p0.port, method, path, body)
            assert status == 503 and json.loads(raw)["error"]["message"] == FILE_CHANGED, path
    finally:
        os.replace(original, model)
    assert ask(p0.port, "POST", "/tokenize", {"content": "Hello"})[0] == 200


def test_the_engines_path_is_checked_before_every_completion(
    tmp_path: Path, default_model: Path, llama_server_bin: Path
) -> None:
    """--upstream: the llama-server on that port is replaced by one serving another file (the
    same bytes, another path); bankml's next completion on every endpoint is refused with
    llama-server's /props path named, while a pass-through (a tokenize, not a model answer)
    still answers."""
    model, fork = copy_and_pin(default_model, tmp_path / "a")
    other = tmp_path / "b" / "other.gguf"
    other.parent.mkdir()
    shutil.copyfile(model, other)
    port = support.free_port()
    first = support.LlamaServer(model, binary=llama_server_bin, port=port).start()
    bankml = BankmlProcess(model, fork, ["--upstream", f"127.0.0.1:{port}"], tmp_path / "log")
    try:
        bankml.start()
        body = {"prompt": PROMPT, "n_predict": 1}
        assert ask(bankml.port, "POST", "/completion", body)[0] == 200
        first.stop()
        with support.LlamaServer(other, binary=llama_server_bin, port=port):
            for path, body in (
                ("/completion", {"prompt": PROMPT, "n_predict": 1}),
                ("/v1/completions", {"prompt": PROMPT, "max_tokens": 1, "stream": True}),
                ("/v1/chat/completions", {"messages": CHAT_MESSAGES, "max_tokens": 1}),
            ):
                status, raw, _ = ask(bankml.port, "POST", path, body)
                assert status == 503, raw
                assert json.loads(raw)["error"]["message"] == (
                    f"upstream 127.0.0.1:{port} serves {other}, not the verified "
                    f"{os.path.realpath(model)}: refused"
                )
            assert ask(bankml.port, "POST", "/tokenize", {"content": "Hi"})[0] == 200
    finally:
        first.stop()
        bankml.stop()
