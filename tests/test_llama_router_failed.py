"""Router mode: a pinned model whose load fails half way (its header says three layers, its
file holds two), side by side with llama-server's router on the same directory. Both list it
``unloaded`` with ``exit_code`` 1 and ``failed``, send its ``status_change`` to ``/models/sse``,
refuse a request for it, and go on serving the other model; bankml answers the load itself
with a 500 and the reason (llama-server answers at once and loads in the background), keeps
nothing of the model, and gives its memory back: RSS after ten failed loads within 2 % of
after the first."""

from __future__ import annotations

import json
import os
import struct
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from gguf import GGMLQuantizationType as T

from tests.dropin import call, running_dropin, running_llama_router
from tests.gguf_bytes import s as gguf_string
from tests.native_support import wait_for
from tests.registry_support import pin_into
from tests.support import free_port
from tests.test_llama_router_reload import Events
from tests.tiny_models import TinySpec, write_tiny_model

NAME, BROKEN = "smol", "broken"
SHORT = {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}


def broken_model(path: Path, default_model: Path) -> Path:
    """A tiny llama model whose ``llama.block_count`` says 3 over its two layers' tensors: the
    header and the pin are sound, the load fails at the third layer."""
    write_tiny_model(path, TinySpec("llama", T.Q4_1), default_model)
    raw = path.read_bytes()
    key = gguf_string("llama.block_count") + struct.pack("<I", 4)  # a uint32
    assert raw.count(key + struct.pack("<I", 2)) == 1
    path.write_bytes(raw.replace(key + struct.pack("<I", 2), key + struct.pack("<I", 3)))
    return path


@pytest.fixture(scope="module")
def flags(tmp_path_factory: pytest.TempPathFactory, default_model: Path) -> list[str]:
    directory = tmp_path_factory.mktemp("router-failed") / "models"
    directory.mkdir()
    os.symlink(default_model, directory / f"{NAME}.gguf")
    pin_into(directory, directory / f"{NAME}.gguf")
    pin_into(directory, broken_model(directory / f"{BROKEN}.gguf", default_model))
    return ["--models-dir", str(directory), "--models-max", "1", "-c", "512"] + [
        *("--host", "127.0.0.1", "-t", "2", "--no-webui")
    ]


@pytest.fixture(scope="module")
def bankml(flags: list[str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple]:
    port = free_port()
    log = tmp_path_factory.mktemp("router-failed-log") / "bankml.log"
    args = [*flags, "--listen", f"127.0.0.1:{free_port()}"]
    with running_dropin(args, port, log) as proc:
        yield port, proc


@pytest.fixture(scope="module")
def reference(flags: list[str], llama_server_bin: Path) -> Iterator[int]:
    with running_llama_router(llama_server_bin, flags) as port:
        yield port


def status_of(port: int, name: str) -> dict:
    status, _, raw = call(port, "GET", "/models")
    assert status == 200, raw
    return {m["id"]: m for m in json.loads(raw)["data"]}[name]["status"]


def failed_status(port: int) -> dict:
    """``broken``'s status once its load has failed (llama-server's fails in its child)."""
    for _ in range(600):
        status = status_of(port, BROKEN)
        if status.get("failed"):
            return {k: v for k, v in status.items() if k not in ("args", "preset")}
        time.sleep(0.1)
    raise AssertionError(status)


def unloaded_events(events: Events) -> list[dict]:
    return [
        e
        for e in events.seen
        if e.get("model") == BROKEN
        and e.get("event") == "status_change"
        and e.get("data", {}).get("status") == "unloaded"
    ]


@pytest.mark.parametrize("who", ["bankml", "llama-server"])
def test_a_load_that_fails_is_listed_failed_and_the_other_model_serves(
    who: str, bankml: tuple, reference: int
) -> None:
    port = bankml[0] if who == "bankml" else reference
    events = Events(port)
    try:
        status, _, raw = call(port, "POST", "/models/load", {"model": BROKEN})
        if who == "bankml":  # answered once the load ended: the failure and its reason
            assert status == 500, raw
            assert "cannot load broken.gguf" in json.loads(raw)["error"]["message"]
        else:  # answered at once; the child then dies loading
            assert (status, raw) == (200, b'{"success":true}')
        assert failed_status(port) == {"value": "unloaded", "exit_code": 1, "failed": True}
        wait_for(lambda: unloaded_events(events), "the failed load's status_change")
        assert unloaded_events(events)[-1]["data"] == {"status": "unloaded", "exit_code": 1}
    finally:
        events.close()
    refused, _, raw = call(port, "POST", "/v1/completions", {**SHORT, "model": BROKEN})
    assert refused == 500, raw
    status, _, raw = call(port, "POST", "/v1/completions", {**SHORT, "model": NAME})
    assert status == 200, raw
    assert status_of(port, BROKEN)["value"] == "unloaded"


def test_failed_loads_give_their_memory_back(bankml: tuple) -> None:
    port, proc = bankml

    def failed_load() -> None:
        assert call(port, "POST", "/models/load", {"model": BROKEN})[0] == 500

    failed_load()
    start = psutil.Process(proc.pid).memory_info().rss
    for _ in range(10):
        failed_load()
    end = psutil.Process(proc.pid).memory_info().rss
    assert end - start <= 0.02 * start, (start, end)
