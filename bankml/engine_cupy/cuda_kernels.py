"""The engine's CUDA kernels: their source files, entry points and compile options.

The sources live in ``bankml/engine_cupy/cuda/`` (package data): ``quantize_q8_1.cu`` (an f32
activation row to q8_1 blocks) and ``mmvq_<type>.cu`` for Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K,
Q3_K, Q4_K, Q5_K and Q6_K (one row of weights kept in their GGUF blocks times the q8_1 activation, ggml's
``mul_mat_vec_q`` arithmetic), with the shared ``mmvq_common.cuh``. ``cuda_twins`` computes
each one's result with NumPy. The decode step's other kernels, and the prefill's
(``dequantize_f16.cu``: GGUF blocks to f16 rows for cuBLAS; ``prefill_f16.cu``: n rows at once),
have their twins in ``device_twins`` and ``device_prefill_twins``. ``options()`` are the same for every compiler: ``--fmad=false``
keeps each rounding where the source (and the twin) puts it. The same sources compile for HIP
(ROCm, through CuPy's HIP build and hiprtc) with ``hip_options()``: ``mmvq_common.cuh`` writes
CUDA's intrinsics in HIP's terms there (docs/modules/cuda_kernels.md).

``python -m bankml.engine_cupy.cuda_kernels`` (``scripts/gpu-check.sh --compile-only``)
compiles every kernel with NVRTC (``bankml.engine_cupy.nvrtc``, no GPU needed) for each of
``ARCHS`` and prints one JSON line: ``{"kernels": N, "compiled": N, ...}``; its exit status is
1 when one does not compile, 2 when no libnvrtc is found.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bankml.engine_cupy import nvrtc

SOURCE_DIR = Path(__file__).resolve().parent / "cuda"
ARCHS = ("sm_80", "sm_90")  # Ampere (A100) and Hopper (H100/H200)
MMVQ_NWARPS = 4  # warps per output row: cuda_twins.NWARPS


@dataclass(frozen=True)
class Kernel:
    """One entry point: ``name`` in ``source`` (a file of SOURCE_DIR); ``qtype`` the weight type
    it multiplies (None: not a product)."""

    name: str
    source: str
    qtype: str | None

    def code(self) -> str:
        """The source with its local headers (``#include "x.cuh"`` of SOURCE_DIR) written in, so
        that the text compiled, and CuPy's cache key, holds everything the kernel is made of."""
        return _inline(self.source, set())


def _inline(name: str, seen: set[str]) -> str:
    out = []
    for line in (SOURCE_DIR / name).read_text().splitlines(keepends=True):
        words = line.split()
        if len(words) == 2 and words[0] == "#include" and words[1].startswith('"'):
            header = words[1].strip('"')
            if header not in seen:
                seen.add(header)
                out.append(_inline(header, seen))
            continue
        out.append(line)
    return "".join(out)


KERNELS = (
    Kernel("quantize_q8_1", "quantize_q8_1.cu", None),
    *(
        Kernel(f"mmvq_{q.lower()}", f"mmvq_{q.lower()}.cu", q)
        for q in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
    ),
    # the decode step's (device_step.py): norm, RoPE and cache, attention, GLU, choice, embedding
    Kernel("rms_norm_q8_1", "rms_norm_q8_1.cu", None),
    Kernel("rope_kv_f16", "rope_kv_f16.cu", None),
    Kernel("attn_decode_f16", "attn_decode_f16.cu", None),
    Kernel("swiglu_q8_1", "swiglu_q8_1.cu", None),
    Kernel("argmax_f32", "argmax_f32.cu", None),
    Kernel("top_k_f32", "top_k_f32.cu", None),  # a sampling request's k (id, logit) pairs
    Kernel("get_rows_q8_0", "get_rows.cu", None),
    Kernel("get_rows_f32", "get_rows.cu", None),
    # the prefill's (device_prefill.py): GGUF blocks to f16 rows for cuBLAS, and n rows at once
    *(
        Kernel(f"dequantize_f16_{q.lower()}", "dequantize_f16.cu", None)
        for q in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
    ),
    Kernel("get_rows_q8_0_n", "prefill_f16.cu", None),
    Kernel("get_rows_f32_n", "prefill_f16.cu", None),
    Kernel("add_rms_norm_f16", "prefill_f16.cu", None),
    Kernel("rope_kv_f16_n", "prefill_f16.cu", None),
    Kernel("attn_prefill_f16", "prefill_f16.cu", None),
    Kernel("swiglu_f16", "prefill_f16.cu", None),
    Kernel("advance_pos", "prefill_f16.cu", None),
    # the batched decode step's (device_step.DeviceStep.step_rows): up to 8 slots' rows at once
    *(
        Kernel(f"mmvq_{q.lower()}_rows", f"mmvq_{q.lower()}.cu", None)
        for q in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
    ),
    Kernel("rms_norm_q8_1_rows", "rms_norm_q8_1.cu", None),
    Kernel("rope_kv_f16_rows", "rope_kv_f16.cu", None),
    Kernel("attn_decode_f16_rows", "attn_decode_f16.cu", None),
    Kernel("swiglu_q8_1_rows", "swiglu_q8_1.cu", None),
    Kernel("argmax_f32_rows", "argmax_f32.cu", None),
    Kernel("get_rows_q8_0_rows", "get_rows.cu", None),
    Kernel("get_rows_f32_rows", "get_rows.cu", None),
)


def options(arch: str | None = None) -> list[str]:
    """NVRTC options for every kernel (CuPy's RawModule takes the same, less the architecture)."""
    opts = ["--std=c++17", "--fmad=false", f"-DMMVQ_NWARPS={MMVQ_NWARPS}"]
    return opts + ([f"--gpu-architecture={arch}"] if arch else [])


def hip_options() -> list[str]:
    """hiprtc's (CuPy's HIP build) options for every kernel: clang's words for what
    ``options()`` asks of NVRTC. No contraction into fused multiply-adds (the sources say so
    too, ``mmvq_common.cuh``), and f32 division and square root correctly rounded (HIP's
    default, said so that it cannot change under them)."""
    return [
        "-std=c++17",
        "-ffp-contract=off",
        "-fhip-fp32-correctly-rounded-divide-sqrt",
        f"-DMMVQ_NWARPS={MMVQ_NWARPS}",
    ]


def compile_all(compiler: nvrtc.Compiler, archs: tuple[str, ...] = ARCHS) -> list[dict[str, Any]]:
    """Every kernel for every architecture: name, arch, ok, ptx_bytes or error, seconds."""
    results = []
    for kernel in KERNELS:
        for arch in archs:
            start = time.monotonic()
            entry: dict[str, Any] = {"kernel": kernel.name, "arch": arch}
            try:
                ptx = compiler.ptx(kernel.code(), kernel.source, options(arch))
            except nvrtc.CompileError as err:
                entry.update(ok=False, error=str(err))
            else:
                ok = f".entry {kernel.name}(" in ptx
                entry.update(ok=ok, ptx_bytes=len(ptx), fma_f32=ptx.count("fma.rn.f32"))
                if not ok:
                    entry["error"] = f"no entry point {kernel.name} in the PTX"
            entry["seconds"] = round(time.monotonic() - start, 3)
            results.append(entry)
    return results


def report(archs: tuple[str, ...] = ARCHS) -> tuple[dict[str, Any], int]:
    """The compile-only report and the exit status."""
    path = nvrtc.find_library()
    base: dict[str, Any] = {"kernels": len(KERNELS), "archs": list(archs)}
    try:
        if path is None:
            raise OSError("no libnvrtc found (pip install nvidia-cuda-nvrtc, or set BANKML_NVRTC)")
        compiler = nvrtc.Compiler(path)
        version = compiler.version()
    except OSError as err:
        return {**base, "compiled": 0, "error": str(err)}, 2
    results = compile_all(compiler, archs)
    compiled = sum(all(r["ok"] for r in results if r["kernel"] == k.name) for k in KERNELS)
    failed = [r for r in results if not r["ok"]]
    out = {
        **base,
        "compiled": compiled,
        "nvrtc": f"{version[0]}.{version[1]}",
        "nvrtc_path": path,
        "seconds": round(sum(r["seconds"] for r in results), 3),
        # fused f32 multiply-adds in the PTX: 0 (--fmad=false, the twins round each apart)
        "fma_f32": sum(r.get("fma_f32", 0) for r in results),
        "failures": [{k: r[k] for k in ("kernel", "arch", "error")} for r in failed],
    }
    return out, 0 if compiled == len(KERNELS) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Compile every CUDA kernel with NVRTC.")
    parser.add_argument("--arch", action="append", help="sm_XX (repeatable; default sm_80, sm_90)")
    args = parser.parse_args(argv)
    out, status = report(tuple(args.arch) if args.arch else ARCHS)
    print(json.dumps(out))
    return status


if __name__ == "__main__":
    sys.exit(main())
