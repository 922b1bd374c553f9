"""The GPU path without a GPU: the engine's array path run through a strict CuPy stand-in.

CI has no GPU. ``test_forward.py::test_array_module_path_on_the_cpu`` runs the array path with
``xp = numpy``, which cannot see a device array leaking into NumPy or Numba, nor a host array
handed to a device operation: NumPy accepts both, CuPy raises. ``tests/fake_cupy.py`` raises as
CuPy does and computes with NumPy underneath, so every model here must give, bit for bit, the
logits of the ``xp = numpy`` array path; and ``device="auto"``/``"cuda"`` must pick it when
"CuPy sees a GPU". What it cannot show is CUDA's own arithmetic: that waits for a GPU
(scripts/gpu-check.sh, docs/gpu.md).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import numpy
import pytest
from gguf import GGMLQuantizationType as T

from bankml.engine_cupy import backend, slots
from bankml.engine_cupy.engine import Engine, prompt_batches
from bankml.engine_cupy.model import Model
from bankml.formats.chat_content import chat_schema_content
from tests import fake_cupy
from tests.fake_cupy import FAKE, DeviceArray
from tests.tiny_models import TinySpec, write_tiny_model

PROMPT = [1, 504, 3458, 282, 4649, 314, 28, 11, 2029, 9, 1213, 30, 87, 59, 1030]


@pytest.fixture
def fake_gpu(monkeypatch: pytest.MonkeyPatch) -> fake_cupy.FakeCupy:
    """CuPy "imports and sees a GPU": the stand-in; the array path (the decode step is
    tests/test_device_engine.py's)."""
    monkeypatch.setattr(backend, "_cupy_with_gpu", lambda: (FAKE, ""))
    monkeypatch.setenv("BANKML_DEVICE_STEP", "0")
    return FAKE


def test_the_stand_in_refuses_what_cupy_refuses() -> None:
    """The checks below are only as good as the stand-in's refusals."""
    device, host = FAKE.arange(4, dtype=numpy.float32), numpy.ones(4, numpy.float32)
    refusals = {
        "implicit conversion": lambda: numpy.asarray(device),
        "host operand": lambda: device + host,
        "host operand on the left": lambda: host * device,
        "host array into an xp function": lambda: FAKE.where(host > 0, device, 0),
        "host array stored into a device array": lambda: device.__setitem__(slice(None), host),
        "0-d array as an index": lambda: list(range(device.sum())),
        "host buffer": lambda: device.data,
    }
    for numpy_only in (
        lambda: FAKE.memmap,
        lambda: FAKE.errstate,
        lambda: device.ctypes,
        lambda: device.resize,
    ):
        with pytest.raises(AttributeError):
            numpy_only()
    for name, attempt in refusals.items():
        with pytest.raises(TypeError):
            attempt()
            pytest.fail(name)
    # what CuPy allows: scalars, NumPy ufuncs dispatched to the device, host index arrays,
    # explicit copies both ways
    total = numpy.exp(device * numpy.float32(2) + 1).sum()
    assert isinstance(total, DeviceArray) and total.shape == ()
    assert float(total) == pytest.approx(float(numpy.exp(numpy.arange(4) * 2 + 1).sum()), rel=1e-6)
    assert device[numpy.array([3, 1])].get().tolist() == [3.0, 1.0]
    assert FAKE.asnumpy(FAKE.asarray(host)).tolist() == host.tolist()


def test_auto_and_cuda_take_the_gpu_module(fake_gpu: fake_cupy.FakeCupy) -> None:
    assert backend.get_xp("auto") is fake_gpu
    assert backend.get_xp("cuda") is fake_gpu
    assert backend.get_xp("cpu") is numpy
    assert backend.device_name(fake_gpu) == "cuda"


def _prefill_and_decode(model: Model, cache_type: str | None, n_decode: int) -> list[numpy.ndarray]:
    """Logits of the prompt (in llama-server's micro-batches) and of n_decode greedy steps."""
    cache = model.new_cache(len(PROMPT) + n_decode + 1, cache_type)
    out = []
    for a, b in prompt_batches(0, len(PROMPT), model.has_sliding_window):
        logits = model.forward(PROMPT[a:b], cache)
    out.append(logits)
    for _ in range(n_decode):
        logits = model.forward([int(numpy.argmax(logits))], cache)
        out.append(logits)
    return out


def _assert_same_logits(on_device: list[numpy.ndarray], on_host: list[numpy.ndarray]) -> None:
    assert len(on_device) == len(on_host)
    for step, (a, b) in enumerate(zip(on_device, on_host)):
        assert type(a) is numpy.ndarray, "the logits must come back to the host"
        assert numpy.array_equal(a, b), f"step {step}: {numpy.abs(a - b).max()}"


DEVICE_SPECS = (
    TinySpec("llama", T.Q4_K, tied=False, llama3_rope=True, out_type=T.Q6_K),  # rope_freqs
    TinySpec("qwen2", T.Q4_1, tied=False),  # QKV biases, block minimums
    TinySpec("qwen3", T.BF16),  # Q/K norms
    TinySpec("gemma3", T.Q5_0, n_layer=4),  # GeGLU, embedding scale, sliding-window layers
)


@pytest.mark.parametrize("cache_type", ["f16", "q8_0"])
@pytest.mark.parametrize("spec", DEVICE_SPECS, ids=lambda s: s.name)
def test_tiny_models_on_the_device_path(
    spec: TinySpec,
    cache_type: str,
    fake_gpu: Any,
    tmp_path_factory: pytest.TempPathFactory,
    default_model: Path,
) -> None:
    path = write_tiny_model(
        tmp_path_factory.mktemp("device") / f"{spec.name}.gguf", spec, default_model
    )
    on_device = Model.load(path, device="cuda", progress=False)
    on_host = Model.load(path, device="cpu", progress=False, exact=False)
    assert on_device.xp is fake_gpu and not on_device.exact
    assert isinstance(on_device.weights.layers[0].attn_norm, DeviceArray)
    _assert_same_logits(
        _prefill_and_decode(on_device, cache_type, 6), _prefill_and_decode(on_host, cache_type, 6)
    )


def _chat(engine: Engine, system: str, content: str, **fields: Any) -> tuple[str, list[int]]:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": content}]
    steps = engine.run_steps(
        engine.parse_request({"messages": messages, "max_tokens": 12, **fields}, "chat")
    )
    text = "".join(chunk.text for chunk in steps)
    return text, steps.summary.tokens


POET = ("Poet.", "Name a colour.")
GREEDY = {"temperature": 0}


@pytest.mark.slow
def test_default_model_engine_on_the_device_path(
    fake_gpu: Any, default_model: Path, tmp_path: Path
) -> None:
    """The whole engine on the device: greedy chat equal to the host array path, the prompt
    served from the slot, from the host prompt cache and from a slot file alike, a JSON schema,
    and seeded sampling with penalties and n_probs."""
    engine = Engine.open(default_model, n_ctx=512, device="cuda")
    assert engine.model.xp is fake_gpu

    text, tokens = _chat(engine, *POET, **GREEDY)
    assert tokens == _host_greedy(engine, default_model, len(tokens)) and text
    from_slot = _chat(engine, *POET, **GREEDY)  # all but the last prompt token from the slot

    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    answer, _ = _chat(
        engine,
        "Geographer.",
        "Reply in JSON.",
        **GREEDY,
        max_tokens=24,
        response_format={"type": "json_schema", "json_schema": {"schema": schema}},
    )
    # the answer may sit in a ```json fence, which the chat content leaves out
    assert chat_schema_content(answer).startswith("{") and '"ok"' in answer
    kept = engine.host_cache.entries  # the poet's conversation, copied aside on the device
    assert len(kept) == 1 and all(isinstance(a, (DeviceArray, tuple)) for a in kept[0].kv)
    assert _chat(engine, *POET, **GREEDY) == from_slot  # back from the host prompt cache

    sha = hashlib.sha256(b"not checked here").hexdigest()
    saved = slots.save_slot(engine, str(tmp_path / "slot.bin"), sha)
    assert saved.n_tokens == len(engine.slot_tokens) > 0
    slots.erase_slot(engine)
    slots.restore_slot(engine, str(tmp_path / "slot.bin"), sha)
    assert engine.slot_tokens and _chat(engine, *POET, **GREEDY) == from_slot

    sampled = {
        "temperature": 0.9,
        "top_k": 20,
        "top_p": 0.9,
        "min_p": 0.02,
        "seed": 7,
        "repeat_penalty": 1.2,
        "frequency_penalty": 0.3,
        "logprobs": True,
        "top_logprobs": 3,
    }
    runs = []
    for _ in range(2):
        slots.erase_slot(engine)  # both runs prefill the whole prompt in one batch
        runs.append(_chat(engine, "Storyteller.", "Tell me a word.", **sampled))
    assert runs[0] == runs[1] and runs[0][0]


def _host_greedy(engine: Engine, default_model: Path, n: int) -> list[int]:
    """The poet's answer computed by the xp = numpy array path, outside the engine."""
    host = Model.load(default_model, device="cpu", progress=False, exact=False)
    messages = [{"role": "system", "content": POET[0]}, {"role": "user", "content": POET[1]}]
    prompt = engine.tokenize(
        engine.apply_template(messages, add_generation_prompt=True), parse_special=True
    )
    cache = host.new_cache(len(prompt) + n + 1)
    logits, out = host.forward(prompt, cache), []
    for _ in range(n):
        out.append(int(numpy.argmax(logits)))
        logits = host.forward([out[-1]], cache)
    return out
