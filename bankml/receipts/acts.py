"""What an agent acts on beyond the answer's text: its reasoning and its tool calls, collected as
sent so that a receipt can hash them.

A chat answer carries them in choice 0's ``message`` (``reasoning_content``, ``tool_calls``) or,
streamed, in its ``delta`` pieces: ``reasoning_content`` pieces joined in order, and each tool
call by its ``index``: its ``id`` and ``type`` from the delta that names them, its
``function.name`` and ``function.arguments`` the pieces joined in order (llama-server sends the
name first, then the arguments in pieces). ``Acts.take_chat(part)`` reads one message or delta;
the gateway's tally and the receipt checker read the same way, so the hashes agree.

The same for the Responses API (``reasoning`` and ``function_call`` output items; a stream's
are its ``response.completed`` answer's) and for Anthropic Messages (``thinking`` and
``tool_use`` blocks, the input as compact JSON; streamed, a block's start names the call and its
``input_json_delta`` pieces, joined, are the arguments), and for Ollama's /api/chat and
/api/generate (``thinking`` pieces joined in order; each ``tool_calls`` entry a whole call, its
object ``arguments`` as compact JSON: ``Acts.take_ollama``).

The receipt's fields (only where the answer carries something):

- ``reasoning_sha256``: sha256 of the reasoning text's UTF-8 bytes;
- ``tool_calls_sha256``: sha256 of ``digest.canonical_tool_calls``: the calls in order as compact
  JSON, each ``{"id", "type", "name", "arguments"}`` with ``arguments`` the string exactly as sent.

Pure Python, no Twisted.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from bankml.receipts.digest import canonical_tool_calls, sha256_hex, text_sha256


def _str(value: Any) -> str:
    return value if isinstance(value, str) else ""


@dataclass
class ToolCall:
    """One tool call, as the client assembles it."""

    id: str = ""
    type: str = ""
    name: str = ""
    arguments: str = ""

    def as_json(self) -> dict[str, str]:
        return {"id": self.id, "type": self.type, "name": self.name, "arguments": self.arguments}


@dataclass
class Acts:
    """The reasoning pieces and tool calls of one answer, in the order received."""

    reasoning: list[str] = field(default_factory=list)
    calls: dict[int, ToolCall] = field(default_factory=dict)

    def add_reasoning(self, piece: Any) -> bool:
        """One piece of reasoning text; True when it holds something."""
        text = _str(piece)
        if text:
            self.reasoning.append(text)
        return bool(text)

    def add_call(self, entry: Any, position: int) -> bool:
        """One ``tool_calls`` entry of a message (``position``: its place in the list) or of a
        delta (it names its ``index``); True when it adds something."""
        if not isinstance(entry, dict):
            return False
        index = entry.get("index", position)
        key = index if isinstance(index, int) and not isinstance(index, bool) else position
        call = self.calls.setdefault(key, ToolCall())
        call.id = call.id or _str(entry.get("id"))
        call.type = call.type or _str(entry.get("type"))
        function = entry.get("function")
        if isinstance(function, dict):
            call.name += _str(function.get("name"))
            call.arguments += _str(function.get("arguments"))
        return True

    def take_chat(self, part: Any) -> bool:
        """A chat ``message`` or ``delta``: its reasoning and tool calls; True when it carried
        any (a piece of the answer, for the time to first token)."""
        if not isinstance(part, dict):
            return False
        took = self.add_reasoning(part.get("reasoning_content"))
        calls = part.get("tool_calls")
        if isinstance(calls, list):
            for position, entry in enumerate(calls):
                took = self.add_call(entry, position) or took
        return took

    def take_responses_output(self, output: Any) -> None:
        """A Responses answer's ``output`` items (a stream's are ``response.completed``'s):
        ``reasoning`` items' ``reasoning_text`` parts, and each ``function_call`` as a call
        (its ``call_id``, ``type`` ``function``, ``name`` and ``arguments``)."""
        for item in output if isinstance(output, list) else []:
            if not isinstance(item, dict):
                continue
            if item.get("type") == "reasoning":
                for part in item.get("content") or []:
                    if isinstance(part, dict) and part.get("type") == "reasoning_text":
                        self.add_reasoning(part.get("text"))
            elif item.get("type") == "function_call":
                self.add_call(
                    {
                        "id": item.get("call_id"),
                        "type": "function",
                        "function": {"name": item.get("name"), "arguments": item.get("arguments")},
                    },
                    len(self.calls),
                )

    def take_messages_content(self, content: Any) -> None:
        """An Anthropic Messages answer's ``content`` blocks: ``thinking`` blocks' text, and each
        ``tool_use`` block as a call (its ``id``, ``type`` ``tool_use``, ``name``, and its
        ``input`` as compact JSON, keys in the order received)."""
        for block in content if isinstance(content, list) else []:
            if not isinstance(block, dict):
                continue
            if block.get("type") == "thinking":
                self.add_reasoning(block.get("thinking"))
            elif block.get("type") == "tool_use":
                arguments = json.dumps(
                    block.get("input"), separators=(",", ":"), ensure_ascii=False
                )
                self.add_call(
                    {
                        "id": block.get("id"),
                        "type": "tool_use",
                        "function": {"name": block.get("name"), "arguments": arguments},
                    },
                    len(self.calls),
                )

    def take_messages_event(self, event: dict[str, Any]) -> bool:
        """One event of a Messages stream: a ``tool_use`` block's start (its id and name, by the
        block's ``index``), its ``input_json_delta`` pieces (the arguments as streamed), a
        ``thinking_delta``; True when it carried any."""
        index = event.get("index")
        if event.get("type") == "content_block_start":
            block = event.get("content_block")
            if isinstance(block, dict) and block.get("type") == "tool_use":
                return self.add_call(
                    {
                        "index": index,
                        "id": block.get("id"),
                        "type": "tool_use",
                        "function": {"name": block.get("name")},
                    },
                    len(self.calls),
                )
        elif event.get("type") == "content_block_delta":
            delta = event.get("delta")
            if not isinstance(delta, dict):
                return False
            if delta.get("type") == "thinking_delta":
                return self.add_reasoning(delta.get("thinking"))
            if delta.get("type") == "input_json_delta":
                return self.add_call(
                    {"index": index, "function": {"arguments": delta.get("partial_json")}},
                    len(self.calls),
                )
        return False

    def take_ollama(self, part: Any) -> bool:
        """An Ollama answer's ``message`` (/api/chat) or object (/api/generate): its
        ``thinking`` piece, and each ``tool_calls`` entry as a whole call (Ollama sends each
        once, whole): its ``id``, ``type`` ``function``, ``function.name``, and
        ``function.arguments`` (a JSON object) as compact JSON, keys in the order received;
        True when it carried any."""
        if not isinstance(part, dict):
            return False
        took = self.add_reasoning(part.get("thinking"))
        calls = part.get("tool_calls")
        for entry in calls if isinstance(calls, list) else []:
            if not isinstance(entry, dict):
                continue
            function = entry.get("function")
            function = function if isinstance(function, dict) else {}
            arguments = json.dumps(
                function.get("arguments"), separators=(",", ":"), ensure_ascii=False
            )
            took = (
                self.add_call(
                    {
                        "id": entry.get("id"),
                        "type": "function",
                        "function": {"name": function.get("name"), "arguments": arguments},
                    },
                    len(self.calls),
                )
                or took
            )
        return took

    @property
    def reasoning_text(self) -> str:
        return "".join(self.reasoning)

    def tool_calls(self) -> list[ToolCall]:
        return [self.calls[key] for key in sorted(self.calls)]

    def receipt_fields(self) -> dict[str, str]:
        """``reasoning_sha256`` and ``tool_calls_sha256``, each only where the answer has it."""
        out = {}
        if self.reasoning:
            out["reasoning_sha256"] = text_sha256(self.reasoning_text)
        if self.calls:
            out["tool_calls_sha256"] = sha256_hex(
                canonical_tool_calls(call.as_json() for call in self.tool_calls())
            )
        return out
