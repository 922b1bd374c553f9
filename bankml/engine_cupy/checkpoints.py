"""llama-server's context checkpoints, for models with sliding-window layers (gemma3).

llama.cpp's SWA cache forgets positions that fell out of the window, so llama-server cannot
always keep a cached prefix: it saves the SWA cache's cells at a few points of each prompt
("context checkpoints") and, when a later prompt shares a prefix the cache no longer holds the
window of, restores the newest usable checkpoint or evaluates the prompt again from 0
(tools/server/server-context.cpp: the prefix reuse in the slot's start, the prompt batch loop,
``create_checkpoint``). Where it ends its prompt batches to take them decides which attention
kernel each token meets, so the engine cuts its batches at the same places.

This module holds those rules; the KV cache keeps every position anyway, so a checkpoint is only
the SWA ring's layout (``KVCache.ring_positions``): restoring it means "the ring as it was then,
positions from its n_tokens on computed again".
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

N_CTX_CHECKPOINTS = 32  # common_params::n_ctx_checkpoints (--ctx-checkpoints)
CHECKPOINT_MIN_STEP = 8192  # common_params::checkpoint_min_step (--checkpoint-min-step)
N_BATCH = 2048  # llama-server's -b: the most prompt tokens in one llama_decode
N_UBATCH = 512  # -ub: llama_decode splits a batch into micro-batches of this many tokens
END_OFFSETS = (4 + N_UBATCH, 4)  # checkpoint_offsets: batches end this many tokens before the end

# the sample messages common/chat-diff-analyzer.cpp renders to find the role markers
USER_MSG = "U_USER_MSG Hello END_U"
USER_MSG_TWO = "V_USER_MSG Hello END_V"
ASSISTANT_MSG = "A_ASST_MSG I can help END_A"


@dataclass
class Checkpoint:
    """common_prompt_checkpoint: taken before the batch that starts at ``n_tokens``."""

    n_tokens: int
    pos_min: int
    pos_max: int
    task: int
    ring: Any = None  # the SWA ring's positions in cell order (None without a ring)
    # the sliding layers' K/V at those positions (KVCache.window_values), copied only once the
    # slot's position store is to be overwritten while this checkpoint stays (an embedding);
    # None: the store still holds them
    values: Any = None
    nbytes: int = 0  # what llama-server's checkpoint holds (KVCache.state_nbytes, window_only)


@dataclass
class MessageSpans:
    """common_chat_msg_spans, reduced to what the batch loop reads: user-message starts."""

    user_starts: frozenset[int] = frozenset()

    @property
    def last_user(self) -> int:
        return max(self.user_starts, default=-1)

    def is_user_start(self, pos: int) -> bool:
        return pos in self.user_starts


def find_spans(
    tokens: Sequence[int], delimiters: Sequence[tuple[str, Sequence[int]]]
) -> MessageSpans:
    """common_chat_msg_delimiters::split: at each token, the first delimiter (assistant before
    user, as the server lists them) whose tokens start there marks a message."""
    starts: list[int] = []
    if not delimiters:
        return MessageSpans()
    for i in range(len(tokens)):
        for role, ids in delimiters:
            if list(tokens[i : i + len(ids)]) == list(
                ids
            ):  # an empty one matches anywhere, as there
                if role == "user":
                    starts.append(i)
                break
    return MessageSpans(frozenset(starts))


def batch_end(
    start: int,
    n_prompt: int,
    spans: MessageSpans,
    checkpoints: list[Checkpoint],
    min_step: int = CHECKPOINT_MIN_STEP,
) -> int:
    """Where llama-server ends the prompt batch that starts at ``start``: at most N_BATCH tokens,
    at the last user message's start or another one far enough past the last checkpoint, and
    516 and 4 tokens before the prompt's end."""
    pos = start
    while pos < n_prompt and pos - start < N_BATCH:
        pos += 1
        if spans.is_user_start(pos) and (
            pos == spans.last_user or not checkpoints or pos > checkpoints[-1].n_tokens + min_step
        ):
            break
        if any(n_prompt == pos + min(N_BATCH, k) for k in END_OFFSETS):
            break
    return pos


def takes_checkpoint(
    start: int,
    end: int,
    n_prompt: int,
    pos_min: int,
    spans: MessageSpans,
    checkpoints: list[Checkpoint],
    min_step: int = CHECKPOINT_MIN_STEP,
) -> bool:
    """Whether llama-server saves a checkpoint before decoding the batch [start, end)."""
    near_end = n_prompt < end + N_UBATCH
    if end < n_prompt and not spans.is_user_start(start) and not near_end:
        return False  # an ordinary mid-prompt batch
    if pos_min < 0:
        return False  # nothing to save yet
    return (
        not checkpoints
        or start == spans.last_user
        or near_end
        or start > checkpoints[-1].n_tokens + min_step
    )


@dataclass
class Checkpoints:
    """A slot's checkpoints, oldest first, under llama-server's default limits."""

    window: int
    n_max: int = N_CTX_CHECKPOINTS
    min_step: int = CHECKPOINT_MIN_STEP
    items: list[Checkpoint] = field(default_factory=list)

    def create(
        self, n_tokens: int, pos_min: int, pos_max: int, task: int, ring: Any, nbytes: int = 0
    ) -> None:
        """create_checkpoint: once the list is (nearly) full, drop other tasks' checkpoints
        within min_step of an earlier one, then the oldest; one per n_tokens."""
        kept: list[Checkpoint] = []
        last = -1
        for i, c in enumerate(self.items):
            full = len(kept) + len(self.items) - i + 1 >= self.n_max
            if full and c.task != task and last >= 0 and c.n_tokens <= last + self.min_step:
                continue
            kept.append(c)
            last = c.n_tokens
        while len(kept) >= self.n_max:
            kept.pop(0)
        kept = [c for c in kept if c.n_tokens != n_tokens]
        kept.append(Checkpoint(n_tokens, pos_min, pos_max, task, ring, nbytes=nbytes))
        self.items = kept

    def reuse(
        self,
        n_past: int,
        n_prompt: int,
        n_slot: int,
        pos_min: int,
        restore: Callable[[Any, Any], None],
    ) -> int:
        """The slot's start: how many cached tokens a prompt keeps. When the cache no longer
        holds the window of the shared prefix (its pos_min is past pos_next - n_swa), the newest
        checkpoint early enough is restored (``restore(ring, values)``) and the prefix is cut to it, or
        the prompt is evaluated from 0; checkpoints past the kept prefix are then erased."""
        pos_next = n_past
        threshold = max(0, pos_next - self.window - (0 if n_past < n_prompt else 1))
        if 0 < n_past <= n_slot and pos_min >= threshold:
            usable = [
                c
                for c in self.items
                if c.pos_max <= pos_next and (c.pos_min < threshold or c.pos_min == 0)
            ]
            if usable:
                c = usable[-1]
                restore(c.ring, c.values)
                pos_next = min(pos_next, max(c.pos_min + 1, c.pos_max))
                n_past = min(pos_next, c.n_tokens)
            else:
                pos_next = n_past = 0
        self.items = [c for c in self.items if c.pos_max <= pos_next]
        return n_past

    def clear(self) -> None:
        self.items = []


# --- the role markers llama-server's template analysis finds (common/chat-diff-analyzer.cpp) ---


def _segments(text: str) -> list[tuple[bool, str]]:
    """segmentize_markers: (is_marker, text) pieces, a marker being <...> or [...]."""
    pieces = re.findall(r"<[^>]*>|\[[^\]]*\]|[<\[].*|[^<\[]+", text, re.DOTALL)
    return [((p[0], p[-1]) in (("<", ">"), ("[", "]")) and len(p) > 1, p) for p in pieces]


def _added(left: str, right: str) -> str:
    """The part of ``right`` that ``left`` lacks, compared segment by segment from both ends
    (calculate_diff_split's right; when ``left`` begins ``right``, the rest of it)."""
    if right.startswith(left):
        return right[len(left) :]
    a, b = _segments(left), _segments(right)
    i = 0
    while i < len(a) and i < len(b) and a[i] == b[i]:
        i += 1
    j = 0
    while j < len(a) - i and j < len(b) - i and a[-1 - j] == b[-1 - j]:
        j += 1
    return "".join(t for _, t in b[i : len(b) - j])


def _render_diff(render: Callable[..., str], before: list[dict], after: list[dict]) -> str | None:
    try:
        return _added(
            render(before, add_generation_prompt=False), render(after, add_generation_prompt=False)
        )
    except Exception:  # a template that refuses these messages: no marker, as llama-server
        return None


def user_start_marker(render: Callable[..., str]) -> str:
    """detect_user_start_marker: what a template puts before a user message's text."""
    user = {"role": "user", "content": USER_MSG}
    added = _render_diff(render, [], [user])
    if added is None:
        first = [
            {"role": "user", "content": USER_MSG_TWO},
            {"role": "assistant", "content": ASSISTANT_MSG},
        ]
        added = _render_diff(render, first, first + [user])
        if added is None:
            return ""
    if ASSISTANT_MSG in added:
        added = added[added.index(ASSISTANT_MSG) + len(ASSISTANT_MSG) :]
    candidate = added.split(USER_MSG)[0]
    out, seen_marker = [], False
    for is_marker, text in _segments(candidate):
        lower = text.lower()
        if is_marker and not seen_marker and ("end" in lower or "close" in lower):
            continue  # an end marker of the previous message
        if not is_marker and not seen_marker and not text.strip():
            continue
        seen_marker |= is_marker
        out.append(text)
    return "".join(out).strip()


def assistant_start_marker(render: Callable[..., str]) -> str:
    """detect_assistant_start_marker: what a template puts before an assistant message."""
    user = {"role": "user", "content": USER_MSG}
    added = _render_diff(render, [user], [user, {"role": "assistant", "content": ASSISTANT_MSG}])
    if not added:
        return ""
    return added.split(ASSISTANT_MSG)[0].strip()
