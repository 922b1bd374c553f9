#!/usr/bin/env python3
"""What bankml's gateway adds, against the same llama-server in the same run.

    bench/gateway.py [--llama-server BIN] [--model FILE] [--fork FORK.json] [--requests 200]
                     [--mode upstream|spawn]

Starts llama-server and `bankml serve` in front of it (`--upstream` by default; `--spawn` lets
bankml launch its own on another port, and the direct figures then go to that one). Then, alternating
through and direct so that both see the same machine load:

- `/health`, `--requests` pairs: the added latency (through - direct), p50 and p99 in ms;
- a short non-streamed chat (8 tokens, temperature 0), `--chat-pairs` (25): the added latency;
- a streamed answer (`--stream-tokens` 128, ignore_eos), `--stream-pairs` (5): tokens per second
  through / direct (medians).

Each client keeps one HTTP/1.1 connection open, as an application would. It prints a table and
ends with one JSON line of the figures. Targets: /health p50 added <= 1 ms, streamed
throughput >= 0.98 of direct.
"""

from __future__ import annotations

import argparse
import http.client
import json
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests import support  # noqa: E402  (the project's one llama-server launcher)
from tests.bankml_process import BankmlProcess  # noqa: E402

CHAT = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8, "temperature": 0}
STREAM = {
    "messages": [{"role": "user", "content": "Tell me a long story about a lighthouse."}],
    "max_tokens": 128,
    "temperature": 0,
    "ignore_eos": True,
    "stream": True,
}


class Client:
    """One kept-alive connection; times one request to its last byte."""

    def __init__(self, port: int) -> None:
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)

    def timed(
        self, method: str, path: str, body: dict[str, Any] | None = None
    ) -> tuple[float, bytes]:
        try:
            return self._timed(method, path, body)
        except (BrokenPipeError, ConnectionResetError, http.client.RemoteDisconnected):
            self.conn.close()  # the server closed an idle kept-alive connection: time it again
            return self._timed(method, path, body)

    def _timed(self, method: str, path: str, body: dict[str, Any] | None) -> tuple[float, bytes]:
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"} if data else {}
        t0 = time.perf_counter()
        self.conn.request(method, path, body=data, headers=headers)
        resp = self.conn.getresponse()
        raw = resp.read()
        elapsed = time.perf_counter() - t0
        if resp.status != 200:
            raise RuntimeError(f"{method} {path}: {resp.status} {raw[:200]!r}")
        return elapsed, raw


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def added_latency(
    through: Client, direct: Client, method: str, path: str, body: Any, n: int
) -> list[float]:
    """Through minus direct, in ms, pair by pair (the order alternates each pair)."""
    added = []
    for i in range(n):
        if i % 2:
            d, _ = direct.timed(method, path, body)
            t, _ = through.timed(method, path, body)
        else:
            t, _ = through.timed(method, path, body)
            d, _ = direct.timed(method, path, body)
        added.append((t - d) * 1000)
    return added


def stream_rate(client: Client, tokens: int) -> float:
    """Completion tokens per second of one streamed answer, first request byte to last byte."""
    elapsed, raw = client.timed("POST", "/v1/chat/completions", {**STREAM, "max_tokens": tokens})
    tokens = 0
    for event in raw.split(b"\n\n"):
        if event.startswith(b"data: {"):
            obj = json.loads(event[6:])
            for choice in obj.get("choices") or []:
                if (choice.get("delta") or {}).get("content"):
                    tokens += 1
    return tokens / elapsed


def progress(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def measure(
    through_port: int,
    direct_port: int,
    n: int,
    chat_pairs: int,
    stream_pairs: int,
    stream_tokens: int,
) -> dict[str, Any]:
    through, direct = Client(through_port), Client(direct_port)
    for _ in range(20):  # warm both paths (connections, caches)
        through.timed("GET", "/health")
        direct.timed("GET", "/health")
    through.timed("POST", "/v1/chat/completions", CHAT)
    direct.timed("POST", "/v1/chat/completions", CHAT)
    progress("warm; /health pairs")
    health = added_latency(through, direct, "GET", "/health", None, n)
    progress("chat pairs")
    chat = added_latency(through, direct, "POST", "/v1/chat/completions", CHAT, chat_pairs)
    progress("streamed pairs")
    rates_through, rates_direct = [], []
    for i in range(stream_pairs):
        pair = (through, direct) if i % 2 == 0 else (direct, through)
        for client in pair:
            rate = stream_rate(client, stream_tokens)
            (rates_through if client is through else rates_direct).append(rate)
    return {
        "health_added_ms_p50": round(percentile(health, 50), 3),
        "health_added_ms_p99": round(percentile(health, 99), 3),
        "chat_added_ms_p50": round(percentile(chat, 50), 3),
        "chat_added_ms_p99": round(percentile(chat, 99), 3),
        "stream_tps_through": round(statistics.median(rates_through), 2),
        "stream_tps_direct": round(statistics.median(rates_direct), 2),
        "stream_ratio": round(
            statistics.median(rates_through) / statistics.median(rates_direct), 4
        ),
        "health_pairs": len(health),
        "chat_pairs": len(chat),
        "stream_pairs": stream_pairs,
        "stream_tokens": stream_tokens,
        "stream_tps_through_all": [round(r, 2) for r in rates_through],
        "stream_tps_direct_all": [round(r, 2) for r in rates_direct],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-server", type=Path, default=None)
    parser.add_argument("--model", type=Path, default=support.DEFAULT_MODEL)
    parser.add_argument("--fork", type=Path, default=None)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--chat-pairs", type=int, default=25)
    parser.add_argument("--stream-pairs", type=int, default=5)
    parser.add_argument("--stream-tokens", type=int, default=128)
    parser.add_argument("--mode", choices=("upstream", "spawn"), default="upstream")
    args = parser.parse_args(argv)
    signal.signal(
        signal.SIGTERM, lambda *_: sys.exit(143)
    )  # so the servers are stopped on the way out
    binary = args.llama_server or support.llama_server_binary()
    model = args.model.resolve()
    fork = args.fork or model.with_name(model.name + ".FORK.json")
    counts = (args.requests, args.chat_pairs, args.stream_pairs, args.stream_tokens)
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "bankml.log"
        if args.mode == "spawn":
            upstream_port = support.free_port()
            engine = ["--spawn", str(binary), "--upstream", f"127.0.0.1:{upstream_port}"]
            with BankmlProcess(model, fork, engine, log) as bankml:
                figures = measure(bankml.port, upstream_port, *counts)
        else:
            with support.LlamaServer(model, binary=binary) as server:
                with BankmlProcess(
                    model, fork, ["--upstream", f"127.0.0.1:{server.port}"], log
                ) as bankml:
                    figures = measure(bankml.port, server.port, *counts)
    figures.update(mode=args.mode, model=model.name)
    print(f"{'measure':<28}{'value':>12}")
    for key, value in figures.items():
        print(f"{key:<28}{value!s:>12}")
    print(
        f"targets: /health p50 added <= 1 ms: {'met' if figures['health_added_ms_p50'] <= 1 else 'MISSED'}; "
        f"stream ratio >= 0.98: {'met' if figures['stream_ratio'] >= 0.98 else 'MISSED'}"
    )
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
