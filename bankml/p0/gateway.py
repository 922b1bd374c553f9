"""What every P0 resource shares: the verified model, the upstream engine and its state.

One `Gateway` is built by tap.makeService after `verify` passed. The resources read it to decide
whether they may answer (the engine is up, the file is still the one that was hashed, the engine
still serves that path); `EngineProcess` (process_protocol.py) writes the engine's state into it.

The checks before every answer:

- `identity_problem()`: the file is still the one that was hashed (bankml/receipts/vouch.py);
- `engine_path_problem(props)`: the engine's `/props` `model_path`, canonicalised, is
  `verified.path`. Chat answers fetch `/props` for this before they are forwarded.

And after it, `receipt(tally)`: the answer's receipt, built where native's are.
`prompt_token_count(prompt)` asks the engine's `/tokenize` how many tokens it makes of one
completion prompt, for the receipts of the answers whose counts llama-server's whole answer
leaves out (the prompts after the first of a `/v1/completions` request).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from typing import Any

import treq
from twisted.internet.defer import Deferred, inlineCallbacks, succeed
from twisted.logger import Logger
from twisted.web.client import Agent, HTTPConnectionPool, _HTTP11ClientFactory
from twisted.web.http_headers import Headers
from twisted.web.iweb import IBodyProducer, IResponse
from zope.interface import implementer

from bankml.gate.verify import Verified
from bankml.receipts.keys import SigningKey
from bankml.receipts.log import ReceiptLog
from bankml.receipts.sign import forwarded_facts
from bankml.receipts.tally import Tally
from bankml.receipts.vouch import identity_problem, issue_receipt
from bankml.version import __version__

_log = Logger(namespace="bankml.gateway")

MAX_UPSTREAM_BYTES = 64 * 1024 * 1024  # an upstream body or chunk over 64 MiB is refused
PROPS_TIMEOUT_S = 10.0

# engine states, as /bankml shows them
STARTING, READY, DOWN, REFUSED, STOPPED = "starting", "ready", "down", "refused", "stopped"


class UpstreamTooLarge(Exception):
    """An upstream body or SSE line over MAX_UPSTREAM_BYTES: refused before it is held."""

    def __init__(self, what: str) -> None:
        limit = MAX_UPSTREAM_BYTES
        size = f"{limit // (1024 * 1024)} MiB" if limit >= 1024 * 1024 else f"{limit} bytes"
        super().__init__(f"llama-server sent {what} over {size}: refused")


def parse_upstream(address: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:PORT`` for IPv6) -> (host, port); ValueError with the reason."""
    host, sep, port_text = address.strip().rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"upstream address {address!r}: expected HOST:PORT, e.g. 127.0.0.1:18092")
    return host, int(port_text)


class _QuietClientFactory(_HTTP11ClientFactory):
    """The pool's connection factory without a "Starting/Stopping factory" log line per
    connection (HTTPConnectionPool's documented way to customise it is `_factory`)."""

    noisy = False


def make_agent(reactor: Any) -> Agent:
    """An Agent over one persistent connection pool, so /health and chat reuse open connections.

    Not treq's HTTPClient: it wraps every request in a CookieAgent (one cookie jar shared by
    every client of the gateway: wrong for a proxy), a ContentDecoderAgent (asks llama-server
    for gzip and inflates it, hiding the declared length the 64 MiB check reads) and a
    RedirectAgent; and it measured ~0.7 ms more per request than the bare Agent on this
    machine, against a 1 ms budget for the whole gateway. Bodies are still read with
    treq.collect (bounded_collect) or proxy_resource's reader."""
    pool = HTTPConnectionPool(reactor, persistent=True)
    pool._factory = _QuietClientFactory
    pool.maxPersistentPerHost = 8
    pool.cachedConnectionTimeout = 60
    return Agent(reactor, pool=pool, connectTimeout=5)


@implementer(IBodyProducer)
class BytesProducer:
    """A request body already in memory (the client's chat body, forwarded as is)."""

    def __init__(self, body: bytes) -> None:
        self.body = body
        self.length = len(body)

    def startProducing(self, consumer: Any) -> Deferred[None]:
        consumer.write(self.body)
        return succeed(None)

    def pauseProducing(self) -> None:
        pass

    def resumeProducing(self) -> None:
        pass

    def stopProducing(self) -> None:
        pass


def check_length(response: Any, limit: int) -> None:
    """Refuse a body whose declared length (Content-Length, which Twisted's client turns into
    `response.length`) is over the limit, before reading it."""
    length = getattr(response, "length", None)
    if isinstance(length, int) and length > limit:
        raise UpstreamTooLarge("a body")


def bounded_collect(response: Any, limit: int | None = None) -> Deferred[bytes]:
    """The whole body of a response, refused (UpstreamTooLarge) once it passes `limit` bytes
    (default MAX_UPSTREAM_BYTES)."""
    limit = MAX_UPSTREAM_BYTES if limit is None else limit
    parts: list[bytes] = []
    size = [0]

    def collector(data: bytes) -> None:
        check_length(response, limit)  # raising here makes treq close the connection
        size[0] += len(data)
        if size[0] > limit:
            raise UpstreamTooLarge("a body")
        parts.append(data)

    return treq.collect(response, collector).addCallback(lambda _: b"".join(parts))


def canonical(path: str) -> str:
    return os.path.realpath(path)


@dataclass
class Gateway:
    """The verified model, the upstream address and the engine's state, shared by the resources."""

    verified: Verified
    upstream: tuple[str, int]
    mode: str  # "spawn" or "upstream"
    agent: Agent
    reactor: Any
    state: str = STARTING
    state_reason: str = "starting"
    state_since: float = field(default_factory=time.time)
    pid: int | None = None
    engine_build: str | None = None
    retry_after_s: int = 1
    restarts: int = 0
    # the signed receipt: the key, and what bankml knows of the engine (the rest from /props)
    receipt_key: SigningKey | None = None
    cache_type: str | None = None  # the KV cache type llama-server was started with, if known
    engine_digest: str | None = None  # sha256 of the llama-server executable bankml launched
    engine_n_ctx: int | None = None  # /props default_generation_settings.n_ctx
    receipt_log: ReceiptLog | None = None  # --receipt-log: every receipt appended
    rpc_workers: tuple[str, ...] = ()  # llama-server's --rpc workers: every receipt names them
    # the answers this gateway issued a completion receipt on, and their tokens (/bankml/metrics)
    answered: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0

    @property
    def upstream_url(self) -> str:
        host, port = self.upstream
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    @property
    def upstream_text(self) -> str:
        host, port = self.upstream
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    @property
    def engine_name(self) -> str:
        return f"llama-server {self.engine_build}" if self.engine_build else "llama-server"

    def set_state(self, state: str, reason: str, pid: int | None = None) -> None:
        self.state, self.state_reason, self.state_since = state, reason, time.time()
        self.pid = pid
        _log.info("engine {state}: {reason}", state=state, reason=reason)

    # --- the checks before every answer -------------------------------------------------------

    def identity_problem(self) -> str | None:
        return identity_problem(self.verified)

    def receipt(self, tally: Tally, *, ttft_measured: bool = True) -> dict[str, Any]:
        """The receipt of one answer llama-server gave through the gateway: signed when the
        tally holds the request as forwarded (``proxy_answers.forwarded_request``) and there is a
        key."""
        facts = None
        if tally.forwarded is not None:
            facts = forwarded_facts(
                tally.forwarded,
                tally,
                n_ctx=self.engine_n_ctx,
                cache_type=self.cache_type,
                engine_version=self.engine_build,
                engine_digest=self.engine_digest,
                rpc=self.rpc_workers or None,
            )
        out = issue_receipt(
            tally,
            self.verified,
            self.engine_name,
            facts=facts,
            key=self.receipt_key,
            ttft_measured=ttft_measured,
        )
        if self.receipt_log is not None:
            self.receipt_log.append(out)
        self.answered += 1
        self.prompt_tokens += int(tally.prompt_tokens or 0)
        self.completion_tokens += int(tally.completion_tokens or 0)
        return out

    def availability_problem(self) -> tuple[str, int | None] | None:
        """(message, Retry-After seconds or None) when no answer may be given now, else None."""
        if self.state == READY:
            problem = self.identity_problem()
            return None if problem is None else (problem, None)
        if self.state in (STARTING, DOWN):
            return (f"llama-server is {self.state}: {self.state_reason}", self.retry_after_s)
        return (f"llama-server is {self.state}: {self.state_reason}", None)

    def engine_path_problem(self, props: Any) -> str | None:
        """None when /props says the engine serves the verified canonical path."""
        served = props.get("model_path") if isinstance(props, dict) else None
        if not isinstance(served, str):
            return f"upstream {self.upstream_text} /props has no model_path: refused"
        if canonical(served) != self.verified.path:
            return (
                f"upstream {self.upstream_text} serves {served}, "
                f"not the verified {self.verified.path}: refused"
            )
        return None

    @inlineCallbacks
    def fetch_props(self) -> Any:
        """The engine's /props as JSON (its build is noted for receipts)."""
        response = yield self.request(b"GET", "/props", timeout=PROPS_TIMEOUT_S)
        body = yield bounded_collect(response)
        if response.code != 200:
            raise ValueError(f"upstream /props answered {response.code}")
        props = json.loads(body)
        build = props.get("build_info") if isinstance(props, dict) else None
        if isinstance(build, str) and build:
            self.engine_build = build
        settings = props.get("default_generation_settings") if isinstance(props, dict) else None
        n_ctx = settings.get("n_ctx") if isinstance(settings, dict) else None
        if isinstance(n_ctx, int) and not isinstance(n_ctx, bool):
            self.engine_n_ctx = n_ctx
        return props

    @inlineCallbacks
    def prompt_token_count(self, prompt: Any) -> Any:
        """How many tokens the engine makes of one completion prompt (a string, or an array
        of strings and token ids), as it tokenizes a completion's prompt: ``/tokenize`` with
        ``add_special`` and ``parse_special`` (tokenize_input_subprompt's flags). None when it
        cannot tell (another kind of prompt, or no usable answer)."""
        if not isinstance(prompt, (str, list)):
            return None
        body = json.dumps({"content": prompt, "add_special": True, "parse_special": True})
        headers = {b"Content-Type": [b"application/json"]}
        try:
            response = yield self.request(
                b"POST", "/tokenize", body.encode(), headers, timeout=PROPS_TIMEOUT_S
            )
            raw = yield bounded_collect(response)
            tokens = json.loads(raw).get("tokens") if response.code == 200 else None
        except Exception:  # the count stays unknown: the receipt names none, as before
            return None
        return len(tokens) if isinstance(tokens, list) else None

    @inlineCallbacks
    def check_engine_path(self) -> Any:
        """None when the engine still serves the verified path, else the reason (a string).
        A /props that cannot be fetched raises (the caller answers 503 or 502)."""
        props = yield self.fetch_props()
        return self.engine_path_problem(props)

    def request(
        self,
        method: bytes,
        path: str,
        body: bytes | None = None,
        headers: dict[bytes, list[bytes]] | None = None,
        timeout: float | None = None,
    ) -> Deferred[IResponse]:
        """One request to the engine; `timeout` cancels it if no response has begun by then."""
        url = (self.upstream_url + path).encode("ascii", "strict")
        producer = None if body is None else BytesProducer(body)
        d = self.agent.request(method, url, Headers(headers or {}), producer)
        if timeout is not None:
            timer = self.reactor.callLater(timeout, d.cancel)

            def stop_timer(result: Any) -> Any:
                if timer.active():
                    timer.cancel()
                return result

            d.addBoth(stop_timer)
        return d

    def close(self) -> Any:
        """Close the pooled upstream connections (tests; the process exit does it otherwise)."""
        pool = getattr(self.agent, "_pool", None)
        return pool.closeCachedConnections() if pool is not None else None

    # --- GET /bankml -------------------------------------------------------------------------

    def describe(self) -> dict[str, Any]:
        v = self.verified
        return {
            "bankml": __version__,
            "mode": self.mode,
            "verified": v.as_dict(),
            "guard_result": v.guard.as_dict(),
            "model": v.path,
            "model_sha256": v.sha256,
            "fork": v.fork_path,
            "hashed_at": _iso_utc(v.verified_at),
            "hashed_at_unix": v.verified_at,
            "upstream": self.upstream_text,
            "engine": {
                "name": self.engine_name,
                "state": self.state,
                "reason": self.state_reason,
                "since": _iso_utc(self.state_since),
                "pid": self.pid,
                "restarts": self.restarts,
                "spawned": self.mode == "spawn",
                "rpc": list(self.rpc_workers),  # llama.cpp RPC workers it computes on
            },
            "file_unchanged": self.identity_problem() is None,
        }


def _iso_utc(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))
