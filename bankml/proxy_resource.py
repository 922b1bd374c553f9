"""P0: forwarding to llama-server, with a receipt on every completion answer.

- ``Forward(gateway)``: any other llama-server endpoint (``/health``, ``/props``, ``/tokenize``,
  ``/embedding``, ``/slots``, ``/metrics``, ...): the request's method, path, query, body and
  ``Content-Type``/``Authorization``/``Accept`` forwarded as they are, llama-server's status,
  headers (less hop-by-hop and CORS ones, which bankml's site decides) and body passed back,
  after the cheap checks (engine state, file identity).
- ``CompletionProxy(gateway, kind)``: the completion endpoints (bankml/proxy_answers.py names
  them and how each is read). Before forwarding: the engine state, the file identity, and the
  engine's ``/props`` ``model_path``. Then:

  * not streamed: the upstream JSON with ``bankml_receipt`` added (top-level; in each object of
    a several-prompt ``/completion`` list);
  * streamed (llama-server answers ``text/event-stream``): every upstream SSE event written to
    the client as soon as it is complete, bytes unchanged, the text, logprobs and counts
    collected on the way; the event that ends an answer (``stop: true`` on ``/completion``, the
    ``finish_reason`` chunk, the usage chunk when the request set
    ``stream_options.include_usage``, ``response.completed``, ``message_stop``) gains ``bankml_receipt`` as its last field, after the
    file is checked once more, so every event a client reads is a regular one;
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
import time
from collections.abc import Callable
from typing import Any

from twisted.internet.defer import CancelledError, Deferred, gatherResults, inlineCallbacks
from twisted.internet.error import ConnectError, ConnectionClosed
from twisted.internet.protocol import Protocol
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.client import ResponseDone, ResponseFailed, ResponseNeverReceived
from twisted.web.http import PotentialDataLoss
from twisted.web.server import NOT_DONE_YET, Request

from bankml.formats.errors import error_object
from bankml.formats.rerank import EMPTY_TEI
from bankml.p0 import gateway as gw
from bankml.p0.answers import (
    StreamReading,
    add_whole_receipts,
    completion_prompts,
    forwarded_request,
    request_object,
)
from bankml.p0.gateway import Gateway, UpstreamTooLarge, check_length
from bankml.receipts.embedding import Issuer, embedding_receipt, p0_receipts
from bankml.receipts.kinds import OAI_COMPLETION, RERANK
from bankml.receipts.rerank import (
    RerankMismatch,
    answer_prompt_tokens,
    answer_results,
    rerank_receipt,
)
from bankml.receipts.tally import Tally
from bankml.serving.writers import (
    SSE,
    JsonResource,
    gone,
    sse_event,
    write_error,
    write_json,
)

_log = Logger(namespace="bankml.proxy")

FORWARDED_REQUEST_HEADERS = (b"content-type", b"authorization", b"accept")
# not passed back: the connection's own, those bankml writes itself, and CORS (bankml's site's)
DROPPED_RESPONSE_HEADERS = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"transfer-encoding",
        b"content-length",
        b"server",
        b"date",
    }
)


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


# --- pass-through --------------------------------------------------------------------------------


def upstream_path(request: Request) -> str:
    """The request's path and query, as llama-server is asked them."""
    path = request.path.decode("ascii", "replace")
    query = request.uri.partition(b"?")[2]
    return path + ("?" + query.decode("ascii", "replace") if query else "")


def copy_response_headers(request: Request, response: Any) -> None:
    for name, values in response.headers.getAllRawHeaders():
        lower = name.lower()
        if lower in DROPPED_RESPONSE_HEADERS or lower.startswith(b"access-control-"):
            continue
        request.responseHeaders.setRawHeaders(name, values)


def write_failure(request: Request, gateway: Gateway, failure: Failure) -> None:
    status, message = upstream_failure_message(failure)
    write_error(request, status, message, gateway.retry_after_s if status == 503 else None)


def pass_through(request: Request, response: Any, raw: bytes) -> None:
    """llama-server's status, headers and body, as they came."""
    if gone(request):
        return
    request.setResponseCode(response.code)
    copy_response_headers(request, response)
    request.setHeader(b"content-length", str(len(raw)).encode())
    request.write(raw)
    request.finish()


class Forward(JsonResource):
    """Any request passed through to the same path on llama-server."""

    isLeaf = True

    def __init__(self, gateway: Gateway) -> None:
        super().__init__()
        self.gateway = gateway

    def render(self, request: Request) -> Any:
        body = request.content.read() if request.method not in (b"GET", b"HEAD") else None
        if refuse_unavailable(self.gateway, request):
            return NOT_DONE_YET
        self._forward(request, body)
        return NOT_DONE_YET

    @inlineCallbacks
    def _forward(self, request: Request, body: bytes | None) -> Any:
        method = b"GET" if request.method == b"HEAD" else request.method
        try:
            response = yield self.gateway.request(
                method, upstream_path(request), body=body, headers=forwarded_headers(request)
            )
            reader, body_d = read_bounded(response)
            request.notifyFinish().addErrback(lambda _: reader.abort())
            raw = yield body_d
        except Exception:
            write_failure(request, self.gateway, Failure())
            return
        pass_through(request, response, raw)


def gateway_issuer(gateway: Gateway) -> Issuer:
    """The Issuer of P0's embedding and rerank receipts: llama-server as the gateway knows it."""
    return Issuer(
        verified=gateway.verified,
        engine_name=gateway.engine_name,
        device=None,
        n_ctx=gateway.engine_n_ctx,
        cache_type=gateway.cache_type,
        key=gateway.receipt_key,
        engine_version=gateway.engine_build,
        engine_digest=gateway.engine_digest,
        log=gateway.receipt_log,
    )


class EmbeddingProxy(JsonResource):
    """An embedding or rerank (``kind`` RERANK) endpoint through to llama-server, its receipts
    added: the sha256 of each vector it sent (bankml/receipts/embedding.py), of the results it
    ranked (bankml/receipts/rerank.py: on Jina's object, or on the first result of TEI's
    array). An answer other than 200 JSON of its shape passes as it came (llama-server's
    refusals: no vector, no receipt), but a 200 rerank answer with no result to carry the
    receipt (TEI's empty array) is not passed (formats/rerank.py's 501)."""

    isLeaf = True

    def __init__(self, gateway: Gateway, kind: str) -> None:
        super().__init__()
        self.gateway = gateway
        self.kind = kind

    def render_POST(self, request: Request) -> Any:
        body = request.content.read()
        if not refuse_unavailable(self.gateway, request):
            self._answer(request, body)
        return NOT_DONE_YET

    @inlineCallbacks
    def _answer(self, request: Request, body: bytes) -> Any:
        started = time.monotonic()
        try:
            problem = yield self.gateway.check_engine_path()
            if problem is not None:
                write_error(request, 503, problem)
                return
            response = yield self.gateway.request(
                b"POST", upstream_path(request), body=body, headers=forwarded_headers(request)
            )
            reader, body_d = read_bounded(response)
            request.notifyFinish().addErrback(lambda _: reader.abort())
            raw = yield body_d
        except Exception:
            write_failure(request, self.gateway, Failure())
            return
        if gone(request):
            return
        try:
            answer = json.loads(raw) if response.code == 200 else None
        except ValueError:
            answer = None
        if answer is None:
            pass_through(request, response, raw)
            return
        problem = self.gateway.identity_problem()
        if problem is not None:
            write_error(request, 503, problem)
            return
        if self.kind == RERANK:
            self._rerank(request, response, raw, body, answer, started)
            return
        asked = request_object(body)
        normalize = asked.get("embd_normalize")
        issuer = gateway_issuer(self.gateway)

        def issue(vectors: list[list[float]], prompt_tokens: int | None) -> dict[str, Any]:
            return embedding_receipt(
                issuer,
                api=self.kind,
                request_body=body,
                started=started,
                vectors=vectors,
                inputs_tokens=None,
                prompt_tokens=prompt_tokens,
                pooling=None,
                embd_normalize=normalize if isinstance(normalize, int) else None,
            )

        if not p0_receipts(self.kind, answer, issue):
            pass_through(request, response, raw)
            return
        write_json(request, 200, json.dumps(answer, ensure_ascii=False).encode("utf-8"))

    def _rerank(
        self, request: Request, response: Any, raw: bytes, body: bytes, answer: Any, started: float
    ) -> None:
        """llama-server's rerank answer with its receipt (receipts/rerank.py)."""
        try:
            results = answer_results(answer)
        except RerankMismatch as err:
            write_error(request, 502, f"bankml gateway error: llama-server's rerank answer: {err}")
            return
        if isinstance(answer, dict):  # Jina's object
            holder = answer
        elif results:  # TEI's array: the first result carries the receipt
            holder = answer[0]
        else:  # TEI's empty array: no result to carry it
            write_error(request, 501, EMPTY_TEI, kind="not_supported_error")
            return
        out = rerank_receipt(
            gateway_issuer(self.gateway),
            request_body=body,
            started=started,
            results=results,
            pairs_tokens=None,
            prompt_tokens=answer_prompt_tokens(answer),
        )
        holder["bankml_receipt"] = out
        write_json(request, 200, json.dumps(answer, ensure_ascii=False).encode("utf-8"))


# --- completion endpoints ------------------------------------------------------------------------


def is_event_stream(response: Any) -> bool:
    content_type = (response.headers.getRawHeaders(b"content-type") or [b""])[-1]
    return content_type.split(b";")[0].strip().lower() == SSE


class CompletionProxy(JsonResource):
    """A completion endpoint through to llama-server, with the receipt added."""

    isLeaf = True

    def __init__(self, gateway: Gateway, kind: str) -> None:
        super().__init__()
        self.gateway = gateway
        self.kind = kind

    def render_POST(self, request: Request) -> Any:
        body = request.content.read()
        if not refuse_unavailable(self.gateway, request):
            self._answer(request, body).addErrback(self._unexpected, request)
        return NOT_DONE_YET

    def _unexpected(self, failure: Failure, request: Request) -> None:
        _log.failure("completion proxy failed", failure)
        if not request.startedWriting:
            write_error(request, 502, f"bankml gateway error: {failure.getErrorMessage()}")
        elif not request.finished:
            request.finish()

    @inlineCallbacks
    def _answer(self, request: Request, body: bytes) -> Any:
        # its clock starts with the request; a seed is drawn where the request named none
        reading = StreamReading(self.kind, body, forwarded=forwarded_request(body, self.kind))
        left = [False]
        request.notifyFinish().addErrback(lambda _: left.__setitem__(0, True))
        try:
            problem = yield self.gateway.check_engine_path()
        except Exception:
            write_failure(request, self.gateway, Failure())
            return
        if left[0]:
            return
        if problem is not None:
            write_error(request, 503, problem)
            return
        pending = self.gateway.request(
            b"POST", upstream_path(request), body=reading.sent, headers=forwarded_headers(request)
        )
        request.notifyFinish().addErrback(lambda _: pending.cancel())
        try:
            response = yield pending
        except CancelledError:
            return
        except Exception:
            write_failure(request, self.gateway, Failure())
            return
        if response.code == 200 and is_event_stream(response):
            yield self._stream(request, response, reading)
        else:
            yield self._whole(request, response, reading)

    @inlineCallbacks
    def _whole(self, request: Request, response: Any, reading: StreamReading) -> Any:
        reader, body_d = read_bounded(response)
        request.notifyFinish().addErrback(lambda _: reader.abort())
        try:
            raw = yield body_d
        except Exception:
            write_failure(request, self.gateway, Failure())
            return
        if response.code != 200:
            pass_through(request, response, raw)
            return
        try:
            answer = json.loads(raw)
        except ValueError:
            write_error(request, 502, "llama-server answered 200 with a body that is not JSON")
            return
        problem = self.gateway.identity_problem()
        if problem is not None:
            write_error(request, 503, problem)
            return

        def issue(tally: Tally) -> dict[str, Any]:
            return self.gateway.receipt(tally, ttft_measured=False)

        counts = yield self._later_prompt_counts(reading)
        if not add_whole_receipts(
            self.kind, answer, lambda: reading.tally(len(reading.tallies)), issue, counts
        ):
            pass_through(request, response, raw)  # not an answer of this kind: no receipt
            return
        write_json(request, 200, json.dumps(answer, ensure_ascii=False).encode("utf-8"))

    @inlineCallbacks
    def _later_prompt_counts(self, reading: StreamReading) -> Any:
        """A several-prompt /v1/completions request's prompt counts by prompt (None for the
        first, whose count the answer's usage gives), asked of the engine's /tokenize: the
        whole answer reports the first prompt's usage only. Empty for other requests."""
        if self.kind != OAI_COMPLETION:
            return []
        prompts = completion_prompts(request_object(reading.sent).get("prompt"))
        if len(prompts) < 2:
            return []
        later = yield gatherResults([self.gateway.prompt_token_count(p) for p in prompts[1:]])
        return [None, *later]

    def _stream(self, request: Request, response: Any, reading: StreamReading) -> Deferred[None]:
        relay = SSERelay(self.gateway, request, reading)
        reader = _BodyReader(relay.feed)
        relay.reader = reader
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
    """Forwards llama-server's SSE events as each one completes, and puts each answer's receipt
    inside the event that ends it (StreamReading says which). Every other event's bytes pass
    unchanged; that one gains only the field."""

    def __init__(self, gateway: Gateway, request: Request, reading: StreamReading) -> None:
        self.gateway = gateway
        self.request = request
        self.reading = reading
        self.reader: _BodyReader | None = None
        self.buffer = bytearray()
        self.event: list[bytes] = []
        self.event_size = 0
        self.receipts = 0  # receipts written
        self.done = False  # [DONE] seen and written
        self.errored = False  # an error event passed: no receipt after it
        self.stopped = False  # bankml ended the stream itself (the file changed)
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
        if self.stopped:
            return
        payloads = [line[5:].strip() for line in event.splitlines() if line.startswith(b"data:")]
        if payloads == [b"[DONE]"]:
            self.done = True
            self._write(event)
            return
        objects = [_json_object(payload) for payload in payloads]
        if any(obj is not None and "error" in obj for obj in objects):
            self.errored = True
        if self.errored or len(objects) != 1 or objects[0] is None:
            self._write(event)
            return
        ended = self.reading.event(objects[0])
        if ended is None:
            self._write(event)
            return
        problem = self.gateway.identity_problem()
        if problem is not None:
            self._error_event(problem)
            self.stopped = True
            if self.reader is not None:
                self.reader.abort()
            return
        self._write(with_receipt(event, self.gateway.receipt(ended)))
        self.receipts += 1

    def _write(self, data: bytes) -> None:
        if not gone(self.request):
            self.request.write(data)

    def _error_event(self, message: str) -> None:
        self._write(sse_event(error_object(502, message)))
        self.errored = True

    def _complete(self) -> bool:
        """Whether the stream reached its proper end."""
        if self.reading.ends_with_done:
            return self.done
        return self.receipts > 0 and len(self.reading.tallies) <= self.receipts

    def upstream_ended(self, failure: Failure | None) -> None:
        """The upstream body ended: cleanly after its last event, or not (died, refused, cut)."""
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
        if not self.stopped and (failure is not None or not self._complete()):
            if failure is not None and failure.check(UpstreamTooLarge):
                reason = str(failure.value)
            else:
                last = "[DONE]" if self.reading.ends_with_done else "its last event"
                reason = f"llama-server ended the stream before {last}"
                if failure is not None and failure.check(ResponseFailed, ConnectionClosed):
                    reason += " (connection lost)"
                elif failure is not None:
                    reason += f" ({failure.getErrorMessage()})"
            _log.warn("stream cut: {reason}", reason=reason)
            if not self.errored:
                self._error_event(reason)
        self.request.finish()


def _json_object(payload: bytes) -> dict[str, Any] | None:
    try:
        obj = json.loads(payload)
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None
