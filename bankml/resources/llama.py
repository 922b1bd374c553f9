"""llama-server's own endpoints, answered by the native engine (the engine address in --native).

``POST /tokenize``, ``/detokenize``, ``/apply-template``, ``/completion`` (NativeChat's
llama_completion kind), ``GET /health``, ``/props``, ``/metrics`` (Prometheus text as
llama-server's ``--metrics``), and ``POST /slots/{id}?action=save|restore|erase`` with
llama-server's checks in its order: no slot dir (501), an id ``std::stoi`` cannot read
("Invalid slot ID"), the action ("Invalid action"), the filename (llama.cpp's
``fs_validate_filename``, "Invalid filename"), then the slot itself ("Invalid slot ID" for any id
but 0). A failed restore is 400 ``Unable to restore slot: <reason>``, a failed save 500.

Text work (tokenizing, templating) runs on the bridge's prepare thread; slot work on the engine
thread, so it never meets a half-finished run.
"""

from __future__ import annotations

import os
import re
from typing import Any, Callable

from twisted.python.failure import Failure
from twisted.web.server import NOT_DONE_YET, Request

from bankml.bridge import NativeEngine
from bankml.proxy_resource import JsonResource, error_body, write_json
from bankml.resources.openai import dumps, generation_settings, read_json_object

NOT_SUPPORTED_SLOTS = "This server does not support slots action. Start it with `--slot-save-path`"
FORBIDDEN_CODEPOINTS = set(':*?"<>|/\\') | {"\ufffd", "\ufeff", "\uff0e", "\u2215", "\u2216"}
INT_MIN, INT_MAX = -(2 ** 31), 2 ** 31 - 1
_STOI = re.compile(r"[ \t\n\v\f\r]*([+-]?[0-9]+)")


def _error(request: Request, status: int, message: str, kind: str | None = None) -> None:
    body = error_body(status, message) if kind is None else dumps(
        {"error": {"code": status, "message": message, "type": kind}})
    write_json(request, status, body)


def _on_failure(request: Request) -> Callable[[Failure], None]:
    """A prepare/engine job's error as llama-server answers it: its own message for a request
    error (400), the reason otherwise (500)."""

    def failed(failure: Failure) -> None:
        from bankml.engine_cupy.chat_template import TemplateError
        from bankml.engine_cupy.engine import RequestError

        if failure.check(RequestError, TemplateError, ValueError, TypeError, KeyError):
            status = int(getattr(failure.value, "status", 400))
            _error(request, status, str(failure.value.args[0] if failure.value.args else failure.value))
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
    """llama-server's tokenize_mixed: a string, or an array of strings and token ids."""
    if isinstance(content, str):
        return engine.tokenize(content, add_special=add_special, parse_special=parse_special)
    if isinstance(content, list):
        out: list[int] = []
        first = True
        for part in content:
            if isinstance(part, str):
                out += engine.tokenize(part, add_special=add_special and first, parse_special=parse_special)
                first = False
            elif isinstance(part, int) and not isinstance(part, bool):
                out.append(part)
            else:
                raise ValueError("content must be a string or an array of strings and token ids")
        return out
    raise ValueError("content must be a string or an array of strings and token ids")


def _flag(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ValueError(f"[json.exception.type_error.302] type must be boolean, but is {type(value).__name__}")
    return value


def tokenize_answer(engine: Any, body: dict[str, Any]) -> dict[str, Any]:
    if "content" not in body:
        return {"tokens": []}
    tokens = tokenize_mixed(engine, body["content"], _flag(body, "add_special", False),
                            _flag(body, "parse_special", True))
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
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise ValueError("[json.exception.type_error.302] tokens must be an array of integers")
    if any(t < 0 or t >= engine.n_vocab for t in tokens):
        raise ValueError("Invalid token id")  # llama-server would read out of bounds
    raw = b"".join(engine.tokenizer.token_to_piece(t, True) for t in tokens)
    return {"content": raw.decode("utf-8", "replace")}


def apply_template_answer(engine: Any, body: dict[str, Any]) -> dict[str, Any]:
    """oaicompat_chat_params_parse's prompt, as /apply-template returns it."""
    from bankml.engine_cupy.engine import check_chat_messages

    messages = check_chat_messages(body)
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise ValueError("chat_template_kwargs must be an object")
    add_gen = body.get("add_generation_prompt", True)
    prompt = engine.apply_template(messages, add_generation_prompt=bool(add_gen), tools=body.get("tools"),
                                   **kwargs)
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

    caps = getattr(template, "caps", None)
    return {
        "default_generation_settings": {"params": generation_settings(_Defaults, native), "n_ctx": native.n_ctx},
        "total_slots": 1,
        "model_alias": native.model_id,
        "model_ftype": main_weight_type(native.verified.guard),
        "model_path": native.verified.path,
        "modalities": {"vision": False, "video": False, "audio": False},
        "media_marker": "<__media__>",
        "endpoint_slots": False,
        "endpoint_props": False,
        "endpoint_metrics": True,
        "ui": False,
        "ui_settings": {},
        "chat_template": getattr(template, "source", ""),
        "chat_template_caps": dict(vars(caps)) if caps is not None else {},
        "bos_token": getattr(template, "bos_token", ""),
        "eos_token": getattr(template, "eos_token", ""),
        "build_info": native.build_info,
        "is_sleeping": False,
        "cors_proxy_enabled": False,
        "n_ctx": native.n_ctx,
    }


def main_weight_type(guard: Any) -> str:
    """The file's weight type as llama-server's model_ftype names it: the commonest tensor type
    other than F32 (the norms), e.g. "Q4_1"."""
    types = {k: v for k, v in dict(getattr(guard, "types", {}) or {}).items() if k != "F32"}
    return max(types, key=types.get) if types else "F32"


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
        ("prompt_tokens_total", "Number of prompt tokens processed, excluding cached tokens", t["prompt_tokens"]),
        ("prompt_tokens_cached_total", "Number of prompt tokens reused from the cache",
         t["prompt_tokens_cached"]),
        ("prompt_seconds_total", "Total time spent processing prompts", t["prompt_seconds"]),
        ("tokens_predicted_total", "Number of generation tokens processed", t["tokens_predicted"]),
        ("tokens_predicted_seconds_total", "Total time spent generating tokens", t["predicted_seconds"]),
        ("n_decode_total", "Total number of llama_decode() calls, excluding speculative decoding and "
         "multimodal decoding", t["decode_calls"]),
        ("n_tokens_max", "Largest observed sequence length (prompt + generation)", t["n_tokens_max"]),
    ]
    prompt_rate = (t["prompt_tokens"] / t["prompt_seconds"]) if t["prompt_seconds"] > 0 else 0.0
    predicted_rate = (t["tokens_predicted"] / t["predicted_seconds"]) if t["predicted_seconds"] > 0 else 0.0
    gauges = [
        ("prompt_tokens_seconds", "Average prompt throughput in tokens/s", prompt_rate),
        ("predicted_tokens_seconds", "Average generation throughput in tokens/s", predicted_rate),
        ("requests_processing", "Number of requests processing", 1 if busy else 0),
        ("requests_deferred", "Number of requests deferred", native.bridge.queued if native.bridge else 0),
        ("n_busy_slots_per_decode", "Average number of busy slots per llama_decode() call",
         1.0 if t["decode_calls"] else 0.0),
    ]
    lines = []
    for kind, items in (("counter", counters), ("gauge", gauges)):
        for name, help_text, value in items:
            lines += [f"# HELP llamacpp:{name} {help_text}", f"# TYPE llamacpp:{name} {kind}",
                      f"llamacpp:{name} {_num(value)}"]
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
            filename = body.get("filename")
            if not isinstance(filename, str):
                _error(request, 400, "[json.exception.out_of_range.403] key 'filename' not found"
                       if filename is None else "[json.exception.type_error.302] type must be string")
                return NOT_DONE_YET
            if not filename_ok(filename):
                _error(request, 400, "Invalid filename")
                return NOT_DONE_YET
        if id_slot != 0:
            _error(request, 400, "Invalid slot ID")
            return NOT_DONE_YET
        d = native.bridge.call(slot_job, native, action, filename)
        d.addCallback(lambda out: write_json(request, out[0], dumps(out[1])))
        d.addErrback(_on_failure(request))
        return NOT_DONE_YET


def slot_job(native: NativeEngine, action: str, filename: str) -> tuple[int, dict[str, Any]]:
    """On the engine thread: (status, body) of one slot action."""
    from bankml.engine_cupy import slots

    engine = native.engine
    if action == "erase":
        return 200, {"id_slot": 0, "n_erased": slots.erase_slot(engine)}
    path = os.path.join(native.slot_dir, filename)
    if action == "save":
        try:
            done = slots.save_slot(engine, path, native.verified.sha256)
        except OSError as err:
            return 500, {"error": {"code": 500, "message": f"Unable to save slot: {err.strerror or err}",
                                   "type": "server_error"}}
        return 200, {"id_slot": 0, "filename": filename, "n_saved": done.n_tokens, "n_written": done.n_bytes,
                     "timings": {"save_ms": round(done.ms, 3)}}
    try:
        done = slots.restore_slot(engine, path, native.verified.sha256)
    except slots.SlotError as err:
        return 400, {"error": {"code": 400, "message": f"Unable to restore slot: {err}",
                               "type": "invalid_request_error"}}
    return 200, {"id_slot": 0, "filename": filename, "n_restored": done.n_tokens, "n_read": done.n_bytes,
                 "timings": {"restore_ms": round(done.ms, 3)}}

