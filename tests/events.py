"""Waiting on events in reactor tests, never on a length of time.

``until`` polls a condition while the reactor runs; its deadline is a hang guard only (a test
that passes never comes near it), so the verdict is the same on an idle and on a loaded machine.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from twisted.internet import reactor
from twisted.internet.task import deferLater

HANG_GUARD_S = 120.0  # generous: only a hung test ever waits this long
POLL_S = 0.01


async def until(condition: Callable[[], bool], what: str, guard: float = HANG_GUARD_S) -> None:
    """Return once ``condition()`` is true; AssertionError naming ``what`` if it never becomes
    true within the hang guard."""
    deadline = time.monotonic() + guard
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"still waiting for {what} after {guard:g} s (a hang)")
        await deferLater(reactor, POLL_S, lambda: None)
