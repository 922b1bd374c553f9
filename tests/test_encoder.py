"""bankml's BERT encoder (engine_cupy.encoder) against llama-server build 11434, bit for bit.

all-MiniLM-L6-v2 (a real sentence-transformers directory, scripts/fetch-minilm.sh) is converted by
``bankml convert`` to F16 and to Q8_0, and a small random BERT (tests/hf_dirs.py: 64 wide, 4
heads, CLS pooling) to F16; each file passes the gate (the guard, then its pin) and is served by
the real llama-server with ``--embeddings --pooling none``. For a few texts (short, punctuation
and accents, CJK, an emoji, a special token's text, one of about 120 tokens so that attention runs
its tiled kernel) llama-server's per-token vectors must equal ``Encoder.hidden_states`` of
``Encoder.tokenize``'s ids exactly (float32, every bit), and those ids must be the ones
llama-server's /tokenize gives with its special tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from bankml.convert import convert
from bankml.engine_cupy.encoder import Encoder
from bankml.engine_cupy.gguf_file import read_metadata
from bankml.gate.verify import verify
from tests import hf_dirs, support

TEXTS = [
    "Hello, World!",
    "Café naïve — 東京, ok? 🦙 [SEP] İstanbul's «straße»",
    " ".join(["The quick brown fox jumps over the lazy dog; it was 3.14 metres, wasn't it?"] * 5),
]

# tokenized only (cheap): case and accents (İ, Σ, a combining mark, a ligature), controls and
# tabs, a 120-letter word (cut into pieces: llama.cpp has no 100-character limit), a word the
# vocabulary cannot cover (the unknown token), special texts, CJK and Thai, symbols, no text
TOKENIZED = [
    *TEXTS,
    "İSTANBUL ΣΟΦΙΑ e\u0301te\u0301 ﬁne\tdone\x07ok \u200b zero-width",
    "x" * 120 + " snow☃man [UNK] [CLS][MASK]y ｆｕｌｌ สวัสดี 你好世界 ^_^ $5 ~a~ `b` @c #d",
    "",
]

MODELS = ["minilm-f16", "minilm-q8_0", "tiny-bert-f16"]


@pytest.fixture(scope="module")
def minilm() -> Path:
    return hf_dirs.minilm_dir()


@pytest.fixture(scope="module")
def models(
    minilm: Path, tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str], tuple[Encoder, Path]]:
    """MODELS[i] -> (the encoder on the verified file, the file), each converted once."""
    done: dict[str, tuple[Encoder, Path]] = {}

    def get(model: str) -> tuple[Encoder, Path]:
        if model not in done:
            name, outtype = model.rsplit("-", 1)
            root = tmp_path_factory.mktemp(name)
            source = (
                minilm if name == "minilm" else hf_dirs.tiny_bert_dir(minilm, root / "Tiny-bert")
            )
            out, fork = root / f"{model}.gguf", root / f"{model}.gguf.FORK.json"
            made = convert(str(source), str(out), str(fork), outtype=outtype, progress=False)
            assert made.architecture == "bert"
            verified = verify(out, fork)
            assert verified.guard.verdict == "play" and verified.guard.arch == "bert"
            done[model] = (Encoder(verified.path), out)
        return done[model]

    return get


ARGS = ["--embeddings", "--pooling", "none", "-c", "512"]


@pytest.fixture(scope="module", params=MODELS)
def served(
    request: pytest.FixtureRequest,
    models: Callable[[str], tuple[Encoder, Path]],
    llama_server_bin: Path,
) -> Iterator[tuple[Encoder, str, Path]]:
    """(the encoder on the verified file, llama-server's URL on the same file, the file)."""
    encoder, out = models(request.param)
    with support.LlamaServer(out, args=ARGS, binary=llama_server_bin) as server:
        yield encoder, server.url, out


def test_tokens_are_the_ones_llama_server_embeds(served: tuple[Encoder, str, Path]) -> None:
    encoder, url, _ = served
    for text in TOKENIZED:
        status, answer = support.http_json(
            url + "/tokenize", {"content": text, "add_special": True}
        )
        assert status == 200
        ids = encoder.tokenize(text)
        assert ids == answer["tokens"]
        assert ids[0] == 101 and ids[-1] == 102  # [CLS] … [SEP]
    assert encoder.tokenize("snow☃man") == [101, 100, 102]  # [CLS] [UNK] [SEP]
    assert len(encoder.tokenize("x" * 120)) > 3
    assert 100 < len(encoder.tokenize(TEXTS[-1])) < 128  # the tiled attention kernel's size


def test_hidden_states_are_llama_servers_bits(served: tuple[Encoder, str, Path]) -> None:
    """One request: with one slot, llama-server embeds each text alone in its batch."""
    encoder, url, _ = served
    status, answer = support.http_json(url + "/embedding", {"content": TEXTS})
    assert status == 200 and len(answer) == len(TEXTS)
    for text, item in zip(TEXTS, sorted(answer, key=lambda a: a["index"])):
        ref = np.array(item["embedding"], dtype=np.float32)
        ids = encoder.tokenize(text)
        ours = encoder.hidden_states(ids)
        assert ours.dtype == np.float32 and ours.shape == (len(ids), encoder.n_embd)
        assert ref.shape == ours.shape
        assert np.array_equal(ours, ref), f"{int((ours != ref).sum())} values differ for {text!r}"


def test_texts_computed_together_are_each_llama_servers_alone(
    served: tuple[Encoder, str, Path],
) -> None:
    """``hidden_states_each``: the texts' products shared (F16 with two rows or more a text,
    Q8_0 always), each text's attention its own; every text the bits llama-server gives it
    alone (one slot: one text at a time)."""
    encoder, url, _ = served
    texts = [*TEXTS, "a", "ok then"]
    status, answer = support.http_json(url + "/embedding", {"content": texts})
    assert status == 200
    assert encoder.shares_rows(2)
    together = encoder.hidden_states_each([encoder.tokenize(t) for t in texts])
    for ours, item in zip(together, sorted(answer, key=lambda a: a["index"]), strict=True):
        assert np.array_equal(ours, np.array(item["embedding"], dtype=np.float32))


def test_the_contract_reads_the_gguf(served: tuple[Encoder, str, Path]) -> None:
    encoder, _, path = served
    keys = ("bert.embedding_length", "bert.context_length", "bert.pooling_type")
    values = read_metadata(path, keys)

    def field(key: str) -> int:
        return int(values[key])  # type: ignore[call-overload]

    assert encoder.n_embd == field("bert.embedding_length")
    assert encoder.n_ctx_train == field("bert.context_length")
    assert encoder.pooling_type == field("bert.pooling_type")
    # MiniLM's 1_Pooling says mean (1), the tiny model's CLS (2)
    assert encoder.pooling_type == (1 if path.name.startswith("minilm") else 2)
    with pytest.raises(ValueError, match="no tokens"):
        encoder.hidden_states([])
    with pytest.raises(ValueError, match="positions"):
        encoder.hidden_states([101] * (encoder.n_ctx_train + 1))
    with pytest.raises(ValueError, match="vocabulary"):
        encoder.hidden_states([101, 30522, 102])


def test_texts_sharing_a_batch_are_llama_servers_bits(
    models: Callable[[str], tuple[Encoder, Path]], llama_server_bin: Path
) -> None:
    """With four slots llama-server embeds four texts in one micro-batch (here 71 tokens, so the
    tiled attention runs over all of them, each text masked from the others), in the order of
    its slots: on a fresh server each task takes the least recently used free slot, the last of
    equals (server-context.cpp get_available_slot), so text i lands in slot 3 - i and the batch
    holds them reversed. ``hidden_states_batch`` of the four in that order gives its bits."""
    encoder, out = models("minilm-f16")
    texts = [TEXTS[0], TEXTS[1], " ".join(["The lazy dog sleeps."] * 8), "Short."]
    seqs = [encoder.tokenize(t) for t in texts]
    assert sum(map(len, seqs)) >= 64
    with support.LlamaServer(out, args=[*ARGS, "-np", "4"], binary=llama_server_bin) as server:
        status, answer = support.http_json(server.url + "/embedding", {"content": texts})
    assert status == 200
    refs = [np.array(a["embedding"], np.float32) for a in sorted(answer, key=lambda a: a["index"])]
    batch = encoder.hidden_states_batch(seqs[::-1])[::-1]
    for ids, ours, ref in zip(seqs, batch, refs):
        assert ours.shape == ref.shape == (len(ids), encoder.n_embd)
        assert np.array_equal(ours, ref)
