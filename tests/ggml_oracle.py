"""ggml's own kernels as a test oracle: one ggml op on the CPU backend of the reference build.

Import it as ``from tests import ggml_oracle as go`` (see tests/test_ggml_oracle.py).

``tests/oracle/ggml_op.c`` is compiled once against the static ggml libraries that
``scripts/build-llama-server.sh`` leaves in its build folder, so every figure compares with the
arithmetic of the very llama-server binary the end-to-end tests use. Arrays go in and come out in
NumPy order, the reverse of ggml's ``ne`` (a ggml tensor ``ne = [K, N]`` is a NumPy ``[N, K]``).

    mul_mat(raw, qtype, n_out, n_in, x)          weights as GGUF block bytes, x f32 [m, n_in]
    mul_mat_repacked(raw, qtype, n_out, n_in, x) the same with W in the CPU_REPACK buffer (llama-server's layers)
    quantize_rows(x, qtype)                      ggml's from_float of each row (the activation rounding)
    flash_attn_ext(q, k, v, mask, scale)         q [n_head, n_q, hd] f32, k/v [n_kv_head, n_kv, hd] f16
    rope_ext(x, positions, n_dims, mode, ...)    x [n, n_head, hd]
    fwht(x, n)                                   x [..., n*k] f32 turned in blocks of n (the KV cache's Hadamard rotation)
    set_rows(x, rows, n_rows, qtype)             x f32 [m, k] stored at ``rows`` of a zeroed [n_rows, k] cache of qtype
    unary(op, x) / binary(op, a, b) / rms_norm(x, eps) / rms_norm_mul(x, w, eps) / get_rows(raw, qtype, n_rows, k, ids) / cpy(x, qtype)
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import struct
import subprocess
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as T

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "oracle" / "ggml_op.c"
REPO = HERE.parent
I32 = 26  # GGML_TYPE_I32
NONE = -1


@lru_cache(maxsize=1)
def llama_root() -> Path:
    """The cache folder of the reference build (bin/, build/, src/llama.cpp)."""
    binary = (
        os.environ.get("BANKML_LLAMA_SERVER")
        or subprocess.run(
            [str(REPO / "scripts" / "build-llama-server.sh")],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    return Path(binary).resolve().parent.parent


def reference_tool(target: str) -> Path:
    """A llama.cpp program (e.g. llama-quantize) of the reference build's tree, built on first
    use: the build script configured the tree and built its libraries, so this takes seconds."""
    build = llama_root() / "build"
    out = build / "bin" / target
    if not out.exists():
        if not (build / "CMakeCache.txt").exists():
            raise RuntimeError(
                f"no configured llama.cpp build in {build}: run scripts/build-llama-server.sh"
            )
        with _exclusive(build / f".{target}.lock"):  # the suite's workers build it once
            if not out.exists():
                subprocess.run(
                    [
                        *("cmake", "--build", str(build), "--target", target),
                        *("-j", str(os.cpu_count() or 1)),
                    ],
                    check=True,
                    capture_output=True,
                )
    return out


@contextmanager
def _exclusive(path: Path) -> Iterator[None]:
    """An exclusive lock on ``path`` for the block: one process of the suite at a time."""
    with open(path, "ab") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


@lru_cache(maxsize=1)
def oracle_binary() -> Path:
    """Compile ggml_op.c once per source and library version; later calls reuse it."""
    return compile_against_ggml(SOURCE, "ggml-op")


def compile_against_ggml(source: Path, name: str) -> Path:
    """A C or C++ program linked with the reference build's static libraries, compiled once per
    source and library version under the build's cache (the oracle, bench/kquants.py's timer).
    A C++ source is also linked with llama.cpp's libllama and common (the schema converter's
    oracle)."""
    root = llama_root()
    build = root / "build"
    cxx = source.suffix == ".cpp"
    libs = [
        *(
            build / lib
            for lib in (
                "common/libllama-common.a",
                "common/libllama-common-base.a",
                "src/libllama.a",
            )
            if cxx
        ),
        *(build / "ggml" / "src" / lib for lib in ("libggml.a", "libggml-cpu.a", "libggml-base.a")),
    ]
    rpc = build / "ggml" / "src" / "ggml-rpc" / "libggml-rpc.a"  # libggml registers RPC's backend
    if rpc.exists():
        libs.insert(libs.index(build / "ggml" / "src" / "libggml.a") + 1, rpc)
    missing = [str(p) for p in libs if not p.exists()]
    if missing:
        raise RuntimeError(
            f"the reference build has no {missing}: run scripts/build-llama-server.sh"
        )
    digest = hashlib.sha256(source.read_bytes())
    for lib in libs:
        digest.update(str(lib.stat().st_mtime_ns).encode())
    out = root / name / digest.hexdigest()[:16] / name
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(f".{os.getpid()}.tmp")  # the suite's workers may both compile it
        src = root / "src" / "llama.cpp"
        includes = ["ggml/include", *(("common", "include", "vendor") if cxx else ())]
        subprocess.run(
            [
                "g++" if cxx else "gcc",
                *(["-std=c++17"] if cxx else []),
                "-O2",
                "-o",
                str(tmp),
                str(source),
                *(f"-I{src / inc}" for inc in includes),
                *map(str, libs),
                "-lstdc++",
                "-lm",
                "-fopenmp",
                "-lpthread",
            ],
            check=True,
        )
        tmp.replace(out)
    return out


def _input(qtype: int, ne: Sequence[int], data: bytes | None) -> bytes:
    ne4 = list(ne) + [1] * (4 - len(ne))
    if data is None:
        return struct.pack("<i4qq", NONE, 1, 1, 1, 1, 0)
    return struct.pack("<i4qq", qtype, *ne4, len(data)) + data


def _array_input(a: np.ndarray | None, qtype: int | None = None) -> bytes:
    if a is None:
        return _input(NONE, (), None)
    kinds = {np.dtype(np.float32): T.F32, np.dtype(np.float16): T.F16, np.dtype(np.int32): I32}
    qt = int(kinds[a.dtype] if qtype is None else qtype)
    return _input(qt, a.shape[::-1], np.ascontiguousarray(a).tobytes())


def run(
    op: str,
    inputs: Sequence[bytes],
    fp: Sequence[float] = (),
    ip: Sequence[int] = (),
    threads: int = 2,
) -> np.ndarray:
    """Run one op; the result as a NumPy array (f32/f16 by its type, raw uint8 rows otherwise)."""
    fp8 = list(fp) + [0.0] * (8 - len(fp))
    ip8 = list(ip) + [0] * (8 - len(ip))
    request = (
        op.encode().ljust(32, b"\0")
        + struct.pack("<i8f8ii", threads, *fp8, *ip8, len(inputs))
        + b"".join(inputs)
    )
    done = subprocess.run([str(oracle_binary())], input=request, capture_output=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(
            done.stderr.decode(errors="replace").strip() or f"ggml-op exit {done.returncode}"
        )
    head = struct.calcsize("<i4qq")
    qtype, n0, n1, n2, n3, nbytes = struct.unpack("<i4qq", done.stdout[:head])
    body = done.stdout[head : head + nbytes]
    shape = [n for n in (n3, n2, n1, n0)]
    if qtype == T.F32:
        return np.frombuffer(body, np.float32).reshape(shape).copy()
    if qtype == T.F16:
        return np.frombuffer(body, np.float16).reshape(shape).copy()
    rows = n1 * n2 * n3
    return np.frombuffer(body, np.uint8).reshape(rows, -1).copy()


def mul_mat(
    raw: np.ndarray, qtype: int, n_out: int, n_in: int, x: np.ndarray, threads: int = 2
) -> np.ndarray:
    """ggml_mul_mat(W, x): W as GGUF block bytes [n_out rows of n_in], x f32 [m, n_in] -> [m, n_out]."""
    w = _input(int(qtype), (n_in, n_out), np.ascontiguousarray(raw).tobytes())
    x = np.atleast_2d(np.asarray(x, np.float32))
    return run("mul_mat", [w, _array_input(x)], threads=threads).reshape(x.shape[0], n_out)


def mul_mat_repacked(
    raw: np.ndarray, qtype: int, n_out: int, n_in: int, x: np.ndarray, threads: int = 2
) -> np.ndarray:
    """mul_mat with W in the CPU_REPACK buffer, as llama-server loads layer weights (Q4_0 ->
    q4_0_8x8 on AVX2 when n_out % 8 == 0): ggml's repacked gemv/gemm kernels. Only for the
    types the AVX2 build repacks (ggml's repack buffer crashes on the others)."""
    if T(qtype) not in (T.Q4_0, T.IQ4_NL, T.Q4_K) or n_out % 8:
        raise ValueError(f"the AVX2 build does not repack {T(qtype).name} [{n_out}, {n_in}]")
    w = _input(int(qtype), (n_in, n_out), np.ascontiguousarray(raw).tobytes())
    x = np.atleast_2d(np.asarray(x, np.float32))
    return run("mul_mat_repacked", [w, _array_input(x)], threads=threads).reshape(x.shape[0], n_out)


def quantize_rows(x: np.ndarray, qtype: int) -> np.ndarray:
    """ggml's CPU from_float for each row of x (f32 [rows, k]) -> uint8 [rows, row bytes]."""
    x = np.atleast_2d(np.asarray(x, np.float32))
    return run("quantize", [_array_input(x)], ip=[int(qtype)])


def flash_attn_ext(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    mask: np.ndarray | None,
    scale: float,
    max_bias: float = 0.0,
    softcap: float = 0.0,
    threads: int = 2,
) -> np.ndarray:
    """q f32 [n_head, n_q, hd]; k, v f16 [n_kv_head, n_kv, hd]; mask f16 [n_q(padded), n_kv].

    Returns ggml's permuted result as NumPy [n_q, n_head, hd]."""
    return run(
        "flash_attn_ext",
        [
            _array_input(np.asarray(q, np.float32)),
            _array_input(k),
            _array_input(v),
            _array_input(mask),
        ],
        fp=[scale, max_bias, softcap],
        threads=threads,
    ).reshape(q.shape[1], q.shape[0], -1)


def rope_ext(
    x: np.ndarray,
    positions: np.ndarray,
    n_dims: int,
    mode: int,
    freq_base: float,
    freq_scale: float = 1.0,
    freq_factors: np.ndarray | None = None,
    n_ctx_orig: int = 0,
    ext_factor: float = 0.0,
    attn_factor: float = 1.0,
    beta_fast: float = 32.0,
    beta_slow: float = 1.0,
    threads: int = 2,
) -> np.ndarray:
    """x f32 [n, n_head, hd], positions int32 [n]; mode 0 (NORM) or 2 (NEOX)."""
    return run(
        "rope_ext",
        [
            _array_input(np.asarray(x, np.float32)),
            _array_input(np.asarray(positions, np.int32)),
            _array_input(None if freq_factors is None else np.asarray(freq_factors, np.float32)),
        ],
        fp=[freq_base, freq_scale, ext_factor, attn_factor, beta_fast, beta_slow],
        ip=[n_dims, mode, n_ctx_orig],
        threads=threads,
    ).reshape(np.shape(x))


def unary(op: str, x: np.ndarray, threads: int = 2) -> np.ndarray:
    """silu, gelu, tanh of f32 x."""
    return run(op, [_array_input(np.asarray(x, np.float32))], threads=threads).reshape(np.shape(x))


def binary(op: str, a: np.ndarray, b: np.ndarray, threads: int = 2) -> np.ndarray:
    """swiglu(gate, up), geglu(gate, up), mul, add (b broadcast over a's rows as ggml does)."""
    return run(
        op,
        [_array_input(np.asarray(a, np.float32)), _array_input(np.asarray(b, np.float32))],
        threads=threads,
    ).reshape(np.shape(a))


def rms_norm(x: np.ndarray, eps: float, threads: int = 2) -> np.ndarray:
    return run(
        "rms_norm", [_array_input(np.asarray(x, np.float32))], fp=[eps], threads=threads
    ).reshape(np.shape(x))


def rms_norm_mul(x: np.ndarray, weight: np.ndarray, eps: float, threads: int = 2) -> np.ndarray:
    """rms_norm(x) * weight, which ggml's CPU backend computes fused (as in every llama layer)."""
    return run(
        "rms_norm_mul",
        [_array_input(np.asarray(x, np.float32)), _array_input(np.asarray(weight, np.float32))],
        fp=[eps],
        threads=threads,
    ).reshape(np.shape(x))


def scale(x: np.ndarray, s: float, threads: int = 2) -> np.ndarray:
    return run("scale", [_array_input(np.asarray(x, np.float32))], fp=[s], threads=threads).reshape(
        np.shape(x)
    )


def get_rows(raw: np.ndarray, qtype: int, n_rows: int, k: int, ids: np.ndarray) -> np.ndarray:
    """Rows ``ids`` of a [n_rows, k] table in GGUF block bytes, as f32 [len(ids), k]."""
    table = _input(int(qtype), (k, n_rows), np.ascontiguousarray(raw).tobytes())
    return run("get_rows", [table, _array_input(np.asarray(ids, np.int32))]).reshape(len(ids), k)


def cpy(x: np.ndarray, qtype: int) -> np.ndarray:
    """x f32 converted to ``qtype`` by ggml_cpy (how K and V enter the cache)."""
    out = run("cpy", [_array_input(np.asarray(x, np.float32))], ip=[int(qtype)])
    return out.reshape(np.shape(x)) if out.dtype != np.uint8 else out


def hadamard(n: int) -> np.ndarray:
    """llama.cpp's ggml_gen_hadamard: the orthonormal Sylvester matrix of size n (a power of 2)."""
    h = np.full((1, 1), 1.0 / np.sqrt(np.float32(n)), np.float32)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h


def fwht(x: np.ndarray, n: int, threads: int = 2) -> np.ndarray:
    """llama_mul_mat_hadamard(x, H_n): ggml_mul_mat by the n x n Hadamard matrix with the hint
    GGML_HINT_SRC0_IS_HADAMARD, which the CPU backend computes as a fast Walsh-Hadamard transform
    of every n consecutive values of x (f32 or f16, [..., a multiple of n])."""
    x = np.asarray(x)
    rows = x.reshape(-1, n)
    out = run("fwht", [_array_input(hadamard(n)), _array_input(rows)], threads=threads)
    return out.reshape(x.shape)


def set_rows(
    x: np.ndarray, rows: np.ndarray, n_rows: int, qtype: int, threads: int = 2
) -> np.ndarray:
    """ggml_set_rows of x (f32 [m, k]) at ``rows`` (m indices) of a zeroed cache [n_rows, k] of
    ``qtype``: the cache afterwards, as raw row bytes (uint8 [n_rows, row size]) or f16/f32."""
    x = np.atleast_2d(np.asarray(x, np.float32))
    out = run(
        "set_rows",
        [_array_input(x), _array_input(np.asarray(rows, np.int32))],
        ip=[int(qtype), int(n_rows)],
        threads=threads,
    )
    return out.reshape(n_rows, -1)
