"""bankml.engine_cupy.jit: Numba's on-disk cache of a kernel follows the modules it calls into.

Each run is a fresh Python process (Numba only reads its cache at compile time), with
NUMBA_CACHE_DIR in a temporary directory, on a two-module package written here: ``kernel``
calls ``helper``'s njit function, and only ``helper`` is edited between runs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import bankml
from bankml.engine_cupy import exact_decode, exact_matmul, jit

HELPER = """\
from bankml.engine_cupy.jit import njit


@njit
def scaled(x):
    return x * {factor}
"""

KERNEL = """\
from bankml.engine_cupy.jit import fma32, njit
from stalepkg.helper import scaled


@njit
def kernel(x):
    return fma32(scaled(x), x, x)
"""

RUN = """\
import json
from stalepkg.kernel import kernel
value = kernel(3.0)
print(json.dumps({"value": value, "hits": sum(kernel.stats.cache_hits.values()),
                  "misses": sum(kernel.stats.cache_misses.values())}))
"""


def write_package(root: Path, factor: float) -> None:
    package = root / "stalepkg"
    package.mkdir(exist_ok=True)
    (package / "__init__.py").write_text("")
    (package / "kernel.py").write_text(KERNEL)
    (package / "helper.py").write_text(HELPER.format(factor=factor))


def run_kernel(root: Path) -> dict:
    """kernel(3.0) in a fresh process, with Numba's cache statistics of that process."""
    repo = Path(bankml.__file__).resolve().parent.parent
    env = dict(os.environ, NUMBA_CACHE_DIR=str(root / "numba-cache"),
               PYTHONPATH=os.pathsep.join([str(root), str(repo)]))
    done = subprocess.run([sys.executable, "-c", RUN], env=env, cwd=root, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
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


def test_every_engine_module_with_kernels_is_in_the_digest() -> None:
    """A module that compiles kernels but imports this module some other way would escape
    the rule (``compiled_modules`` finds them by their import line)."""
    engine = Path(jit.__file__).resolve().parent
    with_kernels = {p.resolve() for p in engine.glob("*.py")
                    if p.name != "jit.py" and ("@njit" in p.read_text() or "njit(" in p.read_text())}
    assert with_kernels, "no kernels found: the engine moved?"
    assert with_kernels <= set(jit.compiled_modules(engine))


@pytest.mark.parametrize("kernel", [exact_matmul.row_product, exact_decode.decode_layer])
def test_engine_kernels_use_the_keyed_cache(kernel: object) -> None:
    """Every jit.njit kernel gets KernelCache, whose stamp is Numba's own plus the digest
    (exact_decode keeps no keying of its own on top)."""
    assert type(kernel._cache) is jit.KernelCache
    own_stamp, digest = kernel._cache._cache_file._source_stamp
    assert isinstance(own_stamp, bytes)  # Numba's hash of the function's own file, not nested
    assert digest == jit.compiled_sources_digest(Path(jit.__file__).resolve().parent)


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

