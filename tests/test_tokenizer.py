"""Oracle tests: bankml's tokenizer against the real llama-server's /tokenize and /detokenize.

Every string of a ~1,100-string corpus (ASCII, many scripts, emoji sequences, whitespace runs,
digits, contractions, special-token texts, seeded random Unicode including unassigned code points
and combining marks) is tokenized by both, with and without special parsing; the ids must be
identical, every one. The same holds for the default model's vocabulary under the other
pre-tokenizers (tiny GGUFs that reuse SmolLM2's vocabulary) and for a synthetic SentencePiece
vocabulary with byte fallback.
"""

from __future__ import annotations

import http.client
import json
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest

from bankml.engine_cupy.gguf_file import read_metadata as read_gguf_metadata
from bankml.engine_cupy.tokenizer import Tokenizer, TokenizerError, pre_tokenize
from tests import support
from tests.spm_vocab import write_bpe_variant, write_spm_model


class Oracle:
    """llama-server over one keep-alive HTTP connection (thousands of small requests)."""

    def __init__(self, url: str) -> None:
        parsed = urlparse(url)
        self.conn = http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=60)

    def post(self, path: str, body: dict[str, Any]) -> Any:
        self.conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        resp = self.conn.getresponse()
        data = resp.read()
        assert resp.status == 200, (path, body, resp.status, data[:300])
        return json.loads(data)

    def tokenize(self, text: str, parse_special: bool, add_special: bool = False) -> list[int]:
        return self.post(
            "/tokenize",
            {"content": text, "add_special": add_special, "parse_special": parse_special},
        )["tokens"]

    def detokenize(self, ids: list[int]) -> str:
        return self.post("/detokenize", {"tokens": ids})["content"]

    def close(self) -> None:
        self.conn.close()


# ------------------------------------------------------------------------------------------------
# The corpus
# ------------------------------------------------------------------------------------------------

ASCII = [
    "Hello world",
    "hello world",
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "I'm here. You're there. They've gone. She'll stay. He'd go. It's fine. Don't!",
    "I'M HERE. YOU'RE THERE. THEY'VE GONE. SHE'LL STAY. HE'D GO. IT'S FINE. DON'T!",
    "'s 't 're 've 'm 'll 'd 'S 'T 'RE 'Ve 'M 'Ll 'D",
    "rock'n'roll o'clock ma'am y'all",
    "''' '' ' 's' ",
    "def f(x):\n    return x ** 2  # square\n",
    "for (int i = 0; i < n; ++i) { a[i] += b[i]; }",
    "https://example.com/path?query=1&b=2#frag",
    "user.name+tag@example.co.uk",
    "C:\\Users\\me\\file.txt",
    '{"key": [1, 2.5, true, null], "s": "v"}',
    '<html><body class="x">Hi</body></html>',
    "$100 + 5% = ?!",
    "a+b=c; x-y<z>w^v~u|t`s",
    "...!!!???,,,;;;:::",
    "--- *** ___ ### @@@",
    "CamelCaseWord snake_case_word kebab-case-word SCREAMING_CASE",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
    "Mr. Smith went to Washington D.C. on Jan. 5th, 2024 at 3:45 p.m.",
    "e.g. i.e. etc. vs. cf.",
    "A",
    "a",
    " ",
    "  ",
    "\n",
    "\t",
    "x",
    ".",
    "'",
    "''",
    "' '",
    "0",
    "00",
    "000",
    "0000",
    "00000",
]
WHITESPACE = [
    "a  b",
    "a   b",
    "a    b",
    "   leading",
    "trailing   ",
    "\t\tindented",
    "line1\nline2",
    "line1\r\nline2",
    "\n\n\n",
    "\r\n\r\n",
    " \n \n ",
    "  \n  \t  ",
    "a\n\n\nb",
    "a \n b",
    "\t \t \t",
    "tab\there",
    "x \t\n y",
    "word\u00a0word",
    "word\u3000word",
    "word\u2028word",
    "a\u2003b",
    "a\u200bb",
    "\u0085next",
    "a\u000bb\u000cc",
    "end with space ",
    "end with newline\n",
    "end with spaces   ",
    " \r",
    "\r",
    "\r\r\n\n",
    "    def x():\n\tpass",
]
DIGITS = [
    "1234567890",
    "3.14159265358979",
    "1,000,000",
    "2024-01-05",
    "+1 (555) 123-4567",
    "0xDEADBEEF",
    "1e-10",
    "٠١٢٣٤٥٦٧٨٩",
    "۱۲۳",
    "１２３４５",
    "²³¹ ½ ¾",
    "Ⅻ ⅻ ↂ",
    "१२३४",
    "๑๒๓",
    "一二三 123 四五六",
    "12abc34def5",
    "99 bottles",
    "v1.2.3-rc4",
    "007",
    "1/2/3/4",
    "10%",
    "1,234.56€",
    "৳১২৩",
    "𝟏𝟐𝟑",
]
SCRIPTS = [
    "日本語のテキストです。",
    "中文文本，包含标点符号。",
    "한국어 텍스트입니다.",
    "ひらがな カタカナ 漢字",
    "العربية نص تجريبي",
    "مرحبا بالعالم!",
    "עברית טקסט לדוגמה",
    "שָׁלוֹם",
    "हिन्दी पाठ का उदाहरण",
    "नमस्ते दुनिया",
    "ภาษาไทยเป็นภาษาที่สวยงาม",
    "Русский текст, пример.",
    "Привет, мир!",
    "Ελληνικά κείμενο",
    "Γειά σου Κόσμε",
    "Հայերեն",
    "ქართული ენა",
    "தமிழ் மொழி",
    "বাংলা ভাষা",
    "አማርኛ",
    "Tiếng Việt có dấu",
    "Türkçe İıĞğŞş",
    "Ünïcödé àçcèntš",
    "Œuvre naïve façade",
    "Straße ß ẞ",
    "Ǆ ǅ ǆ ǈ",
    "Ꭰ Ꭱ Ꭲ",
    "ᠮᠣᠩᠭᠣᠯ",
    "ꦗꦮ",
    "𐌰𐌱𐌲",
    "Ελληνικά123ΑΒΓ",
    "mixed中文and English",
    "עבריתEnglishعربي",
    "😀 grinning",
    "日本123語",
]
EMOJI = [
    "😀😃😄😁",
    "👍👍🏻👍🏼👍🏽👍🏾👍🏿",
    "👨‍👩‍👧‍👦",
    "👩‍❤️‍💋‍👨",
    "🏳️‍🌈",
    "🏴‍☠️",
    "🇫🇷🇩🇪🇯🇵",
    "1️⃣ #️⃣ *️⃣",
    "🧑🏽‍💻 coding",
    "❤️ ♥ ❤",
    "☃️⛄",
    "🎉🎊✨",
    "👁️‍🗨️",
    "🤷‍♀️🤷🏼‍♂️",
    "text 🔥 text",
    "🦀🐍🦊",
    "🏻",
    "\u200d",
    "a\u200db",
    "\ufe0f",
    "🫠🫡🫶",
    "🪿🫎",
    "🛜",
    "🩷🩵🩶",
]
SPECIAL_TEXT = [
    "<|im_start|>",
    "<|im_end|>",
    "<|endoftext|>",
    "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n",
    "x<|im_start|>y",
    "<|im_start|><|im_end|>",
    "<|im_sta",
    "<|im_start",
    "|im_start|>",
    "<<|im_start|>>",
    "<|im_start|><|im_start|><|im_start|>",
    " <|im_end|> ",
    "<repo_name>foo<file_sep>bar",
    "<reponame>x<filename>y",
    "<jupyter_code>print(1)<jupyter_output>1",
    "<issue_start>bug<issue_comment>ok<issue_closed>",
    "<gh_stars>100",
    "<empty_output>",
    "<s></s><unk>",
    "<|endoftext|><|endoftext|>",
    "<|im_end|>\n\n<|im_start|>",
    "<start_of_turn>user\nhi<end_of_turn>",
    "<custom_tag> [MASK] <pad>",
    "<0x41><0x0A>",
]


def _random_unicode(rng: random.Random, n: int) -> str:
    """Code points from many blocks: assigned, unassigned, combining marks, private use, planes 1-3,
    and those assigned in Unicode 15.x and 16.0 (where Unicode versions differ)."""
    blocks = [
        (0x20, 0x7E),
        (0xA0, 0x24F),
        (0x300, 0x36F),
        (0x370, 0x3FF),
        (0x400, 0x52F),
        (0x590, 0x6FF),
        (0x900, 0x9FF),
        (0xE00, 0xE7F),
        (0x1100, 0x11FF),
        (0x1AB0, 0x1AFF),
        (0x2000, 0x206F),
        (0x20A0, 0x20CF),
        (0x2100, 0x23FF),
        (0x2460, 0x27BF),
        (0x2E80, 0x2FFF),
        (0x3000, 0x30FF),
        (0x31C0, 0x31EF),
        (0x4E00, 0x4E80),
        (0xA000, 0xA4CF),
        (0xAC00, 0xAC80),
        (0xD7B0, 0xD7FF),
        (0xE000, 0xE010),
        (0xF900, 0xFAFF),
        (0xFB00, 0xFDFF),
        (0xFE00, 0xFE6F),
        (0xFF00, 0xFFFD),
        (0x10000, 0x1007F),
        (0x10EC0, 0x10EFF),
        (0x11F00, 0x11F5F),
        (0x1D400, 0x1D4FF),
        (0x1E030, 0x1E08F),
        (0x1F300, 0x1FAFF),
        (0x20000, 0x20010),
        (0x2EBF0, 0x2EE60),
        (0x31350, 0x31360),
        (0xE0000, 0xE007F),
        (0x0890, 0x089F),
        (0x1CC0, 0x1CCF),
        (0x10D40, 0x10D8F),
    ]
    out = []
    for _ in range(n):
        lo, hi = rng.choice(blocks)
        out.append(chr(rng.randint(lo, hi)))
        if rng.random() < 0.15:
            out.append(rng.choice(" \n\t'0123456789"))
    return "".join(out)


def _random_ascii(rng: random.Random, n: int) -> str:
    alphabet = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 \t\n\r!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~"
    return "".join(rng.choice(alphabet) for _ in range(n))


def _mixed(rng: random.Random, pools: list[list[str]]) -> str:
    return rng.choice(["", " ", "\n", "  "]).join(
        rng.choice(rng.choice(pools)) for _ in range(rng.randint(2, 5))
    )


def corpus(seed: int = 1234, n_random: int = 900) -> list[str]:
    """The fixed strings plus seeded random ones: ASCII soup, Unicode soup, mixtures, long texts."""
    rng = random.Random(seed)
    fixed = ASCII + WHITESPACE + DIGITS + SCRIPTS + EMOJI + SPECIAL_TEXT
    texts = list(fixed)
    pools = [ASCII, WHITESPACE, DIGITS, SCRIPTS, EMOJI, SPECIAL_TEXT]
    for i in range(n_random):
        kind = i % 4
        if kind == 0:
            texts.append(_random_ascii(rng, rng.randint(1, 60)))
        elif kind == 1:
            texts.append(_random_unicode(rng, rng.randint(1, 40)))
        elif kind == 2:
            texts.append(_mixed(rng, pools))
        else:
            texts.append(
                " " * rng.randint(0, 3)
                + rng.choice(fixed)
                + rng.choice(["", " ", "  ", "\n", "'s", "123"])
            )
    texts.append(" ".join(SCRIPTS) * 3)
    texts.append(_random_unicode(rng, 1500))
    texts.append(_random_ascii(rng, 3000))
    texts.append("".join(EMOJI) * 4)
    return texts


# ------------------------------------------------------------------------------------------------
# Comparison helpers
# ------------------------------------------------------------------------------------------------


def compare_tokenize(
    tokenizer: Tokenizer, oracle: Oracle, texts: list[str], add_special: bool = False
) -> tuple[int, int, list[tuple[str, bool, list[int], list[int]]]]:
    """(identical, total, mismatches) over every text, with and without special parsing."""
    identical, total, bad = 0, 0, []
    for text in texts:
        for parse_special in (True, False):
            ours = tokenizer.tokenize(text, add_special=add_special, parse_special=parse_special)
            theirs = oracle.tokenize(text, parse_special, add_special)
            total += 1
            if ours == theirs:
                identical += 1
            else:
                bad.append((text, parse_special, ours, theirs))
    return identical, total, bad


def _report(name: str, identical: int, total: int, bad: list) -> None:
    print(f"\n{name}: {identical}/{total} identical ({100.0 * identical / total:.2f} %)")
    for text, parse_special, ours, theirs in bad[:5]:
        print(
            f"  MISMATCH parse_special={parse_special} {text!r}\n    ours   {ours}\n    theirs {theirs}"
        )


@pytest.fixture(scope="module")
def smollm(default_model: Path) -> Tokenizer:
    return Tokenizer.from_gguf(default_model)


@pytest.fixture(scope="module")
def oracle(reference_server: support.LlamaServer) -> Iterator[Oracle]:
    client = Oracle(reference_server.url)
    yield client
    client.close()


# ------------------------------------------------------------------------------------------------
# Tests without llama-server: properties llama-vocab.cpp fixes
# ------------------------------------------------------------------------------------------------


def test_vocabulary_properties(smollm: Tokenizer) -> None:
    assert smollm.n_vocab == 49152
    assert (smollm.bos_id, smollm.eos_id) == (1, 2)
    assert smollm.add_bos is False and smollm.add_eos is False
    # <|endoftext|> and <|im_end|> by name, EOS by id, <reponame> as llama-vocab's FIM-repo name
    assert smollm.eog_ids == frozenset({0, 2, 4}) and smollm.tokens[4] == "<reponame>"
    assert smollm.token_to_piece(1, special=True) == b"<|im_start|>"
    assert smollm.token_to_piece(1, special=False) == b""
    vocab = smollm.vocab_bytes()
    assert len(vocab) == smollm.n_vocab and vocab[1] == b"<|im_start|>"


def test_pre_tokenizer_splits() -> None:
    text = "I'm 12345 ok!!  \n\n  x"
    assert pre_tokenize(text, "smollm") == [
        "I",
        "'m",
        " ",
        "1",
        "2",
        "3",
        "4",
        "5",
        " ok",
        "!!",
        "  \n\n ",
        " x",
    ]
    assert pre_tokenize(text, "llama3") == [
        "I",
        "'m",
        " ",
        "123",
        "45",
        " ok",
        "!!",
        "  \n\n",
        " ",
        " x",
    ]
    assert pre_tokenize(text, "qwen2") == [
        "I",
        "'m",
        " ",
        "1",
        "2",
        "3",
        "4",
        "5",
        " ok",
        "!!",
        "  \n\n",
        " ",
        " x",
    ]
    assert pre_tokenize("IT'S", "llama3") == ["IT", "'S"] and pre_tokenize("IT'S", "gpt2") == [
        "IT",
        "'",
        "S",
    ]


def test_unknown_pre_tokenizer_is_refused(tmp_path: Path, default_model: Path) -> None:
    metadata = read_gguf_metadata(
        default_model,
        ["tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges"],
    )
    path = write_bpe_variant(
        tmp_path / "gpt2.gguf", metadata, "gpt2"
    )  # llama.cpp's name is "gpt-2"
    with pytest.raises(TokenizerError, match="unknown pre-tokenizer type: 'gpt2'"):
        Tokenizer.from_gguf(path)


def test_reader_and_path_agree(default_model: Path, smollm: Tokenizer) -> None:
    reader_metadata = read_gguf_metadata(
        default_model, ["tokenizer.ggml.merges", "tokenizer.ggml.pre"]
    )
    assert reader_metadata["tokenizer.ggml.pre"] == "smollm"
    assert len(reader_metadata["tokenizer.ggml.merges"]) == 48900  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------------
# Oracle tests
# ------------------------------------------------------------------------------------------------


def test_default_model_tokenize_matches_llama_server(smollm: Tokenizer, oracle: Oracle) -> None:
    texts = corpus(n_random=1850)
    assert len(texts) >= 2000  # 2,000 strings at least, each with and without special parsing
    start = time.perf_counter()
    identical, total, bad = compare_tokenize(smollm, oracle, texts)
    _report("SmolLM2 (smollm) /tokenize", identical, total, bad)
    print(f"  {total} comparisons in {time.perf_counter() - start:.1f} s")
    assert total >= 4000
    assert identical == total


def test_default_model_detokenize_matches_llama_server(smollm: Tokenizer, oracle: Oracle) -> None:
    rng = random.Random(99)
    id_lists = [smollm.tokenize(t, parse_special=True) for t in corpus(seed=4321, n_random=200)]
    # random ids too: lone byte tokens make invalid UTF-8, control tokens render their text
    id_lists += [
        [rng.randrange(smollm.n_vocab) for _ in range(rng.randint(1, 12))] for _ in range(150)
    ]
    theirs = [oracle.detokenize(ids) for ids in id_lists]
    identical = sum(
        smollm.pieces_bytes(ids).decode("utf-8", "replace") == text
        for ids, text in zip(id_lists, theirs)
    )
    print(f"\nSmolLM2 /detokenize: {identical}/{len(id_lists)} identical")
    assert identical == len(id_lists)
    # smollm has no space clean-up, so llama_detokenize with control texts is the same string
    assert all(
        smollm.detokenize(ids, unparse_special=True) == text for ids, text in zip(id_lists, theirs)
    )


def test_round_trip_restores_text(smollm: Tokenizer) -> None:
    for text in corpus(seed=5, n_random=100):
        ids = smollm.tokenize(text, parse_special=True)
        assert smollm.pieces_bytes(ids).decode("utf-8") == text


@pytest.fixture(scope="module")
def smollm_metadata(default_model: Path) -> dict[str, object]:
    return read_gguf_metadata(
        default_model,
        [
            "tokenizer.ggml.tokens",
            "tokenizer.ggml.token_type",
            "tokenizer.ggml.merges",
            "tokenizer.ggml.bos_token_id",
            "tokenizer.ggml.eos_token_id",
            "tokenizer.ggml.unknown_token_id",
            "tokenizer.ggml.padding_token_id",
            "tokenizer.ggml.add_bos_token",
        ],
    )


@pytest.mark.parametrize("pre", ["qwen2", "llama-bpe", "gpt-2", "default"])
def test_pre_tokenizer_variants_match_llama_server(
    pre: str, tmp_path: Path, smollm_metadata: dict[str, object], llama_server_bin: Path
) -> None:
    # llama-bpe without the add_bos flag: llama.cpp's default for it (add BOS) must apply
    path = write_bpe_variant(
        tmp_path / f"{pre}.gguf", smollm_metadata, pre, keep_add_bos=(pre != "llama-bpe")
    )
    tokenizer = Tokenizer.from_gguf(path)
    texts = corpus(seed=sum(map(ord, pre)), n_random=300)
    with support.LlamaServer(path, binary=llama_server_bin) as server:
        client = Oracle(server.url)
        identical, total, bad = compare_tokenize(
            tokenizer, client, texts, add_special=(pre == "llama-bpe")
        )
        client.close()
    _report(f"pre-tokenizer {pre} /tokenize", identical, total, bad)
    assert identical == total


@pytest.mark.parametrize("add_space_prefix", [True, False])
def test_sentencepiece_matches_llama_server(
    add_space_prefix: bool, tmp_path: Path, llama_server_bin: Path
) -> None:
    path = write_spm_model(tmp_path / "spm.gguf", add_space_prefix)
    tokenizer = Tokenizer.from_gguf(path)
    assert tokenizer.add_bos and tokenizer.bos_id == 1
    texts = corpus(seed=77, n_random=250)
    with support.LlamaServer(path, binary=llama_server_bin) as server:
        client = Oracle(server.url)
        identical, total, bad = compare_tokenize(tokenizer, client, texts, add_special=True)
        id_lists = [tokenizer.tokenize(t, parse_special=True) for t in texts[:300]]
        detok = sum(
            tokenizer.pieces_bytes(ids).decode("utf-8", "replace") == client.detokenize(ids)
            for ids in id_lists
        )
        client.close()
    _report(f"SentencePiece add_space_prefix={add_space_prefix} /tokenize", identical, total, bad)
    print(f"  /detokenize {detok}/{len(id_lists)} identical")
    assert identical == total
    assert detok == len(id_lists)


def test_open_gguf_reader_gives_the_same_tokenizer(tmp_path: Path) -> None:
    """The engine passes its open gguf.GGUFReader; the result equals reading the path."""
    import gguf

    path = write_spm_model(tmp_path / "spm.gguf", add_space_prefix=True)
    from_path, from_reader = Tokenizer.from_gguf(path), Tokenizer.from_gguf(gguf.GGUFReader(path))
    assert from_reader.tokens == from_path.tokens and from_reader.scores == from_path.scores
    assert (from_reader.add_bos, from_reader.eog_ids) == (from_path.add_bos, from_path.eog_ids)
    for text in corpus(seed=3, n_random=50):
        assert from_reader.tokenize(text, True, True) == from_path.tokenize(text, True, True)


def test_llama_detokenize_space_cleanup(tmp_path: Path, smollm_metadata: dict[str, object]) -> None:
    """llama_detokenize's clean-up (gpt-2 vocabularies): " ?" " !" " ." " ," lose the space,
    " ' " closes up, " 's" " 'm" " 're" " 've" attach while " 't" " 'd" " 'll" keep their space."""
    from bankml.engine_cupy.tokenizer import _clean_spaces

    assert (
        _clean_spaces(b"a , b . c ' d it 's you 're I 'd ok ?") == b"a, b. c'd it's you're I 'd ok?"
    )
    assert _clean_spaces(b"x ' ' y") == b"x'' y"  # the blanked byte stops a second match
    tokenizer = Tokenizer.from_gguf(
        write_bpe_variant(tmp_path / "g.gguf", smollm_metadata, "gpt-2")
    )
    assert tokenizer.clean_spaces
    ids = tokenizer.tokenize("Hello , world ! It 's")
    assert tokenizer.detokenize(ids) == "Hello, world! It's"
    assert tokenizer.pieces_bytes(ids) == b"Hello , world ! It 's"
