"""The Responses and Anthropic Messages requests as the chat completions llama-server makes of them.

llama-server answers ``/v1/responses`` and ``/v1/messages`` by converting the request into a chat
completion request and running that (its ``server_chat_convert_responses_to_chatcmpl`` and
``server_chat_convert_anthropic_to_oai``). A receipt's sampler settings and a replay start from
the same chat completion, so both are computed here the way llama-server computes them:

- Responses: every field of the request passes through, except ``input`` and ``instructions``
  (made into ``messages``), ``max_output_tokens`` (becomes ``max_tokens``), ``reasoning``
  (its ``effort`` becomes ``reasoning_effort``) and ``tools`` (the function tools kept, in chat's
  shape). A ``seed`` passes, so bankml's drawn seed reaches the sampler.
- Messages: only ``temperature``, ``top_p``, ``top_k``, ``stream``, ``chat_template_kwargs``,
  ``stop_sequences`` (as ``stop``), ``max_tokens`` (4096 when absent), ``thinking``,
  ``metadata.user_id``, ``tools`` and ``tool_choice`` pass; every other field, ``seed``
  included, is dropped, and llama-server draws a seed of its own that its answer does not show.

``chat_fields(api, body)`` is the converted request without its messages and tools (what the
sampler and the token limit are read from; it never fails on the messages); ``to_chat(api,
body)`` is the whole converted request, or ``NotConverted`` for an input this module does not
convert (images, files, tool calls and results, reasoning items: the replay says it cannot
replay such a request).

``n_cmpl_of(request)`` is how many completions a request asks of each prompt (``n_cmpl`` or
``n``), for the receipts that number a request's answers as llama-server numbers its tasks.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from bankml.receipts.kinds import MESSAGES, RESPONSES

MESSAGES_DEFAULT_MAX_TOKENS = 4096  # llama-server's, when a Messages request names none
_MESSAGES_PASSED = ("temperature", "top_p", "top_k", "stream", "chat_template_kwargs")


class NotConverted(ValueError):
    """The request holds something llama-server converts that this module does not."""


def chat_fields(api: str, body: dict[str, Any]) -> dict[str, Any]:
    """The top-level fields of the chat completion llama-server makes of ``body`` (no
    ``messages``, no ``tools``)."""
    if api == RESPONSES:
        out = dict(body)  # shallow: nothing nested is changed, and a deep copy could recurse
        for name in ("input", "instructions", "tools"):
            out.pop(name, None)
        if "max_output_tokens" in body:
            del out["max_output_tokens"]
            out["max_tokens"] = body["max_output_tokens"]
        reasoning = out.pop("reasoning", None)
        if isinstance(reasoning, dict) and "effort" in reasoning:
            out["reasoning_effort"] = reasoning["effort"]
        return out
    if api != MESSAGES:
        raise ValueError(f"no conversion for the {api} API")
    out = {}
    if "stop_sequences" in body:
        out["stop"] = body["stop_sequences"]
    # a null stays null, as in llama-server
    out["max_tokens"] = body.get("max_tokens", MESSAGES_DEFAULT_MAX_TOKENS)
    for name in _MESSAGES_PASSED:
        if name in body:
            out[name] = body[name]
    thinking = body.get("thinking")
    if isinstance(thinking, dict) and thinking.get("type") == "enabled":
        budget = thinking.get("budget_tokens", 10000)
        out["thinking_budget_tokens"] = budget
    metadata = body.get("metadata")
    user_id = metadata.get("user_id") if isinstance(metadata, dict) else None
    if isinstance(user_id, str) and user_id:
        out["__metadata_user_id"] = user_id
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        if choice.get("type") == "auto":
            out["tool_choice"] = "auto"
        elif choice.get("type") in ("any", "tool"):
            out["tool_choice"] = "required"
    return out


def to_chat(api: str, body: dict[str, Any]) -> dict[str, Any]:
    """The whole chat completion request llama-server makes of ``body``."""
    out = chat_fields(api, body)
    if api == RESPONSES:
        out["messages"] = _responses_messages(body)
        tools = _responses_tools(body.get("tools")) if "tools" in body else None
        if tools:
            out["tools"] = tools
        return out
    out["messages"] = _anthropic_messages(body)
    if isinstance(body.get("tools"), list):
        out["tools"] = [_anthropic_tool(t) for t in body["tools"]]
    return out


def _text_part(text: Any) -> dict[str, Any]:
    return {"text": text, "type": "text"}


def _responses_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    if "input" not in body:
        raise NotConverted("'input' is required")
    messages: list[dict[str, Any]] = []
    if "instructions" in body:
        instructions = body["instructions"]
        messages.append(
            {"role": "system", "content": instructions if isinstance(instructions, str) else ""}
        )
    given = body["input"]
    if isinstance(given, str):
        messages.append({"role": "user", "content": given})
        return messages
    if not isinstance(given, list):
        raise NotConverted("'input' must be a string or array of objects")
    for item in given:
        if not isinstance(item, dict):
            raise NotConverted("an input item is not an object")
        item = copy.deepcopy(item)
        if isinstance(item.get("content"), str):
            item["content"] = [{"text": item["content"], "type": "input_text"}]
        role = item.get("role")
        if isinstance(item.get("content"), list) and role in ("user", "system", "developer"):
            parts = []
            for part in item["content"]:
                if not isinstance(part, dict) or part.get("type") != "input_text":
                    raise NotConverted("an input part other than input_text")
                if "text" not in part:
                    raise NotConverted("'Input text' requires 'text'")
                parts.append(_text_part(part["text"]))
            item.pop("type", None)
            item.pop("status", None)
            item["content"] = parts
            messages.append(item)
        elif role == "assistant" and item.get("type") == "message":
            # an earlier answer given back; merging it into a previous assistant turn, or its
            # refusals, is not converted here
            if messages and messages[-1].get("role") == "assistant":
                raise NotConverted("two assistant items in a row")
            parts = []
            for part in item.get("content") or []:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind not in ("output_text", "input_text") or not isinstance(
                    part.get("text"), str
                ):
                    raise NotConverted("an assistant part other than output_text")
                parts.append(_text_part(part["text"]))
            item.pop("status", None)
            item.pop("type", None)
            item["content"] = parts
            messages.append(item)
        else:
            raise NotConverted(f"an input item of type {item.get('type')!r}")
    return messages


def _responses_tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise NotConverted("'tools' must be an array of objects")
    out = []
    for tool in tools:
        if not isinstance(tool, dict) or tool.get("type") != "function":
            continue  # llama-server skips them too
        function = {k: copy.deepcopy(v) for k, v in tool.items() if k != "type"}
        function.setdefault("strict", True)
        out.append({"type": "function", "function": function})
    return out


def _anthropic_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    system = body.get("system")
    if system is not None:
        if isinstance(system, str):
            text = system
        elif isinstance(system, list):
            text = "".join(
                b.get("text", "") if isinstance(b.get("text"), str) else ""
                for b in system
                if isinstance(b, dict) and b.get("type") == "text"
            )
        else:
            text = ""
        if text.startswith("x-anthropic-billing-header:"):
            raise NotConverted("a billing-header system prompt (llama-server edits it)")
        messages.append({"role": "system", "content": text})
    if "messages" not in body:
        raise NotConverted("'messages' is required")
    given = body["messages"]
    if not isinstance(given, list):
        return messages
    for message in given:
        if not isinstance(message, dict):
            raise NotConverted("a message is not an object")
        if "content" not in message:
            if message.get("role") != "assistant":
                messages.append(copy.deepcopy(message))
            continue
        content = message["content"]
        if not isinstance(content, list):
            messages.append(copy.deepcopy(message))
            continue
        parts = []
        for block in content:
            if not isinstance(block, dict) or block.get("type") != "text":
                raise NotConverted("a content block other than text")
            parts.append(copy.deepcopy(block))
        if parts:
            messages.append({"role": message.get("role", ""), "content": parts})
    return messages


def _anthropic_tool(tool: Any) -> dict[str, Any]:
    tool = tool if isinstance(tool, dict) else {}
    name, description = tool.get("name"), tool.get("description")
    return {
        "type": "function",
        "function": {
            "name": name if isinstance(name, str) else "",
            "description": description if isinstance(description, str) else "",
            "parameters": copy.deepcopy(tool.get("input_schema", {})),
        },
    }


def n_cmpl_of(request: Mapping[str, Any]) -> int:
    """The completions a request asks for each prompt (``n_cmpl``, or its alias ``n``), as the
    engine reads the field (a number truncated to an integer, at least 1)."""
    for name in ("n_cmpl", "n"):
        value = request.get(name)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return max(int(value), 1)
    return 1
