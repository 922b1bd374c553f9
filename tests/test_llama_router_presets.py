"""llama-server's router mode with ``--models-preset FILE`` and ``--no-models-autoload``, side by
side with the real llama-server on the same directory and preset: two pinned tiny models, an
unpinned copy, a pinned model outside the directory named by a section, a section naming the
unpinned file. The same models listed (ids, aliases, tags, sources, statuses, a loaded model's
meta), each model's own options applied (its context size, its ``n-predict``), the
load-on-startup model loaded at start, a request naming a model not loaded refused as
llama-server refuses it unless ``?autoload=1``, and the preset's refusals before anything
listens."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType as T

from tests.dropin import Pair, bankml, call, start_dropin
from tests.registry_support import pin_into
from tests.support import ROOT, free_port
from tests.tiny_models import TinySpec, write_tiny_model

LLAMA, QWEN = "tiny-llama-f16", "tiny-qwen3-q4_0"
PRESET = """version = 1
; every model
[*]
c = 1024
LLAMA_ARG_N_PREDICT = 6

[tiny-qwen3-q4_0]
load-on-startup = true
alias = qw   # a comment
temp = 0

[custom]
model = {outside}
tags = b,a
LLAMA_ARG_CTX_SIZE = 512

[copy]
model = {unpinned}
"""
BODY = {"prompt": "The capital of France is", "temperature": 0}


@pytest.fixture(scope="module")
def pair(
    tmp_path_factory: pytest.TempPathFactory, default_model: Path, llama_server_bin: Path
) -> Iterator[Pair]:
    root = tmp_path_factory.mktemp("presets")
    directory, other = root / "models", root / "other"
    directory.mkdir()
    other.mkdir()
    for name, spec, seed in (
        (LLAMA, TinySpec("llama", T.F16), 1),
        (QWEN, TinySpec("qwen3", T.Q4_0), 2),
    ):
        pin_into(directory, write_tiny_model(directory / f"{name}.gguf", spec, default_model, seed))
    outside = write_tiny_model(other / "outside.gguf", TinySpec("llama", T.F16), default_model, 3)
    pin_into(other, outside)
    shutil.copyfile(directory / f"{LLAMA}.gguf", directory / "unpinned.gguf")
    preset = root / "preset.ini"
    preset.write_text(PRESET.format(outside=outside, unpinned=directory / "unpinned.gguf"))
    common = ["--models-dir", str(directory), "--models-preset", str(preset), "--host", "127.0.0.1"]
    common += ["-t", "2", "--no-webui", "--no-models-autoload"]
    theirs = free_port()
    ref = subprocess.Popen(
        [str(llama_server_bin), *common, "--port", str(theirs)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    ours = free_port()
    proc = start_dropin([*common, "--listen", f"127.0.0.1:{free_port()}"], ours, root / "b.log")
    try:
        for _ in range(600):  # llama-server loads its load-on-startup model in the background
            try:
                if models(theirs)[QWEN]["status"]["value"] == "loaded":
                    break
            except (OSError, KeyError, AssertionError, ValueError):
                pass
            time.sleep(0.2)
        yield Pair(ours, theirs)
    finally:
        proc.terminate()
        proc.wait(30)
        ref.terminate()
        ref.wait(30)


def models(port: int) -> dict[str, dict]:
    status, _, raw = call(port, "GET", "/models")
    assert status == 200
    return {m["id"]: m for m in json.loads(raw)["data"]}


def test_the_preset_is_listed_as_llama_server_lists_it(pair: Pair) -> None:
    ours, theirs = (models(port) for port in pair.ports)
    assert list(ours) == list(theirs) == ["copy", "custom", LLAMA, QWEN, "unpinned"]
    for name in ours:
        assert [k for k in ours[name] if k != "meta"] == [k for k in theirs[name] if k != "meta"]
        for key in ("aliases", "tags", "object", "owned_by", "architecture", "source"):
            assert ours[name][key] == theirs[name][key], (name, key)
        assert ours[name]["status"]["value"] == theirs[name]["status"]["value"], name
        assert list(ours[name]["status"])[:2] == ["value", "args"]
        # status.preset as llama-server renders it ([*]'s and the section's keys, the file's
        # path, the command line's options; a key by its last spelling, sorted by its first);
        # status.args the same options as a command line after bankml's own command, the
        # port a loaded model answers on (llama-server's child's, bankml's own), 0 otherwise
        mine, reference = ours[name]["status"], theirs[name]["status"]
        assert mine["preset"] == reference["preset"], name
        assert mine["args"][1:4] == ["-m", "bankml", "llama-server"]
        assert len(mine["args"]) == len(reference["args"]) + 3
        port = mine["args"].index("--port") + 1
        assert mine["args"][port] == (str(pair.ports[0]) if name == QWEN else "0")
        del mine["args"][port], reference["args"][port - 3]
        assert mine["args"][4:] == reference["args"][1:], name
    assert ours[QWEN]["aliases"] == ["qw"] and ours["custom"]["tags"] == ["a", "b"]
    assert ours["custom"]["source"] == "preset" and ours[LLAMA]["source"] == "models_dir"
    # the load-on-startup model is loaded, with its own options (the [*] context)
    assert ours[QWEN]["status"]["value"] == "loaded"
    assert ours[QWEN]["meta"] == theirs[QWEN]["meta"]
    # a model whose file no fork pins: listed, refused with the reason
    for name in ("copy", "unpinned"):
        assert ours[name]["status"]["failed"] is True
        assert "not pinned" in ours[name]["status"]["bankml_refused"]


def test_without_autoload_a_model_not_loaded_is_refused_as_llama_server_refuses_it(
    pair: Pair,
) -> None:
    ours, theirs = pair.ports
    refused = pair.both("POST", "/v1/completions", {**BODY, "model": "custom"})
    assert refused[0] == refused[1]
    assert refused[0][0] == 400 and b"model is not loaded" in refused[0][1]
    # ?autoload=1 loads it for this request: its own options (c = 512, [*]'s n-predict)
    answers = []
    for port in pair.ports:
        status, _, raw = call(
            port, "POST", "/v1/completions?autoload=1", {**BODY, "model": "custom"}
        )
        assert status == 200, raw
        answers.append(json.loads(raw))
    assert answers[0]["choices"] == answers[1]["choices"]
    assert answers[0]["model"] == answers[1]["model"] == "custom"
    assert answers[0]["usage"] == answers[1]["usage"]
    assert answers[0]["usage"]["completion_tokens"] == 6
    assert models(ours)["custom"]["meta"] == models(theirs)["custom"]["meta"]
    assert models(ours)["custom"]["meta"]["n_ctx"] == 512
    # an alias names its model; the answer names the model's id
    by_alias = [
        json.loads(call(port, "POST", "/v1/completions", {**BODY, "model": "qw"})[2])
        for port in pair.ports
    ]
    assert by_alias[0]["choices"] == by_alias[1]["choices"]
    assert by_alias[0]["model"] == by_alias[1]["model"] == QWEN
    # POST /models/load still loads a model
    for port in pair.ports:
        assert call(port, "POST", "/models/load", {"model": LLAMA})[0] == 200
    status, _, raw = call(
        ours, "POST", "/v1/completions", {**BODY, "model": LLAMA, "max_tokens": 2}
    )
    assert status == 200, raw
    for port in pair.ports:
        assert call(port, "POST", "/models/unload", {"model": LLAMA})[0] == 200
    # the unpinned file named by a section: refused with the reason
    status, _, raw = call(ours, "POST", "/models/load", {"model": "copy"})
    assert status == 400 and "not pinned" in json.loads(raw)["error"]["message"]


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ("bogus = 1", "option 'bogus' not recognized in preset 'x'"),
        ("parallel = 2", "preset 'x': option 'parallel': bankml sets it for every model"),
        ("lora = a.gguf", "preset 'x': option 'lora': "),
    ],
)
def test_a_preset_option_bankml_cannot_serve_is_refused_before_anything_listens(
    tmp_path: Path, default_model: Path, section: str, message: str
) -> None:
    directory = tmp_path / "models"
    directory.mkdir()
    pin_into(directory, default_model)
    preset = tmp_path / "preset.ini"
    preset.write_text(f"[x]\nmodel = {default_model}\n{section}\n")
    done = subprocess.run(
        bankml("llama-server", "--models-dir", str(directory), "--models-preset", str(preset)),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert done.returncode != 0
    assert message in done.stdout + done.stderr


def _events(port: int, into: list[dict]) -> socket.socket:
    """``GET /models/sse`` read on a thread, as it arrives: each ``data:`` event appended to
    ``into`` (each event is one chunk of the answer on both servers)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=120)
    sock.sendall(b"GET /models/sse HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    head = b""
    while b"\r\n\r\n" not in head:
        head += sock.recv(1)
    assert head.startswith(b"HTTP/1.1 200") and b"text/event-stream" in head.lower()

    def read() -> None:
        pending = b""
        try:
            while chunk := sock.recv(65536):
                pending += chunk
                *lines, pending = pending.split(b"\n")
                into.extend(json.loads(x[6:]) for x in lines if x.startswith(b"data: "))
        except (OSError, ValueError):
            pass

    threading.Thread(target=read, daemon=True).start()
    return sock


def test_models_sse_streams_the_router_s_load_and_unload_events(pair: Pair) -> None:
    streams: list[list[dict]] = [[], []]
    conns = []
    for port, into in zip(pair.ports, streams):
        conns.append(_events(port, into))
    try:
        for port in pair.ports:
            for action, state in (("load", "loaded"), ("unload", "unloaded")):
                assert call(port, "POST", f"/models/{action}", {"model": LLAMA})[0] == 200
                for _ in range(300):  # llama-server loads and unloads in the background
                    if models(port)[LLAMA]["status"]["value"] == state:
                        break
                    time.sleep(0.2)
        for into in streams:
            for _ in range(300):
                if any(e["data"]["status"] == "unloaded" for e in into):
                    break
                time.sleep(0.2)
    finally:
        for conn in conns:
            conn.close()
    shown = []
    for into in streams:
        # llama-server's load progress (status_change while loading) has no bankml equivalent
        kept = [
            e for e in into if e["event"] != "status_change" or e["data"]["status"] != "loading"
        ]
        assert all(e["model"] == LLAMA for e in kept)
        shown.append([(e["event"], e["data"]["status"]) for e in kept])
    assert (
        shown[0]
        == shown[1]
        == [
            ("model_status", "loading"),
            ("status_change", "loaded"),
            ("status_change", "unloaded"),
        ]
    )
    loaded = [
        next(e["data"]["info"] for e in into if e["data"]["status"] == "loaded") for into in streams
    ]
    assert list(loaded[0]) == list(loaded[1])
    assert loaded[0]["meta"] == loaded[1]["meta"]


def test_props_answers_the_router_s_properties_as_llama_server(pair: Pair) -> None:
    ours, theirs = (json.loads(call(port, "GET", "/props")[2]) for port in pair.ports)
    assert list(ours) == list(theirs)
    assert {k: v for k, v in ours.items() if k != "build_info"} == {
        k: v for k, v in theirs.items() if k != "build_info"
    }
    assert ours["role"] == "router" and ours["models_autoload"] is False
    # ?model=: the model's own properties (an alias names it), refused alike when it is not
    # loaded or not known
    for name in (LLAMA, "nope"):  # LLAMA: unloaded by the tests before
        refused = pair.both("GET", f"/props?model={name}")
        assert refused[0] == refused[1] and refused[0][0] == 400
    mine, reference = (json.loads(call(port, "GET", "/props?model=qw")[2]) for port in pair.ports)
    for key in ("model_alias", "model_path"):
        assert mine[key] == reference[key] == (QWEN if key == "model_alias" else mine[key])
    n_ctx = [p["default_generation_settings"]["n_ctx"] for p in (mine, reference)]
    assert n_ctx == [1024, 1024]
    assert set(mine) <= set(reference), "keys llama-server's child does not answer"


def test_a_router_from_a_preset_alone_serves_its_sections_as_llama_server(
    tmp_path: Path, default_model: Path, llama_server_bin: Path
) -> None:
    """No ``--models-dir``: the models are the preset's sections (llama-server also lists its
    download cache, kept empty here)."""
    models_at = tmp_path / "files"
    models_at.mkdir()
    first = write_tiny_model(models_at / "a.gguf", TinySpec("llama", T.F16), default_model, 4)
    pin_into(models_at, first)
    preset = tmp_path / "preset.ini"
    preset.write_text(f"[one]\nmodel = {first}\nLLAMA_ARG_N_PREDICT = 3\nc = 256\n")
    common = ["--models-preset", str(preset), "--host", "127.0.0.1", "-t", "2", "--no-webui"]
    cache = tmp_path / "cache"
    cache.mkdir()
    env = {**os.environ, "LLAMA_CACHE": str(cache), "HF_HOME": str(cache)}
    theirs = free_port()
    ref = subprocess.Popen(
        [str(llama_server_bin), *common, "--port", str(theirs)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    ours = free_port()
    proc = start_dropin([*common, "--listen", f"127.0.0.1:{free_port()}"], ours, tmp_path / "b.log")
    try:
        for _ in range(600):
            try:
                if call(theirs, "GET", "/models")[0] == 200:
                    break
            except OSError:
                time.sleep(0.2)
        mine, reference = models(ours), models(theirs)
        assert list(mine) == list(reference) == ["one"]
        for key in ("aliases", "tags", "object", "owned_by", "architecture", "source"):
            assert mine["one"][key] == reference["one"][key], key
        assert mine["one"]["status"]["value"] == reference["one"]["status"]["value"] == "unloaded"
        answers = []
        for port in (ours, theirs):
            status, _, raw = call(port, "POST", "/v1/completions", {**BODY, "model": "one"})
            assert status == 200, raw
            answers.append(json.loads(raw))
        assert answers[0]["choices"] == answers[1]["choices"]
        assert answers[0]["usage"] == answers[1]["usage"]
        assert answers[0]["usage"]["completion_tokens"] == 3
        assert models(ours)["one"]["meta"] == models(theirs)["one"]["meta"]
    finally:
        proc.terminate()
        proc.wait(30)
        ref.terminate()
        ref.wait(30)
