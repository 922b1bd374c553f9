"""Embeddings from hidden states, as llama.cpp pools them and llama-server normalises them.

A model that embeds gives ``hidden_states(tokens)``: float32 [n_tokens, n_embd], llama.cpp's
``t_embd`` (a decoder's hidden states after the output norm; an encoder's last layer). Two
steps turn them into what llama-server sends, bit for bit:

- ``pool(hidden, pooling)``: ``build_pooling`` (src/llama-graph.cpp) for one sequence alone in
  its micro-batch: ``none`` keeps every row; ``cls`` the first row, ``last`` the last (a
  ``get_rows``: the bits as they are); ``mean`` is the product of the transposed rows and a
  column of ``1/n`` (``float(1.0f/float(n))``), which ggml's CPU computes for one column with
  ``ggml_vec_dot_f32``: AVX2's four accumulators of eight lanes (fma over steps of 32 tokens),
  GGML_F32x8_REDUCE, then the tail tokens in order (``sumf += x*y``), as the build compiles
  that loop: the products of each whole group of four tail tokens rounded first (vmulps) and
  added one by one, the last ``tail % 4`` each one fma (checked against llama-server for
  inputs of 2 to 100 tokens, tails of 0, 1, 2, 4, 8, 16, 19 and 31);
  ``rank`` (a classification head) is not pooled here. A sequence pooled beside others in
  its micro-batch (llama-server ``-np N``: Engine.pooled_together) is one column of a product
  of two or more, which ggml gives to llamafile's tinyBLAS<8> (f32, AVX2): one accumulator of
  eight lanes, one fma per row into lane ``row mod 8`` (the other sequences' rows add
  ``x·0``), then hsum: ((l4+l0) + (l6+l2)) + ((l5+l1) + (l7+l3)). The sum does not depend on
  the row the sequence starts at (a shift of the lanes swaps terms of hsum's additions
  only), so ``mean_rows(..., beside_others=True)`` counts from the sequence's first row;
- ``normalize(vec, embd_normalize)``: common_embd_normalize (common/common.cpp): -1 none,
  0 max-abs scaled to int16 (/32760), 1 taxicab, 2 euclidean (llama-server's default), >2 the
  p-norm; sums in double (euclidean adds each float32 square), the factor ``1/sum`` rounded to
  float32, each element multiplied by it in float32.

Pure NumPy, with two compiled loops (the vec_dot and tinyBLAS's lanes) through kernels.jit.
"""

from __future__ import annotations

import math

import numpy

from bankml.engine_cupy.kernels.jit import fma32, njit

__all__ = ["POOLING_TYPES", "pool", "normalize", "mean_rows", "pooling_name"]

F32 = numpy.float32

# llama.cpp's enum llama_pooling_type (GGUF's <arch>.pooling_type holds the number)
POOLING_TYPES = {0: "none", 1: "mean", 2: "cls", 3: "last", 4: "rank"}


def pooling_name(value: int | str | None) -> str:
    """A GGUF pooling type (its number) or a --pooling name, as a name; None: ``none``."""
    if value is None:
        return "none"
    if isinstance(value, str):
        if value not in POOLING_TYPES.values():
            raise ValueError(f"unknown pooling type {value!r}")
        return value
    if int(value) not in POOLING_TYPES:
        raise ValueError(f"unknown pooling type {value}")
    return POOLING_TYPES[int(value)]


@njit
def _vec_dot_mean(x, w, out):  # pragma: no cover - compiled
    """out[e] = ggml_vec_dot_f32(n, x[:, e], w) with w constant (AVX2: GGML_F32_STEP 32,
    GGML_F32_EPR 8, four accumulators)."""
    n, d = x.shape
    np_ = n & ~31
    for e in range(d):
        acc = numpy.zeros((4, 8), numpy.float32)
        for i in range(0, np_, 32):
            for j in range(4):
                for lane in range(8):
                    acc[j, lane] = fma32(x[i + j * 8 + lane, e], w, acc[j, lane])
        y = numpy.empty(8, numpy.float32)
        for lane in range(8):
            y[lane] = (acc[0, lane] + acc[2, lane]) + (acc[1, lane] + acc[3, lane])
        t0 = y[0] + y[4]
        t1 = y[1] + y[5]
        t2 = y[2] + y[6]
        t3 = y[3] + y[7]
        s = numpy.float32((t0 + t1) + (t2 + t3))
        m = np_ + ((n - np_) // 4) * 4
        for i in range(np_, m):  # the compiler's vmulps over four tail products, added in turn
            p = x[i, e] * w
            s = s + p
        for i in range(m, n):  # its scalar epilogue: one vfmadd each
            s = fma32(x[i, e], w, s)
        out[e] = s


@njit
def _tinyblas_mean(x, w, out):  # pragma: no cover - compiled
    """out[e] = tinyBLAS<8>'s dot of x[:, e] and a column of w (see the module doc)."""
    n, d = x.shape
    acc = numpy.empty(8, numpy.float32)
    for e in range(d):
        acc[:] = 0
        for i in range(n):
            acc[i & 7] = fma32(x[i, e], w, acc[i & 7])
        out[e] = ((acc[4] + acc[0]) + (acc[6] + acc[2])) + ((acc[5] + acc[1]) + (acc[7] + acc[3]))


def mean_rows(hidden: numpy.ndarray, beside_others: bool = False) -> numpy.ndarray:
    """llama.cpp's mean pooling of one sequence: [n, d] -> [d]; alone in its micro-batch (the
    vec_dot), or ``beside_others`` (tinyBLAS's lanes)."""
    x = numpy.ascontiguousarray(hidden, dtype=F32)
    w = F32(F32(1.0) / F32(x.shape[0]))
    out = numpy.empty(x.shape[1], F32)
    (_tinyblas_mean if beside_others else _vec_dot_mean)(x, w, out)
    return out


def pool(hidden: numpy.ndarray, pooling: str, beside_others: bool = False) -> numpy.ndarray:
    """[n, d] hidden states -> [n, d] (``none``) or [1, d] (mean, cls, last); ``mean`` pooled
    ``beside_others`` in its micro-batch or alone (``mean_rows``)."""
    if hidden.shape[0] == 0:
        raise ValueError("no token to pool")
    if pooling == "none":
        return hidden
    if pooling == "mean":
        return mean_rows(hidden, beside_others)[None, :]
    if pooling == "cls":
        return hidden[:1].copy()
    if pooling == "last":
        return hidden[-1:].copy()
    raise ValueError(f"pooling {pooling!r} is not served")


def _c_pow(x: float, y: float) -> float:
    """C's ``pow`` where Python's raises: an overflow is infinity, zero to a negative power
    infinity, anything else undefined NaN (a sum of NaN or infinity then scales by 0)."""
    try:
        return math.pow(x, y)
    except OverflowError:
        return math.inf
    except ValueError:
        return math.inf if x == 0.0 and y < 0 else math.nan


def normalize(vec: numpy.ndarray, embd_normalize: int) -> numpy.ndarray:
    """common_embd_normalize of one float32 vector (see the module doc)."""
    v = numpy.asarray(vec, dtype=F32)
    if embd_normalize == -1:
        total = 1.0
    elif embd_normalize == 0:
        total = 0.0
        for a in numpy.abs(v).tolist():
            if total < a:
                total = a
        total /= 32760.0
    elif embd_normalize == 2:
        total = 0.0
        for sq in (v * v).tolist():  # each square a float32, added in double in order
            total += sq
        total = math.sqrt(total)
    else:
        total = 0.0
        p = float(embd_normalize)
        for a in numpy.abs(v).tolist():
            total += _c_pow(a, p)
        total = _c_pow(total, 1.0 / p)
    norm = F32(1.0 / total) if total > 0.0 else F32(0.0)
    return v * norm
