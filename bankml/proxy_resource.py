"""P0: forwarding to llama-server, with a receipt on every chat answer.

- ``ProxyGet(gateway, path)``: ``GET /health``, ``/props``, ``/v1/models`` passed through (status,
  content type and body), after the cheap checks (engine state, file identity).
- ``ChatProxy(gateway)``: ``POST /v1/chat/completions``. Before forwarding: the engine state,
  the file identity, and the engine's ``/props`` ``model_path``. Then:

  * not streamed: the upstream JSON with a top-level ``bankml_receipt`` added;
  * streamed (``"stream": true``): every upstream SSE event written to the client once the next
    one is complete (bytes unchanged), the content deltas and the usage collected on the way;
    the last chunk before ``data: [DONE]`` (the usage chunk with ``include_usage``, else the
    one with ``finish_reason``) is held back until then and written with ``bankml_receipt``
    added as its last field, so every event a client reads is a regular chunk;
  * an upstream error status: passed through with its body, no receipt;
  * an upstream body, or one SSE line, over 64 MiB: refused before it is held (502, or an SSE
    error event when the stream has started);
  * the client going away: the upstream connection is closed, so llama-server stops generating;
  * the upstream going away mid-stream: one ``data: {"error": ...}`` event, then the end.

Upstream bodies are read with a small ``Protocol`` of our own (``_BodyReader``) rather than
``treq.collect``: it holds the upstream transport, so a client disconnect can close the upstream
connection at once, even while llama-server is still silent (prompt processing).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from twisted.internet.defer import CancelledError, Deferred, inlineCallbacks
from twisted.internet.error import ConnectError, ConnectionClosed
from twisted.internet.protocol import Protocol
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.client import ResponseDone, ResponseFailed, ResponseNeverReceived
from twisted.web.http import PotentialDataLoss
from twisted.web.server import NOT_DONE_YET, Request

from bankml import gateway as gw
from bankml.formats.errors import error_object
from bankml.gateway import Gateway, UpstreamTooLarge, check_length
from bankml.receipt import Tally
from bankml.receipts.answer import prompt_of_timings
from bankml.serving.vouch import forwarded_tally
from bankml.serving.writers import (
    JSON,
    SSE,
    JsonResource,
    gone,
    sse_event,
    write_error,
    write_json,
)

_log = Logger(namespace="bankml.proxy")

FORWARDED_REQUEST_HEADERS = (b"content-type", b"authorization", b"accept")


# --- small answers -------------------------------------------------------------------------------


def refuse_unavailable(gateway: Gateway, request: Request) -> bool:
    """Answer 503 (with Retry-After while the engine is starting or restarting) when no answer
    may be given now; True when it did."""
    problem = gateway.availability_problem()
    if problem is None:
        return False
    message, retry_after = problem
    write_error(request, 503, message, retry_after)
    return True


def upstream_failure_message(failure: Failure) -> tuple[int, str]:
    """The status and message for an upstream request that failed before any answer."""
    if failure.check(UpstreamTooLarge):
        return 502, str(failure.value)
    if failure.check(ValueError):
        return 502, f"llama-server answered something unreadable: {failure.getErrorMessage()}"
    if failure.check(ConnectError):
        return 503, f"llama-server is unreachable: {failure.getErrorMessage()}"
    if failure.check(ResponseFailed, ResponseNeverReceived, ConnectionClosed):
        return 503, "llama-server closed the connection before answering"
    if failure.check(CancelledError):
        return 503, "llama-server did not answer in time"
    return 502, f"llama-server failed: {failure.getErrorMessage()}"


def forwarded_headers(request: Request) -> dict[bytes, list[bytes]]:
    out: dict[bytes, list[bytes]] = {}
    for name in FORWARDED_REQUEST_HEADERS:
        values = request.requestHeaders.getRawHeaders(name)
        if values:
            out[name] = values
    return out


class _BodyReader(Protocol):
    """Reads an upstream body into `on_data`, bounded by nothing itself (the callers bound what
    they keep); `done` fires with None at the end, or errbacks when the connection broke."""

    def __init__(self, on_data: Callable[[bytes], None]) -> None:
        self.on_data = on_data
        self.done: Deferred[None] = Deferred()
        self.closed_by_us = False

    def dataReceived(self, data: bytes) -> None:
        if self.closed_by_us:
            return
        try:
            self.on_data(data)
        except Exception:
            self.abort()
            if not self.done.called:
                self.done.errback(Failure())

    def abort(self) -> None:
        """Close the upstream connection (the client left, or the body was refused)."""
        if not self.closed_by_us and self.transport is not None:
            self.closed_by_us = True
            self.transport.stopProducing()

    def connectionLost(self, reason: Failure) -> None:
        if self.done.called:
            return
        if reason.check(ResponseDone, PotentialDataLoss):
            self.done.callback(None)
        else:
            self.done.errback(reason)


def read_bounded(response: Any, limit: int | None = None) -> tuple[_BodyReader, Deferred[bytes]]:
    """The reader (to abort it) and the Deferred of the whole body, refused past `limit`
    (default gateway.MAX_UPSTREAM_BYTES, read at call time)."""
    limit = gw.MAX_UPSTREAM_BYTES if limit is None else limit
    parts: list[bytes] = []
    size = [0]

    def keep(data: bytes) -> None:
        size[0] += len(data)
        if size[0] > limit:
            raise UpstreamTooLarge("a body")
        parts.append(data)

    reader = _BodyReader(keep)
    response.deliverBody(reader)
    try:
        check_length(response, limit)
    except UpstreamTooLarge:
        reader.abort()  # not one byte of it is read
        reader.done.errback(Failure())
    return reader, reader.done.addCallback(lambda _: b"".join(parts))


# --- GET pass-through ----------------------------------------------------------------------------


class ProxyGet(JsonResource):
    """A GET passed through to the same path on llama-server."""

    isLeaf = True

    def __init__(self, gateway: Gateway, path: str) -> None:
        super().__init__()
        self.gateway = gateway
        self.path = path

    def render_GET(self, request: Request) -> Any:
        if refuse_unavailable(self.gateway, request):
            return NOT_DONE_YET
        self._forward(request)
        return NOT_DONE_YET

    @inlineCallbacks
    def _forward(self, request: Request) -> Any:
        query = request.uri.partition(b"?")[2]
        path = self.path + ("?" + query.decode("ascii", "replace") if query else "")
        try:
            response = yield self.gateway.request(b"GET", path, headers=forwarded_headers(request))
            reader, body_d = read_bounded(response)
            request.notifyFinish().addErrback(lambda _: reader.abort())
            body = yield body_d
        except Exception:
            status, message = upstream_failure_message(Failure())
            write_error(
                request, status, message, self.gateway.retry_after_s if status == 503 else None
            )
            return
        if gone(request):
            return
        request.setResponseCode(response.code)
        for name in (b"content-type",):
            for value in response.headers.getRawHeaders(name, []):
                request.setHeader(name, value)
        request.setHeader(b"content-length", str(len(body)).encode())
        request.write(body)
        request.finish()


# --- POST /v1/chat/completions -------------------------------------------------------------------


def wants_stream(body: bytes) -> bool:
    """Whether the request asks for SSE; a body that is not JSON is forwarded as it is, so
    llama-server's own 400 message reaches the client."""
    try:
        parsed = json.loads(body)
    except (ValueError, RecursionError):  # nested past the recursion limit: not JSON either
        return False
    return isinstance(parsed, dict) and parsed.get("stream") is True


def first_choice(obj: Any) -> dict[str, Any] | None:
    choices = obj.get("choices") if isinstance(obj, dict) else None
    if not isinstance(choices, list):
        return None
    for choice in choices:
        if isinstance(choice, dict) and choice.get("index", 0) == 0:
            return choice
    return None


def tally_counts(tally: Tally, obj: dict[str, Any]) -> None:
    """Token counts from `usage`, else from llama-server's `timings` (a stream sends usage only
    when asked with stream_options.include_usage, and timings always: the prompt is its
    ``prompt_n`` evaluated plus its ``cache_n`` reused, as usage counts it); the finish reason of
    choice 0 and `timings.cache_n`, for the signed receipt."""
    usage = obj.get("usage")
    if isinstance(usage, dict):
        tally.set_counts(usage.get("prompt_tokens"), usage.get("completion_tokens"))
    timings = obj.get("timings")
    if isinstance(timings, dict):
        if tally.prompt_tokens is None:
            tally.set_counts(prompt_of_timings(timings), None)
        if tally.completion_tokens is None:
            tally.set_counts(None, timings.get("predicted_n"))
        tally.set_end(None, timings.get("cache_n"))
    choice = first_choice(obj)
    if choice is not None:
        tally.set_end(choice.get("finish_reason"), None)


def tally_logprobs(tally: Tally, choice: dict[str, Any]) -> None:
    logprobs = choice.get("logprobs")
    if isinstance(logprobs, dict) and isinstance(logprobs.get("content"), list):
        tally.add_logprobs(logprobs["content"])


class ChatProxy(JsonResource):
    """POST /v1/chat/completions through to llama-server, with the receipt added."""

    isLeaf = True

    def __init__(self, gateway: Gateway) -> None:
        super().__init__()
        self.gateway = gateway

    def render_POST(self, request: Request) -> Any:
        body = request.content.read()
        tally = forwarded_tally(body, "chat")  # a seed drawn where the request named none
        if not refuse_unavailable(self.gateway, request):
            self._answer(request, body, tally).addErrback(self._unexpected, request)
        return NOT_DONE_YET

    def _unexpected(self, failure: Failure, request: Request) -> None:
        _log.failure("chat proxy failed", failure)
        if not request.startedWriting:
            write_error(request, 502, f"bankml gateway error: {failure.getErrorMessage()}")
        elif not request.finished:
            request.finish()

    @inlineCallbacks
    def _answer(self, request: Request, body: bytes, tally: Tally) -> Any:
        gone = [False]
        request.notifyFinish().addErrback(lambda _: gone.__setitem__(0, True))
        try:
            problem = yield self.gateway.check_engine_path()
        except Exception:
            status, message = upstream_failure_message(Failure())
            write_error(
                request, status, message, self.gateway.retry_after_s if status == 503 else None
            )
            return
        if gone[0]:
            return
        if problem is not None:
            write_error(request, 503, problem)
            return
        pending = self.gateway.request(
            b"POST",
            "/v1/chat/completions",
            body=tally.forwarded.body,
            headers=forwarded_headers(request),
        )
        request.notifyFinish().addErrback(lambda _: pending.cancel())
        try:
            response = yield pending
        except CancelledError:
            return
        except Exception:
            status, message = upstream_failure_message(Failure())
            write_error(
                request, status, message, self.gateway.retry_after_s if status == 503 else None
            )
            return
        if response.code == 200 and wants_stream(body):
            yield self._stream(request, response, tally)
        else:
            yield self._whole(request, response, tally)

    @inlineCallbacks
    def _whole(self, request: Request, response: Any, tally: Tally) -> Any:
        reader, body_d = read_bounded(response)
        request.notifyFinish().addErrback(lambda _: reader.abort())
        try:
            raw = yield body_d
        except Exception:
            status, message = upstream_failure_message(Failure())
            write_error(
                request, status, message, self.gateway.retry_after_s if status == 503 else None
            )
            return
        content_type = (response.headers.getRawHeaders(b"content-type") or [JSON])[-1]
        if response.code != 200:
            self._pass_through(request, response.code, content_type, raw)
            return
        try:
            answer = json.loads(raw)
        except ValueError:
            write_error(request, 502, "llama-server answered 200 with a body that is not JSON")
            return
        choice = first_choice(answer)
        if choice is None or not isinstance(answer, dict):
            self._pass_through(request, 200, content_type, raw)  # not a chat completion: no receipt
            return
        message = choice.get("message") if isinstance(choice.get("message"), dict) else {}
        content = message.get("content")
        tally.add_text(content if isinstance(content, str) else "")
        tally_logprobs(tally, choice)
        tally_counts(tally, answer)
        problem = self.gateway.identity_problem()
        if problem is not None:
            write_error(request, 503, problem)
            return
        answer["bankml_receipt"] = self.gateway.receipt(tally, ttft_measured=False)
        write_json(request, 200, json.dumps(answer, ensure_ascii=False).encode("utf-8"))

    @staticmethod
    def _pass_through(request: Request, status: int, content_type: bytes, raw: bytes) -> None:
        if gone(request):
            return
        request.setResponseCode(status)
        request.setHeader(b"content-type", content_type)
        request.setHeader(b"content-length", str(len(raw)).encode())
        request.write(raw)
        request.finish()

    def _stream(self, request: Request, response: Any, tally: Tally) -> Deferred[None]:
        relay = SSERelay(self.gateway, request, tally)
        reader = _BodyReader(relay.feed)
        response.deliverBody(reader)
        request.notifyFinish().addErrback(lambda _: reader.abort())
        return reader.done.addCallbacks(lambda _: relay.upstream_ended(None), relay.upstream_ended)


def with_receipt(event: bytes, r: dict[str, Any]) -> bytes:
    """One SSE event whose single ``data:`` line is a JSON object, with ``bankml_receipt`` added
    as its last top-level field; the upstream's bytes before it are kept as they are."""
    lines = event.split(b"\n")
    for i, line in enumerate(lines):
        if line.startswith(b"data:"):
            payload = line.rstrip(b"\r")
            tail = line[len(payload) :]
            close = payload.rstrip()
            empty = close[5:].strip() == b"{}"
            field = b'"bankml_receipt":' + json.dumps(r).encode()
            lines[i] = close[:-1] + (field if empty else b"," + field) + b"}" + tail
            break
    return b"\n".join(lines)


class SSERelay:
    """Forwards llama-server's SSE events and puts the receipt inside the last one before [DONE].

    One event is held back: the latest chunk that is a JSON object (with whatever followed it),
    written as soon as the next such chunk arrives, or at [DONE] with ``bankml_receipt`` added.
    Every other event's bytes pass unchanged; the held one gains only that field."""

    def __init__(self, gateway: Gateway, request: Request, tally: Tally) -> None:
        self.gateway = gateway
        self.request = request
        self.tally = tally
        self.buffer = bytearray()
        self.event: list[bytes] = []
        self.event_size = 0
        self.held: list[bytes] = []  # the last JSON-object chunk, then anything after it
        self.done = False  # [DONE] seen and written
        self.errored = False  # an error event passed: no receipt
        self.ended = False
        request.setResponseCode(200)
        request.setHeader(b"content-type", SSE)
        request.setHeader(b"cache-control", b"no-cache")

    # upstream bytes -> lines -> events
    def feed(self, data: bytes) -> None:
        if self.ended:
            return
        self.buffer += data
        start = 0
        while True:
            end = self.buffer.find(b"\n", start)
            if end < 0:
                break
            self._line(bytes(self.buffer[start : end + 1]))
            start = end + 1
        del self.buffer[:start]
        if len(self.buffer) + self.event_size > gw.MAX_UPSTREAM_BYTES:
            raise UpstreamTooLarge("an SSE event")

    def _line(self, line: bytes) -> None:
        self.event.append(line)
        self.event_size += len(line)
        if line.strip(b"\r\n"):
            return
        event, self.event, self.event_size = b"".join(self.event), [], 0
        self._event(event)

    def _event(self, event: bytes) -> None:
        payloads = [line[5:].strip() for line in event.splitlines() if line.startswith(b"data:")]
        if payloads == [b"[DONE]"]:
            self._finish_with_receipt(event)
            return
        objects = [self._collect(payload) for payload in payloads]
        if len(objects) == 1 and objects[0] is not None and "error" not in objects[0]:
            self._flush()  # a new last chunk: the one held so far is not the last
        elif not self.held:
            self._write(event)
            return
        self.held.append(event)

    def _collect(self, payload: bytes) -> dict[str, Any] | None:
        """Tally one payload; the object it holds, or None when it is not a JSON object."""
        try:
            obj = json.loads(payload)
        except ValueError:
            return None
        if not isinstance(obj, dict):
            return None
        if "error" in obj:
            self.errored = True
            return obj
        choice = first_choice(obj)
        if choice is not None:
            delta = choice.get("delta")
            if isinstance(delta, dict) and isinstance(delta.get("content"), str):
                self.tally.add_text(delta["content"])
            tally_logprobs(self.tally, choice)
        tally_counts(self.tally, obj)
        return obj

    def _flush(self) -> None:
        """Write what is held back, unchanged."""
        held, self.held = self.held, []
        if held:
            self._write(b"".join(held))

    def _finish_with_receipt(self, done_event: bytes) -> None:
        problem = self.gateway.identity_problem()
        if problem is not None:
            self._flush()
            self._error_event(problem)
            return
        if not self.errored and self.held:
            self.held[0] = with_receipt(self.held[0], self.gateway.receipt(self.tally))
        self._flush()
        self._write(done_event)
        self.done = True

    def _write(self, data: bytes) -> None:
        if not gone(self.request):
            self.request.write(data)

    def _error_event(self, message: str) -> None:
        self._write(sse_event(error_object(502, message)))
        self.errored = True

    def upstream_ended(self, failure: Failure | None) -> None:
        """The upstream body ended: cleanly after [DONE], or not (died, refused, cut)."""
        if self.ended:
            return
        self.ended = True
        if gone(self.request):
            return
        if (
            failure is not None
            and failure.check(UpstreamTooLarge)
            and not self.request.startedWriting
        ):
            write_error(self.request, 502, str(failure.value))
            return
        if not self.done:
            self._flush()
            if failure is not None and failure.check(UpstreamTooLarge):
                reason = str(failure.value)
            else:
                reason = "llama-server ended the stream before [DONE]"
                if failure is not None and failure.check(ResponseFailed, ConnectionClosed):
                    reason += " (connection lost)"
                elif failure is not None:
                    reason += f" ({failure.getErrorMessage()})"
            _log.warn("stream cut: {reason}", reason=reason)
            if not self.errored:
                self._error_event(reason)
        self.request.finish()
