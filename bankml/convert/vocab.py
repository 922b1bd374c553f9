"""A model's tokenizer as llama.cpp's converter writes it: SentencePiece or byte-level BPE.

A directory with ``tokenizer.model`` is SentencePiece: its pieces, scores and types are read from
the ``ModelProto`` protobuf directly, then ``added_tokens.json`` and ``tokenizer_config.json``'s
``added_tokens_decoder`` laid over them, as the reference does. Otherwise ``tokenizer.json`` must
be a byte-level BPE: the token list and types come from its vocabulary and added tokens; the
pre-tokenizer name is found as the reference finds it, by hashing the ids the tokenizer gives a
fixed check text (bankml's own llama.cpp tokenizer stands in for Hugging Face's: each
pre-tokenizer it knows is tried, and a hash the reference's table knows names the
pre-tokenizer). The merges, special token ids, add-BOS/EOS flags and chat template follow the
reference's rules for ``tokenizer.json``, ``tokenizer_config.json`` and ``config.json``. A
byte-fallback BPE (Llama 2 style ``tokenizer.json`` without ``tokenizer.model``), or a
pre-tokenizer whose hash the table does not hold, is refused.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from bankml.convert.errors import ConvertError
from bankml.convert.prehash import CHECK_TEXT, PRE_BY_HASH

TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED = 1, 3, 4, 5
SPECIAL_TYPES = ("bos", "eos", "unk", "sep", "pad", "cls", "mask")
# bankml's tokenizer: its pre-tokenizer kinds, each with and without ignore_merges
_KINDS = ("default", "gpt2", "llama3", "qwen2", "smollm")


def read_json(path: str, what: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except OSError as err:
        raise ConvertError(f"cannot read {what}: {err.strerror or err}") from None
    except (ValueError, RecursionError) as err:
        raise ConvertError(f"{what} is not JSON ({err})") from None


@dataclass
class Vocab:
    tokens: list[str] | list[bytes]
    types: list[int]
    pre: str
    merges: list[str]
    model: str = "gpt2"  # "llama": SentencePiece, with scores
    scores: list[float] | None = None
    special_ids: dict[str, int] = field(default_factory=dict)
    add_special: dict[str, bool] = field(default_factory=dict)
    chat_template: str | list[dict[str, str]] | None = None
    lowercase: bool | None = None
    strip_accents: bool | None = None
    add_space_prefix: bool | None = None
    n_real: int = 0  # tokenizer.json's vocabulary plus its added tokens (Gemma 3 trims to it)


def _looks_special(token: str) -> bool:
    return (
        token in ("<pad>", "<mask>", "<2mass>", "[@BOS@]")
        or (token.startswith("<|") and token.endswith("|>"))
        or (token.startswith("<｜") and token.endswith("｜>"))
        or (token.startswith("<unused") and token.endswith(">"))
    )


def _merges(model: dict[str, Any]) -> list[str]:
    merges = model.get("merges")
    if not isinstance(merges, list) or not merges:
        return []
    if all(isinstance(m, str) for m in merges):
        return list(merges)
    if all(
        isinstance(m, list) and len(m) == 2 and all(isinstance(s, str) for s in m) for m in merges
    ):
        # the pair form: a space inside a part is written as U+0120 (space + 256)
        return [
            " ".join("".join(chr(ord(c) + 256) if c == " " else c for c in part) for part in m)
            for m in merges
        ]
    raise ConvertError("tokenizer.json: unknown merges format")


def _post_ids(tokenizer: dict[str, Any]) -> tuple[list[int], list[int]]:
    """The ids Hugging Face's post-processor puts before and after one sequence."""
    post = tokenizer.get("post_processor") or {}
    before: list[int] = []
    after: list[int] = []
    for p in post.get("processors", [post]) if isinstance(post, dict) else []:
        kind = p.get("type")
        if kind == "TemplateProcessing":
            single = p.get("single") or []
            specials = p.get("special_tokens") or {}
            seen_seq = False
            for piece in single:
                if "Sequence" in piece:
                    seen_seq = True
                elif "SpecialToken" in piece:
                    ids = (specials.get(piece["SpecialToken"].get("id")) or {}).get("ids") or []
                    (after if seen_seq else before).extend(ids)
        elif kind in ("RobertaProcessing", "BertProcessing"):
            before.append(int(p["cls"][1]))
            after.append(int(p["sep"][1]))
        elif kind not in ("ByteLevel", None):
            raise ConvertError(f"tokenizer.json: post-processor {kind} is not known to bankml")
    return before, after


def _pre_name(tokens: list[str], types: list[int], merges: list[str], tokenizer: dict) -> str:
    from bankml.engine_cupy.tokenizer import _SPECIAL_KEYS, Tokenizer, TokenizerError

    before, after = _post_ids(tokenizer)
    tried: list[str] = []
    first = bool((tokenizer.get("model") or {}).get("ignore_merges"))
    for ignore in (first, not first):  # tokenizer.json's own setting first
        try:
            t = Tokenizer(
                model="gpt2",
                tokens=list(tokens),
                token_types=list(types),
                scores=[0.0] * len(tokens),
                merges=merges,
                special={role: None for _, role in _SPECIAL_KEYS},
                ignore_merges=ignore,
            )
        except (TokenizerError, KeyError, IndexError):
            continue
        for kind in _KINDS:
            t.pre = kind  # a word's merges do not depend on the pre-tokenizer: one vocabulary
            try:
                ids = before + t.tokenize(CHECK_TEXT) + after
            except (TokenizerError, KeyError, IndexError):
                continue
            digest = hashlib.sha256(str(ids).encode()).hexdigest()
            if digest in PRE_BY_HASH:
                return PRE_BY_HASH[digest]
            tried.append(digest)
    raise ConvertError(
        "tokenizer: its pre-tokenizer is not one llama.cpp build 11434 knows (check-text hash "
        f"{tried[0] if tried else 'unknown'}): not converted"
    )


def _varint(data: bytes, at: int) -> tuple[int, int]:
    shift = value = 0
    while True:
        if at >= len(data) or shift > 63:
            raise ConvertError("tokenizer.model: a truncated or malformed protobuf")
        b = data[at]
        at += 1
        value |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return value, at


def _fields(data: bytes) -> list[tuple[int, int, Any]]:
    """A protobuf message's (field number, wire type, value) in order."""
    out: list[tuple[int, int, Any]] = []
    at = 0
    while at < len(data):
        key, at = _varint(data, at)
        number, wire = key >> 3, key & 7
        value: int | bytes
        if wire == 0:
            value, at = _varint(data, at)
        elif wire == 1:
            value, at = data[at : at + 8], at + 8
        elif wire == 2:
            n, at = _varint(data, at)
            value, at = data[at : at + n], at + n
        elif wire == 5:
            value, at = data[at : at + 4], at + 4
        else:
            raise ConvertError(f"tokenizer.model: protobuf wire type {wire} is not SentencePiece's")
        if at > len(data):
            raise ConvertError("tokenizer.model: a truncated protobuf")
        out.append((number, wire, value))
    return out


SPM_NORMAL, SPM_UNKNOWN, SPM_CONTROL, SPM_USER_DEFINED, SPM_UNUSED, SPM_BYTE = 1, 2, 3, 4, 5, 6


def read_sentencepiece(path: str) -> list[tuple[bytes, float, int]]:
    """(piece, score, type) of each piece of a SentencePiece ``ModelProto``, by id."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as err:
        raise ConvertError(f"cannot read tokenizer.model: {err.strerror or err}") from None
    pieces: list[tuple[bytes, float, int]] = []
    for number, wire, value in _fields(data):
        if number != 1 or wire != 2:
            continue
        piece, score, kind = b"", 0.0, SPM_NORMAL
        for n, w, v in _fields(value):
            if n == 1 and w == 2:
                piece = v
            elif n == 2 and w == 5:
                score = float(np.frombuffer(v, dtype="<f4")[0])
            elif n == 3 and w == 0:
                kind = v
        pieces.append((piece, score, kind))
    if not pieces:
        raise ConvertError("tokenizer.model: no pieces (not a SentencePiece model)")
    return pieces


def load_spm_vocab(directory: str, vocab_size: int | None) -> Vocab:
    """The reference's SentencePiece vocabulary (tokens as bytes, scores, types)."""
    pieces = read_sentencepiece(os.path.join(directory, "tokenizer.model"))
    n = vocab_size or len(pieces)
    tokens: list[bytes] = [f"[PAD{i}]".encode() for i in range(n)]
    scores = [-10000.0] * n
    types = [SPM_UNUSED] * n
    for i, (piece, score, kind) in enumerate(pieces[:n]):
        tokens[i] = piece
        scores[i] = score
        types[i] = kind if kind in (SPM_UNKNOWN, SPM_CONTROL, SPM_UNUSED, SPM_BYTE) else SPM_NORMAL
    added_path = os.path.join(directory, "added_tokens.json")
    if os.path.isfile(added_path):
        added = read_json(added_path, "added_tokens.json")
        for key, tid in added.items() if isinstance(added, dict) else []:
            if isinstance(tid, int) and 0 <= tid < n:
                tokens[tid] = key.encode("utf-8")
                scores[tid] = -1000.0
                types[tid] = SPM_USER_DEFINED
    config_path = os.path.join(directory, "tokenizer_config.json")
    tok_config = (
        read_json(config_path, "tokenizer_config.json") if os.path.isfile(config_path) else None
    )
    if isinstance(tok_config, dict):
        for key, data in (tok_config.get("added_tokens_decoder") or {}).items():
            tid = int(key)
            if tid >= n or not isinstance(data, dict):
                continue
            token = str(data["content"])
            if data.get("special") or _looks_special(token):
                types[tid] = SPM_CONTROL
            else:
                token = token.replace("\u2581", " ")
                types[tid] = SPM_USER_DEFINED
            scores[tid] = -1000.0
            tokens[tid] = token.encode("utf-8")
    out = Vocab(tokens=tokens, types=types, pre="default", merges=[], model="llama", scores=scores)
    out.n_real = len(tokens)
    tok_path = os.path.join(directory, "tokenizer.json")
    tokenizer = read_json(tok_path, "tokenizer.json") if os.path.isfile(tok_path) else {}
    _special_vocab(
        out,
        directory,
        tokenizer if isinstance(tokenizer, dict) else {},
        tok_config if isinstance(tok_config, dict) else None,
        len(tokens),
    )
    return out


def load_vocab(
    directory: str, vocab_size: int | None, add_space_prefix_key: bool, wordpiece: bool = False
) -> Vocab:
    """The vocabulary in ``directory``: SentencePiece when it has ``tokenizer.model``, else a
    GPT-2-style BPE ``tokenizer.json``, or for BERT (``wordpiece``) a WordPiece
    ``tokenizer.json``; ConvertError otherwise."""
    if not wordpiece and os.path.isfile(os.path.join(directory, "tokenizer.model")):
        out = load_spm_vocab(directory, vocab_size)
        if add_space_prefix_key:
            out.add_space_prefix = _space_prefix(directory)
        return out
    path = os.path.join(directory, "tokenizer.json")
    if not os.path.isfile(path):
        raise ConvertError("tokenizer: no tokenizer.json in the directory")
    tokenizer = read_json(path, "tokenizer.json")
    model = tokenizer.get("model") if isinstance(tokenizer, dict) else None
    kind = model.get("type") if isinstance(model, dict) else None
    if not isinstance(model, dict) or kind != ("WordPiece" if wordpiece else "BPE"):
        raise ConvertError(
            f"tokenizer: a {kind or 'unknown'} tokenizer.json model is not converted"
            + (" for this architecture" if kind in ("BPE", "WordPiece") else "")
        )
    if model.get("byte_fallback"):
        raise ConvertError("tokenizer: a byte-fallback BPE (Llama 2 style) is not converted")
    vocab = model.get("vocab")
    if not isinstance(vocab, dict):
        raise ConvertError("tokenizer.json: model.vocab is not an object")
    config_path = os.path.join(directory, "tokenizer_config.json")
    tok_config = (
        read_json(config_path, "tokenizer_config.json") if os.path.isfile(config_path) else None
    )
    if tok_config is not None and not isinstance(tok_config, dict):
        raise ConvertError("tokenizer_config.json is not a JSON object")

    full: dict[str, int] = {k: v for k, v in vocab.items() if isinstance(v, int)}
    added = [a for a in tokenizer.get("added_tokens") or [] if isinstance(a, dict)]
    added_vocab: dict[str, dict] = {}
    for a in added:
        if isinstance(a.get("content"), str) and isinstance(a.get("id"), int):
            full[a["content"]] = a["id"]
            added_vocab[a["content"]] = a
    if not full:
        raise ConvertError("tokenizer.json: an empty vocabulary")
    n = vocab_size if vocab_size is not None else len(full)
    if max(full.values()) >= n:
        raise ConvertError(
            f"tokenizer: token id {max(full.values())} is outside the model's vocabulary ({n})"
        )
    reverse = {i: t for t, i in full.items()}
    tokens: list[str] = []
    types: list[int] = []
    for i in range(n):
        token = reverse.get(i)
        if token is None:
            tokens.append(f"[PAD{i}]")
            types.append(TOKEN_UNUSED)
            continue
        if token in added_vocab:
            if added_vocab[token].get("special") or _looks_special(token):
                types.append(TOKEN_CONTROL)
            else:
                token = token.replace("\u2581", " ")
                types.append(TOKEN_USER_DEFINED)
        else:
            types.append(TOKEN_NORMAL)
        tokens.append(token)
    if wordpiece:
        return _wordpiece_vocab(tokens, types, directory, tokenizer, tok_config)
    merges = _merges(model)
    pre = _pre_name(tokens, types, merges, tokenizer)
    out = Vocab(tokens=tokens, types=types, pre=pre, merges=merges, n_real=len(vocab) + len(added))
    if add_space_prefix_key:
        out.add_space_prefix = _space_prefix(directory)
    _special_vocab(out, directory, tokenizer, tok_config)
    return out


def _wordpiece_vocab(
    tokens: list[str],
    types: list[int],
    directory: str,
    tokenizer: dict[str, Any],
    tok_config: dict[str, Any] | None,
) -> Vocab:
    """BERT's vocabulary as the reference writes it: every token but the control ones in
    llama.cpp's phantom-space form ("##x" -> "x", else U+2581 in front), its special tokens and
    normalizer flags, and the pre-tokenizer named by the check-text hash of llama.cpp's own
    WordPiece tokenizer (which must give the ids Hugging Face's gives)."""
    from bankml.engine_cupy.tokenizer import _SPECIAL_KEYS, Tokenizer, TokenizerError

    phantom = [
        t if ty == TOKEN_CONTROL else (t[2:] if t.startswith("##") else "\u2581" + t)
        for t, ty in zip(tokens, types)
    ]
    out = Vocab(tokens=phantom, types=types, pre="", merges=[], model="bert", n_real=len(tokens))
    _special_vocab(out, directory, tokenizer, tok_config, len(tokens))
    before, after = _post_ids(tokenizer)
    unk = ((tokenizer.get("model") or {}).get("unk_token")) or "[UNK]"
    special: dict[str, int | None] = {role: None for _, role in _SPECIAL_KEYS}
    special["unk"] = next((i for i, t in enumerate(tokens) if t == unk), None)
    try:
        t = Tokenizer(
            model="bert",
            tokens=list(phantom),
            token_types=list(types),
            scores=[0.0] * len(phantom),
            merges=[],
            special=special,
            lowercase=bool(out.lowercase),
            strip_accents=bool(out.lowercase if out.strip_accents is None else out.strip_accents),
        )
        ids = before + t.tokenize(CHECK_TEXT) + after
    except (TokenizerError, KeyError, IndexError, ValueError) as err:
        raise ConvertError(f"tokenizer: the WordPiece vocabulary cannot be read ({err})") from None
    digest = hashlib.sha256(str(ids).encode()).hexdigest()
    if digest not in PRE_BY_HASH:
        raise ConvertError(
            "tokenizer: its pre-tokenizer is not one llama.cpp build 11434 knows (check-text hash "
            f"{digest}): not converted"
        )
    out.pre = PRE_BY_HASH[digest]
    return out


def _space_prefix(directory: str) -> bool | None:
    """tokenizer_config.json's add_prefix_space, which the reference's Llama writes first."""
    path = os.path.join(directory, "tokenizer_config.json")
    if not os.path.isfile(path):
        return None
    config = read_json(path, "tokenizer_config.json")
    flag = config.get("add_prefix_space") if isinstance(config, dict) else None
    return None if flag is None else bool(flag)


def _set_special(out: Vocab, typ: str, tid: Any, n_vocab: int | None) -> None:
    if not isinstance(tid, int) or isinstance(tid, bool):
        return
    if tid < 0:
        raise ConvertError(f"invalid value for special token type {typ}: {tid}")
    if n_vocab is None or tid < n_vocab:  # an id past the vocabulary is skipped
        out.special_ids.setdefault(typ, tid)


def _normalizer(out: Vocab, normalizer: dict[str, Any]) -> None:
    kind = normalizer.get("type")
    if kind == "Lowercase":
        out.lowercase = True
    elif kind == "StripAccents":
        out.strip_accents = True
    elif kind == "BertNormalizer":
        if "lowercase" in normalizer:
            out.lowercase = normalizer["lowercase"]
        if "strip_accents" in normalizer:
            out.strip_accents = normalizer["strip_accents"]
    elif kind == "Sequence":
        for n in normalizer.get("normalizers", []):
            _normalizer(out, n)


def _special_vocab(
    out: Vocab,
    directory: str,
    tokenizer: dict[str, Any],
    tok_config: dict[str, Any] | None,
    n_vocab: int | None = None,
) -> None:
    """The reference's special-token rules (its SpecialVocab, merges loaded)."""
    types: list[str] = list(SPECIAL_TYPES)
    if normalizer := tokenizer.get("normalizer"):
        _normalizer(out, normalizer)
    added = tokenizer.get("added_tokens") or []
    config = dict(tok_config) if tok_config is not None else None
    bos = (config or {}).get("bos_token")
    cls = (config or {}).get("cls_token")
    eos = (config or {}).get("eos_token")
    sep = (config or {}).get("sep_token")
    if not bos and cls and config:
        config["bos_token"] = bos = cls
    if not eos and sep and config:
        config["eos_token"] = eos = sep
    post = tokenizer.get("post_processor")
    if post:
        for p in post.get("processors", [post]):
            kind = p.get("type")
            if kind == "ByteLevel":
                out.add_special.setdefault("bos", False)
                out.add_special.setdefault("eos", False)
            elif kind == "RobertaProcessing":
                out.add_special.update(bos=True, eos=True, sep=True)
                if not cls and config:
                    cls = config["cls_token"] = p.get("cls", [bos])[0]
                if not sep and config:
                    sep = config["sep_token"] = p.get("sep", [eos])[0]
            elif kind == "TemplateProcessing":
                single = p.get("single", [])
                first = last = None
                if len(single) > 1:
                    if first := single[0].get("SpecialToken", {}).get("id"):
                        if not config:
                            bos = first
                        elif first not in (bos, cls):
                            if not bos:
                                config["bos_token"] = bos = first
                            if not cls:
                                config["cls_token"] = cls = first
                        out.add_special["bos"] = first in (bos, cls)
                    if last := single[-1].get("SpecialToken", {}).get("id"):
                        if not config:
                            eos = last
                        elif last != eos:
                            if "eot" not in types:
                                types.append("eot")
                                config["eot_token"] = eos
                            elif "eom" not in types:
                                types.append("eom")
                                config["eom_token"] = eos
                            config["eos_token"] = eos = last
                        out.add_special["eos"] = last == eos
                pair = p.get("pair", [])
                if pair:
                    start = 1 if first and pair[0].get("SpecialToken", {}).get("id") == first else 0
                    stop = (
                        -1 if last and pair[-1].get("SpecialToken", {}).get("id") == last else None
                    )
                    pair = pair[slice(start, stop)]
                    if pair:
                        a = pair[0].get("Sequence", {}).get("id")
                        b = pair[-1].get("Sequence", {}).get("id")
                        if a == "A" and b == "B" and (middle := pair[1:-1]):
                            add_sep = False
                            if entry := middle[0].get("SpecialToken", {}).get("id"):
                                if entry in (sep, eos) and not last:
                                    add_sep = True
                            if len(middle) == 2:
                                if entry := middle[1].get("SpecialToken", {}).get("id"):
                                    if entry in (sep, eos):
                                        add_sep = True
                            out.add_special["sep"] = add_sep
                            if add_sep and not sep and config:
                                config["sep_token"] = eos
    if config:
        template: Any = None
        jinja = os.path.join(directory, "chat_template.jinja")
        as_json = os.path.join(directory, "chat_template.json")
        if os.path.isfile(jinja):
            with open(jinja, encoding="utf-8") as f:
                template = f.read()
            extra_dir = os.path.join(directory, "additional_chat_templates")
            extras = (
                sorted(e for e in os.listdir(extra_dir) if e.endswith(".jinja"))
                if os.path.isdir(extra_dir)
                else []
            )
            if extras:
                raise ConvertError(
                    "tokenizer: additional_chat_templates are not converted by bankml"
                )
        elif os.path.isfile(as_json):
            template = read_json(as_json, "chat_template.json").get("chat_template")
        template = config.get("chat_template", template)
        if template is None or isinstance(template, (str, list)):
            out.chat_template = template
        for typ in types:
            flag = config.get(f"add_{typ}_token")
            if isinstance(flag, bool) and typ not in out.add_special:
                out.add_special[typ] = flag
            entry = config.get(f"{typ}_token")
            if isinstance(entry, dict):
                entry = entry.get("content")
            if not isinstance(entry, str):
                continue
            tid = next((a.get("id") for a in added if a.get("content") == entry), None)
            _set_special(out, typ, tid, n_vocab)
    config_json = os.path.join(directory, "config.json")
    if os.path.isfile(config_json):
        hf = read_json(config_json, "config.json")
        for typ in types:
            tid = hf.get(f"{typ}_token_id")
            if tid is None and isinstance(hf.get("text_config"), dict):
                tid = hf["text_config"].get(f"{typ}_token_id")
            _set_special(out, typ, tid, n_vocab)
