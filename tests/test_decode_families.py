"""The fused and batched decode steps compile only the products of the model's weight families.

Each run is a fresh process with its own Numba cache (NUMBA_CACHE_DIR in a temporary
directory), which runs one fused decode step and one batched step of a model, then says which
products Numba compiled: a kernel compiled inside its caller is listed in its own dispatcher's
``signatures`` too. The one-row products of exact_matmul (Q4_0..Q8_0, the float types),
exact_kquants and exact_iquants (IQ4, the grid and TQ types), and the batched step's two
kinds (exact_matmul's tiles, the K-quant/IQ4 dots) are watched, and within exact_matmul's
family the type codes its per-type loops were compiled for (each loop is compiled with the code
as a constant, once per type it meets). A second process on the same cache loads the steps and
compiles nothing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from gguf import GGMLQuantizationType as T

import bankml
from bankml.engine_cupy.kernels import exact_matmul

RUN = """\
import json, sys
from bankml.engine_cupy.kernels import exact_batch, exact_iquants, exact_kquants, exact_matmul
from bankml.engine_cupy.kernels import progress
from bankml.engine_cupy.model import Model

model = Model.load(sys.argv[1], device="cpu", progress=False)
assert model.ops.plan is not None, "the fused step does not take this model"
with progress.reporting() as stats:
    cache = model.new_cache(8)
    model.forward([0], cache)  # one token: the fused step
    model.decode_batch([1, 2], [cache, model.new_cache(8)])  # two f16 rows: the batched step
products = {
    "matmul": exact_matmul.row_product,
    "kquant": exact_kquants.row_product,
    "iq4": exact_iquants.row_product,
    "grid": exact_iquants.grid_row_product,
    "batch tiles": exact_batch._matmul_rows,
    "batch dots": exact_batch._dots,
}
per_type = [  # exact_matmul's loops compiled per weight type: the quantized, then the float
    exact_matmul._serial_for, exact_matmul._parallel_for, exact_matmul._one_row_serial,
    exact_matmul._one_row_parallel, exact_batch._q_serial, exact_batch._q_parallel,
    exact_matmul._float_serial, exact_matmul._float_parallel,
]
codes = sorted({sig[0].literal_value for kernel in per_type for sig in kernel.signatures})
print(json.dumps({
    "compiled": sorted(name for name, kernel in products.items() if kernel.signatures),
    "kernels": [name for name, _ in stats.kernels],
    "matmul codes": codes,
}))
"""


def run(model: Path, cache: Path) -> dict:
    repo = Path(bankml.__file__).resolve().parent.parent
    env = dict(os.environ, NUMBA_CACHE_DIR=str(cache), PYTHONPATH=str(repo))
    done = subprocess.run(
        [sys.executable, "-c", RUN, str(model)],
        env=env,
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_default_model_compiles_no_kquant_or_iq_product(
    default_model: Path, tmp_path: Path
) -> None:
    """Q4_1 and Q8_0 matrices: exact_matmul's products only, for those two types only (not
    Q4_0, Q5_0, Q5_1, repacked Q4_0 or the float types); then all from the cache."""
    cold = run(default_model, tmp_path / "numba-cache")
    assert cold["compiled"] == ["batch tiles", "matmul"]
    q4_1, q8_0 = exact_matmul._LAYOUT[T.Q4_1][0], exact_matmul._LAYOUT[T.Q8_0][0]
    assert cold["matmul codes"] == sorted([q4_1, q8_0])
    assert "exact_decode.decode_stack" in cold["kernels"]  # decode_layer compiles within it
    assert "exact_batch.layer_rest" in cold["kernels"]

    warm = run(default_model, tmp_path / "numba-cache")
    assert warm["kernels"] == []
