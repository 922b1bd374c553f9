"""Receipts: what bankml vouches for on every chat answer.

A `Tally` collects one answer as it passes through (the request body, the answer's text pieces in
order, token counts, timings, logprobs) and `receipt()` turns it into the `bankml_receipt`
object, with its fields in this fixed order (clients may rely on it):

``bankml, engine, model_sha256, guard, prompt_tokens, completion_tokens, ttft_ms, wall_ms,
response_sha256, request_sha256[, logprobs_sha256][, reasoning_sha256][, tool_calls_sha256],
signed``

The bracketed fields are there only when the answer carries logprobs, reasoning or tool calls
(bankml.receipts.acts).

How a client checks one by hand is in docs/receipts.md. Pure Python, no Twisted.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from bankml.receipts.acts import Acts
from bankml.receipts.digest import canonical_logprobs, sha256_hex, text_sha256
from bankml.version import __version__


@dataclass
class Tally:
    """One answer, collected as it passes through the gateway."""

    request_body: bytes
    clock: Callable[[], float] = time.monotonic
    started: float = 0.0
    pieces: list[str] = field(default_factory=list)
    logprobs: list[Any] | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    first_piece_at: float | None = None
    finished_at: float | None = None
    # what a forwarded answer says of its end, for the signed receipt (native runs have a Summary)
    finish_reason: str | None = None
    cache_n: int | None = None
    # P0: the request as forwarded (bankml.receipts.sign.ForwardedRequest), None natively
    forwarded: Any = None
    # the reasoning and tool calls of a chat answer, as sent
    acts: Acts = field(default_factory=Acts)

    def __post_init__(self) -> None:
        if not self.started:
            self.started = self.clock()

    def add_text(self, piece: str) -> None:
        """One piece of the answer's content, in the order produced (empty pieces are kept out
        of the TTFT: an empty role delta is not a token)."""
        if piece and self.first_piece_at is None:
            self.first_piece_at = self.clock()
        self.pieces.append(piece)

    def take_chat(self, part: Any) -> None:
        """A chat ``message`` or ``delta``: its content, reasoning and tool calls as sent."""
        content = part.get("content") if isinstance(part, dict) else None
        self.add_text(content if isinstance(content, str) else "")
        if self.acts.take_chat(part):
            self.note_piece()

    def note_piece(self) -> None:
        """A piece of the answer that is not content (reasoning, a tool call) came now."""
        if self.first_piece_at is None:
            self.first_piece_at = self.clock()

    def add_logprobs(self, entries: list[Any]) -> None:
        if self.logprobs is None:
            self.logprobs = []
        self.logprobs.extend(entries)

    def set_counts(self, prompt_tokens: Any, completion_tokens: Any) -> None:
        """Token counts as the engine reported them (an unusable value leaves the count unknown)."""
        if _is_count(prompt_tokens):
            self.prompt_tokens = prompt_tokens
        if _is_count(completion_tokens):
            self.completion_tokens = completion_tokens

    def set_end(self, finish_reason: Any, cache_n: Any) -> None:
        """The finish reason and the prompt tokens reused from the slot, as the engine reported
        them (an unusable value leaves what was known)."""
        if isinstance(finish_reason, str):
            self.finish_reason = finish_reason
        if _is_count(cache_n):
            self.cache_n = cache_n

    def finish(self) -> None:
        if self.finished_at is None:
            self.finished_at = self.clock()

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def ttft_ms(self) -> int | None:
        if self.first_piece_at is None:
            return None
        return round((self.first_piece_at - self.started) * 1000)

    def wall_ms(self) -> int:
        end = self.finished_at if self.finished_at is not None else self.clock()
        return round((end - self.started) * 1000)


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def receipt(
    tally: Tally, *, engine: str, model_sha256: str, guard: str = "play", ttft_measured: bool = True
) -> dict[str, Any]:
    """The receipt for a finished tally. `ttft_measured=False` (a non-streamed P0 answer,
    where the gateway sees the whole text at once) gives ``ttft_ms: null``."""
    tally.finish()
    out: dict[str, Any] = {
        "bankml": __version__,
        "engine": engine,
        "model_sha256": model_sha256,
        "guard": guard,
        "prompt_tokens": tally.prompt_tokens,
        "completion_tokens": tally.completion_tokens,
        "ttft_ms": tally.ttft_ms() if ttft_measured else None,
        "wall_ms": tally.wall_ms(),
        "response_sha256": text_sha256(tally.text),
        "request_sha256": sha256_hex(tally.request_body),
    }
    if tally.logprobs is not None:
        out["logprobs_sha256"] = sha256_hex(canonical_logprobs(tally.logprobs))
    out.update(tally.acts.receipt_fields())
    out["signed"] = False
    return out
