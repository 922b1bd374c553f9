"""The P0 gateway's resources against the Twisted mock llama-server, over real loopback HTTP.

Fast cases, and the ones a real llama-server cannot be made to produce on demand (an error
status, a body over the limit, a connection dropped mid-stream). tests/test_serve_p0.py repeats
the main paths against the real llama-server.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import pytest_twisted
import treq
from twisted.internet import defer, reactor
from twisted.internet.task import Clock

from bankml.gate.fileident import FileIdent
from bankml.gate.guard import GuardResult
from bankml.gate.verify import Verified
from bankml.p0 import gateway as gw
from bankml.p0.gateway import Gateway, make_agent
from bankml.p0.routes import p0_root
from bankml.receipts.digest import canonical_logprobs
from bankml.receipts.vouch import FILE_CHANGED
from bankml.serving.site import LoopbackSite, listen_loopback
from bankml.usage import UsageSampler
from bankml.version import __version__
from tests.bankml_process import sha
from tests.events import until
from tests.mock_llama import PIECES, MockLlama, listen

CHAT = {"messages": [{"role": "user", "content": "Who knows?"}], "max_tokens": 8}
RECEIPT_FIELDS = [
    "bankml",
    "engine",
    "model_sha256",
    "guard",
    "prompt_tokens",
    "completion_tokens",
    "ttft_ms",
    "wall_ms",
    "response_sha256",
    "request_sha256",
    "signed",
]


@dataclass
class Front:
    mock: MockLlama
    gateway: Gateway
    sampler: UsageSampler
    url: str
    model: Path


@pytest.fixture
def front(tmp_path: Path):
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF not really a model, the mock never reads it")
    mock = MockLlama(model_path=str(model))
    mock_port = listen(mock)
    verified = Verified(
        str(model.resolve()),
        sha(model.read_bytes()),
        GuardResult("play"),
        FileIdent.of(model),
        time.time(),
        str(tmp_path / "FORK.json"),
    )
    gateway = Gateway(
        verified,
        ("127.0.0.1", mock_port.getHost().port),
        "upstream",
        make_agent(reactor),
        reactor,
        state=gw.READY,
    )
    sampler = UsageSampler(reactor, lambda: [("bankml serve", os.getpid())])
    port = listen_loopback(LoopbackSite(p0_root(gateway, sampler)), "127.0.0.1:0", reactor)
    yield Front(mock, gateway, sampler, f"http://127.0.0.1:{port.getHost().port}", model)
    pytest_twisted.blockon(
        defer.gatherResults(
            [
                defer.maybeDeferred(port.stopListening),
                defer.maybeDeferred(mock_port.stopListening),
                defer.maybeDeferred(gateway.close),
            ]
        )
    )


async def post(url: str, body: bytes, **kw: Any) -> Any:
    return await treq.post(url, data=body, headers={"Content-Type": "application/json"}, **kw)


async def chat(front: Front, obj: dict[str, Any]) -> tuple[Any, bytes, bytes]:
    body = json.dumps(obj).encode()
    response = await post(front.url + "/v1/chat/completions", body)
    return response, await response.content(), body


def events_of(raw: bytes) -> list[bytes]:
    return [e + b"\n\n" for e in raw.split(b"\n\n") if e]


# --- receipts ------------------------------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_non_streamed_answer_gets_a_receipt_of_its_text_and_request(front: Front) -> None:
    response, raw, body = await chat(front, CHAT)
    assert response.code == 200
    answer = json.loads(raw)
    r = answer["bankml_receipt"]
    assert list(r) == RECEIPT_FIELDS
    assert (
        r["response_sha256"]
        == sha("".join(PIECES))
        == sha(answer["choices"][0]["message"]["content"])
    )
    assert r["request_sha256"] == sha(body)
    # forwarded as sent, with the seed bankml drew appended (the request named none)
    forwarded = front.mock.requests[-1]
    assert forwarded.startswith(body[:-1] + b',"seed":') and forwarded.endswith(b"}")
    seed = json.loads(forwarded)["seed"]
    assert json.loads(forwarded) == {**CHAT, "seed": seed} and 0 <= seed < 2**32 - 1
    assert (r["prompt_tokens"], r["completion_tokens"]) == (7, 2)
    assert r["model_sha256"] == front.gateway.verified.sha256
    assert (r["bankml"], r["engine"], r["guard"], r["signed"]) == (
        __version__,
        "llama-server b0-mock",
        "play",
        False,
    )
    assert r["ttft_ms"] is None and r["wall_ms"] >= 0


def receipt_spliced_out(event: bytes, r: dict[str, Any]) -> bytes:
    """The event as llama-server wrote it: the ``bankml_receipt`` field the gateway added, taken
    out again."""
    field = b',"bankml_receipt":' + json.dumps(r).encode()
    assert event.count(field) == 1
    return event.replace(field, b"")


@pytest.mark.parametrize("usage", [False, True])
@pytest_twisted.ensureDeferred
async def test_streamed_events_pass_unchanged_and_the_receipt_rides_in_the_last_chunk(
    front: Front, usage: bool
) -> None:
    front.mock.pieces = ["Sav", "ante ", "knows", ". ✓"]
    options = {"stream_options": {"include_usage": True}} if usage else {}
    response, raw, body = await chat(front, {**CHAT, "stream": True, **options})
    assert response.code == 200
    assert response.headers.getRawHeaders(b"content-type") == [b"text/event-stream"]
    events = events_of(raw)
    assert events[-1] == b"data: [DONE]\n\n"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert all("choices" in c for c in chunks), "every event is a regular chunk"
    assert [i for i, c in enumerate(chunks) if "bankml_receipt" in c] == [len(chunks) - 1]
    last = chunks[-1]
    r = last["bankml_receipt"]
    assert list(last)[-1] == "bankml_receipt"  # added after llama-server's own fields
    if usage:  # the usage chunk is the last: no choices, usage and timings
        assert last["choices"] == [] and "usage" in last
    else:
        assert last["choices"][0]["finish_reason"] == "stop"
    assert list(r) == RECEIPT_FIELDS
    deltas = [c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]]
    assert r["response_sha256"] == sha("".join(deltas)) == sha("Savante knows. ✓")
    assert r["request_sha256"] == sha(body)
    assert (r["prompt_tokens"], r["completion_tokens"]) == (7, 4)
    assert isinstance(r["ttft_ms"], int)
    # every upstream event reaches the client byte for byte, the last with the receipt added
    upstream = front.mock.streamed[-1]
    assert b"".join(events[:-2]) + receipt_spliced_out(events[-2], r) + events[-1] == upstream


@pytest.mark.parametrize("stream", [False, True])
@pytest_twisted.ensureDeferred
async def test_logprobs_hash_covers_the_entries_in_order(front: Front, stream: bool) -> None:
    _, raw, _ = await chat(front, {**CHAT, "stream": stream, "logprobs": True})
    if stream:
        events = [json.loads(e[6:]) for e in events_of(raw)[:-1]]
        entries = [
            x
            for e in events
            if "choices" in e and e["choices"]
            for x in (e["choices"][0].get("logprobs") or {}).get("content", [])
        ]
        r = events[-1]["bankml_receipt"]
    else:
        answer = json.loads(raw)
        entries, r = answer["choices"][0]["logprobs"]["content"], answer["bankml_receipt"]
    assert len(entries) == len(PIECES)
    assert r["logprobs_sha256"] == sha(canonical_logprobs(entries))
    assert list(r)[-2:] == ["logprobs_sha256", "signed"]


@pytest_twisted.ensureDeferred
async def test_without_logprobs_there_is_no_logprobs_hash(front: Front) -> None:
    _, raw, _ = await chat(front, CHAT)
    assert "logprobs_sha256" not in json.loads(raw)["bankml_receipt"]


@pytest_twisted.ensureDeferred
async def test_stream_is_forwarded_as_it_arrives(front: Front) -> None:
    # The mock writes its next event only when the test advances its clock, which it does only
    # once the client holds the piece before: each event reached the client while upstream had
    # written it and nothing more, seen by order, whatever the machine's speed.
    pieces = ["a", "b", "c", "d"]
    clock = Clock()
    # a delay on the mock's clock: one advance, one event (a 0 s delay would run them all)
    front.mock.pieces, front.mock.reactor, front.mock.piece_delay = pieces, clock, 1.0
    answer = defer.ensureDeferred(
        post(
            front.url + "/v1/chat/completions",
            json.dumps({**CHAT, "stream": True}).encode(),
            unbuffered=True,
        )
    )
    await until(lambda: answer.called, "the answer to begin")
    response = await answer
    seen: list[bytes] = []
    done = treq.collect(response, seen.append)
    for i, piece in enumerate(pieces):
        event = f'"content": "{piece}"'.encode()
        await until(lambda e=event: e in b"".join(seen), f"piece {piece!r} to reach the client")
        written = [e for e in events_of(front.mock.streamed[0]) if b'"content": "' in e]
        assert len(written) == i + 1, "upstream wrote no more"
        assert not done.called and b"bankml_receipt" not in b"".join(seen)
        clock.advance(front.mock.piece_delay)  # upstream writes what comes next
    await done
    assert b"bankml_receipt" in b"".join(seen)


# --- errors passed through, refused, cut -------------------------------------------------------------


@pytest.mark.parametrize("status", [400, 500, 503])
@pytest_twisted.ensureDeferred
async def test_upstream_error_status_passes_through_without_receipt(
    front: Front, status: int
) -> None:
    front.mock.error_status = status
    for stream in (False, True):
        response, raw, _ = await chat(front, {**CHAT, "stream": stream})
        assert response.code == status
        assert json.loads(raw) == {
            "error": {"code": status, "message": "mock error", "type": "server_error"}
        }


@pytest_twisted.ensureDeferred
async def test_a_body_that_is_not_json_gets_the_engines_own_400(front: Front) -> None:
    response = await post(front.url + "/v1/chat/completions", b"{not json")
    assert response.code == 400
    assert json.loads(await response.content())["error"]["message"] == "Failed to parse JSON"
    assert front.mock.requests == [b"{not json"]


@pytest_twisted.ensureDeferred
async def test_body_declared_over_the_limit_is_refused_with_502(front: Front, monkeypatch) -> None:
    monkeypatch.setattr(gw, "MAX_UPSTREAM_BYTES", 1024)
    front.mock.declared_length = 1025
    response, raw, _ = await chat(front, CHAT)
    assert response.code == 502
    assert (
        json.loads(raw)["error"]["message"] == "llama-server sent a body over 1024 bytes: refused"
    )


@pytest_twisted.ensureDeferred
async def test_sse_line_over_the_limit_is_refused_before_it_is_held(
    front: Front, monkeypatch
) -> None:
    monkeypatch.setattr(gw, "MAX_UPSTREAM_BYTES", 1024)
    front.mock.long_line_bytes = 4096
    response, raw, _ = await chat(front, {**CHAT, "stream": True})
    assert response.code == 502
    assert "an SSE event over 1024 bytes" in json.loads(raw)["error"]["message"]


@pytest_twisted.ensureDeferred
async def test_upstream_dying_mid_stream_ends_the_client_stream_with_an_error(front: Front) -> None:
    front.mock.pieces, front.mock.die_after = ["one ", "two ", "three"], 1
    response, raw, _ = await chat(front, {**CHAT, "stream": True})
    events = events_of(raw)
    assert json.loads(events[1][6:])["choices"][0]["delta"]["content"] == "one "  # after the role
    last = json.loads(events[-1][6:])
    assert "before [DONE]" in last["error"]["message"]
    assert b"bankml_receipt" not in raw and b"data: [DONE]" not in raw


@pytest_twisted.ensureDeferred
async def test_client_going_away_closes_the_upstream_stream(front: Front) -> None:
    # the mock's clock never moves: its stream stays open after the first piece until closed
    front.mock.pieces, front.mock.reactor, front.mock.piece_delay = ["x"] * 50, Clock(), 1.0
    answer = defer.ensureDeferred(
        post(
            front.url + "/v1/chat/completions",
            json.dumps({**CHAT, "stream": True}).encode(),
            unbuffered=True,
        )
    )
    await until(lambda: answer.called, "the answer to begin")
    response = await answer

    class Leave(Exception):
        pass

    def leave(data: bytes) -> None:
        raise Leave()  # treq closes the connection when the collector raises

    with pytest.raises(Leave):
        await treq.collect(response, leave)
    await until(lambda: front.mock.cancelled > 0, "the upstream stream to be closed")
    assert front.mock.cancelled == 1 and front.mock.streamed[0].count(b'"content": "x"') == 1


# --- the checks before every answer ------------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_model_file_replaced_answers_503_without_receipt(front: Front) -> None:
    copy = front.model.with_suffix(".copy")
    shutil.copyfile(front.model, copy)
    os.replace(copy, front.model)  # same bytes, another inode
    for stream in (False, True):
        response, raw, _ = await chat(front, {**CHAT, "stream": stream})
        assert response.code == 503
        assert json.loads(raw)["error"]["message"] == FILE_CHANGED
        assert b"bankml_receipt" not in raw
    health = await treq.get(front.url + "/health")
    assert health.code == 503
    assert front.mock.requests == [], "nothing reached the engine"


@pytest_twisted.ensureDeferred
async def test_file_replaced_mid_stream_ends_it_with_an_error_not_a_receipt(front: Front) -> None:
    def replace_the_file() -> None:  # after the pieces, before the chunk the receipt rides in
        copy = front.model.with_suffix(".copy")
        shutil.copyfile(front.model, copy)
        os.replace(copy, front.model)

    front.mock.before_finish = replace_the_file
    response, raw, _ = await chat(front, {**CHAT, "stream": True})
    assert response.code == 200
    events = events_of(raw)
    assert [json.loads(e[6:])["choices"][0]["delta"].get("content") for e in events[1:3]] == PIECES
    assert json.loads(events[-1][6:])["error"]["message"] == FILE_CHANGED
    assert b"bankml_receipt" not in raw and b"[DONE]" not in raw


@pytest_twisted.ensureDeferred
async def test_engine_serving_another_path_answers_503(front: Front) -> None:
    front.mock.model_path = "/elsewhere/other.gguf"
    response, raw, _ = await chat(front, CHAT)
    assert response.code == 503
    assert "serves /elsewhere/other.gguf, not the verified" in json.loads(raw)["error"]["message"]
    assert front.mock.requests == []


@pytest_twisted.ensureDeferred
async def test_props_is_checked_before_every_chat_answer(front: Front) -> None:
    for _ in range(3):
        await chat(front, CHAT)
    assert front.mock.props_requests == 3


@pytest.mark.parametrize("state", [gw.DOWN, gw.STARTING])
@pytest_twisted.ensureDeferred
async def test_engine_down_answers_503_with_retry_after(front: Front, state: str) -> None:
    front.gateway.set_state(state, "restarting for the test")
    front.gateway.retry_after_s = 4
    for path in ("/health", "/v1/models"):
        response = await treq.get(front.url + path)
        assert response.code == 503
        assert response.headers.getRawHeaders(b"retry-after") == [b"4"]
    response, raw, _ = await chat(front, CHAT)
    assert response.code == 503 and response.headers.getRawHeaders(b"retry-after") == [b"4"]
    assert "restarting for the test" in json.loads(raw)["error"]["message"]


@pytest_twisted.ensureDeferred
async def test_unreachable_engine_answers_503_with_retry_after(front: Front) -> None:
    from tests.support import free_port

    front.gateway.upstream = ("127.0.0.1", free_port())
    for response in (await treq.get(front.url + "/health"), (await chat(front, CHAT))[0]):
        assert response.code == 503
        assert response.headers.getRawHeaders(b"retry-after") == [b"1"]
        assert "unreachable" in json.loads(await response.content())["error"]["message"]


# --- pass-through GETs, /bankml, 404 -----------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_gets_are_passed_through(front: Front) -> None:
    for path, want in (
        ("/health", {"status": "ok"}),
        ("/props", {"model_path": str(front.model), "build_info": "b0-mock"}),
    ):
        response = await treq.get(front.url + path)
        assert (response.code, json.loads(await response.content())) == (200, want)
    models = json.loads(await (await treq.get(front.url + "/v1/models")).content())
    assert models["data"][0]["id"] == "model.gguf"


@pytest_twisted.ensureDeferred
async def test_unknown_paths_and_methods_are_json_errors(front: Front) -> None:
    response = await treq.get(front.url + "/nope")
    assert response.code == 404
    assert json.loads(await response.content())["error"]["type"] == "not_found_error"
    # llama-server routes on method and path: another method is its 404 too, not HTTP's 405
    for response in (
        await post(front.url + "/health", b"{}"),
        await treq.get(front.url + "/v1/chat/completions"),
    ):
        assert response.code == 404
        assert json.loads(await response.content())["error"]["message"] == "File Not Found"
    assert front.mock.requests == []


@pytest_twisted.ensureDeferred
async def test_bankml_says_what_was_verified(front: Front) -> None:
    info = json.loads(await (await treq.get(front.url + "/bankml")).content())
    v = front.gateway.verified
    assert info["verified"]["sha256"] == info["model_sha256"] == v.sha256
    assert info["model"] == v.path and info["fork"] == v.fork_path
    assert info["upstream"] == front.gateway.upstream_text and info["mode"] == "upstream"
    assert info["engine"]["state"] == "ready" and info["bankml"] == __version__
    assert info["hashed_at"] == time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(v.verified_at))
    assert info["file_unchanged"] is True


@pytest_twisted.ensureDeferred
async def test_metrics_ring_is_empty_in_p0(front: Front) -> None:
    metrics = json.loads(await (await treq.get(front.url + "/bankml/metrics")).content())
    assert (metrics["kept"], metrics["keep"], metrics["records"]) == (0, 256, [])
    assert (metrics["prompt_tokens"], metrics["completion_tokens"]) == (0, 0)


@pytest_twisted.ensureDeferred
async def test_usage_is_sampled_once_for_concurrent_pollers(front: Front) -> None:
    assert front.sampler.keep == 1.0
    # Kept for an hour here, so the pollers share one sample however slow the machine is
    # (the second's expiry is checked below by a keep of 0, not by waiting).
    front.sampler.keep = 3600.0
    responses = await defer.gatherResults([treq.get(front.url + "/bankml/usage") for _ in range(5)])
    bodies = [json.loads(await r.content()) for r in responses]
    assert front.sampler.samples_taken == 1
    assert len({b["sampled_at"] for b in bodies}) == 1
    again = json.loads(await (await treq.get(front.url + "/bankml/usage")).content())
    assert again["sampled_at"] == bodies[0]["sampled_at"], "the kept sample"
    front.sampler.keep = 0.0
    await treq.get(front.url + "/bankml/usage")
    assert front.sampler.samples_taken == 2, "an expired sample is taken again"
    sample = bodies[0]
    assert sample["processes"][0]["pid"] == os.getpid() and sample["rss_bytes"] > 0
    # the 250 ms wait between the two readings, in ms; the upper bound only catches a wrong
    # unit, generous because a loaded machine's reactor may be late
    assert 200 <= sample["interval_ms"] < 60_000
    assert sample["mem_total_bytes"] > 0 and "gpus" in sample and "package_watts" in sample


@pytest_twisted.ensureDeferred
async def test_p0_serves_the_api_description_without_asking_the_engine(front: Front) -> None:
    response = await treq.get(front.url + "/openapi.json")
    body = await response.content()
    assert response.code == 200
    assert body == (Path(__file__).parent.parent / "bankml" / "openapi.json").read_bytes()
    assert front.mock.requests == []


@pytest_twisted.ensureDeferred
async def test_the_web_page_is_at_ui_of_the_listen_address(front: Front) -> None:
    """P0 serves bankml's web page at /ui (docs/modules/web.md); another method there is 404."""
    for path, kind in (("/ui", "text/html"), ("/ui/app.js", "text/javascript")):
        resp = await treq.get(front.url + path)
        body = await resp.content()
        assert resp.code == 200, path
        assert resp.headers.getRawHeaders("content-type") == [f"{kind}; charset=utf-8"]
        policy = resp.headers.getRawHeaders("content-security-policy")[0]
        assert "default-src 'self'" in policy and b"bankml" in body
    resp = await treq.post(front.url + "/ui", b"{}", headers={"Content-Type": "application/json"})
    assert resp.code == 404 and (await resp.json())["error"]["message"] == "File Not Found"
