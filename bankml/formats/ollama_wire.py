"""The bytes of Ollama's answers and its error: ``OllamaError``, ``dumps``, ``ndjson_line``.

Kept apart from ``formats.ollama`` (which reads the registry) so that the HTTP resources can
frame and refuse without importing the registry or the engine. JSON with ``", "`` and ``": "``
separators and non-ASCII written raw; a non-finite float is written as null.
"""

from __future__ import annotations

import json
from typing import Any

from bankml.formats.nlohmann import finite_or_null


class OllamaError(Exception):
    """A request refused with Ollama's error shape: HTTP ``status`` and ``{"error": message}``."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.retry_after: int | None = None  # seconds, sent as Retry-After (a busy server)

    def body(self) -> dict[str, str]:
        return error_body(self.message)


def dumps(obj: Any) -> bytes:
    """One JSON object as bankml's Ollama answers write it (no trailing newline)."""
    try:
        text = json.dumps(obj, ensure_ascii=False, allow_nan=False)
    except ValueError:
        text = json.dumps(finite_or_null(obj), ensure_ascii=False, allow_nan=False)
    return text.encode("utf-8", "surrogatepass")


def ndjson_line(obj: Any) -> bytes:
    return dumps(obj) + b"\n"


def error_body(message: str) -> dict[str, str]:
    return {"error": message}
