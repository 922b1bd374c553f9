"""The KV cache's memory: a slot holds only the pages its written positions reach.

Every store is laid out per KV head for the whole context, so a first prompt of a few tokens
writes a little into every head's region. In 2 MiB pages that made the kernel zero (and keep
resident) the whole store; kv_cache.zeroed maps the stores in 4 KiB pages. Read from the
process's own /proc/self/pagemap and smaps, Linux only.
"""

from __future__ import annotations

import mmap
from pathlib import Path

import numpy
import pytest

from bankml.engine_cupy.kernels.exact_attention import _cell_buffer
from bankml.engine_cupy.kv_cache import KVCache, zeroed

pytestmark = pytest.mark.skipif(
    not Path("/proc/self/pagemap").exists(), reason="reads the process's memory map (Linux)"
)

PAGE = mmap.PAGESIZE


def present_pages(array: numpy.ndarray) -> int:
    """How many of the pages under ``array`` are in memory (/proc/self/pagemap: one 64-bit
    entry a page, bit 63 set when present)."""
    first = array.__array_interface__["data"][0]
    start, end = first // PAGE, -(-(first + array.nbytes) // PAGE)
    with open("/proc/self/pagemap", "rb") as pagemap:
        pagemap.seek(start * 8)
        entries = numpy.frombuffer(pagemap.read((end - start) * 8), numpy.uint64)
    return int(((entries >> numpy.uint64(63)) & numpy.uint64(1)).sum())


def huge_pages(arrays: list[numpy.ndarray]) -> int:
    """AnonHugePages, in bytes, of the mappings that hold the arrays' bytes (/proc/self/smaps)."""
    spans = [(a.__array_interface__["data"][0], a.nbytes) for a in arrays]
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            start, end = (int(x, 16) for x in head.split("-"))
            inside = any(start < first + size and first < end for first, size in spans)
        elif inside and head == "AnonHugePages:":
            total += int(line.split()[1]) * 1024
    return total


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
    # the values' stores (a q8_0 cache's f16 scales are 1/64 of them)
    stores = [entry[0] if cache_type == "q8_0" else entry for entry in cache._k + cache._v]
    assert huge_pages(stores) == 0
    for store in stores:  # what 17 positions reach: a page or two of each head's region
        per_head = -(-n * (store.nbytes // store.shape[0] // n_ctx) // PAGE) + 1
        assert store.nbytes // store.shape[0] >= 8 * PAGE  # each head's region spans more
        assert present_pages(store) <= store.shape[0] * per_head, store.dtype


def test_zeroed_stores_read_as_zeros_and_write_as_arrays() -> None:
    store = zeroed(numpy, (3, 1000, 64), numpy.float32)
    assert store.flags.c_contiguous and store.flags.writeable
    assert not store.any()
    store[1, 5] = 2.5
    assert store.sum() == 2.5 * 64
    assert zeroed(numpy, (0, 4), numpy.int8).shape == (0, 4)


def test_attention_reads_the_stores_in_place() -> None:
    """The attention kernels take a view of a store's first cells and read the store itself
    (exact_attention._cell_buffer): copying the cells would cost more than the attention."""
    n = 17
    rng = numpy.random.default_rng(3)
    k, v = (rng.standard_normal((n, 2, 64), numpy.float32) for _ in "kv")
    f16 = KVCache(numpy, 1, 2, 64, 512, "f16")
    f16.store(0, 0, k, v)
    assert _cell_buffer(f16.keys(0, n), numpy.float32) is f16._k[0]
    assert _cell_buffer(f16.values(0, n), numpy.float32) is f16._v[0]
    q8 = KVCache(numpy, 1, 2, 64, 512, "q8_0")
    q8.store(0, 0, k, v)
    k_q, _, v_q, _ = q8.quantized(0, n)
    assert _cell_buffer(k_q, numpy.int8) is q8._k[0][0]
    assert _cell_buffer(v_q, numpy.int8) is q8._v[0][0]
