"""Start-up, shared by P0 and native: verify before anything listens, one refusal rule, bind,
signals.

- ``verify_before_listening(file, fork)``: ``verify`` (guard, then the whole-file sha256 against
  the pin), run before the reactor starts; a refusal prints ``refuse: <reason>`` and exits with
  verify's code (2, or 1 for an unreadable file, 3 for a truncated header). Passing logs the
  ``verified … pinned in …`` line.
- ``receipt_key_before_listening(path)``: the receipt signing key, loaded (or created 0600 at
  the first start; when no path is given, ``$BANKML_RECEIPT_KEY``, else
  ``~/.local/share/bankml/receipt-key.pem``); a key file others may
  read or change, or that does not parse, is ``refuse: <reason>``, exit 2. The log says where
  the key is and its id.
- ``receipt_log_before_listening(path)``: ``--receipt-log FILE`` opened (bankml/receipts/log.py)
  to go on with its chain; the service appends every receipt to it and fsyncs it every second
  (``LOG_SYNC_S``) off the reactor thread, and closes it on stop.
- ``ServingService``: the base of both modes' services. ``fatal(reason)`` is the one refusal
  after the reactor started (an engine that cannot be brought up, an address that cannot be
  bound): ``refuse: <reason>`` on stderr and in the log, exit status 2 (``EXIT_REFUSED``).
  ``listen(site, address)`` binds a loopback address and keeps the port for ``stopService``.
  SIGHUP stops bankml like SIGTERM and SIGINT (Twisted handles those two; the default action
  of SIGHUP would kill bankml without its shutdown triggers, leaving llama-server behind). A
  SIGINT ignored when bankml starts (a shell's background job) stays ignored, and the log says so.
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
from collections.abc import Callable
from typing import Any

from twisted.application import service
from twisted.internet import task
from twisted.internet.address import IPv4Address, IPv6Address
from twisted.internet.interfaces import IListeningPort
from twisted.internet.threads import deferToThread
from twisted.logger import Logger
from twisted.web.server import Site

from bankml.gate.verify import Refused, Verified, verify
from bankml.receipts.keys import KeyRefused, SigningKey, ensure_key, key_path
from bankml.receipts.log import LogBroken, ReceiptLog
from bankml.serving.site import listen_loopback

_log = Logger(namespace="bankml.serve")

DEFAULT_LISTEN = "127.0.0.1:18093"
DEFAULT_UPSTREAM = "127.0.0.1:18092"
EXIT_REFUSED = 2
LOG_SYNC_S = 1.0  # --receipt-log: a crash loses at most this much of the log


def refuse(reason: str, code: int = EXIT_REFUSED) -> SystemExit:
    print(f"refuse: {reason}", file=sys.stderr, flush=True)
    return SystemExit(code)


def verify_before_listening(
    file: str, fork: str, while_hashing: Callable[[str], object] | None = None
) -> Verified:
    """verify() before anything listens; a refusal exits with its code. ``while_hashing`` is
    verify's: started once the guard passed, it overlaps the hash."""
    try:
        verified = verify(file, fork, while_hashing=while_hashing)
    except Refused as err:
        raise refuse(err.reason, err.exit_code) from None
    _log.info(
        "verified {path}: sha256 {sha} pinned in {fork}",
        path=verified.path,
        sha=verified.sha256,
        fork=verified.fork_path,
    )
    return verified


def receipt_key_before_listening(path: str | None) -> SigningKey:
    """The key every receipt is signed with (``--receipt-key``, else ``$BANKML_RECEIPT_KEY``,
    else the default under HOME); a refusal exits 2."""
    where = key_path(path)
    try:
        key, created = ensure_key(where)
    except KeyRefused as err:
        raise refuse(f"--receipt-key {err.reason}") from None
    _log.info(
        "receipt key {path} ({how}), key id {keyid}",
        path=str(where),
        how="created" if created else "loaded",
        keyid=key.keyid,
    )
    return key


def receipt_log_before_listening(path: str | None) -> ReceiptLog | None:
    """``--receipt-log FILE`` opened to go on with its chain (a last line cut short by a crash
    cut off first); a file that cannot be read or written is a refusal, exit 2."""
    if not path:
        return None
    try:
        log = ReceiptLog.open(path)
    except OSError as err:
        raise refuse(f"--receipt-log {path}: {err.strerror or err}") from None
    except LogBroken as err:
        raise refuse(f"--receipt-log {err.reason}") from None
    _log.info("receipt log {path}, next line {seq}", path=path, seq=log.seq)
    return log


def stop_on_sighup(reactor: Any) -> None:
    """SIGHUP stops bankml like SIGTERM, exiting by the signal."""

    def on_hup(signum: int, frame: Any) -> None:
        _log.info("Received SIGHUP, shutting down.")
        reactor._exitSignal = signum  # ISupportsExitSignalCapturing: exit by the signal
        reactor.callFromThread(reactor.stop)

    signal.signal(signal.SIGHUP, on_hup)
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        # a background job of a shell starts so; Twisted leaves an ignored SIGINT ignored
        _log.info("SIGINT is ignored, as this process was started; stop bankml with SIGTERM")


def _exit_now(code: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class ServingService(service.MultiService):
    """What both modes' services share: SIGHUP, the refusal rule, the listening ports."""

    def __init__(self, reactor: Any) -> None:
        super().__init__()
        self.reactor = reactor
        self.ports: list[IListeningPort] = []
        self.exit_code = 0
        self.exit_at_interpreter_end = True  # under twistd; serve_command reads exit_code itself
        self.receipt_log: ReceiptLog | None = None  # --receipt-log, synced every second
        self.log_syncer: task.LoopingCall | None = None

    def startService(self) -> None:
        super().startService()
        stop_on_sighup(self.reactor)
        if self.receipt_log is not None:
            log = self.receipt_log
            # fsync off the reactor thread: appends go on while the disk catches up
            self.log_syncer = task.LoopingCall(lambda: deferToThread(log.sync))
            self.log_syncer.clock = self.reactor
            self.log_syncer.start(LOG_SYNC_S, now=False).addErrback(
                lambda failure: _log.failure("receipt log sync failed", failure)
            )

    def listen(self, site: Site, address: str) -> IListeningPort:
        port = listen_loopback(site, address, self.reactor)
        self.ports.append(port)
        return port

    def port_of(self, index: int) -> int:
        """The bound port of the ``index``-th address (for tests that bind port 0)."""
        address = self.ports[index].getHost()
        assert isinstance(address, (IPv4Address, IPv6Address))  # listen_loopback binds TCP
        return address.port

    def fatal(self, reason: str, code: int = EXIT_REFUSED) -> None:
        """Refuse to serve: the reason on stderr and in the log, then exit with ``code``."""
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
        else:  # refused in startService (a port taken): stop as soon as the reactor runs
            self.reactor.callWhenRunning(self.reactor.stop)

    def stopService(self) -> Any:
        for port in self.ports:
            port.stopListening()
        self.ports = []
        if self.log_syncer is not None and self.log_syncer.running:
            self.log_syncer.stop()
        if self.receipt_log is not None:
            self.receipt_log.close()
        return super().stopService()
