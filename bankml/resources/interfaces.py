"""What the Resources ask of the objects they serve: ``typing.Protocol``s.

The Resources (bankml/resources/) read a request, hand work to the engine's threads and write
the answer; they never compute, and they never import what computes. What they call is declared
here, and the native layer's objects satisfy it:

- ``Bridge``: the engine thread and the prepare thread (bankml/native/bridge.py's
  ``EngineBridge``);
- ``ResidentEngine``: the resident engine as the native endpoints see it (bankml/native/
  resident.py's ``NativeEngine``): its jobs, its records, the plain data /props, /slots,
  /metrics and /v1/models are written from, and what an ``Answer`` asks (``AnswerSource``);
- ``OllamaRoutes`` and ``OllamaLines``: Ollama's API over the engine (bankml/native/ollama.py's
  ``OllamaHost`` and one answer's ``OllamaRun``).

A unit test serves a Resource from any object with these methods (a fake engine).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol, TypeVar

from twisted.internet.defer import Deferred

from bankml.formats.answer import AnswerSource
from bankml.formats.llama import MetricsScrape, Props
from bankml.formats.ollama_wire import OllamaError
from bankml.formats.openai import ModelFacts
from bankml.formats.slot_view import SlotView
from bankml.serving.run_control import RunControl

T = TypeVar("T")


class Bridge(Protocol):
    """The engine's two threads: ``call`` (the engine thread, in turn with the runs),
    ``prepare`` (request parsing), ``stream`` and ``stream_each`` (runs whose items reach
    ``deliver`` on the reactor thread)."""

    @property
    def scheduler(self) -> Any:
        """The several-slot engine thread (None with one slot)."""
        ...

    def new_control(self) -> RunControl: ...

    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> Deferred[T]: ...

    def prepare(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> Deferred[T]: ...

    def stream(
        self,
        steps: Callable[[Callable[[], bool]], Iterator[T]],
        deliver: Callable[[T], None],
        control: RunControl | None = None,
    ) -> Deferred[Any]: ...

    def stream_each(
        self,
        runs: Sequence[tuple[Callable[..., Iterator[T]], RunControl]],
        deliver: Callable[[T], None],
        group: int = 1,
    ) -> list[Deferred[Any]]: ...


class ResidentEngine(AnswerSource, Protocol):
    """The resident engine as the native endpoints see it. The jobs (``parse``, ``steps``,
    the text and slot jobs) raise ``ApiError`` on a refusal."""

    @property
    def bridge(self) -> Bridge | None: ...

    @property
    def slot_dir(self) -> str | None:
        """Where slot files are saved (None: slot actions are refused)."""
        ...

    @property
    def started(self) -> float:
        """When the engine started (Unix time)."""
        ...

    @property
    def slot_views(self) -> Sequence[SlotView]:
        """What GET /slots shows of each slot (updated on the reactor thread)."""
        ...

    def identity_problem(self) -> str | None: ...

    def parse(
        self,
        body: dict[str, Any],
        kind: str,
        choice: tuple[Any, Any] | None = None,
        autoload: bool | None = None,
    ) -> list[Any]: ...

    def steps(
        self, prompts: list[Any], keep_alive: bool = True, first_index: int = 0
    ) -> Callable[..., Iterator[Any]]: ...

    def shared(self, prompts: list[Any], n_cmpl: int) -> list[Any]: ...

    def view_for(self, item: Any) -> SlotView | None: ...

    def record(
        self, summary: Any, ttft_ms: int | None, wall_ms: int, kind: str, model: str = ""
    ) -> None: ...

    def tokenize(self, body: dict[str, Any]) -> dict[str, Any]: ...

    def detokenize(self, body: dict[str, Any]) -> dict[str, Any]: ...

    def apply_template(self, body: dict[str, Any]) -> dict[str, Any]: ...

    def input_tokens(self, body: dict[str, Any], kind: str = ...) -> dict[str, Any]: ...

    def slots(self, views: Sequence[SlotView]) -> list[dict[str, Any]]: ...

    def slot_action(
        self, action: str, filename: str, id_slot: int
    ) -> tuple[int, dict[str, Any]]: ...

    def props(self) -> Props: ...

    def scrape(self) -> MetricsScrape: ...

    def model_facts(self) -> ModelFacts: ...


class OllamaLines(Protocol):
    """One /api/chat or /api/generate answer: the lines its run's items make, its final
    object."""

    @property
    def stream(self) -> bool: ...

    def ready(self, item: Any) -> None: ...

    def on_chunk(self, chunk: Any) -> list[dict[str, Any]]: ...

    def last_lines(self) -> list[dict[str, Any]]: ...

    def final(self, item: Any) -> dict[str, Any]: ...


class OllamaRoutes(Protocol):
    """What Ollama's routes ask: listings, the registry's changes, and the answers' jobs
    (``prepare`` on the prepare thread, ``run`` and ``load_or_unload`` on the engine thread);
    a refusal is ``OllamaError``."""

    @property
    def bridge(self) -> Bridge: ...

    def root_text(self) -> str: ...

    def version(self) -> dict[str, Any]: ...

    def tags(self) -> dict[str, Any]: ...

    def ps(self) -> dict[str, Any]: ...

    def show(self, raw: bytes) -> dict[str, Any]: ...

    def unknown(self, method: str, path: str) -> OllamaError: ...

    def create(self, raw: bytes) -> tuple[bool, list[str]]: ...

    def copy(self, raw: bytes) -> None: ...

    def delete(self, raw: bytes) -> None: ...

    def prepare(self, kind: str, raw: bytes, started_ns: int) -> Any: ...

    def load_or_unload(self, job: Any) -> dict[str, Any]: ...

    def new_run(self, job: Any) -> OllamaLines: ...

    def run(self, job: Any) -> Callable[..., Iterator[Any]]: ...

    def record(self, run: Any, summary: Any) -> None:
        """One finished answer into the engine's records (/bankml/metrics, /metrics)."""
        ...
