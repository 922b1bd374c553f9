"""The drop-in side by side with llama-server: ``bankml llama-server`` started as a process,
plain HTTP calls to it, and a pair of both servers started with the same llama-server flags
(the tests of the drop-in's flags: context shift, speculative decoding, presets, --no-jinja,
verbose)."""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests import support
from tests.support import ROOT, free_port


def call(
    port: int, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    try:
        data = None if body is None else json.dumps(body).encode()
        head = {"Content-Type": "application/json"} if data is not None else {}
        conn.request(method, path, data, {**head, **(headers or {})})
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def bankml(*args: str) -> list[str]:
    return [sys.executable, "-m", "bankml", *args]


def start_dropin(args: list[str], port: int, log: Path) -> subprocess.Popen:
    """`bankml llama-server ARGS --port PORT`, healthy (a first engine load compiles kernels)."""
    return _healthy(bankml("llama-server", *args, "--port", str(port)), port, log)


@contextlib.contextmanager
def running_dropin(args: list[str], port: int, log: Path) -> Iterator[subprocess.Popen]:
    """``start_dropin``'s process for the block, terminated after it."""
    proc = start_dropin(args, port, log)
    try:
        yield proc
    finally:
        proc.terminate()
        proc.wait(30)


@contextlib.contextmanager
def running_llama_router(binary: Path, flags: list[str]) -> Iterator[int]:
    """llama-server itself in router mode (``flags``: ``--models-dir`` ...) on a free port,
    once ``GET /models`` answers: its port for the block, terminated after it."""
    port = free_port()
    ref = subprocess.Popen(
        [str(binary), *flags, "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 120
        while not (listening(port) and call(port, "GET", "/models")[0] == 200):
            assert ref.poll() is None and time.monotonic() < deadline, "no router answered"
            time.sleep(0.1)
        yield port
    finally:
        ref.terminate()
        ref.wait(30)


def start_serve(args: list[str], port: int, log: Path) -> subprocess.Popen:
    """`bankml serve ARGS --listen 127.0.0.1:PORT`, healthy (its model loaded)."""
    return _healthy(bankml("serve", *args, f"--listen=127.0.0.1:{port}"), port, log)


def _healthy(argv: list[str], port: int, log: Path) -> subprocess.Popen:
    return _wait_healthy(_spawn(argv, log), argv, port, log)


def _spawn(argv: list[str], log: Path) -> subprocess.Popen:
    with open(log, "wb") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)


def _wait_healthy(
    proc: subprocess.Popen, argv: list[str], port: int, log: Path
) -> subprocess.Popen:
    """``proc`` once /health answers 200 on ``port``; its log in the failure if it never does."""
    # under the suite's per-test timeout, so that a start that never answers fails this test
    # with the process's log (the timeout would end the whole run)
    deadline = time.monotonic() + 600
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            if call(port, "GET", "/health")[0] == 200:
                return proc
        except OSError:
            pass
        time.sleep(0.2)
    proc.kill()
    status = proc.wait()  # a signal (a crash) is -N
    raise AssertionError(
        f"{' '.join(argv[2:4])} did not come up (exit status {status}):\n{log.read_text()}"
    )


class Pair:
    """The drop-in and llama-server, started with the same flags."""

    def __init__(self, ours: int, theirs: int, listen: int = 0) -> None:
        self.ports = (ours, theirs)
        self.listen_port = listen  # the drop-in's --listen: /bankml and Ollama's routes

    def both(self, method: str, path: str, body: Any = None) -> list[tuple[int, bytes]]:
        """(status, body) of the same request to each, the drop-in first."""
        return [call(port, method, path, body)[::2] for port in self.ports]  # type: ignore[misc]


# the /metrics counters a task moves (the rest are gauges, maxima or times)
TASK_COUNTERS = (
    "llamacpp:prompt_tokens_total",
    "llamacpp:prompt_tokens_cached_total",
    "llamacpp:tokens_predicted_total",
    "llamacpp:n_decode_total",
)


def metrics_values(port: int) -> dict[str, float]:
    """GET /metrics' series as numbers (llama-server needs --metrics)."""
    status, _, raw = call(port, "GET", "/metrics")
    assert status == 200, raw
    out = {}
    for line in raw.decode().splitlines():
        if line and not line.startswith("#"):
            name, value = line.split()[:2]
            out[name] = float(value)
    return out


def assert_tasks_counted_alike(
    pair: Pair, requests: list[tuple[str, Any]], statuses: list[int] | None = None
) -> dict[str, float]:
    """The same POSTs to both, each answered with its status of ``statuses`` (200 when not
    given): each counter of TASK_COUNTERS moves by as much on each side, and ``GET /slots``
    afterwards is the same but for ``id_task`` (llama-server numbers its other tasks too).
    Returns the drop-in's moves."""
    before = [metrics_values(port) for port in pair.ports]
    for i, (path, body) in enumerate(requests):
        for port in pair.ports:
            status, _, raw = call(port, "POST", path, body)
            assert status == (200 if statuses is None else statuses[i]), raw
    after = [metrics_values(port) for port in pair.ports]
    moved = [{k: a[k] - b[k] for k in TASK_COUNTERS} for a, b in zip(after, before)]
    assert moved[0] == moved[1]
    slots = [json.loads(raw) for _, raw in pair.both("GET", "/slots")]
    for listing in slots:
        for slot in listing:
            slot.pop("id_task", None)
    assert slots[0] == slots[1], slots
    return moved[0]


def dropin_pair(
    flags: list[str], model: Path, fork: Path, binary: Path, log: Path
) -> Iterator[Pair]:
    """Both servers with llama-server's ``flags`` over the tests' defaults (two threads, one
    slot, no llama-server UI), the drop-in logging to ``log``; stopped when the iterator is."""
    port, listen = free_port(), free_port()
    args = [
        *("--fork", str(fork), "-m", str(model)),
        *("--host", "127.0.0.1", "-t", "2", "-np", "1", "--no-webui"),
        *("--listen", f"127.0.0.1:{listen}"),
        *flags,
    ]
    argv = bankml("llama-server", *args, "--port", str(port))
    proc = _spawn(argv, log)  # it starts while llama-server loads its model
    try:
        with support.LlamaServer(model, args=flags, binary=binary) as ref:
            _wait_healthy(proc, argv, port, log)
            yield Pair(port, ref.port, listen)
    finally:
        proc.terminate()
        proc.wait(30)


def pair_fixture(flags: list[str]) -> Any:
    """A module-scoped fixture: the drop-in and llama-server, both started with ``flags``."""

    @pytest.fixture(scope="module")
    def fixture(
        default_model: Path,
        default_fork: Path,
        llama_server_bin: Path,
        tmp_path_factory: pytest.TempPathFactory,
    ) -> Iterator[Pair]:
        log = tmp_path_factory.mktemp("pair") / "bankml.log"
        yield from dropin_pair(flags, default_model, default_fork, llama_server_bin, log)

    return fixture
