#!/usr/bin/env python3
"""Tokens per second and time to first token: llama-server over llama.cpp RPC workers against
one llama-server process, same run.

    bench/rpc.py [--llama-server BIN] [--model FILE] [--workers 1,2] [--rounds 3]
                 [--tokens 64] [--threads 1] [--delay-ms 0] [--rate-mbit 0]

Starts rpc-server (beside the llama-server binary, as scripts/build-llama-server.sh builds it)
on free loopback ports, and llama-server (``-t N -c 2048 -np 1``) once alone and once over each
count of workers given. Each setup answers the same greedy streamed chat (``--tokens`` tokens,
``ignore_eos``) ``--rounds`` times after one warm-up; the figures are the medians of the time to
the first streamed token (client side, over HTTP) and of llama-server's own decode tokens per
second (``timings.predicted_per_second``), and the time llama-server took to be healthy (it
sends each worker its share of the weights then). The answers are compared with the single
process's.

``--delay-ms D`` adds a network's latency between llama-server and its workers: every byte each
way waits D ms. With ``tc netem`` (kernel module sch_netem) the workers run in a network
namespace joined by a veth pair whose both ends get ``netem delay Dms``; where the kernel has no
netem, a loopback relay in this process holds each chunk D ms before passing it on (the same
latency, no jitter). ``--rate-mbit R`` limits the link to R Mbit/s each way (netem ``rate``; the
relay holds each chunk for its size at that rate too). The line says which was used.

Prints one line per setup and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bankml import rpc  # noqa: E402
from tests import support  # noqa: E402  (the project's llama-server launcher)
from tests.support import free_port  # noqa: E402

PROMPT = "Write a long story about a lighthouse keeper and the sea."
NS = f"bkbench{os.getpid()}"


def wait_worker(address: str, proc: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while rpc.worker_problem(address, 2) is not None:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"rpc-server on {address} did not come up")
        time.sleep(0.1)


class Relay:
    """A loopback TCP relay to ``target`` holding every chunk ``delay`` seconds each way, after
    its time on a link of ``rate`` bits per second (0: unlimited)."""

    def __init__(self, target: tuple[str, int], delay: float, rate: float = 0.0) -> None:
        self.target, self.delay, self.rate = target, delay, rate
        self.port = free_port()
        self.loop = asyncio.new_event_loop()
        started = threading.Event()
        threading.Thread(target=self._run, args=(started,), daemon=True).start()
        started.wait()

    def _run(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)

        async def main() -> None:
            await asyncio.start_server(self._client, "127.0.0.1", self.port)
            started.set()
            await asyncio.Event().wait()

        self.loop.run_until_complete(main())

    async def _pump(self, reader: Any, writer: Any) -> None:
        queue: asyncio.Queue = asyncio.Queue()

        async def send() -> None:
            while True:
                due, data = await queue.get()
                if data is None:
                    break
                wait = due - self.loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                writer.write(data)
                await writer.drain()
            writer.close()

        sender = asyncio.ensure_future(send())
        free_at = 0.0  # when the emulated link has sent everything queued so far
        while data := await reader.read(1 << 20):
            free_at = max(self.loop.time(), free_at)
            if self.rate:
                free_at += len(data) * 8 / self.rate
            queue.put_nowait((free_at + self.delay, data))
        queue.put_nowait((0, None))
        await sender

    async def _client(self, reader: Any, writer: Any) -> None:
        up_reader, up_writer = await asyncio.open_connection(*self.target)
        for sock in (writer.get_extra_info("socket"), up_writer.get_extra_info("socket")):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        await asyncio.gather(self._pump(reader, up_writer), self._pump(up_reader, writer))


def netem_namespace(delay_ms: float, rate_mbit: float) -> str | None:
    """A namespace joined by veth (10.232.0.1 there, .2 here) with netem delay (and rate) on
    both ends; None (nothing left behind) where the kernel has no netem."""
    rate = ["rate", f"{rate_mbit:g}mbit"] if rate_mbit else []

    def ip(*args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True)

    try:
        ip("netns", "add", NS)
    except (OSError, subprocess.CalledProcessError):
        return None
    try:
        ip("link", "add", f"{NS}h", "type", "veth", "peer", "name", f"{NS}w")
        ip("link", "set", f"{NS}w", "netns", NS)
        ip("addr", "add", "10.232.0.2/24", "dev", f"{NS}h")
        ip("link", "set", f"{NS}h", "up")
        ip("-n", NS, "addr", "add", "10.232.0.1/24", "dev", f"{NS}w")
        ip("-n", NS, "link", "set", f"{NS}w", "up")
        for ns_args, dev in (([], f"{NS}h"), (["-n", NS], f"{NS}w")):
            subprocess.run(
                ["tc", *ns_args, "qdisc", "add", "dev", dev, "root", "netem", "delay"]
                + [f"{delay_ms:g}ms", *rate],
                check=True,
                capture_output=True,
            )
    except (OSError, subprocess.CalledProcessError):
        drop_namespace()
        return None
    return NS


def drop_namespace() -> None:
    subprocess.run(["ip", "link", "del", f"{NS}h"], capture_output=True)
    subprocess.run(["ip", "netns", "del", NS], capture_output=True)


def stream_once(url: str, tokens: int) -> tuple[float, float, str]:
    """(ms to the first streamed token, llama-server's decode tokens/s, the text)."""
    import http.client
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    body = {
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "cache_prompt": False,
    }
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=600)
    start = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "text/json"})
    resp = conn.getresponse()
    first = None
    text, tps = "", 0.0
    for line in resp:
        if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
            continue
        event = json.loads(line[6:])
        for choice in event.get("choices", []):
            piece = choice.get("delta", {}).get("content")
            if piece:
                if first is None:
                    first = time.perf_counter()
                text += piece
        if "timings" in event:
            tps = event["timings"]["predicted_per_second"]
    conn.close()
    return ((first or time.perf_counter()) - start) * 1000, tps, text


def measure(server: support.LlamaServer, rounds: int, tokens: int) -> dict[str, Any]:
    started = time.perf_counter()
    with server:
        load_s = time.perf_counter() - started
        stream_once(server.url, tokens)  # warm-up
        runs = [stream_once(server.url, tokens) for _ in range(rounds)]
    return {
        "load_s": round(load_s, 2),
        "ttft_ms": round(statistics.median(r[0] for r in runs), 1),
        "tokens_per_s": round(statistics.median(r[1] for r in runs), 2),
        "text": runs[0][2],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-server", type=Path, default=None)
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--workers", default="1,2", help="worker counts, comma-separated")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--delay-ms", type=float, default=0.0)
    parser.add_argument("--rate-mbit", type=float, default=0.0)
    args = parser.parse_args()
    binary = args.llama_server or support.llama_server_binary()
    model = args.model or support.default_model()
    rpc_server = binary.parent / "rpc-server"
    counts = [int(c) for c in args.workers.split(",")]
    procs: list[subprocess.Popen] = []
    results: dict[str, Any] = {}
    shaped = bool(args.delay_ms or args.rate_mbit)
    namespace = netem_namespace(args.delay_ms, args.rate_mbit) if shaped else None
    how = "loopback"
    if shaped:
        link = f"{args.delay_ms:g} ms each way" + (
            f", {args.rate_mbit:g} Mbit/s" if args.rate_mbit else ""
        )
        how = f"netem {link}" if namespace else f"relay {link} (no netem in this kernel)"
    try:
        one = support.LlamaServer(model, binary=binary, args=["-t", str(args.threads)])
        results["one process"] = measure(one, args.rounds, args.tokens)
        addresses = []
        relays = []
        for _ in range(max(counts)):
            port = free_port()
            host = "10.232.0.1" if namespace else "127.0.0.1"
            prefix = ["ip", "netns", "exec", namespace] if namespace else []
            cmd = [*prefix, str(rpc_server), "-H", host, "-p", str(port), "-t", str(args.threads)]
            procs.append(
                subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            )
            wait_worker(f"{host}:{port}", procs[-1])
            if shaped and not namespace:
                relays.append(Relay((host, port), args.delay_ms / 1000, args.rate_mbit * 1e6))
                addresses.append(f"127.0.0.1:{relays[-1].port}")
            else:
                addresses.append(f"{host}:{port}")
        for count in counts:
            extra = ["-t", str(args.threads), "--rpc", ",".join(addresses[:count])]
            over = support.LlamaServer(model, binary=binary, args=extra)
            results[f"{count} worker{'s' * (count > 1)}"] = measure(over, args.rounds, args.tokens)
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(10)
        if namespace:
            drop_namespace()
    single = results["one process"]["text"]
    for name, r in results.items():
        r["same_text"] = r.pop("text") == single
        print(
            f"{name:12s} load {r['load_s']:6.2f} s  ttft {r['ttft_ms']:8.1f} ms  "
            f"decode {r['tokens_per_s']:7.2f} tok/s  same text as one process: {r['same_text']}"
        )
    print(
        json.dumps(
            {
                "machine": f"{platform.machine()} {os.cpu_count()} cpus",
                "network": how,
                "threads": args.threads,
                "tokens": args.tokens,
                "rounds": args.rounds,
                "results": results,
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
