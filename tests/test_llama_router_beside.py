"""Router mode with several slots (``-np 2``) and room for two models (``--models-max 2``): a
request for another model loads it between two steps of the running generation and answers
while that generation goes on, and a second request on the generating model is answered beside
it; before, each waited for every running generation to end (the scheduler ran a load, and the
mark of a model's use, only once no run was active)."""

from __future__ import annotations

import http.client
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.dropin import call, running_dropin
from tests.registry_support import pin_into
from tests.support import free_port
from tests.test_llama_router_stop import LONG, NAME, OTHER, SHORT, TINY, processing
from tests.tiny_models import write_tiny_model


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, default_model: Path) -> Iterator[int]:
    root = tmp_path_factory.mktemp("router-beside")
    directory = root / "models"
    directory.mkdir()
    os.symlink(default_model, directory / f"{NAME}.gguf")
    pin_into(directory, directory / f"{NAME}.gguf")
    pin_into(directory, write_tiny_model(directory / f"{OTHER}.gguf", TINY, default_model))
    port = free_port()
    args = ["--models-dir", str(directory), "--models-max", "2", "-np", "2", "-c", "8192"]
    args += ["--host", "127.0.0.1", "-t", "2", "--metrics", "--no-webui"]
    args += ["--listen", f"127.0.0.1:{free_port()}"]
    with running_dropin(args, port, root / "bankml.log"):
        yield port


class Streaming:
    """A long streamed generation on the default model, read up to its first token; closing
    it leaves the request (the server ends the run)."""

    def __init__(self, port: int) -> None:
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        body = json.dumps({**LONG, "stream": True}).encode()
        self.conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        self.response = self.conn.getresponse()
        assert self.response.status == 200
        while not self.response.readline().startswith(b"data: {"):
            pass

    def close(self, port: int) -> None:
        self.conn.close()
        for _ in range(600):  # the run ends at its next step once the client is gone
            if processing(port) == 0:
                return
            time.sleep(0.05)
        raise AssertionError("the left generation still runs")


@pytest.fixture
def generating(server: int) -> Iterator[int]:
    assert call(server, "POST", "/models/load", {"model": NAME})[0] in (200, 400)
    stream = Streaming(server)
    try:
        yield server
    finally:
        stream.close(server)


def test_another_model_loads_and_answers_while_the_generation_goes_on(generating: int) -> None:
    port = generating
    call(port, "POST", "/models/unload", {"model": OTHER})  # not resident: loaded by the request
    status, _, raw = call(port, "POST", "/v1/completions", {**SHORT, "model": OTHER})
    assert status == 200, raw
    answer = json.loads(raw)
    assert answer["model"] == OTHER and answer["bankml_receipt"]
    # the 3000-token generation is still running: the load did not wait for it
    assert processing(port) == 1


def test_a_second_request_on_the_generating_model_is_answered_beside_it(generating: int) -> None:
    port = generating
    status, _, raw = call(port, "POST", "/v1/completions", SHORT)
    assert status == 200, raw
    assert json.loads(raw)["model"] == NAME
    assert processing(port) == 1


def test_a_generation_beside_another_models_load_is_the_one_it_is_alone(server: int) -> None:
    """A greedy 200-token generation streamed while the other model is loaded and answers
    (between its steps, as above) has the text it has alone, token for token."""
    body = {**SHORT, "max_tokens": 200, "ignore_eos": True}
    assert call(server, "POST", "/models/load", {"model": NAME})[0] in (200, 400)
    call(server, "POST", "/models/unload", {"model": OTHER})
    conn = http.client.HTTPConnection("127.0.0.1", server, timeout=120)
    try:
        raw = json.dumps({**body, "stream": True}).encode()
        conn.request("POST", "/v1/completions", raw, {"Content-Type": "application/json"})
        response = conn.getresponse()
        pieces, loaded = [], False
        for line in response:
            if not line.startswith(b"data: {"):
                continue
            pieces.append(json.loads(line[6:])["choices"][0]["text"])
            if not loaded:  # after its first token: the other model loaded and answering
                status, _, answer = call(
                    server, "POST", "/v1/completions", {**SHORT, "model": OTHER}
                )
                assert status == 200, answer
                loaded = True
    finally:
        conn.close()
    status, _, alone = call(server, "POST", "/v1/completions", body)
    assert status == 200, alone
    assert "".join(pieces) == json.loads(alone)["choices"][0]["text"]
