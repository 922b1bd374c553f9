"""The answer class of each API kind the native engine answers, and the answers of a request.

- ``ANSWERS``: the ``Answer`` subclass (bankml/formats/answer.py, formats/converted.py) that
  writes each kind;
- ``answers_for``: one Answer per parsed answer of a request, sharing the first one's id and
  creation time, as llama-server's answers to one request share them;
- ``merged``: the non-streamed answer to a request with several prompts or completions.

Pure Python, no Twisted.
"""

from __future__ import annotations

from typing import Any

from bankml.formats import openai as openai_format
from bankml.formats.answer import (
    Answer,
    AnswerSource,
    ChatAnswer,
    CompletionAnswer,
    LlamaCompletionAnswer,
)
from bankml.formats.converted import MessagesAnswer, ResponsesAnswer
from bankml.receipts.kinds import CHAT, LLAMA_COMPLETION, MESSAGES, OAI_COMPLETION, RESPONSES

ANSWERS: dict[str, type[Answer]] = {
    CHAT: ChatAnswer,
    OAI_COMPLETION: CompletionAnswer,
    LLAMA_COMPLETION: LlamaCompletionAnswer,
    RESPONSES: ResponsesAnswer,
    MESSAGES: MessagesAnswer,
}


def answers_for(
    source: AnswerSource,
    kind: str,
    body: bytes,
    request: dict[str, Any],
    parsed: list[Any],
    stream: bool | None = None,
) -> list[Answer]:
    """The Answer of each of a request's parsed answers (its prompts and ``n`` completions, in
    index order), all with the first one's id and creation time."""
    answers = [
        ANSWERS[kind](source, kind, body, request, one, index=index, stream=stream)
        for index, one in enumerate(parsed)
    ]
    for answer in answers[1:]:
        answer.id, answer.created = answers[0].id, answers[0].created
    return answers


def merged(kind: str, results: list[dict[str, Any]]) -> Any:
    """The non-streamed answer to a request's prompts and completions (``results`` in index
    order): one object for one; for several, llama-server's array on /completion, one object
    with every choice on the OpenAI endpoints."""
    if len(results) == 1:
        return results[0]
    if kind == LLAMA_COMPLETION:
        return results
    return openai_format.merged_completions(results)
