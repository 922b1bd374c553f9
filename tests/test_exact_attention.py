"""bankml.engine_cupy.kernels.exact_attention against ggml's own flash attention, bit for bit.

Every case runs ``ggml_flash_attn_ext`` of the reference build (tests/ggml_oracle.py: the CPU
backend, 2 threads unless said) on the very inputs given to ``flash_attn_f16``, with K, V and the
mask padded to the cells ggml sees as llama.cpp pads them, and asserts equal float32 bits. The
cases cover the three kernels ggml picks (one_chunk below 64 rows, the split of one row over 512
cells or more, the tiled kernel from 64 rows), random data and Q/K/V captured from the default
model, GQA shapes, head sizes with leftover elements, sliding windows and the thread count.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from bankml.engine_cupy.kernels.exact_attention import (
    FA_TILE_Q,
    SPLIT_MIN_CELLS,
    attention_mask,
    flash_attn_f16,
    flash_attn_q8_0,
    kv_length,
)
from tests import ggml_oracle
from tests.engine_checks import ggml_reference

CACHE_CELLS = 2048  # llama-server -c 2048 -np 1: the cache size that caps the padded length


def random_case(
    rng: np.random.Generator,
    n_rows: int,
    n_cells: int,
    n_head: int = 9,
    n_head_kv: int = 3,
    hd: int = 64,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q/K/V in the ranges of a small model's attention, with a strong first key (a 'sink')."""
    q = rng.normal(0, 2.5, (n_rows, n_head, hd)).astype(np.float32)
    k = rng.normal(0, 2.0, (n_head_kv, n_cells, hd))
    k[:, 0] *= 4  # the first cell draws much of the attention, as BOS does in real models
    v = rng.normal(0, 0.7, (n_head_kv, n_cells, hd))
    return q, k.astype(np.float16), v.astype(np.float16)


def assert_bitwise(
    n_rows: int,
    n_cells: int,
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    scale: float = 0.125,
    window: int = 0,
    threads: int = 2,
    parallel: bool | None = None,
) -> None:
    """A causal batch of n_rows ending at cell n_cells - 1."""
    start = n_cells - n_rows
    mask = attention_mask(np.arange(start, start + n_rows), np.arange(n_cells), window)
    n_kv = kv_length(n_cells, CACHE_CELLS)
    got = flash_attn_f16(q, k, v, mask, scale, n_kv=n_kv, n_threads=threads, parallel=parallel)
    want = ggml_reference(q, k, v, mask, scale, n_kv, threads)
    differ = int(np.sum(got.view(np.uint32) != want.view(np.uint32)))
    print(
        f"rows={n_rows} T={n_cells} n_kv={n_kv} window={window} threads={threads}: "
        f"{differ} of {got.size} values differ"
    )
    assert differ == 0


@pytest.mark.parametrize("n_cells", [1, 2, 31, 100, 255, 256])
def test_decode_one_chunk(n_cells: int) -> None:
    """One row over fewer than 512 padded cells: the one_chunk kernel with its f16 accumulator."""
    q, k, v = random_case(np.random.default_rng(n_cells), 1, n_cells)
    assert kv_length(n_cells, CACHE_CELLS) < SPLIT_MIN_CELLS
    assert_bitwise(1, n_cells, q, k, v)


@pytest.mark.parametrize("n_cells", [257, 300, 511, 512, 513, 1000, 1500, 2048])
def test_decode_split_and_merged(n_cells: int) -> None:
    """One row over 512 cells or more: per-thread chunks merged by reduce_partials."""
    q, k, v = random_case(np.random.default_rng(n_cells), 1, n_cells)
    assert kv_length(n_cells, CACHE_CELLS) >= SPLIT_MIN_CELLS
    assert_bitwise(1, n_cells, q, k, v)


@pytest.mark.parametrize("threads,n_cells", [(1, 900), (3, 900), (4, 900), (4, 257), (8, 520)])
def test_decode_split_follows_thread_count(threads: int, n_cells: int) -> None:
    """The chunks are ceil(n_kv / threads) cells: each -t gives ggml's own rounding, including
    chunks made only of padding (T = 257 over 4 chunks of 128, of which two are empty)."""
    q, k, v = random_case(np.random.default_rng(threads), 1, n_cells)
    assert_bitwise(1, n_cells, q, k, v, threads=threads)


def test_thread_count_changes_the_split_result() -> None:
    """The split really changes the arithmetic, so modelling the thread count is needed."""
    q, k, v = random_case(np.random.default_rng(5), 1, 1200)
    n_kv = kv_length(1200, CACHE_CELLS)
    two = flash_attn_f16(q, k, v, None, 0.125, n_kv=n_kv, n_threads=2)
    three = flash_attn_f16(q, k, v, None, 0.125, n_kv=n_kv, n_threads=3)
    assert not np.array_equal(two, three)


@pytest.mark.parametrize("n_rows,n_cells", [(2, 2), (7, 40), (33, 300), (63, 63), (63, 700)])
def test_small_batches(n_rows: int, n_cells: int) -> None:
    """2..63 rows (the causal mask hides later cells): every row through one_chunk."""
    q, k, v = random_case(np.random.default_rng(n_rows * 1000 + n_cells), n_rows, n_cells)
    assert n_rows < FA_TILE_Q
    assert_bitwise(n_rows, n_cells, q, k, v)


@pytest.mark.parametrize(
    "n_rows,n_cells", [(64, 64), (100, 100), (100, 530), (512, 512), (200, 1024)]
)
def test_tiled_batches(n_rows: int, n_cells: int) -> None:
    """64 rows or more: the tiled kernel (f32 Q, ggml_v_expf, f32 fma chains)."""
    q, k, v = random_case(np.random.default_rng(n_rows * 1000 + n_cells), n_rows, n_cells)
    assert_bitwise(n_rows, n_cells, q, k, v)


@pytest.mark.parametrize("n_rows,n_cells", [(1, 700), (20, 300), (128, 600)])
def test_sliding_window(n_rows: int, n_cells: int) -> None:
    """gemma3's local layers: cells a window or more back are hidden too."""
    q, k, v = random_case(np.random.default_rng(n_rows), n_rows, n_cells)
    assert_bitwise(n_rows, n_cells, q, k, v, window=128)


@pytest.mark.parametrize("n_rows", [1, 10, 100])
def test_masks_with_holes(n_rows: int) -> None:
    """Hidden cells anywhere (a whole tile in the middle, scattered cells, a row with one
    visible cell, a row with none): all-hidden tiles inside a row's span are skipped as ggml."""
    rng = np.random.default_rng(n_rows + 50)
    q, k, v = random_case(rng, n_rows, 300)
    mask = attention_mask(np.arange(300 - n_rows, 300), np.arange(300))
    mask[:, 64:128] = -np.inf
    mask[rng.random(mask.shape) < 0.3] = -np.inf
    mask[0, :] = -np.inf
    mask[0, 200] = 0
    mask[1:2, :] = -np.inf  # a row that sees nothing: ggml writes zeros (S = 0)
    n_kv = kv_length(300, CACHE_CELLS)
    got = flash_attn_f16(q, k, v, mask, 0.125, n_kv=n_kv)
    want = ggml_reference(q, k, v, mask, 0.125, n_kv)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("n_head,n_head_kv,hd", [(8, 8, 128), (4, 2, 80), (6, 1, 36)])
@pytest.mark.parametrize("n_rows,n_cells", [(1, 40), (1, 600), (5, 90), (70, 150)])
def test_other_shapes(n_head: int, n_head_kv: int, hd: int, n_rows: int, n_cells: int) -> None:
    """No GQA, GQA 2 and 6; head sizes with elements past the 32-wide (and 64-wide) blocks."""
    rng = np.random.default_rng(hd + n_rows)
    q, k, v = random_case(rng, n_rows, n_cells, n_head, n_head_kv, hd)
    assert_bitwise(n_rows, n_cells, q, k, v, scale=float(1 / np.sqrt(hd)))


@pytest.mark.parametrize("parallel", [False, True])
@pytest.mark.parametrize("n_rows,n_cells", [(1, 100), (1, 900), (6, 200), (80, 150)])
def test_serial_and_parallel_drivers(parallel: bool, n_rows: int, n_cells: int) -> None:
    """Each kernel on one thread and spread over Numba's threads: the same ggml bits."""
    q, k, v = random_case(np.random.default_rng(n_cells), n_rows, n_cells)
    assert_bitwise(n_rows, n_cells, q, k, v, parallel=parallel)


def test_no_mask_means_every_cell_visible() -> None:
    """mask=None attends over all T cells, as a zero mask does."""
    q, k, v = random_case(np.random.default_rng(9), 3, 120)
    zero = np.zeros((3, 120), np.float32)
    assert np.array_equal(
        flash_attn_f16(q, k, v, None, 0.125), flash_attn_f16(q, k, v, zero, 0.125)
    )


@pytest.mark.parametrize("n_rows", [1, 5, 70])
def test_cache_views_read_in_place(n_rows: int) -> None:
    """K/V given as [:, :T] views of a longer f32 cache (as kv_cache returns them) and as
    float16 copies give the same bits, on each kernel (the views are read without a copy)."""
    q, k, v = random_case(np.random.default_rng(n_rows), n_rows, 600)
    k_cache = np.zeros((3, 2048, 64), np.float32)
    v_cache = np.zeros((3, 2048, 64), np.float32)
    k_cache[:, :600], v_cache[:, :600] = k, v
    mask = attention_mask(np.arange(600 - n_rows, 600), np.arange(600))
    from_views = flash_attn_f16(q, k_cache[:, :600], v_cache[:, :600], mask, 0.125, n_kv=768)
    from_copies = flash_attn_f16(q, k, v, mask, 0.125, n_kv=768)
    assert np.array_equal(from_views.view(np.uint32), from_copies.view(np.uint32))


def test_bad_shapes_are_refused() -> None:
    q, k, v = random_case(np.random.default_rng(0), 2, 10)
    with pytest.raises(ValueError, match="mask"):
        flash_attn_f16(q, k, v, np.zeros((2, 9), np.float32), 0.125)
    with pytest.raises(ValueError, match="do not fit"):
        flash_attn_f16(q, k[:, :, :32], v, None, 0.125)
    with pytest.raises(ValueError, match="n_kv"):
        flash_attn_f16(q, k, v, None, 0.125, n_kv=5)


def test_kv_length_pads_as_llama_cpp() -> None:
    assert [kv_length(n, 2048) for n in (1, 256, 257, 2000)] == [256, 256, 512, 2048]
    assert kv_length(100, 200) == 200  # never past the cache


# --- the q8_0 cache ---------------------------------------------------------------------------

Q8_BLOCK = np.dtype([("d", "<f2"), ("qs", "i1", 32)])  # block_q8_0: f16 scale, 32 int8


def ggml_q8_0(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x f32 [..., hd] through ggml's own quantize_row_q8_0: int8 [..., hd], f16 [..., hd/32]."""
    raw = ggml_oracle.quantize_rows(x.reshape(-1, x.shape[-1]), 8)  # GGML_TYPE_Q8_0
    blocks = raw.view(Q8_BLOCK).reshape(*x.shape[:-1], -1)
    return np.ascontiguousarray(blocks["qs"]).reshape(x.shape), np.ascontiguousarray(blocks["d"])


def q8_0_bytes(qs: np.ndarray, d: np.ndarray) -> bytes:
    blocks = np.zeros(d.shape, Q8_BLOCK)
    blocks["d"], blocks["qs"] = d, qs.reshape(*d.shape, 32)
    return blocks.tobytes()


@pytest.mark.parametrize(
    "n_rows,n_cells", [(1, 1), (1, 200), (1, 700), (9, 300), (100, 300), (300, 300)]
)
@pytest.mark.parametrize("n_head,n_head_kv,hd", [(9, 3, 64), (4, 4, 128)])
def test_q8_0_cache(n_rows: int, n_cells: int, n_head: int, n_head_kv: int, hd: int) -> None:
    """q8_0 K/V: ggml's one-row kernel for every batch (q8_0 dot, f32 accumulator)."""
    rng = np.random.default_rng(n_rows * 7 + n_cells + hd)
    q = rng.normal(0, 2.5, (n_rows, n_head, hd)).astype(np.float32)
    (kq, kd), (vq, vd) = (
        ggml_q8_0(rng.normal(0, s, (n_head_kv, n_cells, hd)).astype(np.float32)) for s in (2.0, 0.7)
    )
    mask = attention_mask(np.arange(n_cells - n_rows, n_cells), np.arange(n_cells))
    n_kv = kv_length(n_cells, CACHE_CELLS)
    pad = n_kv - n_cells

    def padded(a: np.ndarray) -> np.ndarray:
        return np.concatenate([a, np.zeros((a.shape[0], pad) + a.shape[2:], a.dtype)], axis=1)

    mp = np.full((n_rows, n_kv), -np.inf, np.float16)
    mp[:, :n_cells] = mask
    want = ggml_oracle.run(
        "flash_attn_ext",
        [
            ggml_oracle._array_input(np.ascontiguousarray(q.transpose(1, 0, 2))),
            ggml_oracle._input(8, (hd, n_kv, n_head_kv), q8_0_bytes(padded(kq), padded(kd))),
            ggml_oracle._input(8, (hd, n_kv, n_head_kv), q8_0_bytes(padded(vq), padded(vd))),
            ggml_oracle._array_input(mp),
        ],
        fp=[float(1 / np.sqrt(hd)), 0.0, 0.0],
    ).reshape(q.shape)
    got = flash_attn_q8_0(q, kq, kd, vq, vd, mask, float(1 / np.sqrt(hd)), parallel=n_rows > 50)
    differ = int(np.sum(got.view(np.uint32) != want.view(np.uint32)))
    print(f"q8_0 rows={n_rows} T={n_cells} heads={n_head}/{n_head_kv} hd={hd}: {differ} differ")
    assert differ == 0


# --- Q/K/V of the default model --------------------------------------------------------------


@pytest.fixture(scope="module")
def engine_calls(default_model: Path) -> dict[str, object]:
    """The engine's own flash_attn_f16 calls on the default model (layers 0, 15 and 29).

    A 300-token prompt (the tiled kernel), then one decoded token over 301 cells (the split).
    Recorded by wrapping this module's function, which the forward pass calls on the CPU.
    """
    from bankml.engine_cupy.kernels import exact_attention
    from bankml.engine_cupy.model import Model

    engine = Model.load(default_model, device="cpu", progress=False)
    # the fused decode step (exact_decode) calls the same one-row kernel from compiled code;
    # the general path's call is recorded here (test_decode_fast_path: the two give one result)
    engine.fused_decode = False
    calls: list[tuple] = []
    original = exact_attention.flash_attn_f16

    def recording(q, k, v, mask, scale, n_kv=None, n_threads=2, parallel=None):
        calls.append(
            (
                np.array(q),
                np.array(k),
                np.array(v),
                None if mask is None else np.array(mask),
                float(scale),
                n_kv,
                n_threads,
            )
        )
        return original(q, k, v, mask, scale, n_kv=n_kv, n_threads=n_threads, parallel=parallel)

    exact_attention.flash_attn_f16 = recording
    try:
        ids = [int(t) for t in np.random.default_rng(7).integers(100, engine.n_vocab - 100, 300)]
        cache = engine.new_cache(CACHE_CELLS, "f16")
        logits = engine.forward(ids, cache)
        engine.forward([int(np.argmax(logits))], cache)
    finally:
        exact_attention.flash_attn_f16 = original
    n_layer = engine.hp.n_layer
    assert len(calls) == 2 * n_layer, "the CPU forward pass no longer calls flash_attn_f16"
    layers = (0, n_layer // 2, n_layer - 1)
    return {
        "prefill": [calls[il] for il in layers],
        "decode": [calls[n_layer + il] for il in layers],
    }


def replay(call: tuple) -> None:
    q, k, v, mask, scale, n_kv, threads = call
    n_rows, n_cells = q.shape[0], k.shape[1]
    if mask is None:
        mask = np.zeros((n_rows, n_cells), np.float32)
    n_kv = n_cells if n_kv is None else n_kv
    got = flash_attn_f16(q, k, v, mask, scale, n_kv=n_kv, n_threads=threads)
    want = ggml_reference(q, k.astype(np.float16), v.astype(np.float16), mask, scale, n_kv, threads)
    differ = int(np.sum(got.view(np.uint32) != want.view(np.uint32)))
    print(f"engine call rows={n_rows} T={n_cells} n_kv={n_kv}: {differ} of {got.size} differ")
    assert differ == 0


@pytest.mark.parametrize("kind", ["prefill", "decode"])
def test_engine_calls_on_the_default_model(engine_calls: dict, kind: str) -> None:
    """The forward pass's calls, replayed on ggml (SmolLM2: 9 heads on 3 KV heads of 64)."""
    for call in engine_calls[kind]:
        replay(call)


@pytest.mark.parametrize("n_rows,n_cells", [(1, 20), (1, 300), (40, 300), (100, 100), (64, 200)])
def test_default_model_attention(engine_calls: dict, n_rows: int, n_cells: int) -> None:
    """Real Q/K/V on every kernel: the prompt's queries n_cells - n_rows .. n_cells - 1."""
    for q, k, v, _, scale, _, _ in engine_calls["prefill"]:
        assert_bitwise(
            n_rows,
            n_cells,
            q[n_cells - n_rows : n_cells],
            k[:, :n_cells].astype(np.float16),
            v[:, :n_cells].astype(np.float16),
            scale=scale,
        )


# --- the scalar pieces ------------------------------------------------------------------------


def test_f16_rounding_equals_numpy() -> None:
    """jit.f16_round (the kernels' f32->f16->f32) equals NumPy's conversion on spread bit patterns,
    ties, subnormals and overflow included."""
    from bankml.engine_cupy.kernels.jit import f16_bits, f16_round, njit

    @njit(cache=False)
    def both(x, a, b):
        for i in range(x.shape[0]):
            a[i] = f16_round(x[i])
            b[i] = f16_bits(x[i])

    x = np.arange(0, 2**32, 4099, dtype=np.uint64).astype(np.uint32).view(np.float32)
    a, b = np.empty_like(x), np.empty(x.shape, np.int64)
    both(x, a, b)
    with np.errstate(over="ignore", invalid="ignore"):
        half = x.astype(np.float16)
    want = half.astype(np.float32)
    numbers = ~np.isnan(want)
    assert np.array_equal(a.view(np.uint32)[numbers], want.view(np.uint32)[numbers])
    assert np.array_equal(b[numbers], half.view(np.uint16)[numbers].astype(np.int64))
    assert np.isnan(a[~numbers]).all()


def test_numba_exp_is_libm_expf() -> None:
    """ggml's scalar expf is glibc's; Numba's float32 math.exp must call the same function."""
    import ctypes
    import ctypes.util
    import math

    from bankml.engine_cupy.kernels.jit import njit

    libm = ctypes.CDLL(ctypes.util.find_library("m"))
    libm.expf.restype, libm.expf.argtypes = ctypes.c_float, [ctypes.c_float]

    @njit(cache=False)
    def exps(x, out):
        for i in range(x.shape[0]):
            out[i] = math.exp(x[i])

    x = -np.abs(np.random.default_rng(1).normal(0, 12, 20000)).astype(np.float32)
    got = np.empty_like(x)
    exps(x, got)
    want = np.array([libm.expf(float(t)) for t in x], np.float32)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def test_warm_up_compiles_what_the_engine_calls() -> None:
    """After warm_up, each driver has the one compiled signature an engine-shaped call uses."""
    from bankml.engine_cupy.kernels import exact_attention as ea

    ea.warm_up(q8_0=True)
    drivers = [
        ea._one_chunk_serial,
        ea._one_chunk_parallel,
        ea._split_serial,
        ea._split_parallel,
        ea._tiled_serial,
        ea._tiled_parallel,
        ea._q8_0_serial,
        ea._q8_0_parallel,
        ea._pack_k_tiles,
        ea._reduce_all,
    ]
    before = [len(d.signatures) for d in drivers]
    assert all(n >= 1 for n in before)
    cache = np.zeros((3, 2048, 64), np.float32)
    for n_rows in (1, 5, 70):
        q = np.ones((n_rows, 9, 64), np.float32)
        mask = attention_mask(np.arange(700 - n_rows, 700), np.arange(700))
        for parallel in (False, True):
            flash_attn_f16(
                q,
                cache[:, :700],
                cache[:, :700],
                mask if n_rows > 1 else None,
                0.125,
                n_kv=768,
                parallel=parallel,
            )
    assert [len(d.signatures) for d in drivers] == before
