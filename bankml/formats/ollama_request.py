"""Ollama's ``/api/chat`` and ``/api/generate`` requests, validated before any compute.

``prepare(kind, body, catalog, ...)`` runs the checks in this order and returns a ``Prepared``
request (the engine's body among it) or raises ``OllamaError`` with the status and message:

1. the body is JSON (``parse_body``: 400 ``body is not JSON``);
2. ``model`` resolves to a pin or a derived model (404, listing the names);
3. a derived model's layer is taken (its parameters under the request's ``options``);
4. ``keep_alive`` (Go durations, seconds, 0, negative);
5. ``stream`` (default true);
6. an empty request (chat without ``messages``, generate without ``prompt``) only loads or
   unloads, and stops here;
7. fields bankml refuses: ``format`` with ``raw``, ``tools`` on generate, ``images``,
   ``suffix``, ``template`` (a field is present unless null, false, ``""``, ``[]`` or ``{}``);
   ``context`` must be token ids, and not with ``raw``; ``think`` (``read_think``: a boolean
   or a level, not with ``raw`` or ``context``) and ``tools`` (``read_tools``); then the
   template's capabilities, Ollama's refusals in its order: ``"<model>" does not support
   thinking``, ``<model> does not support tools``;
8. ``logprobs`` and ``top_logprobs``;
9. ``format``: ``"json"``, ``{}`` and ``{"type": "object"}`` are JSON mode, another object a
   JSON schema, ``""`` none;
10. ``options``: honoured, neutral, ignored and refused keys (below), ``num_ctx`` against the
    server's context;
11. the sampler, built from the model's GGUF defaults and the options, with llama-server's
    refusals;
12. ``messages`` (chat) or ``prompt``/``system`` (generate).

**Options.** Honoured as llama-server applies them: temperature (>= 0), top_k, top_p and min_p
(clamped to [0, 1]), seed, repeat_penalty, repeat_last_n, presence_penalty, frequency_penalty,
typical_p, min_keep; ``num_predict`` > 0 is the limit and any other value none; ``num_ctx`` fits
the conversation; ``stop`` a string or strings (empty ones dropped). Neutral: mirostat 0, tfs_z
1, mirostat_eta, mirostat_tau, penalize_newline. Ignored (how to run, not what to answer):
num_thread, num_gpu, main_gpu, num_batch, use_mmap, use_mlock, low_vram, numa, f16_kv,
vocab_only, logits_all, num_keep. Anything else is refused rather than ignored.

**Tools and thinking** go to the chat body the engine reads as /v1/chat/completions: ``tools``
as given; ``think`` true/false as ``chat_template_kwargs.enable_thinking``, a level ("high",
"medium", "low", "max") as thinking on plus ``reasoning_effort``; no ``think``, the server's
own setting. An assistant message's ``thinking`` is its ``reasoning_content``, its
``tool_calls`` (object arguments) the chat body's (arguments as compact JSON); a ``tool``
message's ``tool_name`` is its ``name``.

**Prompts.** Chat: a derived model's MESSAGEs come before the request's messages, its SYSTEM first
unless the request starts with a system message. Generate (not raw): the request's ``system``,
else the layer's, then the MESSAGEs, then ``{user: prompt}``, through the chat template; with
``context``, the text of those token ids comes before the templated prompt, and the final object
returns the tokens of prompt and answer (Ollama's behaviour). Raw: the prompt is tokenized as
given (special tokens parsed), with no template; ``system`` is ignored.

**num_ctx** fitting (``fit_chat``) follows Ollama's ``chatPrompt``: walking back from the last
message, an earlier one is kept while it, the messages after it and the system messages before
it still fit; the last message always stays; a system message that is itself the first one cut
is dropped. What still does not fit is refused (``prompt_too_long``): there is no context shift.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from bankml.engine_cupy.sampler import SamplerError, SamplerParams
from bankml.formats.ollama import OllamaError, pin_completes
from bankml.formats.ollama import pin_capabilities as default_capabilities
from bankml.registry.catalog import Catalog, Target, layer_of, pin_of
from bankml.registry.keepalive import DEFAULT, UNLOAD, BadKeepAlive, KeepAlive, parse_keep_alive
from bankml.registry.layer import Layer
from bankml.registry.names import tag
from bankml.registry.pins import NotFound

CHAT, GENERATE = "chat", "generate"
MAX_TOP_LOGPROBS = 20
HONOURED = (
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "seed",
    "repeat_penalty",
    "repeat_last_n",
    "presence_penalty",
    "frequency_penalty",
    "typical_p",
    "min_keep",
)
NEUTRAL = frozenset({"mirostat_eta", "mirostat_tau", "penalize_newline"})
IGNORED = frozenset(
    {
        "num_thread",
        "num_gpu",
        "main_gpu",
        "num_batch",
        "use_mmap",
        "use_mlock",
        "low_vram",
        "numa",
        "f16_kv",
        "vocab_only",
        "logits_all",
        "num_keep",
    }
)
CLAMPED = {"temperature": (0.0, None), "top_p": (0.0, 1.0), "min_p": (0.0, 1.0)}
ROLES = ("system", "user", "assistant", "tool")
RAW_CONFLICT = "raw mode does not support template, system, or context"
THINK_LEVELS = ("high", "medium", "low", "max")
TOOLS, THINKING = "tools", "thinking"  # /api/show's capabilities beyond "completion"
IMAGES_REFUSED = "images: bankML's models are text-only; vision is out of scope"


def present(value: Any) -> bool:
    """Present unless null, false, "", [] or {}."""
    return value not in (None, False, "", [], {})


@dataclass
class Prepared:
    """A validated Ollama request: what to load, how long to keep it, and the engine's body."""

    kind: str  # CHAT | GENERATE
    target: Target
    model: str  # the name answered, "<name>:latest"
    keep_alive: KeepAlive
    stream: bool
    empty: bool = False  # load or unload only
    unload: bool = False
    raw: bool = False
    engine_kind: str = "chat"  # "chat" (templated) or "completion" (raw)
    body: dict[str, Any] = field(default_factory=dict)  # llama-server / OpenAI fields
    num_ctx: int | None = None  # fit the prompt to this (None: the server's context)
    logprobs: bool = False
    top_logprobs: int = 0
    context: list[int] | None = None  # generate's token ids from an earlier answer
    returns_context: bool = False  # generate, not raw: the final object carries context
    think: bool | str | None = None  # the request's think (None: not given)
    # the answer is read by the chat format's parse into content, thinking and tool calls
    # (the template has tools or thinking, or the request asks for either)
    parse_message: bool = False


def parse_body(raw: bytes) -> dict[str, Any]:
    """Step 1: the body as a JSON object (no NaN or Infinity, no number beyond a double)."""

    def no_constant(name: str) -> Any:
        raise ValueError(name)

    def finite(text: str) -> float:
        value = float(text)
        if not math.isfinite(value):
            raise ValueError(text)
        return value

    try:
        obj = json.loads(raw, parse_constant=no_constant, parse_float=finite)
    except (ValueError, RecursionError):
        raise OllamaError(400, "body is not JSON") from None
    if not isinstance(obj, dict):
        raise OllamaError(400, "body is not a JSON object")
    return obj


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _resolve(obj: Mapping[str, Any], catalog: Catalog) -> Target:
    model = obj.get("model")
    if model is not None and not isinstance(model, str):
        raise OllamaError(400, "model must be a string")
    try:
        return catalog.resolve(model)
    except NotFound as err:
        raise OllamaError(404, str(err)) from None


def merged_options(options: Any, layer: Layer | None) -> Any:
    """The request's options with the layer's missing keys before them (``stop`` when absent)."""
    if layer is None or not (options is None or isinstance(options, dict)):
        return options
    given = {k: v for k, v in (options or {}).items() if v is not None}
    out: dict[str, Any] = {k: v for k, v in layer.parameters.items() if k not in given}
    if layer.stop and "stop" not in given:
        out["stop"] = list(layer.stop)
    out.update(given)
    return out


def _refusals(kind: str, obj: Mapping[str, Any]) -> None:
    raw = obj.get("raw") is True
    if raw and present(obj.get("format")):
        raise OllamaError(
            400,
            "format: a JSON answer is constrained through the chat template; raw mode takes no "
            "format",
        )
    if kind == GENERATE and present(obj.get("tools")):
        raise OllamaError(400, "tools: /api/generate takes no tools; send them to /api/chat")
    if present(obj.get("images")):
        raise OllamaError(400, IMAGES_REFUSED)
    if present(obj.get("suffix")):
        raise OllamaError(
            400, "suffix: fill-in-the-middle is not reproduced; send the whole prompt"
        )
    if present(obj.get("template")):
        raise OllamaError(
            400,
            "template: the model's own chat template is used; a replacement template is not taken",
        )


def read_think(value: Any) -> bool | str | None:
    """``think``: None (not given), true, false or a level (``THINK_LEVELS``); anything else is
    refused with Ollama's message."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str):
        if value in THINK_LEVELS:
            return value
        raise OllamaError(
            400,
            f'invalid think value: "{value}" (must be "high", "medium", "low", "max", true, or '
            "false)",
        )
    raise OllamaError(
        400, 'think must be a boolean or string ("high", "medium", "low", "max", true, or false)'
    )


def think_fields(think: bool | str | None) -> dict[str, Any]:
    """The chat body's fields for ``think``: true or a level turns the template's thinking on
    (``chat_template_kwargs.enable_thinking``), a level is also the ``reasoning_effort`` the
    template is given, false turns it off; not given, the server's own setting stands."""
    if think is None:
        return {}
    out: dict[str, Any] = {"chat_template_kwargs": {"enable_thinking": think is not False}}
    if isinstance(think, str):
        out["reasoning_effort"] = think
    return out


def read_tools(tools: Any) -> list[dict[str, Any]]:
    """``tools`` as Ollama takes them: an array of ``{"type": "function", "function": {"name",
    "description", "parameters"}}``; the first fault refused (400, ``tools: ...``)."""
    if tools is None or tools == []:
        return []
    if not isinstance(tools, list):
        raise OllamaError(400, "tools: an array of tools")
    for index, tool in enumerate(tools):
        where = f"tools[{index}]"
        if not isinstance(tool, dict):
            raise OllamaError(400, f"tools: {where} is not an object")
        kind = tool.get("type", "function")
        if kind != "function":
            raise OllamaError(400, f'tools: {where}.type is {json.dumps(kind)}, not "function"')
        function = tool.get("function")
        if not isinstance(function, dict):
            raise OllamaError(400, f"tools: {where}.function must be an object")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise OllamaError(400, f"tools: {where}.function.name must be a non-empty string")
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise OllamaError(400, f"tools: {where}.function.description must be a string")
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise OllamaError(400, f"tools: {where}.function.parameters must be an object")
    return [{**tool, "type": "function"} for tool in tools]


def cannot_complete(kind: str, model: str) -> OllamaError:
    """Ollama's refusal of a generate or chat on a model that only embeds."""
    return OllamaError(400, f'"{model}" does not support {"chat" if kind == CHAT else "generate"}')


def check_capabilities(
    model: str,
    think: bool | str | None,
    tools: list[dict[str, Any]],
    capabilities: Sequence[str],
    *,
    kind: str = GENERATE,
    completes: bool = True,
) -> None:
    """Ollama's refusals, in its order: thinking asked of a template that cannot think (``model``
    as the request named it), a model that does not complete (``cannot_complete``), then tools
    given to a template without tool calls."""
    if think not in (None, False) and THINKING not in capabilities:
        raise OllamaError(400, f'"{model}" does not support thinking')
    if not completes:
        raise cannot_complete(kind, model)
    if tools and TOOLS not in capabilities:
        raise OllamaError(400, f"{model} does not support tools")


def _context(kind: str, obj: Mapping[str, Any]) -> list[int] | None:
    context = obj.get("context")
    if kind != GENERATE or context is None or context == []:
        return None
    ok = isinstance(context, list) and all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in context
    )
    if not ok:
        raise OllamaError(400, "context must be an array of token ids (from an earlier answer)")
    if obj.get("raw") is True:
        raise OllamaError(400, RAW_CONFLICT)
    return list(context)


def _logprobs(obj: Mapping[str, Any]) -> tuple[bool, int]:
    top = obj.get("top_logprobs")
    if top is None:
        top = 0
    elif not (isinstance(top, int) and not isinstance(top, bool)):
        raise OllamaError(400, f"top_logprobs: a whole number from 0 to {MAX_TOP_LOGPROBS}")
    elif not 0 <= top <= MAX_TOP_LOGPROBS:
        raise OllamaError(400, f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}")
    logprobs = obj.get("logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise OllamaError(400, "logprobs: true or false")
    return bool(logprobs), top if logprobs else 0


def response_format(fmt: Any) -> dict[str, Any] | None:
    """Step 9: the engine's ``response_format`` for Ollama's ``format`` (None: unconstrained)."""
    if fmt is None or fmt == "":
        return None
    if fmt == "json" or fmt == {} or fmt == {"type": "object"}:
        return {"type": "json_object"}
    if isinstance(fmt, dict):
        return {"type": "json_schema", "json_schema": {"schema": fmt}}
    raise OllamaError(400, 'format: "json" or a JSON schema (an object)')


def _stop(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value] if value else []
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return [s for s in value if s]
    raise OllamaError(400, "stop must be a string or an array of strings")


def read_options(options: Any, n_ctx: int) -> tuple[dict[str, Any], int | None]:
    """Step 10: (the engine's sampling and length fields, num_ctx to fit to or None)."""
    if options is None:
        return {}, None
    if not isinstance(options, dict):
        raise OllamaError(400, "options must be an object")
    body: dict[str, Any] = {}
    num_ctx = None
    for key, value in options.items():
        if value is None or key in IGNORED or key in NEUTRAL:
            continue
        if key == "stop":
            body["stop"] = _stop(value)
            continue
        if key not in HONOURED and key not in ("num_predict", "num_ctx", "mirostat", "tfs_z"):
            raise OllamaError(
                400,
                f"options.{key}: not an option bankML knows; it refuses rather than ignore what "
                "might change the answer",
            )
        if not _number(value):
            raise OllamaError(400, f"options.{key} must be a number")
        if key == "mirostat":
            if value != 0:
                raise OllamaError(
                    400,
                    "mirostat: not reproduced; bankml samples with llama-server's default chain "
                    "(send mirostat 0 or leave it out)",
                )
        elif key == "tfs_z":
            if value != 1:
                raise OllamaError(
                    400, "tfs_z: tail-free sampling is not reproduced (llama.cpp removed it)"
                )
        elif key == "num_predict":
            if value > 0:
                body["n_predict"] = int(value)
        elif key == "num_ctx":
            wanted = int(value)
            if wanted > n_ctx:
                raise OllamaError(
                    400,
                    f"num_ctx {wanted} is larger than the context this server holds ({n_ctx}); "
                    f"restart bankml serve with --ctx {wanted} if it fits in memory",
                )
            num_ctx = wanted if wanted >= 1 else None
        else:
            lo, hi = CLAMPED.get(key, (None, None))
            if lo is not None:
                value = max(lo, value)
            if hi is not None:
                value = min(hi, value)
            body[key] = value
    return body, num_ctx


def _tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's Ollama ``tool_calls`` as the chat body's: each ``{"id"?,
    "function": {"name", "arguments": {...}}}`` as ``{"type": "function", "function": {"name",
    "arguments": <compact JSON>}, "id"?}``."""
    if not isinstance(calls, list):
        raise OllamaError(400, f"{where}.tool_calls must be an array")
    out = []
    for index, call in enumerate(calls):
        at = f"{where}.tool_calls[{index}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            raise OllamaError(400, f"{at}.function must be an object")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise OllamaError(400, f"{at}.function.name must be a non-empty string")
        arguments = function.get("arguments")
        if arguments is None:
            arguments = {}
        if not isinstance(arguments, dict):
            raise OllamaError(400, f"{at}.function.arguments must be an object")
        entry: dict[str, Any] = {
            "type": "function",
            "function": {
                "name": name,
                "arguments": json.dumps(arguments, ensure_ascii=False, separators=(",", ":")),
            },
        }
        call_id = call.get("id")
        if call_id is not None and not isinstance(call_id, str):
            raise OllamaError(400, f"{at}.id must be a string")
        if call_id:
            entry["id"] = call_id
        out.append(entry)
    return out


def _chat_messages(messages: Any) -> list[dict[str, Any]]:
    """Step 12 for chat: text messages with a role; ``thinking`` becomes the turn's reasoning,
    an assistant's ``tool_calls`` the chat body's, a tool message's ``tool_name`` its ``name``."""
    if not isinstance(messages, list):
        raise OllamaError(400, "messages must be an array")
    out = []
    for index, m in enumerate(messages):
        if not isinstance(m, dict):
            raise OllamaError(400, "messages must be an array of objects")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise OllamaError(400, "a message without a role")
        role = role.lower()  # as Ollama reads it
        if role not in ROLES:
            raise OllamaError(
                400, f'a message with role "{role}": roles are system, user, assistant and tool'
            )
        content = m.get("content")
        if content is not None and not isinstance(content, str):
            raise OllamaError(400, "only text content is in scope")
        if present(m.get("images")):
            raise OllamaError(400, IMAGES_REFUSED)
        msg: dict[str, Any] = {"role": role, "content": content or ""}
        reasoning = m.get("thinking") or m.get("reasoning_content")
        if isinstance(reasoning, str) and reasoning:
            msg["reasoning_content"] = reasoning
        if present(m.get("tool_calls")):
            if role != "assistant":
                raise OllamaError(400, f"messages[{index}]: only an assistant message calls tools")
            msg["tool_calls"] = _tool_calls(m["tool_calls"], f"messages[{index}]")
        for key, name in (("tool_name", "name"), ("tool_call_id", "tool_call_id")):
            value = m.get(key)
            if value is not None and not isinstance(value, str):
                raise OllamaError(400, f"messages[{index}].{key} must be a string")
            if value:
                msg[name] = value
        out.append(msg)
    return out


def layered_messages(
    messages: list[dict[str, Any]], layer: Layer | None, system: str | None = None
) -> list[dict[str, Any]]:
    """The layer's MESSAGEs, then ``messages``; the system prompt (``system``, else the layer's)
    first, unless ``messages`` starts with a system message."""
    prompt = system if system else (layer.system if layer is not None else None)
    out: list[dict[str, Any]] = []
    if prompt and not (messages and messages[0].get("role") == "system"):
        out.append({"role": "system", "content": prompt})
    if layer is not None:
        out += [{"role": r, "content": c} for r, c in layer.messages]
    return out + messages


def _string_field(obj: Mapping[str, Any], key: str) -> str | None:
    value = obj.get(key)
    if value is not None and not isinstance(value, str):
        raise OllamaError(400, f"{key} must be a string")
    return value


def prepare(
    kind: str,
    obj: Mapping[str, Any],
    catalog: Catalog,
    *,
    n_ctx: int,
    default_keep_alive: KeepAlive = DEFAULT,
    capabilities: Callable[[Target], Sequence[str]] | None = None,
) -> Prepared:
    """Steps 2-12 over a parsed body (``parse_body`` is step 1); OllamaError when refused.
    ``capabilities``: what the target's chat template can do beyond completion (``TOOLS``,
    ``THINKING``); by default read from the pin's own template."""
    target = _resolve(obj, catalog)
    layer = layer_of(target)
    options = merged_options(obj.get("options"), layer)
    try:
        keep_alive = parse_keep_alive(obj.get("keep_alive"), default_keep_alive)
    except BadKeepAlive as err:
        raise OllamaError(400, str(err)) from None
    stream = obj.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise OllamaError(400, "stream: true or false")
    prepared = Prepared(
        kind=kind,
        target=target,
        model=tag(target.name),
        keep_alive=keep_alive,
        stream=stream is not False,
    )
    if kind == CHAT:
        empty = obj.get("messages") is None or obj.get("messages") == []
    else:
        empty = obj.get("prompt") is None or obj.get("prompt") == ""
    model = obj["model"] if isinstance(obj.get("model"), str) else prepared.model
    completes = pin_completes(pin_of(target))
    if empty:
        prepared.empty = True
        prepared.unload = keep_alive.kind == UNLOAD
        if not (prepared.unload or completes):  # Ollama loads only a model that completes
            raise cannot_complete(kind, model)
        return prepared
    _refusals(kind, obj)
    prepared.context = _context(kind, obj)
    think = prepared.think = read_think(obj.get("think"))
    tools = read_tools(obj.get("tools")) if kind == CHAT else []
    if think is not None and kind == GENERATE and (obj.get("raw") is True or prepared.context):
        raise OllamaError(
            400,
            "think: raw mode and a context take the prompt as given; thinking is set through the "
            "chat template (send think without raw or context, or leave it out)",
        )
    caps = (capabilities or default_capabilities)(target)
    check_capabilities(model, think, tools, caps, kind=kind, completes=completes)
    prepared.parse_message = bool(tools) or think is not None or TOOLS in caps or THINKING in caps
    prepared.logprobs, prepared.top_logprobs = _logprobs(obj)
    fmt = response_format(obj.get("format"))
    body, prepared.num_ctx = read_options(options, n_ctx)
    if fmt is not None:
        body["response_format"] = fmt
    if prepared.logprobs:
        body["logprobs"] = True
        body["top_logprobs"] = max(prepared.top_logprobs, 1)
    pin = pin_of(target)
    defaults = SamplerParams.from_gguf_metadata(
        pin.header.sampling_metadata() if pin.header else {}
    )
    try:
        SamplerParams.from_request(body, defaults)
    except SamplerError as err:
        raise OllamaError(400, str(err)) from None
    body.update(think_fields(think))
    if tools:
        body["tools"] = tools
    if kind == CHAT:
        body["messages"] = layered_messages(_chat_messages(obj.get("messages")), layer)
    else:
        prompt = _string_field(obj, "prompt") or ""
        system = _string_field(obj, "system")
        prepared.raw = obj.get("raw") is True
        if obj.get("raw") is not None and not isinstance(obj.get("raw"), bool):
            raise OllamaError(400, "raw: true or false")
        if prepared.raw:
            prepared.engine_kind = "completion"
            body["prompt"] = prompt
            if prepared.logprobs:
                body["n_probs"] = body.pop("top_logprobs")
                body.pop("logprobs")
        else:
            body["messages"] = layered_messages(
                [{"role": "user", "content": prompt}], layer, system
            )
            prepared.returns_context = True
    prepared.body = body
    return prepared


def fit_chat(
    messages: Sequence[Mapping[str, Any]],
    count_tokens: Callable[[list[Mapping[str, Any]]], int],
    num_ctx: int,
) -> list[Mapping[str, Any]]:
    """Ollama's chatPrompt: the messages kept under ``num_ctx`` (``count_tokens`` renders a list
    through the template and counts its tokens)."""
    msgs = list(messages)
    if not msgs:
        return msgs
    n = len(msgs) - 1
    system: list[Mapping[str, Any]] = []
    for i in range(n - 1, -1, -1):
        system = [m for m in msgs[:i] if m.get("role") == "system"]
        if count_tokens(system + msgs[i:]) > num_ctx:
            break
        n = i
    else:
        system = []
    return system + msgs[n:]


def prompt_too_long(n_tokens: int, num_ctx: int) -> OllamaError:
    return OllamaError(
        400,
        f"the prompt is {n_tokens} tokens, more than num_ctx {num_ctx}: send a shorter prompt or "
        "a larger num_ctx (bankml does not shift the context)",
    )


def show_target(obj: Any, catalog: Catalog) -> Target:
    """/api/show's ``{model|name, verbose}``: the model shown; every error is 404 with its
    reason, as Ollama answers /api/show."""
    if not isinstance(obj, dict):
        raise OllamaError(404, "the request body must be a JSON object")
    name = obj.get("model") if obj.get("model") is not None else obj.get("name")
    if not isinstance(name, str) or not name.strip():
        raise OllamaError(404, "model is required (the name of the model to show)")
    try:
        return catalog.resolve(name)
    except NotFound as err:
        raise OllamaError(404, str(err)) from None
