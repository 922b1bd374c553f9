"""Which micro-batches are computed together: the plan of one iteration's forward passes.

Each run asks for one micro-batch a step (a ``Forward``: one decode token, or one prompt
micro-batch of at most 512). An iteration of several slots' runs is planned at two levels,
both here:

- ``passes_of`` cuts the iteration into groups of at most ``BATCH_ROWS`` tokens (llama-server's
  ``-b``, its batch of all the slots' tokens): every decode step in the first group, each
  prompt micro-batch in slot order in the first group it fits. Each group is one
  ``Model.forward_batch`` call; a group whose pass fails fails only its own runs.
- ``pass_groups`` is how ``forward_batch`` runs one group: where the model shares passes
  (``Model.shares_passes``), the prompt chunks fill passes in order while a pass holds at most
  ``SHARED_PASS_ROWS`` rows (a longer chunk alone) and the decode steps ride in the first;
  otherwise, and with no prompt chunk, the decode steps are one batched step and each chunk
  its own pass. ``forward_batch`` returns its logits as ``PassLogits``, which name the passes
  it ran, so that whoever counts passes counts what was computed.
- ``hidden_passes`` is how ``Model.hidden_states_batch`` runs one request's embedding inputs:
  in order, those of at most ``SHARED_INPUT_ROWS`` tokens as many as fit ``SHARED_PASS_ROWS``
  rows a pass where the model shares passes; a longer input, and every input of a model that
  does not share passes, alone.

Nothing here changes what a sequence computes: each sequence of a pass is the bits of its own
forward pass (model.md); the plan decides only how many passes read the weights.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, TypeVar

__all__ = [
    "BATCH_ROWS",
    "SHARED_INPUT_ROWS",
    "SHARED_PASS_ROWS",
    "PassLogits",
    "hidden_passes",
    "pass_groups",
    "passes_of",
]

BATCH_ROWS = 2048  # llama-server's -b: the most tokens of one forward_batch call (all slots')
# The most rows a shared pass of several prompt chunks takes: on a 2-core AMD EPYC with the
# default model four chunks in one pass ran 1.21-1.30x faster than apart at 32-128 rows in all
# and 0.79-0.90x at 256-2048 (model.md, "The shared pass"). The decode steps join the first
# pass whatever its rows: beside one chunk of 13-512 rows they measured even. With the 1B-shaped
# Q4_K_M model (2026-12-07) four chunks in one pass: 1.20x at 128 rows, 1.05x at 256, 0.91x at
# 512: the same bound holds for K-quant files.
SHARED_PASS_ROWS = 128
# The longest embedding input that shares a pass (``hidden_passes``): with the default model
# (2-core AMD EPYC, 2026-12-05) 16 inputs of 4, 16 and 32 tokens in shared passes took 1.7x,
# 1.55x and 1.33x less time than one after the other, of 64 tokens 0.96x (their products are
# already the tiles' work), MiniLM's likewise (embeddings.md).
SHARED_INPUT_ROWS = 32


class MicroBatch(Protocol):
    """What the plan reads of a step (engine ``Forward``): its tokens, and whether it is a
    decode step (one token)."""

    tokens: list[int]

    @property
    def decode(self) -> bool: ...


F = TypeVar("F", bound=MicroBatch)


def passes_of(forwards: Sequence[F], budget: int = BATCH_ROWS) -> list[list[F]]:
    """One iteration's forward passes in groups, each one ``forward_batch`` call: every decode
    step (``.decode``) in the first group, and the prompt micro-batches (``.tokens``) in slot
    order, each in the first group of at most ``budget`` tokens it fits (a micro-batch is at
    most 512, so each fits one). In the first group the model takes the decode steps into a
    pass with prompt chunks where it shares passes (``pass_groups``), else they are one
    batched step."""
    decodes = [f for f in forwards if f.decode]
    groups: list[list[F]] = [decodes]
    room = [budget - len(decodes)]
    for f in forwards:
        if f.decode:
            continue
        n = len(f.tokens)
        for i, left in enumerate(room):
            if n <= left:
                groups[i].append(f)
                room[i] -= n
                break
        else:
            groups.append([f])
            room.append(budget - n)
    return [group for group in groups if group]


def pass_groups(sizes: Sequence[int], shares: bool) -> list[list[int]]:
    """The passes ``forward_batch`` makes of micro-batches of ``sizes`` tokens (their indices,
    a list a pass). Where the model ``shares`` passes, the prompt chunks fill passes in order
    while one holds at most ``SHARED_PASS_ROWS`` rows (a longer chunk alone), and the decode
    steps join the first; otherwise, and with no prompt chunk, the decode steps are one pass
    (a batched step) and each chunk its own."""
    single = [i for i, n in enumerate(sizes) if n == 1]
    longer = [i for i, n in enumerate(sizes) if n > 1]
    if not shares or not longer:
        return ([single] if single else []) + [[i] for i in longer]
    groups: list[list[int]] = []
    rows = SHARED_PASS_ROWS + 1
    for i in longer:
        n = sizes[i]
        if rows + n > SHARED_PASS_ROWS:
            groups.append([])
            rows = 0
        groups[-1].append(i)
        rows += n
    groups[0] = single + groups[0]
    return groups


def hidden_passes(
    sizes: Sequence[int],
    n_ubatch: int,
    shares: bool,
    rows: int = SHARED_PASS_ROWS,
    longest: int = SHARED_INPUT_ROWS,
) -> list[list[int]]:
    """The passes of several inputs of ``sizes`` tokens whose every row is kept (embeddings):
    where the model ``shares`` passes, the inputs of at most ``longest`` tokens fill passes in
    order while a pass holds at most ``rows`` rows; a longer input (over ``n_ubatch``:
    computed in micro-batches of its own) is a pass alone, as is every input otherwise."""
    if not shares:
        return [[i] for i in range(len(sizes))]
    groups: list[list[int]] = []
    held = rows + 1
    for i, n in enumerate(sizes):
        if n > min(rows, longest, n_ubatch):
            groups.append([i])
            held = rows + 1
            continue
        if held + n > rows:
            groups.append([])
            held = 0
        groups[-1].append(i)
        held += n
    return groups


class PassLogits(list[Any]):
    """``forward_batch``'s answer: the logits of each sequence, in the order given, and
    ``passes``, the passes that computed them (``pass_groups``' index lists)."""

    def __init__(self, logits: Sequence[Any], passes: list[list[int]]) -> None:
        super().__init__(logits)
        self.passes = passes
