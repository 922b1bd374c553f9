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


# --- scripts/gpu-check.sh, with stand-ins for the GPU's tools, pip, CMake and the check ----------

# Each stand-in appends one line to $STUB_LOG: its name, its arguments, and (the check) the
# deadline it was given and whether the llama-server build was running when it started.
STUB_PYTHON = r"""#!{python}
import json, os, signal, sys, time
from pathlib import Path

argv, stubs = sys.argv[1:], Path(os.environ["STUB_DIR"])
def log(line):
    with open(os.environ["STUB_LOG"], "a") as f:
        f.write(line + "\n")
if argv[:1] != ["bench/gpu_check.py"]:
    log("python " + " ".join(argv).replace("\n", " "))
    if argv[:2] == ["-m", "bankml.engine_cupy.cuda_kernels"]:
        print(json.dumps({{"kernels": 1, "compiled": 1}}))
    sys.exit(0)  # pip, and the compile-only's question (a libnvrtc is found)
(stubs / "check.started").touch()
building = (stubs / "build.started").exists() and not (stubs / "build.ended").exists()
env = {{k: os.environ.get(k) for k in ("BANKML_GPU_CHECK_DEADLINE", "BANKML_GPU_CHECK_STARTED",
                                      "BANKML_GPU_CHECK_TIMINGS")}}
mode, status = os.environ.get("STUB_CHECK", ""), None
if "--llama-server-build-status" in argv and not mode:  # as the check: wait for the build
    path = Path(argv[argv.index("--llama-server-build-status") + 1])
    for _ in range(300):
        if path.exists():
            status = path.read_text().splitlines()
            break
        time.sleep(0.1)
log("check " + json.dumps({{"argv": argv, "env": env, "building": building, "status": status}}))
out = Path(argv[argv.index("--out") + 1])
(out / "gpu_check.json").write_text(json.dumps({{"device": "cuda", "models": []}}, indent=1))
if mode == "ignores-term":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if mode == "stops-on-term":
    def stop(*_):
        print(json.dumps({{"stopped": "SIGTERM"}}))
        sys.exit(0)
    signal.signal(signal.SIGTERM, stop)
if mode:
    time.sleep(120)
print(json.dumps({{"device": "cuda", "stub": True}}))
"""

# cmake: a configure is logged; a build (held until the check has started, at most 30 s, so
# that a build run before the check, not beside it, shows) leaves a llama-server that answers
# --version. STUB_BUILD=hang: a build that never ends, its pid in build.pid.
STUB_CMAKE = r"""#!/bin/bash
echo "cmake $*" >>"$STUB_LOG"
[ "$1" = --build ] || exit 0
touch "$STUB_DIR/build.started"
if [ "${STUB_BUILD:-}" = hang ]; then
  echo $$ >"$STUB_DIR/build.pid"
  sleep 120
fi
for _ in $(seq 300); do [ -e "$STUB_DIR/check.started" ] && break; sleep 0.1; done
mkdir -p "$2/bin"
printf '#!/bin/sh\necho "version: stub"\n' >"$2/bin/llama-server"
chmod +x "$2/bin/llama-server"
touch "$STUB_DIR/build.ended"
"""

STUB_NVIDIA_SMI = r"""#!/bin/bash
echo "nvidia-smi $*" >>"$STUB_LOG"
if [ "$*" = "--query-gpu=compute_cap --format=csv,noheader" ]; then echo "9.0"; exit 0; fi
echo "NVIDIA H100 80GB HBM3, 550.54.15, 81559 MiB, 9.0"
"""


@pytest.fixture
def sandbox(tmp_path: Path) -> dict[str, Path]:
    """A copy of the two scripts with a stand-in scripts/fetch-model.sh, a venv whose python is
    the stand-in above, and nvidia-smi, cmake and nvcc stand-ins first on the PATH; the
    llama-server cache holds the build 11434 source's top file, so nothing is downloaded."""
    repo, bin_dir, stubs = tmp_path / "repo", tmp_path / "bin", tmp_path / "stubs"
    for d in (repo / "scripts", bin_dir, stubs, tmp_path / "venv" / "bin", tmp_path / "out"):
        d.mkdir(parents=True)
    for name in ("gpu-check.sh", "build-llama-server.sh"):
        shutil.copy2(ROOT / "scripts" / name, repo / "scripts" / name)
    cache = tmp_path / "cache"
    source = cache / "llama-server" / "11434" / "src" / "llama.cpp"
    source.mkdir(parents=True)
    (source / "CMakeLists.txt").touch()
    files = {
        repo / "scripts" / "fetch-model.sh": '#!/bin/bash\necho "fetch-model" >>"$STUB_LOG"\n'
        "echo models/stub.gguf\n",
        tmp_path / "venv" / "bin" / "python": STUB_PYTHON.format(python=sys.executable),
        bin_dir / "cmake": STUB_CMAKE,
        bin_dir / "nvcc": "#!/bin/sh\nexit 0\n",
        bin_dir / "nvidia-smi": STUB_NVIDIA_SMI,
    }
    for path, text in files.items():
        path.write_text(text)
        path.chmod(0o755)
    return {"root": tmp_path, "repo": repo, "bin": bin_dir, "stubs": stubs, "cache": cache}


def run_script(
    box: dict[str, Path], *args: str, timeout: float = 60, **env: str
) -> tuple[subprocess.CompletedProcess[str], list[str], dict | None]:
    """The copied script run with ``args``: its result, the stand-ins' log lines and the check's
    record (None when the check did not run)."""
    root = box["root"]
    base = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("BANKML_LLAMA_SERVER", "BANKML_CUDA", "BANKML_BUILD", "STUB_"))
    }
    run = subprocess.run(
        ["bash", str(box["repo"] / "scripts" / "gpu-check.sh"), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={
            **base,
            "PATH": f"{box['bin']}:{os.environ['PATH']}",
            "VENV": str(root / "venv"),
            "OUT": str(root / "out"),
            "BANKML_CACHE": str(box["cache"]),
            "STUB_LOG": str(root / "calls.log"),
            "STUB_DIR": str(box["stubs"]),
            **env,
        },
    )
    log = root / "calls.log"
    lines = log.read_text().splitlines() if log.exists() else []
    checks = [json.loads(line[len("check ") :]) for line in lines if line.startswith("check ")]
    assert len(checks) <= 1, lines
    return run, lines, checks[0] if checks else None


def option(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


@pytest.mark.parametrize("args", [[], ["--with-llama-server"]])
def test_the_script_builds_llama_server_cuda_for_this_gpu_beside_the_check(
    sandbox: dict[str, Path], args: list[str]
) -> None:
    """With nothing prepared: the llama-server target alone, CUDA, for the detected architecture
    only (compute capability 9.0 -> 90), all cores; the check started while it was building and
    was handed the build's status file, which names the binary."""
    run, calls, check = run_script(sandbox, *args)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout.splitlines()[-1]) == {"device": "cuda", "stub": True}
    configure = [c for c in calls if c.startswith("cmake -S")]
    build = [c for c in calls if c.startswith("cmake --build")]
    assert len(configure) == 1 and len(build) == 1, calls
    assert "-DGGML_CUDA=ON" in configure[0].split()
    assert "-DCMAKE_CUDA_ARCHITECTURES=90" in configure[0].split()
    nproc = subprocess.run(["nproc"], capture_output=True, text=True).stdout.strip()
    assert build[0].split()[3:] == ["--target", "llama-server", "-j", nproc], build[0]
    assert any(c.startswith("python -m pip install -q -e .[cuda]") for c in calls), calls
    assert check is not None and check["building"], "the build did not run beside the check"
    argv = check["argv"]
    assert option(argv, "--device") == "cuda" and option(argv, "--ngl") == "99"
    assert option(argv, "--llama-server") == "none"  # until the build's status file says
    assert option(argv, "--llama-server-build-status") == str(
        sandbox["root"] / "out" / "llama-server-build.status"
    )
    binary = sandbox["cache"] / "llama-server" / "11434" / "bin-cuda" / "llama-server"
    assert check["status"][0] == "0" and check["status"][2] == str(binary), check["status"]


def test_a_named_cuda_llama_server_is_used_and_nothing_built(sandbox: dict[str, Path]) -> None:
    run, calls, check = run_script(sandbox, BANKML_LLAMA_SERVER_CUDA="/opt/cuda/llama-server")
    assert run.returncode == 0, run.stderr
    assert not [c for c in calls if c.startswith("cmake")], calls
    assert check is not None
    assert option(check["argv"], "--llama-server") == "/opt/cuda/llama-server"
    assert option(check["argv"], "--ngl") == "99"
    assert "--llama-server-build-status" not in check["argv"]


def test_no_llama_server_builds_nothing(sandbox: dict[str, Path]) -> None:
    run, calls, check = run_script(sandbox, "--no-llama-server", "--with-llama-server")
    assert run.returncode == 0, run.stderr
    assert not [c for c in calls if c.startswith("cmake")], calls
    assert check is not None and option(check["argv"], "--llama-server") == "none"
    assert "--ngl" not in check["argv"] and "--llama-server-build-status" not in check["argv"]


def test_compile_only_runs_the_compile_check_alone(sandbox: dict[str, Path]) -> None:
    run, calls, check = run_script(sandbox, "--compile-only")
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout.splitlines()[-1]) == {"kernels": 1, "compiled": 1}
    assert calls[-1] == "python -m bankml.engine_cupy.cuda_kernels", calls
    assert [c.split()[:2] for c in calls] == [["python", "-c"], ["python", "-m"]], calls
    assert check is None


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--bogus"], "unknown argument: --bogus"),
        (["--device", "cpu"], "unknown argument: --device"),
        (["--budget-s", "soon"], "--budget-s takes whole seconds"),
        (["--budget-s"], "--budget-s needs a number"),
        (["--models"], "--models needs a value"),
    ],
)
def test_the_script_refuses_what_it_does_not_know(
    sandbox: dict[str, Path], args: list[str], said: str
) -> None:
    run, calls, _ = run_script(sandbox, *args)
    assert run.returncode == 2 and said in run.stderr, run.stderr
    assert calls == []  # before installing, building or fetching anything


def test_the_deadline_is_passed_to_the_check(sandbox: dict[str, Path]) -> None:
    """480 s from the script's start unless --budget-s says; the check plans to end 10 s before
    it. The check's own arguments pass through."""
    run, _, check = run_script(
        sandbox, "--budget-s", "300", "--quick", "--models=default", "--jobs", "3"
    )
    assert run.returncode == 0, run.stderr
    assert check is not None
    env = check["env"]
    started, deadline = int(env["BANKML_GPU_CHECK_STARTED"]), int(env["BANKML_GPU_CHECK_DEADLINE"])
    assert deadline - started == 290
    timings = json.loads(env["BANKML_GPU_CHECK_TIMINGS"])
    assert timings["deadline_s"] == 300 and 0 <= timings["install_s"] <= timings["model_fetch_s"]
    assert check["argv"][-4:] == ["--quick", "--models=default", "--jobs", "3"]
    assert option(check["argv"], "--model") == "models/stub.gguf"
    for name in ("check.started", "build.started", "build.ended"):
        (sandbox["stubs"] / name).unlink(missing_ok=True)
    (sandbox["root"] / "calls.log").unlink()
    run, _, check = run_script(sandbox, "--no-llama-server")
    assert check is not None
    env = check["env"]
    assert int(env["BANKML_GPU_CHECK_DEADLINE"]) - int(env["BANKML_GPU_CHECK_STARTED"]) == 470


def test_the_checks_own_arguments_pass_through(
    sandbox: dict[str, Path], default_model: Path
) -> None:
    """Those the script documents reach bench/gpu_check.py as given, and it takes them."""
    given = ["--quick", "--models", "default", "--model", str(default_model), "--vocab"]
    given += [str(default_model), "--prompts", "1", "--greedy", "2", "--default-prompts", "1"]
    given += ["--prefill", "8", "--decode", "2", "--rounds", "1", "--threads", "2", "--jobs=1"]
    run, _, check = run_script(sandbox, "--no-llama-server", *given)
    assert run.returncode == 0, run.stderr
    assert check is not None and check["argv"][-len(given) :] == given
    args = gpu_check.parse_args(given)
    assert (args.quick, args.models, args.decode, args.jobs) == (True, "default", 2, 1)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["stops-on-term", "ignores-term"])
def test_the_script_ends_at_its_deadline(sandbox: dict[str, Path], mode: str) -> None:
    """A check still busy at the deadline is told to stop (SIGTERM) and prints its report; one
    that does not stop is killed, and the script prints the report as last saved. A llama-server
    build still running is stopped with its compilers."""
    start = time.monotonic()
    run, _, check = run_script(sandbox, "--budget-s", "12", STUB_CHECK=mode, STUB_BUILD="hang")
    took = time.monotonic() - start
    assert took < 20, took
    assert check is not None and check["status"] is None  # the build never ended
    last = json.loads(run.stdout.splitlines()[-1])
    if mode == "stops-on-term":
        assert run.returncode == 0 and last == {"stopped": "SIGTERM"}, run.stdout
    else:
        assert run.returncode == 137, run.stdout + run.stderr
        assert "before its report" in last["stopped"] and last["device"] == "cuda", last
    assert sum(line.startswith("{") for line in run.stdout.splitlines()) == 1, run.stdout
    build = int((sandbox["stubs"] / "build.pid").read_text())
    assert process_gone(build, 10), "the llama-server build outlived the script: " + run.stderr


# --- the check's budget -----------------------------------------------------------------------


def test_a_budget_too_small_for_the_1b_model_skips_it(tmp_path: Path, default_model: Path) -> None:
    """The 1B-shape model needs its allowance; with less left it is not written, and the JSON
    names it with the seconds it needed and those left."""
    out, work = tmp_path / "out", tmp_path / "work"
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--models", "llama-1b-Q4_K"]
        + ["--budget-s", "60", "--llama-server", "none", "--vocab", str(default_model)]
        + ["--out", str(out), "--workdir", str(work)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    report = json.loads(run.stdout.splitlines()[-1])
    why = f"needs about {gpu_check.SHAPED_ALLOWANCE_S:.0f} s (an allowance), 60 s were left"
    assert report["shaped_models"] == [{"model": "llama-1b-Q4_K", "skipped": {"model": why}}]
    assert report["skipped"] == {"llama-1b-Q4_K": why} and report["errors"] == 0
    assert report["timings"]["budget_s"] == 60.0 and "total_s" in report["timings"]
    assert not list(work.glob("*.gguf"))


def test_the_checks_budget_is_the_time_left_of_the_scripts_deadline(
    monkeypatch: pytest.MonkeyPatch, default_model: Path
) -> None:
    vocab = ["--vocab", str(default_model)]
    monkeypatch.delenv(gpu_check.DEADLINE_ENV, raising=False)
    assert gpu_check.parse_args(vocab).budget_s == 900.0
    monkeypatch.setenv(gpu_check.DEADLINE_ENV, str(int(time.time()) + 100))
    assert 95 <= gpu_check.parse_args(vocab).budget_s <= 100
    assert gpu_check.parse_args([*vocab, "--budget-s", "5"]).budget_s == 5.0
    monkeypatch.setenv(gpu_check.DEADLINE_ENV, str(int(time.time()) - 100))
    assert gpu_check.parse_args(vocab).budget_s == 0.0


def test_a_llama_server_being_built_is_waited_for_only_until_the_time_given(
    tmp_path: Path,
) -> None:
    status = tmp_path / "llama-server-build.status"
    source = gpu_check.ServerSource.of("none", str(status))
    assert source.building and source.expected and source.poll() is None
    start = time.monotonic()
    assert source.wait(start + 1.5) is None
    assert 1.4 <= time.monotonic() - start < 5
    assert "not ready" in source.describe() and "ran out" in source.describe()
    # a build that failed: why, with the end of its log
    status.write_text("2\n40\n\nbuild-llama-server: --cuda needs nvcc\n")
    assert source.wait(time.monotonic() + 60) is None and not source.building
    assert source.describe() == "its build failed (exit 2): build-llama-server: --cuda needs nvcc"
    assert source.build_s == 40.0
    # a build that ended: its binary, asked for its version
    binary = tmp_path / "llama-server"
    binary.write_text('#!/bin/sh\necho "version: 11434 (stub)"\n')
    binary.chmod(0o755)
    status.write_text(f"0\n95\n{binary}\n")
    later = gpu_check.ServerSource.of(None, str(status))
    assert later.wait(time.monotonic() + 60) == binary
    assert later.describe() == "ran: version: 11434 (stub)" and later.build_s == 95.0


def test_sigterm_ends_the_check_with_its_report(tmp_path: Path, default_model: Path) -> None:
    """The models' work stood in for by a long sleep: SIGTERM (scripts/gpu-check.sh at its
    deadline) ends it, and the report, saying so, is printed and saved."""
    code = (
        "import sys, time; from bench import gpu_check; "
        "gpu_check.run_models = lambda *a: time.sleep(120); "
        "sys.exit(gpu_check.main(sys.argv[1:]))"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, "--device", "cpu", "--llama-server", "none"]
        + ["--vocab", str(default_model), "--out", str(tmp_path)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / gpu_check.RESULT_FILE).exists() and time.monotonic() < deadline:
            time.sleep(0.1)  # saved once the kernels' part is done: the models' work is next
        time.sleep(0.5)
        proc.terminate()
        stdout, _ = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0
    report = json.loads(stdout.splitlines()[-1])
    assert report["stopped"].startswith("SIGTERM") and "timings" in report
    assert json.loads((tmp_path / gpu_check.RESULT_FILE).read_text()) == report
