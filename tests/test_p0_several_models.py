"""P0 with several models (``bankml serve --spawn BIN --registry DIR --max-loaded 2``): the
default model and two tiny generated pinned ones, each run by its own supervised llama-server
and chosen by the request's ``model`` through the official ``openai`` client. Each answer equals
the real llama-server's on that file alone, its receipt names that file's sha256 and checks
valid; at the bound the least recently used llama-server is stopped; an unknown model is 404, a
file changed since it was pinned 503; a killed llama-server is restarted on its own while the
other model keeps answering."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import psutil
import pytest
from gguf import GGMLQuantizationType as T

from bankml.gate.verify import sha256_file
from bankml.receipts.keys import SigningKey
from tests.bankml_process import BankmlProcess, check_receipt_cli, process_gone
from tests.registry_support import answers_alone, flip_last_byte, pin_into
from tests.support import DEFAULT_SHA256, LlamaServer, free_port
from tests.tiny_models import TinySpec, write_tiny_model

PROMPT = "The capital of France is"
N_PREDICT = 8
TINY = {"tiny-a": 1, "tiny-b": 2}  # name -> the generator's seed


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory, default_model: Path) -> Path:
    """Two tiny models pinned, and a third pinned then changed."""
    directory = tmp_path_factory.mktemp("p0-several") / "forks"
    directory.mkdir()
    for name, seed in [*TINY.items(), ("tiny-changed", 3)]:
        path = write_tiny_model(
            directory / f"{name}.gguf", TinySpec("llama", T.F16), default_model, seed
        )
        pin_into(directory, path)
    flip_last_byte(directory / "tiny-changed.gguf")  # same size, other bytes
    return directory


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory,
    registry: Path,
    default_model: Path,
    default_fork: Path,
    llama_server_bin: Path,
    signing_key: SigningKey,
) -> Iterator[BankmlProcess]:
    log = tmp_path_factory.mktemp("p0-several-log") / "bankml.log"
    engine = ["--spawn", str(llama_server_bin), "--upstream", f"127.0.0.1:{free_port()}"]
    engine += ["--receipt-key", str(signing_key.path), "--registry", str(registry)]
    engine += ["--max-loaded", "2", "--restart-delay", "0.5"]
    with BankmlProcess(default_model, default_fork, engine, log, llama_args=["--metrics"]) as proc:
        yield proc


@pytest.fixture(scope="module")
def reference(
    registry: Path, reference_server: LlamaServer, llama_server_bin: Path
) -> dict[str, str]:
    """Each model's greedy answer from a plain llama-server on its file alone."""
    files = {name: registry / f"{name}.gguf" for name in TINY}
    return answers_alone(files, reference_server.url, llama_server_bin, PROMPT, N_PREDICT)


def client(server: BankmlProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", timeout=120, max_retries=0)


def complete(server: BankmlProcess, model: str) -> tuple[str, bytes, bytes]:
    """(text, request bytes, response bytes) of a greedy completion naming ``model``."""
    raw = client(server).completions.with_raw_response.create(
        model=model, prompt=PROMPT, max_tokens=N_PREDICT, temperature=0
    )
    return raw.parse().choices[0].text, raw.http_request.content, raw.http_response.content


def engines(server: BankmlProcess) -> dict[str, int]:
    """The running llama-servers bankml started: model file name -> pid."""
    assert server.proc is not None
    out = {}
    for child in psutil.Process(server.proc.pid).children():
        try:
            argv = child.cmdline()
        except psutil.NoSuchProcess:
            continue
        if child.status() != psutil.STATUS_ZOMBIE and "-m" in argv:
            out[Path(argv[argv.index("-m") + 1]).name] = child.pid
    return out


def test_each_model_answers_as_alone_with_its_receipt(
    server: BankmlProcess,
    reference: dict[str, str],
    registry: Path,
    default_model: Path,
    signing_key: SigningKey,
    tmp_path: Path,
) -> None:
    """Three models in turn at --max-loaded 2: each answer is the plain llama-server's on that
    file, its receipt names that file's sha256 and checks valid; the third stops the least
    recently used llama-server."""
    startup = default_model.name[: -len(".gguf")].lower()
    first, second = TINY
    text, _, resp = complete(server, startup)
    assert text == reference[""]
    assert json.loads(resp)["bankml_receipt"]["model_sha256"] == DEFAULT_SHA256
    assert set(engines(server)) == {default_model.name}
    text, req, resp = complete(server, first)
    assert text == reference[first]
    sha = sha256_file(registry / f"{first}.gguf", progress=False)
    assert json.loads(resp)["bankml_receipt"]["model_sha256"] == sha
    assert (
        check_receipt_cli(tmp_path, req, resp, signing_key.public_key_pem, "--model-sha256", sha)[0]
        == 0
    )
    assert set(engines(server)) == {default_model.name, f"{first}.gguf"}
    old = engines(server)[default_model.name]
    text, _, resp = complete(server, second)  # the bound: the startup model's is stopped
    assert text == reference[second]
    assert json.loads(resp)["bankml_receipt"]["model_sha256"] == sha256_file(
        registry / f"{second}.gguf", progress=False
    )
    assert process_gone(old)
    assert set(engines(server)) == {f"{first}.gguf", f"{second}.gguf"}
    text, _, resp = complete(server, startup)  # started again, verified again
    assert text == reference[""]
    assert json.loads(resp)["bankml_receipt"]["model_sha256"] == DEFAULT_SHA256
    assert set(engines(server)) == {default_model.name, f"{second}.gguf"}


def test_unknown_model_404_changed_file_503(
    server: BankmlProcess, reference: dict[str, str]
) -> None:
    with pytest.raises(openai.NotFoundError) as err:
        complete(server, "no-such-model")
    assert "no-such-model" in str(err.value)
    running = engines(server)  # before: a refused file stops none of them
    with pytest.raises(openai.InternalServerError) as changed:
        complete(server, "tiny-changed")
    assert changed.value.status_code == 503
    assert engines(server) == running and "tiny-changed.gguf" not in running
    second = list(TINY)[1]
    assert complete(server, second)[0] == reference[second]
    assert set(engines(server)) == set(running) | {f"{second}.gguf"}


def test_killed_llama_server_restarted_alone(
    server: BankmlProcess, reference: dict[str, str], default_model: Path
) -> None:
    startup = default_model.name[: -len(".gguf")].lower()
    second = list(TINY)[1]
    assert complete(server, second)[0] == reference[second]
    assert complete(server, startup)[0] == reference[""]
    before = engines(server)
    killed = before[f"{second}.gguf"]
    os.kill(killed, signal.SIGKILL)
    assert process_gone(killed)
    assert complete(server, startup)[0] == reference[""]
    assert engines(server)[default_model.name] == before[default_model.name]
    deadline = time.monotonic() + 120
    while True:  # 503 with Retry-After while it restarts
        try:
            text = complete(server, second)[0]
            break
        except openai.InternalServerError as err:
            assert err.status_code == 503
            assert time.monotonic() < deadline, "not restarted"
            time.sleep(0.2)
    assert text == reference[second]
    after = engines(server)
    assert after[f"{second}.gguf"] != killed
    assert after[default_model.name] == before[default_model.name]


def get_json(server: BankmlProcess, path: str) -> dict:
    with urllib.request.urlopen(server.url + path, timeout=60) as resp:
        return json.loads(resp.read())


def test_bankml_usage_metrics_and_v1_models_cover_every_model(
    server: BankmlProcess, registry: Path, default_model: Path
) -> None:
    """/bankml describes every served model, /bankml/metrics and /bankml/usage count each
    model's answers and show a resident one's memory, /v1/models lists every model."""
    second = list(TINY)[1]
    before = get_json(server, "/bankml/metrics")["models"][second]
    _, _, raw = complete(server, second)  # resident now
    usage_of = json.loads(raw)["usage"]
    described = get_json(server, "/bankml")
    assert described["model_sha256"] == DEFAULT_SHA256  # the startup model's, as with one
    shown = described["models"][second]
    assert shown["resident"] is True
    assert shown["model_sha256"] == sha256_file(registry / f"{second}.gguf", progress=False)
    assert shown["engine"]["pid"] == engines(server)[f"{second}.gguf"]
    metrics = get_json(server, "/bankml/metrics")["models"]
    mine = metrics[second]
    assert mine["resident"] is True and mine["requests"] == before["requests"] + 1
    assert mine["completions"] == before["completions"] + 1
    for key in ("prompt_tokens", "completion_tokens"):
        assert mine[key] == before[key] + usage_of[key]
    assert mine["rss_bytes"] > 0 and mine["pid"] == engines(server)[f"{second}.gguf"]
    assert mine["need_bytes"] > (registry / f"{second}.gguf").stat().st_size  # and its KV cache
    assert metrics["tiny-changed"] == {
        "resident": False,
        "requests": 0,
        "completions": 0,
        "prompt_tokens": 0,
        "completion_tokens": 0,
    }
    usage = get_json(server, "/bankml/usage")
    assert set(usage["models"]) == set(metrics)
    names = {row["name"] for row in usage["processes"]}
    assert f"llama-server {second}" in names and "bankml serve" in names
    listed = get_json(server, "/v1/models")
    files = {Path(entry["id"]).name for entry in listed["data"]}
    assert files == {default_model.name, *(f"{n}.gguf" for n in [*TINY, "tiny-changed"])}
    resident = [e for e in listed["data"] if Path(e["id"]).name == f"{second}.gguf"]
    assert "meta" in resident[0]  # its llama-server's own entry
    # /metrics: the startup model's llama-server's series, then bankml's per model
    with urllib.request.urlopen(server.url + "/metrics", timeout=60) as reply:
        text = reply.read().decode()
    assert "llamacpp:prompt_tokens_total " in text
    counted = get_json(server, "/bankml/metrics")["models"]
    for name, counts in counted.items():
        for series, key in [("requests", "requests"), ("completion_tokens", "completion_tokens")]:
            line = f'bankml:model_{series}_total{{model="{name}"}} {counts[key]}\n'
            assert line in text, (line, text[-2000:])
    assert counted[second]["completion_tokens"] > 0 and counted[second]["requests"] > 0
    resident_bytes = f'bankml:model_resident_bytes{{model="{second}"}} '
    assert int(text.split(resident_bytes)[1].split("\n")[0]) == counted[second]["need_bytes"]
    assert 'bankml:model_resident_bytes{model="tiny-changed"} 0\n' in text


def post(server: BankmlProcess, path: str, body: dict) -> int:
    """The status of a JSON POST (an error status too)."""
    request = urllib.request.Request(
        server.url + path, json.dumps(body).encode(), {"content-type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as resp:
            resp.read()
            return int(resp.status)
    except urllib.error.HTTPError as err:
        err.read()
        return int(err.code)


def test_every_forwarded_request_counted_on_its_model(server: BankmlProcess) -> None:
    """/bankml/metrics' and /bankml/usage's ``requests`` of a model grow by exactly one for
    each request of any kind routed to its llama-server (answered or refused there);
    ``completions`` only for a completion; a request naming an unknown model counts nowhere."""
    second = list(TINY)[1]
    assert complete(server, second)[0]  # resident now
    kinds = [
        ("/tokenize", {"content": PROMPT}),
        ("/detokenize", {"tokens": [1, 2, 3]}),
        ("/v1/embeddings", {"input": PROMPT}),
        ("/apply-template", {"messages": [{"role": "user", "content": "hi"}]}),
        ("/completion", {"prompt": PROMPT, "n_predict": 1}),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
        ),
    ]
    for path, body in kinds:
        before = get_json(server, "/bankml/metrics")["models"]
        status = post(server, path, {**body, "model": second})
        after = get_json(server, "/bankml/metrics")["models"]
        assert after[second]["requests"] == before[second]["requests"] + 1, (path, status)
        completion = path in ("/completion", "/v1/chat/completions")
        assert after[second]["completions"] == before[second]["completions"] + completion, path
        others = {n: m["requests"] for n, m in after.items() if n != second}
        assert others == {n: m["requests"] for n, m in before.items() if n != second}, path
    before = get_json(server, "/bankml/metrics")["models"]
    assert post(server, "/tokenize", {"content": PROMPT, "model": "no-such-model"}) == 404
    assert post(server, "/tokenize", {"content": PROMPT, "model": second}) == 200
    sent = time.time()
    deadline = time.monotonic() + 15
    while True:  # /bankml/usage is a sample: one taken after the requests
        sampled = get_json(server, "/bankml/usage")
        if sampled["sampled_at"] > sent or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    after = sampled["models"]
    assert {n: m["requests"] for n, m in after.items()} == {
        n: m["requests"] + (n == second) for n, m in before.items()
    }


STUBBORN = """#!{python}
# llama-server under a parent that ignores SIGTERM (a llama-server slow to stop): the child
# dies with this process (PR_SET_PDEATHSIG), so only a SIGKILL ends both
import ctypes, signal, subprocess, sys
signal.signal(signal.SIGTERM, signal.SIG_IGN)
def die_with_parent():
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)
child = subprocess.Popen([{real!r}, *sys.argv[1:]], preexec_fn=die_with_parent)
sys.exit(child.wait())
"""


def test_stop_timeout_is_an_unloaded_llama_servers_grace(
    tmp_path: Path,
    registry: Path,
    default_model: Path,
    default_fork: Path,
    llama_server_bin: Path,
    reference: dict[str, str],
) -> None:
    """--stop-timeout 1: the llama-server of a model unloaded to make room (--max-loaded 1)
    that does not end on SIGTERM is killed 1 s later, and the model asked for answers."""
    stubborn = tmp_path / "stubborn-llama-server"
    stubborn.write_text(STUBBORN.format(python=sys.executable, real=str(llama_server_bin)))
    stubborn.chmod(0o755)
    log = tmp_path / "bankml.log"
    engine = ["--spawn", str(stubborn), "--upstream", f"127.0.0.1:{free_port()}"]
    engine += ["--registry", str(registry), "--max-loaded", "1", "--stop-timeout", "1"]
    first = list(TINY)[0]
    with BankmlProcess(default_model, default_fork, engine, log) as proc:
        old = engines(proc)[default_model.name]
        assert complete(proc, first)[0] == reference[first]
        assert process_gone(old)
        assert set(engines(proc)) == {f"{first}.gguf"}
    text = log.read_text()
    assert "still running after 1 s: SIGKILL" in text, text[-3000:]


def test_a_model_over_the_memory_budget_is_a_503_and_no_llama_server_stops(
    registry: Path,
    default_model: Path,
    default_fork: Path,
    llama_server_bin: Path,
    tmp_path: Path,
) -> None:
    """P0 at ``--models-memory 1M``: the startup model runs whatever the budget; another
    model needs more than the whole budget (its file and its llama-server's KV cache), so it
    is refused with 503 and the reason, its llama-server never started, the startup one's
    untouched."""
    engine = ["--spawn", str(llama_server_bin), "--upstream", f"127.0.0.1:{free_port()}"]
    engine += ["--registry", str(registry), "--max-loaded", "2", "--models-memory", "1M"]
    with BankmlProcess(default_model, default_fork, engine, tmp_path / "bankml.log") as proc:
        running = engines(proc)
        with pytest.raises(openai.InternalServerError) as over:
            complete(proc, list(TINY)[0])
        assert over.value.status_code == 503
        assert "more than the --models-memory budget of 1 MiB" in str(over.value)
        assert engines(proc) == running and set(running) == {default_model.name}


def test_several_models_need_spawn_or_native(llama_server_bin: Path, tmp_path: Path) -> None:
    """--registry and --max-loaded take --spawn (or --native); with --upstream they are refused."""
    from twisted.python import usage

    from bankml.tap import Options

    def parsed(*args: str) -> Options:
        options = Options()
        options.parseOptions(["m.gguf", "--fork", "f.json", *args])
        return options

    spawn = ["--spawn", str(llama_server_bin)]
    got = parsed(*spawn, "--registry", str(tmp_path), "--max-loaded", "3")
    assert (got["registry"], got["max-loaded"], got["mode"]) == (str(tmp_path), 3, "spawn")
    assert got["stop_timeout"] == 10  # llama-server's router's default
    several = [*spawn, "--max-loaded", "2"]
    assert parsed(*several, "--stop-timeout", "0")["stop_timeout"] == 0
    for args, words in (
        (["--max-loaded", "2"], "it needs --native or --spawn"),
        (["--registry", str(tmp_path)], "needs --native"),
        ([*spawn, "--max-loaded", "0"], "--max-loaded: at least 1"),
        ([*spawn, "--stop-timeout", "5"], "--stop-timeout is the grace"),
        ([*several, "--stop-timeout", "1.5"], "not a whole number"),
        ([*several, "--stop-timeout", "-1"], "0 or more seconds"),
    ):
        with pytest.raises(usage.UsageError) as err:
            parsed(*args)
        assert words in str(err.value)
