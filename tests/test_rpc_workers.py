"""P0 over llama.cpp's RPC workers: `bankml rpc-worker` (real rpc-server processes, built beside
llama-server by scripts/build-llama-server.sh) on loopback, and `bankml serve --spawn --rpc`
spreading the model over them.

One worker pair is shared by the module; each `bankml serve` here is a subprocess. The greedy
answers over one and two workers are compared with one llama-server's (one process, no RPC): on this CPU build they are the same text, byte for byte (the tests say so by asserting
it). The faults: an rpc-server SIGKILLed mid-answer, and ten killed in a row while idle.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from bankml import rpc
from bankml.receipts.answer import read_answer
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
    sse_events,
)

pytestmark = pytest.mark.llama_server


@pytest.fixture(scope="module")
def rpc_server_bin(llama_server_bin: Path) -> Path:
    binary = llama_server_bin.parent / "rpc-server"
    assert binary.is_file(), (
        f"no rpc-server beside {llama_server_bin}: scripts/build-llama-server.sh builds both"
    )
    return binary


class Worker:
    """`bankml rpc-worker` as a subprocess on a free loopback port."""

    def __init__(self, binary: Path, log: Path, *extra: str) -> None:
        self.port = support.free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.log = log
        cmd = [str(BIN / "bankml"), "rpc-worker", "--port", str(self.port), "--threads", "1"]
        cmd += ["--rpc-server", str(binary), "--restart-delay", "0.2", *extra]
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)

    def wait_answering(self, timeout: float = 60) -> Worker:
        deadline = time.monotonic() + timeout
        while rpc.worker_problem(self.address, 2) is not None:
            assert self.proc.poll() is None, self.log.read_text()
            assert time.monotonic() < deadline, self.log.read_text()
            time.sleep(0.1)
        return self

    def rpc_server_pid(self) -> int:
        (child,) = psutil.Process(self.proc.pid).children()
        return child.pid

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(30)


@pytest.fixture(scope="module")
def workers(rpc_server_bin: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list]:
    logs = tmp_path_factory.mktemp("workers")
    started = [Worker(rpc_server_bin, logs / f"worker{i}.log") for i in range(2)]
    try:
        yield [w.wait_answering() for w in started]
    finally:
        pids = []
        for w in started:
            pids += [c.pid for c in psutil.Process(w.proc.pid).children()]
            assert w.stop() == 128 + signal.SIGTERM
        assert all(process_gone(pid) for pid in pids)  # SIGTERM leaves no rpc-server behind


@pytest.fixture(scope="module")
def model_copy(tmp_path_factory: pytest.TempPathFactory, default_model: Path) -> tuple[Path, Path]:
    return copy_and_pin(default_model, tmp_path_factory.mktemp("rpc"))


def over(
    workers_given: str,
    model_copy: tuple[Path, Path],
    llama_bin: Path,
    log: Path,
    after: bool,
    restart_delay: str = "0.2",
) -> BankmlProcess:
    """`bankml serve --spawn` over the workers, given as bankml's --rpc or after --."""
    model, fork = model_copy
    engine = ["--spawn", str(llama_bin), "--upstream", f"127.0.0.1:{support.free_port()}"]
    engine += ["--restart-delay", restart_delay]
    if after:
        return BankmlProcess(
            model, fork, engine, log, threads=1, llama_args=["--rpc", workers_given]
        )
    return BankmlProcess(model, fork, [*engine, "--rpc", workers_given], log, threads=1)


# --- the hello and the refusals (no llama-server starts) -----------------------------------------


def test_a_worker_answers_hello_with_build_11434s_protocol(workers: list[Worker]) -> None:
    assert rpc.hello(workers[0].address) == rpc.PROTOCOL == (7, 0, 0)


def fake_worker(version: bytes) -> tuple[str, threading.Thread]:
    """A loopback peer that answers one HELLO as an rpc-server of protocol ``version`` would."""
    server = socket.create_server(("127.0.0.1", 0))
    address = f"127.0.0.1:{server.getsockname()[1]}"

    def answer() -> None:
        with server:
            conn, _ = server.accept()
            with conn:
                got = b""
                while len(got) < 1 + 8 + rpc.CONN_CAPS_SIZE:
                    got += conn.recv(64)
                assert got[0] == rpc.RPC_CMD_HELLO
                conn.sendall(struct.pack("<Q", 28) + version + bytes(25))

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    return address, thread


def test_a_worker_of_another_protocol_version_is_refused_before_llama_server_starts(
    model_copy: tuple[Path, Path], llama_server_bin: Path, tmp_path: Path
) -> None:
    address, thread = fake_worker(bytes([6, 1, 0]))
    bankml = over(address, model_copy, llama_server_bin, tmp_path / "log", after=False).launch()
    assert bankml.wait_exit() != 0
    thread.join(10)
    out = bankml.output()
    assert f"RPC worker {address} speaks RPC protocol 6.1.0, not 7.0.0" in out, out
    assert "launched:" not in out  # refused before any llama-server


def test_an_unreachable_worker_is_refused_with_the_reason(
    model_copy: tuple[Path, Path], llama_server_bin: Path, tmp_path: Path
) -> None:
    address = f"127.0.0.1:{support.free_port()}"
    bankml = over(address, model_copy, llama_server_bin, tmp_path / "log", after=True).launch()
    assert bankml.wait_exit() != 0
    assert f"RPC worker {address} cannot be reached" in bankml.output()


@pytest.mark.parametrize(
    "args,message",
    [
        (["--rpc", "127.0.0.1"], "expected HOST:PORT"),
        (["--rpc", "127.0.0.1:1,127.0.0.1:1"], "named twice"),
        (["--rpc", "127.0.0.1:1", "--", "--rpc", "127.0.0.1:2"], "given twice"),
        (["--max-loaded", "2", "--", "--rpc", "127.0.0.1:1"], "serves one model"),
    ],
)
def test_bad_rpc_arguments_are_usage_errors(
    model_copy: tuple[Path, Path], llama_server_bin: Path, args: list[str], message: str
) -> None:
    from twisted.python import usage

    from bankml.tap import Options

    model, fork = model_copy
    with pytest.raises(usage.UsageError, match=message):
        Options().parseOptions(
            [str(model), "--fork", str(fork), "--spawn", str(llama_server_bin), *args]
        )


def test_rpc_given_to_bankml_goes_to_llama_server_after_its_other_arguments(
    model_copy: tuple[Path, Path], llama_server_bin: Path
) -> None:
    from bankml.tap import Options

    model, fork = model_copy
    options = Options()
    options.parseOptions(
        [str(model), "--fork", str(fork), "--spawn", str(llama_server_bin)]
        + ["--rpc", "127.0.0.1:50052,localhost:50053", "--", "-fa", "on"]
    )
    assert options["engine_args"] == ["-fa", "on", "--rpc", "127.0.0.1:50052,localhost:50053"]
    assert options["rpc_workers"] == ("127.0.0.1:50052", "localhost:50053")


def test_a_second_worker_on_an_address_in_use_is_refused(
    workers: list[Worker], rpc_server_bin: Path
) -> None:
    done = subprocess.run(
        [str(BIN / "bankml"), "rpc-worker", "--port", str(workers[0].port)]
        + ["--rpc-server", str(rpc_server_bin)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 3, done.stderr
    assert f"something already listens on {workers[0].address}" in done.stderr


def test_rpc_worker_binds_another_address_only_when_told_to(rpc_server_bin: Path) -> None:
    done = subprocess.run(
        [
            str(BIN / "bankml"),
            "rpc-worker",
            "--host",
            "0.0.0.0",
            "--rpc-server",
            str(rpc_server_bin),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1 and "no authentication" in done.stderr, done.stderr


# --- answers over workers ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def single(default_model: Path, llama_server_bin: Path) -> Iterator[support.LlamaServer]:
    """One llama-server without RPC, one thread as the workers' (two threads on two shared
    cores spin at every barrier)."""
    with support.LlamaServer(default_model, binary=llama_server_bin, args=["-t", "1"]) as server:
        yield server


def reference_text(single: support.LlamaServer, body: bytes) -> str:
    status, answer = support.http_json(single.url + "/v1/chat/completions", json.loads(body))
    assert status == 200, answer
    return answer["choices"][0]["message"]["content"]


@pytest.mark.parametrize("count,after", [(1, False), (2, True)])
def test_greedy_answers_over_workers_are_the_single_process_answers_with_the_workers_in_the_receipt(
    workers: list[Worker],
    model_copy: tuple[Path, Path],
    llama_server_bin: Path,
    single: support.LlamaServer,
    signing_key: Any,
    tmp_path: Path,
    count: int,
    after: bool,
) -> None:
    addresses = [w.address for w in workers[:count]]
    bankml = over(",".join(addresses), model_copy, llama_server_bin, tmp_path / "log", after)
    bankml.engine_args += ["--receipt-key", str(signing_key.path)]
    body = chat_body(False, max_tokens=16)
    stream_body = chat_body(True, max_tokens=16)
    with bankml:
        status, raw, _ = bankml.post(body)
        assert status == 200, raw
        status, streamed, _ = bankml.post(stream_body)
        assert status == 200, streamed
        public_key = bankml.get("/bankml/key")[1]
        assert "--rpc " + ",".join(addresses) in bankml.output()  # llama-server's command line
    receipt = check_whole_receipt(raw, body, support.DEFAULT_SHA256)
    assert receipt["rpc"] == addresses
    assert check_streamed_receipt(streamed, stream_body, support.DEFAULT_SHA256)["rpc"] == addresses
    # signed as every receipt: bankml check-receipt says valid
    assert check_receipt_cli(tmp_path, body, raw, public_key["public_key"]) == (0, "valid")
    # bit-identical to one llama-server without RPC, on this CPU build
    assert read_answer(raw, "chat").text == reference_text(single, body)


# --- faults ---------------------------------------------------------------------------------------


def test_a_worker_killed_mid_answer_ends_the_stream_cleanly_then_503_then_answers_again(
    workers: list[Worker],
    model_copy: tuple[Path, Path],
    llama_server_bin: Path,
    tmp_path: Path,
) -> None:
    worker = workers[1]
    # llama-server restarts 2 s after its end: the 503 is read well within that
    log = tmp_path / "log"
    bankml = over(worker.address, model_copy, llama_server_bin, log, False, restart_delay="2")
    with bankml:
        first_engine = bankml.engine_pid()
        killed = worker.rpc_server_pid()
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
            os.kill(killed, signal.SIGKILL)
            received = first + resp.read()  # ends: neither hangs nor resets
        finally:
            conn.close()
        events = sse_events(received)
        assert b"bankml_receipt" not in received and b"data: [DONE]" not in received
        error = json.loads(events[-1][len(b"data: ") :])["error"]["message"]
        assert error.startswith("llama-server ended the stream before [DONE]"), events[-1]
        # until llama-server serves again: 503 with Retry-After
        deadline = time.monotonic() + 120  # a hang guard only
        while bankml.get("/bankml")[1]["engine"]["state"] == "ready":
            assert time.monotonic() < deadline, "bankml did not notice llama-server's end"
            time.sleep(0.05)
        status, _, headers = bankml.get("/health")
        assert status == 503 and int(headers["Retry-After"]) == 2
        assert bankml.get("/bankml")[1]["engine"]["rpc"] == [worker.address]
        # rpc-worker restarts its rpc-server, then bankml restarts llama-server on it
        deadline = time.monotonic() + 180
        while bankml.get("/health")[0] != 200:
            assert time.monotonic() < deadline, bankml.output()[-3000:]
            time.sleep(0.2)
        assert worker.rpc_server_pid() != killed and process_gone(killed)
        assert bankml.engine_pid() != first_engine and process_gone(first_engine)
        body = chat_body(False)
        status, raw, _ = bankml.post(body)
        assert status == 200, raw
        assert check_whole_receipt(raw, body, support.DEFAULT_SHA256)["rpc"] == [worker.address]


def test_ten_worker_kills_in_a_row_each_give_a_clean_refusal_then_answers(
    workers: list[Worker],
    model_copy: tuple[Path, Path],
    llama_server_bin: Path,
    tmp_path: Path,
) -> None:
    """An rpc-server killed while llama-server idles, ten times: each time the next request is
    refused cleanly (no receipt, never a 200 without one) and, once rpc-worker and bankml have
    restarted their processes, answers again with a valid receipt; bankml's SIGTERM then leaves
    no llama-server (the module's workers leave no rpc-server)."""
    worker = workers[0]
    bankml = over(worker.address, model_copy, llama_server_bin, tmp_path / "log", False)
    engines = []
    body = chat_body(False, max_tokens=2)
    with bankml:
        for _ in range(10):
            engines.append(bankml.engine_pid())
            killed = worker.rpc_server_pid()
            os.kill(killed, signal.SIGKILL)
            status, raw, _ = bankml.post(body)
            assert status != 200 or b"bankml_receipt" in raw, raw
            deadline = time.monotonic() + 120  # a hang guard only
            while True:
                status, raw, _ = bankml.post(body)
                if status == 200:
                    break
                assert status in (502, 503), raw
                assert time.monotonic() < deadline, bankml.output()[-3000:]
                time.sleep(0.2)
            assert check_whole_receipt(raw, body, support.DEFAULT_SHA256)["rpc"] == [worker.address]
            assert process_gone(killed)
        engines.append(bankml.engine_pid())
    assert len(set(engines)) == 11  # a new llama-server after each kill
    assert all(process_gone(pid) for pid in engines)


# --- across network namespaces -------------------------------------------------------------------


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


@pytest.fixture(scope="module")
def worker_namespace() -> Iterator[tuple[str, str, str]]:
    """(namespace, its address, this namespace's address): a network namespace joined to this
    one by a veth pair on 10.231.0.0/24; skipped where `ip netns` cannot make one (not root)."""
    name = f"bkrpc{os.getpid()}"
    try:
        ip("netns", "add", name)
    except (OSError, subprocess.CalledProcessError) as err:
        pytest.skip(f"ip netns is not available here: {err}")
    here, there = f"{name}h", f"{name}w"
    try:
        try:
            ip("link", "add", here, "type", "veth", "peer", "name", there)
            ip("link", "set", there, "netns", name)
            ip("addr", "add", "10.231.0.2/24", "dev", here)
            ip("link", "set", here, "up")
            ip("-n", name, "addr", "add", "10.231.0.1/24", "dev", there)
            ip("-n", name, "link", "set", there, "up")
            ip("-n", name, "link", "set", "lo", "up")
        except subprocess.CalledProcessError as err:
            pytest.skip(f"no veth pair into a network namespace here: {err.stderr!r}")
        yield name, "10.231.0.1", "10.231.0.2"
    finally:
        subprocess.run(["ip", "link", "del", here], capture_output=True, timeout=30)
        ip("netns", "del", name)


def test_a_worker_in_another_network_namespace_serves_p0_over_the_veth(
    worker_namespace: tuple[str, str, str],
    rpc_server_bin: Path,
    model_copy: tuple[Path, Path],
    llama_server_bin: Path,
    tmp_path: Path,
) -> None:
    """`bankml rpc-worker --host ADDR --allow-network` in its own namespace (with the warning);
    `bankml serve --spawn --rpc ADDR:PORT` here answers over it, the receipt naming it."""
    name, address, _ = worker_namespace
    port = support.free_port()
    worker_log = tmp_path / "worker.log"
    cmd = ["ip", "netns", "exec", name, str(BIN / "bankml"), "rpc-worker", "--host", address]
    cmd += ["--port", str(port), "--allow-network", "--threads", "1"]
    cmd += ["--rpc-server", str(rpc_server_bin)]
    with open(worker_log, "wb") as out:
        worker = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    try:
        target = f"{address}:{port}"
        deadline = time.monotonic() + 60
        while rpc.worker_problem(target, 2) is not None:
            assert worker.poll() is None and time.monotonic() < deadline, worker_log.read_text()
            time.sleep(0.1)
        assert "has no authentication" in worker_log.read_text()
        bankml = over(target, model_copy, llama_server_bin, tmp_path / "log", after=False)
        with bankml:
            body = chat_body(False)
            status, raw, _ = bankml.post(body)
        assert status == 200, raw
        assert check_whole_receipt(raw, body, support.DEFAULT_SHA256)["rpc"] == [target]
    finally:
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(30) == 128 + signal.SIGTERM
