"""``status.args`` and ``status.preset`` of a router model in ``GET /models``, rendered as
llama-server's router (build 11434) renders them.

```python
cli_options(argv) -> dict[Option, str]          # the router's command line, as a preset
model_options(dir_path, given, cli) -> dict      # one model's options: DIR's file, the preset, the command line
status_args(options, alias, port, binary) -> list[str]
status_preset(name, options) -> str
```

llama-server keeps a model's options in a map sorted by each option's first spelling
(``common_arg::operator<``) and writes each by its last (``common_preset::to_args``,
``to_ini``): a model of DIR starts from its file (``model``), then the preset's ``[*]`` and its
section (a key by any spelling or environment variable; a negation's value turned over:
``no-jinja = on`` is ``jinja = false``), then the router's own command line over both (a switch
``1``, its negation ``0``; a value as given; the last one given wins), less the router's own
options (``server-models.cpp`` ``unset_reserved_args``: ``--models-*``, the API keys, TLS files,
``--log-file``, and the command line's ``-m``, ``--mmproj``, ``--alias``, ``-hf``). ``args``
is the child's command line: the binary, then every option but a preset's own, with ``--host
127.0.0.1``, ``--port`` (0 until loaded), ``--alias ID`` and ``--log-colors off``
(``update_args``); a switch turned off is its negation, or left out without one. ``preset``
is the same options as an INI section, less the host, port, alias and tags.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from bankml.llama_options import OPTIONS

TRUTHY = ("on", "enabled", "true", "1")
FALSEY = ("off", "disabled", "false", "0")


@dataclass(frozen=True)
class Option:
    spellings: tuple[str, ...]  # llama-server's order: sorted by the first, written by the last
    negations: tuple[str, ...]
    takes_value: bool
    env: str
    preset_only: bool

    @property
    def key(self) -> str:
        """Its key in a rendered preset: the last spelling without its dashes."""
        return self.spellings[-1].lstrip("-")


ALL = tuple(Option(*row) for row in OPTIONS)
BY_SPELLING = {s: o for o in ALL for s in (*o.spellings, *o.negations)}
BY_KEY = {
    **{o.env: o for o in ALL if o.env},
    # get_env: a switch's LLAMA_ARG_NO_ variable names the switch itself (its value as given)
    **{o.env.replace("LLAMA_ARG_", "LLAMA_ARG_NO_"): o for o in ALL if o.env and o.negations},
    **{s.lstrip("-"): o for o in ALL for s in (*o.spellings, *o.negations)},
}
BY_ENV = {o.env: o for o in ALL if o.env}

# unset_reserved_args: never a child's; with the command line's model options too
RESERVED = frozenset(
    {
        "LLAMA_ARG_SSL_KEY_FILE",
        "LLAMA_ARG_SSL_CERT_FILE",
        "LLAMA_API_KEY",
        "LLAMA_ARG_API_KEY_FILE",
        "LLAMA_ARG_MODELS_DIR",
        "LLAMA_ARG_MODELS_MAX",
        "LLAMA_ARG_MODELS_PRESET",
        "LLAMA_ARG_MODELS_AUTOLOAD",
    }
)
CLI_ONLY = RESERVED | {
    "LLAMA_ARG_MODEL",
    "LLAMA_ARG_MMPROJ",
    "LLAMA_ARG_ALIAS",
    "LLAMA_ARG_HF_REPO",
    "LLAMA_ARG_LOG_FILE",
}
NOT_LISTED = RESERVED | {"LLAMA_ARG_HOST", "LLAMA_ARG_PORT", "LLAMA_ARG_ALIAS", "LLAMA_ARG_TAGS"}
CHILD_ADDR = "127.0.0.1"


def cli_options(argv: Sequence[str]) -> dict[Option, str]:
    """The router's command line as llama-server's ``load_from_args`` reads it (a long flag's
    ``_`` read as ``-``; ``--flag=value`` read as the value), less what it keeps to itself."""
    out: dict[Option, str] = {}
    i = 0
    while i < len(argv):
        arg, i = argv[i], i + 1
        inline = None
        if arg.startswith("--"):
            arg, eq, value = arg.partition("=")
            inline = value if eq else None
            arg = arg.replace("_", "-")
        option = BY_SPELLING.get(arg)
        if option is None:
            continue  # bankml's own (--fork, --listen ...)
        if option.takes_value:
            if inline is None:
                if i >= len(argv):
                    break
                inline, i = argv[i], i + 1
            out[option] = inline
        else:
            out[option] = "0" if arg in option.negations else "1"
    return {o: v for o, v in out.items() if o.env not in CLI_ONLY}


def _read(key: str, value: str) -> tuple[Option, str] | None:
    """A preset key and its value as llama-server's ``load_from_ini`` keeps them."""
    option = BY_KEY.get(key)
    if option is None:
        return None
    if option.negations and key in (n.lstrip("-") for n in option.negations):
        value = "false" if value in TRUTHY else "true"
    return option, value


def model_options(
    dir_path: str | None, given: Mapping[str, str], cli: Mapping[Option, str]
) -> dict[Option, str]:
    """One model's options: its file in DIR (``model``), the preset's keys (``[*]``'s then its
    section's, as given), the command line's over them."""
    out: dict[Option, str] = {}
    if dir_path is not None:
        out[BY_ENV["LLAMA_ARG_MODEL"]] = dir_path
    for key, value in given.items():
        read = _read(key, value)
        if read is not None:
            out[read[0]] = read[1]
    out.update(cli)
    return out


def _sorted(options: Mapping[Option, str]) -> list[tuple[Option, str]]:
    return sorted(options.items(), key=lambda item: item[0].spellings[0].encode())


def _child(options: Mapping[Option, str], alias: str, port: int) -> dict[Option, str]:
    out = {o: v for o, v in options.items() if o.env not in RESERVED}
    out[BY_ENV["LLAMA_ARG_HOST"]] = CHILD_ADDR
    out[BY_ENV["LLAMA_ARG_PORT"]] = str(port)
    out[BY_ENV["LLAMA_ARG_ALIAS"]] = alias
    out[BY_ENV["LLAMA_ARG_LOG_COLORS"]] = "off"  # bankml's log has no colours
    return out


def status_args(
    options: Mapping[Option, str], alias: str, port: int, binary: Sequence[str]
) -> list[str]:
    """``status.args``: the command line that serves the model (``binary`` first)."""
    out = list(binary)
    for option, value in _sorted(_child(options, alias, port)):
        if option.preset_only:
            continue
        if not option.takes_value:
            if value in FALSEY:
                if option.negations:
                    out.append(option.negations[-1])
                continue
            out.append(option.spellings[-1])
        else:
            out += [option.spellings[-1], value]
    return out


def status_preset(name: str, options: Mapping[Option, str], alias: str) -> str:
    """``status.preset``: the model's options as an INI section (no host, port, alias, tags)."""
    shown = {o: v for o, v in _child(options, alias, 0).items() if o.env not in NOT_LISTED}
    lines = [f"[{name}]"]
    lines += [f"{o.key} = {v.replace(chr(10), chr(92) + chr(10))}" for o, v in _sorted(shown)]
    return "\n".join(lines) + "\n\n"
