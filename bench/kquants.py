#!/usr/bin/env python3
"""K-quant batch products: bankml's exact kernels against ggml's own, same thread count.

    bench/kquants.py [--types Q4_K Q6_K Q5_K] [--rows 512 64] [--threads 1] [--reps 7]

For each weight type, shape and batch size, times ``KQuantMatrix.matmul`` (activation rounding
included; at one row, ``--rows 1``, the fused decode step's own one-row product from compiled
code, ``one_row_timer``) and ggml's mul_mat of the same operands in llama-server build 11434's static libraries
(``bench/ggml_mul_mat_timer.c``, a persistent process that times each graph compute itself),
alternating one run of each, and prints GMAC/s and the ratio bankml/ggml (> 1: bankml faster).
Q4_K goes in the CPU_REPACK buffer (q4_K_8x8), as llama-server loads layer weights, and through
bankml's repacked arithmetic; the other types through the plain (tiled) kernels. The outputs
are checked bit for bit on the way. Ends with one JSON line.

Shapes are the default model's ([n_out, n_in]: ffn_down 576x1536, q/o 576x576, gate/up
1536x576, k/v 192x576), but a K-quant row is whole super-blocks of 256, so the n_in = 576
shapes are timed at n_in = 768 (llama-quantize falls back to Q5_0/Q8_0 for them in a real
Q4_K_M of this model; in a larger model they are K-quants of the same kind).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import struct
import subprocess
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import numba
import numpy
from gguf import GGMLQuantizationType as T

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bankml.engine_cupy.kernels import exact_kquants as ek  # noqa: E402
from bankml.engine_cupy.kernels import jit  # noqa: E402
from tests import ggml_oracle as go  # noqa: E402

TIMER_SOURCE = Path(__file__).resolve().parent / "ggml_mul_mat_timer.c"
# name -> (n_out, n_in): the default model's products, n_in 576 -> 768 (whole super-blocks)
SHAPES = {
    "ffn_down": (576, 1536),
    "attn_q/o": (576, 768),
    "ffn_gate/up": (1536, 768),
    "attn_k/v": (192, 768),
}


def timer_binary() -> Path:
    """The timer, compiled once per source and library version as the oracle is."""
    return go.compile_against_ggml(TIMER_SOURCE, "ggml-timer")


class GgmlProduct:
    """ggml's mul_mat of fixed operands in a child process: ``run()`` computes it once and
    returns the (wall, CPU) seconds the compute took, measured in the child; ``result()`` the
    output."""

    def __init__(
        self,
        raw: numpy.ndarray,
        qtype: T,
        n_out: int,
        n_in: int,
        x: numpy.ndarray,
        threads: int,
        repacked: bool,
    ):
        self.shape = (x.shape[0], n_out)
        # its stderr (ggml's 'repack: ...' lines) is dropped; a failure shows as its exit status
        self.proc = subprocess.Popen(
            [str(timer_binary())],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
        head = struct.pack("<6i", int(qtype), n_out, n_in, x.shape[0], threads, int(repacked))
        self.proc.stdin.write(
            head
            + numpy.ascontiguousarray(raw).tobytes()
            + numpy.ascontiguousarray(x, numpy.float32).tobytes()
        )
        self.proc.stdin.flush()

    def _ask(self, command: bytes, nbytes: int) -> bytes:
        self.proc.stdin.write(command)
        self.proc.stdin.flush()
        data = self.proc.stdout.read(nbytes)
        if len(data) != nbytes:
            raise RuntimeError(f"ggml-mul-mat-timer stopped (exit {self.proc.wait()})")
        return data

    def run(self) -> tuple[float, float]:
        return struct.unpack("<2d", self._ask(b"r", 16))

    def result(self) -> numpy.ndarray:
        return numpy.frombuffer(
            self._ask(b"o", 4 * self.shape[0] * self.shape[1]), numpy.float32
        ).reshape(self.shape)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


def weights_for(qtype: T, n_out: int, n_in: int, rng: numpy.random.Generator) -> numpy.ndarray:
    """Gaussian weights quantized by ggml's own from_float (real K-quant statistics)."""
    w = (rng.standard_normal((n_out, n_in)) * 0.05).astype(numpy.float32)
    return go.cpy(w, qtype)


@numba.njit
def _row_products(code, parallel, raw, x, out, calls):  # pragma: no cover - compiled
    """``calls`` one-row products as the fused decode step makes them (its activation
    rounding included), from compiled code: no Python call or allocation in between."""
    for _ in range(calls):
        ek.row_product(code, parallel, raw, x, out)


def one_row_timer(matrix: ek.KQuantMatrix, x: numpy.ndarray) -> tuple[Any, numpy.ndarray]:
    """(a call timing ``ONE_ROW_CALLS`` products of the one row ``x``, their output): the
    decode step's own callable (``exact_kquants.row_product``), with the arithmetic and the
    threading it picks for one row. ``KQuantMatrix.matmul`` would add a Python call, the
    activation's object and an output array to every product, which at one row is as much
    time as the product itself (about 25 us of 66 on the 576x1536 Q4_K one)."""
    raw, row = matrix.raw, numpy.ascontiguousarray(x, numpy.float32)
    out = numpy.empty((1, matrix.n_out), numpy.float32)
    code, parallel = matrix.row_code(), matrix.n_out * matrix.n_in >= ek.PARALLEL_MIN_MACS
    _row_products(code, parallel, raw, row, out, 1)  # compiled before anything is timed
    return (lambda: _row_products(code, parallel, raw, row, out, ONE_ROW_CALLS)), out


ONE_ROW_CALLS = 100  # products per timed call at m = 1 (each call's time is divided by it)


def timed(f) -> tuple[float, float]:
    """(wall, process CPU) seconds of one call."""
    wall, cpu = time.perf_counter(), time.process_time()
    f()
    return time.perf_counter() - wall, time.process_time() - cpu


def measure(
    qtype: T,
    n_out: int,
    n_in: int,
    m: int,
    threads: int,
    reps: int,
    clock: int,
    rng: numpy.random.Generator,
) -> dict:
    """Median seconds of each side over ``reps`` alternating runs (after one warm-up each), by
    the wall clock (clock 0) or the process's CPU time (clock 1)."""
    raw = weights_for(qtype, n_out, n_in, rng)
    x = rng.standard_normal((m, n_in)).astype(numpy.float32)
    repacked = ek.repacked_by_llama_server(qtype, n_out)
    matrix = ek.KQuantMatrix(raw, qtype, n_out, n_in, repacked=repacked)
    ggml = GgmlProduct(raw, qtype, n_out, n_in, x, threads, repacked)
    try:
        if m == 1:
            ours_call, ours = one_row_timer(matrix, x)
            calls = ONE_ROW_CALLS
        else:
            ours_call, ours, calls = partial(matrix.matmul, x), matrix.matmul(x), 1
        ggml.run()
        differ = int(
            numpy.count_nonzero(ours.view(numpy.uint32) != ggml.result().view(numpy.uint32))
        )
        mine, theirs = [], []
        for _ in range(reps):
            mine.append(timed(ours_call)[clock] / calls)
            theirs.append(ggml.run()[clock])
    finally:
        ggml.close()
    macs = m * n_out * n_in
    t_mine, t_theirs = statistics.median(mine), statistics.median(theirs)
    return {
        "type": qtype.name,
        "repacked": repacked,
        "n_out": n_out,
        "n_in": n_in,
        "m": m,
        "bankml_ms": round(t_mine * 1e3, 3),
        "ggml_ms": round(t_theirs * 1e3, 3),
        "bankml_gmacs": round(macs / t_mine / 1e9, 1),
        "ggml_gmacs": round(macs / t_theirs / 1e9, 1),
        "ratio": round(t_theirs / t_mine, 3),
        "differing_outputs": differ,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--types",
        nargs="+",
        default=["Q4_K", "Q6_K"],
        choices=["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"],
    )
    parser.add_argument("--rows", nargs="+", type=int, default=[512, 64])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="cpu: each side's process CPU time (steadier on a busy machine; --threads 1 only)",
    )
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    args = parser.parse_args(argv)
    if args.clock == "cpu" and args.threads != 1:
        parser.error(
            "--clock cpu counts every thread's time (spinning ones too): use it with --threads 1"
        )
    jit.start_worker_threads()  # with the engine's short spin, before the first kernel
    numba.set_num_threads(min(args.threads, numba.config.NUMBA_NUM_THREADS))
    rng = numpy.random.default_rng(0)
    load_before = os.getloadavg()
    print(
        f"threads {args.threads}, {args.clock} clock, load average {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f}",
        file=sys.stderr,
    )
    results = []
    print(
        f"{'type':6} {'shape':12} {'n_out x n_in':>12} {'m':>4} {'bankml GMAC/s':>14} {'ggml GMAC/s':>12} "
        f"{'ratio':>6} {'differ':>6}"
    )
    for name in args.shapes:
        n_out, n_in = SHAPES[name]
        for qtype in (T[t] for t in args.types):
            for m in args.rows:
                r = measure(
                    qtype, n_out, n_in, m, args.threads, args.reps, int(args.clock == "cpu"), rng
                )
                results.append(r | {"shape": name})
                label = qtype.name + ("r" if r["repacked"] else "")
                print(
                    f"{label:6} {name:12} {f'{n_out}x{n_in}':>12} {m:4} {r['bankml_gmacs']:14.1f} "
                    f"{r['ggml_gmacs']:12.1f} {r['ratio']:6.2f} {r['differing_outputs']:6}",
                    flush=True,
                )
    load_after = os.getloadavg()
    summary = {}
    for qtype in args.types:
        for m in args.rows:
            picked = [r for r in results if r["type"] == qtype and r["m"] == m]
            # total time over the shapes, as a layer spends it
            summary[f"{qtype}_m{m}"] = round(
                sum(r["ggml_ms"] for r in picked) / sum(r["bankml_ms"] for r in picked), 3
            )
    print(
        "ratio bankml/ggml over all shapes (time-weighted, > 1: bankml faster): "
        + ", ".join(f"{k} {v}" for k, v in summary.items())
    )
    print(f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f}")
    print(
        json.dumps(
            {
                "threads": args.threads,
                "clock": args.clock,
                "reps": args.reps,
                "load_before": round(load_before[0], 2),
                "load_after": round(load_after[0], 2),
                "summary": summary,
                "results": results,
            }
        )
    )
    return 0 if all(r["differing_outputs"] == 0 for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
