"""The Python API: ``bankml.chat(request)`` and ``bankml.chat_stream(request)``.

The same answer and the same receipt as ``POST /v1/chat/completions`` on ``bankml serve --native``
for the same request, without HTTP or a reactor: the request is parsed and validated by the
engine, run in the calling thread, and the objects are built by the same ``Answer`` the HTTP
resource uses (bankml/resources/openai.py).

- ``chat(request)`` returns the non-streamed object (OpenAI's, with ``timings`` and
  ``bankml_receipt``), whatever ``stream`` says.
- ``chat_stream(request)`` yields the streamed events' objects, as the SSE ``data:`` lines carry
  them: the role delta, the content deltas, the last chunk with ``usage`` and ``timings``, and
  ``{"bankml_receipt": ...}`` (``[DONE]`` is not an object and is not yielded). Closing the
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
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from bankml.bridge import NativeEngine

__all__ = ["chat", "chat_stream", "open_native", "ApiError"]

_default: NativeEngine | None = None
_default_lock = threading.Lock()
_executors: dict[int, ThreadPoolExecutor] = {}


class ApiError(Exception):
    """A request bankml will not answer: ``status`` and llama-server's error ``body``."""

    def __init__(self, status: int, body: dict[str, Any]) -> None:
        message = (
            body.get("error", {}).get("message", str(body)) if isinstance(body, dict) else str(body)
        )
        super().__init__(f"{status}: {message}")
        self.status = status
        self.body = body


def open_native(
    model: str,
    fork: str | None = None,
    *,
    n_ctx: int = 4096,
    device: str = "auto",
    cache_type: str | None = None,
) -> NativeEngine:
    """Verify ``model`` against its pin (guard, then sha256), then open the engine on it."""
    from bankml.engine_cupy import backend
    from bankml.engine_cupy.engine import Engine
    from bankml.verify import Refused, verify

    try:
        verified = verify(model, fork or model + ".FORK.json")
    except Refused as err:
        raise ApiError(
            400,
            {
                "error": {
                    "code": 400,
                    "message": f"refuse: {err.reason}",
                    "type": "invalid_request_error",
                }
            },
        ) from None
    engine = Engine.open(
        verified.path,
        n_ctx=n_ctx,
        device=device,
        cache_type=cache_type or os.environ.get("BANKML_CACHE_TYPE"),
        cache_ram=os.environ.get("BANKML_CACHE_RAM"),
    )
    device_name = backend.device_name(engine.model.xp) if hasattr(engine.model, "xp") else "cpu"
    return NativeEngine(engine, None, verified, n_ctx=engine.n_ctx, device=device_name)


def _default_native() -> NativeEngine:
    global _default
    with _default_lock:
        if _default is None:
            model = os.environ.get("BANKML_MODEL")
            if not model:
                raise ApiError(
                    400,
                    {
                        "error": {
                            "code": 400,
                            "type": "invalid_request_error",
                            "message": "no model: pass native=open_native(FILE, FORK) "
                            "or set BANKML_MODEL (and BANKML_FORK)",
                        }
                    },
                )
            _default = open_native(model, os.environ.get("BANKML_FORK"))
        return _default


def _body(request: dict[str, Any] | bytes) -> tuple[bytes, dict[str, Any]]:
    """(raw bytes, object), read as the HTTP resource reads a body: strict JSON (a dict holding
    NaN or an infinity is not JSON either)."""
    from bankml.resources.openai import loads_json

    try:
        if isinstance(request, (bytes, bytearray)):
            raw = bytes(request)
            obj = loads_json(raw)
        else:
            obj, raw = request, json.dumps(request, allow_nan=False).encode("utf-8")
    except ValueError as err:
        raise ApiError(
            400,
            {
                "error": {
                    "code": 400,
                    "message": f"the request body is not JSON: {err}",
                    "type": "invalid_request_error",
                }
            },
        ) from None
    if not isinstance(obj, dict):
        raise ApiError(
            400,
            {
                "error": {
                    "code": 400,
                    "message": "the request body must be a JSON object",
                    "type": "invalid_request_error",
                }
            },
        )
    return raw, obj


def _on_engine_thread(native: NativeEngine, fn: Any) -> Any:
    """Run ``fn`` where the engine runs: on the server's engine thread when this NativeEngine is
    being served (the reactor runs and we are not on it), else on this NativeEngine's own single
    thread. Either way one thread computes, in turn with every other job, so an answer never
    depends on the calling thread (the CPU BLAS thread setting is per thread)."""
    bridge = native.bridge
    if bridge is not None and bridge.reactor.running:
        from twisted.internet.threads import blockingCallFromThread
        from twisted.python.threadable import isInIOThread

        if not isInIOThread():
            return blockingCallFromThread(bridge.reactor, bridge.call, fn)
    return _executor(native).submit(fn).result()


def _executor(native: NativeEngine) -> ThreadPoolExecutor:
    with _default_lock:
        pool = _executors.get(id(native))
        if pool is None:
            pool = _executors[id(native)] = ThreadPoolExecutor(
                1, thread_name_prefix="bankml-api-engine"
            )
        return pool


def _prepare(native: NativeEngine, request: dict[str, Any] | bytes, stream: bool) -> Any:
    from bankml.engine_cupy.engine import RequestError
    from bankml.resources.openai import CHAT, Answer, refusal_of

    raw, obj = _body(request)
    problem = native.identity_problem()
    if problem is not None:
        raise ApiError(
            503, {"error": {"code": 503, "message": problem, "type": "unavailable_error"}}
        )
    try:
        parsed = native.engine.parse_request(obj, "chat")
    except RequestError as err:
        status, body = refusal_of(err)
        raise ApiError(status, json.loads(body)) from None
    return Answer(native, CHAT, raw, obj, parsed, stream=stream), parsed


def chat(request: dict[str, Any] | bytes, *, native: NativeEngine | None = None) -> dict[str, Any]:
    """The non-streamed answer to a /v1/chat/completions request, receipt included."""
    native = native or _default_native()
    answer, parsed = _prepare(native, request, stream=False)

    def work() -> dict[str, Any]:
        run = native.engine.run_steps(parsed)
        for chunk in run:
            answer.on_chunk(chunk)
        return answer.whole(run.summary), run.summary

    out, summary = _on_engine_thread(native, work)
    native.record(summary, answer.tally.ttft_ms(), answer.tally.wall_ms(), "api")
    return out


_END = object()
STREAM_WINDOW = 8  # events computed ahead of the reader: a slow reader holds the engine


def chat_stream(
    request: dict[str, Any] | bytes, *, native: NativeEngine | None = None
) -> Iterator[dict[str, Any]]:
    """The streamed answer's event objects, ending with ``{"bankml_receipt": ...}``."""
    native = native or _default_native()
    answer, parsed = _prepare(native, request, stream=True)
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
            run = native.engine.run_steps(parsed, stop.is_set)
            for chunk in run:
                for event in answer.on_chunk(chunk):
                    put(event)
            if not run.summary.cancelled:
                for event in answer.final_events(run.summary):
                    put(event)
                native.record(run.summary, answer.tally.ttft_ms(), answer.tally.wall_ms(), "api")
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
