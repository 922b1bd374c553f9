"""Name resolution over the pins and the derived models of a registry directory.

Order (``/v1`` and ``/api`` alike): a derived model when no pin has exactly that name; then the
pins (the startup model for a blank name, the exact name, the unique suffix-less alias); then a
derived model again; else 404 with every name. So ``mindx-gen39`` is a derived model when one
has that name, and ``mindx-gen39-f16`` the pin.

A derived model binds to the registry's pin with its base's sha256 (and a file), else to its
base's fork in the directory and the path it was verified at; a pin that now says another sha256
refuses it ("create it again"). Manifests that fail are skipped, with the reason kept.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

from bankml.registry.layer import Layer
from bankml.registry.manifest import Manifest, ManifestError, manifests_in, read_manifest
from bankml.registry.names import model_name, request_name, tag
from bankml.registry.pins import NotFound, Pin, Registry, make_pin, read_fork_text


@dataclass(frozen=True)
class Derived:
    """A derived model: its manifest and the pin it plays."""

    manifest: Manifest
    pin: Pin

    @property
    def name(self) -> str:
        return self.manifest.name

    @property
    def layer(self) -> Layer:
        return self.manifest.layer

    @property
    def parent_model(self) -> str:
        return tag(self.manifest.base.name)


Target = Pin | Derived


def pin_of(target: Target) -> Pin:
    return target.pin if isinstance(target, Derived) else target


def layer_of(target: Target) -> Layer | None:
    return target.layer if isinstance(target, Derived) else None


def bind(manifest: Manifest, registry: Registry, directory: str) -> Derived:
    """The pin a manifest's base is; ManifestError when its pin changed since it was created."""
    base = manifest.base
    for pin in registry.pins:
        if pin.sha256 == base.sha256 and pin.path is not None:
            return Derived(manifest, pin)
    fork_path = os.path.join(directory, base.fork)
    text = read_fork_text(fork_path) or ""
    path = base.path if os.path.isfile(base.path) else None
    pin = make_pin(base.file, path, fork_path, text, None)
    if pin.sha256 != base.sha256:
        raise ManifestError(
            f"its base {base.file} was {base.sha256} when it was created; the pin now says "
            f'"{pin.sha256}" — create it again'
        )
    return Derived(manifest, pin)


class Catalog:
    """The pins and derived models one server (or one ``create``) sees."""

    def __init__(
        self,
        registry: Registry,
        directory: str | None,
        derived: dict[str, Derived] | None = None,
        skipped: list[tuple[str, str]] | None = None,
    ) -> None:
        self.registry = registry
        self.directory = directory
        self.derived: dict[str, Derived] = dict(derived or {})
        self.skipped: list[tuple[str, str]] = list(skipped or [])

    @classmethod
    def load(
        cls,
        registry: Registry,
        directory: str | None,
        log: Callable[[str], None] = lambda line: None,
    ) -> Catalog:
        """The registry plus every good ``*.MODEL.json`` of ``directory`` (bad ones logged)."""
        derived: dict[str, Derived] = {}
        skipped: list[tuple[str, str]] = []
        if directory is not None:
            for path in manifests_in(directory):
                try:
                    model = bind(read_manifest(path), registry, directory)
                except ManifestError as err:
                    skipped.append((path, str(err)))
                    log(f"skipping {path}: {err}")
                    continue
                if registry.by_name(model.name) is None:
                    derived[model.name] = model
        return cls(registry, directory, derived, skipped)

    def reload(self, log: Callable[[str], None] = lambda line: None) -> Catalog:
        return Catalog.load(self.registry, self.directory, log)

    def derived_names(self) -> list[str]:
        return sorted(self.derived)

    def not_found(self, requested: str) -> NotFound:
        return self.registry.not_found(requested, self.derived_names())

    def resolve(self, requested: str | None) -> Target:
        """A request's ``model``: a pin or a derived model; NotFound (404) otherwise."""
        n = request_name(requested) if requested and requested.strip() else ""
        if n and self.registry.by_name(n) is None and n in self.derived:
            return self.derived[n]
        try:
            return self.registry.resolve(requested)
        except NotFound:
            pass
        if n in self.derived:
            return self.derived[n]
        raise self.not_found(requested or "")

    def shown_name(self, target: Target) -> str:
        """The name a target is listed and answered as, with its tag."""
        return tag(target.name if isinstance(target, Derived) else model_name(target.file))


MANIFEST_CHANGED = "its manifest changed since it was read"


def manifest_problem(target: Target) -> str | None:
    """Why a derived model's manifest may not play now: read again from disk, it no longer
    verifies (edited by hand, removed), or it is another manifest than the catalog read (made
    again since). None for a pin, or a manifest as it was read."""
    if not isinstance(target, Derived) or not target.manifest.path:
        return None
    try:
        now = read_manifest(target.manifest.path)
    except ManifestError as err:
        return str(err)
    if now.digest != target.manifest.digest:
        return MANIFEST_CHANGED
    return None


def stale_layer(target: Target, verified_sha256: str) -> str | None:
    """Why a derived model may not play over the file just verified (its pin moved on since the
    catalog was read), else None. Call after every load."""
    if isinstance(target, Derived) and target.layer.base_sha256 != verified_sha256:
        base = target.manifest.base
        return (
            f"its base {base.file} was {base.sha256} when it was created; the pin now says "
            f'"{verified_sha256}" — create it again'
        )
    return None
