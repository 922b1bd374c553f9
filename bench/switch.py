#!/usr/bin/env python3
"""Switching models: the time from a request that names a model not loaded to its answer,
bankml's drop-in in router mode against llama-server's router, same run.

    bench/switch.py [--llama-server BIN] [--model FILE] [--rounds 6]

A directory holds two pinned copies of the model (``a.gguf``, ``b.gguf``, each with its
FORK.json). Both servers start in router mode on it with one model resident at most
(``--models-dir DIR --models-max 1 -c 2048 -t 2``). Each round sends each server, the first
server alternating, a one-token /v1/completions naming ``a`` then ``b``: every request makes the
server put the other model away and load the named one (bankml: verify the file again, guard
and sha256, then read its weights; llama-server: start a child process that loads it). A
second request to the model just loaded gives the figure with the model resident.

Prints each server's median switch time (request to answer, on the client's clock) and its
resident answer time, the ratio llama-server / bankml of the switch (above 1: bankml switches
faster), and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.dropin import call, start_dropin  # noqa: E402
from tests.registry_support import pin_into  # noqa: E402
from tests.support import free_port  # noqa: E402

FLAGS = ["-c", "2048", "-t", "2", "--models-max", "1", "--no-webui"]


def _answer(port: int, model: str) -> float:
    """Seconds from sending a one-token completion naming ``model`` to its whole answer."""
    body = {"model": model, "prompt": "The capital of France is", "max_tokens": 1}
    body["temperature"] = 0
    start = time.perf_counter()
    status, _, raw = call(port, "POST", "/v1/completions", body)
    took = time.perf_counter() - start
    assert status == 200, raw
    return took


def _start_llama_server(binary: str, directory: Path, port: int) -> subprocess.Popen:
    proc = subprocess.Popen(
        [binary, "--models-dir", str(directory), "--host", "127.0.0.1", "--port", str(port)]
        + FLAGS,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if call(port, "GET", "/models")[0] == 200:
                return proc
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise SystemExit("llama-server's router did not come up")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-server", default=shutil.which("llama-server"))
    parser.add_argument("--model", default=str(ROOT / "models/SmolLM2-135M-Instruct.Q4_1.gguf"))
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    if not args.llama_server:
        raise SystemExit("give --llama-server (scripts/build-llama-server.sh prints its path)")
    with tempfile.TemporaryDirectory(prefix="bankml-switch-") as tmp:
        directory = Path(tmp) / "models"
        directory.mkdir()
        for name in ("a", "b"):
            copy = directory / f"{name}.gguf"
            shutil.copyfile(args.model, copy)
            pin_into(directory, copy)
        ours, theirs = free_port(), free_port()
        dropin = ["--models-dir", str(directory), "--host", "127.0.0.1", *FLAGS]
        dropin += ["--listen", f"127.0.0.1:{free_port()}"]
        reference = _start_llama_server(args.llama_server, directory, theirs)
        proc = start_dropin(dropin, ours, Path(tmp) / "bankml.log")
        servers = {"bankml": ours, "llama-server": theirs}
        switch: dict[str, list[float]] = {who: [] for who in servers}
        resident: dict[str, list[float]] = {who: [] for who in servers}
        try:
            for port in servers.values():  # warm-up: each model loaded once
                _answer(port, "a")
                _answer(port, "b")
            for r in range(args.rounds):
                order = list(servers) if r % 2 == 0 else list(reversed(servers))
                for who in order:
                    for model in ("a", "b"):
                        switch[who].append(_answer(servers[who], model))
                        resident[who].append(_answer(servers[who], model))
        finally:
            proc.terminate()
            proc.wait(30)
            reference.terminate()
            reference.wait(30)
    out: dict[str, Any] = {}
    for who in servers:
        out[who] = {
            "switch_s": statistics.median(switch[who]),
            "resident_s": statistics.median(resident[who]),
        }
        print(
            f"{who:>13}: switch {out[who]['switch_s']:.3f} s, "
            f"resident {out[who]['resident_s']:.3f} s (median of {len(switch[who])})"
        )
    out["switch_ratio_llama_over_bankml"] = (
        out["llama-server"]["switch_s"] / out["bankml"]["switch_s"]
    )
    print(f"switch ratio llama-server / bankml: {out['switch_ratio_llama_over_bankml']:.2f}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
