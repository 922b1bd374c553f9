"""Native OpenAI endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions`` (run by
``AnswerResource``, bankml/resources/runs.py), ``GET /v1/models``, and llama-server's token count
``POST /v1/chat/completions/input_tokens`` (bankml/resources/llama.py's ``ChatInputTokens``).

The objects and events are OpenAI's as llama-server writes them (bankml/formats/openai.py),
built by the same ``Answer`` that ``bankml.chat`` uses, so both give the same answer and receipt.
"""

from __future__ import annotations

from typing import Any

from twisted.web.server import NOT_DONE_YET, Request

from bankml.formats.nlohmann import dumps
from bankml.formats.openai import models_object
from bankml.receipts.kinds import CHAT, OAI_COMPLETION
from bankml.resources.interfaces import ResidentEngine
from bankml.resources.llama import ChatInputTokens
from bankml.resources.runs import AnswerResource
from bankml.serving.routes import NotFound
from bankml.serving.writers import JsonResource, write_json


class ChatCompletions(AnswerResource):
    """``POST /v1/chat/completions`` (and ``/chat/completions``), with llama-server's child
    ``input_tokens`` (any other path below it is its 404)."""

    isLeaf = False

    def __init__(self, native: ResidentEngine) -> None:
        super().__init__(native, CHAT)
        self.putChild(b"input_tokens", ChatInputTokens(native))

    def getChild(self, path: bytes, request: Request) -> Any:
        return NotFound()


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
