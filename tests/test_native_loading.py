"""A native start listens as soon as the file is verified and answers llama-server's 503
"Loading model" until the engine is up.

The NativeService tap starts for ``--native``, in this process, on ports 0, with the engine's
bring-up held back (its kernel compile made to wait): both addresses already answer every path,
``/health`` and ``/bankml`` included, with llama-server's own 503 body, byte for byte as
llama-server's server-state middleware writes it; once the bring-up goes on, the same ports
answer the model's routes.
"""

from __future__ import annotations

import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import pytest_twisted
from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.internet.threads import deferToThread

from bankml.native.service import make_native_service
from bankml.serving.routes import LOADING

pytestmark = pytest.mark.slow


def fetch(url: str, body: bytes | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(url, body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            return answer.status, bytes(answer.read())
    except urllib.error.HTTPError as err:
        return err.code, err.read()


@pytest_twisted.ensureDeferred
async def test_every_path_answers_loading_model_until_the_engine_is_up(
    default_model: Path, tmp_path: Path
) -> None:
    svc: Any = make_native_service(
        {
            "file": str(default_model),
            "fork": str(default_model) + ".FORK.json",
            "ctx": 2048,
            "device": "cpu",
            "listen": "127.0.0.1:0",
            "upstream": "127.0.0.1:0",
            "slot-dir": str(tmp_path),
        },
        reactor,
    )
    compiling, held = svc.compiling, Deferred()
    svc.compiling = held  # the bring-up waits for it first
    svc.exit_at_interpreter_end = False
    svc.startService()
    try:
        urls = [f"http://127.0.0.1:{svc.port_of(i)}" for i in (0, 1)]
        for url in urls:
            for path, body in [
                ("/health", None),
                ("/bankml", None),
                ("/v1/models", None),
                ("/v1/chat/completions", b'{"messages":[{"role":"user","content":"Hi"}]}'),
            ]:
                status, answer = await deferToThread(fetch, url + path, body)
                assert (status, answer) == (503, LOADING), (url, path)
        if compiling is not None:
            compiling.chainDeferred(held)
        else:
            held.callback(None)
        await svc.ready
        status, _ = await deferToThread(fetch, urls[1] + "/v1/models")
        assert status == 200 and svc.native is not None
    finally:
        await svc.stopService()
