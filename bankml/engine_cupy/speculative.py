"""Speculative decoding without a draft model, as llama-server's ``--spec-type ngram-simple``.

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
from dataclasses import dataclass
from typing import Any

SPEC_TYPES = ("ngram-simple",)  # the kinds bankml follows (llama-server has more)


@dataclass(frozen=True)
class NgramSimple:
    """``--spec-ngram-simple-size-n`` / ``-size-m`` (llama-server's defaults, 12 and 48)."""

    size_n: int = 12  # the n-gram looked up in the history
    size_m: int = 48  # the most tokens drafted after a match


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
