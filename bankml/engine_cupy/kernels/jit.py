"""Numba compilation for the CPU kernels that must round exactly as ggml's do.

NumPy's vectorised operations cannot follow ggml's per-lane accumulation order without
materialising many times the work, so the kernels that must be bit-identical to llama-server's
(quantized matrix products, the f16 flash-attention accumulator, SiLU's polynomial exp) are
written as plain loops and compiled by Numba. ``njit`` is the one decorator they use:
compiled once per machine (cached beside the module, or in Numba's user cache when the package
directory is read-only), no Python objects inside, and the GIL released so the engine thread
never blocks the reactor. ``fma32`` is a single-rounding fused multiply-add in float32, which
ggml's AVX2 kernels use (``_mm256_fmadd_ps``) and Python 3.11's ``math`` lacks.

Numba keys a cached function on its own source file only, yet a kernel inlines the helpers and
intrinsics it calls from other modules: ``njit`` therefore keys every kernel's cache on the
sources of all the compiled modules too (``KernelCache``), so that editing (or upgrading) any of
them recompiles what may depend on it, instead of running the old machine code.

Several processes fill one cache at once (compile jobs beside a start, servers and the tests
sharing a cache directory). Numba's own files numbered a new specialization's data file by the
count of the index's entries, so two writers of different signatures could both choose
``.1.nbc`` and leave one signature mapped to the other's machine code (a crash when run):
``KernelCache`` names each data file by its signature, updates the index under a lock, and
loads an entry only if the data file holds that very entry.
"""

from __future__ import annotations

import ast
import fcntl
import functools
import hashlib
import inspect
import os
import pickle
import re
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numba
from llvmlite import ir
from numba import njit as _numba_njit
from numba import types
from numba.core.caching import (
    CompileResultCacheImpl,
    FunctionCache,
    IndexDataCacheFile,
    NullCache,
)
from numba.core.compiler_lock import global_compiler_lock
from numba.core.dispatcher import Dispatcher
from numba.extending import intrinsic

__all__ = [
    "njit",
    "fma32",
    "f16_round",
    "f16_bits",
    "start_worker_threads",
    "present_in",
    "every_type_compiled",
    "release_compile_memory",
]


# libgomp's wait: spin this many iterations after a parallel region, then sleep. Measured on a
# decode step of the default model, 2 idle cores: 14.5 ms with 10,000, 16.0 ms spinning (ACTIVE,
# libgomp's default here), 31.7 ms sleeping at once (PASSIVE), whose wake-up costs tens of
# microseconds for each of a step's ~120 parallel products. Since a step is one compiled call
# (exact_decode.decode_stack) the workers also wait out the sampler's part between two steps:
# 100,000 then gave 10.1-11.4 ms a step against 10.3-16.7 with 10,000 (three alternating
# rounds, 2026-12-02 03:20 UTC, load 1.2-1.5), and served decode 1.015x and 1.08x
# llama-server's (bench/serve.py) against 0.98x.
SPIN_COUNT = "100000"


_start_lock = threading.Lock()
_started = False


def start_worker_threads() -> None:
    """Start Numba's OpenMP workers with a short spin, for this process only; once.

    Called by the thread that will run the engine (Model.load on the exact backend), never at
    import: that thread then owns the worker team, and a decode step run from another thread
    took twice as long. libgomp reads GOMP_SPINCOUNT once, when Numba's threading layer loads
    it, so the variable is set for that moment only and then put back (unless the user set it
    or OMP_WAIT_POLICY): a llama-server started later by this process (P0 --spawn, the tests,
    the benchmarks) keeps its own defaults, on which its speed depends (with a passive policy
    inherited it decoded 20-25 tok/s instead of 90-100 here). A long spin would starve a thread
    the workers wait for on a loaded 2-core machine; a short one costs little there.
    """
    global _started
    with _start_lock:
        if _started:
            return
        _started = True
        if "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ:
            numba.get_num_threads()
            return
        os.environ["GOMP_SPINCOUNT"] = SPIN_COUNT
        try:
            numba.get_num_threads()  # loads the threading layer and starts its workers
        finally:
            del os.environ["GOMP_SPINCOUNT"]


# --- Numba's cache, keyed on the compiled modules a kernel builds on ------------------------------

# A compiled module: one that imports this module (``njit``, the intrinsics), in any spelling.
_USES_THIS_MODULE = re.compile(
    rb"^\s*(?:from\s+(?:bankml\.engine_cupy\.kernels\.|\.)jit\s+import\b"
    rb"|from\s+(?:bankml\.engine_cupy\.kernels|\.)\s+import\s+[^\n]*\bjit\b"
    rb"|import\s+bankml\.engine_cupy\.kernels\.jit\b)",
    re.MULTILINE,
)
_HERE = Path(__file__).resolve()
_ENGINE_PACKAGE = "bankml.engine_cupy"  # the engine, whose modules a kernel may build on
_ENGINE_DIR = _HERE.parent.parent


def is_compiled_module(path: Path) -> bool:
    return path == _HERE or bool(_USES_THIS_MODULE.search(path.read_bytes()))


def _module_file(dotted: str, roots: dict[str, Path]) -> Path | None:
    """The file of module ``dotted`` if it lies in one of ``roots`` (package name: folder)."""
    for package, folder in roots.items():
        if dotted.startswith(package + "."):
            candidate = folder.joinpath(*dotted[len(package) + 1 :].split(".")).with_suffix(".py")
            if candidate.is_file():
                return candidate.resolve()
    return None


@functools.cache
def _import_nodes(path: Path) -> tuple[ast.Import | ast.ImportFrom, ...]:
    """The import statements of ``path``, anywhere in it (lazy ones too): parsed once per
    process, however many kernel modules build on it."""
    return tuple(
        node
        for node in ast.walk(ast.parse(path.read_bytes()))
        if isinstance(node, (ast.Import, ast.ImportFrom))
    )


def _imported_files(path: Path, package: str) -> set[Path]:
    """The modules ``path`` imports (anywhere in it, lazily too) from its own package or from
    bankml's engine (its subpackages included), as files."""
    roots = {package: path.parent, _ENGINE_PACKAGE: _ENGINE_DIR}
    names: list[str] = []  # dotted module names, some of them names inside a module
    for node in _import_nodes(path):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package up level - 1 parents
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{node.module}" if node.module else parent
            names.append(base)  # from pkg.module import name
            names += [f"{base}.{alias.name}" for alias in node.names]  # from pkg import module
        else:
            names += [alias.name for alias in node.names]
    files = {_module_file(name, roots) for name in names}
    return {f for f in files if f is not None}


def kernel_sources(path: Path, package: str) -> list[Path]:
    """The files whose source a kernel of ``path`` may compile in: this module, ``path``, and
    what it imports from its package or bankml's engine, followed through the compiled modules
    (a plain module imported is included, since its constants can be frozen into the code)."""
    found, todo = {_HERE}, [path.resolve()]
    while todo:
        current = todo.pop()
        if current in found:
            continue
        found.add(current)
        if is_compiled_module(current):
            todo += sorted(_imported_files(current, package))
    return sorted(found)


@functools.cache
def kernel_sources_digest(path: Path, package: str) -> str:
    """SHA-256 of ``kernel_sources`` (names and bytes); read once per process and module, as
    the code a process runs is the code it imported."""
    digest = hashlib.sha256()
    for source in kernel_sources(path, package):
        digest.update(source.name.encode() + b"\0" + source.read_bytes() + b"\0")
    return digest.hexdigest()


class _StampedLocator:
    """Numba's cache locator for a function, with the compiled modules' digest in its stamp."""

    def __init__(self, locator: Any, sources_digest: str) -> None:
        self._locator = locator
        self._sources_digest = sources_digest

    def get_source_stamp(self) -> Any:
        return (self._locator.get_source_stamp(), self._sources_digest)

    def __getattr__(self, name: str) -> Any:  # cache path, disambiguator, ...: Numba's own
        return getattr(self._locator, name)


class _KernelCacheImpl(CompileResultCacheImpl):
    """Numba's CompileResult cache; its locator's stamp also covers the compiled modules."""

    def __init__(self, py_func: Callable) -> None:
        source = Path(inspect.getfile(py_func))
        package = (py_func.__module__ or "").rpartition(".")[0]
        # "<string>" and the like: no file, and Numba finds no locator for it either
        self._sources_digest = kernel_sources_digest(source, package) if source.is_file() else ""
        super().__init__(py_func)

    @property
    def locator(self) -> Any:
        return _StampedLocator(super().locator, self._sources_digest)

    def rebuild(self, target_context: Any, payload: Any) -> Any:
        """Numba's rebuild, the threading layer started first where the kernel's code calls into
        it. Numba records in a compiled library what must run before its code does (for a
        parallel loop, starting the threading layer, whose functions the code calls by name) and
        a kernel inherits it from the libraries it links; but a library read back from the cache
        has forgotten it. A kernel compiled over a cache-loaded parallel kernel is then saved
        without it, and a process that loads only that kernel called a threading layer never
        started: a segmentation fault at address 0 (tests/test_jit.py)."""
        if _calls_threading_layer(payload):
            start_worker_threads()
        return super().rebuild(target_context, payload)


def _calls_threading_layer(payload: Any) -> bool:
    """Whether a cached CompileResult's code calls Numba's threading layer (a parallel loop of
    its own or of a kernel it links): its object code names ``numba_parallel_for``. A payload
    of another shape counts as calling it (starting the workers is harmless)."""
    try:
        _name, kind, data = payload[0]
        code = data[0] if kind == "object" else data
        return b"numba_parallel_for" in bytes(code)
    except (TypeError, ValueError, IndexError):
        return True


class _KernelCacheFile(IndexDataCacheFile):
    """Numba's index and data files of a function, safe for writers in several processes.

    Numba's ``save`` reads the index, names a new data file ``<base>.<N>.nbc`` by the count of
    its entries, writes the index, then the data: two processes saving different signatures at
    once both choose the same N, and the index written last can name a file whose bytes are
    the other signature's machine code. Here:

    - a data file is named by a digest of its entry's key (signature, target, bytecode), so
      two signatures never share one, and one signature's writers write the same code;
    - it holds the key and the source stamp beside Numba's data, and ``load`` returns it only
      for that key and stamp (anything else, an earlier format included, is a miss: compiled
      and saved again);
    - the data is written first, then the index is read, changed and written under an
      exclusive ``fcntl`` lock on ``<base>.nbi.lock``, so that no writer drops another's entry.
    """

    def __init__(self, cache_path: str, filename_base: str, source_stamp: Any) -> None:
        super().__init__(cache_path, filename_base, source_stamp)
        self._filename_base = filename_base
        self._lock_path = self._index_path + ".lock"

    def _key_data_name(self, key: Any) -> str:
        # repr covers the signature's types, the target (magic tuple) and the bytecode digests;
        # a name two keys might share would only be a miss (load checks the key)
        digest = hashlib.sha256(repr(key).encode()).hexdigest()[:20]
        return f"{self._filename_base}.{digest}.nbc"

    @contextmanager
    def _index_lock(self) -> Iterator[None]:
        with open(self._lock_path, "ab") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def save(self, key: Any, data: Any) -> None:
        data_name = self._key_data_name(key)
        self._save_data(data_name, (key, self._source_stamp, data))  # replaced atomically
        with self._index_lock():
            overloads = self._load_index()
            if overloads.get(key) != data_name:
                overloads[key] = data_name
                self._save_index(overloads)

    def load(self, key: Any) -> Any:
        data_name = self._load_index().get(key)
        if data_name is None:
            return None
        try:
            stored = self._load_data(data_name)
        except (OSError, EOFError, pickle.UnpicklingError):  # removed, or not a data file
            return None
        if not (isinstance(stored, tuple) and len(stored) == 3):
            return None
        stored_key, stamp, data = stored
        if stamp != self._source_stamp or stored_key != key:
            return None  # another entry's code, or another source's: never run it
        return data


# How long a process waits for another to finish compiling a kernel it needs before it
# compiles the kernel itself: longer than the largest kernel's compile on a loaded machine (the
# fused decode step, about a minute). A holder that dies releases its claim at once (flock).
COMPILE_WAIT_S = 300.0


class _CompileClaims:
    """Which process compiles a kernel signature that the cache misses: the first to claim it.

    Several processes often need the same kernels at once (a start and its compile jobs, two
    servers, the suite's precompiler beside a test's server), and Numba would compile them in
    each. A claim is an exclusive ``flock`` on ``<data file>.compiling``, taken on a miss and
    held until the compiled code is saved; a process that finds it taken waits for it, then
    reads the cache again and loads what the holder saved. Locks are taken in call order (a
    kernel's claim before its callees'), and the call graph has no cycles, so no two processes
    wait on each other. A compile that raises (a typing error, which another process meets
    alike) releases its claims at once (``_use_kernel_cache``), so no one waits on it."""

    def __init__(self) -> None:
        self._held: dict[str, Any] = {}

    def claim(self, path: str) -> None:
        """Hold the claim ``path``, once no other process holds it."""
        self.release(path)  # one this process still holds (it is taken again, not waited on)
        try:
            claim = open(path, "ab")  # noqa: SIM115 (closed by release)
        except OSError:  # a cache this process cannot write: it compiles without a claim
            return
        deadline = time.monotonic() + COMPILE_WAIT_S
        while True:
            try:
                fcntl.flock(claim, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:  # a holder stuck: compile it here
                    break
                time.sleep(0.05)
        self._held[path] = claim

    def release(self, path: str) -> None:
        claim = self._held.pop(path, None)
        if claim is not None:
            claim.close()  # closing the file drops its flock


_CLAIMS = _CompileClaims()  # one per process: a claim it still holds is found again


class KernelCache(FunctionCache):
    """Numba's on-disk function cache (same places, same index), fresh only while neither the
    function's source nor any compiled module's has changed, safe for several processes
    writing at once (``_KernelCacheFile``), and compiling each signature in one process only
    (``_CompileClaims``): the others wait and load it."""

    _impl_class = _KernelCacheImpl

    def __init__(self, py_func: Callable) -> None:
        super().__init__(py_func)
        if type(getattr(self, "_cache_file", None)) is not IndexDataCacheFile:
            raise RuntimeError(
                f"numba {numba.__version__}: Cache._cache_file is gone, "
                "bankml.engine_cupy.jit cannot make its kernels' cache safe for several writers"
            )
        self._cache_file = _KernelCacheFile(
            cache_path=self._cache_path,
            filename_base=self._impl.filename_base,
            source_stamp=self._impl.locator.get_source_stamp(),
        )
        self.unsaved: list[str] = []  # claims taken on a miss, their code not saved yet

    def load_overload(self, sig: Any, target_context: Any) -> Any:
        """The cached code; on a miss, this process's claim to compile it, taken after any
        other process's compile of it has ended, and the cache read again then (the other may
        have saved it: a hit; or the claim was free and another process saved it just before)."""
        data = super().load_overload(sig, target_context)
        if data is not None or not self._enabled:
            return data
        self._impl.locator.ensure_cache_path()
        claim = self._claim_path(sig, target_context.codegen())
        _CLAIMS.claim(claim)
        data = super().load_overload(sig, target_context)
        if data is not None:
            _CLAIMS.release(claim)
        else:
            self.unsaved.append(claim)
        return data

    def save_overload(self, sig: Any, data: Any) -> None:
        """Numba's save, then the claim released, whether Numba saved the code or not."""
        claim = self._claim_path(sig, data.codegen)
        try:
            super().save_overload(sig, data)
        finally:
            _CLAIMS.release(claim)
            if claim in self.unsaved:
                self.unsaved.remove(claim)

    def release_unsaved(self, held: int) -> None:
        """Release the claims taken since ``unsaved`` held ``held`` of them: their compiles
        raised (a typing error, or Numba asking for literal arguments), so nothing will be
        saved for them. Kept, each would hold every other process that needs the same
        signature (and fails alike) for COMPILE_WAIT_S, for as long as this process lives."""
        while len(self.unsaved) > held:
            _CLAIMS.release(self.unsaved.pop())

    def _claim_path(self, sig: Any, codegen: Any) -> str:
        data_name = self._cache_file._key_data_name(self._index_key(sig, codegen))
        return os.path.join(self._cache_path, data_name + ".compiling")


def _use_kernel_cache(dispatcher: Dispatcher) -> Dispatcher:
    """Give ``dispatcher`` a KernelCache in place of the FunctionCache of ``cache=True``.

    Numba offers no option to choose a dispatcher's cache class: this sets the attribute that
    ``Dispatcher.enable_caching`` sets (numba 0.68; tests/test_jit.py checks it still works)."""
    if not isinstance(getattr(dispatcher, "_cache", None), NullCache):  # what cache=False leaves
        raise RuntimeError(
            f"numba {numba.__version__}: Dispatcher._cache is gone, "
            "bankml.engine_cupy.jit cannot key its kernels' cache"
        )
    cache = dispatcher._cache = KernelCache(dispatcher.py_func)
    compile_signature = dispatcher.compile

    def compile(sig: Any) -> Any:
        """Numba's compile of one signature; if it raises, the claims it took are released."""
        with global_compiler_lock:  # compiles are serial: ``unsaved`` is this compile's own
            held = len(cache.unsaved)
            try:
                return compile_signature(sig)
            except BaseException:
                cache.release_unsaved(held)
                raise

    dispatcher.compile = compile  # what Numba calls, for a call from Python or from a kernel
    return dispatcher


def njit(*args: Any, **kwargs: Any) -> Callable:
    """numba.njit with the project's settings: cached (KernelCache), nogil, IEEE float semantics
    (no fastmath). Signatures, if given, are compiled at once, after the cache is in place."""
    options = {"cache": True, "nogil": True, "fastmath": False, "error_model": "numpy"}
    options.update(kwargs)
    cached = options.pop("cache")
    function = args[0] if args and callable(args[0]) else None
    signatures = args[0] if args and function is None else []

    def compile_kernel(py_func: Callable) -> Dispatcher:
        dispatcher = _numba_njit(**options)(py_func)
        _KERNELS.append(dispatcher)
        if cached:
            _use_kernel_cache(dispatcher)
        for signature in [signatures] if isinstance(signatures, str) else signatures:
            dispatcher.compile(signature)
        return dispatcher

    return compile_kernel(function) if function is not None else compile_kernel


# --- What only compiling needs, given back once the kernels are loaded ---------------------------

_KERNELS: list[Dispatcher] = []  # every njit kernel, for release_compile_memory


def _module_for_linking(bitcode: bytes) -> Any:
    """A kernel's module for another kernel to link in, parsed again from its bitcode."""
    from llvmlite import binding

    return binding.parse_bitcode(bitcode)


def release_compile_memory() -> dict[str, int]:
    """Give back what the process holds only for compiling, once the kernels it runs are loaded
    (Model.warm_up); nothing a loaded kernel runs is touched. Returns the bytes of each part.

    - ``linking``: Numba keeps with every compiled or cache-loaded kernel its whole LLVM module
      (parsed IR, ~8x its bitcode) in case a later compile links it in. It is kept as bitcode
      instead and parsed again by such a compile (``_get_module_for_linking``, the one method
      that reads it; numba 0.68, tests/test_jit.py).
    - glibc's free memory (``malloc_trim``): the compiler's and the loader's scratch.
    - ``llvm_pages``: LLVM's code and read-only data, libllvmlite's clean file pages, which
      only compiling runs: dropped from this process's page tables (``MADV_DONTNEED`` on its
      read-only mappings without private pages), read again from the page cache by the next
      compile. Linux only.
    """
    linking = 0
    with global_compiler_lock:  # no compile (of another thread) links a library meanwhile
        for dispatcher in _KERNELS:
            for result in list(dispatcher.overloads.values()):
                library = result.library
                module = getattr(library, "_shared_module", None)
                if module is None:
                    continue
                bitcode = module.as_bitcode()
                linking += len(bitcode)
                library._get_module_for_linking = functools.partial(_module_for_linking, bitcode)
                library._shared_module = None
        _malloc_trim()
        return {"linking_bitcode": linking, "llvm_pages": _drop_llvm_pages()}


def _malloc_trim() -> None:
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        trim = getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None
    except OSError:
        return
    if trim is not None:  # glibc
        trim(0)


def _drop_llvm_pages() -> int:
    """Drop libllvmlite's clean file pages from this process's memory (see
    release_compile_memory); the bytes dropped. Only read-only mappings whose pages are all
    clean file pages (no ``Anonymous`` ones: relocated data stays)."""
    import ctypes
    import mmap

    from llvmlite.binding import ffi

    smaps = Path("/proc/self/smaps")
    advise = getattr(mmap, "MADV_DONTNEED", None)
    if not smaps.exists() or advise is None:
        return 0
    path = os.path.realpath(ffi.lib._name)
    ranges: list[tuple[int, int, int]] = []  # start, length, resident bytes
    current: list[Any] | None = None
    for line in smaps.read_text().splitlines():
        head, _, rest = line.partition(" ")
        if "-" in head and not head.endswith(":"):  # a mapping: range perms offset dev inode path
            fields = rest.split(None, 4)
            current = None
            if len(fields) == 5 and "w" not in fields[0] and fields[4] == path:
                start, end = (int(x, 16) for x in head.split("-"))
                current = [start, end - start, 0, 0]
        elif current is not None and head in ("Rss:", "Anonymous:"):
            current[2 if head == "Rss:" else 3] = int(rest.split()[0]) * 1024
            if head == "Anonymous:" and current[3] == 0:
                ranges.append((current[0], current[1], current[2]))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    dropped = 0
    for start, length, resident in ranges:
        if libc.madvise(start, length, advise) == 0:
            dropped += resident
    return dropped


# BANKML_KERNEL_TYPES=all: compile each kernel once for every weight type and family, instead of
# once per set of types a file has. A file's first start then compiles more, but every later file,
# of any types, finds its kernels cached (a machine serving files of many types; the test suite's
# tiny models of every type). The same source either way, so the same bits.
KERNEL_TYPES_ENV = "BANKML_KERNEL_TYPES"


def every_type_compiled() -> bool:
    """Whether the kernels are compiled for every weight type (``BANKML_KERNEL_TYPES=all``)
    rather than for the types of the file at hand: the type sets (``present_in``'s flags) are
    then all set."""
    return os.environ.get(KERNEL_TYPES_ENV, "") == "all"


def present_in(flags: Any) -> tuple[bool, ...]:
    """Which entries of a tuple of flags are set, read from the tuple's Numba type (a set entry
    is True, an unset one None): an ``overload`` that drops the branches of the unset entries
    before typing compiles only what the set ones need (one specialization per set, cached)."""
    return tuple(not isinstance(t, types.NoneType) for t in flags)


if TYPE_CHECKING:  # what a compiled kernel calls (the intrinsics take the typing context first)

    def fma32(a: Any, b: Any, c: Any) -> Any: ...

    def f16_round(x: Any) -> Any: ...

else:

    @intrinsic
    def fma32(typingctx: Any, a: Any, b: Any, c: Any) -> Any:
        """a * b + c in float32 with one rounding (llvm.fma.f32: the FMA instruction where
        present)."""
        sig = types.float32(types.float32, types.float32, types.float32)

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            f32 = ir.FloatType()
            fn = builder.module.declare_intrinsic(
                "llvm.fma", [f32], ir.FunctionType(f32, [f32] * 3)
            )
            return builder.call(fn, args)

        return sig, codegen

    @intrinsic
    def f16_round(typingctx: Any, x: Any) -> Any:
        """float32 x through f16 and back, round to nearest even: ggml's GGML_CPU_FP32_TO_FP16
        then FP16_TO_FP32 (F16C's vcvtps2ph/vcvtph2ps where present, LLVM's exact soft
        conversion else)."""
        sig = types.float32(types.float32)

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            return builder.fpext(builder.fptrunc(args[0], ir.HalfType()), ir.FloatType())

        return sig, codegen


@intrinsic
def f16_bits(typingctx: Any, x: Any) -> Any:
    """The bits of float32 x rounded to f16 (nearest even), as an int64 table index."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        h = builder.fptrunc(args[0], ir.HalfType())
        return builder.zext(builder.bitcast(h, ir.IntType(16)), ir.IntType(64))

    return types.int64(types.float32), codegen
