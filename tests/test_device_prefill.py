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

from bankml.engine_cupy import device_prefill as dp
from bankml.engine_cupy import device_prefill_twins as pt
from bankml.engine_cupy.model import Model
from bankml.engine_cupy.weights import dequantize
from tests.fake_cupy import READS
from tests.fake_cupy_kernels import KernelCupy
from tests.test_device_step import PROMPT, _device_step, _top10_diff
from tests.tiny_models import TinySpec, _matrix, write_tiny_model

F32 = numpy.float32
QTYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory: pytest.TempPathFactory, default_model: Path) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("device_prefill")
    specs = [
        TinySpec("llama", T.Q5_K, tied=False, out_type=T.Q6_K),  # as Q5_K_M files pair them
        TinySpec("llama", T.Q4_0),  # tied Q4_0 output: its embedding through the f32 table
        TinySpec("qwen2", T.Q8_0),  # biases, NEOX RoPE, Q8_0 embedding rows from their blocks
        TinySpec("llama", T.Q4_K, tied=False, llama3_rope=True, out_type=T.Q6_K),
        TinySpec("llama", T.Q3_K, tied=False, out_type=T.Q2_K),  # as Q3_K_M/Q2_K files pair them
        # the other layer types' dequantize_f16 kernels, each tied (its output through mmvq);
        # Q5_0 in qwen2: llama's tiny Q5_0 model has two top logits 0.26 apart, a coin flip
        TinySpec("qwen2", T.Q5_0),
        TinySpec("llama", T.Q5_1),
        TinySpec("qwen2", T.Q2_K),
        TinySpec("llama", T.Q6_K),
    ]
    return {s.name: write_tiny_model(out / f"{s.name}.gguf", s, default_model) for s in specs}


@pytest.mark.parametrize(
    "name, kernels",
    [
        ("llama-Q5_K-untied", {"mmvq_q5_k", "mmvq_q6_k"}),
        ("llama-Q3_K-untied", {"mmvq_q3_k", "mmvq_q2_k"}),
    ],
)
def test_kquant_decode_step_against_the_exact_path(
    tiny_models: dict[str, Path], name: str, kernels: set[str]
) -> None:
    """Q5_K layers with a Q6_K output, Q3_K layers with a Q2_K output, one decode step per
    prompt token: the top-1 token the exact path's, the top-10 log-probabilities within
    test_device_step's bound."""
    path = tiny_models[name]
    cp, step = _device_step(path)
    seq = step.new_sequence(32)
    for token in PROMPT:
        step.set_token(seq, token)
        step.step(seq)
    assert {n for n, _, _ in cp.launches if n.startswith("mmvq_")} == kernels
    model = Model.load(path, device="cpu", progress=False)
    want = model.forward(PROMPT, model.new_cache(32))
    got = step.host_logits()
    assert int(numpy.argmax(got)) == int(numpy.argmax(want))
    diff = _top10_diff(got, want)
    assert 0 < diff < 1.0, diff


# --- the prefill ---------------------------------------------------------------------------------


def test_dequantize_twins_are_ggml_dequantization() -> None:
    """dequantize_f16_<type>'s values, by the kernel's index arithmetic, are bit for bit the CPU
    dequantization's f32 values (gguf's, ggml's formulas), then rounded to f16 once."""
    rng = numpy.random.default_rng(11)
    for qtype in QTYPES:
        w, _ = _matrix(rng, 8, 512, T[qtype], 0.05)
        got = pt.dequantize_values(qtype, w)
        want = dequantize(numpy.asarray(w), T[qtype]).astype(F32)
        assert got.tobytes() == want.tobytes(), qtype
        assert pt.dequantize_f16(qtype, w).tobytes() == want.astype(numpy.float16).tobytes()


def _per_layer(layer: object) -> list[str]:
    def prod(name: str) -> list[str]:
        return [f"dequantize_f16_{getattr(layer, name).qtype.lower()}", "gemm"]

    return [
        "add_rms_norm_f16",
        *prod("q"),
        *prod("k"),
        *prod("v"),
        "rope_kv_f16_n",
        "attn_prefill_f16",
        *prod("o"),
        "add_rms_norm_f16",
        *prod("gate"),
        *prod("up"),
        "swiglu_f16",
        *prod("down"),
    ]


def _f16(a: object) -> numpy.ndarray:
    return a.host_view.view(numpy.float16).astype(F32)  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    "name, bound",
    [
        ("llama-Q4_0", 2.0),
        ("qwen2-Q8_0", 1.0),
        ("llama-Q4_K-untied-rope3", 1.0),
        ("llama-Q5_K-untied", 1.0),
        ("llama-Q3_K-untied", 1.0),
        ("qwen2-Q5_0", 1.0),
        ("llama-Q5_1", 1.0),
        ("qwen2-Q2_K", 1.0),
        ("llama-Q6_K", 1.0),
    ],
)
def test_prefill_against_the_exact_path_and_the_step(
    tiny_models: dict[str, Path], name: str, bound: float
) -> None:
    """The 9-token prompt in one prefill: a fixed list of launches (19 a layer, 6 around them,
    the layers' dequantize_f16 kernels those of the model's type), no host read; the last row's
    top-1 token the exact path's and its top-10 log-probabilities within test_device_step's
    bound; then the decode step goes on from the prefilled sequence and chooses the same greedy
    tokens as after feeding the prompt one step per token; the cache near the step-by-step one."""
    path = tiny_models[name]
    cp, step = _device_step(path)
    hp = step.hp
    prefill = dp.DevicePrefill(cp, step.w, step.kernels)
    seq = step.new_sequence(32)
    start, reads, transfers = len(cp.launches), dict(READS), cp.transfers
    prefill.prefill(seq, PROMPT)
    assert dict(READS) == reads and cp.transfers == transfers + 1  # the ids up, nothing back
    launches = [n for n, _, _ in cp.launches[start:]]
    assert len(launches) == dp.launches_per_prefill(hp.n_layer) == 19 * hp.n_layer + 6
    embd = "get_rows_q8_0_n" if step.w.embd_qtype == "Q8_0" else "get_rows_f32_n"
    want_launches = [embd]
    for layer in step.w.layers:
        want_launches += _per_layer(layer)
    out = f"mmvq_{step.w.output.qtype.lower()}"
    want_launches += ["add_rms_norm_f16", "rms_norm_q8_1", out, "advance_pos", "argmax_f32"]
    assert launches == want_launches
    qtype = name.split("-")[1].lower()  # the layers' type, as the spec's name spells it
    assert {n for n in launches if n.startswith("dequantize_f16_")} == {f"dequantize_f16_{qtype}"}
    assert int(seq.pos.get()[0]) == len(PROMPT) == seq.n_tokens

    model = Model.load(path, device="cpu", progress=False)
    cache = model.new_cache(32)
    want = model.forward(PROMPT, cache)
    got = prefill.host_logits()
    assert step.chosen(seq) == int(numpy.argmax(got)) == int(numpy.argmax(want))
    diff = _top10_diff(got, want)
    assert 0 < diff < bound, diff

    by_step = step.new_sequence(32)
    for token in PROMPT:
        step.set_token(by_step, token)
        step.step(by_step)
    # the same positions filled; the values apart by the products' arithmetic (f16 rows
    # through cuBLAS against q8_1 rows through mmvq), not by where they went
    n = len(PROMPT)
    for a, b in ((seq.k, by_step.k), (seq.v, by_step.v)):
        got_c, want_c = _f16(a), _f16(b)
        assert numpy.abs(got_c[:, :, :n]).max(axis=-1).min() > 0 and not got_c[:, :, n:].any()
        rel = numpy.abs(got_c - want_c).max() / numpy.abs(want_c).max()
        assert rel < 0.08, rel
    tokens, tokens_by_step = [], []
    for _ in range(3):
        tokens.append(step.chosen(seq))
        tokens_by_step.append(step.chosen(by_step))
        step.step(seq)
        step.step(by_step)
    assert tokens == tokens_by_step


def test_prefill_in_two_parts_and_its_limits(tiny_models: dict[str, Path]) -> None:
    """A prompt in two prefills (the second from position 5, the first's cache read back by
    its attention) ends where one prefill ends; without logits the same cells, no head; too
    many tokens or none are refused first."""
    path = tiny_models["qwen2-Q8_0"]
    cp, step = _device_step(path)
    prefill = dp.DevicePrefill(cp, step.w, step.kernels)
    whole = step.new_sequence(16)
    prefill.prefill(whole, PROMPT)
    logits = prefill.host_logits()
    parts = step.new_sequence(16)
    prefill.prefill(parts, PROMPT[:5])
    assert int(parts.pos.get()[0]) == 5
    prefill.prefill(parts, PROMPT[5:])
    assert int(parts.pos.get()[0]) == len(PROMPT) == parts.n_tokens
    assert step.chosen(parts) == step.chosen(whole)
    assert numpy.abs(prefill.host_logits() - logits).max() < 1e-2 * numpy.abs(logits).max()
    assert numpy.abs(_f16(parts.k) - _f16(whole.k)).max() < 1e-2 * numpy.abs(_f16(whole.k)).max()
    # the cache only (logits=False, the engine's rows before a pass's last): the same cells
    # and position, no output head, the sequence's logits and next token left as they were
    cells = step.new_sequence(16)
    token, row = cells.token.get().copy(), cells.logits.get().copy()
    start = len(cp.launches)
    prefill.prefill(cells, PROMPT, logits=False)
    names = [n for n, _, _ in cp.launches[start:]]
    assert len(names) == dp.launches_per_prefill(step.hp.n_layer, logits=False) == 19 * 2 + 2
    assert names[-1] == "advance_pos" and "argmax_f32" not in names
    assert int(cells.pos.get()[0]) == len(PROMPT) == cells.n_tokens
    assert _f16(cells.k).tobytes() == _f16(whole.k).tobytes()
    assert _f16(cells.v).tobytes() == _f16(whole.v).tobytes()
    assert cells.token.get().tobytes() == token.tobytes()
    assert cells.logits.get().tobytes() == row.tobytes()
    launches = len(cp.launches)
    with pytest.raises(ValueError, match="holds 16"):
        prefill.prefill(parts, list(range(8)))
    with pytest.raises(ValueError, match="no tokens"):
        prefill.prefill(parts, [])
    with pytest.raises(ValueError, match="vocabulary"):
        prefill.prefill(parts, [step.hp.n_vocab])
    assert len(cp.launches) == launches


def test_default_model_prefill_then_greedy_steps(default_model: Path) -> None:
    """The default model (30 layers, Q4_1, a Q8_0 tied embedding): the prompt in one prefill,
    then 4 greedy tokens chosen on the device, against the exact path's greedy tokens; the
    prefilled cache against the exact path's."""
    cp, step = _device_step(default_model)
    prefill = dp.DevicePrefill(cp, step.w, step.kernels)
    seq = step.new_sequence(32)
    prefill.prefill(seq, PROMPT)
    model = Model.load(default_model, device="cpu", progress=False)
    cache = model.new_cache(32)
    want = model.forward(PROMPT, cache)
    diff = _top10_diff(prefill.host_logits(), want)
    # the cache near the exact path's (measured: 2.6 % of the largest K, 3.9 % of V, where the
    # prompt fed one step per token is 6.2 % and 13 % away: its q8_1 activations)
    n = len(PROMPT)
    for ours, exact_cache in ((seq.k, cache._k), (seq.v, cache._v)):
        ex = numpy.stack([numpy.asarray(a) for a in exact_cache])[:, :, :n]
        assert numpy.abs(_f16(ours)[:, :, :n] - ex).max() < 0.06 * numpy.abs(ex).max()
    tokens, exact = [], []
    for _ in range(4):
        tokens.append(step.chosen(seq))
        exact.append(int(numpy.argmax(want)))
        step.step(seq)
        want = model.forward([exact[-1]], cache)
    assert tokens == exact
    assert 0 < diff < 1.0, diff


def test_prefill_refuses_what_does_not_fit(tiny_models: dict[str, Path]) -> None:
    cp, step = _device_step(tiny_models["llama-Q4_0"])
    prefill = dp.DevicePrefill(cp, step.w, step.kernels)
    seq = step.new_sequence(32)
    cp.free = prefill.scratch_bytes(len(PROMPT), 32)
    with pytest.raises(dp.DeviceMemory, match="needs"):
        prefill.prefill(seq, PROMPT)
    assert seq.n_tokens == 0 and not any(n.startswith("get_rows") for n, _, _ in cp.launches)


def test_the_gpu_checks_device_prefill_report(tiny_models: dict[str, Path]) -> None:
    """bench/kernel_check.py's prefill part (what a GPU run reports: the prefill on the device
    against the same through the twins), here with the stand-in on both sides."""
    from bench import kernel_check

    report = kernel_check.device_prefill_vs_twins(KernelCupy(), tiny_models["qwen2-Q8_0"], steps=2)  # type: ignore[arg-type]
    assert report["same_tokens"] and len(report["tokens"]) == 2
    assert report["logits"]["identical"] and report["k_cache"]["identical"]
    assert report["launches_per_prefill"] == 19 * 2 + 6 and report["us_per_prefill"] is None


def test_hidden_states_on_the_device(
    tiny_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``DeviceModel.hidden_states`` (embeddings on the GPU path): every row after the output
    norm, f32, read back once after the layers (the last add and the norm on the host, in
    add_rms_norm_f16's order of additions); near the exact path's rows (f16 activations
    through cuBLAS, as for a prompt); near the same rows in chunks of 4 as in one prefill;
    the cache filled as a prompt's, and a logits row from before refused as stale."""
    import sys

    from bankml.engine_cupy import backend
    from bankml.engine_cupy.device_model import DeviceModel

    cp = KernelCupy()
    monkeypatch.setitem(sys.modules, "cupy", cp)
    monkeypatch.setattr(backend, "_cupy_with_gpu", lambda: (cp, ""))
    path = tiny_models["llama-Q4_K-untied-rope3"]
    model = Model.load(path, device="cuda", progress=False)
    assert isinstance(model, DeviceModel)
    want = Model.load(path, device="cpu", progress=False).hidden_states(PROMPT)
    cache = model.new_cache(32)
    before = model.forward(PROMPT[:3], cache)
    reads = dict(READS)
    got = model.hidden_states(PROMPT, cache)
    # x and the last delta, once (the norm's weight too): no read inside the layers
    assert sum(READS.values()) - sum(reads.values()) == 3, (READS, reads)
    assert got.shape == want.shape == (len(PROMPT), model.hp.n_embd) and got.dtype == F32
    cosine = (got * want).sum(axis=1) / (
        numpy.linalg.norm(got, axis=1) * numpy.linalg.norm(want, axis=1)
    )
    assert cosine.min() > 0.99, cosine
    assert not numpy.array_equal(got, want)  # the GPU's arithmetic, not the exact path's bits
    assert cache.n_tokens == len(PROMPT) and int(cache.seq.pos.get()[0]) == len(PROMPT)
    with pytest.raises(RuntimeError, match="overwritten by a later step"):
        before.host()
    # in chunks of 4 the products see other row counts (cuBLAS's, and its twin's, order of
    # additions may follow them): the same rows to f16 precision
    chunked = model.hidden_states(PROMPT, cache, n_ubatch=4)
    assert numpy.abs(chunked - got).max() <= 2e-3 * numpy.abs(got).max()


def test_the_gpu_checks_device_hidden_report(tiny_models: dict[str, Path]) -> None:
    """bench/kernel_check.py's embeddings part, here with the stand-in on both sides: identical
    to the twins, near the exact path."""
    from bench import kernel_check

    report = kernel_check.device_hidden_vs_twins(KernelCupy(), tiny_models["qwen2-Q8_0"])  # type: ignore[arg-type]
    assert report["vs_twins"]["identical"] and report["min_cosine_vs_twins"] == 1.0
    assert 0.99 < report["min_cosine_vs_exact"] < 1.0 and report["rows"] == len(PROMPT)


def test_a_prefill_too_big_for_the_free_memory_goes_in_smaller_chunks(
    tiny_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prompt whose prefill scratch does not fit the device's free memory is prefilled in
    chunks halved until one fits (the refusal comes before any launch, so nothing is half
    done), for a prompt and for embeddings; the answers those of one prefill, to the products'
    row-count rounding; at one row the refusal stands, with the figures, the cache as it was."""
    import sys

    from bankml.engine_cupy import backend
    from bankml.engine_cupy import device_step as ds

    cp = KernelCupy()
    monkeypatch.setitem(sys.modules, "cupy", cp)
    monkeypatch.setattr(backend, "_cupy_with_gpu", lambda: (cp, ""))
    model = Model.load(tiny_models["qwen2-Q8_0"], device="cuda", progress=False)
    n_ctx = 64
    roomy, tight, empty = (model.new_cache(n_ctx) for _ in range(3))
    want = model.forward(PROMPT, roomy).host()
    want_rows = model.hidden_states(PROMPT, roomy)
    # room for a prefill of 2 rows, not of 4 (the 8 before the prompt's last token)
    cp.free = int(model.prefill.scratch_bytes(3, n_ctx) / ds.MEMORY_SHARE)
    start = len(cp.launches)
    got = model.forward(PROMPT, tight).host()
    chunks = [n for n, _, _ in cp.launches[start:]].count("advance_pos")
    assert chunks == 4 and tight.n_tokens == len(PROMPT)  # 8 rows as 2 + 2 + 2 + 2
    assert int(numpy.argmax(got)) == int(numpy.argmax(want))
    assert numpy.abs(got - want).max() <= 1e-2 * numpy.abs(want).max()
    rows = model.hidden_states(PROMPT, tight)
    assert rows.shape == want_rows.shape
    assert numpy.abs(rows - want_rows).max() <= 2e-3 * numpy.abs(want_rows).max()
    cp.free = 1 << 10
    with pytest.raises(ds.DeviceMemory, match=r"needs [\d.]+ MiB on the device"):
        model.forward(PROMPT, empty)
    assert empty.n_tokens == 0 and int(empty.seq.pos.get()[0]) == 0
