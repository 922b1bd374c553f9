"""The answers to the two APIs llama-server runs as a chat completion: OpenAI Responses
(``/v1/responses``) and Anthropic Messages (``/v1/messages``).

llama-server converts such a request to a chat completion (bankml/receipts/convert.py), runs it
with its chat parser, and writes the parsed message in the API's own shape
(tools/server/server-task.cpp's ``to_json_oaicompat_resp*`` and ``to_json_anthropic*``). Each
answer here is a ``ChatAnswer`` (the same parse after every token and at the end, the same
``MessageStream`` diffs) that writes those shapes instead of OpenAI's chunks:

- **Messages** (``MessagesAnswer``): a whole ``message`` with ``thinking``, ``text`` and
  ``tool_use`` blocks (a call's ``input`` is its arguments parsed, ``{}`` when they are not
  JSON), ``stop_reason`` (``end_turn``, ``tool_use``, ``max_tokens``) and ``stop_sequence``;
  streamed, ``message_start`` with the first token, then ``content_block_start`` /
  ``content_block_delta`` as the parse grows (thinking block 0, then text, then each call), and
  at the end the last parse's blocks again as llama-server writes them, the ``signature_delta``
  of a thinking block, every ``content_block_stop``, ``message_delta`` and ``message_stop``.
- **Responses** (``ResponsesAnswer``): a ``response`` whose ``output`` holds a ``reasoning``
  item, a ``message`` item and a ``function_call`` item per call (ids ``fc_``/``call_`` and the
  call's id); streamed, ``response.created`` and ``response.in_progress`` with the first token,
  ``response.output_item.added``, ``response.reasoning_text.delta``,
  ``response.output_text.delta`` and ``response.function_call_arguments.delta`` as the parse
  grows, then the ``.done`` events of each item and ``response.completed`` (with the run's
  ``timings``). As in llama-server, what the last parse adds is in the ``.done`` events only.

A stream event is ``{"event": NAME, "data": OBJECT}`` (sent as ``event:`` and ``data:`` lines;
bankml/serving/writers.py). Neither API has a per-answer ``timings`` or ``__verbose`` object;
the receipt rides in the whole answer, or in the data of the last event (``message_stop``,
``response.completed``). The receipt's text is the answer's text as the receipt checker reads
it (the ``text`` blocks or ``output_text`` parts; streamed, the text deltas), its reasoning and
tool calls as bankml/receipts/acts.py reads them.

Pure Python, no Twisted.
"""

from __future__ import annotations

import json
import time
from typing import Any

from bankml.formats.answer import ChatAnswer
from bankml.formats.chat_content import chat_schema_content
from bankml.formats.chat_message import ChatMessage, MessageDiff, MessageStream, tool_call_id
from bankml.formats.llama import llama_timings
from bankml.receipts.answer import STOP_REASONS, messages_text, responses_text


def typed_event(name: str, data: dict[str, Any]) -> dict[str, Any]:
    return {"event": name, "data": data}


class ConvertedAnswer(ChatAnswer):
    """A chat answer written in another API's shape (see the module doc)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.verbose = False  # neither API carries llama-server's __verbose object
        if self.messages is None:  # a template without a chat parser: the text is the content
            self.messages = MessageStream(self._content_only)

    def _content_only(self, text: str, partial: bool) -> ChatMessage:
        return ChatMessage(
            content=chat_schema_content(text) if self.schema_answer else self.prefill + text
        )

    @property
    def message(self) -> ChatMessage:
        assert self.messages is not None
        return self.messages.message

    def stop_reason(self, summary: Any) -> str:
        """Anthropic's ``stop_reason`` of the answer (llama-server's rule for both APIs)."""
        if summary.finish_reason != "stop":
            return "max_tokens"
        return "tool_use" if self.message.tool_calls else "end_turn"

    def pieces(self, chunk: Any) -> list[dict[str, Any]]:
        assert self.messages is not None
        events = self.opening_events(chunk) + self.diff_events(
            self.messages.update(chunk.text, partial=True)
        )
        self.tally_events(events)
        return self.timed(events, chunk)

    def timed(self, events: list[dict[str, Any]], chunk: Any) -> list[dict[str, Any]]:
        """A token's events as sent (``timings_per_token``: the run's timings on the last one,
        where the API carries them)."""
        return events

    def on_progress(self, progress: Any) -> list[dict[str, Any]]:
        self.progress_sent = True
        return []

    def whole(self, summary: Any) -> dict[str, Any]:
        """The non-streamed answer, receipt included (no timings, as llama-server's)."""
        self.tally.set_counts(summary.prompt_tokens, summary.completion_tokens)
        self.answer_text(summary)  # the last parse
        out = self.whole_object(summary)
        self.tally_object(out)
        out["bankml_receipt"] = self.receipt(summary)
        return out

    def final_events(self, summary: Any) -> list[dict[str, Any]]:
        """The stream's last events, the receipt in the data of the last one."""
        assert self.messages is not None
        self.tally.set_counts(summary.prompt_tokens, summary.completion_tokens)
        events = self.closing_events(summary, self.messages.update("", partial=False))
        self.tally_events(events)
        events[-1]["data"]["bankml_receipt"] = self.receipt(summary)
        return events

    # -- what each API writes

    def opening_events(self, chunk: Any) -> list[dict[str, Any]]:
        """The events a token sends before its diffs (the answer's start)."""
        raise NotImplementedError

    def whole_object(self, summary: Any) -> dict[str, Any]:
        raise NotImplementedError

    def closing_events(self, summary: Any, diffs: list[MessageDiff]) -> list[dict[str, Any]]:
        raise NotImplementedError

    def tally_object(self, out: dict[str, Any]) -> None:
        """The whole answer, for its receipt, as the receipt checker reads it."""
        raise NotImplementedError

    def tally_events(self, events: list[dict[str, Any]]) -> None:
        raise NotImplementedError


class MessagesAnswer(ConvertedAnswer):
    """/v1/messages: Anthropic's message, or its events (see the module doc)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.thinking_started = False
        self.text_started = False

    def _usage(self, prompt_tokens: int, cached: int, output_tokens: int) -> dict[str, Any]:
        return {
            "cache_read_input_tokens": cached,
            "input_tokens": prompt_tokens - cached,
            "output_tokens": output_tokens,
        }

    def opening_events(self, chunk: Any) -> list[dict[str, Any]]:
        if self.n_tokens != 1:
            return []
        timings = chunk.timings or {}
        cached = int(timings.get("cache_n", 0))
        start = {
            "type": "message_start",
            "message": {
                "id": self.id,
                "type": "message",
                "role": "assistant",
                "content": [],
                "model": self.model,
                "stop_reason": None,
                "stop_sequence": None,
                "usage": self._usage(len(self.parsed.prompt_tokens), cached, 0),
            },
        }
        return [typed_event("message_start", start)]

    def _block_events(
        self,
        diffs: list[MessageDiff],
        thinking_started: bool,
        text_started: bool,
        has_thinking: bool,
        text_count: Any,
        tool_started: Any,
    ) -> list[dict[str, Any]]:
        """The block events of one parse's diffs; ``text_count(text_started)`` is how many text
        blocks come before the calls, ``tool_started(index, diff)`` whether a call's block
        starts here (llama-server's two writers differ in both)."""
        events = []
        text_index = 1 if has_thinking else 0
        for diff in diffs:
            if diff.reasoning_content_delta:
                if not thinking_started:
                    events.append(_block_start(0, {"type": "thinking", "thinking": ""}))
                    thinking_started = True
                events.append(
                    _block_delta(
                        0, {"type": "thinking_delta", "thinking": diff.reasoning_content_delta}
                    )
                )
            if diff.content_delta:
                if not text_started:
                    events.append(_block_start(text_index, {"type": "text", "text": ""}))
                    text_started = True
                events.append(
                    _block_delta(text_index, {"type": "text_delta", "text": diff.content_delta})
                )
            if diff.tool_call_index is not None:
                index = (1 if has_thinking else 0) + text_count(text_started)
                index += diff.tool_call_index
                if tool_started(diff):
                    call = self.message.tool_calls[diff.tool_call_index]
                    name = diff.tool_call_delta.name or call.name
                    block = {"type": "tool_use", "id": diff.tool_call_delta.id or call.id}
                    block["name"] = name
                    events.append(_block_start(index, block))
                if diff.tool_call_delta.arguments:
                    delta = {"type": "input_json_delta"}
                    delta["partial_json"] = diff.tool_call_delta.arguments
                    events.append(_block_delta(index, delta))
        return events

    def diff_events(self, diffs: list[MessageDiff]) -> list[dict[str, Any]]:
        events = self._block_events(
            diffs,
            self.thinking_started,
            self.text_started,
            bool(self.message.reasoning_content),
            lambda text_started: 1 if text_started else 0,
            lambda diff: bool(diff.tool_call_delta.name),
        )
        self.thinking_started |= any(d.reasoning_content_delta for d in diffs)
        self.text_started |= any(d.content_delta for d in diffs)
        return events

    def closing_events(self, summary: Any, diffs: list[MessageDiff]) -> list[dict[str, Any]]:
        message = self.message
        has_thinking, has_text = bool(message.reasoning_content), bool(message.content)
        started: set[int] = set()

        def tool_started(diff: MessageDiff) -> bool:
            index = diff.tool_call_index
            new = index not in started
            started.add(index)  # type: ignore[arg-type]
            return new

        # the last parse's diffs, written afresh: a block already started starts again
        events = self._block_events(
            diffs, False, False, has_thinking, lambda _: 1 if has_text else 0, tool_started
        )
        if has_thinking:
            events.append(_block_delta(0, {"type": "signature_delta", "signature": ""}))
            events.append(_block_stop(0))
        if has_text:
            events.append(_block_stop(1 if has_thinking else 0))
        first_call = (1 if has_thinking else 0) + (1 if has_text else 0)
        events += [_block_stop(first_call + i) for i in range(len(message.tool_calls))]
        reason = self.stop_reason(summary)
        stop = {"stop_reason": reason, "stop_sequence": _stop_word(summary)}
        events.append(
            typed_event(
                "message_delta",
                {
                    "type": "message_delta",
                    "delta": stop,
                    "usage": {"output_tokens": summary.completion_tokens},
                },
            )
        )
        events.append(typed_event("message_stop", {"type": "message_stop"}))
        self.tally.set_end(STOP_REASONS[reason], None)
        return events

    def whole_object(self, summary: Any) -> dict[str, Any]:
        message = self.message
        blocks: list[dict[str, Any]] = []
        if message.reasoning_content:
            blocks.append(
                {"type": "thinking", "thinking": message.reasoning_content, "signature": ""}
            )
        if message.content:
            blocks.append({"type": "text", "text": message.content})
        for call in message.tool_calls:
            blocks.append(
                {"type": "tool_use", "id": call.id, "name": call.name, "input": _input(call)}
            )
        reason = self.stop_reason(summary)
        self.tally.set_end(STOP_REASONS[reason], None)
        cached = int((summary.timings or {}).get("cache_n", 0))
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "content": blocks,
            "model": self.model,
            "stop_reason": reason,
            "stop_sequence": _stop_word(summary),
            "usage": self._usage(summary.prompt_tokens, cached, summary.completion_tokens),
        }

    def tally_object(self, out: dict[str, Any]) -> None:
        self.tally.add_text(messages_text(out["content"]))
        self.tally.acts.take_messages_content(out["content"])

    def tally_events(self, events: list[dict[str, Any]]) -> None:
        for event in events:
            data = event["data"]
            delta = data.get("delta")
            if data["type"] == "content_block_delta" and delta.get("type") == "text_delta":
                self.tally.add_text(delta["text"])
            elif self.tally.acts.take_messages_event(data):
                self.tally.note_piece()


def _block_start(index: int, block: dict[str, Any]) -> dict[str, Any]:
    data = {"type": "content_block_start", "index": index, "content_block": block}
    return typed_event("content_block_start", data)


def _block_delta(index: int, delta: dict[str, Any]) -> dict[str, Any]:
    data = {"type": "content_block_delta", "index": index, "delta": delta}
    return typed_event("content_block_delta", data)


def _block_stop(index: int) -> dict[str, Any]:
    return typed_event("content_block_stop", {"type": "content_block_stop", "index": index})


def _stop_word(summary: Any) -> str | None:
    return str(summary.stopping_word) if getattr(summary, "stopping_word", "") else None


def _input(call: Any) -> Any:
    """A tool_use block's ``input``: the call's arguments parsed, ``{}`` when they are not JSON."""
    try:
        return json.loads(call.arguments)
    except ValueError:
        return {}


def _in_progress(name: str, response_id: str) -> dict[str, Any]:
    response = {"id": response_id, "object": "response", "status": "in_progress"}
    return typed_event(name, {"type": name, "response": response})


class ResponsesAnswer(ConvertedAnswer):
    """/v1/responses: OpenAI's response, or its events (see the module doc)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.id = "resp_" + tool_call_id()
        self.reasoning_id = "rs_" + tool_call_id()
        self.message_id = "msg_" + tool_call_id()
        self.created_sent = False
        self.reasoning_started = False
        self.text_started = False
        self.call_id = ""  # the call whose arguments are streaming

    def opening_events(self, chunk: Any) -> list[dict[str, Any]]:
        if self.created_sent:
            return []
        self.created_sent = True
        return [
            _in_progress("response.created", self.id),
            _in_progress("response.in_progress", self.id),
        ]

    def timed(self, events: list[dict[str, Any]], chunk: Any) -> list[dict[str, Any]]:
        if self.timings_per_token and events and chunk.timings:
            events[-1]["data"]["timings"] = llama_timings(chunk.timings)
        return events

    def on_progress(self, progress: Any) -> list[dict[str, Any]]:
        """``return_progress``: the opening events with the first report, then
        ``response.in_progress`` with each, the report in the last event's data."""
        self.progress_sent = True
        if not self.stream:
            return []
        events = self.opening_events(None) or [_in_progress("response.in_progress", self.id)]
        data = events[-1]["data"]
        if self.timings_per_token and progress.timings:
            data["timings"] = llama_timings(progress.timings)
        data["prompt_progress"] = progress.as_json()
        return events

    def diff_events(self, diffs: list[MessageDiff]) -> list[dict[str, Any]]:
        events = []
        for diff in diffs:
            if diff.reasoning_content_delta:
                if not self.reasoning_started:
                    self.reasoning_started = True
                    item = {
                        "id": self.reasoning_id,
                        "summary": [],
                        "type": "reasoning",
                        "content": [],
                        "encrypted_content": "",
                        "status": "in_progress",
                    }
                    events.append(_item_added(item))
                events.append(
                    _event(
                        "response.reasoning_text.delta",
                        delta=diff.reasoning_content_delta,
                        item_id=self.reasoning_id,
                    )
                )
            if diff.content_delta:
                if not self.text_started:
                    self.text_started = True
                    item = {
                        "content": [],
                        "id": self.message_id,
                        "role": "assistant",
                        "status": "in_progress",
                        "type": "message",
                    }
                    events.append(_item_added(item))
                    events.append(
                        _event(
                            "response.content_part.added",
                            item_id=self.message_id,
                            part={"type": "output_text", "text": ""},
                        )
                    )
                events.append(
                    _event(
                        "response.output_text.delta",
                        item_id=self.message_id,
                        delta=diff.content_delta,
                    )
                )
            call = diff.tool_call_delta
            if call.name:
                self.call_id = call.id
                item = {
                    "id": "fc_" + call.id,
                    "arguments": "",
                    "call_id": "call_" + call.id,
                    "name": call.name,
                    "type": "function_call",
                    "status": "in_progress",
                }
                events.append(_item_added(item))
            if call.arguments:
                events.append(
                    _event(
                        "response.function_call_arguments.delta",
                        delta=call.arguments,
                        item_id="fc_" + self.call_id,
                    )
                )
        return events

    def _usage(self, summary: Any) -> dict[str, Any]:
        prompt, completion = summary.prompt_tokens, summary.completion_tokens
        return {
            "input_tokens": prompt,
            "output_tokens": completion,
            "total_tokens": prompt + completion,
            "input_tokens_details": {
                "cached_tokens": int((summary.timings or {}).get("cache_n", 0))
            },
        }

    def _output_text(self) -> dict[str, Any]:
        return {
            "type": "output_text",
            "annotations": [],
            "logprobs": [],
            "text": self.message.content,
        }

    def _calls(self) -> list[dict[str, Any]]:
        return [
            {
                "id": "fc_" + call.id,
                "type": "function_call",
                "status": "completed",
                "arguments": call.arguments,
                "call_id": "call_" + call.id,
                "name": call.name,
            }
            for call in self.message.tool_calls
        ]

    def _reasoning_item(self, item_id: str) -> dict[str, Any]:
        return {
            "id": item_id,
            "summary": [],
            "type": "reasoning",
            "content": [{"text": self.message.reasoning_content, "type": "reasoning_text"}],
            "encrypted_content": "",
        }

    def whole_object(self, summary: Any) -> dict[str, Any]:
        message = self.message
        output = []
        if message.reasoning_content:
            output.append({**self._reasoning_item("rs_" + tool_call_id()), "status": "completed"})
        if message.content:
            output.append(
                {
                    "content": [self._output_text()],
                    "id": "msg_" + tool_call_id(),
                    "role": "assistant",
                    "status": "completed",
                    "type": "message",
                }
            )
        output += self._calls()
        now = int(time.time())
        return {
            "completed_at": now,
            "created_at": now,
            "id": self.id,
            "model": self.model,
            "object": "response",
            "output": output,
            "status": "completed",
            "usage": self._usage(summary),
        }

    def closing_events(self, summary: Any, diffs: list[MessageDiff]) -> list[dict[str, Any]]:
        message = self.message
        events, output = [], []
        if message.reasoning_content:
            item = self._reasoning_item(self.reasoning_id)
            events.append(_event("response.output_item.done", item=item))
            output.append(item)
        if message.content:
            events.append(
                _event("response.output_text.done", item_id=self.message_id, text=message.content)
            )
            part = self._output_text()
            events.append(_event("response.content_part.done", item_id=self.message_id, part=part))
            item = {
                "type": "message",
                "status": "completed",
                "id": self.message_id,
                "content": [part],
                "role": "assistant",
            }
            events.append(_event("response.output_item.done", item=item))
            output.append(item)
        for item in self._calls():
            events.append(_event("response.output_item.done", item=item))
            output.append(item)
        response = {
            "id": self.id,
            "object": "response",
            "created_at": int(time.time()),
            "status": "completed",
            "model": self.model,
            "output": output,
            "usage": self._usage(summary),
        }
        completed = _event("response.completed", response=response)
        completed["data"]["timings"] = llama_timings(summary.timings)
        events.append(completed)
        return events

    def tally_object(self, out: dict[str, Any]) -> None:
        self.tally.add_text(responses_text(out["output"]))
        self.tally.acts.take_responses_output(out["output"])

    def tally_events(self, events: list[dict[str, Any]]) -> None:
        for event in events:
            data = event["data"]
            if data["type"] == "response.output_text.delta":
                self.tally.add_text(data["delta"])
            elif data["type"] in (
                "response.reasoning_text.delta",
                "response.function_call_arguments.delta",
            ):
                self.tally.note_piece()
            elif data["type"] == "response.completed":
                self.tally.acts.take_responses_output(data["response"]["output"])


def _event(name: str, **fields: Any) -> dict[str, Any]:
    return typed_event(name, {"type": name, **fields})


def _item_added(item: dict[str, Any]) -> dict[str, Any]:
    return _event("response.output_item.added", item=item)
