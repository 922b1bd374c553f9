"""``create``, ``copy`` and ``delete`` of derived models, with their status lines.

``create`` takes a Spec (from a Modelfile or a structured ``/api/create``), resolves its FROM,
verifies the base in full (the guard, then its sha256 against its fork), merges the layer over a
derived parent, and writes ``<name>.MODEL.json``. Status lines, in order::

    parsing modelfile                                   (when a Modelfile was given)
    converting <dir> (safetensors) to <name>-F16.gguf   (FROM a directory)
    pinned <name>-F16.gguf sha256:<sha256> in <name>-F16.gguf.FORK.json
    verifying <file> (the guard, then its sha256 against <fork>)
    using existing layer sha256:<base sha256>
    creating system layer / parameters / license / messages layer   (as the layer has them)
    writing manifest <name>.MODEL.json (digest sha256:<digest>)
    success

**FROM**, first match wins: a path-like value (has ``/``, starts with ``.``, or ends ``.gguf``)
naming a directory, a Hugging Face safetensors checkout: ``bankml convert`` writes it into the
registry directory as ``<name>-F16.gguf`` and pins it in ``<name>-F16.gguf.FORK.json`` with its
provenance (refused when either file exists); a path-like value naming a file, whose basename must
be pinned by a ``*.FORK.json`` of the directory (the first in sorted order); a pin's name; a
derived model (it becomes the parent and its layer is inherited); a unique suffix-less alias. The
base's fork must be in the registry directory.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from bankml.gate import verify
from bankml.registry.catalog import Catalog, Derived, Target
from bankml.registry.layer import (
    Layer,
    LayerError,
    Spec,
    merge,
    number_parameter,
    spec_from_instructions,
)
from bankml.registry.manifest import (
    SUFFIX,
    Base,
    Manifest,
    manifest_path,
    rfc3339_ns,
    write_manifest,
)
from bankml.registry.modelfile import ROLES, ModelfileError, parse_modelfile
from bankml.registry.names import BadName, check_name, model_name, request_name
from bankml.registry.pins import NotFound, Pin, forks_in, make_pin, read_fork_text

StatusFn = Callable[[str], None]


class CreateError(Exception):
    """A create, copy or delete refused: HTTP ``status`` and the message."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass
class Created:
    manifest: Manifest
    path: str
    base_file: str
    status: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def _path_like(value: str) -> bool:
    return "/" in value or value.startswith(".") or value.lower().endswith(".gguf")


def _fork_pinning(directory: str, file: str) -> tuple[str, str] | None:
    """(fork path, text) of the first fork in ``directory`` that pins ``file``."""
    for fork_path in forks_in(directory):
        text = read_fork_text(fork_path)
        if text is None:
            continue
        try:
            if verify.pinned_sha256(text, file):
                return fork_path, text
        except verify.Refused:
            continue
    return None


@dataclass(frozen=True)
class _From:
    pin: Pin
    parent: Derived | None


def _convert_into(value: str, source: str, name: str, directory: str, status: StatusFn) -> str:
    """Convert the checkout ``source`` to ``<name>-F16.gguf`` in the registry; its path."""
    from bankml.convert import ConvertError, convert

    file = f"{name}-F16.gguf"
    out = os.path.join(directory, file)
    fork = out + ".FORK.json"
    for path in (out, fork):
        if os.path.lexists(path):
            raise CreateError(
                f"FROM {value}: {os.path.basename(path)} already exists in {directory}"
            )
    status(f"converting {source} (safetensors) to {file}")
    try:
        done = convert(source, out, fork)
    except ConvertError as err:
        raise CreateError(f"FROM {value}: refuse: {err.reason}") from None
    status(f"pinned {file} sha256:{done.sha256} in {os.path.basename(fork)}")
    return done.path


def resolve_from(
    value: str,
    catalog: Catalog,
    directory: str,
    relative_to: str | None,
    name: str | None = None,
    status: StatusFn = lambda line: None,
) -> _From:
    """FROM's model, first match wins (see the module's doc); ``name`` names a conversion."""
    if _path_like(value):
        candidate = os.path.expanduser(value)
        if not os.path.isabs(candidate) and relative_to is not None:
            candidate = os.path.join(relative_to, candidate)
        if os.path.isdir(candidate):
            if name is None:
                raise CreateError(f"FROM {value}: a directory is converted only by create")
            candidate = _convert_into(value, os.path.realpath(candidate), name, directory, status)
        if os.path.isfile(candidate):
            canonical = os.path.realpath(candidate)
            file = os.path.basename(canonical)
            found = _fork_pinning(directory, file)
            if found is None:
                raise CreateError(
                    f"FROM {value}: no *.FORK.json in {directory} pins {file}; pin it there first "
                    f"(bankml pin {canonical} --fork {os.path.join(directory, file)}.FORK.json)"
                )
            return _From(make_pin(file, canonical, found[0], found[1], None), None)
    n = request_name(value)
    registry = catalog.registry
    pin = registry.by_name(n)
    if pin is not None:
        return _From(pin, None)
    if n in catalog.derived:
        parent = catalog.derived[n]
        return _From(parent.pin, parent)
    pin = registry.by_alias(n)
    if pin is not None:
        return _From(pin, None)
    derived = catalog.derived_names()
    raise CreateError(
        f"FROM {value}: no such model — pins: {', '.join(registry.names()) or 'none'}"
        + (f"; derived: {', '.join(derived)}" if derived else "")
    )


def _verify_base(value: str, pin: Pin, directory: str, status: StatusFn) -> verify.Verified:
    fork_dir = os.path.realpath(os.path.dirname(pin.fork_path))
    if not pin.fork_text or fork_dir != os.path.realpath(directory):
        raise CreateError(
            f"FROM {value}: {pin.file} has no FORK.json in {directory}; a derived model's base "
            "is pinned in the registry directory"
        )
    if pin.path is None:
        raise CreateError(f"FROM {value}: {pin.file} is pinned but not on this machine")
    status(f"verifying {pin.file} (the guard, then its sha256 against {pin.fork_name})")
    try:
        return verify.verify(pin.path, pin.fork_path)
    except verify.Refused as err:
        raise CreateError(f"FROM {value}: refuse: {err.reason}") from None


def _layer_lines(layer: Layer) -> list[str]:
    lines = []
    if layer.system:
        lines.append("creating system layer")
    if layer.parameters or layer.stop:
        lines.append("creating parameters layer")
    if layer.license:
        lines.append("creating license layer")
    if layer.messages:
        lines.append("creating messages layer")
    return lines


def create(
    name: str,
    spec: Spec,
    catalog: Catalog,
    *,
    relative_to: str | None = None,
    parsed_modelfile: bool = False,
    status: StatusFn = lambda line: None,
    n_ctx: int | None = None,
    now_ns: Callable[[], int] = time.time_ns,
) -> Created:
    """Write the derived model ``name``; CreateError (400) with the reason when refused."""
    directory = catalog.directory
    if directory is None:
        raise CreateError("creating a model needs a registry directory (bankml serve --registry)")
    lines: list[str] = []

    def say(line: str) -> None:
        lines.append(line)
        status(line)

    try:
        name = check_name(name, set(catalog.registry.names()))
        if parsed_modelfile:
            say("parsing modelfile")
        spec.check()
        assert spec.base is not None
        found = resolve_from(spec.base, catalog, directory, relative_to, name, say)
        verified = _verify_base(spec.base, found.pin, directory, say)
        if found.parent is not None and found.parent.layer.base_sha256 != verified.sha256:
            raise CreateError(
                f"FROM {spec.base}: its base {found.pin.file} is {verified.sha256} now, not "
                f"{found.parent.layer.base_sha256} — create {found.parent.name} again"
            )
        say(f"using existing layer sha256:{verified.sha256}")
        header = found.pin.header
        layer = merge(
            spec,
            verified.sha256,
            found.parent.layer if found.parent else None,
            header.chat_template if header else None,
        )
    except (BadName, LayerError) as err:
        raise CreateError(str(err)) from None
    for line in _layer_lines(layer):
        say(line)
    base = Base(
        name=model_name(found.pin.file),
        file=found.pin.file,
        sha256=verified.sha256,
        fork=found.pin.fork_name,
        path=verified.path,
    )
    manifest = Manifest(
        name=name, created_at=rfc3339_ns(now_ns()), base=base, layer=layer, digest=layer.digest()
    )
    say(f"writing manifest {name}{SUFFIX} (digest sha256:{manifest.digest})")
    try:
        path = write_manifest(directory, manifest)
    except ValueError as err:
        raise CreateError(str(err), 500) from None
    say("success")
    warnings = []
    ctx = layer.parameters.get("num_ctx")
    if n_ctx is not None and ctx is not None and ctx > n_ctx:
        warnings.append(
            f"{name}: num_ctx {ctx} is larger than the context this server holds ({n_ctx}); "
            f"requests to it are refused until bankml serve runs with --ctx {ctx}"
        )
    return Created(manifest, path, found.pin.file, lines, warnings)


def spec_from_modelfile(text: str) -> Spec:
    try:
        return spec_from_instructions(parse_modelfile(text))
    except (ModelfileError, LayerError) as err:
        raise CreateError(str(err)) from None


# -- /api/create's request ------------------------------------------------------------------------

REFUSED_CREATE_FIELDS = {
    "files": "files: bankml makes layers over pinned models; it takes no uploaded weights",
    "adapters": "adapters: LoRA adapters are not merged (bankml plays the pinned weights only)",
    "quantize": "quantize: bankml does not requantize; pin the quantized file you want",
}


def present(value: Any) -> bool:
    """A field counts as present unless it is null, false, "", [] or {}."""
    return value not in (None, False, "", [], {})


@dataclass(frozen=True)
class CreateRequest:
    name: str
    spec: Spec
    parsed_modelfile: bool
    stream: bool


def _strings(value: Any, what: str) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return list(value)
    raise CreateError(f"{what} must be a string or an array of strings")


def _structured_spec(obj: Mapping[str, Any]) -> Spec:
    spec = Spec()
    base = obj.get("from")
    if present(base):
        if not isinstance(base, str):
            raise CreateError("from must be a string")
        spec.base, spec.from_count = base, 1
    for key in ("system", "template"):
        value = obj.get(key)
        if value is not None:
            if not isinstance(value, str):
                raise CreateError(f"{key} must be a string")
            if value:
                setattr(spec, key, value)
    if present(obj.get("license")):
        spec.license = _strings(obj["license"], "license")
    params = obj.get("parameters")
    if params is not None:
        if not isinstance(params, dict):
            raise CreateError("parameters must be an object")
        for key, value in params.items():
            if value is None:
                continue
            if key == "stop":
                spec.stop.extend(_strings(value, "parameters.stop"))
                continue
            try:
                spec.parameters[key] = number_parameter(key, value)
            except LayerError as err:
                raise CreateError(str(err)) from None
    messages = obj.get("messages")
    if messages is not None:
        if not isinstance(messages, list):
            raise CreateError("messages must be an array")
        for m in messages:
            if not isinstance(m, dict) or m.get("role") not in ROLES:
                raise CreateError('each message needs a role: "system", "user" or "assistant"')
            content = m.get("content")
            if content is not None and not isinstance(content, str):
                raise CreateError("only text content is in scope")
            spec.messages.append((m["role"], content or ""))
    return spec


def create_request(obj: Any) -> CreateRequest:
    """/api/create's body: ``{model|name, modelfile}`` or the structured form, checked."""
    if not isinstance(obj, dict):
        raise CreateError("the request body must be a JSON object")
    name = obj.get("model") if obj.get("model") is not None else obj.get("name")
    if not isinstance(name, str) or not name.strip():
        raise CreateError("model is required (the name of the model to create)")
    for key, message in REFUSED_CREATE_FIELDS.items():
        if present(obj.get(key)):
            raise CreateError(message)
    stream = obj.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise CreateError("stream: true or false")
    modelfile = obj.get("modelfile")
    if modelfile is not None and not isinstance(modelfile, str):
        raise CreateError("modelfile must be a string")
    if modelfile:
        return CreateRequest(name, spec_from_modelfile(modelfile), True, stream is not False)
    return CreateRequest(name, _structured_spec(obj), False, stream is not False)


# -- copy and delete ------------------------------------------------------------------------------


def copy(source: str, destination: str, catalog: Catalog, **kwargs: Any) -> Created:
    """``destination`` as a layer over ``source`` with nothing added (the same digest); a pin's
    copy is an empty layer over it. 404 when the source does not exist."""
    try:
        target: Target = catalog.resolve(source)
    except NotFound as err:
        raise CreateError(str(err), 404) from None
    base = target.name if isinstance(target, Derived) else target.name
    spec = Spec(base=base, from_count=1)
    return create(destination, spec, catalog, **kwargs)


def delete(name: Any, catalog: Catalog) -> str:
    """Remove a derived model's manifest; its path. A pin: 400. Unknown: 404."""
    if not isinstance(name, str) or not name.strip():
        raise CreateError("model is required (the name of the model to delete)")
    n = request_name(name)
    if catalog.registry.by_name(n) is None and n in catalog.derived:
        path = catalog.derived[n].manifest.path or manifest_path(catalog.directory or "", n)
        try:
            os.unlink(path)
        except OSError as err:
            raise CreateError(f"cannot delete {path}: {err.strerror or err}", 500) from None
        return path
    try:
        catalog.registry.resolve(name)
    except NotFound:
        raise CreateError(f"model '{name}' not found", 404) from None
    raise CreateError(
        f"{name} is a pinned model: bankml does not delete pins over HTTP (its file and its "
        "FORK.json record stay; remove them by hand)"
    )


def copy_request(obj: Any) -> tuple[str, str]:
    """/api/copy's body: ``{source, destination}``, both non-empty strings."""
    if not isinstance(obj, dict):
        raise CreateError("the request body must be a JSON object")
    source, destination = obj.get("source"), obj.get("destination")
    if not (isinstance(source, str) and source.strip()):
        raise CreateError("source is required (the model to copy)")
    if not (isinstance(destination, str) and destination.strip()):
        raise CreateError("destination is required (the name of the copy)")
    return source, destination


def delete_request(obj: Any) -> str:
    """/api/delete's body: ``{model|name}``."""
    if not isinstance(obj, dict):
        raise CreateError("the request body must be a JSON object")
    name = obj.get("model") if obj.get("model") is not None else obj.get("name")
    if not (isinstance(name, str) and name.strip()):
        raise CreateError("model is required (the name of the model to delete)")
    return name
