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
second request to the model just loaded gives the figure with the model resident. Then each
switch is timed in its two parts: ``POST /models/load`` until ``GET /models`` lists the model
``loaded`` (llama-server answers the load at once and loads in its child; bankml answers once
loaded), and then a streamed one-token completion's first token.

Prints each server's median switch time (request to answer, on the client's clock), its
resident answer time, the split switch's load and first-token times, the ratio llama-server /
bankml of the switch and of the load (above 1: bankml is faster), and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import http.client
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


def _loaded(port: int, model: str) -> bool:
    status, _, raw = call(port, "GET", "/models")
    assert status == 200, raw
    entry = next(m for m in json.loads(raw)["data"] if m["id"] == model)
    return entry["status"]["value"] == "loaded"


def _load_then_first_token(port: int, model: str) -> tuple[float, float]:
    """(seconds from ``POST /models/load`` to the model listed loaded, seconds from then to a
    streamed completion's first token)."""
    start = time.perf_counter()
    status, _, raw = call(port, "POST", "/models/load", {"model": model})
    assert status == 200, raw
    while not _loaded(port, model):
        time.sleep(0.01)
    loaded = time.perf_counter()
    body = {"model": model, "prompt": "The capital of France is", "max_tokens": 1}
    body.update(temperature=0, stream=True)
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    try:
        conn.request(
            "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        resp = conn.getresponse()
        assert resp.status == 200, resp.read()
        while not resp.readline().startswith(b"data: "):
            pass
        first = time.perf_counter()
        resp.read()
    finally:
        conn.close()
    return loaded - start, first - loaded


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
        load: dict[str, list[float]] = {who: [] for who in servers}
        first_token: dict[str, list[float]] = {who: [] for who in servers}
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
            for r in range(args.rounds):
                order = list(servers) if r % 2 == 0 else list(reversed(servers))
                for who in order:
                    for model in ("a", "b"):
                        took = _load_then_first_token(servers[who], model)
                        load[who].append(took[0])
                        first_token[who].append(took[1])
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
            "load_s": statistics.median(load[who]),
            "first_token_s": statistics.median(first_token[who]),
        }
        print(
            f"{who:>13}: switch {out[who]['switch_s']:.3f} s, "
            f"resident {out[who]['resident_s']:.3f} s; load {out[who]['load_s']:.3f} s, "
            f"then first token {out[who]['first_token_s']:.3f} s (medians of {len(switch[who])})"
        )
    for part in ("switch", "load"):
        ratio = out["llama-server"][f"{part}_s"] / out["bankml"][f"{part}_s"]
        out[f"{part}_ratio_llama_over_bankml"] = ratio
        print(f"{part} ratio llama-server / bankml: {ratio:.2f}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
