"""Speculative decoding without a draft model, as llama-server's ``--spec-type ngram-simple``
and ``ngram-mod`` (the latter: ``NgramMod``, one table for the server).

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
    if "ngram-mod" in kinds:
        made.append(NgramMod(**kinds["ngram-mod"]))
    return Speculative(made)
