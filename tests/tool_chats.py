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
