"""llama-server's own endpoints, answered by the native engine (the engine address in --native).

``POST /completion`` (``Completion``: one prompt or several, llama-server's array of results,
run by ``AnswerResource``), ``POST /infill`` (``Infill``: the fill-in-the-middle prompt, then the
same run), ``/tokenize``, ``/detokenize``, ``/apply-template``,
``/chat/completions/input_tokens`` (``ChatInputTokens``, a child of the chat endpoint), ``GET
/health``, ``/props``, ``/metrics`` (Prometheus text as llama-server's ``--metrics``), ``GET
/slots`` (the slot monitor: bankml/formats/slot_view.py), and
``POST /slots/{id}?action=save|restore|erase`` with llama-server's checks in its order: no slot
dir (501), an id ``std::stoi`` cannot read ("Invalid slot ID"), the action ("Invalid action"),
the filename (llama.cpp's ``fs_validate_filename``, "Invalid filename"); any id then wraps onto
the one slot and is echoed back. A failed restore is 400 ``Unable to restore slot: <reason>``,
a failed save 500.

Text work (tokenizing, templating) runs on the bridge's prepare thread; slot work on the engine
thread, so it never meets a half-finished run. The bodies come from bankml/formats/llama.py, on
the plain data the engine gives (``ResidentEngine``: ``props``, ``scrape``), and from the
engine's jobs; a refusal is ``ApiError``, written as it is.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from twisted.python.failure import Failure
from twisted.web.server import NOT_DONE_YET, Request

from bankml.formats.errors import ApiError, error_body
from bankml.formats.llama import prometheus_text, props_object
from bankml.formats.nlohmann import dumps, type_error
from bankml.formats.slot_actions import NOT_SUPPORTED_SLOTS, filename_ok, stoi
from bankml.receipts.kinds import CHAT, INFILL, LLAMA_COMPLETION
from bankml.resources.interfaces import Bridge, ResidentEngine
from bankml.resources.runs import AnswerResource, read_json_object
from bankml.serving.writers import JsonResource, write_error, write_json

NO_SLOT_AVAILABLE = "no slot available"


def _write_failure(request: Request) -> Callable[[Failure], None]:
    """A job's error as llama-server answers it: a refusal as it is, anything else 500."""

    def failed(failure: Failure) -> None:
        err = failure.value
        if isinstance(err, ApiError):
            write_json(request, err.status, err.as_bytes())
        else:
            write_error(request, 500, failure.getErrorMessage())

    return failed


def _bridge(native: ResidentEngine) -> Bridge:
    """The bridge of a served engine (the service builds these Resources with one)."""
    assert native.bridge is not None, "a served NativeEngine has its bridge"
    return native.bridge


class _Native(JsonResource):
    isLeaf = True

    def __init__(self, native: ResidentEngine) -> None:
        super().__init__()
        self.native = native


class _TextJob(_Native):
    """A POST whose JSON body one of the engine's text jobs answers on the prepare thread."""

    def job(self, body: dict[str, Any]) -> dict[str, Any]:
        raise NotImplementedError

    def render_POST(self, request: Request) -> Any:
        try:
            _, body = read_json_object(request)
        except ApiError as err:
            write_json(request, err.status, err.as_bytes())
            return NOT_DONE_YET
        d = _bridge(self.native).prepare(self.job, body)
        d.addCallback(lambda out: write_json(request, 200, dumps(out)))
        d.addErrback(_write_failure(request))
        return NOT_DONE_YET


class Completion(AnswerResource):
    """``POST /completion`` (and ``/completions``)."""

    def __init__(self, native: ResidentEngine) -> None:
        super().__init__(native, LLAMA_COMPLETION)


class Infill(AnswerResource):
    """``POST /infill``: llama-server's fill-in-the-middle prompt (engine_cupy/infill.py), then
    the /completion run, answer and receipt."""

    def __init__(self, native: ResidentEngine) -> None:
        super().__init__(native, LLAMA_COMPLETION)
        self.parse_kind = INFILL


class Tokenize(_TextJob):
    def job(self, body: dict[str, Any]) -> dict[str, Any]:
        return self.native.tokenize(body)


class Detokenize(_TextJob):
    def job(self, body: dict[str, Any]) -> dict[str, Any]:
        return self.native.detokenize(body)


class ApplyTemplate(_TextJob):
    def job(self, body: dict[str, Any]) -> dict[str, Any]:
        return self.native.apply_template(body)


class ChatInputTokens(_TextJob):
    """``POST /chat/completions/input_tokens`` (and under /v1): a chat body's prompt tokens;
    ``kind`` ``responses`` (``/v1/responses/input_tokens``) or ``messages``
    (``/v1/messages/count_tokens``): that API's body, converted as llama-server converts it."""

    def __init__(self, native: ResidentEngine, kind: str = CHAT) -> None:
        super().__init__(native)
        self.kind = kind

    def job(self, body: dict[str, Any]) -> dict[str, Any]:
        return self.native.input_tokens(body, self.kind)


class Health(_Native):
    def render_GET(self, request: Request) -> Any:
        write_json(request, 200, dumps({"status": "ok"}))
        return NOT_DONE_YET


class Props(_Native):
    def render_GET(self, request: Request) -> Any:
        write_json(request, 200, dumps(props_object(self.native.props())))
        return NOT_DONE_YET


class Metrics(_Native):
    def render_GET(self, request: Request) -> Any:
        body = prometheus_text(self.native.scrape()).encode()
        request.setResponseCode(200)
        request.setHeader(b"content-type", b"text/plain; version=0.0.4")
        request.setHeader(b"process-start-time-unix", str(int(self.native.started)).encode())
        request.setHeader(b"content-length", str(len(body)).encode())
        request.write(body)
        request.finish()
        return NOT_DONE_YET


class Slots(JsonResource):
    """``GET /slots`` (llama-server's slot monitor) and ``POST /slots/{id}?action=...`` (one
    child per id path segment)."""

    def __init__(self, native: ResidentEngine) -> None:
        super().__init__()
        self.native = native

    def render_GET(self, request: Request) -> Any:
        # copies: the reactor thread keeps updating the views
        views = [replace(view) for view in self.native.slot_views]
        # ?fail_on_no_slot (any value): 503 when no slot is idle, as llama-server answers it
        if request.args.get(b"fail_on_no_slot", [b""])[0] and all(v.processing for v in views):
            write_json(request, 503, error_body(503, NO_SLOT_AVAILABLE))
            return NOT_DONE_YET
        d = _bridge(self.native).prepare(self.native.slots, views)
        d.addCallback(lambda out: write_json(request, 200, dumps(out)))
        d.addErrback(_write_failure(request))
        return NOT_DONE_YET

    def getChild(self, path: bytes, request: Request) -> Any:
        return SlotAction(self.native, path.decode("utf-8", "replace"))

    def render_POST(self, request: Request) -> Any:  # /slots/ with no id
        return SlotAction(self.native, "").render(request)


class SlotAction(_Native):
    def __init__(self, native: ResidentEngine, id_text: str) -> None:
        super().__init__(native)
        self.id_text = id_text

    def render_POST(self, request: Request) -> Any:
        try:
            action, filename, id_slot = self._checked(request)
        except ApiError as err:
            write_json(request, err.status, err.as_bytes())
            return NOT_DONE_YET
        # get_slot_by_id: any id wraps onto a slot (resident.slot_index); the answer echoes the
        # id asked for, as llama-server's. Queued as a call: it waits for the runs before it.
        d = _bridge(self.native).call(self.native.slot_action, action, filename, id_slot)
        d.addCallback(lambda out: write_json(request, out[0], dumps(out[1])))
        d.addErrback(_write_failure(request))
        return NOT_DONE_YET

    def _checked(self, request: Request) -> tuple[str, str, int]:
        """(action, filename, id) after llama-server's checks, in its order."""
        if not self.native.slot_dir:
            raise ApiError.of(501, NOT_SUPPORTED_SLOTS, "not_supported_error")
        id_slot = stoi(self.id_text)
        if id_slot is None:
            raise ApiError.of(400, "Invalid slot ID")
        action = (request.args.get(b"action") or [b""])[0].decode("utf-8", "replace")
        if action not in ("save", "restore", "erase"):
            raise ApiError.of(400, "Invalid action")
        if action == "erase":
            return action, "", id_slot
        _, body = read_json_object(request)
        if "filename" not in body:
            raise ApiError.of(400, "[json.exception.out_of_range.403] key 'filename' not found")
        filename = body["filename"]
        if not isinstance(filename, str):
            raise ApiError.of(400, str(type_error("string", filename)))
        if not filename_ok(filename):
            raise ApiError.of(400, "Invalid filename")
        return action, filename, id_slot
