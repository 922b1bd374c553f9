"""llama-server's checks of a slot action, ``POST /slots/{id}?action=save|restore|erase``: the
id as ``std::stoi`` reads it, the filename as llama.cpp's ``fs_validate_filename`` accepts it.

The resource applies them in llama-server's order (the slot directory, the id, the action, the
filename); the action itself is ``NativeEngine.slot_action``, on the engine thread.
"""

from __future__ import annotations

import re

from bankml.formats.nlohmann import INT_MAX, INT_MIN

NOT_SUPPORTED_SLOTS = "This server does not support slots action. Start it with `--slot-save-path`"
FORBIDDEN_CODEPOINTS = set(':*?"<>|/\\') | {"\ufffd", "\ufeff", "\uff0e", "\u2215", "\u2216"}
_STOI = re.compile(r"[ \t\n\v\f\r]*([+-]?[0-9]+)")


def filename_ok(name: str) -> bool:
    """llama.cpp's fs_validate_filename(name, allow_subdirs=false)."""
    try:
        encoded = name.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate from a \\ud800 escape: not valid UTF-8
        return False
    if not encoded or len(encoded) > 255:
        return False
    for ch in name:
        c = ord(ch)
        if c <= 0x1F or c == 0x7F or 0x80 <= c <= 0x9F or ch in FORBIDDEN_CODEPOINTS:
            return False
    if name[0] == " " or name[-1] in " .":
        return False
    return ".." not in name and name != "."


def stoi(text: str) -> int | None:
    """std::stoi: leading whitespace, a sign, digits (the rest ignored); None where it throws."""
    match = _STOI.match(text)
    if not match:
        return None
    value = int(match.group(1))
    return value if INT_MIN <= value <= INT_MAX else None
