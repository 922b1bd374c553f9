"""A short explanation for a failed ``==`` between large values.

pytest explains a failed comparison by diffing the values' reprs; with ``CI`` set (or ``-v``)
it diffs them in full with ``difflib.ndiff``, whose time grows with the square of the lines'
lengths: on megabytes of bytes or long lists a failing test then runs for hours instead of
failing. conftest's ``pytest_assertrepr_compare`` hook answers first with this explanation
when the values' reprs are long, so a failure is reported at once, naming where the values
first differ.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

# reprs longer than this (together) are not diffed
LONG_REPR = 20_000
_SHOWN = 120  # characters of each side shown around the first difference


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _SHOWN else text[:_SHOWN] + f"... ({len(text)} chars)"


def _first_difference(left: Any, right: Any) -> list[str]:
    if isinstance(left, Mapping) and isinstance(right, Mapping):
        keys = sorted(set(left) ^ set(right), key=repr)
        if keys:
            return [f"keys in one only: {_short(keys)}"]
        for key in left:
            if left[key] != right[key]:
                return [f"first different key {key!r}: {_short(left[key])} != {_short(right[key])}"]
        return []
    if (
        isinstance(left, Sequence | bytes)
        and isinstance(right, Sequence | bytes)
        and not isinstance(left, str)
    ):
        for i, (a, b) in enumerate(zip(left, right)):
            if a != b:
                return [f"first difference at index {i}: {_short(a)} != {_short(b)}"]
        return [f"lengths {len(left)} and {len(right)}, equal up to the shorter"]
    a, b = repr(left), repr(right)
    i = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    start = max(0, i - 20)
    return [f"reprs first differ at character {i}: {a[start : i + 60]!r} != {b[start : i + 60]!r}"]


def explain(op: str, left: Any, right: Any) -> list[str] | None:
    """For ``==`` between values whose reprs are long together: a few lines (their types and
    sizes, where they first differ); None otherwise (pytest's own explanation)."""
    if op != "==":
        return None
    sizes = len(repr(left)), len(repr(right))
    if sum(sizes) <= LONG_REPR:
        return None
    head = (
        f"{type(left).__name__} == {type(right).__name__} "
        f"(reprs of {sizes[0]} and {sizes[1]} characters: not diffed)"
    )
    return [head, *_first_difference(left, right)]
