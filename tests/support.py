"""Shared test helpers: where llama-server and the default model are, free ports, a real llama-server process.

Tests use the real llama-server built by scripts/build-llama-server.sh and the default model
fetched by scripts/fetch-model.sh. `make test` passes both in the environment; run alone, the
helpers find them the same way (the build script answers at once when its cache is in place).
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from bankml.llama_server import command_line

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_FORK = ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf.FORK.json"
DEFAULT_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def llama_server_binary() -> Path:
    """The reference llama-server: $BANKML_LLAMA_SERVER, else the build script's cached binary."""
    env = os.environ.get("BANKML_LLAMA_SERVER")
    if env:
        return Path(env)
    out = subprocess.run(
        [str(ROOT / "scripts" / "build-llama-server.sh")],
        check=True,
        capture_output=True,
        text=True,
    )
    return Path(out.stdout.strip().splitlines()[-1])


def default_model() -> Path:
    env = os.environ.get("BANKML_MODEL")
    if env:
        return Path(env).resolve()
    subprocess.run([str(ROOT / "scripts" / "fetch-model.sh")], check=True, capture_output=True)
    return DEFAULT_MODEL


def llama_templates_dir(llama_server_bin: Path) -> Path:
    """llama.cpp's models/templates: scripts/build-llama-server.sh keeps the source beside the
    binary (<cache>/<version>/src/llama.cpp); a path that does not exist when it is not there."""
    for parent in llama_server_bin.resolve().parents:
        candidate = parent / "src" / "llama.cpp" / "models" / "templates"
        if candidate.is_dir():
            return candidate
    return Path("/nonexistent")


def _die_with_parent() -> None:
    """PR_SET_DEATHSIG: a test run that is killed leaves no llama-server behind (Linux only)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)
    except (AttributeError, OSError):
        pass


_HANDED_OUT: set[int] = set()  # the ports free_port gave this process


def compiled_probe(tmp_path: Path, source: str) -> Path:
    """A C++ program compiled here with the system's compiler and standard library (the ones
    llama-server is built with), to compare an order or a rounding with; the test is skipped
    where there is no C++ compiler."""
    compiler = shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        pytest.skip("no C++ compiler")
    (tmp_path / "probe.cpp").write_text(source)
    subprocess.run(
        [compiler, "-O1", "-o", str(tmp_path / "probe"), str(tmp_path / "probe.cpp")], check=True
    )
    return tmp_path / "probe"


def free_port() -> int:
    """A loopback port nothing listens on, never one this process was given before: a
    fixture that asks for two (``--port`` and ``--listen``) gets two, and a test never binds
    a port an earlier test's server may still hold."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


def http_json(url: str, body: dict | None = None, timeout: float = 120) -> tuple[int, dict]:
    """A blocking JSON request for test set-up (not for the code under test)."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as err:
        raw = err.read()
        try:
            return err.code, json.loads(raw)
        except ValueError:
            return err.code, {"raw": raw.decode("utf-8", "replace")}


@dataclass
class LlamaServer:
    """A real llama-server on a free loopback port, for oracle and gateway tests."""

    model: Path
    args: list[str] = field(default_factory=list)
    binary: Path = field(default_factory=llama_server_binary)
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 120) -> LlamaServer:
        # thinking as llama-server decides it from the template, as bankml's engine does; the
        # test's args follow bankml's defaults (of a flag given twice llama-server reads the last)
        cmd = command_line(
            str(self.binary),
            str(self.model),
            "127.0.0.1",
            self.port,
            2,
            2048,
            reasoning_off=False,
            after=self.args,
        )
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=_die_with_parent
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.proc.returncode}: {cmd}")
            try:
                if http_json(self.url + "/health", timeout=2)[0] == 200:
                    return self
            except OSError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError("llama-server did not become healthy")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> LlamaServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
