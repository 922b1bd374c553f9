#!/usr/bin/env python3
"""A real model size: prefill, decode and 4-stream aggregate on a Q4_K_M model of Llama-3.2-1B's
(or about 3B's) shape with random weights, against llama-server, same run; decode also as a
fraction of the machine's memory bandwidth measured in the same run.

    bench/real_size.py [--shape 1b|3b] [--llama-server BIN] [--rounds 2] [--streams 1,4]

The model is built once and cached in ``$BANKML_CACHE/bench-models`` (default
``~/.cache/bankml``): an F16 GGUF written by tests/tiny_models.py's writer (the default model's
vocabulary and tokenizer, Llama 3 RoPE frequency factors, tied embeddings), quantized to Q4_K_M by
``llama-quantize`` of the reference build (build 11434), and pinned beside it. The shapes:

| shape | layers | width | heads (KV) | head size | FFN | parameters |
|---|---|---|---|---|---|---|
| 1b (Llama-3.2-1B) | 16 | 2048 | 32 (8) | 64 | 8192 | 1.07 B |
| 3b (Llama-3.2-3B) | 28 | 3072 | 24 (8) | 128 | 8192 | 3.06 B |

The vocabulary is the default model's 49,152 tokens where Llama 3.2 has 128,256, so the output
product is about 38 % of Llama's; every other matrix is Llama's size.

Then, in this process: the memory bandwidth (the best of 5 copies of a 1 GiB array: bytes read
plus written per second); ``bench/engine.py --model`` (prefill and one-stream decode of the engine
against llama-server's own timings); ``bench/parallel.py --model`` (served streams, aggregate
tokens per second, ``-np N -kvu``). The decode's distance to the physical limit: every decoded
token reads every weight once, so weights bytes x tokens per second / bandwidth is the fraction of
the bandwidth a decode uses (for both servers). Prints each script's own lines, a summary, and
one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gguf import GGMLQuantizationType as T  # noqa: E402

from tests import ggml_oracle, support  # noqa: E402
from tests.registry_support import pin_into  # noqa: E402
from tests.tiny_models import TinySpec, write_tiny_model  # noqa: E402

SHAPES = {
    "1b": TinySpec(
        "llama", T.F16, n_layer=16, n_embd=2048, n_ff=8192, n_head=32, n_head_kv=8,
        head_dim=64, llama3_rope=True,
    ),
    "3b": TinySpec(
        "llama", T.F16, n_layer=28, n_embd=3072, n_ff=8192, n_head=24, n_head_kv=8,
        head_dim=128, llama3_rope=True,
    ),
}  # fmt: skip


def model_file(shape: str) -> Path:
    """The shape's Q4_K_M file, built and pinned on first use."""
    cache = Path(os.environ.get("BANKML_CACHE", Path.home() / ".cache" / "bankml"))
    out = cache / "bench-models" / f"llama-{shape}-shape.Q4_K_M.gguf"
    if out.exists() and out.with_name(out.name + ".FORK.json").exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    f16 = out.with_name(f"llama-{shape}-shape.F16.gguf.tmp")
    print(f"[real_size] writing {f16.name}", file=sys.stderr, flush=True)
    write_tiny_model(f16, SHAPES[shape], support.default_model())
    print(f"[real_size] quantizing to {out.name}", file=sys.stderr, flush=True)
    tmp = out.with_name(out.name + ".tmp")
    subprocess.run(
        [str(ggml_oracle.reference_tool("llama-quantize")), str(f16), str(tmp), "Q4_K_M"],
        check=True,
        capture_output=True,
    )
    f16.unlink()
    tmp.rename(out)
    pin_into(out.parent, out)
    return out


def bandwidth() -> float:
    """Bytes per second of the best of 5 copies of 1 GiB (read + write)."""
    src = numpy.ones(1 << 30, dtype=numpy.uint8)
    dst = numpy.empty_like(src)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        numpy.copyto(dst, src)
        best = min(best, time.perf_counter() - start)
    return 2 * src.nbytes / best


def _run(script: str, *args: str) -> dict[str, Any]:
    """Run a bench script, its lines shown, and return its last line's JSON."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / script), *args],
        check=True,
        stdout=subprocess.PIPE,
        text=True,
    )
    print(done.stdout, end="")
    return json.loads(done.stdout.strip().splitlines()[-1])


def weight_bytes(path: Path) -> int:
    from bankml.engine_cupy.gguf_file import open_file

    return sum(t.data.nbytes for t in open_file(path).tensors)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    parser.add_argument("--llama-server", type=Path, default=None)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--streams", default="1,4")
    args = parser.parse_args()
    binary = str(args.llama_server or support.llama_server_binary())
    model = model_file(args.shape)
    per_second = bandwidth()
    weights = weight_bytes(model)
    print(
        f"{model.name}: {weights / 2**30:.2f} GiB of weights; bandwidth {per_second / 1e9:.1f} GB/s"
    )
    engine = _run(
        "engine.py", "--model", str(model), "--llama-server", binary, "--rounds", str(args.rounds),
        "--prompt-tokens", "256", "--decode-tokens", "32",
    )  # fmt: skip
    served = _run(
        "parallel.py", "--model", str(model), "--llama-server", binary, "--streams", args.streams,
        "--tokens", "64", "--rounds", "1",
    )  # fmt: skip
    share = {
        name: engine[f"decode_{name}"] * weights / per_second for name in ("engine", "llama_server")
    }
    print(
        f"decode: bankml {engine['decode_engine']} tok/s ({share['engine']:.0%} of the "
        f"bandwidth), llama-server {engine['decode_llama_server']} tok/s "
        f"({share['llama_server']:.0%}); prefill x{engine['prefill_ratio']}, decode "
        f"x{engine['decode_ratio']}; load {os.getloadavg()[0]:.2f}"
    )
    print(
        json.dumps(
            {
                "shape": args.shape,
                "weights_bytes": weights,
                "bandwidth_bytes_s": per_second,
                "bandwidth_share": share,
                "engine": engine,
                "served": served,
            }
        )
    )


if __name__ == "__main__":
    main()
