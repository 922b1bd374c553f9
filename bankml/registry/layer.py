"""A derived model's layer: what it sets over its base, the rules that build it, and its digest.

The layer holds a system prompt, sampling parameters, stop strings, messages, licences and a
``REQUIRES`` note; a ``TEMPLATE`` only when it is the base's own chat template (kept as its
sha256). No weights: a derived model plays its base, verified before every load.

**Parameters** are taken in this order: temperature, top_k, top_p, min_p, seed, num_ctx,
num_predict, repeat_penalty, repeat_last_n, presence_penalty, frequency_penalty. The integers
are top_k, seed, num_ctx, num_predict and repeat_last_n; the others are stored as f32 and must be
finite. ``stop`` accumulates; for any other name the last value wins.

**Content and digest.** The layer is written as one JSON text (``content``), keys in a fixed
order, strings escaped as ``jstr`` does (``"``, ``\\``, newline as ``\\n``, other control
characters as ``\\u00xx``, everything else raw), floats as the shortest digits that round-trip the
f32, never with an exponent and without ``.0`` on whole values (``0.7``, ``1``). The digest is
the sha256 of that text: it leaves out the name and the time, so a copy keeps it.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

PARAMS = (
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "seed",
    "num_ctx",
    "num_predict",
    "repeat_penalty",
    "repeat_last_n",
    "presence_penalty",
    "frequency_penalty",
)
INTEGER_PARAMS = frozenset({"top_k", "seed", "num_ctx", "num_predict", "repeat_last_n"})
# Refused with a reason of their own: samplers bankml's chain does not reproduce, and options
# that say how to run a model rather than what it answers.
NOT_REPRODUCED = frozenset(
    {
        "typical_p",
        "mirostat",
        "mirostat_eta",
        "mirostat_tau",
        "tfs_z",
        "min_keep",
        "penalize_newline",
    }
)
RESOURCE_OPTIONS = frozenset(
    {
        "num_thread",
        "num_gpu",
        "main_gpu",
        "num_batch",
        "num_keep",
        "use_mmap",
        "use_mlock",
        "low_vram",
        "numa",
        "vocab_only",
        "f16_kv",
        "logits_all",
    }
)


class LayerError(ValueError):
    """A layer bankml refuses to build; the message says which instruction and why."""


# -- text ---------------------------------------------------------------------------------------


def jstr(text: str) -> str:
    """A JSON string: ``"``, ``\\`` and newline escaped, other controls as ``\\u00xx``, the rest raw
    (a lone surrogate, which UTF-8 cannot carry, as its ``\\uXXXX`` escape)."""
    out = ['"']
    for ch in text:
        code = ord(ch)
        if ch == '"':
            out.append('\\"')
        elif ch == "\\":
            out.append("\\\\")
        elif ch == "\n":
            out.append("\\n")
        elif code < 0x20 or 0xD800 <= code <= 0xDFFF:
            out.append(f"\\u{code:04x}")
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


def f32_text(value: float) -> str:
    """The f32 nearest ``value`` in its shortest round-trip digits, positional (no exponent)."""
    return np.format_float_positional(np.float32(value), unique=True, trim="-")


def f32_value(value: float) -> float:
    """The number ``f32_text`` writes, as a Python float (``0.7``, not 0.699999988...)."""
    return float(f32_text(value))


def _value_text(name: str, value: int | float) -> str:
    return str(int(value)) if name in INTEGER_PARAMS else f32_text(value)


# -- the layer ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Layer:
    base_sha256: str
    system: str | None = None
    parameters: dict[str, int | float] = field(default_factory=dict)  # in PARAMS order
    stop: tuple[str, ...] = ()
    template_sha256: str | None = None
    license: tuple[str, ...] = ()
    messages: tuple[tuple[str, str], ...] = ()  # (role, content)
    requires: str | None = None

    def content(self) -> str:
        """The exact text the digest covers."""

        def opt(value: str | None) -> str:
            return "null" if value is None else jstr(value)

        params = ", ".join(f"{jstr(k)}: {_value_text(k, v)}" for k, v in self.parameters.items())
        messages = ", ".join(
            f'{{"role": {jstr(r)}, "content": {jstr(c)}}}' for r, c in self.messages
        )
        return (
            f'{{"base_sha256": {jstr(self.base_sha256)}, "system": {opt(self.system)}, '
            f'"parameters": {{{params}}}, "stop": [{", ".join(jstr(s) for s in self.stop)}], '
            f'"template_sha256": {opt(self.template_sha256)}, '
            f'"license": [{", ".join(jstr(s) for s in self.license)}], '
            f'"messages": [{messages}], "requires": {opt(self.requires)}}}'
        )

    def digest(self) -> str:
        return hashlib.sha256(self.content().encode("utf-8")).hexdigest()

    def options(self) -> dict[str, Any]:
        """The layer as Ollama ``options`` (its parameters, then ``stop`` when it has any)."""
        out: dict[str, Any] = dict(self.parameters)
        if self.stop:
            out["stop"] = list(self.stop)
        return out

    @classmethod
    def from_json(cls, obj: Any) -> Layer:
        """A layer read back from a manifest; LayerError when a field has the wrong shape."""
        if not isinstance(obj, dict):
            raise LayerError("layer is not an object")

        def text(key: str, nullable: bool = True) -> str | None:
            value = obj.get(key)
            if value is None and nullable:
                return None
            if not isinstance(value, str):
                raise LayerError(f"layer.{key} is not a string")
            return value

        def texts(key: str) -> tuple[str, ...]:
            value = obj.get(key, [])
            if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
                raise LayerError(f"layer.{key} is not a list of strings")
            return tuple(value)

        raw_params = obj.get("parameters", {})
        if not isinstance(raw_params, dict):
            raise LayerError("layer.parameters is not an object")
        params = {}
        for key, value in raw_params.items():
            if key not in PARAMS:
                raise LayerError(f"layer.parameters.{key} is not a layer parameter")
            params[key] = number_parameter(key, value)
        raw_messages = obj.get("messages", [])
        if not isinstance(raw_messages, list):
            raise LayerError("layer.messages is not a list")
        messages = []
        for m in raw_messages:
            if not (isinstance(m, dict) and isinstance(m.get("role"), str)):
                raise LayerError("layer.messages holds a message without a role")
            if not isinstance(m.get("content"), str):
                raise LayerError("layer.messages holds a message without text content")
            messages.append((m["role"], m["content"]))
        return cls(
            base_sha256=text("base_sha256", nullable=False) or "",
            system=text("system"),
            parameters=ordered(params),
            stop=texts("stop"),
            template_sha256=text("template_sha256"),
            license=texts("license"),
            messages=tuple(messages),
            requires=text("requires"),
        )


def ordered(params: Mapping[str, int | float]) -> dict[str, int | float]:
    return {k: params[k] for k in PARAMS if k in params}


# -- parameters ---------------------------------------------------------------------------------


def refuse_unknown(name: str) -> None:
    """Refuse a parameter name a layer does not take, with the reason for it."""
    if name in NOT_REPRODUCED:
        raise LayerError(
            f"PARAMETER {name}: not reproduced (bankml samples with llama-server's chain; "
            f"a layer takes {', '.join(PARAMS)} and stop)"
        )
    if name in RESOURCE_OPTIONS:
        raise LayerError(
            f"PARAMETER {name}: a resource option (how to run a model, not what it answers); "
            "bankml serve sets those"
        )
    raise LayerError(f"PARAMETER {name}: not a known parameter ({', '.join(PARAMS)} and stop)")


def text_parameter(name: str, text: str) -> int | float:
    """A Modelfile PARAMETER value: an integer for the integer names, else a finite f32."""
    if name not in PARAMS:
        refuse_unknown(name)
    stripped = text.strip()
    if name in INTEGER_PARAMS:
        body = stripped[1:] if stripped[:1] in "+-" else stripped
        if not body.isascii() or not body.isdigit():
            raise LayerError(f'PARAMETER {name} "{text}": not an integer')
        return int(stripped)
    try:
        value = float(stripped)
    except ValueError:
        raise LayerError(f'PARAMETER {name} "{text}": not a number') from None
    return _finite_f32(name, value, text)


def _finite_f32(name: str, value: float, shown: str) -> float:
    with np.errstate(over="ignore"):
        if not math.isfinite(value) or not math.isfinite(float(np.float32(value))):
            raise LayerError(f'PARAMETER {name} "{shown}": not a finite number')
    return f32_value(value)


def number_parameter(name: str, value: Any) -> int | float:
    """A structured (JSON) parameter value; ``parameters.<k>: must be a number`` otherwise."""
    if name not in PARAMS:
        refuse_unknown(name)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise LayerError(f"parameters.{name}: must be a number")
    if name in INTEGER_PARAMS:
        if isinstance(value, float) and not (math.isfinite(value) and value.is_integer()):
            raise LayerError(f'PARAMETER {name} "{value}": not an integer')
        return int(value)
    return _finite_f32(name, float(value), repr(value))


def check_ranges(params: Mapping[str, int | float]) -> None:
    """num_ctx >= 1, num_predict >= -2, repeat_penalty > 0; top_k, seed and the two penalties
    free; everything else >= 0."""
    for name, value in params.items():
        if name == "num_ctx":
            ok = value >= 1
        elif name == "num_predict":
            ok = value >= -2
        elif name == "repeat_penalty":
            ok = value > 0
        elif name in ("top_k", "seed", "presence_penalty", "frequency_penalty"):
            ok = True
        else:
            ok = value >= 0
        if not ok:
            raise LayerError(f"PARAMETER {name} {_value_text(name, value)}: out of range")


# -- what a create asks for, and the merge over a parent ----------------------------------------


@dataclass
class Spec:
    """What a Modelfile or a structured /api/create asks for (None: not said, so inherited)."""

    base: str | None = None  # FROM
    from_count: int = 0
    system: str | None = None
    template: str | None = None
    requires: str | None = None
    license: list[str] = field(default_factory=list)
    messages: list[tuple[str, str]] = field(default_factory=list)
    parameters: dict[str, int | float] = field(default_factory=dict)
    stop: list[str] = field(default_factory=list)
    adapter: bool = False

    def check(self) -> None:
        if self.from_count == 0 or not self.base:
            raise LayerError("no FROM line for the model was specified")
        if self.from_count > 1:
            raise LayerError("more than one FROM: a bankML model has one base")
        if self.adapter:
            raise LayerError(
                "ADAPTER: LoRA adapters are not merged (bankml plays the pinned weights only)"
            )


def split_message(value: str) -> tuple[str, str]:
    """A stored ``role: content`` message split at its first ``": "``."""
    role, _, content = value.partition(": ")
    return role, content


def merge(
    spec: Spec,
    base_sha256: str,
    parent: Layer | None,
    base_template: str | None,
) -> Layer:
    """The layer ``spec`` asks for over ``parent`` (a derived model FROM'd), range-checked.

    Parameters: the parent's, overridden key by key. Licences: the parent's, then the new ones.
    System, stop, messages and requires: the spec's, else the parent's. A TEMPLATE must be
    byte-equal to the base's own chat template; without one the parent's is kept.
    """
    inherited = parent or Layer(base_sha256)
    params = dict(inherited.parameters)
    params.update(spec.parameters)
    params = ordered(params)
    check_ranges(params)
    template_sha = inherited.template_sha256
    if spec.template is not None:
        if base_template is None or spec.template != base_template:
            raise LayerError(
                "TEMPLATE: the base's own chat template is used; a replacement template is not "
                "taken (a TEMPLATE line is accepted only when it is byte for byte the base's)"
            )
        template_sha = hashlib.sha256(spec.template.encode("utf-8")).hexdigest()
    return replace(
        inherited,
        base_sha256=base_sha256,
        system=spec.system if spec.system is not None else inherited.system,
        parameters=params,
        stop=tuple(spec.stop) if spec.stop else inherited.stop,
        template_sha256=template_sha,
        license=inherited.license + tuple(spec.license),
        messages=tuple(spec.messages) if spec.messages else inherited.messages,
        requires=spec.requires if spec.requires is not None else inherited.requires,
    )


_SEMVER = re.compile(
    r"(0|[1-9]\d*)(?:\.(0|[1-9]\d*)(?:\.(0|[1-9]\d*))?)?"
    r"(?:-[0-9A-Za-z-]+(?:\.[0-9A-Za-z-]+)*)?(?:\+[0-9A-Za-z-]+(?:\.[0-9A-Za-z-]+)*)?"
)


def requires_version(value: str) -> str:
    """REQUIRES: a semantic version (a leading ``v`` dropped), as Ollama takes it."""
    version = value[1:] if value.startswith("v") else value
    if not _SEMVER.fullmatch(version):
        raise LayerError(f'REQUIRES "{value}": requires must be a valid semver (e.g. 0.14.0)')
    return version


def spec_from_instructions(instructions: Sequence[Any]) -> Spec:
    """The rules over a parsed Modelfile: one FROM; the last SYSTEM, TEMPLATE and REQUIRES win;
    LICENSE, MESSAGE and PARAMETER stop accumulate; other parameters: the last value wins."""
    spec = Spec()
    for ins in instructions:
        if ins.name == "from":
            spec.from_count += 1
            spec.base = spec.base or ins.value
        elif ins.name == "system":
            spec.system = ins.value
        elif ins.name == "template":
            spec.template = ins.value
        elif ins.name == "requires":
            spec.requires = requires_version(ins.value)
        elif ins.name == "license":
            spec.license.append(ins.value)
        elif ins.name == "message":
            spec.messages.append((ins.arg, ins.value))
        elif ins.name == "adapter":
            spec.adapter = True
        elif ins.name == "parameter":
            if ins.arg == "stop":
                spec.stop.append(ins.value)
            else:
                spec.parameters[ins.arg] = text_parameter(ins.arg, ins.value)
    return spec
