#!/usr/bin/env python3
"""Memory serving the same model: bankml's drop-in against llama-server, same flags, same run.

    bench/memory.py [--llama-server BIN] [--model FILE] [--rounds 2] [--answers 8]

Each round starts each server in turn (the first alternating) with ``-c 4096 -t 2 -np 1``,
waits for /health, sends --answers completions of different prompts (16 tokens each, so the
prompt cache holds something), then reads the process's memory from /proc: VmRSS, and its
anonymous and file-backed parts (RssAnon, RssFile: the model's mapped pages and the shared
libraries). bankml's host prompt cache is given apart (``prompt_cache.bytes`` of
/bankml/metrics): memory llama-server keeps too (its --cache-ram), not the runtime's.

A bankml start before the rounds, not measured, fills Numba's cache if the kernels' sources
changed, so that each round measures a server loading its kernels (a start that compiles
holds the compiler's memory too).

Prints the medians in MiB and the ratio bankml / llama-server of the RSS (the goal: at most
1.5), also without bankml's prompt cache, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.dropin import bankml, call  # noqa: E402
from tests.support import free_port  # noqa: E402

FLAGS = ["-c", "4096", "-t", "2", "-np", "1", "--no-webui"]
MIB = 1024 * 1024


def _memory(pid: int) -> dict[str, float]:
    status = dict(
        line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
    )
    return {
        key: int(status[key].split()[0]) * 1024 / MIB for key in ("VmRSS", "RssAnon", "RssFile")
    }


def measure(command: list[str], port: int, answers: int, metrics_port: int | None) -> dict:
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline:
            try:
                if call(port, "GET", "/health")[0] == 200:
                    break
            except OSError:
                pass
            time.sleep(0.2)
        for i in range(answers):
            body = {"prompt": f"Question {i}: what is {i} plus {i}?", "max_tokens": 16}
            status, _, raw = call(port, "POST", "/v1/completions", {**body, "temperature": 0})
            assert status == 200, raw
        time.sleep(1)
        figures = _memory(proc.pid)
        if metrics_port is not None:
            _, _, raw = call(metrics_port, "GET", "/bankml/metrics")
            figures["prompt_cache"] = json.loads(raw)["prompt_cache"]["bytes"] / MIB
        return figures
    finally:
        proc.terminate()
        proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-server", default=shutil.which("llama-server"))
    parser.add_argument("--model", default=str(ROOT / "models/SmolLM2-135M-Instruct.Q4_1.gguf"))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--answers", type=int, default=8)
    args = parser.parse_args()
    if not args.llama_server:
        raise SystemExit("give --llama-server (scripts/build-llama-server.sh prints its path)")
    fork = f"{args.model}.FORK.json"
    runs: dict[str, list[dict]] = {"bankml": [], "llama-server": []}
    port, listen = free_port(), free_port()
    command = bankml("llama-server", "-m", args.model, "--fork", fork, *FLAGS)
    measure(command + ["--port", str(port), "--listen", f"127.0.0.1:{listen}"], port, 1, None)
    for round_ in range(args.rounds):
        order = ["bankml", "llama-server"] if round_ % 2 == 0 else ["llama-server", "bankml"]
        for name in order:
            port = free_port()
            if name == "bankml":
                listen = free_port()
                command = bankml("llama-server", "-m", args.model, "--fork", fork, *FLAGS)
                command += ["--port", str(port), "--listen", f"127.0.0.1:{listen}"]
                runs[name].append(measure(command, port, args.answers, listen))
            else:
                command = [args.llama_server, "-m", args.model, *FLAGS, "--port", str(port)]
                runs[name].append(measure(command, port, args.answers, None))
    med = {
        name: {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}
        for name, rounds in runs.items()
    }
    for name, figures in med.items():
        print(f"{name:13s} " + ", ".join(f"{k} {v:.1f} MiB" for k, v in figures.items()))
    ratio = med["bankml"]["VmRSS"] / med["llama-server"]["VmRSS"]
    own = (med["bankml"]["VmRSS"] - med["bankml"]["prompt_cache"]) / med["llama-server"]["VmRSS"]
    print(
        f"RSS bankml / llama-server: x{ratio:.2f}, x{own:.2f} without bankml's prompt cache "
        f"(load {os.getloadavg()[0]:.2f})"
    )
    print(json.dumps({"runs": runs, "medians": med, "ratio": ratio, "without_prompt_cache": own}))


if __name__ == "__main__":
    main()
