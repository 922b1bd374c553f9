"""bench/gpu_check.py, the GPU check (docs/gpu.md), run on the CPU.

CI has no GPU, so the script is run with ``--device cpu``: the array path (exact=False, the code
CuPy runs) against the exact path and the real llama-server, on two tiny models it builds. These
tests check that it runs end to end, that its JSON says what a GPU run reports, that a model
that fails does not stop the others, and what the check and scripts/gpu-check.sh say when a part
is missing.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench import gpu_check
from tests import tiny_models
from tests.bankml_process import process_gone
from tests.tiny_models import write_tiny_model

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "gpu_check.py"
SHELL_SCRIPT = ROOT / "scripts" / "gpu-check.sh"


@pytest.fixture(scope="module")
def quick_report(
    tmp_path_factory: pytest.TempPathFactory, llama_server_bin: Path, default_model: Path
) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("gpu-check")
    run = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--device",
            "cpu",
            "--quick",
            "--jobs",
            "1",
            "--out",
            str(out),
            "--vocab",
            str(default_model),
            "--llama-server",
            str(llama_server_bin),
        ],
        capture_output=True,
        text=True,
        timeout=900,  # a hang guard: a cold Numba cache on a busy 2-core machine takes minutes
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    print(run.stdout[:-1].rsplit("\n", 1)[0])  # the table, for the log
    return json.loads(run.stdout.strip().splitlines()[-1]), out


@pytest.mark.llama_server
@pytest.mark.slow
def test_quick_run_reports_both_paths(quick_report: tuple[dict, Path]) -> None:
    report, out = quick_report
    assert report["device"] == "cpu" and report["quick"] is True
    assert report["errors"] == 0, report
    assert report["llama_server"].startswith("ran: ")
    assert json.loads((out / gpu_check.RESULT_FILE).read_text()) == report
    assert [m["model"] for m in report["models"]] == [s.name for s in gpu_check.QUICK_SPECS]
    for m in report["models"]:
        n = m["prompts"]
        assert n == 3 and m["greedy_tokens"] == 16 and m["array_device"] == "cpu"
        a = m["array_vs_exact"]
        # the array path computes the same model in f32 products, not the same bits:
        # measured 0.471 and 0.487, top-1 2/3 and 3/3, greedy 2/3 and 1/3
        assert 0 < a["max_top10_logprob_diff"] < 1.0
        assert 1 <= a["same_top1"] <= n and 0 <= a["greedy_identical"] <= n
        assert len(a["greedy_split_at"]) == n - a["greedy_identical"]
        exact, array = m["vs_llama_server"]["exact"], m["vs_llama_server"]["array"]
        # the exact path is llama-server's arithmetic (tests/test_forward.py): measured 0.000001, 3/3
        assert exact["max_top10_logprob_diff"] < 1e-4
        assert exact["same_top1"] == n and exact["greedy_identical"] == n
        # so the array path sits as far from llama-server as from the exact path
        assert math.isclose(
            array["max_top10_logprob_diff"], a["max_top10_logprob_diff"], abs_tol=1e-4
        )
        assert array["greedy_identical"] == a["greedy_identical"]
        # every part that gave a figure above has its seconds (a float), named <part>_s
        assert {"array_vs_exact_s", "vs_llama_server_s"} <= set(m["times"]), m["times"]
        assert all(k.endswith("_s") and isinstance(t, float) for k, t in m["times"].items())
    assert report["default_model"] is None  # quick mode checks only the tiny models


def test_a_failing_worker_does_not_stop_the_others(tmp_path: Path) -> None:
    def writer(name: str) -> tuple[str, list[str], Path]:
        result = tmp_path / f"{name}.json"
        code = f"open({str(result)!r}, 'w').write('{{\"model\": \"{name}\"}}')"
        return name, [sys.executable, "-c", code], result

    crash = (
        "crash",
        [sys.executable, "-c", "import sys; print('boom'); sys.exit(3)"],
        tmp_path / "crash.json",
    )
    results = gpu_check.run_workers(
        [crash, writer("good")], parallel=2, deadline=time.monotonic() + 60
    )
    assert results["good"] == {"model": "good"}
    assert (
        "exit status 3" in results["crash"]["error"]["worker"]
        and "boom" in results["crash"]["error"]["worker"]
    )

    # A worker past the budget is killed, not waited for: it would leave a mark if it ran to its
    # own end (an hour away; the budget is 2 s), and it is gone when run_workers returns.
    pid_file, finished = tmp_path / "hang.pid", tmp_path / "hang.finished"
    code = (
        f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); "
        f"time.sleep(3600); open({str(finished)!r}, 'w')"
    )
    hang = ("hang", [sys.executable, "-c", code], tmp_path / "hang.json")
    results = gpu_check.run_workers(
        [hang, writer("late")], parallel=1, deadline=time.monotonic() + 2
    )
    assert "past the time budget" in results["hang"]["error"]["worker"]
    assert not finished.exists()
    if pid_file.exists():  # it got as far as starting
        assert process_gone(int(pid_file.read_text()), 0), "the worker outlived its budget"
    assert results["late"] == {
        "model": "late",
        "error": {"budget": "skipped: the time budget was spent"},
    }


def test_a_killed_check_takes_its_workers_with_it(tmp_path: Path) -> None:
    """SIGKILL of the check (a timeout, Ctrl-C twice) leaves no worker compiling on its own."""
    pid_file = tmp_path / "worker.pid"
    hang = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(60)"
    orchestrator = (
        "import sys, time; from bench import gpu_check; "
        f"gpu_check.run_workers([('hang', [sys.executable, '-c', {hang!r}], "
        f"__import__('pathlib').Path({str(tmp_path / 'hang.json')!r}))], 1, time.monotonic() + 60)"
    )
    proc = subprocess.Popen([sys.executable, "-c", orchestrator], cwd=ROOT)
    try:
        deadline = time.monotonic() + 60
        while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
            time.sleep(0.1)
        worker_pid = int(pid_file.read_text())
    finally:
        proc.kill()
        proc.wait()
    # the worker dies with the check (a signal at its parent's death): waited for as an
    # event, the deadline a hang guard only
    assert process_gone(worker_pid, 120), f"worker {worker_pid} outlived the check"


def test_a_model_that_fails_is_reported_with_its_traceback(tmp_path: Path) -> None:
    result = gpu_check.check_model(tmp_path / "missing.gguf", "cpu", 2, 4, None)
    assert set(result["error"]) == {"load_array", "load_exact"}
    assert all("Traceback" in tb and "missing.gguf" in tb for tb in result["error"].values())
    assert (
        "array_vs_exact" not in result
        and "failed: load_array, load_exact" in gpu_check.table_row(result)
    )


@pytest.mark.llama_server
def test_one_path_failing_leaves_the_other_figures(
    tmp_path: Path, default_model: Path, llama_server_bin: Path
) -> None:
    """On a GPU machine the array path may fail (CuPy) while the exact path works, or the other
    way round (Numba there): what can still be compared is."""
    spec = gpu_check.QUICK_SPECS[0]
    path = write_tiny_model(tmp_path / f"{spec.name}.gguf", spec, default_model)
    result = gpu_check.check_model(path, "cuda-typo", 2, 4, llama_server_bin)
    assert list(result["error"]) == ["load_array"] and "cuda-typo" in result["error"]["load_array"]
    assert "array_vs_exact" not in result and "array_device" not in result
    exact = result["vs_llama_server"]["exact"]
    assert set(result["vs_llama_server"]) == {"exact"}
    assert (
        exact["same_top1"] == 2
        and exact["greedy_identical"] == 2
        and exact["max_top10_logprob_diff"] < 1e-4
    )


def test_without_a_vocabulary_file_it_says_how_to_fetch_one(tmp_path: Path) -> None:
    missing = tmp_path / "no.gguf"
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--quick", "--vocab", str(missing)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2 and "scripts/fetch-model.sh" in run.stderr


def test_no_llama_server_unless_one_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """A clean clone has no llama-server: the check runs without one and says how to add it,
    never building one on its own."""
    monkeypatch.delenv("BANKML_LLAMA_SERVER", raising=False)
    server, note = gpu_check.find_server(None)
    assert server is None and "--llama-server" in note
    server, note = gpu_check.find_server("/nonexistent/llama-server")
    assert server is None and "nonexistent" in note


@pytest.mark.skipif(
    any(shutil.which(tool) for tool in ("nvidia-smi", "rocm-smi")) or Path("/dev/kfd").exists(),
    reason="this machine has a GPU tool: the script would install CuPy",
)
def test_the_shell_script_without_a_gpu_asks_which_kind(tmp_path: Path) -> None:
    """On a machine with neither nvidia-smi nor rocm-smi it stops before installing anything."""
    venv = tmp_path / "venv"
    run = subprocess.run(
        ["bash", str(SHELL_SCRIPT)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "VENV": str(venv), "OUT": str(tmp_path / "out")},
    )
    assert run.returncode == 2 and "--cuda or --rocm" in run.stderr, run.stderr
    assert not venv.exists()


def test_the_tiny_models_keep_their_shape() -> None:
    assert all((spec.n_embd, spec.n_head) == (256, 4) for spec in tiny_models.TINY_SPECS)


@pytest.mark.llama_server
def test_the_decode_step_is_a_side_of_its_own(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, llama_server_bin: Path, default_model: Path
) -> None:
    """On a CUDA device a full-size model is also loaded as ``Model.load`` chooses there, the
    decode step (device_model.DeviceModel), and that side is compared with the exact path and
    with llama-server (given ``--ngl``) and timed beside them; a shaped model is written first.
    Run here through the CuPy stand-in whose kernels are the NumPy twins, on small shapes."""
    from gguf import GGMLQuantizationType as T

    from bankml.engine_cupy import backend
    from tests.fake_cupy_kernels import KernelCupy

    cp = KernelCupy()
    monkeypatch.setitem(sys.modules, "cupy", cp)
    monkeypatch.setattr(backend, "_cupy_with_gpu", lambda: (cp, ""))
    small = tiny_models.TinySpec("llama", T.Q4_K, tied=False, out_type=T.Q6_K)
    monkeypatch.setattr(gpu_check, "SHAPED_SPECS", {"llama-small-Q4_K": small})
    args = gpu_check.parse_args(
        ["--device", "cuda", "--vocab", str(default_model), "--ngl", "99", "--threads", "2"]
        + ["--default-prompts", "2", "--greedy", "4", "--prefill", "24", "--decode", "4"]
        + ["--rounds", "1", "--models", "llama-small-Q4_K"]
    )
    assert gpu_check.chosen_models(args) == ([], False, ["llama-small-Q4_K"])
    assert gpu_check.server_args_of(args) == ["-ngl", "99"]
    path = tmp_path / "llama-small-Q4_K.gguf"
    deadline = time.monotonic() + 600
    result = gpu_check.full_size_checks(path, args, llama_server_bin, deadline, "llama-small-Q4_K")
    assert result["model"] == "llama-small-Q4_K" and "error" not in result, result
    assert {"write_s", "load_device_step_s", "device_step_vs_exact_s"} <= set(result["times"])
    step = result["device_step_vs_exact"]
    # the step's q8_1 activations are ggml CUDA's, not the CPU's: near the exact path, not its bits
    assert 0 <= step["max_top10_logprob_diff"] < 1.0 and step["same_top1"] >= 1
    served = result["vs_llama_server"]["device_step"]
    assert math.isclose(
        served["max_top10_logprob_diff"], step["max_top10_logprob_diff"], abs_tol=1e-4
    )
    assert {"array", "exact", "device_step", "llama_server"} <= set(result["speed"])
    # a model the step does not play keeps the array path, with the reason, and no such side
    qwen3 = write_tiny_model(
        tmp_path / "qwen3.gguf", tiny_models.TinySpec("qwen3", T.Q4_0), default_model
    )
    noted: dict = {}
    models = gpu_check.load_models(noted, qwen3, "cuda")
    assert set(models) == {"array", "exact"} and "qwen3" in noted["device_step"]
