"""Native OpenAI endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions``,
``GET /v1/models`` (and ``POST /completion``, llama-server's own, built on the same run).

Every request goes the same way (``NativeChat``):

1. the body is read as JSON (not an object: 400), the model file's identity is checked (changed
   since verify: 503, no receipt);
2. ``engine.parse_request`` runs on the bridge's prepare thread and validates everything before a
   token is computed; a refusal is llama-server's status and error object (the context limit's
   ``exceed_context_size_error`` body as the engine wrote it);
3. the run is queued on the engine thread; each Chunk comes back on the reactor thread;
4. not streamed: one JSON object (OpenAI's, with llama-server's ``timings``, ``logprobs`` when
   asked, and ``bankml_receipt``); streamed: server-sent events as llama-server writes them, the
   last chunk with ``usage`` and ``timings``, then ``data: {"bankml_receipt": ...}``, then
   ``data: [DONE]``; an error after the stream began is ``data: {"error": ...}``.

``Answer`` builds every object and event from the Chunks and the run's summary without Twisted,
so ``bankml.api.chat`` answers the same request with the same objects and the same receipt.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Callable, Iterator

from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.server import NOT_DONE_YET, Request

from bankml.bridge import ClientGone, NativeEngine, RunControl
from bankml.proxy_resource import JsonResource, error_body, write_json
from bankml.receipt import Tally, receipt

_log = Logger(namespace="bankml.openai")

CHAT, OAI_COMPLETION, LLAMA_COMPLETION = "chat", "oai_completion", "llama_completion"
ENGINE_KIND = {CHAT: "chat", OAI_COMPLETION: "completion", LLAMA_COMPLETION: "completion"}
SSE = b"text/event-stream"


def dumps(obj: Any) -> bytes:
    """JSON as llama-server (nlohmann) writes it: compact, UTF-8 kept as it is."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "surrogatepass")


def sse(obj: Any) -> bytes:
    return b"data: " + dumps(obj) + b"\n\n"


def error_object(status: int, message: str, kind: str | None = None) -> dict[str, Any]:
    return json.loads(error_body(status, message)) if kind is None else {
        "error": {"code": status, "message": message, "type": kind}}


def refusal_of(err: Exception) -> tuple[int, bytes]:
    """(status, JSON body) for the engine's RequestError: its own body when it wrote one (the
    context limit), else llama-server's error object around its message."""
    status = int(getattr(err, "status", 400))
    body = getattr(err, "body", None)
    if isinstance(body, dict):
        return status, dumps(body)
    return status, error_body(status, str(body if isinstance(body, str) else err))


def summary_steps(engine: Any, parsed: Any) -> Callable[[Callable[[], bool]], Iterator[Any]]:
    """The bridge's ``steps``: the engine's Chunks, then its summary as the generator's value."""

    def steps(cancelled: Callable[[], bool]) -> Iterator[Any]:
        run = engine.run_steps(parsed, cancelled)
        for chunk in run:
            yield chunk
        return run.summary

    return steps


# --- the answer, without Twisted -----------------------------------------------------------------


class Answer:
    """One answer's objects and events, built from Chunks and the summary; holds its Tally."""

    def __init__(self, native: NativeEngine, kind: str, body: bytes, request: dict[str, Any],
                 parsed: Any, clock: Callable[[], float] = time.monotonic, stream: bool | None = None) -> None:
        self.native = native
        self.kind = kind
        self.request = request
        self.parsed = parsed
        self.stream = request.get("stream") is True if stream is None else stream
        self.tally = Tally(request_body=body, clock=clock)
        self.model = request["model"] if isinstance(request.get("model"), str) else native.model_id
        self.id = ("chatcmpl-" if kind == CHAT else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.entries: list[dict[str, Any]] = []  # every logprob entry the engine gave, in order
        self.n_tokens = 0  # tokens generated so far
        self.first_seen = False
        self.wants_logprobs = int(getattr(parsed, "n_probs", 0) or 0) > 0

    # -- per chunk

    def on_chunk(self, chunk: Any) -> list[dict[str, Any]]:
        """Note one Chunk; return the streamed events it makes (none when not streaming)."""
        self.n_tokens += 1
        if chunk.text and self.tally.first_piece_at is None:
            self.tally.first_piece_at = self.tally.clock()  # TTFT, streamed or not
        if chunk.entry is not None:
            self.entries.append(chunk.entry)
        if not self.stream:
            return []
        if self.kind == CHAT:
            events = self._chat_deltas(chunk)
        elif self.kind == OAI_COMPLETION:
            events = self._completion_pieces(chunk)
        else:
            events = self._llama_pieces(chunk)
        return events

    def _base(self, obj: str) -> dict[str, Any]:
        return {"created": self.created, "id": self.id, "model": self.model,
                "system_fingerprint": self.native.build_info, "object": obj}

    def _chat_event(self, delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {"choices": [{"finish_reason": finish, "index": 0, "delta": delta}],
                **self._base("chat.completion.chunk")}

    def _chat_deltas(self, chunk: Any) -> list[dict[str, Any]]:
        events = []
        if not self.first_seen:  # OpenAI's (and llama-server's) opening role delta
            self.first_seen = True
            events.append(self._chat_event({"role": "assistant", "content": None}))
        if chunk.text:
            self.tally.add_text(chunk.text)
            events.append(self._chat_event({"content": chunk.text}))
        if chunk.entry is not None and events:  # an entry rides on its token's last delta
            events[-1]["choices"][0]["logprobs"] = {"content": [chunk.entry]}
            self.tally.add_logprobs([chunk.entry])
        return events

    def _completion_pieces(self, chunk: Any) -> list[dict[str, Any]]:
        if not chunk.text and chunk.entry is None:
            return []
        self.tally.add_text(chunk.text)
        logprobs = None
        if chunk.entry is not None:
            logprobs = {"content": [chunk.entry]}
            self.tally.add_logprobs([chunk.entry])
        return [{"choices": [{"text": chunk.text, "index": 0, "logprobs": logprobs, "finish_reason": None}],
                 **self._base("text_completion")}]

    def _llama_pieces(self, chunk: Any) -> list[dict[str, Any]]:
        if not chunk.text and chunk.entry is None:
            return []
        self.tally.add_text(chunk.text)
        event: dict[str, Any] = {"index": 0, "content": chunk.text,
                                 "tokens": [chunk.token] if chunk.token is not None else [],
                                 "stop": False, "id_slot": 0, "tokens_predicted": self.n_tokens,
                                 "tokens_evaluated": len(self.parsed.prompt_tokens)}
        if chunk.entry is not None:
            event["completion_probabilities"] = [chunk.entry]
            self.tally.add_logprobs([chunk.entry])
        return [event]

    # -- the end

    def usage(self, summary: Any) -> dict[str, Any]:
        cache_n = (summary.timings or {}).get("cache_n", 0)
        return {"completion_tokens": summary.completion_tokens, "prompt_tokens": summary.prompt_tokens,
                "total_tokens": summary.completion_tokens + summary.prompt_tokens,
                "prompt_tokens_details": {"cached_tokens": cache_n}}

    def final_logprobs(self, summary: Any) -> list[dict[str, Any]]:
        """Non-streamed: every entry, less a stop word's own tokens after a stop hit (llama-server
        drops the last len(tokenize(stop)) entries)."""
        entries = list(self.entries)
        word = getattr(summary, "stopping_word", "")
        if word:
            drop = min(len(entries), len(self.native.engine.tokenize(word)))
            entries = entries[:len(entries) - drop]
        return entries

    def whole(self, summary: Any) -> dict[str, Any]:
        """The non-streamed answer, receipt included."""
        self.tally.set_counts(summary.prompt_tokens, summary.completion_tokens)
        text = summary.text
        self.tally.add_text(text)
        entries = self.final_logprobs(summary) if self.wants_logprobs else []
        if entries:
            self.tally.add_logprobs(entries)
        if self.kind == CHAT:
            choice: dict[str, Any] = {"finish_reason": summary.finish_reason, "index": 0,
                                      "message": {"role": "assistant", "content": text}}
            if entries:
                choice["logprobs"] = {"content": entries}
            out = {"choices": [choice], **self._base("chat.completion"), "usage": self.usage(summary)}
        elif self.kind == OAI_COMPLETION:
            out = {"choices": [{"text": text, "index": 0,
                                "logprobs": {"content": entries} if entries else None,
                                "finish_reason": summary.finish_reason}],
                   **self._base("text_completion"), "usage": self.usage(summary)}
        else:
            out = self._llama_final(summary, text)
            if entries:
                out["completion_probabilities"] = entries
        out["timings"] = summary.timings
        out["bankml_receipt"] = self.receipt()
        return out

    def _llama_final(self, summary: Any, text: str) -> dict[str, Any]:
        timings = summary.timings or {}
        word = getattr(summary, "stopping_word", "")
        stop_type = ("word" if word else "eos") if summary.finish_reason == "stop" else "limit"
        return {"index": 0, "content": text, "tokens": [], "id_slot": 0, "stop": True,
                "model": self.model, "tokens_predicted": summary.completion_tokens,
                "tokens_evaluated": summary.prompt_tokens,
                "generation_settings": generation_settings(self.parsed, self.native),
                "prompt": self.parsed.prompt_text or "", "has_new_line": "\n" in text,
                "truncated": False, "stop_type": stop_type, "stopping_word": word,
                "tokens_cached": summary.prompt_tokens + summary.completion_tokens - 1
                if summary.completion_tokens else timings.get("cache_n", 0)}

    def final_events(self, summary: Any) -> list[dict[str, Any]]:
        """Streamed: the last chunk (finish reason, usage, timings), then the receipt event."""
        self.tally.set_counts(summary.prompt_tokens, summary.completion_tokens)
        if self.kind == CHAT:
            if not self.first_seen:
                self.first_seen = True
                events = [self._chat_event({"role": "assistant", "content": None})]
            else:
                events = []
            last = self._chat_event({}, summary.finish_reason)
        elif self.kind == OAI_COMPLETION:
            events = []
            last = {"choices": [{"text": "", "index": 0, "logprobs": None,
                                 "finish_reason": summary.finish_reason}], **self._base("text_completion")}
        else:
            events = []
            last = self._llama_final(summary, "")
        if self.kind != LLAMA_COMPLETION:
            last["usage"] = self.usage(summary)
        last["timings"] = summary.timings
        events.append(last)
        events.append({"bankml_receipt": self.receipt()})
        return events

    def receipt(self) -> dict[str, Any]:
        v = self.native.verified
        return receipt(self.tally, engine=self.native.engine_name, model_sha256=v.sha256,
                       guard=v.guard.verdict)


def generation_settings(parsed: Any, native: NativeEngine) -> dict[str, Any]:
    """/completion's ``generation_settings``: the sampler parameters the run used."""
    import dataclasses

    params = getattr(parsed, "sampler", None)
    out: dict[str, Any] = {"n_predict": getattr(parsed, "n_predict", -1)}
    if params is not None and dataclasses.is_dataclass(params):
        for key, value in dataclasses.asdict(params).items():
            out[key] = list(value) if isinstance(value, tuple) else value
    out["stop"] = list(getattr(parsed, "stop", ()))
    out["n_probs"] = getattr(parsed, "n_probs", 0)
    out["cache_prompt"] = getattr(parsed, "cache_prompt", True)
    return out


# --- the resource --------------------------------------------------------------------------------


def read_json_object(request: Request) -> tuple[bytes, dict[str, Any] | None, bytes | None]:
    """(raw body, the object, None) or (raw, None, the 400 error body)."""
    raw = request.content.read()
    try:
        obj = json.loads(raw)
    except ValueError as err:
        return raw, None, error_body(400, f"the request body is not JSON: {err}")
    if not isinstance(obj, dict):
        return raw, None, error_body(400, "the request body must be a JSON object")
    return raw, obj, None


def gone(request: Request) -> bool:
    return request.finished or bool(getattr(request, "_disconnected", False))


class NativeChat(JsonResource):
    """One endpoint kind (chat, OpenAI completion, llama-server completion) on the native engine."""

    isLeaf = True

    def __init__(self, native: NativeEngine, kind: str = CHAT) -> None:
        super().__init__()
        if kind not in ENGINE_KIND:
            raise ValueError(f"unknown kind {kind!r}")
        self.native = native
        self.kind = kind

    def render_POST(self, request: Request) -> Any:
        raw, obj, refusal = read_json_object(request)
        if refusal is not None:
            write_json(request, 400, refusal)
            return NOT_DONE_YET
        problem = self.native.identity_problem()
        if problem is not None:
            write_json(request, 503, error_body(503, problem))
            return NOT_DONE_YET
        control = self.native.bridge.new_control()
        request.notifyFinish().addErrback(lambda _: control.cancel())
        d = self.native.bridge.prepare(self.native.engine.parse_request, obj, ENGINE_KIND[self.kind])
        d.addCallback(self._run, request, raw, obj, control)
        d.addErrback(self._failed, request, control, None)
        return NOT_DONE_YET

    def _run(self, parsed: Any, request: Request, raw: bytes, obj: dict[str, Any],
             control: RunControl) -> Any:
        if gone(request):
            return None
        answer = Answer(self.native, self.kind, raw, obj, parsed)
        writer = _Writer(request, answer, control)
        d = self.native.bridge.stream(summary_steps(self.native.engine, parsed), writer.chunk, control)
        d.addCallback(writer.done)
        d.addErrback(self._failed, request, control, writer)
        return d

    def _failed(self, failure: Failure, request: Request, control: RunControl,
                writer: "_Writer | None") -> None:
        if failure.check(ClientGone) or gone(request):
            return
        from bankml.engine_cupy.engine import RequestError

        if failure.check(RequestError):
            status, body = refusal_of(failure.value)
            write_json(request, status, body)
            return
        _log.failure("native run failed", failure)
        message = f"the engine failed: {failure.getErrorMessage()}"
        if writer is not None and writer.started:
            writer.error(message)
        else:
            write_json(request, 500, error_body(500, message))


class _Writer:
    """Writes one answer to its request: SSE events as Chunks arrive, or one object at the end."""

    def __init__(self, request: Request, answer: Answer, control: RunControl) -> None:
        self.request = request
        self.answer = answer
        self.control = control
        self.started = False
        if answer.stream:  # the transport's pauses reach the engine thread
            request.registerProducer(control, True)

    def _open(self) -> None:
        if not self.started:
            self.started = True
            self.request.setResponseCode(200)
            self.request.setHeader(b"content-type", SSE)
            self.request.setHeader(b"cache-control", b"no-cache")

    def _write(self, events: list[dict[str, Any]]) -> None:
        if events and not gone(self.request):
            self._open()
            self.request.write(b"".join(sse(e) for e in events))

    def chunk(self, chunk: Any) -> None:
        self._write(self.answer.on_chunk(chunk))

    def done(self, summary: Any) -> None:
        if gone(self.request) or getattr(summary, "cancelled", False):
            self._release()
            return
        native = self.answer.native
        problem = native.identity_problem()
        if problem is not None:  # the file changed during the run: no receipt
            if self.answer.stream:
                self.error(problem, 503)
            else:
                write_json(self.request, 503, error_body(503, problem))
            return
        if self.answer.stream:
            self._write(self.answer.final_events(summary))
            # llama-server ends its own /completion stream without [DONE]; the OpenAI ones with it
            self._finish(b"" if self.answer.kind == LLAMA_COMPLETION else b"data: [DONE]\n\n")
        else:
            self._release()
            write_json(self.request, 200, dumps(self.answer.whole(summary)))
        tally = self.answer.tally
        native.record(summary, tally.ttft_ms(), tally.wall_ms(), self.answer.kind)

    def error(self, message: str, status: int = 500) -> None:
        self._open()
        self._finish(sse(error_object(status, message)))

    def _release(self) -> None:
        if self.answer.stream and self.request.producer is not None:
            self.request.unregisterProducer()

    def _finish(self, last: bytes) -> None:
        self._release()
        if not gone(self.request):
            if last:
                self.request.write(last)
            self.request.finish()


class ModelsResource(JsonResource):
    """``GET /v1/models``: the resident model, as llama-server lists it."""

    isLeaf = True

    def __init__(self, native: NativeEngine) -> None:
        super().__init__()
        self.native = native

    def render_GET(self, request: Request) -> Any:
        write_json(request, 200, dumps(models_object(self.native)))
        return NOT_DONE_YET


def models_object(native: NativeEngine) -> dict[str, Any]:
    engine = native.engine
    meta = {"vocab_type": 2, "n_vocab": getattr(engine, "n_vocab", None),
            "n_ctx_train": getattr(getattr(getattr(engine, "model", None), "hp", None), "n_ctx_train", None),
            "n_embd": getattr(getattr(getattr(engine, "model", None), "hp", None), "n_embd", None),
            "size": __import__("os").path.getsize(native.verified.path)}
    return {"models": [{"name": native.model_id, "model": native.model_id, "modified_at": "",
                        "size": "", "digest": "", "type": "model", "description": "", "tags": [""],
                        "capabilities": ["completion"], "parameters": "",
                        "details": {"parent_model": "", "format": "gguf", "family": "", "families": [""],
                                    "parameter_size": "", "quantization_level": ""}}],
            "object": "list",
            "data": [{"id": native.model_id, "object": "model", "created": int(native.started),
                      "owned_by": "bankML", "meta": meta}]}
