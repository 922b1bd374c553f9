"""The message content of a chat answer constrained by a JSON schema, as llama-server's chat
parser takes it from the generated text: the JSON value alone, without the blanks and the
```json fence the chat grammar allows around it. Pure; used for the whole answer and, as the
text grows, for each streamed delta.
"""

from __future__ import annotations

import json

_C_SPACE = " \t\n\v\f\r"  # isspace, the answer parser's blanks
_FENCE = "```json"
_JSON_VALUE = json.JSONDecoder(strict=False)


def chat_schema_content(text: str) -> str:
    """The message content llama-server's chat parser takes from a schema answer: the JSON value
    alone, without the blanks and the ```json fence around it. An unfinished answer (cut by the
    token limit, or streamed so far) gives what the value has so far."""
    i = len(text) - len(text.lstrip(_C_SPACE))
    if text.startswith(_FENCE, i):
        rest = text[i + len(_FENCE) :]
        i = len(text) - len(rest.lstrip(_C_SPACE))
    elif _FENCE.startswith(text[i:]):
        return ""  # blanks, or a fence begun
    try:
        _, end = _JSON_VALUE.raw_decode(text, i)
    except ValueError:
        return text[i:]
    return text[i:end]
