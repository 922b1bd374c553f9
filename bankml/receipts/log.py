"""A log of what was served: every receipt appended as one JSON line, each chained to the one
before by hash (``bankml serve --receipt-log FILE``).

A line is the canonical JSON (canonical.py) of ``{"seq", "prev", "receipt"}``: ``seq`` counts
from 0 across the whole log, ``prev`` is the sha256 of the previous line's bytes (without its
newline; 64 zeros before the first line). Removing, reordering or changing a line breaks the
chain at the next line; a line's receipt is signed on its own (and its envelope), so changing a
receipt and the chain after it needs the key.

``ReceiptLog.open(path)`` continues a log: a last line cut short by a crash (no newline) is cut
off first, so the chain never breaks there; the crash loses that line and what was not yet
synced. ``append`` writes a line (to the OS at once); ``sync`` makes what was written durable
(``fsync``; the server calls it every second, off the reactor thread). When the file passes
``max_bytes`` it is renamed ``FILE.1`` (an older ``FILE.1`` becomes ``FILE.2``, and so on) and a
new ``FILE`` goes on with the chain: its first line's ``prev`` is the last line of ``FILE.1``.

``check_log(paths, public)`` checks the files of one log in order (oldest first): every line
JSON, ``seq`` consecutive, ``prev`` the previous line's hash, every receipt signed by the key
(and its envelope); a last line without its newline (a crash while it was written) is not
counted. It returns the number of lines, or raises ``LogBroken`` naming the first line that
breaks the log. Pure Python.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bankml.receipts.canonical import canonical_json

GENESIS = "0" * 64
MAX_BYTES = 64 * 1024 * 1024  # a file's size before it is rotated


class LogBroken(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def line_hash(line: bytes) -> str:
    return hashlib.sha256(line).hexdigest()


def _last_line(path: Path) -> bytes | None:
    """The last complete line of a file (without its newline), None when it has none."""
    with open(path, "rb") as file:
        end = file.seek(0, os.SEEK_END)
        block, data = 4096, b""
        while end > 0:
            start = max(0, end - block)
            file.seek(start)
            data = file.read(end - start) + data
            end = start
            lines = data.rstrip(b"\n").split(b"\n")
            if len(lines) > 1 or start == 0:
                return lines[-1] or None
        return None


def _repaired(path: Path) -> None:
    """Cut off a last line without its newline (a crash while it was written)."""
    with open(path, "rb+") as file:
        size = file.seek(0, os.SEEK_END)
        if size == 0:
            return
        file.seek(size - 1)
        if file.read(1) == b"\n":
            return
        keep, position = 0, size
        while position > 0:
            step = min(4096, position)
            position -= step
            file.seek(position)
            chunk = file.read(step)
            at = chunk.rfind(b"\n")
            if at >= 0:
                keep = position + at + 1
                break
        file.truncate(keep)
        os.fsync(file.fileno())


def rotated(path: Path, index: int) -> Path:
    return path.with_name(f"{path.name}.{index}")


def log_files(path: str | Path) -> list[Path]:
    """The files of the log at ``path``, oldest first (``FILE.N`` ... ``FILE.1``, ``FILE``)."""
    path = Path(path)
    older = []
    index = 1
    while rotated(path, index).exists():
        older.append(rotated(path, index))
        index += 1
    return [*reversed(older), *([path] if path.exists() else [])]


class ReceiptLog:
    """One log, appended to by one server (see the module doc)."""

    def __init__(self, path: Path, seq: int, prev: str, max_bytes: int) -> None:
        self.path = path
        self.seq = seq
        self.prev = prev
        self.max_bytes = max_bytes
        self.lock = threading.Lock()
        self.file = open(path, "ab")  # noqa: SIM115 (held open for the life of the log)
        self.unsynced = False

    @classmethod
    def open(cls, path: str | Path, max_bytes: int = MAX_BYTES) -> ReceiptLog:
        """The log at ``path`` continued (created when absent; a cut-short last line removed);
        OSError or LogBroken when its last line cannot be read."""
        path = Path(path)
        seq, prev = 0, GENESIS
        files = log_files(path)
        if path.exists():
            _repaired(path)
        for file in reversed(files):
            last = _last_line(file)
            if last is None:
                continue
            try:
                seq = int(json.loads(last)["seq"]) + 1
            except (ValueError, KeyError, TypeError):
                raise LogBroken(f"{file}: its last line is not a log line") from None
            prev = line_hash(last)
            break
        return cls(path, seq, prev, max_bytes)

    def append(self, receipt: dict[str, Any]) -> None:
        """One receipt as the next line (rotating the file first when it is full)."""
        with self.lock:
            line = canonical_json({"seq": self.seq, "prev": self.prev, "receipt": receipt})
            if self.file.tell() and self.file.tell() + len(line) + 1 > self.max_bytes:
                self._rotate()
            self.file.write(line + b"\n")
            self.file.flush()
            self.seq += 1
            self.prev = line_hash(line)
            self.unsynced = True

    def _rotate(self) -> None:
        os.fsync(self.file.fileno())
        self.file.close()
        index = 1
        while rotated(self.path, index).exists():
            index += 1
        for older in range(index, 1, -1):
            os.replace(rotated(self.path, older - 1), rotated(self.path, older))
        os.replace(self.path, rotated(self.path, 1))
        self.file = open(self.path, "ab")  # noqa: SIM115 (held open, as above)

    def sync(self) -> None:
        """Make every line written so far durable."""
        with self.lock:
            if not self.unsynced:
                return
            fd, self.unsynced = os.dup(self.file.fileno()), False
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def close(self) -> None:
        self.sync()
        with self.lock:
            self.file.close()


def check_log(paths: Sequence[Path], verify: Callable[[dict[str, Any]], None]) -> int:
    """The number of lines of a log's files (oldest first), each receipt passed to ``verify``
    (which raises LogBroken); LogBroken at the first line that breaks the log."""
    count, prev = 0, GENESIS
    for path in paths:
        data = path.read_bytes()
        lines = data.split(b"\n")
        if lines[-1]:  # a last line cut short by a crash: not part of the log
            if path != paths[-1]:
                raise LogBroken(f"{path.name}: its last line is cut short, and a file follows")
        for number, line in enumerate(lines[:-1], 1):
            where = f"{path.name} line {number}"
            try:
                entry = json.loads(line)
            except ValueError:
                raise LogBroken(f"{where} is not JSON") from None
            if not isinstance(entry, dict) or set(entry) != {"seq", "prev", "receipt"}:
                raise LogBroken(f"{where} is not a log line")
            if entry["seq"] != count:
                raise LogBroken(f"{where}: seq {entry['seq']!r}, expected {count}")
            if entry["prev"] != prev:
                raise LogBroken(f"{where}: prev is not the hash of the line before it")
            if canonical_json(entry) != line:
                raise LogBroken(f"{where} is not in canonical form")
            try:
                verify(entry["receipt"])
            except LogBroken as err:
                raise LogBroken(f"{where}: {err.reason}") from None
            count += 1
            prev = line_hash(line)
    return count
