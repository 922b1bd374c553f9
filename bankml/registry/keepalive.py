"""``keep_alive``: how long a model stays loaded after a request, as Ollama reads it.

Absent, null or ``""`` is the default. A number is seconds. A string is first read as a decimal
number of seconds (``"90"``, ``"-1"``), then as a Go duration: an optional sign and one or more
number+unit segments, units ``ns``, ``us``/``µs``/``μs``, ``ms``, ``s``, ``m``, ``h``
(``"1h30m"``, ``"2.5s"``, ``"-1m"``; ``"0"`` alone needs no unit, as in Go).
Below zero keeps the model for good, zero unloads it after the answer, above zero sets the expiry.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

FOREVER, UNLOAD, FOR = "forever", "unload", "for"

_DECIMAL = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?")
_SEGMENT = re.compile(r"(\d*)(?:\.(\d*))?(ns|us|µs|μs|ms|s|m|h)")
_UNIT_SECONDS = {
    "ns": 1e-9,
    "us": 1e-6,
    "µs": 1e-6,  # U+00B5 MICRO SIGN
    "μs": 1e-6,  # U+03BC GREEK SMALL LETTER MU
    "ms": 1e-3,
    "s": 1.0,
    "m": 60.0,
    "h": 3600.0,
}
GO_MAX_SECONDS = (2**63 - 1) / 1e9  # time.Duration is int64 nanoseconds


class BadKeepAlive(ValueError):
    """A keep_alive bankml cannot read; the message is the 400 answer's."""


@dataclass(frozen=True)
class KeepAlive:
    """FOREVER, UNLOAD, or FOR ``seconds`` (> 0)."""

    kind: str
    seconds: float = 0.0

    @classmethod
    def of_seconds(cls, seconds: float) -> KeepAlive:
        if seconds < 0:
            return cls(FOREVER)
        if seconds == 0:
            return cls(UNLOAD)
        return cls(FOR, seconds)

    def expires_at(self, now: float) -> float | None:
        """When a model kept this way expires (None: never); UNLOAD expires at once."""
        if self.kind == FOREVER:
            return None
        return now + self.seconds if self.kind == FOR else now


DEFAULT = KeepAlive(FOR, 300.0)


def go_duration_seconds(text: str) -> float:
    """Go's time.ParseDuration, in seconds; ValueError when it does not parse."""
    s = text
    sign = 1.0
    if s[:1] in ("+", "-"):
        sign = -1.0 if s[0] == "-" else 1.0
        s = s[1:]
    if s == "0":
        return 0.0
    if not s:
        raise ValueError(text)
    total = 0.0
    pos = 0
    while pos < len(s):
        m = _SEGMENT.match(s, pos)
        if m is None or (not m.group(1) and not m.group(2)):
            raise ValueError(text)  # no digits before the unit ("m", ".s") or no unit ("5x")
        whole, frac, unit = m.group(1) or "0", m.group(2) or "", m.group(3)
        total += float(f"{whole}.{frac}0") * _UNIT_SECONDS[unit]
        pos = m.end()
    if total > GO_MAX_SECONDS:
        raise ValueError(text)  # Go: "invalid duration" (overflows int64 nanoseconds)
    return sign * total


def parse_keep_alive(value: Any, default: KeepAlive = DEFAULT) -> KeepAlive:
    """A request's (or the command line's) keep_alive; raises BadKeepAlive with the 400 message."""
    if value is None or value == "":
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise BadKeepAlive("keep_alive must be a duration string or a number of seconds")
    if isinstance(value, str):
        try:
            seconds = float(value) if _DECIMAL.fullmatch(value) else go_duration_seconds(value)
        except ValueError:
            raise BadKeepAlive(
                f'keep_alive "{value}": not a duration ("5m", "1h", seconds, 0 or -1)'
            ) from None
    else:
        seconds = float(value)
    if math.isnan(seconds):
        raise BadKeepAlive(f'keep_alive "{value}": not a duration ("5m", "1h", seconds, 0 or -1)')
    return KeepAlive.of_seconds(seconds)
