#!/usr/bin/env python3
"""The cost of a receipt's DSSE envelope per answer, against the answer it rides on, and of the
receipt log at 100 answers a second.

    bench/envelope.py --model M.gguf --fork M.gguf.FORK.json [--answers 20] [--rounds 2000]

Answers a short chat (16 tokens, greedy) on bankml's engine (``bankml.api``) with a receipt key,
``--answers`` times, and times, over ``--rounds``: building and signing the receipt's envelope
(``envelope.envelope_of``: the in-toto Statement in canonical JSON, base64, one Ed25519
signature) and checking it (``envelope.opened`` and ``matches``); then appends the receipt to a
``--receipt-log`` (log.py) 100 times and syncs it, as a server answering 100 answers a second
does each second. Reports the median answer's wall time, the envelope's microseconds, their
ratio (the goal: under 1 %), the log's cost per second of answers, the machine (CPU model,
cores, load average) and the date; ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bankml import api  # noqa: E402
from bankml.receipts.envelope import envelope_of, matches, opened  # noqa: E402
from bankml.receipts.keys import keygen, load_public_key  # noqa: E402
from bankml.receipts.log import ReceiptLog  # noqa: E402
from bench.sampler import cpu_model  # noqa: E402

CHAT = [{"role": "user", "content": "Say hello."}]


def per_call_us(fn: object, rounds: int) -> float:
    start = time.perf_counter()
    for _ in range(rounds):
        fn()  # type: ignore[operator]
    return (time.perf_counter() - start) / rounds * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--fork", required=True)
    parser.add_argument("--answers", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=2000)
    args = parser.parse_args()
    key = keygen(Path(tempfile.mkdtemp()) / "receipt-key.pem")
    public = load_public_key(key.public_key_pem)
    walls, receipt = [], None
    native = api.open_native(args.model, args.fork, n_ctx=2048, receipt_key=key)
    request = {"messages": CHAT, "max_tokens": 16, "temperature": 0}
    for _ in range(args.answers + 1):  # the first compiles
        start = time.perf_counter()
        answer = api.chat(request, native=native)
        walls.append((time.perf_counter() - start) * 1e3)
        receipt = answer["bankml_receipt"]
    assert receipt is not None
    answer_ms = statistics.median(walls[1:])
    name = os.path.basename(args.model)
    build_us = per_call_us(lambda: envelope_of(receipt, name, key), args.rounds)
    envelope = envelope_of(receipt, name, key)
    check_us = per_call_us(lambda: matches(opened(envelope, public), receipt), args.rounds)
    share = build_us / 1e3 / answer_ms * 100
    log = ReceiptLog.open(Path(tempfile.mkdtemp()) / "receipts.jsonl")
    seconds = []
    for _ in range(10):  # ten seconds' worth: 100 appends and one sync each
        start = time.perf_counter()
        for _ in range(100):
            log.append(receipt)
        log.sync()
        seconds.append(time.perf_counter() - start)
    log.close()
    log_ms = statistics.median(seconds) * 1e3
    print(f"answer (16 tokens, greedy): {answer_ms:.1f} ms median of {args.answers}")
    print(f"envelope built and signed:  {build_us:.1f} us ({share:.3f} % of the answer)")
    print(f"envelope checked:           {check_us:.1f} us")
    print(f"log, 100 answers and a sync: {log_ms:.2f} ms a second ({log_ms / 10:.3f} % of it)")
    facts = {
        "date": time.strftime("%Y-%m-%d"),
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "answer_ms": round(answer_ms, 2),
        "envelope_build_us": round(build_us, 1),
        "envelope_check_us": round(check_us, 1),
        "share_percent": round(share, 4),
        "log_ms_per_100_answers": round(log_ms, 3),
    }
    print(json.dumps(facts))


if __name__ == "__main__":
    main()
