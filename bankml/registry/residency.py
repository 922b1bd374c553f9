"""Residency: which model is loaded, until when, and the re-verification of every load.

A pure state object; the server drives it on the thread that holds the run lock (every
completion, load and unload), and its reaper calls ``reap`` once a second when that lock is free.
Times are wall-clock seconds given by the caller (``/api/ps`` shows them as ``expires_at``).

``acquire(pin)``:

- the same pin resident with the same file identity: reused, no hash, ``load_ns`` 0;
- the same pin, another identity: dropped, and 503 ``<file> changed since bankml verified it``;
- a pin whose file is absent: 404; one the forward pass does not play: 400 with the reason;
- otherwise the resident model is dropped first, then the file is verified in full (the guard,
  then its sha256 against the fork) before ``open_model`` reads a weight, and its identity must be
  the same after the hash as before it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from bankml.gate import verify
from bankml.gate.fileident import FileIdent
from bankml.registry.keepalive import FOREVER, UNLOAD, KeepAlive
from bankml.registry.pins import Pin

PS_FOREVER_SECONDS = 292 * 365.25 * 24 * 3600  # Ollama shows "kept for good" as now + 292 years


class LoadError(Exception):
    """A model that may not be loaded now: HTTP ``status`` and the message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass
class Resident:
    pin: Pin
    verified: verify.Verified
    handle: Any  # what open_model returned (the engine); the caller closes it on unload
    loaded_at: float
    expires_at: float | None = None  # None: kept for good
    shown_as: str = ""  # the model whose request loaded the weights (Ollama names its runner so)
    context_length: int = 0

    @property
    def ident(self) -> FileIdent:
        return self.verified.ident


@dataclass(frozen=True)
class Acquired:
    resident: Resident
    load_ns: int  # 0 when it was already resident


class Residency:
    """One model resident at a time (the default ``max_loaded``)."""

    def __init__(
        self,
        open_model: Callable[[verify.Verified], Any],
        on_unload: Callable[[Resident, str], None] = lambda resident, why: None,
        log: Callable[[str], None] = lambda line: None,
        verify_model: Callable[[str, str], verify.Verified] | None = None,
        ident_of: Callable[[str], FileIdent] = FileIdent.of,
        clock_ns: Callable[[], int] = time.monotonic_ns,
    ) -> None:
        self.open_model = open_model
        self.on_unload = on_unload
        self.log = log
        # looked up at call time, so the verify module's function is the one that runs
        self.verify_model = verify_model or (lambda path, fork: verify.verify(path, fork))
        self.ident_of = ident_of
        self.clock_ns = clock_ns
        self.resident: Resident | None = None

    # -- loading -------------------------------------------------------------------------------

    def drop(self, why: str) -> Resident | None:
        """Unload the resident model (if any), telling ``on_unload`` why."""
        gone, self.resident = self.resident, None
        if gone is not None:
            self.log(f"{gone.pin.name} unloaded ({why})")
            self.on_unload(gone, why)
        return gone

    def _current_ident(self, path: str) -> FileIdent | None:
        try:
            return self.ident_of(path)
        except OSError:
            return None

    def acquire(
        self, pin: Pin, now: float, shown_as: str = "", context_length: int = 0
    ) -> Acquired:
        """The resident model for ``pin``: reused when unchanged, else verified and loaded."""
        here = self.resident
        if here is not None and here.pin.name == pin.name:
            if self._current_ident(here.verified.path) == here.ident:
                self._record(here, shown_as, context_length)
                return Acquired(here, 0)
            self.drop("its file changed")
            raise LoadError(
                503,
                f"{pin.file} changed since bankml verified it: unloaded, and refused; "
                "the next request verifies it again",
            )
        if pin.path is None:
            raise LoadError(404, f"{pin.file} is pinned but not on this machine")
        if pin.native_reason is not None:
            raise LoadError(
                400,
                f"{pin.name}: bankML's native forward pass does not play it: {pin.native_reason}",
            )
        self.drop("another model was asked for")
        started = self.clock_ns()
        verified = self._verify(pin)
        try:
            handle = self.open_model(verified)
        except OSError as err:
            raise LoadError(500, f"cannot open {pin.file}: {err.strerror or err}") from None
        self.log(
            f"bankml serve --native: {pin.name} verified (sha256 {verified.sha256}); loading it"
        )
        resident = Resident(pin, verified, handle, loaded_at=now)
        self._record(resident, shown_as, context_length)
        self.resident = resident
        return Acquired(resident, max(self.clock_ns() - started, 1))

    def _verify(self, pin: Pin) -> verify.Verified:
        assert pin.path is not None
        before = self._current_ident(os.path.realpath(pin.path))
        try:
            verified = self.verify_model(pin.path, pin.fork_path)
        except verify.Refused as err:
            if err.reason.endswith("changed while it was being hashed: refused"):
                raise LoadError(503, err.reason) from None
            raise LoadError(400, f"refuse: {err.reason}") from None
        if before is not None and verified.ident != before:
            raise LoadError(503, f"{pin.file} changed while it was being hashed: refused")
        return verified

    @staticmethod
    def _record(resident: Resident, shown_as: str, context_length: int) -> None:
        """``/api/ps``'s naming: replaced on a (re)load, when empty, or when num_ctx differs."""
        if shown_as and (not resident.shown_as or context_length != resident.context_length):
            resident.shown_as = shown_as
            resident.context_length = context_length
        elif not resident.shown_as:
            resident.shown_as = resident.pin.name
            resident.context_length = context_length

    # -- after a request, and the reaper --------------------------------------------------------

    def touch(self, name: str, keep_alive: KeepAlive, now: float) -> None:
        """Apply a request's keep-alive to the pin ``name`` when it is the resident model."""
        here = self.resident
        if here is None or here.pin.name != name:
            return
        if keep_alive.kind == UNLOAD:
            self.drop("keep_alive 0")
        elif keep_alive.kind == FOREVER:
            here.expires_at = None
        else:
            here.expires_at = keep_alive.expires_at(now)

    def unload(self, name: str) -> bool:
        """Drop ``name`` now (an empty request with keep_alive 0); False when it was not resident."""
        if self.resident is None or self.resident.pin.name != name:
            return False
        self.drop("keep_alive 0")
        return True

    def expired(self, now: float) -> bool:
        here = self.resident
        return here is not None and here.expires_at is not None and here.expires_at <= now

    def reap(self, now: float) -> Resident | None:
        """Drop the resident model when its keep-alive has run out (the reaper's one step)."""
        return self.drop("keep_alive expired") if self.expired(now) else None

    def ps_expires_at(self, now: float) -> float | None:
        """``expires_at`` for /api/ps (kept for good: now + 292 years); None when none is loaded."""
        here = self.resident
        if here is None:
            return None
        return now + PS_FOREVER_SECONDS if here.expires_at is None else here.expires_at
