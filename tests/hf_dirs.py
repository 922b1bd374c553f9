"""Hugging Face style model directories the convert tests build from data they make.

``smollm2_dir`` turns the default model's GGUF back into what its Hugging Face checkout holds:
the weights dequantized into one BF16 ``model.safetensors`` (the query and key projections
un-permuted into Hugging Face's layout), ``config.json`` from its metadata, and a
``tokenizer.json`` / ``tokenizer_config.json`` from its vocabulary, merges and chat template.
``tiny_dir`` writes a small random model of another architecture with the same tokenizer.
``minilm_dir`` is all-MiniLM-L6-v2, a real sentence-transformers BERT directory
(scripts/fetch-minilm.sh), and ``tiny_bert_dir`` a small random BERT with its WordPiece tokenizer.
``write_safetensors`` is the file format itself (8-byte header length, JSON header, data).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from bankml.engine_cupy.gguf_file import GGUFFile

HF_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}


def bf16_bits(a: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits, rounded to nearest even (as torch rounds)."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def write_safetensors(path: Path, tensors: dict[str, tuple[str, np.ndarray]]) -> None:
    """tensors: name -> (dtype name, array of that dtype's bytes: <f4, <f2, or uint16 for BF16)."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    at = 0
    blobs = []
    for name, (dtype, arr) in tensors.items():
        raw = np.ascontiguousarray(arr).tobytes()
        header[name] = {
            "dtype": dtype,
            "shape": list(arr.shape),
            "data_offsets": [at, at + len(raw)],
        }
        at += len(raw)
        blobs.append(raw)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for b in blobs:
            f.write(b)


def _field(reader: GGUFFile, key: str) -> Any:
    f = reader.fields.get(key)
    return None if f is None else f.contents()


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    return (
        w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def write_tokenizer(directory: Path, reader: GGUFFile) -> None:
    tokens = _field(reader, "tokenizer.ggml.tokens")
    types = _field(reader, "tokenizer.ggml.token_type")
    merges = _field(reader, "tokenizer.ggml.merges")
    added = [
        {
            "id": i,
            "content": t,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for i, (t, ty) in enumerate(zip(tokens, types))
        if ty == 3
    ]
    tok = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Digits", "individual_digits": True},
                {
                    "type": "ByteLevel",
                    "add_prefix_space": False,
                    "trim_offsets": True,
                    "use_regex": True,
                },
            ],
        },
        "post_processor": {
            "type": "ByteLevel",
            "add_prefix_space": True,
            "trim_offsets": False,
            "use_regex": True,
        },
        "decoder": {
            "type": "ByteLevel",
            "add_prefix_space": True,
            "trim_offsets": True,
            "use_regex": True,
        },
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": {t: i for i, t in enumerate(tokens)},
            "merges": [m.split(" ", 1) for m in merges],
        },
    }
    (directory / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False), encoding="utf-8")
    names = {i: tokens[i] for i in range(len(tokens))}
    config = {
        "add_prefix_space": False,
        "additional_special_tokens": [a["content"] for a in added[1:3]],
        "bos_token": names[int(_field(reader, "tokenizer.ggml.bos_token_id"))],
        "chat_template": _field(reader, "tokenizer.chat_template"),
        "clean_up_tokenization_spaces": False,
        "eos_token": names[int(_field(reader, "tokenizer.ggml.eos_token_id"))],
        "model_max_length": 8192,
        "pad_token": names[int(_field(reader, "tokenizer.ggml.padding_token_id"))],
        "tokenizer_class": "GPT2Tokenizer",
        "unk_token": names[int(_field(reader, "tokenizer.ggml.unknown_token_id"))],
        "vocab_size": len(tokens),
    }
    (directory / "tokenizer_config.json").write_text(
        json.dumps(config, indent=2, ensure_ascii=False), encoding="utf-8"
    )


def smollm2_dir(gguf_path: Path, directory: Path) -> Path:
    """The default model as a Hugging Face checkout (BF16 weights) in ``directory``."""
    reader = GGUFFile(gguf_path)  # gguf's reader takes seconds over the vocabulary
    directory.mkdir(parents=True, exist_ok=True)
    n_head = int(_field(reader, "llama.attention.head_count"))
    n_kv = int(_field(reader, "llama.attention.head_count_kv"))
    tensors: dict[str, tuple[str, np.ndarray]] = {}
    for t in reader.tensors:
        data = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        parts = t.name.split(".")
        if parts[0] == "blk":
            name = f"model.layers.{parts[1]}.{HF_NAMES[parts[2]]}.{parts[3]}"
            if parts[2] == "attn_q":
                data = unpermute(data, n_head)
            elif parts[2] == "attn_k":
                data = unpermute(data, n_kv)
        else:
            name = f"{HF_NAMES[parts[0]]}.{parts[1]}"
        tensors[name] = ("BF16", bf16_bits(data))
    write_safetensors(directory / "model.safetensors", dict(sorted(tensors.items())))
    config = {
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": int(_field(reader, "tokenizer.ggml.bos_token_id")),
        "eos_token_id": int(_field(reader, "tokenizer.ggml.eos_token_id")),
        "hidden_act": "silu",
        "hidden_size": int(_field(reader, "llama.embedding_length")),
        "initializer_range": 0.041666666666666664,
        "intermediate_size": int(_field(reader, "llama.feed_forward_length")),
        "max_position_embeddings": int(_field(reader, "llama.context_length")),
        "model_type": "llama",
        "num_attention_heads": n_head,
        "num_hidden_layers": int(_field(reader, "llama.block_count")),
        "num_key_value_heads": n_kv,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-05,
        "rope_scaling": None,
        "rope_theta": 100000,
        "tie_word_embeddings": "output.weight" not in [t.name for t in reader.tensors],
        "torch_dtype": "bfloat16",
        "transformers_version": "4.42.3",
        "use_cache": True,
        "vocab_size": len(_field(reader, "tokenizer.ggml.tokens")),
    }
    (directory / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    (directory / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 1, "eos_token_id": 2, "transformers_version": "4.42.3"}),
        encoding="utf-8",
    )
    write_tokenizer(directory, reader)
    return directory


def tiny_dir(
    gguf_path: Path,
    directory: Path,
    arch: str,
    *,
    seed: int = 0,
    shards: int = 1,
    spm: bytes | None = None,
    head_dim: int | None = None,
    rope_scaling: dict[str, Any] | None = None,
    rope_parameters: bool = False,
    qk_scale: float = 1.0,
) -> Path:
    """A small random ``arch`` ("llama", "qwen2", "qwen3") model with the default model's tokenizer.

    Weights are stored in a mix of F32, F16 and BF16; ``shards`` > 1 splits them over several
    files with a ``model.safetensors.index.json``. ``spm``: a SentencePiece ``tokenizer.model``
    to use instead (its vocabulary padded to 512). ``head_dim`` (default hidden // heads) and
    ``rope_scaling`` (with rope_theta 500000, as Llama 3's) go into config.json when given;
    with ``rope_parameters`` as transformers v5 writes them (one ``rope_parameters`` object
    holding rope_theta, no ``rope_scaling``); ``qk_scale`` scales the Q and K projections
    (sharper attention, where RoPE shows).
    """
    reader = GGUFFile(gguf_path)  # gguf's reader takes seconds over the vocabulary
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    n_vocab = 512 if spm is not None else len(_field(reader, "tokenizer.ggml.tokens"))
    hidden, n_head, n_kv, n_ff, n_layer = 64, 4, 2, 96, 2
    explicit_head_dim = head_dim is not None
    head_dim = head_dim or hidden // n_head
    dtypes = ["BF16", "F16", "F32"]

    def tensor(shape: tuple[int, ...], k: int, scale: float = 1.0) -> tuple[str, np.ndarray]:
        a = (rng.standard_normal(shape) * 0.05 * scale).astype(np.float32)
        dtype = dtypes[k % 3]
        if dtype == "BF16":
            return dtype, bf16_bits(a)
        return dtype, a.astype("<f2" if dtype == "F16" else "<f4")

    t: dict[str, tuple[str, np.ndarray]] = {}
    k = 0
    t["model.embed_tokens.weight"] = tensor((n_vocab, hidden), 0)
    t["model.norm.weight"] = tensor((hidden,), 2)
    t["lm_head.weight"] = tensor((n_vocab, hidden), 1)
    for b in range(n_layer):
        p = f"model.layers.{b}."
        shapes = {
            "self_attn.q_proj.weight": (n_head * head_dim, hidden),
            "self_attn.k_proj.weight": (n_kv * head_dim, hidden),
            "self_attn.v_proj.weight": (n_kv * head_dim, hidden),
            "self_attn.o_proj.weight": (hidden, n_head * head_dim),
            "mlp.gate_proj.weight": (n_ff, hidden),
            "mlp.up_proj.weight": (n_ff, hidden),
            "mlp.down_proj.weight": (hidden, n_ff),
            "input_layernorm.weight": (hidden,),
            "post_attention_layernorm.weight": (hidden,),
        }
        if arch == "qwen2":
            shapes.update(
                {
                    "self_attn.q_proj.bias": (n_head * head_dim,),
                    "self_attn.k_proj.bias": (n_kv * head_dim,),
                    "self_attn.v_proj.bias": (n_kv * head_dim,),
                }
            )
        if arch == "qwen3":
            shapes.update(
                {"self_attn.q_norm.weight": (head_dim,), "self_attn.k_norm.weight": (head_dim,)}
            )
        for name, shape in shapes.items():
            k += 1
            qk = name.startswith(("self_attn.q_proj", "self_attn.k_proj"))
            t[p + name] = tensor(shape, k, qk_scale if qk else 1.0)
    names = sorted(t)
    if shards <= 1:
        write_safetensors(directory / "model.safetensors", {n: t[n] for n in names})
    else:
        weight_map = {}
        for s in range(shards):
            part = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            mine = names[s::shards]
            write_safetensors(directory / part, {n: t[n] for n in mine})
            weight_map.update({n: part for n in mine})
        index = {"metadata": {"total_size": 0}, "weight_map": dict(sorted(weight_map.items()))}
        (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    hf = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[
        arch
    ]
    config: dict[str, Any] = {
        "architectures": [hf],
        "model_type": arch,
        "hidden_size": hidden,
        "intermediate_size": n_ff,
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "num_hidden_layers": n_layer,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
        "vocab_size": n_vocab,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    if arch == "qwen3" or explicit_head_dim:
        config["head_dim"] = head_dim
    if rope_scaling is not None and rope_parameters:
        del config["rope_theta"]
        config["rope_parameters"] = {**rope_scaling, "rope_theta": 500000.0}
    elif rope_scaling is not None:
        config["rope_scaling"] = rope_scaling
        config["rope_theta"] = 500000.0
    (directory / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    write_model_card(directory, arch)
    if spm is not None:
        write_spm_tokenizer(directory, spm)
    else:
        write_tokenizer(directory, reader)
    return directory


# runs llama.cpp's convert_hf_to_gguf.py's main() once per job in one process:
# argv: the script, then JSON [[directory, outtype, outfile], ...]
REFERENCE_DRIVER = """
import importlib.util, json, os, sys
script, jobs = sys.argv[1], json.loads(sys.argv[2])
sys.path.insert(0, os.path.dirname(script))
spec = importlib.util.spec_from_file_location("convert_hf_to_gguf", script)
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
for directory, outtype, out in jobs:
    sys.argv = [script, directory, "--outtype", outtype, "--outfile", out]
    module.main()
"""


def write_model_card(directory: Path, arch: str) -> None:
    """generation_config.json's sampling defaults and a README.md model card, which the
    reference reads into general.* and sampling keys."""
    generation = {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20}
    generation["repetition_penalty"] = 1.05
    (directory / "generation_config.json").write_text(json.dumps(generation), encoding="utf-8")
    (directory / "README.md").write_text(
        "---\nlicense: apache-2.0\nlanguage:\n- en\ntags:\n- tiny\n- " + arch + "\n"
        "pipeline_tag: text-generation\n---\n\n# A tiny random model\n\nMade by bankml's tests.\n",
        encoding="utf-8",
    )


def minilm_dir() -> Path:
    """all-MiniLM-L6-v2 unpacked under the cache (scripts/fetch-minilm.sh, run by ``make
    test-deps``; run here when it has not been)."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    out = subprocess.run(
        [str(root / "scripts" / "fetch-minilm.sh")],
        check=True,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHON": sys.executable},
    )
    return Path(out.stdout.strip().splitlines()[-1])


def tiny_bert_dir(
    minilm: Path, directory: Path, *, seed: int = 0, labels: list[str] | None = None
) -> Path:
    """A small random BERT checkpoint in the original BERT naming ("bert."
    prefix, LayerNorm ``gamma``/``beta``, a pooler and an MLM head the converter drops; BF16, F16
    and F32 weights) with MiniLM's tokenizer and CLS pooling (modules.json, 1_Pooling). With
    ``labels``: a ``BertForSequenceClassification`` (a reranker, a cross-encoder) instead, its
    ``classifier`` one row per label, ``id2label`` naming them, no sentence-transformers files."""
    import shutil

    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    n_vocab, hidden, n_head, n_ff, n_layer, n_pos = 30522, 64, 4, 128, 2, 128
    k = 0

    def tensor(shape: tuple[int, ...], scale: float = 0.05) -> tuple[str, np.ndarray]:
        nonlocal k
        k += 1
        a = (rng.standard_normal(shape) * scale).astype(np.float32)
        dtype = ("BF16", "F16", "F32")[k % 3]
        if dtype == "BF16":
            return dtype, bf16_bits(a)
        return dtype, a.astype("<f2" if dtype == "F16" else "<f4")

    def norm(prefix: str) -> dict[str, tuple[str, np.ndarray]]:
        return {
            prefix + ".gamma": ("F32", (1 + rng.standard_normal(hidden) * 0.1).astype("<f4")),
            prefix + ".beta": ("F32", (rng.standard_normal(hidden) * 0.1).astype("<f4")),
        }

    t: dict[str, tuple[str, np.ndarray]] = {
        "bert.embeddings.word_embeddings.weight": tensor((n_vocab, hidden), 0.5),
        "bert.embeddings.position_embeddings.weight": tensor((n_pos, hidden), 0.5),
        "bert.embeddings.token_type_embeddings.weight": tensor((2, hidden), 0.5),
        "bert.embeddings.position_ids": ("I64", np.arange(n_pos, dtype="<i8")[None, :]),
        **norm("bert.embeddings.LayerNorm"),
        "bert.pooler.dense.weight": tensor((hidden, hidden)),
        "bert.pooler.dense.bias": tensor((hidden,)),
        "cls.predictions.bias": tensor((n_vocab,)),
        "cls.predictions.transform.dense.weight": tensor((hidden, hidden)),
    }
    for b in range(n_layer):
        p = f"bert.encoder.layer.{b}."
        for name, shape in {
            "attention.self.query": (hidden, hidden),
            "attention.self.key": (hidden, hidden),
            "attention.self.value": (hidden, hidden),
            "attention.output.dense": (hidden, hidden),
            "intermediate.dense": (n_ff, hidden),
            "output.dense": (hidden, n_ff),
        }.items():
            t[p + name + ".weight"] = tensor(shape, 0.2)
            t[p + name + ".bias"] = tensor(shape[:1], 0.1)
        t.update(norm(p + "attention.output.LayerNorm"))
        t.update(norm(p + "output.LayerNorm"))
    if labels is not None:  # the classifier reads the [CLS] row (scaled up: scores spread)
        t["classifier.weight"] = tensor((len(labels), hidden), 2.0)
        t["classifier.bias"] = tensor((len(labels),), 0.5)
    write_safetensors(directory / "model.safetensors", dict(sorted(t.items())))
    config: dict[str, Any] = {
        "architectures": ["BertModel" if labels is None else "BertForSequenceClassification"],
        "model_type": "bert",
        "hidden_size": hidden,
        "intermediate_size": n_ff,
        "num_attention_heads": n_head,
        "num_hidden_layers": n_layer,
        "max_position_embeddings": n_pos,
        "type_vocab_size": 2,
        "layer_norm_eps": 1e-05,
        "vocab_size": n_vocab,
        "pad_token_id": 0,
    }
    if labels is not None:
        config["id2label"] = {str(i): label for i, label in enumerate(labels)}
        config["label2id"] = {label: i for i, label in enumerate(labels)}
    (directory / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(minilm / name, directory / name)
    if labels is not None:
        return directory
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pool", "type": "sentence_transformers.models.Pooling"},
    ]
    (directory / "modules.json").write_text(json.dumps(modules), encoding="utf-8")
    (directory / "1_Pool").mkdir(exist_ok=True)
    (directory / "1_Pool" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": hidden, "pooling_mode_cls_token": True}),
        encoding="utf-8",
    )
    return directory


def reference_python() -> str | None:
    """The reference converter's Python (scripts/convert-reference-venv.sh), when it is set up."""
    cache = os.environ.get("BANKML_CACHE", os.path.expanduser("~/.cache/bankml"))
    py = os.path.join(cache, "convert-reference", "venv", "bin", "python")
    return (
        py
        if os.path.isfile(os.path.join(cache, "convert-reference", "venv", ".complete-11434"))
        else None
    )


def reference_script() -> str:
    cache = os.environ.get("BANKML_CACHE", os.path.expanduser("~/.cache/bankml"))
    return os.path.join(cache, "llama-server", "11434", "src", "llama.cpp", "convert_hf_to_gguf.py")


def tiny_gemma3_dir(
    gguf_path: Path, directory: Path, *, seed: int = 0, spm: bytes | None = None
) -> Path:
    """A small random Gemma 3 text model (tied embeddings, q/k norms, four norms a layer)."""
    reader = GGUFFile(gguf_path)  # gguf's reader takes seconds over the vocabulary
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    n_vocab = 512 if spm is not None else len(_field(reader, "tokenizer.ggml.tokens"))
    hidden, n_head, n_kv, head_dim, n_ff, n_layer = 64, 4, 1, 16, 96, 2
    t: dict[str, tuple[str, np.ndarray]] = {}
    k = 0

    def tensor(shape: tuple[int, ...]) -> tuple[str, np.ndarray]:
        nonlocal k
        k += 1
        a = (rng.standard_normal(shape) * 0.05).astype(np.float32)
        dtype = ("BF16", "F16", "F32")[k % 3]
        if dtype == "BF16":
            return dtype, bf16_bits(a)
        return dtype, a.astype("<f2" if dtype == "F16" else "<f4")

    t["model.embed_tokens.weight"] = tensor((n_vocab, hidden))
    t["model.norm.weight"] = tensor((hidden,))
    for b in range(n_layer):
        p = f"model.layers.{b}."
        for name, shape in {
            "self_attn.q_proj.weight": (n_head * head_dim, hidden),
            "self_attn.k_proj.weight": (n_kv * head_dim, hidden),
            "self_attn.v_proj.weight": (n_kv * head_dim, hidden),
            "self_attn.o_proj.weight": (hidden, n_head * head_dim),
            "self_attn.q_norm.weight": (head_dim,),
            "self_attn.k_norm.weight": (head_dim,),
            "mlp.gate_proj.weight": (n_ff, hidden),
            "mlp.up_proj.weight": (n_ff, hidden),
            "mlp.down_proj.weight": (hidden, n_ff),
            "input_layernorm.weight": (hidden,),
            "post_attention_layernorm.weight": (hidden,),
            "pre_feedforward_layernorm.weight": (hidden,),
            "post_feedforward_layernorm.weight": (hidden,),
        }.items():
            t[p + name] = tensor(shape)
    write_safetensors(directory / "model.safetensors", dict(sorted(t.items())))
    config = {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "hidden_size": hidden,
        "intermediate_size": n_ff,
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "num_hidden_layers": n_layer,
        "max_position_embeddings": 8192,
        "query_pre_attn_scalar": head_dim,
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "sliding_window": 512,
        "sliding_window_pattern": 6,
        "final_logit_softcapping": None,
        "vocab_size": n_vocab,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    (directory / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    write_model_card(directory, "gemma3")
    if spm is not None:
        write_spm_tokenizer(directory, spm)
    else:
        write_tokenizer(directory, reader)
    return directory


SPM_TRAIN = """
import io, random, sys
import sentencepiece as spm
random.seed(0)
words = "the quick brown fox jumps over a lazy dog while the model answers and signs".split()
lines = [" ".join(random.choice(words) for _ in range(12)) for _ in range(2000)]
out = io.BytesIO()
spm.SentencePieceTrainer.train(
    sentence_iterator=iter(lines), model_writer=out, vocab_size=400, model_type="bpe",
    byte_fallback=True, pad_id=0, eos_id=1, bos_id=2, unk_id=3,
    user_defined_symbols=["<start_of_turn>", "<end_of_turn>"], minloglevel=2)
sys.stdout.buffer.write(out.getvalue())
"""


def train_sentencepiece(python: str) -> bytes:
    """A small BPE SentencePiece model (Gemma's special ids), trained by ``python``'s
    sentencepiece (the reference converter's venv has it) on generated text."""
    import subprocess

    return subprocess.run([python, "-c", SPM_TRAIN], check=True, capture_output=True).stdout


def write_spm_tokenizer(directory: Path, model: bytes) -> None:
    """``tokenizer.model`` and a ``tokenizer_config.json`` as Gemma and Llama 2 checkouts have them."""
    (directory / "tokenizer.model").write_bytes(model)
    config = {
        "add_bos_token": True,
        "add_eos_token": False,
        "added_tokens_decoder": {
            "0": {"content": "<pad>", "special": True},
            "4": {"content": "<start_of_turn>", "special": True},
            "5": {"content": "<end_of_turn>", "special": True},
            "401": {"content": "<extra_0>", "special": False},
        },
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "<pad>",
        "unk_token": "<unk>",
        "chat_template": "{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}<end_of_turn>\n{% endfor %}",
        "tokenizer_class": "GemmaTokenizer",
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
