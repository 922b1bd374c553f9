#!/usr/bin/env python3
"""The sampler's cost per token: ``Sampler.sample`` + ``accept`` on a vocabulary of random logits.

    bench/sampler.py [--vocab 49152] [--tokens 2000] [--rounds 5]

Times greedy (temperature 0) and the default chain (temperature 0.8, top_k 40, top_p 0.95,
min_p 0.05), each with the compiled chain (``sampler.FAST_CHAIN``, the default) and with the
NumPy stages after the top-k, alternating rounds so that both see the same machine load.
Reports the median round's microseconds per token, the machine (CPU model, cores, load
average) and the date; ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bankml.engine_cupy import sampler as S  # noqa: E402

CHAINS = {"greedy": replace(S.SamplerParams(), temperature=0.0), "default": S.SamplerParams()}


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def per_token_us(params: S.SamplerParams, steps: list[np.ndarray], fast: bool) -> float:
    S.FAST_CHAIN = fast
    sampler = S.Sampler(replace(params, seed=1), None, len(steps[0]))
    for logits in steps[:20]:  # warm
        sampler.accept(sampler.sample(logits))
    start = time.perf_counter()
    for logits in steps:
        sampler.accept(sampler.sample(logits))
    return (time.perf_counter() - start) / len(steps) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=49_152)
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    S.warm_up()
    rng = np.random.default_rng(0)
    steps = [(rng.standard_normal(args.vocab) * 3).astype(np.float32) for _ in range(64)]
    steps = (steps * (args.tokens // len(steps) + 1))[: args.tokens]
    times: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        for name, params in CHAINS.items():
            for fast in (True, False):
                key = f"{name} {'compiled' if fast else 'numpy'}"
                times.setdefault(key, []).append(per_token_us(params, steps, fast))
    S.FAST_CHAIN = True
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "vocab": args.vocab,
        "us_per_token": {k: round(statistics.median(v), 1) for k, v in times.items()},
    }
    for key, us in result["us_per_token"].items():
        print(f"{key:>18}: {us:7.1f} us per sample + accept")
    print(
        f"{result['date']}, {result['cpu']}, {result['cores']} cores, load {result['load_average']}"
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
