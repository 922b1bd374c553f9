"""bench/kernel_check.py (each CUDA kernel against its twin on a GPU), run through the fake CuPy
of tests/test_cuda_loader.py: kernels that compute their twins' bits are reported identical, and
one that differs in a single bit of one row is reported with that row; bench/gpu_check.py adds
the report on a CUDA device and says why not on the CPU."""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy
import pytest

from bankml.engine_cupy import backend
from bankml.engine_cupy import cuda_twins as tw
from bench import gpu_check, kernel_check
from tests.test_cuda_loader import FakeCupy, FakeKernel


def test_identical_kernels_are_reported_identical(default_model: Path) -> None:
    report = kernel_check.kernels_vs_twins(FakeCupy(), default_model, rows=64, cols=512)  # type: ignore[arg-type]
    assert report["quantize_q8_1"] == {"identical": True, "n": 16 * 36}
    assert sorted(report["generated"]) == sorted(tw.BLOCK_TYPES)
    assert {q: r["identical"] for q, r in report["generated"].items()} == dict.fromkeys(
        tw.BLOCK_TYPES, True
    )
    # the default model's types: its Q8_0 embedding and Q4_1 layers
    assert {q: r["tensor"] for q, r in report["model"].items()} == {
        "Q8_0": "token_embd.weight",
        "Q4_1": "blk.0.ffn_down.weight",
    }
    assert report["identical"] == report["checked"] == 1 + len(tw.BLOCK_TYPES) + 2


def test_a_kernel_one_bit_off_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    call = FakeKernel.__call__

    def one_bit_off(self: FakeKernel, grid: tuple, block: tuple, args: tuple) -> None:
        call(self, grid, block, args)
        if self.name == "mmvq_q4_1":
            dst = args[2]
            dst[3:4] = (dst[3:4].view(numpy.uint32) ^ numpy.uint32(1)).view(numpy.float32)

    monkeypatch.setattr(FakeKernel, "__call__", one_bit_off)
    report = kernel_check.kernels_vs_twins(FakeCupy(), None, rows=64, cols=512)  # type: ignore[arg-type]
    q4_1 = report["generated"]["Q4_1"]
    assert q4_1["identical"] is False and q4_1["differing"] == 1
    assert 0 < q4_1["max_rel_diff"] < 1e-6
    assert report["identical"] == report["checked"] - 1 and "model" not in report


def test_gpu_check_adds_the_kernel_report_on_cuda_only(
    monkeypatch: pytest.MonkeyPatch, default_model: Path
) -> None:
    cpu = gpu_check.kernel_report(argparse.Namespace(device="cpu", model=default_model))
    assert cpu == {"skipped": "the CUDA kernels need CuPy and a GPU (device cpu)"}
    monkeypatch.setattr(backend, "_cupy_with_gpu", lambda: (FakeCupy(), ""))
    real = kernel_check.kernels_vs_twins
    monkeypatch.setattr(
        kernel_check, "kernels_vs_twins", lambda cp, model: real(cp, model, rows=32, cols=256)
    )
    cuda = gpu_check.kernel_report(argparse.Namespace(device="cuda", model=default_model))
    assert cuda["identical"] == cuda["checked"] and sorted(cuda["model"]) == ["Q4_1", "Q8_0"]
    # a failing check leaves its traceback, and the rest of the GPU check goes on
    monkeypatch.setattr(backend, "_cupy_with_gpu", lambda: (None, "CuPy sees no GPU"))
    failed = gpu_check.kernel_report(argparse.Namespace(device="cuda", model=default_model))
    assert "CuPy sees no GPU" in failed["error"]["kernels"]
