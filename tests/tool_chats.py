"""The conversations that make the tiny default model call a tool or reason, shared by the tool
call tests of both modes, and the tool-capable template they run on.

The model calls ``get_weather`` when the conversation shows it two calls first (``CALLING``);
it reasons when the request continues an assistant turn that holds only reasoning
(``REASONING``: the server opens the reasoning block for it). Both need a template with tool
calls and a reasoning block: Qwen3's, from llama.cpp's models/templates (``TEMPLATE``).
"""

from __future__ import annotations

import json
from typing import Any

TEMPLATE = "Qwen-Qwen3-0.6B.jinja"
WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


def assistant_call(call_id: str, city: str) -> dict[str, Any]:
    """An earlier assistant turn that called get_weather for ``city``."""
    function = {"name": "get_weather", "arguments": json.dumps({"city": city})}
    return {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": call_id, "type": "function", "function": function}],
    }


CALLING: dict[str, Any] = {
    "messages": [
        {"role": "user", "content": "What is the weather in Paris?"},
        assistant_call("a1", "Paris"),
        {"role": "user", "content": "What is the weather in London?"},
        assistant_call("a2", "London"),
        {"role": "user", "content": "What is the weather in Rome?"},
    ],
    "tools": [WEATHER],
    "max_tokens": 40,
    "temperature": 0,
}
REASONING: dict[str, Any] = {
    "messages": [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "", "reasoning_content": "The user wants"},
    ],
    "max_tokens": 30,
    "temperature": 0,
}


def as_messages(chat: dict[str, Any]) -> dict[str, Any]:
    """A chat request of this module as the Anthropic Messages request that says the same: an
    assistant call as a ``tool_use`` block, a reasoning turn as a ``thinking`` block."""
    messages: list[dict[str, Any]] = []
    for message in chat["messages"]:
        if message.get("tool_calls"):
            blocks = [
                {
                    "type": "tool_use",
                    "id": call["id"],
                    "name": call["function"]["name"],
                    "input": json.loads(call["function"]["arguments"]),
                }
                for call in message["tool_calls"]
            ]
            messages.append({"role": "assistant", "content": blocks})
        elif message.get("reasoning_content"):
            block = {"type": "thinking", "thinking": message["reasoning_content"]}
            messages.append({"role": "assistant", "content": [block]})
        else:
            messages.append(message)
    out: dict[str, Any] = {
        "messages": messages,
        "max_tokens": chat["max_tokens"],
        "temperature": chat["temperature"],
    }
    if "tools" in chat:
        out["tools"] = [
            {
                "name": tool["function"]["name"],
                "description": tool["function"]["description"],
                "input_schema": tool["function"]["parameters"],
            }
            for tool in chat["tools"]
        ]
    return out


def as_responses(chat: dict[str, Any]) -> dict[str, Any]:
    """The same as an OpenAI Responses request: a call as a ``function_call`` item, a reasoning
    turn as a ``reasoning`` item."""
    items: list[dict[str, Any]] = []
    for message in chat["messages"]:
        if message.get("tool_calls"):
            items += [
                {
                    "type": "function_call",
                    "call_id": call["id"],
                    "name": call["function"]["name"],
                    "arguments": call["function"]["arguments"],
                }
                for call in message["tool_calls"]
            ]
        elif message.get("reasoning_content"):
            text = {"type": "reasoning_text", "text": message["reasoning_content"]}
            items.append({"type": "reasoning", "summary": [], "content": [text]})
        else:
            items.append(message)
    out: dict[str, Any] = {
        "input": items,
        "max_output_tokens": chat["max_tokens"],
        "temperature": chat["temperature"],
    }
    if "tools" in chat:
        out["tools"] = [{"type": "function", **tool["function"]} for tool in chat["tools"]]
    return out
