"""A chat answer as llama-server's chat parser leaves it: content, reasoning and tool calls, the
message object it writes, and the stream deltas it sends as the answer grows.

llama-server (build 11434) parses the generated text after every token (partial) and once more
at the end (final) into a message, and streams what changed since the last parse
(common/chat.cpp ``compute_diffs``, tools/server/server-task.cpp ``update_chat_msg``,
server-chat.cpp ``server_chat_msg_diff_to_json_oaicompat``). This module does the same with the
parse the engine's chat format gives (``MessageStream(parse)``):

- ``ChatMessage``: ``content``, ``reasoning_content``, ``tool_calls`` (name, arguments as a JSON
  string, id);
- ``message_object(msg)``: the ``message`` of a whole answer: ``role``, ``content`` (``""`` when
  empty), ``reasoning_content`` when any, ``tool_calls`` (``type``, ``function``, ``id``);
- ``compute_diffs(old, new)``: reasoning first, then content, then the last known call's new
  arguments (and its id and name when they changed), then each new call whole; a parse that
  finds fewer calls than before is an error, as llama-server's;
- ``delta_object(diff)``: one stream delta;
- ``finish_reason(stopped, msg)``: ``tool_calls`` for an answer that stopped (end of generation
  or a stop word) with calls, ``stop`` without, ``length`` otherwise.

A call without an id gets one drawn as llama-server draws them (32 letters and digits), once,
kept for the rest of the answer. Pure Python, no Twisted.
"""

from __future__ import annotations

import secrets
import string
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

_ID_ALPHABET = string.digits + string.ascii_uppercase + string.ascii_lowercase


def tool_call_id() -> str:
    """A tool call id as llama-server draws one: 32 characters of [0-9A-Za-z]."""
    return "".join(secrets.choice(_ID_ALPHABET) for _ in range(32))


@dataclass(frozen=True)
class ToolCallMsg:
    name: str = ""
    arguments: str = ""
    id: str = ""


@dataclass(frozen=True)
class ChatMessage:
    content: str = ""
    reasoning_content: str = ""
    tool_calls: tuple[ToolCallMsg, ...] = ()

    @property
    def empty(self) -> bool:
        return not (self.content or self.reasoning_content or self.tool_calls)


@dataclass(frozen=True)
class MessageDiff:
    reasoning_content_delta: str = ""
    content_delta: str = ""
    tool_call_index: int | None = None
    tool_call_delta: ToolCallMsg = field(default_factory=ToolCallMsg)


class DiffError(ValueError):
    """The parse went back on a tool call it had already sent."""


def message_object(msg: ChatMessage) -> dict[str, Any]:
    """``common_chat_msg::to_json_oaicompat`` of an assistant answer."""
    out: dict[str, Any] = {"role": "assistant", "content": msg.content}
    if msg.reasoning_content:
        out["reasoning_content"] = msg.reasoning_content
    if msg.tool_calls:
        calls = []
        for call in msg.tool_calls:
            entry: dict[str, Any] = {
                "type": "function",
                "function": {"name": call.name, "arguments": call.arguments},
            }
            if call.id:
                entry["id"] = call.id
            calls.append(entry)
        out["tool_calls"] = calls
    return out


def _string_diff(old: str, new: str) -> str:
    """What ``new`` adds to ``old`` (llama-server's string_diff): nothing where ``new`` is
    shorter and ``old`` starts with it (the last parse ended on a partial stop word, this one on
    the stop word, taken away); anything else is an error."""
    if not new.startswith(old):
        if old.startswith(new):
            return ""
        raise DiffError(f"invalid diff: {old[-20:]!r} is not a prefix of {new[-20:]!r}")
    return new[len(old) :]


def compute_diffs(old: ChatMessage, new: ChatMessage) -> list[MessageDiff]:
    diffs = []
    if old.reasoning_content != new.reasoning_content:
        diffs.append(
            MessageDiff(
                reasoning_content_delta=_string_diff(old.reasoning_content, new.reasoning_content)
            )
        )
    if old.content != new.content:
        diffs.append(MessageDiff(content_delta=_string_diff(old.content, new.content)))
    if len(new.tool_calls) < len(old.tool_calls):
        raise DiffError("invalid diff: now finding less tool calls")
    if old.tool_calls:
        index = len(old.tool_calls) - 1
        before, after = old.tool_calls[index], new.tool_calls[index]
        if before.name != after.name and before.name and after.name:
            if not after.name.startswith(before.name):
                raise DiffError("invalid diff: tool call mismatch")
        arguments = _string_diff(before.arguments, after.arguments)
        renamed = before.id != after.id or before.name != after.name
        if arguments or renamed:
            delta = ToolCallMsg(
                name=after.name if renamed else "",
                arguments=arguments,
                id=after.id if renamed else "",
            )
            diffs.append(MessageDiff(tool_call_index=index, tool_call_delta=delta))
    for index in range(len(old.tool_calls), len(new.tool_calls)):
        diffs.append(MessageDiff(tool_call_index=index, tool_call_delta=new.tool_calls[index]))
    return diffs


def delta_object(diff: MessageDiff) -> dict[str, Any]:
    """``server_chat_msg_diff_to_json_oaicompat``: one stream delta."""
    delta: dict[str, Any] = {}
    if diff.reasoning_content_delta:
        delta["reasoning_content"] = diff.reasoning_content_delta
    if diff.content_delta:
        delta["content"] = diff.content_delta
    if diff.tool_call_index is not None:
        call: dict[str, Any] = {"index": diff.tool_call_index}
        piece = diff.tool_call_delta
        if piece.id:
            call["id"] = piece.id
            call["type"] = "function"
        if piece.name or piece.arguments:
            function: dict[str, Any] = {}
            if piece.name:
                function["name"] = piece.name
            if piece.arguments:
                function["arguments"] = piece.arguments
            call["function"] = function
        delta["tool_calls"] = [call]
    return delta


def finish_reason(stopped: bool, msg: ChatMessage) -> str:
    """``stopped``: the answer ended at an end-of-generation token or a stop word."""
    if not stopped:
        return "length"
    return "tool_calls" if msg.tool_calls else "stop"


def as_message(parsed: Any) -> ChatMessage:
    """A parse's message (anything with ``content``, ``reasoning_content`` and ``tool_calls`` of
    ``name``, ``arguments``, ``id``) as a ChatMessage."""
    if isinstance(parsed, ChatMessage):
        return parsed
    return ChatMessage(
        content=str(getattr(parsed, "content", "") or ""),
        reasoning_content=str(getattr(parsed, "reasoning_content", "") or ""),
        tool_calls=tuple(
            ToolCallMsg(
                name=str(getattr(call, "name", "") or ""),
                arguments=str(getattr(call, "arguments", "") or ""),
                id=str(getattr(call, "id", "") or ""),
            )
            for call in getattr(parsed, "tool_calls", ()) or ()
        ),
    )


Parse = Callable[[str, bool], Any]


class MessageStream:
    """One answer's message as it grows: ``update(text, partial)`` parses everything generated so
    far (``parse(text, partial)``: a message as ``as_message`` reads one) and returns what
    changed since the last parse."""

    def __init__(self, parse: Parse, new_id: Callable[[], str] = tool_call_id) -> None:
        self.parse = parse
        self.new_id = new_id
        self.text = ""
        self.message = ChatMessage()
        self.ids: list[str] = []

    def _with_ids(self, msg: ChatMessage) -> ChatMessage:
        """Each call keeps the id it was first given (its own, or one drawn)."""
        calls = []
        for index, call in enumerate(msg.tool_calls):
            if index >= len(self.ids):
                self.ids.append(call.id or self.new_id())
            calls.append(replace(call, id=self.ids[index]))
        return replace(msg, tool_calls=tuple(calls))

    def update(self, added: str, partial: bool) -> list[MessageDiff]:
        self.text += added
        parsed = as_message(self.parse(self.text, partial))
        if parsed.empty:
            return []
        before, self.message = self.message, self._with_ids(parsed)
        return compute_diffs(before, self.message)
