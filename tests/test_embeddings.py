"""Embeddings side by side: ``bankml llama-server`` and the real llama-server started with the
same ``--embeddings --pooling ...`` flags on the default model, the vectors compared bit for
bit as float32 (the official ``openai`` client and raw HTTP), the receipts checked by
``bankml check-receipt``, Ollama's /api/embed through the official ``ollama`` client, and the
refusals of bad input."""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy
import pytest

from tests.bankml_process import check_receipt_cli
from tests.dropin import Pair, assert_tasks_counted_alike, call, dropin_pair, pair_fixture
from tests.support import LlamaServer

mean_pair = pair_fixture(["--embeddings", "--pooling", "mean", "-c", "2048", "--metrics"])
last_pair = pair_fixture(["--embeddings", "--pooling", "last", "--embd-normalize", "3"])
none_pair = pair_fixture(["--embeddings", "--pooling", "none"])
# four slots, one cache: llama-server batches a request's inputs, and its cls vectors stay each
# input's own (docs/modules/embeddings.md)
slots_pair = pair_fixture(["--embeddings", "--pooling", "cls", "-np", "4", "-kvu"])
# the same with mean pooling: llama-server's vectors then depend on the batch (documented below)
kvu_mean_pair = pair_fixture(["--embeddings", "--pooling", "mean", "-np", "4", "-kvu"])
# the same flags on servers of their own: a test that follows the slots' history from the start
kvu_reuse_pair = pair_fixture(["--embeddings", "--pooling", "mean", "-np", "4", "-kvu"])
# idle slots not cleared: a batch takes the cells the other slots' inputs leave free
kvu_kept_pair = pair_fixture(
    ["--embeddings", "--pooling", "mean", "-np", "4", "-kvu", "--no-cache-idle-slots"]
)
# no host prompt cache: the idle slots keep their cells, a completion's too
kvu_cram0_pair = pair_fixture(
    ["--embeddings", "--pooling", "mean", "-np", "4", "-kvu", "-cram", "0"]
)
Q8_CACHE = ["-ctk", "q8_0", "-ctv", "q8_0"]
kvu_q8_pair = pair_fixture(["--embeddings", "--pooling", "mean", "-np", "4", "-kvu", *Q8_CACHE])
# four inputs of 31 tokens in all: one micro-batch under 64 tokens at -np 4 -kvu
SHORT_TEXTS = ["Hello world", "The quick brown fox jumps over the lazy dog.", "a b c", "zz " * 8]

TEXTS = ["Hello world", "The quick brown fox jumps over the lazy dog. " * 4]


def f32(values: Any) -> numpy.ndarray:
    return numpy.asarray(values, dtype=numpy.float64).astype(numpy.float32)


def post(port: int, path: str, body: Any) -> tuple[int, Any, bytes]:
    status, _, raw = call(port, "POST", path, body)
    return status, json.loads(raw), raw


def public_key(pair: Pair) -> str:
    status, _, raw = call(pair.ports[0], "GET", "/bankml/key")
    assert status == 200
    return str(json.loads(raw)["public_key"])


def assert_receipt_holds(pair: Pair, tmp_path: Path, body: Any, raw: bytes) -> None:
    code, out = check_receipt_cli(tmp_path, json.dumps(body).encode(), raw, public_key(pair))
    assert code == 0, out


def test_openai_client_mean_pooling_is_llama_servers_bits(mean_pair: Pair) -> None:
    from openai import OpenAI

    got = []
    for port in mean_pair.ports:
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x")
        got.append(client.embeddings.create(model="m", input=TEXTS))
    ours, theirs = got
    assert len(ours.data) == len(theirs.data) == 2
    for a, b in zip(ours.data, theirs.data):
        assert a.index == b.index
        assert numpy.array_equal(f32(a.embedding), f32(b.embedding))
    assert ours.usage.prompt_tokens == theirs.usage.prompt_tokens


def test_many_inputs_of_one_request_are_each_llama_servers_bits(mean_pair: Pair) -> None:
    """Inputs of 1 to 150 tokens in one request: bankml computes them in shared passes,
    llama-server (one slot) one after the other; every vector equal."""
    body = {
        "input": ["x", "Hello world", [1, 2, 3], "z " * 150, "a b c", TEXTS[1], "ok"],
        "embd_normalize": -1,
    }
    (s1, ours, _), (s2, theirs, _) = (post(p, "/v1/embeddings", body) for p in mean_pair.ports)
    assert s1 == s2 == 200 and len(ours["data"]) == 7
    for a, b in zip(ours["data"], theirs["data"], strict=True):
        assert numpy.array_equal(f32(a["embedding"]), f32(b["embedding"]))
    assert ours["usage"] == theirs["usage"]


def test_raw_http_base64_and_tokens_and_receipt(mean_pair: Pair, tmp_path: Path) -> None:
    body = {"input": [[1, 2, 3, 4, 5], "a b c"], "encoding_format": "base64", "embd_normalize": 0}
    (s1, ours, raw), (s2, theirs, _) = (post(p, "/v1/embeddings", body) for p in mean_pair.ports)
    assert s1 == s2 == 200
    assert [list(d) for d in ours["data"]] == [list(d) for d in theirs["data"]]
    for a, b in zip(ours["data"], theirs["data"]):
        assert base64.b64decode(a["embedding"]) == base64.b64decode(b["embedding"])
    receipt = ours["bankml_receipt"]
    assert receipt["api"] == "embeddings" and receipt["embd_normalize"] == 0
    assert receipt["embeddings_sha256"] == [
        hashlib.sha256(base64.b64decode(d["embedding"])).hexdigest() for d in ours["data"]
    ]
    assert_receipt_holds(mean_pair, tmp_path, body, raw)
    # a vector changed by one bit is refused
    changed = json.loads(raw)
    vec = bytearray(base64.b64decode(changed["data"][1]["embedding"]))
    vec[0] ^= 1
    changed["data"][1]["embedding"] = base64.b64encode(bytes(vec)).decode()
    code, out = check_receipt_cli(
        tmp_path, json.dumps(body).encode(), json.dumps(changed).encode(), public_key(mean_pair)
    )
    assert code != 0 and "vector 1" in out


def test_llama_shape_content_replay_and_completions_still_answer(
    mean_pair: Pair, tmp_path: Path, default_model: Path, default_fork: Path
) -> None:
    body = {"content": TEXTS, "embd_normalize": 1}  # taxicab
    (s1, ours, raw), (s2, theirs, _) = (post(p, "/embedding", body) for p in mean_pair.ports)
    assert s1 == s2 == 200
    assert len(ours) == len(theirs) == 2 and [r["index"] for r in ours] == [0, 1]
    for a, b in zip(ours, theirs):
        assert numpy.array_equal(f32(a["embedding"]), f32(b["embedding"]))
    replay = ("--replay", str(default_model), "--fork", str(default_fork))
    code, out = check_receipt_cli(
        tmp_path, json.dumps(body).encode(), raw, public_key(mean_pair), *replay
    )
    assert code == 0 and "replay: identical: 2 vectors" in out, out
    # llama-server with --embeddings still completes (its prompt cut in batches of -ub)
    req = {"prompt": "Once upon a time", "n_predict": 4, "temperature": 0}
    (c1, one, _), (c2, two, _) = (post(p, "/completion", req) for p in mean_pair.ports)
    assert c1 == c2 == 200 and one["content"] == two["content"]


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/embeddings", {}),
        ("/v1/embeddings", {"input": []}),
        ("/v1/embeddings", {"input": ""}),
        ("/v1/embeddings", {"input": [99999999]}),
        ("/v1/embeddings", {"input": "hi", "encoding_format": "b"}),
        ("/v1/embeddings", {"input": "hi", "encoding_format": 5}),
        ("/v1/embeddings", {"input": 5}),
        ("/v1/embeddings", {"input": [[]]}),
        ("/v1/embeddings", {"input": ["a", ""]}),
        ("/v1/embeddings", {"input": "hi", "embd_normalize": "2"}),
    ],
)
def test_bad_input_is_llama_servers_refusal(mean_pair: Pair, path: str, body: Any) -> None:
    (s1, ours, _), (s2, theirs, _) = (post(p, path, body) for p in mean_pair.ports)
    assert s1 == s2 == 400
    assert ours == theirs


def test_an_input_over_the_micro_batch_is_a_400_with_llama_servers_message(
    mean_pair: Pair,
) -> None:
    body = {"input": "hi " * 600}
    (s1, ours, _), (s2, theirs, _) = (post(p, "/v1/embeddings", body) for p in mean_pair.ports)
    assert s2 == 500  # llama-server answers it as its own error
    assert s1 == 400 and ours["error"]["message"] == theirs["error"]["message"]
    assert "too large to process" in ours["error"]["message"]


def test_a_completion_reuses_the_cells_an_embedding_left_as_llama_servers(mean_pair: Pair) -> None:
    """llama-server's slot keeps an embedding's tokens and cells until its next task: a
    completion whose prompt starts with the embedded text reuses them (``cache_n``) and
    evaluates only the rest, so its logprobs are those of that split (here 51 tokens cached,
    13 evaluated: the one-row attention, where 64 at once go through the tiled one), not of
    the prompt computed whole. bankml's slot keeps them alike: the same counts, text and
    logprobs."""
    text = "The quick brown fox jumps over the lazy dog. " * 5
    rest = " And then the dog woke up and said hello to everyone in the"
    for port in mean_pair.ports:
        assert post(port, "/embedding", {"content": text})[0] == 200
    body = {"prompt": text + rest, "n_predict": 3, "temperature": 0, "n_probs": 2}
    (s1, ours, _), (s2, theirs, _) = (post(p, "/completion", body) for p in mean_pair.ports)
    assert s1 == s2 == 200
    assert ours["timings"]["cache_n"] == theirs["timings"]["cache_n"] == 51
    assert ours["timings"]["prompt_n"] == theirs["timings"]["prompt_n"] == 13
    assert ours["content"] == theirs["content"]
    # the split decides the logprobs (-2.341 here, the prompt whole gives -2.228)
    assert_same_answer(ours, theirs)


def completions_side_by_side(pair: Pair, prompt: str) -> tuple[Any, Any]:
    """The same greedy /completion on both, its counts compared; the two answers."""
    body = {"prompt": prompt, "n_predict": 3, "temperature": 0, "n_probs": 2}
    (s1, ours, _), (s2, theirs, _) = (post(p, "/completion", body) for p in pair.ports)
    assert s1 == s2 == 200
    for key in ("cache_n", "prompt_n"):
        assert ours["timings"][key] == theirs["timings"][key], key
    return ours, theirs


def assert_same_answer(ours: Any, theirs: Any) -> None:
    assert ours["content"] == theirs["content"]
    assert logprobs(ours) == logprobs(theirs)


def logprobs(answer: Any) -> list[list[float]]:
    """Each token's logprob, then its top logprobs."""
    return [
        [p["logprob"], *(t["logprob"] for t in p["top_logprobs"])]
        for p in answer["completion_probabilities"]
    ]


def test_with_kvu_a_completion_reuses_an_embeddings_cells_as_llama_servers(
    kvu_reuse_pair: Pair,
) -> None:
    """``-np 4 -kvu``: the slots share one cache and each task's launch clears the idle slots,
    saving them to the host prompt cache. A completion that starts with an embedded text
    reuses its cells in place when it comes next (``cache_n`` 51, ``prompt_n`` 13): alone on
    an idle server, first of its batch (there with the K/V the batch computed: the batch has
    64 tokens, so the tiled attention), last of its batch (its cells after the others', the
    completion's new ones in the cells the launch frees before them, attended in that order).
    Embedded before another embedding, the input goes to the host prompt cache and a later
    completion loads it from there, after the other slot's cells, as do a batch's inputs that
    a later batch of the same request clears. Every answer llama-server's: the counts, the
    tokens, the logprobs bit for bit (the code before was 0.11 off last of a batch, 0.06
    loaded from the host cache)."""
    pair = kvu_reuse_pair
    tail = " And then the dog woke up and said hello to everyone in the"
    fox = "The quick brown fox jumps over the lazy dog. " * 5
    for port in pair.ports:
        assert post(port, "/embedding", {"content": fox})[0] == 200
    ours, theirs = completions_side_by_side(pair, fox + tail)
    assert theirs["timings"]["cache_n"] == 51
    assert_same_answer(ours, theirs)
    # a batch of four (slot 3 holds the completion: the third input takes slot 0, the batch's
    # first; 154 tokens in all), then one whose first input takes slot 3, the batch's last
    cat = "Once upon a time a small cat sat on a warm mat. " * 4
    knight = "A brave knight rode through the dark forest at night. " * 4
    for batch, text in (
        (["zz " * 40, "Hello world", cat, "a b c " * 30], cat),
        ([knight, "Hello world", "zz " * 40, "a b c " * 30], knight),
    ):
        for port in pair.ports:
            assert post(port, "/v1/embeddings", {"input": batch})[0] == 200
        ours, theirs = completions_side_by_side(pair, text + tail)
        assert theirs["timings"]["cache_n"] > 40
        assert_same_answer(ours, theirs)
    # an input embedded, then another: the first from the host prompt cache
    owl = "An old owl lived in an oak and saw many things. " * 4
    for port in pair.ports:
        for text in (owl, "Hello world"):
            assert post(port, "/embedding", {"content": text})[0] == 200
    ours, theirs = completions_side_by_side(pair, owl + tail)
    assert theirs["timings"]["cache_n"] > 40
    assert_same_answer(ours, theirs)
    # five inputs on four slots: the fifth's launch saves the first batch's other slots (the
    # one it takes loses its input) to the host prompt cache, from which each comes back
    texts = [f"Story {n}: " + "a bird flew over the hill and sang. " * 4 for n in range(4)]
    for port in pair.ports:
        assert post(port, "/v1/embeddings", {"input": [*texts, "zz " * 20]})[0] == 200
    reused = []
    for text in texts:
        ours, theirs = completions_side_by_side(pair, text + tail)
        assert_same_answer(ours, theirs)
        reused.append(theirs["timings"]["cache_n"])
    assert reused.count(0) == 1 and min(n for n in reused if n) > 30, reused


def same_vectors(pair: Pair, body: Any) -> tuple[Any, bytes]:
    """The same /v1/embeddings request on both, every vector bit for bit; bankml's answer and
    its raw body."""
    (s1, ours, raw), (s2, theirs, _) = (post(p, "/v1/embeddings", body) for p in pair.ports)
    assert s1 == s2 == 200
    for i, (x, y) in enumerate(zip(ours["data"], theirs["data"], strict=True)):
        assert numpy.array_equal(f32(x["embedding"]), f32(y["embedding"])), (body, i)
    return ours, raw


@pytest.fixture(scope="module")
def gemma3_pair(
    request: pytest.FixtureRequest,
    default_model: Path,
    llama_server_bin: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Pair, str]]:
    """A tiny gemma3 (F32, window 8, layers 0 and 2 sliding), pinned, on both servers at
    ``--embeddings --pooling POOLING`` with the slot flags (the test's parameter: the
    pooling, then the flags); the pooling; and ``check-receipt``'s replay arguments."""
    from gguf import GGMLQuantizationType as T

    from bankml.gate.verify import pin
    from tests.tiny_models import TinySpec, write_tiny_model

    pooling, slot_flags = request.param
    root = tmp_path_factory.mktemp("gemma3")
    spec = TinySpec("gemma3", T.F32, n_layer=4)
    model = write_tiny_model(root / "gemma3-swa.gguf", spec, default_model)
    pin(model, root / "FORK.json")
    flags = ["--embeddings", "--pooling", pooling, *slot_flags.split()]
    log = root / "bankml.log"
    for pair in dropin_pair(flags, model, root / "FORK.json", llama_server_bin, log):
        yield pair, pooling, ("--replay", str(model), "--fork", str(root / "FORK.json"))


GEMMA3_TEXT = "The quick brown fox jumps over the lazy dog. " * 5
GEMMA3_OTHER = "Lorem ipsum dolor sit amet, consectetur adipiscing elit. " * 4
GEMMA3_REST = " And then the dog woke up and said hello to everyone in the"


@pytest.mark.parametrize(
    "gemma3_pair",
    [("mean", "-np 4 -kvu"), ("last", "-np 4 -kvu")],
    ids=["mean", "last"],
    indirect=True,
)
def test_a_sliding_window_slot_keeps_an_embedding_as_llama_servers(
    gemma3_pair: tuple[Pair, str],
) -> None:
    """A sliding-window model's slot keeps an embedding's cells, its ring among them, so a
    completion that starts with the embedded text reuses them where the ring still holds
    the window of the shared prefix (51 tokens cached, 13 evaluated), and evaluates it whole
    where it does not (a prefix of 7 within the window of 8: llama-server's ``pos_min`` rule,
    no checkpoint). The slot's context checkpoints outlive an embedding that cannot be split
    (pooling mean): a completion after one restores the checkpoint an earlier completion
    left (14 tokens cached); pooling ``last`` erases them (none cached). Each count and text
    is llama-server's, and the logprobs where the full layers' cells are laid out alike."""
    pair, pooling, _ = gemma3_pair
    long_text, other, rest = GEMMA3_TEXT, GEMMA3_OTHER, GEMMA3_REST

    def embed_then_complete(text: str, *others: str) -> tuple[Any, Any]:
        for content in (text, *others):
            for port in pair.ports:
                assert post(port, "/embedding", {"content": content})[0] == 200
        ours, theirs = completions_side_by_side(pair, text + rest)
        assert ours["content"] == theirs["content"]
        return ours, theirs

    ours, theirs = embed_then_complete(long_text)
    assert (ours["timings"]["cache_n"], ours["timings"]["prompt_n"]) == (51, 13)
    assert_same_answer(ours, theirs)
    ours, theirs = embed_then_complete(long_text[:30], other)
    assert (ours["timings"]["cache_n"], ours["timings"]["prompt_n"]) == (0, 19)
    assert_same_answer(ours, theirs)
    ours, theirs = embed_then_complete(long_text, other)
    assert ours["timings"]["cache_n"] == (14 if pooling == "mean" else 0)
    assert_same_answer(ours, theirs)


@pytest.mark.parametrize("gemma3_pair", [("mean", "-np 1")], ids=["mean"], indirect=True)
def test_a_checkpoint_restored_after_an_embedding_holds_its_own_cells_as_llama_servers(
    gemma3_pair: tuple[Pair, str],
) -> None:
    """A completion leaves a context checkpoint; an embedding in its slot overwrites the
    positions it covers, and stays in the host prompt cache when another prompt takes the
    slot. A completion continuing the embedded text loads it back, and since the ring no
    longer holds the window of the shared prefix, restores that checkpoint (14 cached): the
    sliding layers then hold the earlier completion's K/V, as llama-server's checkpoint
    holds them, not the embedded text's. The code before read them from the slot's position
    store, the embedding's (a top logprob -78.7816 against llama-server's -78.8516)."""
    pair, _, _ = gemma3_pair
    ours, theirs = completions_side_by_side(pair, GEMMA3_TEXT[:30] + GEMMA3_REST)
    assert ours["timings"]["cache_n"] == 0
    for port in pair.ports:
        assert post(port, "/embedding", {"content": GEMMA3_TEXT})[0] == 200
    ours, theirs = completions_side_by_side(pair, GEMMA3_OTHER)
    assert ours["timings"]["cache_n"] == 0
    ours, theirs = completions_side_by_side(pair, GEMMA3_TEXT + GEMMA3_REST)
    assert (ours["timings"]["cache_n"], ours["timings"]["prompt_n"]) == (14, 50)
    assert_same_answer(ours, theirs)


# a tiny gemma3 whose idle slots keep their cells in both shared caches
kvu_kept_gemma3 = pytest.mark.parametrize(
    "gemma3_pair", [("mean", "-np 4 -kvu --no-cache-idle-slots")], ids=["mean"], indirect=True
)

GEMMA3_SENTENCES = [
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over.",
    "Lorem ipsum dolor sit amet, consectetur adipiscing elit, sed do eiusmod tempor.",
    "One two three four five six seven eight nine ten eleven twelve thirteen fourteen.",
    "Hello there, how are you doing today? I am fine, thank you very much indeed.",
]


@kvu_kept_gemma3
def test_a_sliding_window_models_batches_around_other_slots_cells_are_llama_servers(
    gemma3_pair: tuple[Pair, str, tuple[str, ...]], tmp_path: Path
) -> None:
    """``-np 4 -kvu --no-cache-idle-slots`` on a tiny gemma3: the idle slots keep their
    inputs' cells in both of llama-server's caches, the full layers' and the sliding layers'
    smaller one, where a cell out of the window of its own sequence is taken again. Five
    requests of two to four inputs, micro-batches of 52 to about 190 tokens: bankml keeps the
    book of both caches (kv_cache.IswaCells), so every batch is evaluated where llama-server's
    sits (the second request: 79 tokens in cells 19-33 and 63-126 of the full layers' cache,
    19-55 and 63-104 of the sliding layers'), and every vector is llama-server's bit for bit
    (bankml computed each input alone before: up to 6e-5 off); the receipts name the sliding
    layers' cells and replay identical."""
    pair, _, replay = gemma3_pair
    a, b, c, d = GEMMA3_SENTENCES
    requests = [
        [a, b, c, d],
        [f"{a} {b}", f"{c} {d}"],
        [f"{b} {b} {b}", a, d],
        ["hi", f"{a} {d} {c}"],
        [f"{c} " * 7, d, a, f"{b} {b}"],
    ]
    swa_apart = 0
    for texts in requests:
        body = {"input": texts}
        ours, raw = same_vectors(pair, body)
        receipt = ours["bankml_receipt"]
        for entry in receipt.get("evaluated_cells", []):
            swa_apart += entry["swa_cells"] != entry["cells"]
        code, out = check_receipt_cli(
            tmp_path, json.dumps(body).encode(), raw, public_key(pair), *replay
        )
        assert code == 0 and f"replay: identical: {len(texts)} vectors" in out, out
    assert swa_apart >= 2


@pytest.mark.parametrize(
    "gemma3_pair",
    [
        ("mean", "-np 4 -kvu --no-cache-idle-slots"),
        ("last", "-np 4 -kvu -cram 0"),
        ("mean", "-np 4 -kvu"),
    ],
    ids=["mean-kept", "last-cram0", "mean"],
    indirect=True,
)
def test_a_sliding_window_models_completions_follow_both_shared_caches_as_llama_servers(
    gemma3_pair: tuple[Pair, str, tuple[str, ...]], request: pytest.FixtureRequest
) -> None:
    """``-np 4 -kvu`` on a tiny gemma3, embeddings and completions in turn: each completion's
    micro-batches and decoded tokens take the cells llama-server's give them in both shared
    caches, round the other slots' inputs where they keep them (``--no-cache-idle-slots``,
    ``-cram 0``) or after the host prompt cache's load (the default), its full layers
    attending over the full layers' cache's cells and its sliding layers over the sliding
    layers' cache's (kv_cache.SequenceIswa): its logprobs are llama-server's bit for bit. The
    book is still known after it, so the next request's batches sit where llama-server's do
    and their vectors are llama-server's. Before, a completion on such a model gave the book up
    and, where the idle slots keep their cells, the later batches were each input alone (3e-5
    off in the first one after a completion)."""
    pair, _, _ = gemma3_pair
    flags = request.node.callspec.params["gemma3_pair"][1]
    a, b, c, d = GEMMA3_SENTENCES
    steps: list[Any] = [
        [a, b, c, d],
        GEMMA3_TEXT + GEMMA3_REST,
        [f"{c} {a}", f"{d} {b} {d}"],
        GEMMA3_TEXT + GEMMA3_REST + " morning, and",
        GEMMA3_OTHER + GEMMA3_REST,
        [f"{b} {c}", d, f"{a} {a}"],
    ]
    placed_apart = 0
    for step in steps:
        if isinstance(step, str):
            ours, theirs = completions_side_by_side(pair, step)
            assert_same_answer(ours, theirs)
            assert ours["id_slot"] == theirs["id_slot"], step
            continue
        receipt = same_vectors(pair, {"input": step})[0]["bankml_receipt"]
        # the book known after a completion: each batch evaluated together where it sits
        assert sorted(sum(receipt["evaluated_together"], [])) == list(range(len(step)))
        placed_apart += bool(receipt.get("evaluated_cells"))
    if "-cram 0" in flags or "--no-cache-idle-slots" in flags:
        assert placed_apart >= 1  # round the first completion's cells


def test_metrics_and_slots_count_embedding_tasks_as_llama_server(mean_pair: Pair) -> None:
    """Every input a task of its own: its tokens as prompt tokens, one decode, nothing
    predicted; the slot shows the last input's task."""
    requests = [("/v1/embeddings", {"input": TEXTS}), ("/embedding", {"content": "a b c"})]
    moved = assert_tasks_counted_alike(mean_pair, requests)
    assert moved["llamacpp:n_decode_total"] == 3 and moved["llamacpp:prompt_tokens_total"] > 3


def test_ollama_client_embed_and_legacy_embeddings(mean_pair: Pair, tmp_path: Path) -> None:
    import ollama

    client = ollama.Client(host=f"http://127.0.0.1:{mean_pair.listen_port}")
    model = next(m.model for m in client.list().models if m.model.startswith("smollm2"))
    assert "embedding" in (client.show(model).capabilities or [])
    out = client.embed(model=model, input=TEXTS)
    assert len(out.embeddings) == 2 and len(out.embeddings[0]) == 576
    # Ollama's normalisation of llama-server's mean vector (taken raw: embd_normalize -1)
    _, raw_mean, _ = post(
        mean_pair.ports[1], "/v1/embeddings", {"input": TEXTS, "embd_normalize": -1}
    )
    for got, ref in zip(out.embeddings, raw_mean["data"]):
        v = f32(ref["embedding"])
        total = numpy.float32(0)
        for x in v:
            total = numpy.float32(total + numpy.float32(x * x))
        norm = numpy.float32(1.0 / numpy.sqrt(numpy.float64(total)))
        assert numpy.array_equal(f32(got), v * norm)
    cut = client.embed(model=model, input="Hello", dimensions=8)
    assert len(cut.embeddings[0]) == 8
    assert abs(float(numpy.linalg.norm(f32(cut.embeddings[0]))) - 1.0) < 1e-5
    body = {"model": model, "input": "Hello"}
    status, _, raw = call(mean_pair.listen_port, "POST", "/api/embed", body)
    assert status == 200
    assert_receipt_holds(mean_pair, tmp_path, body, raw)
    legacy = {"model": model, "prompt": "Hello"}
    status, _, raw = call(mean_pair.listen_port, "POST", "/api/embeddings", legacy)
    assert status == 200 and len(json.loads(raw)["embedding"]) == 576
    assert_receipt_holds(mean_pair, tmp_path, legacy, raw)
    status, _, raw = call(
        mean_pair.listen_port, "POST", "/api/embed", {"model": "m", "input": ["a", 5]}
    )
    assert status == 400 and json.loads(raw) == {"error": "invalid input type"}
    with pytest.raises(ollama.ResponseError) as refused:
        client.embed(model="no-such-model", input="a")
    assert refused.value.status_code == 404 and "not found" in refused.value.error
    with pytest.raises(ollama.ResponseError) as refused:
        client.embed(model=model, input="a", keep_alive="soon")
    assert refused.value.status_code == 400
    assert client.embed(model=model, input="a", keep_alive=0).embeddings
    assert client.ps().models == []  # keep_alive 0: unloaded after the answer


def test_last_pooling_and_p_norm_several_inputs(last_pair: Pair, tmp_path: Path) -> None:
    body = {"input": TEXTS + ["x"]}
    (s1, ours, raw), (s2, theirs, _) = (post(p, "/v1/embeddings", body) for p in last_pair.ports)
    assert s1 == s2 == 200
    for a, b in zip(ours["data"], theirs["data"], strict=True):
        assert numpy.array_equal(f32(a["embedding"]), f32(b["embedding"]))
    assert ours["usage"] == theirs["usage"]
    assert_receipt_holds(last_pair, tmp_path, body, raw)


def test_several_slots_batched_inputs_with_cls_pooling_are_llama_servers_bits(
    slots_pair: Pair,
) -> None:
    body = {"input": [*TEXTS, "a b c"], "embd_normalize": -1}
    (s1, ours, _), (s2, theirs, _) = (post(p, "/v1/embeddings", body) for p in slots_pair.ports)
    assert s1 == s2 == 200 and len(ours["data"]) == 3
    for a, b in zip(ours["data"], theirs["data"]):
        assert numpy.array_equal(f32(a["embedding"]), f32(b["embedding"]))


def test_several_slots_from_64_tokens_are_llama_servers_batch(
    kvu_mean_pair: Pair, mean_pair: Pair, default_model: Path, default_fork: Path, tmp_path: Path
) -> None:
    """``-np 4 -kvu --pooling mean`` on a fresh server, one request of four inputs, 126 tokens:
    llama-server puts them on slots 3, 2, 1, 0 and evaluates them in one micro-batch in slot
    order, from cell 0 of the cache they share, through the tiled attention over its cells,
    so every vector moves from the input's alone (``-np 1``; docs/modules/embeddings.md,
    "Several slots"). bankml evaluates that micro-batch as llama-server does: every vector
    equal bit for bit, the receipt names the batch in its order, and a replay computes it
    again. In the next request the first input takes slot 2, which held the same text; its
    launch clears the idle slots, the cache is empty again and the others take slots 0 and 1:
    the batch is inputs 1, 2, 0, from cell 0 again."""
    texts = ["Hello world", TEXTS[1], "a b c", "zz " * 40]
    body = {"input": texts, "embd_normalize": -1}
    (s1, ours, raw), (s2, theirs, _) = (
        post(p, "/v1/embeddings", body) for p in kvu_mean_pair.ports
    )
    s3, alone, _ = post(mean_pair.ports[1], "/v1/embeddings", body)  # llama-server -np 1
    assert s1 == s2 == s3 == 200
    mine = [f32(d["embedding"]) for d in ours["data"]]
    for a, b in zip(mine, theirs["data"], strict=True):
        assert numpy.array_equal(a, f32(b["embedding"]))
    rel = [
        float(numpy.linalg.norm(a - f32(b["embedding"])) / numpy.linalg.norm(a))
        for a, b in zip(mine, alone["data"], strict=True)
    ]
    assert 0 < rel[3] < 1e-6, rel  # measured 1.6e-7: the same rows, summed in tinyBLAS's lanes
    assert all(1e-3 < r < 0.05 for r in rel[:3]), rel  # measured 0.0103, 0.0142, 0.0117
    assert ours["usage"] == theirs["usage"]
    assert ours["bankml_receipt"]["evaluated_together"] == [[3, 2, 1, 0]]
    assert ours["bankml_receipt"]["pooled_together"] == [[0, 1, 2, 3]]
    replay = ("--replay", str(default_model), "--fork", str(default_fork))
    key = public_key(kvu_mean_pair)
    code, out = check_receipt_cli(tmp_path, json.dumps(body).encode(), raw, key, *replay)
    assert code == 0 and "replay: identical: 4 vectors" in out, out

    again = {"content": [texts[1], texts[3], texts[0]]}  # llama-server's route, normalised
    (s1, ours, _), (s2, theirs, _) = (post(p, "/embedding", again) for p in kvu_mean_pair.ports)
    assert s1 == s2 == 200
    for a, b in zip(ours, theirs, strict=True):
        assert a["index"] == b["index"]
        assert numpy.array_equal(f32(a["embedding"]), f32(b["embedding"]))
    assert ours[0]["bankml_receipt"]["evaluated_together"] == [[1, 2, 0]]


def assert_cells_vectors(
    pair: Pair, reference: int, texts: list[str], tmp_path: Path, replay: tuple[str, ...]
) -> Any:
    """Embeddings of ``texts`` on both servers of ``pair``: every vector bit for bit, the first
    moved against llama-server on port ``reference`` (where the cells are not these), the
    receipt replayed identical. Returns bankml's receipt."""
    body = {"input": texts, "embd_normalize": -1}
    (s1, ours, raw), (s2, theirs, _) = (post(p, "/v1/embeddings", body) for p in pair.ports)
    s3, elsewhere, _ = post(reference, "/v1/embeddings", body)
    assert s1 == s2 == s3 == 200
    for i, (a, b) in enumerate(zip(ours["data"], theirs["data"], strict=True)):
        assert numpy.array_equal(f32(a["embedding"]), f32(b["embedding"])), (texts, i)
    first = f32(ours["data"][0]["embedding"])
    moved = numpy.linalg.norm(first - f32(elsewhere["data"][0]["embedding"]))
    assert moved / numpy.linalg.norm(first) > 1e-4, (texts, moved)
    key = public_key(pair)
    code, out = check_receipt_cli(tmp_path, json.dumps(body).encode(), raw, key, *replay)
    assert code == 0 and f"replay: identical: {len(texts)} vectors" in out, out
    return ours["bankml_receipt"]


def test_batches_around_the_cells_other_slots_keep_are_llama_servers(
    kvu_kept_pair: Pair, mean_pair: Pair, default_model: Path, default_fork: Path, tmp_path: Path
) -> None:
    """``-np 4 -kvu --no-cache-idle-slots``: an idle slot keeps its embedding's cells in the
    shared cache until its own next task, so a later input takes the cells left free, from the
    first freed (llama_kv_cache's find_slot, not contiguous), and from 64 tokens the tiled
    attention's tiles see it there. Four inputs from cell 0 (233 tokens); one of 101 tokens on
    slot 0, in the 81 cells it freed and 20 past the cells the others keep; one of 91 on slot 1
    (31 cells, then 60); then two together from cell 112. Every vector is llama-server's bit
    for bit where the inputs alone give others, the receipt names the cells, and a replay
    computes them again."""
    requests = [
        ["zz " * 40, "Hello world " * 20, "a b c " * 10, TEXTS[1] * 2],
        ["Once upon a time " * 25],
        ["An old owl " * 30],
        ["x y " * 40, "Hello"],
    ]
    replay = ("--replay", str(default_model), "--fork", str(default_fork))
    for n, texts in enumerate(requests):
        # beside llama-server -np 1, each input alone
        receipt = assert_cells_vectors(kvu_kept_pair, mean_pair.ports[1], texts, tmp_path, replay)
        if n == 1:
            assert receipt["evaluated_together"] == [[0]]
            assert receipt["evaluated_cells"] == [
                {"group": 0, "n_kv": 256, "cells": [[[0, 81], [233, 253]]]}
            ], receipt["evaluated_cells"]


def test_after_a_completion_embeddings_take_the_cells_past_its_as_llama_servers(
    kvu_cram0_pair: Pair,
    kvu_mean_pair: Pair,
    default_model: Path,
    default_fork: Path,
    tmp_path: Path,
) -> None:
    """``-np 4 -kvu -cram 0``: a completion's prompt and decoded tokens stay in its slot's
    cells, the slot idle (its last token, never decoded, takes none); a batch after it takes
    the cells past them. A completion that reuses the first one's prefix in the same slot
    takes cells from the first one it does not reuse, then past the batch's; an input after
    it takes the cells its slot frees, then the cells past the completion's. Every vector is
    llama-server's bit for bit where the same inputs from cell 0 give others, the receipt
    names the cells, and a replay computes them again."""
    pair = kvu_cram0_pair
    story = "Once upon a time a small cat sat on a warm mat. " * 3
    rounds = [
        (story, ["zz " * 40, "Hello world " * 10, "a b c " * 10]),
        (story + "The cat looked up and", ["An old owl " * 30]),
    ]
    replay = ("--replay", str(default_model), "--fork", str(default_fork))
    for n, (prompt, texts) in enumerate(rounds):
        body = {"prompt": prompt, "n_predict": 8, "temperature": 0}
        (s1, ours, _), (s2, theirs, _) = (post(p, "/completion", body) for p in pair.ports)
        assert s1 == s2 == 200 and ours["content"] == theirs["content"]
        assert ours["timings"]["cache_n"] == theirs["timings"]["cache_n"] == (0, 39)[n]
        # beside llama-server on an emptied cache (every slot idle: the launch clears them)
        receipt = assert_cells_vectors(pair, kvu_mean_pair.ports[1], texts, tmp_path, replay)
        expected = [
            {"group": 0, "n_kv": 256, "cells": [[[47, 78]], [[78, 99]], [[99, 179]]]},
            {"group": 0, "n_kv": 256, "cells": [[[47, 78], [183, 243]]]},
        ]
        assert receipt["evaluated_cells"] == [expected[n]], receipt["evaluated_cells"]


def test_a_completion_attends_over_the_cells_other_slots_keep_as_llama_servers(
    kvu_cram0_pair: Pair, kvu_mean_pair: Pair
) -> None:
    """``-np 4 -kvu -cram 0``: embeddings keep their cells in three slots; a completion of 109
    tokens in the fourth takes the cells past them, and from 64 tokens the tiled attention
    walks the cache from cell 0 in tiles, so its logprobs are llama-server's only where bankml
    attends over those cells (the same prompt on an emptied cache gives others). A short prompt
    after it takes the cells its slot freed, before the others'; the first prompt continued
    takes free cells before its own, out of position order: each answer llama-server's."""
    pair = kvu_cram0_pair
    texts = ["zz " * 40, "Hello world " * 10, "a b c " * 10]
    for port in pair.ports:
        assert post(port, "/v1/embeddings", {"input": texts})[0] == 200
    story = "Once upon a time a small cat sat on a warm mat and looked at the birds. " * 6
    prompts = [story, "Hello there my friend, how are you today?", story + " And then"]
    for n, prompt in enumerate(prompts):
        ours, theirs = completions_side_by_side(pair, prompt)
        assert_same_answer(ours, theirs)
        assert ours["id_slot"] == theirs["id_slot"]
        if n == 0:
            body = {"prompt": prompt, "n_predict": 3, "temperature": 0, "n_probs": 2}
            status, emptied, _ = post(kvu_mean_pair.ports[1], "/completion", body)
            assert status == 200
            assert abs(logprobs(emptied)[0][0] - logprobs(theirs)[0][0]) > 1e-4
    assert theirs["timings"]["cache_n"] == 109


def test_several_slots_over_a_q8_0_cache_keep_each_inputs_states(kvu_q8_pair: Pair) -> None:
    """Over a q8_0 cache ggml attends one row at a time at any micro-batch size, skipping the
    hidden cells, so a batch of 126 tokens keeps every input's hidden states on this model
    (its products row-independent) and only the ``mean`` moves (tinyBLAS's lanes over the
    batch): bankml answers llama-server's bits, the batch evaluated and pooled together."""
    body = {"input": ["Hello world", TEXTS[1], "a b c", "zz " * 40], "embd_normalize": -1}
    (s1, ours, _), (s2, theirs, _) = (post(p, "/v1/embeddings", body) for p in kvu_q8_pair.ports)
    assert s1 == s2 == 200
    for a, b in zip(ours["data"], theirs["data"], strict=True):
        assert numpy.array_equal(f32(a["embedding"]), f32(b["embedding"]))
    assert ours["bankml_receipt"]["pooled_together"] == [[0, 1, 2, 3]]
    assert ours["bankml_receipt"]["evaluated_together"] == [[3, 2, 1, 0]]


def test_several_slots_mean_under_64_tokens_is_llama_servers_batch(
    kvu_mean_pair: Pair, default_model: Path, default_fork: Path, tmp_path: Path
) -> None:
    """``-np 4 -kvu --pooling mean``, five inputs in one request: the first four go on the
    four slots and into one micro-batch of fewer than 64 tokens, where each input's hidden
    states are its own and only the pooling changes (tinyBLAS's lanes over the batch); the
    fifth waits for the next update and is pooled alone. bankml answers llama-server's bits for
    all five, on both routes, and its receipt names the group, so that a replay pools it alike
    (after the test above: a server that has answered before)."""
    texts = [*SHORT_TEXTS, "Name a colour."]
    body = {"input": texts, "embd_normalize": -1}
    (s1, ours, raw), (s2, theirs, _) = (
        post(p, "/v1/embeddings", body) for p in kvu_mean_pair.ports
    )
    assert s1 == s2 == 200
    for a, b in zip(ours["data"], theirs["data"], strict=True):
        assert numpy.array_equal(f32(a["embedding"]), f32(b["embedding"]))
    assert ours["bankml_receipt"]["pooled_together"] == [[0, 1, 2, 3]]
    replay = ("--replay", str(default_model), "--fork", str(default_fork))
    key = public_key(kvu_mean_pair)
    code, out = check_receipt_cli(tmp_path, json.dumps(body).encode(), raw, key, *replay)
    assert code == 0 and "replay: identical: 5 vectors" in out, out
    content = {"content": texts[1:4]}  # three inputs, normalised (llama-server's default)
    (s1, ours, _), (s2, theirs, _) = (post(p, "/embedding", content) for p in kvu_mean_pair.ports)
    assert s1 == s2 == 200
    for a, b in zip(ours, theirs, strict=True):
        assert numpy.array_equal(f32(a["embedding"]), f32(b["embedding"]))
        assert a["bankml_receipt"]["pooled_together"] == [[0, 1, 2]]


def tinyblas_mean(rows: numpy.ndarray, offset: int) -> numpy.ndarray:
    """ggml's mean pooling of a sequence batched with others (llamafile_sgemm's f32 tinyBLAS on
    AVX2): one 8-lane accumulator, lane = row of the micro-batch mod 8, each row one fma (here
    in double, then rounded: exact but for a double-rounding tie), then hsum's pairs."""
    w = numpy.float32(numpy.float32(1.0) / numpy.float32(rows.shape[0]))
    acc = numpy.zeros((8, rows.shape[1]), numpy.float32)
    for i, row in enumerate(rows):
        lane = (offset + i) % 8
        acc[lane] = (row.astype(numpy.float64) * float(w) + acc[lane]).astype(numpy.float32)
    pairs = [acc[i + 4] + acc[i] for i in range(4)]
    return (pairs[0] + pairs[2]) + (pairs[1] + pairs[3])


def test_llama_servers_batched_mean_is_tinyblas_lanes_of_unchanged_states(
    none_pair: Pair, default_model: Path, llama_server_bin: Path
) -> None:
    """Below 64 tokens in its micro-batch llama-server ``-np 4 -kvu`` keeps every input's hidden
    states (bankml's, taken from ``--pooling none``) and pools each by tinyBLAS's lanes at the
    input's row in the batch (the request's inputs on slots 3, 2, 1, 0, batched in slot order),
    where one input alone is the vec_dot of pooling.mean_rows (docs/modules/embeddings.md)."""
    from bankml.engine_cupy.pooling import mean_rows

    texts = SHORT_TEXTS
    status, states, _ = post(none_pair.ports[0], "/embedding", {"content": texts})
    assert status == 200
    rows = [f32(s["embedding"]) for s in sorted(states, key=lambda s: s["index"])]
    lengths = [len(r) for r in rows]
    assert sum(lengths) < 64
    offsets = [sum(lengths[i + 1 :]) for i in range(len(rows))]
    flags = ["--embeddings", "--pooling", "mean", "-np", "4", "-kvu"]
    with LlamaServer(default_model, args=flags, binary=llama_server_bin) as ref:
        body = {"input": texts, "embd_normalize": -1}
        status, theirs, _ = post(ref.port, "/v1/embeddings", body)
    assert status == 200
    got = [f32(d["embedding"]) for d in theirs["data"]]
    for r, o, g in zip(rows, offsets, got, strict=True):
        assert numpy.array_equal(tinyblas_mean(r, o), g)
    assert not all(numpy.array_equal(mean_rows(r), g) for r, g in zip(rows, got, strict=True))


def test_none_pooling_gives_every_tokens_vector(none_pair: Pair, tmp_path: Path) -> None:
    body = {"content": TEXTS}
    (s1, ours, raw), (s2, theirs, _) = (post(p, "/embeddings", body) for p in none_pair.ports)
    assert s1 == s2 == 200
    for a, b in zip(ours, theirs, strict=True):
        assert len(a["embedding"]) > 1
        assert numpy.array_equal(f32(a["embedding"]), f32(b["embedding"]))
    assert_receipt_holds(none_pair, tmp_path, body, raw)
    (s1, ours, _), (s2, theirs, _) = (
        post(p, "/v1/embeddings", {"input": "hi"}) for p in none_pair.ports
    )
    assert s1 == s2 == 400 and ours == theirs  # pooling none is not OpenAI's shape


@pytest.fixture(scope="module")
def p0_embeddings(
    signing_key: Any,
    default_model: Path,
    default_fork: Path,
    llama_server_bin: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Any:
    from tests.bankml_process import spawned_p0

    log = tmp_path_factory.mktemp("p0") / "p0.log"
    flags = ["--embeddings", "--pooling", "mean"]
    with spawned_p0(signing_key, default_model, default_fork, llama_server_bin, log, flags) as p0:
        yield p0


def test_p0_passes_the_flags_and_its_receipts_cover_the_vectors(
    p0_embeddings: Any, mean_pair: Pair, tmp_path: Path
) -> None:
    cmdline = Path(f"/proc/{p0_embeddings.engine_pid()}/cmdline").read_bytes().split(b"\0")
    assert b"--embeddings" in cmdline and cmdline[cmdline.index(b"--pooling") + 1] == b"mean"
    body = {"input": TEXTS}
    status, answer, raw = post(p0_embeddings.port, "/v1/embeddings", body)
    assert status == 200
    _, direct, _ = post(mean_pair.ports[0], "/v1/embeddings", body)  # bankml's own engine
    for a, b in zip(answer["data"], direct["data"], strict=True):
        assert numpy.array_equal(f32(a["embedding"]), f32(b["embedding"]))
    receipt = answer["bankml_receipt"]
    assert receipt["api"] == "embeddings" and receipt["engine"].startswith("llama-server")
    key = p0_embeddings.get("/bankml/key")[1]["public_key"]
    code, out = check_receipt_cli(tmp_path, json.dumps(body).encode(), raw, key)
    assert code == 0, out
    body = {"content": "Hello"}
    status, results, raw = post(p0_embeddings.port, "/embedding", body)
    assert status == 200 and "bankml_receipt" in results[0]
    code, out = check_receipt_cli(tmp_path, json.dumps(body).encode(), raw, key)
    assert code == 0, out
    status, refused, _ = post(p0_embeddings.port, "/v1/embeddings", {"input": ""})
    assert status == 400 and "bankml_receipt" not in refused  # llama-server's refusal as it is


def test_the_lanes_pooling_is_the_oracles_at_every_row_offset() -> None:
    """pooling's compiled tinyBLAS lanes (one real fma per row) against the double-precision
    oracle above, for a sequence starting at any row of its micro-batch: the sum does not
    depend on the offset; one row to more than the tiled attention's 64."""
    from bankml.engine_cupy.pooling import mean_rows, pool

    rng = numpy.random.default_rng(7)
    for n in (1, 2, 7, 8, 9, 31, 64, 65):
        rows = rng.standard_normal((n, 96)).astype(numpy.float32)
        beside = mean_rows(rows, beside_others=True)
        assert all(numpy.array_equal(beside, tinyblas_mean(rows, o)) for o in range(8))
        assert numpy.array_equal(pool(rows, "mean", beside_others=True)[0], beside)
        assert numpy.array_equal(pool(rows, "cls", beside_others=True), rows[:1])


def _slots_engine(
    n_slots: int = 4, shares: bool = True, ub: int = 512, follows: bool = False
) -> Any:
    """An Engine's slot bookkeeping alone (no model): ``follows``, a model that evaluates a
    micro-batch of several inputs (an encoder's ``hidden_states_together``)."""
    from types import SimpleNamespace

    from bankml.engine_cupy.encoder_engine import NoCache
    from bankml.engine_cupy.engine import Engine
    from bankml.engine_cupy.schedule import Slot

    engine = Engine.__new__(Engine)
    engine.slots = [Slot(i, NoCache(), 512) for i in range(n_slots)]
    engine.kv_unified, engine.n_ubatch = shares, ub
    engine.slot_prompt_similarity, engine._task_id, engine._uses = 0.1, 0, 0
    engine.clear_idle_slots = True
    engine._tracks_cells, engine.cells = False, None  # no cache: no cells to follow
    engine._cell_changes = 0
    engine.model = SimpleNamespace(follows_micro_batches=follows, rows_independent=True)
    return engine


def test_a_requests_inputs_take_the_slots_as_llama_servers_tasks() -> None:
    """Engine.embedding_batches: -np inputs at a time in request order, each to the least
    recently used idle slot (the last of equals), evaluated in slot order and released in it,
    which orders the slots for the next request."""
    engine = _slots_engine()
    inputs = [[1, 2], [3], [4, 5, 6], [7]]
    assert engine.embedding_batches(inputs).batches == [[3, 2, 1, 0]]  # a fresh server: reversed
    others = [[9], [10], [11], [12]]
    assert engine.embedding_batches(others).batches == [[0, 1, 2, 3]]  # released 0, 1, 2, 3
    # [10] takes slot 1, which embedded it (similarity); with -kvu its launch clears the idle
    # slots, so the rest go by use; without -kvu every slot keeps its input
    assert engine.embedding_batches([[10], [20], [30], [40]]).batches == [[1, 0, 2, 3]]
    engine = _slots_engine(shares=False)
    engine.embedding_batches(inputs)
    assert engine.embedding_batches([[7], [4, 5, 6], [3], [1, 2]]).batches == [[0, 1, 2, 3]]
    engine = _slots_engine()
    assert engine.embedding_batches(inputs[:2]).batches == [[1, 0]]  # slots 3 and 2
    assert engine.embedding_batches(others).batches == [[1, 0, 2, 3]]  # slots 1, 0, then 2, 3
    assert _slots_engine().embedding_batches([*inputs, [8], [9]]).batches == [[3, 2, 1, 0], [4, 5]]
    engine = _slots_engine(n_slots=1)
    assert engine.embedding_batches(inputs).batches == [[0], [1], [2], [3]]
    assert all(not slot.processing and slot.t_last_used > 0 for slot in engine.slots)


def test_the_inputs_pooled_together_follow_llama_servers_batches() -> None:
    """Engine.evaluated_together and pooled_together: the batches of two inputs or more sharing
    one micro-batch, up to one over -ub (it changes the batches after it). Where the model
    follows micro-batches, a batch is evaluated together (in its order) whenever its cells are
    known: below 64 tokens always, from 64 only with every slot idle (the cache emptied by
    --cache-idle-slots), over a q8_0 cache always. A row-independent model's states are its own
    below 64 tokens, and at any size over a q8_0 cache: pooled together there too."""
    from types import SimpleNamespace

    def groups(
        lengths: list[int], follows: bool = False, idle: bool = True, q8: bool = False, **kw: Any
    ) -> Any:
        engine = _slots_engine(follows=follows, **kw)
        if q8:
            engine.slots[0].cache = SimpleNamespace(cache_type="q8_0", truncate=lambda n: None)
        batches = engine.embedding_batches([[0] * n for n in lengths]).batches
        return (
            engine.pooled_together(batches, lengths, idle),
            engine.evaluated_together(batches, lengths, idle),
        )

    assert groups([2, 10, 3, 16]) == ([[0, 1, 2, 3]], [])
    assert groups([2, 10, 3, 16, 5]) == ([[0, 1, 2, 3]], [])  # the fifth alone: the vec_dot
    assert groups([2, 10, 3, 16, 5, 6], n_slots=2) == ([[0, 1], [2, 3], [4, 5]], [])
    assert groups([40, 20, 2, 2, 1, 1]) == ([[4, 5]], [])  # 64 tokens: the tiled attention
    assert groups([40, 20, 2, 2, 1, 1], True) == ([[0, 1, 2, 3], [4, 5]], [[3, 2, 1, 0], [4, 5]])
    assert groups([40, 20, 2, 2, 1, 1], True, idle=False) == ([[4, 5]], [[4, 5]])
    everything = ([[0, 1, 2, 3], [4, 5]], [[3, 2, 1, 0], [4, 5]])
    assert groups([40, 20, 2, 2, 1, 1], True, idle=False, q8=True) == everything
    assert groups([40, 20, 2, 2, 1, 1], q8=True) == (everything[0], [])  # the states own
    assert groups([2, 10, 3, 16], True) == ([[0, 1, 2, 3]], [[3, 2, 1, 0]])
    assert groups([10, 10, 10, 10, 1, 1], True, ub=32) == ([], [])
    assert groups([2, 3], n_slots=1) == groups([2, 3], shares=False) == ([], [])


def test_a_replay_refuses_groups_that_are_not_the_requests_inputs() -> None:
    from bankml.receipts.embedding import input_groups

    assert input_groups([[0, 1, 2], [3, 4]], 5) == {0, 1, 2, 3, 4}
    assert input_groups([], 3) == set()
    for bad in ([[0]], [[0, 5]], [[0, 1], [1, 2]], [[0, True]], [0, 1], {"0": 1}, [[0, -1]]):
        assert input_groups(bad, 5) is None, bad
