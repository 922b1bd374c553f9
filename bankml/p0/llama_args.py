"""llama-server's extra arguments (`bankml serve FILE --fork F --spawn BIN -- ARGS...`).

bankml appends them to the command line it launches llama-server with, and refuses (a usage
error, before anything starts) only those that would defeat the verification or the
supervision:

- another model, or a second file of weights the guard and the pin never saw: ``-m``, ``-mu``,
  ``-hf``/``-hff``/``-dr``, the ``--*-default`` presets (they download a model), ``--lora``,
  ``--control-vector`` (they change the weights' effect with a file bankml did not verify),
  ``-mm``/``-mmu`` (a projector file), ``-md``/``-hfd`` (a draft model file: it cannot change a
  greedy answer, but llama-server still parses a file that passed no guard), ``--override-kv``
  (rewrites the verified file's metadata, such as its tokenizer settings), and router mode's
  ``--models-*`` (no fixed model at all);
- what bankml's supervision relies on: ``--host``/``--port``/``--reuse-port`` (bankml chooses
  the address it checks), ``--api-prefix`` (moves every route away from where bankml forwards),
  ``--ssl-*`` (bankml speaks plain HTTP on loopback), ``--api-key``/``--api-key-file`` (bankml's
  own ``/props`` check before every answer would be refused);
- what bankml has its own option for (one way to set each): ``-t`` (``--threads``), ``-c``
  (``--ctx``), ``--slot-save-path`` (``--slot-dir``).

Everything else passes. bankml's own defaults (``-np 1``, ``--jinja``, ``--reasoning off``,
``--no-webui``) give way to the user's spelling of the same setting. llama-server matches its
arguments exactly (``--a_b`` is read as ``--a-b``, there is no ``--flag=value``), and so does
this check. The environment variables llama-server reads for the refused arguments
(``LLAMA_ARG_MODEL``, ``LLAMA_ARG_HF_REPO``, ...) are removed from the spawned engine's
environment, so they cannot do what the command line may not.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

_MODEL = "it loads a model other than the verified file"
_UNVERIFIED = "it loads a file of weights bankml did not verify"
_PRESET = "it downloads and serves another model"

# flag -> why it is refused
REFUSED: dict[str, str] = {
    **dict.fromkeys(
        ["-m", "--model", "-mu", "--model-url", "-dr", "--docker-repo", "-hf", "-hfr"], _MODEL
    ),
    **dict.fromkeys(["--hf-repo", "-hff", "--hf-file"], _MODEL),
    **dict.fromkeys(
        ["--models-dir", "--models-preset", "--models-max", "--models-autoload"], _MODEL
    ),
    **dict.fromkeys(
        [
            "--embd-gemma-default",
            "--fim-qwen-1.5b-default",
            "--fim-qwen-3b-default",
            "--fim-qwen-7b-default",
            "--fim-qwen-7b-spec",
            "--fim-qwen-14b-spec",
            "--fim-qwen-30b-default",
            "--gpt-oss-20b-default",
            "--gpt-oss-120b-default",
            "--vision-gemma-4b-default",
            "--vision-gemma-12b-default",
        ],
        _PRESET,
    ),
    **dict.fromkeys(
        [
            "--lora",
            "--lora-scaled",
            "--lora-init-without-apply",
            "--control-vector",
            "--control-vector-scaled",
            "--control-vector-layer-range",
        ],
        _UNVERIFIED + " (an adapter changes what the verified weights answer)",
    ),
    **dict.fromkeys(["-mm", "--mmproj", "-mmu", "--mmproj-url"], _UNVERIFIED + " (a projector)"),
    **dict.fromkeys(
        [
            "-md",
            "--model-draft",
            "--spec-draft-model",
            "-hfd",
            "-hfrd",
            "--hf-repo-draft",
            "--spec-draft-hf",
        ],
        _UNVERIFIED + " (a draft model)",
    ),
    "--override-kv": "it rewrites the verified file's metadata",
    **dict.fromkeys(
        ["--host", "--port", "--reuse-port"],
        "bankml chooses llama-server's address (--upstream) and checks it there",
    ),
    "--api-prefix": "it moves llama-server's routes away from where bankml forwards them",
    **dict.fromkeys(
        ["--ssl-key-file", "--ssl-cert-file"], "bankml speaks plain HTTP to llama-server"
    ),
    **dict.fromkeys(
        ["--api-key", "--api-key-file"],
        "bankml's own /props check before every answer would be refused",
    ),
    **dict.fromkeys(["-t", "--threads"], "use bankml's --threads"),
    **dict.fromkeys(["-c", "--ctx-size"], "use bankml's --ctx"),
    "--slot-save-path": "use bankml's --slot-dir",
}

# the environment variables llama-server reads for refused flags (common/arg.cpp's set_env)
REFUSED_ENV = frozenset(
    {
        "LLAMA_ARG_MODEL",
        "LLAMA_ARG_MODEL_URL",
        "LLAMA_ARG_DOCKER_REPO",
        "LLAMA_ARG_HF_REPO",
        "LLAMA_ARG_HF_FILE",
        "LLAMA_ARG_MODELS_DIR",
        "LLAMA_ARG_MODELS_PRESET",
        "LLAMA_ARG_MODELS_MAX",
        "LLAMA_ARG_MODELS_AUTOLOAD",
        "LLAMA_ARG_MMPROJ",
        "LLAMA_ARG_MMPROJ_URL",
        "LLAMA_ARG_SPEC_DRAFT_MODEL",
        "LLAMA_ARG_SPEC_DRAFT_HF_REPO",
        "LLAMA_ARG_HOST",
        "LLAMA_ARG_PORT",
        "LLAMA_ARG_REUSE_PORT",
        "LLAMA_ARG_API_PREFIX",
        "LLAMA_ARG_SSL_KEY_FILE",
        "LLAMA_ARG_SSL_CERT_FILE",
        "LLAMA_API_KEY",
        "LLAMA_ARG_API_KEY_FILE",
        "LLAMA_ARG_THREADS",
        "LLAMA_ARG_CTX_SIZE",
    }
)

# bankml's defaults, each with every spelling that sets the same thing: the user's wins
DEFAULTS: list[tuple[list[str], frozenset[str]]] = [
    (["-np", "1"], frozenset({"-np", "--parallel"})),
    (["--jinja"], frozenset({"--jinja", "--no-jinja"})),
    (["--reasoning", "off"], frozenset({"-rea", "--reasoning"})),
    (["--no-webui"], frozenset({"--ui", "--webui", "--no-ui", "--no-webui"})),
]


def flag_name(arg: str) -> str:
    """An argument as llama-server looks it up: ``_`` read as ``-`` in a long flag."""
    return arg.replace("_", "-") if arg.startswith("--") else arg


def refusal(extra: Sequence[str]) -> str | None:
    """Why these extra arguments are refused, or None when they may pass."""
    for arg in extra:
        reason = REFUSED.get(flag_name(arg))
        if reason is not None:
            return f"llama-server argument {arg} is refused: {reason}"
    return None


def defaults_for(extra: Sequence[str]) -> list[str]:
    """bankml's default arguments less those the user's extra arguments set themselves."""
    named = {flag_name(arg) for arg in extra}
    out: list[str] = []
    for args, spellings in DEFAULTS:
        if not named & spellings:
            out += args
    return out


def value_of(extra: Sequence[str], spellings: frozenset[str]) -> str | None:
    """The value the extra arguments give a flag of these spellings (its last one, as
    llama-server reads them), or None."""
    value = None
    for i, arg in enumerate(extra):
        name, _, inline = arg.partition("=")
        if flag_name(name) in spellings:
            value = inline if inline else (extra[i + 1] if i + 1 < len(extra) else None)
    return value


CACHE_TYPE_K = frozenset({"-ctk", "--cache-type-k"})


def engine_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The spawned engine's environment: bankml's, less what would do a refused flag's work."""
    return {k: v for k, v in environ.items() if k not in REFUSED_ENV}
