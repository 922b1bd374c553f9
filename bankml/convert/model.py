"""What llama.cpp build 11434's converter writes for the architectures bankml converts.

``hparams`` reads ``config.json`` as the reference reads it through Hugging Face's config
classes (their defaults filled in: a Llama config always carries ``head_dim``, a Qwen3 one
defaults it to 128); ``Plan`` maps each safetensors tensor to its GGUF name and type, in the
reference's order, and writes the metadata keys in the reference's order.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import gguf
import numpy as np

from bankml.convert.errors import ConvertError
from bankml.convert.safetensors import DTYPE_BYTES, Shard, TensorSpec, not_converted
from bankml.convert.vocab import Vocab, read_json


@dataclass(frozen=True)
class Arch:
    name: str  # general.architecture
    model_arch: gguf.MODEL_ARCH
    defaults: dict[str, Any]
    head_dim_default: int | None  # None: hidden_size // heads (Llama), 0: no head_dim (Qwen2)
    permute_qk: bool
    space_prefix_key: bool  # Llama reads tokenizer_config's add_prefix_space


_BASE = {"rope_scaling": None, "rms_norm_eps": 1e-06, "rope_theta": 10000.0}
ARCHES: dict[str, Arch] = {}
for _hf, _arch in (
    ("LlamaForCausalLM", "llama"),
    ("LLaMAForCausalLM", "llama"),
    ("LlamaModel", "llama"),
    ("Qwen2ForCausalLM", "qwen2"),
    ("Qwen2Model", "qwen2"),
    ("Qwen3ForCausalLM", "qwen3"),
    ("Qwen3Model", "qwen3"),
):
    if _arch == "llama":
        ARCHES[_hf] = Arch(
            "llama",
            gguf.MODEL_ARCH.LLAMA,
            {
                **_BASE,
                "vocab_size": 32000,
                "max_position_embeddings": 2048,
                "hidden_size": 4096,
                "intermediate_size": 11008,
                "num_hidden_layers": 32,
                "num_attention_heads": 32,
            },
            None,
            True,
            True,
        )
    else:
        ARCHES[_hf] = Arch(
            _arch,
            gguf.MODEL_ARCH.QWEN2 if _arch == "qwen2" else gguf.MODEL_ARCH.QWEN3,
            {
                **_BASE,
                "vocab_size": 151936,
                "max_position_embeddings": 32768,
                "hidden_size": 4096,
                "intermediate_size": 22016,
                "num_hidden_layers": 32,
                "num_attention_heads": 32,
                "num_key_value_heads": 32,
            },
            128 if _arch == "qwen3" else 0,
            False,
            False,
        )


ARCHES["Gemma3ForCausalLM"] = Arch(
    "gemma3",
    gguf.MODEL_ARCH.GEMMA3,
    {
        **_BASE,
        "rope_theta": 1000000.0,
        "vocab_size": 262208,
        "max_position_embeddings": 131072,
        "hidden_size": 2304,
        "intermediate_size": 9216,
        "num_hidden_layers": 26,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "rope_local_base_freq": 10000.0,
        "sliding_window": 4096,
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        "query_pre_attn_scalar": 256,
    },
    256,
    False,
    False,
)


# BertConfig's defaults; BERT has no RoPE, RMSNorm, key/value heads or head_dim
ARCHES["BertModel"] = Arch(
    "bert",
    gguf.MODEL_ARCH.BERT,
    {
        "vocab_size": 30522,
        "hidden_size": 768,
        "num_hidden_layers": 12,
        "num_attention_heads": 12,
        "intermediate_size": 3072,
        "max_position_embeddings": 512,
        "type_vocab_size": 2,
        "layer_norm_eps": 1e-12,
    },
    0,
    False,
    False,
)


# a BERT with a classifier (a reranker): the same conversion, its labels and cls.output tensors
ARCHES["BertForSequenceClassification"] = ARCHES["BertModel"]


def classifier_labels(hp: dict[str, Any]) -> list[str] | None:
    """A BERT's ``id2label`` values in label order, as the reference writes them in
    ``bert.classifier.output_labels``; None for none, or for AutoConfig's two placeholders."""
    labels = hp.get("id2label")
    if not isinstance(labels, dict) or not labels:
        return None
    if len(labels) == 2 and labels.get("0", labels.get(0)) == "LABEL_0":
        return None
    try:
        ordered = sorted(labels.items(), key=lambda kv: int(kv[0]))
    except (TypeError, ValueError):
        raise ConvertError("config.json: id2label's keys are not label numbers") from None
    return [str(v) for _, v in ordered]


def load_config(directory: str) -> tuple[dict[str, Any], str, Arch]:
    """(hparams with the defaults filled in, the Hugging Face architecture, its Arch)."""
    path = os.path.join(directory, "config.json")
    if not os.path.isfile(path):
        raise ConvertError("no config.json in the directory")
    raw = read_json(path, "config.json")
    if not isinstance(raw, dict):
        raise ConvertError("config.json is not a JSON object")
    arches = raw.get("architectures")
    hf = arches[0] if isinstance(arches, list) and arches else None
    if isinstance(raw.get("text_config"), dict):
        raise ConvertError("config.json: a multimodal model (text_config) is not converted")
    if not isinstance(hf, str) or hf not in ARCHES:
        known = sorted({a for a in ARCHES})
        raise ConvertError(
            f"config.json: architecture {hf!r} is not converted by bankml (it converts "
            f"{', '.join(known)})"
        )
    arch = ARCHES[hf]
    hp = dict(raw)
    for key, value in arch.defaults.items():
        hp.setdefault(key, value)
    if hp.get("num_key_value_heads") is None and arch.name != "bert":
        hp["num_key_value_heads"] = hp["num_attention_heads"]
    if arch.head_dim_default is None:
        if hp.get("head_dim") is None:
            hp["head_dim"] = hp["hidden_size"] // hp["num_attention_heads"]
    elif arch.head_dim_default:
        hp.setdefault("head_dim", arch.head_dim_default)
    rope = hp.get("rope_scaling")
    if isinstance(rope, dict) and "type" in rope:
        rope.setdefault("rope_type", rope["type"])
    for key in ("num_local_experts", "num_experts", "n_routed_experts"):
        if key in hp:
            raise ConvertError(f"config.json: a mixture-of-experts model ({key}) is not converted")
    for key in ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads"):
        if key == "num_key_value_heads" and arch.name == "bert":
            continue
        if not isinstance(hp.get(key), int) or isinstance(hp.get(key), bool) or hp[key] <= 0:
            raise ConvertError(f"config.json: {key} {hp.get(key)!r} is not a positive integer")
    if "draft_vocab_size" in hp:
        raise ConvertError("config.json: a speculative draft model is not converted")
    if arch.name == "bert":
        if hf == "BertForSequenceClassification" and classifier_labels(hp) is None:
            raise ConvertError(
                "config.json: a classifier with no id2label or AutoConfig's placeholder labels "
                "(LABEL_0, LABEL_1) is not converted (llama.cpp's converter writes it as a "
                "layer llama.cpp cannot load)"
            )
        if hp.get("position_embedding_type", "absolute") != "absolute":
            raise ConvertError(
                f"config.json: position_embedding_type {hp['position_embedding_type']!r} is not "
                "converted (absolute only)"
            )
    return hp, hf, arch


def find(hp: dict[str, Any], keys: tuple[str, ...]) -> Any:
    return next((hp[k] for k in keys if k in hp), None)


def rope_parameters(hp: dict[str, Any]) -> dict[str, Any]:
    params = dict(hp.get("rope_parameters", hp.get("rope_scaling")) or {})
    theta = find(
        hp,
        (
            "global_rope_theta",
            "rope_global_theta",
            "rope_theta_global",
            "rope_theta",
            "rotary_emb_base",
        ),
    )
    if "full_attention" not in params and "sliding_attention" not in params:
        if "rope_theta" not in params and theta is not None:
            params["rope_theta"] = theta
        if "rope_type" not in params and params.get("type") is not None:
            params["rope_type"] = params["type"]
        local = find(
            hp,
            (
                "local_rope_theta",
                "rope_local_theta",
                "rope_theta_local",
                "swa_rope_theta",
                "rope_local_base_freq",
            ),
        )
        if local is not None:
            params["sliding_attention"] = {"rope_theta": local}
    else:
        raise ConvertError("config.json: per-layer-type RoPE parameters are not converted")
    return params


_F32 = np.float32


def _llama3_factors(powed: np.ndarray, factor: float, low: float, high: float, old: float) -> bytes:
    """The reference's loop over ``freqs = 1.0 / powed``, each step as torch does it in float32:
    ``scalar / tensor`` is ``tensor.reciprocal() * scalar``, a Python float meeting a float32
    tensor (a comparison, ``-``, ``/``) is rounded to float32 first."""
    freqs = np.reciprocal(powed) * _F32(1.0)
    low_wavelen, high_wavelen = _F32(old / low), _F32(old / high)
    out = np.empty(len(freqs), dtype=_F32)
    for i, freq in enumerate(freqs):
        wavelen = np.reciprocal(freq) * _F32(2 * math.pi)
        if wavelen < high_wavelen:
            out[i] = 1.0
        elif wavelen > low_wavelen:
            out[i] = _F32(factor)
        else:
            smooth = (np.reciprocal(wavelen) * _F32(old) - _F32(low)) / _F32(high - low)
            out[i] = np.reciprocal((_F32(1.0) - smooth) / _F32(factor) + smooth)
    return out.tobytes()


# (rope_theta, head_dim) whose every power ``rope_theta ** (2i / head_dim)`` was compared with
# torch 2.13's float32 power (the reference's) and found to be the correctly rounded one: Llama
# 3.1, 3.2 and 3.3 (tests/test_convert.py checks them again against the reference's torch)
CONFIRMED_POWERS = {(500000.0, 64), (500000.0, 128)}
# torch's power was seen to differ from the correctly rounded float32 only where the exact power
# lies within 0.08 ULP of a rounding midpoint (41,600 powers); nearer than this it is not trusted
_NEAR_MIDPOINT = 0.4


def llama3_powers(base: float, dim: int) -> tuple[np.ndarray, np.ndarray]:
    """``base ** (arange(0, dim, 2) / dim)`` in float32 (the float64 power, correctly rounded),
    and which of them torch's float32 power might round the other way."""
    exps = np.arange(0, dim, 2, dtype=_F32) / _F32(dim)
    exact = np.power(np.float64(_F32(base)), exps.astype(np.float64))
    powed = exact.astype(_F32)
    frac = (exact - powed.astype(np.float64)) / np.spacing(powed).astype(np.float64)
    unsure = np.abs(frac) > _NEAR_MIDPOINT
    if (float(_F32(base)), dim) in CONFIRMED_POWERS:
        unsure[:] = False
    return powed, unsure


def llama3_rope_factors(hp: dict[str, Any]) -> np.ndarray | None:
    """The ``rope_freqs.weight`` the reference writes for ``rope_type: llama3`` (LlamaModel's
    ``generate_extra_tensors``), None for another RoPE.

    Its ``base ** (arange(0, dim, 2) / dim)`` is torch's vectorised float32 power, documented
    within one ULP of the exact power; here it is the float64 power correctly rounded to
    float32, the value torch was seen to give except near a rounding midpoint. Every later step
    is reproduced exactly. A power near a midpoint (outside ``CONFIRMED_POWERS``) is tried one
    ULP lower and higher: when that changes a factor, the model is refused."""
    rope = rope_parameters(hp)
    if str(rope.get("rope_type", "")).lower() != "llama3":
        return None
    names = {
        "rope_theta": 10000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    values: dict[str, float] = {}
    for key, default in names.items():
        v = rope.get(key, default)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < math.inf:
            raise ConvertError(f"config.json: llama3 RoPE {key} {v!r} is not a positive number")
        values[key] = v
    base, factor = values["rope_theta"], values["factor"]
    low, high = values["low_freq_factor"], values["high_freq_factor"]
    old = values["original_max_position_embeddings"]
    if low == high:
        raise ConvertError("config.json: llama3 RoPE with low_freq_factor == high_freq_factor")
    dim = hp["head_dim"]
    if not isinstance(dim, int) or isinstance(dim, bool) or dim <= 0:
        raise ConvertError(f"config.json: head_dim {dim!r} is not a positive integer")
    powed, unsure = llama3_powers(base, dim)
    factors = _llama3_factors(powed, factor, low, high, old)
    if unsure.any() and not llama3_guard(powed, unsure, factor, low, high, old, factors):
        raise ConvertError(
            f"config.json: llama3 RoPE factors (rope_theta {base}, head_dim {dim}) that "
            "depend on the last bit of torch's float32 power are not converted: bankml cannot "
            "promise the reference's bytes for them"
        )
    return np.frombuffer(factors, dtype=_F32).copy()


def llama3_guard(
    powed: np.ndarray,
    unsure: np.ndarray,
    factor: float,
    low: float,
    high: float,
    old: float,
    factors: bytes,
) -> bool:
    """True when the factors stay ``factors`` with the ``unsure`` powers one ULP lower or
    higher (each factor depends on its own power only)."""
    for side in (-np.inf, np.inf):
        moved = np.where(unsure, np.nextafter(powed, _F32(side)), powed)
        if _llama3_factors(moved, factor, low, high, old) != factors:
            return False
    return True


def _skip_multimodal(name: str) -> bool:
    return name.startswith(
        (
            "mlp",
            "vit.",
            "vpm.",
            "siglip2.",
            "conformer.",
            "merger.",
            "resampler.",
            "sound_encoder.",
            "sound_projection.",
            "speech_embeddings.",
        )
    ) or any(
        s in name
        for s in (
            "visual.",
            "vision.",
            "audio.",
            "talker.",
            "vision_",
            "audio_",
            "token2wav.",
            "code2wav.",
            "projector.",
            "pre_mm_projector_norm",
            "image_newline",
            "view_seperator",
            "patch_embed",
            "patch_embedding",
            "patch_merger.",
            "patch_merge_mlp.",
            "model.connector.",
        )
    )


@dataclass
class Item:
    """One output tensor: its GGUF name and type, and how to compute its data."""

    name: str
    qtype: gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    nbytes: int
    load: Callable[[], np.ndarray]


def index_tensors(arch: Arch, shards: list[Shard]) -> list[tuple[str, Shard, TensorSpec]]:
    """The tensors in the reference's order: shard by shard, by name within a shard."""
    out: dict[str, tuple[Shard, TensorSpec]] = {}
    for shard in shards:
        for spec in shard.tensors.values():
            name = spec.name.replace("e_score_correction_bias", "e_score_correction.bias")
            if _skip_multimodal(name):
                continue
            if arch.name == "bert":  # BertModel.filter_tensors
                name = name.removeprefix("bert.")
                if name.endswith(".gamma"):
                    name = name[:-6] + ".weight"
                if name.endswith(".beta"):
                    name = name[:-5] + ".bias"
                if name in (
                    "embeddings.position_ids",
                    "pooler.dense.weight",
                    "pooler.dense.bias",
                ) or name.startswith(("cls.predictions", "cls.seq_relationship")):
                    continue
            if arch.name == "llama" and "text_model." in name:
                name = name.replace("text_model.", "")
            name = name.replace("language_model.", "")
            out[name] = (shard, spec)
    return [(n, s, t) for n, (s, t) in out.items()]


def permute(w: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def tensor_bytes(qtype: gguf.GGMLQuantizationType, shape: tuple[int, ...]) -> int:
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    n = int(np.prod(shape, dtype=np.int64))
    return n // block * size


def plan_tensors(
    hp: dict[str, Any],
    arch: Arch,
    hf: str,
    ftype: gguf.LlamaFileType,
    named: list[tuple[str, Shard, TensorSpec]],
    read: Callable[[Shard, TensorSpec], np.ndarray],
    n_vocab_real: int | None = None,
) -> list[Item]:
    n_blocks = hp["num_hidden_layers"]
    tmap = gguf.get_tensor_name_map(arch.model_arch, n_blocks)
    n_head = hp["num_attention_heads"]
    n_kv = hp.get("num_key_value_heads", n_head)
    want = {
        gguf.LlamaFileType.ALL_F32: gguf.GGMLQuantizationType.F32,
        gguf.LlamaFileType.MOSTLY_F16: gguf.GGMLQuantizationType.F16,
        gguf.LlamaFileType.MOSTLY_BF16: gguf.GGMLQuantizationType.BF16,
        gguf.LlamaFileType.MOSTLY_Q8_0: gguf.GGMLQuantizationType.Q8_0,
    }[ftype]
    items: list[Item] = []
    seen: set[str] = set()
    if arch.name == "llama" and (factors := llama3_rope_factors(hp)) is not None:
        # the reference's extra tensors come before the checkpoint's
        name = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight"
        seen.add(name)

        def rope_freqs(factors: np.ndarray = factors) -> np.ndarray:
            return factors

        f32 = gguf.GGMLQuantizationType.F32
        items.append(Item(name, f32, factors.shape, factors.nbytes, rope_freqs))
    for name, shard, spec in named:
        if name.endswith((".attention.masked_bias", ".attention.bias", ".rotary_emb.inv_freq")):
            continue
        if spec.dtype not in DTYPE_BYTES:
            raise ConvertError(not_converted(f"{shard.name}: tensor {spec.name!r}", spec.dtype))
        if hf in ("LlamaModel", "Qwen2Model", "Qwen3Model"):
            name = "model." + name
        if arch.name == "bert" and name in ("classifier.weight", "classifier.bias"):
            if classifier_labels(hp) is not None:  # BertModel.modify_tensors: cls.output
                name = name.replace("classifier.", "classifier.out_proj.")
        new_name = tmap.get_name(key=name, try_suffixes=(".weight", ".bias"))
        if new_name is None:
            raise ConvertError(
                f"tensor {spec.name!r} ({shard.name}) has no GGUF name for {arch.name}"
            )
        if new_name in seen:
            raise ConvertError(f"tensor {new_name} would be written twice")
        seen.add(new_name)
        shape = spec.shape
        rows: int | None = None
        shift = arch.name == "gemma3" and name.endswith("norm.weight")
        if arch.name == "gemma3" and "embed_tokens.weight" in name and n_vocab_real is not None:
            rows = n_vocab_real  # out-of-vocabulary rows dropped, as the reference drops them
            shape = (min(shape[0], rows), *shape[1:])
        if arch.permute_qk and name.endswith(
            ("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias")
        ):
            heads = n_head if "q_proj" in name else n_kv
            if not shape or shape[0] % (2 * heads):
                raise ConvertError(
                    f"tensor {spec.name!r}: shape {list(shape)} does not split into {heads} heads"
                )
        if (
            len(shape) <= 1
            or new_name.endswith("_norm.weight")
            or new_name in ("position_embd.weight", "token_types.weight")  # kept in F32
            or new_name[-7:]
            not in (
                ".weight",
                ".lora_a",
                ".lora_b",
            )
        ):
            qtype = gguf.GGMLQuantizationType.F32
        else:
            qtype = want
            if qtype == gguf.GGMLQuantizationType.Q8_0 and shape[-1] % 32:
                qtype = gguf.GGMLQuantizationType.F16  # the reference's fallback
        stored_f16 = spec.dtype == "F16"

        def load(
            shard: Shard = shard,
            spec: TensorSpec = spec,
            name: str = name,
            qtype: gguf.GGMLQuantizationType = qtype,
            stored_f16: bool = stored_f16,
            rows: int | None = rows,
            shift: bool = shift,
        ) -> np.ndarray:
            data = read(shard, spec)
            if rows is not None:
                data = data[:rows]
            if shift:
                data = data + data.dtype.type(1.0)  # Gemma3RMSNorm's (1 + weight), in its dtype
            if arch.permute_qk:
                if name.endswith(("q_proj.weight", "q_proj.bias")):
                    data = permute(data, n_head, n_head)
                elif name.endswith(("k_proj.weight", "k_proj.bias")):
                    data = permute(data, n_head, n_kv)
            if qtype == gguf.GGMLQuantizationType.F32:
                return np.ascontiguousarray(data, dtype=np.float32)
            if qtype == gguf.GGMLQuantizationType.F16:
                return np.ascontiguousarray(data, dtype=np.float16)
            if not stored_f16:
                data = np.asarray(data, dtype=np.float32)
            return np.ascontiguousarray(gguf.quants.quantize(np.ascontiguousarray(data), qtype))

        items.append(Item(new_name, qtype, shape, tensor_bytes(qtype, shape), load))
    return items


def add_parameters(
    w: gguf.GGUFWriter, hp: dict[str, Any], arch: Arch, ftype: gguf.LlamaFileType, directory: str
) -> None:
    """TextModel's keys, then the architecture's own (the reference's order)."""
    w.add_block_count(hp["num_hidden_layers"])
    n_ctx = find(
        hp,
        (
            "max_position_embeddings",
            "n_ctx",
            "n_positions",
            "max_length",
            "max_sequence_length",
            "model_max_length",
        ),
    )
    if n_ctx is not None:
        w.add_context_length(n_ctx)
    if (n_embd := find(hp, ("hidden_size", "n_embd", "dim"))) is not None:
        w.add_embedding_length(n_embd)
    n_ff = find(
        hp,
        (
            "prefix_dense_intermediate_size",
            "dense_intermediate_size",
            "intermediate_size",
            "n_inner",
            "hidden_dim",
        ),
    )
    if n_ff is not None:
        w.add_feed_forward_length(n_ff)
    if (n_head := find(hp, ("num_attention_heads", "n_head", "n_heads"))) is not None:
        w.add_head_count(n_head)
    if (n_kv := find(hp, ("num_key_value_heads", "n_kv_heads"))) is not None:
        w.add_head_count_kv(n_kv)
    if hp.get("is_causal") is False:
        w.add_causal_attention(False)
    rope = rope_parameters(hp)
    if (rope_type := rope.get("rope_type")) is not None:
        factor = rope.get("factor")
        if rope_type == "linear" and factor is not None:
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(factor)
        elif rope_type == "yarn" and factor is not None:
            w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            w.add_rope_scaling_factor(factor)
            w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
            if (v := rope.get("extrapolation_factor")) is not None:
                w.add_rope_scaling_yarn_ext_factor(v)
            if (v := rope.get("attention_factor", rope.get("attn_factor"))) is not None:
                w.add_rope_scaling_yarn_attn_factor(v)
            if (v := rope.get("beta_fast")) is not None:
                w.add_rope_scaling_yarn_beta_fast(v)
            if (v := rope.get("beta_slow")) is not None:
                w.add_rope_scaling_yarn_beta_slow(v)
        elif str(rope_type).lower() == "llama3" and arch.name == "llama":
            pass  # no keys: its factors are the rope_freqs.weight tensor (llama3_rope_factors)
        elif rope_type != "default":
            raise ConvertError(
                f"config.json: RoPE scaling {rope_type!r} is not converted by bankml"
            )
    if "mrope_section" in rope:
        raise ConvertError("config.json: multimodal RoPE sections are not converted")
    if (theta := rope.get("rope_theta")) is not None:
        w.add_rope_freq_base(theta)
    if (local := rope.get("sliding_attention", {}).get("rope_theta")) is not None:
        w.add_rope_freq_base_swa(local)
    if (eps := find(hp, ("rms_norm_eps", "norm_eps"))) is not None:
        w.add_layer_norm_rms_eps(eps)
    if (eps := find(hp, ("layer_norm_eps", "layer_norm_epsilon", "norm_epsilon"))) is not None:
        w.add_layer_norm_eps(eps)
    if (
        used := find(hp, ("num_experts_per_tok", "num_experts_per_token", "top_k_experts"))
    ) is not None:
        raise ConvertError(f"config.json: experts per token ({used}) are not converted")
    if hp.get("n_group") is not None or hp.get("topk_group") is not None:
        raise ConvertError("config.json: expert groups are not converted")
    if (head_dim := hp.get("head_dim")) is not None:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_file_type(ftype)
    if arch.name == "gemma3":
        # Gemma3's own keys; some repeat TextModel's (overwritten in place, as the reference does)
        w.add_context_length(hp.get("max_position_embeddings", 131072))
        w.add_head_count(hp.get("num_attention_heads", 8))
        w.add_layer_norm_rms_eps(hp.get("rms_norm_eps", 1e-6))
        w.add_key_length(hp.get("head_dim", 256))
        w.add_value_length(hp.get("head_dim", 256))
        w.add_rope_freq_base(rope.get("rope_theta", 1_000_000.0))
        if hp.get("attn_logit_softcapping") is not None:
            raise ConvertError("config.json: attn_logit_softcapping is not a Gemma 3 setting")
        if softcap := hp.get("final_logit_softcapping"):
            w.add_final_logit_softcapping(softcap)
        if hp.get("sliding_window_pattern") != 1:
            w.add_sliding_window(hp["sliding_window"])
        w.add_head_count_kv(hp.get("num_key_value_heads", 4))
    elif arch.name == "bert":
        w.add_causal_attention(False)
        pooling = pooling_type(directory)
        if pooling is not None:
            w.add_pooling_type(pooling)
        if hp.get("classifier_pooling") is not None:
            raise ConvertError("config.json: a classifier head is not converted")
        if labels := classifier_labels(hp):
            w.add_classifier_output_labels(labels)
    elif arch.name == "llama":
        w.add_vocab_size(hp["vocab_size"])
        rope_dim = hp.get("head_dim")
        if rope_dim is None:
            rope_dim = hp["hidden_size"] // hp["num_attention_heads"]
        w.add_rope_dimension_count(rope_dim)
    else:
        if os.path.isfile(os.path.join(directory, "modules.json")):
            raise ConvertError("a sentence-transformers model (modules.json) is not converted yet")
        if hp.get("classifier_pooling") is not None:
            raise ConvertError("config.json: a classifier head is not converted")


def pooling_type(directory: str) -> gguf.PoolingType | None:
    """The sentence-transformers pooling the reference writes as ``bert.pooling_type``: from
    the Pooling module that modules.json names (its config.json), else none."""
    path = os.path.join(directory, "modules.json")
    if not os.path.isfile(path):
        return None
    modules = read_json(path, "modules.json")
    where = next(
        (
            m.get("path")
            for m in (modules if isinstance(modules, list) else [])
            if isinstance(m, dict) and str(m.get("type", "")).endswith("Pooling")
        ),
        None,
    )
    if where is None:
        return None
    name = os.path.join(str(where), "config.json")
    pooling = read_json(os.path.join(directory, name), name)
    if not isinstance(pooling, dict):
        raise ConvertError(f"{name} is not a JSON object")
    modes = {
        "mean": gguf.PoolingType.MEAN,
        "cls": gguf.PoolingType.CLS,
        "lasttoken": gguf.PoolingType.LAST,
    }
    if pooling.get("pooling_mode_mean_tokens"):
        return gguf.PoolingType.MEAN
    if pooling.get("pooling_mode_cls_token"):
        return gguf.PoolingType.CLS
    if pooling.get("pooling_mode_lasttoken"):
        return gguf.PoolingType.LAST
    if (mode := pooling.get("pooling_mode")) in modes:
        return modes[mode]
    raise ConvertError(f"{name}: only mean, CLS and last-token pooling are converted")


def add_vocab(w: gguf.GGUFWriter, v: Vocab, hp: dict[str, Any], arch: Arch) -> None:
    if arch.name == "bert":
        w.add_token_type_count(hp.get("type_vocab_size", 1))
    if v.add_space_prefix is not None:
        w.add_add_space_prefix(v.add_space_prefix)
    w.add_tokenizer_model(v.model)
    w.add_tokenizer_pre(v.pre)
    w.add_token_list(v.tokens)
    if v.scores is not None:
        w.add_token_scores(v.scores)
    w.add_token_types(v.types)
    if v.merges:
        w.add_token_merges(v.merges)
    for typ, tid in v.special_ids.items():
        adder = getattr(w, f"add_{typ}_token_id", None)
        if adder is not None:  # no key for a CLS token: skipped, as the reference skips it
            adder(tid)
    for typ, flag in v.add_special.items():
        adder = getattr(w, f"add_add_{typ}_token", None)
        if adder is not None:
            adder(flag)
    if v.chat_template is not None:
        w.add_chat_template(v.chat_template)
    if v.lowercase is not None:
        w.add_bool("tokenizer.ggml.normalizer.lowercase", v.lowercase)
    if v.strip_accents is not None:
        w.add_bool("tokenizer.ggml.normalizer.strip_accents", v.strip_accents)
    if arch.name == "gemma3" and v.model == "llama":
        w.add_add_space_prefix(False)
    if arch.name == "llama":
        vocab_size = hp.get("vocab_size", 32000)
        if vocab_size == 32016:
            raise ConvertError("a CodeLlama vocabulary (32016 tokens) is not converted")
        if vocab_size == 49152:  # the reference's rule for Granite-sized vocabularies
            w.add_add_bos_token(False)  # overwritten in place when already written


def qwen3_reranker(directory: str, hp: dict[str, Any], hf_raw: str | None) -> bool:
    readme = os.path.join(directory, "README.md")
    text = ""
    if os.path.isfile(readme):
        with open(readme, encoding="utf-8", errors="replace") as f:
            text = f.read().lower()
    if "# qwen3-reranker" in text or "# qwen3-vl-reranker" in text:
        return True
    hints = [
        os.path.basename(os.path.normpath(directory)),
        str(hp.get("_name_or_path", "")),
        str(hp.get("model_type", "")),
        str(hf_raw or ""),
    ]
    if any("qwen3-reranker" in h.lower() or "qwen3-vl-reranker" in h.lower() for h in hints if h):
        return True
    return "sequenceclassification" in (hf_raw or "").lower()


def generation_repeat_penalty(directory: str) -> Any:
    path = os.path.join(directory, "generation_config.json")
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(cfg, dict) or "penalty_repeat" in cfg:
        return None
    return cfg.get("repetition_penalty")
