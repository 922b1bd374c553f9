"""llama-server's command line (build 11434) as bankml takes it for ``--native``.

The flags, and what the native mode does with each, are the drop-in's column of llama-server's
flag table (``bankml.llama_server.FLAGS``, shared with P0's pass-through). Three uses:

- ``bankml serve --native`` takes the server flags bankml honours under llama-server's long
  names, with its meanings and defaults (``SERVE_PARAMETERS``, ``SERVE_SWITCHES``);
  ``native_settings`` checks them and turns them into what the engine and the site need.
- ``bankml llama-server --fork F -m FILE [llama-server's flags]`` takes llama-server's own
  argument list, every spelling of every flag (``-c``, ``--ctx-size``, ``-np``, ``-ctk`` ...):
  ``dropin_argv`` rewrites it into a ``bankml serve --native`` command line.
- docs/llama-server.md lists the same table for users.

Each flag is honoured (``SERVE``: it becomes a ``bankml serve`` option), ignored (``IGNORE``:
it cannot change an answer, because bankml computes the same bits on any thread count, batch
size, attention kernel or device), or refused (``REFUSE``) with the reason, before anything
listens. A spelling the drop-in does not list (``UNKNOWN`` rows, or none at all) is refused as
a flag bankml does not know.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from bankml.llama_server import FLAGS, IGNORE, MODEL, SERVE, UNKNOWN, Flag, value_refusal

if TYPE_CHECKING:
    from bankml.serving.presets import RouterPresets


class FlagError(ValueError):
    """A flag bankml refuses, or a value it cannot take; the message is for the user."""


# the drop-in's flags: every spelling of the table's rows it knows (the others are unknown here)
BY_SPELLING: dict[str, Flag] = {
    s: flag for flag in FLAGS if flag.action != UNKNOWN for s in flag.spellings
}

# bankml serve's own options that the drop-in form passes through as they are
BANKML_VALUE_OPTIONS = (
    "--fork",
    "--listen",
    "--receipt-key",
    "--receipt-log",
    "--max-queue",
    "--stop-timeout",  # router mode: an unloaded model's running generation's grace
    "--ollama-listen",  # Ollama's API on an address of its own, beside llama-server's
    "--models-memory",  # router mode: the resident models' memory budget
)

# the sampling flags: bankml serve's option -> (the request field it defaults, its reader)
SAMPLING: dict[str, tuple[str, Callable[[str], Any]]] = {
    "temp": ("temperature", float),
    "seed": ("seed", int),
    "top-k": ("top_k", int),
    "top-p": ("top_p", float),
    "min-p": ("min_p", float),
    "top-nsigma": ("top_n_sigma", float),
    "xtc-probability": ("xtc_probability", float),
    "xtc-threshold": ("xtc_threshold", float),
    "typical": ("typical_p", float),
    "repeat-last-n": ("repeat_last_n", int),
    "repeat-penalty": ("repeat_penalty", float),
    "presence-penalty": ("presence_penalty", float),
    "frequency-penalty": ("frequency_penalty", float),
    "dry-multiplier": ("dry_multiplier", float),
    "dry-base": ("dry_base", float),
    "dry-allowed-length": ("dry_allowed_length", int),
    "dry-penalty-last-n": ("dry_penalty_last_n", int),
    "dynatemp-range": ("dynatemp_range", float),
    "dynatemp-exp": ("dynatemp_exponent", float),
    "mirostat": ("mirostat", int),
    "mirostat-lr": ("mirostat_eta", float),
    "mirostat-ent": ("mirostat_tau", float),
    "samplers": ("samplers", lambda v: v.split(";")),  # names, ';'-separated
    "sampling-seq": ("samplers", str),  # one character per sampler
}

_OWN_OPTIONS = {"ctx", "threads", "slot-dir"}  # bankml serve already has these
SERVE_PARAMETERS: tuple[tuple[str, str], ...] = tuple(
    (f.name, f"llama-server's {f.spellings[0]} (docs/llama-server.md)")
    for f in FLAGS
    if f.action == SERVE and f.takes_value and f.name not in _OWN_OPTIONS
)
SERVE_SWITCHES: tuple[tuple[str, str], ...] = tuple(
    (f.name, f"llama-server's {f.spellings[0]} (docs/llama-server.md)")
    for f in FLAGS
    if f.action == SERVE and not f.takes_value
)
LLAMA_OPTION_NAMES = tuple(name for name, _ in SERVE_PARAMETERS + SERVE_SWITCHES)
# the flags of who may call the server: P0 takes them too (bankml checks them before forwarding)
ACCESS_OPTION_NAMES = frozenset(
    {
        "api-key",
        "api-key-file",
        "cors-origins",
        "cors-methods",
        "cors-headers",
        "cors-credentials",
        "no-cors-credentials",
    }
)

# flags of which llama-server keeps the last given: each drops those before it (with a value)
_JINJA = {"--jinja": False, "--no-jinja": False}
_VERBOSITY = {"--verbose": False, "--verbosity": True}
_PRESERVE = {"--reasoning-preserve": False, "--no-reasoning-preserve": False}
_UI = {"--ui": False, "--webui": False, "--no-ui": False, "--no-webui": False}
_SHIFT = {"--context-shift": False, "--no-context-shift": False}
_AUTOLOAD = {"--models-autoload": False, "--no-models-autoload": False}
_IDLE = {"--cache-idle-slots": False, "--no-cache-idle-slots": False}
_LAST_WINS = {
    "jinja": _JINJA,
    "no-jinja": _JINJA,
    "verbose": _VERBOSITY,
    "verbosity": _VERBOSITY,
    "reasoning-preserve": _PRESERVE,
    "no-reasoning-preserve": _PRESERVE,
    "ui": _UI,
    "no-ui": _UI,
    "context-shift": _SHIFT,
    "no-context-shift": _SHIFT,
    "models-autoload": _AUTOLOAD,
    "no-models-autoload": _AUTOLOAD,
    "cache-idle-slots": _IDLE,
    "no-cache-idle-slots": _IDLE,
}


def _dropped(args: list[str], options: Mapping[str, bool]) -> list[str]:
    """``args`` without any of ``options`` (each with its value when it takes one)."""
    out: list[str] = []
    skip = False
    for arg in args:
        if skip:
            skip = False
        elif arg in options:
            skip = options[arg]
        else:
            out.append(arg)
    return out


DEFAULT_PORT = 8080  # llama-server's
AUTO_PARALLEL = 4  # llama-server's -np -1 (auto): 4 slots, with a unified KV cache
DEFAULT_PARALLEL = 1  # bankml's default: one slot (llama-server's is auto)
DEFAULT_SLOT_PROMPT_SIMILARITY = 0.1


# --- the drop-in form -------------------------------------------------------------------------


def dropin_argv(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """``bankml llama-server`` arguments -> (``bankml serve`` arguments, notes on ignored
    flags). Raises FlagError for a refused or unknown flag, or a missing value."""
    out: list[str] = ["--native"]
    notes: list[str] = []
    model: str | None = None
    args = list(argv)
    i = 0
    while i < len(args):
        arg = args[i]
        i += 1
        spelling, eq, inline = arg.partition("=") if arg.startswith("--") else (arg, "", "")
        if spelling in BANKML_VALUE_OPTIONS or spelling in BY_SPELLING:
            flag = BY_SPELLING.get(spelling)
            takes_value = flag.takes_value if flag else True
            value: str | None = None
            if takes_value:
                if eq:
                    value = inline
                elif i < len(args):
                    value, i = args[i], i + 1
                else:
                    raise FlagError(f"{spelling} needs a value")
            elif eq:
                raise FlagError(f"{spelling} takes no value")
            if flag is None:  # bankml's own
                out += [spelling, str(value)]
            elif flag.action == MODEL:
                model = value
            elif flag.action == SERVE and flag.name in ("rerank", "pooling"):
                # llama-server's --rerank is --embeddings with pooling rank, in its place: a
                # --pooling after it wins (--embeddings stays), one before it does not
                if flag.name == "rerank":
                    out = _dropped(out, {"--pooling": True}) + ["--rerank"]
                else:
                    if "--rerank" in out:
                        out = _dropped(out, {"--rerank": False}) + ["--embeddings"]
                    out = _dropped(out, {"--pooling": True}) + ["--pooling", str(value)]
            elif flag.action == SERVE:
                if flag.name in _LAST_WINS:  # of these llama-server keeps the last given
                    out = _dropped(out, _LAST_WINS[flag.name])
                out += [f"--{flag.name}"] + ([str(value)] if takes_value else [])
            elif flag.action == IGNORE:
                refused = value_refusal(flag, value)
                if refused is not None:
                    raise FlagError(f"{spelling} {value}: {refused}")
                notes.append(f"ignoring {spelling}: {flag.reason}")
            else:
                raise FlagError(f"{spelling}: {flag.reason}")
        elif arg.startswith("-"):
            raise FlagError(f"{arg}: not a llama-server (build 11434) flag bankml knows")
        else:
            raise FlagError(f"{arg}: llama-server takes no positional argument (use -m FILE)")
    router = model is None and ("--models-dir" in out or "--models-preset" in out)
    if router:
        model = _router_startup(out)
        out += ["--router-argv", json.dumps(list(argv))]  # GET /models renders each model's
    elif "--models-preset" in out and "--models-dir" not in out:
        # llama-server's single-model mode (-m) does not read a preset: say so, as for a flag
        out = _dropped(out, {"--models-preset": True})
        notes.append("ignoring --models-preset: with -m one model is served and no preset read")
    if model is None and not router:
        raise FlagError(
            "-m FILE is required: the model to serve (or --models-dir DIR, --models-preset FILE)"
        )
    if "--ctx" not in out and not router:
        out += ["--ctx", "0"]  # llama-server's default -c 0: the model's training context
    # (in router mode a -c not given is no -c: each model's preset says its own, tap.py)
    # (a router with no pinned model has no FILE: it starts empty, as llama-server's can)
    return ([model] if model is not None else []) + out, notes


def _router_startup(out: list[str]) -> str | None:
    """llama-server's router mode (``--models-dir DIR`` or ``--models-preset FILE`` without
    ``-m``): the server's nominal model (its file verified before anything listens, nothing of
    it opened: the router starts with no model loaded, native/service.py), a pinned
    load-on-startup model of the preset, else the first model DIR pins (its ``*.FORK.json``;
    ``--fork`` is that fork unless given), else the first pinned model a preset section names;
    every model is served beside it (tap.py). None pinned: None, no FILE and no ``--fork``
    (the router starts with no startup model, as llama-server's starts with none loaded; its
    unpinned files are listed as refused, native/router.py ``RouterModels``)."""
    from bankml.registry.pins import discover

    directory: str | None = None
    pins: list[Any] = []
    if "--models-dir" in out:
        directory = out[len(out) - 1 - out[::-1].index("--models-dir") + 1]
        if not os.path.isdir(directory):
            raise FlagError(f"--models-dir {directory}: not a directory")
        pins = [p for p in discover(directory).pins if p.path is not None and p.sha256]
    if "--models-preset" in out:  # a pinned load-on-startup model first, if any
        from bankml.serving.presets import PresetError, load_presets

        preset = out[len(out) - 1 - out[::-1].index("--models-preset") + 1]
        try:
            found = load_presets(preset, directory, {})
        except PresetError as err:
            raise FlagError(str(err)) from None
        pins += found.outside_pins(pins)
        served, _ = found.assign(pins)
        first = [served[name] for name in found.startup() if name in served]
        pins = first + [p for p in pins if p not in first]
    if not pins:
        return None
    if "--fork" not in out:
        out += ["--fork", pins[0].fork_path]
    return str(pins[0].path)


# --- checking bankml serve's llama-server options ---------------------------------------------


def _number(name: str, text: str, read: Callable[[str], Any]) -> Any:
    try:
        return read(text)
    except ValueError:
        raise FlagError(f"--{name} {text}: not a number") from None


def check_model_settings(models: RouterPresets, options: Mapping[str, Any]) -> None:
    """Every router model's settings (``models``: serving/presets.py ``RouterPresets``) over the
    server's ``options``, as ``native_settings`` reads them; FlagError naming the model."""
    for name in models.models:
        try:
            native_settings({**options, **models.options_for(name)})
        except FlagError as err:
            raise FlagError(f"preset '{name}': {err}") from None


def native_settings(options: Mapping[str, Any]) -> dict[str, Any]:
    """What ``bankml serve --native``'s llama-server options mean, checked: the sampling
    defaults (a request body's fields), ``n_predict``, the reasoning budget and its message
    (``reasoning_budget``: a request's default ``reasoning_budget_tokens``), aliases, API keys, CORS, the chat
    template's source, the cache type, whether /metrics and GET /slots answer. Raises
    FlagError with the reason for a value bankml cannot honour."""
    sampling: dict[str, Any] = {}
    for name, (field, read) in SAMPLING.items():
        if options.get(name) is not None:
            sampling[field] = _number(name, options[name], read)
    if sampling:
        _check_sampling(sampling)
    n_predict = -1
    if options.get("n-predict") is not None:
        n_predict = _number("n-predict", options["n-predict"], int)
        if n_predict < -1:
            raise FlagError(f"--n-predict {n_predict}: -1 (no limit) or a number of tokens")
    reasoning_budget = -1
    if options.get("reasoning-budget") is not None:
        reasoning_budget = _number("reasoning-budget", options["reasoning-budget"], int)
        if reasoning_budget < -1:  # llama-server: "invalid value"
            raise FlagError(
                f"--reasoning-budget {reasoning_budget}: invalid value (-1: no limit, 0: end "
                "the reasoning at once, N: a budget of N tokens)"
            )
    n_parallel, kv_unified = _parallel(options)
    similarity = DEFAULT_SLOT_PROMPT_SIMILARITY
    if options.get("slot-prompt-similarity") is not None:
        similarity = _number("slot-prompt-similarity", options["slot-prompt-similarity"], float)
    aliases = sorted(
        {a.strip() for a in (options.get("alias") or "").split(",") if a.strip()}
    )  # llama-server keeps them in a std::set: the first in order names the model
    tags = sorted({t.strip() for t in (options.get("tags") or "").split(",") if t.strip()})
    return {
        "sampling": sampling,
        "n_predict": n_predict,
        "reasoning_budget": reasoning_budget,
        "reasoning_budget_message": str(options.get("reasoning-budget-message") or ""),
        **chat_settings(options),
        "aliases": aliases,
        "tags": tags,  # --tags: listed in /v1/models (informational)
        **access_settings(options),
        "jinja": not options.get("no-jinja"),
        "verbose": _verbose(options),
        "context_shift": bool(options.get("context-shift")),
        "spm_infill": bool(options.get("spm-infill")),  # /infill: the suffix before the prefix
        "speculative": _speculative(options),
        **_batch_sizes(options),
        "embedding": embedding_settings(options),
        "n_keep": _number("keep", options["keep"], int) if options.get("keep") is not None else 0,
        "chat_template": _chat_template(options),
        "cache_type": _cache_type(options),
        "metrics": bool(options.get("metrics")),
        "slots_endpoint": not options.get("no-slots"),
        "webui": not options.get("no-ui"),  # --no-ui / --no-webui: bankml's page left out
        "n_parallel": n_parallel,
        "kv_unified": kv_unified,
        "slot_prompt_similarity": similarity,
        # --cache-idle-slots (llama-server's default; it needs --cache-ram, 0 turns it off):
        # every task's launch saves the idle slots to the host prompt cache, and with -kvu
        # clears them, so their prompts no longer count in the next slot choice
        # (Engine.clear_idle_slots)
        "cache_idle_slots": not options.get("no-cache-idle-slots")
        and str(options.get("cache-ram", "")).strip() != "0",
    }


def _batch_sizes(options: Mapping[str, Any]) -> dict[str, int]:
    """-b and -ub; with --embeddings (or --rerank) llama-server lowers -b to -ub (an embedding is evaluated
    in one micro-batch), which cuts every prompt, a completion's too, in batches of -ub."""
    n_batch = _batch_size(options, "batch-size", 2048)
    n_ubatch = _batch_size(options, "ubatch-size", 512)
    if (options.get("embeddings") or options.get("rerank")) and n_batch > n_ubatch:
        n_batch = n_ubatch
    return {"n_batch": n_batch, "n_ubatch": n_ubatch}


POOLING_TYPES = ("none", "mean", "cls", "last", "rank")


def embedding_settings(options: Mapping[str, Any]) -> dict[str, Any]:
    """--embeddings, --pooling (none, mean, cls, last, rank; absent: the model's own),
    --embd-normalize (llama-server's default 2) and --rerank (alias --reranking: llama-server's
    --embeddings with pooling rank, whatever --pooling says: native/rerank.py)."""
    pooling = options.get("pooling")
    if pooling is not None and pooling not in POOLING_TYPES:
        raise FlagError(f"error: invalid parameter for argument: --pooling {pooling}")
    if options.get("rerank"):
        pooling = "rank"
    normalize = 2
    if options.get("embd-normalize") is not None:
        normalize = _number("embd-normalize", options["embd-normalize"], int)
    return {
        "enabled": bool(options.get("embeddings") or options.get("rerank")),
        "pooling": pooling,
        "embd_normalize": int(normalize),
    }


def _batch_size(options: Mapping[str, Any], name: str, default: int) -> int:
    """``-b`` / ``-ub`` (llama-server's defaults 2048 and 512), at least 1."""
    if options.get(name) is None:
        return default
    value = _number(name, options[name], int)
    if value < 1:
        raise FlagError(f"--{name} {value}: a batch holds at least one token")
    return int(value)


# the draftless kinds of --spec-type bankml follows, in llama-server's order of preference
SPEC_KINDS = ("ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache")

# the speculative flags llama-server checks, with its ranges and messages: (flag, kind, key,
# default, low, high, message)
_SPEC_SIZES = (
    (
        "spec-ngram-simple-size-n",
        "ngram-simple",
        "size_n",
        12,
        1,
        "ngram size N must be between 1 and 1024 inclusive",
    ),
    (
        "spec-ngram-simple-size-m",
        "ngram-simple",
        "size_m",
        48,
        1,
        "ngram size M must be between 1 and 1024 inclusive",
    ),
    *(
        (
            f"spec-{kind}-size-{letter.lower()}",
            kind,
            f"size_{letter.lower()}",
            default,
            1,
            f"ngram size {letter} must be between 1 and 1024 inclusive",
        )
        for kind in ("ngram-map-k", "ngram-map-k4v")
        for letter, default in (("N", 12), ("M", 48))
    ),
    (
        "spec-ngram-mod-n-match",
        "ngram-mod",
        "n_match",
        24,
        1,
        "ngram size N must be between 1 and 1024 inclusive",
    ),
    (
        "spec-ngram-mod-n-max",
        "ngram-mod",
        "n_max",
        64,
        0,
        "ngram n-max must be between 0 and 1024 inclusive",
    ),
    (
        "spec-ngram-mod-n-min",
        "ngram-mod",
        "n_min",
        48,
        0,
        "ngram n-min must be between 0 and 1024 inclusive",
    ),
)


def _speculative(options: Mapping[str, Any]) -> dict[str, dict[str, int]] | None:
    """``--spec-type`` (a comma-separated list, as llama-server's: ``none`` and the kinds of
    ``SPEC_KINDS`` are what bankml follows) and their sizes, checked as llama-server checks
    them: {kind: {size: value}} for each kind named, None without any."""
    kinds = [k.strip() for k in str(options.get("spec-type") or "none").split(",")]
    for kind in kinds:
        if kind != "none" and kind not in SPEC_KINDS:
            raise FlagError(
                f"--spec-type {kind}: bankml's native engine drafts only as "
                + ", ".join(SPEC_KINDS)
            )
    sizes: dict[str, dict[str, int]] = {kind: {} for kind in SPEC_KINDS}
    for name, kind, key, default, low, message in _SPEC_SIZES:
        value = default
        if options.get(name) is not None:
            value = _number(name, options[name], int)
            if not low <= value <= 1024:
                raise FlagError(f"--{name} {value}: {message}")
        sizes[kind][key] = value
    for kind in ("ngram-simple", "ngram-map-k", "ngram-map-k4v"):
        name = f"spec-{kind}-min-hits"  # read for every kind; only ngram-map-k4v uses it
        hits = 1 if options.get(name) is None else _number(name, options[name], int)
        if hits < 1:
            raise FlagError(f"--{name} {hits}: ngram min hits must be at least 1")
        if kind != "ngram-simple":
            sizes[kind]["min_hits"] = int(hits)
    chosen: dict[str, dict[str, int]] = {k: sizes[k] for k in sizes if k in kinds}
    return chosen or None


def _verbose(options: Mapping[str, Any]) -> bool:
    """The server-wide default of a request's ``verbose`` (llama-server's ``verbosity > 9``):
    on with ``-v`` (verbosity without limit) or ``-lv N`` above 9."""
    if options.get("verbose"):
        return True
    if options.get("verbosity") is None:
        return False
    return bool(_number("verbosity", options["verbosity"], int) > 9)


REASONING_FORMATS = ("none", "auto", "deepseek", "deepseek-legacy")


def chat_settings(options: Mapping[str, Any]) -> dict[str, Any]:
    """``--reasoning-format`` (none, auto, deepseek, deepseek-legacy; default auto),
    ``--reasoning`` (on/enabled/true/1, off/disabled/false/0, auto/-1: thinking on, off, or as
    the template decides; on and off also set the ``enable_thinking`` kwarg, as llama-server's
    flag does), ``--reasoning-effort LEVEL`` (the ``reasoning_effort`` kwarg; ``default``: none),
    ``--reasoning-preserve``/``--no-reasoning-preserve`` (the ``preserve_reasoning`` kwarg, true
    unless said otherwise, as llama-server's) and ``--chat-template-kwargs`` (a JSON object: the
    kwargs every chat request starts from). llama-server applies them in the order given; bankml
    applies them in this order, ``--chat-template-kwargs`` last."""
    reasoning_format = options.get("reasoning-format") or "auto"
    if reasoning_format not in REASONING_FORMATS:
        raise FlagError(
            f"--reasoning-format {reasoning_format}: Unknown reasoning format: {reasoning_format}"
        )
    kwargs: dict[str, Any] = {}
    value = str(options.get("reasoning") or "auto")
    if value in ("on", "enabled", "true", "1"):
        reasoning, kwargs["enable_thinking"] = "on", True
    elif value in ("off", "disabled", "false", "0"):
        reasoning, kwargs["enable_thinking"] = "off", False
    elif value in ("auto", "-1"):
        reasoning = "auto"
    else:
        raise FlagError(f"error: unknown value for --reasoning: '{value}'")
    effort = options.get("reasoning-effort")
    if effort is not None and effort != "default":  # "default": the template's own
        kwargs["reasoning_effort"] = str(effort)
    if options.get("reasoning-preserve") or options.get("no-reasoning-preserve"):
        kwargs["preserve_reasoning"] = not options.get("no-reasoning-preserve")
    given = options.get("chat-template-kwargs")
    if given is not None:
        try:
            parsed = json.loads(given)
        except ValueError as err:
            raise FlagError(f"--chat-template-kwargs: not JSON ({err})") from None
        if not isinstance(parsed, dict):
            raise FlagError("--chat-template-kwargs: must be a JSON object")
        kwargs.update(parsed)
    kwargs.setdefault("preserve_reasoning", True)  # llama-server's default when none says
    return {
        "reasoning_format": reasoning_format,
        "reasoning": reasoning,
        "chat_template_kwargs": kwargs,
    }


def _parallel(options: Mapping[str, Any]) -> tuple[int, bool]:
    """(slots, unified KV cache) as llama-server reads -np and -kvu: 0 is refused, a negative
    count (-1, auto) is 4 slots with a unified cache (whatever -no-kvu says, as there); any
    other count has a unified cache only with -kvu."""
    n = DEFAULT_PARALLEL
    if options.get("parallel") is not None:
        n = _number("parallel", options["parallel"], int)
        if n == 0:
            raise FlagError("--parallel 0: invalid value for n_parallel")
    if n < 0:
        return AUTO_PARALLEL, True
    return n, bool(options.get("kv-unified"))


def access_settings(options: Mapping[str, Any]) -> dict[str, Any]:
    """Who may call the server (``--api-key``, ``--api-key-file``, ``--cors-*``): the settings of
    ``serving.access.AccessControl``, in both modes. Raises FlagError for an unreadable key file."""
    return {
        "api_keys": _api_keys(options),
        "cors": {
            "origins": options.get("cors-origins") or "*",
            "methods": options.get("cors-methods") or "GET, POST, DELETE, OPTIONS",
            "headers": options.get("cors-headers") or "*",
            "credentials": not options.get("no-cors-credentials"),
        },
    }


def _check_sampling(sampling: Mapping[str, Any]) -> None:
    """The values as llama-server checks a request's, so a bad default is refused now."""
    from bankml.engine_cupy.sampler import SamplerError, SamplerParams

    try:
        SamplerParams.from_request(sampling, SamplerParams())
    except SamplerError as err:
        raise FlagError(f"sampling default refused: {err}") from None


def _api_keys(options: Mapping[str, Any]) -> list[str]:
    """--api-key's comma-separated keys, then --api-key-file's lines (# starts a comment)."""
    keys = [k for k in (options.get("api-key") or "").split(",") if k]
    path = options.get("api-key-file")
    if path:
        try:
            with open(path, encoding="utf-8") as handle:
                lines = handle.read().splitlines()
        except OSError as err:
            raise FlagError(f"--api-key-file {path}: {err.strerror or err}") from None
        keys += [line for line in lines if line and not line.startswith("#")]
    return keys


def _chat_template(options: Mapping[str, Any]) -> str | None:
    """The template source --chat-template or --chat-template-file gives (llama-server takes
    the value as Jinja source, ``chatml`` as its ChatML template), compiled now so a template
    that cannot run is refused before anything listens; with --no-jinja, a template none of
    llama.cpp's built-in ones (builtin_templates.py: a name such as ``llama3``, or a text it
    recognises) is refused with llama-server's message."""
    from bankml.engine_cupy import builtin_templates
    from bankml.engine_cupy.chat_template import (
        CHATML_TEMPLATE,
        TemplateError,
        compile_template,
    )

    source = options.get("chat-template")
    path = options.get("chat-template-file")
    if path:
        try:
            with open(path, encoding="utf-8") as handle:
                source = handle.read()
        except OSError as err:
            raise FlagError(f"--chat-template-file {path}: {err.strerror or err}") from None
    if source is None:
        return None
    if options.get("no-jinja") and not builtin_templates.supported(source):
        # common_chat_verify_template without Jinja: only llama.cpp's built-in templates
        raise FlagError(
            f"error: the supplied chat template is not supported: {source}\nnote: llama.cpp was "
            "started without --jinja, we only support commonly used templates"
        )
    if source == "chatml":
        return CHATML_TEMPLATE
    try:
        compile_template(source)
    except (TemplateError, Exception) as err:
        raise FlagError(f"chat template refused: {err}") from None
    return str(source)


def _cache_type(options: Mapping[str, Any]) -> str | None:
    """One type for K and V (bankml's cache keeps both alike): -ctk/-ctv, else the environment's
    BANKML_CACHE_TYPE, else None (f16)."""
    from bankml.engine_cupy.kv_cache import CACHE_TYPES

    k, v = options.get("cache-type-k"), options.get("cache-type-v")
    if k is None and v is None:
        return os.environ.get("BANKML_CACHE_TYPE")
    k, v = k or "f16", v or "f16"  # llama-server's default for each
    for given in (k, v):
        if given not in CACHE_TYPES:
            raise FlagError(f"cache type {given}: bankml keeps {' or '.join(CACHE_TYPES)}")
    if k != v:
        raise FlagError(
            f"-ctk {k} -ctv {v}: bankml's KV cache keeps K and V in one type; give the same"
        )
    return k


def engine_address(options: Mapping[str, Any]) -> str | None:
    """--host/--port as one engine address (llama-server's defaults fill the other half), or
    None when neither is given."""
    host, port = options.get("host"), options.get("port")
    if host is None and port is None:
        return None
    host = host or "127.0.0.1"
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{port or DEFAULT_PORT}"
