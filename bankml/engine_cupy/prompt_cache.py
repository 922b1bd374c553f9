"""The host prompt cache: llama-server's ``--cache-ram``, so interleaved conversations keep context.

One cache for all the engine's slots. When a request's prompt shares little with what its slot
holds, the slot's tokens and KV are copied to host memory before the slot is reused, and an
earlier entry that shares more with the prompt is moved back in. The rules are llama-server's
(``server_prompt_cache``):

- when it runs is decided with the slot (``Engine.choose_slot``): a slot chosen as the least
  recently used, or one chosen by similarity that keeps less than half of its tokens;
- save: skip an empty slot or one an entry already holds whole; drop entries the slot holds whole;
  evict the oldest until the new entry fits; an entry larger than the limit is not kept;
- load: among entries that keep at least a quarter of themselves for this prompt, the one with the
  largest kept fraction moves in, if both its kept fraction and its similarity beat the slot's.

The limit (``cache_ram_limit``, MiB as llama-server's ``--cache-ram``): None or empty →
min(8192, a quarter of the memory available when the engine opens), at least 1; ``0`` turns the
cache off; negative means no limit. Entries count the bytes of
their KV copies. Twisted-free; the engine calls it on its own thread.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

MIB = 1 << 20


def longest_common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if len(diff) else n


def cache_ram_limit(mib: int | str | None = None) -> int | None:
    """The byte limit for ``mib`` MiB (a number, or its text as given on a command line):
    0 off, None unlimited; None or empty text: the default above."""
    raw = mib.strip() if isinstance(mib, str) else mib
    if raw is None or raw == "":
        try:
            import psutil

            available = psutil.virtual_memory().available
        except Exception:  # psutil missing or unreadable: a modest default
            available = 4096 * MIB
        return max(1, min(8192, available // 4 // MIB)) * MIB
    try:
        size = int(raw)
    except ValueError:
        raise ValueError(f"cache RAM {raw!r}: expected a number of MiB") from None
    return None if size < 0 else size * MIB


@dataclass
class Entry:
    tokens: list[int]
    kv: list[Any]
    nbytes: int
    ring: Any = None  # the SWA ring's positions in cell order (KVCache.ring_positions)
    checkpoints: list[Any] = field(
        default_factory=list
    )  # the slot's context checkpoints, kept with it


def _kv_bytes(kv: list[Any]) -> int:
    return sum(sum(a.nbytes for a in e) if isinstance(e, tuple) else e.nbytes for e in kv)


class HostPromptCache:
    """Entries of (tokens, KV copy), oldest first, under a byte limit."""

    def __init__(self, limit_bytes: int | None):
        self.limit = limit_bytes
        self.entries: list[Entry] = []

    @property
    def enabled(self) -> bool:
        return self.limit != 0

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    def save(self, slot: Sequence[int], cache: Any, checkpoints: Sequence[Any] = ()) -> None:
        """Copy the slot in, as llama-server's prompt save does (its checkpoints with it)."""
        tokens = list(slot)
        if not tokens or any(_holds_whole(e.tokens, tokens) for e in self.entries):
            return
        self.entries = [e for e in self.entries if not _holds_whole(tokens, e.tokens)]
        kv = cache.snapshot()
        ring = cache.ring_positions() if hasattr(cache, "ring_positions") else None
        entry = Entry(tokens, kv, _kv_bytes(kv), ring, list(checkpoints))
        if self.limit is not None and entry.nbytes > self.limit:
            return
        while self.entries and self.limit is not None and self.nbytes + entry.nbytes > self.limit:
            self.entries.pop(0)
        self.entries.append(entry)

    def take_better(self, slot: Sequence[int], prompt: Sequence[int]) -> Entry | None:
        """The entry that serves ``prompt`` better than the slot, removed from the cache."""
        slot_lcp = longest_common_prefix(slot, prompt)
        best_f_keep = slot_lcp / len(slot) if slot else 0.0
        best_sim = slot_lcp / len(prompt) if prompt else 0.0
        best: Entry | None = None
        for entry in self.entries:
            lcp = longest_common_prefix(entry.tokens, prompt)
            f_keep = lcp / len(entry.tokens)
            sim = lcp / len(prompt) if prompt else 0.0
            if f_keep >= 0.25 and f_keep > best_f_keep and sim > best_sim:
                best, best_f_keep, best_sim = entry, f_keep, sim
        if best is not None:
            self.entries.remove(best)
        return best


def _holds_whole(holder: Sequence[int], tokens: Sequence[int]) -> bool:
    """True when ``tokens`` is a prefix of ``holder``."""
    return len(holder) >= len(tokens) and longest_common_prefix(holder, tokens) == len(tokens)
