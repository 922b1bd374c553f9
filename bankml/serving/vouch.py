"""What bankml vouches for, in one place for every API and both modes.

- ``identity_problem(verified)``: before every answer, the file is still the one that was
  hashed (``FileIdent``: device, inode, size, mtime; one ``stat``, microseconds);
- ``issue_receipt(tally, verified, engine_name)``: after it, the answer's ``bankml_receipt``.

Pure Python: no Twisted (``bankml.chat`` uses it too).
"""

from __future__ import annotations

from typing import Any

from bankml.gate.fileident import FileIdent
from bankml.receipt import Tally, receipt

FILE_CHANGED = (
    "the model file changed since bankml verified it; restart bankml serve to verify it again"
)


def identity_problem(verified: Any) -> str | None:
    """None while the file is the one that was hashed (same device, inode, size, mtime)."""
    try:
        now = FileIdent.of(verified.path)
    except OSError as err:
        return f"{FILE_CHANGED} ({err.strerror or err})"
    return None if now == verified.ident else FILE_CHANGED


def issue_receipt(
    tally: Tally, verified: Any, engine_name: str, *, ttft_measured: bool = True
) -> dict[str, Any]:
    """The receipt of a finished answer from what was verified and the engine that answered.
    ``ttft_measured=False`` where bankml saw the text only whole (a non-streamed P0 answer)."""
    return receipt(
        tally,
        engine=engine_name,
        model_sha256=verified.sha256,
        guard=verified.guard.verdict,
        ttft_measured=ttft_measured,
    )
