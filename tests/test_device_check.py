"""bench/device_check.py, the prepared GPU check, run here on the CPU (docs/device-check.md).

CI has no GPU, so the script is run with ``--device cpu``: the array path (exact=False, the code
CuPy runs) against the exact path and the real llama-server, on two tiny models it builds. These
tests check that it runs end to end, that its JSON says what the device run will report, that a
model that fails does not stop the others, and that the models built from the vocabulary file
that travels are the very models the oracle tests build from the default model.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench import device_check
from tests import tiny_models
from tests.tiny_models import write_tiny_model

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "device_check.py"


@pytest.fixture(scope="module")
def quick_report(
    tmp_path_factory: pytest.TempPathFactory, llama_server_bin: Path, default_model: Path
) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("device-check")
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
        timeout=300,
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
    assert json.loads((out / device_check.RESULT_FILE).read_text()) == report
    assert [m["model"] for m in report["models"]] == [s.name for s in device_check.QUICK_SPECS]
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
        assert all(t >= 0 for t in m["times"].values())
    assert report["big"] is None  # quick mode builds no big model


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
    results = device_check.run_workers(
        [crash, writer("good")], parallel=2, deadline=time.monotonic() + 60
    )
    assert results["good"] == {"model": "good"}
    assert (
        "exit status 3" in results["crash"]["error"]["worker"]
        and "boom" in results["crash"]["error"]["worker"]
    )

    hang = ("hang", [sys.executable, "-c", "import time; time.sleep(60)"], tmp_path / "hang.json")
    start = time.monotonic()
    results = device_check.run_workers([hang, writer("late")], parallel=1, deadline=start + 2)
    assert time.monotonic() - start < 10
    assert "past the time budget" in results["hang"]["error"]["worker"]
    assert results["late"] == {
        "model": "late",
        "error": {"budget": "skipped: the time budget was spent"},
    }


def test_a_model_that_fails_is_reported_with_its_traceback(tmp_path: Path) -> None:
    result = device_check.check_model(tmp_path / "missing.gguf", "cpu", 2, 4, None)
    assert set(result["error"]) == {"load_array", "load_exact"}
    assert all("Traceback" in tb and "missing.gguf" in tb for tb in result["error"].values())
    assert (
        "array_vs_exact" not in result
        and "failed: load_array, load_exact" in device_check.table_row(result)
    )


@pytest.mark.llama_server
def test_one_path_failing_leaves_the_other_figures(
    tmp_path: Path, default_model: Path, llama_server_bin: Path
) -> None:
    """On the GPU machine the array path may fail (CuPy) while the exact path works, or the other
    way round (Numba there): what can still be compared is."""
    spec = device_check.QUICK_SPECS[0]
    path = write_tiny_model(tmp_path / f"{spec.name}.gguf", spec, default_model)
    result = device_check.check_model(path, "cuda-typo", 2, 4, llama_server_bin)
    assert list(result["error"]) == ["load_array"] and "cuda-typo" in result["error"]["load_array"]
    assert "array_vs_exact" not in result and "array_device" not in result
    exact = result["vs_llama_server"]["exact"]
    assert set(result["vs_llama_server"]) == {"exact"}
    assert (
        exact["same_top1"] == 2
        and exact["greedy_identical"] == 2
        and exact["max_top10_logprob_diff"] < 1e-4
    )


@pytest.mark.slow
def test_models_from_the_travelling_vocabulary_equal_the_oracle_tests_models(
    tmp_path: Path, default_model: Path
) -> None:
    """The device builds its models from the vocabulary-only GGUF: byte for byte the files
    tests/test_forward.py builds from the default model."""
    vocab = device_check.write_vocab(tmp_path / "vocab.gguf", default_model)
    assert vocab.stat().st_size < 4 * 2**20  # it travels; the 92 MB model does not
    spec = device_check.QUICK_SPECS[0]
    a = write_tiny_model(tmp_path / "a.gguf", spec, default_model)
    b = write_tiny_model(tmp_path / "b.gguf", spec, vocab)
    assert a.read_bytes() == b.read_bytes()


def test_big_shape_is_the_default_models_and_the_tiny_ones_keep_theirs() -> None:
    big = device_check.BIG_SPEC
    assert (big.n_embd, big.n_head) == (576, 9)
    assert big.n_embd == big.n_head * big.head_dim
    assert all((spec.n_embd, spec.n_head) == (256, 4) for spec in tiny_models.TINY_SPECS)
