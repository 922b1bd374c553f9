"""The bytes a receipt hashes, and the hash: one definition for the receipts that bankml writes
and for the checker that reads them.

- ``sha256_hex(data)``: the lowercase hex sha256 every ``*_sha256`` field holds;
- ``canonical_logprobs(entries)``: what ``logprobs_sha256`` hashes;
- ``canonical_tool_calls(calls)``: what ``tool_calls_sha256`` hashes.

Pure Python, no Twisted.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from typing import Any


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def text_sha256(text: str) -> str:
    """sha256 of a text's UTF-8 bytes (a lone surrogate as the client's JSON reader kept it)."""
    return sha256_hex(text.encode("utf-8", "surrogatepass"))


def _compact(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode(
        "utf-8", "surrogatepass"
    )


def canonical_logprobs(entries: list[Any]) -> bytes:
    """The bytes `logprobs_sha256` hashes: the logprobs `content` entries (one list, in order, the
    streamed chunks' lists joined), written as compact JSON with non-ASCII kept as UTF-8 and keys
    in the order received. That is ``json.dumps(entries, separators=(",", ":"),
    ensure_ascii=False).encode()`` after ``json.loads`` of the answer, in any language."""
    return _compact(entries)


def canonical_tool_calls(calls: Iterable[Mapping[str, str]]) -> bytes:
    """The bytes ``tool_calls_sha256`` hashes: the calls in order, each ``{"id", "type",
    "name", "arguments"}`` (``arguments`` the string exactly as sent), as compact JSON with
    non-ASCII kept as UTF-8: ``json.dumps(calls, separators=(",", ":"), ensure_ascii=False)``."""
    return _compact([dict(call) for call in calls])
