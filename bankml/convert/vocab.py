"""A Hugging Face byte-level BPE tokenizer (``tokenizer.json``) as llama.cpp's converter writes it.

The token list and types come from ``tokenizer.json``'s vocabulary and added tokens; the
pre-tokenizer name is found as the reference finds it, by hashing the ids the tokenizer gives a
fixed check text (bankml's own llama.cpp tokenizer stands in for Hugging Face's: each
pre-tokenizer it knows is tried, and a hash the reference's table knows names the
pre-tokenizer); the merges, special token ids, add-BOS/EOS flags and chat template follow the
reference's rules for ``tokenizer.json``, ``tokenizer_config.json`` and ``config.json``.
A SentencePiece tokenizer (``tokenizer.model``), a byte-fallback BPE, or a pre-tokenizer whose
hash the table does not hold is refused.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from typing import Any

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
    tokens: list[str]
    types: list[int]
    pre: str
    merges: list[str]
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
    for kind in _KINDS:
        for ignore in (False, True):
            try:
                t = Tokenizer(
                    model="gpt2",
                    tokens=list(tokens),
                    token_types=list(types),
                    scores=[0.0] * len(tokens),
                    merges=merges,
                    pre=kind,
                    special={role: None for _, role in _SPECIAL_KEYS},
                    ignore_merges=ignore,
                )
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


def load_vocab(directory: str, vocab_size: int | None, add_space_prefix_key: bool) -> Vocab:
    """The vocabulary of a GPT-2-style BPE tokenizer in ``directory``; ConvertError otherwise."""
    if os.path.isfile(os.path.join(directory, "tokenizer.model")):
        raise ConvertError(
            "tokenizer: a SentencePiece tokenizer (tokenizer.model) is not converted by bankml"
        )
    path = os.path.join(directory, "tokenizer.json")
    if not os.path.isfile(path):
        raise ConvertError("tokenizer: no tokenizer.json in the directory")
    tokenizer = read_json(path, "tokenizer.json")
    model = tokenizer.get("model") if isinstance(tokenizer, dict) else None
    if not isinstance(model, dict) or model.get("type") != "BPE":
        kind = model.get("type") if isinstance(model, dict) else None
        raise ConvertError(
            f"tokenizer: a {kind or 'unknown'} tokenizer.json model is not converted"
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
    merges = _merges(model)
    pre = _pre_name(tokens, types, merges, tokenizer)
    out = Vocab(tokens=tokens, types=types, pre=pre, merges=merges, n_real=len(vocab) + len(added))
    if add_space_prefix_key and tok_config is not None:
        flag = tok_config.get("add_prefix_space")
        if flag is not None:
            out.add_space_prefix = bool(flag)
    _special_vocab(out, directory, tokenizer, tok_config)
    return out


def _set_special(out: Vocab, typ: str, tid: Any) -> None:
    if not isinstance(tid, int) or isinstance(tid, bool):
        return
    if tid < 0:
        raise ConvertError(f"invalid value for special token type {typ}: {tid}")
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
    out: Vocab, directory: str, tokenizer: dict[str, Any], tok_config: dict[str, Any] | None
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
            _set_special(out, typ, tid)
    config_json = os.path.join(directory, "config.json")
    if os.path.isfile(config_json):
        hf = read_json(config_json, "config.json")
        for typ in types:
            tid = hf.get(f"{typ}_token_id")
            if tid is None and isinstance(hf.get("text_config"), dict):
                tid = hf["text_config"].get(f"{typ}_token_id")
            _set_special(out, typ, tid)
