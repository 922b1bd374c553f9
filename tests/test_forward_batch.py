"""Model.forward_batch and Model.shared_pass: several sequences' micro-batches (prompt chunks,
decode steps) at once, each sequence bit for bit its own forward.

Every step runs twice from the same state: once as one ``forward_batch`` (or ``shared_pass``)
over several caches (each at its own length, some taking a prompt chunk, some one token), once
as one
``forward(tokens, cache)`` per sequence on a twin cache filled with the same prompt. Each
sequence's logits and every byte of its cache (the sliding-window ring's too) must be equal;
``forward`` is what the oracle and llama-server agreement tests hold to llama-server's bits.
A count of the passes through the definition says the shared pass really ran.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy
import pytest
from gguf import GGMLQuantizationType as T

from bankml.engine_cupy import model as model_module
from bankml.engine_cupy.model import Model
from tests.engine_checks import Rows, kv_bytes, tiny, token_ids
from tests.tiny_models import FAST_SPECS, TinySpec

# the tiny models whose every product is row-independent (Q4_0/Q4_1/Q5_0/Q5_1/Q8_0, not
# repacked) or a K-quant one, which multiplies each sequence's rows in that sequence's own
# arithmetic: their prompts and decode steps share one pass
SHARING = {
    "qwen2-Q4_1-untied",
    "gemma3-Q5_0",
    "llama-Q4_K-untied-rope3",  # repacked: gemm for each chunk's rows in fours, gemv for the rest
    "qwen2-Q2_K",
    "llama-Q3_K-untied",
    "gemma3-Q6_K",  # tiled for a chunk of 8 rows or more, vec_dot below and for decode steps
}


class Sequences(Rows):
    """Twin caches per sequence filled by the same prompt (test_decode_batch's ``Rows``):
    ``batch`` advanced by forward_batch, ``single`` by one forward per sequence."""

    seed = 100  # the prompt chunks' tokens, a new seed each

    def step(self, chunks: dict[int, int], shared: bool = False) -> None:
        """One forward_batch (``shared``: one shared_pass): sequence r takes ``chunks[r]`` new
        prompt tokens, or (1) its greedy next token; against a forward per sequence."""
        model = self.model
        run = model.shared_pass if shared else model.forward_batch
        rows = list(chunks)
        tokens = []
        for r in rows:
            self.seed += 1
            n = chunks[r]
            tokens.append([self.next[r]] if n == 1 else token_ids(model, n, seed=self.seed))
        got = run(tokens, [self.batch[r] for r in rows])
        assert len(got) == len(rows)
        for i, r in enumerate(rows):
            assert got[i].dtype == numpy.float32 and got[i].shape == (model.n_vocab,)
            self.agree(r, tokens[i], got[i])


@pytest.fixture()
def shared_passes(monkeypatch: pytest.MonkeyPatch) -> list[list[int | str]]:
    """Each pass the definition ran with several sequences: a row count for each micro-batch
    of its own (a Segment), "B decode" for its decode steps attended by the one-row kernel
    (DecodeRows)."""
    passes: list[list[int | str]] = []
    stack = model_module.stack

    def counting(ops: Any, hp: Any, weights: Any, x: Any, segments: Any, *rest: Any) -> Any:
        if len(segments) > 1 or isinstance(segments[0], model_module.DecodeRows):
            passes.append(
                [
                    f"{s.rows.stop - s.rows.start} decode"
                    if isinstance(s, model_module.DecodeRows)
                    else s.rows.stop - s.rows.start
                    for s in segments
                ]
            )
        return stack(ops, hp, weights, x, segments, *rest)

    monkeypatch.setattr(model_module, "stack", counting)
    return passes


def test_default_model(default_engine: Model, shared_passes: list[list[int | str]]) -> None:
    """Prompt chunks of 17 and 3, 30 and 12 (a q8_0 cache's sequence among f16 ones), 60 and
    60 in one pass each (the lane tiles of 16 rows and more), 40 and 512 apart (past the
    pass's rows), with the decode steps at 5..300 cells (300: ggml's split attention over 512
    cells, on two threads) in the first pass, a long chunk's too (a q8_0 cache's step a
    segment of its own); decode steps alone in one decode_batch; a shared pass given its
    sequences in any order."""
    model = default_engine
    assert model.shares_passes
    seqs = Sequences(
        model, [5, 40, 300, 12, 0, 9], [256, 256, 1024, 1024, 700, 256], [None] * 5 + ["q8_0"]
    )
    seqs.step({0: 40, 1: 1, 2: 1, 3: 512})  # 552 rows: past SHARED_PASS_ROWS, two passes
    seqs.step({4: 17, 3: 3, 2: 1})
    seqs.step({5: 30, 4: 12, 0: 1})
    seqs.step({0: 60, 1: 60, 4: 30, 5: 20})  # two passes of at most 128 rows
    seqs.step({1: 1, 5: 1, 4: 20})  # the q8_0 step a segment beside the decode rows
    seqs.step({0: 1, 1: 1, 2: 1})  # decode steps only: one decode_batch
    seqs.step({3: 150, 0: 1, 1: 1, 4: 20})  # the decode steps ride with the first, long chunk
    seqs.step({3: 130, 2: 1})
    seqs.step({3: 200, 0: 1, 5: 1, 2: 1}, shared=True)  # any order: rows as given
    assert shared_passes == [
        ["2 decode", 40],
        ["1 decode", 17, 3],
        ["1 decode", 30, 12],
        [60, 60],
        [30, 20],
        ["1 decode", 1, 20],
        ["2 decode", 150],
        ["1 decode", 130],
        ["2 decode", 200, 1],
    ]


@pytest.mark.parametrize("spec", FAST_SPECS, ids=lambda s: s.name)
def test_tiny_models(
    spec: TinySpec, tiny_dir: Path, default_model: Path, shared_passes: list[list[int | str]]
) -> None:
    """Every family the exact path plays: the row-independent and K-quant ones share a pass
    among their prompt chunks and decode steps (biases, gemma3's window of 8 crossed; chunks
    of 12, 20 and 6 rows: the K-quants' batch and one-row arithmetics side by side), the
    others run each prompt chunk as its own pass and the decode steps as one decode_batch;
    the same bits either way."""
    model = tiny(spec, tiny_dir, default_model)
    sharing = spec.name in SHARING
    assert model.shares_passes == sharing
    seqs = Sequences(model, [5, 20, 3, 9], [64, 64, 64, 64])
    seqs.step({0: 12, 1: 1, 2: 1})
    seqs.step({3: 20, 2: 6, 0: 1, 1: 1})
    if sharing:
        seqs.step({0: 5, 1: 1, 2: 1}, shared=True)
    shared = [["2 decode", 12], ["2 decode", 20, 6], ["2 decode", 5]]
    assert shared_passes == (shared if sharing else [])


def test_sliding_window_ring(
    tiny_dir: Path, default_model: Path, shared_passes: list[list[int | str]]
) -> None:
    """gemma3 sequences past llama.cpp's 768-cell SWA ring: a prompt chunk into reused cells
    beside decode steps in the ring and a short sequence in position order."""
    model = tiny(TinySpec("gemma3", T.Q5_0, n_layer=4), tiny_dir, default_model)
    seqs = Sequences(model, [780, 10, 800], [1000, 100, 1000])
    assert seqs.batch[0].cells is not None and seqs.batch[1].cells is None
    seqs.step({0: 30, 1: 1, 2: 1})
    seqs.step({2: 25, 0: 1, 1: 40})
    seqs.step({0: 3, 1: 1, 2: 1}, shared=True)
    assert shared_passes == [["2 decode", 30], ["1 decode", 25, 40], ["2 decode", 3]]


def test_row_dependent_products_would_change_an_answer(tiny_dir: Path, default_model: Path) -> None:
    """Why F16 products do not share a pass: tinyBLAS rounds two or more rows otherwise than
    vec_dot rounds one, so a decode step in a pass beside a prompt chunk would not be its own
    step's bits."""
    model = tiny(TinySpec("llama", T.F16), tiny_dir, default_model)
    assert not model.shares_passes
    shared, alone = [model.new_cache(64) for _ in range(2)], [model.new_cache(64) for _ in range(2)]
    prompt, token = token_ids(model, 9), token_ids(model, 1, seed=3)
    for cache in (shared[1], alone[1]):
        model.forward(token_ids(model, 5, seed=4), cache)
    got = model.shared_pass([prompt, token], shared)  # what sharing would give
    want = [model.forward(prompt, alone[0]), model.forward(token, alone[1])]
    assert any(g.tobytes() != w.tobytes() for g, w in zip(got, want))


def test_bad_sequences_change_nothing(default_engine: Model) -> None:
    """A sequence that cannot take its tokens (no room, a token out of range, none at all), a
    cache given twice or a count mismatch: ValueError before any cache changes."""
    model = default_engine
    full, other = model.new_cache(8), model.new_cache(32)
    model.forward([5, 6, 7, 8, 9, 10], full)
    model.forward([5], other)
    before = kv_bytes(other, model.n_layer)
    for tokens, caches in (
        ([[1, 2, 3], [1, 2, 3]], [other, full]),
        ([[1, 2, 3], [model.n_vocab]], [other, model.new_cache(8)]),
        ([[1, 2, 3], [-1, 4]], [other, model.new_cache(8)]),
        ([[1, 2, 3], []], [other, model.new_cache(8)]),
        ([[1, 2, 3], [4]], [other, other]),
        ([[1, 2, 3]], [other, model.new_cache(8)]),
    ):
        with pytest.raises(ValueError):
            model.forward_batch(tokens, caches)
        assert other.n_tokens == 1 and full.n_tokens == 6
        assert kv_bytes(other, model.n_layer) == before
    assert model.forward_batch([], []) == []
