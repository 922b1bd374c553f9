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
import math
import struct
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.server import NOT_DONE_YET, Request

from bankml.bridge import ClientGone, NativeEngine, RunControl
from bankml.engine_cupy.json_schema_grammar import chat_schema_content
from bankml.proxy_resource import JsonResource, error_body, write_json
from bankml.receipt import Tally, receipt

_log = Logger(namespace="bankml.openai")

CHAT, OAI_COMPLETION, LLAMA_COMPLETION = "chat", "oai_completion", "llama_completion"
ENGINE_KIND = {CHAT: "chat", OAI_COMPLETION: "completion", LLAMA_COMPLETION: "completion"}
SSE = b"text/event-stream"


def dumps(obj: Any) -> bytes:
    """JSON as llama-server (nlohmann) writes it: compact, UTF-8 kept as it is, and a NaN or
    infinity written as null (never Python's NaN/Infinity, which are not JSON)."""
    try:
        text = json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except ValueError:  # rare: a non-finite float somewhere; walk the object only then
        text = json.dumps(
            finite_or_null(obj), ensure_ascii=False, separators=(",", ":"), allow_nan=False
        )
    return text.encode("utf-8", "surrogatepass")


def finite_or_null(obj: Any) -> Any:
    """``obj`` with every non-finite float replaced by None, as nlohmann's dump writes it."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite_or_null(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_or_null(v) for v in obj]
    return obj


def json_type(value: Any) -> str:
    """nlohmann's type_name() of a parsed JSON value, as its type errors print it."""
    return {bool: "boolean", str: "string", list: "array", dict: "object", type(None): "null"}.get(
        type(value), "number"
    )


def sse(obj: Any) -> bytes:
    return b"data: " + dumps(obj) + b"\n\n"


def error_object(status: int, message: str, kind: str | None = None) -> dict[str, Any]:
    return (
        json.loads(error_body(status, message))
        if kind is None
        else {"error": {"code": status, "message": message, "type": kind}}
    )


def refusal_of(err: Exception) -> tuple[int, bytes]:
    """(status, JSON body) for the engine's RequestError: its own body when it wrote one (the
    context limit), else llama-server's error object around its message."""
    status = int(getattr(err, "status", 400))
    body = getattr(err, "body", None)
    if isinstance(body, dict):
        return status, dumps(body)
    return status, error_body(status, str(body if isinstance(body, str) else err))


def include_usage(request: dict[str, Any]) -> bool:
    """``stream_options.include_usage`` (checked by the engine's parse, in llama-server's schema order)."""
    options = request.get("stream_options")
    return isinstance(options, dict) and options.get("include_usage") is True


def summary_steps(engine: Any, parsed: Any) -> Callable[[Callable[[], bool]], Iterator[Any]]:
    """The bridge's ``steps``: the engine's Chunks, then its summary as the generator's value."""

    def steps(cancelled: Callable[[], bool]) -> Iterator[Any]:
        run = engine.run_steps(parsed, cancelled)
        yield from run
        return run.summary

    return steps


# --- the answer, without Twisted -----------------------------------------------------------------


class Answer:
    """One answer's objects and events, built from Chunks and the summary; holds its Tally."""

    def __init__(
        self,
        native: NativeEngine,
        kind: str,
        body: bytes,
        request: dict[str, Any],
        parsed: Any,
        clock: Callable[[], float] = time.monotonic,
        stream: bool | None = None,
    ) -> None:
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
        # a chat schema's answer reaches the client as llama-server's chat parser leaves it: the
        # JSON value without blanks and ```json fence (streamed: as that content grows)
        constraint = getattr(parsed, "constraint", None)
        self.schema_answer = kind == CHAT and getattr(constraint, "kind", "") == "chat_schema"
        self.generated = ""  # the generated text so far, when it is a schema answer
        self.content_sent = ""

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
        return {
            "created": self.created,
            "id": self.id,
            "model": self.model,
            "system_fingerprint": self.native.build_info,
            "object": obj,
        }

    def _chat_event(self, delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {
            "choices": [{"finish_reason": finish, "index": 0, "delta": delta}],
            **self._base("chat.completion.chunk"),
        }

    def _chat_deltas(self, chunk: Any) -> list[dict[str, Any]]:
        events = []
        if not self.first_seen:  # OpenAI's (and llama-server's) opening role delta
            self.first_seen = True
            events.append(self._chat_event({"role": "assistant", "content": None}))
        text = chunk.text
        if self.schema_answer and text:
            self.generated += text
            content = chat_schema_content(self.generated)
            text = (
                content[len(self.content_sent) :] if content.startswith(self.content_sent) else ""
            )
            self.content_sent += text
        if text:
            self.tally.add_text(text)
            events.append(self._chat_event({"content": text}))
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
        return [
            {
                "choices": [
                    {"text": chunk.text, "index": 0, "logprobs": logprobs, "finish_reason": None}
                ],
                **self._base("text_completion"),
            }
        ]

    def _llama_pieces(self, chunk: Any) -> list[dict[str, Any]]:
        if not chunk.text and chunk.entry is None:
            return []
        self.tally.add_text(chunk.text)
        event: dict[str, Any] = {
            "index": 0,
            "content": chunk.text,
            "tokens": [chunk.token] if chunk.token is not None else [],
            # llama-server's partial results carry id_slot -1, its final one the slot
            "stop": False,
            "id_slot": -1,
            "tokens_predicted": self.n_tokens,
            "tokens_evaluated": len(self.parsed.prompt_tokens),
        }
        if chunk.entry is not None:
            event["completion_probabilities"] = [chunk.entry]
            self.tally.add_logprobs([chunk.entry])
        return [event]

    # -- the end

    def usage(self, summary: Any) -> dict[str, Any]:
        cache_n = (summary.timings or {}).get("cache_n", 0)
        return {
            "completion_tokens": summary.completion_tokens,
            "prompt_tokens": summary.prompt_tokens,
            "total_tokens": summary.completion_tokens + summary.prompt_tokens,
            "prompt_tokens_details": {"cached_tokens": cache_n},
        }

    def final_logprobs(self, summary: Any) -> list[dict[str, Any]]:
        """Non-streamed: every entry, less a stop word's own tokens after a stop hit (llama-server
        drops the last len(tokenize(stop)) entries)."""
        entries = list(self.entries)
        word = getattr(summary, "stopping_word", "")
        if word:
            drop = min(len(entries), len(self.native.engine.tokenize(word)))
            entries = entries[: len(entries) - drop]
        return entries

    def whole(self, summary: Any) -> dict[str, Any]:
        """The non-streamed answer, receipt included."""
        self.tally.set_counts(summary.prompt_tokens, summary.completion_tokens)
        text = chat_schema_content(summary.text) if self.schema_answer else summary.text
        self.tally.add_text(text)
        entries = self.final_logprobs(summary) if self.wants_logprobs else []
        if entries:
            self.tally.add_logprobs(entries)
        if self.kind == CHAT:
            choice: dict[str, Any] = {
                "finish_reason": summary.finish_reason,
                "index": 0,
                "message": {"role": "assistant", "content": text},
            }
            if entries:
                choice["logprobs"] = {"content": entries}
            out = {
                "choices": [choice],
                **self._base("chat.completion"),
                "usage": self.usage(summary),
            }
        elif self.kind == OAI_COMPLETION:
            out = {
                "choices": [
                    {
                        "text": text,
                        "index": 0,
                        "logprobs": {"content": entries} if entries else None,
                        "finish_reason": summary.finish_reason,
                    }
                ],
                **self._base("text_completion"),
                "usage": self.usage(summary),
            }
        else:
            out = self._llama_final(summary, text)
            if entries:
                out["completion_probabilities"] = entries
        out["timings"] = llama_timings(summary.timings)
        out["bankml_receipt"] = self.receipt()
        return out

    def _llama_final(self, summary: Any, text: str) -> dict[str, Any]:
        timings = summary.timings or {}
        word = getattr(summary, "stopping_word", "")
        stop_type = ("word" if word else "eos") if summary.finish_reason == "stop" else "limit"
        return {
            "index": 0,
            "content": text,
            "tokens": [],
            "id_slot": 0,
            "stop": True,
            "model": self.model,
            "tokens_predicted": summary.completion_tokens,
            "tokens_evaluated": summary.prompt_tokens,
            "generation_settings": generation_settings(self.parsed, self.native),
            "prompt": self.parsed.prompt_text or "",
            "has_new_line": "\n" in text,
            "truncated": False,
            "stop_type": stop_type,
            "stopping_word": word,
            "tokens_cached": summary.prompt_tokens + summary.completion_tokens - 1
            if summary.completion_tokens
            else timings.get("cache_n", 0),
        }

    def final_events(self, summary: Any) -> list[dict[str, Any]]:
        """Streamed: the last chunk (finish reason, usage, timings), then the receipt event.

        A chat asked with ``stream_options.include_usage`` ends as llama-server (and OpenAI) end
        it: the finish chunk alone, then a chunk with no choices carrying usage and timings.
        Without it llama-server's finish chunk carries timings only; bankml adds usage there (the
        issue's "the last chunk carries usage and timings")."""
        self.tally.set_counts(summary.prompt_tokens, summary.completion_tokens)
        events: list[dict[str, Any]] = []
        timings = llama_timings(summary.timings)
        if self.kind == CHAT:
            if not self.first_seen:
                self.first_seen = True
                events.append(self._chat_event({"role": "assistant", "content": None}))
            last = self._chat_event({}, summary.finish_reason)
            if include_usage(self.request):
                events.append(last)
                last = {**self._chat_event({}), "choices": []}
        elif self.kind == OAI_COMPLETION:
            last = {
                "choices": [
                    {
                        "text": "",
                        "index": 0,
                        "logprobs": None,
                        "finish_reason": summary.finish_reason,
                    }
                ],
                **self._base("text_completion"),
            }
        else:
            last = self._llama_final(summary, "")
        if self.kind != LLAMA_COMPLETION:
            last["usage"] = self.usage(summary)
        last["timings"] = timings
        events.append(last)
        events.append({"bankml_receipt": self.receipt()})
        return events

    def receipt(self) -> dict[str, Any]:
        v = self.native.verified
        return receipt(
            self.tally, engine=self.native.engine_name, model_sha256=v.sha256, guard=v.guard.verdict
        )


# llama-server's task_params::to_json, in its key order: (key, whether llama.cpp holds it as a C
# float). The SamplerParams fields carry the same names. /props' default_generation_settings.params
# (to_json(only_metrics=true)) leaves out dry_sequence_breakers, stop, logit_bias and the grammar
# fields, which generation_settings adds between these runs for a task.
_SAMPLING_HEAD = (
    ("seed", False),
    ("temperature", True),
    ("dynatemp_range", True),
    ("dynatemp_exponent", True),
    ("top_k", False),
    ("top_p", True),
    ("min_p", True),
    ("top_n_sigma", True),
    ("xtc_probability", True),
    ("xtc_threshold", True),
    ("typical_p", True),
    ("repeat_last_n", False),
    ("repeat_penalty", True),
    ("presence_penalty", True),
    ("frequency_penalty", True),
    ("dry_multiplier", True),
    ("dry_base", True),
    ("dry_allowed_length", False),
    ("dry_penalty_last_n", False),
)
_MIROSTAT = (
    ("mirostat", False),
    ("mirostat_tau", True),
    ("mirostat_eta", True),
    ("adaptive_target", True),
    ("adaptive_decay", True),
)


def c_float(value: Any) -> Any:
    """A C ``float`` as nlohmann writes it: widened to double (0.8 -> 0.800000011920929);
    infinities and NaN (and doubles beyond a float's range, which become infinities) are null."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return value
    try:
        widened = struct.unpack("<f", struct.pack("<f", float(value)))[0]
    except OverflowError:
        return None
    return widened if math.isfinite(widened) else None


def _sampling_values(params: Any, table: tuple[tuple[str, bool], ...]) -> dict[str, Any]:
    return {
        key: c_float(getattr(params, key)) if is_float else getattr(params, key)
        for key, is_float in table
    }


def logit_bias_entries(biases: Any) -> list[dict[str, Any]]:
    """format_logit_bias: ``{"bias", "token"}`` objects, -inf (a banned token) written as null."""
    return [{"bias": c_float(b.bias), "token": b.token} for b in biases]


def generation_settings(
    parsed: Any, native: NativeEngine, only_metrics: bool = False
) -> dict[str, Any]:
    """llama-server's ``task_params::to_json``: /completion's ``generation_settings`` (the
    parameters the run used), or with ``only_metrics`` /props' ``default_generation_settings.params``
    (the defaults, without stop, logit_bias and the grammar fields). Same keys, same order, floats
    as llama.cpp's C floats print."""
    params = parsed.sampler
    options = getattr(parsed, "options", None) or {}
    n_predict = getattr(parsed, "n_predict", -1)
    out = _sampling_values(params, _SAMPLING_HEAD)
    if not only_metrics:
        out["dry_sequence_breakers"] = list(params.dry_sequence_breakers)
    out.update(_sampling_values(params, _MIROSTAT))
    if not only_metrics:
        out["stop"] = list(getattr(parsed, "stop", ()))
    out.update(
        {
            "max_tokens": n_predict,
            "n_predict": n_predict,
            "n_keep": options.get("n_keep", 0),
            "n_discard": options.get("n_discard", 0),
            "ignore_eos": bool(getattr(params, "ignore_eos", False)),
            "stream": bool(options.get("stream", False)),
        }
    )
    if not only_metrics:
        out["logit_bias"] = logit_bias_entries(getattr(params, "logit_bias", ()))
    out.update({"n_probs": getattr(parsed, "n_probs", 0), "min_keep": params.min_keep})
    if not only_metrics:
        constraint = getattr(parsed, "constraint", None)
        # llama-server shows its GBNF; a JSON schema it converts to GBNF first, which bankml does
        # not (llguidance takes the schema itself), so only a GBNF grammar is shown
        out.update(
            {
                "grammar": constraint.source
                if constraint is not None and constraint.kind == "gbnf"
                else "",
                "grammar_lazy": False,
                "grammar_triggers": [],
                "preserved_tokens": [],
            }
        )
    out.update(
        {
            "chat_format": "Content-only",
            # the server's --reasoning-format (default auto, shown as deepseek) reaches a task,
            # not the defaults /props shows
            "reasoning_format": "none" if only_metrics else "deepseek",
            "reasoning_in_content": False,
            "generation_prompt": "",
            "samplers": list(params.samplers),
            "speculative.types": "none",
            "timings_per_token": bool(options.get("timings_per_token", False)),
            "post_sampling_probs": bool(getattr(parsed, "post_sampling_probs", False)),
            "backend_sampling": bool(options.get("backend_sampling", False)),
            "lora": [],
        }
    )
    return out


def llama_timings(timings: dict[str, Any] | None) -> dict[str, Any] | None:
    """The engine's timings with llama-server's per-token times added, in its key order
    (server_slot_stats::to_json). A per-token time is null where its count or time is 0, as the
    rates are (llama-server writes 0.0 there)."""
    if timings is None:
        return None
    t = dict(timings)

    def per_token(ms: Any, n: Any) -> float | None:
        return ms / n if n and ms else None

    out = {
        "cache_n": t.pop("cache_n", 0),
        "prompt_n": t.get("prompt_n", 0),
        "prompt_ms": t.get("prompt_ms", 0.0),
        "prompt_per_token_ms": per_token(t.get("prompt_ms"), t.get("prompt_n")),
        "prompt_per_second": t.get("prompt_per_second"),
        "predicted_n": t.get("predicted_n", 0),
        "predicted_ms": t.get("predicted_ms", 0.0),
        "predicted_per_token_ms": per_token(t.get("predicted_ms"), t.get("predicted_n")),
        "predicted_per_second": t.get("predicted_per_second"),
    }
    for key in (
        "prompt_n",
        "prompt_ms",
        "prompt_per_second",
        "predicted_n",
        "predicted_ms",
        "predicted_per_second",
    ):
        t.pop(key, None)
    out.update(
        t
    )  # anything else the engine reports (draft counts) stays, after llama-server's keys
    return out


# --- the resource --------------------------------------------------------------------------------


def _not_json(name: str) -> Any:
    """Python reads NaN, Infinity and -Infinity; JSON (and nlohmann) has no such values."""
    raise ValueError(f"{name} is not a JSON value")


def _finite_float(text: str) -> float:
    """A JSON number with a fraction or exponent; one beyond a double's range is nlohmann's
    parse error (Python would read it as an infinity)."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number overflow parsing '{text}'")
    return value


def loads_json(raw: bytes) -> Any:
    """A request body as JSON, as strictly as nlohmann reads it (no NaN or Infinity, no number
    beyond a double); ValueError when it is not JSON."""
    return json.loads(raw, parse_constant=_not_json, parse_float=_finite_float)


def read_json_object(request: Request) -> tuple[bytes, dict[str, Any] | None, bytes | None]:
    """(raw body, the object, None) or (raw, None, the 400 error body)."""
    raw = request.content.read()
    try:
        obj = loads_json(raw)
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
        d = self.native.bridge.prepare(self._parse, obj)
        d.addCallback(self._answer, request, raw, obj, control)
        d.addErrback(self._failed, request, control, None)
        return NOT_DONE_YET

    def _parse(self, obj: dict) -> Any:
        """The engine's validation of the body (on the engine thread); refusals raise."""
        return self.native.engine.parse_request(obj, ENGINE_KIND[self.kind])

    def _answer(self, parsed: Any, request: Request, raw: bytes, obj: dict, control: Any) -> Any:
        return self._run(parsed, request, raw, obj, control)

    def _run(
        self, parsed: Any, request: Request, raw: bytes, obj: dict[str, Any], control: RunControl
    ) -> Any:
        if gone(request):
            return None
        answer = Answer(self.native, self.kind, raw, obj, parsed)
        writer = _Writer(request, answer, control)
        d = self.native.bridge.stream(
            summary_steps(self.native.engine, parsed), writer.chunk, control
        )
        d.addCallback(writer.done)
        d.addErrback(self._failed, request, control, writer)
        return d

    def _failed(
        self, failure: Failure, request: Request, control: RunControl, writer: _Writer | None
    ) -> None:
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


VOCAB_TYPES = {"llama": 1, "gpt2": 2, "bert": 3, "t5": 4, "rwkv": 5}  # llama_vocab_type


def model_info(native: NativeEngine) -> dict[str, Any]:
    """One model as llama-server's get_res_model_info lists it. The id is the file's name
    (llama-server uses its -m argument as given); the sizes are the tensors' (llama_model_size,
    llama_model_n_params), not the file's."""
    from bankml.resources.llama import main_weight_type

    engine = native.engine
    hp = getattr(getattr(engine, "model", None), "hp", None)
    tokenizer = getattr(engine, "tokenizer", None)
    n_params, size = native.tensor_totals()
    return {
        "id": native.model_id,
        "aliases": [native.model_id],
        "tags": [],
        "object": "model",
        "architecture": {"input_modalities": ["text"], "output_modalities": ["text"]},
        "created": int(time.time()),
        "owned_by": "bankML",
        "meta": {
            "vocab_type": VOCAB_TYPES.get(getattr(tokenizer, "model", ""), 0),
            "n_vocab": getattr(engine, "n_vocab", None),
            "n_ctx": native.n_ctx,
            "n_ctx_train": getattr(hp, "n_ctx_train", None),
            "n_embd": getattr(hp, "n_embd", None),
            "n_params": n_params,
            "size": size,
            "ftype": main_weight_type(native.verified.guard),
        },
    }


def models_object(native: NativeEngine) -> dict[str, Any]:
    """``GET /v1/models`` (and ``/models``): llama-server's get_res_models, the Ollama-style
    ``models`` list and OpenAI's ``data``."""
    return {
        "models": [
            {
                "name": native.model_id,
                "model": native.model_id,
                "modified_at": "",
                "size": "",
                "digest": "",
                "type": "model",
                "description": "",
                "tags": [""],
                "capabilities": ["completion"],
                "parameters": "",
                "details": {
                    "parent_model": "",
                    "format": "gguf",
                    "family": "",
                    "families": [""],
                    "parameter_size": "",
                    "quantization_level": "",
                },
            }
        ],
        "object": "list",
        "data": [model_info(native)],
    }
