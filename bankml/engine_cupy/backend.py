"""The array module the engine computes with: NumPy on the CPU, CuPy on a GPU.

Every array operation in the engine goes through the module returned here (called ``xp``), so
the CPU and GPU paths are one code path. Only the final logits cross back to the host.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import numpy

DEVICES = ("auto", "cpu", "cuda")


class DeviceUnavailable(RuntimeError):
    """A GPU was asked for and none can be used; the message says why."""


def _cupy_with_gpu() -> tuple[ModuleType | None, str]:
    """CuPy if it imports and sees at least one GPU, else (None, the reason)."""
    try:
        import cupy
    except Exception as err:  # ImportError, or a CUDA library that fails to load
        return None, f"CuPy is not importable ({err}); install bankml[cuda]"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as err:
        return None, f"CuPy sees no usable GPU ({err})"
    if count < 1:
        return None, "CuPy sees no GPU"
    return cupy, ""


def get_xp(device: str = "auto") -> ModuleType:
    """The array module for ``device``: "auto" (CuPy when a GPU is usable), "cpu" or "cuda"."""
    if device not in DEVICES:
        raise ValueError(f"device {device!r}: expected one of {', '.join(DEVICES)}")
    if device == "cpu":
        return numpy
    cupy, reason = _cupy_with_gpu()
    if cupy is not None:
        return cupy
    if device == "cuda":
        raise DeviceUnavailable(f"device 'cuda' was asked for but {reason}")
    return numpy


def to_host(array: Any) -> numpy.ndarray:
    """A NumPy copy (or view) of an array of either module."""
    if isinstance(array, numpy.ndarray):
        return array
    return array.get()  # CuPy


def device_name(xp: ModuleType) -> str:
    return "cpu" if xp is numpy else "cuda"


class BlasThreads:
    """Sets the CPU BLAS thread count between products (threadpoolctl; a no-op without it).

    OpenBLAS's threads wait for work by spinning and yielding; a one-row product (a decoding
    step) is too small to share, and on a machine whose other core is busy two threads made
    decoding more than ten times slower than one (measured: 0.7 against 10 tokens/s).
    """

    def __init__(self, xp: ModuleType):
        self._controllers: list[Any] = []
        self._current: int | None = None
        if xp is not numpy:
            return
        try:
            from threadpoolctl import ThreadpoolController
        except ImportError:
            return
        self._controllers = ThreadpoolController().select(user_api="blas").lib_controllers
        self.default = max((c.num_threads for c in self._controllers), default=1)

    def set(self, threads: int | None) -> None:
        """Use ``threads`` BLAS threads from now on (None: as many as at start)."""
        if not self._controllers:
            return
        wanted = threads or self.default
        if wanted != self._current:
            for controller in self._controllers:
                controller.set_num_threads(wanted)
            self._current = wanted
