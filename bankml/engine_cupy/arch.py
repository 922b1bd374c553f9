"""What differs between the architectures the forward pass plays: llama, qwen2, qwen3, gemma3.

One generic transformer (model.py) runs all four; each architecture is a table of the tensors it
needs and may have, and a few switches, all read from llama.cpp's graph builders
(src/models/{llama,qwen2,qwen3,gemma3}.cpp and llama_model_rope_type in src/llama-model.cpp).
"""

from __future__ import annotations

from dataclasses import dataclass

# Per-layer tensors every architecture has (Q/K/V may come fused as attn_qkv instead).
BASE_LAYER_TENSORS = (
    "attn_norm.weight",
    "attn_output.weight",
    "ffn_norm.weight",
    "ffn_gate.weight",
    "ffn_up.weight",
    "ffn_down.weight",
)
SPLIT_QKV = ("attn_q.weight", "attn_k.weight", "attn_v.weight")
FUSED_QKV = ("attn_qkv.weight",)
QKV_BIASES = ("attn_q.bias", "attn_k.bias", "attn_v.bias")


@dataclass(frozen=True)
class ArchSpec:
    name: str
    # RoPE pairs: NEOX rotates (i, i + d/2), NORM rotates adjacent pairs (2i, 2i + 1).
    rope_neox: bool
    # Extra per-layer tensors the graph requires, and those it uses when present.
    required_layer: tuple[str, ...] = ()
    optional_layer: tuple[str, ...] = ()
    # Global tensors used when present (besides token_embd, output_norm, output).
    optional_global: tuple[str, ...] = ()
    ffn_activation: str = "silu"  # "silu" (SwiGLU) or "gelu" (GeGLU, tanh approximation)
    qk_norm: bool = False  # per-head RMSNorm of Q and K before RoPE
    post_norms: bool = False  # RMSNorm of the attention and FFN outputs before each residual
    scale_embeddings: bool = False  # token embeddings times sqrt(n_embd)
    sliding_window: bool = False  # local (windowed) layers with their own RoPE base
    # Q times the attention scale before attention, which then attends at scale 1 (gemma3's
    # query_pre_attn_scalar: ggml_scale of Q, then flash attention with kq_scale 1)
    scale_q: bool = False

    def attention_scales(self, attn_scale: float) -> tuple[float, float]:
        """(the factor Q is multiplied by before attention, the attention's own scale) for a
        model whose Q·K scale is ``attn_scale``: (1, attn_scale), or (attn_scale, 1) where
        ``scale_q``. The one rule both the definition (model.py) and the fused decode step
        (kernels/exact_decode.py) follow."""
        return (attn_scale, 1.0) if self.scale_q else (1.0, attn_scale)


ARCHITECTURES: dict[str, ArchSpec] = {
    "llama": ArchSpec(
        name="llama",
        rope_neox=False,
        optional_layer=QKV_BIASES + ("attn_output.bias",),
        # Llama 3.x RoPE scaling is stored by the converter as per-frequency divisors.
        optional_global=("rope_freqs.weight",),
    ),
    "qwen2": ArchSpec(
        name="qwen2",
        rope_neox=True,
        required_layer=QKV_BIASES,
        optional_global=("output.bias",),
    ),
    "qwen3": ArchSpec(
        name="qwen3",
        rope_neox=True,
        required_layer=("attn_q_norm.weight", "attn_k_norm.weight"),
        # a reranker's head (engine_cupy/rank_head.py), not part of the causal graph
        optional_global=("cls.output.weight",),
        qk_norm=True,
    ),
    "gemma3": ArchSpec(
        name="gemma3",
        rope_neox=True,
        required_layer=(
            "attn_q_norm.weight",
            "attn_k_norm.weight",
            "post_attention_norm.weight",
            "post_ffw_norm.weight",
        ),
        ffn_activation="gelu",
        qk_norm=True,
        post_norms=True,
        scale_embeddings=True,
        sliding_window=True,
        scale_q=True,
    ),
}


def supported_names() -> str:
    return ", ".join(ARCHITECTURES)
