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
cache off; negative means no byte limit. An entry counts the bytes llama-server's state of the
sequence takes (``KVCache.state_nbytes``: f16 or q8_0 cells with their metadata, whatever
bankml holds them in) and its context checkpoints'. After a slot's save and load, and after
each idle slot saved, ``update`` evicts the oldest entries over the byte limit, then over the
token limit: the server's context (all slots'), raised to what the byte limit holds at the
entries' bytes per token. So without a byte limit the cache holds one context's tokens.

With ``-kvu`` an entry saved while the engine knew the shared cache's cells (``SavedCells``)
keeps where the sequence sat, as llama-server's state of it lists its cells in cell order: a
load places them in the shared cache in that order, as llama.cpp reads a saved sequence back.
Twisted-free; the engine calls it on its own thread.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

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


class SavedCells(NamedTuple):
    """A sequence's positions in cell order in the cache the slots share (``-kvu``), as
    llama-server's state of it writes them: the full layers' cache's, and a sliding-window
    model's sliding layers' cache's window (None: a model without one)."""

    base: np.ndarray
    swa: np.ndarray | None = None


@dataclass
class Entry:
    tokens: list[int]
    kv: list[Any]
    nbytes: int  # as llama-server counts it: its state of the sequence and its checkpoints'
    ring: Any = None  # the SWA ring's positions in cell order (KVCache.ring_positions)
    checkpoints: list[Any] = field(
        default_factory=list
    )  # the slot's context checkpoints, kept with it
    # where it sat in the shared cache, when the engine knew (None: not known, or no -kvu)
    cells: SavedCells | None = None

    @property
    def held_nbytes(self) -> int:
        """The memory its KV copies take as bankml holds them (f32 for an f16 cache)."""
        return sum(sum(a.nbytes for a in e) if isinstance(e, tuple) else e.nbytes for e in self.kv)


class HostPromptCache:
    """Entries of (tokens, KV copy), oldest first, under a byte limit and a token limit
    (``limit_tokens``: the server's whole context; 0 none). ``n_streams``: the streams of
    llama-server's cache (1 with ``-kvu``, else one per slot), which its state sizes count."""

    def __init__(self, limit_bytes: int | None, limit_tokens: int = 0, n_streams: int = 1):
        self.limit = limit_bytes
        self.limit_tokens = int(limit_tokens)
        self.n_streams = int(n_streams)
        self.entries: list[Entry] = []

    @property
    def enabled(self) -> bool:
        return self.limit != 0

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    @property
    def n_tokens(self) -> int:
        return sum(len(e.tokens) for e in self.entries)

    def save(
        self,
        slot: Sequence[int],
        cache: Any,
        checkpoints: Sequence[Any] = (),
        cells: SavedCells | None = None,
    ) -> bool:
        """Copy the slot in, as llama-server's prompt save does (its checkpoints with it, and
        where it sat in the shared cache where that is known); whether it was kept."""
        tokens = list(slot)
        if not tokens or any(_holds_whole(e.tokens, tokens) for e in self.entries):
            return False
        nbytes = cache.state_nbytes(self.n_streams) + sum(c.nbytes for c in checkpoints)
        if self.limit is not None and nbytes > self.limit:
            return False
        self.entries = [e for e in self.entries if not _holds_whole(tokens, e.tokens)]
        while self.entries and self.limit is not None and self.nbytes + nbytes > self.limit:
            self.entries.pop(0)
        if cells is not None and cells.swa is not None:  # the shared sliding layers' window
            ring: Any = cells.swa
        else:
            ring = cache.ring_positions() if hasattr(cache, "ring_positions") else None
        self.entries.append(Entry(tokens, cache.snapshot(), nbytes, ring, list(checkpoints), cells))
        return True

    def update(self) -> None:
        """server_prompt_cache::update: the oldest entries out while over the byte limit, then
        while over the token limit (raised to the byte limit over the bytes per token)."""
        if self.limit:
            while self.entries and self.nbytes > self.limit:
                self.entries.pop(0)
        # in float32, as there
        per_token = max(np.float32(1), np.float32(self.nbytes) / np.float32(max(1, self.n_tokens)))
        limit_tokens = self.limit_tokens
        if self.limit:
            limit_tokens = max(limit_tokens, int(np.float32(self.limit) / per_token))
        if self.limit_tokens > 0:
            while self.entries and self.n_tokens > limit_tokens:
                self.entries.pop(0)

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
