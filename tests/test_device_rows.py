"""The batched decode step (device_step.DeviceStep.step_rows) without a GPU: several slots'
rows through one step of the strict CuPy stand-in (tests/fake_cupy_kernels.py, the kernels'
NumPy twins), each slot's logits, token, position and K/V bits against its own one-row step,
with the launches (the one-row budget whatever the number of rows) and host reads counted;
then the device model's ``forward_batch`` (the engine's slots) against one ``forward`` each.

What this cannot show: that the ``*_rows`` kernels give on a device the bits of the one-row
kernels (they run the same additions in the same order per row; scripts/gpu-check.sh on a GPU).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy
import pytest
from gguf import GGMLQuantizationType as T

from bankml.engine_cupy import cuda_twins as tw
from bankml.engine_cupy import device_step as ds
from bankml.engine_cupy.device_model import DeviceModel
from bankml.engine_cupy.weights import open_reader, read_hparams
from tests.fake_cupy import READS
from tests.fake_cupy_kernels import KernelCupy
from tests.tiny_models import TinySpec, _matrix, write_tiny_model

PROMPT = [1, 504, 3458, 282, 4649, 314, 28, 11, 2029]
# four slots at different positions (3, 6, 7 and 1 tokens held)
HISTORIES = [PROMPT[:3], PROMPT[:6], PROMPT[2:9], PROMPT[:1]]
ORDERS = ([0, 1], [3, 0, 2], [2, 1, 3, 0])  # 2, 3 and 4 rows, slots in any order


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory: pytest.TempPathFactory, default_model: Path) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("device_rows")
    specs = [
        TinySpec("llama", T.Q4_0),  # tied Q4_0 output: its embedding through the f32 table
        TinySpec("qwen2", T.Q8_0),  # biases, NEOX RoPE, Q8_0 embedding rows from their blocks
        TinySpec("llama", T.Q4_K, tied=False, llama3_rope=True, out_type=T.Q6_K),
    ]
    return {s.name: write_tiny_model(out / f"{s.name}.gguf", s, default_model) for s in specs}


def _device_step(path: Path) -> tuple[KernelCupy, ds.DeviceStep]:
    reader = open_reader(path)
    cp = KernelCupy()
    weights = ds.DeviceWeights.upload(cp, reader, read_hparams(reader))  # type: ignore[arg-type]
    return cp, ds.DeviceStep(cp, weights)  # type: ignore[arg-type]


def _fill(step: ds.DeviceStep, seqs: list[ds.DeviceSequence], histories: list[list[int]]) -> None:
    for seq, history in zip(seqs, histories):
        for token in history:
            step.set_token(seq, token)
            step.step(seq)


def _state(seq: ds.DeviceSequence) -> dict[str, str]:
    """Everything a step leaves in a sequence, as the sha256 of its bits per part: a mismatch
    names the part, and its message stays short (a failed comparison of the raw bytes would
    have pytest diff megabytes of reprs)."""
    n = seq.n_tokens
    parts = {
        "logits": seq.logits.host_view.tobytes(),
        "token": seq.token.host_view.tobytes(),
        "pos": seq.pos.host_view.tobytes(),
        "k": seq.k.host_view[:, :, :n].tobytes(),
        "v": seq.v.host_view[:, :, :n].tobytes(),
        "n_tokens": n.to_bytes(4, "little"),
    }
    return {name: hashlib.sha256(bits).hexdigest() for name, bits in parts.items()}


def _check_rows_against_alone(
    cp: KernelCupy,
    step: ds.DeviceStep,
    histories: list[list[int]],
    orders: tuple[list[int], ...],
) -> None:
    """Slots stepped together (``orders``: the rows of each round) against the same slots
    stepped one by one: each slot's bits the same after every round; the batched step's
    launches and host reads."""
    hp, n = step.hp, len(histories)
    together = step.new_sequences(n, 32)
    alone = step.new_sequences(n, 32)
    _fill(step, together, histories)
    _fill(step, alone, histories)
    for order in orders:
        start, reads = len(cp.launches), dict(READS)
        step.step_rows([together[i] for i in order])
        launches = [(name, grid) for name, grid, _ in cp.launches[start:]]
        assert dict(READS) == reads  # no .get(), asnumpy, int/float/bool, synchronize
        assert len(launches) == ds.launches_per_step(hp.n_layer) == 12 * hp.n_layer + 4
        assert all(name.endswith("_rows") for name, _ in launches)
        mmvq = [grid for name, grid in launches if name.startswith("mmvq_")]
        assert len(mmvq) == 7 * hp.n_layer + 1  # one launch per product for all the rows
        for i in order:
            step.step(alone[i])
        for i in range(n):
            assert _state(together[i]) == _state(alone[i]), (order, i)


@pytest.mark.parametrize("name", ["llama-Q4_0", "qwen2-Q8_0", "llama-Q4_K-untied-rope3"])
def test_rows_step_gives_each_slot_its_own_steps_bits(
    tiny_models: dict[str, Path], name: str
) -> None:
    cp, step = _device_step(tiny_models[name])
    _check_rows_against_alone(cp, step, HISTORIES, ORDERS)


def test_default_model_rows_step(default_model: Path) -> None:
    """The default model: 3 slots at positions 2, 1 and 3 in one step (kept short: each row
    through the twins costs a second)."""
    cp, step = _device_step(default_model)
    _check_rows_against_alone(cp, step, [PROMPT[:2], PROMPT[:1], PROMPT[3:6]], ([2, 0, 1],))


def test_rows_step_refuses_what_it_cannot_take(tiny_models: dict[str, Path]) -> None:
    _, step = _device_step(tiny_models["llama-Q4_0"])
    a, b = step.new_sequences(2, 8)
    other = step.new_sequence(8)
    with pytest.raises(ValueError, match="one pool"):
        step.step_rows([a, other])
    with pytest.raises(ValueError, match="distinct"):
        step.step_rows([a, a])
    with pytest.raises(ValueError, match="1..8"):
        step.step_rows([])
    many = step.new_sequences(9, 4)
    with pytest.raises(ValueError, match="1..8"):
        step.step_rows(many)


def test_batched_product_twin_is_each_rows_product() -> None:
    """``cuda_twins.mmvq_rows``: row j of the batched product is the one-row product of
    activation j, for a plain and a K-quant type."""
    rng = numpy.random.default_rng(7)
    for qtype, t in (("Q4_1", T.Q4_1), ("Q5_K", T.Q5_K)):
        w, _ = _matrix(rng, 40, 512, t, 0.05)
        xs = [rng.normal(size=512).astype(numpy.float32) for _ in range(5)]
        got = tw.mmvq_rows(qtype, numpy.asarray(w), xs)
        for j, x in enumerate(xs):
            assert got[j].tobytes() == tw.mmvq(qtype, numpy.asarray(w), x).tobytes()
    with pytest.raises(ValueError, match="1..8"):
        tw.mmvq_rows("Q4_1", numpy.asarray(w), [])


def test_device_model_steps_the_slots_together(tiny_models: dict[str, Path]) -> None:
    """``DeviceModel.forward_batch`` (what the engine calls for its slots): the decode steps of
    the slots' caches in one batched step, a prompt chunk beside them through ``forward``;
    each slot's logits and greedy token the bits of one ``forward`` each."""
    path = tiny_models["qwen2-Q8_0"]
    reader = open_reader(path)
    hp = read_hparams(reader)
    cp = KernelCupy()
    model = DeviceModel.upload(cp, str(path), reader, hp)  # type: ignore[arg-type]
    together = model.new_caches(4, 32)
    alone = model.new_caches(4, 32)
    for caches in (together, alone):
        for cache, history in zip(caches, HISTORIES):
            model.forward(history, cache)
    start = len(cp.launches)
    batch = [[5], [77], [PROMPT[4], PROMPT[5]], [9]]  # three steps and a two-token chunk
    got = model.forward_batch(batch, together)
    names = [name for name, _, _ in cp.launches[start:]]
    assert names.count("argmax_f32_rows") == 1 and names.count("argmax_f32") == 1
    want = [model.forward(toks, cache) for toks, cache in zip(batch, alone)]
    for g, w, a, b in zip(got, want, together, alone):
        assert g.host().tobytes() == w.host().tobytes()
        assert g.greedy() == w.greedy()
        assert _state(a.seq) == _state(b.seq)
    # the next round: the greedy tokens the device holds, not written again
    tokens = [[g.greedy()] for g in got]
    got = model.forward_batch(tokens, together)
    want = [model.forward(toks, cache) for toks, cache in zip(tokens, alone)]
    assert [g.host().tobytes() for g in got] == [w.host().tobytes() for w in want]
    rows = model.decode_batch([1, 2, 3, 4], together)
    assert rows.shape == (4, hp.n_vocab)


def test_the_gpu_checks_rows_report(tiny_models: dict[str, Path]) -> None:
    """bench/kernel_check.py's batched-step part (what a GPU run reports: each slot of the
    batched step against its own step on the same device), here on the stand-in."""
    from bench import kernel_check

    report = kernel_check.device_rows_vs_steps(KernelCupy(), tiny_models["qwen2-Q8_0"], rows=3)  # type: ignore[arg-type]
    assert report["identical_rows"] == 9 and report["differing_rows"] == 0
    assert report["same_tokens"] and report["us_rows_step"] is None
