"""A chat request made into what the engine runs and how its answer is read, as llama-server
prepares a chat task (tools/server/server-common.cpp ``oaicompat_chat_params_parse`` then
common/chat.cpp ``common_chat_templates_apply``).

``chat_task(template, body, defaults, json_schema)`` reads the body's tool and reasoning fields
(``chat_request.chat_fields``), applies the template through the autoparser
(``autoparser.apply.chat_params``: the prompt, the generation prompt, the PEG parser of the
answer, the tool-call grammar with its triggers and preserved tokens, extra stop words, the
thinking tags) and returns a ``ChatTask``:

- ``prompt``: the text the model reads;
- ``sampling_fields()``: the grammar and budget fields the template sets for the sampler
  (``grammar_lazy``, ``grammar_triggers``, ``preserved_tokens``, ``generation_prompt``, and where
  the template has thinking tags the reasoning budget's), in the form a /completion body gives
  them;
- ``tool_grammar``: the GBNF that constrains tool calls (lazy with ``tool_choice`` auto, from the
  first token with required), "" without tools;
- ``parse(text, partial)``: the answer so far as llama-server's chat parser reads the generation
  prompt plus the generated text (content, reasoning, tool calls); a final parse that does not
  match the format reads the whole text as content (llama-server answers that case with an
  error).

Templates llama-server reads with a dedicated parser of its own go through that handler's port
(``autoparser.dedicated``); those ``autoparser.apply.SPECIALIZED`` names without one are not
followed yet: such a template renders as before and its answer is its text; a request with tools
on one is refused (``RequestError``) rather than answered without its calls.

``builtin_chat_task`` is the same without Jinja (llama-server's ``--no-jinja``): tools and a
``tool_choice`` other than auto refused with llama-server's messages
(``refuse_tools_without_jinja``), the prompt written by llama.cpp's built-in template the
template's text is recognised as (builtin_templates.py), the answer read as content only.
Pure Python, no Twisted.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from bankml.engine_cupy.autoparser.apply import (
    ChatRequest,
    SpecializedTemplateError,
    chat_params,
    supports_thinking,
)
from bankml.engine_cupy.autoparser.generator import (
    ChatParams,
    Continuation,
    ReasoningFormat,
    ToolChoice,
)
from bankml.engine_cupy.builtin_templates import BuiltinTemplateError, render_legacy
from bankml.engine_cupy.chat_request import ChatDefaults, ChatFields, chat_fields
from bankml.engine_cupy.chat_template import ChatTemplate, normalize_messages
from bankml.engine_cupy.grammar import GRAMMAR_TOOL_CALLS
from bankml.engine_cupy.grammar_triggers import (
    TRIGGER_PATTERN,
    TRIGGER_PATTERN_FULL,
    TRIGGER_TOKEN,
    TRIGGER_WORD,
)
from bankml.engine_cupy.json_schema_grammar import CHAT_PARSER_FAILED, SchemaConversionError
from bankml.engine_cupy.peg.chat import ChatFormat, ChatMsg, ChatParseError, chat_peg_parse
from bankml.engine_cupy.request import RequestError

_TRIGGER_TYPES = {
    "token": TRIGGER_TOKEN,
    "word": TRIGGER_WORD,
    "pattern": TRIGGER_PATTERN,
    "pattern_full": TRIGGER_PATTERN_FULL,
}

Parse = Callable[[str, bool], ChatMsg]


@dataclass(frozen=True)
class ChatTask:
    prompt: str
    fields: ChatFields
    params: ChatParams | None  # None: a template with a dedicated parser, not followed

    @property
    def generation_prompt(self) -> str:
        return "" if self.params is None else self.params.generation_prompt

    @property
    def tool_grammar(self) -> str:
        """The grammar the template's tool calls get ("" without tools to call)."""
        if self.params is None or not self.fields.calls_tools:
            return ""
        return self.params.grammar

    @property
    def additional_stops(self) -> tuple[str, ...]:
        return () if self.params is None else self.params.additional_stops

    def sampling_fields(self) -> dict[str, Any]:
        """What oaicompat_chat_params_parse sets for the sampler, as a /completion body gives
        it: the template's lazy-grammar fields, and the reasoning budget's where the template
        has thinking tags (budget -1: the sampler is made only where it may act)."""
        params = self.params
        if params is None:
            return {"grammar_lazy": False, "grammar_triggers": [], "preserved_tokens": []}
        out: dict[str, Any] = {
            "grammar_lazy": params.grammar_lazy,
            "grammar_triggers": [
                {"type": _TRIGGER_TYPES[t.type.value], "value": t.value}
                for t in params.grammar_triggers
            ],
            "preserved_tokens": list(params.preserved_tokens),
            "generation_prompt": params.generation_prompt,
        }
        if self.tool_grammar:  # llama-server's grammar_type: its sampler takes the prompt first
            out["grammar_type"] = GRAMMAR_TOOL_CALLS
        if params.thinking_end_tags:
            out.update(
                reasoning_budget_tokens=self.fields.reasoning_budget,
                reasoning_budget_start_tag=params.thinking_start_tag,
                reasoning_budget_end_tags=list(params.thinking_end_tags),
                reasoning_budget_message=self.fields.reasoning_budget_message,
            )
        return out

    def parser(self) -> Parse | None:
        params = self.params
        if params is None or params.parser is None:
            return None
        arena, prompt, form = params.parser, params.generation_prompt, ChatFormat(params.format)

        def parse(text: str, partial: bool) -> ChatMsg:
            """The message in ``text``. A final output the format does not match is
            llama-server's 500 (the engine checks it before the answer ends); a partial one
            that fails from its first byte is read as content as it grows."""
            try:
                return chat_peg_parse(arena, text, partial, prompt, form)
            except ChatParseError as err:
                if partial:
                    return ChatMsg(role="assistant", content=text)
                raise RequestError(str(err), status=500) from None

        return parse


def _continuation(
    body: Mapping[str, Any], messages: list[Any], explicit: str | None
) -> Continuation:
    """The body's ``continue_final_message``, else AUTO for a trailing assistant message (llama-
    server's prefill of the assistant turn), with its refusal of two at the end."""
    if explicit is not None:
        return Continuation(explicit)
    if messages and isinstance(messages[-1], dict) and messages[-1].get("role") == "assistant":
        if len(messages) >= 2 and messages[-2].get("role") == "assistant":
            raise RequestError("Cannot have 2 or more assistant messages at the end of the list.")
        return Continuation.AUTO
    return Continuation.NONE


def chat_task(
    template: ChatTemplate,
    body: Mapping[str, Any],
    defaults: ChatDefaults,
    *,
    add_generation_prompt: bool,
    continue_final_message: str | None,
    json_schema: Mapping[str, Any] | None,
    render: Callable[[], str],
) -> ChatTask:
    """The task of a checked chat body (its messages checked, its render options read):
    ``render`` renders it the way a template with a dedicated parser is rendered."""
    thinks = supports_thinking(template)
    fields = chat_fields(body, defaults, thinks, template.caps.supports_parallel_tool_calls)
    messages = list(body["messages"])
    request = ChatRequest(
        messages=messages,
        tools=fields.tools or None,
        tool_choice=ToolChoice(fields.tool_choice),
        parallel_tool_calls=fields.parallel_tool_calls,
        reasoning_format=ReasoningFormat(fields.reasoning_format),
        enable_thinking=fields.enable_thinking,
        chat_template_kwargs=fields.chat_template_kwargs,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=_continuation(body, messages, continue_final_message),
        json_schema=json_schema,
        grammar=body["grammar"] if isinstance(body.get("grammar"), str) else "",
    )
    try:
        params = chat_params(template, request)
    except SchemaConversionError as err:  # the response format's schema, in the parser
        raise RequestError(f"{CHAT_PARSER_FAILED}{err}") from None
    except SpecializedTemplateError as err:
        if fields.calls_tools:
            raise RequestError(
                f"tool calls on this chat template are not read yet ({err.name}: llama-server "
                "reads them with a parser of its own)"
            ) from None
        return ChatTask(render(), fields, None)
    return ChatTask(params.prompt, fields, params)


# oaicompat_chat_params_parse's refusals without Jinja
NO_JINJA_TOOLS = "tools param requires --jinja flag"
NO_JINJA_TOOL_CHOICE = "tool_choice param requires --jinja flag"


def refuse_tools_without_jinja(body: Mapping[str, Any]) -> None:
    """Without Jinja, a non-empty ``tools`` array or a ``tool_choice`` string other than auto is
    refused (anything else in ``tool_choice`` reads as auto, as json_value reads it)."""
    tools = body.get("tools")
    if isinstance(tools, list) and tools:
        raise RequestError(NO_JINJA_TOOLS)
    choice = body.get("tool_choice")
    if isinstance(choice, str) and choice != "auto":
        raise RequestError(NO_JINJA_TOOL_CHOICE)


def builtin_chat_task(
    template: ChatTemplate,
    body: Mapping[str, Any],
    defaults: ChatDefaults,
    *,
    add_generation_prompt: bool,
    continue_final_message: str | None,
) -> ChatTask:
    """The task of a checked chat body without Jinja (common_chat_templates_apply_legacy): the
    messages parsed as llama-server parses them, then written by the built-in template the
    template's text is recognised as; a continued last message is written closed, without the
    assistant's turn. No parser: the answer is its text."""
    fields = chat_fields(body, defaults, False, template.caps.supports_parallel_tool_calls)
    messages = list(body["messages"])
    normalize_messages(messages, template.caps, object_arguments=False)  # its refusals
    continuation = _continuation(body, messages, continue_final_message)
    try:
        prompt = render_legacy(
            template.source, messages, add_generation_prompt and continuation == Continuation.NONE
        )
    except BuiltinTemplateError as err:
        raise RequestError(str(err)) from None
    return ChatTask(prompt, fields, None)
