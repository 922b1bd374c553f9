"""Every CUDA kernel compiles with NVRTC for sm_80 and sm_90, on a machine without a GPU.

NVRTC comes from the ``nvidia-cuda-nvrtc`` wheel (a test dependency, setup.cfg) and is loaded
through ctypes (bankml/engine_cupy/nvrtc.py); no CuPy, no driver. The PTX must hold each entry
point for the right target and no fused f32 multiply-add (the twins round every operation
apart: cuda_twins.py). Without libnvrtc the tests are skipped, saying why.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bankml.engine_cupy import cuda_kernels, cuda_twins, nvrtc

ROOT = Path(__file__).resolve().parent.parent
LIB = nvrtc.find_library()
pytestmark = pytest.mark.skipif(
    LIB is None,
    reason="no libnvrtc: `pip install nvidia-cuda-nvrtc` (make test-deps) or set BANKML_NVRTC",
)


@pytest.fixture(scope="module")
def compiler() -> nvrtc.Compiler:
    assert LIB is not None
    return nvrtc.Compiler(LIB)


@pytest.fixture(scope="module")
def compile_only_report(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """scripts/gpu-check.sh --compile-only, run once: its one JSON line (the venv it uses
    already finds libnvrtc, so it installs nothing)."""
    venv = tmp_path_factory.mktemp("venv")
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)
    env = {**os.environ, "VENV": str(venv), "BANKML_NVRTC": str(LIB)}
    run = subprocess.run(
        [str(ROOT / "scripts" / "gpu-check.sh"), "--compile-only"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_every_kernel_compiles_for_sm80_and_sm90(
    compiler: nvrtc.Compiler, compile_only_report: dict
) -> None:
    assert {80, 90} <= set(compiler.supported_archs())
    assert compile_only_report["compiled"] == len(cuda_kernels.KERNELS), compile_only_report
    # --fmad=false: every rounding where the source has it
    assert compile_only_report["fma_f32"] == 0, compile_only_report
    # one PTX looked at whole: the target and the entry point's parameters
    kernel = cuda_kernels.KERNELS[1]
    ptx = compiler.ptx(kernel.code(), kernel.source, cuda_kernels.options("sm_90"))
    assert ".target sm_90" in ptx and f".visible .entry {kernel.name}(" in ptx
    assert "dp4a.s32.s32" in ptx  # the integer dot products
    # the decode step's and the prefill's e^x is exp_rn's IEEE operations, not the hardware's
    for name in ("attn_decode_f16", "swiglu_q8_1", "attn_prefill_f16", "swiglu_f16"):
        kernel = next(k for k in cuda_kernels.KERNELS if k.name == name)
        ptx = compiler.ptx(kernel.code(), kernel.source, cuda_kernels.options("sm_80"))
        assert f".visible .entry {name}(" in ptx and "ex2.approx" not in ptx
        assert "fma.rn.f32" not in ptx


def test_every_source_is_a_kernel() -> None:
    on_disk = sorted(p.name for p in cuda_kernels.SOURCE_DIR.glob("*.cu"))
    assert on_disk == sorted({k.source for k in cuda_kernels.KERNELS})
    # every type the twins model has its kernel, and no other
    assert sorted(k.qtype for k in cuda_kernels.KERNELS if k.qtype) == sorted(
        cuda_twins.BLOCK_TYPES
    )


def test_a_broken_source_gives_nvrtc_log(compiler: nvrtc.Compiler) -> None:
    with pytest.raises(nvrtc.CompileError, match=r"broken\.cu.*undefined"):
        compiler.ptx(
            'extern "C" __global__ void k() { undefined_name(); }',
            "broken.cu",
            ["--gpu-architecture=sm_80"],
        )


def test_compile_only_script(compile_only_report: dict) -> None:
    """scripts/gpu-check.sh --compile-only: one JSON line, every kernel compiled."""
    n = len(cuda_kernels.KERNELS)
    report = compile_only_report
    assert report["kernels"] == n and report["compiled"] == n, report
    assert report["archs"] == ["sm_80", "sm_90"] and report["failures"] == []
