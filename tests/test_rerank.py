"""Rerank side by side: a small random ``BertForSequenceClassification`` (tests/hf_dirs.py)
converted by ``bankml convert``, served by ``bankml llama-server --rerank`` and by the real
llama-server with the same flags. The answers of /rerank and its aliases must be llama-server's
JSON (the scores bit for bit, their order, ``top_n``, ``usage``, ``model``), bad input its
refusals; each answer's receipt holds under ``bankml check-receipt`` and replays on bankml's
encoder; P0 (``bankml serve --spawn``) passes ``--rerank`` to llama-server and signs its
answers the same way. A tiny generated qwen3 with a rank head (``cls.output``, two labels, a
rerank template), the layout of Qwen3's rerankers, is ranked as llama-server ranks it."""

from __future__ import annotations

import hashlib
import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import numpy
import pytest
from gguf import GGMLQuantizationType as T

from bankml.convert import convert
from bankml.openapi import load_description
from bankml.receipts.rerank import answer_results
from tests import hf_dirs
from tests.bankml_process import check_receipt_cli
from tests.dropin import Pair, assert_tasks_counted_alike, bankml, call, dropin_pair, start_serve
from tests.registry_support import pin_into
from tests.support import free_port
from tests.tiny_models import TinySpec, write_tiny_model

QUERY = "What is a giant panda?"
DOCUMENTS = [
    "hi",
    "The giant panda is a bear species endemic to China.",
    "Café naïve — 東京 [SEP] [CLS] İstanbul",
    "hi",  # the same score twice: equal scores keep the documents' order
    "Bamboo makes up almost all of the panda's diet.",
]


@pytest.fixture(scope="module")
def reranker(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the converted reranker, its FORK.json)."""
    root = tmp_path_factory.mktemp("reranker")
    source = hf_dirs.tiny_bert_dir(hf_dirs.minilm_dir(), root / "Tiny-reranker", labels=["yes"])
    out, fork = root / "reranker.gguf", root / "FORK.json"
    made = convert(str(source), str(out), str(fork), outtype="f16", progress=False)
    assert made.architecture == "bert"
    return out, fork


@pytest.fixture(scope="module")
def pair(
    reranker: tuple[Path, Path], llama_server_bin: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Pair]:
    log = tmp_path_factory.mktemp("pair") / "bankml.log"
    flags = ["--rerank", "-c", "128", "--metrics"]  # the tiny model's positions: 128
    yield from dropin_pair(flags, reranker[0], reranker[1], llama_server_bin, log)


@pytest.fixture(scope="module")
def slots_pair(
    reranker: tuple[Path, Path], llama_server_bin: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Pair]:
    log = tmp_path_factory.mktemp("pair") / "bankml.log"
    flags = ["--rerank", "-np", "4", "-kvu", "-c", "128"]
    yield from dropin_pair(flags, reranker[0], reranker[1], llama_server_bin, log)


def post(port: int, path: str, body: Any) -> tuple[int, Any, bytes]:
    status, _, raw = call(port, "POST", path, body)
    return status, json.loads(raw), raw


def key_of(port: int) -> str:
    return str(json.loads(call(port, "GET", "/bankml/key")[2])["public_key"])


@pytest.mark.parametrize(
    "path, body",
    [
        ("/rerank", {"query": QUERY, "documents": DOCUMENTS * 4}),  # past 16: introsort's ties
        ("/v1/rerank", {"query": QUERY, "documents": DOCUMENTS, "top_n": 2.9, "model": "m"}),
        ("/reranking", {"query": "", "documents": DOCUMENTS[:2], "top_n": 0}),
        ("/v1/reranking", {"query": QUERY, "documents": "x", "texts": [1], "top_n": 9.7}),
        # TEI's form: a bare array, the documents' texts; the receipt in its first result
        ("/rerank", {"query": QUERY, "texts": DOCUMENTS, "return_text": True, "top_n": 3}),
    ],
)
def test_answers_are_llama_servers(pair: Pair, path: str, body: Any, tmp_path: Path) -> None:
    (s1, ours, raw), (s2, theirs, _) = (post(p, path, body) for p in pair.ports)
    key = key_of(pair.ports[0])
    if body.get("texts") == [1]:  # documents not an array, texts not strings: both refuse
        assert s1 == s2 == 400 and ours == theirs
        return
    assert s1 == s2 == 200
    if "texts" in body:
        receipt = ours[0].pop("bankml_receipt")
        assert ours == theirs and len(ours) == 3 and ours[0]["text"] in DOCUMENTS
        code, out = check_receipt_cli(tmp_path, json.dumps(body).encode(), raw, key)
        assert code == 0 and receipt["api"] == "rerank", out
        return
    receipt = ours.pop("bankml_receipt")
    if "model" not in body:  # the model's name: the file's, where llama-server says its path
        assert ours["model"] == Path(theirs["model"]).name
        theirs["model"] = ours["model"]
    assert ours == theirs  # the scores as doubles of float32s, bit for bit, in llama-server's order
    assert len(ours["results"]) == min(int(body.get("top_n", 20)), len(body["documents"]))
    assert receipt["api"] == "rerank" and receipt["pooling"] == "rank"
    assert receipt["prompt_tokens"] == ours["usage"]["prompt_tokens"] > 0
    schema = {"$ref": "#/components/schemas/RerankList", **load_description()}
    jsonschema.Draft202012Validator(schema).validate({**ours, "bankml_receipt": receipt})
    code, out = check_receipt_cli(tmp_path, json.dumps(body).encode(), raw, key)
    assert code == 0, out


def test_receipt_replays_and_refuses_another_ranking(
    pair: Pair, reranker: tuple[Path, Path], tmp_path: Path
) -> None:
    body = {"query": QUERY, "documents": DOCUMENTS, "top_n": 3}
    status, answer, raw = post(pair.ports[0], "/rerank", body)
    assert status == 200 and len(answer_results(answer)) == 3
    request, key = json.dumps(body).encode(), key_of(pair.ports[0])
    replay = ("--replay", str(reranker[0]), "--fork", str(reranker[1]))
    code, out = check_receipt_cli(tmp_path, request, raw, key, *replay)
    assert code == 0 and "replay: identical: 3 results of 5 documents" in out, out
    swapped = dict(answer)
    swapped["results"] = [answer["results"][1], answer["results"][0], answer["results"][2]]
    code, out = check_receipt_cli(tmp_path, request, json.dumps(swapped).encode(), key)
    assert code != 0 and "rerank_sha256" in out, out


def test_several_slots_score_as_llama_servers_micro_batches(
    slots_pair: Pair, pair: Pair, reranker: tuple[Path, Path], tmp_path: Path
) -> None:
    """``--rerank -np 4 -kvu`` on a fresh server: llama-server scores the first four pairs on
    slots 3, 2, 1, 0 in one micro-batch of 68 tokens (the attention's tiles over all of it, the
    head over the four [CLS] rows in one product), the fifth alone in the next update; the
    scores move from the one-slot server's. bankml scores the same batches (Engine.embedding_
    batches, Encoder.rank_score_batches): the answer equal, the receipt naming the batch in its
    order, a replay identical. Then a batch of 40 tokens (the states each pair's own, the
    head over the rows together), equal too."""
    documents = ["hi", DOCUMENTS[1] + " It eats bamboo.", DOCUMENTS[2], "hi there friend"]
    body = {"query": QUERY, "documents": [*documents, DOCUMENTS[4]]}
    (s1, ours, raw), (s2, theirs, _) = (post(p, "/rerank", body) for p in slots_pair.ports)
    s3, alone, _ = post(pair.ports[1], "/rerank", body)  # llama-server -np 1
    assert s1 == s2 == s3 == 200
    receipt = ours.pop("bankml_receipt")
    assert ours["results"] == theirs["results"] and ours["usage"] == theirs["usage"]
    assert ours["results"] != alone["results"]
    assert receipt["evaluated_together"] == [[3, 2, 1, 0]]
    replay = ("--replay", str(reranker[0]), "--fork", str(reranker[1]))
    key = key_of(slots_pair.ports[0])
    code, out = check_receipt_cli(tmp_path, json.dumps(body).encode(), raw, key, *replay)
    assert code == 0 and "replay: identical: 5 results of 5 documents" in out, out
    short = {"query": "a panda?", "documents": ["hi", "bamboo", "a bear", "China"]}
    (s1, ours, _), (s2, theirs, _) = (post(p, "/rerank", short) for p in slots_pair.ports)
    assert s1 == s2 == 200 and ours["results"] == theirs["results"]
    assert len(ours["bankml_receipt"]["evaluated_together"][0]) == 4


def test_metrics_and_slots_count_rerank_tasks_as_llama_server(pair: Pair) -> None:
    """Every pair a task of its own, counted as llama-server counts it; the slot shows the
    last pair's task."""
    body = {"query": "a fox", "documents": ["the quick brown fox", "a lazy dog", "fox"]}
    moved = assert_tasks_counted_alike(pair, [("/rerank", body)])
    assert moved["llamacpp:n_decode_total"] == 3 and moved["llamacpp:tokens_predicted_total"] == 0


@pytest.mark.parametrize(
    "body",
    [
        {"documents": ["a"]},
        {"query": None, "documents": ["a"]},
        {"query": 3, "documents": ["a"]},
        {"query": "q"},
        {"query": "q", "documents": []},
        {"query": "q", "documents": ["a", 2]},
        {"query": "q", "documents": ["a", "word " * 200]},  # a pair over the context (128)
    ],
)
def test_bad_input_is_llama_servers_refusal(pair: Pair, body: Any) -> None:
    (s1, ours, _), (s2, theirs, _) = (post(p, "/rerank", body) for p in pair.ports)
    assert s1 == s2 == 400 and ours == theirs


def test_refusals_of_bankml_own(pair: Pair) -> None:
    """TEI's form with top_n 0 (an empty array, no result to carry the receipt) and a negative
    top_n (which fails inside llama-server) are refused with a 501 or 400, never computed."""
    body = {"query": "q", "texts": ["a", "b"], "top_n": 0}
    status, answer, _ = post(pair.ports[0], "/rerank", body)
    assert status == 501 and answer["error"]["type"] == "not_supported_error"
    status, answer, _ = post(
        pair.ports[0], "/rerank", {"query": "q", "documents": ["a"], "top_n": -1}
    )
    assert status == 400 and "top_n" in answer["error"]["message"]
    status, answer, _ = post(pair.ports[0], "/v1/embeddings", {"input": "a"})
    assert status == 501 and "rerank" in answer["error"]["message"]


@pytest.fixture(scope="module")
def p0_rerank(
    signing_key: Any,
    reranker: tuple[Path, Path],
    llama_server_bin: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Any:
    from tests.bankml_process import spawned_p0

    log = tmp_path_factory.mktemp("p0") / "p0.log"
    model, fork = reranker
    with spawned_p0(signing_key, model, fork, llama_server_bin, log, ["--rerank"]) as p0:
        yield p0


def test_p0_passes_rerank_and_signs_the_ranking(
    p0_rerank: Any, pair: Pair, reranker: tuple[Path, Path], tmp_path: Path
) -> None:
    cmdline = Path(f"/proc/{p0_rerank.engine_pid()}/cmdline").read_bytes().split(b"\0")
    assert b"--rerank" in cmdline
    body = {"query": QUERY, "documents": DOCUMENTS, "top_n": 4, "model": "m"}
    status, answer, raw = post(p0_rerank.port, "/v1/rerank", body)
    assert status == 200
    receipt = answer.pop("bankml_receipt")
    _, direct, _ = post(pair.ports[0], "/v1/rerank", body)  # bankml's own engine
    direct.pop("bankml_receipt")
    assert answer == direct
    assert receipt["api"] == "rerank" and receipt["engine"].startswith("llama-server")
    key = p0_rerank.get("/bankml/key")[1]["public_key"]
    replay = ("--replay", str(reranker[0]), "--fork", str(reranker[1]))
    code, out = check_receipt_cli(tmp_path, json.dumps(body).encode(), raw, key, *replay)
    assert code == 0 and "replay: identical: 4 results of 5 documents" in out, out
    status, refused, _ = post(p0_rerank.port, "/rerank", {"query": "q", "documents": []})
    assert status == 400 and "bankml_receipt" not in refused  # llama-server's refusal as it is
    body = {"query": QUERY, "texts": DOCUMENTS}
    status, tei, raw = post(p0_rerank.port, "/rerank", body)
    assert status == 200 and tei[0]["bankml_receipt"]["api"] == "rerank"
    code, out = check_receipt_cli(tmp_path, json.dumps(body).encode(), raw, key)
    assert code == 0, out


def test_rerank_flag_is_embeddings_with_rank_pooling() -> None:
    """llama-server's --rerank sets --embeddings and pooling rank where it stands: a --pooling
    after it wins (the drop-in keeps the order; bankml serve's own --rerank always ranks)."""
    from bankml.serving.llama_flags import dropin_argv, embedding_settings
    from bankml.tap import Options

    def settings(*flags: str) -> dict[str, Any]:
        options = Options()
        options.parseOptions(dropin_argv(["-m", "x.gguf", "--fork", "f", *flags])[0])
        return embedding_settings(options)

    assert settings("--pooling", "mean", "--reranking")["pooling"] == "rank"
    assert settings("--rerank", "--pooling", "mean") == {
        "enabled": True,
        "pooling": "mean",
        "embd_normalize": 2,
    }
    assert settings("--embeddings", "--pooling", "rank")["pooling"] == "rank"
    assert embedding_settings({"rerank": True, "pooling": "mean"})["pooling"] == "rank"


def test_bankml_serve_native_rerank(
    pair: Pair,
    reranker: tuple[Path, Path],
    default_model: Path,
    default_fork: Path,
    tmp_path: Path,
) -> None:
    """``bankml serve FILE --fork F --native --rerank``: llama-server's answer; on a model that
    is not a BERT reranker it does not start, saying why."""
    model, fork = reranker
    port = free_port()
    proc = start_serve(
        [str(model), "--fork", str(fork), "--native", "--rerank"], port, tmp_path / "log"
    )
    try:
        body = {"query": QUERY, "documents": DOCUMENTS, "model": "m"}
        status, ours, _ = post(port, "/v1/rerank", body)
        assert status == 200 and ours.pop("bankml_receipt")["api"] == "rerank"
        assert ours == post(pair.ports[1], "/v1/rerank", body)[1]
    finally:
        proc.terminate()
        proc.wait(30)
    args = [str(default_model), "--fork", str(default_fork), "--native", "--rerank"]
    done = subprocess.run(
        bankml("serve", *args, f"--listen=127.0.0.1:{free_port()}"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode != 0
    assert "reranks with a BERT reranker" in done.stdout + done.stderr


@pytest.fixture(scope="module")
def qwen3_reranker(
    default_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, Path]:
    """A tiny qwen3 reranker (its head F16, labels yes and no) and its FORK.json."""
    root = tmp_path_factory.mktemp("qwen3-reranker")
    model = root / "qwen3-rank.gguf"
    spec = TinySpec("qwen3", T.F16, rank_labels=("yes", "no"))
    return model, pin_into(root, write_tiny_model(model, spec, default_model, 3))


@pytest.fixture(scope="module")
def qwen3_pair(
    qwen3_reranker: tuple[Path, Path],
    llama_server_bin: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Pair]:
    """The tiny qwen3 reranker under both servers."""
    model, fork = qwen3_reranker
    log = tmp_path_factory.mktemp("qwen3-pair") / "bankml.log"
    yield from dropin_pair(
        ["--rerank", "-c", "512", "--metrics"], model, fork, llama_server_bin, log
    )


def test_a_qwen3_reranker_ranks_as_llama_server(
    qwen3_pair: Pair, qwen3_reranker: tuple[Path, Path], tmp_path: Path
) -> None:
    """The last token's normed hidden state through cls.output and the soft max: llama-server's
    scores bit for bit, its order (the tie of the two "hi"), top_n, usage; counted as its tasks;
    the receipt holds."""
    body = {"query": QUERY, "documents": DOCUMENTS, "top_n": 4}
    (s1, ours, raw), (s2, theirs, _) = (post(p, "/rerank", body) for p in qwen3_pair.ports)
    assert s1 == s2 == 200
    receipt = ours.pop("bankml_receipt")
    theirs["model"] = Path(theirs["model"]).name
    assert ours == theirs and len(ours["results"]) == 4
    assert 0.0 < ours["results"][0]["relevance_score"] < 1.0  # a probability: the soft max
    key = key_of(qwen3_pair.ports[0])
    code, out = check_receipt_cli(tmp_path, json.dumps(body).encode(), raw, key)
    assert code == 0 and receipt["pooling"] == "rank", out
    replay = ("--replay", str(qwen3_reranker[0]), "--fork", str(qwen3_reranker[1]))
    code, out = check_receipt_cli(tmp_path, json.dumps(body).encode(), raw, key, *replay)
    assert code == 0 and "replay: identical: 4 results of 5 documents" in out, out
    moved = assert_tasks_counted_alike(
        qwen3_pair, [("/rerank", {"query": "a", "documents": ["b", "c"]})]
    )
    assert moved["llamacpp:n_decode_total"] == 2


def test_a_qwen3_reranker_on_several_slots_scores_as_llama_servers_micro_batch(
    qwen3_pair: Pair,
    qwen3_reranker: tuple[Path, Path],
    llama_server_bin: Path,
    tmp_path_factory: pytest.TempPathFactory,
    tmp_path: Path,
) -> None:
    """``--rerank -np 4 -kvu`` on a fresh server: the first four pairs (183 tokens) go on slots
    3, 2, 1, 0 into one micro-batch from cell 0 of the emptied shared cache, through the tiled
    attention, the F16 products over all its rows and the head over the four last rows in
    one product; the fifth alone next. The scores move from the one-slot server's; bankml's
    are llama-server's, its receipt names the batch in its order, and a replay is identical."""
    model, fork = qwen3_reranker
    log = tmp_path_factory.mktemp("qwen3-slots") / "bankml.log"
    body = {"query": QUERY, "documents": DOCUMENTS}
    flags = ["--rerank", "-np", "4", "-kvu", "-c", "512"]
    for slots in dropin_pair(flags, model, fork, llama_server_bin, log):
        (s1, ours, raw), (s2, theirs, _) = (post(p, "/rerank", body) for p in slots.ports)
        key = key_of(slots.ports[0])
    s3, alone, _ = post(qwen3_pair.ports[1], "/rerank", body)  # llama-server -np 1
    assert s1 == s2 == s3 == 200
    receipt = ours.pop("bankml_receipt")
    assert ours["results"] == theirs["results"] != alone["results"]
    assert receipt["evaluated_together"] == [[3, 2, 1, 0]]
    replay = ("--replay", str(model), "--fork", str(fork))
    code, out = check_receipt_cli(tmp_path, json.dumps(body).encode(), raw, key, *replay)
    assert code == 0 and "replay: identical: 5 results of 5 documents" in out, out


def test_a_qwen3_reranker_scores_around_the_cells_idle_slots_keep_as_llama_server(
    qwen3_reranker: tuple[Path, Path],
    llama_server_bin: Path,
    tmp_path_factory: pytest.TempPathFactory,
    tmp_path: Path,
) -> None:
    """``--rerank -np 4 -kvu --no-cache-idle-slots``: the idle slots keep their pairs' cells,
    so the next request's pairs take the cells left free (embeddings.md, "Where the other
    slots keep their cells"). Every score is llama-server's, the receipt names the cells where
    they are not the batch's from cell 0 (the second request's pair of 114 tokens, the third's
    one pair of 70, each split round the cells kept), and a replay through those cells is
    identical. (On this tiny reranker the scores at those cells are also the pairs' alone:
    tests/test_embeddings.py shows the cells moving a vector.)"""
    model, fork = qwen3_reranker
    log = tmp_path_factory.mktemp("qwen3-kept") / "bankml.log"
    flags = ["--rerank", "-np", "4", "-kvu", "-c", "512", "--no-cache-idle-slots"]
    replay = ("--replay", str(model), "--fork", str(fork))
    bodies = [
        {"query": QUERY, "documents": DOCUMENTS},
        {"query": "Where do bears live?", "documents": DOCUMENTS[1:3]},
        {
            "query": "Where does a giant panda live?",
            "documents": [f"{DOCUMENTS[1]} {DOCUMENTS[4]} It sleeps."],  # 70 tokens, alone
        },
    ]
    named = 0
    for slots in dropin_pair(flags, model, fork, llama_server_bin, log):
        key = key_of(slots.ports[0])
        for body in bodies:
            (s1, ours, raw), (s2, theirs, _) = (post(p, "/rerank", body) for p in slots.ports)
            assert s1 == s2 == 200
            receipt = ours.pop("bankml_receipt")
            assert ours["results"] == theirs["results"], body
            named += len(receipt.get("evaluated_cells", []))
            code, out = check_receipt_cli(tmp_path, json.dumps(body).encode(), raw, key, *replay)
            assert code == 0 and "replay: identical" in out, out
    assert named >= 2


def test_a_qwen3_head_of_many_labels_is_llama_servers_soft_max(
    default_model: Path, llama_server_bin: Path, tmp_path: Path
) -> None:
    """A head of 19 labels: ggml's soft max takes two groups of 8 through its vector exp and 3
    through glibc's expf; every document's score (the first label's value, soft-maxed over all
    19) is llama-server's, the pairs computed together as each alone."""
    from bankml.engine_cupy.engine import Engine
    from bankml.engine_cupy.rank_head import rank_head
    from tests import support

    model = tmp_path / "qwen3-rank19.gguf"
    labels = tuple(f"label{i}" for i in range(19))
    write_tiny_model(model, TinySpec("qwen3", T.F16, rank_labels=labels), default_model, 5)
    with support.LlamaServer(
        model, args=["--rerank", "-c", "512"], binary=llama_server_bin
    ) as server:
        status, answer = support.http_json(
            server.url + "/rerank", {"query": QUERY, "documents": DOCUMENTS}
        )
    assert status == 200
    head = rank_head(Engine.open(model, n_ctx=512, device="cpu"))
    assert head is not None and head.n_labels == 19
    pairs = [head.rerank_tokens(QUERY, doc) for doc in DOCUMENTS]
    ours = head.rank_score_each(pairs)
    theirs = {r["index"]: r["relevance_score"] for r in answer["results"]}
    assert len(theirs) == len(DOCUMENTS)
    for i, score in enumerate(ours):
        assert score == head.rank_score(pairs[i])
        assert numpy.float32(score) == numpy.float32(theirs[i]), i


def test_with_several_models_the_body_model_chooses_the_reranker(
    pair: Pair,
    qwen3_pair: Pair,
    reranker: tuple[Path, Path],
    qwen3_reranker: tuple[Path, Path],
    tmp_path: Path,
) -> None:
    """``bankml serve BERT --native --rerank --registry DIR --max-loaded 2`` (DIR pins the qwen3
    reranker): each /rerank answer is llama-server's on the model its ``model`` names, its
    receipt naming that file; an unknown model is the chat's 404."""
    model, fork = reranker
    registry = qwen3_reranker[0].parent
    port = free_port()
    args = [str(model), "--fork", str(fork), "--native", "--rerank"]
    args += ["--registry", str(registry), "--max-loaded", "2"]
    proc = start_serve(args, port, tmp_path / "log")
    try:
        for name, file, ref in [
            ("qwen3-rank", qwen3_reranker[0], qwen3_pair),
            ("reranker", model, pair),
        ]:
            body = {"query": QUERY, "documents": DOCUMENTS, "top_n": 3, "model": name}
            status, ours, _ = post(port, "/rerank", body)
            assert status == 200, ours
            receipt = ours.pop("bankml_receipt")
            assert receipt["model_sha256"] == hashlib.sha256(file.read_bytes()).hexdigest()
            assert ours == post(ref.ports[1], "/rerank", body)[1], name
        unknown = post(port, "/rerank", {"query": "a", "documents": ["b"], "model": "nope"})
        chat = {"model": "nope", "messages": [{"role": "user", "content": "a"}]}
        assert unknown[:2] == post(port, "/v1/chat/completions", chat)[:2]
        assert unknown[0] == 404
    finally:
        proc.terminate()
        proc.wait(30)
