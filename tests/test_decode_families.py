"""A first start compiles only the products of the model's weight families, on two processes.

Each run is a fresh process with its own Numba cache (NUMBA_CACHE_DIR in a temporary
directory), which runs the model's warm-up with two processes (compile_jobs: this one runs the
fused decode step, a compile job the rest, which this one then loads), then says which
products the cache holds: a kernel compiled inside its caller is cached (and listed in the
index of its own dispatcher's cache) too, whichever process compiled it. The one-row products of exact_matmul (Q4_0..Q8_0, the float types),
exact_kquants and exact_iquants (IQ4, the grid and TQ types), and the batched step's two
kinds (exact_matmul's tiles, the K-quant/IQ4 dots) are watched, and within exact_matmul's
family the type codes its per-type loops were compiled for (each loop is compiled with the code
as a constant, once per type it meets). A second process on the same cache loads the steps and
compiles nothing.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

from gguf import GGMLQuantizationType as T

import bankml
from bankml.engine_cupy.kernels import exact_matmul
from bankml.engine_cupy.kernels.jit import KERNEL_TYPES_ENV
from bankml.engine_cupy.model import Model

RUN = """\
import hashlib, json, sys
from bankml.engine_cupy.kernels import exact_batch, exact_iquants, exact_kquants, exact_matmul
from bankml.engine_cupy.model import Model

model = Model.load(sys.argv[1], device="cpu", progress=False)
assert model.ops.plan is not None, "the fused step does not take this model"
lines = []
stats = model.warm_up(report=lines.append, jobs=2)
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
loaded = {  # the batched step's kernels, which the job compiles
    "exact_batch.attention_inputs": exact_batch.attention_inputs,
    "exact_batch.layer_rest": exact_batch.layer_rest,
}


def on_disk(kernel):  # the signatures in the cache's index, whichever process compiled them
    return [key[0] for key in kernel._cache._cache_file._load_index()]


codes = sorted({sig[0].literal_value for kernel in per_type for sig in on_disk(kernel)})
cache = model.new_cache(64)
logits = [model.forward(list(range(100, 140)), cache), model.forward([7], cache)]
print(json.dumps({
    "logits": [hashlib.sha256(row.tobytes()).hexdigest() for row in logits],
    "compiled": sorted(name for name, kernel in products.items() if on_disk(kernel)),
    "kernels": [name for name, _ in stats.kernels],
    "loaded": [name for name, kernel in loaded.items() if kernel.signatures],
    "cached": [name for name, kernel in loaded.items() if on_disk(kernel)],
    "matmul codes": codes,
    "report": lines,
}))
"""


def run(model: Path, cache: Path) -> dict:
    repo = Path(bankml.__file__).resolve().parent.parent
    env = dict(os.environ, NUMBA_CACHE_DIR=str(cache), PYTHONPATH=str(repo))
    env.pop(KERNEL_TYPES_ENV, None)  # a start's own type set, not the suite's all-types kernels
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
    Q4_0, Q5_0, Q5_1, repacked Q4_0 or the float types), the batched step's compiled by the
    compile job and loaded here; then all from the cache."""
    cold = run(default_model, tmp_path / "numba-cache")
    assert cold["compiled"] == ["batch tiles", "matmul"]
    q4_1, q8_0 = exact_matmul._LAYOUT[T.Q4_1][0], exact_matmul._LAYOUT[T.Q8_0][0]
    assert cold["matmul codes"] == sorted([q4_1, q8_0])
    assert "exact_decode.decode_stack" in cold["kernels"]  # decode_layer compiles within it
    assert any(line.startswith("compiling on 2 processes") for line in cold["report"])
    assert not any("compile job" in line and "ended with status" in line for line in cold["report"])
    for kernel in ("exact_batch.attention_inputs", "exact_batch.layer_rest"):
        assert kernel in cold["loaded"] and kernel not in cold["kernels"], cold
        assert kernel in cold["cached"]

    warm = run(default_model, tmp_path / "numba-cache")
    assert warm["kernels"] == []
    # the kernels compiled for every type (this process's, BANKML_KERNEL_TYPES=all) give the
    # same bits as the file's own type set
    assert os.environ.get(KERNEL_TYPES_ENV) == "all"
    model = Model.load(default_model, device="cpu", progress=False)
    assert all(family is not None for family in model.ops.plan.families)
    assert exact_matmul.code_set([q4_1]) == (True,) * exact_matmul.N_CODES
    cache = model.new_cache(64)
    logits = [model.forward(list(range(100, 140)), cache), model.forward([7], cache)]
    assert [hashlib.sha256(row.tobytes()).hexdigest() for row in logits] == cold["logits"]
    assert warm["logits"] == cold["logits"]
