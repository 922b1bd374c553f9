"""Receipts: what bankml vouches for on every answer, signed, and the checker anyone can run.

- kinds.py: the API kinds (a receipt's ``api``), one vocabulary for both modes
- tally.py: an answer's text, counts and timings as it is written, and the unsigned fields
- vouch.py: the identity check before every answer and the one receipt builder (it signs)
- keys.py: the Ed25519 signing key (keygen, load_key, key id, ``GET /bankml/key``'s body)
- canonical.py: the bytes a signature covers
- convert.py: a Responses or Messages request as the chat completion llama-server makes of it
- sign.py: the receipt plus the replay facts, signed (build_receipt_v2)
- answer.py: a response read back as the receipt hashed it (JSON, SSE, NDJSON)
- check.py: check_receipt -> "valid" | "refuse: <reason>"
- replay.py: the request re-run on the exact engine or an unmodified llama-server

``bankml check-receipt`` and ``bankml keygen`` are in ``bankml/cli/receipts.py``. This file imports
nothing, so a module that needs one receipt type loads only that module (no NumPy through here).
No Twisted in the package: the serving code calls in, never the other way round.
"""
