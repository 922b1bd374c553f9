"""The reasoning budget: at most N tokens inside a reasoning block, then its end forced.

llama.cpp's reasoning-budget sampler (common/reasoning-budget.cpp), as common_sampler puts it in
front of the chain: it watches the tokens drawn (and the generation prompt's, before the first
draw) for a start sequence, counts the tokens after it, and when the budget is spent forces a
fixed token sequence (the budget message and the first end tag) one token at a time by setting
every other logit to -inf. A natural end sequence ends the count; a later start sequence arms it
again. Sequences are matched on token ids (an Aho-Corasick automaton over the sequences, the
longest one ending at a token wins), not on text.

States, as llama.cpp names them: IDLE (waiting for a start), COUNTING, WAITING_UTF8 (the budget is
spent but the last token left a UTF-8 character unfinished: one more token may finish it),
FORCING, DONE (free until a new start).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

IDLE, COUNTING, FORCING, WAITING_UTF8, DONE = (
    "idle",
    "counting",
    "forcing",
    "waiting_utf8",
    "done",
)
INT_MAX = 2_147_483_647


@dataclass(frozen=True)
class ReasoningBudgetSpec:
    """A request's budget settings, as common_params_sampling holds them: ``tokens`` (-1: no
    limit), the start sequence, the end sequences (the first is the one forced), the forced
    sequence (message and first end tag; empty when the request named no message) and
    ``control`` (the sampler exists even without a limit, so a run could be ended on demand)."""

    tokens: int = -1
    start: tuple[int, ...] = ()
    end: tuple[tuple[int, ...], ...] = ()
    forced: tuple[int, ...] = ()
    control: bool = False

    def active(self, grammar_lazy: bool) -> bool:
        """common_sampler_init's condition for creating the sampler."""
        return (
            bool(self.start)
            and bool(self.end)
            and (grammar_lazy or self.tokens >= 0 or self.control)
        )


class TokenMatcher:
    """Several token sequences watched at once (llama.cpp's token_matcher over common_trie's
    Aho-Corasick automaton): ``advance`` returns the index of the longest sequence that ends at
    this token, and starts over after a match."""

    def __init__(self, seqs: Sequence[Sequence[int]]):
        self.seqs: list[tuple[int, ...]] = []
        for seq in seqs:
            t = tuple(seq)
            if t and t not in self.seqs:
                self.seqs.append(t)
        self._children: list[dict[int, int]] = [{}]
        pattern: list[int] = [-1]
        for index, seq in enumerate(self.seqs):
            node = 0
            for tok in seq:
                nxt = self._children[node].get(tok)
                if nxt is None:
                    nxt = len(self._children)
                    self._children[node][tok] = nxt
                    self._children.append({})
                    pattern.append(-1)
                node = nxt
            if pattern[node] < 0:
                pattern[node] = index
        n = len(self._children)
        self._fail = [0] * n
        order: list[int] = []
        queue = deque([0])
        while queue:
            u = queue.popleft()
            order.append(u)
            for tok, v in sorted(self._children[u].items()):
                if u != 0:
                    f = self._fail[u]
                    while f and tok not in self._children[f]:
                        f = self._fail[f]
                    to = self._children[f].get(tok)
                    self._fail[v] = to if to is not None and to != v else 0
                queue.append(v)
        self._match = [-1] * n
        for u in order:
            self._match[u] = (
                pattern[u] if pattern[u] >= 0 else (self._match[self._fail[u]] if u else -1)
            )
        self.state = 0

    def _next(self, state: int, tok: int) -> int:
        while state and tok not in self._children[state]:
            state = self._fail[state]
        return self._children[state].get(tok, 0)

    def advance(self, token: int) -> int:
        self.state = self._next(self.state, token)
        found = self._match[self.state]
        if found >= 0:
            self.state = 0
        return found

    def reset(self) -> None:
        self.state = 0


def utf8_is_complete(piece: bytes) -> bool:
    """common_utf8_is_complete: whether the piece does not end inside a UTF-8 character (only
    continuation bytes in its last four: not complete)."""
    n = len(piece)
    if n == 0:
        return True
    for back in range(1, min(4, n) + 1):
        c = piece[n - back]
        if c & 0xC0 != 0x80:
            expected = 4 if c >= 0xF0 else 3 if c >= 0xE0 else 2 if c >= 0xC0 else 1
            return back >= expected
    return False


class ReasoningBudget:
    """One run's budget sampler: ``accept`` every generated token (and the generation prompt's),
    ``apply`` to the logits before the chain."""

    def __init__(
        self,
        start: Sequence[Sequence[int]],
        end: Sequence[Sequence[int]],
        forced: Sequence[int],
        budget: int,
        piece: Callable[[int], bytes] | None = None,
        state: str = IDLE,
    ):
        """common_reasoning_budget_init: any of ``start`` arms the count, any of ``end`` ends
        it, ``forced`` is forced when ``budget`` tokens are spent. ``piece``: a token's text
        (token_to_piece(special=false)) for the UTF-8 check; without it every token counts as
        complete. A COUNTING start with no budget starts FORCING."""
        self.start = TokenMatcher(start)
        self.end = TokenMatcher(end)
        self.forced = tuple(forced)
        self.budget = budget
        self.remaining = budget
        self.piece = piece
        self.state = FORCING if state == COUNTING and budget <= 0 else state
        self.force_pos = 0
        self.end_match = -1

    @classmethod
    def of(cls, spec: ReasoningBudgetSpec, piece: Callable[[int], bytes] | None) -> ReasoningBudget:
        """A request's budget sampler (common_sampler_init: no limit is INT_MAX tokens)."""
        budget = INT_MAX if spec.tokens < 0 else spec.tokens
        return cls([spec.start], spec.end, spec.forced, budget, piece)

    def _arm(self) -> None:
        self.state = COUNTING
        self.remaining = self.budget
        if self.remaining <= 0:
            self.state = FORCING
            self.force_pos = 0

    def accept(self, token: int) -> None:
        state = self.state
        if state == IDLE:
            if self.start.advance(token) >= 0:
                self._arm()
        elif state in (COUNTING, WAITING_UTF8):
            match = self.end.advance(token)
            if match >= 0:
                self.state = DONE
                self.end_match = match
                return
            complete = utf8_is_complete(self.piece(token)) if self.piece is not None else True
            if state == WAITING_UTF8:
                if complete:
                    self.state = FORCING
                    self.force_pos = 0
                    self.end.reset()
            else:
                self.remaining -= 1
                if self.remaining <= 0:
                    self.state = FORCING if complete else WAITING_UTF8
                    self.force_pos = 0 if complete else self.force_pos
                    self.end.reset()
        elif state == FORCING:
            # the end sequence is tracked inside the forced tokens too, to report it on DONE
            match = self.end.advance(token)
            self.force_pos += 1
            if self.force_pos >= len(self.forced):
                self.state = DONE
                self.end_match = match
        elif self.start.advance(token) >= 0:  # DONE: a new start arms a fresh budget
            self.end.reset()
            self.end_match = -1
            self._arm()

    def forced_token(self) -> int | None:
        """The token the next draw must be, or None when the logits pass untouched."""
        if self.state != FORCING or self.force_pos >= len(self.forced):
            return None
        return self.forced[self.force_pos]

    def apply(self, logits: np.ndarray) -> np.ndarray:
        """The logits the chain sees: all -inf but the forced token's while forcing (a copy), else
        the same array."""
        forced = self.forced_token()
        if forced is None:
            return logits
        out = np.full(len(logits), -np.inf, dtype=np.float32)
        if 0 <= forced < len(logits):
            out[forced] = logits[forced]
        return out

    def end_sequence(self) -> tuple[int, ...] | None:
        """The end sequence that brought the sampler to DONE (None if none was seen)."""
        return self.end.seqs[self.end_match] if self.end_match >= 0 else None

    def force(self) -> bool:
        """common_reasoning_budget_force: end a counting budget now (True if it was counting)."""
        if self.state != COUNTING:
            return False
        self.state = FORCING
        self.force_pos = 0
        self.end.reset()
        return True
