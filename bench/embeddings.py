#!/usr/bin/env python3
"""Embeddings per second: bankml's drop-in against llama-server with the same flags, same run.

    bench/embeddings.py [--llama-server BIN] [--model FILE] [--fork FORK.json] [--rounds 3]
                        [--pooling mean] [--tokens 64] [--parallel 1]

Starts ``bankml llama-server`` and llama-server (``-t 2 -c 2048 -np 1 --embeddings --pooling
mean``; ``--parallel N``: ``-np N -kvu``, where both evaluate N inputs in one micro-batch) on
free loopback ports, then sends each the same ``/v1/embeddings`` requests of 1, 16 and
64 inputs of ``--tokens`` tokens each (token ids, so both embed exactly that many tokens an
input), the first server alternating each round. The figure is inputs per second over the request's wall time,
the median over rounds; the vectors of the two servers are checked equal as float32.

Prints one line per batch size and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests import support  # noqa: E402  (the project's one llama-server launcher)
from tests.dropin import call, start_dropin  # noqa: E402
from tests.support import free_port  # noqa: E402

SIZES = (1, 16, 64)
N_TOKENS = 64


def inputs(n: int, tokens: int = N_TOKENS) -> list[list[int]]:
    """``n`` inputs of ``tokens`` token ids each, all different (ids well inside the
    vocabulary)."""
    return [[100 + (i * 37 + j * 11) % 40000 for j in range(tokens)] for i in range(n)]


def vectors(raw: bytes) -> numpy.ndarray:
    data = json.loads(raw)["data"]
    return numpy.asarray([d["embedding"] for d in data], dtype=numpy.float64).astype("<f4")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-server", type=Path, default=support.llama_server_binary())
    parser.add_argument(
        "--model", type=Path, default=ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    )
    parser.add_argument("--fork", type=Path, default=None)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--pooling", default="mean")
    parser.add_argument("--tokens", type=int, default=N_TOKENS, help="tokens an input")
    parser.add_argument("--parallel", type=int, default=1, help="slots (-np N -kvu)")
    args = parser.parse_args()
    fork = args.fork or Path(f"{args.model}.FORK.json")
    flags = ["-c", "2048", "--embeddings", "--pooling", args.pooling, "-np", str(args.parallel)]
    if args.parallel > 1:
        flags.append("-kvu")
    log = Path(tempfile.mkdtemp(prefix="bankml-bench-embed-")) / "bankml.log"
    port = free_port()
    dropin = [
        *("--fork", str(fork), "-m", str(args.model)),
        *("--host", "127.0.0.1", "-t", "2", "--no-webui"),
        *("--listen", f"127.0.0.1:{free_port()}"),
        *flags,
    ]
    report: dict[str, Any] = {}
    with support.LlamaServer(args.model, args=flags, binary=args.llama_server) as ref:
        proc = start_dropin(dropin, port, log)
        try:
            servers = {"bankml": port, "llama-server": ref.port}
            for who in servers:  # one warm-up request each
                call(servers[who], "POST", "/v1/embeddings", {"input": inputs(1, args.tokens)})
            print(f"{'inputs':>6} {'bankml/s':>10} {'llama-server/s':>15} {'ratio':>7}")
            for n in SIZES:
                body = {"input": inputs(n, args.tokens)}
                rates: dict[str, list[float]] = {who: [] for who in servers}
                for r in range(args.rounds):
                    order = list(servers) if r % 2 == 0 else list(reversed(servers))
                    got = {}
                    for who in order:
                        start = time.perf_counter()
                        status, _, raw = call(servers[who], "POST", "/v1/embeddings", body)
                        rates[who].append(n / (time.perf_counter() - start))
                        assert status == 200, raw[:300]
                        got[who] = vectors(raw)
                    if not numpy.array_equal(got["bankml"], got["llama-server"]):
                        raise SystemExit(f"{n} inputs: the vectors differ")
                ours = statistics.median(rates["bankml"])
                theirs = statistics.median(rates["llama-server"])
                print(f"{n:>6} {ours:>10.1f} {theirs:>15.1f} {ours / theirs:>7.2f}")
                report[str(n)] = {
                    "bankml": round(ours, 1),
                    "llama-server": round(theirs, 1),
                    "ratio": round(ours / theirs, 2),
                }
        finally:
            proc.terminate()
            proc.wait(30)
    summary = {"tokens_per_input": args.tokens, "pooling": args.pooling, "parallel": args.parallel}
    print(json.dumps({**summary, **report}))


if __name__ == "__main__":
    main()
