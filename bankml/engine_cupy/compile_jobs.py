"""A first start compiles the kernels on every core: compile jobs beside the start-up.

A first start (or one after bankml or Numba changed) compiles some thirty kernels, a minute or
more (kernels.progress). Numba compiles one function at a time in a process, yet the kernels
are independent and share one on-disk cache. So the warm-up is cut into parts
(``WARM_UP_STEPS`` of the exact backend), and as soon as the first kernel misses the cache the
start-up launches compile jobs: other processes (``python -m bankml.engine_cupy.compile_jobs``)
that map the same file and run the other parts, each filling the cache. The start-up runs the
part the first answer needs most (the one-token step, then the sampler), waits for the jobs,
and runs the rest, which then loads what they compiled. A start whose kernels are all cached
launches nothing.

- **How many**: as many processes as cores this process may run on (``os.sched_getaffinity``),
  at most one per part; a caller may ask fewer (``jobs=1``: the start-up compiles alone).
- **Same bits**: a job only fills the cache; what the start-up runs is the same machine code
  whichever process compiled it (Numba keys it on the function, its types and every compiled
  module's source: kernels.jit).
- **Faults**: a job that fails or is killed leaves its part to the start-up, which compiles
  it itself and says so; a job ends itself when the process that launched it is gone, and
  the start-up stops its jobs if the warm-up fails.
- **Memory**: a job maps the model file as the start-up does (the pages are shared) and holds
  what the weights' loading makes of it (kernels.exact_matmul) until it ends.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from typing import IO

__all__ = ["Jobs", "default_jobs", "end_with_parent", "parts_for"]

# The start-up's part first: the one-token step (the fused decode, the largest kernel) that
# every answer runs. Three processes and more split the rest in two; the prompt's and the
# batched step's kernels overlap little (2026-12-05, AMD EPYC, 2 cores, load 0.1: the default
# model's cold warm-up took 79 s in one process, 45 s in two).
_START_UP = ("decode",)
_SPLIT_REST = (("attention", "prompt"), ("batch", "pair"))
_ALL_REST = ("attention", "prompt", "batch", "pair")


def default_jobs() -> int:
    """The processes a cold warm-up uses by default: one per core this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def parts_for(processes: int) -> list[tuple[str, ...]]:
    """The warm-up's steps for ``processes`` processes: the start-up's part first, then one
    part per job; every step in exactly one part. One process: everything in the first."""
    if processes <= 1:
        return [_START_UP + _ALL_REST]
    if processes == 2:
        return [_START_UP, _ALL_REST]
    return [_START_UP, *_SPLIT_REST]


class Jobs:
    """Compile jobs for the model at ``path`` and a cache of ``cache_type``, one per part;
    started by ``start`` (a compile event's callback: any thread, once), waited for by
    ``wait``, stopped by ``stop``."""

    def __init__(
        self,
        path: str,
        cache_type: str | None,
        parts: Sequence[Sequence[str]],
        report: Callable[[str], None] | None = None,
    ):
        self.path, self.cache_type, self.parts = path, cache_type, [tuple(p) for p in parts]
        self.report = report
        self._lock = threading.Lock()
        self._running: list[tuple[tuple[str, ...], subprocess.Popen[bytes], IO[bytes]]] = []
        self.started = False

    def start(self) -> None:
        with self._lock:
            if self.started or not self.parts:
                return
            self.started = True
            for part in self.parts:
                errors = tempfile.TemporaryFile()  # noqa: SIM115 (closed by wait or stop)
                command = [sys.executable, "-m", __name__, self.path, "--steps", ",".join(part)]
                command += ["--parent", str(os.getpid())]
                if self.cache_type:
                    command += ["--cache-type", self.cache_type]
                process = subprocess.Popen(
                    command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=errors
                )
                self._running.append((part, process, errors))
        self._say(
            f"compiling on {len(self.parts) + 1} processes: this one and "
            f"{len(self.parts)} compile job{'s' if len(self.parts) > 1 else ''}"
        )

    def wait(self) -> list[tuple[str, ...]]:
        """Wait for every job; the parts whose job failed (the caller runs them anyway)."""
        with self._lock:
            running, self._running = self._running, []
        failed = []
        for part, process, errors in running:
            code = process.wait()
            if code:
                errors.seek(0)
                last = errors.read().decode(errors="replace").strip().splitlines()[-1:]
                failed.append(part)
                self._say(
                    f"a compile job ({', '.join(part)}) ended with status {code}"
                    + (f": {last[0]}" if last else "")
                    + "; compiling its part here"
                )
            errors.close()
        return failed

    def stop(self) -> None:
        """End the jobs still running (the warm-up failed or was interrupted)."""
        with self._lock:
            running, self._running = self._running, []
        for _, process, errors in running:
            if process.poll() is None:
                process.kill()
            process.wait()
            errors.close()

    def _say(self, line: str) -> None:
        if self.report is not None:
            self.report(line)


def end_with_parent(parent: int, status: int = 3) -> None:
    """End this process with ``status`` once process ``parent`` is gone (run on a daemon
    thread): a compile job is of use only to the start-up that launched it."""
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(status)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bankml.engine_cupy.compile_jobs",
        description="Compile (into Numba's cache) the kernels of some warm-up steps of a model.",
    )
    parser.add_argument("path")
    parser.add_argument("--steps", required=True, help="comma-separated warm-up steps")
    parser.add_argument("--cache-type", default=None)
    parser.add_argument("--parent", type=int, help="end when this process is gone")
    options = parser.parse_args(argv)
    parent = os.getppid() if options.parent is None else options.parent
    threading.Thread(target=end_with_parent, args=(parent,), daemon=True).start()

    from bankml.engine_cupy.model import Model

    model = Model.load(options.path, device="cpu", progress=False)
    model.ops.warm_up(model, options.cache_type, tuple(options.steps.split(",")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
