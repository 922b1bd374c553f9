"""P0 `--spawn`: launching llama-server on the verified path and supervising it.

`EngineProcess` is a twisted Service:

- `start()` (called by tap's service once the reactor runs) refuses if something already answers
  on the upstream address, launches llama-server (bankml's arguments, then the user's extra
  ones given after `--`, which llama_args.py checked; the environment variables that would do a
  refused argument's work are removed), waits up to 900 s for
  `/health` (polling), and fails at once if the process exits first. Then it requires `/props`
  `model_path` to be the verified canonical path, as `--upstream` does.
- llama-server's stdout and stderr go to twisted.logger, line by line (namespace
  ``bankml.llama-server``).
- An unexpected exit: the engine goes `down` (answers are 503 with Retry-After), the file is
  verified again (the whole sha256, in a thread: `deferToThread(verify, ...)`), and llama-server
  is started again after a backoff, `--restart-delay MIN[:MAX]` (default 1 s doubling to 60 s; one
  value: that delay every time); the backoff returns to MIN once the engine has stayed healthy
  for 60 s. A file that no longer verifies leaves the engine `refused`
  (503 without Retry-After) and is not restarted. Every event is logged.
- `stopService()` (reactor shutdown: SIGTERM, SIGINT, SIGHUP, or twistd's stop) sends SIGTERM
  to llama-server, waits up to 10 s, then SIGKILL, and returns a Deferred that fires only when
  the process is gone: twistd waits for it before the reactor stops.
- On Linux the child is started through a tiny exec shim that sets PR_SET_DEATHSIG (SIGTERM)
  before exec'ing llama-server, so even a SIGKILL of bankml itself (which runs no shutdown
  trigger) leaves no llama-server behind. spawnProcess has no preexec_fn; the shim is
  `python -I -S -c SHIM parent_pid llama-server args...`, costing ~30 ms once per start.
- With llama.cpp RPC workers (`rpc_workers`, llama-server's `--rpc`), every start and restart
  first checks that each worker answers RPC's hello with build 11434's protocol (bankml/rpc.py);
  a restart checks them before hashing the file again.

The launching, output, backoff and stopping are `Supervised`'s, shared with
bankml/rpc_worker.py's `WorkerProcess` (llama.cpp's rpc-server under `bankml rpc-worker`).
"""

from __future__ import annotations

import math
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from twisted.application import service
from twisted.internet import error, protocol, task
from twisted.internet.defer import Deferred, inlineCallbacks, succeed
from twisted.internet.threads import deferToThread
from twisted.logger import Logger
from twisted.python.failure import Failure

from bankml import rpc
from bankml.gate.verify import Refused, Verified, verify
from bankml.llama_server import command_line
from bankml.p0 import gateway as gw
from bankml.p0 import llama_args
from bankml.p0.gateway import Gateway

_log = Logger(namespace="bankml.engine")
_engine_log = Logger(namespace="bankml.llama-server")

HEALTH_TIMEOUT_S = 900.0
HEALTH_POLL_S = 0.1
STOP_GRACE_S = 10.0
BACKOFF_FIRST_S = 1.0
BACKOFF_MAX_S = 60.0
BACKOFF_SHORTEST_S = 0.1  # systemd's default RestartSec: a crash loop never restarts back to back
HEALTHY_RESETS_BACKOFF_S = 60.0
MAX_LOG_LINE = 16 * 1024

# Sets the parent-death signal, checks the parent did not die before that, then becomes llama-server.
DEATHSIG_SHIM = (
    "import ctypes,os,sys\n"
    "ctypes.CDLL(None,use_errno=True).prctl(1,15,0,0,0)\n"  # PR_SET_DEATHSIG, SIGTERM
    "os.getppid()==int(sys.argv[1]) or os._exit(70)\n"
    "os.execv(sys.argv[2],sys.argv[2:])\n"
)


class EngineFailed(Exception):
    """llama-server could not be brought up (the message says why)."""


@dataclass(frozen=True)
class RestartDelay:
    """The wait before each restart: `first` seconds, doubled per restart up to `most`."""

    first: float = BACKOFF_FIRST_S
    most: float = BACKOFF_MAX_S

    def after(self, delay: float) -> float:
        return min(delay * 2, self.most)


def parse_restart_delay(text: str) -> RestartDelay:
    """`--restart-delay MIN[:MAX]` (seconds): MIN doubling to MAX; one value is a fixed delay.
    ValueError with the reason for anything else."""
    parts = text.split(":")
    try:
        if len(parts) > 2:
            raise ValueError
        first, most = float(parts[0]), float(parts[-1])
    except ValueError:
        raise ValueError(f"--restart-delay {text}: MIN[:MAX] in seconds, e.g. 1:60") from None
    if not (BACKOFF_SHORTEST_S <= first <= most < float("inf")):
        raise ValueError(
            f"--restart-delay {text}: MIN at least {BACKOFF_SHORTEST_S} s and MAX not below MIN"
        )
    return RestartDelay(first, most)


def llama_server_args(
    binary: str,
    verified_path: str,
    host: str,
    port: int,
    threads: int,
    ctx: int,
    slot_dir: str | None = None,
    spec_ngram: bool = False,
    extra: Sequence[str] = (),
) -> list[str]:
    """llama-server's command line for the verified file (all of it accepted by the pinned build
    11434, checked with --help), the user's `extra` arguments last (checked by
    llama_args.refusal before anything starts); bankml's defaults that `extra` sets itself are
    left out."""
    settings = ["--spec-type", "ngram-simple"] if spec_ngram else []
    if slot_dir:
        settings += ["--slot-save-path", slot_dir]
    return command_line(
        binary,
        verified_path,
        host,
        port,
        threads,
        ctx,
        reasoning_off=True,  # P0's default: no thinking in a chat (the user's -rea replaces it)
        give_way_to=extra,
        after=[*settings, *extra],
    )


def with_deathsig(args: list[str]) -> tuple[str, list[str]]:
    """(executable, argv) that run `args` with PR_SET_DEATHSIG set, on Linux; else unchanged."""
    if not sys.platform.startswith("linux"):
        return args[0], args
    return sys.executable, [
        sys.executable,
        "-I",
        "-S",
        "-c",
        DEATHSIG_SHIM,
        str(os.getpid()),
        *args,
    ]


class _EngineProtocol(protocol.ProcessProtocol):
    """Logs the child's output by line and reports its end to the supervisor."""

    def __init__(
        self, on_end: Callable[[_EngineProtocol, Failure], None], log: Logger = _engine_log
    ) -> None:
        self.on_end = on_end
        self.log = log
        self.partial = {1: b"", 2: b""}
        self.ended: Deferred[None] = Deferred()

    def childDataReceived(self, fd: int, data: bytes) -> None:
        buf = self.partial.get(fd, b"") + data
        *lines, rest = buf.split(b"\n")
        for line in lines:
            self.log.info("{line}", line=line[:MAX_LOG_LINE].decode("utf-8", "replace").rstrip())
        self.partial[fd] = rest[-MAX_LOG_LINE:]

    def processEnded(self, reason: Failure) -> None:
        for rest in self.partial.values():
            if rest:
                self.log.info("{line}", line=rest.decode("utf-8", "replace"))
        self.on_end(self, reason)
        self.ended.callback(None)


def exit_text(reason: Failure) -> str:
    value = reason.value
    if isinstance(value, (error.ProcessDone, error.ProcessTerminated)):
        if getattr(value, "signal", None):
            return f"killed by signal {value.signal}"
        return f"exit status {value.exitCode}"
    return reason.getErrorMessage()


class Supervised(service.Service):
    """A child process bankml launches and keeps up until it stops: started through the
    parent-death shim, its output logged by line (``output_log``), restarted after a backoff
    (``RestartDelay``, back to its first delay once the child stayed up for 60 s), stopped with
    SIGTERM, then SIGKILL after a grace period. `EngineProcess` (llama-server) and
    `bankml.rpc_worker.WorkerProcess` (llama.cpp's rpc-server) are its two kinds; each says
    what "up" means, what an unexpected end does, and what a restart checks first."""

    what = "child"  # its name in the log
    output_log = _engine_log

    def __init__(self, reactor: Any, restart_delay: RestartDelay) -> None:
        self.reactor = reactor
        self.restart_delay = restart_delay
        self.proto: _EngineProtocol | None = None
        self.transport: Any = None
        self.stopping = False
        self.backoff = restart_delay.first
        self.ready_at: float | None = None
        self.restart_call: Any = None
        self.starts = 0
        self.pid: int | None = None
        self.stop_grace = STOP_GRACE_S  # SIGTERM to SIGKILL when the service stops it

    def _launch(self, args: list[str], env: dict[str, str]) -> None:
        executable, argv = with_deathsig(args)
        self.starts += 1
        self.proto = _EngineProtocol(self._ended, self.output_log)
        self.transport = self.reactor.spawnProcess(self.proto, executable, argv, env=env)
        self.pid = (
            self.transport.pid
        )  # kept: Twisted clears transport.pid once the process is reaped

    def _ended(self, proto: _EngineProtocol, reason: Failure) -> None:
        raise NotImplementedError

    def _restart(self) -> Any:
        raise NotImplementedError

    def _schedule_restart(self) -> float:
        """Call `_restart` after the next delay of the backoff; returns that delay."""
        if (
            self.ready_at is not None
            and time.monotonic() - self.ready_at >= HEALTHY_RESETS_BACKOFF_S
        ):
            self.backoff = self.restart_delay.first
        delay, self.backoff = self.backoff, self.restart_delay.after(self.backoff)
        self.restart_call = self.reactor.callLater(delay, self._restart)
        return delay

    def _signal(self, sig: int) -> None:
        if self.transport is not None:
            try:
                self.transport.signalProcess(sig)
            except error.ProcessExitedAlready:
                pass

    def _kill_quietly(self) -> None:
        self._signal(signal.SIGKILL)

    def stopService(self) -> Deferred[None] | None:
        super().stopService()
        return self.stop(self.stop_grace)

    def stop(self, grace: float = STOP_GRACE_S) -> Deferred[None]:
        """SIGTERM, then SIGKILL after `grace` seconds; fires when the child is gone."""
        self.stopping = True
        if self.restart_call is not None and self.restart_call.active():
            self.restart_call.cancel()
        proto = self.proto
        if self.transport is None or proto is None or proto.ended.called:
            return succeed(None)
        pid, what = self.pid, self.what
        _log.info("stopping {what} (pid {pid}): SIGTERM", what=what, pid=pid)
        self._signal(signal.SIGTERM)

        def kill() -> None:
            _log.warn(
                "{what} (pid {pid}) still running after {g:.0f} s: SIGKILL",
                what=what,
                pid=pid,
                g=grace,
            )
            self._signal(signal.SIGKILL)

        killer = self.reactor.callLater(grace, kill)
        done: Deferred[None] = Deferred()

        def ended(_: Any) -> None:
            if killer.active():
                killer.cancel()
            done.callback(None)

        proto.ended.addBoth(ended)
        return done


class EngineProcess(Supervised):
    """llama-server, launched on the verified file and kept up until bankml stops; with
    ``rpc_workers`` (llama-server's ``--rpc``), every start first checks that each worker
    answers RPC's hello with build 11434's protocol (bankml/rpc.py)."""

    name = "engine"
    what = "llama-server"

    def __init__(
        self,
        gateway: Gateway,
        binary: str,
        *,
        threads: int,
        ctx: int,
        slot_dir: str | None = None,
        spec_ngram: bool = False,
        extra_args: Sequence[str] = (),
        health_timeout: float = HEALTH_TIMEOUT_S,
        reverify: Callable[[str, str], Verified] = verify,
        restart_delay: RestartDelay = RestartDelay(),
        rpc_workers: Sequence[str] = (),
    ) -> None:
        super().__init__(gateway.reactor, restart_delay)
        self.gateway = gateway
        self.binary = binary
        self.threads, self.ctx = threads, ctx
        self.slot_dir, self.spec_ngram = slot_dir, spec_ngram
        self.extra_args = list(extra_args)
        self.health_timeout = health_timeout
        self.reverify = reverify
        self.rpc_workers = tuple(rpc_workers)

    # --- starting ----------------------------------------------------------------------------

    def command(self) -> list[str]:
        host, port = self.gateway.upstream
        return llama_server_args(
            self.binary,
            self.gateway.verified.path,
            host,
            port,
            self.threads,
            self.ctx,
            self.slot_dir,
            self.spec_ngram,
            self.extra_args,
        )

    @inlineCallbacks
    def start(self) -> Any:
        """Bring llama-server up; EngineFailed when it cannot be (the first start is fatal)."""
        if (yield self._answers_health()):
            raise EngineFailed(
                f"something already answers on {self.gateway.upstream_text}: "
                "refusing to spawn a second engine there"
            )
        if self.rpc_workers:
            problem = yield deferToThread(rpc.workers_problem, self.rpc_workers)
            if problem is not None:
                raise EngineFailed(problem)
        self._spawn()
        yield self._wait_healthy()
        props = yield self.gateway.fetch_props()
        problem = self.gateway.engine_path_problem(props)
        if problem is not None:
            raise EngineFailed(problem)
        self.ready_at = time.monotonic()
        self.gateway.set_state(gw.READY, f"healthy on {self.gateway.upstream_text}", self.pid)

    @inlineCallbacks
    def _answers_health(self) -> Any:
        try:
            response = yield self.gateway.request(b"GET", "/health", timeout=2)
            yield gw.bounded_collect(response, 1024 * 1024)
        except Exception:
            return False
        return True

    def _spawn(self) -> None:
        args = self.command()
        self._launch(args, llama_args.engine_environment(os.environ))
        self.gateway.set_state(gw.STARTING, "launched: " + " ".join(args), self.pid)

    @inlineCallbacks
    def _wait_healthy(self) -> Any:
        """Poll /health until 200; fail at once if the process ends, or after health_timeout."""
        proto = self.proto
        deadline = self.reactor.seconds() + self.health_timeout
        while True:
            if proto is None or proto.ended.called or self.stopping:
                raise EngineFailed(
                    f"llama-server exited before it was healthy ({self.gateway.state_reason})"
                )
            try:
                response = yield self.gateway.request(b"GET", "/health", timeout=5)
                yield gw.bounded_collect(response, 1024 * 1024)
                if response.code == 200:
                    return
            except Exception:
                pass  # not listening yet
            if self.reactor.seconds() > deadline:
                self._signal(signal.SIGKILL)
                raise EngineFailed(
                    f"llama-server was not healthy within {self.health_timeout:.0f} s"
                )
            yield task.deferLater(self.reactor, HEALTH_POLL_S, lambda: None)

    # --- supervising -------------------------------------------------------------------------

    def _ended(self, proto: _EngineProtocol, reason: Failure) -> None:
        pid = self.pid
        how = exit_text(reason)
        if proto is self.proto:
            self.transport = None
        if self.stopping:
            self.gateway.set_state(gw.STOPPED, f"llama-server (pid {pid}) stopped: {how}")
            return
        was_ready = self.gateway.state == gw.READY
        self.gateway.set_state(gw.DOWN, f"llama-server (pid {pid}) exited unexpectedly: {how}")
        if was_ready:
            self._schedule_restart()

    def _schedule_restart(self) -> float:
        delay = super()._schedule_restart()
        self.gateway.retry_after_s = max(1, math.ceil(delay))
        _log.warn(
            "restarting llama-server in {delay:g} s after verifying the file again", delay=delay
        )
        return delay

    @inlineCallbacks
    def _restart(self) -> Any:
        self.restart_call = None
        if self.stopping:
            return
        if self.rpc_workers:  # a worker still down: wait for it before hashing the file again
            problem = yield deferToThread(rpc.workers_problem, self.rpc_workers)
            if problem is not None:
                if self.stopping:
                    return
                _log.warn("not restarting yet: {problem}", problem=problem)
                self.gateway.set_state(gw.DOWN, f"waiting for the RPC workers: {problem}")
                self._schedule_restart()
                return
        v = self.gateway.verified
        try:
            again = yield deferToThread(self.reverify, v.path, v.fork_path)
        except Refused as err:
            self.gateway.set_state(gw.REFUSED, f"the file no longer verifies: {err.reason}")
            return
        if again.sha256 != v.sha256 or again.path != v.path:
            self.gateway.set_state(
                gw.REFUSED,
                f"the file verifies as {again.sha256} at {again.path}, "
                f"not {v.sha256} at {v.path}: not restarting",
            )
            return
        self.gateway.verified = again  # the same pinned bytes, hashed again just now
        _log.info("verified again: {path} sha256 {sha}", path=again.path, sha=again.sha256)
        self.gateway.restarts += 1
        try:
            yield self.start()
        except Exception as err:
            if self.stopping:
                return
            _log.error("restart failed: {err}", err=err)
            self._kill_quietly()
            self.gateway.set_state(gw.DOWN, f"restart failed: {err}")
            self._schedule_restart()
