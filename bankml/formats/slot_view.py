"""What llama-server's slot monitor (``GET /slots``) shows of one of bankml's slots.

``SlotView`` follows the task the slot runs, or last ran: ``RunWriter``
(bankml/resources/runs.py) calls ``begin`` when a prompt's run starts, ``on_chunk`` for each
generated token, ``end`` when it is over. Every call comes on the reactor thread, where
``GET /slots`` reads it, so it needs no lock; ``formats.llama.slot_object`` writes a copy of it.

llama-server's slot forgets its counters when a task ends (``server_slot::reset``): an idle slot
shows the last task's parameters with zero counts, ``has_next_token`` false and ``n_remain`` -1,
which is what ``live`` false gives here. Pure Python: no Twisted.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class SlotView:
    """The slot's current (or last) task, and its counters while it runs."""

    tasks_begun: int = 0
    id_task: int = -1  # -1: no task yet (llama-server then shows only id, n_ctx, ...)
    kind: str = ""
    body: dict[str, Any] = field(default_factory=dict)
    parsed: Any = None
    processing: bool = False
    n_decoded: int = 0
    cache_n: int = 0
    prompt_n: int = 0
    has_new_line: bool = False
    # an embedding or rerank request's tasks (``pooled``): each input a task of its own with
    # the server's default parameters (``parsed``: an object with them), the slot left holding
    # the last input's tokens (``slot_tokens``)
    pooled: bool = False
    slot_tokens: int = 0
    # llama-server's slot.has_next_token: true until a completion ends on the slot; an
    # embedding or rerank task leaves it as it was
    next_token_left: bool = True
    # the last task was refused on the slot before anything was computed (a completion on an
    # encoder): its parameters shown, the slot's tokens and has_next_token left as they were
    refused: bool = False

    def begin(self, kind: str, body: dict[str, Any], parsed: Any) -> None:
        """A prompt's run starts (each prompt of a request is a task of its own, as there)."""
        self.id_task = self.tasks_begun
        self.tasks_begun += 1
        self.kind, self.body, self.parsed = kind, body, parsed
        self.pooled, self.slot_tokens, self.refused = False, 0, False
        self.processing = True
        self.n_decoded = self.cache_n = self.prompt_n = 0
        self.has_new_line = False

    def on_chunk(self, chunk: Any) -> None:
        self.n_decoded += 1
        timings = getattr(chunk, "timings", None) or {}
        self.cache_n = int(timings.get("cache_n", self.cache_n))
        self.prompt_n = int(timings.get("prompt_n", self.prompt_n))
        self.has_new_line = self.has_new_line or "\n" in (chunk.text or "")

    def end(self) -> None:
        """The task is over: llama-server's reset keeps its parameters and zeroes the rest."""
        self.processing = False
        self.next_token_left = False
        self.n_decoded = self.cache_n = self.prompt_n = 0
        self.has_new_line = False

    def pooled_tasks(self, kind: str, defaults: Any, inputs_tokens: list[int]) -> None:
        """An embedding or rerank request ran, one task per input (``inputs_tokens``: each
        one's token count, in order), as llama-server runs them on one slot: the slot shows the
        last task, its default parameters, its tokens, zero counts, and ``has_next_token`` as
        the slot's last completion left it (true before any)."""
        if not inputs_tokens:
            return
        self.tasks_begun += len(inputs_tokens)
        self.id_task = self.tasks_begun - 1
        self.kind, self.body, self.parsed = kind, {}, defaults
        self.pooled, self.slot_tokens, self.refused = True, inputs_tokens[-1], False
        self.processing = False
        self.n_decoded = self.cache_n = self.prompt_n = 0
        self.has_new_line = False

    def refused_tasks(self, kind: str, body: dict[str, Any], parsed: list[Any]) -> None:
        """A request's tasks refused on the slot before a token was computed (llama-server's
        500 for a completion on a context without memory: an encoder's): each a task, the slot
        shows the last one's parameters with zero counts; its tokens (the last embedding's) and
        ``has_next_token`` stay as they were."""
        if not parsed:
            return
        self.tasks_begun += len(parsed)
        self.id_task = self.tasks_begun - 1
        self.kind, self.body, self.parsed = kind, body, parsed[-1]
        self.pooled, self.refused = False, True
        self.processing = False
        self.n_decoded = self.cache_n = self.prompt_n = 0
        self.has_new_line = False

    def n_remain(self) -> int:
        """server_slot::n_remaining: -1 without a limit (and on an idle slot)."""
        n_predict = int(getattr(self.parsed, "n_predict", -1)) if self.processing else -1
        return -1 if n_predict == -1 else n_predict - self.n_decoded
