"""exact_matmul against ggml's own CPU mul_mat and from_float (tests/ggml_oracle.py), bit for bit.

Each product test also counts how many outputs the previous f32 path gets wrong on the same data
(the activation rounded by weights.quantize_activation, times the dequantized matrix, in NumPy)
and asserts that it does miss some, so a pass is not a pass by luck of the data. ``pytest -s``
prints both figures.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import quants

from bankml.engine_cupy import weights
from bankml.engine_cupy.gguf_file import GGUFFile
from bankml.engine_cupy.kernels import exact_matmul as em
from tests import ggml_oracle as go
from tests.engine_checks import activations, differing

F32 = np.float32
TYPES = (T.Q4_1, T.Q8_0, T.Q4_0, T.Q5_0, T.Q5_1)
ROWS = (1, 3, 17, 64, 512)


def naive_product(raw: np.ndarray, qtype: T, n_out: int, n_in: int, x: np.ndarray) -> np.ndarray:
    """The f32 path the engine used before: rounded activation @ dequantized weights."""
    w = weights.dequantize(raw, qtype).reshape(n_out, n_in)
    return weights.quantize_activation(np, x, weights.VEC_DOT_KIND[qtype]) @ w.T


def check_product(
    name: str, raw: np.ndarray, qtype: T, n_out: int, n_in: int, x: np.ndarray
) -> int:
    ggml = go.mul_mat(raw, qtype, n_out, n_in, x)
    ours = em.QuantMatrix(raw, qtype, n_out, n_in).matmul(x)
    mine, naive = differing(ours, ggml), differing(naive_product(raw, qtype, n_out, n_in, x), ggml)
    print(f"\n{name}: exact_matmul differs in {mine}, the f32 path in {naive} of {ggml.size}")
    assert mine == 0
    return naive


# --- activation rounding --------------------------------------------------------------------------


@pytest.mark.parametrize("qtype, ours", [(T.Q8_0, em.quantize_q8_0), (T.Q8_1, em.quantize_q8_1)])
def test_activation_blocks_match_ggml_from_float(qtype: T, ours) -> None:
    rng = np.random.default_rng(1)
    x = activations(rng, 40, 256)
    x[0, :32] = 0  # an all-zero block: d = 0, quants 0
    x[1] = rng.standard_normal(256).astype(F32) * F32(1e-6)  # d below f16's normal range
    x[2, :32] = np.arange(32, dtype=F32) - F32(15.5)  # many .5 products: ties to even
    x[3, :32] = F32(-3.0)  # one value: quants all -127
    x[4, 5] = F32(np.inf)  # inf: NaN quants saturate as ggml's packs
    assert np.array_equal(ours(x), go.quantize_rows(x, qtype))


def test_f16_rounding_matches_numpy_over_all_exponents() -> None:
    rng = np.random.default_rng(2)
    bits = rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32)
    values = bits.view(F32)
    values = values[~np.isnan(values)]
    ours = np.array([em.f32_to_f16_bits(v) for v in values[:20_000]], np.uint16)
    near = (rng.standard_normal(20_000) * 1e-5).astype(F32)  # the subnormal-f16 range
    ours_near = np.array([em.f32_to_f16_bits(v) for v in near], np.uint16)
    with np.errstate(over="ignore"):
        assert np.array_equal(ours, values[:20_000].astype(np.float16).view(np.uint16))
        assert np.array_equal(ours_near, near.astype(np.float16).view(np.uint16))


# --- products on random weights ----------------------------------------------------------------


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_random_weights_match_ggml_mul_mat(qtype: T) -> None:
    rng = np.random.default_rng(3)
    n_out, n_in = 72, 320
    w = (rng.standard_normal((n_out, n_in)) * 0.05).astype(F32)
    raw = quants.quantize(w, qtype)
    naive_misses = 0
    for m in ROWS:
        naive_misses += check_product(
            f"{qtype.name} [{m}, {n_in}] x [{n_out}, {n_in}]",
            raw,
            qtype,
            n_out,
            n_in,
            activations(rng, m, n_in),
        )
    assert naive_misses > 0


def test_edge_shapes_match_ggml() -> None:
    """Row counts that leave partial tiles (4x1, 2x2) and tinyBLAS tails on both sides; 15
    activation rows take every batch tile in turn (1x8, 1x4, 2x2, 4x1), 31 the 16-row lane
    tile first."""
    rng = np.random.default_rng(12)
    for qtype in TYPES + (T.BF16, T.F16, T.F32):
        for n_out in (1, 5, 9):
            w = rng.standard_normal((n_out, 64)).astype(F32)
            raw = (
                quants.quantize(w, qtype)
                if qtype not in (T.F16, T.F32)
                else (w.astype(np.float16) if qtype == T.F16 else w).view(np.uint8)
            )
            for m in (1, 3, 5, 15, 31):
                x = activations(rng, m, 64)
                ours = em.QuantMatrix(raw, qtype, n_out, 64).matmul(x)
                assert differing(ours, go.mul_mat(raw, qtype, n_out, 64, x)) == 0, (
                    qtype.name,
                    n_out,
                    m,
                )
    empty = em.QuantMatrix(raw, T.F32, 9, 64).matmul(np.zeros((0, 64), F32))
    assert empty.shape == (0, 9)


# bytes of each block's quants (after d, and m / qh) for the extreme-value test
_QUANT_BYTES = {T.Q4_0: (2, 18), T.Q4_1: (4, 20), T.Q5_0: (6, 22), T.Q5_1: (8, 24), T.Q8_0: (2, 34)}


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_extreme_quants_match_ggml(qtype: T) -> None:
    """Every weight quant at an end of its range (Q8_0's bytes -128 and 127, nibbles 0 and 15,
    fifth bits all set or clear) against activations that round to +-127: the largest integer
    lanes the one-row tiles and the lane tiles (vpdpbusd on a VNNI host: the activation + 128
    against the signed weight, less 128 times the weights' sum) can meet, at m = 1, 16, 17."""
    rng = np.random.default_rng(13)
    n_out, n_in = 40, 256
    raw = quants.quantize((rng.standard_normal((n_out, n_in)) * 0.05).astype(F32), qtype)
    blocks = raw.reshape(n_out * n_in // 32, -1)
    start, end = _QUANT_BYTES[qtype]
    ends = [0x80, 0x7F, 0x81] if qtype == T.Q8_0 else [0x00, 0xFF, 0x0F, 0xF0]
    blocks[:, start:end] = rng.choice(np.array(ends, np.uint8), (blocks.shape[0], end - start))
    if qtype in (T.Q5_0, T.Q5_1):  # qh: all set, all clear, or random
        qh = rng.choice(np.array([0x00, 0xFF], np.uint8), (blocks.shape[0], 1))
        blocks[:, start - 4 : start] = np.where(
            rng.random((blocks.shape[0], 1)) < 0.2,
            rng.integers(0, 256, (blocks.shape[0], 4), dtype=np.uint8),
            qh,
        )
    for m in (1, 16, 17):
        x = rng.choice(np.array([-1.0, 1.0], F32), (m, n_in))  # quants +-127
        check_product(f"{qtype.name} extremes, m = {m}", raw, qtype, n_out, n_in, x)


def test_parallel_and_serial_kernels_agree_with_ggml() -> None:
    """A product big enough for the threaded kernel, with a row count that leaves a short task."""
    rng = np.random.default_rng(4)
    n_out, n_in = 1000, 512
    raw = quants.quantize((rng.standard_normal((n_out, n_in)) * 0.05).astype(F32), T.Q4_1)
    x = activations(rng, 2, n_in)
    assert 2 * n_out * n_in >= em.PARALLEL_MIN_MACS
    check_product("Q4_1 [2, 512] x [1000, 512] (threaded)", raw, T.Q4_1, n_out, n_in, x)


@pytest.mark.parametrize("qtype", (T.F16, T.F32), ids=lambda t: t.name)
def test_float_weights_match_ggml_on_both_paths(qtype: T) -> None:
    """n_out = 64: tinyBLAS from two activation rows on; n_out = 70 (not a multiple of 4): vec_dot."""
    rng = np.random.default_rng(9)
    wrong_path_misses = 0
    for n_out in (64, 70):
        w = (rng.standard_normal((n_out, 256)) * 0.05).astype(F32)
        raw = (w.astype(np.float16) if qtype == T.F16 else w).view(np.uint8)
        for m in (1, 2, 17):
            x = activations(rng, m, 256)
            check_product(f"{qtype.name} [{m}, 256] x [{n_out}, 256]", raw, qtype, n_out, 256, x)
            # the other accumulation order (vec_dot's four accumulators vs tinyBLAS's one) must miss
            matrix = em.QuantMatrix(raw, qtype, n_out, 256)
            xr = x.astype(np.float16).astype(F32) if qtype == T.F16 else x
            other = np.empty((m, n_out), F32)
            split = m == 1 or n_out % 4 != 0
            em._float_product(
                matrix._codes, matrix._kind, False, not split, matrix.raw, 256, n_out, xr, other
            )
            wrong_path_misses += differing(other, go.mul_mat(raw, qtype, n_out, 256, x))
    print(f"\n{qtype.name}: the other path's order misses {wrong_path_misses}")
    assert wrong_path_misses > 0


# --- BF16 weights --------------------------------------------------------------------------------


def test_bf16_rounding_matches_ggml_from_float() -> None:
    """ggml_cpu_fp32_to_bf16 on random bit patterns: every exponent, infinities, NaNs (quieted)."""
    rng = np.random.default_rng(13)
    x = (
        rng.integers(0, 2**32, 40_000, dtype=np.uint64)
        .astype(np.uint32)
        .view(F32)
        .reshape(40, 1000)
    )
    x[0, :4] = [np.inf, -np.inf, F32(3.4e38), F32(-0.0)]  # 3.4e38 rounds up to inf
    assert np.isnan(x).sum() > 50
    ggml = go.quantize_rows(x, T.BF16).view(np.uint16)
    assert np.array_equal((em.bf16_round(x).view(np.uint32) >> 16).astype(np.uint16), ggml)


def bf16_weights(rng: np.random.Generator, n_out: int, n_in: int) -> np.ndarray:
    """GGUF BF16 bytes [n_out, 2*n_in] of random weights (gguf's ggml_compute_fp32_to_bf16)."""
    return quants.quantize((rng.standard_normal((n_out, n_in)) * 0.05).astype(F32), T.BF16)


@pytest.mark.parametrize("n_out, n_in", [(64, 256), (70, 256), (64, 75), (6, 40)])
def test_bf16_weights_match_ggml_on_both_paths(n_out: int, n_in: int) -> None:
    """vec_dot_bf16 (one row, or n_out not a multiple of 4) and tinyBLAS (two rows or more with
    n_out % 4 == 0); n_in = 75 and 40 leave tails (vec_dot's double sum, tinyBLAS's partial step).
    The other path's order and the f32 product must both miss, so agreement is not luck."""
    rng = np.random.default_rng(14)
    raw = bf16_weights(rng, n_out, n_in)
    matrix = em.QuantMatrix(raw, T.BF16, n_out, n_in)
    naive_misses = wrong_path_misses = 0
    for m in (1, 2, 3, 4, 5, 8, 17, 64):
        x = activations(rng, m, n_in)
        naive_misses += check_product(
            f"BF16 [{m}, {n_in}] x [{n_out}, {n_in}]", raw, T.BF16, n_out, n_in, x
        )
        other = np.empty((m, n_out), F32)
        split = m == 1 or n_out % 4 != 0
        em._float_product(
            matrix._codes,
            matrix._kind,
            False,
            not split,
            matrix.raw,
            n_in,
            n_out,
            em.bf16_round(x),
            other,
        )
        wrong_path_misses += differing(other, go.mul_mat(raw, T.BF16, n_out, n_in, x))
    print(f"\nBF16 [{n_out}, {n_in}]: the other path's order misses {wrong_path_misses}")
    assert naive_misses > 0 and wrong_path_misses > 0


def test_bf16_special_values_match_ggml() -> None:
    """inf and NaN weights, products below f32's normal range (where a separate multiply would
    round before the add: ggml's vfmadd does not), -0 activations, and a tail."""
    rng = np.random.default_rng(15)
    n_out, n_in = 8, 72
    w = (rng.standard_normal((n_out, n_in)) * 0.05).astype(F32)
    w[0, 3], w[2, 5], w[3] = np.inf, np.nan, F32(-0.0)
    w[1] = rng.standard_normal(n_in).astype(F32) * F32(1e-30)
    raw = quants.quantize(w, T.BF16)
    for m in (1, 2):
        x = activations(rng, m, n_in)
        x[:, 7], x[:, 70] = F32(1e-12), F32(-1e-13)
        x[0, 0] = F32(-0.0)
        assert (
            differing(
                em.QuantMatrix(raw, T.BF16, n_out, n_in).matmul(x),
                go.mul_mat(raw, T.BF16, n_out, n_in, x),
            )
            == 0
        )


def test_bf16_threaded_products_match_ggml() -> None:
    """Big enough for the parallel kernels, on both paths, with a short last task."""
    rng = np.random.default_rng(16)
    n_out, n_in = 1000, 520
    raw = bf16_weights(rng, n_out, n_in)
    for m in (1, 2):
        assert m * n_out * n_in >= em.PARALLEL_MIN_MACS
        check_product(
            f"BF16 [{m}, {n_in}] x [{n_out}, {n_in}] (threaded)",
            raw,
            T.BF16,
            n_out,
            n_in,
            activations(rng, m, n_in),
        )


def test_bf16_token_embedding_rows_and_routing_match_ggml() -> None:
    """A BF16 token embedding: the loader's rows are ggml's get_rows (the exact widening), and
    BF16 matrices go to exact_matmul."""
    rng = np.random.default_rng(17)
    raw = bf16_weights(rng, 300, 40)
    info = SimpleNamespace(data=raw, tensor_type=T.BF16, shape=(40, 300))
    ids = np.array([0, 299, 17, 17, 123])
    rows = weights.EmbeddingRows(info)[ids]
    assert differing(rows, go.get_rows(raw, T.BF16, 300, 40, ids)) == 0
    assert weights.exact_family(T.BF16) is em


# --- products on the default model's matrices --------------------------------------------------


@pytest.fixture(scope="module")
def default_tensors(default_model: Path) -> dict[str, object]:
    reader = GGUFFile(default_model)
    return {t.name: t for t in reader.tensors}


@pytest.mark.parametrize(
    "name",
    [
        "blk.0.attn_q.weight",
        "blk.7.attn_k.weight",
        "blk.29.ffn_down.weight",
        "blk.13.ffn_gate.weight",
    ],
)
def test_default_model_layer_matrices_match_ggml(default_tensors: dict, name: str) -> None:
    tensor = default_tensors[name]
    n_in, n_out = int(tensor.shape[0]), int(tensor.shape[1])
    rng = np.random.default_rng(5)
    for m in (1, 17):
        check_product(
            f"{name} {tensor.tensor_type.name} m={m}",
            tensor.data,
            tensor.tensor_type,
            n_out,
            n_in,
            activations(rng, m, n_in),
        )


def test_default_model_output_matrix_matches_ggml(default_tensors: dict) -> None:
    """The tied output (token_embd, Q8_0 [49152, 576]): vec_dot for one row, tinyBLAS for two."""
    tensor = default_tensors["token_embd.weight"]
    assert tensor.tensor_type == T.Q8_0
    rng = np.random.default_rng(6)
    for m in (1, 2):
        check_product(
            f"token_embd m={m}", tensor.data, T.Q8_0, 49152, 576, activations(rng, m, 576)
        )


# --- API ---------------------------------------------------------------------------------------


def test_concat_is_the_products_side_by_side() -> None:
    rng = np.random.default_rng(7)
    parts = [
        em.QuantMatrix(
            quants.quantize(rng.standard_normal((n, 64)).astype(F32), T.Q4_1), T.Q4_1, n, 64
        )
        for n in (32, 8, 8)
    ]
    x = activations(rng, 3, 64)
    together = em.QuantMatrix.concat(parts).matmul(x)
    assert np.array_equal(together, np.concatenate([p.matmul(x) for p in parts], axis=1))
    act = parts[0].quantize(x)  # one rounding reused for several matrices
    assert np.array_equal(parts[1].matmul(act), parts[1].matmul(x))
    # mixed types (a Q4_0 file with a Q8_0 attn_v, an F16 part): a stack, same products
    mixed = [
        parts[0],
        em.QuantMatrix(
            quants.quantize(rng.standard_normal((8, 64)).astype(F32), T.Q8_0), T.Q8_0, 8, 64
        ),
        em.QuantMatrix(
            rng.standard_normal((8, 64)).astype(np.float16).view(np.uint8), T.F16, 8, 64
        ),
        em.QuantMatrix(
            quants.quantize(rng.standard_normal((8, 64)).astype(F32), T.Q4_0),
            T.Q4_0,
            8,
            64,
            repacked=True,
        ),
    ]
    stack = em.QuantMatrix.concat(mixed)
    assert isinstance(stack, em.MatrixStack) and stack.n_out == 56
    assert np.array_equal(stack.matmul(x), np.concatenate([p.matmul(x) for p in mixed], axis=1))
    with pytest.raises(ValueError, match="input width"):
        em.QuantMatrix.concat(
            [parts[0], em.QuantMatrix(np.zeros(20 * 8 * 4, np.uint8), T.Q4_1, 8, 128)]
        )


def test_zero_copy_on_gguf_tensor_data(default_tensors: dict) -> None:
    tensor = default_tensors["blk.0.attn_v.weight"]
    matrix = em.QuantMatrix(
        tensor.data, tensor.tensor_type, int(tensor.shape[1]), int(tensor.shape[0])
    )
    assert np.shares_memory(matrix.raw, tensor.data)


def test_refusals_say_why() -> None:
    assert em.supported(T.Q4_1) and em.supported(T.Q8_0)
    assert em.supported(T.F16) and em.supported(T.F32)
    assert em.supported(T.BF16)
    assert not em.supported(T.Q6_K) and not em.supported(999)
    raw = np.zeros(20 * 2 * 4, np.uint8)
    with pytest.raises(ValueError, match="no exact kernel for Q6_K"):
        em.QuantMatrix(raw, T.Q6_K, 4, 64)
    with pytest.raises(ValueError, match="needs 200 bytes"):
        em.QuantMatrix(raw, T.Q4_1, 5, 64)
    with pytest.raises(ValueError, match="multiple of 32"):
        em.QuantMatrix(raw, T.Q4_1, 4, 48)
    assert (
        em.QuantMatrix(np.zeros(2 * 4 * 7, np.uint8), T.BF16, 4, 7).n_in == 7
    )  # bf16 rows: any length
    with pytest.raises(ValueError, match="BF16 \\[4, 7\\] needs 56 bytes, got 50"):
        em.QuantMatrix(np.zeros(50, np.uint8), T.BF16, 4, 7)
    matrix = em.QuantMatrix(raw, T.Q4_1, 4, 64)
    with pytest.raises(ValueError, match="activation width 32"):
        matrix.matmul(np.zeros((1, 32), F32))


# --- llama-server's repacked Q4_0 ----------------------------------------------------------------


def test_repack_rule_follows_llama_server() -> None:
    assert em.repacked_by_llama_server(T.Q4_0, 576)
    assert not em.repacked_by_llama_server(T.Q4_0, 572)  # rows not a multiple of 8
    assert not em.repacked_by_llama_server(T.Q4_0, 49152, token_embd=True)
    assert not em.repacked_by_llama_server(T.Q4_1, 576)
    with pytest.raises(ValueError, match="does not repack Q8_0"):
        em.QuantMatrix(np.zeros(34 * 8, np.uint8), T.Q8_0, 8, 32, repacked=True)


def test_repacked_q4_0_matches_ggml_cpu_repack_buffer() -> None:
    """ggml's q4_0_8x8 gemv/gemm (the weight in the CPU_REPACK buffer, as llama-server loads it)."""
    if not hasattr(go, "mul_mat_repacked"):
        pytest.skip(
            "tests/ggml_oracle.py has no mul_mat_repacked (weight in the CPU_REPACK buffer) yet"
        )
    rng = np.random.default_rng(8)
    n_out, n_in = 72, 320
    raw = quants.quantize((rng.standard_normal((n_out, n_in)) * 0.05).astype(F32), T.Q4_0)
    plain_misses = 0
    for m in (1, 3, 4, 17, 64):
        x = activations(rng, m, n_in)
        ggml = go.mul_mat_repacked(raw, T.Q4_0, n_out, n_in, x)
        ours = em.QuantMatrix(raw, T.Q4_0, n_out, n_in, repacked=True).matmul(x)
        plain = em.QuantMatrix(raw, T.Q4_0, n_out, n_in).matmul(x)
        mine, plain_diff = differing(ours, ggml), differing(plain, ggml)
        print(
            f"\nrepacked Q4_0 m={m}: exact_matmul differs in {mine}, the unrepacked kernel in {plain_diff} of {ggml.size}"
        )
        assert mine == 0
        plain_misses += plain_diff
    assert plain_misses > 0
