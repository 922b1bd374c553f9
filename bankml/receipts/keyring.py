"""Key rotation: the receipt keys a server signed with before, published with their validity.

``bankml keygen --rotate`` retires the key in ``FILE``: its public half goes into the keyring
``FILE.keyring.json`` with ``not_before`` (when it took over, where known) and ``not_after``
(now), and a new key replaces it in ``FILE``. ``bankml keygen --revoke KEYID --reason TEXT``
marks a retired key revoked (the current key is rotated first). ``GET /bankml/key`` publishes
the current key with ``since`` and every retired one under ``previous`` (``published``).

``TrustedKeys.of(text)`` reads what a checker is given: one PEM public key, or that published
document. ``for_receipt(receipt)`` is the key that may have signed a receipt: the one its
``keyid`` names, refused (``KeyNotTrusted``) when the document does not list it, when it was
revoked (with the reason), or when the receipt's ``timestamp`` falls outside the key's validity.
Pure Python.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from bankml.receipts.canonical import timestamp
from bankml.receipts.keys import (
    ALG,
    KeyRefused,
    SigningKey,
    key_document,
    keyid_of,
    load_key,
    load_public_key,
)


class KeyNotTrusted(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def keyring_path(key_path: str | os.PathLike[str]) -> Path:
    return Path(f"{key_path}.keyring.json")


def read_keyring(key_path: str | os.PathLike[str] | None) -> list[dict[str, Any]]:
    """The retired keys of the key in ``key_path``, oldest first ([] when none)."""
    if key_path is None:
        return []
    path = keyring_path(key_path)
    try:
        entries = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return []
    except (OSError, ValueError) as err:
        raise KeyRefused(f"{path}: not a keyring bankml can read ({err})") from None
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise KeyRefused(f"{path}: not a list of keys")
    return entries


def _write_atomically(path: Path, data: bytes, mode: int) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent)
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def rotate(key_path: str | os.PathLike[str], now: float | None = None) -> SigningKey:
    """Retire the key in ``key_path`` into its keyring and put a new one in its place."""
    old = load_key(key_path)
    entries = read_keyring(key_path)
    entries.append(
        {
            "alg": ALG,
            "keyid": old.keyid,
            "public_key": old.public_key_pem,
            "not_before": entries[-1]["not_after"] if entries else None,
            "not_after": timestamp(now),
            "revoked": None,
        }
    )
    # the keyring first: a crash between the two leaves the old key current and listed, which
    # a later rotation repeats harmlessly
    ring = json.dumps(entries, indent=1).encode() + b"\n"
    _write_atomically(keyring_path(key_path), ring, 0o644)
    private = Ed25519PrivateKey.generate()
    pem = private.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    _write_atomically(Path(key_path), pem, 0o600)
    return SigningKey.of(private, str(key_path))


def revoke(
    key_path: str | os.PathLike[str], keyid: str, reason: str, now: float | None = None
) -> None:
    """Mark a retired key revoked: its receipts are refused from now on, with ``reason``."""
    current = load_key(key_path)
    if keyid == current.keyid:
        raise KeyRefused(f"{keyid} is the current key: rotate it first (keygen --rotate)")
    entries = read_keyring(key_path)
    for entry in entries:
        if entry.get("keyid") == keyid:
            entry["revoked"] = {"at": timestamp(now), "reason": reason}
            ring = json.dumps(entries, indent=1).encode() + b"\n"
            _write_atomically(keyring_path(key_path), ring, 0o644)
            return
    raise KeyRefused(f"no retired key {keyid} in {keyring_path(key_path)}")


def published(key: SigningKey) -> dict[str, Any]:
    """The body of ``GET /bankml/key``: the current key, since when, and the retired ones."""
    entries = read_keyring(key.path)
    return {
        **key_document(key),
        "since": entries[-1]["not_after"] if entries else None,
        "previous": entries,
    }


@dataclass
class TrustedKeys:
    """The keys a checker trusts: the current one and, from a published document, the retired
    ones with their validity."""

    current: Any
    since: str | None = None
    previous: dict[str, Mapping[str, Any]] = field(default_factory=dict)

    @classmethod
    def of(cls, given: str | bytes) -> TrustedKeys:
        """One PEM public key, or ``GET /bankml/key``'s document; ValueError saying why not."""
        text = given.decode("utf-8", "replace") if isinstance(given, bytes) else given
        if not text.lstrip().startswith("{"):
            return cls(load_public_key(text))
        try:
            document = json.loads(text)
            current = load_public_key(document["public_key"])
            previous = {e["keyid"]: e for e in document.get("previous") or []}
            for entry in previous.values():
                load_public_key(entry["public_key"])
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise ValueError(f"not a bankml key document ({err})") from None
        return cls(current, document.get("since"), previous)

    @property
    def keyid(self) -> str:
        return keyid_of(self.current)

    def for_receipt(self, receipt: Mapping[str, Any]) -> Any:
        """The public key that may have signed ``receipt``; KeyNotTrusted saying why none."""
        keyid, signed_at = receipt.get("keyid"), receipt.get("timestamp")
        if keyid == self.keyid:
            if self.since and isinstance(signed_at, str) and signed_at < self.since:
                raise KeyNotTrusted(
                    f"signed at {signed_at} by key {keyid}, which signs only since {self.since}"
                )
            return self.current
        entry = self.previous.get(keyid) if isinstance(keyid, str) else None
        if entry is None:
            raise KeyNotTrusted(f"signed by key {keyid}, not by the key given ({self.keyid})")
        revoked = entry.get("revoked")
        if revoked:
            raise KeyNotTrusted(
                f"signed by key {keyid}, revoked at {revoked.get('at')}: {revoked.get('reason')}"
            )
        start, end = entry.get("not_before"), str(entry.get("not_after"))
        if not isinstance(signed_at, str) or (start and signed_at < start) or signed_at > end:
            raise KeyNotTrusted(
                f"signed at {signed_at} by key {keyid}, valid from {start or 'its start'} to {end}"
            )
        return load_public_key(entry["public_key"])
