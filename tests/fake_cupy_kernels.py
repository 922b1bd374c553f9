"""The strict CuPy stand-in (tests/fake_cupy.py) with the engine's CUDA kernels: a
``RawModule`` whose kernels are the NumPy twins, and the counts a decode step is held to.

``KernelCupy`` is ``fake_cupy.FakeCupy`` (CuPy's rules at the host boundary: no implicit
conversion, no host operand in a device operation) plus:

- ``RawModule(code=..., options=...)``: each ``get_function(name)`` parses the entry point's
  parameter list out of the CUDA source it was given and checks every launch against it (the
  count, a device array of the pointer's element type for each pointer, numpy.int32 or
  numpy.float32 for each int or float), checks the geometry each kernel expects, then computes
  the twin's result into the output arrays (cuda_twins, device_twins);
- ``matmul``: the prefill's cuBLAS product (f16 operands, f16 out) through its twin
  (tests/fake_cupy_prefill.py, which also runs the prefill's kernels' twins);
- ``launches``: every launch, (name, grid, block), in order, the products as ("gemm", ...);
- ``cuda.runtime.memGetInfo`` (``free``/``total`` set by the test), ``getDeviceCount``, and
  ``cuda.Device().synchronize()``, counted with the reads in ``fake_cupy.READS``;
- with ``graphs=True``, CuPy's stream capture: ``cuda.Stream`` (a context manager making it
  the current stream; ``begin_capture``/``end_capture``), ``cuda.get_current_stream`` and the
  ``Graph`` that ``end_capture`` returns. While a stream captures, a launch on it is checked
  as any launch and recorded, not run (its device arrays are views of the buffers, its scalars
  the values it was given, as a CUDA graph's kernel nodes hold them); a launch on another
  stream, a copy between host and device or a synchronize is an error, as on a GPU.
  ``Graph.launch`` appends one ("graph", (nodes,), ()) to ``launches`` and runs the recorded
  launches through the twins in order, reading the buffers' values at that time. Without
  ``graphs`` the module has no ``cuda.Stream``: a CuPy without capture.

So a test can run the device step through the twins, compare it with the CPU's exact path,
and count per step the launches and every host read of a device value.
"""

from __future__ import annotations

import re
import types
from typing import Any

import numpy

from bankml.engine_cupy import cuda_twins as tw
from bankml.engine_cupy import device_twins as dt
from tests import fake_cupy_prefill
from tests.fake_cupy import CAPTURING, READS, DeviceArray, FakeCupy

_POINTER_TYPES = {
    "float": numpy.float32,
    "int": numpy.int32,
    "u16": numpy.uint16,
    "u8": numpy.uint8,
    "block_q8_1": numpy.uint8,
}


def signature(code: str, name: str) -> list[tuple[str, bool]]:
    """The entry point's parameters as (base type, is a pointer), from its source (the
    product and dequantization kernels' through their macro's definition)."""
    macro = re.search(rf"\b(\w+)\(\s*{name}\s*,", code)
    if macro:  # the macro's own definition, its first parameter the entry point's name
        lines = code.replace("\\\n", " ")
        define = re.search(rf"#define {macro.group(1)}\((\w+)[^)]*\)(.*)", lines)
        assert define, f"no definition of {macro.group(1)}"
        code, name = define.group(2), define.group(1)
    match = re.search(rf"\b{name}\s*\(([^)]*)\)\s*{{", code)
    assert match and 'extern "C"' in code, f"no entry point {name} in the source"
    params = []
    for param in match.group(1).split(","):
        words = param.replace("*", " * ").replace("__restrict__", "").replace("const", "").split()
        params.append((words[0], "*" in words))
    return params


def q8_of(raw: numpy.ndarray) -> tw.Q8_1:
    """q8_1 blocks read back from their bytes (36 each: f16 d, f16 s, 32 int8)."""
    b = raw.reshape(-1, 36)
    d = numpy.ascontiguousarray(b[:, 0:2]).view("<f2")[:, 0]
    s = numpy.ascontiguousarray(b[:, 2:4]).view("<f2")[:, 0]
    return tw.Q8_1(numpy.ascontiguousarray(b[:, 4:]).view(numpy.int8), d, s)


def _covers(grid: tuple, block: tuple, n: int) -> None:
    assert len(grid) == 1 and len(block) == 1 and block[0] % 32 == 0
    assert grid[0] * block[0] >= n > (grid[0] - 1) * block[0], (grid, block, n)


def _run_rows(name: str, grid: tuple, block: tuple, a: list[Any]) -> bool:  # noqa: C901
    """The batched step's kernels (``*_rows``): each row through its one-row twin, on the
    row's slices and its slot's state, as the kernel's row r does. False: not one of them."""
    if name.startswith("mmvq_") and name.endswith("_rows"):
        w, y, dst, ncols, nrows_y = a
        qtype = name.removeprefix("mmvq_").removesuffix("_rows").upper()
        bt, n, rows = tw.BLOCK_TYPES[qtype], int(nrows_y), w.shape[0]
        assert block == (32, tw.NWARPS) and grid == (rows,) and 1 <= n <= 8
        assert w.flags.c_contiguous and w.shape[1] == int(ncols) // bt.values * bt.block_bytes
        per_row = int(ncols) // 32 * 36
        assert y.size >= n * per_row and dst.size >= n * rows
        ys = [q8_of(y[j * per_row : (j + 1) * per_row]) for j in range(n)]
        dst[: n * rows] = tw.mmvq_rows(qtype, w, ys).reshape(-1)
    elif name == "rms_norm_q8_1_rows":
        x, delta, has_delta, weight, y, n, eps = a
        m = int(n)
        assert len(grid) == 1 and block == (dt.NORM_THREADS,) and weight.size == m
        for r in range(grid[0]):
            xr = x[r * m : (r + 1) * m]
            new_x, q8 = dt.rms_norm_q8_1(
                xr, delta[r * m : (r + 1) * m] if has_delta else None, weight, float(eps)
            )
            xr[:] = new_x
            y[r * (m // 32) * 36 : (r + 1) * (m // 32) * 36] = q8.to_bytes()
    elif name == "rope_kv_f16_rows":
        q, k, v, bias, has_bias, slots, pos, cos, sin, q_out, kp, vp = a[:12]
        il, n_layer, nh, nkv, hd, n_ctx, neox = (int(x) for x in a[12:])
        nq, nk = nh * hd, nkv * hd
        assert len(grid) == 2 and len(block) == 1
        _covers(grid[:1], block, (nq + nk) // 2 + nk)
        assert kp.shape == vp.shape and kp.shape[1:] == (n_layer, nkv, n_ctx, hd)
        assert not has_bias or bias.size == nq + 2 * nk
        for r in range(grid[1]):
            s = int(slots[r])
            q_out[r * nq : (r + 1) * nq] = dt.rope_kv_f16(
                q[r * nq : (r + 1) * nq],
                k[r * nk : (r + 1) * nk],
                v[r * nk : (r + 1) * nk],
                bias if has_bias else None,
                int(pos[s]),
                cos,
                sin,
                kp[s, il].view(numpy.float16),
                vp[s, il].view(numpy.float16),
                hd,
                bool(neox),
            )
    elif name == "attn_decode_f16_rows":
        q, kp, vp, slots, pos, scores, out = a[:7]
        il, n_layer, nh, nkv, hd, n_ctx = (int(x) for x in a[7:13])
        scale = a[13]
        assert len(grid) == 2 and grid[0] == nh and block == (dt.ATTN_WARPS * 32,)
        assert hd % 32 == 0 and hd <= dt.ATTN_MAX_HD and nh % nkv == 0
        assert scores.shape[1:] == (nh, n_ctx) and kp.shape[1:] == (n_layer, nkv, n_ctx, hd)
        per_row = nh * hd // 32 * 36
        for r in range(grid[1]):
            s = int(slots[r])
            p = int(pos[s])
            assert 0 <= p < n_ctx
            scores[s, :, : p + 1] = numpy.nan  # scratch: not kept
            out[r * per_row : (r + 1) * per_row] = dt.attn_decode_q8_1(
                q[r * nh * hd : (r + 1) * nh * hd],
                kp[s, il].view(numpy.float16),
                vp[s, il].view(numpy.float16),
                p,
                nh,
                float(scale),
            ).to_bytes()
    elif name == "swiglu_q8_1_rows":
        gate, up, y, n = a
        m = int(n)
        assert len(grid) == 2
        _covers(grid[:1], block, m)
        for r in range(grid[1]):
            y[r * (m // 32) * 36 : (r + 1) * (m // 32) * 36] = dt.swiglu_q8_1(
                gate[r * m : (r + 1) * m], up[r * m : (r + 1) * m]
            ).to_bytes()
    elif name == "argmax_f32_rows":
        x, n, slots, logits, token, pos = a
        m = int(n)
        assert len(grid) == 1 and block == (dt.ARGMAX_THREADS,) and logits.shape[1] == m
        for r in range(grid[0]):
            s = int(slots[r])
            logits[s] = x[r * m : (r + 1) * m]
            token[s] = dt.argmax_f32(x[r * m : (r + 1) * m])
            pos[s] += 1
    elif name in ("get_rows_q8_0_rows", "get_rows_f32_rows"):
        w, token, slots, dst, ncols = a
        m = int(ncols)
        assert len(grid) == 2
        _covers(grid[:1], block, m)
        for r in range(grid[1]):
            ident = int(token[int(slots[r])])
            if name == "get_rows_q8_0_rows":
                dst[r * m : (r + 1) * m] = dt.get_rows_q8_0(w, ident, m)
            else:
                dst[r * m : (r + 1) * m] = w.reshape(-1, m)[ident]
    else:
        return False
    return True


def _run(name: str, grid: tuple, block: tuple, a: list[Any]) -> None:  # noqa: C901
    """The twin of kernel ``name`` on the launch's (unwrapped) arguments."""
    if _run_rows(name, grid, block, a):
        return
    if name == "quantize_q8_1":
        x, y, n = a
        _covers(grid, block, int(n))
        y[:] = tw.quantize_q8_1(x[: int(n)]).to_bytes()
    elif name.startswith("mmvq_"):
        w, y, dst, ncols = a
        qtype = name.removeprefix("mmvq_").upper()
        bt = tw.BLOCK_TYPES[qtype]
        assert block == (32, tw.NWARPS) and grid == (w.shape[0],)
        assert w.flags.c_contiguous and w.shape[1] == int(ncols) // bt.values * bt.block_bytes
        assert dst.shape == (w.shape[0],) and y.size == int(ncols) // 32 * 36
        dst[:] = tw.mmvq(qtype, w, q8_of(y))
    elif name == "rms_norm_q8_1":
        x, delta, has_delta, weight, y, n, eps = a
        assert grid == (1,) and block == (dt.NORM_THREADS,)
        assert x.size == weight.size == int(n) and y.size == int(n) // 32 * 36
        new_x, q8 = dt.rms_norm_q8_1(x, delta if has_delta else None, weight, float(eps))
        x[:] = new_x
        y[:] = q8.to_bytes()
    elif name == "rope_kv_f16":
        q, k, v, bias, has_bias, pos, cos, sin, q_out, kc, vc, nh, nkv, hd, n_ctx, neox = a
        nq, nk = int(nh) * int(hd), int(nkv) * int(hd)
        _covers(grid, block, (nq + nk) // 2 + nk)
        assert q.size == q_out.size == nq and k.size == v.size == nk
        assert kc.shape == vc.shape == (int(nkv), int(n_ctx), int(hd))
        assert not has_bias or bias.size == nq + 2 * nk
        q_out[:] = dt.rope_kv_f16(
            q,
            k,
            v,
            bias if has_bias else None,
            int(pos[0]),
            cos,
            sin,
            kc.view(numpy.float16),
            vc.view(numpy.float16),
            int(hd),
            bool(neox),
        )
    elif name == "attn_decode_f16":
        q, kc, vc, pos, scores, out, nh, nkv, hd, n_ctx, scale = a
        assert grid == (int(nh),) and block == (dt.ATTN_WARPS * 32,)
        assert int(hd) % 32 == 0 and int(hd) <= dt.ATTN_MAX_HD and int(nh) % int(nkv) == 0
        assert scores.size >= int(nh) * int(n_ctx) and out.size == int(nh) * int(hd) // 32 * 36
        p = int(pos[0])
        assert 0 <= p < int(n_ctx)
        scores.reshape(int(nh), int(n_ctx))[:, : p + 1] = numpy.nan  # scratch: not kept
        out[:] = dt.attn_decode_q8_1(
            q, kc.view(numpy.float16), vc.view(numpy.float16), p, int(nh), float(scale)
        ).to_bytes()
    elif name == "swiglu_q8_1":
        gate, up, y, n = a
        _covers(grid, block, int(n))
        y[:] = dt.swiglu_q8_1(gate[: int(n)], up[: int(n)]).to_bytes()
    elif name == "argmax_f32":
        x, n, ident, pos = a
        assert grid == (1,) and block == (dt.ARGMAX_THREADS,)
        ident[0] = dt.argmax_f32(x[: int(n)])
        pos[0] += 1
    elif name == "top_k_f32":
        x, n, k, out = a
        assert grid == (1,) and block == (dt.TOPK_THREADS,)
        assert 0 < int(k) <= int(n) <= x.size and out.size >= 2 * int(k) + 1
        out[: 2 * int(k) + 1] = dt.top_k_f32(x[: int(n)], int(k))
    elif name == "get_rows_q8_0":
        w, ident, dst, ncols = a
        _covers(grid, block, int(ncols))
        dst[:] = dt.get_rows_q8_0(w, int(ident[0]), int(ncols))
    elif name == "get_rows_f32":
        w, ident, dst, ncols = a
        _covers(grid, block, int(ncols))
        dst[:] = w.reshape(-1, int(ncols))[int(ident[0])]
    elif not fake_cupy_prefill.run(name, grid, block, a):
        raise AssertionError(f"no twin for kernel {name}")


class FakeKernel:
    def __init__(self, fake: KernelCupy, name: str, code: str) -> None:
        self.fake, self.name = fake, name
        self.params = signature(code, name)

    def __call__(self, grid: tuple, block: tuple, args: tuple) -> None:
        recording = self.fake.recording()
        if recording is None:
            self.fake.launches.append((self.name, tuple(grid), tuple(block)))
        assert len(args) == len(self.params), (self.name, len(args), self.params)
        unwrapped = []
        for arg, (base, pointer) in zip(args, self.params):
            if pointer:
                assert isinstance(arg, DeviceArray), f"{self.name}: a host {type(arg)} for {base} *"
                assert arg.host_view.dtype == _POINTER_TYPES[base], (self.name, base, arg.dtype)
                assert arg.host_view.flags.c_contiguous
                unwrapped.append(arg.host_view)
            else:
                want = {"int": numpy.int32, "float": numpy.float32}[base]
                assert type(arg) is want, f"{self.name}: {type(arg)} for {base}"
                unwrapped.append(arg)
        if recording is not None:
            recording.append((self.name, tuple(grid), tuple(block), unwrapped))
            return
        _run(self.name, tuple(grid), tuple(block), unwrapped)


class FakeGraph:
    """``cupy.cuda.graph.Graph``: the launches a capture recorded (module doc)."""

    def __init__(self, fake: KernelCupy, nodes: list[tuple[str, tuple, tuple, list[Any]]]):
        self.fake, self.nodes = fake, nodes

    def launch(self, stream: Any = None) -> None:
        assert not CAPTURING, "a graph launched while a capture records"
        self.fake.launches.append(("graph", (len(self.nodes),), ()))
        for name, grid, block, args in self.nodes:
            _run(name, grid, block, args)


class FakeStream:
    """``cupy.cuda.Stream``: the current stream inside ``with``; stream capture."""

    def __init__(self, fake: KernelCupy, non_blocking: bool = False) -> None:
        self.fake, self.non_blocking = fake, non_blocking
        self.nodes: list[tuple[str, tuple, tuple, list[Any]]] | None = None

    def __enter__(self) -> FakeStream:
        self.fake.streams.append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        assert self.fake.streams.pop() is self

    def begin_capture(self, mode: Any = None) -> None:
        assert self.nodes is None and not CAPTURING, "a capture already under way"
        self.nodes = []
        CAPTURING.append(self)

    def is_capturing(self) -> bool:
        return self.nodes is not None

    def end_capture(self) -> FakeGraph:
        assert self.nodes is not None and len(CAPTURING) == 1 and CAPTURING[0] is self, (
            "no capture under way here"
        )
        CAPTURING.clear()
        nodes, self.nodes = self.nodes, None
        return FakeGraph(self.fake, nodes)


class _Runtime:
    def __init__(self, fake: KernelCupy) -> None:
        self.fake = fake

    def memGetInfo(self) -> tuple[int, int]:  # noqa: N802 (CuPy's name)
        return self.fake.free, self.fake.total

    @staticmethod
    def getDeviceCount() -> int:  # noqa: N802
        return 1


class _Device:
    def synchronize(self) -> None:
        assert not CAPTURING, "a synchronize while a capture records"
        READS["synchronize"] += 1


class KernelCupy(FakeCupy):
    """The strict stand-in with kernels (module doc)."""

    def __init__(self, free: int = 80 << 30, total: int = 80 << 30, graphs: bool = False) -> None:
        super().__init__()
        self.launches: list[tuple[str, tuple, tuple]] = []
        self.modules: list[tuple[str, tuple]] = []
        self.free, self.total = free, total
        self.streams: list[FakeStream] = []  # the ``with`` stack; the null stream below it
        self.cuda = types.SimpleNamespace(runtime=_Runtime(self), Device=_Device)
        if graphs:
            fake = self

            class Stream(FakeStream):
                def __init__(self, non_blocking: bool = False) -> None:
                    super().__init__(fake, non_blocking)

            self.cuda.Stream = Stream
            self.cuda.get_current_stream = self.current_stream
            self.cuda.graph = types.SimpleNamespace(Graph=FakeGraph)

    def current_stream(self) -> FakeStream | None:
        return self.streams[-1] if self.streams else None

    def recording(self) -> list[Any] | None:
        """Where a launch goes while a capture records (None: it runs): the capturing stream's
        record if it is the current stream; a launch on another stream is an error then."""
        if not CAPTURING:
            return None
        stream = self.current_stream()
        assert stream is CAPTURING[0], "a launch on another stream while a capture records"
        assert stream is not None and stream.nodes is not None
        return stream.nodes

    def matmul(self, a: Any, b: Any, out: Any = None) -> Any:
        """cuBLAS's f16 product as the prefill calls it (tests/fake_cupy_prefill.py)."""
        return fake_cupy_prefill.matmul(self, a, b, out)

    def RawModule(self, code: str, options: tuple = ()) -> Any:  # noqa: N802 (CuPy's name)
        assert not CAPTURING, "a module compiled or loaded while a capture records"
        self.modules.append((code, tuple(options)))
        fake = self

        class Module:
            def get_function(self, name: str) -> FakeKernel:
                return FakeKernel(fake, name, code)

        return Module()
