"""bankml ``--native`` inside the test process, and the clients the native tests ask it with.

- ``shared_served``: the NativeService tap starts for ``--native`` (one slot, n_ctx ``N_CTX``
  as the tests' llama-server), on ports 0; ``parallel_served``: the same with ``--parallel 4
  -kvu`` and ``--metrics``. Each starts once per test process and is shared by every module that
  asks (opening the engine is most of its cost); the reactor's shutdown stops it. Both give a
  ``Served``: the engine, bankml's address, the engine address and the slot directory.
- the engine alone, no HTTP: ``one_and_four_slots`` (a one-slot and a four-slot engine over one
  loaded model), ``run_alone`` (what a run yields alone on an idle one-slot engine, as
  ``recorded`` lists it), ``HeadlessControl`` (a run's flags with nobody on the reactor side),
  ``wait_for`` (a blocking wait on a condition, bounded by the hang guard).
- HTTP on loopback: ``post`` and ``get`` (blocking: run them in a thread), ``apost``,
  ``sse_events`` (a stream's payloads: JSON, or ``"[DONE]"``), ``stream_then_leave`` (a client
  that leaves at the first piece of text); request bodies ``chat`` and ``completion`` (greedy, two
  tokens) and ``seeded_chat`` (sampled with a seed, with log-probabilities).
- bankml beside llama-server: ``call`` and ``both`` (the same request to each), ``key_paths``,
  ``assert_same_keys``, ``receipt_free`` (a stream with bankml's receipt taken out of the event
  it rides in, checked to be there).
"""

from __future__ import annotations

import atexit
import http.client
import json
import shutil
import socket
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest_twisted
from twisted.internet import reactor
from twisted.internet.threads import deferToThread

from bankml.engine_cupy.engine import Engine
from bankml.native.resident import NativeEngine
from bankml.native.run import prompt_steps
from bankml.native.service import make_native_service
from bankml.serving.run_control import RunControl
from tests.events import HANG_GUARD_S

N_CTX = 2048  # the tests' llama-server's -c
N_SLOTS = 4


@dataclass
class Served:
    native: NativeEngine
    url: str  # bankml's own address (--listen)
    engine_url: str  # the engine address (--upstream), with /slots
    slot_dir: Path


_SHARED: list[Served] = []


def shared_served(model: Path, fork: Path) -> Served:
    """The NativeService tap starts for --native, on ports 0: verify, open the engine off the
    reactor, then bind both addresses. Started once per test process and shared by the native
    test modules (opening the engine is most of its cost); the reactor's shutdown closes it."""
    if not _SHARED:
        slot_dir = Path(tempfile.mkdtemp(prefix="bankml-slots-"))
        atexit.register(shutil.rmtree, slot_dir, True)
        svc = make_native_service(
            {
                "file": str(model),
                "fork": str(fork),
                "ctx": N_CTX,
                "device": "cpu",
                "listen": "127.0.0.1:0",
                "upstream": "127.0.0.1:0",
                "slot-dir": str(slot_dir),
                "llama": {"metrics": True},  # llama-server's --metrics: /metrics answers
            },
            reactor,
        )
        assert svc.compiling is not None, "the kernels did not start compiling during the hash"
        svc.exit_at_interpreter_end = False
        svc.startService()
        pytest_twisted.blockon(svc.ready)
        assert svc.native is not None and len(svc.ports) == 2, "the native service did not come up"
        reactor.addSystemEventTrigger("before", "shutdown", svc.stopService)
        urls = [f"http://127.0.0.1:{svc.port_of(i)}" for i in (0, 1)]
        _SHARED.append(Served(svc.native, urls[0], urls[1], slot_dir))
    return _SHARED[0]


_PARALLEL: list[Served] = []


def parallel_served(default_model: Path, default_fork: Path, tmp_path_factory: Any) -> Served:
    """``bankml serve --native --parallel 4 -kvu --ctx 2048 --metrics`` on ports 0, in this
    process (NativeService as tap starts it), one for the whole test run."""
    if not _PARALLEL:
        slot_dir = tmp_path_factory.mktemp("parallel-slots")
        svc = make_native_service(
            {
                "file": str(default_model),
                "fork": str(default_fork),
                "ctx": N_CTX,
                "device": "cpu",
                "listen": "127.0.0.1:0",
                "upstream": "127.0.0.1:0",
                "slot-dir": str(slot_dir),
                "llama": {"metrics": True, "n_parallel": N_SLOTS, "kv_unified": True},
            },
            reactor,
        )
        svc.exit_at_interpreter_end = False
        svc.startService()
        pytest_twisted.blockon(svc.ready)
        assert svc.native is not None and len(svc.ports) == 2
        reactor.addSystemEventTrigger("before", "shutdown", svc.stopService)
        urls = [f"http://127.0.0.1:{svc.port_of(i)}" for i in (0, 1)]
        _PARALLEL.append(Served(svc.native, urls[0], urls[1], Path(slot_dir)))
    return _PARALLEL[0]


# --- the engine alone -----------------------------------------------------------------------------


def one_and_four_slots(model: Path) -> tuple[Engine, Engine]:
    """(one slot, four slots) over one loaded model, each slot 2048 positions."""
    one = Engine.open(model, n_ctx=N_CTX, device="cpu")
    four = Engine(one.model, one.tokenizer, one.template, one.n_ctx, n_slots=N_SLOTS)
    return one, four


def run_alone(engine: Engine, kind: str, body: dict[str, Any]) -> list[Any]:
    """What one run yields on an idle one-slot engine from an empty slot: every chunk's token,
    text and logprob entry, then the summary's text, finish reason and tokens."""
    engine.slot_tokens = []
    engine.cache.truncate(0)
    request = engine.parse_request({"temperature": 0, **body}, kind)
    return recorded(list(prompt_steps(engine, [request])(lambda: False)))


def recorded(steps: list[Any]) -> list[Any]:
    out: list[Any] = []
    for step in steps:
        if step.chunk is not None:
            out.append((step.chunk.token, step.chunk.text, step.chunk.entry))
        elif step.summary is not None:
            s = step.summary
            out.append((s.text, s.finish_reason, s.tokens, s.completion_tokens))
    return out


class HeadlessControl(RunControl):
    """A run's flags with nobody on the reactor side: every item counts as delivered at once,
    unless the test pauses it."""


def wait_for(condition: Any, what: str) -> None:
    deadline = time.monotonic() + HANG_GUARD_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


# --- HTTP on loopback -----------------------------------------------------------------------------


def post(url: str, body: Any, raw: bytes | None = None) -> tuple[int, str, bytes]:
    """(status, content type, body) of a POST; blocking (run it in a thread)."""
    host, port = url.removeprefix("http://").split("/", 1)[0].split(":")
    path = "/" + url.removeprefix("http://").split("/", 1)[1]
    conn = http.client.HTTPConnection(host, int(port), timeout=HANG_GUARD_S)
    data = raw if raw is not None else json.dumps(body).encode()
    conn.request("POST", path, data, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    out = resp.status, resp.getheader("content-type") or "", resp.read()
    conn.close()
    return out


def get(url: str) -> tuple[int, str, bytes]:
    host, port = url.removeprefix("http://").split("/", 1)[0].split(":")
    path = "/" + url.removeprefix("http://").split("/", 1)[1]
    conn = http.client.HTTPConnection(host, int(port), timeout=HANG_GUARD_S)
    conn.request("GET", path)
    resp = conn.getresponse()
    out = resp.status, resp.getheader("content-type") or "", resp.read()
    conn.close()
    return out


async def apost(url: str, body: Any, raw: bytes | None = None) -> tuple[int, Any]:
    status, ctype, data = await deferToThread(post, url, body, raw)
    try:
        return status, json.loads(data)
    except ValueError:
        return status, data.decode("utf-8", "replace")


def sse_events(data: bytes) -> list[Any]:
    events = []
    for block in data.decode("utf-8").split("\n\n"):
        block = block.strip()
        if not block:
            continue
        assert block.startswith("data: "), block
        payload = block[len("data: ") :]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def stream_then_leave(url: str, body: dict[str, Any]) -> bytes:
    """Read a stream until its first piece of text, then close the connection."""
    host, port = url.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)), timeout=HANG_GUARD_S)
    data = json.dumps(body).encode()
    s.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        b"Content-Type: application/json\r\n"
        + f"Content-Length: {len(data)}\r\n\r\n".encode()
        + data
    )
    seen = b""
    while b'"content":"' not in seen:
        chunk = s.recv(4096)
        if not chunk:
            break
        seen += chunk
    s.close()
    return seen


def chat(content: str = "Name a colour.", **extra: Any) -> dict[str, Any]:
    return {
        "messages": [{"role": "user", "content": content}],
        "temperature": 0,
        "max_tokens": 2,
        **extra,
    }


def completion(prompt: str = "The capital of France is", **extra: Any) -> dict[str, Any]:
    return {"prompt": prompt, "n_predict": 2, "temperature": 0, **extra}


def seeded_chat(**extra: Any) -> dict[str, Any]:
    return {
        "messages": [{"role": "user", "content": "Tell me a joke."}],
        "temperature": 0.9,
        "seed": 41,
        "max_tokens": 12,
        "logprobs": True,
        "top_logprobs": 2,
        "cache_prompt": False,
        **extra,
    }


# --- bankml beside llama-server -------------------------------------------------------------------

RECEIPT = "bankml_receipt"
BANKML_ADDITIONS = {RECEIPT}  # top-level keys of any answer or event that llama-server never sends


def call(
    url: str, method: str, path: str, body: Any = None, raw: bytes | None = None
) -> tuple[int, str, Any]:
    """(status, content type, body as JSON or text) of one request; blocking (run it in a thread)."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=HANG_GUARD_S)
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    conn.request(
        method, path, data, {"Content-Type": "application/json"} if data is not None else {}
    )
    resp = conn.getresponse()
    payload = resp.read()
    conn.close()
    ctype = resp.getheader("content-type") or ""
    if ctype.startswith("text/event-stream"):
        return resp.status, ctype, sse_events(payload)
    try:
        return resp.status, ctype, json.loads(payload)
    except ValueError:
        return resp.status, ctype, payload.decode("utf-8", "replace")


async def both(
    ours: str, ref: Any, method: str, path: str, body: Any = None, raw: bytes | None = None
) -> tuple[tuple[int, str, Any], tuple[int, str, Any]]:
    """The same request to bankml (``ours``: a base URL) and to llama-server (``ref``)."""
    mine = await deferToThread(call, ours, method, path, body, raw)
    theirs = await deferToThread(call, ref.url, method, path, body, raw)
    return mine, theirs


def key_paths(obj: Any, prefix: str = "") -> set[str]:
    """Every key path of a JSON value: ``.a.b`` for objects, ``[]`` for list items (merged)."""
    out: set[str] = set()
    if isinstance(obj, dict):
        for key, value in obj.items():
            path = f"{prefix}.{key}"
            out.add(path)
            out |= key_paths(value, path)
    elif isinstance(obj, list):
        for value in obj:
            out |= key_paths(value, prefix + "[]")
    return out


def without_additions(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: v for k, v in obj.items() if k not in BANKML_ADDITIONS}
    return obj


def assert_same_keys(ours: Any, ref: Any, ignore: set[str] = frozenset()) -> None:
    mine, theirs = key_paths(without_additions(ours)) - ignore, key_paths(ref) - ignore
    assert mine == theirs, {
        "only bankml": sorted(mine - theirs),
        "only llama-server": sorted(theirs - mine),
    }


def receipt_free(events: list[Any]) -> list[Any]:
    """A stream's events with bankml's receipt taken out of the last regular event, where it
    rides (checked to be there, once: every other event is exactly llama-server's)."""
    dicts = [i for i, e in enumerate(events) if isinstance(e, dict)]
    receipts = [i for i in dicts if RECEIPT in events[i]]
    assert receipts == dicts[-1:], events
    last = {k: v for k, v in events[receipts[0]].items() if k != RECEIPT}
    assert last, "the receipt rides inside a regular event, never alone"
    return [last if i == receipts[0] else e for i, e in enumerate(events)]
