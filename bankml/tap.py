"""`bankml serve` and `twistd bankml`: one Options class, one makeService.

    bankml serve FILE --fork FORK.json (--spawn BIN | --upstream HOST:PORT) [--listen 127.0.0.1:18093]
                 [--threads 3] [--ctx 4096] [--slot-dir D] [--spec-ngram]
    twistd -n bankml --fork FORK.json FILE ...      # the same options, in the foreground
    twistd --pidfile P --logfile L bankml ...       # the same, as a daemon

Order of events (nothing listens until the file has passed verify):

1. `Options` parse and check the arguments (a bad --listen is refused here).
2. `makeService` runs `verify` (guard, then the whole-file sha256 against the pin) before the
   reactor starts; a refusal prints ``refuse: <reason>`` and exits with verify's code (2, or 1
   for an unreadable file, 3 for a truncated header). Under twistd this happens before it
   daemonizes, so the refusal reaches the terminal.
3. When the reactor runs, `BankmlService` brings the engine up: `--spawn` launches and supervises
   llama-server (process_protocol.py); `--upstream` waits up to 10 s for `/health` and requires
   `/props` `model_path` to be the verified canonical path. A failure prints ``refuse: <reason>``
   and bankml exits 2.
4. Then it listens on `--listen` (loopback only) with `LoopbackSite`.

SIGTERM, SIGINT and SIGHUP stop bankml and a spawned llama-server (Twisted handles the first two;
SIGHUP, which Twisted leaves alone, is handled here the same way). `bankml serve` then exits
with 128 + the signal number; twistd re-raises the signal on itself, which a shell reports the
same way.
"""

from __future__ import annotations

import atexit
import getopt
import os
import signal
import sys
from typing import Any

from twisted.application import service
from twisted.internet import task
from twisted.internet.defer import inlineCallbacks
from twisted.logger import Logger
from twisted.python import usage

from bankml import __version__
from bankml import gateway as gw

_log = Logger(namespace="bankml.serve")

DEFAULT_LISTEN = "127.0.0.1:18093"
DEFAULT_UPSTREAM = "127.0.0.1:18092"
UPSTREAM_WAIT_S = 10.0
EXIT_REFUSED = 2


class Options(usage.Options):
    synopsis = (
        "FILE --fork FORK.json (--spawn BIN | --upstream HOST:PORT) [--listen ADDR] "
        "[--threads N] [--ctx N] [--slot-dir D] [--spec-ngram]"
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
        [
            "device",
            None,
            None,
            "with --native: the engine's device (cpu, cuda, rocm; default auto)",
        ],
    ]
    optFlags = [
        ["spec-ngram", None, "with --spawn: llama-server --spec-type ngram-simple"],
        [
            "native",
            None,
            "answer with bankml's own engine (bankml/native_service.py), also on the "
            "--upstream address",
        ],
    ]

    def parseOptions(self, options: list[str] | None = None) -> None:
        """serve.md writes FILE first (`bankml serve FILE --fork F`); Twisted's parser stops at
        the first positional, so options are moved ahead of it (GNU getopt order) first."""
        args = sys.argv[1:] if options is None else list(options)
        try:
            opts, positional = getopt.gnu_getopt(args, self.shortOpt, self.longOpt)
        except getopt.GetoptError as err:
            raise usage.UsageError(str(err)) from None
        takes_value = {"--" + name[:-1] for name in self.longOpt if name.endswith("=")}
        takes_value |= {
            "-" + c for c, nxt in zip(self.shortOpt, self.shortOpt[1:] + " ") if nxt == ":"
        }
        ordered: list[str] = []
        for flag, value in opts:
            ordered += [flag, value] if flag in takes_value else [flag]
        super().parseOptions(ordered + ["--"] + positional)

    def opt_version(self) -> None:
        """Print bankml's version and exit."""
        print(f"bankml {__version__}")
        sys.exit(0)

    def parseArgs(self, file: str) -> None:
        self["file"] = file

    def postOptions(self) -> None:
        if not self["fork"]:
            raise usage.UsageError("--fork FORK.json is required: bankml serves only a pinned file")
        if self["device"] and not self["native"]:
            raise usage.UsageError("--device chooses the native engine's device: it needs --native")
        if self["native"] and (self["spawn"] or self["spec-ngram"]):
            raise usage.UsageError(
                "--native answers with bankml's own engine: "
                "--spawn and --spec-ngram are for llama-server"
            )
        from bankml.site import NotLoopbackError, parse_listen

        try:
            parse_listen(self["listen"])
            self["upstream_addr"] = gw.parse_upstream(self["upstream"])
        except (NotLoopbackError, ValueError) as err:
            raise usage.UsageError(str(err)) from None
        if self["threads"] < 1 or self["ctx"] < 1:
            raise usage.UsageError("--threads and --ctx must be positive")
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
        self["mode"] = "native" if self["native"] else "spawn" if spawn else "upstream"


def refuse(reason: str, code: int = EXIT_REFUSED) -> SystemExit:
    print(f"refuse: {reason}", file=sys.stderr, flush=True)
    return SystemExit(code)


def verify_or_exit(options: Options) -> Any:
    """verify() before anything listens; a refusal exits with its code."""
    from bankml.gate.verify import Refused, verify

    try:
        return verify(options["file"], options["fork"])
    except Refused as err:
        raise refuse(err.reason, err.exit_code) from None


def stop_on_sighup(reactor: Any) -> None:
    """SIGHUP stops bankml like SIGTERM (Twisted installs no SIGHUP handler; the default
    action would kill bankml without its shutdown triggers, leaving llama-server behind)."""

    def on_hup(signum: int, frame: Any) -> None:
        _log.info("Received SIGHUP, shutting down.")
        reactor._exitSignal = signum  # ISupportsExitSignalCapturing: exit by the signal
        reactor.callFromThread(reactor.stop)

    signal.signal(signal.SIGHUP, on_hup)


class BankmlService(service.MultiService):
    """Brings the engine up, then listens; stops both on shutdown."""

    def __init__(self, options: Options, gateway: Any, site: Any, engine: Any) -> None:
        super().__init__()
        self.options = options
        self.gateway = gateway
        self.site = site
        self.engine = engine
        self.port: Any = None
        self.exit_code = 0
        self.exit_at_interpreter_end = True  # under twistd; serve_command returns the code itself
        if engine is not None:
            engine.setServiceParent(self)

    def startService(self) -> None:
        super().startService()
        stop_on_sighup(self.reactor)
        self.reactor.callWhenRunning(self._bring_up)

    @property
    def reactor(self) -> Any:
        return self.gateway.reactor

    @inlineCallbacks
    def _bring_up(self) -> Any:
        from bankml.process_protocol import EngineFailed
        from bankml.site import listen_loopback

        try:
            if self.engine is not None:
                yield self.engine.start()
            else:
                yield self._check_upstream()
        except EngineFailed as err:
            self._fatal(str(err))
            return
        except Exception as err:  # an engine we cannot reach or read is refused the same way
            self._fatal(f"engine check failed: {err}")
            return
        if not self.running:
            return
        try:
            self.port = listen_loopback(self.site, self.options["listen"], self.reactor)
        except Exception as err:
            self._fatal(f"cannot listen on {self.options['listen']}: {err}")
            return
        v = self.gateway.verified
        _log.info(
            "bankml {ver} serving {path} (sha256 {sha}) on {listen}, engine {up} ({mode})",
            ver=__version__,
            path=v.path,
            sha=v.sha256,
            listen=self.options["listen"],
            up=self.gateway.upstream_text,
            mode=self.gateway.mode,
        )

    @inlineCallbacks
    def _check_upstream(self) -> Any:
        """--upstream: /health within 10 s, then /props model_path must be the verified path."""
        from bankml.process_protocol import EngineFailed

        g = self.gateway
        deadline = self.reactor.seconds() + UPSTREAM_WAIT_S
        last = "no answer"
        while True:
            try:
                response = yield g.request(b"GET", "/health", timeout=2)
                yield gw.bounded_collect(response, 1024 * 1024)
                if response.code == 200:
                    break
                last = f"/health answered {response.code}"
            except Exception as err:
                last = str(err) or err.__class__.__name__
            if self.reactor.seconds() > deadline:
                raise EngineFailed(
                    f"upstream {g.upstream_text} not healthy within "
                    f"{UPSTREAM_WAIT_S:.0f} s ({last})"
                )
            yield task.deferLater(self.reactor, 0.1, lambda: None)
        props = yield g.fetch_props()
        problem = g.engine_path_problem(props)
        if problem is not None:
            raise EngineFailed(problem)
        g.set_state(gw.READY, f"upstream {g.upstream_text} serves the verified file")

    def _fatal(self, reason: str, code: int = EXIT_REFUSED) -> None:
        if not self.running:  # stopping already (a signal during start-up): not a refusal
            _log.info("start-up interrupted: {reason}", reason=reason)
            return
        _log.error("refuse: {reason}", reason=reason)
        print(f"refuse: {reason}", file=sys.stderr, flush=True)
        self.exit_code = code
        if self.exit_at_interpreter_end:
            atexit.register(_exit_now, code)  # twistd itself would exit 0 after the reactor stops
        if self.reactor.running:
            self.reactor.stop()

    def stopService(self) -> Any:
        if self.port is not None:
            self.port.stopListening()
        return super().stopService()


def _exit_now(code: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def makeService(options: Options) -> service.IService:
    """Verify (before anything listens), then the gateway, the engine and the site.
    `--native` is bankml/native_service.py's service (it verifies the same way)."""
    from twisted.internet import reactor

    if options["mode"] == "native":
        from bankml.native_service import make_native_service

        return make_native_service(options)

    from bankml.gateway import Gateway, make_agent
    from bankml.process_protocol import EngineProcess
    from bankml.resources.p0 import p0_root
    from bankml.site import LoopbackSite
    from bankml.usage import EngineFinder, UsageSampler

    verified = verify_or_exit(options)
    _log.info(
        "verified {path}: sha256 {sha} pinned in {fork}",
        path=verified.path,
        sha=verified.sha256,
        fork=verified.fork_path,
    )
    gateway = Gateway(
        verified=verified,
        upstream=options["upstream_addr"],
        mode=options["mode"],
        agent=make_agent(reactor),
        reactor=reactor,
    )
    engine = None
    if options["mode"] == "spawn":
        engine = EngineProcess(
            gateway,
            options["spawn"],
            threads=options["threads"],
            ctx=options["ctx"],
            slot_dir=options["slot-dir"],
            spec_ngram=bool(options["spec-ngram"]),
        )

    sampler = UsageSampler(reactor, EngineFinder(gateway))
    site = LoopbackSite(p0_root(gateway, sampler))
    return BankmlService(options, gateway, site, engine)


def serve_command(argv: list[str]) -> int:
    """`bankml serve ...`: the twistd plugin's Options and makeService, run in the foreground
    with logs on stderr, returning the exit status (128 + signal after a stop by signal)."""
    from twisted.logger import (
        FilteringLogObserver,
        LogLevel,
        LogLevelFilterPredicate,
        globalLogBeginner,
        textFileLogObserver,
    )

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
