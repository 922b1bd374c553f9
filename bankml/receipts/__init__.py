"""Signed receipts (version 2) and the checker anyone can run.

- keys.py: the Ed25519 signing key (keygen, load_key, key id, ``GET /bankml/key``'s body)
- canonical.py: the bytes a signature covers
- convert.py: a Responses or Messages request as the chat completion llama-server makes of it
- sign.py: today's receipt plus the replay facts, signed (build_receipt_v2)
- answer.py: a response read back as the receipt hashed it (JSON, SSE, NDJSON)
- check.py: check_receipt -> "valid" | "refuse: <reason>"
- replay.py: the request re-run on the exact engine or an unmodified llama-server
- cli.py: ``bankml check-receipt`` and ``bankml keygen``

No Twisted here: the serving code calls in, never the other way round.
"""

from bankml.receipts.check import check_receipt
from bankml.receipts.keys import KeyRefused, SigningKey, key_document, keygen, load_key
from bankml.receipts.sign import ReplayFacts, build_receipt_v2

__all__ = [
    "KeyRefused",
    "ReplayFacts",
    "SigningKey",
    "build_receipt_v2",
    "check_receipt",
    "key_document",
    "keygen",
    "load_key",
]
