"""`bankml rpc-worker`: one llama.cpp ``rpc-server`` (an RPC worker llama-server spreads layers
over with ``--rpc``), launched and kept up by bankml.

`WorkerProcess` is a `bankml.process_protocol.Supervised` (the supervision P0 gives
llama-server: the parent-death shim, output logged by line, restarts after the backoff of
``--restart-delay MIN[:MAX]``, SIGTERM then SIGKILL at the end):

- ``start()`` refuses if something already listens on the worker's address, launches
  ``rpc-server -H HOST -p PORT [-t N]``, and waits (up to 60 s) until the worker answers RPC's
  hello with build 11434's protocol (bankml/rpc.py); it fails at once if the process exits
  first. The first start failing is fatal.
- An unexpected exit is logged and rpc-server is started again after the backoff; a restart
  that fails is retried after the next delay.
- The worker binds loopback (127.0.0.1) unless the command line says otherwise and also gives
  ``--allow-network``: llama.cpp's RPC protocol has no authentication and no encryption, so
  anyone who can reach the port can allocate memory and run computations on the
  machine, and read the weights sent to it. bankml warns each time it binds elsewhere (docs/rpc.md: across machines, keep
  the port on a private network, an SSH tunnel or WireGuard).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

from twisted.internet import task
from twisted.internet.defer import inlineCallbacks
from twisted.internet.threads import deferToThread
from twisted.logger import Logger
from twisted.python.failure import Failure

from bankml import rpc
from bankml.process_protocol import RestartDelay, Supervised, exit_text

_log = Logger(namespace="bankml.rpc-worker")
_output_log = Logger(namespace="bankml.rpc-server")

READY_TIMEOUT_S = 60.0
READY_POLL_S = 0.1
LOOPBACK = ("127.0.0.1", "localhost")
NETWORK_WARNING = (
    "rpc-server on {host}: llama.cpp's RPC protocol has no authentication and no encryption; "
    "whoever reaches {host}:{port} can use this worker and read the weights sent to it. "
    "Keep the port on a private network, an SSH tunnel or WireGuard."
)


class WorkerFailed(Exception):
    """rpc-server could not be brought up (the message says why)."""


def rpc_server_args(
    binary: str, host: str, port: int, threads: int | None, extra: Sequence[str] = ()
) -> list[str]:
    args = [binary, "-H", host, "-p", str(port)]
    if threads is not None:
        args += ["-t", str(threads)]
    return [*args, *extra]


class WorkerProcess(Supervised):
    """One rpc-server on HOST:PORT, kept up until bankml stops."""

    name = "rpc-worker"
    what = "rpc-server"
    output_log = _output_log

    def __init__(
        self,
        reactor: Any,
        binary: str,
        host: str = "127.0.0.1",
        port: int = rpc.DEFAULT_PORT,
        *,
        threads: int | None = None,
        extra_args: Sequence[str] = (),
        restart_delay: RestartDelay | None = None,
        ready_timeout: float = READY_TIMEOUT_S,
    ) -> None:
        super().__init__(reactor, restart_delay or RestartDelay())
        self.binary = binary
        self.host, self.port = host, port
        self.threads = threads
        self.extra_args = list(extra_args)
        self.ready_timeout = ready_timeout
        self.ready = False

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def command(self) -> list[str]:
        return rpc_server_args(self.binary, self.host, self.port, self.threads, self.extra_args)

    @inlineCallbacks
    def start(self) -> Any:
        """Bring rpc-server up; WorkerFailed when it cannot be."""
        if self.host not in LOOPBACK:
            _log.warn(NETWORK_WARNING, host=self.host, port=self.port)
        if (yield deferToThread(rpc.reachable, self.address)):
            raise WorkerFailed(
                f"something already listens on {self.address}: refusing to start a second "
                "worker there"
            )
        args = self.command()
        self._launch(args, dict(os.environ))
        _log.info("launched: {args}", args=" ".join(args))
        yield self._wait_ready()
        self.ready = True
        self.ready_at = time.monotonic()
        _log.info(
            "rpc-server (pid {pid}) answers on {address}, RPC protocol {v}",
            pid=self.pid,
            address=self.address,
            v=rpc.version_text(rpc.PROTOCOL),
        )

    @inlineCallbacks
    def _wait_ready(self) -> Any:
        proto = self.proto
        deadline = self.reactor.seconds() + self.ready_timeout
        last = "no answer"
        while True:
            if proto is None or proto.ended.called or self.stopping:
                raise WorkerFailed(f"rpc-server exited before it answered ({last})")
            try:
                version = yield deferToThread(rpc.hello, self.address, 2.0)
            except rpc.WorkerRefused as err:
                last = str(err)  # not listening yet
            else:
                if version == rpc.PROTOCOL:
                    return
                self._kill_quietly()  # it answers, but not as this build's worker
                raise WorkerFailed(
                    f"{self.binary} answers RPC protocol {rpc.version_text(version)}, not "
                    f"{rpc.version_text(rpc.PROTOCOL)}: not an rpc-server of build 11434"
                )
            if self.reactor.seconds() > deadline:
                self._kill_quietly()
                raise WorkerFailed(
                    f"rpc-server did not answer within {self.ready_timeout:.0f} s ({last})"
                )
            yield task.deferLater(self.reactor, READY_POLL_S, lambda: None)

    def _ended(self, proto: Any, reason: Failure) -> None:
        if proto is self.proto:
            self.transport = None
        how = exit_text(reason)
        if self.stopping:
            _log.info("rpc-server (pid {pid}) stopped: {how}", pid=self.pid, how=how)
            return
        was_ready, self.ready = self.ready, False
        _log.warn("rpc-server (pid {pid}) exited unexpectedly: {how}", pid=self.pid, how=how)
        if was_ready:
            self._schedule_restart()

    def _schedule_restart(self) -> float:
        delay = super()._schedule_restart()
        _log.warn("restarting rpc-server in {delay:g} s", delay=delay)
        return delay

    @inlineCallbacks
    def _restart(self) -> Any:
        self.restart_call = None
        if self.stopping:
            return
        try:
            yield self.start()
        except Exception as err:
            if self.stopping:
                return
            _log.error("restart failed: {err}", err=err)
            self._kill_quietly()
            self._schedule_restart()
