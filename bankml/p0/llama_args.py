"""llama-server's extra arguments in P0 (`bankml serve FILE --fork F --spawn BIN -- ARGS...`).

bankml appends them to the command line it launches llama-server with, and refuses (a usage
error, before anything starts) only those that would defeat the verification or the
supervision. Which flags those are, and why, is P0's column of llama-server's flag table
(bankml/llama_server.py, ``Flag.p0_reason``), read here as ``REFUSED``:

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
``--no-webui``: the table's ``DEFAULTS``) give way to the user's spelling of the same setting
(``llama_server.command_line``). llama-server matches its arguments exactly (``--a_b`` is read
as ``--a-b``, there is no ``--flag=value``), and so does this check. The environment variables
llama-server reads for the refused arguments (``LLAMA_ARG_MODEL``, ``LLAMA_ARG_HF_REPO``, ...)
are removed from the spawned engine's environment, so they cannot do what the command line may
not.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

# DEFAULTS (bankml's defaults, each with the spellings that replace it) is named here with
# P0's refusals
from bankml.llama_server import DEFAULTS as DEFAULTS
from bankml.llama_server import FLAGS, REFUSE, flag_name

# P0's column of the table: flag -> why it is refused
REFUSED: dict[str, str] = {
    s: f.p0_reason for f in FLAGS if f.p0_action == REFUSE for s in f.spellings
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


def refusal(extra: Sequence[str]) -> str | None:
    """Why these extra arguments are refused, or None when they may pass."""
    for arg in extra:
        reason = REFUSED.get(flag_name(arg))
        if reason is not None:
            return f"llama-server argument {arg} is refused: {reason}"
    return None


def value_of(extra: Sequence[str], spellings: frozenset[str]) -> str | None:
    """The value the extra arguments give a flag of these spellings (its last one, as
    llama-server reads them), or None."""
    value = None
    for i, arg in enumerate(extra):
        name, _, inline = arg.partition("=")
        if flag_name(name) in spellings:
            value = inline if inline else (extra[i + 1] if i + 1 < len(extra) else None)
    return value


CACHE_TYPE_K = frozenset(next(f.spellings for f in FLAGS if "-ctk" in f.spellings))
CACHE_TYPE_V = frozenset(next(f.spellings for f in FLAGS if "-ctv" in f.spellings))
RPC = frozenset(next(f.spellings for f in FLAGS if "--rpc" in f.spellings))


def engine_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The spawned engine's environment: bankml's, less what would do a refused flag's work."""
    return {k: v for k, v in environ.items() if k not in REFUSED_ENV}
