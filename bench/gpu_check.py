#!/usr/bin/env python3
"""The engine's array path (CuPy with --device cuda) against its exact CPU path on this machine.

    bench/gpu_check.py [--device cuda|cpu] [--quick] [--out DIR] [--model FILE] [--vocab FILE]
                       [--llama-server BIN|none] [--llama-server-build-status FILE]
                       [--jobs N] [--threads N] [--budget-s S]
                       [--models NAME,...] [--prompts N] [--greedy N]

scripts/gpu-check.sh sets up a clean clone and runs this (docs/gpu.md). For each tiny model
(every architecture and weight type of ``TINY_SPECS``, built with tests/tiny_models.py from the
default model's vocabulary) and for the default model itself, it loads the model twice,
``Model.load(device=DEVICE, exact=False, device_step=False)`` (the array path: CuPy on
``cuda``, NumPy on ``cpu``) and ``Model.load(device="cpu")`` (the exact path), and reports (a) the largest top-10
log-probability difference and the same top-1 over the prompts, (b) identical greedy answers,
(c) with a llama-server given, both paths against it, (d) prefill and decode tokens/s of both
paths (and llama-server) on the default model, (e) every exception with its traceback. A model
that fails is reported and the others go on.

Tiny models run in worker processes side by side (``--jobs``; Numba compiles each weight type's
kernels once there, cold on a fresh machine); the speed figures are taken afterwards, alone.
Results are written to DIR/gpu_check.json after each phase (a run cut short keeps what it had)
and end stdout as one JSON line. A part that would not fit in ``--budget-s`` is skipped and
named under ``skipped``; SIGTERM stops the check, which then prints what it has. The exit status is 0 when the run completed, whatever the
agreement: the array path is not meant to give the exact path's bits, so these are figures to
read, not a pass/fail test.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy
from gguf import GGMLQuantizationType as T

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bankml.engine_cupy.model import Model  # noqa: E402
from bankml.engine_cupy.tokenizer import Tokenizer  # noqa: E402
from bench import engine as bench_engine  # noqa: E402
from tests import support  # noqa: E402
from tests.engine_checks import (  # noqa: E402
    PROMPTS,
    compare_greedy,
    compare_next_token,
    engine_greedy,
    log_softmax,
    prefill,
)
from tests.tiny_models import TINY_SPECS, TinySpec, write_tiny_model  # noqa: E402

# Quick mode (the CPU test): two small models in Q4_1, the default model's type, so that the
# Numba kernels they need are the ones the rest of the suite compiles anyway.
QUICK_SPECS = (TinySpec("llama", T.Q4_1), TINY_SPECS[3])
# The name --models gives the default model (the real one: agreement and the speed figures).
DEFAULT_NAME = "default"
# Models of a real model's shape, built on the spot and checked like the default model (alone,
# with speed figures): Llama 3.2 1B's shape (16 layers, 2048 wide, 8192 feed-forward, 32 heads,
# 8 KV heads of 64) in a Q4_K_M file's two main types (Q4_K layers, a Q6_K output), random
# weights and the default model's vocabulary (49152 tokens where Llama 3.2 has 128256): 1.1
# billion weights, 0.7 GB.
SHAPED_SPECS = {
    "llama-1b-Q4_K": TinySpec(
        "llama",
        T.Q4_K,
        n_layer=16,
        tied=False,
        out_type=T.Q6_K,
        n_embd=2048,
        n_ff=8192,
        n_head=32,
        n_head_kv=8,
        head_dim=64,
    ),
}
RESULT_FILE = "gpu_check.json"
# The time a part is given before it starts, so that the check skips it rather than overrun its
# budget. Allowances, not measurements: a GPU run's `timings` say what the parts took.
KERNELS_ALLOWANCE_S = 30.0
DEFAULT_MODEL_ALLOWANCE_S = 60.0
SHAPED_ALLOWANCE_S = 180.0
SPEED_ALLOWANCE_S = 20.0
# after the wait for llama-server: the comparisons with it and the speed figures
SERVER_PARTS_ALLOWANCE_S = 25.0 + SPEED_ALLOWANCE_S
# scripts/gpu-check.sh's deadline (seconds since the epoch), its start, and its own phases' times
DEADLINE_ENV = "BANKML_GPU_CHECK_DEADLINE"
STARTED_ENV = "BANKML_GPU_CHECK_STARTED"
TIMINGS_ENV = "BANKML_GPU_CHECK_TIMINGS"


# --- building the models -----------------------------------------------------------------------


def spec_by_name(name: str) -> TinySpec:
    for spec in (*TINY_SPECS, *QUICK_SPECS):
        if spec.name == name:
            return spec
    known = ", ".join([s.name for s in (*TINY_SPECS, *QUICK_SPECS)] + list(SHAPED_SPECS))
    raise SystemExit(f"unknown model {name!r}; known: {known}, {DEFAULT_NAME}")


# --- the comparisons ---------------------------------------------------------------------------


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    start = time.perf_counter()
    value = fn()
    return value, round(time.perf_counter() - start, 2)


def array_vs_exact(
    array_model: Model, exact_model: Model, prompts: list[list[int]], greedy_n: int
) -> dict[str, Any]:
    """(a) the largest |log-prob difference| over the exact path's top 10 and the same top-1,
    (b) identical greedy answers (and where the others part)."""
    worst, same_top1 = 0.0, 0
    for ids in prompts:
        ref = log_softmax(prefill(exact_model, ids, exact_model.new_cache(len(ids) + 1)))
        got = log_softmax(prefill(array_model, ids, array_model.new_cache(len(ids) + 1)))
        top = numpy.argsort(-ref)[:10]
        worst = max(worst, float(numpy.abs(ref[top] - got[top]).max()))
        same_top1 += int(numpy.argmax(ref) == numpy.argmax(got))
    same_greedy, splits = 0, []
    for ids in prompts:
        ref_ids = engine_greedy(exact_model, ids, greedy_n)
        got_ids = engine_greedy(array_model, ids, greedy_n)
        if ref_ids == got_ids:
            same_greedy += 1
        else:
            splits.append(
                next(
                    (i for i, (a, b) in enumerate(zip(ref_ids, got_ids)) if a != b),
                    min(len(ref_ids), len(got_ids)),
                )
            )
    return {
        "max_top10_logprob_diff": round(worst, 6),
        "same_top1": same_top1,
        "greedy_identical": same_greedy,
        "greedy_split_at": splits,
    }


def against_server(
    models: dict[str, Model],
    path: Path,
    binary: Path,
    prompts: list[list[int]],
    greedy_n: int,
    server_args: list[str] | None = None,
) -> dict[str, Any]:
    """(c) each loaded path against llama-server on the same file (tests/test_forward's functions;
    llama-server -t 2, as the oracle tests and the exact path's attention split assume, and
    ``server_args``: ``-ngl 99`` for a CUDA build)."""
    out: dict[str, Any] = {}
    with support.LlamaServer(path, binary=binary, args=list(server_args or [])) as server:
        for side, model in models.items():
            worst, same_top1 = compare_next_token(model, server, prompts)
            same, notes = compare_greedy(model, server, prompts, greedy_n)
            out[side] = {
                "max_top10_logprob_diff": round(worst, 6),
                "same_top1": same_top1,
                "greedy_identical": same,
                "greedy_notes": notes,
            }
    return out


def attempt(result: dict[str, Any], part: str, fn: Callable[[], Any]) -> tuple[bool, Any]:
    """(True, fn()) with its seconds in result["times"]; or (False, None) with the traceback in
    result["error"][part], so that one part failing (CuPy, or Numba's kernels on that machine)
    leaves the figures the other parts can still give."""
    try:
        value, seconds = timed(fn)
    except Exception:
        result.setdefault("error", {})[part] = traceback.format_exc()
        return False, None
    result.setdefault("times", {})[f"{part}_s"] = seconds
    return True, value


def load_models(result: dict[str, Any], path: Path, device: str) -> dict[str, Model]:
    """The models of each path that loaded, by side: ``array`` (the array path on ``device``),
    ``exact`` (the CPU), and on a CUDA device ``device_step`` (``Model.load``'s own choice
    there: the decode step, device_model.DeviceModel, where it plays the model; where it does
    not, the reason is ``result["device_step"]`` and the side is absent, being the array path)."""
    _, array_model = attempt(
        result,
        "load_array",
        lambda: Model.load(path, device=device, progress=False, exact=False, device_step=False),
    )
    _, exact_model = attempt(
        result, "load_exact", lambda: Model.load(path, device="cpu", progress=False)
    )
    if exact_model is not None:
        # Numba compiles (or loads from its cache) the exact kernels here, not inside the figures
        warmed, _ = attempt(result, "warm_up_exact", exact_model.warm_up)
        exact_model = exact_model if warmed else None
    models: dict[str, Model] = {}
    if array_model is not None:
        result["array_device"] = "cuda" if array_model.xp is not numpy else "cpu"
        models["array"] = array_model
    if exact_model is not None:
        models["exact"] = exact_model
    if device == "cuda":
        from bankml.engine_cupy.device_model import DeviceModel

        _, step_model = attempt(
            result,
            "load_device_step",
            lambda: Model.load(path, device="cuda", progress=False),
        )
        if isinstance(step_model, DeviceModel):
            models["device_step"] = step_model
        elif step_model is not None:
            result["device_step"] = step_model.array_path_reason or "the array path"
    return models


# the sides compared with the exact path, each under result[f"{side}_vs_exact"]
APPROXIMATE_SIDES = ("array", "device_step")


def versus_exact(
    result: dict[str, Any], models: dict[str, Model], prompts: list[list[int]], greedy_n: int
) -> None:
    """(a) and (b) for each side other than the exact path, when both loaded."""
    exact_model = models.get("exact")
    for side in APPROXIMATE_SIDES:
        model = models.get(side)
        if model is not None and exact_model is not None:
            _, result[f"{side}_vs_exact"] = attempt(
                result,
                f"{side}_vs_exact",
                lambda model=model: array_vs_exact(model, exact_model, prompts, greedy_n),
            )


def prompt_ids(model: Model, count: int) -> list[list[int]]:
    """The oracle tests' prompts, tokenized by bankml's tokenizer (identical to llama-server's
    /tokenize on this vocabulary: tests/test_tokenizer.py), special tokens parsed."""
    tokenizer = Tokenizer.from_gguf(model.reader)
    return [tokenizer.tokenize(text, parse_special=True) for text in PROMPTS[:count]]


def check_model(
    path: Path,
    device: str,
    n_prompts: int,
    greedy_n: int,
    server: Path | None,
    server_args: list[str] | None = None,
) -> dict[str, Any]:
    """(a), (b) and (c) for one model file; each part's exception is kept, not raised."""
    result: dict[str, Any] = {
        "model": path.stem,
        "prompts": n_prompts,
        "greedy_tokens": greedy_n,
        "times": {},
    }
    models = load_models(result, path, device)
    if not models:
        return result
    ok, prompts = attempt(
        result, "tokenize", lambda: prompt_ids(next(iter(models.values())), n_prompts)
    )
    if not ok:
        return result
    versus_exact(result, models, prompts, greedy_n)
    if server is not None:
        _, result["vs_llama_server"] = attempt(
            result,
            "vs_llama_server",
            lambda: against_server(models, path, server, prompts, greedy_n, server_args),
        )
    return {k: v for k, v in result.items() if v is not None}


# --- speed -------------------------------------------------------------------------------------


def median_round(run: Callable[[], tuple[float, float]], rounds: int) -> dict[str, float]:
    figures = [run() for _ in range(rounds)]
    return {
        "prefill_tok_s": round(statistics.median(f[0] for f in figures), 1),
        "decode_tok_s": round(statistics.median(f[1] for f in figures), 1),
    }


def engine_speed(model: Model, ids: list[int], n_decode: int, rounds: int) -> dict[str, float]:
    bench_engine.engine_round(model, ids[:32], 4)  # first-use costs (CuPy kernels, caches)
    return median_round(lambda: bench_engine.engine_round(model, ids, n_decode), rounds)


def server_speed(
    binary: Path,
    path: Path,
    ids: list[int],
    n_decode: int,
    rounds: int,
    threads: int,
    server_args: list[str] | None = None,
) -> dict[str, float]:
    args = ["-t", str(threads), *(server_args or [])]
    with support.LlamaServer(path, binary=binary, args=args) as srv:
        bench_engine.server_round(srv, ids[:32], 4)
        return median_round(lambda: bench_engine.server_round(srv, ids, n_decode), rounds)


def speed(
    result: dict[str, Any],
    models: dict[str, Model],
    ids: list[int],
    args: argparse.Namespace,
    server: Path | None,
    path: Path,
    threads: int,
) -> dict[str, Any]:
    """(d) prefill and decode tokens/s of each path (bench/engine.py's rounds), and llama-server's
    at the same thread count as the exact path when it runs."""
    out: dict[str, Any] = {
        "prompt_tokens": len(ids),
        "decode_tokens": args.decode,
        "rounds": args.rounds,
        "cpu_threads": threads,
    }
    for side, model in models.items():
        _, out[side] = attempt(
            result, f"speed_{side}", lambda: engine_speed(model, ids, args.decode, args.rounds)
        )
    if server is not None:
        _, out["llama_server"] = attempt(
            result,
            "speed_llama_server",
            lambda: server_speed(
                server, path, ids, args.decode, args.rounds, threads, server_args_of(args)
            ),
        )
    return {k: v for k, v in out.items() if v is not None}


def fits(result: dict[str, Any], part: str, deadline: float, allowance: float) -> bool:
    """Whether ``allowance`` seconds are left before ``deadline``; if not, ``part`` is named in
    result["skipped"] with the seconds it needed and those left."""
    left = deadline - time.monotonic()
    if left >= allowance:
        return True
    result.setdefault("skipped", {})[part] = (
        f"needs about {allowance:.0f} s (an allowance), {max(left, 0.0):.0f} s were left"
    )
    return False


def default_model_checks(
    path: Path,
    args: argparse.Namespace,
    server: Path | ServerSource | None,
    deadline: float = float("inf"),
    into: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """(a)-(d) for one full-size model, into ``into`` as they come (a check stopped midway keeps
    them): first what needs no llama-server, then, a server still being built waited for while
    the time left allows, the comparisons with it and the speed figures (taken after the build,
    whose compilers would share the machine)."""
    import numba

    source = server if isinstance(server, ServerSource) else ServerSource(server)
    threads = min(args.threads, numba.config.NUMBA_NUM_THREADS)
    numba.set_num_threads(threads)
    result = into if into is not None else {}
    result.update(
        model=path.stem, prompts=args.default_prompts, greedy_tokens=args.greedy, times={}
    )
    models = load_models(result, path, args.device)
    if not models:
        return result
    if "exact" in models:
        models["exact"].threads = threads  # as bench/engine.py: Numba threads for the kernels
    first = next(iter(models.values()))
    prompts = prompt_ids(first, args.default_prompts)
    versus_exact(result, models, prompts, args.greedy)
    binary = source.wait(deadline - SERVER_PARTS_ALLOWANCE_S)
    if binary is None and source.expected:
        result.setdefault("skipped", {})["llama_server"] = source.describe()
    if binary is not None and not fits(result, "llama_server", deadline, SERVER_PARTS_ALLOWANCE_S):
        binary = None
    if binary is not None:
        _, result["vs_llama_server"] = attempt(
            result,
            "vs_llama_server",
            lambda: against_server(
                models, path, binary, prompts, args.greedy, server_args_of(args)
            ),
        )
    if fits(result, "speed", deadline, SPEED_ALLOWANCE_S):
        ids = Tokenizer.from_gguf(first.reader).tokenize(bench_engine.TEXT * 40)[: args.prefill]
        result["speed"] = speed(result, models, ids, args, binary, path, threads)
    for key in [k for k, v in result.items() if v is None]:
        del result[key]
    return result


def full_size_checks(
    path: Path,
    args: argparse.Namespace,
    server: Path | ServerSource | None,
    deadline: float,
    shaped: str = "",
    into: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """``default_model_checks`` of the default model, or of the shaped model ``shaped`` written
    to ``path`` first, into ``into``; skipped, and named in its "skipped", when the time left is
    less than its allowance."""
    result = into if into is not None else {}
    result["model"] = shaped or path.stem
    allowance = SHAPED_ALLOWANCE_S if shaped else DEFAULT_MODEL_ALLOWANCE_S
    if not fits(result, "model", deadline, allowance):
        return result
    if not shaped:
        return default_model_checks(path, args, server, deadline, result)
    ok, _ = attempt(
        result, "write", lambda: write_tiny_model(path, SHAPED_SPECS[shaped], Path(args.vocab))
    )
    if not ok:
        return result
    written = result.pop("times")
    # "model": the file's stem, the name
    default_model_checks(path, args, server, deadline, result)
    result["times"] = {**written, **result["times"]}
    return result


# --- orchestration -----------------------------------------------------------------------------


def environment(device: str, server: Path | None) -> dict[str, Any]:
    from importlib.metadata import version

    import numba

    env: dict[str, Any] = {
        "python": platform.python_version(),
        "numpy": numpy.__version__,
        "numba": numba.__version__,
        "gguf": version("gguf"),
        "cpu_count": os.cpu_count(),
        "cpu": platform.processor() or platform.machine(),
    }
    if device == "cuda":
        try:
            import cupy

            props = cupy.cuda.runtime.getDeviceProperties(0)
            env.update(
                cupy=cupy.__version__,
                gpu=props["name"].decode(),
                cuda_runtime=cupy.cuda.runtime.runtimeGetVersion(),
            )
        except Exception as err:
            env["cupy_error"] = f"{type(err).__name__}: {err}"
    if server is not None:
        env["llama_server"] = str(server)
    return env


def find_server(choice: str | None) -> tuple[Path | None, str]:
    """The llama-server to compare with, if it runs here: --llama-server, else
    $BANKML_LLAMA_SERVER; neither, or 'none': no server (nothing is built here)."""
    choice = choice or os.environ.get("BANKML_LLAMA_SERVER")
    if not choice or choice == "none":
        return (
            None,
            "not asked for (--llama-server BIN; scripts/gpu-check.sh builds one unless "
            "--no-llama-server)",
        )
    try:
        binary = Path(choice)
        run = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=30)
    except Exception as err:
        return None, f"{type(err).__name__}: {err}"
    said = (run.stderr + run.stdout).strip()
    if run.returncode != 0:
        return None, f"exit {run.returncode}: {said[-400:]}"
    return binary, said.splitlines()[0] if said else "ok"


@dataclass
class ServerSource:
    """The llama-server to compare with: known from the start (``binary``, or None with the
    reason in ``note``), or being built beside the check: ``status`` is the file that
    scripts/gpu-check.sh's build writes when it ends (its exit status, its seconds, the binary's
    path, and after a failure the end of its log), read when it appears and waited for only
    until a given time."""

    binary: Path | None = None
    note: str = ""
    status: Path | None = None
    expected: bool = False  # a build was asked for: its absence is a part missing, said why
    build_s: float | None = None
    seen_after_s: float | None = None  # seconds into the check when its build's end was seen
    waited_s: float = 0.0
    gave_up: bool = False  # waited for until the time left for it ran out
    started: float = field(default_factory=time.monotonic)

    @classmethod
    def of(cls, choice: str | None, status: str | None) -> ServerSource:
        if status:
            return cls(note="being built", status=Path(status), expected=True)
        return cls(*find_server(choice))

    @property
    def building(self) -> bool:
        return self.status is not None

    def poll(self) -> Path | None:
        """The binary if there is one now (a build that has ended is read), without waiting."""
        if self.status is not None and self.status.exists():
            self._read(self.status)
        return self.binary

    def wait(self, until: float) -> Path | None:
        """The binary, a build still running waited for until ``until`` (time.monotonic)."""
        start = time.monotonic()
        try:
            while self.poll() is None and self.building and time.monotonic() < until:
                time.sleep(min(1.0, max(0.0, until - time.monotonic())))
        finally:  # also when SIGTERM ends the wait
            self.waited_s = round(self.waited_s + time.monotonic() - start, 1)
            self.gave_up = self.gave_up or self.building
        return self.binary

    def describe(self) -> str:
        """The report's "llama_server": "ran: " and its version, or why there is none."""
        if self.binary is not None:
            return "ran: " + self.note
        if self.building:
            return (
                f"not ready: its build had not ended {time.monotonic() - self.started:.0f} s "
                + (
                    "into the check, when the time left for it ran out"
                    if self.gave_up
                    else "into the check (nothing waited for it: no full-size model was checked)"
                )
            )
        return self.note

    def _read(self, path: Path) -> None:
        self.status = None
        self.seen_after_s = round(time.monotonic() - self.started, 1)
        try:
            lines = path.read_text().splitlines()
            code, self.build_s = int(lines[0]), float(lines[1])
            binary = lines[2].strip() if len(lines) > 2 else ""
        except (OSError, ValueError, IndexError) as err:
            self.note = f"the build's status file {path} is unreadable: {err}"
            return
        if code != 0:
            tail = "\n".join(lines[3:])[-2000:]
            self.note = f"its build failed (exit {code}): {tail}"
        elif not binary:
            self.note = "its build ended without naming a binary"
        else:
            self.binary, self.note = find_server(binary)


def worker_command(
    args: argparse.Namespace, name: str, result: Path, workdir: Path, server: Path | None
) -> list[str]:
    return [
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker",
        name,
        "--result",
        str(result),
        "--workdir",
        str(workdir),
        "--vocab",
        str(args.vocab),
        "--device",
        args.device,
        "--prompts",
        str(args.prompts),
        "--greedy",
        str(args.greedy),
        "--llama-server",
        str(server) if server else "none",
        *(["--ngl", str(args.ngl)] if args.ngl is not None else []),
    ]


def server_args_of(args: argparse.Namespace) -> list[str]:
    """llama-server's arguments beyond the model's and the threads' (``--ngl``)."""
    return ["-ngl", str(args.ngl)] if args.ngl is not None else []


def run_workers(
    jobs: list[tuple[str, list[str], Path]],
    parallel: int,
    deadline: float,
    on_result: Callable[[dict[str, dict[str, Any]]], None] = lambda r: None,
) -> dict[str, dict[str, Any]]:
    """Worker processes, ``parallel`` at a time; one that crashes or outlives the deadline is
    reported with the end of its output, and the others go on. ``on_result`` sees the results
    so far each time one comes in (the report is saved then: a run killed keeps them)."""
    pending, running, results = list(jobs), [], {}
    while pending or running:
        while pending and len(running) < parallel:
            name, cmd, result = pending.pop(0)
            if time.monotonic() > deadline:
                results[name] = {
                    "model": name,
                    "error": {"budget": "skipped: the time budget was spent"},
                }
                continue
            log = tempfile.TemporaryFile()
            env = dict(
                os.environ, NUMBA_NUM_THREADS=os.environ.get("GPU_CHECK_WORKER_THREADS", "2")
            )
            running.append(
                (
                    name,
                    subprocess.Popen(
                        cmd,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        env=env,
                        # a check that is killed takes its workers with it
                        preexec_fn=support._die_with_parent,
                    ),
                    result,
                    log,
                )
            )
        time.sleep(0.2)
        for item in list(running):
            name, proc, result, log = item
            late = time.monotonic() > deadline
            if proc.poll() is None and not late:
                continue
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            running.remove(item)
            log.seek(0)
            tail = log.read().decode("utf-8", "replace")[-3000:]
            log.close()
            if result.exists():
                results[name] = json.loads(result.read_text())
            else:
                why = "past the time budget" if late else f"exit status {proc.returncode}"
                results[name] = {
                    "model": name,
                    "error": {"worker": f"ended without a result ({why}):\n{tail}"},
                }
            on_result(results)
    return results


def worker(args: argparse.Namespace) -> int:
    """One model in its own process; the result (or the traceback) goes to --result as JSON."""
    workdir = Path(args.workdir)
    try:
        spec = spec_by_name(args.worker)
        path, seconds = timed(
            lambda: write_tiny_model(workdir / f"{spec.name}.gguf", spec, Path(args.vocab))
        )
        server = None if args.llama_server in (None, "none") else Path(args.llama_server)
        result = check_model(
            path, args.device, args.prompts, args.greedy, server, server_args_of(args)
        )
        result["times"] = {"write_s": seconds, **result["times"]}
    except Exception:
        result = {"model": args.worker, "error": {"worker": traceback.format_exc()}}
    Path(args.result).write_text(json.dumps(result))
    return 0


def fmt(value: Any, total: int | None = None) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.5f}"
    return f"{value}/{total}" if total is not None else str(value)


def table_row(m: dict[str, Any]) -> str:
    """One model's figures; '-' where a part gave none, the failed parts named at the end."""
    n = m.get("prompts")
    a = m.get("array_vs_exact") or {}
    srv = m.get("vs_llama_server") or {}
    cells = [
        fmt(a.get("max_top10_logprob_diff")),
        fmt(a.get("same_top1"), n if a else None),
        fmt(a.get("greedy_identical"), n if a else None),
    ]
    for side in ("array", "exact"):
        s = srv.get(side) or {}
        cells += [
            fmt(s.get("max_top10_logprob_diff")),
            fmt(s.get("greedy_identical"), n if s else None),
        ]
    failed = ", ".join(m.get("error", {}))
    skipped = ", ".join(m.get("skipped", {}))
    return (
        f"{m['model']:28} {cells[0]:>10} {cells[1]:>6} {cells[2]:>7} | {cells[3]:>8} {cells[4]:>7}"
        f" | {cells[5]:>8} {cells[6]:>7}"
        + (f"  failed: {failed}" if failed else "")
        + (f"  skipped: {skipped}" if skipped else "")
    )


def step_row(m: dict[str, Any]) -> str:
    """One model's decode-step figures (against the exact path and llama-server), or why the
    step does not play it."""
    if "device_step" in m:
        return f"{m['model']:28} not the decode step: {m['device_step']}"
    n = m.get("prompts")
    a = m.get("device_step_vs_exact") or {}
    s = (m.get("vs_llama_server") or {}).get("device_step") or {}
    cells = [
        fmt(a.get("max_top10_logprob_diff")),
        fmt(a.get("same_top1"), n if a else None),
        fmt(a.get("greedy_identical"), n if a else None),
        fmt(s.get("max_top10_logprob_diff")),
        fmt(s.get("same_top1"), n if s else None),
        fmt(s.get("greedy_identical"), n if s else None),
    ]
    return (
        f"{m['model']:28} {cells[0]:>10} {cells[1]:>6} {cells[2]:>7} | {cells[3]:>8} "
        f"{cells[4]:>6} {cells[5]:>7}"
    )


def print_table(report: dict[str, Any]) -> None:
    print(f"\narray path on {report['device']} vs exact CPU path (and each vs llama-server)")
    print(
        f"{'model':28} {'top10 diff':>10} {'top1':>6} {'greedy':>7} | {'arr-srv':>8} {'greedy':>7}"
        f" | {'exa-srv':>8} {'greedy':>7}"
    )
    default = report.get("default_model")
    full = [*([default] if default else []), *report.get("shaped_models", [])]
    for m in [*report["models"], *full]:
        print(table_row(m))
    stepped = [m for m in [*report["models"], *full] if "device_step" in m or _has_step(m)]
    if stepped:
        print("\ndecode step (CUDA) vs exact CPU path, and vs llama-server")
        print(
            f"{'model':28} {'top10 diff':>10} {'top1':>6} {'greedy':>7} | {'step-srv':>8} "
            f"{'top1':>6} {'greedy':>7}"
        )
        for m in stepped:
            print(step_row(m))
    server = " ".join(["llama-server", *report.get("llama_server_args", [])])
    for m in full:
        if "model" not in m.get("skipped", {}):
            print_speeds(m, server)
    if report.get("errors"):
        print("tracebacks: the JSON's 'error' of each model, by part")
    print(f"\nllama-server: {report['llama_server']}")
    for name, why in report.get("skipped", {}).items():
        print(f"skipped, {name}: {why}")
    if report.get("stopped"):
        print(f"stopped: {report['stopped']}")


def _has_step(m: dict[str, Any]) -> bool:
    return "device_step_vs_exact" in m or "device_step" in (m.get("vs_llama_server") or {})


def print_speeds(m: dict[str, Any], server: str) -> None:
    """A full-size model's prefill and decode tokens/s, by path."""
    speeds = m.get("speed") or {}
    labels = {
        "array": f"array ({m.get('array_device', '?')})",
        "device_step": "decode step (cuda)",
        "exact": "exact (cpu)",
        "llama_server": server,
    }
    if not any(side in speeds for side in labels):
        print(f"\n{m['model']}: no speed figures")
        return
    print(
        f"\n{m['model']}: {speeds['prompt_tokens']}-token prefill, "
        f"{speeds['decode_tokens']}-token decode, median of {speeds['rounds']} "
        f"(CPU paths on {speeds['cpu_threads']} threads)"
    )
    for side, label in labels.items():
        if side in speeds:
            print(
                f"  {label:22} prefill {speeds[side]['prefill_tok_s']:8.1f} tok/s   "
                f"decode {speeds[side]['decode_tok_s']:7.1f} tok/s"
            )


def save(report: dict[str, Any], out: Path) -> None:
    """DIR/gpu_check.json, replaced whole (a check killed while writing leaves the last one)."""
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / (RESULT_FILE + ".tmp")
    tmp.write_text(json.dumps(report, indent=1))
    os.replace(tmp, out / RESULT_FILE)


def chosen_models(args: argparse.Namespace) -> tuple[list[TinySpec], bool, list[str]]:
    """The tiny specs to check, whether the default model is checked too, and the shaped models
    to check (``--models``, else all; quick: the two Q4_1 tiny ones only)."""
    if args.models:
        names = [n.strip() for n in args.models.split(",") if n.strip()]
        tiny = [spec_by_name(n) for n in names if n != DEFAULT_NAME and n not in SHAPED_SPECS]
        return tiny, DEFAULT_NAME in names, [n for n in names if n in SHAPED_SPECS]
    if args.quick:
        return list(QUICK_SPECS), False, []
    return list(TINY_SPECS), True, list(SHAPED_SPECS)


def _passes(part: dict[str, Any]) -> str:
    """A request's prompt passes through the twins (kernel_check.device_engine_vs_twins)."""
    p = part["prompt_passes_on_twins"]
    return f"{part['prompt_n']} tokens: {p['prefills']} prefill(s) + {p['steps']} step(s)"


def kernel_report(args: argparse.Namespace) -> dict[str, Any]:
    """The CUDA kernels against their NumPy twins (bench/kernel_check.py) on a CUDA device."""
    if args.device != "cuda":
        return {"skipped": f"the CUDA kernels need CuPy and a GPU (device {args.device})"}
    from bankml.engine_cupy.backend import get_xp
    from bench.kernel_check import kernels_vs_twins

    result: dict[str, Any] = {}
    model = args.model if args.model is not None and Path(args.model).exists() else None
    ok, value = attempt(result, "kernels", lambda: kernels_vs_twins(get_xp("cuda"), model))
    if ok and model is not None:
        from bench import kernel_check as kc

        parts: list[tuple[str, Callable[..., Any], Callable[[Any], str]]] = [
            (
                "device_step",
                kc.device_step_vs_twins,
                lambda r: (
                    f"decode step on the device: same greedy tokens {r['same_tokens']}, "
                    f"steps identical to the twins {r['identical_steps']}/{len(r['steps'])}"
                ),
            ),
            (
                "device_rows",
                kc.device_rows_vs_steps,
                lambda r: (
                    f"batched decode step of {r['rows']} slots on the device: rows identical to "
                    f"their own steps {r['identical_rows']}/"
                    f"{r['identical_rows'] + r['differing_rows']}; {r['us_rows_step']} us "
                    f"against {r['us_one_row_steps']} us one by one"
                ),
            ),
            (
                "device_graphs",
                kc.device_graphs_vs_uncaptured,
                lambda r: (
                    f"decode step from CUDA graphs: steps identical to the uncaptured step "
                    f"{r['identical_steps']}/{r['identical_steps'] + r['differing_steps']} "
                    f"({r['replayed']} replays; {r['graph_reason'] or 'captured'}); decode "
                    f"{r['decode_tok_s']['captured']} tok/s captured, "
                    f"{r['decode_tok_s']['uncaptured']} uncaptured; {r['rows']} slots "
                    f"{r['rows_decode_tok_s']['captured']} against "
                    f"{r['rows_decode_tok_s']['uncaptured']}"
                ),
            ),
            (
                "device_engine",
                kc.device_engine_vs_twins,
                lambda r: (
                    "engine on the decode step: same tokens as through the twins, greedy "
                    f"{r['greedy']['same_tokens']}, top-k {r['top_k']['same_tokens']}; "
                    f"{r['greedy']['decode_tokens_per_s']} tokens/s greedy; prompt "
                    f"{_passes(r['greedy'])}, held prompt {_passes(r['top_k'])}"
                ),
            ),
            (
                "device_prefill",
                kc.device_prefill_vs_twins,
                lambda r: (
                    f"prefill on the device: same greedy tokens {r['same_tokens']}, logits "
                    f"{r['logits'].get('max_rel_diff', 0.0):.2e} from the twins' (largest, relative)"
                ),
            ),
            (
                "device_hidden",
                kc.device_hidden_vs_twins,
                lambda r: (
                    f"embeddings' hidden states on the device: rows' smallest cosine "
                    f"{r['min_cosine_vs_twins']} to the twins', {r['min_cosine_vs_exact']} to "
                    "the exact path's"
                ),
            ),
        ]
        for name, check, summary in parts:
            part_ok, got = attempt(value, name, lambda check=check: check(get_xp("cuda"), model))
            if part_ok:
                value[name] = got
                print(summary(got))
    if ok:
        print(f"CUDA kernels identical to their twins: {value['identical']}/{value['checked']}")
        return value
    print("CUDA kernels against their twins: failed (the report has the traceback)")
    return result


class Stopped(BaseException):
    """SIGTERM (scripts/gpu-check.sh at its deadline): the check ends with what it has. Not an
    Exception, so that ``attempt`` does not keep it as a part's failure."""


@contextmanager
def stop_on_sigterm() -> Iterator[None]:
    def stop(signum: int, frame: object) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second one ends the process
        raise Stopped

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def script_timings() -> tuple[dict[str, Any], float]:
    """scripts/gpu-check.sh's own phases (its deadline, install and model fetch, seconds from its
    start) and how long before this check it started; ({}, 0) when run on its own."""
    try:
        given = json.loads(os.environ.get(TIMINGS_ENV) or "{}")
        offset = time.time() - float(os.environ[STARTED_ENV]) if STARTED_ENV in os.environ else 0.0
    except ValueError:
        return {}, 0.0
    return (given if isinstance(given, dict) else {}), max(offset, 0.0)


def skipped_parts(report: dict[str, Any]) -> dict[str, str]:
    """Every part left out for want of time (or of llama-server), by name: a model's name for a
    whole model, "<model> <part>" for one of its parts."""
    out: dict[str, str] = {}
    kernels = report.get("kernels") or {}
    if "budget" in kernels:
        out["kernels"] = kernels["budget"]
    if report.get("tiny_models_vs_llama_server"):
        out["tiny models vs llama-server"] = report["tiny_models_vs_llama_server"]
    default = report.get("default_model")
    for m in [*report["models"], *([default] if default else []), *report["shaped_models"]]:
        budget = (m.get("error") or {}).get("budget")
        if budget:
            out[m["model"]] = budget
        for part, why in (m.get("skipped") or {}).items():
            out[m["model"] if part == "model" else f"{m['model']} {part}"] = why
    return out


def orchestrate(args: argparse.Namespace) -> int:
    started = time.monotonic()
    deadline = started + args.budget_s
    given, offset = script_timings()
    source = ServerSource.of(args.llama_server, args.llama_server_build_status)
    server = source.poll()
    out = Path(args.out)
    report: dict[str, Any] = {
        "device": args.device,
        "quick": args.quick,
        "environment": environment(args.device, server),
        "llama_server": "being built" if source.building else source.describe(),
        "models": [],
        "default_model": None,
        "shaped_models": [],
        "llama_server_args": server_args_of(args),
    }
    # seconds each phase took; "_at_s": since scripts/gpu-check.sh started (else this check)
    timings: dict[str, Any] = {**given, "budget_s": round(args.budget_s, 1)}
    if offset:
        timings["check_started_at_s"] = round(offset, 1)

    def phase(name: str, since: float) -> None:
        timings[f"{name}_s"] = round(time.monotonic() - since, 1)

    with stop_on_sigterm():
        try:
            t = time.monotonic()
            kernels: dict[str, Any] = {}
            if args.device != "cuda" or fits(kernels, "budget", deadline, KERNELS_ALLOWANCE_S):
                report["kernels"] = kernel_report(args)
            else:
                report["kernels"] = kernels["skipped"]
            phase("kernels", t)
            save(report, out)
            run_models(args, report, source, out, deadline, phase)
        except Stopped:
            report["stopped"] = (
                f"SIGTERM {time.monotonic() - started:.0f} s into the check: the parts not "
                "reported had not ended"
            )
    report["llama_server"] = source.describe()
    if source.binary is not None:
        report["environment"]["llama_server"] = str(source.binary)
    for key, value in (
        ("llama_server_build_s", source.build_s),
        ("llama_server_ready_at_s", source.seen_after_s),
        ("llama_server_wait_s", source.waited_s or None),
    ):
        if value is not None:
            timings[key] = round(value + (offset if key.endswith("_at_s") else 0.0), 1)
    report["skipped"] = skipped_parts(report)
    checked = [*report["models"], report["default_model"] or {}, *report["shaped_models"]]
    report["errors"] = sum(1 for m in checked if "error" in m)
    report["elapsed_s"] = round(time.monotonic() - started, 1)
    timings["total_s"] = round(offset + report["elapsed_s"], 1)
    report["timings"] = timings
    save(report, out)
    print_table(report)
    print(
        f"\n{report['errors']} model(s) with an error; {report['elapsed_s']} s; "
        f"full report in {out / RESULT_FILE}"
    )
    print(json.dumps(report))
    return 0


def run_models(
    args: argparse.Namespace,
    report: dict[str, Any],
    source: ServerSource,
    out: Path,
    deadline: float,
    phase: Callable[[str, float], None],
) -> None:
    """The tiny models in workers, then the default model and the shaped ones alone, into
    ``report`` (saved after each)."""
    specs, with_default, shaped = chosen_models(args)
    started = time.monotonic()
    # the tiny models take llama-server only if it is there when they start
    server = source.poll()
    if specs and server is None and source.building:
        report["tiny_models_vs_llama_server"] = "llama-server was still being built"
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        workdir = Path(args.workdir or tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        jobs = [
            (
                s.name,
                worker_command(args, s.name, workdir / f"{s.name}.json", workdir, server),
                workdir / f"{s.name}.json",
            )
            for s in specs
        ]

        def keep(results: dict[str, dict[str, Any]]) -> None:
            report["models"] = [results[s.name] for s in specs if s.name in results]
            save(report, out)
            print(
                f"[{time.monotonic() - started:5.0f} s] {len(results)}/{len(jobs)} workers done",
                flush=True,
            )

        # the default model's allowance is kept back from the workers: it gives the figures
        # that matter most (agreement with llama-server, speed)
        reserve = DEFAULT_MODEL_ALLOWANCE_S if with_default else 0.0
        t = time.monotonic()
        results = run_workers(jobs, args.jobs, deadline - reserve, keep)
        report["models"] = [results[s.name] for s in specs]
        if specs:
            phase("tiny_models", t)
        # alone, after the workers: their speed figures need the machine to itself
        if with_default:
            t = time.monotonic()
            report["default_model"] = {"model": Path(args.model).stem}
            full_size_checks(args.model, args, source, deadline, into=report["default_model"])
            phase("default_model", t)
            save(report, out)
        t = time.monotonic()
        for name in shaped:
            path = workdir / f"{name}.gguf"
            report["shaped_models"].append({"model": name})
            full_size_checks(path, args, source, deadline, name, report["shaped_models"][-1])
            path.unlink(missing_ok=True)
            save(report, out)
        if shaped:
            phase("shaped_models", t)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="where the array path runs: cuda is CuPy's device, a CUDA or a ROCm GPU "
        "(the exact path is always the CPU)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="two tiny Q4_1 models, 3 prompts, 16 greedy tokens, not the default model",
    )
    parser.add_argument(
        "--out",
        default=os.environ.get("OUT") or str(ROOT / "bench" / "out"),
        help=f"folder for {RESULT_FILE} (default $OUT, else bench/out)",
    )
    parser.add_argument(
        "--model",
        type=Path,
        default=support.DEFAULT_MODEL,
        help="the full-size model checked and timed (default: the default model)",
    )
    parser.add_argument(
        "--vocab",
        type=Path,
        default=None,
        help="the GGUF whose vocabulary the tiny models take (default: the default model)",
    )
    parser.add_argument(
        "--llama-server",
        default=None,
        help="llama-server binary to compare both paths with, or 'none' "
        "(default $BANKML_LLAMA_SERVER, else none)",
    )
    parser.add_argument(
        "--llama-server-build-status",
        default=None,
        metavar="FILE",
        help="a llama-server is being built beside the check (scripts/gpu-check.sh): FILE appears "
        "when the build ends (its exit status, seconds, binary); the full-size models wait for it "
        "while the budget allows, the tiny models take it if it is there when they start",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=max(1, min(12, (os.cpu_count() or 2) - 2)),
        help="tiny models checked at once, each on 2 Numba threads (default: the cores less 2, "
        "at most 12)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=os.cpu_count() or 1,
        help="Numba threads (and llama-server -t) for the default model's CPU figures",
    )
    parser.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="seconds the check may take: a part that would not fit is skipped and named in the "
        f"JSON (default: the time left before ${DEADLINE_ENV}, scripts/gpu-check.sh's deadline, "
        "else 900)",
    )
    parser.add_argument(
        "--models",
        default=None,
        help=f"comma-separated names to check (tiny specs' names, {DEFAULT_NAME}); "
        "default all (quick: two tiny ones)",
    )
    parser.add_argument(
        "--prompts", type=int, default=None, help="prompts per tiny model (10; quick 3)"
    )
    parser.add_argument("--greedy", type=int, default=None, help="greedy tokens (32; quick 16)")
    parser.add_argument(
        "--ngl",
        type=int,
        default=None,
        help="llama-server's -ngl (layers on the GPU) for every llama-server started: 99 for "
        "a CUDA build (scripts/gpu-check.sh); default: not given (llama-server's own)",
    )
    parser.add_argument("--default-prompts", type=int, default=4)
    parser.add_argument("--prefill", type=int, default=256)
    parser.add_argument("--decode", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--result", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--workdir", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.prompts is None:
        args.prompts = 3 if args.quick else 10
    if args.greedy is None:
        args.greedy = 16 if args.quick else 32
    if args.vocab is None:
        args.vocab = args.model
    if args.budget_s is None:
        args.budget_s = default_budget()
    return args


def default_budget() -> float:
    """The seconds left before scripts/gpu-check.sh's deadline, else 900."""
    try:
        return max(0.0, float(os.environ[DEADLINE_ENV]) - time.time())
    except (KeyError, ValueError):
        return 900.0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    if not Path(args.vocab).exists():
        print(
            f"no GGUF at {args.vocab}: scripts/fetch-model.sh fetches the default model",
            file=sys.stderr,
        )
        return 2
    return orchestrate(args)


if __name__ == "__main__":
    raise SystemExit(main())
