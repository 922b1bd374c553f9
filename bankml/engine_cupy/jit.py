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

from typing import Any, Callable

from llvmlite import ir
from numba import njit as _numba_njit
from numba import types
from numba.extending import intrinsic

__all__ = ["njit", "fma32"]


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
