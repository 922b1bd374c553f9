"""A chat request's tool and reasoning fields, read as llama-server (build 11434) reads them:
the values it resolves and the refusals it gives, with its messages (each message below is the
one the real llama-server answers for the same body)."""

from __future__ import annotations

from typing import Any

import pytest

from bankml.engine_cupy.chat_request import ChatDefaults, chat_fields, parse_tools
from bankml.engine_cupy.request import RequestError

USER = [{"role": "user", "content": "hi"}]
SERVER = ChatDefaults()
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object"}},
}


def _fields(body: dict[str, Any], defaults: ChatDefaults = SERVER, thinks: bool = True) -> Any:
    return chat_fields({"messages": USER, **body}, defaults, thinks, True)


def test_tools_are_normalised_as_llama_server_does() -> None:
    assert parse_tools(None) == []
    assert parse_tools([{"type": "function", "function": {"name": "f"}}]) == [
        {
            "type": "function",
            "function": {
                "name": "f",
                "description": "",
                "parameters": {},
            },
        }
    ]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (
            {"tools": {"a": 1}},
            "Failed to parse tools: Expected 'tools' to be an array, got {\"a\":1}; "
            'tools = {\n  "a": 1\n}',
        ),
        (
            {"tools": [{"type": "function"}]},
            'Failed to parse tools: Missing tool function: {"type":"function"}; '
            'tools = [\n  {\n    "type": "function"\n  }\n]',
        ),
        (
            {"tools": [{"type": "code", "function": {"name": "f"}}]},
            'Failed to parse tools: Unsupported tool type: {"type":"code","function":{"name":"f"}}; '
            'tools = [\n  {\n    "type": "code",\n    "function": {\n      "name": "f"\n    }\n  }\n]',
        ),
        ({"tools": [WEATHER], "tool_choice": "bogus"}, "Invalid tool_choice: bogus"),
        (
            {"tools": [WEATHER], "grammar": 'root ::= "a"'},
            "Cannot use custom grammar constraints with tools.",
        ),
        ({"reasoning_format": "bogus"}, "Unknown reasoning format: bogus"),
        (
            {"chat_template_kwargs": {"enable_thinking": "yes"}},
            'invalid type for "enable_thinking" (expected boolean, got string)',
        ),
    ],
)
def test_refusals_are_llama_servers(body: dict[str, Any], message: str) -> None:
    with pytest.raises(RequestError) as err:
        _fields(body)
    assert str(err.value) == message


def test_values_llama_server_reads_as_defaults() -> None:
    # a tool_choice that is not a string, a kwargs that is not an object: their defaults
    read = _fields(
        {"tools": [WEATHER], "tool_choice": {"type": "function"}, "chat_template_kwargs": "x"}
    )
    assert read.tool_choice == "auto" and read.chat_template_kwargs == {} and read.calls_tools
    assert not _fields({"tools": [WEATHER], "tool_choice": "none", "grammar": "x"}).calls_tools
    assert _fields({"parallel_tool_calls": "yes"}).parallel_tool_calls is True
    assert _fields({"parallel_tool_calls": False}).parallel_tool_calls is False


def test_thinking_follows_the_flags_the_kwargs_and_the_effort() -> None:
    assert _fields({}).enable_thinking is True
    assert _fields({}, thinks=False).enable_thinking is False
    off = ChatDefaults(reasoning="off", chat_template_kwargs={"enable_thinking": False})
    assert _fields({}, off).enable_thinking is False
    assert _fields({"chat_template_kwargs": {"enable_thinking": True}}, off).enable_thinking is True
    effort = _fields(
        {"reasoning_effort": "none", "chat_template_kwargs": {"reasoning_effort": "x"}}
    )
    assert effort.enable_thinking is False and "reasoning_effort" not in effort.chat_template_kwargs
    assert _fields({"reasoning_effort": "high"}).chat_template_kwargs == {
        "reasoning_effort": "high"
    }
    assert _fields({"reasoning_format": "none"}).reasoning_format == "none"
    assert _fields({}, ChatDefaults(reasoning_format="deepseek")).reasoning_format == "deepseek"


def test_the_reasoning_budget_request_over_the_flag() -> None:
    flag = ChatDefaults(reasoning_budget=8, reasoning_budget_message="enough")
    assert (_fields({}, flag).reasoning_budget, _fields({}, flag).reasoning_budget_message) == (
        8,
        "enough",
    )
    assert _fields({"reasoning_budget_tokens": 3}, flag).reasoning_budget == 3
    assert _fields({"thinking_budget_tokens": 2}, flag).reasoning_budget == 2
    assert _fields({"reasoning_budget_tokens": -1}, flag).reasoning_budget == 8
