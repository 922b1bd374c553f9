"""compile_jobs: how a cold warm-up is cut between processes, and its jobs' faults.

That the jobs' kernels are the ones a start-up then loads, and that it compiles only its own
part, is checked on a real cold cache by test_decode_families.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bankml.engine_cupy import compile_jobs
from bankml.engine_cupy.exact_backend import WARM_UP_STEPS


@pytest.mark.parametrize("processes", [1, 2, 3, 4, 16])
def test_every_step_runs_in_exactly_one_part(processes: int) -> None:
    parts = compile_jobs.parts_for(processes)
    steps = [step for part in parts for step in part]
    assert sorted(steps) == sorted(WARM_UP_STEPS)
    assert "decode" in parts[0]  # the step every answer runs compiles in the start-up
    assert len(parts) == min(processes, 3)


def test_a_failed_job_leaves_its_part_to_the_start_up(tmp_path: Path) -> None:
    not_a_model = tmp_path / "not-a-model.gguf"
    not_a_model.write_bytes(b"GGUF" + b"\0" * 60)
    lines: list[str] = []
    jobs = compile_jobs.Jobs(str(not_a_model), None, [("batch",), ("prompt",)], lines.append)
    assert jobs.wait() == []  # none started yet
    jobs.start()
    jobs.start()  # once only
    assert jobs.wait() == [("batch",), ("prompt",)]
    assert lines[0] == "compiling on 3 processes: this one and 2 compile jobs"
    assert len(lines) == 3
    assert all(
        "ended with status 1" in line and "compiling its part here" in line for line in lines[1:]
    )


STARTER = """\
import os, sys
from bankml.engine_cupy import compile_jobs
jobs = compile_jobs.Jobs(sys.argv[1], None, [("batch", "prompt", "attention")])
jobs.start()
print(jobs._running[0][1].pid, flush=True)
os._exit(0)  # gone without stopping its job
"""


def test_a_job_ends_when_its_start_up_is_gone(default_model: Path, tmp_path: Path) -> None:
    """A job compiling into a cold cache ends within seconds once the process that launched
    it is gone, instead of compiling on for nobody."""
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "numba-cache"))
    done = subprocess.run(
        [sys.executable, "-c", STARTER, str(default_model)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    pid = int(done.stdout.split()[0])
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and _running(pid):
        time.sleep(0.2)
    assert not _running(pid)


def _running(pid: int) -> bool:
    """Whether ``pid`` is a live process (not a zombie left for init to reap)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"
