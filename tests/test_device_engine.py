"""The engine on a GPU through the decode step (device_model.py, device_sampling.py) without a
GPU: ``cupy`` is the strict stand-in whose kernels are the NumPy twins
(tests/fake_cupy_kernels.py), and requests go through the engine's own request path
(parse_request, run_steps). Greedy tokens against the CPU's exact path; a seeded top-k draw
from the device's k pairs against the same draw from the whole row; the launches, host reads
and token writes of every generated token counted.

What this cannot show: the kernels' bits and speed on a device (scripts/gpu-check.sh).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy
import pytest
import pytest_twisted
from twisted.internet import reactor

from bankml.engine_cupy import device_sampling as dsm
from bankml.engine_cupy import device_step as ds
from bankml.engine_cupy import device_twins as dt
from bankml.engine_cupy import sampler as smp
from bankml.engine_cupy.device_model import DeviceCache, DeviceModel
from bankml.engine_cupy.engine import Engine
from bankml.engine_cupy.model import Model
from bankml.native.service import make_native_service
from tests.fake_cupy import READS
from tests.fake_cupy_kernels import KernelCupy
from tests.native_support import apost

PROMPT = "The capital of France is"
N_PREDICT = 3
PER_STEP = ds.launches_per_step(30)  # the default model's 30 layers


@pytest.fixture(scope="module")
def device(default_model: Path) -> Iterator[tuple[KernelCupy, Engine]]:
    cp = KernelCupy()
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(sys.modules, "cupy", cp)
        engine = Engine.open(default_model, n_ctx=32, device="cuda")
        yield cp, engine


@pytest.fixture(scope="module")
def writes(device: tuple[KernelCupy, Engine]) -> Iterator[list[int]]:
    """Every token the host writes to a device sequence (DeviceStep.set_token)."""
    _, engine = device
    step = engine.model.step
    seen: list[int] = []
    original = step.set_token

    def set_token(seq: Any, token: int) -> None:
        seen.append(token)
        original(seq, token)

    step.set_token = set_token
    yield seen
    step.set_token = original


def _run(
    cp: KernelCupy, engine: Engine, body: dict[str, Any], writes: list[int]
) -> tuple[list[int], list[dict[str, Any]], Any]:
    """The request's tokens, and per chunk after the first: launches by name, host reads and
    token writes since the chunk before (one decode step and one draw)."""
    req = engine.parse_request({"prompt": PROMPT, "n_predict": N_PREDICT, **body}, "completion")
    steps = engine.run_steps(req)
    tokens, per_token = [], []
    last = None
    for chunk in steps:
        mark = (len(cp.launches), dict(READS), len(writes))
        if last is not None:
            names = [n for n, _, _ in cp.launches[last[0] : mark[0]]]
            reads = {k: v - last[1].get(k, 0) for k, v in READS.items() if v != last[1].get(k, 0)}
            per_token.append(
                {
                    "launches": len(names),
                    "top_k": names.count("top_k_f32"),
                    "reads": reads,
                    "writes": mark[2] - last[2],
                }
            )
        last = mark
        tokens.append(chunk.token)
    return tokens, per_token, steps.summary


@pytest.fixture(scope="module")
def exact(default_model: Path) -> Engine:
    return Engine.open(default_model, n_ctx=32, device="cpu")


def test_the_engine_runs_the_device_step(device: tuple[KernelCupy, Engine]) -> None:
    _, engine = device
    assert isinstance(engine.model, DeviceModel) and engine.model.array_path_reason is None
    assert all(isinstance(slot.cache, DeviceCache) for slot in engine.slots)
    assert engine.host_cache.enabled  # --cache-ram's default: entries copied on the device


def test_greedy_tokens_chosen_on_the_device_equal_the_exact_paths(
    device: tuple[KernelCupy, Engine], writes: list[int], exact: Engine
) -> None:
    cp, engine = device
    got, per_token, summary = _run(cp, engine, {"temperature": 0}, writes)
    want = [
        c.token
        for c in exact.run_steps(
            exact.parse_request(
                {"prompt": PROMPT, "n_predict": N_PREDICT, "temperature": 0}, "completion"
            )
        )
    ]
    assert got == want and len(got) == N_PREDICT
    assert summary.timings["prompt_n"] == len(engine.tokenize(PROMPT, add_special=True))
    # each later token: one decode step, the greedy id read back (4 bytes), nothing written
    assert per_token == [{"launches": PER_STEP, "top_k": 0, "reads": {"get": 1}, "writes": 0}] * (
        N_PREDICT - 1
    )


def test_a_prompt_is_one_prefill_then_one_step_and_its_greedy_tokens_the_exact_paths(
    device: tuple[KernelCupy, Engine], exact: Engine
) -> None:
    """A prompt the slot does not hold: its tokens before the last through the prefill
    (device_prefill.py, the cache only, no output head), its last token through one decode
    step, whose logits the first draw reads; the greedy tokens are the exact path's."""
    from bankml.engine_cupy.device_prefill import launches_per_prefill

    cp, engine = device
    body = {"prompt": "Paris is a city in", "n_predict": 2, "temperature": 0}
    start = len(cp.launches)
    steps = engine.run_steps(engine.parse_request(dict(body), "completion"))
    first = next(iter(steps))
    names = [n for n, _, _ in cp.launches[start:]]
    got = [first.token] + [c.token for c in steps]
    want = [c.token for c in exact.run_steps(exact.parse_request(dict(body), "completion"))]
    assert got == want
    assert steps.summary.timings["prompt_n"] == len(engine.tokenize(body["prompt"], True)) > 2
    prefill, step = names[:-PER_STEP], names[-PER_STEP:]
    assert len(prefill) == launches_per_prefill(30, logits=False)  # cuBLAS calls: "gemm"
    assert prefill.count("attn_prefill_f16") == 30 and "attn_decode_f16" not in prefill
    assert "argmax_f32" not in prefill and step.count("attn_decode_f16") == 30
    assert step[-1] == "argmax_f32"


def test_a_seeded_top_k_draw_from_the_device_pairs_equals_the_draw_from_the_row(
    device: tuple[KernelCupy, Engine], writes: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    cp, engine = device
    body = {"temperature": 1.5, "top_k": 20, "top_p": 0.95, "seed": 7}
    got, per_token, summary = _run(cp, engine, body, writes)
    # the slot held the prompt: only its last token is evaluated again
    assert summary.timings["prompt_n"] == 1
    # each later token: a step and the top-k kernel, one read of 2k + 1 ints, the drawn id up
    assert per_token == [
        {"launches": PER_STEP + 1, "top_k": 1, "reads": {"get": 1}, "writes": 1}
    ] * (N_PREDICT - 1)
    # the same request drawing from the whole row (n_probs asks for it), and with the chain's
    # NumPy stages in place of the compiled tail: the same tokens
    full, per_full, _ = _run(cp, engine, {**body, "n_probs": 1}, writes)
    assert all(t["top_k"] == 0 for t in per_full)
    monkeypatch.setattr(smp, "FAST_CHAIN", False)
    stages, _, _ = _run(cp, engine, body, writes)
    assert got == full == stages, (got, full, stages)


def test_a_logit_bias_is_added_on_the_device_before_the_top_k(
    device: tuple[KernelCupy, Engine], writes: list[int]
) -> None:
    """ignore_eos and a logit bias (added to a copy of the row on the device, then the top-k
    pairs): the same tokens as the request drawing from the whole row; greedy with a bias that
    makes a token the largest: that token first, from the biased row's top-1 pair (the step's
    own argmax, unbiased, would not give it)."""
    cp, engine = device
    eog = sorted(engine.tokenizer.eog_ids)
    sampled = {"top_k": 20, "seed": 5, "ignore_eos": True, "logit_bias": [[11, 3.0]]}
    sampled["n_predict"] = 2
    got, per_token, _ = _run(cp, engine, sampled, writes)
    full, _, _ = _run(cp, engine, {**sampled, "n_probs": 1}, writes)
    assert got == full and not set(got) & set(eog)
    assert all(t["top_k"] == 1 and t["reads"] == {"get": 1} for t in per_token)
    forced = {"temperature": 0, "logit_bias": [[11, 100.0]], "n_predict": 2}
    greedy, per_greedy, _ = _run(cp, engine, forced, writes)
    assert greedy[0] == 11
    assert all(t["top_k"] == 1 and t["reads"] == {"get": 1} for t in per_greedy)


def test_the_draw_reads_only_what_the_request_needs(device: tuple[KernelCupy, Engine]) -> None:
    _, engine = device

    def mode(**body: Any) -> tuple[str, int]:
        req = engine.parse_request({"prompt": PROMPT, **body}, "completion")
        sampler = engine._guided_sampler(req.sampler, req.constraint, req.reasoning_budget, "")
        return dsm.choice(sampler, req.n_probs, engine.n_vocab)

    assert mode(temperature=0) == (dsm.GREEDY, 0)
    assert mode() == (dsm.TOP_K, 40)  # llama-server's default chain starts with its top-k
    assert mode(top_k=200) == (dsm.FULL, 0)  # more pairs than the kernel hands back
    assert mode(top_k=0) == (dsm.FULL, 0)
    assert mode(n_probs=2) == (dsm.FULL, 0)
    assert mode(repeat_penalty=1.1) == (dsm.FULL, 0)  # penalties act before the top-k
    assert mode(logit_bias=[[11, 1.0]]) == (dsm.TOP_K, 40)  # added on the device
    assert mode(logit_bias=[[11, 1.0], [11, 2.0]]) == (dsm.FULL, 0)  # added in turn: the host
    assert mode(grammar='root ::= "a"') == (dsm.FULL, 0)
    assert mode(samplers=["top_p", "top_k", "temperature"]) == (dsm.FULL, 0)
    assert mode(mirostat=2) == (dsm.FULL, 0)


def test_the_top_k_kernel_twin_is_the_hosts_stable_top_k() -> None:
    rng = numpy.random.default_rng(3)
    x = rng.normal(size=5000).astype(numpy.float32).round(1)  # many equal values
    x[[7, 9]] = -numpy.inf
    for k in (1, 40, 128):
        out = dt.top_k_f32(x, k)
        order = smp.top_k_order(x, k)
        assert out[:k].tolist() == order.tolist() and out[2 * k] == 0
        assert out[k : 2 * k].view(numpy.float32).tobytes() == x[order].tobytes()
    x[11] = numpy.nan
    assert dt.top_k_f32(x, 4)[8] == 1
    short = dt.top_k_f32(numpy.asarray([1, numpy.nan, 2], numpy.float32), 3)
    assert short[:3].tolist() == [2, 0, -1] and short[6] == 1


def test_a_model_the_step_does_not_play_keeps_the_array_path(
    tmp_path: Path, default_model: Path
) -> None:
    from gguf import GGMLQuantizationType as T

    from tests.tiny_models import TinySpec, write_tiny_model

    path = write_tiny_model(tmp_path / "qwen3.gguf", TinySpec("qwen3", T.Q4_0), default_model)
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(sys.modules, "cupy", KernelCupy())
        model = Model.load(path, device="cuda", progress=False)
    assert not isinstance(model, DeviceModel)
    assert model.array_path_reason is not None and "qwen3" in model.array_path_reason


def test_two_slots_step_in_turn_each_with_its_own_logits(default_model: Path) -> None:
    """Two runs advanced side by side as the scheduler advances them (forward_rows: both slots'
    passes, then both draws): each slot's sequence keeps its own logits on the device, so each
    run's top-k draws are those it gets alone, with its prompt found whole in its slot (the
    last prompt token one step again) and evaluated afresh (cache_prompt false). Each prompt's
    pass is a prefill then one step, whose logits the draw reads (device_model.md), so the
    three give the same bits; the side-by-side decode steps are one batched step of both
    slots (DeviceStep.step_rows), each row its own step's bits."""
    from bankml.native.scheduler import forward_rows

    cp = KernelCupy()
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(sys.modules, "cupy", cp)
        engine = Engine.open(default_model, n_ctx=32, device="cuda", n_slots=2)
    sampling = {"n_predict": 2, "top_k": 10, "temperature": 0.7, "seed": 3}
    bodies = [{"prompt": p, **sampling} for p in ("Hi there, my", "Paris is the capital")]
    runs = [engine.run_steps(engine.parse_request(b, "completion")).coroutine for b in bodies]
    tokens: list[list[int]] = [[], []]
    replies: list[Any] = [None, None]
    live = [True, True]
    while any(live):
        asked = []
        for i, run in enumerate(runs):
            if not live[i]:
                continue
            try:
                item = run.send(replies[i])
                while not getattr(item, "is_forward", False):
                    if hasattr(item, "token"):
                        tokens[i].append(item.token)
                    item = run.send(None)
                asked.append((i, item))
            except StopIteration:
                live[i] = False
        if asked:
            rows, _ = forward_rows([f for _, f in asked])
            for (i, _), row in zip(asked, rows):
                replies[i] = row
    slots = {s.id: s.tokens for s in engine.slots}
    assert slots[0] != slots[1]  # a slot each
    assert tokens[0] != tokens[1] and all(len(t) == 2 for t in tokens)
    # the second tokens' decode steps, both slots', went through one batched step
    assert [name for name, _, _ in cp.launches].count("argmax_f32_rows") == 1
    for body, side_by_side in zip(bodies, tokens):
        held = engine.run_steps(engine.parse_request(body, "completion"))
        assert [c.token for c in held] == side_by_side
        assert held.summary.timings["prompt_n"] == 1  # found whole in its slot
        fresh_body = {**body, "cache_prompt": False}
        fresh = engine.run_steps(engine.parse_request(fresh_body, "completion"))
        assert [c.token for c in fresh] == side_by_side
        assert fresh.summary.timings["prompt_n"] == len(engine.tokenize(body["prompt"], True)) > 2


@pytest.fixture(scope="module")
def served_cuda(
    default_model: Path, default_fork: Path, tmp_path_factory: Any
) -> Iterator[tuple[str, Any]]:
    """``bankml serve --native --device cuda`` in this process (NativeService as the tap
    starts it), ``cupy`` the stand-in: bankml's own address and its NativeEngine."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(sys.modules, "cupy", KernelCupy())
        svc = make_native_service(
            {
                "file": str(default_model),
                "fork": str(default_fork),
                "ctx": 32,
                "device": "cuda",
                "listen": "127.0.0.1:0",
                "upstream": "127.0.0.1:0",
                "slot-dir": str(tmp_path_factory.mktemp("device-slots")),
                "llama": {"embedding": {"enabled": True}},  # --embeddings
            },
            reactor,
        )
        svc.exit_at_interpreter_end = False
        svc.startService()
        pytest_twisted.blockon(svc.ready)
        assert svc.native is not None and len(svc.ports) == 2
        try:
            yield f"http://127.0.0.1:{svc.port_of(0)}", svc.native
        finally:
            pytest_twisted.blockon(svc.stopService())


@pytest_twisted.ensureDeferred
async def test_a_completion_over_http_on_the_device_path(
    served_cuda: tuple[str, Any], device: tuple[KernelCupy, Engine]
) -> None:
    """One greedy /completion through the real HTTP path of a --device cuda server: the engine's
    own greedy text on the device path, and its receipt."""
    url, native = served_cuda
    assert isinstance(native.engine.model, DeviceModel)
    body = {"prompt": PROMPT, "n_predict": 2, "temperature": 0}
    status, answer = await apost(url + "/completion", body)
    assert status == 200, answer
    _, engine = device
    want = list(engine.run_steps(engine.parse_request(body, "completion")))
    assert answer["content"] == "".join(c.text for c in want)
    assert answer["tokens_predicted"] == 2 and "bankml_receipt" in answer
    assert answer["bankml_receipt"]["engine"].endswith("native (cuda)")
    # embeddings: the prefill's rows after the output norm (DeviceModel.hidden_states)
    status, answer = await apost(url + "/embedding", {"content": "Paris"})
    assert status == 200, answer
    values = numpy.asarray(answer[0]["embedding"], dtype=numpy.float32)
    assert values.shape[-1] == native.engine.model.hp.n_embd and numpy.isfinite(values).all()
    assert "bankml_receipt" in json.dumps(answer)  # signed as on the CPU
    # several inputs of one request (the model's pooling is none: a vector per token): each
    # its own pass, the vectors it gets alone
    status, two = await apost(url + "/embedding", {"content": ["Paris", "Rome"]})
    assert status == 200 and [d["index"] for d in two] == [0, 1], two
    assert two[0]["embedding"] == answer[0]["embedding"] != two[1]["embedding"]


def test_a_context_shift_on_the_device_follows_the_exact_paths(
    device: tuple[KernelCupy, Engine], exact: Engine
) -> None:
    """llama-server's context shift (keep 1, drop 2, the rest moved down and their keys turned
    by RoPE at -2) on a device sequence, then one step: near the exact path's logits after the
    same shift, and nearer than without the shift."""
    _, engine = device
    tokens = engine.tokenize(PROMPT, add_special=True) + [11]
    dev, cpu = engine.model, exact.model
    shifted, kept = dev.new_cache(16), dev.new_cache(16)
    dev.forward(tokens[:-1], shifted)
    kept.copy_from(shifted)  # a device copy of the sequence (a shared prompt's child's)
    dev.shift_context(shifted, 1, 2)
    assert shifted.n_tokens == len(tokens) - 3
    got = numpy.asarray(dev.forward(tokens[-1:], shifted))
    unshifted = numpy.asarray(dev.forward(tokens[-1:], kept))
    ref = cpu.new_cache(16)
    cpu.forward(tokens[:-1], ref)
    cpu.shift_context(ref, 1, 2)
    want = cpu.forward(tokens[-1:], ref)
    assert int(numpy.argmax(got)) == int(numpy.argmax(want))
    assert _top10_diff(got, want) < 1.0 < _top10_diff(unshifted, want)


def _top10_diff(got: numpy.ndarray, want: numpy.ndarray) -> float:
    def logprobs(x: numpy.ndarray) -> numpy.ndarray:
        x = x.astype(numpy.float64)
        return x - x.max() - numpy.log(numpy.exp(x - x.max()).sum())

    top = numpy.argsort(-want)[:10]
    return float(numpy.abs(logprobs(got)[top] - logprobs(want)[top]).max())


def test_a_device_slot_saved_erased_and_restored_answers_as_before(
    device: tuple[KernelCupy, Engine], writes: list[int], tmp_path: Path
) -> None:
    """/slots save, erase and restore on the device path (slots.py): the file holds the
    sequence's f16 K/V bits (saved again after the restore: the same bytes), and the restored
    slot serves the prompt from its cells (only the last prompt token evaluated again)."""
    from bankml.engine_cupy import slots

    cp, engine = device
    body = {"temperature": 0}
    before, _, _ = _run(cp, engine, body, writes)
    first, second = tmp_path / "a.bin", tmp_path / "b.bin"
    sha = "0" * 64
    saved = slots.save_slot(engine, str(first), sha)
    assert saved.n_tokens == len(engine.slots[0].tokens) > 0
    assert slots.erase_slot(engine) == saved.n_tokens and engine.cache.n_tokens == 0
    assert slots.restore_slot(engine, str(first), sha).n_tokens == saved.n_tokens
    slots.save_slot(engine, str(second), sha)
    assert first.read_bytes() == second.read_bytes()
    after, _, summary = _run(cp, engine, body, writes)
    assert summary.timings["prompt_n"] == 1 and after == before


def test_the_gpu_checks_device_engine_report(tmp_path: Path, default_model: Path) -> None:
    """bench/kernel_check.py's device-engine part (what a GPU run reports: the engine on the
    decode step on the device against the same engine through the twins), here with the
    stand-in on both sides and a tiny qwen2 model."""
    from gguf import GGMLQuantizationType as T

    from bench import kernel_check
    from tests.tiny_models import TinySpec, write_tiny_model

    path = write_tiny_model(tmp_path / "qwen2.gguf", TinySpec("qwen2", T.Q8_0), default_model)
    before = sys.modules.get("cupy")
    report = kernel_check.device_engine_vs_twins(KernelCupy(), path, n_predict=2)  # type: ignore[arg-type]
    for part in ("greedy", "top_k"):
        assert report[part]["same_tokens"] and len(report[part]["tokens"]) == 2, report
        assert isinstance(report[part]["decode_tokens_per_s"], float)  # a figure, not a bound
    # the greedy request's prompt is new to the slot: a prefill then a step; the top-k
    # request finds it whole: its last token one step again
    n_prompt = report["greedy"]["prompt_n"]
    assert n_prompt > 2 and report["top_k"]["prompt_n"] == 1
    assert report["greedy"]["prompt_passes_on_twins"]["prefills"] == 1
    assert report["greedy"]["prompt_passes_on_twins"]["steps"] == 1
    assert report["top_k"]["prompt_passes_on_twins"]["prefills"] == 0
    assert report["top_k"]["prompt_passes_on_twins"]["steps"] == 1
    assert sys.modules.get("cupy") is before  # the check puts back the module it found


def _hip_cupy(fails: str | None = None) -> KernelCupy:
    """The stand-in as CuPy's HIP build (``cuda.runtime.is_hip``), its compiler refusing the
    kernel ``fails`` as hiprtc refuses a source it cannot compile."""

    class HipCupy(KernelCupy):
        def RawModule(self, code: str, options: tuple = ()) -> Any:  # noqa: N802 (CuPy's name)
            module = super().RawModule(code, options)
            if fails is not None and f" {fails}(" in code:
                raise RuntimeError(f"hiprtc: error: {fails} does not compile\nmore lines")
            return module

    hip = HipCupy()
    hip.cuda.runtime.is_hip = True  # type: ignore[attr-defined]
    return hip


def test_rocm_runs_the_step_with_hiprtcs_options(tmp_path: Path, default_model: Path) -> None:
    """CuPy's HIP build: the same kernels, compiled with hiprtc's options (no --fmad=false,
    which hiprtc does not know) as the model loads, every one the step and the prefill launch;
    no graph capture; the greedy tokens those of the CUDA build."""
    from gguf import GGMLQuantizationType as T

    from bankml.engine_cupy import cuda_kernels
    from tests.tiny_models import TinySpec, write_tiny_model

    path = write_tiny_model(tmp_path / "qwen2.gguf", TinySpec("qwen2", T.Q8_0), default_model)
    tokens = {}
    for kind, cp in (("hip", _hip_cupy()), ("cuda", KernelCupy())):
        with pytest.MonkeyPatch.context() as mp:
            mp.setitem(sys.modules, "cupy", cp)
            model = Model.load(path, device="cuda", progress=False)
            assert isinstance(model, DeviceModel), model.array_path_reason
            compiled = len(cp.modules)
            cache = model.new_cache(64)
            ids = [1, 2, 3]
            for _ in range(3):
                ids.append(int(model.forward(ids, cache).greedy()))
            tokens[kind] = ids
        options = {opts for _, opts in cp.modules}
        if kind == "hip":
            assert options == {tuple(cuda_kernels.hip_options())}
            assert compiled == len(model.kernel_names())  # all of them at load, before a request
            assert "HIP" in str(ds.graph_unsupported(cp))
        else:
            assert options == {tuple(cuda_kernels.options())}
            assert compiled == 0  # on CUDA they compile at first use (or in the warm-up)
    assert tokens["hip"] == tokens["cuda"]


def test_rocm_keeps_the_array_path_where_a_kernel_does_not_compile(
    tmp_path: Path, default_model: Path
) -> None:
    """hiprtc refusing one of the step's kernels: the model takes the array path, the reason
    naming the kernel and hiprtc's first line, rather than failing at its first request."""
    from gguf import GGMLQuantizationType as T

    from tests.tiny_models import TinySpec, write_tiny_model

    path = write_tiny_model(tmp_path / "qwen2.gguf", TinySpec("qwen2", T.Q8_0), default_model)
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(sys.modules, "cupy", _hip_cupy(fails="attn_decode_f16"))
        model = Model.load(path, device="cuda", progress=False)
    assert not isinstance(model, DeviceModel)
    assert model.array_path_reason == (
        "ROCm: kernel attn_decode_f16 does not compile here"
        " (RuntimeError: hiprtc: error: attn_decode_f16 does not compile)"
    )


def test_a_context_past_the_training_one_grows_the_rope_table(
    tmp_path: Path, default_model: Path
) -> None:
    """A slot's context longer than the model's training context (llama-server allows it): the
    RoPE table grows, its earlier rows the same bits, and a step past the training context
    writes its position."""
    from gguf import GGMLQuantizationType as T

    from bankml.engine_cupy.weights import open_reader, read_hparams
    from tests.tiny_models import TinySpec, write_tiny_model

    path = write_tiny_model(tmp_path / "qwen2.gguf", TinySpec("qwen2", T.Q8_0), default_model)
    reader = open_reader(path)
    hp = read_hparams(reader)
    cp = KernelCupy()
    step = ds.DeviceStep(cp, ds.DeviceWeights.upload(cp, reader, hp))  # type: ignore[arg-type]
    before = step.w.cos.host_view.copy()
    seq = step.new_sequence(hp.n_ctx_train + 16)
    assert step.w.cos.shape == (hp.n_ctx_train + 16, hp.head_dim // 2)
    assert step.w.cos.host_view[: hp.n_ctx_train].tobytes() == before.tobytes()
    past = hp.n_ctx_train + 5
    seq.pos.set(numpy.asarray([past], numpy.int32))
    seq.n_tokens = past
    step.set_token(seq, 11)
    step.step(seq)
    assert seq.k.host_view[:, :, past].any() and int(seq.pos.get()[0]) == past + 1


def test_a_prompt_cache_entry_is_a_device_copy_put_back_bit_for_bit(
    tmp_path: Path, default_model: Path
) -> None:
    """The prompt cache (--cache-ram) on the device path: ``snapshot`` copies a sequence's
    positions on the device (no host read), and ``restore`` puts them back after the cells were
    written over, the same bits, the position set."""
    from gguf import GGMLQuantizationType as T

    from bankml.engine_cupy.prompt_cache import HostPromptCache
    from tests.tiny_models import TinySpec, write_tiny_model

    path = write_tiny_model(tmp_path / "qwen2.gguf", TinySpec("qwen2", T.Q8_0), default_model)
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(sys.modules, "cupy", KernelCupy())
        model = Model.load(path, device="cuda", progress=False)
    assert isinstance(model, DeviceModel)
    cache = model.new_cache(16)
    model.forward([1, 504, 3458], cache)
    k, v = cache.seq.k.host_view[:, :, :3].copy(), cache.seq.v.host_view[:, :, :3].copy()
    store = HostPromptCache(None)
    reads = dict(READS)
    store.save([1, 504, 3458], cache)
    # counted as llama-server's state of the sequence: its f16 rows (the copies' bytes), 12
    # bytes a cell, 8 of streams and 16 of layout, 24 a layer (KVCache.state_nbytes)
    metadata = 8 + 12 * 3 + 16 + 24 * cache.step.hp.n_layer
    assert dict(READS) == reads and store.nbytes == k.nbytes + v.nbytes + metadata
    cache.truncate(0)
    model.forward([7, 8, 9, 10], cache)
    assert cache.seq.k.host_view[:, :, :3].tobytes() != k.tobytes()
    entry = store.take_better([7], [1, 504, 3458, 11])
    assert entry is not None
    cache.restore(entry.kv, len(entry.tokens))
    assert cache.n_tokens == 3 and int(cache.seq.pos.get()[0]) == 3
    assert cache.seq.k.host_view[:, :, :3].tobytes() == k.tobytes()
    assert cache.seq.v.host_view[:, :, :3].tobytes() == v.tobytes()


def test_a_pass_longer_than_a_prefill_is_prefilled_in_chunks_then_one_step(
    tmp_path: Path, default_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pass of more rows than ``PREFILL_ROWS`` (set to 2 here): its rows before the last in
    prefills of at most that many, then one step for the last, the position after all of
    them; the same greedy token as one prefill of the same rows. A speculative check
    (all_logits) is one step a token, no prefill."""
    from gguf import GGMLQuantizationType as T

    from bankml.engine_cupy import device_model as dm
    from tests.tiny_models import TinySpec, write_tiny_model

    path = write_tiny_model(tmp_path / "qwen2.gguf", TinySpec("qwen2", T.Q8_0), default_model)
    cp = KernelCupy()
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(sys.modules, "cupy", cp)
        model = Model.load(path, device="cuda", progress=False)
    assert isinstance(model, DeviceModel)
    ids = [1, 504, 3458, 11, 7, 9]
    whole = model.new_cache(16)
    want = model.forward(ids, whole).greedy()
    monkeypatch.setattr(dm, "PREFILL_ROWS", 2)
    cache = model.new_cache(16)
    start = len(cp.launches)
    got = model.forward(ids, cache)
    names = [n for n, _, _ in cp.launches[start:]]
    assert names.count("advance_pos") == 3 and names.count("argmax_f32") == 1  # 2 + 2 + 1, 1
    assert names[-1] == "argmax_f32" and cache.n_tokens == len(ids) == int(cache.seq.pos.get()[0])
    assert got.greedy() == want
    start = len(cp.launches)
    rows = model.forward([5, 6, 8], cache, all_logits=True)
    names = [n for n, _, _ in cp.launches[start:]]
    assert rows.shape[0] == 3 and names.count("argmax_f32") == 3 and "advance_pos" not in names
