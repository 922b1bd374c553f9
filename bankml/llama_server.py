"""llama-server's command line (build 11434): what bankml does with each flag, and the command
line bankml launches llama-server with.

One table, ``FLAGS``, read by both modes that take llama-server's flags. Each row is one flag,
all its spellings, whether it takes a value, and a verdict per mode:

- the native drop-in (``bankml llama-server`` and ``bankml serve --native``, read by
  serving/llama_flags.py): ``action`` is ``SERVE`` (it becomes a ``bankml serve`` option),
  ``IGNORE`` (it cannot change an answer), ``REFUSE`` (with ``reason``), ``MODEL`` (``-m``),
  ``OWN`` (``bankml llama-server`` answers it itself: its usage, its version) or ``UNKNOWN``
  (not among the drop-in's flags: refused there as any flag it does not know). Every flag of
  llama-server's ``--help`` has a row with a verdict (tests/test_llama_help.py checks it);
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


@dataclass(frozen=True)
class Flag:
    spellings: tuple[str, ...]  # llama-server's, the long name bankml serve takes first
    takes_value: bool
    action: str  # the native drop-in's: SERVE, IGNORE, REFUSE, MODEL, OWN or UNKNOWN
    reason: str = ""  # why the drop-in ignores or refuses it
    serve_name: str | None = None  # the bankml serve option, when not the first spelling
    p0_reason: str = ""  # why P0 refuses it ("": not refused)
    p0_default: tuple[str, ...] = ()  # bankml's default that it replaces in P0

    @property
    def name(self) -> str:
        return self.serve_name or self.spellings[0].lstrip("-")

    @property
    def p0_action(self) -> str:
        """P0's verdict: REFUSE, DEFAULT or PASS."""
        return REFUSE if self.p0_reason else DEFAULT if self.p0_default else PASS


def _f(
    spellings: str,
    takes_value: bool,
    action: str,
    reason: str = "",
    serve: str = "",
    *,
    p0_refuse: str = "",
    p0_default: tuple[str, ...] = (),
) -> Flag:
    return Flag(
        tuple(spellings.split()), takes_value, action, reason, serve or None, p0_refuse, p0_default
    )


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
    _f("-m --model", True, MODEL, p0_refuse=P0_MODEL),
    # -- mapped onto bankml serve's own options
    _f("--ctx-size -c", True, SERVE, serve="ctx", p0_refuse="use bankml's --ctx"),
    _f("--threads -t", True, SERVE, p0_refuse="use bankml's --threads"),
    _f("--host", True, SERVE, p0_refuse=P0_ADDRESS),
    _f("--port", True, SERVE, p0_refuse=P0_ADDRESS),
    _f("--slot-save-path", True, SERVE, serve="slot-dir", p0_refuse="use bankml's --slot-dir"),
    # -- server-wide sampling defaults (a request's own field overrides them)
    _f("--n-predict -n --predict", True, SERVE),
    _f("--temp --temperature", True, SERVE),
    _f("--seed -s", True, SERVE),
    _f("--top-k", True, SERVE),
    _f("--top-p", True, SERVE),
    _f("--min-p", True, SERVE),
    _f("--top-nsigma --top-n-sigma", True, SERVE),
    _f("--xtc-probability", True, SERVE),
    _f("--xtc-threshold", True, SERVE),
    _f("--typical --typical-p", True, SERVE),
    _f("--repeat-last-n", True, SERVE),
    _f("--repeat-penalty", True, SERVE),
    _f("--presence-penalty", True, SERVE),
    _f("--frequency-penalty", True, SERVE),
    _f("--dry-multiplier", True, SERVE),
    _f("--dry-base", True, SERVE),
    _f("--dry-allowed-length", True, SERVE),
    _f("--dry-penalty-last-n", True, SERVE),
    _f("--dynatemp-range", True, SERVE),
    _f("--dynatemp-exp", True, SERVE),
    _f("--mirostat", True, SERVE),
    _f("--mirostat-lr", True, SERVE),
    _f("--mirostat-ent", True, SERVE),
    _f("--samplers", True, SERVE),
    _f("--sampling-seq --sampler-seq", True, SERVE),
    _f("--reasoning-budget", True, SERVE),
    _f("--reasoning-format", True, SERVE),
    _f("--reasoning -rea", True, SERVE, p0_default=REASONING_OFF),
    _f("--chat-template-kwargs", True, SERVE),
    _f("--reasoning-budget-message", True, SERVE),
    # -- the server
    _f("--alias -a", True, SERVE),
    _f("--api-key", True, SERVE, p0_refuse=P0_KEY),
    _f("--api-key-file", True, SERVE, p0_refuse=P0_KEY),
    _f("--chat-template", True, SERVE),
    _f("--chat-template-file", True, SERVE),
    # the last of the two wins, as in llama-server; without Jinja: llama.cpp's built-in templates
    _f("--jinja", False, SERVE, p0_default=JINJA),
    _f("--no-jinja", False, SERVE, p0_default=JINJA),
    # the server-wide default of a request's "verbose" (__verbose on answers): -v, or -lv above 9
    _f("--verbose -v --log-verbose", False, SERVE),
    # a generation that fills its slot shifts the context and goes on (off: it stops there);
    # --keep: a request's default n_keep (the tokens a shift keeps)
    _f("--context-shift", False, SERVE),
    _f("--spm-infill", False, SERVE),
    _f("--no-context-shift", False, SERVE),
    _f("--keep", True, SERVE),
    _f("--verbosity -lv --log-verbosity", True, SERVE),
    _f("--parallel -np", True, SERVE, p0_default=PARALLEL_1),
    _f("--metrics", False, SERVE),
    _f("--slots", False, SERVE),
    _f("--no-slots", False, SERVE),
    _f("--cors-origins", True, SERVE),
    _f("--cors-methods", True, SERVE),
    _f("--cors-headers", True, SERVE),
    _f("--cors-credentials", False, SERVE),
    _f("--no-cors-credentials", False, SERVE),
    _f("--cache-type-k -ctk", True, SERVE),
    _f("--cache-type-v -ctv", True, SERVE),
    _f("--cache-ram -cram", True, SERVE),
    # -- accepted and ignored: they cannot change an answer
    _f("--flash-attn -fa", True, IGNORE, SAME_BITS),
    _f("--gpu-layers -ngl --n-gpu-layers", True, IGNORE, SAME_BITS + " (--device picks it)"),
    _f("--device -dev", True, IGNORE, SAME_BITS + " (bankml serve --device picks it)"),
    _f("--split-mode -sm", True, IGNORE, SAME_BITS),
    _f("--tensor-split -ts", True, IGNORE, SAME_BITS),
    _f("--main-gpu -mg", True, IGNORE, SAME_BITS),
    _f("--fit -fit", True, IGNORE, SAME_BITS),
    _f("--fit-target -fitt", True, IGNORE, SAME_BITS),
    _f("--fit-ctx -fitc", True, IGNORE, SAME_BITS),
    # how a prompt is cut into passes: the kernels a row meets, so the bits (Engine.set_batch_sizes)
    _f("--batch-size -b", True, SERVE),
    _f("--ubatch-size -ub", True, SERVE),
    _f("--threads-batch -tb", True, IGNORE, SAME_BITS),
    _f("--threads-http", True, IGNORE, SAME_BITS),
    _f("--cpu-mask -C", True, IGNORE, SAME_BITS),
    _f("--cpu-range -Cr", True, IGNORE, SAME_BITS),
    _f("--cpu-strict", True, IGNORE, SAME_BITS),
    _f("--prio", True, IGNORE, SAME_BITS),
    _f("--poll", True, IGNORE, SAME_BITS),
    _f("--cpu-mask-batch -Cb", True, IGNORE, SAME_BITS),
    _f("--cpu-range-batch -Crb", True, IGNORE, SAME_BITS),
    _f("--cpu-strict-batch", True, IGNORE, SAME_BITS),
    _f("--prio-batch", True, IGNORE, SAME_BITS),
    _f("--poll-batch", True, IGNORE, SAME_BITS),
    _f("--numa", True, IGNORE, SAME_BITS),
    _f("--load-mode -lm", True, IGNORE, SAME_BITS),
    _f("--lazy-mode -lzm", True, IGNORE, SAME_BITS),
    _f("--repack", False, IGNORE, SAME_BITS),
    _f("--no-repack -nr", False, IGNORE, SAME_BITS),
    _f("--no-host", False, IGNORE, SAME_BITS),
    _f("--kv-offload -kvo", False, IGNORE, SAME_BITS),
    _f("--no-kv-offload -nkvo", False, IGNORE, SAME_BITS),
    _f("--op-offload", False, IGNORE, SAME_BITS),
    _f("--no-op-offload", False, IGNORE, SAME_BITS),
    _f("--cont-batching -cb", False, IGNORE, SAME_BITS),
    _f("--no-cont-batching -nocb", False, IGNORE, SAME_BITS),
    _f("--kv-unified -kvu", False, SERVE),
    _f("--no-kv-unified -no-kvu", False, SERVE),
    _f("--cache-idle-slots", False, IGNORE, SAME_BITS),
    _f("--no-cache-idle-slots", False, IGNORE, SAME_BITS),
    _f("--ctx-checkpoints -ctxcp --swa-checkpoints", True, IGNORE, SAME_BITS),
    _f("--checkpoint-min-step -cms", True, IGNORE, SAME_BITS),
    _f("--slot-prompt-similarity -sps", True, SERVE),
    _f("--warmup", False, IGNORE, SAME_BITS),
    _f("--no-warmup", False, IGNORE, SAME_BITS),
    _f("--perf", False, IGNORE, SAME_BITS),
    _f("--no-perf", False, IGNORE, SAME_BITS),
    _f("--check-tensors", False, IGNORE, "bankml checks the whole file's sha256 before serving"),
    _f("--timeout -to", True, IGNORE, "bankml keeps its own read and write timeouts"),
    _f("--reuse-port", False, IGNORE, SAME_BITS, p0_refuse=P0_ADDRESS),
    _f("--sleep-idle-seconds", True, IGNORE, SAME_BITS),
    _f("--prefill-assistant", False, IGNORE, "it is the default"),
    _f("--cache-prompt", False, IGNORE, "it is the default"),
    _f("--offline", False, IGNORE, PINNED),
    _f("--ui --webui", False, SERVE, p0_default=NO_WEBUI),
    _f("--no-ui --no-webui", False, SERVE, p0_default=NO_WEBUI),
    _f("--log-disable", False, IGNORE, LOGS),
    _f("--log-file", True, IGNORE, LOGS),
    _f("--log-colors", True, IGNORE, LOGS),
    _f("--log-prefix", False, IGNORE, LOGS),
    _f("--no-log-prefix", False, IGNORE, LOGS),
    _f("--log-timestamps", False, IGNORE, LOGS),
    _f("--no-log-timestamps", False, IGNORE, LOGS),
    # -- refused natively, with the reason
    _f("--log-jsonl", False, IGNORE, LOGS),
    _f("--model-url -mu", True, REFUSE, PINNED, p0_refuse=P0_MODEL),
    _f("--hf-repo -hf -hfr", True, REFUSE, PINNED, p0_refuse=P0_MODEL),
    _f("--hf-file -hff", True, REFUSE, PINNED, p0_refuse=P0_MODEL),
    _f("--hf-token -hft", True, REFUSE, PINNED),
    _f("--docker-repo -dr", True, REFUSE, PINNED, p0_refuse=P0_MODEL),
    _f("--models-dir", True, SERVE, p0_refuse=P0_MODEL),
    _f("--models-preset", True, SERVE, p0_refuse=P0_MODEL),
    _f("--models-max", True, SERVE, p0_refuse=P0_MODEL),
    _f("--lora", True, REFUSE, CHANGES_MODEL, p0_refuse=P0_ADAPTER),
    _f("--lora-scaled", True, REFUSE, CHANGES_MODEL, p0_refuse=P0_ADAPTER),
    _f("--control-vector", True, REFUSE, CHANGES_MODEL, p0_refuse=P0_ADAPTER),
    _f("--control-vector-scaled", True, REFUSE, CHANGES_MODEL, p0_refuse=P0_ADAPTER),
    _f("--override-kv", True, REFUSE, CHANGES_MODEL, p0_refuse=P0_METADATA),
    _f("--override-tensor -ot", True, REFUSE, CHANGES_MODEL),
    _f("--rope-scaling", True, REFUSE, CHANGES_MODEL),
    _f("--rope-scale", True, REFUSE, CHANGES_MODEL),
    _f("--rope-freq-base", True, REFUSE, CHANGES_MODEL),
    _f("--rope-freq-scale", True, REFUSE, CHANGES_MODEL),
    _f("--yarn-orig-ctx", True, REFUSE, CHANGES_MODEL),
    _f("--yarn-ext-factor", True, REFUSE, CHANGES_MODEL),
    _f("--yarn-attn-factor", True, REFUSE, CHANGES_MODEL),
    _f("--yarn-beta-slow", True, REFUSE, CHANGES_MODEL),
    _f("--yarn-beta-fast", True, REFUSE, CHANGES_MODEL),
    _f("--mmproj -mm", True, REFUSE, NOT_HERE + " (images, audio)", p0_refuse=P0_PROJECTOR),
    _f(
        "--model-draft -md --spec-draft-model",
        True,
        REFUSE,
        SPECULATIVE,
        p0_refuse=P0_DRAFT,
    ),
    # speculative decoding: llama-server's draftless n-gram drafts (speculative.py)
    _f("--spec-type", True, SERVE),
    _f("--spec-ngram-simple-size-n", True, SERVE),
    _f("--spec-ngram-simple-size-m", True, SERVE),
    _f("--spec-ngram-simple-min-hits", True, SERVE),
    _f("--spec-ngram-mod-n-min", True, SERVE),
    _f("--spec-ngram-mod-n-max", True, SERVE),
    _f("--spec-ngram-mod-n-match", True, SERVE),
    _f("--spec-ngram-map-k-size-n", True, SERVE),
    _f("--spec-ngram-map-k-size-m", True, SERVE),
    _f("--spec-ngram-map-k-min-hits", True, SERVE),
    _f("--spec-ngram-map-k4v-size-n", True, SERVE),
    _f("--spec-ngram-map-k4v-size-m", True, SERVE),
    _f("--spec-ngram-map-k4v-min-hits", True, SERVE),
    # embeddings: /v1/embeddings, /embedding(s) and Ollama's /api/embed (native/embed.py)
    _f("--embedding --embeddings", False, SERVE, serve="embeddings"),
    # rerank: /rerank, /v1/rerank on a BERT reranker (native/rerank.py)
    _f("--rerank --reranking", False, SERVE, serve="rerank"),
    _f("--pooling", True, SERVE),
    _f("--props", False, REFUSE, "bankml does not change global properties while serving"),
    _f("--api-prefix", True, REFUSE, NOT_HERE, p0_refuse=P0_ROUTES),
    _f("--path", True, REFUSE, NO_UI),
    _f("--ssl-key-file", True, REFUSE, LOOPBACK, p0_refuse=P0_PLAIN_HTTP),
    _f("--ssl-cert-file", True, REFUSE, LOOPBACK, p0_refuse=P0_PLAIN_HTTP),
    _f("--tools", True, REFUSE, NOT_HERE),
    _f("--agent -ag", False, REFUSE, NOT_HERE),
    _f("--ui-mcp-proxy --webui-mcp-proxy", False, REFUSE, NOT_HERE),
    _f("--mcp-servers-config", True, REFUSE, NOT_HERE),
    _f("--mcp-servers-json", True, REFUSE, NOT_HERE),
    _f("--media-path", True, REFUSE, NOT_HERE),
    _f("--cache-reuse", True, REFUSE, PER_REQUEST + " (n_cache_reuse)"),
    _f("--no-cache-prompt", False, REFUSE, PER_REQUEST + " (cache_prompt)"),
    _f("--ignore-eos", False, REFUSE, PER_REQUEST + " (ignore_eos)"),
    _f("--logit-bias -l", True, REFUSE, PER_REQUEST + " (logit_bias)"),
    _f("--grammar", True, REFUSE, PER_REQUEST + " (grammar)"),
    _f("--grammar-file", True, REFUSE, PER_REQUEST + " (grammar)"),
    _f("--json-schema -j", True, REFUSE, PER_REQUEST + " (json_schema)"),
    _f("--json-schema-file -jf", True, REFUSE, PER_REQUEST + " (json_schema)"),
    _f("--dry-sequence-breaker", True, REFUSE, PER_REQUEST + " (dry_sequence_breakers)"),
    _f("--sse-ping-interval", True, REFUSE, PER_REQUEST + " (sse_ping_interval)"),
    _f("--adaptive-target", True, REFUSE, "bankml's sampler has no adaptive-p"),
    _f("--adaptive-decay", True, REFUSE, "bankml's sampler has no adaptive-p"),
    _f("--backend-sampling -bs", False, REFUSE, NOT_HERE),
    _f("--no-prefill-assistant", False, REFUSE, NOT_HERE),
    _f("--skip-chat-parsing", False, REFUSE, NOT_HERE),
    _f("--swa-full", False, REFUSE, NOT_HERE),
    _f("--list-devices", False, REFUSE, "bankml serve --device picks the device"),
    # -- refused in both modes
    _f("--models-autoload", False, SERVE, p0_refuse=P0_MODEL),
    _f("--embd-gemma-default", False, REFUSE, PINNED, p0_refuse=P0_PRESET),
    _f("--fim-qwen-1.5b-default", False, REFUSE, PINNED, p0_refuse=P0_PRESET),
    _f("--fim-qwen-3b-default", False, REFUSE, PINNED, p0_refuse=P0_PRESET),
    _f("--fim-qwen-7b-default", False, REFUSE, PINNED, p0_refuse=P0_PRESET),
    _f("--fim-qwen-7b-spec", False, REFUSE, PINNED, p0_refuse=P0_PRESET),
    _f("--fim-qwen-14b-spec", False, REFUSE, PINNED, p0_refuse=P0_PRESET),
    _f("--fim-qwen-30b-default", False, REFUSE, PINNED, p0_refuse=P0_PRESET),
    _f("--gpt-oss-20b-default", False, REFUSE, PINNED, p0_refuse=P0_PRESET),
    _f("--gpt-oss-120b-default", False, REFUSE, PINNED, p0_refuse=P0_PRESET),
    _f("--vision-gemma-4b-default", False, REFUSE, PINNED, p0_refuse=P0_PRESET),
    _f("--vision-gemma-12b-default", False, REFUSE, PINNED, p0_refuse=P0_PRESET),
    _f("--lora-init-without-apply", False, REFUSE, CHANGES_MODEL, p0_refuse=P0_ADAPTER),
    _f(
        "--control-vector-layer-range", True, REFUSE, CHANGES_MODEL, p0_refuse=P0_ADAPTER
    ),  # START END
    _f("--mmproj-url -mmu", True, REFUSE, PINNED, p0_refuse=P0_PROJECTOR),
    _f("--spec-draft-hf -hfd -hfrd --hf-repo-draft", True, REFUSE, PINNED, p0_refuse=P0_DRAFT),
    # -- llama-server's other flags (each of its --help has a row)
    _f("--help -h --usage", False, OWN, HELP),
    _f("--version", False, OWN, HELP),
    _f("--cache-list -cl", False, REFUSE, PINNED),
    _f("--completion-bash", False, REFUSE, "bankml's command line has no completion script"),
    _f("--tags", True, SERVE),
    _f("--reasoning-effort", True, SERVE),
    _f("--reasoning-preserve", False, SERVE),
    _f("--no-reasoning-preserve", False, SERVE),
    _f("--escape -e", False, IGNORE, "it only changes -r and --dry-sequence-breaker, refused here"),
    _f("--no-escape", False, IGNORE, "it only changes -r and --dry-sequence-breaker, refused here"),
    _f("--defrag-thold -dt", True, IGNORE, SAME_BITS + " (llama-server ignores it too)"),
    _f("--rpc", True, IGNORE, SAME_BITS),
    _f("--cpu-moe -cmoe", False, IGNORE, SAME_BITS),
    _f("--n-cpu-moe -ncmoe", True, IGNORE, SAME_BITS),
    _f("--n-cpu-ffn -ncffn", True, IGNORE, SAME_BITS),
    _f("--no-log-jsonl", False, IGNORE, DEFAULT),
    _f("--log-prompts-dir", True, IGNORE, LOGS),
    _f("--no-mmproj --no-mmproj-auto", False, IGNORE, DEFAULT),
    _f("--mmproj-offload", False, IGNORE, NO_MEDIA),
    _f("--no-mmproj-offload", False, IGNORE, NO_MEDIA),
    _f("--mmproj-device -mmdev", True, IGNORE, NO_MEDIA),
    _f("--image-min-tokens", True, IGNORE, NO_MEDIA),
    _f("--image-max-tokens", True, IGNORE, NO_MEDIA),
    _f("--mtmd-batch-max-tokens", True, IGNORE, NO_MEDIA),
    _f("--video-fps", True, IGNORE, NO_MEDIA),
    _f("--video-timestamp-interval", True, IGNORE, NO_MEDIA),
    _f("--video-ffmpeg-dir", True, IGNORE, NO_MEDIA),
    _f("--embd-normalize", True, SERVE),
    _f("--ui-config --webui-config", True, IGNORE, NO_UI),
    _f("--ui-config-file --webui-config-file", True, IGNORE, NO_UI),
    _f("--no-ui-mcp-proxy --no-webui-mcp-proxy", False, IGNORE, DEFAULT),
    _f("--no-agent -no-ag", False, IGNORE, DEFAULT),
    _f("--no-models-autoload", False, SERVE),
    _f("--no-skip-chat-parsing", False, IGNORE, DEFAULT),
    _f("--mmproj-auto", False, REFUSE, NOT_HERE + " (images, audio)"),
    _f("--special -sp", False, REFUSE, NOT_HERE + " (special tokens in the answer's text)"),
    _f("--reverse-prompt -r", True, REFUSE, PER_REQUEST + " (stop)"),
    _f("--kv-unified-per-slot", True, REFUSE, NOT_HERE + " (a per-slot context limit)"),
    _f("--tools-runtime", True, REFUSE, NOT_HERE),
    _f("--lookup-cache-static -lcs", True, REFUSE, LOOKUP_FILES),
    _f("--lookup-cache-dynamic -lcd", True, REFUSE, LOOKUP_FILES),
    _f("--spec-default", False, REFUSE, SPECULATIVE),
    _f("--spec-draft-type-k -ctkd --cache-type-k-draft", True, REFUSE, SPECULATIVE),
    _f("--spec-draft-type-v -ctvd --cache-type-v-draft", True, REFUSE, SPECULATIVE),
    _f("--spec-draft-n-max", True, REFUSE, SPECULATIVE),
    _f("--spec-draft-n-min", True, REFUSE, SPECULATIVE),
    _f("--spec-synth-len", True, REFUSE, SPECULATIVE),
    _f("--spec-synth-rates", True, REFUSE, SPECULATIVE),
    _f("--spec-draft-p-split --draft-p-split", True, REFUSE, SPECULATIVE),
    _f("--spec-draft-p-min --draft-p-min", True, REFUSE, SPECULATIVE),
    _f("--spec-draft-backend-sampling", False, REFUSE, SPECULATIVE),
    _f("--no-spec-draft-backend-sampling", False, REFUSE, SPECULATIVE),
    _f("--spec-draft-sampling", True, REFUSE, SPECULATIVE),
    _f("--spec-draft-threads -td --threads-draft", True, REFUSE, SPECULATIVE),
    _f("--spec-draft-threads-batch -tbd --threads-batch-draft", True, REFUSE, SPECULATIVE),
    _f("--spec-draft-cpu-mask -Cd --cpu-mask-draft", True, REFUSE, SPECULATIVE),
    _f("--spec-draft-cpu-range -Crd --cpu-range-draft", True, REFUSE, SPECULATIVE),
    _f("--spec-draft-cpu-strict --cpu-strict-draft", True, REFUSE, SPECULATIVE),
    _f("--spec-draft-prio --prio-draft", True, REFUSE, SPECULATIVE),
    _f("--spec-draft-poll --poll-draft", True, REFUSE, SPECULATIVE),
    _f("--spec-draft-cpu-mask-batch -Cbd --cpu-mask-batch-draft", True, REFUSE, SPECULATIVE),
    _f("--spec-draft-cpu-strict-batch --cpu-strict-batch-draft", True, REFUSE, SPECULATIVE),
    _f("--spec-draft-prio-batch --prio-batch-draft", True, REFUSE, SPECULATIVE),
    _f("--spec-draft-poll-batch --poll-batch-draft", True, REFUSE, SPECULATIVE),
    _f("--spec-draft-override-tensor -otd --override-tensor-draft", True, REFUSE, SPECULATIVE),
    _f("--spec-draft-cpu-moe -cmoed --cpu-moe-draft", False, REFUSE, SPECULATIVE),
    _f(
        "--spec-draft-n-cpu-moe --spec-draft-ncmoe -ncmoed --n-cpu-moe-draft",
        True,
        REFUSE,
        SPECULATIVE,
    ),
    _f("--spec-draft-device -devd --device-draft", True, REFUSE, SPECULATIVE),
    _f("--spec-draft-ngl -ngld --gpu-layers-draft --n-gpu-layers-draft", True, REFUSE, SPECULATIVE),
    _f("--draft --draft-n --draft-max", True, REFUSE, REMOVED),
    _f("--draft-min --draft-n-min", True, REFUSE, REMOVED),
    _f("--spec-ngram-size-n", True, REFUSE, REMOVED),
    _f("--spec-ngram-size-m", True, REFUSE, REMOVED),
    _f("--spec-ngram-min-hits", True, REFUSE, REMOVED),
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


# llama-server's environment variable of each flag (its --help's "env:"), as a preset's key may
# spell it: the variable -> (the flag's first spelling in FLAGS, whether the flag has a negation,
# whose LLAMA_ARG_NO_ variable names the same flag)
ENV_NAMES: dict[str, tuple[str, bool]] = {
    "LLAMA_ARG_THREADS": ("--threads", False),
    "LLAMA_ARG_CTX_SIZE": ("--ctx-size", False),
    "LLAMA_ARG_N_PREDICT": ("--n-predict", False),
    "LLAMA_ARG_BATCH": ("--batch-size", False),
    "LLAMA_ARG_UBATCH": ("--ubatch-size", False),
    "LLAMA_ARG_SWA_FULL": ("--swa-full", False),
    "LLAMA_ARG_FLASH_ATTN": ("--flash-attn", False),
    "LLAMA_ARG_PERF": ("--perf", True),
    "LLAMA_ARG_ROPE_SCALING_TYPE": ("--rope-scaling", False),
    "LLAMA_ARG_ROPE_SCALE": ("--rope-scale", False),
    "LLAMA_ARG_ROPE_FREQ_BASE": ("--rope-freq-base", False),
    "LLAMA_ARG_ROPE_FREQ_SCALE": ("--rope-freq-scale", False),
    "LLAMA_ARG_YARN_ORIG_CTX": ("--yarn-orig-ctx", False),
    "LLAMA_ARG_YARN_EXT_FACTOR": ("--yarn-ext-factor", False),
    "LLAMA_ARG_YARN_ATTN_FACTOR": ("--yarn-attn-factor", False),
    "LLAMA_ARG_YARN_BETA_SLOW": ("--yarn-beta-slow", False),
    "LLAMA_ARG_YARN_BETA_FAST": ("--yarn-beta-fast", False),
    "LLAMA_ARG_KV_OFFLOAD": ("--kv-offload", True),
    "LLAMA_ARG_REPACK": ("--repack", True),
    "LLAMA_ARG_NO_HOST": ("--no-host", False),
    "LLAMA_ARG_CACHE_TYPE_K": ("--cache-type-k", False),
    "LLAMA_ARG_CACHE_TYPE_V": ("--cache-type-v", False),
    "LLAMA_ARG_DEFRAG_THOLD": ("--defrag-thold", False),
    "LLAMA_ARG_RPC": ("--rpc", False),
    "LLAMA_ARG_LOAD_MODE": ("--load-mode", False),
    "LLAMA_ARG_LAZY_MODE": ("--lazy-mode", False),
    "LLAMA_ARG_NUMA": ("--numa", False),
    "LLAMA_ARG_DEVICE": ("--device", False),
    "LLAMA_ARG_OVERRIDE_TENSOR": ("--override-tensor", False),
    "LLAMA_ARG_CPU_MOE": ("--cpu-moe", False),
    "LLAMA_ARG_N_CPU_MOE": ("--n-cpu-moe", False),
    "LLAMA_ARG_N_CPU_FFN": ("--n-cpu-ffn", False),
    "LLAMA_ARG_N_GPU_LAYERS": ("--gpu-layers", False),
    "LLAMA_ARG_SPLIT_MODE": ("--split-mode", False),
    "LLAMA_ARG_TENSOR_SPLIT": ("--tensor-split", False),
    "LLAMA_ARG_MAIN_GPU": ("--main-gpu", False),
    "LLAMA_ARG_FIT": ("--fit", False),
    "LLAMA_ARG_FIT_TARGET": ("--fit-target", False),
    "LLAMA_ARG_FIT_CTX": ("--fit-ctx", False),
    "LLAMA_ARG_MODEL": ("-m", False),
    "LLAMA_ARG_MODEL_URL": ("--model-url", False),
    "LLAMA_ARG_DOCKER_REPO": ("--docker-repo", False),
    "LLAMA_ARG_HF_REPO": ("--hf-repo", False),
    "LLAMA_ARG_HF_FILE": ("--hf-file", False),
    "HF_TOKEN": ("--hf-token", False),
    "LLAMA_ARG_LOG_FILE": ("--log-file", False),
    "LLAMA_ARG_LOG_JSONL": ("--log-jsonl", True),
    "LLAMA_ARG_LOG_COLORS": ("--log-colors", False),
    "LLAMA_ARG_OFFLINE": ("--offline", False),
    "LLAMA_ARG_LOG_VERBOSITY": ("--verbosity", False),
    "LLAMA_ARG_LOG_PREFIX": ("--log-prefix", True),
    "LLAMA_ARG_LOG_TIMESTAMPS": ("--log-timestamps", True),
    "LLAMA_ARG_SPEC_DRAFT_CACHE_TYPE_K": ("--spec-draft-type-k", False),
    "LLAMA_ARG_SPEC_DRAFT_CACHE_TYPE_V": ("--spec-draft-type-v", False),
    "LLAMA_ARG_TEMPERATURE": ("--temp", False),
    "LLAMA_ARG_TOP_K": ("--top-k", False),
    "LLAMA_ARG_TOP_P": ("--top-p", False),
    "LLAMA_ARG_MIN_P": ("--min-p", False),
    "LLAMA_ARG_REPEAT_PENALTY": ("--repeat-penalty", False),
    "LLAMA_ARG_PRESENCE_PENALTY": ("--presence-penalty", False),
    "LLAMA_ARG_FREQUENCY_PENALTY": ("--frequency-penalty", False),
    "LLAMA_ARG_BACKEND_SAMPLING": ("--backend-sampling", False),
    "LLAMA_ARG_SPEC_DRAFT_HF_REPO": ("--spec-draft-hf", False),
    "LLAMA_ARG_SPEC_DRAFT_CPU_MOE": ("--spec-draft-cpu-moe", False),
    "LLAMA_ARG_SPEC_DRAFT_N_CPU_MOE": ("--spec-draft-n-cpu-moe", False),
    "LLAMA_ARG_SPEC_DRAFT_N_MAX": ("--spec-draft-n-max", False),
    "LLAMA_ARG_SPEC_DRAFT_N_MIN": ("--spec-draft-n-min", False),
    "LLAMA_ARG_SPEC_SYNTH_LEN": ("--spec-synth-len", False),
    "LLAMA_ARG_SPEC_SYNTH_RATES": ("--spec-synth-rates", False),
    "LLAMA_ARG_SPEC_DRAFT_P_SPLIT": ("--spec-draft-p-split", False),
    "LLAMA_ARG_SPEC_DRAFT_P_MIN": ("--spec-draft-p-min", False),
    "LLAMA_ARG_SPEC_DRAFT_BACKEND_SAMPLING": ("--spec-draft-backend-sampling", True),
    "LLAMA_ARG_SPEC_DRAFT_SAMPLING": ("--spec-draft-sampling", False),
    "LLAMA_ARG_N_GPU_LAYERS_DRAFT": ("--spec-draft-ngl", False),
    "LLAMA_ARG_SPEC_DRAFT_MODEL": ("--model-draft", False),
    "LLAMA_ARG_SPEC_TYPE": ("--spec-type", False),
    "LLAMA_ARG_DRAFT_MAX": ("--draft", False),
    "LLAMA_ARG_DRAFT_MIN": ("--draft-min", False),
    "LLAMA_ARG_KV_UNIFIED_PER_SLOT": ("--kv-unified-per-slot", False),
    "LLAMA_ARG_CTX_CHECKPOINTS": ("--ctx-checkpoints", False),
    "LLAMA_ARG_CHECKPOINT_MIN_SPACING_NT": ("--checkpoint-min-step", False),
    "LLAMA_ARG_CACHE_RAM": ("--cache-ram", False),
    "LLAMA_ARG_KV_UNIFIED": ("--kv-unified", True),
    "LLAMA_ARG_CACHE_IDLE_SLOTS": ("--cache-idle-slots", True),
    "LLAMA_ARG_CONTEXT_SHIFT": ("--context-shift", True),
    "LLAMA_ARG_POOLING": ("--pooling", False),
    "LLAMA_ARG_N_PARALLEL": ("--parallel", False),
    "LLAMA_ARG_CONT_BATCHING": ("--cont-batching", True),
    "LLAMA_ARG_MMPROJ": ("--mmproj", False),
    "LLAMA_ARG_MMPROJ_URL": ("--mmproj-url", False),
    "LLAMA_ARG_MMPROJ_AUTO": ("--mmproj-auto", True),
    "LLAMA_ARG_MMPROJ_OFFLOAD": ("--mmproj-offload", True),
    "MTMD_BACKEND_DEVICE": ("--mmproj-device", False),
    "LLAMA_ARG_IMAGE_MIN_TOKENS": ("--image-min-tokens", False),
    "LLAMA_ARG_IMAGE_MAX_TOKENS": ("--image-max-tokens", False),
    "LLAMA_ARG_MTMD_BATCH_MAX_TOKENS": ("--mtmd-batch-max-tokens", False),
    "LLAMA_ARG_VIDEO_FPS": ("--video-fps", False),
    "LLAMA_ARG_VIDEO_TIMESTAMP_INTERVAL": ("--video-timestamp-interval", False),
    "LLAMA_ARG_VIDEO_FFMPEG_DIR": ("--video-ffmpeg-dir", False),
    "LLAMA_ARG_ALIAS": ("--alias", False),
    "LLAMA_ARG_TAGS": ("--tags", False),
    "LLAMA_ARG_HOST": ("--host", False),
    "LLAMA_ARG_PORT": ("--port", False),
    "LLAMA_ARG_REUSE_PORT": ("--reuse-port", False),
    "LLAMA_ARG_STATIC_PATH": ("--path", False),
    "LLAMA_ARG_CORS_ORIGINS": ("--cors-origins", False),
    "LLAMA_ARG_CORS_METHODS": ("--cors-methods", False),
    "LLAMA_ARG_CORS_HEADERS": ("--cors-headers", False),
    "LLAMA_ARG_CORS_CREDENTIALS": ("--cors-credentials", True),
    "LLAMA_ARG_API_PREFIX": ("--api-prefix", False),
    "LLAMA_ARG_UI_CONFIG": ("--ui-config", False),
    "LLAMA_ARG_UI_CONFIG_FILE": ("--ui-config-file", False),
    "LLAMA_ARG_UI_MCP_PROXY": ("--ui-mcp-proxy", True),
    "LLAMA_ARG_TOOLS": ("--tools", False),
    "LLAMA_ARG_TOOLS_RUNTIME": ("--tools-runtime", False),
    "LLAMA_ARG_MCP_SERVERS_CONFIG": ("--mcp-servers-config", False),
    "LLAMA_ARG_MCP_SERVERS_JSON": ("--mcp-servers-json", False),
    "LLAMA_ARG_AGENT": ("--agent", True),
    "LLAMA_ARG_UI": ("--ui", True),
    "LLAMA_ARG_EMBEDDINGS": ("--embedding", False),
    "LLAMA_ARG_RERANKING": ("--rerank", False),
    "LLAMA_API_KEY": ("--api-key", False),
    "LLAMA_ARG_API_KEY_FILE": ("--api-key-file", False),
    "LLAMA_ARG_SSL_KEY_FILE": ("--ssl-key-file", False),
    "LLAMA_ARG_SSL_CERT_FILE": ("--ssl-cert-file", False),
    "LLAMA_ARG_CHAT_TEMPLATE_KWARGS": ("--chat-template-kwargs", False),
    "LLAMA_ARG_TIMEOUT": ("--timeout", False),
    "LLAMA_ARG_SSE_PING_INTERVAL": ("--sse-ping-interval", False),
    "LLAMA_ARG_THREADS_HTTP": ("--threads-http", False),
    "LLAMA_ARG_CACHE_PROMPT": ("--cache-prompt", True),
    "LLAMA_ARG_CACHE_REUSE": ("--cache-reuse", False),
    "LLAMA_ARG_ENDPOINT_METRICS": ("--metrics", False),
    "LLAMA_ARG_ENDPOINT_PROPS": ("--props", False),
    "LLAMA_ARG_ENDPOINT_SLOTS": ("--slots", True),
    "LLAMA_ARG_MODELS_DIR": ("--models-dir", False),
    "LLAMA_ARG_MODELS_PRESET": ("--models-preset", False),
    "LLAMA_ARG_MODELS_MAX": ("--models-max", False),
    "LLAMA_ARG_MODELS_AUTOLOAD": ("--models-autoload", True),
    "LLAMA_ARG_JINJA": ("--jinja", True),
    "LLAMA_ARG_THINK": ("--reasoning-format", False),
    "LLAMA_ARG_REASONING": ("--reasoning", False),
    "LLAMA_ARG_REASONING_EFFORT": ("--reasoning-effort", False),
    "LLAMA_ARG_THINK_BUDGET": ("--reasoning-budget", False),
    "LLAMA_ARG_THINK_BUDGET_MESSAGE": ("--reasoning-budget-message", False),
    "LLAMA_ARG_REASONING_PRESERVE": ("--reasoning-preserve", True),
    "LLAMA_ARG_CHAT_TEMPLATE": ("--chat-template", False),
    "LLAMA_ARG_CHAT_TEMPLATE_FILE": ("--chat-template-file", False),
    "LLAMA_ARG_SKIP_CHAT_PARSING": ("--skip-chat-parsing", True),
    "LLAMA_ARG_PREFILL_ASSISTANT": ("--prefill-assistant", True),
}
