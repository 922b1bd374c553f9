"""The `bankml` command itself as a user runs it: a subprocess, stdout, stderr, exit code.

Each command's own behaviour is tested beside its module (test_verify_cli.py, test_text_cli.py,
test_generate_cli.py, test_serve_p0.py); here: the version, the help, bad command lines, and
that `serve` hands its arguments to the twistd options in the order given.
"""

from __future__ import annotations

import hashlib
import json
import re
import socket
import subprocess
import sys
from pathlib import Path

import bankml
from tests import support
from tests.gguf_bytes import LLAMA_KVS, build, tensor

COMMANDS = [
    "guard",
    "sha256",
    "pin",
    "verify",
    "serve",
    "tokenize",
    "chat-template",
    "generate",
    "create",
    "check-receipt",
    "keygen",
    "usage",
    "version",
    "help",
]


def bankml_run(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "bankml", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=support.ROOT,
    )


def test_version_everywhere_is_bankmls() -> None:
    expected = f"bankml {bankml.__version__}\n"
    for args in (["version"], ["--version"], ["serve", "--version"]):
        out = bankml_run(*args)
        assert (out.returncode, out.stdout, out.stderr) == (0, expected, ""), args
    assert "Twisted" not in bankml_run("serve", "--version").stdout


def test_help_lists_every_command() -> None:
    for args in (["--help"], ["-h"], ["help"]):
        out = bankml_run(*args)
        assert out.returncode == 0 and out.stderr == "", args
        assert out.stdout.startswith("usage: bankml ")
        for name in COMMANDS:
            assert re.search(rf"\n    {name}\s", out.stdout), (args, name)


def test_no_command_prints_the_help_on_stderr_and_exits_1() -> None:
    out = bankml_run()
    assert (out.returncode, out.stdout) == (1, "")
    assert out.stderr.startswith("usage: bankml ") and "generate" in out.stderr


def test_unknown_command_or_option_exits_1_with_the_usage() -> None:
    out = bankml_run("frobnicate")
    assert out.returncode == 1 and out.stdout == ""
    assert "usage: bankml " in out.stderr and "invalid choice: 'frobnicate'" in out.stderr
    out = bankml_run("--frobnicate")
    assert out.returncode == 1 and "usage: bankml " in out.stderr
    assert "Traceback" not in out.stderr


def test_each_command_keeps_its_usage_exit_code(tmp_path: Path) -> None:
    # the gate's commands keep 2 and 3 for verdicts, so a bad command line is 1 there
    for args in (["sha256"], ["sha256", "a", "b"], ["pin", "x.gguf"], ["verify", "x.gguf"]):
        out = bankml_run(*args)
        assert out.returncode == 1, args
        assert out.stderr.startswith(f"usage: bankml {args[0]} "), args
    out = bankml_run("sha256", "a", "b")
    assert "bankml sha256: error: unrecognized arguments: b" in out.stderr
    # the engine's commands keep argparse's 2
    for args in (["tokenize"], ["chat-template", "x.gguf"], ["generate", "x.gguf"]):
        out = bankml_run(*args)
        assert out.returncode == 2 and f"usage: bankml {args[0]} " in out.stderr, args
    # serve's usage errors are the twistd options' own, exit 1
    out = bankml_run("serve", tmp_path / "m.gguf")
    assert out.returncode == 1 and "--fork FORK.json is required" in out.stderr


def test_usage_samples_bankml_and_the_given_processes() -> None:
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        gone = subprocess.Popen([sys.executable, "-c", "pass"])
        gone.wait()
        out = bankml_run("usage", str(busy.pid), str(gone.pid))
    finally:
        busy.kill()
        busy.wait()
    assert out.returncode == 0, out.stderr
    sample = json.loads(out.stdout)
    rows = {row["name"]: row for row in sample["processes"]}
    assert set(rows) == {"bankml", f"pid {busy.pid}"}  # the process that is gone is left out
    assert rows[f"pid {busy.pid}"]["cpu_percent"] > 0 and rows["bankml"]["rss_bytes"] > 0
    assert sample["rss_bytes"] == sum(row["rss_bytes"] for row in rows.values())
    assert sample["prompt_cache"] is None  # no server here
    for bad in ("abc", "0", "-3"):
        refused = bankml_run("usage", bad)
        assert refused.returncode == 1 and "is not a process id" in refused.stderr, bad


def test_serve_reads_options_on_both_sides_of_the_file(tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(build(LLAMA_KVS, [tensor("a", [64], 0, 0)]))
    fork = tmp_path / "FORK.json"
    assert bankml_run("pin", model, "--fork", fork).returncode == 0
    doc = json.loads(fork.read_text())
    doc["files"][0]["sha256"] = "0" * 64
    fork.write_text(json.dumps(doc))
    port = support.free_port()
    out = bankml_run("serve", "--fork", fork, model, "--native", f"--listen=127.0.0.1:{port}")
    assert out.returncode == 2, out.stderr
    assert (
        f"refuse: m.gguf sha256 {hashlib.sha256(model.read_bytes()).hexdigest()} != pinned {'0' * 64}"
        in out.stderr
    )
    with socket.socket() as probe:  # refused before anything listened
        assert probe.connect_ex(("127.0.0.1", port)) != 0


def test_sha256_does_not_import_twisted(tmp_path: Path) -> None:
    target = tmp_path / "f"
    target.write_bytes(b"bankml")
    code = (
        "import sys; from bankml.cli import main; status = main(['sha256', sys.argv[1]]); "
        "print(status, 'twisted' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(target)], capture_output=True, text=True, timeout=120
    )
    assert out.stdout.splitlines()[-1] == "0 False", out.stderr


def test_create_derives_a_model_over_a_pinned_one(tmp_path: Path) -> None:
    """`bankml create` writes the manifest over the pinned base and prints the status lines."""
    model = tmp_path / "models" / "tiny.gguf"
    model.parent.mkdir()
    model.write_bytes(build(LLAMA_KVS, [tensor("a", [64], 0, 0)]))
    registry = tmp_path / "forks"
    registry.mkdir()
    fork = registry / "tiny.gguf.FORK.json"
    assert bankml_run("pin", model, "--fork", fork).returncode == 0
    modelfile = tmp_path / "Modelfile"
    modelfile.write_text('FROM tiny\nSYSTEM "Answer in one word."\n')
    done = bankml_run(
        "create", "brief", "-f", modelfile, "--registry", registry, "--models", model.parent
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "success"
    manifest = json.loads((registry / "brief.MODEL.json").read_text())
    assert hashlib.sha256(model.read_bytes()).hexdigest() in json.dumps(manifest)
    again = bankml_run("create", "brief", "-f", tmp_path / "missing", "--registry", registry)
    assert again.returncode != 0


def test_keygen_writes_a_private_key_and_check_receipt_refuses_a_bad_one(tmp_path: Path) -> None:
    key = tmp_path / "keys" / "receipt.pem"
    made = bankml_run("keygen", "--key", key)
    assert made.returncode == 0, made.stderr
    assert key.stat().st_mode & 0o777 == 0o600
    assert json.loads(made.stdout)["path"] == str(key)
    assert bankml_run("keygen", "--key", key).returncode != 0  # never over an existing key
    request = tmp_path / "request.json"
    request.write_text('{"messages":[{"role":"user","content":"Hi"}]}')
    response = tmp_path / "response.json"
    response.write_text('{"choices":[]}')  # no receipt at all
    checked = bankml_run(
        "check-receipt", "--request", request, "--response", response, "--key", key
    )
    assert checked.returncode == 2
    assert checked.stdout.startswith("refuse: ") or checked.stderr.startswith("refuse: ")
