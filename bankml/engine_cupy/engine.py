"""The native engine: one model, one slot, requests parsed and run as llama-server runs them.

``Engine.open`` loads the model, its tokenizer and chat template. ``parse_request`` validates a
/completion or /v1/chat/completions body completely (prompt, stop strings, sampler parameters,
constraint, limits, context) before any compute, raising ``RequestError`` with llama-server's
status and message. ``run_steps`` prefills in micro-batches of 512 (reusing the longest common
prefix with the slot's tokens; with ``progress`` a ``Progress`` before and after each prompt
batch), then samples token by token, yielding ``Chunk``s; its
``summary`` holds finish reason, counts and timings once the iteration is over.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from bankml.engine_cupy import checkpoints as _checkpoints
from bankml.engine_cupy.chat_template import (
    CONTINUE_AUTO,
    CONTINUE_CONTENT,
    CONTINUE_REASONING,
    ChatTemplate,
    TemplateError,
)
from bankml.engine_cupy.checkpoints import Checkpoints, MessageSpans, find_spans
from bankml.engine_cupy.grammar import (
    Constraint,
    ConstraintError,
    ConstraintSpec,
    build_llg_tokenizer,
    resolve_constraint,
)
from bankml.engine_cupy.kv_cache import pad_cells
from bankml.engine_cupy.model import Model
from bankml.engine_cupy.prompt_cache import HostPromptCache, cache_ram_limit, longest_common_prefix
from bankml.engine_cupy.sampler import (
    LogitBias,
    Sampler,
    SamplerError,
    SamplerParams,
    TokenProbs,
    VocabInfo,
    logarithm,
    parse_logit_bias,
    post_sampling_probs,
    token_logprobs,
)
from bankml.engine_cupy.sampler import (
    warm_up as warm_up_sampler,
)
from bankml.engine_cupy.slots import copy_slot
from bankml.engine_cupy.tokenizer import Tokenizer

MICRO_BATCH = _checkpoints.N_UBATCH


def prompt_batches(start: int, end: int, checkpoints: bool) -> list[tuple[int, int]]:
    """The micro-batches [a, b) llama-server evaluates prompt positions start..end-1 in when no
    message starts are known (plain prompts): 512 at a time from start, and, with
    ``checkpoints`` (sliding-window models), its batches also end 516 and 4 tokens before the
    end. The cuts decide which attention kernel (tiled or one-row) each token sees; the engine's
    own loop (``Engine._batch_end``) also follows user-message starts and the slot's checkpoints."""
    out: list[tuple[int, int]] = []
    a = start
    while a < end:
        b = (
            _checkpoints.batch_end(a, end, MessageSpans(), [])
            if checkpoints
            else min(a + _checkpoints.N_BATCH, end)
        )
        out += _micro_batches(a, b)
        a = b
    return out


def _micro_batches(a: int, b: int) -> list[tuple[int, int]]:
    """llama_decode's split of one batch [a, b) into ubatches of 512."""
    return [(i, min(i + MICRO_BATCH, b)) for i in range(a, b, MICRO_BATCH)]


INT32_MAX = 2_147_483_647
INT64_MAX = 2**63 - 1
# the upper limit of n_cmpl without an engine to ask: llama-server's is n_parallel, the
# engine's slot count (parse_task_fields' n_slots)
N_SLOTS = 1
DEFAULT_SLOT_PROMPT_SIMILARITY = 0.1  # llama-server's --slot-prompt-similarity


class RequestError(ValueError):
    """A refused request: HTTP ``status`` with ``body`` (a message string or llama-server's JSON)."""

    def __init__(self, message: str, status: int = 400, body: dict | None = None, reason: str = ""):
        super().__init__(message)
        self.status = status
        self.body = body if body is not None else message
        self.reason = reason  # what bankml found wrong, where llama-server's message says less


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


@dataclass
class Chunk:
    """One generated token: the text released with it, its logprob entry, the first-token flag."""

    text: str
    entry: dict | None
    first: bool
    token: int | None
    timings: dict[str, Any] | None = (
        None  # the run's timings so far (llama-server's timings_per_token)
    )
    slot: int = -1  # the slot computing it


@dataclass
class Summary:
    finish_reason: str = "stop"
    text: str = ""
    tokens: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cancelled: bool = False
    stopping_word: str = ""
    timings: dict[str, Any] = field(default_factory=dict)
    slot: int = -1  # the slot the run ran in


# --- request parsing helpers ---------------------------------------------------------------------------


def _bool_field(body: Mapping[str, Any], name: str, default: bool) -> bool:
    """A field_bool: null keeps the default; anything but true/false is nlohmann's type error."""
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise RequestError(
            f"Field '{name}': [json.exception.type_error.302] type must be boolean, "
            f"but is {_json_type(value)}"
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
            out[name] = _bool_field(body, name, default)
        elif kind == "stream_options":
            out[name] = _include_usage(body, default)
        else:
            out[name] = _int_field(body, (name, *aliases), default, lo, hi)
    fields_ = body.get("response_fields")
    # json_value(..., vector<string>()): anything but an array of strings reads as "all fields"
    ok = isinstance(fields_, list) and all(isinstance(f, str) for f in fields_)
    out["response_fields"] = list(fields_) if ok else []
    return out


def _include_usage(body: Mapping[str, Any], default: bool) -> bool:
    """``stream_options.include_usage``: the schema reads ``stream_options`` only as an object
    (anything else is ignored) and its ``include_usage`` as a field_bool."""
    options = body.get("stream_options")
    return (
        _bool_field(options, "include_usage", default) if isinstance(options, Mapping) else default
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
                f"but is {_json_type(value)}"
            )
        v = int(value)
        if v < lo or v > hi:
            raise RequestError(
                f"Field '{name}': Value must be between {lo} <= value <= {hi}, but got {v}"
            )
        return v
    return default


def _is_integer(value: Any) -> bool:
    """nlohmann's is_number_integer()."""
    return isinstance(value, int) and not isinstance(value, bool)


def _is_mixed(value: Any) -> bool:
    """json_is_array_of_mixed_numbers_strings: an array with both a string and an integer."""
    return (
        isinstance(value, list)
        and any(isinstance(v, str) for v in value)
        and any(_is_integer(v) for v in value)
    )


def _lora_field(body: Mapping[str, Any]) -> list[Any]:
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


def _json_type(value: Any) -> str:
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
                f"but is {_json_type(word)}"
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
    return messages


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


# --- text release: UTF-8 and stop strings ------------------------------------------------------------


def incomplete_utf8_at(text: bytes) -> int:
    """validate_utf8: the length without a multi-byte character cut off at the end."""
    n = len(text)
    for i in range(1, min(4, n) + 1):
        c = text[n - i]
        if (
            (c & 0xE0) == 0xC0
            and i < 2
            or (c & 0xF0) == 0xE0
            and i < 3
            or (c & 0xF8) == 0xF0
            and i < 4
        ):
            return n - i
    return n


def find_partial_stop(text: bytes, stop: bytes) -> int:
    """string_find_partial_stop: where a suffix of ``text`` that begins ``stop`` starts, or -1."""
    for length in range(min(len(text), len(stop)), 0, -1):
        if text.endswith(stop[:length]):
            return len(text) - length
    return -1


class TextRelease:
    """process_token's text handling: hold incomplete UTF-8 and partial stop strings, cut at a stop."""

    def __init__(self, stops: Sequence[str]):
        self.stops = [s.encode("utf-8") for s in stops]
        self.text = b""
        self.sent = 0
        self.stopping_word = ""

    def push(self, piece: bytes, is_eog: bool) -> tuple[bytes | None, bool]:
        """Add a token's bytes; returns (released bytes or None while UTF-8 is incomplete, stopped)."""
        self.text += piece
        if incomplete_utf8_at(self.text) < len(self.text):
            return None, False
        pos = min(self.sent, len(self.text))
        tail = self.text[pos:]
        stop_pos, word = self._find_full(tail, len(piece))
        if stop_pos >= 0:
            self.text = self.text[: pos + stop_pos]
            self.stopping_word = word.decode("utf-8", "replace")
            pos = min(self.sent, len(self.text))
        elif not is_eog and any(find_partial_stop(tail, s) >= 0 for s in self.stops):
            return b"", False
        out = self.text[pos:]
        self.sent += len(out)
        return out, stop_pos >= 0

    def _find_full(self, tail: bytes, piece_len: int) -> tuple[int, bytes]:
        best, word = -1, b""
        for s in self.stops:
            start = max(len(tail) - (len(s) + piece_len), 0)
            p = tail.find(s, start)
            if p >= 0 and (best < 0 or p < best):
                best, word = p, s
        return best, word


def utf8_prefix_text(raw: bytes) -> str:
    """A logprob entry's ``token``: the incomplete trailing character cut, other bad bytes replaced."""
    return raw[: incomplete_utf8_at(raw)].decode("utf-8", "replace")


class LineLimits:
    """process_token's line rules: ``n_indent`` (once a newline was sent, a later line indented by
    fewer spaces/tabs ends the answer, cut after that line's indentation) and ``t_max_predict_ms``
    (a newline sent after that long since the first token ends it). Both stop with "limit"."""

    def __init__(self, n_indent: int, t_max_predict_ms: int):
        self.n_indent = n_indent
        self.t_max = t_max_predict_ms
        self.has_new_line = False
        self.last_nl_pos = 0

    def stops(self, release: TextRelease, sent: bytes, gen_ms: float) -> bool:
        stop = self.has_new_line and self.n_indent > 0 and self._indent_stop(release)
        if b"\n" in sent:
            self.has_new_line = True
            if self.t_max > 0 and gen_ms > self.t_max:
                stop = True
        return stop

    def _indent_stop(self, release: TextRelease) -> bool:
        text = release.text
        stop = False
        if self.last_nl_pos > 0:
            pos = self.last_nl_pos
            while pos < len(text) and text[pos : pos + 1] in (b" ", b"\t"):
                pos += 1
            if pos < len(text) and pos - self.last_nl_pos < self.n_indent:
                release.text = text[:pos]  # the short line is cut, its indentation kept
                stop = True
        nl = text.find(b"\n", self.last_nl_pos)
        if nl != -1:
            self.last_nl_pos = nl + 1
        return stop


# --- timings ---------------------------------------------------------------------------------------------


@dataclass
class Clock:
    t_start: float = 0.0
    t_prompt: float = 0.0
    t_gen: float = 0.0

    def timings(self, cache_n: int, prompt_n: int, predicted_n: int) -> dict[str, Any]:
        """server_slot_stats' times and rates, by its formulas: a rate is 0.0 until its time is
        known; generation's rate counts decode steps (the first token comes free from the
        prompt's logits), its time at least 1 us once the first token is out."""
        prompt_ms = round((self.t_prompt - self.t_start) * 1e3, 3) if self.t_prompt else 0.0
        predicted_ms = (
            round(max((self.t_gen - self.t_prompt) * 1e3, 0.001), 3) if self.t_gen else 0.0
        )
        return {
            "cache_n": cache_n,
            "prompt_n": prompt_n,
            "prompt_ms": prompt_ms,
            "prompt_per_second": 1e3 / prompt_ms * prompt_n if prompt_ms > 0 else 0.0,
            "predicted_n": predicted_n,
            "predicted_ms": predicted_ms,
            "predicted_per_second": 1e3 / predicted_ms * max(predicted_n - 1, 0)
            if predicted_ms > 0
            else 0.0,
        }


@dataclass(frozen=True)
class Progress:
    """Prompt processing so far (llama-server's ``prompt_progress``, with ``return_progress``):
    once the cached prefix is known, then after each prompt batch."""

    total: int
    cache: int
    processed: int
    time_ms: int
    timings: dict[str, Any]
    slot: int = -1  # the slot computing the prompt

    def as_json(self) -> dict[str, int]:
        return {
            "total": self.total,
            "cache": self.cache,
            "processed": self.processed,
            "time_ms": self.time_ms,
        }


def _progress(
    clock: Clock, total: int, cache: int, processed: int, done: bool, slot: int = -1
) -> Progress:
    """The prompt's progress now: ``done`` after a batch (its time counts as prompt time)."""
    now = time.perf_counter()
    elapsed = Clock(t_start=clock.t_start, t_prompt=now if done else 0.0)
    return Progress(
        total,
        cache,
        processed,
        int((now - clock.t_start) * 1e3),
        elapsed.timings(cache, processed - cache, 0),
        slot,
    )


# --- the engine --------------------------------------------------------------------------------------------


@dataclass
class Forward:
    """A run's request for one forward pass: ``tokens`` evaluated into ``cache`` by ``model``.
    The run is a coroutine: it yields a Forward and is sent the last row's logits back, so
    whoever drives it decides when (and batched with what) the pass runs."""

    model: Any
    tokens: list[int]
    cache: Any
    prompt: bool = False  # a prompt micro-batch (the scheduler counts their tokens)

    is_forward = True  # what the serving layer recognises it by (it imports no NumPy)

    @property
    def decode(self) -> bool:
        """One token after the prompt: a decode step (the ones a batch step can share)."""
        return len(self.tokens) == 1

    def compute(self) -> Any:
        return self.model.forward(self.tokens, self.cache)


class Steps:
    """An iteration over a run's chunks (and progress, when asked); ``summary`` is filled when
    it ends. Iterating computes each forward pass inline; ``coroutine`` is the run itself, for
    a scheduler that yields ``Forward``s and wants the logits sent back."""

    def __init__(self, gen_factory: Callable[[Steps], Generator[Any, Any, None]]):
        self.summary = Summary()
        self.coroutine = gen_factory(self)

    def __iter__(self) -> Iterator[Chunk | Progress]:
        return self

    def __next__(self) -> Chunk | Progress:
        item = next(self.coroutine)
        while isinstance(item, (Forward, Waiting)):
            if isinstance(item, Waiting):  # no parent runs beside it here: it computes its own
                item.shared.abandon()
                item = self.coroutine.send(None)
            else:
                item = self.coroutine.send(item.compute())
        return item


@dataclass(eq=False)
class SharedPrompt:
    """One prompt computed once for its ``n_cmpl`` completions on several slots, as
    llama-server's parent task and its children: each child's run takes a slot and waits
    (``join``, yielding ``Waiting``) while the parent's run computes the prompt; when the
    parent's prefill ends (``publish``), each waiting child's slot becomes a copy of the
    parent's (slots.copy_slot: KV cells, tokens, checkpoints) and the child samples its first
    token from a copy of the parent's last logits, reporting the parent's cache_n and prompt
    start. A parent that ends without its logits (cancelled, refused) ``abandon``s: the
    children still waiting compute the prompt themselves."""

    done: bool = False
    logits: Any = None  # the parent's last prompt logits (None: each child computes its own)
    cache_n: int = 0
    t_start: float = 0.0
    waiting: dict[int, Slot] = field(default_factory=dict)  # by slot id
    copied: set[int] = field(default_factory=set)  # the slots that got the parent's state

    def publish(self, slot: Slot, cache_n: int, logits: Any, t_start: float) -> None:
        """The parent's prefill is over: its state goes to every waiting child's slot."""
        if self.done:
            return
        if logits is not None:
            for child in self.waiting.values():
                copy_slot(slot, child)
                self.copied.add(child.id)
            self.logits, self.cache_n, self.t_start = logits.copy(), cache_n, t_start
        self.done = True
        self.waiting = {}

    def abandon(self) -> None:
        """The parent will not publish (it ended, or no scheduler runs it beside its children)."""
        self.done = True
        self.waiting = {}

    def join(self, slot: Slot, cancelled: Callable[[], bool]) -> Generator[Waiting, Any, bool]:
        """A child waits on its slot until the parent publishes; True when its slot got the
        parent's state, False when it must compute the prompt itself (or was cancelled)."""
        if not self.done:
            self.waiting[slot.id] = slot
        try:
            while not self.done:
                if cancelled():
                    return False
                yield Waiting(self)
        finally:
            self.waiting.pop(slot.id, None)  # a child that left is never copied into
        return slot.id in self.copied


@dataclass(eq=False)
class Waiting:
    """A child run waiting for its parent's prompt (``SharedPrompt.join``): it needs no
    forward pass this iteration; the scheduler resumes it at the next."""

    shared: SharedPrompt

    is_wait = True  # what the serving layer recognises it by


@dataclass
class Slot:
    """One of the server's slots: its KV cache and the tokens it holds, its context
    checkpoints (sliding-window models), the task it runs or last ran, and when it was last
    used (llama-server's least-recently-used choice)."""

    id: int
    cache: Any
    n_ctx: int
    tokens: list[int] = field(default_factory=list)
    checkpoints: Checkpoints | None = None
    task_id: int = -1
    processing: bool = False
    t_last_used: int = -1


def slot_context(n_ctx: int, n_slots: int, kv_unified: bool) -> int:
    """llama_context's n_ctx_seq: each slot's positions. A unified cache gives each the whole
    context; otherwise the context is divided between the slots, each part padded to 256."""
    n_ctx = pad_cells(n_ctx)
    if kv_unified or n_slots <= 1:
        return n_ctx
    return pad_cells(n_ctx // n_slots)


def compile_kernels(
    path: str | os.PathLike,
    *,
    device: str = "auto",
    cache_type: str | None = None,
    report: Callable[[str], None] | None = None,
) -> Any:
    """Compile (or load from Numba's cache) the kernels the model at ``path`` reaches, then
    let the model go; returns kernels.progress.CompileStats.

    For a start-up that compiles while it hashes the file: once the file's header has passed
    the guard, call this on the thread that will run the engine (it starts the kernels' worker
    team, Model.load) while another thread checks the pin. Numba keeps the compiled kernels in
    the process, so the Engine.open and warm_up that follow the pin take seconds. Nothing is
    answered from the model loaded here."""
    model = Model.load(path, device=device, progress=False)
    return _warm_up(model, cache_type, report)


def _warm_up(model: Any, cache_type: str | None, report: Callable[[str], None] | None) -> Any:
    """The model's kernels, then the sampler's top-k (else the first draw compiles it)."""
    stats = model.warm_up(cache_type, report)
    warm_up_sampler()
    return stats


class Engine:
    """One resident model with ``n_slots`` slots (each a KV cache of ``n_ctx`` positions and the
    tokens it holds), one host prompt cache for all of them. ``cache``, ``slot_tokens`` and
    ``checkpoints`` are slot 0's (a one-slot engine's only slot)."""

    def __init__(
        self,
        model: Any,
        tokenizer: Tokenizer,
        template: ChatTemplate | None,
        n_ctx: int,
        cache_type: str | None = None,
        sampling_defaults: SamplerParams | None = None,
        cache_ram: int | str | None = None,
        n_slots: int = 1,
        slot_prompt_similarity: float = DEFAULT_SLOT_PROMPT_SIMILARITY,
    ):
        if n_slots < 1:
            raise ValueError("an engine has at least one slot")
        self.model = model
        self.tokenizer = tokenizer
        self.template = template
        self.n_ctx = n_ctx
        self.n_vocab = int(model.n_vocab)
        self.host_cache = HostPromptCache(cache_ram_limit(cache_ram))  # MiB, as --cache-ram
        self.defaults = sampling_defaults or SamplerParams()
        self.n_predict = -1  # the server's -n: where a request's n_predict is -1 or absent
        self._pieces = tokenizer.vocab_bytes()
        self._text_pieces = [tokenizer.token_to_piece(i, False) for i in range(tokenizer.n_vocab)]
        # built on first use, by the prepare thread (parsing) or the engine thread alike
        self._lazy_lock = threading.Lock()
        self._llg: Any = None
        self._chat_delimiters: list[tuple[str, list[int]]] | None = None
        # llama-server's context checkpoints: only for sliding-window models (n_swa > 0)
        swa = getattr(model, "has_sliding_window", False)
        self.slots = [
            Slot(
                i,
                model.new_cache(n_ctx, cache_type),
                n_ctx,
                checkpoints=Checkpoints(model.hp.swa_window) if swa else None,
            )
            for i in range(n_slots)
        ]
        self.slot_prompt_similarity = float(slot_prompt_similarity)
        self._task_id = 0  # the last task's id, counted over all slots (as llama-server's)
        self._uses = 0  # a clock for the slots' t_last_used
        self._vocab_info = VocabInfo(self._pieces, lambda s: self.tokenize(s))

    @classmethod
    def open(
        cls,
        path: str | os.PathLike,
        n_ctx: int = 4096,
        device: str = "auto",
        cache_type: str | None = None,
        cache_ram: int | str | None = None,
        n_slots: int = 1,
        kv_unified: bool = False,
        slot_prompt_similarity: float = DEFAULT_SLOT_PROMPT_SIMILARITY,
    ) -> Engine:
        """Load ``path`` for ``n_ctx`` positions on ``device``, with a KV cache of ``cache_type``
        (f16 or q8_0; None: f16) and a host prompt cache of ``cache_ram`` MiB (None: the default
        of prompt_cache.cache_ram_limit). ``n_slots`` slots share the context (each
        ``slot_context``: all of it with ``kv_unified``). Call it on the thread that will run
        the engine: on the CPU that thread starts and owns the kernels' worker team
        (kernels.jit)."""
        model = Model.load(path, device=device)
        tokenizer = Tokenizer.from_gguf(model.reader)
        template = ChatTemplate.from_gguf(model.reader, tokenizer)
        # as llama_context: -c 1000 holds 1024 positions (then each slot its share)
        n_ctx = slot_context(n_ctx, n_slots, kv_unified)
        return cls(
            model,
            tokenizer,
            template,
            n_ctx,
            cache_type,
            _gguf_sampling_defaults(model.reader),
            cache_ram,
            n_slots,
            slot_prompt_similarity,
        )

    # --- slots ----------------------------------------------------------------------------------------------

    @property
    def n_slots(self) -> int:
        return len(self.slots)

    @property
    def cache(self) -> Any:
        return self.slots[0].cache

    @property
    def slot_tokens(self) -> list[int]:
        return self.slots[0].tokens

    @slot_tokens.setter
    def slot_tokens(self, tokens: list[int]) -> None:
        self.slots[0].tokens = tokens

    @property
    def checkpoints(self) -> Checkpoints | None:
        return self.slots[0].checkpoints

    def free_slots(self) -> int:
        return sum(not slot.processing for slot in self.slots)

    def choose_slot(self, prompt: Sequence[int]) -> tuple[Slot, bool]:
        """llama-server's get_available_slot among the idle slots: the one whose tokens share
        the largest fraction of ``prompt`` (above ``slot_prompt_similarity``), else the least
        recently used (the last of equals, as its ``<=``). Returns the slot and whether the host
        prompt cache is to be updated for it (chosen by use, or keeping under half its tokens).
        Raises RuntimeError when every slot is busy (the scheduler never asks then)."""
        chosen: Slot | None = None
        update_cache = False
        threshold = np.float32(self.slot_prompt_similarity)
        if threshold != 0.0 and prompt:
            best = np.float32(0.0)
            best_lcp = 0
            for slot in self.slots:
                if slot.processing or not slot.tokens:
                    continue
                lcp = longest_common_prefix(slot.tokens, prompt)
                sim = np.float32(lcp) / np.float32(len(prompt))
                if sim > best and sim > threshold:
                    best, best_lcp, chosen = sim, lcp, slot
            if chosen is not None:
                update_cache = best_lcp / len(chosen.tokens) < 0.5  # f_keep
        if chosen is None:
            t_last = -1
            for slot in self.slots:
                if slot.processing:
                    continue
                if chosen is None or slot.t_last_used <= t_last:
                    t_last, chosen = slot.t_last_used, slot
            update_cache = True
        if chosen is None:
            raise RuntimeError("every slot is busy")
        return chosen, update_cache

    def free_slot(self) -> Slot:
        """llama-server's get_free_slots for a child task: the first idle slot in id order (its
        contents are replaced by its parent's, so neither similarity nor the host prompt cache
        has a say). Raises RuntimeError when every slot is busy."""
        for slot in self.slots:
            if not slot.processing:
                return slot
        raise RuntimeError("every slot is busy")

    def share_prompt(self, completions: Sequence[Request]) -> list[Request]:
        """One prompt's completions (parent first, then its children) made to compute the
        prompt once (``SharedPrompt``): only for runs that a scheduler advances side by side,
        all admitted at once."""
        if len(completions) < 2:
            return list(completions)
        shared = SharedPrompt()
        return [
            replace(req, shared=shared, shared_child=j > 0) for j, req in enumerate(completions)
        ]

    def _acquire(self, slot: Slot) -> None:
        slot.processing = True
        self._task_id += 1
        slot.task_id = self._task_id

    def _release(self, slot: Slot) -> None:
        self._uses += 1
        slot.processing = False
        slot.t_last_used = self._uses

    def warm_up(self, report: Callable[[str], None] | None = None) -> Any:
        """Run each kernel a request can reach once (Model.warm_up), for this cache's type;
        ``report`` is told what compiles (kernels.progress). Returns its CompileStats."""
        return _warm_up(self.model, self.cache.cache_type, report)

    # --- text ---------------------------------------------------------------------------------------------

    def tokenize(
        self, text: str, add_special: bool = False, parse_special: bool = False
    ) -> list[int]:
        return self.tokenizer.tokenize(text, add_special=add_special, parse_special=parse_special)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.tokenizer.detokenize(ids)

    def apply_template(self, messages: Sequence[Mapping[str, Any]], **kwargs: Any) -> str:
        if self.template is None:
            raise RequestError("this model has no chat template")
        return self.template.render(messages, **kwargs)

    def llg_tokenizer(self) -> Any:
        """llguidance's view of the vocabulary, built on first use (about a second)."""
        with self._lazy_lock:
            if self._llg is None:
                self._llg = build_llg_tokenizer(
                    self._pieces,
                    self.tokenizer.eog_ids,
                    self.tokenizer.bos_id,
                    lambda s: self.tokenize(s),
                )
            return self._llg

    # --- requests -------------------------------------------------------------------------------------------

    def parse_request(self, request: Mapping[str, Any], kind: str) -> Request:
        """Validate a one-prompt request body completely; raises RequestError (status 400) before any
        compute. A /completion body with several prompts is ``parse_batch``'s."""
        requests = self.parse_batch(request, kind)
        if len(requests) > 1:
            raise RequestError(
                "several prompts in one request are answered on /completion (llama-server's "
                "array of results); send them there or one per request"
            )
        return requests[0]

    def parse_batch(self, request: Mapping[str, Any], kind: str) -> list[Request]:
        """Validate a body into one Request per prompt (llama-server's tasks of one request: the same
        parameters, each prompt answered as if alone). Fields are read in llama-server's schema order,
        so the first refusal is the one it gives."""
        if not isinstance(request, Mapping):
            raise RequestError("request body must be a JSON object")
        body = dict(request)
        try:
            if kind == "chat":
                prompts = [self._chat_prompt(body)]
            elif kind == "completion":
                prompts = self._completion_prompts(body)
            else:
                raise ValueError(f"unknown request kind {kind!r}")
            task = parse_task_fields(body, self.n_slots)
            if kind == "chat":
                task.update(self._continuation(body))
                if task["verbose"]:  # __verbose shows the chat parser's generation prompt
                    task["generation_prompt"] = self._generation_prompt(body)
            params = SamplerParams.from_request(body, self.defaults)
            task["backend_sampling"] = _bool_field(
                body, "backend_sampling", False
            )  # no backend here: no effect
            post_sampling = _bool_field(body, "post_sampling_probs", False)
            task["lora"] = _lora_field(body)
            constraint = resolve_constraint(body, kind)
            if constraint is not None and constraint.kind == "chat_schema":
                constraint = constraint.with_generation_prompt(self._generation_prompt(body))
            if constraint is not None:
                Constraint(constraint, self.llg_tokenizer(), self.n_vocab, self.tokenizer.eog_ids)
            params = self._with_biases(body, params)
            stop = parse_stop(body)
            if params.dry_multiplier != 0.0:
                self._new_sampler(params)  # breaker tokenization can refuse
        except (SamplerError, TemplateError) as err:
            raise RequestError(str(err)) from None
        except ConstraintError as err:
            raise RequestError(str(err), reason=err.reason) from None
        delimiters = self._message_delimiters(body, kind)
        out = []
        for prompt_text, tokens in prompts:
            self._check_context(tokens)
            out.append(
                Request(
                    kind,
                    tokens,
                    params,
                    constraint,
                    task["n_predict"] if task["n_predict"] != -1 else self.n_predict,
                    stop,
                    max(params.n_probs, 0),
                    task["cache_prompt"],
                    prompt_text,
                    post_sampling,
                    task["n_indent"],
                    task["t_max_predict_ms"],
                    task,
                    find_spans(tokens, delimiters),
                )
            )
        return out

    def _message_delimiters(
        self, body: Mapping[str, Any], kind: str
    ) -> list[tuple[str, list[int]]]:
        """The role markers llama-server finds message starts by, for its context checkpoints
        (a sliding-window model only): a chat prompt's come from the template's analysis, a
        /completion body may give its own ``message_delimiters`` ([{role, delimiter}])."""
        if self.slots[0].checkpoints is None:  # not a sliding-window model
            return []
        if kind == "chat":
            with self._lazy_lock:
                if self._chat_delimiters is None:
                    markers = [
                        ("assistant", _checkpoints.assistant_start_marker(self.apply_template)),
                        ("user", _checkpoints.user_start_marker(self.apply_template)),
                    ]
                    self._chat_delimiters = [
                        (role, self.tokenize(text, parse_special=True))
                        for role, text in markers
                        if text
                    ]
                return self._chat_delimiters
        given = body.get("message_delimiters")
        if not isinstance(given, list):  # json_value: anything but an array reads as none
            return []
        return [
            (d.get("role"), self.tokenize(str(d.get("delimiter", "")), parse_special=True))
            for d in given
            if isinstance(d, dict)
        ]

    def _with_biases(self, body: Mapping[str, Any], params: SamplerParams) -> SamplerParams:
        """logit_bias, then ignore_eos's -inf on every end-of-generation token (appended, as
        llama-server appends its logit_bias_eog)."""
        biases: tuple[LogitBias, ...] = params.logit_bias
        if body.get("logit_bias") is not None:
            biases = parse_logit_bias(
                body["logit_bias"], self.n_vocab, lambda text: self.tokenize(text)
            )
        ignore_eos = _bool_field(body, "ignore_eos", params.ignore_eos)
        if ignore_eos and body.get("ignore_eos") is not None:
            biases += tuple(LogitBias(-float("inf"), t) for t in sorted(self.tokenizer.eog_ids))
        return replace(params, logit_bias=biases, ignore_eos=ignore_eos)

    def chat_prompt_tokens(self, body: Mapping[str, Any]) -> list[int]:
        """The tokens a chat body's prompt evaluates (its template, messages and logprobs checks
        as a chat's, nothing else; no context check): POST /chat/completions/input_tokens."""
        return self._chat_prompt(dict(body))[1]

    def _chat_prompt(self, body: dict[str, Any]) -> tuple[str, list[int]]:
        messages = check_chat_messages(body)
        chat_logprobs(body)
        kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict):
            raise RequestError("chat_template_kwargs must be an object")
        text = self.apply_template(
            messages, tools=body.get("tools"), **chat_render_options(body), **kwargs
        )
        return text, self.tokenize(text, add_special=True, parse_special=True)

    def _continuation(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """What a continued last message does to a chat's answer: its content starts the
        answer's (``prefill``); a stream sends it with the first piece unless
        ``continue_final_message`` asked for the continuation without ``echo``
        (``prefill_streamed``)."""
        assert self.template is not None  # _chat_prompt rendered the messages
        continuation = chat_render_options(body)["continue_final_message"]
        return {
            "prefill": self.template.continued_content(body["messages"], continuation),
            "prefill_streamed": continuation is None or body.get("echo") is True,
        }

    def _generation_prompt(self, body: Mapping[str, Any]) -> str:
        """The assistant-turn text a chat schema's grammar starts with (checked by _chat_prompt)."""
        assert self.template is not None
        kwargs = body.get("chat_template_kwargs") or {}
        return self.template.generation_prompt(body["messages"], body.get("tools"), **kwargs)

    def _completion_prompts(self, body: Mapping[str, Any]) -> list[tuple[str, list[int]]]:
        """tokenize_input_prompts: an array without integers is several prompts, anything else one.
        Each prompt's text is its tokens detokenized with special tokens, as /completion reports it."""
        if "prompt" not in body:
            raise RequestError("[json.exception.out_of_range.403] key 'prompt' not found")
        prompt = body["prompt"]
        if isinstance(prompt, list) and not any(_is_integer(p) for p in prompt):
            if not prompt:
                raise RequestError('"prompt" must not be empty')
            parts = [self._subprompt(p) for p in prompt]
        else:
            parts = [self._subprompt(prompt)]
        return [
            (self.tokenizer.detokenize(tokens, unparse_special=True), tokens) for tokens in parts
        ]

    def _subprompt(self, prompt: Any) -> list[int]:
        """tokenize_input_subprompt: a string, ids, ids mixed with strings, or {"prompt_string": ...}."""
        if isinstance(prompt, str) or _is_mixed(prompt):
            return self._mixed_prompt(prompt)
        if isinstance(prompt, list) and all(_is_integer(t) for t in prompt):
            return self._valid_ids(prompt)
        if isinstance(prompt, dict) and "prompt_string" in prompt:
            if "multimodal_data" in prompt:
                raise RequestError(
                    "Multimodal data provided, but model does not support multimodal requests."
                )
            return self._mixed_prompt(prompt["prompt_string"])
        raise RequestError(
            '"prompt" elements must be a string, a list of tokens, a JSON object containing a '
            "prompt string, or a list of mixed strings & tokens."
        )

    def _valid_ids(self, ids: Sequence[int]) -> list[int]:
        if any(t < 0 or t >= self.n_vocab for t in ids):
            raise RequestError("Prompt contains invalid tokens")
        return list(ids)

    def _mixed_prompt(self, prompt: Any) -> list[int]:
        """tokenize_mixed: a string, or strings and ids (special tokens parsed; BOS per the vocabulary
        only before a leading string)."""
        if isinstance(prompt, str):
            return self.tokenize(prompt, add_special=True, parse_special=True)
        if not isinstance(prompt, list):
            raise RequestError(
                f"[json.exception.type_error.302] type must be string, but is {_json_type(prompt)}"
            )
        out: list[int] = []
        for i, part in enumerate(prompt):
            if isinstance(part, str):
                out += self.tokenize(part, add_special=i == 0, parse_special=True)
            elif isinstance(part, (int, float)) and not isinstance(part, bool):
                out += self._valid_ids([int(part)])  # get<llama_token>() truncates a float
            else:
                raise RequestError(
                    f"[json.exception.type_error.302] type must be number, but is {_json_type(part)}"
                )
        return out

    def _check_context(self, tokens: Sequence[int]) -> None:
        if len(tokens) >= self.n_ctx:  # each slot's context
            message = (
                f"request ({len(tokens)} tokens) exceeds the available context size ({self.n_ctx} "
                f"tokens), try increasing it"
            )
            raise RequestError(
                message,
                400,
                {
                    "error": {
                        "code": 400,
                        "message": message,
                        "type": "exceed_context_size_error",
                        "n_prompt_tokens": len(tokens),
                        "n_ctx": self.n_ctx,
                    }
                },
            )

    # --- running --------------------------------------------------------------------------------------------

    def _new_sampler(self, params: SamplerParams) -> Sampler:
        return Sampler(params, self._vocab_info, self.n_vocab)

    def run_steps(
        self,
        request: Request,
        cancelled: Callable[[], bool] = lambda: False,
        progress: bool = False,
    ) -> Steps:
        """Prefill then generate in a slot chosen when the run starts (``choose_slot``);
        iterate for Chunks (and, with ``progress``, a ``Progress`` before the first batch and
        after each), then read ``.summary``. ``.coroutine`` yields each forward pass as a
        ``Forward`` too, for the caller to compute and send back."""
        return Steps(lambda steps: self._run(request, cancelled, steps.summary, progress))

    def _prefill(
        self,
        slot: Slot,
        update_cache: bool,
        tokens: list[int],
        cache_prompt: bool,
        cancelled: Callable[[], bool],
        spans: MessageSpans | None = None,
        clock: Clock | None = None,
    ) -> Iterator[Progress]:
        """Reuse the slot's common prefix (re-evaluating the last prompt token when all of it is
        cached; for a sliding-window model, as far as llama-server's checkpoints allow), then
        evaluate the rest in llama-server's batches. Yields a ``Progress`` when the prefix is
        known and after each batch, when given the run's ``clock``; returns (cache_n, last
        logits or None if cancelled)."""
        if cache_prompt and update_cache:
            self._use_host_cache(slot, tokens)
        n_past = longest_common_prefix(slot.tokens, tokens) if cache_prompt else 0
        cache = slot.cache
        if slot.checkpoints is not None:
            n_past = slot.checkpoints.reuse(
                n_past, len(tokens), len(slot.tokens), cache.pos_min, cache.load_ring
            )
        if n_past == len(tokens):
            n_past -= 1
        cache.truncate(n_past)
        slot.tokens = slot.tokens[:n_past]
        if clock is not None:
            yield _progress(clock, len(tokens), n_past, n_past, False, slot.id)
        logits = None
        start = n_past
        while start < len(tokens):
            end = self._batch_end(slot, start, len(tokens), spans or MessageSpans())
            for a, b in _micro_batches(start, end):
                if cancelled():
                    return n_past, None
                batch = tokens[a:b]
                logits = yield Forward(self.model, batch, cache, prompt=True)
                slot.tokens += batch
            start = end
            if clock is not None:
                yield _progress(clock, len(tokens), n_past, end, True, slot.id)
        return n_past, logits

    def _batch_end(self, slot: Slot, start: int, n_prompt: int, spans: MessageSpans) -> int:
        """Where llama-server's prompt batch from ``start`` ends; for a sliding-window model the
        checkpoint it takes before decoding that batch is recorded here."""
        ckpts = slot.checkpoints
        if ckpts is None:
            return min(start + _checkpoints.N_BATCH, n_prompt)
        end = _checkpoints.batch_end(start, n_prompt, spans, ckpts.items, ckpts.min_step)
        cache = slot.cache
        pos_min = cache.pos_min
        if _checkpoints.takes_checkpoint(
            start, end, n_prompt, pos_min, spans, ckpts.items, ckpts.min_step
        ):
            ckpts.create(start, pos_min, cache.pos_max, slot.task_id, cache.ring_positions())
        return end

    def _use_host_cache(self, slot: Slot, prompt: list[int]) -> None:
        """llama-server's --cache-ram (one cache for all slots): keep the slot's context (and
        its checkpoints) for later, bring back a better one."""
        if not self.host_cache.enabled:
            return
        held = slot.checkpoints.items if slot.checkpoints is not None else []
        self.host_cache.save(slot.tokens, slot.cache, held)
        entry = self.host_cache.take_better(slot.tokens, prompt)
        if entry is not None:
            slot.cache.restore(entry.kv, len(entry.tokens))
            if entry.ring is not None:
                slot.cache.load_ring(entry.ring)  # the ring as the entry held it
            slot.tokens = list(entry.tokens)
            if slot.checkpoints is not None:
                slot.checkpoints.items = list(entry.checkpoints)

    def _run(
        self, req: Request, cancelled: Callable[[], bool], summary: Summary, progress: bool = False
    ) -> Generator[Chunk | Progress | Forward, Any, None]:
        clock = Clock(t_start=time.perf_counter())
        tokens = req.prompt_tokens
        summary.prompt_tokens = len(tokens)
        shared = req.shared
        try:
            if not tokens:
                return
            if shared is not None and req.shared_child:
                slot, update_cache = self.free_slot(), False
            else:
                slot, update_cache = self.choose_slot(tokens)
            self._acquire(slot)
            try:
                yield from self._generate(
                    slot, update_cache, req, cancelled, summary, clock, progress
                )
            finally:
                self._release(slot)
        finally:
            if shared is not None and not req.shared_child:
                shared.abandon()  # a parent that ended before its prompt did: children compute

    def _generate(
        self,
        slot: Slot,
        update_cache: bool,
        req: Request,
        cancelled: Callable[[], bool],
        summary: Summary,
        clock: Clock,
        progress: bool,
    ) -> Generator[Chunk | Progress | Forward, Any, None]:
        tokens = req.prompt_tokens
        summary.slot = slot.id
        sampler = self._new_sampler(req.sampler)
        constraint = (
            Constraint(req.constraint, self.llg_tokenizer(), self.n_vocab, self.tokenizer.eog_ids)
            if req.constraint
            else None
        )
        cache_n, logits = yield from self._prompt(
            slot, update_cache, req, cancelled, clock, progress
        )
        prompt_n = len(tokens) - cache_n
        summary.timings = clock.timings(cache_n, prompt_n, 0)
        if logits is None:
            summary.cancelled = True
            return
        for t in tokens:
            sampler.accept(t)
        release = TextRelease(req.stop)
        lines = LineLimits(req.n_indent, req.t_max_predict_ms)
        eog = self.tokenizer.eog_ids
        n_gen = 0
        raw = b""
        while True:
            if cancelled():
                summary.cancelled = True
                break
            token = self._sample(sampler, constraint, logits)
            sampler.accept(token)
            if constraint is not None:
                constraint.accept(token)
            n_gen += 1
            now = time.perf_counter()
            if n_gen == 1:
                clock.t_prompt = now
            clock.t_gen = now
            summary.tokens.append(token)
            piece = self._text_pieces[token]
            raw += piece
            released, hit_stop = release.push(piece, token in eog)
            entry = None
            if released is not None and req.n_probs > 0:
                probs = (
                    post_sampling_probs(sampler.last, req.n_probs, token)
                    if req.post_sampling_probs and sampler.last is not None
                    else token_logprobs(logits, req.n_probs, token)
                )
                entry = self._entry(probs, token, released, req.post_sampling_probs)
            yield Chunk(
                released.decode("utf-8", "replace") if released else "",
                entry,
                n_gen == 1,
                token,
                clock.timings(cache_n, prompt_n, n_gen),
                slot.id,
            )
            finish = self._finish(slot, req, token, n_gen, hit_stop, eog)
            # n_indent / t_max_predict_ms come after the limits and before EOG in process_token
            if lines.stops(
                release, piece if released is None else released, (now - clock.t_prompt) * 1e3
            ):
                finish = "stop" if token in eog else "length"
            if finish:
                summary.finish_reason = finish
                break
            logits = yield Forward(self.model, [token], slot.cache)
            slot.tokens.append(token)
        summary.text = release.text.decode("utf-8", "replace")
        summary.stopping_word = release.stopping_word
        summary.completion_tokens = n_gen
        summary.timings = clock.timings(cache_n, prompt_n, n_gen)

    def _prompt(
        self,
        slot: Slot,
        update_cache: bool,
        req: Request,
        cancelled: Callable[[], bool],
        clock: Clock,
        progress: bool,
    ) -> Generator[Progress | Forward | Waiting, Any, tuple[int, Any]]:
        """The prompt in the slot: (cache_n, its last logits; None when cancelled). A shared
        prompt's child takes its parent's (``SharedPrompt``: no progress, the parent's prompt
        start for its timings); a parent publishes its own when its prefill ends."""
        shared = req.shared
        if shared is not None and req.shared_child:
            if (yield from shared.join(slot, cancelled)):
                clock.t_start = shared.t_start
                return shared.cache_n, shared.logits.copy()  # its own: sampling may write it
            if cancelled():
                return 0, None
        cache_n, logits = yield from self._prefill(
            slot,
            update_cache,
            req.prompt_tokens,
            req.cache_prompt,
            cancelled,
            req.spans,
            clock if progress else None,
        )
        if shared is not None and not req.shared_child:
            shared.publish(slot, cache_n, logits, clock.t_start)
        return cache_n, logits

    def _sample(self, sampler: Sampler, constraint: Constraint | None, logits: np.ndarray) -> int:
        if constraint is None:
            return sampler.sample(logits)
        return sampler.sample(logits, constraint.allows, constraint.mask)

    def _finish(
        self, slot: Slot, req: Request, token: int, n_gen: int, hit_stop: bool, eog: frozenset[int]
    ) -> str | None:
        """process_token's order: stop word, context full, n_predict, then EOG."""
        finish = "stop" if hit_stop else None
        if (
            len(slot.tokens) + 1 >= slot.n_ctx
            or finish is None
            and req.n_predict != -1
            and n_gen >= req.n_predict
        ):
            finish = "length"
        if token in eog:
            finish = "stop"
        return finish

    def _entry(self, probs: TokenProbs, token: int, released: bytes, post_sampling: bool) -> dict:
        """A probabilities entry in llama-server's shape: ``logprob``/``top_logprobs`` from the raw
        logits, or with post_sampling_probs ``prob``/``top_probs`` from the chain's candidates."""
        key, top_key = ("prob", "top_probs") if post_sampling else ("logprob", "top_logprobs")
        value: Callable[[float], float] = (lambda p: p) if post_sampling else logarithm
        top = []
        for tid, p in probs.top:
            piece = self._text_pieces[tid]
            top.append(
                {"id": tid, "token": utf8_prefix_text(piece), "bytes": list(piece), key: value(p)}
            )
        return {
            "id": token,
            "token": utf8_prefix_text(released),
            "bytes": list(released),
            key: value(probs.p_token),
            top_key: top,
        }


def _gguf_sampling_defaults(reader: Any) -> SamplerParams:
    """general.sampling.* from the header, over llama.cpp's defaults."""
    values: dict[str, Any] = {}
    fields = getattr(reader, "fields", {}) or {}
    for name, fld in fields.items():
        if not name.startswith("general.sampling."):
            continue
        try:
            values[name] = fld.contents()
        except Exception:  # an odd type in an optional key: llama.cpp ignores what it cannot read
            continue
    return SamplerParams.from_gguf_metadata(values)
