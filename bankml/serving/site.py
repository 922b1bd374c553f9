"""The HTTP front door shared by every bankml endpoint: bankml's loopback rules.

``LoopbackSite`` is a ``twisted.web.server.Site`` whose channel checks every request head before
any resource sees it, and refuses with a short plain-text answer, ``Connection: close`` and the
status of this table:

========================================================  ======================================
condition                                                 answer
========================================================  ======================================
``Host`` missing, repeated, or not ``127.0.0.1``,         403
``localhost`` or ``[::1]`` (any port, any case)
any ``Transfer-Encoding`` on a request                    400 ``send Content-Length``
``Content-Length`` over 16 MiB (decided from the header)  413
``POST`` whose ``Content-Type`` is not application/json   415
request line or header line over 16 KiB, more than 100    400
header lines, or any request Twisted cannot parse
more than 32 open connections                             503 after draining for 200 ms
no complete request within ``read_timeout`` (30 s) of     408 (mid-request) or a plain close
the last byte                                             (idle keep-alive connection)
========================================================  ======================================

A refusal writes its answer at once, then reads and discards the body it was sent (up to its
``Content-Length``, at most ``drain_max_bytes``, for at most ``drain_timeout`` seconds) before
closing, so the client reads the status instead of losing it to a connection reset.
A client that reads nothing of a pending answer for ``write_timeout`` (120 s) is dropped.

Nothing here buffers responses: resources write straight to the transport, so streamed answers
(server-sent events) leave as they are produced.
"""

from __future__ import annotations

import ipaddress
from typing import Any

from twisted.application import internet, service
from twisted.internet.interfaces import IDelayedCall, IListeningPort
from twisted.internet.protocol import Protocol
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web import http, server
from twisted.web.http_headers import Headers
from twisted.web.resource import IResource

__all__ = [
    "LoopbackSite",
    "LoopbackChannel",
    "NotLoopbackError",
    "check_request_head",
    "is_loopback_host",
    "listen_loopback",
    "loopback_service",
    "parse_listen",
]

KIB = 1024
MIB = 1024 * KIB

MAX_BODY_BYTES = 16 * MIB
MAX_LINE_BYTES = 16 * KIB
MAX_HEADER_LINES = 100
MAX_CONNECTIONS = 32
BUSY_DRAIN_SECONDS = 0.2
READ_TIMEOUT_SECONDS = 30.0
WRITE_TIMEOUT_SECONDS = 120.0
DRAIN_TIMEOUT_SECONDS = 5.0
# A refusal reads at most this much of a body: the whole of any body up to twice the limit,
# enough for a client that sends a just-too-large body before reading the answer.
DRAIN_MAX_BYTES = 2 * MAX_BODY_BYTES
# Connections beyond the limit that wait out their 200 ms drain at the same time; past this a
# flood is closed at once so that it costs no memory or timers.
MAX_BUSY_CONNECTIONS = 256

LOOPBACK_HOSTS = frozenset({b"127.0.0.1", b"localhost", b"[::1]"})
LOOPBACK_NAMES = {"localhost": "127.0.0.1"}

_log = Logger(namespace="bankml.site")


class NotLoopbackError(ValueError):
    """A listen address that is malformed or not on loopback; the message is for the user."""


# --- the rules, as pure functions of the request head -----------------------------------------


def is_loopback_host(value: bytes) -> bool:
    """Whether a ``Host`` value names 127.0.0.1, localhost or [::1], with or without a port."""
    value = value.strip().lower()
    if value.startswith(b"["):
        end = value.find(b"]") + 1
        host, rest = (value[:end], value[end:]) if end else (value, b"")
    else:
        host, colon, port = value.partition(b":")
        rest = colon + port
    if rest and not (rest[:1] == b":" and rest[1:].isdigit() and len(rest) <= 6):
        return False
    return host in LOOPBACK_HOSTS


def _media_type(value: bytes) -> bytes:
    """``application/json; charset=utf-8`` -> ``application/json``."""
    return value.split(b";", 1)[0].strip().lower()


def check_request_head(
    method: bytes,
    headers: Headers,
    content_length: int | None,
    saw_transfer_encoding: bool,
    max_body: int = MAX_BODY_BYTES,
) -> tuple[int, str] | None:
    """The refusal (status, text) for a complete request head, or None when it may go on.

    Checked in this order: Host (the DNS-rebinding guard comes first), Transfer-Encoding,
    body size, POST media type.
    """
    hosts = headers.getRawHeaders(b"host") or []
    if len(hosts) != 1 or not is_loopback_host(hosts[0]):
        return 403, "Host must be 127.0.0.1, localhost or [::1]"
    if saw_transfer_encoding:
        return 400, "send Content-Length"
    if content_length is not None and content_length > max_body:
        return 413, f"request body over {max_body // MIB} MiB"
    if method == b"POST":
        types = headers.getRawHeaders(b"content-type") or []
        if len(types) != 1 or _media_type(types[0]) != b"application/json":
            return 415, "POST needs Content-Type: application/json"
    return None


def plain_response(status: int, text: str, extra: tuple[bytes, ...] = ()) -> bytes:
    """A complete HTTP/1.1 answer with a short text body that closes the connection."""
    body = text.encode("utf-8") + b"\n"
    reason = http.RESPONSES.get(status, b"Error")
    head = [
        b"HTTP/1.1 %d %s" % (status, reason),
        b"Content-Type: text/plain; charset=utf-8",
        b"Content-Length: %d" % len(body),
        b"Connection: close",
        *extra,
    ]
    return b"\r\n".join(head) + b"\r\n\r\n" + body


# --- the channel: the rules applied while a request is parsed --------------------------------


class LoopbackChannel(http.HTTPChannel):
    """An HTTPChannel that refuses what bankml refuses, before the Resource sees it."""

    MAX_LENGTH = MAX_LINE_BYTES  # LineReceiver: the request line and each header line
    maxHeaders = MAX_HEADER_LINES
    # The per-line and per-count limits are the rule; the total only has to admit them.
    totalHeadersSize = (MAX_HEADER_LINES + 1) * MAX_LINE_BYTES

    site: LoopbackSite  # set by Site.buildProtocol

    _refusing = False
    _sawTransferEncoding = False
    _drainLeft = 0
    _drainCall: IDelayedCall | None = None
    _writeCall: IDelayedCall | None = None
    _sentAtClockStart: int | None = None
    _bytesQueued = 0

    # -- connection bookkeeping

    def connectionMade(self) -> None:
        self.site._channelOpened()
        super().connectionMade()

    def connectionLost(self, reason: Failure) -> None:
        self._cancel("_drainCall")
        self._cancel("_writeCall")
        self.site._channelClosed()
        super().connectionLost(reason)

    def _cancel(self, name: str) -> None:
        call = getattr(self, name)
        if call is not None and call.active():
            call.cancel()
        setattr(self, name, None)

    # -- the checks

    def headerReceived(self, line: bytes) -> bool:
        # Twisted would set up a chunked decoder; bankml refuses any Transfer-Encoding instead,
        # so the header is only noted here and judged once the head is complete.
        if line.split(b":", 1)[0].lower() == b"transfer-encoding":
            self._sawTransferEncoding = True
            self._receivedHeaderCount += 1
            if self._receivedHeaderCount > self.maxHeaders:
                self._respondToBadRequestAndDisconnect()
                return False
            return True
        return bool(super().headerReceived(line))

    def allHeadersReceived(self) -> None:
        request = self.requests[-1]
        refusal = check_request_head(
            self._command,
            request.requestHeaders,
            self.length,
            self._sawTransferEncoding,
            self.site.max_body,
        )
        if refusal is None:
            super().allHeadersReceived()
            return
        status, text = refusal
        body = None if self._sawTransferEncoding else self.length
        self.refuse(status, text, body_bytes=body)

    def allContentReceived(self) -> None:
        if not self._refusing:  # a refused request never reaches the resource
            super().allContentReceived()

    def lineLengthExceeded(self, line: bytes) -> None:
        self.refuse(400, f"request line or header line over {self.MAX_LENGTH // KIB} KiB")
        self._discard(line)

    def _respondToBadRequestAndDisconnect(self) -> None:
        # Twisted's own parse errors (too many headers, a malformed line, a bad Content-Length)
        # get the same clean answer as bankml's rules instead of a bare status line.
        self.refuse(400, "bad request")

    # -- refusing: answer, drain the body, close

    def refuse(self, status: int, text: str, body_bytes: int | None = None) -> None:
        """Answer ``status`` now, then read and discard the request body before closing.

        ``body_bytes`` is the declared body still to come (None: unknown, drain until
        ``drain_timeout``); the drain is bounded by ``drain_max_bytes`` and ``drain_timeout``.
        """
        if self._refusing or self.transport is None:
            return
        self._refusing = True
        self.setTimeout(None)  # the drain has its own clock
        self.setRawMode()  # whatever follows in this read is body, not headers
        self._networkProducer.resumeProducing()  # keep reading: the drain needs the body
        _log.debug(
            "refused {status} to {peer}: {text}", status=status, peer=self._peer(), text=text
        )
        self.write(plain_response(status, text))
        limit = self.site.drain_max_bytes
        self._drainLeft = limit if body_bytes is None else min(body_bytes, limit)
        if self._drainLeft <= 0:
            self._endDrain()
            return
        self._drainCall = self.site.reactor.callLater(self.site.drain_timeout, self._endDrain)

    def _discard(self, data: bytes) -> None:
        self._drainLeft -= len(data)
        if self._drainLeft <= 0:
            self._endDrain()

    def _endDrain(self) -> None:
        self._cancel("_drainCall")
        if not self.transport.disconnecting:
            self.loseConnection()

    def dataReceived(self, data: bytes) -> None:
        if self._refusing:
            self._discard(data)
        else:
            super().dataReceived(data)

    def rawDataReceived(self, data: bytes) -> None:
        if self._refusing:
            self._discard(data)
        else:
            super().rawDataReceived(data)

    # -- timeouts

    def timeoutConnection(self) -> None:
        """The read timeout: no complete request within ``read_timeout`` of the last byte."""
        if self.requests or self._buffer:
            self.refuse(408, f"no complete request within {self.timeOut:g} s", body_bytes=0)
        else:
            _log.debug("closing idle connection from {peer}", peer=self._peer())
            self.loseConnection()

    def pauseProducing(self) -> None:
        # The transport's send buffer is full: the client is behind. Start the clock.
        super().pauseProducing()
        self._startWriteClock()

    def resumeProducing(self) -> None:
        super().resumeProducing()
        self._cancel("_writeCall")

    def loseConnection(self) -> None:
        # Closing waits for the send buffer to empty, and the transport no longer tells us
        # about progress: a client that never reads would hold the socket for ever.
        super().loseConnection()
        self._startWriteClock()

    def write(self, data: bytes) -> None:
        self._bytesQueued += len(data)
        rest = self._sendNow(data)
        if rest:
            super().write(rest)

    def writeSequence(self, iovec: Any) -> None:
        data = b"".join(iovec)
        self._bytesQueued += len(data)
        rest = self._sendNow(data)
        if rest:
            super().writeSequence([rest])

    def _sendNow(self, data: bytes) -> bytes:
        """Hand ``data`` to the kernel at once when the transport holds nothing unsent, as
        asyncio's transports do; return what the kernel did not take (all of it otherwise),
        for the transport to queue as usual. A stream's token costs one send instead of a
        queued write, a reactor wake when the socket is writable, then the send; order and
        back-pressure stay the transport's, as anything left goes through it."""
        transport = self.transport
        sock = getattr(transport, "socket", None)
        if (
            not data
            or sock is None
            or getattr(transport, "TLS", False)
            or not getattr(transport, "connected", False)
            or getattr(transport, "disconnecting", True)
            or getattr(transport, "_writeDisconnected", True)
            or self._pendingBytes() != 0
        ):
            return data
        try:
            sent = sock.send(data)
        except OSError:  # would block, or the connection failed: the reactor's write reports it
            return data
        return data[sent:]

    def writeHeaders(self, version: bytes, code: bytes, reason: bytes, headers: Any) -> None:
        # Twisted writes the head straight to the transport; count it by what it added there.
        before = self._pendingBytes()
        super().writeHeaders(version, code, reason, headers)
        after = self._pendingBytes()
        if before is not None and after is not None:
            self._bytesQueued += after - before

    def _pendingBytes(self) -> int | None:
        """Bytes still in the transport's send buffer, where the transport says (TCP does;
        its writes only queue, the reactor sends later)."""
        transport = self.transport
        try:
            return len(transport.dataBuffer) - transport.offset + transport._tempDataLen
        except AttributeError:
            return None

    def _bytesSent(self) -> int | None:
        """Bytes this connection has handed to the kernel so far: what the client has taken."""
        pending = self._pendingBytes()
        return None if pending is None else self._bytesQueued - pending

    def _startWriteClock(self) -> None:
        if self._writeCall is None and self.transport is not None:
            self._sentAtClockStart = self._bytesSent()
            self._writeCall = self.site.reactor.callLater(
                self.site.write_timeout, self._writeTimedOut
            )

    def _writeTimedOut(self) -> None:
        self._writeCall = None
        before, now = self._sentAtClockStart, self._bytesSent()
        if before is not None and now is not None and now > before:
            self._startWriteClock()  # the client read some: slow, not stalled
            return
        _log.info(
            "dropping {peer}: it read nothing of the answer for {seconds:g} s",
            peer=self._peer(),
            seconds=self.site.write_timeout,
        )
        self.transport.abortConnection()

    def _peer(self) -> str:
        return str(self.transport.getPeer()) if self.transport is not None else "?"


# --- beyond the connection limit ---------------------------------------------------------------


class _BusyProtocol(Protocol):
    """The 33rd connection: drain what it sends for ``busy_drain`` seconds, then answer 503.

    The answer is scheduled, never written on the accept path, so a slow client cannot hold the
    accept loop, and it does not count as one of the open connections.
    """

    def __init__(self, site: LoopbackSite) -> None:
        self.site = site
        self._answerCall: IDelayedCall | None = None
        self._received = 0

    def connectionMade(self) -> None:
        self._answerCall = self.site.reactor.callLater(self.site.busy_drain, self._answer)

    def dataReceived(self, data: bytes) -> None:
        self._received += len(data)
        if self._received > self.site.drain_max_bytes:
            self.transport.abortConnection()

    def _answer(self) -> None:
        self._answerCall = None
        limit = self.site.max_connections
        self.transport.write(
            plain_response(503, f"more than {limit} open connections", (b"Retry-After: 1",))
        )
        self.transport.loseConnection()

    def connectionLost(self, reason: Failure = None) -> None:  # type: ignore[assignment]
        if self._answerCall is not None and self._answerCall.active():
            self._answerCall.cancel()
        self.site._busy -= 1


# --- the site ----------------------------------------------------------------------------------


class LoopbackSite(server.Site):
    """A Site for loopback only, with the rules above; every limit is an attribute tests may set.

    Access lines go to twisted.logger at debug level (hidden at twistd's default level); refusals
    are logged at debug, the connection limit being reached at warn (at most once a minute).
    """

    protocol = LoopbackChannel  # plain HTTP/1.1: no TLS, so no HTTP/2 negotiation wrapper
    noisy = False

    def __init__(
        self,
        resource: IResource,
        *,
        read_timeout: float = READ_TIMEOUT_SECONDS,
        write_timeout: float = WRITE_TIMEOUT_SECONDS,
        max_connections: int = MAX_CONNECTIONS,
        max_body: int = MAX_BODY_BYTES,
        reactor: Any = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(resource, timeout=read_timeout, reactor=reactor, **kwargs)
        self.write_timeout = write_timeout
        self.max_connections = max_connections
        self.max_body = max_body
        self.busy_drain = BUSY_DRAIN_SECONDS
        self.drain_timeout = DRAIN_TIMEOUT_SECONDS
        self.drain_max_bytes = DRAIN_MAX_BYTES
        self.max_busy = MAX_BUSY_CONNECTIONS
        self.open_connections = 0
        self._busy = 0
        self._lastLimitWarning: float | None = None

    @property
    def read_timeout(self) -> float | None:
        """Seconds without a byte before an unfinished request is refused (408) or closed."""
        return self.timeOut

    @read_timeout.setter
    def read_timeout(self, seconds: float | None) -> None:
        self.timeOut = seconds  # HTTPFactory hands timeOut to each new channel

    def buildProtocol(self, addr: Any) -> Protocol | None:
        if self.open_connections < self.max_connections:
            return super().buildProtocol(addr)
        self._warnLimit()
        if self._busy >= self.max_busy:
            return None  # Twisted closes the socket at once
        self._busy += 1
        return _BusyProtocol(self)

    def _warnLimit(self) -> None:
        now = self.reactor.seconds()
        if self._lastLimitWarning is None or now - self._lastLimitWarning >= 60:
            self._lastLimitWarning = now
            _log.warn(
                "{limit} connections open: answering 503 to new ones", limit=self.max_connections
            )

    def _channelOpened(self) -> None:
        self.open_connections += 1

    def _channelClosed(self) -> None:
        self.open_connections -= 1

    def log(self, request: server.Request) -> None:
        _log.debug(
            "{method} {uri} {code} {length}",
            method=request.method.decode("latin-1"),
            uri=request.uri.decode("latin-1"),
            code=request.code,
            length=request.sentLength,
        )


# --- listening ---------------------------------------------------------------------------------


def _is_loopback_ip(host: str) -> bool:
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    return ip.is_loopback and not (ip.version == 6 and ip.ipv4_mapped is not None)


def parse_listen(address: str) -> tuple[str, int]:
    """``"127.0.0.1:18093"``, ``"localhost:18093"`` or ``"[::1]:18093"`` -> (interface, port).

    The interface is the literal address to bind: ``localhost`` becomes ``127.0.0.1`` and
    ``[::1]`` becomes ``::1``. Anything not on loopback (127.0.0.0/8, ::1, localhost), or
    malformed, raises NotLoopbackError (a ValueError) with a message for the user.
    """
    host, sep, port_text = address.strip().rpartition(":")
    if not sep or not host:
        raise NotLoopbackError(
            f"listen address {address!r}: expected HOST:PORT, e.g. 127.0.0.1:18093"
        )
    if not port_text.isdigit() or int(port_text) > 65535:
        raise NotLoopbackError(f"listen address {address!r}: the port must be 0 to 65535")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise NotLoopbackError(
            f"listen address {address!r}: write an IPv6 address in brackets, [::1]:PORT"
        )
    host = LOOPBACK_NAMES.get(host.lower(), host)
    if not _is_loopback_ip(host):
        raise NotLoopbackError(
            f"refusing to listen on {address!r}: bankml listens on loopback only "
            "(127.0.0.0/8, [::1] or localhost)"
        )
    return host, int(port_text)


def listen_loopback(site: server.Site, address: str, reactor: Any = None) -> IListeningPort:
    """Listen on a loopback address (see parse_listen); anything else raises NotLoopbackError."""
    interface, port = parse_listen(address)
    if reactor is None:
        from twisted.internet import reactor as default_reactor

        reactor = default_reactor
    listening: IListeningPort = reactor.listenTCP(port, site, interface=interface)
    _log.info("listening on {address}", address=listening.getHost())
    return listening


def loopback_service(site: server.Site, address: str) -> service.IService:
    """The same as listen_loopback for twistd: a TCPServer service, refused (NotLoopbackError)
    when it is built, so a bad --listen fails before anything starts."""
    interface, port = parse_listen(address)
    return internet.TCPServer(port, site, interface=interface)
