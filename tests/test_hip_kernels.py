"""Every kernel's source compiles for AMD GPUs (HIP), on a machine without one.

No ROCm compiler (hipcc, hiprtc) installs from PyPI, so the sources are compiled with the clang
of the ``ziglang`` wheel (a test dependency, setup.cfg), which has LLVM's AMDGPU target, in its
HIP mode for the device only, with ``cuda_kernels.hip_options()`` (what CuPy's HIP build hands
hiprtc) and ``tests/hip_runtime_stub.h`` standing in for the HIP runtime header hiprtc puts
before a source. Checked, for a data-centre GPU of each of the last two generations (gfx90a,
gfx942) and a desktop one of each (gfx1030, gfx1100):

- every source compiles to AMDGPU code, and every kernel of ``cuda_kernels.KERNELS`` is an
  entry point of its source's code;
- no multiply-add is fused and no division or square root is approximated (the LLVM IR has no
  ``contract``, ``afn`` or ``arcp`` flag, no ``fmuladd``/``fma`` call and no ``!fpmath``), so
  every rounding is where the twins put it, as ``--fmad=false`` keeps it on CUDA;
- the products' integer dot products are AMD's dot instruction where the GPU has one, as
  ggml's HIP build takes it.

What this cannot show: that HIP's own headers (hiprtc's) accept the sources as this stand-in
does, and that a kernel gives its twin's bits on the GPU; that needs a ROCm machine
(scripts/gpu-check.sh --rocm). Without the wheel the tests are skipped, saying why.
"""

from __future__ import annotations

import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from bankml.engine_cupy import cuda_kernels

STUB = Path(__file__).resolve().parent / "hip_runtime_stub.h"
TARGETS = ("gfx90a", "gfx942", "gfx1030", "gfx1100")
# the dot instruction the products' __dp4a becomes on each target
DOT = {
    "gfx90a": "v_dot4c_i32_i8",
    "gfx942": "v_dot4c_i32_i8",
    "gfx1030": "v_dot4c_i32_i8",
    "gfx1100": "v_dot4_i32_iu8",
}
SOURCES = sorted({k.source for k in cuda_kernels.KERNELS})

try:
    import ziglang  # noqa: F401
except ImportError:
    pytestmark = pytest.mark.skip(reason="no ziglang wheel: `pip install ziglang` (make test-deps)")


def clang(
    source: Path, target: str, out: Path, *flags: str, options: list[str] | None = None
) -> str:
    """Compile ``source`` for ``target`` (device only) into ``out``; clang's messages."""
    run = subprocess.run(
        [sys.executable, "-m", "ziglang", "clang", "-x", "hip", f"--offload-arch={target}"]
        + ["--offload-device-only", "-nogpulib", "-nogpuinc", "-O3", "-include", str(STUB)]
        + ["-Wno-pragma-once-outside-header", "-S", *flags, str(source), "-o", str(out)]
        + (cuda_kernels.hip_options() if options is None else options),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, f"{source.name} for {target}:\n{run.stderr}"
    return run.stderr


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each source as CuPy compiles it: its local headers written in (Kernel.code)."""
    tmp = tmp_path_factory.mktemp("hip")
    by_source = {k.source: k for k in cuda_kernels.KERNELS}
    out = {}
    for name in SOURCES:
        out[name] = tmp / f"{name}.hip"
        out[name].write_text(by_source[name].code())
    return out


@pytest.fixture(scope="module")
def assembly(sources: dict[str, Path]) -> dict[tuple[str, str], str]:
    """Every source's AMDGPU assembly for every target."""
    jobs = [(name, target) for name in SOURCES for target in TARGETS]

    def build(job: tuple[str, str]) -> str:
        name, target = job
        out = sources[name].with_suffix(f".{target}.s")
        clang(sources[name], target, out)
        return out.read_text()

    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip(jobs, pool.map(build, jobs), strict=True))


@pytest.fixture(scope="module")
def llvm_ir(sources: dict[str, Path]) -> dict[str, str]:
    """Every source's optimised LLVM IR for gfx942 (the float operations are the target's
    choice no more than the source's: the flags are the same for every target)."""
    ir = {}
    for name in SOURCES:
        out = sources[name].with_suffix(".ll")
        clang(sources[name], "gfx942", out, "-emit-llvm")
        ir[name] = out.read_text()
    return ir


def test_every_kernel_is_an_entry_point_for_every_target(
    assembly: dict[tuple[str, str], str],
) -> None:
    for kernel in cuda_kernels.KERNELS:
        for target in TARGETS:
            code = assembly[(kernel.source, target)]
            assert re.search(rf"^\s*\.globl\s+{kernel.name}$", code, re.M), (kernel.name, target)
            assert f"{kernel.name}.kd" in code, (kernel.name, target)  # its kernel descriptor


FUSED = re.compile(r"\b(contract|afn|arcp|fast|reassoc)\b|llvm\.fmuladd|llvm\.fma\.|!fpmath")


def test_no_operation_is_fused_or_approximated(llvm_ir: dict[str, str]) -> None:
    float_ops = 0
    for name, ir in llvm_ir.items():
        lines = [line for line in ir.splitlines() if not line.startswith(("attributes", "!"))]
        found = [line.strip() for line in lines if FUSED.search(line)]
        assert not found, (name, found[:3])
        float_ops += sum(bool(re.search(r"= f(add|mul|div|sub) float", x)) for x in lines)
    assert float_ops > 500  # the check read the kernels' arithmetic, not an empty file


def test_the_fused_check_sees_a_contraction(tmp_path: Path) -> None:
    """The check above fails where clang may fuse: a multiply-add compiled with HIP's usual
    contraction and no pragma against it."""
    src = tmp_path / "madd.hip"
    src.write_text('extern "C" __global__ void madd(float *x) { x[0] = x[1] * x[2] + x[3]; }\n')
    out = tmp_path / "madd.ll"
    clang(src, "gfx942", out, "-emit-llvm", options=["-ffp-contract=fast"])
    assert FUSED.search(out.read_text())


def test_the_products_use_the_dot_instruction(assembly: dict[tuple[str, str], str]) -> None:
    for kernel in cuda_kernels.KERNELS:
        if kernel.qtype is None or not kernel.name.startswith("mmvq_"):
            continue
        for target in TARGETS:
            code = assembly[(kernel.source, target)]
            assert DOT[target] in code, (kernel.name, target)
