#!/usr/bin/env python3
"""`bankml serve --native` against llama-server, same model and threads, through /v1/chat/completions.

    bench/serve.py [--llama-server BIN] [--model FILE] [--fork FORK.json] [--rounds 3]
                   [--max-tokens 32] [--long-tokens 400] [--decode-pairs 5] [--decode-tokens 128]
                   [--sign-answers 20] [--replay-tokens 128]

Starts llama-server (tests/support.py's LlamaServer: ``-t 2 -c 2048 -np 1``) and
``bankml serve FILE --fork FORK --native`` (tests/bankml_process.py, ``--ctx 2048``; the engine's
BLAS uses the machine's cores for prefill and one thread for decode steps), each on a free port.
Then, round by round, alternating which server goes first so that both see the same machine load,
every request streamed (SSE), greedy:

- first turn, short prompt (~20 tokens) and long prompt (~--long-tokens), ``cache_prompt: false``:
  time to first token (request sent -> first content delta) and decode tokens per second
  ((completion tokens - 1) / (last content delta - first content delta));
- second turn of a conversation, prompt cache on: turn 1 (the long prompt, new per round so no
  earlier round's cache helps) is answered, then turn 2 = turn 1's messages + the assistant answer
  + a new user message; its time to first token is the figure (and ``cache_n`` when reported).

First, served single-stream decode: --decode-pairs pairs of greedy --decode-tokens-token answers
(``ignore_eos``, ``cache_prompt: false``), one from each server back to back, the first server
alternating; the figure is the median of the pairs' ratios (target: at least 1.1). ``--rounds 0``,
``--sign-answers 0`` and ``--replay-tokens 0`` leave out the other parts.

Then the signed receipts' costs, on bankml alone (its key in the run's temporary directory):

- signing: --sign-answers short non-streamed chats (greedy, 32 tokens); for each, the answer's
  wall time at the client and the time of ``build_receipt_v2`` (canonical bytes and Ed25519
  signature, what the server adds to build a signed receipt) on that answer's own receipt and
  counts, run here with the server's key; every receipt is checked ``valid`` first. Target:
  signing under 1 % of the answer's wall time;
- replay: one greedy 128-token chat (``ignore_eos``, ``cache_prompt: false``), non-streamed: its
  generation time at the client, then ``replay_in_process`` of it on the exact engine opened in
  this process (the opening timed apart): the replay time as a ratio of the generation time.

Prints a table of medians with ratios bankml / llama-server (for TTFT lower is better, so a ratio
below 1 means bankml is faster; for tokens per second higher is better), the receipts' figures,
and ends with one JSON line. Target: second-turn TTFT no worse than llama-server's (ratio <= 1).
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests import support  # noqa: E402  (the project's one llama-server launcher)
from tests.bankml_process import BankmlProcess  # noqa: E402

SHORT = "Write a short story about a lighthouse keeper and a storm at sea."  # ~20 tokens with the template
PARAGRAPH = (
    "The history of computing is a story of people who wanted to calculate faster than they "
    "could by hand. From the abacus to mechanical calculators, from punched cards to "
    "transistors, every step made arithmetic cheaper and more reliable. "
)
FOLLOW_UP = "Now tell me the same in one sentence, for a child."


@dataclass
class Streamed:
    ttft_s: float  # request sent -> first content delta
    decode_tps: float | None  # (tokens - 1) / (last delta - first delta)
    tokens: int
    text: str
    cache_n: int | None  # from the last chunk's timings, when the server reports them
    prompt_n: int | None  # the server's own count of prompt tokens it computed
    prompt_ms: float | None  # and its own prefill time: TTFT minus this is what serving adds


def stream_chat(port: int, body: dict[str, Any]) -> Streamed:
    """One streamed chat completion on a fresh connection, timed event by event."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    data = json.dumps({**body, "stream": True}).encode()
    t0 = time.perf_counter()
    conn.request(
        "POST", "/v1/chat/completions", body=data, headers={"Content-Type": "application/json"}
    )
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"port {port}: {resp.status} {resp.read()[:300]!r}")
    first = last = None
    pieces, deltas, final = [], 0, {}
    for line in resp:  # SSE: one "data: {...}" line per event
        if not line.startswith(b"data: {"):
            continue
        event = json.loads(line[6:])
        for choice in event.get("choices") or []:
            content = (choice.get("delta") or {}).get("content")
            if content:
                last = time.perf_counter()
                first = first or last
                pieces.append(content)
                deltas += 1
        if "timings" in event or "usage" in event:
            final = event
    conn.close()
    if first is None:
        raise RuntimeError(f"port {port}: no content in the answer")
    tokens = (final.get("usage") or {}).get("completion_tokens") or deltas
    rate = (tokens - 1) / (last - first) if tokens > 1 and last > first else None
    timings = final.get("timings") or {}
    return Streamed(
        first - t0,
        rate,
        tokens,
        "".join(pieces),
        timings.get("cache_n"),
        timings.get("prompt_n"),
        timings.get("prompt_ms"),
    )


def long_prompt(port: int, n_tokens: int) -> str:
    """About n_tokens of text (counted with llama-server's /tokenize) and a question."""
    text = PARAGRAPH
    while count_tokens(port, text) < n_tokens:
        text += PARAGRAPH
    return text + "\nSummarize the text above."


def count_tokens(port: int, text: str) -> int:
    """Tokens of the text alone (the chat template adds about 30 more)."""
    return len(
        support.http_json(f"http://127.0.0.1:{port}/tokenize", {"content": text})[1]["tokens"]
    )


def first_turn(port: int, content: str, max_tokens: int) -> Streamed:
    return stream_chat(
        port,
        {
            "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "cache_prompt": False,
        },
    )


def second_turn(port: int, content: str, max_tokens: int) -> tuple[Streamed, Streamed]:
    """Turn 1 then turn 2 of one conversation, prompt cache on; turn 2 is the measured one."""
    messages = [{"role": "user", "content": content}]
    turn1 = stream_chat(
        port,
        {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "cache_prompt": True},
    )
    messages = [
        *messages,
        {"role": "assistant", "content": turn1.text},
        {"role": "user", "content": FOLLOW_UP},
    ]
    turn2 = stream_chat(
        port,
        {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "cache_prompt": True},
    )
    return turn1, turn2


DECODE_PROMPT = "Write a long story about a dragon who learns to read."


def decode_pairs(ports: dict[str, int], pairs: int, tokens: int) -> list[dict[str, float]]:
    """Served single-stream decode: ``pairs`` times, one greedy ``tokens``-token answer
    (``ignore_eos``, ``cache_prompt: false``) from each server back to back, the server that goes
    first alternating; each pair's ratio bankml / llama-server is taken from answers that ran
    seconds apart, so a load that changes between pairs moves both alike."""
    body = {
        "messages": [{"role": "user", "content": DECODE_PROMPT}],
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
        "cache_prompt": False,
    }
    out = []
    for i in range(pairs):
        names = list(ports) if i % 2 == 0 else list(reversed(ports))
        rates = {name: stream_chat(ports[name], body).decode_tps for name in names}
        pair = {f"{name}_tps": float(rate or 0.0) for name, rate in rates.items()}
        pair["ratio"] = pair["bankml_tps"] / pair["llama_server_tps"]
        progress(
            f"decode pair {i + 1}: bankml {pair['bankml_tps']:.1f}, "
            f"llama-server {pair['llama_server_tps']:.1f} tok/s, ratio {pair['ratio']:.3f}"
        )
        out.append(pair)
    return out


def decode_figures(pairs: list[dict[str, float]], tokens: int) -> dict[str, Any]:
    if not pairs:
        return {}
    return {
        "decode_tokens": tokens,
        "decode_pairs": len(pairs),
        "decode_tps_bankml": round(statistics.median(p["bankml_tps"] for p in pairs), 2),
        "decode_tps_llama_server": round(
            statistics.median(p["llama_server_tps"] for p in pairs), 2
        ),
        "decode_ratio_median": round(statistics.median(p["ratio"] for p in pairs), 3),
        "decode_ratios": [round(p["ratio"], 3) for p in pairs],
    }


def print_decode(figures: dict[str, Any]) -> None:
    if "decode_ratio_median" not in figures:
        return
    ratio = figures["decode_ratio_median"]
    print(
        f"served decode, {figures['decode_pairs']} alternated pairs of "
        f"{figures['decode_tokens']}-token answers: bankml {figures['decode_tps_bankml']} tok/s, "
        f"llama-server {figures['decode_tps_llama_server']} tok/s (medians); ratio per pair "
        f"{figures['decode_ratios']}, median {ratio}"
    )
    print(
        f"target: served decode at least 1.1x llama-server's: {'met' if ratio >= 1.1 else 'MISSED'}"
    )


def progress(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def one_round(
    ports: dict[str, int], r: int, long_text: str, max_tokens: int
) -> dict[str, dict[str, Any]]:
    """Every measure once per server; the server that goes first alternates per measure and round."""
    names = list(ports) if r % 2 == 0 else list(reversed(ports))
    out: dict[str, dict[str, Any]] = {name: {} for name in ports}
    for name in names:
        short = first_turn(ports[name], SHORT, max_tokens)
        out[name].update(
            short_ttft_ms=short.ttft_s * 1000,
            short_tps=short.decode_tps,
            short_prompt_ms=short.prompt_ms,
            short_prompt_n=short.prompt_n,
        )
    for name in reversed(names):
        long = first_turn(ports[name], long_text, max_tokens)
        out[name].update(
            long_ttft_ms=long.ttft_s * 1000,
            long_tps=long.decode_tps,
            long_prompt_ms=long.prompt_ms,
            long_prompt_n=long.prompt_n,
        )
    conversation = (
        f"Conversation {r + 1}. " + long_text
    )  # a new prefix each round: no help from the last
    for name in names:
        turn1, turn2 = second_turn(ports[name], conversation, max_tokens)
        out[name].update(
            turn1_ttft_ms=turn1.ttft_s * 1000,
            turn2_ttft_ms=turn2.ttft_s * 1000,
            turn2_prompt_ms=turn2.prompt_ms,
            turn2_prompt_n=turn2.prompt_n,
            turn2_cache_n=turn2.cache_n,
        )
    for name in ports:
        progress(
            f"round {r + 1} {name}: "
            + ", ".join(
                f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in out[name].items()
            )
        )
    return out


MEASURES = [  # (key, what, lower is better)
    ("short_ttft_ms", "TTFT short prompt, ms", True),
    ("short_prompt_ms", "  server's own prompt_ms", True),
    ("long_ttft_ms", "TTFT long prompt, ms", True),
    ("long_prompt_ms", "  server's own prompt_ms", True),
    ("short_tps", "decode tok/s, short prompt", False),
    ("long_tps", "decode tok/s, long prompt", False),
    ("turn1_ttft_ms", "TTFT turn 1 (cache on), ms", True),
    ("turn2_ttft_ms", "TTFT turn 2 (cached), ms", True),
    ("turn2_prompt_ms", "  server's own prompt_ms", True),
]
REPORTED = [
    "short_prompt_n",
    "long_prompt_n",
    "turn2_prompt_n",
    "turn2_cache_n",
]  # counts, last round


def median_of(rounds: list[dict[str, dict[str, Any]]], name: str, key: str) -> float | None:
    values = [r[name][key] for r in rounds if r[name][key] is not None]
    return statistics.median(values) if values else None


def summarize(rounds: list[dict[str, dict[str, Any]]]) -> dict[str, Any]:
    figures: dict[str, Any] = {}
    for key, _, _ in MEASURES:
        b, ls = median_of(rounds, "bankml", key), median_of(rounds, "llama_server", key)
        figures[f"{key}_bankml"] = None if b is None else round(b, 2)
        figures[f"{key}_llama_server"] = None if ls is None else round(ls, 2)
        figures[f"{key}_ratio"] = round(b / ls, 3) if b and ls else None
    for key in REPORTED:
        for name in ("bankml", "llama_server"):
            figures[f"{key}_{name}"] = rounds[-1][name][key]
    return figures


def print_table(figures: dict[str, Any]) -> None:
    print(
        f"{'median':<30}{'bankml':>10}{'llama-server':>14}{'ratio b/l':>11}  bankml is better when"
    )
    for key, what, lower in MEASURES:
        cells = [figures[f"{key}_{s}"] for s in ("bankml", "llama_server", "ratio")]
        print(
            f"{what:<30}"
            + "".join(f"{'-' if c is None else c!s:>{w}}" for c, w in zip(cells, (10, 14, 11)))
            + ("  ratio < 1" if lower else "  ratio > 1")
        )
    for key in REPORTED:
        print(
            f"{key} (last round): bankml {figures[key + '_bankml']}, "
            f"llama-server {figures[key + '_llama_server']}"
        )
    ratio = figures["turn2_ttft_ms_ratio"]
    verdict = "met" if ratio is not None and ratio <= 1 else "MISSED"
    print(f"target: second-turn TTFT no worse than llama-server's (ratio <= 1): {verdict}")


def post_chat(port: int, body: dict[str, Any]) -> tuple[bytes, bytes, float]:
    """(request bytes, response bytes, wall seconds) of one non-streamed chat."""
    data = json.dumps(body).encode()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    t0 = time.perf_counter()
    conn.request(
        "POST", "/v1/chat/completions", body=data, headers={"Content-Type": "application/json"}
    )
    resp = conn.getresponse()
    raw = resp.read()
    wall = time.perf_counter() - t0
    conn.close()
    if resp.status != 200:
        raise RuntimeError(f"port {port}: {resp.status} {raw[:300]!r}")
    return data, raw, wall


def signing_cost(port: int, key: Any, answers: int, max_tokens: int) -> dict[str, Any]:
    """build_receipt_v2's time on each of ``answers`` real answers' receipts, and its share of
    that answer's wall time."""
    from bankml.receipts.check import VALID, check_receipt
    from bankml.receipts.sign import ReplayFacts, build_receipt_v2, engine_source_digest

    engine_source_digest()  # once per process, as the server computes it before any answer
    key.sign(b"")  # the first signature of a process initializes the library
    signs, shares = [], []
    for i in range(answers):
        body = {
            "messages": [{"role": "user", "content": f"{SHORT} ({i})"}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "cache_prompt": False,
        }
        data, raw, wall = post_chat(port, body)
        verdict = check_receipt(data, raw, key.public_key_pem)
        if verdict != VALID:
            raise RuntimeError(f"a served receipt is not valid: {verdict}")
        receipt = json.loads(raw)["bankml_receipt"]
        base = {k: receipt[k] for k in list(receipt)[: list(receipt).index("signed") + 1]}
        facts = ReplayFacts(
            api=receipt["api"],
            stream=receipt["stream"],
            sampler=receipt["sampler"],
            n_predict=receipt["n_predict"],
            n_ctx=receipt["n_ctx"],
            cache_type=receipt["cache_type"],
            device=receipt["device"],
            engine_version=receipt["engine_version"],
            engine_digest=receipt["engine_digest"],
            prompt_token_ids=list(range(receipt["prompt_tokens"])),  # as many ids as it had
            completion_token_ids=list(range(receipt["completion_tokens"])),
            cache_n=receipt["cache_n"],
            finish_reason=receipt["finish_reason"],
        )
        t0 = time.perf_counter()
        build_receipt_v2(base, facts, key)
        sign = time.perf_counter() - t0
        signs.append(sign)
        shares.append(sign / wall)
    return {
        "sign_answers": answers,
        "sign_us_median": round(statistics.median(signs) * 1e6, 1),
        "sign_us_max": round(max(signs) * 1e6, 1),
        "sign_share_pct_median": round(statistics.median(shares) * 100, 4),
        "sign_share_pct_max": round(max(shares) * 100, 4),
    }


def replay_cost(port: int, model: Path, fork: Path, tokens: int) -> dict[str, Any]:
    """One greedy answer of ``tokens`` tokens, generated by the server, then replayed here."""
    from bankml.receipts.replay import open_replay_engine, replay_in_process

    body = {
        "messages": [{"role": "user", "content": SHORT}],
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
        "cache_prompt": False,
    }
    data, raw, generation = post_chat(port, body)
    receipt = json.loads(raw)["bankml_receipt"]
    t0 = time.perf_counter()
    engine = open_replay_engine(str(model), str(fork), receipt)
    opened = time.perf_counter() - t0
    t0 = time.perf_counter()
    verdict = replay_in_process(data, raw, engine)
    replay = time.perf_counter() - t0
    return {
        "replay_tokens": receipt["completion_tokens"],
        "replay_generation_s": round(generation, 3),
        "replay_s": round(replay, 3),
        "replay_ratio": round(replay / generation, 3),
        "replay_open_s": round(opened, 2),
        "replay_verdict": verdict,
    }


def print_receipts(figures: dict[str, Any]) -> None:
    if "sign_share_pct_max" in figures:
        print_signing(figures)
    if "replay_s" in figures:
        print(
            f"replay of a {figures['replay_tokens']}-token answer: {figures['replay_s']} s against "
            f"{figures['replay_generation_s']} s generated, ratio {figures['replay_ratio']} "
            f"(engine opened in {figures['replay_open_s']} s, apart); {figures['replay_verdict']}"
        )


def print_signing(figures: dict[str, Any]) -> None:
    share = figures["sign_share_pct_max"]
    print(
        f"signing a receipt: median {figures['sign_us_median']} us, max {figures['sign_us_max']} us "
        f"over {figures['sign_answers']} answers; share of the answer's wall time median "
        f"{figures['sign_share_pct_median']} %, max {share} % "
        f"(target < 1 %: {'met' if share < 1 else 'MISSED'})"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-server", type=Path, default=None)
    parser.add_argument("--model", type=Path, default=support.DEFAULT_MODEL)
    parser.add_argument(
        "--fork", type=Path, default=None, help="default: FILE.FORK.json beside the model"
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--long-tokens", type=int, default=400)
    parser.add_argument("--sign-answers", type=int, default=20)
    parser.add_argument("--replay-tokens", type=int, default=128)
    parser.add_argument("--decode-pairs", type=int, default=5)
    parser.add_argument("--decode-tokens", type=int, default=128)
    args = parser.parse_args(argv)
    signal.signal(
        signal.SIGTERM, lambda *_: sys.exit(143)
    )  # so the servers are stopped on the way out
    binary = args.llama_server or support.llama_server_binary()
    model = args.model.resolve()
    fork = args.fork or model.with_name(model.name + ".FORK.json")
    with tempfile.TemporaryDirectory() as tmp, support.LlamaServer(model, binary=binary) as server:
        engine_port = support.free_port()  # the engine address --native also binds
        progress("llama-server up; starting bankml serve --native")
        key_path = Path(tmp) / "receipt-key.pem"  # made by bankml serve's first start
        with BankmlProcess(
            model,
            fork,
            ["--native", "--upstream", f"127.0.0.1:{engine_port}", "--receipt-key", str(key_path)],
            Path(tmp) / "bankml.log",
        ) as bankml:
            ports = {"bankml": bankml.port, "llama_server": server.port}
            long_text = long_prompt(server.port, args.long_tokens)
            for port in ports.values():  # warm both once (first-request costs are not the measure)
                first_turn(port, "Hi.", 4)
            pairs = decode_pairs(ports, args.decode_pairs, args.decode_tokens)
            rounds = [one_round(ports, r, long_text, args.max_tokens) for r in range(args.rounds)]
            prompt_tokens = {
                "short": count_tokens(server.port, SHORT),
                "long": count_tokens(server.port, long_text),
            }
            from bankml.receipts.keys import load_key

            receipts: dict[str, Any] = {}
            if args.sign_answers > 0:
                progress("receipts: signing cost")
                receipts.update(
                    signing_cost(
                        bankml.port, load_key(key_path), args.sign_answers, args.max_tokens
                    )
                )
            if args.replay_tokens > 0:
                progress("receipts: a replay")
                receipts.update(replay_cost(bankml.port, model, fork, args.replay_tokens))
    figures = summarize(rounds) if rounds else {}
    figures.update(decode_figures(pairs, args.decode_tokens))
    figures.update(receipts)
    figures.update(
        model=model.name,
        rounds=args.rounds,
        max_tokens=args.max_tokens,
        threads=2,
        prompt_tokens_short=prompt_tokens["short"],
        prompt_tokens_long=prompt_tokens["long"],
    )
    if rounds:
        print_table(figures)
    print_decode(figures)
    if receipts:
        print_receipts(figures)
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
