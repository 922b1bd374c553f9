"""``GET /models?reload=1`` in the drop-in's router mode (``bankml llama-server --models-dir
DIR``), side by side with the real llama-server router on the same directory: a file pinned
after the start is served once the list is reloaded (not before), a file added is listed, a
file removed leaves the list and, resident, is unloaded, while an unchanged resident model stays
loaded; the ``models_reload`` event goes to ``GET /models/sse``; a preset that no longer reads
is a 400 that changes nothing."""

from __future__ import annotations

import http.client
import json
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from gguf import GGMLQuantizationType as T

from tests.dropin import call, running_dropin, running_llama_router
from tests.registry_support import pin_into
from tests.support import free_port
from tests.tiny_models import TinySpec, write_tiny_model

TINY = TinySpec("llama", T.Q4_1)  # the default model's weight types: its kernels serve these
CHAT = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4, "temperature": 0}


@pytest.fixture
def directory(tmp_path: Path, default_model: Path) -> Path:
    """DIR with a pinned tiny model ``a`` and an unpinned one ``b``."""
    out = tmp_path / "models"
    out.mkdir()
    pin_into(out, write_tiny_model(out / "a.gguf", TINY, default_model, seed=0))
    write_tiny_model(out / "b.gguf", TINY, default_model, seed=1)
    return out


@pytest.fixture
def reference(directory: Path, llama_server_bin: Path) -> Iterator[int]:
    """The real llama-server router on DIR: its port."""
    flags = ["--models-dir", str(directory), "--host", "127.0.0.1", "-t", "1", "--no-webui"]
    with running_llama_router(llama_server_bin, flags) as port:
        yield port


def dropin(directory: Path, tmp_path: Path, *extra: str) -> Any:
    port = free_port()
    args = ["--models-dir", str(directory), "--models-max", "2", *extra]
    args += ["--host", "127.0.0.1", "-t", "2", "--no-webui", "--listen", f"127.0.0.1:{free_port()}"]
    return port, running_dropin(args, port, tmp_path / "bankml.log")


def statuses(port: int, query: str = "") -> dict[str, dict[str, Any]]:
    status, _, raw = call(port, "GET", f"/models{query}")
    assert status == 200, raw
    return {m["id"]: m["status"] for m in json.loads(raw)["data"]}


def chat(port: int, model: str) -> tuple[int, bytes]:
    status, _, raw = call(port, "POST", "/v1/chat/completions", {**CHAT, "model": model})
    return status, raw


class Events:
    """``GET /models/sse`` read on a thread: the events' bodies as they come."""

    def __init__(self, port: int) -> None:
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        self.conn.request("GET", "/models/sse")
        self.response = self.conn.getresponse()
        assert self.response.status == 200
        self.seen: list[dict[str, Any]] = []
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            for line in self.response:
                if line.startswith(b"data: "):
                    self.seen.append(json.loads(line[6:]))
        except (OSError, ValueError):
            pass

    def wait_for(self, event: str, timeout: float = 30) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [e for e in self.seen if e.get("event") == event]
            if found:
                return found[0]
            time.sleep(0.05)
        raise AssertionError(f"no {event} event in {self.seen}")

    def close(self) -> None:
        # the reader blocks in a read: shut the socket down so that it returns at once (closing
        # the connection alone waits for that read's timeout)
        if self.conn.sock is not None:
            self.conn.sock.shutdown(socket.SHUT_RDWR)
        self.thread.join(30)
        self.conn.close()


def test_reload_serves_what_was_pinned_added_or_removed_since_the_start(
    directory: Path, tmp_path: Path, reference: int
) -> None:
    port, running = dropin(directory, tmp_path)
    with running:
        assert statuses(port)["b"]["failed"] is True  # not pinned at start
        assert chat(port, "a")[0] == 200
        pin_into(directory, directory / "b.gguf")
        # the directory is read at start and on a reload only, as llama-server's router
        assert statuses(port)["b"].get("failed") is True
        assert chat(port, "b")[0] == 400
        events = Events(port)
        try:
            now = statuses(port, "?reload=1")
            assert events.wait_for("models_reload") == {"model": "*", "event": "models_reload"}
        finally:
            events.close()
        assert "failed" not in now["b"] and now["b"]["value"] == "unloaded"
        assert now["a"]["value"] == "loaded"  # unchanged: still resident
        status, raw = chat(port, "b")
        assert status == 200, raw
        assert json.loads(raw)["model"] == "b"

        # a file added: listed on both routers once reloaded (bankml: refused, not pinned)
        shutil.copyfile(directory / "b.gguf", directory / "c.gguf")
        assert "c" not in statuses(port) and "c" not in statuses(reference)
        assert "bankml_refused" in statuses(port, "?reload=1")["c"]
        assert sorted(statuses(port)) == sorted(statuses(reference, "?reload=1")) == ["a", "b", "c"]

        # a resident model's file removed: unloaded and gone from both lists
        assert statuses(port)["b"]["value"] == "loaded"
        (directory / "b.gguf").unlink()
        after = statuses(port, "?reload=1")
        assert sorted(after) == sorted(statuses(reference, "?reload=1")) == ["a", "c"]
        assert after["a"]["value"] == "loaded"
        status, raw = chat(port, "b")
        assert status == 400 and b"model 'b' not found" in raw
        assert chat(port, "a")[0] == 200


@pytest.fixture
def preset_router(directory: Path, tmp_path: Path) -> Iterator[tuple[int, Path]]:
    """The drop-in on DIR and a preset giving ``a`` a context of 512, ``a`` resident: (its
    port, the preset's path)."""
    preset = tmp_path / "preset.ini"
    preset.write_text("[a]\nc = 512\n")
    port, running = dropin(directory, tmp_path, "--models-preset", str(preset))
    with running:
        assert chat(port, "a")[0] == 200
        yield port, preset


def test_a_reload_that_would_change_a_resident_models_options_unloads_it(
    preset_router: tuple[int, Path],
) -> None:
    port, preset = preset_router
    assert statuses(port, "?reload=1")["a"]["value"] == "loaded"  # the same options
    preset.write_text("[a]\nc = 1024\n")
    assert statuses(port, "?reload=1")["a"]["value"] == "unloaded"
    status, _, raw = call(port, "GET", "/props?model=a")
    assert status == 200, raw
    assert json.loads(raw)["default_generation_settings"]["n_ctx"] == 1024


def test_a_preset_that_no_longer_reads_is_refused_and_changes_nothing(
    preset_router: tuple[int, Path],
) -> None:
    port, preset = preset_router
    before = statuses(port)
    preset.write_text("[a]\nno-such-option = 1\n")
    status, _, raw = call(port, "GET", "/models?reload=1")
    assert status == 400, raw
    assert "not recognized" in json.loads(raw)["error"]["message"]
    assert statuses(port) == before
    assert chat(port, "a")[0] == 200
