"""exact_kquants against ggml's own CPU mul_mat, repacked mul_mat and from_float (tests/ggml_oracle.py).

Every product is compared bit for bit. Each test also computes the same product in the other
arithmetics ggml has for these types (vec_dot, tiled, repacked gemv/gemm) and in f32 from the
dequantized operands, and asserts that they miss some outputs on the same data, so a pass shows
that the right arithmetic was picked, not that the data cannot tell them apart. ``pytest -s``
prints the figures.
"""

from __future__ import annotations

from pathlib import Path

import numba
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from bankml.engine_cupy import weights
from bankml.engine_cupy.gguf_file import GGUFFile
from bankml.engine_cupy.kernels import exact_kquants as ek
from tests import ggml_oracle as go
from tests.engine_checks import activations, differing, random_blocks

F32 = np.float32
# every arithmetic ggml has for a weight type
CODES = {
    T.Q6_K: {"vec_dot": ek._VD6, "tiled": ek._T6},
    T.Q5_K: {"vec_dot": ek._VD5, "tiled": ek._T5},
    T.Q4_K: {
        "vec_dot": ek._VD4,
        "tiled": ek._T4,
        "repacked gemv": ek._GV4,
        "repacked gemm": ek._GM4,
    },
    T.Q3_K: {"vec_dot": ek._VD3, "tiled": ek._T3},
    T.Q2_K: {"vec_dot": ek._VD2, "tiled": ek._T2},
}


def f32_product(
    raw: np.ndarray, qtype: T, n_out: int, n_in: int, act: ek.KActivation
) -> np.ndarray:
    """The same operands multiplied in f32 (dequantized weight, dequantized q8_K activation)."""
    w = weights.dequantize(raw, qtype).reshape(n_out, n_in)
    x = act.q.astype(F32) * np.repeat(act.d, ek.QK_K, axis=1)
    return x @ w.T


def other_arithmetics(
    matrix: ek.KQuantMatrix, x: np.ndarray, ggml: np.ndarray, used: set[int]
) -> dict[str, int]:
    """Differing outputs of every other arithmetic for this weight type on the same data."""
    codes = {k: c for k, c in CODES[matrix.qtype].items() if c not in used}
    act = ek.KActivation(x)
    found = {}
    for name, code in codes.items():
        out = np.empty_like(ggml)
        ek._run(code, matrix.raw, act, slice(0, x.shape[0]), out)
        found[name] = differing(out, ggml)
    found["f32"] = differing(
        f32_product(matrix.raw, matrix.qtype, matrix.n_out, matrix.n_in, act), ggml
    )
    return found


def check(
    name: str, qtype: T, n_out: int, n_in: int, m: int, seed: int, repacked: bool = False
) -> None:
    rng = np.random.default_rng(seed)
    raw, x = random_blocks(rng, qtype, n_out, n_in), activations(rng, m, n_in)
    matrix = ek.KQuantMatrix(raw, qtype, n_out, n_in, repacked=repacked)
    oracle = go.mul_mat_repacked if repacked else go.mul_mat
    ggml = oracle(raw, qtype, n_out, n_in, x)
    mine = differing(matrix.matmul(x), ggml)
    if repacked:
        used = {ek._GM4} if m % 4 == 0 else {ek._GV4} if m < 4 else set()
    else:
        used = {CODES[qtype]["vec_dot" if m < 8 else "tiled"]}
    others = other_arithmetics(matrix, x, ggml, used)
    print(
        f"\n{name} {qtype.name} [{n_out}, {n_in}] m={m}: exact_kquants differs in {mine} of {ggml.size}; "
        + ", ".join(f"{k} {v}" for k, v in others.items())
    )
    assert mine == 0
    assert others["f32"] > 0
    assert any(v > 0 for k, v in others.items() if k != "f32")


# --- activation rounding --------------------------------------------------------------------------


def test_q8_k_rounding_matches_ggml_from_float() -> None:
    rng = np.random.default_rng(1)
    x = activations(rng, 12, 512)
    x[0, :256] = 0.0  # a zero block: d = 0, quants 0
    x[1, :256] = 0.5  # constant block
    x[2, 7] = -np.abs(x[2, :256]).max() * 2  # the largest value negative: the scale's sign flips
    x[3, :256] = np.linspace(-2.5, 2.5, 256, dtype=F32)  # ties of the rounding
    ours, ggml = ek.quantize_q8_K(x), go.quantize_rows(x, T.Q8_K)
    assert ours.shape == ggml.shape
    assert np.array_equal(ours, ggml)


# --- products -------------------------------------------------------------------------------------


@pytest.mark.parametrize("m", [1, 3, 4, 17, 64])
def test_q6_k_matches_ggml(m: int) -> None:
    """m < 8: ggml_vec_dot_q6_K_q8_K; m >= 8: the tiled kernel."""
    check("plain", T.Q6_K, 576, 1536, m, seed=10 + m)


@pytest.mark.parametrize("m", [1, 3, 8, 17])
def test_q4_k_unrepacked_matches_ggml(m: int) -> None:
    """Row counts not a multiple of 8 (and the token embedding) keep Q4_K unrepacked."""
    check("plain", T.Q4_K, 100, 1536, m, seed=20 + m)


@pytest.mark.parametrize("m", [1, 3, 4, 5, 17, 64])
def test_q4_k_repacked_matches_ggml_cpu_repack_buffer(m: int) -> None:
    """q4_K_8x8: gemm for rows in fours (4x8-packed rounding), gemv for the m % 4 others."""
    check("repacked", T.Q4_K, 576, 1536, m, seed=30 + m, repacked=True)


@pytest.mark.parametrize(
    "qtype, repacked", [(T.Q4_K, True), (T.Q6_K, False), (T.Q2_K, False)], ids=str
)
def test_row_groups_keep_their_own_arithmetic(qtype: T, repacked: bool) -> None:
    """A product of several sequences' rows (a shared pass) with their groups: each group's
    rows are the bits ggml gives that group alone (repacked: gemm for its rows in fours, gemv
    for the rest; else tiled from 8 rows, vec_dot below), in one product; as one product of
    all the rows some would not be. A stack of a repacked and a plain part rounds once per
    rule and keeps each part's arithmetic too."""
    rng = np.random.default_rng(5)
    n_out, n_in, groups = 64, 512, [1, 6, 5, 12, 3, 1]
    raw = random_blocks(rng, qtype, n_out, n_in)
    x = activations(rng, sum(groups), n_in)
    matrix = ek.KQuantMatrix(raw, qtype, n_out, n_in, repacked=repacked)
    oracle = go.mul_mat_repacked if repacked else go.mul_mat
    got = matrix.matmul(x, groups)
    start = 0
    for m in groups:
        rows = slice(start, start + m)
        assert differing(got[rows], oracle(raw, qtype, n_out, n_in, x[rows])) == 0
        assert differing(got[rows], matrix.matmul(x[rows])) == 0
        start += m
    assert differing(matrix.matmul(x), got) > 0  # as one product of 28 rows
    plain = ek.KQuantMatrix(random_blocks(rng, T.Q6_K, 32, n_in), T.Q6_K, 32, n_in)
    stack = ek.KMatrixStack([matrix, plain])
    both = stack.matmul(x, groups)
    assert differing(both, np.concatenate([got, plain.matmul(x, groups)], axis=1)) == 0


def test_row_groups_refused_where_they_do_not_cover_the_rows() -> None:
    """Groups that do not add up to the rows, or an empty group: ValueError."""
    rng = np.random.default_rng(6)
    matrix = ek.KQuantMatrix(random_blocks(rng, T.Q4_K, 8, 256), T.Q4_K, 8, 256, repacked=True)
    x = activations(rng, 5, 256)
    for groups in ([2, 2], [5, 0], [6]):
        with pytest.raises(ValueError, match="row groups"):
            matrix.matmul(x, groups)


ZMM = pytest.mark.skipif(not ek.HOST_HAS_ZMM_VNNI, reason="no AVX512BW/VNNI here")
# every dot of the one-row arithmetics a host may pick: (weight type, the dot, activation rows)
ONE_ROW_KERNELS = {
    "gemv avx2": (T.Q4_K, lambda: ek._make_dot(ek._GV4, 1), 1),
    "gemv avx2 x4": (T.Q4_K, lambda: ek._make_dot(ek._GV4, 4), 4),
    "gemv 512-bit": (T.Q4_K, lambda: ek._make_gv4_zmm(1), 1),
    "Q6_K vec_dot avx2": (T.Q6_K, lambda: ek._make_dot(ek._VD6, 1), 1),
    "Q6_K vec_dot avx2 x4": (T.Q6_K, lambda: ek._make_dot(ek._VD6, 4), 4),
    "Q6_K vec_dot 512-bit": (T.Q6_K, lambda: ek._make_vd6_zmm(1), 1),
    "Q6_K vec_dot 512-bit x4": (T.Q6_K, lambda: ek._make_vd6_zmm(4), 4),
}


def _one_row_dots(dot, rn: int):
    """A compiled loop of a dot of ``_make_dot``'s signature (rn activation rows a call) over
    every weight row and the activation rows."""

    @numba.njit
    def run(raw, xq, xd, bsums, out):
        m, n = xq.shape
        nb, n_out = n // ek.QK_K, out.shape[1]
        w_rows, row_bytes = raw.shape
        for t in range(0, m, rn):
            x, s, o = t * n, t * nb, t * n_out
            dot(raw, 0, row_bytes, w_rows, xq, x, n, xd, bsums, s, nb, out, o, n_out)

    return run


@pytest.mark.parametrize(
    "kernel", [pytest.param(k, marks=[ZMM] if "512" in k else []) for k in ONE_ROW_KERNELS]
)
def test_one_row_kernels_match_ggml(kernel: str) -> None:
    """Every dot of repacked Q4_K's gemv and Q6_K's vec_dot, whichever the host picks (the
    512-bit ones where it has AVX512BW and VNNI), for one activation row or four at a time (a
    batched decode step), gives each row ggml's one-row bits, from the extremes (every quant
    and 6-bit scale at its largest, every activation quant at -127) to random blocks."""
    qtype, make, rn = ONE_ROW_KERNELS[kernel]
    rng = np.random.default_rng(77)
    n_out, n_in, m = 64, 2048, 4
    raw = random_blocks(rng, qtype, n_out, n_in)
    blocks = raw.reshape(n_out, n_in // ek.QK_K, -1)
    if qtype == T.Q4_K:
        blocks[0, :, 4:] = 0xFF  # scales and mins 63, quants 15
    else:
        blocks[0, :, :192] = 0xFF  # quants 63
        blocks[0, :, 192:208] = 0x80  # scales -128
    x = activations(rng, m, n_in)
    x[0] = -np.abs(x[0]).max()  # every activation quant -127 (or -128)
    act = ek.KActivation(x)
    out = np.empty((m, n_out), np.float32)
    _one_row_dots(make(), rn)(raw, act.q, act.d, act.bsums, out)
    oracle = go.mul_mat_repacked if qtype == T.Q4_K else go.mul_mat
    for t in range(m):  # one row at a time: a one-row product's arithmetic
        assert differing(out[t : t + 1], oracle(raw, qtype, n_out, n_in, x[t : t + 1])) == 0


@pytest.mark.parametrize("m", [1, 5, 8, 17])
def test_q5_k_matches_ggml(m: int) -> None:
    """Q5_K is never repacked on AVX2: vec_dot (scalar min chain) below 8 rows, tiled above."""
    check("plain", T.Q5_K, 256, 1024, m, seed=50 + m)


# Q2_K and Q3_K: every batch size up to the tiled threshold and past it, weight row counts
# that are and are not multiples of 8 and 16 (the task size), widths of 2 to 6 super-blocks
SMALL_K_CASES = [
    (1, 576, 1536),
    (2, 101, 512),
    (3, 576, 1536),
    (4, 333, 1024),
    (5, 101, 512),
    (6, 576, 1536),
    (7, 333, 1024),
    (8, 576, 1536),
    (9, 101, 512),
    (17, 333, 1024),
    (64, 576, 1536),
]


@pytest.mark.parametrize("m, n_out, n_in", SMALL_K_CASES)
def test_q3_k_matches_ggml(m: int, n_out: int, n_in: int) -> None:
    """Never repacked: ggml_vec_dot_q3_K_q8_K (q3l·x - q3h·x per pair) below 8 rows, tiled
    (act-bias, no min) from 8."""
    check("plain", T.Q3_K, n_out, n_in, m, seed=70 + m)


@pytest.mark.parametrize("m, n_out, n_in", SMALL_K_CASES)
def test_q2_k_matches_ggml(m: int, n_out: int, n_in: int) -> None:
    """Repacked only on AVX512 (q2_K_8x8): ggml_vec_dot_q2_K_q8_K (the min lanes and the scale
    lanes fused into one accumulator, min first) below 8 rows, tiled (fnmadd by dmin) from 8."""
    check("plain", T.Q2_K, n_out, n_in, m, seed=80 + m)


# The batch arithmetics (tiled, repacked gemm) run in weight-row lanes: eight weight rows
# unpacked together, activation rows four at a time then one by one, the n_out % 8 last weight
# rows by the one-row dots; serial below PARALLEL_MIN_MACS, parallel above (m = 512 here).
WIDE_TYPES = [
    (T.Q2_K, False, 44),
    (T.Q3_K, False, 44),
    (T.Q4_K, False, 44),
    (T.Q5_K, False, 44),
    (T.Q6_K, False, 44),
    (T.Q4_K, True, 40),
]


@pytest.mark.parametrize("m", [8, 9, 16, 17, 64, 512])
@pytest.mark.parametrize(
    "qtype, repacked, n_out", WIDE_TYPES, ids=lambda v: getattr(v, "name", str(v))
)
def test_weight_row_lanes_match_ggml(qtype: T, repacked: bool, n_out: int, m: int) -> None:
    check("lanes", qtype, n_out, 512, m, seed=90 + m, repacked=repacked)


@pytest.mark.parametrize("qtype", [T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K])
def test_fewer_than_eight_weight_rows_and_one_block(qtype: T) -> None:
    """n_out < 8 (no lane group: only the one-row dots) and 13 = 8 + 5, one super-block wide."""
    for n_out in (3, 13):
        check("narrow", qtype, n_out, 256, 11, seed=95 + n_out)


@pytest.mark.parametrize(
    "qtype, repacked",
    [
        (T.Q2_K, False),
        (T.Q3_K, False),
        (T.Q4_K, False),
        (T.Q4_K, True),
        (T.Q5_K, False),
        (T.Q6_K, False),
    ],
    ids=lambda v: getattr(v, "name", str(v)),
)
def test_weight_row_lanes_at_the_int16_bounds(qtype: T, repacked: bool) -> None:
    """Every quant and 6-bit scale at its largest (all bits set; Q6_K's int8 scales at +127 and
    -128) against activation rows of constant ±1 (every q8_K quant ±127): the int16 runs of
    pmaddubsw pair sums (_RUN) reach their largest magnitude and must not wrap. (With runs of 8
    quads for Q5_K and 4 for Q6_K this test failed for both, the random-block tests passed.)"""
    rng = np.random.default_rng(12)
    n_out, n_in = 16, 512
    raw = random_blocks(rng, qtype, n_out, n_in).reshape(n_out, n_in // ek.QK_K, -1)
    halves = {T.Q6_K: [208], T.Q3_K: [108], T.Q2_K: [80, 82]}.get(qtype, [0, 2])
    keep = np.zeros(raw.shape[-1], bool)
    for at in halves:
        keep[at : at + 2] = True
    raw[..., ~keep] = 0xFF
    if qtype == T.Q6_K:
        raw[:8, :, 192:208], raw[8:, :, 192:208] = 0x7F, 0x80
    raw = raw.reshape(n_out, -1)
    x = np.ones((9, n_in), F32)
    x[1::2] = -1.0
    x[8, ::3] = -2.0  # a mixed row
    matrix = ek.KQuantMatrix(raw, qtype, n_out, n_in, repacked=repacked)
    ggml = (go.mul_mat_repacked if repacked else go.mul_mat)(raw, qtype, n_out, n_in, x)
    assert differing(matrix.matmul(x), ggml) == 0


def test_wide_slice_of_a_2048x8192_matrix() -> None:
    """A long row (32 super-blocks), as ffn_down of a 2048-wide model: decode and a batch."""
    for qtype, repacked in ((T.Q6_K, False), (T.Q4_K, True), (T.Q3_K, False), (T.Q2_K, False)):
        for m in (1, 9):
            check("wide", qtype, 64, 8192, m, seed=40 + m, repacked=repacked)


def test_repacked_rounding_sign_rule_for_packed_rows() -> None:
    """A block whose largest magnitude occurs as -a first and +a later: quantize_row_q8_K takes
    the first (scale > 0), the 4-row packing takes +a (scale < 0). Rows 0-3 of a repacked
    product see the packing's rule, row 4 the row rule."""
    rng = np.random.default_rng(5)
    n_out, n_in = 16, 256
    raw = random_blocks(rng, T.Q4_K, n_out, n_in)
    x = activations(rng, 5, n_in)
    a = np.abs(x).max() * 1.5
    x[:, 3], x[:, 200] = -a, a
    x[:, 100] = a / 3  # a third of the maximum: the ±127/a scale rounds it differently by sign
    matrix = ek.KQuantMatrix(raw, T.Q4_K, n_out, n_in, repacked=True)
    assert differing(matrix.matmul(x), go.mul_mat_repacked(raw, T.Q4_K, n_out, n_in, x)) == 0
    packed, plain = matrix.quantize(x), ek.KActivation(x)
    assert np.all(np.sign(packed.d[:4]) != np.sign(plain.d[:4]))
    assert packed.d[4, 0] == plain.d[4, 0]


@pytest.fixture(scope="module")
def ffn_down_f32(default_model: Path) -> np.ndarray:
    """The default model's blk.0.ffn_down (Q4_1, [576, 1536]) as f32."""
    tensor = next(t for t in GGUFFile(default_model).tensors if t.name == "blk.0.ffn_down.weight")
    n_in, n_out = (int(v) for v in tensor.shape)
    return weights.dequantize(tensor.data, tensor.tensor_type).reshape(n_out, n_in)


@pytest.mark.parametrize("qtype", [T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K])
def test_default_model_ffn_down_requantized_by_ggml(ffn_down_f32: np.ndarray, qtype: T) -> None:
    """Real weights with real K-quant statistics: the default model's blk.0.ffn_down (Q4_1,
    [576, 1536]) dequantized, then quantized to the K type by ggml's own from_float (ggml_cpy),
    as a Q4_K_M file's quantizer would; products for decode and a batch, as llama-server would
    load it (Q4_K: 576 rows, so repacked)."""
    n_out, n_in = ffn_down_f32.shape
    raw = go.cpy(ffn_down_f32, qtype)
    repacked = ek.repacked_by_llama_server(qtype, n_out)
    matrix = ek.KQuantMatrix(raw, qtype, n_out, n_in, repacked=repacked)
    x = activations(np.random.default_rng(60), 9, n_in)
    for m in (1, 9):
        ggml = (go.mul_mat_repacked if repacked else go.mul_mat)(raw, qtype, n_out, n_in, x[:m])
        naive = differing(f32_product(raw, qtype, n_out, n_in, matrix.quantize(x[:m])), ggml)
        mine = differing(matrix.matmul(x[:m]), ggml)
        print(
            f"\nblk.0.ffn_down as {qtype.name}, m={m}: exact_kquants differs in {mine}, "
            f"f32 in {naive} of {ggml.size}"
        )
        assert mine == 0 and naive > 0


def test_concat_equals_separate_products() -> None:
    rng = np.random.default_rng(7)
    parts = [
        ek.KQuantMatrix(random_blocks(rng, T.Q4_K, n, 512), T.Q4_K, n, 512, repacked=True)
        for n in (16, 8, 24)
    ]
    x = activations(rng, 6, 512)
    joined = ek.KQuantMatrix.concat(parts)
    assert (joined.n_out, joined.n_in, joined.qtype, joined.repacked) == (48, 512, T.Q4_K, True)
    assert differing(joined.matmul(x), np.concatenate([p.matmul(x) for p in parts], axis=1)) == 0


def test_concat_of_mixed_types_is_a_stack_of_each_kernel() -> None:
    """A Q4_K_M layer's Q (Q4_K, repacked), K (Q4_K, 36 rows: not repacked) and V (Q6_K), and
    a Q3_K_M/Q2_K file's Q3_K and Q2_K parts."""
    rng = np.random.default_rng(9)
    specs = [
        (T.Q4_K, 64, True),
        (T.Q4_K, 36, False),
        (T.Q6_K, 40, False),
        (T.Q3_K, 24, False),
        (T.Q2_K, 16, False),
    ]
    raws = [random_blocks(rng, q, n, 512) for q, n, _ in specs]
    parts = [ek.KQuantMatrix(raw, q, n, 512, repacked=rep) for raw, (q, n, rep) in zip(raws, specs)]
    stack = ek.KQuantMatrix.concat(parts)
    assert isinstance(stack, ek.KMatrixStack) and (stack.n_out, stack.n_in) == (180, 512)
    for m in (1, 9):
        x = activations(rng, m, 512)
        want = np.concatenate(
            [
                (go.mul_mat_repacked if rep else go.mul_mat)(raw, q, n, 512, x)
                for raw, (q, n, rep) in zip(raws, specs)
            ],
            axis=1,
        )
        assert differing(stack.matmul(x), want) == 0


def test_zero_copy_and_shape_checks() -> None:
    rng = np.random.default_rng(8)
    raw = random_blocks(rng, T.Q6_K, 8, 256)
    matrix = ek.KQuantMatrix(raw, T.Q6_K, 8, 256)
    assert np.shares_memory(matrix.raw, raw)
    with pytest.raises(ValueError, match="needs"):
        ek.KQuantMatrix(raw[:4], T.Q6_K, 8, 256)
    with pytest.raises(ValueError, match="multiple of 256"):
        ek.KQuantMatrix(raw, T.Q6_K, 16, 128)
    with pytest.raises(ValueError, match="does not repack"):
        ek.KQuantMatrix(raw, T.Q6_K, 8, 256, repacked=True)
    with pytest.raises(ValueError, match="width"):
        matrix.matmul(np.zeros((1, 512), F32))
    assert matrix.matmul(np.zeros((0, 256), F32)).shape == (0, 8)
    repacked = ek.KQuantMatrix(random_blocks(rng, T.Q4_K, 8, 256), T.Q4_K, 8, 256, repacked=True)
    with pytest.raises(ValueError, match="repacked"):
        repacked.matmul(ek.KActivation(np.ones((4, 256), F32)))
    with pytest.raises(ValueError, match="no exact"):
        ek.KQuantMatrix(raw, T.IQ4_XS, 8, 256)


def test_supported_and_repack_rule() -> None:
    assert all(ek.supported(q) for q in (T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K))
    assert not ek.supported(T.Q4_0) and not ek.supported(T.IQ4_XS) and not ek.supported(9999)
    assert ek.repacked_by_llama_server(T.Q4_K, 576)
    assert not ek.repacked_by_llama_server(T.Q4_K, 100)
    assert not ek.repacked_by_llama_server(T.Q4_K, 576, token_embd=True)
    assert not ek.repacked_by_llama_server(T.Q6_K, 576)
    assert not ek.repacked_by_llama_server(T.Q5_K, 576)
    # q2_K_8x8 needs AVX512 (ggml_repack_get_optimal_repack_type); Q3_K has no repacked layout
    assert not ek.repacked_by_llama_server(T.Q2_K, 576)
    assert not ek.repacked_by_llama_server(T.Q3_K, 576)
    assert weights.exact_family(T.Q2_K) is ek and weights.exact_family(T.Q3_K) is ek
