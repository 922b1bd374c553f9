"""A GGUF's chat template, rendered as llama-server's ``/apply-template`` renders it.

The template runs in Jinja2's ``ImmutableSandboxedEnvironment`` with the options and the
variables of llama.cpp's own Jinja engine (common/jinja, common/chat.cpp):

* ``trim_blocks`` and ``lstrip_blocks`` on, undefined values chainable and rendered empty;
* ``messages`` normalised as llama-server does (content null -> "", content parts joined or kept
  per what the template reads, ``developer`` -> ``system``, empty ``reasoning_content`` dropped);
* ``bos_token``/``eos_token`` (the tokens' texts), ``add_generation_prompt`` (defined only when
  true), ``tools`` (only when given), ``enable_thinking``, ``datetime``/``date_string``,
  ``raise_exception``, ``strftime_now``, ``namespace``, ``dict``, ``range`` and any
  ``chat_template_kwargs``;
* ``tojson`` as llama.cpp writes JSON (insertion order, ", "/": " separators, no ASCII escaping);
* a trailing assistant message is continued (prefilled), not closed; with
  ``continue_final_message`` the last message is continued whatever its role;
* the rendered BOS text is dropped from the front when the tokenizer adds BOS itself.

A template that names a Python internal (an attribute or key starting with ``_``) is refused
when it is loaded, before anything runs; the sandbox stops any other unsafe access at run time.
A GGUF without a template gets llama.cpp's ChatML fallback.
"""

from __future__ import annotations

import functools
import json
import math
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.parser import Parser
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

from bankml.engine_cupy.autoparser.analysis import (
    AnalysisError,
    ReasoningAnalysis,
    TemplateAnalysis,
    analyze_reasoning,
    analyze_template,
)

# llama.cpp common/chat.cpp CHATML_TEMPLATE_SRC: what a model without a template gets.
CHATML_TEMPLATE = (
    "{%- for message in messages -%}\n"
    "  {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' -}}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "  {{- '<|im_start|>assistant\n' -}}\n"
    "{%- endif -%}"
)


# common_chat_continuation: how the last message is continued (continue_final_message)
CONTINUE_AUTO, CONTINUE_CONTENT, CONTINUE_REASONING = "auto", "content", "reasoning_content"


class TemplateError(ValueError):
    """The template or the messages cannot be rendered; the text says why."""


# ---------------------------------------------------------------------------------------------
# llama.cpp's JSON writer (jinja value_to_json) and value printing
# ---------------------------------------------------------------------------------------------


def _json_float(value: float) -> str:
    if math.isnan(value) or math.isinf(value):
        return "null"
    return f"{value:g}"  # std::ostream's default: 6 significant digits


def llama_json(
    value: Any,
    indent: int | None = None,
    item_sep: str | None = None,
    key_sep: str = ": ",
    level: int = 0,
) -> str:
    """JSON as llama.cpp's Jinja ``tojson`` writes it: key order kept, non-ASCII kept."""
    width = -1 if indent is None else indent
    sep = item_sep if item_sep is not None else (", " if width < 0 else ",")
    newline = "\n" if width >= 0 else ""
    pad_outer = " " * (level * width) if width > 0 else ""
    pad_inner = pad_outer + (" " * width if width > 0 else "")
    if value is None or isinstance(value, jinja2.Undefined):
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return _json_float(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, Mapping):
        if not value:
            return "{}"
        items = [
            pad_inner
            + json.dumps(str(k), ensure_ascii=False)
            + key_sep
            + llama_json(v, indent, item_sep, key_sep, level + 1)
            for k, v in value.items()
        ]
        return "{" + newline + (sep + newline).join(items) + newline + pad_outer + "}"
    if isinstance(value, (list, tuple)):
        if not value:
            return "[]"
        items = [pad_inner + llama_json(v, indent, item_sep, key_sep, level + 1) for v in value]
        return "[" + newline + (sep + newline).join(items) + newline + pad_outer + "]"
    return "null"


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Sequence[str] | None = None,
    sort_keys: bool = False,
) -> str:
    if sort_keys:
        raise TemplateError("tojson sort_keys=true not implemented")
    if isinstance(value, Iterator):
        value = list(value)  # a map/select result is a list to llama.cpp
    item_sep = separators[0] if separators else None
    key_sep = separators[1] if separators and len(separators) > 1 else ": "
    text = llama_json(value, indent, item_sep, key_sep)
    if ensure_ascii:
        text = text.encode("ascii", "backslashreplace").decode("ascii")
    return text


def _finalize(value: Any) -> Any:
    """Print values as llama.cpp does: None as "None", floats with 6 significant digits."""
    if isinstance(value, float) and not isinstance(value, bool):
        text = f"{value:f}".rstrip("0")
        return text + "0" if text.endswith(".") else text
    return value


def _as_string(value: Any) -> str:
    if value is None or isinstance(value, jinja2.Undefined):
        return ""
    return str(_finalize(value))


def _raise_exception(message: str) -> None:
    raise TemplateError(f"Jinja Exception: {message}")


def _strftime_now(fmt: str) -> str:
    return time.strftime(fmt, time.localtime())


# ---------------------------------------------------------------------------------------------
# Environment
# ---------------------------------------------------------------------------------------------


# The list methods llama.cpp's Jinja has that change the list (templates build lists with them).
_LIST_MUTATORS = ("append", "pop")


def _allowed_attribute(env: ImmutableSandboxedEnvironment, obj: Any, attr: str, value: Any) -> bool:
    if attr.startswith("_"):
        return False
    if isinstance(obj, list) and attr in _LIST_MUTATORS:
        return True
    return ImmutableSandboxedEnvironment.is_safe_attribute(env, obj, attr, value)


def _binop(
    env: ImmutableSandboxedEnvironment, context: Any, operator: str, left: Any, right: Any
) -> Any:
    """``+`` as llama.cpp's Jinja does it: with a string on either side it joins the two as
    strings (null or undefined reading as "", other values as they print)."""
    if operator == "+" and (isinstance(left, str) or isinstance(right, str)):
        return _as_string(left) + _as_string(right)
    return ImmutableSandboxedEnvironment.call_binop(env, context, operator, left, right)


class _Environment(ImmutableSandboxedEnvironment):
    """The sandbox, refusing every underscore name, with llama.cpp's globals only."""

    intercepted_binops = frozenset({"+"})

    def is_safe_attribute(self, obj: Any, attr: str, value: Any) -> bool:
        return _allowed_attribute(self, obj, attr, value)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        return _binop(self, context, operator, left, right)

    def unsafe_undefined(self, obj: Any, attribute: str) -> jinja2.Undefined:
        # Jinja2 would hand back an Undefined that prints empty; a template doing this is refused.
        raise SecurityError(
            f"access to attribute {attribute!r} of a {type(obj).__name__!r} is not allowed"
        )


class _GenerationTags(Extension):
    """``{% generation %}`` and ``{% endgeneration %}`` (transformers' markers) render nothing."""

    tags = {"generation", "endgeneration"}

    def parse(self, parser: Parser) -> nodes.Node:
        return nodes.Output([], lineno=next(parser.stream).lineno)


def _make_environment(
    env_class: type[ImmutableSandboxedEnvironment] = _Environment,
) -> ImmutableSandboxedEnvironment:
    env = env_class(
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=False,
        undefined=jinja2.ChainableUndefined,
        finalize=_finalize,
        autoescape=False,
        # {% break %} / {% continue %} and the ignored {% generation %} tags, as llama.cpp's Jinja
        extensions=["jinja2.ext.loopcontrols", _GenerationTags],
    )
    env.globals = {
        "raise_exception": _raise_exception,
        "strftime_now": _strftime_now,
        "namespace": env.globals["namespace"],
        "dict": dict,
        "range": range,
    }
    env.filters["tojson"] = _tojson
    return env


def _refuse_internals(ast: nodes.Template) -> None:
    """Refuse, before anything runs, a template naming a Python internal (``x.__class__``,
    ``x['__globals__']``, ``x._private``): no chat template needs one."""
    for node in ast.find_all((nodes.Getattr, nodes.Getitem, nodes.Name, nodes.Filter)):
        if isinstance(node, nodes.Getattr):
            name = node.attr
        elif isinstance(node, nodes.Getitem):
            name = (
                node.arg.value
                if isinstance(node.arg, nodes.Const) and isinstance(node.arg.value, str)
                else ""
            )
        elif isinstance(node, nodes.Filter):
            first = node.args[0] if node.name == "attr" and node.args else None
            name = (
                first.value
                if isinstance(first, nodes.Const) and isinstance(first.value, str)
                else ""
            )
        else:
            name = node.name if node.name.startswith("__") else ""
        if name.startswith("_"):
            raise TemplateError(
                f"chat template refused: it reaches for the Python internal {name!r} "
                f"(line {node.lineno})"
            )


def compile_template(source: str) -> jinja2.Template:
    """Parse and check a template; TemplateError on a syntax error or a reach for internals."""
    env = _make_environment()
    try:
        _refuse_internals(env.parse(source))
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as err:
        raise TemplateError(
            f"chat template syntax error on line {err.lineno}: {err.message}"
        ) from err


# ---------------------------------------------------------------------------------------------
# Capability probes (llama.cpp common/jinja/caps.cpp), judged from what the template reads
# ---------------------------------------------------------------------------------------------


@dataclass
class Caps:
    supports_string_content: bool = True
    supports_typed_content: bool = False
    supports_tools: bool = True
    supports_tool_calls: bool = True
    supports_system_role: bool = True
    supports_parallel_tool_calls: bool = True
    supports_object_arguments: bool = False


class _Marker(str):
    """The probe's string content: iterating it is an array access that fails, as in llama.cpp."""

    def __iter__(self):  # type: ignore[override]
        _Probe.current.ops.add((id(self), "array_access"))
        raise TypeError("Expected iterable or object type in for loop: got String")


class _MarkerList(list):
    def __iter__(self):  # type: ignore[override]
        _Probe.current.ops.add((id(self), "array_access"))
        return super().__iter__()


class _Probe(ImmutableSandboxedEnvironment):
    """Records which values the template reads: (id(container), key) and (id(value), op)."""

    current: _Probe

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.ops: set[tuple[int, str]] = set()
        _Probe.current = self

    def _note(self, obj: Any, key: Any) -> None:
        self.ops.add((id(obj), f"key:{key}"))
        if isinstance(key, int) and not isinstance(key, bool):
            self.ops.add((id(obj), "array_access"))

    def getitem(self, obj: Any, argument: Any) -> Any:
        self._note(obj, argument)
        return super().getitem(obj, argument)

    def getattr(self, obj: Any, attribute: str) -> Any:
        self._note(obj, attribute)
        return super().getattr(obj, attribute)

    intercepted_binops = frozenset({"+"})

    def is_safe_attribute(self, obj: Any, attr: str, value: Any) -> bool:
        return _allowed_attribute(self, obj, attr, value)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        return _binop(self, context, operator, left, right)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        # dict.get(key) reads that key; dict.items() reads every value (as llama.cpp counts them)
        owner = getattr(__obj, "__self__", None)
        if isinstance(owner, dict):
            name = getattr(__obj, "__name__", "")
            if name == "get" and args:
                __self._note(owner, args[0])
            elif name in ("items", "values"):
                _mark_used(__self, owner)
        return super().call(__context, __obj, *args, **kwargs)


def _probe_render(template_source: str, variables: dict[str, Any]) -> tuple[_Probe, bool, str]:
    env = _make_environment(_Probe)  # type: ignore[arg-type]
    assert isinstance(env, _Probe)
    probe = env
    string_test = env.tests["string"]
    env.tests["string"] = lambda value: (
        probe.ops.add((id(value), "test_is_string")),
        string_test(value),
    )[1]
    selectattr = env.filters["selectattr"]

    def tracked_selectattr(*args: Any, **kwargs: Any) -> Any:
        if len(args) > 1:
            probe.ops.add((id(args[1]), "selectattr"))
        return selectattr(*args, **kwargs)

    tracked_selectattr.jinja_pass_arg = getattr(selectattr, "jinja_pass_arg", None)  # type: ignore[attr-defined]
    env.filters["selectattr"] = tracked_selectattr

    def tracked_tojson(value: Any, *args: Any, **kwargs: Any) -> str:
        if isinstance(value, Iterator):
            value = list(value)
        _mark_used(probe, value)  # a value written out as JSON is read whole, as in llama.cpp
        return _tojson(_plain(value), *args, **kwargs)

    env.filters["tojson"] = tracked_tojson
    for name in ("items", "dictsort", "string"):
        env.filters[name] = _reading_whole(probe, env.filters[name])
    base = {"bos_token": "", "eos_token": "", "add_generation_prompt": True, "tools": []}
    try:
        text = env.from_string(template_source).render({**base, **variables})
        return probe, True, text
    except Exception:  # noqa: BLE001 - a failing probe is an answer, as in caps.cpp
        return probe, False, ""


def _reading_whole(probe: _Probe, fn: Callable[..., Any]) -> Callable[..., Any]:
    """A filter that reads its whole input (items, dictsort, string), marking it used."""

    def tracked(*args: Any, **kwargs: Any) -> Any:
        # a filter taking the environment or context gets it first (jinja_pass_arg)
        _mark_used(probe, args[1] if getattr(fn, "jinja_pass_arg", None) else args[0])
        return fn(*args, **kwargs)

    tracked.jinja_pass_arg = getattr(fn, "jinja_pass_arg", None)  # type: ignore[attr-defined]
    return tracked


def _plain(value: Any) -> Any:
    """A probe value as plain lists and dicts (writing it out is no array access)."""
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in list.copy(value)]
    return value


def _mark_used(probe: _Probe, value: Any) -> None:
    probe.ops.add((id(value), "used"))
    if isinstance(value, Mapping):
        for item in value.values():
            _mark_used(probe, item)
    elif isinstance(value, (list, tuple)):
        for item in list.copy(value) if isinstance(value, list) else value:
            _mark_used(probe, item)


def _has(probe: _Probe, obj: Any, op: str) -> bool:
    return (id(obj), op) in probe.ops


def detect_caps(source: str) -> Caps:
    caps = Caps()
    content = _Marker("STRING_MARKER")
    probe, ok, text = _probe_render(source, {"messages": [{"role": "user", "content": content}]})
    checks_string = _has(probe, content, "test_is_string")
    as_array = _has(probe, content, "selectattr") or _has(probe, content, "array_access")
    caps.supports_typed_content = as_array
    if not ok or (as_array and "STRING_MARKER" not in text):
        caps.supports_string_content = False
    if checks_string:
        parts = _MarkerList()
        probe, ok, _ = _probe_render(source, {"messages": [{"role": "user", "content": parts}]})
        if ok and (_has(probe, parts, "selectattr") or _has(probe, parts, "array_access")):
            caps.supports_typed_content = True

    system = {"role": "system", "content": "System message"}
    probe, _, _ = _probe_render(
        source, {"messages": [system, {"role": "user", "content": "User message"}]}
    )
    caps.supports_system_role = _has(probe, system, "key:content")

    for arguments in ({"arg": "value"}, '{"arg": "value"}'):
        call = {
            "id": "call00001",
            "type": "function",
            "function": {"name": "tool1", "arguments": arguments},
        }
        assistant = {"role": "assistant", "content": "", "tool_calls": [call]}
        tool = {
            "name": "tool1",
            "description": "Tool description",
            "parameters": {
                "type": "object",
                "properties": {"arg": {"type": "string", "description": "Arg description"}},
                "required": ["arg"],
            },
        }
        tools = [{"name": "tool", "type": "function", "function": tool}]
        messages = [
            {"role": "user", "content": "User message"},
            assistant,
            {"role": "tool", "content": "Tool response", "tool_call_id": "call00001"},
            {"role": "assistant", "content": "The tool response was 'tool response'"},
            {"role": "user", "content": "User message"},
        ]
        probe, ok, text = _probe_render(source, {"messages": messages, "tools": tools})
        if not ok:
            if isinstance(arguments, str):
                caps.supports_tool_calls = caps.supports_tools = False
            continue
        if not (_has(probe, tool, "key:name") or _has(probe, tool, "used")):
            caps.supports_tools = False
        if not _has(probe, assistant, "key:tool_calls"):
            caps.supports_tool_calls = False
            break
        if isinstance(arguments, dict):
            if (
                _has(probe, arguments, "key:arg")
                or _has(probe, arguments, "used")
                or '"arg"' in text
            ):
                caps.supports_object_arguments = True
                break
    caps.supports_parallel_tool_calls = _reads_second_call(source, caps)
    return caps


def _reads_second_call(source: str, caps: Caps) -> bool:
    """caps.cpp's parallel tool call probe: an assistant turn with two calls; the template
    supports parallel calls when it reads the second call's function."""
    arguments: Any = {"arg": "value"} if caps.supports_object_arguments else '{"arg": "value"}'
    calls = [
        {
            "id": call_id,
            "type": "function",
            "function": {"name": "tool1", "arguments": arguments},
        }
        for call_id in ("call00001", "call00002")
    ]
    tool = {
        "name": "tool",
        "type": "function",
        "function": {
            "name": "tool1",
            "description": "Tool description",
            "parameters": {
                "type": "object",
                "properties": {"arg": {"type": "string", "description": "Arg description"}},
                "required": ["arg"],
            },
        },
    }
    messages = [
        {"role": "user", "content": "User message"},
        {"role": "assistant", "content": "", "tool_calls": calls},
        {"role": "tool", "content": "Tool response", "tool_call_id": "call00001"},
        {"role": "assistant", "content": "The tool response was 'tool response'"},
        {"role": "user", "content": "User message"},
    ]
    probe, ok, _ = _probe_render(source, {"messages": messages, "tools": [tool]})
    second = calls[1]
    return ok and (
        _has(probe, second, "key:function")
        or _has(probe, second, "used")
        or _has(probe, second["function"], "used")
    )


# ---------------------------------------------------------------------------------------------
# Messages, as llama-server parses and normalises them
# ---------------------------------------------------------------------------------------------


def _dump(value: Any) -> str:
    """JSON as nlohmann's dump() writes it in llama-server's error messages."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _text(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise TemplateError(f"Failed to parse messages: {what} must be a string")
    return value


def _parse_message(message: Any) -> dict[str, Any]:
    """common_chat_msgs_parse_oaicompat + common_chat_msg::to_json_oaicompat for one message."""
    if not isinstance(message, dict):
        raise TemplateError(
            f"Failed to parse messages: Expected 'message' to be an object, got {_dump(message)}"
        )
    if "role" not in message:
        raise TemplateError(
            f"Failed to parse messages: Missing 'role' in message: {_dump(message)}"
        )
    role = _text(message["role"], "'role'")
    if role != "assistant" and "content" not in message:
        raise TemplateError("All non-assistant messages must contain 'content'")
    if role == "assistant" and "content" not in message and "tool_calls" not in message:
        raise TemplateError("Assistant message must contain either 'content' or 'tool_calls'!")
    out: dict[str, Any] = {"role": role}
    content = message.get("content")
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or "type" not in part:
                raise TemplateError(
                    f"Failed to parse messages: Missing content part type: {_dump(part)}"
                )
            if part["type"] not in ("text", "media_marker"):
                raise TemplateError(
                    f"Failed to parse messages: Unsupported content part type: "
                    f"{_dump(part['type'])}"
                )
            parts.append(
                {"type": part["type"], "text": _text(part.get("text"), "a content part's text")}
            )
        out["content"] = parts if parts else ""
    elif content is None or isinstance(content, str):
        out["content"] = content or ""
    else:
        raise TemplateError("Expected 'content' to be a string or an array")
    for key, name in (
        ("reasoning_content", "reasoning_content"),
        ("name", "name"),
        ("tool_call_id", "tool_call_id"),
    ):
        if message.get(key):
            out[name] = _text(message[key], f"'{key}'")
    calls = message.get("tool_calls")
    if calls:
        out["tool_calls"] = [_parse_tool_call(call) for call in calls]
    return out


def _parse_tool_call(call: Any) -> dict[str, Any]:
    if not isinstance(call, dict) or "type" not in call:
        raise TemplateError(f"Failed to parse messages: Missing tool call type: {_dump(call)}")
    if call["type"] != "function":
        raise TemplateError(f"Failed to parse messages: Unsupported tool call type: {_dump(call)}")
    function = call.get("function")
    if not isinstance(function, dict):
        raise TemplateError(f"Failed to parse messages: Missing tool call function: {_dump(call)}")
    if "name" not in function:
        raise TemplateError(f"Failed to parse messages: Missing tool call name: {_dump(call)}")
    arguments = function.get("arguments")
    arguments = (
        arguments
        if isinstance(arguments, str)
        else json.dumps(arguments, ensure_ascii=False, separators=(",", ":"))
    )
    out: dict[str, Any] = {
        "type": "function",
        "function": {"name": function["name"], "arguments": arguments},
    }
    if call.get("id"):
        out["id"] = call["id"]
    return out


def _join_parts(parts: list[dict[str, Any]]) -> str:
    """messages_inp_normalizer::concat_content_parts: newline-joined, none around media markers."""
    text, after_media = "", False
    for part in parts:
        if part["type"] == "text":
            if not after_media and text:
                text += "\n"
            after_media = False
        else:
            after_media = True
        text += part.get("text", "")
    return text


def _render_content(message: dict[str, Any]) -> str:
    content = message.get("content", "")
    if isinstance(content, str):
        return content
    return "".join(p["text"] for p in content if p["type"] == "text")


def render_content(message: Mapping[str, Any]) -> str:
    """common_chat_msg::render_content: a request message's content, its text parts joined by
    blank lines."""
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n\n".join(
            p.get("text", "") for p in content if isinstance(p, Mapping) and p.get("type") == "text"
        )
    return ""


def continue_generation_prompt(
    generation_prompt: str,
    reasoning_start: str,
    reasoning_end: str,
    message: Mapping[str, Any],
    continue_content: bool,
) -> str:
    """The generation prompt that continues ``message`` (peg_generator::generate_parser): cut at
    the reasoning opener, the opener and the message's reasoning so far (closed when the content
    continues), then the content (when it continues)."""
    if reasoning_start:
        cut = generation_prompt.find(reasoning_start)
        generation_prompt = generation_prompt[:cut] if cut >= 0 else generation_prompt
        generation_prompt += reasoning_start + (message.get("reasoning_content") or "")
        if continue_content:
            generation_prompt += reasoning_end
    if continue_content:
        generation_prompt += render_content(message)
    return generation_prompt


def normalize_content(messages: list[dict[str, Any]], caps: Caps) -> list[dict[str, Any]]:
    """messages_inp_normalizer: content parts joined for a string-only template, a string made
    one text part for a typed-only one (in place; the list is returned)."""
    only_string = caps.supports_string_content and not caps.supports_typed_content
    only_typed = caps.supports_typed_content and not caps.supports_string_content
    for message in messages:
        content = message.get("content")
        if only_string and isinstance(content, list):
            message["content"] = _join_parts(
                [p for p in content if p.get("type") in ("text", "media_marker")]
            )
        elif only_typed and isinstance(content, str):
            message["content"] = [{"type": "text", "text": content}]
    return messages


def normalize_messages(
    messages: Any,
    caps: Caps,
    object_arguments: bool | None = None,
    developer_as_system: bool = True,
) -> list[dict[str, Any]]:
    """llama-server's messages as the template sees them (without the trailing-prefill split);
    ``developer_as_system`` False keeps the developer role (GPT-OSS's template reads it)."""
    if not isinstance(messages, list):
        raise TemplateError("Expected 'messages' to be an array")
    parsed = normalize_content([_parse_message(m) for m in messages], caps)
    for message in parsed:
        if message["role"] == "developer" and developer_as_system:
            message["role"] = "system"
    if not caps.supports_system_role and parsed and parsed[0]["role"] == "system":
        first = parsed.pop(0)
        if parsed:
            parsed[0]["content"] = _render_content(first) + "\n" + _render_content(parsed[0])
    if caps.supports_object_arguments if object_arguments is None else object_arguments:
        for message in parsed:
            for call in message.get("tool_calls", []):
                try:
                    call["function"]["arguments"] = json.loads(call["function"]["arguments"])
                except ValueError as err:
                    raise TemplateError(
                        f"Failed to parse tool call arguments as JSON: {err}"
                    ) from err
    return parsed


def extra_context(chat_template_kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """common_chat_extra_context plus the request's chat_template_kwargs: ``datetime``
    (``%b %d %Y``) and ``date_string`` (``%d %b %Y``), then the kwargs over them."""
    return {
        "datetime": time.strftime("%b %d %Y"),
        "date_string": time.strftime("%d %b %Y"),
        **chat_template_kwargs,
    }


def normalize_tools(tools: Any) -> list[dict[str, Any]]:
    """common_chat_tools_parse_oaicompat + common_chat_tools_to_json_oaicompat."""

    def refuse(reason: str) -> TemplateError:
        listed = json.dumps(tools, indent=2, ensure_ascii=False)
        return TemplateError(f"Failed to parse tools: {reason}; tools = {listed}")

    if not isinstance(tools, list):
        raise refuse(f"Expected 'tools' to be an array, got {_dump(tools)}")
    out = []
    for tool in tools:
        if not isinstance(tool, dict) or "type" not in tool:
            raise refuse(f"Missing tool type: {_dump(tool)}")
        if tool["type"] != "function":
            raise refuse(f"Unsupported tool type: {_dump(tool)}")
        if "function" not in tool:
            raise refuse(f"Missing tool function: {_dump(tool)}")
        function = tool["function"]
        if not isinstance(function, dict) or "name" not in function:
            raise refuse("[json.exception.out_of_range.403] key 'name' not found")
        description = function.get("description", "")
        out.append(
            {
                "type": "function",
                "function": {
                    "name": function["name"],
                    "description": description if isinstance(description, str) else "",
                    "parameters": function.get("parameters", {}),
                },
            }
        )
    return out


# ---------------------------------------------------------------------------------------------
# The template
# ---------------------------------------------------------------------------------------------


@dataclass
class ChatTemplate:
    """A chat template with the tokens and flags llama-server renders it with."""

    source: str
    bos_token: str = ""
    eos_token: str = ""
    add_bos: bool = False
    add_eos: bool = False
    caps: Caps = field(default_factory=Caps)

    def __post_init__(self) -> None:
        self._template = compile_template(self.source)
        self.caps = detect_caps(self.source)

    @functools.cached_property
    def analysis(self) -> TemplateAnalysis:
        """The template's differential analysis (bankml.engine_cupy.autoparser), done once.
        AnalysisError where its tool calls cannot be analysed (llama-server refuses it too)."""
        return analyze_template(self)

    @functools.cached_property
    def reasoning(self) -> ReasoningAnalysis:
        """The reasoning block's markers, as the analysis finds them (its workarounds included);
        a template whose tool calls defeat the analysis keeps what the reasoning probes found."""
        try:
            return self.analysis.reasoning
        except AnalysisError:
            return analyze_reasoning(self, self.caps.supports_tool_calls)

    def direct_apply(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = False,
        enable_thinking: bool = True,
        extra_context: Mapping[str, Any] | None = None,
        strip_bos_eos: bool = False,
    ) -> str:
        """The template run on messages as given (common_chat_template_direct_apply): only the
        content is made string or typed as the template needs; no other normalisation, ``tools``
        passed as they are. ``strip_bos_eos`` drops the BOS/EOS texts the tokenizer adds itself."""
        context: dict[str, Any] = {
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "enable_thinking": enable_thinking,
        }
        if tools:
            context["tools"] = tools
        context.update(extra_context or {})
        return self._apply(
            normalize_content(messages, self.caps), context, add_generation_prompt, strip_bos_eos
        )

    @classmethod
    def from_gguf(
        cls, source: str | os.PathLike[str] | object, tokenizer: Any = None
    ) -> ChatTemplate:
        """The GGUF's ``tokenizer.chat_template`` (ChatML when it has none), with its BOS/EOS texts."""
        from bankml.engine_cupy.tokenizer import Tokenizer, _read_fields

        values = _read_fields(
            source, ["tokenizer.chat_template", "tokenizer.chat_template.tool_use"]
        )
        text = values.get("tokenizer.chat_template") or values.get(
            "tokenizer.chat_template.tool_use"
        )
        if not text or text == "chatml":
            text = CHATML_TEMPLATE
        tok = tokenizer if tokenizer is not None else Tokenizer.from_gguf(source)

        def token_text(token_id: int | None) -> str:
            return (
                ""
                if token_id is None
                else tok.token_to_piece(token_id, True).decode("utf-8", "replace")
            )

        return cls(
            source=str(text),
            bos_token=token_text(tok.bos_id),
            eos_token=token_text(tok.eos_id),
            add_bos=tok.add_bos,
            add_eos=tok.add_eos,
        )

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        continue_final_message: str | None = None,
        **chat_template_kwargs: Any,
    ) -> str:
        """The prompt llama-server's /apply-template returns for these messages.
        ``continue_final_message`` ("auto", "content" or "reasoning_content") continues the last
        message whatever its role; without it a trailing assistant message is continued ("auto",
        llama-server's prefill)."""
        parsed = normalize_messages(
            list(messages) if isinstance(messages, tuple) else messages, self.caps
        )
        context = self._context(tools, chat_template_kwargs)
        if continue_final_message is None and parsed and parsed[-1]["role"] == "assistant":
            if len(parsed) >= 2 and parsed[-2]["role"] == "assistant":
                raise TemplateError(
                    "Cannot have 2 or more assistant messages at the end of the list."
                )
            continue_final_message = CONTINUE_AUTO
        if continue_final_message is None:
            return self._apply(parsed, context, add_generation_prompt)
        return self._continue_last(
            parsed, messages[-1] if messages else {}, context, continue_final_message
        )

    def continued_content(
        self, messages: Sequence[Mapping[str, Any]], continue_final_message: str | None = None
    ) -> str:
        """The content a continued last message lends the answer (llama-server's chat parser
        reads the generation from the generation prompt on, so the answer's content starts with
        it); "" where nothing is continued or the reasoning is."""
        parsed = normalize_messages(list(messages), self.caps)
        mode = continue_final_message
        if mode is None and parsed and parsed[-1]["role"] == "assistant":
            mode = CONTINUE_AUTO
        if mode is None or not parsed:
            return ""
        last = messages[-1]
        content = render_content(last)
        reasoning_only = bool(last.get("reasoning_content")) and not content
        if mode == CONTINUE_REASONING or (mode == CONTINUE_AUTO and reasoning_only):
            return ""
        return content

    def generation_prompt(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        **chat_template_kwargs: Any,
    ) -> str:
        """The text the template adds for the assistant's turn (common_chat_template_generation_prompt:
        the prompt with it minus the prompt without it; a trailing assistant message left out)."""
        parsed = normalize_messages(list(messages), self.caps)
        if parsed and parsed[-1]["role"] == "assistant":
            parsed = parsed[:-1]
        context = self._context(tools, chat_template_kwargs)
        without = self._apply(parsed, context, False)
        with_prompt = self._apply(parsed, context, True)
        return with_prompt[len(os.path.commonprefix([without, with_prompt])) :]

    def _context(
        self, tools: Sequence[Mapping[str, Any]] | None, chat_template_kwargs: Mapping[str, Any]
    ) -> dict[str, Any]:
        tool_list = normalize_tools(list(tools)) if tools else None
        # llama-server turns thinking on by default where the template has a reasoning block
        enable_thinking = chat_template_kwargs.get("enable_thinking", self.reasoning.supported)
        if not isinstance(enable_thinking, bool):
            raise TemplateError('invalid type for "enable_thinking" (expected boolean, got string)')
        context: dict[str, Any] = {
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "enable_thinking": enable_thinking,
        }
        if tool_list:
            context["tools"] = tool_list
        context.update(extra_context(chat_template_kwargs))
        return context

    def _continue_last(
        self,
        parsed: list[dict[str, Any]],
        message: Mapping[str, Any],
        context: dict[str, Any],
        mode: str,
    ) -> str:
        """The last message is continued: the conversation before it, the generation prompt,
        then its content (common_chat_templates_apply_jinja with continue_final_message; "auto"
        continues the reasoning where the message has only reasoning, "reasoning_content" always)."""
        if not parsed:
            return self._apply(parsed, context, False)
        last, before = parsed[-1], parsed[:-1]
        if last.get("tool_calls"):
            raise TemplateError("Cannot continue an assistant message that contains tool calls.")
        without = self._apply(before, context, False)
        if not any(
            last.get(key)
            for key in ("content", "reasoning_content", "tool_calls", "name", "tool_call_id")
        ):
            return without  # an empty assistant message continues nothing (common_chat_msg::empty)
        with_prompt = self._apply(before, context, True)
        generation_prompt = with_prompt[len(os.path.commonprefix([without, with_prompt])) :]
        continue_reasoning = mode == CONTINUE_REASONING or (
            mode == CONTINUE_AUTO
            and bool(message.get("reasoning_content"))
            and not render_content(message)
        )
        return without + continue_generation_prompt(
            generation_prompt,
            self.reasoning.start,
            self.reasoning.end,
            message,
            not continue_reasoning,
        )

    def _apply(
        self,
        messages: list[dict[str, Any]],
        context: dict[str, Any],
        add_generation_prompt: bool,
        strip_bos_eos: bool = True,
    ) -> str:
        variables = {**context, "messages": messages}
        if add_generation_prompt:
            variables["add_generation_prompt"] = True
        try:
            text = self._template.render(variables)
        except TemplateError:
            raise
        except SecurityError as err:
            raise TemplateError(f"chat template refused: {err}") from err
        except jinja2.TemplateError as err:
            raise TemplateError(f"chat template error: {err}") from err
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as err:
            raise TemplateError(f"chat template error: {err}") from err
        if not strip_bos_eos:
            return text
        if self.add_bos and self.bos_token and text.startswith(self.bos_token):
            text = text[len(self.bos_token) :]
        if self.add_eos and self.eos_token and text.endswith(self.eos_token):
            text = text[: -len(self.eos_token)]
        return text
