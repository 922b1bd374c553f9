"""The embedding endpoints on the native engine: llama-server's ``POST /v1/embeddings``,
``/embedding``, ``/embeddings`` (``Embeddings``), its ``POST /rerank``, ``/reranking``,
``/v1/rerank``, ``/v1/reranking`` (``Rerank``) and Ollama's ``POST /api/embed``,
``/api/embeddings`` (``OllamaEmbed``).

Each request is read and tokenized on the bridge's prepare thread (a refusal is llama-server's
or Ollama's status and error object, nothing computed), computed on the engine thread (in turn
with the runs), and answered on the reactor thread with its receipt
(bankml/native/embed.py, bankml/native/rerank.py). The model file's identity is checked before and after: changed, the
answer is a 503 and no receipt.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.server import NOT_DONE_YET, Request

from bankml.formats.embeddings import ollama_error
from bankml.formats.errors import RETRY_AFTER_S, ApiError, error_body
from bankml.formats.nlohmann import dumps, loads_json
from bankml.formats.ollama_wire import dumps as ollama_dumps
from bankml.resources.ollama import Unknown
from bankml.resources.runs import read_json_object
from bankml.serving.run_control import Overloaded
from bankml.serving.writers import JsonResource, gone, write_json

_log = Logger(namespace="bankml.native")


class EmbeddingSource(Protocol):
    """What the endpoints ask (bankml/native/embed.py's ``Embedder``)."""

    native: Any

    def parse(self, body: dict[str, Any], raw: bytes, oai: bool, started: float) -> Any: ...

    def parse_ollama(
        self, body: dict[str, Any], raw: bytes, legacy: bool, started: float, started_ns: int
    ) -> Any: ...

    def compute(self, job: Any) -> Any: ...

    def job_problem(self, job: Any) -> str | None: ...

    def answer(self, job: Any) -> Any: ...


class RerankSource(Protocol):
    """What the rerank endpoint asks (bankml/native/rerank.py's ``Reranker``)."""

    native: Any

    def parse(self, body: dict[str, Any], raw: bytes, started: float) -> Any: ...

    def compute(self, job: Any) -> Any: ...

    def job_problem(self, job: Any) -> str | None: ...

    def answer(self, job: Any) -> Any: ...


class _EmbeddingResource(JsonResource):
    isLeaf = True

    def __init__(self, embedder: EmbeddingSource | RerankSource) -> None:
        super().__init__()
        self.embedder = embedder

    def _refuse(self, request: Request, err: ApiError) -> None:
        write_json(request, err.status, err.as_bytes())

    def _run(self, request: Request, parse: Any, *args: Any) -> None:
        native = self.embedder.native
        problem = native.identity_problem()
        if problem is not None:
            write_json(request, 503, error_body(503, problem))
            return
        bridge = native.bridge
        d = bridge.prepare(parse, *args)
        d.addCallback(self._queue, bridge)
        d.addCallback(self._answer, request)
        d.addErrback(self._failed, request)

    def _queue(self, job: Any, bridge: Any) -> Any:
        """The job computed in turn with the runs; refused past the queue's bound as a run is
        (``--max-queue`` runs waiting and every slot busy: 503 with Retry-After)."""
        overloaded = getattr(bridge, "overloaded", None)
        if overloaded is not None and overloaded():
            raise Overloaded(bridge.max_queue)
        return bridge.call(self.embedder.compute, job)

    def _answer(self, job: Any, request: Request) -> None:
        if gone(request):
            return
        problem = self.embedder.job_problem(job)  # the file of the model that computed it
        if problem is not None:
            write_json(request, 503, error_body(503, problem))
            return
        self._write(request, self.embedder.answer(job))

    def _write(self, request: Request, body: Any) -> None:
        write_json(request, 200, dumps(body))

    def _failed(self, failure: Failure, request: Request) -> None:
        if gone(request):
            return
        err = failure.value
        if isinstance(err, Overloaded):  # never queued: nothing computed
            err = ApiError.of(503, str(err))
            err.retry_after = RETRY_AFTER_S
        elif not isinstance(err, ApiError):  # a fault of bankml's own: logged with its trace
            _log.failure("embedding request failed", failure)
            err = ApiError.of(500, failure.getErrorMessage())
        if err.retry_after is not None:  # a busy server: when to ask again
            request.setHeader(b"retry-after", str(err.retry_after).encode())
        self._refuse(request, err)


class Embeddings(_EmbeddingResource):
    """``POST /v1/embeddings`` (``oai``: OpenAI's object) or ``/embedding``, ``/embeddings``
    (llama-server's array)."""

    def __init__(self, embedder: EmbeddingSource, oai: bool) -> None:
        super().__init__(embedder)
        self.oai = oai

    def render_POST(self, request: Request) -> Any:
        started = time.monotonic()
        try:
            raw, body = read_json_object(request)
        except ApiError as err:
            self._refuse(request, err)
            return NOT_DONE_YET
        self._run(request, self.embedder.parse, body, raw, self.oai, started)
        return NOT_DONE_YET


class Rerank(_EmbeddingResource):
    """``POST /rerank``, ``/reranking``, ``/v1/rerank``, ``/v1/reranking``."""

    def __init__(self, reranker: RerankSource) -> None:
        super().__init__(reranker)
        self.reranker = reranker

    def render_POST(self, request: Request) -> Any:
        started = time.monotonic()
        try:
            raw, body = read_json_object(request)
        except ApiError as err:
            self._refuse(request, err)
            return NOT_DONE_YET
        self._run(request, self.reranker.parse, body, raw, started)
        return NOT_DONE_YET


class OllamaEmbed(_EmbeddingResource):
    """``POST /api/embed`` or (``legacy``) ``/api/embeddings``, Ollama's error shape; another
    method, or a longer path, is the 404 of Ollama's routes (``host``: their OllamaRoutes)."""

    def __init__(self, embedder: EmbeddingSource, legacy: bool, host: Any = None) -> None:
        super().__init__(embedder)
        self.source = embedder
        self.legacy = legacy
        self.host = host

    def render(self, request: Request) -> Any:
        extra = request.postpath and request.postpath != [b""]
        if self.host is not None and (request.method != b"POST" or extra):
            return Unknown(self.host).render(request)
        return super().render(request)

    def render_POST(self, request: Request) -> Any:
        started, started_ns = time.monotonic(), time.time_ns()
        raw = request.content.read() if request.content is not None else b""
        if not raw.strip():
            self._refuse(request, ollama_error(400, "missing request body"))
            return NOT_DONE_YET
        try:
            body = loads_json(raw)
        except ValueError as err:
            self._refuse(request, ollama_error(400, str(err)))
            return NOT_DONE_YET
        if not isinstance(body, dict):
            self._refuse(request, ollama_error(400, "the request body must be an object"))
            return NOT_DONE_YET
        self._run(request, self.source.parse_ollama, body, raw, self.legacy, started, started_ns)
        return NOT_DONE_YET

    def _refuse(self, request: Request, err: ApiError) -> None:
        body = err.body
        if isinstance(body, dict) and isinstance(body.get("error"), dict):
            body = {"error": body["error"].get("message", "")}  # Ollama's shape
        write_json(request, err.status, ollama_dumps(body))

    def _write(self, request: Request, body: Any) -> None:
        write_json(request, 200, ollama_dumps(body))
