"""The gate: a model plays only when its header passes the guard and its whole-file sha256 is pinned.

`verify` reads FORK.json, runs the guard on the header, then hashes the whole file and compares
it with the pin for the file's basename. `pin` writes that pin. FORK.json is parsed as JSON (a
pin file that is not JSON is refused, never scanned as text). Messages and exit codes are
bankml's stable interface (docs/modules/verify.md). Pure functions, no Twisted.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from bankml.gate.fileident import FileIdent
from bankml.gate.guard import GuardResult, guard_file

HASH_BLOCK_BYTES = 1024 * 1024  # measured: 1 MiB stays in L2 and beats 4-16 MiB by ~10% (docs)
PROGRESS_MIN_BYTES = 256 * 1024 * 1024  # smaller files hash in well under a second
MAX_FORK_BYTES = 16 * 1024 * 1024  # a pin file is a few hundred bytes; never load a huge one
SHA256_HEX = re.compile(r"[0-9a-fA-F]{64}")


class Refused(Exception):
    """Why a file may not play. exit_code: 1 for I/O ("cannot ..."), 3 for a truncated header, else 2."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason

    @property
    def exit_code(self) -> int:
        if self.reason.startswith("cannot"):
            return 1
        if self.reason.startswith("guard needs"):
            return 3
        return 2


@dataclass(frozen=True)
class Verified:
    """A file that passed the guard and matched its pin, with the identity it had when hashed."""

    path: str  # canonical (os.path.realpath): the path the engine is given
    sha256: str
    guard: GuardResult
    ident: FileIdent
    verified_at: float  # unix time
    fork_path: str

    def as_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "sha256": self.sha256,
            "guard": self.guard.verdict,
            "engine": self.guard.engine,
            "arch": self.guard.arch,
            "name": self.guard.name,
            "types": dict(self.guard.types),
            "ident": self.ident.as_dict(),
            "verified_at": self.verified_at,
            "fork": self.fork_path,
        }


def _os_error(err: OSError) -> str:
    return err.strerror or str(err)


def sha256_file(path: str | os.PathLike[str], progress: bool | None = None) -> str:
    """Hex sha256 of a whole file, read in 1 MiB blocks into one reusable buffer.

    progress None shows a tqdm bar only when stderr is a terminal and the file is large.
    Raises OSError when the file cannot be read.
    """
    digest = hashlib.sha256()
    buf = bytearray(HASH_BLOCK_BYTES)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        if progress is None:
            progress = size >= PROGRESS_MIN_BYTES and sys.stderr.isatty()
        bar = _progress_bar(os.path.basename(os.fspath(path)), size) if progress else None
        try:
            while n := f.readinto(buf):
                digest.update(view[:n])  # hashlib drops the GIL for blocks this large
                if bar is not None:
                    bar.update(n)
        finally:
            if bar is not None:
                bar.close()
    return digest.hexdigest()


def _progress_bar(name: str, size: int) -> Any:
    from tqdm import tqdm  # only imported when a terminal will show it

    return tqdm(
        total=size,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        desc=f"sha256 {name}",
        file=sys.stderr,
        leave=False,
    )


def pinned_sha256(fork_text: str, name: str) -> str | None:
    """The sha256 FORK.json pins for basename `name`, lower-cased; None when it pins none.

    Only `files[].path` and `files[].sha256` are read; a path with a directory never equals a
    basename. Raises Refused for a fork that is not JSON, a malformed pin, or two different pins.
    """
    try:
        doc = json.loads(fork_text)
    except (ValueError, RecursionError) as err:
        raise Refused(f"FORK.json is not JSON ({err}): {name} unpinned, refused") from None
    files = doc.get("files") if isinstance(doc, dict) else None
    if not isinstance(files, list):
        return None
    pins: list[str] = []
    for entry in files:
        if not isinstance(entry, dict) or entry.get("path") != name:
            continue
        sha = entry.get("sha256")
        if not isinstance(sha, str) or not SHA256_HEX.fullmatch(sha):
            raise Refused(f"{name} has a malformed sha256 record in FORK.json ({sha!r}): refused")
        pins.append(sha.lower())
    if len(set(pins)) > 1:
        raise Refused(
            f"{name} has {len(set(pins))} different sha256 records in FORK.json: ambiguous, refused"
        )
    return pins[0] if pins else None


def read_fork(fork_path: str | os.PathLike[str]) -> str:
    """FORK.json's text; Refused("cannot read ...") (exit 1) when it cannot be read."""
    try:
        with open(fork_path, "rb") as f:
            raw = f.read(MAX_FORK_BYTES + 1)
    except OSError as err:
        raise Refused(f"cannot read {os.fspath(fork_path)}: {_os_error(err)}") from None
    if len(raw) > MAX_FORK_BYTES:
        raise Refused(
            f"FORK.json {os.fspath(fork_path)} is larger than {MAX_FORK_BYTES} bytes: refused"
        )
    return raw.decode("utf-8", "replace")


def _guard(path: str, engine: str) -> GuardResult:
    try:
        result = guard_file(path, engine)
    except OSError as err:
        raise Refused(f"cannot read {path}: {_os_error(err)}") from None
    if result.verdict == "need_more":
        raise Refused(f"guard needs {result.bytes_needed} header bytes: file truncated")
    if result.verdict != "play":
        raise Refused("guard refused: " + "; ".join(result.reasons))
    return result


def _ident(path: str) -> FileIdent:
    try:
        return FileIdent.of(path)
    except OSError as err:
        raise Refused(f"cannot read {path}: {_os_error(err)}") from None


def _hash_unchanged(path: str, name: str, before: FileIdent) -> str:
    """Hash the file and require the identity it had before the guard to hold after the hash."""
    try:
        got = sha256_file(path)
    except OSError as err:
        raise Refused(f"cannot hash {name}: {_os_error(err)}") from None
    if _ident(path) != before:
        raise Refused(f"{name} changed while it was being hashed: refused")
    return got


def verify(
    path: str | os.PathLike[str],
    fork_path: str | os.PathLike[str],
    engine: str = "mainline",
    while_hashing: Callable[[str], object] | None = None,
) -> Verified:
    """The fork (readable), then the guard (header only), then the whole-file sha256 against the pin.

    The pin is looked up by the basename of `path` as given; the guard and hash read the
    canonical path, which is what Verified.path holds. Raises Refused with the documented reason.
    ``while_hashing(canonical_path)`` is called once the header passed the guard and the file has
    a pin, just before the hash: work it starts on another thread (compiling the engine's
    kernels) overlaps the hash, and must not answer anything before verify returns.
    """
    fork_text = read_fork(fork_path)
    name = os.path.basename(os.fspath(path))
    canonical = os.path.realpath(path)
    before = _ident(canonical)
    guard = _guard(canonical, engine)
    want = pinned_sha256(fork_text, name)
    if want is None:
        raise Refused(f"{name} has no sha256 record in FORK.json: unpinned, refused")
    if while_hashing is not None:
        while_hashing(canonical)
    got = _hash_unchanged(canonical, name, before)
    if got != want:
        raise Refused(f"{name} sha256 {got} != pinned {want}: refused")
    return Verified(canonical, got, guard, before, time.time(), os.path.realpath(fork_path))


def _load_fork_for_update(fork_path: str) -> dict[str, Any]:
    if not os.path.exists(fork_path):
        return {"files": []}
    doc_text = read_fork(fork_path)
    try:
        doc = json.loads(doc_text)
    except (ValueError, RecursionError) as err:
        raise Refused(f"FORK.json {fork_path} is not JSON ({err}): not overwritten") from None
    if not isinstance(doc, dict) or not isinstance(doc.setdefault("files", []), list):
        raise Refused(f'FORK.json {fork_path} has no "files" list: not overwritten')
    return doc


def _write_atomically(path: str, text: str) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    try:
        fd, tmp = tempfile.mkstemp(prefix=".FORK.", suffix=".tmp", dir=directory)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError as err:
        raise Refused(f"cannot write {path}: {_os_error(err)}") from None


def pin(path: str | os.PathLike[str], fork_path: str | os.PathLike[str]) -> str:
    """Hash the file and record {"path": basename, "bytes", "sha256"} in FORK.json; return the sha256.

    Other keys and entries (provenance) are kept; an existing entry for the basename is updated
    in place and any duplicates of it are dropped. The file is written atomically and created
    when absent.
    """
    fork = os.fspath(fork_path)
    name = os.path.basename(os.fspath(path))
    doc = _load_fork_for_update(fork)
    try:
        before = FileIdent.of(path)
    except OSError as err:
        raise Refused(f"cannot hash {name}: {_os_error(err)}") from None
    sha = _hash_unchanged(os.fspath(path), name, before)
    _record(fork, doc, name, before.size, sha)
    return sha


def _record(fork: str, doc: dict[str, Any], name: str, size: int, sha: str) -> None:
    files: list[Any] = doc["files"]
    mine = [i for i, e in enumerate(files) if isinstance(e, dict) and e.get("path") == name]
    if mine:
        files[mine[0]].update({"bytes": size, "sha256": sha})
        doc["files"] = [e for i, e in enumerate(files) if i not in mine[1:]]
    else:
        files.append({"path": name, "bytes": size, "sha256": sha})
    _write_atomically(fork, json.dumps(doc, indent=2, ensure_ascii=False) + "\n")


def check_fork(fork_path: str | os.PathLike[str]) -> None:
    """Refused when ``fork_path`` exists but could not take a pin (not JSON, no files list)."""
    _load_fork_for_update(os.fspath(fork_path))


def record_pin(
    fork_path: str | os.PathLike[str], name: str, size: int, sha: str, provenance: dict[str, Any]
) -> None:
    """Record a pin for ``name`` hashed elsewhere (as it was written), with its provenance keys.

    The provenance keys replace those of the same name; ``files`` goes last; other entries and
    keys are kept. Refused when the fork exists but is not a FORK.json.
    """
    fork = os.fspath(fork_path)
    doc = _load_fork_for_update(fork)
    files = doc.pop("files")
    doc.update(provenance)
    doc["files"] = files
    _record(fork, doc, name, size, sha)
