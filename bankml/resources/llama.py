"""llama-server's own endpoints, answered by the native engine (the engine address in --native).

``POST /tokenize``, ``/detokenize``, ``/apply-template``, ``/completion`` (``Completion``: one
prompt or several, llama-server's array of results), ``GET /health``, ``/props``, ``/metrics`` (Prometheus text as
llama-server's ``--metrics``), and ``POST /slots/{id}?action=save|restore|erase`` with
llama-server's checks in its order: no slot dir (501), an id ``std::stoi`` cannot read
("Invalid slot ID"), the action ("Invalid action"), the filename (llama.cpp's
``fs_validate_filename``, "Invalid filename"); any id then wraps onto the one slot and is echoed
back. A failed restore is 400 ``Unable to restore slot: <reason>``, a failed save 500.

Text work (tokenizing, templating) runs on the bridge's prepare thread; slot work on the engine
thread, so it never meets a half-finished run.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable
from typing import Any

from twisted.python.failure import Failure
from twisted.web.server import NOT_DONE_YET, Request

from bankml.bridge import NativeEngine, RunControl
from bankml.engine_cupy.file_type import file_ftype_name
from bankml.proxy_resource import JsonResource, error_body, write_json
from bankml.resources.openai import (
    LLAMA_COMPLETION,
    OAI_COMPLETION,
    SSE,
    Answer,
    NativeChat,
    dumps,
    generation_settings,
    gone,
    json_type,
    logit_bias_entries,
    read_json_object,
    sse,
)

NOT_SUPPORTED_SLOTS = "This server does not support slots action. Start it with `--slot-save-path`"
FORBIDDEN_CODEPOINTS = set(':*?"<>|/\\') | {"\ufffd", "\ufeff", "\uff0e", "\u2215", "\u2216"}
INT_MIN, INT_MAX = -(2**31), 2**31 - 1
_STOI = re.compile(r"[ \t\n\v\f\r]*([+-]?[0-9]+)")


def _error(request: Request, status: int, message: str, kind: str | None = None) -> None:
    body = (
        error_body(status, message)
        if kind is None
        else dumps({"error": {"code": status, "message": message, "type": kind}})
    )
    write_json(request, status, body)


def _on_failure(request: Request) -> Callable[[Failure], None]:
    """A prepare/engine job's error as llama-server answers it: its own message for a request
    error (400), the reason otherwise (500)."""

    def failed(failure: Failure) -> None:
        from bankml.engine_cupy.chat_template import TemplateError
        from bankml.engine_cupy.engine import RequestError

        if failure.check(RequestError, TemplateError, ValueError, TypeError, KeyError):
            status = int(getattr(failure.value, "status", 400))
            _error(
                request, status, str(failure.value.args[0] if failure.value.args else failure.value)
            )
        else:
            _error(request, 500, failure.getErrorMessage())

    return failed


class _Native(JsonResource):
    isLeaf = True

    def __init__(self, native: NativeEngine) -> None:
        super().__init__()
        self.native = native

    def _prepare(self, request: Request, fn: Callable[..., Any], *args: Any) -> Any:
        d = self.native.bridge.prepare(fn, *args)
        d.addCallback(lambda out: write_json(request, 200, dumps(out)))
        d.addErrback(_on_failure(request))
        return NOT_DONE_YET


# --- text ----------------------------------------------------------------------------------------


def tokenize_mixed(engine: Any, content: Any, add_special: bool, parse_special: bool) -> list[int]:
    """llama-server's tokenize_mixed: a string, or an array of strings and token ids (the first
    item, string or id, is the only one that may take the special tokens)."""
    if not isinstance(content, list):
        return engine.tokenize(
            _json_string(content), add_special=add_special, parse_special=parse_special
        )
    out: list[int] = []
    for index, part in enumerate(content):
        if isinstance(part, str):
            out += engine.tokenize(
                part, add_special=add_special and index == 0, parse_special=parse_special
            )
        else:
            out.append(c_int(part))
    return out


def _json_string(value: Any) -> str:
    """nlohmann's get<std::string>."""
    if not isinstance(value, str):
        raise ValueError(
            f"[json.exception.type_error.302] type must be string, but is {json_type(value)}"
        )
    return value


def c_int(value: Any) -> int:
    """nlohmann's get<int> (a llama_token): any number converts as C++ converts it, a boolean
    to 0/1, an integer wrapping to 32 bits, a double truncated (x86's INT_MIN where it does not
    fit); anything else is its type error."""
    if isinstance(value, bool) or isinstance(value, int) and -(2**63) <= value < 2**64:
        return (int(value) - INT_MIN) % 2**32 + INT_MIN
    if isinstance(value, (int, float)):  # an integer beyond 64 bits is a double to nlohmann
        fits = math.isfinite(value) and INT_MIN <= math.trunc(value) <= INT_MAX
        return math.trunc(value) if fits else INT_MIN
    raise ValueError(
        f"[json.exception.type_error.302] type must be number, but is {json_type(value)}"
    )


def _flag(body: dict[str, Any], name: str, default: bool) -> bool:
    """json_value(body, name, default): anything but a boolean reads as the default."""
    value = body.get(name)
    return value if isinstance(value, bool) else default


def tokenize_answer(engine: Any, body: dict[str, Any]) -> dict[str, Any]:
    if "content" not in body:
        return {"tokens": []}
    tokens = tokenize_mixed(
        engine,
        body["content"],
        _flag(body, "add_special", False),
        _flag(body, "parse_special", True),
    )
    if not _flag(body, "with_pieces", False):
        return {"tokens": tokens}
    pieces = []
    for token in tokens:
        raw = engine.tokenizer.token_to_piece(token, True)
        try:
            piece: Any = raw.decode("utf-8")
        except UnicodeDecodeError:
            piece = list(raw)  # not valid UTF-8: llama-server lists the bytes
        pieces.append({"id": token, "piece": piece})
    return {"tokens": pieces}


def detokenize_answer(engine: Any, body: dict[str, Any]) -> dict[str, Any]:
    """tokens_to_str: every token's piece with special tokens as text."""
    tokens = body.get("tokens", [])
    if not isinstance(tokens, list):
        raise ValueError(
            f"[json.exception.type_error.302] type must be array, but is {json_type(tokens)}"
        )
    ids = [c_int(t) for t in tokens]
    if any(t < 0 or t >= engine.n_vocab for t in ids):
        raise ValueError("Invalid token id")  # llama-server would read out of bounds
    raw = b"".join(engine.tokenizer.token_to_piece(t, True) for t in ids)
    return {"content": raw.decode("utf-8", "replace")}


def apply_template_answer(engine: Any, body: dict[str, Any]) -> dict[str, Any]:
    """oaicompat_chat_params_parse's prompt, as /apply-template returns it."""
    from bankml.engine_cupy.engine import check_chat_messages

    messages = check_chat_messages(body)
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise ValueError("chat_template_kwargs must be an object")
    add_gen = body.get("add_generation_prompt", True)
    prompt = engine.apply_template(
        messages, add_generation_prompt=bool(add_gen), tools=body.get("tools"), **kwargs
    )
    return {"prompt": prompt}


class Tokenize(_Native):
    def render_POST(self, request: Request) -> Any:
        _, body, refusal = read_json_object(request)
        if refusal is not None:
            write_json(request, 400, refusal)
            return NOT_DONE_YET
        return self._prepare(request, tokenize_answer, self.native.engine, body)


class Detokenize(_Native):
    def render_POST(self, request: Request) -> Any:
        _, body, refusal = read_json_object(request)
        if refusal is not None:
            write_json(request, 400, refusal)
            return NOT_DONE_YET
        return self._prepare(request, detokenize_answer, self.native.engine, body)


class ApplyTemplate(_Native):
    def render_POST(self, request: Request) -> Any:
        _, body, refusal = read_json_object(request)
        if refusal is not None:
            write_json(request, 400, refusal)
            return NOT_DONE_YET
        return self._prepare(request, apply_template_answer, self.native.engine, body)


# --- state ---------------------------------------------------------------------------------------


class Health(_Native):
    def render_GET(self, request: Request) -> Any:
        write_json(request, 200, dumps({"status": "ok"}))
        return NOT_DONE_YET


def props_object(native: NativeEngine) -> dict[str, Any]:
    """llama-server's /props keys, from the resident model."""
    engine = native.engine
    template = getattr(engine, "template", None)
    defaults = getattr(engine, "defaults", None)

    class _Defaults:  # generation_settings reads a parsed request's fields
        sampler, n_predict, stop, n_probs, cache_prompt = defaults, -1, (), 0, True

    return {
        "default_generation_settings": {
            "params": generation_settings(_Defaults, native, only_metrics=True),
            "n_ctx": native.n_ctx,
        },
        "total_slots": 1,
        "model_alias": native.model_id,
        "model_ftype": file_ftype_name(native.verified.path),
        "model_path": native.verified.path,
        "modalities": {"vision": False, "video": False, "audio": False},
        "media_marker": "<__media__>",
        "endpoint_slots": False,
        "endpoint_props": False,
        "endpoint_metrics": True,
        "ui": False,
        "ui_settings": {},
        "chat_template": getattr(template, "source", ""),
        "chat_template_caps": template_caps(getattr(template, "caps", None)),
        "bos_token": getattr(template, "bos_token", ""),
        "eos_token": getattr(template, "eos_token", ""),
        "build_info": native.build_info,
        "is_sleeping": False,
        "cors_proxy_enabled": False,
    }


def template_caps(caps: Any) -> dict[str, bool]:
    """llama.cpp's ``caps::to_map``: the template's capabilities, sorted by name as its std::map
    is. The three caps chat_template.Caps does not probe take llama.cpp's result for a template
    without them: parallel tool calls only where tool calls work (its probe fails otherwise),
    no preserved reasoning and no reasoning effort (neither probe finds the variable used)."""
    if caps is None:
        return {}
    out = dict(vars(caps))
    out.setdefault("supports_parallel_tool_calls", bool(out.get("supports_tool_calls", False)))
    out.setdefault("supports_preserve_reasoning", False)
    out.setdefault("supports_reasoning_effort", False)
    return dict(sorted(out.items()))


class Props(_Native):
    def render_GET(self, request: Request) -> Any:
        write_json(request, 200, dumps(props_object(self.native)))
        return NOT_DONE_YET


def prometheus_text(native: NativeEngine) -> str:
    """llama-server's --metrics exposition, from the engine's totals."""
    with native._lock:
        t = dict(native.totals)
    busy = bool(native.bridge and native.bridge.busy)

    counters = [
        (
            "prompt_tokens_total",
            "Number of prompt tokens processed, excluding cached tokens",
            t["prompt_tokens"],
        ),
        (
            "prompt_tokens_cached_total",
            "Number of prompt tokens reused from the cache",
            t["prompt_tokens_cached"],
        ),
        ("prompt_seconds_total", "Total time spent processing prompts", t["prompt_seconds"]),
        ("tokens_predicted_total", "Number of generation tokens processed", t["tokens_predicted"]),
        (
            "tokens_predicted_seconds_total",
            "Total time spent generating tokens",
            t["predicted_seconds"],
        ),
        (
            "n_decode_total",
            "Total number of llama_decode() calls, excluding speculative decoding and "
            "multimodal decoding",
            t["decode_calls"],
        ),
        (
            "n_tokens_max",
            "Largest observed sequence length (prompt + generation)",
            t["n_tokens_max"],
        ),
        # bankml has no speculative decoding: llama-server's counters, always 0 here as there without a draft
        ("spec_decode_num_draft_tokens_total", "Speculative: Total draft tokens generated", 0),
        (
            "spec_decode_num_accepted_tokens_total",
            "Speculative: Total draft tokens accepted by the target model",
            0,
        ),
        (
            "spec_decode_num_drafts_total",
            "Speculative: Total speculative decoding verification steps",
            0,
        ),
    ]
    prompt_rate = (t["prompt_tokens"] / t["prompt_seconds"]) if t["prompt_seconds"] > 0 else 0.0
    predicted_rate = (
        (t["tokens_predicted"] / t["predicted_seconds"]) if t["predicted_seconds"] > 0 else 0.0
    )
    gauges = [
        ("prompt_tokens_seconds", "Average prompt throughput in tokens/s", prompt_rate),
        ("predicted_tokens_seconds", "Average generation throughput in tokens/s", predicted_rate),
        ("requests_processing", "Number of requests processing", 1 if busy else 0),
        (
            "requests_deferred",
            "Number of requests deferred",
            native.bridge.queued if native.bridge else 0,
        ),
        (
            "n_busy_slots_per_decode",
            "Average number of busy slots per llama_decode() call",
            1.0 if t["decode_calls"] else 0.0,
        ),
    ]
    lines = []
    for kind, items in (("counter", counters), ("gauge", gauges)):
        for name, help_text, value in items:
            lines += [
                f"# HELP llamacpp:{name} {help_text}",
                f"# TYPE llamacpp:{name} {kind}",
                f"llamacpp:{name} {_num(value)}",
            ]
    return "\n".join(lines) + "\n"


def _num(value: float) -> str:
    """A number as C++'s ostream writes a double (6 significant digits, no trailing zeros)."""
    return f"{float(value):.6g}"


class Metrics(_Native):
    def render_GET(self, request: Request) -> Any:
        body = prometheus_text(self.native).encode()
        request.setResponseCode(200)
        request.setHeader(b"content-type", b"text/plain; version=0.0.4")
        request.setHeader(b"process-start-time-unix", str(int(self.native.started)).encode())
        request.setHeader(b"content-length", str(len(body)).encode())
        request.write(body)
        request.finish()
        return NOT_DONE_YET


# --- slots ---------------------------------------------------------------------------------------


def filename_ok(name: str) -> bool:
    """llama.cpp's fs_validate_filename(name, allow_subdirs=false)."""
    try:
        encoded = name.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate from a \\ud800 escape: not valid UTF-8
        return False
    if not encoded or len(encoded) > 255:
        return False
    for ch in name:
        c = ord(ch)
        if c <= 0x1F or c == 0x7F or 0x80 <= c <= 0x9F or ch in FORBIDDEN_CODEPOINTS:
            return False
    if name[0] == " " or name[-1] in " .":
        return False
    return ".." not in name and name != "."


def stoi(text: str) -> int | None:
    """std::stoi: leading whitespace, a sign, digits (the rest ignored); None where it throws."""
    match = _STOI.match(text)
    if not match:
        return None
    value = int(match.group(1))
    return value if INT_MIN <= value <= INT_MAX else None


class Slots(JsonResource):
    """``POST /slots/{id}?action=...`` (one child per id path segment)."""

    def __init__(self, native: NativeEngine) -> None:
        super().__init__()
        self.native = native

    def getChild(self, path: bytes, request: Request) -> Any:
        return SlotAction(self.native, path.decode("utf-8", "replace"))

    def render_POST(self, request: Request) -> Any:  # /slots/ with no id
        return SlotAction(self.native, "").render(request)


class SlotAction(_Native):
    def __init__(self, native: NativeEngine, id_text: str) -> None:
        super().__init__(native)
        self.id_text = id_text

    def render_POST(self, request: Request) -> Any:
        native = self.native
        if not native.slot_dir:
            _error(request, 501, NOT_SUPPORTED_SLOTS, "not_supported_error")
            return NOT_DONE_YET
        id_slot = stoi(self.id_text)
        if id_slot is None:
            _error(request, 400, "Invalid slot ID")
            return NOT_DONE_YET
        action = (request.args.get(b"action") or [b""])[0].decode("utf-8", "replace")
        if action not in ("save", "restore", "erase"):
            _error(request, 400, "Invalid action")
            return NOT_DONE_YET
        filename = ""
        if action != "erase":
            _, body, refusal = read_json_object(request)
            if refusal is not None:
                write_json(request, 400, refusal)
                return NOT_DONE_YET
            if "filename" not in body:
                _error(request, 400, "[json.exception.out_of_range.403] key 'filename' not found")
                return NOT_DONE_YET
            filename = body["filename"]
            if not isinstance(filename, str):
                _error(
                    request,
                    400,
                    f"[json.exception.type_error.302] type must be string, but is {json_type(filename)}",
                )
                return NOT_DONE_YET
            if not filename_ok(filename):
                _error(request, 400, "Invalid filename")
                return NOT_DONE_YET
        # get_slot_by_id: any id wraps onto a slot (id % n_slots, the id read as size_t), so with
        # bankml's one slot every id is slot 0; the answer echoes the id asked for, as llama-server's
        d = native.bridge.call(slot_job, native, action, filename, id_slot)
        d.addCallback(lambda out: write_json(request, out[0], dumps(out[1])))
        d.addErrback(_on_failure(request))
        return NOT_DONE_YET


def slot_job(
    native: NativeEngine, action: str, filename: str, id_slot: int = 0
) -> tuple[int, dict[str, Any]]:
    """On the engine thread: (status, body) of one slot action on the one slot; ``id_slot`` is
    the id the request named (llama-server echoes it)."""
    from bankml.engine_cupy import slots

    engine = native.engine
    if action == "erase":
        return 200, {"id_slot": id_slot, "n_erased": slots.erase_slot(engine)}
    path = os.path.join(native.slot_dir, filename)
    if action == "save":
        try:
            done = slots.save_slot(engine, path, native.verified.sha256)
        except OSError as err:
            return 500, {
                "error": {
                    "code": 500,
                    "message": f"Unable to save slot: {err.strerror or err}",
                    "type": "server_error",
                }
            }
        return 200, {
            "id_slot": id_slot,
            "filename": filename,
            "n_saved": done.n_tokens,
            "n_written": done.n_bytes,
            "timings": {"save_ms": round(done.ms, 3)},
        }
    try:
        done = slots.restore_slot(engine, path, native.verified.sha256)
    except slots.SlotError as err:
        return 400, {
            "error": {
                "code": 400,
                "message": f"Unable to restore slot: {err}",
                "type": "invalid_request_error",
            }
        }
    return 200, {
        "id_slot": id_slot,
        "filename": filename,
        "n_restored": done.n_tokens,
        "n_read": done.n_bytes,
        "timings": {"restore_ms": round(done.ms, 3)},
    }


# --- /completion ---------------------------------------------------------------------------------


def nested_values(paths: list[str], obj: dict[str, Any]) -> dict[str, Any]:
    """json_get_nested_values: each ``a/b`` path looked up, kept under the path as its key;
    a path that is not there is left out."""
    out: dict[str, Any] = {}
    for path in paths:
        current: Any = obj
        for key in path.split("/"):
            if not isinstance(current, dict) or key not in current:
                break
            current = current[key]
        else:
            out[path] = current
    return out


class CompletionAnswer(Answer):
    """One prompt's answer on /completion or /v1/completions: its ``index`` in the request, and on
    /completion ``tokens`` when ``return_tokens``, per-token ``timings`` with ``timings_per_token``,
    llama-server's ``logit_bias`` form and the task fields it reports, ``response_fields``."""

    def __init__(
        self,
        native: NativeEngine,
        kind: str,
        body: bytes,
        request: dict[str, Any],
        parsed: Any,
        index: int,
    ) -> None:
        super().__init__(native, kind, body, request, parsed)
        self.index = index
        self.options: dict[str, Any] = getattr(parsed, "options", {}) or {}

    def _llama_pieces(self, chunk: Any) -> list[dict[str, Any]]:
        events = super()._llama_pieces(chunk)
        for event in events:
            event["index"] = self.index
            event[
                "id_slot"
            ] = -1  # llama-server's partial results carry the task's id_slot, -1 unless asked
            if self.options.get("timings_per_token") and getattr(chunk, "timings", None):
                event["timings"] = chunk.timings
        return events

    def _completion_pieces(self, chunk: Any) -> list[dict[str, Any]]:
        return [self._indexed(e) for e in super()._completion_pieces(chunk)]

    def _indexed(self, obj: dict[str, Any]) -> dict[str, Any]:
        for choice in obj.get("choices", ()):
            choice["index"] = self.index
        return obj

    def _llama_final(self, summary: Any, text: str) -> dict[str, Any]:
        out = super()._llama_final(summary, text)
        out["index"] = self.index
        if summary.completion_tokens == 0:
            out["stop_type"] = (
                "none"  # nothing generated (an empty prompt): llama-server's STOP_TYPE_NONE
            )
        if self.options.get("return_tokens") and not self.stream:
            out["tokens"] = list(summary.tokens)
        settings = out["generation_settings"]
        settings["logit_bias"] = logit_bias_entries(self.parsed.sampler.logit_bias)
        settings["max_tokens"] = settings.get("n_predict", -1)
        for key in (
            "n_keep",
            "n_discard",
            "stream",
            "timings_per_token",
            "backend_sampling",
            "lora",
        ):
            if key in self.options:
                settings[key] = self.options[key]
        settings["post_sampling_probs"] = bool(getattr(self.parsed, "post_sampling_probs", False))
        return out

    def whole(self, summary: Any) -> dict[str, Any]:
        return self._only_fields(self._indexed(super().whole(summary)))

    def final_events(self, summary: Any) -> list[dict[str, Any]]:
        events = super().final_events(summary)
        return [e if "bankml_receipt" in e else self._only_fields(self._indexed(e)) for e in events]

    def _only_fields(self, obj: dict[str, Any]) -> dict[str, Any]:
        """``response_fields`` (llama-server's own format only): those paths (the receipt stays,
        it is bankml's)."""
        paths = self.options.get("response_fields") or []
        if not paths or self.kind != LLAMA_COMPLETION:
            return obj
        out = nested_values(paths, obj)
        if "bankml_receipt" in obj:
            out["bankml_receipt"] = obj["bankml_receipt"]
        return out


def merged(kind: str, results: list[dict[str, Any]]) -> Any:
    """The non-streamed answer to several prompts: llama-server's array on /completion; on
    /v1/completions the first object with every prompt's choice (its usage is the first prompt's,
    as llama-server's) and ``bankml_receipt`` the list of each choice's receipt."""
    if len(results) == 1:
        return results[0]
    if kind == LLAMA_COMPLETION:
        return results
    out = dict(results[0])
    out["choices"] = [r["choices"][0] for r in results]
    out["bankml_receipt"] = [r["bankml_receipt"] for r in results]
    return out


def batch_steps(engine: Any, parsed: list[Any]) -> Callable[[Callable[[], bool]], Any]:
    """The bridge's ``steps`` for a request's prompts, one after the other on the engine thread:
    ``(index, Chunk)`` items, then ``(index, Summary)`` when that prompt is done."""

    def steps(cancelled: Callable[[], bool]) -> Any:
        for index, request in enumerate(parsed):
            run = engine.run_steps(request, cancelled)
            for chunk in run:
                yield index, chunk
            yield index, run.summary
            if run.summary.cancelled:
                return None
        return None

    return steps


class Completion(NativeChat):
    """``POST /completion`` (and ``/v1/completions`` with ``kind=OAI_COMPLETION``): every prompt of
    the request (a string, ids, ids mixed with strings, or an array of those) answered as if alone,
    in order. One prompt: one object; several: ``merged`` (streamed: each prompt's events in turn
    with its index, and llama-server's ``data: null`` before each prompt after the first)."""

    def __init__(self, native: NativeEngine, kind: str = LLAMA_COMPLETION) -> None:
        if kind not in (LLAMA_COMPLETION, OAI_COMPLETION):
            raise ValueError(f"Completion serves the completion kinds, not {kind!r}")
        super().__init__(native, kind)

    def _parse(self, obj: dict) -> Any:
        return self.native.engine.parse_batch(obj, "completion")

    def _answer(self, parsed: Any, request: Request, raw: bytes, obj: dict, control: Any) -> Any:
        return self._run_batch(parsed, request, raw, obj, control)
        problem = self.native.identity_problem()
        if problem is not None:
            write_json(request, 503, error_body(503, problem))
            return NOT_DONE_YET
        control = self.native.bridge.new_control()
        request.notifyFinish().addErrback(lambda _: control.cancel())
        d = self.native.bridge.prepare(self.native.engine.parse_batch, obj, "completion")
        d.addCallback(self._run_batch, request, raw, obj, control)
        d.addErrback(self._failed, request, control, None)
        return NOT_DONE_YET

    def _run_batch(
        self,
        parsed: list[Any],
        request: Request,
        raw: bytes,
        obj: dict[str, Any],
        control: RunControl,
    ) -> Any:
        if gone(request):
            return None
        answers = [
            CompletionAnswer(self.native, self.kind, raw, obj, p, i) for i, p in enumerate(parsed)
        ]
        writer = _BatchWriter(request, answers, control)
        d = self.native.bridge.stream(batch_steps(self.native.engine, parsed), writer.item, control)
        d.addCallback(lambda _: writer.done())
        d.addErrback(self._failed, request, control, writer)
        return d


class _BatchWriter:
    """Writes a /completion answer: SSE events as items arrive, or the object(s) at the end."""

    def __init__(
        self, request: Request, answers: list[CompletionAnswer], control: RunControl
    ) -> None:
        from bankml.engine_cupy.engine import Summary

        self._summary_type = Summary
        self.request = request
        self.answers = answers
        self.stream = answers[0].stream
        self.started = False
        self.results: list[dict[str, Any]] = []
        self.cancelled = False
        if self.stream:
            request.registerProducer(control, True)

    def _write(self, events: list[Any]) -> None:
        if not events or gone(self.request):
            return
        if not self.started:
            self.started = True
            self.request.setResponseCode(200)
            self.request.setHeader(b"content-type", SSE)
            self.request.setHeader(b"cache-control", b"no-cache")
        self.request.write(b"".join(sse(e) for e in events))

    def item(self, item: tuple[int, Any]) -> None:
        index, value = item
        answer = self.answers[index]
        if not isinstance(value, self._summary_type):
            events = answer.on_chunk(value)
            if index > 0 and answer.n_tokens == 1 and self.stream:
                events = [
                    None,
                    *events,
                ]  # llama-server's begin event of a later task, written as null
            self._write(events)
            return
        if value.cancelled or gone(self.request):
            self.cancelled = True
            return
        if answer.n_tokens == 0 and index > 0 and self.stream:
            self._write([None])
        native = answer.native
        if self.stream:
            self._write(answer.final_events(value))
        else:
            self.results.append(answer.whole(value))
        native.record(value, answer.tally.ttft_ms(), answer.tally.wall_ms(), answer.kind)

    def done(self) -> None:
        if self.stream and self.request.producer is not None:
            self.request.unregisterProducer()
        if self.cancelled or gone(self.request):
            return
        problem = self.answers[0].native.identity_problem()
        if problem is not None:  # the file changed during the run: no receipt
            if self.stream:
                self.error(problem, 503)
            else:
                write_json(self.request, 503, error_body(503, problem))
            return
        if self.stream:
            if self.answers[0].kind == OAI_COMPLETION:
                self.request.write(
                    b"data: [DONE]\n\n"
                )  # llama-server ends only its own /completion without it
            self.request.finish()
        else:
            write_json(self.request, 200, dumps(merged(self.answers[0].kind, self.results)))

    def error(self, message: str, status: int = 500) -> None:
        """An engine failure after the stream began (NativeChat._failed's call)."""
        if self.stream and self.request.producer is not None:
            self.request.unregisterProducer()
        if gone(self.request):
            return
        if not self.started:
            write_json(self.request, status, error_body(status, message))
            return
        self.request.write(
            sse({"error": {"code": status, "message": message, "type": "server_error"}})
        )
        self.request.finish()
