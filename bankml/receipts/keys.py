"""The receipt signing key: Ed25519, one PEM file readable by its owner only.

``keygen(path)`` writes a new key (mode 0600, atomically, never over an existing file);
``load_key(path)`` reads one back and refuses a file others may read or that is not an Ed25519
private key, with the reason. The key id is the sha256 of the raw 32-byte public key, in hex: what
a receipt names and ``GET /bankml/key`` publishes (``key_document``).
"""

from __future__ import annotations

import hashlib
import os
import stat
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

ALG = "ed25519"
KEY_FILE_NAME = "receipt-key.pem"
KEY_ENV = "BANKML_RECEIPT_KEY"  # the key file when the command line names none


class KeyRefused(Exception):
    """A key file bankml will not use; ``reason`` says why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def raw_public_bytes(public: Ed25519PublicKey) -> bytes:
    return public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def keyid_of(public: Ed25519PublicKey) -> str:
    """sha256 of the raw public key, hex (``openssl pkey -pubin -outform DER | tail -c 32``)."""
    return hashlib.sha256(raw_public_bytes(public)).hexdigest()


def public_pem(public: Ed25519PublicKey) -> str:
    return public.public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    ).decode("ascii")


@dataclass(frozen=True)
class SigningKey:
    """A loaded private key with its public half's PEM and id."""

    private: Ed25519PrivateKey
    keyid: str
    public_key_pem: str
    path: str | None = None

    @classmethod
    def of(cls, private: Ed25519PrivateKey, path: str | None = None) -> SigningKey:
        public = private.public_key()
        return cls(private, keyid_of(public), public_pem(public), path)

    def sign(self, data: bytes) -> bytes:
        return self.private.sign(data)


def key_document(key: SigningKey) -> dict[str, str]:
    """The body of ``GET /bankml/key``."""
    return {"alg": ALG, "keyid": key.keyid, "public_key": key.public_key_pem}


def default_key_path(home: str | os.PathLike[str]) -> Path:
    """Where ``bankml serve`` keeps its key when given none: under ``HOME/.local/share/bankml``
    (the caller reads HOME)."""
    return Path(home) / ".local" / "share" / "bankml" / KEY_FILE_NAME


def key_path(
    given: str | os.PathLike[str] | None,
    environ: Mapping[str, str] = os.environ,
    home: str | os.PathLike[str] | None = None,
) -> Path:
    """The key file ``bankml serve`` and ``bankml keygen`` use: the one given, else
    ``$BANKML_RECEIPT_KEY``, else ``default_key_path`` under ``home`` (default: ``~``)."""
    if given:
        return Path(given)
    if environ.get(KEY_ENV):
        return Path(environ[KEY_ENV])
    return default_key_path(home if home is not None else os.path.expanduser("~"))


def keygen(path: str | os.PathLike[str]) -> SigningKey:
    """A new key at ``path``: written to a 0600 temporary file beside it, synced, then linked into
    place, so the file never exists half-written or readable by others. An existing file is
    refused (rotating a key is a new file; the old one's receipts need its public key)."""
    target = Path(path)
    if target.exists():
        raise KeyRefused(f"{target}: a file is already there (a new key goes to a new file)")
    target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    private = Ed25519PrivateKey.generate()
    pem = private.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    fd, tmp = tempfile.mkstemp(prefix=".receipt-key-", dir=target.parent)  # mode 0600
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(pem)
            out.flush()
            os.fsync(out.fileno())
        try:
            os.link(tmp, target)  # atomic, and fails rather than replace a key written meanwhile
        except FileExistsError:
            raise KeyRefused(f"{target}: a file is already there") from None
    finally:
        os.unlink(tmp)
    return SigningKey.of(private, str(target))


def load_key(path: str | os.PathLike[str]) -> SigningKey:
    """The key in ``path``; KeyRefused when it is missing, readable or writable by group or
    others, owned by another user, or not an unencrypted Ed25519 private key in PEM."""
    target = Path(path)
    try:
        info = target.stat()
        data = target.read_bytes()
    except OSError as err:
        raise KeyRefused(f"{target}: {err.strerror or err}") from None
    if not stat.S_ISREG(info.st_mode):
        raise KeyRefused(f"{target}: not a regular file")
    mode = stat.S_IMODE(info.st_mode)
    if mode & 0o077:
        raise KeyRefused(
            f"{target}: permissions {mode:04o} let others read or change the key "
            "(chmod 600 it, or make a new one)"
        )
    if hasattr(os, "geteuid") and info.st_uid != os.geteuid():
        raise KeyRefused(f"{target}: owned by uid {info.st_uid}, not by this user")
    try:
        private = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as err:
        raise KeyRefused(f"{target}: not a PEM private key bankml can read ({err})") from None
    if not isinstance(private, Ed25519PrivateKey):
        raise KeyRefused(f"{target}: a {type(private).__name__}, not an Ed25519 key")
    return SigningKey.of(private, str(target))


def ensure_key(path: str | os.PathLike[str]) -> tuple[SigningKey, bool]:
    """(the key at ``path``, whether it was just created): ``bankml serve``'s first start makes
    one; a later start loads it (and refuses it as ``load_key`` does)."""
    if not Path(path).exists():
        try:
            return keygen(path), True
        except KeyRefused:
            if not Path(path).exists():
                raise
    return load_key(path), False


def load_public_key(pem: str | bytes) -> Ed25519PublicKey:
    """A PEM public key (SubjectPublicKeyInfo), or ValueError saying why not."""
    data = pem.encode("ascii") if isinstance(pem, str) else pem
    try:
        public = serialization.load_pem_public_key(data)
    except (ValueError, TypeError) as err:
        raise ValueError(f"not a PEM public key ({err})") from None
    if not isinstance(public, Ed25519PublicKey):
        raise ValueError(f"a {type(public).__name__}, not an Ed25519 public key")
    return public


def verifies(public: Ed25519PublicKey, signature: bytes, data: bytes) -> bool:
    try:
        public.verify(signature, data)
    except InvalidSignature:
        return False
    return True
