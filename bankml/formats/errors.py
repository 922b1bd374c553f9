"""The error object of llama-server's API family (its own endpoints and the OpenAI ones):
``{"error": {"code", "message", "type"}}``, and ``ApiError``, a refusal that carries one.

``error_object`` is the one builder of that object: every refusal bankml writes on these APIs
(P0 and native, HTTP and ``bankml.chat``) comes from it. The type follows the status as
llama-server's ``format_error_response`` names it, unless the caller names another.
Pure Python: no Twisted.
"""

from __future__ import annotations

from typing import Any

from bankml.formats.nlohmann import dumps

RETRY_AFTER_S = 1  # what a busy server's Retry-After asks (a queue full, a model switched)

ERROR_TYPES = {
    400: "invalid_request_error",
    404: "not_found_error",
    405: "invalid_request_error",
    500: "server_error",
    502: "server_error",
    503: "unavailable_error",
}


def error_object(status: int, message: str, kind: str | None = None) -> dict[str, Any]:
    """llama-server's error shape; ``kind`` overrides the type the status gives."""
    return {
        "error": {
            "code": status,
            "message": message,
            "type": kind or ERROR_TYPES.get(status, "server_error"),
        }
    }


def error_body(status: int, message: str, kind: str | None = None) -> bytes:
    """``error_object`` as the bytes of a JSON answer."""
    return dumps(error_object(status, message, kind))


class ApiError(Exception):
    """A request bankml will not answer: ``status`` and llama-server's error ``body``."""

    def __init__(self, status: int, body: dict[str, Any]) -> None:
        message = (
            body.get("error", {}).get("message", str(body)) if isinstance(body, dict) else str(body)
        )
        super().__init__(f"{status}: {message}")
        self.status = status
        self.body = body
        self.retry_after: int | None = None  # seconds, sent as Retry-After (a busy server)

    @classmethod
    def of(
        cls, status: int, message: str, kind: str | None = None, retry_after: int | None = None
    ) -> ApiError:
        err = cls(status, error_object(status, message, kind))
        err.retry_after = retry_after
        return err

    def as_bytes(self) -> bytes:
        return dumps(self.body)


def refusal_of(err: Exception) -> ApiError:
    """The engine's refusal (its ``status`` and ``body``) as an ApiError: its own body when it
    wrote one (the context limit), else llama-server's error object around its message."""
    status = int(getattr(err, "status", 400))
    body = getattr(err, "body", None)
    if isinstance(body, dict):
        return ApiError(status, body)
    return ApiError.of(status, str(body if isinstance(body, str) else err))
