"""bankml/engine_cupy/cuda_loader.py without a GPU: a fake CuPy whose kernels are the twins.

The fake's ``RawModule`` records the code and options it is given, and its kernels check each
launch against what the CUDA source expects (grid and block shapes, argument types, sizes of
the buffers) before computing the twin's result into the output buffer. So the loader's wiring
(which kernel, which launch geometry, which byte layout between the two kernels) is checked
here; the kernels' own arithmetic is the twins' (tests/test_cuda_twins.py), and that they agree
on a device only a GPU run shows.
"""

from __future__ import annotations

import types
from typing import Any

import numpy
import pytest
from gguf import GGMLQuantizationType as T

from bankml.engine_cupy import cuda_kernels, cuda_loader
from bankml.engine_cupy import cuda_twins as tw
from tests.tiny_models import _matrix


class FakeKernel:
    def __init__(self, fake: FakeCupy, name: str) -> None:
        self.fake, self.name = fake, name

    def __call__(self, grid: tuple, block: tuple, args: tuple) -> None:
        self.fake.launches.append((self.name, grid, block))
        assert all(isinstance(a, (numpy.ndarray, numpy.int32)) for a in args), args
        if self.name == "quantize_q8_1":
            x, y, n = args
            assert len(grid) == 1 and len(block) == 1 and block[0] % 32 == 0
            assert grid[0] * block[0] >= n > (grid[0] - 1) * block[0]  # every value, no spare block
            assert x.dtype == numpy.float32 and y.dtype == numpy.uint8 and y.size == n // 32 * 36
            y[:] = tw.quantize_q8_1(x[:n]).to_bytes()
            return
        qtype = self.name.removeprefix("mmvq_").upper()
        w, y, dst, ncols = args
        assert block == (32, tw.NWARPS) and grid == (w.shape[0],)  # one row per thread block
        assert w.dtype == numpy.uint8 and w.flags.c_contiguous
        bt = tw.BLOCK_TYPES[qtype]
        assert w.shape[1] == ncols // bt.values * bt.block_bytes
        assert dst.dtype == numpy.float32 and dst.shape == (w.shape[0],)
        raw = y.reshape(-1, 36)
        q8 = tw.Q8_1(
            raw[:, 4:].view(numpy.int8),
            raw[:, 0:2].copy().view("<f2")[:, 0],
            raw[:, 2:4].copy().view("<f2")[:, 0],
        )
        dst[:] = tw.mmvq(qtype, w, q8)


class FakeCupy(types.SimpleNamespace):
    def __init__(self) -> None:
        super().__init__(modules=[], launches=[])

    def RawModule(self, code: str, options: tuple) -> Any:  # noqa: N802 (CuPy's name)
        self.modules.append((code, options))
        fake = self

        class Module:
            def get_function(self, name: str) -> FakeKernel:
                assert 'extern "C" __global__ void' in code and name in code
                return FakeKernel(fake, name)

        return Module()

    def empty(self, shape: Any, dtype: Any) -> numpy.ndarray:
        return numpy.full(shape, 0xAB if dtype == numpy.uint8 else numpy.nan, dtype)

    def asarray(self, a: Any) -> numpy.ndarray:  # host to "device": a copy
        return numpy.array(a)

    def asnumpy(self, a: numpy.ndarray) -> numpy.ndarray:
        return numpy.array(a)


@pytest.mark.parametrize("qtype", tuple(tw.BLOCK_TYPES))
def test_matvec_launches_the_twins_arithmetic(qtype: str) -> None:
    rng = numpy.random.default_rng(2)
    w, _ = _matrix(rng, 40, 2560, T[qtype], 0.05)
    x = rng.normal(size=2560).astype(numpy.float32)
    fake = FakeCupy()
    kernels = cuda_loader.CudaKernels(fake)  # type: ignore[arg-type]
    got = kernels.matvec(qtype, numpy.ascontiguousarray(w), x)
    assert got.tobytes() == tw.mmvq(qtype, w, x).tobytes()
    assert fake.launches == [
        ("quantize_q8_1", (10,), (256,)),
        (f"mmvq_{qtype.lower()}", (40,), (32, 4)),
    ]
    # compiled once each, from the package's source with its header written in, the twins' options
    assert len(fake.modules) == 2
    code, options = fake.modules[1]
    assert "#include" not in code and "mmvq_row" in code and f"mmvq_{qtype.lower()}" in code
    assert options == tuple(cuda_kernels.options()) and "--fmad=false" in options
    kernels.matvec(qtype, numpy.ascontiguousarray(w), x)
    assert len(fake.modules) == 2 and len(fake.launches) == 4


def test_wrong_shapes_are_refused_before_a_launch() -> None:
    fake = FakeCupy()
    kernels = cuda_loader.CudaKernels(fake)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="multiple of 32"):
        kernels.quantize_q8_1(numpy.zeros(40, numpy.float32))
    w = numpy.zeros((4, 18 * 4), numpy.uint8)
    y = numpy.zeros(36 * 4, numpy.uint8)
    with pytest.raises(ValueError, match="do not hold"):
        kernels.mmvq("Q4_1", w, y, 128)
    with pytest.raises(ValueError, match="q8_1 blocks"):
        kernels.mmvq("Q4_0", w, y[:36], 128)
    with pytest.raises(ValueError, match="no one-row product kernel for IQ4_NL"):
        kernels.mmvq("IQ4_NL", w, y, 128)
    assert fake.launches == [] and fake.modules == []
