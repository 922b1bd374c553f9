"""The fused decode step (exact_decode) gives the general path's bits.

Each decode step runs twice from the same state, once through ``exact_decode.DecodePlan.step``
(``model.fused_decode = True``) and once through the general per-op forward pass, on two caches
filled by the same prompt: the logits and the K/V stores must be equal byte for byte. The
general path is what the llama-server agreement tests (test_forward.py) check, so this carries
their agreement over to the fast path.
"""

from __future__ import annotations

from pathlib import Path

import numpy
import pytest
from gguf import GGMLQuantizationType as T

from bankml.engine_cupy.kernels import exact_decode
from bankml.engine_cupy.kernels.exact_kquants import KMatrixStack, KQuantMatrix
from bankml.engine_cupy.model import Model
from tests.engine_checks import token_ids
from tests.tiny_models import FAST_SPECS, TinySpec, write_tiny_model


def decode_both_ways(model: Model, prompt: list[int], steps: int, n_ctx: int) -> int:
    """Decode ``steps`` tokens after ``prompt`` (in micro-batches of 512) through both paths,
    comparing every step; returns how many steps the fused path really took."""
    fused_cache, general_cache = model.new_cache(n_ctx), model.new_cache(n_ctx)
    model.fused_decode = False
    for i in range(0, len(prompt), 512):
        logits = model.forward(prompt[i : i + 512], fused_cache)
        model.forward(prompt[i : i + 512], general_cache)
    taken = 0
    try:
        for _ in range(steps):
            token = int(numpy.argmax(logits))
            model.fused_decode = True
            fused = model.forward([token], fused_cache)
            taken += model._decode_plan() is not None and fused_cache.fused_decode
            model.fused_decode = False
            general = model.forward([token], general_cache)
            assert fused.tobytes() == general.tobytes(), (
                f"step at position {fused_cache.n_tokens - 1}: largest difference "
                f"{numpy.abs(fused - general).max()}"
            )
            logits = general
        if fused_cache.cells is not None:  # the same cells chosen, the same positions held
            assert (fused_cache.cells.pos == general_cache.cells.pos).all()
        for il in range(model.n_layer):
            stores = [fused_cache.f16_cells(il), general_cache.f16_cells(il)]
            if fused_cache.in_ring(il):
                stores += [fused_cache.ring_f16_cells(il)[:2], general_cache.ring_f16_cells(il)[:2]]
            for a, b in zip(stores[0::2], stores[1::2]):
                for x, y in zip(a, b):
                    assert x.tobytes() == y.tobytes(), f"layer {il}: the K/V stores differ"
    finally:
        model.fused_decode = True
    return taken


def test_default_model_short_context(default_engine: Model) -> None:
    """Few cells: each head walks them in one chunk, on one thread."""
    assert decode_both_ways(default_engine, token_ids(default_engine, 5), 4, 64) == 4


def test_default_model_split_attention(default_engine: Model) -> None:
    """300 cells (n_kv 512): ggml's per-thread split of the cells, the tasks on two threads."""
    assert decode_both_ways(default_engine, token_ids(default_engine, 300), 3, 320) == 3


@pytest.mark.parametrize("spec", FAST_SPECS, ids=lambda s: s.name)
def test_tiny_models(spec: TinySpec, tiny_dir: Path, default_model: Path) -> None:
    model = Model.load(
        write_tiny_model(tiny_dir / f"{spec.name}.gguf", spec, default_model),
        device="cpu",
        progress=False,
    )
    # 20 tokens cross gemma3's window of 8: its sliding layers hide the far cells
    assert decode_both_ways(model, token_ids(model, 20), 4, 40) == 4


def test_kquant_stack(tiny_dir: Path, default_model: Path) -> None:
    """Q/K/V as a stack of K-quant parts of different arithmetics (as a Q4_K_M file's Q4_K and
    Q6_K parts): Q and V repacked (gemv), K not (vec_dot); the parts side by side, the bias
    of each part its own."""
    spec = TinySpec("qwen2", T.Q4_K)
    model = Model.load(
        write_tiny_model(tiny_dir / f"{spec.name}.gguf", spec, default_model),
        device="cpu",
        progress=False,
    )
    for layer in model.weights.layers:
        (linear,) = layer.qkv
        fused, start, parts = linear.exact, 0, []
        for (_, width), repacked in zip(linear.parts, (True, False, True)):
            parts.append(
                KQuantMatrix(
                    fused.raw[start : start + width], T.Q4_K, width, fused.n_in, repacked=repacked
                )
            )
            start += width
        linear.exact = KMatrixStack(parts)
    plan = exact_decode.DecodePlan.build(model.hp, model.weights, None)
    assert plan is not None and sum(p[0] != exact_decode._ABSENT for p in plan.layers[0][1]) == 3
    assert decode_both_ways(model, token_ids(model, 20), 4, 40) == 4


def test_q4_k_m_model(default_model_q4_k_m: Path) -> None:
    """llama.cpp's Q4_K_M of the default model: Q5_0 and Q8_0 V matrices stacked with Q5_0
    Q/K (576 wide rows cannot be K-quants), Q4_K (repacked) and Q6_K down matrices."""
    model = Model.load(default_model_q4_k_m, device="cpu", progress=False)
    assert decode_both_ways(model, token_ids(model, 20), 3, 40) == 3


def test_sliding_window_ring(tiny_dir: Path, default_model: Path) -> None:
    """gemma3 with a context larger than llama.cpp's SWA cache (768 cells for 1000): a prompt
    of 780 wraps the ring, then 40 decode steps store into reused cells and attend over the
    ring's cells in cell order, with its mask and n_kv, as the general path does."""
    spec = TinySpec("gemma3", T.Q5_0, n_layer=4)
    model = Model.load(
        write_tiny_model(tiny_dir / f"{spec.name}.gguf", spec, default_model),
        device="cpu",
        progress=False,
    )
    assert model.new_cache(1000).cells.size == 768
    assert any(model.new_cache(1000).in_ring(il) for il in range(model.n_layer))
    assert decode_both_ways(model, token_ids(model, 780), 40, 1000) == 40
