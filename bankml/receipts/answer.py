"""An answer as the client received it, read the way bankml hashed it when it wrote the receipt.

``read_answer(body)`` takes the response body exactly as received: one JSON object, an SSE stream
(``data:`` events, OpenAI's ending with ``data: [DONE]``) or NDJSON (one object a line), and
returns what a receipt speaks of: the receipt itself, the answer text (the content of choice 0,
or llama-server's ``content``, or Ollama's ``message.content`` / ``response``, or the
``output_text`` parts of a Responses answer's message items, or the ``text`` blocks of an
Anthropic Messages answer; streamed pieces joined in order: ``delta.content``,
``response.output_text.delta``'s ``delta``, a ``content_block_delta``'s ``text_delta``), an
answer's reasoning and tool calls (``acts``, read as bankml.receipts.acts reads them: chat,
Responses, Messages and Ollama's ``thinking`` and ``tool_calls``), the
logprobs entries, the token counts and finish reason the answer reports.
A stream carries its receipt as a ``bankml_receipt`` field of its last regular event (that event
may hold nothing else). Anything that is not such an answer raises ``Unreadable``.
``answer_parts(body)`` splits a response with several answers (several prompts, ``n``
completions) into each answer's objects and receipt.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from bankml.receipts.acts import Acts
from bankml.receipts.kinds import RERANK

JSON, SSE, NDJSON = "json", "sse", "ndjson"


class Unreadable(Exception):
    """The response is not an answer the checker can read; the message says why."""


@dataclass
class AnswerView:
    form: str  # JSON, SSE or NDJSON
    receipt: Any
    text: str = ""
    logprobs: list[Any] | None = None  # None: the answer carries no logprobs
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    finish_reason: str | None = None
    objects: list[dict[str, Any]] = field(default_factory=list)  # every event's object, in order
    pieces: list[str] = field(default_factory=list)  # each object's share of the text, in order
    acts: Acts = field(default_factory=Acts)  # a chat answer's reasoning and tool calls

    def add_text(self, piece: str) -> None:
        self.text += piece
        if piece:
            self.pieces.append(piece)

    def add_logprobs(self, entries: list[Any]) -> None:
        if self.logprobs is None:
            self.logprobs = []
        self.logprobs.extend(entries)


def _loads(raw: bytes | str, what: str) -> Any:
    try:
        return json.loads(raw)
    except ValueError as err:
        raise Unreadable(f"{what} is not JSON ({err})") from None


def sse_payloads(body: bytes) -> list[bytes]:
    """The data of each event of an SSE body (its ``data:`` lines joined by newlines)."""
    text = body.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
    out = []
    for block in text.split(b"\n\n"):
        lines = [line for line in block.split(b"\n") if line and not line.startswith(b":")]
        if not lines:
            continue
        data = []
        for line in lines:
            name, _, value = line.partition(b":")
            if name != b"data":
                continue  # event:, id:, retry: say nothing about the answer
            data.append(value[1:] if value.startswith(b" ") else value)
        if data:
            out.append(b"\n".join(data))
    return out


def response_form(body: bytes) -> str:
    head = body.lstrip()
    if head.startswith((b"data:", b"event:", b"id:", b":")):
        return SSE
    try:
        json.loads(body)
        return JSON
    except ValueError:
        return NDJSON


def stream_objects(body: bytes, form: str) -> list[dict[str, Any]]:
    """The events' objects of a stream, in order; [DONE] only as the very last event."""
    if form == SSE:
        payloads = sse_payloads(body)
        if payloads and payloads[-1].strip() == b"[DONE]":
            payloads = payloads[:-1]
    else:
        payloads = [line for line in body.split(b"\n") if line.strip()]
    objects = []
    for index, payload in enumerate(payloads):
        if payload.strip() == b"[DONE]":
            raise Unreadable(f"event {index} is [DONE] but more events follow it")
        obj = _loads(payload, f"event {index}")
        if obj is None:
            raise Unreadable("the stream answers several prompts (a null event between them)")
        if not isinstance(obj, dict):
            raise Unreadable(f"event {index} is not a JSON object")
        if "error" in obj:
            raise Unreadable(f"event {index} is an error: {json.dumps(obj['error'])[:200]}")
        objects.append(obj)
    if not objects:
        raise Unreadable("the stream holds no events")
    return objects


def first_choice(obj: Any, index: int = 0) -> dict[str, Any] | None:
    """Choice ``index`` (0: the choice whose index is 0, or that names none), as the gateway
    tallies it; None when ``obj`` has no list of choices."""
    choices = obj.get("choices") if isinstance(obj, dict) else None
    if not isinstance(choices, list):
        return None
    for choice in choices:
        if isinstance(choice, dict) and choice.get("index", 0) == index:
            return choice
    return None


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _dicts(value: Any) -> list[dict[str, Any]]:
    return [v for v in value if isinstance(v, dict)] if isinstance(value, list) else []


def _str(value: Any) -> str:
    return value if isinstance(value, str) else ""


# Anthropic's stop_reason as the chat finish reason llama-server computed it from
STOP_REASONS = {"end_turn": "stop", "max_tokens": "length", "tool_use": "tool_calls"}
# /completion's stop_type (on its last object) as the finish reason
STOP_TYPES = {"eos": "stop", "word": "stop", "limit": "length"}


def responses_text(output: Any) -> str:
    """The text of a Responses answer: its message items' ``output_text`` parts, in order."""
    return "".join(
        _str(part.get("text"))
        for item in _dicts(output)
        if item.get("type") == "message"
        for part in _dicts(item.get("content"))
        if part.get("type") == "output_text"
    )


def messages_text(content: Any) -> str:
    """The text of an Anthropic Messages answer: its ``text`` blocks, in order."""
    return "".join(_str(b.get("text")) for b in _dicts(content) if b.get("type") == "text")


def responses_counts(usage: Any) -> tuple[int | None, int | None, int | None]:
    """(prompt tokens, completion tokens, prompt tokens reused) of a Responses ``usage``."""
    if not isinstance(usage, dict):
        return None, None, None
    details = usage.get("input_tokens_details")
    cached = _count(details.get("cached_tokens")) if isinstance(details, dict) else None
    return _count(usage.get("input_tokens")), _count(usage.get("output_tokens")), cached


def anthropic_counts(usage: Any) -> tuple[int | None, int | None, int | None]:
    """(prompt tokens, completion tokens, prompt tokens reused) of an Anthropic ``usage``:
    its ``input_tokens`` leave out the ``cache_read_input_tokens``."""
    if not isinstance(usage, dict):
        return None, None, None
    fresh, cached = _count(usage.get("input_tokens")), _count(usage.get("cache_read_input_tokens"))
    prompt = None if fresh is None else fresh + (cached or 0)
    return prompt, _count(usage.get("output_tokens")), cached


def prompt_of_timings(timings: dict[str, Any]) -> int | None:
    """The prompt's length as ``usage.prompt_tokens`` counts it, from llama-server's
    ``timings``: ``prompt_n`` tokens evaluated plus ``cache_n`` reused from the slot."""
    evaluated, reused = _count(timings.get("prompt_n")), _count(timings.get("cache_n"))
    if evaluated is None:
        return None
    return evaluated + (reused or 0)


def _note_counts(view: AnswerView, obj: dict[str, Any], api: str) -> None:
    """Counts an answer reports: ``usage`` (OpenAI), llama-server's ``tokens_evaluated`` /
    ``tokens_predicted`` on a final object, else ``timings`` (prompt_n + cache_n, predicted_n)."""
    if api in ("responses", "messages"):
        _note_typed_counts(view, obj, api)
        return
    usage = obj.get("usage")
    if isinstance(usage, dict):
        view.prompt_tokens = _count(usage.get("prompt_tokens"))
        view.completion_tokens = _count(usage.get("completion_tokens"))
        return
    if api == "llama_completion" and obj.get("stop") is True:
        view.prompt_tokens = _count(obj.get("tokens_evaluated"))
        view.completion_tokens = _count(obj.get("tokens_predicted"))
        return
    if api.startswith("ollama") and obj.get("done") is True:
        view.prompt_tokens = _count(obj.get("prompt_eval_count"))
        view.completion_tokens = _count(obj.get("eval_count"))
        return
    timings = obj.get("timings")
    if isinstance(timings, dict):
        if view.prompt_tokens is None:
            view.prompt_tokens = prompt_of_timings(timings)
        if view.completion_tokens is None:
            view.completion_tokens = _count(timings.get("predicted_n"))


def _note_typed_counts(view: AnswerView, obj: dict[str, Any], api: str) -> None:
    """The Responses and Messages counts: the whole answer's ``usage``; streamed, Responses'
    ``response.completed`` and Messages' ``message_start`` (prompt) and ``message_delta``
    (completion, stop reason)."""
    kind = obj.get("type")
    if api == "responses":
        response = obj.get("response") if kind == "response.completed" else obj
        if isinstance(response, dict) and "usage" in response:
            view.prompt_tokens, view.completion_tokens, _ = responses_counts(response["usage"])
        return
    if kind == "message_start" and isinstance(obj.get("message"), dict):
        view.prompt_tokens = anthropic_counts(obj["message"].get("usage"))[0]
    elif kind in ("message", "message_delta"):
        prompt, completion, _ = anthropic_counts(obj.get("usage"))
        if kind == "message":
            view.prompt_tokens = prompt
        view.completion_tokens = completion
        holder = obj.get("delta") if kind == "message_delta" else obj
        reason = holder.get("stop_reason") if isinstance(holder, dict) else None
        if isinstance(reason, str):
            view.finish_reason = STOP_REASONS.get(reason, reason)


def _add_piece(
    view: AnswerView, obj: dict[str, Any], api: str, stream: bool, index: int = 0
) -> None:
    """One object's share of the text and logprobs (of choice ``index``), as the receipt's
    Tally took it."""
    if api in ("chat", "oai_completion"):
        choice = first_choice(obj, index)
        if choice is None:
            return
        if api == "chat":
            part = choice.get("delta" if stream else "message")
            content = part.get("content") if isinstance(part, dict) else None
            view.acts.take_chat(part)
        else:
            content = choice.get("text")
        if isinstance(content, str):
            view.add_text(content)
        logprobs = choice.get("logprobs")
        if isinstance(logprobs, dict) and isinstance(logprobs.get("content"), list):
            view.add_logprobs(logprobs["content"])
        if isinstance(choice.get("finish_reason"), str):
            view.finish_reason = choice["finish_reason"]
    elif api == "responses":
        if not stream:
            view.add_text(responses_text(obj.get("output")))
            view.acts.take_responses_output(obj.get("output"))
        elif obj.get("type") == "response.output_text.delta" and isinstance(obj.get("delta"), str):
            view.add_text(obj["delta"])
        elif obj.get("type") == "response.completed" and isinstance(obj.get("response"), dict):
            view.acts.take_responses_output(obj["response"].get("output"))
    elif api == "messages":
        if not stream:
            view.add_text(messages_text(obj.get("content")))
            view.acts.take_messages_content(obj.get("content"))
        elif obj.get("type") == "content_block_delta":
            delta = obj.get("delta")
            if isinstance(delta, dict) and delta.get("type") == "text_delta":
                view.add_text(_str(delta.get("text")))
            else:
                view.acts.take_messages_event(obj)
        elif obj.get("type") == "content_block_start":
            view.acts.take_messages_event(obj)
    elif api == "llama_completion":
        if isinstance(obj.get("content"), str):
            view.add_text(obj["content"])
        if obj.get("stop") is True and obj.get("stop_type") in STOP_TYPES:
            view.finish_reason = STOP_TYPES[obj["stop_type"]]
        if isinstance(obj.get("completion_probabilities"), list):
            view.add_logprobs(obj["completion_probabilities"])
    else:  # Ollama: /api/chat's message.content, /api/generate's response
        message = obj.get("message")
        content = message.get("content") if isinstance(message, dict) else obj.get("response")
        if isinstance(content, str):
            view.add_text(content)
        view.acts.take_ollama(message if isinstance(message, dict) else obj)
        # the final object lists every entry again (piece lines carry them as they come): the
        # receipt hashes that list
        if obj.get("done") is True and isinstance(obj.get("logprobs"), list):
            view.add_logprobs(obj["logprobs"])
        if isinstance(obj.get("done_reason"), str):
            view.finish_reason = obj["done_reason"]


def tei_receipt(obj: Any) -> dict[str, Any] | None:
    """The receipt of a TEI rerank answer (a JSON array whose first result carries a rerank
    receipt, and no other one a receipt), else None."""
    if not isinstance(obj, list) or not obj or not isinstance(obj[0], dict):
        return None
    found = obj[0].get("bankml_receipt")
    if not isinstance(found, dict) or found.get("api") != RERANK:
        return None
    if any(isinstance(r, dict) and "bankml_receipt" in r for r in obj[1:]):
        return None
    return found


def find_receipt(body: bytes) -> tuple[str, Any, list[dict[str, Any]]]:
    """(form, the receipt, the objects) of a response body."""
    form = response_form(body)
    if form == JSON:
        obj = _loads(body, "the response")
        tei = tei_receipt(obj)
        if tei is not None:  # a rerank answer in TEI's form: one receipt, on its first result
            return form, tei, [{"results": obj}]
        if isinstance(obj, list):
            raise Unreadable("the answer holds several prompts' results; check one at a time")
        if not isinstance(obj, dict):
            raise Unreadable("the response is not a JSON object")
        if "bankml_receipt" not in obj:
            raise Unreadable("the response carries no bankml_receipt")
        return form, obj["bankml_receipt"], [obj]
    objects = stream_objects(body, form)
    for index, obj in enumerate(objects[:-1]):
        if "bankml_receipt" in obj:
            raise Unreadable(f"a receipt in event {index}, not in the stream's last event")
    if "bankml_receipt" not in objects[-1]:
        raise Unreadable("the stream's last event carries no bankml_receipt")
    return form, objects[-1]["bankml_receipt"], objects


def read_answer(body: bytes, api: str) -> AnswerView:
    """The answer of ``api`` (a receipt's ``api``) in ``body``."""
    form, receipt, objects = find_receipt(body)
    if isinstance(receipt, list):
        raise Unreadable("the answer holds several prompts' receipts; check one at a time")
    return answer_of(objects, form, api, receipt)


def read_plain_answer(body: bytes, api: str) -> AnswerView:
    """An answer that carries no receipt (llama-server's own, on a replay)."""
    form = response_form(body)
    if form == JSON:
        obj = _loads(body, "the response")
        if not isinstance(obj, dict):
            raise Unreadable("the response is not a JSON object")
        if "error" in obj:
            raise Unreadable(f"an error: {json.dumps(obj['error'])[:200]}")
        return answer_of([obj], form, api, None)
    return answer_of(stream_objects(body, form), form, api, None)


def answer_of(
    objects: list[dict[str, Any]], form: str, api: str, receipt: Any, index: int = 0
) -> AnswerView:
    """The answer of choice ``index`` in ``objects`` (one answer's objects, in order)."""
    view = AnswerView(form, receipt, objects=objects)
    stream = form != JSON
    for obj in objects:
        _add_piece(view, obj, api, stream, index)
        _note_counts(view, obj, api)
    if api == "chat" and not stream and first_choice(objects[0], index) is None:
        raise Unreadable("the response is not a chat completion (no choice 0)")
    if api == "responses" and not stream and not isinstance(objects[0].get("output"), list):
        raise Unreadable("the response is not a Responses answer (no output list)")
    if api == "messages" and not stream and objects[0].get("type") != "message":
        raise Unreadable("the response is not a Messages answer (its type is not message)")
    if api in ("responses", "messages") and stream:
        last = {"responses": "response.completed", "messages": "message_stop"}[api]
        if objects[-1].get("type") != last:
            raise Unreadable(f"the stream's last event is not {last}")
    return view


@dataclass
class Part:
    """One answer of a response with several (a request's ``n`` completions, its prompts):
    its index, its receipt and its objects, read as ``answer_of(objects, form, api, receipt,
    index)``."""

    index: int
    receipt: Any
    objects: list[dict[str, Any]]
    form: str


def answer_parts(body: bytes) -> list[Part] | None:
    """The answers of a response with several, one per receipt, in index order: /completion's
    array (each object its receipt), an OpenAI object whose ``bankml_receipt`` is the list of
    its choices' receipts (the usage and timings it shows are choice 0's), or a stream whose
    events are several choices' or prompts' (each answer's receipt on its own last event, a
    choice-less usage chunk belonging to the choice before it); None for one answer."""
    form = response_form(body)
    if form == JSON:
        obj = _loads(body, "the response")
        if isinstance(obj, list):
            return None if tei_receipt(obj) is not None else _array_parts(obj)
        if not isinstance(obj, dict) or not isinstance(obj.get("bankml_receipt"), list):
            return None
        return _choice_parts(obj)
    return _stream_parts(body, form)


def _array_parts(objects: list[Any]) -> list[Part]:
    parts = []
    for position, obj in enumerate(objects):
        if not isinstance(obj, dict) or "bankml_receipt" not in obj:
            raise Unreadable(f"result {position} of the array carries no bankml_receipt")
        if obj.get("index", position) != position:
            raise Unreadable(f"result {position} of the array has index {obj.get('index')!r}")
        parts.append(Part(position, obj["bankml_receipt"], [obj], JSON))
    return parts


def _choice_parts(obj: dict[str, Any]) -> list[Part]:
    receipts = obj["bankml_receipt"]
    choices = obj.get("choices")
    if not isinstance(choices, list) or len(choices) != len(receipts):
        raise Unreadable("the answer's choices are not one per receipt of its bankml_receipt list")
    parts = []
    for index, receipt in enumerate(receipts):
        if first_choice(obj, index) is None:
            raise Unreadable(f"the answer has no choice {index} for its receipt {index}")
        own = {k: v for k, v in obj.items() if k != "bankml_receipt"}
        if index:  # the usage and timings shown are choice 0's, as llama-server's
            own = {k: v for k, v in own.items() if k not in ("usage", "timings")}
        parts.append(Part(index, receipt, [own], JSON))
    return parts


def _event_index(obj: dict[str, Any], previous: int | None) -> int | None:
    if "choices" in obj:
        choices = obj["choices"]
        if isinstance(choices, list) and choices and isinstance(choices[0], dict):
            return _count(choices[0].get("index", 0))
        return previous  # a usage chunk follows its choice's finish chunk
    return _count(obj.get("index", 0))


def _stream_parts(body: bytes, form: str) -> list[Part] | None:
    payloads = (
        sse_payloads(body) if form == SSE else [line for line in body.split(b"\n") if line.strip()]
    )
    if payloads and payloads[-1].strip() == b"[DONE]":
        payloads = payloads[:-1]
    groups: dict[int, list[dict[str, Any]]] = {}
    begins = 0
    previous: int | None = None
    for position, payload in enumerate(payloads):
        obj = _loads(payload, f"event {position}")
        if obj is None:  # a later task's begin
            begins += 1
            continue
        if not isinstance(obj, dict) or "error" in obj:
            return None  # read_answer says what is wrong
        index = _event_index(obj, previous)
        if index is None:
            raise Unreadable(f"event {position} names no choice")
        groups.setdefault(index, []).append(obj)
        previous = index
    if len(groups) <= 1 and not begins:
        return None
    if sorted(groups) != list(range(len(groups))):
        raise Unreadable(f"the stream's answers are {sorted(groups)}, not 0 to {len(groups) - 1}")
    parts = []
    for index in range(len(groups)):
        objects = groups[index]
        for obj in objects[:-1]:
            if "bankml_receipt" in obj:
                raise Unreadable(f"answer {index}'s receipt is not on its last event")
        if "bankml_receipt" not in objects[-1]:
            raise Unreadable(f"answer {index}'s last event carries no bankml_receipt")
        parts.append(Part(index, objects[-1]["bankml_receipt"], objects, form))
    return parts
