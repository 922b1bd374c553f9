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
body)`` is the whole converted request, as llama-server converts it: system prompts, text, image,
tool-call, tool-result and reasoning parts, an assistant item merged into the assistant message
before it, Anthropic's billing-header stamp made constant. Where llama-server refuses a body,
``ConversionError`` carries its message (llama-server answers a missing ``messages`` with a 500;
bankml's callers answer every ``ConversionError`` with a 400).

``n_cmpl_of(request)`` is how many completions a request asks of each prompt (``n_cmpl`` or
``n``), for the receipts that number a request's answers as llama-server numbers its tasks.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from typing import Any

from bankml.receipts.kinds import MESSAGES, RESPONSES

MESSAGES_DEFAULT_MAX_TOKENS = 4096  # llama-server's, when a Messages request names none
_MESSAGES_PASSED = ("temperature", "top_p", "top_k", "stream", "chat_template_kwargs")


class ConversionError(ValueError):
    """llama-server refuses to convert the request: its message (a 400)."""


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
    """The whole chat completion request llama-server makes of ``body`` (``ConversionError``
    with llama-server's message where it refuses the body)."""
    if api == RESPONSES:
        return _responses_to_chat(body)
    if api != MESSAGES:
        raise ValueError(f"no conversion for the {api} API")
    out: dict[str, Any] = {"messages": _anthropic_messages(body)}
    if "tools" in body:
        tools = body["tools"]
        if isinstance(tools, list):
            out["tools"] = [_anthropic_tool(t) for t in tools]
    out.update(chat_fields(MESSAGES, body))
    return out


def _string(obj: Any, name: str) -> str:
    """nlohmann's ``json_value(obj, name, std::string())``: the member when it is a string."""
    value = obj.get(name) if isinstance(obj, dict) else None
    return value if isinstance(value, str) else ""


def _has_string(obj: Any, name: str) -> bool:
    return isinstance(obj, dict) and isinstance(obj.get(name), str)


def _has_array(obj: Any, name: str) -> bool:
    return isinstance(obj, dict) and isinstance(obj.get(name), list)


def _text_part(text: Any) -> dict[str, Any]:
    return {"text": text, "type": "text"}


def _image_part(url: Any) -> dict[str, Any]:
    return {"image_url": {"url": url}, "type": "image_url"}


def _responses_to_chat(body: dict[str, Any]) -> dict[str, Any]:
    """``server_chat_convert_responses_to_chatcmpl``: every field passes but ``input``,
    ``instructions``, ``tools``, ``max_output_tokens`` and ``reasoning``, which are converted."""
    if "input" not in body:
        raise ConversionError("'input' is required")
    if _string(body, "previous_response_id"):
        raise ConversionError("llama.cpp does not support 'previous_response_id'.")
    out = {k: v for k, v in body.items() if k not in ("input", "instructions")}
    messages: list[dict[str, Any]] = []
    if "instructions" in body:
        messages.append({"role": "system", "content": _string(body, "instructions")})
    given = body["input"]
    if isinstance(given, str):
        messages.append({"role": "user", "content": given})
    elif isinstance(given, list):
        for item in given:
            _responses_item(copy.deepcopy(item), messages)
    else:
        raise ConversionError("'input' must be a string or array of objects")
    out["messages"] = messages
    if "tools" in body:
        out.pop("tools")
        tools = _responses_tools(body["tools"])
        if tools:
            out["tools"] = tools
    if "max_output_tokens" in body:
        del out["max_output_tokens"]
        out["max_tokens"] = body["max_output_tokens"]
    if "reasoning" in body:
        reasoning = out.pop("reasoning")
        if isinstance(reasoning, dict) and "effort" in reasoning:
            out["reasoning_effort"] = reasoning["effort"]
    return out


def _responses_item(item: Any, messages: list[dict[str, Any]]) -> None:
    """One ``input`` item as chat messages (an assistant item merged into the assistant message
    before it, as llama-server merges them)."""
    merge = bool(messages) and messages[-1].get("role") == "assistant"
    if _has_string(item, "content"):
        item["content"] = [{"text": item["content"], "type": "input_text"}]
    kind = item.get("type") if _has_string(item, "type") else None
    if (
        _has_array(item, "content")
        and _has_string(item, "role")
        and item["role"] in ("user", "system", "developer")
    ):
        parts = []
        for part in item["content"]:
            part_type = _string(part, "type")
            if part_type == "input_text":
                if "text" not in part:
                    raise ConversionError("'Input text' requires 'text'")
                parts.append(_text_part(part["text"]))
            elif part_type == "input_image":
                if "image_url" not in part:
                    raise ConversionError("'image_url' is required")
                parts.append(_image_part(part["image_url"]))
            elif part_type == "input_file":
                raise ConversionError("'input_file' is not supported by llamacpp at this moment")
            else:
                raise ConversionError(
                    "'type' must be one of 'input_text', 'input_image', or 'input_file'"
                )
        item.pop("type", None)
        item.pop("status", None)
        item["content"] = parts
        messages.append(item)
    elif _has_string(item, "role") and item["role"] == "assistant" and kind == "message":
        parts = []
        if _has_array(item, "content"):
            for part in item["content"]:
                part_type = _string(part, "type")
                if part_type in ("output_text", "input_text"):
                    if not _has_string(part, "text"):
                        raise ConversionError("'Output text' requires 'text'")
                    parts.append(_text_part(part["text"]))
                elif part_type == "refusal":
                    if not _has_string(part, "refusal"):
                        raise ConversionError("'Refusal' requires 'refusal'")
                    parts.append({"refusal": part["refusal"], "type": "refusal"})
                else:
                    raise ConversionError("'type' must be one of 'output_text' or 'refusal'")
        if merge:
            previous = messages[-1]
            if not isinstance(previous.get("content"), list):
                previous["content"] = []
            previous["content"].extend(parts)
        else:
            item.pop("status", None)
            item.pop("type", None)
            item["content"] = parts
            messages.append(item)
    elif (
        kind == "function_call"
        and _has_string(item, "arguments")
        and _has_string(item, "call_id")
        and _has_string(item, "name")
    ):
        call = {
            "function": {"arguments": item["arguments"], "name": item["name"]},
            "id": item["call_id"],
            "type": "function",
        }
        if merge:
            previous = messages[-1]
            if not isinstance(previous.get("tool_calls"), list):
                previous["tool_calls"] = []
            previous["tool_calls"].append(call)
        else:
            messages.append({"role": "assistant", "tool_calls": [call]})
    elif (
        kind == "function_call_output"
        and _has_string(item, "call_id")
        and (_has_string(item, "output") or _has_array(item, "output"))
    ):
        output = item["output"]
        if isinstance(output, list):
            for part in output:
                if not isinstance(part, dict) or "type" not in part:
                    raise ConversionError("Output of tool call missing 'type' field")
                if part["type"] not in ("input_text", "input_image"):
                    raise ConversionError(
                        "Output of tool call should be 'Input text' or 'Input image'"
                    )
                if part["type"] == "input_text":
                    part["type"] = "text"
                else:
                    if "image_url" not in part:
                        raise ConversionError("'image_url' is required")
                    part["type"] = "image_url"
                    part["image_url"] = {"url": part["image_url"]}
        messages.append({"content": output, "role": "tool", "tool_call_id": item["call_id"]})
    elif kind == "reasoning" and _has_array(item, "summary"):
        if not _has_array(item, "content"):
            raise ConversionError("item['content'] is not an array")
        if not item["content"]:
            raise ConversionError("item['content'] is empty")
        if not _has_string(item["content"][0], "text"):
            raise ConversionError("item['content']['text'] is not a string")
        text = item["content"][0]["text"]
        if merge:
            messages[-1]["reasoning_content"] = text
        else:
            messages.append({"role": "assistant", "content": [], "reasoning_content": text})
    else:
        raise ConversionError("Cannot determine type of 'item'")


def _responses_tools(tools: Any) -> list[dict[str, Any]]:
    """The function tools in chat's shape (``strict`` true unless given); llama-server skips the
    Responses tools that have no chat equivalent."""
    if not isinstance(tools, list):
        raise ConversionError("'tools' must be an array of objects")
    out = []
    for tool in tools:
        if _string(tool, "type") != "function":
            continue
        function = {k: copy.deepcopy(v) for k, v in tool.items() if k != "type"}
        function.setdefault("strict", True)
        out.append({"type": "function", "function": function})
    return out


_BILLING_HEADER = "x-anthropic-billing-header:"


def _billing_header_normalized(text: str) -> str:
    """llama-server's edit of a billing-header system prompt: the five characters of its
    ``cch=`` stamp (new on every request, so no prompt cache would get past it) become ``f``."""
    if not text.startswith(_BILLING_HEADER):
        return text
    at = text.find("cch=", len(_BILLING_HEADER))
    if at < 0:
        return text
    start = at + 4
    if start + 5 < len(text) and text[start + 5] == ";":
        return text[:start] + "fffff" + text[start + 5 :]
    return text


def _anthropic_system(system: Any) -> str:
    if isinstance(system, str):
        return _billing_header_normalized(system)
    if isinstance(system, list):
        return "".join(
            _billing_header_normalized(_string(block, "text"))
            for block in system
            if _string(block, "type") == "text"
        )
    return ""


def _anthropic_image(source: Any) -> dict[str, Any] | None:
    source = source if isinstance(source, dict) else {}
    kind = _string(source, "type")
    if kind == "base64":
        media_type = source.get("media_type")
        media_type = media_type if isinstance(media_type, str) else "image/jpeg"
        return _image_part(f"data:{media_type};base64,{_string(source, 'data')}")
    if kind == "url":
        return _image_part(_string(source, "url"))
    return None


def _tool_result(block: dict[str, Any]) -> dict[str, Any]:
    """A ``tool_result`` block as a ``tool`` message: its text joined, or its parts where it
    holds an image."""
    message: dict[str, Any] = {"role": "tool", "tool_call_id": _string(block, "tool_use_id")}
    content = block.get("content")
    if isinstance(content, str):
        message["content"] = content
    elif isinstance(content, list):
        text, parts, images = "", [], False
        for part in content:
            part_type = _string(part, "type")
            if part_type == "text":
                text += _string(part, "text")
                parts.append({"type": "text", "text": _string(part, "text")})
            elif part_type == "image":
                images = True
                image = _anthropic_image(part.get("source"))
                if image is not None:
                    parts.append({"type": "image_url", "image_url": image["image_url"]})
        message["content"] = parts if images else text
    else:
        message["content"] = ""
    return message


def _anthropic_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """``server_chat_convert_anthropic_to_oai``'s messages: the system prompt first, then each
    message; a message's blocks become its content parts, reasoning and tool calls, and its
    ``tool_result`` blocks ``tool`` messages after it."""
    messages: list[dict[str, Any]] = []
    if body.get("system") is not None:
        messages.append({"role": "system", "content": _anthropic_system(body["system"])})
    if "messages" not in body:
        raise ConversionError("'messages' is required")
    given = body["messages"]
    for message in given if isinstance(given, list) else []:
        role = _string(message, "role")
        if not isinstance(message, dict) or "content" not in message:
            if role != "assistant":
                messages.append(copy.deepcopy(message))
            continue
        content = message["content"]
        if not isinstance(content, list):
            messages.append(copy.deepcopy(message))
            continue
        parts: list[Any] = []
        calls: list[dict[str, Any]] = []
        results: list[dict[str, Any]] = []
        reasoning = ""
        for block in content:
            block_type = _string(block, "type")
            if block_type == "text":
                parts.append(copy.deepcopy(block))
            elif block_type == "thinking":
                reasoning += _string(block, "thinking")
            elif block_type == "image":
                image = _anthropic_image(block.get("source"))
                if image is not None:
                    parts.append({"type": "image_url", "image_url": image["image_url"]})
            elif block_type == "tool_use":
                arguments = block.get("input", {})
                calls.append(
                    {
                        "id": _string(block, "id"),
                        "type": "function",
                        "function": {
                            "name": _string(block, "name"),
                            "arguments": json.dumps(
                                arguments, ensure_ascii=False, separators=(",", ":")
                            ),
                        },
                    }
                )
            elif block_type == "tool_result":
                results.append(_tool_result(block))
        if parts or calls or reasoning:
            converted: dict[str, Any] = {"role": role}
            if parts:
                converted["content"] = parts
            else:
                converted["content"] = ""
            if calls:
                converted["tool_calls"] = calls
            if reasoning:
                converted["reasoning_content"] = reasoning
            messages.append(converted)
        messages.extend(results)
    return messages


def _anthropic_tool(tool: Any) -> dict[str, Any]:
    schema = tool.get("input_schema", {}) if isinstance(tool, dict) else {}
    return {
        "type": "function",
        "function": {
            "name": _string(tool, "name"),
            "description": _string(tool, "description"),
            "parameters": copy.deepcopy(schema),
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
