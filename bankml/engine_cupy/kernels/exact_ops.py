"""Element-wise and row operations of the forward pass, rounded exactly as ggml's CPU backend.

llama-server (build 11434) is built for AVX2 + FMA + F16C with GCC, whose default for GNU C/C++
is ``-ffp-contract=fast``: a C expression ``a*b + c`` becomes one fused multiply-add. So the
last bit of several ops depends on code generation that NumPy cannot follow:

- SwiGLU / SiLU (``ggml_vec_swiglu_f32``): 8 lanes at a time through ``ggml_v_expf``, a
  polynomial exp built of FMAs; the row's last ``n % 8`` elements through libm's ``expf``.
- RoPE (``ggml_compute_forward_rope_flt``): angles by ``theta *= theta_scale`` from
  ``powf(base, -2/n_dims)``, cos/sin by libm's ``sincosf``, then a rotation whose ``x0``
  products are fused (``fma(x0, cos, -(x1*sin))``, ``fma(x0, sin, x1*cos)``), except where
  GCC's vectorised NORM loop leaves a last odd pair to an unfused ``vaddsubps``.
- RMSNorm (``ggml_compute_forward_rms_norm_f32``): squares summed in double *in sequence*
  (NumPy sums pairwise), then ``1.0f/sqrtf(mean + eps)``, ``(x*scale)*w``.
- The GELU table behind GeGLU (``ggml_cpu_init``): ``1 + 0.044715*x*x`` is one FMA and tanh is
  libm's ``tanhf``, before rounding to f16.
- The quantized KV cache's Hadamard rotation (``llama_mul_mat_hadamard``): not a matrix product
  but ggml's fast Walsh-Hadamard transform (``ggml_compute_forward_fwht``), scaled first.

Each op is a Numba loop (``jit.njit``: IEEE, no fast-math) over float32 C-contiguous arrays whose
last axis is ggml's row. libm is called by symbol (``expf32``, ``sincosf32``, ``tanhf32``,
``powf32``: glibc's own aliases of ``expf`` & co., which LLVM does not recognise and so cannot
replace by a vector library or fold differently), so the results are the ones llama-server's
dynamically linked libm gives on the same machine. Adds, muls and ``ggml_scale`` are single
IEEE operations in both and stay NumPy.
"""

from __future__ import annotations

from typing import Any

import numpy
from llvmlite import ir
from numba import prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from bankml.engine_cupy.kernels.jit import f16_bits, fma32, njit

__all__ = [
    "swiglu",
    "silu",
    "ggml_v_expf",
    "rms_norm",
    "rope_cos_sin",
    "apply_rope",
    "gelu_f16_table",
    "geglu",
    "attn_scale",
    "theta_scale",
    "expf",
    "fwht",
    "NEOX",
    "NORM",
]

F32 = numpy.float32
NORM, NEOX = 0, 2  # ggml's rope modes (GGML_ROPE_TYPE_NORMAL / GGML_ROPE_TYPE_NEOX)


# --- libm by symbol, and float bits -------------------------------------------------------------


def _libm_f32(name: str) -> Any:
    """An intrinsic calling glibc's float ``name(float)``."""

    @intrinsic
    def call(typingctx: Any, x: Any) -> Any:
        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            f32 = ir.FloatType()
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(f32, [f32]), name)
            return builder.call(fn, args)

        return types.float32(types.float32), codegen

    return call


_expf = _libm_f32("expf32")
_logf = _libm_f32("logf32")
_tanhf = _libm_f32("tanhf32")


@intrinsic
def _powf(typingctx: Any, x: Any, y: Any) -> Any:
    """glibc's powf."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        f32 = ir.FloatType()
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(f32, [f32, f32]), "powf32"
        )
        return builder.call(fn, args)

    return types.float32(types.float32, types.float32), codegen


@intrinsic
def _sincosf(typingctx: Any, x: Any) -> Any:
    """glibc's sincosf (GCC merges rope_yarn's cosf and sinf into it) -> (sin, cos)."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        f32 = ir.FloatType()
        fnty = ir.FunctionType(ir.VoidType(), [f32, f32.as_pointer(), f32.as_pointer()])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "sincosf32")
        s = cgutils.alloca_once(builder, f32)
        c = cgutils.alloca_once(builder, f32)
        builder.call(fn, [args[0], s, c])
        pair = [builder.load(s), builder.load(c)]
        return context.make_tuple(builder, signature.return_type, pair)

    return types.UniTuple(types.float32, 2)(types.float32), codegen


@intrinsic
def _exp_scales(typingctx: Any, z: Any, n: Any) -> Any:
    """ggml_v_expf's integer steps, in 32-bit wrapping arithmetic as the epi32 intrinsics:
    k = 2^n from z's low bits, and s1, s2 that split 2^n where it would overflow k."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        i32, f32 = ir.IntType(32), ir.FloatType()
        z, n = args
        e = builder.shl(builder.bitcast(z, i32), ir.Constant(i32, 23))
        k = builder.bitcast(builder.add(e, ir.Constant(i32, 0x3F800000)), f32)
        nonpositive = builder.fcmp_ordered("<=", n, ir.Constant(f32, 0.0))
        g = builder.select(nonpositive, ir.Constant(i32, 0x82000000), ir.Constant(i32, 0))
        s1 = builder.bitcast(builder.add(g, ir.Constant(i32, 0x7F000000)), f32)
        s2 = builder.bitcast(builder.sub(e, g), f32)
        return context.make_tuple(builder, signature.return_type, [k, s1, s2])

    return types.UniTuple(types.float32, 3)(types.float32, types.float32), codegen


# --- SiLU / SwiGLU ------------------------------------------------------------------------------

_R = F32(float.fromhex("0x1.8p23"))
_LOG2E = F32(float.fromhex("0x1.715476p+0"))
_LN2_HI = F32(float.fromhex("0x1.62e4p-1"))
_LN2_LO = F32(float.fromhex("0x1.7f7d1cp-20"))
_P0 = F32(float.fromhex("0x1.ffffecp-1"))
_P1 = F32(float.fromhex("0x1.fffdb6p-2"))
_P2 = F32(float.fromhex("0x1.555e66p-3"))
_P3 = F32(float.fromhex("0x1.573e2ep-5"))
_P4 = F32(float.fromhex("0x1.0e4020p-7"))
_ONE = F32(1.0)
_ZERO = F32(0.0)


@njit
def ggml_v_expf(x: float) -> float:
    """One lane of ggml_v_expf (vec.h, the AVX2+FMA branch).

    The C tests whether any of the 8 lanes has |n| > 126 before blending, but a lane's value
    does not depend on that choice: fma(j, k, k) is what the blend keeps for the others.
    Written without branches so that LLVM can vectorise the loop around it.
    """
    z = fma32(x, _LOG2E, _R)
    n = z - _R
    b = fma32(-n, _LN2_LO, fma32(-n, _LN2_HI, x))
    k, s1, s2 = _exp_scales(z, n)
    u = b * b
    j = fma32(fma32(fma32(_P4, b, _P3), u, fma32(_P2, b, _P1)), u, _P0 * b)
    wide = abs(n)
    r = fma32(s2, j, s2) * s1 if wide > F32(126) else fma32(j, k, k)
    return s1 * s1 if wide > F32(192) else r


@njit
def _v_silu(x: float) -> float:
    """One lane of ggml_v_silu: x / (1 + ggml_v_expf(0 - x))."""
    return x / (_ONE + ggml_v_expf(_ZERO - x))


@njit
def _silu_f32(x: float) -> float:
    """ggml_silu_f32, the scalar tail: x / (1 + expf(-x)) with libm's expf."""
    return x / (_ONE + _expf(-x))


def _swiglu_row_loop(
    gate: numpy.ndarray, g_stride: int, up: numpy.ndarray, u_stride: int, out: numpy.ndarray, r: int
) -> None:
    n = out.shape[1]
    # the row as contiguous 1-D slices indexed from 0: LLVM then knows each index is in range and
    # not negative and loads 8 neighbours at once; indexed as gate[g0 + i], it kept Numba's
    # negative-index wraparound per element and vectorised the loop with gathers (3-4x slower)
    g = gate[r * g_stride : r * g_stride + n]
    u = up[r * u_stride : r * u_stride + n]
    o = out[r]
    vec = n - n % 8  # ggml_vec_swiglu_f32: 8-lane blocks from the row's start, then scalar
    for i in range(vec):
        o[i] = _v_silu(g[i]) * u[i]
    for i in range(vec, n):
        o[i] = _silu_f32(g[i]) * u[i]


_swiglu_row = njit(inline="always")(_swiglu_row_loop)


# gate and up come as flat 1-D arrays and a row stride (_flat_rows): indexed so, LLVM sees unit
# steps and vectorises the polynomial 8 lanes wide, where a strided 2-D view kept it scalar (6x)
@njit
def _swiglu_rows(
    gate: numpy.ndarray, g_stride: int, up: numpy.ndarray, u_stride: int, out: numpy.ndarray
) -> None:
    for r in range(out.shape[0]):
        _swiglu_row(gate, g_stride, up, u_stride, out, r)


@njit(parallel=True)
def _swiglu_rows_parallel(
    gate: numpy.ndarray, g_stride: int, up: numpy.ndarray, u_stride: int, out: numpy.ndarray
) -> None:
    for r in prange(out.shape[0]):  # rows are independent: the same bits on any thread
        _swiglu_row(gate, g_stride, up, u_stride, out, r)


PARALLEL_MIN_ELEMENTS = 1 << 16  # below this a parallel region costs more than it saves


@njit
def _silu_rows(x: numpy.ndarray, out: numpy.ndarray) -> None:
    rows, n = x.shape
    vec = n - n % 8
    for r in range(rows):
        for i in range(vec):
            out[r, i] = _v_silu(x[r, i])
        for i in range(vec, n):
            out[r, i] = _silu_f32(x[r, i])


def _rows(x: Any) -> numpy.ndarray:
    """x as a float32 [rows, last axis] array, a copy only when it must be: a 2-D view with a
    contiguous last axis (the gate and up halves of a fused product) is used as it is, which
    spared a 256-token prefill ~0.1 s of copies."""
    if isinstance(x, numpy.ndarray) and x.dtype == F32 and x.ndim == 2 and x.strides[1] == 4:
        return x
    a = numpy.ascontiguousarray(x, dtype=F32)
    return a.reshape(-1, a.shape[-1]) if a.ndim else a.reshape(1, 1)


def _flat_rows(a: numpy.ndarray) -> tuple[numpy.ndarray, int]:
    """A [rows, n] array with a unit last-axis step as (1-D view from its first element to its
    last, row stride in elements): row r is flat[r*stride : r*stride + n]."""
    rows, n = a.shape
    if a.flags.c_contiguous:  # one row, or whole rows: a plain reshape (as_strided costs ~20 µs)
        return a.reshape(-1), n
    stride = a.strides[0] // a.itemsize
    span = (rows - 1) * stride + n
    return numpy.lib.stride_tricks.as_strided(a, shape=(span,), strides=(a.itemsize,)), stride


def swiglu(gate: Any, up: Any) -> numpy.ndarray:
    """ggml_swiglu_split(gate, up): silu(gate) * up, each last-axis row as ggml_vec_swiglu_f32."""
    g, u = _rows(gate), _rows(up)
    if g.shape != u.shape:
        raise ValueError(f"swiglu: gate {numpy.shape(gate)} and up {numpy.shape(up)} differ")
    out = numpy.empty(g.shape, F32)
    kernel = _swiglu_rows_parallel if g.size >= PARALLEL_MIN_ELEMENTS else _swiglu_rows
    kernel(*_flat_rows(g), *_flat_rows(u), out)
    return out.reshape(numpy.shape(gate))


def silu(x: Any) -> numpy.ndarray:
    """ggml_silu: each last-axis row as ggml_vec_silu_f32 (8-lane polynomial exp, libm tail)."""
    a = _rows(x)
    out = numpy.empty_like(a)
    _silu_rows(a, out)
    return out.reshape(numpy.shape(x))


# --- RMSNorm ------------------------------------------------------------------------------------


@njit
def _rms_norm_rows(x: numpy.ndarray, w: numpy.ndarray, eps: float, out: numpy.ndarray) -> None:
    rows, n = x.shape
    has_weight = w.shape[0] == n
    for r in range(rows):
        total = 0.0  # ggml_float: a double, summed in order
        for i in range(n):
            total += numpy.float64(x[r, i] * x[r, i])
        mean = numpy.float32(total / n)
        scale = _ONE / numpy.sqrt(mean + eps)
        if has_weight:
            for i in range(n):
                out[r, i] = (x[r, i] * scale) * w[i]
        else:
            for i in range(n):
                out[r, i] = x[r, i] * scale


_NO_WEIGHT = numpy.zeros(0, F32)


def rms_norm(x: Any, weight: Any | None, eps: float) -> numpy.ndarray:
    """ggml_rms_norm(x, eps) over the last axis, then ggml_mul by ``weight`` (None: no weight).

    The same in ggml's fused rms_norm+mul kernel and in the two ops apart: x*scale, then *w.
    """
    a = _rows(x)
    w = _NO_WEIGHT if weight is None else numpy.ascontiguousarray(weight, dtype=F32).reshape(-1)
    if weight is not None and w.shape[0] != a.shape[1]:
        raise ValueError(f"rms_norm: weight of {w.shape[0]} for rows of {a.shape[1]}")
    out = numpy.empty_like(a)
    _rms_norm_rows(a, w, F32(eps), out)
    return out.reshape(numpy.shape(x))


# --- RoPE ---------------------------------------------------------------------------------------


@njit
def _theta_scale(base: float, n_dims: int) -> float:
    return _powf(base, F32(-2.0) / F32(n_dims))


def theta_scale(base: float, n_dims: int) -> numpy.float32:
    """ggml_compute_forward_rope_flt's powf(freq_base, -2.0f/n_dims), with glibc's powf."""
    return F32(_theta_scale(F32(base), int(n_dims)))


@njit
def _rope_cache(
    positions: numpy.ndarray,
    half: int,
    step: float,
    freq_scale: float,
    factors: numpy.ndarray,
    mscale: float,
    cos: numpy.ndarray,
    sin: numpy.ndarray,
) -> None:
    for r in range(positions.shape[0]):
        theta = numpy.float32(positions[r])
        for i in range(half):
            s, c = _sincosf(freq_scale * (theta / factors[i]))
            cos[r, i] = c * mscale
            sin[r, i] = s * mscale
            theta = theta * step


def rope_cos_sin(
    positions: Any,
    n_dims: int,
    base: float,
    freq_scale: float = 1.0,
    freq_factors: Any | None = None,
    mscale: float = 1.0,
) -> tuple[numpy.ndarray, numpy.ndarray]:
    """cos, sin [n, n_dims/2] per position, as ggml_rope_cache_init with ext_factor 0.

    theta starts at the position (as float), is divided by the Llama 3 frequency factor when
    there is one, multiplied by ``freq_scale``, and goes through sincosf; each step multiplies
    theta by ``theta_scale(base, n_dims)``. ``mscale`` is ggml's attn_factor (1 unless YaRN).
    """
    half = int(n_dims) // 2
    pos = numpy.ascontiguousarray(positions, dtype=numpy.int64).reshape(-1)
    if freq_factors is None:
        factors = numpy.ones(half, F32)  # theta / 1.0f is theta: what ggml computes without them
    else:
        factors = numpy.ascontiguousarray(freq_factors, dtype=F32).reshape(-1)
        if factors.shape[0] < half:
            raise ValueError(f"rope: {factors.shape[0]} frequency factors for {half} pairs")
    cos = numpy.empty((pos.shape[0], half), F32)
    sin = numpy.empty((pos.shape[0], half), F32)
    _rope_cache(
        pos, half, theta_scale(base, n_dims), F32(freq_scale), factors, F32(mscale), cos, sin
    )
    return cos, sin


@njit
def _rope_rows(
    x: numpy.ndarray,
    cos: numpy.ndarray,
    sin: numpy.ndarray,
    neox: bool,
    fused_pairs: int,
    out: numpy.ndarray,
) -> None:
    n, heads, hd = x.shape
    half = cos.shape[1]
    for t in range(n):
        for h in range(heads):
            for i in range(half):
                c = cos[t, i]
                s = sin[t, i]
                if neox:
                    a, b = i, i + half
                else:
                    a, b = 2 * i, 2 * i + 1
                x0 = x[t, h, a]
                x1 = x[t, h, b]
                if i < fused_pairs:
                    out[t, h, a] = fma32(x0, c, -(x1 * s))
                    out[t, h, b] = fma32(x0, s, x1 * c)
                else:
                    out[t, h, a] = x0 * c - x1 * s
                    out[t, h, b] = x0 * s + x1 * c
            for i in range(2 * half, hd):  # channels beyond n_dims pass through
                out[t, h, i] = x[t, h, i]


@njit
def _norm_fused_pairs(pairs: int) -> int:
    """How many NORM pairs GCC's vectorised loop fuses (it leaves an odd last pair unfused)."""
    return pairs - pairs % 2


def apply_rope(x: Any, cos: numpy.ndarray, sin: numpy.ndarray, neox: bool) -> numpy.ndarray:
    """x [n, heads, head_dim] rotated as ggml_rope_ext (rotate_pairs) with ``rope_cos_sin``'s table.

    NEOX pairs (i, i + n_dims/2), NORM pairs (2i, 2i + 1). Checked both with ggml's source and
    destination apart and in place (ggml_rope_ext_inplace): both take the same fused path.
    """
    a = numpy.ascontiguousarray(x, dtype=F32)
    if (
        a.ndim != 3
        or cos.shape != sin.shape
        or cos.shape[0] != a.shape[0]
        or 2 * cos.shape[1] > a.shape[2]
    ):
        raise ValueError(f"rope: x {a.shape} with a table of {cos.shape}")
    pairs = cos.shape[1]
    fused = pairs if neox else _norm_fused_pairs(pairs)
    out = numpy.empty_like(a)
    _rope_rows(
        a,
        numpy.ascontiguousarray(cos, dtype=F32),
        numpy.ascontiguousarray(sin, dtype=F32),
        bool(neox),
        fused,
        out,
    )
    return out


# --- GELU (GeGLU) -------------------------------------------------------------------------------

_GELU_COEF_A = F32(0.044715)
_SQRT_2_OVER_PI = F32(0.79788456080286535587989211986876)
_HALF = F32(0.5)


@njit
def _gelu_f32(x: numpy.ndarray, out: numpy.ndarray) -> None:
    """ggml_gelu_f32 as GCC compiles it in ggml-cpu.c:
    (0.5x)·(1 + tanhf((√(2/π)x)·fma(0.044715x, x, 1)))."""
    for i in range(x.shape[0]):
        v = x[i]
        inner = (_SQRT_2_OVER_PI * v) * fma32(_GELU_COEF_A * v, v, _ONE)
        out[i] = (_tanhf(inner) + _ONE) * (_HALF * v)


def gelu_f16_table() -> numpy.ndarray:
    """ggml_table_gelu_f16 as float32 [65536]: GELU of every f16 bit pattern, rounded to f16."""
    bits = numpy.arange(1 << 16, dtype=numpy.uint32).astype(numpy.uint16)
    x = bits.view(numpy.float16).astype(F32)
    y = numpy.empty_like(x)
    _gelu_f32(x, y)
    with numpy.errstate(over="ignore", invalid="ignore"):
        return y.astype(numpy.float16).astype(F32)


@njit
def _geglu_rows(
    gate: numpy.ndarray, up: numpy.ndarray, table: numpy.ndarray, out: numpy.ndarray
) -> None:
    rows, n = gate.shape
    for r in range(rows):
        for i in range(n):
            v = gate[r, i]
            if v <= F32(-10.0):
                out[r, i] = _ZERO
            elif v >= F32(10.0):
                out[r, i] = v * up[r, i]
            else:
                out[r, i] = table[f16_bits(v)] * up[r, i]


def geglu(gate: Any, up: Any, table: numpy.ndarray) -> numpy.ndarray:
    """ggml_geglu_split(gate, up) as ggml_vec_geglu_f32 with ``gelu_f16_table()``."""
    g, u = _rows(gate), _rows(up)
    if g.shape != u.shape:
        raise ValueError(f"geglu: gate {numpy.shape(gate)} and up {numpy.shape(up)} differ")
    out = numpy.empty_like(g)
    _geglu_rows(g, u, table, out)
    return out.reshape(numpy.shape(gate))


# --- libm's expf over arrays --------------------------------------------------------------------


@njit
def _expf_flat(x: numpy.ndarray, out: numpy.ndarray) -> None:
    for i in range(x.shape[0]):
        out[i] = _expf(x[i])


def expf(x: Any) -> numpy.ndarray:
    """glibc's expf of each element: the scalar exp of ggml's flash attention (``expf(s - M)``)
    and of the SiLU tail. NumPy's own float32 exp differs from it in the last bit on about a
    third of random inputs."""
    a = numpy.ascontiguousarray(x, dtype=F32)
    out = numpy.empty_like(a)
    _expf_flat(a.reshape(-1), out.reshape(-1))
    return out


@njit
def _logf_flat(x: numpy.ndarray, out: numpy.ndarray) -> None:
    for i in range(x.shape[0]):
        out[i] = _logf(x[i])


def logf(x: Any) -> numpy.ndarray:
    """glibc's logf of each element (llama.cpp's samplers and llama-server's logprobs). NumPy's
    float32 log differs from it in the last bit on about a fifth of random inputs, a log in
    double rounded to float on about one in a hundred."""
    a = numpy.ascontiguousarray(x, dtype=F32)
    out = numpy.empty_like(a)
    _logf_flat(a.reshape(-1), out.reshape(-1))
    return out


# --- scalars ------------------------------------------------------------------------------------


def attn_scale(d: int) -> numpy.float32:
    """1.0f/sqrtf(float(d)), as llama.cpp builds kq_scale (two float roundings, not one)."""
    return F32(1) / numpy.sqrt(F32(d))


# --- the KV cache's Hadamard rotation -------------------------------------------------------------


@njit
def _first_three_stages(x: numpy.ndarray, r: int, i: int, scale: float, out: numpy.ndarray) -> None:
    """Scale x[r, i:i+8] and run the butterflies of strides 1, 2 and 4 on it in registers: the
    same operations on the same values as stage by stage, twice as fast as three passes."""
    a0, a1, a2, a3 = x[r, i] * scale, x[r, i + 1] * scale, x[r, i + 2] * scale, x[r, i + 3] * scale
    a4, a5 = x[r, i + 4] * scale, x[r, i + 5] * scale
    a6, a7 = x[r, i + 6] * scale, x[r, i + 7] * scale
    b0, b1, b2, b3 = a0 + a1, a0 - a1, a2 + a3, a2 - a3
    b4, b5, b6, b7 = a4 + a5, a4 - a5, a6 + a7, a6 - a7
    c0, c1, c2, c3 = b0 + b2, b1 + b3, b0 - b2, b1 - b3
    c4, c5, c6, c7 = b4 + b6, b5 + b7, b4 - b6, b5 - b7
    out[r, i], out[r, i + 1], out[r, i + 2], out[r, i + 3] = c0 + c4, c1 + c5, c2 + c6, c3 + c7
    out[r, i + 4], out[r, i + 5], out[r, i + 6], out[r, i + 7] = c0 - c4, c1 - c5, c2 - c6, c3 - c7


@njit
def _fwht_rows(x: numpy.ndarray, scale: float, out: numpy.ndarray) -> None:
    """ggml_compute_forward_fwht on each row of x [rows, n]: scale first, then the butterflies
    (u + v, u - v) from stride 1 up. Its AVX2 passes (strides >= 8) write u - v as
    fma(v, -1, u), which rounds exactly as u - v, so plain loops give the same bits."""
    n = x.shape[1]
    for r in range(x.shape[0]):
        if n >= 8:
            for i in range(0, n, 8):
                _first_three_stages(x, r, i, scale, out)
            length = 8
        else:
            for j in range(n):
                out[r, j] = x[r, j] * scale
            length = 1
        while length < n:
            for i in range(0, n, 2 * length):
                for j in range(i, i + length):
                    u = out[r, j]
                    v = out[r, j + length]
                    out[r, j] = u + v
                    out[r, j + length] = u - v
            length *= 2


def fwht(x: Any, n: int) -> numpy.ndarray:
    """``llama_mul_mat_hadamard(x, H_n)`` as llama-server's CPU backend computes it: every n
    consecutive values of x (n a power of two dividing its last axis) times the orthonormal
    n x n Walsh-Hadamard matrix. The product carries GGML_HINT_SRC0_IS_HADAMARD, so ggml runs a
    fast transform (``ggml_compute_forward_fwht``: x * (1/sqrtf(n)), then log2(n) add/subtract
    stages) whose rounding differs from a matrix product's. The transform is its own inverse up
    to rounding (H @ H = I)."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"the Hadamard size must be a power of two, not {n}")
    a = numpy.ascontiguousarray(x, dtype=F32)
    if a.ndim == 0 or a.shape[-1] % n:
        width = a.shape[-1] if a.ndim else 0
        raise ValueError(f"rows of {width} values do not split in blocks of {n}")
    out = numpy.empty_like(a)
    _fwht_rows(a.reshape(-1, n), F32(1) / numpy.sqrt(F32(n)), out.reshape(-1, n))
    return out
