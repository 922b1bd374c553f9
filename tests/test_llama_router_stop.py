"""Router mode's stop-timeout in the drop-in (``bankml llama-server --models-dir DIR``): a model
unloaded while it generates gets its stop-timeout (its preset's ``stop-timeout``, as
llama-server's router reads it, over ``--stop-timeout``), then its generation ends at its next
step with a 503 and the unload goes on; a generation that ends first is answered in full, with
its receipt. A load that needs a generating model's room stops nothing: it waits for that
model's answer, as llama-server's router does (side by side)."""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType as T
from twisted.python import usage

from bankml.serving.llama_flags import dropin_argv
from bankml.tap import Options
from tests.dropin import call, running_dropin, running_llama_router
from tests.registry_support import pin_into
from tests.support import free_port
from tests.tiny_models import TinySpec, write_tiny_model

NAME, OTHER = "smol", "tiny-llama-q4_1"
TINY = TinySpec("llama", T.Q4_1)
# a generation that would last minutes on the CPU (ignore_eos: to its max_tokens)
LONG = {"prompt": "Once upon a time", "max_tokens": 3000, "ignore_eos": True, "model": NAME}
SHORT = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0, "model": NAME}


def router_flags(root: Path, default_model: Path, slots: int) -> list[str]:
    """Router flags both servers read (``--models-max 1``, ``-np slots``) on a directory
    holding the default model and a tiny one (both pinned), the default one's preset
    stop-timeout 1 s."""
    directory = root / "models"
    directory.mkdir()
    os.symlink(default_model, directory / f"{NAME}.gguf")
    pin_into(directory, directory / f"{NAME}.gguf")
    # the other model: a tiny one of the same weight types (the kernels compiled once serve both)
    pin_into(directory, write_tiny_model(directory / f"{OTHER}.gguf", TINY, default_model))
    preset = root / "preset.ini"
    preset.write_text(f"[{NAME}]\nstop-timeout = 1\n")
    args = ["--models-dir", str(directory), "--models-preset", str(preset)]
    args += ["--models-max", "1", "-np", str(slots), "-c", "8192"]
    return args + ["--host", "127.0.0.1", "-t", "2", "--metrics", "--no-webui"]


@contextlib.contextmanager
def stop_router(root: Path, default_model: Path, slots: int) -> Iterator[int]:
    """The drop-in in router mode on ``router_flags``' directory, the preset's stop-timeout
    over the command line's 600: its port."""
    port = free_port()
    args = router_flags(root, default_model, slots) + ["--stop-timeout", "600"]
    args += ["--listen", f"127.0.0.1:{free_port()}"]
    with running_dropin(args, port, root / "bankml.log"):
        yield port


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, default_model: Path) -> Iterator[int]:
    with stop_router(tmp_path_factory.mktemp("router-stop"), default_model, 1) as port:
        yield port


@pytest.fixture(scope="module")
def reference(
    tmp_path_factory: pytest.TempPathFactory, default_model: Path, llama_server_bin: Path
) -> Iterator[int]:
    """llama-server's own router on the same flags and a directory alike, one slot: its port."""
    flags = router_flags(tmp_path_factory.mktemp("router-stop-ref"), default_model, 1)
    with running_llama_router(llama_server_bin, flags) as port:
        yield port


def processing(port: int, series: str = "requests_processing") -> float:
    status, _, raw = call(port, "GET", f"/metrics?model={NAME}")
    assert status == 200, raw
    for line in raw.decode().splitlines():
        if line.startswith(f"llamacpp:{series} "):
            return float(line.split()[1])
    raise AssertionError(raw)


def state(port: int, name: str = NAME) -> str:
    status, _, raw = call(port, "GET", "/models")
    assert status == 200, raw
    return {m["id"]: m for m in json.loads(raw)["data"]}[name]["status"]["value"]


def wait_generating(port: int, running: Future) -> None:
    """Once the long generation runs (GET /metrics answers beside it, not queued; its model is
    loaded before, so the engine thread's one job is the run), and a moment more (its run
    holds its model from its first step)."""
    for _ in range(1200):
        assert not running.done(), running.result()
        if processing(port) > 0:
            time.sleep(0.5)
            return
        time.sleep(0.1)
    raise AssertionError("the generation did not start")


def test_an_unload_stops_a_running_generation_after_its_stop_timeout(server: int) -> None:
    assert call(server, "POST", "/models/load", {"model": NAME})[0] == 200
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(call, server, "POST", "/v1/completions", LONG)
        wait_generating(server, running)
        unload = call(server, "POST", "/models/unload", {"model": NAME})
        assert unload[0] == 200 and json.loads(unload[2]) == {"success": True}
        status, _, raw = running.result(timeout=120)
    # the stopped generation: a 503 with the reason, no answer, no receipt
    assert status == 503, raw
    error = json.loads(raw)["error"]
    assert error["code"] == 503 and "stop-timeout of 1 s ran out" in error["message"]
    assert "bankml_receipt" not in json.loads(raw)
    assert state(server) == "unloaded"


def test_a_generation_queued_before_the_unload_is_stopped_too(server: int) -> None:
    """With one slot a second generation waits behind the first. An unload asked for then
    stops the first after its stop-timeout; the second starts before the unload runs and gets
    the stop-timeout as it starts (before, nothing armed it and the unload waited for its whole
    generation). Both are answered 503 with the reason, and the model is unloaded."""
    assert call(server, "POST", "/models/load", {"model": NAME})[0] == 200
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(call, server, "POST", "/v1/completions", LONG)
        wait_generating(server, first)
        second = pool.submit(call, server, "POST", "/v1/completions", LONG)
        for _ in range(600):
            if processing(server, "requests_deferred") > 0:
                break
            time.sleep(0.05)
        else:
            raise AssertionError("the second generation was not queued")
        # one request waits (the mark of use its POST queued on the engine thread too is no
        # request): the unload is queued behind its run
        time.sleep(0.3)
        assert processing(server, "requests_deferred") == 1
        unload = call(server, "POST", "/models/unload", {"model": NAME})
        answers = [first.result(timeout=120), second.result(timeout=120)]
    assert unload[0] == 200, unload
    for status, _, raw in answers:
        assert status == 503, raw
        assert "stop-timeout of 1 s ran out" in json.loads(raw)["error"]["message"]
    assert state(server) == "unloaded"


def test_a_generation_that_ends_first_is_answered_in_full(server: int) -> None:
    """The tiny model's stop-timeout is the command line's (600 s): its unload waits for its
    generation, which is answered in full with its receipt, then unloads it."""
    body = {**SHORT, "model": OTHER, "max_tokens": 200, "ignore_eos": True}
    assert call(server, "POST", "/models/load", {"model": OTHER})[0] == 200
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(call, server, "POST", "/v1/completions", body)
        time.sleep(0.5)  # mostly while it generates; before or after, it is answered in full
        unload = call(server, "POST", "/models/unload", {"model": OTHER})
        status, _, raw = running.result(timeout=120)
    assert unload[0] == 200, unload
    assert status == 200, raw
    answer = json.loads(raw)
    assert answer["usage"]["completion_tokens"] == body["max_tokens"]
    assert answer["bankml_receipt"]
    assert state(server, OTHER) == "unloaded"
    # loaded again on request, nothing left stopping it: the same answer
    status, _, raw = call(server, "POST", "/v1/completions", body)
    assert status == 200 and json.loads(raw)["choices"][0]["text"] == answer["choices"][0]["text"]


LIMIT_REACHED = (
    b'{"error":{"code":500,"message":"model limit reached, try again later","type":"server_error"}}'
)


def room_waits_for_the_generation(port: int) -> dict:
    """A generation of 800 tokens on the default model, then ``POST /models/load`` of the other
    model, refused at once with llama-server's 500 (its room is taken by a model that
    answers), then a request for the other model, which waits for that room (``--models-max
    1``): the generation is answered in full, and only then is its model unloaded and the
    other one loaded and answering (the default model's stop-timeout of 1 s stops nothing:
    only an unload arms it). The generation's answer."""
    assert call(port, "POST", "/models/load", {"model": NAME})[0] == 200
    body = {**LONG, "max_tokens": 800}

    def generation() -> tuple[tuple[int, dict[str, str], bytes], float]:
        return call(port, "POST", "/v1/completions", body), time.monotonic()

    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(generation)
        wait_generating(port, running)
        # POST /models/load is refused at once: no idle model to replace
        refused = call(port, "POST", "/models/load", {"model": OTHER})
        assert (refused[0], refused[2]) == (500, LIMIT_REACHED), refused
        assert not running.done()
        status, _, raw = call(port, "POST", "/v1/completions", {**SHORT, "model": OTHER})
        other_at = time.monotonic()
        (generated, _, text), generated_at = running.result(timeout=300)
    assert status == 200, raw
    assert json.loads(raw)["model"] == OTHER
    assert generated == 200, text
    answer = json.loads(text)
    assert answer["usage"]["completion_tokens"] == body["max_tokens"]
    assert generated_at < other_at
    assert state(port) == "unloaded" and state(port, OTHER) == "loaded"
    return answer


@pytest.mark.parametrize("who", ["bankml", "llama-server"])
def test_a_load_needing_room_waits_for_the_generating_model(
    who: str, server: int, reference: int
) -> None:
    """At ``--models-max 1`` a request for the other model waits for the generating one's
    answer, whole, before that model is unloaded: llama-server's router evicts only an idle
    model, and bankml's does the same."""
    answer = room_waits_for_the_generation(server if who == "bankml" else reference)
    assert ("bankml_receipt" in answer) == (who == "bankml")


def test_the_dropin_passes_stop_timeout_and_serve_takes_it_in_router_mode_only(
    tmp_path: Path, default_model: Path, default_fork: Path
) -> None:
    argv, _ = dropin_argv(["-m", str(default_model), "--fork", str(default_fork)])
    assert "--stop-timeout" not in argv
    argv, _ = dropin_argv(
        ["-m", str(default_model), "--fork", str(default_fork), "--stop-timeout", "5"]
    )
    assert argv[argv.index("--stop-timeout") + 1] == "5"
    with pytest.raises(usage.UsageError, match="or native router mode"):
        Options().parseOptions(argv)  # one model: nothing to unload
    directory = tmp_path / "models"
    directory.mkdir()
    os.symlink(default_model, directory / f"{NAME}.gguf")
    pin_into(directory, directory / f"{NAME}.gguf")
    argv, _ = dropin_argv(["--models-dir", str(directory), "--stop-timeout", "5"])
    options = Options()
    options.parseOptions(argv)
    assert options["stop_timeout"] == 5 and options["router"]
