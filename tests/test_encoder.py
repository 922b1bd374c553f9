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

from collections.abc import Iterator
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

MODELS = ["minilm-f16", "minilm-q8_0", "tiny-bert-f16"]


@pytest.fixture(scope="module")
def minilm() -> Path:
    return hf_dirs.minilm_dir()


@pytest.fixture(scope="module", params=MODELS)
def served(
    request: pytest.FixtureRequest,
    minilm: Path,
    llama_server_bin: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Encoder, str, Path]]:
    """(the encoder on the verified file, llama-server's URL on the same file, the file)."""
    name, outtype = request.param.rsplit("-", 1)
    root = tmp_path_factory.mktemp(name)
    source = minilm if name == "minilm" else hf_dirs.tiny_bert_dir(minilm, root / "Tiny-bert")
    out, fork = root / f"{name}-{outtype}.gguf", root / f"{name}-{outtype}.gguf.FORK.json"
    done = convert(str(source), str(out), str(fork), outtype=outtype, progress=False)
    assert done.architecture == "bert"
    verified = verify(out, fork)
    assert verified.guard.verdict == "play" and verified.guard.arch == "bert"
    encoder = Encoder(verified.path)
    args = ["--embeddings", "--pooling", "none", "-c", "512"]
    with support.LlamaServer(out, args=args, binary=llama_server_bin) as server:
        yield encoder, server.url, out


def test_tokens_are_the_ones_llama_server_embeds(served: tuple[Encoder, str, Path]) -> None:
    encoder, url, _ = served
    for text in TEXTS:
        status, answer = support.http_json(
            url + "/tokenize", {"content": text, "add_special": True}
        )
        assert status == 200
        ids = encoder.tokenize(text)
        assert ids == answer["tokens"]
        assert ids[0] == 101 and ids[-1] == 102  # [CLS] … [SEP]
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
