"""NVRTC, CUDA's run-time compiler, through ctypes: CUDA C source to PTX without a GPU or CuPy.

``find_library()`` looks for ``libnvrtc`` where the ``nvidia-cuda-nvrtc`` wheels put it
(``nvidia/cu13/lib``, ``nvidia/cuda_nvrtc/lib`` under any ``sys.path`` entry), then
``$BANKML_NVRTC`` (a path to the library) first if set, then the system's library path.
``Compiler(path).ptx(source, name, options)`` compiles one translation unit and returns its PTX,
or raises ``CompileError`` with NVRTC's log. The engine's kernels are compiled this way by the
tests and by ``scripts/gpu-check.sh --compile-only`` (``bankml.engine_cupy.cuda_kernels``); on a
GPU, CuPy's ``RawModule`` compiles the same sources with its own NVRTC.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
import sys

# where the wheels install the library: CUDA 13's nvidia-cuda-nvrtc, and CUDA 12's
# nvidia-cuda-nvrtc-cu12
_WHEEL_GLOBS = ("nvidia/cu13/lib/libnvrtc.so.*", "nvidia/cuda_nvrtc/lib/libnvrtc.so.*")


class CompileError(RuntimeError):
    """NVRTC refused a source: the message holds its log."""


def find_library() -> str | None:
    """The path (or soname) of a loadable libnvrtc, or None."""
    env = os.environ.get("BANKML_NVRTC")
    if env:
        return env
    for entry in sys.path:
        for pattern in _WHEEL_GLOBS:
            # the library itself (libnvrtc.so.13), not the builtins beside it
            hits = sorted(
                p for p in glob.glob(os.path.join(entry or ".", pattern)) if "builtins" not in p
            )
            if hits:
                return hits[0]
    return ctypes.util.find_library("nvrtc")


class Compiler:
    """One loaded libnvrtc."""

    def __init__(self, path: str) -> None:
        self.path = path
        lib = ctypes.CDLL(path)
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        lib.nvrtcGetErrorString.argtypes = [ctypes.c_int]
        self._lib = lib

    def version(self) -> tuple[int, int]:
        major, minor = ctypes.c_int(), ctypes.c_int()
        self._check(self._lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "version")
        return major.value, minor.value

    def supported_archs(self) -> list[int]:
        """The compute capabilities this NVRTC compiles for (80 for sm_80, ...)."""
        n = ctypes.c_int()
        self._check(self._lib.nvrtcGetNumSupportedArchs(ctypes.byref(n)), "archs")
        archs = (ctypes.c_int * n.value)()
        self._check(self._lib.nvrtcGetSupportedArchs(archs), "archs")
        return list(archs)

    def _check(self, status: int, what: str) -> None:
        if status != 0:
            text = self._lib.nvrtcGetErrorString(status).decode(errors="replace")
            raise CompileError(f"nvrtc {what}: {text} ({status})")

    def ptx(self, source: str, name: str, options: list[str] | tuple[str, ...] = ()) -> str:
        """Compile ``source`` (named ``name`` in messages) with NVRTC ``options`` to PTX."""
        lib = self._lib
        prog = ctypes.c_void_p()
        self._check(
            lib.nvrtcCreateProgram(
                ctypes.byref(prog), source.encode(), name.encode(), 0, None, None
            ),
            "create",
        )
        try:
            opts = (ctypes.c_char_p * len(options))(*(o.encode() for o in options))
            status = lib.nvrtcCompileProgram(prog, len(options), opts)
            if status != 0:
                raise CompileError(f"{name}: {self._log(prog)}".rstrip())
            size = ctypes.c_size_t()
            self._check(lib.nvrtcGetPTXSize(prog, ctypes.byref(size)), "PTX size")
            buf = ctypes.create_string_buffer(size.value)
            self._check(lib.nvrtcGetPTX(prog, buf), "PTX")
            return buf.value.decode()
        finally:
            lib.nvrtcDestroyProgram(ctypes.byref(prog))

    def _log(self, prog: ctypes.c_void_p) -> str:
        size = ctypes.c_size_t()
        self._lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        buf = ctypes.create_string_buffer(max(size.value, 1))
        self._lib.nvrtcGetProgramLog(prog, buf)
        return buf.value.decode(errors="replace")
