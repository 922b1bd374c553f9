"""exact_ops against ggml's own CPU kernels (tests/ggml_oracle.py), bit for bit.

Each test also counts how many elements the plain NumPy formula (what the forward pass used
before) gets wrong on the same data, and prints both figures (pytest -s shows them). Where the
data is chosen to exercise a rounding that NumPy does not follow, the test asserts that the naive
formula does miss it, so that a pass is not a pass by luck of the data.
"""

from __future__ import annotations

import ctypes
import ctypes.util

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import quants

from bankml.engine_cupy.kernels import exact_ops as eo
from tests import ggml_oracle as go
from tests.engine_checks import differing

F32 = np.float32


def report(name: str, ours: np.ndarray, naive: np.ndarray, ggml: np.ndarray) -> int:
    mine, theirs = differing(ours, ggml), differing(naive, ggml)
    print(f"\n{name}: exact_ops differs in {mine}, NumPy in {theirs} of {ggml.size}")
    assert mine == 0
    return theirs


def naive_silu(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return x / (F32(1) + np.exp(-x))


def activations(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Gate-like values: mostly N(0, 1), some rows 10x and 60x wider (exp's edge cases)."""
    wide = rng.choice(np.array([1, 10, 60], F32), size=shape)
    return (rng.standard_normal(shape) * wide).astype(F32)


# --- SwiGLU / SiLU -------------------------------------------------------------------------------


def test_swiglu_matches_ggml_on_a_decode_and_a_batch() -> None:
    rng = np.random.default_rng(10)
    for rows in (1, 7):
        gate, up = activations(rng, (rows, 1536)), rng.standard_normal((rows, 1536)).astype(F32)
        naive_misses = report(
            f"swiglu [{rows}, 1536]",
            eo.swiglu(gate, up),
            naive_silu(gate) * up,
            go.binary("swiglu", gate, up),
        )
        assert naive_misses > 0


@pytest.mark.parametrize("width", [1, 7, 8, 9, 15, 100, 1003])
def test_swiglu_rows_end_in_libm_expf(width: int) -> None:
    """Each row: 8-lane polynomial blocks from its start, then n % 8 elements through expf."""
    rng = np.random.default_rng(width)
    gate, up = activations(rng, (3, width)), rng.standard_normal((3, width)).astype(F32)
    report(
        f"swiglu [3, {width}]",
        eo.swiglu(gate, up),
        naive_silu(gate) * up,
        go.binary("swiglu", gate, up),
    )


def test_swiglu_overflow_and_underflow_lanes() -> None:
    """|x| past 88 and 104: the blend of ggml_v_expf's s1/s2 branches and its flush to 0/inf."""
    rng = np.random.default_rng(11)
    gate = rng.uniform(-250, 250, (4, 1000)).astype(F32)
    gate[0, :16] = [
        0.0,
        -0.0,
        88.3,
        88.4,
        -88.3,
        -88.4,
        103.9,
        -103.9,
        126.5,
        -126.5,
        150,
        -150,
        192.5,
        -192.5,
        1e30,
        -1e30,
    ]
    up = rng.standard_normal((4, 1000)).astype(F32)
    report(
        "swiglu over [-250, 250]",
        eo.swiglu(gate, up),
        naive_silu(gate) * up,
        go.binary("swiglu", gate, up),
    )


def test_silu_alone_matches_ggml() -> None:
    x = activations(np.random.default_rng(12), (5, 576))
    assert report("silu [5, 576]", eo.silu(x), naive_silu(x), go.unary("silu", x)) > 0


def test_swiglu_keeps_the_shape_and_refuses_mismatched_inputs() -> None:
    gate = np.ones((2, 3, 16), F32)
    assert eo.swiglu(gate, gate).shape == (2, 3, 16)
    with pytest.raises(ValueError):
        eo.swiglu(gate, np.ones((2, 3, 8), F32))


# --- RMSNorm -----------------------------------------------------------------------------------


def naive_rms_norm(x: np.ndarray, w: np.ndarray | None, eps: float) -> np.ndarray:
    mean = (np.square(x).astype(np.float64).sum(axis=-1, keepdims=True) / x.shape[-1]).astype(F32)
    y = x * (F32(1) / np.sqrt(mean + F32(eps)))
    return y if w is None else y * w


@pytest.mark.parametrize("width", [64, 576, 2048])
def test_rms_norm_with_and_without_weight(width: int) -> None:
    rng = np.random.default_rng(width)
    spread = rng.choice(np.array([0.01, 1, 30], F32), (16, 1))
    x = (rng.standard_normal((16, width)) * spread).astype(F32)
    w = rng.normal(1, 0.3, width).astype(F32)
    report(
        f"rms_norm*w [16, {width}]",
        eo.rms_norm(x, w, 1e-5),
        naive_rms_norm(x, w, 1e-5),
        go.rms_norm_mul(x, w, 1e-5),
    )
    report(
        f"rms_norm [16, {width}]",
        eo.rms_norm(x, None, 1e-6),
        naive_rms_norm(x, None, 1e-6),
        go.rms_norm(x, 1e-6),
    )


def test_rms_norm_sums_the_squares_in_order() -> None:
    """A row whose double sum of squares gives another float mean when summed pairwise.

    28² + 2·(2^-8)² = 784 + 2^-15: over 256 elements, the mean 3.0625 + 2^-23 is a float32 tie
    that rounds (to even) down to 3.0625. The 253 squares of 2^-23 after them vanish one by one
    in ggml's sequential double sum (each is under half an ulp of 784) but not in NumPy's
    pairwise sum, whose mean then rounds up, and sqrtf turns that into another scale.
    """
    row = np.full(256, 2.0**-23, F32)
    row[:3] = 28.0, 2.0**-8, 2.0**-8
    x = np.stack([row, np.roll(row, 100)])
    want = go.rms_norm(x, 0.0)
    assert (
        report(
            "rms_norm, order-sensitive rows",
            eo.rms_norm(x, None, 0.0),
            naive_rms_norm(x, None, 0.0),
            want,
        )
        > 0
    )


def test_rms_norm_of_heads_uses_the_last_axis() -> None:
    """Q/K norm (qwen3): [n, heads, head_dim] normalised per head with a [head_dim] weight."""
    rng = np.random.default_rng(13)
    q = rng.standard_normal((3, 8, 128)).astype(F32)
    w = rng.normal(1, 0.5, 128).astype(F32)
    report(
        "rms_norm per head [3, 8, 128]",
        eo.rms_norm(q, w, 1e-6),
        naive_rms_norm(q, w, 1e-6),
        go.rms_norm_mul(q, w, 1e-6),
    )
    with pytest.raises(ValueError):
        eo.rms_norm(q, w[:64], 1e-6)


# --- RoPE ---------------------------------------------------------------------------------------


def naive_rope(
    x: np.ndarray,
    positions: np.ndarray,
    n_dims: int,
    base: float,
    freq_scale: float,
    factors: np.ndarray | None,
    neox: bool,
) -> np.ndarray:
    """The NumPy RoPE the forward pass used: f32 theta recurrence, NumPy cos/sin, no FMA."""
    half = n_dims // 2
    steps = np.full((len(positions), half), F32(np.power(F32(base), F32(-2.0) / F32(n_dims))), F32)
    steps[:, 0] = positions.astype(F32)
    theta = np.cumprod(steps, axis=1)
    if factors is not None:
        theta = theta / factors
    theta = F32(freq_scale) * theta
    c, s = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]
    out = x.copy()
    a, b = (x[..., :half], x[..., half:]) if neox else (x[..., 0::2], x[..., 1::2])
    first, second = a * c - b * s, a * s + b * c
    if neox:
        out[..., :half], out[..., half:] = first, second
    else:
        out[..., 0::2], out[..., 1::2] = first, second
    return out


ROPE_CASES = [  # head_dim, mode, base, freq_scale, Llama-3 factors, as in the architectures played
    (64, eo.NORM, 100000.0, 1.0, False),  # SmolLM2 / llama
    (128, eo.NORM, 500000.0, 1.0, True),  # Llama 3.x with rope_freqs
    (64, eo.NEOX, 10000.0, 1.0, False),  # qwen2
    (128, eo.NEOX, 1000000.0, 0.25, False),  # qwen3 with linear scaling
    (256, eo.NEOX, 10000.0, 1.0, False),  # gemma3 local layers
]


@pytest.mark.parametrize("head_dim,mode,base,freq_scale,with_factors", ROPE_CASES)
def test_rope_matches_ggml(
    head_dim: int, mode: int, base: float, freq_scale: float, with_factors: bool
) -> None:
    rng = np.random.default_rng(head_dim + mode)
    positions = np.concatenate([[0, 1], rng.integers(2, 32768, 5)]).astype(np.int32)
    x = rng.normal(0, 2, (len(positions), 4, head_dim)).astype(F32)
    factors = rng.uniform(1, 8, head_dim // 2).astype(F32) if with_factors else None
    want = go.rope_ext(x, positions, head_dim, mode, base, freq_scale, factors)
    cos, sin = eo.rope_cos_sin(positions, head_dim, base, freq_scale, factors)
    got = eo.apply_rope(x, cos, sin, mode == eo.NEOX)
    naive = naive_rope(x, positions, head_dim, base, freq_scale, factors, mode == eo.NEOX)
    assert report(f"rope hd={head_dim} mode={mode}", got, naive, want) > 0


@pytest.mark.parametrize("mode", [eo.NORM, eo.NEOX])
def test_rope_of_every_small_width(mode: int) -> None:
    """NORM's vectorised loop fuses pairs two and four at a time and leaves an odd last pair
    to an unfused vaddsubps; NEOX is fused throughout."""
    rng = np.random.default_rng(14 + mode)
    positions = rng.integers(0, 4000, 3).astype(np.int32)
    for n_dims in range(2, 42, 2):
        x = rng.normal(0, 2, (3, 5, n_dims)).astype(F32)
        cos, sin = eo.rope_cos_sin(positions, n_dims, 10000.0)
        got = eo.apply_rope(x, cos, sin, mode == eo.NEOX)
        assert differing(got, go.rope_ext(x, positions, n_dims, mode, 10000.0)) == 0, n_dims


def test_rope_theta_scale_is_libm_powf() -> None:
    libm = ctypes.CDLL(ctypes.util.find_library("m"))
    libm.powf.restype, libm.powf.argtypes = ctypes.c_float, [ctypes.c_float, ctypes.c_float]
    for base, n_dims in [(10000.0, 64), (100000.0, 64), (500000.0, 128), (1e6, 128), (1e4, 256)]:
        want = F32(libm.powf(F32(base), F32(-2.0) / F32(n_dims)))
        assert eo.theta_scale(base, n_dims) == want


def test_rope_refuses_a_table_of_another_shape() -> None:
    cos, sin = eo.rope_cos_sin(np.arange(2), 64, 10000.0)
    with pytest.raises(ValueError):
        eo.apply_rope(np.zeros((3, 2, 64), F32), cos, sin, False)
    with pytest.raises(ValueError):
        eo.rope_cos_sin(np.arange(2), 64, 10000.0, freq_factors=np.ones(8, F32))


# --- GELU / GeGLU -------------------------------------------------------------------------------


def naive_gelu_table() -> np.ndarray:
    """The table as NumPy computed it: no FMA in 1 + 0.044715x², NumPy's tanh."""
    x = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(F32)
    with np.errstate(invalid="ignore", over="ignore"):
        inner = F32(0.7978845608028654) * x * (F32(1) + F32(0.044715) * x * x)
        y = F32(0.5) * x * (F32(1) + np.tanh(inner))
        return y.astype(np.float16).astype(F32)


def naive_geglu(gate: np.ndarray, up: np.ndarray, table: np.ndarray) -> np.ndarray:
    y = table[gate.astype(np.float16).view(np.uint16).astype(np.int32)]
    y = np.where(gate <= F32(-10), F32(0), y)
    return np.where(gate >= F32(10), gate, y) * up


def test_gelu_table_matches_ggml_on_every_f16() -> None:
    """GeGLU with up = 1 over every finite f16 value reads back the whole table."""
    every = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(F32)
    gate = every[np.isfinite(every)].reshape(1, -1)
    ones = np.ones_like(gate)
    table = eo.gelu_f16_table()
    assert (
        report(
            "gelu table (every finite f16)",
            eo.geglu(gate, ones, table),
            naive_geglu(gate, ones, naive_gelu_table()),
            go.binary("geglu", gate, ones),
        )
        > 0
    )


def test_geglu_matches_ggml() -> None:
    rng = np.random.default_rng(15)
    gate = rng.uniform(-12, 12, (4, 1536)).astype(F32)
    up = rng.standard_normal((4, 1536)).astype(F32)
    table = eo.gelu_f16_table()
    report(
        "geglu [4, 1536]",
        eo.geglu(gate, up, table),
        naive_geglu(gate, up, naive_gelu_table()),
        go.binary("geglu", gate, up),
    )
    report(
        "gelu [4, 1536]",
        eo.geglu(gate, np.ones_like(gate), table),
        naive_geglu(gate, np.ones_like(gate), naive_gelu_table()),
        go.unary("gelu", gate),
    )


# --- what NumPy already does exactly --------------------------------------------------------------


@pytest.mark.parametrize(
    "qtype",
    [T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.F16, T.BF16],
)
def test_get_rows_is_gguf_dequantize(qtype: T) -> None:
    """ggml's get_rows dequantizes with ggml-base's to_float, built without -mfma: no FMA, so
    gguf-py's dequantization (what weights.py uses for token_embd) is already exact."""
    rng = np.random.default_rng(int(qtype))
    x = rng.normal(0, 0.05, (40, 256)).astype(F32)
    raw = go.quantize_rows(x, qtype)
    ids = rng.integers(0, 40, 12).astype(np.int32)
    want = go.get_rows(raw, qtype, 40, 256, ids)
    assert differing(quants.dequantize(raw, qtype).reshape(40, 256)[ids], want) == 0


def test_residual_add_mul_and_scale_are_single_roundings() -> None:
    rng = np.random.default_rng(16)
    a = rng.standard_normal((3, 576)).astype(F32)
    b = rng.standard_normal((3, 576)).astype(F32)
    w = rng.standard_normal(576).astype(F32)
    assert differing(a + b, go.binary("add", a, b)) == 0
    assert differing(a * w, go.binary("mul", a, np.broadcast_to(w, a.shape).copy())) == 0
    assert differing(a * F32(0.0625), go.scale(a, 0.0625)) == 0


def test_kq_scale_is_two_float_roundings() -> None:
    """llama.cpp's 1.0f/sqrtf(float(d)): the double 1/sqrt(d) rounded once differs at d = 96."""
    assert eo.attn_scale(64) == F32(0.125)
    assert eo.attn_scale(96) == F32(1) / np.sqrt(F32(96))
    assert eo.attn_scale(96) != F32(1 / np.sqrt(96.0))


def test_expf_is_libm() -> None:
    libm = ctypes.CDLL(ctypes.util.find_library("m"))
    libm.expf.restype, libm.expf.argtypes = ctypes.c_float, [ctypes.c_float]
    x = np.random.default_rng(17).uniform(-30, 30, 3000).astype(F32)
    want = np.array([libm.expf(float(v)) for v in x], F32)
    got = eo.expf(x.reshape(60, 50)).reshape(-1)
    misses = differing(np.exp(x), want)
    print(f"\nexpf: exact_ops differs in {differing(got, want)}, NumPy in {misses} of {x.size}")
    assert differing(got, want) == 0


# --- the KV cache's Hadamard rotation (llama_mul_mat_hadamard) -----------------------------------


@pytest.mark.parametrize("n", [64, 128, 256])
def test_fwht_matches_ggml_and_not_a_matrix_product(n: int) -> None:
    """Rows of 3 blocks, magnitudes from 1e-3 to 1e3, a zero row and a subnormal one: the fast
    transform's bits, which a product by the Hadamard matrix misses on most values."""
    rng = np.random.default_rng(n)
    x = (rng.standard_normal((40, 3 * n)) * 10.0 ** rng.uniform(-3, 3, (40, 1))).astype(F32)
    x[0] = 0
    x[1] = rng.standard_normal(3 * n).astype(F32) * F32(1e-39)
    want = go.fwht(x, n)
    naive = (x.reshape(-1, n) @ go.hadamard(n)).reshape(x.shape)
    assert report(f"fwht {n}", eo.fwht(x, n), naive, want) > x.size // 4


def test_fwht_of_heads_and_its_refusals() -> None:
    """[tokens, heads, hd] turned per head, as the cache turns Q/K/V; one row; bad sizes refused."""
    rng = np.random.default_rng(18)
    q = rng.standard_normal((5, 9, 64)).astype(F32)
    assert differing(eo.fwht(q, 64), go.fwht(q, 64)) == 0
    assert eo.fwht(q, 64).shape == q.shape
    assert differing(eo.fwht(q[0, 0], 64), go.fwht(q[0, 0], 64)) == 0
    for n in (1, 2, 4, 8, 16, 32):  # under 8 ggml has no SIMD stage; 8 is one register
        assert differing(eo.fwht(q, n), go.fwht(q, n)) == 0, n
    with pytest.raises(ValueError, match="power of two"):
        eo.fwht(q, 48)
    with pytest.raises(ValueError, match="blocks of 128"):
        eo.fwht(q, 128)


def test_swiglu_of_fused_halves_and_in_parallel_is_the_same_bits() -> None:
    """The gate/up halves of a fused product are read in place (no copy), and batches large
    enough for the parallel loop give the bits of the serial one."""
    rng = np.random.default_rng(11)
    fused = (rng.standard_normal((64, 2 * 1536)) * 4).astype(np.float32)
    gate, up = fused[:, :1536], fused[:, 1536:]
    assert not gate.flags.c_contiguous and gate.size >= eo.PARALLEL_MIN_ELEMENTS
    whole = eo.swiglu(gate, up)
    rows = np.concatenate(
        [eo.swiglu(gate[i : i + 1].copy(), up[i : i + 1].copy()) for i in range(64)]
    )
    assert np.array_equal(whole.view(np.uint32), rows.view(np.uint32))
