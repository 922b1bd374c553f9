"""The suite's kernels compiled ahead, in a process beside the tests.

A fresh checkout's suite compiles the exact kernels of every type set its tiny models use
(tests/tiny_models.py) the first time a test runs each of them, on the test process's core,
while the other core often waits on a server. conftest starts this module in the background,
at the lowest useful priority (nice 10), when the run includes tests on tiny models: it
writes those models and runs their warm-up (Model.warm_up, one process), in the order the
tests meet them, so that Numba's on-disk cache (the checkout's, shared by every process) holds
the kernels before the tests ask. Nothing here is checked: a kernel not ready in time is
compiled by the test, as without it, and the bits are the same whichever process compiled
them (bankml.engine_cupy.kernels.jit).

    python -m tests.precompile OUT_DIR DEFAULT_MODEL
"""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

from bankml.engine_cupy.compile_jobs import end_with_parent
from bankml.engine_cupy.engine import compile_kernels
from tests.tiny_models import FAST_SPECS, TINY_SPECS, write_tiny_model


def main(out_dir: Path, default_model: Path) -> None:
    threading.Thread(target=end_with_parent, args=(os.getppid(), 0), daemon=True).start()
    specs = list(dict.fromkeys(FAST_SPECS + TINY_SPECS))  # test_decode_batch's order first
    for spec in specs:
        path = write_tiny_model(out_dir / f"{spec.name}.gguf", spec, default_model)
        compile_kernels(path, device="cpu", jobs=1)  # one core: the tests keep the other
        path.unlink()
    compile_kernels(default_model, device="cpu", cache_type="q8_0", jobs=1)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
