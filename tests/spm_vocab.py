"""Tiny synthetic GGUFs for the tokenizer oracle tests.

``write_tiny_llama`` writes a one-layer ``llama`` model with random F32 weights that llama-server
loads in a blink, carrying whatever vocabulary the caller puts in its metadata. ``spm_vocab``
builds a SentencePiece vocabulary (``tokenizer.ggml.model == "llama"``) with what Gemma-style
vocabularies have: ``<unk>``/``<s>``/``</s>``, the 256 byte-fallback tokens ``<0xNN>``, control
and user-defined tokens, and scored pieces with ``▁`` for spaces (some scores tied on purpose, so
the leftmost-on-ties rule is exercised).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np

N_EMBD, N_HEAD, N_FF = 32, 2, 64

SPM_WORDS = [
    "hello",
    "world",
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "lazy",
    "dog",
    "tokenizer",
    "sentence",
    "piece",
    "model",
    "byte",
    "fallback",
    "score",
    "merge",
    "token",
    "text",
    "space",
    "prefix",
    "llama",
    "gemma",
    "python",
    "code",
    "function",
    "return",
    "value",
    "print",
    "über",
    "café",
    "naïve",
    "résumé",
    "привет",
    "мир",
    "γεια",
    "σου",
    "你好",
    "世界",
    "日本",
    "東京",
]
SPM_CONTROL = ("<start_of_turn>", "<end_of_turn>", "<pad>")
SPM_USER_DEFINED = ("<custom_tag>", "[MASK]")


def spm_vocab(seed: int = 7) -> tuple[list[str], list[float], list[int]]:
    """Tokens, scores and token types of a small SentencePiece vocabulary."""
    rng = random.Random(seed)
    tokens = ["<unk>", "<s>", "</s>"]
    types = [2, 3, 3]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [6] * 256
    tokens += list(SPM_CONTROL) + list(SPM_USER_DEFINED)
    types += [3] * len(SPM_CONTROL) + [4] * len(SPM_USER_DEFINED)
    scores = [0.0] * len(tokens)
    pieces: list[str] = []
    seen = set(tokens)

    def add(piece: str) -> None:
        if piece and piece not in seen:
            seen.add(piece)
            pieces.append(piece)

    for ch in "▁abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,!?'\"-:;()":
        add(ch)
    for word in SPM_WORDS:
        for form in (word, "▁" + word):
            for i in range(len(form)):
                for j in range(i + 1, len(form) + 1):
                    add(form[i:j])
    add("▁▁")
    add("▁▁▁▁")
    for piece in pieces:
        tokens.append(piece)
        types.append(1)
        # coarse scores: many ties, so merge order falls back to the leftmost pair
        scores.append(-round(rng.uniform(0, 12) + len(piece) * -0.5, 0))
    return tokens, scores, types


def write_tiny_llama(
    path: Path, n_vocab: int, vocab_kv: Callable[[gguf.GGUFWriter], None], seed: int = 0
) -> Path:
    """A one-layer llama GGUF with tied embeddings, random weights and the caller's vocabulary."""
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("bankml tiny tokenizer test model")
    writer.add_context_length(256)
    writer.add_embedding_length(N_EMBD)
    writer.add_block_count(1)
    writer.add_feed_forward_length(N_FF)
    writer.add_head_count(N_HEAD)
    writer.add_head_count_kv(N_HEAD)
    writer.add_rope_dimension_count(N_EMBD // N_HEAD)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(0)
    vocab_kv(writer)

    def weight(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)

    writer.add_tensor("token_embd.weight", weight(n_vocab, N_EMBD))
    writer.add_tensor("output_norm.weight", np.ones(N_EMBD, dtype=np.float32))
    writer.add_tensor("blk.0.attn_norm.weight", np.ones(N_EMBD, dtype=np.float32))
    for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
        writer.add_tensor(f"blk.0.{name}.weight", weight(N_EMBD, N_EMBD))
    writer.add_tensor("blk.0.ffn_norm.weight", np.ones(N_EMBD, dtype=np.float32))
    writer.add_tensor("blk.0.ffn_gate.weight", weight(N_FF, N_EMBD))
    writer.add_tensor("blk.0.ffn_up.weight", weight(N_FF, N_EMBD))
    writer.add_tensor("blk.0.ffn_down.weight", weight(N_EMBD, N_FF))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_spm_model(path: Path, add_space_prefix: bool, seed: int = 7) -> Path:
    """A tiny llama model with the synthetic SentencePiece vocabulary."""
    tokens, scores, types = spm_vocab(seed)

    def vocab(writer: gguf.GGUFWriter) -> None:
        writer.add_tokenizer_model("llama")
        writer.add_token_list(tokens)
        writer.add_token_scores(scores)
        writer.add_token_types(types)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_unk_token_id(0)
        writer.add_bool("tokenizer.ggml.add_space_prefix", add_space_prefix)
        writer.add_chat_template(
            "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] | trim }}"
            "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
        )

    return write_tiny_llama(path, len(tokens), vocab)


def write_bpe_variant(
    path: Path, metadata: dict[str, object], pre: str, keep_add_bos: bool = True
) -> Path:
    """A tiny llama model carrying a real GPT-2-style vocabulary (tokens, types, merges, special
    ids from ``metadata``) under another pre-tokenizer name."""
    tokens = list(metadata["tokenizer.ggml.tokens"])  # type: ignore[call-overload]

    def vocab(writer: gguf.GGUFWriter) -> None:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(pre)
        writer.add_token_list(tokens)
        writer.add_token_types(list(metadata["tokenizer.ggml.token_type"]))  # type: ignore[call-overload]
        writer.add_token_merges(list(metadata["tokenizer.ggml.merges"]))  # type: ignore[call-overload]
        for key, add in (
            ("bos_token_id", writer.add_bos_token_id),
            ("eos_token_id", writer.add_eos_token_id),
            ("unknown_token_id", writer.add_unk_token_id),
            ("padding_token_id", writer.add_pad_token_id),
        ):
            if "tokenizer.ggml." + key in metadata:
                add(int(metadata["tokenizer.ggml." + key]))  # type: ignore[call-overload]
        if keep_add_bos and "tokenizer.ggml.add_bos_token" in metadata:
            writer.add_add_bos_token(bool(metadata["tokenizer.ggml.add_bos_token"]))

    return write_tiny_llama(path, len(tokens), vocab)
