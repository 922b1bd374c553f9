"""bankml.engine_cupy.kernels.progress: the compile report a start-up shows.

Each run is a fresh Python process with NUMBA_CACHE_DIR in a temporary directory, compiling a
two-kernel package written here (``kernel`` calls ``helper``), once cold and once from the cache.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import bankml

KERNEL = """\
from bankml.engine_cupy.kernels.jit import njit


@njit
def helper(x):
    return x * 2.0


@njit
def kernel(x):
    return helper(x) + 1.0
"""

RUN = """\
import json
from bankml.engine_cupy.kernels import progress
from progpkg.kernel import kernel
lines = []
with progress.reporting(lines.append, "a test") as stats:
    value = kernel(3.0)
print(json.dumps({"value": value, "lines": lines, "compiled": [n for n, _ in stats.kernels]}))
"""


def run(root: Path) -> dict:
    repo = Path(bankml.__file__).resolve().parent.parent
    env = dict(
        os.environ,
        NUMBA_CACHE_DIR=str(root / "numba-cache"),
        PYTHONPATH=os.pathsep.join([str(root), str(repo)]),
    )
    done = subprocess.run(
        [sys.executable, "-c", RUN], env=env, cwd=root, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_first_start_is_reported_and_a_cached_start_says_so(tmp_path: Path) -> None:
    package = tmp_path / "progpkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "kernel.py").write_text(KERNEL)

    cold = run(tmp_path)
    assert cold["value"] == 7.0
    # one top-level kernel: the helper it calls compiles inside it and is not listed apart
    assert cold["compiled"] == ["kernel.kernel"]
    first, kernel_line, last = cold["lines"]
    assert first.startswith("compiling the exact CPU kernels for a test (first start")
    assert "later starts load them from the cache in seconds" in first
    assert kernel_line.startswith("compiled kernel.kernel in ")
    assert last.startswith("kernels for a test ready: 1 compiled in ")

    warm = run(tmp_path)
    assert warm["value"] == 7.0 and warm["compiled"] == []
    (line,) = warm["lines"]
    assert line.startswith("kernels for a test loaded from the cache in ")
