"""`bankml serve` and `twistd bankml`: one Options class, one makeService.

    bankml serve FILE --fork FORK.json (--spawn BIN | --upstream HOST:PORT) [--listen 127.0.0.1:18093]
                 [--threads 3] [--ctx 4096] [--slot-dir D] [--spec-ngram] [--restart-delay 1:60]
                 [--rpc HOST:PORT,...] [-- LLAMA-SERVER ARGS]
    twistd -n bankml --fork FORK.json FILE ...      # the same options, in the foreground
    twistd --pidfile P --logfile L bankml ...       # the same, as a daemon

Order of events (nothing listens until the file has passed verify):

1. `Options` parse and check the arguments (a bad --listen is refused here, and so is an extra
   llama-server argument after `--` that llama_args.py refuses, or any without --spawn).
2. `makeService` runs `verify` (guard, then the whole-file sha256 against the pin) before the
   reactor starts; a refusal prints ``refuse: <reason>`` and exits with verify's code (2, or 1
   for an unreadable file, 3 for a truncated header). Under twistd this happens before it
   daemonizes, so the refusal reaches the terminal.
3. When the reactor runs, `P0Service` (bankml/p0/service.py) brings the engine up: `--spawn` launches and supervises
   llama-server (process_protocol.py); `--upstream` waits up to 10 s for `/health` and requires
   `/props` `model_path` to be the verified canonical path. A failure prints ``refuse: <reason>``
   and bankml exits 2.
4. Then it listens on `--listen` (loopback only) with `LoopbackSite`.

Steps 2 and 3 are the serving core's (bankml/serving/startup.py), which native mode shares.
SIGTERM, SIGINT and SIGHUP stop bankml and a spawned llama-server (Twisted handles the first two;
SIGHUP, which Twisted leaves alone, is handled by the core the same way). `bankml serve` then exits
with 128 + the signal number; twistd re-raises the signal on itself, which a shell reports the
same way.
"""

from __future__ import annotations

import faulthandler
import getopt
import json
import os
import re
import signal
import sys
from typing import Any

from twisted.logger import (
    FilteringLogObserver,
    Logger,
    LogLevel,
    LogLevelFilterPredicate,
    globalLogBeginner,
    textFileLogObserver,
)
from twisted.python import usage

from bankml import rpc
from bankml.llama_server import DEFAULT_STOP_TIMEOUT
from bankml.native.service import make_native_service
from bankml.p0 import gateway as gw
from bankml.p0 import llama_args
from bankml.p0.service import make_p0_service
from bankml.process_protocol import (
    RestartDelay,
    parse_restart_delay,
)
from bankml.registry.keepalive import BadKeepAlive, parse_keep_alive
from bankml.serving import llama_flags, presets
from bankml.serving.site import NotLoopbackError, parse_listen
from bankml.serving.startup import (
    DEFAULT_LISTEN,
    DEFAULT_UPSTREAM,
    ServingService,
)
from bankml.version import __version__

_log = Logger(namespace="bankml.serve")


class Options(usage.Options):
    synopsis = (
        "FILE --fork FORK.json (--spawn BIN | --upstream HOST:PORT) [--listen ADDR] "
        "[--threads N] [--ctx N] [--slot-dir D] [--spec-ngram] [--restart-delay MIN[:MAX]] "
        "[--rpc HOST:PORT,...] "
        "[-- LLAMA-SERVER ARGS (--spawn)]"
    )
    longdesc = (
        "Serve a verified GGUF model on loopback in front of llama-server, with a receipt "
        "on every chat answer. Nothing listens until FILE passes verify."
    )

    optParameters = [
        ["fork", None, None, "FORK.json holding FILE's sha256 pin (required)"],
        ["spawn", None, None, "launch and supervise this llama-server binary on the verified file"],
        [
            "upstream",
            None,
            DEFAULT_UPSTREAM,
            "llama-server's address: where --spawn starts it, or the running one to check",
        ],
        ["listen", None, DEFAULT_LISTEN, "loopback address bankml answers on"],
        ["threads", None, 3, "llama-server threads (-t) with --spawn", int],
        ["ctx", None, 4096, "llama-server context size (-c) with --spawn", int],
        ["slot-dir", None, None, "with --spawn: llama-server's --slot-save-path (a directory)"],
        ["restart-delay", None, None, "with --spawn: seconds before a restart, MIN[:MAX] (1:60)"],
        [
            "stop-timeout",
            None,
            None,
            "with --spawn and several models: seconds from SIGTERM to SIGKILL when a model's "
            "llama-server is unloaded; in native router mode: how long an unloaded model's "
            "running generation may go on before it is stopped (llama-server's router preset "
            "key stop-timeout; 10)",
        ],
        [
            "rpc",
            None,
            None,
            "with --spawn: llama-server's --rpc HOST:PORT,... (llama.cpp RPC workers, e.g. "
            "bankml rpc-worker), each checked before every start and named in every receipt",
        ],
        [
            "device",
            None,
            None,
            "with --native: the engine's device (cpu, cuda, rocm; default auto)",
        ],
        [
            "receipt-key",
            None,
            None,
            "the Ed25519 key that signs every receipt (default $BANKML_RECEIPT_KEY, else "
            "~/.local/share/bankml/receipt-key.pem; created 0600 at the first start)",
        ],
        [
            "receipt-log",
            None,
            None,
            "append every receipt to this file, each line chained to the one before by hash "
            "(fsynced every second, rotated at 64 MiB; bankml check-receipt --log FILE checks it)",
        ],
        # -- Ollama's API (--native): the registry, keep-alive, residency, its own address
        [
            "registry",
            None,
            None,
            "with --native or --spawn: also serve every *.FORK.json model of this directory "
            "(a bare --registry: $BANKML_FORKS, else ~/.local/share/bankml/forks)",
        ],
        ["keep-alive", None, "5m", "with --native: how long a model stays loaded (Go duration)"],
        [
            "max-loaded",
            None,
            1,
            "with --native or --spawn: models resident at once, each with its own engine "
            "(--spawn: its own llama-server); past it the least recently used idle one is "
            "unloaded (1)",
            int,
        ],
        [
            "router-argv",
            None,
            None,
            "llama-server's router mode: its command line as JSON (bankml llama-server passes "
            "its own on; GET /models renders each model's status.args and status.preset from it)",
        ],
        [
            "models-memory",
            None,
            None,
            "with --native: the most the resident models may need together, each its file "
            "and KV cache (bytes, or with K, M, G, T; default: half of the RAM); with "
            "--spawn: each its file and the KV cache its llama-server allocates (default: no bound)",
        ],
        [
            "max-queue",
            None,
            512,
            "with --native: requests that wait for a slot before the next is answered 503 "
            "with Retry-After (512)",
            int,
        ],
        [
            "ollama-listen",
            None,
            None,
            "with --native: a second loopback address answering Ollama's routes only "
            "(e.g. 127.0.0.1:11434)",
        ],
        # llama-server's server flags, under its long names (bankml/serving/llama_flags.py)
        *([name, None, None, text] for name, text in llama_flags.SERVE_PARAMETERS),
    ]
    optFlags = [
        ["spec-ngram", None, "with --spawn: llama-server --spec-type ngram-simple"],
        [
            "native",
            None,
            "answer with bankml's own engine (bankml/native/service.py), also on the "
            "--upstream address",
        ],
        *([name, None, text] for name, text in llama_flags.SERVE_SWITCHES),
    ]

    def parseOptions(self, options: list[str] | None = None) -> None:
        """The usage writes FILE first (`bankml serve FILE --fork F`); Twisted's parser stops at
        the first positional, so options are moved ahead of it (GNU getopt order) first.
        Everything after the first `--` is llama-server's (`engine_args`), kept out of that."""
        args = sys.argv[1:] if options is None else list(options)
        self["engine_args"] = []
        if "--" in args:
            cut = args.index("--")
            args, self["engine_args"] = args[:cut], args[cut + 1 :]
        args = registry_with_default(args)
        try:
            opts, positional = getopt.gnu_getopt(args, self.shortOpt, self.longOpt)
        except getopt.GetoptError as err:
            raise usage.UsageError(str(err)) from None
        takes_value = {"--" + name[:-1] for name in self.longOpt if name.endswith("=")}
        takes_value |= {
            "-" + c for c, nxt in zip(self.shortOpt, self.shortOpt[1:] + " ") if nxt == ":"
        }
        ordered: list[str] = []
        # the options the command line gives (a router model's preset yields to them)
        self["given"] = {flag.lstrip("-") for flag, _ in opts}
        for flag, value in opts:
            ordered += [flag, value] if flag in takes_value else [flag]
        super().parseOptions(ordered + ["--"] + positional)

    def opt_version(self) -> None:
        """Print bankml's version and exit."""
        print(f"bankml {__version__}")
        sys.exit(0)

    def opt_ctx_size(self, value: str) -> None:
        """llama-server's name for --ctx"""
        try:
            self["ctx"] = int(value)
        except ValueError:
            raise usage.UsageError(f"--ctx-size {value}: not a number") from None

    def opt_slot_save_path(self, path: str) -> None:
        """llama-server's name for --slot-dir"""
        self["slot-dir"] = path

    def parseArgs(self, file: str | None = None) -> None:
        self["file"] = file  # None: native router mode with no pinned model (_router)

    def postOptions(self) -> None:
        if self["file"] is None:
            self._no_file()
        elif not self["fork"]:
            raise usage.UsageError("--fork FORK.json is required: bankml serves only a pinned file")
        if self["device"] and not self["native"]:
            raise usage.UsageError("--device chooses the native engine's device: it needs --native")
        if self["native"] and (self["spawn"] or self["spec-ngram"]):
            raise usage.UsageError(
                "--native answers with bankml's own engine: "
                "--spawn and --spec-ngram are for llama-server"
            )
        self._llama_options()
        try:
            parse_listen(self["listen"])
            if self["native"]:  # bankml binds the engine address too: loopback only
                parse_listen(self["upstream"])
            self["upstream_addr"] = gw.parse_upstream(self["upstream"])
        except (NotLoopbackError, ValueError) as err:
            raise usage.UsageError(str(err)) from None
        if self["threads"] < 1 or self["ctx"] < (0 if self["native"] else 1):
            raise usage.UsageError(
                "--threads and --ctx must be positive (--ctx 0 with --native: the model's own)"
            )
        spawn = self["spawn"]
        if spawn and not (os.path.isfile(spawn) and os.access(spawn, os.X_OK)):
            raise usage.UsageError(f"--spawn {spawn}: not an executable file")
        if self["slot-dir"] and not os.path.isdir(self["slot-dir"]):
            raise usage.UsageError(f"--slot-dir {self['slot-dir']}: not a directory")
        if not (spawn or self["native"]) and (self["slot-dir"] or self["spec-ngram"]):
            raise usage.UsageError(
                "--slot-dir and --spec-ngram are llama-server arguments: "
                "they need --spawn (--slot-dir also works with --native)"
            )
        self.check_ollama()
        self._restart_delay(spawn)
        self._stop_timeout()
        self["mode"] = "native" if self["native"] else "spawn" if spawn else "upstream"
        if self["engine_args"] and self["mode"] != "spawn":
            raise usage.UsageError(
                "llama-server arguments after -- need --spawn: "
                "they are passed to the llama-server bankml launches"
            )
        refused = llama_args.refusal(self["engine_args"])
        if refused is not None:
            raise usage.UsageError(refused)
        self._rpc_workers()
        # the engine's cache settings: the flags, else the environment (here, and only here)
        self["cache_type"] = self["llama"].get("cache_type", os.environ.get("BANKML_CACHE_TYPE"))
        self["cache_ram"] = self["cache-ram"] or os.environ.get("BANKML_CACHE_RAM")

    def _no_file(self) -> None:
        """No FILE: allowed only in native router mode (``--models-dir``/``--models-preset``
        with ``--native``), whose router then starts with no startup model, as llama-server's
        router starts with none loaded (``bankml llama-server`` on a directory pinning none)."""
        if not (self["native"] and (self["models-dir"] or self["models-preset"])):
            raise usage.UsageError(
                "FILE is required: the pinned model to serve (only native router mode, "
                "--native with --models-dir or --models-preset, starts without one)"
            )
        if self["fork"]:
            raise usage.UsageError("--fork pins FILE: it needs FILE")

    def _llama_options(self) -> None:
        """llama-server's flags, checked and read into ``self["llama"]``: all of them with
        --native; in P0 only who may call (the API key, CORS), which bankml checks itself before
        forwarding. --host/--port become the engine address."""
        given = [name for name in llama_flags.LLAMA_OPTION_NAMES if self[name]]
        self["llama"] = {}
        if not self["native"]:
            engine_flags = [n for n in given if n not in llama_flags.ACCESS_OPTION_NAMES]
            if engine_flags:
                raise usage.UsageError(
                    f"--{engine_flags[0]} is llama-server's: bankml takes it with --native "
                    "(with --spawn, give it to llama-server after --)"
                )
        read = llama_flags.native_settings if self["native"] else llama_flags.access_settings
        try:
            self["llama"] = read(self)
        except llama_flags.FlagError as err:
            raise usage.UsageError(str(err)) from None
        if not self["native"]:
            return
        address = llama_flags.engine_address(self)
        if address is not None:
            self["upstream"] = address
        self._router()

    def _router(self) -> None:
        """llama-server's router mode (``--models-dir DIR``, ``--models-max N``): every model
        DIR pins served (DIR is the registry), up to N resident (llama-server's default 4; 0:
        no bound), and its ``/models`` routes (``router``)."""
        self["router"] = bool(self["models-dir"] or self["models-preset"])
        if self["models-max"] is not None and not self["router"]:
            raise usage.UsageError(
                "--models-max bounds router mode: it needs --models-dir or --models-preset"
            )
        if not self["router"]:
            return
        if self["models-dir"] and not os.path.isdir(self["models-dir"]):
            raise usage.UsageError(f"--models-dir {self['models-dir']}: not a directory")
        self["registry"] = self["registry"] or self["models-dir"]
        try:
            bound = int(self["models-max"] if self["models-max"] is not None else 4)
        except ValueError:
            raise usage.UsageError(f"--models-max {self['models-max']}: not a number") from None
        if bound < 0:
            raise usage.UsageError(f"--models-max {bound}: 0 (no bound) or a number of models")
        if self["max-loaded"] == 1:  # bankml serve's own --max-loaded wins where given
            self["max-loaded"] = bound or 2**31 - 1
        # --no-models-autoload: a request naming a model not loaded is refused (the drop-in
        # passes on the last of it and --models-autoload, as llama-server keeps the last given)
        self["autoload"] = not self["no-models-autoload"]
        try:
            argv = json.loads(self["router-argv"]) if self["router-argv"] else []
        except ValueError:
            argv = None
        if not isinstance(argv, list) or not all(isinstance(a, str) for a in argv):
            raise usage.UsageError("--router-argv: a JSON list of strings")
        self["router-argv"] = argv
        self._presets(bound)

    def _presets(self, bound: int) -> None:
        """The router's models and their own options (``presets``: serving/presets.py): DIR's
        files, ``--models-preset``'s sections over them, each model's settings checked now; the
        startup model (FILE) served with its own."""
        cli = {name: self.get(name) for name in presets.PER_MODEL if name != "ctx"}
        given = self.get("given") or set()
        if not given & {"ctx", "ctx-size"}:  # llama-server's -c 0: each model's preset's, else own
            self["ctx"] = 0
        # a context size given on the command line wins over every preset's, -c 0 too
        cli["ctx"] = str(self["ctx"]) if given & {"ctx", "ctx-size"} else None
        if self["models-preset"] and not os.path.isfile(self["models-preset"]):
            raise usage.UsageError(f"preset file does not exist: {self['models-preset']}")
        try:
            found = presets.load_presets(self["models-preset"], self["models-dir"], cli)
        except presets.PresetError as err:
            raise usage.UsageError(str(err)) from None
        startup = found.startup()
        if bound and len(startup) > bound:
            raise usage.UsageError(
                f"number of models to load on startup ({len(startup)}) exceeds models_max ({bound})"
            )
        try:
            llama_flags.check_model_settings(found, self)
        except llama_flags.FlagError as err:
            raise usage.UsageError(str(err)) from None
        self["presets"] = found
        mine = found.model_of(self["file"]) if self["file"] is not None else None
        if mine is not None:  # FILE's own options: its context, its sampling defaults ...
            own = found.options_for(mine)
            self["llama"] = llama_flags.native_settings({**self, **own})
            self["ctx"] = int(own.get("ctx") or self["ctx"])

    def _rpc_workers(self) -> None:
        """The RPC workers (``self["rpc_workers"]``): ``--rpc A,B`` here or after ``--`` (one of
        the two), each HOST:PORT; here, it is passed on to llama-server after ``--``."""
        given = self["rpc"]
        after = llama_args.value_of(self["engine_args"], llama_args.RPC)
        self["rpc_workers"] = ()
        if given is None and after is None:
            return
        if self["mode"] != "spawn":
            raise usage.UsageError("--rpc is llama-server's: it needs --spawn")
        if given is not None and after is not None:
            raise usage.UsageError("--rpc is given twice (here and after --): give it once")
        if self["registry"] or self["max-loaded"] > 1:
            raise usage.UsageError(
                "--rpc serves one model: an RPC worker serves one llama-server at a time "
                "(--registry and --max-loaded above 1 start one per model)"
            )
        try:
            self["rpc_workers"] = rpc.parse_workers(given if given is not None else after or "")
        except ValueError as err:
            raise usage.UsageError(str(err)) from None
        if given is not None:
            self["engine_args"] = [*self["engine_args"], "--rpc", ",".join(self["rpc_workers"])]

    def _stop_timeout(self) -> None:
        """--stop-timeout SECONDS into ``self["stop_timeout"]`` (10 when not given, as
        llama-server's router's default): it needs --spawn with several models, or native
        router mode (``--models-dir``/``--models-preset``: the grace of a generation running
        on a model that is unloaded)."""
        given = self["stop-timeout"]
        self["stop_timeout"] = DEFAULT_STOP_TIMEOUT
        if given is None:
            return
        several = self["spawn"] and (self["registry"] or self["max-loaded"] > 1)
        if not (several or (self["native"] and self.get("router"))):
            raise usage.UsageError(
                "--stop-timeout is the grace of an unloaded model's llama-server: it needs "
                "--spawn with --registry or --max-loaded above 1, or native router mode "
                "(--models-dir or --models-preset)"
            )
        try:
            self["stop_timeout"] = int(given)
        except ValueError:
            raise usage.UsageError(f"--stop-timeout {given}: not a whole number") from None
        if self["stop_timeout"] < 0:
            raise usage.UsageError(f"--stop-timeout {given}: 0 or more seconds")

    def _restart_delay(self, spawn: str | None) -> None:
        """--restart-delay MIN[:MAX] into ``self["restart_delay"]``; it needs --spawn."""
        given = self["restart-delay"]
        if given is not None and not spawn:
            raise usage.UsageError("--restart-delay is for the llama-server --spawn launches")
        try:
            self["restart_delay"] = parse_restart_delay(given) if given else RestartDelay()
        except ValueError as err:
            raise usage.UsageError(str(err)) from None

    def check_ollama(self) -> None:
        """The Ollama options: --native only, a readable keep-alive, loopback addresses."""
        given = [n for n in ("registry", "ollama-listen") if self[n]]
        if self["spawn"] and given == ["registry"]:  # --spawn runs a llama-server per model
            given = []
        if given and not self["native"]:
            raise usage.UsageError(f"--{given[0]} serves Ollama's API: it needs --native")
        try:
            parse_keep_alive(self["keep-alive"])
        except BadKeepAlive as err:
            raise usage.UsageError(f"--keep-alive: {err}") from None
        if self["max-loaded"] < 1:
            raise usage.UsageError("--max-loaded: at least 1")
        if self["max-loaded"] != 1 and not (self["native"] or self["spawn"]):
            raise usage.UsageError(
                "--max-loaded serves several models: it needs --native or --spawn"
            )
        if self["models-memory"] is not None:
            try:
                self["models-memory"] = parse_size(self["models-memory"])
            except ValueError as err:
                raise usage.UsageError(f"--models-memory: {err}") from None
        if (
            self["registry"]
            and os.path.exists(self["registry"])
            and not os.path.isdir(self["registry"])
        ):
            raise usage.UsageError(f"--registry {self['registry']}: not a directory")
        if self["ollama-listen"]:
            try:
                parse_listen(self["ollama-listen"])
            except (NotLoopbackError, ValueError) as err:
                raise usage.UsageError(f"--ollama-listen: {err}") from None


def parse_size(text: Any) -> int:
    """A size in bytes: a whole number, or one with K, M, G or T (powers of 1024, an optional
    ``iB`` or ``B`` after it); ValueError otherwise."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*", str(text), re.IGNORECASE)
    if m is None:
        raise ValueError(f"{text!r}: not a size (bytes, or a number with K, M, G or T)")
    power = " KMGT".index(m.group(2).upper() or " ")
    return int(float(m.group(1)) * 1024**power)


def default_registry() -> str:
    """A bare ``--registry``'s directory: $BANKML_FORKS, else ~/.local/share/bankml/forks."""
    return os.environ.get("BANKML_FORKS") or os.path.expanduser("~/.local/share/bankml/forks")


def registry_with_default(args: list[str]) -> list[str]:
    """``--registry`` takes a directory when the next argument is one (or ``--registry=DIR``);
    bare, it names the default directory."""
    out: list[str] = []
    for i, arg in enumerate(args):
        if arg == "--registry" and not (i + 1 < len(args) and os.path.isdir(args[i + 1])):
            out.append(f"--registry={default_registry()}")
        else:
            out.append(arg)
    return out


def makeService(options: Options) -> ServingService:
    """Verify (before anything listens), then the engine and the site: `--native` is
    bankml/native/service.py's service, `--spawn` / `--upstream` bankml/p0/service.py's (both
    verify the same way)."""
    from twisted.internet import reactor  # the reactor twistd (or serve_command) installed

    _trace_crashes()
    if options["mode"] == "native":
        return make_native_service(options, reactor)
    return make_p0_service(options, reactor)


def _trace_crashes() -> None:
    """A crash in compiled code (a kernel, a native library) ends the process by a signal with
    nothing in its log; with faulthandler on, each thread's Python stack goes to the process's
    real stderr first (the terminal, the process manager's log). Left as it is where it is on
    already (``python -X faulthandler``, pytest)."""
    stream = sys.__stderr__
    if faulthandler.is_enabled() or stream is None:
        return
    try:
        faulthandler.enable(file=stream)
    except (OSError, ValueError, AttributeError):  # a stderr without a file descriptor
        pass


def serve_command(argv: list[str]) -> int:
    """`bankml serve ...`: the twistd plugin's Options and makeService, run in the foreground
    with logs on stderr, returning the exit status (128 + signal after a stop by signal)."""
    options = Options()
    try:
        options.parseOptions(argv)
    except usage.UsageError as err:
        print(f"bankml serve: {err}\nusage: bankml serve {Options.synopsis}", file=sys.stderr)
        return 1
    observer = FilteringLogObserver(
        textFileLogObserver(sys.stderr), [LogLevelFilterPredicate(defaultLogLevel=LogLevel.info)]
    )
    globalLogBeginner.beginLoggingTo([observer], redirectStandardIO=False)
    try:
        svc = makeService(options)
    except SystemExit as done:
        return int(done.code or 0)
    except KeyboardInterrupt:
        return 128 + signal.SIGINT
    from twisted.internet import reactor

    svc.exit_at_interpreter_end = False
    svc.startService()
    reactor.addSystemEventTrigger("before", "shutdown", svc.stopService)
    reactor.run()
    exit_signal = getattr(reactor, "_exitSignal", None)
    if exit_signal:
        return 128 + int(exit_signal)
    return svc.exit_code
