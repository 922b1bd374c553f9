"""llama-server's router mode in the drop-in (``bankml llama-server --models-dir DIR`` without
``-m``), side by side with the real llama-server in router mode on the same directory: two
pinned tiny models and a GGUF no fork pins. ``GET /models`` lists the same models with the same
fields (a loaded model's ``meta`` equal), ``POST /models/load`` and ``/models/unload`` answer as
llama-server's, a completion naming a model is the same text on both; the unpinned file is
listed as failed with bankml's reason and refused. A request naming no model on a route the
router forwards to a model is refused with the same bytes; ``POST``/``DELETE /models`` (its
download cache) refused with its messages."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType as T

from tests.dropin import Pair, call, running_dropin, start_dropin
from tests.registry_support import pin_into
from tests.support import free_port
from tests.tiny_models import TinySpec, write_tiny_model

TINY = {
    "tiny-llama-f16": (TinySpec("llama", T.F16), 1),
    "tiny-qwen3-q4_0": (TinySpec("qwen3", T.Q4_0), 2),
}
FIRST, SECOND = TINY
BODY = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
LOGS: dict[int, Path] = {}  # the drop-in's log, by its port


@pytest.fixture(scope="module")
def pair(
    tmp_path_factory: pytest.TempPathFactory, default_model: Path, llama_server_bin: Path
) -> Iterator[Pair]:
    directory = tmp_path_factory.mktemp("router") / "models"
    directory.mkdir()
    for name, (spec, seed) in TINY.items():
        pin_into(directory, write_tiny_model(directory / f"{name}.gguf", spec, default_model, seed))
    shutil.copyfile(directory / f"{FIRST}.gguf", directory / "unpinned.gguf")
    # every model's context in the preset (as its environment variable), -c 0 over it
    preset = directory.parent / "preset.ini"
    preset.write_text("[*]\nLLAMA_ARG_CTX_SIZE = 512\n")
    common = ["--models-dir", str(directory), "--models-preset", str(preset)]
    log = directory.parent / "bankml.log"
    with side_by_side(llama_server_bin, [*common, "-c", "0"], log) as both:
        yield both


@contextmanager
def side_by_side(llama_server_bin: Path, flags: list[str], log: Path) -> Iterator[Pair]:
    """llama-server and the drop-in started with the same router ``flags`` (on loopback, two
    threads, no web UI), both answering ``GET /models``."""
    common = [*flags, "--host", "127.0.0.1", "-t", "2", "--no-webui"]
    theirs = free_port()
    ref = subprocess.Popen(
        [str(llama_server_bin), *common, "--port", str(theirs)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    ours = free_port()
    args = [*common, "--listen", f"127.0.0.1:{free_port()}"]
    try:
        proc = start_dropin(args, ours, log)
    except BaseException:
        ref.terminate()
        ref.wait(30)
        raise
    LOGS[ours] = log
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if call(theirs, "GET", "/models")[0] == 200:
                    break
            except OSError:
                time.sleep(0.2)
        yield Pair(ours, theirs)
    finally:
        ref.terminate()  # first: the drop-in's stop may time out (a compile under way)
        proc.terminate()
        try:
            proc.wait(30)
        finally:
            ref.wait(30)


def models(port: int) -> dict[str, dict]:
    status, _, raw = call(port, "GET", "/models")
    assert status == 200
    listing = json.loads(raw)
    assert listing["object"] == "list"
    return {m["id"]: m for m in listing["data"]}


def loaded(port: int, name: str) -> dict:
    """The model's entry once it is loaded (llama-server loads in the background)."""
    for _ in range(600):
        entry = models(port)[name]
        if entry["status"]["value"] == "loaded":
            return entry
        time.sleep(0.2)
    raise AssertionError(f"{name} did not load")


def test_the_directory_is_listed_as_llama_server_lists_it(pair: Pair) -> None:
    ours, theirs = (models(port) for port in pair.ports)
    assert sorted(ours) == sorted(theirs) == [FIRST, SECOND, "unpinned"]
    for name in ours:
        # the same fields in the same order (a loaded model adds its meta: see below)
        assert [k for k in ours[name] if k != "meta"] == list(theirs[name])
        for key in ("aliases", "tags", "object", "owned_by", "architecture", "source"):
            assert ours[name][key] == theirs[name][key], (name, key)
        assert ours[name]["can_remove"] is theirs[name]["can_remove"] is False
    # no preset loads a model on startup: none is loaded on either, and bankml opened none
    # (no model's weights read, no kernel compiled: each model is opened as it is loaded)
    for name in ours:
        assert ours[name]["status"]["value"] == theirs[name]["status"]["value"] == "unloaded"
    # status.args (the command that serves the model: bankml's own before the options) and
    # status.preset rendered as llama-server renders them: the model's file, the preset's
    # [*] context, the command line's -c 0 over it, -t, --no-webui (its host, port and
    # alias in args only)
    for name in ours:
        mine, reference = ours[name]["status"], theirs[name]["status"]
        assert mine["args"][-len(reference["args"]) + 1 :] == reference["args"][1:], name
        assert mine["args"][1:4] == ["-m", "bankml", "llama-server"]
        assert len(mine["args"]) == len(reference["args"]) + 3
        assert mine["preset"] == reference["preset"], name
    log = LOGS[pair.ports[0]].read_text()
    assert "loading it" not in log and "compiling" not in log
    refused = ours["unpinned"]["status"]
    assert refused["failed"] is True and "not pinned" in refused["bankml_refused"]
    # /v1/models is the same listing, as llama-server's router answers it
    for port in pair.ports:
        v1 = json.loads(call(port, "GET", "/v1/models")[2])
        assert [m["id"] for m in v1["data"]] == list(models(port))


def test_load_unload_and_answers_as_llama_server(pair: Pair) -> None:
    ours, theirs = pair.ports
    # loading: both load the second model; a second load is refused alike
    for port in pair.ports:
        status, _, raw = call(port, "POST", "/models/load", {"model": SECOND})
        assert (status, json.loads(raw)) == (200, {"success": True})
    mine, reference = loaded(ours, SECOND), loaded(theirs, SECOND)
    assert mine["meta"] == reference["meta"]
    assert mine["meta"]["n_ctx"] == 4096  # -c 0: the model's own, not the preset's 512
    assert pair.both("POST", "/models/load", {"model": SECOND})[0] == (
        400,
        b'{"error":{"code":400,"message":"model is already running","type":"invalid_request_error"}}',
    )
    again = pair.both("POST", "/models/load", {"model": SECOND})
    assert again[0] == again[1]
    # the same answer from the same file
    answers = []
    for port in pair.ports:
        status, _, raw = call(port, "POST", "/v1/completions", {**BODY, "model": SECOND})
        assert status == 200, raw
        answers.append(json.loads(raw))
    assert answers[0]["choices"] == answers[1]["choices"]
    assert answers[0]["model"] == answers[1]["model"]
    assert answers[0]["usage"] == answers[1]["usage"]
    # unloading, and the refusals of an unload
    for port in pair.ports:
        status, _, raw = call(port, "POST", "/models/unload", {"model": SECOND})
        assert (status, json.loads(raw)) == (200, {"success": True})
    for port in pair.ports:
        for _ in range(600):
            if models(port)[SECOND]["status"]["value"] == "unloaded":
                break
            time.sleep(0.2)
    not_running, unknown = (
        pair.both("POST", "/models/unload", {"model": name}) for name in (SECOND, "nope")
    )
    assert not_running[0] == not_running[1]
    assert unknown[0] == unknown[1]
    assert call(ours, "POST", "/models/load", {"model": "nope"})[0] == 404
    assert call(theirs, "POST", "/models/load", {"model": "nope"})[0] == 404
    # a request naming an unknown model: the router's refusal on both
    unknown_model = pair.both("POST", "/v1/completions", {**BODY, "model": "nope"})
    assert unknown_model[0] == unknown_model[1]
    # the unpinned file: llama-server would load it; bankml refuses it with the reason
    status, _, raw = call(ours, "POST", "/models/load", {"model": "unpinned"})
    assert status == 400 and "not pinned" in json.loads(raw)["error"]["message"]


# routes llama-server's router forwards to the child of the model a request names
FORWARDED = [
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ("POST", "/completion", {"prompt": "hi", "model": ""}),
    ("POST", "/v1/embeddings", {"input": "hi", "model": 3}),
    ("POST", "/tokenize", {"content": "hi"}),
    ("POST", "/apply-template", {"messages": []}),
    ("POST", "/slots/0?action=erase", {}),
    ("GET", "/slots", None),
    ("GET", "/metrics", None),
]


def test_a_request_naming_no_model_is_refused_as_llama_server_refuses_it(pair: Pair) -> None:
    for method, path, body in FORWARDED:
        ours, theirs = pair.both(method, path, body)
        assert ours == theirs, (method, path)
        assert ours[0] == 400 and b"model name is missing" in ours[1]
    # a route that reads the engine answers with the model it names (loaded first), an unknown
    # one is the router's refusal
    content = {"content": "The capital of France"}
    named = pair.both("POST", "/tokenize", {**content, "model": FIRST})
    assert named[0] == named[1] and named[0][0] == 200
    unknown = pair.both("POST", "/detokenize", {"tokens": [1], "model": "nope"})
    assert unknown[0] == unknown[1] and unknown[0][0] == 400
    # llama-server's cache management: a name is required on both; bankml downloads and removes
    # nothing (llama-server answers a model that is not from its cache with a 500)
    assert pair.both("POST", "/models", {})[0] == pair.both("POST", "/models", {})[1]
    missing = pair.both("DELETE", "/models")
    assert missing[0] == missing[1] and missing[0][0] == 400
    status, _, raw = call(pair.ports[0], "POST", "/models", {"model": "someone/model"})
    assert status == 501 and b"downloads no model" in raw
    for name in (FIRST, "nope"):
        (status, raw), (_, reference) = pair.both("DELETE", f"/models?model={name}")
        assert status in (400, 404)
        assert json.loads(raw)["error"]["message"] == json.loads(reference)["error"]["message"]


@pytest.fixture(scope="module")
def one_at_a_time(tmp_path_factory: pytest.TempPathFactory, default_model: Path) -> Iterator[int]:
    """The drop-in in router mode with ``--models-max 1``: its port."""
    directory = tmp_path_factory.mktemp("router-one") / "models"
    directory.mkdir()
    for name, (spec, seed) in TINY.items():
        pin_into(directory, write_tiny_model(directory / f"{name}.gguf", spec, default_model, seed))
    port = free_port()
    args = ["--models-dir", str(directory), "--models-max", "1", "--host", "127.0.0.1"]
    args += ["-c", "2048", "-t", "2", "--no-webui", "--listen", f"127.0.0.1:{free_port()}"]
    with running_dropin(args, port, directory.parent / "bankml.log"):
        yield port


def test_with_one_model_at_most_each_request_loads_the_model_it_names(
    one_at_a_time: int,
) -> None:
    """At ``--models-max 1`` a request naming the model that is not loaded puts the other away
    and is answered by the one it names, as llama-server's router does."""
    for name in (SECOND, FIRST, SECOND):
        status, _, raw = call(one_at_a_time, "POST", "/v1/completions", {**BODY, "model": name})
        assert status == 200, raw
        assert json.loads(raw)["model"] == name
        states = {n: m["status"]["value"] for n, m in models(one_at_a_time).items()}
        assert states == {name: "loaded", **{n: "unloaded" for n in TINY if n != name}}


@pytest.fixture(scope="module")
def two_resident(tmp_path_factory: pytest.TempPathFactory, default_model: Path) -> Iterator[int]:
    """The drop-in in router mode with ``--models-max 2`` and each model its own context (the
    preset's): its port."""
    directory = tmp_path_factory.mktemp("router-two") / "models"
    directory.mkdir()
    for name, (spec, seed) in TINY.items():
        pin_into(directory, write_tiny_model(directory / f"{name}.gguf", spec, default_model, seed))
    preset = directory.parent / "preset.ini"
    preset.write_text(f"[{FIRST}]\nc = 256\n\n[{SECOND}]\nc = 512\n")
    port = free_port()
    args = ["--models-dir", str(directory), "--models-preset", str(preset), "--models-max", "2"]
    args += ["--host", "127.0.0.1", "-t", "2", "--no-webui", "--listen", f"127.0.0.1:{free_port()}"]
    with running_dropin(args, port, directory.parent / "bankml.log"):
        yield port


def test_a_route_reads_the_engine_of_the_model_its_request_names(two_resident: int) -> None:
    """With two models resident, ``/slots`` and ``/tokenize`` naming one model answer from that
    model's engine while completions for the other (which make its engine the current one) run
    between them, as llama-server's router forwards each to its model's child."""
    port = two_resident
    contexts = {FIRST: 256, SECOND: 512}
    for name in TINY:
        assert call(port, "POST", "/models/load", {"model": name})[0] == 200
    assert {m["status"]["value"] for m in models(port).values()} == {"loaded"}

    def slots_of(name: str) -> int:
        status, _, raw = call(port, "GET", f"/slots?model={name}")
        assert status == 200, raw
        return json.loads(raw)[0]["n_ctx"]

    def completion(name: str) -> str:
        body = {**BODY, "max_tokens": 24, "model": name}
        status, _, raw = call(port, "POST", "/v1/completions", body)
        assert status == 200, raw
        return json.loads(raw)["model"]

    def tokens(name: str) -> list[int]:
        status, _, raw = call(port, "POST", "/tokenize", {"model": name, "content": "Paris"})
        assert status == 200, raw
        return json.loads(raw)["tokens"]

    alone = {name: tokens(name) for name in TINY}
    with ThreadPoolExecutor(max_workers=6) as pool:
        jobs = []
        for _ in range(4):  # each route's request queued between the other model's runs
            for name, other in ((FIRST, SECOND), (SECOND, FIRST)):
                jobs.append((other, pool.submit(completion, other)))
                jobs.append((contexts[name], pool.submit(slots_of, name)))
                jobs.append((alone[name], pool.submit(tokens, name)))
        for expected, job in jobs:
            assert job.result() == expected


@pytest.fixture(scope="module")
def three_at_two(
    tmp_path_factory: pytest.TempPathFactory, default_model: Path, llama_server_bin: Path
) -> Iterator[Pair]:
    """Both routers with ``--models-max 2`` over three pinned tiny models."""
    directory = tmp_path_factory.mktemp("router-lru") / "models"
    directory.mkdir()
    specs = {**TINY, "tiny-llama-third": (TinySpec("llama", T.F16), 3)}
    for name, (spec, seed) in specs.items():
        pin_into(directory, write_tiny_model(directory / f"{name}.gguf", spec, default_model, seed))
    flags = ["--models-dir", str(directory), "--models-max", "2", "-c", "256"]
    with side_by_side(llama_server_bin, flags, directory.parent / "bankml.log") as both:
        yield both


def settled(port: int, expected: dict[str, str]) -> dict[str, str]:
    """Each model's status once they are ``expected`` (llama-server loads and unloads in the
    background), else as they are after 60 s."""
    for _ in range(300):
        states = {n: m["status"]["value"] for n, m in models(port).items()}
        if states == expected:
            break
        time.sleep(0.2)
    return states


def test_every_post_forwarded_marks_its_model_used_a_get_does_not(three_at_two: Pair) -> None:
    """The least recently used model is the one unloaded at the bound, as llama-server's
    router reckons its use: every POST forwarded to a model marks it used, one its route
    refuses too (it neither runs on the model nor, before, made it bankml's current one), and
    a GET does not (``GET /slots?model=`` reads the model as it is)."""
    first, second, third = [*TINY, "tiny-llama-third"]

    def load(name: str) -> None:
        for port in three_at_two.ports:
            status, _, raw = call(port, "POST", "/models/load", {"model": name})
            assert (status, json.loads(raw)) == (200, {"success": True}), port
            loaded(port, name)

    load(first)
    load(second)  # first is the least recently used
    # a completion with no prompt, naming the first model: refused by its route on both
    refused = three_at_two.both("POST", "/completion", {"model": first})
    assert refused[0][0] == refused[1][0] == 400, refused
    load(third)  # the second is now the least recently used: unloaded
    expected = {first: "loaded", second: "unloaded", third: "loaded"}
    for port in three_at_two.ports:
        assert settled(port, expected) == expected, port
    # a GET naming the first model: answered from it, and not a use of it
    for port in three_at_two.ports:
        status, _, raw = call(port, "GET", f"/slots?model={first}")
        assert status == 200 and json.loads(raw)[0]["n_ctx"] == 256, (port, raw)
    load(second)  # the first, used before the third was loaded, is unloaded
    expected = {first: "unloaded", second: "loaded", third: "loaded"}
    for port in three_at_two.ports:
        assert settled(port, expected) == expected, port
