#!/usr/bin/env python3
"""Prefill and decode speed of the native engine against llama-server, same model and threads.

    bench/engine.py [--llama-server BIN] [--model FILE] [--threads 2] [--prompt-tokens 256]
                    [--decode-tokens 64] [--rounds 3] [--batch 1,2,4,8] [--shared 16,64,512]

Both run the same token ids (from llama-server's /tokenize), alternating round by round in one
run so that a busy machine slows both alike. llama-server's figures are its own
``timings.prompt_per_second`` and ``predicted_per_second`` (``cache_prompt: false``); the
engine's are wall-clock over ``Model.forward`` (prefill in 512-token micro-batches, greedy
decode). On the CPU the engine's exact kernels run on --threads Numba threads (llama-server's -t
is the same number); --decode-threads only sets BLAS for the non-exact types' products.
Prints a line per round, the median ratios, and ends with one JSON line.

``--batch 1,2,4,8`` measures the engine alone (no llama-server): for each row count B, B caches
holding prompts of --prompt-tokens (minus 8 per row, so the rows sit at different positions)
advance --decode-tokens steps together through ``Model.decode_batch`` (B = 1: ``forward``),
the row counts alternating round by round; per B the median wall and CPU milliseconds a step
and the aggregate tokens/s against B = 1, by the wall clock and per CPU second (the figure a
busy machine moves least; with --threads 1 no thread waits at a barrier).

``--shared 16,64,512`` (with ``--batch B``, default 3) measures the engine alone, for each chunk
size: a prompt chunk for one cache beside one decode step of B others, and a chunk for each of
B + 1 caches, as one ``Model.shared_pass`` (every row through the layers together) against the
same apart (a ``forward`` of each chunk, one ``decode_batch`` of the steps), alternating
--rounds times with --decode-tokens repetitions each; per case the median wall and CPU
milliseconds and the ratio apart / together (above 1: the shared pass is faster).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numba
import numpy

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bankml.engine_cupy.model import Model  # noqa: E402
from tests import support  # noqa: E402

TEXT = (
    "The history of computing is a story of people who wanted to calculate faster than they "
    "could by hand. From the abacus to mechanical calculators, from punched cards to "
    "transistors, every step made arithmetic cheaper and more reliable. "
)


def prompt_ids(server: support.LlamaServer, n: int) -> list[int]:
    _, body = support.http_json(server.url + "/tokenize", {"content": TEXT * 40})
    ids = body["tokens"]
    return ids[:n]


def server_round(server: support.LlamaServer, ids: list[int], n_decode: int) -> tuple[float, float]:
    _, body = support.http_json(
        server.url + "/completion",
        {
            "prompt": ids,
            "n_predict": n_decode,
            "temperature": 0,
            "cache_prompt": False,
            "ignore_eos": True,
        },
        timeout=600,
    )
    t = body["timings"]
    return t["prompt_per_second"], t["predicted_per_second"]


def engine_round(model: Model, ids: list[int], n_decode: int) -> tuple[float, float]:
    cache = model.new_cache(len(ids) + n_decode + 1)
    start = time.perf_counter()
    for i in range(0, len(ids), 512):
        logits = model.forward(ids[i : i + 512], cache)
    prefill = len(ids) / (time.perf_counter() - start)
    start = time.perf_counter()
    for _ in range(n_decode):
        logits = model.forward([int(numpy.argmax(logits))], cache)
    decode = n_decode / (time.perf_counter() - start)
    return prefill, decode


def batch_round(
    model: Model, caches: list, lengths: list[int], first: int, n_decode: int
) -> tuple[float, float]:
    """n_decode steps of every cache at once from its prompt; wall and CPU ms a step."""
    for cache, n in zip(caches, lengths):
        cache.truncate(n)
    tokens = [first] * len(caches)
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(n_decode):
        if len(caches) == 1:
            logits = model.forward(tokens, caches[0])[None, :]
        else:
            logits = model.decode_batch(tokens, caches)
        tokens = [int(numpy.argmax(row)) for row in logits]
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return wall / n_decode * 1e3, cpu / n_decode * 1e3


def batch_main(model: Model, args: argparse.Namespace) -> int:
    counts = [int(b) for b in args.batch.split(",")]
    ids = [
        int(t) for t in numpy.random.default_rng(0).integers(3, model.n_vocab, args.prompt_tokens)
    ]
    lengths = [max(1, len(ids) - 8 * i) for i in range(max(counts))]
    caches = [model.new_cache(len(ids) + args.decode_tokens + 1) for _ in lengths]
    for cache, n in zip(caches, lengths):
        for i in range(0, n, 512):
            model.forward(ids[i : min(i + 512, n)], cache)
    for b in counts:  # warm each shape once
        batch_round(model, caches[:b], lengths[:b], ids[0], 2)
    runs: dict[int, list[tuple[float, float]]] = {b: [] for b in counts}
    for r in range(args.rounds):
        for b in counts:
            runs[b].append(batch_round(model, caches[:b], lengths[:b], ids[0], args.decode_tokens))
        print(
            f"round {r + 1}: "
            + ", ".join(f"B={b} {runs[b][-1][0]:.2f} ms ({runs[b][-1][1]:.2f} CPU)" for b in counts)
        )
    base = statistics.median(w for w, _ in runs[counts[0]]) / counts[0]
    base_cpu = statistics.median(c for _, c in runs[counts[0]]) / counts[0]
    result = {"model": Path(model.path).name, "threads": args.threads, "rows": {}}
    for b in counts:
        wall = statistics.median(w for w, _ in runs[b])
        cpu = statistics.median(c for _, c in runs[b])
        result["rows"][b] = {
            "ms_per_step": round(wall, 2),
            "cpu_ms_per_step": round(cpu, 2),
            "tokens_per_s": round(b / wall * 1e3, 1),
            "vs_first": round(base * b / wall, 2),
            "cpu_vs_first": round(base_cpu * b / cpu, 2),
        }
        print(
            f"B={b}: {wall:.2f} ms a step ({cpu:.2f} ms CPU), {b / wall * 1e3:.1f} tok/s, "
            f"{base * b / wall:.2f}x B={counts[0]}'s tokens/s ({base_cpu * b / cpu:.2f}x "
            "tokens per CPU second)"
        )
    print(json.dumps(result))
    return 0


def shared_round(
    model: Model, batches: list, caches: list, lengths: list[int], together: bool, reps: int
) -> tuple[float, float]:
    """``reps`` times: batches[i] into caches[i] as one ``shared_pass``, or apart (a
    ``forward`` of each longer batch, one ``decode_batch`` of the one-token ones); wall and CPU
    ms per repetition."""
    single = [i for i, b in enumerate(batches) if len(b) == 1]
    wall = cpu = 0.0
    for _ in range(reps):
        for cache, n in zip(caches, lengths):
            cache.truncate(n)
        w, c = time.perf_counter(), time.process_time()
        if together:
            model.shared_pass(batches, caches)
        else:
            for b, cache in zip(batches, caches):
                if len(b) > 1:
                    model.forward(b, cache)
            if single:
                model.decode_batch([batches[i][0] for i in single], [caches[i] for i in single])
        wall += time.perf_counter() - w
        cpu += time.process_time() - c
    return wall / reps * 1e3, cpu / reps * 1e3


def shared_main(model: Model, args: argparse.Namespace) -> int:
    sizes = [int(n) for n in args.shared.split(",")]
    n_decode = int(args.batch or 3)
    rng = numpy.random.default_rng(0)
    ids = [int(t) for t in rng.integers(3, model.n_vocab, args.prompt_tokens)]
    lengths = [max(1, len(ids) - 8 * i) for i in range(n_decode + 1)]
    caches = [model.new_cache(len(ids) + max(sizes) + 16) for _ in lengths]
    for cache, n in zip(caches, lengths):
        for i in range(0, n, 512):
            model.forward(ids[i : min(i + 512, n)], cache)
    print(f"shares passes: {model.shares_passes}; caches at {lengths} cells")
    result: dict = {"model": Path(model.path).name, "decode_steps": n_decode, "cases": {}}
    for size in sizes:
        chunk = [int(t) for t in rng.integers(3, model.n_vocab, size)]
        cases = {
            f"chunk {size} + {n_decode} decode steps": [chunk] + [[chunk[0]]] * n_decode,
            f"{n_decode + 1} chunks of {size}": [chunk] * (n_decode + 1),
        }
        for name, batches in cases.items():
            for together in (True, False):  # warm both once
                shared_round(model, batches, caches, lengths, together, 1)
            runs: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
            for _ in range(args.rounds):
                for together in (True, False):
                    runs[together].append(
                        shared_round(model, batches, caches, lengths, together, args.decode_tokens)
                    )
            med = {
                k: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v))
                for k, v in runs.items()
            }
            ratio, cpu_ratio = med[False][0] / med[True][0], med[False][1] / med[True][1]
            result["cases"][name] = {
                "together_ms": round(med[True][0], 2),
                "apart_ms": round(med[False][0], 2),
                "together_cpu_ms": round(med[True][1], 2),
                "apart_cpu_ms": round(med[False][1], 2),
                "ratio": round(ratio, 3),
                "cpu_ratio": round(cpu_ratio, 3),
            }
            print(
                f"{name}: one pass {med[True][0]:.2f} ms ({med[True][1]:.2f} CPU), apart "
                f"{med[False][0]:.2f} ms ({med[False][1]:.2f} CPU): {ratio:.3f}x "
                f"({cpu_ratio:.3f}x per CPU second)"
            )
    print(json.dumps(result))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-server", type=Path, default=None)
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--decode-threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", default=None, help="row counts, e.g. 1,2,4,8 (engine only)")
    parser.add_argument("--shared", default=None, help="prompt chunk sizes, e.g. 16,64,512")
    args = parser.parse_args(argv)
    model_path = args.model or support.default_model()
    start = time.perf_counter()
    model = Model.load(model_path, device="cpu")
    model.threads, model.decode_threads = args.threads, args.decode_threads
    numba.set_num_threads(min(args.threads, numba.config.NUMBA_NUM_THREADS))  # the exact kernels
    print(
        f"engine load {time.perf_counter() - start:.1f} s, weights "
        f"{model.weights.nbytes / 2**20:.0f} MiB"
    )
    if args.shared:
        return shared_main(model, args)
    if args.batch:
        return batch_main(model, args)
    binary = args.llama_server or support.llama_server_binary()
    rows = []
    with support.LlamaServer(model_path, binary=binary, args=["-t", str(args.threads)]) as server:
        ids = prompt_ids(server, args.prompt_tokens)
        # warm both once, on the whole prompt: a first prefill of this length would otherwise
        # compile the engine's kernels for it inside the first round
        server_round(server, ids, 4)
        engine_round(model, ids, 4)
        for r in range(args.rounds):
            sp, sd = server_round(server, ids, args.decode_tokens)
            ep, ed = engine_round(model, ids, args.decode_tokens)
            rows.append((sp, sd, ep, ed))
            print(
                f"round {r + 1}: prefill engine {ep:7.1f} vs llama-server {sp:7.1f} tok/s "
                f"({ep / sp:.2f}x); decode engine {ed:6.1f} vs {sd:6.1f} tok/s ({ed / sd:.2f}x)"
            )
    result = {
        "model": Path(model_path).name,
        "threads": args.threads,
        "decode_threads": args.decode_threads,
        "prompt_tokens": len(ids),
        "decode_tokens": args.decode_tokens,
        "rounds": args.rounds,
        "prefill_engine": round(statistics.median(r[2] for r in rows), 1),
        "prefill_llama_server": round(statistics.median(r[0] for r in rows), 1),
        "decode_engine": round(statistics.median(r[3] for r in rows), 1),
        "decode_llama_server": round(statistics.median(r[1] for r in rows), 1),
        "prefill_ratio": round(statistics.median(r[2] / r[0] for r in rows), 3),
        "decode_ratio": round(statistics.median(r[3] / r[1] for r in rows), 3),
    }
    print(
        f"median ratios: prefill {result['prefill_ratio']}x, decode {result['decode_ratio']}x "
        "(targets 1.5x and 0.5x)"
    )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
