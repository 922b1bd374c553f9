"""Model.decode_batch: each row is bit for bit its own one-token forward.

Every step runs twice from the same state: once as one ``decode_batch`` over several caches
(different lengths and sizes), once as ``forward([token], cache)`` on a second cache filled
with the same prompt, row by row. The logits of each row and every cache's K/V stores (the
sliding-window ring's too) must be equal byte for byte; the one-row forward is what
test_decode_fast_path.py and the llama-server agreement tests hold to llama-server's bits.
"""

from __future__ import annotations

from pathlib import Path

import numpy
import pytest
from gguf import GGMLQuantizationType as T

from bankml.engine_cupy.kernels import exact_batch, exact_decode
from bankml.engine_cupy.model import Model
from tests.engine_checks import Rows, kv_bytes, tiny
from tests.tiny_models import FAST_SPECS, TinySpec, write_tiny_model


@pytest.fixture()
def batch_runs(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The row counts exact_batch ran (so a test knows the batched path really ran)."""
    runs: list[int] = []
    run = exact_batch.BatchStep.run

    def counting(self: exact_batch.BatchStep, x: numpy.ndarray, *args: object) -> numpy.ndarray:
        runs.append(x.shape[0])
        return run(self, x, *args)

    monkeypatch.setattr(exact_batch.BatchStep, "run", counting)
    return runs


def test_default_model(default_engine: Model, batch_runs: list[int]) -> None:
    """Rows at 5, 40, 300 (n_kv 512: ggml's split attention, on two threads), 12 and more
    cells, in caches of different sizes; B = 1..4 and back, then 8 and 9 (the products take
    their activation rows eight, four and two at a time, then one), each row's own
    position."""
    rows = Rows(default_engine, [5, 40, 300, 12, 1, 2, 3, 7, 20], [64, 128, 320, 40] + [32] * 5)
    for b in (1, 2, 3, 4, 4, 2, 9, 8):
        rows.step(list(range(b)))
    rows.step([3, 0, 2])  # any order
    assert batch_runs == [2, 3, 4, 4, 2, 9, 8, 3]


@pytest.mark.parametrize("spec", FAST_SPECS, ids=lambda s: s.name)
def test_tiny_models(
    spec: TinySpec, tiny_dir: Path, default_model: Path, batch_runs: list[int]
) -> None:
    """Every family the fused step takes (exact_matmul's types, the K-quants, IQ4_NL/XS, the
    grid and TQ types), biases, Q/K norms, gemma3's window (8, crossed by 20 and 40); 2 to 9
    rows (each product's groups of eight, four and two rows and the single ones)."""
    model = tiny(spec, tiny_dir, default_model)
    rows = Rows(model, [5, 20, 40, 3, 1, 9, 14, 2, 30], [64, 48, 64, 16] + [48] * 5)
    for b in (4, 2, 3, 9, 5):
        rows.step(list(range(b)))
    assert batch_runs == [4, 2, 3, 9, 5]


def test_sliding_window_ring(tiny_dir: Path, default_model: Path, batch_runs: list[int]) -> None:
    """gemma3 rows past llama.cpp's 768-cell SWA ring (each step into a reused cell) beside a
    short one in position order."""
    model = tiny(TinySpec("gemma3", T.Q5_0, n_layer=4), tiny_dir, default_model)
    rows = Rows(model, [780, 10, 800], [1000, 32, 1000])
    assert rows.batch[0].cells is not None and rows.batch[1].cells is None
    for _ in range(6):
        rows.step([0, 1, 2])
    assert batch_runs == [3] * 6


def test_q8_0_cache_rows_fall_back(default_engine: Model, batch_runs: list[int]) -> None:
    """A q8_0 cache's row is its own forward; the f16 rows still go together."""
    rows = Rows(default_engine, [5, 30, 9], [32, 64, 32], ["f16", "q8_0", "f16"])
    for _ in range(2):
        rows.step([0, 1, 2])
    assert batch_runs == [2, 2]
    rows.step([1, 0])  # one f16 row left: nothing to batch
    assert batch_runs == [2, 2]


def test_fused_step_off_falls_back(default_engine: Model, batch_runs: list[int]) -> None:
    rows = Rows(default_engine, [5, 7], [16, 16])
    default_engine.fused_decode = False
    try:
        rows.step([0, 1])
    finally:
        default_engine.fused_decode = True
    assert batch_runs == []


def test_model_the_plan_refuses(
    tiny_dir: Path, default_model: Path, monkeypatch: pytest.MonkeyPatch, batch_runs: list[int]
) -> None:
    monkeypatch.setattr(exact_decode.DecodePlan, "build", classmethod(lambda *a: None))
    model = tiny(TinySpec("llama", T.Q4_0), tiny_dir, default_model)
    rows = Rows(model, [4, 9], [16, 16])
    rows.step([0, 1])
    assert batch_runs == []


def test_array_backend_falls_back(
    tiny_dir: Path, default_model: Path, batch_runs: list[int]
) -> None:
    path = write_tiny_model(tiny_dir / "qwen2-array.gguf", TinySpec("qwen2", T.Q8_0), default_model)
    model = Model.load(path, device="cpu", progress=False, exact=False)
    rows = Rows(model, [4, 9, 2], [16, 16, 16])
    rows.step([0, 1, 2])
    assert batch_runs == []


def test_bad_rows_change_nothing(default_engine: Model) -> None:
    """A row that cannot step (full cache, token out of range), a cache given twice or a
    count mismatch: ValueError before any cache changes."""
    model = default_engine
    full, other = model.new_cache(4), model.new_cache(8)
    model.forward([5, 6, 7, 8], full)
    model.forward([5], other)
    before = kv_bytes(other, model.n_layer)
    for tokens, caches in (
        ([1, 2], [other, full]),
        ([1, model.n_vocab], [other, model.new_cache(8)]),
        ([1, -1], [other, model.new_cache(8)]),
        ([1, 2], [other, other]),
        ([1], [other, model.new_cache(8)]),
    ):
        with pytest.raises(ValueError):
            model.decode_batch(tokens, caches)
        assert other.n_tokens == 1 and full.n_tokens == 4
        assert kv_bytes(other, model.n_layer) == before
    assert model.decode_batch([], []).shape == (0, model.n_vocab)
