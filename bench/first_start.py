#!/usr/bin/env python3
"""The first start: kernels compiled on one process and on every core, and the time to the first
answer of a cold and a warm bankml against llama-server's, same run.

    bench/first_start.py [--llama-server BIN] [--model FILE] [--rounds 2]

Each round, in alternating order:

- **compile**: a fresh process on an empty Numba cache (NUMBA_CACHE_DIR in a temporary
  directory) runs ``compile_kernels`` on the model with one process (``jobs=1``), and another
  with one per core (compile_jobs), each its seconds;
- **first answer**: ``bankml llama-server -m MODEL --fork F`` started on an empty cache (a first
  start), then again on the cache it filled (a later start), and llama-server with the same
  flags: the seconds from the start of the process to the whole answer of a one-token
  completion (polling /health meanwhile, as a client waiting for it would).

Prints the medians, the ratio one process / every core of the compile, and each server's time to
the first answer with the ratio bankml / llama-server (above 1: bankml is slower), then one JSON
line. Run it on an otherwise idle machine; the load is printed with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.dropin import bankml, call  # noqa: E402
from tests.support import free_port  # noqa: E402

COMPILE = """\
import sys, time
from bankml.engine_cupy.engine import compile_kernels
start = time.perf_counter()
compile_kernels(sys.argv[1], device="cpu", jobs=int(sys.argv[2]))
print(time.perf_counter() - start)
"""
FLAGS = ["-c", "2048", "-t", "2", "--no-webui"]


def compile_seconds(model: str, jobs: int) -> float:
    with tempfile.TemporaryDirectory(prefix="bankml-numba-") as cache:
        env = dict(os.environ, NUMBA_CACHE_DIR=cache)
        done = subprocess.run(
            [sys.executable, "-c", COMPILE, model, str(jobs)],
            env=env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        )
    return float(done.stdout.split()[-1])


def first_answer(command: list[str], port: int, env: dict[str, str]) -> float:
    """Seconds from starting ``command`` to the whole answer of a one-token completion."""
    start = time.perf_counter()
    proc = subprocess.Popen(
        command, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        while proc.poll() is None:
            try:
                if call(port, "GET", "/health")[0] == 200:
                    break
            except OSError:
                pass
            time.sleep(0.1)
        body = {"prompt": "The capital of France is", "max_tokens": 1, "temperature": 0}
        status, _, raw = call(port, "POST", "/v1/completions", body)
        took = time.perf_counter() - start
        assert status == 200, raw
        return took
    finally:
        proc.terminate()
        proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-server", default=shutil.which("llama-server"))
    parser.add_argument("--model", default=str(ROOT / "models/SmolLM2-135M-Instruct.Q4_1.gguf"))
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    if not args.llama_server:
        raise SystemExit("give --llama-server (scripts/build-llama-server.sh prints its path)")
    from bankml.engine_cupy.compile_jobs import default_jobs

    cores = default_jobs()
    fork = f"{args.model}.FORK.json"
    figures: dict[str, list[float]] = {
        "compile_one": [],
        "compile_all": [],
        "bankml_cold": [],
        "bankml_warm": [],
        "llama_server": [],
    }
    load = [os.getloadavg()[0]]
    for round_ in range(args.rounds):
        order = [1, cores] if round_ % 2 == 0 else [cores, 1]
        for jobs in order:
            figures["compile_one" if jobs == 1 else "compile_all"].append(
                compile_seconds(args.model, jobs)
            )
        with tempfile.TemporaryDirectory(prefix="bankml-numba-") as cache:
            env = dict(os.environ, NUMBA_CACHE_DIR=cache)
            port = free_port()
            ours = bankml("llama-server", "-m", args.model, "--fork", fork, *FLAGS, "--port")
            figures["bankml_cold"].append(first_answer([*ours, str(port)], port, env))
            figures["bankml_warm"].append(first_answer([*ours, str(port)], port, env))
        port = free_port()
        theirs = [args.llama_server, "-m", args.model, *FLAGS, "--port", str(port)]
        figures["llama_server"].append(first_answer(theirs, port, dict(os.environ)))
        load.append(os.getloadavg()[0])
    med = {name: statistics.median(values) for name, values in figures.items()}
    print(f"cores {cores}, load {min(load):.2f}-{max(load):.2f}, {args.rounds} rounds")
    print(
        f"compile on an empty cache: one process {med['compile_one']:.1f} s, "
        f"{cores} processes {med['compile_all']:.1f} s "
        f"(x{med['compile_one'] / med['compile_all']:.2f})"
    )
    print(
        f"first answer: bankml first start {med['bankml_cold']:.1f} s, later start "
        f"{med['bankml_warm']:.1f} s, llama-server {med['llama_server']:.1f} s "
        f"(bankml / llama-server: x{med['bankml_cold'] / med['llama_server']:.1f} first, "
        f"x{med['bankml_warm'] / med['llama_server']:.1f} later)"
    )
    print(json.dumps({"cores": cores, "load": load, "figures": figures, "medians": med}))


if __name__ == "__main__":
    main()
