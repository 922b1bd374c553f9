#!/usr/bin/env python3
"""Speculative decoding (``--spec-type ngram-simple``): decode speed on repetitive text, bankml's
drop-in against llama-server with the same flags, same run.

    bench/speculative.py [--llama-server BIN] [--model FILE] [--fork FORK.json] [--rounds 5]
                         [--tokens 200]

Starts four servers on free loopback ports, one pair at a time: ``bankml llama-server`` and
llama-server (``-t 2 -c 2048 -np 1 --temp 0``), first with ``--spec-type ngram-simple`` (its
default sizes, 12 and 48), then without. Each round sends both servers of a pair the same
greedy /completion requests (``cache_prompt: false``, ``ignore_eos``), the first server
alternating: a Python file to copy and a JSON list to continue, answers that repeat their
prompt. The figure is the servers' own ``timings.predicted_per_second`` (decode steps over
decode time), the median over rounds; the answers of a pair are checked identical.

Prints, per prompt: each server's tokens per second with and without drafts, the speed-up
drafts give each, the ratio bankml / llama-server with drafts (above 1: bankml faster), the
drafted and accepted counts, and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests import support  # noqa: E402  (the project's one llama-server launcher)
from tests.support import free_port  # noqa: E402
from tests.test_llama_dropin import call, start_dropin  # noqa: E402

CODE = "".join(
    f"def {name}(a, b):\n    return a {op} b\n\n\n"
    for name, op in (("add", "+"), ("sub", "-"), ("mul", "*"), ("div", "/"), ("mod", "%"))
)
ROWS = "".join(f'  {{"id": {i}, "name": "item {i}", "in_stock": true}},\n' for i in range(1, 9))
PROMPTS = {
    "copy a file": f"Two copies of a Python file:\n```python\n{CODE}```\n```python\n{CODE}```\n"
    "A third copy:\n```python\n",
    "continue JSON": f"A JSON list of items:\n[\n{ROWS}",
}
BASE_FLAGS = ["-c", "2048", "--temp", "0"]
SPEC_FLAGS = ["--spec-type", "ngram-simple"]


def run_pair(flags: list[str], args: argparse.Namespace, log: Path) -> dict[str, Any]:
    """{prompt: {"bankml": [tok/s...], "llama-server": [...], "draft": (n, accepted)}}."""
    port = free_port()
    dropin = [
        *("--fork", str(args.fork), "-m", str(args.model)),
        *("--host", "127.0.0.1", "-t", "2", "-np", "1", "--no-webui"),
        *("--listen", f"127.0.0.1:{free_port()}"),
        *flags,
    ]
    out: dict[str, Any] = {}
    with support.LlamaServer(args.model, args=flags, binary=args.llama_server) as ref:
        proc = start_dropin(dropin, port, log)
        try:
            servers = {"bankml": port, "llama-server": ref.port}
            for name, prompt in PROMPTS.items():
                body = {
                    "prompt": prompt,
                    "n_predict": args.tokens,
                    "ignore_eos": True,
                    "cache_prompt": False,
                }
                figures: dict[str, Any] = {"bankml": [], "llama-server": []}
                for r in range(args.rounds):
                    order = list(servers) if r % 2 == 0 else list(reversed(servers))
                    answers = {}
                    for who in order:
                        status, _, raw = call(servers[who], "POST", "/completion", body)
                        assert status == 200, raw
                        answers[who] = json.loads(raw)
                        figures[who].append(answers[who]["timings"]["predicted_per_second"])
                    if answers["bankml"]["content"] != answers["llama-server"]["content"]:
                        raise SystemExit(f"{name}: the answers differ")
                    timings = answers["bankml"]["timings"]
                    figures["draft"] = (
                        timings.get("draft_n", 0),
                        timings.get("draft_n_accepted", 0),
                    )
                out[name] = figures
        finally:
            proc.terminate()
            proc.wait(30)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-server", type=Path, default=support.llama_server_binary())
    parser.add_argument(
        "--model", type=Path, default=ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    )
    parser.add_argument("--fork", type=Path, default=None)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=200)
    args = parser.parse_args()
    args.fork = args.fork or Path(f"{args.model}.FORK.json")
    log = Path(tempfile.mkdtemp(prefix="bankml-bench-spec-")) / "bankml.log"
    with_drafts = run_pair(BASE_FLAGS + SPEC_FLAGS, args, log)
    without = run_pair(BASE_FLAGS, args, log)
    report: dict[str, Any] = {}
    print(f"{'prompt':<14} {'server':<13} {'tok/s drafts':>12} {'tok/s plain':>12} {'speed-up':>9}")
    for name in PROMPTS:
        row: dict[str, Any] = {"draft_n, accepted": with_drafts[name]["draft"]}
        for who in ("bankml", "llama-server"):
            fast = statistics.median(with_drafts[name][who])
            plain = statistics.median(without[name][who])
            row[who] = {"drafts": round(fast, 1), "plain": round(plain, 1)}
            print(f"{name:<14} {who:<13} {fast:>12.1f} {plain:>12.1f} {fast / plain:>8.2f}x")
        ratio = row["bankml"]["drafts"] / row["llama-server"]["drafts"]
        row["ratio_with_drafts"] = round(ratio, 2)
        drafted, accepted = row["draft_n, accepted"]
        print(
            f"{'':<14} bankml / llama-server with drafts: {ratio:.2f}  ({accepted}/{drafted} drafted tokens accepted)"
        )
        report[name] = row
    print(json.dumps(report))


if __name__ == "__main__":
    main()
