"""The bytes a version-2 receipt's signature covers.

``signed_bytes(receipt)`` is ``CONTEXT`` followed by the receipt without its ``signature`` and
``envelope`` fields
in bankml's canonical JSON: keys sorted, no whitespace (``,`` and ``:``), UTF-8, strings escaped
as JSON requires plus DEL as ``\\u007f``, an integral number written as an integer and any other
number as the shortest decimal that reads back as the same double (Python's ``repr``). NaN and
the infinities are not JSON and are refused. For receipts that is byte for byte what
``jq -cjS 'del(.signature, .envelope)'`` writes, so a shell with jq and openssl checks one
(docs/modules/receipts.md). A receipt is sent with its numbers already in this form
(``normalized``), so that jq versions that keep a number's text as written (1.7) agree too.
"""

from __future__ import annotations

import json
import time
from datetime import datetime, timezone
from typing import Any

CONTEXT = b"bankml-receipt-v2\n"  # keeps a receipt signature from meaning anything else
_EXACT_INT_LIMIT = 2**53


def normalized(value: Any) -> Any:
    """``value`` with every integral float an int (``1.0`` -> ``1``), as canonical JSON writes it."""
    if isinstance(value, float) and value.is_integer() and abs(value) < _EXACT_INT_LIMIT:
        return int(value)
    if isinstance(value, dict):
        return {k: normalized(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [normalized(v) for v in value]
    return value


def canonical_json(value: Any) -> bytes:
    text = json.dumps(
        normalized(value),
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=False,
        allow_nan=False,
    )
    return text.replace("\x7f", "\\u007f").encode("utf-8")


def signed_bytes(receipt: dict[str, Any]) -> bytes:
    """What the receipt's ``signature`` covers: every field but itself and the DSSE ``envelope``
    (envelope.py, signed on its own)."""
    return CONTEXT + canonical_json(
        {k: v for k, v in receipt.items() if k not in ("signature", "envelope")}
    )


def timestamp(now: float | None = None) -> str:
    """A receipt's time: UTC, RFC 3339 with milliseconds (such strings sort by time)."""
    moment = datetime.fromtimestamp(time.time() if now is None else now, timezone.utc)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")
