"""Ollama's routes on the native engine: thin Resources over ``OllamaRoutes`` (interfaces.py),
which native/ollama.py's ``OllamaHost`` satisfies.

- ``HEAD``/``GET /``: a line of text saying bankml is running;
- ``GET /api/version``, ``GET /api/tags``, ``GET /api/ps``, ``POST /api/show``: JSON objects;
- ``POST /api/chat``, ``POST /api/generate``: validated on the bridge's prepare thread, run on
  its engine thread; streamed as NDJSON (one object a line, the last with ``done: true``, the
  counts, ``bankml_cache_n`` and the receipt) unless ``stream: false``, then one object;
- ``/api/pull``, ``/api/push``: 400 with the reason (``/api/embed`` and ``/api/embeddings``:
  resources/embeddings.py);
  another ``/api`` path, or a route's other methods: 404 listing the routes.

Every refusal is Ollama's ``{"error": "..."}`` with its status; after a stream began, the error
is its last line (the status is already 200). The file's identity is checked before the final
object: changed during the run, the answer ends with a 503 error instead, and no receipt.
"""

from __future__ import annotations

import time
from typing import Any

from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.error import UnsupportedMethod
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Request

from bankml.formats.errors import RETRY_AFTER_S
from bankml.formats.ollama_wire import OllamaError, dumps, ndjson_line
from bankml.resources.interfaces import OllamaLines, OllamaRoutes
from bankml.serving.run_control import ClientGone, Overloaded, RunControl
from bankml.serving.writers import NDJSON, EventStream, gone, write_json

_log = Logger(namespace="bankml.ollama")

TEXT = b"text/plain; charset=utf-8"


def write_object(request: Request, status: int, obj: Any) -> None:
    write_json(request, status, dumps(obj))


def write_refusal(request: Request, err: OllamaError) -> None:
    if err.retry_after is not None:
        request.setHeader(b"retry-after", str(err.retry_after).encode())
    write_object(request, err.status, err.body())


def read_body(request: Request) -> bytes:
    return request.content.read() if request.content is not None else b""


class OllamaResource(Resource):
    """A leaf of Ollama's routes: another method, or a longer path, is Ollama's 404 (it routes
    on method and path), in its error shape."""

    isLeaf = True

    def __init__(self, host: OllamaRoutes) -> None:
        super().__init__()
        self.host = host

    def render(self, request: Request) -> Any:
        if request.postpath and request.postpath != [b""]:
            return Unknown(self.host).render(request)
        try:
            return super().render(request)
        except UnsupportedMethod:
            return Unknown(self.host).render(request)


class Running(OllamaResource):
    """``HEAD``/``GET /``."""

    def render_GET(self, request: Request) -> Any:
        body = self.host.root_text().encode("utf-8")
        request.setHeader(b"content-type", TEXT)
        request.setHeader(b"content-length", str(len(body)).encode())
        return body


class Listing(OllamaResource):
    """``GET /api/version``, ``/api/tags`` and ``/api/ps``: ``what`` names the host's method."""

    def __init__(self, host: OllamaRoutes, what: str) -> None:
        super().__init__(host)
        self.what = what

    def render_GET(self, request: Request) -> Any:
        write_object(request, 200, getattr(self.host, self.what)())
        return NOT_DONE_YET


class Show(OllamaResource):
    """``POST /api/show``."""

    def render_POST(self, request: Request) -> Any:
        try:
            write_object(request, 200, self.host.show(read_body(request)))
        except OllamaError as err:
            write_refusal(request, err)
        return NOT_DONE_YET


class Create(OllamaResource):
    """``POST /api/create`` (on the prepare thread: it verifies the base in full): its status
    lines as NDJSON, or ``{"status": "success"}`` with ``stream: false``."""

    def render_POST(self, request: Request) -> Any:
        d = self.host.bridge.prepare(self.host.create, read_body(request))
        d.addCallback(self._done, request)
        d.addErrback(_refused, request)
        return NOT_DONE_YET

    @staticmethod
    def _done(result: tuple[bool, list[str]], request: Request) -> None:
        streamed, lines = result
        if not streamed:
            write_object(request, 200, {"status": "success"})
            return
        events = EventStream(request, ndjson_line, NDJSON)
        events.write([{"status": line} for line in lines])
        events.finish()


class Copy(OllamaResource):
    """``POST /api/copy``: 200 with an empty body."""

    def render_POST(self, request: Request) -> Any:
        return _change(self.host.copy, self.host, request)


class Delete(OllamaResource):
    """``DELETE /api/delete``: 200 with an empty body."""

    def render_DELETE(self, request: Request) -> Any:
        return _change(self.host.delete, self.host, request)


def _change(job: Any, host: OllamaRoutes, request: Request) -> Any:
    d = host.bridge.prepare(job, read_body(request))
    d.addCallback(lambda _: _empty(request))
    d.addErrback(_refused, request)
    return NOT_DONE_YET


def _empty(request: Request) -> None:
    if not gone(request):
        request.setResponseCode(200)
        request.setHeader(b"content-length", b"0")
        request.finish()


def _refused(failure: Failure, request: Request) -> None:
    if gone(request):
        return
    err = failure.value
    if not isinstance(err, OllamaError):
        _log.failure("Ollama request failed", failure)
        err = OllamaError(500, f"bankml failed: {failure.getErrorMessage()}")
    write_refusal(request, err)


class Unknown(OllamaResource):
    """A route bankml does not answer: 400 for what it refuses (POST), else 404."""

    def render(self, request: Request) -> Any:
        path = request.path.decode("latin-1").rstrip("/")
        write_refusal(request, self.host.unknown(request.method.decode("latin-1"), path))
        return NOT_DONE_YET


class ApiBranch(Resource):
    """``/api``: its routes, and ``Unknown`` for anything else."""

    def __init__(self, host: OllamaRoutes) -> None:
        super().__init__()
        self.host = host

    def getChild(self, path: bytes, request: Request) -> Any:
        return Unknown(self.host)

    def render(self, request: Request) -> Any:
        return Unknown(self.host).render(request)


class Answer(OllamaResource):
    """``POST /api/chat`` (``kind`` "chat") and ``POST /api/generate`` ("generate")."""

    def __init__(self, host: OllamaRoutes, kind: str) -> None:
        super().__init__(host)
        self.kind = kind

    def render_POST(self, request: Request) -> Any:
        raw = read_body(request)
        bridge = self.host.bridge
        control = bridge.new_control()
        request.notifyFinish().addErrback(lambda _: control.cancel())
        d = bridge.prepare(self.host.prepare, self.kind, raw, time.time_ns())
        d.addCallback(self._start, request, control)
        d.addErrback(self._failed, request, None)
        return NOT_DONE_YET

    def _start(self, job: Any, request: Request, control: RunControl) -> Any:
        if gone(request):
            return None
        bridge = self.host.bridge
        if job.prepared.empty:  # only load or unload: one object, as Ollama answers it
            d = bridge.call(self.host.load_or_unload, job)
            d.addCallback(lambda obj: write_object(request, 200, obj))
            return d
        writer = LineWriter(request, self.host.new_run(job), control, self.host)
        d = bridge.stream(self.host.run(job), writer.item, control)
        d.addCallback(writer.end)
        d.addErrback(self._failed, request, writer)
        return d

    def _failed(self, failure: Failure, request: Request, writer: LineWriter | None) -> None:
        if failure.check(ClientGone) or gone(request):
            return
        if failure.check(Overloaded):  # never queued: Ollama's answer past OLLAMA_MAX_QUEUE
            request.setHeader(b"retry-after", str(RETRY_AFTER_S).encode())
            write_refusal(request, OllamaError(503, str(failure.value)))
            return
        err = failure.value
        if not isinstance(err, OllamaError):
            _log.failure("Ollama answer failed", failure)
            err = OllamaError(500, f"the engine failed: {failure.getErrorMessage()}")
        if writer is not None:
            writer.error(err)
        else:
            write_refusal(request, err)


class LineWriter:
    """One answer's NDJSON lines as the run's items arrive, or its one object at the end."""

    def __init__(
        self, request: Request, run: OllamaLines, control: RunControl, host: OllamaRoutes
    ) -> None:
        self.request = request
        self.run = run
        self.control = control
        self.host = host
        self.events = EventStream(
            request, ndjson_line, NDJSON, producer=control if run.stream else None
        )
        self.result: dict[str, Any] | None = None
        self.problem: str | None = None
        self.cancelled = False

    def item(self, item: Any) -> None:
        """A ``Ready``, a token's ``Step`` or the ``Finished`` item of the run."""
        stage = getattr(item, "stage", "token")  # a token's Step has no stage
        if stage == "ready":
            self.run.ready(item)
        elif stage == "finished":
            self._finished(item)
        else:
            self.events.write(self.run.on_chunk(item.chunk))

    def _finished(self, item: Any) -> None:
        summary = item.summary
        if summary.cancelled or gone(self.request):
            self.cancelled = True
            return
        if item.problem is not None:  # the file changed: no receipt
            self.problem = item.problem
            return
        if self.run.stream:
            self.events.write([*self.run.last_lines(), self.run.final(item)])
        else:
            self.result = self.run.final(item)
        self.host.record(self.run, summary)

    def end(self, _: Any = None) -> None:
        self.events.release()
        if self.problem is not None:
            self.error(OllamaError(503, self.problem))
            return
        if self.cancelled or gone(self.request):
            return
        if self.result is not None:
            write_object(self.request, 200, self.result)
        else:
            self.events.finish()

    def error(self, err: OllamaError) -> None:
        """Refused before a line was sent: the status and the object; after: the last line."""
        self.events.release()
        if gone(self.request):
            return
        if not self.events.started:
            write_refusal(self.request, err)
        else:
            self.events.finish(ndjson_line(err.body()))


def put_ollama_routes(root: Resource, host: OllamaRoutes) -> None:
    """Ollama's routes on ``root`` (a Branch): ``/`` and ``/api/...``."""
    root.putChild(b"", Running(host))
    api = ApiBranch(host)
    root.putChild(b"api", api)
    for name, what in ((b"version", "version"), (b"tags", "tags"), (b"ps", "ps")):
        api.putChild(name, Listing(host, what))
    api.putChild(b"show", Show(host))
    api.putChild(b"chat", Answer(host, "chat"))
    api.putChild(b"generate", Answer(host, "generate"))
    api.putChild(b"create", Create(host))
    api.putChild(b"copy", Copy(host))
    api.putChild(b"delete", Delete(host))
