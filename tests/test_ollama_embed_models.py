"""Ollama's embedding routes for every model of the registry (``bankml serve --native
--registry DIR --embeddings``, one model resident at a time): all-MiniLM-L6-v2 (a BERT,
served by the encoder engine) and a tiny generated decoder pinned beside the startup model, each
loaded by the request that names it (verified again), its vectors the real llama-server's on
that file, normalised as Ollama normalises; the startup model loaded again afterwards answers as
before; ``/api/show``'s capabilities as Ollama reads a GGUF; generate and chat on the encoder
refused with Ollama's messages; every receipt names the file that computed it.

A second server over the same registry at ``--max-loaded 2 --parallel 2 --max-queue 1``: the
``model`` of ``/v1/embeddings`` (the official ``openai`` client) and of ``/embedding`` chooses
the model as a chat's does, each answer llama-server's on that file alone with a receipt naming
it; an unknown model is the chat's 404; ``/api/ps`` shows the BERT's own context (512); past the
queue's bound an embedding is 503 with Retry-After on both APIs."""

from __future__ import annotations

import hashlib
import http.client
import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy
import ollama
import openai
import pytest
from gguf import GGMLQuantizationType as T

from bankml.convert import convert
from bankml.receipts.check import VALID, check_receipt
from bankml.receipts.keys import SigningKey, keygen
from bankml.registry.header import read_header
from tests import hf_dirs
from tests.native_server import NativeProcess, native_process
from tests.native_support import wait_for
from tests.registry_support import pin_into
from tests.support import LlamaServer
from tests.tiny_models import TinySpec, write_tiny_model

TEXTS = ["Hello, World!", "The quick brown fox. " * 8]
ENCODER, DECODER = "all-minilm", "tiny-embed-llama"
PROMPT, N_PREDICT = "The capital of France is", 6


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory, default_model: Path) -> Path:
    directory = tmp_path_factory.mktemp("embed-models") / "forks"
    directory.mkdir()
    made = convert(
        str(hf_dirs.minilm_dir()),
        str(directory / f"{ENCODER}.gguf"),
        str(directory / "convert.FORK.json"),
        outtype="f16",
        progress=False,
    )
    assert made.architecture == "bert"
    (directory / "convert.FORK.json").unlink()
    pin_into(directory, directory / f"{ENCODER}.gguf")
    decoder = directory / f"{DECODER}.gguf"
    pin_into(directory, write_tiny_model(decoder, TinySpec("llama", T.F16), default_model, 5))
    return directory


@pytest.fixture(scope="module")
def key(tmp_path_factory: pytest.TempPathFactory) -> SigningKey:
    return keygen(tmp_path_factory.mktemp("embed-models-key") / "receipt-key.pem")


def _embedding_server(
    registry: Path, key: SigningKey, model: Path, fork: Path, home: Path, flags: list[str]
) -> NativeProcess:
    """A native server of the registry with --embeddings, signing receipts, and ``flags``."""
    proc = native_process(model, fork, home)
    proc.engine_args += [
        *("--registry", str(registry)),
        *("--receipt-key", str(key.path)),
        *flags,
        "--embeddings",
    ]
    return proc


@pytest.fixture(scope="module")
def server(
    registry: Path,
    key: SigningKey,
    default_model: Path,
    default_fork: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[NativeProcess]:
    home = tmp_path_factory.mktemp("embed-home")
    with _embedding_server(registry, key, default_model, default_fork, home, []) as proc:
        yield proc


def raw_vectors(model: Path, flags: list[str], binary: Path) -> list[numpy.ndarray]:
    """The real llama-server's vectors of TEXTS on ``model`` alone, not normalised."""
    with LlamaServer(model, args=["--embeddings", *flags], binary=binary) as ref:
        body = {"input": TEXTS, "embd_normalize": -1}
        _, answer = post(ref.url, "/v1/embeddings", body)
    return [
        numpy.asarray(d["embedding"], numpy.float64).astype(numpy.float32) for d in answer["data"]
    ]


def ollama_normalized(v: numpy.ndarray) -> numpy.ndarray:
    """Ollama's normalize: a float32 sum of squares in order, one float32 factor."""
    total = numpy.float32(0)
    for x in v:
        total = numpy.float32(total + numpy.float32(x * x))
    return v * numpy.float32(1.0 / numpy.sqrt(numpy.float64(total)))


def post(url: str, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    request = urllib.request.Request(
        url + path, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=600) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def embed_and_check(
    server: NativeProcess, key: SigningKey, model: str, file: Path
) -> tuple[list[list[float]], list[float]]:
    """The official client's vectors of TEXTS with ``model`` (the same as the raw answer's, whose
    receipt is valid and names ``file``) and the legacy route's of the first text."""
    client = ollama.Client(host=server.url, timeout=600)
    vectors = [list(v) for v in client.embed(model=model, input=TEXTS).embeddings]
    body = {"model": model, "input": TEXTS}
    request = urllib.request.Request(
        server.url + "/api/embed", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=600) as answer:
        raw = answer.read()
    assert check_receipt(json.dumps(body).encode(), raw, key.public_key_pem) == VALID
    receipt = json.loads(raw)["bankml_receipt"]
    assert receipt["model_sha256"] == hashlib.sha256(file.read_bytes()).hexdigest()
    assert json.loads(raw)["embeddings"] == vectors
    return vectors, list(client.embeddings(model=model, prompt=TEXTS[0]).embedding)


def assert_ollamas_vectors(
    got: tuple[list[list[float]], list[float]], ref: list[numpy.ndarray]
) -> None:
    """/api/embed: llama-server's vectors normalised as Ollama normalises; /api/embeddings: the
    first as it is."""
    vectors, legacy = got
    assert len(vectors) == len(ref)
    for ours, theirs in zip(vectors, ref):
        assert numpy.array_equal(numpy.asarray(ours, numpy.float32), ollama_normalized(theirs))
    assert numpy.array_equal(numpy.asarray(legacy, numpy.float64).astype(numpy.float32), ref[0])


def test_an_encoder_of_the_registry_embeds_as_llama_server(
    server: NativeProcess, key: SigningKey, registry: Path, llama_server_bin: Path
) -> None:
    file = registry / f"{ENCODER}.gguf"
    assert "bert.pooling_type" in read_header(file).kv  # Ollama's sign of an embedding model
    got = embed_and_check(server, key, ENCODER, file)
    client = ollama.Client(host=server.url, timeout=600)
    assert [m.model for m in client.ps().models] == [f"{ENCODER}:latest"]
    assert_ollamas_vectors(got, raw_vectors(file, ["-c", "512"], llama_server_bin))
    assert client.show(ENCODER).capabilities == ["embedding"]


def test_generate_and_chat_on_an_encoder_are_ollamas_refusals(server: NativeProcess) -> None:
    refusals = [
        ("/api/generate", {"model": ENCODER, "prompt": "hi"}, "generate"),
        ("/api/generate", {"model": ENCODER}, "generate"),  # a load
        ("/api/chat", {"model": ENCODER, "messages": [{"role": "user", "content": "hi"}]}, "chat"),
        ("/api/chat", {"model": ENCODER, "messages": []}, "chat"),
    ]
    for path, body, what in refusals:
        assert post(server.url, path, body) == (
            400,
            {"error": f'"{ENCODER}" does not support {what}'},
        ), body
    status, answer = post(server.url, "/api/generate", {"model": ENCODER, "keep_alive": 0})
    assert status == 200 and answer["done_reason"] == "unload"


def test_a_decoder_of_the_registry_embeds_and_the_startup_model_answers_again(
    server: NativeProcess,
    key: SigningKey,
    registry: Path,
    llama_server_bin: Path,
    reference_server: LlamaServer,
    default_model: Path,
) -> None:
    file = registry / f"{DECODER}.gguf"
    got = embed_and_check(server, key, DECODER, file)
    # Ollama's runner pools a model without pooling by its last token
    assert_ollamas_vectors(got, raw_vectors(file, ["--pooling", "last"], llama_server_bin))
    client = ollama.Client(host=server.url, timeout=600)
    assert client.show(DECODER).capabilities == ["completion", "embedding"]
    startup = default_model.name[: -len(".gguf")].lower()
    options = {"temperature": 0, "num_predict": N_PREDICT}
    answer = client.generate(model=startup, prompt=PROMPT, raw=True, options=options)
    body = {"prompt": PROMPT, "max_tokens": N_PREDICT, "temperature": 0}
    _, ref = post(reference_server.url, "/v1/completions", body)
    assert answer.response == ref["choices"][0]["text"]
    (resident,) = client.ps().models
    assert resident.model == f"{startup}:latest" and resident.context_length == 2048


# --- several models: the body's model chooses (--max-loaded 2) -----------------------------------


@pytest.fixture(scope="module")
def several(
    registry: Path,
    key: SigningKey,
    default_model: Path,
    default_fork: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[NativeProcess]:
    home = tmp_path_factory.mktemp("embed-several")
    flags = ["--max-loaded", "2", "--parallel", "2", "--max-queue", "1"]
    with _embedding_server(registry, key, default_model, default_fork, home, flags) as proc:
        yield proc


def sha256_of(file: Path) -> str:
    return hashlib.sha256(file.read_bytes()).hexdigest()


def test_the_body_model_chooses_the_embedding_model(
    several: NativeProcess, key: SigningKey, registry: Path, llama_server_bin: Path
) -> None:
    encoder, decoder = registry / f"{ENCODER}.gguf", registry / f"{DECODER}.gguf"
    client = openai.OpenAI(base_url=several.url + "/v1", api_key="none", timeout=600)
    got = client.embeddings.create(model=ENCODER, input=TEXTS)
    body = {"model": ENCODER, "input": TEXTS}
    status, raw = post_raw(several.url, "/v1/embeddings", body)
    assert status == 200
    assert check_receipt(json.dumps(body).encode(), raw, key.public_key_pem) == VALID
    assert json.loads(raw)["bankml_receipt"]["model_sha256"] == sha256_of(encoder)
    # two slots, as this server's: the two inputs (under 64 tokens) share one micro-batch, and
    # their mean is pooled over it (docs/modules/embeddings.md, "Several slots")
    assert json.loads(raw)["bankml_receipt"]["pooled_together"] == [[0, 1]]
    flags = ["--embeddings", "-c", "512", "-np", "2"]
    with LlamaServer(encoder, args=flags, binary=llama_server_bin) as ref:
        _, theirs = post(ref.url, "/v1/embeddings", {"input": TEXTS})
    for ours, want in zip(got.data, theirs["data"], strict=True):
        assert numpy.array_equal(
            numpy.asarray(ours.embedding, numpy.float32),
            numpy.asarray(want["embedding"], numpy.float64).astype(numpy.float32),
        )
    # /api/ps: the encoder's own context (its training context caps the server's)
    listed = {m.model: m.context_length for m in ollama.Client(host=several.url).ps().models}
    assert listed[f"{ENCODER}:latest"] == 512
    # llama-server's /embedding takes the model too: the decoder, every token's vector
    body = {"model": DECODER, "content": TEXTS[0]}
    status, raw = post_raw(several.url, "/embedding", body)
    assert status == 200
    ours_rows = json.loads(raw)[0]
    assert ours_rows["bankml_receipt"]["model_sha256"] == sha256_of(decoder)
    with LlamaServer(decoder, args=["--embeddings"], binary=llama_server_bin) as ref:
        _, theirs_rows = post(ref.url, "/embedding", {"content": TEXTS[0]})
    assert numpy.array_equal(
        numpy.asarray(ours_rows["embedding"], numpy.float64).astype(numpy.float32),
        numpy.asarray(theirs_rows[0]["embedding"], numpy.float64).astype(numpy.float32),
    )
    # an unknown model: the chat's 404, the same body
    unknown = post(several.url, "/v1/embeddings", {"model": "no-such-model", "input": "a"})
    chat = {"model": "no-such-model", "messages": [{"role": "user", "content": "a"}]}
    assert unknown == post(several.url, "/v1/chat/completions", chat)
    assert unknown[0] == 404
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="no-such-model", input="a")


def post_raw(url: str, path: str, body: dict[str, Any]) -> tuple[int, bytes]:
    request = urllib.request.Request(
        url + path, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=600) as answer:
            return answer.status, answer.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def metric(url: str, name: str) -> float:
    """One series of GET /metrics (llama-server's ``llamacpp:`` prefix)."""
    with urllib.request.urlopen(url + "/metrics", timeout=60) as answer:
        lines = answer.read().decode().splitlines()
    values = dict(line.split()[:2] for line in lines if line and not line.startswith("#"))
    return float(values[f"llamacpp:{name}"])


def test_past_the_queue_bound_an_embedding_is_503_with_retry_after(
    several: NativeProcess, default_model: Path
) -> None:
    startup = default_model.name[: -len(".gguf")].lower()
    body = {"prompt": "Count:", "n_predict": 1500, "ignore_eos": True, "stream": True}
    host, port = several.url.removeprefix("http://").split(":")
    streams = []
    for _ in range(3):  # two on the slots, one waiting: the queue's bound
        conn = http.client.HTTPConnection(host, int(port), timeout=600)
        conn.request("POST", "/completion", json.dumps(body), {"Content-Type": "application/json"})
        streams.append(conn)
        if len(streams) == 2:
            wait_for(lambda: metric(several.url, "requests_processing") == 2, "both slots busy")
    wait_for(lambda: metric(several.url, "requests_deferred") == 1, "the third to wait")
    refusals = [
        ("/embedding", {"model": startup, "content": "hi"}),
        ("/api/embed", {"model": startup, "input": "hi"}),
    ]
    for path, asked in refusals:
        request = urllib.request.Request(
            several.url + path, json.dumps(asked).encode(), {"Content-Type": "application/json"}
        )
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=600)
        assert refused.value.code == 503 and refused.value.headers["Retry-After"] == "1", path
        error = json.loads(refused.value.read())["error"]
        assert "busy" in (error if isinstance(error, str) else error["message"])
    for conn in streams:  # the clients leave: their runs end within a token
        conn.close()
    wait_for(lambda: metric(several.url, "requests_processing") == 0, "the runs to end")
    status, answer = post(several.url, "/embedding", {"model": startup, "content": "hi"})
    assert status == 200 and answer[0]["embedding"]  # pooling none: a vector per token
