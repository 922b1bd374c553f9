"""Reading llama-server's completion answers for their receipts, as P0 forwards them.

Three families of completion endpoints, each with llama-server's own layout:

- ``CHAT`` (``/v1/chat/completions``, ``/chat/completions``): the text of choice 0
  (``message.content``, or the streamed ``delta.content`` pieces), its reasoning and tool calls
  (``reasoning_content``, ``tool_calls``: bankml.receipts.acts), its ``logprobs.content``;
  a stream's last regular chunk is the usage chunk (``choices: []``) when the request set
  ``stream_options.include_usage``, else choice 0's chunk with a ``finish_reason``.
- ``OAI_COMPLETION`` (``/v1/completions``): each choice's ``text`` and ``logprobs.content``,
  one receipt per choice (a list when the request had several prompts, as native mode's); a
  choice's last chunk is the one with its ``finish_reason`` (llama-server puts ``usage`` there).
- ``LLAMA_COMPLETION`` (``/completion``, ``/completions``, ``/infill``): each prompt's
  ``content`` and ``completion_probabilities``; its last event is the one with ``stop: true``
  (no ``[DONE]`` follows); several prompts answer a list of objects, each with its receipt.
- ``RESPONSES`` (``/v1/responses``, ``/responses``): the ``output_text`` parts of the
  ``message`` items (streamed: the ``response.output_text.delta`` pieces), the reasoning and
  function call items (streamed: ``response.completed``'s); the last event is
  ``response.completed``; counts from ``usage.input_tokens``/``output_tokens``, the reused
  prompt from ``input_tokens_details.cached_tokens``; no finish reason (the answer has none).
- ``MESSAGES`` (``/v1/messages``, Anthropic's shape): the ``text`` blocks of ``content``
  (streamed: the ``text_delta`` pieces), the ``thinking`` and ``tool_use`` blocks (streamed:
  their starts and deltas); the last event is ``message_stop``; counts from
  ``usage`` (``input_tokens`` plus the cached ``cache_read_input_tokens``, ``output_tokens``),
  the finish reason from ``stop_reason`` (``end_turn`` is ``stop``, ``max_tokens`` ``length``).

Every kind's receipt is signed (bankml/receipts/sign.py's ``forward_request``): the request is
forwarded with a drawn seed appended where it named none, except a Messages request, which
llama-server converts without its seed: its receipt records the seed as unknown (null) and the
replay reproduces only its seed-free (greedy) answers (docs/receipts.md).

Token counts come from ``usage``, else ``tokens_evaluated``/``tokens_predicted``, else the
``timings`` (``prompt_n + cache_n``, ``predicted_n``). A whole ``/v1/completions`` answer to
several prompts reports the first prompt's ``usage`` only: the prompt counts of the others are
given by the caller (P0 asks llama-server's ``/tokenize``, ``completion_prompts`` splits the
prompts as llama-server does). Pure Python, no Twisted.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from typing import Any

from bankml.receipts.answer import (
    STOP_REASONS,
    STOP_TYPES,
    anthropic_counts,
    first_choice,
    messages_text,
    responses_counts,
    responses_text,
)
from bankml.receipts.kinds import (
    APIS,
    CHAT,
    LLAMA_COMPLETION,
    MESSAGES,
    OAI_COMPLETION,
    RESPONSES,
)
from bankml.receipts.sign import ForwardedRequest, forward_request
from bankml.receipts.tally import Tally

Issue = Callable[[Tally], dict[str, Any]]


def request_object(body: bytes) -> dict[str, Any]:
    """The request as JSON, or {} when it is not an object (llama-server answers it then)."""
    try:
        parsed = json.loads(body)
    except (ValueError, RecursionError):  # nested past the recursion limit: not JSON either
        return {}
    return parsed if isinstance(parsed, dict) else {}


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def tally_counts(tally: Tally, obj: dict[str, Any], index: int = 0) -> None:
    """Token counts from ``usage``, else llama-server's own fields, else its ``timings`` (a chat
    stream sends usage only when asked with stream_options.include_usage, timings always); the
    finish reason of choice ``index``."""
    usage = obj.get("usage")
    if isinstance(usage, dict):
        tally.set_counts(usage.get("prompt_tokens"), usage.get("completion_tokens"))
    tally.set_counts(
        obj.get("tokens_evaluated") if tally.prompt_tokens is None else None,
        obj.get("tokens_predicted") if tally.completion_tokens is None else None,
    )
    timings = obj.get("timings")
    if isinstance(timings, dict):
        prompt_n, cache_n = _int(timings.get("prompt_n")), _int(timings.get("cache_n")) or 0
        if tally.prompt_tokens is None and prompt_n is not None:
            tally.set_counts(prompt_n + cache_n, None)  # prompt_n counts only what was not cached
        if tally.completion_tokens is None:
            tally.set_counts(None, timings.get("predicted_n"))
        tally.set_end(None, cache_n)
    choice = first_choice(obj, index)
    if choice is not None:  # what the signed receipt says of the answer's end
        tally.set_end(choice.get("finish_reason"), None)
    if obj.get("stop") is True:  # /completion's last object
        stop_type = obj.get("stop_type")
        tally.set_end(STOP_TYPES.get(stop_type) if isinstance(stop_type, str) else None, None)


def tally_entries(tally: Tally, entries: Any) -> None:
    if isinstance(entries, list):
        tally.add_logprobs(entries)


def tally_logprobs(tally: Tally, choice: dict[str, Any]) -> None:
    logprobs = choice.get("logprobs")
    if isinstance(logprobs, dict):
        tally_entries(tally, logprobs.get("content"))


def _text(value: Any) -> str:
    return value if isinstance(value, str) else ""


def tally_typed_usage(tally: Tally, counts: tuple[int | None, int | None, int | None]) -> None:
    """(prompt, completion, reused) from a Responses or Anthropic ``usage``
    (answer.responses_counts / anthropic_counts)."""
    prompt, completion, cached = counts
    tally.set_counts(prompt, completion)
    tally.set_end(None, cached)


def tally_stop_reason(tally: Tally, holder: Any) -> None:
    """Anthropic's ``stop_reason``, as the chat finish reason llama-server computed it from."""
    reason = holder.get("stop_reason") if isinstance(holder, dict) else None
    if isinstance(reason, str):
        tally.set_end(STOP_REASONS.get(reason, reason), None)


# --- whole answers -------------------------------------------------------------------------------


def completion_prompts(prompt: Any) -> list[Any]:
    """The prompts of a ``/v1/completions`` ``prompt`` as llama-server's
    ``tokenize_input_prompts`` splits it: an array with no integer in it is several prompts
    (each a string, a token array or a mixed one), anything else one."""
    if isinstance(prompt, list) and not any(_int(p) is not None for p in prompt):
        return list(prompt)
    return [prompt]


def add_whole_receipts(
    kind: str,
    answer: Any,
    new_tally: Callable[[], Tally],
    issue: Issue,
    prompt_counts: Sequence[int | None] = (),
) -> bool:
    """Add ``bankml_receipt`` to a non-streamed answer of this kind; False when it is not one
    (passed through as it is, without a receipt). ``prompt_counts``: the prompt token count of
    each prompt after the first of a several-prompt ``/v1/completions`` request, by prompt
    index (llama-server's ``usage`` names the first prompt's only)."""
    if kind in (CHAT, OAI_COMPLETION):
        choices = answer.get("choices") if isinstance(answer, dict) else None
        if not isinstance(choices, list) or not choices or first_choice(answer) is None:
            return False
        receipts = []
        for i, choice in enumerate(choices):  # a request's prompts and n completions, in order
            tally = new_tally()
            choice = choice if isinstance(choice, dict) else {}
            if kind == CHAT:
                tally.take_chat(choice.get("message"))
            else:
                tally.add_text(_text(choice.get("text")))
            tally_logprobs(tally, choice)
            if i == 0:  # llama-server's usage and timings are the first answer's
                tally_counts(tally, answer)
            else:
                tally.set_end(choice.get("finish_reason"), None)
                prompt = i // getattr(tally.forwarded, "n_cmpl", 1)
                usage = answer.get("usage")
                if prompt == 0 and isinstance(usage, dict):  # the first prompt's completion
                    tally.set_counts(usage.get("prompt_tokens"), None)
                elif 0 < prompt < len(prompt_counts):
                    tally.set_counts(prompt_counts[prompt], None)
            receipts.append(issue(tally))
        answer["bankml_receipt"] = receipts[0] if len(receipts) == 1 else receipts
        return True
    if kind == RESPONSES:
        if not isinstance(answer, dict) or not isinstance(answer.get("output"), list):
            return False
        tally = new_tally()
        tally.add_text(responses_text(answer["output"]))
        tally.acts.take_responses_output(answer["output"])
        tally_typed_usage(tally, responses_counts(answer.get("usage")))
        answer["bankml_receipt"] = issue(tally)
        return True
    if kind == MESSAGES:
        if not isinstance(answer, dict) or answer.get("type") != "message":
            return False
        tally = new_tally()
        tally.add_text(messages_text(answer.get("content")))
        tally.acts.take_messages_content(answer.get("content"))
        tally_typed_usage(tally, anthropic_counts(answer.get("usage")))
        tally_stop_reason(tally, answer)
        answer["bankml_receipt"] = issue(tally)
        return True
    objects = answer if isinstance(answer, list) else [answer]
    if not objects or not all(isinstance(o, dict) and "content" in o for o in objects):
        return False
    for obj in objects:
        tally = new_tally()
        tally.add_text(_text(obj.get("content")))
        tally_entries(tally, obj.get("completion_probabilities"))
        tally_counts(tally, obj)
        obj["bankml_receipt"] = issue(tally)
    return True


# --- streams -------------------------------------------------------------------------------------


class StreamReading:
    """One streamed answer's tallies (one per choice or prompt index), fed its events in order.

    ``event(obj)`` tallies one event and returns the tally whose answer that event ends (its
    receipt goes inside it), else None."""

    def __init__(
        self,
        kind: str,
        body: bytes,
        clock: Callable[[], float] = time.monotonic,
        forwarded: ForwardedRequest | None = None,
    ) -> None:
        self.kind = kind
        self.body = body
        self.forwarded = forwarded  # what is sent upstream, for the signed receipt's facts
        self.sent = body if forwarded is None else forwarded.body
        self.clock = clock
        self.started = clock()
        self.tallies: dict[int, Tally] = {}
        self.last_finished: Any = 0  # the index of the choice whose finish came last
        options = request_object(body).get("stream_options")
        self.include_usage = isinstance(options, dict) and options.get("include_usage") is True
        self.ends_with_done = kind in (CHAT, OAI_COMPLETION)  # those end with data: [DONE]

    def tally(self, index: Any) -> Tally:
        """Answer ``index``'s tally (its completion's seed in the receipt's facts)."""
        key = index if isinstance(index, int) else 0
        if key not in self.tallies:
            self.tallies[key] = Tally(
                request_body=self.body,
                clock=self.clock,
                started=self.started,
                forwarded=None if self.forwarded is None else self.forwarded.for_answer(key),
            )
        return self.tallies[key]

    def event(self, obj: dict[str, Any]) -> Tally | None:
        if self.kind in (RESPONSES, MESSAGES):
            return self._typed_event(obj)
        if self.kind == LLAMA_COMPLETION:
            tally = self.tally(obj.get("index", 0))
            tally.add_text(_text(obj.get("content")))
            tally_entries(tally, obj.get("completion_probabilities"))
            if obj.get("stop") is True:
                tally_counts(tally, obj)
                return tally
            return None
        choices = obj.get("choices")
        choices = [c for c in choices if isinstance(c, dict)] if isinstance(choices, list) else []
        ended: Tally | None = None
        for choice in choices:
            tally = self.tally(choice.get("index", 0))
            if self.kind == CHAT:
                tally.take_chat(choice.get("delta"))
            else:
                tally.add_text(_text(choice.get("text")))
            tally_logprobs(tally, choice)
            if choice.get("finish_reason") is not None:
                tally_counts(tally, obj, choice.get("index", 0))
                self.last_finished = choice.get("index", 0)
                if len(choices) == 1 and not (self.kind == CHAT and self.include_usage):
                    ended = tally
        if self.kind == CHAT and self.include_usage and not choices and "usage" in obj:
            # the usage event names no choice: it follows the finish of the one it counts
            ended = self.tally(self.last_finished)
            tally_counts(ended, obj)
        return ended

    def _typed_event(self, obj: dict[str, Any]) -> Tally | None:
        """The Responses and Messages streams: typed events, one answer, a named last event."""
        tally, kind = self.tally(0), obj.get("type")
        if kind == "response.output_text.delta":
            tally.add_text(_text(obj.get("delta")))
        elif kind in ("response.reasoning_text.delta", "response.function_call_arguments.delta"):
            if _text(obj.get("delta")):
                tally.note_piece()
        elif kind == "response.completed":
            response = obj.get("response")
            response = response if isinstance(response, dict) else {}
            tally.acts.take_responses_output(response.get("output"))
            tally_typed_usage(tally, responses_counts(response.get("usage")))
            return tally
        elif kind == "content_block_delta":
            delta = obj.get("delta")
            if isinstance(delta, dict) and delta.get("type") == "text_delta":
                tally.add_text(_text(delta.get("text")))
            elif tally.acts.take_messages_event(obj):
                tally.note_piece()
        elif kind == "content_block_start":
            tally.acts.take_messages_event(obj)
        elif kind == "message_start":
            message = obj.get("message")
            prompt, _, cached = anthropic_counts(
                message.get("usage") if isinstance(message, dict) else None
            )
            tally_typed_usage(tally, (prompt, None, cached))
        elif kind == "message_delta":
            tally_typed_usage(tally, (None, anthropic_counts(obj.get("usage"))[1], None))
            tally_stop_reason(tally, obj.get("delta"))
        elif kind == "message_stop":
            return tally
        return None


def forwarded_request(body: bytes, kind: str) -> ForwardedRequest | None:
    """The request as P0 forwards it (a drawn seed appended where it named none and
    llama-server reads it: every kind but Messages) for the kinds a signed receipt describes
    (all of them); None for another (an unsigned receipt)."""
    return forward_request(body, kind) if kind in APIS else None
