"""bankml.engine_cupy.kernels.jit: Numba's on-disk cache of a kernel follows the modules it calls into.

Each run is a fresh Python process (Numba only reads its cache at compile time), with
NUMBA_CACHE_DIR in a temporary directory, on a two-module package written here: ``kernel``
calls ``helper``'s njit function; ``other`` is a compiled module the kernel does not import.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy
import pytest

import bankml
from bankml.engine_cupy.kernels import exact_decode, exact_matmul, jit

HELPER = """\
from bankml.engine_cupy.kernels.jit import njit


@njit
def scaled(x):
    return x * {factor}
"""

KERNEL = """\
from bankml.engine_cupy.kernels.jit import fma32, njit
from stalepkg.helper import scaled


@njit
def kernel(x):
    return fma32(scaled(x), x, x)
"""

OTHER = """\
from bankml.engine_cupy.kernels.jit import njit


@njit
def unrelated(x):
    return x - {offset}
"""

RUN = """\
import json
from stalepkg.kernel import kernel
value = kernel(3.0)
print(json.dumps({"value": value, "hits": sum(kernel.stats.cache_hits.values()),
                  "misses": sum(kernel.stats.cache_misses.values())}))
"""


def write_package(root: Path, factor: float, offset: float = 1.0) -> None:
    package = root / "stalepkg"
    package.mkdir(exist_ok=True)
    (package / "__init__.py").write_text("")
    (package / "kernel.py").write_text(KERNEL)
    (package / "helper.py").write_text(HELPER.format(factor=factor))
    (package / "other.py").write_text(OTHER.format(offset=offset))


def kernel_env(root: Path) -> dict[str, str]:
    """The environment of a process that imports packages written under ``root`` and caches
    their kernels in ``root``'s own Numba cache."""
    repo = Path(bankml.__file__).resolve().parent.parent
    return dict(
        os.environ,
        NUMBA_CACHE_DIR=str(root / "numba-cache"),
        PYTHONPATH=os.pathsep.join([str(root), str(repo)]),
    )


def run_kernel(root: Path, script: str = RUN, *args: str) -> dict:
    """kernel(3.0) (or ``script``, given ``args``) in a fresh process, with Numba's cache
    statistics of that process; a crash shows its Python stack."""
    env = kernel_env(root)
    done = subprocess.run(
        [sys.executable, "-X", "faulthandler", "-c", script, *args],
        env=env,
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, (args, done.returncode, done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def index_files(root: Path) -> list[str]:
    return sorted(p.name for p in (root / "numba-cache").rglob("*.nbi"))


def test_cached_kernel_follows_an_edited_helper_module(tmp_path: Path) -> None:
    write_package(tmp_path, 2.0)
    first = run_kernel(tmp_path)
    assert first == {"value": 3.0 * 2.0 * 3.0 + 3.0, "hits": 0, "misses": 1}
    indexes = index_files(tmp_path)
    assert any(name.startswith("kernel.kernel-") for name in indexes)

    # A second process loads the machine code from the cache: no compilation.
    second = run_kernel(tmp_path)
    assert second == {"value": first["value"], "hits": 1, "misses": 0}
    assert index_files(tmp_path) == indexes

    # A compiled module that the kernel does not import changes: the cache stays fresh.
    write_package(tmp_path, 2.0, offset=7.0)
    assert run_kernel(tmp_path) == {"value": first["value"], "hits": 1, "misses": 0}

    # Only helper.py changes (its content and its mtime): kernel.py's own stamp is the same,
    # so plain cache=True would load the old machine code and still give 21.
    write_package(tmp_path, 5.0)
    helper = tmp_path / "stalepkg" / "helper.py"
    stat = helper.stat()
    os.utime(helper, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    third = run_kernel(tmp_path)
    assert third["value"] == 3.0 * 5.0 * 3.0 + 3.0
    assert third["misses"] == 1 and third["hits"] == 0

    # The recompiled kernel is cached in turn.
    assert run_kernel(tmp_path) == {"value": third["value"], "hits": 1, "misses": 0}


RELEASE = """\
import json
from bankml.engine_cupy.kernels.jit import njit, release_compile_memory
from stalepkg.helper import scaled
before = scaled(3.0)
released = release_compile_memory()

@njit(cache=False)
def doubled(x):
    return scaled(x) * 2.0

print(json.dumps({"before": before, "linked": doubled(3.0), "again": scaled(3.0),
                  "released": released, "hits": sum(scaled.stats.cache_hits.values())}))
"""


def test_released_kernels_still_run_and_link(tmp_path: Path) -> None:
    """release_compile_memory keeps a kernel's module as bitcode only and drops LLVM's code
    pages: the kernel still runs, and a kernel compiled afterwards still links it in, whether
    it was compiled here (first run) or loaded from the cache (second)."""
    write_package(tmp_path, 2.0)
    for hits in (0, 1):
        out = run_kernel(tmp_path, RELEASE)
        assert out["hits"] == hits
        assert out["before"] == out["again"] == 6.0 and out["linked"] == 12.0
        assert out["released"]["linking_bitcode"] > 0
        if sys.platform == "linux":
            assert out["released"]["llvm_pages"] > 0


KERNELS = Path(jit.__file__).resolve().parent
ENGINE = KERNELS.parent
PACKAGE = "bankml.engine_cupy.kernels"


def test_every_engine_module_with_kernels_is_a_compiled_module() -> None:
    """A module that compiles kernels but imported jit in a spelling the pattern misses would
    not be followed into (``is_compiled_module`` reads the import line)."""
    with_kernels = [p for p in ENGINE.rglob("*.py") if "njit" in p.read_text()]
    assert len(with_kernels) >= 8, "kernels not found: the engine moved?"
    assert all(jit.is_compiled_module(p) for p in with_kernels)
    assert not jit.is_compiled_module(ENGINE / "weights.py")


def test_kernel_sources_follow_the_engine_imports() -> None:
    """The fused decode step builds on every kernel module (and the cache's store, outside the
    kernels package); exact_matmul on none."""

    def stems(name: str) -> set[str]:
        return {p.stem for p in jit.kernel_sources(KERNELS / f"{name}.py", PACKAGE)}

    assert stems("exact_matmul") == {"exact_matmul", "jit"}
    assert stems("exact_kquants") == {"exact_kquants", "exact_matmul", "jit"}
    assert stems("exact_attention") == {"exact_attention", "exact_ops", "jit"}
    assert {"exact_matmul", "exact_ops", "exact_attention", "kv_cache", "jit"} <= stems(
        "exact_decode"
    )


@pytest.mark.parametrize("kernel", [exact_matmul.row_product, exact_decode.decode_layer])
def test_engine_kernels_use_the_keyed_cache(kernel: object) -> None:
    """Every jit.njit kernel gets KernelCache, whose stamp is Numba's own plus the digest
    (exact_decode keeps no keying of its own on top)."""
    assert type(kernel._cache) is jit.KernelCache
    own_stamp, digest = kernel._cache._cache_file._source_stamp
    assert isinstance(own_stamp, bytes)  # Numba's hash of the function's own file, not nested
    module = Path(kernel.py_func.__code__.co_filename)
    assert digest == jit.kernel_sources_digest(module, PACKAGE)


def test_plain_numba_options_still_pass_through() -> None:
    """cache=False gives Numba's NullCache; explicit signatures compile at decoration."""
    uncached = jit.njit(cache=False)(lambda x: x + 1)
    assert type(uncached._cache).__name__ == "NullCache"
    eager = jit.njit("int64(int64)", cache=False)(lambda x: x * 2)
    assert eager.signatures and eager(21) == 42


def test_cache_hook_fails_loudly_without_numbas_attribute() -> None:
    class NotADispatcher:
        py_func = staticmethod(lambda: None)

    with pytest.raises(RuntimeError, match="Dispatcher._cache"):
        jit._use_kernel_cache(NotADispatcher())  # type: ignore[arg-type]


RACE_KERNEL = """\
from bankml.engine_cupy.kernels.jit import njit


@njit
def plus_one(x):
    return x + 1
"""

# Two writers save different signatures of one function into one cache at once, in the order
# that broke Numba's own IndexDataCacheFile (numbering a new data file by the count of the
# index's entries): both read the index empty, both write it, then both their data; the first
# to write its index is the last to write its data. Each step waits for the steps before it,
# up to 0.5 s (a writer that holds a lock the other waits on goes on after that).
RACE_WRITE = """\
import threading
from numba import types
from bankml.engine_cupy.kernels.jit import KernelCache
from racepkg.kernel import plus_one

SIGNATURES = {"int": (types.int64,), "float": (types.float64,)}
ORDER = [("int", "_load_index"), ("float", "_load_index"), ("int", "_save_index"),
         ("float", "_save_index"), ("float", "_save_data"), ("int", "_save_data")]
done, turn = set(), threading.Condition()

plus_one._cache.disable()  # compiled in memory only: the writers below save
results = {}
for name, signature in SIGNATURES.items():
    plus_one.compile(signature)
    results[name] = plus_one.overloads[signature]


def gated(step, original):
    def run(*args):
        with turn:
            if step not in done:
                before = ORDER[: ORDER.index(step)]
                turn.wait_for(lambda: all(s in done for s in before), timeout=0.5)
        try:
            return original(*args)
        finally:
            with turn:
                done.add(step)
                turn.notify_all()

    return run


writers = []
for name, signature in SIGNATURES.items():
    cache = KernelCache(plus_one.py_func)
    for method in ("_load_index", "_save_index", "_save_data"):
        original = getattr(cache._cache_file, method)
        setattr(cache._cache_file, method, gated((name, method), original))
    writers.append(threading.Thread(target=cache.save_overload, args=(signature, results[name])))
for writer in writers:
    writer.start()
for writer in writers:
    writer.join()
print("{}")
"""

RACE_LOAD = """\
import json, shutil
from pathlib import Path
from numba import types
from bankml.engine_cupy.kernels.jit import KernelCache
from racepkg.kernel import plus_one

SIGNATURES = {"int": (types.int64,), "float": (types.float64,)}


def loaded():
    out = {}
    for name, signature in SIGNATURES.items():
        result = KernelCache(plus_one.py_func).load_overload(signature, plus_one.targetctx)
        out[name] = None if result is None else [str(t) for t in result.signature.args]
    return out


first = loaded()
values = [plus_one(3), plus_one(2.5)]
hits = sum(plus_one.stats.cache_hits.values())
# A data file overwritten by another signature's: the index still names it for int64.
cache = KernelCache(plus_one.py_func)
files = cache._cache_file._load_index()
paths = {name: Path(cache.cache_path) / files[key] for key in files
         for name, signature in SIGNATURES.items() if key[0] == signature}
shutil.copyfile(paths["float"], paths["int"])
print(json.dumps({"first": first, "values": values, "hits": hits, "swapped": loaded()}))
"""


def test_concurrent_writers_keep_each_signature_its_own_code(tmp_path: Path) -> None:
    """Processes that fill one cache at once (compile jobs beside a start, servers and tests
    sharing a cache directory) never leave a signature mapped to another's machine code, and
    a data file that is not the entry it is read for is a miss, never run."""
    package = tmp_path / "racepkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "kernel.py").write_text(RACE_KERNEL)
    run_kernel(tmp_path, RACE_WRITE)
    out = run_kernel(tmp_path, RACE_LOAD)
    assert out["first"] == {"int": ["int64"], "float": ["float64"]}  # both kept, each its own
    assert out["values"] == [4, 3.5] and out["hits"] == 2
    assert out["swapped"] == {"int": None, "float": ["float64"]}


PARALLEL_KERNEL = """\
import numpy
from numba import prange
from bankml.engine_cupy.kernels.jit import njit


@njit
def doubles(x, out):
    out[:] = x * 2.0


@njit(parallel=True)
def spread(x, out):
    for i in prange(x.shape[0]):
        doubles(x[i : i + 1], out[i : i + 1])


@njit
def first_caller(x):
    out = numpy.empty_like(x)
    spread(x, out)
    return out.sum()


@njit
def second_caller(x):
    out = numpy.empty_like(x)
    spread(x, out)
    return out.sum() + 1.0
"""

# Each process calls kernels in its own order and never starts the threading layer itself.
PARALLEL_RUN = """\
import json, sys
import numpy
from parpkg import kernel
x = numpy.arange(64.0)
values = [getattr(kernel, name)(x) for name in sys.argv[1:]]
print(json.dumps({"values": values, "hits": sum(
    sum(getattr(kernel, name).stats.cache_hits.values()) for name in sys.argv[1:])}))
"""


def test_a_caller_of_a_cached_parallel_kernel_loads_and_runs(tmp_path: Path) -> None:
    """Numba keeps what a loaded kernel must run first (its threading layer, for a parallel loop)
    in the compiled library, but a library read back from the cache has forgotten it: a kernel
    compiled in a process that loaded its parallel callee from the cache is saved without it,
    and a process that then loads only that kernel calls into a threading layer never started
    (a segmentation fault at address 0: an encoder's server, whose float products another
    process had compiled). KernelCache starts it before loading such a kernel."""
    package = tmp_path / "parpkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "kernel.py").write_text(PARALLEL_KERNEL)

    expected = float(numpy.arange(64.0).sum() * 2.0)
    first = run_kernel(tmp_path, PARALLEL_RUN, "first_caller")  # compiles spread, first_caller
    assert first["values"] == [expected]
    # spread loaded from the cache, second_caller compiled over it and saved
    both = run_kernel(tmp_path, PARALLEL_RUN, "first_caller", "second_caller")
    assert both["values"] == [expected, expected + 1.0]
    alone = run_kernel(tmp_path, PARALLEL_RUN, "second_caller")  # a process that started nothing
    assert alone == {"values": [expected + 1.0], "hits": 1}


# Two processes need the same kernel at the same moment (a start and its compile job, two
# servers on one cache): each waits at a barrier of files, then calls the kernel.
AT_ONCE = """\
import json, sys, time
from pathlib import Path
from stalepkg.kernel import kernel
here = Path(sys.argv[1])
(here / f"ready-{sys.argv[2]}").touch()
while not (here / "go").exists():
    time.sleep(0.005)
value = kernel(3.0)
print(json.dumps({"value": value, "hits": sum(kernel.stats.cache_hits.values()),
                  "misses": sum(kernel.stats.cache_misses.values())}))
"""


def test_a_kernel_two_processes_need_at_once_compiles_in_one(tmp_path: Path) -> None:
    """The first to miss claims the compile; the other waits for it and loads the saved code
    (on Numba's own cache both compile: two misses)."""
    write_package(tmp_path, 2.0)
    env = kernel_env(tmp_path)
    runs = [
        subprocess.Popen(
            [sys.executable, "-c", AT_ONCE, str(tmp_path), str(n)],
            env=env,
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for n in range(2)
    ]
    deadline = time.monotonic() + 60
    while not all((tmp_path / f"ready-{n}").exists() for n in range(2)):
        assert time.monotonic() < deadline and all(run.poll() is None for run in runs)
        time.sleep(0.01)
    (tmp_path / "go").touch()
    results = []
    for run in runs:
        out, err = run.communicate(timeout=120)
        assert run.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert [r["value"] for r in results] == [3.0 * 2.0 * 3.0 + 3.0] * 2
    assert sorted((r["misses"], r["hits"]) for r in results) == [(0, 1), (1, 0)]


FAILING_KERNEL = """\
from bankml.engine_cupy.kernels.jit import njit


@njit
def broken(x):
    return x.no_such_attribute
"""

FAIL_AND_STAY = """\
import sys, time
from pathlib import Path
from brokenpkg.kernel import broken
here = Path(sys.argv[1])
try:
    broken(1.0)
except Exception as err:
    (here / "failed").write_text(type(err).__name__)
deadline = time.monotonic() + 120
while not (here / "done").exists() and time.monotonic() < deadline:
    time.sleep(0.05)
"""

FAIL_TIMED = """\
import json, time
from brokenpkg.kernel import broken
start = time.monotonic()
try:
    broken(1.0)
except Exception as err:
    print(json.dumps({"raised": type(err).__name__, "seconds": time.monotonic() - start}))
"""


def test_a_compile_that_fails_in_a_live_process_holds_no_other_up(tmp_path: Path) -> None:
    """A kernel signature that does not compile (a typing error) releases its claim when the
    compile raises: another process that needs the same signature meets the same error at
    once, not after jit.COMPILE_WAIT_S (the failing process still running meanwhile, as a
    server that fell back after such an error does)."""
    package = tmp_path / "brokenpkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "kernel.py").write_text(FAILING_KERNEL)
    env = kernel_env(tmp_path)
    first = subprocess.Popen(
        [sys.executable, "-c", FAIL_AND_STAY, str(tmp_path)], env=env, cwd=tmp_path
    )
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "failed").exists():
            assert time.monotonic() < deadline and first.poll() is None
            time.sleep(0.05)
        assert (tmp_path / "failed").read_text() == "TypingError"
        out = run_kernel(tmp_path, FAIL_TIMED)
        assert out["raised"] == "TypingError"
        assert out["seconds"] < jit.COMPILE_WAIT_S / 10
    finally:
        (tmp_path / "done").touch()
        first.wait(30)
