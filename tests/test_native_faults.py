"""Faults injected into a real `bankml serve --native`: the model file truncated, replaced or
removed while serving, and SIGTERM during a stream.

- A file that is no longer the one verified answers every generating endpoint 503 with
  ``FILE_CHANGED`` and no receipt, streamed or not, and nothing is computed from it; a restart
  verifies the file again before anything listens (a truncated file is refused, the
  restored bytes answer again).
- SIGTERM during a stream ends it without a receipt for the partial answer, and bankml exits by
  the signal (128 + 15).
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from bankml.gate.verify import pin
from bankml.serving.vouch import FILE_CHANGED
from tests.native_server import NativeProcess, native_process

CHAT = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 3, "temperature": 0}
GENERATING = [
    ("/v1/chat/completions", CHAT),
    ("/completion", {"prompt": "Hi", "n_predict": 3}),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 3}),
]


@pytest.fixture
def own_copy(default_model: Path, tmp_path: Path) -> tuple[Path, Path]:
    """A copy of the default model, pinned in its own FORK.json: the tests may damage it."""
    model = tmp_path / default_model.name
    shutil.copyfile(default_model, model)
    fork = tmp_path / "FORK.json"
    pin(model, fork)
    return model, fork


@pytest.fixture
def server(own_copy: tuple[Path, Path], tmp_path: Path) -> Iterator[NativeProcess]:
    model, fork = own_copy
    with native_process(model, fork, tmp_path / "run") as proc:
        yield proc


def post(port: int, path: str, body: dict) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def assert_refused_everywhere(server: NativeProcess, reason: str) -> None:
    for address in (server.port, server.engine_port):
        for path, body in GENERATING:
            for stream in (False, True):
                status, raw = post(address, path, {**body, "stream": stream})
                assert status == 503, (path, stream, raw[:200])
                assert json.loads(raw)["error"]["message"] == reason, (path, stream)
                assert b"bankml_receipt" not in raw


def test_a_file_truncated_replaced_or_removed_while_serving_answers_503_without_receipt(
    server: NativeProcess, own_copy: tuple[Path, Path], tmp_path: Path
) -> None:
    model, fork = own_copy
    intact = tmp_path / "intact.gguf"
    shutil.copyfile(model, intact)
    status, raw = post(server.port, "/v1/chat/completions", CHAT)
    assert status == 200 and b"bankml_receipt" in raw
    answered = server.get("/bankml/metrics")[1]["kept"]

    copy = model.with_suffix(".copy")
    shutil.copyfile(model, copy)
    os.replace(copy, model)  # the same bytes under another inode
    assert_refused_everywhere(server, FILE_CHANGED)

    with open(model, "r+b") as f:  # cut in place: same inode, another size
        f.truncate(model.stat().st_size // 2)
    assert_refused_everywhere(server, FILE_CHANGED)

    model.unlink()
    assert_refused_everywhere(server, f"{FILE_CHANGED} (No such file or directory)")
    assert server.get("/bankml/metrics")[1]["kept"] == answered, "something was computed"
    assert server.stop() == 128 + signal.SIGTERM

    # a restart verifies again before anything listens: the cut file is refused ...
    shutil.copyfile(intact, model)
    with open(model, "r+b") as f:
        f.truncate(model.stat().st_size // 2)
    cut = native_process(model, fork, tmp_path / "cut").launch()
    assert cut.wait_exit(120) in (2, 3), cut.output()
    assert "refuse: " in cut.output()
    # ... and the restored bytes answer again
    shutil.copyfile(intact, model)
    with native_process(model, fork, tmp_path / "again") as again:
        status, raw = post(again.port, "/v1/chat/completions", CHAT)
        assert status == 200 and b"bankml_receipt" in raw


def test_sigterm_during_a_stream_ends_it_without_a_receipt(server: NativeProcess) -> None:
    body = {**CHAT, "max_tokens": 400, "stream": True, "messages": [
        {"role": "user", "content": "Write a long story about the sea."}]}  # fmt: skip
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    conn.request(
        "POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"}
    )
    resp = conn.getresponse()
    assert resp.status == 200
    first = resp.readline()
    assert first.startswith(b"data: "), first  # the answer has begun
    server.proc.send_signal(signal.SIGTERM)
    rest = b""
    try:
        while chunk := resp.read1(65536):
            rest += chunk
    except (http.client.IncompleteRead, ConnectionError) as cut:
        rest += getattr(cut, "partial", b"")
    conn.close()
    assert b"bankml_receipt" not in first + rest, "a receipt for a partial answer"
    assert b"[DONE]" not in rest
    assert server.wait_exit(60) == 128 + signal.SIGTERM
