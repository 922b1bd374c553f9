"""Several models resident at once (``bankml serve --native --registry DIR --max-loaded 2``):
the default model and two tiny generated ones, switched by name with the official ``openai`` and
``ollama`` clients; each answer equal to the real llama-server's on the same file; the least
recently used idle model unloaded at the bound, as /api/ps shows; keep_alive 0 unloading only
its own model; an unknown name, a file changed since it was pinned, a memory budget too small;
and the memory of twenty loads and unloads."""

from __future__ import annotations

import concurrent.futures
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import ollama
import openai
import pytest
from gguf import GGMLQuantizationType as T

from bankml.gate import verify
from bankml.native.ollama import kv_bytes
from bankml.registry.pins import discover
from bankml.registry.residency import LoadError, Residency
from tests.native_server import NativeProcess
from tests.registry_support import answers_alone, flip_last_byte, pin_into
from tests.support import LlamaServer, free_port, http_json
from tests.tiny_models import TinySpec, write_tiny_model

PROMPT = "The capital of France is"
N_PREDICT = 8
TINY = {
    "tiny-llama-f16": (TinySpec("llama", T.F16), 1),
    "tiny-qwen3-q4_0": (TinySpec("qwen3", T.Q4_0), 2),
}


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory, default_model: Path) -> Path:
    """The registry directory: the two tiny models pinned, and a third pinned then changed."""
    directory = tmp_path_factory.mktemp("several") / "forks"
    directory.mkdir()
    for name, (spec, seed) in TINY.items():
        pin_into(directory, write_tiny_model(directory / f"{name}.gguf", spec, default_model, seed))
    changed = write_tiny_model(
        directory / "tiny-changed.gguf", TinySpec("llama", T.F16), default_model, 3
    )
    pin_into(directory, changed)
    flip_last_byte(changed)  # same size, other bytes
    return directory


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory,
    registry: Path,
    default_model: Path,
    default_fork: Path,
) -> Iterator[NativeProcess]:
    home = tmp_path_factory.mktemp("several-home")
    proc = NativeProcess(
        default_model,
        default_fork,
        [
            "--native",
            "--upstream",
            f"127.0.0.1:{free_port()}",
            "--registry",
            str(registry),
            "--max-loaded",
            "2",
            "--metrics",
        ],
        home / "bankml.log",
    )
    with proc:
        yield proc


@pytest.fixture(scope="module")
def reference(
    registry: Path, reference_server: LlamaServer, llama_server_bin: Path
) -> dict[str, str]:
    """Each model's answer from the real llama-server on the same file, each model alone."""
    files = {name: registry / f"{name}.gguf" for name in TINY}
    return answers_alone(files, reference_server.url, llama_server_bin, PROMPT, N_PREDICT)


def ps_names(client: ollama.Client) -> list[str]:
    return sorted(m.model for m in client.ps().models)


def completion(client: openai.OpenAI, model: str) -> str:
    answer = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=N_PREDICT, temperature=0
    )
    return answer.choices[0].text


def test_models_switched_by_name_answer_as_each_alone(
    server: NativeProcess, reference: dict[str, str], default_model: Path
) -> None:
    """openai and ollama name three models in turn at --max-loaded 2: each answer is the real
    llama-server's on that file, fresh or resident long; the least recently used goes first."""
    oai = openai.OpenAI(base_url=server.url + "/v1", api_key="none", timeout=120)
    oll = ollama.Client(host=server.url, timeout=120)
    startup = default_model.name[: -len(".gguf")].lower()
    first, second = TINY
    assert completion(oai, startup) == reference[""]
    assert ps_names(oll) == [f"{startup}:latest"]
    assert completion(oai, first) == reference[first]
    assert ps_names(oll) == sorted([f"{startup}:latest", f"{first}:latest"])
    # the startup model is the least recently used idle one: it makes room
    assert completion(oai, second) == reference[second]
    assert ps_names(oll) == sorted([f"{first}:latest", f"{second}:latest"])
    # with the ollama client: the first tiny model is now the least recently used
    answer = oll.generate(
        model=startup, prompt=PROMPT, raw=True, options={"temperature": 0, "num_predict": N_PREDICT}
    )
    assert answer.response == reference[""]
    assert ps_names(oll) == sorted([f"{second}:latest", f"{startup}:latest"])
    # loaded again: the same answer as when it was first loaded
    assert completion(oai, first) == reference[first]
    models = {m.model: m for m in oll.ps().models}
    assert set(models) == {f"{startup}:latest", f"{first}:latest"}
    for m in models.values():
        assert m.size_vram == 0 and m.context_length == 2048 and m.size > 0
        assert m.expires_at is not None
    # /bankml/metrics: each model's own requests and tokens, and the resident ones' memory
    status, metrics, _ = server.get("/bankml/metrics")
    assert status == 200
    per_model = metrics["models"]
    assert per_model[startup]["requests"] == 2 and per_model[first]["requests"] == 2
    assert per_model[second]["requests"] == 1 and not per_model[second]["resident"]
    assert per_model[first]["completion_tokens"] > 0
    for name in (startup, first):
        assert per_model[name]["resident"] and per_model[name]["need_bytes"] > 0
    assert {r.get("model") for r in metrics["records"]} == {startup, first, second}
    # /bankml/usage: the same per-model view beside the process's memory
    status, usage, _ = server.get("/bankml/usage")
    assert status == 200 and usage["models"][first]["need_bytes"] > 0
    # /metrics: llama-server's series, then one line per model for each of bankml's own
    with urllib.request.urlopen(server.url + "/metrics", timeout=60) as reply:
        text = reply.read().decode()
    assert f'bankml:model_requests_total{{model="{second}"}} 1\n' in text
    assert f'bankml:model_resident_bytes{{model="{second}"}} 0\n' in text
    resident_bytes = f'bankml:model_resident_bytes{{model="{first}"}} '
    assert int(text.split(resident_bytes)[1].split("\n")[0]) == per_model[first]["need_bytes"]
    for series, field in (("prompt", "prompt_tokens"), ("completion", "completion_tokens")):
        for name in (startup, first, second):
            line = f'bankml:model_{series}_tokens_total{{model="{name}"}} '
            assert int(text.split(line)[1].split("\n")[0]) == per_model[name][field] > 0


def test_three_models_asked_at_once_each_answer_as_alone(
    server: NativeProcess, reference: dict[str, str], default_model: Path
) -> None:
    """Three requests sent together, each naming another model, at --max-loaded 2: whatever
    the order they are parsed and run in (a model parsed for may be unloaded before its turn,
    and is then loaded again), each answer is its own model's, as the real llama-server's."""
    startup = default_model.name[: -len(".gguf")].lower()
    body = {"prompt": PROMPT, "max_tokens": N_PREDICT, "temperature": 0}
    names = [startup, *TINY]
    with concurrent.futures.ThreadPoolExecutor(len(names)) as pool:
        replies = list(
            pool.map(
                lambda name: http_json(server.url + "/v1/completions", {**body, "model": name}),
                names,
            )
        )
    for name, (status, answer) in zip(names, replies):
        assert status == 200, answer
        assert answer["choices"][0]["text"] == reference[name if name != startup else ""]
        # the answer names the file of the model that computed it
        assert answer["model"] == (default_model.name if name == startup else f"{name}.gguf")


def test_keep_alive_zero_unloads_only_its_model(server: NativeProcess) -> None:
    """/api/generate with keep_alive 0 names one of two resident models: only it goes."""
    oll = ollama.Client(host=server.url, timeout=120)
    first, second = TINY
    oll.generate(model=first, keep_alive="10m")  # an empty prompt loads it
    oll.generate(model=second, keep_alive=-1)
    before = {m.model: m.expires_at for m in oll.ps().models}
    assert set(before) == {f"{first}:latest", f"{second}:latest"}
    # kept for good lists first (the longest time left), as Ollama sorts them
    assert [m.model for m in oll.ps().models] == [f"{second}:latest", f"{first}:latest"]
    oll.generate(model=first, keep_alive=0)
    assert ps_names(oll) == [f"{second}:latest"]


def test_unknown_and_changed_models_are_refused_the_others_untouched(
    server: NativeProcess,
) -> None:
    """At the bound (two resident, --max-loaded 2): an unknown model is a 404, a file changed
    since it was pinned a 503, and neither unloads a resident model to make room."""
    oai = openai.OpenAI(base_url=server.url + "/v1", api_key="none", timeout=120, max_retries=0)
    oll = ollama.Client(host=server.url, timeout=120)
    for name in TINY:  # an empty prompt loads it
        oll.generate(model=name)
    before = ps_names(oll)
    assert before == sorted(f"{name}:latest" for name in TINY)
    with pytest.raises(openai.NotFoundError) as missing:
        completion(oai, "no-such-model")
    assert "no-such-model" in str(missing.value)
    with pytest.raises(ollama.ResponseError) as err:
        oll.generate(model="no-such-model", prompt=PROMPT)
    assert err.value.status_code == 404
    with pytest.raises(openai.InternalServerError) as changed:
        completion(oai, "tiny-changed")
    assert changed.value.status_code == 503 and "!= pinned" in str(changed.value)
    with pytest.raises(ollama.ResponseError) as err:
        oll.generate(model="tiny-changed", prompt=PROMPT)
    assert err.value.status_code == 503 and "!= pinned" in str(err.value)
    assert ps_names(oll) == before


def vm_rss(pid: int) -> int:
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_loading_and_unloading_twenty_times_keeps_memory(server: NativeProcess) -> None:
    """RSS after a tiny model was loaded and unloaded 20 times: at most 2 % above where it
    started (measured after ten warm-up loads and unloads: the first loads grow the heap and the
    kernels' caches to where they stay). RSS may fall below the start: pages of the file and
    freed arenas given back are no leak."""
    oll = ollama.Client(host=server.url, timeout=120)
    first = next(iter(TINY))
    assert server.proc is not None
    for _ in range(10):  # warm-up
        oll.generate(model=first)
        oll.generate(model=first, keep_alive=0)
    start = vm_rss(server.proc.pid)
    for _ in range(20):
        oll.generate(model=first)
        oll.generate(model=first, keep_alive=0)
    end = vm_rss(server.proc.pid)
    assert end - start <= 0.02 * start, (start, end)


def test_a_model_over_the_memory_budget_is_a_503_and_the_resident_one_stays(
    registry: Path, tmp_path: Path
) -> None:
    """A server whose --models-memory (1 MiB) is less than any model needs: its startup model
    is loaded whatever the budget; another model is refused with 503 and the reason, on both
    APIs, and nothing is unloaded."""
    first, second = TINY
    startup = registry / f"{first}.gguf"
    proc = NativeProcess(
        startup,
        registry / f"{first}.gguf.FORK.json",
        ["--native", "--upstream", f"127.0.0.1:{free_port()}", "--registry", str(registry)]
        + ["--max-loaded", "2", "--models-memory", "1M"],
        tmp_path / "bankml.log",
    )
    with proc:
        oll = ollama.Client(host=proc.url, timeout=120)
        with pytest.raises(ollama.ResponseError) as err:
            oll.generate(model=second, prompt=PROMPT, raw=True)
        assert err.value.status_code == 503 and "--models-memory budget of 1 MiB" in str(err.value)
        oai = openai.OpenAI(base_url=proc.url + "/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.InternalServerError) as over:
            completion(oai, second)
        assert over.value.status_code == 503
        assert ps_names(oll) == [f"{first}:latest"]


def test_a_load_needing_room_waits_for_the_answer_running_then_unloads_its_model(
    registry: Path, reference: dict[str, str], tmp_path: Path
) -> None:
    """--models-memory with room for one tiny model at a time (--max-loaded 3, two slots): a
    request for the other model while the resident one streams an answer waits; the stream is
    answered in full, and only then is its model unloaded for the budget and the other
    loaded."""
    first, second = TINY
    paths = [registry / f"{name}.gguf" for name in TINY]
    sizes, kvs = [p.stat().st_size for p in paths], [kv_bytes(str(p), 512) for p in paths]
    assert min(sizes) // 2 > max(kvs)  # KV caches small beside the files: two never fit
    budget = max(s + k for s, k in zip(sizes, kvs, strict=True)) + min(sizes) // 2
    proc = NativeProcess(
        registry / f"{first}.gguf",
        registry / f"{first}.gguf.FORK.json",
        ["--native", "--upstream", f"127.0.0.1:{free_port()}", "--registry", str(registry)]
        + ["--max-loaded", "3", "--models-memory", str(budget), "--ctx", "512", "--parallel", "2"],
        tmp_path / "bankml.log",
    )
    with proc, concurrent.futures.ThreadPoolExecutor(1) as pool:
        oai = openai.OpenAI(base_url=proc.url + "/v1", api_key="none", timeout=300, max_retries=0)
        stream = oai.completions.create(
            model=first, prompt=PROMPT, max_tokens=200, temperature=0, stream=True
        )
        chunks = iter(stream)
        next(chunks)  # its run has started

        def answered() -> tuple[str, float]:
            return completion(oai, second), time.monotonic()

        other = pool.submit(answered)
        finished = [c.choices[0].finish_reason for c in chunks if c.choices]
        stream_ended = time.monotonic()
        assert [f for f in finished if f] == ["length"]  # all 200 tokens
        text, answered_at = other.result(timeout=300)
        assert answered_at > stream_ended
        assert text == reference[second]  # just loaded, two slots: as llama-server's alone
        oll = ollama.Client(host=proc.url, timeout=120)
        assert ps_names(oll) == [f"{second}:latest"]
    log = proc.log.read_text(errors="replace")
    assert f"{first} unloaded (--models-memory needed room)" in log


# -- the residency's bounds, without a server --------------------------------------------------


def test_a_model_over_the_memory_budget_is_refused_and_idle_ones_make_room(
    registry: Path,
) -> None:
    """--models-memory: a model needing more than the whole budget is a 503 and nothing is
    unloaded; one that fits once an idle model is gone unloads it; with every resident model
    in use, a 503 that says to try again."""
    reg = discover(str(registry))
    a, b = (reg.resolve(name) for name in TINY)
    sizes = {a.name: 100, b.name: 60}
    closed: list[str] = []
    res = Residency(
        lambda v: object(),
        lambda resident, why: closed.append(resident.pin.name),
        verify_model=verify.verify,
        max_loaded=3,
        budget=150,
        need=lambda pin: sizes[pin.name],
    )
    res.acquire(a, now=0.0)
    sizes[b.name] = 151
    with pytest.raises(LoadError) as err:
        res.acquire(b, now=1.0)
    assert err.value.status == 503 and "--models-memory" in err.value.message
    assert list(res.residents) == [a.name] and closed == []
    sizes[b.name] = 60  # 160 > 150: the idle model makes room
    res.acquire(b, now=2.0)
    assert list(res.residents) == [b.name] and closed == [a.name]
    res.residents[b.name].in_use = 1  # answering: never unloaded under its request
    with pytest.raises(LoadError) as err:
        res.acquire(a, now=3.0)
    assert err.value.status == 503 and err.value.busy
    assert list(res.residents) == [b.name]


@pytest.mark.parametrize(
    ("fault", "message"),
    [
        (OSError(5, "Input/output error"), "cannot open {file}: Input/output error"),
        (ValueError("tensor blk.1.attn_q.weight: bad shape"), "cannot load {file}: tensor "),
    ],
)
def test_a_load_that_fails_leaves_nothing_resident(
    registry: Path, fault: Exception, message: str
) -> None:
    """The loader failing (reading the file, or half way through laying out the model): a
    500 with the reason, nothing of it resident, the other model untouched."""
    reg = discover(str(registry))
    a, b = (reg.resolve(name) for name in TINY)

    def open_model(v: verify.Verified) -> object:
        if v.path.endswith(f"{b.name}.gguf"):
            raise fault
        return object()

    res = Residency(open_model, verify_model=verify.verify, max_loaded=2)
    res.acquire(a, now=0.0)
    with pytest.raises(LoadError) as err:
        res.acquire(b, now=1.0)
    assert err.value.status == 500
    assert err.value.message.startswith(message.format(file=b.file))
    assert list(res.residents) == [a.name]


@pytest.mark.parametrize("cache_type", ["f16", "q8_0"])
def test_the_kv_cache_reckoned_is_the_engines(default_model: Path, cache_type: str) -> None:
    """What --models-memory counts for a model's KV cache is what the engine allocates."""
    from bankml.native.ollama import kv_bytes
    from bankml.native.resident import open_engine

    engine, _ = open_engine(str(default_model), n_ctx=512, device="cpu", cache_type=cache_type)
    arrays = [
        a
        for s in engine.slots
        for layer in s.cache._k + s.cache._v
        for a in (layer if isinstance(layer, tuple) else (layer,))
    ]
    assert sum(a.nbytes for a in arrays) == kv_bytes(str(default_model), 512, cache_type)
