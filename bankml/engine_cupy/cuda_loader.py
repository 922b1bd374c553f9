"""The CUDA kernels on a GPU: ``cupy.RawModule`` from the package's sources, and their launches.

``CudaKernels(cupy)`` compiles a kernel's source (``cuda_kernels.KERNELS``, with
``cuda_kernels.options()``: CuPy picks the architecture of the device) the first time it is
used; CuPy keeps the compiled binary in its on-disk kernel cache, so later processes load it.
Then, with device arrays:

- ``quantize_q8_1(x)``: an f32 row (a multiple of 32 long) to its q8_1 blocks, uint8
  [n/32 * 36]: one thread per value, ``THREADS`` per thread block;
- ``mmvq(qtype, w, y, ncols)``: rows of weights in their GGUF blocks (uint8 [rows, row bytes],
  the tensor's bytes uploaded as they are in the file) times q8_1 blocks, f32 [rows]: one thread
  block of ``cuda_twins.NWARPS`` warps per row;
- ``matvec(qtype, w, x)``: both.

Each launch computes what ``cuda_twins`` computes on the CPU (docs/modules/cuda_twins.md);
nothing here reads a device value back to the host. The engine's decode step
(device_step.py, served by device_model.py) launches its kernels through ``function``.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import numpy

from bankml.engine_cupy import cuda_kernels
from bankml.engine_cupy.cuda_twins import BLOCK_TYPES, NWARPS, QK, WARP

THREADS = 256  # per thread block of quantize_q8_1 (whole warps: every warp one q8_1 block)
Q8_1_BYTES = 36


def on_hip(cupy: ModuleType) -> bool:
    """Whether ``cupy`` is CuPy's HIP build (a ROCm GPU)."""
    return bool(getattr(getattr(getattr(cupy, "cuda", None), "runtime", None), "is_hip", False))


class CudaKernels:
    """The kernels of one process, compiled on first use; ``cupy`` is the CuPy module."""

    def __init__(self, cupy: ModuleType) -> None:
        self._cp = cupy
        self._functions: dict[str, Any] = {}
        self._by_name = {k.name: k for k in cuda_kernels.KERNELS}
        self._by_qtype = {k.qtype: k for k in cuda_kernels.KERNELS if k.qtype}

    def function(self, name: str) -> Any:
        """The compiled entry point ``name`` (a ``cupy.RawKernel``): NVRTC's options on CUDA,
        hiprtc's on CuPy's HIP build."""
        fn = self._functions.get(name)
        if fn is None:
            kernel = self._by_name[name]
            opts = cuda_kernels.hip_options() if on_hip(self._cp) else cuda_kernels.options()
            module = self._cp.RawModule(code=kernel.code(), options=tuple(opts))
            fn = self._functions[name] = module.get_function(name)
        return fn

    def quantize_q8_1(self, x: Any) -> Any:
        n = int(x.shape[-1])
        if x.ndim != 1 or n % QK:
            raise ValueError(
                f"quantize_q8_1 takes one row of a multiple of {QK} values, not {x.shape}"
            )
        y = self._cp.empty(n // QK * Q8_1_BYTES, dtype=numpy.uint8)
        grid = (-(-n // THREADS),)
        self.function("quantize_q8_1")(grid, (THREADS,), (x, y, numpy.int32(n)))
        return y

    def mmvq(self, qtype: str, w: Any, y: Any, ncols: int) -> Any:
        if qtype not in self._by_qtype:
            raise ValueError(f"no one-row product kernel for {qtype}")
        bt = BLOCK_TYPES[qtype]
        rows, row_bytes = (int(s) for s in w.shape)
        if ncols % bt.values or row_bytes != ncols // bt.values * bt.block_bytes:
            raise ValueError(f"{qtype} rows of {row_bytes} bytes do not hold {ncols} values")
        if int(y.shape[0]) != ncols // QK * Q8_1_BYTES:
            raise ValueError(f"{y.shape[0]} bytes of q8_1 blocks for {ncols} values")
        dst = self._cp.empty(rows, dtype=numpy.float32)
        fn = self.function(self._by_qtype[qtype].name)
        fn((rows,), (WARP, NWARPS), (w, y, dst, numpy.int32(ncols)))
        return dst

    def matvec(self, qtype: str, w: Any, x: Any) -> Any:
        return self.mmvq(qtype, w, self.quantize_q8_1(x), int(x.shape[-1]))
