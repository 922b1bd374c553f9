"""The GPU decode step (bankml/engine_cupy/device_step.py) without a GPU: its kernels' NumPy
twins checked against plain float64 arithmetic, then the whole step run through the strict CuPy
stand-in whose kernels are those twins (tests/fake_cupy_kernels.py), against the CPU's exact
path, with the launches and host reads of every step counted.

What this cannot show: that each CUDA kernel gives its twin's bits on a device, and the speed
(bench/kernel_check.py, scripts/gpu-check.sh on a GPU).
"""

from __future__ import annotations

from pathlib import Path

import numpy
import pytest
from gguf import GGMLQuantizationType as T

from bankml.engine_cupy import cuda_twins as tw
from bankml.engine_cupy import device_step as ds
from bankml.engine_cupy import device_twins as dt
from bankml.engine_cupy.array_backend import apply_rope, rope_angles
from bankml.engine_cupy.model import Model
from bankml.engine_cupy.weights import UnsupportedModel, dequantize, open_reader, read_hparams
from tests.fake_cupy import READS
from tests.fake_cupy_kernels import KernelCupy
from tests.tiny_models import TinySpec, _matrix, write_tiny_model

F32 = numpy.float32
PROMPT = [1, 504, 3458, 282, 4649, 314, 28, 11, 2029]


def _logprobs(x: numpy.ndarray) -> numpy.ndarray:
    x = x.astype(numpy.float64)
    return x - x.max() - numpy.log(numpy.exp(x - x.max()).sum())


def _top10_diff(got: numpy.ndarray, want: numpy.ndarray) -> float:
    top = numpy.argsort(-want)[:10]
    return float(numpy.abs(_logprobs(got)[top] - _logprobs(want)[top]).max())


# --- the twins against float64 ------------------------------------------------------------------


def test_exp_rn_within_one_ulp_and_its_edges() -> None:
    x = numpy.linspace(-86.9, 87.9, 400_001).astype(F32)
    got, want = dt.exp_rn(x).astype(numpy.float64), numpy.exp(x.astype(numpy.float64))
    assert numpy.abs(got / want - 1).max() < 2**-23  # under one f32 ulp of the value
    edges = dt.exp_rn(numpy.asarray([0.0, -0.0, -87.5, -1e30, 88.5, numpy.inf], F32))
    assert edges.tolist() == [1.0, 1.0, 0.0, 0.0, numpy.inf, numpy.inf]


def test_rms_norm_twin() -> None:
    rng = numpy.random.default_rng(1)
    x, delta, weight = (rng.normal(size=576).astype(F32) for _ in range(3))
    new_x, q8 = dt.rms_norm_q8_1(x, delta, weight, 1e-5)
    assert new_x.tobytes() == (x + delta).tobytes()  # the residual add, one f32 rounding
    x64 = (x + delta).astype(numpy.float64)
    want = x64 / numpy.sqrt((x64 * x64).mean() + 1e-5) * weight
    got = q8.qs.astype(numpy.float64) * q8.d.astype(numpy.float64)[:, None]
    # within half a quant step of each block, plus 127 quants times d's f16 rounding
    step = q8.d.astype(numpy.float64)[:, None]
    assert numpy.all(numpy.abs(got - want.reshape(-1, 32)) <= step * (0.5 + 127 * 2**-11) + 1e-6)
    # the sum of squares in the kernel's order: threads of 256 strided, butterflies, warps
    sq = (x + delta) * (x + delta)
    acc = numpy.zeros(256, F32)
    for i, v in enumerate(sq):
        acc[i % 256] = F32(acc[i % 256] + v)
    total = F32(0)
    for w in range(8):
        total = F32(total + tw.butterfly_sum(acc[32 * w : 32 * w + 32]))
    scale = F32(1) / numpy.sqrt(total / F32(576) + F32(1e-5))
    assert (
        q8.to_bytes().tobytes()
        == tw.quantize_q8_1((x + delta) * scale * weight).to_bytes().tobytes()
    )


def test_swiglu_twin() -> None:
    rng = numpy.random.default_rng(2)
    g, u = (rng.normal(scale=4, size=1536).astype(F32) for _ in range(2))
    g[:4] = [-100, 100, 0, -0.0]
    got = dt.silu_mul(g, u).astype(numpy.float64)
    want = g / (1 + numpy.exp(-g.astype(numpy.float64))) * u
    assert numpy.abs(got - want).max() <= 4 * 2**-23 * numpy.abs(want).max()
    assert (
        dt.swiglu_q8_1(g, u).to_bytes().tobytes()
        == tw.quantize_q8_1(dt.silu_mul(g, u)).to_bytes().tobytes()
    )


@pytest.mark.parametrize("neox", [False, True])
def test_rope_twin_is_the_array_paths_rotation(neox: bool) -> None:
    rng = numpy.random.default_rng(3)
    hd, n_head, n_kv, n_ctx, pos = 64, 4, 2, 16, 11
    cos, sin = rope_angles(numpy, numpy.arange(n_ctx), hd, 10000.0, 1.0, None)
    q, k, v = (rng.normal(size=n * hd).astype(F32) for n in (n_head, n_kv, n_kv))
    bias = rng.normal(size=(n_head + 2 * n_kv) * hd).astype(F32)
    kc = numpy.zeros((n_kv, n_ctx, hd), numpy.float16)
    vc = numpy.zeros_like(kc)
    q_out = dt.rope_kv_f16(q, k, v, bias, pos, cos, sin, kc, vc, hd, neox)
    qb, kb = q + bias[: n_head * hd], k + bias[n_head * hd : (n_head + n_kv) * hd]
    want_q = apply_rope(qb.reshape(1, n_head, hd), cos[pos : pos + 1], sin[pos : pos + 1], neox)
    want_k = apply_rope(kb.reshape(1, n_kv, hd), cos[pos : pos + 1], sin[pos : pos + 1], neox)
    assert q_out.tobytes() == want_q.reshape(-1).astype(numpy.float16).astype(F32).tobytes()
    assert kc[:, pos].tobytes() == want_k[0].astype(numpy.float16).tobytes()
    vb = v + bias[(n_head + n_kv) * hd :]
    assert vc[:, pos].tobytes() == vb.reshape(n_kv, hd).astype(numpy.float16).tobytes()
    assert not kc[:, :pos].any() and not vc[:, pos + 1 :].any()  # only its own position


def test_attention_twin_against_float64() -> None:
    rng = numpy.random.default_rng(4)
    n_head, n_kv, hd, n_ctx, pos = 6, 2, 64, 40, 29
    q = rng.normal(size=n_head * hd).astype(numpy.float16).astype(F32)
    kc = rng.normal(scale=2, size=(n_kv, n_ctx, hd)).astype(numpy.float16)
    vc = rng.normal(size=(n_kv, n_ctx, hd)).astype(numpy.float16)
    scale = 1 / 8
    got = dt.attn_decode_f16(q, kc, vc, pos, n_head, scale).reshape(n_head, hd)
    for h in range(n_head):
        keys, vals = kc[h // 3, : pos + 1].astype(numpy.float64), vc[h // 3, : pos + 1]
        s = keys @ q[h * hd : (h + 1) * hd].astype(numpy.float64) * scale
        p = numpy.exp(s - s.max())
        want = (p / p.sum()) @ vals.astype(numpy.float64)
        assert numpy.abs(got[h] - want).max() < 1e-5 * max(1.0, numpy.abs(want).max())
    # a later position does not change the earlier ones' answer (T = pos + 1 positions only)
    kc2 = kc.copy()
    kc2[:, pos + 1 :] = 1000
    assert dt.attn_decode_f16(q, kc2, vc, pos, n_head, scale).tobytes() == got.tobytes()


def test_get_rows_and_argmax_twins() -> None:
    rng = numpy.random.default_rng(5)
    w, _ = _matrix(rng, 12, 576, T.Q8_0, 0.05)
    table = dequantize(numpy.asarray(w), T.Q8_0)
    for token in (0, 7, 11):
        assert dt.get_rows_q8_0(w, token, 576).tobytes() == table[token].astype(F32).tobytes()
    x = numpy.asarray([1, 5, -2, 5, 3], F32)
    assert dt.argmax_f32(x) == 1  # the lowest index among equals, as the kernel's comparisons


# --- the step through the stand-in --------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory: pytest.TempPathFactory, default_model: Path) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("device_step")
    specs = [
        TinySpec("llama", T.Q4_0),  # tied Q4_0 output: its embedding through the f32 table
        TinySpec("qwen2", T.Q8_0),  # biases, NEOX RoPE, Q8_0 embedding rows from their blocks
        TinySpec("llama", T.Q4_K, tied=False, llama3_rope=True, out_type=T.Q6_K),
        TinySpec("qwen3", T.Q4_0),  # Q/K norms: not the step's
    ]
    return {s.name: write_tiny_model(out / f"{s.name}.gguf", s, default_model) for s in specs}


def _device_step(path: Path, **fake: int) -> tuple[KernelCupy, ds.DeviceStep]:
    reader = open_reader(path)
    cp = KernelCupy(**fake)
    weights = ds.DeviceWeights.upload(cp, reader, read_hparams(reader))  # type: ignore[arg-type]
    return cp, ds.DeviceStep(cp, weights)  # type: ignore[arg-type]


PER_LAYER = [
    "rms_norm_q8_1",
    "mmvq_q",
    "mmvq_k",
    "mmvq_v",
    "rope_kv_f16",
    "attn_decode_f16",
    "mmvq_o",
    "rms_norm_q8_1",
    "mmvq_gate",
    "mmvq_up",
    "swiglu_q8_1",
    "mmvq_down",
]


@pytest.mark.parametrize(
    "name, bound", [("llama-Q4_0", 2.0), ("qwen2-Q8_0", 1.0), ("llama-Q4_K-untied-rope3", 1.0)]
)
def test_tiny_models_step_by_step(tiny_models: dict[str, Path], name: str, bound: float) -> None:
    """Each prompt token one step: 12 launches a layer and 4 around them, no host read inside a
    step; the chosen id one read of 4 bytes; the logits near the exact path's."""
    path = tiny_models[name]
    cp, step = _device_step(path)
    hp = step.hp
    seq = step.new_sequence(32)
    transfers = cp.transfers
    for token in PROMPT:
        step.set_token(seq, token)
        start, reads = len(cp.launches), dict(READS)
        step.step(seq)
        launches = [n for n, _, _ in cp.launches[start:]]
        assert dict(READS) == reads  # no .get(), asnumpy, int/float/bool, synchronize
        assert len(launches) == ds.launches_per_step(hp.n_layer) == 12 * hp.n_layer + 4
        assert launches[0].startswith("get_rows_") and launches[-3:-1] == [
            "rms_norm_q8_1",
            f"mmvq_{step.w.output.qtype.lower()}",
        ]
        assert launches[-1] == "argmax_f32"
        for il, layer in enumerate(step.w.layers):
            got = launches[1 + 12 * il : 13 + 12 * il]
            mats = {"q": layer.q, "k": layer.k, "v": layer.v, "o": layer.o}
            mats.update(gate=layer.gate, up=layer.up, down=layer.down)
            want = [
                f"mmvq_{mats[k.removeprefix('mmvq_')].qtype.lower()}"
                if k.startswith("mmvq_")
                else k
                for k in PER_LAYER
            ]
            assert got == want
    assert cp.transfers == transfers  # set_token writes in place: no new device array
    reads = dict(READS)
    chosen = step.chosen(seq)
    assert dict(READS) == {**reads, "get": reads.get("get", 0) + 1}
    got = step.host_logits()
    model = Model.load(path, device="cpu", progress=False)
    want = model.forward(PROMPT, model.new_cache(32))
    assert chosen == int(numpy.argmax(got))
    assert int(numpy.argmax(got)) == int(numpy.argmax(want))
    diff = _top10_diff(got, want)
    assert 0 < diff < bound, diff
    # the position and the cache live on the device: the step moved them
    assert int(seq.pos.get()[0]) == len(PROMPT) == seq.n_tokens
    assert (
        seq.k.host_view[:, :, len(PROMPT) - 1].any()
        and not seq.k.host_view[:, :, len(PROMPT)].any()
    )


def test_default_model_greedy_on_the_device(default_model: Path) -> None:
    """The default model: after the prompt, 6 tokens each chosen on the device (argmax) and fed
    to the next step without coming back, against the exact path's greedy tokens."""
    cp, step = _device_step(default_model)
    assert step.w.embd_qtype == "Q8_0"  # rows from the Q8_0 blocks, no f32 table
    seq = step.new_sequence(32)
    for token in PROMPT:
        step.set_token(seq, token)
        step.step(seq)
    model = Model.load(default_model, device="cpu", progress=False)
    cache = model.new_cache(32)
    want = model.forward(PROMPT, cache)
    diff = _top10_diff(step.host_logits(), want)
    tokens, exact = [], []
    for _ in range(6):
        tokens.append(step.chosen(seq))
        exact.append(int(numpy.argmax(want)))
        reads = sum(READS.values())
        step.step(seq)  # its input: the token the last step chose, still on the device
        assert sum(READS.values()) == reads
        want = model.forward([exact[-1]], cache)
    assert tokens == exact
    assert 0 < diff < 1.0, diff


def test_a_model_the_step_does_not_play(tiny_models: dict[str, Path]) -> None:
    with pytest.raises(UnsupportedModel, match="does not play architecture qwen3"):
        _device_step(tiny_models["qwen3-Q4_0"])


def test_a_model_too_big_for_the_device_is_refused_with_the_figures(
    tiny_models: dict[str, Path],
) -> None:
    path = tiny_models["qwen2-Q8_0"]
    reader = open_reader(path)
    need = ds.upload_bytes(reader, read_hparams(reader))
    with pytest.raises(ds.DeviceMemory, match=r"needs [\d.]+ MiB on the device.*free \(16\.0 MiB"):
        _device_step(path, free=need, total=16 << 20)
    cp, step = _device_step(path, free=2 * need, total=16 << 20)
    assert cp.launches == [] and cp.transfers > 0  # the upload itself launches nothing
    cp.free = 1 << 10
    with pytest.raises(ds.DeviceMemory, match="needs"):
        step.new_sequence(32)


def test_the_gpu_checks_device_step_report(tiny_models: dict[str, Path]) -> None:
    """bench/kernel_check.py's device-step part (what a GPU run reports: the step on the device
    against the same step through the twins), here with the stand-in on both sides."""
    from bench import kernel_check

    report = kernel_check.device_step_vs_twins(KernelCupy(), tiny_models["qwen2-Q8_0"], steps=2)  # type: ignore[arg-type]
    assert report["same_tokens"] and report["identical_steps"] == 2 == len(report["tokens"])
    assert report["launches_per_step"] == 12 * 2 + 4 and report["us_per_step"] is None
