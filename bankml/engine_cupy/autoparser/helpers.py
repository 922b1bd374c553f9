"""The text tools of llama.cpp's differential template analysis (common/chat-auto-parser-helpers.cpp).

* whitespace trimming as C's ``isspace`` sees whitespace (ASCII only);
* ``segmentize_markers``: a text cut into markers (``<...>`` or ``[...]``) and the text between;
* ``calculate_diff_split``: two renders split into common prefix, common suffix and the two
  differing middles, the prefix and suffix ending on whole markers;
* ``until_common_prefix`` / ``after_common_suffix``;
* ``compare_variants``: render a template twice, the second time with the parameters changed,
  and split the two renders.

The analysis also matches a handful of small patterns on rendered text, each a tagged PEG parser
(bankml.engine_cupy.peg) run once: ``match_tags`` from the start, ``search_tags`` from the first
position where it matches.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from bankml.engine_cupy.peg.chat import build_tagged_peg_parser
from bankml.engine_cupy.peg.parser import Parser, ParserBuilder

if TYPE_CHECKING:
    from bankml.engine_cupy.chat_template import ChatTemplate

_SPACE_CHARS = " \t\n\v\f\r"

# ---------------------------------------------------------------------------------------------
# Whitespace
# ---------------------------------------------------------------------------------------------


def trim_whitespace(text: str) -> str:
    """Leading and trailing ASCII whitespace removed."""
    return text.strip(_SPACE_CHARS)


def trim_leading_whitespace(text: str) -> str:
    return text.lstrip(_SPACE_CHARS)


def trim_trailing_whitespace(text: str) -> str:
    return text.rstrip(_SPACE_CHARS)


def trim_trailing_newlines(text: str) -> str:
    return text.rstrip("\n")


# ---------------------------------------------------------------------------------------------
# Markers
# ---------------------------------------------------------------------------------------------

TEXT, MARKER = "TEXT", "MARKER"


@dataclass(frozen=True)
class Segment:
    """A piece of text: a marker (``<...>``/``[...]``) or the text between markers."""

    type: str
    value: str


def segmentize_markers(text: str) -> list[Segment]:
    """The text cut into markers and non-marker fragments; an unclosed opener stays text."""
    segments: list[Segment] = []
    opener = ""
    border = 0
    for pos, char in enumerate(text):
        if not opener and char in "<[":
            if border < pos:
                segments.append(Segment(TEXT, text[border:pos]))
            border, opener = pos, char
        elif opener and char == (">" if opener == "<" else "]"):
            segments.append(Segment(MARKER, text[border : pos + 1]))
            border, opener = pos + 1, ""
    if border < len(text):
        segments.append(Segment(TEXT, text[border:]))
    return segments


def prune_whitespace_segments(segments: Iterable[Segment]) -> list[Segment]:
    return [seg for seg in segments if trim_whitespace(seg.value)]


# ---------------------------------------------------------------------------------------------
# Diffs
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DiffSplit:
    """Two texts as ``prefix + left + suffix`` and ``prefix + right + suffix``."""

    prefix: str = ""
    suffix: str = ""
    left: str = ""
    right: str = ""


def _common_prefix_len(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _common_suffix_len(a: str, b: str) -> int:
    return _common_prefix_len(a[::-1], b[::-1])


def calculate_diff_split(left: str, right: str) -> DiffSplit:
    """Longest common prefix and suffix of two texts, aligned on whole markers, and the middles."""
    lseg, rseg = segmentize_markers(left), segmentize_markers(right)
    if not lseg:
        return DiffSplit(right=right)
    if not rseg:
        return DiffSplit(left=left)
    prefix, suffix = "", ""
    ls, le, rs, re_ = 0, len(lseg) - 1, 0, len(rseg) - 1
    left_done = right_done = False
    while ls != le and rs != re_:
        advanced = False
        if lseg[ls] == rseg[rs]:
            prefix += lseg[ls].value
            ls += 1
            rs += 1
            advanced = True
        if lseg[le] == rseg[re_]:
            suffix = lseg[le].value + suffix
            if ls != le:
                le -= 1
            else:
                left_done = True
            if rs != re_:
                re_ -= 1
            else:
                right_done = True
            advanced = True
        if not advanced:
            break
    if ls == le and rs != re_:
        if lseg[ls] == rseg[re_]:
            suffix = rseg[re_].value + suffix
            re_ -= 1
            left_done = True
        elif lseg[ls] == rseg[rs]:
            prefix += rseg[rs].value
            rs += 1
            left_done = True
    elif rs == re_ and ls != le:
        if lseg[le] == rseg[rs]:
            suffix = lseg[le].value + suffix
            le -= 1
            right_done = True
        elif lseg[ls] == rseg[rs]:
            prefix += lseg[ls].value
            ls += 1
            right_done = True
    elif ls == le and rs == re_ and lseg[ls] == rseg[rs] and lseg[ls].type == MARKER:
        prefix += rseg[rs].value
        left_done = right_done = True

    text_suffix = lseg[le].type == TEXT and rseg[re_].type == TEXT
    text_prefix = rseg[rs].type == TEXT and lseg[ls].type == TEXT
    rem_left = "".join(s.value for s in lseg[ls : le if left_done else le + 1])
    rem_right = "".join(s.value for s in rseg[rs : re_ if right_done else re_ + 1])
    suffix_len = _common_suffix_len(rem_left, rem_right) if text_suffix else 0
    prefix_len = (
        _common_prefix_len(
            rem_left[: len(rem_left) - suffix_len], rem_right[: len(rem_right) - suffix_len]
        )
        if text_prefix
        else 0
    )
    result = DiffSplit(
        prefix=prefix + rem_left[:prefix_len],
        suffix=rem_left[len(rem_left) - suffix_len :] + suffix,
        left=rem_left[prefix_len : len(rem_left) - suffix_len],
        right=rem_right[prefix_len : len(rem_right) - suffix_len],
    )
    if not result.left and not result.right:
        result = DiffSplit(prefix=left)  # no difference: all of it is the prefix
    if not result.left and result.right and right.startswith(left):
        # left is all shared: the diff is what right appends (no rotated suffix)
        result = DiffSplit(prefix=left, right=right[len(left) :])
    return result


def until_common_prefix(full: str, left: str, right: str) -> str:
    """``full`` up to the first occurrence of the common prefix of ``left`` and ``right``."""
    n = _common_prefix_len(left, right)
    if n == 0:
        return ""
    pos = full.find(left[:n])
    return "" if pos < 0 else full[:pos]


def after_common_suffix(full: str, left: str, right: str) -> str:
    """``full`` after the last occurrence of the common suffix of ``left`` and ``right``."""
    n = _common_suffix_len(left, right)
    if n == 0:
        return ""
    pos = full.rfind(left[len(left) - n :])
    return "" if pos < 0 else full[pos + n :]


# ---------------------------------------------------------------------------------------------
# Rendering variants
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TemplateParams:
    """What the analysis renders a template with (llama.cpp's ``template_params``)."""

    messages: Sequence[Any] = ()
    tools: Sequence[Any] | None = None
    add_generation_prompt: bool = False
    enable_thinking: bool = True
    extra_context: dict[str, Any] | None = None

    def but(self, **changes: Any) -> TemplateParams:
        return replace(self, **changes)


@dataclass(frozen=True)
class CompareResult:
    diff: DiffSplit
    output_a: str
    output_b: str


def apply_template(tmpl: ChatTemplate, params: TemplateParams) -> str | None:
    """The render, or None where the template fails (llama.cpp's ``#**ERROR**#``)."""
    extra = dict(params.extra_context or {})
    extra["enable_thinking"] = params.enable_thinking
    try:
        return tmpl.direct_apply(
            copy.deepcopy(list(params.messages)),
            tools=copy.deepcopy(list(params.tools)) if params.tools else None,
            add_generation_prompt=params.add_generation_prompt,
            enable_thinking=params.enable_thinking,
            extra_context=extra,
        )
    except Exception:  # noqa: BLE001 - any failure of a probe render is an answer, as in llama.cpp
        return None


def compare_variants(
    tmpl: ChatTemplate,
    params_a: TemplateParams,
    modifier: Callable[[TemplateParams], TemplateParams] | None = None,
) -> CompareResult | None:
    """Render ``params_a`` and ``modifier(params_a)`` and split the two; None if either fails."""
    params_b = modifier(params_a) if modifier else params_a
    out_a, out_b = apply_template(tmpl, params_a), apply_template(tmpl, params_b)
    if out_a is None or out_b is None:
        return None
    return CompareResult(calculate_diff_split(out_a, out_b), out_a, out_b)


# ---------------------------------------------------------------------------------------------
# The analysis's one-shot tagged parsers
# ---------------------------------------------------------------------------------------------


def match_tags(fn: Callable[[ParserBuilder], Parser], text: str) -> dict[str, str] | None:
    """The tags of a tagged PEG parser run from the start of ``text`` (which it need not
    consume: ``tagged_peg_parser::parse_and_extract``), None when it fails."""
    found = build_tagged_peg_parser(fn).parse_and_extract(text)
    return found.tags if found.result.success() else None


def search_tags(fn: Callable[[ParserBuilder], Parser], text: str) -> dict[str, str] | None:
    """The tags from the first position of ``text`` where the parser succeeds
    (``parse_anywhere_and_extract``), None when it succeeds nowhere."""
    found = build_tagged_peg_parser(fn).parse_anywhere_and_extract(text)
    return found.tags if found.result.success() else None


def get(tags: dict[str, str] | None, name: str) -> str:
    """A tag's text; "" when the parse failed or the tag matched nothing (``tags[name]``)."""
    return (tags or {}).get(name, "")


def last_marker(p: ParserBuilder) -> Parser:
    """The last marker of the text and what follows it, to the end."""
    return p.marker() + p.zero_or_more(p.negate(p.marker()) + p.any()) + p.end()
