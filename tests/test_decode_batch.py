"""Model.decode_batch: each row is bit for bit its own one-token forward.

Every step runs twice from the same state: once as one ``decode_batch`` over several caches
(different lengths and sizes), once as ``forward([token], cache)`` on a second cache filled
with the same prompt, row by row. The logits of each row and every cache's K/V stores (the
sliding-window ring's too) must be equal byte for byte; the one-row forward is what
test_decode_fast_path.py and the llama-server agreement tests hold to llama-server's bits.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy
import pytest
from gguf import GGMLQuantizationType as T

from bankml.engine_cupy.kernels import exact_batch, exact_decode
from bankml.engine_cupy.kv_cache import KVCache
from bankml.engine_cupy.model import Model
from tests.test_decode_fast_path import FAST_SPECS, token_ids
from tests.tiny_models import TinySpec, write_tiny_model


def kv_bytes(cache: KVCache, n_layer: int) -> list[bytes]:
    """Every byte a decode step may write: the whole position stores (or, for q8_0, the
    positions held), the ring's stores and the sliding-window cells' bookkeeping."""
    out: list[bytes] = []
    for il in range(n_layer):
        if cache.fused_decode:
            out += [a.tobytes() for a in cache.f16_cells(il)]
            if cache.in_ring(il):  # the ring's stores, whatever the last micro-batch's size
                out += [cache._ring_k[il].tobytes(), cache._ring_v[il].tobytes()]
    if not cache.fused_decode:
        for entry in cache.snapshot():
            parts = entry if isinstance(entry, tuple) else (entry,)
            out += [numpy.ascontiguousarray(p).tobytes() for p in parts]
    for cells in (cache.cells, cache.swa):  # the ring's (or the window's) bookkeeping
        if cells is not None:
            out += [cells.pos.tobytes(), int(cells.head).to_bytes(8, "little", signed=True)]
    return out


class Rows:
    """Pairs of caches filled by the same prompts: ``batch`` advanced by decode_batch, ``single``
    by one-row forwards."""

    def __init__(
        self,
        model: Model,
        lengths: Sequence[int],
        n_ctx: Sequence[int],
        cache_types: Sequence[str | None] | None = None,
    ):
        self.model = model
        cache_types = cache_types or [None] * len(lengths)
        self.batch = [model.new_cache(c, t) for c, t in zip(n_ctx, cache_types)]
        self.single = [model.new_cache(c, t) for c, t in zip(n_ctx, cache_types)]
        self.next = []
        for row, n in enumerate(lengths):
            prompt = token_ids(model, n, seed=row)
            for i in range(0, n, 512):
                model.forward(prompt[i : i + 512], self.batch[row])
                logits = model.forward(prompt[i : i + 512], self.single[row])
            self.next.append(int(numpy.argmax(logits)))

    def step(self, rows: Sequence[int]) -> None:
        """One decode_batch over ``rows`` against a forward per row; the next tokens greedy."""
        model = self.model
        tokens = [self.next[r] for r in rows]
        batched = model.decode_batch(tokens, [self.batch[r] for r in rows])
        assert batched.shape == (len(rows), model.n_vocab) and batched.dtype == numpy.float32
        for i, r in enumerate(rows):
            self.agree(r, [tokens[i]], batched[i])

    def agree(self, r: int, tokens: list[int], got: numpy.ndarray) -> None:
        """Row r's ``tokens`` by one forward on its single twin: the same logits as ``got``
        and the same cache bytes; its next token greedy."""
        single = self.model.forward(tokens, self.single[r])
        assert got.tobytes() == single.tobytes(), (
            f"row {r} ({len(tokens)} tokens to position {self.single[r].n_tokens - 1}): "
            f"largest difference {numpy.abs(got - single).max()}"
        )
        assert self.batch[r].n_tokens == self.single[r].n_tokens
        assert kv_bytes(self.batch[r], self.model.n_layer) == kv_bytes(
            self.single[r], self.model.n_layer
        ), f"row {r}: the caches differ"
        self.next[r] = int(numpy.argmax(single))


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


@pytest.fixture(scope="module")
def default_engine(default_model: Path) -> Model:
    return Model.load(default_model, device="cpu", progress=False)


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


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tiny-batch")


def tiny(spec: TinySpec, tiny_dir: Path, default_model: Path) -> Model:
    path = write_tiny_model(tiny_dir / f"{spec.name}.gguf", spec, default_model)
    return Model.load(path, device="cpu", progress=False)


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
