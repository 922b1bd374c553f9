"""The KV cache's memory: a slot holds only the pages its written positions reach.

Every store is laid out per KV head for the whole context, so a first prompt of a few tokens
writes a little into every head's region. In 2 MiB pages that made the kernel zero (and keep
resident) the whole store; kv_cache.zeroed maps the stores in 4 KiB pages. Read from the
process's own /proc/self/smaps, Linux only.
"""

from __future__ import annotations

from pathlib import Path

import numpy
import pytest

from bankml.engine_cupy.kv_cache import KVCache, zeroed

pytestmark = pytest.mark.skipif(
    not Path("/proc/self/smaps").exists(), reason="reads the process's memory map (Linux)"
)

KIB = 1024


def resident(array: numpy.ndarray) -> tuple[int, int, int]:
    """(Size, Rss, AnonHugePages) in bytes of the mappings that hold ``array``'s bytes."""
    first = array.__array_interface__["data"][0]
    last = first + array.nbytes
    totals = {"Size:": 0, "Rss:": 0, "AnonHugePages:": 0}
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start < last and first < end
        elif inside and head in totals:
            totals[head] += int(line.split()[1]) * KIB
    return totals["Size:"], totals["Rss:"], totals["AnonHugePages:"]


@pytest.mark.parametrize("cache_type", ["f16", "q8_0"])
def test_a_short_prompt_makes_resident_only_the_pages_it_writes(cache_type: str) -> None:
    # a 3B model's layer at -c 2048: 8 KV heads of 128, an 8 MiB f32 store per layer and kind
    n_head_kv, head_dim, n_ctx, n = 8, 128, 2048, 17
    cache = KVCache(numpy, 2, n_head_kv, head_dim, n_ctx, cache_type)
    rng = numpy.random.default_rng(7)
    for layer in range(2):
        k, v = (rng.standard_normal((n, n_head_kv, head_dim), numpy.float32) for _ in "kv")
        cache.store(layer, 0, k, v)
    cache.advance(n)
    store = cache._k[0] if cache_type == "f16" else cache._k[0][0]
    size, rss, huge = resident(store)
    per_head = -(-n * head_dim * store.itemsize // (4 * KIB)) + 1  # pages, a boundary maybe
    assert huge == 0
    assert rss <= n_head_kv * per_head * 4 * KIB, (rss, store.nbytes)
    assert size == store.nbytes >= 2 * 2**20  # a mapping of its own, the whole context's


def test_zeroed_stores_read_as_zeros_and_write_as_arrays() -> None:
    store = zeroed(numpy, (3, 1000, 64), numpy.float32)
    assert store.flags.c_contiguous and store.flags.writeable
    assert not store.any()
    store[1, 5] = 2.5
    assert store.sum() == 2.5 * 64
    assert zeroed(numpy, (0, 4), numpy.int8).shape == (0, 4)
