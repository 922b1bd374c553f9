"""A run's text as llama-server's ``process_token`` releases it: UTF-8 and stop strings.

``TextRelease`` holds a token's bytes back while a UTF-8 character is incomplete or a stop
string may be starting, and cuts the answer at a full one; ``LineLimits`` ends an answer by
its lines (``n_indent``, ``t_max_predict_ms``); ``utf8_prefix_text`` is a logprob entry's
``token``. Pure functions of bytes: no model here.
"""

from __future__ import annotations

from collections.abc import Sequence


def incomplete_utf8_at(text: bytes) -> int:
    """validate_utf8: the length without a multi-byte character cut off at the end."""
    n = len(text)
    for i in range(1, min(4, n) + 1):
        c = text[n - i]
        if (
            (c & 0xE0) == 0xC0
            and i < 2
            or (c & 0xF0) == 0xE0
            and i < 3
            or (c & 0xF8) == 0xF0
            and i < 4
        ):
            return n - i
    return n


def find_partial_stop(text: bytes, stop: bytes) -> int:
    """string_find_partial_stop: where a suffix of ``text`` that begins ``stop`` starts, or -1."""
    for length in range(min(len(text), len(stop)), 0, -1):
        if text.endswith(stop[:length]):
            return len(text) - length
    return -1


class TextRelease:
    """process_token's text handling: hold incomplete UTF-8 and partial stop strings, cut at a stop."""

    def __init__(self, stops: Sequence[str]):
        self.stops = [s.encode("utf-8") for s in stops]
        self.text = b""
        self.sent = 0
        self.stopping_word = ""

    def push(self, piece: bytes, is_eog: bool) -> tuple[bytes | None, bool]:
        """Add a token's bytes; returns (released bytes or None while UTF-8 is incomplete, stopped)."""
        self.text += piece
        if incomplete_utf8_at(self.text) < len(self.text):
            return None, False
        pos = min(self.sent, len(self.text))
        tail = self.text[pos:]
        stop_pos, word = self._find_full(tail, len(piece))
        if stop_pos >= 0:
            self.text = self.text[: pos + stop_pos]
            self.stopping_word = word.decode("utf-8", "replace")
            pos = min(self.sent, len(self.text))
        elif not is_eog and any(find_partial_stop(tail, s) >= 0 for s in self.stops):
            return b"", False
        out = self.text[pos:]
        self.sent += len(out)
        return out, stop_pos >= 0

    def _find_full(self, tail: bytes, piece_len: int) -> tuple[int, bytes]:
        best, word = -1, b""
        for s in self.stops:
            start = max(len(tail) - (len(s) + piece_len), 0)
            p = tail.find(s, start)
            if p >= 0 and (best < 0 or p < best):
                best, word = p, s
        return best, word


def utf8_prefix_text(raw: bytes) -> str:
    """A logprob entry's ``token``: the incomplete trailing character cut, other bad bytes replaced."""
    return raw[: incomplete_utf8_at(raw)].decode("utf-8", "replace")


class LineLimits:
    """process_token's line rules: ``n_indent`` (once a newline was sent, a later line indented by
    fewer spaces/tabs ends the answer, cut after that line's indentation) and ``t_max_predict_ms``
    (a newline sent after that long since the first token ends it). Both stop with "limit"."""

    def __init__(self, n_indent: int, t_max_predict_ms: int):
        self.n_indent = n_indent
        self.t_max = t_max_predict_ms
        self.has_new_line = False
        self.last_nl_pos = 0

    def stops(self, release: TextRelease, sent: bytes, gen_ms: float) -> bool:
        stop = self.has_new_line and self.n_indent > 0 and self._indent_stop(release)
        if b"\n" in sent:
            self.has_new_line = True
            if self.t_max > 0 and gen_ms > self.t_max:
                stop = True
        return stop

    def _indent_stop(self, release: TextRelease) -> bool:
        text = release.text
        stop = False
        if self.last_nl_pos > 0:
            pos = self.last_nl_pos
            while pos < len(text) and text[pos : pos + 1] in (b" ", b"\t"):
                pos += 1
            if pos < len(text) and pos - self.last_nl_pos < self.n_indent:
                release.text = text[:pos]  # the short line is cut, its indentation kept
                stop = True
        nl = text.find(b"\n", self.last_nl_pos)
        if nl != -1:
            self.last_nl_pos = nl + 1
        return stop
