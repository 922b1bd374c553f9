#!/usr/bin/env python3
"""A soak of `bankml serve --native`: mixed load for M minutes, the server's RSS, fds and threads.

    bench/soak.py [--minutes 10] [--clients 4] [--bankml-url URL [--engine-url URL]]
                  [--cache-ram MiB] [--warm-up S] [--heap-log FILE] [--seed 0]

Without --bankml-url it starts its own server (tests/native_server.py: the default model,
``--ctx 2048``, a slot directory, ``BANKML_CACHE_RAM`` set from --cache-ram when given). Loopback
only. Each client loops until the deadline over a seeded mix: plain and streamed chat answers
(the receipt checked), a stream left after its first events, a slow reader (small reads with
pauses), a long prompt new to the prompt cache, refusals (a body that is not JSON, a prompt past
the context: 400 expected), /tokenize and /health, and slot save, restore and erase on the engine
address. Anything else than the expected status, a dropped or timed-out connection, a missing
receipt or a traceback in a body is an error.

The load runs in two phases: a warm-up (--warm-up seconds, by default a third of the time, at
most five minutes: the kernels, thread pools and the host prompt cache fill, and the C heap
reaches its high-water mark), a quiet pause, then the rest. The server process is sampled
every second (psutil); growth is measured between the two quiet points (after the warm-up and
after the load), where no request holds a connection or a buffer and the server's heap trim
(every 5 s, bankml/native/heap.py) has run since the last answer. Ends with one JSON line:
requests, errors, p50/p99 latency, RSS, fds and threads at both points and their growth, the
highest RSS of each minute (a leak keeps setting new highs, a heap that has levelled off does
not), the load average.

The C heap: glibc raises its mmap threshold to the size of each large block freed (up to
32 MiB), so after the first large temporaries the engine's later ones come from the heap, which
keeps freed space for reuse instead of returning it. RSS therefore climbs for the first minutes
of a mixed load while the bytes in use stay flat, then levels off (docs/reliability.md).
--heap-log FILE starts the server through bench/heap_probe.py, which samples glibc's figures
inside it each second; the JSON line then holds them at both quiet points too.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import socket
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bankml.native.heap import TRIM_INTERVAL_S  # noqa: E402
from tests import support  # noqa: E402  (the default model and its pin)
from tests.native_server import NativeProcess, native_process  # noqa: E402

TIMEOUT_S = 120.0
WORDS = [
    "river",
    "stone",
    "lamp",
    "window",
    "garden",
    "letter",
    "mountain",
    "candle",
    "harbour",
    "violin",
    "orchard",
]


@dataclass
class Target:
    host: str
    port: int
    engine_port: int | None  # slot actions need the engine address

    @staticmethod
    def of(url: str, engine_url: str | None) -> Target:
        listen = urlsplit(url)
        engine = urlsplit(engine_url) if engine_url else None
        return Target(listen.hostname or "127.0.0.1", listen.port or 80, engine and engine.port)


@dataclass
class Tally:
    lock: threading.Lock = field(default_factory=threading.Lock)
    latencies_ms: list[float] = field(default_factory=list)
    kinds: Counter[str] = field(default_factory=Counter)
    errors: list[str] = field(default_factory=list)

    def record(self, kind: str, started: float, error: str | None) -> None:
        with self.lock:
            self.kinds[kind] += 1
            self.latencies_ms.append((time.monotonic() - started) * 1000)
            if error:
                self.errors.append(f"{kind}: {error}")


def connect(host: str, port: int) -> http.client.HTTPConnection:
    return http.client.HTTPConnection(host, port, timeout=TIMEOUT_S)


def chat_body(content: str, stream: bool, max_tokens: int = 16) -> bytes:
    return json.dumps(
        {
            "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": stream,
        }
    ).encode()


def exchange(host: str, port: int, method: str, path: str, body: bytes | None) -> tuple[int, bytes]:
    conn = connect(host, port)
    try:
        conn.request(method, path, body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def problem(status: int, raw: bytes, expected: int = 200) -> str | None:
    if status != expected:
        return f"status {status} (expected {expected}): {raw[:200]!r}"
    if b"Traceback" in raw:
        return "a traceback in the body"
    return None


class Client:
    def __init__(self, index: int, target: Target, tally: Tally, seed: int) -> None:
        self.index = index
        self.target = target
        self.tally = tally
        self.random = random.Random(seed * 1000 + index)
        self.slot_file = f"soak-{index}.bin"

    def prompt(self, n_words: int) -> str:
        return " ".join(self.random.choice(WORDS) for _ in range(n_words))

    # each action returns an error text or None

    def plain(self) -> str | None:
        status, raw = exchange(
            self.target.host, self.target.port, "POST", "/v1/chat/completions",
            chat_body("Say hello to " + self.prompt(2), False),
        )  # fmt: skip
        return problem(status, raw) or (None if b"bankml_receipt" in raw else "no receipt")

    def streamed(self) -> str | None:
        status, raw = exchange(
            self.target.host, self.target.port, "POST", "/v1/chat/completions",
            chat_body("Count to five about " + self.prompt(2), True),
        )  # fmt: skip
        if problem(status, raw):
            return problem(status, raw)
        if not raw.rstrip().endswith(b"data: [DONE]") or b"bankml_receipt" not in raw:
            return f"an unfinished stream: {raw[-200:]!r}"
        return None

    def _stream(self, max_tokens: int) -> http.client.HTTPResponse:
        conn = connect(self.target.host, self.target.port)
        body = chat_body("Tell a long story about " + self.prompt(3), True, max_tokens)
        conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
        return conn.getresponse()

    def cancelled(self) -> str | None:
        resp = self._stream(200)
        try:
            first = resp.read1(256) if resp.status == 200 else resp.read()
            return problem(resp.status, first) or (
                None if first.startswith(b"data: ") else "no event"
            )
        finally:
            resp.close()  # leaves mid-stream: the server must stop generating and let go

    def slow_reader(self) -> str | None:
        resp = self._stream(24)
        try:
            chunks = []
            while chunk := resp.read1(64):
                chunks.append(chunk)
                time.sleep(0.05)
            raw = b"".join(chunks)
            if problem(resp.status, raw):
                return problem(resp.status, raw)
            return None if raw.rstrip().endswith(b"data: [DONE]") else "an unfinished stream"
        finally:
            resp.close()

    def long_prompt(self) -> str | None:
        """A prompt new to the prompt cache: fills the host cache toward its bound."""
        content = "Summarise: " + self.prompt(self.random.randint(150, 450))
        status, raw = exchange(
            self.target.host, self.target.port, "POST", "/v1/chat/completions",
            chat_body(content, False, 4),
        )  # fmt: skip
        return problem(status, raw)

    def refusal(self) -> str | None:
        if self.random.random() < 0.5:
            status, raw = exchange(
                self.target.host, self.target.port, "POST", "/v1/chat/completions", b"{not json"
            )
        else:
            status, raw = exchange(
                self.target.host, self.target.port, "POST", "/v1/chat/completions",
                chat_body(self.prompt(3000), False),  # past the context: refused before decoding
            )  # fmt: skip
        return problem(status, raw, 400)

    def light(self) -> str | None:
        status, raw = exchange(
            self.target.host, self.target.port, "POST", "/tokenize",
            json.dumps({"content": self.prompt(20)}).encode(),
        )  # fmt: skip
        if problem(status, raw):
            return problem(status, raw)
        status, raw = exchange(self.target.host, self.target.port, "GET", "/health", None)
        return problem(status, raw)

    def slots(self) -> str | None:
        if self.target.engine_port is None:
            return None
        body = json.dumps({"filename": self.slot_file}).encode()
        for action in ("save", "restore", "erase"):
            payload = None if action == "erase" else body
            status, raw = exchange(
                self.target.host, self.target.engine_port, "POST",
                f"/slots/0?action={action}", payload or b"{}",
            )  # fmt: skip
            if problem(status, raw):
                return f"{action}: {problem(status, raw)}"
        return None

    MIX = (
        ("plain", 4), ("streamed", 4), ("cancelled", 2), ("slow_reader", 2),
        ("long_prompt", 3), ("refusal", 2), ("light", 2), ("slots", 1),
    )  # fmt: skip

    def run(self, deadline: float, first: tuple[str, ...] = ()) -> None:
        names = [name for name, _ in self.MIX]
        weights = [weight for _, weight in self.MIX]
        queue = list(first)
        while time.monotonic() < deadline:
            kind = queue.pop(0) if queue else self.random.choices(names, weights)[0]
            started = time.monotonic()
            try:
                error = getattr(self, kind)()
            except (OSError, http.client.HTTPException) as err:
                error = f"{type(err).__name__}: {err}"
            self.tally.record(kind, started, error)


@dataclass
class Sample:
    at: float
    rss: int
    file_backed: int  # RSS pages that map files (the model's weights, shared libraries)
    fds: int
    threads: int


class Sampler(threading.Thread):
    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.process = psutil.Process(pid)
        self.samples: list[Sample] = []
        self.stopping = threading.Event()

    def now(self) -> Sample:
        p = self.process
        memory = p.memory_info()
        return Sample(time.monotonic(), memory.rss, memory.shared, p.num_fds(), p.num_threads())

    def run(self) -> None:
        while not self.stopping.wait(1.0):
            self.samples.append(self.now())


def listening_pid(port: int) -> int:
    for conn in psutil.net_connections("tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr.port == port and conn.pid:
            return conn.pid
    raise SystemExit(f"no process of this user listens on port {port}")


def load(
    target: Target,
    clients: int,
    seconds: float,
    tally: Tally,
    seed: int,
    first: tuple[str, ...] = (),
) -> None:
    deadline = time.monotonic() + seconds
    threads = [
        threading.Thread(target=Client(i, target, tally, seed).run, args=(deadline, first))
        for i in range(clients)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def prompt_cache(target: Target) -> dict[str, Any] | None:
    """The server's host prompt cache (entries, bytes, limit_bytes) from ``GET /bankml/metrics``."""
    conn = connect(target.host, target.port)
    try:
        conn.request("GET", "/bankml/metrics")
        return json.loads(conn.getresponse().read()).get("prompt_cache")
    finally:
        conn.close()


def quiet_point(sampler: Sampler) -> Sample:
    # Closed connections reaped, the last answers' buffers released, and the server's periodic
    # heap trim run once since: both points then count the pages in use, not the free pages
    # the allocator happened to keep between two trims.
    time.sleep(TRIM_INTERVAL_S + 1.0)
    return sampler.now()


def percentile(values: list[float], q: float) -> float | None:
    if len(values) < 2:
        return values[0] if values else None
    return statistics.quantiles(values, n=100, method="inclusive")[round(q) - 1]


WARM_UP_MOST_S = 300.0


def _cache_bytes(cache: dict[str, Any] | None) -> int:
    """The memory the prompt cache's entries take, as /bankml reports it (0 where there is
    none)."""
    return int(cache.get("held_bytes", 0)) if cache else 0


def highest_by_minute(samples: list[Sample]) -> list[float]:
    """The highest RSS (MiB) of each minute of samples, in order."""
    if not samples:
        return []
    start = samples[0].at
    highest: dict[int, int] = {}
    for s in samples:
        minute = int((s.at - start) // 60)
        highest[minute] = max(highest.get(minute, 0), s.rss)
    return [round(highest[m] / (1024 * 1024), 1) for m in sorted(highest)]


def soak(
    target: Target, pid: int, minutes: float, clients: int, seed: int, warm_up: float | None = None
) -> dict[str, Any]:
    total = minutes * 60
    warm_up = min(WARM_UP_MOST_S, total / 3) if warm_up is None else warm_up
    sampler = Sampler(pid)
    sampler.start()
    tally = Tally()
    # every kind once first, long prompts twice: kernels, pools and the prompt cache warm
    warm_first = ("long_prompt", "long_prompt") + tuple(name for name, _ in Client.MIX)
    load(target, clients, warm_up, tally, seed, warm_first)
    before = quiet_point(sampler)
    cache_before = prompt_cache(target)
    before_wall = time.time()
    load(target, clients, total - warm_up, tally, seed + 1)
    after = quiet_point(sampler)
    after_wall = time.time()
    cache_end = prompt_cache(target)
    sampler.stopping.set()
    sampler.join()
    mib = 1024 * 1024
    # the prompt cache grows up to its --cache-ram limit by design: its bytes are taken out
    rest_before = before.rss - _cache_bytes(cache_before)
    rest_after = after.rss - _cache_bytes(cache_end)
    return {
        "minutes": minutes,
        "clients": clients,
        "requests": len(tally.latencies_ms),
        "errors": len(tally.errors),
        "by_kind": dict(sorted(tally.kinds.items())),
        "p50_ms": round(percentile(tally.latencies_ms, 50) or 0),
        "p99_ms": round(percentile(tally.latencies_ms, 99) or 0),
        "warm_up_s": round(warm_up),
        "rss_mib_after_warm_up": round(before.rss / mib, 1),
        "rss_mib_end": round(after.rss / mib, 1),
        "rss_growth_pct": round(100 * (after.rss - before.rss) / before.rss, 2),
        "rss_growth_pct_without_prompt_cache": round(
            100 * (rest_after - rest_before) / rest_before, 2
        ),
        "rss_mib_without_prompt_cache": [round(rest_before / mib, 1), round(rest_after / mib, 1)],
        "rss_file_backed_mib": [
            round(before.file_backed / mib, 1),
            round(after.file_backed / mib, 1),
        ],
        "rss_mib_max": round(max(s.rss for s in sampler.samples) / mib, 1),
        "rss_mib_highest_by_minute": highest_by_minute(sampler.samples),
        "fds_after_warm_up": before.fds,
        "fds_end": after.fds,
        "fd_growth": after.fds - before.fds,
        "threads_after_warm_up": before.threads,
        "threads_end": after.threads,
        "thread_growth": after.threads - before.threads,
        "prompt_cache_end": cache_end,
        "samples": len(sampler.samples),
        "loadavg": [round(x, 2) for x in os.getloadavg()],
        "error_examples": tally.errors[:5],
        "quiet_points_unix": [round(before_wall, 2), round(after_wall, 2)],
    }


@dataclass
class ProbedProcess(NativeProcess):
    """The soak's server, started through bench/heap_probe.py (its heap sampled inside)."""

    heap_log: str = ""

    def command(self) -> list[str]:
        python, *rest = super().command()
        return [python, str(ROOT / "bench" / "heap_probe.py"), self.heap_log, *rest]


def heap_at(log: Path, when: float) -> dict[str, Any] | None:
    """The heap probe's sample nearest to the wall time ``when``."""
    samples = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    return min(samples, key=lambda s: abs(s["at"] - when), default=None)


def less_heap_slack(figures: dict[str, Any]) -> float | None:
    """The RSS growth without the prompt cache's bytes and without the free bytes glibc's heap
    gained between the quiet points: where the heap's top sits after a trim depends on which
    block was allocated last (measured: 123-139 MiB of heap around 88-103 MiB in use, minute to
    minute), so a 1-minute soak's plain RSS moves by ~3 % with nothing leaked. A leak still shows:
    C bytes in use, Python's own arenas and mmapped blocks are all outside the free bytes."""
    start, end = figures.get("heap_mib_after_warm_up"), figures.get("heap_mib_end")
    if not start or not end:
        return None
    slack_mib = max(0.0, end["free_mib"] - start["free_mib"])
    before, after = figures["rss_mib_without_prompt_cache"]
    return round(100 * (after - before - slack_mib) / before, 2)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--bankml-url", help="a running bankml serve --native (loopback)")
    ap.add_argument("--engine-url", help="its engine address, for the slot actions")
    ap.add_argument(
        "--cache-ram", type=int, help="BANKML_CACHE_RAM (MiB) for the server started here"
    )
    ap.add_argument(
        "--warm-up", type=float, help="seconds before the first quiet point (a third, at most 300)"
    )
    ap.add_argument(
        "--heap-log", type=Path, help="sample the server's glibc heap into this file (JSON lines)"
    )
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.heap_log and args.bankml_url:
        ap.error("--heap-log samples a server the soak starts itself: not with --bankml-url")
    if args.minutes <= 0 or args.clients < 1:
        ap.error("--minutes and --clients must be positive")
    if args.warm_up is not None and not 0 < args.warm_up < args.minutes * 60:
        ap.error("--warm-up must be positive and shorter than the run")
    if args.bankml_url:
        target = Target.of(args.bankml_url, args.engine_url)
        if socket.gethostbyname(target.host) != "127.0.0.1":
            ap.error("loopback only: --bankml-url must be 127.0.0.1")
        pid = listening_pid(target.port)
        figures = soak(target, pid, args.minutes, args.clients, args.seed, args.warm_up)
    else:
        env = {} if args.cache_ram is None else {"BANKML_CACHE_RAM": str(args.cache_ram)}
        with tempfile.TemporaryDirectory(prefix="bankml-soak-") as tmp:
            model = support.default_model()
            server = native_process(model, support.DEFAULT_FORK, Path(tmp), env)
            if args.heap_log:
                args.heap_log.unlink(missing_ok=True)  # the probe appends
                given = {f.name: getattr(server, f.name) for f in fields(server)}
                server = ProbedProcess(**given, heap_log=str(args.heap_log.resolve()))
            with server:
                target = Target("127.0.0.1", server.port, server.engine_port)
                assert server.proc is not None
                figures = soak(
                    target, server.proc.pid, args.minutes, args.clients, args.seed, args.warm_up
                )
        figures["cache_ram_mib"] = args.cache_ram
        if args.heap_log:
            figures["heap_mib_after_warm_up"], figures["heap_mib_end"] = (
                heap_at(args.heap_log, when) for when in figures["quiet_points_unix"]
            )
            figures["rss_growth_pct_less_heap_slack"] = less_heap_slack(figures)
    print(json.dumps(figures), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
