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
        import cupy  # type: ignore[import-not-found]
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
