"""A GGUF's tokenizer, computed as llama.cpp's llama-vocab.cpp computes it.

Three vocabulary kinds are supported:

* byte-level BPE (``tokenizer.ggml.model == "gpt2"``): special tokens are cut out first, the rest
  is split by the pre-tokenizer named in ``tokenizer.ggml.pre`` (llama.cpp's hand-written
  splitters of unicode.cpp, with its Unicode 15.1 classes), each piece is GPT-2 byte-encoded and
  merged by rank (lowest rank first, leftmost on ties).
* SentencePiece (``tokenizer.ggml.model == "llama"``): spaces become U+2581, an optional space
  prefix, pairs merged by score (highest first, leftmost on ties), byte fallback ``<0xNN>``.
* WordPiece (``tokenizer.ggml.model == "bert"``, llama.cpp's WPM): the text lowercased and its
  accents stripped as the GGUF's normalizer keys say (each code point's simple lowercase and the
  first code point of its NFD), split at whitespace and around punctuation, ASCII symbols and
  CJK ideographs, control characters dropped; each word, with the U+2581 phantom space in front,
  is cut into the longest vocabulary entries from the left (bytes), a word that cannot be cut
  whole becoming the unknown token. With special tokens added: the BOS ([CLS]) first and the
  separator ([SEP]) last, whatever the add_bos/add_eos flags say.

Everything comes from the GGUF's metadata, read with ``gguf_file``.
"""

from __future__ import annotations

import heapq
import os
import unicodedata
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from bankml.engine_cupy.gguf_file import GGUFError, metadata
from bankml.engine_cupy.unicode_classes import CLASS_CODES, build_class_table

# llama.h token attributes (llama_token_attr) and GGUF token types (llama_token_type).
ATTR_UNDEFINED = 0
ATTR_UNKNOWN = 1 << 0
ATTR_UNUSED = 1 << 1
ATTR_NORMAL = 1 << 2
ATTR_CONTROL = 1 << 3
ATTR_USER_DEFINED = 1 << 4
ATTR_BYTE = 1 << 5
TYPE_TO_ATTR = {
    0: ATTR_UNDEFINED,
    1: ATTR_NORMAL,
    2: ATTR_UNKNOWN,
    3: ATTR_CONTROL,
    4: ATTR_USER_DEFINED,
    5: ATTR_UNUSED,
    6: ATTR_BYTE,
}

SPM_SPACE = "\u2581"

# Per-code-point class indices (see unicode_classes.CLASS_CODES) and llama.cpp's \s set.
_CLASS = build_class_table()
_NUMBER, _LETTER, _PUNCT = (CLASS_CODES.index(c) for c in "NLP")
_MARK, _SYMBOL, _OTHER = (CLASS_CODES.index(c) for c in "MSC")
_WHITESPACE = frozenset(
    [chr(c) for c in range(0x09, 0x0E)]
    + [chr(c) for c in range(0x2000, 0x200B)]
    + [chr(c) for c in (0x20, 0x85, 0xA0, 0x1680, 0x2028, 0x2029, 0x202F, 0x205F, 0x3000)]
)


class TokenizerError(ValueError):
    """The GGUF's vocabulary is missing, malformed or of a kind this tokenizer does not handle."""


# ---------------------------------------------------------------------------------------------
# GPT-2 byte <-> unicode map (unicode.cpp unicode_byte_to_utf8_map)
# ---------------------------------------------------------------------------------------------


def _gpt2_byte_map() -> list[str]:
    printable = list(range(0x21, 0x7F)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    mapping: dict[int, str] = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return [mapping[b] for b in range(256)]


BYTE_TO_UNICODE: list[str] = _gpt2_byte_map()
UNICODE_TO_BYTE: dict[str, int] = {ch: b for b, ch in enumerate(BYTE_TO_UNICODE)}
_BYTE_ENCODE_TABLE = {b: ch for b, ch in enumerate(BYTE_TO_UNICODE)}


def byte_encode(text: str) -> str:
    """GPT-2's reversible byte-to-character encoding of the UTF-8 bytes of ``text``."""
    return text.encode("utf-8").decode("latin-1").translate(_BYTE_ENCODE_TABLE)


# ---------------------------------------------------------------------------------------------
# Pre-tokenizers: each stage maps a list of (start, end) spans over the text's code points to a
# finer list, exactly as unicode.cpp's custom splitters and its std::regex fallback do.
# ---------------------------------------------------------------------------------------------

Spans = list[tuple[int, int]]


class _Text:
    """Code points of a text with their classes; positions outside [lo, hi) have no flags."""

    __slots__ = ("text", "cls", "ws")

    def __init__(self, text: str) -> None:
        self.text = text
        self.cls = [_CLASS[ord(c)] for c in text]
        self.ws = [c in _WHITESPACE for c in text]


def _split_gpt2(t: _Text, spans: Spans) -> Spans:
    """'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+"""
    out: Spans = []
    text, cls, ws = t.text, t.cls, t.ws
    for lo, hi in spans:
        pos = lo

        def kind(p: int) -> int:
            # -1: outside the span (flags 0); else the class, whitespace reported separately
            return cls[p] if lo <= p < hi else -1

        def is_ws(p: int) -> bool:
            return lo <= p < hi and ws[p]

        while pos < hi:
            ch = text[pos]
            if ch == "'" and pos + 1 < hi:
                nxt = text[pos + 1]
                if nxt in "stmd":
                    out.append((pos, pos + 2))
                    pos += 2
                    continue
                if pos + 2 < hi and nxt + text[pos + 2] in ("re", "ve", "ll"):
                    out.append((pos, pos + 3))
                    pos += 3
                    continue
            probe = pos + 1 if ch == " " else pos
            k2 = kind(probe)
            start = pos
            if k2 == _LETTER or k2 == _NUMBER:
                pos = probe
                while kind(pos) == k2:
                    pos += 1
                out.append((start, pos))
                continue
            if k2 >= 0 and not is_ws(probe):
                # <space>?[^\s\p{L}\p{N}]+ (anything in range with flags that is no letter/number/space)
                pos = probe
                while kind(pos) >= 0 and kind(pos) not in (_LETTER, _NUMBER) and not is_ws(pos):
                    pos += 1
                out.append((start, pos))
                continue
            n_ws = 0
            while is_ws(pos + n_ws):
                n_ws += 1
            if n_ws > 1 and pos + n_ws < hi:
                pos += n_ws - 1
                out.append((start, pos))
                continue
            if n_ws > 0:
                pos += n_ws
                out.append((start, pos))
                continue
            pos += 1
            out.append((start, pos))
    return out


def _make_split_llama3(max_digits: int) -> Callable[[_Text, Spans], Spans]:
    """llama3 (\\p{N}{1,3}) and qwen2 (\\p{N}) system regexes, case-insensitive contractions."""

    def split(t: _Text, spans: Spans) -> Spans:
        out: Spans = []
        text, cls, ws = t.text, t.cls, t.ws
        for lo, hi in spans:
            pos = lo

            def kind(p: int) -> int:
                return cls[p] if lo <= p < hi else -1

            def is_ws(p: int) -> bool:
                return lo <= p < hi and ws[p]

            while pos < hi:
                ch = text[pos]
                k = cls[pos]
                if ch == "'" and pos + 1 < hi:
                    nxt = text[pos + 1]
                    if nxt in "sStTmMdD":
                        out.append((pos, pos + 2))
                        pos += 2
                        continue
                    if (
                        pos + 2 < hi
                        and (nxt + text[pos + 2]).lower() in ("re", "ve", "ll")
                        and (nxt + text[pos + 2]).isascii()
                    ):
                        out.append((pos, pos + 3))
                        pos += 3
                        continue
                start = pos
                # [^\r\n\p{L}\p{N}]?\p{L}+
                if not (ch == "\r" or ch == "\n" or k == _NUMBER):
                    if k == _LETTER or kind(pos + 1) == _LETTER:
                        pos += 1
                        while kind(pos) == _LETTER:
                            pos += 1
                        out.append((start, pos))
                        continue
                # \p{N}{1,max_digits}
                if k == _NUMBER:
                    run = pos
                    while kind(pos) == _NUMBER:
                        pos += 1
                        if pos - run >= max_digits:
                            out.append((run, pos))
                            run = pos
                    if pos > run:
                        out.append((run, pos))
                    continue
                # <space>?[^\s\p{L}\p{N}]+[\r\n]*  (the first test reads flags at pos, as unicode.cpp)
                probe = pos + 1 if ch == " " else pos
                k2 = kind(probe)
                if not (is_ws(probe) or k2 == _LETTER or k2 == _NUMBER):
                    pos = probe
                    while kind(pos) >= 0 and kind(pos) not in (_LETTER, _NUMBER) and not is_ws(pos):
                        pos += 1
                    while pos < hi and text[pos] in "\r\n":
                        pos += 1
                    out.append((start, pos))
                    continue
                n_ws = 0
                last_newline_end = 0
                while is_ws(pos + n_ws):
                    if text[pos + n_ws] in "\r\n":
                        last_newline_end = pos + n_ws + 1
                    n_ws += 1
                if last_newline_end > 0:
                    pos = last_newline_end
                    out.append((start, pos))
                    continue
                if n_ws > 1 and pos + n_ws < hi:
                    pos += n_ws - 1
                    out.append((start, pos))
                    continue
                if n_ws > 0:
                    pos += n_ws
                    out.append((start, pos))
                    continue
                pos += 1
                out.append((start, pos))
        return out

    return split


def _regex_stage(
    matches: Callable[[_Text, int], bool], run: bool, fixed: int = 0
) -> Callable[[_Text, Spans], Spans]:
    """unicode.cpp's std::regex fallback for a single character class: ``[class]+`` (run),
    ``[class]`` (one character) or ``[class]{fixed}``; matches and the text between them
    become spans, as unicode_regex_split_stl does."""

    def split(t: _Text, spans: Spans) -> Spans:
        out: Spans = []
        for lo, hi in spans:
            prev = lo
            pos = lo
            while pos < hi:
                if not matches(t, pos):
                    pos += 1
                    continue
                end = pos + 1
                if run:
                    while end < hi and matches(t, end):
                        end += 1
                elif fixed:
                    end = pos
                    while end < hi and end - pos < fixed and matches(t, end):
                        end += 1
                    if end - pos < fixed:
                        pos += 1
                        continue
                if pos > prev:
                    out.append((prev, pos))
                out.append((pos, end))
                prev = pos = end
            if prev < hi:
                out.append((prev, hi))
        return out

    return split


def _collapsed_class(class_index: int, ascii_members: str) -> Callable[[_Text, int], bool]:
    """A \\p{..} class in unicode.cpp's "collapsed" text: ASCII by its own list, any other
    code point by its class unless it is whitespace (collapsed to \\v)."""
    members = frozenset(ascii_members)

    def matches(t: _Text, p: int) -> bool:
        ch = t.text[p]
        if ch < "\x80":
            return ch in members
        return not t.ws[p] and t.cls[p] == class_index

    return matches


_ASCII_DIGITS = "0123456789"
_ASCII_PUNCT = "!\"#%&'()*,-./:;?@[\\]_{}"
_is_number = _collapsed_class(_NUMBER, _ASCII_DIGITS)
_is_punct_or_ops = _collapsed_class(_PUNCT, _ASCII_PUNCT + "$+<=>^~|")


def _is_ascii_digit(t: _Text, p: int) -> bool:
    return "0" <= t.text[p] <= "9"


_SPLIT_GPT2 = _split_gpt2
_SPLIT_LLAMA3 = _make_split_llama3(3)
_SPLIT_QWEN2 = _make_split_llama3(1)
_SPLIT_EACH_NUMBER = _regex_stage(_is_number, run=False)

# pre-tokenizer name -> (stages, clean_spaces, ignore_merges, add_bos default); llama-vocab.cpp
_PRE_STAGES: dict[str, tuple[Callable[[_Text, Spans], Spans], ...]] = {
    "default": (
        _regex_stage(_is_punct_or_ops, run=True),
        _SPLIT_GPT2,
        _regex_stage(_is_number, run=True),
        _regex_stage(_is_ascii_digit, run=False, fixed=3),
    ),
    "llama3": (_SPLIT_LLAMA3,),
    "gpt2": (_SPLIT_GPT2,),
    "qwen2": (_SPLIT_QWEN2,),
    "smollm": (_SPLIT_EACH_NUMBER, _SPLIT_GPT2),
}


@dataclass(frozen=True)
class _PreTokenizer:
    kind: str
    clean_spaces: bool = True
    ignore_merges: bool = False
    add_bos: bool = False


_PRE_NAMES: dict[str, _PreTokenizer] = {}
for _names, _pre in (
    (("default",), _PreTokenizer("default")),
    (
        (
            "llama3",
            "llama-v3",
            "llama-bpe",
            "falcon3",
            "falcon-h1",
            "pixtral",
            "midm-2.0",
            "lfm2",
            "jina-v5-nano",
        ),
        _PreTokenizer("llama3", ignore_merges=True, add_bos=True),
    ),
    (("dbrx", "smaug-bpe"), _PreTokenizer("llama3")),
    (
        (
            "gpt-2",
            "phi-2",
            "jina-es",
            "jina-de",
            "gigachat",
            "jina-v2-es",
            "jina-v2-de",
            "a.x-4.0",
            "mellum",
            "modern-bert",
            "exaone4",
            "mpt",
            "olmo",
            "jais",
        ),
        _PreTokenizer("gpt2"),
    ),
    (("trillion", "granite-docling"), _PreTokenizer("gpt2", clean_spaces=False)),
    (
        ("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "hunyuan"),
        _PreTokenizer("qwen2", clean_spaces=False),
    ),
    (("stablelm2", "megrez"), _PreTokenizer("qwen2")),
    (("smollm", "command-r"), _PreTokenizer("smollm", clean_spaces=False)),
    (
        ("starcoder", "refact", "codeshell", "exaone", "minerva-7b", "mellum2"),
        _PreTokenizer("smollm"),
    ),
):
    for _name in _names:
        _PRE_NAMES[_name] = _pre


def pre_tokenize(text: str, kind: str) -> list[str]:
    """Split ``text`` into the words llama.cpp's pre-tokenizer ``kind`` makes (not byte-encoded)."""
    t = _Text(text)
    spans: Spans = [(0, len(text))] if text else []
    for stage in _PRE_STAGES[kind]:
        spans = stage(t, spans)
    return [text[a:b] for a, b in spans]


# ---------------------------------------------------------------------------------------------
# Merge loops
# ---------------------------------------------------------------------------------------------


def _merge_symbols(
    symbols: list[str], pair_priority: Callable[[str, str], float | None]
) -> list[str]:
    """Merge adjacent symbols by priority (smaller first, leftmost on ties) until none applies.

    A priority queue with lazy deletion, as llama-vocab.cpp's llm_tokenizer_{bpe,spm}_session:
    an entry is stale when either side was merged away or changed since it was queued.
    """
    n = len(symbols)
    if n < 2:
        return symbols
    text = list(symbols)
    nxt = list(range(1, n)) + [-1]
    prv = list(range(-1, n - 1))
    queue: list[tuple[float, int, int, str, str]] = []

    def push(left: int, right: int) -> None:
        if left < 0 or right < 0:
            return
        priority = pair_priority(text[left], text[right])
        if priority is not None:
            heapq.heappush(queue, (priority, left, right, text[left], text[right]))

    for i in range(n - 1):
        push(i, i + 1)
    while queue:
        _, left, right, left_text, right_text = heapq.heappop(queue)
        if (
            not text[left]
            or not text[right]
            or text[left] != left_text
            or text[right] != right_text
            or nxt[left] != right
        ):
            continue
        text[left] = left_text + right_text
        text[right] = ""
        nxt[left] = nxt[right]
        if nxt[right] >= 0:
            prv[nxt[right]] = left
        push(prv[left], left)
        push(left, nxt[left])
    return [s for s in text if s]


# ---------------------------------------------------------------------------------------------
# The tokenizer
# ---------------------------------------------------------------------------------------------

_EOT_NAMES = (
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "<｜end▁of▁sentence｜>",
    "<end_of_utterance>",
)
_EOG_NAMES = frozenset(
    _EOT_NAMES
    + (
        "<|return|>",
        "<|call|>",
        "<|flush|>",
        "<|calls|>",
        "</s>",
        "<|eom_id|>",
        "[EOS]",
        "<eos>",
        "<turn|>",
        "<|tool_response>",
        "[e~[",
    )
)
_FIM_NAMES = {
    "fim_pre": (
        "<|fim_prefix|>",
        "<fim-prefix>",
        "<fim_prefix>",
        "<｜fim▁begin｜>",
        "<PRE>",
        "▁<PRE>",
        "<|code_prefix|>",
        "<|prefix|>",
    ),
    "fim_suf": (
        "<|fim_suffix|>",
        "<fim-suffix>",
        "<fim_suffix>",
        "<｜fim▁hole｜>",
        "<SUF>",
        "▁<SUF>",
        "<|code_suffix|>",
        "<|suffix|>",
    ),
    "fim_mid": (
        "<|fim_middle|>",
        "<fim-middle>",
        "<fim_middle>",
        "<｜fim▁end｜>",
        "<MID>",
        "▁<MID>",
        "<|code_middle|>",
        "<|middle|>",
    ),
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}
# GGUF key suffix -> special role (tokenizer.ggml.<key>); later keys of a role override earlier.
_SPECIAL_KEYS = (
    ("bos_token_id", "bos"),
    ("eos_token_id", "eos"),
    ("eot_token_id", "eot"),
    ("eom_token_id", "eom"),
    ("unknown_token_id", "unk"),
    ("seperator_token_id", "sep"),
    ("padding_token_id", "pad"),
    ("mask_token_id", "mask"),
    ("fim_pre_token_id", "fim_pre"),
    ("fim_suf_token_id", "fim_suf"),
    ("fim_mid_token_id", "fim_mid"),
    ("fim_pad_token_id", "fim_pad"),
    ("fim_rep_token_id", "fim_rep"),
    ("fim_sep_token_id", "fim_sep"),
    ("prefix_token_id", "fim_pre"),
    ("suffix_token_id", "fim_suf"),
    ("middle_token_id", "fim_mid"),
)


def _array(value: object) -> list[Any]:
    """A metadata array's items (none where the key is absent)."""
    return list(value) if isinstance(value, (list, tuple)) else []


def _read_fields(source: str | os.PathLike[str] | object, keys: Iterable[str]) -> dict[str, object]:
    """The named metadata values of a GGUF (``gguf_file.metadata``), a file it cannot read
    refused as a TokenizerError."""
    try:
        return metadata(source, keys)
    except GGUFError as err:
        raise TokenizerError(str(err)) from None


@dataclass
class Tokenizer:
    """llama.cpp's tokenizer for one GGUF vocabulary (BPE or SentencePiece)."""

    model: str  # "gpt2" (byte-level BPE), "llama" (SentencePiece) or "bert" (WordPiece)
    tokens: list[str] = field(repr=False)
    token_types: list[int] = field(repr=False)
    scores: list[float] = field(repr=False)
    merges: list[str] = field(repr=False)
    pre: str = "default"
    special: dict[str, int | None] = field(default_factory=dict, repr=False)
    add_bos: bool = False
    add_eos: bool = False
    add_space_prefix: bool = False
    clean_spaces: bool = False
    ignore_merges: bool = False  # llama3: a word that is a token is taken whole
    lowercase: bool = False  # WordPiece: tokenizer.ggml.normalizer.lowercase
    strip_accents: bool = False  # WordPiece: .strip_accents (default: as lowercase)

    def __post_init__(self) -> None:
        self._build_vocab()
        self._word_cache: dict[str, tuple[int, ...]] = {}

    # -- loading --------------------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, source: str | os.PathLike[str] | object) -> Tokenizer:
        """Read the vocabulary of a GGUF file (or an open ``gguf.GGUFReader``)."""
        prefix = "tokenizer.ggml."
        keys = [
            prefix + k
            for k in (
                "model",
                "pre",
                "tokens",
                "token_type",
                "scores",
                "merges",
                "add_bos_token",
                "add_eos_token",
                "add_space_prefix",
                "normalizer.lowercase",
                "normalizer.strip_accents",
            )
        ]
        keys += [prefix + k for k, _ in _SPECIAL_KEYS]
        values = _read_fields(source, keys)
        model = values.get(prefix + "model")
        if model not in ("gpt2", "llama", "bert"):
            raise TokenizerError(
                f"unsupported tokenizer model {model!r} (supported: 'gpt2' BPE, 'llama' "
                "SentencePiece, 'bert' WordPiece)"
            )
        tokens = values.get(prefix + "tokens")
        if not isinstance(tokens, list) or not tokens:
            raise TokenizerError("the GGUF has no tokenizer.ggml.tokens")
        n_vocab = len(tokens)
        token_types = list(_array(values.get(prefix + "token_type")) or [1] * n_vocab)
        scores = [float(s) for s in (_array(values.get(prefix + "scores")) or [0.0] * n_vocab)]
        if len(token_types) < n_vocab or len(scores) < n_vocab:
            raise TokenizerError("token_type or scores shorter than the vocabulary")
        merges = list(_array(values.get(prefix + "merges")))
        if model == "gpt2" and not merges:
            raise TokenizerError("cannot find tokenizer merges in model file")

        if model == "gpt2":
            pre_name = values.get(prefix + "pre") or "default"
            pre = _PRE_NAMES.get(str(pre_name))
            if pre is None:
                raise TokenizerError(f"unknown pre-tokenizer type: '{pre_name}'")
            defaults = {"bos": 11, "eos": 11}
            add_bos, clean_spaces, add_space_prefix = pre.add_bos, pre.clean_spaces, False
        elif model == "bert":  # llama-vocab's WPM defaults
            pre = _PreTokenizer("default", clean_spaces=True)
            defaults = {"bos": 101, "unk": 100, "sep": 102, "pad": 0, "mask": 103}
            add_bos, clean_spaces, add_space_prefix = True, True, False
        else:
            pre = _PreTokenizer("default", clean_spaces=False)
            defaults = {"bos": 1, "eos": 2, "unk": 0}
            add_bos, clean_spaces, add_space_prefix = True, False, True
        special: dict[str, int | None] = {role: None for _, role in _SPECIAL_KEYS}
        for role, default in defaults.items():
            special[role] = default if default < n_vocab else None
        for key, role in _SPECIAL_KEYS:
            value = values.get(prefix + key)
            if isinstance(value, int) and 0 <= value < n_vocab:
                special[role] = value
        flag = values.get(prefix + "add_bos_token")
        add_bos = bool(flag) if flag is not None else add_bos
        flag = values.get(prefix + "add_eos_token")
        add_eos = bool(flag) if flag is not None else False
        flag = values.get(prefix + "add_space_prefix")
        add_space_prefix = bool(flag) if flag is not None else add_space_prefix
        lowercase = bool(values.get(prefix + "normalizer.lowercase") or False)
        flag = values.get(prefix + "normalizer.strip_accents")
        strip_accents = bool(flag) if flag is not None else lowercase
        return cls(
            model=model,
            tokens=tokens,
            token_types=token_types[:n_vocab],
            scores=scores[:n_vocab],
            merges=merges,
            pre=pre.kind,
            special=special,
            add_bos=add_bos,
            add_eos=add_eos,
            add_space_prefix=add_space_prefix,
            clean_spaces=clean_spaces,
            ignore_merges=pre.ignore_merges,
            lowercase=lowercase,
            strip_accents=strip_accents,
        )

    def _build_vocab(self) -> None:
        self.tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(self.tokens)]
        self._token_to_id: dict[str, int] = {}
        for i, text in enumerate(self.tokens):
            self._token_to_id[text] = i  # a repeated text maps to its last id, as llama.cpp
        self._attrs = [TYPE_TO_ATTR.get(t, ATTR_UNDEFINED) for t in self.token_types]
        self._ranks: dict[tuple[str, str], int] = {}
        for rank, merge in enumerate(self.merges):
            cut = merge.find(" ", 1)
            left, right = (merge[:cut], merge[cut + 1 :]) if cut >= 0 else ("", "")
            self._ranks.setdefault((left, right), rank)  # std::map::emplace keeps the first
        self._find_special_by_text()
        self._special_cache = sorted(
            (
                i
                for i, a in enumerate(self._attrs)
                if a & (ATTR_CONTROL | ATTR_USER_DEFINED | ATTR_UNKNOWN)
            ),
            key=lambda i: -len(self.tokens[i].encode("utf-8")),
        )
        self._pieces_special = [self._piece(i) for i in range(len(self.tokens))]
        if self.model == "bert":
            self._wpm_ids = {t.encode("utf-8"): i for t, i in self._token_to_id.items()}
            self._max_token_len = max(len(t.encode("utf-8")) for t in self.tokens)

    def _find_special_by_text(self) -> None:
        """llama-vocab's text-based fix-ups: EOT/EOM/FIM ids, EOG set, control overrides."""
        sp = self.special
        for role in ("eot", "eom", *_FIM_NAMES):
            sp.setdefault(role, None)
        names_by_role = {"eot": _EOT_NAMES, "eom": ("<|eom_id|>",), **_FIM_NAMES}
        # llama.cpp walks an unordered_map; when several candidate texts exist, the lowest id wins here
        for role, names in names_by_role.items():
            if sp[role] is not None:
                continue
            found = [self._token_to_id[n] for n in names if n in self._token_to_id]
            if found:
                first = sp[role] = min(found)
                self._attrs[first] |= ATTR_CONTROL
        for i, text in enumerate(self.tokens):  # control tokens named "unused" are unused
            if self._attrs[i] & ATTR_CONTROL and "unused" in text:
                self._attrs[i] |= ATTR_UNUSED
        fims = ("fim_pad", "fim_rep", "fim_sep")
        eog: set[int] = {tid for r in fims if (tid := sp[r]) is not None}
        for text, i in self._token_to_id.items():
            if text in _EOG_NAMES:
                eog.add(i)
                self._attrs[i] |= ATTR_CONTROL
        for text in ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"):
            if text in self._token_to_id:
                self._attrs[self._token_to_id[text]] = ATTR_USER_DEFINED
        eog.update(tid for r in ("eos", "eot", "eom") if (tid := sp[r]) is not None)
        texts = {self.tokens[i]: i for i in eog}
        if "<|end|>" in texts and (
            ("<|return|>" in texts and ("<|call|>" in texts or "<|calls|>" in texts))
            or (("<|call|>" in texts or "<|calls|>" in texts) and "<|flush|>" in texts)
        ):
            eog.discard(texts["<|end|>"])
            self._attrs[texts["<|end|>"]] = ATTR_USER_DEFINED
        if "</s>" in texts and ("<|tool_response>" in texts or "<|plamo:eos|>" in texts):
            eog.discard(texts["</s>"])
            self._attrs[texts["</s>"]] = ATTR_NORMAL
        self._eog = frozenset(eog)

    # -- properties -------------------------------------------------------------------------------

    @property
    def n_vocab(self) -> int:
        return len(self.tokens)

    @property
    def bos_id(self) -> int | None:
        return self.special.get("bos")

    @property
    def eos_id(self) -> int | None:
        return self.special.get("eos")

    @property
    def eog_ids(self) -> frozenset[int]:
        return self._eog

    def token_attr(self, token_id: int) -> int:
        """llama_token_attr bits of a token, after llama-vocab's overrides."""
        return self._attrs[token_id]

    def is_control(self, token_id: int) -> bool:
        return bool(self._attrs[token_id] & ATTR_CONTROL)

    # -- tokenize ---------------------------------------------------------------------------------

    def tokenize(
        self, text: str, add_special: bool = False, parse_special: bool = False
    ) -> list[int]:
        """llama_tokenize(text, add_special, parse_special)."""
        fragments: list[str | int] = self._partition(text, parse_special) if text else []
        out: list[int] = []
        if add_special and self.add_bos:
            if self.bos_id is None:
                raise TokenizerError("the model adds BOS but has no BOS token")
            out.append(self.bos_id)
        if self.model == "bert":
            if add_special and not self.add_bos:  # WPM adds [CLS] whatever add_bos says
                if self.bos_id is None:
                    raise TokenizerError("the model adds BOS but has no BOS token")
                out.append(self.bos_id)
            for fragment in fragments:
                if isinstance(fragment, int):
                    out.append(fragment)
                else:
                    for word in wpm_words(fragment, self.lowercase, self.strip_accents):
                        out.extend(self._wpm_word(word))
            if add_special:  # and [SEP] last, whatever add_eos says
                sep = self.special.get("sep")
                if sep is None:
                    raise TokenizerError("the model adds a separator but has none")
                out.append(sep)
            return out
        if self.model == "llama":
            self._tokenize_spm(fragments, out)
        else:
            for fragment in fragments:
                if isinstance(fragment, int):
                    out.append(fragment)
                else:
                    for word in pre_tokenize(fragment, self.pre):
                        out.extend(self._bpe_word(byte_encode(word)))
        if add_special and self.add_eos:
            if self.eos_id is None:
                raise TokenizerError("the model adds EOS but has no EOS token")
            out.append(self.eos_id)
        return out

    def _partition(self, text: str, parse_special: bool) -> list[str | int]:
        """Cut special-token texts out, longest first (tokenizer_st_partition)."""
        fragments: list[str | int] = [text]
        for token_id in self._special_cache:
            if not parse_special and self._attrs[token_id] & (ATTR_CONTROL | ATTR_UNKNOWN):
                continue
            needle = self.tokens[token_id]
            if not any(isinstance(f, str) and needle in f for f in fragments):
                continue
            split: list[str | int] = []
            for fragment in fragments:
                if isinstance(fragment, int) or needle not in fragment:
                    split.append(fragment)
                    continue
                parts = fragment.split(needle)
                for k, part in enumerate(parts):
                    if k:
                        split.append(token_id)
                    if part:
                        split.append(part)
            fragments = split
        return fragments

    def _bpe_word(self, word: str) -> tuple[int, ...]:
        cached = self._word_cache.get(word)
        if cached is not None:
            return cached
        vocab = self._token_to_id
        if self.ignore_merges and word in vocab:
            ids: tuple[int, ...] = (vocab[word],)
        else:
            ranks = self._ranks
            symbols = _merge_symbols(list(word), lambda a, b: ranks.get((a, b)))
            result: list[int] = []
            for symbol in symbols:
                token_id = vocab.get(symbol)
                if token_id is not None:
                    result.append(token_id)
                    continue
                for byte in symbol.encode(
                    "utf-8"
                ):  # no token: single-byte texts only, else dropped
                    single = vocab.get(chr(byte)) if byte < 0x80 else None
                    if single is not None:
                        result.append(single)
            ids = tuple(result)
        if len(self._word_cache) > 200_000:
            self._word_cache.clear()
        self._word_cache[word] = ids
        return ids

    def _wpm_word(self, word: str) -> tuple[int, ...]:
        """llm_tokenizer_wpm_session: the longest entries from the left over the bytes of
        U+2581 + word; the unknown token when some byte cannot be covered."""
        cached = self._word_cache.get(word)
        if cached is not None:
            return cached
        data = (SPM_SPACE + word).encode("utf-8")
        n, vocab, longest = len(data), self._wpm_ids, self._max_token_len
        ids: list[int] = []
        i = 0
        while i < n:
            for j in range(min(n, i + longest + 1), i, -1):
                token_id = vocab.get(data[i:j])
                if token_id is not None:
                    ids.append(token_id)
                    i = j
                    break
            else:
                ids = []
                break
        if not ids:
            unk = self.special.get("unk")
            if unk is None:
                raise TokenizerError("a word outside the vocabulary and no unknown token")
            ids = [unk]
        result = tuple(ids)
        if len(self._word_cache) > 200_000:
            self._word_cache.clear()
        self._word_cache[word] = result
        return result

    def _tokenize_spm(self, fragments: list[str | int], out: list[int]) -> None:
        prev_special = True
        for fragment in fragments:
            if isinstance(fragment, int):
                out.append(fragment)
                prev_special = True
                continue
            text = (" " if self.add_space_prefix and prev_special else "") + fragment
            out.extend(self._spm_text(text.replace(" ", SPM_SPACE)))
            prev_special = False

    def _spm_text(self, text: str) -> list[int]:
        vocab, scores = self._token_to_id, self.scores

        def priority(a: str, b: str) -> float | None:
            token_id = vocab.get(a + b)
            return None if token_id is None else -scores[token_id]

        out: list[int] = []
        for symbol in _merge_symbols(list(text), priority):
            token_id = vocab.get(symbol)
            if token_id is not None:
                out.append(token_id)
            else:
                out.extend(self._byte_token(b) for b in symbol.encode("utf-8"))
        return out

    def _byte_token(self, byte: int) -> int:
        token_id = self._token_to_id.get(f"<0x{byte:02X}>")
        if token_id is None and byte < 0x80:
            token_id = self._token_to_id.get(chr(byte))
        if token_id is None:
            raise TokenizerError(f"the vocabulary has no token for byte 0x{byte:02X}")
        return token_id

    # -- detokenize -------------------------------------------------------------------------------

    def _piece(self, token_id: int) -> bytes:
        """llama_token_to_piece(special=true) of one token."""
        attr = self._attrs[token_id]
        text = self.tokens[token_id]
        if attr & (ATTR_UNKNOWN | ATTR_CONTROL | ATTR_USER_DEFINED):
            return text.encode("utf-8")
        if attr & ATTR_NORMAL:
            if self.model in ("llama", "bert"):
                return text.replace(SPM_SPACE, " ").encode("utf-8")
            return self._decode_bpe_text(text)
        if attr & ATTR_BYTE:
            return (
                bytes((int(text[3:5], 16),))
                if self.model == "llama" or text.startswith("<0x")
                else b""
            )
        return b""

    @staticmethod
    def _decode_bpe_text(text: str) -> bytes:
        out = bytearray()
        for ch in text:
            byte = UNICODE_TO_BYTE.get(ch)
            if byte is not None:
                out.append(byte)
            else:  # llama_decode_text's marker for a character outside the byte map
                out += (
                    b"[UNK_BYTE_0x"
                    + ch.encode("utf-8").hex().encode()
                    + text.encode("utf-8")
                    + b"]"
                )
        return bytes(out)

    def token_to_piece(self, token_id: int, special: bool) -> bytes:
        """llama_token_to_piece: the token's bytes; control and unknown tokens only if ``special``."""
        if not 0 <= token_id < len(self.tokens):
            raise IndexError(f"token id {token_id} out of range [0, {len(self.tokens)})")
        if not special and self._attrs[token_id] & (ATTR_UNKNOWN | ATTR_CONTROL):
            return b""
        return self._pieces_special[token_id]

    def pieces_bytes(self, ids: Sequence[int], special: bool = True) -> bytes:
        """The tokens' pieces joined, as llama-server's /detokenize (special=True) and its
        streamed completion text (special=False) build them."""
        return b"".join(self.token_to_piece(i, special) for i in ids)

    def detokenize_bytes(
        self, ids: Sequence[int], remove_special: bool = False, unparse_special: bool = False
    ) -> bytes:
        """llama_detokenize: pieces joined, optional BOS/EOS removal, leading-space strip, cleanup."""
        ids = list(ids)
        remove_space = self.add_space_prefix
        if remove_special and self.add_bos and ids and ids[0] == self.bos_id:
            remove_space = False
            ids = ids[1:]
        if remove_special and self.add_eos and ids and ids[-1] == self.eos_id:
            ids = ids[:-1]
        parts = []
        for k, token_id in enumerate(ids):
            piece = self.token_to_piece(token_id, unparse_special)
            if k == 0 and remove_space and piece.startswith(b" "):
                piece = piece[1:]
            parts.append(piece)
        text = b"".join(parts)
        return _clean_spaces(text) if self.clean_spaces else text

    def detokenize(
        self, ids: Sequence[int], remove_special: bool = False, unparse_special: bool = False
    ) -> str:
        """llama_detokenize as text (invalid UTF-8 replaced by U+FFFD)."""
        return self.detokenize_bytes(ids, remove_special, unparse_special).decode(
            "utf-8", "replace"
        )

    def vocab_bytes(self) -> list[bytes]:
        """Every token's bytes (token_to_piece with special=true), for the grammar engine."""
        return list(self._pieces_special)


# llm_tokenizer_wpm_session::is_chinese_char (0x2B920: the Hugging Face value, not 0x2B820)
_CJK = (
    (0x04E00, 0x09FFF),
    (0x03400, 0x04DBF),
    (0x20000, 0x2A6DF),
    (0x2A700, 0x2B73F),
    (0x2B740, 0x2B81F),
    (0x2B920, 0x2CEAF),
    (0x0F900, 0x0FAFF),
    (0x2F800, 0x2FA1F),
)


def _simple_lower(ch: str) -> str:
    """unicode_tolower: UnicodeData's one-code-point lowercase mapping."""
    low = ch.lower()
    if len(low) == 1:
        return low
    return "i" if ch == "\u0130" else ch  # the one full mapping longer than its simple one


def _nfd_first(ch: str) -> str:
    """unicode_cpts_normalize_nfd: each code point becomes the first of its NFD."""
    return unicodedata.normalize("NFD", ch)[0]


def wpm_words(text: str, lowercase: bool, strip_accents: bool) -> list[str]:
    """llm_tokenizer_wpm_session::preprocess: the words of ``text``."""
    words: list[str] = []
    word: list[str] = []
    for ch in text:
        if strip_accents:
            ch = _nfd_first(ch)
        cpt = ord(ch)
        if ch in _WHITESPACE:
            if word:
                words.append("".join(word))
                word = []
            continue
        cls = _CLASS[cpt]
        if cpt == 0 or cpt == 0xFFFD or cls == _OTHER:
            continue
        if strip_accents and cls == _MARK:
            continue
        s = _simple_lower(ch) if lowercase else ch
        if (
            cls == _PUNCT
            or (cpt < 0x7F and cls == _SYMBOL)
            or any(lo <= cpt <= hi for lo, hi in _CJK)
        ):
            if word:
                words.append("".join(word))
                word = []
            words.append(s)
        else:
            word.append(s)
    if word:
        words.append("".join(word))
    return words


def _clean_spaces(text: bytes) -> bytes:
    """llama_detokenize's clean_up_tokenization_spaces, ported literally: the three passes
    compact the buffer in place, and the second one blanks a byte ahead of its cursor."""
    buf = bytearray(text)
    total = len(buf)

    # pass 1: " ?", " !", " .", " ,"
    size, written = total, (1 if total else 0)
    for i in range(1, size):
        x = buf[i]
        if buf[i - 1] == 0x20 and x in b"?!.,":
            written -= 1
        buf[written] = x
        written += 1
    # pass 2: " ' " -> "'"
    size, written = written, (1 if written else 0)
    i = 1
    while i < size:
        x = buf[i]
        if x == 0x27 and i + 1 < size and buf[i - 1] == 0x20 and buf[i + 1] == 0x20:
            written -= 1
            i += 1
            buf[i] = 0
        buf[written] = x
        written += 1
        i += 1
    # pass 3: " 's", " 'm", " 're", " 've" lose the space
    size, written = written, (1 if written else 0)
    for i in range(1, size):
        x = buf[i]
        if buf[i - 1] == 0x20 and x == 0x27 and i + 1 < size:
            x1 = buf[i + 1]
            if x1 in b"sm" or (i + 2 < size and (x1, buf[i + 2]) in ((0x72, 0x65), (0x76, 0x65))):
                written -= 1
        buf[written] = x
        written += 1
    return bytes(buf[:written])
