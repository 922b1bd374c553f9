"""Speculative decoding without a draft model, as llama-server's ``--spec-type ngram-simple``,
``ngram-map-k``, ``ngram-map-k4v`` (``NgramMap``, a table per slot), ``ngram-mod``
(``NgramMod``, one table for the server) and ``ngram-cache`` (``NgramCache``, without lookup
files).

After each sampled token the slot looks for the last ``size_n`` tokens (the sampled one
included) earlier in its own history and, where they occurred before, proposes the ``size_m``
tokens that followed them there (``ngram_simple_draft``, llama.cpp's
``common_ngram_simple_draft``). The sampled token and the draft are evaluated in one pass
with every row's logits; the sampler then draws from each row in turn, accepting while its
draw equals the drafted token (``accept_draft``, llama.cpp's
``common_sampler_sample_and_accept_n``): the answer is the one the same sampler gives the same
logits, token for token. Repetitive text (code, JSON, a list being copied) is where drafts are
accepted and the pass costs less than as many one-token steps.

``draft_limit`` is llama-server's ``get_n_draft_max``: room for the draft in the context
(leaving one cell for a context shift) and in what ``n_predict`` has left.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy


@dataclass(frozen=True)
class NgramSimple:
    """``--spec-ngram-simple-size-n`` / ``-size-m`` (llama-server's defaults, 12 and 48)."""

    size_n: int = 12  # the n-gram looked up in the history
    size_m: int = 48  # the most tokens drafted after a match

    def begin(self, slot: int, prompt: Sequence[int]) -> None:
        pass

    def draft(self, slot: int, tokens: Sequence[int], sampled: int) -> list[int]:
        return ngram_simple_draft(self, tokens, sampled)

    def accept(self, slot: int, n_accepted: int, is_other: bool) -> None:
        pass


def ngram_simple_draft(config: NgramSimple, tokens: Sequence[int], sampled: int) -> list[int]:
    """The tokens that followed the last occurrence of ``tokens[-(n-1):] + [sampled]`` in
    ``tokens`` (the slot's history, without ``sampled``), at most ``size_m``; none when there
    is no earlier occurrence (position 0 never counts) or fewer than ``size_n`` follow it."""
    n, m = config.size_n, config.size_m
    cur_len = len(tokens)
    if cur_len <= n + m + 1:
        return []
    pattern = [*tokens[cur_len - n + 1 :], sampled]
    match_pos = 0
    for j in range(cur_len - n - 1, 0, -1):  # backwards, skipping where the pattern ends now
        if list(tokens[j : j + len(pattern)]) == pattern:
            match_pos = j
            break
    if match_pos == 0:
        return []
    copy_max = min(m, cur_len - (match_pos + n))
    if copy_max < n:
        return []
    start = match_pos + n
    return list(tokens[start : start + copy_max])


def draft_limit(n_ctx: int, n_tokens: int, n_predict: int, n_gen: int) -> int:
    """get_n_draft_max: the slot's free cells less two (the sampled token and one for a
    context shift), and no more than ``n_predict`` leaves less one (-1: no limit)."""
    limit = n_ctx - n_tokens - 2
    if n_predict != -1 and n_predict - n_gen > 0:
        limit = min(limit, n_predict - n_gen - 1)
    return limit


def accept_draft(
    sample: Callable[[Any], int],
    accept: Callable[[int], None],
    rows: Sequence[Any],
    draft: Sequence[int],
    is_eog: Callable[[int], bool],
) -> list[int]:
    """common_sampler_sample_and_accept_n over the verification pass's ``rows`` (row i: the
    logits after the sampled token and draft[:i]): draw and accept from each row while the draw
    is the drafted token, stopping after a drafted end-of-generation token that is not the last
    of the draft; when the whole draft is taken, one more draw from the last row. The tokens
    drawn, the last of them not yet in the cache."""
    taken: list[int] = []
    i = 0
    while i < len(draft):
        token = sample(rows[i])
        accept(token)
        taken.append(token)
        if draft[i] != token or (is_eog(token) and i + 1 < len(draft)):
            break
        i += 1
    if i == len(draft):
        token = sample(rows[i])
        accept(token)
        taken.append(token)
    return taken


@dataclass
class DraftStats:
    """A run's drafted and accepted tokens: llama-server's timings add them as ``draft_n`` and
    ``draft_n_accepted`` once something was drafted."""

    drafted: int = 0
    accepted: int = 0

    def record(self, drafted: int, accepted: int) -> None:
        self.drafted += drafted
        self.accepted += accepted

    def added_to(self, timings: dict[str, Any]) -> dict[str, Any]:
        if self.drafted > 0:
            timings["draft_n"] = self.drafted
            timings["draft_n_accepted"] = self.accepted
        return timings


# --- ngram-map-k, ngram-map-k4v -------------------------------------------------------------

_LCG = 2654435761  # common_ngram_map_hash's factor; the hash wraps at 32 bits
KEY_MAP_ENTRIES = 262144  # a slot's table from an n-gram's hash to where it occurs
MAX_VALUES = 4  # m-grams remembered after each key
MAX_COUNT = 16380  # a key's or a value's count saturates here


def _lcg_hash(tokens: Sequence[int], start: int, length: int) -> int:
    value = 0
    for token in tokens[start : start + length]:
        value = (value * _LCG + token) & 0xFFFFFFFF
    return value


def _same(tokens: Sequence[int], at: int, other: Sequence[int], other_at: int, length: int) -> bool:
    return all(tokens[at + k] == other[other_at + k] for k in range(length))


@dataclass
class _Value:
    """An m-gram seen after a key: where it starts, how often, the last draft's acceptance."""

    index: int = 0  # 0: an unused place
    count: int = 0
    n_accepted: int = -1


@dataclass
class _Key:
    index: int  # where the key n-gram occurs in the history
    counted_to: int = 0  # the values are counted up to here
    count: int = 0
    values: list[_Value] = field(default_factory=lambda: [_Value() for _ in range(MAX_VALUES)])


@dataclass
class _SlotMap:
    """One slot's common_ngram_map: it lives as long as the server, across requests."""

    keys: list[_Key] = field(default_factory=list)
    key_map: list[int] = field(default_factory=lambda: [0] * KEY_MAP_ENTRIES)
    key_map_last: int = 0
    size_last_begin: int = 0
    last_check: int = 0
    last_draft: tuple[int, int] | None = None  # (key, value) of the last draft


@dataclass
class NgramMap:
    """llama-server's ``--spec-type ngram-map-k`` (``key_only``) and ``ngram-map-k4v``
    (common_ngram_map): each slot keeps a table from the hash of ``size_n`` tokens to where
    they occurred, and a list of keys seen again. ``ngram-map-k`` drafts the ``size_m`` tokens
    that followed the key's first remembered occurrence, as many as the last draft from that
    key had accepted; ``ngram-map-k4v`` counts up to four different m-grams after the key and
    drafts the most frequent once the key was hit ``min_hits`` times and that m-gram is at least
    twice as frequent as the others together."""

    key_only: bool
    size_n: int = 12
    size_m: int = 48
    min_hits: int = 1
    slots: dict[int, _SlotMap] = field(init=False, default_factory=dict)

    def _map(self, slot: int) -> _SlotMap:
        return self.slots.setdefault(slot, _SlotMap())

    def begin(self, slot: int, prompt: Sequence[int]) -> None:
        """common_ngram_map_begin: a history shorter than the last one checked drops the keys,
        values and hashes from where the previous prompt ended (or the new one's last key)."""
        state, n, m = self._map(slot), self.size_n, self.size_m
        size_begin = len(prompt)
        cleanup = state.size_last_begin
        if cleanup > size_begin:
            cleanup = size_begin - n - m if size_begin > n + m else 0
        if size_begin < state.last_check:
            key_map = state.key_map
            for i, index in enumerate(key_map):
                if index != 0 and index >= cleanup:
                    key_map[i] = 0
            state.key_map_last = cleanup - 1 if cleanup > 0 else 0
            for i in range(len(state.keys) - 1, -1, -1):
                key = state.keys[i]
                if key.index >= cleanup:
                    del state.keys[i]
                    continue
                if self.key_only:
                    continue
                for j in range(MAX_VALUES - 1, -1, -1):
                    if key.values[j].index != 0 and key.values[j].index >= cleanup:
                        # the later ones move left; the last place is cleared but for its
                        # n_accepted, as llama.cpp leaves it
                        last = key.values[-1].n_accepted
                        del key.values[j]
                        key.values.append(_Value(n_accepted=last))
                if key.values[0].index == 0:
                    del state.keys[i]
        state.last_check = size_begin
        state.size_last_begin = size_begin

    def _find(self, state: _SlotMap, tokens: Sequence[int], key: Sequence[int]) -> int:
        """Where ``key`` occurred before (0: nowhere): its hash's entry when it matches, else
        a search down the prompt, then down the answer, above what the table holds."""
        n, m, cur_len = self.size_n, self.size_m, len(tokens)
        at = state.key_map[_lcg_hash(key, 0, n) % KEY_MAP_ENTRIES]
        if at != 0 and at < cur_len - n - m - 1 and _same(tokens, at, key, 0, n):
            return at
        if state.size_last_begin > n + m + 1:
            for j in range(state.size_last_begin - n - m - 1, state.key_map_last, -1):
                if _same(tokens, j, key, 0, n):
                    return j
        j = cur_len - n - m - 1
        while j > state.size_last_begin and j > state.key_map_last:
            if _same(tokens, j, key, 0, n):
                return j
            j -= 1
        return 0

    def _remember(self, state: _SlotMap, tokens: Sequence[int]) -> None:
        """The hashes of the n-grams not yet in the table (a taken entry keeps its first)."""
        n, m, cur_len = self.size_n, self.size_m, len(tokens)
        key_map = state.key_map
        starts: list[int] = []
        if state.size_last_begin > n + m + 1:
            starts.extend(range(state.size_last_begin - n - m - 1, state.key_map_last, -1))
        j = cur_len - n - m - 1
        while j > state.size_last_begin and j > state.key_map_last:
            starts.append(j)
            j -= 1
        for j in starts:
            entry = _lcg_hash(tokens, j, n) % KEY_MAP_ENTRIES
            if key_map[entry] == 0:
                key_map[entry] = j
        state.key_map_last = max(cur_len - n - m - 1, state.key_map_last)

    def draft(self, slot: int, tokens: Sequence[int], sampled: int) -> list[int]:
        """common_ngram_map_draft over the slot's history and the token just sampled."""
        state, n, m = self._map(slot), self.size_n, self.size_m
        state.last_draft = None
        cur_len = len(tokens)
        if cur_len < 2 * n + m:
            return []
        state.last_check = cur_len
        key_tokens = [*tokens[cur_len - n + 1 :], sampled]
        match_pos = self._find(state, tokens, key_tokens)
        self._remember(state, tokens)
        if match_pos == 0:
            return []
        offset = next(
            (i for i, k in enumerate(state.keys) if _same(tokens, k.index, key_tokens, 0, n)),
            len(state.keys),
        )
        if offset == len(state.keys):
            fresh = _Key(index=match_pos)
            for value in fresh.values:
                value.n_accepted = m
            state.keys.append(fresh)
        key = state.keys[offset]
        key.count = min(key.count + 1, MAX_COUNT)
        if self.key_only:
            state.last_draft = (offset, 0)
            return self._copy(tokens, match_pos, key.values[0])
        if key.count < self.min_hits:
            return []
        self._count_values(tokens, key, key_tokens, match_pos)
        counts = [value.count for value in key.values]
        best = max(range(MAX_VALUES), key=lambda v: (counts[v], -v))  # the first of the most
        others = sum(counts) - counts[best]
        if others > 0 and counts[best] < 2 * others:
            return []  # no m-gram clearly the most frequent
        state.last_draft = (offset, best)
        return self._copy(tokens, match_pos, key.values[best])

    def _count_values(
        self, tokens: Sequence[int], key: _Key, key_tokens: Sequence[int], match_pos: int
    ) -> None:
        """The m-grams after each occurrence of the key from where counting stopped up to
        ``match_pos``: a known one counted again, a new one in the first unused place."""
        n, m = self.size_n, self.size_m
        for i in range(key.counted_to, match_pos + 1):
            if not _same(tokens, i, key_tokens, 0, n):
                continue
            begin = i + n
            for value in key.values:
                if value.index == 0:
                    value.index, value.count, value.n_accepted = begin, 0, m
                elif not _same(tokens, begin, tokens, value.index, m):
                    continue
                value.count = min(value.count + 1, MAX_COUNT)
                break
        key.counted_to = match_pos

    def _copy(self, tokens: Sequence[int], match_pos: int, value: _Value) -> list[int]:
        start = match_pos + self.size_n
        return list(tokens[start : start + min(self.size_m, value.n_accepted)])

    def accept(self, slot: int, n_accepted: int, is_other: bool) -> None:
        state = self._map(slot)
        if is_other or state.last_draft is None:
            return
        key, value = state.last_draft
        state.keys[key].values[value].n_accepted = n_accepted


# --- ngram-cache ----------------------------------------------------------------------------

NGRAM_MIN, NGRAM_MAX = 1, 4  # LLAMA_NGRAM_MIN, LLAMA_NGRAM_MAX
CACHE_DRAFT = 8  # the tokens an ngram-cache draft holds at most (llama-server's n_draft)
LAX_MIN_SAMPLES = (2, 2, 1, 1)  # draft_min_sample_size_lax, per n-gram size 1..4
LAX_MIN_PERCENT = (66, 50, 50, 50)  # draft_min_percent_lax
# libstdc++'s unordered_map sizes its buckets from these (the first 14 sizes from a table, then
# the first prime of its list not below the size asked for): its iteration order, which breaks
# a tie between two followers, follows from them
_FAST_BUCKETS = (2, 2, 2, 3, 5, 5, 7, 7, 11, 11, 11, 11, 13, 13)
_PRIMES = (
    *(17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59, 61, 67, 71, 73, 79, 83, 89, 97, 103, 109, 113),
    *(127, 137, 139, 149, 157, 167, 179, 193, 199, 211, 227, 241, 257, 277, 293, 313, 337, 359),
    *(383, 409, 439, 467, 503, 541, 577, 619, 661, 709, 761, 823, 887, 953, 1031, 1109, 1193),
    *(1289, 1381, 1493, 1613, 1741, 1879, 2029, 2179, 2357, 2549, 2753, 2971, 3209, 3469, 3739),
    *(4027, 4349, 4703, 5087, 5503, 5953, 6427, 6949, 7517, 8123, 8783, 9497, 10273, 11113),
    *(12011, 12983, 14033, 15173, 16411, 17749, 19183, 20753, 22447, 24281, 26267, 28411),
    *(30727, 33223, 35933, 38873, 42043, 45481, 49201, 53201, 57557, 62233, 67307, 72817),
    *(78779, 85229, 92203, 99733, 107897, 116731, 126271, 136607, 147793, 159871, 172933),
    *(187091, 202409, 218971, 236897, 256279, 277261, 299951, 324503, 351061, 379787, 410857),
    *(444487, 480881, 520241, 562841, 608903, 658753, 712697, 771049, 834181, 902483, 976369),
)


class Followers:
    """The tokens seen after one n-gram and how often (common_ngram_cache_part, a libstdc++
    ``unordered_map<llama_token, int32_t>``), kept in that map's iteration order: a new key goes
    before the first key of its bucket (``key % buckets``), or first of all when its bucket is
    empty; a rehash re-inserts every key in the old order by the same rule."""

    __slots__ = ("order", "counts", "buckets", "next_resize")

    def __init__(self) -> None:
        self.order: list[int] = []
        self.counts: dict[int, int] = {}
        self.buckets = 1
        self.next_resize = 0

    def add(self, token: int) -> None:
        if token in self.counts:
            self.counts[token] += 1
            return
        n = len(self.order)
        if n + 1 > self.next_resize:  # _Prime_rehash_policy::_M_need_rehash (load factor 1)
            least = max(n + 1, 0 if self.next_resize else 11)
            if least >= self.buckets:
                self._rehash(self._next_buckets(max(least + 1, self.buckets * 2)))
            else:
                self.next_resize = self.buckets
        self._insert(self.order, token)
        self.counts[token] = 1

    def _next_buckets(self, n: int) -> int:
        if n < len(_FAST_BUCKETS):
            self.next_resize = _FAST_BUCKETS[n]
            return _FAST_BUCKETS[n]
        size = next(p for p in _PRIMES if p >= n)
        self.next_resize = size
        return size

    def _insert(self, order: list[int], token: int) -> None:
        bucket = token % self.buckets
        for i, key in enumerate(order):
            if key % self.buckets == bucket:
                order.insert(i, token)
                return
        order.insert(0, token)

    def _rehash(self, buckets: int) -> None:
        self.buckets = buckets
        old, self.order = self.order, []
        for key in old:
            self._insert(self.order, key)


def _cache_update(cache: dict[tuple[int, ...], Followers], tokens: Sequence[int]) -> None:
    """common_ngram_cache_update over ``tokens`` alone: each n-gram of 1..4 of them, the token
    after it counted."""
    for size in range(NGRAM_MIN, NGRAM_MAX + 1):
        for i in range(size, len(tokens)):
            gram = tuple(tokens[i - size : i])
            followers = cache.get(gram)
            if followers is None:
                followers = cache[gram] = Followers()
            followers.add(tokens[i])


def _cache_try(cache: dict[tuple[int, ...], Followers], grams: list[tuple[int, ...]]) -> int:
    """try_draft over the context cache (no static cache: every follower weighs the same):
    the longest n-gram first, its most frequent follower (the first in the map's order among
    equals) if it was seen often enough and holds its share; -1 when none does."""
    for i in range(len(grams) - 1, -1, -1):
        followers = cache.get(grams[i])
        if followers is None:
            continue
        best, best_count, total = -1, 0, 0
        for token in followers.order:
            count = followers.counts[token]
            if count > best_count:
                best, best_count = token, count
            total += count
        if total < LAX_MIN_SAMPLES[i] or 100 * best_count < LAX_MIN_PERCENT[i] * total:
            continue
        return best
    return -1


@dataclass
class NgramCache:
    """llama-server's ``--spec-type ngram-cache`` without lookup files (common_speculative_impl_
    ngram_cache): per slot, a cache from each n-gram of 1..4 tokens to the tokens that followed
    it, grown from the history's new tokens at each draft (an n-gram across the previous edge is
    not added; a history shorter than what was added adds nothing until it is longer again),
    kept across requests. A draft of up to 8 tokens takes, token by token, the most frequent
    follower of the longest n-gram that has a clear one."""

    n_draft: int = CACHE_DRAFT
    slots: dict[int, tuple[list[int], dict[tuple[int, ...], Followers]]] = field(
        init=False, default_factory=dict
    )

    def begin(self, slot: int, prompt: Sequence[int]) -> None:
        pass

    def draft(self, slot: int, tokens: Sequence[int], sampled: int) -> list[int]:
        size, cache = self.slots.setdefault(slot, ([0], {}))
        if size[0] < len(tokens) + 1:
            _cache_update(cache, [*tokens[size[0] :], sampled])
            size[0] = len(tokens) + 1
        n = len(tokens) + 1  # the history with the sampled token
        if n < 2:  # LLAMA_NGRAM_STATIC
            return []
        recent = [*tokens[-(NGRAM_MAX - 1) :], sampled]  # all an n-gram reaches back to
        draft: list[int] = []
        while len(draft) < self.n_draft:
            tail = recent + draft
            # an n-gram longer than the history (a prompt of one token) matches nothing
            grams = [
                tuple(tail[len(tail) - k :]) if n + len(draft) >= k else (-1,) * k
                for k in range(NGRAM_MIN, NGRAM_MAX + 1)
            ]
            token = _cache_try(cache, grams)
            if token < 0:
                break
            draft.append(token)
        return draft

    def accept(self, slot: int, n_accepted: int, is_other: bool) -> None:
        pass


# --- ngram-mod ----------------------------------------------------------------------------------

_MIX_INT = 6364136223846793005  # common_ngram_mod::idx's multiplier, on size_t (64 bits)
_MIX = numpy.uint64(_MIX_INT)
_U64 = (1 << 64) - 1
MOD_ENTRIES = 4 * 1024 * 1024  # llama-server's table: 4Mi tokens, shared by every slot
EMPTY = -1


@dataclass
class NgramMod:
    """llama-server's ``--spec-type ngram-mod`` (common_speculative_impl_ngram_mod): one table
    for the whole server, kept across requests, from the hash of ``n_match`` tokens to the token
    that last followed them. A slot's prompt is added when it is evaluated (``begin``), its
    answer in chunks of 32 as it grows; a draft follows the table from the last ``n_match``
    tokens for up to ``n_max`` tokens, and is none if it stops before ``n_min``. Five checks in
    a row that accept under a quarter of their draft empty the table."""

    n_match: int = 24
    n_max: int = 64
    n_min: int = 48
    size: int = MOD_ENTRIES
    entries: numpy.ndarray = field(init=False, repr=False)
    used: int = field(init=False, default=0)
    # per slot: where the table's additions stopped, the last draft's length, the low streak
    slots: dict[int, list[int]] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self.entries = numpy.full(self.size, EMPTY, numpy.int32)

    def _state(self, slot: int) -> list[int]:
        return self.slots.setdefault(slot, [0, 0, 0])  # i_last, n_draft_last, n_low

    def _indices(self, tokens: numpy.ndarray) -> numpy.ndarray:
        """common_ngram_mod::idx of every n_match-token window of ``tokens`` (uint64, wrapping)."""
        n = self.n_match
        windows = len(tokens) - n + 1
        res = numpy.zeros(windows, numpy.uint64)
        with numpy.errstate(over="ignore"):
            for k in range(n):
                res = res * _MIX + tokens[k : k + windows].astype(numpy.uint64)
        return (res % numpy.uint64(self.size)).astype(numpy.int64)

    def _index(self, window: Sequence[int]) -> int:
        """common_ngram_mod::idx of one window, in plain integers (a draft asks up to n_max
        of them, one at a time)."""
        res = 0
        for token in window:
            res = (res * _MIX_INT + token) & _U64
        return res % self.size

    def _add(self, tokens: Sequence[int], start: int, stop: int) -> None:
        """add() for the windows starting at start..stop-1: each maps to the token after it,
        in order (a later window overwrites an earlier one in the same entry)."""
        if stop <= start:
            return
        window = numpy.asarray(tokens[start : stop + self.n_match], numpy.int64)
        idx = self._indices(window[:-1])
        fresh = numpy.unique(idx[self.entries[idx] == EMPTY])
        self.used += int(fresh.size)
        self.entries[idx] = window[self.n_match :].astype(numpy.int32)  # the last one wins

    def reset(self) -> None:
        self.entries.fill(EMPTY)
        self.used = 0

    def begin(self, slot: int, prompt: Sequence[int]) -> None:
        state = self._state(slot)
        state[0] = state[1] = 0
        n = self.n_match
        if len(prompt) < n:
            return
        self._add(prompt, 0, len(prompt) - n)
        state[0] = len(prompt) - n
        if self.used / self.size > 0.25:  # too full to be told apart: start again
            self.reset()

    def draft(self, slot: int, tokens: Sequence[int], sampled: int) -> list[int]:
        state = self._state(slot)
        state[1] = 0
        n, cur_len = self.n_match, len(tokens)
        if cur_len < n:
            return []
        if state[0] + 32 < cur_len:  # the answer's n-grams, in chunks
            self._add(tokens, state[0], cur_len - n)
            state[0] = cur_len - n
        key = [*tokens[cur_len - n + 1 :], sampled]
        out: list[int] = []
        for i in range(self.n_max):
            token = int(self.entries[self._index(key[i : i + n])])
            if token == EMPTY:
                if i < self.n_min:
                    return []
                break
            key.append(token)
            out.append(token)
        state[1] = len(out)
        return out

    def accept(self, slot: int, n_accepted: int, is_other: bool) -> None:
        if is_other:
            return
        state = self._state(slot)
        if state[1] > 0:
            if n_accepted / state[1] < 0.25:
                state[2] += 1
                if state[2] >= 5:
                    self.reset()
                    state[0] = state[2] = 0
            else:
                state[2] = 0


class Drafter(Protocol):
    def begin(self, slot: int, prompt: Sequence[int]) -> None: ...

    def draft(self, slot: int, tokens: Sequence[int], sampled: int) -> list[int]: ...

    def accept(self, slot: int, n_accepted: int, is_other: bool) -> None: ...


class Speculative:
    """The server's drafters (common_speculative): in llama-server's order of preference, the
    first that drafts for a step gives its draft, cut to ``draft_limit``; the check's accepted
    count goes to that drafter (``accept``), the others hear of it as ``is_other``."""

    def __init__(self, drafters: Sequence[Drafter]):
        self.drafters = list(drafters)
        self._last: dict[int, Drafter] = {}  # per slot: the drafter of its last draft

    def begin(self, slot: int, prompt: Sequence[int]) -> None:
        """The slot's prompt is evaluated (common_speculative_begin)."""
        for drafter in self.drafters:
            drafter.begin(slot, prompt)

    def draft(self, slot: int, tokens: Sequence[int], sampled: int, limit: int) -> list[int]:
        for drafter in self.drafters:
            found = drafter.draft(slot, tokens, sampled)
            if found:
                self._last[slot] = drafter
                return found[:limit]
        return []

    def accept(self, slot: int, n_accepted: int) -> None:
        last = self._last.get(slot)
        if last is None:
            return
        last.accept(slot, n_accepted, False)
        for drafter in self.drafters:
            if drafter is not last:
                drafter.accept(slot, n_accepted, True)


def drafters(kinds: dict[str, dict[str, int]] | None) -> Speculative | None:
    """The server's drafters from its flags ({kind: sizes}, serving.llama_flags), in
    llama-server's order of preference; None without speculative decoding."""
    if not kinds:
        return None
    made: list[Drafter] = []
    if "ngram-simple" in kinds:
        made.append(NgramSimple(**kinds["ngram-simple"]))
    if "ngram-map-k" in kinds:
        made.append(NgramMap(key_only=True, **kinds["ngram-map-k"]))
    if "ngram-map-k4v" in kinds:
        made.append(NgramMap(key_only=False, **kinds["ngram-map-k4v"]))
    if "ngram-mod" in kinds:
        made.append(NgramMod(**kinds["ngram-mod"]))
    if "ngram-cache" in kinds:
        made.append(NgramCache())
    return Speculative(made)
