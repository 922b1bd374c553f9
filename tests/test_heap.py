"""bankml/native/heap.py: free heap pages given back to the system (docs/modules/heap.md)."""

from __future__ import annotations

import numpy as np
import psutil
import pytest

from bankml.native import heap

MIB = 2**20


def test_freed_heap_pages_go_back_to_the_system() -> None:
    if not heap.can_release():
        pytest.skip("this C library has no malloc_trim")
    process = psutil.Process()
    blocks = [np.ones(8000) for _ in range(4000)]  # 64 kB each: on the heap, not mmap'd
    last = blocks[-1]  # kept, so the freed space below it is not trimmed on its own
    del blocks
    resident = process.memory_info().rss
    heap.release_free_heap()
    given_back = resident - process.memory_info().rss
    assert given_back > 100 * MIB, f"only {given_back / MIB:.1f} MiB given back"
    assert last.sum() == 8000  # the block still in use is untouched
