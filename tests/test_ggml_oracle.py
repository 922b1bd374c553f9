"""The ggml kernel oracle itself: its answers agree with plain arithmetic where that is exact enough."""

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import quants

from tests import ggml_oracle as go


def test_f32_product_matches_float64_within_rounding() -> None:
    rng = np.random.default_rng(1)
    w = rng.standard_normal((40, 96)).astype(np.float32)
    x = rng.standard_normal((5, 96)).astype(np.float32)
    got = go.mul_mat(w.view(np.uint8), T.F32, 40, 96, x)
    want = x.astype(np.float64) @ w.astype(np.float64).T
    assert got.shape == (5, 40)
    assert np.abs(got - want).max() < 1e-4


def test_q8_0_rows_dequantize_near_the_input() -> None:
    x = np.random.default_rng(2).standard_normal((3, 64)).astype(np.float32)
    raw = go.quantize_rows(x, T.Q8_0)
    back = quants.dequantize(raw, T.Q8_0).reshape(3, 64)
    assert np.abs(back - x).max() <= np.abs(x).max() / 127


def test_rms_norm_and_shapes_follow_numpy_order() -> None:
    x = np.random.default_rng(3).standard_normal((4, 32)).astype(np.float32)
    got = go.rms_norm(x, 1e-5)
    want = x / np.sqrt((x.astype(np.float64) ** 2).mean(axis=1, keepdims=True) + 1e-5)
    assert np.abs(got - want).max() < 1e-5


def test_an_unknown_op_is_an_error() -> None:
    try:
        go.run("no_such_op", [])
    except RuntimeError as e:
        assert "unknown op" in str(e)
    else:
        raise AssertionError("no error")


def test_fused_rms_norm_mul_is_the_norm_times_the_weight() -> None:
    rng = np.random.default_rng(4)
    x = rng.standard_normal((4, 32)).astype(np.float32)
    w = rng.standard_normal(32).astype(np.float32)
    assert np.abs(go.rms_norm_mul(x, w, 1e-5) - go.rms_norm(x, 1e-5) * w).max() < 1e-5
