"""The run convention every native endpoint answers by: ``Step``s.

A request's prompts run in order on the engine thread, each as ``Step``s with its token
``chunk``s (and, asked with ``return_progress`` in a stream, its prompt's ``progress``), then one
``Step`` with its ``summary``. ``prompt_steps`` is the bridge's ``steps`` for such a run;
``relay_forwards`` hands a run's forward passes to the scheduler (several slots) and sends their
logits back into it.

The writers of the answers (bankml/formats/answer.py, bankml/native/ollama.py) read a Step's
``chunk``, ``progress`` and ``summary``. Pure Python: no Twisted, no NumPy (the engine is read
through its methods).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Step:
    """One item of a run: a generated token (``chunk``) of prompt ``index``, its prompt's
    processing so far (``progress``, asked with ``return_progress``), or that prompt's end
    (``summary``: finish reason, counts, text, timings)."""

    index: int
    chunk: Any = None
    summary: Any = None
    progress: Any = None


def wants_progress(request: Any) -> bool:
    """llama-server sends prompt progress only in a stream, and only with ``return_progress``."""
    options = getattr(request, "options", None) or {}
    return bool(options.get("return_progress") and options.get("stream"))


def prompt_steps(
    engine: Any, prompts: list[Any], first_index: int = 0
) -> Callable[..., Generator[Any, Any, None]]:
    """The bridge's ``steps`` for a request's prompts, one after the other on the engine thread
    (a cancelled prompt ends the run); their Steps are numbered from ``first_index`` (a run of
    one answer among several on their own slots has its answer's index). Called with ``forwards=True`` (the bridge's scheduler,
    which ``yields_forwards`` tells), the run's forward passes come out too, as the engine's
    ``Forward``s, and their logits are to be sent back; otherwise they are computed inline."""

    def steps(cancelled: Callable[[], bool], forwards: bool = False) -> Generator[Any, Any, None]:
        for index, request in enumerate(prompts, first_index):
            progress = wants_progress(request)
            run = (
                engine.run_steps(request, cancelled, progress)
                if progress
                else engine.run_steps(request, cancelled)
            )
            coroutine = getattr(run, "coroutine", None) if forwards else None
            if coroutine is None:
                for item in run:
                    yield _step(index, item)
            else:
                yield from relay_forwards(coroutine, functools.partial(_step, index))
            yield Step(index, summary=run.summary)
            if run.summary.cancelled:
                return

    steps.yields_forwards = True  # type: ignore[attr-defined]
    return steps


def relay_forwards(coroutine: Any, wrap: Callable[[Any], Any]) -> Generator[Any, Any, None]:
    """A run's coroutine relayed: its ``Forward``s handed out as they are, what is sent back for
    one going into the run (a plain ``next`` computes it here), its ``Waiting``s (a shared
    prompt's child waiting for its parent) as they are too, every other item as ``wrap``
    makes it."""
    reply = None
    while True:
        try:
            item = coroutine.send(reply)
        except StopIteration:
            return
        reply = None
        if getattr(item, "is_wait", False):
            yield item
        elif getattr(item, "is_forward", False):
            reply = yield item
            if reply is None:
                reply = item.compute()
        else:
            yield wrap(item)


def _step(index: int, item: Any) -> Step:
    if hasattr(item, "processed"):  # the engine's Progress (engine_cupy imports NumPy)
        return Step(index, progress=item)
    return Step(index, chunk=item)
