"""Ollama's API bodies: listings, answers, stream lines and errors, as bankml writes them.

Pure functions: registry entries and engine results in, JSON objects (and their bytes) out. The
request side (validation before any compute) is ``formats.ollama_request``.

**Encoding.** JSON with ``", "`` and ``": "`` separators and non-ASCII written raw (Python's
default separators); a non-finite float is written as null. A streamed answer is NDJSON, one
object a line; a non-streamed one is a single object with no trailing newline.

**Times.** ``created_at``, ``modified_at`` and ``expires_at`` are RFC 3339 UTC with nine
fractional digits and ``Z``; every duration is in nanoseconds.

**Answers.** A piece line is ``{model, created_at, message|response, done: false}`` (with
``logprobs`` when asked for); empty pieces are not sent. The final object's fields, in order:
``model, created_at, message|response ("" when streamed), done, done_reason, [context],
total_duration, load_duration, prompt_eval_count, prompt_eval_duration, eval_count,
eval_duration, bankml_cache_n, [logprobs], bankml_receipt``. ``context`` (generate, not raw) sits
where Ollama puts it, after ``done_reason``. A load or unload answers ``{model, created_at,
message|response, done: true, done_reason: "load"|"unload", load_duration}``: no counts, no
receipt.

**Errors** are ``{"error": "<message>"}`` and nothing else; during a stream the status stays 200
and the error is the last line.

**Thinking and tool calls** (``OllamaAnswer`` with the chat format's parse): ``message.thinking``
(generate: ``thinking``) and ``message.tool_calls`` (``{"id", "function": {"index", "name",
"arguments": {...}}}``, each call whole), as the engine's parse reads the answer for
/v1/chat/completions; ``capabilities`` lists ``tools`` and ``thinking`` where the template can
(``template_capabilities``).

Where this differs from Ollama on purpose: ``bankml_cache_n`` and ``bankml_receipt`` on the final object,
``bankml`` objects in ``/api/version``, ``/api/tags`` and ``/api/show``, ``size_vram`` 0 (the
engine runs on the CPU), and ``/api/show``'s ``parameters`` without a ``stop`` line for a pin
(a pin stops at its own end-of-generation tokens).
"""

from __future__ import annotations

import functools
import json
import secrets
import string
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from bankml.engine_cupy.sampler import SamplerParams
from bankml.formats.chat_message import MessageStream, Parse, ToolCallMsg
from bankml.formats.ollama_wire import OllamaError as OllamaError
from bankml.formats.ollama_wire import dumps as dumps
from bankml.formats.ollama_wire import error_body as error_body
from bankml.formats.ollama_wire import ndjson_line as ndjson_line
from bankml.receipts.tally import Tally, receipt
from bankml.registry.catalog import Catalog, Derived, Target, pin_of
from bankml.registry.layer import PARAMS, Layer, f32_text
from bankml.registry.manifest import parse_rfc3339, rfc3339_ns
from bankml.registry.modelfile import format_value
from bankml.registry.names import tag
from bankml.registry.pins import Pin
from bankml.registry.residency import Resident
from bankml.version import __version__

ROOT_TEXT = "bankml is running (Ollama's API at /api, native only)"
NDJSON = "application/x-ndjson"
JSON = "application/json"
ROUTES = (
    ("GET", "/"),
    ("HEAD", "/"),
    ("GET", "/api/version"),
    ("GET", "/api/tags"),
    ("GET", "/api/ps"),
    ("POST", "/api/show"),
    ("POST", "/api/chat"),
    ("POST", "/api/generate"),
    ("POST", "/api/create"),
    ("POST", "/api/copy"),
    ("DELETE", "/api/delete"),
    ("POST", "/api/embed"),
    ("POST", "/api/embeddings"),
)
NOT_OFFERED = {
    "/api/pull": (
        "bankml does not pull: models are imported sha256-pinned with open licences only; pin a "
        "GGUF in the registry directory (bankml pin FILE --fork F) instead"
    ),
    "/api/push": "not offered: bankml publishes nothing; its models stay on this machine",
}
PIECE_FIELDS = ("model", "created_at", "message", "response", "done", "logprobs")
FINAL_FIELDS = (
    "model",
    "created_at",
    "message",
    "response",
    "done",
    "done_reason",
    "context",
    "total_duration",
    "load_duration",
    "prompt_eval_count",
    "prompt_eval_duration",
    "eval_count",
    "eval_duration",
    "bankml_cache_n",
    "logprobs",
    "bankml_receipt",
)


def rfc3339(seconds: float) -> str:
    return rfc3339_ns(int(round(seconds * 1e9)))


def unknown_route(method: str, path: str) -> OllamaError:
    """404 for a route bankml does not have, listing the ones it has."""
    routes = ", ".join(f"{m} {p}" for m, p in ROUTES)
    return OllamaError(404, f"bankml serve --native (Ollama API): {routes}")


def not_offered(path: str) -> OllamaError | None:
    """400 for Ollama's routes bankml refuses (pull, push); None for the others."""
    message = NOT_OFFERED.get(path)
    return OllamaError(400, message) if message is not None else None


# -- listings -----------------------------------------------------------------------------------


def version_body(version: str = __version__) -> dict[str, Any]:
    return {"version": version, "bankml": True}


def details(pin: Pin, parent_model: str = "") -> dict[str, Any]:
    header = pin.header
    family = (header.arch or "") if header else ""
    return {
        "parent_model": parent_model,
        "format": "gguf",
        "family": family,
        "families": [family] if family else [],
        "parameter_size": header.parameter_size if header else "",
        "quantization_level": header.quant if header else "",
    }


def pin_status(pin: Pin) -> dict[str, Any]:
    """``bankml`` of a pin's listing: whether the forward pass plays it, and why not."""
    return {
        "native": pin.native,
        "reason": pin.native_reason,
        "file": pin.file,
        "found": pin.path is not None,
    }


def _digest(target: Target) -> str:
    """A pin's bare sha256; a derived model's ``sha256:<manifest digest>``."""
    if isinstance(target, Derived):
        return f"sha256:{target.manifest.digest}"
    return target.sha256


def _modified_at(target: Target) -> str:
    if isinstance(target, Derived):
        return rfc3339(parse_rfc3339(target.manifest.created_at))
    return rfc3339(target.modified_at)


def _parent(target: Target) -> str:
    return target.parent_model if isinstance(target, Derived) else ""


def tag_entry(target: Target) -> dict[str, Any]:
    pin = pin_of(target)
    name = tag(target.name)
    return {
        "name": name,
        "model": name,
        "modified_at": _modified_at(target),
        "size": pin.bytes,
        "digest": _digest(target),
        "details": details(pin, _parent(target)),
        "bankml": pin_status(pin),
    }


def tags_body(catalog: Catalog) -> dict[str, Any]:
    """``GET /api/tags``: every pin, then every derived model."""
    targets: list[Target] = list(catalog.registry.pins)
    targets += [catalog.derived[n] for n in catalog.derived_names()]
    return {"models": [tag_entry(t) for t in targets]}


def ps_body(
    resident: Resident | None, catalog: Catalog, expires_at: float | None
) -> dict[str, Any]:
    """``GET /api/ps`` with one model resident (or none)."""
    if resident is None or expires_at is None:
        return {"models": []}
    return ps_models_body([(resident, expires_at)], catalog)


def ps_models_body(residents: Sequence[tuple[Resident, float]], catalog: Catalog) -> dict[str, Any]:
    """``GET /api/ps``: every resident model with its ``expires_at``, each named after the model
    whose request loaded it, the longest time left first (as Ollama sorts them, by the second;
    ``residents`` in the order ties keep)."""
    models = [_ps_entry(resident, catalog, expires_at) for resident, expires_at in residents]
    order = sorted(range(len(models)), key=lambda i: -int(residents[i][1]))
    return {"models": [models[i] for i in order]}


def _ps_entry(resident: Resident, catalog: Catalog, expires_at: float) -> dict[str, Any]:
    try:
        shown: Target = catalog.resolve(resident.shown_as or resident.pin.name)
    except LookupError:
        shown = resident.pin
    if pin_of(shown).sha256 != resident.pin.sha256:
        shown = resident.pin  # a stale name (a derived model deleted or rebased since)
    name = tag(shown.name)
    return {
        "name": name,
        "model": name,
        "size": resident.pin.bytes,
        "digest": _digest(shown),
        "details": details(resident.pin, _parent(shown)),
        "expires_at": rfc3339(expires_at),
        "size_vram": 0,
        "context_length": resident.context_length,
    }


@functools.lru_cache(maxsize=32)
def template_capabilities(source: str) -> tuple[str, ...]:
    """What a chat template can do beyond completion, as Ollama lists it: ``tools`` where the
    template's analysis finds how it writes tool calls (bankml then parses them, as
    llama-server does), ``thinking`` where it has a reasoning block. A template llama-server
    reads with a parser of its own (``autoparser.apply.SPECIALIZED``), or one that cannot be
    analysed, lists neither: its answer is its text."""
    from bankml.engine_cupy.autoparser.analysis import ToolFormat
    from bankml.engine_cupy.autoparser.apply import specialized_template
    from bankml.engine_cupy.chat_template import ChatTemplate

    if specialized_template(source) is not None:
        return ()
    out = []
    try:
        template = ChatTemplate(source=source)
        if (
            template.caps.supports_tool_calls
            and template.analysis.tools.format.mode is not ToolFormat.NONE
        ):
            out.append("tools")
    except Exception:  # noqa: BLE001 - a template the analysis cannot read lists nothing more
        return ()
    try:
        if template.reasoning.supported:
            out.append("thinking")
    except Exception:  # noqa: BLE001
        pass
    return tuple(out)


def pin_template(pin: Pin) -> str:
    """The chat template a pin is answered with when it is loaded: its GGUF's (ChatML where it
    has none, as the engine reads it)."""
    from bankml.engine_cupy.chat_template import CHATML_TEMPLATE

    text = pin.header.chat_template if pin.header else None
    return CHATML_TEMPLATE if not text or text == "chatml" else text


def pin_completes(pin: Pin) -> bool:
    """Ollama's reading of a GGUF: a model whose header has ``<arch>.pooling_type`` embeds
    (``embedding``) and does not complete; any other completes (``completion``)."""
    header = pin.header
    if header is None:
        return True
    return f"{header.arch}.pooling_type" not in header.kv


def pin_capabilities(target: Target) -> tuple[str, ...]:
    """``template_capabilities`` of the target's pin's own template, and ``embedding`` for a
    model that does not complete (``pin_completes``)."""
    pin = pin_of(target)
    found = template_capabilities(pin_template(pin))
    return found if pin_completes(pin) else (*found, "embedding")


def _sampling_defaults(pin: Pin) -> SamplerParams:
    metadata = pin.header.sampling_metadata() if pin.header else {}
    return SamplerParams.from_gguf_metadata(metadata)


def _number_text(value: float | int) -> str:
    return str(value) if isinstance(value, int) else f32_text(value)


def show_parameters(pin: Pin, layer: Layer | None) -> list[tuple[str, Any]]:
    """(name, value) pairs: the pin's sampling defaults, overridden by the layer's parameters,
    then the layer's stop strings."""
    defaults = _sampling_defaults(pin)
    values: dict[str, Any] = {
        "temperature": defaults.temperature,
        "top_k": defaults.top_k,
        "top_p": defaults.top_p,
        "min_p": defaults.min_p,
    }
    if layer is not None:
        values.update(layer.parameters)
    pairs = [(k, values[k]) for k in PARAMS if k in values]
    if layer is not None:
        pairs += [("stop", s) for s in layer.stop]
    return pairs


def parameters_text(pairs: Iterable[tuple[str, Any]]) -> str:
    """Ollama's ``parameters``: one ``name value`` line each, the name padded to 30."""
    lines = []
    for name, value in pairs:
        shown = (
            json.dumps(value, ensure_ascii=False) if isinstance(value, str) else _number_text(value)
        )
        lines.append(f"{name:<30} {shown}")
    return "\n".join(lines)


def layer_modelfile_lines(layer: Layer) -> list[str]:
    """A layer as Modelfile instructions (they parse back to the same layer)."""
    lines = []
    if layer.system is not None:
        lines.append(f"SYSTEM {format_value(layer.system)}")
    for name, value in layer.parameters.items():
        lines.append(f"PARAMETER {name} {_number_text(value)}")
    lines += [f"PARAMETER stop {format_value(s)}" for s in layer.stop]
    lines += [f"MESSAGE {role} {format_value(content)}" for role, content in layer.messages]
    lines += [f"LICENSE {format_value(text)}" for text in layer.license]
    if layer.requires is not None:
        lines.append(f"REQUIRES {format_value(layer.requires)}")
    return lines


def modelfile_text(target: Target) -> str:
    pin = pin_of(target)
    if isinstance(target, Derived):
        lines = [f"FROM {target.manifest.base.name}"] + layer_modelfile_lines(target.layer)
    else:
        lines = [
            f"# bankml {__version__}: a pinned model (sha256 {pin.sha256}), verified before "
            "every load; not editable",
            f"FROM {pin.path or pin.file}",
        ]
        lines += [
            f"PARAMETER {k} {format_value(v) if isinstance(v, str) else _number_text(v)}"
            for k, v in show_parameters(pin, None)
        ]
    return "\n".join(lines) + "\n"


def show_body(
    target: Target, n_ctx: int, capabilities: Sequence[str] | None = None
) -> dict[str, Any]:
    """``POST /api/show`` for a pin or a derived model (a derived model: its base's answer with
    its own Modelfile, parameters, system, licence, messages, parent and layer);
    ``capabilities``: what its template can do beyond completion, and ``embedding`` (None:
    ``pin_capabilities``), listed after ``completion`` (a model that completes:
    ``pin_completes``) in Ollama's order (tools, then thinking)."""
    pin = pin_of(target)
    layer = target.layer if isinstance(target, Derived) else None
    header = pin.header
    out: dict[str, Any] = {}
    if layer is not None and layer.license:
        out["license"] = "\n".join(layer.license)
    out["modelfile"] = modelfile_text(target)
    out["parameters"] = parameters_text(show_parameters(pin, layer))
    out["template"] = (header.chat_template if header else None) or ""
    if layer is not None and layer.system is not None:
        out["system"] = layer.system
    out["details"] = details(pin, _parent(target))
    if layer is not None and layer.messages:
        out["messages"] = [{"role": r, "content": c} for r, c in layer.messages]
    out["model_info"] = header.scalar_keys() if header else {}
    extra = pin_capabilities(target) if capabilities is None else capabilities
    completes = ["completion"] if pin_completes(pin) else []
    out["capabilities"] = (
        completes + [c for c in ("tools", "thinking", "embedding") if c in extra]
        if pin.native
        else []
    )
    out["modified_at"] = _modified_at(target)
    bankml: dict[str, Any] = {"sha256": pin.sha256, "native": pin_status(pin), "n_ctx": n_ctx}
    if isinstance(target, Derived):
        bankml["layer"] = {
            "derived": True,
            "digest": f"sha256:{target.manifest.digest}",
            "base_sha256": target.layer.base_sha256,
            "base_fork": target.manifest.base.fork,
        }
    out["bankml"] = bankml
    return out


# -- answers ------------------------------------------------------------------------------------


def _text_field(
    kind: str, text: str, thinking: str = "", tool_calls: Sequence[Mapping[str, Any]] = ()
) -> dict[str, Any]:
    """/api/chat's ``message`` (``role``, ``content``, then ``thinking`` and ``tool_calls`` where
    the answer has them), /api/generate's ``response`` and ``thinking``, in Ollama's order."""
    if kind == "chat":
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if thinking:
            message["thinking"] = thinking
        if tool_calls:
            message["tool_calls"] = [dict(call) for call in tool_calls]
        return {"message": message}
    out: dict[str, Any] = {"response": text}
    if thinking:
        out["thinking"] = thinking
    return out


def piece_line(
    kind: str,
    model: str,
    created_at: str,
    text: str,
    logprobs: list[dict] | None = None,
    thinking: str = "",
    tool_calls: Sequence[Mapping[str, Any]] = (),
) -> dict[str, Any]:
    """One streamed piece (``kind`` "chat" or "generate"); ``model`` is ``<name>:latest``."""
    out: dict[str, Any] = {"model": model, "created_at": created_at}
    out.update(_text_field(kind, text, thinking, tool_calls))
    out["done"] = False
    if logprobs is not None:
        out["logprobs"] = logprobs
    return out


def final_object(
    kind: str,
    model: str,
    created_at: str,
    text: str,
    *,
    done_reason: str,
    total_ns: int,
    load_ns: int,
    prompt_eval_count: int,
    prompt_eval_ns: int,
    eval_count: int,
    eval_ns: int,
    cache_n: int,
    receipt: Mapping[str, Any],
    logprobs: list[dict] | None = None,
    context: Sequence[int] | None = None,
    thinking: str = "",
    tool_calls: Sequence[Mapping[str, Any]] = (),
) -> dict[str, Any]:
    """The last object (``text`` is "" when the pieces were streamed, the whole answer if not;
    a parsed answer's last parse puts its own pieces here, thinking and tool calls among them)."""
    out: dict[str, Any] = {"model": model, "created_at": created_at}
    out.update(_text_field(kind, text, thinking, tool_calls))
    out["done"] = True
    out["done_reason"] = done_reason
    if context is not None:
        out["context"] = list(context)
    out.update(
        {
            "total_duration": int(total_ns),
            "load_duration": int(load_ns),
            "prompt_eval_count": int(prompt_eval_count),
            "prompt_eval_duration": int(prompt_eval_ns),
            "eval_count": int(eval_count),
            "eval_duration": int(eval_ns),
            "bankml_cache_n": int(cache_n),
        }
    )
    if logprobs is not None:
        out["logprobs"] = logprobs
    out["bankml_receipt"] = dict(receipt)
    return out


_CALL_ID_ALPHABET = string.ascii_lowercase + string.digits


def ollama_call_id() -> str:
    """A tool call id as Ollama draws one: ``call_`` and 8 lowercase letters and digits."""
    return "call_" + "".join(secrets.choice(_CALL_ID_ALPHABET) for _ in range(8))


def _no_constant(name: str) -> Any:
    raise ValueError(name)


def ollama_tool_call(call: ToolCallMsg, index: int) -> dict[str, Any]:
    """One parsed tool call in Ollama's shape: ``{"id", "function": {"index", "name",
    "arguments"}}``, the arguments the JSON object the model wrote (its text, should it not be
    JSON)."""
    arguments: Any = {}
    if call.arguments:
        try:
            arguments = json.loads(call.arguments, parse_constant=_no_constant)
        except ValueError:
            arguments = call.arguments
    return {"id": call.id, "function": {"index": index, "name": call.name, "arguments": arguments}}


def load_object(
    kind: str, model: str, created_at: str, unloaded: bool, load_ns: int
) -> dict[str, Any]:
    """An empty request's one answer: the model loaded (or unloaded); no counts, no receipt."""
    out: dict[str, Any] = {"model": model, "created_at": created_at}
    out.update(_text_field(kind, ""))
    out["done"] = True
    out["done_reason"] = "unload" if unloaded else "load"
    out["load_duration"] = 0 if unloaded else int(load_ns)
    return out


def ollama_logprobs(entries: Iterable[Mapping[str, Any]], top: int) -> list[dict[str, Any]]:
    """The engine's (llama-server's) probability entries as Ollama's: ``{token, logprob, bytes,
    top_logprobs}``, no ``id``, ``bytes`` left out when empty, ``top_logprobs`` left out at top 0
    (the engine computes top 0 as one alternative, llama-server's n_probs 1)."""
    out = []
    for entry in entries:
        item: dict[str, Any] = {"token": entry.get("token", ""), "logprob": entry.get("logprob")}
        raw = entry.get("bytes") or []
        if raw:
            item["bytes"] = list(raw)
        if top > 0:
            alts = []
            for alt in list(entry.get("top_logprobs") or [])[:top]:
                a: dict[str, Any] = {"token": alt.get("token", ""), "logprob": alt.get("logprob")}
                if alt.get("bytes"):
                    a["bytes"] = list(alt["bytes"])
                alts.append(a)
            item["top_logprobs"] = alts
        out.append(item)
    return out


class OllamaAnswer:
    """One /api/chat or /api/generate answer built from the engine's Chunks and Summary.

    Streamed, ``on_chunk`` gives the piece lines (a token that released no text but carries a
    logprob entry gets its own line with empty content; empty pieces are not sent otherwise);
    not streamed, it only collects. ``final`` gives the last object, receipt included (the same
    ``bankml.receipts.tally`` /v1 carries: the answer's text, the raw request body, the counts and the
    logprob entries). Times: ``started_ns`` is when the request arrived (``time.time_ns``).

    With ``parser`` (the chat format's parse, as /v1/chat/completions reads the answer) the
    generated text is parsed after every token (streamed) or once at the end (not): the pieces
    carry the content and the ``thinking`` the parse adds, and each tool call whole, once the
    parse has moved past it (a later call began) or at the end, as Ollama sends them. A
    continued last turn's own text is held, not sent again. The receipt hashes the thinking and
    the calls as sent (``receipts.acts``).
    """

    def __init__(
        self,
        kind: str,
        model: str,
        request_body: bytes,
        *,
        stream: bool,
        top_logprobs: int | None = None,  # None: no logprobs asked for
        started_ns: int | None = None,
        load_ns: int = 0,
        clock_ns: Callable[[], int] = time.time_ns,
        parser: Parse | None = None,
    ) -> None:
        self.kind = kind
        self.model = model
        self.stream = stream
        self.top = top_logprobs
        self.clock_ns = clock_ns
        self.started_ns = clock_ns() if started_ns is None else started_ns
        self.load_ns = load_ns
        self.tally = Tally(request_body=request_body, clock=lambda: self.clock_ns() / 1e9)
        self.tally.started = self.started_ns / 1e9
        self.entries: list[dict[str, Any]] = []
        self.messages = None if parser is None else MessageStream(parser, ollama_call_id)
        if self.messages is not None:
            self.messages.update("", partial=True)  # a continued turn's text: held, not sent
        self.calls_sent = 0
        self.closed = False  # the last parse done (streamed: its pieces sent on their own line)

    def _now(self) -> str:
        return rfc3339_ns(self.clock_ns())

    def _parsed(self, added: str, partial: bool) -> tuple[str, str, list[dict[str, Any]]]:
        """(content, thinking, whole tool calls) the parse adds after ``added``, tallied."""
        assert self.messages is not None
        diffs = self.messages.update(added, partial)
        content = "".join(d.content_delta for d in diffs)
        thinking = "".join(d.reasoning_content_delta for d in diffs)
        calls = self.messages.message.tool_calls
        done = len(calls) - 1 if partial else len(calls)
        new = [ollama_tool_call(calls[i], i) for i in range(self.calls_sent, max(done, 0))]
        self.calls_sent = max(self.calls_sent, done)
        self.tally.add_text(content)
        if self.tally.acts.take_ollama({"thinking": thinking, "tool_calls": new}):
            self.tally.note_piece()
        return content, thinking, new

    def _entry(self, chunk: Any) -> list[dict[str, Any]] | None:
        if self.top is None or chunk.entry is None:
            return None
        mine = ollama_logprobs([chunk.entry], self.top)
        self.entries.extend(mine)
        return mine

    def on_chunk(self, chunk: Any) -> list[dict[str, Any]]:
        text = chunk.text or ""
        if self.messages is not None:
            mine = self._entry(chunk)
            if not self.stream:
                if text:
                    self.tally.note_piece()  # parsed once at the end; the first token came now
                return []
            content, thinking, calls = self._parsed(text, True)
            if not (content or thinking or calls or mine):
                return []
            return [piece_line(self.kind, self.model, self._now(), content, mine, thinking, calls)]
        self.tally.add_text(text)
        mine = self._entry(chunk)
        if not self.stream or (not text and not mine):
            return []
        return [piece_line(self.kind, self.model, self._now(), text, mine)]

    def last_pieces(self) -> list[dict[str, Any]]:
        """Streamed with a parser, before ``final``: the last parse's pieces (the last tool
        call, what a stop word held back) on a line of their own, as Ollama sends a call
        before its final object; nothing otherwise."""
        if self.messages is None or not self.stream or self.closed:
            return []
        self.closed = True
        content, thinking, calls = self._parsed("", False)
        if not (content or thinking or calls):
            return []
        return [piece_line(self.kind, self.model, self._now(), content, None, thinking, calls)]

    def final(
        self,
        summary: Any,
        *,
        engine: str = "",
        model_sha256: str = "",
        guard: str = "play",
        context: Sequence[int] | None = None,
        drop_last_entries: int = 0,
        issue: Callable[[Tally], Mapping[str, Any]] | None = None,
    ) -> dict[str, Any]:
        """The last object. ``drop_last_entries``: a stop string's own tokens, whose entries a
        non-streamed answer leaves out (as llama-server does). ``issue``: the server's receipt
        builder (``receipts.vouch``), else one built from ``engine`` and ``model_sha256``."""
        timings = getattr(summary, "timings", None) or {}
        entries = self.entries
        if not self.stream and drop_last_entries:
            entries = entries[: max(len(entries) - drop_last_entries, 0)]
        logprobs = entries if self.top is not None else None
        thinking, calls = "", list[dict[str, Any]]()
        if self.messages is not None and not self.closed:
            # the last parse's pieces (a whole answer's: all of them)
            self.closed = True
            text, thinking, calls = self._parsed("" if self.stream else str(summary.text), False)
        elif self.messages is not None:
            text = ""
        else:
            text = "" if self.stream else self.tally.text
        self.tally.set_counts(summary.prompt_tokens, summary.completion_tokens)
        if logprobs is not None:
            self.tally.add_logprobs(logprobs)
        self.tally.finish()
        if issue is not None:
            signed = issue(self.tally)
        else:
            signed = receipt(self.tally, engine=engine, model_sha256=model_sha256, guard=guard)
        return final_object(
            self.kind,
            self.model,
            self._now(),
            text,
            done_reason=summary.finish_reason,
            total_ns=self.clock_ns() - self.started_ns,
            load_ns=self.load_ns,
            prompt_eval_count=summary.prompt_tokens,
            prompt_eval_ns=int(round(float(timings.get("prompt_ms", 0.0)) * 1e6)),
            eval_count=summary.completion_tokens,
            eval_ns=int(round(float(timings.get("predicted_ms", 0.0)) * 1e6)),
            cache_n=int(timings.get("cache_n", 0) or 0),
            receipt=signed,
            logprobs=logprobs,
            context=context,
            thinking=thinking,
            tool_calls=calls,
        )
