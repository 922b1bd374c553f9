"""Request fields read and checked as llama-server reads them, before any compute.

``Request`` is a validated request, ready to run; ``RequestError`` a refused one, with
llama-server's status and message (or its JSON body). The functions here read one field or
group of fields of a /completion or /v1/chat/completions body in llama-server's schema order
(server-schema.cpp; oaicompat_chat_params_parse for a chat's messages, logprobs and
continuation), so a body with two bad fields gets the refusal llama-server gives.
``Engine.parse_batch`` (engine.py) calls them with what only the engine knows: the
tokenizer, the chat template, the vocabulary, the slots.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from bankml.engine_cupy.chat_template import CONTINUE_AUTO, CONTINUE_CONTENT, CONTINUE_REASONING
from bankml.engine_cupy.checkpoints import MessageSpans
from bankml.engine_cupy.grammar import ConstraintSpec
from bankml.engine_cupy.grammar_triggers import TRIGGER_TOKEN, TRIGGER_WORD, GrammarTrigger
from bankml.engine_cupy.reasoning_budget import ReasoningBudgetSpec
from bankml.engine_cupy.sampler import SamplerParams

if TYPE_CHECKING:
    from bankml.engine_cupy.schedule import SharedPrompt

INT32_MAX = 2_147_483_647
INT64_MAX = 2**63 - 1
# the upper limit of n_cmpl without an engine to ask: llama-server's is n_parallel, the
# engine's slot count (parse_task_fields' n_slots)
N_SLOTS = 1


class RequestError(ValueError):
    """A refused request: HTTP ``status`` with ``body`` (a message string or llama-server's JSON)."""

    def __init__(self, message: str, status: int = 400, body: dict | None = None, reason: str = ""):
        super().__init__(message)
        self.status = status
        self.body = body if body is not None else message
        self.reason = reason  # what bankml found wrong, where llama-server's message says less
        # requests read in full, then refused on their slot (an encoder's completion): tasks
        # llama-server started, so its slot monitor shows the last of them
        self.refused: list[Any] = []


@dataclass
class Request:
    """A validated request, ready to run."""

    kind: str  # "chat" | "completion"
    prompt_tokens: list[int]
    sampler: SamplerParams
    constraint: ConstraintSpec | None = None
    n_predict: int = -1  # -1: until EOG or the context is full
    stop: tuple[str, ...] = ()
    n_probs: int = 0
    cache_prompt: bool = True
    prompt_text: str | None = None
    post_sampling_probs: bool = (
        False  # entries carry "prob"/"top_probs" from the chain's candidates
    )
    n_indent: int = 0  # stop when a later line is indented less (code completion)
    t_max_predict_ms: int = -1  # stop at a newline once generation took this long
    options: dict[str, Any] = field(default_factory=dict)  # accepted fields the answer reports back
    spans: MessageSpans = field(
        default_factory=MessageSpans
    )  # user-message starts (checkpoint cuts)
    seed_drawn: bool = False  # the request named no seed and sampler.seed was drawn for it
    # one prompt's n_cmpl completions on several slots (Engine.share_prompt): the first computes
    # the prompt, the others (``shared_child``) take its state instead of computing it again
    shared: SharedPrompt | None = None
    shared_child: bool = False
    # tokens whose text the answer shows although they are control tokens (preserved_tokens)
    preserved_tokens: frozenset[int] = frozenset()
    # the text the prompt ends with, which the reasoning budget and a grammar that needs it
    # take before the first draw (generation_prompt)
    generation_prompt: str = ""
    # the budget sampler's settings; None where llama-server makes none (ReasoningBudgetSpec.active)
    reasoning_budget: ReasoningBudgetSpec | None = None
    # the chat format's parse of the answer (chat_task.ChatTask.parser): (text, partial) ->
    # the message; None for a /completion task
    chat_parser: Any = None


def bool_field(body: Mapping[str, Any], name: str, default: bool) -> bool:
    """A field_bool: null keeps the default; anything but true/false is nlohmann's type error."""
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise RequestError(
            f"Field '{name}': [json.exception.type_error.302] type must be boolean, "
            f"but is {json_type(value)}"
        )
    return value


# field_bool and field_num of llama-server's completion schema that run before the sampling
# fields, in its order (the first refusal wins, as there). Each is (name, aliases, kind, lo, hi, default).
_TASK_FIELDS: tuple[tuple[str, tuple[str, ...], str, int, int, Any], ...] = (
    ("verbose", (), "bool", 0, 0, False),
    ("timings_per_token", (), "bool", 0, 0, False),
    ("stream", (), "bool", 0, 0, False),
    (
        "include_usage",
        (),
        "stream_options",
        0,
        0,
        False,
    ),  # field_nested("stream_options")'s one subfield
    ("cache_prompt", (), "bool", 0, 0, True),
    ("return_tokens", (), "bool", 0, 0, False),
    ("return_progress", (), "bool", 0, 0, False),
    ("sse_ping_interval", (), "int", -1, INT32_MAX, -1),
    ("n_predict", ("max_completion_tokens", "max_tokens"), "int", -1, INT32_MAX, -1),
    ("n_indent", (), "int", 0, INT32_MAX, 0),
    ("n_keep", (), "int", -1, INT32_MAX, 0),
    ("n_discard", (), "int", 0, INT32_MAX, 0),
    ("n_cmpl", ("n",), "int", 1, N_SLOTS, 1),
    ("n_cache_reuse", (), "int", 0, INT32_MAX, 0),
    ("t_max_predict_ms", (), "int", -1, INT64_MAX, -1),
)


def parse_task_fields(body: Mapping[str, Any], n_slots: int = N_SLOTS) -> dict[str, Any]:
    """The schema's task fields, checked as llama-server checks them (``n_cmpl`` up to the
    server's ``n_slots``); returns every value."""
    out: dict[str, Any] = {}
    for name, aliases, kind, lo, hi, default in _TASK_FIELDS:
        hi = n_slots if name == "n_cmpl" else hi
        if kind == "bool":
            out[name] = bool_field(body, name, default)
        elif kind == "stream_options":
            out[name] = _include_usage(body, default)
        else:
            out[name] = _int_field(body, (name, *aliases), default, lo, hi)
    fields_ = body.get("response_fields")
    # json_value(..., vector<string>()): anything but an array of strings reads as "all fields"
    if isinstance(fields_, list) and all(isinstance(f, str) for f in fields_):
        out["response_fields"] = list(fields_)
    else:
        out["response_fields"] = []
    return out


def _include_usage(body: Mapping[str, Any], default: bool) -> bool:
    """``stream_options.include_usage``: the schema reads ``stream_options`` only as an object
    (anything else is ignored) and its ``include_usage`` as a field_bool."""
    options = body.get("stream_options")
    return (
        bool_field(options, "include_usage", default) if isinstance(options, Mapping) else default
    )


def _int_field(
    body: Mapping[str, Any], names: Sequence[str], default: int, lo: int, hi: int
) -> int:
    """A hard-limited integer field_num (n_predict and its aliases)."""
    for name in names:
        value = body.get(name)
        if value is None:
            continue
        if not isinstance(value, (int, float)):  # a boolean converts, as nlohmann's get<int> does
            raise RequestError(
                f"Field '{name}': [json.exception.type_error.302] type must be number, "
                f"but is {json_type(value)}"
            )
        v = int(value)
        if v < lo or v > hi:
            raise RequestError(
                f"Field '{name}': Value must be between {lo} <= value <= {hi}, but got {v}"
            )
        return v
    return default


def is_integer(value: Any) -> bool:
    """nlohmann's is_number_integer()."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_mixed(value: Any) -> bool:
    """json_is_array_of_mixed_numbers_strings: an array with both a string and an integer."""
    return (
        isinstance(value, list)
        and any(isinstance(v, str) for v in value)
        and any(is_integer(v) for v in value)
    )


def lora_field(body: Mapping[str, Any]) -> list[Any]:
    """``lora``: an array, as llama-server requires; bankml loads no adapters, so, like
    llama-server without adapters, the entries change nothing."""
    lora = body.get("lora")
    if lora is None:
        return []
    if not isinstance(lora, list):
        raise RequestError(
            "Field 'lora': Error: 'lora' must be an array of objects with 'id' and 'scale' fields"
        )
    return lora


def json_type(value: Any) -> str:
    return {bool: "boolean", str: "string", list: "array", dict: "object", type(None): "null"}.get(
        type(value), "number"
    )


def parse_stop(body: Mapping[str, Any]) -> tuple[str, ...]:
    """The ``stop`` handler: a string or an array of strings; any other type is ignored, and a
    non-string item is nlohmann's conversion error, as in llama-server."""
    stop = body.get("stop")
    if isinstance(stop, str):
        return (stop,)
    if not isinstance(stop, list):
        return ()
    words = []
    for word in stop:
        if word is None or word == [] or word == {}:
            continue  # json::empty(): null and empty arrays/objects; an empty string is kept (and stops at once)
        if not isinstance(word, str):
            raise RequestError(
                f"Field 'stop': [json.exception.type_error.302] type must be string, "
                f"but is {json_type(word)}"
            )
        words.append(word)
    return tuple(words)


def chat_logprobs(body: dict[str, Any]) -> None:
    """oaicompat_chat_params_parse's logprobs mapping. ``logprobs: true`` sets n_probs to
    ``top_logprobs`` (json_value: 20 when it is not a number); any other ``logprobs`` stays in the
    body, where the schema reads it as n_probs' alias (a number counts, a string is its type
    error), as llama-server copies the remaining properties."""
    if body.get("logprobs") is True:  # json_value(body, "logprobs", false): only a boolean true
        tools = body.get("tools")
        if isinstance(tools, list) and tools and body.get("stream") is True:
            raise RequestError("logprobs is not supported with tools + stream")
        top = body.get("top_logprobs")
        body["n_probs"] = (
            int(top) if isinstance(top, (int, float)) else 20
        )  # get<int>; a boolean converts
    elif body.get("top_logprobs") is not None:
        raise RequestError("top_logprobs requires logprobs to be set to true")


def check_chat_messages(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The shape checks oaicompat_chat_params_parse makes before templating."""
    if "messages" not in body:
        raise RequestError("'messages' is required")
    messages = body["messages"]
    if not isinstance(messages, list):
        raise RequestError("Expected 'messages' to be an array")
    for msg in messages:
        if not isinstance(msg, dict):
            raise RequestError("Expected 'messages' items to be objects")
        role = msg.get("role")
        if role != "assistant" and "content" not in msg:
            raise RequestError("All non-assistant messages must contain 'content'")
        if role == "assistant" and "content" not in msg and "tool_calls" not in msg:
            raise RequestError("Assistant message must contain either 'content' or 'tool_calls'!")
        content = msg.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise RequestError("Expected 'content' to be a string or an array")
        for part in content if isinstance(content, list) else []:
            check_content_part(part)
    return messages


# a media part's kind, in llama-server's refusal of it when no projector is loaded (bankml
# loads none)
MEDIA_PARTS = {
    "image_url": "image",
    "input_audio": "audio",
    "input_video": "video",
    "video_url": "video",
}


def check_content_part(part: Any) -> None:
    """oaicompat_content_load_media's checks of one content part: text, else a media part
    (refused: no projector), else its refusal of the type."""
    kind = part.get("type") if isinstance(part, dict) else None
    kind = kind if isinstance(kind, str) else ""
    if kind in MEDIA_PARTS:
        raise RequestError(
            f"{MEDIA_PARTS[kind]} input is not supported - hint: if this is unexpected, "
            "you may need to provide the mmproj"
        )
    if kind != "text":
        raise RequestError("unsupported content[].type")


def chat_render_options(body: Mapping[str, Any]) -> dict[str, Any]:
    """``add_generation_prompt`` and ``continue_final_message`` as oaicompat_chat_params_parse
    reads them (json_value: a flag that is not a boolean is its default, true; a continuation
    is ``true``, "content" or "reasoning_content", anything else none), with its two refusals."""
    flag = body.get("add_generation_prompt")
    add_generation_prompt = flag if isinstance(flag, bool) else True
    value = body.get("continue_final_message")
    continuation = (
        CONTINUE_AUTO
        if value is True
        else value
        if isinstance(value, str) and value in (CONTINUE_CONTENT, CONTINUE_REASONING)
        else None
    )
    if continuation is not None:
        if add_generation_prompt:
            raise RequestError(
                "Cannot set both add_generation_prompt and continue_final_message to true."
            )
        messages = body.get("messages") or []
        last = messages[-1] if messages else {}
        if last.get("role") == "assistant" and last.get("tool_calls"):
            raise RequestError("Cannot continue an assistant message that contains tool calls.")
    return {"add_generation_prompt": add_generation_prompt, "continue_final_message": continuation}


# --- grammar triggers, preserved tokens, the reasoning budget ---------------------------------------


@dataclass(frozen=True)
class GrammarFields:
    """/completion's lazy-grammar fields as llama-server reads them: ``grammar_lazy``,
    ``grammar_triggers`` (a one-token word made a token trigger), ``preserved_tokens`` (ids),
    ``generation_prompt`` and ``grammar_type``."""

    lazy: bool = False
    triggers: tuple[GrammarTrigger, ...] = ()
    preserved: frozenset[int] = frozenset()
    generation_prompt: str = ""
    grammar_type: str = ""

    def echoed(self) -> dict[str, Any]:
        """What generation_settings shows of them (task_params::to_json)."""
        return {
            "grammar_lazy": self.lazy,
            "grammar_triggers": [t.to_json() for t in self.triggers],
            "preserved_tokens": sorted(self.preserved),
            "generation_prompt": self.generation_prompt,
        }


def _items(value: Any) -> list[Any]:
    """A range-for over a JSON value: an array's items, an object's values, a scalar itself."""
    if isinstance(value, list):
        return value
    if isinstance(value, dict):
        return list(value.values())
    return [] if value is None else [value]


def _string(name: str, value: Any) -> str:
    """get<std::string>()."""
    if not isinstance(value, str):
        raise RequestError(
            f"Field '{name}': [json.exception.type_error.302] type must be string, "
            f"but is {json_type(value)}"
        )
    return value


def _integer(name: str, value: Any) -> int:
    """get<int>(): a number (truncated) or a boolean."""
    if not isinstance(value, (int, float)):
        raise RequestError(
            f"Field '{name}': [json.exception.type_error.302] type must be number, "
            f"but is {json_type(value)}"
        )
    return int(value)


def _at(name: str, obj: Any, key: str) -> Any:
    """json::at(key)."""
    if not isinstance(obj, dict):
        raise RequestError(
            f"Field '{name}': [json.exception.type_error.304] cannot use at() with {json_type(obj)}"
        )
    if key not in obj:
        raise RequestError(
            f"Field '{name}': [json.exception.out_of_range.403] key '{key}' not found"
        )
    return obj[key]


def grammar_fields(body: Mapping[str, Any], tokenize: Callable[[str], list[int]]) -> GrammarFields:
    """The schema's ``grammar_type`` (json_value: "" unless a string), ``grammar_lazy``,
    ``generation_prompt``, ``preserved_tokens`` and ``grammar_triggers``, in its order, with its
    refusals. ``tokenize``: text to tokens with special tokens parsed (common_tokenize(.., false,
    true)). A preserved token is a text of exactly one token; a word trigger of one token must be
    one of them and becomes a token trigger; a lazy grammar given an empty list of triggers is
    refused."""
    grammar_type = body.get("grammar_type")
    lazy = bool_field(body, "grammar_lazy", False)
    prompt = body.get("generation_prompt")
    generation_prompt = "" if prompt is None else _string("generation_prompt", prompt)
    preserved: set[int] = set()
    if body.get("preserved_tokens") is not None:
        for t in _items(body["preserved_tokens"]):
            ids = tokenize(_string("preserved_tokens", t))
            if len(ids) == 1:
                preserved.add(ids[0])
    triggers: list[GrammarTrigger] = []
    if body.get("grammar_triggers") is not None:
        name = "grammar_triggers"
        for t in _items(body[name]):
            kind = _integer(name, _at(name, t, "type"))
            value = _string(name, _at(name, t, "value"))
            token = _integer(name, _at(name, t, "token")) if kind == TRIGGER_TOKEN else None
            if kind == TRIGGER_WORD:
                ids = tokenize(value)
                if len(ids) == 1:
                    if ids[0] not in preserved:
                        raise RequestError(
                            f"Field '{name}': Grammar trigger word should be marked as "
                            f"preserved token: {value}"
                        )
                    triggers.append(GrammarTrigger(TRIGGER_TOKEN, value, ids[0]))
                    continue
            triggers.append(GrammarTrigger(kind, value, token))
        if lazy and not triggers:
            raise RequestError(f"Field '{name}': Error: no triggers set for lazy grammar!")
    return GrammarFields(
        lazy,
        tuple(triggers),
        frozenset(preserved),
        generation_prompt,
        grammar_type if isinstance(grammar_type, str) else "",
    )


# the budget fields, in the schema's order (a chat task passes the body's through)
BUDGET_FIELDS = (
    "reasoning_control",
    "reasoning_budget_tokens",
    "reasoning_budget_start_tag",
    "reasoning_budget_end_tags",
    "reasoning_budget_end_tag",
    "reasoning_budget_message",
)


def reasoning_budget_fields(
    body: Mapping[str, Any], tokenize: Callable[[str], list[int]], default_tokens: int = -1
) -> ReasoningBudgetSpec:
    """``reasoning_control``, ``reasoning_budget_tokens`` (-1 to INT32_MAX; the server's
    --reasoning-budget is the default), ``reasoning_budget_start_tag``,
    ``reasoning_budget_end_tags`` (or one ``reasoning_budget_end_tag``; empty tags left out) and
    ``reasoning_budget_message`` as llama-server reads them. The forced sequence (the message's
    tokens, then the first end tag's) is set only when the request names a message (any value;
    one that is not a string reads as "") and an end tag."""
    control = bool_field(body, "reasoning_control", False)
    tokens = _int_field(body, ("reasoning_budget_tokens",), default_tokens, -1, INT32_MAX)
    start: tuple[int, ...] = ()
    if body.get("reasoning_budget_start_tag") is not None:
        start = tuple(
            tokenize(_string("reasoning_budget_start_tag", body["reasoning_budget_start_tag"]))
        )
    end: tuple[tuple[int, ...], ...] = ()
    many, one = "reasoning_budget_end_tags", "reasoning_budget_end_tag"
    if body.get(many) is not None or body.get(one) is not None:
        name = many if body.get(many) is not None else one
        tags = _items(body[many]) if many in body else [body[one]]
        end = tuple(tuple(tokenize(tag)) for tag in (_string(name, t) for t in tags) if tag)
    forced: tuple[int, ...] = ()
    if body.get("reasoning_budget_message") is not None and end:
        message = body["reasoning_budget_message"]
        message = message if isinstance(message, str) else ""
        forced = (tuple(tokenize(message)) if message else ()) + end[0]
    return ReasoningBudgetSpec(tokens, start, end, forced, control)
