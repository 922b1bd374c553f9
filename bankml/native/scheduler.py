"""Several slots on the one engine thread: llama-server's ``update_slots`` loop.

``Scheduler`` replaces the bridge's one-run-at-a-time worker when the server has more than one
slot (``--parallel N``). It serves the same queue of jobs, in arrival order:

- **Runs** are admitted while a slot is free (at most ``n_slots`` active); the rest wait in
  arrival order, at most ``max_queue`` of them (``EngineBridge.stream`` refuses past that).
- **Groups** (``RunGroup``: a prompt's ``n_cmpl`` completions, the parent first) are admitted
  only when a slot is free for each of their runs at once, as llama-server launches a parent
  task with its children. A group that does not fit keeps its place in the queue, and, as
  llama-server defers such a task and goes on with the next, later runs that fit the free
  slots are admitted meanwhile; each time slots free, the queue is scanned again from its
  head, so the group goes first once it fits. (Under a steady stream of later single runs a
  group can wait long, as there.) A group's runs start in the iteration that admits them: a
  child takes its slot and waits (it yields ``Waiting``, needing no forward pass) until the
  parent's prefill ends, when the engine copies the parent's slot into it
  (schedule.SharedPrompt).
- **Each iteration advances every active run by one step**: the run (a generator from
  ``prompt_steps(..., forwards=True)``) is resumed until it asks for its next forward pass (an
  engine ``Forward``: one decode token, or one prefill micro-batch); the items it made on the
  way (chunks, progress) go to the reactor. Then the iteration's forward passes are computed
  as engine_cupy.passes plans them (``passes_of``: the prompt micro-batches in groups of at
  most ``BATCH_ROWS`` tokens, the decode steps in the first), each group one ``forward_rows``
  call (``Model.forward_batch``: where the model shares passes, the prompt chunks through the
  layers together and the decode steps in the first such pass, so one pass over the weights
  computes a token for every generating slot and a waiting one's next chunk; else the decode
  steps one batched step and each chunk a pass); each run is sent its logits at its next step,
  and ``stats`` count the passes the call reports it ran. New runs join at the next
  iteration; finished or cancelled ones leave at once.
- **Back-pressure per slot**: a run whose client window is full (``RunControl.has_room``) is
  skipped, its logits kept, until the client has room; the others go on. A cancelled run is
  advanced whatever its window, and the engine stops it before its next token.
- **Other jobs** (``EngineBridge.call``: slot actions, model loads, the Python API's runs) keep
  their place in the queue: one runs when every run that came before it has finished, and the
  runs after it wait for it, so it never sees a slot half-way through a step. A job that
  touches no active run's slot may say when it can run beside them (``beside_runs``: a model's
  load once its room can be made from idle models, an unload once its model is idle:
  ``EngineBridge.call_beside_runs``): at the head of the queue it runs between two iterations
  as soon as that holds, without waiting for the other models' runs to end.

Every request computes exactly what it would alone: each run has its own slot (KV cache,
tokens, checkpoints) and its own sampler; the forward passes of one iteration touch disjoint
caches, and each sequence of a shared pass is the same bits as that slot's own forward
pass; a child's slot is an exact copy of its parent's after the prompt (llama-server's child
slots are too), and it samples with its own sampler from its own copy of the parent's last logits.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from twisted.python.failure import Failure

from bankml.engine_cupy.passes import pass_groups, passes_of
from bankml.serving.run_control import ClientGone

__all__ = ["Scheduler", "RunJob", "RunGroup", "CallJob", "forward_rows"]


WAIT_SLICE_S = 0.5  # an idle or fully paused loop re-checks its runs this often (a safety net)


def forward_rows(forwards: Sequence[Any]) -> tuple[list[Any], list[list[int]]]:
    """The logits of each of one iteration's forward passes, each its own array (a paused run
    keeps its logits past the next pass), and the passes that computed them (index lists into
    ``forwards``): one ``forward_batch`` call over the slots' caches where the model has it
    (its ``PassLogits`` name the passes it ran: the prompt micro-batches and the decode steps
    in one pass where the model shares passes, else the decode steps one batched step; every
    sequence the bits of its own forward pass), else each pass in turn (counted as a model
    that shares no pass runs them: the decode steps one step, each prompt chunk its own)."""
    model = forwards[0].model
    batch = getattr(model, "forward_batch", None)
    in_turn = pass_groups([len(f.tokens) for f in forwards], shares=False)
    together = not any(getattr(f, "all_logits", False) for f in forwards)  # a draft's check
    if (
        len(forwards) > 1
        and together
        and batch is not None
        and all(f.model is model for f in forwards)
    ):
        logits = batch([f.tokens for f in forwards], [f.cache for f in forwards])
        return list(logits), getattr(logits, "passes", in_turn)
    return [f.compute() for f in forwards], in_turn


@dataclass
class RunJob:
    """A run waiting for (or holding) a slot: its steps, where its items go, its flags."""

    steps: Callable[..., Iterator[Any]]
    deliver: Callable[[Any, Any], None]  # (item, control), called on the engine thread
    control: Any
    deferred: Any
    iterator: Any = None
    reply: Any = None  # the logits of its last Forward, sent at its next step
    forward: Any = None  # the pass it asked for this iteration


@dataclass
class RunGroup:
    """Runs admitted together or not at all (a prompt's ``n_cmpl`` completions: the parent
    first), each on a slot of its own."""

    jobs: list[RunJob]


@dataclass
class CallJob:
    work: Callable[[], Any]
    deferred: Any
    # set: the job may run between two iterations, beside the active runs, once it is at the
    # head of the queue and this says so (asked on the engine thread before each iteration)
    beside_runs: Callable[[], bool] | None = None

    def may_run(self, runs_active: bool) -> bool:
        return not runs_active or (self.beside_runs is not None and self.beside_runs())


@dataclass
class SchedulerStats:
    """What the loop did, for /metrics, tests and docs."""

    iterations: int = 0
    passes: int = 0  # forward passes computed (a batched decode step counts one)
    decode_calls: int = 0  # of those, the passes with decode steps
    decode_rows: int = 0  # slots decoded in them
    shared_decodes: int = 0  # of those passes, the ones with several slots' decode steps
    prefill_batches: int = 0  # prompt micro-batches of more than one token computed
    shared_prompts: int = 0  # passes that took several slots' prompt micro-batches
    mixed_passes: int = 0  # passes that took decode steps and prompt micro-batches together
    prompt_tokens: int = 0  # prompt tokens computed (prefill micro-batches, one-token ones too)
    groups: int = 0  # run groups admitted (a prompt's completions computing it once)
    deferred: int = 0  # admissions a group waited on for want of free slots
    skipped: int = 0  # run-steps sat out on a full window
    max_active: int = 0
    runs: list[Any] = field(default_factory=list)  # the last runs' controls (a ring)


class Scheduler:
    """The engine thread of a server with several slots (see the module doc). The same
    surface as the bridge's one-run worker: ``start``, ``submit_run``/``submit_call``,
    ``stop``, ``thread``, ``pending``, ``busy``."""

    KEEP_RUNS = 64

    def __init__(
        self,
        reactor: Any,
        name: str,
        n_slots: int,
        resolve: Callable[[Any, Any], None],
        on_run: Callable[[Any], None] | None = None,
    ) -> None:
        if n_slots < 1:
            raise ValueError("a scheduler has at least one slot")
        self.reactor = reactor
        self.name = name
        self.n_slots = n_slots
        self._resolve = resolve  # (deferred, outcome) -> fired on the reactor thread
        self._on_run = on_run  # told of each run as it is admitted (the bridge's counters)
        self._cond = threading.Condition()
        self._queue: deque[Any] = deque()
        self._active: list[RunJob] = []
        self._stopping = False
        self._calling = False
        self.thread: threading.Thread | None = None
        self.stats = SchedulerStats()

    # --- any thread ---------------------------------------------------------------------------

    def start(self) -> None:
        if self.thread is None:
            self._stopping = False
            self.thread = threading.Thread(target=self._serve, name=self.name, daemon=True)
            self.thread.start()

    def wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def submit_run(self, job: RunJob | RunGroup) -> None:
        """Queue a run, or a group of runs to be admitted together (``RunGroup``)."""
        self.start()
        for run in _runs_of(job):
            run.control.on_change = self.wake
        with self._cond:
            self._queue.append(job)
            self._cond.notify_all()

    def submit_call(self, job: CallJob) -> None:
        self.start()
        with self._cond:
            self._queue.append(job)
            self._cond.notify_all()

    @property
    def pending(self) -> int:
        """Jobs waiting for their turn (runs waiting for a slot, and calls)."""
        with self._cond:
            return len(self._queue)

    @property
    def waiting_runs(self) -> int:
        with self._cond:
            return sum(not run.control.cancelled() for job in self._queue for run in _runs_of(job))

    @property
    def processing(self) -> int:
        """Runs holding a slot now (llama-server's requests_processing)."""
        return len(self._active)

    @property
    def busy(self) -> bool:
        return bool(self._active) or self._calling

    def active_controls(self) -> list[Any]:
        return [run.control for run in list(self._active)]

    def stop(self, timeout: float | None = None) -> None:
        """Cancel the active runs, let them end, and end the thread."""
        thread = self.thread
        if thread is None:
            return
        with self._cond:
            self._stopping = True
            for run in self._active:
                run.control.cancel()
            self._cond.notify_all()
        thread.join(timeout)
        self.thread = None

    # --- the engine thread --------------------------------------------------------------------

    def _serve(self) -> None:
        while True:
            call = None
            with self._cond:
                self._admit()
                head = self._queue[0] if self._queue else None
                if isinstance(head, CallJob) and head.may_run(bool(self._active)):
                    call = self._queue.popleft()
                    self._calling = True
                elif not self._active:
                    if self._stopping:
                        self._fail_queued()
                        return
                    self._cond.wait(WAIT_SLICE_S)
                    continue
            if call is not None:
                self._call(call)
                continue
            if not self._iterate():
                with self._cond:  # every active run is paused: wait for room (or anything)
                    self._cond.wait(WAIT_SLICE_S)

    def _admit(self) -> None:
        """Queued runs take the free slots in arrival order; a group only when all of its runs
        fit at once, else it keeps its place and later runs that fit take the free slots (as
        llama-server defers a parent task). A call stops the scan: it waits for the active runs
        to end, and the runs behind it wait for it."""
        i = 0
        while i < len(self._queue):
            job = self._queue[i]
            if isinstance(job, CallJob):
                return
            runs = _runs_of(job)
            if all(run.control.cancelled() for run in runs):
                del self._queue[i]
                for run in runs:
                    self._resolve(
                        run.deferred, Failure(ClientGone("the client left before its turn"))
                    )
                continue
            free = self.n_slots - len(self._active)
            if free == 0 or self._stopping:
                return
            if len(runs) > free:
                self.stats.deferred += 1
                i += 1
                continue
            del self._queue[i]
            self.stats.groups += int(len(runs) > 1)
            for run in runs:
                self._start(run)

    def _start(self, job: RunJob) -> None:
        self._active.append(job)
        self.stats.max_active = max(self.stats.max_active, len(self._active))
        self.stats.runs.append(job.control)
        del self.stats.runs[: -self.KEEP_RUNS]
        if self._on_run is not None:
            self._on_run(job.control)

    def _fail_queued(self) -> None:
        while self._queue:
            job = self._queue.popleft()
            for one in job.jobs if isinstance(job, RunGroup) else [job]:
                self._resolve(one.deferred, Failure(ClientGone("the server is stopping")))

    def _call(self, call: CallJob) -> None:
        try:
            outcome: Any = call.work()
        except BaseException:  # the job's own error goes to its Deferred, never kills the thread
            outcome = Failure()
        finally:
            with self._cond:
                self._calling = False
        self._resolve(call.deferred, outcome)

    def _iterate(self) -> bool:
        """One step of every active run that may go on, then the iteration's forward passes.
        False when none could go on (every client's window full, or only waiting)."""
        self.stats.iterations += 1
        moved = False
        for run in list(self._active):
            control = run.control
            # a run not yet started always starts: it takes its slot in its group's iteration
            started = run.iterator is not None
            if started and not control.cancelled() and not control.has_room():
                control.skipped += 1
                self.stats.skipped += 1
                continue
            moved = self._advance(run) or moved
        self._compute([run for run in self._active if run.forward is not None])
        return moved

    def _advance(self, run: RunJob) -> bool:
        """Resume the run until it asks for a forward pass, waits (a shared prompt's child
        while its parent computes the prompt), its window is full, or it ends. False when it
        only waited."""
        control = run.control
        try:
            if run.iterator is None:
                run.iterator = run.steps(control.cancelled, forwards=True)
            while True:
                reply, run.reply = run.reply, None
                item = run.iterator.send(reply)
                if getattr(item, "is_wait", False):
                    return False
                if getattr(item, "is_forward", False):
                    run.forward = item
                    return True
                control.steps += 1
                run.deliver(item, control)
                if not control.cancelled() and not control.has_room():
                    return True
        except StopIteration as end:
            self._leave(run, end.value)
        except BaseException:  # its own error ends only this run
            self._leave(run, Failure())
        return True

    def _leave(self, run: RunJob, outcome: Any) -> None:
        with self._cond:
            if run in self._active:
                self._active.remove(run)
        self._resolve(run.deferred, outcome)

    def _compute(self, runs: list[RunJob]) -> None:
        by_forward = {id(run.forward): run for run in runs}
        for group in passes_of([run.forward for run in runs]):
            members = [by_forward[id(f)] for f in group]
            for run in members:
                run.forward = None
            try:
                replies, passes = forward_rows(group)
            except BaseException:
                failure = Failure()
                for run in members:
                    self._close(run, failure)
                continue
            self._count(group, passes)
            for run, reply in zip(members, replies):
                run.reply = reply

    def _count(self, group: list[Any], passes: list[list[int]]) -> None:
        """The stats of one ``forward_rows`` call: ``passes`` are the passes it ran (index
        lists into ``group``)."""
        stats = self.stats
        decodes = sum(1 for f in group if f.decode)
        prompts = len(group) - decodes
        stats.passes += len(passes)
        stats.prompt_tokens += sum(len(f.tokens) for f in group if getattr(f, "prompt", False))
        stats.decode_calls += int(decodes > 0)
        stats.decode_rows += decodes
        stats.shared_decodes += int(decodes > 1)
        stats.prefill_batches += prompts
        for p in passes:
            chunks = sum(1 for i in p if not group[i].decode)
            stats.shared_prompts += int(chunks > 1)
            stats.mixed_passes += int(0 < chunks < len(p))

    def _close(self, run: RunJob, failure: Failure) -> None:
        """A forward pass failed: the run's generator is closed (its slot released) and its
        Deferred fails."""
        try:
            run.iterator.close()
        except BaseException:  # closing must not hide the pass's own error
            pass
        self._leave(run, failure)


def _runs_of(job: Any) -> list[RunJob]:
    """The runs of a queued job: a group's, a run itself, none for a call."""
    if isinstance(job, RunGroup):
        return job.jobs
    return [job] if isinstance(job, RunJob) else []
