#!/usr/bin/env python3
"""Each CUDA kernel against its NumPy twin, on this machine's GPU.

    bench/kernel_check.py [--model FILE] [--rows N] [--cols N]

``kernels_vs_twins(cupy, model)`` runs every kernel of ``bankml/engine_cupy/cuda`` through
``cuda_loader.CudaKernels`` and compares its output with ``cuda_twins``: the q8_1 bytes of one
activation row, and for each weight type a generated matrix (``--rows`` x ``--cols``) and, with
a model, the first matrix of each of its types. Each comparison says whether the bits are
identical, how many rows differ and by how much; with CuPy's events it also times one product
(microseconds per launch pair, quantization included). bench/gpu_check.py adds this report to
its own on a CUDA machine (docs/gpu.md); it prints one JSON line when run alone. Figures to
read, not a verdict: a kernel that differs from its twin in a bit differs from the arithmetic
the twin documents, and one of the two has a bug. With a model it also runs the decode step
(``device_step_vs_twins``), the batched step against each slot's own step
(``device_rows_vs_steps``) and the prefill (``device_prefill_vs_twins``) on the device against
the same through the twins, and the step replayed from CUDA graphs against the same step
uncaptured (``device_graphs_vs_uncaptured``: bits and decode tokens per second), and the
embeddings' hidden states (``device_hidden_vs_twins``) against the twins' and the exact path's.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy
from gguf import GGMLQuantizationType as T

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bankml.engine_cupy import cuda_twins as tw  # noqa: E402
from bankml.engine_cupy.cuda_loader import CudaKernels  # noqa: E402
from bankml.engine_cupy.gguf_file import open_file  # noqa: E402
from tests.tiny_models import _matrix  # noqa: E402

STEP_PROMPT = [1, 504, 3458, 282, 4649, 314, 28, 11, 2029]


def compare(got: numpy.ndarray, want: numpy.ndarray) -> dict[str, Any]:
    """Bits identical, how many values (rows, or q8_1 bytes) differ, the largest difference
    (absolute, and over max |want|)."""
    same = got.tobytes() == want.tobytes()
    out: dict[str, Any] = {"identical": same, "n": int(want.shape[0])}
    if not same:
        g, w = got.astype(numpy.float64), want.astype(numpy.float64)
        diff = numpy.abs(g - w)
        out.update(
            differing=int((got != want).sum()),
            max_abs_diff=float(numpy.nanmax(diff)) if diff.size else 0.0,
            max_rel_diff=float(numpy.nanmax(diff) / max(numpy.abs(w).max(), 1e-30)),
        )
    return out


def _time_us(cp: ModuleType, run: Any, repeats: int = 50) -> float | None:
    """Microseconds per call on the device (CuPy's events), or None without them."""
    cuda = getattr(cp, "cuda", None)
    if cuda is None or not hasattr(cuda, "Event"):
        return None
    run()
    start, stop = cuda.Event(), cuda.Event()
    start.record()
    for _ in range(repeats):
        run()
    stop.record()
    stop.synchronize()
    return round(cuda.get_elapsed_time(start, stop) * 1000 / repeats, 2)


def _product(
    cp: ModuleType, kernels: CudaKernels, qtype: str, w: numpy.ndarray, x: numpy.ndarray
) -> dict[str, Any]:
    w_dev, x_dev = cp.asarray(numpy.ascontiguousarray(w)), cp.asarray(x)
    got = cp.asnumpy(kernels.matvec(qtype, w_dev, x_dev))
    out = compare(got, tw.mmvq(qtype, w, x))
    out["us_per_product"] = _time_us(cp, lambda: kernels.matvec(qtype, w_dev, x_dev))
    return out


def _activation(rng: numpy.random.Generator, cols: int) -> numpy.ndarray:
    x = rng.normal(size=cols).astype(numpy.float32)
    x[:32] *= numpy.float32(40)  # blocks of different scales
    return x


def kernels_vs_twins(
    cp: ModuleType, model: Path | None = None, rows: int = 2048, cols: int = 4096, seed: int = 0
) -> dict[str, Any]:
    rng = numpy.random.default_rng(seed)
    started = time.monotonic()
    kernels = CudaKernels(cp)
    x = _activation(rng, cols)
    got = cp.asnumpy(kernels.quantize_q8_1(cp.asarray(x)))
    report: dict[str, Any] = {"quantize_q8_1": compare(got, tw.quantize_q8_1(x).to_bytes())}
    generated: dict[str, Any] = {}
    for qtype in tw.BLOCK_TYPES:
        w, _ = _matrix(rng, rows, cols, T[qtype], 0.05)
        generated[qtype] = _product(cp, kernels, qtype, w, x)
    report["generated"] = generated
    if model is not None:
        seen: dict[str, Any] = {}
        for t in open_file(model).tensors:
            qtype = t.tensor_type.name
            if qtype in tw.BLOCK_TYPES and qtype not in seen:
                width = t.data.shape[1] // tw.BLOCK_TYPES[qtype].block_bytes
                xm = _activation(rng, width * tw.BLOCK_TYPES[qtype].values)
                seen[qtype] = {"tensor": t.name, **_product(cp, kernels, qtype, t.data, xm)}
        report["model"] = seen
    checked = [report["quantize_q8_1"], *generated.values(), *report.get("model", {}).values()]
    report["identical"] = sum(c["identical"] for c in checked)
    report["checked"] = len(checked)
    report["elapsed_s"] = round(time.monotonic() - started, 2)
    return report


def _weights(cp: ModuleType, model: Path) -> Any:
    """The model's weights on ``cp``'s device, in their GGUF blocks (DeviceWeights)."""
    from bankml.engine_cupy import device_step as ds
    from bankml.engine_cupy.weights import read_hparams

    reader = open_file(model)
    return ds.DeviceWeights.upload(cp, reader, read_hparams(reader))


def _run_step(cp: ModuleType, model: Path, steps: int) -> tuple[list[int], list[Any], Any]:
    """The prompt, then ``steps`` greedy tokens chosen on the device: the chosen ids, the
    logits after each step (host copies), and the DeviceStep."""
    from bankml.engine_cupy import device_step as ds

    step = ds.DeviceStep(cp, _weights(cp, model), graphs=False)
    seq = step.new_sequence(len(STEP_PROMPT) + steps + 1)
    for token in STEP_PROMPT:
        step.set_token(seq, token)
        step.step(seq)
    chosen, logits = [], []
    for _ in range(steps):
        chosen.append(step.chosen(seq))
        logits.append(step.host_logits())
        step.step(seq)
    return chosen, logits, (step, seq)


def device_step_vs_twins(cp: ModuleType, model: Path, steps: int = 8) -> dict[str, Any]:
    """The whole decode step (engine_cupy/device_step.py) on the device against the same step
    through the twins (tests/fake_cupy_kernels.py): greedy ids, logits bits per step, launches
    per step, and microseconds per step on the device."""
    from tests.fake_cupy_kernels import KernelCupy

    started = time.monotonic()
    got_ids, got_logits, (step, seq) = _run_step(cp, model, steps)
    want_ids, want_logits, _ = _run_step(KernelCupy(), model, steps)
    per_step = [compare(g, w) for g, w in zip(got_logits, want_logits)]
    out: dict[str, Any] = {
        "tokens": got_ids,
        "same_tokens": got_ids == want_ids,
        "identical_steps": sum(c["identical"] for c in per_step),
        "steps": per_step,
        "launches_per_step": 12 * step.hp.n_layer + 4,
    }

    def one() -> None:  # position 0 again each time (its cache row overwritten in place)
        seq.pos.fill(0)
        seq.n_tokens = 0
        step.step(seq)

    out["us_per_step"] = _time_us(cp, one, repeats=20)
    out["elapsed_s"] = round(time.monotonic() - started, 2)
    return out


def device_rows_vs_steps(cp: ModuleType, model: Path, rows: int = 4) -> dict[str, Any]:
    """The batched decode step (DeviceStep.step_rows) on the device against each slot's own
    one-row step on the same device: ``rows`` slots at different positions (prompt prefixes of
    1.. ``rows`` tokens), stepped together then alone for 3 rounds, each slot's logits bits
    compared; microseconds for one batched step of the ``rows`` slots and for their ``rows``
    one-row steps."""
    from bankml.engine_cupy import device_step as ds

    started = time.monotonic()
    step = ds.DeviceStep(cp, _weights(cp, model), graphs=False)
    n_ctx = len(STEP_PROMPT) + 8
    together, alone = step.new_sequences(rows, n_ctx), step.new_sequences(rows, n_ctx)
    for seqs in (together, alone):
        for i, seq in enumerate(seqs):
            for token in STEP_PROMPT[: i % len(STEP_PROMPT) + 1]:
                step.set_token(seq, token)
                step.step(seq)
    identical, differing = 0, 0
    for _ in range(3):
        step.step_rows(together)
        for seq in alone:
            step.step(seq)
        for a, b in zip(together, alone):
            same = step.host_logits(a).tobytes() == step.host_logits(b).tobytes()
            identical, differing = identical + same, differing + (not same)
    out: dict[str, Any] = {
        "rows": rows,
        "identical_rows": identical,
        "differing_rows": differing,
        "same_tokens": [step.chosen(s) for s in together] == [step.chosen(s) for s in alone],
    }

    def rewind(seqs: list[Any]) -> None:  # the same positions again each time
        for i, seq in enumerate(seqs):
            seq.pos.fill(i % len(STEP_PROMPT) + 1)
            seq.n_tokens = i % len(STEP_PROMPT) + 1

    def batched() -> None:
        rewind(together)
        step.step_rows(together)

    def one_by_one() -> None:
        rewind(alone)
        for seq in alone:
            step.step(seq)

    out["us_rows_step"] = _time_us(cp, batched, repeats=20)
    out["us_one_row_steps"] = _time_us(cp, one_by_one, repeats=20)
    out["elapsed_s"] = round(time.monotonic() - started, 2)
    return out


def device_graphs_vs_uncaptured(
    cp: ModuleType, model: Path, rows: int = 4, steps: int = 6
) -> dict[str, Any]:
    """The decode step replayed from CUDA graphs (DeviceStep with graphs on) against the same
    step uncaptured on the same device: ``rows`` slots at different positions, ``steps``
    rounds (one-row steps and batched steps of every slot by turns), each slot's logits,
    token and position and the pools' K/V compared after each round; then decode tokens per
    second of one sequence and of the ``rows`` slots batched, captured and uncaptured."""
    from bankml.engine_cupy import device_step as ds

    started = time.monotonic()
    weights = _weights(cp, model)
    graphed, plain = ds.DeviceStep(cp, weights), ds.DeviceStep(cp, weights, graphs=False)
    n_ctx = len(STEP_PROMPT) + steps + 2
    mine, theirs = graphed.new_sequences(rows, n_ctx), plain.new_sequences(rows, n_ctx)
    for step, seqs in ((graphed, mine), (plain, theirs)):
        for i, seq in enumerate(seqs):
            for token in STEP_PROMPT[: i % len(STEP_PROMPT) + 1]:
                step.set_token(seq, token)
                step.step(seq)

    def state(step: Any, seqs: list[Any]) -> list[bytes]:
        pool = seqs[0].pool
        out = [pool.k.get().tobytes(), pool.v.get().tobytes(), pool.pos.get().tobytes()]
        return out + [step.host_logits(s).tobytes() for s in seqs]

    identical, differing, same_tokens = 0, 0, True
    for r in range(steps):
        for step, seqs in ((graphed, mine), (plain, theirs)):
            if r % 2:
                step.step_rows(seqs)
            else:
                step.step(seqs[r % rows])
        same = state(graphed, mine) == state(plain, theirs)
        identical, differing = identical + same, differing + (not same)
        same_tokens &= [graphed.chosen(s) for s in mine] == [plain.chosen(s) for s in theirs]
    out: dict[str, Any] = {
        "rows": rows,
        "graph_reason": graphed.graph_reason,
        "identical_steps": identical,
        "differing_steps": differing,
        "same_tokens": same_tokens,
        **graphed.graph_stats,
    }

    def tok_s(step: Any, seqs: list[Any], batched: bool) -> float | None:
        def run() -> None:  # the same positions again each time
            for seq in seqs:
                seq.pos.fill(len(STEP_PROMPT))
                seq.n_tokens = len(STEP_PROMPT)
            if batched:
                step.step_rows(seqs)
            else:
                step.step(seqs[0])

        run()  # a row count's first sight, then its capture
        us = _time_us(cp, run, repeats=50)
        return None if us is None else round((len(seqs) if batched else 1) * 1e6 / us, 1)

    out["decode_tok_s"] = {
        "captured": tok_s(graphed, mine, False),
        "uncaptured": tok_s(plain, theirs, False),
    }
    out["rows_decode_tok_s"] = {
        "captured": tok_s(graphed, mine, True),
        "uncaptured": tok_s(plain, theirs, True),
    }
    out["elapsed_s"] = round(time.monotonic() - started, 2)
    return out


ENGINE_PROMPT = "The capital of France is"


def _engine_answers(cp: ModuleType, model: Path, n_predict: int) -> list[dict[str, Any]]:
    """A greedy and a seeded top-k /completion through the engine on ``cp`` (the decode step:
    Engine.open with device cuda): the tokens, and the engine's own timings."""
    from bankml.engine_cupy.engine import Engine

    saved = sys.modules.get("cupy")
    sys.modules["cupy"] = cp  # type: ignore[assignment]
    try:
        engine = Engine.open(model, n_ctx=256, device="cuda")
    finally:
        if saved is None:
            del sys.modules["cupy"]
        else:
            sys.modules["cupy"] = saved
    out = []
    launches = getattr(cp, "launches", None)  # the stand-in lists its launches; a device not
    for sampling in ({"temperature": 0}, {"top_k": 40, "temperature": 0.8, "seed": 1}):
        body = {"prompt": ENGINE_PROMPT, "n_predict": n_predict, **sampling}
        steps = engine.run_steps(engine.parse_request(body, "completion"))
        mark = len(launches) if launches is not None else 0
        tokens, prompt = [], None
        for chunk in steps:
            if launches is not None and prompt is None:  # the prompt's passes, to its 1st token
                names = [name for name, _, _ in launches[mark:]]
                # a prefill ends in advance_pos, a step in argmax_f32 (device_model.md's rule)
                prefills, passes = names.count("advance_pos"), names.count("argmax_f32")
                prompt = {"prefills": prefills, "steps": passes, "launches": len(names)}
            tokens.append(chunk.token)
        timings = steps.summary.timings
        out.append({"tokens": tokens, "timings": timings, "prompt_passes": prompt})
    return out


def device_engine_vs_twins(cp: ModuleType, model: Path, n_predict: int = 8) -> dict[str, Any]:
    """The engine on the decode step (engine_cupy/device_model.py), on the device against the
    same engine through the twins: greedy tokens (argmax on the device) and seeded top-k tokens
    (the top_k_f32 pairs, the host finishing the chain), and the device's decode tokens/s as
    the engine reports them (predicted_per_second); through the twins, each request's prompt
    passes (prefills and steps up to its first token: the greedy request's prompt is new to the
    slot, the top-k request's found whole in it) and the prompt's tokens and tokens/s."""
    from tests.fake_cupy_kernels import KernelCupy

    started = time.monotonic()
    got = _engine_answers(cp, model, n_predict)
    want = _engine_answers(KernelCupy(), model, n_predict)  # type: ignore[arg-type]
    out: dict[str, Any] = {}
    for name, g, w in zip(("greedy", "top_k"), got, want):
        out[name] = {
            "tokens": g["tokens"],
            "same_tokens": g["tokens"] == w["tokens"],
            "decode_tokens_per_s": round(g["timings"]["predicted_per_second"], 1),
            "prompt_n": g["timings"]["prompt_n"],
            "prompt_tokens_per_s": round(g["timings"]["prompt_per_second"], 1),
            "prompt_passes_on_twins": w["prompt_passes"],
        }
    out["elapsed_s"] = round(time.monotonic() - started, 2)
    return out


def _run_prefill(cp: ModuleType, model: Path, steps: int) -> tuple[list[int], Any, Any]:
    """The prompt in one prefill, then ``steps`` greedy tokens by the decode step: the chosen
    ids (the prefill's first), the prefill's logits (a host copy), and (prefill, step, seq)."""
    from bankml.engine_cupy import device_prefill as dp
    from bankml.engine_cupy import device_step as ds

    step = ds.DeviceStep(cp, _weights(cp, model))
    prefill = dp.DevicePrefill(cp, step.w, step.kernels)
    seq = step.new_sequence(len(STEP_PROMPT) + steps + 1)
    prefill.prefill(seq, STEP_PROMPT)
    logits = prefill.host_logits()
    chosen = []
    for _ in range(steps):
        chosen.append(step.chosen(seq))
        step.step(seq)
    return chosen, logits, (prefill, step, seq)


def device_prefill_vs_twins(cp: ModuleType, model: Path, steps: int = 4) -> dict[str, Any]:
    """The prefill (engine_cupy/device_prefill.py) on the device against the same prefill
    through the twins: the greedy ids after it, the last row's logits and the K/V cache (cuBLAS
    adds in its own order, so these are near, not identical), launches, and microseconds per
    prefill of the prompt on the device."""
    from bankml.engine_cupy import device_prefill as dp
    from tests.fake_cupy_kernels import KernelCupy

    started = time.monotonic()
    got_ids, got_logits, (prefill, step, seq) = _run_prefill(cp, model, steps)
    fake = KernelCupy()
    want_ids, want_logits, (_, _, want_seq) = _run_prefill(fake, model, steps)  # type: ignore[arg-type]
    n = len(STEP_PROMPT)
    out: dict[str, Any] = {
        "tokens": got_ids,
        "same_tokens": got_ids == want_ids,
        "logits": compare(got_logits, want_logits),
        "k_cache": compare(
            cp.asnumpy(seq.k[:, :, :n]).view(numpy.float16).reshape(-1),
            want_seq.k.host_view[:, :, :n].view(numpy.float16).reshape(-1),
        ),
        "launches_per_prefill": dp.launches_per_prefill(step.hp.n_layer),
        "prompt_tokens": n,
    }

    def one() -> None:  # position 0 again each time (the cache rows overwritten in place)
        seq.pos.fill(0)
        seq.n_tokens = 0
        prefill.prefill(seq, STEP_PROMPT)

    out["us_per_prefill"] = _time_us(cp, one, repeats=10)
    out["elapsed_s"] = round(time.monotonic() - started, 2)
    return out


def _run_hidden(cp: ModuleType, model: Path) -> numpy.ndarray:
    """The prompt's hidden states after the output norm (DevicePrefill.hidden), on the host."""
    from bankml.engine_cupy import device_prefill as dp
    from bankml.engine_cupy import device_step as ds

    step = ds.DeviceStep(cp, _weights(cp, model), graphs=False)
    prefill = dp.DevicePrefill(cp, step.w, step.kernels)
    return prefill.hidden(step.new_sequence(len(STEP_PROMPT)), STEP_PROMPT)


def device_hidden_vs_twins(cp: ModuleType, model: Path) -> dict[str, Any]:
    """The embeddings' hidden states (DevicePrefill.hidden: the prefill's layers on the device,
    the last add and output norm on the host) against the same through the twins and against
    the exact CPU path's (Model.hidden_states): the largest difference and the smallest cosine
    of a row (cuBLAS adds in its own order, so near, not identical)."""
    from bankml.engine_cupy.model import Model
    from tests.fake_cupy_kernels import KernelCupy

    started = time.monotonic()
    got = _run_hidden(cp, model)
    twins = _run_hidden(KernelCupy(), model)  # type: ignore[arg-type]
    exact = Model.load(model, device="cpu", progress=False).hidden_states(STEP_PROMPT)

    def cosine(a: numpy.ndarray, b: numpy.ndarray) -> float:
        dots = (a * b).sum(axis=1) / (numpy.linalg.norm(a, axis=1) * numpy.linalg.norm(b, axis=1))
        return round(float(dots.min()), 6)

    return {
        "rows": len(STEP_PROMPT),
        "vs_twins": compare(got, twins),
        "min_cosine_vs_twins": cosine(got, twins),
        "min_cosine_vs_exact": cosine(got, exact),
        "elapsed_s": round(time.monotonic() - started, 2),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path)
    parser.add_argument("--rows", type=int, default=2048)
    parser.add_argument("--cols", type=int, default=4096)
    parser.add_argument("--step-tokens", type=int, default=8, help="device step check (0: none)")
    args = parser.parse_args(argv)
    import cupy  # type: ignore[import-not-found]

    report = kernels_vs_twins(cupy, args.model, args.rows, args.cols)
    if args.model is not None and args.step_tokens:
        try:
            report["device_step"] = device_step_vs_twins(cupy, args.model, args.step_tokens)
        except Exception as err:  # a model the step does not play, or a kernel that fails
            report["device_step"] = {"error": f"{type(err).__name__}: {err}"}
        try:
            report["device_rows"] = device_rows_vs_steps(cupy, args.model)
        except Exception as err:
            report["device_rows"] = {"error": f"{type(err).__name__}: {err}"}
        try:
            report["device_engine"] = device_engine_vs_twins(cupy, args.model, args.step_tokens)
        except Exception as err:
            report["device_engine"] = {"error": f"{type(err).__name__}: {err}"}
        try:
            report["device_prefill"] = device_prefill_vs_twins(cupy, args.model)
        except Exception as err:  # a model the prefill does not play, or a kernel that fails
            report["device_prefill"] = {"error": f"{type(err).__name__}: {err}"}
        try:
            report["device_hidden"] = device_hidden_vs_twins(cupy, args.model)
        except Exception as err:
            report["device_hidden"] = {"error": f"{type(err).__name__}: {err}"}
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
