"""llama-server's command line (build 11434): what bankml does with each flag, and the command
line bankml launches llama-server with.

One table, ``FLAGS``, read by both modes that take llama-server's flags: bankml's verdicts on
each of llama-server's options (an option and its negation are two rows). llama-server's own
facts are not written here: a row names one spelling of the option, the one bankml puts first
(``first``: the name ``bankml serve`` takes, ``name``, unless ``serve_name`` gives another;
the one its messages show), and reads the option's other spellings
(``spellings``, in llama-server's order after ``first``) and whether it takes a value
(``takes_value``) from ``OPTIONS`` (bankml/llama_options.py, written from llama.cpp's
common/arg.cpp); ``ENV_NAMES`` (an option's environment variable) comes from there too. Each
row's verdicts, per mode:

- the native drop-in (``bankml llama-server`` and ``bankml serve --native``, read by
  serving/llama_flags.py): ``action`` is ``SERVE`` (it becomes a ``bankml serve`` option),
  ``IGNORE`` (it cannot change an answer), ``REFUSE`` (with ``reason``), ``MODEL`` (``-m``),
  ``OWN`` (``bankml llama-server`` answers it itself: its usage, its version) or ``UNKNOWN``
  (not among the drop-in's flags: refused there as any flag it does not know). Every option
  and negation of ``OPTIONS`` has a row with a verdict, and ``OPTIONS`` is llama-server's
  ``--help`` (tests/test_llama_help.py checks both);
- P0's pass-through (``bankml serve --spawn BIN -- ARGS``, read by p0/llama_args.py):
  ``p0_action`` is ``PASS`` (appended to llama-server's command line as given), ``REFUSE``
  (with ``p0_reason``: it would defeat the verification or the supervision) or ``DEFAULT``
  (bankml sets a default for it, ``p0_default``, which the user's spelling replaces).

``command_line`` builds the argument list of every llama-server bankml starts: P0's spawned
engine (process_protocol.py), the replay through an unmodified llama-server (receipts/replay.py)
and the tests' reference server. Each caller says what differs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from bankml.llama_options import OPTIONS

# the native drop-in's verdicts
SERVE, IGNORE, REFUSE, MODEL, UNKNOWN = "serve", "ignore", "refuse", "model", "unknown"
OWN = "own"  # bankml llama-server answers it itself and exits
# P0's verdicts (REFUSE as above)
PASS, DEFAULT = "pass", "default"

# bankml's defaults on the llama-server it starts (DEFAULTS: in this order)
PARALLEL_1 = ("-np", "1")
JINJA = ("--jinja",)
REASONING_OFF = ("--reasoning", "off")
NO_WEBUI = ("--no-webui",)
# its router's DEFAULT_STOP_TIMEOUT: the seconds a generation may go on on a model being unloaded
DEFAULT_STOP_TIMEOUT = 10


# llama-server's own facts, from its option table (bankml/llama_options.py, written from
# llama.cpp's common/arg.cpp): each spelling -> the spellings of its side of the option (the
# option's own, or its negations) in llama-server's order, and whether that side takes a value
# (a negation never does). A preset's own options (no command-line spelling) are not here.
_SIDES: dict[str, tuple[tuple[str, ...], bool]] = {
    s: side
    for spellings, negations, takes_value, _, preset_only in OPTIONS
    if not preset_only
    for side in ((spellings, takes_value), (negations, False))
    for s in side[0]
}


@dataclass(frozen=True)
class Flag:
    """bankml's verdicts on one side of one of llama-server's options (the option or its
    negation), keyed by ``first``; its spellings and whether it takes a value are llama-server's
    (``OPTIONS``)."""

    first: str  # the spelling bankml puts first: the long name bankml serve takes (``name``)
    action: str  # the native drop-in's: SERVE, IGNORE, REFUSE, MODEL, OWN or UNKNOWN
    reason: str = ""  # why the drop-in ignores or refuses it
    serve_name: str | None = None  # the bankml serve option, when not the first spelling
    p0_reason: str = ""  # why P0 refuses it ("": not refused)
    p0_default: tuple[str, ...] = ()  # bankml's default that it replaces in P0

    def __post_init__(self) -> None:
        if self.first not in _SIDES:
            raise KeyError(f"{self.first} is not one of llama-server's options (OPTIONS)")

    @property
    def spellings(self) -> tuple[str, ...]:
        """Every spelling of its side of the option: ``first``, then the others in
        llama-server's order."""
        return (self.first, *(s for s in _SIDES[self.first][0] if s != self.first))

    @property
    def takes_value(self) -> bool:
        return _SIDES[self.first][1]

    @property
    def name(self) -> str:
        return self.serve_name or self.first.lstrip("-")

    @property
    def p0_action(self) -> str:
        """P0's verdict: REFUSE, DEFAULT or PASS."""
        return REFUSE if self.p0_reason else DEFAULT if self.p0_default else PASS


def _f(
    first: str,
    action: str,
    reason: str = "",
    serve: str = "",
    *,
    p0_refuse: str = "",
    p0_default: tuple[str, ...] = (),
) -> Flag:
    return Flag(first, action, reason, serve or None, p0_refuse, p0_default)


# --- why the native drop-in ignores or refuses a flag -----------------------------------------
SAME_BITS = "bankml computes the same answer whatever this is set to"
LOGS = "it only changes llama-server's logging"
NO_UI = "bankml's web page is its own (no llama-server UI files or settings)"
PINNED = "bankml serves only the local file pinned in FORK.json"
CHANGES_MODEL = "it changes the model's computation; bankml serves the pinned model as it is"
PER_REQUEST = "bankml takes it per request only: send the field in the request body"
NOT_HERE = "bankml's native engine does not have this feature"
LOOPBACK = "bankml listens on loopback in plain HTTP only"
SPECULATIVE = (
    "bankml's native engine drafts only as --spec-type ngram-simple, ngram-map-k, "
    "ngram-map-k4v, ngram-mod or ngram-cache "
    "(speculative decoding)"
)
LOOKUP_FILES = (
    "bankml reads no n-gram lookup files (they are not pinned); --spec-type ngram-cache "
    "drafts from each slot's own history"
)
NO_MEDIA = "bankml reads no images, audio or video"
DEFAULT = "it is the default"
FLASH_ATTN_SAME = (
    "bankml computes the same answer with -fa on or auto (auto is on for the CPU); -fa off "
    "is refused"
)
FLASH_ATTN_OFF = (
    "bankml's native engine computes flash attention: llama-server's bits with -fa on or auto "
    "(auto is on for the CPU); with -fa off llama-server's attention rounds otherwise and its "
    "answers differ. Leave -fa out, or serve llama-server itself (bankml serve --spawn)"
)


def value_refusal(flag: Flag, value: str | None) -> str | None:
    """Why the native drop-in refuses an ignored flag with this value (None: it does not):
    ``-fa off`` changes llama-server's answers where ``on`` and ``auto`` do not; a value
    llama-server does not know, its own error."""
    if flag.name != "flash-attn" or value is None:
        return None
    if value in ("off", "disabled", "false", "0"):
        return FLASH_ATTN_OFF
    if value not in ("on", "enabled", "true", "1", "auto", "-1"):
        return f"unknown value for --flash-attn: '{value}'"
    return None


REMOVED = "llama-server 11434 refuses it too: it was removed"
HELP = "bankml llama-server answers it itself (its usage, its version) and exits"

# --- why P0 refuses a flag: it would defeat the verification or the supervision ---------------
P0_MODEL = "it loads a model other than the verified file"
P0_PRESET = "it downloads and serves another model"
_P0_UNVERIFIED = "it loads a file of weights bankml did not verify"
P0_ADAPTER = _P0_UNVERIFIED + " (an adapter changes what the verified weights answer)"
P0_PROJECTOR = _P0_UNVERIFIED + " (a projector)"
P0_DRAFT = _P0_UNVERIFIED + " (a draft model)"
P0_METADATA = "it rewrites the verified file's metadata"
P0_ADDRESS = "bankml chooses llama-server's address (--upstream) and checks it there"
P0_ROUTES = "it moves llama-server's routes away from where bankml forwards them"
P0_PLAIN_HTTP = "bankml speaks plain HTTP to llama-server"
P0_KEY = "bankml's own /props check before every answer would be refused"

# a row with neither p0_refuse nor p0_default passes in P0 as given
FLAGS: tuple[Flag, ...] = (
    _f("-m", MODEL, p0_refuse=P0_MODEL),
    # -- mapped onto bankml serve's own options
    _f("--ctx-size", SERVE, serve="ctx", p0_refuse="use bankml's --ctx"),
    _f("--threads", SERVE, p0_refuse="use bankml's --threads"),
    _f("--host", SERVE, p0_refuse=P0_ADDRESS),
    _f("--port", SERVE, p0_refuse=P0_ADDRESS),
    _f("--slot-save-path", SERVE, serve="slot-dir", p0_refuse="use bankml's --slot-dir"),
    # -- server-wide sampling defaults (a request's own field overrides them)
    _f("--n-predict", SERVE),
    _f("--temp", SERVE),
    _f("--seed", SERVE),
    _f("--top-k", SERVE),
    _f("--top-p", SERVE),
    _f("--min-p", SERVE),
    _f("--top-nsigma", SERVE),
    _f("--xtc-probability", SERVE),
    _f("--xtc-threshold", SERVE),
    _f("--typical", SERVE),
    _f("--repeat-last-n", SERVE),
    _f("--repeat-penalty", SERVE),
    _f("--presence-penalty", SERVE),
    _f("--frequency-penalty", SERVE),
    _f("--dry-multiplier", SERVE),
    _f("--dry-base", SERVE),
    _f("--dry-allowed-length", SERVE),
    _f("--dry-penalty-last-n", SERVE),
    _f("--dynatemp-range", SERVE),
    _f("--dynatemp-exp", SERVE),
    _f("--mirostat", SERVE),
    _f("--mirostat-lr", SERVE),
    _f("--mirostat-ent", SERVE),
    _f("--samplers", SERVE),
    _f("--sampling-seq", SERVE),
    _f("--reasoning-budget", SERVE),
    _f("--reasoning-format", SERVE),
    _f("--reasoning", SERVE, p0_default=REASONING_OFF),
    _f("--chat-template-kwargs", SERVE),
    _f("--reasoning-budget-message", SERVE),
    # -- the server
    _f("--alias", SERVE),
    _f("--api-key", SERVE, p0_refuse=P0_KEY),
    _f("--api-key-file", SERVE, p0_refuse=P0_KEY),
    _f("--chat-template", SERVE),
    _f("--chat-template-file", SERVE),
    # the last of the two wins, as in llama-server; without Jinja: llama.cpp's built-in templates
    _f("--jinja", SERVE, p0_default=JINJA),
    _f("--no-jinja", SERVE, p0_default=JINJA),
    # the server-wide default of a request's "verbose" (__verbose on answers): -v, or -lv above 9
    _f("--verbose", SERVE),
    # a generation that fills its slot shifts the context and goes on (off: it stops there);
    # --keep: a request's default n_keep (the tokens a shift keeps)
    _f("--context-shift", SERVE),
    _f("--spm-infill", SERVE),
    _f("--no-context-shift", SERVE),
    _f("--keep", SERVE),
    _f("--verbosity", SERVE),
    _f("--parallel", SERVE, p0_default=PARALLEL_1),
    _f("--metrics", SERVE),
    _f("--slots", SERVE),
    _f("--no-slots", SERVE),
    _f("--cors-origins", SERVE),
    _f("--cors-methods", SERVE),
    _f("--cors-headers", SERVE),
    _f("--cors-credentials", SERVE),
    _f("--no-cors-credentials", SERVE),
    _f("--cache-type-k", SERVE),
    _f("--cache-type-v", SERVE),
    _f("--cache-ram", SERVE),
    # -- accepted and ignored: they cannot change an answer
    _f("--flash-attn", IGNORE, FLASH_ATTN_SAME),
    _f("--gpu-layers", IGNORE, SAME_BITS + " (--device picks it)"),
    _f("--device", IGNORE, SAME_BITS + " (bankml serve --device picks it)"),
    _f("--split-mode", IGNORE, SAME_BITS),
    _f("--tensor-split", IGNORE, SAME_BITS),
    _f("--main-gpu", IGNORE, SAME_BITS),
    _f("--fit", IGNORE, SAME_BITS),
    _f("--fit-target", IGNORE, SAME_BITS),
    _f("--fit-ctx", IGNORE, SAME_BITS),
    # how a prompt is cut into passes: the kernels a row meets, so the bits (Engine.set_batch_sizes)
    _f("--batch-size", SERVE),
    _f("--ubatch-size", SERVE),
    _f("--threads-batch", IGNORE, SAME_BITS),
    _f("--threads-http", IGNORE, SAME_BITS),
    _f("--cpu-mask", IGNORE, SAME_BITS),
    _f("--cpu-range", IGNORE, SAME_BITS),
    _f("--cpu-strict", IGNORE, SAME_BITS),
    _f("--prio", IGNORE, SAME_BITS),
    _f("--poll", IGNORE, SAME_BITS),
    _f("--cpu-mask-batch", IGNORE, SAME_BITS),
    _f("--cpu-range-batch", IGNORE, SAME_BITS),
    _f("--cpu-strict-batch", IGNORE, SAME_BITS),
    _f("--prio-batch", IGNORE, SAME_BITS),
    _f("--poll-batch", IGNORE, SAME_BITS),
    _f("--numa", IGNORE, SAME_BITS),
    _f("--load-mode", IGNORE, SAME_BITS),
    _f("--lazy-mode", IGNORE, SAME_BITS),
    _f("--repack", IGNORE, SAME_BITS),
    _f("--no-repack", IGNORE, SAME_BITS),
    _f("--no-host", IGNORE, SAME_BITS),
    _f("--kv-offload", IGNORE, SAME_BITS),
    _f("--no-kv-offload", IGNORE, SAME_BITS),
    _f("--op-offload", IGNORE, SAME_BITS),
    _f("--no-op-offload", IGNORE, SAME_BITS),
    _f("--cont-batching", IGNORE, SAME_BITS),
    _f("--no-cont-batching", IGNORE, SAME_BITS),
    _f("--kv-unified", SERVE),
    _f("--no-kv-unified", SERVE),
    _f("--cache-idle-slots", SERVE),
    _f("--no-cache-idle-slots", SERVE),
    _f("--ctx-checkpoints", IGNORE, SAME_BITS),
    _f("--checkpoint-min-step", IGNORE, SAME_BITS),
    _f("--slot-prompt-similarity", SERVE),
    _f("--warmup", IGNORE, SAME_BITS),
    _f("--no-warmup", IGNORE, SAME_BITS),
    _f("--perf", IGNORE, SAME_BITS),
    _f("--no-perf", IGNORE, SAME_BITS),
    _f("--check-tensors", IGNORE, "bankml checks the whole file's sha256 before serving"),
    _f("--timeout", IGNORE, "bankml keeps its own read and write timeouts"),
    _f("--reuse-port", IGNORE, SAME_BITS, p0_refuse=P0_ADDRESS),
    _f("--sleep-idle-seconds", IGNORE, SAME_BITS),
    _f("--prefill-assistant", IGNORE, "it is the default"),
    _f("--cache-prompt", IGNORE, "it is the default"),
    _f("--offline", IGNORE, PINNED),
    _f("--ui", SERVE, p0_default=NO_WEBUI),
    _f("--no-ui", SERVE, p0_default=NO_WEBUI),
    _f("--log-disable", IGNORE, LOGS),
    _f("--log-file", IGNORE, LOGS),
    _f("--log-colors", IGNORE, LOGS),
    _f("--log-prefix", IGNORE, LOGS),
    _f("--no-log-prefix", IGNORE, LOGS),
    _f("--log-timestamps", IGNORE, LOGS),
    _f("--no-log-timestamps", IGNORE, LOGS),
    # -- refused natively, with the reason
    _f("--log-jsonl", IGNORE, LOGS),
    _f("--model-url", REFUSE, PINNED, p0_refuse=P0_MODEL),
    _f("--hf-repo", REFUSE, PINNED, p0_refuse=P0_MODEL),
    _f("--hf-file", REFUSE, PINNED, p0_refuse=P0_MODEL),
    _f("--hf-token", REFUSE, PINNED),
    _f("--docker-repo", REFUSE, PINNED, p0_refuse=P0_MODEL),
    _f("--models-dir", SERVE, p0_refuse=P0_MODEL),
    _f("--models-preset", SERVE, p0_refuse=P0_MODEL),
    _f("--models-max", SERVE, p0_refuse=P0_MODEL),
    _f("--lora", REFUSE, CHANGES_MODEL, p0_refuse=P0_ADAPTER),
    _f("--lora-scaled", REFUSE, CHANGES_MODEL, p0_refuse=P0_ADAPTER),
    _f("--control-vector", REFUSE, CHANGES_MODEL, p0_refuse=P0_ADAPTER),
    _f("--control-vector-scaled", REFUSE, CHANGES_MODEL, p0_refuse=P0_ADAPTER),
    _f("--override-kv", REFUSE, CHANGES_MODEL, p0_refuse=P0_METADATA),
    _f("--override-tensor", REFUSE, CHANGES_MODEL),
    _f("--rope-scaling", REFUSE, CHANGES_MODEL),
    _f("--rope-scale", REFUSE, CHANGES_MODEL),
    _f("--rope-freq-base", REFUSE, CHANGES_MODEL),
    _f("--rope-freq-scale", REFUSE, CHANGES_MODEL),
    _f("--yarn-orig-ctx", REFUSE, CHANGES_MODEL),
    _f("--yarn-ext-factor", REFUSE, CHANGES_MODEL),
    _f("--yarn-attn-factor", REFUSE, CHANGES_MODEL),
    _f("--yarn-beta-slow", REFUSE, CHANGES_MODEL),
    _f("--yarn-beta-fast", REFUSE, CHANGES_MODEL),
    _f("--mmproj", REFUSE, NOT_HERE + " (images, audio)", p0_refuse=P0_PROJECTOR),
    _f(
        "--model-draft",
        REFUSE,
        SPECULATIVE,
        p0_refuse=P0_DRAFT,
    ),
    # speculative decoding: llama-server's draftless n-gram drafts (speculative.py)
    _f("--spec-type", SERVE),
    _f("--spec-ngram-simple-size-n", SERVE),
    _f("--spec-ngram-simple-size-m", SERVE),
    _f("--spec-ngram-simple-min-hits", SERVE),
    _f("--spec-ngram-mod-n-min", SERVE),
    _f("--spec-ngram-mod-n-max", SERVE),
    _f("--spec-ngram-mod-n-match", SERVE),
    _f("--spec-ngram-map-k-size-n", SERVE),
    _f("--spec-ngram-map-k-size-m", SERVE),
    _f("--spec-ngram-map-k-min-hits", SERVE),
    _f("--spec-ngram-map-k4v-size-n", SERVE),
    _f("--spec-ngram-map-k4v-size-m", SERVE),
    _f("--spec-ngram-map-k4v-min-hits", SERVE),
    # embeddings: /v1/embeddings, /embedding(s) and Ollama's /api/embed (native/embed.py)
    _f("--embedding", SERVE, serve="embeddings"),
    # rerank: /rerank, /v1/rerank on a BERT reranker (native/rerank.py)
    _f("--rerank", SERVE, serve="rerank"),
    _f("--pooling", SERVE),
    _f("--props", REFUSE, "bankml does not change global properties while serving"),
    _f("--api-prefix", REFUSE, NOT_HERE, p0_refuse=P0_ROUTES),
    _f("--path", REFUSE, NO_UI),
    _f("--ssl-key-file", REFUSE, LOOPBACK, p0_refuse=P0_PLAIN_HTTP),
    _f("--ssl-cert-file", REFUSE, LOOPBACK, p0_refuse=P0_PLAIN_HTTP),
    _f("--tools", REFUSE, NOT_HERE),
    _f("--agent", REFUSE, NOT_HERE),
    _f("--ui-mcp-proxy", REFUSE, NOT_HERE),
    _f("--mcp-servers-config", REFUSE, NOT_HERE),
    _f("--mcp-servers-json", REFUSE, NOT_HERE),
    _f("--media-path", REFUSE, NOT_HERE),
    _f("--cache-reuse", REFUSE, PER_REQUEST + " (n_cache_reuse)"),
    _f("--no-cache-prompt", REFUSE, PER_REQUEST + " (cache_prompt)"),
    _f("--ignore-eos", REFUSE, PER_REQUEST + " (ignore_eos)"),
    _f("--logit-bias", REFUSE, PER_REQUEST + " (logit_bias)"),
    _f("--grammar", REFUSE, PER_REQUEST + " (grammar)"),
    _f("--grammar-file", REFUSE, PER_REQUEST + " (grammar)"),
    _f("--json-schema", REFUSE, PER_REQUEST + " (json_schema)"),
    _f("--json-schema-file", REFUSE, PER_REQUEST + " (json_schema)"),
    _f("--dry-sequence-breaker", REFUSE, PER_REQUEST + " (dry_sequence_breakers)"),
    _f("--sse-ping-interval", REFUSE, PER_REQUEST + " (sse_ping_interval)"),
    _f("--adaptive-target", REFUSE, "bankml's sampler has no adaptive-p"),
    _f("--adaptive-decay", REFUSE, "bankml's sampler has no adaptive-p"),
    _f("--backend-sampling", REFUSE, NOT_HERE),
    _f("--no-prefill-assistant", REFUSE, NOT_HERE),
    _f("--skip-chat-parsing", REFUSE, NOT_HERE),
    _f("--swa-full", REFUSE, NOT_HERE),
    _f("--list-devices", REFUSE, "bankml serve --device picks the device"),
    # -- refused in both modes
    _f("--models-autoload", SERVE, p0_refuse=P0_MODEL),
    _f("--embd-gemma-default", REFUSE, PINNED, p0_refuse=P0_PRESET),
    _f("--fim-qwen-1.5b-default", REFUSE, PINNED, p0_refuse=P0_PRESET),
    _f("--fim-qwen-3b-default", REFUSE, PINNED, p0_refuse=P0_PRESET),
    _f("--fim-qwen-7b-default", REFUSE, PINNED, p0_refuse=P0_PRESET),
    _f("--fim-qwen-7b-spec", REFUSE, PINNED, p0_refuse=P0_PRESET),
    _f("--fim-qwen-14b-spec", REFUSE, PINNED, p0_refuse=P0_PRESET),
    _f("--fim-qwen-30b-default", REFUSE, PINNED, p0_refuse=P0_PRESET),
    _f("--gpt-oss-20b-default", REFUSE, PINNED, p0_refuse=P0_PRESET),
    _f("--gpt-oss-120b-default", REFUSE, PINNED, p0_refuse=P0_PRESET),
    _f("--vision-gemma-4b-default", REFUSE, PINNED, p0_refuse=P0_PRESET),
    _f("--vision-gemma-12b-default", REFUSE, PINNED, p0_refuse=P0_PRESET),
    _f("--lora-init-without-apply", REFUSE, CHANGES_MODEL, p0_refuse=P0_ADAPTER),
    _f("--control-vector-layer-range", REFUSE, CHANGES_MODEL, p0_refuse=P0_ADAPTER),  # START END
    _f("--mmproj-url", REFUSE, PINNED, p0_refuse=P0_PROJECTOR),
    _f("--spec-draft-hf", REFUSE, PINNED, p0_refuse=P0_DRAFT),
    # -- llama-server's other flags (each of its --help has a row)
    _f("--help", OWN, HELP),
    _f("--version", OWN, HELP),
    _f("--cache-list", REFUSE, PINNED),
    _f("--completion-bash", REFUSE, "bankml's command line has no completion script"),
    _f("--tags", SERVE),
    _f("--reasoning-effort", SERVE),
    _f("--reasoning-preserve", SERVE),
    _f("--no-reasoning-preserve", SERVE),
    _f("--escape", IGNORE, "it only changes -r and --dry-sequence-breaker, refused here"),
    _f("--no-escape", IGNORE, "it only changes -r and --dry-sequence-breaker, refused here"),
    _f("--defrag-thold", IGNORE, SAME_BITS + " (llama-server ignores it too)"),
    _f("--rpc", IGNORE, SAME_BITS),
    _f("--cpu-moe", IGNORE, SAME_BITS),
    _f("--n-cpu-moe", IGNORE, SAME_BITS),
    _f("--n-cpu-ffn", IGNORE, SAME_BITS),
    _f("--no-log-jsonl", IGNORE, DEFAULT),
    _f("--log-prompts-dir", IGNORE, LOGS),
    _f("--no-mmproj", IGNORE, DEFAULT),
    _f("--mmproj-offload", IGNORE, NO_MEDIA),
    _f("--no-mmproj-offload", IGNORE, NO_MEDIA),
    _f("--mmproj-device", IGNORE, NO_MEDIA),
    _f("--image-min-tokens", IGNORE, NO_MEDIA),
    _f("--image-max-tokens", IGNORE, NO_MEDIA),
    _f("--mtmd-batch-max-tokens", IGNORE, NO_MEDIA),
    _f("--video-fps", IGNORE, NO_MEDIA),
    _f("--video-timestamp-interval", IGNORE, NO_MEDIA),
    _f("--video-ffmpeg-dir", IGNORE, NO_MEDIA),
    _f("--embd-normalize", SERVE),
    _f("--ui-config", IGNORE, NO_UI),
    _f("--ui-config-file", IGNORE, NO_UI),
    _f("--no-ui-mcp-proxy", IGNORE, DEFAULT),
    _f("--no-agent", IGNORE, DEFAULT),
    _f("--no-models-autoload", SERVE),
    _f("--no-skip-chat-parsing", IGNORE, DEFAULT),
    _f("--mmproj-auto", REFUSE, NOT_HERE + " (images, audio)"),
    _f("--special", REFUSE, NOT_HERE + " (special tokens in the answer's text)"),
    _f("--reverse-prompt", REFUSE, PER_REQUEST + " (stop)"),
    _f("--kv-unified-per-slot", REFUSE, NOT_HERE + " (a per-slot context limit)"),
    _f("--tools-runtime", REFUSE, NOT_HERE),
    _f("--lookup-cache-static", REFUSE, LOOKUP_FILES),
    _f("--lookup-cache-dynamic", REFUSE, LOOKUP_FILES),
    _f("--spec-default", REFUSE, SPECULATIVE),
    _f("--spec-draft-type-k", REFUSE, SPECULATIVE),
    _f("--spec-draft-type-v", REFUSE, SPECULATIVE),
    _f("--spec-draft-n-max", REFUSE, SPECULATIVE),
    _f("--spec-draft-n-min", REFUSE, SPECULATIVE),
    _f("--spec-synth-len", REFUSE, SPECULATIVE),
    _f("--spec-synth-rates", REFUSE, SPECULATIVE),
    _f("--spec-draft-p-split", REFUSE, SPECULATIVE),
    _f("--spec-draft-p-min", REFUSE, SPECULATIVE),
    _f("--spec-draft-backend-sampling", REFUSE, SPECULATIVE),
    _f("--no-spec-draft-backend-sampling", REFUSE, SPECULATIVE),
    _f("--spec-draft-sampling", REFUSE, SPECULATIVE),
    _f("--spec-draft-threads", REFUSE, SPECULATIVE),
    _f("--spec-draft-threads-batch", REFUSE, SPECULATIVE),
    _f("--spec-draft-cpu-mask", REFUSE, SPECULATIVE),
    _f("--spec-draft-cpu-range", REFUSE, SPECULATIVE),
    _f("--spec-draft-cpu-strict", REFUSE, SPECULATIVE),
    _f("--spec-draft-prio", REFUSE, SPECULATIVE),
    _f("--spec-draft-poll", REFUSE, SPECULATIVE),
    _f("--spec-draft-cpu-mask-batch", REFUSE, SPECULATIVE),
    _f("--spec-draft-cpu-strict-batch", REFUSE, SPECULATIVE),
    _f("--spec-draft-prio-batch", REFUSE, SPECULATIVE),
    _f("--spec-draft-poll-batch", REFUSE, SPECULATIVE),
    _f("--spec-draft-override-tensor", REFUSE, SPECULATIVE),
    _f("--spec-draft-cpu-moe", REFUSE, SPECULATIVE),
    _f(
        "--spec-draft-n-cpu-moe",
        REFUSE,
        SPECULATIVE,
    ),
    _f("--spec-draft-device", REFUSE, SPECULATIVE),
    _f("--spec-draft-ngl", REFUSE, SPECULATIVE),
    _f("--draft", REFUSE, REMOVED),
    _f("--draft-min", REFUSE, REMOVED),
    _f("--spec-ngram-size-n", REFUSE, REMOVED),
    _f("--spec-ngram-size-m", REFUSE, REMOVED),
    _f("--spec-ngram-min-hits", REFUSE, REMOVED),
)

# bankml's defaults, each with every spelling that sets the same thing (P0: the user's wins)
DEFAULTS: list[tuple[list[str], frozenset[str]]] = [
    (list(args), frozenset(s for f in FLAGS if f.p0_default == args for s in f.spellings))
    for args in (PARALLEL_1, JINJA, REASONING_OFF, NO_WEBUI)
]


def flag_name(arg: str) -> str:
    """An argument as llama-server looks it up: ``_`` read as ``-`` in a long flag."""
    return arg.replace("_", "-") if arg.startswith("--") else arg


def command_line(
    binary: str,
    model: str,
    host: str,
    port: int,
    threads: int,
    ctx: int,
    *,
    reasoning_off: bool,
    give_way_to: Sequence[str] = (),
    after: Sequence[str] = (),
) -> list[str]:
    """``BINARY -m MODEL --host H --port P -t N -c N``, then bankml's defaults (``-np 1 --jinja
    --no-webui``, and ``--reasoning off`` in their order with ``reasoning_off``) less each one that
    ``give_way_to`` sets in any spelling, then ``after`` as given."""
    named = {flag_name(arg) for arg in give_way_to}
    defaults: list[str] = []
    for args, spellings in DEFAULTS:
        if (reasoning_off or tuple(args) != REASONING_OFF) and not named & spellings:
            defaults += args
    return [
        binary,
        "-m",
        model,
        "--host",
        host,
        "--port",
        str(port),
        "-t",
        str(threads),
        "-c",
        str(ctx),
        *defaults,
        *after,
    ]


# llama-server's environment variable of each option (OPTIONS; its --help's "env:"), as a
# preset's key may spell it: the variable -> (the option's first spelling in FLAGS, whether the
# option has a negation, whose LLAMA_ARG_NO_ variable names the same option)
_FIRST = {s: f.first for f in FLAGS for s in f.spellings}
ENV_NAMES: dict[str, tuple[str, bool]] = {
    env: (_FIRST[spellings[0]], bool(negations))
    for spellings, negations, _, env, preset_only in OPTIONS
    if env and not preset_only
}
