"""Ollama's embedding routes for every model of the registry (``bankml serve --native
--registry DIR --embeddings``, one model resident at a time): all-MiniLM-L6-v2 (a BERT,
served by the encoder engine) and a tiny generated decoder pinned beside the startup model, each
loaded by the request that names it (verified again), its vectors the real llama-server's on
that file, normalised as Ollama normalises; the startup model loaded again afterwards answers as
before; ``/api/show``'s capabilities as Ollama reads a GGUF; generate and chat on the encoder
refused with Ollama's messages; every receipt names the file that computed it."""

from __future__ import annotations

import hashlib
import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy
import ollama
import pytest
from gguf import GGMLQuantizationType as T

from bankml.convert import convert
from bankml.receipts.check import VALID, check_receipt
from bankml.receipts.keys import SigningKey, keygen
from bankml.registry.header import read_header
from tests import hf_dirs
from tests.native_server import NativeProcess, native_process
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


@pytest.fixture(scope="module")
def server(
    registry: Path,
    key: SigningKey,
    default_model: Path,
    default_fork: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[NativeProcess]:
    proc = native_process(default_model, default_fork, tmp_path_factory.mktemp("embed-home"))
    proc.engine_args += [
        *("--registry", str(registry)),
        *("--receipt-key", str(key.path)),
        "--embeddings",
    ]
    with proc:
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
