"""The one place where the reactor meets the engine.

The engine (``bankml.engine_cupy``) is plain blocking Python: ``run_steps(request, cancelled)``
yields Chunks as tokens are computed. Twisted must never run it on the reactor thread, and the
engine must never touch Twisted. ``EngineBridge`` joins the two:

- **One engine thread.** Every engine job (a run, a tokenize, a slot save) goes into one FIFO
  queue served by a single dedicated thread, so requests that arrive while the engine is busy
  wait in arrival order and each runs alone, as llama-server's single slot does. With several
  slots (``n_slots`` > 1, ``--parallel``) the thread is ``scheduler.Scheduler`` instead: up to
  ``n_slots`` runs advance a step at a time side by side, the others wait in arrival order, at
  most ``max_queue`` of them (``stream`` refuses the next with ``Overloaded``: a 503).
- **Chunks come back with ``reactor.callFromThread``**, in order, followed by the run's result
  (the generator's return value) on the run's Deferred.
- **Back-pressure.** A ``RunControl`` (bankml/serving/run_control.py) is an ``IPushProducer``
  registered on the HTTP request: when the client's transport is full, Twisted pauses it and
  the engine thread blocks before producing its next chunk (with several slots the scheduler
  skips that run instead, and the others go on). At most ``window`` chunks are ever in flight between the engine
  thread and the reactor, so a slow client costs a bounded amount of memory, not a growing queue.
- **Cancellation.** A client that goes away (``notifyFinish`` errback, or ``stopProducing``)
  sets the run's cancel flag. The engine reads it through the ``cancelled`` callable before each
  token and each prefill micro-batch; the bridge stops delivering at once and never blocks a
  cancelled run. A job still waiting in the queue when its client leaves is skipped.

Parsing a request (tokenizing a long prompt, compiling a grammar) is CPU work too, but it must
not wait behind a long generation: llama-server refuses a bad request at once even while busy.
So ``EngineBridge`` has a second single-thread FIFO, ``prepare``, for that work; being one
thread, it keeps arrival order, and its results reach the engine queue in the same order.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar, cast

from twisted.internet.defer import Deferred, fail
from twisted.internet.threads import blockingCallFromThread
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.python.threadable import isInIOThread

from bankml.native.scheduler import CallJob, RunGroup, RunJob, Scheduler
from bankml.serving.run_control import DEFAULT_WINDOW, ClientGone, Overloaded, RunControl

__all__ = ["EngineBridge", "Cancelled"]

_log = Logger(namespace="bankml.bridge")

T = TypeVar("T")
Cancelled = Callable[[], bool]

DEFAULT_MAX_QUEUE = 512  # runs waiting for a slot before a 503 (Ollama's OLLAMA_MAX_QUEUE)


@dataclass
class _Job(Generic[T]):
    work: Callable[[], Any]
    deferred: Deferred
    control: RunControl | None = None
    label: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


class _Worker:
    """One daemon thread serving a FIFO of jobs; results go back with callFromThread."""

    _STOP = object()

    def __init__(self, reactor: Any, name: str) -> None:
        self.reactor = reactor
        self.name = name
        self.jobs: queue.Queue[Any] = queue.Queue()
        self.thread: threading.Thread | None = None
        self.current: _Job | None = None
        self.done = 0

    def start(self) -> None:
        if self.thread is None:
            self.thread = threading.Thread(target=self._serve, name=self.name, daemon=True)
            self.thread.start()

    def submit(self, job: _Job) -> None:
        self.start()
        self.jobs.put(job)

    def stop(self, timeout: float | None = None) -> None:
        if self.thread is not None:
            self.jobs.put(self._STOP)
            self.thread.join(timeout)
            self.thread = None

    @property
    def pending(self) -> int:
        return self.jobs.qsize()

    @property
    def waiting_runs(self) -> int:
        """Runs waiting for the thread (a call job, a model's load or its mark of use, is no
        request waiting)."""
        with self.jobs.mutex:
            return sum(
                isinstance(job, _Job) and job.control is not None and not job.control.cancelled()
                for job in self.jobs.queue
            )

    def _serve(self) -> None:
        while True:
            job = self.jobs.get()
            if job is self._STOP:
                return
            self.current = job
            try:
                if job.control is not None and job.control.cancelled():
                    outcome: Any = Failure(ClientGone("the client left before its turn"))
                else:
                    outcome = job.work()
            except (
                BaseException
            ):  # the job's own error goes to its Deferred, never kills the thread
                outcome = Failure()
            finally:
                self.current = None
                self.done += 1
            self._resolve(job.deferred, outcome)

    def _resolve(self, d: Deferred, outcome: Any) -> None:
        if isinstance(outcome, Failure):
            self.reactor.callFromThread(d.errback, outcome)
        else:
            self.reactor.callFromThread(d.callback, outcome)


class EngineBridge:
    """The engine thread and the prepare thread, with one FIFO each.

    ``call(fn, ...)``: any engine operation, in turn with the runs (a slot save never sees a
    half-written KV cache). ``prepare(fn, ...)``: request parsing, kept off the engine's queue.
    ``stream(steps, deliver, control)``: one run; ``steps(cancelled)`` returns an iterator whose
    items are passed to ``deliver`` on the reactor thread; the Deferred fires with the
    iterator's return value (``StopIteration.value``) after the last item was delivered.
    """

    def __init__(
        self,
        reactor: Any,
        window: int = DEFAULT_WINDOW,
        n_slots: int = 1,
        max_queue: int = DEFAULT_MAX_QUEUE,
    ) -> None:
        self.reactor = reactor
        self.window = window
        self.n_slots = n_slots
        self.max_queue = max_queue
        self.engine: Any = (
            _Worker(reactor, "bankml-engine")
            if n_slots == 1
            else Scheduler(reactor, "bankml-engine", n_slots, self._resolve, self._admitted)
        )
        self.preparer = _Worker(reactor, "bankml-prepare")
        self._shutdown_trigger: Any = reactor.addSystemEventTrigger(
            "before", "shutdown", self._on_shutdown
        )
        self.runs_started = 0
        self.last_run: RunControl | None = None  # the latest run's control (tests, /bankml)

    # --- jobs -------------------------------------------------------------------------------

    @property
    def scheduler(self) -> Any:
        """The several-slot engine thread (None with one slot)."""
        return None if isinstance(self.engine, _Worker) else self.engine

    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> Deferred[T]:
        d: Deferred = Deferred()
        scheduler = self.scheduler
        if scheduler is not None:
            scheduler.submit_call(CallJob(lambda: fn(*args, **kwargs), d))
        else:
            self.engine.submit(_Job(lambda: fn(*args, **kwargs), d))
        return d

    def call_beside_runs(
        self, ready: Callable[[], bool], fn: Callable[..., T], *args: Any
    ) -> Deferred[T]:
        """``call``, for a job that touches no running answer's slot: with several slots it
        runs between two of the scheduler's iterations once it is at the head of the queue and
        ``ready()`` (asked on the engine thread) says so, without waiting for the active runs
        to end (native/scheduler.py). With one slot, as ``call``."""
        scheduler = self.scheduler
        if scheduler is None:
            return self.call(fn, *args)
        d: Deferred = Deferred()
        scheduler.submit_call(CallJob(lambda: fn(*args), d, beside_runs=ready))
        return d

    def prepare(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> Deferred[T]:
        d: Deferred = Deferred()
        self.preparer.submit(_Job(lambda: fn(*args, **kwargs), d))
        return d

    def can_wait_on(self) -> bool:
        """Whether a caller may block on ``call_and_wait``: the reactor runs, and the caller is
        not on its thread (which would wait on itself)."""
        return bool(self.reactor.running) and not isInIOThread()

    def call_and_wait(
        self, fn: Callable[[], T], beside_runs: Callable[[], bool] | None = None
    ) -> T:
        """From a thread other than the reactor's: ``fn`` as an engine job (``beside_runs``: as
        ``call_beside_runs``), its result waited for (``bankml.chat`` on a served engine queues
        with the HTTP requests this way)."""

        def start() -> Deferred[Any]:
            if beside_runs is not None:
                return self.call_beside_runs(beside_runs, fn)
            return self.call(fn)

        return cast(T, blockingCallFromThread(self.reactor, start))

    def new_control(self) -> RunControl:
        return RunControl(self.window)

    def stream(
        self,
        steps: Callable[[Cancelled], Iterator[T]],
        deliver: Callable[[T], None],
        control: RunControl | None = None,
    ) -> Deferred[Any]:
        control = control or self.new_control()
        d: Deferred = Deferred()
        scheduler = self.scheduler
        if scheduler is None:
            self.engine.submit(_Job(lambda: self._run(steps, deliver, control), d, control))
            return d
        if self.overloaded():
            d.errback(Failure(Overloaded(self.max_queue)))
            return d

        scheduler.submit_run(RunJob(_coroutine(steps), self._sender(deliver), control, d))
        return d

    def stream_each(
        self,
        runs: Sequence[tuple[Callable[..., Iterator[T]], RunControl]],
        deliver: Callable[[T], None],
        group: int = 1,
    ) -> list[Deferred[Any]]:
        """Several runs of one request, each its own job (its own slot), queued together in
        order: a request's choices and prompts computed at once on several slots. Each
        ``group`` consecutive runs (a prompt's ``n_cmpl`` completions) are admitted together,
        when that many slots are free at once (``RunGroup``). Refused as a whole (each Deferred
        fails with ``Overloaded``) when the queue is full, so none of them is computed for an
        answer that cannot be given."""
        if self.overloaded():
            return [fail(Overloaded(self.max_queue)) for _ in runs]
        scheduler = self.scheduler
        if scheduler is None:  # one slot: each in turn, in order
            return [self.stream(steps, deliver, control) for steps, control in runs]
        if not 1 <= group <= self.n_slots:
            raise ValueError(f"a group of {group} runs does not fit {self.n_slots} slots")
        out: list[Deferred[Any]] = []
        jobs = []
        for steps, control in runs:
            d: Deferred = Deferred()
            jobs.append(RunJob(_coroutine(steps), self._sender(deliver), control, d))
            out.append(d)
        for start in range(0, len(jobs), group):
            members = jobs[start : start + group]
            scheduler.submit_run(members[0] if len(members) == 1 else RunGroup(members))
        return out

    def _sender(self, deliver: Callable[[T], None]) -> Callable[[T, RunControl], None]:
        """What the scheduler calls with each item of a run: sent to ``deliver`` on the reactor
        when the run's window has room (the scheduler checked it) and it is not cancelled."""

        def on_engine(item: T, run_control: RunControl) -> None:
            if run_control.take_room():
                self.reactor.callFromThread(self._deliver, deliver, item, run_control)

        return on_engine

    def overloaded(self) -> bool:
        """Every slot busy and ``max_queue`` runs waiting: the next run would be refused."""
        scheduler = self.scheduler
        return scheduler is not None and (
            scheduler.processing >= self.n_slots and scheduler.waiting_runs >= self.max_queue
        )

    @property
    def busy(self) -> bool:
        scheduler = self.scheduler
        return scheduler.busy if scheduler is not None else self.engine.current is not None

    @property
    def processing(self) -> int:
        """Runs computing now (llama-server's requests_processing)."""
        scheduler = self.scheduler
        if scheduler is not None:
            return int(scheduler.processing)
        return int(self.busy)  # one slot: any job holds it, as before several slots

    @property
    def queued(self) -> int:
        """Requests waiting for a slot (llama-server's requests_deferred): runs only, as the
        engine thread's other jobs (a router's load or mark of use) answer no request."""
        return int(self.engine.waiting_runs)

    def _admitted(self, control: RunControl) -> None:
        self.runs_started += 1
        self.last_run = control

    def _resolve(self, d: Deferred, outcome: Any) -> None:
        if isinstance(outcome, Failure):
            self.reactor.callFromThread(d.errback, outcome)
        else:
            self.reactor.callFromThread(d.callback, outcome)

    def _on_shutdown(self) -> None:
        self._shutdown_trigger = None  # firing now: nothing to remove
        self.stop()

    def stop(self, wait: bool = True) -> None:
        """Cancel the running job, let it end, and stop both threads (reactor shutdown).
        ``wait=False`` returns at once: the daemon threads end after their current job (a
        start-up refused while the kernels compile must not wait for the compiler)."""
        if self._shutdown_trigger is not None:
            self.reactor.removeSystemEventTrigger(self._shutdown_trigger)
            self._shutdown_trigger = None
        scheduler = self.scheduler
        current = None if scheduler is not None else self.engine.current
        if current is not None and current.control is not None:
            current.control.cancel()
        self.preparer.stop(timeout=5 if wait else 0)
        self.engine.stop(timeout=30 if wait else 0)

    # --- on the engine thread ---------------------------------------------------------------

    def _run(
        self,
        steps: Callable[[Cancelled], Iterator[T]],
        deliver: Callable[[T], None],
        control: RunControl,
    ) -> Any:
        self.runs_started += 1
        self.last_run = control
        iterator = steps(control.cancelled)
        while True:
            try:
                item = next(iterator)
            except StopIteration as end:
                return end.value
            control.steps += 1
            # The engine keeps pulling while cancelled (it stops itself before its next token, so
            # its cache stays consistent); only the delivery stops.
            if control.wait_for_room():
                self.reactor.callFromThread(self._deliver, deliver, item, control)

    @staticmethod
    def _deliver(deliver: Callable[[T], None], item: T, control: RunControl) -> None:
        try:
            if not control.cancelled():
                deliver(item)
        except Exception:  # a writer that fails ends the run rather than feeding a dead sink
            _log.failure("delivering a chunk failed; cancelling the run")
            control.cancel()
        finally:
            control.delivered()


def _coroutine(steps: Callable[..., Iterator[Any]]) -> Callable[..., Iterator[Any]]:
    """``steps`` as the scheduler drives it: with its forward passes handed out where it
    ``yields_forwards`` (prompt_steps), as a generator (``send``) whatever it returns."""

    def run(cancelled: Cancelled, forwards: bool = True) -> Iterator[Any]:
        if getattr(steps, "yields_forwards", False):
            return (yield from steps(cancelled, forwards=forwards))
        return (yield from steps(cancelled))

    return run
