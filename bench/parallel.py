#!/usr/bin/env python3
"""Concurrent streams: `bankml serve --native --parallel N` against llama-server `-np N`.

    bench/parallel.py [--llama-server BIN] [--model FILE] [--fork FORK.json]
                      [--streams 1,2,4,8] [--tokens 128] [--rounds 2]

For each N, both servers are started with N slots and a unified cache (``-kvu``: every slot
the whole ``-c 2048``), the same model and ``-t 2``, one after the other on the same machine.
Each round sends N streamed /v1/chat/completions at once (distinct prompts, greedy,
``max_tokens`` --tokens with ``ignore_eos``, ``cache_prompt: false``), alternating which server
goes first. Figures per server and N: aggregate decode tokens per second (every stream's
tokens over the wall time from the first request sent to the last stream's end), p50 and p99
time to first token over every stream of every round; then the ratios bankml / llama-server
(above 1 is bankml faster for tok/s, below 1 for TTFT) and each server's N-stream / 1-stream
aggregate. Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.serve import stream_chat  # noqa: E402  (one streamed chat, timed event by event)
from tests import support  # noqa: E402  (the project's one llama-server launcher)
from tests.native_server import native_process  # noqa: E402

TOPICS = [
    "a lighthouse keeper",
    "a mountain village",
    "a robot learning to paint",
    "a river in winter",
    "a night market",
    "an old library",
    "a desert crossing",
    "a ship's cook",
]


def body(i: int, tokens: int) -> dict[str, Any]:
    return {
        "messages": [
            {"role": "user", "content": f"Write a story about {TOPICS[i % len(TOPICS)]}."}
        ],
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
        "cache_prompt": False,
    }


def one_round(port: int, n: int, tokens: int) -> dict[str, Any]:
    """N streams at once; their TTFTs and the aggregate decode rate."""
    results: list[Any] = [None] * n

    def client(i: int) -> None:
        try:
            results[i] = stream_chat(port, body(i, tokens))
        except Exception as err:  # reported with the figures, never hidden
            results[i] = err

    threads = [threading.Thread(target=client, args=(i,)) for i in range(n)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    failed = [r for r in results if isinstance(r, Exception)]
    if failed:
        raise RuntimeError(f"port {port}: {failed[0]}")
    return {
        "ttft_s": [r.ttft_s for r in results],
        "tokens": sum(r.tokens for r in results),
        "wall_s": wall,
    }


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def summarize(rounds: list[dict[str, Any]]) -> dict[str, float]:
    ttfts = [t for r in rounds for t in r["ttft_s"]]
    return {
        "tok_s": sum(r["tokens"] for r in rounds) / sum(r["wall_s"] for r in rounds),
        "ttft_p50_s": statistics.median(ttfts),
        "ttft_p99_s": percentile(ttfts, 0.99),
    }


def measure(args: argparse.Namespace, n: int, binary: Path, model: Path, fork: Path) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        llama = support.LlamaServer(model, binary=binary, args=["-np", str(n), "-kvu"])
        bankml = native_process(model, fork, Path(tmp))
        bankml.engine_args += ["--parallel", str(n), "--kv-unified"]
        with llama as server, bankml as ours:
            ports = {"bankml": ours.port, "llama_server": server.port}
            for port in ports.values():  # first-request costs are not the measure
                one_round(port, 1, 4)
            rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in ports}
            for r in range(args.rounds):
                order = list(ports) if r % 2 == 0 else list(reversed(ports))
                for name in order:
                    rounds[name].append(one_round(ports[name], n, args.tokens))
    return {name: summarize(rs) for name, rs in rounds.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-server", type=Path, default=None)
    parser.add_argument("--model", type=Path, default=support.DEFAULT_MODEL)
    parser.add_argument("--fork", type=Path, default=None)
    parser.add_argument("--streams", default="1,2,4,8")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the servers stop on the way out
    binary = args.llama_server or support.llama_server_binary()
    model = args.model.resolve()
    fork = args.fork or model.with_name(model.name + ".FORK.json")
    figures: dict[str, Any] = {"model": model.name, "tokens": args.tokens, "rounds": args.rounds}
    counts = [int(s) for s in args.streams.split(",")]
    for n in counts:
        print(f"[parallel] N = {n}", file=sys.stderr, flush=True)
        figures[f"n{n}"] = measure(args, n, binary, model, fork)
    print(f"{'N':>3} {'server':<13} {'tok/s':>8} {'TTFT p50':>9} {'TTFT p99':>9}")
    for n in counts:
        row = figures[f"n{n}"]
        for name in ("bankml", "llama_server"):
            f = row[name]
            print(
                f"{n:>3} {name:<13} {f['tok_s']:8.1f} {f['ttft_p50_s']:8.3f}s {f['ttft_p99_s']:8.3f}s"
            )
        row["ratio_tok_s"] = row["bankml"]["tok_s"] / row["llama_server"]["tok_s"]
        row["ratio_ttft_p50"] = row["bankml"]["ttft_p50_s"] / row["llama_server"]["ttft_p50_s"]
        print(
            f"{n:>3} bankml/llama-server: tok/s x{row['ratio_tok_s']:.2f}, TTFT p50 "
            f"x{row['ratio_ttft_p50']:.2f}"
        )
    if 1 in counts:
        for n in counts:
            for name in ("bankml", "llama_server"):
                figures[f"n{n}"][name]["scaling"] = (
                    figures[f"n{n}"][name]["tok_s"] / figures["n1"][name]["tok_s"]
                )
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
