"""What the kernels' compilation is doing, told to a callback: for a start-up to show and log.

On the first start (and after bankml or Numba changes) Numba compiles the exact kernels the
warm-up reaches, which takes minutes; later starts load them from Numba's on-disk cache in
seconds. ``reporting(report)`` listens to Numba's compile events for the duration of a
``with`` block and calls ``report(line)`` with plain text lines:

- once, at the first kernel actually compiled: that compiling has begun, why, and how long it
  takes about;
- at each kernel compiled at the top level (the kernels it calls compile inside it): its name,
  its seconds, and the time so far;
- at the end: how many kernels were compiled and in how long, or that all came from the cache.

``report`` runs on the compiling thread (the engine's); it must not raise. Nothing here
imports Twisted or writes anywhere by itself.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from numba.core import event

__all__ = ["CompileStats", "reporting", "FIRST_START"]

Report = Callable[[str], None]

FIRST_START = (
    "compiling the exact CPU kernels for {what} (first start, or bankml or Numba changed): "
    "a few minutes, longer on a busy machine; later starts load them from the cache in seconds"
)


@dataclass
class CompileStats:
    """What one ``reporting`` block saw: top-level kernels compiled, and seconds."""

    kernels: list[tuple[str, float]] = field(default_factory=list)  # (name, seconds)
    seconds: float = 0.0

    @property
    def compiled(self) -> int:
        return len(self.kernels)


def kernel_name(dispatcher: object) -> str:
    """``module.function`` of a Numba dispatcher, the module without its package path."""
    function = getattr(dispatcher, "py_func", None)
    module = getattr(function, "__module__", "") or ""
    name = getattr(function, "__qualname__", repr(dispatcher))
    return f"{module.rpartition('.')[2]}.{name}" if module else name


class _Listener(event.Listener):
    """Numba's compile events, nested ones counted inside the top-level kernel that needs them."""

    def __init__(
        self,
        report: Report | None,
        what: str,
        stats: CompileStats,
        on_compile: Callable[[], None] | None = None,
    ) -> None:
        self.report, self.what, self.stats = report, what, stats
        self.on_compile = on_compile
        self.started = time.perf_counter()
        self._depth: dict[int, int] = {}  # per thread: compiles under way
        self._begun: dict[int, float] = {}  # per thread: when its top-level compile began
        self._lock = threading.Lock()

    def _say(self, line: str) -> None:
        if self.report is not None:
            self.report(line)

    def on_start(self, ev: event.Event) -> None:
        thread = threading.get_ident()
        with self._lock:
            depth = self._depth.get(thread, 0)
            self._depth[thread] = depth + 1
            first = not self.stats.kernels and not self._begun
            if depth == 0:
                self._begun[thread] = time.perf_counter()
        if depth == 0 and first:
            self._say(FIRST_START.format(what=self.what))
            if self.on_compile is not None:
                self.on_compile()

    def on_end(self, ev: event.Event) -> None:
        thread = threading.get_ident()
        with self._lock:
            depth = self._depth.get(thread, 1) - 1
            self._depth[thread] = depth
            if depth:
                return
            seconds = time.perf_counter() - self._begun.pop(thread)
            name = kernel_name((ev.data or {}).get("dispatcher"))
            self.stats.kernels.append((name, seconds))
            count = self.stats.compiled
        so_far = time.perf_counter() - self.started
        self._say(f"compiled {name} in {seconds:.0f} s ({count} kernels, {so_far:.0f} s so far)")


@contextmanager
def reporting(
    report: Report | None = None,
    what: str = "this model",
    on_compile: Callable[[], None] | None = None,
) -> Iterator[CompileStats]:
    """Tell ``report`` about every kernel Numba compiles inside the block (any thread), and at
    its end how it went; the CompileStats it yields are filled as it goes. ``on_compile`` is
    called once, as the first kernel begins to compile (a cache miss): compile_jobs starts
    its jobs then."""
    stats = CompileStats()
    listener = _Listener(report, what, stats, on_compile)
    try:
        with event.install_listener("numba:compile", listener):
            yield stats
    finally:
        stats.seconds = time.perf_counter() - listener.started
        if stats.compiled:
            listener._say(
                f"kernels for {what} ready: {stats.compiled} compiled in {stats.seconds:.0f} s; "
                "the next start loads them from the cache"
            )
        else:
            listener._say(f"kernels for {what} loaded from the cache in {stats.seconds:.1f} s")
