"""GGUF header decisions, refusals, dequantization and activation rounding of the native engine."""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any

import numpy
import pytest
from gguf import GGMLQuantizationType as T
from gguf import GGUFWriter, quants

from bankml.engine_cupy import backend, weights
from bankml.engine_cupy.model import Model, UnsupportedModel
from tests.tiny_models import TinySpec, write_tiny_model


def write_header_only(
    path: Path,
    arch: str,
    tensors: dict[str, numpy.ndarray],
    keys: dict[str, object] | None = None,
    raw: dict[str, T] | None = None,
) -> Path:
    """A small GGUF with the given architecture, tensors and extra keys (no vocabulary)."""
    w = GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_embedding_length(32)
    w.add_feed_forward_length(64)
    w.add_head_count(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_context_length(128)
    for key, value in (keys or {}).items():
        if isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        else:
            w.add_uint32(key, int(value))
    for name, array in tensors.items():
        w.add_tensor(name, array, raw_dtype=(raw or {}).get(name))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def llama_tensors(extra: dict[str, numpy.ndarray] | None = None) -> dict[str, numpy.ndarray]:
    rng = numpy.random.default_rng(0)
    m = lambda r, c: rng.standard_normal((r, c)).astype(numpy.float32)  # noqa: E731
    t = {"token_embd.weight": m(100, 32), "output_norm.weight": numpy.ones(32, numpy.float32)}
    for name, shape in (
        ("attn_q", (32, 32)),
        ("attn_k", (32, 32)),
        ("attn_v", (32, 32)),
        ("attn_output", (32, 32)),
        ("ffn_gate", (64, 32)),
        ("ffn_up", (64, 32)),
        ("ffn_down", (32, 64)),
    ):
        t[f"blk.0.{name}.weight"] = m(*shape)
    t["blk.0.attn_norm.weight"] = numpy.ones(32, numpy.float32)
    t["blk.0.ffn_norm.weight"] = numpy.ones(32, numpy.float32)
    t.update(extra or {})
    return t


def refusal(path: Path) -> str:
    with pytest.raises(UnsupportedModel) as err:
        Model.load(path, device="cpu", progress=False)
    return str(err.value)


def test_small_llama_loads(tmp_path: Path) -> None:
    model = Model.load(
        write_header_only(tmp_path / "ok.gguf", "llama", llama_tensors()),
        device="cpu",
        progress=False,
    )
    assert (model.arch, model.n_vocab, model.n_embd, model.n_layer) == ("llama", 100, 32, 1)
    assert model.hp.tied_output and model.hp.n_head_kv == 2 and model.hp.head_dim == 16
    logits = model.forward([1, 2, 3], model.new_cache(8))
    assert logits.shape == (100,) and logits.dtype == numpy.float32


def test_refuses_unknown_architecture(tmp_path: Path) -> None:
    path = write_header_only(tmp_path / "f.gguf", "falcon", llama_tensors())
    assert (
        refusal(path) == "architecture falcon: the forward pass plays llama, qwen2, qwen3, gemma3"
    )


def test_refuses_unknown_tensor_naming_it(tmp_path: Path) -> None:
    extra = {"blk.0.ffn_gate_inp.weight": numpy.zeros((4, 32), numpy.float32)}
    path = write_header_only(tmp_path / "moe.gguf", "llama", llama_tensors(extra))
    assert "tensor blk.0.ffn_gate_inp.weight: not part of the llama graph" in refusal(path)


def test_refuses_missing_tensor(tmp_path: Path) -> None:
    tensors = llama_tensors()
    del tensors["blk.0.ffn_up.weight"]
    path = write_header_only(tmp_path / "missing.gguf", "llama", tensors)
    assert refusal(path) == "tensor blk.0.ffn_up.weight is missing: the llama graph needs it"


def test_qwen3_needs_its_qk_norms(tmp_path: Path) -> None:
    path = write_header_only(tmp_path / "q3.gguf", "qwen3", llama_tensors())
    assert refusal(path) == "tensor blk.0.attn_q_norm.weight is missing: the qwen3 graph needs it"


def test_refuses_type_gguf_cannot_dequantize(tmp_path: Path) -> None:
    extra = {"blk.0.ffn_up.weight": numpy.zeros((64, 32), numpy.int8)}  # an I8 tensor
    path = write_header_only(tmp_path / "i8.gguf", "llama", llama_tensors(extra))
    assert refusal(path) == (
        "tensor blk.0.ffn_up.weight has type I8, which gguf.quants cannot "
        "dequantize: the forward pass refuses it"
    )


def test_refuses_yarn_scaling(tmp_path: Path) -> None:
    path = write_header_only(
        tmp_path / "yarn.gguf", "llama", llama_tensors(), keys={"llama.rope.scaling.type": "yarn"}
    )
    assert "RoPE scaling 'yarn' on llama: not reproduced" in refusal(path)


def test_refuses_from_the_header_before_reading_weights(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The decision reads no weight: dequantizing anything would fail this test."""

    def no_weight_reads(*args: object) -> None:
        raise AssertionError("a weight was read before the header was judged")

    monkeypatch.setattr(weights, "dequantize", no_weight_reads)
    extra = {"blk.0.attn_qkv_extra.weight": numpy.zeros((4, 32), numpy.float32)}
    path = write_header_only(tmp_path / "x.gguf", "qwen2", llama_tensors(extra))
    assert "not part of the qwen2 graph" in refusal(path) or "missing" in refusal(path)


def test_memory_budget_refusal(tmp_path: Path) -> None:
    reader = weights.open_reader(write_header_only(tmp_path / "m.gguf", "llama", llama_tensors()))
    need = weights.weight_bytes(reader)
    weights.check_memory(reader, available=need * 2)
    with pytest.raises(UnsupportedModel, match="the weights take"):
        weights.check_memory(reader, available=need)


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.BF16])
def test_chunked_dequantize_equals_gguf(qtype: T) -> None:
    data = numpy.random.default_rng(1).standard_normal((700, 256)).astype(numpy.float32)
    packed = quants.quantize(data, qtype)
    assert numpy.array_equal(weights.dequantize(packed, qtype), quants.dequantize(packed, qtype))


def test_q8_activation_matches_ggml_reference_quantizer() -> None:
    """Round-trip through gguf's Q8_0 (ggml's reference quantizer) gives the same values,
    except where that quantizer's ties-away rounding differs from AVX2's ties-to-even."""
    x = numpy.random.default_rng(2).standard_normal((64, 512)).astype(numpy.float32)
    ours = weights.quantize_activation(numpy, x, "q8_0")
    ref = quants.dequantize(quants.quantize(x, T.Q8_0), T.Q8_0)
    share = float(numpy.mean(ours == ref))
    print(f"\nq8_0 activation equal to gguf's round trip: {share:.5%}")
    assert share > 0.9999


def test_q8_k_activation_keeps_the_signed_extreme() -> None:
    x = numpy.zeros((1, 256), numpy.float32)
    x[0, :4] = [-2.0, 1.0, 0.5, 2.0]  # the first largest |x| is negative: d = 2/127, q = -127
    y = weights.quantize_activation(numpy, x, "q8_K")
    assert y[0, 0] == -2.0 and abs(y[0, 3] - 2.0) < 1e-6
    assert abs(y[0, 2] - numpy.float32(-127 / -2.0) ** -1 * round(0.5 * 127 / 2)) < 1e-6


def test_f16_and_bf16_activation_rounding() -> None:
    x = numpy.array([[1.0 + 2.0**-12, 3.14159265, -1e-3, 65504.0]], numpy.float32)
    assert numpy.array_equal(
        weights.quantize_activation(numpy, x, "f16"), x.astype(numpy.float16).astype(numpy.float32)
    )
    bf = weights.quantize_activation(numpy, x, "bf16")
    assert numpy.array_equal(bf, quants.dequantize(quants.quantize(x, T.BF16), T.BF16))


def _cupy_module(device_count: Any) -> types.ModuleType:
    """An importable ``cupy`` whose runtime reports ``device_count`` (or raises it)."""

    def count() -> int:
        if isinstance(device_count, Exception):
            raise device_count
        return device_count

    module = types.ModuleType("cupy")
    module.cuda = types.SimpleNamespace(runtime=types.SimpleNamespace(getDeviceCount=count))
    return module


@pytest.mark.parametrize(
    "cupy, reason",
    [
        (None, "CuPy is not importable"),  # sys.modules[name] = None: the import raises
        (_cupy_module(RuntimeError("cudaErrorNoDevice")), "CuPy sees no usable GPU"),
        (_cupy_module(0), "CuPy sees no GPU"),
    ],
)
def test_backend_without_a_usable_gpu(
    monkeypatch: pytest.MonkeyPatch, cupy: Any, reason: str
) -> None:
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    assert backend.get_xp("cpu") is numpy
    assert backend.get_xp("auto") is numpy
    with pytest.raises(
        backend.DeviceUnavailable, match=f"device 'cuda' was asked for but {reason}"
    ):
        backend.get_xp("cuda")
    with pytest.raises(ValueError, match="expected one of auto, cpu, cuda"):
        backend.get_xp("tpu")


def test_backend_with_a_gpu_takes_cupy_for_auto_and_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    cupy = _cupy_module(1)
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    assert backend.get_xp("auto") is cupy and backend.get_xp("cuda") is cupy
    assert backend.get_xp("cpu") is numpy


def test_default_model_header(default_model: Path) -> None:
    hp = weights.read_hparams(weights.open_reader(default_model))
    assert (hp.arch, hp.n_layer, hp.n_embd, hp.n_head, hp.n_head_kv, hp.head_dim) == (
        "llama",
        30,
        576,
        9,
        3,
        64,
    )
    assert hp.tied_output and hp.rope_base == 100000.0 and hp.n_vocab == 49152


def test_gemma3_header_layers(tmp_path: Path, default_model: Path) -> None:
    path = write_tiny_model(
        tmp_path / "g.gguf", TinySpec("gemma3", T.F16, n_layer=4), default_model
    )
    hp = weights.read_hparams(weights.open_reader(path))
    assert hp.swa_layers == (True, False, True, False) and hp.swa_window == 8
    assert hp.embd_scale == 16.0 and hp.attn_scale == 1 / 8 and hp.rope_base_swa == 10000.0
