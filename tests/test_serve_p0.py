"""`bankml serve` and `twistd bankml` end to end, in front of the real llama-server and model.

Every bankml here is a subprocess (`.venv/bin/bankml serve` or `.venv/bin/twistd -n bankml`).
The spawn-mode gateway works on a copy of the default model pinned in a temporary FORK.json, so
the tests that replace the file or kill the engine never touch the real one.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest

from bankml.receipts.answer import find_receipt, read_answer
from bankml.receipts.check import check_receipt
from bankml.receipts.vouch import FILE_CHANGED
from tests import support
from tests.bankml_process import (
    BIN,
    BankmlProcess,
    chat_body,
    check_receipt_cli,
    check_streamed_receipt,
    check_whole_receipt,
    copy_and_pin,
    process_gone,
    sha,
    sse_events,
)

pytestmark = pytest.mark.llama_server


@pytest.fixture(scope="module")
def model_copy(tmp_path_factory: pytest.TempPathFactory, default_model: Path) -> tuple[Path, Path]:
    return copy_and_pin(default_model, tmp_path_factory.mktemp("p0"))


def held_launcher(binary: Path, directory: Path) -> tuple[Path, Path]:
    """(launcher, hold): a llama-server launcher that waits while the file ``hold`` exists, then
    execs ``binary`` with its arguments (same pid), so a test can keep an engine start in
    'starting' for as long as it looks, instead of racing the start."""
    hold = directory / "hold"
    launcher = directory / "llama-server"
    launcher.write_text(
        f"#!{sys.executable}\n"
        "import os, sys, time\n"
        f"while os.path.exists({str(hold)!r}):\n"
        "    time.sleep(0.02)\n"
        f"os.execv({str(binary)!r}, [{str(binary)!r}, *sys.argv[1:]])\n"
    )
    launcher.chmod(0o755)
    return launcher, hold


@pytest.fixture(scope="module")
def spawned_hold(
    llama_server_bin: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, Path]:
    return held_launcher(llama_server_bin, tmp_path_factory.mktemp("launcher"))


@pytest.fixture(scope="module")
def spawned(
    model_copy: tuple[Path, Path],
    spawned_hold: tuple[Path, Path],
    tmp_path_factory: pytest.TempPathFactory,
):
    """One `bankml serve --spawn` on the copy, shared by the tests that only ask it questions;
    its llama-server is started through held_launcher (no hold: at once)."""
    model, fork = model_copy
    log = tmp_path_factory.mktemp("log") / "spawned.log"
    launcher = spawned_hold[0]
    engine = ["--spawn", str(launcher), "--upstream", f"127.0.0.1:{support.free_port()}"]
    with BankmlProcess(model, fork, engine, log) as bankml:
        yield bankml


@pytest.fixture(scope="module")
def upstream(
    reference_server: support.LlamaServer,
    default_model: Path,
    default_fork: Path,
    tmp_path_factory: pytest.TempPathFactory,
):
    """One `bankml serve --upstream` in front of the shared reference llama-server."""
    log = tmp_path_factory.mktemp("log") / "upstream.log"
    with BankmlProcess(
        default_model, default_fork, ["--upstream", f"127.0.0.1:{reference_server.port}"], log
    ) as bankml:
        yield bankml


# --- receipts the test recomputes ----------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_spawned_answers_carry_receipts(spawned: BankmlProcess, stream: bool) -> None:
    body = chat_body(stream)
    status, raw, headers = spawned.post(body)
    assert status == 200, raw
    if stream:
        assert headers["Content-Type"] == "text/event-stream"
        check_streamed_receipt(raw, body, support.DEFAULT_SHA256)
    else:
        check_whole_receipt(raw, body, support.DEFAULT_SHA256)


@pytest.mark.parametrize("stream", [False, True])
def test_spawned_receipts_are_signed_valid_and_name_the_seed_llama_server_used(
    spawned: BankmlProcess, stream: bool, tmp_path: Path
) -> None:
    """No seed in the request: bankml draws one, forwards it and signs it; ``bankml
    check-receipt`` says valid with ``GET /bankml/key``'s key, refuses a changed answer, and
    the same request with the receipt's seed gives the same text."""
    key = spawned.get("/bankml/key")[1]
    assert spawned.get("/bankml")[1]["receipt_keyid"] == key["keyid"]
    body = chat_body(stream, content="Tell me a story.", max_tokens=16, temperature=1.0)
    status, raw, _ = spawned.post(body)
    assert status == 200, raw
    pem = key["public_key"]
    assert check_receipt_cli(tmp_path, body, raw, pem) == (0, "valid")
    receipt = find_receipt(raw)[1]
    assert receipt["receipt_version"] == 2 and receipt["api"] == "chat"
    assert receipt["n_ctx"] == 2048 and receipt["engine_version"] in receipt["engine"]
    assert receipt["engine_digest"] == sha(Path(spawned.engine_args[1]).read_bytes())
    seed = receipt["sampler"]["seed"]
    assert seed != 4294967295
    changed = re.sub(rb'"bankml_receipt":\s*\{', b'"bankml_receipt": {"extra": 1, ', raw, count=1)
    assert changed != raw
    code, out = check_receipt_cli(tmp_path, body, changed, pem)
    assert code == 2 and out.startswith("refuse: the signature does not verify"), out
    again = chat_body(stream, content="Tell me a story.", max_tokens=16, temperature=1.0, seed=seed)
    status, raw_again, _ = spawned.post(again)
    assert status == 200 and check_receipt(again, raw_again, pem) == "valid"
    assert read_answer(raw_again, "chat").text == read_answer(raw, "chat").text


@pytest.mark.parametrize("stream", [False, True])
def test_upstream_answers_carry_receipts(upstream: BankmlProcess, stream: bool) -> None:
    body = chat_body(stream, content="Name a colour.")
    status, raw, _ = upstream.post(body)
    assert status == 200, raw
    check = check_streamed_receipt if stream else check_whole_receipt
    check(raw, body, support.DEFAULT_SHA256)


def test_usage_in_upstream_mode_finds_the_engine_by_its_port(
    upstream: BankmlProcess, reference_server: support.LlamaServer
) -> None:
    processes = {p["name"]: p for p in upstream.get("/bankml/usage")[1]["processes"]}
    assert processes["llama-server"]["pid"] == reference_server.proc.pid
    assert processes["bankml serve"]["pid"] == upstream.proc.pid


def test_streamed_and_whole_answers_hash_the_same_text(upstream: BankmlProcess) -> None:
    """At temperature 0 the same request gives the same text streamed or not: so the same hash."""
    whole = json.loads(upstream.post(chat_body(False, max_tokens=16))[1])["bankml_receipt"]
    streamed = sse_events(upstream.post(chat_body(True, max_tokens=16))[1])
    receipt = json.loads(streamed[-2][len(b"data: ") :])["bankml_receipt"]  # in the last chunk
    assert receipt["response_sha256"] == whole["response_sha256"]


def test_bankml_endpoints_in_spawn_mode(
    spawned: BankmlProcess, model_copy: tuple[Path, Path]
) -> None:
    status, info, _ = spawned.get("/bankml")
    assert status == 200 and info["mode"] == "spawn" and info["engine"]["state"] == "ready"
    assert (
        info["model"] == os.path.realpath(model_copy[0])
        and info["model_sha256"] == support.DEFAULT_SHA256
    )
    assert psutil.Process(info["engine"]["pid"]).is_running()
    props = spawned.get("/props")[1]
    assert os.path.realpath(props["model_path"]) == info["model"]
    assert spawned.get("/health")[:2] == (200, {"status": "ok"})
    assert spawned.get("/v1/models")[1]["data"][0]["id"]
    usage = spawned.get("/bankml/usage")[1]
    names = {p["name"]: p for p in usage["processes"]}
    assert (
        names["llama-server"]["pid"] == info["engine"]["pid"]
        and names["llama-server"]["rss_bytes"] > 0
    )
    assert names["bankml serve"]["pid"] == spawned.proc.pid
    assert spawned.get("/bankml/metrics")[1]["records"] == []


# --- refusals at start ---------------------------------------------------------------------------


def test_upstream_serving_another_file_is_refused_at_start(
    reference_server: support.LlamaServer, default_model: Path, tmp_path: Path
) -> None:
    copy, fork = copy_and_pin(default_model, tmp_path)  # the same bytes, but another file
    bankml = BankmlProcess(
        copy, fork, ["--upstream", f"127.0.0.1:{reference_server.port}"], tmp_path / "log"
    ).launch()
    assert bankml.wait_exit() == 2
    out = bankml.output()
    assert (
        f"refuse: upstream 127.0.0.1:{reference_server.port} serves {default_model}, not the verified {copy}: refused"
        in out
    )


def test_an_unpinned_file_is_refused_before_anything_listens(
    default_model: Path, tmp_path: Path
) -> None:
    fork = tmp_path / "FORK.json"
    fork.write_text(
        json.dumps({"files": [{"path": default_model.name, "bytes": 1, "sha256": "0" * 64}]})
    )
    bankml = BankmlProcess(
        default_model, fork, ["--upstream", "127.0.0.1:9"], tmp_path / "log"
    ).launch()
    assert bankml.wait_exit() == 2
    assert "refuse: " in bankml.output() and "!= pinned" in bankml.output()
    with pytest.raises(OSError):
        bankml.get("/bankml")


def test_an_upstream_that_never_answers_is_refused_after_10_s(
    default_model: Path, default_fork: Path, tmp_path: Path
) -> None:
    port = support.free_port()
    bankml = BankmlProcess(
        default_model, default_fork, ["--upstream", f"127.0.0.1:{port}"], tmp_path / "log"
    ).launch()
    assert bankml.wait_exit() == 2
    assert f"refuse: upstream 127.0.0.1:{port} not healthy within 10 s" in bankml.output()


def test_spawn_refuses_an_address_already_answering(
    reference_server: support.LlamaServer,
    default_model: Path,
    default_fork: Path,
    llama_server_bin: Path,
    tmp_path: Path,
) -> None:
    bankml = BankmlProcess(
        default_model,
        default_fork,
        ["--spawn", str(llama_server_bin), "--upstream", f"127.0.0.1:{reference_server.port}"],
        tmp_path / "log",
    ).launch()
    assert bankml.wait_exit() == 2
    assert "something already answers" in bankml.output()


# --- the file replaced, the engine killed, bankml stopped ------------------------------------------


def test_model_file_replaced_answers_503_until_restored(
    spawned: BankmlProcess, model_copy: tuple[Path, Path]
) -> None:
    model = model_copy[0]
    original = model.with_name("original-inode.gguf")
    os.link(model, original)  # keeps the verified inode to put back afterwards
    replacement = model.with_name("replacement.gguf")
    shutil.copyfile(model, replacement)
    os.replace(replacement, model)  # same bytes, another inode: not the file that was hashed
    try:
        for stream in (False, True):
            status, raw, _ = spawned.post(chat_body(stream))
            assert status == 503 and b"bankml_receipt" not in raw
            assert json.loads(raw)["error"]["message"] == FILE_CHANGED
    finally:
        os.replace(original, model)
    status, raw, _ = spawned.post(chat_body(False))
    assert status == 200 and b"bankml_receipt" in raw


def test_engine_killed_mid_stream_ends_cleanly_and_comes_back(
    spawned: BankmlProcess, spawned_hold: tuple[Path, Path]
) -> None:
    hold = spawned_hold[1]
    first_pid = spawned.engine_pid()
    # the restart's llama-server waits in 'starting' until the test has looked
    received = read_killed_stream(spawned, first_pid, before_kill=hold.touch)
    events = sse_events(received)
    assert json.loads(events[-1][len(b"data: ") :])["error"]["message"].startswith(
        "llama-server ended the stream before [DONE]"
    )
    assert b"bankml_receipt" not in received and b"data: [DONE]" not in received
    # meanwhile: 503 with Retry-After (the restart waits 1 s, verifies the file, then starts a
    # llama-server that is held before it loads the model), once bankml has seen the exit
    try:
        deadline = time.monotonic() + 120  # a hang guard only
        while spawned.get("/bankml")[1]["engine"]["state"] == "ready":
            assert time.monotonic() < deadline, "bankml did not notice the engine's exit"
            time.sleep(0.05)
        status, body, headers = spawned.get("/health")
        assert status == 503 and int(headers["Retry-After"]) >= 1, body
    finally:
        hold.unlink()
    deadline = time.monotonic() + 120
    while spawned.get("/health")[0] != 200:
        assert time.monotonic() < deadline, "llama-server did not come back"
        time.sleep(0.2)
    info = spawned.get("/bankml")[1]
    assert info["engine"]["pid"] != first_pid and info["engine"]["restarts"] == 1
    assert process_gone(first_pid)
    body = chat_body(False)
    status, raw, _ = spawned.post(body)
    assert status == 200
    check_whole_receipt(raw, body, support.DEFAULT_SHA256)


KILLS = 10


def llama_servers_on(port: int) -> list[int]:
    """The pids of every running process in the process table with ``--port PORT`` in its
    command line (a zombie has none: bankml's children list shows those)."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmd = proc.info["cmdline"] or []
        if "--port" in cmd[:-1] and cmd[cmd.index("--port") + 1] == str(port):
            found.append(proc.pid)
    return sorted(found)


def read_killed_stream(
    bankml: BankmlProcess, kill: int, before_kill: Callable[[], Any] = lambda: None
) -> bytes:
    """A long streamed answer, its llama-server (pid ``kill``) SIGKILLed after the first event
    (``before_kill`` run just before); everything the client received."""
    conn = bankml.connection()
    try:
        conn.request(
            "POST",
            "/v1/chat/completions",
            body=chat_body(True, content="Count from one to one hundred.", max_tokens=400),
            headers={"Content-Type": "application/json"},
        )
        resp = conn.getresponse()
        assert resp.status == 200
        first = resp.readline()
        assert first.startswith(b"data: ")
        before_kill()
        os.kill(kill, signal.SIGKILL)
        return first + resp.read()  # ends: neither hangs nor resets
    finally:
        conn.close()


def ready_after(bankml: BankmlProcess, restarts: int) -> dict[str, Any]:
    """/bankml's engine once it is ready after at least ``restarts`` restarts."""
    deadline = time.monotonic() + 120  # a hang guard only
    while True:
        info = bankml.get("/bankml")[1]["engine"]
        if info["restarts"] >= restarts and info["state"] == "ready":
            return info
        assert time.monotonic() < deadline, f"no restart {restarts}: {info}"
        time.sleep(0.05)


def test_engine_killed_ten_times_in_a_row_restarts_each_time_and_leaves_no_process(
    model_copy: tuple[Path, Path], llama_server_bin: Path, tmp_path: Path
) -> None:
    """``--restart-delay 0.1``: ten SIGKILLs mid-stream, ten restarts; each stream ends with
    bankml's error event (no receipt, no [DONE]), the process table holds exactly the one
    llama-server after each restart, and the greedy answer is the first llama-server's."""
    model, fork = model_copy
    port = support.free_port()
    engine = ["--spawn", str(llama_server_bin), "--upstream", f"127.0.0.1:{port}"]
    # one thread: a 2-thread pool spins at every barrier on a busy machine, and the answers,
    # not the restarts, would take most of the time
    bankml = BankmlProcess(
        model, fork, [*engine, "--restart-delay", "0.1"], tmp_path / "log", threads=1
    )
    greedy = chat_body(False)
    with bankml:
        status, raw, _ = bankml.post(greedy)
        assert status == 200, raw
        expected = read_answer(raw, "chat").text
        for restarts in range(1, KILLS + 1):
            killed = bankml.engine_pid()
            assert llama_servers_on(port) == [killed]
            events = sse_events(read_killed_stream(bankml, killed))
            error = json.loads(events[-1][len(b"data: ") :])["error"]["message"]
            assert error.startswith("llama-server ended the stream before [DONE]"), events[-1]
            assert not any(b"bankml_receipt" in e or e == b"data: [DONE]" for e in events)
            info = ready_after(bankml, restarts)
            assert info["restarts"] == restarts and info["pid"] != killed
            # only the new one runs, and the killed one is reaped: bankml's children, zombies
            # included, are the new one alone
            assert llama_servers_on(port) == [info["pid"]], bankml.output()[-3000:]
            assert [p.pid for p in psutil.Process(bankml.proc.pid).children()] == [info["pid"]]
            status, raw, _ = bankml.post(greedy)
            assert status == 200, raw
            check_whole_receipt(raw, greedy, support.DEFAULT_SHA256)
            assert read_answer(raw, "chat").text == expected
        assert bankml.output().count("exited unexpectedly: killed by signal 9") == KILLS
    assert llama_servers_on(port) == []


@pytest.mark.parametrize(
    "launcher,sig",
    [
        ("serve", signal.SIGTERM),
        ("serve", signal.SIGINT),
        ("twistd", signal.SIGHUP),
        ("twistd", signal.SIGTERM),
    ],
)
def test_a_signal_stops_bankml_and_leaves_no_llama_server(
    model_copy: tuple[Path, Path], llama_server_bin: Path, tmp_path: Path, launcher: str, sig: int
) -> None:
    model, fork = model_copy
    engine = ["--spawn", str(llama_server_bin), "--upstream", f"127.0.0.1:{support.free_port()}"]
    bankml = BankmlProcess(model, fork, engine, tmp_path / "log", launcher=launcher).start()
    pid = bankml.engine_pid()
    assert psutil.Process(pid).ppid() == bankml.proc.pid
    code = bankml.stop(sig)
    assert code == (128 + sig if launcher == "serve" else -sig), bankml.output()
    # gone when bankml has exited, not soon after: bankml waits for it before it exits
    assert process_gone(pid, 0), "llama-server outlived bankml"
    assert "stopping llama-server" in bankml.output()


def engine_children(pid: int, port: int, deadline: float) -> list[psutil.Process]:
    """The children of ``pid`` whose command line names ``port``, once there are any: a child
    caught within its exec shows no command line for a moment."""
    while True:
        found = []
        for child in psutil.Process(pid).children():
            try:
                if str(port) in " ".join(child.cmdline()):
                    found.append(child)
            except psutil.Error:  # gone, or a zombie
                pass
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.02)


def test_sigterm_while_the_engine_is_starting_leaves_no_llama_server(
    model_copy: tuple[Path, Path], llama_server_bin: Path, tmp_path: Path
) -> None:
    model, fork = model_copy
    port = support.free_port()
    launcher, hold = held_launcher(llama_server_bin, tmp_path)
    hold.touch()  # the engine stays 'starting' however fast the machine is; never released
    bankml = BankmlProcess(
        model,
        fork,
        ["--spawn", str(launcher), "--upstream", f"127.0.0.1:{port}"],
        tmp_path / "log",
    ).launch()
    deadline = time.monotonic() + 60
    while "engine starting: launched" not in bankml.output():
        assert time.monotonic() < deadline and bankml.proc.poll() is None, bankml.output()
        time.sleep(0.02)
    engines = engine_children(bankml.proc.pid, port, deadline)
    assert len(engines) == 1
    assert bankml.stop(signal.SIGTERM) == 128 + signal.SIGTERM, bankml.output()
    assert process_gone(engines[0].pid, 0) and "refuse:" not in bankml.output()


def test_twistd_daemon_starts_and_stops_with_its_pidfile(
    model_copy: tuple[Path, Path], llama_server_bin: Path, tmp_path: Path
) -> None:
    model, fork = model_copy
    pidfile, logfile, port = tmp_path / "bankml.pid", tmp_path / "bankml.log", support.free_port()
    bankml = BankmlProcess(
        model,
        fork,
        ["--spawn", str(llama_server_bin), "--upstream", f"127.0.0.1:{support.free_port()}"],
        tmp_path / "out",
        port=port,
    )
    cmd = [
        str(BIN / "twistd"),
        "--pidfile",
        str(pidfile),
        "--logfile",
        str(logfile),
        "bankml",
        *bankml.command()[2:],
    ]
    assert subprocess.run(cmd, cwd=support.ROOT, timeout=60).returncode == 0  # the parent returns
    deadline = time.monotonic() + 120
    while True:
        try:
            if bankml.get("/bankml")[0] == 200:
                break
        except OSError:
            pass
        assert time.monotonic() < deadline, logfile.read_text()
        time.sleep(0.2)
    daemon = int(pidfile.read_text())
    engine_pid = bankml.engine_pid()
    assert psutil.Process(engine_pid).ppid() == daemon
    os.kill(daemon, signal.SIGTERM)
    assert process_gone(daemon, 120) and process_gone(engine_pid, 0)  # 120 s: a hang guard
    assert not pidfile.exists()
    assert "verified" in logfile.read_text() and "stopping llama-server" in logfile.read_text()
