"""Model names: a pin's name from its file, the suffix-less alias, and a derived model's name check.

A pin is named after its file: the last path segment without ``.gguf``, lower-cased
(``Bonsai-1.7B-Q1_0.gguf`` is ``bonsai-1.7b-q1_0``). Its alias drops the first weight-type suffix
that matches (``mindx-gen39-f16`` is also ``mindx-gen39``), when exactly one pin has that alias.
Every name is listed with the tag ``:latest``, the only tag there is.
"""

from __future__ import annotations

import re

TAG = ":latest"
GGUF = ".gguf"
# Checked in this order; the first that ends the name is stripped (-q2_0_g64 before -q2_0).
WEIGHT_SUFFIXES = (
    "-f16",
    "-bf16",
    "-f32",
    "-q1_0",
    "-q2_0_g64",
    "-q2_0",
    "-q8_0",
    "-q4_k_m",
    "-q4_0",
)
MAX_NAME_BYTES = 128
_NAME_CHARS = re.compile(r"[a-z0-9._-]+")


class BadName(ValueError):
    """A derived model's name that is not taken; the message says why."""


def model_name(file: str) -> str:
    """The last path segment, without ``.gguf`` (any case), lower-cased."""
    last = file.rsplit("/", 1)[-1]
    if last.lower().endswith(GGUF):
        last = last[: -len(GGUF)]
    return last.lower()


def base_name(name: str) -> str:
    """``name`` without the first weight-type suffix it ends with (unchanged when none does)."""
    for suffix in WEIGHT_SUFFIXES:
        if name.endswith(suffix) and len(name) > len(suffix):
            return name[: -len(suffix)]
    return name


def tag(name: str) -> str:
    return name + TAG


def strip_tag(requested: str) -> str:
    """A requested model without its ``:latest`` tag (any case); other tags are kept, and so
    never match a name."""
    return requested[: -len(TAG)] if requested.lower().endswith(TAG) else requested


def request_name(requested: str) -> str:
    """What a request's ``model`` is compared with: trimmed, untagged, as a model name."""
    return model_name(strip_tag(requested.strip()))


def check_name(requested: str, pin_names: frozenset[str] | set[str] = frozenset()) -> str:
    """A derived model's name: trimmed, ``:latest`` stripped, lower-cased, then checked.

    Raises BadName for another tag, characters outside ``[a-z0-9._-]``, a length outside 1-128
    bytes, a leading ``.`` or ``-``, a ``.gguf`` ending, or a pin's own name.
    """
    name = strip_tag(requested.strip())
    if ":" in name:
        raise BadName(f"model name {requested!r}: the only tag is {TAG}")
    name = name.lower()
    if not 1 <= len(name.encode("utf-8")) <= MAX_NAME_BYTES or not _NAME_CHARS.fullmatch(name):
        raise BadName(
            f"model name {requested!r}: 1 to {MAX_NAME_BYTES} of a-z, 0-9, '.', '_' and '-'"
        )
    if name[0] in ".-":
        raise BadName(f"model name {requested!r}: may not start with '.' or '-'")
    if name.endswith(GGUF):
        raise BadName(f"model name {requested!r}: may not end with {GGUF} (that names a file)")
    if name in pin_names:
        raise BadName(
            f"{name} is a pinned model's name (its file's); a derived model needs its own "
            f"— e.g. {name}-persona"
        )
    return name
