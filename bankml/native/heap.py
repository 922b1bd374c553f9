"""Giving the C heap's free pages back to the system while serving.

Each answer allocates and frees NumPy temporaries (logits, candidates, activations) on the
engine thread. glibc's allocator keeps freed space inside its arenas for reuse, and its dynamic
mmap threshold moves blocks that were mmap'd at first onto the heap, so a long-running server's
resident size climbs for its first minutes while the bytes in use stay flat (docs/reliability.md
measured it with ``bench/soak.py --heap-log``). ``malloc_trim(0)`` returns the whole free pages
of every arena to the system; the native service calls it every few seconds on a thread of the
reactor's pool (a trim of a fragmented heap was measured at 4-45 ms, too long for the reactor).
It changes no allocation the engine makes, only which free pages stay resident.

Where the C library has no ``malloc_trim`` (not glibc), ``release_free_heap`` does nothing.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

__all__ = ["TRIM_INTERVAL_S", "release_free_heap", "can_release"]

TRIM_INTERVAL_S = 5.0  # often enough to keep the resident size flat under a steady load


def _malloc_trim() -> Callable[[int], int] | None:
    try:
        libc = ctypes.CDLL(None)  # the C library this process runs on
    except OSError:
        return None
    trim = getattr(libc, "malloc_trim", None)
    if trim is None:
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


_TRIM = _malloc_trim()


def can_release() -> bool:
    """Whether this C library can give free heap pages back (glibc's ``malloc_trim``)."""
    return _TRIM is not None


def release_free_heap() -> bool:
    """Return the free heap pages to the system; True when some were returned."""
    return bool(_TRIM(0)) if _TRIM is not None else False
