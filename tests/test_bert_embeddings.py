"""A BERT sentence-embedding model served side by side: all-MiniLM-L6-v2 converted by ``bankml
convert`` to F16 (as tests/test_encoder.py converts it), then ``bankml llama-server`` and the
real llama-server started with the same flags on that file. The vectors (the official
``openai`` client, raw /embedding with pooling none, the official ``ollama`` client) must be
llama-server's bits as float32; completions and chats are answered as llama-server answers a
model that cannot generate; a receipt holds and replays on the encoder."""

from __future__ import annotations

import hashlib
import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy
import pytest

from bankml.convert import convert
from tests import hf_dirs, support
from tests.bankml_process import check_receipt_cli
from tests.dropin import (
    Pair,
    assert_tasks_counted_alike,
    bankml,
    call,
    dropin_pair,
    start_serve,
)

TEXTS = ["Hello, World!", "Café naïve — 東京 🦙 [SEP] ok", "The quick brown fox. " * 20]


@pytest.fixture(scope="module")
def minilm_f16(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the converted MiniLM F16, its FORK.json)."""
    root = tmp_path_factory.mktemp("minilm")
    out, fork = root / "minilm.gguf", root / "FORK.json"
    made = convert(str(hf_dirs.minilm_dir()), str(out), str(fork), outtype="f16", progress=False)
    assert made.architecture == "bert"
    return out, fork


def _pair(
    flags: list[str], model: tuple[Path, Path], binary: Path, factory: pytest.TempPathFactory
) -> Iterator[Pair]:
    log = factory.mktemp("pair") / "bankml.log"
    # llama-server's default context is the model's (512); the tests' own default is not
    yield from dropin_pair([*flags, "-c", "512"], model[0], model[1], binary, log)


@pytest.fixture(scope="module")
def bert_pair(
    minilm_f16: tuple[Path, Path], llama_server_bin: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Pair]:
    flags = ["--embeddings", "--metrics"]
    yield from _pair(flags, minilm_f16, llama_server_bin, tmp_path_factory)


@pytest.fixture(scope="module")
def bert_none_pair(
    minilm_f16: tuple[Path, Path], llama_server_bin: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Pair]:
    flags = ["--embeddings", "--pooling", "none"]
    yield from _pair(flags, minilm_f16, llama_server_bin, tmp_path_factory)


@pytest.fixture(scope="module")
def bert_plain_pair(
    minilm_f16: tuple[Path, Path], llama_server_bin: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Pair]:
    yield from _pair(["-np", "2"], minilm_f16, llama_server_bin, tmp_path_factory)


@pytest.fixture(scope="module")
def bert_slots_pair(
    minilm_f16: tuple[Path, Path], llama_server_bin: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Pair]:
    flags = ["--embeddings", "-np", "4", "-kvu"]
    yield from _pair(flags, minilm_f16, llama_server_bin, tmp_path_factory)


def f32(values: Any) -> numpy.ndarray:
    return numpy.asarray(values, dtype=numpy.float64).astype(numpy.float32)


def post(port: int, path: str, body: Any) -> tuple[int, Any, bytes]:
    status, _, raw = call(port, "POST", path, body)
    return status, json.loads(raw), raw


def test_openai_client_string_and_list_are_llama_servers_bits(bert_pair: Pair) -> None:
    from openai import OpenAI

    for given in (TEXTS[0], TEXTS):
        got = []
        for port in bert_pair.ports:
            client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x")
            got.append(client.embeddings.create(model="minilm", input=given))
        ours, theirs = got
        assert len(ours.data) == len(theirs.data) == (1 if isinstance(given, str) else 3)
        for a, b in zip(ours.data, theirs.data):
            assert len(a.embedding) == 384  # MiniLM's width, mean-pooled (the GGUF's pooling)
            assert numpy.array_equal(f32(a.embedding), f32(b.embedding))
        assert ours.usage.prompt_tokens == theirs.usage.prompt_tokens


def test_receipt_holds_and_replays_on_the_encoder(
    bert_pair: Pair, minilm_f16: tuple[Path, Path], tmp_path: Path
) -> None:
    body = {"content": TEXTS[:2]}
    (s1, ours, raw), (s2, theirs, _) = (post(p, "/embedding", body) for p in bert_pair.ports)
    assert s1 == s2 == 200
    for a, b in zip(ours, theirs, strict=True):
        assert numpy.array_equal(f32(a["embedding"]), f32(b["embedding"]))
    sha = hashlib.sha256(minilm_f16[0].read_bytes()).hexdigest()
    assert {r["bankml_receipt"]["model_sha256"] for r in ours} == {sha}
    key = json.loads(call(bert_pair.ports[0], "GET", "/bankml/key")[2])["public_key"]
    replay = ("--replay", str(minilm_f16[0]), "--fork", str(minilm_f16[1]))
    code, out = check_receipt_cli(tmp_path, json.dumps(body).encode(), raw, key, *replay)
    assert code == 0 and "replay: identical: 2 vectors" in out, out


@pytest.mark.parametrize(
    "path, body",
    [
        ("/completion", {"prompt": "Hello", "n_predict": 2}),
        ("/completion", {"prompt": "Hello", "n_predict": 2, "stream": True}),
        ("/completion", {"n_predict": 2}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ("/v1/chat/completions", {"messages": "hi"}),
        ("/tokenize", {"content": "Hello [SEP] world", "add_special": True, "with_pieces": True}),
        ("/detokenize", {"tokens": [101, 7592, 2088, 102]}),
        ("/v1/rerank", {"query": "a", "documents": ["b"]}),  # not --rerank: the 501
    ],
)
def test_other_routes_answer_as_llama_server(bert_pair: Pair, path: str, body: Any) -> None:
    (s1, ours), (s2, theirs) = bert_pair.both("POST", path, body)
    assert s1 == s2
    assert json.loads(ours) == json.loads(theirs)


def test_props_models_and_slots_are_llama_servers(bert_pair: Pair) -> None:
    ours, theirs = (json.loads(b) for _, b in bert_pair.both("GET", "/v1/models"))
    meta = [m["data"][0]["meta"] for m in (ours, theirs)]
    assert meta[0] == meta[1] and meta[0]["n_embd"] == 384
    ours, theirs = (json.loads(b) for _, b in bert_pair.both("GET", "/slots"))
    # the slot itself; llama-server also lists its last task (docs/llama-server.md)
    keys = ("id", "n_ctx", "speculative", "is_processing")
    assert [{k: s[k] for k in keys} for s in ours] == [{k: s[k] for k in keys} for s in theirs]
    ours, theirs = (json.loads(b) for _, b in bert_pair.both("GET", "/props"))
    for key in ("default_generation_settings", "total_slots", "chat_template", "modalities"):
        assert ours[key] == theirs[key], key


def test_a_refused_completion_is_a_task_as_llama_servers(bert_pair: Pair) -> None:
    """llama-server starts a completion's task on the encoder's slot, then refuses it (500):
    no counter of /metrics moves, and /slots shows the refused task (its parameters, zero
    counts, the tokens of the embedding before it); a refused chat likewise. The refused
    prompt is one never embedded: llama-server would first load a like prompt from its prompt
    cache into the slot (docs/llama-server.md)."""
    fresh = "Zebras quietly graze near seven tall acacia trees at dawn on the plain"
    requests = [
        ("/v1/embeddings", {"input": TEXTS[0]}),
        ("/completion", {"prompt": fresh, "n_predict": 3}),
    ]
    moved = assert_tasks_counted_alike(bert_pair, requests, [200, 500])
    assert moved["llamacpp:n_decode_total"] == 1 and moved["llamacpp:tokens_predicted_total"] == 0
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    moved = assert_tasks_counted_alike(bert_pair, [("/v1/chat/completions", chat)], [500])
    assert set(moved.values()) == {0}


def test_several_slots_from_64_tokens_are_llama_servers_batch(
    bert_slots_pair: Pair, bert_pair: Pair, minilm_f16: tuple[Path, Path], tmp_path: Path
) -> None:
    """``-np 4 -kvu`` (mean, the GGUF's pooling) on a fresh server, four inputs of 133 tokens
    in one request: llama-server gives them slots 3, 2, 1 and 0 and evaluates them in one
    micro-batch in slot order, through the tiled attention over the whole of it, so every
    vector moves from the input's alone (``-np 1``; docs/modules/embeddings.md, "Several
    slots"). bankml evaluates that micro-batch as llama-server does: every vector equal bit
    for bit, the receipt names the batch in its order, and a replay computes it again. In the
    next request the first input takes slot 2, which held the same text (prompt similarity);
    launching it clears the idle slots (``-kvu`` with --cache-idle-slots, the default), so
    the others take slots 0 and 1, the least recently used: the batch is inputs 1, 2, 0."""
    texts = ["Hello world", "The quick brown fox jumps over the lazy dog. " * 4, "a b c"]
    body = {"input": [*texts, "zz " * 40], "embd_normalize": -1}
    (s1, ours, raw), (s2, theirs, _) = (
        post(p, "/v1/embeddings", body) for p in bert_slots_pair.ports
    )
    alone = post(bert_pair.ports[1], "/v1/embeddings", body)  # llama-server -np 1
    assert s1 == s2 == alone[0] == 200
    mine = [f32(d["embedding"]) for d in ours["data"]]
    for a, b in zip(mine, theirs["data"], strict=True):
        assert numpy.array_equal(a, f32(b["embedding"]))
    rel = [
        float(numpy.linalg.norm(a - f32(b["embedding"])) / numpy.linalg.norm(a))
        for a, b in zip(mine, alone[1]["data"], strict=True)
    ]
    assert 0 < rel[3] < 1e-6, rel  # first in the batch, its states its own: the pooling only
    assert all(1e-5 < r < 1e-2 for r in rel[:3]), rel  # measured 6.8e-4, 5.9e-4, 7.3e-4
    receipt = ours["bankml_receipt"]
    assert receipt["evaluated_together"] == [[3, 2, 1, 0]]
    assert receipt["pooled_together"] == [[0, 1, 2, 3]]
    key = json.loads(call(bert_slots_pair.ports[0], "GET", "/bankml/key")[2])["public_key"]
    replay = ("--replay", str(minilm_f16[0]), "--fork", str(minilm_f16[1]))
    code, out = check_receipt_cli(tmp_path, json.dumps(body).encode(), raw, key, *replay)
    assert code == 0 and "replay: identical: 4 vectors" in out, out

    again = {"content": [texts[1], "zz " * 40, texts[0]]}  # llama-server's route, normalised
    (s1, ours, _), (s2, theirs, _) = (post(p, "/embedding", again) for p in bert_slots_pair.ports)
    assert s1 == s2 == 200
    for a, b in zip(ours, theirs, strict=True):
        assert a["index"] == b["index"]
        assert numpy.array_equal(f32(a["embedding"]), f32(b["embedding"]))
    assert ours[0]["bankml_receipt"]["evaluated_together"] == [[1, 2, 0]]


def test_several_slots_mean_under_64_tokens_is_llama_servers_batch(
    bert_slots_pair: Pair, minilm_f16: tuple[Path, Path], tmp_path: Path
) -> None:
    """``-np 4 -kvu`` on the encoder, six inputs: four in one micro-batch under 64 tokens
    (each input's hidden states its own, the mean pooled by tinyBLAS's lanes over the batch),
    then two more together in the next update. bankml answers llama-server's bits, and its
    receipt names the groups, so that a replay pools them alike."""
    texts = ["Hello world", "a b c", "The quick brown fox", "zz zz zz", "one", "two words"]
    body = {"input": texts, "embd_normalize": -1}
    (s1, ours, raw), (s2, theirs, _) = (
        post(p, "/v1/embeddings", body) for p in bert_slots_pair.ports
    )
    assert s1 == s2 == 200
    for a, b in zip(ours["data"], theirs["data"], strict=True):
        assert numpy.array_equal(f32(a["embedding"]), f32(b["embedding"]))
    assert ours["bankml_receipt"]["pooled_together"] == [[0, 1, 2, 3], [4, 5]]
    key = json.loads(call(bert_slots_pair.ports[0], "GET", "/bankml/key")[2])["public_key"]
    replay = ("--replay", str(minilm_f16[0]), "--fork", str(minilm_f16[1]))
    code, out = check_receipt_cli(tmp_path, json.dumps(body).encode(), raw, key, *replay)
    assert code == 0 and "replay: identical: 6 vectors" in out, out


def test_pooling_none_gives_every_tokens_vector(bert_none_pair: Pair) -> None:
    body = {"content": TEXTS[1]}
    (s1, ours, _), (s2, theirs, _) = (post(p, "/embedding", body) for p in bert_none_pair.ports)
    assert s1 == s2 == 200
    a, b = f32(ours[0]["embedding"]), f32(theirs[0]["embedding"])
    assert a.shape == b.shape and a.shape[0] > 5  # [CLS] … [SEP]: one vector per token
    assert numpy.array_equal(a, b)


def test_ollama_client_embed(bert_pair: Pair) -> None:
    import ollama

    client = ollama.Client(host=f"http://127.0.0.1:{bert_pair.listen_port}")
    model = next(m.model for m in client.list().models if m.model.startswith("minilm"))
    out = client.embed(model=model, input=TEXTS)
    # Ollama's normalisation of llama-server's mean vector (taken raw: embd_normalize -1)
    _, raw_mean, _ = post(
        bert_pair.ports[1], "/v1/embeddings", {"input": TEXTS, "embd_normalize": -1}
    )
    assert len(out.embeddings) == len(raw_mean["data"]) == 3
    for got, ref in zip(out.embeddings, raw_mean["data"]):
        v = f32(ref["embedding"])
        total = numpy.float32(0)
        for x in v:
            total = numpy.float32(total + numpy.float32(x * x))
        norm = numpy.float32(1.0 / numpy.sqrt(numpy.float64(total)))
        assert numpy.array_equal(f32(got), v * norm)


def test_without_embeddings_one_slot_does_not_start(
    minilm_f16: tuple[Path, Path], llama_server_bin: Path, tmp_path: Path
) -> None:
    """llama-server aborts in its warm-up (an encoder outputs every token, its context one row
    per slot); bankml refuses to start, saying why."""
    model, fork = minilm_f16
    with pytest.raises(RuntimeError, match="exited"):
        support.LlamaServer(model, args=["-c", "512"], binary=llama_server_bin).start()
    args = ["llama-server", "-m", str(model), "--fork", str(fork), "-np", "1", "-c", "512"]
    port = ["--port", str(support.free_port()), "--listen", f"127.0.0.1:{support.free_port()}"]
    done = subprocess.run(bankml(*args, *port), capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert "llama-server aborts at startup" in done.stdout + done.stderr


def test_without_embeddings_it_serves_and_refuses_as_llama_server(bert_plain_pair: Pair) -> None:
    """With two slots llama-server starts on an encoder without --embeddings: it is healthy,
    refuses the embedding routes with its 501 and a completion with its 500."""
    assert [s for s, _ in bert_plain_pair.both("GET", "/health")] == [200, 200]
    for path, body in [
        ("/v1/embeddings", {"input": "hi"}),
        ("/completion", {"prompt": "hi", "n_predict": 1}),
    ]:
        (s1, ours), (s2, theirs) = bert_plain_pair.both("POST", path, body)
        assert s1 == s2 and s1 in (500, 501)
        assert json.loads(ours) == json.loads(theirs)


def test_bankml_serve_native_embeddings(
    bert_pair: Pair, minilm_f16: tuple[Path, Path], tmp_path: Path
) -> None:
    """``bankml serve FILE --fork F --native --embeddings``: the same vector as llama-server's."""
    model, fork = minilm_f16
    port = support.free_port()
    args = [str(model), "--fork", str(fork), "--native", "--embeddings"]
    proc = start_serve(args, port, tmp_path / "serve.log")
    try:
        body = {"input": TEXTS[1]}
        status, ours, _ = post(port, "/v1/embeddings", body)
        _, theirs, _ = post(bert_pair.ports[1], "/v1/embeddings", body)
        assert status == 200, ours
        assert numpy.array_equal(
            f32(ours["data"][0]["embedding"]), f32(theirs["data"][0]["embedding"])
        )
        assert "bankml_receipt" in ours
    finally:
        proc.terminate()
        proc.wait(30)
