"""llama-server's router mode in the drop-in on a directory that pins no model: ``bankml
llama-server --models-dir DIR`` (no ``-m``) starts and serves with no startup model, as
llama-server's router starts with none loaded, side by side with the real llama-server router
on the same directory (one UNPINNED link to the default model). The file is listed as refused
with bankml's reason; a request naming no model gets llama-server's 400, one naming the
unpinned file the router's refusal, an unknown one llama-server's 400; ``/health``, ``/props``,
``/bankml``, ``/bankml/metrics`` answer; ``/metrics`` as llama-server's router answers it. And
``bankml serve`` takes no FILE only in native router mode; a port another process holds is
refused (exit 2)."""

from __future__ import annotations

import json
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from twisted.python import usage

from bankml.serving.llama_flags import FlagError, dropin_argv
from bankml.tap import Options
from tests.dropin import Pair, bankml, call, start_dropin
from tests.support import free_port

NAME = "SmolLM2-135M-Instruct.Q4_1"
CHAT = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}


@pytest.fixture(scope="module")
def directory(tmp_path_factory: pytest.TempPathFactory, default_model: Path) -> Path:
    out = tmp_path_factory.mktemp("empty-router") / "models"
    out.mkdir()
    (out / default_model.name).symlink_to(default_model.resolve())  # no FORK.json beside it
    return out


@pytest.fixture(scope="module")
def pair(directory: Path, llama_server_bin: Path) -> Iterator[Pair]:
    """llama-server and the drop-in started with the same router flags; the drop-in's
    ``--listen`` (``/bankml``) is ``Pair.listen_port``."""
    common = ["--models-dir", str(directory), "--host", "127.0.0.1", "-t", "2", "--no-webui"]
    theirs = free_port()
    ref = subprocess.Popen(
        [str(llama_server_bin), *common, "--port", str(theirs)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    ours, listen = free_port(), free_port()
    log = directory.parent / "bankml.log"
    try:
        proc = start_dropin([*common, "--listen", f"127.0.0.1:{listen}"], ours, log)
    except BaseException:
        ref.terminate()
        ref.wait(30)
        raise
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if call(theirs, "GET", "/health")[0] == 200:
                    break
            except OSError:
                time.sleep(0.2)
        yield Pair(ours, theirs, listen)
    finally:
        ref.terminate()
        proc.terminate()
        try:
            proc.wait(30)
        finally:
            ref.wait(30)


def test_it_starts_with_no_pinned_model_and_lists_the_file_refused(pair: Pair) -> None:
    ours, theirs = pair.ports
    assert call(ours, "GET", "/health")[0] == call(theirs, "GET", "/health")[0] == 200
    for path in ("/models", "/v1/models"):
        listings = [json.loads(raw) for _, raw in pair.both("GET", path)]
        (mine,), (reference,) = (listing["data"] for listing in listings)
        assert mine["id"] == reference["id"] == NAME
        assert mine["status"]["value"] == reference["status"]["value"] == "unloaded"
        # llama-server would load the file; bankml lists it refused, with the reason
        assert mine["status"]["failed"] is True
        assert "is not pinned" in mine["status"]["bankml_refused"]
        assert [k for k in mine if k != "meta"] == list(reference)
    # the router's own properties: no model behind them on either
    (status, raw), (ref_status, ref_raw) = pair.both("GET", "/props")
    assert status == ref_status == 200
    mine_props, reference_props = json.loads(raw), json.loads(ref_raw)
    assert mine_props["role"] == reference_props["role"] == "router"
    assert mine_props["model_path"] == reference_props["model_path"] == "none"


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/completion", "/v1/completions"])
def test_a_request_naming_no_model_or_an_unknown_one_is_refused_as_llama_server(
    pair: Pair, path: str
) -> None:
    body = {**CHAT, "prompt": "Hello"}
    ours, theirs = pair.both("POST", path, body)
    assert ours == theirs and ours[0] == 400
    assert b"model name is missing from the request" in ours[1]
    ours, theirs = pair.both("POST", path, {**body, "model": "no-such-model"})
    assert ours == theirs and ours[0] == 400
    assert b"model 'no-such-model' not found" in ours[1]


def test_a_request_naming_the_unpinned_file_gets_the_routers_refusal(pair: Pair) -> None:
    ours = pair.ports[0]
    for path in ("/v1/chat/completions", "/completion"):
        status, _, raw = call(ours, "POST", path, {**CHAT, "prompt": "Hi", "model": NAME})
        assert status == 400, raw  # never loaded, never a 500
        assert "is not pinned" in json.loads(raw)["error"]["message"]
    status, _, raw = call(ours, "POST", "/models/load", {"model": NAME})
    assert 400 <= status < 600 and status != 500, raw
    assert "is not pinned" in raw.decode()
    # still nothing loaded
    (entry,) = json.loads(call(ours, "GET", "/models")[2])["data"]
    assert entry["status"]["value"] == "unloaded"


def test_bankml_and_metrics_answer_without_a_model(pair: Pair) -> None:
    status, _, raw = call(pair.listen_port, "GET", "/bankml")
    assert status == 200
    described = json.loads(raw)
    assert described["mode"] == "native" and described["verified"] is None
    assert described["models"] == [] and described["resident"] is None
    status, _, raw = call(pair.listen_port, "GET", "/bankml/metrics")
    assert status == 200
    assert json.loads(raw)["prompt_cache"]["entries"] == 0
    assert call(pair.listen_port, "GET", "/bankml/usage")[0] == 200
    # /metrics is forwarded to a model by llama-server's router: the same refusal on both
    ours, theirs = pair.both("GET", "/metrics")
    assert ours == theirs and ours[0] == 400


def test_serve_takes_no_file_only_in_native_router_mode(directory: Path) -> None:
    argv, _ = dropin_argv(["--models-dir", str(directory)])
    assert "--fork" not in argv and argv[0] == "--native"  # no FILE, no --fork
    with pytest.raises(FlagError, match="-m FILE is required"):
        dropin_argv([])
    options = Options()
    options.parseOptions(["--native", "--models-dir", str(directory)])
    assert options["file"] is None and options["router"]
    for refused in (["--native"], ["--models-dir", str(directory)]):
        with pytest.raises(usage.UsageError, match="FILE is required"):
            Options().parseOptions(refused)
    with pytest.raises(usage.UsageError, match="--fork pins FILE"):
        Options().parseOptions(["--native", "--models-dir", str(directory), "--fork", "x.json"])


def test_a_preset_alone_naming_only_unpinned_files_starts_empty_too(
    directory: Path, tmp_path: Path
) -> None:
    preset = tmp_path / "preset.ini"
    preset.write_text(f"[only]\nmodel = {directory / (NAME + '.gguf')}\n")
    port = free_port()
    args = ["--models-preset", str(preset), "--host", "127.0.0.1", "--no-webui"]
    proc = start_dropin([*args, "--listen", f"127.0.0.1:{free_port()}"], port, tmp_path / "log")
    try:
        (entry,) = json.loads(call(port, "GET", "/models")[2])["data"]
        assert entry["id"] == "only" and entry["status"]["failed"] is True
        status, _, raw = call(port, "POST", "/v1/chat/completions", CHAT)
        assert status == 400 and b"model name is missing from the request" in raw
        status, _, raw = call(port, "POST", "/v1/chat/completions", {**CHAT, "model": "only"})
        assert status == 400 and b"is not pinned" in raw
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.mark.parametrize("taken", ["--port", "--listen"])
def test_a_port_another_process_holds_is_refused_and_the_process_ends(
    directory: Path, taken: str
) -> None:
    """A port it cannot listen on is a refusal: the reason on stderr and exit status 2 at
    once, as for any other refusal, not a process left running that never answers (a process
    manager would take it for a server)."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        held = holder.getsockname()[1]
        ports = {"--port": free_port(), "--listen": free_port(), taken: held}
        args = ["--models-dir", str(directory), "--host", "127.0.0.1", "--no-webui"]
        args += ["--port", str(ports["--port"]), "--listen", f"127.0.0.1:{ports['--listen']}"]
        done = subprocess.run(
            bankml("llama-server", *args), capture_output=True, text=True, timeout=120
        )
    assert done.returncode == 2, done.stderr
    assert f"refuse: cannot listen: Couldn't listen on 127.0.0.1:{held}" in done.stderr
    assert "Address already in use" in done.stderr
