"""The protocol between a run and whatever drives it (the engine's own iteration, or the
native scheduler's several slots).

A run (``Engine.run_steps``) is a coroutine: it yields a ``Forward`` for each forward pass it
needs and is sent the logits back, so the driver decides when, and batched with what, the pass
runs; a child of a ``SharedPrompt`` yields ``Waiting`` while its parent computes the prompt.
What reaches the client is a ``Chunk`` per generated token and, when asked, a ``Progress`` per
prompt batch; ``Steps`` iterates a run computing each pass inline, and holds its ``Summary``.
A run holds one ``Slot`` (KV cache, tokens, checkpoints) from its start to its end; ``Clock``
keeps its times as llama-server's ``server_slot_stats``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field
from typing import Any

from bankml.engine_cupy.checkpoints import Checkpoints
from bankml.engine_cupy.slots import copy_slot


@dataclass
class Chunk:
    """One generated token: the text released with it, its logprob entry, the first-token flag."""

    text: str
    entry: dict | None
    first: bool
    token: int | None
    timings: dict[str, Any] | None = (
        None  # the run's timings so far (llama-server's timings_per_token)
    )
    slot: int = -1  # the slot computing it


@dataclass
class Summary:
    """A run's outcome, filled when its iteration ends (``Steps.summary``)."""

    finish_reason: str = "stop"
    text: str = ""
    tokens: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cancelled: bool = False
    stopping_word: str = ""
    timings: dict[str, Any] = field(default_factory=dict)
    slot: int = -1  # the slot the run ran in
    truncated: bool = False  # the context filled: it stopped there, or shifted (--context-shift)
    n_discarded: int = 0  # tokens the context shifts dropped


@dataclass
class Clock:
    """A run's times (``time.perf_counter``): its start, its first token, its last token."""

    t_start: float = 0.0
    t_prompt: float = 0.0
    t_gen: float = 0.0

    def timings(self, cache_n: int, prompt_n: int, predicted_n: int) -> dict[str, Any]:
        """server_slot_stats' times and rates, by its formulas: a rate is 0.0 until its time is
        known; generation's rate counts decode steps (the first token comes free from the
        prompt's logits), its time at least 1 us once the first token is out."""
        prompt_ms = round((self.t_prompt - self.t_start) * 1e3, 3) if self.t_prompt else 0.0
        predicted_ms = (
            round(max((self.t_gen - self.t_prompt) * 1e3, 0.001), 3) if self.t_gen else 0.0
        )
        return {
            "cache_n": cache_n,
            "prompt_n": prompt_n,
            "prompt_ms": prompt_ms,
            "prompt_per_second": 1e3 / prompt_ms * prompt_n if prompt_ms > 0 else 0.0,
            "predicted_n": predicted_n,
            "predicted_ms": predicted_ms,
            "predicted_per_second": 1e3 / predicted_ms * max(predicted_n - 1, 0)
            if predicted_ms > 0
            else 0.0,
        }


@dataclass(frozen=True)
class Progress:
    """Prompt processing so far (llama-server's ``prompt_progress``, with ``return_progress``):
    once the cached prefix is known, then after each prompt batch."""

    total: int
    cache: int
    processed: int
    time_ms: int
    timings: dict[str, Any]
    slot: int = -1  # the slot computing the prompt

    def as_json(self) -> dict[str, int]:
        return {
            "total": self.total,
            "cache": self.cache,
            "processed": self.processed,
            "time_ms": self.time_ms,
        }


def prompt_progress(
    clock: Clock, total: int, cache: int, processed: int, done: bool, slot: int = -1
) -> Progress:
    """The prompt's progress now: ``done`` after a batch (its time counts as prompt time)."""
    now = time.perf_counter()
    elapsed = Clock(t_start=clock.t_start, t_prompt=now if done else 0.0)
    return Progress(
        total,
        cache,
        processed,
        int((now - clock.t_start) * 1e3),
        elapsed.timings(cache, processed - cache, 0),
        slot,
    )


@dataclass
class Forward:
    """A run's request for one forward pass: ``tokens`` evaluated into ``cache`` by ``model``.
    The run is a coroutine: it yields a Forward and is sent the last row's logits back, so
    whoever drives it decides when (and batched with what) the pass runs."""

    model: Any
    tokens: list[int]
    cache: Any
    prompt: bool = False  # a prompt micro-batch (the scheduler counts their tokens)
    all_logits: bool = False  # every row's logits (a speculative draft's check), not the last's

    is_forward = True  # what the serving layer recognises it by (it imports no NumPy)

    @property
    def decode(self) -> bool:
        """One token after the prompt: a decode step (the ones a batch step can share)."""
        return len(self.tokens) == 1

    def compute(self) -> Any:
        return self.model.forward(self.tokens, self.cache, all_logits=self.all_logits)


class Steps:
    """An iteration over a run's chunks (and progress, when asked); ``summary`` is filled when
    it ends. Iterating computes each forward pass inline; ``coroutine`` is the run itself, for
    a scheduler that yields ``Forward``s and wants the logits sent back."""

    def __init__(self, gen_factory: Callable[[Steps], Generator[Any, Any, None]]):
        self.summary = Summary()
        self.coroutine = gen_factory(self)

    def __iter__(self) -> Iterator[Chunk | Progress]:
        return self

    def __next__(self) -> Chunk | Progress:
        item = next(self.coroutine)
        while isinstance(item, (Forward, Waiting)):
            if isinstance(item, Waiting):  # no parent runs beside it here: it computes its own
                item.shared.abandon()
                item = self.coroutine.send(None)
            else:
                item = self.coroutine.send(item.compute())
        return item


@dataclass(eq=False)
class SharedPrompt:
    """One prompt computed once for its ``n_cmpl`` completions on several slots, as
    llama-server's parent task and its children: each child's run takes a slot and waits
    (``join``, yielding ``Waiting``) while the parent's run computes the prompt; when the
    parent's prefill ends (``publish``), each waiting child's slot becomes a copy of the
    parent's (slots.copy_slot: KV cells, tokens, checkpoints) and the child samples its first
    token from a copy of the parent's last logits, reporting the parent's cache_n and prompt
    start. A parent that ends without its logits (cancelled, refused) ``abandon``s: the
    children still waiting compute the prompt themselves."""

    done: bool = False
    logits: Any = None  # the parent's last prompt logits (None: each child computes its own)
    cache_n: int = 0
    t_start: float = 0.0
    waiting: dict[int, Slot] = field(default_factory=dict)  # by slot id
    copied: set[int] = field(default_factory=set)  # the slots that got the parent's state

    def publish(self, slot: Slot, cache_n: int, logits: Any, t_start: float) -> None:
        """The parent's prefill is over: its state goes to every waiting child's slot."""
        if self.done:
            return
        if logits is not None:
            for child in self.waiting.values():
                copy_slot(slot, child)
                self.copied.add(child.id)
            self.logits, self.cache_n, self.t_start = logits.copy(), cache_n, t_start
        self.done = True
        self.waiting = {}

    def abandon(self) -> None:
        """The parent will not publish (it ended, or no scheduler runs it beside its children)."""
        self.done = True
        self.waiting = {}

    def join(self, slot: Slot, cancelled: Callable[[], bool]) -> Generator[Waiting, Any, bool]:
        """A child waits on its slot until the parent publishes; True when its slot got the
        parent's state, False when it must compute the prompt itself (or was cancelled)."""
        if not self.done:
            self.waiting[slot.id] = slot
        try:
            while not self.done:
                if cancelled():
                    return False
                yield Waiting(self)
        finally:
            self.waiting.pop(slot.id, None)  # a child that left is never copied into
        return slot.id in self.copied


@dataclass(eq=False)
class Waiting:
    """A child run waiting for its parent's prompt (``SharedPrompt.join``): it needs no
    forward pass this iteration; the scheduler resumes it at the next."""

    shared: SharedPrompt

    is_wait = True  # what the serving layer recognises it by


@dataclass
class Slot:
    """One of the server's slots: its KV cache and the tokens it holds, its context
    checkpoints (sliding-window models), the task it runs or last ran, and when it was last
    used (llama-server's least-recently-used choice). ``embedded``: after an embedding whose
    cells the slot does not keep (Engine.keeps_embeddings), the input's tokens, which
    llama-server's slot keeps until its next task (so its choice by prompt similarity sees
    them), where this slot's cache and ``tokens`` are left empty."""

    id: int
    cache: Any
    n_ctx: int
    tokens: list[int] = field(default_factory=list)
    embedded: list[int] = field(default_factory=list)
    # ``tokens`` and the cells are an embedding's: with -kvu the next task's launch clears them
    # (--cache-idle-slots), where a completion's stay for a later prompt to reuse (bankml's
    # stand-in for llama-server's host prompt cache)
    holds_embedding: bool = False
    checkpoints: Checkpoints | None = None
    task_id: int = -1
    processing: bool = False
    t_last_used: int = -1
