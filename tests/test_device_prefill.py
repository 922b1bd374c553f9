"""The GPU prefill (bankml/engine_cupy/device_prefill.py) and the Q5_K one-row product without a
GPU: the kernels' NumPy twins run through the strict CuPy stand-in (tests/fake_cupy_kernels.py),
against the CPU's exact path and against the decode step fed one prompt token at a time.

What this cannot show: that each CUDA kernel gives its twin's bits on a device, cuBLAS's own
order of additions, and the speed (scripts/gpu-check.sh on a GPU).
"""

from __future__ import annotations

from pathlib import Path

import numpy
import pytest
from gguf import GGMLQuantizationType as T

from bankml.engine_cupy.model import Model
from tests.test_device_step import PROMPT, _device_step, _top10_diff
from tests.tiny_models import TinySpec, write_tiny_model


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory: pytest.TempPathFactory, default_model: Path) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("device_prefill")
    specs = [
        TinySpec("llama", T.Q5_K, tied=False, out_type=T.Q6_K),  # as Q5_K_M files pair them
    ]
    return {s.name: write_tiny_model(out / f"{s.name}.gguf", s, default_model) for s in specs}


def test_q5_k_decode_step_against_the_exact_path(tiny_models: dict[str, Path]) -> None:
    """Q5_K layers (mmvq_q5_k) and a Q6_K output, one decode step per prompt token: the top-1
    token the exact path's, the top-10 log-probabilities within test_device_step's bound."""
    path = tiny_models["llama-Q5_K-untied"]
    cp, step = _device_step(path)
    assert {m.qtype for m in (step.w.layers[0].q, step.w.layers[1].down)} == {"Q5_K"}
    seq = step.new_sequence(32)
    for token in PROMPT:
        step.set_token(seq, token)
        step.step(seq)
    assert "mmvq_q5_k" in {name for name, _, _ in cp.launches}
    model = Model.load(path, device="cpu", progress=False)
    want = model.forward(PROMPT, model.new_cache(32))
    got = step.host_logits()
    assert int(numpy.argmax(got)) == int(numpy.argmax(want))
    diff = _top10_diff(got, want)
    assert 0 < diff < 1.0, diff
