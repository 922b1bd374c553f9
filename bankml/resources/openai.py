"""Native OpenAI and Anthropic endpoints: ``POST /v1/chat/completions``, ``POST
/v1/completions``, ``POST /v1/responses`` and ``POST /v1/messages`` (run by ``AnswerResource``,
bankml/resources/runs.py), ``GET /v1/models``, and llama-server's token counts
``POST /v1/chat/completions/input_tokens``, ``/v1/responses/input_tokens`` and
``/v1/messages/count_tokens`` (bankml/resources/llama.py's ``ChatInputTokens``).

The objects and events are OpenAI's as llama-server writes them (bankml/formats/openai.py),
built by the same ``Answer`` that ``bankml.chat`` uses, so both give the same answer and receipt.
"""

from __future__ import annotations

from typing import Any

from twisted.web.server import NOT_DONE_YET, Request

from bankml.formats.nlohmann import dumps
from bankml.formats.openai import models_object
from bankml.receipts.kinds import CHAT, MESSAGES, OAI_COMPLETION, RESPONSES
from bankml.resources.interfaces import ResidentEngine
from bankml.resources.llama import ChatInputTokens
from bankml.resources.runs import AnswerResource
from bankml.serving.routes import NotFound
from bankml.serving.writers import JsonResource, write_json


class _CountedAnswers(AnswerResource):
    """An answering endpoint with llama-server's token count child (any other path below it
    is its 404)."""

    isLeaf = False
    count_child = b"input_tokens"

    def __init__(self, native: ResidentEngine, kind: str) -> None:
        super().__init__(native, kind)
        self.putChild(self.count_child, ChatInputTokens(native, kind))

    def getChild(self, path: bytes, request: Request) -> Any:
        return NotFound()


class ChatCompletions(_CountedAnswers):
    """``POST /v1/chat/completions`` (and ``/chat/completions``), and its ``input_tokens``."""

    def __init__(self, native: ResidentEngine) -> None:
        super().__init__(native, CHAT)


class Responses(_CountedAnswers):
    """``POST /v1/responses`` (and ``/responses``): OpenAI's Responses API, run as the chat
    completion llama-server makes of it, and its ``input_tokens``."""

    def __init__(self, native: ResidentEngine) -> None:
        super().__init__(native, RESPONSES)


class Messages(_CountedAnswers):
    """``POST /v1/messages``: Anthropic's Messages API, run as the chat completion llama-server
    makes of it, and its ``count_tokens``."""

    count_child = b"count_tokens"

    def __init__(self, native: ResidentEngine) -> None:
        super().__init__(native, MESSAGES)


class Completions(AnswerResource):
    """``POST /v1/completions``: one prompt or several, each a choice at its index."""

    def __init__(self, native: ResidentEngine) -> None:
        super().__init__(native, OAI_COMPLETION)


class Models(JsonResource):
    """``GET /v1/models``: the resident model, as llama-server lists it."""

    isLeaf = True

    def __init__(self, native: ResidentEngine) -> None:
        super().__init__()
        self.native = native

    def render_GET(self, request: Request) -> Any:
        write_json(request, 200, dumps(models_object(self.native.model_facts())))
        return NOT_DONE_YET
