"""One run's flow control between an HTTP request and the thread that computes it.

``RunControl`` is the ``IPushProducer`` a streamed answer registers on its request: the
transport's pauses, the client leaving and the chunks handed to the transport reach the thread
that computes the run (bankml/native/bridge.py's engine thread, or its scheduler) under one
condition variable, and at most ``window`` chunks are ever in flight between the two. A run that
cannot be queued fails with ``Overloaded`` (a 503 asking for ``Retry-After: RETRY_AFTER_S``), a
job whose client left before its turn with ``ClientGone``.

The Resources (bankml/resources/) read these names to answer; the bridge and the scheduler
raise and drive them. No engine, no NumPy: ``threading`` and Twisted's interfaces only.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from twisted.internet.defer import CancelledError
from twisted.internet.interfaces import IPushProducer
from zope.interface import implementer

from bankml.formats.errors import RETRY_AFTER_S

__all__ = ["RunControl", "ClientGone", "Overloaded", "DEFAULT_WINDOW"]

DEFAULT_WINDOW = 4  # chunks computed but not yet written: bounds memory per slow client
WAIT_SLICE_S = 0.5  # a blocked engine thread re-checks its flags this often (a safety net only)


class ClientGone(CancelledError):
    """The client left before its job ran: the job was skipped."""


class Overloaded(Exception):
    """Every slot is busy and ``max_queue`` runs already wait: the run was not queued."""

    def __init__(self, max_queue: int) -> None:
        super().__init__(
            f"the server is busy: every slot is in use and {max_queue} requests are waiting; "
            f"retry in {RETRY_AFTER_S} s"
        )
        self.max_queue = max_queue


@implementer(IPushProducer)
class RunControl:
    """The flags shared by one run's engine side and its reactor side.

    The reactor side (``pauseProducing``/``resumeProducing``/``stopProducing``, ``cancel``,
    ``delivered``) and the engine side (``cancelled``, ``wait_for_room``) meet under one
    condition variable. ``steps`` counts the items the engine produced and ``steps_at_cancel``
    what it had produced when the cancel came, so a test can see how far a run went on.
    """

    def __init__(self, window: int = DEFAULT_WINDOW) -> None:
        if window < 1:
            raise ValueError("window must be at least 1")
        self.window = window
        self._cond = threading.Condition()
        self._cancelled = False
        self._paused = False
        self._in_flight = 0
        self.steps = 0
        self.steps_at_cancel: int | None = None
        self.paused_count = 0  # how often the transport pushed back (for tests and docs)
        self.skipped = 0  # scheduler steps it sat out on a full window (several slots)
        self.on_change: Callable[[], None] | None = None  # the scheduler's wake-up
        # the controls of a request's other runs (its choices and prompts on several slots):
        # the client's cancel, pause and resume reach each of them
        self.followers: list[RunControl] = []

    def follow(self, other: RunControl) -> None:
        """``other`` (one run of this request) is cancelled, paused and resumed with this one."""
        self.followers.append(other)
        if self._cancelled:
            other.cancel()

    # --- reactor side -----------------------------------------------------------------------

    def cancel(self) -> None:
        with self._cond:
            if not self._cancelled:
                self._cancelled = True
                self.steps_at_cancel = self.steps
            self._cond.notify_all()
        self._changed()
        for other in self.followers:
            other.cancel()

    def pauseProducing(self) -> None:
        with self._cond:
            self._paused = True
            self.paused_count += 1
        for other in self.followers:
            other.pauseProducing()

    def resumeProducing(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify_all()
        self._changed()
        for other in self.followers:
            other.resumeProducing()

    def _changed(self) -> None:
        wake = self.on_change
        if wake is not None:
            wake()

    def stopProducing(self) -> None:
        self.cancel()

    def delivered(self) -> None:
        """One chunk has been handed to the transport: room for another."""
        with self._cond:
            self._in_flight -= 1
            self._cond.notify_all()
        self._changed()

    def attach(self, request: Any) -> None:
        """Register on a twisted.web request: its transport's pauses reach the engine, and its
        connection closing cancels the run."""
        request.registerProducer(self, True)
        request.notifyFinish().addErrback(lambda _: self.cancel())

    # --- engine side --------------------------------------------------------------------------

    def cancelled(self) -> bool:
        return self._cancelled  # a bool read is atomic; the engine polls it per token

    def has_room(self) -> bool:
        """Whether a chunk may be sent now (the scheduler's test: it never blocks)."""
        with self._cond:
            return not self._paused and self._in_flight < self.window

    def take_room(self) -> bool:
        """Count one chunk in flight without waiting (the scheduler checked ``has_room`` before
        the step); False once the run is cancelled (then nothing more is sent)."""
        with self._cond:
            if self._cancelled:
                return False
            self._in_flight += 1
            return True

    def wait_for_room(self) -> bool:
        """Block while the client is paused or ``window`` chunks are in flight. True when a
        chunk may be sent, False once the run is cancelled (then nothing more is sent)."""
        with self._cond:
            while not self._cancelled and (self._paused or self._in_flight >= self.window):
                self._cond.wait(WAIT_SLICE_S)
            if self._cancelled:
                return False
            self._in_flight += 1
            return True
