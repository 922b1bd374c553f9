"""``<name>.MODEL.json``: a derived model's manifest, written atomically and checked when read.

The manifest is written to ``<name>.MODEL.json.part``, flushed, then renamed over the final
name, so a reader sees the old manifest or the new one, never half of one. Its layout::

    {
     "kind": "bankml derived model (a layer over a pinned base; no weights)",
     "bankml": "<version>",
     "name": "<name>",
     "created_at": "<RFC 3339, 9 fractional digits>",
     "base": {"name": ..., "file": ..., "sha256": ..., "fork": ..., "path": ...},
     "layer": <the layer's content, byte for byte the text the digest covers>,
     "digest": "sha256:<hex>"
    }

Read back, the digest is recomputed from the layer; a manifest whose digest is not its
content's, or whose layer names another base than its ``base``, was edited by hand and is refused.
"""

from __future__ import annotations

import datetime as dt
import json
import os
from dataclasses import dataclass
from typing import Any

from bankml.registry.layer import Layer, LayerError, jstr
from bankml.version import __version__

SUFFIX = ".MODEL.json"
KIND = "bankml derived model (a layer over a pinned base; no weights)"
MAX_MANIFEST_BYTES = 16 * 1024 * 1024


class ManifestError(ValueError):
    """A manifest that cannot be used; the message says why (and what to do)."""


@dataclass(frozen=True)
class Base:
    name: str
    file: str
    sha256: str
    fork: str  # the FORK.json's name, in the registry directory
    path: str  # the canonical path the base was verified at

    def as_json(self) -> str:
        return (
            f'{{"name": {jstr(self.name)}, "file": {jstr(self.file)}, '
            f'"sha256": {jstr(self.sha256)}, "fork": {jstr(self.fork)}, "path": {jstr(self.path)}}}'
        )


@dataclass(frozen=True)
class Manifest:
    name: str
    created_at: str
    base: Base
    layer: Layer
    digest: str  # hex, without "sha256:"
    path: str = ""
    bankml: str = __version__

    def text(self) -> str:
        return (
            "{\n"
            f' "kind": {jstr(KIND)},\n'
            f' "bankml": {jstr(self.bankml)},\n'
            f' "name": {jstr(self.name)},\n'
            f' "created_at": {jstr(self.created_at)},\n'
            f' "base": {self.base.as_json()},\n'
            f' "layer": {self.layer.content()},\n'
            f' "digest": "sha256:{self.digest}"\n'
            "}\n"
        )


def rfc3339_ns(ns: int) -> str:
    """UTC, nine fractional digits, ``Z`` (the epoch is ``1970-01-01T00:00:00.000000000Z``)."""
    seconds, frac = divmod(ns, 1_000_000_000)
    when = dt.datetime(1970, 1, 1, tzinfo=dt.timezone.utc) + dt.timedelta(seconds=seconds)
    return when.strftime("%Y-%m-%dT%H:%M:%S") + f".{frac:09d}Z"


def parse_rfc3339(text: str) -> float:
    """Seconds since the epoch of a ``created_at`` (0 when it does not parse)."""
    try:
        head, _, frac = text.rstrip("Z").partition(".")
        when = dt.datetime.strptime(head, "%Y-%m-%dT%H:%M:%S").replace(tzinfo=dt.timezone.utc)
        return when.timestamp() + (float("0." + frac) if frac.isdigit() else 0.0)
    except ValueError:
        return 0.0


def manifest_path(directory: str, name: str) -> str:
    return os.path.join(directory, name + SUFFIX)


def write_manifest(directory: str, manifest: Manifest) -> str:
    """Write ``manifest`` as ``<dir>/<name>.MODEL.json`` through a ``.part`` file; its path."""
    final = manifest_path(directory, manifest.name)
    part = final + ".part"
    try:
        with open(part, "w", encoding="utf-8", newline="\n") as f:
            f.write(manifest.text())
            f.flush()
            os.fsync(f.fileno())
        os.replace(part, final)
    except OSError as err:
        try:
            os.unlink(part)
        except OSError:
            pass
        raise ManifestError(f"cannot write {final}: {err.strerror or err}") from None
    return final


def _field(doc: dict, key: str) -> str:
    value = doc.get(key)
    if not isinstance(value, str):
        raise ManifestError(f"its {key} is not a string")
    return value


def read_manifest(path: str) -> Manifest:
    """A manifest read back and checked; ManifestError with the reason otherwise."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_MANIFEST_BYTES + 1)
    except OSError as err:
        raise ManifestError(f"cannot read it: {err.strerror or err}") from None
    if len(raw) > MAX_MANIFEST_BYTES:
        raise ManifestError(f"larger than {MAX_MANIFEST_BYTES} bytes")
    try:
        doc: Any = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as err:
        raise ManifestError(f"not JSON ({err})") from None
    if not isinstance(doc, dict):
        raise ManifestError("not a JSON object")
    base_doc = doc.get("base")
    if not isinstance(base_doc, dict):
        raise ManifestError("its base is not an object")
    base = Base(*(_field(base_doc, k) for k in ("name", "file", "sha256", "fork", "path")))
    stated = _field(doc, "digest")
    try:
        layer = Layer.from_json(doc.get("layer"))
    except LayerError as err:
        raise ManifestError(
            f"its layer cannot be read ({err}): edited by hand, refused — create it again"
        ) from None
    want = layer.digest()
    if stated != f"sha256:{want}" or layer.base_sha256 != base.sha256:
        raise ManifestError(
            f"its digest {stated} is not its content's (sha256:{want}): edited by hand, "
            "refused — create it again"
        )
    name = _field(doc, "name")
    expected = os.path.basename(path)[: -len(SUFFIX)] if path.endswith(SUFFIX) else name
    if name != expected:
        raise ManifestError(
            f"it names itself {name!r} but is stored as {os.path.basename(path)}: renamed by "
            "hand, refused — copy it instead"
        )
    return Manifest(
        name=name,
        created_at=_field(doc, "created_at"),
        base=base,
        layer=layer,
        digest=want,
        path=path,
        bankml=str(doc.get("bankml") or ""),
    )


def manifests_in(directory: str) -> list[str]:
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return []
    return [os.path.join(directory, n) for n in names if n.endswith(SUFFIX)]
