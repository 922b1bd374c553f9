"""What bankml vouches for, in one place for every API and both modes.

- ``identity_problem(verified)``: before every answer, the file is still the one that was
  hashed (``FileIdent``: device, inode, size, mtime; one ``stat``, microseconds);
- ``issue_receipt(tally, verified, engine_name, facts=..., key=...)``: after it, the answer's
  ``bankml_receipt``: today's fields from the tally, then, with a key, the replay facts added and
  the whole signed (version 2, bankml/receipts/sign.py) and put in a DSSE envelope
  (envelope.py). The one place a receipt is built and
  signed: native answers reach it through ``NativeEngine.receipt``, P0's through
  ``Gateway.receipt``;

Pure Python: no Twisted (``bankml.chat`` uses it too).
"""

from __future__ import annotations

import os
from typing import Any

from bankml.gate.fileident import FileIdent
from bankml.receipts.envelope import envelope_of
from bankml.receipts.keys import SigningKey
from bankml.receipts.sign import ReplayFacts, build_receipt_v2
from bankml.receipts.tally import Tally, receipt

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
    tally: Tally,
    verified: Any,
    engine_name: str,
    *,
    facts: ReplayFacts | None = None,
    key: SigningKey | None = None,
    ttft_measured: bool = True,
) -> dict[str, Any]:
    """The receipt of a finished answer from what was verified and the engine that answered.
    With ``key`` and ``facts`` it is the signed version-2 receipt; without a key (the Python
    API opened without one) today's unsigned receipt. ``ttft_measured=False`` where bankml saw
    the text only whole (a non-streamed P0 answer)."""
    base = receipt(
        tally,
        engine=engine_name,
        model_sha256=verified.sha256,
        guard=verified.guard.verdict,
        ttft_measured=ttft_measured,
    )
    if key is None or facts is None:
        return base
    signed = build_receipt_v2(base, facts, key)
    signed["envelope"] = envelope_of(signed, os.path.basename(str(verified.path)), key)
    return signed
