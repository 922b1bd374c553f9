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

Where this differs from Ollama on purpose: no ``thinking`` (bankml's models answer without a
separate thinking channel), ``bankml_cache_n`` and ``bankml_receipt`` on the final object,
``bankml`` objects in ``/api/version``, ``/api/tags`` and ``/api/show``, ``size_vram`` 0 (the
engine runs on the CPU), and ``/api/show``'s ``parameters`` without a ``stop`` line for a pin
(a pin stops at its own end-of-generation tokens).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from bankml.engine_cupy.sampler import SamplerParams
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
)
NOT_OFFERED = {
    "/api/embed": (
        "embeddings need an encoder graph, which bankml's forward pass does not have "
        "(it plays decoder-only chat models); keep Ollama for embeddings"
    ),
    "/api/embeddings": (
        "embeddings need an encoder graph, which bankml's forward pass does not have "
        "(it plays decoder-only chat models); keep Ollama for embeddings"
    ),
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
    """400 for Ollama's routes bankml refuses (embeddings, pull, push); None for the others."""
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
    """``GET /api/ps``: the resident model, named after the model whose request loaded it."""
    if resident is None or expires_at is None:
        return {"models": []}
    try:
        shown: Target = catalog.resolve(resident.shown_as or resident.pin.name)
    except LookupError:
        shown = resident.pin
    if pin_of(shown).sha256 != resident.pin.sha256:
        shown = resident.pin  # a stale name (a derived model deleted or rebased since)
    name = tag(shown.name)
    return {
        "models": [
            {
                "name": name,
                "model": name,
                "size": resident.pin.bytes,
                "digest": _digest(shown),
                "details": details(resident.pin, _parent(shown)),
                "expires_at": rfc3339(expires_at),
                "size_vram": 0,
                "context_length": resident.context_length,
            }
        ]
    }


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


def show_body(target: Target, n_ctx: int) -> dict[str, Any]:
    """``POST /api/show`` for a pin or a derived model (a derived model: its base's answer with
    its own Modelfile, parameters, system, licence, messages, parent and layer)."""
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
    out["capabilities"] = ["completion"] if pin.native else []
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


def _text_field(kind: str, text: str) -> dict[str, Any]:
    if kind == "chat":
        return {"message": {"role": "assistant", "content": text}}
    return {"response": text}


def piece_line(
    kind: str, model: str, created_at: str, text: str, logprobs: list[dict] | None = None
) -> dict[str, Any]:
    """One streamed piece (``kind`` "chat" or "generate"); ``model`` is ``<name>:latest``."""
    out: dict[str, Any] = {"model": model, "created_at": created_at}
    out.update(_text_field(kind, text))
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
) -> dict[str, Any]:
    """The last object (``text`` is "" when the pieces were streamed, the whole answer if not)."""
    out: dict[str, Any] = {"model": model, "created_at": created_at}
    out.update(_text_field(kind, text))
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

    def _now(self) -> str:
        return rfc3339_ns(self.clock_ns())

    def on_chunk(self, chunk: Any) -> list[dict[str, Any]]:
        text = chunk.text or ""
        self.tally.add_text(text)
        mine: list[dict[str, Any]] | None = None
        if self.top is not None and chunk.entry is not None:
            mine = ollama_logprobs([chunk.entry], self.top)
            self.entries.extend(mine)
        if not self.stream or (not text and not mine):
            return []
        return [piece_line(self.kind, self.model, self._now(), text, mine)]

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
            "" if self.stream else self.tally.text,
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
        )
