"""Every model pinned by a ``*.FORK.json`` in a directory, plus the startup model.

Entry 0 is the startup model (the file given to ``bankml serve``, with its ``--fork``); it is the
default. Then each ``*.FORK.json`` of the directory, in sorted order: a fork that cannot be read,
is not JSON or has no ``files`` list is skipped; each ``files[].path`` gives its last ``/``
segment, ``.gguf`` names only, and the first holder of a name wins. The file is looked for in the
search directories in order (``serve``: beside the startup model, then the directory;
``create``: the directory, then ``--models``).

Listing a pin reads its header (never its weights); a pin whose file is absent, whose header the
guard's parser refuses, or whose architecture the forward pass does not play is still listed,
with the reason. Nothing here hashes: every load verifies again (``residency``).
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from bankml.engine_cupy.arch import ARCHITECTURES, supported_names
from bankml.gate import verify
from bankml.registry.header import HeaderError, HeaderInfo, read_header
from bankml.registry.names import base_name, model_name, request_name

# encoder-only architectures: served by the encoder engine (engine_cupy/encoder_engine.py's
# ``is_encoder``), embeddings only
ENCODER_ARCHITECTURES = ("bert",)

FORK_GLOB = "*.FORK.json"
NOT_HERE = "pinned, but the file is not on this machine"


class NotFound(LookupError):
    """A model name that resolves to nothing; the message is the 404 answer's."""


@dataclass(frozen=True)
class Pin:
    """One pinned GGUF: where it is, which fork pins it, and what its header says."""

    name: str
    file: str  # the basename the fork pins
    path: str | None  # where the file was found (None: not on this machine)
    fork_path: str
    fork_text: str
    sha256: str  # "" when the fork pins no valid sha256 for it
    bytes: int
    header: HeaderInfo | None
    native_reason: str | None  # None: the forward pass plays it
    modified_at: float  # the file's mtime (the fork's when the file is absent)

    @property
    def native(self) -> bool:
        return self.native_reason is None

    @property
    def fork_name(self) -> str:
        return os.path.basename(self.fork_path)


def fork_files(fork_text: str) -> list[dict] | None:
    """The ``files`` list of a fork, or None when it is not JSON or has none."""
    try:
        doc = json.loads(fork_text)
    except (ValueError, RecursionError):
        return None
    files = doc.get("files") if isinstance(doc, dict) else None
    return files if isinstance(files, list) else None


def _pinned(fork_text: str, file: str) -> str:
    try:
        return verify.pinned_sha256(fork_text, file) or ""
    except verify.Refused:
        return ""  # a malformed or ambiguous record: unpinned (verify says why on load)


def _native_reason(path: str | None, header: HeaderInfo | None, header_error: str) -> str | None:
    if path is None:
        return NOT_HERE
    if header is None:
        return f"its header is refused: {header_error}"
    if header.arch not in ARCHITECTURES and header.arch not in ENCODER_ARCHITECTURES:
        return f"architecture {header.arch}: the forward pass plays {supported_names()}"
    return None


def make_pin(
    file: str, path: str | None, fork_path: str, fork_text: str, bytes_: int | None
) -> Pin:
    """A registry entry for ``file`` as pinned by the fork (its header read when it is here)."""
    header, error = None, ""
    modified = 0.0
    if path is not None:
        try:
            st = os.stat(path)
            modified = st.st_mtime
            bytes_ = st.st_size
            header = read_header(path)
        except (OSError, HeaderError) as err:
            error = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
    if not modified:
        try:
            modified = os.stat(fork_path).st_mtime
        except OSError:
            modified = 0.0
    return Pin(
        name=model_name(file),
        file=file,
        path=path,
        fork_path=fork_path,
        fork_text=fork_text,
        sha256=_pinned(fork_text, file),
        bytes=int(bytes_ or 0),
        header=header,
        native_reason=_native_reason(path, header, error),
        modified_at=modified,
    )


def _find(file: str, search: Sequence[str]) -> str | None:
    for directory in search:
        candidate = os.path.join(directory, file)
        if os.path.isfile(candidate):
            return candidate
    return None


def forks_in(directory: str) -> list[str]:
    """The ``*.FORK.json`` paths of a directory, sorted (none when it does not exist)."""
    return sorted(glob.glob(os.path.join(glob.escape(directory), FORK_GLOB)))


def read_fork_text(fork_path: str) -> str | None:
    try:
        return verify.read_fork(fork_path)
    except verify.Refused:
        return None


def _record_bytes(entry: dict) -> int | None:
    value = entry.get("bytes")
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


class Registry:
    """The pins, in order (entry 0 the default when there is a startup model)."""

    def __init__(self, pins: Iterable[Pin], has_startup: bool = True) -> None:
        self.pins: list[Pin] = list(pins)
        self.has_startup = has_startup and bool(self.pins)

    def names(self) -> list[str]:
        return [p.name for p in self.pins]

    def by_name(self, name: str) -> Pin | None:
        return next((p for p in self.pins if p.name == name), None)

    def by_alias(self, name: str) -> Pin | None:
        """The one pin whose suffix-less name is ``name`` (None when none or several)."""
        matches = [p for p in self.pins if base_name(p.name) == name]
        return matches[0] if len(matches) == 1 else None

    def not_found(self, requested: str, derived: Sequence[str] = ()) -> NotFound:
        text = (
            f"model '{requested}' not found: bankml serves pinned models only "
            f"({', '.join(self.names())})"
        )
        if derived:
            text += f"; derived: {', '.join(derived)}"
        return NotFound(text)

    def resolve(self, requested: str | None) -> Pin:
        """Blank: the startup model. Else the exact name (``:latest`` and ``.gguf`` optional, any
        case), then the suffix-less alias when exactly one pin has it; else NotFound."""
        if requested is None or not requested.strip():
            if self.has_startup:
                return self.pins[0]
            raise self.not_found(requested or "")
        n = request_name(requested)
        pin = self.by_name(n) or self.by_alias(n)
        if pin is None:
            raise self.not_found(requested)
        return pin


def discover(
    directory: str | None,
    search: Sequence[str] = (),
    startup: tuple[str, str] | None = None,
) -> Registry:
    """The registry: the startup ``(model path, fork path)`` first, then every pin in ``directory``.

    ``search`` is where pinned files are looked for, in order (``directory`` is looked in after
    them when it is not among them). Without ``directory`` only the startup model is served.
    """
    pins: list[Pin] = []
    seen: set[str] = set()
    if startup is not None:
        path, fork_path = startup
        text = read_fork_text(fork_path) or ""
        file = os.path.basename(path)
        pins.append(make_pin(file, path, fork_path, text, None))
        seen.add(model_name(file))
    if directory is not None:
        dirs = list(search) + ([directory] if directory not in search else [])
        for fork_path in forks_in(directory):
            fork_text = read_fork_text(fork_path)
            files = fork_files(fork_text) if fork_text is not None else None
            if fork_text is None or files is None:
                continue
            for entry in files:
                if not isinstance(entry, dict) or not isinstance(entry.get("path"), str):
                    continue
                file = entry["path"].rsplit("/", 1)[-1]
                if not file.lower().endswith(".gguf") or model_name(file) in seen:
                    continue
                seen.add(model_name(file))
                pins.append(
                    make_pin(file, _find(file, dirs), fork_path, fork_text, _record_bytes(entry))
                )
    return Registry(pins, has_startup=startup is not None)
