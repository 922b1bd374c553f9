"""The decode step captured into CUDA graphs (device_step.DeviceStep with graphs on) without a
GPU: the strict CuPy stand-in records a capture's launches and runs a replay's through the
twins in order, reading the buffers as they are at the replay (tests/fake_cupy_kernels.py).
Each replayed step's logits, tokens, positions and K/V cells against the same step run
uncaptured, bit for bit, over several tokens and slots, one-row and several-row steps; a
replay's budget (one graph launch, no host read, at most one small write); graphs captured
with a value baked in that changes from token to token caught; the fallbacks and their
reasons.

What this cannot show: a capture and its replays on a CUDA device (scripts/gpu-check.sh's
``device_graphs`` part).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
from gguf import GGMLQuantizationType as T

from bankml.engine_cupy import device_step as ds
from bankml.engine_cupy.device_model import DeviceModel
from bankml.engine_cupy.weights import open_reader, read_hparams
from tests.fake_cupy import READS, WRITES
from tests.fake_cupy_kernels import KernelCupy
from tests.test_device_rows import _state
from tests.tiny_models import TinySpec, write_tiny_model

PROMPT = [1, 504, 3458, 282, 4649, 314, 28, 11, 2029]
HISTORIES = [PROMPT[:2], PROMPT[:3], PROMPT[2:4], PROMPT[:1]]
# each round: the slots stepped, one step each (one row) or one batched step (several)
ROUNDS: tuple[tuple[str, list[int]], ...] = (
    ("one", [0]),
    ("one", [2]),
    ("rows", [1, 3]),
    ("rows", [3, 0]),
    ("one", [1]),
    ("rows", [0, 1, 2]),
    ("rows", [2, 3, 1]),
    ("rows", [1, 0, 3]),
    ("one", [3]),
)


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory: pytest.TempPathFactory, default_model: Path) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("device_graphs")
    specs = [
        TinySpec("llama", T.Q4_0),
        TinySpec("qwen2", T.Q8_0),  # biases, NEOX RoPE, Q8_0 embedding rows
    ]
    return {s.name: write_tiny_model(out / f"{s.name}.gguf", s, default_model) for s in specs}


def _steps(
    path: Path, graphed: type[ds.DeviceStep] = ds.DeviceStep
) -> tuple[KernelCupy, ds.DeviceStep, ds.DeviceStep]:
    """A stand-in with stream capture, and on the same weights a step that captures (of class
    ``graphed``) and one that does not."""
    reader = open_reader(path)
    cp = KernelCupy(graphs=True)
    weights = ds.DeviceWeights.upload(cp, reader, read_hparams(reader))  # type: ignore[arg-type]
    step = graphed(cp, weights)  # type: ignore[arg-type]
    assert step.graph_reason is None
    return cp, step, ds.DeviceStep(cp, weights, graphs=False)  # type: ignore[arg-type]


def _run(step: ds.DeviceStep, seqs: list[ds.DeviceSequence], kind: str, order: list[int]) -> None:
    if kind == "one":
        for i in order:
            step.step(seqs[i])
    else:
        step.step_rows([seqs[i] for i in order])


def _check_graphs_against_uncaptured(
    cp: KernelCupy, graphed: ds.DeviceStep, plain: ds.DeviceStep
) -> dict[str, int]:
    """The slots filled token by token, then ``ROUNDS`` (each with a fresh token written to
    some slots), each round by both steps: every slot's bits the same after every step; a
    replay one graph launch, no host read, at most one write (the slots' indices, 4 bytes
    a row, only where they differ from the last replay's). The replays' count."""
    mine, theirs = graphed.new_sequences(4, 24), plain.new_sequences(4, 24)
    for step, seqs in ((graphed, mine), (plain, theirs)):
        for seq, history in zip(seqs, HISTORIES):
            for token in history:
                step.set_token(seq, token)
                step.step(seq)
    for a, b in zip(mine, theirs):
        assert _state(a) == _state(b), "the prompts"
    replays = 0
    for r, (kind, order) in enumerate(ROUNDS):
        if r % 3 == 1:  # a token chosen on the host for the first slot of the round
            graphed.set_token(mine[order[0]], PROMPT[r % len(PROMPT)])
            plain.set_token(theirs[order[0]], PROMPT[r % len(PROMPT)])
        before = graphed.graph_stats["replayed"]
        start, reads, writes = len(cp.launches), dict(READS), dict(WRITES)
        _run(graphed, mine, kind, order)
        launches = cp.launches[start:]
        assert dict(READS) == reads  # no .get(), asnumpy, int/float/bool, synchronize
        if graphed.graph_stats["replayed"] > before:  # a replay: nothing but the graph
            steps = graphed.graph_stats["replayed"] - before
            replays += steps
            assert [name for name, _, _ in launches] == ["graph"] * steps
            assert WRITES["set"] - writes.get("set", 0) <= steps
        _run(plain, theirs, kind, order)
        for i, (a, b) in enumerate(zip(mine, theirs)):
            assert _state(a) == _state(b), (r, kind, order, i)
    return {"replays": replays}


@pytest.mark.parametrize("name", ["llama-Q4_0", "qwen2-Q8_0"])
def test_replayed_steps_give_the_uncaptured_steps_bits(
    tiny_models: dict[str, Path], name: str
) -> None:
    cp, graphed, plain = _steps(tiny_models[name])
    got = _check_graphs_against_uncaptured(cp, graphed, plain)
    # one graph per row count (1, 2, 3) of the pool, captured the second time it is seen
    assert graphed.graph_stats["captured"] == 3
    assert got["replays"] == 7  # every round but the first sight of 2 and of 3 rows
    nodes = {grid[0] for n, grid, _ in cp.launches if n == "graph"}
    assert nodes == {ds.launches_per_step(graphed.hp.n_layer)}  # the uncaptured launches


def test_a_replay_with_the_same_slots_writes_nothing(tiny_models: dict[str, Path]) -> None:
    cp, step, _ = _steps(tiny_models["llama-Q4_0"])
    seqs = step.new_sequences(3, 16)
    for seq in seqs:
        step.set_token(seq, 5)
    step.step_rows(seqs)  # first sight: uncaptured
    step.step_rows(seqs)  # captured, replayed
    writes, start = dict(WRITES), len(cp.launches)
    step.step_rows(seqs)
    step.step_rows(seqs)
    assert dict(WRITES) == writes and [n for n, _, _ in cp.launches[start:]] == ["graph"] * 2
    assert step.graph_stats == {"captured": 1, "replayed": 3, "uncaptured": 1}


class BakedSlotList(ds.DeviceStep):
    """Wrong on purpose: the graph reads the slots of the step it was captured at (the cached
    index list of that set of slots), not the buffer written before each replay."""

    baked: Any = None

    def _capture(self, pool: ds.SequencePool, entry: ds.StepGraph, n: int) -> Any:
        self.baked = self._slot_list(pool, entry.indices)  # uploaded before the capture
        return super()._capture(pool, entry, n)

    def _capture_launches(self, pool: ds.SequencePool, entry: ds.StepGraph, n: int) -> None:
        self._rows_launches(pool, self.baked, n)


class BakedOneRow(ds.DeviceStep):
    """Wrong on purpose: a one-row graph of the one-row step's own launches, which name the
    slot's cache, position and token (the slot of the step it was captured at)."""

    captured: ds.DeviceSequence | None = None

    def step(self, seq: ds.DeviceSequence) -> None:
        self.captured = self.captured or seq
        super().step(seq)

    def _capture(self, pool: ds.SequencePool, entry: ds.StepGraph, n: int) -> Any:
        w = self.w  # the one-row kernels loaded before the capture (the rows' are)
        names = {"rms_norm_q8_1", "rope_kv_f16", "attn_decode_f16", "swiglu_q8_1", "argmax_f32"}
        names.add(f"get_rows_{w.embd_qtype.lower()}")
        mats = ("q", "k", "v", "o", "gate", "up", "down")
        for m in [w.output] + [getattr(x, a) for x in w.layers for a in mats]:
            names.add(f"mmvq_{m.qtype.lower()}")
        for name in names:
            self.kernels.function(name)
        return super()._capture(pool, entry, n)

    def _capture_launches(self, pool: ds.SequencePool, entry: ds.StepGraph, n: int) -> None:
        if n != 1:
            return super()._capture_launches(pool, entry, n)
        assert self.captured is not None
        self._step_launches(self.captured)


@pytest.mark.parametrize("broken", [BakedSlotList, BakedOneRow])
def test_a_graph_with_a_baked_slot_is_caught(
    tiny_models: dict[str, Path], broken: type[ds.DeviceStep]
) -> None:
    """The check above fails on graphs that hold what changes from step to step."""
    cp, graphed, plain = _steps(tiny_models["llama-Q4_0"], broken)
    with pytest.raises(AssertionError, match="the prompts"):  # a slot's bits, not a budget
        _check_graphs_against_uncaptured(cp, graphed, plain)


class ReadsInCapture(ds.DeviceStep):
    """A capture that reads a device value back (not allowed while a stream captures)."""

    def _capture_launches(self, pool: ds.SequencePool, entry: ds.StepGraph, n: int) -> None:
        pool.pos.get()


def test_fallbacks_say_why(
    tiny_models: dict[str, Path], caplog: pytest.LogCaptureFixture, monkeypatch: Any
) -> None:
    path = tiny_models["qwen2-Q8_0"]
    reader = open_reader(path)
    hp = read_hparams(reader)
    caplog.set_level(logging.INFO, logger=ds.__name__)
    plain_cp = KernelCupy()  # a CuPy without stream capture
    weights = ds.DeviceWeights.upload(plain_cp, reader, hp)  # type: ignore[arg-type]
    step = ds.DeviceStep(plain_cp, weights)  # type: ignore[arg-type]
    assert step.graph_reason is not None and "no stream capture" in step.graph_reason
    assert "uncaptured: this CuPy has no stream capture" in caplog.text
    monkeypatch.setenv("BANKML_CUDA_GRAPHS", "0")
    assert "BANKML_CUDA_GRAPHS=0" in str(ds.graph_unsupported(KernelCupy(graphs=True)))  # type: ignore[arg-type]
    monkeypatch.delenv("BANKML_CUDA_GRAPHS")
    # a capture that fails: the step runs uncaptured, the same bits, the reason logged once
    cp, graphed, plain = _steps(path, ReadsInCapture)
    caplog.clear()
    _check_graphs_against_uncaptured(cp, graphed, plain)
    assert graphed.graph_stats["captured"] == graphed.graph_stats["replayed"] == 0
    failures = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(failures) == 3  # one per row count
    assert "capture unsupported" in failures[0].getMessage()
    assert not any(n == "graph" for n, _, _ in cp.launches)


def test_a_longer_rope_table_drops_the_graphs(tiny_models: dict[str, Path]) -> None:
    """A pool longer than the training context grows the RoPE table (a new device array): the
    graphs, which hold the old table's address, are captured anew."""
    cp, step, plain = _steps(tiny_models["llama-Q4_0"])
    for seqs in (step.new_sequences(2, 8), step.new_sequences(2, step.hp.n_ctx_train + 4)):
        theirs = plain.new_sequences(2, seqs[0].n_ctx)
        for _ in range(3):
            step.step_rows(seqs)
            plain.step_rows(theirs)
        assert [_state(s) for s in seqs] == [_state(s) for s in theirs]
    assert step.graph_stats == {"captured": 2, "replayed": 4, "uncaptured": 2}


def test_device_model_replays_its_steps(tiny_models: dict[str, Path]) -> None:
    """``DeviceModel`` (what the engine calls) with stream capture: its slots' decode steps,
    lone and batched, replayed, each slot's logits and greedy token those of the model without
    capture."""
    path = tiny_models["qwen2-Q8_0"]
    models = []
    for cp in (KernelCupy(graphs=True), KernelCupy()):
        reader = open_reader(path)
        models.append(DeviceModel.upload(cp, str(path), reader, read_hparams(reader)))  # type: ignore[arg-type]
    graphed, plain = models
    caches = [m.new_caches(3, 24) for m in models]
    for model, cs in zip(models, caches):
        for cache, history in zip(cs, HISTORIES):
            model.forward(history, cache)
    tokens: list[list[int]] = [[5], [77], [9]]
    for _ in range(4):
        got = graphed.forward_batch(tokens, caches[0])
        want = plain.forward_batch(tokens, caches[1])
        assert [g.host().tobytes() for g in got] == [w.host().tobytes() for w in want]
        tokens = [[g.greedy()] for g in got]
        assert tokens == [[w.greedy()] for w in want]
        lone = [graphed.forward([7], caches[0][1]), plain.forward([7], caches[1][1])]
        assert lone[0].host().tobytes() == lone[1].host().tobytes()
    assert graphed.step.graph_stats["replayed"] >= 6
    assert plain.step.graph_stats["replayed"] == 0


def test_the_gpu_checks_graph_report(tiny_models: dict[str, Path]) -> None:
    """bench/kernel_check.py's graph part (what a GPU run reports: replayed steps against
    uncaptured ones on the same device, and both speeds), here on the stand-in."""
    from bench import kernel_check

    report = kernel_check.device_graphs_vs_uncaptured(
        KernelCupy(graphs=True),  # type: ignore[arg-type]
        tiny_models["qwen2-Q8_0"],
        rows=3,
    )
    assert report["graph_reason"] is None and report["replayed"] > 0
    assert report["differing_steps"] == 0 and report["identical_steps"] > 0
    assert report["same_tokens"]
    assert report["decode_tok_s"] == {"captured": None, "uncaptured": None}
