"""`bankml guard`, `sha256`, `pin`, `verify` as a user runs them: a subprocess, stdout, stderr, exit code."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import bankml
from tests import support
from tests.gguf_bytes import LLAMA_KVS, build, kv_u32, tensor


def bankml_run(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "bankml", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture()
def files(tmp_path: Path) -> dict[str, Path]:
    """A playing model, a hostile one, a truncated one, and a fork pinning the first."""
    good = tmp_path / "good.gguf"
    good.write_bytes(build(LLAMA_KVS, [tensor("a", [64], 0, 0)]))
    hostile = tmp_path / "hostile.gguf"
    hostile.write_bytes(build(LLAMA_KVS + [kv_u32("general.alignment", 48)], n_tensors=2**40))
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(good.read_bytes()[:60])
    return {
        "good": good,
        "hostile": hostile,
        "truncated": truncated,
        "fork": tmp_path / "FORK.json",
    }


# -- guard --------------------------------------------------------------------------------------


def test_guard_plays_the_default_model(default_model: Path) -> None:
    out = bankml_run("guard", default_model)
    assert out.returncode == 0 and out.stdout == "play F32:61 Q4_1:210 Q8_0:1\n"
    out = bankml_run("guard", default_model, "--json")
    doc = json.loads(out.stdout)
    assert (out.returncode, doc["verdict"], doc["arch"], doc["tensors"]) == (
        0,
        "play",
        "llama",
        272,
    )


def test_guard_refuse_need_more_unreadable(files: dict[str, Path]) -> None:
    out = bankml_run("guard", files["hostile"])
    assert out.returncode == 2
    assert (
        out.stdout
        == "refuse\n  - header claims 1099511627776 tensors, more than the 1048576 allowed\n"
    )
    out = bankml_run("guard", files["truncated"], "--json")
    least = 24 + 2 * 13 + 1 * 24  # the smallest header holding its 2 keys and 1 tensor info
    assert out.returncode == 3 and json.loads(out.stdout) == {
        "verdict": "need_more",
        "bytes_needed": least,
    }
    missing = files["good"].parent / "missing.gguf"
    out = bankml_run("guard", missing)
    assert (out.returncode, out.stdout) == (1, "")
    assert out.stderr == f"bankml guard: cannot read {missing}: No such file or directory\n"


def test_guard_engine_option(tmp_path: Path) -> None:
    model = tmp_path / "p.gguf"
    model.write_bytes(build(LLAMA_KVS, [tensor("p", [256], 142, 0)], data_size=64))
    assert bankml_run("guard", model).returncode == 2
    out = bankml_run("guard", model, "--engine", "prism", "--json")
    assert out.returncode == 0 and json.loads(out.stdout)["engine"] == "prism"


def test_guard_usage_errors_exit_1() -> None:
    out = bankml_run("guard")
    assert out.returncode == 1 and "usage: bankml guard" in out.stderr
    assert bankml_run("guard", "x.gguf", "--engine", "other").returncode == 1


# -- sha256 and pin -----------------------------------------------------------------------------


def test_sha256_prints_like_sha256sum(files: dict[str, Path]) -> None:
    ours = bankml_run("sha256", files["good"])
    theirs = subprocess.run(
        ["sha256sum", str(files["good"])], capture_output=True, text=True, check=True
    )
    assert ours.returncode == 0 and ours.stdout == theirs.stdout
    assert bankml_run("sha256", files["good"].parent / "missing").returncode == 1


def test_pin_then_verify(files: dict[str, Path]) -> None:
    out = bankml_run("pin", files["good"], "--fork", files["fork"])
    sha = json.loads(files["fork"].read_text())["files"][0]["sha256"]
    assert (out.returncode, out.stdout) == (0, f"pinned {sha}\n")
    out = bankml_run("verify", files["good"], "--fork", files["fork"])
    assert (out.returncode, out.stdout) == (0, f"play pinned {sha}\n")


def test_pin_refusal_exits_2(files: dict[str, Path]) -> None:
    files["fork"].write_text("[")
    out = bankml_run("pin", files["good"], "--fork", files["fork"])
    assert out.returncode == 2 and out.stdout.startswith("refuse: FORK.json ")
    files["fork"].unlink()
    out = bankml_run("pin", files["good"].parent / "missing.gguf", "--fork", files["fork"])
    assert (out.returncode, out.stdout) == (
        2,
        "refuse: cannot hash missing.gguf: No such file or directory\n",
    )
    assert bankml_run("pin", files["good"]).returncode == 1  # --fork is required


# -- verify -------------------------------------------------------------------------------------


def test_verify_default_model(default_model: Path, default_fork: Path) -> None:
    out = bankml_run("verify", default_model, "--fork", default_fork)
    assert (out.returncode, out.stdout) == (0, f"play pinned {support.DEFAULT_SHA256}\n")
    out = bankml_run("verify", default_model, "--fork", default_fork, "--json")
    assert out.returncode == 0
    assert list(json.loads(out.stdout).items()) == [
        ("verdict", "play"),
        ("guard", "play"),
        ("engine", "mainline"),
        ("model_sha256", support.DEFAULT_SHA256),
        ("bankml", bankml.__version__),
        ("arch", "llama"),
        ("name", json.loads(out.stdout)["name"]),
        ("types", {"F32": 61, "Q4_1": 210, "Q8_0": 1}),
    ]


def test_verify_refusals_and_exit_codes(
    files: dict[str, Path], default_model: Path, default_fork: Path
) -> None:
    write = files["fork"].write_text
    write(json.dumps({"files": [{"path": "good.gguf", "sha256": "0" * 64}]}))
    out = bankml_run("verify", files["good"], "--fork", files["fork"])
    assert out.returncode == 2 and out.stdout.startswith("refuse: good.gguf sha256 ")
    assert out.stdout.endswith(f" != pinned {'0' * 64}: refused\n")
    out = bankml_run("verify", files["good"], "--fork", default_fork)  # pins another name
    assert (out.returncode, out.stdout) == (
        2,
        "refuse: good.gguf has no sha256 record in FORK.json: unpinned, refused\n",
    )
    out = bankml_run("verify", files["hostile"], "--fork", files["fork"], "--json")
    assert out.returncode == 2
    assert json.loads(out.stdout) == {
        "verdict": "refuse",
        "reason": "guard refused: header claims 1099511627776 tensors, more than the 1048576 allowed",
        "bankml": bankml.__version__,
    }
    out = bankml_run("verify", files["truncated"], "--fork", files["fork"])
    assert (out.returncode, out.stdout) == (
        3,
        "refuse: guard needs 74 header bytes: file truncated\n",
    )
    out = bankml_run("verify", files["good"].parent / "gone.gguf", "--fork", files["fork"])
    assert out.returncode == 1 and out.stdout.startswith("refuse: cannot read ")


def test_verify_fork_problems_exit_1(files: dict[str, Path]) -> None:
    out = bankml_run("verify", files["good"])
    assert out.returncode == 1 and "usage: bankml verify" in out.stderr and out.stdout == ""
    out = bankml_run("verify", files["good"], "--fork", files["fork"])  # does not exist
    assert (out.returncode, out.stdout) == (1, "")
    assert out.stderr == f"bankml: cannot read {files['fork']}: No such file or directory\n"
