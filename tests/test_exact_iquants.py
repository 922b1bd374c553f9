"""exact_iquants against ggml's own CPU mul_mat and repacked mul_mat (tests/ggml_oracle.py).

Every product is compared bit for bit, on weights quantized by ggml itself (the oracle's
from_float). Each check also computes the same product in the other arithmetics ggml has for the
type (vec_dot, tinyBLAS, repacked, tiled) and in f32 from the dequantized operands, and asserts
that some of them miss outputs on the same data, so a pass shows that the right arithmetic was
picked. ``pytest -s`` prints the figures.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from bankml.engine_cupy import weights
from bankml.engine_cupy.gguf_file import GGUFFile
from bankml.engine_cupy.kernels import exact_iquants as ei
from bankml.engine_cupy.kernels import exact_kquants as ek
from bankml.engine_cupy.kernels import exact_matmul as em
from tests import ggml_oracle as go
from tests.engine_checks import activations, differing
from tests.engine_checks import random_blocks as kquant_blocks

F32 = np.float32
CODES = {
    T.IQ4_NL: {"vec_dot": ei._NL_VD, "tinyBLAS": ei._NL_TB, "repacked": ei._NL_RP},
    T.IQ4_XS: {"vec_dot": ei._XS_VD, "tiled": ei._XS_T},
}
ROWS = [1, 2, 3, 4, 5, 6, 7, 8, 9, 16, 17, 64]


def ggml_weights(rng: np.random.Generator, qtype: T, n_out: int, n_in: int) -> np.ndarray:
    """Gaussian rows (some rows 10x wider) quantized by ggml's quantize_row_iq4_nl/iq4_xs."""
    w = rng.standard_normal((n_out, n_in)).astype(F32) * rng.choice(
        np.array([0.02, 0.2], F32), (n_out, 1)
    )
    return go.quantize_rows(w, qtype)


def rounded(matrix: ei.IQuantMatrix, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    act = matrix.quantize(x)
    return act.q, act.d


def f32_product(matrix: ei.IQuantMatrix, x: np.ndarray) -> np.ndarray:
    """The same operands multiplied in f32 (dequantized weight, dequantized activation)."""
    w = weights.dequantize(matrix.raw, matrix.qtype).reshape(matrix.n_out, matrix.n_in)
    q, d = rounded(matrix, x)
    return (q.astype(F32) * np.repeat(d, q.shape[1] // d.shape[1], axis=1)) @ w.T


def other_arithmetics(matrix: ei.IQuantMatrix, x: np.ndarray, ggml: np.ndarray) -> dict[str, int]:
    """Differing outputs of every other arithmetic for this weight type on the same data."""
    used = matrix._code(x.shape[0])
    q, d = rounded(matrix, x)
    found = {}
    for name, code in CODES[matrix.qtype].items():
        if code != used:
            out = np.empty_like(ggml)
            ei._run(code, matrix.raw, q, d, out)
            found[name] = differing(out, ggml)
    found["f32"] = differing(f32_product(matrix, x), ggml)
    return found


def check(
    qtype: T, n_out: int, n_in: int, m: int, seed: int, repacked: bool = False
) -> dict[str, int]:
    """ggml's product against ours; returns the other arithmetics' differing outputs."""
    rng = np.random.default_rng(seed)
    raw, x = ggml_weights(rng, qtype, n_out, n_in), activations(rng, m, n_in)
    matrix = ei.IQuantMatrix(raw, qtype, n_out, n_in, repacked=repacked)
    ggml = (go.mul_mat_repacked if repacked else go.mul_mat)(raw, qtype, n_out, n_in, x)
    mine = differing(matrix.matmul(x), ggml)
    others = other_arithmetics(matrix, x, ggml)
    print(
        f"\n{qtype.name} [{n_out}, {n_in}]{' repacked' if repacked else ''} m={m}: exact_iquants differs in "
        f"{mine} of {ggml.size}; " + ", ".join(f"{k} {v}" for k, v in others.items())
    )
    assert mine == 0
    assert others["f32"] > 0
    return others


# --- IQ4_NL ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("m", ROWS)
def test_iq4_nl_repacked_matches_ggml_cpu_repack_buffer(m: int) -> None:
    """n_out % 8 == 0: iq4_nl_8x8 gemm for rows in fours, gemv for the others; 17 blocks per
    row (gemv/gemm have no pairing of blocks, vec_dot's odd tail is not theirs)."""
    others = check(T.IQ4_NL, 64, 544, m, seed=100 + m, repacked=True)
    assert others["vec_dot"] > 0 and others["tinyBLAS"] > 0


@pytest.mark.parametrize("m", ROWS)
def test_iq4_nl_unrepacked_matches_ggml(m: int) -> None:
    """36 rows (not a multiple of 8, like a narrow K/V or the token embedding): vec_dot (two
    accumulators and a scalar tail for the odd 17th block) for one row, tinyBLAS for more."""
    others = check(T.IQ4_NL, 36, 544, m, seed=200 + m)
    assert any(v > 0 for k, v in others.items() if k != "f32")


@pytest.mark.parametrize("n_in", [32, 64, 96, 1536])
def test_iq4_nl_vec_dot_block_counts(n_in: int) -> None:
    """One row, 1 to 48 blocks: the pair loop not entered, one pair, a pair and a tail, many."""
    check(T.IQ4_NL, 101, n_in, 1, seed=300 + n_in)
    check(T.IQ4_NL, 101, n_in, 3, seed=301 + n_in)


# --- IQ4_XS ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("m", ROWS)
def test_iq4_xs_matches_ggml(m: int) -> None:
    """Never repacked on x86: ggml_vec_dot_iq4_xs_q8_K below 8 rows, the tiled kernel from 8;
    100 rows (not a multiple of 8 or of the 16-row task)."""
    others = check(T.IQ4_XS, 100, 1024, m, seed=400 + m)
    assert any(v > 0 for k, v in others.items() if k != "f32")


def test_iq4_xs_row_counts_that_are_multiples_of_8() -> None:
    """A repackable-looking shape stays plain for IQ4_XS (ggml has no x86 layout for it)."""
    for m in (1, 9):
        check(T.IQ4_XS, 64, 256, m, seed=500 + m)


# --- real weights ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ffn_down_f32(default_model: Path) -> np.ndarray:
    """The default model's blk.0.ffn_down (Q4_1, [576, 1536]) as f32."""
    tensor = next(t for t in GGUFFile(default_model).tensors if t.name == "blk.0.ffn_down.weight")
    n_in, n_out = (int(v) for v in tensor.shape)
    return weights.dequantize(tensor.data, tensor.tensor_type).reshape(n_out, n_in)


@pytest.mark.parametrize("qtype", [T.IQ4_NL, T.IQ4_XS])
def test_default_model_ffn_down_requantized_by_ggml(ffn_down_f32: np.ndarray, qtype: T) -> None:
    """Real weights requantized by ggml (ggml_cpy) as llama-quantize would make them, multiplied
    as llama-server loads them (IQ4_NL: 576 rows, so repacked), for decode and a batch."""
    n_out, n_in = ffn_down_f32.shape
    raw = go.cpy(ffn_down_f32, qtype)
    repacked = ei.repacked_by_llama_server(qtype, n_out)
    assert repacked == (qtype == T.IQ4_NL)
    matrix = ei.IQuantMatrix(raw, qtype, n_out, n_in, repacked=repacked)
    x = activations(np.random.default_rng(60), 9, n_in)
    for m in (1, 9):
        ggml = (go.mul_mat_repacked if repacked else go.mul_mat)(raw, qtype, n_out, n_in, x[:m])
        naive, mine = (
            differing(f32_product(matrix, x[:m]), ggml),
            differing(matrix.matmul(x[:m]), ggml),
        )
        print(
            f"\nblk.0.ffn_down as {qtype.name}, m={m}: exact_iquants differs in {mine}, f32 in {naive} "
            f"of {ggml.size}"
        )
        assert mine == 0 and naive > 0


# --- layers: concatenation and stacks with the other exact modules --------------------------------


def test_concat_equals_separate_products() -> None:
    rng = np.random.default_rng(7)
    parts = [
        ei.IQuantMatrix(ggml_weights(rng, T.IQ4_NL, n, 256), T.IQ4_NL, n, 256, repacked=True)
        for n in (16, 8, 24)
    ]
    joined = ei.IQuantMatrix.concat(parts)
    assert isinstance(joined, ei.IQ4NLMatrix)
    assert (joined.n_out, joined.n_in, joined.qtype, joined.repacked) == (48, 256, T.IQ4_NL, True)
    x = activations(rng, 6, 256)
    assert differing(joined.matmul(x), np.concatenate([p.matmul(x) for p in parts], axis=1)) == 0


def test_q8_0_stack_of_iq4_nl_and_the_q4_0_family() -> None:
    """A layer's Q (IQ4_NL, repacked), K (IQ4_NL, 36 rows: plain) and V (Q8_0): one q8_0
    rounding (exact_matmul's MatrixStack), each part's own kernel, as ggml."""
    rng = np.random.default_rng(9)
    specs = [(T.IQ4_NL, 64, True), (T.IQ4_NL, 36, False), (T.Q8_0, 40, False), (T.Q4_0, 24, True)]
    raws = [ggml_weights(rng, q, n, 512) for q, n, _ in specs]
    parts = [
        (ei.IQuantMatrix if q == T.IQ4_NL else em.QuantMatrix)(raw, q, n, 512, repacked=rep)
        for raw, (q, n, rep) in zip(raws, specs)
    ]
    for first in (parts, parts[2:] + parts[:2]):  # whichever family comes first
        stack = type(first[0]).concat(first)
        assert isinstance(stack, em.MatrixStack) and stack.n_out == 164
    stack = ei.IQuantMatrix.concat(parts)
    for m in (1, 5):
        x = activations(rng, m, 512)
        want = np.concatenate(
            [
                (go.mul_mat_repacked if rep else go.mul_mat)(raw, q, n, 512, x)
                for raw, (q, n, rep) in zip(raws, specs)
            ],
            axis=1,
        )
        assert differing(stack.matmul(x), want) == 0


def test_q8_k_stack_of_iq4_xs_and_k_quants() -> None:
    """An IQ4_XS file's layer next to Q6_K and a repacked Q4_K (its 4-row packed rounding kept
    apart from IQ4_XS's plain one): exact_kquants' KMatrixStack."""
    rng = np.random.default_rng(11)
    specs = [(T.IQ4_XS, 40, False), (T.Q6_K, 24, False), (T.Q4_K, 16, True)]
    raws = [
        ggml_weights(rng, q, n, 512) if q == T.IQ4_XS else kquant_blocks(rng, q, n, 512)
        for q, n, _ in specs
    ]
    parts = [
        (ei.IQuantMatrix if q == T.IQ4_XS else ek.KQuantMatrix)(raw, q, n, 512, repacked=rep)
        for raw, (q, n, rep) in zip(raws, specs)
    ]
    stack = ei.IQuantMatrix.concat(parts)
    assert isinstance(stack, ek.KMatrixStack) and stack.n_out == 80
    for m in (1, 5, 9):
        x = activations(rng, m, 512)
        want = np.concatenate(
            [
                (go.mul_mat_repacked if rep else go.mul_mat)(raw, q, n, 512, x)
                for raw, (q, n, rep) in zip(raws, specs)
            ],
            axis=1,
        )
        assert differing(stack.matmul(x), want) == 0


# --- interface -------------------------------------------------------------------------------------


def test_shape_checks_and_errors() -> None:
    rng = np.random.default_rng(8)
    raw = ggml_weights(rng, T.IQ4_XS, 8, 256)
    matrix = ei.IQuantMatrix(raw, T.IQ4_XS, 8, 256)
    assert isinstance(matrix, ei.IQ4XSMatrix) and np.shares_memory(matrix.raw, raw)
    with pytest.raises(ValueError, match="needs"):
        ei.IQuantMatrix(raw[:4], T.IQ4_XS, 8, 256)
    with pytest.raises(ValueError, match="multiple of 256"):
        ei.IQuantMatrix(raw, T.IQ4_XS, 16, 128)
    with pytest.raises(ValueError, match="does not repack"):
        ei.IQuantMatrix(raw, T.IQ4_XS, 8, 256, repacked=True)
    with pytest.raises(ValueError, match="width"):
        matrix.matmul(np.zeros((1, 512), F32))
    with pytest.raises(ValueError, match="repacked"):
        matrix.matmul(ek.KActivation(np.ones((4, 256), F32), packed_rows=4))
    with pytest.raises(ValueError, match="no exact IQ"):
        ei.IQuantMatrix(raw, T.Q4_0, 8, 256)
    nl = ei.IQuantMatrix(ggml_weights(rng, T.IQ4_NL, 12, 64), T.IQ4_NL, 12, 64)
    with pytest.raises(ValueError, match="does not repack"):
        ei.IQuantMatrix(nl.raw, T.IQ4_NL, 12, 64, repacked=True)
    with pytest.raises(ValueError, match="multiple of 32"):
        ei.IQuantMatrix(nl.raw, T.IQ4_NL, 24, 32 + 16)
    assert nl.matmul(np.zeros((0, 64), F32)).shape == (0, 12)
    assert matrix.matmul(np.zeros((0, 256), F32)).shape == (0, 8)


def test_supported_and_repack_rule() -> None:
    assert ei.supported(T.IQ4_NL) and ei.supported(T.IQ4_XS)
    assert not ei.supported(T.Q4_0) and not ei.supported(T.MXFP4) and not ei.supported(9999)
    assert ei.repacked_by_llama_server(T.IQ4_NL, 576)
    assert not ei.repacked_by_llama_server(T.IQ4_NL, 100)
    assert not ei.repacked_by_llama_server(T.IQ4_NL, 576, token_embd=True)
    assert not ei.repacked_by_llama_server(T.IQ4_XS, 576)
    assert weights.exact_family(T.IQ4_NL) is ei and weights.exact_family(T.IQ4_XS) is ei
    assert weights.exact_family(T.MXFP4) is None


# --- the grid types (IQ1_*, IQ2_*, IQ3_*) and the ternary TQ1_0/TQ2_0 ------------------------------

GRID_TYPES = [T.IQ3_XXS, T.IQ3_S, T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ1_S, T.IQ1_M, T.TQ2_0, T.TQ1_0]
GRID_ROWS = [1, 2, 3, 8, 9, 17, 64]
TILED_TYPES = {q for q in GRID_TYPES if ei._GRID[q][5] is not None}


def grid_weights(rng: np.random.Generator, qtype: T, n_out: int, n_in: int) -> np.ndarray:
    """TQ rows quantized by ggml (quantize_row_tq1_0/tq2_0). The grid types have no from_float
    in ggml's CPU traits (their quantizers need ggml_quantize_init and, below 3 bits, an
    importance matrix), so their rows are random bytes, which are all valid blocks (every index
    is in its grid, every sign pattern allowed), with small positive f16 d as real weights have."""
    if qtype in (T.TQ1_0, T.TQ2_0):
        w = rng.standard_normal((n_out, n_in)).astype(F32) * rng.choice(
            np.array([0.02, 0.2], F32), (n_out, 1)
        )
        return go.quantize_rows(w, qtype)
    block_bytes = ei._GRID[qtype][0]
    blocks = rng.integers(0, 256, (n_out * n_in // 256, block_bytes), dtype=np.uint8)
    d = (rng.random(len(blocks)) * 0.01 + 1e-4).astype(np.float16).view(np.uint16)
    if qtype == T.IQ1_M:  # d is spread over the top nibbles of the four scale words
        words = blocks[:, 48:56].copy().view(np.uint16)
        for k in range(4):
            words[:, k] = (words[:, k] & 0x0FFF) | (((d >> (4 * k)) & 0xF) << 12)
        blocks[:, 48:56] = words.view(np.uint8)
    else:
        blocks[:, 0:2] = d.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(n_out, -1)


def grid_others(matrix: ei.IQGridMatrix, act: ek.KActivation, ggml: np.ndarray) -> dict[str, int]:
    """Differing outputs of ggml's other arithmetic for the type (vec_dot or tiled), of TQ's
    vec_dot with plain lanes (no bsums subtraction by lane), and of the f32 product."""
    used = matrix._code(act.q.shape[0])
    codes = {"vec_dot": ei._GRID[matrix.qtype][3]}
    if matrix.qtype in TILED_TYPES:
        codes["tiled"] = ei._GRID_T
    if matrix.qtype in (T.TQ1_0, T.TQ2_0):
        codes["plain lanes"] = ei._GRID_VD
    found = {}
    for name, code in codes.items():
        if code != used:
            out = np.empty_like(ggml)
            ei._grid_run(code, matrix, act.q, act.d, out)
            found[name] = differing(out, ggml)
    found["f32"] = differing(ek_f32(matrix, act), ggml)
    return found


def ek_f32(matrix: ei.IQGridMatrix, act: ek.KActivation) -> np.ndarray:
    w = weights.dequantize(matrix.raw, matrix.qtype).reshape(matrix.n_out, matrix.n_in)
    return (act.q.astype(F32) * np.repeat(act.d, 256, axis=1)) @ w.T


def check_grid(qtype: T, n_out: int, n_in: int, m: int, seed: int) -> dict[str, int]:
    rng = np.random.default_rng(seed)
    raw, x = grid_weights(rng, qtype, n_out, n_in), activations(rng, m, n_in)
    matrix = ei.IQuantMatrix(raw, qtype, n_out, n_in)
    assert isinstance(matrix, ei.IQGridMatrix)
    ggml = go.mul_mat(raw, qtype, n_out, n_in, x)
    act = matrix.quantize(x)
    mine = differing(matrix.matmul(act), ggml)
    others = grid_others(matrix, act, ggml)
    print(
        f"\n{qtype.name} [{n_out}, {n_in}] m={m}: exact_iquants differs in {mine} of {ggml.size}; "
        + ", ".join(f"{k} {v}" for k, v in others.items())
    )
    assert mine == 0
    assert others["f32"] > 0
    return others


@pytest.mark.parametrize("qtype", GRID_TYPES, ids=lambda q: q.name)
def test_grid_types_match_ggml(qtype: T) -> None:
    """vec_dot below 8 rows, the tiled kernel from 8 (TQ: vec_dot always); 37 rows (not a
    multiple of 8 or of the 16-row task), 3 super-blocks per row; m = 1, 2, 3, 8, 9, 17, 64.
    Over the row counts the other arithmetics miss outputs on the same data, so the right one
    was picked."""
    misses: dict[str, int] = {}
    for m in GRID_ROWS:
        for name, count in check_grid(qtype, 37, 768, m, seed=600 + m).items():
            misses[name] = misses.get(name, 0) + count
    assert all(count > 0 for count in misses.values()), misses


@pytest.mark.parametrize("qtype", [T.IQ3_XXS, T.IQ2_S, T.IQ1_M, T.TQ1_0], ids=lambda q: q.name)
def test_grid_types_one_and_five_blocks(qtype: T) -> None:
    """One super-block per row (a tiny model's n_embd = 256) and five, one and nine rows."""
    for n_in in (256, 1280):
        for m in (1, 9):
            check_grid(qtype, 24, n_in, m, seed=700 + n_in + m)


@pytest.mark.parametrize("qtype", GRID_TYPES, ids=lambda q: q.name)
def test_decoded_weight_is_gguf_dequantization(qtype: T) -> None:
    """The kernels' decoded integers (value, IQ1 delta/8, 16-value scale, f16 d, the power of two
    vec_dot applies at the end) give back gguf-py's dequantization exactly: the bit layouts
    agree with gguf-py's (an independent reading of ggml's), for every row."""
    rng = np.random.default_rng(800)
    raw = grid_weights(rng, qtype, 6, 512)
    matrix = ei.IQuantMatrix(raw, qtype, 6, 512)
    rows = [matrix.decoded(r) for r in range(6)]
    w = np.stack([r[0] for r in rows]).astype(np.float64)
    delta = np.stack([r[1] for r in rows]) / 8.0
    power = {T.IQ2_XXS: 0.125, T.IQ2_XS: 0.125, T.IQ2_S: 0.125, T.IQ3_XXS: 0.25}.get(qtype, 1.0)
    mine = (
        (w + delta)
        * np.repeat(matrix.scales, 16, axis=1)
        * np.repeat(matrix.d, 256, axis=1)
        * power
    )
    want = weights.dequantize(raw, qtype).reshape(6, 512)
    assert np.array_equal(mine.astype(F32), want)
    assert np.abs(w).max() <= 62  # no pmaddubsw saturation in ggml, none in our int32 lanes
    assert (qtype in (T.IQ1_S, T.IQ1_M)) == bool(np.any(delta))


def test_q8_k_stack_of_grid_types_and_k_quants() -> None:
    """An IQ2_XXS/IQ3_S mix file's layer: its parts beside IQ4_XS and Q6_K in one KMatrixStack."""
    rng = np.random.default_rng(12)
    specs = [(T.IQ2_XXS, 40), (T.IQ3_S, 24), (T.IQ4_XS, 16), (T.Q6_K, 8)]
    raws = [
        grid_weights(rng, q, n, 512)
        if q in ei._GRID
        else ggml_weights(rng, q, n, 512)
        if q == T.IQ4_XS
        else kquant_blocks(rng, q, n, 512)
        for q, n in specs
    ]
    parts = [
        (ei.IQuantMatrix if q != T.Q6_K else ek.KQuantMatrix)(raw, q, n, 512)
        for raw, (q, n) in zip(raws, specs)
    ]
    stack = ei.IQuantMatrix.concat(parts)
    assert isinstance(stack, ek.KMatrixStack) and stack.n_out == 88
    same = ei.IQuantMatrix.concat(parts[:1] * 2)
    assert isinstance(same, ei.IQGridMatrix) and same.n_out == 80
    for m in (1, 9):
        x = activations(rng, m, 512)
        want = np.concatenate(
            [go.mul_mat(raw, q, n, 512, x) for raw, (q, n) in zip(raws, specs)], axis=1
        )
        assert differing(stack.matmul(x), want) == 0
        assert differing(same.matmul(x), np.concatenate([parts[0].matmul(x)] * 2, axis=1)) == 0


def test_grid_shape_checks() -> None:
    rng = np.random.default_rng(13)
    raw = grid_weights(rng, T.IQ3_XXS, 8, 256)
    with pytest.raises(ValueError, match="needs"):
        ei.IQuantMatrix(raw[:4], T.IQ3_XXS, 8, 256)
    with pytest.raises(ValueError, match="does not repack"):
        ei.IQuantMatrix(raw, T.IQ3_XXS, 8, 256, repacked=True)
    matrix = ei.IQuantMatrix(raw, T.IQ3_XXS, 8, 256)
    with pytest.raises(ValueError, match="width"):
        matrix.matmul(np.zeros((1, 512), F32))
    with pytest.raises(ValueError, match="repacked"):
        matrix.matmul(ek.KActivation(np.ones((4, 256), F32), packed_rows=4))
    assert matrix.matmul(np.zeros((0, 256), F32)).shape == (0, 8)
    assert all(ei.supported(q) and not ei.repacked_by_llama_server(q, 576) for q in GRID_TYPES)
    assert all(weights.exact_family(q) is ei for q in GRID_TYPES)
