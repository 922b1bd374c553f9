"""The one error ``bankml convert`` raises: a refusal with its reason (exit status 2)."""

from __future__ import annotations


class ConvertError(Exception):
    """The directory is not converted; the message says why. No output file is left."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason

    def __str__(self) -> str:
        return self.reason
