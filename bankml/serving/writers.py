"""How every bankml answer leaves: one JSON object, or a stream of events (SSE or NDJSON).

- ``write_json``: one whole answer with its Content-Length (never chunked); ``write_error``
  writes llama-server's error object (bankml/formats/errors.py) the same way.
- ``JsonResource``: a Resource whose method refusal is JSON too (405 with ``Allow``).
- ``EventStream``: one streamed answer. Its first write opens it (200, the content type,
  ``Cache-Control: no-cache``); each write frames its events (``sse_event``:
  ``data: <json>\\n\\n``, or ``ndjson_line``: ``<json>\\n``) and goes straight to the transport;
  ``finish`` ends it once, ``error`` ends it with an error event. With a ``producer`` (the
  run's ``RunControl``, serving/run_control.py) the transport's pauses reach the engine while
  the stream is open.

Nothing is written to a request whose client has gone (``gone``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from twisted.internet.interfaces import IPushProducer
from twisted.web.error import UnsupportedMethod
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Request

from bankml.formats.errors import error_body, error_object
from bankml.formats.nlohmann import dumps

JSON = b"application/json; charset=utf-8"
SSE = b"text/event-stream"
NDJSON = b"application/x-ndjson"


def gone(request: Request) -> bool:
    """The answer is over: finished, or the client closed its connection."""
    return bool(request.finished) or bool(getattr(request, "_disconnected", False))


def write_json(
    request: Request, status: int, body: bytes, extra: dict[bytes, bytes] | None = None
) -> None:
    """One whole JSON answer, with its Content-Length (so no chunked encoding)."""
    if gone(request):
        return
    request.setResponseCode(status)
    request.setHeader(b"content-type", JSON)
    request.setHeader(b"content-length", str(len(body)).encode())
    for name, value in (extra or {}).items():
        request.setHeader(name, value)
    request.write(body)
    request.finish()


def write_error(
    request: Request,
    status: int,
    message: str,
    retry_after: int | None = None,
    kind: str | None = None,
) -> None:
    """llama-server's error object as a whole answer (with Retry-After when given)."""
    extra = {b"retry-after": str(retry_after).encode()} if retry_after is not None else None
    write_json(request, status, error_body(status, message, kind), extra)


class JsonResource(Resource):
    """A Resource whose method refusal is JSON (405 with Allow), like every other bankml answer."""

    def render(self, request: Request) -> Any:
        try:
            return super().render(request)
        except UnsupportedMethod as err:
            allowed = b", ".join(err.allowedMethods)
            message = (
                f"method {request.method.decode('latin-1')} not allowed; use {allowed.decode()}"
            )
            write_json(request, 405, error_body(405, message), {b"allow": allowed})
            return NOT_DONE_YET


def sse_event(obj: Any) -> bytes:
    """One server-sent event carrying ``obj`` (``None`` is llama-server's ``data: null``)."""
    return b"data: " + dumps(obj) + b"\n\n"


def typed_sse_event(obj: Any) -> bytes:
    """One event of a Responses stream: ``{"event": NAME, "data": OBJECT}`` as an ``event:``
    line and a ``data:`` line; anything else (an error object) as ``sse_event``."""
    if isinstance(obj, dict) and obj.keys() == {"event", "data"}:
        return b"event: " + obj["event"].encode() + b"\ndata: " + dumps(obj["data"]) + b"\n\n"
    return sse_event(obj)


def anthropic_sse_event(obj: Any) -> bytes:
    """One event of a Messages stream, as ``typed_sse_event``; an error object is Anthropic's
    ``error`` event, as llama-server writes it."""
    if isinstance(obj, dict) and obj.keys() == {"error"}:
        return typed_sse_event({"event": "error", "data": obj["error"]})
    return typed_sse_event(obj)


def ndjson_line(obj: Any) -> bytes:
    return dumps(obj) + b"\n"


class EventStream:
    """One streamed answer on ``request``, framed by ``frame`` under ``content_type``."""

    def __init__(
        self,
        request: Request,
        frame: Callable[[Any], bytes] = sse_event,
        content_type: bytes = SSE,
        producer: IPushProducer | None = None,
    ) -> None:
        self.request = request
        self.frame = frame
        self.content_type = content_type
        self.started = False
        self.producer = producer
        if producer is not None:  # the transport's pauses reach the engine thread
            request.registerProducer(producer, True)

    def open(self) -> None:
        if not self.started:
            self.started = True
            self.request.setResponseCode(200)
            self.request.setHeader(b"content-type", self.content_type)
            self.request.setHeader(b"cache-control", b"no-cache")

    def write(self, events: list[Any]) -> None:
        """Frame and send these events (nothing when there are none)."""
        if events:
            self.write_raw(b"".join(self.frame(e) for e in events))

    def write_raw(self, data: bytes) -> None:
        if data and not gone(self.request):
            self.open()
            self.request.write(data)

    def release(self) -> None:
        """Unregister the producer: the engine is done with this stream."""
        if self.producer is not None and self.request.producer is not None:
            self.request.unregisterProducer()
        self.producer = None

    def finish(self, last: bytes = b"") -> None:
        """End the stream, ``last`` (such as ``data: [DONE]``) written first."""
        self.release()
        if not gone(self.request):
            if last:
                self.open()
                self.request.write(last)
            self.request.finish()

    def error(self, status: int, message: str) -> None:
        """End with llama-server's error object around ``message`` (``fail``)."""
        self.fail(status, error_object(status, message))

    def fail(self, status: int, body: dict[str, Any]) -> None:
        """End with the error ``body``: an event once the stream has begun, else the whole JSON
        answer with its status."""
        self.release()
        if gone(self.request):
            return
        if not self.started:
            write_json(self.request, status, dumps(body))
            return
        self.finish(self.frame(body))
