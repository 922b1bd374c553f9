"""llama-server's extra arguments after `--`: parsed, refused where they defeat verification or
supervision, appended to the spawned command line."""

from __future__ import annotations

import re
import socket
import subprocess
from pathlib import Path

import pytest
from twisted.python import usage

from bankml.p0 import llama_args
from bankml.process_protocol import llama_server_args
from bankml.tap import Options
from tests import support
from tests.bankml_process import BIN


def parsed(argv: list[str]) -> Options:
    options = Options()
    options.parseOptions(argv)
    return options


@pytest.fixture
def spawn_bin(tmp_path: Path) -> str:
    binary = tmp_path / "llama-server"
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    return str(binary)


@pytest.mark.parametrize(
    "argv",
    [
        ["m.gguf", "--fork", "F", "--spawn", "{bin}", "--", "-ngl", "99", "-fa", "on"],
        ["--fork", "F", "m.gguf", "--spawn={bin}", "--", "-ngl", "99", "-fa", "on"],
        ["--spawn", "{bin}", "--fork", "F", "m.gguf", "--", "-ngl", "99", "-fa", "on"],
    ],
)
def test_everything_after_the_first_double_dash_is_llama_servers(
    spawn_bin: str, argv: list[str]
) -> None:
    options = parsed([a.replace("{bin}", spawn_bin) for a in argv])
    assert options["file"] == "m.gguf" and options["mode"] == "spawn"
    assert options["engine_args"] == ["-ngl", "99", "-fa", "on"]


def test_a_second_double_dash_and_bankml_looking_flags_go_to_llama_server(spawn_bin: str) -> None:
    options = parsed(
        ["m.gguf", "--fork", "F", "--spawn", spawn_bin, "--", "--ctx-checkpoints", "2", "--", "x"]
    )
    assert options["engine_args"] == ["--ctx-checkpoints", "2", "--", "x"]
    assert options["ctx"] == 4096


def test_no_double_dash_means_no_extra_arguments(spawn_bin: str) -> None:
    assert parsed(["m.gguf", "--fork", "F", "--spawn", spawn_bin])["engine_args"] == []


@pytest.mark.parametrize(
    "flag,why",
    [
        ("-m", "loads a model other than the verified file"),
        ("--model", "loads a model other than the verified file"),
        ("-hf", "loads a model other than the verified file"),
        ("--hf_repo", "loads a model other than the verified file"),  # llama-server reads _ as -
        ("-mu", "loads a model other than the verified file"),
        ("--gpt-oss-20b-default", "downloads and serves another model"),
        ("--lora", "a file of weights bankml did not verify"),
        ("--control-vector", "a file of weights bankml did not verify"),
        ("-md", "a draft model"),
        ("--mmproj", "a projector"),
        ("--override-kv", "rewrites the verified file's metadata"),
        ("--host", "bankml chooses llama-server's address"),
        ("--port", "bankml chooses llama-server's address"),
        ("--api-prefix", "moves llama-server's routes"),
        ("--api-key", "bankml's own /props check"),
        ("--ssl-key-file", "plain HTTP"),
        ("-c", "use bankml's --ctx"),
        ("-t", "use bankml's --threads"),
        ("--slot-save-path", "use bankml's --slot-dir"),
    ],
)
def test_arguments_that_defeat_verification_or_supervision_are_refused(
    spawn_bin: str, flag: str, why: str
) -> None:
    with pytest.raises(usage.UsageError) as err:
        parsed(["m.gguf", "--fork", "F", "--spawn", spawn_bin, "--", "-ngl", "1", flag, "v"])
    assert str(err.value).startswith(f"llama-server argument {flag} is refused: ")
    assert why in str(err.value)


def test_extra_arguments_need_spawn() -> None:
    for engine in (["--upstream", "127.0.0.1:9"], ["--native"]):
        with pytest.raises(usage.UsageError, match="llama-server arguments after -- need --spawn"):
            parsed(["m.gguf", "--fork", "F", *engine, "--", "-ngl", "1"])


def test_extra_arguments_come_last_and_bankmls_defaults_give_way() -> None:
    base = llama_server_args("BIN", "/m.gguf", "127.0.0.1", 1, 2, 3)
    extra = ["-ngl", "99", "-fa", "on"]
    assert llama_server_args("BIN", "/m.gguf", "127.0.0.1", 1, 2, 3, extra=extra) == base + extra
    own = ["-np", "2", "--no-jinja", "-rea", "on", "--webui"]
    args = llama_server_args("BIN", "/m.gguf", "127.0.0.1", 1, 2, 3, extra=own)
    assert args[: base.index("-np")] == base[: base.index("-np")]
    assert args[base.index("-np") :] == own  # none of bankml's four defaults is left


def test_the_engine_environment_cannot_do_a_refused_flags_work() -> None:
    env = {
        "PATH": "/bin",
        "LLAMA_ARG_HF_REPO": "x/y",
        "LLAMA_ARG_MODEL": "/other",
        "LLAMA_ARG_N_GPU_LAYERS": "9",
    }
    assert llama_args.engine_environment(env) == {"PATH": "/bin", "LLAMA_ARG_N_GPU_LAYERS": "9"}


@pytest.mark.llama_server
def test_every_flag_named_here_is_one_of_llama_servers(llama_server_bin: Path) -> None:
    """A renamed flag in another build would slip past the refusal: each name is in its --help."""
    out = subprocess.run([str(llama_server_bin), "--help"], capture_output=True, text=True)
    names = set(re.findall(r"(?<![\w-])(--?[A-Za-z][\w.-]*)", out.stdout + out.stderr))
    named = set(llama_args.REFUSED) | {f for _, spellings in llama_args.DEFAULTS for f in spellings}
    assert named - names == set()
    env_names = set(re.findall(r"\(env: ([A-Z_0-9]+)\)", out.stdout + out.stderr))
    assert llama_args.REFUSED_ENV - env_names == set()


def test_bankml_serve_refuses_an_extra_argument_before_anything_starts(
    default_fork: Path, default_model: Path, spawn_bin: str
) -> None:
    port = support.free_port()
    out = subprocess.run(
        [
            str(BIN / "bankml"),
            "serve",
            str(default_model),
            "--fork",
            str(default_fork),
            "--spawn",
            spawn_bin,
            "--listen",
            f"127.0.0.1:{port}",
            "--",
            "-ngl",
            "99",
            "-m",
            "/tmp/other.gguf",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=support.ROOT,
    )
    assert out.returncode == 1, out.stderr
    assert (
        "bankml serve: llama-server argument -m is refused: it loads a model other than the "
        "verified file" in out.stderr
    )
    assert "verified" not in out.stderr.replace("the verified file", "")  # nothing was hashed
    with socket.socket() as probe:
        assert probe.connect_ex(("127.0.0.1", port)) != 0


def test_value_of_reads_the_last_value_given_in_either_spelling() -> None:
    spellings = llama_args.CACHE_TYPE_K
    assert llama_args.value_of(["-ngl", "99"], spellings) is None
    assert llama_args.value_of(["-ctk", "q8_0"], spellings) == "q8_0"
    assert llama_args.value_of(["--cache-type-k=q4_0", "-ctk", "q8_0"], spellings) == "q8_0"
    assert llama_args.value_of(["--cache_type_k", "bf16"], spellings) == "bf16"
