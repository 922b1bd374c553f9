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


class F16Accumulator:
    """An f16 accumulator updated in place, as ggml's ``ggml_vec_scale_f16``/``ggml_vec_mad_f16``:
    each update is computed in f32 and rounded to f16.

    NumPy converts f32 to f16 one element at a time (about 7 ns each, ten times an f32 add), so
    on the CPU the accumulator is an f32 array kept on the f16 grid by five f32/uint32
    operations without a conversion: x + M − M, where M = 1.5·2^(e+13) for x's binade 2^e
    (at least 1.5·2^-1, f16's subnormal spacing), rounds x to f16's spacing there, ties to
    even. That is exact below f16's largest value, 65504; past it ggml's accumulator would
    become inf and this one keeps rounding on the grid. CuPy converts in one kernel, so there it is an
    f16 array updated by mixed-type ufuncs (one kernel per update).
    """

    # exponent bits of an f32, and what turns 2^e into 1.5 * 2^(e+13): added to x, the f32 sum's
    # last bit is 2^(e-10), the spacing of f16 in x's binade
    _EXPONENT = numpy.uint32(0x7F800000)
    _MAGIC_OFFSET = numpy.uint32((13 << 23) | 0x400000)
    # below 2^-14 f16 is subnormal with spacing 2^-24: the magic number stops at 1.5 * 2^-1
    _SUBNORMAL_MAGIC = numpy.float32(0.75).view(numpy.uint32)

    def __init__(self, xp: ModuleType, shape: tuple[int, ...]):
        self.xp = xp
        self._native = xp is numpy
        if self._native:
            self.acc = numpy.zeros(shape, numpy.float32)
            self._bits = self.acc.view(numpy.uint32)
            self._magic_bits = numpy.empty(shape, numpy.uint32)
            self._magic = self._magic_bits.view(numpy.float32)
        else:
            self.acc = xp.zeros(shape, xp.float16)

    def walk(self, terms: Any, factors: Any, scaled: list[bool]) -> None:
        """For each step t: acc = f16(acc * factors[t]) where scaled[t], then acc = f16(acc + terms[t]).

        The loop of a decoding step (one pass per attended cell and layer), so on NumPy it is
        written out with local names: a method call per update cost a fifth of the time.
        """
        acc, xp = self.acc, self.xp
        if not self._native:
            for t in range(len(scaled)):
                if scaled[t]:
                    xp.multiply(acc, factors[t], out=acc, casting="same_kind")
                xp.add(acc, terms[t], out=acc, casting="same_kind")
            return
        bits, magic_bits, magic = self._bits, self._magic_bits, self._magic
        # the constants as lane-shaped arrays: a ufunc call converting a NumPy scalar took a
        # third longer than the work on a few hundred lanes
        exponent, offset, low = (numpy.full(acc.shape, c, numpy.uint32) for c in (
            self._EXPONENT, self._MAGIC_OFFSET, self._SUBNORMAL_MAGIC))
        add, sub, mul, band, top = (numpy.add, numpy.subtract, numpy.multiply, numpy.bitwise_and,
                                    numpy.maximum)
        for t, rescaled in enumerate(scaled):
            if rescaled:
                mul(acc, factors[t], out=acc)
                band(bits, exponent, out=magic_bits)  # round to f16 (see the class)
                add(magic_bits, offset, out=magic_bits)
                top(magic_bits, low, out=magic_bits)
                add(acc, magic, out=acc)
                sub(acc, magic, out=acc)
            add(acc, terms[t], out=acc)
            band(bits, exponent, out=magic_bits)  # round to f16 again
            add(magic_bits, offset, out=magic_bits)
            top(magic_bits, low, out=magic_bits)
            add(acc, magic, out=acc)
            sub(acc, magic, out=acc)

    def value(self) -> Any:
        """The accumulator as float32."""
        return self.acc if self._native else self.acc.astype(self.xp.float32)
