"""`--native` end to end: the real Engine on the default model, real HTTP on loopback, and the real
llama-server (``reference_server``, same model, ``-c 2048``) side by side.

One engine is opened for the module (n_ctx 2048, as the tests' llama-server) and served on two
loopback ports exactly as NativeService binds them: bankml's address and the engine address.
Clients run in threads (``deferToThread``) so the reactor keeps serving while they wait.
Answers are greedy (temperature 0) and short, so the module stays well under a minute of compute.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import time
from pathlib import Path
from typing import Any

import pytest
import pytest_twisted
from twisted.internet import reactor
from twisted.internet.defer import Deferred, DeferredList
from twisted.internet.task import deferLater
from twisted.internet.threads import deferToThread

from bankml.native.bridge import EngineBridge
from bankml.native.resident import NativeEngine
from bankml.native.service import build_native_roots, make_native_service
from bankml.serving.site import LoopbackSite, listen_loopback
from tests import support
from tests.bankml_process import sha
from tests.events import HANG_GUARD_S
from tests.native_support import N_CTX, Served, apost, get, post, sse_events


def test_a_wrongly_pinned_file_is_refused_before_anything_listens(
    tmp_path: Path, default_model: Path
) -> None:
    fork = tmp_path / "FORK.json"
    fork.write_text(json.dumps({"files": [{"path": default_model.name, "sha256": "0" * 64}]}))
    with pytest.raises(SystemExit) as exit_:
        make_native_service({"file": str(default_model), "fork": str(fork)}, reactor)
    assert exit_.value.code == 2


def chat(content: str, **extra: Any) -> dict[str, Any]:
    return {
        "messages": [{"role": "user", "content": content}],
        "temperature": 0,
        "max_tokens": 6,
        **extra,
    }


# --- /v1/chat/completions -------------------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_chat_answer_with_timings_and_receipt(served: Served, reference_server: Any) -> None:
    body = chat("Name a colour.")
    raw = json.dumps(body).encode()
    status, answer = await apost(served.url + "/v1/chat/completions", None, raw)
    assert status == 200, answer
    ref_status, ref = await apost(reference_server.url + "/v1/chat/completions", body)
    assert ref_status == 200
    assert set(answer) - {"bankml_receipt"} == set(ref)  # the same keys as llama-server
    choice = answer["choices"][0]
    assert set(choice) == set(ref["choices"][0]) and set(choice["message"]) >= {"role", "content"}
    assert set(answer["timings"]) >= {
        "cache_n",
        "prompt_n",
        "prompt_ms",
        "prompt_per_second",
        "predicted_n",
        "predicted_ms",
        "predicted_per_second",
    }
    assert (
        answer["usage"]["prompt_tokens"] == ref["usage"]["prompt_tokens"]
    )  # same template + tokens
    assert answer["usage"]["completion_tokens"] == 6 == answer["timings"]["predicted_n"]
    assert choice["finish_reason"] == "length"
    r = answer["bankml_receipt"]
    assert r["response_sha256"] == sha(choice["message"]["content"])
    assert r["request_sha256"] == sha(raw)
    assert r["model_sha256"] == support.DEFAULT_SHA256 and r["signed"] is True
    assert r["prompt_tokens"] == answer["usage"]["prompt_tokens"] and isinstance(r["ttft_ms"], int)
    print(
        "native:",
        repr(choice["message"]["content"]),
        "llama-server:",
        repr(ref["choices"][0]["message"]["content"]),
    )


@pytest_twisted.ensureDeferred
async def test_streamed_chat_ends_with_usage_and_receipt_in_the_last_chunk(served: Served) -> None:
    body = chat("Name a colour.", stream=True, cache_prompt=False)
    raw = json.dumps(body).encode()
    status, ctype, data = await deferToThread(post, served.url + "/v1/chat/completions", None, raw)
    assert status == 200 and ctype.startswith("text/event-stream")
    events = sse_events(data)
    assert events[-1] == "[DONE]"
    last = events[-2]  # the last chunk: finish reason, usage, timings and the receipt
    receipt = last["bankml_receipt"]
    assert not any("bankml_receipt" in e for e in events[:-2])
    assert last["choices"][0]["finish_reason"] == "length" and last["choices"][0]["delta"] == {}
    assert last["usage"]["completion_tokens"] == 6 and "cache_n" in last["timings"]
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": None}
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-2])
    assert receipt["response_sha256"] == sha(text) and receipt["request_sha256"] == sha(raw)
    # The same request not streamed, also from an empty slot, gives the same text (greedy).
    status, whole = await apost(
        served.url + "/v1/chat/completions", chat("Name a colour.", cache_prompt=False)
    )
    assert whole["choices"][0]["message"]["content"] == text
    assert whole["timings"]["cache_n"] == 0


@pytest_twisted.ensureDeferred
async def test_logprobs_ride_on_the_answer_and_in_the_receipt(served: Served) -> None:
    status, answer = await apost(
        served.url + "/v1/chat/completions",
        chat("Say yes.", logprobs=True, top_logprobs=2, max_tokens=3),
    )
    assert status == 200
    entries = answer["choices"][0]["logprobs"]["content"]
    assert len(entries) == 3 and all(len(e["top_logprobs"]) == 2 for e in entries)
    assert set(entries[0]) == {"id", "token", "bytes", "logprob", "top_logprobs"}
    canon = json.dumps(entries, separators=(",", ":"), ensure_ascii=False)
    assert answer["bankml_receipt"]["logprobs_sha256"] == sha(canon)


@pytest.mark.parametrize(
    "extra, expect",
    [
        ({"top_logprobs": 2}, "top_logprobs requires logprobs to be set to true"),
        (
            {"repeat_last_n": -1},
            "Field 'repeat_last_n': Value must be between 0 <= value <= 2147483647, but got -1",
        ),
        (
            {"stop": [5]},
            "Field 'stop': [json.exception.type_error.302] type must be string, but is number",
        ),
        ({"temperature": "x"}, None),
    ],
)
@pytest_twisted.ensureDeferred
async def test_refusals_match_llama_server(
    served: Served, reference_server: Any, extra: dict, expect: str | None
) -> None:
    body = chat("hi", **extra)
    status, answer = await apost(served.url + "/v1/chat/completions", body)
    ref_status, ref = await apost(reference_server.url + "/v1/chat/completions", body)
    assert status == ref_status == 400
    assert answer["error"]["type"] == "invalid_request_error"
    if expect is not None:
        assert answer["error"]["message"] == ref["error"]["message"] == expect


@pytest_twisted.ensureDeferred
async def test_context_limit_is_llama_servers_body(served: Served, reference_server: Any) -> None:
    body = chat("word " * (N_CTX + 50))
    status, answer = await apost(served.url + "/v1/chat/completions", body)
    ref_status, ref = await apost(reference_server.url + "/v1/chat/completions", body)
    assert status == ref_status == 400
    assert answer == ref  # type, message, n_prompt_tokens, n_ctx


@pytest_twisted.ensureDeferred
async def test_bad_json_is_400_not_500(served: Served) -> None:
    for raw in (b"{not json", b"[1, 2]", b'"text"'):
        status, answer = await apost(served.url + "/v1/chat/completions", None, raw)
        assert status == 400 and answer["error"]["code"] == 400


# --- llama-server's endpoints, side by side ---------------------------------------------------------


@pytest.mark.parametrize(
    "path, body",
    [
        ("/tokenize", {"content": "Hello <|im_start|> wörld 123"}),
        ("/tokenize", {"content": "Hello <|im_start|>", "parse_special": False}),
        ("/tokenize", {"content": "héllo", "with_pieces": True}),
        ("/tokenize", {"content": ["a b", 42, "c"]}),
        ("/detokenize", {"tokens": [19556, 665, 28, 1, 2]}),
        (
            "/apply-template",
            {
                "messages": [
                    {"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "Hi"},
                ]
            },
        ),
        ("/apply-template", {"messages": [{"role": "user", "content": "Hi"}]}),
    ],
)
@pytest_twisted.ensureDeferred
async def test_text_endpoints_equal_llama_servers(
    served: Served, reference_server: Any, path: str, body: dict
) -> None:
    ours = await apost(served.engine_url + path, body)
    ref = await apost(reference_server.url + path, body)
    assert ours == ref


@pytest.mark.parametrize("path", ["/health", "/props", "/v1/models", "/models"])
@pytest_twisted.ensureDeferred
async def test_state_endpoints_have_llama_servers_keys(
    served: Served, reference_server: Any, path: str
) -> None:
    status, ctype, data = await deferToThread(get, served.engine_url + path)
    ref_status, _, ref_data = await deferToThread(get, reference_server.url + path)
    assert status == ref_status == 200 and ctype.startswith("application/json")
    ours, ref = json.loads(data), json.loads(ref_data)
    assert set(ours) >= set(ref), set(ref) - set(ours)
    if path == "/props":
        assert ours["model_path"] == served.native.verified.path
        assert ours["default_generation_settings"]["n_ctx"] == N_CTX
        assert set(ours["default_generation_settings"]["params"]) >= {
            "temperature",
            "top_k",
            "top_p",
            "min_p",
        }
    if path in ("/v1/models", "/models"):
        # llama-server names the model by its -m argument; bankml by the file's name
        assert (
            ours["data"][0]["id"] == Path(ref["data"][0]["id"]).name == support.DEFAULT_MODEL.name
        )
        assert set(ours["data"][0]) >= set(ref["data"][0]) - {"aliases", "tags", "architecture"}


# --- the bridge on the real engine: disconnects, simultaneous clients, prefix reuse ------------------


def _stream_then_leave(url: str, body: dict) -> bytes:
    """Send a streamed request, read until the first content delta, then close the socket."""
    host, port = url.removeprefix("http://").split(":")
    raw = json.dumps(body).encode()
    s = socket.create_connection((host, int(port)), timeout=HANG_GUARD_S)
    s.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % len(raw) + raw
    )
    seen = b""
    while b'"content":"' not in seen:
        data = s.recv(4096)
        if not data:
            break
        seen += data
    s.close()
    return seen


@pytest_twisted.ensureDeferred
async def test_a_client_leaving_mid_stream_stops_the_engine_within_one_token(
    served: Served,
) -> None:
    bridge = served.native.bridge
    before = served.native.totals["requests"]
    body = chat("Write a long story about a lighthouse.", stream=True, max_tokens=400)
    seen = await deferToThread(_stream_then_leave, served.url, body)
    assert b'"content":"' in seen
    deadline = time.monotonic() + HANG_GUARD_S
    while bridge.busy and time.monotonic() < deadline:
        await deferLater(reactor, 0.05, lambda: None)
    control = bridge.last_run
    assert control is not None and control.steps_at_cancel is not None
    # The engine's own count of tokens it yielded after the cancel: at most the one under way.
    assert control.steps - control.steps_at_cancel <= 1, (control.steps, control.steps_at_cancel)
    assert control.steps < 100  # far short of the 400 asked for
    assert served.native.totals["requests"] == before  # a cancelled run records nothing
    # The engine is free and answers the next request.
    status, answer = await apost(served.url + "/v1/chat/completions", chat("Say hi.", max_tokens=2))
    assert status == 200 and answer["usage"]["completion_tokens"] == 2


@pytest_twisted.ensureDeferred
async def test_five_simultaneous_clients_get_their_own_answers(served: Served) -> None:
    # Short raw prompts on /completion keep the prefills cheap; cache_prompt false runs each from an
    # empty slot, so an answer cannot depend on which request the queue served before it (the
    # threads below arrive in no fixed order).
    prompts = ["Apples are", "The sea is", "Dogs like", "One, two,", "Mars is"]

    def body(p: str) -> dict:
        return {"prompt": p, "n_predict": 3, "temperature": 0, "cache_prompt": False}

    alone = []
    for p in prompts:  # each asked alone first
        status, answer = await apost(served.url + "/completion", body(p))
        alone.append(answer["content"])
    together = await DeferredList(
        [Deferred.fromCoroutine(apost(served.url + "/completion", body(p))) for p in prompts],
        consumeErrors=True,
    )
    got = [result[1]["content"] if ok else repr(result) for ok, result in together]
    assert got == alone
    assert len(set(alone)) > 1  # the prompts really gave different answers


@pytest_twisted.ensureDeferred
async def test_second_turn_reuses_the_first_turns_prefix(served: Served) -> None:
    first = [{"role": "user", "content": "My name is Ada. Remember it."}]
    status, a1 = await apost(
        served.url + "/v1/chat/completions", {"messages": first, "temperature": 0, "max_tokens": 5}
    )
    turn2 = first + [
        {"role": "assistant", "content": a1["choices"][0]["message"]["content"]},
        {"role": "user", "content": "What is my name?"},
    ]
    status, a2 = await apost(
        served.url + "/v1/chat/completions", {"messages": turn2, "temperature": 0, "max_tokens": 5}
    )
    assert status == 200 and a2["timings"]["cache_n"] > 0
    assert a2["timings"]["cache_n"] + a2["timings"]["prompt_n"] == a2["usage"]["prompt_tokens"]


# --- slots ---------------------------------------------------------------------------------------------


async def slot(
    served: Served, sid: str, action: str, body: dict | None = None, url: str | None = None
) -> tuple[int, Any]:
    return await apost(f"{url or served.engine_url}/slots/{sid}?action={action}", body or {})


@pytest_twisted.ensureDeferred
async def test_save_erase_restore_gives_back_the_same_slot(served: Served) -> None:
    url = served.url + "/v1/chat/completions"
    body = chat("Tell me about the sea.", max_tokens=5)
    await slot(served, "0", "erase")
    status, first = await apost(url, body)  # from an empty slot
    status, saved = await slot(served, "0", "save", {"filename": "sea.bin"})
    assert status == 200, saved
    assert (
        saved["n_saved"] == first["usage"]["prompt_tokens"] + 5 - 1
    )  # the last token is never decoded
    assert saved["n_written"] == (served.slot_dir / "sea.bin").stat().st_size
    status, warm = await apost(url, body)  # the same question on the slot as it was saved
    status, erased = await slot(served, "0", "erase")
    assert status == 200 and erased["id_slot"] == 0 and erased["n_erased"] > 0
    status, empty = await apost(url, body)
    assert empty["timings"]["cache_n"] == 0
    assert empty["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]
    await slot(served, "0", "erase")
    status, restored = await slot(served, "0", "restore", {"filename": "sea.bin"})
    assert status == 200 and restored["n_restored"] == saved["n_saved"]
    assert restored["n_read"] == saved["n_written"]
    status, again = await apost(url, body)
    assert again["timings"]["cache_n"] == again["usage"]["prompt_tokens"] - 1  # the restored prefix
    assert again["choices"][0]["message"]["content"] == warm["choices"][0]["message"]["content"]
    assert again["timings"]["cache_n"] == warm["timings"]["cache_n"]
    # and equal to an empty slot's: below 64 rows ggml's attention is the per-row kernel, so
    # re-evaluating the last prompt token alone computes the bits the whole prompt did
    assert again["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]


@pytest_twisted.ensureDeferred
async def test_a_save_onto_a_full_disk_is_500_and_leaves_no_file_and_the_slot_as_it_was(
    served: Served,
) -> None:
    await apost(served.url + "/v1/chat/completions", chat("Hello there.", max_tokens=2))
    status, before = await slot(served, "0", "save", {"filename": "before.bin"})
    assert status == 200
    # the save writes through <name>.tmp: pointed at /dev/full, every write fails with ENOSPC
    (served.slot_dir / "full.bin.tmp").symlink_to("/dev/full")
    status, refused = await slot(served, "0", "save", {"filename": "full.bin"})
    assert status == 500
    assert refused["error"]["message"] == "Unable to save slot: No space left on device"
    assert not (served.slot_dir / "full.bin").exists()
    assert not os.path.lexists(served.slot_dir / "full.bin.tmp"), "the partial file was left"
    status, after = await slot(served, "0", "save", {"filename": "after.bin"})
    assert status == 200 and after["n_saved"] == before["n_saved"]
    assert (served.slot_dir / "after.bin").read_bytes() == (
        served.slot_dir / "before.bin"
    ).read_bytes()


@pytest_twisted.ensureDeferred
async def test_damaged_and_foreign_slot_files_are_refused_and_leave_an_empty_slot(
    served: Served,
) -> None:
    await apost(served.url + "/v1/chat/completions", chat("Hello.", max_tokens=2))
    status, saved = await slot(served, "0", "save", {"filename": "good.bin"})
    data = (served.slot_dir / "good.bin").read_bytes()
    cases = {
        "junk.bin": (b"not a slot at all", "not a bankML slot file"),
        "flip.bin": (
            data[:200] + bytes([data[200] ^ 1]) + data[201:],
            "the slot file is damaged (its sha256 does not match)",
        ),
    }
    other = bytearray(data[:-32])
    other[15:79] = b"f" * 64
    cases["other.bin"] = (
        bytes(other) + hashlib.sha256(bytes(other)).digest(),
        "the slot was saved for another model",
    )
    for name, (content, reason) in cases.items():
        (served.slot_dir / name).write_bytes(content)
        status, answer = await slot(served, "0", "restore", {"filename": name})
        assert status == 400 and answer["error"]["message"] == f"Unable to restore slot: {reason}"
        assert served.native.engine.slot_tokens == []  # left empty
    status, answer = await slot(served, "0", "restore", {"filename": "missing.bin"})
    assert status == 400 and answer["error"]["message"].startswith("Unable to restore slot: ")


@pytest_twisted.ensureDeferred
async def test_slots_without_a_slot_dir_are_501(served: Served) -> None:
    bare = NativeEngine(
        served.native.engine,
        served.native.bridge,
        served.native.verified,
        slot_dir=None,
        n_ctx=N_CTX,
        reactor=reactor,
    )
    _, engine_root = build_native_roots(bare)
    port = listen_loopback(LoopbackSite(engine_root), "127.0.0.1:0")
    try:
        status, answer = await slot(
            served,
            "0",
            "save",
            {"filename": "a.bin"},
            url=f"http://127.0.0.1:{port.getHost().port}",
        )
    finally:
        await port.stopListening()
    assert status == 501 and answer["error"] == {
        "code": 501,
        "type": "not_supported_error",
        "message": "This server does not support slots action. Start it with `--slot-save-path`",
    }


@pytest_twisted.ensureDeferred
async def test_no_slots_makes_the_slot_monitor_llama_servers_501_and_keeps_the_actions(
    served: Served,
) -> None:
    _, engine_root = build_native_roots(served.native, slots_list=False)  # --no-slots
    port = listen_loopback(LoopbackSite(engine_root), "127.0.0.1:0")
    url = f"http://127.0.0.1:{port.getHost().port}"
    try:
        status, _, data = await deferToThread(get, url + "/slots")
        erased, answer = await slot(served, "0", "erase", url=url)
    finally:
        await port.stopListening()
    assert status == 501 and json.loads(data)["error"] == {
        "code": 501,
        "type": "not_supported_error",
        "message": "This server does not support slots endpoint. Start it with `--slots`",
    }
    assert erased == 200 and answer["id_slot"] == 0
    status, _, data = await deferToThread(get, served.engine_url + "/slots")  # the default: on
    assert status == 200 and json.loads(data)[0]["id"] == 0


# --- /metrics, /completion, /v1/completions, /bankml ---------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_prometheus_metrics_count_the_tokens(served: Served) -> None:
    await apost(served.url + "/v1/chat/completions", chat("One more.", max_tokens=3))
    status, ctype, data = await deferToThread(get, served.engine_url + "/metrics")
    assert status == 200 and ctype.startswith("text/plain; version=0.0.4")
    text = data.decode()
    values = {
        line.split()[0]: float(line.split()[1])
        for line in text.splitlines()
        if not line.startswith("#")
    }
    assert values["llamacpp:tokens_predicted_total"] >= 3
    assert values["llamacpp:prompt_tokens_total"] > 0
    for name in (
        "prompt_tokens_total",
        "prompt_seconds_total",
        "tokens_predicted_seconds_total",
        "n_decode_total",
        "n_tokens_max",
        "prompt_tokens_seconds",
        "predicted_tokens_seconds",
        "requests_processing",
        "requests_deferred",
    ):
        assert f"# TYPE llamacpp:{name} " in text


@pytest_twisted.ensureDeferred
async def test_completion_endpoints_have_llama_servers_keys(
    served: Served, reference_server: Any
) -> None:
    for path in ("/completion", "/v1/completions"):
        body = {"prompt": "The capital of France is", "n_predict": 3, "temperature": 0}
        status, ours = await apost(served.engine_url + path, body)
        ref_status, ref = await apost(reference_server.url + path, body)
        assert status == ref_status == 200
        assert set(ours) - {"bankml_receipt"} >= set(ref) - {"generation_settings"}, set(ref) - set(
            ours
        )
        text = ours["content"] if path == "/completion" else ours["choices"][0]["text"]
        assert ours["bankml_receipt"]["response_sha256"] == sha(text)


@pytest_twisted.ensureDeferred
async def test_bankml_describes_the_resident_model(served: Served) -> None:
    status, _, data = await deferToThread(get, served.url + "/bankml")
    info = json.loads(data)
    assert status == 200 and info["mode"] == "native"
    assert info["resident"]["sha256"] == support.DEFAULT_SHA256 and info["models"] == [
        support.DEFAULT_MODEL.name
    ]
    body = chat("Say hi.", max_tokens=2)  # one completion of its own: the ring is not empty
    assert (await deferToThread(post, served.url + "/v1/chat/completions", body))[0] == 200
    status, _, data = await deferToThread(get, served.url + "/bankml/metrics")
    metrics = json.loads(data)
    assert (
        status == 200 and metrics["kept"] >= 1 and metrics["records"][-1]["completion_tokens"] >= 1
    )
    cache = metrics["prompt_cache"]  # the default bound: a quarter of free memory, up to 8 GiB
    assert 0 < cache["limit_bytes"] <= 8192 * 1024 * 1024 and cache["bytes"] <= cache["limit_bytes"]
    status, _, data = await deferToThread(get, served.url + "/bankml/usage")
    usage = json.loads(data)["prompt_cache"]
    assert status == 200 and usage["limit_bytes"] == cache["limit_bytes"]


@pytest_twisted.ensureDeferred
async def test_streamed_logprobs_ride_on_their_deltas(
    served: Served, reference_server: Any
) -> None:
    body = chat("Say yes.", stream=True, logprobs=True, top_logprobs=1, max_tokens=3)
    status, _, data = await deferToThread(post, served.url + "/v1/chat/completions", body)
    events = sse_events(data)
    sent = [
        e["choices"][0]["logprobs"]["content"][0]
        for e in events[:-2]
        if e.get("choices") and e["choices"][0].get("logprobs")
    ]
    assert 1 <= len(sent) <= 3 and all(len(e["top_logprobs"]) == 1 for e in sent)
    canon = json.dumps(sent, separators=(",", ":"), ensure_ascii=False)
    assert events[-2]["bankml_receipt"]["logprobs_sha256"] == sha(canon)
    # llama-server's chunks carry the same keys
    _, _, ref_data = await deferToThread(post, reference_server.url + "/v1/chat/completions", body)
    ref_events = sse_events(ref_data)
    assert set(events[0]) == set(ref_events[0]) and events[0]["object"] == "chat.completion.chunk"
    assert (
        ref_events[0]["choices"][0]["delta"] == events[0]["choices"][0]["delta"]
    )  # the role delta


@pytest_twisted.ensureDeferred
async def test_a_changed_model_file_answers_503_without_a_receipt(served: Served) -> None:
    import dataclasses

    from bankml.gate.fileident import FileIdent

    v = served.native.verified
    moved = dataclasses.replace(v, ident=dataclasses.replace(v.ident, size=v.ident.size + 1))
    changed = NativeEngine(
        served.native.engine, served.native.bridge, moved, n_ctx=N_CTX, reactor=reactor
    )
    listen_root, _ = build_native_roots(changed)
    port = listen_loopback(LoopbackSite(listen_root), "127.0.0.1:0")
    try:
        status, answer = await apost(
            f"http://127.0.0.1:{port.getHost().port}/v1/chat/completions", chat("hi")
        )
    finally:
        await port.stopListening()
    assert isinstance(v.ident, FileIdent)
    assert status == 503 and "bankml_receipt" not in answer
    assert "changed since bankml verified it" in answer["error"]["message"]


# --- failures inside a run (a scripted engine: the real one does not fail on demand) -------------------


class _FailingEngine:
    """parse_request accepts anything; run_steps yields one chunk then raises."""

    n_ctx = N_CTX
    slot_tokens: list[int] = []

    def parse_request(self, body: dict, kind: str) -> Any:
        from bankml.engine_cupy.request import Request
        from bankml.engine_cupy.sampler import SamplerParams

        return Request(kind, [1, 2, 3], SamplerParams())

    def run_steps(self, request: Any, cancelled: Any) -> Any:
        from bankml.engine_cupy.schedule import Chunk

        yield Chunk("partial", None, True, 7)
        raise RuntimeError("the forward pass broke")


@pytest_twisted.ensureDeferred
async def test_an_engine_failure_is_an_sse_error_event_or_a_500(served: Served) -> None:
    broken = NativeEngine(
        _FailingEngine(),
        EngineBridge(reactor),
        served.native.verified,
        n_ctx=N_CTX,
        reactor=reactor,
    )
    listen_root, _ = build_native_roots(broken)
    port = listen_loopback(LoopbackSite(listen_root), "127.0.0.1:0")
    url = f"http://127.0.0.1:{port.getHost().port}/v1/chat/completions"
    try:
        status, _, data = await deferToThread(post, url, chat("hi", stream=True))
        whole_status, whole = await apost(url, chat("hi"))
    finally:
        await port.stopListening()
        broken.bridge.stop()
    events = sse_events(data)
    assert (
        status == 200
        and events[-1]["error"]["message"] == "the engine failed: the forward pass broke"
    )
    assert "[DONE]" not in events and not any(
        "bankml_receipt" in e for e in events if isinstance(e, dict)
    )
    assert whole_status == 500 and whole["error"]["type"] == "server_error"


# --- a slot across a restart ------------------------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_a_slot_saved_before_a_restart_restores_into_a_new_engine(served: Served) -> None:
    from bankml.engine_cupy import slots
    from bankml.engine_cupy.engine import Engine
    from bankml.native.run import prompt_steps

    url = served.url + "/v1/chat/completions"
    body = chat("What is a harbour?", max_tokens=4)
    await slot(served, "0", "erase")
    await apost(url, body)
    status, saved = await slot(served, "0", "save", {"filename": "restart.bin"})
    status, warm = await apost(url, body)  # the next answer on the slot as saved
    await slot(served, "0", "erase")
    status, empty = await apost(url, body)  # the answer from an empty slot
    # "Restart": a second Engine opened from the file, as a new bankml process would.
    fresh = await deferToThread(Engine.open, served.native.verified.path, n_ctx=N_CTX, device="cpu")
    done = await deferToThread(
        slots.restore_slot,
        fresh,
        str(served.slot_dir / "restart.bin"),
        served.native.verified.sha256,
    )
    assert (
        done.n_tokens == saved["n_saved"]
        and fresh.slot_tokens == served.native.engine.slot_tokens[: done.n_tokens]
    )

    def answer() -> tuple[str, int]:
        parsed = fresh.parse_request(body, "chat")
        *_, end = prompt_steps(fresh, [parsed])(lambda: False)
        return end.summary.text, end.summary.timings["cache_n"]

    text, cache_n = await deferToThread(answer)
    assert (text, cache_n) == (warm["choices"][0]["message"]["content"], warm["timings"]["cache_n"])
    assert text == empty["choices"][0]["message"]["content"]  # as from an empty slot
    # A slot from another context size is refused with the reason, and leaves the slot empty.
    data = bytearray((served.slot_dir / "restart.bin").read_bytes()[:-32])
    data[79:87] = (1024).to_bytes(8, "little")  # n_ctx, after the magic and the model sha256
    (served.slot_dir / "ctx.bin").write_bytes(bytes(data) + hashlib.sha256(bytes(data)).digest())
    with pytest.raises(
        slots.SlotError, match="saved with a 1024-token context, this engine has 2048"
    ):
        slots.restore_slot(fresh, str(served.slot_dir / "ctx.bin"), served.native.verified.sha256)
    assert fresh.slot_tokens == [] and fresh.cache.n_tokens == 0


@pytest_twisted.ensureDeferred
async def test_streamed_completion_endpoints_end_as_llama_server_ends_them(
    served: Served, reference_server: Any
) -> None:
    body = {"prompt": "Once upon a time", "n_predict": 3, "temperature": 0, "stream": True}
    for path, done in (("/completion", False), ("/v1/completions", True)):
        _, _, data = await deferToThread(post, served.engine_url + path, body)
        _, _, ref_data = await deferToThread(post, reference_server.url + path, body)
        events, ref_events = sse_events(data), sse_events(ref_data)
        assert (events[-1] == "[DONE]") == (ref_events[-1] == "[DONE]") == done
        ours = [e for e in events if isinstance(e, dict)]
        refs = [e for e in ref_events if isinstance(e, dict)]
        assert [i for i, e in enumerate(ours) if "bankml_receipt" in e] == [len(ours) - 1]
        assert set(ours[0]) >= set(refs[0]) - {"timings", "prompt_progress"}, set(refs[0]) - set(
            ours[0]
        )
        text = "".join(
            e["content"] if path == "/completion" else e["choices"][0]["text"] for e in ours
        )
        receipt = ours[-1]["bankml_receipt"]
        assert receipt["response_sha256"] == sha(text)
        if path == "/completion":  # a client reading content and stop from every event
            for events_of in (ours, refs):
                assert all("content" in e and "stop" in e for e in events_of), events_of
                assert [e["stop"] for e in events_of] == [False] * (len(events_of) - 1) + [True]
