"""A chat request's tool and reasoning fields, read as llama-server reads them
(tools/server/server-common.cpp ``oaicompat_chat_params_parse``, common/chat.cpp
``common_chat_tools_parse_oaicompat``, ``common_chat_tool_choice_parse_oaicompat``,
``common_reasoning_format_from_name``), with the server's own defaults (``ChatDefaults``: the
``--reasoning``, ``--reasoning-format``, ``--chat-template-kwargs``, ``--reasoning-budget`` and
``--reasoning-budget-message`` flags).

``chat_fields(body, defaults, template_thinks)`` returns ``ChatFields``: the tools (each
``{"type": "function", "function": {"name", "description", "parameters"}}`` as llama-server
normalises them), ``tool_choice`` (auto, none, required), ``parallel_tool_calls``,
``reasoning_format``, ``enable_thinking``, the merged ``chat_template_kwargs`` (the server's,
then the request's over them), and the reasoning budget. The refusals are llama-server's, in its
order, with its messages (``RequestError``: HTTP 400; where llama-server answers 500 for a body
it cannot read, bankml answers 400 with the same message):

- ``tools`` that is not an array (null is none), a tool without ``type``, of another type than
  ``function``, without ``function`` or without a function ``name``: "Failed to parse tools:
  <why>; tools = <the tools, indented by 2>";
- a ``tool_choice`` string other than auto, none, required: "Invalid tool_choice: <it>" (a
  value that is not a string is read as auto, as llama-server's ``json_value`` reads it);
- ``grammar`` with tools whose choice is not none: "Cannot use custom grammar constraints with
  tools.";
- a ``reasoning_format`` other than none, auto, deepseek, deepseek-legacy: "Unknown reasoning
  format: <it>";
- ``enable_thinking`` given as a string in the kwargs: 'invalid type for "enable_thinking"
  (expected boolean, got string)'.

``reasoning_effort`` "none" turns thinking off (and takes the kwarg away); another value is
given to the template as the ``reasoning_effort`` kwarg. Pure Python, no Twisted.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from bankml.engine_cupy.chat_template import TemplateError, normalize_tools
from bankml.engine_cupy.request import RequestError

REASONING_FORMATS = ("none", "auto", "deepseek", "deepseek-legacy")
TOOL_CHOICES = ("auto", "none", "required")


@dataclass(frozen=True)
class ChatDefaults:
    """The server's chat settings (llama-server's flags)."""

    reasoning_format: str = "auto"  # --reasoning-format
    reasoning: str = "auto"  # --reasoning on|off|auto
    chat_template_kwargs: Mapping[str, Any] = field(default_factory=dict)  # JSON values
    reasoning_budget: int = -1  # --reasoning-budget
    reasoning_budget_message: str = ""  # --reasoning-budget-message

    def enable_thinking(self, template_thinks: bool) -> bool:
        """Thinking is on unless ``--reasoning off``, where the template can think."""
        return self.reasoning != "off" and template_thinks


@dataclass(frozen=True)
class ChatFields:
    tools: list[dict[str, Any]]
    tool_choice: str
    parallel_tool_calls: bool
    reasoning_format: str
    enable_thinking: bool
    chat_template_kwargs: dict[str, Any]
    reasoning_budget: int
    reasoning_budget_message: str

    @property
    def calls_tools(self) -> bool:
        """The answer is parsed for tool calls (llama-server's ``parse_tool_calls``)."""
        return bool(self.tools) and self.tool_choice != "none"


def parse_tools(tools: Any) -> list[dict[str, Any]]:
    """``common_chat_tools_parse_oaicompat`` then ``common_chat_tools_to_json_oaicompat``
    (chat_template.normalize_tools), null read as none; its refusals as RequestError."""
    if tools is None:
        return []
    try:
        return normalize_tools(tools)
    except TemplateError as err:
        raise RequestError(str(err)) from None


def _type(value: Any) -> str:
    return {bool: "boolean", str: "string", list: "array", dict: "object", type(None): "null"}.get(
        type(value), "number"
    )


def _json_value(body: Mapping[str, Any], key: str, default: Any, kind: type) -> Any:
    """llama-server's ``json_value``: the field when it has the default's type, else the
    default (null and a wrong type alike)."""
    value = body.get(key)
    if (
        value is None
        or not isinstance(value, kind)
        or (kind is not bool and isinstance(value, bool))
    ):
        return default
    return value


def chat_fields(
    body: Mapping[str, Any],
    defaults: ChatDefaults,
    template_thinks: bool,
    supports_parallel_tool_calls: bool,
) -> ChatFields:
    """The body's tool and reasoning fields (``template_thinks``: the template has a reasoning
    block thinking can turn on; ``supports_parallel_tool_calls``: its caps' default)."""
    tool_choice = _json_value(body, "tool_choice", "auto", str)
    tools = parse_tools(body.get("tools"))
    if tool_choice not in TOOL_CHOICES:
        raise RequestError(f"Invalid tool_choice: {tool_choice}")
    parallel = _json_value(body, "parallel_tool_calls", supports_parallel_tool_calls, bool)
    reasoning_format = defaults.reasoning_format
    if "reasoning_format" in body:
        value = body["reasoning_format"]
        if not isinstance(value, str):
            raise RequestError(
                f"[json.exception.type_error.302] type must be string, but is {_type(value)}"
            )
        if value not in REASONING_FORMATS:
            raise RequestError(f"Unknown reasoning format: {value}")
        reasoning_format = value
    enable_thinking = defaults.enable_thinking(template_thinks)
    if tools and tool_choice != "none" and "grammar" in body:
        raise RequestError("Cannot use custom grammar constraints with tools.")
    kwargs = dict(defaults.chat_template_kwargs)
    kwargs.update(_json_value(body, "chat_template_kwargs", {}, dict))
    if "enable_thinking" in kwargs:
        switch = kwargs["enable_thinking"]
        if switch is True or switch is False:
            enable_thinking = switch
        elif isinstance(switch, str):
            raise RequestError('invalid type for "enable_thinking" (expected boolean, got string)')
    if "reasoning_effort" in body:
        effort = _json_value(body, "reasoning_effort", "", str)
        if effort == "none":
            enable_thinking = False
            kwargs.pop("reasoning_effort", None)
        elif effort:
            kwargs["reasoning_effort"] = effort
    budget = body.get("reasoning_budget_tokens", body.get("thinking_budget_tokens", -1))
    budget = budget if isinstance(budget, int) and not isinstance(budget, bool) else -1
    if budget == -1:
        budget = defaults.reasoning_budget
    message = _json_value(body, "reasoning_budget_message", defaults.reasoning_budget_message, str)
    return ChatFields(
        tools=tools,
        tool_choice=tool_choice,
        parallel_tool_calls=parallel,
        reasoning_format=reasoning_format,
        enable_thinking=enable_thinking,
        chat_template_kwargs=kwargs,
        reasoning_budget=budget,
        reasoning_budget_message=message,
    )
