"""The prefill's kernels in the strict CuPy stand-in (tests/fake_cupy_kernels.py): each launch's
geometry checked, then its twin (bankml/engine_cupy/device_prefill_twins.py) computed into the
output arrays; and ``PrefillCupy``, the stand-in whose ``matmul`` is the cuBLAS product's twin,
recorded in ``launches`` as ("gemm", (n, m, k), ()) beside the kernels."""

from __future__ import annotations

from typing import Any

import numpy

from bankml.engine_cupy import device_prefill_twins as pt
from bankml.engine_cupy import device_twins as dt
from bankml.engine_cupy.cuda_twins import BLOCK_TYPES
from tests.fake_cupy import DeviceArray

F16 = numpy.float16


def _covers(grid: tuple, n: int, block: tuple, rows: int | None = None) -> None:
    assert len(block) == 1 and block[0] % 32 == 0
    assert grid[0] * block[0] >= n > (grid[0] - 1) * block[0], (grid, block, n)
    assert grid[1:] == (() if rows is None else (rows,)), (grid, rows)


def run(name: str, grid: tuple, block: tuple, a: list[Any]) -> bool:  # noqa: C901
    """The twin of a prefill kernel on the launch's (unwrapped) arguments; False: not one."""
    if name.startswith("dequantize_f16_"):
        w, dst, n = a
        qtype = name.removeprefix("dequantize_f16_").upper()
        bt = BLOCK_TYPES[qtype]
        _covers(grid, int(n), block)
        assert int(n) == w.shape[0] * w.shape[1] // bt.block_bytes * bt.values <= dst.size
        dst[: int(n)] = pt.dequantize_f16(qtype, w).view(numpy.uint16).reshape(-1)
    elif name in ("get_rows_q8_0_n", "get_rows_f32_n"):
        w, ids, dst, ncols = a
        rows, d = dst.shape
        _covers(grid, int(ncols), block, rows)
        assert d == int(ncols) and ids.shape == (rows,)
        for r, token in enumerate(ids.tolist()):
            if name == "get_rows_q8_0_n":
                dst[r] = dt.get_rows_q8_0(w, token, d)
            else:
                dst[r] = w.reshape(-1, d)[token]
    elif name == "add_rms_norm_f16":
        x, delta, has_delta, weight, y, n, eps = a
        assert block == (dt.NORM_THREADS,) and grid == (x.shape[0],) and x.shape[1] == int(n)
        assert delta.shape == y.shape == x.shape and weight.size == int(n)
        new_x, y16 = pt.add_rms_norm_f16(
            x, delta.view(F16) if has_delta else None, weight, float(eps)
        )
        x[:] = new_x
        y[:] = y16.view(numpy.uint16)
    elif name == "rope_kv_f16_n":
        q, k, v, bias, has_bias, pos, cos, sin, q_out, kc, vc, nh, nkv, hd, n_ctx, neox = a
        rows = q.shape[0]
        nq, nk = int(nh) * int(hd), int(nkv) * int(hd)
        _covers(grid, (nq + nk) // 2 + nk, block, rows)
        assert q.shape == q_out.shape == (rows, nq) and k.shape == v.shape == (rows, nk)
        assert kc.shape == vc.shape == (int(nkv), int(n_ctx), int(hd))
        assert int(pos[0]) + rows <= int(n_ctx)
        q_out[:] = pt.rope_kv_f16_n(
            q.view(F16),
            k.view(F16),
            v.view(F16),
            bias if has_bias else None,
            int(pos[0]),
            cos,
            sin,
            kc.view(F16),
            vc.view(F16),
            int(hd),
            bool(neox),
        ).view(numpy.uint16)
    elif name == "attn_prefill_f16":
        q, kc, vc, pos, scores, out, nh, nkv, hd, n_ctx, scale = a
        rows = q.shape[0]
        assert grid == (int(nh), rows) and block == (dt.ATTN_WARPS * 32,)
        assert int(hd) % 32 == 0 and int(nh) % int(nkv) == 0 and out.shape == q.shape
        assert scores.shape == (rows, int(nh), int(n_ctx))
        assert int(pos[0]) + rows <= int(n_ctx)
        scores[:] = numpy.nan  # scratch: not kept
        out[:] = pt.attn_prefill_f16(
            q.view(F16), kc.view(F16), vc.view(F16), int(pos[0]), int(nh), float(scale)
        ).view(numpy.uint16)
    elif name == "swiglu_f16":
        gate, up, y, n = a
        _covers(grid, int(n), block)
        assert gate.size == up.size == y.size == int(n)
        y.reshape(-1)[:] = (
            pt.swiglu_f16(gate.view(F16), up.view(F16)).reshape(-1).view(numpy.uint16)
        )
    elif name == "advance_pos":
        pos, by = a
        assert grid == (1,)
        pos[0] += int(by)
    else:
        return False
    return True


def matmul(fake: Any, a: Any, b: Any, out: Any = None) -> Any:
    """cupy.matmul as the prefill calls it: f16 rows [n, k] times a transposed f16 matrix
    [k, m] into f16 [n, m]; the twin's product; recorded as a launch."""
    assert (
        isinstance(a, DeviceArray) and isinstance(b, DeviceArray) and isinstance(out, DeviceArray)
    )
    av, bv, ov = a.host_view, b.host_view, out.host_view
    assert av.dtype == bv.dtype == ov.dtype == F16, (av.dtype, bv.dtype, ov.dtype)
    assert av.ndim == bv.ndim == 2 and ov.shape == (av.shape[0], bv.shape[1])
    assert av.shape[1] == bv.shape[0] and ov.flags.c_contiguous
    fake.launches.append(("gemm", (av.shape[0], bv.shape[1], av.shape[1]), ()))
    ov[...] = pt.gemm_f16(av, bv.T)
    return out
