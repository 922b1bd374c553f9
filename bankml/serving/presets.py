"""llama-server's ``--models-preset FILE`` (build 11434) in the drop-in's router mode.

```python
read_ini(path) -> dict[section, dict[key, value]]      # llama-server's INI grammar (PresetError)
load_presets(path, directory, cli) -> RouterPresets   # checked against bankml's flag verdicts
RouterPresets.models: dict[id, ModelPreset]           # every model: DIR's files, then the sections
RouterPresets.options_for(id) -> dict                 # bankml serve's options of that model
```

The file is an INI file as llama-server reads it: ``[section]`` lines, ``key = value`` lines
(a value ends at a ``;`` or ``#`` comment), comments and blank lines; a key before any section
belongs to no model (``version`` is skipped everywhere). ``[*]`` holds the options of every
model. Each other section is a model: a section named as a file of DIR (its name without
``.gguf``) adds options to that file, any other names a model of its own, whose ``model`` key
says its file. A key is a llama-server flag without its dashes, any spelling (``c``,
``ctx-size``), or its environment variable (``LLAMA_ARG_CTX_SIZE``: ``ENV_NAMES``); a flag without a value takes a boolean (``on``/``true``/``1``/``enabled`` or
their opposites; ``no-jinja = false`` is ``jinja``). Three keys are the preset's own:
``load-on-startup`` (the model is loaded, verified, at start), ``stop-timeout`` (read, and
without effect: bankml stops no child process) and ``dedup-cache-models`` (no effect:
llama-server hides its download cache's listing of a file a section downloads with
``hf-repo``; bankml lists no cache and refuses ``hf-repo``).

As llama-server's router, a model's options are ``[*]``'s, then its section's, then those the
command line gives over both (``-c 0`` too). Without DIR the sections are the models. bankml applies per model what its native engine keeps per model
(``PER_MODEL``: the context size, sampling defaults, ``-n``, the reasoning and chat-template
settings, ``--keep``, ``-b``/``-ub``, ``--context-shift``, ``--alias``, ``--tags``); any other
flag bankml serves holds for the whole server and is refused in a preset (give it on the
command line), a flag bankml ignores is ignored, one it refuses is refused with its reason,
each naming the section. A key that is no llama-server flag is refused with llama-server's
``option 'KEY' not recognized in preset 'NAME'``. Refusals are ``PresetError`` (the server does
not start).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from bankml.llama_server import (
    ENV_NAMES,
    FLAGS,
    IGNORE,
    MODEL,
    REFUSE,
    SERVE,
    UNKNOWN,
    Flag,
    value_refusal,
)
from bankml.registry.pins import Pin
from bankml.serving import router_status

TRUTHY = ("on", "enabled", "true", "1")
FALSEY = ("off", "disabled", "false", "0")
GLOBAL = "*"
PRESET_ONLY = ("load-on-startup", "stop-timeout", "dedup-cache-models")
# the preset's own keys spelled as llama-server's variables for them
_PRESET_ONLY_ENV = {f"__PRESET_{k.upper().replace('-', '_')}": k for k in PRESET_ONLY}

# the serve options each model keeps for itself (its engine's): the rest are server-wide
PER_MODEL = frozenset(
    {
        "ctx",
        "alias",
        "tags",
        "temp",
        "seed",
        "top-k",
        "top-p",
        "min-p",
        "top-nsigma",
        "xtc-probability",
        "xtc-threshold",
        "typical",
        "repeat-last-n",
        "repeat-penalty",
        "presence-penalty",
        "frequency-penalty",
        "dry-multiplier",
        "dry-base",
        "dry-allowed-length",
        "dry-penalty-last-n",
        "dynatemp-range",
        "dynatemp-exp",
        "mirostat",
        "mirostat-lr",
        "mirostat-ent",
        "samplers",
        "sampling-seq",
        "n-predict",
        "reasoning-budget",
        "reasoning-budget-message",
        "reasoning-format",
        "reasoning",
        "reasoning-effort",
        "reasoning-preserve",
        "no-reasoning-preserve",
        "chat-template-kwargs",
        "chat-template",
        "chat-template-file",
        "jinja",
        "no-jinja",
        "keep",
        "batch-size",
        "ubatch-size",
        "context-shift",
        "no-context-shift",
        "spm-infill",
    }
)

# every spelling of llama-server's flags, without its dashes (the preset's keys)
_BY_KEY: dict[str, Flag] = {s.lstrip("-"): f for f in FLAGS for s in f.spellings}

_BY_SPELLING: dict[str, Flag] = {s: f for f in FLAGS for s in f.spellings}


def _flag_of(key: str) -> Flag | None:
    """The llama-server flag a preset key names: a spelling without its dashes, or the flag's
    environment variable (``LLAMA_ARG_CTX_SIZE``; a switch's ``LLAMA_ARG_NO_`` variable names the
    switch itself, its value taken as given, as llama-server takes it)."""
    if key in _BY_KEY:
        return _BY_KEY[key]
    env = ENV_NAMES.get(key)
    if env is None and key.startswith("LLAMA_ARG_NO_"):
        positive = ENV_NAMES.get("LLAMA_ARG_" + key[len("LLAMA_ARG_NO_") :])
        env = positive if positive is not None and positive[1] else None
    return _BY_SPELLING[env[0]] if env is not None else None


_SECTION = re.compile(r"^[ \t]*\[[ \t]*([^\]]+?)[ \t]*\][ \t]*(?:[;#].*)?$")
_KEY_VALUE = re.compile(r"^([a-zA-Z_][a-zA-Z0-9_.-]*)[ \t]*=[ \t]*(.*?)[ \t]*(?:[;#].*)?$")
_BLANK = re.compile(r"^[ \t]*(?:[;#].*)?$")
_TAG = re.compile(r"[-.]([A-Z0-9_]+)$", re.IGNORECASE)


class PresetError(ValueError):
    """A preset file bankml cannot serve as given; the message is for the user."""


def read_ini(path: str) -> dict[str, dict[str, str]]:
    """The sections of a preset file and their keys, as llama-server parses it (a later key
    of a section, or a later section of one name, wins; a key before any section is in
    ``""``)."""
    if not os.path.exists(path):
        raise PresetError(f"preset file does not exist: {path}")
    try:
        with open(path, encoding="utf-8", newline="") as handle:
            text = handle.read()
    except (OSError, UnicodeDecodeError):
        raise PresetError(f"failed to open server preset file: {path}") from None
    parsed: dict[str, dict[str, str]] = {}
    section = ""
    for line in re.split(r"\r\n|\n|\r", text):
        header = _SECTION.match(line)
        if header:
            section = header.group(1)
            parsed[section] = {}
            continue
        pair = _KEY_VALUE.match(line)
        if pair:
            parsed.setdefault(section, {})[pair.group(1)] = pair.group(2)
            continue
        if not _BLANK.match(line):
            raise PresetError(f"failed to parse server config file: {path}")
    return parsed


def _canonical(name: str) -> str:
    """llama-server's section name: a ``:tag`` suffix's quantization in capitals."""
    if name == GLOBAL or ":" not in name:
        return name
    head, _, tag = name.rpartition(":")
    found = _TAG.search(tag)
    return f"{head}:{(found.group(1) if found else tag).upper()}"


@dataclass
class ModelPreset:
    """One model of the router: its id, where its options come from, its options as ``bankml
    serve``'s (option name -> value; a switch's value True), its file."""

    name: str
    source: str  # "models_dir" or "preset", as llama-server's listing says
    path: str | None  # the file (None: a section with no model key)
    options: dict[str, Any] = field(default_factory=dict)
    given: dict[str, str] = field(default_factory=dict)  # the keys as the file gave them
    load_on_startup: bool = False
    notes: list[str] = field(default_factory=list)
    dir_path: str | None = None  # its file in DIR, when it has one (llama-server's ``model``)

    @property
    def aliases(self) -> list[str]:
        return sorted({a.strip() for a in str(self.options.get("alias") or "").split(",")} - {""})

    @property
    def tags(self) -> list[str]:
        return sorted({t.strip() for t in str(self.options.get("tags") or "").split(",")} - {""})

    def status(
        self, cli: Mapping[Any, str], port: int, binary: Sequence[str]
    ) -> tuple[list[str], str]:
        """``status.args`` and ``status.preset`` of the model in ``GET /models``, as
        llama-server's router renders them (serving/router_status.py) from its file in DIR,
        the keys the preset gave it (``[*]``'s then its own) and the router's command line
        (``cli``: ``router_status.cli_options``)."""
        options = router_status.model_options(self.dir_path, self.given, cli)
        args = router_status.status_args(options, self.name, port, binary)
        return args, router_status.status_preset(self.name, options, self.name)


@dataclass
class RouterPresets:
    models: dict[str, ModelPreset]
    cli: dict[str, Any]  # the command line's per-model options (they win over every preset)

    def options_for(self, name: str) -> dict[str, Any]:
        """``bankml serve``'s per-model options of model ``name``: its preset's, the command
        line's over them."""
        model = self.models.get(name)
        out = dict(model.options) if model is not None else {}
        for key, value in self.cli.items():
            if value is None or value is False or (value == 0 and not isinstance(value, str)):
                continue  # not given on the command line
            out[key] = value
            flag = _BY_KEY.get(key)
            negation = _negation(flag) if flag is not None and not flag.takes_value else None
            if negation is not None and not self.cli.get(negation):
                out.pop(negation, None)
        return out

    def startup(self) -> list[str]:
        """The models ``load-on-startup`` names, by id."""
        return [name for name, m in sorted(self.models.items()) if m.load_on_startup]

    def _ranked(self) -> list[ModelPreset]:
        """The models, the one named after its file first (it has the file's own id)."""

        def own_name(m: ModelPreset) -> bool:
            return m.path is not None and os.path.basename(m.path) == f"{m.name}.gguf"

        return sorted(self.models.values(), key=lambda m: (not own_name(m), m.name))

    def model_of(self, path: str) -> str | None:
        """The id of the model served from ``path`` (None: none)."""
        real = os.path.realpath(path)
        for model in self._ranked():
            if model.path is not None and os.path.realpath(model.path) == real:
                return model.name
        return None

    def outside_pins(self, pins: Sequence[Pin]) -> list[Pin]:
        """Pins for the preset models whose file is outside the directory and pinned by a
        ``*.FORK.json`` beside it (not yet among ``pins``)."""
        from bankml.registry.create import _fork_pinning
        from bankml.registry.pins import make_pin, model_name

        known = {os.path.realpath(p.path) for p in pins if p.path is not None}
        names = {p.name for p in pins}
        out: list[Pin] = []
        for model in self._ranked():
            if model.path is None or not os.path.isfile(model.path):
                continue
            real = os.path.realpath(model.path)
            file = os.path.basename(model.path)
            if real in known or model_name(file) in names:
                continue
            found = _fork_pinning(os.path.dirname(os.path.abspath(model.path)), file)
            if found is not None:
                out.append(make_pin(file, model.path, found[0], found[1], None))
                known.add(real)
                names.add(model_name(file))
        return out

    def assign(self, pins: Sequence[Pin]) -> tuple[dict[str, Pin], dict[str, str]]:
        """({id: its pin}, {id: why it is refused}): each model served from the pin of its file;
        a file no fork pins, or one another model already serves, refused with the reason."""
        by_path = {os.path.realpath(p.path): p for p in pins if p.path is not None and p.sha256}
        served: dict[str, Pin] = {}
        refused: dict[str, str] = {}
        taken: dict[str, str] = {}
        for model in self._ranked():
            real = os.path.realpath(model.path) if model.path else ""
            pin = by_path.get(real)
            file = os.path.basename(model.path or "")
            if model.path is None or not os.path.isfile(model.path):
                refused[model.name] = f"{model.path}: no such file"
            elif pin is None:
                refused[model.name] = (
                    f"{file} is not pinned: no *.FORK.json of "
                    f"{os.path.dirname(os.path.abspath(model.path))} has its sha256"
                )
            elif pin.name in taken:
                refused[model.name] = (
                    f"bankml serves a pinned file as one model: {file} is model '{taken[pin.name]}'"
                )
            else:
                served[model.name] = pin
                taken[pin.name] = model.name
        return served, refused


def _truthy(section: str, key: str, value: str) -> bool:
    if value in TRUTHY:
        return True
    if value in FALSEY:
        return False
    raise PresetError(f"preset '{section}': option '{key}': invalid boolean value '{value}'")


def _negation(flag: Flag) -> str | None:
    """The serve option that says the opposite of a switch (``no-jinja`` for ``jinja``)."""
    name = flag.name
    other = name[3:] if name.startswith("no-") else f"no-{name}"
    return other if any(f.name == other and f.action == SERVE for f in FLAGS) else None


def _read_section(section: str, keys: Mapping[str, str], into: ModelPreset) -> None:
    """The keys of one section read into ``into`` (bankml serve's names), checked."""
    # llama-server keeps a section's keys sorted: of two spellings of one flag the later wins
    for key, value in sorted(keys.items()):
        if key == "version":
            continue
        key = _PRESET_ONLY_ENV.get(key, key)
        if key in PRESET_ONLY:
            into.given[key] = value
            if key == "load-on-startup":
                into.load_on_startup = _truthy(section, key, value)
            continue
        flag = _flag_of(key)
        if flag is None:
            raise PresetError(f"option '{key}' not recognized in preset '{section}'")
        into.given[key] = value
        where = f"preset '{section}': option '{key}'"
        if flag.action == MODEL:
            into.path = value
        elif flag.action == UNKNOWN:
            raise PresetError(f"{where}: not a llama-server (build 11434) flag bankml knows")
        elif flag.action == REFUSE:
            raise PresetError(f"{where}: {flag.reason}")
        elif flag.action == IGNORE:
            refused = value_refusal(flag, value if flag.takes_value else None)
            if refused is not None:
                raise PresetError(f"{where}: {refused}")
            into.notes.append(f"ignoring {where}: {flag.reason}")
        elif flag.action == SERVE:
            name = "ctx" if flag.name == "ctx-size" else flag.name
            if name not in PER_MODEL:
                raise PresetError(
                    f"{where}: bankml sets it for every model of the server (give "
                    f"{flag.spellings[0]} on the command line)"
                )
            if flag.takes_value:
                into.options[name] = value
            else:
                on = _truthy(section, key, value)
                negation = _negation(flag)
                for other in (name, negation):
                    if other:
                        into.options.pop(other, None)
                if on:
                    into.options[name] = True
                elif negation:
                    into.options[negation] = True
        else:  # OWN: --help, --version
            raise PresetError(f"{where}: not an option of a model")


def load_presets(path: str | None, directory: str | None, cli: Mapping[str, Any]) -> RouterPresets:
    """The router's models: each GGUF of ``directory`` (by its name without ``.gguf``), then
    the preset file's sections over them and ``[*]`` under every one. ``cli``: the command
    line's per-model options (``PER_MODEL`` names), which win. ``path`` None: DIR alone;
    ``directory`` None: the sections alone."""
    ini = read_ini(path) if path is not None else {}
    glob = ModelPreset(GLOBAL, "preset", None)
    _read_section(GLOBAL, ini.get(GLOBAL, {}), glob)
    if glob.path is not None:
        raise PresetError(f"preset '{GLOBAL}': option 'model': a model names its own file")
    models: dict[str, ModelPreset] = {}
    for file in sorted(os.listdir(directory)) if directory is not None else []:
        full = os.path.join(directory or "", file)
        if file.lower().endswith(".gguf") and os.path.isfile(full):
            name = file[: -len(".gguf")]
            models[name] = ModelPreset(name, "models_dir", full, dir_path=full)
    for raw, keys in ini.items():
        if raw in (GLOBAL, ""):
            continue
        name = _canonical(raw)
        own = ModelPreset(name, "preset", None)
        _read_section(name, keys, own)
        base = models.get(name)
        merged = ModelPreset(
            name,
            "preset",
            own.path or (base.path if base else None),
            dir_path=base.dir_path if base else None,
        )
        for source in (glob, own):
            merged.options.update(source.options)
            merged.given.update(source.given)
            merged.notes += source.notes
        merged.load_on_startup = own.load_on_startup or (
            glob.load_on_startup and "load-on-startup" not in own.given
        )
        if merged.path is None:
            raise PresetError(f"preset '{name}': no model file (a 'model' key)")
        if base is None and not os.path.isabs(merged.path):
            merged.path = os.path.abspath(merged.path)
        models[name] = merged
    for model in models.values():
        if model.source == "models_dir" and (glob.options or glob.given):
            model.options.update(glob.options)
            model.given.update(glob.given)
            model.load_on_startup = glob.load_on_startup
    return RouterPresets(models, {k: v for k, v in cli.items() if k in PER_MODEL})
