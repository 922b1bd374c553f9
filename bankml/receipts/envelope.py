"""A signed receipt as a DSSE envelope holding an in-toto Statement v1, the shape supply-chain
tools (in-toto, Sigstore, SLSA verifiers) check.

Every signed receipt carries its envelope as ``bankml_receipt.envelope``:

- ``payloadType``: ``application/vnd.in-toto+json``;
- ``payload``: base64 of the Statement in canonical JSON (canonical.py): ``_type`` the in-toto
  Statement v1 type, ``subject`` the model file (its basename, ``sha256``), the request body
  (``request``), the answer's text (``answer``) and, where the answer has them, its reasoning
  (``reasoning``) and tool calls (``tool_calls``), each with the receipt's own ``sha256``;
  ``predicateType`` ``PREDICATE_TYPE``; ``predicate`` the receipt's fields (all but
  ``signature`` and ``envelope``; schema: bankml/receipt-predicate.schema.json);
- ``signatures``: one, ``keyid`` the receipt key's id, ``sig`` base64 of the Ed25519 signature
  over DSSE's pre-authentication encoding of the type and the payload (``pae``).

``opened(envelope, public)`` checks one and returns its Statement (``EnvelopeRefused`` with the
reason otherwise); ``matches(statement, receipt)`` says where a Statement and a receipt
disagree. Pure Python.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Mapping
from typing import Any

from bankml.receipts.canonical import canonical_json, normalized
from bankml.receipts.keys import SigningKey, keyid_of, verifies

PAYLOAD_TYPE = "application/vnd.in-toto+json"
STATEMENT_TYPE = "https://in-toto.io/Statement/v1"  # the in-toto standard's own identifier
PREDICATE_TYPE = "urn:bankml:receipt:v2"
UNSIGNED = ("signature", "envelope")  # the receipt fields no signature covers
# the subjects besides the model file: (name, the receipt field holding its sha256)
DIGESTS = (
    ("request", "request_sha256"),
    ("answer", "response_sha256"),
    ("reasoning", "reasoning_sha256"),
    ("tool_calls", "tool_calls_sha256"),
)


class EnvelopeRefused(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def pae(payload_type: str, payload: bytes) -> bytes:
    """DSSE v1's pre-authentication encoding: what the signature covers."""
    kind = payload_type.encode("utf-8")
    return b"DSSEv1 %d %s %d %s" % (len(kind), kind, len(payload), payload)


def predicate_of(receipt: Mapping[str, Any]) -> dict[str, Any]:
    return normalized({k: v for k, v in receipt.items() if k not in UNSIGNED})


def statement(receipt: Mapping[str, Any], model_name: str) -> dict[str, Any]:
    """The in-toto Statement of a signed receipt for the model file named ``model_name``."""
    subjects = [{"name": model_name, "digest": {"sha256": receipt["model_sha256"]}}]
    subjects += [
        {"name": name, "digest": {"sha256": receipt[field]}}
        for name, field in DIGESTS
        if isinstance(receipt.get(field), str)
    ]
    return {
        "_type": STATEMENT_TYPE,
        "subject": subjects,
        "predicateType": PREDICATE_TYPE,
        "predicate": predicate_of(receipt),
    }


def envelope_of(receipt: Mapping[str, Any], model_name: str, key: SigningKey) -> dict[str, Any]:
    """The DSSE envelope of a signed receipt."""
    payload = canonical_json(statement(receipt, model_name))
    signature = key.sign(pae(PAYLOAD_TYPE, payload))
    return {
        "payloadType": PAYLOAD_TYPE,
        "payload": base64.b64encode(payload).decode("ascii"),
        "signatures": [{"keyid": key.keyid, "sig": base64.b64encode(signature).decode("ascii")}],
    }


def _b64(value: Any, what: str) -> bytes:
    if not isinstance(value, str):
        raise EnvelopeRefused(f"the envelope's {what} is not a base64 string")
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise EnvelopeRefused(f"the envelope's {what} is not valid base64") from None


def opened(envelope: Any, public: Any) -> dict[str, Any]:
    """The Statement of an envelope signed by ``public``'s key, once its type, signature and
    Statement hold."""
    if not isinstance(envelope, dict):
        raise EnvelopeRefused("the envelope is not a JSON object")
    if envelope.get("payloadType") != PAYLOAD_TYPE:
        raise EnvelopeRefused(
            f"the envelope's payloadType is {envelope.get('payloadType')!r}, not {PAYLOAD_TYPE}"
        )
    payload = _b64(envelope.get("payload"), "payload")
    signatures = envelope.get("signatures")
    if not isinstance(signatures, list) or not signatures:
        raise EnvelopeRefused("the envelope holds no signature")
    keyid = keyid_of(public)
    ours = [s for s in signatures if isinstance(s, dict) and s.get("keyid") == keyid]
    if not ours:
        raise EnvelopeRefused(f"the envelope is not signed by the key given ({keyid})")
    signature = _b64(ours[0].get("sig"), "signature")
    if len(signature) != 64 or not verifies(public, signature, pae(PAYLOAD_TYPE, payload)):
        raise EnvelopeRefused("the envelope's signature does not verify: it was changed")
    try:
        found = json.loads(payload)
    except (ValueError, RecursionError):
        raise EnvelopeRefused("the envelope's payload is not JSON") from None
    if not isinstance(found, dict) or found.get("_type") != STATEMENT_TYPE:
        raise EnvelopeRefused("the envelope's payload is not an in-toto Statement v1")
    if found.get("predicateType") != PREDICATE_TYPE:
        raise EnvelopeRefused(
            f"the Statement's predicateType is {found.get('predicateType')!r}, not {PREDICATE_TYPE}"
        )
    if not isinstance(found.get("predicate"), dict) or not isinstance(found.get("subject"), list):
        raise EnvelopeRefused("the Statement has no predicate object or no subject list")
    return found


def _unchecked_statement(envelope: Any) -> dict[str, Any]:
    """An envelope's payload read as JSON, its signature not checked ({} when unreadable)."""
    try:
        found = json.loads(base64.b64decode(envelope["payload"], validate=True))
    except (ValueError, KeyError, TypeError, binascii.Error, RecursionError):
        return {}
    return found if isinstance(found, dict) else {}


def claimed_predicate(envelope: Any) -> dict[str, Any]:
    """The predicate an envelope's payload holds, unchecked ({} when it has none): which key it
    names and when, to choose the key that must have signed it."""
    predicate = _unchecked_statement(envelope).get("predicate")
    return predicate if isinstance(predicate, dict) else {}


def model_name(envelope: Any) -> str:
    """The model file's name an envelope's Statement gives (``model`` when it gives none)."""
    subjects = _unchecked_statement(envelope).get("subject")
    names = (
        [s.get("name") for s in subjects if isinstance(s, dict)]
        if isinstance(subjects, list)
        else []
    )
    others = dict(DIGESTS)
    return next((n for n in names if isinstance(n, str) and n not in others), "model")


def subject_digests(found: Mapping[str, Any]) -> dict[str, Any]:
    """Each subject's name and sha256."""
    out = {}
    for subject in found.get("subject") or []:
        digest = subject.get("digest") if isinstance(subject, dict) else None
        if isinstance(digest, dict) and isinstance(subject.get("name"), str):
            out[subject["name"]] = digest.get("sha256")
    return out


def matches(found: Mapping[str, Any], receipt: Mapping[str, Any]) -> str | None:
    """Where an opened Statement and a receipt disagree (a subject's digest, the predicate),
    else None."""
    digests = subject_digests(found)
    others = dict(DIGESTS)
    if not any(
        digest == receipt.get("model_sha256") and name not in others
        for name, digest in digests.items()
    ):
        return "the Statement names no model file with the receipt's model_sha256"
    for name, field in DIGESTS:
        if digests.get(name) != receipt.get(field):
            return f"the Statement's {name} subject is not the receipt's {field}"
    if found["predicate"] != predicate_of(receipt):
        return "the Statement's predicate is not the receipt's fields"
    return None
