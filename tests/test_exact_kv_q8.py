"""The q8_0 KV cache on the CPU against ggml's own ops (tests/ggml_oracle.py), bit for bit.

llama.cpp's graph with ``--cache-type-k/v q8_0`` (llm_graph_context::build_attn): Q and K turned
by ``llama_mul_mat_hadamard`` with the K rotation, V with the V rotation, K and V written into
the cache by ``ggml_set_rows`` (f32 -> q8_0: ``quantize_row_q8_0``), flash attention over the
cache, and its output turned back by the V rotation. Each step is compared here with the same
step run by ggml; the last test chains them all on one layer.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from bankml.engine_cupy.kernels.exact_attention import attention_mask, flash_attn_q8_0, kv_length
from bankml.engine_cupy.kv_cache import KVCache, rotation_sizes
from tests import ggml_oracle as go

F32 = np.float32
Q8_BLOCK = np.dtype([("d", "<f2"), ("qs", "i1", 32)])  # ggml's block_q8_0: f16 scale, 32 int8


def differing(a: np.ndarray, b: np.ndarray) -> int:
    """Elements whose bits differ."""
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    assert a.shape == b.shape and a.dtype.itemsize == b.dtype.itemsize
    width = {1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize]
    return int(np.count_nonzero(a.view(width) != b.view(width)))


def heads(rng: np.random.Generator, n: int, n_head: int, hd: int) -> np.ndarray:
    """[n, n_head, hd] values, each head row of its own magnitude (1e-3..1e3), some all zero."""
    x = rng.standard_normal((n, n_head, hd)) * 10.0 ** rng.uniform(-3, 3, (n, n_head, 1))
    x[rng.random((n, n_head)) < 0.05] = 0
    return x.astype(F32)


def ggml_cache(
    x: np.ndarray, start: int, n_ctx: int, n: int | None
) -> tuple[np.ndarray, np.ndarray]:
    """What llama.cpp's cache holds after storing x [n_tok, n_head_kv, hd] at start..: x turned
    by the hinted Hadamard product (n None: not turned), then ggml_set_rows into a q8_0 cache of
    n_ctx rows; read back as (int8 [n_head_kv, n_ctx, hd], f16 [n_head_kv, n_ctx, hd/32])."""
    n_tok, n_head_kv, hd = x.shape
    rows = x.reshape(n_tok, -1)
    if n:
        rows = go.fwht(rows, n)
    raw = go.set_rows(rows, np.arange(start, start + n_tok), n_ctx, T.Q8_0)
    blocks = raw.view(Q8_BLOCK).reshape(n_ctx, n_head_kv, hd // 32)
    qs = np.ascontiguousarray(blocks["qs"]).reshape(n_ctx, n_head_kv, hd).transpose(1, 0, 2)
    return np.ascontiguousarray(qs), np.ascontiguousarray(blocks["d"].transpose(1, 0, 2))


# --- which rotation, on which sizes ----------------------------------------------------------


def test_rotation_sizes_as_llama_kv_cache() -> None:
    """n_rot_k: 64 doubled while it divides the head; n_rot_v: 64; none unless hd % 64 == 0."""
    assert rotation_sizes(64) == (64, 64)
    assert rotation_sizes(128) == (128, 64)
    assert rotation_sizes(192) == (64, 64)
    assert rotation_sizes(256) == (256, 64)
    assert rotation_sizes(96) == (0, 0)


@pytest.mark.parametrize("hd", [64, 128, 256])
def test_rotations_match_ggml(hd: int) -> None:
    """rotate_k (Q and K), rotate_v (V) and output (the attention output) as ggml's hinted
    products on the same sizes; an f16 cache turns nothing."""
    rot_k, rot_v = rotation_sizes(hd)
    cache = KVCache(np, 1, 2, hd, 8, "q8_0")
    rng = np.random.default_rng(hd)
    q, v, o = heads(rng, 5, 6, hd), heads(rng, 5, 2, hd), heads(rng, 5, 6, hd)
    assert differing(cache.rotate_k(q), go.fwht(q, rot_k)) == 0
    assert differing(cache.rotate_v(v), go.fwht(v, rot_v)) == 0
    assert differing(cache.output(o), go.fwht(o, rot_v)) == 0
    plain = KVCache(np, 1, 2, hd, 8, "f16")
    assert plain.rotate_k(q) is q and plain.output(o) is o


def test_a_head_not_a_multiple_of_64_is_not_turned() -> None:
    cache = KVCache(np, 1, 2, 96, 8, "q8_0")
    q = heads(np.random.default_rng(0), 3, 2, 96)
    assert cache.rotate_k(q) is q and cache.rotate_v(q) is q


# --- the store ----------------------------------------------------------------------------------


@pytest.mark.parametrize("hd,n_head_kv", [(64, 3), (128, 2), (96, 4)])
def test_store_matches_ggml_set_rows(hd: int, n_head_kv: int) -> None:
    """Two batches stored one after the other (a prompt, then a token) and a batch that
    overwrites cells after truncate: the cache's int8 values and f16 scales are ggml's."""
    rot_k, rot_v = rotation_sizes(hd)
    n_ctx = 40
    cache = KVCache(np, 2, n_head_kv, hd, n_ctx, "q8_0")
    rng = np.random.default_rng(hd)
    k = heads(rng, 30, n_head_kv, hd)
    v = heads(rng, 30, n_head_kv, hd)
    cache.store(1, 0, k[:29], v[:29])
    cache.store(1, 29, k[29:], v[29:])
    for mine, (q_want, d_want) in zip(
        ((0, 1), (2, 3)), (ggml_cache(k, 0, n_ctx, rot_k), ggml_cache(v, 0, n_ctx, rot_v))
    ):
        got = cache.quantized(1, n_ctx)
        assert differing(got[mine[0]], q_want) == 0
        assert differing(got[mine[1]], d_want) == 0
    k2 = heads(rng, 3, n_head_kv, hd)
    cache.store(1, 10, k2, k2)  # cells 10..12 again, as after truncate(10)
    k_all = k.copy()
    k_all[10:13] = k2
    q_want, d_want = ggml_cache(k_all, 0, n_ctx, rot_k)
    kq, kd, _, _ = cache.quantized(1, n_ctx)
    assert differing(kq, q_want) == 0 and differing(kd, d_want) == 0


def test_quantized_are_views_of_the_cache() -> None:
    cache = KVCache(np, 2, 3, 64, 50, "q8_0")
    rng = np.random.default_rng(1)
    cache.store(0, 0, heads(rng, 4, 3, 64), heads(rng, 4, 3, 64))
    kq, kd, vq, vd = cache.quantized(0, 4)
    assert kq.shape == vq.shape == (3, 4, 64) and kd.shape == vd.shape == (3, 4, 2)
    assert kq.dtype == np.int8 and kd.dtype == np.float16
    for view, (q, d) in zip(((kq, kd), (vq, vd)), (cache._k[0], cache._v[0])):
        assert np.shares_memory(view[0], q) and np.shares_memory(view[1], d)
    with pytest.raises(ValueError, match="f16 cache holds no q8_0"):
        KVCache(np, 1, 3, 64, 8, "f16").quantized(0, 1)


def test_vectorised_path_rounds_as_ggml_but_turns_by_a_product() -> None:
    """The CuPy path (run here on NumPy with exact=False, as the model's array path asks): its
    q8_0 rounding of given rows is ggml's; its rotation is a matrix product, which is not ggml's
    transform bit for bit."""
    rng = np.random.default_rng(2)
    x = heads(rng, 20, 3, 64)
    cache = KVCache(np, 1, 3, 64, 20, "q8_0", exact=False)
    assert not cache.exact and KVCache(np, 1, 3, 64, 20, "q8_0").exact
    q, d = cache._q8(x)
    raw = go.quantize_rows(x.reshape(-1, 64), T.Q8_0).view(Q8_BLOCK).reshape(20, 3, 2)
    assert differing(q, np.ascontiguousarray(raw["qs"]).reshape(x.shape)) == 0
    assert differing(d, np.ascontiguousarray(raw["d"])) == 0
    turned, want = cache.rotate_k(x), go.fwht(x, 64)
    assert differing(turned, want) > 0
    np.testing.assert_allclose(turned, want, rtol=1e-5, atol=1e-5 * float(np.abs(x).max()))


# --- one layer, end to end -----------------------------------------------------------------------


@pytest.mark.parametrize("n_past,n_rows", [(0, 7), (7, 1), (0, 70), (70, 1)])
@pytest.mark.parametrize("hd,n_head,n_head_kv", [(64, 9, 3), (128, 4, 2)])
def test_attention_through_the_cache_as_llama_cpp(
    n_past: int, n_rows: int, hd: int, n_head: int, n_head_kv: int
) -> None:
    """build_attn with a q8_0 cache, step by step on ggml: Q, K, V turned; K, V set into the
    cache (after n_past earlier positions); flash_attn_ext over the q8_0 cells (padded to 256 and
    masked, as llama.cpp); the output turned back. The cache with exact_attention.flash_attn_q8_0
    gives the same float32 bits."""
    rot_k, rot_v = rotation_sizes(hd)
    n_ctx, end = 300, n_past + n_rows
    scale = F32(1) / np.sqrt(F32(hd))
    rng = np.random.default_rng(n_past * 31 + n_rows + hd)
    k, v = (rng.normal(0, s, (end, n_head_kv, hd)).astype(F32) for s in (2.0, 0.7))
    q = rng.normal(0, 2.5, (n_rows, n_head, hd)).astype(F32)

    cache = KVCache(np, 1, n_head_kv, hd, n_ctx, "q8_0")
    if n_past:
        cache.store(0, 0, k[:n_past], v[:n_past])
    cache.store(0, n_past, k[n_past:], v[n_past:])
    mask = attention_mask(np.arange(n_past, end), np.arange(end))
    got = cache.output(flash_attn_q8_0(cache.rotate_k(q), *cache.quantized(0, end), mask, scale))

    n_kv = kv_length(end, n_ctx)
    kq, kd = ggml_cache(k, 0, n_kv, rot_k)  # cells past `end` are zero padding, hidden
    vq, vd = ggml_cache(v, 0, n_kv, rot_v)
    mp = np.full((n_rows, n_kv), -np.inf, np.float16)
    mp[:, :end] = mask

    def q8_0_input(qs: np.ndarray, d: np.ndarray) -> bytes:
        blocks = np.zeros(d.shape, Q8_BLOCK)
        blocks["d"], blocks["qs"] = d, qs.reshape(*d.shape, 32)
        return go._input(int(T.Q8_0), (hd, n_kv, n_head_kv), blocks.tobytes())

    attended = go.run(
        "flash_attn_ext",
        [
            go._array_input(np.ascontiguousarray(go.fwht(q, rot_k).transpose(1, 0, 2))),
            q8_0_input(kq, kd),
            q8_0_input(vq, vd),
            go._array_input(mp),
        ],
        fp=[float(scale), 0.0, 0.0],
    ).reshape(n_rows, n_head, hd)
    want = go.fwht(attended, rot_v)
    print(f"\nq8_0 layer hd={hd} past={n_past} rows={n_rows}: {differing(got, want)} differ")
    assert differing(got, want) == 0
