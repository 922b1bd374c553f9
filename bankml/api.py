"""The Python API: ``bankml.chat(request)`` and ``bankml.chat_stream(request)``.

The same answer and the same receipt as ``POST /v1/chat/completions`` on ``bankml serve --native``
for the same request, without HTTP or a reactor: the request is parsed and validated by the
engine, and the objects are built by the same ``ChatAnswer`` the HTTP endpoint uses
(bankml/formats/answer.py). Nothing here imports Twisted.

- ``chat(request)`` returns the non-streamed object (OpenAI's, with ``timings`` and
  ``bankml_receipt``), whatever ``stream`` says.
- ``chat_stream(request)`` yields the streamed events' objects, as the SSE ``data:`` lines carry
  them: the role delta, the content deltas, and the last chunk with ``usage``, ``timings`` and
  ``bankml_receipt`` (``[DONE]`` is not an object and is not yielded). Closing the
  iterator early stops the engine before its next token.

``request`` is a dict, or the exact bytes of a JSON body. ``request_sha256`` is the sha256 of
those bytes; for a dict it is of ``json.dumps(request).encode()`` (Python's default separators),
so the same dict sent over HTTP with ``json.dumps`` gets the same receipt.

The model: pass ``native=`` (a ``NativeEngine`` from ``open_native``), or let the first call open
``$BANKML_MODEL`` pinned in ``$BANKML_FORK`` (default ``<model>.FORK.json``), verified first.
Every call computes on one thread per NativeEngine, in turn: the server's engine thread when the
NativeEngine is being served (so API and HTTP requests queue together), else the NativeEngine's
own single thread. Calling from the reactor thread itself is not supported (it would block it).
A refusal raises ``ApiError`` with llama-server's status and error object.
"""

from __future__ import annotations

import json
import os
import queue
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar, cast

from bankml.formats.answer import ChatAnswer
from bankml.formats.answers import answers_for, merged
from bankml.formats.errors import ApiError
from bankml.formats.nlohmann import check_unicode, loads_json
from bankml.gate.verify import Refused, verify
from bankml.native.resident import NativeEngine, open_engine
from bankml.receipts.keys import SigningKey
from bankml.receipts.kinds import CHAT

__all__ = ["chat", "chat_stream", "open_native", "ApiError"]

T = TypeVar("T")

_default: NativeEngine | None = None
_default_lock = threading.Lock()
_executors: dict[int, ThreadPoolExecutor] = {}


def open_native(
    model: str,
    fork: str | None = None,
    *,
    n_ctx: int = 4096,
    device: str = "auto",
    cache_type: str | None = None,
    cache_ram: str | None = None,
    receipt_key: SigningKey | None = None,
    parallel: int = 1,
    kv_unified: bool = False,
) -> NativeEngine:
    """Verify ``model`` against its pin (guard, then sha256), then open the engine on it, with
    the KV cache type (``f16`` when None) and the host prompt cache's bound in MiB (the default
    when None). With ``receipt_key`` (``bankml.receipts.keys.load_key(FILE)``) every receipt is
    signed, as ``bankml serve`` signs them; without one they are unsigned. ``parallel`` slots
    (llama-server's -np; each ``n_ctx / parallel`` positions, all ``n_ctx`` with ``kv_unified``)
    keep several conversations' prompts for reuse; the calls still run one at a time."""
    try:
        verified = verify(model, fork or model + ".FORK.json")
    except Refused as err:
        raise ApiError.of(400, f"refuse: {err.reason}") from None
    if parallel < 1:
        raise ApiError.of(400, f"parallel {parallel}: a number of slots, at least 1")
    engine, device_name = open_engine(
        verified.path,
        n_ctx=n_ctx,
        device=device,
        cache_type=cache_type,
        cache_ram=cache_ram,
        n_slots=parallel,
        kv_unified=kv_unified,
    )
    return NativeEngine(
        engine, None, verified, n_ctx=engine.n_ctx, device=device_name, receipt_key=receipt_key
    )


def _default_native() -> NativeEngine:
    global _default
    with _default_lock:
        if _default is None:
            model = os.environ.get("BANKML_MODEL")
            if not model:
                raise ApiError.of(
                    400,
                    "no model: pass native=open_native(FILE, FORK) "
                    "or set BANKML_MODEL (and BANKML_FORK)",
                )
            # the default engine is configured from the environment, as `bankml serve` is
            _default = open_native(
                model,
                os.environ.get("BANKML_FORK"),
                cache_type=os.environ.get("BANKML_CACHE_TYPE"),
                cache_ram=os.environ.get("BANKML_CACHE_RAM"),
            )
        return _default


def _body(request: dict[str, Any] | bytes) -> tuple[bytes, dict[str, Any]]:
    """(raw bytes, object), read as the HTTP resource reads a body: strict JSON (a dict holding
    NaN or an infinity is not JSON either)."""
    try:
        if isinstance(request, (bytes, bytearray)):
            raw = bytes(request)
            obj = loads_json(raw)
        else:
            check_unicode(request)
            obj, raw = request, json.dumps(request, allow_nan=False).encode("utf-8")
    except ValueError as err:
        raise ApiError.of(400, f"the request body is not JSON: {err}") from None
    if not isinstance(obj, dict):
        raise ApiError.of(400, "the request body must be a JSON object")
    return raw, obj


def _on_engine_thread(native: NativeEngine, fn: Callable[[], T]) -> T:
    """Run ``fn`` where the engine runs: on the server's engine thread when this NativeEngine is
    being served (the reactor runs and we are not on it), else on this NativeEngine's own single
    thread. Either way one thread computes, in turn with every other job, so an answer never
    depends on the calling thread (the CPU BLAS thread setting is per thread)."""
    bridge = native.bridge
    if bridge is not None and bridge.can_wait_on():
        return bridge.call_and_wait(fn)
    return _executor(native).submit(fn).result()


def _executor(native: NativeEngine) -> ThreadPoolExecutor:
    with _default_lock:
        pool = _executors.get(id(native))
        if pool is None:
            pool = _executors[id(native)] = ThreadPoolExecutor(
                1, thread_name_prefix="bankml-api-engine"
            )
        return pool


def _prepare(
    native: NativeEngine, request: dict[str, Any] | bytes, stream: bool
) -> tuple[list[ChatAnswer], list[Any]]:
    """The answers to fill (one per completion, ``n`` on an engine with several slots) and
    their parsed requests (a refusal raises ApiError)."""
    raw, obj = _body(request)
    problem = native.identity_problem()
    if problem is not None:
        raise ApiError.of(503, problem)
    prompts = native.parse(obj, CHAT)
    return cast(list[ChatAnswer], answers_for(native, CHAT, raw, obj, prompts, stream)), prompts


def chat(request: dict[str, Any] | bytes, *, native: NativeEngine | None = None) -> dict[str, Any]:
    """The non-streamed answer to a /v1/chat/completions request, receipt included."""
    native = native or _default_native()
    answers, prompts = _prepare(native, request, stream=False)

    def work() -> list[tuple[dict[str, Any], Any]]:
        done = []
        for step in native.steps(prompts)(lambda: False):  # the completions in turn
            answer = answers[step.index]
            if step.summary is None:
                answer.on_chunk(step.chunk)
            else:
                done.append((answer.whole(step.summary), step.summary))
        if len(done) != len(answers):
            raise RuntimeError("the run ended without its summary")
        return done

    done = _on_engine_thread(native, work)
    for answer, (_, summary) in zip(answers, done):
        native.record(summary, answer.tally.ttft_ms(), answer.tally.wall_ms(), "api")
    return cast(dict[str, Any], merged(CHAT, [out for out, _ in done]))


_END = object()
STREAM_WINDOW = 8  # events computed ahead of the reader: a slow reader holds the engine


def chat_stream(
    request: dict[str, Any] | bytes, *, native: NativeEngine | None = None
) -> Iterator[dict[str, Any]]:
    """The streamed answer's event objects, the last one carrying ``bankml_receipt``."""
    native = native or _default_native()
    answers, prompts = _prepare(native, request, stream=True)
    events: queue.Queue[Any] = queue.Queue(STREAM_WINDOW)
    stop = threading.Event()

    def put(item: Any) -> None:
        while not stop.is_set():
            try:
                events.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def work() -> None:
        try:
            for step in native.steps(prompts)(stop.is_set):
                answer = answers[step.index]
                if step.summary is None:
                    for event in answer.on_chunk(step.chunk):
                        put(event)
                elif not step.summary.cancelled:
                    for event in answer.final_events(step.summary):
                        put(event)
                    native.record(
                        step.summary, answer.tally.ttft_ms(), answer.tally.wall_ms(), "api"
                    )
        except BaseException as err:  # handed to the reader, raised there
            put(err)
        finally:
            put(_END)

    threading.Thread(
        target=_on_engine_thread, args=(native, work), daemon=True, name="bankml-api-stream"
    ).start()
    try:
        while True:
            item = events.get()
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()  # closed early: the engine stops before its next token
