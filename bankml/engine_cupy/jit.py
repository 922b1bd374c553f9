"""Numba compilation for the CPU kernels that must round exactly as ggml's do.

NumPy's vectorised operations cannot follow ggml's per-lane accumulation order without
materialising many times the work, so the kernels that must be bit-identical to llama-server's
(quantized matrix products, the f16 flash-attention accumulator, SiLU's polynomial exp) are
written as plain loops and compiled by Numba. ``njit`` is the one decorator they use:
compiled once per machine (cached beside the module, or in Numba's user cache when the package
directory is read-only), no Python objects inside, and the GIL released so the engine thread
never blocks the reactor. ``fma32`` is a single-rounding fused multiply-add in float32, which
ggml's AVX2 kernels use (``_mm256_fmadd_ps``) and Python 3.11's ``math`` lacks.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import numba
from llvmlite import ir
from numba import njit as _numba_njit
from numba import types
from numba.extending import intrinsic

__all__ = ["njit", "fma32", "f16_round", "f16_bits"]


# libgomp's wait: spin this many iterations (a few microseconds) after a parallel region, then
# sleep. Measured on a decode step of the default model, 2 idle cores: 14.5 ms with 10,000,
# 16.0 ms spinning (ACTIVE, libgomp's default here), 31.7 ms sleeping at once (PASSIVE), whose
# wake-up costs tens of microseconds for each of a step's ~120 parallel products.
SPIN_COUNT = "10000"


def start_worker_threads() -> None:
    """Start Numba's OpenMP workers with a short spin, for this process only.

    libgomp reads GOMP_SPINCOUNT once, when Numba's threading layer loads it, so the variable is
    set for that moment only and then put back (unless the user set it or OMP_WAIT_POLICY):
    a llama-server started later by this process (P0 --spawn, the tests, the benchmarks) keeps
    its own defaults, on which its speed depends (with a passive policy inherited it decoded
    20-25 tok/s instead of 90-100 here). A long spin would starve a thread the workers wait for
    on a loaded 2-core machine; a short one costs little there.
    """
    if "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ:
        numba.get_num_threads()
        return
    os.environ["GOMP_SPINCOUNT"] = SPIN_COUNT
    try:
        numba.get_num_threads()  # loads the threading layer and starts its workers
    finally:
        del os.environ["GOMP_SPINCOUNT"]


start_worker_threads()


def njit(*args: Any, **kwargs: Any) -> Callable:
    """numba.njit with the project's settings: cached, nogil, IEEE float semantics (no fastmath)."""
    options = {"cache": True, "nogil": True, "fastmath": False, "error_model": "numpy"}
    options.update(kwargs)
    if args and callable(args[0]):
        return _numba_njit(**options)(args[0])
    return _numba_njit(*args, **options)


@intrinsic
def fma32(typingctx: Any, a: Any, b: Any, c: Any) -> Any:
    """a * b + c in float32 with one rounding (llvm.fma.f32: the FMA instruction where present)."""
    sig = types.float32(types.float32, types.float32, types.float32)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        f32 = ir.FloatType()
        fn = builder.module.declare_intrinsic("llvm.fma", [f32], ir.FunctionType(f32, [f32] * 3))
        return builder.call(fn, args)

    return sig, codegen


@intrinsic
def f16_round(typingctx: Any, x: Any) -> Any:
    """float32 x through f16 and back, round to nearest even: ggml's GGML_CPU_FP32_TO_FP16 then
    FP16_TO_FP32 (F16C's vcvtps2ph/vcvtph2ps where present, LLVM's exact soft conversion else)."""
    sig = types.float32(types.float32)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.fpext(builder.fptrunc(args[0], ir.HalfType()), ir.FloatType())

    return sig, codegen


@intrinsic
def f16_bits(typingctx: Any, x: Any) -> Any:
    """The bits of float32 x rounded to f16 (nearest even), as an int64 table index."""
    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        h = builder.fptrunc(args[0], ir.HalfType())
        return builder.zext(builder.bitcast(h, ir.IntType(16)), ir.IntType(64))

    return types.int64(types.float32), codegen
