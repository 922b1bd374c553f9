"""The encoder's reranker head (``Encoder.rank_scores``, ``rank_score``, ``rerank_tokens``)
against llama-server build 11434 started with ``--rerank``, bit for bit.

Two small random ``BertForSequenceClassification`` checkpoints (tests/hf_dirs.py: one label in
F16, two labels in Q8_0) are converted by ``bankml convert`` (byte-identical to the reference's
conversion: tests/test_convert.py), pass the gate, and are served by the real llama-server with
``--rerank`` and one slot (each pair alone in its batch): a pair is [CLS] query [SEP] document
[SEP], with no token types (every token is "sentence A", as llama.cpp runs BERT). For a query and several documents (a
special token's text among them, an accented one, a long one) its ``/rerank`` answer with
``top_n`` must give each document the float32 ``rank_score`` of ``rerank_tokens(query,
document)`` exactly, in its order, and count the tokens those ids count.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from bankml.convert import convert
from bankml.engine_cupy.encoder import Encoder
from bankml.gate.verify import verify
from tests import hf_dirs, support

QUERY = "What is a giant panda?"
DOCUMENTS = [
    "hi",
    "The giant panda is a bear species endemic to China.",
    "Café naïve — 東京 [SEP] [CLS] İstanbul",
    " ".join(["Bamboo makes up almost all of the panda's diet, wild or not."] * 6),
]
MODELS = {"one-label-f16": (["LABEL_0"], "f16"), "two-labels-q8_0": (["no", "yes"], "q8_0")}


@pytest.fixture(scope="module")
def rerankers(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[Encoder, Path]]:
    done: dict[str, tuple[Encoder, Path]] = {}

    def get(name: str) -> tuple[Encoder, Path]:
        if name not in done:
            labels, outtype = MODELS[name]
            root = tmp_path_factory.mktemp(name)
            source = hf_dirs.tiny_bert_dir(
                hf_dirs.minilm_dir(), root / "Tiny-reranker", labels=labels
            )
            out, fork = root / f"{name}.gguf", root / f"{name}.gguf.FORK.json"
            made = convert(str(source), str(out), str(fork), outtype=outtype, progress=False)
            assert made.architecture == "bert"
            verified = verify(out, fork)
            assert verified.guard.verdict == "play"
            done[name] = (Encoder(verified.path), out)
        return done[name]

    return get


@pytest.fixture(scope="module", params=list(MODELS))
def served(
    request: pytest.FixtureRequest,
    rerankers: Callable[[str], tuple[Encoder, Path]],
    llama_server_bin: Path,
) -> Iterator[tuple[Encoder, str, int]]:
    """(the encoder, llama-server --rerank's URL on the same file, the number of labels)."""
    encoder, out = rerankers(request.param)
    args = ["--rerank", "-np", "1", "-c", "512"]
    with support.LlamaServer(out, args=args, binary=llama_server_bin) as server:
        yield encoder, server.url, len(MODELS[request.param][0])


def test_relevance_scores_are_llama_servers_bits(served: tuple[Encoder, str, int]) -> None:
    encoder, url, n_labels = served
    body = {"query": QUERY, "documents": DOCUMENTS, "top_n": 3}
    status, answer = support.http_json(url + "/rerank", body)
    assert status == 200
    pairs = [encoder.rerank_tokens(QUERY, d) for d in DOCUMENTS]
    ours = [encoder.rank_score(ids) for ids in pairs]
    assert answer["usage"]["prompt_tokens"] == sum(map(len, pairs))
    results = answer["results"]
    assert len(results) == 3
    assert [r["index"] for r in results] == sorted(range(4), key=lambda i: -ours[i])[:3]
    for r in results:
        assert np.float32(r["relevance_score"]) == np.float32(ours[r["index"]])
    scores = encoder.rank_scores(pairs[1])
    assert scores.dtype == np.float32 and scores.shape == (n_labels,) == (encoder.n_cls_out,)
    assert len(set(ours)) == len(ours)  # the head separates the documents


def test_a_pair_is_cls_query_sep_document_sep(served: tuple[Encoder, str, int]) -> None:
    """[CLS] query [SEP] document [SEP] (the converted vocabulary adds its end token, [SEP],
    after each text, and no separator of its own), each text tokenized as llama-server's
    /tokenize does without special tokens; a special token's text in a document is text."""
    encoder, url, _ = served

    def tokens(text: str) -> list[int]:
        status, answer = support.http_json(url + "/tokenize", {"content": text})
        assert status == 200
        return list(answer["tokens"])

    ids = encoder.rerank_tokens(QUERY, DOCUMENTS[1])
    assert ids == [101, *tokens(QUERY), 102, *tokens(DOCUMENTS[1]), 102]
    ids = encoder.rerank_tokens(QUERY, DOCUMENTS[2])
    assert ids.count(102) == 2 and ids.count(101) == 1
