"""process_protocol.py: launching, supervising and stopping the engine.

The engine here is tests/mock_llama.py run as a real process with llama-server's arguments
(fast and controllable); tests/test_serve_p0.py does the same with the real llama-server.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
import pytest_twisted
from twisted.internet import defer, reactor
from twisted.python import usage

from bankml.gate.fileident import FileIdent
from bankml.gate.guard import GuardResult
from bankml.gate.verify import Refused, Verified
from bankml.p0 import gateway as gw
from bankml.p0.gateway import Gateway, make_agent
from bankml.process_protocol import (
    EngineFailed,
    EngineProcess,
    RestartDelay,
    llama_server_args,
    parse_restart_delay,
    with_deathsig,
)
from bankml.tap import Options
from tests.bankml_process import process_gone
from tests.events import HANG_GUARD_S, until
from tests.mock_llama import MockLlama, listen
from tests.support import ROOT, free_port


def test_llama_server_arguments_are_serve_md_s() -> None:
    base = [
        "BIN",
        "-m",
        "/m.gguf",
        "--host",
        "127.0.0.1",
        "--port",
        "18092",
        "-t",
        "3",
        "-c",
        "4096",
        "-np",
        "1",
        "--jinja",
        "--reasoning",
        "off",
        "--no-webui",
    ]
    assert llama_server_args("BIN", "/m.gguf", "127.0.0.1", 18092, 3, 4096) == base
    assert llama_server_args(
        "BIN", "/m.gguf", "127.0.0.1", 18092, 3, 4096, "/slots", True
    ) == base + ["--spec-type", "ngram-simple", "--slot-save-path", "/slots"]


@pytest.mark.parametrize(
    "text,first,most", [("1:60", 1, 60), ("0.1", 0.1, 0.1), ("0.5:2", 0.5, 2), ("3:3", 3, 3)]
)
def test_restart_delay_reads_min_and_max(text: str, first: float, most: float) -> None:
    assert parse_restart_delay(text) == RestartDelay(first, most)


@pytest.mark.parametrize(
    "text", ["", "x", "1:", "0:5", "0.05", "5:1", "1:2:3", "-1", "nan", "1:inf"]
)
def test_restart_delay_refuses_what_is_not_min_max(text: str) -> None:
    with pytest.raises(ValueError, match="--restart-delay"):
        parse_restart_delay(text)


def test_serve_takes_restart_delay_with_spawn_only(tmp_path: Path) -> None:
    binary = tmp_path / "llama-server"
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    base = ["m.gguf", "--fork", "f.json"]
    options = Options()
    options.parseOptions([*base, "--spawn", str(binary)])
    assert options["restart_delay"] == RestartDelay(1, 60)  # the default: 1 s doubling to 60 s
    options = Options()
    options.parseOptions([*base, "--spawn", str(binary), "--restart-delay", "0.2:5"])
    assert options["restart_delay"] == RestartDelay(0.2, 5)
    for argv in (
        [*base, "--restart-delay", "2"],  # no llama-server to restart
        [*base, "--spawn", str(binary), "--restart-delay", "5:1"],
    ):
        with pytest.raises(usage.UsageError, match="--restart-delay"):
            Options().parseOptions(argv)


def test_the_death_signal_shim_wraps_the_command() -> None:
    exe, argv = with_deathsig(["/bin/true", "x"])
    assert exe == sys.executable and argv[-2:] == ["/bin/true", "x"]
    assert argv[argv.index("-c") + 2] == str(os.getpid())


def test_a_sigkilled_parent_takes_its_engine_with_it() -> None:
    """PR_SET_DEATHSIG: even a SIGKILL of bankml, which runs no shutdown code, leaves no engine."""
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "import subprocess,sys,time\n"
                "from bankml.process_protocol import with_deathsig\n"
                "exe, argv = with_deathsig(['/bin/sleep', '60'])\n"
                "child = subprocess.Popen(argv, executable=exe)\n"
                "print(child.pid, flush=True); time.sleep(60)\n"
            ),
        ],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    child_pid = int(parent.stdout.readline())
    deadline = time.monotonic() + HANG_GUARD_S
    while psutil.Process(child_pid).name() != "sleep":  # until the shim has exec'd
        assert time.monotonic() < deadline, "the shim never exec'd"
        time.sleep(0.05)
    parent.kill()
    parent.wait()
    # the signal comes at the parent's death; its delivery is awaited, the guard bounds a hang
    assert process_gone(child_pid, HANG_GUARD_S), "the engine outlived its SIGKILLed parent"


@pytest.fixture
def fake_engine(tmp_path: Path) -> Path:
    """An executable that runs the mock llama-server with whatever arguments it is given."""
    script = tmp_path / "llama-server"
    script.write_text(f'#!/bin/sh\nexec {sys.executable} {ROOT / "tests" / "mock_llama.py"} "$@"\n')
    script.chmod(0o755)
    return script


@pytest.fixture
def gateway(tmp_path: Path):
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF mock")
    verified = Verified(
        str(model.resolve()),
        hashlib.sha256(b"GGUF mock").hexdigest(),
        GuardResult("play"),
        FileIdent.of(model),
        time.time(),
        str(tmp_path / "F.json"),
    )
    g = Gateway(verified, ("127.0.0.1", free_port()), "spawn", make_agent(reactor), reactor)
    yield g
    pytest_twisted.blockon(defer.maybeDeferred(g.close))


@pytest_twisted.ensureDeferred
async def test_spawn_waits_for_health_and_stop_leaves_no_process(
    gateway: Gateway, fake_engine: Path
) -> None:
    engine = EngineProcess(gateway, str(fake_engine), threads=1, ctx=256)
    await engine.start()
    assert gateway.state == gw.READY and gateway.engine_build == "b0-mock"
    pid = gateway.pid
    assert psutil.Process(pid).is_running()
    await engine.stop()
    assert gateway.state == gw.STOPPED and process_gone(pid, 0)  # stop fires once it is gone


@pytest_twisted.ensureDeferred
async def test_spawn_refuses_when_something_answers_on_the_address(
    gateway: Gateway, fake_engine: Path
) -> None:
    squatter = listen(MockLlama(model_path="/other.gguf"))
    gateway.upstream = ("127.0.0.1", squatter.getHost().port)
    engine = EngineProcess(gateway, str(fake_engine), threads=1, ctx=256)
    try:
        with pytest.raises(EngineFailed, match="something already answers on 127.0.0.1:"):
            await engine.start()
        assert engine.starts == 0
    finally:
        await squatter.stopListening()


@pytest_twisted.ensureDeferred
async def test_an_engine_that_exits_while_starting_fails_at_once(
    gateway: Gateway, tmp_path: Path
) -> None:
    failing = tmp_path / "llama-server"
    failing.write_text("#!/bin/sh\necho 'error: bad model' >&2\nexit 3\n")
    failing.chmod(0o755)
    # an hour's health timeout: a start that waited for it instead of noticing the exit would
    # trip the 120 s hang guard (generous for a busy machine; the exit is noticed at once)
    engine = EngineProcess(gateway, str(failing), threads=1, ctx=256, health_timeout=3600)
    started = engine.start()
    started.addTimeout(120, reactor)
    with pytest.raises(EngineFailed, match="exited before it was healthy .*exit status 3"):
        await started


def verifies_the_same(
    gateway: Gateway, calls: list[tuple[str, str]]
) -> Callable[[str, str], Verified]:
    """A re-verify that finds the same file (the fixture's pin is not a real FORK.json)."""

    def reverify(path: str, fork: str) -> Verified:
        calls.append((path, fork))
        v = gateway.verified
        return Verified(v.path, v.sha256, v.guard, FileIdent.of(v.path), time.time(), v.fork_path)

    return reverify


@pytest_twisted.ensureDeferred
async def test_unexpected_death_reverifies_and_restarts(
    gateway: Gateway, fake_engine: Path
) -> None:
    calls: list[tuple[str, str]] = []
    reverify = verifies_the_same(gateway, calls)
    engine = EngineProcess(gateway, str(fake_engine), threads=1, ctx=256, reverify=reverify)
    await engine.start()
    first = gateway.pid
    os.kill(first, signal.SIGKILL)
    await until(lambda: gateway.state == gw.DOWN, "the engine down")
    assert gateway.retry_after_s == 1 and "killed by signal 9" in gateway.state_reason
    await until(lambda: gateway.state == gw.READY, "the engine ready again")
    assert gateway.pid != first and gateway.restarts == 1
    assert calls == [(gateway.verified.path, gateway.verified.fork_path)]
    assert engine.backoff == 2, "the next restart would wait twice as long"
    await engine.stop()


@pytest_twisted.ensureDeferred
async def test_the_restart_delay_doubles_from_min_to_max(
    gateway: Gateway, fake_engine: Path
) -> None:
    engine = EngineProcess(
        gateway,
        str(fake_engine),
        threads=1,
        ctx=256,
        reverify=verifies_the_same(gateway, []),
        restart_delay=RestartDelay(0.1, 0.3),
    )
    await engine.start()
    waits = []
    for restarts in (1, 2, 3):
        waits.append(engine.backoff)
        os.kill(gateway.pid, signal.SIGKILL)
        await until(lambda n=restarts: gateway.restarts == n and gateway.state == gw.READY, "up")
    assert waits == [0.1, 0.2, 0.3] and engine.backoff == 0.3
    assert gateway.retry_after_s == 1  # Retry-After is whole seconds, at least 1
    await engine.stop()


@pytest_twisted.ensureDeferred
async def test_a_file_that_no_longer_verifies_is_not_restarted(
    gateway: Gateway, fake_engine: Path
) -> None:
    def reverify(path: str, fork: str) -> Verified:
        raise Refused("model.gguf sha256 00 != pinned 11: refused")

    engine = EngineProcess(gateway, str(fake_engine), threads=1, ctx=256, reverify=reverify)
    await engine.start()
    os.kill(gateway.pid, signal.SIGKILL)
    await until(lambda: gateway.state == gw.REFUSED, "the engine refused")
    assert "no longer verifies" in gateway.state_reason and engine.starts == 1
    assert gateway.availability_problem()[1] is None, "no Retry-After: it will not come back"
    await engine.stop()


@pytest_twisted.ensureDeferred
async def test_an_engine_ignoring_sigterm_is_killed_after_the_grace(
    gateway: Gateway, tmp_path: Path
) -> None:
    stubborn = tmp_path / "llama-server"
    stubborn.write_text(
        f"#!/bin/sh\nexec {sys.executable} {ROOT / 'tests' / 'mock_llama.py'} "
        '"$@" --ignore-sigterm\n'
    )
    stubborn.chmod(0o755)
    engine = EngineProcess(gateway, str(stubborn), threads=1, ctx=256)
    await engine.start()
    pid = gateway.pid
    await engine.stop(grace=0.5)
    # stop fires once the process is gone; it ignored the SIGTERM, so the SIGKILL ended it
    assert process_gone(pid, 0) and "killed by signal 9" in gateway.state_reason
