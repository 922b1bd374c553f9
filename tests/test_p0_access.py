"""P0 with `--api-key` and `--cors-origins`: bankml checks who may call before it forwards.

`bankml serve --upstream` in front of the shared real llama-server (which has no key of its own):
without the key every endpoint but `/health` is llama-server's 401 body and nothing reaches the
engine's completions; with it (Bearer or `X-Api-Key`) the answer comes with its receipt. CORS
headers follow `--cors-origins`. Other llama-server flags in P0 are refused with the way to pass
them.
"""

from __future__ import annotations

import http.client
import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bankml.serving.access import INVALID_API_KEY
from tests import support
from tests.bankml_process import BIN, BankmlProcess

pytestmark = pytest.mark.llama_server
KEY = "p0-secret-key"
CHAT = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 3, "temperature": 0}


def health(port: int) -> int | None:
    try:
        return request(port, "GET", "/health")[0]
    except OSError:
        return None


def request(
    port: int, method: str, path: str, body: dict | None = None, headers: dict | None = None
) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        data = None if body is None else json.dumps(body)
        sent = {"Content-Type": "application/json", **(headers or {})}
        conn.request(method, path, data, sent)
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


@pytest.fixture(scope="module")
def guarded(
    reference_server: support.LlamaServer,
    default_model: Path,
    default_fork: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[BankmlProcess]:
    log = tmp_path_factory.mktemp("log") / "p0-access.log"
    engine = ["--upstream", f"127.0.0.1:{reference_server.port}", "--api-key", KEY]
    engine += ["--cors-origins", "localhost"]
    bankml = BankmlProcess(default_model, default_fork, engine, log).launch()
    deadline = time.monotonic() + 180  # /bankml needs the key: ready is /health's 200
    while health(bankml.port) != 200:
        assert bankml.proc.poll() is None, bankml.output()
        assert time.monotonic() < deadline, bankml.output()
        time.sleep(0.1)
    yield bankml
    bankml.stop()


def test_without_the_key_everything_but_health_is_401(guarded: BankmlProcess) -> None:
    for method, path, body in [
        ("POST", "/v1/chat/completions", CHAT),
        ("POST", "/completion", {"prompt": "Hi", "n_predict": 2}),
        ("POST", "/tokenize", {"content": "hi"}),
        ("GET", "/v1/models", None),
        ("GET", "/bankml", None),
    ]:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"X-Api-Key": "wrong"}):
            status, _, raw = request(guarded.port, method, path, body, headers)
            assert (status, raw) == (401, INVALID_API_KEY), (method, path, headers)
    assert request(guarded.port, "GET", "/health")[0] == 200
    assert KEY not in guarded.output()


def test_with_the_key_the_answer_and_its_receipt_come_back(guarded: BankmlProcess) -> None:
    for headers in ({"Authorization": f"Bearer {KEY}"}, {"X-Api-Key": KEY}):
        status, _, raw = request(guarded.port, "POST", "/v1/chat/completions", CHAT, headers)
        assert status == 200, raw
        assert "bankml_receipt" in json.loads(raw)


def test_cors_follows_cors_origins(guarded: BankmlProcess) -> None:
    auth = {"Authorization": f"Bearer {KEY}"}
    local = {**auth, "Origin": "http://localhost:3000"}
    _, headers, _ = request(guarded.port, "GET", "/v1/models", None, local)
    assert headers["access-control-allow-origin"] == "http://localhost:3000"
    _, headers, _ = request(
        guarded.port, "GET", "/v1/models", None, {**auth, "Origin": "http://a.example"}
    )
    assert "access-control-allow-origin" not in headers
    status, headers, body = request(guarded.port, "OPTIONS", "/v1/chat/completions", None, local)
    assert (status, body) == (200, b"") and "access-control-allow-methods" in headers


def test_other_llama_server_flags_in_p0_are_refused_with_the_way_to_pass_them(
    default_model: Path, default_fork: Path
) -> None:
    out = subprocess.run(
        [str(BIN / "bankml"), "serve", str(default_model), "--fork", str(default_fork),
         "--upstream", "127.0.0.1:1", "--temp", "0"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 1
    assert "--temp is llama-server's: bankml takes it with --native" in out.stderr
    assert "after --" in out.stderr
